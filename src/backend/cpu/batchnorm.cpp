// Batch normalisation (Ioffe and Szegedy, 2015), per channel over the batch and the plane: in
// training y = (x - mean) / sqrt(var + eps) * scale + shift with the batch's mean and biased
// variance, and the running statistics move toward them (running = (1 - momentum) * running +
// momentum * batch, the variance unbiased: PyTorch's BatchNorm2d); at inference the running
// statistics take their place. After an fc the plane is one value: BatchNorm1d. Plain layouts
// only (the backend keeps a batch norm's activations plain: Note [Activation layouts]), sums in
// double, one channel at a time; no cross-layer fusion takes a batch norm's neighbours.
#include <cmath>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi::cpu {
namespace {

class BatchNorm final : public LayerKernel {
 public:
  BatchNorm(const LayerSpec& l, const LayerBuffers& b, bool training)
      : b_(b),
        channels_(l.in.c),
        plane_(static_cast<std::int64_t>(l.in.h) * l.in.w),
        momentum_(l.momentum),
        eps_(l.eps),
        training_(training) {
    MNIST_CHECK(b.x_layout == Layout::kPlain && b.y_layout == Layout::kPlain && b.w && b.state, ExitCode::kRuntime,
                "batch norm: plain activations, its scale and shift, and its running statistics are needed");
    mean_.assign(static_cast<std::size_t>(channels_), 0.0f);
    inv_std_.assign(static_cast<std::size_t>(channels_), 0.0f);
  }

  void forward(const StepContext& ctx) override {
    const float* scale = b_.w;
    const float* shift = b_.w + channels_;
    float* running_mean = b_.state;
    float* running_var = b_.state + channels_;
    const bool batch_stats = ctx.training && training_;
    const double m = static_cast<double>(b_.batch) * static_cast<double>(plane_);
    for (int c = 0; c < channels_; ++c) {
      float mean = running_mean[c], var = running_var[c];
      if (batch_stats) {
        double sum = 0.0;
        for_plane(c, [&](std::int64_t at) { sum += b_.x[at]; });
        const double mu = sum / m;
        double sq = 0.0;
        for_plane(c, [&](std::int64_t at) {
          const double d = b_.x[at] - mu;
          sq += d * d;
        });
        const double biased = sq / m;
        mean = static_cast<float>(mu);
        var = static_cast<float>(biased);
        const double unbiased = m > 1.0 ? sq / (m - 1.0) : biased;
        running_mean[c] = static_cast<float>((1.0 - momentum_) * running_mean[c] + momentum_ * mu);
        running_var[c] = static_cast<float>((1.0 - momentum_) * running_var[c] + momentum_ * unbiased);
      }
      const float inv_std = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var) + eps_));
      mean_[static_cast<std::size_t>(c)] = mean;
      inv_std_[static_cast<std::size_t>(c)] = inv_std;
      const float a = scale[c] * inv_std, bias = shift[c] - mean * a;
      for_plane(c, [&](std::int64_t at) { b_.y[at] = b_.x[at] * a + bias; });
    }
  }

  // With x_hat = (x - mean) * inv_std: d shift = sum dy, d scale = sum dy * x_hat, and
  // dx = scale * inv_std / m * (m * dy - d shift - x_hat * d scale).
  void backward(const StepContext&) override {
    const float* scale = b_.w;
    const double m = static_cast<double>(b_.batch) * static_cast<double>(plane_);
    for (int c = 0; c < channels_; ++c) {
      const float mean = mean_[static_cast<std::size_t>(c)], inv_std = inv_std_[static_cast<std::size_t>(c)];
      double dshift = 0.0, dscale = 0.0;
      for_plane(c, [&](std::int64_t at) {
        dshift += b_.dy[at];
        dscale += static_cast<double>(b_.dy[at]) * ((b_.x[at] - mean) * inv_std);
      });
      b_.dw[c] = static_cast<float>(dscale);
      b_.dw[channels_ + c] = static_cast<float>(dshift);
      if (!b_.dx) continue;
      const float k = static_cast<float>(scale[c] * inv_std / m);
      const float mean_dy = static_cast<float>(dshift), mean_dy_xhat = static_cast<float>(dscale);
      const float fm = static_cast<float>(m);
      for_plane(c, [&](std::int64_t at) {
        const float x_hat = (b_.x[at] - mean) * inv_std;
        b_.dx[at] = k * (fm * b_.dy[at] - mean_dy - x_hat * mean_dy_xhat);
      });
    }
  }

  std::string describe() const override { return "batchnorm (plain loops, sums in double)"; }

 private:
  // f(index) for every element of channel c, sample by sample (NCHW: a plane of `plane_` values).
  template <typename F>
  void for_plane(int c, F f) const {
    for (int n = 0; n < b_.batch; ++n) {
      const std::int64_t base = (static_cast<std::int64_t>(n) * channels_ + c) * plane_;
      for (std::int64_t i = 0; i < plane_; ++i) f(base + i);
    }
  }

  LayerBuffers b_;
  int channels_;
  std::int64_t plane_;
  double momentum_, eps_;
  bool training_;
  std::vector<float> mean_, inv_std_;  // per channel, of the last forward (backward reads them)
};

}  // namespace

std::unique_ptr<LayerKernel> make_batchnorm(const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<BatchNorm>(l, b, training);
}

}  // namespace mnist_mpi::cpu
