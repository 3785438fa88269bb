// Preemption: SIGTERM, SIGINT and SIGUSR1 (Slurm's --signal) only set a flag here, in an
// async-signal-safe handler; the training loop reads it at each step boundary and all ranks agree
// on it (Checkpointer::after_step), so the run stops with a checkpoint instead of dying mid-step.
#pragma once

namespace mnist_mpi {

// Installs the handlers (idempotent). main() calls it first thing, so that a signal during
// start-up is not fatal either.
void install_preemption_handlers();
// 0, or the number of the first of these signals received.
int preemption_signal();
// "SIGTERM", "SIGINT", "SIGUSR1" or "signal N".
const char* signal_name(int signo);
// Forgets a received signal (tests).
void clear_preemption_signal();

}  // namespace mnist_mpi
