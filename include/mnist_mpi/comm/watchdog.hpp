// CollectiveWatch: a watchdog thread that ends the job when a collective has not finished after a
// time limit (--collective-timeout), so a hung, stopped or lost rank cannot make the others wait
// forever. The code that waits on a collective marks it in a preallocated slot of atomics
// (begin/end: no allocation, no lock); the thread looks at the slots about once a second.
// watch_communicator() wraps any Communicator so that every blocking call is marked. Host waits
// on a GPU poll instead of blocking, with the same limit: wait_until (Note [Device waits have a
// deadline]).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/joined_thread.hpp"

namespace mnist_mpi {

class CollectiveWatch {
 public:
  // What the watch does when a slot has been busy for longer than the limit: gets one line naming
  // the collective, step and bucket. The default prints it on stderr (with the rank and host) and
  // calls MPI_Abort(MPI_COMM_WORLD, 1).
  using OnTimeout = std::function<void(const std::string& message)>;

  // timeout_s <= 0: never fires (the thread is not started). poll_s: how often the thread looks.
  CollectiveWatch(double timeout_s, int rank, std::string host, OnTimeout on_timeout = {}, double poll_s = 1.0);
  ~CollectiveWatch();  // stops the thread
  CollectiveWatch(const CollectiveWatch&) = delete;
  CollectiveWatch& operator=(const CollectiveWatch&) = delete;

  // Marks the start and end of a blocking collective. `what` must be a string literal (its
  // pointer is kept). Calls do not nest: a communicator is used from one thread.
  void begin(const char* what);
  void end();

  double timeout_s() const { return timeout_s_; }

 private:
  void loop();

  const double timeout_s_;
  const int rank_;
  const std::string host_;
  OnTimeout on_timeout_;
  const double poll_s_;
  std::atomic<std::int64_t> started_ns_{0};  // 0: idle
  std::atomic<const char*> what_{nullptr};
  std::mutex mutex_;  // only for the thread's sleep and shutdown, never taken by begin/end
  std::condition_variable wake_;
  bool stop_ = false;
  JoinedThread thread_;  // last: joined first (Note [Threads are joined on every path])
};

// Where this process is, for the watch's message: the training step (-1: before the first step),
// set by the trainer, and the gradient bucket being waited for (-1: none), set by the reducer
// around its waits. Process-wide relaxed atomics, so the step loop needs no pointer to a watch.
void watch_set_step(std::int64_t step);
void watch_set_bucket(std::int64_t bucket);

// " in step N, gradient bucket k" (or " before the first step"), from the two values above.
std::string watch_location();

// Note [Device waits have a deadline]
// NCCL sums run on the GPU: a peer that stalls (stopped, spinning, its GPU hung) leaves this
// rank's NCCL kernel waiting on the device, and ncclCommGetAsyncError reports only what NCCL
// itself detects, which a stalled peer on the same node is not. The collective watchdog sees
// only blocking host calls, and the host never blocks on the device: it polls an event
// (cuda::Context::wait_for_event). So the poll carries the deadline: between polls `check` asks
// NCCL for an asynchronous error (and throws one), and once --collective-timeout has passed
// `abort` aborts the NCCL communicator (which stops its kernels) and wait_until throws one line
// naming the wait, the step and bucket: main() reports it and MPI_Abort ends every rank, as the
// watchdog does on the CPU. A timeout of 0 waits forever (as --collective-timeout 0 means).
struct DeviceWaitPolicy {
  double timeout_s = 0.0;       // --collective-timeout; <= 0: no deadline
  std::function<void()> check;  // between polls (may throw)
  std::function<void()> abort;  // at the deadline, before the throw
};
// Polls `ready` until it returns true: spins briefly, then sleeps 50 us between polls. `what`
// names the wait for the message ("the GPU's queue").
void wait_until(const std::function<bool()>& ready, const DeviceWaitPolicy& policy, const char* what);

// Marks one collective for as long as it lives.
class WatchScope {
 public:
  WatchScope(CollectiveWatch* w, const char* what) : w_(w) {
    if (w_) w_->begin(what);
  }
  ~WatchScope() {
    if (w_) w_->end();
  }
  WatchScope(const WatchScope&) = delete;
  WatchScope& operator=(const WatchScope&) = delete;

 private:
  CollectiveWatch* w_;
};

// A Communicator that forwards every call to `inner` and marks every blocking one (allreduce,
// wait, broadcast, allgather, barrier) in `watch`; start/test do not block and are not marked.
std::unique_ptr<Communicator> watch_communicator(std::unique_ptr<Communicator> inner, CollectiveWatch& watch);

}  // namespace mnist_mpi
