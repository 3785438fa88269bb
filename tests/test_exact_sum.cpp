// Note [Exact sums in fixed point] (include/mnist_mpi/exact_sum.hpp) and Note [Chunks of the global
// batch] (include/mnist_mpi/data/sampler.hpp), on their own: the same bits for any order and any
// grouping of the same terms, the precision the Note promises against a long double sum, the edges
// of float's range, and every world size's chunks up to the number of chunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/data/sampler.hpp"
#include "mnist_mpi/exact_sum.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/train/exact_sums.hpp"

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
        ASSERT_LE(std::llabs(q), std::int64_t{1} << term_bits(terms)) << "a term outside the Note's range";
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

// Note [Fixed point without a conversion instruction]: the additions give the bits of nearbyint
// and of the int64-to-double cast, ties and both ends of the range included.
TEST(ExactSum, ConversionsByAdditionEqualThePlainOnes) {
  std::mt19937_64 gen(3);
  std::uniform_int_distribution<int> shift_of(-30, 60);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::vector<std::pair<float, int>> cases = {{0.5f, 0},  {1.5f, 0},  {2.5f, 0},  {-0.5f, 0},      {-2.5f, 0},
                                              {0.0f, 10}, {-0.0f, 5}, {1.0f, 50}, {-1.0f, 50},     {0.75f, 51},
                                              {FLT_TRUE_MIN, 149}, {FLT_MAX, -77}, {-FLT_MAX, -77}};
  for (int i = 0; i < 200000; ++i) {
    const int shift = shift_of(gen);
    const float x = std::ldexp(mant(gen), 50 - shift);  // |x| * 2^shift < 2^50
    cases.push_back({x, shift});
  }
  for (const auto& [x, shift] : cases) {
    ASSERT_LT(std::fabs(std::ldexp(static_cast<double>(x), shift)), std::ldexp(1.0, 51));
    const std::int64_t q = to_fixed(x, shift);
    ASSERT_EQ(to_fixed_scaled(x, std::ldexp(1.0, shift)), q) << x << " * 2^" << shift;
    ASSERT_EQ(from_fixed_scaled(q, std::ldexp(1.0, -shift)), from_fixed(q, shift)) << q;
  }
  std::uniform_int_distribution<std::int64_t> any(std::numeric_limits<std::int64_t>::min() / 2,
                                                  std::numeric_limits<std::int64_t>::max() / 2);
  std::vector<std::int64_t> qs = {0, 1, -1, (std::int64_t{1} << 53) + 1, -(std::int64_t{1} << 53) - 1,
                                  (std::int64_t{1} << 62), -(std::int64_t{1} << 62), 0xffffffffLL, -0x100000000LL};
  for (int i = 0; i < 200000; ++i) qs.push_back(any(gen));
  for (const std::int64_t q : qs) ASSERT_EQ(int64_to_double(q), static_cast<double>(q)) << q;
}

// The engine of --exact-sums on its own: chunk gradients absorbed in any grouping (as 1, 2 or 3
// ranks hold them) and summed give the same float bits; a value beyond its predicted limit is
// counted (the step is then probed and computed again); a non-finite one makes the result NaN.
TEST(ExactSum, EngineGivesTheSameBitsForAnyGroupingAndCountsWhatItCannotHold) {
  ModelSpec spec = parse_model_spec("fc:7,relu,fc:3", Shape{1, 2, 3}, 3);
  const std::int64_t P = spec.param_count, chunks = 6;
  const auto grads = chunks_of(static_cast<int>(chunks), static_cast<int>(P), 5);
  auto run = [&](int world) {
    // Every "rank" absorbs its chunks into its own engine; the integers are then added up.
    std::vector<std::int64_t> total(static_cast<std::size_t>(P) + 2, 0);
    std::vector<ExactSums> engines;
    for (int r = 0; r < world; ++r) {
      engines.emplace_back(spec, chunks);
      ExactSums& x = engines.back();
      x.set_limits(std::vector<std::int32_t>(spec.params.size(), 12));  // 2^12 holds every value of chunks_of
      // A pass of other chunks first, as the previous step: the first chunk of a pass must
      // replace what the integers held, not add to it.
      x.begin_pass();
      for (int j = 0; j < 2; ++j) x.absorb_all(grads[static_cast<std::size_t>(chunks - 1 - r % 2 - j)].data(), j == 0);
      x.begin_pass();
      const ChunkRange k = rank_chunks(chunks, 1, world, r);
      for (std::int64_t j = 0; j < k.count; ++j) x.absorb_all(grads[static_cast<std::size_t>(k.first + j)].data(), j == 0);
      for (std::size_t i = 0; i < total.size(); ++i) total[i] += x.fixed()[i];
    }
    ExactSums& x = engines.front();
    std::copy(total.begin(), total.end(), x.fixed().begin());
    std::vector<float> out(static_cast<std::size_t>(P));
    EXPECT_EQ(x.out_of_range(), 0);
    x.to_float(out.data());
    return std::make_pair(out, x.limits());
  };
  const auto [one, limits1] = run(1);
  for (int world : {2, 3, 6}) {
    const auto [other, limits] = run(world);
    for (std::int64_t i = 0; i < P; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(other[static_cast<std::size_t>(i)]),
                std::bit_cast<std::uint32_t>(one[static_cast<std::size_t>(i)]))
          << "world " << world << " element " << i;
    EXPECT_EQ(limits, limits1) << "the next step's limits depend on the number of ranks";
  }
  // The next limit is the summed gradient's exponent plus the headroom.
  for (std::size_t t = 0; t < spec.params.size(); ++t) {
    float m = 0.0f;
    for (std::int64_t i = 0; i < spec.params[t].size; ++i)
      m = std::max(m, std::fabs(one[static_cast<std::size_t>(spec.params[t].offset + i)]));
    int e = 0;
    std::frexp(m, &e);
    EXPECT_EQ(limits1[t], e + ExactSums::kHeadroomBits) << spec.params[t].name;
  }
  // A value at its limit and a NaN: counted apart; the result is then NaN for the step guard.
  ExactSums x(spec, chunks);
  x.set_limits(std::vector<std::int32_t>(spec.params.size(), 0));  // values must be below 1
  std::vector<float> g(static_cast<std::size_t>(P), 0.25f);
  g[3] = 1.0f;
  g[5] = -3.0f;
  x.begin_pass();
  x.absorb_all(g.data(), true);
  EXPECT_EQ(x.out_of_range(), 2);
  EXPECT_EQ(x.nonfinite(), 0);
  g[4] = std::numeric_limits<float>::quiet_NaN();
  g[6] = -std::numeric_limits<float>::infinity();
  x.absorb_all(g.data(), false);
  EXPECT_EQ(x.out_of_range(), 4);
  EXPECT_EQ(x.nonfinite(), 2);
  std::vector<float> out(static_cast<std::size_t>(P));
  x.to_float(out.data());
  EXPECT_TRUE(std::isnan(out[0]) && std::isnan(out.back()));
  // A probe takes the largest finite value: a NaN or inf in a chunk leaves no limit of 2^200 behind
  // (which would round every later gradient of the tensor to 0); the pass counts it instead.
  const auto comm = make_mpi_communicator();
  ExactSums probed(spec, chunks);
  probed.begin_probe();
  std::vector<float> h(static_cast<std::size_t>(P), 0.75f);
  h[1] = std::numeric_limits<float>::quiet_NaN();
  h[2] = std::numeric_limits<float>::infinity();
  probed.probe_chunk(h.data());
  probed.finish_probe(*comm);
  EXPECT_FALSE(probed.needs_probe());
  for (const std::int32_t limit : probed.limits()) EXPECT_EQ(limit, 0);  // 0.75 < 2^0
  EXPECT_EQ(default_exact_chunk(100), 10);
  EXPECT_EQ(default_exact_chunk(256), 8);
  EXPECT_EQ(default_exact_chunk(97), 1);
}

// The host's passes (include/mnist_mpi/backend/fixed_point.hpp), which the GPU's must equal: the
// counters tell out-of-range from non-finite, a probe ignores NaN and inf while a conversion back
// keeps inf, read() hands over the slots and zeroes them (ExactSums relies on that: a probe starts
// from zero slots), and a range outside the integers is refused.
TEST(ExactSum, HostPassesCountProbeConvertAndZeroTheirSlots) {
  const auto passes = make_host_fixed_point_passes(8, 2);
  ASSERT_EQ(passes->integers().size(), 10u);  // 8, then the two counters
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> g = {0.5f, -0.25f, 1.0f, -3.0f, nan, inf, 0.75f, 0.0f};
  const int shift = shift_for_limit(0, 4);  // values below 1
  passes->to_fixed(g.data(), 0, 8, std::ldexp(1.0, shift), 1.0f, true);
  FixedPointCounts c = passes->read({});
  EXPECT_EQ(c.out_of_range, 2);  // 1.0 (at the bound) and -3
  EXPECT_EQ(c.nonfinite, 2);
  for (const int i : {0, 1, 6, 7})
    EXPECT_EQ(passes->integers()[static_cast<std::size_t>(i)], to_fixed(g[static_cast<std::size_t>(i)], shift));
  passes->probe(g.data(), 8, 0);
  std::vector<std::uint32_t> top(2, 7u);
  passes->read(top);
  EXPECT_EQ(top[0], std::bit_cast<std::uint32_t>(3.0f)) << "the largest finite magnitude";
  EXPECT_EQ(top[1], 0u);
  passes->read(top);
  EXPECT_EQ(top[0], 0u) << "read() zeroes the slots";
  std::vector<float> back(8, -1.0f);
  passes->from_fixed(6, back.data() + 6, 2, std::ldexp(1.0, -shift), 1);
  EXPECT_EQ(back[6], 0.75f);
  EXPECT_EQ(back[7], 0.0f);
  EXPECT_EQ(back[5], -1.0f) << "outside the range: untouched";
  passes->from_fixed(0, back.data(), 1, std::ldexp(1.0, 200), 1);  // 0.5 * 2^shift * 2^200: beyond float
  passes->read(top);
  EXPECT_EQ(top[1], 0x7f800000u) << "a sum beyond float's range is inf, and its magnitude is inf's";
  passes->zero_counters();
  c = passes->read({});
  EXPECT_EQ(c.out_of_range + c.nonfinite, 0);
  EXPECT_THROW(passes->to_fixed(g.data(), 5, 4, 1.0, 1.0f, true), Error);
  EXPECT_THROW(passes->from_fixed(-1, back.data(), 1, 1.0, 0), Error);
  // The engine on top: a probe after a conversion back takes its limits from the probe alone.
  ModelSpec spec = parse_model_spec("fc:3", Shape{1, 1, 2}, 3);
  ExactSums x(spec, 1);
  x.set_limits(std::vector<std::int32_t>(spec.params.size(), 12));
  std::vector<float> big(static_cast<std::size_t>(spec.param_count), 1000.0f), out(big.size());
  x.begin_pass();
  x.absorb_all(big.data(), true);
  x.to_float(out.data());  // slots: 1000's magnitude, then zeroed
  std::vector<float> small(big.size(), 0.1f);
  x.begin_probe();
  x.probe_chunk(small.data());
  const auto comm = make_mpi_communicator();
  x.finish_probe(*comm);
  for (const std::int32_t limit : x.limits()) EXPECT_EQ(limit, -3) << "0.1 < 2^-3: the probe's, not the sums'";
}

// Note [Hot loops checked by their ranges] (include/mnist_mpi/range_checked.hpp): the conversions'
// loops carry no per-access checks under AddressSanitizer; their one check per array must still
// catch an array one element short, in each direction.
TEST(ExactSum, HostPassesRangesAreCheckedUnderAddressSanitizer) {
#if defined(__SANITIZE_ADDRESS__)
  // Each death in a fresh run of this program, not a fork of this one: MPI's threads are running
  // here, and a fork copies whatever lock one of them held.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto passes = make_host_fixed_point_passes(8, 1);
  const std::vector<float> short_g(7, 0.5f);
  EXPECT_DEATH(passes->to_fixed(short_g.data(), 0, 8, 1.0, 1.0f, true), "AddressSanitizer: heap-buffer-overflow");
  std::vector<float> short_back(7, 0.0f);
  EXPECT_DEATH(passes->from_fixed(0, short_back.data(), 8, 1.0, 0), "AddressSanitizer: heap-buffer-overflow");
  const std::vector<float> g(8, 0.5f);
  std::vector<float> back(8, 0.0f);
  passes->to_fixed(g.data(), 0, 8, 1.0, 1.0f, true);  // whole arrays: no report
  passes->from_fixed(0, back.data(), 8, 1.0, 0);
  EXPECT_EQ(back[7], 0.0f) << "0.5 rounds to 0 at scale 1";
#else
  GTEST_SKIP() << "only under AddressSanitizer (scripts/test.sh's build-asan runs it)";
#endif
}

// Note [A weight gradient written once as integers] (include/mnist_mpi/backend/layer.hpp): a
// tensor a kernel hands over in tiles, every chunk's tile in turn, gives the integers and the
// probed limits of the same chunks absorbed whole; absorb_all and probe_chunk leave it alone (its
// floats in the gradient buffer are garbage then).
TEST(ExactSum, ATakenTensorFedInTilesGivesTheIntegersOfTheWhole) {
  ModelSpec spec = parse_model_spec("fc:7,relu,fc:3", Shape{1, 2, 3}, 3);
  const std::int64_t P = spec.param_count, chunks = 4;
  const auto grads = chunks_of(static_cast<int>(chunks), static_cast<int>(P), 11);
  const ParamTensor& w = spec.params[0];  // the last layer's weight comes first in the flat buffer
  ASSERT_FALSE(w.is_bias);
  const auto comm = make_mpi_communicator();
  ExactSums whole(spec, chunks), tiled(spec, chunks);
  tiled.take(w.offset, w.size);
  EXPECT_THROW(tiled.take(w.offset, w.size - 1), Error);  // not a tensor
  // The probe: the same limits.
  for (ExactSums* x : {&whole, &tiled}) x->begin_probe();
  for (const auto& g : grads) whole.probe_chunk(g.data());
  std::vector<float> garbage(static_cast<std::size_t>(P));
  for (std::size_t j = 0; j < grads.size(); ++j) {
    garbage = grads[j];
    std::fill(garbage.begin() + w.offset, garbage.begin() + w.offset + w.size, 1e30f);  // never written by the kernel
    tiled.probe_chunk(garbage.data());
  }
  const std::int64_t tile = 4;  // rows of 3: tiles of 4 elements and a shorter last one
  for (std::int64_t at = 0; at < w.size; at += tile)
    for (std::size_t j = 0; j < grads.size(); ++j)
      tiled.absorb_range(w.offset + at, grads[j].data() + w.offset + at, std::min(tile, w.size - at), j == 0);
  whole.finish_probe(*comm);
  tiled.finish_probe(*comm);
  EXPECT_EQ(tiled.limits(), whole.limits());
  // A pass: the same integers.
  for (ExactSums* x : {&whole, &tiled}) x->begin_pass();
  for (std::size_t j = 0; j < grads.size(); ++j) {
    whole.absorb_all(grads[j].data(), j == 0);
    garbage = grads[j];
    std::fill(garbage.begin() + w.offset, garbage.begin() + w.offset + w.size, 1e30f);
    tiled.absorb_all(garbage.data(), j == 0);
  }
  for (std::int64_t at = 0; at < w.size; at += tile)
    for (std::size_t j = 0; j < grads.size(); ++j)
      tiled.absorb_range(w.offset + at, grads[j].data() + w.offset + at, std::min(tile, w.size - at), j == 0);
  EXPECT_EQ(tiled.out_of_range(), 0);
  EXPECT_TRUE(std::equal(whole.fixed().begin(), whole.fixed().end(), tiled.fixed().begin()));
  // A range outside every taken tensor is refused.
  EXPECT_THROW(tiled.absorb_range(spec.params[1].offset, grads[0].data(), 1, true), Error);
}

}  // namespace
}  // namespace mnist_mpi
