// The run's plan (include/mnist_mpi/train/run_plan.hpp): batch sizes, steps, sharding and threads
// from the options and the job's plain facts. No collective and no backend: the trainer computes
// it on every rank during set-up, which does only local work (Note [Ending every rank] in
// src/main.cpp).
#include "mnist_mpi/train/run_plan.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/codec.hpp"
#include "mnist_mpi/train/exact_sums.hpp"  // default_exact_chunk
#include "mnist_mpi/train/optimizer.hpp"   // learning_rate

namespace mnist_mpi {
namespace {

// --global-batch-size or --batch-size per rank, with --accumulation-steps: the per-rank
// micro-batch (the largest, when the global batch does not divide evenly), the global batch and
// rank_images, the images this rank takes per step. Sizes from the options are products of user
// input: 64-bit and overflow-checked, and the per-rank batch must fit the int that the kernels
// take. A size out of range names every factor of it and its value, and a fix that can work with
// the training split's `train_count` images.
void resolve_batch_sizes(const Options& opt, const JobFacts& job, RunPlan& p) {
  const std::int64_t world = job.world, train_count = job.train_count;
  p.accumulation = opt.accumulation_steps;
  const std::string ranks = std::to_string(world) + (world == 1 ? " rank" : " ranks");
  const std::string accumulation = "--accumulation-steps " + std::to_string(p.accumulation);
  const std::string split = "the training split (" + std::to_string(train_count) + " images)";
  const auto too_big = [](const std::string& what) -> std::int64_t {
    throw_error(ExitCode::kUsage, what + " is too large to train (it overflows a 64-bit count)");
  };
  const std::int64_t parts = checked_mul(world, p.accumulation).value_or(-1);  // micro-batches per global batch
  if (parts < 0) too_big(ranks + " x " + accumulation);
  if (opt.global_batch_size > 0) {  // Note [Uneven slices] (include/mnist_mpi/data/sampler.hpp)
    const std::int64_t g = opt.global_batch_size;
    std::string fix = "give at least " + std::to_string(parts);  // a fix that can work, below
    if (parts > train_count)  // more micro-batches than images: fewer of them, not a larger batch
      fix = g >= world ? "lower --accumulation-steps to at most " + std::to_string(g / world) + " with " + ranks
            : g >= p.accumulation ? "run on at most " + std::to_string(g / p.accumulation) + " ranks"
                                  : "run on at most " + std::to_string(g) + " ranks with --accumulation-steps 1";
    else if (p.accumulation > 1)
      fix = "give a --global-batch-size of at least " + std::to_string(parts) + ", or lower --accumulation-steps";
    MNIST_CHECK(
        g >= parts, ExitCode::kUsage,
        "--global-batch-size " + std::to_string(g) + " is smaller than the " + ranks +
            (p.accumulation > 1 ? " x " + std::to_string(p.accumulation) + " accumulation steps (" + accumulation + ")"
                                : std::string()) +
            ": every micro-batch needs at least one image; " + fix);
    MNIST_CHECK(g <= train_count, ExitCode::kUsage,
                "--global-batch-size " + std::to_string(g) + " is larger than " + split + ": give at most " +
                    std::to_string(train_count));
    p.global_batch = g;
    p.batch = largest_part(p.global_batch, parts);
  } else {
    p.batch = opt.batch_size;
    const std::string factors = "--batch-size " + std::to_string(p.batch) + " x " + ranks + " x " + accumulation;
    p.global_batch = checked_mul(p.batch, parts).value_or(-1);
    if (p.global_batch < 0) too_big("the global batch of " + factors);
    MNIST_CHECK(p.global_batch <= train_count, ExitCode::kUsage,
                "the global batch of " + std::to_string(p.global_batch) + " images (" + factors + ") is larger than " +
                    split + "; lower --batch-size" + (p.accumulation > 1 ? " or --accumulation-steps" : "") +
                    (world > 1 ? ", or use fewer ranks" : ""));
  }
  p.rank_images = images_in_parts(p.global_batch, parts, job.rank * p.accumulation, p.accumulation);
  if (opt.exact_sums) {  // Note [Chunks of the global batch]: the model runs one chunk at a time
    p.exact_chunk = opt.exact_chunk > 0 ? opt.exact_chunk : default_exact_chunk(p.global_batch);
    p.my_chunks = rank_chunks(p.global_batch, p.exact_chunk, world, job.rank);
    p.batch = p.exact_chunk;
    p.rank_images = p.my_chunks.count * p.exact_chunk;
  }
  MNIST_CHECK(p.batch <= std::numeric_limits<int>::max(), ExitCode::kUsage,
              "a batch of " + std::to_string(p.batch) +
                  " images per rank is more than this program can hold; give a "
                  "smaller --batch-size or --global-batch-size");
}

}  // namespace

RunPlan plan_run(const Options& opt, const JobFacts& job) {
  RunPlan p;
  const CodecChoice codec = find_codec(opt.grad_compression);  // an unknown gradient codec is a usage error
  // --shard-optimizer auto: sharded on the CPU with 2 or more ranks (Note [Sharded optimiser state]
  // in include/mnist_mpi/train/optimizer.hpp); the CUDA path shards only when asked, until NCCL's
  // reduce-scatter and all-gather have run across two GPUs (on one GPU: docs/gpu.md). Not with a
  // codec that compresses: its sums reach every rank whole (or in bf16), and the sharded
  // optimiser's allgather would put every parameter back on the wire as a float each step (at
  // 1 Gbit/s that allgather was most of lenet's PowerSGD step: bench/network.sh).
  p.sharded = opt.shard_optimizer == Options::Sharding::kOn ||
              (opt.shard_optimizer == Options::Sharding::kAuto && !job.cuda && job.world > 1 &&
               codec.row->name == std::string_view("none"));
  resolve_batch_sizes(opt, job, p);
  check_global_batch(job.train_count, p.global_batch);
  p.steps_per_epoch = job.train_count / p.global_batch;  // as the Sampler draws them (the last partial batch dropped)
  p.total_steps = opt.max_steps > 0 ? opt.max_steps : checked_mul(opt.epochs, p.steps_per_epoch).value_or(-1);
  MNIST_CHECK(p.total_steps >= 0, ExitCode::kUsage,
              "--epochs " + std::to_string(opt.epochs) + " is too large to train (it overflows a 64-bit count)");
  learning_rate(opt.schedule, 0, 0, p.total_steps);  // validates the schedule's name
  p.compression_start_step = opt.compression_start_steps >= 0 ? opt.compression_start_steps : p.total_steps / 10;
  p.threads = opt.threads;
  if (opt.exact_sums) p.threads = 1;  // one thread per rank: more are refused (config/combinations.cpp)
  if (p.threads == 0) p.threads = job.local_size > 1 ? 1 : static_cast<int>(std::max(1u, job.hardware_threads));
  return p;
}

}  // namespace mnist_mpi
