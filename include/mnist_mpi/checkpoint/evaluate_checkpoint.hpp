// `mnist_mpi evaluate --checkpoint FILE`: one process, no MPI. Loads and verifies a checkpoint,
// rebuilds its model on the CPU backend and prints accuracy, mean loss and the confusion matrix
// of the test (or validation) split. Also the library call behind it, for tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mnist_mpi/checkpoint/checkpoint.hpp"
#include "mnist_mpi/data/idx.hpp"

namespace mnist_mpi {

struct CheckpointEvaluation {
  double accuracy = 0.0;
  double loss = 0.0;  // mean softmax cross-entropy
  std::int64_t count = 0;
  int classes = 0;
  std::vector<std::int64_t> confusion;  // (classes, classes): [true label][predicted label]
};

// Evaluates a decoded checkpoint on a split (threads: 0 = all cores).
CheckpointEvaluation evaluate_checkpoint(const Checkpoint& ck, const Split& split, int batch, int threads);

// The subcommand; argv[0] is "evaluate". Returns the exit code (messages printed here).
int evaluate_checkpoint_main(int argc, char** argv);

}  // namespace mnist_mpi
