// Checkpointer: resume, atomic writes by rank 0 on a background thread, retention
// (include/mnist_mpi/checkpoint/checkpointer.hpp).
#include "mnist_mpi/checkpoint/checkpointer.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <limits>
#include <sstream>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/resilience/fault.hpp"
#include "mnist_mpi/resilience/finite.hpp"
#include "mnist_mpi/resilience/preemption.hpp"

namespace fs = std::filesystem;

namespace mnist_mpi {
namespace {

void warn(const std::string& msg) {
  std::fflush(stdout);
  std::fprintf(stderr, "mnist_mpi: warning: %s\n", msg.c_str());
  std::fflush(stderr);
}

// The resolved options as they go into CONF (docs/checkpoint.md, "CONF"): every option that
// shapes the training state, with the batch sizes this run really uses, and without what says
// where or how a run started rather than what state it is in (resume, the data and checkpoint
// directories; the output paths are not in `resolved` at all): identical training states must give
// identical files on any machine.
std::string config_for_checkpoint(const std::string& resolved, std::int64_t global_batch, std::int64_t per_rank_batch) {
  std::istringstream in(resolved);
  std::string line, out;
  while (std::getline(in, line)) {
    if (line.rfind("resume = ", 0) == 0 || line.rfind("data-dir = ", 0) == 0 || line.rfind("checkpoint-dir = ", 0) == 0)
      continue;
    if (line.rfind("global-batch-size = ", 0) == 0)
      line = "global-batch-size = " + std::to_string(global_batch);
    else if (line.rfind("batch-size = ", 0) == 0)
      line = "batch-size = " + std::to_string(per_rank_batch);
    out += line + "\n";
  }
  return out;
}

std::uint32_t schedule_kind(const std::string& k) { return k == "step" ? 1u : k == "cosine" ? 2u : 0u; }

std::vector<std::string> list_temporaries(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (checkpoint_temporary_step(name) >= 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Note [One job per checkpoint directory]
// Two jobs on one --checkpoint-dir (a job submitted twice, a requeued job while the old one is
// still ending) would remove each other's temporary files as "left by a write that did not
// finish" and interleave their checkpoints. Rank 0 therefore takes an advisory lock, flock() on
// DIR/.mnist_mpi.lock, before it touches anything in the directory, and holds it for the job's
// life; the kernel releases it when the process ends, however it ends, so a killed job leaves no
// stale lock. The holder writes who it is into the file (host, pid, Slurm job, start time), and a
// second job is refused at set-up (exit 4) with that line. flock works across the nodes of a
// cluster on NFS (Linux emulates it with byte-range locks) and on Lustre mounted with flock.
constexpr const char* kLockName = ".mnist_mpi.lock";
constexpr const char* kWriteProbeName = ".mnist_mpi-write-test";

int lock_checkpoint_dir(const std::string& dir) {
  const std::string path = dir + "/" + kLockName;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0644);
  struct stat st {};
  if (fd < 0 && (errno == EACCES || errno == EPERM || errno == EROFS))
    throw_error(ExitCode::kCheckpoint, "the checkpoint directory " + quote_input(dir) +
                                           " is not writable (cannot create its lock file .mnist_mpi.lock: " +
                                           std::strerror(errno) + "); choose a writable --checkpoint-dir");
  if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int e = errno;
    if (fd >= 0) ::close(fd);
    throw_error(ExitCode::kCheckpoint, "cannot take the lock " + quote_input(path) + " of the checkpoint directory: " +
                                           (fd >= 0 ? "it is " + describe_path(path) : std::string(std::strerror(e))) +
                                           "; remove it or choose another --checkpoint-dir");
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    char holder[512] = {0};
    const ssize_t n = ::pread(fd, holder, sizeof holder - 1, 0);
    ::close(fd);
    std::string who = n > 0 ? std::string(holder, static_cast<std::size_t>(n)) : std::string();
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    if (e != EWOULDBLOCK)
      throw_error(ExitCode::kCheckpoint, "cannot lock the checkpoint directory " + quote_input(dir) + ": " +
                                             std::strerror(e) + "; choose another --checkpoint-dir");
    throw_error(ExitCode::kCheckpoint, "the checkpoint directory " + quote_input(dir) + " is in use by another job (" +
                                           (who.empty() ? "holder unknown" : quote_input(who, 160)) +
                                           "); wait for it to end, or give this job another --checkpoint-dir");
  }
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const char* job = std::getenv("SLURM_JOB_ID");
  const std::time_t now = std::time(nullptr);
  char when[64] = {0};
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S %Z", std::localtime(&now));
  const std::string me = std::string("host ") + host + ", pid " + std::to_string(::getpid()) +
                         (job ? std::string(", Slurm job ") + job : std::string()) + ", since " + when + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size()))
    warn("cannot write the holder into " + path + ": " + std::strerror(errno) + " (the lock is held anyway)");
  return fd;
}

}  // namespace

void Checkpointer::declare_files(const Options& o, FileRoles& roles) {
  const std::string owner = "checkpoints";
  // A finished checkpoint may sit in the directory the checkpointer writes (it resumes from there
  // by design); a --resume file named like its temporary or its lock would be removed or
  // overwritten, so that one clashes.
  if (!o.resume.empty() && o.resume != "auto") {
    const std::string name = std::filesystem::path(o.resume).filename().string();
    roles.input("--resume", o.resume, checkpoint_file_step(name) >= 0 ? owner : std::string());
  }
  if (o.checkpoint_dir.empty()) return;
  const std::string dir = o.checkpoint_dir;
  for (const auto& [step, name] : list_checkpoints(dir))
    roles.input("--checkpoint-dir (its checkpoint " + name + ")", dir + "/" + name, owner);
  if (file_kind(dir + "/" + kLockName) != FileKind::kMissing)
    roles.input("--checkpoint-dir (its lock file)", dir + "/" + kLockName, owner);
  roles.outputs_in(
      "--checkpoint-dir", dir,
      [](std::string_view view) {
        const std::string name(view);
        return name == kLockName || name == kWriteProbeName || checkpoint_file_step(name) >= 0 ||
               checkpoint_temporary_step(name) >= 0;
      },
      "checkpoints (step-NNNNNNNN.ckpt), their temporary files and its lock file", owner);
}

Checkpointer::Checkpointer(const Options& options, Communicator& comm, const CheckpointRun& run)
    : opt_(options), comm_(comm), run_(run), dir_(options.checkpoint_dir), rank0_(comm.rank() == 0) {
  if (!rank0_) return;
  if (!dir_.empty()) {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec || !fs::is_directory(dir_))
      throw_error(ExitCode::kCheckpoint, "cannot create the checkpoint directory " + quote_input(dir_) + ": " +
                                             (ec ? ec.message() : "it is " + describe_path(dir_)) +
                                             "; choose a writable --checkpoint-dir");
    lock_fd_ = lock_checkpoint_dir(dir_);  // before anything in the directory is touched
    // A write that never finished leaves a temporary file: it is never read, so remove it. Only
    // the holder of the lock gets here, so no other job's write is in flight.
    for (const std::string& t : list_temporaries(dir_)) {
      fs::remove(fs::path(dir_) / t, ec);
      if (!opt_.quiet)
        std::cout << "checkpoint: removed '" << dir_ << "/" << t << "', left by a write that did not finish\n";
    }
    // Find out now, not after hours of training, whether the directory takes a file.
    const std::string probe = kWriteProbeName;
    const std::uint8_t one = 1;
    try {
      write_file_atomically(dir_, probe, {&one, 1});
    } catch (const Error& e) {
      throw_error(ExitCode::kCheckpoint, "the checkpoint directory '" + dir_ + "' is not writable (" + e.what() + ")");
    }
    fs::remove(fs::path(dir_) / probe, ec);
    encoder_ = std::make_unique<CheckpointEncoder>(
        *run_.spec, config_for_checkpoint(opt_.resolved, run_.global_batch, per_rank_batch()),
        traits(opt_.optimizer.kind).moments == 2, run_.exact_chunk,
        CodecStateShape{run_.codec_state > 0 ? comm_.size() : 0, run_.codec_state, run_.codec_shared});
    stats_.bytes = static_cast<double>(encoder_->size());
  }
  if (!opt_.resume.empty()) find_resume_checkpoint();  // may refuse: no thread runs yet
  if (!dir_.empty() && opt_.checkpoint_async) {        // last (Note [Threads are joined on every path])
    thread_.start([this] { writer_loop(); }, mu_, quit_, cv_);
    fault_after_thread_start("checkpoint-writer", comm_.rank());
  }
}

Checkpointer::~Checkpointer() {
  thread_.join();
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock (the kernel does so for a dead process too)
}

void Checkpointer::find_resume_checkpoint() {
  auto use = [&](std::vector<std::uint8_t> bytes, const Checkpoint& ck, const std::string& path) {
    const std::string diff = check_compatible(ck, path);
    resume_bytes_ = std::move(bytes);
    resumed_from_ = path;
    if (!opt_.quiet) {
      std::cout << "resuming from " << path << ": step " << ck.meta.step << ", epoch " << ck.meta.epoch + 1
                << ", sample " << ck.meta.sampler_position << " of the epoch's permutation\n";
      if (!diff.empty())
        std::cout << "resume: options that differ from the run that wrote the checkpoint (this run's apply): " << diff
                  << "\n";
    }
  };
  if (opt_.resume != "auto") {
    std::vector<std::uint8_t> bytes = read_checkpoint_bytes(opt_.resume);
    const Checkpoint ck = decode_checkpoint(bytes, opt_.resume);
    use(std::move(bytes), ck, opt_.resume);
    return;
  }
  for (const auto& [step, name] : list_checkpoints(dir_)) {
    const std::string path = dir_ + "/" + name;
    std::vector<std::uint8_t> bytes;
    Checkpoint ck;
    try {
      bytes = read_checkpoint_bytes(path);
      ck = decode_checkpoint(bytes, path);
    } catch (const Error& e) {
      warn(std::string(e.what()) + " -- --resume auto skips it and tries the previous checkpoint");
      continue;
    }
    use(std::move(bytes), ck, path);  // another model's checkpoint is an error, not skipped
    return;
  }
  if (!opt_.quiet) std::cout << "--resume auto: no valid checkpoint in '" << dir_ << "'; starting from step 0\n";
}

std::string Checkpointer::check_compatible(const Checkpoint& ck, const std::string& path) const {
  const ModelSpec& spec = *run_.spec;
  const CheckpointMeta& m = ck.meta;
  const std::string fix = "; resume with the options that wrote it (its config: mnist_mpi evaluate --checkpoint '" +
                          path + "' --show-config), or use another --checkpoint-dir";
  if (ck.spec != spec.text || !(ck.input == spec.input) || ck.num_classes != spec.num_classes() ||
      ck.tensors != checkpoint_tensors(spec) || ck.state_tensors != checkpoint_state_tensors(spec))
    throw_error(ExitCode::kCheckpoint, "checkpoint '" + path + "' holds another model: its spec is '" + ck.spec +
                                           "', this run's --model is '" + spec.text + "'" + fix);
  if (m.optimizer_kind != traits(opt_.optimizer.kind).checkpoint_code)
    throw_error(ExitCode::kCheckpoint, "checkpoint '" + path + "' holds " + name_of(checkpoint_optimizer(m)) +
                                           " state, this run's --optimizer is " + name_of(opt_.optimizer.kind) + fix);
  if (m.global_batch != run_.global_batch)
    throw_error(ExitCode::kCheckpoint,
                "checkpoint '" + path + "' was trained with a global batch of " + std::to_string(m.global_batch) +
                    " images, this run's is " + std::to_string(run_.global_batch) +
                    ": the sampler position is counted in global batches; give --global-batch-size " +
                    std::to_string(m.global_batch) + " (on any number of ranks up to it)");
  if (ck.exact_chunk != run_.exact_chunk) {
    const auto mode = [](std::int64_t chunk) {
      return chunk > 0 ? "with --exact-sums, chunks of " + std::to_string(chunk) + " images"
                       : std::string("without --exact-sums");
    };
    throw_error(ExitCode::kCheckpoint,
                "checkpoint '" + path + "' was trained " + mode(ck.exact_chunk) + "; this run is " +
                    mode(run_.exact_chunk) +
                    ": the gradient sums would change; resume " +
                    (ck.exact_chunk > 0 ? "with --exact-sums --exact-chunk " + std::to_string(ck.exact_chunk)
                                        : std::string("without --exact-sums")));
  }
  if (m.train_count != run_.train_count)
    throw_error(ExitCode::kCheckpoint, "checkpoint '" + path + "' was trained on " + std::to_string(m.train_count) +
                                           " training images, this run has " + std::to_string(run_.train_count) +
                                           " (--data-dir, --train-limit, --validation-size)" + fix);
  if (m.step > run_.total_steps)
    throw_error(ExitCode::kCheckpoint, "checkpoint '" + path + "' is at step " + std::to_string(m.step) +
                                           ", past the end of this run (" + std::to_string(run_.total_steps) +
                                           " steps): raise --max-steps or --epochs to train on from it");
  // Everything else may change on resume; say what did.
  const auto a = key_value_lines(ck.config),
             b = key_value_lines(config_for_checkpoint(opt_.resolved, run_.global_batch, per_rank_batch()));
  std::string diff;
  for (const auto& [k, v] : b) {
    const auto it = a.find(k);
    const std::string old = it == a.end() ? "(unset)" : it->second;
    if (old != v) diff += (diff.empty() ? "" : ", ") + k + " " + old + " -> " + v;
  }
  return diff;
}

std::int64_t Checkpointer::restore(float* params,
                                   const std::function<void(const RestoredState&)>& restore_state) {
  std::uint64_t n = rank0_ ? resume_bytes_.size() : 0;
  comm_.broadcast(std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(&n), sizeof n), 0);
  if (n == 0) return 0;
  if (!rank0_) resume_bytes_.resize(static_cast<std::size_t>(n));
  constexpr std::size_t kChunk = std::size_t{1} << 30;  // MPI counts are ints
  for (std::size_t at = 0; at < resume_bytes_.size(); at += kChunk)
    comm_.broadcast(std::span<std::uint8_t>(resume_bytes_.data() + at, std::min(kChunk, resume_bytes_.size() - at)), 0);
  const Checkpoint ck = decode_checkpoint(resume_bytes_, rank0_ ? resumed_from_ : "(received from rank 0)");
  MNIST_CHECK(ck.meta.param_count == run_.spec->param_count &&
                  static_cast<std::int64_t>(ck.model_state.size()) == run_.spec->state_count,
              ExitCode::kCheckpoint, "checkpoint from rank 0 does not fit this rank's model");
  std::copy(ck.params.begin(), ck.params.end(), params);
  restore_state({ck.first_moment.data(), ck.second_moment.empty() ? nullptr : ck.second_moment.data(),
                 ck.meta.optimizer_steps, ck.exact_limits, ck.model_state, ck.codec_ranks, ck.codec_shared, ck.codec_state});
  std::vector<std::uint8_t>().swap(resume_bytes_);
  return ck.meta.step;
}

bool Checkpointer::write_failed() {
  std::lock_guard<std::mutex> lk(mu_);
  return !error_.empty();
}

std::string Checkpointer::wait_for_writes() {
  if (!dir_.empty()) wait_idle();
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

void Checkpointer::wait_idle() {
  const double t0 = now_s();
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return !job_; });
  stats_.wait_previous_ms += 1e3 * (now_s() - t0);
}

void Checkpointer::write(const StepEnd& s, const std::function<TrainingState()>& state_now) {
  wait_idle();  // the encoder's image belongs to the writer until its job is done
  // A diverged model is never saved. The trainer stops (or skips) a non-finite step
  // before it reaches the parameters, so this is the last line of defence: the write is refused,
  // the last good checkpoint stays, and the step boundary ends every rank with this message.
  // The state in host memory first: on a device the check below must see this step's parameters,
  // not those of the last host copy.
  const double t0 = now_s();
  const TrainingState state = state_now();
  if (!params_are_finite(state.params, run_.spec->param_count)) {
    std::lock_guard<std::mutex> lk(mu_);
    error_ = "not writing the checkpoint after step " + std::to_string(s.step) +
             ": the parameters hold NaN or inf (the last good checkpoint is kept)";
    return;
  }
  CheckpointMeta m;
  m.step = s.step;
  m.steps_per_epoch = run_.steps_per_epoch;
  m.epoch = s.step / run_.steps_per_epoch;
  m.sampler_position = (s.step % run_.steps_per_epoch) * run_.global_batch;
  m.global_batch = run_.global_batch;
  m.train_count = run_.train_count;
  m.total_steps = run_.total_steps;
  m.world_size = comm_.size();
  m.seed = opt_.seed;
  m.sampler_epoch = m.epoch;
  m.dropout_step = s.step;
  m.param_count = run_.spec->param_count;
  m.optimizer_steps = state.optimizer_steps;
  const OptimizerConfig& oc = *state.optimizer;
  m.optimizer_kind = traits(oc.kind).checkpoint_code;
  m.nesterov = oc.nesterov ? 1u : 0u;
  m.beta1 = oc.beta1;
  m.beta2 = oc.beta2;
  m.eps = oc.eps;
  m.momentum = oc.momentum;
  m.weight_decay = oc.weight_decay;
  const ScheduleConfig& sc = opt_.schedule;
  m.schedule_kind = schedule_kind(sc.kind);
  m.base_lr = sc.base_lr;
  m.gamma = sc.gamma;
  m.step_epochs = sc.step_epochs;
  m.min_lr = sc.min_lr;
  m.warmup_steps = sc.warmup_steps;
  m.last_lr = s.lr;
  m.next_lr = s.next_lr;
  m.validation_accuracy = s.validation_accuracy;
  m.validation_loss = s.validation_loss;
  m.train_loss = s.train_loss;
  encoder_->capture(m, state.params, state.first_moment, state.second_moment, state.exact_limits,
                    state.model_state, state.codec_state);
  stats_.capture_ms += 1e3 * (now_s() - t0);
  if (!opt_.quiet)
    std::printf("checkpoint after step %lld: %s/step-%08lld.ckpt\n", static_cast<long long>(s.step), dir_.c_str(),
                static_cast<long long>(s.step));  // as checkpoint_file_name, without allocating
  if (thread_.running()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = true;
    }
    cv_.notify_all();
  } else {
    write_job();
  }
}

void Checkpointer::write_job() {
  const double t0 = now_s();
  const CheckpointMeta& m = encoder_->meta();
  const std::string name = checkpoint_file_name(m.step);
  try {
    encoder_->seal();
    write_file_atomically(dir_, name, encoder_->bytes());
    validation_of_[name] = m.validation_accuracy;
    prune();
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.written;
    stats_.last_file = dir_ + "/" + name;
    stats_.write_ms += 1e3 * (now_s() - t0);
  } catch (const Error& e) {
    std::lock_guard<std::mutex> lk(mu_);
    if (error_.empty()) error_ = e.what();
  }
}

// Keeps the newest --keep-checkpoints files and the one with the best validation accuracy (the
// newest of equals); removes the rest. Files this run has not seen are read for their META.
void Checkpointer::prune() {
  if (opt_.keep_checkpoints <= 0) return;
  const auto files = list_checkpoints(dir_);
  std::string best;
  double best_acc = -1.0;
  for (const auto& [step, name] : files) {  // newest first: ">" keeps the newest of equals
    auto it = validation_of_.find(name);
    if (it == validation_of_.end()) {
      double acc = std::numeric_limits<double>::quiet_NaN();
      try {
        acc = read_checkpoint_meta(dir_ + "/" + name).validation_accuracy;
      } catch (const Error&) {
      }
      it = validation_of_.emplace(name, acc).first;
    }
    if (std::isfinite(it->second) && it->second > best_acc) {
      best_acc = it->second;
      best = name;
    }
  }
  for (std::size_t i = static_cast<std::size_t>(opt_.keep_checkpoints); i < files.size(); ++i) {
    const std::string& name = files[i].second;
    if (name == best) continue;
    std::error_code ec;
    fs::remove(fs::path(dir_) / name, ec);
    validation_of_.erase(name);
  }
}

void Checkpointer::writer_loop() {
  block_preemption_signals();  // taken by the signal thread (Note [The preemption flag])
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return job_ || quit_; });
    if (job_) {
      lk.unlock();
      write_job();
      lk.lock();
      job_ = false;
      cv_.notify_all();
      continue;
    }
    return;
  }
}

}  // namespace mnist_mpi
