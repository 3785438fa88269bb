// ReLU on cuDNN's activation functions; backward reads the layer's input and output as cuDNN
// asks (the gradient passes where the input is positive, as on the CPU).
#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi::cuda {
namespace {

class Relu final : public LayerKernel {
 public:
  Relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool) : c_(c), b_(b) {
    t_.set(b.batch, static_cast<int>(l.in.size()), 1, 1);  // (N, C*H*W, 1, 1)
    CUDNN_CHECK(cudnnCreateActivationDescriptor(&act_));
    CUDNN_CHECK(cudnnSetActivationDescriptor(act_, CUDNN_ACTIVATION_RELU, CUDNN_NOT_PROPAGATE_NAN, 0.0));
  }
  ~Relu() override { cudnnDestroyActivationDescriptor(act_); }

  void forward(const StepContext&) override {
    const float one = 1.0f, zero = 0.0f;
    CUDNN_CHECK(cudnnActivationForward(c_.cudnn, act_, &one, t_.d, b_.x, &zero, t_.d, b_.y));
  }
  void backward(const StepContext&) override {
    if (!b_.dx) return;
    const float one = 1.0f, zero = 0.0f;
    CUDNN_CHECK(cudnnActivationBackward(c_.cudnn, act_, &one, t_.d, b_.y, t_.d, b_.dy, t_.d, b_.x, &zero, t_.d, b_.dx));
  }
  std::string describe() const override { return "cudnn relu"; }

 private:
  Context& c_;
  LayerBuffers b_;
  TensorDesc t_;
  cudnnActivationDescriptor_t act_ = nullptr;
};

}  // namespace

std::unique_ptr<LayerKernel> make_relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Relu>(c, l, b, training);
}

}  // namespace mnist_mpi::cuda
