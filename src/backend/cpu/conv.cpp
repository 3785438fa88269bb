// 2-D convolution on oneDNN: forward, backward-data and backward-weights (with bias) primitives
// made once for the layer's shapes and buffers. Tensors are plain NCHW / OIHW, the layout of the
// flat parameter buffer and of the checkpoint.
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

class Conv final : public BoundLayer {
 public:
  Conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) : BoundLayer(c) {
    using dims = dnnl::memory::dims;
    const dims src{b.batch, l.in.c, l.in.h, l.in.w};          // (N, C, H, W)
    const dims wei{l.channels, l.in.c, l.kernel_h, l.kernel_w};  // (O, I, KH, KW)
    const dims bia{l.channels};                                  // (O)
    const dims dst{b.batch, l.out.c, l.out.h, l.out.w};       // (N, O, OH, OW)
    const dims strides{l.stride, l.stride}, pad_l{l.pad_top, l.pad_left}, pad_r{l.pad_bottom, l.pad_right};
    const dnnl::memory::desc src_md(src, dt::f32, tag::nchw), wei_md(wei, dt::f32, tag::oihw),
        bia_md(bia, dt::f32, tag::x), dst_md(dst, dt::f32, tag::nchw);
    const float* w = b.w;
    const float* bias = b.w + l.channels * l.in.c * l.kernel_h * l.kernel_w;

    dnnl::convolution_forward::primitive_desc fwd(
        dnnl::convolution_forward::desc(training ? dnnl::prop_kind::forward_training
                                                 : dnnl::prop_kind::forward_inference,
                                        dnnl::algorithm::convolution_direct, src_md, wei_md, bia_md,
                                        dst_md, strides, pad_l, pad_r),
        user_scratchpad(), c.engine);
    desc_ = "conv fwd " + impl(fwd);
    fwd_ = bind<dnnl::convolution_forward>(c, fwd, {{DNNL_ARG_SRC, wrap(c, src, tag::nchw, b.x)},
                                                    {DNNL_ARG_WEIGHTS, wrap(c, wei, tag::oihw, w)},
                                                    {DNNL_ARG_BIAS, wrap(c, bia, tag::x, bias)},
                                                    {DNNL_ARG_DST, wrap(c, dst, tag::nchw, b.y)}});
    if (!training) return;
    if (b.dx) {  // the first layer computes no input gradient
      dnnl::convolution_backward_data::primitive_desc bd(
          dnnl::convolution_backward_data::desc(dnnl::algorithm::convolution_direct, src_md, wei_md,
                                                dst_md, strides, pad_l, pad_r),
          user_scratchpad(), c.engine, fwd);
      desc_ += ", bwd-data " + impl(bd);
      bwd_data_ = bind<dnnl::convolution_backward_data>(
          c, bd, {{DNNL_ARG_DIFF_DST, wrap(c, dst, tag::nchw, b.dy)},
                  {DNNL_ARG_WEIGHTS, wrap(c, wei, tag::oihw, w)},
                  {DNNL_ARG_DIFF_SRC, wrap(c, src, tag::nchw, b.dx)}});
    }
    float* dbias = b.dw + (bias - w);
    dnnl::convolution_backward_weights::primitive_desc bw(
        dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src_md, wei_md,
                                                 bia_md, dst_md, strides, pad_l, pad_r),
        user_scratchpad(), c.engine, fwd);
    desc_ += ", bwd-weights " + impl(bw);
    bwd_weights_ = bind<dnnl::convolution_backward_weights>(
        c, bw, {{DNNL_ARG_SRC, wrap(c, src, tag::nchw, b.x)},
                {DNNL_ARG_DIFF_DST, wrap(c, dst, tag::nchw, b.dy)},
                {DNNL_ARG_DIFF_WEIGHTS, wrap(c, wei, tag::oihw, b.dw)},
                {DNNL_ARG_DIFF_BIAS, wrap(c, bia, tag::x, dbias)}});
  }
};

}  // namespace

std::unique_ptr<LayerKernel> make_conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Conv>(c, l, b, training);
}

}  // namespace mnist_mpi::cpu
