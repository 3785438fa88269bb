// Shared pieces of the CPU backend's oneDNN kernels: the engine and stream, memory wrapping of our
// fixed buffers, and the user-managed scratchpad (allocated once per primitive at build).
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/cpu.hpp"

#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

namespace mnist_mpi::cpu {

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  CpuFusions fuse;  // which cross-layer fusions may run (make_cpu_backend; Note [The fusion plan] in fusion.cpp)
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
