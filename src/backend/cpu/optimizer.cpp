// The CPU's optimiser pass (include/mnist_mpi/backend/optimizer_pass.hpp): the step count and
// its scalars on the host, and one fused loop over a range of the flat buffers, built for every
// x86-64 ISA with the same bits; LAMB's two phases and its exact norms. The GPU's pass
// (src/backend/cuda/kernels.cu) computes the same expressions in the same order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "mnist_mpi/backend/optimizer_pass.hpp"
#include "mnist_mpi/backend/parameter_store.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/cpu_clones.hpp"
#include "mnist_mpi/exact_norm.hpp"
#include "src/backend/cpu/bf16.hpp"

namespace mnist_mpi {
namespace {
struct AdamScalars {
  float wd, b1, b2, step_size, inv_sqrt_bc2, eps;
};

// One element's update: the expressions of both passes below. Inlined into each loop (a helper
// with the loop and its OpenMP region inside would be a function of its own, built for the
// baseline x86-64 rather than in the clones: Note [One build for every x86-64]; that ran at a
// third of the speed).
[[gnu::always_inline]] inline void adam_element(const AdamScalars& a, float& p, float g, float& m, float& v) {
  const float gi = g + a.wd * p;
  m = a.b1 * m + (1.0f - a.b1) * gi;
  v = a.b2 * v + (1.0f - a.b2) * gi * gi;
  p -= a.step_size * m / (std::sqrt(v) * a.inv_sqrt_bc2 + a.eps);
}

// Built for AVX-512, AVX2 and the baseline (Note [One build for every x86-64] in
// include/mnist_mpi/cpu_clones.hpp): each element goes through the same IEEE operations in the
// same order on every ISA (the core is built with -ffp-contract=off), so the three give the same bits.
MNIST_MPI_CPU_CLONES
void adam_pass(const AdamScalars& a, float* __restrict p, const float* __restrict g, float* __restrict m,
               float* __restrict v, std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) adam_element(a, p[i], g[i], m[i], v[i]);
}
// The same, and each new parameter's bf16 to copy while it is in a register (Note [Weight copies
// kept between passes] in src/backend/cpu/bf16.cpp).
MNIST_MPI_CPU_CLONES
void adam_pass_copy(const AdamScalars& a, float* __restrict p, const float* __restrict g, float* __restrict m,
                    float* __restrict v, std::uint16_t* __restrict copy, std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    adam_element(a, p[i], g[i], m[i], v[i]);
    copy[i] = cpu::bf16_bits(p[i]);
  }
}
// LAMB's first phase (Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp): Adam's
// moments without the weight decay in the gradient, and the direction written over the gradient.
struct LambScalars {
  float wd, b1, b2, inv_bc1, inv_sqrt_bc2, eps;
};
MNIST_MPI_CPU_CLONES
void lamb_direction_pass(const LambScalars& a, const float* __restrict p, float* __restrict g, float* __restrict m,
                         float* __restrict v, std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = a.b1 * m[i] + (1.0f - a.b1) * gi;
    const float vi = a.b2 * v[i] + (1.0f - a.b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    g[i] = mi * a.inv_bc1 / (std::sqrt(vi) * a.inv_sqrt_bc2 + a.eps) + a.wd * p[i];
  }
}
// The second phase: p -= rate * u, and the new parameters' bf16 when there is a copy.
MNIST_MPI_CPU_CLONES
void lamb_apply_pass(float rate, float* __restrict p, const float* __restrict u, std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) p[i] -= rate * u[i];
}
MNIST_MPI_CPU_CLONES
void lamb_apply_pass_copy(float rate, float* __restrict p, const float* __restrict u, std::uint16_t* __restrict copy,
                          std::int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    p[i] -= rate * u[i];
    copy[i] = cpu::bf16_bits(p[i]);
  }
}
// Squares of x[0, n) into `into`, in pieces that the threads share: exact sums, so the bits do not
// depend on which thread adds which piece (Note [Exact squared norms] in include/mnist_mpi/exact_norm.hpp).
void add_squares(SquaredNorm& into, const float* x, std::int64_t n) {
  constexpr std::int64_t kPiece = 1 << 16;
  if (n <= kPiece) {
    into.add(x, n);
    return;
  }
  const std::int64_t pieces = (n + kPiece - 1) / kPiece;
#pragma omp parallel
  {
    SquaredNorm mine;
#pragma omp for schedule(static) nowait
    for (std::int64_t k = 0; k < pieces; ++k) mine.add(x + k * kPiece, std::min(kPiece, n - k * kPiece));
#pragma omp critical
    into.add(mine);
  }
}

// The fused pass over n elements, with the scalars of the step.
void host_pass(const OptimizerConfig& cfg, const OptimizerScalars& s, float* __restrict p, const float* __restrict g,
               float* __restrict m, float* __restrict v, std::uint16_t* __restrict copy, std::int64_t n) {
  const float wd = static_cast<float>(cfg.weight_decay);
  if (cfg.kind == OptimizerKind::kAdam) {
    const AdamScalars a{wd,
                        static_cast<float>(cfg.beta1),
                        static_cast<float>(cfg.beta2),
                        s.step_size,
                        s.inv_sqrt_bc2,
                        static_cast<float>(cfg.eps)};
    if (copy)
      adam_pass_copy(a, p, g, m, v, copy, n);
    else
      adam_pass(a, p, g, m, v, n);
  } else {
    const float mu = static_cast<float>(cfg.momentum), flr = s.lr;
    const bool nesterov = cfg.nesterov;
#pragma omp parallel for simd schedule(static)
    for (std::int64_t i = 0; i < n; ++i) {
      float gi = g[i] + wd * p[i];
      if (mu != 0.0f) {
        m[i] = mu * m[i] + gi;  // PyTorch: buf = momentum * buf + g (buf starts at 0, dampening 0)
        gi = nesterov ? gi + mu * m[i] : m[i];
      }
      p[i] -= flr * gi;
    }
    if (copy) cpu::to_bf16(p, copy, n);  // sgd: a pass of its own
  }
}

// Note [The parameters and their copies] (include/mnist_mpi/backend/parameter_store.hpp): a write
// of params[0, n) in pieces, write(lo, hi, image), image the plain bf16 image over the piece (or
// null), and each piece reported to the store. Elementwise passes: the pieces do not move a bit.
template <typename Write>
void write_and_report(ParameterStore* store, float* params, std::int64_t n, Write&& write) {
  if (!store) {
    write(0, n, nullptr);
    return;
  }
  std::int64_t at = 0;
  const auto plain = [&](std::int64_t hi) {
    if (at >= hi) return;
    write(at, hi, nullptr);
    store->changed(params + at, params + hi);
    at = hi;
  };
  for (const LayerKernel::PlainCopy& c : store->plain_bf16_images()) {  // in the buffer's order
    const std::int64_t lo = std::max<std::int64_t>(at, c.begin - params),
                       hi = std::min<std::int64_t>(n, c.end - params);
    if (lo >= hi) continue;
    plain(lo);
    write(lo, hi, c.copy + (params + lo - c.begin));
    store->changed(params + lo, params + hi, ParameterStore::Images::kWritten);
    at = hi;
  }
  plain(n);
}

class HostOptimizerPass final : public OptimizerPass {
 public:
  HostOptimizerPass(const OptimizerConfig& cfg, ParameterStore* store) : cfg_(cfg), store_(store) {}
  void begin_step(double lr) override {
    ++t_;
    scalars_ = optimizer_scalars(cfg_.beta1, cfg_.beta2, lr, t_);
  }
  std::int64_t read() override { return t_; }
  void set(std::int64_t t) override { t_ = t; }
  void update(float* params, const float* grads, float* m, float* v, std::int64_t n) override {
    write_and_report(store_, params, n, [&](std::int64_t lo, std::int64_t hi, std::uint16_t* image) {
      host_pass(cfg_, scalars_, params + lo, grads + lo, m + lo, v ? v + lo : nullptr, image, hi - lo);
    });
  }
  void set_norm_slots(std::int64_t slots) override {
    norms_.assign(static_cast<std::size_t>(2 * slots), SquaredNorm{});
  }
  void direction(const float* params, float* grads, float* m, float* v, std::int64_t n, std::int64_t slot) override {
    const LambScalars a{static_cast<float>(cfg_.weight_decay),
                        static_cast<float>(cfg_.beta1),
                        static_cast<float>(cfg_.beta2),
                        scalars_.inv_bc1,
                        scalars_.inv_sqrt_bc2,
                        static_cast<float>(cfg_.eps)};
    lamb_direction_pass(a, params, grads, m, v, n);
    if (slot < 0) return;
    MNIST_CHECK(2 * slot + 1 < static_cast<std::int64_t>(norms_.size()), ExitCode::kRuntime,
                "the optimiser pass: a norm slot it has no room for");
    add_squares(norms_[static_cast<std::size_t>(2 * slot)], params, n);
    add_squares(norms_[static_cast<std::size_t>(2 * slot + 1)], grads, n);
  }
  void take_norms(std::span<std::int64_t> limbs) override {
    MNIST_CHECK(limbs.size() == norms_.size() * kNormWords, ExitCode::kRuntime,
                "the optimiser pass: the norms' limbs are not the size of its slots");
    for (std::size_t i = 0; i < norms_.size(); ++i) {
      norms_[i].add_to_limbs(limbs.subspan(i * kNormWords, kNormWords));
      norms_[i].clear();
    }
  }
  void apply_direction(float* params, const float* u, std::int64_t n, float rate) override {
    write_and_report(store_, params, n, [&](std::int64_t lo, std::int64_t hi, std::uint16_t* image) {
      if (image)
        lamb_apply_pass_copy(rate, params + lo, u + lo, image, hi - lo);
      else
        lamb_apply_pass(rate, params + lo, u + lo, hi - lo);
    });
  }

 private:
  OptimizerConfig cfg_;
  ParameterStore* store_;
  std::int64_t t_ = 0;
  OptimizerScalars scalars_;
  std::vector<SquaredNorm> norms_;  // (slots, {w, u})
};

}  // namespace

std::unique_ptr<OptimizerPass> make_host_optimizer_pass(const OptimizerConfig& cfg, ParameterStore* store) {
  return std::make_unique<HostOptimizerPass>(cfg, store);
}

}  // namespace mnist_mpi
