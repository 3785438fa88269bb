// The checkpoint writer and its retention policy: which file to resume from (rank 0 reads and
// verifies it, then broadcasts it), the writes themselves (rank 0 alone, atomically, from a
// snapshot on a background thread) and what to keep (the newest --keep-checkpoints plus the best
// by validation accuracy). When to write, and the ranks' agreement on signals and write errors at
// every step boundary, are the step boundary's (include/mnist_mpi/train/step_boundary.hpp).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "mnist_mpi/checkpoint/checkpoint.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/data/sampler.hpp"
#include "mnist_mpi/io/file_roles.hpp"
#include "mnist_mpi/joined_thread.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/run_facts.hpp"
#include "mnist_mpi/config/optimizer_config.hpp"

namespace mnist_mpi {

// What the trainer knows about its run, fixed at construction.
struct CheckpointRun {
  const ModelSpec* spec = nullptr;
  std::int64_t global_batch = 0, train_count = 0, steps_per_epoch = 0, total_steps = 0;
  std::int64_t exact_chunk = 0;  // --exact-sums: the chunk (0: off); a resume must keep both
  std::int64_t codec_state = 0;  // floats of gradient-codec state per rank (0: the codec keeps none)
  std::int64_t codec_shared = 0;  // of them, the last ones, the same on every rank
};

// The training state a checkpoint saves, in host memory.
struct TrainingState {
  const float* params = nullptr;         // (count)
  const float* first_moment = nullptr;   // (count)
  const float* second_moment = nullptr;  // (count); null for sgd
  std::int64_t optimizer_steps = 0;                 // the optimiser's step count
  const OptimizerConfig* optimizer = nullptr;      // its configuration
  std::span<const std::int32_t> exact_limits;      // --exact-sums: the next step's limits
  const float* model_state = nullptr;  // (spec.state_count), averaged over the ranks; null without batch norm
  std::span<const float> codec_state;  // every rank's gradient-codec state, in rank order (CheckpointRun::codec_state each)
};

// A checkpoint's state besides the parameters, in host memory, handed to the trainer on resume:
// the optimiser's full-size moments in flat order (second null for sgd) and step count, and the
// exact sums' limits.
struct RestoredState {
  const float* first_moment = nullptr;
  const float* second_moment = nullptr;
  std::int64_t steps = 0;
  std::span<const std::int32_t> exact_limits;  // --exact-sums runs: one per tensor
  std::span<const float> model_state;          // batch norm's running statistics (empty without)
  // The gradient codec's state of every rank of the run that wrote it (codec_ranks of them, in
  // rank order; empty when its codec kept none).
  std::int64_t codec_ranks = 0;
  std::int64_t codec_shared = 0;  // of each rank's, the last values (the same on every rank)
  std::span<const float> codec_state;
};

// The state after a step, for a checkpoint at that point.
struct StepEnd {
  std::int64_t step = 0;  // steps completed
  bool epoch_end = false, last = false;
  double lr = 0, next_lr = 0;                           // of the step just taken, of the next one
  double validation_accuracy = 0, validation_loss = 0;  // NaN unless evaluated after this step
  double train_loss = 0;                                // NaN unless known
};


class Checkpointer {
 public:
  // Local work only (errors are agreed on by main): on rank 0 prepares the directory and finds,
  // reads and verifies the checkpoint to resume from; throws Error(kCheckpoint) when it is
  // unusable or belongs to another model.
  Checkpointer(const Options& options, Communicator& comm, const CheckpointRun& run);
  // The files a run with these options reads and writes here (Note [No output is an input] in
  // include/mnist_mpi/io/file_roles.hpp): --resume FILE, the checkpoints and the lock file already
  // in --checkpoint-dir, and every name the checkpointer writes or removes there.
  static void declare_files(const Options& options, FileRoles& roles);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Collective: broadcasts the checkpoint (if any), restores parameters and optimiser on every
  // rank. Returns the step to continue from (0 for a fresh start).
  // restore_state receives the checkpoint's state besides the parameters (not called on a fresh start).
  std::int64_t restore(float* params, const std::function<void(const RestoredState&)>& restore_state);
  // Rank 0: a checkpoint of the state after step s.step, taken from state() now (the state in
  // host memory: Note [Host copies]) and written on the writer thread (or at once without
  // --checkpoint-async). A state with NaN or inf parameters is not written: that is a write error.
  // When to write, and what every rank does around it, is the step boundary's
  // (include/mnist_mpi/train/step_boundary.hpp).
  void write(const StepEnd& s, const std::function<TrainingState()>& state);
  // Rank 0: whether a write has failed so far (without waiting for the one in flight).
  bool write_failed();
  // Rank 0: waits for the write in flight; the first write error's message, or "" when none.
  std::string wait_for_writes();

  bool enabled() const { return !dir_.empty(); }
  const CheckpointStats& stats() const { return stats_; }
  std::string resumed_from() const { return resumed_from_; }

 private:
  void find_resume_checkpoint();
  std::int64_t per_rank_batch() const {  // the largest micro-batch (Note [Uneven slices])
    return largest_part(run_.global_batch, std::int64_t{comm_.size()} * opt_.accumulation_steps);
  }
  // Throws when ck cannot continue this run; returns the options that differ (for a note).
  std::string check_compatible(const Checkpoint& ck, const std::string& path) const;
  void wait_idle();  // rank 0: the previous write has finished
  void write_job();              // rank 0: seal, write, prune (the writer thread, or inline)
  void prune();
  void writer_loop();

  const Options& opt_;
  Communicator& comm_;
  CheckpointRun run_;
  std::string dir_;
  bool rank0_ = false;
  std::vector<std::uint8_t> resume_bytes_;  // rank 0: the verified file to resume from
  std::string resumed_from_;
  std::unique_ptr<CheckpointEncoder> encoder_;   // rank 0
  std::map<std::string, double> validation_of_;  // file name -> validation accuracy (NaN: none)
  CheckpointStats stats_;

  int lock_fd_ = -1;  // rank 0: holds the directory's lock (Note [One job per checkpoint directory])

  // The writer thread (rank 0, --checkpoint-async true).
  std::mutex mu_;
  std::condition_variable cv_;
  bool job_ = false, quit_ = false;
  std::string error_;    // the first write error, for the next agreement
  JoinedThread thread_;  // last: joined first (Note [Threads are joined on every path])
};

}  // namespace mnist_mpi
