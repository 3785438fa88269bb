// The verdicts of the step guard (Note [Non-finite steps] in include/mnist_mpi/backend/step_guard.hpp),
// read in step order on every rank alike: a non-finite step stops the run (exit code 4), or with
// --skip-nonfinite-steps is counted and skipped. What it leaves to others, through the hooks given
// at construction: reading a step's verdict (the backend's guard), the collective that finds the
// first rank whose own loss was not finite, and what a skipped step means to the loss window and
// the monitor.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

namespace mnist_mpi {

// One step's verdict, as the guard found it on this rank.
struct StepVerdict {
  bool nonfinite_gradient = false;  // the step was skipped (the ranks' gradients, ORed)
  bool nonfinite_loss = false;      // this rank's own loss was not finite
};

class NonfiniteSteps {
 public:
  struct Hooks {
    std::function<StepVerdict(std::int64_t step)> verdict;  // once per step, in order
    // Collective: the lowest rank whose own loss was not finite, or INT64_MAX when none.
    std::function<std::int64_t(bool own_loss_bad)> first_bad_rank;
    // After a skipped step (--skip-nonfinite-steps): where it went wrong, in words.
    std::function<void(std::int64_t step, const std::string& where)> skipped;
  };
  // skip: --skip-nonfinite-steps. rank0: this rank prints the message of a stopped run.
  NonfiniteSteps(bool skip, bool rank0, Hooks hooks) : skip_(skip), rank0_(rank0), hooks_(std::move(hooks)) {}
  void restart(std::int64_t first_step) {  // the run's first step (a resumed run's is not 0)
    next_ = first_step;
    skipped_ = 0;
  }
  // Reads the verdicts of the steps up to `up_to` not read yet; `current` is the step the loop is
  // at (a device's verdicts arrive some steps late). Throws AgreedError(kNumerical) on a
  // non-finite step unless skipping.
  void settle(std::int64_t up_to, std::int64_t current);
  std::int64_t skipped() const { return skipped_; }  // steps skipped so far

 private:
  void nonfinite_step(std::int64_t bad_step, bool own_loss_bad, std::int64_t current);

  bool skip_, rank0_;
  Hooks hooks_;
  std::int64_t next_ = 0;  // the first step whose verdict is unread
  std::int64_t skipped_ = 0;
};

}  // namespace mnist_mpi
