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
    // Note [The fc forward as a matmul]
    // oneDNN's inner product forward on our fixed (O, I) weights runs as gemm:jit, which packs the
    // whole weight matrix on every call: lenet's fc1 forward (50 x 3136 x 1024) took 3.1 ms with the
    // weights cold in cache, against 1.5 ms for its backward-data of the same FLOPs. The same
    // product as a matmul with the weights read as an (I, O) matrix in `ba` order (the same bytes)
    // runs on oneDNN's brgemm kernels where the CPU has them (AVX-512): 1.85 ms cold. It sums in
    // another order, so it is used only where it is brgemm; elsewhere (AVX2) the inner product
    // stays, and so do the bits.
    const dnnl::memory::desc mm_src(src, dt::f32, tag::ab), mm_wei({in, l.channels}, dt::f32, tag::ba),
        mm_bia({1, l.channels}, dt::f32, tag::ab), mm_dst(dst, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc mm(dnnl::matmul::desc(mm_src, mm_wei, mm_bia, mm_dst), user_scratchpad(), c.engine);
    if (impl(mm).rfind("brg", 0) == 0) {
      desc_ = "fc fwd matmul " + impl(mm);
      fwd_ = bind<dnnl::matmul>(c, mm,
                                {{DNNL_ARG_SRC, dnnl::memory(mm_src, c.engine, const_cast<float*>(b.x))},
                                 {DNNL_ARG_WEIGHTS, dnnl::memory(mm_wei, c.engine, const_cast<float*>(b.w))},
                                 {DNNL_ARG_BIAS, dnnl::memory(mm_bia, c.engine, const_cast<float*>(bias))},
                                 {DNNL_ARG_DST, dnnl::memory(mm_dst, c.engine, b.y)}});
    } else {
      desc_ = "fc fwd " + impl(fwd);
      fwd_ = bind<dnnl::inner_product_forward>(c, fwd,
                                               {{DNNL_ARG_SRC, wrap(c, src, tag::nc, b.x)},
                                                {DNNL_ARG_WEIGHTS, wrap(c, wei, tag::oi, b.w)},
                                                {DNNL_ARG_BIAS, wrap(c, bia, tag::x, bias)},
                                                {DNNL_ARG_DST, wrap(c, dst, tag::nc, b.y)}});
    }
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
