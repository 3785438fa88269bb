// Inverted dropout: in training y = x * mask / (1 - rate); at inference y = x. The mask is kept
// (made once at build, filled each step) for backward. Plain loops: oneDNN has no dropout.
#include <cstring>
#include <vector>

#include "mnist_mpi/rng.hpp"
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

// Note [Dropout masks do not depend on the rank]
// An element's mask bit is a pure function of (seed, global step, the sample's position in the
// GLOBAL batch, layer index, element index). A sample therefore gets the same mask whichever rank
// processes it and however the global batch is split, which is what makes 1, 2 and 3 ranks follow
// the same trajectory and a resumed run repeat the masks of the run that
// never stopped. Both backends call the same two functions, rng::dropout_key and
// rng::dropout_scale (include/mnist_mpi/rng.hpp, compiled for host and device).
class Dropout final : public LayerKernel {
 public:
  Dropout(const LayerSpec& l, int index, const LayerBuffers& b, bool training)
      : b_(b), index_(index), per_sample_(l.in.size()), rate_(l.drop_rate), training_(training) {
    if (training_) scale_.assign(static_cast<std::size_t>(b.batch * per_sample_), 0.0f);
  }

  void forward(const StepContext& ctx) override {
    const std::int64_t n_total = b_.batch * per_sample_;
    if (!ctx.training || !training_) {
      if (b_.y != b_.x) std::memcpy(b_.y, b_.x, static_cast<std::size_t>(n_total) * sizeof(float));
      return;
    }
    const float keep_scale = 1.0f / (1.0f - rate_);
    for (int n = 0; n < b_.batch; ++n) {
      const std::uint64_t sample_key = rng::dropout_key(ctx.seed, ctx.step, ctx.first_sample + n, index_);
      for (std::int64_t i = 0; i < per_sample_; ++i) {
        const std::int64_t k = n * per_sample_ + i;
        const float s = rng::dropout_scale(sample_key, i, rate_, keep_scale);
        scale_[static_cast<std::size_t>(k)] = s;
        b_.y[k] = b_.x[k] * s;
      }
    }
  }

  void backward(const StepContext&) override {
    if (!b_.dx) return;
    const std::int64_t n_total = b_.batch * per_sample_;
    for (std::int64_t k = 0; k < n_total; ++k) b_.dx[k] = b_.dy[k] * scale_[static_cast<std::size_t>(k)];
  }
  std::string describe() const override { return "dropout (counter-based mask)"; }

 private:
  LayerBuffers b_;
  int index_;
  std::int64_t per_sample_;
  float rate_;
  bool training_;
  std::vector<float> scale_;  // (N, C*H*W): 0 or 1 / (1 - rate)
};

// Flatten changes only the shape: the model aliases its output to its input (NCHW is already
// (N, C*H*W) in memory), so there is normally nothing to do.
class Flatten final : public LayerKernel {
 public:
  Flatten(const LayerSpec& l, const LayerBuffers& b) : b_(b), n_(b.batch * l.in.size()) {}
  void forward(const StepContext&) override {
    if (b_.y != b_.x) std::memcpy(b_.y, b_.x, static_cast<std::size_t>(n_) * sizeof(float));
  }
  void backward(const StepContext&) override {
    if (b_.dx && b_.dx != b_.dy) std::memcpy(b_.dx, b_.dy, static_cast<std::size_t>(n_) * sizeof(float));
  }
  std::string describe() const override { return "flatten (aliased)"; }

 private:
  LayerBuffers b_;
  std::int64_t n_;
};

}  // namespace

std::unique_ptr<LayerKernel> make_dropout(const LayerSpec& l, int index, const LayerBuffers& b, bool training) {
  return std::make_unique<Dropout>(l, index, b, training);
}
std::unique_ptr<LayerKernel> make_flatten(const LayerSpec& l, const LayerBuffers& b) {
  return std::make_unique<Flatten>(l, b);
}

}  // namespace mnist_mpi::cpu
