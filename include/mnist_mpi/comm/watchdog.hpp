// CollectiveWatch: a watchdog thread that ends the job when a collective has not finished after a
// time limit (--collective-timeout), so a hung, stopped or lost rank cannot make the others wait
// forever. The code that waits on a collective marks it in a preallocated slot of atomics
// (begin/end: no allocation, no lock); the thread looks at the slots about once a second.
// watch_communicator() wraps any Communicator so that every blocking call is marked.
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
