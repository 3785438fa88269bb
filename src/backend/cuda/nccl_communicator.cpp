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
  // Float sums and broadcasts are the device's (device_buffers()); the rest is host memory.
  void allreduce(Elements d, Reduction op) final {
    if (d.is(ElementType::kFloat32) && op == Reduction::kSum)
      sum_on_device(d.as<float>());
    else
      host_.allreduce(d, op);
  }
  void broadcast(Elements d, int root) final {
    if (d.is(ElementType::kFloat32))
      broadcast_on_device(d.as<float>(), root);
    else
      host_.broadcast(d, root);
  }
  void allgather(std::uint64_t value, std::span<std::uint64_t> out) override { host_.allgather(value, out); }
  void barrier() override { host_.barrier(); }
  void gather(std::span<const std::uint8_t> mine, std::vector<std::uint8_t>& out, std::vector<std::int64_t>& counts,
              int root) override {  // host bytes: MPI's
    host_.gather(mine, out, counts, root);
  }
  void gather(std::span<const double> mine, std::span<double> out, int root) override { host_.gather(mine, out, root); }

 protected:
  virtual void sum_on_device(std::span<float> d) = 0;
  virtual void broadcast_on_device(std::span<float> d, int root) = 0;

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

  // Note [Shards] (include/mnist_mpi/comm/communicator.hpp): the halves' equal pieces [0, W q) in
  // one in-place ReduceScatter / AllGather (rank r's piece at r * q, where NCCL's in-place forms put
  // it), the remainder reduced to and broadcast from the last rank, in one NCCL group each.
  CommRequest start(Collective what, Elements d) override {
    const ncclDataType_t type = nccl_type(d.type);
    switch (what) {
      case Collective::kAllreduceSum:
        return enqueue([&] { NCCL_CHECK(ncclAllReduce(d.data, d.data, d.size(), type, ncclSum, comm_, comm_stream_)); });
      case Collective::kReduceScatterSum:
        return enqueue([&] {
          const auto [q, tail] = pieces(d);
          NCCL_CHECK(ncclGroupStart());
          if (q > 0)
            NCCL_CHECK(ncclReduceScatter(d.data, at(d, static_cast<std::size_t>(host_.rank()) * q), q, type, ncclSum,
                                         comm_, comm_stream_));
          if (tail > 0)
            NCCL_CHECK(ncclReduce(at(d, d.size() - tail), at(d, d.size() - tail), tail, type, ncclSum,
                                  host_.size() - 1, comm_, comm_stream_));
          NCCL_CHECK(ncclGroupEnd());
        });
      case Collective::kAllgatherShards:
        return enqueue([&] {
          const auto [q, tail] = pieces(d);
          NCCL_CHECK(ncclGroupStart());
          if (q > 0)
            NCCL_CHECK(ncclAllGather(at(d, static_cast<std::size_t>(host_.rank()) * q), d.data, q, type, comm_,
                                     comm_stream_));
          if (tail > 0)
            NCCL_CHECK(ncclBroadcast(at(d, d.size() - tail), at(d, d.size() - tail), tail, type, host_.size() - 1,
                                     comm_, comm_stream_));
          NCCL_CHECK(ncclGroupEnd());
        });
    }
    throw_error(ExitCode::kRuntime, "an unknown collective");
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

 private:
  void sum_on_device(std::span<float> d) override {
    CommRequest r = start(Collective::kAllreduceSum, d);
    wait(r, nullptr);
  }
  void broadcast_on_device(std::span<float> d, int root) override {
    connected();
    // On the compute stream: ordered after whatever wrote d and before whatever reads it.
    NCCL_CHECK(ncclBroadcast(d.data(), d.data(), d.size(), ncclFloat, root, comm_, compute_));
  }

  struct Slot {
    cudaEvent_t ready = nullptr, done = nullptr;
    bool busy = false;
  };

  // Note [Buckets on the communication stream]: queue() puts the collective on the communication
  // stream, after the compute stream's work so far; the request's `done` event follows it.
  template <class Queue>
  CommRequest enqueue(Queue queue) {
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
  static ncclDataType_t nccl_type(ElementType t) {
    switch (t) {
      case ElementType::kFloat32: return ncclFloat;
      case ElementType::kFloat64: return ncclDouble;
      case ElementType::kInt64: return ncclInt64;
      case ElementType::kUInt8: return ncclUint8;
      case ElementType::kBFloat16: return ncclBfloat16;
    }
    throw_error(ExitCode::kRuntime, "no NCCL datatype for this element type");
  }
  // Element i of d, as NCCL's untyped pointer.
  static void* at(const Elements& d, std::size_t i) { return static_cast<char*>(d.data) + i * element_bytes(d.type); }
  // The equal piece per rank and the remainder (Note [Shards]).
  std::pair<std::size_t, std::size_t> pieces(const Elements& d) const {
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

  // Done at once: the request only records that. A reduce-scatter is the whole sum (more than it
  // must do); the allgather stages like the sum. --exact-sums's integers have their own staging
  // buffer (the bucket's, and the two counters).
  CommRequest start(Collective what, Elements d) override {
    if (d.is(ElementType::kInt64) && what != Collective::kAllgatherShards) {
      MNIST_CHECK(d.size() <= integers_.size(), ExitCode::kRuntime, "staged collective larger than its buffer");
      std::span<std::int64_t> h(integers_.data(), d.size());
      copy(h.data(), d.data, d.size_bytes(), cudaMemcpyDeviceToHost);
      host_.allreduce_sum(h);
      copy(d.data, h.data(), d.size_bytes(), cudaMemcpyHostToDevice);
      return CommRequest{0};
    }
    MNIST_CHECK(d.is(ElementType::kFloat32), ExitCode::kRuntime,
                std::string("a staged ") + collective_name(what) + " of " + element_name(d.type));
    if (what == Collective::kAllgatherShards) {
      std::span<float> h = stage(d.as<float>());
      CommRequest r = host_.start_allgather_shards(h);
      host_.wait(r, nullptr);
      backend_.upload(h, d.as<float>().data());
    } else {
      sum_on_device(d.as<float>());
    }
    return CommRequest{0};
  }
  void wait(CommRequest& req, std::chrono::steady_clock::time_point* completed) override {
    req.id = -1;
    if (completed) *completed = std::chrono::steady_clock::now();
  }

 private:
  void sum_on_device(std::span<float> d) override {
    std::span<float> h = stage(d);
    host_.allreduce_sum(h);
    backend_.upload(h, d.data());
  }
  void broadcast_on_device(std::span<float> d, int root) override {
    std::span<float> h = stage(d);
    host_.broadcast(h, root);
    backend_.upload(h, d.data());
  }

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
