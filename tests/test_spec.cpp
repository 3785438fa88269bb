// Tests of the model spec parser and the parameter initialisers: per-layer shapes and parameter
// counts of the LeNet-style and tiny specs, the flat layout (reverse layer order, weight before
// bias, contiguous, covering [0, param_count)), usage errors naming the bad token, and each
// initialiser's range, spread and determinism in the seed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi {
namespace {

using ::testing::HasSubstr;

const char* kLenet =
    "conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10";
const char* kTiny = "conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10";

// Note [A layer kind's facts]: every LayerKind has its row in kLayerTraits, in order, and each row's
// facts hold: its example parses to a layer of its kind (so its parse case exists), the kinds with
// a parameter prefix, and only they, get a weight and a bias named with it. (What row_wise and
// keeps_blocked claim is shown where they are used: the row-wise tail by the start-up check of
// --exact-sums and e2e_exact_sums's bits, the blocked layouts by the CPU layer tests.)
// The switch lists every kind with -Wswitch an error here: a kind added to the enum does not
// compile this test until it is listed, and then fails it until it has its row.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
constexpr int kind_index(LayerKind k) {
  switch (k) {
    case LayerKind::kConv: return 0;
    case LayerKind::kMaxPool: return 1;
    case LayerKind::kRelu: return 2;
    case LayerKind::kFlatten: return 3;
    case LayerKind::kFc: return 4;
    case LayerKind::kDropout: return 5;
    case LayerKind::kBatchNorm: return 6;
  }
  return -1;
}
#pragma GCC diagnostic pop

TEST(LayerTraits, EveryKindHasItsRowAndItsFactsHold) {
  const LayerKind every[] = {LayerKind::kConv,    LayerKind::kMaxPool, LayerKind::kRelu,     LayerKind::kFlatten,
                             LayerKind::kFc,      LayerKind::kDropout, LayerKind::kBatchNorm};
  ASSERT_EQ(std::size(every), std::size(kLayerTraits)) << "one row per kind";
  for (const LayerKind k : every) {
    ASSERT_EQ(kind_index(k), static_cast<int>(k));
    const LayerTraits& t = layer_traits(k);
    EXPECT_EQ(t.kind, k);
    SCOPED_TRACE(t.token);
    const ModelSpec spec = parse_model_spec(std::string(t.example) + ",flatten,fc:3", Shape{2, 4, 4}, 3);
    EXPECT_EQ(spec.layers[0].kind, k) << "the example parses to its kind";
    EXPECT_EQ(spec.layers[0].text, t.example);
    const auto named = std::count_if(spec.params.begin(), spec.params.end(),
                                     [](const ParamTensor& p) { return p.layer == 0; });
    if (t.param_prefix) {
      EXPECT_EQ(named, 2) << "a weight and a bias";
      for (const ParamTensor& p : spec.params) {
        if (p.layer == 0) {
          EXPECT_EQ(p.name.rfind(std::string("0") + t.param_prefix + ".", 0), 0u) << p.name;
        }
      }
    } else {
      EXPECT_EQ(named, 0);
    }
  }
  EXPECT_THROW(layer_traits(static_cast<LayerKind>(std::size(kLayerTraits))), std::logic_error);
}

TEST(Spec, LenetShapesAndCount) {
  const ModelSpec s = parse_model_spec(kLenet, {1, 28, 28}, 10);
  ASSERT_EQ(s.layers.size(), 11u);
  const std::vector<Shape> out{{32, 28, 28}, {32, 28, 28}, {32, 14, 14}, {64, 14, 14}, {64, 14, 14}, {64, 7, 7},
                               {3136, 1, 1}, {1024, 1, 1}, {1024, 1, 1}, {1024, 1, 1}, {10, 1, 1}};
  const std::vector<LayerKind> kinds{LayerKind::kConv, LayerKind::kRelu,    LayerKind::kMaxPool, LayerKind::kConv,
                                     LayerKind::kRelu, LayerKind::kMaxPool, LayerKind::kFlatten, LayerKind::kFc,
                                     LayerKind::kRelu, LayerKind::kDropout, LayerKind::kFc};
  Shape in{1, 28, 28};
  for (std::size_t i = 0; i < s.layers.size(); ++i) {
    SCOPED_TRACE(s.layers[i].text);
    EXPECT_EQ(s.layers[i].kind, kinds[i]);
    EXPECT_EQ(s.layers[i].in, in);
    EXPECT_EQ(s.layers[i].out, out[i]);
    in = out[i];
  }
  EXPECT_EQ(s.layers[0].pad_top, 2);
  EXPECT_EQ(s.layers[0].pad_bottom, 2);
  EXPECT_EQ(s.layers[0].kernel_h, 5);
  EXPECT_EQ(s.layers[2].stride, 2);
  EXPECT_FLOAT_EQ(s.layers[9].drop_rate, 0.5f);
  EXPECT_EQ(s.num_classes(), 10);
  // 5*5*1*32+32 + 5*5*32*64+64 + 3136*1024+1024 + 1024*10+10
  EXPECT_EQ(s.param_count, 3274634);
}

TEST(Spec, ParamsInReverseLayerOrderContiguous) {
  const ModelSpec s = parse_model_spec(kLenet, {1, 28, 28}, 10);
  const std::vector<std::string> names{"10.fc.weight",  "10.fc.bias",  "7.fc.weight",   "7.fc.bias",
                                       "3.conv.weight", "3.conv.bias", "0.conv.weight", "0.conv.bias"};
  const std::vector<std::vector<int>> shapes{{10, 1024},     {10}, {1024, 3136},  {1024},
                                             {64, 32, 5, 5}, {64}, {32, 1, 5, 5}, {32}};
  ASSERT_EQ(s.params.size(), names.size());
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    const ParamTensor& p = s.params[i];
    SCOPED_TRACE(p.name);
    EXPECT_EQ(p.name, names[i]);
    EXPECT_EQ(p.shape, shapes[i]);
    EXPECT_EQ(p.is_bias, i % 2 == 1);
    std::int64_t n = 1;
    for (int d : p.shape) n *= d;
    EXPECT_EQ(p.size, n);
    EXPECT_EQ(p.offset, offset);
    offset += p.size;
    if (i > 0) {
      EXPECT_LE(p.layer, s.params[i - 1].layer);
    }
  }
  EXPECT_EQ(offset, s.param_count);
  EXPECT_EQ(s.params[0].layer, 10);
  EXPECT_EQ(s.params.back().layer, 0);
  EXPECT_EQ(s.params[4].fan_in, 32 * 25);
  EXPECT_EQ(s.params[4].fan_out, 64 * 25);
  EXPECT_EQ(s.params[2].fan_in, 3136);
  EXPECT_EQ(s.params[2].fan_out, 1024);
}

TEST(Spec, TinyCount) {
  const ModelSpec s = parse_model_spec(kTiny, {1, 28, 28}, 10);
  EXPECT_EQ(s.param_count, 9098);  // 80 + 1168 + 7850
  EXPECT_EQ(s.layers[4].out, (Shape{784, 1, 1}));
}

TEST(Spec, OptionalFieldsAndWhitespace) {
  const ModelSpec s = parse_model_spec(" conv:3:4:valid:s2 , maxpool:2:1 , fc:10 ", {1, 9, 9}, 10);
  EXPECT_EQ(s.layers[0].kernel_h, 3);
  EXPECT_EQ(s.layers[0].kernel_w, 3);
  EXPECT_FALSE(s.layers[0].same);
  EXPECT_EQ(s.layers[0].stride, 2);
  EXPECT_EQ(s.layers[0].out, (Shape{4, 4, 4}));
  EXPECT_EQ(s.layers[1].out, (Shape{4, 3, 3}));
}

void expect_usage(const std::string& spec, const std::string& needle, int classes = 10) {
  SCOPED_TRACE(spec);
  try {
    parse_model_spec(spec, {1, 28, 28}, classes);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_THAT(e.what(), HasSubstr(needle));
  }
}

TEST(Spec, BadSpecsThrowUsageNamingTheToken) {
  expect_usage("conv:5x5:32,pool:2,flatten,fc:10", "'pool:2'");  // unknown kind
  expect_usage("conv:5x5:32,pool:2,flatten,fc:10", "unknown layer kind");
  expect_usage("conv:5x5,flatten,fc:10", "'conv:5x5'");  // conv without channels
  expect_usage("conv:5x5:0,flatten,fc:10", "'conv:5x5:0'");
  expect_usage("conv:5x5:8:samee,flatten,fc:10", "samee");
  expect_usage("conv:axb:8,flatten,fc:10", "'conv:axb:8'");
  expect_usage("flatten,dropout:1.5,fc:10", "'dropout:1.5'");
  expect_usage("flatten,dropout:abc,fc:10", "dropout:abc");
  expect_usage("flatten,fc:0,fc:10", "'fc:0'");
  expect_usage("flatten,fc:-3,fc:10", "'fc:-3'");
  expect_usage("flatten,fc:12", "ends with 12 outputs");  // wrong class count
  expect_usage("flatten,fc:12", "fc:10");
  expect_usage("conv:3x3:8,,flatten,fc:10", "empty layer");
  expect_usage("", "empty layer");
  expect_usage("maxpool:29,flatten,fc:10", "'maxpool:29'");  // window larger than the input
  expect_usage("conv:29x29:4:valid,flatten,fc:10", "'conv:29x29:4:valid'");
  expect_usage("relu:2,flatten,fc:10", "'relu:2'");
}

// The message of the usage error parse_model_spec throws for spec (on a 28x28 input).
std::string usage_error(const std::string& spec) {
  try {
    parse_model_spec(spec, {1, 28, 28}, 10);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    return e.what();
  }
  ADD_FAILURE() << "no throw for " << spec.substr(0, 200);
  return "";
}

// Hostile input: sizes from the spec that do not fit 32 bits. conv:1:3000000 outputs 2.35e9
// values per image; they were cast to int by flatten and the fc fan-in and init_params segfaulted.
// Every size is computed in 64 bits, and what the kernels cannot take is refused naming the layer.
TEST(Spec, SizesThatOverflow32BitsAreRefusedNamingTheLayer) {
  EXPECT_EQ(usage_error("conv:1:3000000,flatten,fc:10"),
            "model spec: layer 0 'conv:1:3000000' outputs 3000000x28x28 = 2352000000 values per image, more than "
            "the 2147483647 a tensor can hold; use fewer channels or units, or pool before it");
  // A fan-in of 50000 * 50000 = 2.5e9 inputs per output.
  EXPECT_THAT(usage_error("conv:50000x50000:1,flatten,fc:10"),
              HasSubstr("layer 0 'conv:50000x50000:1': each of its 1 outputs sums 2500000000 inputs"));
  // A count above INT32_MAX is "too large", not "not an integer".
  EXPECT_THAT(usage_error("flatten,fc:3000000000,fc:10"), HasSubstr("'3000000000' is too large (at most 2147483647)"));
  // Four layers of 2^62 weights: each fits int64, their sum does not.
  EXPECT_THAT(usage_error("flatten,fc:2147483647,fc:2147483647,fc:2147483647,fc:2147483647,fc:10"),
              HasSubstr("the model has more parameters than 64 bits can count"));
  // A stride near INT32_MAX overflowed (in + stride - 1) in int; in 64 bits it is one output pixel.
  const ModelSpec s = parse_model_spec("conv:3x3:2:s2147483647,flatten,fc:10", {1, 28, 28}, 10);
  EXPECT_EQ(s.layers[0].out, (Shape{2, 1, 1}));
  EXPECT_EQ(s.layers[0].pad_top + s.layers[0].pad_bottom, 0);
  EXPECT_EQ(s.param_count, 2 * 9 + 2 + 10 * 2 + 10);
  // The largest that the kernels take is still accepted: 2^31 - 1 values per image after flatten.
  const ModelSpec edge = parse_model_spec("flatten,fc:2147483647,fc:10", {1, 28, 28}, 10);
  EXPECT_EQ(edge.params.front().fan_in, 2147483647);
  EXPECT_EQ(edge.param_count, 10LL * 2147483647 + 10 + 784LL * 2147483647 + 2147483647);
}

// Hostile input: the spec text and the token were echoed whole (a 10 MB --model gave a 10 MB
// message) and raw. They are quoted, cut to ~80 characters and escaped.
TEST(Spec, HugeOrBinarySpecTextGivesAShortEscapedMessage) {
  const std::string huge(1 << 20, 'q');  // 1 MB: 10 MB took 106 s under AddressSanitizer
  std::string relus = "flatten,fc:12";   // ends with 12 outputs: the whole text is echoed
  while (relus.size() < huge.size()) relus += ",relu";
  for (const std::string& spec : {"conv:3x3:8," + huge + ",fc:10", "fc:" + huge, huge + ",,fc:10", relus}) {
    const std::string msg = usage_error(spec);
    EXPECT_LT(msg.size(), 400u) << msg.substr(0, 500);  // two quotes of <= 80 and 40 characters, and words
  }
  const std::string msg = usage_error("conv:3x3:8,\x1b[2Jbogus\x01,flatten,fc:10");
  EXPECT_THAT(msg, HasSubstr("bad layer '\\x1b[2Jbogus\\x01'"));
  for (const char c : msg) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << msg;
}

// Note [Will the model fit?]: the estimate adds up the buffers a rank allocates.
TEST(Spec, MemoryEstimateCountsStateAndActivations) {
  const ModelSpec s = parse_model_spec("flatten,fc:10", {1, 2, 2}, 10);  // 4 * 10 + 10 = 50 parameters
  MemoryEstimate e = estimate_model_memory(s, 3, 5, OptimizerKind::kAdam, /*evaluates=*/true);
  EXPECT_FALSE(e.overflow);
  EXPECT_EQ(e.state_bytes, 50 * 4 * 4);                                   // params, grads, two moments
  EXPECT_EQ(e.activation_bytes, (3 + 5) * 4 * 4 + (2 * 3 + 5) * 10 * 4);  // input; fc output and its gradient
  EXPECT_EQ(e.total_bytes, 800 + 128 + 440);
  EXPECT_EQ(e.largest_layer, 1);
  EXPECT_EQ(e.largest_layer_bytes, 800 + 440);
  e = estimate_model_memory(s, 3, 5, OptimizerKind::kSgd, /*evaluates=*/false);
  EXPECT_EQ(e.total_bytes, 50 * 3 * 4 + 3 * 4 * 4 + 2 * 3 * 10 * 4);
  e = estimate_model_memory(s, std::int64_t{1} << 62, 5, OptimizerKind::kAdam, true);
  EXPECT_TRUE(e.overflow);
}

// A model or batch that cannot fit in this machine's memory is refused before anything is allocated,
// naming the total and the largest layer; lenet for a normal batch fits.
TEST(Spec, AModelLargerThanMemoryIsRefusedNamingTheLargestLayer) {
  EXPECT_GT(physical_memory_bytes(), 0);
  check_model_fits_memory(parse_model_spec(kLenet, {1, 28, 28}, 10), 100, 250, OptimizerKind::kAdam, true);  // no throw
  // 1.6e12 parameters: 25 TB with gradients and adam's moments.
  const ModelSpec huge = parse_model_spec("flatten,fc:2000000000,fc:10", {1, 28, 28}, 10);
  try {
    check_model_fits_memory(huge, 32, 250, OptimizerKind::kAdam, true);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    const std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr(" TiB of memory on this rank (1590000000010 parameters with their gradients and adam"));
    EXPECT_THAT(msg, HasSubstr("more than this machine's"));
    EXPECT_THAT(msg, HasSubstr("the largest layer is 1 'fc:2000000000' (about 25.1 TiB)"));
    EXPECT_THAT(msg, HasSubstr("use a smaller --model or --batch-size"));
  }
  // A batch whose activations overflow int64.
  try {
    check_model_fits_memory(parse_model_spec(kTiny, {1, 28, 28}, 10), std::int64_t{1} << 60, 250, OptimizerKind::kSgd, false);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("needs more than 8 EiB"));
    EXPECT_THAT(e.what(), HasSubstr("a batch of 1152921504606846976"));
  }
}

// ---- initialisers ----

struct Moments {
  double mean = 0, sd = 0, max_abs = 0;
};
Moments moments(const float* v, std::int64_t n) {
  double s = 0, s2 = 0, m = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    s += v[i];
    s2 += static_cast<double>(v[i]) * v[i];
    m = std::max(m, std::abs(static_cast<double>(v[i])));
  }
  const double mean = s / static_cast<double>(n);
  return {mean, std::sqrt(s2 / static_cast<double>(n) - mean * mean), m};
}

std::vector<float> init(const ModelSpec& s, const std::string& w, const std::string& b, std::uint64_t seed) {
  std::vector<float> p(static_cast<std::size_t>(s.param_count), -123.0f);
  init_params(s, parse_init_spec(w), parse_init_spec(b), seed, p.data());
  return p;
}

TEST(Init, TruncatedNormalWithinTwoSdAndSpreadRight) {
  const ModelSpec s = parse_model_spec(kLenet, {1, 28, 28}, 10);
  const std::vector<float> p = init(s, "truncated_normal:0.1", "constant:0.1", 1);
  for (const ParamTensor& t : s.params) {
    SCOPED_TRACE(t.name);
    const Moments m = moments(p.data() + t.offset, t.size);
    if (t.is_bias) {
      EXPECT_EQ(m.max_abs, 0.1f);
      EXPECT_NEAR(m.mean, 0.1, 1e-7);
      continue;
    }
    EXPECT_LE(m.max_abs, 0.2f + 1e-7);
    if (t.size > 100000) {
      // A normal cut at 2 sd has sd 0.8796 of the untruncated one.
      EXPECT_NEAR(m.sd, 0.08796, 0.001);
      EXPECT_NEAR(m.mean, 0.0, 0.001);
      EXPECT_GT(m.max_abs, 0.199);  // the tails are really used
    }
  }
}

TEST(Init, NormalXavierHeZerosConstant) {
  const ModelSpec s = parse_model_spec(kLenet, {1, 28, 28}, 10);
  const ParamTensor& big = s.params[2];  // 7.fc.weight (1024, 3136)
  ASSERT_EQ(big.name, "7.fc.weight");

  std::vector<float> p = init(s, "normal:0.05", "zeros", 2);
  Moments m = moments(p.data() + big.offset, big.size);
  EXPECT_NEAR(m.sd, 0.05, 0.0005);
  EXPECT_GT(m.max_abs, 0.1);  // untruncated: beyond 2 sd happens
  for (const ParamTensor& t : s.params)
    if (t.is_bias) {
      EXPECT_TRUE(std::all_of(p.begin() + t.offset, p.begin() + t.offset + t.size, [](float v) { return v == 0.0f; }));
    }

  p = init(s, "xavier", "constant:0.5", 3);
  for (const ParamTensor& t : s.params) {
    SCOPED_TRACE(t.name);
    m = moments(p.data() + t.offset, t.size);
    if (t.is_bias) {
      EXPECT_TRUE(std::all_of(p.begin() + t.offset, p.begin() + t.offset + t.size, [](float v) { return v == 0.5f; }));
      continue;
    }
    const double limit = std::sqrt(6.0 / (t.fan_in + t.fan_out));
    EXPECT_LE(m.max_abs, limit);
    EXPECT_GT(m.max_abs, 0.9 * limit);
    if (t.size > 10000) {
      EXPECT_NEAR(m.sd, limit / std::sqrt(3.0), 0.01 * limit);  // uniform's sd
    }
  }

  p = init(s, "he", "zeros", 4);
  m = moments(p.data() + big.offset, big.size);
  EXPECT_NEAR(m.sd, std::sqrt(2.0 / 3136), 0.01 * std::sqrt(2.0 / 3136));
  EXPECT_NEAR(m.mean, 0.0, 0.001);
  const ParamTensor& conv1 = s.params[6];  // fan_in 25
  ASSERT_EQ(conv1.name, "0.conv.weight");
  EXPECT_NEAR(moments(p.data() + conv1.offset, conv1.size).sd, std::sqrt(2.0 / 25), 0.1 * std::sqrt(2.0 / 25));
  // Nothing left unwritten.
  EXPECT_EQ(std::count(p.begin(), p.end(), -123.0f), 0);
}

TEST(Init, DeterministicInTheSeed) {
  const ModelSpec s = parse_model_spec(kTiny, {1, 28, 28}, 10);
  for (const char* w : {"truncated_normal:0.1", "normal:0.1", "xavier", "he"}) {
    SCOPED_TRACE(w);
    const std::vector<float> a = init(s, w, "zeros", 7), b = init(s, w, "zeros", 7), c = init(s, w, "zeros", 8);
    EXPECT_EQ(a, b);
    EXPECT_NE(a, c);
    // Different tensors are not copies of each other.
    EXPECT_FALSE(std::equal(a.begin() + s.params[0].offset, a.begin() + s.params[0].offset + 10,
                            a.begin() + s.params[2].offset));
  }
}

TEST(Init, ParseSpecs) {
  EXPECT_EQ(parse_init_spec("truncated_normal").kind, InitSpec::Kind::kTruncatedNormal);
  EXPECT_FLOAT_EQ(parse_init_spec("truncated_normal").value, 0.1f);
  EXPECT_FLOAT_EQ(parse_init_spec("truncated_normal:0.02").value, 0.02f);
  EXPECT_EQ(parse_init_spec("glorot").kind, InitSpec::Kind::kXavierUniform);
  EXPECT_EQ(parse_init_spec("he").kind, InitSpec::Kind::kHeNormal);
  EXPECT_EQ(parse_init_spec("zeros").kind, InitSpec::Kind::kConstant);
  EXPECT_FLOAT_EQ(parse_init_spec("constant:-0.25").value, -0.25f);
  for (const char* bad : {"uniform", "truncated_normal:-1", "normal:0", "truncated_normal:abc", "constant:1:2",
                          "constant:", "he:x", "zeros:5", ""}) {
    SCOPED_TRACE(bad);
    try {
      parse_init_spec(bad);
      ADD_FAILURE() << "no throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_THAT(e.what(), HasSubstr("'" + std::string(bad) + "'"));
    }
  }
}

}  // namespace
}  // namespace mnist_mpi
