// The passes of --exact-sums on host memory (include/mnist_mpi/backend/fixed_point.hpp).
#include "mnist_mpi/backend/fixed_point.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/cpu_clones.hpp"
#include "mnist_mpi/exact_sum.hpp"
#include "mnist_mpi/range_checked.hpp"

namespace mnist_mpi {
namespace {

// One tensor's chunk gradient into its integers (q = or += its fixed point), counting the values at
// or beyond bound and the non-finite ones. Such a value makes the step's integers worthless (the
// step is computed again, or refused), so the loop does not exclude them one by one: it converts
// everything, adding with wrap-around (no overflow is undefined), and keeps the largest magnitude,
// whose bits order like the values with NaN above inf; only when that reaches the bound are the
// values counted, in a second pass. Branch-free, so that it vectorises (Note [Fixed point without
// a conversion instruction]); per-element counting had cost it a third of its time.
// Under ASan this file is checked by its arrays' ranges (Note [Hot loops checked by their ranges]):
// every pass checks each array it touches.
MNIST_MPI_CPU_CLONES std::uint32_t to_fixed_loop(const float* g, std::int64_t* q, std::int64_t n, double scale,
                                                 bool assign) {
  MNIST_MPI_CHECK_RANGE(g, n, false);
  MNIST_MPI_CHECK_RANGE(q, n, true);
  std::uint32_t m = 0;
  const auto magnitude = [](float x) { return std::bit_cast<std::uint32_t>(x) & 0x7fffffffu; };
  if (assign) {
    for (std::int64_t i = 0; i < n; ++i) {
      q[i] = to_fixed_scaled(g[i], scale);
      m = std::max(m, magnitude(g[i]));
    }
  } else {
    for (std::int64_t i = 0; i < n; ++i) {
      q[i] = static_cast<std::int64_t>(static_cast<std::uint64_t>(q[i]) +
                                       static_cast<std::uint64_t>(to_fixed_scaled(g[i], scale)));
      m = std::max(m, magnitude(g[i]));
    }
  }
  return m;
}

// The summed integers back to float; returns the largest magnitude's bits. The maximum is taken
// over the magnitudes' bits, which order like the values (none is a NaN): std::fmax was a call
// into libm per element (NaN rules), 5 % of a lenet step.
MNIST_MPI_CPU_CLONES std::uint32_t from_fixed_pass(const std::int64_t* q, float* g, std::int64_t n, double unscale) {
  MNIST_MPI_CHECK_RANGE(q, n, false);
  MNIST_MPI_CHECK_RANGE(g, n, true);
  std::uint32_t m = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = from_fixed_scaled(q[i], unscale);
    g[i] = v;
    m = std::max(m, std::bit_cast<std::uint32_t>(v) & 0x7fffffffu);
  }
  return m;
}

class HostPasses final : public FixedPointPasses {
 public:
  HostPasses(std::int64_t count, std::size_t slots)
      : count_(count), q_(static_cast<std::size_t>(count) + 2, 0), slots_(slots, 0) {}
  std::span<std::int64_t> integers() override { return q_; }
  void zero_counters() override { q_[c()] = q_[c() + 1] = 0; }

  void to_fixed(const float* g, std::int64_t offset, std::int64_t n, double scale, float bound, bool assign) override {
    check_range(count_, offset, n);
    if (to_fixed_loop(g, q_.data() + offset, n, scale, assign) < std::bit_cast<std::uint32_t>(bound)) return;
    for (std::int64_t i = 0; i < n; ++i) {
      const float a = std::fabs(g[i]);
      const bool finite = a <= std::numeric_limits<float>::max();
      q_[c()] += !(a < bound) && finite;
      q_[c() + 1] += !finite;  // NaN too
    }
  }

  // The largest finite magnitude, over the bits as from_fixed_pass takes it (std::fmax is a libm
  // call per element): NaN and inf, whose bits are those of inf and above, count as 0.
  void probe(const float* g, std::int64_t n, std::size_t slot) override {
    MNIST_MPI_CHECK_RANGE(g, n, false);
    constexpr std::uint32_t kInf = 0x7f800000u;
    std::uint32_t bits = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint32_t a = std::bit_cast<std::uint32_t>(g[i]) & 0x7fffffffu;
      bits = std::max(bits, a < kInf ? a : 0u);
    }
    slots_.at(slot) = std::max(slots_.at(slot), bits);
  }

  void from_fixed(std::int64_t offset, float* g, std::int64_t n, double unscale, std::size_t slot) override {
    check_range(count_, offset, n);
    slots_.at(slot) = std::max(slots_.at(slot), from_fixed_pass(q_.data() + offset, g, n, unscale));
  }
  void fill_nan(float* g, std::int64_t n) override {
    MNIST_MPI_CHECK_RANGE(g, n, true);
    std::fill(g, g + n, std::numeric_limits<float>::quiet_NaN());
  }

  FixedPointCounts read(std::span<std::uint32_t> maxima) override {
    if (!maxima.empty()) {
      MNIST_CHECK(maxima.size() == slots_.size(), ExitCode::kRuntime, "fixed point: one maximum per slot");
      std::copy(slots_.begin(), slots_.end(), maxima.begin());
      std::fill(slots_.begin(), slots_.end(), 0u);
    }
    return {q_[c()], q_[c() + 1]};
  }

 private:
  std::size_t c() const { return static_cast<std::size_t>(count_); }
  std::int64_t count_;
  std::vector<std::int64_t> q_;       // count_ integers, then the two counters
  std::vector<std::uint32_t> slots_;  // the largest magnitudes' bits
};

}  // namespace

void FixedPointPasses::check_range(std::int64_t count, std::int64_t offset, std::int64_t n) {
  MNIST_CHECK(offset >= 0 && n >= 0 && offset <= count - n, ExitCode::kRuntime,
              "fixed point: [" + std::to_string(offset) + ", +" + std::to_string(n) + ") is outside the " +
                  std::to_string(count) + " integers");
}

std::unique_ptr<FixedPointPasses> make_host_fixed_point_passes(std::int64_t count, std::size_t slots) {
  MNIST_CHECK(count >= 0, ExitCode::kRuntime, "fixed point: a negative count");
  return std::make_unique<HostPasses>(count, slots);
}

}  // namespace mnist_mpi
