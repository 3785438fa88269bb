// The timeline of every rank (--timeline FILE): each rank records spans (data, forward, each
// layer's backward, each bucket's allreduce, the wait for buckets, the optimiser, evaluation,
// checkpoint writes) into a buffer allocated once at start; at the end rank 0 gathers them all and
// writes one Chrome trace-event JSON file (Perfetto, chrome://tracing), one process row per rank.
// Recording is a bounds check and a store; when --timeline is off the trainer holds a null
// Timeline* and records nothing (Note [Timeline clocks] for how ranks' clocks are aligned).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/run_facts.hpp"

namespace mnist_mpi {

class OutputFile;

enum class SpanKind : std::uint8_t {
  kStep,        // a whole training step, data to optimiser
  kData,        // sampling and pixel conversion of one micro-batch
  kForward,     // forward and loss of one micro-batch
  kBackward,    // index >= 0: one layer's backward; -1: a whole micro-batch's backward (accumulation)
  kWait,        // index: waiting for that bucket's sum after backward
  kOptimizer,   // index: the update of that bucket's parameters
  kAllreduce,   // index: the bucket; from its start to when it was found complete
  kEvaluation,  // index: 0 validation, 1 test
  kCheckpoint,
  kCount
};
const char* span_name(SpanKind kind);

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  // capacity: spans this rank can hold (allocated now). layer_names label the backward spans.
  Timeline(int rank, std::size_t capacity, std::vector<std::string> layer_names);

  // Collective: measures this rank's clock offset to rank 0 and the common origin (Note [Timeline
  // clocks]). Call on every rank before recording.
  void align_clocks(Communicator& comm);

  void record(SpanKind kind, Clock::time_point begin, Clock::time_point end, std::int64_t step,
              std::int32_t index = -1) {
    if (size_ == spans_.size()) return full();
    spans_[size_++] = Span{ns(begin), ns(end), step, index, kind};
  }
  // Backward layer by layer: mark when backward starts, then layer_done(i) as each layer ends.
  void backward_starts(Clock::time_point t, std::int64_t step) {
    mark_ = t;
    step_ = step;
  }
  void layer_done(int layer) { record(SpanKind::kBackward, mark_, Clock::now(), step_, layer); }
  // After the reducer's work between two layers (starting buckets), which is not backward.
  void backward_resumes() { mark_ = Clock::now(); }
  // After the optimiser updated bucket k: the wait for its sum [waited_from, update_begin) and the
  // update [update_begin, update_end).
  void bucket_updated(std::int64_t step, std::size_t k, Clock::time_point waited_from, Clock::time_point update_begin,
                      Clock::time_point update_end) {
    record(SpanKind::kWait, waited_from, update_begin, step, static_cast<std::int32_t>(k));
    record(SpanKind::kOptimizer, update_begin, update_end, step, static_cast<std::int32_t>(k));
  }
  // The end of a step: every bucket's allreduce and the whole step [begin, end).
  void step_done(std::int64_t step, Clock::time_point begin, Clock::time_point end,
                 const std::vector<BucketTiming>& buckets) {
    for (std::size_t k = 0; k < buckets.size(); ++k)
      record(SpanKind::kAllreduce, buckets[k].start, buckets[k].end, step, static_cast<std::int32_t>(k));
    record(SpanKind::kStep, begin, end, step);
  }

  std::size_t size() const { return size_; }
  std::size_t capacity() const { return spans_.size(); }
  std::int64_t dropped() const { return dropped_; }

  // Collective: every rank sends its spans to rank 0, which writes the JSON file to `out` (rank 0's;
  // null on the others). A file that cannot be written is a lost output, reported by `out`, not an
  // error (Note [When an output cannot be written]).
  void gather_and_write(Communicator& comm, OutputFile* out, const std::string& host);

  // A span as stored and sent to rank 0: nanoseconds of this rank's steady clock.
  struct Span {
    std::int64_t begin_ns = 0, end_ns = 0;
    std::int64_t step = 0;
    std::int32_t index = -1;
    SpanKind kind = SpanKind::kStep;
  };

 private:
  static std::int64_t ns(Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }
  void full();

  int rank_;
  std::vector<Span> spans_;  // (capacity), allocated at construction
  std::size_t size_ = 0;
  std::int64_t dropped_ = 0;
  std::vector<std::string> layer_names_;
  Clock::time_point mark_{};
  std::int64_t step_ = 0;
  std::int64_t offset_ns_ = 0;  // this rank's clock minus rank 0's
  std::int64_t origin_ns_ = 0;  // rank 0's clock at time zero of the file
};

// How many spans a run needs: per step one step span, data + forward (+ backward) per micro-batch,
// one backward per layer, and per bucket its allreduce, the wait for it and its update; plus
// evaluations and room for checkpoints. Capped at kTimelineMaxSpans per rank, and at
// kTimelineMaxGathered over all `world` ranks, so that rank 0's gather stays within MPI's int
// counts and 1 GiB.
inline constexpr std::size_t kTimelineMaxSpans = std::size_t{1} << 20;     // 32 MiB per rank
inline constexpr std::size_t kTimelineMaxGathered = std::size_t{1} << 25;  // 1 GiB on rank 0
std::size_t timeline_capacity(std::int64_t steps, std::int64_t accumulation, std::size_t layers, std::size_t buckets,
                              std::int64_t evaluations, int world = 1);

}  // namespace mnist_mpi
