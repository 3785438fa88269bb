// The console progress of rank 0 (see include/mnist_mpi/report/progress.hpp).
#include "mnist_mpi/report/progress.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/report/output.hpp"

namespace mnist_mpi {
namespace {

std::string clock_text(double s) {
  if (!(s >= 0) || s > 359999) return "--:--";
  const long t = static_cast<long>(s + 0.5);
  char b[32];
  if (t >= 3600)
    std::snprintf(b, sizeof b, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else
    std::snprintf(b, sizeof b, "%ld:%02ld", t / 60, t % 60);
  return b;
}

// Note [Is rank 0 on a terminal?]
// isatty(stdout) alone is not enough under Open MPI: mpirun gives its local ranks a pseudo-terminal
// for stdout even when mpirun's own output goes to a file or a pipe, so every rank "is on a
// terminal". When we were started by Open MPI (OMPI_COMM_WORLD_SIZE is set), we therefore ask
// what our parent (mpirun, or orted on another node) writes to: a bar only if its stdout is a
// terminal too. srun and MPICH's hydra give ranks pipes, so isatty() already says no there.
// --progress bar|lines overrides the guess.
bool stdout_is_a_watched_terminal() {
  if (!::isatty(STDOUT_FILENO)) return false;
  if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) return true;
  std::error_code ec;
  const auto target = std::filesystem::read_symlink("/proc/" + std::to_string(::getppid()) + "/fd/1", ec);
  if (ec) return false;
  const std::string t = target.string();
  return t.rfind("/dev/pts/", 0) == 0 || t.rfind("/dev/tty", 0) == 0;
}

}  // namespace

ProgressMode resolve_progress_mode(const std::string& option, bool quiet) {
  if (quiet) return ProgressMode::kOff;
  if (option == "bar") return ProgressMode::kBar;
  if (option == "lines") return ProgressMode::kLines;
  MNIST_CHECK(option == "auto", ExitCode::kUsage, "--progress must be auto, bar or lines, got '" + option + "'");
  return stdout_is_a_watched_terminal() ? ProgressMode::kBar : ProgressMode::kLines;
}

Progress::Progress(ProgressMode mode, std::int64_t total_steps, std::int64_t steps_per_epoch, std::int64_t global_batch)
    : mode_(mode), total_steps_(total_steps), steps_per_epoch_(steps_per_epoch), global_batch_(global_batch) {
  start(Clock::now());
}

void Progress::start(Clock::time_point t) { epoch_start_ = last_draw_ = t; }

void Progress::step_done(std::int64_t step, Clock::time_point now) {
  if (mode_ != ProgressMode::kBar) return;
  const bool epoch_end = (step + 1) % steps_per_epoch_ == 0 || step + 1 == total_steps_;
  if (!epoch_end && now - last_draw_ < std::chrono::milliseconds(250)) return;
  draw(step, now, epoch_end);
}

void Progress::draw(std::int64_t step, Clock::time_point now, bool final) {
  const std::int64_t epoch = step / steps_per_epoch_;
  const std::int64_t first = epoch * steps_per_epoch_;
  const std::int64_t last = std::min(first + steps_per_epoch_, total_steps_);
  const std::int64_t done = step + 1 - first, in_epoch = last - first;
  const double elapsed = std::chrono::duration<double>(now - epoch_start_).count();
  // images/s over the epoch so far (evaluations excluded): steadier than between two redraws.
  const double rate = elapsed > 0 ? static_cast<double>(done * global_batch_) / elapsed : 0.0;
  const double eta = done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(in_epoch - done) : -1.0;
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * done / std::max<std::int64_t>(in_epoch, 1));
  char bar[kWidth + 1];
  for (int i = 0; i < kWidth; ++i) bar[i] = i < filled ? '#' : '.';
  bar[kWidth] = '\0';
  char loss[32] = "-";
  if (loss_ >= 0) std::snprintf(loss, sizeof loss, "%.4f", loss_);
  char text[256];
  std::snprintf(text, sizeof text, "\repoch %lld [%s] %lld/%lld loss %s %.0f img/s %s %s\033[K",
                static_cast<long long>(epoch + 1), bar, static_cast<long long>(done), static_cast<long long>(in_epoch),
                loss, rate, final ? "took" : "ETA", clock_text(final ? elapsed : eta).c_str());
  // A failure of stdout is reported once and the run goes on (Note [When an output cannot be written]).
  OutputFile& out = OutputFile::standard_output();
  out.write(text);
  if (final) {
    out.write("\n");
    epoch_start_ = now;
  }
  out.flush();
  drawn_ = !final;
  last_draw_ = now;
}

void Progress::log(std::int64_t step, double loss, double lr, double images_per_s) {
  loss_ = loss;
  if (mode_ != ProgressMode::kLines) return;
  OutputFile& out = OutputFile::standard_output();
  if (out.print("epoch %lld step %lld/%lld loss %.4f lr %.3g %.0f img/s\n",
                static_cast<long long>(step / steps_per_epoch_ + 1), static_cast<long long>(step + 1),
                static_cast<long long>(total_steps_), loss, lr, images_per_s))
    out.flush();
}

void Progress::line(const char* text) {
  if (mode_ == ProgressMode::kOff) return;
  OutputFile& out = OutputFile::standard_output();
  if (drawn_) out.write("\r\033[K");
  if (out.write(text) && out.write("\n")) out.flush();
  drawn_ = false;
  last_draw_ = Clock::time_point{};  // redraw at the next step
}

}  // namespace mnist_mpi
