// The summary of a finished run in one record: who the run was (the metrics file's "start" event)
// and what it gave (the trainer's FinalFacts, and where its time went). The monitor builds it once
// at the end of training, and everything that reports the end of a run is made from it: the text
// summary on stdout, the metrics file's "final" event (final_event), and the facts and time of the
// HTML report (facts, time); `mnist_mpi report` rebuilds it from a metrics file (from_events), so a
// report drawn after the run says what the one drawn at its end said, under the same names.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mnist_mpi/json.hpp"
#include "mnist_mpi/report/html_report.hpp"  // TimeShare
#include "mnist_mpi/run_facts.hpp"

namespace mnist_mpi {

struct RunSummary {
  // Who the run was: the "start" event's fields.
  std::string config;  // --config as given ("" without one)
  std::string model, precision, optimizer;
  bool exact_sums = false;
  std::uint64_t seed = 0;
  std::int64_t world_size = 1, global_batch = 0, steps_per_epoch = 0;
  // What it gave: the "final" event's fields.
  FinalFacts end;
  std::int64_t buckets = 0;
  double process_s = 0;         // rank 0: from the process start to the end of training
  std::vector<TimeShare> time;  // where process_s went: start-up, each phase of the steps, evaluation, other

  // The "final" event (the monitor adds the launcher's fields).
  Json final_event() const;
  // The summary of a metrics file's "start" and "final" events. A field of the wrong type throws
  // Error(kData) or nlohmann's type_error (the reader adds the file and line). A file written before
  // the final event held "time_s" gets the step phases from the means per step (no evaluation, no
  // other).
  static RunSummary from_events(const Json& start, const Json& final);
  // The report's rows of facts, in order; the same for the report drawn at the end of training and
  // for `mnist_mpi report` (which puts the file's name first).
  std::vector<std::pair<std::string, std::string>> facts() const;
  // Note [Naming a straggler]'s line for this run ("none (one rank)" for one).
  std::string straggler_line() const;
};

// Where a run's time went, in the order every report lists it: start-up, then the step's phases
// (`totals`: seconds over every step); the monitor adds evaluation and the rest ("other").
std::vector<TimeShare> time_shares(double startup_s, const StepTiming& totals);

// The step's phases in ms as the metrics file holds them ("step_ms": data, forward, backward,
// exposed_comm, optimizer), and back.
Json step_ms_json(const StepTiming& t);
StepTiming step_ms_of(const Json& j);
// One rank's means per step as the "ranks" and "final" events hold them, and back (a missing or
// malformed array: none).
Json rank_json(const RankTimes& r);
std::vector<RankTimes> ranks_of(const Json& event);
// A number field (missing or not a number: NaN), and a whole number of 64 bits (missing: dflt; a
// fraction or out of range: Error(kData) naming the field).
double json_field_number(const Json& j, const char* key);
std::int64_t json_field_whole(const Json& j, const char* key, std::int64_t dflt);

}  // namespace mnist_mpi
