// Max pooling (no padding) as plain loops over NCHW or blocked nChwBc input (Note [Activation
// layouts]): forward keeps the argmax of every window (made once at build) and backward scatters
// dy there. See Note [Why pooling is not oneDNN here].
#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "mnist_mpi/check.hpp"
#include "src/backend/cpu/kernels.hpp"
#include "src/backend/cpu/pool_rule.hpp"

namespace mnist_mpi::cpu {
namespace {

// Note [Why pooling is not oneDNN here]
// On plain NCHW tensors oneDNN 2.6 has only its `simple_nchw` pooling, which measured (ONEDNN_VERBOSE,
// tiny, batch 128, one thread) 11.8 ms forward and 5.0 ms backward for the first pool alone: more
// than the two convolutions together. Its jit pooling needs blocked layouts, and the last pool
// before flatten must also turn blocked into plain. These loops do both: blocked input is read one
// channel block at a time (the innermost loop runs over the B channels of a block, contiguous in
// memory), and the output is written in its own layout, plain or blocked, for free. The argmax
// kept per output element is the offset of the max within its sample's input, so backward is the
// same scatter for every layout. The layer tests check every layout combination against the
// double reference and finite differences like every other kernel.

// Note [A ReLU taken over by its max pool]
// lenet's ReLUs each sit between a convolution and a 2 x 2 max pool: a separate pass wrote the
// ReLU's output, the pool read it, and backward wrote the pool's dx and read it again to mask it
// (0.7 ms of a 20 ms lenet step on one rank, measured on an AVX-512 host). A max commutes with a
// ReLU, max(relu(a), relu(b)) = relu(max(a, b)), so a pool after a ReLU (where the fusion plan says
// so: Note [The fusion plan] in fusion.cpp) reads the ReLU's input and starts each window's max at the ReLU of its
// first element: later elements replace it only where they are greater, so the max is the ReLU's
// max, NaN included (oneDNN's ReLU makes a NaN 0, and a NaN never compares greater), and the
// argmax is the one over the ReLU's output (the first maximum, ties at 0 included). The ReLU's own
// passes then do nothing and its y is never written. Backward writes the ReLU's dx
// directly: dy at the argmax where the pooled y > 0, and 0 elsewhere; y > 0 exactly when the input
// at the argmax is > 0, which is the mask the ReLU's backward applies.
// BlockedLayouts.ReluTakenOverByThePoolIsBitwiseTheSame checks logits and gradients against the
// unfused layers bit for bit.
// NaN -> 0, as oneDNN's ReLU does (pool_start; checked by BlockedLayouts.ANaNThroughAReluTakenOverByItsPool).

struct PoolShape {
  int ih, iw, oh, ow, k_h, k_w, s, cb_count;
  std::int64_t in_sample, out_sample;
  bool y_blocked;
  bool relu;  // each window's max starts at relu(first): Note [The max pool's tie rule] in pool_rule.hpp
  bool arg_blocked = false;  // y plain, the argmax kept in x's blocked order (Note [A 2 x 2 pool's gradient in one pass])
};

// Sample n: x blocked (N, C/B, H, W, B); y blocked the same way or plain; arg (may be null) as in
// MaxPool. K > 0: a K x K window with stride K known at compile time (the common 2 x 2 pool: the
// window loops unroll); K = 0: the shape's own window and stride. Always inlined, and no OpenMP
// region inside: both would leave the loop in a function of its own built for the baseline x86-64
// instead of in the clones (Note [One build for every x86-64]).
template <int B, int K>
[[gnu::always_inline]] inline void pool_forward_blocked(const PoolShape& p, std::int64_t n, const float* __restrict xs,
                                                        float* __restrict ys, std::int32_t* __restrict args) {
  const int ih = p.ih, iw = p.iw, oh = p.oh, ow = p.ow;
  const int k_h = K > 0 ? K : p.k_h, k_w = K > 0 ? K : p.k_w, s = K > 0 ? K : p.s;
  for (int cb = 0; cb < p.cb_count; ++cb) {
    const std::int64_t base = static_cast<std::int64_t>(cb) * ih * iw * B;  // within the sample
    const float* x = xs + n * p.in_sample + base;                           // (H, W, B)
    float* y = ys + n * p.out_sample;
    std::int32_t* arg = args ? args + n * p.out_sample : nullptr;
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        float best[B];
        std::int32_t best_at[B];
        const int first = (i * s * iw + j * s) * B;
#pragma omp simd
        for (int c = 0; c < B; ++c) {
          best[c] = pool_start(x[first + c], p.relu);
          best_at[c] = first + c;
        }
        for (int u = 0; u < k_h; ++u)
          for (int v = 0; v < k_w; ++v) {
            const int at = ((i * s + u) * iw + j * s + v) * B;
            // Note [The max pool's tie rule] in pool_rule.hpp, B lanes wide.
#pragma omp simd
            for (int c = 0; c < B; ++c) pool_take(x[at + c], at + c, best[c], best_at[c]);
          }
        if (p.y_blocked) {  // B contiguous outputs
          const std::int64_t o = (static_cast<std::int64_t>(cb) * oh * ow + i * ow + j) * B;
#pragma omp simd
          for (int c = 0; c < B; ++c) y[o + c] = best[c];
          if (arg) {
#pragma omp simd
            for (int c = 0; c < B; ++c) arg[o + c] = static_cast<std::int32_t>(base + best_at[c]);
          }
        } else {
          for (int c = 0; c < B; ++c) {
            const std::int64_t o = (static_cast<std::int64_t>(cb * B + c) * oh + i) * ow + j;
            y[o] = best[c];
            if (arg && !p.arg_blocked) arg[o] = static_cast<std::int32_t>(base + best_at[c]);
          }
          if (arg && p.arg_blocked) {
            const std::int64_t o = (static_cast<std::int64_t>(cb) * oh * ow + i * ow + j) * B;
#pragma omp simd
            for (int c = 0; c < B; ++c) arg[o + c] = static_cast<std::int32_t>(base + best_at[c]);
          }
        }
      }
  }
}

template <int B>
[[gnu::always_inline]] inline void pool_forward_blocked_any(const PoolShape& p, std::int64_t n, const float* x,
                                                            float* y, std::int32_t* arg) {
  if (p.k_h == 2 && p.k_w == 2 && p.s == 2)
    pool_forward_blocked<B, 2>(p, n, x, y, arg);
  else
    pool_forward_blocked<B, 0>(p, n, x, y, arg);
}

// Built for AVX-512, AVX2 and the baseline, chosen by the CPU at load time (as the convolution's
// own loop in src/backend/cpu/conv.cpp): the B-wide compare-and-select needs blends, which the
// baseline x86-64 (SSE2) lacks. Comparisons and selects only: the same bits on every ISA.
MNIST_MPI_CPU_CLONES
void pool_forward_blocked8(const PoolShape& p, std::int64_t n, const float* x, float* y, std::int32_t* arg) {
  pool_forward_blocked_any<8>(p, n, x, y, arg);
}
MNIST_MPI_CPU_CLONES
void pool_forward_blocked16(const PoolShape& p, std::int64_t n, const float* x, float* y, std::int32_t* arg) {
  pool_forward_blocked_any<16>(p, n, x, y, arg);
}

// Note [A 2 x 2 pool's gradient in one pass]
// Where the windows are 2 x 2 with stride 2 and cover the input exactly (lenet's and tiny's pools),
// every input element is in exactly one window. So backward writes each window's four gradients
// in one pass, dy (masked by the ReLU it took over) at the argmax and 0 at the other three,
// instead of zeroing all of dx and then scattering dy into it. The argmax's element is written as
// 0.0f + dy, the very addition the scatter made (a -0 still becomes +0), so the bits are the same:
// BlockedLayouts.PoolGradientInOnePassIsBitwiseTheSame. The B lanes of a block read dy, y and the
// argmax contiguously where y has x's layout (blocked by B, or both plain). lenet's first pool:
// 1.42 -> 0.44 ms. A pool that turns blocked into plain (lenet's second, before the flatten) keeps
// its argmax in x's blocked order instead (nothing else reads it) and, per sample, first copies dy,
// masked by the ReLU, into a blocked scratch of one sample (12.5 KB for lenet, in L1): reading
// plain dy across channels inside the pass had taken 2.1 ms where the scatter took 1.2 (lenet,
// batch 100, one thread); with the copy first, 0.53 -> 0.26 ms a step at batch 50 (perf, 2 ranks).
// T: float, or the bf16 bits (std::uint16_t) of Note [A pool's gradient straight into bf16], which
// also sums each channel's values, the bias's gradient, into bias (per sample in float, in window
// order).
template <int B, bool Relu, typename T = float>
[[gnu::always_inline]] inline void pool_backward_tiles(const PoolShape& p, std::int64_t n, const float* __restrict dys,
                                                       const float* __restrict ys, const std::int32_t* __restrict args,
                                                       T* __restrict dxs, double* __restrict bias = nullptr) {
  constexpr bool kBf16 = std::is_same_v<T, std::uint16_t>;
  const int ih = p.ih, iw = p.iw, oh = p.oh, ow = p.ow;
  const float* dy = dys + n * p.out_sample;
  const float* y = Relu ? ys + n * p.out_sample : nullptr;
  const std::int32_t* arg = args + n * p.out_sample;
  T* dx = dxs + n * p.in_sample;
  const int row = iw * B;  // offsets within a sample fit in 32 bits (the argmax is an int32)
  for (int cb = 0; cb < p.cb_count; ++cb) {
    float sum[B] = {};
    for (int i = 0; i < oh; ++i)
      for (int j = 0; j < ow; ++j) {
        const int base = ((cb * ih + 2 * i) * iw + 2 * j) * B;
        T* d0 = dx + base;
        T* d1 = d0 + row;
#pragma omp simd
        for (int b = 0; b < B; ++b) {
          const int o = ((cb * oh + i) * ow + j) * B + b;
          const float g = Relu ? (y[o] > 0.0f ? dy[o] : 0.0f) : dy[o];
          const float v = 0.0f + g;
          T h;
          if constexpr (kBf16)
            h = cpu::bf16_bits(v);
          else
            h = v;
          const int k = arg[o] - base - b;  // 0, B, row or row + B: where in the window the max is
          d0[b] = k == 0 ? h : T{0};
          d0[b + B] = k == B ? h : T{0};
          d1[b] = k == row ? h : T{0};
          d1[b + B] = k == row + B ? h : T{0};
          if constexpr (kBf16) sum[b] += v;
        }
      }
    if constexpr (kBf16)
      for (int b = 0; b < B; ++b) bias[cb * B + b] += sum[b];
  }
}

// Sample n's plain dy, masked by the ReLU the pool took over, into g blocked by B.
template <int B>
[[gnu::always_inline]] inline void masked_dy_blocked(const PoolShape& p, std::int64_t n, const float* __restrict dys,
                                                     const float* __restrict ys, float* __restrict g) {
  const std::int64_t plane = static_cast<std::int64_t>(p.oh) * p.ow;
  const float* dy = dys + n * p.out_sample;
  const float* y = ys + n * p.out_sample;
  for (int cb = 0; cb < p.cb_count; ++cb)
    for (int b = 0; b < B; ++b) {
      const std::int64_t c = static_cast<std::int64_t>(cb) * B + b;
      float* out = g + static_cast<std::int64_t>(cb) * plane * B + b;
      if (p.relu)
        for (std::int64_t o = 0; o < plane; ++o) out[o * B] = y[c * plane + o] > 0.0f ? dy[c * plane + o] : 0.0f;
      else
        for (std::int64_t o = 0; o < plane; ++o) out[o * B] = dy[c * plane + o];
    }
}

// Sample n of a pool whose y is plain and whose argmax is in x's blocked order: dy (masked by the
// ReLU it took over) into g, one sample blocked by B, then the one pass.
template <int B>
[[gnu::always_inline]] inline void pool_backward_tiles_plain_y(const PoolShape& p, std::int64_t n,
                                                               const float* __restrict dys, const float* __restrict ys,
                                                               const std::int32_t* __restrict args, float* __restrict g,
                                                               float* __restrict dxs) {
  masked_dy_blocked<B>(p, n, dys, ys, g);
  pool_backward_tiles<B, false>(p, 0, g, nullptr, args + n * p.out_sample, dxs + n * p.in_sample);
}
// Note [A pool's gradient straight into bf16]
// Under --precision bf16 the convolution before a ReLU and this pool reads dy only as a bf16 copy
// (its backward-data and backward-weights); the fp32 dy served for the copy's reorder and for its
// bias's gradient. lenet's pool before flatten wrote 2.5 MB of fp32 dy a step, the reorder read it
// and wrote the copy, the bias loop read it again (0.10 + 0.05 ms, oneDNN's log and perf). Where the
// fusion plan joins the two (ConvPoolLink::dy_bf16), this pass writes the copy itself, each
// window's value rounded as bf16_bits and set where its argmax points, and sums the bias's gradient
// as it goes (per sample in float, in window order; over samples in double); the fp32 dy is never
// written. Tested by BlockedLayouts.PoolWritesTheBf16GradientOfTheConvolution.
template <int B>
[[gnu::always_inline]] inline void pool_backward_plain_y_bf16(const PoolShape& p, std::int64_t n,
                                                              const float* __restrict dys, const float* __restrict ys,
                                                              const std::int32_t* __restrict args, float* __restrict g,
                                                              std::uint16_t* __restrict dxs, double* __restrict bias) {
  masked_dy_blocked<B>(p, n, dys, ys, g);
  pool_backward_tiles<B, false, std::uint16_t>(p, 0, g, nullptr, args + n * p.out_sample, dxs + n * p.in_sample, bias);
}
MNIST_MPI_CPU_CLONES
void pool_backward_plain_y16_bf16(const PoolShape& p, std::int64_t n, const float* dy, const float* y,
                                  const std::int32_t* arg, float* g, std::uint16_t* dx, double* bias) {
  pool_backward_plain_y_bf16<16>(p, n, dy, y, arg, g, dx, bias);
}

MNIST_MPI_CPU_CLONES
void pool_backward_plain_y8(const PoolShape& p, std::int64_t n, const float* dy, const float* y,
                            const std::int32_t* arg, float* g, float* dx) {
  pool_backward_tiles_plain_y<8>(p, n, dy, y, arg, g, dx);
}
MNIST_MPI_CPU_CLONES
void pool_backward_plain_y16(const PoolShape& p, std::int64_t n, const float* dy, const float* y,
                             const std::int32_t* arg, float* g, float* dx) {
  pool_backward_tiles_plain_y<16>(p, n, dy, y, arg, g, dx);
}

template <int B>
[[gnu::always_inline]] inline void pool_backward_tiles_any(const PoolShape& p, std::int64_t n, const float* dy,
                                                           const float* y, const std::int32_t* arg, float* dx) {
  p.relu ? pool_backward_tiles<B, true>(p, n, dy, y, arg, dx) : pool_backward_tiles<B, false>(p, n, dy, y, arg, dx);
}

MNIST_MPI_CPU_CLONES
void pool_backward_tiles1(const PoolShape& p, std::int64_t n, const float* dy, const float* y, const std::int32_t* arg,
                          float* dx) {
  pool_backward_tiles_any<1>(p, n, dy, y, arg, dx);
}
MNIST_MPI_CPU_CLONES
void pool_backward_tiles8(const PoolShape& p, std::int64_t n, const float* dy, const float* y, const std::int32_t* arg,
                          float* dx) {
  pool_backward_tiles_any<8>(p, n, dy, y, arg, dx);
}
MNIST_MPI_CPU_CLONES
void pool_backward_tiles16(const PoolShape& p, std::int64_t n, const float* dy, const float* y, const std::int32_t* arg,
                           float* dx) {
  pool_backward_tiles_any<16>(p, n, dy, y, arg, dx);
}

class MaxPool final : public LayerKernel {
 public:
  MaxPool(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training, const LayerFusion& f)
      : l_(l),
        b_(b),
        in_sample_(l.in.size()),
        out_sample_(l.out.size()),
        bx_(block_size(b.x_layout)),
        by_(block_size(b.y_layout)),
        x_(b.x),
        dx_(b.dx),
        // Note [A 2 x 2 pool's gradient in one pass]
        tiles_(c.fuse.pool_backward_tiles && exact_2x2(l) && by_ == bx_),
        plain_y_tiles_(training && c.fuse.pool_backward_tiles && exact_2x2(l) && bx_ > 1 && by_ == 1) {
    if (plain_y_tiles_) {
      threads_ = std::max(1, omp_get_max_threads());
      scratch_.assign(static_cast<std::size_t>(threads_) * out_sample_, 0.0f);
    }
    MNIST_CHECK(l.in.c % bx_ == 0 && l.out.c % by_ == 0 && (bx_ == by_ || by_ == 1), ExitCode::kRuntime,
                "maxpool: unsupported layouts for " + l.text);
    if (training) argmax_.assign(static_cast<std::size_t>(b.batch * out_sample_), 0);
    // Note [The fusion plan] in fusion.cpp: what this pool takes over from the layers before it.
    link_ = f.link;
    if (f.takes_relu) {  // Note [A ReLU taken over by its max pool]
      x_ = f.relu_buffers.x;
      dx_ = f.relu_buffers.dx;
      relu_ = true;
    }
    writes_bf16_dy_ = f.writes_bf16_dy;  // Note [A pool's gradient straight into bf16]
    if (writes_bf16_dy_) bias_acc_.assign(static_cast<std::size_t>(threads_) * l.in.c, 0.0);
    // Notes [The first convolution and its pool in one pass] in conv.cpp and [The first
    // convolution in bf16] in bf16.cpp
    if (f.computes_conv != ConvInPool::kNo) conv_ = first_conv_forward(c, f.conv_spec, f.conv_buffers);
    if (f.computes_conv == ConvInPool::kBf16) conv_bf16_.emplace(conv_->l, std::max(1, omp_get_max_threads()));
    if (f.computes_conv == ConvInPool::kFp32)
      conv_weights_.assign(static_cast<std::size_t>(conv_->l.channels) * conv_->l.kernel_h * conv_->l.kernel_w, 0.0f);
    // Notes [The first convolution reads its pool's gradient] in conv.cpp and [The first
    // convolution's weight gradient in bf16] in bf16.cpp (with a ReLU: y, its mask)
    if (f.hands_gradient) {
      link_->pooled = PooledGradient{b.dy, argmax_.data(), relu_ ? b.y : nullptr};
      dx_left_to_conv_ = true;
    }
  }

  void forward(const StepContext&) override {
    if (conv_bf16_) {
      conv_bf16_->forward(*conv_, b_.batch, b_.y, argmax_.empty() ? nullptr : argmax_.data());
      return;
    }
    if (conv_) {
      first_conv_pool_forward(*conv_, bx_, b_.batch, conv_weights_.data(), b_.y,
                              argmax_.empty() ? nullptr : argmax_.data());
      return;
    }
    if (bx_ == 1)
      forward_plain();
    else if (bx_ == 8)
      forward_blocked<8>();
    else
      forward_blocked<16>();
  }

  void backward(const StepContext&) override {
    if (!dx_ || dx_left_to_conv_) return;
    if (writes_bf16_dy_) {  // Note [A pool's gradient straight into bf16]
      const PoolShape p = shape(bx_);
      std::fill(bias_acc_.begin(), bias_acc_.end(), 0.0);
      const std::int64_t channels = l_.in.c;
#pragma omp parallel for schedule(static) num_threads(threads_)  // no more threads than scratches
      for (std::int64_t n = 0; n < b_.batch; ++n) {
        const std::int64_t t = omp_get_thread_num();
        pool_backward_plain_y16_bf16(p, n, b_.dy, b_.y, argmax_.data(), scratch_.data() + t * out_sample_,
                                     link_->dy_bf16, bias_acc_.data() + t * channels);
      }
      for (std::int64_t c = 0; c < channels; ++c) {  // the threads' sums in thread order
        double s = bias_acc_[static_cast<std::size_t>(c)];
        for (int t = 1; t < threads_; ++t) s += bias_acc_[static_cast<std::size_t>(t * channels + c)];
        link_->db[c] = static_cast<float>(s);
      }
      return;
    }
    if (plain_y_tiles_) {  // Note [A 2 x 2 pool's gradient in one pass]
      const PoolShape p = shape(bx_);
#pragma omp parallel for schedule(static) num_threads(threads_)  // no more threads than scratches
      for (std::int64_t n = 0; n < b_.batch; ++n) {
        float* g = scratch_.data() + static_cast<std::int64_t>(omp_get_thread_num()) * out_sample_;
        if (bx_ == 16)
          pool_backward_plain_y16(p, n, b_.dy, b_.y, argmax_.data(), g, dx_);
        else
          pool_backward_plain_y8(p, n, b_.dy, b_.y, argmax_.data(), g, dx_);
      }
      return;
    }
    if (tiles_) {  // Note [A 2 x 2 pool's gradient in one pass]
      const PoolShape p = shape(bx_);
      const float* y = relu_ ? b_.y : nullptr;
#pragma omp parallel for schedule(static)
      for (std::int64_t n = 0; n < b_.batch; ++n) {
        if (bx_ == 16)
          pool_backward_tiles16(p, n, b_.dy, y, argmax_.data(), dx_);
        else if (bx_ == 8)
          pool_backward_tiles8(p, n, b_.dy, y, argmax_.data(), dx_);
        else
          pool_backward_tiles1(p, n, b_.dy, y, argmax_.data(), dx_);
      }
      return;
    }
#pragma omp parallel for schedule(static)
    for (std::int64_t n = 0; n < b_.batch; ++n) {
      float* dx = dx_ + n * in_sample_;  // one sample, in x's layout
      std::memset(dx, 0, static_cast<std::size_t>(in_sample_) * sizeof(float));
      const float* dy = b_.dy + n * out_sample_;
      const std::int32_t* arg = argmax_.data() + n * out_sample_;
      if (relu_) {  // the ReLU's mask: Note [A ReLU taken over by its max pool]
        const float* y = b_.y + n * out_sample_;
        for (std::int64_t o = 0; o < out_sample_; ++o) dx[arg[o]] += y[o] > 0.0f ? dy[o] : 0.0f;
      } else {
        for (std::int64_t o = 0; o < out_sample_; ++o) dx[arg[o]] += dy[o];
      }
    }
  }
  std::string describe() const override {
    return "maxpool (plain loops, argmax kept; x block " + std::to_string(bx_) + ", y block " + std::to_string(by_) +
           (dx_left_to_conv_           ? "; dx left to the convolution"
            : tiles_ || plain_y_tiles_ ? "; dx in one pass"
                                       : "") +
           (relu_ ? "; applies the ReLU before it" : "") +
           (writes_bf16_dy_ ? "; writes the convolution's dy in bf16" : "") +
           (conv_ ? conv_bf16_ ? "; computes the convolution before the ReLU in bf16"
                               : "; computes the convolution before it"
                  : "") +
           ")";
  }

 private:
  // x and y plain (N, C, H, W).
  void forward_plain() {
    const int ih = l_.in.h, iw = l_.in.w, oh = l_.out.h, ow = l_.out.w, k_h = l_.kernel_h, k_w = l_.kernel_w,
              s = l_.stride;
    const bool keep = !argmax_.empty();
    const std::int64_t planes = static_cast<std::int64_t>(b_.batch) * l_.in.c;
    for (std::int64_t p = 0; p < planes; ++p) {
      const std::int64_t base = (p % l_.in.c) * ih * iw;  // the plane's offset within its sample
      const float* x = x_ + p * ih * iw;                  // (H, W) of one (n, c)
      float* y = b_.y + p * oh * ow;
      std::int32_t* arg = keep ? argmax_.data() + p * oh * ow : nullptr;
      for (int i = 0; i < oh; ++i)
        for (int j = 0; j < ow; ++j) {
          int best_at = i * s * iw + j * s;
          float best = pool_start(x[best_at], relu_);
          for (int u = 0; u < k_h; ++u)
            for (int v = 0; v < k_w; ++v) {
              const int at = (i * s + u) * iw + j * s + v;
              if (pool_replaces(x[at], best)) {  // Note [The max pool's tie rule] in pool_rule.hpp
                best = x[at];
                best_at = at;
              }
            }
          y[i * ow + j] = best;
          if (keep) arg[i * ow + j] = static_cast<std::int32_t>(base + best_at);
        }
    }
  }

  // The loops' view of this pool, with x blocked by B.
  PoolShape shape(int B) const {
    return PoolShape{l_.in.h,   l_.in.w,     l_.out.h,   l_.out.w,    l_.kernel_h, l_.kernel_w,
                     l_.stride, l_.in.c / B, in_sample_, out_sample_, by_ != 1,    relu_,
                     plain_y_tiles_};
  }

  template <int B>
  void forward_blocked() {
    const PoolShape p = shape(B);
    std::int32_t* arg = argmax_.empty() ? nullptr : argmax_.data();
    // Samples are independent: with --threads > 1 they are shared out (same bits for any count).
#pragma omp parallel for schedule(static)
    for (std::int64_t n = 0; n < b_.batch; ++n) {
      if constexpr (B == 8)
        pool_forward_blocked8(p, n, x_, b_.y, arg);
      else
        pool_forward_blocked16(p, n, x_, b_.y, arg);
    }
  }

  LayerSpec l_;
  LayerBuffers b_;
  std::int64_t in_sample_, out_sample_;
  int bx_, by_;
  const float* x_;                          // what forward reads: b_.x, or the input of a ReLU this pool took over
  float* dx_;                               // what backward writes: b_.dx, or that ReLU's dx
  bool tiles_;                              // Note [A 2 x 2 pool's gradient in one pass]
  bool plain_y_tiles_;                      // the same for blocked x and plain y: argmax_ in x's blocked order
  std::vector<float> scratch_;              // plain_y_tiles_: one sample's dy, blocked, per thread
  int threads_ = 1;                         // of them
  bool relu_ = false;                       // Note [A ReLU taken over by its max pool]
  bool dx_left_to_conv_ = false;            // the convolution before reads dy and argmax_ instead of dx
  std::shared_ptr<ConvPoolLink> link_;      // shared with the convolution before (Note [The fusion plan])
  std::optional<FirstConvForward> conv_;    // the convolution before, computed in this pool's forward
  std::vector<float> conv_weights_;         // its weights rearranged, each forward
  std::optional<FirstConvBf16> conv_bf16_;  // Note [The first convolution in bf16]
  bool writes_bf16_dy_ = false;             // Note [A pool's gradient straight into bf16]: into link_
  std::vector<double> bias_acc_;            // its bias sums, a row per thread
  std::vector<std::int32_t> argmax_;        // in y's order (plain_y_tiles_: x's blocked order): offset of the max within its sample's x
};

}  // namespace

bool exact_2x2(const LayerSpec& l) {
  return l.kernel_h == 2 && l.kernel_w == 2 && l.stride == 2 && l.in.h == 2 * l.out.h && l.in.w == 2 * l.out.w;
}

std::unique_ptr<LayerKernel> make_maxpool(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training,
                                          const LayerFusion& f) {
  return std::make_unique<MaxPool>(c, l, b, training, f);
}

}  // namespace mnist_mpi::cpu
