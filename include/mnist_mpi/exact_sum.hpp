// Sums whose bits do not depend on the order or grouping of their terms: float values turned into
// 64-bit fixed point with one scale for all of them, added as integers, turned back once. The
// building block of issue 28's --exact-sums mode (not wired into the reducer yet): chunks of the
// global batch whose gradients are summed on any number of ranks, by MPI or NCCL, in any order.
//
// Note [Exact sums in fixed point]
// Integer addition is associative, so a sum of int64 is the same whatever the order and grouping
// (MPI's and NCCL's int64 sums are exact). So every term of a sum of at most `terms` floats is
// first written as q = round(x * 2^shift), rounded to nearest, ties to even, with one shift for
// every term: shift = 62 - e - ceil(log2(terms)), where 2^(e-1) <= max|x| < 2^e is the exponent
// of the largest magnitude among ALL terms (a MAX, exact in any order: every rank must use the
// same shift). Then |q| <= 2^(62 - ceil(log2(terms))) and a sum of `terms` of them stays within
// 2^62 < 2^63: no overflow, whatever the terms. The sum comes back as float(sum * 2^-shift),
// through double: one deterministic rounding of an exact integer.
// Precision: x * 2^shift is exact in double (a power of two times a 24-bit significand, inside
// double's range for every finite float), so the only loss is the rounding of q to an integer: an
// absolute error of at most 2^-(shift+1) per term, that is max|x| * 2^-(62 - ceil(log2(terms)))
// relative to the largest term (2^-52 for 1024 terms), far below float's own 2^-24 for terms
// within ~2^28 of the largest; terms smaller than about max|x| * 2^-(63 - ceil(log2(terms)))
// vanish. A true sum beyond float's range comes back as inf, as a float sum would, for the
// non-finite guard to see (Note [Non-finite steps]). A non-finite term has no fixed point:
// callers check max|x| first (exact_sum_shift refuses it).
#pragma once

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

// The shift of Note [Exact sums in fixed point] for `terms` terms whose largest magnitude is
// max_abs (finite, >= 0; the same value on every rank). Throws Error(kRuntime) otherwise.
inline int exact_sum_shift(float max_abs, std::int64_t terms) {
  MNIST_CHECK(std::isfinite(max_abs) && max_abs >= 0.0f && terms >= 1 && terms <= (std::int64_t{1} << 30),
              ExitCode::kRuntime, "exact sums: a finite max >= 0 and 1 to 2^30 terms are needed");
  int e = 0;
  if (max_abs > 0.0f) std::frexp(max_abs, &e);  // max_abs = f * 2^e, f in [0.5, 1)
  return 62 - e - ceil_log2(terms);
}

// x (finite, |x| <= the max_abs of the shift) in fixed point.
inline std::int64_t to_fixed(float x, int shift) {
  return static_cast<std::int64_t>(std::nearbyint(std::ldexp(static_cast<double>(x), shift)));
}

// A sum of fixed-point terms, back to float.
inline float from_fixed(std::int64_t sum, int shift) {
  return static_cast<float>(std::ldexp(static_cast<double>(sum), -shift));
}

}  // namespace mnist_mpi
