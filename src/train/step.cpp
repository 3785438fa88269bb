// One global step of one rank (include/mnist_mpi/train/step.hpp).
#include "mnist_mpi/train/step.hpp"

#include <algorithm>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

Step::Step(const StepParts& parts, const StepShape& shape, std::unique_ptr<GradientPipeline> pipeline)
    : p_(parts), shape_(shape), pipeline_(std::move(pipeline)) {
  MNIST_CHECK(p_.backend && p_.model && p_.params && p_.grads && p_.reducer && p_.optimizer && p_.guard && p_.sampler &&
                  p_.data && p_.loss && pipeline_,
              ExitCode::kRuntime, "Step: a part is missing");
  if (shape_.graph) graph_ = p_.backend->make_step_graph();
  // A graph replays body(); a pipeline that decides on the host whether to compute its step again
  // cannot be one. The options' table refuses the pair with the fix (src/config/combinations.cpp);
  // a Step made in code that has it is a program error.
  MNIST_CHECK(!shape_.graph || pipeline_->replayable(), ExitCode::kRuntime,
              "Step: a CUDA graph of a step that is not the same work every time");
  MNIST_CHECK(!shape_.graph || graph_, ExitCode::kRuntime, "Step: a CUDA graph on a backend that has none");
}

void Step::use_order(std::int64_t epoch) {
  if (epoch != order_epoch_) {  // once per epoch (a GPU copies the permutation then)
    p_.data->set_order(p_.sampler->order(epoch));
    order_epoch_ = epoch;
  }
}

// The step's work: the pipeline's gradient, then the optimiser's updates as the sums arrive.
void Step::body(std::int64_t step, double lr, bool poison, StepTiming& timing) {
  const GradientPipeline::Computed c = pipeline_->compute(step, poison, timing);
  apply(step, lr, c.backward_end, timing, c.sums_in);
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
  p_.reducer->begin_step(step);
  if (graph_ && !poison && runs_ > 0) {
    if (!graph_->captured()) {
      StepTiming ignored;  // nothing runs while it is recorded
      graph_->capture([&] { body(step, lr, false, ignored); });
    }
    graph_->replay();        // host times of the parts are not known: one launch
    pipeline_->slow_down();  // on the host, after the launch: the next step's launch waits
    ++replays_;
  } else {
    body(step, lr, poison, r.timing);
  }
  ++runs_;
  p_.guard->end_step(step);
  r.end = Clock::now();
  if (p_.timeline) p_.timeline->step_done(step, r.begin, r.end, p_.reducer->bucket_timings());
  return r;
}

// The optimiser waits only for what it needs: bucket k's parameters are updated as soon as its
// sum is in, while the later buckets are still being summed (the update is elementwise, so the
// bits are those of one pass over the whole buffer). Each bucket is checked before it is applied
// (Note [Non-finite steps]). With check_all_first (--skip-nonfinite-steps) every bucket is waited
// for and checked before the first is applied, so that a skipped step changes nothing; without
// it a bucket the guard refuses stops the updates there, and the run stops after the step.
// Sharded (Note [Sharded optimiser state] in include/mnist_mpi/train/optimizer.hpp): a bucket's
// sum is this rank's shard of it, which is all the rank checks and updates; the reducer has the
// ranks agree on the guard's verdicts and gathers every bucket's parameters, updated or not, so
// that every rank starts the same collectives in the same order. What the optimiser does with a
// bucket and at the end of the step is its own (Note [The optimiser's two moments in a step]).
void Step::apply(std::int64_t step, double lr, Clock::time_point backward_end, StepTiming& t, bool sums_in) {
  Reducer& reducer = *p_.reducer;
  Optimizer& optimizer = *p_.optimizer;
  const std::size_t buckets = reducer.buckets().size();
  float* params = p_.params->data_for_reporting_writers();  // the optimiser's pass reports its writes
  float* grads = p_.grads->data();
  const auto ok = [&](std::size_t k) {
    const ParamRange mine = reducer.shard(k);
    return p_.guard->bucket_ok(grads + mine.begin, mine.end - mine.begin);
  };
  if (!sums_in) t.exposed_comm = reducer.start_remaining();
  bool finite = true;
  std::size_t waited = 0;  // buckets whose sums are in (a sum already in returns at once)
  if (shape_.check_all_first || sums_in) {  // with every sum in, nothing to overlap
    for (; waited < buckets; ++waited) {
      t.exposed_comm += reducer.wait_bucket(waited);
      finite = ok(waited) && finite;
    }
    finite = reducer.agree(*p_.guard) && finite;
  }
  if (finite) {
    optimizer.begin_step(lr);
    auto waited_from = backward_end;  // for the timeline: when the wait for bucket k began
    for (std::size_t k = 0; k < buckets; ++k) {
      if (k >= waited) {
        t.exposed_comm += reducer.wait_bucket(k);
        waited = k + 1;
        if (!ok(k)) {
          finite = false;
          break;
        }
      }
      const auto o0 = Clock::now();
      if (optimizer.on_bucket(params, grads, reducer.shard(k))) reducer.start_gather(k);
      const auto o1 = Clock::now();
      t.optimizer += seconds(o1 - o0);
      if (p_.timeline) p_.timeline->bucket_updated(step, k, waited_from, o0, o1);
      waited_from = o1;
    }
  }
  for (; waited < buckets; ++waited) t.exposed_comm += reducer.wait_bucket(waited);  // none left in flight
  const auto f0 = Clock::now();
  const double norms = optimizer.finish_step(
      params, grads, reducer.shards(), reducer.shards_communicator(),
      [&] { return reducer.agree(*p_.guard) && finite; }, [&](std::size_t k) { reducer.start_gather(k); });
  t.exposed_comm += norms;
  t.optimizer += seconds(Clock::now() - f0) - norms;
  t.exposed_comm += reducer.finish_gathers([&](std::int64_t b, std::int64_t e) { p_.params->changed(b, e); });
  reducer.agree(*p_.guard);  // sharded, once a step: the verdicts the checkpoint and the loop read
}

}  // namespace mnist_mpi
