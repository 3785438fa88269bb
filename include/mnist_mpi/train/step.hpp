// One global step of one rank: the gradient pipeline chosen for the run
// (include/mnist_mpi/train/gradient_pipeline.hpp: micro-batches, or --exact-sums' chunks) makes
// this rank's gradient and starts its sums; then every bucket is waited for, checked (Note
// [Non-finite steps]) and applied by the optimiser as soon as its sum is in. The step knows nothing of logging, evaluation or checkpoints: it
// returns what happened, and the trainer's loop (src/train/trainer.cpp) does the rest.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mnist_mpi/train/gradient_pipeline.hpp"  // StepParts, StepShape

namespace mnist_mpi {

struct StepResult {
  StepTiming timing;  // host seconds of the parts of this step
  std::chrono::steady_clock::time_point begin, end;
};

class Step {
 public:
  // pipeline: made on the same parts and shape (make_summed_pipeline, make_exact_pipeline).
  Step(const StepParts& parts, const StepShape& shape, std::unique_ptr<GradientPipeline> pipeline);
  // Runs global step `step` with learning rate lr. poison: the testing hook marks this rank's loss
  // as non-finite (MNIST_MPI_FAULT=RANK:STEP:nan).
  StepResult run(std::int64_t step, double lr, bool poison);
  std::int64_t graph_replays() const { return replays_; }  // --cuda-graph: steps run as the captured graph
  // How the gradient pipeline runs (--exact-sums: its chunks, Note [The row-wise tail at the
  // rank's batch]), for the banner; "" for the default one.
  std::string plan() const { return pipeline_->plan(); }
  // The training layers' kernels as they run.
  std::string describe_layers() const { return pipeline_->describe_layers(); }

 private:
  // The step's work, queued (or, inside a graph capture, recorded); adds host times to `timing`.
  void body(std::int64_t step, double lr, bool poison, StepTiming& timing);
  void use_order(std::int64_t epoch);  // the data source's order is that of `epoch`
  // Waits for every bucket's sum, checks it and applies it; stops applying at the first bucket the
  // guard refuses (every sum is still waited for: none is left in flight). sums_in: every bucket's
  // sum is already in (the exact pipeline); all are checked before any is applied.
  void apply(std::int64_t step, double lr, std::chrono::steady_clock::time_point backward_end, StepTiming& t,
             bool sums_in = false);

  StepParts p_;
  StepShape shape_;
  std::unique_ptr<GradientPipeline> pipeline_;  // made once, by the caller
  std::int64_t order_epoch_ = -1;           // the epoch whose order p_.data holds
  std::unique_ptr<StepGraph> graph_;        // --cuda-graph: the step, captured at its second run
  std::int64_t runs_ = 0;                   // steps run by this Step
  std::int64_t replays_ = 0;                // of them, replays of the graph
};

}  // namespace mnist_mpi
