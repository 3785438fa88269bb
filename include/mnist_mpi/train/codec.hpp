// What goes on the wire for a bucket of gradients: a GradientCodec. The reducer
// (include/mnist_mpi/train/reducer.hpp) owns one per bucket and knows nothing of what the codec
// sends; the codec knows nothing of buckets' order, overlap or the optimiser.
//
// Note [A gradient codec]
// A codec is bound to one bucket, a contiguous range of the flat gradient buffer, when the reducer
// is made. start() is called once backward has made every gradient of the range final: the codec
// encodes them (or not) and starts one or more collectives on the communicator, in the same order
// on every rank (Note [Buckets start in index order]). finish() waits for them and leaves in the
// range the summed gradient this rank receives: all of it, or with a sharded reducer
// (--shard-optimizer) its shard (Note [Shards]) at least. Codecs so far:
//   - the float codec (src/train/codecs/float_codec.cpp): the floats themselves, summed in place;
//   - the bf16 codec (src/train/codecs/bf16_codec.cpp, --grad-compression bf16): half the bytes,
//     each rank's rounding residual added to its next step's gradient;
//   - the PowerSGD codec (src/train/codecs/powersgd_codec.cpp, --grad-compression powersgd:RANK):
//     each weight matrix as two rank-RANK factors, in two collectives (Note [A codec's later
//     collectives]), with error feedback and a warm start;
//   - the fixed-point codec (src/train/codecs/fixed_point_codec.cpp, --exact-sums): the 64-bit
//     integers ExactSums made of the bucket's chunks, summed exactly; the last bucket's codec also
//     sums the counters that decide whether the step stands, which is why its floats are made
//     back by ExactSums::to_float once every bucket is in, not by finish().
// A new codec is one new file here plus its row in kCodecs (src/train/codecs/codecs.cpp) and in
// the options (docs/style.md, "A new gradient codec"). A codec that keeps state across steps (a
// residual, factors) keeps it per bucket, made at construction: nothing is allocated per step.
//
// Note [A codec's later collectives]
// A codec whose sum takes more than one collective, each made from the one before (PowerSGD sums
// its P factors, orthogonalises them, and only then can make and sum its Q factors), starts the
// first in start() and each later one in advance(). Collectives must start in the same order on
// every rank, so advance() is called only where every rank is at the same point of the same
// sequence: just before the reducer starts the next bucket (the bucket before it moves on while
// backward goes on), and for every bucket at the end of backward, before any wait or gather. A
// codec that is not in that state does nothing; finish() calls it too.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi {

class Backend;  // include/mnist_mpi/backend/backend.hpp

// What a codec is bound to: its bucket and where it is summed.
struct CodecBinding {
  Communicator* comm = nullptr;  // the gradient communicator
  Backend* backend = nullptr;    // whose memory holds the gradients (for a codec's own buffers); may be null
  std::span<float> grads;        // the bucket's gradients: [offset, offset + size) of the flat buffer
  std::int64_t offset = 0;       // of the bucket in the flat buffer
  std::int64_t total = 0;        // elements of the flat buffer
  bool sharded = false;          // a reduce-scatter: this rank needs only its shard of the sum
  Shard receives;                // the part of the bucket whose sum this rank receives (of grads)
  bool last = false;             // the step's last bucket (its codec may carry the step's extras)
};

class GradientCodec {
 public:
  virtual ~GradientCodec() = default;
  GradientCodec() = default;
  GradientCodec(const GradientCodec&) = delete;
  GradientCodec& operator=(const GradientCodec&) = delete;

  // The bucket's gradients are final: encode them and start their collectives.
  virtual void start() = 0;
  // Whether start() was called and finish() not yet.
  virtual bool in_flight() const = 0;
  // Waits for the collectives and decodes the sum this rank receives into the bucket's range.
  // completed (optional): when the wire finished, which may be before finish() returns.
  virtual void finish(std::chrono::steady_clock::time_point* completed) = 0;
  // What the codec keeps from step to step on this rank (a residual, factors), for checkpoints:
  // the same size at every step, in host memory; empty for a codec that keeps nothing.
  virtual std::span<float> state() { return {}; }
  // The trailing values of state() that are the same on every rank (PowerSGD's warm-start
  // factors): on another number of ranks every rank takes rank 0's (Note [Codec state on another
  // number of ranks] in src/train/reducer.cpp); the rest is the rank's own, summable.
  virtual std::int64_t shared_state_size() const { return 0; }
  // Called after a checkpoint's state was copied into state() (a codec whose state() is a copy).
  virtual void state_loaded() {}
  // Note [A codec's later collectives]: starts the next collective, if any.
  virtual void advance() {}
  // Called before each step's start() with the global step (a codec that starts compressing later).
  virtual void begin_step(std::int64_t /*step*/) {}
  // Bytes this rank sends into its collectives in a compressed step (the metrics'
  // reduced_bytes_per_step); 0: the codec does not say.
  virtual double wire_bytes() const { return 0; }
};

using CodecFactory = std::function<std::unique_ptr<GradientCodec>(const CodecBinding&)>;

// The float codec: the gradients summed as they are.
CodecFactory float_codec();
// The bf16 codec (--grad-compression bf16): bf16 on the wire, with error feedback (Note [bf16 on
// the wire with error feedback] in src/train/codecs/bf16_codec.cpp).
CodecFactory bf16_codec();
// The fixed-point codec (--exact-sums): integers holds ExactSums::fixed(), the flat buffer's
// integers and then its two counters.
CodecFactory fixed_point_codec(std::span<std::int64_t> integers);

// The PowerSGD codec (--grad-compression powersgd:RANK; Note [PowerSGD in this reducer] in
// src/train/codecs/powersgd_codec.cpp): the weight matrices of `tensors` (the model's, flat order)
// that fall in a bucket sent as rank-`rank` factors from global step `start_step` on, the floats
// before it; its first factors drawn from `seed`.
CodecFactory powersgd_codec(int rank, std::int64_t start_step, std::uint64_t seed, std::span<const ParamTensor> tensors);

// The auto codec's choice (Note [Choosing a codec per bucket from the link] in
// src/train/codecs/auto_codec.cpp): a link's cost of a sum, a bucket's costs under each codec.
inline constexpr int kAutoChoices = 3;  // none, bf16, powersgd: the order of less compression
struct LinkModel {
  double latency_s = 0, bytes_per_s = 0;  // a sum of B bytes takes latency_s + B / bytes_per_s
};
struct BucketCosts {
  double ready_s = 0;                           // when backward has made it final (after bucket 0)
  std::array<double, kAutoChoices> bytes{};     // on the wire under each codec
  std::array<int, kAutoChoices> collectives{};  // one sum each, PowerSGD two
};
// Per bucket, in start order, the codec (an index into none, bf16, powersgd): from none
// everywhere, the one change of one bucket that ends the last sum (each queued behind the one
// before) soonest, while a change cuts the time past backward's end (backward_s) by more than 2 %
// of it and of backward_s;
// then each bucket back to the least compression that ends the last sum no later.
std::vector<int> choose_codecs(const std::vector<BucketCosts>& buckets, double backward_s, LinkModel link);
// What the auto codec chose, once, for the banner and the metrics file.
struct CodecChoiceReport {
  std::int64_t step = 0;
  LinkModel link;
  double backward_s = 0;
  std::string text;                  // the line rank 0 prints
  std::vector<std::string> buckets;  // each bucket's codec ("none", "bf16", "powersgd:2")
};
using CodecReport = std::function<void(const CodecChoiceReport&)>;

// What a codec is made from besides its bucket: the choice's rank (powersgd:RANK), the run's
// facts.
struct CodecArgs {
  int rank = 0;                 // powersgd:RANK; 0 for a codec without one
  std::int64_t start_step = 0;  // --compression-start-steps, resolved
  std::uint64_t seed = 0;
  std::span<const ParamTensor> tensors;  // the model's, in flat order
  CodecReport report;                    // auto: told its choice (may be empty)
};
// The auto codec (--grad-compression auto[:RANK]): per bucket the float, bf16 or PowerSGD:RANK
// codec, chosen at the start step (at least the fifth) from the measured link and backward.
CodecFactory auto_codec(const CodecArgs& args);

// The codecs a user picks by name (the default "none": the float codec).
struct CodecRow {
  std::string_view name;
  std::string_view summary;  // for --help and messages
  CodecFactory (*make)(const CodecArgs&);
  int default_rank = 0;  // > 0: the name takes ":RANK" (this one when it is left out)
  bool starts_later = false;  // sends the floats before --compression-start-steps
};
// A --grad-compression value: its row and its rank.
struct CodecChoice {
  const CodecRow* row = nullptr;
  int rank = 0;
};
// The row of `text` ("bf16", "powersgd", "powersgd:2"); a usage error naming the choices, or
// what is wrong with the rank, otherwise.
CodecChoice find_codec(std::string_view text);
inline constexpr int kMaxPowerSgdRank = 32;

}  // namespace mnist_mpi
