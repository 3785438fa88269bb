// Batch norm: the spec token and its tensors (parameters and model state), the CPU kernel against a
// double reference and finite differences, its running statistics and inference, the checkpoint's
// SIDX / STAT sections, and the option pairs it refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/checkpoint/checkpoint.hpp"
#include "mnist_mpi/config/combinations.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "test_util.hpp"

namespace mnist_mpi {
namespace {

constexpr const char* kSpec = "conv:3x3:4:same,batchnorm,relu,flatten,fc:6,batchnorm:0.2:0.001,fc:10";

ModelSpec bn_spec() { return parse_model_spec(kSpec, Shape{1, 5, 5}, 10); }

TEST(BatchNormSpec, ScaleAndShiftAreParametersAndTheRunningStatisticsState) {
  const ModelSpec spec = bn_spec();
  const LayerSpec& bn1 = spec.layers[1];
  EXPECT_EQ(bn1.kind, LayerKind::kBatchNorm);
  EXPECT_EQ(bn1.channels, 4);
  EXPECT_FLOAT_EQ(bn1.momentum, 0.1f);
  EXPECT_FLOAT_EQ(bn1.eps, 1e-5f);
  EXPECT_EQ(bn1.out, bn1.in);
  EXPECT_FLOAT_EQ(spec.layers[5].momentum, 0.2f);
  EXPECT_FLOAT_EQ(spec.layers[5].eps, 1e-3f);
  // Parameters in reverse layer order: 6.fc, 5.bn (6 + 6), 4.fc, 1.bn (4 + 4), 0.conv.
  std::vector<std::string> names;
  for (const ParamTensor& p : spec.params) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"6.fc.weight", "6.fc.bias", "5.bn.weight", "5.bn.bias", "4.fc.weight",
                                             "4.fc.bias", "1.bn.weight", "1.bn.bias", "0.conv.weight", "0.conv.bias"}));
  EXPECT_TRUE(spec.params[2].is_scale);
  EXPECT_EQ(spec.params[2].size, 6);
  EXPECT_TRUE(spec.params[3].is_bias);
  // The state: the same order, mean then variance.
  ASSERT_EQ(spec.state.size(), 4u);
  EXPECT_EQ(spec.state[0].name, "5.bn.running_mean");
  EXPECT_EQ(spec.state[1].name, "5.bn.running_var");
  EXPECT_EQ(spec.state[2].name, "1.bn.running_mean");
  EXPECT_EQ(spec.state[3].offset, 6 + 6 + 4);
  EXPECT_EQ(spec.state_count, 2 * 6 + 2 * 4);
  // A model without batch norm has no state.
  EXPECT_EQ(parse_model_spec("flatten,fc:10", Shape{1, 5, 5}, 10).state_count, 0);
}

TEST(BatchNormSpec, BadTokensAreRefusedNamingThem) {
  for (const char* bad : {"batchnorm:0", "batchnorm:1.5", "batchnorm:-0.1", "batchnorm:x", "batchnorm:0.1:0",
                          "batchnorm:0.1:-1", "batchnorm:0.1:1e-5:3"}) {
    const std::string text = std::string("conv:3x3:4,") + bad + ",flatten,fc:10";
    try {
      parse_model_spec(text, Shape{1, 5, 5}, 10);
      ADD_FAILURE() << text << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage) << text;
      EXPECT_NE(std::string(e.what()).find("batchnorm"), std::string::npos) << e.what();
    }
  }
}

TEST(BatchNormSpec, ScaleStartsAtOneAndShiftAtZeroWhateverTheInitialisers) {
  const ModelSpec spec = bn_spec();
  std::vector<float> params(static_cast<std::size_t>(spec.param_count)), state(static_cast<std::size_t>(spec.state_count));
  init_params(spec, parse_init_spec("normal:0.5"), parse_init_spec("constant:0.3"), 7, params.data());
  init_state(spec, state.data());
  for (const ParamTensor& p : spec.params) {
    if (spec.layers[static_cast<std::size_t>(p.layer)].kind != LayerKind::kBatchNorm) continue;
    for (std::int64_t i = 0; i < p.size; ++i) EXPECT_EQ(params[static_cast<std::size_t>(p.offset + i)], p.is_scale ? 1.0f : 0.0f) << p.name;
  }
  for (const StateTensor& s : spec.state)
    for (std::int64_t i = 0; i < s.size; ++i) EXPECT_EQ(state[static_cast<std::size_t>(s.offset + i)], s.initial) << s.name;
  EXPECT_EQ(spec.state[0].initial, 0.0f);
  EXPECT_EQ(spec.state[1].initial, 1.0f);
}

// One batch norm layer on the CPU with its own buffers.
struct BnRig {
  LayerSpec l;
  int n;
  std::vector<float> x, y, dy, dx, w, dw, state;
  std::unique_ptr<LayerKernel> k;
  BnRig(Backend& be, Shape in, int batch, std::uint64_t seed, bool training = true, Layout layout = Layout::kPlain)
      : l(parse_model_spec("batchnorm:0.25", in, static_cast<int>(in.size())).layers[0]), n(batch) {
    const std::size_t size = static_cast<std::size_t>(batch * in.size());
    x = uniform(size, seed, -2.0f, 3.0f);
    y.assign(size, 0.0f);
    dy = uniform(size, seed + 1);
    dx.assign(size, 0.0f);
    w = uniform(2 * static_cast<std::size_t>(in.c), seed + 2, 0.5f, 1.5f);
    dw.assign(w.size(), 0.0f);
    state = uniform(2 * static_cast<std::size_t>(in.c), seed + 3, 0.2f, 0.8f);  // means, then variances > 0
    LayerBuffers b;
    b.batch = batch;
    b.x = x.data();
    b.y = y.data();
    b.w = w.data();
    b.state = state.data();
    b.x_layout = b.y_layout = layout;
    if (training) {
      b.dy = dy.data();
      b.dx = dx.data();
      b.dw = dw.data();
    }
    k = be.make_layer(l, 0, b, training);
  }
  double loss() const {  // L = sum(y * dy)
    double s = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) s += static_cast<double>(y[i]) * dy[i];
    return s;
  }
};

// Channel c's values of an (N, C, plane) buffer.
std::vector<double> channel(const std::vector<float>& v, int batch, int channels, int plane, int c) {
  std::vector<double> out;
  for (int i = 0; i < batch; ++i)
    for (int p = 0; p < plane; ++p) out.push_back(v[(static_cast<std::size_t>(i) * channels + c) * plane + p]);
  return out;
}

void check_training_forward(Shape in, int batch) {
  SCOPED_TRACE("input " + std::to_string(in.c) + "x" + std::to_string(in.h) + "x" + std::to_string(in.w));
  auto be = make_cpu_backend(1);
  BnRig r(*be, in, batch, 11);
  const std::vector<float> before = r.state;
  StepContext ctx;
  r.k->forward(ctx);
  const int plane = in.h * in.w;
  for (int c = 0; c < in.c; ++c) {
    const std::vector<double> xs = channel(r.x, batch, in.c, plane, c), ys = channel(r.y, batch, in.c, plane, c);
    const double m = static_cast<double>(xs.size());
    double mean = 0.0, var = 0.0;
    for (double v : xs) mean += v / m;
    for (double v : xs) var += (v - mean) * (v - mean) / m;
    const double a = r.w[static_cast<std::size_t>(c)] / std::sqrt(var + 1e-5), b = r.w[static_cast<std::size_t>(in.c + c)];
    for (std::size_t i = 0; i < xs.size(); ++i) EXPECT_NEAR(ys[i], (xs[i] - mean) * a + b, 2e-5 * (1 + std::abs(ys[i])));
    // The running statistics moved a quarter of the way (momentum 0.25), the variance unbiased.
    EXPECT_NEAR(r.state[static_cast<std::size_t>(c)], 0.75 * before[static_cast<std::size_t>(c)] + 0.25 * mean, 1e-6);
    EXPECT_NEAR(r.state[static_cast<std::size_t>(in.c + c)],
                0.75 * before[static_cast<std::size_t>(in.c + c)] + 0.25 * var * m / (m - 1), 1e-5);
  }
}

TEST(BatchNormKernel, TrainingForwardNormalisesWithTheBatchAndMovesTheRunningStatistics) {
  check_training_forward(Shape{3, 4, 5}, 4);  // after a conv: statistics over (N, H, W)
  check_training_forward(Shape{7, 1, 1}, 5);  // after an fc: over N
}

TEST(BatchNormKernel, GradientsMatchFiniteDifferences) {
  auto be = make_cpu_backend(1);
  BnRig r(*be, Shape{2, 3, 3}, 3, 21);
  StepContext ctx;
  r.k->forward(ctx);
  std::fill(r.dw.begin(), r.dw.end(), 7.0f);  // overwritten, not accumulated
  r.k->backward(ctx);
  const std::vector<float> dx = r.dx, dw = r.dw;
  const auto fd = [&](std::vector<float>& var, const std::vector<float>& analytic, const char* what) {
    const float h = 1e-2f;
    for (std::size_t i = 0; i < var.size(); ++i) {
      const float v = var[i];
      var[i] = v + h;
      r.k->forward(ctx);
      const double lp = r.loss();
      var[i] = v - h;
      r.k->forward(ctx);
      const double lm = r.loss();
      var[i] = v;
      const double numeric = (lp - lm) / (2.0 * h);
      EXPECT_NEAR(analytic[i], numeric, 2e-3 + 5e-3 * std::abs(numeric)) << what << " element " << i;
    }
  };
  fd(r.x, dx, "dx");
  fd(r.w, dw, "d scale and d shift");
  // d shift is the sum of dy over the channel; a sum of dx over a channel is zero.
  for (int c = 0; c < 2; ++c) {
    double s = 0.0, sdx = 0.0;
    for (double v : channel(r.dy, 3, 2, 9, c)) s += v;
    for (double v : channel(dx, 3, 2, 9, c)) sdx += v;
    EXPECT_NEAR(dw[static_cast<std::size_t>(2 + c)], s, 1e-5);
    EXPECT_NEAR(sdx, 0.0, 1e-4);
  }
}

TEST(BatchNormKernel, InferenceUsesTheRunningStatisticsAndLeavesThem) {
  auto be = make_cpu_backend(1);
  for (bool training_model : {false, true}) {
    BnRig r(*be, Shape{3, 2, 2}, 2, 31, training_model);
    const std::vector<float> before = r.state;
    StepContext ctx;
    ctx.training = false;
    r.k->forward(ctx);
    EXPECT_EQ(r.state, before);
    for (int c = 0; c < 3; ++c) {
      const double mean = before[static_cast<std::size_t>(c)], var = before[static_cast<std::size_t>(3 + c)];
      const std::vector<double> xs = channel(r.x, 2, 3, 4, c), ys = channel(r.y, 2, 3, 4, c);
      for (std::size_t i = 0; i < xs.size(); ++i)
        EXPECT_NEAR(ys[i], (xs[i] - mean) / std::sqrt(var + 1e-5) * r.w[static_cast<std::size_t>(c)] +
                               r.w[static_cast<std::size_t>(3 + c)],
                    1e-5 * (1 + std::abs(ys[i])));
    }
  }
}

// (n, c, p) of a plain buffer in nChwBc (block b).
std::size_t blocked_at(int n, int c, int p, int channels, int plane, int b) {
  return ((static_cast<std::size_t>(n) * (channels / b) + c / b) * plane + p) * b + c % b;
}

// Between convolutions the backend keeps a batch norm's activations blocked (nChw8c, nChw16c): the
// same values as plain, bit for bit, forward, backward and the running statistics.
TEST(BatchNormKernel, BlockedLayoutsGiveThePlainBits) {
  auto be = make_cpu_backend(1);
  const Shape in{16, 3, 5};
  const int batch = 3, plane = in.h * in.w;
  for (Layout layout : {Layout::kBlocked8, Layout::kBlocked16}) {
    const int b = layout == Layout::kBlocked8 ? 8 : 16;
    BnRig plain(*be, in, batch, 41), blocked(*be, in, batch, 41, true, layout);
    const auto to_blocked = [&](const std::vector<float>& v, std::vector<float>& out) {
      for (int n = 0; n < batch; ++n)
        for (int c = 0; c < in.c; ++c)
          for (int p = 0; p < plane; ++p)
            out[blocked_at(n, c, p, in.c, plane, b)] = v[(static_cast<std::size_t>(n) * in.c + c) * plane + p];
    };
    to_blocked(plain.x, blocked.x);
    to_blocked(plain.dy, blocked.dy);
    StepContext ctx;
    plain.k->forward(ctx);
    blocked.k->forward(ctx);
    plain.k->backward(ctx);
    blocked.k->backward(ctx);
    std::vector<float> y(plain.y.size()), dx(plain.dx.size());
    to_blocked(plain.y, y);
    to_blocked(plain.dx, dx);
    EXPECT_EQ(blocked.y, y) << "block " << b;
    EXPECT_EQ(blocked.dx, dx) << "block " << b;
    EXPECT_EQ(blocked.dw, plain.dw) << "block " << b;
    EXPECT_EQ(blocked.state, plain.state) << "block " << b;
  }
}

// The backend keeps conv, batch norm, ReLU and pool blocked together (so the convolutions keep
// oneDNN's direct kernels), and a batch norm after an fc plain.
TEST(BatchNormKernel, TheBackendKeepsItsActivationsBlockedBetweenConvolutions) {
  auto be = make_cpu_backend(1);
  const ModelSpec spec =
      parse_model_spec("conv:3x3:16:same,batchnorm,relu,maxpool:2,conv:3x3:32:same,batchnorm,relu,maxpool:2,flatten,"
                       "fc:24,batchnorm,fc:10",
                       Shape{1, 12, 12}, 10);
  const std::vector<Layout> l = be->activation_layouts(spec);
  for (std::size_t i : {1u, 2u, 3u, 5u, 6u, 7u}) EXPECT_NE(l[i], Layout::kPlain) << "activation " << i;
  EXPECT_EQ(l[2], l[1]);  // a batch norm's input and output agree
  EXPECT_EQ(l[10], Layout::kPlain);
  EXPECT_EQ(l[11], Layout::kPlain);
}

// A model binds each batch norm to its own range of the state: after one training forward from
// the initial state, layer i's running mean is momentum x the mean of its own input, channel by
// channel (kSpec: 4 channels after a conv, 6 units after an fc, plain activations).
TEST(BatchNormModel, EachLayerMovesItsOwnRunningStatistics) {
  auto be = make_cpu_backend(1);
  const ModelSpec spec = bn_spec();
  std::vector<float> params(static_cast<std::size_t>(spec.param_count)), state(static_cast<std::size_t>(spec.state_count));
  std::vector<float> grads(params.size());
  init_params(spec, parse_init_spec("normal:0.3"), parse_init_spec("constant:0.1"), 5, params.data());
  init_state(spec, state.data());
  const int batch = 3;
  Model m(spec, batch, *be, params.data(), grads.data(), state.data());
  const std::vector<float> x = uniform(static_cast<std::size_t>(batch * spec.input.size()), 9);
  std::copy(x.begin(), x.end(), m.input());
  m.forward(StepContext{});
  for (const StateTensor& t : spec.state) {
    if (t.initial != 0.0f) continue;  // the means
    const LayerSpec& l = spec.layers[static_cast<std::size_t>(t.layer)];
    const int plane = l.in.h * l.in.w;
    const std::vector<float> in(m.activation(t.layer), m.activation(t.layer) + batch * l.in.size());
    for (int c = 0; c < l.in.c; ++c) {
      double mean = 0.0;
      for (double v : channel(in, batch, l.in.c, plane, c)) mean += v / (batch * plane);
      EXPECT_NEAR(state[static_cast<std::size_t>(t.offset + c)], l.momentum * mean, 1e-6) << t.name << " channel " << c;
    }
    EXPECT_NE(state[static_cast<std::size_t>(t.offset)], 0.0f) << t.name << " never moved";
  }
}

TEST(BatchNormModel, AModelWithBatchNormNeedsItsState) {
  auto be = make_cpu_backend(1);
  const ModelSpec spec = bn_spec();
  std::vector<float> params(static_cast<std::size_t>(spec.param_count)), state(static_cast<std::size_t>(spec.state_count));
  EXPECT_THROW(Model(spec, 2, *be, params.data(), nullptr, nullptr), Error);
  Model m(spec, 2, *be, params.data(), nullptr, state.data());
  EXPECT_EQ(m.state(), state.data());
  // On a parameter store the state is the store's; a store without it, or of other sizes, is refused.
  ParameterStore store(*be, spec.param_count, spec.state_count);
  ASSERT_NE(store.state(), nullptr);
  Model on_store(spec, 2, *be, store, nullptr);
  EXPECT_EQ(on_store.state(), store.state());
  ParameterStore without(*be, spec.param_count);
  EXPECT_THROW(Model(spec, 2, *be, without, nullptr), Error);
  ParameterStore other(*be, spec.param_count + 1, spec.state_count);
  EXPECT_THROW(Model(spec, 2, *be, other, nullptr), Error);
}

// The META of a file at step 0 whose counters agree (decode_checkpoint checks them).
CheckpointMeta meta_of(const ModelSpec& spec, OptimizerKind optimizer) {
  CheckpointMeta meta;
  meta.steps_per_epoch = 1;
  meta.global_batch = 2;
  meta.train_count = 2;
  meta.param_count = spec.param_count;
  meta.optimizer_kind = traits(optimizer).checkpoint_code;
  return meta;
}

Checkpoint bn_checkpoint(const ModelSpec& spec, const std::vector<float>& state) {
  std::vector<float> params(static_cast<std::size_t>(spec.param_count), 0.5f), m(params.size(), 0.25f), v(params.size(), 0.125f);
  CheckpointEncoder enc(spec, "model = x\n", true);
  enc.capture(meta_of(spec, OptimizerKind::kAdam), params.data(), m.data(), v.data(), {}, state.data());
  enc.seal();
  return decode_checkpoint(enc.bytes(), "bn.ckpt");
}

TEST(BatchNormCheckpoint, TheRunningStatisticsRoundTripInSidxAndStat) {
  const ModelSpec spec = bn_spec();
  std::vector<float> state(static_cast<std::size_t>(spec.state_count));
  for (std::size_t i = 0; i < state.size(); ++i) state[i] = 0.1f * static_cast<float>(i) - 0.7f;
  Checkpoint ck = bn_checkpoint(spec, state);
  ck.spec = kSpec;
  ck.input = Shape{1, 5, 5};
  ck.num_classes = 10;
  EXPECT_EQ(ck.model_state, state);
  EXPECT_EQ(ck.state_tensors, checkpoint_state_tensors(spec));
  EXPECT_EQ(ck.state_tensors[1].name, "5.bn.running_var");
  EXPECT_NO_THROW(checkpoint_model_spec(ck));
  // A file whose state does not fit its own spec is refused (exit 4), not read past.
  Checkpoint short_state = ck;
  short_state.model_state.pop_back();
  EXPECT_THROW(checkpoint_model_spec(short_state), Error);
  Checkpoint no_state = ck;
  no_state.state_tensors.clear();
  no_state.model_state.clear();
  EXPECT_THROW(checkpoint_model_spec(no_state), Error);
  // A model without batch norm writes neither section, and capture refuses a state it cannot hold.
  const ModelSpec plain = parse_model_spec("flatten,fc:10", Shape{1, 5, 5}, 10);
  CheckpointEncoder enc(plain, "", true);
  std::vector<float> p(static_cast<std::size_t>(plain.param_count));
  EXPECT_THROW(enc.capture(CheckpointMeta{}, p.data(), p.data(), p.data(), {}, state.data()), Error);
  const std::string bytes(reinterpret_cast<const char*>(enc.bytes().data()), enc.bytes().size());
  EXPECT_EQ(bytes.find("SIDX"), std::string::npos);
  EXPECT_EQ(bytes.find("STAT"), std::string::npos);
}

TEST(BatchNormCheckpoint, EveryFlippedByteOfTheNewSectionsIsDetected) {
  const ModelSpec spec = bn_spec();
  std::vector<float> state(static_cast<std::size_t>(spec.state_count), 0.5f), params(static_cast<std::size_t>(spec.param_count));
  CheckpointEncoder enc(spec, "", false);
  enc.capture(meta_of(spec, OptimizerKind::kSgd), params.data(), params.data(), nullptr, {}, state.data());
  enc.seal();
  std::vector<std::uint8_t> b(enc.bytes().begin(), enc.bytes().end());
  ASSERT_NO_THROW(decode_checkpoint(b, "x"));
  const std::string s(b.begin(), b.end());
  const std::size_t from = s.find("SIDX");
  ASSERT_NE(from, std::string::npos);
  for (std::size_t i = from; i < s.find("END "); ++i) {
    b[i] ^= 0x10;
    EXPECT_THROW(decode_checkpoint(b, "x"), Error) << "byte " << i;
    b[i] ^= 0x10;
  }
}

TEST(BatchNormOptions, ExactSumsAndUnevenMicroBatchesAreRefused) {
  Options o;
  o.model = "conv:5x5:8:same, batchnorm ,relu,flatten,fc:10";
  o.exact_sums = true;
  EXPECT_THROW(check_combinations(o), Error);
  o.exact_sums = false;
  EXPECT_NO_THROW(check_combinations(o));
  RunPlace three{false, false, "host", 3};
  EXPECT_THROW(check_combinations(o, &three), Error);  // 100 images on 3 ranks
  RunPlace two{false, false, "host", 2};
  EXPECT_NO_THROW(check_combinations(o, &two));
  o.accumulation_steps = 3;
  EXPECT_THROW(check_combinations(o, &two), Error);  // 100 on 2 x 3 micro-batches
  o.global_batch_size = 120;
  EXPECT_NO_THROW(check_combinations(o, &two));
  o.global_batch_size = 0;
  o.batch_size = 7;  // per rank: every micro-batch is whole
  EXPECT_NO_THROW(check_combinations(o, &three));
  o.model = "conv:5x5:8:same,relu,flatten,fc:10";  // no batch norm: uneven slices are fine
  o.batch_size = 0;
  EXPECT_NO_THROW(check_combinations(o, &three));
}

}  // namespace
}  // namespace mnist_mpi
