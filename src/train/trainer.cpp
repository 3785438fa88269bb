// One rank's training loop (see include/mnist_mpi/train/trainer.hpp). The gradient of every rank
// is the sum over its slice divided by the GLOBAL batch; the allreduce sums these, so every rank
// applies the gradient of the global mean loss (Note [Averaging is a scaled sum] in src/train/gradient_pipeline.cpp).
#include "mnist_mpi/train/trainer.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/config/combinations.hpp"
#include "mnist_mpi/comm/consistency.hpp"
#include "mnist_mpi/comm/watchdog.hpp"
#include "mnist_mpi/crc32c.hpp"
#include "mnist_mpi/exact_sum.hpp"
#include "mnist_mpi/report/ranks.hpp"
#include "mnist_mpi/resilience/preemption.hpp"

namespace mnist_mpi {

// Set-up does only local work (Note [Ending every rank] in src/main.cpp), in this order: the
// device, the batch sizes, the data and the model spec, the backend and its gradient
// communicator, the training state, the evaluation model, then the monitor and the step.
Trainer::Trainer(const Options& options, Communicator& comm, std::chrono::steady_clock::time_point start)
    : opt_(options), comm_(comm), start_(start), rank0_(comm.rank() == 0) {
  // The device first, so that `--device cuda` without a GPU fails at once (exit 6, every rank).
  const GpuProbe gpus = opt_.device == "cpu" ? GpuProbe{} : probe_gpus();
  device_ = choose_device(opt_.device, cuda_built(), gpus, comm_.local_rank(), comm_.local_size(),
                          opt_.allow_gpu_sharing, comm_.host());
  // Ranks that share a GPU (allowed by --allow-gpu-sharing) sum through host memory, unless each is
  // an NCCL host of its own (Note [Ranks that are NCCL hosts of their own]). Asked on every rank
  // of a CUDA run, so that the collective is called alike everywhere.
  nccl_hosts_ = device_.cuda && ranks_are_nccl_hosts(comm_) && comm_.local_size() > gpus.count;
  shared_gpus_ = device_.cuda && comm_.local_size() > gpus.count && !nccl_hosts_;
  // Every pair of options, now with what the run found (Options built in code come through here too).
  const RunPlace place{device_.cuda, shared_gpus_, comm_.host(), comm_.size()};
  check_combinations(opt_, &place);
  find_codec(opt_.grad_compression);  // an unknown codec is a usage error before any work
  const std::int64_t world = comm_.size();
  // --shard-optimizer auto: sharded on the CPU with 2 or more ranks (Note [Sharded optimiser state]
  // in include/mnist_mpi/train/optimizer.hpp); the CUDA path shards only when asked, until NCCL's
  // reduce-scatter and all-gather have run across two GPUs (on one GPU: docs/gpu.md).
  sharded_ = opt_.shard_optimizer == Options::Sharding::kOn ||
             (opt_.shard_optimizer == Options::Sharding::kAuto && !device_.cuda && world > 1);
  launch_ = read_launch_env();
  launch_.check_world_size(static_cast<int>(world));
  fault_ = fault_from_env();
  MNIST_CHECK(fault_.kind == FaultKind::kNone || fault_.rank < world, ExitCode::kUsage,
              "MNIST_MPI_FAULT names rank " + std::to_string(fault_.rank) + " but the job has " +
                  std::to_string(world) + " rank(s)");
  opt_.data_dir = find_mnist_dir(opt_.data_dir);  // Note [Where the data is found]
  check_file_roles();                              // before any file is written
  data_ = load_mnist(opt_.data_dir, opt_.validation_size, opt_.train_limit);
  resolve_batch_sizes(data_.train.count);
  spec_ = parse_model_spec(opt_.model, Shape{1, data_.train.rows, data_.train.cols}, 10);
  sampler_ = std::make_unique<Sampler>(data_.train.count, global_batch_, opt_.seed);
  steps_per_epoch_ = sampler_->steps_per_epoch();
  total_steps_ = opt_.max_steps > 0 ? opt_.max_steps : checked_mul(opt_.epochs, steps_per_epoch_).value_or(-1);
  MNIST_CHECK(total_steps_ >= 0, ExitCode::kUsage,
              "--epochs " + std::to_string(opt_.epochs) + " is too large to train (it overflows a 64-bit count)");
  learning_rate(opt_.schedule, 0, 0, total_steps_);  // validates the schedule's name

  const int threads = set_up_backend();
  make_training_state();
  make_evaluation();
  replica_hashes_.resize(static_cast<std::size_t>(comm_.size()));
  // Designated initialisers: two fields of one type in another order do not compile.
  MonitorSetup ms{.rank = comm_.rank(),
                  .world = comm_.size(),
                  .host = comm_.host(),
                  .layer_names = {},
                  .buckets = reducer_->buckets().size(),
                  .total_steps = total_steps_,
                  .steps_per_epoch = steps_per_epoch_,
                  .global_batch = global_batch_,
                  .accumulation = accumulation_,
                  .process_start = start_,
                  .exact_chunk = exact_chunk_};
  for (const LayerSpec& l : spec_.layers) ms.layer_names.push_back(l.text);
  monitor_ = std::make_unique<Monitor>(opt_, std::move(ms));  // opens the metrics file (rank 0)
  timeline_ = monitor_->timeline();
  const StepParts parts{.backend = backend_.get(),
                        .model = train_model_.get(),
                        .params = params_.get(),
                        .grads = grads_.get(),
                        .reducer = reducer_.get(),
                        .optimizer = optimizer_.get(),
                        .guard = guard_.get(),
                        .sampler = sampler_.get(),
                        .data = train_data_.get(),
                        .loss = train_loss_.get(),
                        .timeline = timeline_};
  const StepShape shape{.rank = comm_.rank(),
                        .world = comm_.size(),
                        .accumulation = accumulation_,
                        .batch = batch_,
                        .global_batch = global_batch_,
                        .seed = opt_.seed,
                        .check_all_first = opt_.skip_nonfinite_steps,
                        .graph = opt_.cuda_graph,
                        .slow_ms = fault_.slow_ms_for(comm_.rank()),
                        .local_dropout_key = fault_.local_dropout_key_for(comm_.rank())};
  step_ = std::make_unique<Step>(
      parts, shape,
      exact_ ? make_exact_pipeline(parts, shape, {exact_.get(), scratch_loss_.get(), global_batch_ / exact_chunk_, my_chunks_})
             : make_summed_pipeline(parts, shape));
  monitor_->on_start(start_facts(threads, gpus));  // which GPU (every rank), the banner, the "start" event
}

// Note [No output is an input] (include/mnist_mpi/io/file_roles.hpp): every file of the run, each
// declared by the part that reads or writes it, compared on every rank before anything is written.
void Trainer::check_file_roles() const {
  FileRoles roles;
  declare_mnist_inputs(opt_.data_dir, roles);
  if (!opt_.config_file.empty()) roles.input("--config", opt_.config_file);
  Checkpointer::declare_files(opt_, roles);
  Monitor::declare_files(opt_, roles);
  roles.check();
}

// --global-batch-size or --batch-size per rank, with --accumulation-steps: the per-rank
// micro-batch batch_ (the largest, when the global batch does not divide evenly), the global
// batch_ and rank_images_, the images this rank takes per step. Sizes from the options are
// products of user input: 64-bit and overflow-checked, and the per-rank batch must fit the int
// that the kernels take. A size out of range names every factor of it and its value, and a fix
// that can work with the training split's `train_count` images.
void Trainer::resolve_batch_sizes(std::int64_t train_count) {
  const std::int64_t world = comm_.size();
  accumulation_ = opt_.accumulation_steps;
  const std::string ranks = std::to_string(world) + (world == 1 ? " rank" : " ranks");
  const std::string accumulation = "--accumulation-steps " + std::to_string(accumulation_);
  const std::string split = "the training split (" + std::to_string(train_count) + " images)";
  const auto too_big = [](const std::string& what) -> std::int64_t {
    throw_error(ExitCode::kUsage, what + " is too large to train (it overflows a 64-bit count)");
  };
  const std::int64_t parts = checked_mul(world, accumulation_).value_or(-1);  // micro-batches per global batch
  if (parts < 0) too_big(ranks + " x " + accumulation);
  if (opt_.global_batch_size > 0) {  // Note [Uneven slices] (include/mnist_mpi/data/sampler.hpp)
    const std::int64_t g = opt_.global_batch_size;
    std::string fix = "give at least " + std::to_string(parts);  // a fix that can work, below
    if (parts > train_count)  // more micro-batches than images: fewer of them, not a larger batch
      fix = g >= world                  ? "lower --accumulation-steps to at most " + std::to_string(g / world) +
                                              " with " + ranks
            : g >= accumulation_ ? "run on at most " + std::to_string(g / accumulation_) + " ranks"
                                 : "run on at most " + std::to_string(g) + " ranks with --accumulation-steps 1";
    else if (accumulation_ > 1)
      fix = "give a --global-batch-size of at least " + std::to_string(parts) + ", or lower --accumulation-steps";
    MNIST_CHECK(g >= parts, ExitCode::kUsage,
                "--global-batch-size " + std::to_string(g) + " is smaller than the " + ranks +
                    (accumulation_ > 1 ? " x " + std::to_string(accumulation_) + " accumulation steps (" +
                                             accumulation + ")"
                                       : std::string()) +
                    ": every micro-batch needs at least one image; " + fix);
    MNIST_CHECK(g <= train_count, ExitCode::kUsage,
                "--global-batch-size " + std::to_string(g) + " is larger than " + split +
                    ": give at most " + std::to_string(train_count));
    global_batch_ = g;
    batch_ = largest_part(global_batch_, parts);
  } else {
    batch_ = opt_.batch_size;
    const std::string factors = "--batch-size " + std::to_string(batch_) + " x " + ranks + " x " + accumulation;
    global_batch_ = checked_mul(batch_, parts).value_or(-1);
    if (global_batch_ < 0) too_big("the global batch of " + factors);
    MNIST_CHECK(global_batch_ <= train_count, ExitCode::kUsage,
                "the global batch of " + std::to_string(global_batch_) + " images (" + factors +
                    ") is larger than " + split + "; lower --batch-size" +
                    (accumulation_ > 1 ? " or --accumulation-steps" : "") + (world > 1 ? ", or use fewer ranks" : ""));
  }
  rank_images_ = images_in_parts(global_batch_, parts, comm_.rank() * accumulation_, accumulation_);
  if (opt_.exact_sums) {  // Note [Chunks of the global batch]: the model runs one chunk at a time
    exact_chunk_ = opt_.exact_chunk > 0 ? opt_.exact_chunk : default_exact_chunk(global_batch_);
    my_chunks_ = rank_chunks(global_batch_, exact_chunk_, world, comm_.rank());
    batch_ = exact_chunk_;
    rank_images_ = my_chunks_.count * exact_chunk_;
  }
  MNIST_CHECK(batch_ <= std::numeric_limits<int>::max(), ExitCode::kUsage,
              "a batch of " + std::to_string(batch_) +
                  " images per rank is more than this program can hold; give a "
                  "smaller --batch-size or --global-batch-size");
}

// The backend of the chosen device, and the communicator that sums its gradients. Returns the
// threads per rank (CPU).
int Trainer::set_up_backend() {
  int threads = opt_.threads;
  if (opt_.exact_sums) threads = 1;  // one thread per rank: more are refused (config/combinations.cpp)
  if (threads == 0)
    threads = comm_.local_size() > 1 ? 1 : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  backend_ = make_backend(device_, threads, opt_.precision);
  backend_->set_wait_timeout(opt_.collective_timeout);             // Note [Device waits have a deadline]
  gpu_comm_ = backend_->make_gradient_communicator(comm_, spec_.param_count, shared_gpus_, opt_.exact_sums);
  grad_comm_ = gpu_comm_ ? gpu_comm_.get() : &comm_;
  return threads;
}

// Parameters, gradients, the training model, optimiser, reducer, the training split where the
// backend computes, the step guard and the checkpointer.
void Trainer::make_training_state() {
  const InitSpec wi = parse_init_spec(opt_.weight_init), bi = parse_init_spec(opt_.bias_init);
  {  // before anything is allocated (Note [Will the model fit?])
    const std::int64_t largest = std::max({data_.validation.count, data_.test.count, std::int64_t{1}});
    backend_->check_model_fits(spec_, batch_, std::min(opt_.eval_batch_size, largest), opt_.optimizer.kind,
                               /*evaluates=*/true);  // every rank (Note [Every rank evaluates a share])
  }
  params_ = std::make_unique<ParameterStore>(*backend_, spec_.param_count, spec_.state_count);
  grads_ = backend_->allocate(spec_.param_count);
  init_params(spec_, wi, bi, opt_.seed, params_->host());
  params_->to_backend();
  init_state(spec_, params_->state_host());
  params_->state_to_backend();
  train_model_ = std::make_unique<Model>(spec_, static_cast<int>(batch_), *backend_, *params_, grads_->data());
  // Note [Choosing cuDNN algorithms] (src/backend/cuda/conv.cpp): rank 0 times its convolutions
  // here, local work, and takes its choice at once (its banner shows it); the others take it in
  // run() (share_measured_convolutions).
  if (opt_.conv_algos == "measured" && rank0_) {
    Backend::ConvTiming t = backend_->time_convolutions(spec_, static_cast<int>(batch_));
    conv_table_ = std::move(t.table);
    conv_algos_ = std::move(t.banner);
    backend_->use_measured_convolutions(spec_, conv_table_);
  }
  const auto mb_to_elems = [](double mb) {
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(mb * 1048576.0 / sizeof(float)));
  };
  const auto flat = [&](Buffer& b) { return std::span<float>(b.data(), static_cast<std::size_t>(spec_.param_count)); };
  if (opt_.exact_sums) {
    exact_ = std::make_unique<ExactSums>(spec_, global_batch_ / exact_chunk_, backend_.get());
    scratch_loss_ = backend_->make_loss_meter();
  }
  reducer_ = std::make_unique<Reducer>(
      *grad_comm_, flat(*grads_), plan_buckets(spec_, mb_to_elems(opt_.bucket_mb), mb_to_elems(opt_.first_bucket_mb)),
      !opt_.no_overlap,
      sharded_ ? std::span<float>(params_->data_for_reporting_writers(), static_cast<std::size_t>(spec_.param_count))
               : std::span<float>(),
      exact_ ? fixed_point_codec(exact_->fixed()) : find_codec(opt_.grad_compression).make(), backend_.get());
  // Note [Sharded optimiser state] (include/mnist_mpi/train/optimizer.hpp)
  if (sharded_) {
    std::vector<std::vector<ParamRange>> every_rank;
    for (int r = 0; r < comm_.size(); ++r) every_rank.push_back(reducer_->owned(r));
    optimizer_ = std::make_unique<Optimizer>(opt_.optimizer, spec_.param_count, *backend_, std::move(every_rank),
                                             comm_.rank(), params_.get());
  } else {
    optimizer_ = std::make_unique<Optimizer>(opt_.optimizer, spec_.param_count, *backend_, params_.get());
  }
  std::vector<OptimizerTensor> tensors;  // Note [LAMB in two phases]: weights take a trust ratio, biases not
  for (const ParamTensor& t : spec_.params) tensors.push_back({t.offset, t.offset + t.size, !t.is_bias});
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  optimizer_->set_tensors(std::move(tensors));
  train_data_ = backend_->make_data_source(data_.train, static_cast<int>(batch_));
  train_loss_ = backend_->make_loss_meter();
  guard_ = backend_->make_step_guard(!opt_.skip_nonfinite_steps);
  checkpointer_ = std::make_unique<Checkpointer>(
      opt_, comm_, CheckpointRun{&spec_, global_batch_, data_.train.count, steps_per_epoch_, total_steps_, exact_chunk_,
                                reducer_->codec_state_size()});
  boundary_ = std::make_unique<StepBoundary>(opt_, comm_, *checkpointer_, static_cast<CheckpointSource&>(*this));
}

// Rank 0: the evaluation model (sharing the parameters) and the splits it reads.
void Trainer::make_evaluation() {
  const std::int64_t largest = std::max({data_.validation.count, data_.test.count, std::int64_t{1}});
  const int eb = static_cast<int>(std::min(opt_.eval_batch_size, largest));
  eval_model_ = std::make_unique<Model>(spec_, eb, *backend_, *params_, nullptr);
  if (data_.validation.count > 0) validation_data_ = backend_->make_data_source(data_.validation, eb);
  test_data_ = backend_->make_data_source(data_.test, eb);
  eval_loss_ = make_evaluation_loss(*backend_, exact_ != nullptr, (largest + eb - 1) / eb);
}

// What the banner says (Monitor::on_start).
StartFacts Trainer::start_facts(int threads, const GpuProbe& gpus) const {
  const std::int64_t moments = traits(opt_.optimizer.kind).moments;
  std::int64_t largest_state = 0;  // elements of one moment on the rank that holds the most
  for (int r = 0; r < comm_.size(); ++r) {
    std::int64_t n = 0;
    for (std::size_t k = 0; k < reducer_->buckets().size(); ++k) {
      const ParamRange s = reducer_->shard(k, r);
      n += s.end - s.begin;
    }
    largest_state = std::max(largest_state, n);
  }
  return StartFacts{
      .device_note = device_.note,
      .backend = backend_->name(),
      .threads = threads,
      .cuda = device_.cuda,
      .shared_gpus = shared_gpus_,
      .nccl_hosts = nccl_hosts_,
      .gpu = device_.gpu,
      .gpus = gpus.count,
      .gpu_description = device_.cuda ? describe_gpu(device_.gpu) : std::string(),
      .launch = launch_,
      .train_images = data_.train.count,
      .validation_images = data_.validation.count,
      .test_images = data_.test.count,
      .model = spec_.text,
      .params = spec_.param_count,
      .layers = step_->describe_layers() + (step_->plan().empty() ? std::string() : "  " + step_->plan() + "\n"),
      .per_rank_batch = batch_,
      .gradient_progress = grad_comm_->progress_mode(),
      .conv_algos = conv_algos_,
      .optimizer_state_bytes = largest_state * moments * static_cast<std::int64_t>(sizeof(float)),
      .optimizer_state_total_bytes = spec_.param_count * moments * static_cast<std::int64_t>(sizeof(float)),
      .shard_optimizer = sharded_};
}

std::string Trainer::job_description() const {
  return "version = " MNIST_MPI_VERSION "\n" + agreed_options(opt_.resolved) + "model spec = " + spec_.text + " (" +
         std::to_string(spec_.param_count) + " parameters)\n" + "data = " + std::to_string(data_.train.count) +
         " train, " + std::to_string(data_.validation.count) + " validation, " + std::to_string(data_.test.count) +
         " test images of " + std::to_string(data_.train.rows) + "x" + std::to_string(data_.train.cols) + "\n" +
         "world size = " + std::to_string(comm_.size()) + "\n" +
         "optimizer sharded = " + (sharded_ ? "yes" : "no") + "\n";  // --shard-optimizer auto, resolved here
}

const float* Trainer::host_params() { return params_->read(); }

std::vector<float> Trainer::params_to_host() {
  const float* p = host_params();
  return std::vector<float>(p, p + spec_.param_count);
}

// Rank 0, at a checkpoint: the parameters and the optimiser's full moments in host memory.
TrainingState Trainer::state() {
  const float* params = host_params();
  const Optimizer::Moments m = optimizer_->checkpoint_moments();
  return {params,
          m.first,
          m.second,
          optimizer_->steps_taken(),
          &optimizer_->config(),
          exact_ ? std::span<const std::int32_t>(exact_->limits()) : std::span<const std::int32_t>(),
          params_->read_state(),
          reducer_->gathered_codec_state()};
}

// Note [State that is not trained] (include/mnist_mpi/model/spec.hpp): each rank's running
// statistics move with its own batches; after every step they are replaced by their mean over the
// ranks (summed in rank order: the same bits on every rank), where the gradients are summed. So,
// like the parameters, every rank holds the same state at every step boundary: evaluation and
// checkpoints need nothing more, and a resumed run repeats the straight one bit for bit. In exact
// arithmetic the mean follows running = (1 - momentum) running + momentum mean_r(batch_r).
void Trainer::average_model_state() {
  if (spec_.state_count == 0 || comm_.size() == 1) return;
  grad_comm_->allreduce_sum(params_->state_span());
  backend_->scale(params_->state(), 1.0f / static_cast<float>(comm_.size()), spec_.state_count);
}

// Note [Every rank evaluates a share]
// An evaluation used to be rank 0's alone while the other ranks waited for it at the next
// collective: on lenet, 2 ranks, a quarter of the time to 99 % validation accuracy. Now the
// split's batches of --eval-batch-size are shared out in contiguous runs (part_count/part_first
// of Note [Uneven slices], over batches rather than images), every rank evaluates its run, and one
// allreduce of (loss sum, correct count) gives every rank the split's numbers. Shares are whole
// batches, so every image sits in the same batch at the same row as on one rank and its logits are
// the same bits. The count is an integer (exact in a double), so the accuracy, and every decision
// made from it (--target-accuracy, the best checkpoint), is the one-rank value on any number of
// ranks and the same on every rank. The mean loss adds the ranks' partial sums, so its last bits
// move with the number of ranks, as PyTorch DDP's all-reduced loss does. Every rank holds an
// evaluation model (--eval-batch-size images of activations) and the splits' data.
EvalResult Trainer::evaluate(const Split& split) {
  const std::int64_t batches = eval_batches(split);
  const std::int64_t first = part_first(batches, comm_.size(), comm_.rank());
  const LossStats mine = evaluate_batches(split, first, part_count(batches, comm_.size(), comm_.rank()));
  return eval_result(split.count, eval_loss_->total(comm_, batches, mine));
}

EvalResult Trainer::evaluate_alone(const Split& split) {
  return eval_result(split.count, evaluate_batches(split, 0, eval_batches(split)));
}

// The split's batches of the evaluation model's size (the last one may be short). The model is
// built on every rank at construction (make_evaluation).
std::int64_t Trainer::eval_batches(const Split& split) const {
  const std::int64_t eb = eval_model_->batch();
  return (split.count + eb - 1) / eb;
}

EvalResult Trainer::eval_result(std::int64_t count, const LossStats& s) {
  EvalResult r;
  r.count = count;
  if (count > 0) {
    r.loss = s.loss_sum / static_cast<double>(count);
    r.accuracy = static_cast<double>(s.correct) / static_cast<double>(count);
  }
  return r;
}

// Batches [first, first + n) of the split (the last one of the split may be short), with the current
// parameters, on this rank.
LossStats Trainer::evaluate_batches(const Split& split, std::int64_t first, std::int64_t n) {
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
  eval_loss_->start();
  eval_images_ = 0;
  for (std::int64_t b = first; b < first + n; ++b) {
    const std::int64_t at = b * eb;
    const std::int64_t rows = std::min<std::int64_t>(eb, split.count - at);
    source->slice(at, rows, eval_model_->input());
    // A short last batch: the rows past `rows` are stale and their outputs are ignored.
    eval_model_->forward(ctx);
    backend_->softmax_cross_entropy(eval_model_->logits(), source->labels(), static_cast<int>(rows),
                                    spec_.num_classes(), nullptr, 0.0f, eval_loss_->meter());
    eval_images_ += rows;
    eval_loss_->batch_done();
  }
  return eval_loss_->mine();
}

void Trainer::check_replicas(std::int64_t step) {
  std::vector<std::uint64_t>& hashes = replica_hashes_;  // sized at construction
  // content_digest (27 GB/s here) rather than params_hash's FNV-1a (1 GB/s, byte by byte): lenet's
  // 13 MB took 13 ms a check, 0.13 ms a step at the default of one check every 100 steps.
  comm_.allgather(content_digest(host_params(), static_cast<std::size_t>(spec_.param_count) * sizeof(float)), hashes);
  // Every rank holds the same digests, so every rank finds a divergence here and stops at this
  // point (an AgreedError: rank 0 prints it, none is left in a collective, all exit through
  // MPI_Finalize). An error of one rank's own, with MPI_Abort, let whichever rank printed first
  // end the job, so the message came from either rank.
  for (std::size_t r = 1; r < hashes.size(); ++r)
    if (hashes[r] != hashes[0])
      throw AgreedError(ExitCode::kRuntime,
                        !rank0_
                            ? std::string()
                            : "replicas diverged after step " + std::to_string(step) + ": rank " + std::to_string(r) +
                                  " holds parameters " + hex64(hashes[r]) + ", rank 0 holds " + hex64(hashes[0]) +
                                  " (every rank must hold identical parameters; this is a bug, please report it)");
}

// --conv-algos measured (Note [Choosing cuDNN algorithms] in src/backend/cuda/conv.cpp): rank 0's
// table, three algorithms per convolution of the agreed model spec, broadcast to every rank (the
// same collective on every backend; a CPU rank 0 sends -1s, which change nothing), and the
// other ranks rebuild their training convolutions with it. A rank whose GPU cannot run rank 0's
// choice stops, naming the layer and the algorithm.
void Trainer::share_measured_convolutions() {
  if (opt_.conv_algos != "measured") return;
  const auto convs = std::count_if(spec_.layers.begin(), spec_.layers.end(),
                                   [](const LayerSpec& l) { return l.kind == LayerKind::kConv; });
  if (convs == 0) return;
  std::vector<std::int32_t> table(static_cast<std::size_t>(3 * convs), -1);
  if (rank0_ && conv_table_.size() == table.size()) table = conv_table_;
  comm_.broadcast(
      std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(table.data()), table.size() * sizeof(std::int32_t)), 0);
  if (!rank0_) backend_->use_measured_convolutions(spec_, table);
}

RunResult Trainer::run() {
  RunResult res;
  grad_comm_->connect();  // NCCL: the collective part of its set-up
  share_measured_convolutions();
  // A checkpoint's parameters and optimiser state, on every rank (none: first_step 0).
  const std::int64_t first_step = checkpointer_->restore(params_->host(), [&](const RestoredState& r) {
    optimizer_->restore(r.first_moment, r.second_moment, r.steps);
    if (exact_) exact_->set_limits(r.exact_limits);  // checked against the mode when it was chosen
    reducer_->restore_codec_state(r.codec_ranks, r.codec_state);
    if (spec_.state_count > 0) {                     // the sizes were checked against the spec (Checkpointer::restore)
      std::copy(r.model_state.begin(), r.model_state.end(), params_->state_host());
      params_->state_to_backend();
    }
  });
  if (first_step > 0) params_->to_backend();
  res.first_step = first_step;
  // Rank 0's initial parameters are everyone's: no rank trains weights of its own.
  {
    const ParameterStore::Lease all = params_->write_all();
    grad_comm_->broadcast(all.span(), 0);
  }
  check_replicas(first_step);
  monitor_->start(comm_);
  start_rank_times();
  clock_ = RunClock{};
  clock_.run = clock_.window = std::chrono::steady_clock::now();
  clock_.warmup = total_steps_ - first_step > kWarmupSteps ? kWarmupSteps : 0;
  verdict_next_ = current_step_ = first_step;
  window_n_ = skipped_ = 0;
  logged_loss_ = std::numeric_limits<double>::quiet_NaN();
  train_loss_->reset();
  res.target.accuracy = opt_.target_accuracy;

  std::int64_t end_step = total_steps_;  // earlier when --target-accuracy is reached
  for (std::int64_t step = first_step; step < total_steps_; ++step) {
    if (step == first_step + clock_.warmup) clock_.start_steady(*backend_);
    if (step == first_step) clock_.startup_s = seconds_since(start_);
    current_step_ = step;
    watch_set_step(step);  // for the collective watchdog's message (src/comm/watchdog.cpp)
    if (fault_.armed_for(comm_.rank(), step)) fire_fault(fault_);  // nan and diverge: below, the trainer's
    const std::int64_t epoch = step / steps_per_epoch_;
    const double lr = learning_rate(opt_.schedule, step, epoch, total_steps_);
    const bool poison = fault_.kind == FaultKind::kNan && fault_.armed_for(comm_.rank(), step);

    const StepResult r = step_->run(step, lr, poison);
    average_model_state();  // batch norm's running statistics: every rank the same
    if (fault_.kind == FaultKind::kDiverge && fault_.armed_for(comm_.rank(), step)) {
      host_params();  // a GPU's parameters into the host copy
      float* p = params_->host();
      std::uint32_t bits;
      std::memcpy(&bits, p, sizeof bits);
      bits ^= 1u;
      std::memcpy(p, &bits, sizeof bits);
      params_->to_backend();
    }

    monitor_->on_step(step, r.timing, r.end);
    if (step - first_step >= clock_.warmup) clock_.sum += r.timing;
    window_n_ += rank_images_;
    const bool log_now = opt_.log_every > 0 && ((step + 1) % opt_.log_every == 0 || step + 1 == total_steps_);
    const bool epoch_end = (step + 1) % steps_per_epoch_ == 0;
    const bool eval_now = opt_.eval_every > 0 && (step + 1) % opt_.eval_every == 0 && step + 1 != total_steps_;
    // After the window count above, so that a restarted window drops this step's loss and count
    // alike; at once where the host synchronises anyway, else guard_->lag() steps later.
    settle_verdicts(log_now || epoch_end || eval_now ? step : step - guard_->lag());
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
  settle_verdicts(end_step - 1);
  const std::int64_t steady_steps = end_step - first_step - clock_.warmup;  // <= 0: stopped in the warm-up
  gather_rank_times(end_step - 1, std::max<std::int64_t>(steady_steps, 0));  // the last window (maybe empty)
  if (steady_steps > 0) clock_.end_steady(*backend_);
  boundary_->finish();
  check_replicas(end_step);
  res.steps = end_step;
  res.epochs = static_cast<double>(end_step) / static_cast<double>(steps_per_epoch_);
  res.wall_s = seconds_since(clock_.run);
  if (steady_steps > 0) {
    res.images_per_s = clock_.images_per_s(steady_steps, global_batch_);
    res.timing = clock_.sum.mean_over(steady_steps);
  }
  res.timing.reduced_bytes =  // --exact-sums: 64-bit integers and two counters
      exact_ ? static_cast<double>(exact_->fixed().size()) * sizeof(std::int64_t)
             : static_cast<double>(spec_.param_count) * sizeof(float);
  res.checkpoints = boundary_->stats();
  res.skipped_steps = skipped_;
  res.params_hash = hex64(hash_floats(host_params(), spec_.param_count));
  final_report(res);
  return res;
}

// Note [Timing a step]
// On a GPU the host only queues work, so a step's host time says little. So on every backend the
// steady rate is the wall time from a synchronisation after the warm-up steps (the first 10, when
// the run has more) to one after the last step, less the time spent evaluating, writing
// checkpoints and comparing replicas (--check-replicas-every: a download of the parameters and a
// hash, which on a GPU also drains the stream). The per-step agreement on a signal stays in: it
// is a collective of every step. The per-step parts are host times (queueing times on a GPU),
// averaged over the same steps.
void Trainer::RunClock::start_steady(Backend& backend) {
  backend.synchronize();
  steady = std::chrono::steady_clock::now();
  excluded_at_steady = excluded_s;
}

void Trainer::RunClock::end_steady(Backend& backend) {
  backend.synchronize();
  steady_s = seconds_since(steady) - (excluded_s - excluded_at_steady);
}

double Trainer::RunClock::images_per_s(std::int64_t steps, std::int64_t global_batch) const {
  return steady_s > 0 ? static_cast<double>(steps * global_batch) / steady_s : 0.0;
}

// Note [Non-finite steps] (include/mnist_mpi/backend/step_guard.hpp), the trainer's part: the guard's
// verdict of every step is read in order, on every rank at the same step (every place that
// settles does so on every rank alike), at once on the host and guard_->lag() steps later on a
// device. One more collective finds the first rank whose own loss was not finite. Without
// --skip-nonfinite-steps the run stops; with it the step is counted and the loss window restarts.
void Trainer::settle_verdicts(std::int64_t up_to) {
  while (verdict_next_ <= up_to) {
    const std::int64_t s = verdict_next_++;
    const int v = guard_->verdict(s);
    if (!(v & StepGuard::kNonfiniteGradient)) continue;
    nonfinite_step(s, (v & StepGuard::kNonfiniteLoss) != 0);
    train_loss_->reset();  // the skipped step's loss is in the meter: the window starts again
    window_n_ = 0;
  }
}

void Trainer::nonfinite_step(std::int64_t bad_step, bool own_loss_bad) {
  std::int64_t bad_rank = own_loss_bad ? comm_.rank() : std::numeric_limits<std::int64_t>::max();
  comm_.allreduce_min(std::span<std::int64_t>(&bad_rank, 1));
  const std::string where = bad_rank == std::numeric_limits<std::int64_t>::max()
                                ? "every rank's loss was finite: the gradient overflowed"
                                : "the loss was not finite on rank " + std::to_string(bad_rank);
  const std::string seen = current_step_ == bad_step
                               ? std::string()
                               : "; the GPU guard kept it and the " + std::to_string(current_step_ - bad_step) +
                                     " step(s) after it from the parameters";
  if (!opt_.skip_nonfinite_steps)
    throw AgreedError(ExitCode::kNumerical,
                      !rank0_ ? std::string() :  // main prints the one message
                          "non-finite gradient in step " + std::to_string(bad_step + 1) + " (" + where + seen +
                              "); training diverged or the data holds NaN: lower --lr, add --warmup-steps, or pass "
                              "--skip-nonfinite-steps to skip such steps (no non-finite value reached the parameters)");
  ++skipped_;
  monitor_->on_skipped_step(bad_step, where);
}

// Note [Every rank's step times]
// Rank 0's own step times say little about the others, and a slow rank shows on it only as
// waiting. So each rank sums its phase times (data, forward, backward, exposed communication,
// optimizer) and at every log line, where the ranks already meet for the training loss, one small
// gather (10 doubles a rank, into buffers made at start) brings every rank's window to rank 0: the
// "ranks" metrics event and the report's per-rank charts; and each rank's sums over the steady
// steps so far (clock_.sum, the first 10 left out as from the step rate: their one-off costs
// differ from rank to rank), for every rank's means over the run and Note [Naming a straggler].
// Nothing is added to the steps between log lines; without --log-every the one gather is at the
// end. Its cost: docs/performance.md#every-ranks-step-times.
void Trainer::start_rank_times() {
  // Here, in run(), and not in the constructor: a collective there would leave the ranks whose
  // options parsed waiting in it while one that failed waits in main's set-up agreement
  // (tests/e2e_faults.sh, bad_option_on_one_rank).
  const std::vector<std::string> hosts = gather_hosts(comm_, 0);
  if (comm_.size() > 1) {
    const std::vector<int> locals = gather_local_ranks(comm_, 0);
    if (rank0_) monitor_->on_placement(describe_placement(hosts, locals));
  }
  if (!rank0_) return;
  const auto world = static_cast<std::size_t>(comm_.size());
  rank_gathered_.assign(world * kRankValues, 0.0);
  rank_means_.assign(world, RankTimes{});
  rank_sums_.assign(world, RankTimes{});
  for (std::size_t r = 0; r < world; ++r) {
    rank_means_[r].rank = rank_sums_[r].rank = static_cast<int>(r);
    rank_means_[r].host = rank_sums_[r].host = hosts.at(r);
  }
}

void Trainer::gather_rank_times(std::int64_t step, std::int64_t steady_steps) {
  std::int64_t n = 0;  // the same on every rank: steps since the last log line
  const StepTiming w = monitor_->take_window(n);
  const StepTiming& s = clock_.sum;
  const double mine[kRankValues] = {w.data, w.forward, w.backward, w.exposed_comm, w.optimizer,
                                    s.data, s.forward, s.backward, s.exposed_comm, s.optimizer};
  comm_.gather(std::span<const double>(mine, kRankValues), std::span<double>(rank_gathered_), 0);
  if (!rank0_) return;
  const auto timing = [](const double* g) {
    return StepTiming{.data = g[0], .forward = g[1], .backward = g[2], .exposed_comm = g[3], .optimizer = g[4]};
  };
  for (std::size_t r = 0; r < rank_sums_.size(); ++r) {
    const double* g = rank_gathered_.data() + kRankValues * r;
    rank_means_[r].per_step = timing(g).mean_over(n);
    rank_sums_[r].per_step = timing(g + 5);
  }
  rank_steps_ = steady_steps;
  if (n > 0) monitor_->on_ranks(step + 1, rank_means_);
}

void Trainer::log_training_loss(std::int64_t step, double lr, RunResult& res) {
  double v[2] = {train_loss_->read().loss_sum, static_cast<double>(window_n_)};  // a GPU syncs here
  train_loss_->reset();
  comm_.allreduce_sum(std::span<double>(v, 2));
  res.last_train_loss = v[1] > 0 ? v[0] / v[1] : std::numeric_limits<double>::quiet_NaN();
  logged_loss_ = res.last_train_loss;
  if (rank0_) {
    const double ips = v[1] / seconds_since(clock_.window);
    monitor_->on_log(step, res.last_train_loss, lr, ips);
  }
  gather_rank_times(step, std::max<std::int64_t>(step + 1 - res.first_step - clock_.warmup, 0));
  window_n_ = 0;
  clock_.window = std::chrono::steady_clock::now();
}

// Every rank, a share each (Note [Every rank evaluates a share]): the validation split at an
// epoch's end, the test split every --eval-every steps (with --target-accuracy the validation
// split instead: Note [Stopping at a target accuracy]).
EvalResult Trainer::evaluate_during_training(std::int64_t step, bool epoch_end, bool eval_now) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  EvalResult validation{kNaN, kNaN, 0};
  if (!(epoch_end || eval_now)) return validation;
  const bool target = opt_.target_accuracy > 0;
  const std::int64_t epoch = step / steps_per_epoch_;
  const auto te = std::chrono::steady_clock::now();
  auto report = [&](const char* name, const Split& split) {
    const auto tb = std::chrono::steady_clock::now();
    const EvalResult e = evaluate(split);
    if (&split == &data_.validation) validation = e;
    monitor_->on_eval(step + 1, epoch, name, e.accuracy, e.loss, tb, std::chrono::steady_clock::now());
  };
  if ((epoch_end || (eval_now && target)) && data_.validation.count > 0) report("validation", data_.validation);
  if (eval_now && !target) report("test", data_.test);
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
  end.last = last || step + 1 == total_steps_;
  end.lr = lr;
  end.next_lr = learning_rate(opt_.schedule, step + 1, (step + 1) / steps_per_epoch_, total_steps_);
  end.validation_accuracy = validation.accuracy;
  end.validation_loss = validation.loss;
  end.train_loss = logged_loss_;
  const auto tc = std::chrono::steady_clock::now();
  const std::int64_t written_before = checkpointer_->stats().written;
  const StepBoundary::Decision next = boundary_->after_step(end, last);
  const bool wrote = checkpointer_->stats().written != written_before;  // rank 0 writes
  if (timeline_ && wrote) timeline_->record(SpanKind::kCheckpoint, tc, std::chrono::steady_clock::now(), step);
  // A checkpoint is not training time; the agreement on a signal at every other step is a
  // collective of the step, so the steady rate keeps it (the log line's rate leaves it out, as it
  // always did).
  if (wrote)
    clock_.exclude(tc);
  else
    clock_.pause_window(tc);
  return next;
}

void Trainer::RunClock::exclude(std::chrono::steady_clock::time_point since) {
  excluded_s += std::chrono::duration<double>(pause_window(since)).count();
}

std::chrono::steady_clock::duration Trainer::RunClock::pause_window(std::chrono::steady_clock::time_point since) {
  const auto d = std::chrono::steady_clock::now() - since;
  window += d;
  return d;
}

// The run stopped on a signal after `step` (exit code 75); a checkpoint has been written if there is a directory.
RunResult Trainer::stopped(std::int64_t step, RunResult& res) {
  settle_verdicts(step);
  res.preempted_signal = boundary_->stop_signal();
  res.steps = step + 1;
  res.epochs = static_cast<double>(step + 1) / static_cast<double>(steps_per_epoch_);
  res.checkpoints = boundary_->stats();
  res.skipped_steps = skipped_;
  res.params_hash = hex64(hash_floats(host_params(), spec_.param_count));
  monitor_->on_preempted(PreemptedFacts{.signal = signal_name(res.preempted_signal),
                                        .steps = res.steps,
                                        .checkpointing = checkpointer_->enabled(),
                                        .checkpoint = res.checkpoints.last_file});  // rank 0's message
  return res;
}

// The run's end: peak memory of every rank, the test split (every rank, a share each), the report
// and the last metrics lines.
void Trainer::final_report(RunResult& res) {
  const StepTiming& timing = res.timing;
  const double startup_s = clock_.startup_s;
  double eval_s = clock_.eval_s;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::vector<std::uint64_t> rss(static_cast<std::size_t>(comm_.size()));
  comm_.allgather(static_cast<std::uint64_t>(ru.ru_maxrss), rss);  // KiB

  const auto te = std::chrono::steady_clock::now();
  res.test = evaluate(data_.test);  // every rank, a share each
  monitor_->on_eval(res.steps, res.steps / steps_per_epoch_, "test", res.test.accuracy, res.test.loss, te,
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
                         .exact_chunk = exact_chunk_,
                         .exact_sum_probes = exact_ ? exact_->probes() : 0,
                         .ranks = {},
                         .straggler = {}};
  if (rank0_ && rank_steps_ > 0) {
    facts.ranks = rank_sums_;
    for (RankTimes& r : facts.ranks) r.per_step = r.per_step.mean_over(rank_steps_);
    facts.straggler = find_straggler(facts.ranks, rank_steps_);
  }
  monitor_->on_final(facts);  // rank 0: the final report and the "final" event
  monitor_->finish(comm_, facts);
  res.outputs_lost = monitor_->outputs_lost();  // agreed by every rank (exit code 7)
}

}  // namespace mnist_mpi
