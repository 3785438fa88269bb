// Our own bf16 loops of the CPU backend (--precision bf16 on a CPU with AVX512-BF16): the first
// convolution, its ReLU and its 2 x 2 max pool in one pass (Note [The first convolution in bf16]),
// that convolution's weight gradient (Note [The first convolution's weight gradient in bf16]), and
// the conversion of the fc layers' weights (Note [Weight copies kept between passes]).
#include <immintrin.h>

#include <cpuid.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "src/backend/cpu/kernels.hpp"
#include "src/backend/cpu/pool_rule.hpp"

namespace mnist_mpi::cpu {

// Note [The first convolution in bf16]
// Under --precision bf16 the first convolution stayed fp32 (oneDNN's bf16 kernels for one input
// channel were slower than its fp32 one), and it was the largest fp32 part of a bf16 step: lenet's
// forward took 0.6 ms of a 13.9 ms step (at 44 % of one core's fp32 rate: one input channel gives
// a kernel little to reuse), and the pool after it read back the 5 MB it wrote. When such a
// convolution (one input channel, stride 1, blocked output of 16 channels a block) is followed by a
// ReLU and a 2 x 2 max pool that takes the ReLU over (Note [A ReLU taken over by its max pool] in
// src/backend/cpu/pool.cpp), the pool computes all three here, as the fp32 pass of Note [The first
// convolution and its pool in one pass] in conv.cpp does without the ReLU: the convolution's
// output and the ReLU's are never written. Per sample, the image is rounded to bf16 into a
// zero-padded copy (so no tap is ever skipped), and each output is its bias plus the taps in pairs
// along a kernel row, kw = (0, 1), (2, 3), ..., one VDPBF16PS a pair for 16 channels (a kernel of
// odd width gets a zero weight past its last column): the weights, (O/16, KH, (KW + 1) / 2, 16, 2)
// in bf16, are packed from the fp32 master weights at each forward. Eight or two window positions
// side by side give 16 or 4 independent sums. The window's max starts at the ReLU of its first
// position and the first maximum wins ties, as in the pool's own pass, so its backward (dy at the
// argmax where the pooled y > 0) is unchanged, and so is the convolution's weight gradient, which
// reads x and that dy (Note [The first convolution's weight gradient in bf16]). bf16 products are
// exact in fp32; what moves is the rounding of x and w to 8 bits of mantissa and the order of the
// sums (each pair's two products are added to the sum in one instruction). BlockedLayouts.FirstConvReluPoolInBf16
// checks it against a double reference on the same bf16-rounded inputs; the bits are the same on every rank, as every
// rank runs this kernel on its own samples.

// Note [Weight copies kept between passes]
// A bf16 layer multiplies a bf16 copy of its weights (and a convolution a copy in oneDNN's blocked
// layout). Made at every forward, lenet's fc1 copy (3.2 M weights, read 12.8 MB, write 6.4 MB) took
// 0.73 ms of a 14.9 ms bf16 step on 2 ranks, and as much again for every batch of an evaluation,
// whose weights do not change. So a model built on a parameter store keeps its copies between
// passes, and the store tells it what changed (Note [The parameters and their copies] in
// include/mnist_mpi/backend/parameter_store.hpp): an fc of a training model converts a changed
// range at once, while it is in cache (its copy is plain (O, I), so the range is converted alone);
// a convolution's small blocked copies are marked stale when a range touches them, and made whole
// once, by the next pass that reads them; an evaluation model's copies are made whole by its next
// pass. Within the rank's own shard the fc copies are written by the CPU optimiser's pass itself,
// as it updates each weight (the store names the plain images to it: 0.2 ms less a lenet step
// than converting them after). Every fc copy has one rounding, bf16_bits (bf16.hpp), which is
// VCVTNEPS2BF16's (Bf16.TheRoundingIsTheInstructions), so a pass, a reported change and the
// optimiser give the same bits; bf16 runs kept their bits when this came in (lenet, 60 steps, 1
// and 2 ranks, with and without accumulation, sharded or not), and again when the store took over
// from the flags its callers set. Model.Bf16WeightCopiesAreRefreshedWhereTheParametersChanged
// checks the kept copies against copies made anew after reported changes, the optimiser's pass
// and an evaluation model, and that a change not reported is not seen (the copies are kept);
// tests/e2e_cli.sh that a sharded run with buckets that cut the tensors apart keeps the unsharded
// run's bits.

bool cpu_has_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)) != 0;  // CPUID.7.1:EAX[5]
}

namespace {

constexpr int kB = 16;  // output channels a block: one zmm of fp32 sums

struct Geometry {
  int H, W, OH, OW, PH, PW, KH, JP, pt, pl, rows, cols;
};

Geometry geometry(const LayerSpec& l) {
  Geometry g{};
  g.H = l.in.h;
  g.W = l.in.w;
  g.OH = l.out.h;
  g.OW = l.out.w;
  g.PH = g.OH / 2;
  g.PW = g.OW / 2;
  g.KH = l.kernel_h;
  g.JP = (l.kernel_w + 1) / 2;
  g.pt = l.pad_top;
  g.pl = l.pad_left;
  // Output (h, w) reads padded pixels (h + kh, w + kw + e) for kw + e up to 2 JP - 1: OH + KH - 1
  // rows and OW + 2 JP - 1 columns.
  g.rows = g.OH + g.KH - 1;
  g.cols = g.OW + 2 * g.JP - 1;
  return g;
}

// The dword at p (two bf16 pixels side by side), in every lane.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline __m512bh pair(
    const std::uint16_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}
// The same as a broadcast from memory, written as one instruction: in the forward's loop, where
// the pairs of one row overlap, GCC loads each into an integer register once and broadcasts it from
// there, a shuffle each (one a cycle), which held the forward at half the multiply rate.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline __m512bh pair_load(
    const std::uint16_t* p) {
  __m512i v;
  asm("vpbroadcastd %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const std::int32_t*>(p)));
  return (__m512bh)v;
}

// The sums of NW adjacent pool windows: acc[h][p] is the convolution's output at row h0 + h and
// column c0 + p of channel block wb (h = 0, 1; p = 0 .. 2 NW - 1).
template <int NW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline void window_sums(
    const Geometry& g, const std::uint16_t* xp, int h0, int c0, const std::uint16_t* wb, __m512 bias,
    __m512 (&acc)[2][2 * NW]) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
    for (int p = 0; p < 2 * NW; ++p) acc[h][p] = bias;
  for (int kh = 0; kh < g.KH; ++kh) {
    const std::uint16_t* r0 = xp + static_cast<std::int64_t>(h0 + kh) * g.cols + c0;
    const std::uint16_t* r1 = r0 + g.cols;
    for (int j = 0; j < g.JP; ++j) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(wb + (kh * g.JP + j) * 32);
#pragma GCC unroll 8
      for (int p = 0; p < 2 * NW; ++p) acc[0][p] = _mm512_dpbf16_ps(acc[0][p], w, pair_load(r0 + p + 2 * j));
#pragma GCC unroll 8
      for (int p = 0; p < 2 * NW; ++p) acc[1][p] = _mm512_dpbf16_ps(acc[1][p], w, pair_load(r1 + p + 2 * j));
    }
  }
}

// Window win's ReLU'd maximum and argmax (Note [The max pool's tie rule] in pool_rule.hpp: scan order
// (0, 0), (0, 1), (1, 0), (1, 1), starting at the ReLU of the first).
template <int NW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline void window_max(
    const __m512 (&acc)[2][2 * NW], int win, __m512i at0, int row_step, float* y, std::int32_t* arg) {
  __m512 best = pool_start(acc[0][2 * win]);
  __m512i best_at = at0;
  const int step[4] = {0, kB, row_step, row_step + kB};
#pragma GCC unroll 4
  for (int q = 1; q < 4; ++q) {
    const __m512 v = acc[q / 2][2 * win + q % 2];
    const __mmask16 more = pool_replaces(v, best);
    best = _mm512_mask_mov_ps(best, more, v);
    best_at = _mm512_mask_mov_epi32(best_at, more, _mm512_add_epi32(at0, _mm512_set1_epi32(step[q])));
  }
  _mm512_storeu_ps(y, best);
  if (arg) _mm512_storeu_si512(arg, best_at);
}

template <int NW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline void windows(
    const Geometry& g, const std::uint16_t* xp, int ob, int i, int j, const std::uint16_t* wb, __m512 bias, float* y,
    std::int32_t* arg) {
  __m512 acc[2][2 * NW];
  window_sums<NW>(g, xp, 2 * i, 2 * j, wb, bias, acc);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 4
  for (int win = 0; win < NW; ++win) {
    const std::int64_t o = ((static_cast<std::int64_t>(ob) * g.PH + i) * g.PW + j + win) * kB;
    const int at = ((ob * g.OH + 2 * i) * g.OW + 2 * (j + win)) * kB;
    window_max<NW>(acc, win, _mm512_add_epi32(lane, _mm512_set1_epi32(at)), g.OW * kB, y + o, arg ? arg + o : nullptr);
  }
}

// One image x (H, W) fp32 into xp: rows x cols bf16, zero around it.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void pad_image(const Geometry& g, const float* x,
                                                                               std::uint16_t* xp) {
  // Only the image is written: the border (the padding) stays the zeros the scratch was made with.
  for (int r = 0; r < g.H; ++r)
    for (int c = 0; c < g.W; c += 16) {
      const __mmask16 m = static_cast<__mmask16>(g.W - c >= 16 ? 0xffff : (1u << (g.W - c)) - 1);
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + r * g.W + c));
      _mm256_mask_storeu_epi16(xp + static_cast<std::int64_t>(r + g.pt) * g.cols + g.pl + c, m, (__m256i)v);
    }
}

// One sample: x (H, W) fp32; y and arg (O/16, PH, PW, 16); xp: rows x cols bf16 scratch.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void sample(const Geometry& g, int blocks,
                                                                            const float* x, const std::uint16_t* wp,
                                                                            const float* bias, std::uint16_t* xp,
                                                                            float* y, std::int32_t* arg) {
  pad_image(g, x, xp);
  const int taps = g.KH * g.JP;
  for (int ob = 0; ob < blocks; ++ob) {
    const std::uint16_t* wb = wp + static_cast<std::int64_t>(ob) * taps * 32;
    const __m512 bv = _mm512_loadu_ps(bias + ob * kB);
    for (int i = 0; i < g.PH; ++i) {
      int j = 0;
      for (; j + 4 <= g.PW; j += 4) windows<4>(g, xp, ob, i, j, wb, bv, y, arg);
      for (; j < g.PW; ++j) windows<1>(g, xp, ob, i, j, wb, bv, y, arg);
    }
  }
}

// OIHW fp32 (one input channel) -> (O/16, KH, JP, 16, 2) bf16 (bf16_bits: the instruction's
// rounding), zero past the last column.
void pack(const LayerSpec& l, const float* w, std::uint16_t* wp) {
  const int KH = l.kernel_h, KW = l.kernel_w, JP = (KW + 1) / 2;
  for (int o = 0; o < l.channels; ++o)
    for (int kh = 0; kh < KH; ++kh)
      for (int j = 0; j < JP; ++j)
        for (int e = 0; e < 2; ++e) {
          const int kw = 2 * j + e;
          wp[((((o / kB) * KH + kh) * JP + j) * kB + o % kB) * 2 + e] =
              kw < KW ? bf16_bits(w[(o * KH + kh) * KW + kw]) : std::uint16_t{0};
        }
}

// n floats to bf16, rounded to nearest even (VCVTNEPS2BF16: a denormal becomes a zero of its sign).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void to_bf16_avx512(const float* src,
                                                                                    std::uint16_t* dst,
                                                                                    std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)v);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
  }
}

// Note [The first convolution's weight gradient in bf16]
// The same convolution's weight gradient, dW[o][kh][kw] = sum over images and output pixels (h, w)
// of dy[o][h][w] x[h + kh][w + kw] (padded), was oneDNN's fp32 kernel: 0.21 ms of a 2.5 ms bf16 step
// of the fast recipe, 0.3 ms of lenet's. Here the sum runs over pairs of horizontally adjacent
// pixels, one VDPBF16PS a pair and a tap for 16 channels: dy of pixels w and w + 1 rounded to bf16
// and interleaved channel by channel, times the pair (x[h + kh][w + kw], x[h + kh][w + kw + 1]) of
// the padded bf16 image, broadcast. The KH x KW sums of a channel block stay in registers over an
// image (shapes 3 x 3 and 5 x 5; 25 sums and the pair use 26 of the 32 zmm registers), then go into
// double sums, image by image and then thread by thread, in order (so --threads changes the
// grouping of the doubles, as it does in the fp32 own loop). The bias gradient is summed from the
// same fp32 dy in the same loop (in float over an image, in double over images and threads). It
// runs for any first convolution of one input channel, stride 1, 3 x 3 or 5 x 5, with blocks of 16
// output channels and an even output width, under --precision bf16 on a CPU with AVX512-BF16.
// When a 2 x 2 max pool follows (directly, or after a ReLU it computes with the forward: Note [The
// first convolution in bf16]), dy is not written at all: as in Note [The first convolution reads
// its pool's gradient] (conv.cpp) the pool hands over its own gradient and argmax (and, with a
// ReLU, its output), and each pixel's dy is formed in registers, the window's dy where the argmax
// points at the pixel (and the pooled y > 0, the ReLU's mask), 0 elsewhere. Only a convolution
// that reads the mask is handed one (Note [The fusion plan] in fusion.cpp; the fp32 own loop is not); the pool's backward pass
// and its 3.2 MB write (the fast recipe) are gone, and so is the bias's pass over them.
// BlockedLayouts.FirstConvReluPoolInBf16 checks dW against a double reference on the bf16-rounded dy, with dy from
// memory and from the pool.
struct PooledBlock {  // one image's channel block of the pool's gradient, argmax and output: (PH, PW, 16)
  const float* dy;
  const std::int32_t* arg;
  const float* y;
  std::int32_t base;  // the block's offset within the convolution's output sample (what argmax counts)
};

template <int KH, int KW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline void weight_grad_pair(
    const Geometry& g, const std::uint16_t* xr, int w, __m512 d0, __m512 d1, __m512i idx, __m512 (&acc)[KH * KW]) {
  const __m512bh both = _mm512_cvtne2ps_pbh(d1, d0);
  const __m512bh dy2 = (__m512bh)_mm512_permutexvar_epi16(idx, (__m512i)both);  // (16, 2): w, w + 1
#pragma GCC unroll 5
  for (int kh = 0; kh < KH; ++kh)
#pragma GCC unroll 5
    for (int kw = 0; kw < KW; ++kw)
      acc[kh * KW + kw] = _mm512_dpbf16_ps(acc[kh * KW + kw], dy2, pair(xr + kh * g.cols + w + kw));
}

// One image's channel block into acc and bsum: dy from memory (dyb, (OH, OW, 16)) or, when dyb is
// null, from the pool's block.
template <int KH, int KW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void weight_grad_block(
    const Geometry& g, const std::uint16_t* xp, const float* dyb, const PooledBlock& pb, __m512 (&acc)[KH * KW],
    __m512& bsum) {
  alignas(64) static constexpr std::uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                                21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                                11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kInterleave);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 zero = _mm512_setzero_ps();
  for (int h = 0; h < g.OH; ++h) {
    const std::uint16_t* xr = xp + static_cast<std::int64_t>(h) * g.cols;
    if (dyb) {
      const float* d = dyb + static_cast<std::int64_t>(h) * g.OW * kB;
      for (int w = 0; w < g.OW; w += 2) {
        const __m512 d0 = _mm512_loadu_ps(d + w * kB), d1 = _mm512_loadu_ps(d + (w + 1) * kB);
        bsum = _mm512_add_ps(_mm512_add_ps(bsum, d0), d1);
        weight_grad_pair<KH, KW>(g, xr, w, d0, d1, idx, acc);
      }
      continue;
    }
    const std::int64_t row = static_cast<std::int64_t>(h / 2) * g.PW * kB;
    for (int w = 0; w < g.OW; w += 2) {  // pixels w and w + 1 share the window (h / 2, w / 2)
      const std::int64_t q = row + (w / 2) * kB;
      const __m512 dy = _mm512_loadu_ps(pb.dy + q);
      const __m512i arg = _mm512_loadu_si512(pb.arg + q);
      const __mmask16 positive =  // the ReLU's mask; a pool without a ReLU before it has no y to give
          pb.y ? _mm512_cmp_ps_mask(_mm512_loadu_ps(pb.y + q), zero, _CMP_GT_OQ) : __mmask16{0xffff};
      const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(pb.base + (h * g.OW + w) * kB));
      const __m512 d0 = _mm512_maskz_mov_ps(positive & _mm512_cmpeq_epi32_mask(arg, at), dy);
      const __m512 d1 =
          _mm512_maskz_mov_ps(positive & _mm512_cmpeq_epi32_mask(arg, _mm512_add_epi32(at, _mm512_set1_epi32(kB))), dy);
      bsum = _mm512_add_ps(_mm512_add_ps(bsum, d0), d1);
      weight_grad_pair<KH, KW>(g, xr, w, d0, d1, idx, acc);
    }
  }
}

// Images [first, last) into partial (O/16, KH * KW, 16) and bias (O), both double; dy (N, O/16,
// OH, OW, 16) or, when null, the pool's gradient (pooled: dy, argmax and y (N, O/16, PH, PW, 16)).
// Each image's sums in float, added to the double ones in image order (as the fp32 own loop does:
// a float sum over a thread's 39 k pixel pairs of lenet would keep fewer digits).
template <int KH, int KW>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void weight_grad_images(
    const Geometry& g, int blocks, std::int64_t first, std::int64_t last, const float* x, const float* dy,
    const PooledGradient& pooled, std::uint16_t* xp, double* partial, double* bias) {
  const std::int64_t in = static_cast<std::int64_t>(g.H) * g.W, plane = static_cast<std::int64_t>(g.OH) * g.OW * kB,
                     pplane = static_cast<std::int64_t>(g.PH) * g.PW * kB;
  std::fill(partial, partial + static_cast<std::int64_t>(blocks) * KH * KW * kB, 0.0);
  for (std::int64_t n = first; n < last; ++n) {
    pad_image(g, x + n * in, xp);  // once for every block (each block's sums still take the images in order)
    for (int ob = 0; ob < blocks; ++ob) {
      double* part = partial + static_cast<std::int64_t>(ob) * KH * KW * kB;
      __m512 acc[KH * KW];
      for (auto& a : acc) a = _mm512_setzero_ps();
      __m512 bsum = _mm512_setzero_ps();
      const std::int64_t pq = (n * blocks + ob) * pplane;
      const PooledBlock pb{pooled.dy ? pooled.dy + pq : nullptr, pooled.dy ? pooled.argmax + pq : nullptr,
                           pooled.dy && pooled.y ? pooled.y + pq : nullptr, static_cast<std::int32_t>(ob * plane)};
      weight_grad_block<KH, KW>(g, xp, pooled.dy ? nullptr : dy + (n * blocks + ob) * plane, pb, acc, bsum);
      for (int t = 0; t < KH * KW; ++t) {
        alignas(64) float f[kB];
        _mm512_store_ps(f, acc[t]);
        for (int k = 0; k < kB; ++k) part[t * kB + k] += f[k];
      }
      alignas(64) float b[kB];
      _mm512_store_ps(b, bsum);
      for (int k = 0; k < kB; ++k) bias[ob * kB + k] += b[k];
    }
  }
}

}  // namespace

void to_bf16(const float* src, std::uint16_t* dst, std::int64_t n) {
  static const bool avx512_bf16 = cpu_has_avx512_bf16();
  if (avx512_bf16) return to_bf16_avx512(src, dst, n);
  for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_bits(src[i]);  // an AMX CPU without AVX512-BF16
}

bool first_conv_relu_pool_bf16_fits(const LayerSpec& conv) { return conv.channels % kB == 0 && cpu_has_avx512_bf16(); }

FirstConvBf16::FirstConvBf16(const LayerSpec& conv, int threads) : threads_(threads < 1 ? 1 : threads) {
  const Geometry g = geometry(conv);
  scratch_size_ = static_cast<std::int64_t>(g.rows) * g.cols;
  scratch_.assign(static_cast<std::size_t>(threads_ * scratch_size_), 0);
  const std::int64_t taps = static_cast<std::int64_t>(conv.channels / kB) * g.KH * g.JP;
  packed_.assign(static_cast<std::size_t>(taps * 32), 0);
}

void FirstConvBf16::forward(const FirstConvForward& f, int batch, float* y, std::int32_t* arg) {
  const LayerSpec& l = f.l;
  std::uint16_t* wp = packed_.data();
  pack(l, f.w, wp);  // every pass, unlike the other copies: 400 or 800 weights, less than tracking them
  const Geometry g = geometry(l);
  const std::int64_t in = static_cast<std::int64_t>(l.in.h) * l.in.w, out = l.out.size() / 4;
  // Samples are independent: shared out among the threads in fixed chunks (same bits for any count).
#pragma omp parallel num_threads(threads_)
  {
    const std::int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    std::uint16_t* xp = scratch_.data() + t * scratch_size_;
    for (std::int64_t n = batch * t / threads; n < batch * (t + 1) / threads; ++n)
      sample(g, l.channels / kB, f.x + n * in, wp, f.bias, xp, y + n * out, arg ? arg + n * out : nullptr);
  }
}

bool first_conv_weight_grad_bf16_fits(const LayerSpec& conv) {
  return conv.in.c == 1 && conv.stride == 1 && conv.channels % kB == 0 && conv.out.w % 2 == 0 &&
         ((conv.kernel_h == 5 && conv.kernel_w == 5) || (conv.kernel_h == 3 && conv.kernel_w == 3)) &&
         cpu_has_avx512_bf16();
}

FirstConvWeightGradBf16::FirstConvWeightGradBf16(const LayerSpec& conv, int threads)
    : l_(conv), threads_(threads < 1 ? 1 : threads) {
  const Geometry g = geometry(conv);
  scratch_size_ = static_cast<std::int64_t>(g.rows) * g.cols;
  scratch_.assign(static_cast<std::size_t>(threads_ * scratch_size_), 0);
  partial_.assign(static_cast<std::size_t>(threads_) * conv.channels * conv.kernel_h * conv.kernel_w, 0.0);
  bias_.assign(static_cast<std::size_t>(threads_) * conv.channels, 0.0);
}

void FirstConvWeightGradBf16::run(int batch, const float* x, const float* dy, const PooledGradient& pooled, float* dw,
                                  float* db) {
  const Geometry g = geometry(l_);
  const int blocks = l_.channels / kB, taps = l_.kernel_h * l_.kernel_w;
  const std::int64_t part = static_cast<std::int64_t>(l_.channels) * taps;
  const bool five = l_.kernel_h == 5;
  std::fill(bias_.begin(), bias_.end(), 0.0);
  int team = 1;  // the threads that ran: only their rows are this call's
#pragma omp parallel num_threads(threads_)
  {
    const std::int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    if (t == 0) team = static_cast<int>(threads);
    std::uint16_t* xp = scratch_.data() + t * scratch_size_;
    double* p = partial_.data() + t * part;
    double* b = bias_.data() + t * l_.channels;
    const std::int64_t first = batch * t / threads, last = batch * (t + 1) / threads;
    if (five)
      weight_grad_images<5, 5>(g, blocks, first, last, x, dy, pooled, xp, p, b);
    else
      weight_grad_images<3, 3>(g, blocks, first, last, x, dy, pooled, xp, p, b);
  }
  // (O/16, taps, 16) per thread, added in thread order, into OIHW; the bias likewise.
  for (int o = 0; o < l_.channels; ++o) {
    for (int k = 0; k < taps; ++k) {
      const std::int64_t at = ((o / kB) * taps + k) * kB + o % kB;
      double sum = partial_[static_cast<std::size_t>(at)];
      for (int t = 1; t < team; ++t) sum += partial_[static_cast<std::size_t>(t * part + at)];
      dw[o * taps + k] = static_cast<float>(sum);
    }
    double bsum = bias_[static_cast<std::size_t>(o)];
    for (int t = 1; t < team; ++t) bsum += bias_[static_cast<std::size_t>(t * l_.channels + o)];
    db[o] = static_cast<float>(bsum);
  }
}

}  // namespace mnist_mpi::cpu
