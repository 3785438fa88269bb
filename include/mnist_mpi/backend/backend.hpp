// The one interface every backend implements: a layer kernel prepared for its shapes and buffers
// at model build, the softmax cross-entropy loss, buffer allocation, the data set where the
// kernels read it, the fused optimiser pass and host <-> backend copies. The CPU backend
// (src/backend/cpu/, oneDNN plus small loops) is the reference; the CUDA backend
// (src/backend/cuda/, cuDNN, cuBLAS and a few kernels) computes the same things on one GPU.
// Layers and the trainer never know which backend they run on: every pointer a backend takes or
// returns is in ITS memory (host for the CPU, device for CUDA) unless the name says host.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mnist_mpi/config/optimizer_config.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/backend/optimizer_pass.hpp"

namespace mnist_mpi {

class Communicator;  // include/mnist_mpi/comm/communicator.hpp

// What one forward / backward call needs to know besides its buffers.
struct StepContext {
  bool training = true;
  std::uint64_t seed = 0;
  std::int64_t step = 0;          // global step (dropout key)
  std::int64_t first_sample = 0;  // position of this batch's row 0 within the global batch
};

// Note [Activation layouts]
// How one activation buffer holds its (N, C, H, W) values. kPlain is NCHW. kBlockedB is oneDNN's
// nChwBc: (N, C/B, H, W, B), channels in blocks of B, only where B divides C (so the buffer has
// the plain size). A backend may keep activations between its own layers blocked so that no
// layer converts per step; the model's input, its logits and anything a flatten or fc reads stay
// plain. The backend chooses (Backend::activation_layouts) and every kernel is told the layouts of
// its x / dx and y / dy.
enum class Layout { kPlain, kBlocked8, kBlocked16 };

// Buffers of one layer, fixed for the model's lifetime (kernels bind them once, at build).
struct LayerBuffers {
  int batch = 0;
  const float* x = nullptr;          // (N, in.c, in.h, in.w)
  float* y = nullptr;                // (N, out.c, out.h, out.w)
  const float* dy = nullptr;         // like y; null in an inference model
  float* dx = nullptr;               // like x; null when no input gradient is needed (the first layer)
  const float* w = nullptr;          // this layer's weight, then bias, in the flat parameter buffer
  float* dw = nullptr;               // the same range of the flat gradient buffer; null for inference
  Layout x_layout = Layout::kPlain;  // of x and dx
  Layout y_layout = Layout::kPlain;  // of y and dy
};

class LayerKernel {
 public:
  virtual ~LayerKernel() = default;
  virtual void forward(const StepContext& ctx) = 0;
  // Writes dx (when bound) and this layer's parameter gradients (overwritten, not accumulated).
  virtual void backward(const StepContext& ctx) = 0;
  // The implementation chosen, for logs ("conv: jit:avx2").
  virtual std::string describe() const = 0;
};

struct LossStats {
  double loss_sum = 0.0;  // sum over the batch of -log softmax(logits)[label]
  std::int64_t correct = 0;
};

// A float buffer in the backend's memory, owned by the backend.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual float* data() = 0;
  virtual std::int64_t size() const = 0;
};

// Loss statistics summed where the backend computes, read on the host only when asked (on a GPU
// reading is a synchronisation point: the trainer reads only where it prints).
class LossMeter {
 public:
  virtual ~LossMeter() = default;
  virtual LossStats read() = 0;  // the sums since the last reset
  virtual void reset() = 0;
};

// One split's images (uint8) and labels, placed once where the backend computes; fills a batch
// of [0, 1] floats (x / 255) and int32 labels from it.
class DataSource {
 public:
  virtual ~DataSource() = default;
  // The order of this epoch (dataset indices; a view of the sampler's permutation, valid until
  // the next set_order). A GPU copies it once per epoch.
  virtual void set_order(std::span<const std::int64_t> order) = 0;
  // x (n, 1, rows, cols) and labels() from the images order[position .. position + n).
  virtual void gather(std::int64_t position, std::int64_t n, float* x) = 0;
  // x and labels() from the images [first, first + n) of the split (evaluation).
  virtual void slice(std::int64_t first, std::int64_t n, float* x) = 0;
  virtual const std::int32_t* labels() const = 0;  // (batch), in the backend's memory
};

// Note [Non-finite steps]
// A step whose gradient holds NaN or inf must change no parameter, on every rank alike, and then
// stop the run (or, with --skip-nonfinite-steps, be skipped). The reduced gradient is bitwise the
// same on every rank (Note [Sums in rank order]), so each rank checks it bucket by bucket and all
// reach the same verdict without a collective of their own. A rank whose own loss is not finite
// (or that the testing hook marks) makes its gradient show it: a NaN in dlogits reaches the last
// layer's bias gradient (the sum over the batch of dlogits) before backward hands any bucket to
// the reducer. How a backend keeps the verdict is its own business:
// - On the host (the CPU backend) bucket_ok reads the reduced bucket and answers at once; the
//   step applies no bucket after a bad one, and verdict(step) is known when the step ends (lag 0).
// - A device cannot be read without a synchronisation in the step loop, so the verdict stays on
//   the device: the check of a bucket ORs kNonfiniteGradient into a device flag, the loss kernel
//   ORs kNonfiniteLoss and poisons its gradient, and the fused optimiser pass does nothing while
//   the flag holds kNonfiniteGradient; bucket_ok answers true. So no non-finite value reaches the
//   parameters, whatever the host knows. end_step queues a copy of the flag into pinned host
//   memory and verdict(s) reads it later: the trainer reads step s's verdict after step s + lag(),
//   when the copy has long finished, or at once where it synchronises anyway (a log line, an
//   evaluation, a checkpoint, the end). With keep_verdict (no --skip-nonfinite-steps) the flag
//   is never cleared, so nothing is updated after a non-finite step until the host stops the run.
// With --skip-nonfinite-steps the step waits for and checks every bucket before it applies the
// first, so that a skipped step changes nothing on either kind of backend.
// With --shard-optimizer a rank receives, and checks, only its shard of each bucket's sum, so the
// ranks' verdicts may differ; agree() makes them one: kNonfiniteGradient becomes the OR over every
// rank, by one collective of the gradient communicator. The step calls it after the last bucket
// is checked (with --skip-nonfinite-steps before the first is applied). Before it, a rank that
// refused a shard leaves that shard's parameters alone while the others update theirs; the
// allgather still gives every rank the same bits, so the replicas stay identical, and the run
// stops after the step on every rank alike.
class StepGuard {
 public:
  static constexpr int kNonfiniteGradient = 1, kNonfiniteLoss = 2;
  virtual ~StepGuard() = default;
  virtual void begin_step() = 0;
  // After each micro-batch's loss went into `meter` and its gradient into dlogits (poison: the
  // testing hook marks this rank's loss as non-finite, last micro-batch only).
  virtual void after_loss(LossMeter& meter, float* dlogits, bool poison) = 0;
  // Whether the reduced gradient grads[0, n) of one bucket (or of this rank's shard of it) may be
  // applied.
  virtual bool bucket_ok(const float* grads, std::int64_t n) = 0;
  // Collective on comm (the gradient communicator): the step's kNonfiniteGradient, ORed over
  // every rank. Returns whether the step may be applied (a device answers true: its passes read
  // the flag).
  virtual bool agree(Communicator& comm) = 0;
  virtual void end_step(std::int64_t step) = 0;
  // kNonfinite* bits of step `step` (0: finite); asked once per step, in order, at most lag() + 1
  // steps after its end (a device keeps a few verdicts in flight, not all).
  virtual int verdict(std::int64_t step) = 0;
  virtual std::int64_t lag() const = 0;  // after how many more steps the trainer reads a verdict
};

// Note [A step as one CUDA graph]
// On a GPU a training step is ~100 small kernel launches, cuDNN and cuBLAS calls and NCCL sums;
// with --cuda-graph the step is captured once into a CUDA graph and replayed, one launch per step.
// A replay repeats the captured arguments, so everything that changes from step to step is read
// from device memory instead: the step (dropout's key), the batch's offset in the epoch's order
// (the gathers) and the learning rate (the optimiser's step count computes its scalars on the
// device, Note [The optimiser's step count]). set_step_args queues them before each step, graph
// or not, so the ungraphed step runs the very same kernels on the very same values. What stays
// fixed is fixed by the run: the buffers, each micro-batch's size and first sample, the buckets.
// The epoch's order is uploaded between steps. Not captured: a step the testing hook poisons, and
// the verdict's copy (StepGuard::end_step, whose slot changes). The replay gave the ungraphed
// step's bits on an H200 with one rank (scripts/gpu_check.sh compares params_hash; docs/gpu.md);
// off by default until a run with NCCL across two or more GPUs shows the same.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
  virtual bool captured() const = 0;
  // Records what body() queues (nothing runs) and makes it replayable; throws if the capture fails.
  virtual void capture(const std::function<void()>& body) = 0;
  virtual void replay() = 0;  // queues one run of the captured step
};

// Note [Host copies]
// Checkpoints, replica hashes and the initial parameters need the training state in host memory.
// On the CPU that is the buffers themselves, with nothing copied; on a device, host buffers that
// to_host() fills and to_backend() writes back (each a synchronisation point). Callers use the
// same calls for both and never ask where the buffers live.
class HostCopy {
 public:
  virtual ~HostCopy() = default;
  virtual float* host(std::size_t i) = 0;  // buffers[i] in host memory
  virtual void to_host() = 0;              // every buffer, backend -> host
  virtual void to_backend() = 0;           // every buffer, host -> backend
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual std::unique_ptr<Buffer> allocate(std::int64_t count) = 0;  // zero-filled
  // The layout of every activation of the model (layers.size() + 1 entries: entry i is layer i's
  // input; the first and the last must be kPlain). Default: all plain.
  virtual std::vector<Layout> activation_layouts(const ModelSpec& spec) const {
    return std::vector<Layout>(spec.layers.size() + 1, Layout::kPlain);
  }
  // index: the layer's position in the spec (dropout key). training=false builds inference only.
  virtual std::unique_ptr<LayerKernel> make_layer(const LayerSpec& spec, int index, const LayerBuffers& buffers,
                                                  bool training) = 0;
  // Softmax cross-entropy from logits (N, classes), computed stably via log-sum-exp, added to
  // meter. When dlogits is non-null writes dlogits = (softmax - onehot) * grad_scale.
  virtual void softmax_cross_entropy(const float* logits, const std::int32_t* labels, int batch, int classes,
                                     float* dlogits, float grad_scale, LossMeter& meter) = 0;
  virtual std::unique_ptr<LossMeter> make_loss_meter() = 0;
  // The same on a fresh meter, read at once (tests; a synchronisation point on a GPU).
  LossStats softmax_cross_entropy(const float* logits, const std::int32_t* labels, int batch, int classes,
                                  float* dlogits, float grad_scale) {
    auto meter = make_loss_meter();
    softmax_cross_entropy(logits, labels, batch, classes, dlogits, grad_scale, *meter);
    return meter->read();
  }

  // batch: the largest n that gather / slice will be asked for.
  virtual std::unique_ptr<DataSource> make_data_source(const Split& split, int batch) = 0;

  // The optimiser's pass and step count on this backend's memory (Note [The optimiser's step
  // count] in include/mnist_mpi/backend/optimizer_pass.hpp).
  virtual std::unique_ptr<OptimizerPass> make_optimizer_pass(const OptimizerConfig& cfg) = 0;
  // dst[i] += src[i] and dst[i] = src[i] on the backend's buffers (gradient accumulation).
  virtual void add(float* dst, const float* src, std::int64_t n) = 0;
  virtual void copy(float* dst, const float* src, std::int64_t n) = 0;

  // Host <-> backend copies (parameters broadcast and checkpointed, replica hashes); both return
  // once the copy is complete, so they are synchronisation points on a GPU.
  virtual void upload(std::span<const float> host, float* dst) = 0;
  virtual void download(const float* src, std::span<float> host) = 0;
  // A guard for the steps of one training run (Note [Non-finite steps]); keep_verdict: without
  // --skip-nonfinite-steps, a device guard never clears its flag once set.
  virtual std::unique_ptr<StepGuard> make_step_guard(bool keep_verdict) = 0;
  // Host copies of `buffers` (count floats each, in this backend's memory) for checkpoints,
  // replica hashes and initialisation (Note [Host copies]). The default keeps host vectors and
  // copies with download / upload; the CPU backend hands out the buffers themselves.
  virtual std::unique_ptr<HostCopy> make_host_copy(std::vector<float*> buffers, std::int64_t count);
  // Refuses (Error kResources) a model whose training would not fit this backend's memory, before
  // anything is allocated (Note [Will the model fit?]); a backend that reports its own
  // out-of-memory errors keeps the default, which accepts.
  virtual void check_model_fits(const ModelSpec& spec, std::int64_t batch, std::int64_t eval_batch, bool adam,
                                bool evaluates) const {
    (void)spec, (void)batch, (void)eval_batch, (void)adam, (void)evaluates;
  }
  // Returns once every queued kernel has finished (a no-op on the CPU).
  virtual void synchronize() {}
  // The values of training step `step` that a replayed graph reads from device memory (Note [A step
  // as one CUDA graph]): its learning rate and the offset of its global batch in the epoch's order.
  // Called before every training step; the CPU reads them from its arguments and ignores this.
  virtual void set_step_args(std::int64_t step, double lr, std::int64_t batch_offset) {
    (void)step, (void)lr, (void)batch_offset;
  }
  // A graph for the training step (--cuda-graph); null where the backend has none (the CPU).
  virtual std::unique_ptr<StepGraph> make_step_graph() { return nullptr; }
  // The deadline of every host wait on the device, in seconds (--collective-timeout; 0: none):
  // Note [Device waits have a deadline] in include/mnist_mpi/comm/watchdog.hpp. The CPU has no
  // device waits; its blocking collectives have the watchdog.
  virtual void set_wait_timeout(double seconds) { (void)seconds; }
  // --conv-algos measured (Note [Choosing cuDNN algorithms] in src/backend/cuda/conv.cpp), in two
  // halves, so that set-up stays local work (Note [Ending every rank] in src/main.cpp). Rank 0 calls
  // time_convolutions in its set-up: it times each convolution's algorithms for the training model
  // (spec, batch images per rank) and returns the fastest deterministic ones, three per convolution
  // in layer order (forward, backward-data, backward-filter; -1: none), with a line for the banner.
  // use_measured_convolutions rebuilds the built training model's convolutions with such a table
  // (-1: that one stays as it is): rank 0 at once, the others when they receive it as training
  // starts. The defaults (the CPU, where oneDNN chooses) time and change nothing.
  struct ConvTiming {
    std::vector<std::int32_t> table;
    std::string banner;
  };
  virtual ConvTiming time_convolutions(const ModelSpec& spec, int batch) {
    (void)spec, (void)batch;
    return {};
  }
  virtual void use_measured_convolutions(const ModelSpec& spec, std::span<const std::int32_t> table) {
    (void)spec, (void)table;
  }
  // The communicator that sums this backend's gradients and broadcasts its parameters (buffers of
  // at most param_count elements), made from `world`, which must outlive it and which takes every
  // host collective; it must be destroyed before this backend. null: sum the gradients with
  // `world` itself (the CPU). The CUDA backend returns NCCL's, or, when ranks share a GPU
  // (shared_device: NCCL needs one GPU per rank), one that sums through host memory with `world`.
  virtual std::unique_ptr<Communicator> make_gradient_communicator(Communicator& world, std::int64_t param_count,
                                                                   bool shared_device);
};

// The CPU backend's cross-layer fusions (src/backend/cpu/conv.cpp), all on by default; tests and
// A/B runs turn them off to compare.
struct CpuFusions {
  bool pool_gradient = true;      // Note [The first convolution reads its pool's gradient]
  bool conv_pool_forward = true;  // Note [The first convolution and its pool in one pass]
  bool relu_into_pool = true;     // Note [A ReLU taken over by its max pool] (src/backend/cpu/pool.cpp)
  bool pool_backward_tiles = true;  // Note [A 2 x 2 pool's gradient in one pass] (src/backend/cpu/pool.cpp)
  // The kernels written with AVX2 intrinsics, where the CPU has AVX2 (and FMA); false: their
  // portable versions, which give the same bits (BlockedLayouts tests compare the two).
  bool avx2_kernels = true;
};

// --threads: the number of threads each rank's kernels use.
std::unique_ptr<Backend> make_cpu_backend(int threads, CpuFusions fusions = {});

// The CUDA backend on GPU `device` (already chosen, see include/mnist_mpi/backend/device.hpp);
// tf32: let cuDNN and cuBLAS use TF32 tensor cores for float math. Only in builds with CUDA
// (MNIST_MPI_HAVE_CUDA); elsewhere it throws Error(kDevice).
std::unique_ptr<Backend> make_cuda_backend(int device, bool tf32);

}  // namespace mnist_mpi
