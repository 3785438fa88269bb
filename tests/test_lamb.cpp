// LAMB (Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp) on the host: against
// a plain double-precision reference; the exact squared norms (Note [Exact squared norms] in
// include/mnist_mpi/exact_norm.hpp) the same bits however a tensor is cut and summed; the trust
// ratio's r = 1 cases; and a sharded optimiser over three simulated ranks, with shards that cut
// the tensors anywhere, bit for bit the unsharded one.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/exact_norm.hpp"
#include "mnist_mpi/train/optimizer.hpp"
#include "src/backend/cpu/bf16.hpp"

namespace mnist_mpi {
namespace {

// Two weight tensors around a bias: [0, 60) weights, [60, 67) a bias, [67, 100) weights.
const std::vector<OptimizerTensor> kTensors{{0, 60, true}, {60, 67, false}, {67, 100, true}};
constexpr std::int64_t kCount = 100;

OptimizerConfig lamb_config() {
  OptimizerConfig cfg;
  cfg.kind = OptimizerKind::kLamb;
  cfg.weight_decay = 0.01;
  return cfg;
}
std::vector<float> start_params() {
  std::vector<float> p(kCount);
  for (std::int64_t i = 0; i < kCount; ++i)
    p[static_cast<std::size_t>(i)] = 0.3f * std::sin(0.7f * static_cast<float>(i));
  return p;
}
std::vector<float> grads_of_step(int step) {
  std::vector<float> g(kCount);
  for (std::int64_t i = 0; i < kCount; ++i)
    g[static_cast<std::size_t>(i)] = 0.02f * std::cos(1.3f * static_cast<float>(i) + 0.9f * static_cast<float>(step));
  return g;
}

// LAMB as the paper writes it, in double: Adam's moments with PyTorch's bias correction, u with
// the decoupled decay, r = ||w|| / ||u|| per weight tensor (1 for a bias or a zero norm). The
// moments' betas are the floats the passes multiply by (as PyTorch's float tensors do: 1 - 0.9f
// is 0.10000002, which with the bias correction's exact 1 - 0.9 moves u by 7e-6 relative); the
// bias corrections are double's, as optimizer_scalars computes them.
struct LambReference {
  std::vector<double> p, m, v;
  std::vector<double> ratios;
  void step(const OptimizerConfig& cfg, const std::vector<float>& g, double lr, int step) {
    const double bc1 = 1.0 - std::pow(cfg.beta1, step), bc2 = 1.0 - std::pow(cfg.beta2, step);
    const double b1 = static_cast<float>(cfg.beta1), b2 = static_cast<float>(cfg.beta2);
    std::vector<double> u(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      m[i] = b1 * m[i] + (1.0 - b1) * g[i];
      v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
      u[i] = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + cfg.eps) + cfg.weight_decay * p[i];
    }
    ratios.clear();
    for (const OptimizerTensor& t : kTensors) {
      double w2 = 0.0, u2 = 0.0;
      for (std::int64_t i = t.begin; i < t.end; ++i) {
        w2 += p[static_cast<std::size_t>(i)] * p[static_cast<std::size_t>(i)];
        u2 += u[static_cast<std::size_t>(i)] * u[static_cast<std::size_t>(i)];
      }
      const double r = t.trust_ratio && w2 > 0.0 && u2 > 0.0 ? std::sqrt(w2) / std::sqrt(u2) : 1.0;
      ratios.push_back(r);
      for (std::int64_t i = t.begin; i < t.end; ++i)
        p[static_cast<std::size_t>(i)] -= lr * r * u[static_cast<std::size_t>(i)];
    }
  }
};

TEST(Lamb, MatchesADoublePrecisionReference) {
  const OptimizerConfig cfg = lamb_config();
  Optimizer opt(cfg, kCount);
  opt.set_tensors(kTensors);
  std::vector<float> p = start_params();
  LambReference ref{
      std::vector<double>(p.begin(), p.end()), std::vector<double>(kCount), std::vector<double>(kCount), {}};
  for (int t = 1; t <= 4; ++t) {
    const std::vector<float> g = grads_of_step(t);
    opt.step(p.data(), g.data(), 0.05);
    ref.step(cfg, g, 0.05, t);
    for (std::size_t k = 0; k < kTensors.size(); ++k)
      EXPECT_NEAR(opt.trust_ratio_of(k), ref.ratios[k], 1e-6 * ref.ratios[k]) << "step " << t << ", tensor " << k;
    for (std::size_t i = 0; i < p.size(); ++i)
      ASSERT_NEAR(p[i], ref.p[i], 1e-6 + 1e-5 * std::abs(ref.p[i])) << "step " << t << ", element " << i;
  }
  EXPECT_EQ(opt.trust_ratio_of(1), 1.0) << "a bias takes no trust ratio";
  EXPECT_LT(opt.trust_ratio_of(0), 1.0) << "a trust ratio of 1 would not test much";
  EXPECT_EQ(opt.steps_taken(), 4);
}

// Random floats over every binade (zeros, denormals and the largest included), signs mixed.
std::vector<float> wide_floats(std::size_t n, std::mt19937& rng) {
  std::vector<float> x(n);
  std::uniform_int_distribution<std::uint32_t> exponent(0, 254), mantissa(0, 0x7fffff), sign(0, 1);
  for (float& v : x) v = std::bit_cast<float>(sign(rng) << 31 | exponent(rng) << 23 | mantissa(rng));
  x[0] = 0.0f;
  x[1] = -0.0f;
  x[2] = std::bit_cast<float>(0x00000001u);  // the smallest denormal
  x[3] = std::bit_cast<float>(0x7f7fffffu);  // the largest float
  return x;
}

// Note [Exact squared norms]: any cuts, pieces added in any order, as bins or as limbs summed like
// the ranks' allreduce (canonical or with carries left in), give the same double.
TEST(ExactNorm, SameBitsWhateverTheSplitAndTheOrder) {
  std::mt19937 rng(12345);
  for (const bool wide : {true, false}) {
    SCOPED_TRACE(wide ? "every binade" : "weights of one scale");
    std::vector<float> x = wide_floats(5000, rng);
    if (!wide) {
      std::normal_distribution<float> normal(0.0f, 0.05f);
      for (float& v : x) v = normal(rng);
    }
    SquaredNorm whole;
    whole.add(x.data(), static_cast<std::int64_t>(x.size()));
    const double want = whole.value();
    long double plain = 0.0L;  // a close value, to show the exact one is the sum
    std::vector<long double> squares;
    for (const float v : x) squares.push_back(static_cast<long double>(v) * v);
    std::sort(squares.begin(), squares.end());
    for (const long double s : squares) plain += s;
    EXPECT_NEAR(want / static_cast<double>(plain), 1.0, 1e-15);
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<std::size_t> cuts{0, x.size()};
      std::uniform_int_distribution<std::size_t> at(0, x.size());
      for (int k = trial % 13; k > 0; --k) cuts.push_back(at(rng));
      std::sort(cuts.begin(), cuts.end());
      std::vector<SquaredNorm> pieces(cuts.size() - 1);
      for (std::size_t k = 0; k + 1 < cuts.size(); ++k)
        pieces[k].add(x.data() + cuts[k], static_cast<std::int64_t>(cuts[k + 1] - cuts[k]));
      std::shuffle(pieces.begin(), pieces.end(), rng);
      SquaredNorm merged;
      for (const SquaredNorm& s : pieces) merged.add(s);
      ASSERT_EQ(std::bit_cast<std::uint64_t>(merged.value()), std::bit_cast<std::uint64_t>(want)) << "trial " << trial;
      std::vector<std::int64_t> limbs(kNormWords, 0);
      for (const SquaredNorm& s : pieces) {  // each piece a rank's limbs, summed in int64
        std::vector<std::int64_t> mine(kNormWords, 0);
        s.add_to_limbs(mine);
        for (int k = 0; k < kNormWords; ++k) limbs[static_cast<std::size_t>(k)] += mine[static_cast<std::size_t>(k)];
      }
      ASSERT_EQ(std::bit_cast<std::uint64_t>(squared_norm_of_limbs(limbs)), std::bit_cast<std::uint64_t>(want));
      for (int k = kNormWords - 1; k > 0; --k)  // carries moved down a limb where they can be: the same value
        if (k % kNormLimbs != 0 && limbs[static_cast<std::size_t>(k)] > 0) {
          limbs[static_cast<std::size_t>(k)] -= 1;
          limbs[static_cast<std::size_t>(k - 1)] += std::int64_t{1} << 32;
        }
      ASSERT_EQ(std::bit_cast<std::uint64_t>(squared_norm_of_limbs(limbs)), std::bit_cast<std::uint64_t>(want));
    }
  }
}

// r = 1 when ||w|| = 0 (the step is then lr * u, u about sign(g) at the first step) or ||u|| = 0
// (nothing moves).
TEST(Lamb, TrustRatioIsOneWhenANormIsZero) {
  EXPECT_EQ(trust_ratio(0.0, 4.0), 1.0);
  EXPECT_EQ(trust_ratio(4.0, 0.0), 1.0);
  EXPECT_EQ(trust_ratio(0.0, 0.0), 1.0);
  EXPECT_EQ(trust_ratio(9.0, 4.0), 1.5);
  OptimizerConfig cfg = lamb_config();
  Optimizer zero_weights(cfg, kCount);
  zero_weights.set_tensors(kTensors);
  std::vector<float> p(kCount, 0.0f);
  const std::vector<float> g = grads_of_step(1);
  zero_weights.step(p.data(), g.data(), 0.01);
  for (std::size_t k = 0; k < kTensors.size(); ++k) EXPECT_EQ(zero_weights.trust_ratio_of(k), 1.0) << k;
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(p[i], g[i] > 0 ? -0.01f : 0.01f, 1e-6f) << i;

  cfg.weight_decay = 0.0;  // no gradient and no decay: u = 0
  Optimizer zero_update(cfg, kCount);
  zero_update.set_tensors(kTensors);
  const std::vector<float> p0 = start_params();
  std::vector<float> q = p0;
  const std::vector<float> none(kCount, 0.0f);
  zero_update.step(q.data(), none.data(), 0.01);
  for (std::size_t k = 0; k < kTensors.size(); ++k) EXPECT_EQ(zero_update.trust_ratio_of(k), 1.0) << k;
  EXPECT_EQ(q, p0);
}

// Note [Sharded optimiser state] with LAMB: three ranks, each owning ranges that cut the tensors
// anywhere, run the first phase on their ranges, add their norm limbs (the allreduce), run the
// second phase and "gather" their ranges; over 5 steps the parameters are the unsharded
// optimiser's bit for bit, and so are those of an unsharded one fed in other pieces.
TEST(Lamb, ShardedOverThreeRanksIsTheUnshardedBitForBit) {
  auto backend = make_cpu_backend(1);
  const OptimizerConfig cfg = lamb_config();
  const std::vector<std::vector<ParamRange>> every_rank{{{0, 17}, {45, 61}}, {{17, 45}, {80, 100}}, {{61, 80}}};
  std::vector<std::unique_ptr<Optimizer>> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(std::make_unique<Optimizer>(cfg, kCount, *backend, every_rank, r));
    ranks.back()->set_tensors(kTensors);
  }
  Optimizer whole(cfg, kCount);
  whole.set_tensors(kTensors);
  Optimizer pieces(cfg, kCount, *backend);
  pieces.set_tensors(kTensors);
  std::vector<float> p_sharded = start_params(), p_whole = p_sharded, p_pieces = p_sharded;
  for (int t = 1; t <= 5; ++t) {
    const std::vector<float> g = grads_of_step(t);
    const double lr = 0.05 / t;
    whole.step(p_whole.data(), g.data(), lr);

    std::vector<float> g_pieces = g;  // pieces: [0, 33), [33, 34), [34, 100)
    pieces.begin_step(lr);
    for (const auto& [b, e] : {std::pair<std::int64_t, std::int64_t>{34, 100}, {0, 33}, {33, 34}})
      pieces.update(p_pieces.data(), g_pieces.data(), b, e);
    pieces.finish_first_phase(nullptr);
    pieces.update_second(p_pieces.data(), g_pieces.data(), 0, kCount);

    std::vector<std::vector<float>> g_rank(3, g);  // each rank's summed gradients (its shards' part matters)
    std::vector<std::int64_t> summed;
    for (int r = 0; r < 3; ++r) {
      Optimizer& o = *ranks[static_cast<std::size_t>(r)];
      o.begin_step(lr);
      for (const ParamRange& s : every_rank[static_cast<std::size_t>(r)])
        o.update(p_sharded.data(), g_rank[static_cast<std::size_t>(r)].data(), s.begin, s.end);
      const std::span<std::int64_t> mine = o.take_norm_sums();
      if (summed.empty()) summed.assign(mine.size(), 0);
      for (std::size_t k = 0; k < mine.size(); ++k) summed[k] += mine[k];
    }
    std::vector<float> gathered = p_sharded;
    for (int r = 0; r < 3; ++r) {
      Optimizer& o = *ranks[static_cast<std::size_t>(r)];
      o.finish_first_phase(std::span<const std::int64_t>(summed));
      std::vector<float> mine = p_sharded;  // the rank's replica, updated on its own ranges
      for (const ParamRange& s : every_rank[static_cast<std::size_t>(r)]) {
        o.update_second(mine.data(), g_rank[static_cast<std::size_t>(r)].data(), s.begin, s.end);
        std::copy(mine.begin() + s.begin, mine.begin() + s.end, gathered.begin() + s.begin);
      }
    }
    p_sharded = gathered;
    ASSERT_EQ(0, std::memcmp(p_sharded.data(), p_whole.data(), p_whole.size() * sizeof(float))) << "step " << t;
    ASSERT_EQ(0, std::memcmp(p_pieces.data(), p_whole.data(), p_whole.size() * sizeof(float))) << "step " << t;
  }
  EXPECT_NE(p_whole, start_params());
}

}  // namespace
}  // namespace mnist_mpi
