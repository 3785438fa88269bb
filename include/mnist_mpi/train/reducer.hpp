// The reducer: sums the flat gradient buffer across ranks in buckets, each a contiguous range of
// it (Note [Reverse layer order]), started as soon as backward has produced every gradient in it;
// the Communicator moves them on while backward goes on (the MPI one on a thread of its own), and
// the optimiser waits for each bucket only when it updates that bucket's parameters. What goes on
// the wire for a bucket is its codec's business (Note [A gradient codec] in
// include/mnist_mpi/train/codec.hpp): the reducer owns one per bucket and decides only when each
// starts and who waits for it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mnist_mpi/backend/step_guard.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/function_ref.hpp"
#include "mnist_mpi/run_facts.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/train/codec.hpp"
#include "mnist_mpi/train/optimizer.hpp"  // ParamRange

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
  // sharded_params (--shard-optimizer; Note [Sharded optimiser state] in
  // include/mnist_mpi/train/optimizer.hpp): the flat parameters. Then each bucket is
  // reduce-scattered instead of summed, so that only this rank's shard of it (shard()) holds the
  // summed gradient, and start_gather() hands the updated shards of a bucket's parameters to every
  // rank. --no-overlap then reduce-scatters every bucket, blocking, after backward.
  // codec: makes each bucket's codec (the float codec unless told); --no-overlap unsharded makes
  // one instead, over the whole buffer, which sums it in one go.
  Reducer(Communicator& comm, std::span<float> grads, std::vector<Bucket> buckets, bool overlap,
          std::span<float> sharded_params = {}, const CodecFactory& codec = float_codec(), Backend* backend = nullptr);

  // Call before the step's backward with its global step (a codec that starts compressing later).
  void begin_step(std::int64_t step);
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

  bool sharded() const { return !params_.empty(); }
  // The part of bucket k whose sum this rank receives and whose parameters it updates (flat
  // offsets; may be empty): all of it unsharded, its shard (Note [Shards]) sharded.
  ParamRange shard(std::size_t k) const { return mine_[k]; }  // made at construction
  ParamRange shard(std::size_t k, int rank) const;            // rank's part of bucket k
  // Every bucket's non-empty shard of this rank (or of `rank`), in order: the optimiser's owned ranges.
  std::vector<ParamRange> owned() const;
  std::vector<ParamRange> owned(int rank) const;
  // Every bucket's part (shard(k)), in bucket order: what the optimiser updates.
  std::span<const ParamRange> shards() const { return mine_; }
  // Sharded: the communicator over whose ranks shards() are shards; null unsharded.
  Communicator* shards_communicator() const { return sharded() ? &comm_ : nullptr; }
  // Sharded: starts the allgather of bucket k's parameters (this rank's shard updated), buckets
  // in index order once a step each; unsharded nothing (every rank updated every bucket).
  void start_gather(std::size_t k);
  // Sharded: waits for every started gather; returns the seconds spent waiting. After it every
  // rank holds every updated parameter.
  double wait_gathers();
  // The end of a step's gathers: starts those not started yet (buckets not updated: their bits
  // are the same on every rank), waits for all, and calls others_wrote(begin, end) for each range
  // of parameters the other ranks wrote (for the parameter store's report). Returns the seconds
  // spent waiting; unsharded nothing.
  double finish_gathers(FunctionRef<void(std::int64_t, std::int64_t)> others_wrote);
  // Whether the step stands on every rank (Note [Non-finite steps]): sharded, each rank checked
  // only its shards, so the guard's verdicts are agreed on, once a step (the first call; later
  // ones give its answer); unsharded every rank checked every sum: true, nothing collective.
  bool agree(StepGuard& guard);

  // The codecs' state from step to step (GradientCodec::state), every bucket's in bucket order:
  // its size, a copy into out (codec_state_size() floats), and a checkpoint's put back.
  std::int64_t codec_state_size() const;
  std::int64_t codec_shared_state_size() const;  // of it, the last values, the same on every rank
  void save_codec_state(std::span<float> out) const;
  void load_codec_state(std::span<const float> in);
  // For a checkpoint (collective): every rank's codec state to rank root, in rank order, which
  // gathered_codec_state() then holds there (empty elsewhere, and when the codecs keep none).
  void gather_codec_state(int root);
  std::span<const float> gathered_codec_state() const { return codec_all_; }
  // A checkpoint's codec states (`ranks` of them, in rank order) put back, by Note [Codec state
  // on another number of ranks]; a run whose codecs keep none ignores them. Throws
  // Error(kCheckpoint) when a state's size is not this run's.
  void restore_codec_state(std::int64_t ranks, std::int64_t shared, std::span<const float> all);

  // Bytes a rank sends into the gradient sums in a step, by its codecs (0 where one does not say).
  double wire_bytes() const;

  const std::vector<Bucket>& buckets() const { return buckets_; }
  Communicator& communicator() const { return comm_; }
  const std::vector<BucketTiming>& bucket_timings() const { return timings_; }

 private:
  void start_ready(int layer);  // starts every bucket final after `layer`, in index order
  std::span<float> range(std::int64_t begin, std::int64_t end) const;  // of grads_
  void for_each_codec(FunctionRef<void(GradientCodec&)> f) const;   // whole_'s, or every bucket's
  void codec_state_parts(FunctionRef<void(std::span<float>, std::size_t)> copy) const;

  Communicator& comm_;
  std::span<float> grads_;
  std::vector<Bucket> buckets_;
  std::vector<ParamRange> mine_;  // shard(k, this rank) per bucket: computed once, read every step
  bool overlap_;
  std::span<float> params_;                             // sharded: the parameters to gather; empty otherwise
  std::vector<std::unique_ptr<GradientCodec>> codecs_;  // one per bucket, made once (none with whole_)
  std::unique_ptr<GradientCodec> whole_;                // --no-overlap unsharded: the whole buffer's, alone
  std::vector<CommRequest> gathers_;                    // sharded: one per bucket
  std::vector<BucketTiming> timings_;  // one per bucket, made once
  std::size_t next_ = 0;               // the next bucket to start
  std::size_t next_gather_ = 0;        // sharded: the next bucket whose gather starts
  bool agreed_ = false, verdict_ = true;  // this step's agreement (agree())
  std::vector<float> codec_mine_, codec_all_;       // gather_codec_state's buffers, kept
  std::vector<std::uint8_t> codec_bytes_;
  std::vector<std::int64_t> codec_counts_;
};

}  // namespace mnist_mpi
