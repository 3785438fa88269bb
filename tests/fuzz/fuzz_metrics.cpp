// libFuzzer target: `mnist_mpi report`'s reader of metrics files (src/report/report_command.cpp) on
// hostile files, and the report drawn from whatever it accepts (one run, and the run twice
// overlaid): values of any size, NaN-free or not, any number of points and ranks. Every outcome
// must be a page or an Error(kData): no crash, leak, hang or huge allocation.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/report/report_command.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = mnist_mpi::fuzz::write_file("run.jsonl", data, size, false);
  try {
    mnist_mpi::LabelledRun run = mnist_mpi::read_metrics_file(path);
    std::vector<mnist_mpi::LabelledRun> runs{run, run};
    mnist_mpi::label_runs(runs, {"precision", "exact sums", "seed"});
    if (mnist_mpi::render_html_report(run.data).empty() || mnist_mpi::render_runs_report(runs).empty())
      __builtin_trap();
  } catch (const mnist_mpi::Error& e) {
    if (e.code() != mnist_mpi::ExitCode::kData) __builtin_trap();
  }
  return 0;
}
