// The plan of one rank's run: from the options and the plain facts of the job (world size, rank,
// ranks on this host, the device kind, the training split's size), the sizes, steps and modes
// that the rest of the run is built from (include/mnist_mpi/train/rig.hpp). Pure: no MPI, no
// backend, no allocation of the run's; it raises the refusals of sizes that cannot work (exit
// code 2, each naming its factors and a fix), so they can be tested without a job.
#pragma once

#include <cstdint>

#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/data/sampler.hpp"  // ChunkRange

namespace mnist_mpi {

// What the plan needs to know of the job and the data.
struct JobFacts {
  int world = 1;
  int rank = 0;
  int local_size = 1;             // ranks on this host
  bool cuda = false;              // the chosen device is a GPU
  std::int64_t train_count = 0;   // images in the training split
  unsigned hardware_threads = 1;  // std::thread::hardware_concurrency() (0: unknown)
};

struct RunPlan {
  std::int64_t accumulation = 1;  // micro-batches per rank per step (--accumulation-steps)
  // The batch the training model is built for: the largest per-rank micro-batch (Note [Uneven
  // slices] in include/mnist_mpi/data/sampler.hpp), or with --exact-sums the chunk.
  std::int64_t batch = 0;
  std::int64_t global_batch = 0;
  std::int64_t rank_images = 0;  // images this rank takes per step
  // --exact-sums (Note [Chunks of the global batch]): the chunk and this rank's chunks; 0 and
  // empty otherwise.
  std::int64_t exact_chunk = 0;
  ChunkRange my_chunks;
  std::int64_t steps_per_epoch = 0, total_steps = 0;
  std::int64_t compression_start_step = 0;  // --compression-start-steps, resolved (-1: total_steps / 10)
  bool sharded = false;  // --shard-optimizer, resolved (auto: on for the CPU with 2 or more ranks)
  int threads = 1;       // compute threads per rank (CPU)

  bool exact() const { return exact_chunk > 0; }
  std::int64_t chunks() const { return exact() ? global_batch / exact_chunk : 0; }  // per global step
};

// Throws Error(kUsage) for sizes that cannot be trained: a global batch smaller than the
// micro-batches or larger than the training split, a product that overflows, a per-rank batch
// that does not fit an int, a chunk that does not divide the global batch, --epochs too large.
RunPlan plan_run(const Options& options, const JobFacts& job);

}  // namespace mnist_mpi
