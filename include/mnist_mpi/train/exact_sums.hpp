// --exact-sums: the gradient of the global batch as an exact sum of its chunks' gradients (Note
// [Chunks of the global batch] in include/mnist_mpi/data/sampler.hpp), so that the parameters do
// not depend on the number of ranks. Each rank turns each of its chunks' gradients into 64-bit
// fixed point (Note [Exact sums in fixed point] in include/mnist_mpi/exact_sum.hpp) with one shift
// per parameter tensor, adds them up as integers, the reducer sums the integers over the ranks
// (exact, in any order), and every rank turns the sums it holds back into float once (all of
// them, or with --shard-optimizer its shard of each bucket).
//
// Note [Where the shift comes from]
// The shift of a tensor must be the same on every rank and for every number of ranks, and must be
// known before the first chunk is turned into integers. Taking it from the exact MAX of this
// step's chunks would need every chunk's gradient kept until all are computed (lenet: 13 MB a
// chunk) or computed twice. Instead it is predicted: a tensor's limit is 2^(e + kHeadroomBits),
// where 2^(e-1) <= max|g| < 2^e over the tensor's summed gradient of the previous step, whose
// bits are the same whatever the number of ranks (sharded, each rank takes e over its shard and
// an exact MAX over the ranks gives the tensor's). A chunk value at or beyond the limit
// cannot be represented; such values are counted (as are non-finite ones) in two counters summed
// just after the last bucket, so every rank learns the same counts from the same integers. A step
// with a value out of range is computed again: first a probe pass that takes the exact MAX over
// all chunks of every rank (one allreduce of one integer per tensor), then the step with limits
// from it, which cannot be exceeded. The first step of a run has no previous gradient and is
// probed. Everything that chooses a limit is a function of bits that do not depend on the number
// of ranks, so neither do the limits, the integers or the parameters; the limits of the next step
// are saved in checkpoints, so a resumed run continues with the limits the straight run had.
// Precision: a value is rounded to a multiple of 2^-shift = 2^(limit - b) (b = 51 for up to 2048
// chunks, Note [Exact sums in fixed point]), that is 2^(e - 35): 35 bits below the previous
// step's largest element of the tensor (a float has 24). A tensor whose gradient shrinks by 2^k
// in one step keeps k bits fewer, for that step. A gradient that grows past the headroom costs one
// probe and a second pass (counted: the "final" event's exact_sum_probes).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/fixed_point.hpp"
#include "mnist_mpi/backend/layer.hpp"  // FixedPointSink
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/train/optimizer.hpp"  // ParamRange

namespace mnist_mpi {

// The largest default chunk (--exact-chunk 0): the largest divisor of the global batch up to this.
inline constexpr std::int64_t kDefaultExactChunk = 10;
std::int64_t default_exact_chunk(std::int64_t global_batch);

class ExactSums final : public FixedPointSink {
 public:
  static constexpr int kHeadroomBits = 16;
  static constexpr std::int32_t kUnknown = INT32_MIN;  // no limit yet: the next step is probed

  // chunks: of the global batch (every rank's); the terms of every sum. backend: whose memory
  // holds the gradients and the integers (Backend::make_fixed_point_passes); null: host memory.
  ExactSums(const ModelSpec& spec, std::int64_t chunks, Backend* backend = nullptr);

  // The integers the reducer sums, in the backend's memory: param_count sums, then the
  // out-of-range and non-finite counts.
  std::span<std::int64_t> fixed() { return passes_->integers(); }
  // The counters as they stand (on a GPU a synchronisation; the step reads them from to_float).
  std::int64_t out_of_range() { return passes_->read({}).out_of_range; }
  std::int64_t nonfinite() { return passes_->read({}).nonfinite; }

  bool needs_probe() const { return needs_probe_; }
  void require_probe() { needs_probe_ = true; }
  // A probe pass: begin_probe, probe_chunk for each of this rank's chunks, finish_probe on every rank.
  void begin_probe();
  void probe_chunk(const float* grads);
  void finish_probe(Communicator& comm);

  // A pass: begin_pass, then each chunk's gradients added to the integers, tensor by tensor
  // (absorb_layer as backward finishes each layer of the last chunk, absorb_all for the others).
  void begin_pass();
  void absorb_layer(const float* grads, int layer, bool first_chunk);
  void absorb_all(const float* grads, bool first_chunk);
  // A tensor [offset, offset + size) whose gradient a kernel hands over itself, through
  // absorb_range (Note [A weight gradient written once as integers] in
  // include/mnist_mpi/backend/layer.hpp): probe_chunk and absorb_* leave it alone.
  void take(std::int64_t offset, std::int64_t size);
  void absorb_range(std::int64_t offset, const float* values, std::int64_t n, bool first) override;
  // After the sums: the mean gradient in float over `owned`, the ranges whose sums this rank holds,
  // and the summed counters, read once (one synchronisation on a GPU). A step whose counters are
  // not zero changes no limit: with a non-finite value `owned` is NaN (for the step guard, Note
  // [Non-finite steps]); with one out of range the step is computed again. Otherwise the next
  // step's limits come from the sums. sharded: the communicator over whose ranks `owned` are
  // shards, for the exact MAX that makes the limits those of the whole tensors; null when `owned`
  // covers every element. `waited`: the seconds spent in that collective (waiting for the other
  // ranks, not converting).
  struct Sums {
    FixedPointCounts counts;
    double waited = 0.0;
  };
  Sums to_float(float* grads, std::span<const ParamRange> owned, Communicator* sharded);
  Sums to_float(float* grads) {  // every element
    const ParamRange all{0, count_};
    return to_float(grads, {&all, 1}, nullptr);
  }

  // The limits of the next step, one exponent per tensor (checkpoints); kUnknown: probe.
  const std::vector<std::int32_t>& limits() const { return limit_; }
  void set_limits(std::span<const std::int32_t> limits);
  std::int64_t probes() const { return probes_; }

 private:
  void set_scales(std::size_t t);
  void absorb(const float* grads, std::size_t t, bool first_chunk);
  void absorb_part(std::size_t t, std::int64_t offset, const float* values, std::int64_t n, bool first);

  std::vector<ParamTensor> tensors_;
  std::vector<std::vector<std::size_t>> layer_tensors_;  // tensors of each layer
  std::int64_t count_ = 0, chunks_ = 0;
  std::unique_ptr<FixedPointPasses> passes_;  // the integers (count_ + 2) and a slot per tensor
  std::vector<std::int32_t> limit_;           // per tensor: values must be < 2^limit
  std::vector<double> scale_, unscale_;       // 2^shift and 2^-shift per tensor
  std::vector<float> bound_;                  // 2^limit as a float (inf when beyond float's range)
  std::vector<std::uint32_t> maxima_;         // per tensor: the largest magnitude's bits, read from the passes
  std::vector<std::int64_t> exponent_;        // per tensor: of the probe's or the sums' largest magnitude
  std::vector<char> taken_;                   // per tensor: handed over by a kernel (take)
  bool needs_probe_ = true;
  bool probing_ = false;  // between begin_probe and finish_probe
  std::int64_t probes_ = 0;
};

}  // namespace mnist_mpi
