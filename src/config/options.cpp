// Options: one table of every option with its default and unit, the command line parsed over the
// --config file, and the checks on values that the rest of the program relies on.
#include "mnist_mpi/config/options.hpp"

#include <boost/program_options.hpp>
#include <unistd.h>


#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string_view>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/config/combinations.hpp"
#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/io/standard_streams.hpp"

namespace po = boost::program_options;

namespace mnist_mpi {
namespace {

// The options whose text is checked and turned into a value after parsing (check_choices).
struct ChoiceTexts {
  std::string sharding = "auto";  // --shard-optimizer
  std::string optimizer = name_of(OptimizerConfig{}.kind);
};

// Note [Messages built from what the user wrote]
// Boost.ProgramOptions puts the user's text verbatim into what(): a 10 MB value gave a 10 MB line, a
// binary --config file wrote raw control bytes to the terminal with no file name or line number,
// and a text holding one of its own %placeholders% made what() loop forever (found by
// fuzz_options: "--b:%original_token%" hung the program). So our messages are built from the kind
// of error, the option's name and the value we handed to Boost, each quoted with quote_input()
// (Note [Quoting what the user wrote] in include/mnist_mpi/check.hpp). To know the value, the
// command line is stored one option at a time, and the --config file is read here, line by line,
// each line stored on its own: an error then belongs to one option, one value and one line.
// Storing one option per po::store() loses Boost's check that an option is given once; it is
// done here instead (a --config key given twice is refused too; the command line still wins over
// the file, as store() skips an option that an earlier store() gave). what() is called only for
// an error kind we do not know, and only when no text it could hold has a placeholder.

// The placeholders Boost.ProgramOptions (1.74, errors.cpp) substitutes into its error messages.
const char* boost_placeholder_in(std::string_view text) {
  for (const char* p : {"%option%", "%value%", "%prefix%", "%original_token%", "%canonical_option%", "%invalid_line%"})
    if (text.find(p) != std::string_view::npos) return p;
  return nullptr;
}

// The message for a Boost error about option `name` (as the user would write it; empty when Boost
// could not tell which) given `value` (null when none): see Note [Messages built from what the
// user wrote]. `texts` are all the user's texts Boost may have seen, checked before what() is used.
std::string explain(const po::error& e, std::string name, const std::string* value,
                    const std::vector<std::string>& texts) {
  const auto* named = dynamic_cast<const po::error_with_option_name*>(&e);
  if (name.empty() && named != nullptr) name = named->get_option_name();  // never loops, unlike what()
  const std::string option = quote_input(name);
  const std::string given = value != nullptr ? " " + quote_input(*value) : std::string();
  if (dynamic_cast<const po::unknown_option*>(&e)) return "unrecognised option " + option;
  if (const auto* a = dynamic_cast<const po::ambiguous_option*>(&e)) {
    std::string alternatives;
    const std::string dashes = name.rfind("--", 0) == 0 ? "--" : "";
    for (const std::string& alt : a->alternatives())
      alternatives += (alternatives.empty() ? "" : ", ") + quote_input(dashes + alt);
    return "option " + option + " is ambiguous: it could be " + alternatives;
  }
  if (dynamic_cast<const po::multiple_occurrences*>(&e)) return "option " + option + " is given more than once";
  if (dynamic_cast<const po::too_many_positional_options_error*>(&e))
    return "an argument that is not an option was given (options start with --)";
  if (const auto* v = dynamic_cast<const po::validation_error*>(&e)) {
    if (v->kind() == po::validation_error::invalid_bool_value)
      return "option " + option + ": the value" + given + " is not true or false";
    if (v->kind() == po::validation_error::invalid_option_value)
      return "option " + option + ": the value" + given + " is not valid";
    if (v->kind() == po::validation_error::multiple_values_not_allowed) return "option " + option + " takes one value";
    if (v->kind() == po::validation_error::at_least_one_value_required) return "option " + option + " needs a value";
  }
  if (const auto* s = dynamic_cast<const po::invalid_syntax*>(&e)) {
    switch (s->kind()) {
      case po::invalid_syntax::missing_parameter:
        return "option " + option + " needs a value";
      case po::invalid_syntax::extra_parameter:
        return "option " + option + " takes no value" + (value != nullptr ? ", but was given" + given : std::string());
      case po::invalid_syntax::empty_adjacent_parameter:
        return "option " + option + " has an empty value";
      default:
        break;
    }
  }
  // An error kind not named above: Boost's own text, if what() can be called at all.
  for (const std::string& t : texts)
    if (const char* p = boost_placeholder_in(t))
      return "the options hold '" + std::string(p) + "', and one of them is wrong; remove the '" + p + "' to see which";
  const std::string quoted = quote_input(e.what(), 200);
  return quoted.substr(1, quoted.size() - 2);
}

}  // namespace

std::map<std::string, std::string> key_value_lines(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find(" = ");
    if (eq == std::string::npos)
      out[line] = "";
    else
      out[line.substr(0, eq)] = line.substr(eq + 3);
  }
  return out;
}

std::string option_error_message(const po::error& e, int argc, const char* const* argv) {
  std::vector<std::string> texts;
  for (int i = 1; i < argc; ++i) texts.emplace_back(argv[i]);
  return explain(e, std::string(), nullptr, texts);
}

namespace {

// po::store() of one option, with the same checks and defaults as a store() of them all.
void store_one(const po::options_description& all, const po::option& opt, po::variables_map& vm) {
  po::parsed_options one(&all);
  one.options.push_back(opt);
  po::store(one, vm);
}

// Note [Reading --config ourselves]
// The file is opened with open_regular_file() (Note [Look before you open]): a directory given to
// --config was silently read as empty by std::ifstream and the run went on with the defaults, and a
// FIFO would block. It is then split the way Boost's INI parser did (1.74, config_file.cpp): lines
// at '\n', '#' starts a comment anywhere, blanks and tabs trimmed, "[section]" makes the following
// keys "section.key", and every other line is "key = value". A line holding a control byte is
// refused with its number: such a file is not text, and echoing it would write raw bytes.
struct ConfigLine {
  int number = 0;
  std::string key, value;
};

constexpr std::size_t kMaxConfigBytes = std::size_t{64} << 20;  // a file of options is a few KB

std::string trim(std::string_view s) {
  const std::size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  return std::string(s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1));
}

std::vector<ConfigLine> read_config(const std::string& path) {
  const std::string what = "--config " + quote_input(path);
  const std::vector<std::uint8_t> bytes = read_regular_file(
      path, "--config", ExitCode::kUsage, "give a text file of key = value lines", kMaxConfigBytes, [&](std::uint64_t) {
        throw_error(ExitCode::kUsage, what + " is larger than " + std::to_string(kMaxConfigBytes >> 20) +
                                          " MiB; is it a text file of key = value lines?");
      });
  const std::string text(bytes.begin(), bytes.end());
  std::vector<ConfigLine> lines;
  std::string prefix;
  std::size_t begin = 0;
  for (int number = 1; begin < text.size(); ++number) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    const std::string where = what + " line " + std::to_string(number) + ": ";
    for (std::size_t i = 0; i < line.size(); ++i) {
      const auto c = static_cast<unsigned char>(line[i]);
      const bool crlf = c == '\r' && i + 1 == line.size();
      if ((c < 0x20 && c != '\t' && !crlf) || c == 0x7f)
        throw_error(ExitCode::kUsage, where + "holds the control byte " + quote_input(line.substr(i, 1)) +
                                          " at column " + std::to_string(i + 1) +
                                          "; is it a text file of key = value lines?");
    }
    const std::string s = trim(line.substr(0, line.find('#')));
    if (s.empty()) continue;
    if (s.front() == '[' && s.back() == ']') {
      prefix = s.substr(1, s.size() - 2);
      if (prefix.empty() || prefix.back() != '.') prefix += '.';
      continue;
    }
    const std::size_t eq = s.find('=');
    if (eq == std::string::npos)
      throw_error(ExitCode::kUsage, where + quote_input(s) + " is not a line of the form key = value");
    lines.push_back(
        {number, prefix + trim(std::string_view(s).substr(0, eq)), trim(std::string_view(s).substr(eq + 1))});
  }
  return lines;
}

// Note [One check for every floating-point option]
// A double option must be a finite number in its range, checked here at parse time: --lr inf or
// --beta1 nan were accepted and the run then stopped at step 2 with "non-finite gradient", naming
// no option. Every double of Options, OptimizerConfig and ScheduleConfig has a row; `range` says the
// allowed values in words, lo / hi bound them (open: the bound itself is excluded).
struct RealOption {
  const char* name;
  double value;
  double lo;
  bool lo_open;
  double hi;
  bool hi_open;
  const char* range;
};

std::string number_text(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

void check_real_options(const Options& o) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // 1e6 MB: far beyond any gradient, and MB * 2^20 / 4 elements fits int64 comfortably.
  const RealOption rows[] = {
      {"lr", o.schedule.base_lr, 0.0, true, kInf, true, "a finite number > 0"},
      {"momentum", o.optimizer.momentum, 0.0, false, 1.0, true, "in [0, 1)"},
      {"beta1", o.optimizer.beta1, 0.0, false, 1.0, true, "in [0, 1)"},
      {"beta2", o.optimizer.beta2, 0.0, false, 1.0, true, "in [0, 1)"},
      {"eps", o.optimizer.eps, 0.0, true, kInf, true, "a finite number > 0"},
      {"weight-decay", o.optimizer.weight_decay, 0.0, false, kInf, true, "a finite number >= 0"},
      {"lr-gamma", o.schedule.gamma, 0.0, true, kInf, true, "a finite number > 0"},
      {"lr-step-epochs", o.schedule.step_epochs, 0.0, true, kInf, true, "a finite number of epochs > 0"},
      {"lr-min", o.schedule.min_lr, 0.0, false, kInf, true, "a finite number >= 0"},
      {"bucket-mb", o.bucket_mb, 0.0, true, 1e6, false, "> 0 and <= 1e6 (MB)"},
      {"first-bucket-mb", o.first_bucket_mb, 0.0, true, 1e6, false, "> 0 and <= 1e6 (MB)"},
      {"collective-timeout", o.collective_timeout, 0.0, false, 1e9, false, ">= 0 and <= 1e9 seconds (0 = never)"},
      {"target-accuracy", o.target_accuracy, 0.0, false, 1.0, false, "a fraction in [0, 1] (0 = off)"},
  };
  for (const RealOption& r : rows) {
    const bool above_lo = r.lo_open ? r.value > r.lo : r.value >= r.lo;
    const bool below_hi = r.hi_open ? r.value < r.hi : r.value <= r.hi;
    if (!std::isfinite(r.value) || !above_lo || !below_hi)
      throw_error(ExitCode::kUsage,
                  std::string("--") + r.name + " must be " + r.range + ", got " + number_text(r.value));
  }
  if (o.target_accuracy > 0 && o.validation_size == 0)
    throw_error(ExitCode::kUsage,
                "--target-accuracy is checked on the validation split: give a --validation-size > 0 (default 5000)");
  if (o.schedule.kind != "constant" && o.schedule.min_lr > o.schedule.base_lr)
    throw_error(ExitCode::kUsage, "--lr-min " + number_text(o.schedule.min_lr) + " is above --lr " +
                                      number_text(o.schedule.base_lr) + ": the " + o.schedule.kind +
                                      " schedule goes down from --lr to --lr-min; give an --lr-min <= --lr");
}

}  // namespace

namespace {

// Long on purpose (Note [Why a function is long] in docs/style.md): the option table, one
// add_options() entry per option with its help text, which reads best as one list in the order
// --help prints it. Values are stored into `o` (and the texts of the choices checked later into `choice`).
void add_option_table(po::options_description& all, Options& o, ChoiceTexts& choice) {
  Options d;  // defaults
  po::options_description general("General");
  general.add_options()("help,h", "print this help and exit")("version", "print the version and exit")(
      "config", po::value<std::string>(&o.config_file), "INI file of options (key = value); the command line wins");
  po::options_description data("Data");
  data.add_options()("data-dir", po::value(&o.data_dir),
                     "directory with the four MNIST IDX files (raw or .gz); default: $MNIST_MPI_DATA_DIR, else "
                     "data/mnist under the current directory, else data/mnist of the source tree this program was "
                     "built from (docs/usage.md)")(
      "validation-size", po::value(&o.validation_size)->default_value(d.validation_size),
      "images: the last N training images form the validation split")(
      "train-limit", po::value(&o.train_limit)->default_value(d.train_limit),
      "images: train on the first N training images only (0 = all)");
  po::options_description model("Model");
  model.add_options()("model", po::value(&o.model)->default_value(d.model),
                      "layer spec (see docs/usage.md, 'Writing a model spec')")(
      "weight-init", po::value(&o.weight_init)->default_value(d.weight_init),
      "truncated_normal:STD | normal:STD | xavier | he | zeros | constant:V")(
      "bias-init", po::value(&o.bias_init)->default_value(d.bias_init), "initialiser for biases, as --weight-init");
  po::options_description train("Training");
  train.add_options()(
      "batch-size", po::value(&o.batch_size)->default_value(d.batch_size),
      "images per rank per step (per micro-batch with --accumulation-steps; or give --global-batch-size)")(
      "global-batch-size", po::value(&o.global_batch_size)->default_value(d.global_batch_size),
      "images per step over all ranks, split as evenly as it goes (100 on 8 ranks: 13 or 12 each); at least the number "
      "of ranks. 100 (lenet's recipe) when neither this nor --batch-size is given")(
      "epochs", po::value(&o.epochs)->default_value(d.epochs), "passes over the training split")(
      "max-steps", po::value(&o.max_steps)->default_value(d.max_steps),
      "global steps in the whole run (0 = epochs decide)")(
      "target-accuracy", po::value(&o.target_accuracy)->default_value(d.target_accuracy),
      "fraction: stop once the validation accuracy, checked every --eval-every steps and at each epoch's end, "
      "reaches it; the test split is then evaluated once (0 = off)")("seed", po::value(&o.seed)->default_value(d.seed),
                                                                     "seed of initialisation, sampling and dropout")(
      "optimizer", po::value(&choice.optimizer)->default_value(choice.optimizer),
      (optimizer_names() + " (lamb: Adam's direction scaled per weight tensor by ||w|| / ||direction||)").c_str())(
      "lr", po::value(&o.schedule.base_lr)->default_value(d.schedule.base_lr), "base learning rate")(
      "momentum", po::value(&o.optimizer.momentum)->default_value(d.optimizer.momentum), "sgd momentum")(
      "nesterov", po::value(&o.optimizer.nesterov)->default_value(d.optimizer.nesterov),
      "sgd: Nesterov momentum (true|false)")("beta1", po::value(&o.optimizer.beta1)->default_value(d.optimizer.beta1),
                                             "adam and lamb beta1")(
      "beta2", po::value(&o.optimizer.beta2)->default_value(d.optimizer.beta2), "adam and lamb beta2")(
      "eps", po::value(&o.optimizer.eps)->default_value(d.optimizer.eps), "adam and lamb epsilon")(
      "weight-decay", po::value(&o.optimizer.weight_decay)->default_value(d.optimizer.weight_decay),
      "adam, sgd: L2 penalty added to the gradient; lamb: decoupled, added to the update direction")(
      "lr-schedule", po::value(&o.schedule.kind)->default_value(d.schedule.kind), "constant | step | cosine")(
      "lr-gamma", po::value(&o.schedule.gamma)->default_value(d.schedule.gamma),
      "step: factor applied every --lr-step-epochs epochs")(
      "lr-step-epochs", po::value(&o.schedule.step_epochs)->default_value(d.schedule.step_epochs),
      "step: epochs between decays")("lr-min", po::value(&o.schedule.min_lr)->default_value(d.schedule.min_lr),
                                     "step: floor; cosine: final learning rate")(
      "warmup-steps", po::value(&o.schedule.warmup_steps)->default_value(d.schedule.warmup_steps),
      "steps of linear warm-up from 0");
  po::options_description red("Gradient reduction");
  red.add_options()("bucket-mb", po::value(&o.bucket_mb)->default_value(d.bucket_mb),
                    "MB (2^20 bytes): largest gradient bucket; a larger tensor is split")(
      "first-bucket-mb", po::value(&o.first_bucket_mb)->default_value(d.first_bucket_mb),
      "MB: cap of the first bucket (the last layers' gradients), which starts earliest")(
      "accumulation-steps", po::value(&o.accumulation_steps)->default_value(d.accumulation_steps),
      "micro-batches per step, summed locally and reduced once (like DDP's no_sync)")(
      "exact-sums", po::bool_switch(&o.exact_sums),
      "the same bits on any number of ranks: the global batch is computed in chunks of --exact-chunk images, "
      "whose gradients are summed exactly as 64-bit integers (one thread per rank; docs/reduction.md)")(
      "exact-chunk", po::value(&o.exact_chunk)->default_value(d.exact_chunk),
      "--exact-sums: images per chunk; it divides the global batch, and the number of chunks is the most ranks "
      "(0 = the largest divisor of the global batch up to 10)")(
      "grad-compression", po::value(&o.grad_compression)->default_value(d.grad_compression),
      "none | bf16 | powersgd[:RANK] | auto[:RANK]: what goes on the wire for each gradient bucket "
      "(include/mnist_mpi/train/codec.hpp). bf16: half the bytes, summed in bf16, each rank's rounding residual "
      "added to its next step's gradient (error feedback). powersgd:RANK (default 2): each conv and fc weight "
      "matrix as two rank-RANK factors, with error feedback and a warm start. auto: per bucket none, bf16 or "
      "powersgd:RANK, chosen from the measured link and backward's timing (docs/reduction.md)")(
      "compression-start-steps", po::value(&o.compression_start_steps)->default_value(d.compression_start_steps),
      "powersgd, auto: the global step from which it compresses (auto: chooses, after at least 4 timed steps); "
      "the floats before it (-1 = a tenth of the run's steps)")(
      "no-overlap", po::bool_switch(&o.no_overlap),
      "one blocking sum of all gradients after backward (sharded: one blocking reduce-scatter per bucket), "
      "no overlap (for comparison)")(
      "shard-optimizer",
      po::value(&choice.sharding)->default_value(choice.sharding)->implicit_value("on"),
      "on: each rank keeps and updates only its 1/N shard of the optimizer state (like ZeRO stage 1): gradients "
      "reduce-scattered, updated parameters all-gathered; the same bits as without it (docs/reduction.md). "
      "auto: on for the CPU with 2 or more ranks, off on a GPU; off: every rank updates everything");
  po::options_description ck("Checkpoints (docs/checkpoint.md)");
  ck.add_options()("checkpoint-dir", po::value(&o.checkpoint_dir),
                   "directory where rank 0 writes checkpoints (created if missing); none: no checkpoints")(
      "checkpoint-every", po::value(&o.checkpoint_every)->default_value(d.checkpoint_every),
      "steps between checkpoints (0 = only at the end of each epoch and of the run)")(
      "keep-checkpoints", po::value(&o.keep_checkpoints)->default_value(d.keep_checkpoints),
      "keep the newest N checkpoints plus the best by validation accuracy (0 = keep all)")(
      "resume", po::value(&o.resume),
      "auto: continue from the newest valid checkpoint in --checkpoint-dir (or start fresh and say so); or a "
      "checkpoint file")("checkpoint-async", po::value(&o.checkpoint_async)->default_value(d.checkpoint_async),
                         "true: rank 0 copies the state and writes it on a background thread while training goes on; "
                         "false: writes before the next step");
  po::options_description sys("System");
  sys.add_options()("device", po::value(&o.device)->default_value(d.device),
                    "cpu | cuda | auto (auto: a GPU when one is visible, else the CPU); with cuda each rank takes GPU "
                    "(node-local rank mod visible GPUs)")(
      "precision", po::value(&o.precision)->default_value(d.precision),
      "fp32 | tf32 | bf16: tf32: cuDNN's and cuBLAS's tensor cores on the GPU (~1e-3 relative error); bf16: "
      "the convolutions and fc layers multiply in bf16 (CPU: AVX512-BF16 or AMX, the first convolution on loops "
      "of our own where its shape allows; GPU: tensor cores, the first convolution stays fp32), master weights, "
      "optimiser state, sums and checkpoints stay fp32")(
      "conv-algos", po::value(&o.conv_algos)->default_value(d.conv_algos),
      "heuristic | measured: how each cuDNN convolution algorithm is chosen (GPU). heuristic: cuDNN's heuristics, "
      "the same bits on every run and resume; measured: rank 0 times them at start and every rank takes the "
      "fastest deterministic one (faster, but a later run or resume may round differently)")(
      "cuda-graph", po::bool_switch(&o.cuda_graph),
      "capture the training step once as a CUDA graph and replay it (GPU only; the ungraphed step's bits, shown on "
      "one GPU; off by default until shown with NCCL across GPUs)")(
      "allow-gpu-sharing", po::bool_switch(&o.allow_gpu_sharing),
      "let more ranks than GPUs run on a node (they share GPUs round-robin)")(
      "threads", po::value(&o.threads)->default_value(d.threads),
      "threads per rank (0 = 1 when ranks share a node, else all cores)")(
      "collective-timeout", po::value(&o.collective_timeout)->default_value(d.collective_timeout),
      "seconds: a collective still unfinished after this ends the job, naming the step, bucket and collective (0 = "
      "wait forever)")("skip-nonfinite-steps", po::bool_switch(&o.skip_nonfinite_steps),
                       "skip (no update on any rank) and count a step whose loss or gradient is NaN or inf, instead of "
                       "stopping with exit code 5");
  po::options_description rep("Reporting");
  rep.add_options()("log-every", po::value(&o.log_every)->default_value(d.log_every),
                    "steps between progress lines (0 = none)")(
      "eval-every", po::value(&o.eval_every)->default_value(d.eval_every),
      "steps between test evaluations (of the validation split with --target-accuracy; 0 = only at the end)")(
      "eval-batch-size", po::value(&o.eval_batch_size)->default_value(d.eval_batch_size),
      "images per evaluation batch (every rank evaluates its share of the split)")(
      "check-replicas-every", po::value(&o.check_replicas_every)->default_value(d.check_replicas_every),
      "steps between checks that all ranks hold identical parameters (0 = never)")(
      "metrics-file", po::value(&o.metrics_file), "write JSON lines of step / eval / final events (rank 0)")(
      "quiet", po::bool_switch(&o.quiet), "print only errors and the final summary")(
      "progress", po::value(&o.progress)->default_value(d.progress),
      "auto | bar | lines: rank 0's progress; auto = a live bar on a terminal, else a line every --log-every steps")(
      "tensorboard-dir", po::value(&o.tensorboard_dir),
      "write TensorBoard event files (scalars: loss, lr, images/s, accuracy, time split) into this directory (rank 0)")(
      "timeline", po::value(&o.timeline_file),
      "write a Chrome trace-event JSON of every rank's steps (data, forward, backward per layer, allreduce per bucket, "
      "optimizer, evaluation) to this file")(
      "report", po::value(&o.report_file),
      "write a self-contained HTML report (curves, where the time went) to this file at the end");
  all.add(general).add(data).add(model).add(train).add(red).add(ck).add(sys).add(rep);
}

// The usage error for `mnist_mpi WORD` where WORD is neither a command nor an option.
std::string not_a_command(const std::string& word) {
  std::string names;
  for (const CommandInfo& c : kCommandList)
    names += (names.empty() ? "" : ", ") + std::string(c.name) + (names.empty() ? " (the default)" : "");
  return quote_input(word) + " is not a command or an option of mnist_mpi (options start with --); the commands: " +
         names + " (see mnist_mpi --help)";
}

// --help's usage lines and list of the commands, one line each, from kCommandList.
std::string commands_help() {
  std::string one_process;  // every command but train
  for (const CommandInfo& c : kCommandList)
    if (&c != &kCommandList[0]) one_process += (one_process.empty() ? "" : "|") + std::string(c.name);
  std::string text = "Usage: mpirun -np N mnist_mpi [train] [--config FILE] [options]\n       mnist_mpi " + one_process +
                     " [options] (one process; COMMAND --help)\nCommands:\n";
  for (const CommandInfo& c : kCommandList) {
    const std::string name = c.name;
    text += "  " + name + std::string(name.size() < 10 ? 10 - name.size() : 1, ' ') + c.summary + "\n";
  }
  return text;
}

// The command-line pass (Note [Messages built from what the user wrote]): the first word, where a
// command goes, must be an option (main() has taken the commands); then one option per store().
void store_command_line(int argc, const char* const* argv, const po::options_description& all,
                        po::variables_map& vm) {
  // A word that is not an option (`mnist_mpi evalute`) is caught as this hidden positional option,
  // so that the message can name it and list the commands.
  po::options_description parsing;
  parsing.add(all).add_options()("command-word", po::value<std::vector<std::string>>());
  po::positional_options_description command_words;
  command_words.add("command-word", -1);

  // The first word is where a command goes (main() has taken the commands): a word there is a
  // misspelt command, said before Boost reads the options that were meant for it.
  if (argc >= 2 && argv[1][0] != '-') throw_error(ExitCode::kUsage, not_a_command(argv[1]));
  std::vector<std::string> args;  // what the user wrote, for explain()
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  po::parsed_options command_line(&all);
  try {
    command_line = po::command_line_parser(argc, argv).options(parsing).positional(command_words).run();
  } catch (const po::error& e) {
    throw_error(ExitCode::kUsage, explain(e, "", nullptr, args) + " (see --help)");
  }
  // Note [Messages built from what the user wrote]: one option per store(), so that an error
  // belongs to a known option and value.
  std::set<std::string> given;
  for (const po::option& opt : command_line.options) {
    if (opt.string_key.empty()) continue;
    if (opt.string_key == "command-word") throw_error(ExitCode::kUsage, not_a_command(opt.value.front()));
    const std::string name = "--" + opt.string_key;
    if (!given.insert(opt.string_key).second)
      throw_error(ExitCode::kUsage, "option " + quote_input(name) + " is given more than once (see --help)");
    const std::string* value = opt.value.empty() ? nullptr : &opt.value.front();
    try {
      store_one(all, opt, vm);
    } catch (const po::error& e) {
      throw_error(ExitCode::kUsage, explain(e, name, value, args) + " (see --help)");
    }
  }
}

// The --config pass (Note [Reading --config ourselves]): each line stored on its own; an option
// the command line gave is skipped (the command line wins).
void store_config_file(const std::string& path, const po::options_description& all, po::variables_map& vm) {
  std::map<std::string, int> first_line;  // key -> the line that set it
  for (const ConfigLine& line : read_config(path)) {
    const std::string where = "--config " + quote_input(path) + " line " + std::to_string(line.number) + ": ";
    if (line.key.empty()) throw_error(ExitCode::kUsage, where + "no option name before the '='");
    const po::option_description* known = nullptr;
    try {
      known = all.find_nothrow(line.key, false);
    } catch (const po::error&) {  // "nothrow" still throws ambiguous_option for some names
    }
    if (known == nullptr || known->long_name() != line.key)
      throw_error(ExitCode::kUsage, where + "unknown option " + quote_input(line.key) + " (see --help)");
    if (const auto [it, fresh] = first_line.emplace(line.key, line.number); !fresh)
      throw_error(ExitCode::kUsage, where + quote_input(line.key) + " is set again (first on line " +
                                        std::to_string(it->second) + "); keep one of the two lines");
    po::option opt(line.key, {line.value});
    opt.original_tokens = {line.key, line.value};
    try {
      store_one(all, opt, vm);  // skipped when the command line gave the option: it wins
    } catch (const po::error& e) {
      throw_error(ExitCode::kUsage, where + explain(e, line.key, &line.value, {line.key, line.value}));
    }
  }
}

// The checks on values that the rest of the program relies on, and what follows from them: the
// default global batch, the resolved --shard-optimizer. (The real-valued options: Note [One check
// for every floating-point option].)
void check_counts(const Options& o, const po::variables_map& vm) {
  auto positive = [](std::int64_t v, const char* name, bool allow_zero) {
    if (v < 0 || (!allow_zero && v == 0))
      throw_error(ExitCode::kUsage, std::string("--") + name + " must be " + (allow_zero ? ">= 0" : "> 0") + ", got " +
                                        std::to_string(v));
  };
  positive(o.validation_size, "validation-size", true);
  positive(o.train_limit, "train-limit", true);
  // 0 is these two options' "not given" (the default global batch follows from neither being given),
  // so a 0 that was given, on the command line or in a config file, is refused by name here rather
  // than taken for "not given".
  for (const auto& [v, name] : {std::pair{o.batch_size, "batch-size"}, std::pair{o.global_batch_size, "global-batch-size"}}) {
    positive(v, name, true);
    if (v == 0 && vm.count(name) != 0 && !vm[name].defaulted())
      throw_error(ExitCode::kUsage, std::string("--") + name + " must be > 0, got 0 (leave it out for the default global batch of " +
                                        std::to_string(kDefaultGlobalBatch) + ")");
  }
  if (o.compression_start_steps < 0 && (o.compression_start_steps != -1 || (vm.count("compression-start-steps") != 0 &&
                                                                          !vm["compression-start-steps"].defaulted())))
    throw_error(ExitCode::kUsage, "--compression-start-steps must be >= 0, got " +
                                      std::to_string(o.compression_start_steps) +
                                      " (leave it out for a tenth of the run's steps)");
  positive(o.epochs, "epochs", false);
  positive(o.accumulation_steps, "accumulation-steps", false);
  positive(o.exact_chunk, "exact-chunk", true);
  positive(o.max_steps, "max-steps", true);
  positive(o.log_every, "log-every", true);
  positive(o.eval_every, "eval-every", true);
  positive(o.eval_batch_size, "eval-batch-size", false);
  positive(o.check_replicas_every, "check-replicas-every", true);
  positive(o.schedule.warmup_steps, "warmup-steps", true);
  positive(o.checkpoint_every, "checkpoint-every", true);
  positive(o.keep_checkpoints, "keep-checkpoints", true);
}

void check_choices(Options& o, const ChoiceTexts& choice) {
  const std::string& sharding = choice.sharding;
  if (o.progress != "auto" && o.progress != "bar" && o.progress != "lines")
    throw_error(ExitCode::kUsage, "--progress must be auto, bar or lines, got " + quote_input(o.progress));
  if (o.threads < 0) throw_error(ExitCode::kUsage, "--threads must be >= 0");
  if (o.batch_size == 0 && o.global_batch_size == 0) o.global_batch_size = kDefaultGlobalBatch;
  check_real_options(o);  // Note [One check for every floating-point option]
  if (o.device != "cpu" && o.device != "auto" && o.device != "cuda")
    throw_error(ExitCode::kUsage, "--device must be cpu, cuda or auto, got " + quote_input(o.device));
  const auto one_of = [&](std::initializer_list<const char*> words) {
    return std::any_of(words.begin(), words.end(), [&](const char* w) { return sharding == w; });
  };
  if (one_of({"auto"}))
    o.shard_optimizer = Options::Sharding::kAuto;
  else if (one_of({"on", "true", "yes", "1"}))  // and what the switch it was took in a config file
    o.shard_optimizer = Options::Sharding::kOn;
  else if (one_of({"off", "false", "no", "0"}))
    o.shard_optimizer = Options::Sharding::kOff;
  else
    throw_error(ExitCode::kUsage, "--shard-optimizer must be auto, on or off, got " + quote_input(sharding));
  if (const auto kind = optimizer_kind_named(choice.optimizer))
    o.optimizer.kind = *kind;
  else
    throw_error(ExitCode::kUsage, "--optimizer must be " + optimizer_names(" or ") + ", got " + quote_input(choice.optimizer));
  if (o.precision != "fp32" && o.precision != "tf32" && o.precision != "bf16")
    throw_error(ExitCode::kUsage, "--precision must be fp32, tf32 or bf16, got " + quote_input(o.precision));
  if (o.conv_algos != "heuristic" && o.conv_algos != "measured")
    throw_error(ExitCode::kUsage, "--conv-algos must be heuristic or measured, got " + quote_input(o.conv_algos));
  check_combinations(o);  // the pairs of options: include/mnist_mpi/config/combinations.hpp
}

// Options::resolved: "key = value" for every option but the output paths and --help, --version,
// --config (what says where a run writes, not what it is).
std::string resolved_text(const po::variables_map& vm, const Options& o) {
  std::ostringstream res;
  for (const auto& [name, value] : vm) {
    if (name == "help" || name == "version" || name == "config" || name == "metrics-file" ||
        name == "tensorboard-dir" || name == "timeline" || name == "report")
      continue;
    const boost::any& a = value.value();
    res << name << " = ";
    if (name == "global-batch-size")  // its default depends on --batch-size
      res << o.global_batch_size;
    else if (auto s = boost::any_cast<std::string>(&a))
      res << *s;
    else if (auto i = boost::any_cast<std::int64_t>(&a))
      res << *i;
    else if (auto u = boost::any_cast<std::uint64_t>(&a))
      res << *u;
    else if (auto n = boost::any_cast<int>(&a))
      res << *n;
    else if (auto f = boost::any_cast<double>(&a))
      res << *f;
    else if (auto b = boost::any_cast<bool>(&a))
      res << (*b ? "true" : "false");
    res << "\n";
  }
  return res.str();
}

}  // namespace

// Options: the table, the command line, the --config file (the command line wins), the checks.
ParseOutcome parse_options(int argc, const char* const* argv, Options& o, std::string& text) {
  ChoiceTexts choice;  // --shard-optimizer and --optimizer as given; into o once checked
  po::options_description all("mnist_mpi " MNIST_MPI_VERSION
                              " - data-parallel CNN training on MNIST.\n" +
                              commands_help() + "Options");
  add_option_table(all, o, choice);
  po::variables_map vm;
  store_command_line(argc, argv, all, vm);
  if (vm.count("help")) {
    std::ostringstream os;
    os << all
       << "\nExit code (every rank): 0 trained; 1 an error while training; 2 bad option; 3 data missing, corrupt or\n"
          "differing; 4 bad checkpoint; 5 non-finite loss or gradient; 6 no usable GPU; 7 trained, but an output\n"
          "could not be written; 75 stopped by a signal after a checkpoint (rerun with --resume auto). docs/faults.md\n";
    text = os.str();
    return ParseOutcome::kExitOk;
  }
  if (vm.count("version")) {
    text = "mnist_mpi " MNIST_MPI_VERSION "\n";
    return ParseOutcome::kExitOk;
  }
  if (vm.count("config")) store_config_file(vm["config"].as<std::string>(), all, vm);
  try {
    po::notify(vm);
  } catch (const po::error& e) {
    throw_error(ExitCode::kUsage, option_error_message(e, argc, argv) + " (see --help)");
  }
  check_counts(o, vm);
  check_choices(o, choice);
  o.resolved = resolved_text(vm, o);
  return ParseOutcome::kRun;
}

int run_subcommand(const std::string& name, const std::string& prefix, const po::options_description& desc,
                   const po::positional_options_description* positional, int argc, char** argv,
                   const std::function<int(const po::variables_map&)>& body) {
  const auto fail = [&](const char* what, int code) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s: error: %s\n", prefix.c_str(), what);
    return code;
  };
  // Their output is checked once at the end (below); a buffer that holds all of it in the usual
  // case keeps the errno of a failed write (a full disk) for that message.
  if (!::isatty(1)) std::setvbuf(stdout, nullptr, _IOFBF, std::size_t{1} << 20);
  try {
    po::variables_map vm;
    try {
      po::command_line_parser parser(argc, argv);
      parser.options(desc);
      if (positional) parser.positional(*positional);
      po::store(parser.run(), vm);
      po::notify(vm);
    } catch (const po::error& e) {
      throw_error(ExitCode::kUsage, option_error_message(e, argc, argv) + " (see mnist_mpi " + name + " --help)");
    }
    int rc = 0;
    if (vm.count("help"))
      std::cout << desc;
    else
      rc = body(vm);  // std::cout shares stdout's buffer (synced with stdio): flushed below
    // Their results are their standard output: a failed write is a lost result (exit 7), said once.
    if (const std::string lost = standard_output_error(); !lost.empty()) {
      std::fprintf(stderr, "%s: error: cannot write %s; what it printed is lost, so the command failed\n",
                   prefix.c_str(), lost.c_str());
      return rc != 0 ? rc : static_cast<int>(ExitCode::kOutput);
    }
    return rc;
  } catch (const Error& e) {
    return fail(e.what(), static_cast<int>(e.code()));
  } catch (const std::exception& e) {
    return fail(e.what(), static_cast<int>(ExitCode::kRuntime));
  }
}

}  // namespace mnist_mpi
