// Reads IDX files (the format of the original MNIST files), raw or
// gzip-compressed, checking the magic number, the dimension count, every
// dimension, the exact file length and the label range before trusting any of
// it, and assembles the MNIST train / validation / test splits from them. Every
// error is an Error(ExitCode::kData) whose message names the offending path
// (quoted: it comes from --data-dir).
#include "mnist_mpi/data/idx.hpp"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <filesystem>
#include <limits>
#include <optional>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <new>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/crc32c.hpp"
#include "mnist_mpi/io/file_kind.hpp"

namespace mnist_mpi {
namespace {

namespace fs = std::filesystem;

constexpr std::uint32_t kImagesMagic = 2051;
constexpr std::uint32_t kLabelsMagic = 2049;
constexpr std::int64_t kMaxCount = 100'000'000;
constexpr int kMaxSide = 4096;
constexpr const char* kFetchHint = "fetch it with scripts/fetch_mnist.sh (or point --data-dir at it)";

// The path is quoted (Note [Quoting what the user wrote] in include/mnist_mpi/check.hpp): it comes
// from --data-dir.
[[noreturn]] void data_error(const std::string& path, const std::string& msg) {
  throw Error(ExitCode::kData, quote_input(path) + ": " + msg);
}

constexpr const char* kReplaceHint = "replace it with the MNIST file (scripts/fetch_mnist.sh)";

bool ends_with_gz(const std::string& path) { return path.size() >= 3 && path.compare(path.size() - 3, 3, ".gz") == 0; }

// A sequential byte source over a raw or gzip-compressed file. It is opened with
// open_regular_file() (Note [Look before you open]): a FIFO, a directory or a link to /dev/zero is
// refused at once, saying what it is, and a FIFO never blocks the rank. Everything is read through
// that one descriptor.
class Reader {
 public:
  explicit Reader(const std::string& path)
      : path_(path),
        gz_(ends_with_gz(path)),
        fd_(open_regular_file(path, "IDX file", ExitCode::kData, "scripts/fetch_mnist.sh fetches the MNIST files")) {
    if (gz_) {
      errno = 0;
      gz_file_ = gzdopen(fd_, "rb");
      if (gz_file_ == nullptr) {
        const int err = errno;
        ::close(fd_);
        data_error(path, std::string("cannot open: ") + (err != 0 ? std::strerror(err) : "gzdopen failed"));
      }
      fd_ = -1;  // gzclose() closes it
      gzbuffer(gz_file_, 1 << 17);
    }
  }
  ~Reader() {
    if (gz_file_ != nullptr) gzclose(gz_file_);
    if (fd_ >= 0) ::close(fd_);
  }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  // Reads up to n bytes into dst; returns how many were read (fewer only at the
  // end of the file).
  std::size_t read(std::uint8_t* dst, std::size_t n) {
    std::size_t total = 0;
    if (gz_) {
      while (total < n) {
        const auto chunk = static_cast<unsigned>(std::min<std::size_t>(n - total, std::numeric_limits<int>::max() / 2));
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
      while (total < n) {
        const ssize_t got = ::read(fd_, dst + total, std::min<std::size_t>(n - total, std::size_t{1} << 30));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) data_error(path_, std::string("read error: ") + std::strerror(errno));
        if (got == 0) break;
        total += static_cast<std::size_t>(got);
      }
      offset_ += total;
    }
    return total;
  }

  // The bytes left until the end of a raw file, from its size (nullopt for gzip: only
  // decompressing tells).
  std::optional<std::uint64_t> remaining() {
    if (gz_) return std::nullopt;
    struct stat st;
    if (::fstat(fd_, &st) != 0 || st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) < offset_)
      return std::nullopt;
    return static_cast<std::uint64_t>(st.st_size) - offset_;
  }

  // Note [Trailing data is probed, not counted]
  // Bytes after the payload make the file wrong whatever their number, and counting them means
  // decompressing them: a .gz with 32 GiB of trailing zeros (a few MB on disk) took 30 s to refuse.
  // So at most kTrailingProbe bytes are read; the message then says "at least" that many.
  static constexpr std::size_t kTrailingProbe = std::size_t{1} << 20;
  // The bytes left, counted up to kTrailingProbe; second: whether the end was reached.
  std::pair<std::uint64_t, bool> probe_rest() {
    std::array<std::uint8_t, 1 << 14> buf{};
    std::uint64_t rest = 0;
    while (rest < kTrailingProbe) {
      const std::size_t got = read(buf.data(), buf.size());
      rest += got;
      if (got < buf.size()) return {rest, true};
    }
    std::uint8_t one = 0;
    return {rest, read(&one, 1) == 0};
  }

 private:
  std::string path_;
  bool gz_;
  int fd_ = -1;               // raw files; -1 once gzdopen() owns it
  std::uint64_t offset_ = 0;  // raw files: bytes read so far
  gzFile gz_file_ = nullptr;
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
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | std::uint32_t{p[3]};
}

// Reads and checks the header: magic, then `dims` big-endian 32-bit sizes.
std::vector<std::uint32_t> read_header(Reader& r, const std::string& path, std::uint32_t magic, int dims) {
  std::uint8_t magic_bytes[4];
  if (r.read(magic_bytes, 4) != 4) data_error(path, "truncated: no IDX header");
  const std::uint32_t got_magic = be32(magic_bytes);
  if (got_magic != magic) {
    // The third byte is the element type (0x08 = unsigned byte), the fourth the
    // dimension count.
    const int got_type = magic_bytes[2];
    const int got_dims = magic_bytes[3];
    if (magic_bytes[0] == 0 && magic_bytes[1] == 0 && got_type == 0x08 && got_dims != dims) {
      data_error(path, "wrong dimension count: expected " + std::to_string(dims) + ", got " + std::to_string(got_dims) +
                           " (magic " + std::to_string(got_magic) + ", expected " + std::to_string(magic) + ")");
    }
    data_error(path, "bad magic number " + std::to_string(got_magic) + ", expected " + std::to_string(magic) +
                         " (not an IDX" + std::to_string(dims) + " unsigned-byte file" +
                         (ends_with_gz(path) ? "" : ", or compressed?") + ")");
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

// Note [A payload must fit in memory]
// kMaxCount x kMaxSide^2 is 1.6e15 bytes, so a header that passes the field checks can still
// declare more than the machine holds; a gzip member that really inflates that far grew the buffer
// until std::bad_alloc, which named no file. A declared payload larger than physical memory is
// refused before anything is read, and a std::bad_alloc while reading (other processes took the
// memory) becomes an Error(kData) that names the file and its size.
std::string gib(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

std::vector<std::uint8_t> read_payload_unchecked(Reader& r, const std::string& path, std::size_t n, const char* what);

std::vector<std::uint8_t> read_payload(Reader& r, const std::string& path, std::size_t n, const char* what,
                                       const std::string& declared) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 && n / static_cast<std::uint64_t>(page) >= static_cast<std::uint64_t>(pages))
    data_error(path, "its header declares " + declared + " = " + std::to_string(n) + " bytes of " + what +
                         ", more than this machine's " +
                         gib(static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page)) +
                         " of memory; the file is corrupt or not an MNIST file");
  try {
    return read_payload_unchecked(r, path, n, what);
  } catch (const std::bad_alloc&) {
    data_error(path, "out of memory while reading its " + std::to_string(n) + " bytes of " + what + " (" + declared +
                         "); free memory or run fewer ranks on this machine");
  }
}

std::vector<std::uint8_t> read_payload_unchecked(Reader& r, const std::string& path, std::size_t n, const char* what) {
  if (const std::optional<std::uint64_t> rest = r.remaining()) {  // Note [Reading the data in one pass]
    if (*rest < n)
      data_error(path,
                 "truncated: expected " + std::to_string(n) + " bytes of " + what + ", got " + std::to_string(*rest));
    if (*rest > n)
      data_error(path,
                 std::to_string(*rest - n) + " trailing byte(s) after the " + std::to_string(n) + " bytes of " + what);
    std::vector<std::uint8_t> data;
    reserve_huge(data, n);
    data.resize(n);
    const std::size_t got = r.read(data.data(), n);
    if (got != n)  // the file shrank while we read it
      data_error(path,
                 "truncated: expected " + std::to_string(n) + " bytes of " + what + ", got " + std::to_string(got));
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
    data_error(path, "truncated: expected " + std::to_string(n) + " bytes of " + what + ", got " + std::to_string(got));
  }
  if (const auto [extra, at_end] = r.probe_rest(); extra > 0)  // Note [Trailing data is probed, not counted]
    data_error(path, (at_end ? "" : "at least ") + std::to_string(extra) + " trailing byte(s) after the " +
                         std::to_string(n) + " bytes of " + what);
  return data;
}

void check_count(const std::string& path, std::uint32_t count) {
  if (count > kMaxCount) {
    data_error(path, "item count " + std::to_string(count) + " exceeds the limit of " + std::to_string(kMaxCount));
  }
}

// The path of an MNIST file, raw or .gz. Something that is there but is not a regular file (a
// directory, a FIFO, a link to /dev/zero) is refused saying what it is (Note [Look before you
// open]); "not found, fetch it" is only for a file that is really missing.
std::string require_file(const fs::path& dir, const char* name) {
  const std::string path = (dir / name).string();
  for (const std::string& p : {path, path + ".gz"}) {  // the order resolve() takes them in
    const FileKind kind = file_kind(p);
    if (kind == FileKind::kRegular) return path;
    if (kind != FileKind::kMissing)
      throw Error(ExitCode::kData,
                  "MNIST file " + quote_input(p) + " is " + describe_path(p) + ", not a regular file; " + kReplaceHint);
  }
  throw Error(ExitCode::kData,
              "MNIST file " + quote_input(path) + " not found (nor " + quote_input(path + ".gz") + "); " + kFetchHint);
}

Split make_split(const IdxImages& images, const IdxLabels& labels, std::int64_t begin, std::int64_t end) {
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
    throw Error(ExitCode::kData, quote_input(images_path) + " has " + std::to_string(images.count) + " images but " +
                                     quote_input(labels_path) + " has " + std::to_string(labels.count) + " labels");
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
      data_error(path, std::string(d == 1 ? "rows" : "cols") + " = " + std::to_string(v) + " is out of range [1, " +
                           std::to_string(kMaxSide) + "]");
    }
  }
  IdxImages out;
  out.count = dims[0];
  out.rows = static_cast<int>(dims[1]);
  out.cols = static_cast<int>(dims[2]);
  const std::size_t n =
      static_cast<std::size_t>(out.count) * static_cast<std::size_t>(out.rows) * static_cast<std::size_t>(out.cols);
  out.pixels = read_payload(
      r, path, n, "pixels",
      std::to_string(out.count) + " images of " + std::to_string(out.rows) + "x" + std::to_string(out.cols));
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
  out.labels =
      read_payload(r, path, static_cast<std::size_t>(out.count), "labels", std::to_string(out.count) + " labels");
  for (std::int64_t i = 0; i < out.count; ++i) {
    const int v = out.labels[static_cast<std::size_t>(i)];
    if (v >= num_classes) {
      data_error(path, "label " + std::to_string(v) + " at index " + std::to_string(i) + " is out of range [0, " +
                           std::to_string(num_classes) + ")");
    }
  }
  return out;
}

std::vector<DataFile> mnist_files(const std::string& dir) {
  const fs::path d(dir);
  std::vector<DataFile> files{{"train-images-idx3-ubyte", "the training images", "", 0},
                              {"train-labels-idx1-ubyte", "the training labels", "", 0},
                              {"t10k-images-idx3-ubyte", "the test images", "", 0},
                              {"t10k-labels-idx1-ubyte", "the test labels", "", 0}};
  for (DataFile& f : files) f.path = resolve((d / f.name).string());
  return files;
}

void declare_mnist_inputs(const std::string& dir, FileRoles& roles) {
  for (const DataFile& f : mnist_files(dir)) roles.input("--data-dir (" + f.what + ")", f.path);
}

// Note [Where the data is found] (include/mnist_mpi/data/idx.hpp)
std::string find_mnist_dir(const std::string& given) {
  if (!given.empty()) return given;
  const auto holds_any = [](const std::string& dir) {
    if (file_kind(dir) != FileKind::kDirectory) return false;
    for (const DataFile& f : mnist_files(dir))
      if (file_kind(f.path) != FileKind::kMissing) return true;
    return false;
  };
  const char* env = std::getenv("MNIST_MPI_DATA_DIR");
  if (env != nullptr && *env != '\0') {
    if (holds_any(env)) return env;
    throw Error(ExitCode::kData, "MNIST_MPI_DATA_DIR is " + quote_input(env) +
                                     ", which holds none of the four MNIST files (train-images-idx3-ubyte, ...): "
                                     "fetch them with scripts/fetch_mnist.sh and point it at their directory, or "
                                     "unset it (or give --data-dir DIR)");
  }
  const std::string here = "data/mnist";
  if (holds_any(here)) return here;
  std::error_code ec;
  const std::string cwd = fs::current_path(ec).string();
  const std::string tree = MNIST_MPI_SOURCE_DIR, source = tree + "/data/mnist";
  // Said relative to the current directory when that is inside the tree ("../data/mnist" in build/).
  if (holds_any(source)) return !ec && cwd.rfind(tree + "/", 0) == 0 ? fs::proximate(source, ec).string() : source;
  throw Error(ExitCode::kData,
              "no MNIST data found: --data-dir is not given, MNIST_MPI_DATA_DIR is not set, and neither " +
                  quote_input(here) + " under the current directory" + (ec ? "" : " (" + quote_input(cwd) + ")") +
                  " nor " + quote_input(source) +
                  " (the source tree this program was built from) holds the MNIST files; fetch them with "
                  "`bash scripts/fetch_mnist.sh` in the source tree, or give --data-dir DIR");
}

Mnist load_mnist(const std::string& dir, std::int64_t validation_size, std::int64_t train_limit) {
  if (const FileKind kind = file_kind(dir); kind == FileKind::kMissing) {
    throw Error(ExitCode::kData, "MNIST data directory " + quote_input(dir) + " not found; " + kFetchHint);
  } else if (kind != FileKind::kDirectory) {
    throw Error(ExitCode::kData, "MNIST data directory " + quote_input(dir) + " is " + describe_path(dir) +
                                     ", not a directory; point --data-dir at the directory of the four MNIST files");
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
    throw Error(ExitCode::kData, quote_input(resolve(test_images_path)) + " has " + std::to_string(test_images.rows) +
                                     "x" + std::to_string(test_images.cols) + " images but " +
                                     quote_input(resolve(train_images_path)) + " has " +
                                     std::to_string(train_images.rows) + "x" + std::to_string(train_images.cols));
  }

  if (train_limit < 0) {
    throw Error(ExitCode::kUsage, "--train-limit must be >= 0, got " + std::to_string(train_limit));
  }
  const std::int64_t n_train = train_limit > 0 ? std::min(train_limit, train_images.count) : train_images.count;
  if (validation_size < 0 || validation_size >= n_train) {
    throw Error(ExitCode::kUsage, "--validation-size " + std::to_string(validation_size) +
                                      " must be >= 0 and < the training count " + std::to_string(n_train) + " (from " +
                                      quote_input(resolve(train_images_path)) + ")");
  }

  Mnist m;
  m.files = mnist_files(dir);
  const auto digest = [](const std::vector<std::uint8_t>& bytes, std::initializer_list<std::int64_t> sizes) {
    const std::vector<std::int64_t> s(sizes);
    return content_digest(bytes.data(), bytes.size()) ^ (content_digest(s.data(), s.size() * sizeof s[0]) * 31);
  };
  m.files[0].digest = digest(train_images.pixels, {train_images.count, train_images.rows, train_images.cols});
  m.files[1].digest = digest(train_labels.labels, {train_labels.count});
  m.files[2].digest = digest(test_images.pixels, {test_images.count, test_images.rows, test_images.cols});
  m.files[3].digest = digest(test_labels.labels, {test_labels.count});
  const std::int64_t split = n_train - validation_size;
  m.validation = make_split(train_images, train_labels, split, n_train);
  m.train = head_split(std::move(train_images), std::move(train_labels), split);  // no copy
  m.test = whole_split(std::move(test_images), std::move(test_labels));
  return m;
}

}  // namespace mnist_mpi
