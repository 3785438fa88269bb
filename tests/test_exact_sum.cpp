// Note [Exact sums in fixed point] (include/mnist_mpi/exact_sum.hpp) and Note [Chunks of the global
// batch] (include/mnist_mpi/data/sampler.hpp), on their own: the same bits for any order and any
// grouping of the same terms, the precision the Note promises against a long double sum, the edges
// of float's range, and every world size's chunks up to the number of chunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/data/sampler.hpp"
#include "mnist_mpi/exact_sum.hpp"

namespace mnist_mpi {
namespace {

// terms (chunks) x n values of mixed signs and magnitudes: 1e-12 to 1e3, zeros and denormals too.
std::vector<std::vector<float>> chunks_of(int terms, int n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-40, 10);
  std::vector<std::vector<float>> c(static_cast<std::size_t>(terms), std::vector<float>(static_cast<std::size_t>(n)));
  for (auto& v : c)
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = i % 17 == 0 ? 0.0f : i % 29 == 0 ? FLT_TRUE_MIN * 3 : std::ldexp(mant(gen), expo(gen));
  return c;
}

float max_abs(const std::vector<std::vector<float>>& c) {
  float m = 0.0f;
  for (const auto& v : c)
    for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

TEST(ExactSum, AnyOrderAndAnyGroupingGiveTheSameBits) {
  const int terms = 48, n = 301;
  const auto c = chunks_of(terms, n, 7);
  const int shift = exact_sum_shift(max_abs(c), terms);
  std::mt19937 gen(11);
  for (int i = 0; i < n; ++i) {
    const auto at = static_cast<std::size_t>(i);
    std::vector<std::int64_t> q;
    for (const auto& v : c) q.push_back(to_fixed(v[at], shift));
    const std::int64_t in_order = std::accumulate(q.begin(), q.end(), std::int64_t{0});
    // Grouped as ranks would hold them (uneven runs of chunks), each rank's partial sum first,
    // the partials in another order; and a pairwise tree over a shuffled order.
    for (int world : {1, 2, 3, 5, 7, 48}) {
      std::vector<std::int64_t> partial;
      for (int r = 0; r < world; ++r) {
        const ChunkRange k = rank_chunks(terms, 1, world, r);
        partial.push_back(std::accumulate(q.begin() + k.first, q.begin() + k.first + k.count, std::int64_t{0}));
      }
      std::reverse(partial.begin(), partial.end());
      ASSERT_EQ(std::accumulate(partial.begin(), partial.end(), std::int64_t{0}), in_order) << i << " " << world;
    }
    std::vector<std::int64_t> tree = q;
    std::shuffle(tree.begin(), tree.end(), gen);
    while (tree.size() > 1) {
      std::vector<std::int64_t> next;
      for (std::size_t k = 0; k + 1 < tree.size(); k += 2) next.push_back(tree[k] + tree[k + 1]);
      if (tree.size() % 2) next.push_back(tree.back());
      tree = next;
    }
    ASSERT_EQ(tree[0], in_order) << i;
  }
  // The plain float sums of the same terms do depend on the order, so the data can tell the two apart.
  int order_matters = 0;
  for (int i = 0; i < n; ++i) {
    float fwd = 0.0f, bwd = 0.0f;
    for (int t = 0; t < terms; ++t) fwd += c[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)];
    for (int t = terms - 1; t >= 0; --t) bwd += c[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)];
    order_matters += fwd != bwd;
  }
  EXPECT_GT(order_matters, 0) << "no float sum depended on its order: the data cannot show the difference";
}

TEST(ExactSum, WithinTheNotesBoundOfALongDoubleSum) {
  for (int terms : {1, 2, 7, 64, 1000}) {
    const auto c = chunks_of(terms, 257, static_cast<std::uint32_t>(terms));
    const float m = max_abs(c);
    const int shift = exact_sum_shift(m, terms);
    for (std::size_t i = 0; i < 257; ++i) {
      std::int64_t sum = 0;
      long double ref = 0;
      for (const auto& v : c) {
        const std::int64_t q = to_fixed(v[i], shift);
        ASSERT_LE(std::llabs(q), std::int64_t{1} << (62 - ceil_log2(terms))) << "a term outside the Note's range";
        sum += q;
        ref += v[i];
      }
      const float got = from_fixed(sum, shift);
      // Each term rounded by at most 2^-(shift+1); then one rounding to float.
      const long double bound = terms * std::ldexp(1.0L, -(shift + 1)) + std::fabs(ref) * std::ldexp(1.0L, -24) +
                                FLT_TRUE_MIN;
      ASSERT_LE(std::fabs(static_cast<long double>(got) - ref), bound) << "terms " << terms << " element " << i;
    }
  }
}

TEST(ExactSum, EdgesOfFloatsRange) {
  // The largest floats: no integer overflow; a true sum beyond float's range is inf, as a float
  // sum would be; opposite ones cancel exactly.
  int shift = exact_sum_shift(FLT_MAX, 2);
  EXPECT_EQ(from_fixed(to_fixed(FLT_MAX, shift) + to_fixed(-FLT_MAX, shift), shift), 0.0f);
  EXPECT_EQ(from_fixed(to_fixed(FLT_MAX, shift), shift), FLT_MAX);
  EXPECT_TRUE(std::isinf(from_fixed(to_fixed(FLT_MAX, shift) + to_fixed(FLT_MAX, shift), shift)));
  // The most terms, each the largest float: 2^30 of them still sum within int64 (each <= 2^32).
  shift = exact_sum_shift(FLT_MAX, std::int64_t{1} << 30);
  EXPECT_LE(std::llabs(to_fixed(FLT_MAX, shift)), std::int64_t{1} << 32);
  EXPECT_LE(std::llabs(to_fixed(-FLT_MAX, shift)), std::int64_t{1} << 32);
  // Denormals alone: every one exact.
  shift = exact_sum_shift(FLT_TRUE_MIN * 5, 4);
  std::int64_t s = 0;
  for (float x : {FLT_TRUE_MIN, FLT_TRUE_MIN * 2, -FLT_TRUE_MIN * 5, FLT_TRUE_MIN * 3}) s += to_fixed(x, shift);
  EXPECT_EQ(from_fixed(s, shift), FLT_TRUE_MIN);
  // All zeros: zero, whatever the shift.
  shift = exact_sum_shift(0.0f, 8);
  EXPECT_EQ(from_fixed(to_fixed(0.0f, shift) + to_fixed(-0.0f, shift), shift), 0.0f);
  // A term far below the largest vanishes (the Note's precision), one within its range does not.
  shift = exact_sum_shift(1.0f, 2);
  EXPECT_EQ(to_fixed(std::ldexp(1.0f, -70), shift), 0);
  EXPECT_EQ(from_fixed(to_fixed(1.0f, shift) + to_fixed(std::ldexp(1.0f, -40), shift), shift) - 1.0f, 0.0f);
  EXPECT_EQ(from_fixed(to_fixed(std::ldexp(1.0f, -40), shift), shift), std::ldexp(1.0f, -40));
  // No fixed point for a non-finite max: refused, for the non-finite guard to handle.
  EXPECT_THROW(exact_sum_shift(std::numeric_limits<float>::infinity(), 2), Error);
  EXPECT_THROW(exact_sum_shift(std::numeric_limits<float>::quiet_NaN(), 2), Error);
}

TEST(ExactSum, ChunksForEveryWorldSizeUpToTheNumberOfChunks) {
  const std::int64_t batch = 100, chunk = 4, chunks = 25;
  for (std::int64_t world = 1; world <= chunks; ++world) {
    std::int64_t next = 0, lo = chunks, hi = 0;
    for (std::int64_t r = 0; r < world; ++r) {
      const ChunkRange k = rank_chunks(batch, chunk, world, r);
      EXPECT_EQ(k.first, next) << world << " " << r;  // contiguous, in rank order
      next = k.first + k.count;
      lo = std::min(lo, k.count);
      hi = std::max(hi, k.count);
    }
    EXPECT_EQ(next, chunks) << world;   // every chunk, once
    EXPECT_LE(hi - lo, 1) << world;     // as evenly as it goes
    EXPECT_GE(lo, 1) << world;          // every rank has work
  }
  try {
    rank_chunks(batch, chunk, chunks + 1, 0);
    ADD_FAILURE() << "26 ranks on 25 chunks were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(e.what()).find("run on at most 25 ranks"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rank_chunks(batch, 3, 2, 0), Error);  // 3 does not divide 100
}

}  // namespace
}  // namespace mnist_mpi
