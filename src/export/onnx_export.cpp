// The `export` subcommand (include/mnist_mpi/export/onnx_export.hpp): one ONNX node per layer of
// the model spec, the checkpoint's tensors as initializers, a Softmax next to the logits, and the
// run's facts as metadata. ONNX's checker and strict shape inference vet the graph before a byte
// is written; the file is written to a temporary name and renamed, so it is whole or absent.
#include "mnist_mpi/export/onnx_export.hpp"

#if MNIST_MPI_HAVE_ONNX
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>
#include <onnx/shape_inference/implementation.h>
#endif

#include <bit>
#include <boost/program_options.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/checkpoint/evaluate_checkpoint.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/hash.hpp"
#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/io/file_roles.hpp"

namespace po = boost::program_options;

namespace mnist_mpi {
namespace {

static_assert(std::endian::native == std::endian::little, "ONNX raw_data is little-endian, as our floats are");

constexpr const char* kInputName = "image";
constexpr const char* kLogitsName = "logits";
constexpr const char* kProbabilitiesName = "probabilities";

#if MNIST_MPI_HAVE_ONNX
void set_ints(onnx::NodeProto& node, const char* name, std::initializer_list<std::int64_t> values) {
  onnx::AttributeProto* a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INTS);
  for (std::int64_t v : values) a->add_ints(v);
}

void set_int(onnx::NodeProto& node, const char* name, std::int64_t value) {
  onnx::AttributeProto* a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(value);
}

// A value's type: float32 of shape (N, dims...), N the symbolic batch dimension.
void set_float_type(onnx::ValueInfoProto& v, const std::string& name, std::initializer_list<std::int64_t> dims) {
  v.set_name(name);
  onnx::TypeProto_Tensor* t = v.mutable_type()->mutable_tensor_type();
  t->set_elem_type(onnx::TensorProto::FLOAT);
  onnx::TensorShapeProto* s = t->mutable_shape();
  s->add_dim()->set_dim_param("N");
  for (std::int64_t d : dims) s->add_dim()->set_dim_value(d);
}

// Builds the graph layer by layer. The tensor flowing between nodes is either 4-D (N, C, H, W)
// or 2-D (N, features); our layers' shapes are (C, H, W) throughout (an fc outputs (units, 1, 1)),
// so a conv or maxpool after an fc gets a Reshape back to 4-D, and an fc or the logits after a
// 4-D tensor a Flatten (C, H, W order, the order in which our fc reads a (C, H, W) input).
class GraphBuilder {
 public:
  GraphBuilder(onnx::GraphProto& g, const Checkpoint& ck) : g_(g), ck_(ck), cur_(kInputName) {}

  onnx::NodeProto& node(const char* op, const std::string& name, std::vector<std::string> inputs) {
    onnx::NodeProto* n = g_.add_node();
    n->set_op_type(op);
    n->set_name(name);
    for (const std::string& in : inputs) n->add_input(in);
    cur_ = name;
    n->add_output(cur_);
    return *n;
  }

  void to_4d(const Shape& s, const std::string& layer) {
    if (rank4_) return;
    const std::string shape_name = layer + ".reshape_shape";
    onnx::TensorProto* t = g_.add_initializer();
    t->set_name(shape_name);
    t->set_data_type(onnx::TensorProto::INT64);
    t->add_dims(4);
    for (std::int64_t d : {std::int64_t{-1}, std::int64_t{s.c}, std::int64_t{s.h}, std::int64_t{s.w}})
      t->add_int64_data(d);
    node("Reshape", layer + ".reshape", {cur_, shape_name});
    rank4_ = true;
  }

  void to_2d(const std::string& layer) {
    if (!rank4_) return;
    set_int(node("Flatten", layer + ".flatten", {cur_}), "axis", 1);
    rank4_ = false;
  }

  // A checkpoint tensor as an initializer of the same name ("3.conv.weight"); of the model state
  // ("1.bn.running_mean") when `state`.
  void initializer(const CheckpointTensor& ct, bool state = false) {
    onnx::TensorProto* t = g_.add_initializer();
    t->set_name(ct.name);
    t->set_data_type(onnx::TensorProto::FLOAT);
    for (std::int64_t d : ct.shape) t->add_dims(d);
    const float* from = (state ? ck_.model_state.data() : ck_.params.data()) + ct.offset;
    t->set_raw_data(from, static_cast<std::size_t>(ct.size) * sizeof(float));
  }

  const std::string& current() const { return cur_; }

 private:
  onnx::GraphProto& g_;
  const Checkpoint& ck_;
  std::string cur_;
  bool rank4_ = true;  // the input is (N, C, H, W)
};

const CheckpointTensor& find_tensor(const Checkpoint& ck, const std::string& name) {
  for (const std::vector<CheckpointTensor>* table : {&ck.tensors, &ck.state_tensors})
    for (const CheckpointTensor& t : *table)
      if (t.name == name) return t;
  throw_error(ExitCode::kCheckpoint, "the checkpoint has no tensor '" + name + "' for its own model spec");
}

void add_metadata(onnx::ModelProto& m, const char* key, const std::string& value) {
  onnx::StringStringEntryProto* e = m.add_metadata_props();
  e->set_key(key);
  e->set_value(value);
}

// ONNX's own verdict on what was built: the checker, then shape inference in strict mode, which
// fails when the shapes it infers differ from the declared outputs' (N, classes).
void vet(onnx::ModelProto& model) {
  try {
    onnx::checker::check_model(model);
    onnx::shape_inference::InferShapes(model, onnx::OpSchemaRegistry::Instance(),
                                       onnx::ShapeInferenceOptions(/*check_type=*/true, /*strict_mode=*/1));
  } catch (const std::exception& e) {
    throw_error(ExitCode::kRuntime, std::string("internal error: ONNX's checker refuses the exported graph: ") +
                                        e.what() + " (please report it with the model spec)");
  }
}

#endif  // MNIST_MPI_HAVE_ONNX

// Note [Whole or absent] (include/mnist_mpi/io/file_kind.hpp): the model file is whole or absent.
constexpr const char* kOnnxTempSuffix = ".tmp";

}  // namespace

#if MNIST_MPI_HAVE_ONNX

void check_onnx_exportable(const ModelSpec& spec) {
  std::int64_t bytes = 0;
  for (std::size_t i = 0; i < spec.layers.size(); ++i) {
    for (const ParamTensor& p : spec.params)
      if (p.layer == static_cast<int>(i)) bytes += p.size * static_cast<std::int64_t>(sizeof(float));
    if (bytes > kOnnxMaxBytes)
      throw_error(ExitCode::kUsage, "ONNX cannot hold layer " + std::to_string(i) + " " +
                                        quote_input(spec.layers[i].text) + ": with it the weights reach " +
                                        std::to_string(bytes) +
                                        " bytes, and one ONNX file (a protobuf message) "
                                        "holds at most 2 GiB; export a smaller model (ONNX's external-data form "
                                        "is not written)");
  }
}

// Note [The exported graph]
// One node per layer, in spec order, named after the layer ("3.conv", "7.fc") so that a reader of
// the graph finds the spec in it; the initializers keep the checkpoint's tensor names. conv ->
// Conv with pads [top, left, bottom, right] as the spec resolved them (TensorFlow's SAME puts the
// odd row or column at the end, so asymmetric pads are explicit, never auto_pad); maxpool ->
// MaxPool (no padding, floor); relu -> Relu; flatten -> Flatten(axis 1); fc -> Gemm with
// transB = 1, since our fc weight is (out, in); batchnorm -> BatchNormalization (inference: the
// running mean and variance, epsilon as the spec says), on (N, C, H, W) or, after an fc, (N, C);
// dropout is left out (inference: the identity).
// Long on purpose (Note [Why a function is long] in docs/style.md): one case per layer kind.
OnnxExport export_onnx(const Checkpoint& ck) {
  const ModelSpec spec = checkpoint_model_spec(ck);
  check_onnx_exportable(spec);

  onnx::ModelProto model;
  model.set_ir_version(7);  // the IR version that introduced opset 13: the widest reach
  model.set_producer_name("mnist_mpi");
  model.set_producer_version(MNIST_MPI_VERSION);
  model.set_model_version(ck.meta.step);
  model.set_doc_string("mnist_mpi model " + ck.spec + " after " + std::to_string(ck.meta.step) + " steps");
  onnx::OperatorSetIdProto* opset = model.add_opset_import();
  opset->set_domain("");
  opset->set_version(kOnnxOpset);
  add_metadata(model, "mnist_mpi.model_spec", ck.spec);
  add_metadata(model, "mnist_mpi.step", std::to_string(ck.meta.step));
  add_metadata(model, "mnist_mpi.params_hash",
               hex64(hash_floats(ck.params.data(), static_cast<std::int64_t>(ck.params.size()))));
  add_metadata(model, "mnist_mpi.input_scaling",
               "image = pixel / 255 as float32, (N, " + std::to_string(ck.input.c) + ", " + std::to_string(ck.input.h) +
                   ", " + std::to_string(ck.input.w) +
                   ") row-major; 0 is the background (black), 1 the ink (white), as in MNIST's IDX files");
  add_metadata(model, "mnist_mpi.classes", std::to_string(ck.num_classes));
  add_metadata(model, "mnist_mpi.outputs", "logits (N, classes); probabilities = Softmax(logits, axis 1)");

  onnx::GraphProto& g = *model.mutable_graph();
  g.set_name("mnist_mpi");
  set_float_type(*g.add_input(), kInputName, {ck.input.c, ck.input.h, ck.input.w});
  GraphBuilder b(g, ck);
  OnnxExport out;
  for (std::size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& l = spec.layers[i];
    const std::string name = std::to_string(i) + "." + l.text.substr(0, l.text.find(':'));
    switch (l.kind) {
      case LayerKind::kConv: {
        b.to_4d(l.in, std::to_string(i));
        const CheckpointTensor& w = find_tensor(ck, std::to_string(i) + ".conv.weight");   // (O, I, KH, KW)
        const CheckpointTensor& bias = find_tensor(ck, std::to_string(i) + ".conv.bias");  // (O)
        b.initializer(w);
        b.initializer(bias);
        onnx::NodeProto& n = b.node("Conv", name, {b.current(), w.name, bias.name});
        set_ints(n, "kernel_shape", {l.kernel_h, l.kernel_w});
        set_ints(n, "strides", {l.stride, l.stride});
        set_ints(n, "pads", {l.pad_top, l.pad_left, l.pad_bottom, l.pad_right});
        set_ints(n, "dilations", {1, 1});
        set_int(n, "group", 1);
        break;
      }
      case LayerKind::kMaxPool: {
        b.to_4d(l.in, std::to_string(i));
        onnx::NodeProto& n = b.node("MaxPool", name, {b.current()});
        set_ints(n, "kernel_shape", {l.kernel_h, l.kernel_w});
        set_ints(n, "strides", {l.stride, l.stride});
        break;
      }
      case LayerKind::kRelu:
        b.node("Relu", name, {b.current()});
        break;
      case LayerKind::kFlatten:
        b.to_2d(std::to_string(i));
        break;
      case LayerKind::kFc: {
        b.to_2d(std::to_string(i));
        const CheckpointTensor& w = find_tensor(ck, std::to_string(i) + ".fc.weight");   // (O, I)
        const CheckpointTensor& bias = find_tensor(ck, std::to_string(i) + ".fc.bias");  // (O)
        b.initializer(w);
        b.initializer(bias);
        set_int(b.node("Gemm", name, {b.current(), w.name, bias.name}), "transB", 1);
        break;
      }
      case LayerKind::kBatchNorm: {
        const std::string p = std::to_string(i) + ".bn.";
        const CheckpointTensor& scale = find_tensor(ck, p + "weight");
        const CheckpointTensor& shift = find_tensor(ck, p + "bias");
        const CheckpointTensor& mean = find_tensor(ck, p + "running_mean");
        const CheckpointTensor& var = find_tensor(ck, p + "running_var");
        b.initializer(scale);
        b.initializer(shift);
        b.initializer(mean, /*state=*/true);
        b.initializer(var, /*state=*/true);
        onnx::NodeProto& n = b.node("BatchNormalization", name, {b.current(), scale.name, shift.name, mean.name, var.name});
        onnx::AttributeProto* eps = n.add_attribute();
        eps->set_name("epsilon");
        eps->set_type(onnx::AttributeProto::FLOAT);
        eps->set_f(l.eps);
        break;
      }
      case LayerKind::kDropout:
        out.dropped.push_back(std::to_string(i) + " " + l.text);
        break;
    }
  }
  b.to_2d("logits");
  // The last node's output becomes the graph's output; a graph whose layers made no node (an
  // input already of classes values, then flatten and dropout only) gets an Identity.
  if (g.node_size() == 0) b.node("Identity", "logits.identity", {b.current()});
  g.mutable_node(g.node_size() - 1)->set_output(0, kLogitsName);
  set_int(b.node("Softmax", kProbabilitiesName, {kLogitsName}), "axis", 1);
  set_float_type(*g.add_output(), kLogitsName, {ck.num_classes});
  set_float_type(*g.add_output(), kProbabilitiesName, {ck.num_classes});
  out.nodes = g.node_size();

  vet(model);
  model.mutable_graph()->clear_value_info();  // shape inference added it; the file keeps the plain graph
  MNIST_CHECK(model.SerializeToString(&out.bytes), ExitCode::kRuntime, "protobuf could not serialize the ONNX model");
  return out;
}

#else

OnnxExport export_onnx(const Checkpoint&) {
  throw_error(ExitCode::kUsage,
              "this mnist_mpi was built without ONNX (libonnx-dev and libprotobuf-dev were missing when it was "
              "configured): run `bash scripts/setup.sh use`, which installs them and rebuilds, then export again");
}

#endif  // MNIST_MPI_HAVE_ONNX

int export_onnx_main(int argc, char** argv) {
  std::string checkpoint, onnx_path;
  po::options_description desc(
      "mnist_mpi " MNIST_MPI_VERSION
      " export - write a checkpoint's model as ONNX (opset 13) for inference elsewhere.\n"
      "Usage: mnist_mpi export --checkpoint FILE|DIR --onnx model.onnx (one process, no mpirun)\n"
      "The graph, its metadata and the input scaling: docs/model_use.md\n"
      "Exit code: 0 written; 2 bad option (or a model too large for ONNX, or a build without ONNX);\n"
      "4 bad checkpoint; 7 the ONNX file or standard output could not be written\nOptions");
  desc.add_options()("help,h", "print this help and exit")(
      "checkpoint", po::value(&checkpoint), "checkpoint file, or a --checkpoint-dir (its newest valid checkpoint)")(
      "onnx", po::value(&onnx_path), "the ONNX file to write (replaced whole, or left as it was on an error)");
  return run_subcommand(
      "export", "mnist_mpi export", desc, nullptr, argc, argv,
      [&](const po::variables_map&) -> int {
        if (checkpoint.empty() || onnx_path.empty())
          throw_error(ExitCode::kUsage, "give --checkpoint FILE and --onnx FILE (see mnist_mpi export --help)");
        FileRoles roles;  // Note [No output is an input]
        declare_checkpoint_input(checkpoint, roles);
        roles.replaced_output("--onnx", onnx_path, kOnnxTempSuffix);
        roles.check();
        // Before the work, not after it; a read-only file is refused, not replaced (Note [A
        // read-only output is not replaced] in include/mnist_mpi/io/file_kind.hpp).
        check_output_path(onnx_path, "ONNX file", ExitCode::kOutput);
        std::string chosen;
        const Checkpoint ck = pick_checkpoint(checkpoint, chosen);
        const OnnxExport e = export_onnx(ck);
        write_whole_file(onnx_path, kOnnxTempSuffix, e.bytes);
        std::printf(
            "wrote %s: ONNX opset %lld, %d nodes, input %s (N,%d,%d,%d), outputs %s and %s (N,%d); "
            "model %s at step %lld from %s\n",
            onnx_path.c_str(), static_cast<long long>(kOnnxOpset), e.nodes, kInputName, ck.input.c, ck.input.h,
            ck.input.w, kLogitsName, kProbabilitiesName, ck.num_classes, ck.spec.c_str(),
            static_cast<long long>(ck.meta.step), chosen.c_str());
        for (const std::string& d : e.dropped) std::printf("  left out for inference: layer %s\n", d.c_str());
        return 0;
      });
}

}  // namespace mnist_mpi
