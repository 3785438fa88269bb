// Rank 0's console progress: on a terminal a live bar per epoch (step, loss, images/s, ETA)
// redrawn in place with \r at most four times a second; otherwise (Slurm logs, CI, files) plain
// lines every --log-every steps. Other lines (evaluations) go through line() so they do not land
// in the middle of the bar. Note [Is rank 0 on a terminal?] says how `auto` decides.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace mnist_mpi {

enum class ProgressMode { kOff, kLines, kBar };

// --progress auto|bar|lines (quiet: kOff). auto: kBar when stdout is a terminal that a person
// sees (Note [Is rank 0 on a terminal?]), else kLines.
ProgressMode resolve_progress_mode(const std::string& option, bool quiet);

class Progress {
 public:
  using Clock = std::chrono::steady_clock;
  Progress(ProgressMode mode, std::int64_t total_steps, std::int64_t steps_per_epoch, std::int64_t global_batch);

  // When training starts (the bar's first epoch begins).
  void start(Clock::time_point t);
  // After every step (0-based `step`) with the time it ended; draws the bar when due.
  void step_done(std::int64_t step, Clock::time_point now);
  // At --log-every: the global mean loss of the window, the learning rate, the window's images/s.
  void log(std::int64_t step, double loss, double lr, double images_per_s);
  // A whole line of other output (an evaluation): the bar is cleared first and redrawn later.
  void line(const char* text);
  // Time spent outside training (evaluation) so it does not count in images/s or the ETA.
  void pause(Clock::duration d) { epoch_start_ += d; }
  ProgressMode mode() const { return mode_; }

 private:
  void draw(std::int64_t step, Clock::time_point now, bool final);

  ProgressMode mode_;
  std::int64_t total_steps_, steps_per_epoch_, global_batch_;
  double loss_ = -1.0;  // the last logged loss (none yet: -1)
  Clock::time_point epoch_start_, last_draw_;
  bool drawn_ = false;  // a bar is on the current line
};

}  // namespace mnist_mpi
