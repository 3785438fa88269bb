// Exact squared norms in exponent bins (include/mnist_mpi/exact_norm.hpp, Note [Exact squared norms]).
#include "mnist_mpi/exact_norm.hpp"

#include <cmath>

namespace mnist_mpi {

void SquaredNorm::clear() {
  for (NormBin& b : bins_) b = 0;
}

// Two sets of bins, the even elements' and the odd ones': consecutive elements mostly fall in the
// same bin, and with one set every addition would wait for the previous one's store. The sets are
// added at the end: integers, so the same value as one set.
void SquaredNorm::add(const float* x, std::int64_t n) {
  NormBin odd[kNormBins] = {};
  std::int64_t i = 0;
  for (; i + 1 < n; i += 2) {
    const SquareTerm a = square_term(x[i]), b = square_term(x[i + 1]);
    bins_[a.bin] += a.value;
    odd[b.bin] += b.value;
  }
  if (i < n) {
    const SquareTerm a = square_term(x[i]);
    bins_[a.bin] += a.value;
  }
  for (int k = 0; k < kNormBins; ++k) bins_[k] += odd[k];
}

void SquaredNorm::add(const SquaredNorm& other) {
  for (int k = 0; k < kNormBins; ++k) bins_[k] += other.bins_[k];
}

void SquaredNorm::add_to_limbs(std::span<std::int64_t> limbs) const {
  for (int k = 0; k < kNormBins; ++k)
    for (int j = 0; j < kNormLimbs; ++j)
      limbs[static_cast<std::size_t>(k * kNormLimbs + j)] +=
          static_cast<std::int64_t>(static_cast<std::uint64_t>(bins_[k] >> (32 * j)) & 0xffffffffu);
}

namespace {
// A bin's 128-bit value from its limbs: sum_j limb_j * 2^(32 j), modulo 2^128, which is the exact
// value because the true sum is below 2^128 (Note [Exact squared norms]).
NormBin bin_value(const std::int64_t* limb) {
  NormBin v = 0;
  for (int j = 0; j < kNormLimbs; ++j) v += static_cast<NormBin>(static_cast<std::uint64_t>(limb[j])) << (32 * j);
  return v;
}
// The bins, highest first, each rounded to double once and scaled by 2^(16 bin - 300) (exact).
double combine(const NormBin* bins) {
  double sum = 0.0;
  for (int k = kNormBins - 1; k >= 0; --k)
    if (bins[k] != 0) sum += std::ldexp(static_cast<double>(bins[k]), 16 * k - 300);
  return sum;
}
}  // namespace

double SquaredNorm::value() const { return combine(bins_); }

double squared_norm_of_limbs(std::span<const std::int64_t> limbs) {
  NormBin bins[kNormBins];
  for (int k = 0; k < kNormBins; ++k) bins[k] = bin_value(limbs.data() + k * kNormLimbs);
  return combine(bins);
}

double trust_ratio(double w_squared, double u_squared) {
  if (!(w_squared > 0.0) || !(u_squared > 0.0) || !std::isfinite(w_squared) || !std::isfinite(u_squared)) return 1.0;
  return std::sqrt(w_squared) / std::sqrt(u_squared);
}

}  // namespace mnist_mpi
