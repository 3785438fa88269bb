// The training loop of one rank. Set-up plans the run (include/mnist_mpi/train/run_plan.hpp) and
// builds its parts (the rig: include/mnist_mpi/train/rig.hpp); run() is the loop: one Step per
// global step (include/mnist_mpi/train/step.hpp: the slice of the global batch, forward, loss,
// backward, the bucketed reduction, the update), evaluation (the Evaluator: every rank evaluates a
// share of a split), the checks of resilience/ (non-finite steps, replicas, the testing hook's
// faults) and the step boundary (checkpoints, signals). What a person sees is the Monitor's
// (include/mnist_mpi/report/monitor.hpp): the trainer hands it plain facts and formats nothing.
// Construction does only local work (so that set-up errors can be agreed on by all ranks before
// any collective, see Note [Ending every rank] in src/main.cpp); run() does the collectives.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mnist_mpi/backend/device.hpp"
#include "mnist_mpi/checkpoint/checkpointer.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/launch/launch_env.hpp"
#include "mnist_mpi/report/run_telemetry.hpp"
#include "mnist_mpi/resilience/fault.hpp"
#include "mnist_mpi/resilience/nonfinite_steps.hpp"
#include "mnist_mpi/train/evaluator.hpp"
#include "mnist_mpi/train/rig.hpp"
#include "mnist_mpi/train/run_plan.hpp"
#include "mnist_mpi/train/step_boundary.hpp"

namespace mnist_mpi {

struct RunResult {
  StepTiming timing;  // seconds per step, averaged over the steady steps (the first 10 excluded)
  std::int64_t steps = 0;
  double epochs = 0.0;
  double last_train_loss = 0.0;  // global mean of the last logged step
  EvalResult test;               // the same numbers on every rank (the loss's last bits aside)
  double wall_s = 0.0;
  double images_per_s = 0.0;  // steady: first 10 steps and evaluation excluded
  std::string params_hash;
  std::int64_t first_step = 0;     // > 0 when resumed from a checkpoint
  int preempted_signal = 0;        // the signal that stopped the run early (exit code 75), else 0
  CheckpointStats checkpoints;     // rank 0's numbers (others_wait_* from every rank)
  std::int64_t skipped_steps = 0;  // non-finite steps skipped (--skip-nonfinite-steps)
  TargetFacts target;              // --target-accuracy: whether and where it was reached
  // Training finished but an output (metrics, TensorBoard, timeline, report, stdout) could not be
  // written: exit code 7, on every rank alike (Note [When an output cannot be written]).
  bool outputs_lost = false;
};

class Trainer final : private CheckpointSource {
 public:
  // start: when the process started (for the start-up time); defaults to now.
  Trainer(const Options& options, Communicator& comm,
          std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now());
  RunResult run();
  // The split with the current parameters. Collective: every rank evaluates a share of the
  // split's batches and all learn the result (Note [Every rank evaluates a share] in src/train/evaluator.cpp).
  EvalResult evaluate(SplitKind split) { return rig_->evaluator->evaluate(split); }
  // The whole split on this rank alone (no collective): what evaluate() must agree with.
  EvalResult evaluate_alone(SplitKind split) { return rig_->evaluator->evaluate_alone(split); }
  // This rank's images in the last evaluation.
  std::int64_t last_eval_images() const { return rig_->evaluator->last_images(); }

  std::string layer_descriptions() const { return rig_->train_model->describe(); }  // the banner's lines
  const ModelSpec& spec() const { return spec_; }
  const Mnist& data() const { return data_; }
  const Reducer& reducer() const { return *rig_->reducer; }
  // The flat parameters in the backend's memory (device memory on a GPU).
  const float* params() const { return rig_->params->data(); }
  // A host copy of them (a synchronisation point on a GPU).
  std::vector<float> params_to_host();
  Backend& backend() { return *rig_->backend; }
  Optimizer& optimizer() { return *rig_->optimizer; }
  const DeviceChoice& device() const { return device_.choice; }
  std::int64_t global_batch() const { return plan_.global_batch; }
  std::int64_t per_rank_batch() const { return plan_.batch; }                 // per micro-batch
  std::int64_t graph_replays() const { return rig_->step->graph_replays(); }  // --cuda-graph
  // "key = value" lines that must be the same on every rank: program version, options (those
  // that may differ per node left out), model and data sizes (src/comm/consistency.cpp).
  std::string job_description() const;
  // The four MNIST files this rank loaded, with their digests (check_same_data()).
  const std::vector<DataFile>& data_files() const { return data_.files; }

 private:
  void check_replicas(std::int64_t step);  // include/mnist_mpi/resilience/replicas.hpp
  void log_training_loss(std::int64_t step, double lr, RunResult& res);
  EvalResult evaluate_during_training(std::int64_t step, bool epoch_end, bool eval_now);
  bool target_reached(std::int64_t step, const EvalResult& validation, TargetFacts& target);
  StepBoundary::Decision checkpoint_or_stop(std::int64_t step, bool epoch_end, bool last, double lr,
                                            const EvalResult& validation);
  RunResult stopped(std::int64_t step, RunResult& res);
  RunResult finished(std::int64_t first_step, std::int64_t end_step, RunResult& res);
  void final_report(RunResult& res);
  void ended(std::int64_t steps, RunResult& res);
  // CheckpointSource
  void settle() override { nonfinite_->settle(current_step_, current_step_); }
  void gather_state() override {
    rig_->optimizer->gather_state(comm_);
    rig_->reducer->gather_codec_state(0);
  }
  TrainingState state() override { return rig_->state(); }

  Options opt_;
  Communicator& comm_;
  std::chrono::steady_clock::time_point start_;
  bool rank0_ = false;
  RunDevice device_;
  LaunchEnv launch_;  // Slurm job, launcher (src/launch/launch_env.cpp)
  Fault fault_;       // MNIST_MPI_FAULT, when it names this rank (a testing hook)
  Mnist data_;
  RunPlan plan_;
  ModelSpec spec_;
  std::unique_ptr<Rig> rig_;                   // every part, built from plan_ (rig.hpp)
  std::unique_ptr<NonfiniteSteps> nonfinite_;  // the guard's verdicts (Note [Non-finite steps])
  std::vector<std::uint64_t> replica_hashes_;  // (world)

  // The loop's state (run()).
  RunClock clock_;  // Note [Timing a step] in src/report/run_telemetry.cpp
  LossWindow loss_window_;
  RankTimesGather rank_times_;  // Note [Every rank's step times] in src/report/run_telemetry.cpp
  std::int64_t current_step_ = 0;
  double logged_loss_ = 0;  // the last logged training loss (NaN before)
};

}  // namespace mnist_mpi
