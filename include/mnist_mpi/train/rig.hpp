// The rig of a run: every part the training loop works with, built in one place from the plan
// (include/mnist_mpi/train/run_plan.hpp), in the order their construction needs: the backend and
// the communicator that sums its gradients, the parameters and gradients, the training model, the
// optimiser, the reducer, the checkpointer and the step boundary, the training data, the loss
// meter and the guard, the evaluator, the monitor and the Step. Building it does only local work
// (Note [Ending every rank] in src/main.cpp); the few collectives of its parts' set-up are in
// connect(). When the parts are used is the trainer's (include/mnist_mpi/train/trainer.hpp).
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
#include "mnist_mpi/backend/parameter_store.hpp"
#include "mnist_mpi/checkpoint/checkpointer.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/data/sampler.hpp"
#include "mnist_mpi/launch/launch_env.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/report/monitor.hpp"
#include "mnist_mpi/resilience/fault.hpp"
#include "mnist_mpi/resilience/nonfinite_steps.hpp"
#include "mnist_mpi/train/evaluator.hpp"
#include "mnist_mpi/train/gradient_mode.hpp"
#include "mnist_mpi/train/optimizer.hpp"
#include "mnist_mpi/train/reducer.hpp"
#include "mnist_mpi/train/run_plan.hpp"
#include "mnist_mpi/train/step.hpp"
#include "mnist_mpi/train/step_boundary.hpp"

namespace mnist_mpi {

// Every file of the run, declared by the parts that read or write them, checked on every rank
// before anything is written (Note [No output is an input] in include/mnist_mpi/io/file_roles.hpp).
void check_run_files(const Options& options);

// The device of this rank, and how the ranks of a CUDA run sum their gradients.
struct RunDevice {
  DeviceChoice choice;
  int gpus = 0;              // usable GPUs this process sees
  bool shared_gpus = false;  // ranks share GPUs and sum through host memory
  bool nccl_hosts = false;   // ranks share GPUs, each its own NCCL host: NCCL sums all the same
};
// Probes the GPUs (not for --device cpu) and chooses; throws Error(kDevice) for `--device cuda`
// without a usable GPU. Every rank of a CUDA run asks the others (one collective), so call it on
// every rank alike.
RunDevice choose_run_device(const Options& options, Communicator& comm);

// What the rig is built from besides the options and the plan.
struct RigInputs {
  const ModelSpec* spec = nullptr;
  const Mnist* data = nullptr;
  RunDevice device;
  Fault fault;  // MNIST_MPI_FAULT (its step-wide kinds are the Step's)
  std::chrono::steady_clock::time_point process_start;
  CheckpointSource* source = nullptr;  // the trainer's side of a checkpoint
};

struct Rig {
  Rig(const Options& options, Communicator& comm, const RunPlan& plan, const RigInputs& in);

  // Collective, once at the start of run(): the gradient communicator's set-up (NCCL) and rank 0's
  // --conv-algos measured table to every rank.
  void connect();
  // A checkpoint's parameters, optimiser state and model state, on every rank; returns the first
  // step (0 when there is none to resume).
  std::int64_t restore();
  // Collective: rank 0's parameters are everyone's (no rank trains weights of its own).
  void share_parameters();
  TrainingState state();  // rank 0, at a checkpoint: the state in host memory
  // Collective, after every step: every rank's model state becomes its mean over the ranks (Note
  // [State that is not trained] in include/mnist_mpi/model/spec.hpp). Nothing without batch norm.
  void average_model_state();
  // MNIST_MPI_FAULT kDiverge: this rank's first parameter loses its last bit (a replica gone its
  // own way, for the replica check to find).
  void flip_first_parameter();
  double reduced_bytes() const;  // summed per step: the gradient, or its fixed-point integers
  // What NonfiniteSteps reads and calls (include/mnist_mpi/resilience/nonfinite_steps.hpp): the
  // guard's verdicts, the collective over comm, the monitor's line; then restart_window.
  NonfiniteSteps::Hooks verdict_hooks(std::function<void()> restart_window);
  // What the banner says (Monitor::on_start).
  StartFacts start_facts(const RunDevice& device, const LaunchEnv& launch, const Mnist& data) const;

  const Options& opt;
  Communicator& comm;
  const RunPlan& plan;
  const ModelSpec& spec;
  std::unique_ptr<Backend> backend;
  // The gradient communicator: comm itself on the CPU, NCCL on the GPU (staged through the host
  // when ranks share GPUs). Declared after backend: it is destroyed before it.
  std::unique_ptr<Communicator> gpu_comm;
  Communicator* grad_comm = nullptr;
  // Flat, spec.param_count each (Note [Reverse layer order]); the parameters and the model state
  // with their host images (hashes, initialisation, checkpoints, resume) and the models built on
  // them (Note [The parameters and their copies] in include/mnist_mpi/backend/parameter_store.hpp).
  std::unique_ptr<ParameterStore> params;
  std::unique_ptr<Buffer> grads;
  std::unique_ptr<Model> train_model;
  // Rank 0, --conv-algos measured: the algorithms it timed and the banner's line about them.
  Backend::ConvTiming conv_timing;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<Reducer> reducer;
  std::unique_ptr<GradientMode> mode;  // how the gradient is made and summed (gradient_mode.hpp)
  std::unique_ptr<StepGuard> guard;            // the backend's (Note [Non-finite steps])
  std::unique_ptr<Checkpointer> checkpointer;  // resume, the checkpoint writer, retention (checkpointer.hpp)
  std::unique_ptr<StepBoundary> boundary;      // the per-step agreement and decision (step_boundary.hpp)
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<DataSource> train_data;  // where the backend computes
  std::unique_ptr<LossMeter> train_loss;   // summed over the log window
  std::unique_ptr<Evaluator> evaluator;
  std::unique_ptr<Monitor> monitor;  // progress, metrics file, TensorBoard, timeline, report (src/report/)
  std::unique_ptr<Step> step;        // one global step (step.hpp)

 private:
  void set_up_backend(const RigInputs& in);
  void make_training_state(const RigInputs& in);
  void make_step(const RigInputs& in);
};

}  // namespace mnist_mpi
