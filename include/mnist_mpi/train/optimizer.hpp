// The optimiser of the training loop: its state buffers (whole, or this rank's shards), the
// step's update in pieces as the buckets' sums arrive, checkpoint state in and out; the
// arithmetic is the backend's fused pass (include/mnist_mpi/backend/optimizer_pass.hpp). And the
// learning-rate schedules (constant, step decay per epoch with a floor, cosine; linear warm-up).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mnist_mpi/config/optimizer_config.hpp"
#include "mnist_mpi/backend/optimizer_pass.hpp"

namespace mnist_mpi {

class Backend;
class Buffer;
class Communicator;
class HostCopy;

// A range of the flat parameter buffer, [begin, end) in elements.
struct ParamRange {
  std::int64_t begin = 0, end = 0;
};

// Note [Sharded optimiser state]
// With --shard-optimizer each rank updates only its shard of every bucket (Note [Shards] in
// include/mnist_mpi/comm/communicator.hpp) and holds the moments of those elements alone: the
// optimiser is given the ranges it owns, in flat order, and its m and v are those ranges packed
// one after another (state_size() elements, about count / world). update() takes flat offsets
// and finds the state of its range; the arithmetic per element is the unsharded one, so the
// updated parameters are the same bits. The step count is not sharded: every rank counts every
// step. Checkpoints hold full-size moments (docs/checkpoint.md): the trainer gathers the ranges
// of every rank to rank 0 (Reducer::shard tells where each packed element belongs), and restore() takes
// full-size moments and keeps its own ranges, so a checkpoint resumes sharded or not, on any
// number of ranks.
class Optimizer {
 public:
  // State in host memory, the pass on the host.
  Optimizer(const OptimizerConfig& cfg, std::int64_t count);
  // State allocated by the backend (device memory on a GPU), the pass run by it.
  Optimizer(const OptimizerConfig& cfg, std::int64_t count, Backend& backend);
  // The same for this rank's ranges alone (Note [Sharded optimiser state]): every_rank[r] holds rank
  // r's owned ranges (ascending, disjoint, non-empty; none at all when r owns no element), and
  // this rank is `rank`; rank 0 puts every rank's moments in place for a checkpoint.
  Optimizer(const OptimizerConfig& cfg, std::int64_t count, Backend& backend,
            std::vector<std::vector<ParamRange>> every_rank, int rank);
  ~Optimizer();
  // params -= update(grads); count elements; lr for this step. params and grads in the memory of
  // the backend given at construction (host memory without one). The same as begin_step(lr)
  // followed by update() over [0, count) in any number of pieces (elementwise: the bits do not
  // depend on the pieces), which lets the trainer update each bucket as soon as its sum has arrived.
  void step(float* params, const float* grads, double lr);
  // Counts the step (on a device: unless the guard refused it, Note [The optimiser's step count]).
  void begin_step(double lr);
  // [begin, end) must lie inside one owned range.
  // bf16_copy (may be null): where the new params[begin, end) also go as bf16, in the same pass.
  void update(float* params, const float* grads, std::int64_t begin, std::int64_t end,
              std::uint16_t* bf16_copy = nullptr);
  std::int64_t steps_taken() const;  // a synchronisation on a device
  // State, for checkpoints: the moment buffers (sgd: momentum only, second empty), in the
  // backend's memory (copy through Backend::download on a GPU), and the step count. Each holds
  // state_size() elements: the owned ranges, packed.
  std::span<float> first_moment() { return m_; }
  std::span<float> second_moment() { return v_; }
  const OptimizerConfig& config() const { return cfg_; }
  int moments() const { return traits(cfg_.kind).moments; }  // 1 (first only) or 2
  std::int64_t count() const { return count_; }
  std::int64_t state_size() const { return state_size_; }
  // Puts back a checkpoint's state from host memory: m and v of count() elements, in flat order
  // (v ignored for sgd), of which this optimiser keeps its owned ranges (uploaded when the state
  // lives on a device); and the step count.
  void restore(const float* m, const float* v, std::int64_t steps_taken);
  // For a checkpoint. Collective when sharded (every rank's moments to rank 0, which puts each
  // rank's ranges where they belong: the checkpoint's full-size layout); unsharded, nothing
  // collective. Then, on rank 0, checkpoint_moments() gives the full moments in host memory, in
  // flat order (brought from the backend now: Note [Host copies]); second is null for sgd.
  void gather_state(Communicator& comm);
  struct Moments {
    const float* first = nullptr;
    const float* second = nullptr;
  };
  Moments checkpoint_moments();

 private:
  // The state offset of update()'s range: where its owned range's moments start.
  std::int64_t state_offset(std::int64_t begin, std::int64_t end) const;

  OptimizerConfig cfg_;
  std::int64_t count_;
  std::vector<ParamRange> owned_;           // ascending; [0, count) unsharded
  std::vector<std::vector<ParamRange>> every_rank_;  // sharded: every rank's owned_, for gather_state
  std::vector<std::int64_t> owned_offset_;  // (owned_.size()): where each range's state starts
  std::int64_t state_size_ = 0;             // the sum of the owned ranges' sizes
  std::int64_t begun_ = 0;  // begin_step calls since construction or restore (a check of update's caller)
  Backend* backend_ = nullptr;
  std::unique_ptr<OptimizerPass> pass_;  // the backend's (the host's without one): the count and the arithmetic
  std::vector<float> host_m_, host_v_;     // without a backend; allocated once, here
  std::unique_ptr<Buffer> buf_m_, buf_v_;  // with one
  std::span<float> m_, v_;
  std::unique_ptr<HostCopy> host_state_;  // m_ and v_ in host memory (with a backend; made once)
  std::vector<float> full_[2];            // sharded, rank 0: the gathered full-size moments
  std::vector<std::uint8_t> gathered_;    // sharded: the gather's buffer, kept for the next checkpoint
  std::vector<std::int64_t> gathered_counts_;
};

// The learning rate at global step `step` (0-based) of `total_steps`, in epoch `epoch`.
double learning_rate(const ScheduleConfig& s, std::int64_t step, std::int64_t epoch, std::int64_t total_steps);

}  // namespace mnist_mpi
