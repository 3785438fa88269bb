// The step boundary: what every rank does between two steps, in one place. It runs the one
// per-step agreement (a preemption signal, rank 0's checkpoint write errors, --target-accuracy
// reached) and decides: go on, write a checkpoint, or stop (Note [Agreeing at the step boundary]
// in src/train/step_boundary.cpp). The checkpointer (include/mnist_mpi/checkpoint/checkpointer.hpp)
// is its writer; the trainer is its CheckpointSource. A new reason to stop is one more flag here.
#pragma once

#include <cstdint>

#include "mnist_mpi/checkpoint/checkpointer.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/run_facts.hpp"

namespace mnist_mpi {

// The trainer's side of a checkpoint; the step boundary calls it only when one is written.
class CheckpointSource {
 public:
  // EVERY rank, before a checkpoint of this step is written (scheduled or on a preemption
  // signal): learns the non-finite verdicts still pending (Note [Non-finite steps]) and throws
  // when the run must stop instead, so that no checkpoint follows a bad step.
  virtual void settle() = 0;
  // EVERY rank, after settle() when rank 0 may write: the collective part of bringing the state
  // to rank 0 (the sharded optimiser's moments, Note [Sharded optimiser state]); nothing unsharded.
  virtual void gather_state() = 0;
  // Rank 0, just before the state is copied: the state in host memory, brought there now (on a
  // device a copy; Note [Host copies]), never on other steps.
  virtual TrainingState state() = 0;

 protected:
  ~CheckpointSource() = default;
};

class StepBoundary {
 public:
  StepBoundary(const Options& options, Communicator& comm, Checkpointer& writer, CheckpointSource& source);

  enum class Decision {
    kContinue,  // the next step
    kDone,      // the target accuracy was reached: the run ends normally after this step
    kStop,      // a signal: stopped, with a checkpoint when there is a directory (exit 75)
  };
  // Collective, after every step: writes a checkpoint when one is due, agrees with the other ranks
  // (an agreed write error: AgreedError(kCheckpoint) on every rank), and decides.
  // target_reached: this rank's view, the same on every rank (the validation accuracy is allreduced);
  // s.last must include it, since it makes the last checkpoint due.
  Decision after_step(const StepEnd& s, bool target_reached);
  // Collective, after the last step: waits for the last write and agrees on its outcome.
  void finish();

  int stop_signal() const { return stop_signal_; }
  // The writer's figures with the other ranks' waits at the boundary (after finish()).
  CheckpointStats stats() const;

 private:
  void checkpoint(const StepEnd& s);  // collective: settle, gather, and rank 0 writes
  void agree_on_errors();             // collective: rank 0's write error, if any, thrown on every rank

  const Options& opt_;
  Communicator& comm_;
  Checkpointer& writer_;
  CheckpointSource& source_;
  bool rank0_ = false;
  int stop_signal_ = 0;
  double others_wait_s_ = 0, others_base_s_ = 0;  // the other ranks' waits: after a checkpoint, and not
  std::int64_t others_n_ = 0, others_base_n_ = 0;
  double others_wait_ms_ = 0, others_base_ms_ = 0;  // the worst rank's means, agreed in finish()
};

}  // namespace mnist_mpi
