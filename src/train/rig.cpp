// Building the run's parts (include/mnist_mpi/train/rig.hpp), after the two questions asked
// before them (the run's files, the device), and the few things done to the parts as a whole: the
// collective set-up, restoring a checkpoint, the state a checkpoint saves, the model state's mean
// over the ranks, the banner's facts.
#include "mnist_mpi/train/rig.hpp"

#include <algorithm>
#include <limits>
#include <span>
#include <utility>

namespace mnist_mpi {

namespace {

// The options the monitor is told of (Monitor reads no Options).
MonitorOptions monitor_options(const Options& o) {
  return {.metrics_file = o.metrics_file,
          .timeline_file = o.timeline_file,
          .report_file = o.report_file,
          .tensorboard_dir = o.tensorboard_dir,
          .progress = o.progress,
          .quiet = o.quiet,
          .log_every = o.log_every,
          .eval_every = o.eval_every,
          .config_file = o.config_file,
          .model = o.model,
          .precision = o.precision,
          .data_dir = o.data_dir,
          .exact_sums = o.exact_sums,
          .optimizer = o.optimizer.kind,
          .base_lr = o.schedule.base_lr,
          .seed = o.seed,
          .bucket_mb = o.bucket_mb,
          .first_bucket_mb = o.first_bucket_mb,
          .no_overlap = o.no_overlap,
          .cuda_graph = o.cuda_graph,
          .checkpoint_async = o.checkpoint_async,
          .skip_nonfinite_steps = o.skip_nonfinite_steps};
}

}  // namespace

// Note [No output is an input] (include/mnist_mpi/io/file_roles.hpp): every file of the run, each
// declared by the part that reads or writes it, compared on every rank before anything is written.
void check_run_files(const Options& opt) {
  FileRoles roles;
  declare_mnist_inputs(opt.data_dir, roles);
  if (!opt.config_file.empty()) roles.input("--config", opt.config_file);
  Checkpointer::declare_files(opt, roles);
  Monitor::declare_files(monitor_options(opt), roles);
  roles.check();
}

RunDevice choose_run_device(const Options& opt, Communicator& comm) {
  RunDevice d;
  // The device first, so that `--device cuda` without a GPU fails at once (exit 6, every rank).
  const GpuProbe gpus = opt.device == "cpu" ? GpuProbe{} : probe_gpus();
  d.gpus = gpus.count;
  d.choice = choose_device(opt.device, cuda_built(), gpus, comm.local_rank(), comm.local_size(), opt.allow_gpu_sharing,
                           comm.host());
  // Ranks that share a GPU (allowed by --allow-gpu-sharing) sum through host memory, unless each is
  // an NCCL host of its own (Note [Ranks that are NCCL hosts of their own]). Asked on every rank
  // of a CUDA run, so that the collective is called alike everywhere.
  d.nccl_hosts = d.choice.cuda && ranks_are_nccl_hosts(comm) && comm.local_size() > gpus.count;
  d.shared_gpus = d.choice.cuda && comm.local_size() > gpus.count && !d.nccl_hosts;
  return d;
}

// In this order: the backend and its gradient communicator, the training state, the evaluation,
// then the monitor and the step.
Rig::Rig(const Options& options, Communicator& c, const RunPlan& p, const RigInputs& in)
    : opt(options), comm(c), plan(p), spec(*in.spec) {
  set_up_backend(in);
  make_training_state(in);
  evaluator = std::make_unique<Evaluator>(opt, *in.data, spec, *backend, *params, comm);
  make_step(in);
}

// The backend of the chosen device, and the communicator that sums its gradients.
void Rig::set_up_backend(const RigInputs& in) {
  backend = make_backend(in.device.choice, plan.threads, opt.precision);
  backend->set_wait_timeout(opt.collective_timeout);  // Note [Device waits have a deadline]
  gpu_comm = backend->make_gradient_communicator(comm, spec.param_count, in.device.shared_gpus, opt.exact_sums);
  grad_comm = gpu_comm ? gpu_comm.get() : &comm;
}

// Parameters, gradients, the training model, optimiser, reducer, the training split where the
// backend computes, the step guard and the checkpointer.
void Rig::make_training_state(const RigInputs& in) {
  const Mnist& data = *in.data;
  const InitSpec wi = parse_init_spec(opt.weight_init), bi = parse_init_spec(opt.bias_init);
  {  // before anything is allocated (Note [Will the model fit?])
    const std::int64_t largest = std::max({data.validation.count, data.test.count, std::int64_t{1}});
    backend->check_model_fits(spec, plan.batch, std::min(opt.eval_batch_size, largest), opt.optimizer.kind,
                              /*evaluates=*/true);  // every rank (Note [Every rank evaluates a share])
  }
  params = std::make_unique<ParameterStore>(*backend, spec.param_count, spec.state_count);
  grads = backend->allocate(spec.param_count);
  init_params(spec, wi, bi, opt.seed, params->host());
  params->to_backend();
  init_state(spec, params->state_host());
  params->state_to_backend();
  train_model = std::make_unique<Model>(spec, static_cast<int>(plan.batch), *backend, *params, grads->data());
  // Note [Choosing cuDNN algorithms] (src/backend/cuda/conv.cpp): rank 0 times its convolutions
  // here, local work, and takes its choice at once (its banner shows it); the others take it in
  // connect().
  if (opt.conv_algos == "measured" && comm.rank() == 0) {
    conv_timing = backend->time_convolutions(spec, static_cast<int>(plan.batch));
    backend->use_measured_convolutions(spec, conv_timing.table);
  }
  const auto mb_to_elems = [](double mb) {
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(mb * 1048576.0 / sizeof(float)));
  };
  const auto flat = [&](Buffer& b) { return std::span<float>(b.data(), static_cast<std::size_t>(spec.param_count)); };
  mode = make_gradient_mode(opt, plan, spec, *backend, [this](const CodecChoiceReport& r) {
    if (monitor)
      monitor->on_codec_choice({r.step, r.text, r.link.bytes_per_s * 8 / 1e9, r.link.latency_s * 1e6,
                                r.backward_s * 1e3, r.buckets});
  });
  reducer = std::make_unique<Reducer>(*grad_comm, flat(*grads),
                                      plan_buckets(spec, mb_to_elems(opt.bucket_mb), mb_to_elems(opt.first_bucket_mb)),
                                      !opt.no_overlap,
                                      plan.sharded ? std::span<float>(params->data_for_reporting_writers(),
                                                                      static_cast<std::size_t>(spec.param_count))
                                                   : std::span<float>(),
                                      mode->codec(), backend.get());
  // Note [Sharded optimiser state] (include/mnist_mpi/train/optimizer.hpp)
  if (plan.sharded) {
    std::vector<std::vector<ParamRange>> every_rank;
    for (int r = 0; r < comm.size(); ++r) every_rank.push_back(reducer->owned(r));
    optimizer = std::make_unique<Optimizer>(opt.optimizer, spec.param_count, *backend, std::move(every_rank),
                                            comm.rank(), params.get());
  } else {
    optimizer = std::make_unique<Optimizer>(opt.optimizer, spec.param_count, *backend, params.get());
  }
  std::vector<OptimizerTensor> tensors;  // Note [LAMB in two phases]: weights take a trust ratio, biases not
  for (const ParamTensor& t : spec.params) tensors.push_back({t.offset, t.offset + t.size, !t.is_bias});
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  optimizer->set_tensors(std::move(tensors));
  sampler = std::make_unique<Sampler>(data.train.count, plan.global_batch, opt.seed);
  train_data = backend->make_data_source(data.train, static_cast<int>(plan.batch));
  train_loss = backend->make_loss_meter();
  guard = backend->make_step_guard(!opt.skip_nonfinite_steps);
  checkpointer =
      std::make_unique<Checkpointer>(opt, comm,
                                     CheckpointRun{&spec, plan.global_batch, data.train.count, plan.steps_per_epoch,
                                                   plan.total_steps, plan.exact_chunk, reducer->codec_state_size(),
                                                   reducer->codec_shared_state_size()});
  boundary = std::make_unique<StepBoundary>(opt, comm, *checkpointer, *in.source);
}

// The monitor (it opens the metrics file on rank 0) and the step.
void Rig::make_step(const RigInputs& in) {
  // Designated initialisers: two fields of one type in another order do not compile.
  MonitorSetup ms{.rank = comm.rank(),
                  .world = comm.size(),
                  .host = comm.host(),
                  .layer_names = {},
                  .buckets = reducer->buckets().size(),
                  .total_steps = plan.total_steps,
                  .steps_per_epoch = plan.steps_per_epoch,
                  .global_batch = plan.global_batch,
                  .accumulation = plan.accumulation,
                  .process_start = in.process_start,
                  .exact_chunk = plan.exact_chunk};
  for (const LayerSpec& l : spec.layers) ms.layer_names.push_back(l.text);
  monitor = std::make_unique<Monitor>(monitor_options(opt), std::move(ms));
  const StepParts parts{.backend = backend.get(),
                        .model = train_model.get(),
                        .params = params.get(),
                        .grads = grads.get(),
                        .reducer = reducer.get(),
                        .optimizer = optimizer.get(),
                        .guard = guard.get(),
                        .sampler = sampler.get(),
                        .data = train_data.get(),
                        .loss = train_loss.get(),
                        .timeline = monitor->timeline()};
  const StepShape shape{.rank = comm.rank(),
                        .world = comm.size(),
                        .accumulation = plan.accumulation,
                        .batch = plan.batch,
                        .global_batch = plan.global_batch,
                        .seed = opt.seed,
                        .check_all_first = opt.skip_nonfinite_steps,
                        .graph = opt.cuda_graph,
                        .slow_ms = in.fault.slow_ms_for(comm.rank()),
                        .local_dropout_key = in.fault.local_dropout_key_for(comm.rank())};
  step = std::make_unique<Step>(
      parts, shape,
      mode->pipeline(parts, shape));
}

// --conv-algos measured (Note [Choosing cuDNN algorithms] in src/backend/cuda/conv.cpp): rank 0's
// table, three algorithms per convolution of the agreed model spec, broadcast to every rank (the
// same collective on every backend; a CPU rank 0 sends -1s, which change nothing), and the
// other ranks rebuild their training convolutions with it. A rank whose GPU cannot run rank 0's
// choice stops, naming the layer and the algorithm.
void Rig::connect() {
  grad_comm->connect();  // NCCL: the collective part of its set-up
  if (opt.conv_algos != "measured") return;
  const auto convs = std::count_if(spec.layers.begin(), spec.layers.end(),
                                   [](const LayerSpec& l) { return l.kind == LayerKind::kConv; });
  if (convs == 0) return;
  const bool rank0 = comm.rank() == 0;
  std::vector<std::int32_t> table(static_cast<std::size_t>(3 * convs), -1);
  if (rank0 && conv_timing.table.size() == table.size()) table = conv_timing.table;
  comm.broadcast(
      std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(table.data()), table.size() * sizeof(std::int32_t)), 0);
  if (!rank0) backend->use_measured_convolutions(spec, table);
}

std::int64_t Rig::restore() {
  const std::int64_t first_step = checkpointer->restore(params->host(), [&](const RestoredState& r) {
    optimizer->restore(r.first_moment, r.second_moment, r.steps);
    mode->restore_limits(r.exact_limits);  // checked against the mode when it was chosen
    reducer->restore_codec_state(r.codec_ranks, r.codec_shared, r.codec_state);
    if (spec.state_count > 0) {                    // the sizes were checked against the spec (Checkpointer::restore)
      std::copy(r.model_state.begin(), r.model_state.end(), params->state_host());
      params->state_to_backend();
    }
  });
  if (first_step > 0) params->to_backend();
  return first_step;
}

// Through a lease (Note [Writes that report themselves]): the models' copies follow.
void Rig::share_parameters() {
  const ParameterStore::Lease all = params->write_all();
  grad_comm->broadcast(all.span(), 0);
}

// Rank 0, at a checkpoint: the parameters and the optimiser's full moments in host memory.
TrainingState Rig::state() {
  const float* p = params->read();
  const Optimizer::Moments m = optimizer->checkpoint_moments();
  return {p,
          m.first,
          m.second,
          optimizer->steps_taken(),
          &optimizer->config(),
          mode->limits(),
          params->read_state(),
          reducer->gathered_codec_state()};
}

// Note [State that is not trained] (include/mnist_mpi/model/spec.hpp): each rank's running
// statistics move with its own batches; after every step they are replaced by their mean over the
// ranks (summed in rank order: the same bits on every rank), where the gradients are summed. So,
// like the parameters, every rank holds the same state at every step boundary: evaluation and
// checkpoints need nothing more, and a resumed run repeats the straight one bit for bit. In exact
// arithmetic the mean follows running = (1 - momentum) running + momentum mean_r(batch_r).
void Rig::average_model_state() {
  if (spec.state_count == 0 || comm.size() == 1) return;
  grad_comm->allreduce_sum(params->state_span());
  backend->scale(params->state(), 1.0f / static_cast<float>(comm.size()), spec.state_count);
}

void Rig::flip_first_parameter() {
  params->read();  // a GPU's parameters into the host copy
  flip_last_bit(params->host()[0]);
  params->to_backend();
}

double Rig::reduced_bytes() const {
  const double bytes = mode->reduced_bytes();
  return bytes > 0 ? bytes : reducer->wire_bytes();
}

NonfiniteSteps::Hooks Rig::verdict_hooks(std::function<void()> restart_window) {
  return {.verdict =
              [this](std::int64_t s) {
                const int v = guard->verdict(s);
                return StepVerdict{.nonfinite_gradient = (v & StepGuard::kNonfiniteGradient) != 0,
                                   .nonfinite_loss = (v & StepGuard::kNonfiniteLoss) != 0};
              },
          .first_bad_rank =
              [this](bool own_loss_bad) {
                std::int64_t bad_rank = own_loss_bad ? comm.rank() : std::numeric_limits<std::int64_t>::max();
                comm.allreduce_min(std::span<std::int64_t>(&bad_rank, 1));
                return bad_rank;
              },
          .skipped =
              [this, restart = std::move(restart_window)](std::int64_t s, const std::string& where) {
                monitor->on_skipped_step(s, where);
                restart();
              }};
}

StartFacts Rig::start_facts(const RunDevice& device, const LaunchEnv& launch, const Mnist& data) const {
  const std::int64_t moments = traits(opt.optimizer.kind).moments;
  std::int64_t largest_state = 0;  // elements of one moment on the rank that holds the most
  for (int r = 0; r < comm.size(); ++r) {
    std::int64_t n = 0;
    for (std::size_t k = 0; k < reducer->buckets().size(); ++k) {
      const ParamRange s = reducer->shard(k, r);
      n += s.end - s.begin;
    }
    largest_state = std::max(largest_state, n);
  }
  return StartFacts{
      .device_note = device.choice.note,
      .backend = backend->name(),
      .threads = plan.threads,
      .cuda = device.choice.cuda,
      .shared_gpus = device.shared_gpus,
      .nccl_hosts = device.nccl_hosts,
      .gpu = device.choice.gpu,
      .gpus = device.gpus,
      .gpu_description = device.choice.cuda ? describe_gpu(device.choice.gpu) : std::string(),
      .launch = launch,
      .train_images = data.train.count,
      .validation_images = data.validation.count,
      .test_images = data.test.count,
      .model = spec.text,
      .params = spec.param_count,
      .layers = step->describe_layers() + (step->plan().empty() ? std::string() : "  " + step->plan() + "\n"),
      .per_rank_batch = plan.batch,
      .gradient_progress = grad_comm->progress_mode(),
      .conv_algos = conv_timing.banner,
      .grad_compression = plan.chunks() > 0 || opt.grad_compression == "none" ? std::string() : opt.grad_compression,
      .compression_start_step =
          plan.chunks() == 0 && find_codec(opt.grad_compression).row->starts_later ? plan.compression_start_step : 0,
      .wire_bytes = reducer->wire_bytes(),
      .float_bytes = static_cast<double>(spec.param_count) * sizeof(float),
      .optimizer_state_bytes = largest_state * moments * static_cast<std::int64_t>(sizeof(float)),
      .optimizer_state_total_bytes = spec.param_count * moments * static_cast<std::int64_t>(sizeof(float)),
      .shard_optimizer = plan.sharded};
}

}  // namespace mnist_mpi
