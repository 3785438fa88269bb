// Preemption: SIGTERM, SIGINT and SIGUSR1 (Slurm's --signal) only set a flag here, from a thread
// of their own that waits for them (no compute thread is ever interrupted); the training loop reads it at each step
// boundary and all ranks agree on it (the step boundary, include/mnist_mpi/train/step_boundary.hpp), so the run stops with a checkpoint instead of dying
// mid-step.
#pragma once

namespace mnist_mpi {

// Blocks the three signals in the calling thread (and so in every thread it starts later) and
// starts the thread that waits for them (idempotent). main() calls it first thing, before any
// other thread exists, so that a signal during start-up is not fatal either.
void install_preemption_handlers();
// Blocks the three signals in the calling thread (a thread that must never run a handler, even
// in a process that did not install them, e.g. the checkpoint writer under the unit tests).
void block_preemption_signals();
// 0, or the number of the first of these signals received.
int preemption_signal();
// "SIGTERM", "SIGINT", "SIGUSR1" or "signal N".
const char* signal_name(int signo);
// Forgets a received signal (tests).
void clear_preemption_signal();

}  // namespace mnist_mpi
