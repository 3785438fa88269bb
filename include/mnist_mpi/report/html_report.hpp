// The end-of-run report (--report FILE): one self-contained HTML page, readable in any browser
// without a network (inline SVG, no scripts, no external fonts), with the loss and accuracy curves,
// a bar of where the time went, and the run's facts. The curves' data is embedded as JSON in
// <script type="application/json" id="mnist-mpi-report">, so tools (and tests) can read it back.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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
struct TimeShare {
  std::string name;
  double seconds = 0;
};

struct ReportData {
  std::vector<std::pair<std::string, std::string>> facts;  // (name, value) rows of the summary
  std::vector<TrainPoint> train;                           // at every --log-every
  std::vector<EvalPoint> evals;
  std::vector<TimeShare> time;  // where the time of the run went, in seconds, summing to the wall time
};

std::string report_json(const ReportData& data);
std::string render_html_report(const ReportData& data);
class OutputFile;
// Writes render_html_report(data) to `out` (a kReplace OutputFile: through PATH.tmp and a rename).
// false when it could not be written: a lost output, reported by `out`, not an error.
bool write_html_report(OutputFile& out, const ReportData& data);

}  // namespace mnist_mpi
