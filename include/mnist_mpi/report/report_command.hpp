// `mnist_mpi report RUN.jsonl [RUN2.jsonl ...] --out FILE.html`: one or several runs' metrics files
// (--metrics-file) drawn into one report, overlaid and labelled by their config and options
// (src/report/report_command.cpp). One process, no MPI.
#pragma once

#include <string>
#include <vector>

#include "mnist_mpi/report/html_report.hpp"

namespace mnist_mpi {

// The metrics file's format, written in its "start" event; `report` reads this one only (a file of
// another format is refused, naming the file and both formats).
inline constexpr int kMetricsFormat = 1;

// One metrics file as the report draws it; throws Error(kData) naming the file and line of what is
// wrong: not JSON (truncated), another format, no start or final event.
LabelledRun read_metrics_file(const std::string& path);
// Labels that tell the runs apart: "fast.ini, 2 ranks" and, where those agree, the seed, the
// precision and --exact-sums, then "#k".
void label_runs(std::vector<LabelledRun>& runs, const std::vector<std::string>& what);

int report_main(int argc, char** argv);

}  // namespace mnist_mpi
