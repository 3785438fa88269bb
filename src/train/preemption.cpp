// The preemption flag and its signal handlers (see include/mnist_mpi/train/preemption.hpp).
#include "mnist_mpi/train/preemption.hpp"

#include <csignal>
#include <cstdio>
#include <cstring>
#include <initializer_list>

namespace mnist_mpi {
namespace {

// Note [The preemption flag]
// A handler may only touch a volatile std::sig_atomic_t (or a lock-free atomic); it records the
// first signal and returns. SA_RESTART keeps interrupted reads and writes going; MPI calls in
// progress are not disturbed. The training thread polls the flag once per step and the ranks
// agree on it with a tiny allreduce (max), so that all of them stop after the same step.
volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_preemption_signal(int signo) {
  if (g_signal == 0) g_signal = signo;
}

}  // namespace

void install_preemption_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_preemption_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGTERM, SIGINT, SIGUSR1}) sigaction(s, &sa, nullptr);
}

int preemption_signal() { return g_signal; }

void clear_preemption_signal() { g_signal = 0; }

const char* signal_name(int signo) {
  switch (signo) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    default: {
      static thread_local char buf[24];
      std::snprintf(buf, sizeof buf, "signal %d", signo);
      return buf;
    }
  }
}

}  // namespace mnist_mpi
