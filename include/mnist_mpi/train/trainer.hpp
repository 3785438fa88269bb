// The training loop of one rank: set-up (device, data, model, backend, optimiser, reducer,
// checkpointer, monitor), then run(): one Step per global step (include/mnist_mpi/train/step.hpp:
// the slice of the global batch, forward, loss, backward, the bucketed reduction, the update),
// evaluation (every rank evaluates a share of a split: Note [Every rank evaluates a share]), and
// the step boundary (checkpoints, signals, replica checks). What a person sees is the Monitor's
// (include/mnist_mpi/report/monitor.hpp): the trainer hands it plain facts and formats nothing.
// Construction does only local work (so that set-up errors can be agreed on by all ranks before
// any collective, see Note [Ending every rank] in src/main.cpp); run() does the collectives.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/device.hpp"
#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/checkpoint/checkpointer.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/data/sampler.hpp"
#include "mnist_mpi/hash.hpp"  // hash_floats, hex64
#include "mnist_mpi/launch/launch_env.hpp"
#include "mnist_mpi/report/monitor.hpp"
#include "mnist_mpi/resilience/fault.hpp"
#include "mnist_mpi/train/evaluation_loss.hpp"
#include "mnist_mpi/train/exact_sums.hpp"
#include "mnist_mpi/train/optimizer.hpp"
#include "mnist_mpi/train/reducer.hpp"
#include "mnist_mpi/train/step.hpp"
#include "mnist_mpi/train/step_boundary.hpp"

namespace mnist_mpi {

struct EvalResult {
  double accuracy = 0.0;
  double loss = 0.0;  // mean over the split
  std::int64_t count = 0;
};

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
  // split's batches and all learn the result (Note [Every rank evaluates a share]).
  EvalResult evaluate(const Split& split);
  // The whole split on this rank alone (no collective): what evaluate() must agree with.
  EvalResult evaluate_alone(const Split& split);
  std::int64_t last_eval_images() const { return eval_images_; }  // this rank's images in the last evaluation

  std::string layer_descriptions() const { return train_model_->describe(); }  // the banner's lines
  const ModelSpec& spec() const { return spec_; }
  const Mnist& data() const { return data_; }
  const Reducer& reducer() const { return *reducer_; }
  // The flat parameters in the backend's memory (device memory on a GPU).
  const float* params() const { return params_->data(); }
  // A host copy of them (a synchronisation point on a GPU).
  std::vector<float> params_to_host();
  Backend& backend() { return *backend_; }
  Optimizer& optimizer() { return *optimizer_; }
  const DeviceChoice& device() const { return device_; }
  std::int64_t global_batch() const { return global_batch_; }
  std::int64_t per_rank_batch() const { return batch_; }                 // per micro-batch
  std::int64_t graph_replays() const { return step_->graph_replays(); }  // --cuda-graph
  // "key = value" lines that must be the same on every rank: program version, options (those
  // that may differ per node left out), model and data sizes (src/comm/consistency.cpp).
  std::string job_description() const;
  // The four MNIST files this rank loaded, with their digests (check_same_data()).
  const std::vector<DataFile>& data_files() const { return data_.files; }

 private:
  static constexpr std::int64_t kWarmupSteps = 10;  // left out of the steady rate when the run has more
  // run()'s clocks (Note [Timing a step] in src/train/trainer.cpp).
  struct RunClock {
    std::chrono::steady_clock::time_point run, steady, window;  // window: of the next log line's rate
    std::int64_t warmup = 0;                                    // steps before the steady part
    double startup_s = 0, eval_s = 0;
    double excluded_s = 0, excluded_at_steady = 0;  // evaluation and checkpoints (not training time)
    double steady_s = 0;
    StepTiming sum;  // over the steady steps
    void start_steady(Backend& backend);
    void end_steady(Backend& backend);
    void exclude(std::chrono::steady_clock::time_point since);  // from the rates: since .. now
    // From the log line's rate only: since .. now; returns that span.
    std::chrono::steady_clock::duration pause_window(std::chrono::steady_clock::time_point since);
    double images_per_s(std::int64_t steps, std::int64_t global_batch) const;
  };

  // Set-up (the constructor's steps).
  void check_file_roles() const;
  void resolve_batch_sizes(std::int64_t train_count);
  int set_up_backend();  // the backend and its gradient communicator; returns the threads per rank
  void make_training_state();
  void make_evaluation();
  StartFacts start_facts(int threads, const GpuProbe& gpus) const;

  const float* host_params();  // params_ in host memory (a copy on a device)
  void share_measured_convolutions();  // rank 0's --conv-algos measured table, to every rank
  void check_replicas(std::int64_t step);
  void settle_verdicts(std::int64_t up_to);  // Note [Non-finite steps]
  void nonfinite_step(std::int64_t bad_step, bool own_loss_bad);
  void log_training_loss(std::int64_t step, double lr, RunResult& res);
  // Note [Every rank's step times]: this rank's phase times since the last call, to rank 0.
  // steady_steps: the steps in clock_.sum (past the warm-up) up to `step`.
  void gather_rank_times(std::int64_t step, std::int64_t steady_steps);
  void start_rank_times();  // every rank's host to rank 0, and rank 0's buffers
  std::int64_t eval_batches(const Split& split) const;
  LossStats evaluate_batches(const Split& split, std::int64_t first, std::int64_t n);
  // --exact-sums: the split's loss from every rank's batch losses, and the correct count.
  static EvalResult eval_result(std::int64_t count, const LossStats& s);
  EvalResult evaluate_during_training(std::int64_t step, bool epoch_end, bool eval_now);
  bool target_reached(std::int64_t step, const EvalResult& validation, TargetFacts& target);
  StepBoundary::Decision checkpoint_or_stop(std::int64_t step, bool epoch_end, bool last, double lr,
                                            const EvalResult& validation);
  RunResult stopped(std::int64_t step, RunResult& res);
  void final_report(RunResult& res);
  // CheckpointSource
  void settle() override { settle_verdicts(current_step_); }
  void gather_state() override {
    optimizer_->gather_state(comm_);
    reducer_->gather_codec_state(0);
  }
  // Collective, after every step: every rank's model state becomes its mean over the ranks (Note
  // [State that is not trained] in include/mnist_mpi/model/spec.hpp). Nothing without batch norm.
  void average_model_state();
  TrainingState state() override;

  Options opt_;
  bool sharded_ = false;  // --shard-optimizer, resolved (auto: on for the CPU with 2 or more ranks)
  std::string conv_algos_;                // the banner's line from Backend::time_convolutions (rank 0)
  std::vector<std::int32_t> conv_table_;  // rank 0: the algorithms it timed (--conv-algos measured)
  Communicator& comm_;
  std::chrono::steady_clock::time_point start_;
  DeviceChoice device_;
  Mnist data_;
  ModelSpec spec_;
  std::unique_ptr<Backend> backend_;
  // The gradient communicator: comm_ itself on the CPU, NCCL on the GPU (staged through the host
  // when ranks share GPUs). Declared after backend_: it is destroyed before it.
  std::unique_ptr<Communicator> gpu_comm_;
  Communicator* grad_comm_ = nullptr;
  bool shared_gpus_ = false;
  bool nccl_hosts_ = false;  // ranks share GPUs, each its own NCCL host: NCCL sums all the same
  // Flat, spec_.param_count each (Note [Reverse layer order]); the parameters and the model state
  // with their host images (hashes, initialisation, checkpoints, resume) and the models built on
  // them (Note [The parameters and their copies] in include/mnist_mpi/backend/parameter_store.hpp).
  std::unique_ptr<ParameterStore> params_;
  std::unique_ptr<Buffer> grads_;
  std::unique_ptr<Model> train_model_, eval_model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Reducer> reducer_;
  // --exact-sums (include/mnist_mpi/train/exact_sums.hpp): the chunk, this rank's chunks, the
  // integers and limits, and a loss meter for passes computed again.
  std::int64_t exact_chunk_ = 0;
  ChunkRange my_chunks_;
  std::unique_ptr<ExactSums> exact_;
  std::unique_ptr<LossMeter> scratch_loss_;
  std::unique_ptr<StepGuard> guard_;            // the backend's (Note [Non-finite steps])
  std::unique_ptr<Checkpointer> checkpointer_;  // resume, the checkpoint writer, retention (checkpointer.hpp)
  std::unique_ptr<StepBoundary> boundary_;      // the per-step agreement and decision (step_boundary.hpp)
  std::int64_t accumulation_ = 1;
  std::unique_ptr<Sampler> sampler_;
  std::int64_t batch_ = 0, global_batch_ = 0, steps_per_epoch_ = 0, total_steps_ = 0;
  std::unique_ptr<DataSource> train_data_, validation_data_, test_data_;  // where the backend computes
  std::unique_ptr<LossMeter> train_loss_;
  std::unique_ptr<EvaluationLoss> eval_loss_;  // default or exact, chosen at build
  std::int64_t eval_images_ = 0;               // images this rank evaluated in the last evaluation
  std::vector<std::uint64_t> replica_hashes_;  // (world)
  std::unique_ptr<Monitor> monitor_;           // progress, metrics file, TensorBoard, timeline, report (src/report/)
  // Note [Every rank's step times]: this rank's sums since the last gather; on rank 0 every
  // rank's gathered window and sums, its means, and the sums over the run.
  static constexpr std::size_t kRankValues = 10;  // the window's 5 phases, then clock_.sum's 5
  std::int64_t rank_steps_ = 0;                   // the steps in rank_sums_
  std::vector<double> rank_gathered_;
  std::vector<RankTimes> rank_means_, rank_sums_;
  Timeline* timeline_ = nullptr;               // null unless --timeline: then every step records spans
  LaunchEnv launch_;                           // Slurm job, launcher (src/launch/launch_env.cpp)
  bool rank0_ = false;
  Fault fault_;                 // MNIST_MPI_FAULT, when it names this rank (a testing hook)
  std::unique_ptr<Step> step_;  // one global step (step.hpp)

  // The loop's state (run()).
  RunClock clock_;
  std::int64_t current_step_ = 0, verdict_next_ = 0;  // verdict_next_: the first step whose verdict is unread
  std::int64_t window_n_ = 0;                         // images in the log window
  std::int64_t rank_images_ = 0;                      // images this rank takes per step
  std::int64_t skipped_ = 0;                          // non-finite steps skipped
  double logged_loss_ = 0;                            // the last logged training loss (NaN before)
};

}  // namespace mnist_mpi
