// Evaluation (include/mnist_mpi/train/evaluator.hpp): a share of a split's batches on every rank,
// one collective for the split's numbers.
#include "mnist_mpi/train/evaluator.hpp"

#include <algorithm>

#include "mnist_mpi/data/sampler.hpp"  // part_first, part_count

namespace mnist_mpi {

// The evaluation model and the splits it reads, on every rank (Note [Every rank evaluates a share]).
Evaluator::Evaluator(const Options& opt, const Mnist& data, const ModelSpec& spec, Backend& backend,
                     ParameterStore& params, Communicator& comm)
    : data_(data), spec_(spec), backend_(backend), comm_(comm) {
  const std::int64_t largest = std::max({data.validation.count, data.test.count, std::int64_t{1}});
  const int eb = static_cast<int>(std::min(opt.eval_batch_size, largest));
  model_ = std::make_unique<Model>(spec, eb, backend, params, nullptr);
  if (data.validation.count > 0) validation_data_ = backend.make_data_source(data.validation, eb);
  test_data_ = backend.make_data_source(data.test, eb);
  loss_ = make_evaluation_loss(backend, opt.exact_sums, (largest + eb - 1) / eb);
}

// Note [Every rank evaluates a share]
// An evaluation used to be rank 0's alone while the other ranks waited for it at the next
// collective: on lenet, 2 ranks, a quarter of the time to 99 % validation accuracy. Now the
// split's batches of --eval-batch-size are shared out in contiguous runs (part_count/part_first
// of Note [Uneven slices], over batches rather than images), every rank evaluates its run, and one
// allreduce of (loss sum, correct count) gives every rank the split's numbers. Shares are whole
// batches, so every image sits in the same batch at the same row as on one rank and its logits are
// the same bits. The count is an integer (exact in a double), so the accuracy, and every decision
// made from it (--target-accuracy, the best checkpoint), is the one-rank value on any number of
// ranks and the same on every rank. The mean loss adds the ranks' partial sums, so its last bits
// move with the number of ranks, as PyTorch DDP's all-reduced loss does. Every rank holds an
// evaluation model (--eval-batch-size images of activations) and the splits' data.
EvalResult Evaluator::evaluate(SplitKind kind) {
  const std::int64_t n = batches(kind);
  const std::int64_t first = part_first(n, comm_.size(), comm_.rank());
  const LossStats mine = evaluate_batches(kind, first, part_count(n, comm_.size(), comm_.rank()));
  return result(split(kind).count, loss_->total(comm_, n, mine));
}

EvalResult Evaluator::evaluate_alone(SplitKind kind) {
  return result(split(kind).count, evaluate_batches(kind, 0, batches(kind)));
}

// The split's batches of the evaluation model's size (the last one may be short).
std::int64_t Evaluator::batches(SplitKind kind) const {
  const std::int64_t eb = model_->batch();
  return (split(kind).count + eb - 1) / eb;
}

EvalResult Evaluator::result(std::int64_t count, const LossStats& s) {
  EvalResult r;
  r.count = count;
  if (count > 0) {
    r.loss = s.loss_sum / static_cast<double>(count);
    r.accuracy = static_cast<double>(s.correct) / static_cast<double>(count);
  }
  return r;
}

// Batches [first, first + n) of the split (the last one of the split may be short), with the current
// parameters, on this rank.
LossStats Evaluator::evaluate_batches(SplitKind kind, std::int64_t first, std::int64_t n) {
  const Split& s = split(kind);
  const int eb = model_->batch();
  DataSource* source = kind == SplitKind::kValidation ? validation_data_.get() : test_data_.get();
  StepContext ctx;
  ctx.training = false;
  loss_->start();
  images_ = 0;
  for (std::int64_t b = first; b < first + n; ++b) {
    const std::int64_t at = b * eb;
    const std::int64_t rows = std::min<std::int64_t>(eb, s.count - at);
    source->slice(at, rows, model_->input());
    // A short last batch: the rows past `rows` are stale and their outputs are ignored.
    model_->forward(ctx);
    backend_.softmax_cross_entropy(model_->logits(), source->labels(), static_cast<int>(rows), spec_.num_classes(),
                                   nullptr, 0.0f, loss_->meter());
    images_ += rows;
    loss_->batch_done();
  }
  return loss_->mine();
}

}  // namespace mnist_mpi
