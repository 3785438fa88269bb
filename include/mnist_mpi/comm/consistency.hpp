// The start-up check that every rank runs the same job: each rank describes its program version,
// resolved options, model and data as "key = value" lines; the ranks compare a hash of them and,
// if any differ, show which lines differ on which rank, before the first training step.
#pragma once

#include <cstdint>
#include <string>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/data/idx.hpp"

namespace mnist_mpi {

// Collective over comm. Returns normally on every rank whose description equals rank 0's; throws
// Error(kUsage) on each rank whose description differs, naming the differing lines
// ("rank 1 has seed = 7 where rank 0 has seed = 42"). Callers agree on the outcome afterwards
// (Note [Ending every rank] in src/main.cpp).
void check_ranks_agree(Communicator& comm, const std::string& description);

// Collective over comm: every rank's digests of the data files it loaded (DataFile::digest, in
// the same order on every rank) against every other rank's. Returns on every rank when they are
// equal; otherwise throws Error(kData) on every rank, naming each file that differs and which
// ranks, on which hosts, hold which version (Note [The same data on every rank]).
void check_same_data(Communicator& comm, const std::vector<DataFile>& files);

// Lines of `resolved` (Options::resolved) that must agree across ranks: all but those naming
// per-node paths or resources (data-dir, threads), which may differ legitimately.
std::string agreed_options(const std::string& resolved);

}  // namespace mnist_mpi
