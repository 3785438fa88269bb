// --exact-sums: chunks' gradients to 64-bit fixed point and back (include/mnist_mpi/train/exact_sums.hpp).
#include "mnist_mpi/train/exact_sums.hpp"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/exact_sum.hpp"

namespace mnist_mpi {
std::int64_t default_exact_chunk(std::int64_t global_batch) {
  for (std::int64_t c = std::min(kDefaultExactChunk, global_batch); c > 1; --c)
    if (global_batch % c == 0) return c;
  return 1;
}

ExactSums::ExactSums(const ModelSpec& spec, std::int64_t chunks, Backend* backend)
    : tensors_(spec.params),
      layer_tensors_(spec.layers.size()),
      count_(spec.param_count),
      chunks_(chunks),
      passes_(backend ? backend->make_fixed_point_passes(spec.param_count, spec.params.size())
                      : make_host_fixed_point_passes(spec.param_count, spec.params.size())),
      limit_(spec.params.size(), kUnknown),
      scale_(spec.params.size(), 1.0),
      unscale_(spec.params.size(), 1.0),
      bound_(spec.params.size(), 0.0f),
      maxima_(spec.params.size(), 0),
      exponent_(spec.params.size(), 0),
      taken_(spec.params.size(), 0) {
  MNIST_CHECK(chunks >= 1 && chunks <= (std::int64_t{1} << 30), ExitCode::kRuntime, "exact sums: 1 to 2^30 chunks");
  for (std::size_t t = 0; t < tensors_.size(); ++t)
    layer_tensors_.at(static_cast<std::size_t>(tensors_[t].layer)).push_back(t);
}

// Note [Exact sums in fixed point]: |q| <= 2^(62 - ceil(log2 chunks)) for |x| < 2^limit.
void ExactSums::set_scales(std::size_t t) {
  const int shift = shift_for_limit(limit_[t], chunks_);
  scale_[t] = std::ldexp(1.0, shift);
  unscale_[t] = std::ldexp(1.0, -shift);
  bound_[t] = limit_[t] >= 128 ? std::numeric_limits<float>::infinity() : std::ldexp(1.0f, limit_[t]);
}

void ExactSums::set_limits(std::span<const std::int32_t> limits) {
  MNIST_CHECK(limits.size() == limit_.size(), ExitCode::kCheckpoint,
              "the checkpoint's exact-sum limits are for " + std::to_string(limits.size()) + " tensors, the model has " +
                  std::to_string(limit_.size()));
  needs_probe_ = false;
  for (std::size_t t = 0; t < limit_.size(); ++t) {
    MNIST_CHECK(limits[t] == kUnknown || (limits[t] > -400 && limits[t] < 400), ExitCode::kCheckpoint,
                "the checkpoint's exact-sum limit of tensor " + tensors_[t].name + " is out of range");
    limit_[t] = limits[t];
    if (limit_[t] == kUnknown)
      needs_probe_ = true;
    else
      set_scales(t);
  }
}

// The slots are zero here: made so, and zeroed by every read(), which ends every probe
// (finish_probe) and every conversion back (to_float), the only passes that write them.
void ExactSums::begin_probe() { probing_ = true; }

void ExactSums::probe_chunk(const float* grads) {
  for (std::size_t t = 0; t < tensors_.size(); ++t)
    if (!taken_[t]) passes_->probe(grads + tensors_[t].offset, tensors_[t].size, t);
}

// The exponent e of the largest finite |x| of every chunk of every rank (max|x| < 2^e). A
// non-finite value has no limit to give: the pass that follows counts it, and the step guard
// refuses the step.
void ExactSums::finish_probe(Communicator& comm) {
  constexpr std::int64_t kNone = -1000;
  passes_->read(maxima_);
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    const float m = std::bit_cast<float>(maxima_[t]);
    int e = 0;
    std::frexp(m, &e);
    exponent_[t] = m > 0.0f ? e : kNone;
  }
  comm.allreduce_max(exponent_);
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    // All zero: any limit holds them; keep a known one, or take 0.
    if (exponent_[t] > kNone)
      limit_[t] = static_cast<std::int32_t>(exponent_[t]);
    else if (limit_[t] == kUnknown)
      limit_[t] = 0;
    set_scales(t);
  }
  needs_probe_ = false;
  probing_ = false;
  ++probes_;
}

void ExactSums::begin_pass() {
  MNIST_CHECK(!needs_probe_ && !probing_, ExitCode::kRuntime, "exact sums: a pass before the limits are known");
  passes_->zero_counters();
}

void ExactSums::absorb_part(std::size_t t, std::int64_t offset, const float* values, std::int64_t n, bool first) {
  passes_->to_fixed(values, offset, n, scale_[t], bound_[t], first);
}

void ExactSums::absorb(const float* grads, std::size_t t, bool first_chunk) {
  const ParamTensor& p = tensors_[t];
  if (!taken_[t]) absorb_part(t, p.offset, grads + p.offset, p.size, first_chunk);
}

void ExactSums::take(std::int64_t offset, std::int64_t size) {
  std::int64_t covered = 0;  // the range must be whole tensors
  for (std::size_t t = 0; t < tensors_.size(); ++t)
    if (tensors_[t].offset >= offset && tensors_[t].offset + tensors_[t].size <= offset + size) {
      taken_[t] = 1;
      covered += tensors_[t].size;
    }
  MNIST_CHECK(covered == size && size > 0, ExitCode::kRuntime,
              "exact sums: [" + std::to_string(offset) + ", " + std::to_string(offset + size) +
                  ") is not a run of whole parameter tensors");
}

void ExactSums::absorb_range(std::int64_t offset, const float* values, std::int64_t n, bool first) {
  std::size_t t = 0;
  while (t < tensors_.size() && !(taken_[t] && offset >= tensors_[t].offset &&
                                  offset + n <= tensors_[t].offset + tensors_[t].size))
    ++t;
  MNIST_CHECK(t < tensors_.size(), ExitCode::kRuntime, "exact sums: a range handed over outside a taken tensor");
  if (probing_)
    passes_->probe(values, n, t);
  else
    absorb_part(t, offset, values, n, first);
}

void ExactSums::absorb_layer(const float* grads, int layer, bool first_chunk) {
  for (const std::size_t t : layer_tensors_.at(static_cast<std::size_t>(layer))) absorb(grads, t, first_chunk);
}

void ExactSums::absorb_all(const float* grads, bool first_chunk) {
  for (std::size_t t = 0; t < tensors_.size(); ++t) absorb(grads, t, first_chunk);
}

ExactSums::Sums ExactSums::to_float(float* grads, std::span<const ParamRange> owned, Communicator* sharded) {
  // Every owned range back to float with its tensor's largest magnitude, then the counters and the
  // magnitudes read at once: on a GPU the one synchronisation of the step's sums. A step whose
  // counters say it is thrown away or refused converted for nothing, which is rare.
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    const ParamTensor& p = tensors_[t];
    for (const ParamRange& r : owned) {
      const std::int64_t begin = std::max(r.begin, p.offset), end = std::min(r.end, p.offset + p.size);
      if (begin < end) passes_->from_fixed(begin, grads + begin, end - begin, unscale_[t], t);
    }
  }
  Sums sums;
  sums.counts = passes_->read(maxima_);
  if (sums.counts.nonfinite > 0) {  // the step guard refuses it (Note [Non-finite steps]); the limits stay
    for (const ParamRange& r : owned) passes_->fill_nan(grads + r.begin, r.end - r.begin);
    return sums;
  }
  if (sums.counts.out_of_range > 0) return sums;  // computed again after a probe: the limits stay
  // Per tensor the exponent of its largest sum (kNone: all zero, kBeyond: beyond float's range),
  // over this rank's part, then (sharded) over every rank's: the whole tensor's.
  constexpr std::int64_t kNone = -1000, kBeyond = 1000;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    const float m = std::bit_cast<float>(maxima_[t]);
    int e = 0;
    std::frexp(m, &e);
    exponent_[t] = m == 0.0f ? kNone : std::isfinite(m) ? e : kBeyond;
  }
  const auto w0 = std::chrono::steady_clock::now();
  if (sharded) sharded->allreduce_max(exponent_);
  sums.waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    // Note [Where the shift comes from]; an all-zero or overflowing gradient keeps its limit
    if (exponent_[t] == kNone || exponent_[t] == kBeyond) continue;
    limit_[t] = static_cast<std::int32_t>(exponent_[t]) + kHeadroomBits;
    set_scales(t);
  }
  return sums;
}

}  // namespace mnist_mpi
