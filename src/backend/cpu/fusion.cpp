// The CPU backend's fusion plan: one pass over a model's layers, made when the model is built
// (Backend::plan_model), that decides which layer takes over which neighbour's work. The kernels
// read their decisions from it; the work itself is in conv.cpp, pool.cpp, relu.cpp and bf16.cpp.
#include "src/backend/cpu/fusion.hpp"

#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {

// Note [The fusion plan]
// Every fusion of the CPU backend joins a max pool with the layers right before it: a chain
// conv -> ReLU -> pool or conv -> pool, the layers adjacent in the spec and all in the model being
// built (a head or tail of Note [The row-wise tail at the rank's batch] in src/train/step.cpp is
// planned alone, so nothing is fused across its edge). Any other layer between them (a batch
// norm, a dropout) breaks the chain, so no fusion ever takes a batch norm's neighbours. Per pool i,
// in this order, each under its CpuFusions switch (tests turn them off to compare):
// 1. The ReLU before it (layer i - 1), any layouts: relu_into_pool. Note [A ReLU taken over by its
//    max pool] in pool.cpp. Then, with the convolution before that ReLU (layer i - 2):
//    a. the pool writes the convolution's dy in bf16 and its bias's gradient: under bf16, in
//       training, when that convolution runs on oneDNN's bf16 kernels (not the model's first
//       layer) with its output blocked by 16, and the pool's gradient is one pass from blocked 16
//       into plain (pool_backward_tiles, exact 2 x 2, x blocked 16, y plain). Note [A pool's
//       gradient straight into bf16] in pool.cpp.
//    b. the pool computes the convolution and the ReLU in bf16: under bf16 with conv_pool_forward,
//       exact 2 x 2, x and y blocked 16, and a convolution that fits the fp32 pass (3 below) and
//       whose channels are whole blocks of 16 on a CPU with AVX512-BF16. Note [The first
//       convolution in bf16] in bf16.cpp. And then, in training with pool_gradient, the pool hands
//       its gradient (and its y, the ReLU's mask) to that convolution's weight gradient where it is
//       the own bf16 loop. Note [The first convolution's weight gradient in bf16] in bf16.cpp.
//    The fp32 fusions with a convolution (2 and 3) do not see through a ReLU.
// 2. Without a ReLU taken over, the convolution right before it: in training with pool_gradient,
//    where the pool's gradient tiles (exact 2 x 2, x blocked, y in x's layout) and the
//    convolution's weight gradient is an own loop (fp32 or bf16), the pool writes no dx and hands
//    its dy and argmax over. Note [The first convolution reads its pool's gradient] in conv.cpp.
// 3. The same convolution's forward, in training or not, with conv_pool_forward, the same tiling,
//    for a convolution on fp32 kernels (under bf16, the first layer only) that
//    first_conv_pool_fits (one input channel, stride 1, plain in, blocked out, even output). Note
//    [The first convolution and its pool in one pass] in conv.cpp.
// A kernel is built knowing its part (LayerFusion); the two ends of a conv-pool fusion share a
// ConvPoolLink for the pointers only one of them owns (the pool's argmax, the convolution's bf16 dy).
// BlockedLayouts.* in tests/test_layers.cpp compare each fusion with the layers apart, bit for bit.
FusionPlan plan_fusions(const Context& c, const ModelSpec& spec, const std::vector<Layout>& layouts, int batch,
                        int first, int end, bool training) {
  FusionPlan plan{first, end, batch, training, layouts, {}, {}, {}, first};
  const std::size_t L = spec.layers.size();
  for (const LayerSpec& l : spec.layers) plan.kinds.push_back(l.kind);
  plan.layers.assign(L, LayerFusion{});
  plan.built.assign(L, LayerBuffers{});
  const auto is = [&](int j, LayerKind k) { return j >= first && j < end && spec.layers[j].kind == k; };
  // A convolution on fp32 kernels whose forward a pool may compute (3).
  const auto fp32_first_conv = [&](int j) {
    return !(c.fuse.bf16 && j != 0) && c.fuse.conv_pool_forward &&
           first_conv_pool_fits(spec.layers[j], layouts[j], layouts[j + 1]);
  };
  const auto weight_grad = [&](int j) {
    return conv_weight_grad(c, spec.layers[j], layouts[j], layouts[j + 1], batch, j == 0);
  };
  for (int i = first; i < end; ++i) {
    if (!is(i, LayerKind::kMaxPool)) continue;
    const LayerSpec& pool = spec.layers[i];
    LayerFusion& p = plan.layers[i];
    const int bx = block_size(layouts[i]), by = block_size(layouts[i + 1]);
    const bool exact = exact_2x2(pool);
    const auto fuse_conv = [&](int j) -> LayerFusion& {
      p.conv = j;
      p.conv_spec = spec.layers[j];
      if (!p.link) p.link = std::make_shared<ConvPoolLink>();
      plan.layers[j].link = p.link;
      return plan.layers[j];
    };
    if (c.fuse.relu_into_pool && is(i - 1, LayerKind::kRelu)) {  // 1
      p.takes_relu = plan.layers[i - 1].relu_in_pool = true;
      const int j = i - 2;
      if (!is(j, LayerKind::kConv)) continue;
      const bool plain_y_tiles = training && c.fuse.pool_backward_tiles && exact && bx > 1 && by == 1;
      if (c.fuse.bf16 && plain_y_tiles && bx == 16 && j != 0 && layouts[j + 1] == Layout::kBlocked16)  // 1a
        p.writes_bf16_dy = fuse_conv(j).pool_writes_bf16_dy = true;
      if (c.fuse.bf16 && c.fuse.conv_pool_forward && exact && bx == 16 && by == 16 && fp32_first_conv(j) &&
          first_conv_relu_pool_bf16_fits(spec.layers[j])) {  // 1b
        p.computes_conv = fuse_conv(j).forward_in_pool = ConvInPool::kBf16;
        if (training && c.fuse.pool_gradient && weight_grad(j) == ConvWeightGrad::kOwnBf16)
          p.hands_gradient = fuse_conv(j).reads_pool_gradient = true;
      }
      continue;
    }
    const int j = i - 1;
    const bool tiles = exact && bx > 1 && by == bx;
    if (!tiles || !is(j, LayerKind::kConv)) continue;
    if (training && c.fuse.pool_gradient && weight_grad(j) != ConvWeightGrad::kOneDnn)  // 2
      p.hands_gradient = fuse_conv(j).reads_pool_gradient = true;
    if (fp32_first_conv(j)) p.computes_conv = fuse_conv(j).forward_in_pool = ConvInPool::kFp32;  // 3
  }
  return plan;
}

bool FusionPlan::expects(const LayerSpec& l, int index, const LayerBuffers& b, bool train) const {
  return index == next && index < end && train == training && b.batch == batch &&
         l.kind == kinds[static_cast<std::size_t>(index)] && b.x_layout == layouts[static_cast<std::size_t>(index)] &&
         b.y_layout == layouts[static_cast<std::size_t>(index) + 1];
}

LayerFusion FusionPlan::take(int index, const LayerBuffers& b) {
  const auto i = static_cast<std::size_t>(index);
  built[i] = b;
  ++next;
  LayerFusion f = layers[i];
  if (f.takes_relu) f.relu_buffers = built[i - 1];
  if (f.computes_conv != ConvInPool::kNo) f.conv_buffers = built[static_cast<std::size_t>(f.conv)];
  return f;
}

}  // namespace mnist_mpi::cpu
