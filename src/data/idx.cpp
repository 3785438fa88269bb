// Reads IDX files (the format of the original MNIST files), raw or
// gzip-compressed, checking the magic number, the dimension count, every
// dimension, the exact file length and the label range before trusting any of
// it, and assembles the MNIST train / validation / test splits from them. Every
// error is an Error(ExitCode::kData) whose message starts with the offending
// path.
#include "mnist_mpi/data/idx.hpp"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include <sys/mman.h>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {
namespace {

namespace fs = std::filesystem;

constexpr std::uint32_t kImagesMagic = 2051;
constexpr std::uint32_t kLabelsMagic = 2049;
constexpr std::int64_t kMaxCount = 100'000'000;
constexpr int kMaxSide = 4096;
constexpr const char* kFetchHint =
    "fetch it with scripts/fetch_mnist.sh (or point --data-dir at it)";

[[noreturn]] void data_error(const std::string& path, const std::string& msg) {
  throw Error(ExitCode::kData, path + ": " + msg);
}

bool ends_with_gz(const std::string& path) {
  return path.size() >= 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
}

// A sequential byte source over a raw or gzip-compressed file.
class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path), gz_(ends_with_gz(path)) {
    errno = 0;
    if (gz_) {
      gz_file_ = gzopen(path.c_str(), "rb");
      if (gz_file_ == nullptr) {
        data_error(path, std::string("cannot open: ") +
                             (errno != 0 ? std::strerror(errno) : "gzopen failed"));
      }
      gzbuffer(gz_file_, 1 << 17);
    } else {
      in_.open(path, std::ios::binary);
      if (!in_) data_error(path, std::string("cannot open: ") + std::strerror(errno));
    }
  }
  ~Reader() {
    if (gz_file_ != nullptr) gzclose(gz_file_);
  }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  // Reads up to n bytes into dst; returns how many were read (fewer only at the
  // end of the file).
  std::size_t read(std::uint8_t* dst, std::size_t n) {
    std::size_t total = 0;
    if (gz_) {
      while (total < n) {
        const auto chunk = static_cast<unsigned>(
            std::min<std::size_t>(n - total, std::numeric_limits<int>::max() / 2));
        const int got = gzread(gz_file_, dst + total, chunk);
        if (got < 0) {
          int errnum = 0;
          const char* msg = gzerror(gz_file_, &errnum);
          data_error(path_, std::string("gzip decompression failed: ") + (msg ? msg : "?"));
        }
        if (got == 0) {
          // A clean end, or a gzip stream cut short (Z_BUF_ERROR): either way
          // the data ends here and the caller reports how many bytes it got.
          // Anything else is corruption.
          int errnum = 0;
          const char* msg = gzerror(gz_file_, &errnum);
          if (errnum != Z_OK && errnum != Z_STREAM_END && errnum != Z_BUF_ERROR) {
            data_error(path_, std::string("gzip decompression failed: ") + (msg ? msg : "?"));
          }
          break;
        }
        total += static_cast<std::size_t>(got);
      }
    } else {
      in_.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(n));
      total = static_cast<std::size_t>(in_.gcount());
      if (in_.bad()) data_error(path_, "read error");
    }
    return total;
  }

  // The bytes left until the end of a raw file, from its size (nullopt for gzip: only
  // decompressing tells).
  std::optional<std::uint64_t> remaining() {
    if (gz_) return std::nullopt;
    const std::streamoff at = in_.tellg();
    std::error_code ec;
    const std::uintmax_t size = fs::file_size(path_, ec);
    if (ec || at < 0 || size < static_cast<std::uintmax_t>(at)) return std::nullopt;
    return size - static_cast<std::uint64_t>(at);
  }

  // Counts the bytes left until the end of the file (reads and discards them).
  std::uint64_t count_rest() {
    std::array<std::uint8_t, 1 << 14> buf{};
    std::uint64_t rest = 0;
    for (;;) {
      const std::size_t got = read(buf.data(), buf.size());
      rest += got;
      if (got < buf.size()) break;
    }
    return rest;
  }

 private:
  std::string path_;
  bool gz_;
  gzFile gz_file_ = nullptr;
  std::ifstream in_;
};

// A path that does not exist but whose ".gz" sibling does is read from the
// sibling.
std::string resolve(const std::string& path) {
  std::error_code ec;
  if (fs::exists(path, ec)) return path;
  const std::string gz = path + ".gz";
  if (!ends_with_gz(path) && fs::exists(gz, ec)) return gz;
  return path;
}

std::uint32_t be32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

// Reads and checks the header: magic, then `dims` big-endian 32-bit sizes.
std::vector<std::uint32_t> read_header(Reader& r, const std::string& path, std::uint32_t magic,
                                       int dims) {
  std::uint8_t magic_bytes[4];
  if (r.read(magic_bytes, 4) != 4) data_error(path, "truncated: no IDX header");
  const std::uint32_t got_magic = be32(magic_bytes);
  if (got_magic != magic) {
    // The third byte is the element type (0x08 = unsigned byte), the fourth the
    // dimension count.
    const int got_type = magic_bytes[2];
    const int got_dims = magic_bytes[3];
    if (magic_bytes[0] == 0 && magic_bytes[1] == 0 && got_type == 0x08 && got_dims != dims) {
      data_error(path, "wrong dimension count: expected " + std::to_string(dims) + ", got " +
                           std::to_string(got_dims) + " (magic " + std::to_string(got_magic) +
                           ", expected " + std::to_string(magic) + ")");
    }
    data_error(path, "bad magic number " + std::to_string(got_magic) + ", expected " +
                         std::to_string(magic) + " (not an IDX" + std::to_string(dims) +
                         " unsigned-byte file" + (ends_with_gz(path) ? "" : ", or compressed?") +
                         ")");
  }
  std::vector<std::uint8_t> raw(static_cast<std::size_t>(dims) * 4);
  if (r.read(raw.data(), raw.size()) != raw.size()) {
    data_error(path, "truncated: header ends before its " + std::to_string(dims) + " dimensions");
  }
  std::vector<std::uint32_t> sizes(static_cast<std::size_t>(dims));
  for (int i = 0; i < dims; ++i) sizes[static_cast<std::size_t>(i)] = be32(raw.data() + 4 * i);
  return sizes;
}

// Reads exactly n payload bytes and checks nothing follows them.
// Note [Sizes from a file are not trusted]
// n comes from the header: up to 1e8 x 4096 x 4096 bytes passes the field checks, so a corrupt or
// hostile header must not make us allocate n bytes up front. The buffer grows only as bytes
// actually arrive (64 KiB first, then doubling), so memory follows the real
// (decompressed) length, and a header that promises more than the file holds is reported as
// truncated. tests/fuzz/fuzz_idx.cpp holds this under a 2 GB RSS limit.
// Note [Reading the data in one pass]
// A raw file's size tells how many bytes follow the header, so a wrong length is reported before
// anything is allocated and the payload is read once into a buffer of its exact size. That buffer
// asks for transparent huge pages: on this project's VMs a 4 KiB page fault costs microseconds, and
// growing a buffer by doubling (the gzip path) touched every page of the 47 MB training images two
// or three times: 0.7 s of a 1.1 s start-up before, 2 MB pages and one touch now.
void reserve_huge(std::vector<std::uint8_t>& v, std::size_t n) {
  v.reserve(n);  // allocated, not yet touched
  constexpr std::uintptr_t kHuge = std::uintptr_t{1} << 21;
  const auto first = (reinterpret_cast<std::uintptr_t>(v.data()) + kHuge - 1) & ~(kHuge - 1);
  const auto last = (reinterpret_cast<std::uintptr_t>(v.data()) + n) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // a hint only
}

std::vector<std::uint8_t> read_payload(Reader& r, const std::string& path, std::size_t n,
                                       const char* what) {
  if (const std::optional<std::uint64_t> rest = r.remaining()) {  // Note [Reading the data in one pass]
    if (*rest < n)
      data_error(path, "truncated: expected " + std::to_string(n) + " bytes of " + what + ", got " +
                           std::to_string(*rest));
    if (*rest > n)
      data_error(path, std::to_string(*rest - n) + " trailing byte(s) after the " + std::to_string(n) +
                           " bytes of " + what);
    std::vector<std::uint8_t> data;
    reserve_huge(data, n);
    data.resize(n);
    const std::size_t got = r.read(data.data(), n);
    if (got != n)  // the file shrank while we read it
      data_error(path, "truncated: expected " + std::to_string(n) + " bytes of " + what + ", got " +
                           std::to_string(got));
    return data;
  }
  constexpr std::size_t kFirstChunk = std::size_t{1} << 16;
  std::vector<std::uint8_t> data;
  std::size_t got = 0;
  while (got < n) {
    const std::size_t want = std::min(std::max(kFirstChunk, got), n - got);  // the buffer doubles
    data.resize(got + want);
    const std::size_t now = r.read(data.data() + got, want);
    got += now;
    if (now < want) break;
  }
  data.resize(got);
  if (got != n) {
    data_error(path, "truncated: expected " + std::to_string(n) + " bytes of " + what + ", got " +
                         std::to_string(got));
  }
  std::uint8_t probe = 0;
  if (r.read(&probe, 1) != 0) {
    const std::uint64_t extra = 1 + r.count_rest();
    data_error(path, std::to_string(extra) + " trailing byte(s) after the " + std::to_string(n) +
                         " bytes of " + what);
  }
  return data;
}

void check_count(const std::string& path, std::uint32_t count) {
  if (count > kMaxCount) {
    data_error(path, "item count " + std::to_string(count) + " exceeds the limit of " +
                         std::to_string(kMaxCount));
  }
}

std::string require_file(const fs::path& dir, const char* name) {
  const std::string path = (dir / name).string();
  std::error_code ec;
  if (fs::is_regular_file(path, ec) || fs::is_regular_file(path + ".gz", ec)) return path;
  throw Error(ExitCode::kData,
              "MNIST file '" + path + "' not found (nor '" + path + ".gz'); " + kFetchHint);
}

Split make_split(const IdxImages& images, const IdxLabels& labels, std::int64_t begin,
                 std::int64_t end) {
  Split s;
  s.count = end - begin;
  s.rows = images.rows;
  s.cols = images.cols;
  const std::int64_t px = static_cast<std::int64_t>(images.rows) * images.cols;
  s.pixels.assign(images.pixels.begin() + begin * px, images.pixels.begin() + end * px);
  s.labels.assign(labels.labels.begin() + begin, labels.labels.begin() + end);
  return s;
}

// The first `count` items, taking over the buffers (shrinking a vector keeps its memory).
Split head_split(IdxImages&& images, IdxLabels&& labels, std::int64_t count) {
  Split s;
  s.count = count;
  s.rows = images.rows;
  s.cols = images.cols;
  s.pixels = std::move(images.pixels);
  s.pixels.resize(static_cast<std::size_t>(count * images.rows * images.cols));
  s.labels = std::move(labels.labels);
  s.labels.resize(static_cast<std::size_t>(count));
  return s;
}

Split whole_split(IdxImages&& images, IdxLabels&& labels) {
  Split s;
  s.count = images.count;
  s.rows = images.rows;
  s.cols = images.cols;
  s.pixels = std::move(images.pixels);
  s.labels = std::move(labels.labels);
  return s;
}

void check_agree(const IdxImages& images, const std::string& images_path, const IdxLabels& labels,
                 const std::string& labels_path) {
  if (images.count != labels.count) {
    throw Error(ExitCode::kData, "'" + images_path + "' has " + std::to_string(images.count) +
                                     " images but '" + labels_path + "' has " +
                                     std::to_string(labels.count) + " labels");
  }
}

}  // namespace

IdxImages read_idx_images(const std::string& requested) {
  const std::string path = resolve(requested);
  Reader r(path);
  const auto dims = read_header(r, path, kImagesMagic, 3);
  check_count(path, dims[0]);
  for (int d = 1; d <= 2; ++d) {
    const std::uint32_t v = dims[static_cast<std::size_t>(d)];
    if (v == 0 || v > static_cast<std::uint32_t>(kMaxSide)) {
      data_error(path, std::string(d == 1 ? "rows" : "cols") + " = " + std::to_string(v) +
                           " is out of range [1, " + std::to_string(kMaxSide) + "]");
    }
  }
  IdxImages out;
  out.count = dims[0];
  out.rows = static_cast<int>(dims[1]);
  out.cols = static_cast<int>(dims[2]);
  const std::size_t n = static_cast<std::size_t>(out.count) * static_cast<std::size_t>(out.rows) *
                        static_cast<std::size_t>(out.cols);
  out.pixels = read_payload(r, path, n, "pixels");
  return out;
}

IdxLabels read_idx_labels(const std::string& requested, int num_classes) {
  const std::string path = resolve(requested);
  if (num_classes <= 0 || num_classes > 256) {
    data_error(path, "num_classes " + std::to_string(num_classes) + " is out of range [1, 256]");
  }
  Reader r(path);
  const auto dims = read_header(r, path, kLabelsMagic, 1);
  check_count(path, dims[0]);
  IdxLabels out;
  out.count = dims[0];
  out.labels = read_payload(r, path, static_cast<std::size_t>(out.count), "labels");
  for (std::int64_t i = 0; i < out.count; ++i) {
    const int v = out.labels[static_cast<std::size_t>(i)];
    if (v >= num_classes) {
      data_error(path, "label " + std::to_string(v) + " at index " + std::to_string(i) +
                           " is out of range [0, " + std::to_string(num_classes) + ")");
    }
  }
  return out;
}

Mnist load_mnist(const std::string& dir, std::int64_t validation_size, std::int64_t train_limit) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw Error(ExitCode::kData, "MNIST data directory '" + dir + "' not found; " + kFetchHint);
  }
  const fs::path d(dir);
  const std::string train_images_path = require_file(d, "train-images-idx3-ubyte");
  const std::string train_labels_path = require_file(d, "train-labels-idx1-ubyte");
  const std::string test_images_path = require_file(d, "t10k-images-idx3-ubyte");
  const std::string test_labels_path = require_file(d, "t10k-labels-idx1-ubyte");

  IdxImages train_images = read_idx_images(train_images_path);
  IdxLabels train_labels = read_idx_labels(train_labels_path);
  check_agree(train_images, resolve(train_images_path), train_labels, resolve(train_labels_path));
  IdxImages test_images = read_idx_images(test_images_path);
  IdxLabels test_labels = read_idx_labels(test_labels_path);
  check_agree(test_images, resolve(test_images_path), test_labels, resolve(test_labels_path));
  if (test_images.rows != train_images.rows || test_images.cols != train_images.cols) {
    throw Error(ExitCode::kData,
                "'" + resolve(test_images_path) + "' has " + std::to_string(test_images.rows) +
                    "x" + std::to_string(test_images.cols) + " images but '" +
                    resolve(train_images_path) + "' has " + std::to_string(train_images.rows) +
                    "x" + std::to_string(train_images.cols));
  }

  if (train_limit < 0) {
    throw Error(ExitCode::kUsage, "--train-limit must be >= 0, got " + std::to_string(train_limit));
  }
  const std::int64_t n_train =
      train_limit > 0 ? std::min(train_limit, train_images.count) : train_images.count;
  if (validation_size < 0 || validation_size >= n_train) {
    throw Error(ExitCode::kUsage, "--validation-size " + std::to_string(validation_size) +
                                     " must be >= 0 and < the training count " +
                                     std::to_string(n_train) + " (from '" +
                                     resolve(train_images_path) + "')");
  }

  Mnist m;
  const std::int64_t split = n_train - validation_size;
  m.validation = make_split(train_images, train_labels, split, n_train);
  m.train = head_split(std::move(train_images), std::move(train_labels), split);  // no copy
  m.test = whole_split(std::move(test_images), std::move(test_labels));
  return m;
}

}  // namespace mnist_mpi
