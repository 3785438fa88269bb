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
#include "mnist_mpi/function_ref.hpp"
#include "mnist_mpi/backend/optimizer_pass.hpp"

namespace mnist_mpi {

class Backend;
class Buffer;
class Communicator;
class HostCopy;
class ParameterStore;

// A range of the flat parameter buffer, [begin, end) in elements.
struct ParamRange {
  std::int64_t begin = 0, end = 0;
};

// One parameter tensor of the flat buffer, as LAMB sees it (Note [LAMB in two phases]): its range,
// and whether its step is scaled by its trust ratio (weights) or not (biases).
struct OptimizerTensor {
  std::int64_t begin = 0, end = 0;
  bool trust_ratio = true;
};

// Note [LAMB in two phases]
// LAMB (You et al. 2019) moves each parameter tensor by lr * r * u, where u is Adam's direction
// with PyTorch's bias correction plus the decoupled weight decay, u = m_hat / (sqrt(v_hat) + eps)
// + weight_decay * w, and r = ||w|| / ||u|| is the tensor's trust ratio (1 when either norm is 0).
// r needs the whole tensor's u, hence every bucket's sum (a bucket may cut a tensor, and a shard
// may hold any part of one: Note [Shards] in include/mnist_mpi/comm/communicator.hpp), so the
// update is two passes where Adam's is one (traits' two_phase). The optimiser owns the phases
// (Note [The optimiser's two moments in a step]); the step does not ask which kind it runs:
//   1. update(), per bucket as its sum arrives: the moments, u written over the gradient (its
//      range is not read again in the step), and ||w||^2 and ||u||^2 of the range added, exactly,
//      to its tensor's sums (Note [Exact squared norms] in include/mnist_mpi/exact_norm.hpp);
//   2. finish_first_phase() after the last bucket: sharded, the ranks' sums are added with one
//      int64 allreduce (exact, so in any order); then each tensor's rate lr * r, in double,
//      rounded to float once;
//   3. update_second() over the same ranges: params -= rate * u, with the bf16 copies, and then
//      (sharded) the parameters' gathers.
// The sums are integers, so a tensor's norms, hence its rate and its new parameters, are the same
// bits whatever the buckets, the shards and the number of ranks: sharded and unsharded runs agree
// bit for bit, and with --exact-sums (the same gradients on any number of ranks) so do runs on
// 1, 2 or 3 ranks.
// Biases take no trust ratio (r = 1: a plain Adam-like step of lr * u). They start at zero, where
// r = ||w|| / ||u|| = 0 would leave them there but for the r = 1 rule, and then at ||w|| of about
// lr * ||u|| the ratio would shrink their steps to about lr^2: they would barely learn. The LAMB
// of the BERT recipe (and TensorFlow Addons' exclude_from_layer_adaptation) leaves biases out of
// the layer adaptation for the same reason. The weight decay applies to every tensor, as with
// --weight-decay for adam and sgd.

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
  // State allocated by the backend (device memory on a GPU), the pass run by it. With a store
  // (may be null), the parameters updated are the store's, and the pass reports every write to it
  // (Note [The parameters and their copies] in include/mnist_mpi/backend/parameter_store.hpp).
  Optimizer(const OptimizerConfig& cfg, std::int64_t count, Backend& backend, ParameterStore* store = nullptr);
  // The same for this rank's ranges alone (Note [Sharded optimiser state]): every_rank[r] holds rank
  // r's owned ranges (ascending, disjoint, non-empty; none at all when r owns no element), and
  // this rank is `rank`; rank 0 puts every rank's moments in place for a checkpoint.
  Optimizer(const OptimizerConfig& cfg, std::int64_t count, Backend& backend,
            std::vector<std::vector<ParamRange>> every_rank, int rank, ParameterStore* store = nullptr);
  ~Optimizer();
  // params -= update(grads); count elements; lr for this step. params and grads in the memory of
  // the backend given at construction (host memory without one). The same as begin_step(lr)
  // followed by update() over [0, count) in any number of pieces (elementwise: the bits do not
  // depend on the pieces), which lets the trainer update each bucket as soon as its sum has arrived.
  // A two-phase kind (lamb) takes a copy of grads to write its direction over (update() writes it
  // over the gradients themselves).
  void step(float* params, const float* grads, double lr);
  // Counts the step (on a device: unless the guard refused it, Note [The optimiser's step count]).
  void begin_step(double lr);
  // [begin, end) must lie inside one owned range.
  // For a two-phase kind this is the first phase (Note [LAMB in two phases]): the parameters are
  // not changed, grads[begin, end) becomes the direction.
  void update(float* params, float* grads, std::int64_t begin, std::int64_t end);

  // Note [The optimiser's two moments in a step]
  // The step hands the optimiser each bucket's sum as it arrives (on_bucket, after begin_step) and
  // then, once, the end of the step (finish_step), and asks nothing else: a one-phase kind (sgd,
  // adam) writes a bucket's parameters in on_bucket, which says so, so that their gathers start
  // at once (sharded); a two-phase kind (Note [LAMB in two phases]) takes its first phase there
  // and its norms and second phase in finish_step, which says which bucket it wrote (written(k))
  // as it goes. Before its norms' collective it asks the ranks to agree that the step stands
  // (agree(): false, the step is refused everywhere and nothing more is written).
  // r: inside one owned range. Returns whether the parameters of r were written.
  bool on_bucket(float* params, float* grads, ParamRange r);
  // ranges: each bucket's range given to on_bucket (in bucket order); comm: the communicator over
  // whose ranks they are shards (null when every rank holds every sum). Returns the seconds spent
  // waiting in a collective.
  double finish_step(float* params, float* grads, std::span<const ParamRange> ranges, Communicator* comm,
                     FunctionRef<bool()> agree, FunctionRef<void(std::size_t)> written);

  // Note [LAMB in two phases]. True when the step must call finish_first_phase() once every
  // bucket's update() is done, and then update_second() over the same ranges.
  bool two_phase() const { return traits(cfg_.kind).two_phase; }
  // The tensors of the flat buffer (ascending, covering [0, count) without gaps); without a call,
  // one tensor [0, count) with a trust ratio. Before the first step.
  void set_tensors(std::vector<OptimizerTensor> tensors);
  // This rank's squared norms of the step's first phase as int64 limbs (cleared where they are
  // kept); to be summed over the ranks that share the tensors, then given to finish_first_phase.
  std::span<std::int64_t> take_norm_sums();
  // The trust ratios and rates from the norms summed over every rank (all of them: unsharded,
  // this rank's own sums).
  void finish_first_phase(std::span<const std::int64_t> summed);
  // The same with the sum done here: comm null unsharded, else an allreduce on comm (collective).
  // Returns the seconds spent in the allreduce.
  double finish_first_phase(Communicator* comm);
  // The second phase: params[begin, end) -= rate * u.
  void update_second(float* params, const float* u, std::int64_t begin, std::int64_t end);
  // The trust ratio of tensor t at the last finish_first_phase (tests, reports).
  double trust_ratio_of(std::size_t t) const { return per_tensor_.ratios.at(t); }
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
  // Calls f(t, lo, hi) for each tensor t's part [lo, hi) of [begin, end), in order.
  template <typename F>
  void for_tensor_parts(std::int64_t begin, std::int64_t end, F&& f) const;

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
  // The tensors (set_tensors) and, for two-phase kinds (Note [LAMB in two phases]), their norms
  // and trust ratios: one member, so that the optimiser's state reads as its few parts.
  struct PerTensor {
    std::vector<OptimizerTensor> ranges;
    std::vector<std::int64_t> slot;  // (ranges): the pass's norm slot, -1 without a trust ratio
    std::int64_t slots = 0;
    std::vector<std::int64_t> norm_sums;  // (slots, {w, u}, kNormWords)
    std::vector<double> ratios;           // (ranges) of the last finished first phase
    std::vector<float> rates;             // (ranges): lr * ratio
  };
  PerTensor per_tensor_;
  double lr_ = 0.0;                      // of the begun step
  std::vector<float> host_direction_;    // step()'s copy of the gradients, without a backend
  std::unique_ptr<Buffer> direction_;    // with one
  int phase_ = 0;                        // 1 after begin_step, 2 after finish_first_phase
};

// The learning rate at global step `step` (0-based) of `total_steps`, in epoch `epoch`.
double learning_rate(const ScheduleConfig& s, std::int64_t step, std::int64_t epoch, std::int64_t total_steps);

}  // namespace mnist_mpi
