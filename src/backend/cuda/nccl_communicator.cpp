// The NCCL Communicator: float sums and broadcasts on GPU memory, one NCCL communicator per run,
// bootstrapped over MPI (rank 0's ncclUniqueId broadcast, then ncclCommInitRank on every rank).
// The CUDA backend makes it (Backend::make_gradient_communicator) and hands it its context.
// Gradient buckets are summed on a communication stream of their own, ordered against the compute
// stream with events; asynchronous NCCL errors are polled and end the run with a message.
// --exact-sums's buckets of integers are summed there too, as ncclInt64 (exact, so NCCL's order
// changes no bit). Host collectives (loss sums, replica hashes, agreement) are passed to the MPI
// communicator.
// When ranks share a GPU (--allow-gpu-sharing; NCCL refuses two ranks on one GPU), the staged
// communicator below sums device buffers through host memory with MPI instead.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <utility>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi {
namespace {

// What both GPU communicators forward to the host communicator (MPI): who this rank is, and every
// collective on host memory (the small allreduces of doubles and counters, bytes, hashes).
class HostForwarding : public Communicator {
 public:
  explicit HostForwarding(Communicator& host) : host_(host) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  int local_rank() const override { return host_.local_rank(); }
  int local_size() const override { return host_.local_size(); }
  std::string host() const override { return host_.host(); }
  bool device_buffers() const override { return true; }
  void allreduce_sum(std::span<double> d) override { host_.allreduce_sum(d); }
  void allreduce_sum(std::span<std::int64_t> d) override { host_.allreduce_sum(d); }
  void allreduce_max(std::span<std::int64_t> d) override { host_.allreduce_max(d); }
  void allreduce_min(std::span<std::int64_t> d) override { host_.allreduce_min(d); }
  void broadcast(std::span<std::uint8_t> d, int root) override { host_.broadcast(d, root); }
  void allgather(std::uint64_t value, std::span<std::uint64_t> out) override { host_.allgather(value, out); }
  void barrier() override { host_.barrier(); }
  void gather(std::span<const std::uint8_t> mine, std::vector<std::uint8_t>& out, std::vector<std::int64_t>& counts,
              int root) override {  // host bytes: MPI's
    host_.gather(mine, out, counts, root);
  }
  void gather(std::span<const double> mine, std::span<double> out, int root) override { host_.gather(mine, out, root); }

 protected:
  Communicator& host_;
};

// Note [Buckets on the communication stream]
// start_allreduce_sum(bucket) is called by the reducer right after backward queued the bucket's
// last gradient kernel on the compute stream. It records an event there (ready), makes the
// communication stream wait for it, queues ncclAllReduce on the communication stream and records
// `done` after it. So the sum starts exactly when its gradients exist, runs while the compute
// stream goes on with the earlier layers' backward, and the host never blocks. wait() makes the
// compute stream wait for `done`: the optimiser, queued after the waits, reads summed gradients.
// Buckets are queued in index order on every rank (Note [Buckets start in index order]), which is
// what NCCL requires of collectives on one communicator.
//
// Note [NCCL errors end the run]
// A collective whose peer is gone can block forever on the device. The host never waits on the
// device with a blocking call: every wait (Context::wait_for_stream) polls an event and, between
// polls, calls poll() here, which asks ncclCommGetAsyncError; on an error it calls ncclCommAbort
// (which also stops the stuck kernels) and throws, so main() prints one line and MPI_Abort ends
// every rank. wait() polls too. A peer that merely stalls raises no NCCL error: the
// wait's deadline (--collective-timeout) aborts then (Note [Device waits have a deadline]).
class NcclCommunicator final : public HostForwarding {
 public:
  using HostForwarding::allreduce_sum;  // the host overloads, next to this class's float ones
  using HostForwarding::broadcast;
  NcclCommunicator(Communicator& host, cuda::Context& c) : HostForwarding(host), c_(c), compute_(c.stream) {
    int lo = 0, hi = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    // Higher priority than compute: a bucket's sum is not queued behind backward's kernels.
    CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, hi));
  }
  ~NcclCommunicator() override {
    c_.wait.check = c_.wait.abort = {};
    if (comm_) {
      cudaStreamSynchronize(comm_stream_);
      ncclCommDestroy(comm_);
    }
    for (Slot& s : slots_) {
      cudaEventDestroy(s.ready);
      cudaEventDestroy(s.done);
    }
    cudaStreamDestroy(comm_stream_);
  }

  std::string progress_mode() const override {
    return "summed by NCCL on a communication stream, ordered against backward and the optimizer by events";
  }

  void connect() override {
    ncclUniqueId id{};
    if (host_.rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    host_.broadcast(std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(&id), sizeof id), 0);
    NCCL_CHECK(ncclCommInitRank(&comm_, host_.size(), id, host_.rank()));
    c_.wait.check = [this] { poll(); };
    c_.wait.abort = [this] {  // Note [Device waits have a deadline]: stops this rank's NCCL kernels
      if (comm_) ncclCommAbort(comm_);
      comm_ = nullptr;
    };
  }

  void allreduce_sum(std::span<float> d) override {
    CommRequest r = start_allreduce_sum(d);
    wait(r, nullptr);
  }

  CommRequest start_allreduce_sum(std::span<float> d) override { return start_sum(d, ncclFloat); }
  CommRequest start_allreduce_sum(std::span<std::int64_t> d) override { return start_sum(d, ncclInt64); }

  // Note [Shards] (include/mnist_mpi/comm/communicator.hpp): the equal pieces [0, W q) in one
  // in-place ReduceScatter / AllGather (rank r's piece at r * q, where NCCL's in-place forms put
  // it), the remainder reduced to and broadcast from the last rank, in one NCCL group each.
  CommRequest start_reduce_scatter_sum(std::span<float> d) override { return start_reduce_scatter(d, ncclFloat); }
  CommRequest start_reduce_scatter_sum(std::span<std::int64_t> d) override {
    return start_reduce_scatter(d, ncclInt64);
  }
  CommRequest start_allgather_shards(std::span<float> d) override {
    return start([&] {
      const auto [q, tail] = pieces(d);
      NCCL_CHECK(ncclGroupStart());
      if (q > 0)
        NCCL_CHECK(ncclAllGather(d.data() + static_cast<std::size_t>(host_.rank()) * q, d.data(), q, ncclFloat, comm_,
                                 comm_stream_));
      if (tail > 0)
        NCCL_CHECK(ncclBroadcast(d.data() + (d.size() - tail), d.data() + (d.size() - tail), tail, ncclFloat,
                                 host_.size() - 1, comm_, comm_stream_));
      NCCL_CHECK(ncclGroupEnd());
    });
  }


  // Does not block the host: the compute stream waits for the sum (completed: when the wait was
  // queued, the host does not know when the device finishes).
  void wait(CommRequest& req, std::chrono::steady_clock::time_point* completed) override {
    Slot& s = checked(req);
    poll();
    CUDA_CHECK(cudaStreamWaitEvent(compute_, s.done, 0));
    s.busy = false;
    req.id = -1;
    if (completed) *completed = std::chrono::steady_clock::now();
  }

  void broadcast(std::span<float> d, int root) override {
    connected();
    // On the compute stream: ordered after whatever wrote d and before whatever reads it.
    NCCL_CHECK(ncclBroadcast(d.data(), d.data(), d.size(), ncclFloat, root, comm_, compute_));
  }

 private:
  struct Slot {
    cudaEvent_t ready = nullptr, done = nullptr;
    bool busy = false;
  };

  // Note [Buckets on the communication stream]: queue() puts the collective on the communication
  // stream, after the compute stream's work so far; the request's `done` event follows it.
  template <class Queue>
  CommRequest start(Queue queue) {
    connected();
    std::size_t slot = 0;
    while (slot < slots_.size() && slots_[slot].busy) ++slot;
    if (slot == slots_.size()) {  // grows to the number of buckets, in the first step
      Slot s;
      CUDA_CHECK(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
      slots_.push_back(s);
    }
    Slot& s = slots_[slot];
    CUDA_CHECK(cudaEventRecord(s.ready, compute_));
    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, s.ready, 0));
    queue();
    CUDA_CHECK(cudaEventRecord(s.done, comm_stream_));
    s.busy = true;
    return CommRequest{static_cast<std::int64_t>(slot)};
  }
  template <class T>
  CommRequest start_sum(std::span<T> d, ncclDataType_t type) {
    return start([&] { NCCL_CHECK(ncclAllReduce(d.data(), d.data(), d.size(), type, ncclSum, comm_, comm_stream_)); });
  }
  template <class T>
  CommRequest start_reduce_scatter(std::span<T> d, ncclDataType_t type) {
    return start([&] {
      const auto [q, tail] = pieces(d);
      NCCL_CHECK(ncclGroupStart());
      if (q > 0)
        NCCL_CHECK(ncclReduceScatter(d.data(), d.data() + static_cast<std::size_t>(host_.rank()) * q, q, type, ncclSum,
                                     comm_, comm_stream_));
      if (tail > 0)
        NCCL_CHECK(ncclReduce(d.data() + (d.size() - tail), d.data() + (d.size() - tail), tail, type, ncclSum,
                              host_.size() - 1, comm_, comm_stream_));
      NCCL_CHECK(ncclGroupEnd());
    });
  }
  // The equal piece per rank and the remainder (Note [Shards]).
  template <class T>
  std::pair<std::size_t, std::size_t> pieces(std::span<T> d) const {
    const auto w = static_cast<std::size_t>(host_.size());
    return {d.size() / w, d.size() % w};
  }

  void connected() const { MNIST_CHECK(comm_ != nullptr, ExitCode::kRuntime, "NCCL collective before connect()"); }
  Slot& checked(const CommRequest& req) {
    MNIST_CHECK(req.active() && req.id < static_cast<std::int64_t>(slots_.size()) &&
                    slots_[static_cast<std::size_t>(req.id)].busy,
                ExitCode::kRuntime, "test/wait on a request this communicator did not start");
    return slots_[static_cast<std::size_t>(req.id)];
  }

  // Note [NCCL errors end the run]
  void poll() {
    if (!comm_) return;
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
    if (async == ncclSuccess || async == ncclInProgress) return;
    const std::string last = ncclGetLastError(comm_) ? ncclGetLastError(comm_) : "";
    ncclCommAbort(comm_);
    comm_ = nullptr;
    throw_error(ExitCode::kRuntime, "NCCL failed asynchronously on rank " + std::to_string(host_.rank()) + " (" +
                                        host_.host() + "): " + ncclGetErrorString(async) +
                                        (last.empty() ? std::string() : " (" + last + ")") +
                                        "; the NCCL communicator was aborted. Check the other ranks' messages, "
                                        "the network between the nodes (NCCL_DEBUG=WARN tells more)");
  }

  cuda::Context& c_;  // the backend's: compute_ is its stream, and its wait hook calls poll()
  cudaStream_t compute_ = nullptr, comm_stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::vector<Slot> slots_;
};

// Ranks sharing a GPU: each float collective copies the range to host memory (which waits for
// the compute stream), sums or broadcasts it with the MPI communicator (rank-ordered sums, Note
// [Sums in rank order]) and copies it back; --exact-sums's int64 sums the same way. Slow, but
// correct and simple; the staging buffers are made at construction.
class StagedCommunicator final : public HostForwarding {
 public:
  using HostForwarding::allreduce_sum;  // the host overloads, next to this class's float ones
  using HostForwarding::broadcast;
  StagedCommunicator(Communicator& host, Backend& backend, cuda::Context& c, std::int64_t capacity,
                     bool integer_sums)
      : HostForwarding(host),
        backend_(backend),
        c_(c),
        staging_(static_cast<std::size_t>(capacity)),
        integers_(integer_sums ? static_cast<std::size_t>(capacity) + 2 : 0) {}

  std::string progress_mode() const override {
    return "copied to host memory and summed by MPI as each bucket is ready (ranks share GPUs)";
  }

  void allreduce_sum(std::span<float> d) override {
    std::span<float> h = stage(d);
    host_.allreduce_sum(h);
    backend_.upload(h, d.data());
  }
  CommRequest start_allreduce_sum(std::span<float> d) override {
    allreduce_sum(d);  // done at once: the request only records that
    return CommRequest{0};
  }
  // The integers of --exact-sums: their own staging buffer (the bucket's, and the two counters).
  CommRequest start_allreduce_sum(std::span<std::int64_t> d) override {
    MNIST_CHECK(d.size() <= integers_.size(), ExitCode::kRuntime, "staged collective larger than its buffer");
    std::span<std::int64_t> h(integers_.data(), d.size());
    copy(h.data(), d.data(), d.size_bytes(), cudaMemcpyDeviceToHost);
    host_.allreduce_sum(h);
    copy(d.data(), h.data(), d.size_bytes(), cudaMemcpyHostToDevice);
    return CommRequest{0};
  }
  // A reduce-scatter is the whole sum (more than it must do); the allgather stages like the sum.
  CommRequest start_reduce_scatter_sum(std::span<float> d) override { return start_allreduce_sum(d); }
  CommRequest start_reduce_scatter_sum(std::span<std::int64_t> d) override { return start_allreduce_sum(d); }
  CommRequest start_allgather_shards(std::span<float> d) override {
    std::span<float> h = stage(d);
    CommRequest r = host_.start_allgather_shards(h);
    host_.wait(r, nullptr);
    backend_.upload(h, d.data());
    return CommRequest{0};
  }
  void wait(CommRequest& req, std::chrono::steady_clock::time_point* completed) override {
    req.id = -1;
    if (completed) *completed = std::chrono::steady_clock::now();
  }
  void broadcast(std::span<float> d, int root) override {
    std::span<float> h = stage(d);
    host_.broadcast(h, root);
    backend_.upload(h, d.data());
  }

 private:
  std::span<float> stage(std::span<float> d) {
    MNIST_CHECK(d.size() <= staging_.size(), ExitCode::kRuntime, "staged collective larger than its buffer");
    std::span<float> h(staging_.data(), d.size());
    backend_.download(d.data(), h);
    return h;
  }
  // As Backend::download / upload: the stream drained by polling first, so that the copy (which may
  // block the host in a pageable copy) waits for nothing queued before it.
  void copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    c_.wait_for_stream();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, c_.stream));
    c_.wait_for_stream();
  }
  Backend& backend_;
  cuda::Context& c_;
  std::vector<float> staging_;
  std::vector<std::int64_t> integers_;  // --exact-sums only: capacity + 2
};

}  // namespace

namespace cuda {

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, Context& c) {
  return std::make_unique<NcclCommunicator>(host, c);
}

std::unique_ptr<Communicator> make_staged_communicator(Communicator& host, Backend& backend, Context& c,
                                                       std::int64_t capacity, bool integer_sums) {
  return std::make_unique<StagedCommunicator>(host, backend, c, capacity, integer_sums);
}

}  // namespace cuda
}  // namespace mnist_mpi
