// The training loop's own measurements, from the facts it hands over: its clocks (the steady step
// rate, what is left out of it: Note [Timing a step] in src/report/run_telemetry.cpp), the
// training loss of each log window, and every rank's step times gathered to rank 0 (Note [Every
// rank's step times]). What becomes of them on screen and in the files is the Monitor's
// (include/mnist_mpi/report/monitor.hpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"  // Backend (synchronize), LossMeter
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/report/monitor.hpp"
#include "mnist_mpi/run_facts.hpp"  // StepTiming, RankTimes, FinalFacts

namespace mnist_mpi {

// Collective: every rank's peak resident memory in KiB (getrusage), on every rank.
std::vector<std::uint64_t> gather_peak_rss_kib(Communicator& comm);

// The loop's clocks (Note [Timing a step]).
struct RunClock {
  static constexpr std::int64_t kWarmupSteps = 10;            // left out of the steady rate when the run has more
  std::chrono::steady_clock::time_point run, steady, window;  // window: of the next log line's rate
  std::int64_t warmup = 0;                                    // steps before the steady part
  double startup_s = 0, eval_s = 0;
  double excluded_s = 0, excluded_at_steady = 0;  // evaluation and checkpoints (not training time)
  double steady_s = 0;
  StepTiming sum;  // over the steady steps
  // A fresh clock for a run of steps [first_step, total_steps), started now.
  static RunClock starting(std::int64_t first_step, std::int64_t total_steps);
  void start_steady(Backend& backend);
  void end_steady(Backend& backend);
  void exclude(std::chrono::steady_clock::time_point since);  // from the rates: since .. now
  // From the log line's rate only: since .. now; returns that span.
  std::chrono::steady_clock::duration pause_window(std::chrono::steady_clock::time_point since);
  double images_per_s(std::int64_t steps, std::int64_t global_batch) const;
};

// The training loss of the log window: the meter holds the loss sum of this rank's images since
// the last log line, and this counts them.
class LossWindow {
 public:
  void restart(LossMeter& meter) {  // at the start, and after a skipped step (its loss is in the meter)
    meter.reset();
    images_ = 0;
  }
  void add(std::int64_t images) { images_ += images; }
  // Collective: the window's mean loss over every rank (NaN when empty), and rank 0's log line at
  // the rate since window_start; the window starts again.
  double log(Communicator& comm, Monitor& monitor, LossMeter& meter, std::int64_t step, double lr,
             std::chrono::steady_clock::time_point window_start);

 private:
  std::int64_t images_ = 0;  // this rank's images in the window
};

// Note [Every rank's step times] (src/report/run_telemetry.cpp): this rank's phase times at
// every log line, to rank 0; on rank 0 every rank's gathered window and sums, its means, and the
// sums over the run.
class RankTimesGather {
 public:
  // Collective: every rank's host (and local rank) to rank 0, its placement line, rank 0's buffers.
  void start(Communicator& comm, Monitor& monitor);
  // Collective: this rank's window of phase times (from the monitor) and its sums over the steady
  // steps (steady_sum: steady_steps of them, the warm-up left out) up to `step`, to rank 0.
  void gather(Communicator& comm, Monitor& monitor, const StepTiming& steady_sum, std::int64_t step,
              std::int64_t steady_steps);
  // Rank 0: every rank's means over the steady steps and the straggler, into the final facts.
  void final_facts(FinalFacts& facts) const;

 private:
  static constexpr std::size_t kRankValues = 10;  // the window's 5 phases, then the steady sums' 5
  bool rank0_ = false;
  std::int64_t steps_ = 0;  // the steady steps in sums_
  std::vector<double> gathered_;
  std::vector<RankTimes> means_, sums_;
};

}  // namespace mnist_mpi
