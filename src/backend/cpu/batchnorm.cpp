// Batch normalisation (Ioffe and Szegedy, 2015), per channel over the batch and the plane: in
// training y = (x - mean) / sqrt(var + eps) * scale + shift with the batch's mean and biased
// variance, and the running statistics move toward them (running = (1 - momentum) * running +
// momentum * batch, the variance unbiased: PyTorch's BatchNorm2d); at inference the running
// statistics take their place. After an fc the plane is one value: BatchNorm1d. Any layout, the
// same for x and y (Note [Activation layouts]: between convolutions and pools the backend keeps
// them blocked, so that the convolutions keep oneDNN's direct kernels); a channel's values are
// visited in (sample, position) order in every layout, so its sums, in double, are the same bits
// whatever the layout. No cross-layer fusion takes a batch norm's neighbours.
#include <algorithm>
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
    MNIST_CHECK(b.x_layout == b.y_layout && b.w && b.state, ExitCode::kRuntime,
                "batch norm: one layout for x and y, its scale and shift, and its running statistics are needed");
    block_ = b.x_layout == Layout::kBlocked8 ? 8 : b.x_layout == Layout::kBlocked16 ? 16 : 1;
    MNIST_CHECK(channels_ % block_ == 0, ExitCode::kRuntime, "batch norm: channels not a multiple of the block");
    lanes_ = block_ > 1 ? block_ : plane_ == 1 ? channels_ : 1;  // Note [Lanes of a batch norm]
    const auto c = static_cast<std::size_t>(channels_);
    mean_.assign(c, 0.0f);
    inv_std_.assign(c, 0.0f);
    a_.assign(c, 0.0f);
    bias_.assign(c, 0.0f);
    acc_.assign(c, 0.0);
    acc2_.assign(c, 0.0);
    sum_f_.assign(static_cast<std::size_t>(lanes_), 0.0f);
    sum_xf_.assign(static_cast<std::size_t>(lanes_), 0.0f);
  }

  void forward(const StepContext& ctx) override {
    const float* scale = b_.w;
    const float* shift = b_.w + channels_;
    float* running_mean = b_.state;
    float* running_var = b_.state + channels_;
    const bool batch_stats = ctx.training && training_;
    const double m = static_cast<double>(b_.batch) * static_cast<double>(plane_);
    for (std::int64_t g = 0; g < channels_ / lanes_; ++g) {
      double* const sum = acc_.data() + g * lanes_;
      double* const sq = acc2_.data() + g * lanes_;
      if (batch_stats) {
        std::fill(sum, sum + lanes_, 0.0);
        std::fill(sq, sq + lanes_, 0.0);
        for_group(g, [&](std::int64_t l, std::int64_t at) { sum[l] += b_.x[at]; });
        for (std::int64_t l = 0; l < lanes_; ++l) sum[l] /= m;  // the means
        for_group(g, [&](std::int64_t l, std::int64_t at) {
          const double d = b_.x[at] - sum[l];
          sq[l] += d * d;
        });
      }
      for (std::int64_t l = 0; l < lanes_; ++l) {
        const std::int64_t c = g * lanes_ + l;
        float mean = running_mean[c], var = running_var[c];
        if (batch_stats) {
          const double mu = sum[l], biased = sq[l] / m;
          mean = static_cast<float>(mu);
          var = static_cast<float>(biased);
          const double unbiased = m > 1.0 ? sq[l] / (m - 1.0) : biased;
          running_mean[c] = static_cast<float>((1.0 - momentum_) * running_mean[c] + momentum_ * mu);
          running_var[c] = static_cast<float>((1.0 - momentum_) * running_var[c] + momentum_ * unbiased);
        }
        const float inv_std = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var) + eps_));
        mean_[static_cast<std::size_t>(c)] = mean;
        inv_std_[static_cast<std::size_t>(c)] = inv_std;
        a_[static_cast<std::size_t>(c)] = scale[c] * inv_std;
        bias_[static_cast<std::size_t>(c)] = shift[c] - mean * a_[static_cast<std::size_t>(c)];
      }
      const float* const a = a_.data() + g * lanes_;
      const float* const bias = bias_.data() + g * lanes_;
      for_group(g, [&](std::int64_t l, std::int64_t at) { b_.y[at] = b_.x[at] * a[l] + bias[l]; });
    }
  }

  // With x_hat = (x - mean) * inv_std: d shift = sum dy, d scale = sum dy * x_hat, and
  // dx = scale * inv_std / m * (m * dy - d shift - x_hat * d scale).
  void backward(const StepContext&) override {
    const float* scale = b_.w;
    const double m = static_cast<double>(b_.batch) * static_cast<double>(plane_);
    const float fm = static_cast<float>(m);
    for (std::int64_t g = 0; g < channels_ / lanes_; ++g) {
      double* const dshift = acc_.data() + g * lanes_;
      double* const dscale = acc2_.data() + g * lanes_;
      const float* const mean = mean_.data() + g * lanes_;
      const float* const inv_std = inv_std_.data() + g * lanes_;
      std::fill(dshift, dshift + lanes_, 0.0);
      std::fill(dscale, dscale + lanes_, 0.0);
      for_group(g, [&](std::int64_t l, std::int64_t at) {
        dshift[l] += b_.dy[at];
        dscale[l] += static_cast<double>(b_.dy[at]) * ((b_.x[at] - mean[l]) * inv_std[l]);
      });
      for (std::int64_t l = 0; l < lanes_; ++l) {
        const std::int64_t c = g * lanes_ + l;
        b_.dw[c] = static_cast<float>(dscale[l]);
        b_.dw[channels_ + c] = static_cast<float>(dshift[l]);
        a_[static_cast<std::size_t>(c)] = static_cast<float>(scale[c] * inv_std[l] / m);  // k of the formula
      }
      if (!b_.dx) continue;
      const float* const k = a_.data() + g * lanes_;
      for (std::int64_t l = 0; l < lanes_; ++l) {  // the sums as floats
        sum_f_[static_cast<std::size_t>(l)] = static_cast<float>(dshift[l]);
        sum_xf_[static_cast<std::size_t>(l)] = static_cast<float>(dscale[l]);
      }
      const float* const sdy = sum_f_.data();
      const float* const sdyx = sum_xf_.data();
      for_group(g, [&](std::int64_t l, std::int64_t at) {
        const float x_hat = (b_.x[at] - mean[l]) * inv_std[l];
        b_.dx[at] = k[l] * (fm * b_.dy[at] - sdy[l] - x_hat * sdyx[l]);
      });
    }
  }

  std::string describe() const override {
    return "batchnorm (loops, sums in double; " + (block_ == 1 ? std::string("plain") : "block " + std::to_string(block_)) +
           ")";
  }

 private:
  // Note [Lanes of a batch norm]
  // The channels are visited in groups of `lanes_` that lie side by side in memory: a block of a
  // blocked layout, all of them after an fc (a plain (N, C) buffer is one block of C), or one
  // channel of a plain (N, C, H, W) buffer, whose plane is contiguous. f(l, index) runs for every
  // element of group g, sample by sample, position by position, with the lanes innermost: each
  // channel's values still come in (sample, position) order, so its sums are the same bits in
  // every layout, and the loop over the lanes vectorises (a channel at a time, a blocked buffer
  // would be read once per channel of its block).
  template <typename F>
  void for_group(std::int64_t g, F f) const {
    const std::int64_t groups = channels_ / lanes_;
    for (int n = 0; n < b_.batch; ++n)
      for (std::int64_t p = 0; p < plane_; ++p) {
        const std::int64_t base = ((static_cast<std::int64_t>(n) * groups + g) * plane_ + p) * lanes_;
        for (std::int64_t l = 0; l < lanes_; ++l) f(l, base + l);
      }
  }

  LayerBuffers b_;
  int channels_;
  std::int64_t plane_;
  double momentum_, eps_;
  bool training_;
  std::int64_t block_ = 1;  // of the layout of x and y: 1 (plain), 8 or 16
  std::int64_t lanes_ = 1;  // channels side by side (Note [Lanes of a batch norm])
  std::vector<float> mean_, inv_std_;  // per channel, of the last forward (backward reads them)
  std::vector<float> a_, bias_;        // per channel: forward's scale and shift of x; backward's k
  std::vector<double> acc_, acc2_;     // per channel: the sums of a pass
  std::vector<float> sum_f_, sum_xf_;  // per lane of a group: backward's sums as floats
};

}  // namespace

std::unique_ptr<LayerKernel> make_batchnorm(const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<BatchNorm>(l, b, training);
}

}  // namespace mnist_mpi::cpu
