// The CUDA backend of one rank on one GPU: device buffers, the data splits uploaded once, the loss
// summed on the device (read only when printed), the optimiser and elementwise passes as our
// kernels, copies to and from the host, and the layer factories of src/backend/cuda/ (cuDNN for
// convolution, pooling and ReLU; cuBLAS for fc), and the gradient communicator it makes (NCCL, or
// staged through the host; src/backend/cuda/nccl_communicator.cpp). Everything runs on the
// context's one compute stream (Note [One compute stream] in src/backend/cuda/cuda_backend.hpp).
#include "src/backend/cuda/cuda_backend.hpp"

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <limits>
#include <sstream>
#include <thread>
#include <vector>

#include "mnist_mpi/backend/parameter_store.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/exact_norm.hpp"

namespace mnist_mpi {
namespace cuda {

void Context::wait_for_stream() {
  CUDA_CHECK(cudaEventRecord(sync_event, stream));
  wait_for_event(sync_event);
}

void Context::wait_for_event(cudaEvent_t e) {
  // Poll rather than cudaEventSynchronize: between polls NCCL is checked for asynchronous errors,
  // and the wait has a deadline (Note [Device waits have a deadline]).
  wait_until(
      [e] {
        const cudaError_t rc = cudaEventQuery(e);
        if (rc != cudaErrorNotReady) CUDA_CHECK(rc);
        return rc == cudaSuccess;
      },
      wait, "a wait for the GPU's queue (kernels and NCCL sums)");
}

namespace {

class DeviceBuffer final : public Buffer {
 public:
  explicit DeviceBuffer(std::int64_t n) : a_(n) {}
  float* data() override { return a_.get(); }
  std::int64_t size() const override { return a_.size(); }

 private:
  DeviceArray<float> a_;
};

// Sums on the device: [0] loss, [1] correct (a double holds counts exactly up to 2^53).
class DeviceLossMeter final : public LossMeter {
 public:
  explicit DeviceLossMeter(Context& c) : c_(c), sums_(2) {}
  LossStats read() override {
    double host[2] = {0.0, 0.0};
    c_.wait_for_stream();  // first poll (Note [One compute stream]); the copy then waits for nothing
    CUDA_CHECK(cudaMemcpyAsync(host, sums_.get(), sizeof host, cudaMemcpyDeviceToHost, c_.stream));
    c_.wait_for_stream();
    LossStats s;
    s.loss_sum = host[0];
    s.correct = static_cast<std::int64_t>(host[1]);
    return s;
  }
  void reset() override { CUDA_CHECK(cudaMemsetAsync(sums_.get(), 0, 2 * sizeof(double), c_.stream)); }
  double* sums() { return sums_.get(); }

 private:
  Context& c_;
  DeviceArray<double> sums_;
};

// The split's pixels and labels copied to the device once, at build; a batch is one gather kernel.
class DeviceDataSource final : public DataSource {
 public:
  DeviceDataSource(Context& c, const Split& split, int batch)
      : c_(c),
        count_(split.count),
        pixels_(static_cast<std::int64_t>(split.rows) * split.cols),
        batch_(batch),
        images_(static_cast<std::int64_t>(split.pixels.size())),
        labels_in_(static_cast<std::int64_t>(split.labels.size())),
        order_(split.count),
        labels_(batch) {
    if (!split.pixels.empty())
      CUDA_CHECK(cudaMemcpy(images_.get(), split.pixels.data(), split.pixels.size(), cudaMemcpyHostToDevice));
    if (!split.labels.empty())
      CUDA_CHECK(cudaMemcpy(labels_in_.get(), split.labels.data(), split.labels.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());  // the copies ran on the legacy stream: done before any use
    CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staging_),
                              static_cast<std::size_t>(count_) * sizeof(std::int64_t) + 1));
    CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  }
  ~DeviceDataSource() override {
    if (copied_) cudaEventDestroy(copied_);
    if (staging_) cudaFreeHost(staging_);
  }
  void set_order(std::span<const std::int64_t> order) override {
    MNIST_CHECK(static_cast<std::int64_t>(order.size()) <= count_, ExitCode::kRuntime, "order longer than the split");
    // Once per epoch, through pinned memory (a pageable copy could block inside the CUDA call):
    // the previous epoch's copy must have read the staging buffer before it is refilled, and on
    // the compute stream the gathers queued before still read the old order, the later ones the
    // new one.
    c_.wait_for_event(copied_);
    std::copy(order.begin(), order.end(), staging_);
    CUDA_CHECK(cudaMemcpyAsync(order_.get(), staging_, order.size_bytes(), cudaMemcpyHostToDevice, c_.stream));
    CUDA_CHECK(cudaEventRecord(copied_, c_.stream));
  }
  // Training batches: order[offset + first + i], the offset from device memory (Note [A step as one
  // CUDA graph]), so that a replayed graph reads the step's own batch.
  void gather(std::int64_t position, std::int64_t n, float* x) override {
    check(n);
    const std::int64_t first = position - c_.host_args.batch_offset;
    MNIST_CHECK(first >= 0, ExitCode::kRuntime,
                "gather: the step's device arguments do not match position " + std::to_string(position));
    launch_gather(c_.stream, images_.get(), labels_in_.get(), order_.get(), &c_.step_args->batch_offset, first, n,
                  pixels_, x, labels_.get());
  }
  void slice(std::int64_t first, std::int64_t n, float* x) override {
    check(n);
    MNIST_CHECK(first + n <= count_, ExitCode::kRuntime, "slice past the end of the split");
    launch_gather(c_.stream, images_.get(), labels_in_.get(), nullptr, nullptr, first, n, pixels_, x, labels_.get());
  }
  const std::int32_t* labels() const override { return labels_.get(); }

 private:
  void check(std::int64_t n) const {
    MNIST_CHECK(n <= batch_, ExitCode::kRuntime, "batch larger than the data source's");
  }
  Context& c_;
  std::int64_t count_, pixels_, batch_;
  DeviceArray<std::uint8_t> images_;     // (count, rows, cols)
  DeviceArray<std::uint8_t> labels_in_;  // (count)
  DeviceArray<std::int64_t> order_;      // (count): this epoch's permutation
  DeviceArray<std::int32_t> labels_;     // (batch)
  std::int64_t* staging_ = nullptr;      // (count), pinned: the order on its way
  cudaEvent_t copied_ = nullptr;         // recorded after the last order copy
};

// --exact-sums's passes on the device (include/mnist_mpi/backend/fixed_point.hpp; the kernels:
// Note [Fixed point on a GPU] in kernels.cu): the integers, their counters and the tensors' slots
// in device memory, all on the compute stream; read() copies the counters and the slots into
// pinned memory with one wait, the step's one synchronisation for its sums.
class DevicePasses final : public FixedPointPasses {
 public:
  DevicePasses(Context& c, std::int64_t count, std::size_t slots)
      : c_(c),
        count_(count),
        slots_(slots),
        q_(count + 2),
        maxima_(static_cast<std::int64_t>(std::max<std::size_t>(slots, 1))) {
    // One pinned block: the two counters, then the slots (nothing to free if it fails).
    void* p = nullptr;
    CUDA_CHECK(cudaMallocHost(&p, 2 * sizeof(std::int64_t) + std::max<std::size_t>(slots, 1) * sizeof(std::uint32_t)));
    host_counts_ = static_cast<std::int64_t*>(p);
    host_maxima_ = reinterpret_cast<std::uint32_t*>(host_counts_ + 2);
  }
  ~DevicePasses() override {
    if (host_counts_) cudaFreeHost(host_counts_);
  }
  std::span<std::int64_t> integers() override { return {q_.get(), static_cast<std::size_t>(count_ + 2)}; }
  void zero_counters() override {
    CUDA_CHECK(cudaMemsetAsync(q_.get() + count_, 0, 2 * sizeof(std::int64_t), c_.stream));
  }
  void to_fixed(const float* g, std::int64_t offset, std::int64_t n, double scale, float bound, bool assign) override {
    check_range(count_, offset, n);
    launch_to_fixed(c_.stream, g, q_.get() + offset, n, scale, bound, assign, q_.get() + count_);
  }
  void probe(const float* g, std::int64_t n, std::size_t slot) override {
    launch_max_finite_magnitude(c_.stream, g, n, maxima_.get() + checked(slot));
  }
  void from_fixed(std::int64_t offset, float* g, std::int64_t n, double unscale, std::size_t slot) override {
    check_range(count_, offset, n);
    launch_from_fixed(c_.stream, q_.get() + offset, g, n, unscale, maxima_.get() + checked(slot));
  }
  void fill_nan(float* g, std::int64_t n) override {
    if (n > 0) launch_fill(c_.stream, g, std::numeric_limits<float>::quiet_NaN(), n);
  }
  FixedPointCounts read(std::span<std::uint32_t> maxima) override {
    MNIST_CHECK(maxima.empty() || maxima.size() == slots_, ExitCode::kRuntime, "fixed point: one maximum per slot");
    CUDA_CHECK(
        cudaMemcpyAsync(host_counts_, q_.get() + count_, 2 * sizeof(std::int64_t), cudaMemcpyDeviceToHost, c_.stream));
    if (!maxima.empty()) {
      CUDA_CHECK(cudaMemcpyAsync(host_maxima_, maxima_.get(), slots_ * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                                 c_.stream));
      CUDA_CHECK(cudaMemsetAsync(maxima_.get(), 0, slots_ * sizeof(std::uint32_t), c_.stream));
    }
    c_.wait_for_stream();  // the one wait: polls, with NCCL's error check (the copies are to pinned memory)
    if (!maxima.empty()) std::copy(host_maxima_, host_maxima_ + slots_, maxima.begin());
    return {host_counts_[0], host_counts_[1]};
  }

 private:
  std::size_t checked(std::size_t slot) const {
    MNIST_CHECK(slot < slots_, ExitCode::kRuntime, "fixed point: no slot " + std::to_string(slot));
    return slot;
  }
  Context& c_;
  std::int64_t count_;
  std::size_t slots_;
  DeviceArray<std::int64_t> q_;           // count_ integers, then the two counters
  DeviceArray<std::uint32_t> maxima_;     // slots_: the largest magnitudes' bits
  std::int64_t* host_counts_ = nullptr;   // pinned: 2, then host_maxima_
  std::uint32_t* host_maxima_ = nullptr;  // (slots_), in host_counts_'s block
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, GpuPrecision precision) {
    c_.device = device;
    c_.tf32 = precision == GpuPrecision::kTf32;
    c_.bf16 = precision == GpuPrecision::kBf16;
    const bool tf32 = c_.tf32;
    CUDA_CHECK(cudaSetDevice(device));
    if (c_.bf16) {  // Note [bf16 on the GPU]: bf16 tensor cores came with compute capability 8.0
      cudaDeviceProp prop{};
      CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
      MNIST_CHECK(prop.major >= 8, ExitCode::kUsage,
                  "--precision bf16 needs a GPU with bf16 tensor cores (compute capability 8.0 or later); GPU " +
                      std::to_string(device) + " (" + prop.name + ") is sm_" + std::to_string(prop.major) +
                      std::to_string(prop.minor) + ": use --precision fp32 or tf32 there");
    }
    CUDA_CHECK(cudaStreamCreateWithFlags(&c_.stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&c_.sync_event, cudaEventDisableTiming));
    CUDNN_CHECK(cudnnCreate(&c_.cudnn));
    CUDNN_CHECK(cudnnSetStream(c_.cudnn, c_.stream));
    CUBLAS_CHECK(cublasCreate(&c_.cublas));
    CUBLAS_CHECK(cublasSetStream(c_.cublas, c_.stream));
    // fp32: cuBLAS's default math, which keeps float GEMMs in float (no TF32); tf32: tensor cores.
    // bf16: the fc layers' cublasGemmEx on bf16 inputs uses bf16 tensor cores in the default math.
    CUBLAS_CHECK(cublasSetMathMode(c_.cublas, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    // A workspace of cuBLAS's own, so that a captured GEMM never allocates (Note [A step as one CUDA graph]).
    cublas_workspace_ = DeviceArray<std::uint8_t>(kCublasWorkspace);
    CUBLAS_CHECK(cublasSetWorkspace(c_.cublas, cublas_workspace_.get(), kCublasWorkspace));
    guard_ = DeviceArray<int>(1);
    agreement_ = DeviceArray<float>(1);
    CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&verdicts_), kVerdictSlots * sizeof(int)));
    for (cudaEvent_t& e : verdict_copied_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    step_args_ = DeviceArray<DeviceStepArgs>(1);
    c_.step_args = step_args_.get();
    CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&args_staging_), kVerdictSlots * sizeof(DeviceStepArgs)));
    for (cudaEvent_t& e : args_copied_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~CudaBackend() override {
    // No checks while tearing down (a destructor must not throw); errors here change nothing.
    if (c_.stream) cudaStreamSynchronize(c_.stream);
    for (cudaEvent_t e : verdict_copied_)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : args_copied_)
      if (e) cudaEventDestroy(e);
    if (verdicts_) cudaFreeHost(verdicts_);
    if (args_staging_) cudaFreeHost(args_staging_);
    if (c_.cublas) cublasDestroy(c_.cublas);
    if (c_.cudnn) cudnnDestroy(c_.cudnn);
    if (c_.sync_event) cudaEventDestroy(c_.sync_event);
    if (c_.stream) cudaStreamDestroy(c_.stream);
  }

  std::string name() const override {
    return std::string("cuda (") + (c_.bf16 ? "bf16" : c_.tf32 ? "tf32" : "fp32") + ")";
  }
  std::unique_ptr<Buffer> allocate(std::int64_t count) override { return std::make_unique<DeviceBuffer>(count); }

  std::unique_ptr<LayerKernel> make_layer(const LayerSpec& l, int index, const LayerBuffers& b,
                                          bool training) override {
    switch (l.kind) {
      case LayerKind::kConv:
        return cuda::make_conv(c_, l, index, b, training);
      case LayerKind::kFc:
        return cuda::make_fc(c_, l, b, training);
      case LayerKind::kMaxPool:
        return cuda::make_maxpool(c_, l, b, training);
      case LayerKind::kRelu:
        return cuda::make_relu(c_, l, b, training);
      case LayerKind::kDropout:
        return cuda::make_dropout(c_, l, index, b, training);
      case LayerKind::kFlatten:
        return cuda::make_flatten(c_, l, b);
      case LayerKind::kBatchNorm:
        return cuda::make_batchnorm(c_, l, b, training);
    }
    throw_error(ExitCode::kRuntime, "unknown layer kind");
  }

  // Note [Choosing cuDNN algorithms] (conv.cpp), rank 0's timing: local work.
  ConvTiming time_convolutions(const ModelSpec& spec, int batch) override {
    ConvTiming t;
    double ms_total = 0.0, ms[3];
    for (std::size_t i = 0; i < spec.layers.size(); ++i) {
      if (spec.layers[i].kind != LayerKind::kConv) continue;
      const cuda::MeasuredConv m = cuda::measure_conv(c_, spec.layers[i], batch, /*needs_dx=*/i > 0, ms);
      t.table.insert(t.table.end(), {m.fwd, m.bwd_data, m.bwd_filter});
      ms_total += ms[0] + ms[1] + ms[2];
    }
    std::ostringstream line;
    line << "convolutions: algorithms timed on rank 0 (--conv-algos measured), the fastest deterministic each, "
         << std::fixed << std::setprecision(3) << ms_total << " ms per step by cudnnFind; every rank uses them";
    t.banner = line.str();
    return t;
  }
  // Rank 0's table, into the training model's convolutions: on rank 0 as soon as that model is
  // built, on the others once training starts (Rig::connect).
  void use_measured_convolutions(const ModelSpec& spec, std::span<const std::int32_t> table) override {
    std::size_t k = 0;
    for (std::size_t i = 0; i < spec.layers.size(); ++i) {
      if (spec.layers[i].kind != LayerKind::kConv) continue;
      MNIST_CHECK(k + 3 <= table.size(), ExitCode::kRuntime, "--conv-algos measured: rank 0's table is too short");
      const cuda::MeasuredConv m{table[k], table[k + 1], table[k + 2]};
      k += 3;
      const auto conv = c_.retune.find(static_cast<int>(i));
      if (m.fwd >= 0 && conv != c_.retune.end()) conv->second(m);
    }
  }

  void softmax_cross_entropy(const float* logits, const std::int32_t* labels, int batch, int classes, float* dlogits,
                             float grad_scale, LossMeter& meter) override {
    launch_softmax_xent(c_.stream, logits, labels, batch, classes, dlogits, grad_scale,
                        static_cast<DeviceLossMeter&>(meter).sums(), guard_.get());
  }
  std::unique_ptr<LossMeter> make_loss_meter() override { return std::make_unique<DeviceLossMeter>(c_); }

  std::unique_ptr<DataSource> make_data_source(const Split& split, int batch) override {
    return std::make_unique<DeviceDataSource>(c_, split, batch);
  }

  // The optimiser's pass on the device, and its step count there (Note [The optimiser's step
  // count] in include/mnist_mpi/backend/optimizer_pass.hpp).
  class DeviceOptimizerPass final : public OptimizerPass {
   public:
    DeviceOptimizerPass(CudaBackend& b, const OptimizerConfig& cfg, ParameterStore* store)
        : b_(b), cfg_(cfg), store_(store) {}
    void begin_step(double lr) override {
      MNIST_CHECK(b_.c_.host_args.lr == lr, ExitCode::kRuntime,
                  "the optimizer's step: the step's device arguments hold another learning rate (call "
                  "Backend::set_step_args before the step)");
      launch_count_step(b_.c_.stream, state_.get(), b_.guard_.get(), cfg_.beta1, cfg_.beta2, &b_.c_.step_args->lr);
    }
    std::int64_t read() override {
      DeviceStepState host;
      b_.c_.wait_for_stream();
      CUDA_CHECK(cudaMemcpyAsync(&host, state_.get(), sizeof host, cudaMemcpyDeviceToHost, b_.c_.stream));
      b_.c_.wait_for_stream();
      return host.t;
    }
    void set(std::int64_t t) override {
      b_.c_.wait_for_stream();
      CUDA_CHECK(cudaMemcpyAsync(&state_.get()->t, &t, sizeof t, cudaMemcpyHostToDevice, b_.c_.stream));
      b_.c_.wait_for_stream();
    }
    void update(float* params, const float* grads, float* m, float* v, std::int64_t n) override {
      launch_optimizer(b_.c_.stream, cfg_, state_.get(), params, grads, m, v, n, b_.guard_.get());
      if (store_) store_->changed(params, params + n);  // Note [The parameters and their copies]
    }
    // LAMB (Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp). The norms' device
    // limbs take under 2^32 per element (kernels.cu), so a slot is exact up to 2^32 elements a step.
    void set_norm_slots(std::int64_t slots) override {
      static_assert(kLambNormBins == kNormBins, "the device's norm bins are exact_norm.hpp's");
      norms_ = DeviceArray<unsigned long long>(slots * kLambNormWords);
      host_norms_.assign(static_cast<std::size_t>(slots * kLambNormWords), 0);
      counted_.assign(static_cast<std::size_t>(slots), 0);
    }
    void direction(const float* params, float* grads, float* m, float* v, std::int64_t n, std::int64_t slot) override {
      unsigned long long* norms = nullptr;
      if (slot >= 0) {
        MNIST_CHECK(slot < static_cast<std::int64_t>(counted_.size()), ExitCode::kRuntime,
                    "the optimiser pass: a norm slot it has no room for");
        std::int64_t& counted = counted_[static_cast<std::size_t>(slot)];
        counted += n;
        MNIST_CHECK(counted < (std::int64_t{1} << 32), ExitCode::kUsage,
                    "--optimizer lamb on a GPU: a tensor of " + std::to_string(counted) +
                        " elements on one rank is beyond the exact norms' 2^32 (shard it over more ranks)");
        norms = norms_.get() + slot * kLambNormWords;
      }
      launch_lamb_direction(b_.c_.stream, cfg_, state_.get(), params, grads, m, v, n, b_.guard_.get(), norms);
    }
    void take_norms(std::span<std::int64_t> limbs) override {
      MNIST_CHECK(limbs.size() == host_norms_.size() / 2 * kNormLimbs, ExitCode::kRuntime,
                  "the optimiser pass: the norms' limbs are not the size of its slots");
      if (host_norms_.empty()) return;
      b_.c_.wait_for_stream();
      const std::size_t bytes = host_norms_.size() * sizeof(unsigned long long);
      CUDA_CHECK(cudaMemcpyAsync(host_norms_.data(), norms_.get(), bytes, cudaMemcpyDeviceToHost, b_.c_.stream));
      CUDA_CHECK(cudaMemsetAsync(norms_.get(), 0, bytes, b_.c_.stream));
      b_.c_.wait_for_stream();
      // Each bin's two limbs (low halves, high halves of its words) as canonical 32-bit limbs.
      for (std::size_t bin = 0; bin < host_norms_.size() / 2; ++bin) {
        const NormBin value =
            static_cast<NormBin>(host_norms_[2 * bin]) + (static_cast<NormBin>(host_norms_[2 * bin + 1]) << 32);
        for (int j = 0; j < kNormLimbs; ++j)
          limbs[bin * kNormLimbs + static_cast<std::size_t>(j)] +=
              static_cast<std::int64_t>(static_cast<std::uint64_t>(value >> (32 * j)) & 0xffffffffu);
      }
      std::fill(counted_.begin(), counted_.end(), 0);
    }
    void apply_direction(float* params, const float* u, std::int64_t n, float rate) override {
      launch_lamb_apply(b_.c_.stream, params, u, n, rate, b_.guard_.get());
      if (store_) store_->changed(params, params + n);
    }

   private:
    CudaBackend& b_;
    OptimizerConfig cfg_;
    ParameterStore* store_;
    DeviceArray<DeviceStepState> state_{1};  // zero: t = 0
    DeviceArray<unsigned long long> norms_;  // (slots, kLambNormWords)
    std::vector<unsigned long long> host_norms_;
    std::vector<std::int64_t> counted_;  // (slots): elements added since the last take_norms
  };
  std::unique_ptr<FixedPointPasses> make_fixed_point_passes(std::int64_t count, std::size_t slots) override {
    return std::make_unique<DevicePasses>(c_, count, slots);
  }
  bool host_buffers() const override { return false; }
  std::unique_ptr<OptimizerPass> make_optimizer_pass(const OptimizerConfig& cfg, ParameterStore* store) override {
    return std::make_unique<DeviceOptimizerPass>(*this, cfg, store);
  }

  // Note [Non-finite steps] (include/mnist_mpi/backend/step_guard.hpp), on the device. The flag
  // starts at zero (DeviceArray), so callers that never use a guard (tests, evaluation) see no effect.
  class Guard final : public StepGuard {
   public:
    Guard(CudaBackend& b, bool keep_verdict) : b_(b), keep_verdict_(keep_verdict) {}
    void begin_step() override {
      if (!keep_verdict_) CUDA_CHECK(cudaMemsetAsync(b_.guard_.get(), 0, sizeof(int), b_.c_.stream));
    }
    // The loss kernel checks itself (launch_softmax_xent with the flag); the hook poisons on the device.
    void after_loss(LossMeter&, float* dlogits, bool poison) override {
      if (poison) launch_poison(b_.c_.stream, dlogits, b_.guard_.get());
    }
    bool bucket_ok(const float* grads, std::int64_t n) override {
      launch_finite_check(b_.c_.stream, grads, n, b_.guard_.get());
      return true;  // the optimiser pass reads the flag itself
    }
    // The flag as a float (NaN when kNonfiniteGradient), summed over the ranks on the device in
    // stream order, and checked back into the flag: no host synchronisation.
    bool agree(Communicator& comm) override {
      launch_flag_to_float(b_.c_.stream, b_.guard_.get(), b_.agreement_.get());
      comm.allreduce_sum(std::span<float>(b_.agreement_.get(), 1));
      launch_finite_check(b_.c_.stream, b_.agreement_.get(), 1, b_.guard_.get());
      return true;
    }
    void end_step(std::int64_t step) override {
      const int slot = static_cast<int>(step % kVerdictSlots);
      CUDA_CHECK(
          cudaMemcpyAsync(b_.verdicts_ + slot, b_.guard_.get(), sizeof(int), cudaMemcpyDeviceToHost, b_.c_.stream));
      CUDA_CHECK(cudaEventRecord(b_.verdict_copied_[slot], b_.c_.stream));
    }
    int verdict(std::int64_t step) override {
      const int slot = static_cast<int>(step % kVerdictSlots);
      b_.c_.wait_for_event(b_.verdict_copied_[slot]);  // polls, with NCCL's error check between polls
      return b_.verdicts_[slot];
    }
    std::int64_t lag() const override { return kVerdictLag; }

   private:
    CudaBackend& b_;
    bool keep_verdict_;
  };
  std::unique_ptr<StepGuard> make_step_guard(bool keep_verdict) override {
    return std::make_unique<Guard>(*this, keep_verdict);
  }
  void add(float* dst, const float* src, std::int64_t n) override { launch_add(c_.stream, dst, src, n); }
  void copy(float* dst, const float* src, std::int64_t n) override {
    CUDA_CHECK(
        cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice, c_.stream));
  }
  void scale(float* x, float a, std::int64_t n) override { cuda::launch_scale(c_.stream, x, a, n); }
  // Copies between pageable host memory and the device may block the host inside the CUDA call,
  // where no NCCL error can be polled; so the stream is drained by polling first, and the copy
  // then waits for nothing queued before it.
  void upload(std::span<const float> host, float* dst) override {
    c_.wait_for_stream();
    CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), host.size_bytes(), cudaMemcpyHostToDevice, c_.stream));
    c_.wait_for_stream();
  }
  void download(const float* src, std::span<float> host) override {
    c_.wait_for_stream();
    CUDA_CHECK(cudaMemcpyAsync(host.data(), src, host.size_bytes(), cudaMemcpyDeviceToHost, c_.stream));
    c_.wait_for_stream();
  }
  void synchronize() override { c_.wait_for_stream(); }
  void set_wait_timeout(double seconds) override { c_.wait.timeout_s = seconds; }

  // Note [A step as one CUDA graph]: through pinned staging slots, so the copy never blocks the
  // host; slot s % 4 is refilled only once its copy of four steps ago has run (long since).
  void set_step_args(std::int64_t step, double lr, std::int64_t batch_offset) override {
    const int slot = static_cast<int>(step % kVerdictSlots);
    if (args_used_[slot]) c_.wait_for_event(args_copied_[slot]);
    args_staging_[slot] = DeviceStepArgs{step, batch_offset, lr};
    CUDA_CHECK(cudaMemcpyAsync(step_args_.get(), args_staging_ + slot, sizeof(DeviceStepArgs), cudaMemcpyHostToDevice,
                               c_.stream));
    CUDA_CHECK(cudaEventRecord(args_copied_[slot], c_.stream));
    args_used_[slot] = true;
    c_.host_args = args_staging_[slot];
  }

  class Graph final : public StepGraph {
   public:
    explicit Graph(Context& c) : c_(c) {}
    ~Graph() override {
      if (exec_) cudaGraphExecDestroy(exec_);
    }
    bool captured() const override { return exec_ != nullptr; }
    void capture(const std::function<void()>& body) override {
      MNIST_CHECK(!exec_, ExitCode::kRuntime, "the step's CUDA graph was captured twice");
      // Thread-local: the MPI communication thread makes no CUDA calls, and nothing else may
      // sneak into this stream's capture.
      CUDA_CHECK(cudaStreamBeginCapture(c_.stream, cudaStreamCaptureModeThreadLocal));
      cudaGraph_t graph = nullptr;
      try {
        body();
      } catch (...) {
        cudaStreamEndCapture(c_.stream, &graph);  // ends the capture whatever failed; no check
        if (graph) cudaGraphDestroy(graph);
        throw;
      }
      CUDA_CHECK(cudaStreamEndCapture(c_.stream, &graph));
      const cudaError_t rc = cudaGraphInstantiate(&exec_, graph, 0);
      cudaGraphDestroy(graph);
      CUDA_CHECK(rc);
      CUDA_CHECK(cudaGraphUpload(exec_, c_.stream));
    }
    void replay() override { CUDA_CHECK(cudaGraphLaunch(exec_, c_.stream)); }

   private:
    Context& c_;
    cudaGraphExec_t exec_ = nullptr;
  };
  std::unique_ptr<StepGraph> make_step_graph() override { return std::make_unique<Graph>(c_); }

  // Made here, so that the communicator gets this backend's context (its compute stream and wait
  // hook) directly.
  std::unique_ptr<Communicator> make_gradient_communicator(Communicator& world, std::int64_t param_count,
                                                           bool shared_device, bool integer_sums) override {
    if (shared_device) return make_staged_communicator(world, *this, c_, param_count, integer_sums);
    return make_nccl_communicator(world, c_);
  }

 private:
  Context c_;
  // A step's verdict is read kVerdictLag steps after it, so a few copies of the flag are in flight.
  static constexpr int kVerdictSlots = 4;
  static constexpr std::int64_t kVerdictLag = 2;
  static_assert(kVerdictLag < kVerdictSlots);
  static constexpr std::size_t kCublasWorkspace = std::size_t{32} << 20;  // cuBLAS's advice for Hopper
  DeviceArray<std::uint8_t> cublas_workspace_;
  DeviceArray<DeviceStepArgs> step_args_;        // this training step's values (c_.step_args)
  DeviceStepArgs* args_staging_ = nullptr;       // (kVerdictSlots), pinned
  cudaEvent_t args_copied_[kVerdictSlots] = {};  // recorded after each slot's copy
  bool args_used_[kVerdictSlots] = {};
  DeviceArray<int> guard_;                          // the step's kNonfinite* bits, on the device
  DeviceArray<float> agreement_;                    // Guard::agree's cell
  int* verdicts_ = nullptr;                         // (kVerdictSlots), pinned: the flag after step s in slot s % 4
  cudaEvent_t verdict_copied_[kVerdictSlots] = {};  // recorded after each slot's copy
};

}  // namespace

// Note [bf16 on the GPU]
// --precision bf16 on the GPU mirrors Note [bf16 on the CPU] (src/backend/cpu/cpu_backend.cpp):
// the convolutions after the first and the fc layers multiply bf16 copies of their inputs,
// weights and output gradients on bf16 tensor cores and accumulate in float; the master weights,
// the optimiser, the sums over ranks and checkpoints stay fp32, so a bf16 run resumes in fp32 and
// back. The fc layers' cublasGemmEx writes float outputs (y, dx and dW) directly. cuDNN's legacy
// API runs bf16 convolutions in its PSEUDO_BFLOAT16 configuration only (x, w and y of one type,
// float accumulation), so a convolution writes y, dx and dW in bf16 and widens them to float: the
// weight gradient is rounded to bf16 once per step before the sum over ranks (on the CPU, oneDNN
// writes it in float). The first convolution stays float (its input is the images). The copies
// are our kernels (round to nearest even, as oneDNN). Built and compiled here; it has not yet run
// on a GPU (docs/gpu.md), which the gpu_check stage "bf16" does first.
std::unique_ptr<Backend> make_backend(int device, GpuPrecision precision) {
  return std::make_unique<CudaBackend>(device, precision);
}

}  // namespace cuda
}  // namespace mnist_mpi
