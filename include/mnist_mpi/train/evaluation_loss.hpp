// How an evaluation's loss and correct count are summed over its batches and over the ranks,
// chosen once for the run (Note [Every rank evaluates a share] in src/train/evaluator.cpp).
#pragma once

#include <cstdint>
#include <memory>

#include "mnist_mpi/backend/backend.hpp"

namespace mnist_mpi {

class Communicator;

class EvaluationLoss {
 public:
  virtual ~EvaluationLoss() = default;
  // Where each batch's softmax_cross_entropy adds its loss and correct count.
  LossMeter& meter() { return *meter_; }
  virtual void start() = 0;       // an evaluation begins on this rank
  virtual void batch_done() = 0;  // after each batch added itself to meter()
  virtual LossStats mine() = 0;   // this rank's batches since start()
  // The split's sums over every rank (collective); batches: the split's batches, every rank's.
  virtual LossStats total(Communicator& comm, std::int64_t batches, const LossStats& mine) = 0;

 protected:
  explicit EvaluationLoss(std::unique_ptr<LossMeter> meter) : meter_(std::move(meter)) {}
  std::unique_ptr<LossMeter> meter_;
};

// Default: the meter sums the batches where the backend computes and is read once; one allreduce
// of (loss sum, correct count). exact (--exact-sums): each batch's loss is read on its own, and the
// split's loss is their exact sum in fixed point, the same bits on any number of ranks; at most
// max_batches batches a rank (their losses are kept, allocated here).
std::unique_ptr<EvaluationLoss> make_evaluation_loss(Backend& backend, bool exact, std::int64_t max_batches);

}  // namespace mnist_mpi
