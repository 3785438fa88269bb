// Tests of the ONNX export's graph, read back with ONNX's own protobuf classes: the nodes each
// spec becomes (Reshape and Flatten where an fc and a conv meet, dropout left out), the conv pads
// SAME resolves to (asymmetric ones included), Gemm's transB, initializers that are the checkpoint's
// bytes, the input and outputs, the metadata; and the errors (a model past ONNX's 2 GiB, tensors
// that do not match the spec). That the graph computes what our model does: tests/check_onnx.py.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/export/onnx_export.hpp"
#include "mnist_mpi/hash.hpp"

namespace mnist_mpi {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

Checkpoint make_checkpoint(const std::string& text) {
  const ModelSpec spec = parse_model_spec(text, {1, 28, 28}, 10);
  Checkpoint ck;
  ck.spec = text;
  ck.input = spec.input;
  ck.num_classes = 10;
  ck.tensors = checkpoint_tensors(spec);
  ck.params.resize(static_cast<std::size_t>(spec.param_count));
  init_params(spec, parse_init_spec("xavier"), parse_init_spec("constant:0.25"), 7, ck.params.data());
  ck.meta.step = 321;
  ck.meta.param_count = spec.param_count;
  return ck;
}

onnx::ModelProto exported(const Checkpoint& ck) {
  onnx::ModelProto m;
  EXPECT_TRUE(m.ParseFromString(export_onnx(ck).bytes));
  onnx::checker::check_model(m);  // throws on a bad graph
  return m;
}

std::vector<std::string> ops(const onnx::ModelProto& m) {
  std::vector<std::string> v;
  for (const auto& n : m.graph().node()) v.push_back(n.op_type());
  return v;
}

std::vector<std::int64_t> ints(const onnx::NodeProto& n, const std::string& name) {
  for (const auto& a : n.attribute())
    if (a.name() == name) return {a.ints().begin(), a.ints().end()};
  return {};
}

std::int64_t int_attr(const onnx::NodeProto& n, const std::string& name) {
  for (const auto& a : n.attribute())
    if (a.name() == name) return a.i();
  return -999;
}

TEST(OnnxExport, TinyGraphInputsOutputsAndMetadata) {
  const Checkpoint ck = make_checkpoint("conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10");
  const onnx::ModelProto m = exported(ck);
  EXPECT_EQ(m.opset_import(0).version(), 13);
  EXPECT_THAT(ops(m), ElementsAre("Conv", "MaxPool", "Conv", "MaxPool", "Flatten", "Gemm", "Softmax"));
  const auto& in = m.graph().input(0);
  EXPECT_EQ(in.name(), "image");
  const auto& s = in.type().tensor_type().shape();
  ASSERT_EQ(s.dim_size(), 4);
  EXPECT_EQ(s.dim(0).dim_param(), "N");
  EXPECT_EQ(s.dim(1).dim_value(), 1);
  EXPECT_EQ(s.dim(2).dim_value(), 28);
  EXPECT_EQ(s.dim(3).dim_value(), 28);
  ASSERT_EQ(m.graph().output_size(), 2);
  EXPECT_EQ(m.graph().output(0).name(), "logits");
  EXPECT_EQ(m.graph().output(1).name(), "probabilities");
  EXPECT_EQ(m.graph().node(5).output(0), "logits");
  EXPECT_EQ(int_attr(m.graph().node(5), "transB"), 1);  // our fc weight is (out, in)
  EXPECT_EQ(int_attr(m.graph().node(6), "axis"), 1);
  std::map<std::string, std::string> meta;
  for (const auto& p : m.metadata_props()) meta[p.key()] = p.value();
  EXPECT_EQ(meta["mnist_mpi.model_spec"], ck.spec);
  EXPECT_EQ(meta["mnist_mpi.step"], "321");
  EXPECT_EQ(meta["mnist_mpi.params_hash"], hex64(hash_floats(ck.params.data(), ck.meta.param_count)));
  EXPECT_THAT(meta["mnist_mpi.input_scaling"], HasSubstr("pixel / 255"));
}

TEST(OnnxExport, InitializersAreTheCheckpointsBytes) {
  const Checkpoint ck = make_checkpoint("conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10");
  const onnx::ModelProto m = exported(ck);
  ASSERT_EQ(m.graph().initializer_size(), static_cast<int>(ck.tensors.size()));
  for (const auto& t : m.graph().initializer()) {
    SCOPED_TRACE(t.name());
    const CheckpointTensor* ct = nullptr;
    for (const auto& c : ck.tensors)
      if (c.name == t.name()) ct = &c;
    ASSERT_NE(ct, nullptr);
    EXPECT_EQ(std::vector<std::int64_t>(t.dims().begin(), t.dims().end()), ct->shape);
    ASSERT_EQ(t.raw_data().size(), static_cast<std::size_t>(ct->size) * sizeof(float));
    EXPECT_EQ(std::memcmp(t.raw_data().data(), ck.params.data() + ct->offset, t.raw_data().size()), 0);
  }
}

// TensorFlow's SAME (src/model/spec.cpp) puts the odd padding row and column at the end; ONNX's
// pads are [top, left, bottom, right].
TEST(OnnxExport, ConvPadsAreTheSpecsIncludingAsymmetricSame) {
  const onnx::ModelProto m =
      exported(make_checkpoint("conv:5x5:8:same:s2,conv:3x3:16:valid:s2,maxpool:2:1,flatten,fc:10"));
  EXPECT_THAT(ops(m), ElementsAre("Conv", "Conv", "MaxPool", "Flatten", "Gemm", "Softmax"));
  EXPECT_THAT(ints(m.graph().node(0), "pads"), ElementsAre(1, 1, 2, 2));  // 28 -> 14 with 5x5, stride 2
  EXPECT_THAT(ints(m.graph().node(0), "strides"), ElementsAre(2, 2));
  EXPECT_THAT(ints(m.graph().node(1), "pads"), ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(ints(m.graph().node(2), "kernel_shape"), ElementsAre(2, 2));
  EXPECT_THAT(ints(m.graph().node(2), "strides"), ElementsAre(1, 1));
  const onnx::ModelProto lenet = exported(make_checkpoint(
      "conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10"));
  EXPECT_THAT(ops(lenet), ElementsAre("Conv", "Relu", "MaxPool", "Conv", "Relu", "MaxPool", "Flatten", "Gemm", "Relu",
                                      "Gemm", "Softmax"));  // no Dropout
  EXPECT_THAT(ints(lenet.graph().node(0), "pads"), ElementsAre(2, 2, 2, 2));
}

TEST(OnnxExport, AnFcAndAConvMeetThroughReshapeAndFlatten) {
  const Checkpoint ck = make_checkpoint("conv:4x4:4:same,relu,fc:32,relu,conv:1x1:16,dropout:0.3,fc:10");
  const onnx::ModelProto m = exported(ck);
  EXPECT_THAT(ops(m),
              ElementsAre("Conv", "Relu", "Flatten", "Gemm", "Relu", "Reshape", "Conv", "Flatten", "Gemm", "Softmax"));
  EXPECT_THAT(ints(m.graph().node(0), "pads"), ElementsAre(1, 1, 2, 2));  // 4x4 SAME, stride 1
  const OnnxExport e = export_onnx(ck);
  EXPECT_THAT(e.dropped, ElementsAre("5 dropout:0.3"));
}

TEST(OnnxExport, AModelPastTwoGibNamesItsLayer) {
  const ModelSpec big = parse_model_spec("flatten,fc:700000,relu,fc:10", {1, 28, 28}, 10);
  try {
    check_onnx_exportable(big);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_THAT(e.what(), HasSubstr("layer 1 'fc:700000'"));
    EXPECT_THAT(e.what(), HasSubstr("2 GiB"));
  }
  EXPECT_NO_THROW(check_onnx_exportable(parse_model_spec("flatten,fc:600000,relu,fc:10", {1, 28, 28}, 10)));
}

TEST(OnnxExport, TensorsThatDoNotMatchTheSpecAreACheckpointError) {
  Checkpoint ck = make_checkpoint("flatten,fc:10");
  ck.tensors[0].shape = {10, 783};
  try {
    export_onnx(ck);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kCheckpoint);
  }
}

// The one check that evaluate, export and predict make (checkpoint_model_spec): a checkpoint whose
// tensor table matches its spec but whose parameters are fewer than the spec's (a META count that
// disagrees, which decoding alone does not catch) is refused before any copy into a spec-sized buffer.
TEST(OnnxExport, ParametersShorterThanTheSpecAreACheckpointError) {
  Checkpoint ck = make_checkpoint("flatten,fc:10");
  EXPECT_EQ(checkpoint_model_spec(ck).param_count, static_cast<std::int64_t>(ck.params.size()));
  ck.params.pop_back();
  try {
    checkpoint_model_spec(ck);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kCheckpoint);
    EXPECT_NE(std::string(e.what()).find("do not match its own model spec"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace mnist_mpi
