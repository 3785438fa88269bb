// A thread that its owner cannot leave running: it is stopped and joined when the owner unwinds.
//
// Note [Threads are joined on every path]
// A std::thread that is still joinable when it is destroyed calls std::terminate, and a thread
// that waits on a condition variable of an object being destroyed hangs that destruction (seen:
// the checkpoint writer, started in the Checkpointer's constructor, which then threw because the
// resume checkpoint belonged to another run: the rank hung in pthread_cond_destroy or died with
// "terminate called without an active exception"). A constructor's own destructor does not run
// when the constructor throws, but the destructors of the members already built do. So every
// class that owns a thread (Checkpointer, MpiCommunicator, CollectiveWatch) holds it in a
// JoinedThread declared as its LAST member: it is destroyed first, while the mutexes and
// condition variables its loop uses still exist, and its destructor runs the owner's `stop`
// (set the flag, notify) and joins. Each owner also starts its thread as the last step of its
// constructor, and MNIST_MPI_FAULT=RANK:thread:NAME (include/mnist_mpi/resilience/fault.hpp) throws
// right after a start so that tests/e2e_hostile.sh can check the unwinding path of each.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace mnist_mpi {

class JoinedThread {
 public:
  JoinedThread() = default;
  ~JoinedThread() { join(); }
  JoinedThread(const JoinedThread&) = delete;
  JoinedThread& operator=(const JoinedThread&) = delete;

  // Runs body on a new thread; stop (called on the owner's thread, before the join) must make
  // body return soon.
  template <class Body>
  void start(Body&& body, std::function<void()> stop) {
    join();
    stop_ = std::move(stop);
    thread_ = std::thread(std::forward<Body>(body));
  }
  // The usual owner: body waits on `wake` under `mu` until `quit` is set; stopping sets it and
  // wakes the thread.
  template <class Body>
  void start(Body&& body, std::mutex& mu, bool& quit, std::condition_variable& wake) {
    start(std::forward<Body>(body), [&mu, &quit, &wake] {
      {
        std::lock_guard<std::mutex> lk(mu);
        quit = true;
      }
      wake.notify_all();
    });
  }
  // Stops and joins the thread, if one runs; then does nothing.
  void join() {
    if (!thread_.joinable()) return;
    if (stop_) stop_();
    thread_.join();
  }
  bool running() const { return thread_.joinable(); }

 private:
  std::function<void()> stop_;
  std::thread thread_;
};

}  // namespace mnist_mpi
