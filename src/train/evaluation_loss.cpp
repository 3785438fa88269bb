// An evaluation's sums, default or exact (include/mnist_mpi/train/evaluation_loss.hpp).
#include "mnist_mpi/train/evaluation_loss.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/exact_sum.hpp"

namespace mnist_mpi {

namespace {

class SummedLoss final : public EvaluationLoss {
 public:
  explicit SummedLoss(std::unique_ptr<LossMeter> meter) : EvaluationLoss(std::move(meter)) {}
  void start() override { meter_->reset(); }
  void batch_done() override {}
  LossStats mine() override { return meter_->read(); }  // the one synchronisation of an evaluation
  LossStats total(Communicator& comm, std::int64_t /*batches*/, const LossStats& mine) override {
    double v[2] = {mine.loss_sum, static_cast<double>(mine.correct)};
    comm.allreduce_sum(std::span<double>(v, 2));
    return LossStats{v[0], static_cast<std::int64_t>(v[1])};
  }
};

// --exact-sums: the split's loss as an exact sum of its batches' losses (Note [Exact sums in fixed
// point], the shift from the largest batch loss of every rank), so that it is the same bits on any
// number of ranks, like the accuracy. The loss of a batch is >= 0; a non-finite one makes it NaN.
class ExactLoss final : public EvaluationLoss {
 public:
  ExactLoss(std::unique_ptr<LossMeter> meter, std::int64_t max_batches) : EvaluationLoss(std::move(meter)) {
    losses_.reserve(static_cast<std::size_t>(max_batches));  // no allocation later
  }
  void start() override {
    meter_->reset();
    losses_.clear();
    in_order_ = LossStats{};
  }
  void batch_done() override {  // each batch's loss on its own
    const LossStats one = meter_->read();
    meter_->reset();
    losses_.push_back(one.loss_sum);
    in_order_.loss_sum += one.loss_sum;
    in_order_.correct += one.correct;
  }
  LossStats mine() override { return in_order_; }
  LossStats total(Communicator& comm, std::int64_t batches, const LossStats& mine) override {
    std::int64_t top[2] = {-1100, 0};  // the largest exponent (double's least is -1074), non-finite seen
    for (const double l : losses_) {
      if (!std::isfinite(l)) top[1] = 1;
      int e = 0;
      if (std::isfinite(l) && l > 0.0) std::frexp(l, &e);
      if (l > 0.0) top[0] = std::max<std::int64_t>(top[0], e);
    }
    comm.allreduce_max(top);
    // Note [Exact sums in fixed point]'s shift for the largest batch loss of every rank.
    const int shift =
        shift_for_limit(static_cast<int>(std::max<std::int64_t>(top[0], -1000)), std::max<std::int64_t>(batches, 1));
    std::int64_t v[2] = {0, mine.correct};
    if (top[1] == 0)
      for (const double l : losses_) v[0] += std::llrint(std::ldexp(l, shift));  // exact scaling, then rounded
    comm.allreduce_sum(v);
    return LossStats{top[1] ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(static_cast<double>(v[0]), -shift),
                     v[1]};
  }

 private:
  std::vector<double> losses_;  // this rank's batch losses of the evaluation
  LossStats in_order_;          // the batches' losses added in order, and their correct counts
};

}  // namespace

std::unique_ptr<EvaluationLoss> make_evaluation_loss(Backend& backend, bool exact, std::int64_t max_batches) {
  if (exact) return std::make_unique<ExactLoss>(backend.make_loss_meter(), max_batches);
  return std::make_unique<SummedLoss>(backend.make_loss_meter());
}

}  // namespace mnist_mpi
