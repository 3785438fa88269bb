// The model spec: a comma-separated list of layers, parsed and shape-checked here, and the
// layout of every parameter tensor in the flat buffers (Note [Reverse layer order] in
// src/model/spec.cpp). Nothing here knows about a backend.
//
//   conv:5x5:32:same[:s1]  maxpool:2[:2]  relu  flatten  fc:1024  dropout:0.5  batchnorm[:MOMENTUM[:EPS]]
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "mnist_mpi/optimizer_kind.hpp"

namespace mnist_mpi {

enum class LayerKind { kConv, kMaxPool, kRelu, kFlatten, kFc, kDropout, kBatchNorm };

// Note [A layer kind's facts]
// What the program asks of a layer kind outside its parse case, its kernels and its ONNX export,
// one row per kind: its token in a model spec, an example token (the tests parse it), the middle
// of its parameters' names ("3.conv.weight"; null: the kind has no parameters), whether it
// computes each image's row alone (the --exact-sums tail may run it at the rank's batch: Note [The
// row-wise tail at the rank's batch] in src/train/exact_pipeline.cpp), and whether the CPU
// backend's blocked activation layouts pass through it (activation_layouts in
// src/backend/cpu/cpu_backend.cpp). A new kind is a row here, its case in parse_layer
// (src/model/spec.cpp), its kernels and its export; tests/test_spec.cpp's LayerTraits.* fail for a
// kind without its row, or a row whose facts its parse and layout contradict.
struct LayerTraits {
  LayerKind kind;
  const char* token;         // "conv"
  const char* example;       // "conv:3x3:4"
  const char* param_prefix;  // ".conv" (then ".weight", ".bias"); nullptr: no parameters
  bool row_wise;
  bool keeps_blocked;
};
inline constexpr LayerTraits kLayerTraits[] = {
    {LayerKind::kConv, "conv", "conv:3x3:4", ".conv", false, true},
    {LayerKind::kMaxPool, "maxpool", "maxpool:2", nullptr, false, true},
    {LayerKind::kRelu, "relu", "relu", nullptr, true, true},
    {LayerKind::kFlatten, "flatten", "flatten", nullptr, true, false},
    {LayerKind::kFc, "fc", "fc:6", ".fc", true, false},
    {LayerKind::kDropout, "dropout", "dropout:0.5", nullptr, true, false},
    {LayerKind::kBatchNorm, "batchnorm", "batchnorm", ".bn", false, true},
};
// The row of kind k: the rows are in LayerKind's order (checked below), one per kind; a kind past
// the last row is a program error.
inline const LayerTraits& layer_traits(LayerKind k) {
  const auto i = static_cast<std::size_t>(k);
  if (i >= std::size(kLayerTraits)) throw std::logic_error("LayerKind " + std::to_string(i) + " has no row in kLayerTraits");
  return kLayerTraits[i];
}
constexpr bool layer_traits_in_order() {
  for (std::size_t i = 0; i < std::size(kLayerTraits); ++i)
    if (static_cast<std::size_t>(kLayerTraits[i].kind) != i) return false;
  return true;
}
static_assert(layer_traits_in_order(), "kLayerTraits: one row per LayerKind, in its order");

// A per-sample activation shape (C, H, W); fc outputs are (units, 1, 1).
struct Shape {
  int c = 0, h = 0, w = 0;
  std::int64_t size() const { return static_cast<std::int64_t>(c) * h * w; }
  bool operator==(const Shape&) const = default;
};

struct LayerSpec {
  LayerKind kind{};
  int kernel_h = 0, kernel_w = 0, stride = 1;                    // conv and maxpool
  int channels = 0;                                              // conv: output channels; fc: output units
  bool same = false;                                             // conv padding
  int pad_top = 0, pad_left = 0, pad_bottom = 0, pad_right = 0;  // resolved from `same`
  float drop_rate = 0.0f;                                        // dropout: probability of dropping
  float momentum = 0.1f, eps = 1e-5f;                            // batchnorm (PyTorch's defaults)
  Shape in, out;                                                 // resolved by parse_model_spec
  std::string text;                                              // the token as written
};

struct InitSpec {
  enum class Kind { kTruncatedNormal, kNormal, kXavierUniform, kHeNormal, kConstant } kind{};
  float value = 0.0f;  // stddev (normal kinds) or the constant
  std::string text;
};

// One parameter tensor's place in the flat buffers.
struct ParamTensor {
  std::string name;         // "3.conv.weight"
  std::vector<int> shape;   // conv weight (O, I, KH, KW), fc weight (O, I), bias (O)
  std::int64_t offset = 0;  // in elements, into the flat parameter / gradient buffers
  std::int64_t size = 0;
  int layer = 0;  // index into ModelSpec::layers
  bool is_bias = false;
  bool is_scale = false;  // batch norm's scale (gamma): starts at 1 whatever --weight-init says
  int fan_in = 0, fan_out = 0;
};

// Note [State that is not trained]
// Batch norm's running mean and variance are part of the model (evaluation reads them) but not
// parameters: no gradient, no optimiser, no reducer bucket. They live in a third flat buffer, the
// model state, laid out like the parameters (reverse layer order; per batch-norm layer its running
// mean, then its running variance, C floats each). Training updates them in the forward pass from
// each rank's own batch, as PyTorch's BatchNorm does under DDP, and after every step the trainer
// replaces them by their mean over the ranks (Rig::average_model_state), so every rank holds
// the same state, as it holds the same parameters: evaluation, checkpoints and a resumed run see
// one state. Checkpoints keep it in the SIDX and STAT sections (docs/checkpoint.md).
struct StateTensor {
  std::string name;         // "1.bn.running_mean"
  std::int64_t offset = 0;  // into the flat state buffer
  std::int64_t size = 0;
  int layer = 0;
  float initial = 0.0f;  // mean 0, variance 1
};

struct ModelSpec {
  std::string text;
  Shape input;
  std::vector<LayerSpec> layers;
  std::vector<ParamTensor> params;  // in flat-buffer order (reverse layer order)
  std::int64_t param_count = 0;
  std::vector<StateTensor> state;  // Note [State that is not trained]; empty without batch norm
  std::int64_t state_count = 0;
  int num_classes() const { return layers.empty() ? 0 : static_cast<int>(layers.back().out.size()); }
  // Activation i: the input of layer i, or for i == layers.size() the logits (one sample's shape).
  Shape activation(std::size_t i) const { return i == 0 ? input : layers.at(i - 1).out; }
};

// Parses and shape-checks; throws Error(kUsage) naming the bad token. The last layer must output
// num_classes values. Every size is checked for overflow (Note [Sizes of a model] in
// src/model/spec.cpp): a per-sample activation or a weight's fan-in above INT32_MAX is refused.
ModelSpec parse_model_spec(const std::string& text, Shape input, int num_classes);
InitSpec parse_init_spec(const std::string& text);

// What a rank holds in memory for a model (Note [Will the model fit?] in src/model/spec.cpp), in
// bytes: parameters, gradients and optimiser moments (adam: two, sgd: one); the activations and
// their gradients for train_batch images; on rank 0 the evaluation model's activations for
// eval_batch images. An estimate: a backend's workspaces and copies come on top.
struct MemoryEstimate {
  bool overflow = false;  // some product or sum exceeded int64: far beyond any machine
  std::int64_t total_bytes = 0;
  std::int64_t state_bytes = 0;       // parameters, gradients, optimiser moments
  std::int64_t activation_bytes = 0;  // training and evaluation activations (and their gradients)
  int largest_layer = -1;             // index into ModelSpec::layers; -1: no layer holds anything
  std::int64_t largest_layer_bytes = 0;
};
// evaluates: the rank also holds an evaluation model of eval_batch images (every rank does in
// training: Note [Every rank evaluates a share] in src/train/evaluator.cpp).
MemoryEstimate estimate_model_memory(const ModelSpec& spec, std::int64_t train_batch, std::int64_t eval_batch,
                                     OptimizerKind optimizer, bool evaluates);
// This machine's physical memory in bytes (sysconf), or 0 when it cannot be told.
std::int64_t physical_memory_bytes();
// Throws Error(kUsage) naming the estimate, the machine's memory and the largest layer when the
// estimate exceeds physical_memory_bytes(): a clear message instead of std::bad_alloc or the
// kernel's OOM killer in the middle of set-up.
void check_model_fits_memory(const ModelSpec& spec, std::int64_t train_batch, std::int64_t eval_batch,
                             OptimizerKind optimizer, bool evaluates);
// Fills state (size spec.state_count) with every state tensor's initial value.
void init_state(const ModelSpec& spec, float* state);
// Fills params (size spec.param_count) from the initialisers, deterministically from seed; a batch
// norm's scale is 1 and its shift 0 whatever they say.
void init_params(const ModelSpec& spec, const InitSpec& weight_init, const InitSpec& bias_init, std::uint64_t seed,
                 float* params);

}  // namespace mnist_mpi
