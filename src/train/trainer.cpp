// One rank's training loop (see include/mnist_mpi/train/trainer.hpp). The gradient of every rank
// is the sum over its slice divided by the GLOBAL batch; the allreduce sums these, so every rank
// applies the gradient of the global mean loss (Note [Averaging is a scaled sum] in src/train/gradient_pipeline.cpp).
#include "mnist_mpi/train/trainer.hpp"

#include <algorithm>
#include <limits>
#include <thread>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/consistency.hpp"  // agreed_options
#include "mnist_mpi/comm/watchdog.hpp"
#include "mnist_mpi/config/combinations.hpp"
#include "mnist_mpi/hash.hpp"  // hash_floats, hex64
#include "mnist_mpi/resilience/preemption.hpp"
#include "mnist_mpi/resilience/replicas.hpp"

namespace mnist_mpi {

// Set-up does only local work (Note [Ending every rank] in src/main.cpp), in this order: the
// device, the data, the plan and the model spec, then the rig (the backend and its gradient
// communicator, the training state, the evaluation model, the monitor and the step).
Trainer::Trainer(const Options& options, Communicator& comm, std::chrono::steady_clock::time_point start)
    : opt_(options), comm_(comm), start_(start), rank0_(comm.rank() == 0) {
  device_ = choose_run_device(opt_, comm_);
  // Every pair of options, now with what the run found (Options built in code come through here too).
  const RunPlace place{device_.choice.cuda, device_.shared_gpus, comm_.host(), comm_.size()};
  check_combinations(opt_, &place);
  launch_ = read_launch_env();
  launch_.check_world_size(comm_.size());
  fault_ = fault_from_env();
  check_fault_rank(fault_, comm_.size());
  opt_.data_dir = find_mnist_dir(opt_.data_dir);  // Note [Where the data is found]
  check_run_files(opt_);                          // before any file is written
  data_ = load_mnist(opt_.data_dir, opt_.validation_size, opt_.train_limit);
  plan_ = plan_run(opt_, JobFacts{.world = comm_.size(),
                                  .rank = comm_.rank(),
                                  .local_size = comm_.local_size(),
                                  .cuda = device_.choice.cuda,
                                  .train_count = data_.train.count,
                                  .hardware_threads = std::thread::hardware_concurrency()});
  spec_ = parse_model_spec(opt_.model, Shape{1, data_.train.rows, data_.train.cols}, 10);
  rig_ = std::make_unique<Rig>(
      opt_, comm_, plan_,
      RigInputs{
          .spec = &spec_, .data = &data_, .device = device_, .fault = fault_, .process_start = start_, .source = this});
  nonfinite_ = std::make_unique<NonfiniteSteps>(opt_.skip_nonfinite_steps, rank0_, rig_->verdict_hooks([this] {
    loss_window_.restart(*rig_->train_loss);  // the skipped step's loss is in the meter
  }));
  replica_hashes_.resize(static_cast<std::size_t>(comm_.size()));
  rig_->monitor->on_start(
      rig_->start_facts(device_, launch_, data_));  // which GPU (every rank), the banner, the "start" event
}

std::string Trainer::job_description() const {
  return "version = " MNIST_MPI_VERSION "\n" + agreed_options(opt_.resolved) + "model spec = " + spec_.text + " (" +
         std::to_string(spec_.param_count) + " parameters)\n" + "data = " + std::to_string(data_.train.count) +
         " train, " + std::to_string(data_.validation.count) + " validation, " + std::to_string(data_.test.count) +
         " test images of " + std::to_string(data_.train.rows) + "x" + std::to_string(data_.train.cols) + "\n" +
         "world size = " + std::to_string(comm_.size()) + "\n" +
         "optimizer sharded = " + (plan_.sharded ? "yes" : "no") + "\n";  // --shard-optimizer auto, resolved here
}

std::vector<float> Trainer::params_to_host() {
  const float* p = rig_->params->read();
  return std::vector<float>(p, p + spec_.param_count);
}

// What every run's end reports, stopped or finished after `steps` steps.
void Trainer::ended(std::int64_t steps, RunResult& res) {
  res.steps = steps;
  res.epochs = static_cast<double>(steps) / static_cast<double>(plan_.steps_per_epoch);
  res.checkpoints = rig_->boundary->stats();
  res.skipped_steps = nonfinite_->skipped();
  res.params_hash = hex64(hash_floats(rig_->params->read(), spec_.param_count));
}

void Trainer::check_replicas(std::int64_t step) {
  comm_.allgather(replica_digest(rig_->params->read(), spec_.param_count), replica_hashes_);  // sized at construction
  check_replica_digests(replica_hashes_, step, rank0_);
}

RunResult Trainer::run() {
  RunResult res;
  Rig& rig = *rig_;
  rig.connect();
  const std::int64_t first_step = rig.restore();  // a checkpoint's state, on every rank (none: 0)
  res.first_step = first_step;
  rig.share_parameters();
  check_replicas(first_step);
  rig.monitor->start(comm_);
  rank_times_.start(comm_, *rig.monitor);
  clock_ = RunClock::starting(first_step, plan_.total_steps);
  current_step_ = first_step;
  nonfinite_->restart(first_step);
  logged_loss_ = std::numeric_limits<double>::quiet_NaN();
  loss_window_.restart(*rig.train_loss);
  res.target.accuracy = opt_.target_accuracy;

  const int rank = comm_.rank();
  const std::int64_t total = plan_.total_steps, per_epoch = plan_.steps_per_epoch;
  std::int64_t end_step = total;  // earlier when --target-accuracy is reached
  for (std::int64_t step = first_step; step < total; ++step) {
    if (step == first_step + clock_.warmup) clock_.start_steady(*rig.backend);
    if (step == first_step) clock_.startup_s = seconds_since(start_);
    current_step_ = step;
    watch_set_step(step);  // for the collective watchdog's message (src/comm/watchdog.cpp)
    if (fault_.armed_for(rank, step)) fire_fault(fault_);  // nan and diverge: below, the trainer's
    const double lr = learning_rate(opt_.schedule, step, step / per_epoch, total);

    const StepResult r = rig.step->run(step, lr, fault_.poisons(rank, step));
    rig.average_model_state();  // batch norm's running statistics: every rank the same
    if (fault_.diverges(rank, step)) rig.flip_first_parameter();

    rig.monitor->on_step(step, r.timing, r.end);
    if (step - first_step >= clock_.warmup) clock_.sum += r.timing;
    loss_window_.add(plan_.rank_images);
    const bool log_now = opt_.log_every > 0 && ((step + 1) % opt_.log_every == 0 || step + 1 == total);
    const bool epoch_end = (step + 1) % per_epoch == 0;
    const bool eval_now = opt_.eval_every > 0 && (step + 1) % opt_.eval_every == 0 && step + 1 != total;
    // After the window count above, so that a restarted window drops this step's loss and count
    // alike; at once where the host synchronises anyway, else StepGuard::lag() steps later.
    nonfinite_->settle(log_now || epoch_end || eval_now ? step : step - rig.guard->lag(), step);
    if (log_now) log_training_loss(step, lr, res);
    if (opt_.check_replicas_every > 0 && (step + 1) % opt_.check_replicas_every == 0) {
      const auto tr = std::chrono::steady_clock::now();
      check_replicas(step + 1);
      clock_.exclude(tr);  // a check, not training: on a GPU it drains the stream and downloads
    }
    const EvalResult validation = evaluate_during_training(step, epoch_end, eval_now);
    const bool reached = (epoch_end || eval_now) && target_reached(step, validation, res.target);
    const StepBoundary::Decision next = checkpoint_or_stop(step, epoch_end, reached, lr, validation);
    if (next == StepBoundary::Decision::kStop) return stopped(step, res);
    if (next == StepBoundary::Decision::kDone) {
      end_step = step + 1;
      break;
    }
  }
  return finished(first_step, end_step, res);
}

// The end of a run that reached its last step (or its target accuracy): the verdicts still
// pending, the last window of every rank's step times, the steady rate, the last checkpoint, the
// replica check, then the final report.
RunResult Trainer::finished(std::int64_t first_step, std::int64_t end_step, RunResult& res) {
  nonfinite_->settle(end_step - 1, current_step_);
  const std::int64_t steady_steps = end_step - first_step - clock_.warmup;  // <= 0: stopped in the warm-up
  rank_times_.gather(comm_, *rig_->monitor, clock_.sum, end_step - 1,
                     std::max<std::int64_t>(steady_steps, 0));  // the last window (maybe empty)
  if (steady_steps > 0) clock_.end_steady(*rig_->backend);
  rig_->boundary->finish();
  check_replicas(end_step);
  res.wall_s = seconds_since(clock_.run);
  ended(end_step, res);
  if (steady_steps > 0) {
    res.images_per_s = clock_.images_per_s(steady_steps, plan_.global_batch);
    res.timing = clock_.sum.mean_over(steady_steps);
  }
  res.timing.reduced_bytes = rig_->reduced_bytes();
  final_report(res);
  return res;
}

void Trainer::log_training_loss(std::int64_t step, double lr, RunResult& res) {
  res.last_train_loss = loss_window_.log(comm_, *rig_->monitor, *rig_->train_loss, step, lr, clock_.window);
  logged_loss_ = res.last_train_loss;
  rank_times_.gather(comm_, *rig_->monitor, clock_.sum, step,
                     std::max<std::int64_t>(step + 1 - res.first_step - clock_.warmup, 0));
  clock_.window = std::chrono::steady_clock::now();
}

// Every rank, a share each (Note [Every rank evaluates a share] in src/train/evaluator.cpp): the
// validation split at an epoch's end, the test split every --eval-every steps (with
// --target-accuracy the validation split instead: Note [Stopping at a target accuracy]).
EvalResult Trainer::evaluate_during_training(std::int64_t step, bool epoch_end, bool eval_now) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  EvalResult validation{kNaN, kNaN, 0};
  if (!(epoch_end || eval_now)) return validation;
  const bool target = opt_.target_accuracy > 0;
  const std::int64_t epoch = step / plan_.steps_per_epoch;
  const auto te = std::chrono::steady_clock::now();
  auto report = [&](const char* name, SplitKind split) {
    const auto tb = std::chrono::steady_clock::now();
    const EvalResult e = evaluate(split);
    if (split == SplitKind::kValidation) validation = e;
    rig_->monitor->on_eval(step + 1, epoch, name, e.accuracy, e.loss, tb, std::chrono::steady_clock::now());
  };
  if ((epoch_end || (eval_now && target)) && data_.validation.count > 0) report("validation", SplitKind::kValidation);
  if (eval_now && !target) report("test", SplitKind::kTest);
  clock_.eval_s += seconds_since(te);
  clock_.exclude(te);  // evaluation is not training time
  return validation;
}

// Note [Stopping at a target accuracy]
// --target-accuracy A ends the run after the first check at which the validation accuracy is at
// least A. The checks fall every --eval-every steps and at each epoch's end: steps that do not
// depend on the rank. Every rank evaluates a share and learns the same accuracy, an exact count
// over the split (Note [Every rank evaluates a share]), so every rank makes the same decision at
// the same step with no further collective, and no rank leaves the loop alone. The run then ends
// as one that reached its last step (a checkpoint if there is a directory, the replica check, the
// test split once, the final event with the step, the validation accuracy and the time from the
// process start). That time starts at the first line of main on rank 0, as start-up does: the
// launcher's time before it is not in it (bench/time_to_accuracy.sh also takes the shell's clock).
bool Trainer::target_reached(std::int64_t step, const EvalResult& validation, TargetFacts& target) {
  if (opt_.target_accuracy <= 0 || !(validation.accuracy >= opt_.target_accuracy)) return false;  // NaN: not reached
  target.reached = true;
  target.step = step + 1;
  target.validation_accuracy = validation.accuracy;
  target.time_from_process_start_s = seconds_since(start_);
  return true;
}

// The step boundary (include/mnist_mpi/train/step_boundary.hpp): a checkpoint when due (last: the
// run's last step, also when it stops at its target accuracy); all ranks agree on a preemption
// signal, on write errors and on the target (Note [Agreeing at the step boundary]).
StepBoundary::Decision Trainer::checkpoint_or_stop(std::int64_t step, bool epoch_end, bool last, double lr,
                                                   const EvalResult& validation) {
  StepEnd end;
  end.step = step + 1;
  end.epoch_end = epoch_end;
  end.last = last || step + 1 == plan_.total_steps;
  end.lr = lr;
  end.next_lr = learning_rate(opt_.schedule, step + 1, (step + 1) / plan_.steps_per_epoch, plan_.total_steps);
  end.validation_accuracy = validation.accuracy;
  end.validation_loss = validation.loss;
  end.train_loss = logged_loss_;
  const auto tc = std::chrono::steady_clock::now();
  const std::int64_t written_before = rig_->checkpointer->stats().written;
  const StepBoundary::Decision next = rig_->boundary->after_step(end, last);
  const bool wrote = rig_->checkpointer->stats().written != written_before;  // rank 0 writes
  Timeline* timeline = rig_->monitor->timeline();
  if (timeline && wrote) timeline->record(SpanKind::kCheckpoint, tc, std::chrono::steady_clock::now(), step);
  // A checkpoint is not training time; the agreement on a signal at every other step is a
  // collective of the step, so the steady rate keeps it (the log line's rate leaves it out, as it
  // always did).
  if (wrote)
    clock_.exclude(tc);
  else
    clock_.pause_window(tc);
  return next;
}

// The run stopped on a signal after `step` (exit code 75); a checkpoint has been written if there is a directory.
RunResult Trainer::stopped(std::int64_t step, RunResult& res) {
  nonfinite_->settle(step, current_step_);
  res.preempted_signal = rig_->boundary->stop_signal();
  ended(step + 1, res);
  rig_->monitor->on_preempted(PreemptedFacts{.signal = signal_name(res.preempted_signal),
                                             .steps = res.steps,
                                             .checkpointing = rig_->checkpointer->enabled(),
                                             .checkpoint = res.checkpoints.last_file});  // rank 0's message
  return res;
}

// The run's end: peak memory of every rank, the test split (every rank, a share each), the report
// and the last metrics lines.
void Trainer::final_report(RunResult& res) {
  const StepTiming& timing = res.timing;
  const double startup_s = clock_.startup_s;
  double eval_s = clock_.eval_s;
  std::vector<std::uint64_t> rss = gather_peak_rss_kib(comm_);

  const auto te = std::chrono::steady_clock::now();
  res.test = evaluate(SplitKind::kTest);  // every rank, a share each
  rig_->monitor->on_eval(res.steps, res.steps / plan_.steps_per_epoch, "test", res.test.accuracy, res.test.loss, te,
                         std::chrono::steady_clock::now(), /*final_test=*/true);
  eval_s += seconds_since(te);
  FinalFacts facts{.steps = res.steps,
                   .epochs = res.epochs,
                   .startup_s = startup_s,
                   .images_per_s = res.images_per_s,
                   .test_accuracy = res.test.accuracy,
                   .test_loss = res.test.loss,
                   .params_hash = res.params_hash,
                   .model = spec_.text,
                   .wall_s = res.wall_s,
                   .eval_s = eval_s,
                   .peak_rss_kib = std::move(rss),
                   .per_step = timing,
                   .params = spec_.param_count,
                   .checkpoints = res.checkpoints,
                   .skipped_steps = res.skipped_steps,
                   .target = res.target,
                   .exact_chunk = plan_.exact_chunk,
                   .exact_sum_probes = rig_->mode->probes(),
                   .ranks = {},
                   .straggler = {}};
  rank_times_.final_facts(facts);
  rig_->monitor->on_final(facts);  // rank 0: the final report and the "final" event
  rig_->monitor->finish(comm_, facts);
  res.outputs_lost = rig_->monitor->outputs_lost();  // agreed by every rank (exit code 7)
}

}  // namespace mnist_mpi
