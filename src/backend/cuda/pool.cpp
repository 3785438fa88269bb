// Max pooling (no padding) on cuDNN. Backward reads the forward's input and output (cuDNN finds
// the window's maximum again); CUDNN_POOLING_MAX_DETERMINISTIC routes each window's gradient to
// one element, as the CPU's first-maximum rule does when the maximum is unique.
#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi::cuda {
namespace {

class MaxPool final : public LayerKernel {
 public:
  MaxPool(Context& c, const LayerSpec& l, const LayerBuffers& b, bool) : c_(c), b_(b) {
    x_.set(b.batch, l.in.c, l.in.h, l.in.w);     // (N, C, H, W)
    y_.set(b.batch, l.out.c, l.out.h, l.out.w);  // (N, C, OH, OW)
    CUDNN_CHECK(cudnnCreatePoolingDescriptor(&pool_));
    CUDNN_CHECK(cudnnSetPooling2dDescriptor(pool_, CUDNN_POOLING_MAX_DETERMINISTIC, CUDNN_NOT_PROPAGATE_NAN, l.kernel_h,
                                            l.kernel_w, 0, 0, l.stride, l.stride));
    int n = 0, ch = 0, oh = 0, ow = 0;
    CUDNN_CHECK(cudnnGetPooling2dForwardOutputDim(pool_, x_.d, &n, &ch, &oh, &ow));
    MNIST_CHECK(n == b.batch && ch == l.out.c && oh == l.out.h && ow == l.out.w, ExitCode::kRuntime,
                "cuDNN's output shape for '" + l.text + "' differs from the spec's");
  }
  ~MaxPool() override { cudnnDestroyPoolingDescriptor(pool_); }

  void forward(const StepContext&) override {
    const float one = 1.0f, zero = 0.0f;
    CUDNN_CHECK(cudnnPoolingForward(c_.cudnn, pool_, &one, x_.d, b_.x, &zero, y_.d, b_.y));
  }
  void backward(const StepContext&) override {
    if (!b_.dx) return;
    const float one = 1.0f, zero = 0.0f;
    CUDNN_CHECK(cudnnPoolingBackward(c_.cudnn, pool_, &one, y_.d, b_.y, y_.d, b_.dy, x_.d, b_.x, &zero, x_.d, b_.dx));
  }
  std::string describe() const override { return "cudnn maxpool (deterministic)"; }

 private:
  Context& c_;
  LayerBuffers b_;
  TensorDesc x_, y_;
  cudnnPoolingDescriptor_t pool_ = nullptr;
};

}  // namespace

std::unique_ptr<LayerKernel> make_maxpool(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<MaxPool>(c, l, b, training);
}

}  // namespace mnist_mpi::cuda
