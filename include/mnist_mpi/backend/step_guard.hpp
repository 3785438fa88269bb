// The step guard: how a backend finds a non-finite loss or gradient, where it lives (host or
// device), and how the ranks agree on it before an update is applied (Note [Non-finite steps]).
#pragma once

#include <cstdint>

namespace mnist_mpi {

class Communicator;  // include/mnist_mpi/comm/communicator.hpp
class LossMeter;     // include/mnist_mpi/backend/backend.hpp

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

}  // namespace mnist_mpi
