// The ranks-agree check (see include/mnist_mpi/comm/consistency.hpp): an allgather of 64-bit
// FNV-1a hashes of every rank's description; only when they differ is rank 0's text broadcast,
// so a healthy start costs one tiny collective.
#include "mnist_mpi/comm/consistency.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/config/options.hpp"  // key_value_lines
#include "mnist_mpi/hash.hpp"

namespace mnist_mpi {

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


// Note [The same data on every rank]
// On a cluster each node often has its own copy of the data, and a stale or damaged copy changes
// what is trained without a word: the same-job check compares the sizes, which such a copy keeps.
// So each rank digests the decoded contents of its four files as it loads them (Note [A digest of
// the training data] in include/mnist_mpi/crc32c.hpp), and the ranks allgather the digests, one
// small collective per file. On a difference every rank throws the same kData error, so the ranks
// agree without another round; only then are the host names gathered, for the message.
void check_same_data(Communicator& comm, const std::vector<DataFile>& files) {
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::vector<std::uint64_t>> digests(files.size(), std::vector<std::uint64_t>(n));
  bool same = true;
  for (std::size_t f = 0; f < files.size(); ++f) {
    comm.allgather(files[f].digest, digests[f]);
    for (std::uint64_t d : digests[f]) same = same && d == digests[f][0];
  }
  if (same) return;

  std::vector<std::string> hosts = gather_hosts(comm, 0);
  hosts.resize(n, "?");  // ranks other than 0 learn no host names
  std::string what;
  for (std::size_t f = 0; f < files.size(); ++f) {
    std::vector<std::pair<std::uint64_t, std::vector<std::size_t>>> groups;  // digest, its ranks; rank order
    for (std::size_t r = 0; r < n; ++r) {
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == digests[f][r]; });
      if (g == groups.end()) g = groups.insert(groups.end(), {digests[f][r], {}});
      g->second.push_back(r);
    }
    if (groups.size() == 1) continue;
    what += (what.empty() ? "" : "; ") + files[f].what + " (" + files[f].name + ") differ:";
    bool first = true;
    for (const auto& [digest, ranks] : groups) {
      char hex[20];
      std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(digest));
      std::string who;
      for (std::size_t k = 0; k < ranks.size() && k < 8; ++k)
        who += (k ? ", " : "") + std::to_string(ranks[k]) + " (host " + quote_input(hosts[ranks[k]], 64) + ")";
      if (ranks.size() > 8) who += " and " + std::to_string(ranks.size() - 8) + " more";
      what += std::string(first ? " " : ", ") + (ranks.size() > 1 ? "ranks " : "rank ") + who +
              (ranks.size() > 1 ? " have " : " has ") + hex;
      first = false;
    }
  }
  throw_error(ExitCode::kData, "the ranks would train on different data: " + what +
                                   "; give every node the same copy of the MNIST files (scripts/fetch_mnist.sh "
                                   "fetches them and verifies their sha256), or point --data-dir at a shared one");
}

}  // namespace mnist_mpi
