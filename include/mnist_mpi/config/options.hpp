// Every option of the program in one struct, parsed with Boost.ProgramOptions: the command line
// over --config FILE (INI: `key = value`, the option names without dashes). A bad option or value
// throws Error(ExitCode::kUsage) with one clear line.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "mnist_mpi/config/optimizer_config.hpp"

namespace boost::program_options {
class error;
class options_description;
class positional_options_description;
class variables_map;
}  // namespace boost::program_options

namespace mnist_mpi {

struct Options {
  // data
  std::string data_dir;  // empty: found (Note [Where the data is found] in include/mnist_mpi/data/idx.hpp)
  std::int64_t validation_size = 5000;
  std::int64_t train_limit = 0;
  // model
  std::string model =
      "conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10";
  std::string weight_init = "truncated_normal:0.1";
  std::string bias_init = "zeros";
  // training
  std::int64_t batch_size = 0;         // per rank
  std::int64_t global_batch_size = 0;  // alternative to batch_size; kDefaultGlobalBatch when neither is given
  std::int64_t epochs = 1;
  std::int64_t max_steps = 0;  // 0: epochs decide
  double target_accuracy = 0;  // stop once the validation accuracy reaches it (0: off)
  std::uint64_t seed = 42;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  // gradient reduction
  double bucket_mb = 4.0;
  double first_bucket_mb = 1.0;
  bool no_overlap = false;
  // --shard-optimizer, ZeRO stage 1: each rank keeps and updates 1/N of the optimiser state. auto:
  // on for the CPU with 2 or more ranks (the same bits, faster, less memory; docs/reduction.md),
  // off on a GPU until NCCL's path has run across two GPUs (one GPU: the same bits, docs/gpu.md).
  enum class Sharding { kAuto, kOn, kOff };
  Sharding shard_optimizer = Sharding::kAuto;
  std::int64_t accumulation_steps = 1;
  // --exact-sums (Note [Exact sums in fixed point], docs/reduction.md): the gradient of the global
  // batch summed in chunks of exact_chunk images as 64-bit integers, so that the parameters are the
  // same bits on any number of ranks. exact_chunk 0: the largest divisor of the global batch that
  // is at most kDefaultExactChunk.
  bool exact_sums = false;
  std::int64_t exact_chunk = 0;
  // --grad-compression: the gradient codec's name (kCodecs in src/train/codecs/codecs.cpp, which
  // refuses a name it lacks): none (floats), bf16, powersgd[:RANK] or auto[:RANK].
  std::string grad_compression = "none";
  std::int64_t compression_start_steps = -1;  // powersgd's first compressed step; -1: a tenth of the run's
  // checkpoints (docs/checkpoint.md)
  std::string checkpoint_dir;         // empty: no checkpoints
  std::int64_t checkpoint_every = 0;  // steps; 0: only at epoch ends and at the end of the run
  std::int64_t keep_checkpoints = 3;  // the newest N, plus the best by validation accuracy; 0: all
  std::string resume;                 // "", "auto" or a file
  bool checkpoint_async = true;       // rank 0 writes from a snapshot on a background thread
  // system
  std::string device = "cpu";            // auto | cpu | cuda (resolved per rank: include/mnist_mpi/backend/device.hpp)
  std::string precision = "fp32";        // fp32 | tf32 (CUDA's TF32 tensor cores) | bf16 (conv and fc multiply in bf16)
  std::string conv_algos = "heuristic";  // heuristic | measured (Note [Choosing cuDNN algorithms])
  bool cuda_graph = false;               // the training step as one CUDA graph (Note [A step as one CUDA graph])
  bool allow_gpu_sharing = false;        // more ranks on a node than GPUs
  int threads = 0;                       // 0: auto
  // fault tolerance
  double collective_timeout = 300.0;  // seconds one collective may take before the job is ended (0 = never)
  bool skip_nonfinite_steps = false;  // skip (and count) a step whose gradient is not finite, instead of stopping
  // reporting
  std::int64_t log_every = 100;
  std::int64_t eval_every = 0;
  std::int64_t eval_batch_size = 100;  // as fast as 250 and 50 on lenet; 47 MB less than 250 per rank
  std::int64_t check_replicas_every = 100;
  std::string metrics_file;
  bool quiet = false;
  std::string progress = "auto";  // auto | bar | lines
  std::string tensorboard_dir;    // empty: no TensorBoard events
  std::string timeline_file;      // empty: no timeline
  std::string report_file;        // empty: no HTML report

  std::string config_file;
  std::string resolved;  // "key = value" lines of every option, for logs and checkpoints
};

// The global batch of lenet's recipe (configs/lenet.ini), taken when neither --batch-size nor
// --global-batch-size is given: `mpirun -np 2 ./mnist_mpi` alone trains lenet as the README does.
inline constexpr std::int64_t kDefaultGlobalBatch = 100;

// The program's commands: the first word of the command line picks one (src/main.cpp dispatches
// each; `train` is also the default). --help lists them from here, and so does the message for a
// word that is none of them; tests/check_commands.sh checks that every command main.cpp
// dispatches is here, in --help and in docs/usage.md.
struct CommandInfo {
  const char* name;
  const char* summary;
};
inline constexpr CommandInfo kCommandList[] = {
    {"train", "(the default) train a model on MNIST, on as many ranks as mpirun or srun starts"},
    {"evaluate", "accuracy, loss and confusion matrix of a checkpoint"},
    {"export", "write a checkpoint's model as ONNX"},
    {"predict", "classify digit images (PNG or PGM) with a checkpoint's model"},
    {"report", "draw one or several runs' metrics files into one HTML page"},
};

enum class ParseOutcome { kRun, kExitOk };

// Parses argv. On --help / --version writes the text into `text` and returns kExitOk.
ParseOutcome parse_options(int argc, const char* const* argv, Options& out, std::string& text);

// "key = value" lines (the form of Options::resolved, of a checkpoint's CONF and of the job
// description the ranks compare) to key -> value; a line without " = " is its own key, value empty.
std::map<std::string, std::string> key_value_lines(const std::string& text);

// One line for a Boost.ProgramOptions error about argv, with the user's text quoted
// (Note [Messages built from what the user wrote]); never Boost's what() on text that would hang it.
std::string option_error_message(const boost::program_options::error& e, int argc, const char* const* argv);

// A one-process subcommand (`mnist_mpi evaluate`, `export`, `predict`): parses argv with `desc`
// (and `positional`, when given), prints `desc` for --help, else runs body(vm) and returns its
// exit code. A bad option is a usage error naming --help; an Error or any other exception ends
// the subcommand with one line "<prefix>: error: <what>" on stderr and the error's exit code
// (1 for other exceptions).
int run_subcommand(const std::string& name, const std::string& prefix,
                   const boost::program_options::options_description& desc,
                   const boost::program_options::positional_options_description* positional, int argc, char** argv,
                   const std::function<int(const boost::program_options::variables_map&)>& body);

}  // namespace mnist_mpi
