// The run monitor (see include/mnist_mpi/report/monitor.hpp): rank 0 keeps the curves and the
// time totals, and writes the console output and the metrics file; every rank keeps its own
// timeline.
#include "mnist_mpi/report/monitor.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <sstream>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/data/sampler.hpp"  // part_count
#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/json.hpp"
#include "mnist_mpi/report/ranks.hpp"
#include "mnist_mpi/report/report_command.hpp"  // kMetricsFormat
#include "mnist_mpi/report/run_summary.hpp"

namespace mnist_mpi {
namespace {

// Per rank, "109.0, 95.7" (MB, one decimal: the "final" event has the exact values); beyond 8
// ranks the range, "95.7 to 109.0 (16 ranks; the most on rank 3)".
std::string mb_list(const std::vector<std::uint64_t>& kib) {
  const auto mb = [](std::uint64_t k) { return fmt("%.1f", static_cast<double>(k) / 1024.0); };
  if (kib.size() > 8) {
    const auto [lo, hi] = std::minmax_element(kib.begin(), kib.end());
    return mb(*lo) + " to " + mb(*hi) + " (" + std::to_string(kib.size()) + " ranks; the most on rank " +
           std::to_string(hi - kib.begin()) + ")";
  }
  std::string s;
  for (std::size_t r = 0; r < kib.size(); ++r) s += (r ? ", " : "") + mb(kib[r]);
  return s;
}

}  // namespace

Monitor::Monitor(MonitorOptions options, MonitorSetup setup)
    : opt_(std::move(options)),
      setup_(std::move(setup)),
      rank0_(setup_.rank == 0),
      progress_(rank0_ ? resolve_progress_mode(opt_.progress, opt_.quiet) : ProgressMode::kOff, setup_.total_steps,
                setup_.steps_per_epoch, setup_.global_batch) {
  const std::int64_t steps = std::min<std::int64_t>(setup_.total_steps, std::int64_t{1} << 48);  // no overflow below
  const std::int64_t evaluations = steps / std::max<std::int64_t>(setup_.steps_per_epoch, 1) + 2 +
                                   (opt_.eval_every > 0 ? steps / opt_.eval_every : 0);
  if (rank0_) {
    // Bad paths fail here, at set-up (exit 2), not after an hour of training.
    if (!opt_.metrics_file.empty()) {
      check_output_path(opt_.metrics_file, "--metrics-file", ExitCode::kUsage);
      metrics_file_ = std::make_unique<OutputFile>("the metrics file (--metrics-file)", opt_.metrics_file);
      metrics_file_->open_or_throw(ExitCode::kUsage);
    }
    if (!opt_.timeline_file.empty()) {
      check_replaced_output("--timeline", opt_.timeline_file);
      timeline_file_ =
          std::make_unique<OutputFile>("the timeline (--timeline)", opt_.timeline_file, OutputFile::Mode::kReplace);
    }
    if (!opt_.report_file.empty()) {
      check_replaced_output("--report", opt_.report_file);
      report_file_ =
          std::make_unique<OutputFile>("the report (--report)", opt_.report_file, OutputFile::Mode::kReplace);
    }
    if (!opt_.tensorboard_dir.empty())
      tensorboard_ = std::make_unique<TensorBoardWriter>(opt_.tensorboard_dir, setup_.host);
    // Reserved up front so that logging allocates nothing, up to a cap: --max-steps comes from the
    // user, and a run of 2^63 steps must not ask for exabytes here (it grows past the cap instead).
    constexpr std::int64_t kMaxReserved = std::int64_t{1} << 20;
    const std::int64_t logs = opt_.log_every > 0 ? steps / opt_.log_every + 1 : 0;
    report_.train.reserve(static_cast<std::size_t>(std::min(logs, kMaxReserved)));
    report_.evals.reserve(static_cast<std::size_t>(std::min(evaluations, kMaxReserved)));
    report_.rank_points.reserve(static_cast<std::size_t>(std::min(logs + 1, kMaxReserved)));
    report_.steps_per_epoch = setup_.steps_per_epoch;
    scalars_.reserve(8);
  }
  if (!opt_.timeline_file.empty())
    timeline_ =
        std::make_unique<Timeline>(setup_.rank,
                                   timeline_capacity(setup_.total_steps, micro_batches_per_step(), setup_.layer_names.size(),
                                                     setup_.buckets, evaluations, setup_.world),
                                   setup_.layer_names);
}

std::int64_t Monitor::micro_batches_per_step() const {
  if (setup_.exact_chunk == 0) return setup_.accumulation;
  return largest_part(setup_.global_batch / setup_.exact_chunk, setup_.world);
}

// An output written at the end through PATH.tmp and a rename: a directory, a FIFO or a missing
// directory is refused (Note [Look before you open]), and so is a directory we cannot create the
// temporary file in. A character device (/dev/null) is written directly.
void Monitor::check_replaced_output(const char* option, const std::string& path) const {
  check_output_path(path, option, ExitCode::kUsage);
  if (file_kind(path) == FileKind::kCharDevice) return;
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  MNIST_CHECK(::access(dir.c_str(), W_OK) == 0, ExitCode::kUsage,
              std::string(option) + " " + quote_input(path) + ": cannot write its directory (" +
                  std::strerror(errno) + "); choose a writable path");
}

void Monitor::declare_files(const MonitorOptions& o, FileRoles& roles) {
  if (!o.metrics_file.empty()) roles.output("--metrics-file", o.metrics_file);
  for (const auto& [option, path] : {std::pair{"--timeline", o.timeline_file}, std::pair{"--report", o.report_file}}) {
    if (!path.empty()) roles.replaced_output(option, path, OutputFile::kReplaceSuffix);  // OutputFile::Mode::kReplace
  }
  if (!o.tensorboard_dir.empty())
    roles.outputs_in(
        "--tensorboard-dir", o.tensorboard_dir,
        [](std::string_view name) { return name.rfind(TensorBoardWriter::kFilePrefix, 0) == 0; },
        std::string("event files (") + TensorBoardWriter::kFilePrefix + "*)");
}

void Monitor::metrics(const Json& event) {
  if (metrics_file_ && metrics_file_->write(json_text(event)) && metrics_file_->write("\n")) metrics_file_->flush();
}

std::vector<std::string> Monitor::lost_outputs() const {
  std::vector<std::string> lost;
  for (const OutputFile* f : {metrics_file_.get(), timeline_file_.get(), report_file_.get()})
    if (f && f->failed()) lost.push_back(f->lost());
  if (tensorboard_ && tensorboard_->failed()) lost.push_back(tensorboard_->lost());
  if (rank0_ && OutputFile::standard_output().failed()) lost.push_back(OutputFile::standard_output().lost());
  return lost;
}

void Monitor::on_placement(const std::string& placement) {
  if (rank0_ && !opt_.quiet) std::printf("hosts: %s\n", placement.c_str());
}

void Monitor::on_start(const StartFacts& f) {
  launch_ = f.launch;
  // Every rank: which GPU it took. Plain stdout: only rank 0's standard output counts as an output
  // of the run (Note [When an output cannot be written]).
  if (f.cuda && !opt_.quiet)
    std::printf("rank %d on %s: GPU %d of %d, %s\n", setup_.rank, setup_.host.c_str(), f.gpu, f.gpus,
                f.gpu_description.c_str());
  if (!rank0_) return;
  if (metrics_file_) {
    // format: kMetricsFormat (include/mnist_mpi/report/report_command.hpp); what `mnist_mpi report`
    // labels a run with and needs for its axes.
    Json event{{"event", "start"},
               {"format", kMetricsFormat},
               {"version", MNIST_MPI_VERSION},
               {"config", opt_.config_file},
               {"model", opt_.model},
               {"precision", opt_.precision},
               {"exact_sums", opt_.exact_sums},
               {"optimizer", name_of(opt_.optimizer)},
               {"lr", json_number(opt_.base_lr)},
               {"seed", opt_.seed},
               {"steps_per_epoch", setup_.steps_per_epoch},
               {"total_steps", setup_.total_steps},
               {"world_size", setup_.world},
               {"global_batch", setup_.global_batch},
               {"launcher", launch_.launcher}};
    launch_.add_json_fields(event);
    event["shard_optimizer"] = f.shard_optimizer;
    event["grad_compression"] = f.grad_compression.empty() ? std::string("none") : f.grad_compression;
    if (!f.grad_compression.empty()) {
      event["compression_start_step"] = f.compression_start_step;
      event["wire_bytes_per_step"] = json_number(f.wire_bytes);
    }
    event["optimizer_state_bytes_per_rank"] = f.optimizer_state_bytes;
    event["optimizer_state_bytes_total"] = f.optimizer_state_total_bytes;
    metrics(event);
  }
  if (opt_.quiet) return;
  // "34" or, when the global batch does not divide evenly, "33-34" (Note [Uneven slices]).
  const auto per_rank_text = [&](std::int64_t largest) {
    const std::int64_t parts = setup_.world * setup_.accumulation;
    std::int64_t smallest = part_count(setup_.global_batch, parts, parts - 1);  // the last part
    std::string chunks;
    if (setup_.exact_chunk > 0) {  // Note [Chunks of the global batch]: whole chunks per rank
      const std::int64_t c = setup_.exact_chunk, n = setup_.global_batch / c;
      largest = largest_part(n, setup_.world) * c;
      smallest = part_count(n, setup_.world, setup_.world - 1) * c;
      chunks = " in chunks of " + std::to_string(c);
    }
    return (smallest == largest ? "" : std::to_string(smallest) + "-") + std::to_string(largest) + " per rank" + chunks;
  };
  std::ostringstream os;
  if (!f.device_note.empty()) os << f.device_note << "\n";
  os << "mnist_mpi " MNIST_MPI_VERSION ": " << setup_.world << " rank(s), backend " << f.backend << ", ";
  if (f.cuda && f.nccl_hosts)
    os << "ranks share GPUs, each its own NCCL host (NCCL_HOSTID): gradients summed by NCCL over its network "
          "transport\n";
  else if (f.cuda && !f.shared_gpus)
    os << "one GPU per rank, gradients summed by NCCL\n";
  else if (f.cuda)
    os << "ranks share GPUs (--allow-gpu-sharing): gradients summed through host memory by MPI, as NCCL needs one GPU "
          "per rank\n";
  else
    os << f.threads << " thread(s) per rank\n";
  if (!launch_.describe().empty()) os << launch_.describe() << "\n";
  os << "data: " << f.train_images << " train, " << f.validation_images << " validation, " << f.test_images
     << " test images from " << opt_.data_dir << "\n"
     << "model: " << f.model << " (" << f.params << " parameters)\n"
     << f.layers << "batch: " << setup_.global_batch << " global, " << per_rank_text(f.per_rank_batch) << "; "
     << setup_.steps_per_epoch << " steps per epoch, " << setup_.total_steps << " steps\n"
     << "gradients: " << setup_.buckets << " bucket(s) of at most " << opt_.bucket_mb << " MB (first "
     << opt_.first_bucket_mb << " MB), " << (opt_.no_overlap ? "one blocking sum after backward" : f.gradient_progress)
     << "\n";
  if (!f.conv_algos.empty()) os << f.conv_algos << "\n";
  if (f.grad_compression.rfind("auto", 0) == 0) {
    os << "gradient codec: " << f.grad_compression
       << ": each bucket none, bf16 or powersgd, chosen from the measured link and backward's timing at step "
       << f.compression_start_step << " or after 4 timed steps, whichever is later (floats before it)\n";
  } else if (!f.grad_compression.empty()) {
    char line[200];
    std::snprintf(line, sizeof line, "gradient codec: %s, %.2f MB a step on the wire instead of %.2f MB (%.1fx less)",
                  f.grad_compression.c_str(), f.wire_bytes / 1e6, f.float_bytes / 1e6,
                  f.wire_bytes > 0 ? f.float_bytes / f.wire_bytes : 0.0);
    os << line;
    if (f.compression_start_step > 0) os << ", from step " << f.compression_start_step << " (floats before it)";
    os << "\n";
  }
  if (opt_.cuda_graph)
    os << "step: captured as one CUDA graph at its second run and replayed (--cuda-graph); the host does not time "
          "its parts\n";
  const auto mb = [](std::int64_t bytes) { return static_cast<double>(bytes) / 1e6; };
  char state[160];
  if (f.shard_optimizer)
    std::snprintf(state, sizeof state, "optimizer state: %.1f MB per rank at most (1/%d of %.1f MB, sharded)\n",
                  mb(f.optimizer_state_bytes), setup_.world, mb(f.optimizer_state_total_bytes));
  else
    std::snprintf(state, sizeof state, "optimizer state: %.1f MB per rank (not sharded)\n",
                  mb(f.optimizer_state_bytes));
  os << state;
  OutputFile& out = OutputFile::standard_output();
  if (out.write(os.str())) out.flush();
}

void Monitor::start(Communicator& comm) {
  if (timeline_) timeline_->align_clocks(comm);
  progress_.start(Clock::now());
}

void Monitor::on_step(std::int64_t step, const StepTiming& p, Clock::time_point end) {
  total_ += p;
  window_ += p;
  ++window_steps_;
  last_end_ = end;
  // On a --log-every step the bar is drawn by on_log, with the new loss.
  const bool log_step = opt_.log_every > 0 && ((step + 1) % opt_.log_every == 0 || step + 1 == setup_.total_steps);
  if (!log_step) progress_.step_done(step, end);
}

StepTiming Monitor::take_window(std::int64_t& steps) {
  const StepTiming w = window_;
  steps = window_steps_;
  window_ = StepTiming{};
  window_steps_ = 0;
  return w;
}

void Monitor::on_log(std::int64_t step, double loss, double lr, double images_per_s) {
  if (!rank0_) return;
  progress_.log(step, loss, lr, images_per_s);
  progress_.step_done(step, last_end_);
  report_.train.push_back(TrainPoint{step + 1, loss, lr, images_per_s});
  if (tensorboard_) {
    const double n = static_cast<double>(std::max<std::int64_t>(window_steps_, 1));
    const StepTiming& w = window_;
    scalars_.clear();
    scalars_.emplace_back("train/loss", loss);
    scalars_.emplace_back("train/learning_rate", lr);
    scalars_.emplace_back("train/images_per_s", images_per_s);
    scalars_.emplace_back("time/compute_ms", 1e3 * (w.data + w.forward + w.backward + w.optimizer) / n);
    scalars_.emplace_back("time/exposed_comm_ms", 1e3 * w.exposed_comm / n);
    tensorboard_->scalars(step + 1, scalars_);
  }
  if (metrics_file_)
    metrics({{"event", "step"},
             {"step", step + 1},
             {"epoch", step / setup_.steps_per_epoch + 1},
             {"loss", json_number(loss)},
             {"lr", json_number(lr)},
             {"images_per_s", json_number(images_per_s)}});
}


void Monitor::on_ranks(std::int64_t step, const std::vector<RankTimes>& window) {
  if (!rank0_) return;
  RankPoint p{step, {}, {}};
  for (const RankTimes& r : window) {
    p.compute_ms.push_back(1e3 * r.compute());
    p.wait_ms.push_back(1e3 * r.per_step.exposed_comm);
  }
  report_.rank_points.push_back(std::move(p));
  if (!metrics_file_) return;
  Json ranks = Json::array();
  for (const RankTimes& r : window) ranks.push_back(rank_json(r));
  metrics({{"event", "ranks"}, {"step", step}, {"ranks", std::move(ranks)}});
}

void Monitor::on_eval(std::int64_t step, std::int64_t epoch, const char* split, double accuracy, double loss,
                      Clock::time_point begin, Clock::time_point end, bool final_test) {
  if (timeline_) timeline_->record(SpanKind::kEvaluation, begin, end, step, split[0] == 't' ? 1 : 0);
  if (!rank0_) return;
  eval_s_ += std::chrono::duration<double>(end - begin).count();
  progress_.pause(end - begin);
  if (!final_test) {
    char b[160];
    std::snprintf(b, sizeof b, "epoch %lld step %lld: %s accuracy %.4f loss %.4f", static_cast<long long>(epoch + 1),
                  static_cast<long long>(step), split, accuracy, loss);
    progress_.line(b);
  }
  report_.evals.push_back(EvalPoint{split, step, accuracy, loss});
  if (tensorboard_) {
    const bool test = split[0] == 't';
    scalars_.clear();
    scalars_.emplace_back(test ? "test/accuracy" : "validation/accuracy", accuracy);
    scalars_.emplace_back(test ? "test/loss" : "validation/loss", loss);
    tensorboard_->scalars(step, scalars_);
  }
  if (metrics_file_) {
    Json event{{"event", "eval"}, {"split", split}, {"step", step}};
    if (!final_test) event["epoch"] = epoch + 1;
    event["accuracy"] = json_number(accuracy);
    event["loss"] = json_number(loss);
    metrics(event);
  }
}

void Monitor::on_skipped_step(std::int64_t step, const std::string& why) {
  if (!rank0_) return;
  const std::string text = "epoch " + std::to_string(step / setup_.steps_per_epoch + 1) + " step " +
                           std::to_string(step + 1) + "/" + std::to_string(setup_.total_steps) +
                           " skipped: non-finite gradient (" + why + ")";
  progress_.line(text.c_str());  // not with --quiet
}

void Monitor::on_preempted(const PreemptedFacts& f) {
  if (!rank0_) return;
  const std::string where = f.checkpointing
                                ? "checkpoint " + f.checkpoint + " written; rerun with --resume auto to continue"
                                : "no --checkpoint-dir, so nothing was saved";
  OutputFile::standard_output().flush();  // what was printed comes first
  std::fprintf(stderr, "mnist_mpi: stopped by %s after step %lld of %lld: %s (exit code 75)\n", f.signal,
               static_cast<long long>(f.steps), static_cast<long long>(setup_.total_steps), where.c_str());
  std::fflush(stderr);
  if (metrics_file_) {
    Json event{{"event", "preempted"}, {"signal", f.signal}, {"step", f.steps}, {"checkpoint", f.checkpoint}};
    launch_.add_json_fields(event);
    metrics(event);
  }
}

void Monitor::on_codec_choice(const CodecChoice& c) {
  if (!rank0_) return;
  progress_.line(c.text.c_str());  // not with --quiet
  if (metrics_file_) {
    Json buckets = Json::array();
    for (const std::string& b : c.buckets) buckets.push_back(b);
    metrics(Json{{"event", "codec_choice"},
                 {"step", c.step},
                 {"link_gbit_s", json_number(c.link_gbit_s)},
                 {"latency_us", json_number(c.latency_us)},
                 {"backward_ms", json_number(c.backward_ms)},
                 {"buckets", buckets}});
  }
}

Monitor::~Monitor() = default;

RunSummary Monitor::summarise(const FinalFacts& f) const {
  RunSummary s;
  s.config = opt_.config_file;
  s.model = opt_.model;
  s.precision = opt_.precision;
  s.optimizer = name_of(opt_.optimizer);
  s.exact_sums = opt_.exact_sums;
  s.seed = opt_.seed;
  s.world_size = setup_.world;
  s.global_batch = setup_.global_batch;
  s.steps_per_epoch = setup_.steps_per_epoch;
  s.end = f;
  s.buckets = static_cast<std::int64_t>(setup_.buckets);
  s.process_s = std::chrono::duration<double>(Clock::now() - setup_.process_start).count();
  s.time = time_shares(f.startup_s, total_);  // sums over every step, not the steady means
  s.time.push_back({"evaluation", eval_s_});
  double known = 0;
  for (const TimeShare& share : s.time) known += share.seconds;
  s.time.push_back({"other", std::max(0.0, s.process_s - known)});
  return s;
}

// Long on purpose (Note [Why a function is long] in docs/style.md): the final report, one line
// after another in the order they are printed, then the "final" event with the same figures: both
// from the run's one summary (include/mnist_mpi/report/run_summary.hpp).
void Monitor::on_final(const FinalFacts& facts) {
  if (!rank0_) return;
  summary_ = std::make_unique<RunSummary>(summarise(facts));
  const FinalFacts& f = summary_->end;
  const StepTiming& t = f.per_step;
  const CheckpointStats& c = f.checkpoints;
  OutputFile& out = OutputFile::standard_output();
  // One text for the summary, the report and its facts ("none (one rank)" for a single rank).
  const std::string straggler = summary_->straggler_line();
  if (!opt_.quiet) {
    out.print("test accuracy %.4f loss %.4f after %lld steps (%.2f epochs)\n", f.test_accuracy, f.test_loss,
              static_cast<long long>(f.steps), f.epochs);
    out.print("%.0f images/s steady, wall %.1f s (+ evaluation %.1f s), start-up %.2f s, peak RSS per rank %s MB\n",
              f.images_per_s, f.wall_s, f.eval_s, f.startup_s, mb_list(f.peak_rss_kib).c_str());
    out.print(
        "per step: data %.2f ms, forward %.2f ms, backward %.2f ms, exposed communication %.2f ms, "
        "optimizer %.2f ms; %.1f MB reduced\n",
        1e3 * t.data, 1e3 * t.forward, 1e3 * t.backward, 1e3 * t.exposed_comm, 1e3 * t.optimizer,
        t.reduced_bytes / 1048576.0);
    if (c.written > 0) {
      const double n = static_cast<double>(c.written);
      const double state = static_cast<double>(f.params) * sizeof(float) * (1.0 + traits(opt_.optimizer).moments);
      out.print(
          "checkpoints: %lld written, %.2f MB each (parameters and optimizer state %.2f MB + %.1f KB); "
          "rank 0 copied the state in %.2f ms, wrote it in %.1f ms (%s); the other ranks waited %.2f ms "
          "at a checkpoint step (%.2f ms at other steps)\n",
          static_cast<long long>(c.written), c.bytes / 1048576.0, state / 1048576.0, (c.bytes - state) / 1024.0,
          c.capture_ms / n, c.write_ms / n, opt_.checkpoint_async ? "in the background" : "inline", c.others_wait_ms,
          c.others_wait_baseline_ms);
    }
    if (f.exact_chunk > 0)
      out.print("exact sums: chunks of %lld images, %lld probe pass(es) (the first step's, and each value out of "
                "its predicted range)\n",
                static_cast<long long>(f.exact_chunk), static_cast<long long>(f.exact_sum_probes));
    if (opt_.skip_nonfinite_steps || f.skipped_steps > 0)
      out.print("%lld non-finite step(s) skipped\n", static_cast<long long>(f.skipped_steps));
    if (f.target.accuracy > 0 && f.target.reached)
      out.print("target accuracy %.4f reached after %lld steps (validation %.4f), %.1f s from the process start\n",
                f.target.accuracy, static_cast<long long>(f.target.step), f.target.validation_accuracy,
                f.target.time_from_process_start_s);
    else if (f.target.accuracy > 0)
      out.print("target accuracy %.4f not reached\n", f.target.accuracy);
    if (f.ranks.size() > 1) {
      std::string compute, wait;
      for (const RankTimes& r : f.ranks) {
        compute += (compute.empty() ? "" : " / ") + fmt("%.2f", 1e3 * r.compute());
        wait += (wait.empty() ? "" : " / ") + fmt("%.2f", 1e3 * r.per_step.exposed_comm);
      }
      out.print("ranks: compute per step %s ms, waiting %s ms; straggler: %s\n", compute.c_str(), wait.c_str(),
                straggler.c_str());
    }
    out.print("params_hash %s\n", f.params_hash.c_str());
  }
  report_.ranks = f.ranks;
  report_.straggler = straggler;
  report_.straggler_rank = f.straggler.rank;
  out.flush();
  if (!metrics_file_) return;
  Json event = summary_->final_event();
  launch_.add_json_fields(event);
  metrics(event);
}

void Monitor::finish(Communicator& comm, const FinalFacts& f) {
  if (timeline_) timeline_->gather_and_write(comm, timeline_file_.get(), setup_.host);
  if (rank0_) {
    OutputFile& out = OutputFile::standard_output();
    if (!summary_) summary_ = std::make_unique<RunSummary>(summarise(f));  // on_final made it, when called
    const RunSummary& summary = *summary_;
    const double all_s = summary.process_s;
    report_.time = summary.time;
    out.print("where the time went (rank 0, %lld steps, %.2f s from process start):\n", static_cast<long long>(f.steps),
              all_s);
    out.print("  %-22s %9s %7s %14s\n", "phase", "seconds", "share", "ms/step (all)");
    for (const TimeShare& s : report_.time) {
      const bool per_step = s.name != "start-up" && s.name != "evaluation" && s.name != "other";
      out.print("  %-22s %9.3f %6.1f%% %14s\n", s.name.c_str(), s.seconds, all_s > 0 ? 100.0 * s.seconds / all_s : 0.0,
                per_step && f.steps > 0 ? fmt("%.3f", 1e3 * s.seconds / static_cast<double>(f.steps)).c_str() : "");
    }
    if (timeline_ && !timeline_file_->failed())
      out.print("timeline: %s (open it in Perfetto or chrome://tracing)\n", opt_.timeline_file.c_str());
    if (tensorboard_ && tensorboard_->close())
      out.print("tensorboard: %s (tensorboard --logdir %s)\n", tensorboard_->path().c_str(),
                opt_.tensorboard_dir.c_str());
    out.flush();

    if (report_file_) {
      report_.facts = summary.facts();
      if (write_html_report(*report_file_, report_)) out.print("report: %s\n", opt_.report_file.c_str());
    }
    if (metrics_file_) metrics_file_->close();
    // The summary names what was lost (each was reported on stderr when it happened).
    const std::vector<std::string> lost = lost_outputs();
    if (!lost.empty()) {
      out.print("outputs lost (training finished; exit code 7):\n");
      for (const std::string& l : lost) out.print("  %s\n", l.c_str());
    }
    out.flush();
  }
  // Only rank 0 writes outputs; every rank exits alike (Note [When an output cannot be written]).
  std::int64_t lost = rank0_ && !lost_outputs().empty() ? 1 : 0;
  comm.allreduce_max(std::span<std::int64_t>(&lost, 1));
  outputs_lost_ = lost != 0;
}

}  // namespace mnist_mpi
