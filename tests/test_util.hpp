// Helpers shared by the test files (one copy, not one per file): this process's place in
// MPI_COMM_WORLD, one verdict agreed by every rank, and reproducible random inputs.
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace mnist_mpi {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// True on every rank when `ok` is true on every rank: multi-rank tests pass or fail together.
inline bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v == 1;
}

// n floats uniform in [lo, hi), the same for the same seed.
inline std::vector<float> uniform(std::size_t n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

// How far b is from a: the norm of a - b over the norm of a; and whether any element differs.
struct Distance {
  double relative = 0.0;
  bool differ = false;
};
inline Distance distance(const float* a, const float* b, std::int64_t n) {
  double norm = 0.0, diff = 0.0;
  bool differ = false;
  for (std::int64_t i = 0; i < n; ++i) {
    norm += static_cast<double>(a[i]) * a[i];
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    differ = differ || a[i] != b[i];
  }
  return {std::sqrt(diff / norm), differ};
}

}  // namespace mnist_mpi
