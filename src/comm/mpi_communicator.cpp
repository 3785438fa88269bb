// The MPI Communicator on host buffers. Blocking collectives run on the calling thread; the sums
// started with start_allreduce_sum() run on a communication thread that owns every MPI call they
// make (Note [A thread for the sums]), as point-to-point segments that are summed in rank order
// as they arrive (Note [Sums in rank order]). The node-local rank comes from
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED). Every call goes through MPI_CHECK.
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"

#include "mnist_mpi/joined_thread.hpp"
#include "mnist_mpi/launch/launch_env.hpp"
#include "mnist_mpi/resilience/fault.hpp"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace mnist_mpi {
namespace {

using Clock = std::chrono::steady_clock;

int checked_count(std::size_t n) {
  MNIST_CHECK(n <= static_cast<std::size_t>(std::numeric_limits<int>::max()), ExitCode::kRuntime,
              "collective of " + std::to_string(n) + " elements exceeds MPI's int count");
  return static_cast<int>(n);
}

int provided_thread_level() {
  int level = MPI_THREAD_SINGLE;
  MPI_CHECK(MPI_Query_thread(&level));
  return level;
}

// Note [A thread for the sums]
// Open MPI moves a non-blocking transfer forward only inside MPI calls. Backward is one thread in
// oneDNN kernels that make no MPI call for tens of milliseconds (lenet's conv2 backward: ~60 ms),
// so a bucket started before it used to sit still until backward ended: the overlap was on paper.
// Here a communication thread owns the started sums. start_allreduce_sum() queues the range and
// returns; the thread runs the sums one after another in the order they were started, so every
// rank issues its transfers in the same order (Note [Buckets start in index order]), on a
// communicator of its own (red_), so they never match the main thread's collectives. wait()
// sleeps on a condition variable until the thread marks the sum done.
// The thread shares its core with the compute thread (one rank per core, --bind-to core): idle, it
// sleeps on a condition variable; waiting for a peer, it polls MPI_Testsome and, after a few
// empty polls, naps between polls (20 us, doubling up to 100 us while nothing arrives), so a rank
// that is ahead of its peer does not take half of its core from backward by spinning. The polling itself is where
// shared-memory transfers make progress, so it cannot stop altogether. Once the caller blocks in wait(), the core has
// nothing else to do and the thread polls without sleeping: that is the exposed part of the step. MPI must provide
// MPI_THREAD_MULTIPLE (init_mpi() asks for it; Debian's Open MPI does). With a lower level there is no thread: the sums
// run inside wait() on the caller's thread, and progress_mode() says so.

// Note [Sums in rank order]
// Every element is summed by one owner rank in ascending rank order, ((g0 + g1) + g2) + ..., so
// the bits do not depend on bucketing, on overlap, or on Open MPI's choice of algorithm (with 3 or
// more ranks its allreduce algorithms add the ranks' values in different orders by message size).
// A range of n elements is cut into world-size chunks, chunk r = shard_of(n, r, W) owned by rank
// r (Note [Shards] in include/mnist_mpi/comm/communicator.hpp). Reduce-scatter: every rank sends its contribution to
// chunk p to rank p, in segments of at most kSegmentBytes; the owner adds a segment as soon as all peers' copies of
// it have arrived (the sum runs on data still in cache, and overlaps the transfer of the next segments) and sends the
// summed segment to every peer at once (allgather). Same bytes on the wire as a ring allreduce,
// 2 (W-1)/W of the buffer per rank, and no copy of a rank's own contribution. The sharded
// optimiser runs the two halves apart (start_reduce_scatter_sum, start_allgather_shards): the
// same event loop with one half's requests left out, so its sums are these bits.
constexpr std::int64_t kSegmentBytes = 1 << 20;  // 1 MiB (measured on floats: 256 KiB-1 MiB alike, 64 KiB slower)
constexpr std::int64_t kMaxSegments = 8192;  // per chunk; tags [0, kMaxSegments) and
constexpr int kGatherTag = 16384;            // [kGatherTag, kGatherTag + kMaxSegments) < 32767
// Polling while the caller computes: after 64 empty polls, naps from 20 us doubling to 100 us.
constexpr std::chrono::microseconds kShortestNap{20}, kLongestNap{100};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm parent) {
    MPI_CHECK(MPI_Comm_dup(parent, &comm_));
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_dup(comm_, &red_));
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
    MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local_));
    MPI_CHECK(MPI_Comm_rank(local_, &local_rank_));
    MPI_CHECK(MPI_Comm_size(local_, &local_size_));
    char name[MPI_MAX_PROCESSOR_NAME];
    int len = 0;
    MPI_CHECK(MPI_Get_processor_name(name, &len));
    host_.assign(name, static_cast<std::size_t>(len));
    threaded_ = size_ > 1 && provided_thread_level() >= MPI_THREAD_MULTIPLE;
    if (threaded_) {  // last (Note [Threads are joined on every path])
      worker_.start([this] { run_worker(); }, mu_, stop_, work_cv_);
      fault_after_thread_start("communication", rank_);
    }
  }
  ~MpiCommunicator() override {
    worker_.join();
    MPI_Comm_free(&local_);
    MPI_Comm_free(&red_);
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  std::string host() const override { return host_; }
  std::string progress_mode() const override {
    if (size_ == 1) return "one rank, nothing to sum";
    return threaded_ ? "summed on a communication thread while backward runs"
                     : "summed inside wait() (MPI lacks MPI_THREAD_MULTIPLE, so no communication thread)";
  }

  // Float and bf16 sums go the way of the started ones (rank order; MPI has no bf16 addition); the
  // rest is Open MPI's reduction.
  void allreduce(Elements d, Reduction op) override {
    MNIST_CHECK(!d.is(ElementType::kBFloat16) || op == Reduction::kSum, ExitCode::kRuntime,
                "a bf16 reduction other than a sum");
    if ((d.is(ElementType::kFloat32) || d.is(ElementType::kBFloat16)) && op == Reduction::kSum) {
      CommRequest r = start(Collective::kAllreduceSum, d);
      wait(r, nullptr);
      return;
    }
    const MPI_Op mpi_op = op == Reduction::kSum ? MPI_SUM : op == Reduction::kMax ? MPI_MAX : MPI_MIN;
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, d.data, checked_count(d.size()), mpi_type(d.type), mpi_op, comm_));
  }

  // Queues a sum or a half of one for the communication thread (one rank: done at once).
  CommRequest start(Collective what, Elements d) override {
    MNIST_CHECK(!d.is(ElementType::kUInt8), ExitCode::kRuntime, "a started collective of bytes");
    std::unique_lock<std::mutex> lk(mu_);
    std::size_t slot = 0;
    while (slot < ops_.size() && ops_[slot].state != Op::kFree) ++slot;
    if (slot == ops_.size()) ops_.emplace_back();  // grows to the number of buckets, in the first step
    Op& op = ops_[slot];
    op.data = d;
    op.what = what;
    op.seq = next_seq_++;
    op.state = size_ == 1 ? Op::kDone : Op::kQueued;
    op.done_at = Clock::now();
    lk.unlock();
    if (threaded_) work_cv_.notify_one();
    return CommRequest{static_cast<std::int64_t>(slot)};
  }

  void wait(CommRequest& req, Clock::time_point* completed) override {
    std::unique_lock<std::mutex> lk(mu_);
    Op& op = checked_op(req);
    ++waiters_;
    waiter_cv_.notify_one();
    if (!threaded_) {  // run the queued sums in start order, up to this one, on this thread
      while (op.state != Op::kDone) {
        Op& next = *find_queued(run_seq_);
        lk.unlock();
        run_op(next);
        lk.lock();
        next.state = Op::kDone;
        next.done_at = Clock::now();
        ++run_seq_;
      }
    }
    done_cv_.wait(lk, [&] { return op.state == Op::kDone; });
    --waiters_;
    if (!worker_error_.empty()) throw Error(worker_error_code_, "communication thread: " + worker_error_);
    if (completed) *completed = op.done_at;
    op.state = Op::kFree;
    req.id = -1;
  }

  void broadcast(Elements d, int root) override {
    MPI_CHECK(MPI_Bcast(d.data, checked_count(d.size()), mpi_type(d.type), root, comm_));
  }
  void allgather(std::uint64_t value, std::span<std::uint64_t> out) override {
    MNIST_CHECK(out.size() == static_cast<std::size_t>(size_), ExitCode::kRuntime,
                "allgather: out.size() != world size");
    MPI_CHECK(MPI_Allgather(&value, 1, MPI_UINT64_T, out.data(), 1, MPI_UINT64_T, comm_));
  }
  void barrier() override { MPI_CHECK(MPI_Barrier(comm_)); }
  void gather(std::span<const double> mine, std::span<double> out, int root) override {
    MNIST_CHECK(rank_ != root || out.size() == mine.size() * static_cast<std::size_t>(size_), ExitCode::kRuntime,
                "gather: out must hold every rank's values");
    MPI_CHECK(MPI_Gather(mine.data(), checked_count(mine.size()), MPI_DOUBLE, out.data(), checked_count(mine.size()),
                         MPI_DOUBLE, root, comm_));
  }
  void gather(std::span<const std::uint8_t> mine, std::vector<std::uint8_t>& out, std::vector<std::int64_t>& counts,
              int root) override {
    const bool me = rank_ == root;
    auto n = static_cast<std::int64_t>(mine.size());
    counts.assign(me ? static_cast<std::size_t>(size_) : 0, 0);
    MPI_CHECK(MPI_Gather(&n, 1, MPI_INT64_T, counts.data(), 1, MPI_INT64_T, root, comm_));
    std::vector<int> c(counts.size()), displs(counts.size());
    std::int64_t total = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      c[r] = checked_count(static_cast<std::size_t>(counts[r]));
      displs[r] = checked_count(static_cast<std::size_t>(total));
      total += counts[r];
    }
    out.assign(static_cast<std::size_t>(total), 0);
    MPI_CHECK(MPI_Gatherv(mine.data(), checked_count(mine.size()), MPI_UINT8_T, out.data(), c.data(), displs.data(),
                          MPI_UINT8_T, root, comm_));
  }

 private:
  // A whole sum, or one of its halves (Note [Shards]), of floats, doubles or integers (exact in
  // any order: Note [Exact sums in fixed point]).
  struct Op {
    enum State { kFree, kQueued, kDone } state = kFree;
    std::int64_t seq = 0;
    Elements data;
    Collective what = Collective::kAllreduceSum;
    Clock::time_point done_at;
  };

  static MPI_Datatype mpi_type(ElementType t) {
    switch (t) {
      case ElementType::kFloat32: return MPI_FLOAT;
      case ElementType::kFloat64: return MPI_DOUBLE;
      case ElementType::kInt64: return MPI_INT64_T;
      case ElementType::kUInt8: return MPI_UINT8_T;
      case ElementType::kBFloat16: return MPI_UINT16_T;  // moved as bits; summed here, never by MPI
    }
    throw_error(ExitCode::kRuntime, "no MPI datatype for this element type");
  }

  Op& checked_op(const CommRequest& req) {
    MNIST_CHECK(req.active() && req.id < static_cast<std::int64_t>(ops_.size()) &&
                    ops_[static_cast<std::size_t>(req.id)].state != Op::kFree,
                ExitCode::kRuntime, "test/wait on a request this communicator did not start");
    return ops_[static_cast<std::size_t>(req.id)];
  }
  Op* find_queued(std::int64_t seq) {  // caller holds mu_
    for (Op& o : ops_)
      if (o.state == Op::kQueued && o.seq == seq) return &o;
    return nullptr;
  }

  void run_worker() {
    // Under a real-time policy (chrt) threads of one priority never share a core, so the compute
    // thread would starve this one: it takes one level more, to run whenever it has work (it
    // sleeps between polls while the caller computes). Under the normal policy this does nothing.
    int policy = SCHED_OTHER;
    sched_param sp{};
    if (pthread_getschedparam(pthread_self(), &policy, &sp) == 0 && (policy == SCHED_FIFO || policy == SCHED_RR) &&
        sp.sched_priority < sched_get_priority_max(policy)) {
      ++sp.sched_priority;
      pthread_setschedparam(pthread_self(), policy, &sp);
    }
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      Op* op = nullptr;
      work_cv_.wait(lk, [&] { return stop_ || (op = find_queued(run_seq_)) != nullptr; });
      if (op == nullptr) return;  // stopping, nothing queued
      lk.unlock();
      if (worker_error_.empty()) {
        try {
          run_op(*op);
        } catch (const Error& e) {
          std::lock_guard<std::mutex> g(mu_);
          worker_error_ = e.what();
          worker_error_code_ = e.code();
        }
      }
      lk.lock();
      op->state = Op::kDone;  // also after an error, so that wait() returns and reports it
      op->done_at = Clock::now();
      ++run_seq_;
      done_cv_.notify_all();
    }
  }

  void run_op(Op& op) {
    switch (op.data.type) {
      case ElementType::kFloat32: return reduce(op.data.as<float>(), op.what, scratch_);
      case ElementType::kFloat64: return reduce(op.data.as<double>(), op.what, scratch_doubles_);
      case ElementType::kInt64: return reduce(op.data.as<std::int64_t>(), op.what, scratch_ints_);
      case ElementType::kBFloat16: return reduce(op.data.as<Bf16>(), op.what, scratch_bf16_);
      case ElementType::kUInt8: break;  // refused by start()
    }
  }

  // After a poll that found nothing: Note [A thread for the sums]'s nap, once 64 polls in a row
  // found nothing and no caller waits (a caller arriving in wait() ends the nap).
  void nap_if_idle(int& idle, std::chrono::microseconds& nap) {
    if (++idle > 64 && waiters_.load(std::memory_order_relaxed) == 0) {
      nap = std::min(kLongestNap, std::max(kShortestNap, 2 * nap));
      std::unique_lock<std::mutex> lk(mu_);
      waiter_cv_.wait_for(lk, nap, [&] { return waiters_.load(std::memory_order_relaxed) > 0; });
    }
  }

  // The sum of one range, in place (Note [Sums in rank order]). Runs on the communication thread
  // (or inside wait() without one); the first call for a size grows the buffers, later ones don't.
  // One event loop over four groups of requests, each segment's next transfer posted the moment
  // the one it depends on completes:
  //   [0, A)          reduce-scatter receives: peer j's part of my segment k, at j * my_segs + k
  //   [A, A+B)        reduce-scatter sends: my part of chunk p's segment k, in (p, k) order
  //   [A+B, A+2B)     gather receives, the same (p, k) order: posted when that send completed,
  //                   because they land where it leaves from
  //   [A+2B, 2A+2B)   gather sends of my summed segment k to peer j: posted when k is summed
  // A reduce-scatter posts only the first two groups and sums without sending; an
  // allgather of shards posts only the last two, at once. Integers (--exact-sums) go the
  // same way: their sums are exact, so the rank order only keeps the code one.
  // Long on purpose (Note [Why a function is long] in docs/style.md): the event loop above is one
  // state machine over four groups of requests; its indices are shared by every branch.
  template <class T>
  void reduce(std::span<T> d, Collective what, std::vector<T>& scratch) {
    const MPI_Datatype type = mpi_type(element_type_of<T>());
    const int n = size_, me = rank_;
    if (n == 1) return;
    const bool scatter = what != Collective::kAllgatherShards, gather = what != Collective::kReduceScatterSum;
    T* data = d.data();
    const auto count = static_cast<std::int64_t>(d.size());
    auto lo = [&](int r) { return r == n ? count : shard_of(count, r, n).begin; };  // Note [Shards]
    const std::int64_t my_lo = lo(me), my_len = lo(me + 1) - my_lo;
    const std::int64_t max_len = lo(n) - lo(n - 1);  // the last shard is the longest
    std::int64_t seg = kSegmentBytes / static_cast<std::int64_t>(sizeof(T));
    if ((max_len + seg - 1) / seg > kMaxSegments) seg = (max_len + kMaxSegments - 1) / kMaxSegments;
    auto segments = [&](std::int64_t len) { return static_cast<int>((len + seg - 1) / seg); };
    auto seg_len = [&](std::int64_t len, int k) {
      return checked_count(static_cast<std::size_t>(std::min(seg, len - k * seg)));
    };
    const int my_segs = segments(my_len);
    const auto peers = static_cast<std::size_t>(n - 1);
    const int A = static_cast<int>(peers) * my_segs;
    int B = 0;
    send_peer_.clear();  // (B): the peer and segment of each reduce-scatter send; capacity kept
    for (int p = 0; p < n; ++p)
      if (p != me)
        for (int k = 0; k < segments(lo(p + 1) - lo(p)); ++k, ++B) send_peer_.push_back({p, k});
    const auto total = static_cast<std::size_t>(2 * A + 2 * B);
    if (scratch.size() < peers * static_cast<std::size_t>(my_len)) scratch.resize(peers * static_cast<std::size_t>(my_len));
    if (reqs_.size() < total) reqs_.resize(total);
    if (indices_.size() < total) indices_.resize(total);
    if (arrived_.size() < static_cast<std::size_t>(my_segs)) arrived_.resize(static_cast<std::size_t>(my_segs));
    std::fill(reqs_.begin(), reqs_.begin() + static_cast<std::ptrdiff_t>(total), MPI_REQUEST_NULL);
    std::fill(arrived_.begin(), arrived_.end(), 0);
    auto peer_index = [&](int p) { return static_cast<std::size_t>(p < me ? p : p - 1); };
    auto peer_of = [&](std::size_t j) {
      return static_cast<int>(j) < me ? static_cast<int>(j) : static_cast<int>(j) + 1;
    };
    auto peer_part = [&](std::size_t j, int k) {  // (len): peer j's contribution to my segment k
      return scratch.data() + j * static_cast<std::size_t>(my_len) + static_cast<std::size_t>(k * seg);
    };

    // The gather receive of (p, k), the i-th reduce-scatter send's range, lands where it left from.
    auto post_gather_receive = [&](int i) {
      const auto [p, k] = send_peer_[static_cast<std::size_t>(i)];
      MPI_CHECK(MPI_Irecv(data + lo(p) + k * seg, seg_len(lo(p + 1) - lo(p), k), type, p, kGatherTag + k, red_,
                          &reqs_[static_cast<std::size_t>(A + B + i)]));
    };
    auto post_gather_sends = [&](int k) {  // my summed segment k to every peer
      for (std::size_t j = 0; j < peers; ++j)
        MPI_CHECK(MPI_Isend(data + my_lo + k * seg, seg_len(my_len, k), type, peer_of(j), kGatherTag + k, red_,
                            &reqs_[static_cast<std::size_t>(A + 2 * B) + j * static_cast<std::size_t>(my_segs) +
                                   static_cast<std::size_t>(k)]));
    };

    if (scatter) {
      for (std::size_t j = 0; j < peers; ++j)
        for (int k = 0; k < my_segs; ++k)
          MPI_CHECK(MPI_Irecv(peer_part(j, k), seg_len(my_len, k), type, peer_of(j), k, red_,
                              &reqs_[j * static_cast<std::size_t>(my_segs) + static_cast<std::size_t>(k)]));
      for (int i = 0; i < B; ++i) {
        const auto [p, k] = send_peer_[static_cast<std::size_t>(i)];
        MPI_CHECK(MPI_Isend(data + lo(p) + k * seg, seg_len(lo(p + 1) - lo(p), k), type, p, k, red_,
                            &reqs_[static_cast<std::size_t>(A + i)]));
      }
    } else {  // the shards are summed already: every transfer can start now
      for (int i = 0; i < B; ++i) post_gather_receive(i);
      for (int k = 0; k < my_segs; ++k) post_gather_sends(k);
    }

    // Sums segment k of my chunk in rank order, then sends it to every peer. One pass over memory:
    // a block of kBlock elements is summed in an L1-resident accumulator, ((c0 + c1) + c2) + ...,
    // reading my own contribution where it lies, and then written over it (no copy of it first:
    // that cost the ranks other than 0 two extra passes over their chunk, 1.2 ms of lenet's 12.5 MB).
    auto sum_and_send = [&](int k) {
      T* out = data + my_lo + k * seg;  // (len): my contribution, becomes the sum
      const int len = seg_len(my_len, k);
      auto part = [&](int r, int at) -> const T* {  // rank r's contribution to out[at..]
        return r == me ? out + at : peer_part(peer_index(r), k) + at;
      };
      if (n == 2) {  // c0 + c1 is c1 + c0 bit for bit (IEEE addition commutes): no block needed
        const T* __restrict c = peer_part(0, k);
        T* __restrict o = out;
        if constexpr (std::is_same_v<T, Bf16>)
          bf16_add(o, c, len);  // the CPU clones' loop
        else
          for (int i = 0; i < len; ++i) o[i] += c[i];
      } else {
        constexpr int kBlock = 2048;
        alignas(64) T acc[kBlock];
        for (int at = 0; at < len; at += kBlock) {
          const int m = std::min(kBlock, len - at);
          std::memcpy(acc, part(0, at), static_cast<std::size_t>(m) * sizeof(T));
          for (int r = 1; r < n; ++r) {
            const T* __restrict c = part(r, at);
            if constexpr (std::is_same_v<T, Bf16>)
              bf16_add(acc, c, m);
            else
              for (int i = 0; i < m; ++i) acc[i] += c[i];
          }
          std::memcpy(out + at, acc, static_cast<std::size_t>(m) * sizeof(T));
        }
      }
      if (gather) post_gather_sends(k);
    };

    const std::size_t expected =
        (scatter ? static_cast<std::size_t>(A + B) : 0) + (gather ? static_cast<std::size_t>(A + B) : 0);
    std::size_t done = 0;
    int idle = 0;
    std::chrono::microseconds nap{0};
    while (done < expected) {
      int outcount = 0;
      MPI_CHECK(MPI_Testsome(static_cast<int>(total), reqs_.data(), &outcount, indices_.data(), MPI_STATUSES_IGNORE));
      MNIST_CHECK(outcount != MPI_UNDEFINED, ExitCode::kRuntime, "allreduce: no active request left before the end");
      if (outcount == 0) {
        nap_if_idle(idle, nap);
        continue;
      }
      idle = 0;
      nap = std::chrono::microseconds{0};
      done += static_cast<std::size_t>(outcount);
      for (int c = 0; c < outcount; ++c) {
        const int index = indices_[static_cast<std::size_t>(c)];
        if (index < A) {  // a peer's part of my segment k is in
          const int k = index % my_segs;
          if (++arrived_[static_cast<std::size_t>(k)] == n - 1) sum_and_send(k);
        } else if (index < A + B && gather) {  // my part of (p, k) has left: its sum may land there now
          post_gather_receive(index - A);
        }
      }
    }
  }

  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  MPI_Comm comm_ = MPI_COMM_NULL, red_ = MPI_COMM_NULL, local_ = MPI_COMM_NULL;
  std::string host_;

  // Shared between the caller and the communication thread, under mu_.
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_, waiter_cv_;
  std::deque<Op> ops_;  // a deque: the thread keeps a reference while the caller adds ops
  std::int64_t next_seq_ = 0, run_seq_ = 0;
  bool stop_ = false;
  std::atomic<int> waiters_{0};  // callers blocked in wait(): then the thread polls without sleeping
  std::string worker_error_;
  ExitCode worker_error_code_ = ExitCode::kRuntime;
  bool threaded_ = false;

  // Owned by whichever thread runs reduce().
  std::vector<float> scratch_;                  // (world - 1, my chunk): the peers' contributions to my chunk
  std::vector<double> scratch_doubles_;         // the same for sums of doubles
  std::vector<std::int64_t> scratch_ints_;      // and of integers
  std::vector<Bf16> scratch_bf16_;              // and of bf16 (each addition rounded to bf16)
  std::vector<MPI_Request> reqs_;               // the four groups of reduce()
  std::vector<std::pair<int, int>> send_peer_;  // (peer, segment) of each reduce-scatter send
  std::vector<int> indices_, arrived_;

  JoinedThread worker_;  // last: joined first (Note [Threads are joined on every path])
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD); }
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) { return std::make_unique<MpiCommunicator>(comm); }

namespace {

// The singleton's session tree and the process that made it (a forked child must not remove it).
std::string g_session_tree;
pid_t g_session_owner = 0;

void remove_session_tree() {
  if (g_session_tree.empty() || getpid() != g_session_owner) return;
  std::error_code ignored;  // at exit nothing can be reported; a leftover is only an empty tree in tmp
  std::filesystem::remove_all(g_session_tree, ignored);
}

// Note [A singleton's own session directory] (include/mnist_mpi/launch/launch_env.hpp). When no
// directory can be made, Open MPI is left to its default (and to its own message if that fails).
void give_the_singleton_its_own_session_tree() {
  setenv("OMPI_MCA_ess_singleton_isolated", "1", 0);
  const char* base = std::getenv("OMPI_MCA_orte_tmpdir_base");
  if (!base || !*base) base = std::getenv("TMPDIR");
  if (!base || !*base) base = "/tmp";
  std::string tree = std::string(base) + "/mnist_mpi-session.XXXXXX";
  if (!mkdtemp(tree.data())) return;
  g_session_tree = tree;
  g_session_owner = getpid();
  std::atexit(remove_session_tree);
  setenv("OMPI_MCA_orte_tmpdir_base", tree.c_str(), 1);
}

}  // namespace

// Note [Open MPI under LeakSanitizer]
// Open MPI keeps, until the process ends, thousands of blocks that MPI_Init and MPI_Finalize
// allocate (in libopen-pal, ORTE's and PMIx's components, and hwloc's plugins).
// tests/sanitizers/lsan.supp matched them by the libraries in their allocation stacks, which
// needed the slow unwinder on every malloc (Open MPI's libraries have no frame pointers;
// fast_unwind_on_malloc=0): the library's unit tests took 31 s under AddressSanitizer, 7.9 s with
// the fast one (2026-12-07). With the fast unwinder a block's stack ends at its first frame, often
// in libc (asprintf, strdup) or in a component since unloaded (Note [Components kept loaded under
// LeakSanitizer], tests/sanitizers/keep_loaded.cpp). So what the main thread allocates inside
// MPI_Init and MPI_Finalize is not counted as a leak (__lsan_disable, a per-thread switch); Open
// MPI's own threads allocate from its libraries, which the suppressions name by that first frame.
// Everything else, ours included, is checked (a block leaked in main() after init_mpi() is
// reported with its line).
namespace {
class OpenMpiAllocations {
 public:
#if defined(__SANITIZE_ADDRESS__)
  OpenMpiAllocations() { __lsan_disable(); }
  ~OpenMpiAllocations() { __lsan_enable(); }
#else
  OpenMpiAllocations() = default;
#endif
  OpenMpiAllocations(const OpenMpiAllocations&) = delete;
  OpenMpiAllocations& operator=(const OpenMpiAllocations&) = delete;
};
}  // namespace

// Note [Polling that gives way]
// A rank that waits for its peers polls: the communication thread's MPI_Test loop while the caller
// sits in wait() (Note [A thread for the sums]), MPI_Wait and the collectives. Open MPI polls at
// full speed unless it knows the node is oversubscribed; but a peer may share this rank's core
// without Open MPI knowing (ranks pinned together by a scheduler or taskset, or 2 vCPUs that are
// one host core's two hardware threads). The waiting rank then takes the time of the very peer it
// waits for: the faster rank slows the slower one, which stays behind, and an even run names a
// straggler (tests/e2e_report.sh did so in CI: rank 1 62 % slower, rank 0 waiting 1.5 ms a step).
// mpirun --oversubscribe does not turn yielding on either: 3 ranks on 2 cores spun. So every rank
// asks for mpi_yield_when_idle: a poll that found nothing ends with sched_yield(), which returns at
// once when nothing else wants the core. Measured (docs/performance.md#polling-that-gives-way):
// 2 ranks pinned to one core 6.1x faster, 3 ranks on 2 cores 2.3x (lenet) and 6.4x (tiny), one
// rank a core unchanged. A user's own OMPI_MCA_mpi_yield_when_idle is kept.
int init_mpi(int* argc, char*** argv) {
  const auto lookup = [](const char* name) -> const char* { return std::getenv(name); };
  // Note [Open MPI's point-to-point layer on one node] (include/mnist_mpi/launch/launch_env.hpp)
  if (const char* pml = pml_for_launch(lookup)) setenv("OMPI_MCA_pml", pml, 0);
  setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);  // Note [Polling that gives way]
  if (launched_alone(lookup)) give_the_singleton_its_own_session_tree();
  int provided = MPI_THREAD_SINGLE;
  [[maybe_unused]] OpenMpiAllocations open_mpi;  // Note [Open MPI under LeakSanitizer]
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  return provided;
}

void finalize_mpi() {
  [[maybe_unused]] OpenMpiAllocations open_mpi;  // Note [Open MPI under LeakSanitizer]
  MPI_Finalize();
}

}  // namespace mnist_mpi
