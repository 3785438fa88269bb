// Evaluation with the current parameters: the evaluation model (--eval-batch-size, sharing the
// training parameters), the validation and test splits where the backend computes, and how their
// loss is summed (include/mnist_mpi/train/evaluation_loss.hpp). Every rank evaluates a share of a
// split and all learn the result (Note [Every rank evaluates a share] in src/train/evaluator.cpp).
// When to evaluate, and what is reported, is the trainer's.
#pragma once

#include <cstdint>
#include <memory>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/backend/parameter_store.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/train/evaluation_loss.hpp"

namespace mnist_mpi {

enum class SplitKind { kValidation, kTest };

struct EvalResult {
  double accuracy = 0.0;
  double loss = 0.0;  // mean over the split
  std::int64_t count = 0;
};

class Evaluator {
 public:
  Evaluator(const Options& options, const Mnist& data, const ModelSpec& spec, Backend& backend, ParameterStore& params,
            Communicator& comm);
  // The split with the current parameters. Collective: every rank evaluates a share of the
  // split's batches and all learn the result.
  EvalResult evaluate(SplitKind kind);
  // The whole split on this rank alone (no collective): what evaluate() must agree with.
  EvalResult evaluate_alone(SplitKind kind);
  std::int64_t last_images() const { return images_; }  // this rank's images in the last evaluation

 private:
  const Split& split(SplitKind kind) const { return kind == SplitKind::kValidation ? data_.validation : data_.test; }
  std::int64_t batches(SplitKind kind) const;
  LossStats evaluate_batches(SplitKind kind, std::int64_t first, std::int64_t n);
  // The split's numbers from its sums (every rank's, or this rank's alone).
  static EvalResult result(std::int64_t count, const LossStats& s);

  const Mnist& data_;
  const ModelSpec& spec_;
  Backend& backend_;
  Communicator& comm_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<DataSource> validation_data_, test_data_;  // where the backend computes (none: an empty split)
  std::unique_ptr<EvaluationLoss> loss_;                     // how the splits' sums are made, chosen once
  std::int64_t images_ = 0;                                  // images this rank evaluated in the last evaluation
};

}  // namespace mnist_mpi
