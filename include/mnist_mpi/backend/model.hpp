// A model instance: the spec's layers with kernels prepared by a backend for one batch size, and
// every activation buffer allocated once at build. Parameters and gradients are NOT owned here:
// they are views into the trainer's flat buffers, so a training model and an evaluation model
// (another batch size) share one set of weights.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi {

class Model {
 public:
  // params / grads: flat buffers of spec.param_count elements; grads is null for inference.
  Model(const ModelSpec& spec, int batch, Backend& backend, const float* params, float* grads);

  const ModelSpec& spec() const { return spec_; }
  int batch() const { return batch_; }
  float* input() { return act_ptr_.front(); }              // (N, C, H, W)
  const float* logits() const { return act_ptr_.back(); }  // (N, classes)
  float* dlogits() { return dact_ptr_.back(); }            // (N, classes)
  bool training() const { return training_; }

  void forward(const StepContext& ctx);
  // Runs backward from dlogits() down to the first layer. on_layer_done(i) is called as soon as
  // layer i's parameter gradients are final (the reducer starts buckets from there).
  void backward(const StepContext& ctx, const std::function<void(int layer)>& on_layer_done = {});
  std::string describe() const;

 private:
  const ModelSpec& spec_;
  int batch_;
  bool training_;
  std::vector<std::unique_ptr<Buffer>> acts_, dacts_;  // acts_[i]: input of layer i; back(): logits
  std::vector<float*> act_ptr_, dact_ptr_;
  std::vector<std::unique_ptr<LayerKernel>> kernels_;
};

}  // namespace mnist_mpi
