// Reading the step guard's verdicts (include/mnist_mpi/resilience/nonfinite_steps.hpp).
#include "mnist_mpi/resilience/nonfinite_steps.hpp"

#include <limits>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

// Note [Non-finite steps] (include/mnist_mpi/backend/step_guard.hpp), the trainer's part: the guard's
// verdict of every step is read in order, on every rank at the same step (every place that
// settles does so on every rank alike), at once on the host and StepGuard::lag() steps later on a
// device. One more collective finds the first rank whose own loss was not finite. Without
// --skip-nonfinite-steps the run stops; with it the step is counted and the loss window restarts.
void NonfiniteSteps::settle(std::int64_t up_to, std::int64_t current) {
  while (next_ <= up_to) {
    const std::int64_t s = next_++;
    const StepVerdict v = hooks_.verdict(s);
    if (!v.nonfinite_gradient) continue;
    nonfinite_step(s, v.nonfinite_loss, current);
  }
}

void NonfiniteSteps::nonfinite_step(std::int64_t bad_step, bool own_loss_bad, std::int64_t current) {
  const std::int64_t bad_rank = hooks_.first_bad_rank(own_loss_bad);
  const std::string where = bad_rank == std::numeric_limits<std::int64_t>::max()
                                ? "every rank's loss was finite: the gradient overflowed"
                                : "the loss was not finite on rank " + std::to_string(bad_rank);
  const std::string seen = current == bad_step
                               ? std::string()
                               : "; the GPU guard kept it and the " + std::to_string(current - bad_step) +
                                     " step(s) after it from the parameters";
  if (!skip_)
    throw AgreedError(ExitCode::kNumerical,
                      !rank0_ ? std::string() :  // main prints the one message
                          "non-finite gradient in step " + std::to_string(bad_step + 1) + " (" + where + seen +
                              "); training diverged or the data holds NaN: lower --lr, add --warmup-steps, or pass "
                              "--skip-nonfinite-steps to skip such steps (no non-finite value reached the parameters)");
  ++skipped_;
  hooks_.skipped(bad_step, where);  // the skipped step's loss is in the meter: the window starts again
}

}  // namespace mnist_mpi
