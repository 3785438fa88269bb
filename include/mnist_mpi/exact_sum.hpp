// Sums whose bits do not depend on the order or grouping of their terms: float values turned into
// 64-bit fixed point with one scale for all of them, added as integers, turned back once. The
// building block of --exact-sums (include/mnist_mpi/train/exact_sums.hpp): chunks of the
// global batch whose gradients are summed on any number of ranks, by MPI or NCCL, in any order.
//
// Note [Exact sums in fixed point]
// Integer addition is associative, so a sum of int64 is the same whatever the order and grouping
// (MPI's and NCCL's int64 sums are exact). So every term of a sum of at most `terms` floats is
// first written as q = round(x * 2^shift), rounded to nearest, ties to even, with one shift for
// every term: shift = b - e, where 2^(e-1) <= max|x| < 2^e bounds ALL terms (a MAX, exact in any
// order: every rank must use the same shift) and b = min(51, 62 - ceil(log2(terms))). Then
// |q| <= 2^b and a sum of `terms` of them stays within 2^62 < 2^63: no overflow, whatever the
// terms. The sum comes back as float(sum * 2^-shift), through double: one deterministic rounding
// of an exact integer. b is at most 51 so that the conversion is a double addition (Note [Fixed
// point without a conversion instruction]).
// Precision: x * 2^shift is exact in double (a power of two times a 24-bit significand, inside
// double's range for every finite float), so the only loss is the rounding of q to an integer: an
// absolute error of at most 2^-(shift+1) per term, that is max|x| * 2^-b relative to the largest
// term (2^-51 up to 2048 terms), far below float's own 2^-24 for terms within ~2^27 of the
// largest; terms smaller than about max|x| * 2^-(b+1) vanish. A true sum beyond float's range
// comes back as inf, as a float sum would, for the non-finite guard to see (Note [Non-finite
// steps]). A non-finite term has no fixed point: callers check max|x| first (exact_sum_shift
// refuses it).
//
// Note [Fixed point without a conversion instruction]
// AVX2 has no double <-> int64 conversion, so a loop of llrint and of int64-to-double casts runs
// one element at a time. Both directions are done with double additions instead, which vectorise
// on every x86-64: for |v| < 2^51, v + 1.5 * 2^52 lies in [2^52, 2^53), where doubles are the
// integers, so the addition rounds v to an integer (to nearest, ties to even, as nearbyint does)
// and the low bits of the result are that integer plus 2^51 (to_fixed_scaled). Back, an int64 is
// split into its high and low 32 bits, each turned into a double exactly the same way, and
// hi * 2^32 + lo is one correctly rounded addition: the bits of static_cast<double>(q)
// (from_fixed_scaled). tests/test_exact_sum.cpp compares both with the plain conversions.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

// ceil(log2(n)) for n >= 1.
inline int ceil_log2(std::int64_t n) {
  int k = 0;
  while ((std::int64_t{1} << k) < n) ++k;
  return k;
}

// b of Note [Exact sums in fixed point]: the bits of one term of a sum of `terms` terms.
inline int term_bits(std::int64_t terms) { return std::min(51, 62 - ceil_log2(terms)); }

// The shift of Note [Exact sums in fixed point] for `terms` terms all of magnitude below
// 2^limit_exponent (the same on every rank).
inline int shift_for_limit(int limit_exponent, std::int64_t terms) { return term_bits(terms) - limit_exponent; }

// The shift for `terms` terms whose largest magnitude is max_abs (finite, >= 0; the same value on
// every rank). Throws Error(kRuntime) otherwise.
inline int exact_sum_shift(float max_abs, std::int64_t terms) {
  MNIST_CHECK(std::isfinite(max_abs) && max_abs >= 0.0f && terms >= 1 && terms <= (std::int64_t{1} << 30),
              ExitCode::kRuntime, "exact sums: a finite max >= 0 and 1 to 2^30 terms are needed");
  int e = 0;
  if (max_abs > 0.0f) std::frexp(max_abs, &e);  // max_abs = f * 2^e, f in [0.5, 1)
  return shift_for_limit(e, terms);
}

// x (finite, |x| <= the max_abs of the shift) in fixed point.
inline std::int64_t to_fixed(float x, int shift) {
  return static_cast<std::int64_t>(std::nearbyint(std::ldexp(static_cast<double>(x), shift)));
}

// A sum of fixed-point terms, back to float.
inline float from_fixed(std::int64_t sum, int shift) {
  return static_cast<float>(std::ldexp(static_cast<double>(sum), -shift));
}

// Note [Fixed point without a conversion instruction]: to_fixed(x, shift) with scale = 2^shift,
// for |x * scale| < 2^51 (beyond it some integer, without undefined behaviour: the subtraction
// wraps); and from_fixed(q, shift) with unscale = 2^-shift. Inlined into vectorised loops.
[[gnu::always_inline]] inline std::int64_t to_fixed_scaled(float x, double scale) {
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
  return static_cast<std::int64_t>(std::bit_cast<std::uint64_t>(static_cast<double>(x) * scale + kMagic) -
                                   std::bit_cast<std::uint64_t>(kMagic));
}
[[gnu::always_inline]] inline double int64_to_double(std::int64_t q) {
  constexpr double k52 = 4503599627370496.0;       // 2^52
  constexpr double k52and31 = 4503601774854144.0;  // 2^52 + 2^31
  const auto bits52 = std::bit_cast<std::int64_t>(k52);
  // The high half as a signed 32-bit value plus 2^31, and the low half, each in a double's significand.
  const double hi = std::bit_cast<double>(bits52 | ((q >> 32) + (std::int64_t{1} << 31))) - k52and31;
  const double lo = std::bit_cast<double>(bits52 | (q & 0xffffffffLL)) - k52;
  return hi * 4294967296.0 + lo;  // hi * 2^32 is exact; one rounding
}
[[gnu::always_inline]] inline float from_fixed_scaled(std::int64_t q, double unscale) {
  return static_cast<float>(int64_to_double(q) * unscale);
}

}  // namespace mnist_mpi
