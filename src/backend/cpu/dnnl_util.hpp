// Shared pieces of the CPU backend's oneDNN kernels: the engine and stream, memory wrapping of our
// fixed buffers, and the user-managed scratchpad (allocated once per primitive at build).
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/cpu.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

namespace mnist_mpi::cpu {

// What a 2 x 2 max pool hands the convolution before it instead of writing that convolution's dy
// (Note [The first convolution reads its pool's gradient] in src/backend/cpu/conv.cpp): the pool's
// dy and argmax, (N, C/B, PH, PW, B) each, argmax the offset of each window's max within its
// sample of the convolution's output. Null until a pool fills it in.
struct PooledGradient {
  const float* dy = nullptr;
  const std::int32_t* argmax = nullptr;
  // With a ReLU between them (Note [The first convolution's weight gradient in bf16] in bf16.cpp):
  // the pool's output, whose sign is the ReLU's mask; null without one.
  const float* y = nullptr;
  // Set by the convolution when it registers: whether it applies that mask (a pool after a ReLU
  // hands its gradient over only then).
  bool reads_mask = false;
};

// A first convolution (plain input of one channel, stride 1, blocked output) that a following
// 2 x 2 max pool may compute in its own pass (Note [The first convolution and its pool in one
// pass] in src/backend/cpu/conv.cpp): its input, OIHW weights and bias, and whether a pool took it.
// kernel: samples [first, first + count) of that pass, chosen once when the convolution is built
// (the AVX2 one or the portable one; block: B of the blocked layouts).
using ConvPoolKernel = void (*)(const LayerSpec& l, int block, std::int64_t first, std::int64_t count, const float* x,
                                const float* wt, const float* bias, float* y, std::int32_t* arg);
struct FirstConvForward {
  const float* x = nullptr;
  const float* w = nullptr;
  const float* bias = nullptr;
  LayerSpec l;
  bool taken = false;
  ConvPoolKernel kernel = nullptr;
};

// A ReLU that the max pool after it may take over (Note [A ReLU taken over by its max pool] in
// src/backend/cpu/pool.cpp): the ReLU's input and input gradient (null without one), and whether
// a pool took it (then the ReLU's own passes do nothing).
struct ReluBeforePool {
  const float* x = nullptr;
  float* dx = nullptr;
  bool taken = false;
};

// A bf16 convolution's output gradient that the max pool after it (and its ReLU) may write itself,
// in bf16, with the bias's gradient (Note [A pool's gradient straight into bf16] in
// src/backend/cpu/pool.cpp): where to, and whether a pool took it (then the convolution neither
// converts its fp32 dy nor sums its bias).
struct Bf16Gradient {
  std::uint16_t* dy = nullptr;  // the convolution's bf16 copy of dy, in its layout (blocked 16)
  float* db = nullptr;          // its bias's gradient
  bool taken = false;
};

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  CpuFusions fuse;  // which cross-layer fusions may run (make_cpu_backend)
  // Keyed by the dy buffer of a first convolution that can read its pool's gradient; entries are
  // made by that convolution (node-based: a pointer to one stays valid) and erased when it goes.
  std::unordered_map<const float*, PooledGradient> pooled;
  // Keyed by the y buffer of a first convolution that its pool may compute with itself; the same.
  std::unordered_map<const float*, FirstConvForward> first_conv;
  // Keyed by the y buffer of a ReLU; made by the ReLU and erased when it goes.
  std::unordered_map<const float*, ReluBeforePool> relu_before_pool;
  // Keyed by the dy buffer of a bf16 convolution with blocked output; made by it, erased when it goes.
  std::unordered_map<const float*, Bf16Gradient> bf16_gradient;
};

using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

inline dnnl::memory wrap(const Context& c, const dnnl::memory::dims& dims, tag t, const float* p) {
  return dnnl::memory({dims, dt::f32, t}, c.engine, const_cast<float*>(p));
}

// The oneDNN format tag of a 4-D activation in `layout` (Note [Activation layouts]).
inline tag tag_of(Layout layout) {
  switch (layout) {
    case Layout::kBlocked8:
      return tag::nChw8c;
    case Layout::kBlocked16:
      return tag::nChw16c;
    case Layout::kPlain:
      break;
  }
  return tag::nchw;
}

// B of a blocked layout (Note [Activation layouts]); 1 for plain.
inline int block_size(Layout layout) {
  return layout == Layout::kBlocked8 ? 8 : layout == Layout::kBlocked16 ? 16 : 1;
}

// Note [One block is NHWC]
// A blocked activation whose channels are one block, (N, 1, H, W, B) with B = C, is NHWC byte for
// byte. A convolution between two such activations of different block sizes (tiny on AVX-512: 8
// channels in nChw8c into 16 in nChw16c, Note [A block size per activation] in
// src/backend/cpu/cpu_backend.cpp) describes both to oneDNN as nhwc: for nChw8c into nChw16c
// oneDNN 2.6 has only reference kernels, for nhwc into nhwc its AVX-512 ones. Anywhere else the
// tags are the layouts' own.
inline std::pair<tag, tag> conv_tags(Layout x, int x_channels, Layout y, int y_channels) {
  if (x != y && x != Layout::kPlain && y != Layout::kPlain && block_size(x) == x_channels &&
      block_size(y) == y_channels)
    return {tag::nhwc, tag::nhwc};
  return {tag_of(x), tag_of(y)};
}

inline dnnl::primitive_attr user_scratchpad() {
  dnnl::primitive_attr a;
  a.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return a;
}

// A primitive with its arguments bound once, at build.
struct Bound {
  dnnl::primitive prim;
  std::unordered_map<int, dnnl::memory> args;
  void run(const Context& c) { prim.execute(c.stream, args); }
};

template <typename Prim, typename PD>
Bound bind(const Context& c, const PD& pd, std::unordered_map<int, dnnl::memory> args) {
  args[DNNL_ARG_SCRATCHPAD] = dnnl::memory(pd.scratchpad_desc(), c.engine);
  return Bound{Prim(pd), std::move(args)};
}

template <typename PD>
std::string impl(const PD& pd) {
  return pd.impl_info_str();
}

// A reorder between a user buffer in its fixed layout and a primitive's preferred layout of the same
// tensor, made once at build; absent when the two layouts are the same (then `mem` is the user's).
// Used for weights and weight gradients only, which are small (activations are reordered only
// into the bf16 copies of --precision bf16: bound_reorder below).
struct MaybeReorder {
  dnnl::memory mem;  // what the primitive reads or writes
  std::optional<Bound> reorder;
  void run(const Context& c) {
    if (reorder) reorder->run(c);
  }
};

// A reorder from one memory to another, bound at build (also --precision bf16: an fp32 activation
// into the bf16 copy a primitive reads).
inline Bound bound_reorder(const Context& c, const dnnl::memory& from, const dnnl::memory& to) {
  dnnl::reorder::primitive_desc pd(from, to, user_scratchpad());
  return bind<dnnl::reorder>(c, pd, {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}});
}

// to_primitive: user -> primitive's layout (before a primitive reads it); otherwise the way back.
inline MaybeReorder maybe_reorder(const Context& c, const dnnl::memory& user, const dnnl::memory::desc& prim,
                                  bool to_primitive) {
  if (user.get_desc() == prim) return {user, std::nullopt};
  dnnl::memory m(prim, c.engine);  // allocated once, here
  return {m, to_primitive ? bound_reorder(c, user, m) : bound_reorder(c, m, user)};
}

// The weights a backward-data primitive reads: the forward's copy (fwd) where the primitive wants
// that layout, which then costs no reorder of its own, else the user's weights reordered for it.
inline MaybeReorder weights_for_backward_data(const Context& c, const MaybeReorder& fwd, const dnnl::memory& user,
                                              const dnnl::memory::desc& want) {
  if (want == fwd.mem.get_desc()) return {fwd.mem, std::nullopt};
  return maybe_reorder(c, user, want, true);
}

// A layer made of bound primitives: forward, and for training an optional backward-data
// (absent for the first layer) and an optional backward-weights (absent without parameters).
class BoundLayer : public LayerKernel {
 public:
  explicit BoundLayer(Context& c) : c_(c) {}
  void forward(const StepContext&) override { fwd_.run(c_); }
  void backward(const StepContext&) override {
    if (bwd_data_) bwd_data_->run(c_);
    if (bwd_weights_) bwd_weights_->run(c_);
  }
  std::string describe() const override { return desc_; }

 protected:
  Context& c_;
  Bound fwd_;
  std::optional<Bound> bwd_data_, bwd_weights_;
  std::string desc_;
};

}  // namespace mnist_mpi::cpu
