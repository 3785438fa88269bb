// `mnist_mpi report` (include/mnist_mpi/report/report_command.hpp).
#include "mnist_mpi/report/report_command.hpp"

#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <map>

#include <boost/program_options.hpp>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/config/options.hpp"  // run_subcommand
#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/io/file_roles.hpp"
#include "mnist_mpi/json.hpp"
#include "mnist_mpi/report/output.hpp"
#include "mnist_mpi/report/ranks.hpp"
#include "mnist_mpi/report/run_summary.hpp"

namespace mnist_mpi {
namespace po = boost::program_options;
namespace {

constexpr const char* kTempSuffix = ".tmp";               // Note [Whole or absent]
constexpr std::uint64_t kMaxBytes = std::uint64_t{1} << 32;  // a metrics file of 4 GB is not one

}  // namespace

namespace {

LabelledRun read_metrics(const std::string& path, std::int64_t& n);

}  // namespace

// A field of the wrong type (a hand-edited or damaged file) is nlohmann's type_error: said here,
// with the line, like every other fault of the file.
LabelledRun read_metrics_file(const std::string& path) {
  std::int64_t n = 0;
  try {
    return read_metrics(path, n);
  } catch (const Json::exception& e) {
    throw_error(ExitCode::kData, path + ":" + std::to_string(n) + ": an event with a field of the wrong type (" +
                                     e.what() + "): not a metrics file this program wrote");
  } catch (const Error& e) {  // one that does not name the file and line yet (whole()): its line
    if (n == 0 || std::string(e.what()).rfind(path, 0) == 0) throw;  // n == 0: the file itself
    throw_error(e.code(), path + ":" + std::to_string(n) + ": " + e.what());
  }
}

namespace {

LabelledRun read_metrics(const std::string& path, std::int64_t& n) {
  // Note [Look before you open] (include/mnist_mpi/io/file_kind.hpp): a FIFO or a directory is
  // refused by name, not read.
  const std::vector<std::uint8_t> bytes =
      read_regular_file(path, "the metrics file", ExitCode::kData, "give a file written by --metrics-file", kMaxBytes,
                        [&](std::uint64_t size) {
                          throw_error(ExitCode::kData, "the metrics file " + quote_input(path) + " has " +
                                                           std::to_string(size) +
                                                           " bytes, more than any run writes: not a metrics file");
                        });
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  LabelledRun run;
  ReportData& d = run.data;
  Json start, final_event;
  std::string line;
  while (std::getline(in, line)) {
    ++n;
    const std::string where = path + ":" + std::to_string(n);
    Json e;
    try {
      e = Json::parse(line);
    } catch (const Json::parse_error&) {
      throw_error(ExitCode::kData, where + ": not a line of JSON (a truncated or damaged metrics file?)");
    }
    MNIST_CHECK(e.is_object() && e.contains("event") && e["event"].is_string(), ExitCode::kData,
                where + ": a JSON line without an \"event\": not an mnist_mpi metrics file");
    const std::string kind = e["event"];
    if (n == 1) {
      MNIST_CHECK(kind == "start", ExitCode::kData, where + ": the first event is " + quote_input(kind) + ", not 'start'");
      const std::int64_t format = json_field_whole(e, "format", 0);
      MNIST_CHECK(format == kMetricsFormat, ExitCode::kData,
                  where + ": a metrics file of " +
                      (format == 0 ? std::string("an earlier version (no format number)")
                                   : "format " + std::to_string(format)) +
                      ", written by mnist_mpi " + quote_input(e.value("version", std::string("before 0.1.0"))) +
                      "; this program (" MNIST_MPI_VERSION ") reads format " + std::to_string(kMetricsFormat) +
                      ": draw it with the version that wrote it, or train again");
      start = e;
      continue;
    }
    if (kind == "step") {
      d.train.push_back(TrainPoint{json_field_whole(e, "step", 0), json_field_number(e, "loss"),
                                   json_field_number(e, "lr"), json_field_number(e, "images_per_s")});
    } else if (kind == "eval") {
      const std::string split = e.value("split", std::string());
      d.evals.push_back(EvalPoint{split == "validation" ? "validation" : "test", json_field_whole(e, "step", 0),
                                  json_field_number(e, "accuracy"), json_field_number(e, "loss")});
    } else if (kind == "ranks") {
      RankPoint p{json_field_whole(e, "step", 0), {}, {}};
      for (const RankTimes& r : ranks_of(e)) {
        p.compute_ms.push_back(1e3 * r.compute());
        p.wait_ms.push_back(1e3 * r.per_step.exposed_comm);
      }
      d.rank_points.push_back(std::move(p));
    } else if (kind == "final") {
      final_event = e;
    }
  }
  MNIST_CHECK(n > 0, ExitCode::kData, path + ": empty: not a metrics file");
  MNIST_CHECK(!final_event.is_null(), ExitCode::kData,
              path + ": ends at line " + std::to_string(n) +
                  " without the run's final event (a run still going or stopped, or a truncated file)");
  // The run's summary, as the monitor made it at the end of training (Note in
  // include/mnist_mpi/report/run_summary.hpp): the same facts and time, the file's name first.
  const RunSummary summary = RunSummary::from_events(start, final_event);
  d.steps_per_epoch = summary.steps_per_epoch;
  d.ranks = summary.end.ranks;
  d.straggler = summary.straggler_line();  // "none (one rank)" for one
  d.straggler_rank = summary.end.straggler.rank;
  d.facts = summary.facts();
  d.facts.insert(d.facts.begin(), {"file", path});
  d.time = summary.time;
  const std::string& config = summary.config;
  run.label = config.empty() ? (summary.model.empty() ? std::string("run") : summary.model)
                             : config.substr(config.rfind('/') + 1);
  run.label += ", " + std::to_string(summary.world_size) + " rank" + (summary.world_size == 1 ? "" : "s");
  return run;
}

}  // namespace

// Note [Labels that tell runs apart]
// A run is labelled by its config file's name (or its model) and its number of ranks; where two
// runs share that, each label gets what differs among them: precision, --exact-sums, seed; runs
// still alike are numbered.
void label_runs(std::vector<LabelledRun>& runs, const std::vector<std::string>& what) {
  const auto fact = [](const LabelledRun& r, const std::string& key) {
    for (const auto& [k, v] : r.data.facts)
      if (k == key) return v;
    return std::string();
  };
  std::map<std::string, std::vector<std::size_t>> same;
  for (std::size_t i = 0; i < runs.size(); ++i) same[runs[i].label].push_back(i);
  for (auto& [label, group] : same) {
    if (group.size() < 2) continue;
    for (const std::string& key : what) {
      bool differ = false;
      for (const std::size_t i : group) differ = differ || fact(runs[i], key) != fact(runs[group[0]], key);
      if (differ)
        for (const std::size_t i : group)
          runs[i].label += std::string(", ") + (key == "exact sums" ? "exact sums " : key == "seed" ? "seed " : "") +
                           fact(runs[i], key);
    }
  }
  std::map<std::string, int> seen;
  for (LabelledRun& r : runs)
    if (++seen[r.label] > 1) r.label += " #" + std::to_string(seen[r.label]);
}

int report_main(int argc, char** argv) {
  std::vector<std::string> files;
  std::string out_path;
  po::options_description desc(
      "mnist_mpi " MNIST_MPI_VERSION
      " report - draw one or several runs' metrics files (written with --metrics-file) into one HTML page.\n"
      "Usage: mnist_mpi report RUN.jsonl [RUN2.jsonl ...] --out FILE.html (one process, no mpirun)\n"
      "One run as the training-time --report draws it; several overlaid, labelled by config and options\n"
      "Exit code: 0 written; 2 bad option (no metrics file, no --out, an --out that names a metrics file);\n"
      "3 a metrics file missing, damaged or without its final event; 7 --out or standard output could not be written\n"
      "Options");
  desc.add_options()("help,h", "print this help and exit")(
      "out", po::value(&out_path), "the HTML file to write (replaced whole, or left as it was on an error)")(
      "run", po::value(&files), "metrics files (positional)");
  po::positional_options_description pos;
  pos.add("run", -1);
  return run_subcommand("report", "mnist_mpi report", desc, &pos, argc, argv, [&](const po::variables_map&) -> int {
    if (files.empty() || out_path.empty())
      throw_error(ExitCode::kUsage, "give one or more metrics files and --out FILE.html (see mnist_mpi report --help)");
    FileRoles roles;  // Note [No output is an input]: --out over a metrics file would destroy it
    for (const std::string& f : files) roles.input("a metrics file", f);
    roles.replaced_output("--out", out_path, kTempSuffix);
    roles.check();
    check_output_path(out_path, "the report (--out)", ExitCode::kOutput);  // before the work
    std::vector<LabelledRun> runs;
    for (const std::string& f : files) runs.push_back(read_metrics_file(f));
    label_runs(runs, {"precision", "exact sums", "seed"});
    write_whole_file(out_path, kTempSuffix,
                     runs.size() == 1 ? render_html_report(runs[0].data) : render_runs_report(runs));
    std::printf("report: %s (%zu run%s)\n", out_path.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
    return 0;
  });
}

}  // namespace mnist_mpi
