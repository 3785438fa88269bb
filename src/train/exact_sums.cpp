// --exact-sums: chunks' gradients to 64-bit fixed point and back (include/mnist_mpi/train/exact_sums.hpp).
#include "mnist_mpi/train/exact_sums.hpp"

#include <algorithm>
#include <chrono>
#include <bit>
#include <cmath>
#include <limits>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/cpu_clones.hpp"
#include "mnist_mpi/exact_sum.hpp"

namespace mnist_mpi {
namespace {

// One tensor's chunk gradient into its integers (q = or += its fixed point), counting the values at
// or beyond bound and the non-finite ones. Such a value makes the step's integers worthless (the
// step is computed again, or refused), so the loop does not exclude them one by one: it converts
// everything, adding with wrap-around (no overflow is undefined), and keeps the largest magnitude,
// whose bits order like the values with NaN above inf; only when that reaches the bound are the
// values counted, in a second pass. Branch-free, so that it vectorises (Note [Fixed point without
// a conversion instruction]); per-element counting had cost it a third of its time.
struct Counts {
  std::int64_t beyond = 0, nonfinite = 0;  // beyond: out of range or non-finite
};
MNIST_MPI_CPU_CLONES std::uint32_t to_fixed_loop(const float* g, std::int64_t* q, std::int64_t n, double scale,
                                                 bool assign) {
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
Counts to_fixed_pass(const float* g, std::int64_t* q, std::int64_t n, double scale, float bound, bool assign) {
  Counts c;
  if (to_fixed_loop(g, q, n, scale, assign) < std::bit_cast<std::uint32_t>(bound)) return c;
  for (std::int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(g[i]);
    c.beyond += !(a < bound);  // NaN too
    c.nonfinite += !(a <= std::numeric_limits<float>::max());
  }
  return c;
}

// The summed integers back to float; returns the largest magnitude. The maximum is taken over the
// magnitudes' bits, which order like the values (none is a NaN): std::fmax was a call into libm
// per element (NaN rules), 5 % of a lenet step.
MNIST_MPI_CPU_CLONES float from_fixed_pass(const std::int64_t* q, float* g, std::int64_t n, double unscale) {
  std::uint32_t m = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = from_fixed_scaled(q[i], unscale);
    g[i] = v;
    m = std::max(m, std::bit_cast<std::uint32_t>(v) & 0x7fffffffu);
  }
  return std::bit_cast<float>(m);
}

}  // namespace

std::int64_t default_exact_chunk(std::int64_t global_batch) {
  for (std::int64_t c = std::min(kDefaultExactChunk, global_batch); c > 1; --c)
    if (global_batch % c == 0) return c;
  return 1;
}

ExactSums::ExactSums(const ModelSpec& spec, std::int64_t chunks)
    : tensors_(spec.params),
      layer_tensors_(spec.layers.size()),
      count_(spec.param_count),
      chunks_(chunks),
      fixed_(static_cast<std::size_t>(spec.param_count) + 2, 0),
      limit_(spec.params.size(), kUnknown),
      scale_(spec.params.size(), 1.0),
      unscale_(spec.params.size(), 1.0),
      bound_(spec.params.size(), 0.0f),
      probe_max_(spec.params.size(), 0),
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

void ExactSums::begin_probe() {
  std::fill(probe_max_.begin(), probe_max_.end(), std::int64_t{-1000});
  probing_ = true;
}

// The exponent e of the largest finite |x| (max|x| < 2^e). A non-finite value has no limit to
// give: the pass that follows counts it, and the step guard refuses the step.
void ExactSums::probe_part(std::size_t t, const float* g, std::int64_t n) {
  // The largest finite magnitude, over the bits as from_fixed_pass takes it (std::fmax is a libm
  // call per element): NaN and inf, whose bits are those of inf and above, count as 0.
  constexpr std::uint32_t kInf = 0x7f800000u;
  std::uint32_t bits = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t a = std::bit_cast<std::uint32_t>(g[i]) & 0x7fffffffu;
    bits = std::max(bits, a < kInf ? a : 0u);
  }
  const float m = std::bit_cast<float>(bits);
  int e = 0;
  if (m > 0.0f) {
    std::frexp(m, &e);
    probe_max_[t] = std::max<std::int64_t>(probe_max_[t], e);
  }
}

void ExactSums::probe_chunk(const float* grads) {
  for (std::size_t t = 0; t < tensors_.size(); ++t)
    if (!taken_[t]) probe_part(t, grads + tensors_[t].offset, tensors_[t].size);
}

void ExactSums::finish_probe(Communicator& comm) {
  comm.allreduce_max(probe_max_);
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    // All zero: any limit holds them; keep a known one, or take 0.
    if (probe_max_[t] > -1000)
      limit_[t] = static_cast<std::int32_t>(probe_max_[t]);
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
  fixed_[static_cast<std::size_t>(count_)] = 0;
  fixed_[static_cast<std::size_t>(count_) + 1] = 0;
}

void ExactSums::absorb_part(std::size_t t, std::int64_t offset, const float* values, std::int64_t n, bool first) {
  const Counts c = to_fixed_pass(values, fixed_.data() + offset, n, scale_[t], bound_[t], first);
  fixed_[static_cast<std::size_t>(count_)] += c.beyond - c.nonfinite;
  fixed_[static_cast<std::size_t>(count_) + 1] += c.nonfinite;
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
    probe_part(t, values, n);
  else
    absorb_part(t, offset, values, n, first);
}

void ExactSums::absorb_layer(const float* grads, int layer, bool first_chunk) {
  for (const std::size_t t : layer_tensors_.at(static_cast<std::size_t>(layer))) absorb(grads, t, first_chunk);
}

void ExactSums::absorb_all(const float* grads, bool first_chunk) {
  for (std::size_t t = 0; t < tensors_.size(); ++t) absorb(grads, t, first_chunk);
}

double ExactSums::to_float(float* grads, std::span<const ParamRange> owned, Communicator* sharded) {
  if (nonfinite() > 0) {  // the step guard refuses it (Note [Non-finite steps]); the limits stay
    for (const ParamRange& r : owned) std::fill(grads + r.begin, grads + r.end, std::numeric_limits<float>::quiet_NaN());
    return 0.0;
  }
  // Per tensor the exponent of its largest sum (kNone: all zero, kBeyond: beyond float's range),
  // over this rank's part, then (sharded) over every rank's: the whole tensor's.
  constexpr std::int64_t kNone = -1000, kBeyond = 1000;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    const ParamTensor& p = tensors_[t];
    float m = 0.0f;
    for (const ParamRange& r : owned) {
      const std::int64_t begin = std::max(r.begin, p.offset), end = std::min(r.end, p.offset + p.size);
      if (begin < end) m = std::max(m, from_fixed_pass(fixed_.data() + begin, grads + begin, end - begin, unscale_[t]));
    }
    int e = 0;
    std::frexp(m, &e);
    probe_max_[t] = m == 0.0f ? kNone : std::isfinite(m) ? e : kBeyond;
  }
  const auto w0 = std::chrono::steady_clock::now();
  if (sharded) sharded->allreduce_max(probe_max_);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    // Note [Where the shift comes from]; an all-zero or overflowing gradient keeps its limit
    if (probe_max_[t] == kNone || probe_max_[t] == kBeyond) continue;
    limit_[t] = static_cast<std::int32_t>(probe_max_[t]) + kHeadroomBits;
    set_scales(t);
  }
  return waited;
}

}  // namespace mnist_mpi
