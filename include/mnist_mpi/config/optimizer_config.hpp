// The optimiser's and the schedule's settings: plain values that the options, the backends (their
// fused optimiser kernels), the optimiser and the checkpoint format all read. A header of its own,
// so that a backend needs nothing of the training code to take them.
#pragma once

#include <cstdint>
#include <string>

#include "mnist_mpi/optimizer_kind.hpp"

namespace mnist_mpi {

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdam;
  double momentum = 0.0;                          // sgd
  bool nesterov = false;                          // sgd
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam
  double weight_decay = 0.0;                      // L2, added to the gradient (PyTorch's weight_decay)
};

struct ScheduleConfig {
  std::string kind = "constant";  // constant | step | cosine
  double base_lr = 1e-3;
  double gamma = 0.1;  // step: lr *= gamma every step_epochs epochs
  double step_epochs = 1;
  double min_lr = 0.0;  // step: the floor; cosine: the final value
  std::int64_t warmup_steps = 0;
};

}  // namespace mnist_mpi
