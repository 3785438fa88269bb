// TensorBoard event files (see include/mnist_mpi/report/tensorboard.hpp). The record format is
// TensorFlow's TFRecord: uint64 length, uint32 masked crc32c(length bytes), the data, uint32
// masked crc32c(data), all little-endian.
#include "mnist_mpi/report/tensorboard.hpp"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/crc32c.hpp"

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
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MNIST_CHECK(!ec && std::filesystem::is_directory(dir), ExitCode::kUsage,
              "--tensorboard-dir: cannot create the directory '" + dir + "'" + (ec ? " (" + ec.message() + ")" : "") +
                  "; give a writable directory");
  const double now = unix_seconds();
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<long long>(now)) + "." +
                                         host + "." + std::to_string(::getpid())))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  MNIST_CHECK(file_ != nullptr, ExitCode::kUsage,
              "--tensorboard-dir: cannot write '" + path_ + "' (" + std::strerror(errno) +
                  "); give a writable directory");
  event_.float64(1, now);
  event_.string(3, "brain.Event:2");
  write_event(event_);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::scalars(std::int64_t step, const std::vector<std::pair<std::string_view, double>>& values) {
  if (!file_) return;
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

void TensorBoardWriter::write_event(const ProtoWriter& event) {
  tfrecord_frame(event.data(), record_);
  if (std::fwrite(record_.data(), 1, record_.size(), file_) != record_.size() || std::fflush(file_) != 0) {
    std::fprintf(stderr, "mnist_mpi: warning: cannot write the TensorBoard file '%s' (%s); no more events go to it\n",
                 path_.c_str(), std::strerror(errno));
    std::fclose(file_);
    file_ = nullptr;
  }
}

}  // namespace mnist_mpi
