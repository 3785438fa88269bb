// A model instance: the spec's layers with kernels prepared by a backend for one batch size, and
// every activation buffer allocated once at build. Parameters and gradients are NOT owned here:
// they are views into the trainer's flat buffers, so a training model and an evaluation model
// (another batch size) share one set of weights.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/parameter_store.hpp"
#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi {

// A part of a model: its layers [first, end) (end -1: to the last layer). A part that stops
// before the last layer writes its output into `boundary`, and reads that output's gradient from
// `dboundary`: buffers of another part, `batch` rows (Note [The row-wise tail at the rank's batch]
// in src/train/exact_pipeline.cpp).
struct ModelPart {
  int first = 0, end = -1;
  float* boundary = nullptr;
  float* dboundary = nullptr;
};

class Model {
 public:
  // params / grads: flat buffers of spec.param_count elements; grads is null for inference.
  // state: the model state, spec.state_count elements (Note [State that is not trained] in
  // include/mnist_mpi/model/spec.hpp), read by evaluation and updated by training; may be null
  // only when the spec has none.
  Model(const ModelSpec& spec, int batch, Backend& backend, const float* params, float* grads, float* state,
        ModelPart part = {});
  // A model without state (a spec with no batch norm).
  Model(const ModelSpec& spec, int batch, Backend& backend, const float* params, float* grads, ModelPart part = {})
      : Model(spec, batch, backend, params, grads, nullptr, part) {}
  // The same on the parameters and model state of a store, which tells the model's kernels of
  // every change of the parameters, so that they keep their copies of the weights between passes
  // (Note [The parameters and their copies] in include/mnist_mpi/backend/parameter_store.hpp). The
  // store must outlive the model. A model on a bare pointer makes its kernels' copies at every pass.
  Model(const ModelSpec& spec, int batch, Backend& backend, ParameterStore& store, float* grads, ModelPart part = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelSpec& spec() const { return spec_; }
  float* state() const { return state_; }  // the model state it was built with (null: none)
  int batch() const { return batch_; }
  float* input() { return act_ptr_.at(static_cast<std::size_t>(first_)); }  // (N, C, H, W) of the first layer
  const float* logits() const { return act_ptr_.back(); }  // (N, classes)
  float* dlogits() { return dact_ptr_.back(); }            // (N, classes)
  bool training() const { return training_; }
  int first_layer() const { return first_; }
  int end_layer() const { return end_; }
  // The input of layer i (i == end_layer(): the part's output) and its gradient, for comparisons.
  const float* activation(int i) const { return act_ptr_.at(static_cast<std::size_t>(i)); }
  const float* activation_gradient(int i) const { return dact_ptr_.at(static_cast<std::size_t>(i)); }

  void forward(const StepContext& ctx);
  // Runs backward from dlogits() down to the first layer. on_layer_done(i) is called as soon as
  // layer i's parameter gradients are final (the reducer starts buckets from there).
  void backward(const StepContext& ctx, const std::function<void(int layer)>& on_layer_done = {});
  std::string describe() const;

  // --exact-sums (Note [A weight gradient written once as integers] in
  // include/mnist_mpi/backend/layer.hpp): offers every layer's kernel its weight gradient for
  // `chunks` chunks a step; returns the weights taken (their layers and flat ranges).
  struct TakenWeight {
    int layer = 0;
    std::int64_t offset = 0, size = 0;
  };
  // Each backward call holds batch() / chunk_rows chunks.
  std::vector<TakenWeight> take_weight_gradients(int chunks, int chunk_rows, FixedPointSink& sink);
  // Hands layer's taken weight gradient of every chunk since the last call to the sink.
  void finish_weight_gradient(int layer) { kernels_.at(static_cast<std::size_t>(layer - first_))->finish_weight_gradient(); }

 private:
  friend class ParameterStore;
  static const float* checked_params(const ModelSpec& spec, ParameterStore& store);
  // From the store (Note [The parameters and their copies]): the kernels' plain bf16 copies, and
  // a change of the parameters in [from, to).
  std::vector<LayerKernel::PlainCopy> plain_bf16_copies() const;
  void parameters_changed(const float* from, const float* to, bool images_written);

  const ModelSpec& spec_;
  ParameterStore* store_ = nullptr;  // null: built on a bare pointer
  float* state_;
  int batch_;
  bool training_;
  int first_ = 0, end_ = 0;  // the layers built: [first_, end_)
  std::vector<std::unique_ptr<Buffer>> acts_, dacts_;  // acts_[i]: input of layer i; back(): logits
  std::vector<float*> act_ptr_, dact_ptr_;
  std::vector<std::unique_ptr<LayerKernel>> kernels_;  // kernels_[i - first_]: layer i's
  std::vector<std::int64_t> weight_offset_;  // per layer: its weight's flat offset, -1 without
};

}  // namespace mnist_mpi
