// Tests of the softmax cross-entropy loss (hand-computed values, huge logits, count of correct
// predictions, and that it is not a per-class sigmoid / binary cross-entropy), of the Adam and SGD
// updates against PyTorch's formulas evaluated by hand in double, and of the learning-rate
// schedules (constant, step with a floor, cosine with linear warm-up).
#include <set>
#include <gtest/gtest.h>
#include <bit>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <memory>
#include <numbers>
#include <string>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/bf16.hpp"
#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/optimizer.hpp"
#include "reference.hpp"
#include "src/backend/cpu/bf16.hpp"  // bf16_bits and to_bf16, tested below

namespace mnist_mpi {
namespace {

TEST(SoftmaxCrossEntropy, HandComputedCase) {
  auto be = make_cpu_backend(1);
  const std::vector<float> z{1.0f, 2.0f, 3.0f};
  const std::vector<std::int32_t> y{2};
  std::vector<float> d(3, 99.0f);
  const float scale = 0.5f;
  const LossStats s = be->softmax_cross_entropy(z.data(), y.data(), 1, 3, d.data(), scale);
  const double e1 = std::exp(1.0), e2 = std::exp(2.0), e3 = std::exp(3.0), sum = e1 + e2 + e3;
  EXPECT_NEAR(s.loss_sum, std::log(sum) - 3.0, 1e-6);  // 0.4076...
  EXPECT_NEAR(s.loss_sum, 0.40760596444438, 1e-6);
  EXPECT_EQ(s.correct, 1);
  EXPECT_NEAR(d[0], (e1 / sum - 0.0) * scale, 1e-7);
  EXPECT_NEAR(d[1], (e2 / sum - 0.0) * scale, 1e-7);
  EXPECT_NEAR(d[2], (e3 / sum - 1.0) * scale, 1e-7);
  // Without dlogits only the statistics are computed.
  const LossStats s2 = be->softmax_cross_entropy(z.data(), y.data(), 1, 3, nullptr, scale);
  EXPECT_EQ(s2.loss_sum, s.loss_sum);
}

TEST(SoftmaxCrossEntropy, IsNotBinaryCrossEntropy) {
  // A per-class sigmoid loss on the same case would give
  //   softplus(1) + softplus(2) + softplus(-3) = 3.4888...
  auto be = make_cpu_backend(1);
  const std::vector<float> z{1.0f, 2.0f, 3.0f};
  const std::vector<std::int32_t> y{2};
  std::vector<float> d(3);
  const LossStats s = be->softmax_cross_entropy(z.data(), y.data(), 1, 3, d.data(), 1.0f);
  auto softplus = [](double v) { return std::log1p(std::exp(v)); };
  const double bce = softplus(1.0) + softplus(2.0) + softplus(-3.0);
  EXPECT_NEAR(bce, 3.48878, 1e-4);
  EXPECT_GT(std::abs(s.loss_sum - bce), 1.0);
  // Softmax gradients sum to zero over the classes (sigmoid - onehot would sum to 0.73 + 0.88 - 0.05).
  EXPECT_NEAR(d[0] + d[1] + d[2], 0.0, 1e-6);
  // And the loss is invariant to a shift of every logit; a sigmoid loss is not.
  const std::vector<float> shifted{101.0f, 102.0f, 103.0f};
  const LossStats s3 = be->softmax_cross_entropy(shifted.data(), y.data(), 1, 3, nullptr, 1.0f);
  EXPECT_NEAR(s3.loss_sum, s.loss_sum, 1e-5);
}

TEST(SoftmaxCrossEntropy, HugeLogitsStayFinite) {
  auto be = make_cpu_backend(1);
  const std::vector<float> z{1e4f, -1e4f, 1e4f, -1e4f};  // two rows
  const std::vector<std::int32_t> y{0, 1};
  std::vector<float> d(4);
  const LossStats s = be->softmax_cross_entropy(z.data(), y.data(), 2, 2, d.data(), 0.5f);
  ASSERT_TRUE(std::isfinite(s.loss_sum));
  EXPECT_NEAR(s.loss_sum, 0.0 + 2e4, 1e-3);  // row 0: 0, row 1: 2e4
  EXPECT_EQ(s.correct, 1);
  for (float v : d) ASSERT_TRUE(std::isfinite(v));
  EXPECT_NEAR(d[0], 0.0f, 1e-7);
  EXPECT_NEAR(d[1], 0.0f, 1e-7);
  EXPECT_NEAR(d[2], 0.5f, 1e-7);   // softmax 1, not the label
  EXPECT_NEAR(d[3], -0.5f, 1e-7);  // softmax 0, the label

  const std::vector<std::int32_t> y1{1};
  const LossStats s1 = be->softmax_cross_entropy(z.data(), y1.data(), 1, 2, nullptr, 1.0f);
  EXPECT_NEAR(s1.loss_sum, 2e4, 1e-3);
}

TEST(SoftmaxCrossEntropy, CountsCorrectAndMatchesReference) {
  auto be = make_cpu_backend(1);
  const int batch = 4, classes = 5;
  const std::vector<float> z{0.1f,  2.0f,  -1.0f, 0.0f,  0.5f,   // argmax 1
                             3.0f,  2.9f,  0.0f,  0.0f,  -2.0f,  // argmax 0
                             -1.0f, -2.0f, -0.5f, -3.0f, -0.6f,  // argmax 2
                             0.0f,  0.0f,  0.0f,  0.0f,  4.0f};  // argmax 4
  const std::vector<std::int32_t> y{1, 1, 2, 0};                 // rows 0 and 2 correct
  std::vector<float> d(static_cast<std::size_t>(batch * classes));
  const LossStats s = be->softmax_cross_entropy(z.data(), y.data(), batch, classes, d.data(), 0.25f);
  EXPECT_EQ(s.correct, 2);
  const ref::SoftmaxXent r =
      ref::softmax_cross_entropy(std::vector<double>(z.begin(), z.end()), y, batch, classes, 0.25);
  EXPECT_EQ(r.correct, 2);
  EXPECT_NEAR(s.loss_sum, r.loss_sum, 1e-5);
  for (std::size_t i = 0; i < d.size(); ++i) EXPECT_NEAR(d[i], r.dlogits[i], 1e-7) << i;
}

// ---- optimisers ----

const std::vector<float> kP0{0.5f, -1.0f, 2.0f};
const std::vector<float> kG1{0.1f, -0.2f, 0.3f};
const std::vector<float> kG2{-0.05f, 0.4f, 0.0f};

// PyTorch's Adam, in double, on the float inputs.
std::vector<double> adam_by_hand(double lr, double wd, std::vector<double>* m_out) {
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  std::vector<double> p(kP0.begin(), kP0.end()), m(3, 0.0), v(3, 0.0);
  const std::vector<float>* gs[2] = {&kG1, &kG2};
  for (int t = 1; t <= 2; ++t) {
    for (std::size_t i = 0; i < 3; ++i) {
      const double g = static_cast<double>((*gs[t - 1])[i]) + wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + eps;
      p[i] -= lr / bc1 * m[i] / denom;
    }
  }
  *m_out = m;
  return p;
}

std::unique_ptr<Optimizer> run_two_steps(const OptimizerConfig& cfg, double lr, std::vector<float>* p) {
  auto opt = std::make_unique<Optimizer>(cfg, 3);
  *p = kP0;
  opt->step(p->data(), kG1.data(), lr);
  opt->step(p->data(), kG2.data(), lr);
  return opt;
}

TEST(Adam, TwoStepsMatchPyTorch) {
  OptimizerConfig cfg;
  cfg.kind = OptimizerKind::kAdam;
  std::vector<float> p;
  const auto opt = run_two_steps(cfg, 1e-2, &p);
  std::vector<double> m;
  const std::vector<double> want = adam_by_hand(1e-2, 0.0, &m);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(p[i], want[i], 1e-6) << i;
    EXPECT_NEAR(opt->first_moment()[i], m[i], 1e-7) << i;
  }
  EXPECT_EQ(opt->steps_taken(), 2);
  // Bias correction makes the first step lr * sign(g): p0 - 0.01 * sign(g1), checked on its own.
  Optimizer one(cfg, 3);
  std::vector<float> q = kP0;
  one.step(q.data(), kG1.data(), 1e-2);
  EXPECT_NEAR(q[0], 0.49, 1e-6);
  EXPECT_NEAR(q[1], -0.99, 1e-6);
  EXPECT_NEAR(q[2], 1.99, 1e-6);
}

TEST(Adam, WeightDecayIsAddedToTheGradient) {
  OptimizerConfig cfg;
  cfg.kind = OptimizerKind::kAdam;
  cfg.weight_decay = 0.1;
  std::vector<float> p;
  run_two_steps(cfg, 1e-2, &p);
  std::vector<double> m;
  const std::vector<double> want = adam_by_hand(1e-2, 0.1, &m);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(p[i], want[i], 1e-6) << i;
  // Element 2's second gradient is 0: only the decay moves it, so it differs from no decay.
  std::vector<double> m0;
  EXPECT_GT(std::abs(want[2] - adam_by_hand(1e-2, 0.0, &m0)[2]), 1e-4);
}

// PyTorch's SGD in double: buf = mu * buf + g (buf = g at the first step), nesterov: g + mu * buf.
std::vector<double> sgd_by_hand(double lr, double mu, bool nesterov, double wd) {
  std::vector<double> p(kP0.begin(), kP0.end()), buf(3, 0.0);
  const std::vector<float>* gs[2] = {&kG1, &kG2};
  for (int t = 0; t < 2; ++t)
    for (std::size_t i = 0; i < 3; ++i) {
      double g = static_cast<double>((*gs[t])[i]) + wd * p[i];
      if (mu != 0.0) {
        buf[i] = t == 0 ? g : mu * buf[i] + g;
        g = nesterov ? g + mu * buf[i] : buf[i];
      }
      p[i] -= lr * g;
    }
  return p;
}

TEST(Sgd, PlainMomentumNesterovWeightDecay) {
  struct Case {
    double mu;
    bool nesterov;
    double wd;
  };
  for (const Case& c : {Case{0.0, false, 0.0}, Case{0.9, false, 0.0}, Case{0.9, true, 0.0}, Case{0.0, false, 0.1},
                        Case{0.9, true, 0.1}}) {
    SCOPED_TRACE(testing::Message() << "momentum " << c.mu << " nesterov " << c.nesterov << " wd " << c.wd);
    OptimizerConfig cfg;
    cfg.kind = OptimizerKind::kSgd;
    cfg.momentum = c.mu;
    cfg.nesterov = c.nesterov;
    cfg.weight_decay = c.wd;
    std::vector<float> p;
    run_two_steps(cfg, 0.1, &p);
    const std::vector<double> want = sgd_by_hand(0.1, c.mu, c.nesterov, c.wd);
    for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(p[i], want[i], 1e-6) << i;
  }
  // The hand values themselves, for the plain case: p - 0.1 * (g1 + g2).
  const std::vector<double> plain = sgd_by_hand(0.1, 0.0, false, 0.0);
  EXPECT_NEAR(plain[0], 0.5 - 0.1 * (0.1 - 0.05), 1e-7);
  EXPECT_NEAR(plain[1], -1.0 - 0.1 * (-0.2 + 0.4), 1e-7);
  // Momentum, element 0: buf1 = 0.1, buf2 = 0.9 * 0.1 - 0.05 = 0.04; p = 0.5 - 0.01 - 0.004.
  EXPECT_NEAR(sgd_by_hand(0.1, 0.9, false, 0.0)[0], 0.486, 1e-7);
  // Nesterov, element 0: steps 0.1 + 0.09 = 0.19, then -0.05 + 0.036 = -0.014; p = 0.5 - 0.019 + 0.0014.
  EXPECT_NEAR(sgd_by_hand(0.1, 0.9, true, 0.0)[0], 0.4824, 1e-7);
}

// Note [The parameters and their copies] (include/mnist_mpi/backend/parameter_store.hpp): an
// optimiser on a store writes the bf16 image of an fc's weights in the same pass as the weights
// (bf16_bits of each new parameter), and the parameters are those of an optimiser without a store;
// sgd (with momentum and nesterov), adam and lamb's two phases, each over a range cut in two
// (inside the weights, and the bias outside the image).
TEST(Optimizer, Bf16ImageIsTheUpdatedParametersInBf16) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no bf16 instructions (no bf16 run keeps images)";
  auto be = make_cpu_backend(1, {.bf16 = true});
  const ModelSpec spec = parse_model_spec("flatten,fc:10", {1, 10, 10}, 10);
  const std::int64_t n = spec.param_count;  // 1000 weights, then 10 biases
  for (const OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kSgd, OptimizerKind::kLamb}) {
    SCOPED_TRACE(name_of(kind));
    OptimizerConfig cfg;
    cfg.kind = kind;
    cfg.momentum = 0.9;
    cfg.nesterov = true;
    cfg.weight_decay = 0.01;
    std::vector<float> p0(static_cast<std::size_t>(n)), g(p0.size()), grads(p0.size());
    for (std::int64_t i = 0; i < n; ++i) {
      p0[static_cast<std::size_t>(i)] = std::sin(0.37f * static_cast<float>(i));
      g[static_cast<std::size_t>(i)] = 0.01f * std::cos(1.3f * static_cast<float>(i));
    }
    ParameterStore store(*be, n);
    float* with = store.host();
    std::copy(p0.begin(), p0.end(), with);
    Model model(spec, 2, *be, store, grads.data());
    ASSERT_EQ(store.plain_bf16_images().size(), 1u);
    const LayerKernel::PlainCopy image = store.plain_bf16_images()[0];
    const std::int64_t w0 = image.begin - with, w1 = image.end - with;
    ASSERT_TRUE(0 < w0 + 400 && w0 + 400 < w1 && w1 < n) << "the cut is not inside the weights";
    std::vector<float> without = p0;
    Optimizer a(cfg, n, *be, &store), b(cfg, n);
    for (int step = 0; step < 3; ++step) {
      std::vector<float> ga = g;  // lamb writes its direction over the gradients it is given
      a.begin_step(1e-2);
      a.update(with, ga.data(), 0, w0 + 400);
      a.update(with, ga.data(), w0 + 400, n);
      if (a.two_phase()) {  // Note [LAMB in two phases]: the parameters are written by the second
        a.finish_first_phase(nullptr);
        a.update_second(with, ga.data(), 0, w0 + 400);
        a.update_second(with, ga.data(), w0 + 400, n);
      }
      b.step(without.data(), g.data(), 1e-2);
    }
    EXPECT_TRUE(std::equal(without.begin(), without.end(), with)) << "the image changed the update";
    EXPECT_NE(without, p0) << "nothing was updated";
    for (std::int64_t i = 0; i < w1 - w0; ++i)
      ASSERT_EQ(image.copy[i], cpu::bf16_bits(image.begin[i])) << "weight " << i << " of " << image.begin[i];
  }
}

// bf16_bits is the rounding of VCVTNEPS2BF16 (the fc copies are made by either): nearest even,
// ties both ways, denormals to a zero of their sign, infinities, NaNs quiet; and random bits.
// Note [bf16 on the wire with error feedback] (src/train/codecs/bf16_codec.cpp): what a bf16
// codec's encoding leaves out is its residual, exactly (bf16(v) + e == v), and the next steps
// send it; a value bf16 cannot hold (1 + 2^-10 rounds to 1) reaches the sum on average with the
// feedback and never without it. A non-finite value is sent as it is and leaves no residual.
TEST(Bf16, TheWireSumAndTheFeedbackLoseNothing) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> any(-4.0f, 4.0f);
  constexpr int n = 4099;  // past every vector width, with a tail
  std::vector<float> g(n), e(n), e_before(n);
  std::vector<Bf16> wire(n), a(n), b(n);
  for (int i = 0; i < n; ++i) {
    g[i] = any(gen);
    e[i] = any(gen) * 0x1p-9f;
    a[i].bits = bf16_bits(any(gen));
    b[i].bits = bf16_bits(any(gen));
  }
  std::vector<Bf16> sum = a;
  bf16_add(sum.data(), b.data(), n);
  for (int i = 0; i < n; ++i) {
    Bf16 one = a[i];
    one += b[i];
    ASSERT_EQ(sum[i].bits, one.bits) << i;
    ASSERT_EQ(sum[i].bits, bf16_bits(bf16_to_float(a[i].bits) + bf16_to_float(b[i].bits))) << i;
  }
  e_before = e;
  bf16_encode_with_feedback(g.data(), e.data(), wire.data(), n);
  for (int i = 0; i < n; ++i) {
    const float v = g[i] + e_before[i];
    ASSERT_EQ(wire[i].bits, bf16_bits(v)) << i;
    ASSERT_EQ(bf16_to_float(wire[i].bits) + e[i], v) << "the residual is what the rounding left out, " << i;
  }
  // One value bf16 cannot hold, sent 1000 times.
  constexpr int steps = 1000;
  const float x = 1.0f + 0x1p-10f;
  float residual = 0.0f, sent = 0.0f;
  double with = 0.0, without = 0.0;
  for (int k = 0; k < steps; ++k) {
    Bf16 w;
    bf16_encode_with_feedback(&x, &residual, &w, 1);
    with += bf16_to_float(w.bits);
    without += bf16_to_float(bf16_bits(x));
    sent = bf16_to_float(w.bits);
  }
  (void)sent;
  EXPECT_LE(std::abs(with - steps * double(x)), std::abs(residual) + 1e-3) << "with the feedback";
  EXPECT_GE(std::abs(without - steps * double(x)), 0.9) << "without it 2^-10 is lost at every step";
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    float r = 0.25f;
    Bf16 w;
    bf16_encode_with_feedback(&bad, &r, &w, 1);
    EXPECT_FALSE(std::isfinite(bf16_to_float(w.bits))) << "a non-finite gradient reaches the sum as it is";
    EXPECT_EQ(r, 0.0f) << "and leaves no residual to poison the next steps";
  }
  std::vector<float> decoded(n);
  bf16_decode(wire.data(), decoded.data(), n);
  for (int i = 0; i < n; ++i) ASSERT_EQ(decoded[i], bf16_to_float(wire[i].bits)) << i;
}

TEST(Bf16, TheRoundingIsTheInstructions) {
  if (!cpu::cpu_has_avx512_bf16()) GTEST_SKIP() << "this CPU has no AVX512-BF16 to compare with";
  std::vector<std::uint32_t> bits{0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x00400000u, 0x00800000u,
                                  0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0x7f7fffffu, 0xff7fffffu,
                                  0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffa00000u, 0x7fffffffu};
  std::uint32_t x = 12345u;
  for (int i = 0; i < 100000; ++i) {
    x = x * 1664525u + 1013904223u;
    bits.push_back(x);
  }
  std::vector<float> f(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) f[i] = std::bit_cast<float>(bits[i]);
  std::vector<std::uint16_t> hw(f.size());
  cpu::to_bf16(f.data(), hw.data(), static_cast<std::int64_t>(f.size()));
  for (std::size_t i = 0; i < f.size(); ++i) ASSERT_EQ(cpu::bf16_bits(f[i]), hw[i]) << std::hex << "bits 0x" << bits[i];
}

// One row per kind, each with its own name and checkpoint code (a code reused would make an old
// checkpoint name another optimiser), found back from both.
TEST(Optimizer, EveryKindHasOneRowFoundByNameAndCode) {
  std::set<std::string> names;
  std::set<std::uint32_t> codes;
  for (const OptimizerTraits& t : kOptimizerTraits) {
    EXPECT_TRUE(names.insert(t.name).second) << t.name;
    EXPECT_TRUE(codes.insert(t.checkpoint_code).second) << t.name;
    EXPECT_EQ(&traits(t.kind), &t);
    EXPECT_EQ(optimizer_kind_named(t.name), t.kind);
    EXPECT_EQ(optimizer_kind_of_code(t.checkpoint_code), t.kind);
    EXPECT_TRUE(t.moments == 1 || t.moments == 2) << t.name;
  }
  EXPECT_EQ(traits(OptimizerKind::kAdam).checkpoint_code, 0u);  // the format's codes (docs/checkpoint.md)
  EXPECT_EQ(traits(OptimizerKind::kSgd).checkpoint_code, 1u);
  EXPECT_EQ(traits(OptimizerKind::kLamb).checkpoint_code, 2u);
  EXPECT_EQ(optimizer_kind_named("rmsprop"), std::nullopt);
  EXPECT_EQ(optimizer_kind_of_code(7), std::nullopt);
  EXPECT_EQ(optimizer_names(), "adam | sgd | lamb");
}

// ---- learning-rate schedules ----

TEST(LearningRate, Constant) {
  ScheduleConfig s;
  s.kind = "constant";
  s.base_lr = 1e-3;
  EXPECT_DOUBLE_EQ(learning_rate(s, 0, 0, 100), 1e-3);
  EXPECT_DOUBLE_EQ(learning_rate(s, 99, 7, 100), 1e-3);
}

TEST(LearningRate, StepDecayPerEpochWithFloor) {
  ScheduleConfig s;
  s.kind = "step";
  s.base_lr = 1e-3;
  s.gamma = 0.7;
  s.step_epochs = 1;
  s.min_lr = 1e-5;
  EXPECT_NEAR(learning_rate(s, 0, 0, 1000), 1e-3, 1e-15);
  EXPECT_NEAR(learning_rate(s, 50, 0, 1000), 1e-3, 1e-15);  // within an epoch: constant
  EXPECT_NEAR(learning_rate(s, 100, 1, 1000), 7e-4, 1e-15);
  EXPECT_NEAR(learning_rate(s, 200, 2, 1000), 4.9e-4, 1e-15);
  EXPECT_NEAR(learning_rate(s, 900, 12, 1000), 1e-3 * std::pow(0.7, 12), 1e-15);  // 1.38e-5: above the floor
  EXPECT_DOUBLE_EQ(learning_rate(s, 990, 13, 1000), 1e-5);                        // 0.7^13 * 1e-3 = 9.7e-6: the floor
  EXPECT_DOUBLE_EQ(learning_rate(s, 5000, 50, 10000), 1e-5);                      // 0.7^50 * 1e-3 = 1.8e-11: the floor
}

TEST(LearningRate, CosineWithWarmup) {
  ScheduleConfig s;
  s.kind = "cosine";
  s.base_lr = 1e-3;
  s.min_lr = 1e-5;
  s.warmup_steps = 10;
  const std::int64_t total = 110;                                // 100 cosine steps after the warm-up
  EXPECT_NEAR(learning_rate(s, 0, 0, total), 1e-3 / 10, 1e-15);  // first warm-up step: base / 10
  EXPECT_NEAR(learning_rate(s, 4, 0, total), 1e-3 * 5 / 10, 1e-15);
  EXPECT_NEAR(learning_rate(s, 10, 0, total), 1e-3, 1e-15);                        // the cosine's start
  EXPECT_NEAR(learning_rate(s, 60, 0, total), 1e-5 + 0.5 * (1e-3 - 1e-5), 1e-15);  // half-way
  EXPECT_NEAR(learning_rate(s, 35, 0, total), 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + std::cos(std::numbers::pi / 4)), 1e-15);
  EXPECT_NEAR(learning_rate(s, 110, 0, total), 1e-5, 1e-15);  // the end: min_lr
  EXPECT_NEAR(learning_rate(s, 500, 0, total), 1e-5, 1e-15);  // clamped past the end
}

TEST(LearningRate, UnknownScheduleThrows) {
  ScheduleConfig s;
  s.kind = "linear";
  EXPECT_THROW(learning_rate(s, 0, 0, 10), Error);
}

// Note [Non-finite steps] on the host: a non-finite loss poisons dlogits (in every later
// micro-batch of the step too), a non-finite bucket is refused, and the verdict of the step says
// which, known as soon as the step ends (lag 0).
TEST(StepGuard, HostGuardPoisonsRefusesAndReportsTheStep) {
  auto be = make_cpu_backend(1);
  auto guard = be->make_step_guard(false);
  EXPECT_EQ(guard->lag(), 0);
  auto meter = be->make_loss_meter();
  const float logits[2] = {0.5f, -0.5f};
  const std::int32_t label[1] = {1};
  float dlogits[2] = {0, 0};
  const float good[3] = {1, 2, 3}, bad[3] = {1, std::nanf(""), 3};

  guard->begin_step();
  be->softmax_cross_entropy(logits, label, 1, 2, dlogits, 1.0f, *meter);
  guard->after_loss(*meter, dlogits, false);
  EXPECT_TRUE(std::isfinite(dlogits[0]));
  EXPECT_TRUE(guard->bucket_ok(good, 3));
  guard->end_step(0);
  EXPECT_EQ(guard->verdict(0), 0);

  guard->begin_step();  // the testing hook's poison: the loss counts as non-finite
  guard->after_loss(*meter, dlogits, true);
  EXPECT_TRUE(std::isnan(dlogits[0]));
  EXPECT_FALSE(guard->bucket_ok(bad, 3));
  guard->end_step(1);
  EXPECT_EQ(guard->verdict(1), StepGuard::kNonfiniteGradient | StepGuard::kNonfiniteLoss);

  guard->begin_step();  // a gradient that overflowed while every loss was finite
  meter->reset();
  be->softmax_cross_entropy(logits, label, 1, 2, dlogits, 1.0f, *meter);
  guard->after_loss(*meter, dlogits, false);
  EXPECT_TRUE(std::isfinite(dlogits[0]));
  EXPECT_FALSE(guard->bucket_ok(bad, 3));
  EXPECT_TRUE(guard->bucket_ok(good, 3));  // one bad bucket is enough
  guard->end_step(2);
  EXPECT_EQ(guard->verdict(2), StepGuard::kNonfiniteGradient);
  EXPECT_THROW(guard->verdict(1), Error) << "a host guard keeps only the last step's verdict";

  meter->reset();  // a NaN in the meter (this micro-batch or an earlier one of the window)
  guard->begin_step();
  const float nan_logits[2] = {std::nanf(""), 0.0f};
  be->softmax_cross_entropy(nan_logits, label, 1, 2, dlogits, 1.0f, *meter);
  dlogits[0] = 0.0f;
  guard->after_loss(*meter, dlogits, false);
  EXPECT_TRUE(std::isnan(dlogits[0]));
  guard->end_step(3);
  EXPECT_EQ(guard->verdict(3), StepGuard::kNonfiniteLoss);
}

// Note [Host copies]: the CPU backend hands out its buffers themselves; the default (a device's)
// copies through download and upload, and only when asked.
TEST(HostCopy, CpuSharesTheBuffersAndTheDefaultCopiesWhenAsked) {
  auto be = make_cpu_backend(1);
  auto a = be->allocate(4), b = be->allocate(4);
  for (int i = 0; i < 4; ++i) a->data()[i] = static_cast<float>(i + 1);
  auto same = be->make_host_copy({a->data(), b->data()}, 4);
  EXPECT_EQ(same->host(0), a->data());
  EXPECT_EQ(same->host(1), b->data());

  auto copied = be->Backend::make_host_copy({a->data(), b->data()}, 4);  // the default, as on a device
  ASSERT_NE(copied->host(0), a->data());
  EXPECT_EQ(copied->host(0)[3], 0.0f) << "nothing is copied before to_host()";
  copied->to_host();
  EXPECT_EQ(copied->host(0)[3], 4.0f);
  copied->host(1)[2] = 7.0f;
  EXPECT_EQ(b->data()[2], 0.0f) << "nothing is written back before to_backend()";
  copied->to_backend();
  EXPECT_EQ(b->data()[2], 7.0f);
  EXPECT_EQ(a->data()[0], 1.0f);
}

}  // namespace
}  // namespace mnist_mpi
