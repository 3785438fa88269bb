// The ranks-agree check (see include/mnist_mpi/resilience/consistency.hpp): an allgather of 64-bit
// FNV-1a hashes of every rank's description; only when they differ is rank 0's text broadcast,
// so a healthy start costs one tiny collective.
#include "mnist_mpi/resilience/consistency.hpp"

#include <map>
#include <sstream>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/config/options.hpp"  // key_value_lines
#include "mnist_mpi/hash.hpp"

namespace mnist_mpi {
namespace {}  // namespace

std::string agreed_options(const std::string& resolved) {
  std::istringstream in(resolved);
  std::string line, out;
  while (std::getline(in, line)) {
    if (line.rfind("data-dir = ", 0) == 0 || line.rfind("threads = ", 0) == 0) continue;
    out += line + "\n";
  }
  return out;
}

void check_ranks_agree(Communicator& comm, const std::string& description) {
  const std::uint64_t mine = fnv1a(description);
  std::vector<std::uint64_t> hashes(static_cast<std::size_t>(comm.size()));
  comm.allgather(mine, hashes);
  bool same = true;
  for (std::uint64_t h : hashes) same = same && h == hashes[0];
  if (same) return;

  // Rank 0's description to every rank: its length, then its bytes.
  std::uint64_t len = comm.rank() == 0 ? description.size() : 0;
  comm.broadcast(std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(&len), sizeof len), 0);
  MNIST_CHECK(len < (std::uint64_t{1} << 24), ExitCode::kRuntime, "rank 0's configuration text is implausibly long");
  std::string root_text = comm.rank() == 0 ? description : std::string(static_cast<std::size_t>(len), '\0');
  comm.broadcast(std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(root_text.data()), root_text.size()), 0);
  if (mine == hashes[0]) return;

  const auto theirs = key_value_lines(root_text), ours = key_value_lines(description);
  std::map<std::string, bool> keys;
  for (const auto& kv : theirs) keys[kv.first] = true;
  for (const auto& kv : ours) keys[kv.first] = true;
  std::string diffs;
  int shown = 0;
  for (const auto& [key, unused] : keys) {
    const auto a = ours.find(key), b = theirs.find(key);
    const std::string va = a == ours.end() ? "(not set)" : a->second;
    const std::string vb = b == theirs.end() ? "(not set)" : b->second;
    if (a != ours.end() && b != theirs.end() && va == vb) continue;
    if (shown++ == 4) {
      diffs += "; ...";
      break;
    }
    diffs += (diffs.empty() ? "" : "; ") + key + " = " + va + " here, " + vb + " on rank 0";
  }
  if (diffs.empty()) diffs = "the descriptions differ only in their form";
  throw_error(ExitCode::kUsage, "rank " + std::to_string(comm.rank()) + " does not run the same job as rank 0: " +
                                    diffs + " (every rank must get the same options, model, data and program version)");
}

}  // namespace mnist_mpi
