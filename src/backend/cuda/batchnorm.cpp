// Batch normalisation on the GPU: the CPU's definition (src/backend/cpu/batchnorm.cpp) with
// kernels of our own in kernels.cu, one block per channel and sums in double in a fixed tree
// (deterministic, unlike atomics), rather than cuDNN's batch-norm calls, which cuDNN 9 deprecates.
// The batch's mean and 1 / sqrt(var + eps) per channel are kept on the device for backward.
#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi::cuda {
namespace {

class BatchNorm final : public LayerKernel {
 public:
  BatchNorm(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training)
      : c_(c),
        b_(b),
        channels_(l.in.c),
        plane_(static_cast<std::int64_t>(l.in.h) * l.in.w),
        momentum_(l.momentum),
        eps_(l.eps),
        training_(training),
        mean_(l.in.c),
        inv_std_(l.in.c) {
    MNIST_CHECK(b.w && b.state, ExitCode::kRuntime, "batch norm: its scale and shift and its running statistics are needed");
  }

  void forward(const StepContext& ctx) override {
    if (ctx.training && training_)
      launch_batchnorm_forward_train(c_.stream, b_.x, b_.y, b_.w, b_.w + channels_, b_.state, mean_.get(),
                                     inv_std_.get(), b_.batch, channels_, plane_, momentum_, eps_);
    else
      launch_batchnorm_forward_infer(c_.stream, b_.x, b_.y, b_.w, b_.w + channels_, b_.state, b_.batch, channels_,
                                     plane_, eps_);
  }
  void backward(const StepContext&) override {
    launch_batchnorm_backward(c_.stream, b_.x, b_.dy, b_.dx, b_.w, mean_.get(), inv_std_.get(), b_.dw,
                              b_.dw + channels_, b_.batch, channels_, plane_);
  }
  std::string describe() const override { return "batchnorm (own kernels, a block per channel)"; }

 private:
  Context& c_;
  LayerBuffers b_;
  int channels_;
  std::int64_t plane_;
  double momentum_, eps_;
  bool training_;
  DeviceArray<float> mean_, inv_std_;  // per channel, of the last training forward
};

}  // namespace

std::unique_ptr<LayerKernel> make_batchnorm(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<BatchNorm>(c, l, b, training);
}

}  // namespace mnist_mpi::cuda
