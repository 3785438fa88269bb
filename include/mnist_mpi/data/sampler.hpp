// The sampler: one global permutation of the training split per epoch, a pure function of
// (seed, epoch). Global step s of an epoch covers permutation positions [s*B, (s+1)*B); rank r
// takes the r-th contiguous slice of it (Note [Uneven slices]). The last partial batch is dropped.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace mnist_mpi {

// Which images one micro-batch of one rank takes: positions [position, position + count) of the
// permutation of `epoch`; `first` is where they start within the global batch (the dropout masks
// are keyed by it: Note [Dropout masks do not depend on the rank]).
struct Slice {
  std::int64_t epoch = 0, position = 0, first = 0, count = 0;
};

// Note [Uneven slices]
// A global batch of B images is cut into `parts` contiguous micro-batches (parts = world x K,
// Note [Micro-batches and positions]): part p takes floor(B / parts) images, and the first
// B mod parts parts one more, so any B >= parts works on any number of ranks (100 on 8 GPUs: four
// ranks take 13, four take 12). Nothing is re-weighted: every rank scales its loss gradient by
// 1 / B, the GLOBAL batch (Note [Averaging is a scaled sum]), so the sum over the ranks is the
// mean gradient of the global batch whatever the slices' sizes. A rank's model is built for the
// largest part; a shorter part leaves its last rows' loss gradient at zero (Step::run), and a zero
// row adds exactly nothing to any sum of the backward pass.
inline std::int64_t part_count(std::int64_t global_batch, std::int64_t parts, std::int64_t part) {
  return global_batch / parts + (part < global_batch % parts ? 1 : 0);
}
inline std::int64_t part_first(std::int64_t global_batch, std::int64_t parts, std::int64_t part) {
  return part * (global_batch / parts) + (part < global_batch % parts ? part : global_batch % parts);
}
inline std::int64_t largest_part(std::int64_t global_batch, std::int64_t parts) {
  return global_batch / parts + (global_batch % parts != 0 ? 1 : 0);
}
// The images of parts [first, first + n), the sum of their part_count.
inline std::int64_t images_in_parts(std::int64_t global_batch, std::int64_t parts, std::int64_t first, std::int64_t n) {
  const std::int64_t longer = global_batch % parts - first;  // of these n, the parts that take one more
  return n * (global_batch / parts) + (longer < 0 ? 0 : longer > n ? n : longer);
}

// Note [Chunks of the global batch]
// --exact-sums (include/mnist_mpi/train/exact_sums.hpp): the global batch of B images is cut into B / c
// chunks of c images in global order, and every kernel runs with batch c, so that a chunk's
// gradient is the same bits on whichever rank computes it; the chunks' gradients are then summed
// exactly (Note [Exact sums in fixed point] in include/mnist_mpi/exact_sum.hpp). Each rank owns
// whole chunks, contiguous and as evenly as it goes (the Note [Uneven slices] rule over chunks),
// so the largest world size is the number of chunks.
struct ChunkRange {
  std::int64_t first = 0, count = 0;  // chunks [first, first + count) of the global batch
};
// Rank `rank`'s chunks. Throws Error(kUsage) when `chunk` does not divide the global batch, or the
// world is larger than the number of chunks (the message says the largest world allowed).
ChunkRange rank_chunks(std::int64_t global_batch, std::int64_t chunk, std::int64_t world, std::int64_t rank);

// Throws Error(kUsage) unless 0 < global_batch <= dataset_size: the Sampler's own check, for a
// plan made before the Sampler (include/mnist_mpi/train/run_plan.hpp).
void check_global_batch(std::int64_t dataset_size, std::int64_t global_batch);

class Sampler {
 public:
  Sampler(std::int64_t dataset_size, std::int64_t global_batch, std::uint64_t seed);
  std::int64_t steps_per_epoch() const { return dataset_size_ / global_batch_; }
  // Note [Micro-batches and positions]
  // The global batch is cut into parts = world x K equal micro-batches (K = --accumulation-steps);
  // rank r's micro-batch m is part r*K + m, so 1 rank with K = 2 sees exactly the samples (and
  // dropout keys) that 2 ranks with K = 1 see. `step` counts from the run's start.
  Slice slice(std::int64_t step, std::int64_t part, std::int64_t parts) const;
  // The whole permutation of `epoch` (a view of a buffer made at construction, valid until an
  // other epoch is asked for); step s, offset o of that epoch reads positions s*B + o onwards.
  std::span<const std::int64_t> order(std::int64_t epoch);
  // The permutation of an epoch (a Fisher-Yates shuffle driven by counter-based randomness).
  static std::vector<std::int64_t> permutation(std::int64_t n, std::uint64_t seed, std::int64_t epoch);
  static void permute(std::span<std::int64_t> p, std::uint64_t seed, std::int64_t epoch);  // in place

 private:
  std::int64_t dataset_size_, global_batch_;
  std::uint64_t seed_;
  std::int64_t epoch_ = -1;
  std::vector<std::int64_t> perm_;  // of epoch_
};

}  // namespace mnist_mpi
