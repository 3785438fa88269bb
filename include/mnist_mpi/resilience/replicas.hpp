// The replica check (--check-replicas-every, and at the start and end of every run): every rank's
// digest of its parameters, gathered by the caller, must be rank 0's. What it leaves to others:
// the gather (a collective of the trainer's communicator) and where the parameters live.
#pragma once

#include <cstdint>
#include <span>

namespace mnist_mpi {

// The digest a rank contributes: of its `count` parameters in host memory.
std::uint64_t replica_digest(const float* params, std::int64_t count);
// digests: every rank's, the same on every rank. Throws AgreedError(kRuntime) on every rank when one
// differs from rank 0's (the message, naming the rank and `step`, on rank 0 only).
void check_replica_digests(std::span<const std::uint64_t> digests, std::int64_t step, bool rank0);

}  // namespace mnist_mpi
