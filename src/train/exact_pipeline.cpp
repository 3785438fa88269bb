// The exact gradient pipeline (--exact-sums; include/mnist_mpi/train/gradient_pipeline.hpp): the
// gradient of the global batch as an exact sum of its chunks' gradients, whatever the number of
// ranks (include/mnist_mpi/train/exact_sums.hpp), with the row-wise tail at the rank's batch where
// its kernels allow it (Note [The row-wise tail at the rank's batch], below).
#include <cstdio>
#include <cstring>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/rng.hpp"
#include "mnist_mpi/train/exact_sums.hpp"
#include "mnist_mpi/train/gradient_mode.hpp"
#include "mnist_mpi/train/gradient_pipeline.hpp"

namespace mnist_mpi {
namespace {

// What the exact pipeline needs besides the step's parts: the integers and limits, a loss meter
// for passes computed again (not counted twice), the global batch's chunks and this rank's (Note
// [Chunks of the global batch]; the shape's batch is then the chunk's size).
struct ExactParts {
  ExactSums* sums = nullptr;
  LossMeter* scratch_loss = nullptr;
  std::int64_t chunks = 0;
  ChunkRange my_chunks;
};

}  // namespace

namespace {
using Clock = std::chrono::steady_clock;

class ExactGradients final : public GradientPipeline {
 public:
  ExactGradients(const StepParts& parts, const StepShape& shape, const ExactParts& exact);
  Computed compute(std::int64_t step, bool poison, StepTiming& timing) override;
  std::string describe_layers() const override;
  std::string plan() const override { return "exact sums: " + exact_plan_; }
  bool replayable() const override { return false; }  // the host decides whether to compute a step again

 private:
  // A layer's gradient on the last pass: its taken weight's chunks, then every chunk's values of
  // the layer, into the integers.
  void finish_layer(int layer) override {
    if (taken_layer_[static_cast<std::size_t>(layer)]) taker_->finish_weight_gradient(layer);
    x_.sums->absorb_layer(p_.grads->data(), layer, exact_first_chunk_);
  }
  // One pass over this rank's chunks: probe (only the largest values) or sum into the integers;
  // returns when backward of the last chunk ended.
  Clock::time_point exact_pass(std::int64_t step, bool probe, bool poison, LossMeter& loss, StepTiming& timing);
  // The same pass, once begun, with the row-wise tail at the rank's batch (Note [The row-wise tail
  // at the rank's batch]); tl: the timeline, or null.
  Clock::time_point exact_pass_tail(std::int64_t step, bool probe, bool poison, LossMeter& loss, Timeline* tl,
                                    StepTiming& timing);
  // Builds the head and tail models from layer `first` on, and keeps them only if the tail at the
  // rank's batch and the heads give the chunk-by-chunk model's bits on random data.
  void try_tail(int first);
  void build_tail(int first);
  static constexpr int kMaxTailChunks = 64;  // chunks a rank: a head model each
  bool tail_matches_chunks(int first);
  float* chunk_input(std::int64_t j);  // where chunk j's images go
  void finish_taken();                 // every taken weight's chunks to the sink

  ExactParts x_;
  std::vector<ParamRange> owned_;           // the reducer's owned ranges: the sums this rank receives
  bool exact_first_chunk_ = false;          // the pass's first chunk assigns the integers
  std::vector<char> taken_layer_;           // layers whose kernel hands its weight gradient over
  Model* taker_ = nullptr;                  // the model whose kernels took them (the tail, or p_.model)
  std::vector<std::unique_ptr<Model>> heads_;  // with a tail: chunk j's layers before the tail
  std::unique_ptr<Model> tail_;                // the row-wise tail at the rank's batch, if it agrees
  std::vector<std::int32_t> tail_labels_;      // the rank's chunks' labels, in chunk order
  std::string exact_plan_;
};

ExactGradients::ExactGradients(const StepParts& parts, const StepShape& shape, const ExactParts& exact)
    : GradientPipeline(parts, shape), x_(exact), owned_(parts.reducer->owned()) {
  MNIST_CHECK(x_.sums && x_.scratch_loss, ExitCode::kRuntime, "exact sums: the integers and a scratch loss are needed");
  const ModelSpec& spec = p_.model->spec();
  // Note [A weight gradient written once as integers] in include/mnist_mpi/backend/layer.hpp
  // Note [The row-wise tail at the rank's batch]: the layers from `first` on compute each row alone.
  int first = static_cast<int>(spec.layers.size());
  while (first > 0 && layer_traits(spec.layers[static_cast<std::size_t>(first - 1)].kind).row_wise) --first;
  exact_plan_ = "every layer chunk by chunk";
  // The tail's start-up check reads and writes the buffers from the host: on a GPU every layer
  // runs chunk by chunk.
  if (!p_.backend->host_buffers())
    exact_plan_ = "every layer chunk by chunk (on a GPU)";
  else if (x_.my_chunks.count > 1 && first < static_cast<int>(spec.layers.size()))
    try_tail(first);
  taker_ = tail_ ? tail_.get() : p_.model;
  taken_layer_.assign(spec.layers.size(), 0);
  std::int64_t taken = 0;
  for (const Model::TakenWeight& w : taker_->take_weight_gradients(static_cast<int>(x_.my_chunks.count),
                                                                   static_cast<int>(shape_.batch), *x_.sums)) {
    x_.sums->take(w.offset, w.size);
    taken_layer_[static_cast<std::size_t>(w.layer)] = 1;
    taken += w.size;
  }
  // The tail computes k chunks in one call: a parameter of it that its kernel did not take would
  // reach the integers as one sum of k chunks, not k of them.
  std::int64_t tail_params = 0;
  for (const ParamTensor& t : spec.params) tail_params += tail_ && t.layer >= tail_->first_layer() ? t.size : 0;
  MNIST_CHECK(!tail_ || taken == tail_params, ExitCode::kRuntime,
              "exact sums: a kernel of the row-wise tail did not take its parameters' gradients over");
}

// Note [Exact sums in fixed point]; the limits: Note [Where the shift comes from]. Every rank runs
// its chunks one after another with kernels of the chunk's batch, so a chunk's gradient is the
// same bits on whichever rank computes it; backward of the last one starts the buckets of integers
// as its layers finish. The sums' counters decide, the same on every rank: a value beyond its
// tensor's limit means probe and compute the step again.
GradientPipeline::Computed ExactGradients::compute(std::int64_t step, bool poison, StepTiming& timing) {
  p_.guard->begin_step();
  ExactSums& x = *x_.sums;
  LossMeter* loss = p_.loss;  // the loss of the step is counted once, whatever is computed again
  for (;;) {
    if (x.needs_probe()) {
      exact_pass(step, /*probe=*/true, false, *x_.scratch_loss, timing);
      x.finish_probe(p_.reducer->communicator());
    }
    const Clock::time_point backward_end = exact_pass(step, false, poison, *loss, timing);
    timing.exposed_comm += p_.reducer->finish();
    // On a GPU finish() only queued the waits: the sums end here (a no-op on the CPU), so that
    // their time is not counted as the conversion's.
    const auto s0 = Clock::now();
    p_.backend->synchronize();
    const auto c0 = Clock::now();
    timing.exposed_comm += seconds(c0 - s0);
    // The MAX of the limits waits for the slowest rank: exposed communication, not the optimizer's.
    const ExactSums::Sums sums =
        x.to_float(p_.grads->data(), owned_, p_.reducer->sharded() ? &p_.reducer->communicator() : nullptr);
    timing.optimizer += seconds(Clock::now() - c0) - sums.waited;
    timing.exposed_comm += sums.waited;
    if (sums.counts.out_of_range == 0 || sums.counts.nonfinite > 0) return {backward_end, true};
    x.require_probe();  // out of range: the exact limits of this step, then the step again
    loss = x_.scratch_loss;
  }
}

Clock::time_point ExactGradients::exact_pass(std::int64_t step, bool probe, bool poison, LossMeter& loss, StepTiming& timing) {
  ExactSums& x = *x_.sums;
  Timeline* const tl = probe ? nullptr : p_.timeline;
  if (probe)
    x.begin_probe();
  else
    x.begin_pass();
  if (tail_) return exact_pass_tail(step, probe, poison, loss, tl, timing);
  Clock::time_point backward_end;
  for (std::int64_t j = 0; j < x_.my_chunks.count; ++j) {
    const bool last = j + 1 == x_.my_chunks.count;
    const Slice slice = p_.sampler->slice(step, x_.my_chunks.first + j, x_.chunks);  // c images
    MicroTimes at;
    const StepContext ctx = forward_and_loss(step, slice, loss, poison && last, tl, at);
    exact_first_chunk_ = j == 0;
    if (probe) {
      p_.model->backward(ctx);
      x.probe_chunk(p_.grads->data());
      if (last) finish_taken();  // the taken weights, every chunk at once
    } else if (last) {
      p_.model->backward(ctx, on_layer_done_);  // absorbs each layer, then starts its buckets
      slow_down();
    } else {
      p_.model->backward(ctx);
      x.absorb_all(p_.grads->data(), exact_first_chunk_);
    }
    backward_end = Clock::now();
    record_micro(step, j, last, at, backward_end, tl, timing);
  }
  return backward_end;
}

// Note [The row-wise tail at the rank's batch]
// With --exact-sums a rank computes its chunks of c images one after another with kernels of batch
// c, so that a chunk's gradient is the same bits on whichever rank computes it. That costs most
// where a layer reads much for few rows: lenet's fc1 at batch 10 reads its 12.8 MB of weights once
// per chunk, forward and backward (5 chunks on 2 ranks: 3.4 ms of a 30 ms step more than at batch
// 50). The layers at the end of a model that compute every row on its own (fc, ReLU, dropout,
// flatten: a row of the output depends on that row of the input only, a row of the input
// gradient on that row of the output gradient only) may run at the rank's batch k c instead, if
// their kernels give each row the bits they give it at batch c. That is a property of the kernels
// oneDNN picks for the two batch sizes (the order of each row's sums), not of the values, so the
// step checks it at set-up instead of assuming it (try_tail): on the same random parameters (the
// run's are put back after), images and output gradients it runs the model chunk by chunk at
// batch c (p_.model) and the new way, and compares bit for bit every activation and activation
// gradient of the tail, the heads' outputs, and every chunk's gradient of the head's parameters. An order of summation does not depend on the data, so
// the same bits on random data are the same bits on any data. Then a pass is:
//   - the head (the layers before the tail) chunk by chunk at batch c, one head model per chunk,
//     each writing its rows of the tail's input;
//   - the tail once at batch k c: forward, loss, backward. Its fc kernels keep each chunk's rows
//     and hand each chunk's weight and bias gradient to the integers in tiles, as chunk by chunk;
//   - the heads' backward, chunk by chunk, each chunk's gradient into the integers.
// Every chunk's gradient is the bits it was chunk by chunk (the exact runs' params_hash did not
// move), and the integers make the order of the chunks irrelevant. Where any bit differs, where a
// rank has more than kMaxTailChunks chunks (a head model each), or where the tail cannot be built,
// the step stays chunk by chunk, and the banner says which.
void ExactGradients::try_tail(int first) {
  // A model per chunk: with many chunks a rank they would cost more in memory and start-up than
  // the tail saves (the activations of the rank's whole batch, as the default mode holds).
  const std::int64_t k = x_.my_chunks.count;
  if (k > kMaxTailChunks) {
    exact_plan_ = "every layer chunk by chunk (" + std::to_string(k) + " chunks a rank: the tail is tried up to " +
                  std::to_string(kMaxTailChunks) + ")";
    return;
  }
  try {
    build_tail(first);
  } catch (const std::exception& e) {  // memory, most likely: the chunk-by-chunk plan needs none of it
    heads_.clear();
    tail_.reset();
    exact_plan_ = std::string("every layer chunk by chunk (the tail could not be built: ") + e.what() + ")";
  }
}

void ExactGradients::build_tail(int first) {
  const ModelSpec& spec = p_.model->spec();
  const int c = static_cast<int>(shape_.batch), k = static_cast<int>(x_.my_chunks.count);
  Backend& be = *p_.backend;
  tail_ = std::make_unique<Model>(spec, k * c, be, *p_.params, p_.grads->data(), ModelPart{first, -1});
  const std::int64_t row = spec.activation(static_cast<std::size_t>(first)).size();
  if (first > 0)
    for (int j = 0; j < k; ++j) {
      const std::int64_t at = static_cast<std::int64_t>(j) * c * row;
      heads_.push_back(std::make_unique<Model>(spec, c, be, *p_.params, p_.grads->data(),
                                               ModelPart{0, first, const_cast<float*>(tail_->activation(first)) + at,
                                                         const_cast<float*>(tail_->activation_gradient(first)) + at}));
    }
  tail_labels_.assign(static_cast<std::size_t>(k) * static_cast<std::size_t>(c), 0);
  const std::string layers = "layers " + std::to_string(first) + "-" + std::to_string(spec.layers.size() - 1);
  const auto t0 = Clock::now();
  const bool same = tail_matches_chunks(first);
  char took[32];
  std::snprintf(took, sizeof took, "%.2f s", seconds(Clock::now() - t0));
  if (same) {
    exact_plan_ = layers + " at the rank's batch of " + std::to_string(k * c) +
                  (first > 0 ? ", the layers before chunk by chunk" : "") + " (checked at start-up in " + took +
                  ": each chunk's rows the bits of batch " + std::to_string(c) + ")";
    return;
  }
  exact_plan_ = "every layer chunk by chunk (" + layers + " at batch " + std::to_string(k * c) +
                " gave rows other bits than at batch " + std::to_string(c) + ")";
  heads_.clear();
  tail_.reset();
}

std::string ExactGradients::describe_layers() const {
  if (!tail_) return p_.model->describe();
  return (heads_.empty() ? std::string() : heads_.front()->describe()) + tail_->describe();
}

float* ExactGradients::chunk_input(std::int64_t j) {
  if (!heads_.empty()) return heads_[static_cast<std::size_t>(j)]->input();
  const std::int64_t pixels = p_.model->spec().input.size();
  return tail_->input() + j * shape_.batch * pixels;
}

bool ExactGradients::tail_matches_chunks(int first) {
  const ModelSpec& spec = p_.model->spec();
  const std::int64_t c = shape_.batch, k = x_.my_chunks.count, L = static_cast<std::int64_t>(spec.layers.size());
  const auto row_size = [&](std::int64_t i) { return spec.activation(static_cast<std::size_t>(i)).size(); };
  std::uint64_t drawn = 0;  // the same random values on every rank (include/mnist_mpi/rng.hpp)
  const auto uniform = [&drawn] { return rng::uniform(rng::key(0x7A11, drawn++)); };
  std::vector<float> images(static_cast<std::size_t>(k * c * spec.input.size()));
  for (float& v : images) v = uniform();
  std::vector<float> dlogits(static_cast<std::size_t>(k * c * spec.num_classes()));
  for (float& v : dlogits) v = (uniform() - 0.5f) * 0.02f;
  // Random parameters too: with the run's own (all zero under --weight-init zeros, say) every
  // product could be 0 whatever the order of its sums, and the comparison would prove nothing.
  // They are the run's again when it returns.
  // Both writes go through leases (Note [Writes that report themselves]), so the kernels' copies
  // follow the random parameters and then the run's again.
  const float* params = p_.params->data();
  std::vector<float> saved(params, params + spec.param_count);
  {
    const ParameterStore::Lease random = p_.params->write_all();
    for (float& v : random.span()) v = (uniform() - 0.5f) * 0.2f;
  }
  struct Restore {
    ParameterStore& to;
    const std::vector<float>& from;
    ~Restore() {
      const ParameterStore::Lease back = to.write_all();
      std::copy(from.begin(), from.end(), back.data());
    }
  } restore{*p_.params, saved};
  const auto ctx = [&](std::int64_t j) { return StepContext{true, shape_.seed, 0, j * c}; };
  // The head's parameters: layers [0, first).
  std::vector<std::pair<std::int64_t, std::int64_t>> head;
  for (std::int64_t i = 0; i < first; ++i)
    if (layer_params_[static_cast<std::size_t>(i)].second > 0) head.push_back(layer_params_[static_cast<std::size_t>(i)]);
  const float* grads = p_.grads->data();
  const auto head_grads = [&] {
    std::vector<float> g;
    for (const auto& [begin, size] : head) g.insert(g.end(), grads + begin, grads + begin + size);
    return g;
  };
  // Chunk by chunk at batch c: what every activation (i in [first, L]) and gradient must be.
  Model& ref = *p_.model;
  std::vector<std::vector<float>> act(static_cast<std::size_t>(L + 1)), dact(static_cast<std::size_t>(L + 1));
  std::vector<std::vector<float>> head_want;
  for (std::int64_t j = 0; j < k; ++j) {
    std::copy_n(images.data() + j * c * spec.input.size(), c * spec.input.size(), ref.input());
    ref.forward(ctx(j));
    std::copy_n(dlogits.data() + j * c * spec.num_classes(), c * spec.num_classes(), ref.dlogits());
    for (std::int64_t i = first; i <= L; ++i) {
      const auto u = static_cast<std::size_t>(i);
      act[u].insert(act[u].end(), ref.activation(static_cast<int>(i)), ref.activation(static_cast<int>(i)) + c * row_size(i));
    }
    ref.backward(ctx(j));
    for (std::int64_t i = first; i <= L; ++i)
      if (const float* d = ref.activation_gradient(static_cast<int>(i)))
        dact[static_cast<std::size_t>(i)].insert(dact[static_cast<std::size_t>(i)].end(), d, d + c * row_size(i));
    head_want.push_back(head_grads());
  }
  // The head per chunk, the tail at batch k c.
  for (std::int64_t j = 0; j < k; ++j) {
    std::copy_n(images.data() + j * c * spec.input.size(), c * spec.input.size(), chunk_input(j));
    if (!heads_.empty()) heads_[static_cast<std::size_t>(j)]->forward(ctx(j));
  }
  tail_->forward(ctx(0));
  std::copy(dlogits.begin(), dlogits.end(), tail_->dlogits());
  tail_->backward(ctx(0));
  const auto same = [](const std::vector<float>& want, const float* got) {
    return std::memcmp(want.data(), got, want.size() * sizeof(float)) == 0;
  };
  bool ok = true;
  for (std::int64_t i = first; i <= L; ++i) {
    const auto u = static_cast<std::size_t>(i);
    ok = ok && same(act[u], tail_->activation(static_cast<int>(i)));
    if (!dact[u].empty()) ok = ok && tail_->activation_gradient(static_cast<int>(i)) != nullptr &&
                                same(dact[u], tail_->activation_gradient(static_cast<int>(i)));
  }
  for (std::int64_t j = 0; ok && j < static_cast<std::int64_t>(heads_.size()); ++j) {
    heads_[static_cast<std::size_t>(j)]->backward(ctx(j));
    ok = same(head_want[static_cast<std::size_t>(j)], head_grads().data());
  }
  return ok;
}

// A probe pass's end for the taken weights: every chunk's at once, to the sink (which probes).
void ExactGradients::finish_taken() {
  for (std::size_t layer = 0; layer < taken_layer_.size(); ++layer)
    if (taken_layer_[layer]) taker_->finish_weight_gradient(static_cast<int>(layer));
}

// exact_pass with the tail at the rank's batch (Note [The row-wise tail at the rank's batch]).
Clock::time_point ExactGradients::exact_pass_tail(std::int64_t step, bool probe, bool poison, LossMeter& loss, Timeline* tl,
                                        StepTiming& timing) {
  ExactSums& x = *x_.sums;
  const ModelSpec& spec = p_.model->spec();
  const std::int64_t c = shape_.batch, k = x_.my_chunks.count;
  MicroTimes at;
  at.start = Clock::now();
  std::int64_t first_sample = 0;
  for (std::int64_t j = 0; j < k; ++j) {
    const Slice slice = p_.sampler->slice(step, x_.my_chunks.first + j, x_.chunks);  // c images
    MNIST_CHECK(slice.count == c, ExitCode::kRuntime, "exact sums: a chunk shorter than its size");
    if (j == 0) first_sample = shape_.local_dropout_key ? 0 : slice.first;
    p_.data->gather(slice.position, c, chunk_input(j));
    std::copy_n(p_.data->labels(), c, tail_labels_.data() + j * c);
  }
  at.data = Clock::now();
  for (std::int64_t j = 0; j < static_cast<std::int64_t>(heads_.size()); ++j)
    heads_[static_cast<std::size_t>(j)]->forward(StepContext{true, shape_.seed, step, first_sample + j * c});
  const StepContext ctx{true, shape_.seed, step, first_sample};
  tail_->forward(ctx);
  p_.backend->softmax_cross_entropy(tail_->logits(), tail_labels_.data(), static_cast<int>(k * c), spec.num_classes(),
                                    tail_->dlogits(), grad_scale_, loss);
  p_.guard->after_loss(loss, tail_->dlogits(), poison);
  at.loss = Clock::now();
  if (tl) tl->backward_starts(at.loss, step);
  const bool heads = !heads_.empty();
  exact_first_chunk_ = true;
  if (probe) {
    tail_->backward(ctx);
    finish_taken();
  } else {
    // The tail's layers are done for every chunk (their weights taken, the rest without
    // parameters): their buckets may start. Without heads the last one is layer 0.
    tail_->backward(ctx, on_layer_done_);
  }
  for (std::int64_t j = 0; heads && j < k; ++j) {
    const bool last = j + 1 == k;
    const StepContext cj{true, shape_.seed, step, first_sample + j * c};
    exact_first_chunk_ = j == 0;
    Model& head = *heads_[static_cast<std::size_t>(j)];
    if (probe) {
      head.backward(cj);
      x.probe_chunk(p_.grads->data());
    } else if (last) {
      head.backward(cj, on_layer_done_);
    } else {
      head.backward(cj);
      x.absorb_all(p_.grads->data(), exact_first_chunk_);
    }
  }
  if (!probe) slow_down();
  const Clock::time_point backward_end = Clock::now();
  record_micro(step, 0, true, at, backward_end, tl, timing);
  return backward_end;
}

}  // namespace

namespace {

// --exact-sums: the integers, the fixed-point codec that sums them, the chunked pipeline, and the
// limits a checkpoint keeps (Note [Where the shift comes from] in include/mnist_mpi/train/exact_sums.hpp).
class ExactMode final : public GradientMode {
 public:
  ExactMode(const RunPlan& plan, const ModelSpec& spec, Backend& backend)
      : sums_(spec, plan.chunks(), &backend),
        fixed_(sums_.fixed()),
        scratch_loss_(backend.make_loss_meter()),
        chunks_(plan.chunks()),
        my_chunks_(plan.my_chunks) {}
  CodecFactory codec() const override { return fixed_point_codec(fixed_); }
  std::unique_ptr<GradientPipeline> pipeline(const StepParts& parts, const StepShape& shape) override {
    return std::make_unique<ExactGradients>(parts, shape, ExactParts{&sums_, scratch_loss_.get(), chunks_, my_chunks_});
  }
  double reduced_bytes() const override {  // 64-bit integers and two counters
    return static_cast<double>(fixed_.size()) * sizeof(std::int64_t);
  }
  std::span<const std::int32_t> limits() const override { return sums_.limits(); }
  void restore_limits(std::span<const std::int32_t> limits) override { sums_.set_limits(limits); }
  std::int64_t probes() const override { return sums_.probes(); }

 private:
  ExactSums sums_;
  std::span<std::int64_t> fixed_;  // sums_'s integers, in the backend's memory
  std::unique_ptr<LossMeter> scratch_loss_;
  std::int64_t chunks_;
  ChunkRange my_chunks_;
};

}  // namespace

std::unique_ptr<GradientMode> make_exact_mode(const RunPlan& plan, const ModelSpec& spec, Backend& backend) {
  return std::make_unique<ExactMode>(plan, spec, backend);
}

}  // namespace mnist_mpi
