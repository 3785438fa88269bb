// A testing hook that makes one rank fail on purpose at a given step, so that tests (and people
// checking a cluster) can see what the job does when a rank dies, crashes, throws, stops, hangs
// or produces NaN. Read once at start-up from the environment variable MNIST_MPI_FAULT =
// "RANK:STEP:KIND" (STEP counts from 1, as the progress lines do); unset means no fault.
// "RANK:thread:NAME" instead makes rank RANK throw right after it has started its thread NAME
// (checkpoint-writer, communication or watchdog): Note [Threads are joined on every path].
// "RANK:slow:MS" makes rank RANK sleep MS milliseconds in the backward pass of every step (a
// straggler: Note [Naming a straggler] in src/report/ranks.cpp).
// "RANK:dropout:local" makes rank RANK key its dropout masks by a sample's position in its own
// slice instead of in the global batch (the mistake Note [Dropout masks do not depend on the rank]
// in src/backend/cpu/dropout.cpp rules out), so that a test can show its bound would catch it.
#pragma once

#include <cstdint>
#include <string>

namespace mnist_mpi {

enum class FaultKind {
  kNone,
  kKill,         // the rank sends itself SIGKILL (a node or process lost)
  kSegv,         // the rank sends itself SIGSEGV (a crash)
  kThrow,        // the rank throws an Error, as a failing library call would
  kStop,         // the rank sends itself SIGSTOP (a stopped or swapped-out process)
  kHang,         // the rank sleeps forever (a deadlock, a lost node that keeps its sockets)
  kNan,          // the rank's loss and loss gradient become NaN (numerical trouble)
  kDiverge,      // after the step the rank flips the last bit of its first parameter (a replica gone its own way)
  kThreadStart,  // the rank throws right after starting the thread named by Fault::thread
  kSlow,         // the rank sleeps Fault::slow_ms in every step's backward (a straggler)
  kLocalDropoutKey,  // the rank keys dropout by the position in its own slice (a wrong mask)
};

struct Fault {
  int rank = -1;
  std::int64_t step = 0;  // 1-based
  FaultKind kind = FaultKind::kNone;
  std::string thread;  // kThreadStart: checkpoint-writer | communication | watchdog
  std::int64_t slow_ms = 0;  // kSlow
  // kSlow: this rank's sleep per step in milliseconds, else 0.
  std::int64_t slow_ms_for(int r) const { return kind == FaultKind::kSlow && rank == r ? slow_ms : 0; }
  // kLocalDropoutKey: whether rank r keys its dropout masks by its own slice's positions.
  bool local_dropout_key_for(int r) const { return kind == FaultKind::kLocalDropoutKey && rank == r; }
  bool armed_for(int r, std::int64_t step0) const { return kind != FaultKind::kNone && rank == r && step == step0 + 1; }
  // kNan: whether rank r's loss and loss gradient are poisoned in step step0 (0-based).
  bool poisons(int r, std::int64_t step0) const { return kind == FaultKind::kNan && armed_for(r, step0); }
  // kDiverge: whether rank r flips a bit of its parameters after step step0 (0-based).
  bool diverges(int r, std::int64_t step0) const { return kind == FaultKind::kDiverge && armed_for(r, step0); }
};

// Parses "RANK:STEP:KIND" (KIND: kill | segv | throw | stop | hang | nan | diverge); throws
// Error(kUsage) naming the variable when the value is malformed.
Fault parse_fault(const std::string& text);
// MNIST_MPI_FAULT from the environment (no fault when unset or empty).
Fault fault_from_env();
// For the owner of a thread, right after starting it: throws Error(kRuntime) when
// MNIST_MPI_FAULT is "RANK:thread:NAME" for this rank and this thread name.
void fault_after_thread_start(const char* name, int rank);
// Carries out a fault of kind kill, segv, throw, stop or hang (kNan and kDiverge are the trainer's to apply).
void fire_fault(const Fault& fault);
// Throws Error(kUsage) when the fault names a rank that a job of `world` ranks does not have.
void check_fault_rank(const Fault& fault, std::int64_t world);
// kDiverge: flips the last bit of x, the smallest change that makes a replica differ.
void flip_last_bit(float& x);

}  // namespace mnist_mpi
