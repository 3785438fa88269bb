// TensorBoard event files written without TensorFlow: TFRecord framing (length, masked CRC32C of
// the length, an Event protobuf, masked CRC32C of it) around Event { wall_time = 1, step = 2,
// file_version = 3 | summary = 5 } and Summary { repeated Value { tag = 1, simple_value = 2 } }.
// Used by rank 0 for --tensorboard-dir; `tensorboard --logdir DIR` shows the scalars.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mnist_mpi/report/output.hpp"
#include "mnist_mpi/report/protobuf.hpp"

namespace mnist_mpi {

// One TFRecord: the frame around `payload` (exposed for tests and other record writers), into out
// (cleared first; its capacity is reused).
void tfrecord_frame(std::string_view payload, std::string& out);
inline std::string tfrecord_frame(std::string_view payload) {
  std::string out;
  tfrecord_frame(payload, out);
  return out;
}

class TensorBoardWriter {
 public:
  static constexpr const char* kFilePrefix = "events.out.tfevents.";

  // Creates dir (and its parents) and the file events.out.tfevents.<unix seconds>.<host>.<pid>
  // in it, and writes the file_version record. Throws Error(kUsage) naming dir when it cannot
  // (dir is not a directory and cannot be made one, or the file cannot be created).
  TensorBoardWriter(const std::string& dir, const std::string& host);
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event at `step` holding every (tag, value) pair as a simple_value scalar; flushed, so a
  // running TensorBoard sees it. A failed write warns once on stderr and disables the writer:
  // losing the event file must not end a training run (Note [When an output cannot be written]).
  void scalars(std::int64_t step, const std::vector<std::pair<std::string_view, double>>& values);
  // At the end of the run: false when the file was lost (then or earlier).
  bool close() { return file_->close(); }
  bool failed() const { return file_->failed(); }
  std::string lost() const { return file_->lost(); }
  const std::string& path() const { return file_->path(); }

 private:
  void write_event(const ProtoWriter& event);

  std::optional<OutputFile> file_;       // always engaged once constructed
  ProtoWriter event_, summary_, value_;  // reused: their buffers grow to the largest event once
  std::string record_;
};

}  // namespace mnist_mpi
