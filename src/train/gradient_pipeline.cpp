// What the two gradient pipelines share, and the summed one
// (include/mnist_mpi/train/gradient_pipeline.hpp); the exact one is src/train/exact_pipeline.cpp.
#include "mnist_mpi/train/gradient_pipeline.hpp"

#include <thread>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/gradient_mode.hpp"

namespace mnist_mpi {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

// Note [Averaging is a scaled sum]
// Each rank's loss gradient is scaled by 1 / GLOBAL batch (not by 1 / its own slice), so its
// backward produces (sum of its slice's per-sample gradients) / B. The allreduce then SUMS these
// over the ranks: the result is exactly the gradient of the mean loss over the whole global batch,
// for every parameter, since the allreduce covers the whole flat gradient buffer [0, param_count).
// No division after the reduction, nothing to forget for "the other variables".
GradientPipeline::GradientPipeline(const StepParts& parts, const StepShape& shape)
    : p_(parts), shape_(shape), grad_scale_(1.0f / static_cast<float>(shape.global_batch)) {
  const ModelSpec& spec = p_.model->spec();
  if (shape_.global_batch % (shape_.world * shape_.accumulation) != 0)  // Note [Uneven slices]
    p_.backend->allocate(shape_.batch * spec.num_classes()).swap(zeros_);
  layer_params_.assign(spec.layers.size(), {0, 0});
  for (const ParamTensor& t : spec.params) {
    auto& [begin, size] = layer_params_[static_cast<std::size_t>(t.layer)];
    if (size == 0 || t.offset < begin) begin = t.offset;
    size += t.size;
  }
  // On the last pass of a step a layer's gradients become final once the pipeline has finished
  // them (finish_layer); only then may their bucket start.
  on_layer_done_ = [this](int layer) {
    finish_layer(layer);
    if (p_.timeline) p_.timeline->layer_done(layer);
    p_.reducer->on_layer_done(layer);
    if (p_.timeline) p_.timeline->backward_resumes();
  };
}

StepContext GradientPipeline::forward_and_loss(std::int64_t step, const Slice& slice, LossMeter& loss, bool poison,
                                               Timeline* tl, MicroTimes& at) {
  const ModelSpec& spec = p_.model->spec();
  at.start = Clock::now();
  p_.data->gather(slice.position, slice.count, p_.model->input());
  at.data = Clock::now();
  const StepContext ctx{true, shape_.seed, step, shape_.local_dropout_key ? 0 : slice.first};
  p_.model->forward(ctx);
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

void GradientPipeline::record_micro(std::int64_t step, std::int64_t index, bool last, const MicroTimes& at,
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

// MNIST_MPI_FAULT=RANK:slow:MS (include/mnist_mpi/resilience/fault.hpp): this rank sleeps at the
// end of every step's backward, on every path (the plain step, the exact sums' passes, a replayed
// CUDA graph), so that the others wait for it.
void GradientPipeline::slow_down() const {
  if (shape_.slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(shape_.slow_ms));
}

namespace {

// The summed pipeline: the rank's micro-batches one after another; all but the last are summed
// locally, like DDP's no_sync, and on the last each layer's earlier sum is added as backward
// finishes it, then its float buckets start (the reducer sums them over the ranks).
class SummedGradients final : public GradientPipeline {
 public:
  SummedGradients(const StepParts& parts, const StepShape& shape) : GradientPipeline(parts, shape) {
    if (shape_.accumulation > 1) p_.backend->allocate(p_.model->spec().param_count).swap(accum_);
  }

  Computed compute(std::int64_t step, bool poison, StepTiming& timing) override {
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
    return {backward_end, false};
  }

 private:
  void finish_layer(int layer) override {
    if (!accumulating_) return;
    const auto [begin, size] = layer_params_[static_cast<std::size_t>(layer)];
    if (size > 0) p_.backend->add(p_.grads->data() + begin, accum_->data() + begin, size);
  }

  std::unique_ptr<Buffer> accum_;  // the earlier micro-batches' gradient sum (accumulation > 1)
  bool accumulating_ = false;      // the last micro-batch of an accumulated step
};

}  // namespace

std::unique_ptr<GradientPipeline> make_summed_pipeline(const StepParts& parts, const StepShape& shape) {
  return std::make_unique<SummedGradients>(parts, shape);
}

namespace {

// The summed mode: the codec the options name (--grad-compression) on the floats' buckets.
class SummedMode final : public GradientMode {
 public:
  explicit SummedMode(CodecFactory codec) : codec_(std::move(codec)) {}
  CodecFactory codec() const override { return codec_; }
  std::unique_ptr<GradientPipeline> pipeline(const StepParts& parts, const StepShape& shape) override {
    return make_summed_pipeline(parts, shape);
  }
  double reduced_bytes() const override { return 0; }  // the codecs say (Reducer::wire_bytes)

 private:
  CodecFactory codec_;
};

}  // namespace

std::unique_ptr<GradientMode> make_gradient_mode(const Options& options, const RunPlan& plan, const ModelSpec& spec,
                                                 Backend& backend, CodecReport report) {
  if (plan.chunks() > 0) return make_exact_mode(plan, spec, backend);
  const CodecChoice choice = find_codec(options.grad_compression);
  return std::make_unique<SummedMode>(choice.row->make(
      CodecArgs{choice.rank, plan.compression_start_step, options.seed, spec.params, std::move(report)}));
}

}  // namespace mnist_mpi
