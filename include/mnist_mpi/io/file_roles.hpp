// Which files a command reads and which it writes, compared before anything is opened for
// writing, so that no output can be one of the user's inputs or another output.
//
// Note [No output is an input]
// An output path is the user's text, and so is every input path: nothing stops `--metrics-file`
// from naming the training images, `--report` the checkpoint being resumed, or `--timeline` and
// `--report` the same file. Opening such an output truncates the input at set-up (the run then
// trains on, or reads back, a half-written file) or silently replaces the other output. So every
// command first lists its files here, each with the option that named it: the inputs (the MNIST
// files, --config, the checkpoint resumed or read, the checkpoints already in --checkpoint-dir and
// its lock file, predict's images) and the outputs (the metrics file, the timeline and the report
// with their temporaries, export's ONNX file, evaluate's logits, predict's prepared images), and
// the families of outputs whose names are known only later (checkpoints by step and their
// temporaries, TensorBoard's events file) as a directory and a rule for the names. check() then
// compares every output with every input and every other output, and every family with both:
//  - two paths are the same file when both exist and stat() gives the same device and inode (so a
//    symbolic link or a hard link to an input counts), or when their resolved paths are equal
//    (what does not exist yet: the link-free absolute path, std::filesystem::weakly_canonical);
//  - a path is in a family when its resolved directory is the family's and its name matches.
// A family does not clash with the inputs of its own owner: the checkpointer writes next to the
// checkpoints it resumes from, by design (Note [One job per checkpoint directory]).
// The first clash is a usage error (exit 2) naming both options and the path, on every rank
// (each rank checks the same paths; Note [Ending every rank] in src/main.cpp), before any file
// has been created, truncated or removed. Inputs are not compared with each other: reading a file
// twice destroys nothing.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace mnist_mpi {

class FileRoles {
 public:
  // `option` is how a message names the file: "--metrics-file", "--data-dir (the training images)".
  // `owner` (may be empty) groups a family with the inputs it may write beside.
  void input(std::string option, std::string path, std::string owner = {});
  // A file the command creates, truncates or replaces (for one written through PATH.tmp, give
  // both: the temporary is an output too).
  void output(std::string option, std::string path);
  // An output written whole to PATH + suffix and renamed onto PATH (Note [Whole or absent] in
  // include/mnist_mpi/io/file_kind.hpp): both names are outputs. A character device (/dev/null) is
  // written directly, with no temporary.
  void replaced_output(const std::string& option, const std::string& path, const std::string& suffix);
  // The files the command will create in `dir` whose names are not known yet: every name for
  // which `matches` is true; `names` says which in messages ("checkpoints step-NNNNNNNN.ckpt").
  void outputs_in(std::string option, std::string dir, std::function<bool(std::string_view name)> matches,
                  std::string names, std::string owner = {});

  // Throws Error(ExitCode::kUsage) for the first clash (Note [No output is an input]).
  void check() const;

 private:
  struct File {
    std::string option, path, owner;
    bool output = false;
  };
  struct Family {
    std::string option, dir, names, owner;
    std::function<bool(std::string_view)> matches;
  };
  std::vector<File> files_;
  std::vector<Family> families_;
};

}  // namespace mnist_mpi
