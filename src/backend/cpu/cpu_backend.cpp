// The CPU backend: oneDNN kernels for conv / fc / ReLU, plain loops for max pooling, dropout and the
// softmax cross-entropy loss. Threads: oneDNN here runs on OpenMP, so --threads sets OpenMP's.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi {
namespace {

class HostBuffer final : public Buffer {
 public:
  explicit HostBuffer(std::int64_t n) : v_(static_cast<std::size_t>(n), 0.0f) {}
  float* data() override { return v_.data(); }
  std::int64_t size() const override { return static_cast<std::int64_t>(v_.size()); }

 private:
  std::vector<float> v_;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) { omp_set_num_threads(std::max(1, threads)); }
  std::string name() const override { return "cpu"; }
  std::unique_ptr<Buffer> allocate(std::int64_t count) override { return std::make_unique<HostBuffer>(count); }

  std::unique_ptr<LayerKernel> make_layer(const LayerSpec& l, int index, const LayerBuffers& b,
                                          bool training) override {
    try {
      switch (l.kind) {
        case LayerKind::kConv: return cpu::make_conv(ctx_, l, b, training);
        case LayerKind::kFc: return cpu::make_fc(ctx_, l, b, training);
        case LayerKind::kMaxPool: return cpu::make_maxpool(l, b, training);
        case LayerKind::kRelu: return cpu::make_relu(ctx_, l, b, training);
        case LayerKind::kDropout: return cpu::make_dropout(l, index, b, training);
        case LayerKind::kFlatten: return cpu::make_flatten(l, b);
      }
    } catch (const dnnl::error& e) {
      throw_error(ExitCode::kRuntime, "oneDNN could not build layer " + std::to_string(index) + " '" +
                                          l.text + "': " + e.what() + " (status " +
                                          std::to_string(static_cast<int>(e.status)) + ")");
    }
    throw_error(ExitCode::kRuntime, "unknown layer kind");
  }

  LossStats softmax_cross_entropy(const float* logits, const std::int32_t* labels, int batch, int classes,
                                  float* dlogits, float grad_scale) override {
    return softmax_cross_entropy_reference(logits, labels, batch, classes, dlogits, grad_scale);
  }

  static LossStats softmax_cross_entropy_reference(const float* logits, const std::int32_t* labels, int batch,
                                                   int classes, float* dlogits, float grad_scale) {
    LossStats s;
    for (int n = 0; n < batch; ++n) {
      const float* z = logits + static_cast<std::ptrdiff_t>(n) * classes;  // (classes)
      int argmax = 0;
      for (int k = 1; k < classes; ++k)
        if (z[k] > z[argmax]) argmax = k;
      const double m = z[argmax];
      double sum = 0.0;
      for (int k = 0; k < classes; ++k) sum += std::exp(static_cast<double>(z[k]) - m);
      const double lse = m + std::log(sum);  // log-sum-exp: finite for any finite logits
      const int y = labels[n];
      s.loss_sum += lse - z[y];
      s.correct += argmax == y ? 1 : 0;
      if (dlogits) {
        float* d = dlogits + static_cast<std::ptrdiff_t>(n) * classes;
        for (int k = 0; k < classes; ++k) {
          const double p = std::exp(static_cast<double>(z[k]) - lse);
          d[k] = static_cast<float>((p - (k == y ? 1.0 : 0.0)) * grad_scale);
        }
      }
    }
    return s;
  }

 private:
  cpu::Context ctx_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads) { return std::make_unique<CpuBackend>(threads); }

}  // namespace mnist_mpi
