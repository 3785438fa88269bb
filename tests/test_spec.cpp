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

const char* kLenet = "conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10";
const char* kTiny = "conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10";

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
  const std::vector<std::string> names{"10.fc.weight", "10.fc.bias",   "7.fc.weight",  "7.fc.bias",
                                       "3.conv.weight", "3.conv.bias", "0.conv.weight", "0.conv.bias"};
  const std::vector<std::vector<int>> shapes{{10, 1024}, {10}, {1024, 3136}, {1024}, {64, 32, 5, 5}, {64}, {32, 1, 5, 5}, {32}};
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
  expect_usage("conv:5x5:32,pool:2,flatten,fc:10", "'pool:2'");        // unknown kind
  expect_usage("conv:5x5:32,pool:2,flatten,fc:10", "unknown layer kind");
  expect_usage("conv:5x5,flatten,fc:10", "'conv:5x5'");                // conv without channels
  expect_usage("conv:5x5:0,flatten,fc:10", "'conv:5x5:0'");
  expect_usage("conv:5x5:8:samee,flatten,fc:10", "samee");
  expect_usage("conv:axb:8,flatten,fc:10", "'conv:axb:8'");
  expect_usage("flatten,dropout:1.5,fc:10", "'dropout:1.5'");
  expect_usage("flatten,dropout:abc,fc:10", "dropout:abc");
  expect_usage("flatten,fc:0,fc:10", "'fc:0'");
  expect_usage("flatten,fc:-3,fc:10", "'fc:-3'");
  expect_usage("flatten,fc:12", "ends with 12 outputs");               // wrong class count
  expect_usage("flatten,fc:12", "fc:10");
  expect_usage("conv:3x3:8,,flatten,fc:10", "empty layer");
  expect_usage("", "empty layer");
  expect_usage("maxpool:29,flatten,fc:10", "'maxpool:29'");            // window larger than the input
  expect_usage("conv:29x29:4:valid,flatten,fc:10", "'conv:29x29:4:valid'");
  expect_usage("relu:2,flatten,fc:10", "'relu:2'");
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
