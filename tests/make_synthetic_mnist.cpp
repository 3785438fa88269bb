// make_synthetic_mnist DIR TRAIN_COUNT TEST_COUNT: writes small learnable IDX files for the
// end-to-end tests (tests/e2e_cli.sh), which then corrupt copies of them.
#include <cstdio>
#include <string>

#include "synthetic.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: make_synthetic_mnist DIR TRAIN_COUNT TEST_COUNT\n");
    return 2;
  }
  mnist_mpi::testing::write_synthetic_mnist(argv[1], std::stoll(argv[2]), std::stoll(argv[3]), 7);
  return 0;
}
