// Fully connected layer on oneDNN's inner product: y = x W^T + b with W (O, I). An input of
// shape (C, H, W) is read as (C*H*W) in C, H, W order, so no flatten copy is needed.
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

class Fc final : public BoundLayer {
 public:
  Fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) : BoundLayer(c) {
    using dims = dnnl::memory::dims;
    const auto in = static_cast<dnnl::memory::dim>(l.in.size());
    const dims src{b.batch, in}, wei{l.channels, in}, bia{l.channels}, dst{b.batch, l.channels};
    const dnnl::memory::desc src_md(src, dt::f32, tag::nc), wei_md(wei, dt::f32, tag::oi), bia_md(bia, dt::f32, tag::x),
        dst_md(dst, dt::f32, tag::nc);
    const float* bias = b.w + l.channels * in;
    dnnl::inner_product_forward::primitive_desc fwd(
        dnnl::inner_product_forward::desc(
            training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference, src_md, wei_md, bia_md,
            dst_md),
        user_scratchpad(), c.engine);
    desc_ = "fc fwd " + impl(fwd);
    fwd_ = bind<dnnl::inner_product_forward>(c, fwd,
                                             {{DNNL_ARG_SRC, wrap(c, src, tag::nc, b.x)},
                                              {DNNL_ARG_WEIGHTS, wrap(c, wei, tag::oi, b.w)},
                                              {DNNL_ARG_BIAS, wrap(c, bia, tag::x, bias)},
                                              {DNNL_ARG_DST, wrap(c, dst, tag::nc, b.y)}});
    if (!training) return;
    if (b.dx) {
      dnnl::inner_product_backward_data::primitive_desc bd(
          dnnl::inner_product_backward_data::desc(src_md, wei_md, dst_md), user_scratchpad(), c.engine, fwd);
      desc_ += ", bwd-data " + impl(bd);
      bwd_data_ = bind<dnnl::inner_product_backward_data>(c, bd,
                                                          {{DNNL_ARG_DIFF_DST, wrap(c, dst, tag::nc, b.dy)},
                                                           {DNNL_ARG_WEIGHTS, wrap(c, wei, tag::oi, b.w)},
                                                           {DNNL_ARG_DIFF_SRC, wrap(c, src, tag::nc, b.dx)}});
    }
    dnnl::inner_product_backward_weights::primitive_desc bw(
        dnnl::inner_product_backward_weights::desc(src_md, wei_md, bia_md, dst_md), user_scratchpad(), c.engine, fwd);
    desc_ += ", bwd-weights " + impl(bw);
    bwd_weights_ =
        bind<dnnl::inner_product_backward_weights>(c, bw,
                                                   {{DNNL_ARG_SRC, wrap(c, src, tag::nc, b.x)},
                                                    {DNNL_ARG_DIFF_DST, wrap(c, dst, tag::nc, b.dy)},
                                                    {DNNL_ARG_DIFF_WEIGHTS, wrap(c, wei, tag::oi, b.dw)},
                                                    {DNNL_ARG_DIFF_BIAS, wrap(c, bia, tag::x, b.dw + (bias - b.w))}});
  }
};

}  // namespace

std::unique_ptr<LayerKernel> make_fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Fc>(c, l, b, training);
}

}  // namespace mnist_mpi::cpu
