// What every Communicator shares: how a range is cut into the ranks' shards (Note [Shards] in
// include/mnist_mpi/comm/communicator.hpp).
#include "mnist_mpi/comm/communicator.hpp"

namespace mnist_mpi {

Shard shard_of(std::int64_t count, int rank, int world) {
  const std::int64_t q = count / world;
  return Shard{q * rank, rank + 1 == world ? count : q * (rank + 1)};
}

std::vector<std::string> gather_hosts(Communicator& comm, int root) {
  const std::string me = comm.host();
  std::vector<std::uint8_t> gathered;
  std::vector<std::int64_t> counts;
  comm.gather(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(me.data()), me.size()), gathered,
              counts, root);
  std::vector<std::string> hosts;
  for (std::size_t r = 0, at = 0; r < counts.size(); at += static_cast<std::size_t>(counts[r]), ++r)
    hosts.emplace_back(reinterpret_cast<const char*>(gathered.data()) + at, static_cast<std::size_t>(counts[r]));
  return hosts;
}

}  // namespace mnist_mpi
