// Max pooling on oneDNN. The training forward keeps a workspace (the argmax positions) that the
// backward primitive reads; both are made once at build.
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

class MaxPool final : public BoundLayer {
 public:
  MaxPool(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) : BoundLayer(c) {
    using dims = dnnl::memory::dims;
    const dims src{b.batch, l.in.c, l.in.h, l.in.w}, dst{b.batch, l.out.c, l.out.h, l.out.w};
    const dims strides{l.stride, l.stride}, kernel{l.kernel_h, l.kernel_w}, pad{0, 0};
    const dnnl::memory::desc src_md(src, dt::f32, tag::nchw), dst_md(dst, dt::f32, tag::nchw);
    dnnl::pooling_forward::primitive_desc fwd(
        dnnl::pooling_forward::desc(training ? dnnl::prop_kind::forward_training
                                             : dnnl::prop_kind::forward_inference,
                                    dnnl::algorithm::pooling_max, src_md, dst_md, strides, kernel, pad, pad),
        user_scratchpad(), c.engine);
    desc_ = "maxpool fwd " + impl(fwd);
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, wrap(c, src, tag::nchw, b.x)},
                                               {DNNL_ARG_DST, wrap(c, dst, tag::nchw, b.y)}};
    if (training) {
      workspace_ = dnnl::memory(fwd.workspace_desc(), c.engine);
      args[DNNL_ARG_WORKSPACE] = workspace_;
    }
    fwd_ = bind<dnnl::pooling_forward>(c, fwd, args);
    if (!training || !b.dx) return;
    dnnl::pooling_backward::primitive_desc bd(
        dnnl::pooling_backward::desc(dnnl::algorithm::pooling_max, src_md, dst_md, strides, kernel, pad, pad),
        user_scratchpad(), c.engine, fwd);
    desc_ += ", bwd " + impl(bd);
    bwd_data_ = bind<dnnl::pooling_backward>(c, bd, {{DNNL_ARG_DIFF_DST, wrap(c, dst, tag::nchw, b.dy)},
                                                {DNNL_ARG_DIFF_SRC, wrap(c, src, tag::nchw, b.dx)},
                                                {DNNL_ARG_WORKSPACE, workspace_}});
  }

 private:
  dnnl::memory workspace_;
};

}  // namespace

std::unique_ptr<LayerKernel> make_maxpool(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<MaxPool>(c, l, b, training);
}

}  // namespace mnist_mpi::cpu
