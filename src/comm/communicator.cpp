// What every Communicator shares: how a range is cut into the ranks' shards (Note [Shards] in
// include/mnist_mpi/comm/communicator.hpp).
#include "mnist_mpi/comm/communicator.hpp"

namespace mnist_mpi {

Shard shard_of(std::int64_t count, int rank, int world) {
  const std::int64_t q = count / world;
  return Shard{q * rank, rank + 1 == world ? count : q * (rank + 1)};
}

}  // namespace mnist_mpi
