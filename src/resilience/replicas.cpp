// The replica check (include/mnist_mpi/resilience/replicas.hpp).
#include "mnist_mpi/resilience/replicas.hpp"

#include <cstddef>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/crc32c.hpp"  // content_digest
#include "mnist_mpi/hash.hpp"    // hex64

namespace mnist_mpi {

// content_digest (27 GB/s here) rather than params_hash's FNV-1a (1 GB/s, byte by byte): lenet's
// 13 MB took 13 ms a check, 0.13 ms a step at the default of one check every 100 steps.
std::uint64_t replica_digest(const float* params, std::int64_t count) {
  return content_digest(params, static_cast<std::size_t>(count) * sizeof(float));
}

void check_replica_digests(std::span<const std::uint64_t> hashes, std::int64_t step, bool rank0) {
  // Every rank holds the same digests, so every rank finds a divergence here and stops at this
  // point (an AgreedError: rank 0 prints it, none is left in a collective, all exit through
  // MPI_Finalize). An error of one rank's own, with MPI_Abort, let whichever rank printed first
  // end the job, so the message came from either rank.
  for (std::size_t r = 1; r < hashes.size(); ++r)
    if (hashes[r] != hashes[0])
      throw AgreedError(ExitCode::kRuntime,
                        !rank0
                            ? std::string()
                            : "replicas diverged after step " + std::to_string(step) + ": rank " + std::to_string(r) +
                                  " holds parameters " + hex64(hashes[r]) + ", rank 0 holds " + hex64(hashes[0]) +
                                  " (every rank must hold identical parameters; this is a bug, please report it)");
}

}  // namespace mnist_mpi
