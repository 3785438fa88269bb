// One global step of one rank (include/mnist_mpi/train/step.hpp).
#include "mnist_mpi/train/step.hpp"

#include <algorithm>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

Step::Step(const StepParts& parts, const StepShape& shape)
    : p_(parts), shape_(shape) {
  MNIST_CHECK(p_.backend && p_.model && p_.params && p_.grads && p_.reducer && p_.optimizer && p_.guard && p_.sampler &&
                  p_.data && p_.loss,
              ExitCode::kRuntime, "Step: a part is missing");
  if (shape_.graph) graph_ = p_.backend->make_step_graph();
  // A graph replays body(), and the exact pipeline decides on the host whether to compute its step
  // again. The options' table refuses the pair with the fix (src/config/combinations.cpp); a Step
  // made in code that has it is a program error.
  MNIST_CHECK(!shape_.graph || !p_.exact, ExitCode::kRuntime, "Step: a CUDA graph of the exact step");
  MNIST_CHECK(!shape_.graph || graph_, ExitCode::kRuntime, "Step: a CUDA graph on a backend that has none");
  pipeline_ = make_gradient_pipeline(p_, shape_);
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

// The optimiser's pass over [begin, end); it reports what it wrote to the parameter store (Note
// [The parameters and their copies] in include/mnist_mpi/backend/parameter_store.hpp).
void Step::update(std::int64_t begin, std::int64_t end) {
  float* p = p_.params->data();
  float* g = p_.grads->data();
  if (p_.optimizer->two_phase())
    p_.optimizer->update_second(p, g, begin, end);
  else
    p_.optimizer->update(p, g, begin, end);
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
    p_.params->changed(buckets[k].begin, mine.begin);
    p_.params->changed(mine.end, buckets[k].end);
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
