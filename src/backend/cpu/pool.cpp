// Max pooling (no padding) as plain loops over NCHW: forward keeps the argmax of every window
// (made once at build) and backward scatters dy there. See Note [Why pooling is not oneDNN here].
#include <cstring>
#include <limits>
#include <vector>

#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

// Note [Why pooling is not oneDNN here]
// On plain NCHW tensors oneDNN 2.6 has only its `simple_nchw` pooling, which measured (ONEDNN_VERBOSE,
// tiny, batch 128, one thread) 11.8 ms forward and 5.0 ms backward for the first pool alone: more
// than the two convolutions together. Its jit pooling needs blocked layouts (nChw8c), which would
// mean reorders around every pool. These loops do the same work in a fraction of that; the layer
// tests check them against the double reference and finite differences like every other kernel.
class MaxPool final : public LayerKernel {
 public:
  MaxPool(const LayerSpec& l, const LayerBuffers& b, bool training)
      : l_(l), b_(b), planes_(static_cast<std::int64_t>(b.batch) * l.in.c) {
    if (training) argmax_.assign(static_cast<std::size_t>(planes_ * l.out.h * l.out.w), 0);
  }

  void forward(const StepContext&) override {
    const int ih = l_.in.h, iw = l_.in.w, oh = l_.out.h, ow = l_.out.w, k_h = l_.kernel_h, k_w = l_.kernel_w,
              s = l_.stride;
    const bool keep = !argmax_.empty();
    for (std::int64_t p = 0; p < planes_; ++p) {
      const float* x = b_.x + p * ih * iw;  // (H, W) of one (n, c)
      float* y = b_.y + p * oh * ow;
      std::int32_t* arg = keep ? argmax_.data() + p * oh * ow : nullptr;
      for (int i = 0; i < oh; ++i)
        for (int j = 0; j < ow; ++j) {
          int best_at = i * s * iw + j * s;
          float best = x[best_at];
          for (int u = 0; u < k_h; ++u)
            for (int v = 0; v < k_w; ++v) {
              const int at = (i * s + u) * iw + j * s + v;
              if (x[at] > best) {  // the first maximum wins ties, as in oneDNN and PyTorch
                best = x[at];
                best_at = at;
              }
            }
          y[i * ow + j] = best;
          if (keep) arg[i * ow + j] = best_at;
        }
    }
  }

  void backward(const StepContext&) override {
    if (!b_.dx) return;
    const std::int64_t in_plane = static_cast<std::int64_t>(l_.in.h) * l_.in.w;
    const std::int64_t out_plane = static_cast<std::int64_t>(l_.out.h) * l_.out.w;
    std::memset(b_.dx, 0, static_cast<std::size_t>(planes_ * in_plane) * sizeof(float));
    for (std::int64_t p = 0; p < planes_; ++p) {
      float* dx = b_.dx + p * in_plane;
      const float* dy = b_.dy + p * out_plane;
      const std::int32_t* arg = argmax_.data() + p * out_plane;
      for (std::int64_t o = 0; o < out_plane; ++o) dx[arg[o]] += dy[o];
    }
  }
  std::string describe() const override { return "maxpool (plain loops, argmax kept)"; }

 private:
  LayerSpec l_;
  LayerBuffers b_;
  std::int64_t planes_;
  std::vector<std::int32_t> argmax_;  // (N, C, OH, OW): flat index of the max within its (H, W) plane
};

}  // namespace

std::unique_ptr<LayerKernel> make_maxpool(const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<MaxPool>(l, b, training);
}

}  // namespace mnist_mpi::cpu
