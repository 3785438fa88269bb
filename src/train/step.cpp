// One global step of one rank (include/mnist_mpi/train/step.hpp).
#include "mnist_mpi/train/step.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/rng.hpp"

namespace mnist_mpi {

namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

// Note [Averaging is a scaled sum]
// Each rank's loss gradient is scaled by 1 / GLOBAL batch (not by 1 / its own slice), so its
// backward produces (sum of its slice's per-sample gradients) / B. The allreduce then SUMS these
// over the ranks: the result is exactly the gradient of the mean loss over the whole global batch,
// for every parameter, since the allreduce covers the whole flat gradient buffer [0, param_count).
// No division after the reduction, nothing to forget for "the other variables".
Step::Step(const StepParts& parts, const StepShape& shape)
    : p_(parts), shape_(shape), grad_scale_(1.0f / static_cast<float>(shape.global_batch)) {
  MNIST_CHECK(p_.backend && p_.model && p_.params && p_.grads && p_.reducer && p_.optimizer && p_.guard && p_.sampler &&
                  p_.data && p_.loss,
              ExitCode::kRuntime, "Step: a part is missing");
  if (shape_.graph) graph_ = p_.backend->make_step_graph();
  // A graph replays body(), which is not the exact step. The options' table refuses both pairs with
  // the fix (src/config/combinations.cpp); a Step made in code that has them is a program error.
  MNIST_CHECK(!shape_.graph || !p_.exact, ExitCode::kRuntime, "Step: a CUDA graph of the exact step");
  MNIST_CHECK(!shape_.graph || graph_, ExitCode::kRuntime, "Step: a CUDA graph on a backend that has none");
  const ModelSpec& spec = p_.model->spec();
  if (shape_.accumulation > 1) p_.backend->allocate(spec.param_count).swap(accum_);
  if (shape_.global_batch % (shape_.world * shape_.accumulation) != 0)  // Note [Uneven slices]
    p_.backend->allocate(shape_.batch * spec.num_classes()).swap(zeros_);
  owned_ = p_.reducer->owned();
  plain_copies_ = p_.model->plain_bf16_copies();
  layer_params_.assign(spec.layers.size(), {0, 0});
  for (const ParamTensor& t : spec.params) {
    auto& [begin, size] = layer_params_[static_cast<std::size_t>(t.layer)];
    if (size == 0 || t.offset < begin) begin = t.offset;
    size += t.size;
  }
  if (p_.exact) {  // Note [A weight gradient written once as integers] in include/mnist_mpi/backend/layer.hpp
    // Note [The row-wise tail at the rank's batch]: the layers from `first` on compute each row alone.
    int first = static_cast<int>(spec.layers.size());
    const auto row_wise = [](LayerKind k) {
      return k == LayerKind::kFc || k == LayerKind::kRelu || k == LayerKind::kDropout || k == LayerKind::kFlatten;
    };
    while (first > 0 && row_wise(spec.layers[static_cast<std::size_t>(first - 1)].kind)) --first;
    exact_plan_ = "every layer chunk by chunk";
    // The tail's start-up check reads and writes the buffers from the host: on a GPU every layer
    // runs chunk by chunk.
    if (!p_.backend->host_buffers())
      exact_plan_ = "every layer chunk by chunk (on a GPU)";
    else if (shape_.my_chunks.count > 1 && first < static_cast<int>(spec.layers.size()))
      try_tail(first);
    taker_ = tail_ ? tail_.get() : p_.model;
    taken_layer_.assign(spec.layers.size(), 0);
    std::int64_t taken = 0;
    for (const Model::TakenWeight& w : taker_->take_weight_gradients(static_cast<int>(shape_.my_chunks.count),
                                                                     static_cast<int>(shape_.batch), *p_.exact)) {
      p_.exact->take(w.offset, w.size);
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
  // On the last micro-batch of a step, a layer's gradients become final when the earlier
  // micro-batches' sum is added to them; only then may their bucket start.
  on_layer_done_ = [this](int layer) {
    if (p_.exact) {
      if (taken_layer_[static_cast<std::size_t>(layer)]) taker_->finish_weight_gradient(layer);
      p_.exact->absorb_layer(p_.grads->data(), layer, exact_first_chunk_);
    }
    if (accumulating_) {
      const auto [begin, size] = layer_params_[static_cast<std::size_t>(layer)];
      if (size > 0) p_.backend->add(p_.grads->data() + begin, accum_->data() + begin, size);
    }
    if (p_.timeline) p_.timeline->layer_done(layer);
    p_.reducer->on_layer_done(layer);
    if (p_.timeline) p_.timeline->backward_resumes();
  };
}

void Step::use_order(std::int64_t epoch) {
  if (epoch != order_epoch_) {  // once per epoch (a GPU copies the permutation then)
    p_.data->set_order(p_.sampler->order(epoch));
    order_epoch_ = epoch;
  }
}

// Note [A step as one CUDA graph] (include/mnist_mpi/backend/backend.hpp): the step's values go to
// the backend first, and the epoch's order is in place before the step is queued, so that a
// graph captured at one step replays any other. The first run is not captured (it lets cuDNN,
// cuBLAS and NCCL finish their lazy set-up), nor is a step the testing hook poisons.
StepResult Step::run(std::int64_t step, double lr, bool poison) {
  StepResult r;
  r.begin = Clock::now();
  const Slice first = p_.sampler->slice(step, shape_.rank * shape_.accumulation, shape_.world * shape_.accumulation);
  p_.backend->set_step_args(step, lr, first.position - first.first);
  use_order(first.epoch);  // every micro-batch of a step is in the same epoch
  if (graph_ && !poison && runs_ > 0) {
    if (!graph_->captured()) {
      StepTiming ignored;  // nothing runs while it is recorded
      graph_->capture([&] { body(step, lr, false, ignored); });
    }
    graph_->replay();  // host times of the parts are not known: one launch
    slow_down();       // on the host, after the launch: the next step's launch waits
    ++replays_;
  } else {
    if (p_.exact)
      body_exact(step, lr, poison, r.timing);
    else
      body(step, lr, poison, r.timing);
  }
  ++runs_;
  p_.guard->end_step(step);
  r.end = Clock::now();
  if (p_.timeline) p_.timeline->step_done(step, r.begin, r.end, p_.reducer->bucket_timings());
  return r;
}

// One micro-batch up to its backward: its images, forward, the loss (added to `loss`) and its
// gradient, with the rows past a short slice zeroed, and the guard's look at the loss.
StepContext Step::forward_and_loss(std::int64_t step, const Slice& slice, LossMeter& loss, bool poison, Timeline* tl,
                                   MicroTimes& at) {
  const ModelSpec& spec = p_.model->spec();
  at.start = Clock::now();
  p_.data->gather(slice.position, slice.count, p_.model->input());
  at.data = Clock::now();
  StepContext ctx{true, shape_.seed, step, slice.first};
  ctx.copies_current = copies_current_;  // Note [Weight copies kept between passes] in src/backend/cpu/bf16.cpp
  p_.model->forward(ctx);
  copies_current_ = true;  // made by this pass (and its backward): only apply() writes the parameters
  p_.backend->softmax_cross_entropy(p_.model->logits(), p_.data->labels(), static_cast<int>(slice.count),
                                    spec.num_classes(), p_.model->dlogits(), grad_scale_, loss);
  if (slice.count < shape_.batch) {  // a short micro-batch: its rows past the slice add nothing
    const std::int64_t classes = spec.num_classes();
    p_.backend->copy(p_.model->dlogits() + slice.count * classes, zeros_->data(), (shape_.batch - slice.count) * classes);
  }
  p_.guard->after_loss(loss, p_.model->dlogits(), poison);
  at.loss = Clock::now();
  if (tl) tl->backward_starts(at.loss, step);
  return ctx;
}

// Micro-batch `index`'s spans (the last one's backward is recorded by layer) and host times, its
// backward ended at `end`.
void Step::record_micro(std::int64_t step, std::int64_t index, bool last, const MicroTimes& at,
                        Clock::time_point end, Timeline* tl, StepTiming& timing) {
  if (tl) {
    tl->record(SpanKind::kData, at.start, at.data, step, static_cast<std::int32_t>(index));
    tl->record(SpanKind::kForward, at.data, at.loss, step, static_cast<std::int32_t>(index));
    if (!last) tl->record(SpanKind::kBackward, at.loss, end, step);
  }
  timing.data += seconds(at.data - at.start);
  timing.forward += seconds(at.loss - at.data);
  timing.backward += seconds(end - at.loss);
}

void Step::body(std::int64_t step, double lr, bool poison, StepTiming& timing) {
  p_.guard->begin_step();
  const ModelSpec& spec = p_.model->spec();
  Clock::time_point backward_end;
  for (std::int64_t micro = 0; micro < shape_.accumulation; ++micro) {
    const bool last = micro + 1 == shape_.accumulation;
    // Note [Micro-batches and positions] (include/mnist_mpi/data/sampler.hpp)
    const Slice slice =
        p_.sampler->slice(step, shape_.rank * shape_.accumulation + micro, shape_.world * shape_.accumulation);
    MicroTimes at;
    const StepContext ctx = forward_and_loss(step, slice, *p_.loss, poison && last, p_.timeline, at);
    if (last) {
      accumulating_ = shape_.accumulation > 1;
      p_.model->backward(ctx, on_layer_done_);
      accumulating_ = false;
    } else {  // like DDP's no_sync: no reduction, the gradients are summed locally
      p_.model->backward(ctx);
      if (micro == 0)
        p_.backend->copy(accum_->data(), p_.grads->data(), spec.param_count);
      else
        p_.backend->add(accum_->data(), p_.grads->data(), spec.param_count);
    }
    if (last) slow_down();
    backward_end = Clock::now();
    record_micro(step, micro, last, at, backward_end, p_.timeline, timing);
  }
  apply(step, lr, backward_end, timing);
}

// Note [Exact sums in fixed point]; the limits: Note [Where the shift comes from]. Every rank runs
// its chunks one after another with kernels of the chunk's batch, so a chunk's gradient is the
// same bits on whichever rank computes it; backward of the last one starts the buckets of integers
// as its layers finish. The sums' counters decide, the same on every rank: a value beyond its
// tensor's limit means probe and compute the step again.
void Step::body_exact(std::int64_t step, double lr, bool poison, StepTiming& timing) {
  p_.guard->begin_step();
  ExactSums& x = *p_.exact;
  LossMeter* loss = p_.loss;  // the loss of the step is counted once, whatever is computed again
  for (;;) {
    if (x.needs_probe()) {
      exact_pass(step, /*probe=*/true, false, *p_.scratch_loss, timing);
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
    if (sums.counts.out_of_range == 0 || sums.counts.nonfinite > 0) {
      apply(step, lr, backward_end, timing, /*sums_in=*/true);
      return;
    }
    x.require_probe();  // out of range: the exact limits of this step, then the step again
    loss = p_.scratch_loss;
  }
}

Clock::time_point Step::exact_pass(std::int64_t step, bool probe, bool poison, LossMeter& loss, StepTiming& timing) {
  ExactSums& x = *p_.exact;
  Timeline* const tl = probe ? nullptr : p_.timeline;
  if (probe)
    x.begin_probe();
  else
    x.begin_pass();
  if (tail_) return exact_pass_tail(step, probe, poison, loss, tl, timing);
  Clock::time_point backward_end;
  for (std::int64_t j = 0; j < shape_.my_chunks.count; ++j) {
    const bool last = j + 1 == shape_.my_chunks.count;
    const Slice slice = p_.sampler->slice(step, shape_.my_chunks.first + j, shape_.chunks);  // c images
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
void Step::try_tail(int first) {
  // A model per chunk: with many chunks a rank they would cost more in memory and start-up than
  // the tail saves (the activations of the rank's whole batch, as the default mode holds).
  const std::int64_t k = shape_.my_chunks.count;
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

void Step::build_tail(int first) {
  const ModelSpec& spec = p_.model->spec();
  const int c = static_cast<int>(shape_.batch), k = static_cast<int>(shape_.my_chunks.count);
  Backend& be = *p_.backend;
  tail_ = std::make_unique<Model>(spec, k * c, be, p_.params->data(), p_.grads->data(), p_.model->state(),
                                  ModelPart{first, -1});
  const std::int64_t row = spec.activation(static_cast<std::size_t>(first)).size();
  if (first > 0)
    for (int j = 0; j < k; ++j) {
      const std::int64_t at = static_cast<std::int64_t>(j) * c * row;
      heads_.push_back(std::make_unique<Model>(
          spec, c, be, p_.params->data(), p_.grads->data(), p_.model->state(),
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

std::string Step::describe_layers() const {
  if (!tail_) return p_.model->describe();
  return (heads_.empty() ? std::string() : heads_.front()->describe()) + tail_->describe();
}

float* Step::chunk_input(std::int64_t j) {
  if (!heads_.empty()) return heads_[static_cast<std::size_t>(j)]->input();
  const std::int64_t pixels = p_.model->spec().input.size();
  return tail_->input() + j * shape_.batch * pixels;
}

bool Step::tail_matches_chunks(int first) {
  const ModelSpec& spec = p_.model->spec();
  const std::int64_t c = shape_.batch, k = shape_.my_chunks.count, L = static_cast<std::int64_t>(spec.layers.size());
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
  float* params = p_.params->data();
  std::vector<float> saved(params, params + spec.param_count);
  for (std::int64_t i = 0; i < spec.param_count; ++i) params[i] = (uniform() - 0.5f) * 0.2f;
  struct Restore {
    float* to;
    const std::vector<float>& from;
    ~Restore() { std::copy(from.begin(), from.end(), to); }
  } restore{params, saved};
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

// MNIST_MPI_FAULT=RANK:slow:MS (include/mnist_mpi/resilience/fault.hpp): this rank sleeps at the
// end of every step's backward, on every path (the plain step, the exact sums' passes, a replayed
// CUDA graph), so that the others wait for it.
void Step::slow_down() const {
  if (shape_.slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(shape_.slow_ms));
}

// A probe pass's end for the taken weights: every chunk's at once, to the sink (which probes).
void Step::finish_taken() {
  for (std::size_t layer = 0; layer < taken_layer_.size(); ++layer)
    if (taken_layer_[layer]) taker_->finish_weight_gradient(static_cast<int>(layer));
}

// exact_pass with the tail at the rank's batch (Note [The row-wise tail at the rank's batch]).
Clock::time_point Step::exact_pass_tail(std::int64_t step, bool probe, bool poison, LossMeter& loss, Timeline* tl,
                                        StepTiming& timing) {
  ExactSums& x = *p_.exact;
  const ModelSpec& spec = p_.model->spec();
  const std::int64_t c = shape_.batch, k = shape_.my_chunks.count;
  MicroTimes at;
  at.start = Clock::now();
  std::int64_t first_sample = 0;
  for (std::int64_t j = 0; j < k; ++j) {
    const Slice slice = p_.sampler->slice(step, shape_.my_chunks.first + j, shape_.chunks);  // c images
    MNIST_CHECK(slice.count == c, ExitCode::kRuntime, "exact sums: a chunk shorter than its size");
    if (j == 0) first_sample = slice.first;
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

// The optimiser's update of [begin, end), with the model's weight copies made again where it
// changes them (Note [Weight copies kept between passes] in src/backend/cpu/bf16.cpp): the plain
// bf16 copies by the optimiser's own pass, the others (small, a convolution's) by the next pass.
void Step::update(std::int64_t begin, std::int64_t end) {
  float* p = p_.params->data();
  float* g = p_.grads->data();
  Optimizer& opt = *p_.optimizer;
  const bool second = opt.two_phase();
  const auto pass = [&](std::int64_t lo, std::int64_t hi, std::uint16_t* copy) {
    if (second)
      opt.update_second(p, g, lo, hi, copy);
    else
      opt.update(p, g, lo, hi, copy);
  };
  const auto rest = [&](std::int64_t lo, std::int64_t hi) {  // a range outside every plain copy
    if (lo >= hi) return;
    pass(lo, hi, nullptr);
    p_.model->refresh_copies(p + lo, p + hi);
  };
  std::int64_t at = begin;
  for (const LayerKernel::PlainCopy& c : plain_copies_) {  // in the buffer's order
    const std::int64_t c0 = c.begin - p, c1 = c.end - p;
    const std::int64_t lo = std::max(at, c0), hi = std::min(end, c1);
    if (lo >= hi) continue;
    rest(at, lo);
    pass(lo, hi, c.copy + (lo - c0));
    at = hi;
  }
  rest(at, end);
}

// The optimiser waits only for what it needs: bucket k's parameters are updated as soon as its
// sum is in, while the later buckets are still being summed (the update is elementwise, so the
// bits are those of one pass over the whole buffer). Each bucket is checked before it is applied
// (Note [Non-finite steps]). With check_all_first (--skip-nonfinite-steps) every bucket is waited
// for and checked before the first is applied, so that a skipped step changes nothing; without
// it a bucket the guard refuses stops the updates there, and the run stops after the step.
// Sharded (Note [Sharded optimiser state] in include/mnist_mpi/train/optimizer.hpp): a bucket's
// sum is this rank's shard of it, which is all the rank checks and updates; the guard's verdicts
// are then agreed on, and every bucket's parameters are gathered, updated or not, so that every
// rank starts the same collectives in the same order.
void Step::apply(std::int64_t step, double lr, Clock::time_point backward_end, StepTiming& t, bool sums_in) {
  Reducer& reducer = *p_.reducer;
  const std::vector<Bucket>& buckets = reducer.buckets();
  const bool sharded = reducer.sharded();
  const auto ok = [&](std::size_t k) {
    const ParamRange mine = reducer.shard(k);
    return p_.guard->bucket_ok(p_.grads->data() + mine.begin, mine.end - mine.begin);
  };
  if (!sums_in) t.exposed_comm = reducer.start_remaining();
  const bool check_all_first = shape_.check_all_first || sums_in;  // with every sum in, nothing to overlap
  bool finite = true;
  std::size_t waited = 0;  // buckets whose sums are in (a sum already in returns at once)
  if (check_all_first) {
    for (; waited < buckets.size(); ++waited) {
      t.exposed_comm += reducer.wait_bucket(waited);
      finite = finite && ok(waited);
    }
    if (sharded) finite = p_.guard->agree(reducer.communicator()) && finite;
  }
  std::size_t gathered = 0;  // sharded: buckets whose gathers have started
  const bool two_phase =
      p_.optimizer->two_phase();  // Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp
  if (finite) {
    p_.optimizer->begin_step(lr);
    auto waited_from = backward_end;  // for the timeline: when the wait for bucket k began
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      if (k >= waited) {
        t.exposed_comm += reducer.wait_bucket(k);
        waited = k + 1;
        if (!ok(k)) {
          finite = false;
          break;
        }
      }
      const auto o0 = Clock::now();
      const ParamRange mine = reducer.shard(k);
      if (two_phase)  // the first phase: the parameters are written after the last bucket
        p_.optimizer->update(p_.params->data(), p_.grads->data(), mine.begin, mine.end);
      else
        update(mine.begin, mine.end);
      const auto o1 = Clock::now();
      t.optimizer += seconds(o1 - o0);
      if (sharded && !two_phase) reducer.start_gather(gathered++);
      if (p_.timeline) p_.timeline->bucket_updated(step, k, waited_from, o0, o1);
      waited_from = o1;
    }
  }
  for (; waited < buckets.size(); ++waited) t.exposed_comm += reducer.wait_bucket(waited);  // none left in flight
  bool agreed = check_all_first;
  if (two_phase) gathered = second_phase(finite, agreed, t);
  if (!sharded) return;
  for (; gathered < buckets.size(); ++gathered) reducer.start_gather(gathered);  // not updated: the same bits
  // The gathers first: on the CPU the caller then sleeps in wait() while the communication thread
  // has the core, where a blocking collective beside it would spin against it.
  t.exposed_comm += reducer.wait_gathers();
  const auto r0 = Clock::now();
  for (std::size_t k = 0; k < buckets.size(); ++k) {  // the other ranks' shards, gathered
    const ParamRange mine = reducer.shard(k);
    float* p = p_.params->data();
    p_.model->refresh_copies(p + buckets[k].begin, p + mine.begin);
    p_.model->refresh_copies(p + mine.end, p + buckets[k].end);
  }
  t.optimizer += seconds(Clock::now() - r0);
  if (!agreed) p_.guard->agree(reducer.communicator());
}

// Note [LAMB in two phases] (include/mnist_mpi/train/optimizer.hpp). Sharded, the norms are one
// allreduce, so the ranks first agree on the guard's verdicts (each checked its own shards): a
// rank that stopped at a refused bucket must not leave the others waiting in it.
std::size_t Step::second_phase(bool finite, bool& agreed, StepTiming& t) {
  Reducer& reducer = *p_.reducer;
  const bool sharded = reducer.sharded();
  if (sharded && !agreed) {
    finite = p_.guard->agree(reducer.communicator()) && finite;
    agreed = true;
  }
  if (!finite) return 0;
  const auto o0 = Clock::now();
  const double waited = p_.optimizer->finish_first_phase(sharded ? &reducer.communicator() : nullptr);
  std::size_t gathered = 0;
  for (std::size_t k = 0; k < reducer.buckets().size(); ++k) {
    const ParamRange mine = reducer.shard(k);
    update(mine.begin, mine.end);
    if (sharded) reducer.start_gather(gathered++);
  }
  t.exposed_comm += waited;
  t.optimizer += seconds(Clock::now() - o0) - waited;
  return gathered;
}

}  // namespace mnist_mpi
