// What a person sees of a run, in one object the trainer calls at a few points: the console
// progress (bar or lines), TensorBoard scalars (--tensorboard-dir), the timeline of every rank
// (--timeline), the summary table of where the time went, and the HTML report (--report).
// It also writes the metrics file (--metrics-file, JSON lines the trainer composes). Construction
// does only local work (it checks the paths and opens the metrics file, so bad ones fail at setup
// on every rank); start() is collective when --timeline is on, finish() always. Nothing is written
// that was not asked for. An output that cannot be written is lost, not fatal (Note [When an
// output cannot be written] in include/mnist_mpi/report/output.hpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/report/html_report.hpp"
#include "mnist_mpi/report/output.hpp"
#include "mnist_mpi/report/progress.hpp"
#include "mnist_mpi/report/tensorboard.hpp"
#include "mnist_mpi/report/timeline.hpp"

namespace mnist_mpi {

// Seconds of one step on this rank, by phase.
// Where a step's time went, in seconds (one step, or a sum or mean over steps), and the bytes
// each rank reduced per step: the one timing record of the trainer, the monitor and the report.
struct StepTiming {
  double data = 0, forward = 0, backward = 0, exposed_comm = 0, optimizer = 0;
  double reduced_bytes = 0;  // per step, per rank (set in the run's summary only)
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
  void on_step(std::int64_t step, const StepTiming& phases, Clock::time_point end);
  // At --log-every: the global mean training loss over the window, the learning rate, images/s.
  void on_log(std::int64_t step, double loss, double lr, double images_per_s);
  // An evaluation on rank 0 after `step` steps; print: show the usual console line.
  void on_eval(std::int64_t step, std::int64_t epoch, const char* split, double accuracy, double loss,
               Clock::time_point begin, Clock::time_point end, bool print);
  // One JSON line of the metrics file (rank 0; nothing without --metrics-file), flushed so that a
  // reader following the file sees it.
  void metrics(std::string_view json_line);
  // Collective: gathers and writes the timeline (--timeline); rank 0 prints the table, writes the
  // report and closes every output; then all ranks agree whether an output was lost.
  void finish(Communicator& comm, const FinalFacts& facts);
  // After finish(), on every rank: whether rank 0 lost an output (exit code 7).
  bool outputs_lost() const { return outputs_lost_; }
  // On rank 0: "<output> '<file>' (<error>)" for each output that could not be written so far.
  std::vector<std::string> lost_outputs() const;

 private:
  void check_replaced_output(const char* option, const std::string& path) const;

  const Options& opt_;
  MonitorSetup setup_;
  bool rank0_;
  Progress progress_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<OutputFile> metrics_file_, timeline_file_, report_file_;  // rank 0, when asked for
  bool outputs_lost_ = false;
  std::unique_ptr<Timeline> timeline_;
  StepTiming total_{}, window_{};  // seconds: the whole run, and since the last log
  std::int64_t window_steps_ = 0;
  Clock::time_point last_end_{};
  double eval_s_ = 0;
  ReportData report_;
  std::vector<std::pair<std::string_view, double>> scalars_;  // reused for TensorBoard events
};

}  // namespace mnist_mpi
