// Squared norms of float tensors whose bits do not depend on how the tensor is cut into pieces,
// which rank adds which piece, or in what order the pieces are added: LAMB's per-tensor norms
// (include/mnist_mpi/backend/optimizer_pass.hpp), the same sharded or not, on any number of
// ranks. The per-element split is written here for the host; the GPU's kernel
// (src/backend/cuda/kernels.cu) repeats its few lines in device code.
//
// Note [Exact squared norms]
// A float is x = s * 2^(E - 150) with s a 24-bit integer and E its biased exponent (a denormal:
// E = 0 read as E = 1, s without the implicit bit), so x^2 = s^2 * 2^(2E - 300) is an integer
// times a power of two: exact, with no rounding to depend on. The exponents are grouped into 32
// bins of 8 (bin = E / 8, r = E % 8): x^2 = (s^2 << 2r) * 2^(16 bin - 300), and s^2 << 2r < 2^48
// * 2^14 = 2^62 fits an unsigned 64-bit word. Each bin keeps the sum of its words as an unsigned
// 128-bit integer: integer addition is associative and commutative, so a bin's sum is the same
// whatever the order and grouping of its terms. It cannot overflow: n terms are below n * 2^62,
// under 2^128 for any n < 2^66, more elements than an int64 counts, so no tensor the program can
// hold is refused and nothing needs flushing.
// Across ranks each bin is written as four 32-bit limbs, each held in an int64 (kNormLimbs), and
// the limbs are summed with the communicator's int64 sum: exact in any order, and a limb summed
// over W ranks stays below W * 2^32 < 2^63. The value of a bin is then sum_i limb_i * 2^(32 i),
// taken back into 128 bits with the carries propagated (norm_bins_value): the same 128-bit integer
// however the limbs were cut, so a bin sum in limbs that are not canonical (a GPU's, which adds
// the low and high halves of each word into two 64-bit limbs) gives the same value too.
// Last, the bins become one double in a fixed order, highest bin first: each bin's integer rounded
// to double once, scaled by its power of two (exact), and added. That is not the correctly
// rounded sum, but it is a fixed function of the 32 integers, so the same bits whatever the
// pieces were; its error is a few units in the last place of double, far below what a float
// update can see.
#pragma once

#include <bit>
#include <cstdint>
#include <span>

namespace mnist_mpi {

// A bin's sum: 128 bits (a GCC and Clang extension; __extension__ says so to -Wpedantic).
__extension__ typedef unsigned __int128 NormBin;

inline constexpr int kNormBins = 32;                       // exponent bins of 8 binades each
inline constexpr int kNormLimbs = 4;                       // 32-bit limbs of a bin's 128-bit sum
inline constexpr int kNormWords = kNormBins * kNormLimbs;  // int64 words of one squared norm

// One element's term: x^2 = value * 2^(16 bin - 300) (Note [Exact squared norms]).
struct SquareTerm {
  std::uint32_t bin;
  std::uint64_t value;  // < 2^62
};
inline SquareTerm square_term(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t e = (b >> 23) & 0xffu;
  const std::uint64_t s = (b & 0x7fffffu) | (e != 0 ? 0x800000u : 0u);
  const std::uint32_t ee = e != 0 ? e : 1u;
  return {ee >> 3, (s * s) << (2 * (ee & 7u))};
}

// The sum of squares of any number of float ranges, exactly, in 32 bins (Note [Exact squared norms]).
class SquaredNorm {
 public:
  void clear();
  void add(const float* x, std::int64_t n);
  void add(const SquaredNorm& other);
  // Adds this sum's canonical limbs to limbs (kNormWords words: bin-major, limb 0 the lowest).
  void add_to_limbs(std::span<std::int64_t> limbs) const;
  double value() const;  // the sum, as norm_of_limbs rounds it

 private:
  NormBin bins_[kNormBins] = {};
};

// The squared norm held in limbs (kNormWords non-negative words whose values add up, bin by bin,
// to the exact sums; canonical or not), as one double, by a fixed sequence of operations.
double squared_norm_of_limbs(std::span<const std::int64_t> limbs);

// LAMB's trust ratio ||w|| / ||u|| from the squared norms; 1 when either is 0 (or not finite).
double trust_ratio(double w_squared, double u_squared);

}  // namespace mnist_mpi
