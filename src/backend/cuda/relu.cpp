// ReLU: our own kernels, y = x > 0 ? x : 0 and dx = dy * (x <= 0 ? 0 : 1), the CPU's bits for every
// input, signed zeros and NaNs included (Note [The ReLU, bit for bit] in kernels.cu).
#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi::cuda {
namespace {

class Relu final : public LayerKernel {
 public:
  Relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool) : c_(c), b_(b), n_(b.batch * l.in.size()) {}

  void forward(const StepContext&) override { launch_relu_forward(c_.stream, b_.x, b_.y, n_); }
  void backward(const StepContext&) override {
    if (b_.dx) launch_relu_backward(c_.stream, b_.x, b_.dy, b_.dx, n_);
  }
  std::string describe() const override { return "relu (own kernels, the CPU's bits)"; }

 private:
  Context& c_;
  LayerBuffers b_;
  std::int64_t n_;  // elements of x in the batch
};

}  // namespace

std::unique_ptr<LayerKernel> make_relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Relu>(c, l, b, training);
}

}  // namespace mnist_mpi::cuda
