// TensorBoard event files written without TensorFlow: TFRecord framing (length, masked CRC32C of
// the length, an Event protobuf, masked CRC32C of it) around Event { wall_time = 1, step = 2,
// file_version = 3 | summary = 5 } and Summary { repeated Value { tag = 1, simple_value = 2 } }.
// Used by rank 0 for --tensorboard-dir; `tensorboard --logdir DIR` shows the scalars.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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
  // Creates dir (and its parents) and the file events.out.tfevents.<unix seconds>.<host>.<pid>
  // in it, and writes the file_version record. Throws Error(kUsage) naming dir when it cannot.
  TensorBoardWriter(const std::string& dir, const std::string& host);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event at `step` holding every (tag, value) pair as a simple_value scalar; flushed, so a
  // running TensorBoard sees it. A failed write warns once on stderr and disables the writer:
  // losing the event file must not end a training run.
  void scalars(std::int64_t step, const std::vector<std::pair<std::string_view, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void write_event(const ProtoWriter& event);

  std::string path_;
  std::FILE* file_ = nullptr;
  ProtoWriter event_, summary_, value_;  // reused: their buffers grow to the largest event once
  std::string record_;
};

}  // namespace mnist_mpi
