// Max pooling (no padding) as plain loops over NCHW or blocked nChwBc input (Note [Activation
// layouts]): forward keeps the argmax of every window (made once at build) and backward scatters
// dy there. See Note [Why pooling is not oneDNN here].
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

// Note [Why pooling is not oneDNN here]
// On plain NCHW tensors oneDNN 2.6 has only its `simple_nchw` pooling, which measured (ONEDNN_VERBOSE,
// tiny, batch 128, one thread) 11.8 ms forward and 5.0 ms backward for the first pool alone: more
// than the two convolutions together. Its jit pooling needs blocked layouts, and the last pool
// before flatten must also turn blocked into plain. These loops do both: blocked input is read one
// channel block at a time (the innermost loop runs over the B channels of a block, contiguous in
// memory), and the output is written in its own layout, plain or blocked, for free. The argmax
// kept per output element is the offset of the max within its sample's input, so backward is the
// same scatter for every layout. The layer tests check every layout combination against the
// double reference and finite differences like every other kernel.
int block_of(Layout layout) {
  switch (layout) {
    case Layout::kBlocked8: return 8;
    case Layout::kBlocked16: return 16;
    case Layout::kPlain: break;
  }
  return 1;
}

class MaxPool final : public LayerKernel {
 public:
  MaxPool(const LayerSpec& l, const LayerBuffers& b, bool training)
      : l_(l), b_(b), in_sample_(l.in.size()), out_sample_(l.out.size()),
        bx_(block_of(b.x_layout)), by_(block_of(b.y_layout)) {
    MNIST_CHECK(l.in.c % bx_ == 0 && l.out.c % by_ == 0 && (bx_ == by_ || by_ == 1), ExitCode::kRuntime,
                "maxpool: unsupported layouts for " + l.text);
    if (training) argmax_.assign(static_cast<std::size_t>(b.batch * out_sample_), 0);
  }

  void forward(const StepContext&) override {
    if (bx_ == 1)
      forward_plain();
    else if (bx_ == 8)
      forward_blocked<8>();
    else
      forward_blocked<16>();
  }

  void backward(const StepContext&) override {
    if (!b_.dx) return;
    std::memset(b_.dx, 0, static_cast<std::size_t>(b_.batch * in_sample_) * sizeof(float));
    for (std::int64_t n = 0; n < b_.batch; ++n) {
      float* dx = b_.dx + n * in_sample_;  // one sample, in x's layout
      const float* dy = b_.dy + n * out_sample_;
      const std::int32_t* arg = argmax_.data() + n * out_sample_;
      for (std::int64_t o = 0; o < out_sample_; ++o) dx[arg[o]] += dy[o];
    }
  }
  std::string describe() const override {
    return "maxpool (plain loops, argmax kept; x block " + std::to_string(bx_) + ", y block " +
           std::to_string(by_) + ")";
  }

 private:
  // x and y plain (N, C, H, W).
  void forward_plain() {
    const int ih = l_.in.h, iw = l_.in.w, oh = l_.out.h, ow = l_.out.w, k_h = l_.kernel_h, k_w = l_.kernel_w,
              s = l_.stride;
    const bool keep = !argmax_.empty();
    const std::int64_t planes = static_cast<std::int64_t>(b_.batch) * l_.in.c;
    for (std::int64_t p = 0; p < planes; ++p) {
      const std::int64_t base = (p % l_.in.c) * ih * iw;  // the plane's offset within its sample
      const float* x = b_.x + p * ih * iw;                // (H, W) of one (n, c)
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
          if (keep) arg[i * ow + j] = static_cast<std::int32_t>(base + best_at);
        }
    }
  }

  // x blocked (N, C/B, H, W, B); y blocked the same way or plain.
  template <int B>
  void forward_blocked() {
    const int ih = l_.in.h, iw = l_.in.w, oh = l_.out.h, ow = l_.out.w, k_h = l_.kernel_h, k_w = l_.kernel_w,
              s = l_.stride, cb_count = l_.in.c / B;
    const bool keep = !argmax_.empty(), y_blocked = by_ != 1;
    for (int n = 0; n < b_.batch; ++n)
      for (int cb = 0; cb < cb_count; ++cb) {
        const std::int64_t base = static_cast<std::int64_t>(cb) * ih * iw * B;  // within the sample
        const float* x = b_.x + n * in_sample_ + base;                          // (H, W, B)
        float* y = b_.y + n * out_sample_;
        std::int32_t* arg = keep ? argmax_.data() + n * out_sample_ : nullptr;
        for (int i = 0; i < oh; ++i)
          for (int j = 0; j < ow; ++j) {
            float best[B];
            std::int32_t best_at[B];
            const int first = (i * s * iw + j * s) * B;
            for (int c = 0; c < B; ++c) {
              best[c] = x[first + c];
              best_at[c] = first + c;
            }
            for (int u = 0; u < k_h; ++u)
              for (int v = 0; v < k_w; ++v) {
                const int at = ((i * s + u) * iw + j * s + v) * B;
                // Branch-free so that it vectorises B wide; the first maximum wins ties.
#pragma omp simd
                for (int c = 0; c < B; ++c) {
                  const float xv = x[at + c];
                  const std::int32_t more = -static_cast<std::int32_t>(xv > best[c]);  // all ones or zero
                  best_at[c] = (best_at[c] & ~more) | ((at + c) & more);
                  best[c] = xv > best[c] ? xv : best[c];
                }
              }
            for (int c = 0; c < B; ++c) {
              const std::int64_t o = y_blocked ? (static_cast<std::int64_t>(cb) * oh * ow + i * ow + j) * B + c
                                               : (static_cast<std::int64_t>(cb * B + c) * oh + i) * ow + j;
              y[o] = best[c];
              if (keep) arg[o] = static_cast<std::int32_t>(base + best_at[c]);
            }
          }
      }
  }

  LayerSpec l_;
  LayerBuffers b_;
  std::int64_t in_sample_, out_sample_;
  int bx_, by_;
  std::vector<std::int32_t> argmax_;  // in y's order: offset of the max within its sample's x
};

}  // namespace

std::unique_ptr<LayerKernel> make_maxpool(const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<MaxPool>(l, b, training);
}

}  // namespace mnist_mpi::cpu
