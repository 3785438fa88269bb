// The Communicator: typed, span-based collectives, so element counts and bytes can't be confused.
// MpiCommunicator (src/comm/mpi_communicator.cpp) works on host memory and runs the started sums
// on a communication thread of its own; the NCCL one (src/backend/cuda/nccl_communicator.cpp,
// made by the CUDA backend: Backend::make_gradient_communicator) sums and broadcasts float buffers
// in GPU memory and passes every other call to the MPI communicator it was made from.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

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

  // In place: data becomes the elementwise sum over all ranks, and every rank receives the same
  // bits, so replicas stay identical (the replica check compares them). The order of the
  // additions depends on the implementation:
  //  - MpiCommunicator (and the CUDA backend's communicator for ranks that share a GPU, which sums
  //    through it in host memory): ascending rank order, ((g0 + g1) + g2) + ..., for every world
  //    size, so for a given world size the bits do not depend on how a buffer is split into
  //    calls, on overlap, or on Open MPI's algorithm (Note [Sums in rank order]).
  //  - The NCCL communicator's float sums (its double sums are the MPI communicator's): no
  //    promised order. With 2 ranks each element is one addition (none with 1), so there is
  //    nothing to order; with 3 or more the grouping is NCCL's and depends on its algorithm (ring,
  //    tree, ...), its protocol and how it cuts the buffer into chunks, so on the bucket size, the
  //    world size, the topology and the NCCL version. The bits may then differ from rank order
  //    and between bucket sizes, but are still the same on every rank.
  // Different world sizes group the additions differently on every implementation: results agree
  // to rounding, not bitwise.
  virtual void allreduce_sum(std::span<float> data) = 0;
  virtual void allreduce_sum(std::span<double> data) = 0;
  // Sums of 64-bit integers (Note [Exact sums in fixed point]), in host memory: exact, so neither
  // the order nor the grouping of the additions changes a bit.
  virtual void allreduce_sum(std::span<std::int64_t> data) = 0;
  virtual void allreduce_max(std::span<std::int64_t> data) = 0;
  virtual void allreduce_min(std::span<std::int64_t> data) = 0;
  // Starts an in-place sum (as allreduce_sum); data must stay valid and untouched until wait()
  // returns. Sums complete in the order they were started.
  virtual CommRequest start_allreduce_sum(std::span<float> data) = 0;
  // --exact-sums's buckets of integers: exact, in the memory of the float sums (device_buffers()).
  virtual CommRequest start_allreduce_sum(std::span<std::int64_t> data) = 0;
  // The halves of a sum (Note [Shards]), started like start_allreduce_sum and completing in start
  // order with the sums. After a reduce-scatter this rank's shard shard_of(data.size(), rank(),
  // size()) holds exactly the bits allreduce_sum would leave there; the rest of data is undefined
  // (an implementation may sum it too). After an allgather of shards every rank holds every rank's
  // shard, bit for bit.
  virtual CommRequest start_reduce_scatter_sum(std::span<float> data) = 0;
  virtual CommRequest start_reduce_scatter_sum(std::span<std::int64_t> data) = 0;  // as the int64 sums
  virtual CommRequest start_allgather_shards(std::span<float> data) = 0;
  // Blocks until the request has completed and frees it. completed (optional) receives the time
  // the sum finished, which may be earlier than the time wait() returns.
  virtual void wait(CommRequest& request, std::chrono::steady_clock::time_point* completed = nullptr) = 0;
  virtual void broadcast(std::span<float> data, int root) = 0;
  virtual void broadcast(std::span<std::uint8_t> data, int root) = 0;
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
