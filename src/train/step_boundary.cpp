// The step boundary (include/mnist_mpi/train/step_boundary.hpp): the per-step agreement, the
// checkpoint decision and the stop.
#include "mnist_mpi/train/step_boundary.hpp"

#include <chrono>
#include <span>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/resilience/preemption.hpp"

namespace mnist_mpi {
StepBoundary::StepBoundary(const Options& options, Communicator& comm, Checkpointer& writer, CheckpointSource& source)
    : opt_(options), comm_(comm), writer_(writer), source_(source), rank0_(comm.rank() == 0) {}

// Note [Agreeing at the step boundary]
// After every step each rank contributes (the signal it received, 0 if none; whether it reached
// --target-accuracy) and rank 0 adds (1 if a checkpoint write failed) to one allreduce of three
// int64 (max). All ranks see the same result after the same step, so they stop together: on a
// signal rank 0 writes a checkpoint, waits for it, and a second allreduce tells everyone whether
// it was written (exit 75) or not (exit 4); a write error ends every rank with exit 4 and rank 0's
// message. Whether a checkpoint is due depends on the step and on `last`, which every rank knows
// alike: the validation accuracy that decides the target is allreduced (Note [Every rank
// evaluates a share]), so every rank sees the same value and reaches the target at the same step;
// the flag in the allreduce is a check on that, and the decision to end is taken from it. The
// allreduce is 24 bytes, a few microseconds, next to a step's gradient reduction.
StepBoundary::Decision StepBoundary::after_step(const StepEnd& s, bool target_reached) {
  const bool due = writer_.enabled() &&
                   (s.last || s.epoch_end || (opt_.checkpoint_every > 0 && s.step % opt_.checkpoint_every == 0));
  if (due) checkpoint(s);  // every rank: `due` does not depend on the rank
  std::int64_t flags[3] = {preemption_signal(), 0, target_reached ? 1 : 0};
  if (rank0_) flags[1] = writer_.write_failed() ? 1 : 0;
  const double t0 = now_s();
  comm_.allreduce_max(std::span<std::int64_t>(flags, 3));
  const double waited = now_s() - t0;
  if (due && !s.epoch_end && !s.last) {
    others_wait_s_ += waited;
    ++others_n_;
  } else if (!due) {
    others_base_s_ += waited;
    ++others_base_n_;
  }
  if (flags[1] != 0) agree_on_errors();  // throws on every rank
  const Decision go_on = flags[2] != 0 ? Decision::kDone : Decision::kContinue;
  if (flags[0] == 0 || s.last) return go_on;  // a signal during the last step: the run is done anyway
  stop_signal_ = static_cast<int>(flags[0]);
  if (writer_.enabled() && !due) checkpoint(s);  // a due step was written above (a failed write threw)
  agree_on_errors();
  return Decision::kStop;
}

void StepBoundary::checkpoint(const StepEnd& s) {
  source_.settle();        // every rank: no checkpoint after a bad step
  source_.gather_state();  // every rank: the collective part (sharded moments to rank 0)
  if (rank0_) writer_.write(s, [this] { return source_.state(); });
}

void StepBoundary::agree_on_errors() {
  const std::string msg = rank0_ ? writer_.wait_for_writes() : std::string();
  std::int64_t failed = msg.empty() ? 0 : 1;
  comm_.allreduce_max(std::span<std::int64_t>(&failed, 1));
  if (failed) throw AgreedError(ExitCode::kCheckpoint, msg);
}

void StepBoundary::finish() {
  agree_on_errors();
  // The other ranks' waits, for the report: the worst rank's mean, in microseconds.
  std::int64_t us[2] = {0, 0};
  if (!rank0_) {
    us[0] = others_n_ ? static_cast<std::int64_t>(1e6 * others_wait_s_ / static_cast<double>(others_n_)) : 0;
    us[1] = others_base_n_ ? static_cast<std::int64_t>(1e6 * others_base_s_ / static_cast<double>(others_base_n_)) : 0;
  }
  comm_.allreduce_max(std::span<std::int64_t>(us, 2));
  others_wait_ms_ = static_cast<double>(us[0]) / 1e3;
  others_base_ms_ = static_cast<double>(us[1]) / 1e3;
}

CheckpointStats StepBoundary::stats() const {
  CheckpointStats st = writer_.stats();
  st.others_wait_ms = others_wait_ms_;
  st.others_wait_baseline_ms = others_base_ms_;
  return st;
}

}  // namespace mnist_mpi
