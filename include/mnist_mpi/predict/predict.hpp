// `mnist_mpi predict --checkpoint FILE IMAGE...`: one process, no mpirun. Each image is read
// (include/mnist_mpi/predict/image.hpp), made to look like an MNIST digit
// (include/mnist_mpi/predict/mnist_style.hpp) and classified by the checkpoint's model, on the CPU
// or a GPU; one line per image, or one JSON document. A bad image is reported on stderr and the
// others are still classified; the exit code says that one failed (docs/model_use.md).
#pragma once

#include <string>
#include <vector>

#include "mnist_mpi/checkpoint/checkpoint.hpp"

namespace mnist_mpi {

class Backend;

// The model's class probabilities (softmax of the logits) for prepared inputs, each (H, W) of the
// checkpoint's input size: the library call behind the subcommand, for tests.
std::vector<std::vector<float>> classify(const Checkpoint& ck, Backend& backend,
                                         const std::vector<std::vector<float>>& inputs);

// The subcommand; argv[0] is "predict". Returns the exit code (messages printed here).
int predict_main(int argc, char** argv);

}  // namespace mnist_mpi
