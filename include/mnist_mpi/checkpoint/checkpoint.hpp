// Checkpoint files: the format (every field is described in docs/checkpoint.md), the encoder that
// lays a run's file out once and refills it at each checkpoint, the decoder that verifies every
// byte before trusting any of it, and the atomic file write. When to write, what to keep and how
// to resume is Checkpointer's business (include/mnist_mpi/checkpoint/checkpointer.hpp).
//
//   file    = header section* END      (all integers and floats little-endian)
//   header  = "MNISTCKP" u32 version u32 crc32c(magic, version)
//   section = char tag[4] u32 crc32c(tag, length, payload) u64 length payload zero-padding-to-8
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi {

inline constexpr char kCheckpointMagic[8] = {'M', 'N', 'I', 'S', 'T', 'C', 'K', 'P'};
inline constexpr std::uint32_t kCheckpointVersion = 1;
// Largest file the reader accepts (a bound checked before anything is allocated).
inline constexpr std::uint64_t kMaxCheckpointBytes = std::uint64_t{16} << 30;

// The META section: a fixed 240-byte record (offsets in docs/checkpoint.md).
struct CheckpointMeta {
  std::int64_t step = 0;   // global steps completed; the next step to run
  std::int64_t epoch = 0;  // 0-based epoch of the next step: step / steps_per_epoch
  std::int64_t steps_per_epoch = 0;
  std::int64_t sampler_position = 0;  // the next step's first position in its epoch's permutation
  std::int64_t global_batch = 0;
  std::int64_t train_count = 0;  // images in the training split the sampler permutes
  std::int64_t total_steps = 0;  // of the run that wrote the file
  std::int64_t world_size = 0;   // ranks of that run (information only)
  std::uint64_t seed = 0;
  std::int64_t sampler_epoch = 0;  // RNG counter of the sampler: the permutation is key(seed, epoch)
  std::int64_t dropout_step = 0;   // RNG counter of dropout: the next step's masks use this step
  std::int64_t param_count = 0;
  std::int64_t optimizer_steps = 0;  // Adam's t (bias correction), SGD's step count
  std::uint32_t optimizer_kind = 0;  // OptimizerTraits::checkpoint_code: 0 adam, 1 sgd
  std::uint32_t nesterov = 0;
  double beta1 = 0, beta2 = 0, eps = 0, momentum = 0, weight_decay = 0;
  std::uint32_t schedule_kind = 0;  // 0 constant, 1 step, 2 cosine
  std::uint32_t reserved = 0;
  double base_lr = 0, gamma = 0, step_epochs = 0, min_lr = 0;
  std::int64_t warmup_steps = 0;
  double last_lr = 0;              // the learning rate of the last step taken
  double next_lr = 0;              // the learning rate of the next step (of this run's schedule)
  double validation_accuracy = 0;  // NaN when the validation split was not evaluated at this step
  double validation_loss = 0;
  double train_loss = 0;  // the last logged global training loss; NaN if none
};
inline constexpr std::size_t kCheckpointMetaBytes = 240;

struct CheckpointTensor {
  std::string name;                 // "3.conv.weight"
  std::vector<std::int64_t> shape;  // conv weight (O, I, KH, KW), fc weight (O, I), bias (O)
  std::int64_t offset = 0;          // elements into PARM / MOM1 / MOM2
  std::int64_t size = 0;
  bool operator==(const CheckpointTensor&) const = default;
};

// The optimiser of a decoded checkpoint (decode_checkpoint refuses a code that names none).
inline OptimizerKind checkpoint_optimizer(const CheckpointMeta& m) {
  return optimizer_kind_of_code(m.optimizer_kind).value_or(OptimizerKind::kAdam);
}

// Everything a file holds, decoded.
struct Checkpoint {
  CheckpointMeta meta;
  Shape input;  // per-sample input (C, H, W)
  std::int32_t num_classes = 0;
  std::string spec;    // the model spec text
  std::string config;  // "key = value" lines of every option of the run
  std::vector<CheckpointTensor> tensors;
  std::vector<float> params;         // (param_count), the flat layout of ModelSpec
  std::vector<float> first_moment;   // (param_count): Adam's m, SGD's momentum buffer
  std::vector<float> second_moment;  // (param_count) for Adam, empty for SGD
  // EXSM, written by --exact-sums runs only: the chunk and each tensor's limit exponent for the
  // next step (Note [Where the shift comes from] in include/mnist_mpi/train/exact_sums.hpp).
  std::int64_t exact_chunk = 0;  // 0: not an --exact-sums run
  std::vector<std::int32_t> exact_limits;
  // SIDX and STAT, written for a model with batch norm only: the model state's tensors (Note
  // [State that is not trained] in include/mnist_mpi/model/spec.hpp) and their values.
  std::vector<CheckpointTensor> state_tensors;
  std::vector<float> model_state;  // (ModelSpec::state_count)
  // CDEC, written by runs whose gradient codec keeps state (--grad-compression bf16: its residuals;
  // Note [A gradient codec] in include/mnist_mpi/train/codec.hpp): every rank's state, in rank
  // order, codec_state.size() / codec_ranks floats each.
  std::int64_t codec_ranks = 0;  // 0: no codec state
  std::int64_t codec_shared = 0;  // of each rank's, the last values, the same on every rank
  std::vector<float> codec_state;
};

// The CDEC section's shape: `ranks` states of `per_rank` floats, the last `shared` of each the same
// on every rank.
struct CodecStateShape {
  std::int64_t ranks = 0, per_rank = 0, shared = 0;
  std::size_t floats() const { return static_cast<std::size_t>(ranks * per_rank); }
};

// Lays out one run's file once (the sizes never change during a run) and writes the parts that
// never change (header, SPEC, CONF, PIDX, END); allocates once.
class CheckpointEncoder {
 public:
  // exact_chunk > 0: an --exact-sums run, whose file also holds EXSM.
  // codec: the CDEC section's shape (none when empty).
  CheckpointEncoder(const ModelSpec& spec, const std::string& config, bool second_moment,
                    std::int64_t exact_chunk = 0, CodecStateShape codec = {});
  std::size_t size() const { return image_.size(); }
  // The training thread's part: copies the state into the file image (memcpy; no allocation).
  // model_state: spec.state_count floats (null when the spec has none); codec_state: every rank's,
  // in rank order (the shape given at construction).
  void capture(const CheckpointMeta& meta, const float* params, const float* first_moment, const float* second_moment,
               std::span<const std::int32_t> exact_limits = {}, const float* model_state = nullptr,
               std::span<const float> codec_state = {});
  // The writer's part: checksums of the sections capture() changed. Then bytes() is the file.
  void seal();
  std::span<const std::uint8_t> bytes() const { return image_; }
  const CheckpointMeta& meta() const { return meta_; }

 private:
  std::vector<std::uint8_t> image_;
  std::size_t meta_at_ = 0, parm_at_ = 0, mom1_at_ = 0, mom2_at_ = 0, exsm_at_ = 0, stat_at_ = 0,
              cdec_at_ = 0;  // section offsets
  std::int64_t count_ = 0;
  std::int64_t state_count_ = 0;
  bool second_ = false;
  std::int64_t exact_chunk_ = 0;
  std::size_t tensors_ = 0;
  CodecStateShape codec_;
  CheckpointMeta meta_;
};

// Verifies and decodes a whole file image; `name` (the path) goes into every message. Throws
// Error(kCheckpoint) naming the file, what is wrong and what to do.
Checkpoint decode_checkpoint(std::span<const std::uint8_t> bytes, const std::string& name);
// Reads a file into memory (size bounded by kMaxCheckpointBytes first). Throws Error(kCheckpoint).
std::vector<std::uint8_t> read_checkpoint_bytes(const std::string& path);
inline Checkpoint load_checkpoint(const std::string& path) {
  return decode_checkpoint(read_checkpoint_bytes(path), path);
}
// Reads and verifies only the header and META (the first section): cheap, for choosing files.
CheckpointMeta read_checkpoint_meta(const std::string& path);

// Atomic replacement: writes dir/name.tmp, fsyncs it, renames it to dir/name and fsyncs dir.
// dir/name is either its old content or the complete new file, whatever happens. On any failure
// the temporary file is removed and Error(kCheckpoint) says what failed and why (errno).
void write_file_atomically(const std::string& dir, const std::string& name, std::span<const std::uint8_t> bytes);

// Names of the files: step-00000100.ckpt (8 digits or more), and the temporary during a write.
std::string checkpoint_file_name(std::int64_t step);
// The step of a checkpoint file name, or -1 when `name` is not one.
std::int64_t checkpoint_file_step(const std::string& name);
inline constexpr const char* kCheckpointTempSuffix = ".tmp";
// The step of a checkpoint's temporary file name (step-00000100.ckpt.tmp), or -1.
std::int64_t checkpoint_temporary_step(const std::string& name);
// The checkpoint files of a directory, (step, name), newest step first; none when it cannot be read.
std::vector<std::pair<std::int64_t, std::string>> list_checkpoints(const std::string& dir);

// Tensors of a spec in file form (names, shapes, offsets).
std::vector<CheckpointTensor> checkpoint_tensors(const ModelSpec& spec);
// The same for its model state (SIDX), each tensor of one dimension.
std::vector<CheckpointTensor> checkpoint_state_tensors(const ModelSpec& spec);
// The model of a checkpoint used outside training (evaluate, export, predict): its own spec,
// parsed, and checked against its tensor table and its parameter count, so that its parameters
// fill exactly a buffer of spec.param_count. Throws Error(kCheckpoint) when they disagree.
ModelSpec checkpoint_model_spec(const Checkpoint& ck);

}  // namespace mnist_mpi
