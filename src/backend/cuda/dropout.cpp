// Inverted dropout on the GPU with the CPU's mask function (rng::dropout_key / dropout_scale,
// compiled for the device in src/backend/cuda/kernels.cu): the same sample in the same step gets
// the same mask on either backend (Note [Dropout masks do not depend on the rank] in
// src/backend/cpu/dropout.cpp). The scale buffer is made at build. Flatten, as on the CPU, is an alias.
#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi::cuda {
namespace {

class Dropout final : public LayerKernel {
 public:
  Dropout(Context& c, const LayerSpec& l, int index, const LayerBuffers& b, bool training)
      : c_(c), b_(b), index_(index), per_sample_(l.in.size()), rate_(l.drop_rate), training_(training) {
    if (training_) scale_ = DeviceArray<float>(b.batch * per_sample_);
  }
  void forward(const StepContext& ctx) override {
    const std::int64_t n = b_.batch * per_sample_;
    if (!ctx.training || !training_) {
      if (b_.y != b_.x)
        CUDA_CHECK(cudaMemcpyAsync(b_.y, b_.x, static_cast<std::size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice,
                                   c_.stream));
      return;
    }
    // The step from device memory (Note [A step as one CUDA graph]); the host queued ctx.step there.
    MNIST_CHECK(c_.host_args.step == ctx.step, ExitCode::kRuntime,
                "dropout: the step's device arguments were not set for step " + std::to_string(ctx.step));
    launch_dropout_forward(c_.stream, b_.x, b_.y, scale_.get(), b_.batch, per_sample_, ctx.seed, &c_.step_args->step,
                           ctx.first_sample, index_, rate_);
  }
  void backward(const StepContext&) override {
    if (b_.dx) launch_mul(c_.stream, b_.dy, scale_.get(), b_.dx, b_.batch * per_sample_);
  }
  std::string describe() const override { return "dropout (counter-based mask, shared with the CPU)"; }

 private:
  Context& c_;
  LayerBuffers b_;
  int index_;
  std::int64_t per_sample_;
  float rate_;
  bool training_;
  DeviceArray<float> scale_;  // (N, C*H*W): 0 or 1 / (1 - rate)
};

class Flatten final : public LayerKernel {
 public:
  Flatten(Context& c, const LayerSpec& l, const LayerBuffers& b) : c_(c), b_(b), n_(b.batch * l.in.size()) {}
  void forward(const StepContext&) override {
    if (b_.y != b_.x) CUDA_CHECK(cudaMemcpyAsync(b_.y, b_.x, bytes(), cudaMemcpyDeviceToDevice, c_.stream));
  }
  void backward(const StepContext&) override {
    if (b_.dx && b_.dx != b_.dy)
      CUDA_CHECK(cudaMemcpyAsync(b_.dx, b_.dy, bytes(), cudaMemcpyDeviceToDevice, c_.stream));
  }
  std::string describe() const override { return "flatten (aliased)"; }

 private:
  std::size_t bytes() const { return static_cast<std::size_t>(n_) * sizeof(float); }
  Context& c_;
  LayerBuffers b_;
  std::int64_t n_;
};

}  // namespace

std::unique_ptr<LayerKernel> make_dropout(Context& c, const LayerSpec& l, int index, const LayerBuffers& b,
                                          bool training) {
  return std::make_unique<Dropout>(c, l, index, b, training);
}
std::unique_ptr<LayerKernel> make_flatten(Context& c, const LayerSpec& l, const LayerBuffers& b) {
  return std::make_unique<Flatten>(c, l, b);
}

}  // namespace mnist_mpi::cuda
