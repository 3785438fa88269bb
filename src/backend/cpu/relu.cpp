// ReLU on oneDNN's eltwise primitives; backward reads the layer's input (x), as PyTorch does.
// Elementwise, so the buffers are seen as flat (N, C*H*W) whatever their layout, as long as x and
// y share it (Note [Activation layouts]).
#include "mnist_mpi/check.hpp"
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

class Relu final : public BoundLayer {
 public:
  Relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) : BoundLayer(c) {
    MNIST_CHECK(b.x_layout == b.y_layout, ExitCode::kRuntime, "relu: input and output layouts differ");
    const dnnl::memory::dims d{b.batch, static_cast<dnnl::memory::dim>(l.in.size())};  // (N, C*H*W)
    const dnnl::memory::desc md(d, dt::f32, tag::nc);
    dnnl::eltwise_forward::primitive_desc fwd(
        dnnl::eltwise_forward::desc(training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference,
                                    dnnl::algorithm::eltwise_relu, md, 0.0f),
        user_scratchpad(), c.engine);
    desc_ = "relu fwd " + impl(fwd);
    fwd_ = bind<dnnl::eltwise_forward>(
        c, fwd, {{DNNL_ARG_SRC, wrap(c, d, tag::nc, b.x)}, {DNNL_ARG_DST, wrap(c, d, tag::nc, b.y)}});
    if (training && b.dx) {
      dnnl::eltwise_backward::primitive_desc bd(
          dnnl::eltwise_backward::desc(dnnl::algorithm::eltwise_relu, md, md, 0.0f), user_scratchpad(), c.engine, fwd);
      desc_ += ", bwd " + impl(bd);
      bwd_data_ = bind<dnnl::eltwise_backward>(c, bd,
                                               {{DNNL_ARG_SRC, wrap(c, d, tag::nc, b.x)},
                                                {DNNL_ARG_DIFF_DST, wrap(c, d, tag::nc, b.dy)},
                                                {DNNL_ARG_DIFF_SRC, wrap(c, d, tag::nc, b.dx)}});
    }
    // Offered last, once nothing above can throw: an entry is erased only by a built ReLU.
    if (c.fuse.relu_into_pool) {  // Note [A ReLU taken over by its max pool] in src/backend/cpu/pool.cpp
      fused_ = &c.relu_before_pool[b.y];
      *fused_ = ReluBeforePool{b.x, b.dx, false};  // b.dx: null in an inference model
      y_ = b.y;
    }
  }
  ~Relu() override {
    if (fused_) c_.relu_before_pool.erase(y_);
  }
  void forward(const StepContext& ctx) override {
    if (!taken()) BoundLayer::forward(ctx);
  }
  void backward(const StepContext& ctx) override {
    if (!taken()) BoundLayer::backward(ctx);
  }
  std::string describe() const override {
    return taken() ? "relu (applied by the max pool after it, both ways)" : BoundLayer::describe();
  }

 private:
  bool taken() const { return fused_ && fused_->taken; }
  ReluBeforePool* fused_ = nullptr;  // in c_.relu_before_pool, when a pool after it may take it over
  const float* y_ = nullptr;
};

}  // namespace

std::unique_ptr<LayerKernel> make_relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Relu>(c, l, b, training);
}

}  // namespace mnist_mpi::cpu
