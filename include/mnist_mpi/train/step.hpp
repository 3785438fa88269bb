// One global step of one rank: for each of its micro-batches the sampler's slice, forward, the
// loss, backward (on the last micro-batch with the reducer's buckets started as layers finish);
// then every bucket is waited for, checked (Note [Non-finite steps]) and applied by the optimiser
// as soon as its sum is in. The step knows nothing of logging, evaluation or checkpoints: it
// returns what happened, and the trainer's loop (src/train/trainer.cpp) does the rest.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/data/sampler.hpp"
#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/run_facts.hpp"  // StepTiming
#include "mnist_mpi/report/timeline.hpp"
#include "mnist_mpi/train/optimizer.hpp"
#include "mnist_mpi/train/exact_sums.hpp"
#include "mnist_mpi/train/reducer.hpp"

namespace mnist_mpi {

// Where this rank's step runs: the pieces it drives, all owned by the trainer and bound once.
struct StepParts {
  Backend* backend = nullptr;
  Model* model = nullptr;  // the training model, bound to params and grads
  Buffer* params = nullptr;
  Buffer* grads = nullptr;
  Reducer* reducer = nullptr;  // sums grads across the ranks, bucket by bucket
  Optimizer* optimizer = nullptr;
  StepGuard* guard = nullptr;    // the backend's non-finite guard
  Sampler* sampler = nullptr;    // order() caches the epoch's permutation
  DataSource* data = nullptr;    // the training split where the backend computes
  LossMeter* loss = nullptr;     // the training loss, summed over the log window
  Timeline* timeline = nullptr;  // null unless --timeline
  ExactSums* exact = nullptr;    // --exact-sums; null otherwise
  LossMeter* scratch_loss = nullptr;  // --exact-sums: the loss of a pass computed again (not counted twice)
};

// The shape of the step, fixed for the run.
struct StepShape {
  int rank = 0, world = 1;
  std::int64_t accumulation = 1;  // micro-batches per rank per step
  std::int64_t batch = 0;         // images the model holds: the largest micro-batch (Note [Uneven slices])
  std::int64_t global_batch = 0;  // the sum of every rank's micro-batches
  std::uint64_t seed = 0;         // dropout key
  bool check_all_first = false;   // --skip-nonfinite-steps: every bucket checked before any is applied
  bool graph = false;             // --cuda-graph: Note [A step as one CUDA graph]
  // --exact-sums: the global batch's chunks and this rank's (Note [Chunks of the global batch]);
  // batch is then the chunk's size.
  std::int64_t chunks = 0;
  ChunkRange my_chunks;
  std::int64_t slow_ms = 0;  // MNIST_MPI_FAULT=RANK:slow:MS: this rank sleeps in every step's backward
};

struct StepResult {
  StepTiming timing;  // host seconds of the parts of this step
  std::chrono::steady_clock::time_point begin, end;
};

class Step {
 public:
  Step(const StepParts& parts, const StepShape& shape);
  // Runs global step `step` with learning rate lr. poison: the testing hook marks this rank's loss
  // as non-finite (MNIST_MPI_FAULT=RANK:STEP:nan).
  StepResult run(std::int64_t step, double lr, bool poison);
  std::int64_t graph_replays() const { return replays_; }  // --cuda-graph: steps run as the captured graph
  // --exact-sums: how this rank's chunks run (Note [The row-wise tail at the rank's batch]), for the banner.
  const std::string& exact_plan() const { return exact_plan_; }
  // The training layers' kernels as they run (Model::describe of the heads and the tail, when the
  // exact sums' tail is used).
  std::string describe_layers() const;

 private:
  // The step's work, queued (or, inside a graph capture, recorded); adds host times to `timing`.
  void body(std::int64_t step, double lr, bool poison, StepTiming& timing);
  void use_order(std::int64_t epoch);  // the data source's order is that of `epoch`
  // Waits for every bucket's sum, checks it and applies it; stops applying at the first bucket the
  // guard refuses (every sum is still waited for: none is left in flight).
  // When a micro-batch's parts began: its data, its forward and loss, its backward.
  struct MicroTimes {
    std::chrono::steady_clock::time_point start, data, loss;
  };
  StepContext forward_and_loss(std::int64_t step, const Slice& slice, LossMeter& loss, bool poison, Timeline* tl,
                               MicroTimes& at);
  void record_micro(std::int64_t step, std::int64_t index, bool last, const MicroTimes& at,
                    std::chrono::steady_clock::time_point end, Timeline* tl, StepTiming& timing);
  // The optimiser's pass that writes the parameters of the flat range [begin, end) (its one pass,
  // or a two-phase optimiser's second: Note [LAMB in two phases] in
  // include/mnist_mpi/train/optimizer.hpp), and the weight copies it changes.
  void update(std::int64_t begin, std::int64_t end);
  // A two-phase optimiser's norms and second phase over this rank's shard of every bucket, each
  // bucket's gather started (sharded) once it is written; agreed: whether the ranks have agreed on
  // the guard's verdicts (set when this agrees). Returns the number of gathers started.
  std::size_t second_phase(bool finite, bool& agreed, StepTiming& t);
  // sums_in: every bucket's sum is already in (--exact-sums); all are checked before any is applied.
  void apply(std::int64_t step, double lr, std::chrono::steady_clock::time_point backward_end, StepTiming& t,
             bool sums_in = false);
  // --exact-sums: the step's work (include/mnist_mpi/train/exact_sums.hpp).
  void body_exact(std::int64_t step, double lr, bool poison, StepTiming& timing);
  // One pass over this rank's chunks: probe (only the largest values) or sum into the integers;
  // returns when backward of the last chunk ended.
  std::chrono::steady_clock::time_point exact_pass(std::int64_t step, bool probe, bool poison, LossMeter& loss,
                                                   StepTiming& timing);
  // The same pass, once begun, with the row-wise tail at the rank's batch (Note [The row-wise tail
  // at the rank's batch]); tl: the timeline, or null.
  std::chrono::steady_clock::time_point exact_pass_tail(std::int64_t step, bool probe, bool poison, LossMeter& loss,
                                                        Timeline* tl, StepTiming& timing);
  // Builds the head and tail models from layer `first` on, and keeps them only if the tail at the
  // rank's batch and the heads give the chunk-by-chunk model's bits on random data.
  void try_tail(int first);
  void build_tail(int first);
  static constexpr int kMaxTailChunks = 64;  // chunks a rank: a head model each
  bool tail_matches_chunks(int first);
  float* chunk_input(std::int64_t j);  // where chunk j's images go
  void finish_taken();                 // every taken weight's chunks to the sink
  void slow_down() const;              // MNIST_MPI_FAULT=RANK:slow:MS

  StepParts p_;
  StepShape shape_;
  float grad_scale_;               // 1 / global batch (Note [Averaging is a scaled sum])
  std::unique_ptr<Buffer> accum_;  // the earlier micro-batches' gradient sum (accumulation > 1)
  std::unique_ptr<Buffer> zeros_;  // (batch, classes) of zeros, when some micro-batch is short
  std::vector<std::pair<std::int64_t, std::int64_t>> layer_params_;  // (offset, size) per layer
  // Note [Weight copies kept between passes] (src/backend/cpu/bf16.cpp): the model's copies of its
  // weights hold the parameters: set by a pass, kept by apply(), which refreshes what it changes.
  bool copies_current_ = false;
  std::vector<LayerKernel::PlainCopy> plain_copies_;                 // the model's, which the optimiser writes
  bool accumulating_ = false;                                        // the last micro-batch of an accumulated step
  std::function<void(int)> on_layer_done_;  // made once: finishes a layer's gradient, starts buckets
  bool exact_first_chunk_ = false;          // --exact-sums: the pass's first chunk assigns the integers
  std::vector<ParamRange> owned_;           // the reducer's owned ranges: the sums this rank receives
  std::vector<char> taken_layer_;           // --exact-sums: layers whose kernel hands its weight gradient over
  Model* taker_ = nullptr;                  // --exact-sums: the model whose kernels took them (the tail, or p_.model)
  std::vector<std::unique_ptr<Model>> heads_;  // --exact-sums with a tail: chunk j's layers before the tail
  std::unique_ptr<Model> tail_;                // --exact-sums: the row-wise tail at the rank's batch, if it agrees
  std::vector<std::int32_t> tail_labels_;      // the rank's chunks' labels, in chunk order
  std::string exact_plan_;
  std::int64_t order_epoch_ = -1;           // the epoch whose order p_.data holds
  std::unique_ptr<StepGraph> graph_;        // --cuda-graph: the step, captured at its second run
  std::int64_t runs_ = 0;                   // steps run by this Step
  std::int64_t replays_ = 0;                // of them, replays of the graph
};

}  // namespace mnist_mpi
