// One output of the run (the metrics JSON lines, TensorBoard events, the timeline, the HTML report,
// standard output), written so that its failure is never silent: see the Note below.
//
// Note [When an output cannot be written]
// The outputs are records of training, not its product: the model and its checkpoints are. So a
// write that fails (a full disk, a quota, a file system gone away, /dev/full) does not stop the
// run. Every open, write, flush and close of every output goes through an OutputFile, which
//  - reports the first failure once, on stderr, when it happens, naming the output, the file and
//    the errno text (report_lost_output(): "mnist_mpi: warning: cannot write the metrics file
//    (--metrics-file) '/tmp/m.jsonl': write: No space left on device; training goes on without
//    it, and the run will exit with code 7");
//  - writes nothing more to it (a torn JSON line or event is no better than none);
//  - remembers it (failed(), lost()): the summary at the end lists the outputs that were lost,
//    and every rank exits with code 7 (ExitCode::kOutput: "training finished, but an output could
//    not be written") instead of 0. Only rank 0 writes outputs, so the verdict is agreed by one
//    allreduce in Monitor::finish(). A more serious code (an error, preemption's 75) wins over 7.
// Refused at set-up instead, with exit 2 (they are mistakes in the command, better found before an
// hour of training): an output path that is a directory, a FIFO, a socket or in a missing
// directory (check_output_path(), Note [Look before you open]), and a file that cannot be created.
// Opening never blocks: a FIFO that appears later is opened with O_NONBLOCK and refused.
// Outputs a reader must not see half-written (the timeline, the report) are written to PATH.tmp
// and renamed onto PATH on close, unless PATH is a character device (/dev/null, /dev/full): that
// is written directly, since a rename would replace the device node.
// Standard output (progress lines, the summary) is one OutputFile for the process,
// standard_output(); other code that prints to stdout is covered by its final flush, since a
// stdio stream's error indicator stays set. Under mpirun, rank 0's stdout is a pipe to mpirun:
// a failure of mpirun's own stdout is mpirun's, and the ranks cannot see it.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

// The one warning for a lost output: "mnist_mpi: warning: cannot write <what> '<path>': <error>;
// training goes on without it, and the run will exit with code 7".
void report_lost_output(const std::string& what, const std::string& path, const std::string& error);

// One number as printf's `format` writes it ("%.2f"), for the summary lines and the reports.
std::string fmt(const char* format, double v);

class OutputFile {
 public:
  // kStream: PATH itself, written as the run goes (metrics, TensorBoard). kReplace: written whole
  // at the end through PATH.tmp and a rename on close (timeline, report).
  enum class Mode { kStream, kReplace };
  static constexpr const char* kReplaceSuffix = ".tmp";  // kReplace writes PATH + this, then renames

  // what: how messages name the output, e.g. "the metrics file (--metrics-file)". Opens nothing.
  OutputFile(std::string what, std::string path, Mode mode = Mode::kStream);
  ~OutputFile();  // closes it if open (a failure is reported like any other)
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  // The process's standard output (not owned: flushed, never closed).
  static OutputFile& standard_output();

  // Creates or truncates the file. At set-up: throws Error(code) naming the file when it cannot.
  void open_or_throw(ExitCode code);
  // Later (the timeline, the report): false when it cannot, reported as a lost output.
  bool open();

  // Each returns false once the output has failed (then it does nothing); never throws.
  bool write(std::string_view bytes);
  bool print(const char* format, ...) __attribute__((format(printf, 2, 3)));
  bool flush();  // also catches an earlier failed write by anyone sharing the stream (stdout)
  bool close();  // flush and close (kReplace: and rename); standard output: flush only

  bool is_open() const { return file_ != nullptr; }
  bool failed() const { return failed_; }
  const std::string& what() const { return what_; }
  const std::string& path() const { return path_; }
  // "<what> '<path>' (<error>)" once failed: a line of the summary of lost outputs.
  std::string lost() const;

 private:
  OutputFile(std::string what, std::string path, std::FILE* adopted);
  int open_file(std::string& error);  // 0, or an errno (error says what failed)
  void fail(const char* op, int err);
  void fail(const std::string& error);
  void discard();  // after a failure: close without checking, remove PATH.tmp

  std::string what_, path_, tmp_;  // tmp_: where kReplace writes (empty: straight to path_)
  Mode mode_;
  std::FILE* file_ = nullptr;
  bool owned_ = true;
  bool failed_ = false;
  std::string error_;
};

}  // namespace mnist_mpi
