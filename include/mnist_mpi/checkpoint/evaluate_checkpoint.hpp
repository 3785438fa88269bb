// `mnist_mpi evaluate --checkpoint FILE`: one process, no MPI. Loads and verifies a checkpoint,
// rebuilds its model on the CPU backend and prints accuracy, mean loss and the confusion matrix
// of the test (or validation) split. Also the library call behind it, for tests.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mnist_mpi/backend/parameter_store.hpp"
#include "mnist_mpi/checkpoint/checkpoint.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/io/file_roles.hpp"

namespace mnist_mpi {

struct CheckpointEvaluation {
  double accuracy = 0.0;
  double loss = 0.0;  // mean softmax cross-entropy
  std::int64_t count = 0;
  int classes = 0;
  std::vector<std::int64_t> confusion;  // (classes, classes): [true label][predicted label]
  std::vector<float> logits;            // (count, classes) when asked for (keep_logits), else empty
};

// FILE, or the newest valid checkpoint of a directory (damaged ones are reported on stderr and
// skipped); `chosen` is the file read. Throws Error(kCheckpoint). Shared by evaluate, export, predict.
Checkpoint pick_checkpoint(const std::string& path, std::string& chosen);
// What pick_checkpoint() may read, as inputs of `roles` (Note [No output is an input] in
// include/mnist_mpi/io/file_roles.hpp): FILE, or every checkpoint of the directory.
void declare_checkpoint_input(const std::string& path, FileRoles& roles);

// A decoded checkpoint's parameters and model state in the backend's memory, for a model of spec
// (checkpoint_model_spec(ck)). Shared by evaluate and predict.
std::unique_ptr<ParameterStore> checkpoint_parameters(const Checkpoint& ck, const ModelSpec& spec, Backend& backend);

// Evaluates a decoded checkpoint on a split (threads: 0 = all cores).
CheckpointEvaluation evaluate_checkpoint(const Checkpoint& ck, const Split& split, int batch, int threads,
                                         bool keep_logits = false);

// The subcommand; argv[0] is "evaluate". Returns the exit code (messages printed here).
int evaluate_checkpoint_main(int argc, char** argv);

}  // namespace mnist_mpi
