// The end-of-run report (--report FILE): one self-contained HTML page, readable in any browser
// without a network (inline SVG, no scripts, no external fonts), with the loss and accuracy curves,
// a bar of where the time went, and the run's facts. The curves' data is embedded as JSON in
// <script type="application/json" id="mnist-mpi-report">, so tools (and tests) can read it back:
// the rows drawn, which for a long run are a bounded sample ("logged" says how many there were;
// Note [A bounded sample that keeps the extremes] in src/report/html_report.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mnist_mpi/run_facts.hpp"  // RankTimes

namespace mnist_mpi {

struct TrainPoint {
  std::int64_t step = 0;
  double loss = 0, lr = 0, images_per_s = 0;
};
struct EvalPoint {
  const char* split = "";  // "validation" | "test" (string literals)
  std::int64_t step = 0;
  double accuracy = 0, loss = 0;
};
// Every rank's compute and wait per step over one log window (ms), in rank order.
struct RankPoint {
  std::int64_t step = 0;
  std::vector<double> compute_ms, wait_ms;
};
struct TimeShare {
  std::string name;
  double seconds = 0;
};

struct ReportData {
  std::vector<std::pair<std::string, std::string>> facts;  // (name, value) rows of the summary
  std::vector<TrainPoint> train;                           // at every --log-every
  std::vector<EvalPoint> evals;
  std::vector<TimeShare> time;  // where the time of the run went, in seconds, summing to the wall time
  std::int64_t steps_per_epoch = 0;     // for the epoch marks on the step axes (0: none)
  std::vector<RankPoint> rank_points;  // at every --log-every (Note [Every rank's step times])
  std::vector<RankTimes> ranks;        // every rank's means over the run
  std::string straggler;               // Note [Naming a straggler]'s line (straggler_text)
  int straggler_rank = -1;             // the rank it names, -1: none
};

std::string report_json(const ReportData& data);
// Note [Charts people can read] in src/report/html_report.cpp: ticks at 1, 2 or 5 times a power of
// ten covering [lo, hi], about `target` of them; a value as a tick label (unit: 0 plain, 1 a fraction
// shown as %, 2 a rate as 72.9k, 3 milliseconds), with the decimals that ticks `step` apart need.
std::vector<double> nice_ticks(double lo, double hi, int target);
std::string format_value(double v, int unit, double step);
// A value axis's ticks for data in [lo, hi] (unit as above): nice_ticks, with an axis of some height
// for one value, and a fraction's within [0, 1] (Note [An axis of a fraction]).
std::vector<double> axis_ticks(double lo, double hi, int unit);
// The indices (ascending) of the points of a series, in step order, that its chart draws: all of
// them up to 4 * buckets, else of each of `buckets` step ranges its first, last, lowest and highest
// points and its first that is not a number: at most 5 * buckets (Note [A bounded sample that
// keeps the extremes]).
std::vector<std::size_t> bounded_sample(const std::vector<std::pair<double, double>>& points, std::size_t buckets);
std::string render_html_report(const ReportData& data);
// Several runs' data overlaid in one page (`mnist_mpi report`), each under its label.
struct LabelledRun {
  std::string label;
  ReportData data;
};
std::string render_runs_report(const std::vector<LabelledRun>& runs);
class OutputFile;
// Writes render_html_report(data) to `out` (a kReplace OutputFile: through PATH.tmp and a rename).
// false when it could not be written: a lost output, reported by `out`, not an error.
bool write_html_report(OutputFile& out, const ReportData& data);

}  // namespace mnist_mpi
