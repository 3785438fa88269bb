// How one step's gradient of the global batch is made on this rank and summed over the ranks,
// chosen once for the run: the pipeline owns the passes of a step up to the moment the optimiser
// may apply the sums, and the step (include/mnist_mpi/train/step.hpp) owns what follows (waiting
// for each bucket, the guard, the optimiser, the gathers). Two pipelines:
//   - summed (src/train/gradient_pipeline.cpp): the rank's micro-batches, forward and backward
//     each, accumulated locally (DDP's no_sync) and, on the last, the float buckets started as
//     layers finish; the sums arrive while the optimiser waits for them;
//   - exact (src/train/exact_pipeline.cpp, --exact-sums): the rank's chunks of the global batch,
//     each chunk's gradient in 64-bit fixed point, summed as integers and turned back once, the
//     step computed again when a value left its range (include/mnist_mpi/train/exact_sums.hpp);
//     every sum is in when it returns.
// What both share is here: a micro-batch's (or chunk's) forward and loss, its host times, and the
// hook that finishes a layer's gradient and starts its buckets.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/data/sampler.hpp"
#include "mnist_mpi/report/timeline.hpp"
#include "mnist_mpi/run_facts.hpp"  // StepTiming
#include "mnist_mpi/train/optimizer.hpp"
#include "mnist_mpi/train/reducer.hpp"

namespace mnist_mpi {

// Where this rank's step runs: the pieces it drives, all owned by the trainer and bound once.
struct StepParts {
  Backend* backend = nullptr;
  Model* model = nullptr;  // the training model, bound to params and grads
  ParameterStore* params = nullptr;
  Buffer* grads = nullptr;
  Reducer* reducer = nullptr;  // sums grads across the ranks, bucket by bucket
  Optimizer* optimizer = nullptr;
  StepGuard* guard = nullptr;    // the backend's non-finite guard
  Sampler* sampler = nullptr;    // order() caches the epoch's permutation
  DataSource* data = nullptr;    // the training split where the backend computes
  LossMeter* loss = nullptr;     // the training loss, summed over the log window
  Timeline* timeline = nullptr;  // null unless --timeline
};

// The shape of the step, fixed for the run.
struct StepShape {
  int rank = 0, world = 1;
  std::int64_t accumulation = 1;  // micro-batches per rank per step
  std::int64_t batch = 0;         // images the model holds: the largest micro-batch (Note [Uneven slices])
  std::int64_t global_batch = 0;  // the sum of every rank's micro-batches
  std::uint64_t seed = 0;         // dropout key
  bool check_all_first = false;   // --skip-nonfinite-steps: every bucket checked before any is applied
  bool graph = false;             // --cuda-graph: Note [A step as one CUDA graph]
  std::int64_t slow_ms = 0;  // MNIST_MPI_FAULT=RANK:slow:MS: this rank sleeps in every step's backward
  bool local_dropout_key = false;  // MNIST_MPI_FAULT=RANK:dropout:local: a wrong mask, on purpose
};

class GradientPipeline {
 public:
  virtual ~GradientPipeline() = default;
  GradientPipeline(const GradientPipeline&) = delete;
  GradientPipeline& operator=(const GradientPipeline&) = delete;

  struct Computed {
    std::chrono::steady_clock::time_point backward_end;  // when the rank's last backward ended
    bool sums_in = false;  // every bucket's sum is already in (the optimiser need not wait)
  };
  // Step `step`'s gradient: this rank's passes, their buckets started (the guard's step begun);
  // adds host times to `timing`. poison: the testing hook marks this rank's loss non-finite.
  virtual Computed compute(std::int64_t step, bool poison, StepTiming& timing) = 0;
  // The training layers' kernels as they run, for the banner (Model::describe).
  virtual std::string describe_layers() const { return p_.model->describe(); }
  // How the pipeline runs, for the banner ("" when there is nothing to say).
  virtual std::string plan() const { return ""; }
  // Whether a step's work is the same queued work at every step, so that a CUDA graph of it can
  // replay any step (Note [A step as one CUDA graph]).
  virtual bool replayable() const { return true; }
  // MNIST_MPI_FAULT=RANK:slow:MS (include/mnist_mpi/resilience/fault.hpp): this rank sleeps at the
  // end of every step's backward, on every path (the passes here, and the step's replayed CUDA graph).
  void slow_down() const;

 protected:
  GradientPipeline(const StepParts& parts, const StepShape& shape);
  // When a micro-batch's parts began: its data, its forward and loss, its backward.
  struct MicroTimes {
    std::chrono::steady_clock::time_point start, data, loss;
  };
  // One micro-batch (or chunk) up to its backward: its images, forward, the loss (added to `loss`)
  // and its gradient, with the rows past a short slice zeroed, and the guard's look at the loss.
  StepContext forward_and_loss(std::int64_t step, const Slice& slice, LossMeter& loss, bool poison, Timeline* tl,
                               MicroTimes& at);
  // Micro-batch `index`'s spans (the last one's backward is recorded by layer) and host times, its
  // backward ended at `end`.
  void record_micro(std::int64_t step, std::int64_t index, bool last, const MicroTimes& at,
                    std::chrono::steady_clock::time_point end, Timeline* tl, StepTiming& timing);
  // What the pipeline does to a layer's gradient once backward has made it final on the last pass,
  // before its buckets may start.
  virtual void finish_layer(int layer) = 0;

  StepParts p_;
  StepShape shape_;
  float grad_scale_;               // 1 / global batch (Note [Averaging is a scaled sum] in src/train/gradient_pipeline.cpp)
  std::unique_ptr<Buffer> zeros_;  // (batch, classes) of zeros, when some micro-batch is short
  std::vector<std::pair<std::int64_t, std::int64_t>> layer_params_;  // (offset, size) per layer
  std::function<void(int)> on_layer_done_;  // made once: finish_layer, then the layer's buckets start
};

std::unique_ptr<GradientPipeline> make_summed_pipeline(const StepParts& parts, const StepShape& shape);


}  // namespace mnist_mpi
