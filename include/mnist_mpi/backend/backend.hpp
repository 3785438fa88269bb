// The one interface every backend implements: a layer kernel prepared for its shapes and buffers
// at model build (the layer interface: include/mnist_mpi/backend/layer.hpp), the softmax
// cross-entropy loss, buffer allocation, the data set where the kernels read it, the fused
// optimiser pass (optimizer_pass.hpp), the step guard (step_guard.hpp) and host <-> backend
// copies; last, the hooks that only a GPU fills in (the CPU keeps their defaults). Which backend a
// rank gets: include/mnist_mpi/backend/device.hpp; the CPU's own knobs: cpu.hpp. The CPU backend
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

#include "mnist_mpi/backend/fixed_point.hpp"
#include "mnist_mpi/backend/layer.hpp"
#include "mnist_mpi/backend/optimizer_pass.hpp"
#include "mnist_mpi/backend/step_guard.hpp"
#include "mnist_mpi/config/optimizer_config.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi {

class Communicator;    // include/mnist_mpi/comm/communicator.hpp
class ParameterStore;  // include/mnist_mpi/backend/parameter_store.hpp

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
  // Called by Model before it asks for layers [first, end) of spec, in order, at this batch and
  // with these activation layouts (activation_layouts(spec)): a backend that fuses neighbouring
  // layers decides here, per model, which fusions it builds (the CPU: Note [The fusion plan] in
  // src/backend/cpu/fusion.cpp). Default: nothing to plan.
  virtual void plan_model(const ModelSpec& spec, const std::vector<Layout>& layouts, int batch, int first, int end,
                          bool training) {
    (void)spec, (void)layouts, (void)batch, (void)first, (void)end, (void)training;
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
  // count] in include/mnist_mpi/backend/optimizer_pass.hpp), writing the parameters of store (may
  // be null: parameters no model keeps copies of).
  virtual std::unique_ptr<OptimizerPass> make_optimizer_pass(const OptimizerConfig& cfg, ParameterStore* store) = 0;
  // dst[i] += src[i] and dst[i] = src[i] on the backend's buffers (gradient accumulation).
  virtual void add(float* dst, const float* src, std::int64_t n) = 0;
  virtual void copy(float* dst, const float* src, std::int64_t n) = 0;
  // x[i] *= a on the backend's buffer (the model state's mean over the ranks).
  virtual void scale(float* x, float a, std::int64_t n) = 0;

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
  // --exact-sums: the conversions between a chunk's gradient and the integers the reducer sums,
  // for count parameters and `slots` tensors, on this backend's memory
  // (include/mnist_mpi/backend/fixed_point.hpp). The default: host memory.
  virtual std::unique_ptr<FixedPointPasses> make_fixed_point_passes(std::int64_t count, std::size_t slots) {
    return make_host_fixed_point_passes(count, slots);
  }
  // Refuses (Error kResources) a model whose training would not fit this backend's memory, before
  // anything is allocated (Note [Will the model fit?]); a backend that reports its own
  // out-of-memory errors keeps the default, which accepts.
  virtual void check_model_fits(const ModelSpec& spec, std::int64_t batch, std::int64_t eval_batch,
                                OptimizerKind optimizer, bool evaluates) const {
    (void)spec, (void)batch, (void)eval_batch, (void)optimizer, (void)evaluates;
  }
  // ---- Hooks that only a GPU backend fills in; the CPU keeps these defaults, so that the trainer
  // ---- calls them on any backend and has no device branch.
  // Whether the buffers are host memory, which the host may read and write itself (the CPU); a
  // device's are reached through upload, download and HostCopy only.
  virtual bool host_buffers() const { return true; }
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
  // integer_sums (--exact-sums): it also sums param_count + 2 int64 (the staged one makes their
  // buffer then, and only then).
  virtual std::unique_ptr<Communicator> make_gradient_communicator(Communicator& world, std::int64_t param_count,
                                                                   bool shared_device, bool integer_sums);
};

}  // namespace mnist_mpi
