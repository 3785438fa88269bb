// Fully connected layer on oneDNN's inner product: y = x W^T + b with W (O, I). An input of
// shape (C, H, W) is read as (C*H*W) in C, H, W order, so no flatten copy is needed.
#include <algorithm>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

class Fc final : public BoundLayer {
 public:
  Fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training)
      : BoundLayer(c),
        training_(training),
        batch_(b.batch),
        in_(l.in.size()),
        out_(l.channels),
        x_(b.x),
        dy_(b.dy),
        dw_(b.dw) {
    using dims = dnnl::memory::dims;
    if (c.fuse.bf16) {  // Note [bf16 on the CPU] in src/backend/cpu/cpu_backend.cpp
      build_bf16(l, b, training);
      return;
    }
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

  // Note [A weight gradient written once as integers] in include/mnist_mpi/backend/layer.hpp. A
  // chunk's weight gradient is dy^T x (O x c times c x I); each chunk's x and dy^T are kept, and
  // finish_weight_gradient() computes it in tiles of rows_ rows of W, every chunk's tile in turn:
  // the tile (rows_ x I floats) and the integers it goes into (twice its bytes) stay in L2. The
  // bias's gradient of a chunk (the sum over its rows, in row order) is kept too and handed over
  // after the weight's.
  std::int64_t take_weight_gradient(int chunks, int chunk_rows, std::int64_t weight_offset,
                                    FixedPointSink& sink) override {
    MNIST_CHECK(dw_ != nullptr && chunks >= 1 && chunk_rows >= 1 && batch_ % chunk_rows == 0 && !x_to_bf16_,
                ExitCode::kRuntime, "fc: a weight gradient to take over (fp32, chunks that divide the batch)");
    sink_ = &sink;
    weight_offset_ = weight_offset;
    chunks_ = chunks;
    chunk_rows_ = chunk_rows;
    taken_ = 0;
    stash_x_.assign(static_cast<std::size_t>(chunks * chunk_rows_ * in_), 0.0f);
    stash_dyt_.assign(static_cast<std::size_t>(chunks * out_ * chunk_rows_), 0.0f);
    stash_db_.assign(static_cast<std::size_t>(chunks * out_), 0.0f);
    rows_ = std::clamp<std::int64_t>(kTileBytes / (in_ * 12), 1, out_);
    tile_.assign(static_cast<std::size_t>(rows_ * in_), 0.0f);
    full_ = tile_matmul(rows_);
    if (out_ % rows_ != 0) rest_ = tile_matmul(out_ % rows_);
    desc_ += ", weight gradient as integers in tiles of " + std::to_string(rows_) + " rows (" + impl_of_tile_ + ")";
    return out_ * in_ + out_;
  }

  void forward(const StepContext& ctx) override {
    if (x_to_bf16_) {
      if (w_copy_.take(copies_tracked_)) to_bf16(w_, w_bf_, out_ * in_);  // Note [Weight copies kept between passes]
      x_to_bf16_->run(c_);
    }
    BoundLayer::forward(ctx);
  }

  // A training model's copy is written where the parameters change (by their writer, or here while
  // the range is in cache); an evaluation model's is made whole by its next pass.
  PlainCopy plain_bf16_copy() const override {
    if (w_bf_ == nullptr || !training_) return {};
    return {w_, w_ + out_ * in_, w_bf_};
  }

  void parameters_changed(const float* from, const float* to, bool image_written) override {
    if (w_bf_ == nullptr) return;
    const float* lo = std::max(from, w_);
    const float* hi = std::min(to, w_ + out_ * in_);
    if (lo >= hi) return;
    if (!training_)
      w_copy_.stale = true;
    else if (!image_written)
      to_bf16(lo, w_bf_ + (lo - w_), hi - lo);
  }

  void backward(const StepContext& ctx) override {
    if (dy_to_bf16_) {
      dy_to_bf16_->run(c_);
      BoundLayer::backward(ctx);
      dw_mem_.run(c_);
      return;
    }
    if (sink_ == nullptr) return BoundLayer::backward(ctx);
    if (bwd_data_) bwd_data_->run(c_);
    const std::int64_t here = batch_ / chunk_rows_;  // chunks in this call
    MNIST_CHECK(taken_ + here <= chunks_, ExitCode::kRuntime, "fc: more chunks than were taken over since the last finish");
    std::copy(x_, x_ + batch_ * in_, stash_x_.data() + taken_ * chunk_rows_ * in_);
    // Per chunk dy^T for the tiles, and the bias gradient (the sum over the chunk's rows, in row order).
    for (std::int64_t q = 0; q < here; ++q) {
      const float* dy = dy_ + q * chunk_rows_ * out_;
      float* dyt = stash_dyt_.data() + (taken_ + q) * out_ * chunk_rows_;
      float* db = stash_db_.data() + (taken_ + q) * out_;
      for (std::int64_t o = 0; o < out_; ++o) {
        float sum = 0.0f;
        for (std::int64_t n = 0; n < chunk_rows_; ++n) {
          const float v = dy[n * out_ + o];
          dyt[o * chunk_rows_ + n] = v;
          sum += v;
        }
        db[o] = sum;
      }
    }
    taken_ += here;
  }

  void finish_weight_gradient() override {
    if (sink_ == nullptr) return;
    for (std::int64_t o0 = 0; o0 < out_; o0 += rows_) {
      const std::int64_t rows = std::min(rows_, out_ - o0);
      Bound& mm = rows == rows_ ? *full_ : *rest_;
      for (std::int64_t j = 0; j < taken_; ++j) {
        mm.args.at(DNNL_ARG_SRC).set_data_handle(stash_dyt_.data() + j * out_ * chunk_rows_ + o0 * chunk_rows_);
        mm.args.at(DNNL_ARG_WEIGHTS).set_data_handle(stash_x_.data() + j * chunk_rows_ * in_);
        mm.run(c_);
        sink_->absorb_range(weight_offset_ + o0 * in_, tile_.data(), rows * in_, j == 0);
      }
    }
    for (std::int64_t j = 0; j < taken_; ++j)
      sink_->absorb_range(weight_offset_ + out_ * in_, stash_db_.data() + j * out_, out_, j == 0);
    taken_ = 0;
  }

 private:
  // --precision bf16: inner products on bf16 copies of x, W and dy, writing fp32. W's copy and dW
  // are plain (O, I): with oneDNN's preferred blocked layouts (brgemm kernels) the two reorders of
  // lenet's fc1 weights, f32 to blocked bf16 and blocked dW back, took 2.8 ms a step, more than the
  // three products (1.5 + 0.8 + 0.7 ms against gemm:jit's 1.0 + 0.8 + 0.8 on plain ones).
  void build_bf16(const LayerSpec& l, const LayerBuffers& b, bool training) {
    using dims = dnnl::memory::dims;
    const auto in = static_cast<dnnl::memory::dim>(l.in.size());
    const dims src{b.batch, in}, wei{l.channels, in}, bia{l.channels}, dst{b.batch, l.channels};
    const dnnl::memory::desc src_bf(src, dt::bf16, tag::nc), src_f(src, dt::f32, tag::nc),
        wei_bf(wei, dt::bf16, tag::oi), wei_f(wei, dt::f32, tag::oi), bia_md(bia, dt::f32, tag::x),
        dst_f(dst, dt::f32, tag::nc), dst_bf(dst, dt::bf16, tag::nc);
    const float* bias = b.w + l.channels * in;
    const dnnl::memory user_w = wrap(c_, wei, tag::oi, b.w);
    dnnl::inner_product_forward::primitive_desc fwd(
        dnnl::inner_product_forward::desc(
            training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference, src_bf, wei_bf, bia_md,
            dst_f),
        user_scratchpad(), c_.engine);
    desc_ = "bf16 fc fwd " + impl(fwd);
    const dnnl::memory x_bf(src_bf, c_.engine);
    x_to_bf16_ = bound_reorder(c_, wrap(c_, src, tag::nc, b.x), x_bf);
    // W's plain bf16 copy, made by to_bf16 (Note [Weight copies kept between passes] in bf16.cpp).
    MNIST_CHECK(fwd.weights_desc() == wei_bf, ExitCode::kRuntime,
                "bf16 fc: oneDNN asked for other weights than plain bf16");
    w_fwd_ = {dnnl::memory(wei_bf, c_.engine), std::nullopt};  // allocated once, here
    w_ = b.w;
    w_bf_ = static_cast<std::uint16_t*>(w_fwd_.mem.get_data_handle());
    fwd_ = bind<dnnl::inner_product_forward>(c_, fwd,
                                             {{DNNL_ARG_SRC, x_bf},
                                              {DNNL_ARG_WEIGHTS, w_fwd_.mem},
                                              {DNNL_ARG_BIAS, wrap(c_, bia, tag::x, bias)},
                                              {DNNL_ARG_DST, wrap(c_, dst, tag::nc, b.y)}});
    if (!training) return;
    const dnnl::memory dy_bf(dst_bf, c_.engine);
    dy_to_bf16_ = bound_reorder(c_, wrap(c_, dst, tag::nc, b.dy), dy_bf);
    if (b.dx) {
      dnnl::inner_product_backward_data::primitive_desc bd(
          dnnl::inner_product_backward_data::desc(src_f, wei_bf, dst_bf), user_scratchpad(), c_.engine, fwd);
      desc_ += ", bwd-data " + impl(bd);
      // The same plain copy as the forward's, kept as it is (a reorder of its own would be made
      // again every backward, however current the copy).
      MNIST_CHECK(bd.weights_desc() == wei_bf, ExitCode::kRuntime,
                  "bf16 fc: oneDNN asked for other backward-data weights than plain bf16");
      bwd_data_ = bind<dnnl::inner_product_backward_data>(c_, bd,
                                                          {{DNNL_ARG_DIFF_DST, dy_bf},
                                                           {DNNL_ARG_WEIGHTS, w_fwd_.mem},
                                                           {DNNL_ARG_DIFF_SRC, wrap(c_, src, tag::nc, b.dx)}});
    }
    dnnl::inner_product_backward_weights::primitive_desc bw(
        dnnl::inner_product_backward_weights::desc(src_bf, wei_f, bia_md, dst_bf), user_scratchpad(), c_.engine, fwd);
    desc_ += ", bwd-weights " + impl(bw);
    dw_mem_ = maybe_reorder(c_, wrap(c_, wei, tag::oi, b.dw), bw.diff_weights_desc(), false);
    bwd_weights_ = bind<dnnl::inner_product_backward_weights>(
        c_, bw,
        {{DNNL_ARG_SRC, x_bf},
         {DNNL_ARG_DIFF_DST, dy_bf},
         {DNNL_ARG_DIFF_WEIGHTS, dw_mem_.mem},
         {DNNL_ARG_DIFF_BIAS, wrap(c_, bia, tag::x, b.dw + (bias - b.w))}});
  }

  MaybeReorder w_fwd_, dw_mem_;                  // --precision bf16: W's bf16 copy, dW back to (O, I)
  const float* w_ = nullptr;                     // --precision bf16: W (O, I) ...
  std::uint16_t* w_bf_ = nullptr;                // ... and its copy, in w_fwd_
  KeptCopy w_copy_;                              // w_bf_'s state between passes
  bool training_ = false;
  std::optional<Bound> x_to_bf16_, dy_to_bf16_;  // --precision bf16
  static constexpr std::int64_t kTileBytes = 512 * 1024;  // a tile's floats and its integers: 12 bytes an element

  // (rows x N) times (N x I) into the tile; the operands' pointers are set per call.
  Bound tile_matmul(std::int64_t rows) {
    const dnnl::memory::desc a({rows, chunk_rows_}, dt::f32, tag::ab), b({chunk_rows_, in_}, dt::f32, tag::ab),
        y({rows, in_}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, y), user_scratchpad(), c_.engine);
    impl_of_tile_ = impl(pd);
    return bind<dnnl::matmul>(c_, pd,
                              {{DNNL_ARG_SRC, dnnl::memory(a, c_.engine, stash_dyt_.data())},
                               {DNNL_ARG_WEIGHTS, dnnl::memory(b, c_.engine, stash_x_.data())},
                               {DNNL_ARG_DST, dnnl::memory(y, c_.engine, tile_.data())}});
  }

  std::int64_t batch_, in_, out_;
  const float* x_;
  const float* dy_;
  float* dw_;
  // --exact-sums, once the weight gradient is taken over
  FixedPointSink* sink_ = nullptr;
  std::int64_t weight_offset_ = 0, chunks_ = 0, chunk_rows_ = 0, taken_ = 0, rows_ = 0;
  std::vector<float> stash_x_, stash_dyt_, stash_db_, tile_;  // (chunks, c, I), (chunks, O, c), (chunks, O), (rows_, I)
  std::optional<Bound> full_, rest_;                // tiles of rows_ rows, and the last, shorter one
  std::string impl_of_tile_;
};

}  // namespace

std::unique_ptr<LayerKernel> make_fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Fc>(c, l, b, training);
}

}  // namespace mnist_mpi::cpu
