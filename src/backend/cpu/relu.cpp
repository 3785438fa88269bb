// ReLU on oneDNN's eltwise primitives; backward reads the layer's input (x), as PyTorch does.
// Elementwise, so the buffers are seen as flat (N, C*H*W) whatever their layout, as long as x and
// y share it (Note [Activation layouts]).
#include "mnist_mpi/check.hpp"
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

class Relu final : public BoundLayer {
 public:
  // taken: Note [A ReLU taken over by its max pool] in src/backend/cpu/pool.cpp, decided by the
  // fusion plan (Note [The fusion plan] in fusion.cpp): the pool after it applies it, both ways.
  Relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training, bool taken)
      : BoundLayer(c), taken_(taken) {
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
  }
  void forward(const StepContext& ctx) override {
    if (!taken_) BoundLayer::forward(ctx);
  }
  void backward(const StepContext& ctx) override {
    if (!taken_) BoundLayer::backward(ctx);
  }
  std::string describe() const override {
    return taken_ ? "relu (applied by the max pool after it, both ways)" : BoundLayer::describe();
  }

 private:
  bool taken_;
};

}  // namespace

std::unique_ptr<LayerKernel> make_relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training,
                                       const LayerFusion& f) {
  return std::make_unique<Relu>(c, l, b, training, f.relu_in_pool);
}

}  // namespace mnist_mpi::cpu
