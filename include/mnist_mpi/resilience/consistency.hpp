// The start-up check that every rank runs the same job: each rank describes its program version,
// resolved options, model and data as "key = value" lines; the ranks compare a hash of them and,
// if any differ, show which lines differ on which rank, before the first training step.
#pragma once

#include <cstdint>
#include <string>

#include "mnist_mpi/comm/communicator.hpp"

namespace mnist_mpi {

// Collective over comm. Returns normally on every rank whose description equals rank 0's; throws
// Error(kUsage) on each rank whose description differs, naming the differing lines
// ("rank 1 has seed = 7 where rank 0 has seed = 42"). Callers agree on the outcome afterwards
// (Note [Ending every rank] in src/main.cpp).
void check_ranks_agree(Communicator& comm, const std::string& description);

// Lines of `resolved` (Options::resolved) that must agree across ranks: all but those naming
// per-node paths or resources (data-dir, threads), which may differ legitimately.
std::string agreed_options(const std::string& resolved);

}  // namespace mnist_mpi
