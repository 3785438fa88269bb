// The preemption flag and the thread that sets it (see include/mnist_mpi/resilience/preemption.hpp).
#include "mnist_mpi/resilience/preemption.hpp"

#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <thread>

namespace mnist_mpi {
namespace {

// Note [The preemption flag]
// SIGTERM, SIGINT and SIGUSR1 are taken by one thread of their own, which waits for them with
// sigwait() and records the first one; every other thread blocks them. main() blocks them first
// thing, before MPI, oneDNN or the reducer start a thread, and every thread inherits that mask.
//
// Why not a plain handler: a handler runs on whichever thread the kernel picks, and it picks the
// main thread, which spends most of a step inside oneDNN's JIT kernels. Some of those (the
// AVX-512 and AVX2 f32 GEMM that the fully connected layers use, in the oneDNN that Debian 12
// ships) point rsp into a heap buffer while they run; the kernel then writes the signal frame over
// that buffer and the heap is corrupted ("corrupted size vs. prev_size", an abort a few calls
// later). oneDNN fixed it upstream (uxlfoundation/oneDNN issue 4845), but no signal should reach a
// compute thread anyway. We saw it as 2 aborts in 15 two-rank lenet runs preempted with SIGUSR1
// at a random moment (tests/slurm/requeue.sh in CI), and 0 in 40 after this change.
//
// A handler that only sets the flag stays installed as a fallback for a thread that a library
// starts with these signals unblocked. The training thread polls the flag once per step and the
// ranks agree on it with a tiny allreduce (max), so that all of them stop after the same step.
volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_preemption_signal(int signo) {
  if (g_signal == 0) g_signal = signo;
}

sigset_t preemption_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGTERM, SIGINT, SIGUSR1}) sigaddset(&set, s);
  return set;
}

void signal_thread() {
  const sigset_t set = preemption_set();
  for (;;) {
    int signo = 0;
    if (sigwait(&set, &signo) == 0 && g_signal == 0) g_signal = signo;
  }
}

}  // namespace

void block_preemption_signals() {
  const sigset_t set = preemption_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void install_preemption_handlers() {
  static const bool installed = [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_preemption_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int s : {SIGTERM, SIGINT, SIGUSR1}) sigaction(s, &sa, nullptr);
    block_preemption_signals();           // this thread and every thread it starts from now on
    std::thread(signal_thread).detach();  // lives until the process ends
    return true;
  }();
  (void)installed;
}

int preemption_signal() { return g_signal; }

void clear_preemption_signal() { g_signal = 0; }

const char* signal_name(int signo) {
  switch (signo) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGUSR1:
      return "SIGUSR1";
    default: {
      static thread_local char buf[24];
      std::snprintf(buf, sizeof buf, "signal %d", signo);
      return buf;
    }
  }
}

}  // namespace mnist_mpi
