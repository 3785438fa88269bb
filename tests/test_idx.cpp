// Tests for the IDX reader and the MNIST loader on small IDX files written into
// a fresh temporary directory: raw and gzipped files, the .gz fallback, every
// header and length check, the label range check, the image / label count
// agreement, the missing-directory message and the train / validation split
// boundaries.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/data/idx.hpp"

namespace mnist_mpi {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

using Bytes = std::vector<std::uint8_t>;

void put_be32(Bytes& b, std::uint32_t v) {
  b.push_back(static_cast<std::uint8_t>(v >> 24));
  b.push_back(static_cast<std::uint8_t>(v >> 16));
  b.push_back(static_cast<std::uint8_t>(v >> 8));
  b.push_back(static_cast<std::uint8_t>(v));
}

// An IDX3 image file whose pixel (i, r, c) is (i * 7 + r * 3 + c) % 256.
Bytes images_file(std::uint32_t count, std::uint32_t rows, std::uint32_t cols) {
  Bytes b;
  put_be32(b, 2051);
  put_be32(b, count);
  put_be32(b, rows);
  put_be32(b, cols);
  for (std::uint32_t i = 0; i < count; ++i)
    for (std::uint32_t r = 0; r < rows; ++r)
      for (std::uint32_t c = 0; c < cols; ++c) b.push_back(static_cast<std::uint8_t>((i * 7 + r * 3 + c) % 256));
  return b;
}

// An IDX1 label file whose label i is i % 10.
Bytes labels_file(std::uint32_t count) {
  Bytes b;
  put_be32(b, 2049);
  put_be32(b, count);
  for (std::uint32_t i = 0; i < count; ++i) b.push_back(static_cast<std::uint8_t>(i % 10));
  return b;
}

// The bytes of b after its header of `header` bytes.
Bytes payload(const Bytes& b, std::size_t header) {
  return Bytes(b.begin() + static_cast<std::ptrdiff_t>(header), b.end());
}

class IdxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    dir_ =
        fs::temp_directory_path() / ("mnist_mpi_test_idx_" + std::to_string(stamp) + "_" + std::to_string(counter++));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write_raw(const std::string& name, const Bytes& b) const {
    const std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    EXPECT_TRUE(out.good());
    return p;
  }

  std::string write_gz(const std::string& name, const Bytes& b) const {
    const std::string p = path(name);
    gzFile f = gzopen(p.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    EXPECT_EQ(gzwrite(f, b.data(), static_cast<unsigned>(b.size())), static_cast<int>(b.size()));
    EXPECT_EQ(gzclose(f), Z_OK);
    return p;
  }

  // Writes a full MNIST directory: n_train training and n_test test images of
  // 3x2 pixels.
  void write_mnist(std::uint32_t n_train, std::uint32_t n_test) const {
    write_raw("train-images-idx3-ubyte", images_file(n_train, 3, 2));
    write_raw("train-labels-idx1-ubyte", labels_file(n_train));
    write_gz("t10k-images-idx3-ubyte.gz", images_file(n_test, 3, 2));
    write_gz("t10k-labels-idx1-ubyte.gz", labels_file(n_test));
  }

  fs::path dir_;
};

// Runs f, expects an Error with the given code (a data error by default), and returns its message.
std::string data_error_of(const std::function<void()>& f, ExitCode code = ExitCode::kData) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code);
    return e.what();
  }
  ADD_FAILURE() << "no Error thrown";
  return "";
}

void expect_images(const IdxImages& im, std::uint32_t count, int rows, int cols) {
  ASSERT_EQ(im.count, count);
  ASSERT_EQ(im.rows, rows);
  ASSERT_EQ(im.cols, cols);
  ASSERT_EQ(im.pixels,
            payload(images_file(count, static_cast<std::uint32_t>(rows), static_cast<std::uint32_t>(cols)), 16));
}

TEST_F(IdxTest, ReadsGoodRawFiles) {
  const auto im = read_idx_images(write_raw("img", images_file(5, 4, 3)));
  expect_images(im, 5, 4, 3);
  const auto lb = read_idx_labels(write_raw("lbl", labels_file(12)));
  ASSERT_EQ(lb.count, 12);
  EXPECT_EQ(lb.labels, payload(labels_file(12), 8));
}

TEST_F(IdxTest, ReadsGoodGzFiles) {
  const auto im = read_idx_images(write_gz("img.gz", images_file(6, 2, 5)));
  expect_images(im, 6, 2, 5);
  const auto lb = read_idx_labels(write_gz("lbl.gz", labels_file(7)));
  ASSERT_EQ(lb.count, 7);
  EXPECT_EQ(lb.labels, payload(labels_file(7), 8));
}

TEST_F(IdxTest, FallsBackToGzSibling) {
  write_gz("img.gz", images_file(3, 2, 2));
  write_gz("lbl.gz", labels_file(3));
  expect_images(read_idx_images(path("img")), 3, 2, 2);
  EXPECT_EQ(read_idx_labels(path("lbl")).count, 3);
}

TEST_F(IdxTest, ZeroItemsIsValid) {
  EXPECT_EQ(read_idx_images(write_raw("img", images_file(0, 28, 28))).count, 0);
  EXPECT_EQ(read_idx_labels(write_raw("lbl", labels_file(0))).count, 0);
}

TEST_F(IdxTest, TruncatedRawFile) {
  Bytes b = images_file(4, 3, 3);  // 36 pixels
  b.resize(b.size() - 5);
  const std::string p = write_raw("img", b);
  const std::string msg = data_error_of([&] { read_idx_images(p); });
  EXPECT_EQ(msg.rfind(quote_input(p), 0), 0u) << msg;
  EXPECT_THAT(msg, HasSubstr("truncated: expected 36 bytes of pixels, got 31"));
}

TEST_F(IdxTest, TruncatedGzFile) {
  Bytes b = labels_file(20);
  b.resize(b.size() - 4);
  const std::string p = write_gz("lbl.gz", b);
  const std::string msg = data_error_of([&] { read_idx_labels(p); });
  EXPECT_EQ(msg.rfind(quote_input(p), 0), 0u) << msg;
  EXPECT_THAT(msg, HasSubstr("truncated: expected 20 bytes of labels, got 16"));
}

TEST_F(IdxTest, TruncatedGzStream) {
  // A gzip stream cut short (not just a short payload) is also reported as
  // truncated.
  const std::string full = write_gz("full.gz", images_file(50, 10, 10));
  std::ifstream in(full, std::ios::binary);
  Bytes gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  gz.resize(gz.size() / 2);
  const std::string p = write_raw("cut.gz", gz);
  const std::string msg = data_error_of([&] { read_idx_images(p); });
  EXPECT_EQ(msg.rfind(quote_input(p), 0), 0u) << msg;
  EXPECT_THAT(msg, HasSubstr("truncated"));
}

TEST_F(IdxTest, TruncatedHeader) {
  Bytes b = images_file(1, 2, 2);
  b.resize(10);
  const std::string p = write_raw("img", b);
  EXPECT_THAT(data_error_of([&] { read_idx_images(p); }), HasSubstr("truncated"));
  const std::string empty = write_raw("empty", {});
  EXPECT_THAT(data_error_of([&] { read_idx_labels(empty); }), HasSubstr("truncated"));
}

TEST_F(IdxTest, TrailingGarbage) {
  Bytes b = images_file(2, 2, 2);
  b.push_back(1);
  b.push_back(2);
  b.push_back(3);
  const std::string p = write_raw("img", b);
  const std::string msg = data_error_of([&] { read_idx_images(p); });
  EXPECT_EQ(msg.rfind(quote_input(p), 0), 0u) << msg;
  EXPECT_THAT(msg, HasSubstr("3 trailing byte(s)"));

  Bytes l = labels_file(4);
  l.push_back(0);
  const std::string q = write_gz("lbl.gz", l);
  EXPECT_THAT(data_error_of([&] { read_idx_labels(q); }), HasSubstr("1 trailing byte(s)"));
}

TEST_F(IdxTest, BadMagic) {
  Bytes b = images_file(1, 2, 2);
  b[0] = 0x12;
  const std::string p = write_raw("img", b);
  const std::string msg = data_error_of([&] { read_idx_images(p); });
  EXPECT_EQ(msg.rfind(quote_input(p), 0), 0u) << msg;
  EXPECT_THAT(msg, HasSubstr("bad magic number"));
  EXPECT_THAT(msg, HasSubstr("expected 2051"));

  // A label file read as images, and vice versa.
  const std::string lbl = write_raw("lbl", labels_file(3));
  EXPECT_THAT(data_error_of([&] { read_idx_images(lbl); }), HasSubstr("expected 2051"));
  const std::string img = write_raw("img2", images_file(1, 1, 1));
  EXPECT_THAT(data_error_of([&] { read_idx_labels(img); }), HasSubstr("expected 2049"));

  // A gzip file with a name lacking ".gz" is not gunzipped: its magic is wrong.
  const std::string gz = write_gz("lbl_gz", labels_file(3));
  EXPECT_THAT(data_error_of([&] { read_idx_labels(gz); }), HasSubstr("bad magic number"));
}

TEST_F(IdxTest, WrongDimensionCount) {
  Bytes b;
  put_be32(b, 0x00000802);  // unsigned bytes, 2 dimensions
  put_be32(b, 1);
  put_be32(b, 4);
  for (int i = 0; i < 4; ++i) b.push_back(0);
  const std::string p = write_raw("img", b);
  const std::string msg = data_error_of([&] { read_idx_images(p); });
  EXPECT_EQ(msg.rfind(quote_input(p), 0), 0u) << msg;
  EXPECT_THAT(msg, HasSubstr("wrong dimension count: expected 3, got 2"));
}

TEST_F(IdxTest, BadDimensions) {
  const std::string zero = write_raw("zero", images_file(0, 0, 5));
  EXPECT_THAT(data_error_of([&] { read_idx_images(zero); }), HasSubstr("rows = 0 is out of range"));
  Bytes big;
  put_be32(big, 2051);
  put_be32(big, 1);
  put_be32(big, 2);
  put_be32(big, 4097);
  const std::string wide = write_raw("wide", big);
  EXPECT_THAT(data_error_of([&] { read_idx_images(wide); }), HasSubstr("cols = 4097 is out of range"));
}

TEST_F(IdxTest, HugeCountRejectedBeforeAllocating) {
  Bytes b;
  put_be32(b, 2051);
  put_be32(b, 0xFFFFFFFFu);
  put_be32(b, 4096);
  put_be32(b, 4096);
  const std::string p = write_raw("img", b);
  EXPECT_THAT(data_error_of([&] { read_idx_images(p); }), HasSubstr("exceeds the limit"));
  Bytes l;
  put_be32(l, 2049);
  put_be32(l, 100'000'001u);
  const std::string q = write_raw("lbl", l);
  EXPECT_THAT(data_error_of([&] { read_idx_labels(q); }), HasSubstr("exceeds the limit"));
}

TEST_F(IdxTest, LabelOutOfRange) {
  Bytes b = labels_file(6);
  b[8 + 3] = 12;
  const std::string p = write_raw("train-labels-idx1-ubyte", b);
  const std::string msg = data_error_of([&] { read_idx_labels(p); });
  EXPECT_EQ(msg, quote_input(p) + ": label 12 at index 3 is out of range [0, 10)");
  // The same file is fine with more classes, and a smaller class count catches
  // more.
  EXPECT_EQ(read_idx_labels(p, 13).count, 6);
  EXPECT_THAT(data_error_of([&] { read_idx_labels(p, 5); }), HasSubstr("label 12 at index 3 is out of range [0, 5)"));
  b[8 + 3] = 3;
  const std::string q = write_raw("lbl", b);
  EXPECT_THAT(data_error_of([&] { read_idx_labels(q, 5); }), HasSubstr("label 5 at index 5 is out of range [0, 5)"));
}

TEST_F(IdxTest, MissingFile) {
  const std::string p = path("nope");
  const std::string msg = data_error_of([&] { read_idx_images(p); });
  EXPECT_EQ(msg, "IDX file " + quote_input(p) + " does not exist; scripts/fetch_mnist.sh fetches the MNIST files");
}

TEST_F(IdxTest, LoadMnistMissingDirectory) {
  const std::string missing = path("no_such_dir");
  const std::string msg = data_error_of([&] { load_mnist(missing, 0); });
  EXPECT_THAT(msg, HasSubstr("MNIST data directory '" + missing + "' not found"));
  EXPECT_THAT(msg, HasSubstr("scripts/fetch_mnist.sh"));
  EXPECT_THAT(msg, HasSubstr("--data-dir"));
}

TEST_F(IdxTest, LoadMnistMissingFile) {
  write_mnist(10, 4);
  fs::remove(path("t10k-labels-idx1-ubyte.gz"));
  const std::string msg = data_error_of([&] { load_mnist(dir_.string(), 2); });
  EXPECT_THAT(msg, HasSubstr(path("t10k-labels-idx1-ubyte")));
  EXPECT_THAT(msg, HasSubstr("scripts/fetch_mnist.sh"));
}

TEST_F(IdxTest, LoadMnistCountMismatch) {
  write_mnist(10, 4);
  write_raw("train-labels-idx1-ubyte", labels_file(9));
  const std::string msg = data_error_of([&] { load_mnist(dir_.string(), 2); });
  EXPECT_THAT(msg, HasSubstr(path("train-images-idx3-ubyte")));
  EXPECT_THAT(msg, HasSubstr(path("train-labels-idx1-ubyte")));
  EXPECT_THAT(msg, HasSubstr("10 images"));
  EXPECT_THAT(msg, HasSubstr("9 labels"));

  write_mnist(10, 4);
  write_gz("t10k-labels-idx1-ubyte.gz", labels_file(5));
  const std::string msg2 = data_error_of([&] { load_mnist(dir_.string(), 2); });
  EXPECT_THAT(msg2, HasSubstr(path("t10k-images-idx3-ubyte.gz")));
  EXPECT_THAT(msg2, HasSubstr(path("t10k-labels-idx1-ubyte.gz")));
  EXPECT_THAT(msg2, HasSubstr("4 images"));
  EXPECT_THAT(msg2, HasSubstr("5 labels"));
}

TEST_F(IdxTest, LoadMnistValidationSplit) {
  write_mnist(10, 4);
  const Mnist m = load_mnist(dir_.string(), 3);
  const int px = 3 * 2;
  const Bytes all = images_file(10, 3, 2);
  ASSERT_EQ(m.train.count, 7);
  ASSERT_EQ(m.validation.count, 3);
  ASSERT_EQ(m.test.count, 4);
  EXPECT_EQ(m.train.rows, 3);
  EXPECT_EQ(m.train.cols, 2);
  EXPECT_EQ(m.validation.rows, 3);
  EXPECT_EQ(m.validation.cols, 2);
  ASSERT_EQ(m.train.pixels.size(), 7u * px);
  ASSERT_EQ(m.validation.pixels.size(), 3u * px);
  ASSERT_EQ(m.train.labels.size(), 7u);
  ASSERT_EQ(m.validation.labels.size(), 3u);
  // The first 7 training images stay in train, the last 3 go to validation,
  // pixels unchanged.
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(m.train.labels[i], i % 10);
    for (int k = 0; k < px; ++k) EXPECT_EQ(m.train.image(i)[k], all[16 + i * px + k]);
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(m.validation.labels[i], (7 + i) % 10);
    for (int k = 0; k < px; ++k) EXPECT_EQ(m.validation.image(i)[k], all[16 + (7 + i) * px + k]);
  }
  EXPECT_EQ(m.test.pixels, payload(images_file(4, 3, 2), 16));
  EXPECT_EQ(m.test.labels, payload(labels_file(4), 8));

  // No validation: everything trains.
  const Mnist none = load_mnist(dir_.string(), 0);
  EXPECT_EQ(none.train.count, 10);
  EXPECT_EQ(none.validation.count, 0);
  EXPECT_TRUE(none.validation.pixels.empty());
}

TEST_F(IdxTest, LoadMnistTrainLimit) {
  write_mnist(10, 4);
  const Mnist m = load_mnist(dir_.string(), 2, 6);
  const int px = 3 * 2;
  const Bytes all = images_file(10, 3, 2);
  ASSERT_EQ(m.train.count, 4);
  ASSERT_EQ(m.validation.count, 2);
  EXPECT_EQ(m.test.count, 4);  // the test split is kept whole
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(m.validation.labels[i], 4 + i);
    for (int k = 0; k < px; ++k) EXPECT_EQ(m.validation.image(i)[k], all[16 + (4 + i) * px + k]);
  }
  // A limit above the count keeps everything.
  EXPECT_EQ(load_mnist(dir_.string(), 1, 1000).train.count, 9);
}

TEST_F(IdxTest, LoadMnistValidationSizeBounds) {
  write_mnist(10, 4);
  EXPECT_EQ(load_mnist(dir_.string(), 9).train.count, 1);
  // A bad --validation-size is a usage error (exit code 2), not a data error.
  EXPECT_THAT(data_error_of([&] { load_mnist(dir_.string(), 10); }, ExitCode::kUsage),
              HasSubstr("--validation-size 10 must be >= 0 and < the training count 10"));
  EXPECT_THAT(data_error_of([&] { load_mnist(dir_.string(), -1); }, ExitCode::kUsage),
              HasSubstr("--validation-size -1"));
  EXPECT_THAT(data_error_of([&] { load_mnist(dir_.string(), 5, 5); }, ExitCode::kUsage),
              HasSubstr("< the training count 5"));
}

// ---- hostile input: paths that are not regular files, sizes from hostile headers ----

// Runs f on a thread and returns its data error message; when f has not returned within 10 s (it
// blocks in open() of the FIFO at `fifo`), fails the test and opens the FIFO for writing, which
// lets the blocked open() return, so that the test ends instead of hanging.
std::string data_error_within_10s(const std::function<void()>& f, const std::string& fifo) {
  auto job = std::async(std::launch::async, [&] { return data_error_of(f); });
  if (job.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "blocked for 10 s on the FIFO " << fifo;
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
  }
  return job.get();
}

// Class 2: a directory, a FIFO or a link to /dev/zero in place of an MNIST file was refused as "not
// found ... fetch it", though the path is there; and the raw reader opened a FIFO with
// std::ifstream, which blocks until a writer comes. Now each says what it found, at once.
TEST_F(IdxTest, LoadMnistSaysWhatIsThereWhenItIsNotARegularFile) {
  write_mnist(10, 4);
  fs::remove(path("train-images-idx3-ubyte"));
  fs::create_directory(path("train-images-idx3-ubyte"));
  std::string msg = data_error_of([&] { load_mnist(dir_.string(), 2); });
  EXPECT_EQ(msg, "MNIST file " + quote_input(path("train-images-idx3-ubyte")) +
                     " is a directory, not a regular file; replace it with the MNIST file (scripts/fetch_mnist.sh)");

  fs::remove(path("train-images-idx3-ubyte"));
  write_mnist(10, 4);
  fs::remove(path("train-labels-idx1-ubyte"));
  fs::create_symlink("/dev/zero", path("train-labels-idx1-ubyte"));
  msg = data_error_of([&] { load_mnist(dir_.string(), 2); });
  EXPECT_THAT(msg, HasSubstr(quote_input(path("train-labels-idx1-ubyte")) +
                             " is a symbolic link to a character device ('/dev/zero'), not a regular file"));
  EXPECT_THAT(msg, Not(HasSubstr("not found")));

  write_raw("train-labels-idx1-ubyte.tmp", labels_file(10));
  fs::remove(path("train-labels-idx1-ubyte"));
  fs::rename(path("train-labels-idx1-ubyte.tmp"), path("train-labels-idx1-ubyte"));
  fs::remove(path("t10k-labels-idx1-ubyte.gz"));
  ASSERT_EQ(::mkfifo(path("t10k-labels-idx1-ubyte.gz").c_str(), 0600), 0);
  msg = data_error_within_10s([&] { load_mnist(dir_.string(), 2); }, path("t10k-labels-idx1-ubyte.gz"));
  EXPECT_THAT(msg, HasSubstr(quote_input(path("t10k-labels-idx1-ubyte.gz")) +
                             " is a FIFO (named pipe), not a regular file; replace it with the MNIST file"));
}

// The readers themselves never block on a FIFO, raw or .gz, and say what they found.
TEST_F(IdxTest, ReadersRefuseAFifoWithoutBlocking) {
  for (const std::string name : {"fifo", "fifo.gz"}) {
    ASSERT_EQ(::mkfifo(path(name).c_str(), 0600), 0);
    const std::string msg = data_error_within_10s([&] { read_idx_images(path(name)); }, path(name));
    EXPECT_EQ(msg.rfind("IDX file " + quote_input(path(name)) + " is a FIFO (named pipe), not a regular file", 0), 0u)
        << msg;
  }
}

// --data-dir naming a regular file said "not found; fetch it".
TEST_F(IdxTest, LoadMnistSaysADataDirThatIsAFileIsAFile) {
  const std::string file = write_raw("not_a_dir", labels_file(3));
  EXPECT_EQ(data_error_of([&] { load_mnist(file, 0); }),
            "MNIST data directory " + quote_input(file) +
                " is a regular file, not a directory; point --data-dir at the directory of the four MNIST files");
}

// A gzip member of `b` (zlib's gzip wrapper), in memory.
Bytes gzip_member(const Bytes& b) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 9, Z_DEFAULT_STRATEGY), Z_OK);
  Bytes out(deflateBound(&z, static_cast<uLong>(b.size())));
  z.next_in = const_cast<Bytef*>(b.data());
  z.avail_in = static_cast<uInt>(b.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// Class 4: a .gz whose header declares more than the machine's memory (1e8 images of 4096x4096 =
// 1.6 PB) and that really inflates grew its buffer until std::bad_alloc, naming no file. It is
// refused before the payload is read, naming the file, the count and the bytes.
TEST_F(IdxTest, ADeclaredPayloadLargerThanMemoryIsRefusedBeforeReading) {
  Bytes b;
  put_be32(b, 2051);
  put_be32(b, 100'000'000);
  put_be32(b, 4096);
  put_be32(b, 4096);
  b.resize(b.size() + (1 << 20), 0);  // 1 MiB that really inflates
  const std::string p = write_raw("img.gz", gzip_member(b));
  const std::string msg = data_error_of([&] { read_idx_images(p); });
  EXPECT_EQ(msg.rfind(quote_input(p) + ": its header declares 100000000 images of 4096x4096 = 1677721600000000 "
                                       "bytes of pixels, more than this machine's ",
                      0),
            0u)
      << msg;
}

// Class 4: a std::bad_alloc while reading (here: the address space is limited to 256 MiB above what
// the process holds, and the file declares 1 GiB) is an Error(kData) naming the file, not an
// uncaught exception that aborts the rank.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MNIST_MPI_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define MNIST_MPI_TEST_SANITIZED 1
#endif
#endif
TEST_F(IdxTest, OutOfMemoryWhileReadingNamesTheFile) {
#ifdef MNIST_MPI_TEST_SANITIZED
  GTEST_SKIP() << "a sanitizer's allocator does not throw std::bad_alloc under RLIMIT_AS";
#else
  Bytes header;
  put_be32(header, 2051);
  put_be32(header, 64);
  put_be32(header, 4096);
  put_be32(header, 4096);  // 64 x 4096 x 4096 = 1 GiB
  const std::string p = write_raw("img", header);
  fs::resize_file(p, header.size() + (std::uintmax_t{1} << 30));  // sparse: no disk used
  long vm_pages = 0;
  std::ifstream("/proc/self/statm") >> vm_pages;
  if (vm_pages <= 0) GTEST_SKIP() << "cannot read /proc/self/statm";
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &old), 0);
  rlimit tight = old;
  tight.rlim_cur = static_cast<rlim_t>(vm_pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + (rlim_t{256} << 20);
  if (old.rlim_cur != RLIM_INFINITY && old.rlim_cur < tight.rlim_cur) GTEST_SKIP() << "RLIMIT_AS already tight";
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &tight), 0);
  std::string msg;
  try {
    read_idx_images(p);
  } catch (const Error& e) {
    msg = e.what();
  } catch (const std::bad_alloc&) {
    msg = "std::bad_alloc";
  }
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &old), 0);
  EXPECT_EQ(msg, quote_input(p) +
                     ": out of memory while reading its 1073741824 bytes of pixels (64 images of "
                     "4096x4096); free memory or run fewer ranks on this machine");
#endif
}

// Class 4: a .gz with gigabytes of zeros after its payload was refused only after decompressing all
// of them (30 s for 32 GiB). Now at most 1 MiB past the payload is read: here 4 GiB of trailing
// zeros (4096 gzip members of 1 MiB, 4 MB on disk) are refused in milliseconds.
TEST_F(IdxTest, TrailingGigabytesInAGzAreRefusedWithoutInflatingThem) {
  const Bytes zeros_member = gzip_member(Bytes(1 << 20, 0));
  Bytes file = gzip_member(labels_file(4));
  for (int i = 0; i < 4096; ++i) file.insert(file.end(), zeros_member.begin(), zeros_member.end());
  const std::string p = write_raw("lbl.gz", file);
  const auto start = std::chrono::steady_clock::now();
  const std::string msg = data_error_of([&] { read_idx_labels(p); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(msg, quote_input(p) + ": at least 1048576 trailing byte(s) after the 4 bytes of labels");
  EXPECT_LT(seconds, 2.0) << "4 GiB of trailing zeros were inflated";
  // A short tail is still counted exactly.
  Bytes short_tail = gzip_member(labels_file(4));
  const Bytes tail = gzip_member(Bytes(1000, 0));
  short_tail.insert(short_tail.end(), tail.begin(), tail.end());
  EXPECT_EQ(data_error_of([&] { read_idx_labels(write_raw("short.gz", short_tail)); }),
            quote_input(path("short.gz")) + ": 1000 trailing byte(s) after the 4 bytes of labels");
}

}  // namespace
}  // namespace mnist_mpi
