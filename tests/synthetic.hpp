// Small MNIST-shaped data sets that tests write themselves (never the real MNIST): 28x28 images
// whose class is drawn as a bright bar at a class-dependent place, plus seeded noise, in IDX files.
#pragma once

#include <cstdint>
#include <string>

namespace mnist_mpi::testing {

// Writes the four IDX files (raw) into dir, creating it. Returns dir.
std::string write_synthetic_mnist(const std::string& dir, std::int64_t train_count, std::int64_t test_count,
                                  std::uint64_t seed);
// A fresh directory under the system temp dir, with the same name on every rank of MPI_COMM_WORLD
// (rank 0 picks it and broadcasts it); synthetic data written by rank 0, then a barrier.
std::string shared_synthetic_dir(const std::string& tag, std::int64_t train_count, std::int64_t test_count);

}  // namespace mnist_mpi::testing
