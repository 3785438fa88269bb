// The CPU backend's cross-layer fusions, decided once per model (Note [The fusion plan] in
// fusion.cpp): which layer takes over which of its neighbours' work, and what the two hand each
// other at run time. The kernels that do the work are in conv.cpp, pool.cpp, relu.cpp and bf16.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/cpu.hpp"

namespace mnist_mpi::cpu {

struct Context;  // src/backend/cpu/dnnl_util.hpp

// What a 2 x 2 max pool hands the convolution before it instead of writing that convolution's dy
// (Note [The first convolution reads its pool's gradient] in src/backend/cpu/conv.cpp): the pool's
// dy and argmax, (N, C/B, PH, PW, B) each, argmax the offset of each window's max within its
// sample of the convolution's output; with a ReLU between them (Note [The first convolution's
// weight gradient in bf16] in bf16.cpp) y, the pool's output, whose sign is the ReLU's mask (null
// without one).
struct PooledGradient {
  const float* dy = nullptr;
  const std::int32_t* argmax = nullptr;
  const float* y = nullptr;
};

// A first convolution (plain input of one channel, stride 1, blocked output) that the following
// 2 x 2 max pool computes in its own pass (Note [The first convolution and its pool in one pass]
// in src/backend/cpu/conv.cpp): its input, OIHW weights and bias, and the pass's kernel for samples
// [first, first + count), chosen once at build (the AVX2 one or the portable one; block: B of the
// blocked layouts).
using ConvPoolKernel = void (*)(const LayerSpec& l, int block, std::int64_t first, std::int64_t count, const float* x,
                                const float* wt, const float* bias, float* y, std::int32_t* arg);
struct FirstConvForward {
  const float* x = nullptr;
  const float* w = nullptr;
  const float* bias = nullptr;
  LayerSpec l;
  ConvPoolKernel kernel = nullptr;
};

// What a convolution and the max pool after it (a ReLU between them or not) hand each other at run
// time, where the plan fused them: each side writes its part when it is built, the other reads it
// in its passes (a model builds every layer before any pass runs). Both hold it.
struct ConvPoolLink {
  PooledGradient pooled;             // written by the pool (LayerFusion::hands_gradient)
  std::uint16_t* dy_bf16 = nullptr;  // written by the convolution (LayerFusion::writes_bf16_dy): its bf16
  float* db = nullptr;               // copy of dy (blocked 16) and its bias's gradient
};

// How a max pool computes the convolution before it (LayerFusion::computes_conv).
enum class ConvInPool {
  kNo,
  kFp32,  // Note [The first convolution and its pool in one pass] (conv.cpp)
  kBf16,  // Note [The first convolution in bf16] (bf16.cpp), the ReLU between them too
};

// One layer's part in the plan; all false for a layer that no fusion touches (and for a layer
// built without a plan: Backend::make_layer alone).
struct LayerFusion {
  // A ReLU: taken over by the max pool after it, its own passes do nothing.
  bool relu_in_pool = false;
  // A convolution:
  ConvInPool forward_in_pool = ConvInPool::kNo;  // the pool after it computes its forward
  bool reads_pool_gradient = false;              // its weight gradient reads link->pooled, not dy
  bool pool_writes_bf16_dy = false;              // the pool writes link->dy_bf16 and link->db
  // A max pool:
  bool takes_relu = false;                     // of the layer before it
  ConvInPool computes_conv = ConvInPool::kNo;  // of layer `conv`
  bool hands_gradient = false;                 // writes no dx; fills link->pooled instead
  bool writes_bf16_dy = false;                 // backward writes link->dy_bf16 and link->db
  int conv = -1;                               // the convolution it is fused with (-1: none)
  // Shared by a convolution and its pool where any of the conv-pool fusions above holds.
  std::shared_ptr<ConvPoolLink> link;
  // Filled in as the pool is built (FusionPlan::take): the buffers of the ReLU it takes over and of
  // the convolution it computes, and that convolution.
  LayerBuffers relu_buffers, conv_buffers;
  LayerSpec conv_spec;
};

// The fusions of one model build: layers [first, end) of a spec, at one batch, with its
// activation layouts and training or not (Note [The fusion plan] in fusion.cpp).
struct FusionPlan {
  int first = 0, end = 0, batch = 0;
  bool training = false;
  std::vector<Layout> layouts;
  std::vector<LayerKind> kinds;
  std::vector<LayerFusion> layers;  // one a layer of the spec
  std::vector<LayerBuffers> built;  // the buffers of the layers built so far
  int next = 0;                     // the next layer make_layer should be asked for

  // Whether layer `index` with these buffers is the next layer of this build.
  bool expects(const LayerSpec& l, int index, const LayerBuffers& b, bool training) const;
  // Layer index's fusions, with the buffers of the layers it takes over; records b.
  LayerFusion take(int index, const LayerBuffers& b);
};

FusionPlan plan_fusions(const Context& c, const ModelSpec& spec, const std::vector<Layout>& layouts, int batch,
                        int first, int end, bool training);

}  // namespace mnist_mpi::cpu
