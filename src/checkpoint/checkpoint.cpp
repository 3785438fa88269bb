// The checkpoint format: encoder, verifying decoder and atomic file write (see
// include/mnist_mpi/checkpoint/checkpoint.hpp and docs/checkpoint.md). Every size read from a file is
// bounded by the bytes that are really there before anything is allocated.
#include "mnist_mpi/checkpoint/checkpoint.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string_view>
#include <type_traits>
#include <limits>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/crc32c.hpp"
#include "mnist_mpi/io/file_kind.hpp"

namespace mnist_mpi {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint writer copies float arrays as they are in memory: little-endian hosts only");

namespace {

constexpr std::size_t kHeaderBytes = 16, kSectionHeaderBytes = 16;
constexpr std::uint32_t kMaxTensors = 4096, kMaxNameBytes = 256, kMaxDims = 8;

std::size_t pad8(std::size_t n) { return (n + 7) & ~std::size_t{7}; }

// Little-endian stores and loads at a byte offset.
template <typename T>
void put(std::uint8_t* at, T v) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::memcpy(at, &v, sizeof v);
}
template <typename T>
T get(const std::uint8_t* at) {
  T v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

// Appends fields to a growing buffer (only for the small, fixed sections).
struct Appender {
  std::vector<std::uint8_t>& out;
  template <typename T>
  void operator()(T v) {
    const std::size_t at = out.size();
    out.resize(at + sizeof v);
    put(out.data() + at, v);
  }
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
};

// The sections, in the order they are written (docs/checkpoint.md): the one list the encoder and
// the decoder share. An optional one is written only by the runs that have it (EXSM: --exact-sums;
// SIDX and STAT: a model with batch norm; CDEC: a gradient codec that keeps state); a required one
// missing makes the file corrupt.
enum Section : std::size_t {
  kMeta, kSpec, kConf, kPidx, kParm, kMom1, kMom2, kExsm, kSidx, kStat, kCdec, kEnd, kSections
};
struct SectionKind {
  const char* tag;
  bool required;
};
constexpr SectionKind kSectionKinds[kSections] = {{"META", true},  {"SPEC", true},  {"CONF", true}, {"PIDX", true},
                                                  {"PARM", true},  {"MOM1", true},  {"MOM2", true}, {"EXSM", false},
                                                  {"SIDX", false}, {"STAT", false}, {"CDEC", false},
                                                  {"END ", true}};
std::size_t section_of(std::string_view tag) {  // kSections for a tag of no known section
  std::size_t i = 0;
  while (i < kSections && tag != kSectionKinds[i].tag) ++i;
  return i;
}

std::uint32_t section_crc(const std::uint8_t* header, std::span<const std::uint8_t> payload) {
  std::uint32_t c = crc32c(header, 4);  // tag
  c = crc32c(header + 8, 8, c);         // length
  return crc32c(payload.data(), payload.size(), c);
}

// The META section's layout, written once (docs/checkpoint.md, "META"): every field in file order,
// each little-endian and as wide as its type, with no gaps. The writer and the reader both walk
// this list, so an offset cannot be spelt one way in one and another way in the other.
template <typename Meta, typename Field>
void meta_fields(Meta& m, Field&& field) {
  for (auto* v : {&m.step, &m.epoch, &m.steps_per_epoch, &m.sampler_position, &m.global_batch, &m.train_count,
                  &m.total_steps, &m.world_size})
    field(*v);
  field(m.seed);
  for (auto* v : {&m.sampler_epoch, &m.dropout_step, &m.param_count, &m.optimizer_steps}) field(*v);
  field(m.optimizer_kind);
  field(m.nesterov);
  for (auto* v : {&m.beta1, &m.beta2, &m.eps, &m.momentum, &m.weight_decay}) field(*v);
  field(m.schedule_kind);
  field(m.reserved);
  for (auto* v : {&m.base_lr, &m.gamma, &m.step_epochs, &m.min_lr}) field(*v);
  field(m.warmup_steps);
  for (auto* v : {&m.last_lr, &m.next_lr, &m.validation_accuracy, &m.validation_loss, &m.train_loss}) field(*v);
}

// The bytes meta_fields() lays out must be kCheckpointMetaBytes: checked once per process.
// scripts/read_checkpoint.py reads the same fields at docs/checkpoint.md's offsets, independently
// of this code (tests/e2e_checkpoint.sh).
void check_meta_layout() {
  static const std::size_t bytes = [] {
    CheckpointMeta m;
    std::size_t n = 0;
    meta_fields(m, [&](const auto& v) { n += sizeof v; });
    return n;
  }();
  MNIST_CHECK(bytes == kCheckpointMetaBytes, ExitCode::kRuntime, "the META layout is not 240 bytes");
}

void encode_meta(std::uint8_t* p, const CheckpointMeta& m) {
  check_meta_layout();
  std::size_t at = 0;
  meta_fields(m, [&](const auto& v) {
    put(p + at, v);
    at += sizeof v;
  });
}

CheckpointMeta decode_meta(const std::uint8_t* p) {
  check_meta_layout();
  CheckpointMeta m;
  std::size_t at = 0;
  meta_fields(m, [&](auto& v) {
    v = get<std::remove_reference_t<decltype(v)>>(p + at);
    at += sizeof v;
  });
  return m;
}

[[noreturn]] void corrupt(const std::string& name, const std::string& what) {
  throw_error(ExitCode::kCheckpoint,
              "checkpoint '" + name + "' is unusable: " + what +
                  "; delete or move it away to resume from an older checkpoint (--resume auto takes the newest valid "
                  "one), or pass another file to --resume");
}

std::string errno_text(int e) { return std::string(std::strerror(e)); }

}  // namespace

std::vector<CheckpointTensor> checkpoint_tensors(const ModelSpec& spec) {
  std::vector<CheckpointTensor> out;
  for (const ParamTensor& p : spec.params) {
    CheckpointTensor t;
    t.name = p.name;
    t.shape.assign(p.shape.begin(), p.shape.end());
    t.offset = p.offset;
    t.size = p.size;
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<CheckpointTensor> checkpoint_state_tensors(const ModelSpec& spec) {
  std::vector<CheckpointTensor> out;
  for (const StateTensor& s : spec.state) out.push_back({s.name, {s.size}, s.offset, s.size});
  return out;
}

ModelSpec checkpoint_model_spec(const Checkpoint& ck) {
  const ModelSpec spec = parse_model_spec(ck.spec, ck.input, ck.num_classes);
  MNIST_CHECK(checkpoint_tensors(spec) == ck.tensors && static_cast<std::int64_t>(ck.params.size()) == spec.param_count,
              ExitCode::kCheckpoint,
              "the checkpoint's tensors do not match its own model spec " + quote_input(ck.spec));
  MNIST_CHECK(checkpoint_state_tensors(spec) == ck.state_tensors &&
                  static_cast<std::int64_t>(ck.model_state.size()) == spec.state_count,
              ExitCode::kCheckpoint,
              "the checkpoint's model state (batch norm's running statistics, sections SIDX and STAT) does not "
              "match its own model spec " + quote_input(ck.spec));
  return spec;
}

std::string checkpoint_file_name(std::int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%08lld.ckpt", static_cast<long long>(step));
  return buf;
}

std::int64_t checkpoint_temporary_step(const std::string& name) {
  const std::string_view suffix = kCheckpointTempSuffix;
  if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return -1;
  return checkpoint_file_step(name.substr(0, name.size() - suffix.size()));
}

std::vector<std::pair<std::int64_t, std::string>> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<std::int64_t, std::string>> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::int64_t step = checkpoint_file_step(name);
    if (step >= 0) out.emplace_back(step, name);
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

std::int64_t checkpoint_file_step(const std::string& name) {
  constexpr std::string_view pre = "step-", post = ".ckpt";
  if (name.size() < pre.size() + 8 + post.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - post.size(), post.size(), post) != 0)
    return -1;
  const std::string digits = name.substr(pre.size(), name.size() - pre.size() - post.size());
  if (digits.size() > 18) return -1;
  std::int64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

// ---- encoder ----

CheckpointEncoder::CheckpointEncoder(const ModelSpec& spec, const std::string& config, bool second_moment,
                                     std::int64_t exact_chunk, CodecStateShape codec)
    : count_(spec.param_count), state_count_(spec.state_count), second_(second_moment), exact_chunk_(exact_chunk),
      tensors_(spec.params.size()), codec_(codec) {
  // The fixed sections, each built as its payload first.
  std::vector<std::uint8_t> spec_p, conf_p, pidx_p, sidx_p;
  Appender s{spec_p};
  s(static_cast<std::uint32_t>(spec.input.c));
  s(static_cast<std::uint32_t>(spec.input.h));
  s(static_cast<std::uint32_t>(spec.input.w));
  s(static_cast<std::uint32_t>(spec.num_classes()));
  s.bytes(spec.text.data(), spec.text.size());
  conf_p.assign(config.begin(), config.end());
  const auto index = [](std::vector<std::uint8_t>& out, const std::vector<CheckpointTensor>& tensors) {
    Appender x{out};
    x(static_cast<std::uint32_t>(tensors.size()));
    for (const CheckpointTensor& t : tensors) {
      x(static_cast<std::uint32_t>(t.name.size()));
      x.bytes(t.name.data(), t.name.size());
      x(static_cast<std::uint32_t>(t.shape.size()));
      for (std::int64_t d : t.shape) x(d);
      x(t.offset);
      x(t.size);
    }
  };
  index(pidx_p, checkpoint_tensors(spec));
  index(sidx_p, checkpoint_state_tensors(spec));
  const std::size_t tensor_bytes = static_cast<std::size_t>(count_) * sizeof(float);

  struct Part {
    std::size_t length;
    std::size_t* at;
  };
  std::size_t spec_at = 0, conf_at = 0, pidx_at = 0, sidx_at = 0, end_at = 0;
  const Part parts[kSections] = {{kCheckpointMetaBytes, &meta_at_},  // in kSectionKinds' order
                                 {spec_p.size(), &spec_at},
                                 {conf_p.size(), &conf_at},
                                 {pidx_p.size(), &pidx_at},
                                 {tensor_bytes, &parm_at_},
                                 {tensor_bytes, &mom1_at_},
                                 {second_ ? tensor_bytes : 0, &mom2_at_},
                                 {12 + 4 * tensors_, &exsm_at_},
                                 {sidx_p.size(), &sidx_at},
                                 {static_cast<std::size_t>(state_count_) * sizeof(float), &stat_at_},
                                 {16 + codec_.floats() * sizeof(float), &cdec_at_},
                                 {16, &end_at}};
  const auto written = [&](std::size_t i) {
    if (kSectionKinds[i].required) return true;
    if (i == kExsm) return exact_chunk_ > 0;
    if (i == kCdec) return codec_.floats() > 0;
    return state_count_ > 0;  // SIDX, STAT
  };
  std::size_t size = kHeaderBytes, sections = 0;
  for (std::size_t i = 0; i < kSections; ++i) {
    if (!written(i)) continue;
    ++sections;
    *parts[i].at = size;
    size += kSectionHeaderBytes + pad8(parts[i].length);
  }
  image_.assign(size, 0);  // the one allocation; zeros are also the padding
  std::uint8_t* b = image_.data();
  std::memcpy(b, kCheckpointMagic, 8);
  put<std::uint32_t>(b + 8, kCheckpointVersion);
  put<std::uint32_t>(b + 12, crc32c(b, 12));
  for (std::size_t i = 0; i < kSections; ++i) {
    if (!written(i)) continue;
    std::memcpy(b + *parts[i].at, kSectionKinds[i].tag, 4);
    put<std::uint64_t>(b + *parts[i].at + 8, parts[i].length);
  }
  if (exact_chunk_ > 0) {
    put<std::int64_t>(b + exsm_at_ + kSectionHeaderBytes, exact_chunk_);
    put<std::uint32_t>(b + exsm_at_ + kSectionHeaderBytes + 8, static_cast<std::uint32_t>(tensors_));
  }
  if (codec_.floats() > 0) {
    put<std::uint32_t>(b + cdec_at_ + kSectionHeaderBytes, static_cast<std::uint32_t>(codec_.ranks));
    put<std::uint32_t>(b + cdec_at_ + kSectionHeaderBytes + 4, static_cast<std::uint32_t>(codec_.shared));
    put<std::uint64_t>(b + cdec_at_ + kSectionHeaderBytes + 8, static_cast<std::uint64_t>(codec_.per_rank));
  }
  // std::copy, not memcpy: a section may be empty (a CONF without options), and memcpy from
  // an empty vector's null data() is undefined even for zero bytes.
  std::copy(spec_p.begin(), spec_p.end(), b + spec_at + kSectionHeaderBytes);
  std::copy(conf_p.begin(), conf_p.end(), b + conf_at + kSectionHeaderBytes);
  std::copy(pidx_p.begin(), pidx_p.end(), b + pidx_at + kSectionHeaderBytes);
  if (state_count_ > 0) std::copy(sidx_p.begin(), sidx_p.end(), b + sidx_at + kSectionHeaderBytes);
  put<std::uint64_t>(b + end_at + kSectionHeaderBytes, sections - 1);  // sections before END
  put<std::uint64_t>(b + end_at + kSectionHeaderBytes + 8, size);
  for (std::size_t at : {spec_at, conf_at, pidx_at, sidx_at, end_at}) {
    if (at == 0) continue;  // no SIDX
    const std::size_t len = get<std::uint64_t>(b + at + 8);
    put<std::uint32_t>(b + at + 4, section_crc(b + at, {b + at + kSectionHeaderBytes, len}));
  }
}

void CheckpointEncoder::capture(const CheckpointMeta& meta, const float* params, const float* m, const float* v,
                                std::span<const std::int32_t> exact_limits, const float* model_state,
                                std::span<const float> codec_state) {
  MNIST_CHECK(codec_state.size() == codec_.floats(), ExitCode::kRuntime,
              "checkpoint: every rank's codec state, as the file was laid out for");
  if (!codec_state.empty())
    std::memcpy(image_.data() + cdec_at_ + kSectionHeaderBytes + 16, codec_state.data(), codec_state.size_bytes());
  MNIST_CHECK((model_state != nullptr) == (state_count_ > 0), ExitCode::kRuntime,
              "checkpoint: the model state of a model with batch norm, and only then");
  meta_ = meta;
  std::uint8_t* b = image_.data();
  MNIST_CHECK(exact_limits.size() == (exact_chunk_ > 0 ? tensors_ : 0), ExitCode::kRuntime,
              "checkpoint: exact-sum limits for every tensor of an --exact-sums run, and only then");
  for (std::size_t t = 0; t < exact_limits.size(); ++t)
    put<std::int32_t>(b + exsm_at_ + kSectionHeaderBytes + 12 + 4 * t, exact_limits[t]);
  encode_meta(b + meta_at_ + kSectionHeaderBytes, meta);
  const std::size_t n = static_cast<std::size_t>(count_) * sizeof(float);
  std::memcpy(b + parm_at_ + kSectionHeaderBytes, params, n);
  std::memcpy(b + mom1_at_ + kSectionHeaderBytes, m, n);
  if (second_) std::memcpy(b + mom2_at_ + kSectionHeaderBytes, v, n);
  if (state_count_ > 0)
    std::memcpy(b + stat_at_ + kSectionHeaderBytes, model_state, static_cast<std::size_t>(state_count_) * sizeof(float));
}

void CheckpointEncoder::seal() {
  std::uint8_t* b = image_.data();
  for (std::size_t at : {meta_at_, parm_at_, mom1_at_, mom2_at_, exsm_at_, stat_at_, cdec_at_}) {
    if (at == 0) continue;  // no EXSM, no STAT, no CDEC
    const std::size_t len = get<std::uint64_t>(b + at + 8);
    put<std::uint32_t>(b + at + 4, section_crc(b + at, {b + at + kSectionHeaderBytes, len}));
  }
}

// ---- decoder ----

// PIDX: the tensor index (docs/checkpoint.md), every count and size checked before it is used.
std::vector<CheckpointTensor> decode_tensor_index(std::span<const std::uint8_t> payload,
                                                  const std::function<void(bool, const std::string&)>& need) {
  const std::size_t length = payload.size();
  std::size_t q = 0;
  auto take = [&](std::size_t n) {
    need(length - q >= n, "ends inside a tensor entry");
    const std::uint8_t* r = payload.data() + q;
    q += n;
    return r;
  };
  const auto count = get<std::uint32_t>(take(4));
  need(count <= kMaxTensors, "claims " + std::to_string(count) + " tensors (at most 4096)");
  std::vector<CheckpointTensor> tensors(count);
  for (CheckpointTensor& t : tensors) {
    const auto nl = get<std::uint32_t>(take(4));
    need(nl > 0 && nl <= kMaxNameBytes, "a tensor name of " + std::to_string(nl) + " bytes");
    t.name.assign(reinterpret_cast<const char*>(take(nl)), nl);
    const auto nd = get<std::uint32_t>(take(4));
    need(nd >= 1 && nd <= kMaxDims, "tensor '" + t.name + "' has " + std::to_string(nd) + " dimensions");
    t.shape.resize(nd);
    std::int64_t elems = 1;
    for (auto& d : t.shape) {
      d = get<std::int64_t>(take(8));
      need(d > 0 && d <= (std::int64_t{1} << 31), "tensor '" + t.name + "' has a bad dimension");
      // checked before the product, which could overflow int64 (found by fuzz_checkpoint)
      need(elems <= (std::int64_t{1} << 40) / d, "tensor '" + t.name + "' is implausibly large");
      elems *= d;
    }
    t.offset = get<std::int64_t>(take(8));
    t.size = get<std::int64_t>(take(8));
    need(t.size == elems, "tensor '" + t.name + "' size disagrees with its shape");
  }
  need(q == length, "has trailing bytes");
  return tensors;
}

// The parts of a decoded file must agree with each other: META's counts with the payloads' sizes,
// its step, epoch, sampler position and RNG counters with each other, the tensors with [0, n).
void check_parts_agree(const Checkpoint& ck, std::size_t parm_bytes, std::size_t mom1_bytes, std::size_t mom2_bytes,
                       const std::string& name) {
  const CheckpointMeta& m = ck.meta;
  const std::int64_t n = m.param_count;
  if (n <= 0 || static_cast<std::uint64_t>(n) * sizeof(float) != parm_bytes)
    corrupt(name,
            "META says " + std::to_string(n) + " parameters, PARM holds " + std::to_string(parm_bytes) + " bytes");
  if (mom1_bytes != parm_bytes) corrupt(name, "MOM1 is not the size of PARM");
  const std::optional<OptimizerKind> kind = optimizer_kind_of_code(m.optimizer_kind);
  if (!kind) corrupt(name, "unknown optimizer kind " + std::to_string(m.optimizer_kind));
  if (mom2_bytes != (traits(*kind).moments == 2 ? parm_bytes : 0))
    corrupt(name, "MOM2 does not fit the optimizer (Adam, LAMB: the size of PARM; SGD: empty)");
  if (m.schedule_kind > 2) corrupt(name, "unknown learning-rate schedule kind " + std::to_string(m.schedule_kind));
  // Every field is a file's word, so the products are taken with overflow checks (a fuzzed
  // steps_per_epoch * global_batch overflowed int64 here, which is undefined behaviour).
  std::int64_t epoch_images = 0, position = 0;
  if (m.steps_per_epoch <= 0 || m.global_batch <= 0 || m.step < 0 || m.optimizer_steps < 0 ||
      __builtin_mul_overflow(m.steps_per_epoch, m.global_batch, &epoch_images) || epoch_images > m.train_count ||
      m.epoch != m.step / m.steps_per_epoch || m.sampler_epoch != m.epoch ||
      __builtin_mul_overflow(m.step % m.steps_per_epoch, m.global_batch, &position) || m.sampler_position != position ||
      m.dropout_step != m.step)
    corrupt(name, "its step, epoch, sampler position and RNG counters disagree with each other");
  std::int64_t expect = 0;
  for (const CheckpointTensor& t : ck.tensors) {  // contiguous, in order, covering [0, n)
    if (t.offset != expect) corrupt(name, "tensor '" + t.name + "' is not where the previous one ends");
    expect += t.size;
  }
  if (expect != n)
    corrupt(name, "its tensors cover " + std::to_string(expect) + " of " + std::to_string(n) + " parameters");
}

// Long on purpose (Note [Why a function is long] in docs/style.md): it reads the file top to bottom
// in the order docs/checkpoint.md describes it, one check per field, each with its own message;
// the sections' walk stays in one piece so that the order of the checks (sizes before offsets
// before CRCs) is seen; the tensor index and the agreement of the parts are their own functions.
Checkpoint decode_checkpoint(std::span<const std::uint8_t> bytes, const std::string& name) {
  const std::uint8_t* b = bytes.data();
  const std::size_t size = bytes.size();
  if (size == 0) corrupt(name, "the file is empty (a write that never started?)");
  if (size < kHeaderBytes || std::memcmp(b, kCheckpointMagic, std::min<std::size_t>(size, 8)) != 0)
    corrupt(name, "it is not a mnist_mpi checkpoint (no MNISTCKP magic at its start)");
  if (get<std::uint32_t>(b + 12) != crc32c(b, 12))
    corrupt(name, "its header fails its CRC32C check (the version field is damaged)");
  const auto version = get<std::uint32_t>(b + 8);
  if (version != kCheckpointVersion)
    throw_error(ExitCode::kCheckpoint, "checkpoint '" + name + "' has format version " + std::to_string(version) +
                                           "; this mnist_mpi " MNIST_MPI_VERSION " reads version " +
                                           std::to_string(kCheckpointVersion) +
                                           " only: use the mnist_mpi that wrote it, or another checkpoint");

  Checkpoint ck;
  std::array<bool, kSections> seen{};
  std::span<const std::uint8_t> parm, mom1, mom2, stat;
  std::uint64_t sections = 0;
  std::size_t at = kHeaderBytes;
  while (!seen[kEnd]) {
    if (size - at < kSectionHeaderBytes)
      corrupt(name, "it is truncated: it ends after " + std::to_string(size) + " bytes, before its END section");
    std::string tag(reinterpret_cast<const char*>(b + at), 4);
    for (char& c : tag)
      if (c < 0x20 || c > 0x7e) c = '?';  // a damaged tag goes into messages printably
    const auto stored = get<std::uint32_t>(b + at + 4);
    const auto length = get<std::uint64_t>(b + at + 8);
    const std::size_t room = size - at - kSectionHeaderBytes;
    if (length > room || pad8(static_cast<std::size_t>(length)) > room)
      corrupt(name, "it is truncated or damaged: section '" + tag + "' at byte " + std::to_string(at) + " claims " +
                        std::to_string(length) + " bytes, only " + std::to_string(room) + " follow");
    const std::span<const std::uint8_t> payload(b + at + kSectionHeaderBytes, static_cast<std::size_t>(length));
    const std::uint32_t computed = section_crc(b + at, payload);
    if (computed != stored) {
      char buf[64];
      std::snprintf(buf, sizeof buf, " (stored %08x, computed %08x)", stored, computed);
      corrupt(name, "section '" + tag + "' at byte " + std::to_string(at) + " fails its CRC32C check" + buf);
    }
    for (std::size_t i = static_cast<std::size_t>(length); i < pad8(static_cast<std::size_t>(length)); ++i)
      if (payload.data()[i] != 0) corrupt(name, "the padding after section '" + tag + "' is not zero");
    const std::size_t kind = section_of(tag);
    if (kind < kSections) {
      if (seen[kind]) corrupt(name, "section '" + tag + "' appears twice");
      seen[kind] = true;
    }
    auto need = [&](bool ok, const std::string& what) {
      if (!ok) corrupt(name, "section '" + tag + "': " + what);
    };
    const std::uint8_t* p = payload.data();
    if (kind == kMeta) {
      need(length == kCheckpointMetaBytes, "is " + std::to_string(length) + " bytes, expected 240");
      ck.meta = decode_meta(p);
    } else if (kind == kSpec) {
      need(length >= 16, "too short");
      const auto c = get<std::uint32_t>(p), h = get<std::uint32_t>(p + 4), w = get<std::uint32_t>(p + 8);
      const auto k = get<std::uint32_t>(p + 12);
      need(c > 0 && h > 0 && w > 0 && c <= 65536 && h <= 65536 && w <= 65536 && k > 0 && k <= 65536,
           "implausible input shape or class count");
      ck.input = Shape{static_cast<int>(c), static_cast<int>(h), static_cast<int>(w)};
      ck.num_classes = static_cast<std::int32_t>(k);
      ck.spec.assign(reinterpret_cast<const char*>(p + 16), static_cast<std::size_t>(length - 16));
    } else if (kind == kConf) {
      ck.config.assign(reinterpret_cast<const char*>(p), static_cast<std::size_t>(length));
    } else if (kind == kPidx) {
      ck.tensors = decode_tensor_index(payload, need);
    } else if (kind == kParm) {
      parm = payload;
    } else if (kind == kMom1) {
      mom1 = payload;
    } else if (kind == kMom2) {
      mom2 = payload;
    } else if (kind == kExsm) {
      need(length >= 12, "too short");
      ck.exact_chunk = get<std::int64_t>(p);
      const auto n = get<std::uint32_t>(p + 8);
      need(ck.exact_chunk > 0 && length == 12 + 4 * static_cast<std::uint64_t>(n),
           "holds no chunk, or not one limit per tensor");
      for (std::uint32_t t = 0; t < n; ++t) ck.exact_limits.push_back(get<std::int32_t>(p + 12 + 4 * t));
    } else if (kind == kSidx) {
      ck.state_tensors = decode_tensor_index(payload, need);
    } else if (kind == kStat) {
      stat = payload;
    } else if (kind == kCdec) {
      need(length >= 16, "too short");
      ck.codec_ranks = static_cast<std::int64_t>(get<std::uint32_t>(p));
      ck.codec_shared = static_cast<std::int64_t>(get<std::uint32_t>(p + 4));
      const auto per_rank = get<std::uint64_t>(p + 8);
      need(ck.codec_ranks > 0 && per_rank > 0 && per_rank <= length &&
               length - 16 == static_cast<std::uint64_t>(ck.codec_ranks) * per_rank * sizeof(float),
           "does not hold its ranks' states whole");
      need(static_cast<std::uint64_t>(ck.codec_shared) <= per_rank, "shares more values than a rank holds");
      ck.codec_state.resize(static_cast<std::size_t>(length - 16) / sizeof(float));
      std::memcpy(ck.codec_state.data(), p + 16, static_cast<std::size_t>(length - 16));
    } else if (kind == kEnd) {
      need(length == 16, "is not 16 bytes");
      need(get<std::uint64_t>(p) == sections, "counts " + std::to_string(get<std::uint64_t>(p)) +
                                                  " sections before it, the file has " + std::to_string(sections));
      need(get<std::uint64_t>(p + 8) == size, "records a file of " + std::to_string(get<std::uint64_t>(p + 8)) +
                                                  " bytes, the file has " + std::to_string(size));
    }  // an unknown tag of this version: checksummed and skipped
    ++sections;
    at += kSectionHeaderBytes + pad8(static_cast<std::size_t>(length));
  }
  if (at != size) corrupt(name, std::to_string(size - at) + " bytes follow the END section");
  for (std::size_t i = 0; i < kSections; ++i)
    if (kSectionKinds[i].required && !seen[i])
      corrupt(name, std::string("it has no '") + kSectionKinds[i].tag + "' section");

  check_parts_agree(ck, parm.size(), mom1.size(), mom2.size(), name);
  if (seen[kExsm] && ck.exact_limits.size() != ck.tensors.size())
    corrupt(name, "section 'EXSM' holds " + std::to_string(ck.exact_limits.size()) + " limits for " +
                      std::to_string(ck.tensors.size()) + " tensors");
  if (seen[kSidx] != seen[kStat]) corrupt(name, seen[kSidx] ? "it has SIDX but no 'STAT' section" : "it has STAT but no 'SIDX' section");
  std::int64_t state_expect = 0;
  for (const CheckpointTensor& t : ck.state_tensors) {  // contiguous, in order, covering STAT
    if (t.offset != state_expect) corrupt(name, "state tensor '" + t.name + "' is not where the previous one ends");
    state_expect += t.size;
  }
  if (static_cast<std::uint64_t>(state_expect) * sizeof(float) != stat.size())
    corrupt(name, "its state tensors cover " + std::to_string(state_expect) + " values, STAT holds " +
                      std::to_string(stat.size()) + " bytes");
  const auto copy = [](std::span<const std::uint8_t> s, std::vector<float>& out) {
    out.resize(s.size() / sizeof(float));
    if (!s.empty()) std::memcpy(out.data(), s.data(), s.size());
  };
  copy(parm, ck.params);
  copy(mom1, ck.first_moment);
  copy(mom2, ck.second_moment);
  copy(stat, ck.model_state);
  return ck;
}

// ---- files ----

std::vector<std::uint8_t> read_checkpoint_bytes(const std::string& path) {
  // Note [Look before you open]: a FIFO named like a checkpoint must not block rank 0.
  return read_regular_file(path, "checkpoint", ExitCode::kCheckpoint,
                           "give a checkpoint file written by mnist_mpi (--resume FILE, --checkpoint FILE)",
                           kMaxCheckpointBytes, [&](std::uint64_t size) {
                             corrupt(path, "it is " + std::to_string(size) +
                                               " bytes, more than any checkpoint this program writes");
                           });
}

CheckpointMeta read_checkpoint_meta(const std::string& path) {
  const OwnedFd f(open_regular_file(path, "checkpoint", ExitCode::kCheckpoint, "remove it or give a checkpoint file"));
  std::uint8_t b[kHeaderBytes + kSectionHeaderBytes + kCheckpointMetaBytes];
  std::size_t done = 0;
  while (done < sizeof b) {
    const ssize_t r = ::read(f.fd, b + done, sizeof b - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    done += static_cast<std::size_t>(r);
  }
  if (done < sizeof b || std::memcmp(b, kCheckpointMagic, 8) != 0 || get<std::uint32_t>(b + 12) != crc32c(b, 12) ||
      get<std::uint32_t>(b + 8) != kCheckpointVersion || std::memcmp(b + kHeaderBytes, "META", 4) != 0 ||
      get<std::uint64_t>(b + kHeaderBytes + 8) != kCheckpointMetaBytes ||
      section_crc(b + kHeaderBytes, {b + kHeaderBytes + kSectionHeaderBytes, kCheckpointMetaBytes}) !=
          get<std::uint32_t>(b + kHeaderBytes + 4))
    corrupt(path, "its header or META section is damaged");
  return decode_meta(b + kHeaderBytes + kSectionHeaderBytes);
}

void write_file_atomically(const std::string& dir, const std::string& name, std::span<const std::uint8_t> bytes) {
  const std::string final_path = dir + "/" + name;
  // Note [Whole or absent] (include/mnist_mpi/io/file_kind.hpp). Only the holder of the directory's
  // lock writes here (Note [One job per checkpoint directory]), so a file of the temporary's name
  // is a leftover of ours.
  replace_file(final_path, kCheckpointTempSuffix, bytes, [&](const std::string& what, int e, bool renamed) {
    if (renamed)
      throw_error(ExitCode::kCheckpoint, "checkpoint '" + final_path + "' was written but fsync of the directory '" +
                                             dir + "' failed: " + errno_text(e) + "; check the file system");
    std::string fix = "check the directory";
    if (e == ENOSPC || e == EDQUOT || e == EFBIG)
      fix = "free disk space (or raise the quota / file size limit)";
    else if (e == EACCES || e == EPERM || e == EROFS)
      fix = "make it writable";
    throw_error(ExitCode::kCheckpoint, "cannot write checkpoint '" + final_path + "': " + what +
                                           (e ? ": " + errno_text(e) : std::string()) +
                                           "; the previous checkpoints in '" + dir + "' are untouched; " + fix +
                                           " or choose another --checkpoint-dir, then rerun with --resume auto");
  });
}

}  // namespace mnist_mpi
