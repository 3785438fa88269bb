// The facts of a run that several layers share: what one step's phases took, when each gradient
// bucket's sum ran, what the checkpoints cost, and how the run ended. Plain values, produced by
// the training loop, its reducer and the checkpointer, read by the monitor (include/mnist_mpi/
// report/monitor.hpp), which formats them: one small header at the bottom of the tree, so that a
// producer needs nothing of report/ and report/ nothing of the producers (docs/style.md, "Layers").
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace mnist_mpi {

// A host interval in seconds, as StepTiming holds them; the time since t; the steady clock's now
// in seconds (for differences only). The one definition of each for the trainer, its step
// boundary and the checkpointer.
inline double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return seconds(std::chrono::steady_clock::now() - t);
}
inline double now_s() { return seconds(std::chrono::steady_clock::now().time_since_epoch()); }

// Where a step's time went, in seconds (one step, or a sum or mean over steps), and the bytes
// each rank reduced per step: the one timing record of the trainer, the monitor and the report.
struct StepTiming {
  double data = 0, forward = 0, backward = 0, exposed_comm = 0, optimizer = 0;
  double reduced_bytes = 0;  // per step, per rank (set in the run's summary only)

  // Sums of steps and their mean: the five parts (reduced_bytes is not a per-step time).
  StepTiming& operator+=(const StepTiming& t) {
    data += t.data;
    forward += t.forward;
    backward += t.backward;
    exposed_comm += t.exposed_comm;
    optimizer += t.optimizer;
    return *this;
  }
  StepTiming mean_over(std::int64_t steps) const {
    StepTiming m = *this;
    if (steps <= 0) return m;
    const double n = static_cast<double>(steps);
    m.data /= n;
    m.forward /= n;
    m.backward /= n;
    m.exposed_comm /= n;
    m.optimizer /= n;
    return m;
  }
};

// When one bucket's sum started and when it completed (steady clock), for the last step.
struct BucketTiming {
  std::chrono::steady_clock::time_point start, end;
};

// Numbers for the final report.
struct CheckpointStats {
  std::int64_t written = 0;
  double bytes = 0;                    // per file
  double capture_ms = 0;               // rank 0, training thread: copying the state (mean)
  double write_ms = 0;                 // rank 0: checksums + write + fsync + rename (mean; background if async)
  double wait_previous_ms = 0;         // rank 0: waiting for the previous write to finish (total)
  double others_wait_ms = 0;           // the other ranks: mean wait at the step boundary after a checkpoint
  double others_wait_baseline_ms = 0;  // ... and after a step without one
  std::string last_file;
};

// A run stopped by a signal at a step boundary (exit code 75): rank 0's message and event.
struct PreemptedFacts {
  const char* signal = "";     // "SIGTERM"
  std::int64_t steps = 0;      // steps done
  bool checkpointing = false;  // --checkpoint-dir was given ...
  std::string checkpoint;      // ... and this checkpoint holds the run's state
};

// --target-accuracy: whether and where the run reached it (Note [Stopping at a target accuracy] in
// src/train/trainer.cpp).
struct TargetFacts {
  double accuracy = 0;  // the target; 0: none was set
  bool reached = false;
  std::int64_t step = 0;                 // steps done at the check that reached it
  double validation_accuracy = 0;        // of that check (rank 0)
  double time_from_process_start_s = 0;  // rank 0: from the first line of main to the decision
};

// The end of the run, as the trainer saw it (rank 0's values where ranks differ): the final report
// on stdout, the "final" event, the summary table and the HTML report.
// One rank's means per step, in seconds, over the steps it ran (Note [Every rank's step times]
// in src/report/run_telemetry.cpp).
struct RankTimes {
  int rank = 0;
  std::string host;
  StepTiming per_step;
  // The rank's own work: data, forward, backward and optimizer; exposed_comm is its wait.
  double compute() const { return per_step.data + per_step.forward + per_step.backward + per_step.optimizer; }
};

struct Straggler {
  int rank = -1;  // -1: none
  std::string host;
  std::string phase;           // where it lost the most time: data, forward, backward or optimizer
  double slower = 0;           // its compute over the median of the other ranks', minus 1 (0.23: 23 % slower)
  double phase_slower = 0;     // the same for that phase alone
  double others_waited_s = 0;  // over the run: the other ranks' mean wait beyond the straggler's own
};

struct FinalFacts {
  std::int64_t steps = 0;
  double epochs = 0, startup_s = 0, images_per_s = 0, test_accuracy = 0, test_loss = 0;
  std::string params_hash, model;
  double wall_s = 0;                        // training, from the first step (evaluation included)
  double eval_s = 0;                        // evaluation, as the trainer timed it
  std::vector<std::uint64_t> peak_rss_kib;  // per rank
  StepTiming per_step;                      // means over the steady steps, and the bytes reduced per step
  std::int64_t params = 0;
  CheckpointStats checkpoints;  // capture_ms and write_ms: totals over the checkpoints written
  std::int64_t skipped_steps = 0;
  TargetFacts target;
  // --exact-sums: the chunk (0: off) and the probe passes (Note [Where the shift comes from]).
  std::int64_t exact_chunk = 0, exact_sum_probes = 0;
  std::vector<RankTimes> ranks;  // every rank's means over the run (Note [Naming a straggler])
  Straggler straggler;
};

}  // namespace mnist_mpi
