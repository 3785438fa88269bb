// The Communicator: typed, span-based collectives, so element counts and bytes can't be confused.
// MpiCommunicator (src/comm/mpi_communicator.cpp) works on host memory and runs the started sums
// on a communication thread of its own; the NCCL one (src/backend/cuda/nccl_communicator.cpp,
// made by the CUDA backend: Backend::make_gradient_communicator) sums and broadcasts float buffers
// in GPU memory and passes every other call to the MPI communicator it was made from.
#pragma once

#include <array>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "mnist_mpi/bf16.hpp"

namespace mnist_mpi {

// An in-flight collective; wait() on the communicator that started it.
struct CommRequest {
  std::int64_t id = -1;
  bool active() const { return id >= 0; }
};

// Note [Shards]
// A reduce-scatter leaves rank r with the sums of its shard of the range, and an allgather of
// shards gives every rank every shard: the two halves of an allreduce, which the sharded optimiser
// (--shard-optimizer, docs/reduction.md) runs with its update in between. A range of n elements on
// W ranks is cut into W contiguous shards of q = n / W elements, rank r's starting at r * q, and
// the last rank also takes the n mod W (< W) elements left over: [(W-1) q, n). Not the sampler's
// "first n mod W one longer" (Note [Uneven slices]): NCCL's ReduceScatter and AllGather move equal
// pieces only, and with the remainder at the end the equal pieces are one in-place collective on
// [0, W q) and the remainder a reduce to, and broadcast from, the last rank. The MPI communicator
// cuts every sum (allreduces too) the same way; which rank adds an element changes no bit of it
// (Note [Sums in rank order]).
struct Shard {
  std::int64_t begin = 0, end = 0;  // elements of the range
  std::int64_t size() const { return end - begin; }
};
Shard shard_of(std::int64_t count, int rank, int world);

// What a collective moves: a span of elements of one of these types, named by the type of the
// span it is made from (std::span<float>, a std::vector<std::int64_t>, a pointer and a count).
enum class ElementType : std::uint8_t { kFloat32, kFloat64, kInt64, kUInt8, kBFloat16 };
inline constexpr int kElementTypes = 5;
const char* element_name(ElementType t);  // "float", "double", "int64", "bytes", "bf16"
std::size_t element_bytes(ElementType t);

template <class T>
constexpr ElementType element_type_of() {
  if constexpr (std::is_same_v<T, float>) return ElementType::kFloat32;
  else if constexpr (std::is_same_v<T, double>) return ElementType::kFloat64;
  else if constexpr (std::is_same_v<T, std::int64_t>) return ElementType::kInt64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return ElementType::kUInt8;
  else if constexpr (std::is_same_v<T, Bf16>) return ElementType::kBFloat16;
  else static_assert(sizeof(T) == 0, "a collective moves float, double, int64, bytes or bf16");
}

struct Elements {
  void* data = nullptr;
  std::size_t count = 0;
  ElementType type = ElementType::kFloat32;

  Elements() = default;
  template <class T>
  Elements(std::span<T> s) : data(s.data()), count(s.size()), type(element_type_of<T>()) {}
  template <class T>
  Elements(std::vector<T>& v) : Elements(std::span<T>(v)) {}
  template <class T, std::size_t N>
  Elements(T (&a)[N]) : Elements(std::span<T>(a)) {}
  template <class T, std::size_t N>
  Elements(std::array<T, N>& a) : Elements(std::span<T>(a)) {}
  template <class T, std::integral N>
  Elements(T* p, N n) : Elements(std::span<T>(p, static_cast<std::size_t>(n))) {}

  std::size_t size() const { return count; }
  std::size_t size_bytes() const { return count * element_bytes(type); }
  bool is(ElementType t) const { return type == t; }
  // The span again; T must be the type it was made from (a program error otherwise).
  template <class T>
  std::span<T> as() const {
    check_type(element_type_of<T>());
    return {static_cast<T*>(data), count};
  }

 private:
  void check_type(ElementType t) const;
};

enum class Reduction : std::uint8_t { kSum, kMax, kMin };
enum class Collective : std::uint8_t { kAllreduceSum, kReduceScatterSum, kAllgatherShards };
inline constexpr int kCollectives = 3;
const char* collective_name(Collective c);  // "allreduce_sum", "reduce_scatter_sum", "allgather_shards"

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int local_rank() const = 0;  // among the ranks on this node
  virtual int local_size() const = 0;
  virtual std::string host() const = 0;
  // How started sums make progress, for the start-up log ("a communication thread").
  virtual std::string progress_mode() const = 0;

  // The collective part of set-up (NCCL: the unique id broadcast and ncclCommInitRank); every
  // rank calls it once, after all ranks agreed that local set-up succeeded.
  virtual void connect() {}
  // True when the float collectives (allreduce_sum, start_allreduce_sum, broadcast of floats) and
  // the started sums of int64 (start_allreduce_sum, start_reduce_scatter_sum) take device memory.
  // Then "complete" means: ordered before the work later queued on the backend's compute stream;
  // the host does not wait (wait() makes the compute stream wait on the sum).
  virtual bool device_buffers() const { return false; }

  // One set of operations for every element type (Elements): a reduction of every rank's values,
  // a started collective (Collective), a broadcast. The named forms below are these calls.
  //
  // In place: data becomes the elementwise reduction over all ranks, and every rank receives the
  // same bits, so replicas stay identical (the replica check compares them). The order of the
  // additions of a sum depends on the implementation:
  //  - MpiCommunicator (and the CUDA backend's communicator for ranks that share a GPU, which sums
  //    through it in host memory): floats in ascending rank order, ((g0 + g1) + g2) + ..., for
  //    every world size, so for a given world size the bits do not depend on how a buffer is split
  //    into calls, on overlap, or on Open MPI's algorithm (Note [Sums in rank order]); the started
  //    sums of doubles the same; the blocking sums of doubles are Open MPI's.
  //  - The NCCL communicator's float sums (its blocking double sums are the MPI communicator's): no
  //    promised order. With 2 ranks each element is one addition (none with 1), so there is
  //    nothing to order; with 3 or more the grouping is NCCL's and depends on its algorithm (ring,
  //    tree, ...), its protocol and how it cuts the buffer into chunks, so on the bucket size, the
  //    world size, the topology and the NCCL version. The bits may then differ from rank order
  //    and between bucket sizes, but are still the same on every rank.
  // Different world sizes group the additions differently on every implementation: results agree
  // to rounding, not bitwise. Sums of 64-bit integers (Note [Exact sums in fixed point]) are
  // exact, so neither the order nor the grouping of the additions changes a bit.
  // Where the data lies (device_buffers()): on a device, the float reductions and broadcasts and
  // every started collective take device memory; every other reduction and broadcast host memory.
  virtual void allreduce(Elements data, Reduction op) = 0;
  // Starts an in-place collective on data, which must stay valid and untouched until wait()
  // returns. Started collectives complete in the order they were started. The halves of a sum
  // (Note [Shards]): after a reduce-scatter this rank's shard shard_of(data.size(), rank(),
  // size()) holds exactly the bits an allreduce sum would leave there; the rest of data is
  // undefined (an implementation may sum it too). After an allgather of shards every rank holds
  // every rank's shard, bit for bit. Element types: float, double, int64 and bf16 (whose sums
  // round every addition to bf16; a bf16 sum is a started one, or a float-like device one).
  virtual CommRequest start(Collective what, Elements data) = 0;
  virtual void broadcast(Elements data, int root) = 0;

  void allreduce_sum(Elements d) { allreduce(d, Reduction::kSum); }
  void allreduce_max(Elements d) { allreduce(d, Reduction::kMax); }
  void allreduce_min(Elements d) { allreduce(d, Reduction::kMin); }
  CommRequest start_allreduce_sum(Elements d) { return start(Collective::kAllreduceSum, d); }
  CommRequest start_reduce_scatter_sum(Elements d) { return start(Collective::kReduceScatterSum, d); }
  CommRequest start_allgather_shards(Elements d) { return start(Collective::kAllgatherShards, d); }
  // Blocks until the request has completed and frees it. completed (optional) receives the time
  // the sum finished, which may be earlier than the time wait() returns.
  virtual void wait(CommRequest& request, std::chrono::steady_clock::time_point* completed = nullptr) = 0;
  // out.size() == size(): out[r] = rank r's value.
  virtual void allgather(std::uint64_t value, std::span<std::uint64_t> out) = 0;
  virtual void barrier() = 0;
  // Rank root receives every rank's bytes in rank order (out) and each rank's byte count (counts,
  // size() entries); on other ranks out and counts come back empty. It allocates: for data at the
  // end of a run (the timeline), not for the step loop.
  virtual void gather(std::span<const std::uint8_t> mine, std::vector<std::uint8_t>& out,
                      std::vector<std::int64_t>& counts, int root) = 0;
  // Rank root receives every rank's mine (the same size on every rank) in rank order in out
  // (size() * mine.size() on root; untouched elsewhere). Allocates nothing: for the step loop's
  // per-rank timings (Note [Every rank's step times] in src/report/run_telemetry.cpp).
  virtual void gather(std::span<const double> mine, std::span<double> out, int root) = 0;
};

// Every rank's host name, in rank order, on rank root (empty elsewhere): for messages and reports
// that name a rank's host. Allocates, like the byte gather it is made of.
std::vector<std::string> gather_hosts(Communicator& comm, int root);

// Every rank's node-local rank (Communicator::local_rank), in rank order, on rank root (empty
// elsewhere). Collective; allocates.
std::vector<int> gather_local_ranks(Communicator& comm, int root);

// Where the ranks run, for the "hosts:" line: each host in the order of its first rank, with its
// ranks and their node-local ranks, from gather_hosts and gather_local_ranks (one entry a rank),
// e.g. "node1 ranks 0-1 (local 0-1), node2 ranks 2-3 (local 0-1)".
std::string describe_placement(const std::vector<std::string>& hosts, const std::vector<int>& local_ranks);

// Note [Ranks that are NCCL hosts of their own]
// NCCL tells hosts apart by a hash of the host name and boot id, which the NCCL_HOSTID environment
// variable replaces (getHostHash in NCCL's src/misc/utils.cc). Ranks of one machine that each set
// an NCCL_HOSTID of their own are, to NCCL, one-GPU hosts: its duplicate-GPU check passes and they
// talk through its network transport (sockets where there is no InfiniBand), as separate nodes do.
// So ranks that share a GPU (--allow-gpu-sharing) still sum through NCCL when every one of them is
// such a host; otherwise through host memory by MPI. scripts/gpu_check.sh's gpu_np2 stage runs
// two ranks on one GPU so: NCCL between ranks on a machine with one GPU.
// True when no two ranks have the same host name and NCCL_HOSTID (unset counts as empty), the
// same answer on every rank. Collective: one allgather of a 64-bit hash.
bool ranks_are_nccl_hosts(Communicator& comm);

// Wraps MPI_COMM_WORLD (MPI must be initialised, ideally with MPI_THREAD_MULTIPLE: see
// init_mpi()).
std::unique_ptr<Communicator> make_mpi_communicator();

}  // namespace mnist_mpi
