// 2-D convolution on oneDNN: forward, backward-data and backward-weights (with bias) primitives
// made once for the layer's shapes and buffers. Activations come in the layouts the backend chose
// (Note [Activation layouts]); weights are OIHW in the flat buffers and the checkpoint, reordered
// into the kernel's preferred layout once per step. See Note [Blocked convolutions].
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

// Note [Blocked convolutions]
// On plain NCHW tensors oneDNN 2.6 runs convolutions as im2col + sgemm (`gemm:jit`); measured for
// lenet's conv2 (32 -> 64 channels, 5x5, 14x14, batch 50, one thread) at ~33 ms for each of forward,
// backward-data and backward-weights. With blocked activations (nChw8c / nChw16c) and the weights'
// format left to oneDNN (`any`), it picks its direct jit convolutions, which need no im2col buffer.
// The weights change every step, so they are reordered OIHW -> the kernel's layout in forward
// (backward-data reuses that copy when it wants the same layout: the weights do not change between
// a forward and its backward), and the weight gradient is reordered back into the flat gradient
// buffer after backward-weights. These reorders touch the weights only (lenet conv2: 51,200 floats),
// never the activations.
class Conv final : public LayerKernel {
 public:
  Conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) : c_(c) {
    using dims = dnnl::memory::dims;
    const dims src{b.batch, l.in.c, l.in.h, l.in.w};             // (N, C, H, W)
    const dims wei{l.channels, l.in.c, l.kernel_h, l.kernel_w};  // (O, I, KH, KW)
    const dims bia{l.channels};                                  // (O)
    const dims dst{b.batch, l.out.c, l.out.h, l.out.w};          // (N, O, OH, OW)
    const dims strides{l.stride, l.stride}, pad_l{l.pad_top, l.pad_left}, pad_r{l.pad_bottom, l.pad_right};
    const tag src_tag = tag_of(b.x_layout), dst_tag = tag_of(b.y_layout);
    const dnnl::memory::desc src_md(src, dt::f32, src_tag), wei_any(wei, dt::f32, tag::any),
        bia_md(bia, dt::f32, tag::x), dst_md(dst, dt::f32, dst_tag);
    const float* bias = b.w + l.channels * l.in.c * l.kernel_h * l.kernel_w;
    const dnnl::memory user_w = wrap(c, wei, tag::oihw, b.w);

    dnnl::convolution_forward::primitive_desc fwd(
        dnnl::convolution_forward::desc(training ? dnnl::prop_kind::forward_training
                                                 : dnnl::prop_kind::forward_inference,
                                        dnnl::algorithm::convolution_direct, src_md, wei_any, bia_md,
                                        dst_md, strides, pad_l, pad_r),
        user_scratchpad(), c.engine);
    desc_ = "conv fwd " + impl(fwd);
    w_fwd_ = maybe_reorder(c, user_w, fwd.weights_desc(), true);
    fwd_ = bind<dnnl::convolution_forward>(c, fwd, {{DNNL_ARG_SRC, wrap(c, src, src_tag, b.x)},
                                                    {DNNL_ARG_WEIGHTS, w_fwd_.mem},
                                                    {DNNL_ARG_BIAS, wrap(c, bia, tag::x, bias)},
                                                    {DNNL_ARG_DST, wrap(c, dst, dst_tag, b.y)}});
    if (!training) return;
    if (b.dx) {  // the first layer computes no input gradient
      dnnl::convolution_backward_data::primitive_desc bd(
          dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, src_md, wei_any,
                                                dst_md, strides, pad_l, pad_r),
          user_scratchpad(), c.engine, fwd);
      desc_ += ", bwd-data " + impl(bd);
      if (bd.weights_desc() == fwd.weights_desc())
        w_bwd_ = MaybeReorder{w_fwd_.mem, std::nullopt};  // forward's copy (see the Note)
      else
        w_bwd_ = maybe_reorder(c, user_w, bd.weights_desc(), true);
      bwd_data_ = bind<dnnl::convolution_backward_data>(
          c, bd, {{DNNL_ARG_DIFF_DST, wrap(c, dst, dst_tag, b.dy)},
                  {DNNL_ARG_WEIGHTS, w_bwd_.mem},
                  {DNNL_ARG_DIFF_SRC, wrap(c, src, src_tag, b.dx)}});
    }
    float* dbias = b.dw + (bias - b.w);
    dnnl::convolution_backward_weights::primitive_desc bw(
        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_md, wei_any,
                                                 bia_md, dst_md, strides, pad_l, pad_r),
        user_scratchpad(), c.engine, fwd);
    desc_ += ", bwd-weights " + impl(bw);
    dw_ = maybe_reorder(c, wrap(c, wei, tag::oihw, b.dw), bw.diff_weights_desc(), false);
    bwd_weights_ = bind<dnnl::convolution_backward_weights>(
        c, bw, {{DNNL_ARG_SRC, wrap(c, src, src_tag, b.x)},
                {DNNL_ARG_DIFF_DST, wrap(c, dst, dst_tag, b.dy)},
                {DNNL_ARG_DIFF_WEIGHTS, dw_.mem},
                {DNNL_ARG_DIFF_BIAS, wrap(c, bia, tag::x, dbias)}});
  }

  void forward(const StepContext&) override {
    w_fwd_.run(c_);
    fwd_.run(c_);
  }
  void backward(const StepContext&) override {
    if (bwd_data_) {
      w_bwd_.run(c_);
      bwd_data_->run(c_);
    }
    bwd_weights_->run(c_);
    dw_.run(c_);
  }
  std::string describe() const override { return desc_; }

 private:
  Context& c_;
  MaybeReorder w_fwd_, w_bwd_, dw_;
  Bound fwd_;
  std::optional<Bound> bwd_data_, bwd_weights_;
  std::string desc_;
};

}  // namespace

std::unique_ptr<LayerKernel> make_conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Conv>(c, l, b, training);
}

}  // namespace mnist_mpi::cpu
