// The max pool's one rule for which element of a window is its maximum, for every path that pools:
// the pool's own loops (pool.cpp), the first convolution computed in its pool's pass (conv.cpp, fp32
// portable and AVX2) and in bf16 with its ReLU (bf16.cpp, AVX-512).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace mnist_mpi::cpu {

// Note [The max pool's tie rule]
// A window is scanned in row-major order ((0, 0), (0, 1), ..., (1, 0), ...). Its maximum starts
// at its first element (at that element's ReLU where the pool took a ReLU over: Note [A ReLU taken
// over by its max pool] in pool.cpp, which makes a NaN 0 as oneDNN's ReLU does), and a later
// element replaces it only where it is strictly greater (an ordered compare): so the first maximum
// wins ties, as in oneDNN and PyTorch, and a NaN never replaces the maximum. The argmax is where the
// maximum was last replaced. Every backward (the scatter, the one-pass tiles, a convolution reading
// the pool's gradient) sends dy to that argmax, so every path must pick the same element; the
// functions below are that rule, in scalar form and for the vector widths the intrinsic kernels use.

// The maximum a window starts at: its first element v, or its ReLU (v > 0 ? v : +0; NaN -> +0).
[[gnu::always_inline]] inline float pool_start(float v, bool relu) { return relu ? (v > 0.0f ? v : 0.0f) : v; }

// Whether element v replaces the maximum so far.
[[gnu::always_inline]] inline bool pool_replaces(float v, float best) { return v > best; }

// One element v at offset `at` into (best, best_at), branch-free so that a loop over the lanes of
// a block vectorises.
[[gnu::always_inline]] inline void pool_take(float v, std::int32_t at, float& best, std::int32_t& best_at) {
  const std::int32_t more = -static_cast<std::int32_t>(pool_replaces(v, best));  // all ones or zero
  best_at = (best_at & ~more) | (at & more);
  best = pool_replaces(v, best) ? v : best;
}

// The same for 8 lanes (a mask: all ones where v replaces best) and 16 lanes (a bit mask).
__attribute__((target("avx2"), always_inline)) inline __m256 pool_replaces(__m256 v, __m256 best) {
  return _mm256_cmp_ps(v, best, _CMP_GT_OQ);
}
__attribute__((target("avx512f"), always_inline)) inline __mmask16 pool_replaces(__m512 v, __m512 best) {
  return _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
}
__attribute__((target("avx512f"), always_inline)) inline __m512 pool_start(__m512 v) {  // with a ReLU
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ), v);
}

}  // namespace mnist_mpi::cpu
