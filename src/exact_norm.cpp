// Exact squared norms in exponent bins (include/mnist_mpi/exact_norm.hpp, Note [Exact squared norms]).
#include "mnist_mpi/exact_norm.hpp"

#include <algorithm>
#include <bit>
#include <cmath>

#include "mnist_mpi/cpu_clones.hpp"

namespace mnist_mpi {

void SquaredNorm::clear() {
  for (NormBin& b : bins_) b = 0;
}

// Note [Squared norms a block at a time]
// Added one element at a time, every term waits for the previous one's store to its bin (the
// elements of a tensor mostly share two or three bins): 10 % of a lenet LAMB step's time. So the
// elements go in blocks of 256: one pass computes each term's bin and value (vectorised), then for
// each bin between the block's lowest and highest the values of that bin are summed in two 64-bit
// halves, low 32 bits and high 30 (each sum of 256 halves fits: no carry is lost), also vectorised,
// and joined into the bin's 128 bits. A block whose terms spread over more than kMaxBlockBins bins
// (zeros among large values, say) is added term by term. Integers: the same sums either way.
namespace {

constexpr std::int64_t kBlock = 256;
constexpr std::uint32_t kMaxBlockBins = 4;

// One block of at most kBlock elements into the bins, built for AVX-512, AVX2 and the baseline
// (Note [One build for every x86-64] in include/mnist_mpi/cpu_clones.hpp): the loops over the
// block are the ones that vectorise.
MNIST_MPI_CPU_CLONES
void norm_block(const float* x, std::int64_t m, NormBin* bins) {
  std::uint32_t bin[kBlock];
  std::uint64_t value[kBlock];
  std::uint32_t lo = kNormBins, hi = 0;
  for (std::int64_t j = 0; j < m; ++j) {  // square_term, inline (Note [Exact squared norms])
    const std::uint32_t b = std::bit_cast<std::uint32_t>(x[j]);
    const std::uint32_t e = (b >> 23) & 0xffu;
    const std::uint32_t ee = e != 0 ? e : 1u;
    const std::uint64_t s = (b & 0x7fffffu) | (e != 0 ? 0x800000u : 0u);
    bin[j] = ee >> 3;
    value[j] = (s * s) << (2 * (ee & 7u));
    lo = std::min(lo, bin[j]);
    hi = std::max(hi, bin[j]);
  }
  if (hi - lo >= kMaxBlockBins) {
    for (std::int64_t j = 0; j < m; ++j) bins[bin[j]] += value[j];
    return;
  }
  for (std::uint32_t k = lo; k <= hi; ++k) {
    std::uint64_t low = 0, high = 0;
    for (std::int64_t j = 0; j < m; ++j) {
      const std::uint64_t v = bin[j] == k ? value[j] : 0;
      low += v & 0xffffffffu;
      high += v >> 32;
    }
    bins[k] += (static_cast<NormBin>(high) << 32) + low;
  }
}

}  // namespace

void SquaredNorm::add(const float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; i += kBlock) norm_block(x + i, std::min(kBlock, n - i), bins_);
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
