// Shared pieces of the CPU backend's oneDNN kernels: the engine and stream, memory wrapping of our
// fixed buffers, and the user-managed scratchpad (allocated once per primitive at build).
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include "mnist_mpi/backend/backend.hpp"

#include <optional>
#include <string>
#include <unordered_map>

namespace mnist_mpi::cpu {

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};

using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

inline dnnl::memory wrap(const Context& c, const dnnl::memory::dims& dims, tag t, const float* p) {
  return dnnl::memory({dims, dt::f32, t}, c.engine, const_cast<float*>(p));
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
