// all_finite (see include/mnist_mpi/resilience/finite.hpp): a float is NaN or +-inf exactly when its
// 8 exponent bits are all ones; OR-ing a per-element flag over the buffer vectorises (the
// compiler may not reorder a float sum, but it may reorder integer ORs).
#include "mnist_mpi/resilience/finite.hpp"

#include <cstring>

#include "mnist_mpi/cpu_clones.hpp"

namespace mnist_mpi {

// Built for AVX-512, AVX2 and the baseline (Note [One build for every x86-64] in
// include/mnist_mpi/cpu_clones.hpp): the baseline's 4-wide loop took 2 % of a lenet step (the
// guard reads every reduced gradient once a step).
MNIST_MPI_CPU_CLONES
bool all_finite(const float* p, std::int64_t n) {
  constexpr std::uint32_t kExp = 0x7f800000u;
  std::uint32_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    bad |= static_cast<std::uint32_t>((bits & kExp) == kExp);
  }
  return bad == 0;
}

}  // namespace mnist_mpi
