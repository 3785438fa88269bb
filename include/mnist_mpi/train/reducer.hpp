// The reducer: sums the flat gradient buffer across ranks in buckets, each a contiguous range of
// it (Note [Reverse layer order]), started as soon as backward has produced every gradient in it
// and progressed between layers while backward goes on. Works on any Communicator.
#pragma once

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

class Reducer {
 public:
  // overlap=false: one blocking sum of the whole buffer after backward (--no-overlap).
  Reducer(Communicator& comm, std::span<float> grads, std::vector<Bucket> buckets, bool overlap);

  // Call after backward finished `layer` (layers come in descending order).
  void on_layer_done(int layer);
  // Starts what is left and waits for every bucket; returns the seconds spent waiting.
  double finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }

 private:
  void progress();

  Communicator& comm_;
  std::span<float> grads_;
  std::vector<Bucket> buckets_;
  bool overlap_;
  std::vector<CommRequest> requests_;  // one per bucket, made once
  std::size_t next_ = 0;               // the next bucket to start
};

}  // namespace mnist_mpi
