// TensorBoard event files (see include/mnist_mpi/report/tensorboard.hpp). The record format is
// TensorFlow's TFRecord: uint64 length, uint32 masked crc32c(length bytes), the data, uint32
// masked crc32c(data), all little-endian.
#include "mnist_mpi/report/tensorboard.hpp"

#include <unistd.h>

#include <chrono>
#include <filesystem>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/crc32c.hpp"
#include "mnist_mpi/io/file_kind.hpp"

namespace mnist_mpi {
namespace {

template <class U>
void put_le(std::string& out, U v) {
  for (std::size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

void tfrecord_frame(std::string_view payload, std::string& out) {
  out.clear();
  put_le(out, static_cast<std::uint64_t>(payload.size()));
  put_le(out, crc32c_masked(crc32c(out.data(), 8)));
  out.append(payload);
  put_le(out, crc32c_masked(crc32c(payload.data(), payload.size())));
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, const std::string& host) {
  const FileKind kind = file_kind(dir);
  MNIST_CHECK(kind == FileKind::kMissing || kind == FileKind::kDirectory, ExitCode::kUsage,
              "--tensorboard-dir " + quote_input(dir) + " is " + describe_path(dir) +
                  ", not a directory; give a directory (it is created when missing)");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MNIST_CHECK(!ec && std::filesystem::is_directory(dir), ExitCode::kUsage,
              "--tensorboard-dir: cannot create the directory '" + dir + "'" + (ec ? " (" + ec.message() + ")" : "") +
                  "; give a writable directory");
  const double now = unix_seconds();
  const std::string name = kFilePrefix + std::to_string(static_cast<long long>(now)) + "." + host + "." +
                           std::to_string(::getpid());
  const std::string path = (std::filesystem::path(dir) / name).string();
  file_.emplace("the TensorBoard file (--tensorboard-dir)", path);
  file_->open_or_throw(ExitCode::kUsage);
  event_.float64(1, now);
  event_.string(3, "brain.Event:2");
  write_event(event_);
}

void TensorBoardWriter::scalars(std::int64_t step, const std::vector<std::pair<std::string_view, double>>& values) {
  if (file_->failed()) return;
  summary_.clear();
  for (const auto& [tag, v] : values) {
    value_.clear();
    value_.string(1, tag);
    value_.float32(2, static_cast<float>(v));
    summary_.bytes(1, value_.data());
  }
  event_.clear();
  event_.float64(1, unix_seconds());
  event_.int64(2, step);
  event_.bytes(5, summary_.data());
  write_event(event_);
}

// A failure is reported once by the OutputFile, which then writes nothing more.
void TensorBoardWriter::write_event(const ProtoWriter& event) {
  tfrecord_frame(event.data(), record_);
  if (file_->write(record_)) file_->flush();
}

}  // namespace mnist_mpi
