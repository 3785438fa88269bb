// What a person sees of a run, in one object the trainer calls at a few points with plain facts:
// the start-up banner, the console progress (bar or lines), evaluation lines, skipped steps, the
// preemption message and the final report; TensorBoard scalars (--tensorboard-dir), the timeline
// of every rank (--timeline), the summary table of where the time went, the HTML report (--report)
// and every event of the metrics file (--metrics-file, JSON lines built with nlohmann::json: see
// include/mnist_mpi/json.hpp). The trainer formats nothing itself. Construction does only local
// work (it checks the paths and opens the metrics file, so bad ones fail at setup on every rank);
// start() is collective when --timeline is on, finish() always. Nothing is written that was not
// asked for. An output that cannot be written is lost, not fatal (Note [When an output cannot be
// written] in include/mnist_mpi/report/output.hpp).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/io/file_roles.hpp"
#include "mnist_mpi/launch/launch_env.hpp"
#include "mnist_mpi/optimizer_kind.hpp"
#include "mnist_mpi/report/html_report.hpp"
#include "mnist_mpi/report/output.hpp"
#include "mnist_mpi/report/progress.hpp"
#include "mnist_mpi/report/tensorboard.hpp"
#include "mnist_mpi/report/timeline.hpp"
#include "mnist_mpi/run_facts.hpp"

namespace mnist_mpi {

struct RunSummary;  // include/mnist_mpi/report/run_summary.hpp


// What the monitor is told of the options: plain facts, copied by the caller (src/train/rig.cpp,
// monitor_options), so that the monitor depends on no options struct and reads nothing else of it.
struct MonitorOptions {
  // its outputs and how much it says
  std::string metrics_file, timeline_file, report_file, tensorboard_dir;
  std::string progress = "auto";  // auto | bar | lines | off
  bool quiet = false;
  std::int64_t log_every = 100, eval_every = 0;  // the options' defaults, for a monitor made in code
  // the banner's and the summary's facts of the run
  std::string config_file, model, precision = "fp32", data_dir;
  bool exact_sums = false;
  OptimizerKind optimizer = OptimizerKind::kAdam;
  double base_lr = 1e-3;
  std::uint64_t seed = 42;
  double bucket_mb = 4.0, first_bucket_mb = 1.0;
  bool no_overlap = false, cuda_graph = false, checkpoint_async = true, skip_nonfinite_steps = false;
};

struct MonitorSetup {
  int rank = 0, world = 1;
  std::string host;
  std::vector<std::string> layer_names;  // for the timeline's backward spans
  std::size_t buckets = 0;
  std::int64_t total_steps = 0, steps_per_epoch = 1, global_batch = 0, accumulation = 1;
  std::chrono::steady_clock::time_point process_start;
  std::int64_t exact_chunk = 0;  // --exact-sums: images per chunk, each rank's micro-batch (0: off)
};

// The run as the trainer set it up: rank 0's banner, every rank's GPU line, the "start" event.
// The rest of the banner (sizes of the batch and the run, the buckets, the options) the monitor
// has from MonitorSetup and the options.
struct StartFacts {
  std::string device_note;      // said before the banner when not empty (src/backend/device.cpp)
  std::string backend;          // Backend::name()
  int threads = 0;              // per rank (the CPU backend)
  bool cuda = false;            // one GPU per rank ...
  bool shared_gpus = false;     // ... or ranks share them (--allow-gpu-sharing)
  bool nccl_hosts = false;      // ... share them, each rank its own NCCL host (NCCL_HOSTID): NCCL sums
  int gpu = -1, gpus = 0;       // CUDA: this rank's GPU, and how many its node has
  std::string gpu_description;  // CUDA: describe_gpu(gpu)
  LaunchEnv launch;
  std::int64_t train_images = 0, validation_images = 0, test_images = 0;
  std::string model;  // the model spec's text
  std::int64_t params = 0;
  std::string layers;               // Model::describe(): one line per layer, each ending in '\n'
  std::int64_t per_rank_batch = 0;  // per micro-batch
  std::string gradient_progress;    // Communicator::progress_mode() of the gradient communicator
  std::string conv_algos;           // Backend::time_convolutions' line (--conv-algos measured), or empty
  // --grad-compression other than none: the codec as given, the step it starts compressing at, and
  // the bytes a rank sends into the gradient sums in a step, compressed and as floats.
  std::string grad_compression;
  std::int64_t compression_start_step = 0;
  double wire_bytes = 0, float_bytes = 0;
  // The optimiser's moments: the largest any rank holds, and the whole (equal unless sharded).
  std::int64_t optimizer_state_bytes = 0, optimizer_state_total_bytes = 0;
  bool shard_optimizer = false;  // --shard-optimizer
};

class Monitor {
 public:
  using Clock = std::chrono::steady_clock;
  Monitor(MonitorOptions options, MonitorSetup setup);
  ~Monitor();
  // The files a run with these options writes (Note [No output is an input] in
  // include/mnist_mpi/io/file_roles.hpp): the metrics file, the timeline and the report with
  // their temporaries, and the TensorBoard event files.
  static void declare_files(const MonitorOptions& options, FileRoles& roles);

  Timeline* timeline() { return timeline_.get(); }  // null unless --timeline: the trainer records into it

  // Every rank, after set-up: which GPU this rank took (CUDA); on rank 0 the banner and the
  // "start" event. --quiet leaves only the event.
  void on_start(const StartFacts& facts);
  // Rank 0 prints "hosts: PLACEMENT" (describe_placement()) unless --quiet.
  void on_placement(const std::string& placement);
  void start(Communicator& comm);  // collective when --timeline (aligns clocks); then training starts
  // Every step, before on_log (every rank; only rank 0's figures are shown).
  void on_step(std::int64_t step, const StepTiming& phases, Clock::time_point end);
  // At --log-every, on rank 0: the global mean training loss over the window, the learning rate,
  // images/s; a progress line and the "step" event.
  void on_log(std::int64_t step, double loss, double lr, double images_per_s);
  // Every rank: this rank's step times summed since the last call (on_step's window) and their
  // number of steps; the window starts again (after on_log, which reads it).
  StepTiming take_window(std::int64_t& steps);
  // Rank 0: every rank's means per step over the last log window (Note [Every rank's step times]
  // in src/report/run_telemetry.cpp): the "ranks" event and the report's per-rank series.
  void on_ranks(std::int64_t step, const std::vector<RankTimes>& window);
  // An evaluation on rank 0 after `step` steps: a console line and an "eval" event. final_test:
  // the test evaluation after the last step, shown by on_final instead (its event has no epoch).
  void on_eval(std::int64_t step, std::int64_t epoch, const char* split, double accuracy, double loss,
               Clock::time_point begin, Clock::time_point end, bool final_test = false);
  // A step skipped for a non-finite gradient (--skip-nonfinite-steps), on rank 0: why.
  void on_skipped_step(std::int64_t step, const std::string& why);
  // --grad-compression auto chose its codecs (rank 0 prints `text` and writes a "codec_choice"
  // event: the link measured, backward's time and each bucket's codec).
  struct CodecChoice {
    std::int64_t step = 0;
    std::string text;
    double link_gbit_s = 0, latency_us = 0, backward_ms = 0;
    std::vector<std::string> buckets;
  };
  void on_codec_choice(const CodecChoice& c);
  // Rank 0, when a signal stopped the run: the message on stderr and the "preempted" event.
  void on_preempted(const PreemptedFacts& facts);
  // Rank 0, after the last step and the test evaluation: the final report on stdout (not with
  // --quiet) and the "final" event. Other ranks: nothing.
  void on_final(const FinalFacts& facts);
  // Collective: gathers and writes the timeline (--timeline); rank 0 prints the table, writes the
  // report and closes every output; then all ranks agree whether an output was lost.
  void finish(Communicator& comm, const FinalFacts& facts);
  // After finish(), on every rank: whether rank 0 lost an output (exit code 7).
  bool outputs_lost() const { return outputs_lost_; }
  // On rank 0: "<output> '<file>' (<error>)" for each output that could not be written so far.
  std::vector<std::string> lost_outputs() const;

 private:
  // The run's summary from the trainer's facts, the options and the time totals (rank 0).
  RunSummary summarise(const FinalFacts& facts) const;
  // The micro-batches a rank runs in one step, at most: --accumulation-steps, or its chunks.
  std::int64_t micro_batches_per_step() const;
  void check_replaced_output(const char* option, const std::string& path) const;
  // One event of the metrics file (rank 0; nothing without --metrics-file), flushed so that a
  // reader following the file sees it. Under Slurm, events that say where a run stands (start,
  // preempted, final) end with the job's fields (LaunchEnv::add_json_fields).
  void metrics(const nlohmann::ordered_json& event);

  const MonitorOptions opt_;
  MonitorSetup setup_;
  bool rank0_;
  LaunchEnv launch_;  // from on_start: the Slurm fields of the events
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
  std::unique_ptr<RunSummary> summary_;  // rank 0, from on_final
  std::vector<std::pair<std::string_view, double>> scalars_;  // reused for TensorBoard events
};

}  // namespace mnist_mpi
