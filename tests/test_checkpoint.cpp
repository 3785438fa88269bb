// The checkpoint format on its own: round trip, same state -> same bytes, every damaged byte and
// every truncation detected, foreign / empty / other-version files refused with the file named,
// a failed write leaves the previous file intact, and the optimiser continues bitwise from its
// saved state. The trainer's use of it (resume, preemption) is tested end to end in
// tests/e2e_checkpoint.sh.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>  // mkfifo
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/checkpoint/checkpoint.hpp"
#include "mnist_mpi/checkpoint/checkpointer.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/crc32c.hpp"
#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/train/optimizer.hpp"
#include "mnist_mpi/train/step_boundary.hpp"

namespace mnist_mpi {
namespace {

// A model small enough that every byte of its file can be flipped: 170 parameters.
ModelSpec small_spec() { return parse_model_spec("maxpool:7,flatten,fc:10", Shape{1, 28, 28}, 10); }

CheckpointMeta sample_meta(const ModelSpec& spec) {
  CheckpointMeta m;
  m.step = 37;
  m.steps_per_epoch = 10;
  m.epoch = 3;
  m.sampler_position = 7 * 20;
  m.global_batch = 20;
  m.train_count = 200;
  m.total_steps = 100;
  m.world_size = 2;
  m.seed = 42;
  m.sampler_epoch = 3;
  m.dropout_step = 37;
  m.param_count = spec.param_count;
  m.optimizer_steps = 37;
  m.beta1 = 0.9;
  m.beta2 = 0.999;
  m.eps = 1e-8;
  m.schedule_kind = 1;
  m.base_lr = 0.01;
  m.gamma = 0.7;
  m.step_epochs = 1;
  m.min_lr = 1e-5;
  m.last_lr = 0.0049;
  m.next_lr = 0.0049;
  m.validation_accuracy = std::numeric_limits<double>::quiet_NaN();
  m.validation_loss = std::numeric_limits<double>::quiet_NaN();
  m.train_loss = 0.25;
  return m;
}

struct State {
  std::vector<float> p, m, v;
};

State sample_state(std::int64_t n) {
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (std::int64_t i = 0; i < n; ++i) {
    s.p[i] = 0.01f * static_cast<float>(i) - 0.5f;
    s.m[i] = 1e-3f * static_cast<float>(i % 17);
    s.v[i] = 1e-6f * static_cast<float>(i % 5 + 1);
  }
  return s;
}

std::vector<std::uint8_t> encode(const ModelSpec& spec, const CheckpointMeta& meta, const State& s) {
  CheckpointEncoder e(spec, "model = maxpool:7,flatten,fc:10\nseed = 42\n", true);
  e.capture(meta, s.p.data(), s.m.data(), s.v.data());
  e.seal();
  return {e.bytes().begin(), e.bytes().end()};
}

std::string message_of(const std::vector<std::uint8_t>& bytes, const std::string& name = "x.ckpt") {
  try {
    decode_checkpoint(bytes, name);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kCheckpoint);
    return e.what();
  }
  return "";
}

TEST(Checkpoint, RoundTripKeepsEveryField) {
  const ModelSpec spec = small_spec();
  const CheckpointMeta meta = sample_meta(spec);
  const State s = sample_state(spec.param_count);
  const Checkpoint ck = decode_checkpoint(encode(spec, meta, s), "x.ckpt");
  EXPECT_EQ(ck.meta.step, 37);
  EXPECT_EQ(ck.meta.sampler_position, 140);
  EXPECT_EQ(ck.meta.global_batch, 20);
  EXPECT_EQ(ck.meta.seed, 42u);
  EXPECT_EQ(ck.meta.optimizer_steps, 37);
  EXPECT_EQ(ck.meta.schedule_kind, 1u);
  EXPECT_EQ(ck.meta.gamma, 0.7);
  EXPECT_EQ(ck.meta.last_lr, 0.0049);
  EXPECT_TRUE(std::isnan(ck.meta.validation_accuracy));
  EXPECT_EQ(ck.meta.train_loss, 0.25);
  EXPECT_EQ(ck.spec, "maxpool:7,flatten,fc:10");
  EXPECT_EQ(ck.input, (Shape{1, 28, 28}));
  EXPECT_EQ(ck.num_classes, 10);
  EXPECT_EQ(ck.config, "model = maxpool:7,flatten,fc:10\nseed = 42\n");
  EXPECT_EQ(ck.tensors, checkpoint_tensors(spec));
  ASSERT_EQ(ck.tensors.size(), 2u);
  EXPECT_EQ(ck.tensors[0].name, spec.params[0].name);
  EXPECT_EQ(ck.params, s.p);
  EXPECT_EQ(ck.first_moment, s.m);
  EXPECT_EQ(ck.second_moment, s.v);
}

TEST(Checkpoint, SameStateGivesTheSameBytes) {
  const ModelSpec spec = small_spec();
  const State s = sample_state(spec.param_count);
  const auto a = encode(spec, sample_meta(spec), s);
  usleep(2000);  // nothing time-dependent may enter the file
  const auto b = encode(spec, sample_meta(spec), s);
  EXPECT_EQ(a, b);
  State t = s;
  t.p[5] = std::nextafter(t.p[5], 1.0f);  // and a different state gives different bytes
  EXPECT_NE(a, encode(spec, sample_meta(spec), t));
}

TEST(Checkpoint, EveryFlippedByteIsDetected) {
  const ModelSpec spec = small_spec();
  const auto good = encode(spec, sample_meta(spec), sample_state(spec.param_count));
  for (std::size_t i = 0; i < good.size(); ++i) {
    auto bad = good;
    bad[i] ^= 0x10;
    const std::string msg = message_of(bad, "dir/step-00000037.ckpt");
    ASSERT_FALSE(msg.empty()) << "a flipped bit at byte " << i << " of " << good.size() << " went unnoticed";
    ASSERT_NE(msg.find("dir/step-00000037.ckpt"), std::string::npos) << msg;
  }
}

// EXSM (--exact-sums): the chunk and one limit per tensor come back as written, a file without it
// says "not an --exact-sums run", every flipped byte of a file with it is noticed, and limits for
// the wrong number of tensors are refused before anything is written.
TEST(Checkpoint, ExactSumsSectionRoundTripsAndIsChecked) {
  const ModelSpec spec = small_spec();
  const CheckpointMeta meta = sample_meta(spec);
  const State s = sample_state(spec.param_count);
  std::vector<std::int32_t> limits;
  for (std::size_t t = 0; t < spec.params.size(); ++t) limits.push_back(static_cast<std::int32_t>(5 - 7 * t));
  CheckpointEncoder e(spec, "exact-sums = true\n", true, 10);
  e.capture(meta, s.p.data(), s.m.data(), s.v.data(), limits);
  e.seal();
  const std::vector<std::uint8_t> good(e.bytes().begin(), e.bytes().end());
  const Checkpoint ck = decode_checkpoint(good, "x.ckpt");
  EXPECT_EQ(ck.exact_chunk, 10);
  EXPECT_EQ(ck.exact_limits, limits);
  EXPECT_EQ(ck.params, s.p);
  const Checkpoint plain = decode_checkpoint(encode(spec, meta, s), "x.ckpt");
  EXPECT_EQ(plain.exact_chunk, 0);
  EXPECT_TRUE(plain.exact_limits.empty());
  for (std::size_t i = 0; i < good.size(); ++i) {
    auto bad = good;
    bad[i] ^= 0x04;
    ASSERT_FALSE(message_of(bad).empty()) << "a flipped bit at byte " << i << " of " << good.size() << " went unnoticed";
  }
  limits.pop_back();
  EXPECT_THROW(e.capture(meta, s.p.data(), s.m.data(), s.v.data(), limits), Error);
  CheckpointEncoder without(spec, "", true);
  EXPECT_THROW(without.capture(meta, s.p.data(), s.m.data(), s.v.data(), ck.exact_limits), Error);
}

TEST(Checkpoint, EveryTruncationIsDetected) {
  const ModelSpec spec = small_spec();
  const auto good = encode(spec, sample_meta(spec), sample_state(spec.param_count));
  for (std::size_t n = 0; n < good.size(); ++n) {
    const std::vector<std::uint8_t> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    ASSERT_FALSE(message_of(cut).empty()) << "a file cut to " << n << " bytes was accepted";
  }
  auto longer = good;
  longer.push_back(0);
  EXPECT_NE(message_of(longer).find("records a file of"), std::string::npos);  // END holds the file size
}

TEST(Checkpoint, ForeignEmptyAndOtherVersionFilesAreNamed) {
  EXPECT_NE(message_of({}, "e.ckpt").find("'e.ckpt' is unusable: the file is empty"), std::string::npos);
  const std::string text = "model = fc:10\nthis is a config file, not a checkpoint\n";
  EXPECT_NE(message_of({text.begin(), text.end()}, "c.ini").find("not a mnist_mpi checkpoint"), std::string::npos);
  const ModelSpec spec = small_spec();
  auto v2 = encode(spec, sample_meta(spec), sample_state(spec.param_count));
  const std::uint32_t version = 2;
  std::memcpy(v2.data() + 8, &version, 4);
  const std::uint32_t crc = crc32c(v2.data(), 12);  // a real version-2 header, not a damaged one
  std::memcpy(v2.data() + 12, &crc, 4);
  const std::string msg = message_of(v2, "new.ckpt");
  EXPECT_NE(msg.find("'new.ckpt' has format version 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("reads version 1"), std::string::npos) << msg;
}

TEST(Checkpoint, HugeSizesAreRefusedBeforeAllocating) {
  const ModelSpec spec = small_spec();
  auto bad = encode(spec, sample_meta(spec), sample_state(spec.param_count));
  const std::uint64_t huge = std::uint64_t{1} << 60;  // META's length field
  std::memcpy(bad.data() + 16 + 8, &huge, 8);
  const std::string msg = message_of(bad);
  EXPECT_NE(msg.find("section 'META' at byte 16 claims 1152921504606846976 bytes"), std::string::npos) << msg;
}

TEST(Checkpoint, InconsistentCountersAreRefused) {
  const ModelSpec spec = small_spec();
  CheckpointMeta meta = sample_meta(spec);
  meta.sampler_position += 1;  // well-formed, checksummed, but not a state the trainer can be in
  EXPECT_NE(message_of(encode(spec, meta, sample_state(spec.param_count))).find("disagree"), std::string::npos);
}

// Found by fuzz_checkpoint: counters whose products overflow int64 (undefined behaviour, which the
// UBSan stage of CI turns into a failure) are refused as inconsistent.
TEST(Checkpoint, CountersWhoseProductsOverflowAreRefused) {
  const ModelSpec spec = small_spec();
  CheckpointMeta meta = sample_meta(spec);
  meta.steps_per_epoch = std::int64_t{1} << 40;
  meta.global_batch = std::int64_t{1} << 40;  // 2^80 images per epoch
  meta.epoch = meta.sampler_epoch = 0;
  EXPECT_NE(message_of(encode(spec, meta, sample_state(spec.param_count))).find("disagree"), std::string::npos);
  // A product that wraps to 0 (2^62 * 4 = 2^64) with every other counter consistent with the
  // wrapped value: only the overflow check refuses it, also in a build without UBSan.
  meta = sample_meta(spec);
  meta.steps_per_epoch = std::int64_t{1} << 62;
  meta.global_batch = 4;
  meta.epoch = meta.sampler_epoch = 0;    // 37 / 2^62
  meta.sampler_position = meta.step * 4;  // (37 % 2^62) * 4
  EXPECT_NE(message_of(encode(spec, meta, sample_state(spec.param_count))).find("disagree"), std::string::npos);
}

TEST(Checkpoint, FileNames) {
  EXPECT_EQ(checkpoint_file_name(100), "step-00000100.ckpt");
  EXPECT_EQ(checkpoint_file_step("step-00000100.ckpt"), 100);
  EXPECT_EQ(checkpoint_file_step("step-123456789.ckpt"), 123456789);
  EXPECT_EQ(checkpoint_file_step("step-00000100.ckpt.tmp"), -1);
  EXPECT_EQ(checkpoint_file_step("step-0000010x.ckpt"), -1);
  EXPECT_EQ(checkpoint_file_step("step-100.ckpt"), -1);
}

std::vector<std::uint8_t> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A real failing write: the file-size limit (RLIMIT_FSIZE) makes write() fail with EFBIG
// (SIGXFSZ ignored) in the middle of the file, as a full disk would.
TEST(Checkpoint, AFailedWriteLeavesThePreviousFileIntact) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mnist_mpi_ckwrite_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::vector<std::uint8_t> old_bytes(3000, 0xAB), new_bytes(9000, 0xCD);
  write_file_atomically(dir.string(), "step-00000001.ckpt", old_bytes);
  ASSERT_EQ(slurp((dir / "step-00000001.ckpt").string()), old_bytes);

  rlimit old_limit{};
  getrlimit(RLIMIT_FSIZE, &old_limit);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg;
  try {
    write_file_atomically(dir.string(), "step-00000001.ckpt", new_bytes);
  } catch (const Error& e) {
    msg = e.what();
    EXPECT_EQ(e.code(), ExitCode::kCheckpoint);
  }
  setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);

  EXPECT_NE(msg.find("cannot write checkpoint '" + (dir / "step-00000001.ckpt").string() + "'"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("File too large"), std::string::npos) << msg;
  EXPECT_NE(msg.find("untouched"), std::string::npos) << msg;
  EXPECT_EQ(slurp((dir / "step-00000001.ckpt").string()), old_bytes);  // the old file, whole
  EXPECT_FALSE(fs::exists(dir / "step-00000001.ckpt.tmp"));            // and no leftovers
  fs::remove_all(dir);
}

// Note [Whole or absent] (replace_file, under write_file_atomically and the ONNX export): a
// leftover temporary is replaced, the file is written whole; a path that is a device (here a link
// to /dev/null) is refused and left as it was, since the rename would replace the device node.
TEST(Checkpoint, ReplaceFileRefusesADeviceAndReplacesALeftover) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mnist_mpi_replace_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string file = (dir / "model.onnx").string();
  {
    std::ofstream leftover(file + ".tmp");
    leftover << "half a file";
  }
  const std::vector<std::uint8_t> bytes(5000, 0x5A);
  int calls = 0;
  const WriteError thrower = [&](const std::string& what, int, bool) {
    ++calls;
    throw_error(ExitCode::kOutput, what);
  };
  replace_file(file, ".tmp", bytes, thrower);
  EXPECT_EQ(slurp(file), bytes);
  EXPECT_FALSE(fs::exists(file + ".tmp"));
  EXPECT_EQ(calls, 0);

  const fs::path link = dir / "null.onnx";
  fs::create_symlink("/dev/null", link);
  std::string msg;
  try {
    replace_file(link.string(), ".tmp", bytes, thrower);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(calls, 1);
  EXPECT_NE(msg.find("a character device"), std::string::npos) << msg;
  EXPECT_TRUE(fs::is_symlink(link));  // the link, and the device behind it, untouched
  EXPECT_EQ(fs::read_symlink(link), "/dev/null");
  EXPECT_FALSE(fs::exists(link.string() + ".tmp"));
  fs::remove_all(dir);
}

// read_regular_file (under checkpoints, --config and predict's images): the whole file; more than
// max_bytes goes to too_big with the file's size, before anything is read; a FIFO is refused
// without blocking (Note [Look before you open]).
TEST(Checkpoint, ReadRegularFileReadsWholeFilesAndRefusesTheRest) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mnist_mpi_read_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string file = (dir / "a.bin").string();
  std::vector<std::uint8_t> bytes(70000);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(i * 7);
  replace_file(file, ".tmp", bytes, [](const std::string& what, int, bool) { throw_error(ExitCode::kOutput, what); });
  std::uint64_t seen = 0;
  const auto too_big = [&](std::uint64_t size) {
    seen = size;
    throw_error(ExitCode::kData, "too big");
  };
  EXPECT_EQ(read_regular_file(file, "test file", ExitCode::kData, "", bytes.size(), too_big), bytes);
  EXPECT_EQ(seen, 0u);
  EXPECT_THROW(read_regular_file(file, "test file", ExitCode::kData, "", bytes.size() - 1, too_big), Error);
  EXPECT_EQ(seen, bytes.size());
  const std::string fifo = (dir / "pipe").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string msg;
  try {
    read_regular_file(fifo, "test file", ExitCode::kData, "give a file", 100, too_big);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("FIFO"), std::string::npos) << msg;
  fs::remove_all(dir);
}

// Saving m, v and t and restoring them into a fresh optimiser continues bitwise.
TEST(Checkpoint, OptimizerContinuesBitwiseFromItsState) {
  for (const OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    OptimizerConfig cfg;
    cfg.kind = kind;
    cfg.momentum = 0.9;
    const std::int64_t n = 64;
    std::vector<float> p(n), g(n);
    for (std::int64_t i = 0; i < n; ++i) p[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
    auto grads = [&](int step) {
      for (std::int64_t i = 0; i < n; ++i) g[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(step));
    };
    Optimizer a(cfg, n);
    for (int s = 0; s < 5; ++s) grads(s), a.step(p.data(), g.data(), 0.01);
    std::vector<float> q = p;
    Optimizer b(cfg, n);
    b.restore(a.first_moment().data(), a.second_moment().empty() ? nullptr : a.second_moment().data(), a.steps_taken());
    for (int s = 5; s < 10; ++s) {
      grads(s);
      a.step(p.data(), g.data(), 0.01);
      b.step(q.data(), g.data(), 0.01);
    }
    EXPECT_EQ(std::memcmp(p.data(), q.data(), n * sizeof(float)), 0) << name_of(kind);
  }
}

// A checkpoint reads the state that CheckpointSource::state() brings to host memory at the write
// (on a GPU a download; Note [Host copies]), and checks that state: a host copy still holding
// stale NaN must not make a good step unsaveable, and a good stale copy must not let a bad step
// through. Every due step is settled first (Note [Non-finite steps]).
class DeviceLikeSource final : public CheckpointSource {
 public:
  DeviceLikeSource(std::size_t n, Optimizer& opt)
      : host(n, std::numeric_limits<float>::quiet_NaN()), device(n, 0.5f), opt_(opt) {}
  void settle() override { ++settled; }
  void gather_state() override {}
  TrainingState state() override {
    host = device;  // the download
    return {host.data(), opt_.first_moment().data(), nullptr, opt_.steps_taken(), &opt_.config(), {}, nullptr, {}};
  }
  std::vector<float> host, device;
  int settled = 0;

 private:
  Optimizer& opt_;
};

TEST(Checkpointer, ChecksTheStateThatTheSourceJustBroughtToHost) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mnist_mpi_ckpter_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto comm = make_mpi_communicator(MPI_COMM_SELF);
  const ModelSpec spec = small_spec();
  Options o;
  o.checkpoint_dir = dir.string();
  o.checkpoint_async = false;
  o.quiet = true;
  o.optimizer.kind = OptimizerKind::kSgd;
  Checkpointer ck(o, *comm, CheckpointRun{&spec, 10, 100, 10, 30});
  Optimizer opt(o.optimizer, spec.param_count);
  DeviceLikeSource source(static_cast<std::size_t>(spec.param_count), opt);
  StepBoundary boundary(o, *comm, ck, source);
  StepEnd s;
  s.step = 9;  // not due: neither settled nor written
  s.validation_accuracy = s.validation_loss = s.train_loss = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(boundary.after_step(s, false), StepBoundary::Decision::kContinue);
  EXPECT_EQ(source.settled, 0);
  EXPECT_EQ(ck.stats().written, 0);
  s.step = 10;
  s.epoch_end = true;  // due
  EXPECT_EQ(boundary.after_step(s, false), StepBoundary::Decision::kContinue);
  EXPECT_EQ(source.settled, 1);
  EXPECT_EQ(ck.stats().written, 1) << "a good step was refused because of a stale host copy";
  source.device.assign(source.device.size(), std::numeric_limits<float>::infinity());  // diverged; host copy good
  s.step = 20;
  EXPECT_THROW(boundary.after_step(s, false), AgreedError) << "a diverged model was saved from a stale host copy";
  EXPECT_EQ(source.settled, 2);
  EXPECT_EQ(ck.stats().written, 1);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mnist_mpi
