// The collective watchdog (see include/mnist_mpi/comm/watchdog.hpp): one thread per rank that
// ends the job when a marked collective has been waiting longer than --collective-timeout, and
// the Communicator wrapper that marks every blocking call.
#include "mnist_mpi/comm/watchdog.hpp"

#include <mpi.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/resilience/fault.hpp"

namespace mnist_mpi {
namespace {

std::atomic<std::int64_t> g_step{-1}, g_bucket{-1};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void watch_set_step(std::int64_t step) { g_step.store(step, std::memory_order_relaxed); }
void watch_set_bucket(std::int64_t bucket) { g_bucket.store(bucket, std::memory_order_relaxed); }

std::string watch_location() {
  const std::int64_t step = g_step.load(std::memory_order_relaxed);
  const std::int64_t bucket = g_bucket.load(std::memory_order_relaxed);
  return (step >= 0 ? " in step " + std::to_string(step + 1) : std::string(" before the first step")) +
         (bucket >= 0 ? ", gradient bucket " + std::to_string(bucket) : std::string());
}

// Note [Device waits have a deadline] (include/mnist_mpi/comm/watchdog.hpp)
void wait_until(const std::function<bool()>& ready, const DeviceWaitPolicy& policy, const char* what) {
  const std::int64_t start = now_ns();
  const auto limit_ns = static_cast<std::int64_t>(policy.timeout_s * 1e9);
  for (int spins = 0;; ++spins) {
    if (ready()) return;
    if (policy.check) policy.check();
    if (policy.timeout_s > 0 && now_ns() - start > limit_ns) {
      if (policy.abort) policy.abort();
      char waited[32], limit[32];
      std::snprintf(waited, sizeof waited, "%.1f", static_cast<double>(now_ns() - start) * 1e-9);
      std::snprintf(limit, sizeof limit, "%g", policy.timeout_s);
      throw_error(ExitCode::kRuntime, std::string("device timeout: ") + what + watch_location() +
                                          " has not finished after " + waited + " s (--collective-timeout " + limit +
                                          "): another rank is hung, stopped or lost, or a GPU is stuck; the NCCL "
                                          "communicator was aborted, ending the job");
    }
    if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Note [Aborting from the watchdog thread]
// The watchdog must end the job while the main thread is blocked inside MPI, so it calls
// MPI_Abort from its own thread. init_mpi() asks for MPI_THREAD_MULTIPLE (the communication
// thread needs it too), which makes that legal; with a lower level Open MPI's abort still only
// tells the launcher to kill the job and exits. tests/e2e_faults.sh checks that it ends every
// rank. Should MPI_Abort ever return, the process exits anyway: a rank that exits without
// MPI_Finalize makes mpirun end the job too.
CollectiveWatch::CollectiveWatch(double timeout_s, int rank, std::string host, OnTimeout on_timeout, double poll_s)
    : timeout_s_(timeout_s), rank_(rank), host_(std::move(host)), on_timeout_(std::move(on_timeout)), poll_s_(poll_s) {
  if (!on_timeout_) {
    on_timeout_ = [rank = rank_, host = host_](const std::string& msg) {
      std::fprintf(stderr, "mnist_mpi: error on rank %d (%s): %s\n", rank, host.c_str(), msg.c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);  // Note [Aborting from the watchdog thread]
      std::_Exit(1);
    };
  }
  if (timeout_s_ > 0) {  // last (Note [Threads are joined on every path])
    thread_.start([this] { loop(); }, mutex_, stop_, wake_);
    fault_after_thread_start("watchdog", rank_);
  }
}

CollectiveWatch::~CollectiveWatch() { thread_.join(); }

void CollectiveWatch::begin(const char* what) {
  what_.store(what, std::memory_order_relaxed);
  started_ns_.store(now_ns(), std::memory_order_release);
}

void CollectiveWatch::end() { started_ns_.store(0, std::memory_order_release); }

void CollectiveWatch::loop() {
  const auto poll = std::chrono::duration<double>(poll_s_);
  const auto limit_ns = static_cast<std::int64_t>(timeout_s_ * 1e9);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, poll, [this] { return stop_; })) {
    const std::int64_t started = started_ns_.load(std::memory_order_acquire);
    if (started == 0 || now_ns() - started <= limit_ns) continue;
    const char* what = what_.load(std::memory_order_relaxed);
    char waited[32];
    std::snprintf(waited, sizeof waited, "%.0f", static_cast<double>(now_ns() - started) * 1e-9);
    std::string msg = std::string("collective timeout: ") + (what ? what : "a collective") + watch_location() +
                      ", has not finished after " + waited + " s (--collective-timeout " +
                      std::to_string(static_cast<long long>(timeout_s_)) +
                      "): another rank is hung, stopped or lost; ending the job";
    lock.unlock();
    on_timeout_(msg);  // the default does not return
    return;            // a test's handler returns: the watch fires once
  }
}

namespace {

// The watchdog's names of the collectives, literals (the watch keeps the pointer), by the
// operation and the element type (ElementType's order: float, double, int64, bytes, bf16). A
// started sum of floats is the gradient buckets' and goes without its type.
constexpr const char* kReductionNames[3][kElementTypes] = {
    {"allreduce_sum (float)", "allreduce_sum (double)", "allreduce_sum (int64)", "allreduce_sum (bytes)",
     "allreduce_sum (bf16)"},
    {"allreduce_max (float)", "allreduce_max (double)", "allreduce_max", "allreduce_max (bytes)",
     "allreduce_max (bf16)"},
    {"allreduce_min (float)", "allreduce_min (double)", "allreduce_min", "allreduce_min (bytes)",
     "allreduce_min (bf16)"}};
constexpr const char* kStartedNames[kCollectives][kElementTypes] = {
    {"wait for allreduce_sum", "wait for allreduce_sum (double)", "wait for allreduce_sum (int64)",
     "wait for allreduce_sum (bytes)", "wait for allreduce_sum (bf16)"},
    {"wait for reduce_scatter_sum", "wait for reduce_scatter_sum (double)", "wait for reduce_scatter_sum (int64)",
     "wait for reduce_scatter_sum (bytes)", "wait for reduce_scatter_sum (bf16)"},
    {"wait for allgather_shards", "wait for allgather_shards (double)", "wait for allgather_shards (int64)",
     "wait for allgather_shards (bytes)", "wait for allgather_shards (bf16)"}};
constexpr const char* kBroadcastNames[kElementTypes] = {"broadcast (float)", "broadcast (double)", "broadcast (int64)",
                                                        "broadcast (bytes)", "broadcast (bf16)"};

// Forwards to the inner communicator; marks each blocking call with a literal naming it.
class WatchedCommunicator final : public Communicator {
 public:
  WatchedCommunicator(std::unique_ptr<Communicator> inner, CollectiveWatch& watch) : in_(std::move(inner)), w_(watch) {
    names_.fill("wait for a collective");
  }

  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  int local_rank() const override { return in_->local_rank(); }
  int local_size() const override { return in_->local_size(); }
  std::string host() const override { return in_->host(); }
  std::string progress_mode() const override { return in_->progress_mode(); }

  void allreduce(Elements d, Reduction op) override {
    WatchScope s(&w_, kReductionNames[static_cast<int>(op)][static_cast<int>(d.type)]);
    in_->allreduce(d, op);
  }
  CommRequest start(Collective what, Elements d) override {
    return named(in_->start(what, d), kStartedNames[static_cast<int>(what)][static_cast<int>(d.type)]);
  }
  void wait(CommRequest& r, std::chrono::steady_clock::time_point* completed) override {
    WatchScope s(&w_, r.active() ? names_[static_cast<std::size_t>(r.id) % names_.size()] : "wait");
    in_->wait(r, completed);
  }
  void broadcast(Elements d, int root) override {
    WatchScope s(&w_, kBroadcastNames[static_cast<int>(d.type)]);
    in_->broadcast(d, root);
  }
  void allgather(std::uint64_t value, std::span<std::uint64_t> out) override {
    WatchScope s(&w_, "allgather");
    in_->allgather(value, out);
  }
  void barrier() override {
    WatchScope s(&w_, "barrier");
    in_->barrier();
  }
  void gather(std::span<const std::uint8_t> mine, std::vector<std::uint8_t>& out, std::vector<std::int64_t>& counts,
              int root) override {
    WatchScope s(&w_, "gather");
    in_->gather(mine, out, counts, root);
  }
  void gather(std::span<const double> mine, std::span<double> out, int root) override {
    WatchScope s(&w_, "gather of step times");
    in_->gather(mine, out, root);
  }
  void connect() override { in_->connect(); }
  bool device_buffers() const override { return in_->device_buffers(); }

 private:
  // What a started request is, for the watchdog's message, by id: a fixed ring (no allocation per
  // step); more than its size outstanding at once would only mislabel a message.
  CommRequest named(CommRequest r, const char* what) {
    if (r.active()) names_[static_cast<std::size_t>(r.id) % names_.size()] = what;
    return r;
  }
  std::unique_ptr<Communicator> in_;
  CollectiveWatch& w_;
  std::array<const char*, 1024> names_{};
};

}  // namespace

std::unique_ptr<Communicator> watch_communicator(std::unique_ptr<Communicator> inner, CollectiveWatch& watch) {
  return std::make_unique<WatchedCommunicator>(std::move(inner), watch);
}

}  // namespace mnist_mpi
