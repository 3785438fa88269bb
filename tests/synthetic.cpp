// Writes small learnable MNIST-shaped IDX files for tests (see synthetic.hpp).
#include "synthetic.hpp"

#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "mnist_mpi/rng.hpp"

namespace mnist_mpi::testing {
namespace {

void put_be32(std::ofstream& f, std::uint32_t v) {
  const unsigned char b[4] = {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                              static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)};
  f.write(reinterpret_cast<const char*>(b), 4);
}

void write_split(const std::string& images, const std::string& labels, std::int64_t n, std::uint64_t seed) {
  std::ofstream fi(images, std::ios::binary), fl(labels, std::ios::binary);
  put_be32(fi, 2051);
  put_be32(fi, static_cast<std::uint32_t>(n));
  put_be32(fi, 28);
  put_be32(fi, 28);
  put_be32(fl, 2049);
  put_be32(fl, static_cast<std::uint32_t>(n));
  std::vector<unsigned char> img(28 * 28);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto label = static_cast<int>(rng::key(seed, 1, static_cast<std::uint64_t>(i)) % 10);
    // Class c: a horizontal bar in row band 2 + 2c (even classes) or a vertical bar (odd classes).
    for (int y = 0; y < 28; ++y)
      for (int x = 0; x < 28; ++x) {
        const float noise =
            rng::uniform(rng::key(seed, 2, static_cast<std::uint64_t>(i), static_cast<std::uint64_t>(y * 28 + x)));
        const int band = 3 + 2 * label;
        const bool on = (label % 2 == 0) ? (y >= band && y < band + 3 && x > 3 && x < 24)
                                         : (x >= band && x < band + 3 && y > 3 && y < 24);
        float v = 160.0f * noise + (on ? 60.0f : 0.0f);
        img[static_cast<std::size_t>(y * 28 + x)] = static_cast<unsigned char>(v);
      }
    fi.write(reinterpret_cast<const char*>(img.data()), static_cast<std::streamsize>(img.size()));
    const auto l = static_cast<unsigned char>(label);
    fl.write(reinterpret_cast<const char*>(&l), 1);
  }
}

}  // namespace

std::string write_synthetic_mnist(const std::string& dir, std::int64_t train_count, std::int64_t test_count,
                                  std::uint64_t seed) {
  std::filesystem::create_directories(dir);
  write_split(dir + "/train-images-idx3-ubyte", dir + "/train-labels-idx1-ubyte", train_count, seed);
  write_split(dir + "/t10k-images-idx3-ubyte", dir + "/t10k-labels-idx1-ubyte", test_count, seed + 1000);
  return dir;
}

std::string shared_synthetic_dir(const std::string& tag, std::int64_t train_count, std::int64_t test_count) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  long long pid = rank == 0 ? static_cast<long long>(getpid()) : 0;
  MPI_Bcast(&pid, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("mnist_mpi_" + tag + "_" + std::to_string(pid))).string();
  if (rank == 0) write_synthetic_mnist(dir, train_count, test_count, 7);
  MPI_Barrier(MPI_COMM_WORLD);
  return dir;
}

}  // namespace mnist_mpi::testing
