// The per-epoch global permutation and each rank's contiguous slice of a global batch.
#include "mnist_mpi/data/sampler.hpp"

#include <numeric>
#include <utility>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/rng.hpp"

namespace mnist_mpi {

// Note [Chunks of the global batch] (include/mnist_mpi/data/sampler.hpp)
ChunkRange rank_chunks(std::int64_t global_batch, std::int64_t chunk, std::int64_t world, std::int64_t rank) {
  MNIST_CHECK(chunk > 0 && global_batch > 0 && global_batch % chunk == 0, ExitCode::kUsage,
              "a chunk of " + std::to_string(chunk) + " images does not divide the global batch of " +
                  std::to_string(global_batch) + "; give a chunk size that divides it");
  const std::int64_t chunks = global_batch / chunk;
  MNIST_CHECK(world >= 1 && world <= chunks, ExitCode::kUsage,
              std::to_string(world) + " ranks are more than the " + std::to_string(chunks) + " chunks of " +
                  std::to_string(chunk) + " images in the global batch of " + std::to_string(global_batch) +
                  ": run on at most " + std::to_string(chunks) + " ranks, or use smaller chunks");
  MNIST_CHECK(rank >= 0 && rank < world, ExitCode::kRuntime, "rank_chunks: rank outside the world");
  return {part_first(chunks, world, rank), part_count(chunks, world, rank)};
}

void check_global_batch(std::int64_t dataset_size, std::int64_t global_batch) {
  MNIST_CHECK(global_batch > 0 && global_batch <= dataset_size, ExitCode::kUsage,
              "the global batch (" + std::to_string(global_batch) + " images) is larger than the training split (" +
                  std::to_string(dataset_size) + " images); lower --batch-size / --global-batch-size");
}

Sampler::Sampler(std::int64_t dataset_size, std::int64_t global_batch, std::uint64_t seed)
    : dataset_size_(dataset_size), global_batch_(global_batch), seed_(seed) {
  check_global_batch(dataset_size, global_batch);
  perm_.resize(static_cast<std::size_t>(dataset_size));
}

std::vector<std::int64_t> Sampler::permutation(std::int64_t n, std::uint64_t seed, std::int64_t epoch) {
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  permute(p, seed, epoch);
  return p;
}

void Sampler::permute(std::span<std::int64_t> p, std::uint64_t seed, std::int64_t epoch) {
  const auto n = static_cast<std::int64_t>(p.size());
  std::iota(p.begin(), p.end(), 0);
  for (std::int64_t i = n - 1; i > 0; --i) {
    const std::uint64_t h = rng::key(seed, 0x5A3, static_cast<std::uint64_t>(epoch), static_cast<std::uint64_t>(i));
    const auto j = static_cast<std::int64_t>(h % static_cast<std::uint64_t>(i + 1));
    std::swap(p[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(j)]);
  }
}

std::span<const std::int64_t> Sampler::order(std::int64_t epoch) {
  if (epoch != epoch_) {  // once per epoch, into the buffer made at construction
    permute(perm_, seed_, epoch);
    epoch_ = epoch;
  }
  return perm_;
}

Slice Sampler::slice(std::int64_t step, std::int64_t part, std::int64_t parts) const {
  const std::int64_t spe = steps_per_epoch();
  Slice s;
  s.epoch = step / spe;
  s.first = part_first(global_batch_, parts, part);  // Note [Uneven slices]
  s.position = (step % spe) * global_batch_ + s.first;
  s.count = part_count(global_batch_, parts, part);
  return s;
}

}  // namespace mnist_mpi
