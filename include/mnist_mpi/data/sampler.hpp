// The sampler: one global permutation of the training split per epoch, a pure function of
// (seed, epoch). Global step s of an epoch covers permutation positions [s*B, (s+1)*B); rank r
// takes the r-th contiguous slice of b = B / world images. The last partial batch is dropped.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace mnist_mpi {

class Sampler {
 public:
  Sampler(std::int64_t dataset_size, std::int64_t global_batch, std::uint64_t seed);
  std::int64_t steps_per_epoch() const { return dataset_size_ / global_batch_; }
  // Dataset indices of rank `rank`'s slice of global step `step` (counted from the run's start),
  // `count` of them starting at position `offset` within the global batch.
  void indices(std::int64_t step, std::int64_t offset, std::int64_t count, std::int64_t* out);
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
