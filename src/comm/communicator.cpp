// What every Communicator shares: the element types' names and sizes, and how a range is cut into
// the ranks' shards (Note [Shards] in include/mnist_mpi/comm/communicator.hpp).
#include "mnist_mpi/comm/communicator.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/hash.hpp"

namespace mnist_mpi {

const char* element_name(ElementType t) {
  switch (t) {
    case ElementType::kFloat32: return "float";
    case ElementType::kFloat64: return "double";
    case ElementType::kInt64: return "int64";
    case ElementType::kUInt8: return "bytes";
    case ElementType::kBFloat16: return "bf16";
  }
  return "an unknown element type";
}

std::size_t element_bytes(ElementType t) {
  switch (t) {
    case ElementType::kFloat32: return sizeof(float);
    case ElementType::kFloat64: return sizeof(double);
    case ElementType::kInt64: return sizeof(std::int64_t);
    case ElementType::kUInt8: return 1;
    case ElementType::kBFloat16: return sizeof(Bf16);
  }
  return 0;
}

void Elements::check_type(ElementType t) const {
  MNIST_CHECK(type == t, ExitCode::kRuntime,
              std::string("a collective's elements are ") + element_name(type) + ", read as " + element_name(t));
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllreduceSum: return "allreduce_sum";
    case Collective::kReduceScatterSum: return "reduce_scatter_sum";
    case Collective::kAllgatherShards: return "allgather_shards";
  }
  return "an unknown collective";
}

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

namespace {
// "0-3", "0,2,4", "0-1,4", "1,0": the numbers in their order, each run of consecutive ascending
// ones joined.
std::string runs_of(const std::vector<int>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size();) {
    std::size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(v[i]);
    if (j > i) {
      s += '-';
      s += std::to_string(v[j]);
    }
    i = j + 1;
  }
  return s;
}
}  // namespace

// Note [Ranks that are NCCL hosts of their own] (include/mnist_mpi/comm/communicator.hpp)
bool ranks_are_nccl_hosts(Communicator& comm) {
  const char* id = std::getenv("NCCL_HOSTID");
  const std::uint64_t mine = fnv1a(comm.host() + '\n' + (id ? id : ""));
  std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.size()));
  comm.allgather(mine, all);
  std::sort(all.begin(), all.end());
  return std::adjacent_find(all.begin(), all.end()) == all.end();
}

std::vector<int> gather_local_ranks(Communicator& comm, int root) {
  const double mine = comm.local_rank();
  std::vector<double> all(comm.rank() == root ? static_cast<std::size_t>(comm.size()) : 0);
  comm.gather(std::span<const double>(&mine, 1), std::span<double>(all), root);
  return std::vector<int>(all.begin(), all.end());
}

std::string describe_placement(const std::vector<std::string>& hosts, const std::vector<int>& local_ranks) {
  std::vector<std::string> order;  // hosts by their first rank
  for (const std::string& h : hosts)
    if (std::find(order.begin(), order.end(), h) == order.end()) order.push_back(h);
  std::string s;
  for (std::size_t k = 0; k < order.size(); ++k) {
    std::vector<int> ranks, locals;
    for (std::size_t r = 0; r < hosts.size(); ++r)
      if (hosts[r] == order[k]) {
        ranks.push_back(static_cast<int>(r));
        locals.push_back(local_ranks.at(r));
      }
    if (k) s += ", ";
    s += order[k];
    s += ranks.size() == 1 ? " rank " : " ranks ";
    s += runs_of(ranks);
    s += " (local ";
    s += runs_of(locals);  // in the ranks' order: "0-1", or "1,0" where they do not ascend
    s += ')';
  }
  return s;
}

}  // namespace mnist_mpi
