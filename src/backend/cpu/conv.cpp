// 2-D convolution on oneDNN: forward, backward-data and backward-weights (with bias) primitives
// made once for the layer's shapes and buffers. Activations come in the layouts the backend chose
// (Note [Activation layouts]); weights are OIHW in the flat buffers and the checkpoint, reordered
// into the kernel's preferred layout once per step. See Note [Blocked convolutions].
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "src/backend/cpu/kernels.hpp"
#include "src/backend/cpu/pool_rule.hpp"

namespace mnist_mpi::cpu {
namespace {

// Note [Blocked convolutions]
// On plain NCHW tensors oneDNN 2.6 runs convolutions as im2col + sgemm (`gemm:jit`); measured for
// lenet's conv2 (32 -> 64 channels, 5x5, 14x14, batch 50, one thread) at ~33 ms for each of forward,
// backward-data and backward-weights. With blocked activations (nChw8c / nChw16c) and the weights'
// format left to oneDNN (`any`), it picks its direct jit convolutions, which need no im2col buffer.
// The weights change every step, so they are reordered OIHW -> the kernel's layout in forward
// (backward-data reuses that copy when it wants the same layout: the weights do not change between
// a forward and its backward), and the weight gradient is reordered back into the flat gradient
// buffer after backward-weights. These reorders touch the weights only (lenet conv2: 51,200 floats),
// never the activations.
// Note [Weight gradient of a plain-input convolution]
// oneDNN 2.6 has no jit backward-weights for a plain NCHW source with an nChw8c gradient (it falls
// back to `ref:any`, measured ~600 ms per tiny step for conv 1 -> 8); the first convolution of a
// model has exactly that (one input channel, so its input is plain). This loop computes it
// instead: for every output position the B output channels of a block are contiguous in dy, so the
// innermost loop is a B-wide multiply-add into dW laid out (O/B, I, KH, KW, B), then transposed
// into OIHW. Each image's sum (OH * OW terms) is kept in float and the batch's sum of those in
// double: one float sum over the whole batch (100,352 terms for tiny) would lose digits that
// oneDNN's gemm-based kernel, summing per image, keeps. Fixed order, so deterministic. Measured
// (tiny, 2 ranks): compiled for the baseline x86-64 this loop ran scalar and took 35 % of a step;
// vectorised (target_clones, a zero-padded image, restrict) the tiny backward went from 4.6 to
// 2.6 ms, and sharing the images among --threads (1 rank x 2 threads) took tiny from 17k to 45k
// images/s.
// The terms of one image: part (C, KH, KW, B) += x * dy over every output position, bsum (B) +=
// dy. x is the image zero-padded to (C, Hp, Wp), so no position needs a bounds check: a padding
// term adds v * g = +-0 to a sum that started at +0, which changes no bit of a finite sum. Each
// (c, kh, kw, b) element is summed in the same order as before vectorising; the b loop is B
// independent lanes (no FMA contraction in ISO C++ mode), so the bits do not depend on the ISA.
template <int B>
[[gnu::always_inline]] inline void image_weight_grad(int C, int KH, int KW, int s, int OH, int OW, int Hp, int Wp,
                                                     const float* __restrict xp, const float* __restrict dyp,
                                                     float* __restrict part, float* __restrict bsum) {
  for (int h = 0; h < OH; ++h)
    for (int w = 0; w < OW; ++w) {
      const float* __restrict g = dyp + (static_cast<std::int64_t>(h) * OW + w) * B;
#pragma omp simd
      for (int b = 0; b < B; ++b) bsum[b] += g[b];
      for (int c = 0; c < C; ++c)
        for (int kh = 0; kh < KH; ++kh) {
          const float* __restrict xr = xp + (static_cast<std::int64_t>(c) * Hp + h * s + kh) * Wp + w * s;
          float* __restrict t = part + (static_cast<std::int64_t>(c) * KH + kh) * KW * B;
          for (int kw = 0; kw < KW; ++kw) {
            const float v = xr[kw];
#pragma omp simd
            for (int b = 0; b < B; ++b) t[kw * B + b] += v * g[b];
          }
        }
    }
}

// The same for a KH x KW window known at compile time (3 x 3 and 5 x 5, the usual first layers): the
// KH * KW accumulators of B lanes live in registers across all output positions instead of being
// loaded and stored at each one. The same terms in the same order, so the same bits.
template <int B, int KH, int KW>
[[gnu::always_inline]] inline void image_weight_grad_k(int C, int s, int OH, int OW, int Hp, int Wp,
                                                       const float* __restrict xp, const float* __restrict dyp,
                                                       float* __restrict part, float* __restrict bsum) {
  for (int c = 0; c < C; ++c) {
    float acc[KH * KW][B];
    float bacc[B];
    float* __restrict t = part + static_cast<std::int64_t>(c) * KH * KW * B;
#pragma GCC unroll 32
    for (int k = 0; k < KH * KW; ++k)
#pragma omp simd
      for (int b = 0; b < B; ++b) acc[k][b] = t[k * B + b];
#pragma omp simd
    for (int b = 0; b < B; ++b) bacc[b] = bsum[b];
    for (int h = 0; h < OH; ++h)
      for (int w = 0; w < OW; ++w) {
        const float* __restrict g = dyp + (static_cast<std::int64_t>(h) * OW + w) * B;
        if (c == 0) {
#pragma omp simd
          for (int b = 0; b < B; ++b) bacc[b] += g[b];
        }
        const float* __restrict xr = xp + (static_cast<std::int64_t>(c) * Hp + h * s) * Wp + w * s;
#pragma GCC unroll 8
        for (int kh = 0; kh < KH; ++kh)
#pragma GCC unroll 8
          for (int kw = 0; kw < KW; ++kw) {
            const float v = xr[kh * Wp + kw];
#pragma omp simd
            for (int b = 0; b < B; ++b) acc[kh * KW + kw][b] += v * g[b];
          }
      }
#pragma GCC unroll 32
    for (int k = 0; k < KH * KW; ++k)
#pragma omp simd
      for (int b = 0; b < B; ++b) t[k * B + b] = acc[k][b];
#pragma omp simd
    for (int b = 0; b < B; ++b) bsum[b] = bacc[b];
  }
}

template <int B>
[[gnu::always_inline]] inline void image_weight_grad_any(int C, int KH, int KW, int s, int OH, int OW, int Hp, int Wp,
                                                         const float* xp, const float* dyp, float* part, float* bsum) {
  if (KH == 3 && KW == 3)
    image_weight_grad_k<B, 3, 3>(C, s, OH, OW, Hp, Wp, xp, dyp, part, bsum);
  else if (KH == 5 && KW == 5)
    image_weight_grad_k<B, 5, 5>(C, s, OH, OW, Hp, Wp, xp, dyp, part, bsum);
  else
    image_weight_grad<B>(C, KH, KW, s, OH, OW, Hp, Wp, xp, dyp, part, bsum);
}

// Built for AVX-512, AVX2 and the baseline, chosen at load time by the CPU (GCC's target_clones):
// the rest of the program is built for the baseline x86-64 so that one build runs anywhere.
MNIST_MPI_CPU_CLONES
void image_weight_grad8(int C, int KH, int KW, int s, int OH, int OW, int Hp, int Wp, const float* xp, const float* dyp,
                        float* part, float* bsum) {
  image_weight_grad_any<8>(C, KH, KW, s, OH, OW, Hp, Wp, xp, dyp, part, bsum);
}
MNIST_MPI_CPU_CLONES
void image_weight_grad16(int C, int KH, int KW, int s, int OH, int OW, int Hp, int Wp, const float* xp,
                         const float* dyp, float* part, float* bsum) {
  image_weight_grad_any<16>(C, KH, KW, s, OH, OW, Hp, Wp, xp, dyp, part, bsum);
}

// db[o] = the sum of dy (N, O/B, plane, B) over images and positions: per image in float, over
// the batch in double (acc, O), B lanes at a time. Note [Bias gradient of a blocked convolution]
template <int B>
[[gnu::always_inline]] inline void bias_grad_blocked(int batch, int O, std::int64_t plane, const float* __restrict dy,
                                                     double* __restrict acc, float* __restrict db) {
  std::fill(acc, acc + O, 0.0);
  for (int n = 0; n < batch; ++n)
    for (int ob = 0; ob < O / B; ++ob) {
      const float* __restrict g = dy + (static_cast<std::int64_t>(n) * (O / B) + ob) * plane * B;
      float sum[B] = {};
      for (std::int64_t q = 0; q < plane; ++q)
#pragma omp simd
        for (int b = 0; b < B; ++b) sum[b] += g[q * B + b];
      for (int b = 0; b < B; ++b) acc[ob * B + b] += sum[b];
    }
  for (int o = 0; o < O; ++o) db[o] = static_cast<float>(acc[o]);
}
MNIST_MPI_CPU_CLONES
void bias_grad_blocked8(int batch, int O, std::int64_t plane, const float* dy, double* acc, float* db) {
  bias_grad_blocked<8>(batch, O, plane, dy, acc, db);
}
MNIST_MPI_CPU_CLONES
void bias_grad_blocked16(int batch, int O, std::int64_t plane, const float* dy, double* acc, float* db) {
  bias_grad_blocked<16>(batch, O, plane, dy, acc, db);
}

// Note [The first convolution reads its pool's gradient]
// In tiny (conv 1 -> 8, then a 2 x 2 max pool) the pool's backward wrote the convolution's whole dy,
// 128 x 8 x 28 x 28 floats per step (a memset and a scatter, dx[argmax] += dy), and the own
// weight-gradient loop above read it back: two passes over 3.2 MB that the cache does not hold,
// ~9 % of a tiny step. When a 2 x 2, stride-2 max pool with blocked input and output tiles the
// output of a first convolution (plain input, own weight-gradient loop), the pool writes no dx:
// it hands the convolution its dy and argmax (ConvPoolLink::pooled, Note [The fusion plan] in fusion.cpp), and
// the convolution rebuilds one image's dy block at a time in a per-thread scratch that stays in
// L1 (expand_pooled_dy: 0 + dy where the window's argmax points, 0 + 0 elsewhere: exactly what
// memset + scatter wrote, -0 turned into +0 included) and runs the same loop on it. Same terms in
// the same order, so the same bits. tiny's shape (3 x 3, stride 1, B = 8, on AVX2) skips the scratch
// too: pooled_image_weight_grad_3x3 forms dy from the pool's gradient in registers.
// make_cpu_backend(threads, {.pool_gradient = false}) keeps the layers apart
// (BlockedLayouts.PoolGradientIntoFirstConvIsBitwiseTheSame compares the two).
// One image's block: pdy and parg (OH / 2, OW / 2, B), base = the block's offset within the
// convolution's output sample (argmax counts from the sample's start); g (OH, OW, B).
template <int B>
[[gnu::always_inline]] inline void expand_pooled_dy(int OH, int OW, std::int32_t base, const float* __restrict pdy,
                                                    const std::int32_t* __restrict parg, float* __restrict g) {
  const int PW = OW / 2;
  for (int h = 0; h < OH; ++h)
    for (int w = 0; w < OW; ++w) {
      const int q = ((h / 2) * PW + w / 2) * B;
      const std::int32_t at = base + (h * OW + w) * B;
      float* __restrict gp = g + (h * OW + w) * B;
      // Branch-free (a mask) so that it vectorises B wide.
#pragma omp simd
      for (int b = 0; b < B; ++b) {
        const std::uint32_t hit = 0u - static_cast<std::uint32_t>(parg[q + b] == at + b);  // all ones or zero
        gp[b] = std::bit_cast<float>(std::bit_cast<std::uint32_t>(pdy[q + b]) & hit) + 0.0f;
      }
    }
}
MNIST_MPI_CPU_CLONES
void expand_pooled_dy8(int OH, int OW, std::int32_t base, const float* pdy, const std::int32_t* parg, float* g) {
  expand_pooled_dy<8>(OH, OW, base, pdy, parg, g);
}
MNIST_MPI_CPU_CLONES
void expand_pooled_dy16(int OH, int OW, std::int32_t base, const float* pdy, const std::int32_t* parg, float* g) {
  expand_pooled_dy<16>(OH, OW, base, pdy, parg, g);
}

// The same terms for tiny's shape (3 x 3, stride 1, B = 8) read straight from the pool's gradient,
// with AVX2: the dy block is never written (the two positions of a window row share one load of
// the pool's dy and argmax, g = dy where the argmax points, +0 elsewhere, as expand_pooled_dy), and
// the two positions share the broadcasts of the pixels both read. Each (c, kh, kw) accumulator
// still gets x * g (a multiply, then an add: two roundings, as the loop above) position by
// position in (h, w) order, so the same bits. OW is even (the pool tiles the convolution's output).
__attribute__((target("avx2"))) void pooled_image_weight_grad_3x3(int C, int OH, int OW, int Hp, int Wp,
                                                                  std::int32_t base, const float* xp, const float* pdy,
                                                                  const std::int32_t* parg, float* part, float* bsum) {
  constexpr int B = 8, K = 3;
  const int PW = OW / 2;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 zero = _mm256_setzero_ps();
  for (int c = 0; c < C; ++c) {
    float* t = part + static_cast<std::int64_t>(c) * K * K * B;
    __m256 acc[K * K];
#pragma GCC unroll 9
    for (int k = 0; k < K * K; ++k) acc[k] = _mm256_loadu_ps(t + k * B);
    __m256 bacc = _mm256_loadu_ps(bsum);
    for (int h = 0; h < OH; ++h) {
      const float* xr = xp + (static_cast<std::int64_t>(c) * Hp + h) * Wp;
      const float* pd = pdy + static_cast<std::int64_t>(h / 2) * PW * B;
      const std::int32_t* pa = parg + static_cast<std::int64_t>(h / 2) * PW * B;
      __m256i at = _mm256_add_epi32(lane, _mm256_set1_epi32(base + h * OW * B));
      const __m256i step = _mm256_set1_epi32(B);
      for (int w = 0; w < OW; w += 2, pd += B, pa += B) {
        const __m256 d = _mm256_loadu_ps(pd);
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pa));
        const __m256 g0 = _mm256_add_ps(_mm256_and_ps(d, _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, at))), zero);
        at = _mm256_add_epi32(at, step);
        const __m256 g1 = _mm256_add_ps(_mm256_and_ps(d, _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, at))), zero);
        at = _mm256_add_epi32(at, step);
        if (c == 0) bacc = _mm256_add_ps(_mm256_add_ps(bacc, g0), g1);
#pragma GCC unroll 3
        for (int kh = 0; kh < K; ++kh) {
          const float* xk = xr + kh * Wp + w;
#pragma GCC unroll 4
          for (int col = 0; col <= K; ++col) {  // pixel w + col: tap col of position w, col - 1 of w + 1
            const __m256 xb = _mm256_broadcast_ss(xk + col);
            if (col < K) acc[kh * K + col] = _mm256_add_ps(acc[kh * K + col], _mm256_mul_ps(xb, g0));
            if (col > 0) acc[kh * K + col - 1] = _mm256_add_ps(acc[kh * K + col - 1], _mm256_mul_ps(xb, g1));
          }
        }
      }
    }
#pragma GCC unroll 9
    for (int k = 0; k < K * K; ++k) _mm256_storeu_ps(t + k * B, acc[k]);
    if (c == 0) _mm256_storeu_ps(bsum, bacc);
  }
}

// Per-thread scratch of the own weight-gradient loop, made at build for `threads` threads.
struct OwnScratch {
  int threads = 1;
  std::int64_t xpad_size = 0, part_size = 0;
  std::vector<float> xpad;   // (threads, C, Hp, Wp): one image, zero-padded; the border stays zero
  std::vector<float> part;   // (threads, C, KH, KW, B): one image's sum for one channel block
  std::vector<double> acc;   // (threads, O/B, C, KH, KW, B): the thread's images, summed
  std::vector<double> bias;  // (threads, O)
  std::vector<float> dy;     // (threads, OH, OW, B): one image's dy block, rebuilt from the pool's
  bool pooled_3x3 = false;   // pooled_image_weight_grad_3x3 reads the pool's gradient instead (no dy)
};

// Images are shared out among the threads in fixed contiguous chunks (schedule static); each
// thread sums its chunk in image order, and the chunks' sums are added in thread order. So the
// bits depend on the thread count (not on timing), and one thread gives exactly the serial sum.
// Hp = (OH - 1) * stride + KH, Wp likewise.
// pooled (may be null or empty): read the pool's gradient instead of dy (Note [The first
// convolution reads its pool's gradient]).
template <int B>
void plain_input_weight_grad(const LayerSpec& l, int batch, const float* x, const float* dy,
                             const PooledGradient* pooled, OwnScratch& sc, float* dw, float* db) {
  const int C = l.in.c, H = l.in.h, W = l.in.w, O = l.out.c, OH = l.out.h, OW = l.out.w, KH = l.kernel_h,
            KW = l.kernel_w, s = l.stride;
  const int Hp = (OH - 1) * s + KH, Wp = (OW - 1) * s + KW;
  const std::int64_t per_block = static_cast<std::int64_t>(C) * KH * KW * B;  // (C, KH, KW, B)
  const std::int64_t acc_size = (O / B) * per_block;
  std::fill(sc.acc.begin(), sc.acc.end(), 0.0);
  std::fill(sc.bias.begin(), sc.bias.end(), 0.0);
#pragma omp parallel num_threads(sc.threads)
  {
    const int t = omp_get_thread_num();
    float* xpad = sc.xpad.data() + t * sc.xpad_size;
    float* part = sc.part.data() + t * sc.part_size;
    double* acc = sc.acc.data() + t * acc_size;
    double* bias_sum = sc.bias.data() + static_cast<std::int64_t>(t) * O;
    const bool from_pool = pooled != nullptr && pooled->dy != nullptr;
    const std::int64_t block = static_cast<std::int64_t>(OH) * OW * B;  // one image's dy block
    float* dy_block = from_pool && !sc.pooled_3x3 ? sc.dy.data() + t * block : nullptr;
    const int copy_begin = std::max(0, -l.pad_left), copy_end = std::min(W, Wp - l.pad_left);  // columns
#pragma omp for schedule(static)
    for (int n = 0; n < batch; ++n) {
      const float* xs = x + static_cast<std::int64_t>(n) * C * H * W;  // (C, H, W)
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < H; ++i) {  // columns copy_begin <= j < copy_end land inside the padded row
          const int ph = i + l.pad_top;
          if (ph < 0 || ph >= Hp || copy_begin >= copy_end) continue;
          const float* from = xs + (static_cast<std::int64_t>(c) * H + i) * W;
          std::copy(from + copy_begin, from + copy_end,
                    xpad + (static_cast<std::int64_t>(c) * Hp + ph) * Wp + copy_begin + l.pad_left);
        }
      for (int ob = 0; ob < O / B; ++ob) {
        // One image's sum in float (OH * OW terms), added to the thread's sum in double.
        std::fill(part, part + per_block, 0.0f);
        float bsum[B] = {};
        const float* dyp = dy + (static_cast<std::int64_t>(n) * (O / B) + ob) * block;        // (OH, OW, B)
        const std::int64_t at = (static_cast<std::int64_t>(n) * (O / B) + ob) * (block / 4);  // (OH/2, OW/2, B)
        const auto base = static_cast<std::int32_t>(ob * block);
        if (from_pool && sc.pooled_3x3) {
          pooled_image_weight_grad_3x3(C, OH, OW, Hp, Wp, base, xpad, pooled->dy + at, pooled->argmax + at, part, bsum);
        } else {
          if (from_pool) {
            if constexpr (B == 8)
              expand_pooled_dy8(OH, OW, base, pooled->dy + at, pooled->argmax + at, dy_block);
            else
              expand_pooled_dy16(OH, OW, base, pooled->dy + at, pooled->argmax + at, dy_block);
            dyp = dy_block;
          }
          if constexpr (B == 8)
            image_weight_grad8(C, KH, KW, s, OH, OW, Hp, Wp, xpad, dyp, part, bsum);
          else
            image_weight_grad16(C, KH, KW, s, OH, OW, Hp, Wp, xpad, dyp, part, bsum);
        }
        double* a = acc + ob * per_block;
        for (std::int64_t k = 0; k < per_block; ++k) a[k] += part[k];
        for (int b = 0; b < B; ++b) bias_sum[ob * B + b] += bsum[b];
      }
    }
  }
  for (int t = 1; t < sc.threads; ++t) {  // the chunks' sums in thread order
    for (std::int64_t k = 0; k < acc_size; ++k) sc.acc[k] += sc.acc[t * acc_size + k];
    for (int o = 0; o < O; ++o) sc.bias[o] += sc.bias[static_cast<std::int64_t>(t) * O + o];
  }
  for (int o = 0; o < O; ++o) db[o] = static_cast<float>(sc.bias[o]);
  const std::int64_t k_count = static_cast<std::int64_t>(C) * KH * KW;
  for (int o = 0; o < O; ++o)
    for (std::int64_t k = 0; k < k_count; ++k)
      dw[o * k_count + k] = static_cast<float>(sc.acc[((o / B) * k_count + k) * B + o % B]);
}

// Note [The first convolution and its pool in one pass]
// tiny's first convolution (one input channel, 3x3, 8 outputs) wrote 128 x 8 x 28 x 28 floats
// per step (3.2 MB, at 35 % of the sgemm rate: oneDNN's kernel for one input channel is mostly
// driver and stores), and the 2 x 2 max pool after it read them all back to keep a quarter. When
// such a pool (tiling its input, blocked in and out) follows a first convolution of one input
// channel and stride 1 whose output is blocked, the pool computes the convolution itself, window by
// window: the four positions of a window, B output channels wide, in registers, then their maximum
// and argmax; the convolution's output is never written (nothing else reads it: its weight
// gradient reads x and the pool's gradient). Each output is the sum oneDNN's direct kernels
// form: the bias, then one fused multiply-add per tap in (kh, kw) order, taps outside the image
// skipped. std::fma rounds once, the same on every CPU; the kernel is built with FMA for CPUs that
// have it (chosen once, at build) and falls back to libm's fmaf, slower but the same bits.
// make_cpu_backend(threads, {.conv_pool_forward = false}) keeps the two layers apart;
// BlockedLayouts.FirstConvAndPoolInOnePass compares the two.
// One sample: x (H, W); wt (O/B, KH, KW, B) and bias (O) from the layer's weights; y and arg
// (may be null) the pool's, blocked (O/B, PH, PW, B), arg counting from the convolution output
// sample's start as MaxPool's argmax does.
template <int B>
[[gnu::always_inline]] inline void conv_pool_sample(const LayerSpec& l, const float* __restrict x,
                                                    const float* __restrict wt, const float* __restrict bias,
                                                    float* __restrict y, std::int32_t* __restrict arg) {
  const int H = l.in.h, W = l.in.w, OH = l.out.h, OW = l.out.w, KH = l.kernel_h, KW = l.kernel_w;
  const int PH = OH / 2, PW = OW / 2;
  for (int ob = 0; ob < l.channels / B; ++ob) {
    const float* __restrict wb = wt + static_cast<std::int64_t>(ob) * KH * KW * B;
    for (int i = 0; i < PH; ++i)
      for (int j = 0; j < PW; ++j) {
        float best[B];
        std::int32_t best_at[B];
        for (int q = 0; q < 4; ++q) {  // (0, 0), (0, 1), (1, 0), (1, 1): MaxPool's scan order
          const int h = 2 * i + q / 2, w = 2 * j + q % 2;
          float acc[B];
#pragma omp simd
          for (int b = 0; b < B; ++b) acc[b] = bias[ob * B + b];
          for (int kh = 0; kh < KH; ++kh) {
            const int ih = h + kh - l.pad_top;
            if (ih < 0 || ih >= H) continue;
            for (int kw = 0; kw < KW; ++kw) {
              const int iw = w + kw - l.pad_left;
              if (iw < 0 || iw >= W) continue;
              const float v = x[ih * W + iw];
              const float* __restrict wk = wb + (kh * KW + kw) * B;
#pragma omp simd
              for (int b = 0; b < B; ++b) acc[b] = std::fma(wk[b], v, acc[b]);
            }
          }
          const std::int32_t at = ((ob * OH + h) * OW + w) * B;
          if (q == 0) {
#pragma omp simd
            for (int b = 0; b < B; ++b) {
              best[b] = acc[b];
              best_at[b] = at + b;
            }
          } else {  // Note [The max pool's tie rule] in pool_rule.hpp
#pragma omp simd
            for (int b = 0; b < B; ++b) pool_take(acc[b], at + b, best[b], best_at[b]);
          }
        }
        const std::int64_t o = ((static_cast<std::int64_t>(ob) * PH + i) * PW + j) * B;
#pragma omp simd
        for (int b = 0; b < B; ++b) y[o + b] = best[b];
        if (arg) {
#pragma omp simd
          for (int b = 0; b < B; ++b) arg[o + b] = best_at[b];
        }
      }
  }
}

// A ConvPoolKernel (src/backend/cpu/dnnl_util.hpp).
template <int B>
void conv_pool_any(const LayerSpec& l, int, std::int64_t first, std::int64_t count, const float* x, const float* wt,
                   const float* bias, float* y, std::int32_t* arg) {
  const std::int64_t in = static_cast<std::int64_t>(l.in.h) * l.in.w, out = l.out.size() / 4;
  for (std::int64_t n = first; n < first + count; ++n)
    conv_pool_sample<B>(l, x + n * in, wt, bias, y + n * out, arg ? arg + n * out : nullptr);
}

// The same with AVX2 + FMA intrinsics, 8 lanes at a time (B = 16: two halves): every tap is one
// _mm256_fmadd_ps (one rounding, as std::fma) in the same (kh, kw) order. The loops run over input
// pixels rather than over taps: one broadcast of a pixel feeds every sum of the block that reads it
// (each sum still gets its taps in (kh, kw) order), and a pixel outside the image is skipped, which
// skips exactly the taps oneDNN leaves out. Two windows side by side (eight sums, eight independent
// FMA chains: Zen's FMA has a latency of 5 and a throughput of 1) where both lie inside the image;
// otherwise (border windows, and the last interior window of a row when their count is odd) one
// window (four chains) with every pixel checked. KH, KW known at compile time (3 x 3, 5 x 5) unroll
// everything; 0 reads them from the layer (kh_n, kw_n).
// window_sums: the sums of NW windows side by side, acc[h][p] for the window rows' output row h
// (0, 1) and output column p (0 .. 2 NW - 1); (r0, c0) is the input pixel under the first window's
// top-left tap (negative or past the image at the border: those pixels are skipped when kCheck).
template <int KH, int KW, int NW, bool kCheck>
__attribute__((target("avx2,fma"), always_inline)) inline void window_sums(const float* x, int H, int W, int kh_n,
                                                                           int kw_n, int r0, int c0, const float* wk,
                                                                           int B, __m256 bv, __m256 (&acc)[2][2 * NW]) {
  const int rows = kh_n + 1, cols = 2 * NW + kw_n - 1;  // the input pixels the windows read
#pragma GCC unroll 4
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
    for (int p = 0; p < 2 * NW; ++p) acc[h][p] = bv;
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) {
    const int ir = r0 + r;
    if (kCheck && (ir < 0 || ir >= H)) continue;
#pragma GCC unroll 12
    for (int c = 0; c < cols; ++c) {
      const int ic = c0 + c;
      if (kCheck && (ic < 0 || ic >= W)) continue;
      const __m256 xb = _mm256_broadcast_ss(x + ir * W + ic);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int kh = r - h;
        if (kh < 0 || kh >= kh_n) continue;
#pragma GCC unroll 4
        for (int p = 0; p < 2 * NW; ++p) {
          const int kw = c - p;
          if (kw < 0 || kw >= kw_n) continue;
          acc[h][p] = _mm256_fmadd_ps(_mm256_loadu_ps(wk + (kh * kw_n + kw) * B), xb, acc[h][p]);
        }
      }
    }
  }
}

// The 2 x 2 maximum and its argmax of window win (0 .. NW - 1) of window_sums' block (Note [The max pool's tie rule] in
// pool_rule.hpp); at0 = the index of the window's top-left position in the convolution's output sample, plus the lane.
template <int NW>
__attribute__((target("avx2,fma"), always_inline)) inline void window_max(const __m256 (&acc)[2][2 * NW], int win,
                                                                          __m256i at0, int row_step, float* y,
                                                                          std::int32_t* arg, int B) {
  __m256 best = acc[0][2 * win];
  __m256i best_at = at0;
  const int step[4] = {0, B, row_step, row_step + B};
#pragma GCC unroll 4
  for (int q = 1; q < 4; ++q) {
    const __m256 v = acc[q / 2][2 * win + q % 2];
    const __m256 more = pool_replaces(v, best);
    const __m256i at = _mm256_add_epi32(at0, _mm256_set1_epi32(step[q]));
    best = _mm256_blendv_ps(best, v, more);
    best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), more));
  }
  _mm256_storeu_ps(y, best);
  if (arg) _mm256_storeu_si256(reinterpret_cast<__m256i*>(arg), best_at);
}

template <int KH, int KW>
__attribute__((target("avx2,fma"))) void conv_pool_avx2(const LayerSpec& l, int B, std::int64_t first,
                                                        std::int64_t count, const float* xs, const float* wt,
                                                        const float* bias, float* ys, std::int32_t* args) {
  const int H = l.in.h, W = l.in.w, OH = l.out.h, OW = l.out.w, kh_n = KH > 0 ? KH : l.kernel_h,
            kw_n = KW > 0 ? KW : l.kernel_w;
  const int PH = OH / 2, PW = OW / 2, pt = l.pad_top, pl = l.pad_left, taps = kh_n * kw_n;
  const std::int64_t in = static_cast<std::int64_t>(H) * W, out = l.out.size() / 4;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Window j lies inside the image (no tap skipped) for j in [j0, j1): 2 j - pl >= 0 and
  // 2 j <= last_col2 (its last pixel, 2 j + 1 + kw_n - 1 - pl, at most W - 1); rows likewise.
  const int last_col2 = W - 1 + pl - kw_n, last_row2 = H - 1 + pt - kh_n;
  const int j0 = (pl + 1) / 2, j1 = last_col2 < 0 ? j0 : std::clamp(last_col2 / 2 + 1, j0, std::max(j0, PW));
  const int i0 = (pt + 1) / 2, i1 = last_row2 < 0 ? i0 : std::clamp(last_row2 / 2 + 1, i0, std::max(i0, PH));
  for (std::int64_t n = first; n < first + count; ++n) {
    const float* x = xs + n * in;
    float* y = ys + n * out;
    std::int32_t* arg = args ? args + n * out : nullptr;
    for (int ob = 0; ob < l.channels / B; ++ob)
      for (int half = 0; half < B / 8; ++half) {
        const float* wk = wt + static_cast<std::int64_t>(ob) * taps * B + half * 8;  // (KH, KW, B), 8 lanes
        const __m256 bv = _mm256_loadu_ps(bias + ob * B + half * 8);
        for (int i = 0; i < PH; ++i) {
          const bool row_inside = i >= i0 && i < i1;
          const int r0 = 2 * i - pt;
          const std::int64_t out_row = (static_cast<std::int64_t>(ob) * PH + i) * PW * B + half * 8;
          const int at_row = (ob * OH + 2 * i) * OW * B + half * 8;
          for (int j = 0; j < PW;) {
            if (row_inside && j >= j0 && j + 1 < j1) {
              __m256 acc[2][4];
              window_sums<KH, KW, 2, false>(x, H, W, kh_n, kw_n, r0, 2 * j - pl, wk, B, bv, acc);
#pragma GCC unroll 2
              for (int win = 0; win < 2; ++win) {
                const std::int64_t o = out_row + static_cast<std::int64_t>(j + win) * B;
                const __m256i at0 = _mm256_add_epi32(lane, _mm256_set1_epi32(at_row + 2 * (j + win) * B));
                window_max<2>(acc, win, at0, OW * B, y + o, arg ? arg + o : nullptr, B);
              }
              j += 2;
            } else {
              __m256 acc[2][2];
              window_sums<KH, KW, 1, true>(x, H, W, kh_n, kw_n, r0, 2 * j - pl, wk, B, bv, acc);
              const std::int64_t o = out_row + static_cast<std::int64_t>(j) * B;
              const __m256i at0 = _mm256_add_epi32(lane, _mm256_set1_epi32(at_row + 2 * j * B));
              window_max<1>(acc, 0, at0, OW * B, y + o, arg ? arg + o : nullptr, B);
              j += 1;
            }
          }
        }
      }
  }
}

// Note [Three kernels for one fused pass]
// The first convolution and its pool are computed in one pass by three kernels: conv_pool_any
// (portable), conv_pool_avx2 (fp32, AVX2 + FMA) and FirstConvBf16 (bf16.cpp, AVX512-BF16, the
// ReLU too). They share the pool's rule (Note [The max pool's tie rule] in pool_rule.hpp) and the
// argmax's numbering, and only that: the fp32 two are one computation (the same fused multiply-adds
// in the same order, the same bits: the BlockedLayouts tests compare them), kept twice because the
// portable one is the fallback of a CPU without AVX2 or FMA (one build runs on every x86-64) and the
// plain loop the intrinsics are checked against, while the AVX2 one is the fast path (a pixel's
// broadcast shared by every sum that reads it, eight FMA chains). The bf16 one cannot be either: it
// rounds x and w to bf16 and adds products in pairs, so its bits differ by design.
// The pass's kernel for this layer, block and CPU (CpuFusions::avx2_kernels = false: the portable one).
ConvPoolKernel choose_conv_pool_kernel(const LayerSpec& l, int block, bool avx2_kernels) {
  if (!avx2_kernels || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    return block == 8 ? conv_pool_any<8> : conv_pool_any<16>;
  if (l.kernel_h == 3 && l.kernel_w == 3) return conv_pool_avx2<3, 3>;
  if (l.kernel_h == 5 && l.kernel_w == 5) return conv_pool_avx2<5, 5>;
  return conv_pool_avx2<0, 0>;
}

}  // namespace

bool first_conv_pool_fits(const LayerSpec& conv, Layout x_layout, Layout y_layout) {
  return conv.in.c == 1 && conv.stride == 1 && x_layout == Layout::kPlain && y_layout != Layout::kPlain &&
         conv.out.h % 2 == 0 && conv.out.w % 2 == 0;
}

FirstConvForward first_conv_forward(const Context& c, const LayerSpec& conv, const LayerBuffers& b) {
  const float* bias = b.w + static_cast<std::int64_t>(conv.channels) * conv.in.c * conv.kernel_h * conv.kernel_w;
  return FirstConvForward{b.x, b.w, bias, conv,
                          choose_conv_pool_kernel(conv, block_size(b.y_layout), c.fuse.avx2_kernels)};
}

void first_conv_pool_forward(const FirstConvForward& f, int block, int batch, float* wt, float* y, std::int32_t* arg) {
  const LayerSpec& l = f.l;
  const int k = l.kernel_h * l.kernel_w;
  for (int o = 0; o < l.channels; ++o) {  // OIHW -> (O/B, KH, KW, B): 72 floats for tiny, each step
    for (int t = 0; t < k; ++t) wt[((o / block) * k + t) * block + o % block] = f.w[o * k + t];
  }
  // Samples are independent: shared out among --threads in fixed chunks (same bits for any count).
#pragma omp parallel
  {
    const std::int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    const std::int64_t first = batch * t / threads, last = batch * (t + 1) / threads;
    f.kernel(l, block, first, last - first, f.x, wt, f.bias, y, arg);
  }
}

namespace {

bool is_ref(const std::string& impl_name) { return impl_name.rfind("ref", 0) == 0; }

// Convolution l's oneDNN shapes at a batch, its memory formats for these layouts (Note [One block is
// NHWC]) and its memory descriptors: the one place they are set up, for the primitives, the bf16
// ones and the probes below.
struct ConvGeometry {
  using dims = dnnl::memory::dims;
  dims src, wei, bia, dst;  // (N, C, H, W), (O, I, KH, KW), (O), (N, O, OH, OW)
  dims strides, pad_l, pad_r;
  tag src_tag, dst_tag;
  ConvGeometry(const LayerSpec& l, dnnl::memory::dim batch, Layout x_layout, Layout y_layout)
      : src{batch, l.in.c, l.in.h, l.in.w},
        wei{l.channels, l.in.c, l.kernel_h, l.kernel_w},
        bia{l.channels},
        dst{batch, l.out.c, l.out.h, l.out.w},
        strides{l.stride, l.stride},
        pad_l{l.pad_top, l.pad_left},
        pad_r{l.pad_bottom, l.pad_right} {
    std::tie(src_tag, dst_tag) = conv_tags(x_layout, l.in.c, y_layout, l.out.c);
  }
  dnnl::memory::desc src_md(dt t) const { return {src, t, src_tag}; }
  dnnl::memory::desc wei_any(dt t) const { return {wei, t, tag::any}; }  // the primitive's choice
  dnnl::memory::desc bia_md() const { return {bia, dt::f32, tag::x}; }
  dnnl::memory::desc dst_md(dt t) const { return {dst, t, dst_tag}; }
};

// How an fp32 convolution's weight gradient is computed (bw_is_ref: whether oneDNN's kernel for it
// is a reference one); the fusion plan asks too (conv_weight_grad), since a pool hands its
// gradient only to an own loop.
ConvWeightGrad choose_weight_grad(const Context& c, const LayerSpec& l, Layout x_layout, Layout y_layout, bool first,
                                  bool bw_is_ref) {
  if (bw_is_ref && x_layout == Layout::kPlain && y_layout != Layout::kPlain)
    return ConvWeightGrad::kOwnLoop;  // Note [Weight gradient of a plain-input convolution]
  if (first && c.fuse.bf16 && y_layout == Layout::kBlocked16 && first_conv_weight_grad_bf16_fits(l))
    return ConvWeightGrad::kOwnBf16;  // Note [The first convolution's weight gradient in bf16] in bf16.cpp
  return ConvWeightGrad::kOneDnn;
}

// The forward primitive of convolution l on these memory descriptors (fp32, or bf16 inputs).
dnnl::convolution_forward::primitive_desc conv_forward_pd(const Context& c, const LayerSpec& l, bool training,
                                                          const dnnl::memory::desc& src, const dnnl::memory::desc& wei,
                                                          const dnnl::memory::desc& bia, const dnnl::memory::desc& dst) {
  return dnnl::convolution_forward::primitive_desc(
      dnnl::convolution_forward::desc(
          training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference,
          dnnl::algorithm::convolution_direct, src, wei, bia, dst, {l.stride, l.stride}, {l.pad_top, l.pad_left},
          {l.pad_bottom, l.pad_right}),
      user_scratchpad(), c.engine);
}

class Conv final : public LayerKernel {
 public:
  // Long on purpose (Note [Why a function is long] in docs/style.md): oneDNN's primitives for the
  // three passes are made once here from one set of memory descriptors; they share every local.
  Conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training, bool first, const LayerFusion& f)
      : c_(c),
        w_begin_(b.w),
        w_end_(b.w + static_cast<std::int64_t>(l.channels) * l.in.c * l.kernel_h * l.kernel_w),
        link_(f.link),
        forward_in_pool_(f.forward_in_pool != ConvInPool::kNo),
        reads_pool_gradient_(f.reads_pool_gradient),
        pool_writes_bf16_dy_(f.pool_writes_bf16_dy) {
    if (c.fuse.bf16 && !first) {  // Note [bf16 on the CPU] in src/backend/cpu/cpu_backend.cpp
      build_bf16(l, b, training);
      return;
    }
    const ConvGeometry g(l, b.batch, b.x_layout, b.y_layout);
    const auto& [src, wei, bia, dst, strides, pad_l, pad_r, src_tag, dst_tag] = g;
    const dnnl::memory::desc src_md = g.src_md(dt::f32), wei_any = g.wei_any(dt::f32), bia_md = g.bia_md(),
                             dst_md = g.dst_md(dt::f32);
    const float* bias = b.w + l.channels * l.in.c * l.kernel_h * l.kernel_w;
    const dnnl::memory user_w = wrap(c, wei, tag::oihw, b.w);

    const dnnl::convolution_forward::primitive_desc fwd =
        conv_forward_pd(c, l, training, src_md, wei_any, bia_md, dst_md);
    desc_ = "conv fwd " + impl(fwd);
    w_fwd_ = maybe_reorder(c, user_w, fwd.weights_desc(), true);
    fwd_ = bind<dnnl::convolution_forward>(c, fwd,
                                           {{DNNL_ARG_SRC, wrap(c, src, src_tag, b.x)},
                                            {DNNL_ARG_WEIGHTS, w_fwd_.mem},
                                            {DNNL_ARG_BIAS, wrap(c, bia, tag::x, bias)},
                                            {DNNL_ARG_DST, wrap(c, dst, dst_tag, b.y)}});
    if (!training) return;
    if (b.dx) {  // the first layer computes no input gradient
      dnnl::convolution_backward_data::primitive_desc bd(
          dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, src_md, wei_any, dst_md, strides,
                                                pad_l, pad_r),
          user_scratchpad(), c.engine, fwd);
      desc_ += ", bwd-data " + impl(bd);
      w_bwd_ = weights_for_backward_data(c, w_fwd_, user_w, bd.weights_desc());  // see the Note
      bwd_data_ = bind<dnnl::convolution_backward_data>(c, bd,
                                                        {{DNNL_ARG_DIFF_DST, wrap(c, dst, dst_tag, b.dy)},
                                                         {DNNL_ARG_WEIGHTS, w_bwd_.mem},
                                                         {DNNL_ARG_DIFF_SRC, wrap(c, src, src_tag, b.dx)}});
    }
    float* dbias = b.dw + (bias - b.w);
    dnnl::convolution_backward_weights::primitive_desc bw(
        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_md, wei_any, bia_md, dst_md,
                                                 strides, pad_l, pad_r),
        user_scratchpad(), c.engine, fwd);
    const ConvWeightGrad kind = choose_weight_grad(c, l, b.x_layout, b.y_layout, first, is_ref(impl(bw)));
    if (kind == ConvWeightGrad::kOwnLoop) {
      // Note [Weight gradient of a plain-input convolution]
      desc_ += ", bwd-weights own loop (plain x, blocked dy)";
      l_ = l;
      b_ = b;
      const int threads = std::max(1, omp_get_max_threads());
      own_.threads = threads;
      own_.xpad_size = static_cast<std::int64_t>(l.in.c) * ((l.out.h - 1) * l.stride + l.kernel_h) *
                       ((l.out.w - 1) * l.stride + l.kernel_w);
      own_.part_size = static_cast<std::int64_t>(l.in.c) * l.kernel_h * l.kernel_w * 16;  // B <= 16
      own_.xpad.assign(static_cast<std::size_t>(threads * own_.xpad_size), 0.0f);
      own_.part.assign(static_cast<std::size_t>(threads * own_.part_size), 0.0f);
      own_.acc.assign(static_cast<std::size_t>(threads) * l.channels * l.in.c * l.kernel_h * l.kernel_w, 0.0);
      own_.bias.assign(static_cast<std::size_t>(threads) * l.channels, 0.0);
      if (reads_pool_gradient_) {  // Note [The first convolution reads its pool's gradient]
        own_.pooled_3x3 = c.fuse.avx2_kernels && __builtin_cpu_supports("avx2") && b.y_layout == Layout::kBlocked8 &&
                          l.kernel_h == 3 && l.kernel_w == 3 && l.stride == 1;
        if (!own_.pooled_3x3)
          own_.dy.assign(static_cast<std::size_t>(threads) * l.out.h * l.out.w * 16, 0.0f);  // B <= 16
      }
      return;
    }
    // Note [The first convolution's weight gradient in bf16] in src/backend/cpu/bf16.cpp: the
    // weights' and the bias's gradient in one loop of our own; oneDNN's is not built.
    if (kind == ConvWeightGrad::kOwnBf16) {  // a pool after it may hand its gradient over, a ReLU's mask too
      bf16_grad_.emplace(l, std::max(1, omp_get_max_threads()));
      desc_ += ", bwd-weights own bf16 loop with the bias";
      l_ = l;
      b_ = b;
      return;
    }
    if (b.y_layout != Layout::kPlain) {
      // Note [Bias gradient of a blocked convolution]
      // oneDNN 2.6's jit backward-weights sums the bias gradient in baseline C++ (SSE, perf: ~5 % of
      // a tiny step); over blocked dy it is B contiguous lanes per position, which our loop sums
      // vectorised: per image in float, over the batch in double, in a fixed order.
      dnnl::convolution_backward_weights::primitive_desc bw_nb(
          dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_md, wei_any, dst_md,
                                                   strides, pad_l, pad_r),
          user_scratchpad(), c.engine, fwd);
      if (!is_ref(impl(bw_nb))) {
        desc_ += ", bwd-weights " + impl(bw_nb) + " + own bias sum";
        dw_ = maybe_reorder(c, wrap(c, wei, tag::oihw, b.dw), bw_nb.diff_weights_desc(), false);
        bwd_weights_ = bind<dnnl::convolution_backward_weights>(c, bw_nb,
                                                                {{DNNL_ARG_SRC, wrap(c, src, src_tag, b.x)},
                                                                 {DNNL_ARG_DIFF_DST, wrap(c, dst, dst_tag, b.dy)},
                                                                 {DNNL_ARG_DIFF_WEIGHTS, dw_.mem}});
        own_bias_ = true;
        l_ = l;
        b_ = b;
        bias_acc_.assign(static_cast<std::size_t>(l.channels), 0.0);
        return;
      }
    }
    desc_ += ", bwd-weights " + impl(bw);
    dw_ = maybe_reorder(c, wrap(c, wei, tag::oihw, b.dw), bw.diff_weights_desc(), false);
    bwd_weights_ = bind<dnnl::convolution_backward_weights>(c, bw,
                                                            {{DNNL_ARG_SRC, wrap(c, src, src_tag, b.x)},
                                                             {DNNL_ARG_DIFF_DST, wrap(c, dst, dst_tag, b.dy)},
                                                             {DNNL_ARG_DIFF_WEIGHTS, dw_.mem},
                                                             {DNNL_ARG_DIFF_BIAS, wrap(c, bia, tag::x, dbias)}});
  }

  void forward(const StepContext& /*ctx*/) override {
    if (forward_in_pool_) return;  // the pool computes it (Note [The fusion plan] in fusion.cpp)
    if (w_fwd_copy_.take(copies_tracked_)) w_fwd_.run(c_);  // Note [Weight copies kept between passes]
    if (x_to_bf16_) x_to_bf16_->run(c_);
    fwd_.run(c_);
  }
  void backward(const StepContext& /*ctx*/) override {
    const bool pool_wrote_dy = pool_writes_bf16_dy_;  // and the bias's gradient
    if (dy_to_bf16_ && !pool_wrote_dy) dy_to_bf16_->run(c_);
    if (bwd_data_) {
      if (w_bwd_copy_.take(copies_tracked_)) w_bwd_.run(c_);
      bwd_data_->run(c_);
    }
    // The bias's gradient, after the weights' (l_ and b_ are set where an own loop needs them).
    const auto db = [&] {
      return b_.dw + static_cast<std::int64_t>(l_.channels) * l_.in.c * l_.kernel_h * l_.kernel_w;
    };
    if (bf16_grad_) {  // the weights' and the bias's gradient
      bf16_grad_->run(b_.batch, b_.x, b_.dy, reads_pool_gradient_ ? link_->pooled : PooledGradient{}, b_.dw, db());
      return;
    }
    if (bwd_weights_) {
      bwd_weights_->run(c_);
      dw_.run(c_);
      if (own_bias_ && !pool_wrote_dy) {
        const std::int64_t plane = static_cast<std::int64_t>(l_.out.h) * l_.out.w;
        if (b_.y_layout == Layout::kBlocked8)
          bias_grad_blocked8(b_.batch, l_.channels, plane, b_.dy, bias_acc_.data(), db());
        else
          bias_grad_blocked16(b_.batch, l_.channels, plane, b_.dy, bias_acc_.data(), db());
      }
      return;
    }
    const PooledGradient* pooled = reads_pool_gradient_ ? &link_->pooled : nullptr;
    if (b_.y_layout == Layout::kBlocked8)
      plain_input_weight_grad<8>(l_, b_.batch, b_.x, b_.dy, pooled, own_, b_.dw, db());
    else
      plain_input_weight_grad<16>(l_, b_.batch, b_.x, b_.dy, pooled, own_, b_.dw, db());
  }
  // The weights' copies (a blocked layout, bf16) are made whole, once, by the next pass that reads
  // them: a step's update and gathers may touch a convolution's weights in several ranges.
  void parameters_changed(const float* from, const float* to, bool /*image_written: none is plain*/) override {
    if (from >= to || from >= w_end_ || to <= w_begin_) return;
    w_fwd_copy_.stale = w_bwd_copy_.stale = true;
  }
  std::string describe() const override {
    return (forward_in_pool_ ? "forward in the max pool's pass; " : "") + desc_ +
           (pool_writes_bf16_dy_ ? "; dy in bf16 and the bias's gradient from the max pool" : "") +
           (reads_pool_gradient_ && link_->pooled.dy ? " reading the max pool's gradient" : "");
  }

 private:
  // --precision bf16 (Note [bf16 on the CPU]): the primitives on bf16 copies of x, w and dy.
  void build_bf16(const LayerSpec& l, const LayerBuffers& b, bool training) {
    const ConvGeometry g(l, b.batch, b.x_layout, b.y_layout);
    const auto& [src, wei, bia, dst, strides, pad_l, pad_r, src_tag, dst_tag] = g;
    const dnnl::memory::desc src_bf = g.src_md(dt::bf16), src_f = g.src_md(dt::f32), wei_bf = g.wei_any(dt::bf16),
                             wei_f = g.wei_any(dt::f32), bia_md = g.bia_md(), dst_f = g.dst_md(dt::f32),
                             dst_bf = g.dst_md(dt::bf16);
    const float* bias = b.w + l.channels * l.in.c * l.kernel_h * l.kernel_w;
    const dnnl::memory user_w = wrap(c_, wei, tag::oihw, b.w);
    const dnnl::convolution_forward::primitive_desc fwd =
        conv_forward_pd(c_, l, training, src_bf, wei_bf, bia_md, dst_f);
    desc_ = "bf16 conv fwd " + impl(fwd);
    const dnnl::memory x_bf(src_bf, c_.engine);  // allocated once, here
    x_to_bf16_ = bound_reorder(c_, wrap(c_, src, src_tag, b.x), x_bf);
    w_fwd_ = maybe_reorder(c_, user_w, fwd.weights_desc(), true);
    fwd_ = bind<dnnl::convolution_forward>(c_, fwd,
                                           {{DNNL_ARG_SRC, x_bf},
                                            {DNNL_ARG_WEIGHTS, w_fwd_.mem},
                                            {DNNL_ARG_BIAS, wrap(c_, bia, tag::x, bias)},
                                            {DNNL_ARG_DST, wrap(c_, dst, dst_tag, b.y)}});
    if (!training) return;
    const dnnl::memory dy_bf(dst_bf, c_.engine);
    dy_to_bf16_ = bound_reorder(c_, wrap(c_, dst, dst_tag, b.dy), dy_bf);
    if (pool_writes_bf16_dy_) {  // Note [A pool's gradient straight into bf16] in pool.cpp
      link_->dy_bf16 = static_cast<std::uint16_t*>(dy_bf.get_data_handle());
      link_->db = b.dw + (bias - b.w);
    }
    if (b.dx) {
      dnnl::convolution_backward_data::primitive_desc bd(
          dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, src_f, wei_bf, dst_bf, strides,
                                                pad_l, pad_r),
          user_scratchpad(), c_.engine, fwd);
      desc_ += ", bwd-data " + impl(bd);
      w_bwd_ = weights_for_backward_data(c_, w_fwd_, user_w, bd.weights_desc());
      bwd_data_ = bind<dnnl::convolution_backward_data>(c_, bd,
                                                         {{DNNL_ARG_DIFF_DST, dy_bf},
                                                          {DNNL_ARG_WEIGHTS, w_bwd_.mem},
                                                          {DNNL_ARG_DIFF_SRC, wrap(c_, src, src_tag, b.dx)}});
    }
    // The bias gradient from the fp32 dy: our blocked loop (Note [Bias gradient of a blocked
    // convolution]) or oneDNN's.
    own_bias_ = b.y_layout != Layout::kPlain;
    dnnl::convolution_backward_weights::primitive_desc bw =
        own_bias_ ? dnnl::convolution_backward_weights::primitive_desc(
                        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_bf, wei_f,
                                                                 dst_bf, strides, pad_l, pad_r),
                        user_scratchpad(), c_.engine, fwd)
                  : dnnl::convolution_backward_weights::primitive_desc(
                        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_bf, wei_f,
                                                                 bia_md, dst_bf, strides, pad_l, pad_r),
                        user_scratchpad(), c_.engine, fwd);
    desc_ += ", bwd-weights " + impl(bw) + (own_bias_ ? " + own bias sum" : "");
    dw_ = maybe_reorder(c_, wrap(c_, wei, tag::oihw, b.dw), bw.diff_weights_desc(), false);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, x_bf}, {DNNL_ARG_DIFF_DST, dy_bf}, {DNNL_ARG_DIFF_WEIGHTS, dw_.mem}};
    if (!own_bias_) args[DNNL_ARG_DIFF_BIAS] = wrap(c_, bia, tag::x, b.dw + (bias - b.w));
    bwd_weights_ = cpu::bind<dnnl::convolution_backward_weights>(c_, bw, std::move(args));
    l_ = l;
    b_ = b;
    bias_acc_.assign(static_cast<std::size_t>(l.channels), 0.0);
  }

  Context& c_;
  const float *w_begin_, *w_end_;  // the weights (OIHW) in the flat parameter buffer
  MaybeReorder w_fwd_, w_bwd_, dw_;
  std::optional<Bound> x_to_bf16_, dy_to_bf16_;  // --precision bf16
  Bound fwd_;
  std::optional<Bound> bwd_data_, bwd_weights_;
  std::string desc_;
  LayerSpec l_;  // for the own weight-gradient loop, when used
  LayerBuffers b_;
  OwnScratch own_;  // for the own weight-gradient loop, when used
  // Note [The fusion plan] in fusion.cpp: what this convolution leaves to the max pool after it.
  std::shared_ptr<ConvPoolLink> link_;  // shared with that pool
  bool forward_in_pool_;                // the pool computes the forward
  bool reads_pool_gradient_;            // the weight gradient reads link_->pooled instead of dy
  bool pool_writes_bf16_dy_;            // the pool writes the bf16 dy (link_->dy_bf16) and the bias's gradient
  bool own_bias_ = false;               // Note [Bias gradient of a blocked convolution]
  std::optional<FirstConvWeightGradBf16> bf16_grad_;  // Note [The first convolution's weight gradient in bf16]
  KeptCopy w_fwd_copy_, w_bwd_copy_;                  // the state of w_fwd_'s and w_bwd_'s copies
  std::vector<double> bias_acc_;                      // (O)
};

}  // namespace

bool conv_has_fast_kernels(const Context& c, const LayerSpec& l, Layout x_layout, Layout y_layout, bool with_dx) {
  const dnnl::memory::dim batch = 32;  // a probe: the implementation does not depend on it here
  const ConvGeometry g(l, batch, x_layout, y_layout);
  const auto& [src, wei, bia, dst, strides, pad_l, pad_r, src_tag, dst_tag] = g;
  const dnnl::memory::desc src_md = g.src_md(dt::f32), wei_any = g.wei_any(dt::f32), bia_md = g.bia_md(),
                           dst_md = g.dst_md(dt::f32);
  const auto fast = [](const std::string& name) { return !is_ref(name); };
  try {
    dnnl::convolution_forward::primitive_desc fwd(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, src_md,
                                        wei_any, bia_md, dst_md, strides, pad_l, pad_r),
        c.engine);
    dnnl::convolution_backward_weights::primitive_desc bw(
        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_md, wei_any, bia_md, dst_md,
                                                 strides, pad_l, pad_r),
        c.engine, fwd);
    const bool own_bw = x_layout == Layout::kPlain && y_layout != Layout::kPlain;  // Note [Weight gradient ...]
    bool ok = fast(impl(fwd)) && (own_bw || fast(impl(bw)));
    if (with_dx) {
      dnnl::convolution_backward_data::primitive_desc bd(
          dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, src_md, wei_any, dst_md, strides,
                                                pad_l, pad_r),
          c.engine, fwd);
      ok = ok && fast(impl(bd));
    }
    return ok;
  } catch (const dnnl::error&) {
    return false;
  }
}

std::unique_ptr<LayerKernel> make_conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training, bool first,
                                       const LayerFusion& f) {
  return std::make_unique<Conv>(c, l, b, training, first, f);
}

ConvWeightGrad conv_weight_grad(const Context& c, const LayerSpec& l, Layout x_layout, Layout y_layout, int batch,
                                bool first) {
  if (c.fuse.bf16 && !first) return ConvWeightGrad::kOneDnn;  // Note [bf16 on the CPU]: oneDNN's bf16 kernels
  bool bw_is_ref = false;                                     // asked only where it decides (choose_weight_grad)
  if (x_layout == Layout::kPlain && y_layout != Layout::kPlain) {
    const ConvGeometry g(l, batch, x_layout, y_layout);  // as Conv's, exactly
    const dnnl::memory::desc src_md = g.src_md(dt::f32), wei_any = g.wei_any(dt::f32), bia_md = g.bia_md(),
                             dst_md = g.dst_md(dt::f32);
    const dnnl::convolution_forward::primitive_desc fwd = conv_forward_pd(c, l, true, src_md, wei_any, bia_md, dst_md);
    dnnl::convolution_backward_weights::primitive_desc bw(
        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_md, wei_any, bia_md, dst_md,
                                                 {l.stride, l.stride}, {l.pad_top, l.pad_left},
                                                 {l.pad_bottom, l.pad_right}),
        user_scratchpad(), c.engine, fwd);
    bw_is_ref = is_ref(impl(bw));
  }
  return choose_weight_grad(c, l, x_layout, y_layout, first, bw_is_ref);
}

}  // namespace mnist_mpi::cpu
