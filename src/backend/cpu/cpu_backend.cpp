// The CPU backend: oneDNN kernels for conv / fc / ReLU, plain loops for max pooling, dropout and the
// softmax cross-entropy loss; the data set read in place and the fused optimiser pass of
// src/train/optimizer.cpp. Threads: oneDNN here runs on OpenMP, so --threads sets OpenMP's.
#include <cpuid.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/communicator.hpp"  // StepGuard::agree
#include "mnist_mpi/resilience/finite.hpp"  // all_finite
#include "src/backend/cpu/kernels.hpp"

namespace mnist_mpi {
namespace {

// Note [Huge pages for big buffers]
// A 4 KiB page fault costs microseconds on this project's VMs, and a rank's big buffers (lenet:
// parameters, gradients and Adam's moments at 13 MB each, activations up to 25 MB in the
// evaluation model) were first touched page by page when zero-filled at build: most of the model
// build time. Buffers of 2 MiB and more are allocated on a 2 MiB boundary and advised
// MADV_HUGEPAGE (transparent huge pages in `madvise` mode, Debian's default), so they fault in
// 2 MiB at a time. A hint only: without THP they are ordinary pages.
// Such a buffer is its own anonymous mapping, so it comes zero-filled from the kernel and is not
// cleared a second time.
class HostBuffer final : public Buffer {
 public:
  explicit HostBuffer(std::int64_t n) : n_(n) {
    constexpr std::size_t kHuge = std::size_t{1} << 21;
    const std::size_t bytes = static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(float);
    if (bytes < kHuge) {
      p_ = static_cast<float*>(std::calloc(bytes, 1));
      MNIST_CHECK(p_ != nullptr, ExitCode::kRuntime, "out of memory: a buffer of " + std::to_string(bytes) + " bytes");
      return;
    }
    // Over-map by one huge page to start on a 2 MiB boundary; the slack is unmapped again.
    const std::size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
    void* m = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    MNIST_CHECK(m != MAP_FAILED, ExitCode::kRuntime, "out of memory: a buffer of " + std::to_string(bytes) + " bytes");
    const auto base = reinterpret_cast<std::uintptr_t>(m), start = (base + kHuge - 1) & ~(std::uintptr_t{kHuge} - 1);
    if (start > base) munmap(m, start - base);
    if (const std::size_t tail = base + size + kHuge - (start + size); tail > 0)
      munmap(reinterpret_cast<void*>(start + size), tail);
    p_ = reinterpret_cast<float*>(start);
    mapped_ = size;
    madvise(p_, size, MADV_HUGEPAGE);  // a hint only
  }
  ~HostBuffer() override {
    if (mapped_)
      munmap(p_, mapped_);
    else
      std::free(p_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  float* data() override { return p_; }
  std::int64_t size() const override { return n_; }

 private:
  std::int64_t n_;
  float* p_ = nullptr;
  std::size_t mapped_ = 0;  // bytes mapped at p_ (0: from calloc)
};

class HostLossMeter final : public LossMeter {
 public:
  LossStats read() override { return s_; }
  void reset() override { s_ = LossStats{}; }
  LossStats& sums() { return s_; }

 private:
  LossStats s_;
};

// The split stays where load_mnist put it; a batch is converted image by image.
class HostDataSource final : public DataSource {
 public:
  HostDataSource(const Split& split, int batch) : split_(split), labels_(static_cast<std::size_t>(batch), 0) {}
  void set_order(std::span<const std::int64_t> order) override { order_ = order; }
  void gather(std::int64_t position, std::int64_t n, float* x) override {
    check(n);
    const std::int64_t pixels = static_cast<std::int64_t>(split_.rows) * split_.cols;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t idx = order_[static_cast<std::size_t>(position + i)];
      to_unit_float(split_.image(idx), pixels, x + i * pixels);
      labels_[static_cast<std::size_t>(i)] = split_.labels[static_cast<std::size_t>(idx)];
    }
  }
  void slice(std::int64_t first, std::int64_t n, float* x) override {
    check(n);
    const std::int64_t pixels = static_cast<std::int64_t>(split_.rows) * split_.cols;
    to_unit_float(split_.image(first), n * pixels, x);
    for (std::int64_t i = 0; i < n; ++i)
      labels_[static_cast<std::size_t>(i)] = split_.labels[static_cast<std::size_t>(first + i)];
  }
  const std::int32_t* labels() const override { return labels_.data(); }

 private:
  void check(std::int64_t n) const {
    MNIST_CHECK(n <= static_cast<std::int64_t>(labels_.size()), ExitCode::kRuntime,
                "batch larger than the data source's");
  }
  // uint8 pixels to [0, 1] floats: the one conversion of an image, for training and evaluation.
  static void to_unit_float(const std::uint8_t* src, std::int64_t n, float* dst) {
    constexpr float kScale = 1.0f / 255.0f;
    for (std::int64_t k = 0; k < n; ++k) dst[k] = static_cast<float>(src[k]) * kScale;
  }
  const Split& split_;
  std::span<const std::int64_t> order_;
  std::vector<std::int32_t> labels_;  // (batch)
};

// Note [Non-finite steps] on the host: the reduced buckets are read where they are.
class HostStepGuard final : public StepGuard {
 public:
  void begin_step() override { loss_bad_ = gradient_bad_ = false; }
  void after_loss(LossMeter& meter, float* dlogits, bool poison) override {
    if (poison || !std::isfinite(meter.read().loss_sum)) loss_bad_ = true;  // a plain read here
    if (loss_bad_) dlogits[0] = std::numeric_limits<float>::quiet_NaN();    // every later micro-batch too
  }
  bool bucket_ok(const float* grads, std::int64_t n) override {
    const bool ok = all_finite(grads, n);
    gradient_bad_ = gradient_bad_ || !ok;
    return ok;
  }
  bool agree(Communicator& comm) override {
    std::int64_t bad = gradient_bad_ ? 1 : 0;
    comm.allreduce_max(std::span<std::int64_t>(&bad, 1));
    gradient_bad_ = bad != 0;
    return !gradient_bad_;
  }
  void end_step(std::int64_t step) override {
    step_ = step;
    verdict_ = (gradient_bad_ ? kNonfiniteGradient : 0) | (loss_bad_ ? kNonfiniteLoss : 0);
  }
  int verdict(std::int64_t step) override {
    MNIST_CHECK(step == step_, ExitCode::kRuntime, "a host step guard knows only the last step's verdict");
    return verdict_;
  }
  std::int64_t lag() const override { return 0; }

 private:
  bool loss_bad_ = false, gradient_bad_ = false;
  std::int64_t step_ = -1;
  int verdict_ = 0;
};

// Note [Host copies] on the host: the buffers themselves.
class SameMemory final : public HostCopy {
 public:
  explicit SameMemory(std::vector<float*> buffers) : buffers_(std::move(buffers)) {}
  float* host(std::size_t i) override { return buffers_.at(i); }
  void to_host() override {}
  void to_backend() override {}

 private:
  std::vector<float*> buffers_;
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, CpuFusions fuse) {
    MNIST_CHECK(!fuse.bf16 || cpu_has_bf16(), ExitCode::kUsage,
                "--precision bf16 needs a CPU with bf16 multiply instructions (AVX512-BF16 or AMX-BF16); this one has "
                "neither, and bf16 emulated in fp32 would be slower than fp32: use --precision fp32 here");
    omp_set_num_threads(std::max(1, threads));
    ctx_.fuse = fuse;
  }
  std::string name() const override { return "cpu"; }
  std::unique_ptr<Buffer> allocate(std::int64_t count) override { return std::make_unique<HostBuffer>(count); }

  // Note [Which activations are blocked]
  // An activation is kept blocked (nChw16c on AVX-512 machines when 16 divides every such
  // activation's channels, else nChw8c) when the layer writing it and the layer reading it are
  // both a convolution, a ReLU, a batch norm or a max pool: oneDNN's direct convolutions read and
  // write blocked tensors, ReLU is elementwise and batch norm per channel (any layout, as long as
  // its input and output agree), and the
  // pooling loops read blocked and write either (src/backend/cpu/pool.cpp). So the last pool
  // before flatten turns blocked into plain, and no layer reorders an activation.
  // Note [A block size per activation]
  // One block size for the whole model was the rule: 16 on AVX-512 where every blocked activation
  // has a multiple of 16 channels, else 8. tiny (8 channels, then 16) got 8 everywhere, and
  // oneDNN has only AVX2 kernels for its second convolution in nChw8c (0.63 + 0.53 + 0.64 ms per
  // pass at batch 128 on an AVX-512 host). With 8 channels in blocks of 8 and 16 in blocks of 16,
  // both activations are one block of all their channels, which is NHWC byte for byte, and
  // oneDNN's AVX-512 kernels for NHWC take 0.37 + 0.46 + 0.32 ms (Note [One block is NHWC] in
  // src/backend/cpu/dnnl_util.hpp). So on AVX-512 each activation takes 16 where 16 divides its
  // channels and 8 otherwise; that assignment is kept only where no convolution loses its blocked
  // layouts by it (mixed blocks of several each have no fast kernels), else the old rule stands.
  std::vector<Layout> activation_layouts(const ModelSpec& spec) const override {
    const std::size_t L = spec.layers.size();
    std::vector<bool> candidate(L + 1, false);
    const auto speaks_blocked = [](LayerKind k) { return layer_traits(k).keeps_blocked; };  // Note [A layer kind's facts]
    for (std::size_t i = 1; i < L; ++i)
      candidate[i] = speaks_blocked(spec.layers[i - 1].kind) && speaks_blocked(spec.layers[i].kind) &&
                     spec.activation(i).c % 8 == 0 && spec.activation(i).h * spec.activation(i).w > 1;
    const bool avx512 = dnnl::get_effective_cpu_isa() >= dnnl::cpu_isa::avx512_core;
    bool all16 = avx512;
    for (std::size_t i = 0; i <= L; ++i) all16 = all16 && (!candidate[i] || spec.activation(i).c % 16 == 0);
    const auto uniform = [&](std::size_t) { return all16 ? Layout::kBlocked16 : Layout::kBlocked8; };
    const auto per_activation = [&](std::size_t i) {
      return spec.activation(i).c % 16 == 0 ? Layout::kBlocked16 : Layout::kBlocked8;
    };
    const std::vector<Layout> base = settle(spec, candidate, uniform);
    if (!avx512 || all16) return base;
    const std::vector<Layout> mixed = settle(spec, candidate, per_activation);
    for (std::size_t i = 0; i <= L; ++i)
      if ((mixed[i] == Layout::kPlain) != (base[i] == Layout::kPlain)) return base;
    return mixed;
  }

  // The candidates for a blocked layout, each in block(i), less those a layer cannot keep.
  template <typename Block>
  std::vector<Layout> settle(const ModelSpec& spec, std::vector<bool> blocked, Block block) const {
    const std::size_t L = spec.layers.size();
    const auto layout = [&](std::size_t i) { return blocked[i] ? block(i) : Layout::kPlain; };
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t i = 0; i < L; ++i) {
        const LayerKind k = spec.layers[i].kind;
        // ReLU and batch norm keep their layout; a pool never turns plain into blocked.
        if (((k == LayerKind::kRelu || k == LayerKind::kBatchNorm) && blocked[i] != blocked[i + 1]) ||
            (k == LayerKind::kMaxPool && !blocked[i] && blocked[i + 1])) {
          changed = changed || blocked[i] || blocked[i + 1];
          blocked[i] = blocked[i + 1] = false;
        }
        // A convolution whose blocked kernels would be oneDNN's reference ones (e.g. backward-weights
        // of one input channel into nChw8c) gets a plain output, or failing that a plain input.
        if (k == LayerKind::kConv && (blocked[i] || blocked[i + 1]) &&
            !cpu::conv_has_fast_kernels(ctx_, spec.layers[i], layout(i), layout(i + 1), i > 0)) {
          blocked[blocked[i + 1] ? i + 1 : i] = false;
          changed = true;
        }
      }
    }
    std::vector<Layout> out(L + 1, Layout::kPlain);
    for (std::size_t i = 0; i <= L; ++i) out[i] = layout(i);
    return out;
  }

  // Note [The fusion plan] in src/backend/cpu/fusion.cpp: made here for the model about to be
  // built, and handed out layer by layer as make_layer is asked for them in order.
  void plan_model(const ModelSpec& spec, const std::vector<Layout>& layouts, int batch, int first, int end,
                  bool training) override {
    plan_ = cpu::plan_fusions(ctx_, spec, layouts, batch, first, end, training);
  }

  std::unique_ptr<LayerKernel> make_layer(const LayerSpec& l, int index, const LayerBuffers& b,
                                          bool training) override {
    // A layer of the planned model, or (a layer built alone, a model's build cut short) none.
    cpu::LayerFusion f;
    if (plan_ && plan_->expects(l, index, b, training))
      f = plan_->take(index, b);
    else
      plan_.reset();
    if (plan_ && plan_->next == plan_->end) plan_.reset();
    try {
      switch (l.kind) {
        case LayerKind::kConv:
          return cpu::make_conv(ctx_, l, b, training, index == 0, f);
        case LayerKind::kFc:
          return cpu::make_fc(ctx_, l, b, training);
        case LayerKind::kMaxPool:
          return cpu::make_maxpool(ctx_, l, b, training, f);
        case LayerKind::kRelu:
          return cpu::make_relu(ctx_, l, b, training, f);
        case LayerKind::kDropout:
          return cpu::make_dropout(l, index, b, training);
        case LayerKind::kFlatten:
          return cpu::make_flatten(l, b);
        case LayerKind::kBatchNorm:
          return cpu::make_batchnorm(l, b, training);
      }
    } catch (const dnnl::error& e) {
      throw_error(ExitCode::kRuntime, "oneDNN could not build layer " + std::to_string(index) + " '" + l.text + "': " +
                                          e.what() + " (status " + std::to_string(static_cast<int>(e.status)) + ")");
    }
    throw_error(ExitCode::kRuntime, "unknown layer kind");
  }

  void softmax_cross_entropy(const float* logits, const std::int32_t* labels, int batch, int classes, float* dlogits,
                             float grad_scale, LossMeter& meter) override {
    const LossStats s = softmax_cross_entropy_reference(logits, labels, batch, classes, dlogits, grad_scale);
    LossStats& sum = static_cast<HostLossMeter&>(meter).sums();
    sum.loss_sum += s.loss_sum;
    sum.correct += s.correct;
  }
  std::unique_ptr<LossMeter> make_loss_meter() override { return std::make_unique<HostLossMeter>(); }

  std::unique_ptr<DataSource> make_data_source(const Split& split, int batch) override {
    return std::make_unique<HostDataSource>(split, batch);
  }

  std::unique_ptr<OptimizerPass> make_optimizer_pass(const OptimizerConfig& cfg, ParameterStore* store) override {
    return make_host_optimizer_pass(cfg, store);  // src/backend/cpu/optimizer.cpp
  }
  void add(float* dst, const float* src, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
  }
  void copy(float* dst, const float* src, std::int64_t n) override { std::copy(src, src + n, dst); }
  void scale(float* x, float a, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) x[i] *= a;
  }
  std::unique_ptr<StepGuard> make_step_guard(bool) override { return std::make_unique<HostStepGuard>(); }
  std::unique_ptr<HostCopy> make_host_copy(std::vector<float*> buffers, std::int64_t) override {
    return std::make_unique<SameMemory>(std::move(buffers));
  }
  void check_model_fits(const ModelSpec& spec, std::int64_t batch, std::int64_t eval_batch, OptimizerKind optimizer,
                        bool evaluates) const override {
    check_model_fits_memory(spec, batch, eval_batch, optimizer, evaluates);
  }
  void upload(std::span<const float> host, float* dst) override {
    if (host.data() != dst) std::copy(host.begin(), host.end(), dst);
  }
  void download(const float* src, std::span<float> host) override {
    if (host.data() != src) std::copy(src, src + host.size(), host.begin());
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
  std::optional<cpu::FusionPlan> plan_;  // of the model being built
};

}  // namespace

// Note [bf16 on the CPU]
// --precision bf16 runs the convolutions after the first and the fc layers on oneDNN's bf16
// kernels (jit_bf16:avx512_core_bf16, or AMX where the CPU has it): each reads bf16 copies of its
// input, of its weights and (backward) of its output gradient, and accumulates and writes fp32:
// activations, gradients, the parameters (the master copy), the optimiser's state, the sums over
// ranks and checkpoints stay fp32, so a bf16 run resumes in fp32 and back. The weights' copies are
// made where the parameters change, the optimiser writing an fc's (Note [Weight copies kept
// between passes] in src/backend/cpu/bf16.cpp); a max pool before flatten writes the bf16 output
// gradient of the convolution before it (Note [A pool's gradient straight into bf16] in pool.cpp).
// The first convolution (one input channel: oneDNN's bf16 kernels for it were slower than its fp32
// one) runs on loops of our own where its shape allows: its forward in the pass of a 2 x 2 max pool
// after its ReLU (Note [The first convolution in bf16]), its weight gradient for 3 x 3 and 5 x 5
// kernels, from the pool's gradient where a pool follows (Note [The first convolution's weight
// gradient in bf16]); otherwise oneDNN's fp32 kernels. The pools, ReLUs, dropout and the loss stay
// fp32. Measured on lenet's second convolution at batch 50 (Zen 4, one core):
// 10.5 ms fp32 against 5.8 ms bf16 for forward and both backward passes, the conversions
// included. A CPU without bf16 instructions is refused at set-up: oneDNN would run reference
// kernels, far slower than fp32. The kernels chosen are in the banner's per-layer lines, each bf16
// layer's starting with "bf16".
bool cpu_has_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool amx_bf16 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) != 0;  // CPUID.7.0:EDX[22]
  return cpu::cpu_has_avx512_bf16() || amx_bf16;
}

std::unique_ptr<Backend> make_cpu_backend(int threads, CpuFusions fuse) {
  return std::make_unique<CpuBackend>(threads, fuse);
}

}  // namespace mnist_mpi
