// The passes of --exact-sums over a backend's memory: a chunk's gradient into the 64-bit integers
// the reducer sums, the sums back into float, and the largest magnitudes that choose the next
// step's shifts (Note [Exact sums in fixed point] in include/mnist_mpi/exact_sum.hpp; the engine
// that drives them: include/mnist_mpi/train/exact_sums.hpp). A backend makes them
// (Backend::make_fixed_point_passes): the loops of src/backend/fixed_point.cpp on host memory
// (the CPU), kernels on a GPU (src/backend/cuda/kernels.cu). Both turn the same values into the
// same integers and the same integers into the same floats, bit for bit: the conversions are
// exact or one IEEE rounding to nearest even (Note [Fixed point on a GPU] in kernels.cu).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

namespace mnist_mpi {

// What the summed counters say about a pass (the same on every rank: summed with the integers).
struct FixedPointCounts {
  std::int64_t out_of_range = 0;  // finite values at or beyond their tensor's bound
  std::int64_t nonfinite = 0;     // NaN and inf
};

class FixedPointPasses {
 public:
  virtual ~FixedPointPasses() = default;
  // The integers the reducer sums, in the backend's memory: one per parameter, then the two
  // counters (out of range, non-finite).
  virtual std::span<std::int64_t> integers() = 0;
  virtual void zero_counters() = 0;
  // integers[offset, offset + n) = (assign) or += round(g[i] * scale), rounded to nearest, ties to
  // even; scale = 2^shift with |g[i] * scale| < 2^51 for every |g[i]| < bound. A value with
  // !(|g[i]| < bound) is counted (finite or not) and its integer is left undefined (the pass is
  // then thrown away). The additions wrap around: no overflow is undefined.
  virtual void to_fixed(const float* g, std::int64_t offset, std::int64_t n, double scale, float bound,
                        bool assign) = 0;
  // slots[slot] = max(slots[slot], bits of the largest finite |g[i]|) (NaN and inf count as 0).
  virtual void probe(const float* g, std::int64_t n, std::size_t slot) = 0;
  // g[i] = float(double(integers[offset + i]) * unscale), and slots[slot] = max(slots[slot], bits
  // of the largest |g[i]|) (of inf too, when a sum is beyond float's range).
  virtual void from_fixed(std::int64_t offset, float* g, std::int64_t n, double unscale, std::size_t slot) = 0;
  virtual void fill_nan(float* g, std::int64_t n) = 0;
  // The counters, and (when maxima is not empty: one per slot) the slots, which are then zeroed
  // for the next pass. On a GPU one synchronisation: the host reads what the queue has computed.
  virtual FixedPointCounts read(std::span<std::uint32_t> maxima) = 0;

 protected:
  // Every implementation's check of a range of its `count` integers: Error(kRuntime) outside them.
  static void check_range(std::int64_t count, std::int64_t offset, std::int64_t n);
};

// The passes on host memory (any backend whose buffers are host memory): count parameters, slots
// maxima.
std::unique_ptr<FixedPointPasses> make_host_fixed_point_passes(std::int64_t count, std::size_t slots);

}  // namespace mnist_mpi
