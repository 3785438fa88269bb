// The reducer: sums the flat gradient buffer across ranks in buckets, each a contiguous range of
// it (Note [Reverse layer order]), started as soon as backward has produced every gradient in it;
// the Communicator moves them on while backward goes on (the MPI one on a thread of its own), and
// the optimiser waits for each bucket only when it updates that bucket's parameters.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi {

struct Bucket {
  std::int64_t begin = 0, end = 0;  // elements of the flat gradient buffer
  int ready_after_layer = 0;        // final once backward has finished this layer (and all after it)
};

// Cuts [0, spec.param_count) into buckets of at most cap elements (the first one at most
// first_cap), whole tensors where they fit; a tensor larger than the cap is split across buckets.
std::vector<Bucket> plan_buckets(const ModelSpec& spec, std::int64_t cap, std::int64_t first_cap);

// When one bucket's sum started and when it completed (steady clock), for the last step.
struct BucketTiming {
  std::chrono::steady_clock::time_point start, end;
};

class Reducer {
 public:
  // overlap=false: one blocking sum of the whole buffer after backward (--no-overlap).
  Reducer(Communicator& comm, std::span<float> grads, std::vector<Bucket> buckets, bool overlap);

  // Call after backward finished `layer` (layers come in descending order): starts every bucket
  // whose gradients are now final, in index order.
  void on_layer_done(int layer);
  // Call after backward: starts what is left (--no-overlap: sums everything, blocking). Returns
  // the seconds it blocked.
  double start_remaining();
  // Waits for bucket k's sum; returns the seconds spent waiting. Each bucket once per step, after
  // start_remaining().
  double wait_bucket(std::size_t k);
  // start_remaining() and wait_bucket() for every bucket; returns the seconds spent waiting.
  double finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<BucketTiming>& bucket_timings() const { return timings_; }

 private:
  Communicator& comm_;
  std::span<float> grads_;
  std::vector<Bucket> buckets_;
  bool overlap_;
  std::vector<CommRequest> requests_;  // one per bucket, made once
  std::vector<BucketTiming> timings_;  // one per bucket, made once
  std::size_t next_ = 0;               // the next bucket to start
};

}  // namespace mnist_mpi
