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
//   - the fixed-point codec (src/train/codecs/fixed_point_codec.cpp, --exact-sums): the 64-bit
//     integers ExactSums made of the bucket's chunks, summed exactly; the last bucket's codec also
//     sums the counters that decide whether the step stands, which is why its floats are made
//     back by ExactSums::to_float once every bucket is in, not by finish().
// A new codec is one new file here plus its row in kCodecs (src/train/codecs/codecs.cpp) and in
// the options (docs/style.md, "A new gradient codec"). A codec that keeps state across steps (a
// residual, factors) keeps it per bucket, made at construction: nothing is allocated per step.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>

#include "mnist_mpi/comm/communicator.hpp"

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

// The codecs a user picks by name (the default "none": the float codec).
struct CodecRow {
  std::string_view name;
  std::string_view summary;  // for --help and messages
  CodecFactory (*make)();
  double wire_bytes = 4;  // bytes on the wire per gradient element (the metrics' reduced_bytes_per_step)
};
// The row of `name`; a usage error naming the choices otherwise.
const CodecRow& find_codec(std::string_view name);

}  // namespace mnist_mpi
