// What a person sees of a run, in one object the trainer calls at a few points: the console
// progress (bar or lines), TensorBoard scalars (--tensorboard-dir), the timeline of every rank
// (--timeline), the summary table of where the time went, and the HTML report (--report).
// Construction does only local work (it checks the paths, so bad ones fail at setup on every
// rank); start() and finish() are collective when --timeline is on. Nothing is written that was
// not asked for.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/report/html_report.hpp"
#include "mnist_mpi/report/progress.hpp"
#include "mnist_mpi/report/tensorboard.hpp"
#include "mnist_mpi/report/timeline.hpp"

namespace mnist_mpi {

// Seconds of one step on this rank, by phase.
struct StepPhases {
  double data = 0, forward = 0, backward = 0, exposed_comm = 0, optimizer = 0;
};

struct MonitorSetup {
  int rank = 0, world = 1;
  std::string host;
  std::vector<std::string> layer_names;  // for the timeline's backward spans
  std::size_t buckets = 0;
  std::int64_t total_steps = 0, steps_per_epoch = 1, global_batch = 0, accumulation = 1;
  std::chrono::steady_clock::time_point process_start;
};

// The end of the run, as the trainer saw it (rank 0's values where ranks differ).
struct FinalFacts {
  std::int64_t steps = 0;
  double epochs = 0, startup_s = 0, images_per_s = 0, test_accuracy = 0, test_loss = 0;
  std::string params_hash, model;
};

class Monitor {
 public:
  using Clock = std::chrono::steady_clock;
  Monitor(const Options& options, MonitorSetup setup);

  Timeline* timeline() { return timeline_.get(); }  // null unless --timeline: the trainer records into it

  void start(Communicator& comm);  // collective when --timeline (aligns clocks); then training starts
  // Every step, before on_log (every rank; only rank 0's figures are shown).
  void on_step(std::int64_t step, const StepPhases& phases, Clock::time_point end);
  // At --log-every: the global mean training loss over the window, the learning rate, images/s.
  void on_log(std::int64_t step, double loss, double lr, double images_per_s);
  // An evaluation on rank 0 after `step` steps; print: show the usual console line.
  void on_eval(std::int64_t step, std::int64_t epoch, const char* split, double accuracy, double loss,
               Clock::time_point begin, Clock::time_point end, bool print);
  // Collective when --timeline: gathers and writes it; rank 0 prints the table and writes the report.
  void finish(Communicator& comm, const FinalFacts& facts);

 private:
  void check_output_path(const char* option, const std::string& path) const;

  const Options& opt_;
  MonitorSetup setup_;
  bool rank0_;
  Progress progress_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<Timeline> timeline_;
  StepPhases total_{}, window_{};  // seconds: the whole run, and since the last log
  std::int64_t window_steps_ = 0;
  Clock::time_point last_end_{};
  double eval_s_ = 0;
  ReportData report_;
  std::vector<std::pair<std::string_view, double>> scalars_;  // reused for TensorBoard events
};

}  // namespace mnist_mpi
