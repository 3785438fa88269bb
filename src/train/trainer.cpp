// One rank's training loop (see include/mnist_mpi/train/trainer.hpp). The gradient of every rank
// is the sum over its slice divided by the GLOBAL batch; the allreduce sums these, so every rank
// applies the gradient of the global mean loss (Note [Averaging is a scaled sum]).
#include "mnist_mpi/train/trainer.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/watchdog.hpp"
#include "mnist_mpi/train/consistency.hpp"
#include "mnist_mpi/train/finite.hpp"
#include "mnist_mpi/train/preemption.hpp"

namespace mnist_mpi {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

Trainer::Trainer(const Options& options, Communicator& comm, std::chrono::steady_clock::time_point start)
    : opt_(options), comm_(comm), start_(start), rank0_(comm.rank() == 0) {
  // The device first, so that `--device cuda` without a GPU fails at once (exit 6, every rank).
  const GpuProbe gpus = opt_.device == "cpu" ? GpuProbe{} : probe_gpus();
  device_ = choose_device(opt_.device, cuda_built(), gpus, comm_.local_rank(), comm_.local_size(),
                          opt_.allow_gpu_sharing, comm_.host());
  const std::int64_t world = comm_.size();
  launch_ = read_launch_env();
  launch_.check_world_size(static_cast<int>(world));
  fault_ = fault_from_env();
  MNIST_CHECK(fault_.kind == FaultKind::kNone || fault_.rank < world, ExitCode::kUsage,
              "MNIST_MPI_FAULT names rank " + std::to_string(fault_.rank) + " but the job has " +
                  std::to_string(world) + " rank(s)");
  accumulation_ = opt_.accumulation_steps;
  // Sizes from the options are products of user input: 64-bit and overflow-checked, and the
  // per-rank batch must fit the int that the kernels take.
  const auto too_big = [](const std::string& what) -> std::int64_t {
    throw_error(ExitCode::kUsage, what + " is too large to train (it overflows a 64-bit count)");
  };
  const std::int64_t parts = checked_mul(world, accumulation_).value_or(-1);  // micro-batches per global batch
  if (parts < 0) too_big("--accumulation-steps " + std::to_string(accumulation_));
  if (opt_.global_batch_size > 0) {
    MNIST_CHECK(opt_.global_batch_size % parts == 0, ExitCode::kUsage,
                "--global-batch-size " + std::to_string(opt_.global_batch_size) + " does not divide by the " +
                    std::to_string(world) + " ranks" +
                    (accumulation_ > 1 ? " x " + std::to_string(accumulation_) + " accumulation steps" : std::string()) +
                    "; choose a multiple of " + std::to_string(parts) + " or give --batch-size per rank");
    global_batch_ = opt_.global_batch_size;
    batch_ = global_batch_ / parts;
  } else {
    batch_ = opt_.batch_size;
    global_batch_ = checked_mul(batch_, parts).value_or(-1);
    if (global_batch_ < 0) too_big("--batch-size " + std::to_string(batch_) + " x " + std::to_string(parts) + " micro-batches");
  }
  MNIST_CHECK(batch_ <= std::numeric_limits<int>::max(), ExitCode::kUsage,
              "a batch of " + std::to_string(batch_) + " images per rank is more than this program can hold; give a "
              "smaller --batch-size or --global-batch-size");

  data_ = load_mnist(opt_.data_dir, opt_.validation_size, opt_.train_limit);
  const Shape input{1, data_.train.rows, data_.train.cols};
  spec_ = parse_model_spec(opt_.model, input, 10);
  const InitSpec wi = parse_init_spec(opt_.weight_init), bi = parse_init_spec(opt_.bias_init);
  if (!device_.cuda) {  // before anything is allocated (Note [Will the model fit?]); a GPU reports its own
    const std::int64_t largest = std::max({data_.validation.count, data_.test.count, std::int64_t{1}});
    check_model_fits_memory(spec_, batch_, std::min(opt_.eval_batch_size, largest), opt_.optimizer.kind == "adam",
                            rank0_);
  }

  sampler_ = std::make_unique<Sampler>(data_.train.count, global_batch_, opt_.seed);
  steps_per_epoch_ = sampler_->steps_per_epoch();
  total_steps_ = opt_.max_steps > 0 ? opt_.max_steps : checked_mul(opt_.epochs, steps_per_epoch_).value_or(-1);
  if (total_steps_ < 0) too_big("--epochs " + std::to_string(opt_.epochs));
  learning_rate(opt_.schedule, 0, 0, total_steps_);  // validates the schedule's name

  int threads = opt_.threads;
  if (threads == 0)
    threads = comm_.local_size() > 1 ? 1 : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (device_.cuda) {
    backend_ = make_cuda_backend(device_.gpu, opt_.precision == "tf32");
    shared_gpus_ = comm_.local_size() > gpus.count;  // allowed by --allow-gpu-sharing
    gpu_comm_ = shared_gpus_ ? make_staged_communicator(comm_, *backend_, spec_.param_count)
                             : make_nccl_communicator(comm_, *backend_);
    grad_comm_ = gpu_comm_.get();
  } else {
    backend_ = make_cpu_backend(threads);
    grad_comm_ = &comm_;
  }

  params_ = backend_->allocate(spec_.param_count);
  grads_ = backend_->allocate(spec_.param_count);
  if (backend_->on_device()) {
    host_params_.resize(static_cast<std::size_t>(spec_.param_count));
    init_params(spec_, wi, bi, opt_.seed, host_params_.data());
    backend_->upload(host_params_, params_->data());
  } else {
    init_params(spec_, wi, bi, opt_.seed, params_->data());
  }
  train_model_ = std::make_unique<Model>(spec_, static_cast<int>(batch_), *backend_, params_->data(), grads_->data());
  optimizer_ = std::make_unique<Optimizer>(opt_.optimizer, spec_.param_count, *backend_);
  const auto mb_to_elems = [](double mb) {
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(mb * 1048576.0 / sizeof(float)));
  };
  reducer_ = std::make_unique<Reducer>(
      *grad_comm_, std::span<float>(grads_->data(), static_cast<std::size_t>(spec_.param_count)),
      plan_buckets(spec_, mb_to_elems(opt_.bucket_mb), mb_to_elems(opt_.first_bucket_mb)), !opt_.no_overlap);
  if (accumulation_ > 1) accum_ = backend_->allocate(spec_.param_count);
  layer_params_.assign(spec_.layers.size(), {0, 0});
  for (const ParamTensor& p : spec_.params) {
    auto& [begin, size] = layer_params_[static_cast<std::size_t>(p.layer)];
    if (size == 0 || p.offset < begin) begin = p.offset;
    size += p.size;
  }
  // On the last micro-batch of a step, a layer's gradients become final when the earlier
  // micro-batches' sum is added to them; only then may their bucket start.
  on_layer_done_ = [this](int layer) {
    if (accumulating_) {
      const auto [begin, size] = layer_params_[static_cast<std::size_t>(layer)];
      if (size > 0) backend_->add(grads_->data() + begin, accum_->data() + begin, size);
    }
    if (timeline_) timeline_->layer_done(layer);
    reducer_->on_layer_done(layer);
    if (timeline_) timeline_->backward_resumes();
  };
  train_data_ = backend_->make_data_source(data_.train, static_cast<int>(batch_));
  train_loss_ = backend_->make_loss_meter();
  checkpointer_ = std::make_unique<Checkpointer>(
      opt_, comm_, CheckpointRun{&spec_, global_batch_, data_.train.count, steps_per_epoch_, total_steps_});
  // The state a checkpoint saves, in host memory: the buffers themselves on the CPU; on a GPU,
  // mirrors filled only when a checkpoint is written.
  ckpt_params_ = params_->data();
  ckpt_m_ = optimizer_->first_moment().data();
  ckpt_v_ = optimizer_->second_moment().empty() ? nullptr : optimizer_->second_moment().data();
  if (backend_->on_device()) {
    host_m_.resize(static_cast<std::size_t>(spec_.param_count));
    if (ckpt_v_) host_v_.resize(static_cast<std::size_t>(spec_.param_count));
    ckpt_params_ = host_params_.data();
    ckpt_m_ = host_m_.data();
    ckpt_v_ = ckpt_v_ ? host_v_.data() : nullptr;
    state_to_host_ = [this] {
      backend_->download(params_->data(), host_params_);
      backend_->download(optimizer_->first_moment().data(), host_m_);
      if (!host_v_.empty()) backend_->download(optimizer_->second_moment().data(), host_v_);
    };
  }
  replica_hashes_.resize(static_cast<std::size_t>(comm_.size()));
  if (rank0_) {
    const std::int64_t largest = std::max({data_.validation.count, data_.test.count, std::int64_t{1}});
    const int eb = static_cast<int>(std::min(opt_.eval_batch_size, largest));
    eval_model_ = std::make_unique<Model>(spec_, eb, *backend_, params_->data(), nullptr);
    if (data_.validation.count > 0) validation_data_ = backend_->make_data_source(data_.validation, eb);
    test_data_ = backend_->make_data_source(data_.test, eb);
    eval_loss_ = backend_->make_loss_meter();
  }
  MonitorSetup ms{comm_.rank(), comm_.size(), comm_.host(), {}, reducer_->buckets().size(), total_steps_,
                  steps_per_epoch_, global_batch_, accumulation_, start_};
  for (const LayerSpec& l : spec_.layers) ms.layer_names.push_back(l.text);
  monitor_ = std::make_unique<Monitor>(opt_, std::move(ms));  // opens the metrics file (rank 0)
  timeline_ = monitor_->timeline();
  const StartFacts facts{.device_note = device_.note,
                         .backend = backend_->name(),
                         .threads = threads,
                         .cuda = device_.cuda,
                         .shared_gpus = shared_gpus_,
                         .gpu = device_.gpu,
                         .gpus = gpus.count,
                         .gpu_description = device_.cuda ? describe_gpu(device_.gpu) : std::string(),
                         .launch = launch_,
                         .train_images = data_.train.count,
                         .validation_images = data_.validation.count,
                         .test_images = data_.test.count,
                         .model = spec_.text,
                         .params = spec_.param_count,
                         .layers = train_model_->describe(),
                         .per_rank_batch = batch_,
                         .gradient_progress = grad_comm_->progress_mode()};
  monitor_->on_start(facts);  // which GPU (every rank), the banner and the "start" event (rank 0)
}

std::string Trainer::job_description() const {
  return "version = " MNIST_MPI_VERSION "\n" + agreed_options(opt_.resolved) + "model spec = " + spec_.text + " (" +
         std::to_string(spec_.param_count) + " parameters)\n" + "data = " + std::to_string(data_.train.count) +
         " train, " + std::to_string(data_.validation.count) + " validation, " + std::to_string(data_.test.count) +
         " test images of " + std::to_string(data_.train.rows) + "x" + std::to_string(data_.train.cols) + "\n" +
         "world size = " + std::to_string(comm_.size()) + "\n";
}

void Trainer::load_batch(const Slice& slice) {
  if (slice.epoch != order_epoch_) {  // once per epoch (a GPU copies the permutation then)
    train_data_->set_order(sampler_->order(slice.epoch));
    order_epoch_ = slice.epoch;
  }
  train_data_->gather(slice.position, slice.count, train_model_->input());
}

const float* Trainer::host_params() {
  if (!backend_->on_device()) return params_->data();
  backend_->download(params_->data(), host_params_);
  return host_params_.data();
}

std::vector<float> Trainer::params_to_host() {
  const float* p = host_params();
  return std::vector<float>(p, p + spec_.param_count);
}

EvalResult Trainer::evaluate(const Split& split) {
  MNIST_CHECK(eval_model_ != nullptr, ExitCode::kRuntime, "evaluate() called on a rank without an evaluation model");
  EvalResult r;
  const int eb = eval_model_->batch();
  // The split's data where the backend computes: made at build for validation and test.
  DataSource* source = &split == &data_.validation ? validation_data_.get()
                       : &split == &data_.test     ? test_data_.get()
                                                   : nullptr;
  std::unique_ptr<DataSource> other;
  if (!source) {
    other = backend_->make_data_source(split, eb);
    source = other.get();
  }
  StepContext ctx;
  ctx.training = false;
  eval_loss_->reset();
  for (std::int64_t first = 0; first < split.count; first += eb) {
    const std::int64_t n = std::min<std::int64_t>(eb, split.count - first);
    source->slice(first, n, eval_model_->input());
    // A short last batch: the rows past n are stale and their outputs are ignored.
    eval_model_->forward(ctx);
    backend_->softmax_cross_entropy(eval_model_->logits(), source->labels(), static_cast<int>(n),
                                    spec_.num_classes(), nullptr, 0.0f, *eval_loss_);
  }
  const LossStats s = eval_loss_->read();  // the one synchronisation of an evaluation
  const double loss = s.loss_sum;
  const std::int64_t correct = s.correct;
  r.count = split.count;
  if (split.count > 0) {
    r.loss = loss / static_cast<double>(split.count);
    r.accuracy = static_cast<double>(correct) / static_cast<double>(split.count);
  }
  return r;
}

void Trainer::check_replicas(std::int64_t step) {
  std::vector<std::uint64_t>& hashes = replica_hashes_;  // sized at construction
  comm_.allgather(hash_floats(host_params(), spec_.param_count), hashes);
  for (std::size_t r = 1; r < hashes.size(); ++r)
    MNIST_CHECK(hashes[r] == hashes[0], ExitCode::kRuntime,
                "replicas diverged after step " + std::to_string(step) + ": rank " + std::to_string(r) +
                    " holds parameters " + hex64(hashes[r]) + ", rank 0 holds " + hex64(hashes[0]) +
                    " (every rank must hold identical parameters; this is a bug, please report it)");
}

// Note [Averaging is a scaled sum]
// Each rank's loss gradient is scaled by 1 / GLOBAL batch (not by 1 / its own slice), so its
// backward produces (sum of its slice's per-sample gradients) / B. The allreduce then SUMS these
// over the ranks: the result is exactly the gradient of the mean loss over the whole global batch,
// for every parameter, since the allreduce covers the whole flat gradient buffer [0, param_count).
// No division after the reduction, nothing to forget for "the other variables".
RunResult Trainer::run() {
  RunResult res;
  grad_comm_->connect();  // NCCL: the collective part of its set-up
  // A checkpoint's parameters and optimiser state, on every rank (none: first_step 0).
  const std::int64_t first_step = checkpointer_->restore(backend_->on_device() ? host_params_.data() : params_->data(),
                                                         *optimizer_);
  if (first_step > 0 && backend_->on_device()) backend_->upload(host_params_, params_->data());
  res.first_step = first_step;
  // Rank 0's initial parameters are everyone's: no rank trains weights of its own.
  grad_comm_->broadcast(std::span<float>(params_->data(), static_cast<std::size_t>(spec_.param_count)), 0);
  check_replicas(first_step);
  monitor_->start(comm_);

  const auto t_run = std::chrono::steady_clock::now();
  double startup_s = 0.0, steady_s = 0.0, eval_s = 0.0;
  std::int64_t steady_steps = 0;
  constexpr std::int64_t kWarmup = 10;
  const float grad_scale = 1.0f / static_cast<float>(global_batch_);
  StepTiming timing;
  train_loss_->reset();
  // Note [Timing a GPU]
  // On a GPU the host only queues work, so a step's host time says little; the steady rate is
  // then the wall time from a synchronisation after the warm-up steps to one after the last step
  // (evaluation excluded), and the per-step parts are host (queueing) times.
  const bool device = backend_->on_device();
  auto t_steady = std::chrono::steady_clock::now();
  double eval_at_steady = 0.0;
  auto window_t = std::chrono::steady_clock::now();
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  double logged_loss = kNaN;

  // A non-finite step: every rank is here at the same step with the same verdict (Note [One
  // verdict on every rank]); one more collective finds the first rank whose own loss was not
  // finite. Without --skip-nonfinite-steps the run stops; with it the step is counted.
  const auto nonfinite_step = [&](std::int64_t bad_step, bool own_loss_bad, std::int64_t now) {
    std::int64_t bad_rank = own_loss_bad ? comm_.rank() : std::numeric_limits<std::int64_t>::max();
    comm_.allreduce_min(std::span<std::int64_t>(&bad_rank, 1));
    const std::string where =
        bad_rank == std::numeric_limits<std::int64_t>::max()
            ? "every rank's loss was finite: the gradient overflowed"
            : "the loss was not finite on rank " + std::to_string(bad_rank);
    const std::string seen = now == bad_step ? std::string()
                             : "; the GPU guard kept it and the " + std::to_string(now - bad_step) +
                                   " step(s) after it from the parameters";
    if (!opt_.skip_nonfinite_steps)
      throw AgreedError(ExitCode::kNumerical, !rank0_ ? std::string() :  // main prints the one message
                        "non-finite gradient in step " + std::to_string(bad_step + 1) + " (" + where + seen +
                            "); training diverged or the data holds NaN: lower --lr, add --warmup-steps, or pass "
                            "--skip-nonfinite-steps to skip such steps (no non-finite value reached the parameters)");
    ++res.skipped_steps;
    monitor_->on_skipped_step(bad_step, where);
  };
  // Note [Non-finite steps on a device] (include/mnist_mpi/backend/backend.hpp): on a GPU the
  // verdict of step s is read after step s + kVerdictLag, when its copy has finished long ago, or
  // at once where the trainer synchronises anyway (settle(step) before a log line, an evaluation,
  // a checkpoint and the end). Every place that settles does so on every rank at the same step.
  constexpr std::int64_t kVerdictLag = 2;
  static_assert(kVerdictLag < Backend::kVerdictSlots);
  std::int64_t verdict_next = first_step;  // the first step whose verdict has not been read
  std::int64_t window_n = 0;
  std::int64_t current_step = first_step;
  const auto settle = [&](std::int64_t up_to) {
    while (verdict_next <= up_to) {
      const std::int64_t s = verdict_next++;
      const int v = backend_->guard_verdict(s);
      if (!(v & Backend::kNonfiniteGradient)) continue;
      nonfinite_step(s, (v & Backend::kNonfiniteLoss) != 0, current_step);
      train_loss_->reset();  // the skipped step's loss is in the meter: the window starts again
      window_n = 0;
    }
  };
  const std::function<void()> settle_now = [&] { settle(current_step); };

  for (std::int64_t step = first_step; step < total_steps_; ++step) {
    if (device && step == first_step + kWarmup) {
      backend_->synchronize();
      t_steady = std::chrono::steady_clock::now();
      eval_at_steady = eval_s;
    }
    const auto t0 = std::chrono::steady_clock::now();
    current_step = step;
    if (device) backend_->guard_begin_step(!opt_.skip_nonfinite_steps);
    if (step == first_step) startup_s = seconds_since(start_);
    watch_set_step(step);  // for the collective watchdog's message (src/comm/watchdog.cpp)
    if (fault_.armed_for(comm_.rank(), step) && fault_.kind != FaultKind::kNan) fire_fault(fault_);
    const std::int64_t epoch = step / steps_per_epoch_;
    const double lr = learning_rate(opt_.schedule, step, epoch, total_steps_);
    using sec = std::chrono::duration<double>;
    double t_data = 0, t_fwd = 0, t_bwd = 0;
    std::chrono::steady_clock::time_point backward_end;
    bool loss_finite = true;  // this rank's loss in this step (CPU ranks; Note [One verdict on every rank])
    for (std::int64_t micro = 0; micro < accumulation_; ++micro) {
      const bool last = micro + 1 == accumulation_;
      // Note [Micro-batches and positions] (include/mnist_mpi/data/sampler.hpp)
      const Slice slice = sampler_->slice(step, comm_.rank() * accumulation_ + micro, comm_.size() * accumulation_);
      const auto m0 = std::chrono::steady_clock::now();
      load_batch(slice);
      const auto m1 = std::chrono::steady_clock::now();
      StepContext ctx{true, opt_.seed, step, slice.first};
      train_model_->forward(ctx);
      backend_->softmax_cross_entropy(train_model_->logits(), train_data_->labels(), static_cast<int>(batch_),
                                      spec_.num_classes(), train_model_->dlogits(), grad_scale, *train_loss_);
      const bool poison = last && fault_.kind == FaultKind::kNan && fault_.armed_for(comm_.rank(), step);
      if (device) {  // the loss kernel checks itself (Note [Non-finite steps on a device])
        if (poison) backend_->guard_poison(train_model_->dlogits());
      } else {
        if (poison) loss_finite = false;
        if (!std::isfinite(train_loss_->read().loss_sum)) loss_finite = false;  // CPU: a plain read
        // Note [One verdict on every rank]
        // A non-finite step must be stopped (or skipped) on every rank alike, without a collective
        // of its own. The reduced gradient is bitwise the same on every rank (Note [Sums in rank
        // order]) and a NaN or inf in any rank's contribution makes the sum non-finite; so each rank
        // checks the reduced gradient and all reach the same verdict. A rank whose own loss is not
        // finite (or that the testing hook marks) makes sure its gradient shows it: a NaN in dlogits
        // reaches the last layer's bias gradient (the sum over the batch of dlogits) before backward
        // hands any bucket to the reducer.
        if (!loss_finite) train_model_->dlogits()[0] = std::numeric_limits<float>::quiet_NaN();
      }
      const auto m2 = std::chrono::steady_clock::now();
      if (timeline_) timeline_->backward_starts(m2, step);
      if (last) {
        accumulating_ = accumulation_ > 1;
        train_model_->backward(ctx, on_layer_done_);
        accumulating_ = false;
      } else {  // like DDP's no_sync: no reduction, the gradients are summed locally
        train_model_->backward(ctx);
        if (micro == 0) backend_->copy(accum_->data(), grads_->data(), spec_.param_count);
        else backend_->add(accum_->data(), grads_->data(), spec_.param_count);
      }
      const auto m3 = std::chrono::steady_clock::now();
      if (timeline_) {
        timeline_->record(SpanKind::kData, m0, m1, step, static_cast<std::int32_t>(micro));
        timeline_->record(SpanKind::kForward, m1, m2, step, static_cast<std::int32_t>(micro));
        if (!last) timeline_->record(SpanKind::kBackward, m2, m3, step);
      }
      backward_end = m3;
      t_data += sec(m1 - m0).count();
      t_fwd += sec(m2 - m1).count();
      t_bwd += sec(m3 - m2).count();
    }
    // The optimiser waits only for what it needs: bucket k's parameters are updated as soon as its
    // sum is in, while the later buckets are still being summed (the update is elementwise, so the
    // bits are those of one pass over the whole buffer). Each bucket is checked for NaN and inf
    // before it is applied (Note [One verdict on every rank]). With --skip-nonfinite-steps every
    // bucket is waited for and checked before the first is applied, so that a skipped step
    // changes nothing; without it a non-finite bucket stops the run before it is applied.
    double exposed = reducer_->start_remaining(), t_opt = 0.0;
    const std::size_t n_buckets = reducer_->buckets().size();
    const auto bucket_finite = [&](std::size_t k) {  // on a GPU the verdict stays on the device
      const Bucket& b = reducer_->buckets()[k];
      if (!device) return all_finite(grads_->data() + b.begin, b.end - b.begin);
      backend_->guard_check(grads_->data() + b.begin, b.end - b.begin);
      return true;
    };
    bool finite = true;
    std::size_t waited = 0;  // buckets whose sums are in
    if (opt_.skip_nonfinite_steps)
      for (; waited < n_buckets; ++waited) {
        exposed += reducer_->wait_bucket(waited);
        finite = finite && bucket_finite(waited);
      }
    if (finite) {
      optimizer_->begin_step();
      auto waited_from = backward_end;  // for the timeline: when the wait for bucket k began
      for (std::size_t k = 0; k < n_buckets; ++k) {
        if (k >= waited) {
          exposed += reducer_->wait_bucket(k);
          waited = k + 1;
          if (!bucket_finite(k)) {
            finite = false;
            break;
          }
        }
        const Bucket& b = reducer_->buckets()[k];
        const auto o0 = std::chrono::steady_clock::now();
        optimizer_->update(params_->data(), grads_->data(), lr, b.begin, b.end);
        const auto o1 = std::chrono::steady_clock::now();
        t_opt += sec(o1 - o0).count();
        if (timeline_) timeline_->bucket_updated(step, k, waited_from, o0, o1);
        waited_from = o1;
      }
    }
    if (!finite) {  // only on the CPU
      for (; waited < n_buckets; ++waited) exposed += reducer_->wait_bucket(waited);  // no sum left in flight
      nonfinite_step(step, !loss_finite, step);
    }
    if (device) backend_->guard_end_step(step);
    const auto t5 = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(t5 - t0).count();
    if (timeline_) timeline_->step_done(step, t0, t5, reducer_->bucket_timings());
    monitor_->on_step(step, StepTiming{t_data, t_fwd, t_bwd, exposed, t_opt}, t5);
    if (step - first_step >= kWarmup || total_steps_ - first_step <= kWarmup) {
      steady_s += dt;
      ++steady_steps;
      timing.data += t_data;
      timing.forward += t_fwd;
      timing.backward += t_bwd;
      timing.exposed_comm += exposed;
      timing.optimizer += t_opt;
    }
    if (finite) {
      window_n += batch_ * accumulation_;
    } else {  // a skipped step's loss would make the window's mean NaN: the window starts again
      train_loss_->reset();
      window_n = 0;
    }

    const bool log_now = opt_.log_every > 0 && ((step + 1) % opt_.log_every == 0 || step + 1 == total_steps_);
    const bool epoch_end = (step + 1) % steps_per_epoch_ == 0;
    const bool eval_now = opt_.eval_every > 0 && (step + 1) % opt_.eval_every == 0 && step + 1 != total_steps_;
    // After the window count above, so that a restarted window drops this step's loss and count alike.
    if (device) settle(log_now || epoch_end || eval_now ? step : step - kVerdictLag);  // the former sync anyway
    if (log_now) {
      double v[2] = {train_loss_->read().loss_sum, static_cast<double>(window_n)};  // a GPU syncs here
      train_loss_->reset();
      comm_.allreduce_sum(std::span<double>(v, 2));
      res.last_train_loss = v[1] > 0 ? v[0] / v[1] : std::numeric_limits<double>::quiet_NaN();
      logged_loss = res.last_train_loss;
      if (rank0_) {
        const double ips = v[1] / seconds_since(window_t);
        monitor_->on_log(step, res.last_train_loss, lr, ips);
      }
      window_n = 0;
      window_t = std::chrono::steady_clock::now();
    }
    if (opt_.check_replicas_every > 0 && (step + 1) % opt_.check_replicas_every == 0) check_replicas(step + 1);

    EvalResult validation{kNaN, kNaN, 0};
    if (rank0_ && (epoch_end || eval_now)) {
      const auto te = std::chrono::steady_clock::now();
      auto report = [&](const char* name, const Split& split) {
        const auto tb = std::chrono::steady_clock::now();
        const EvalResult e = evaluate(split);
        if (&split == &data_.validation) validation = e;
        monitor_->on_eval(step + 1, epoch, name, e.accuracy, e.loss, tb, std::chrono::steady_clock::now());
      };
      if (epoch_end && data_.validation.count > 0) report("validation", data_.validation);
      if (eval_now) report("test", data_.test);
      eval_s += seconds_since(te);
      window_t += std::chrono::steady_clock::now() - te;  // evaluation is not training time
    }
    // Checkpoint when due; all ranks agree on a preemption signal (Note [Agreeing at the step boundary]).
    const StepEnd end{step + 1, epoch_end, step + 1 == total_steps_, lr,
                      learning_rate(opt_.schedule, step + 1, (step + 1) / steps_per_epoch_, total_steps_),
                      validation.accuracy, validation.loss, logged_loss, ckpt_params_, optimizer_.get(),
                      ckpt_m_, ckpt_v_, &state_to_host_, device ? &settle_now : nullptr};
    const auto tc = std::chrono::steady_clock::now();
    const std::int64_t written_before = checkpointer_->stats().written;
    const bool stop = checkpointer_->after_step(end);
    const auto tc1 = std::chrono::steady_clock::now();
    if (timeline_ && checkpointer_->stats().written != written_before)  // rank 0's copy of the state
      timeline_->record(SpanKind::kCheckpoint, tc, tc1, step);
    window_t += tc1 - tc;  // checkpoints are not training time
    if (stop) {
      if (device) settle(step);
      res.preempted_signal = checkpointer_->stop_signal();
      res.steps = step + 1;
      res.epochs = static_cast<double>(step + 1) / static_cast<double>(steps_per_epoch_);
      res.checkpoints = checkpointer_->stats();
      res.params_hash = hex64(hash_floats(host_params(), spec_.param_count));
      monitor_->on_preempted(PreemptedFacts{.signal = signal_name(res.preempted_signal),
                                            .steps = res.steps,
                                            .checkpointing = checkpointer_->enabled(),
                                            .checkpoint = res.checkpoints.last_file});  // rank 0's message
      return res;
    }
  }
  if (device) settle(total_steps_ - 1);
  checkpointer_->finish();
  res.checkpoints = checkpointer_->stats();
  if (device) {
    backend_->synchronize();
    if (total_steps_ - first_step > kWarmup) {
      steady_s = seconds_since(t_steady) - (eval_s - eval_at_steady);
      steady_steps = total_steps_ - first_step - kWarmup;
    }
  }
  check_replicas(total_steps_);

  res.steps = total_steps_;
  res.epochs = static_cast<double>(total_steps_) / static_cast<double>(steps_per_epoch_);
  res.wall_s = seconds_since(t_run);
  res.images_per_s = steady_s > 0 ? static_cast<double>(steady_steps * global_batch_) / steady_s : 0.0;
  res.params_hash = hex64(hash_floats(host_params(), spec_.param_count));
  if (steady_steps > 0) {
    const double n = static_cast<double>(steady_steps);
    timing.data /= n;
    timing.forward /= n;
    timing.backward /= n;
    timing.exposed_comm /= n;
    timing.optimizer /= n;
  }
  timing.reduced_bytes = static_cast<double>(spec_.param_count) * sizeof(float);
  res.timing = timing;

  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::vector<std::uint64_t> rss(static_cast<std::size_t>(comm_.size()));
  comm_.allgather(static_cast<std::uint64_t>(ru.ru_maxrss), rss);  // KiB

  if (rank0_) {
    const auto te = std::chrono::steady_clock::now();
    res.test = evaluate(data_.test);
    monitor_->on_eval(res.steps, total_steps_ / steps_per_epoch_, "test", res.test.accuracy, res.test.loss, te,
                      std::chrono::steady_clock::now(), /*final_test=*/true);
    eval_s += seconds_since(te);
  }
  const FinalFacts facts{.steps = res.steps,
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
                         .skipped_steps = res.skipped_steps};
  monitor_->on_final(facts);  // rank 0: the final report and the "final" event
  monitor_->finish(comm_, facts);
  res.outputs_lost = monitor_->outputs_lost();  // agreed by every rank (exit code 7)
  return res;
}

}  // namespace mnist_mpi
