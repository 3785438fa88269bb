// hex64 of include/mnist_mpi/hash.hpp.
#include "mnist_mpi/hash.hpp"

#include <cstdio>

namespace mnist_mpi {

std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace mnist_mpi
