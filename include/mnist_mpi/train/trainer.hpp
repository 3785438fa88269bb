// The training loop of one rank: the sampler's slice of each global batch, forward, softmax
// cross-entropy, backward, the gradient allreduce, the fused optimiser step; rank 0 evaluates.
// What is shown and written of the run (console, metrics file, TensorBoard, timeline, report) the
// Monitor formats from the facts the trainer hands it (src/report/). Construction does only local work
// (so that setup errors can be agreed on by all ranks before any collective, see Note [Ending every
// rank] in src/main.cpp); run() does the collectives.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/device.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/data/sampler.hpp"
#include "mnist_mpi/hash.hpp"  // hash_floats, hex64
#include "mnist_mpi/launch/launch_env.hpp"
#include "mnist_mpi/model/model.hpp"
#include "mnist_mpi/report/monitor.hpp"
#include "mnist_mpi/train/checkpointer.hpp"
#include "mnist_mpi/train/fault.hpp"
#include "mnist_mpi/train/optimizer.hpp"
#include "mnist_mpi/train/reducer.hpp"

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
  EvalResult test;               // rank 0 only
  double wall_s = 0.0;
  double images_per_s = 0.0;     // steady: first 10 steps and evaluation excluded
  std::string params_hash;
  std::int64_t first_step = 0;   // > 0 when resumed from a checkpoint
  int preempted_signal = 0;      // the signal that stopped the run early (exit code 75), else 0
  CheckpointStats checkpoints;   // rank 0's numbers (others_wait_* from every rank)
  std::int64_t skipped_steps = 0;  // non-finite steps skipped (--skip-nonfinite-steps)
  // Training finished but an output (metrics, TensorBoard, timeline, report, stdout) could not be
  // written: exit code 7, on every rank alike (Note [When an output cannot be written]).
  bool outputs_lost = false;
};

class Trainer {
 public:
  // start: when the process started (for the start-up time); defaults to now.
  Trainer(const Options& options, Communicator& comm,
          std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now());
  RunResult run();
  EvalResult evaluate(const Split& split);  // on this rank, with the current parameters

  const ModelSpec& spec() const { return spec_; }
  const Reducer& reducer() const { return *reducer_; }
  // The flat parameters in the backend's memory (device memory on a GPU).
  const float* params() const { return params_->data(); }
  // A host copy of them (a synchronisation point on a GPU).
  std::vector<float> params_to_host();
  Backend& backend() { return *backend_; }
  Optimizer& optimizer() { return *optimizer_; }
  const DeviceChoice& device() const { return device_; }
  std::int64_t global_batch() const { return global_batch_; }
  std::int64_t per_rank_batch() const { return batch_; }  // per micro-batch
  // "key = value" lines that must be the same on every rank: program version, options (those
  // that may differ per node left out), model and data sizes (src/train/consistency.cpp).
  std::string job_description() const;

 private:
  void load_batch(const Slice& slice);  // the sampler's slice, into the model's input
  const float* host_params();  // params_ on the host (a copy into host_params_ on a GPU)
  void check_replicas(std::int64_t step);

  Options opt_;
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
  std::unique_ptr<Buffer> params_, grads_;  // flat, spec_.param_count each (Note [Reverse layer order])
  std::vector<float> host_params_;          // GPU only: host copy for hashes, initialisation
  std::vector<float> host_m_, host_v_;      // GPU only: host copies of the moments for checkpoints
  const float *ckpt_params_ = nullptr, *ckpt_m_ = nullptr, *ckpt_v_ = nullptr;  // what checkpoints read
  std::function<void()> state_to_host_;     // GPU only: fills the host copies (checkpoint steps only)
  std::unique_ptr<Model> train_model_, eval_model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Reducer> reducer_;
  std::unique_ptr<Checkpointer> checkpointer_;  // resume, checkpoints, preemption (checkpointer.hpp)
  std::function<void(int)> on_layer_done_;  // made once: calls reducer_->on_layer_done
  std::unique_ptr<Buffer> accum_;            // sum of the earlier micro-batches' gradients (K > 1)
  std::vector<std::pair<std::int64_t, std::int64_t>> layer_params_;  // (offset, size) per layer
  std::int64_t accumulation_ = 1;
  bool accumulating_ = false;
  std::unique_ptr<Sampler> sampler_;
  std::int64_t batch_ = 0, global_batch_ = 0, steps_per_epoch_ = 0, total_steps_ = 0;
  std::int64_t order_epoch_ = -1;  // the epoch whose order train_data_ holds
  std::unique_ptr<DataSource> train_data_, validation_data_, test_data_;  // where the backend computes
  std::unique_ptr<LossMeter> train_loss_, eval_loss_;
  std::vector<std::uint64_t> replica_hashes_;  // (world)
  std::unique_ptr<Monitor> monitor_;  // progress, metrics file, TensorBoard, timeline, report (src/report/)
  Timeline* timeline_ = nullptr;      // null unless --timeline: then every step records spans
  LaunchEnv launch_;  // Slurm job, launcher (src/launch/launch_env.cpp)
  bool rank0_ = false;
  Fault fault_;  // MNIST_MPI_FAULT, when it names this rank (a testing hook)
};


}  // namespace mnist_mpi
