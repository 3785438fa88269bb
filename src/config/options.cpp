// Options: one table of every option with its default and unit, the command line parsed over the
// --config file, and the checks on values that the rest of the program relies on.
#include "mnist_mpi/config/options.hpp"

#include <boost/program_options.hpp>

#include <fstream>
#include <sstream>
#include <string_view>

#include "mnist_mpi/check.hpp"

namespace po = boost::program_options;

namespace mnist_mpi {
namespace {

// The placeholders Boost.ProgramOptions (1.74, errors.cpp) substitutes into its error messages.
const char* boost_placeholder_in(std::string_view text) {
  for (const char* p : {"%option%", "%value%", "%prefix%", "%original_token%", "%canonical_option%", "%invalid_line%"})
    if (text.find(p) != std::string_view::npos) return p;
  return nullptr;
}

}  // namespace

ParseOutcome parse_options(int argc, const char* const* argv, Options& o, std::string& text) {
  Options d;  // defaults
  po::options_description general("General");
  general.add_options()
      ("help,h", "print this help and exit")
      ("version", "print the version and exit")
      ("config", po::value<std::string>(&o.config_file), "INI file of options (key = value); the command line wins");
  po::options_description data("Data");
  data.add_options()
      ("data-dir", po::value(&o.data_dir)->default_value(d.data_dir), "directory with the four MNIST IDX files (raw or .gz)")
      ("validation-size", po::value(&o.validation_size)->default_value(d.validation_size), "images: the last N training images form the validation split")
      ("train-limit", po::value(&o.train_limit)->default_value(d.train_limit), "images: train on the first N training images only (0 = all)");
  po::options_description model("Model");
  model.add_options()
      ("model", po::value(&o.model)->default_value(d.model), "layer spec (see README.md, 'Writing a model spec')")
      ("weight-init", po::value(&o.weight_init)->default_value(d.weight_init), "truncated_normal:STD | normal:STD | xavier | he | zeros | constant:V")
      ("bias-init", po::value(&o.bias_init)->default_value(d.bias_init), "initialiser for biases, as --weight-init");
  po::options_description train("Training");
  train.add_options()
      ("batch-size", po::value(&o.batch_size)->default_value(d.batch_size), "images per rank per step (per micro-batch with --accumulation-steps; or give --global-batch-size)")
      ("global-batch-size", po::value(&o.global_batch_size)->default_value(d.global_batch_size), "images per step over all ranks; must divide by the number of ranks")
      ("epochs", po::value(&o.epochs)->default_value(d.epochs), "passes over the training split")
      ("max-steps", po::value(&o.max_steps)->default_value(d.max_steps), "global steps in the whole run (0 = epochs decide)")
      ("seed", po::value(&o.seed)->default_value(d.seed), "seed of initialisation, sampling and dropout")
      ("optimizer", po::value(&o.optimizer.kind)->default_value(d.optimizer.kind), "adam | sgd")
      ("lr", po::value(&o.schedule.base_lr)->default_value(d.schedule.base_lr), "base learning rate")
      ("momentum", po::value(&o.optimizer.momentum)->default_value(d.optimizer.momentum), "sgd momentum")
      ("nesterov", po::value(&o.optimizer.nesterov)->default_value(d.optimizer.nesterov), "sgd: Nesterov momentum (true|false)")
      ("beta1", po::value(&o.optimizer.beta1)->default_value(d.optimizer.beta1), "adam beta1")
      ("beta2", po::value(&o.optimizer.beta2)->default_value(d.optimizer.beta2), "adam beta2")
      ("eps", po::value(&o.optimizer.eps)->default_value(d.optimizer.eps), "adam epsilon")
      ("weight-decay", po::value(&o.optimizer.weight_decay)->default_value(d.optimizer.weight_decay), "L2 penalty added to the gradient")
      ("lr-schedule", po::value(&o.schedule.kind)->default_value(d.schedule.kind), "constant | step | cosine")
      ("lr-gamma", po::value(&o.schedule.gamma)->default_value(d.schedule.gamma), "step: factor applied every --lr-step-epochs epochs")
      ("lr-step-epochs", po::value(&o.schedule.step_epochs)->default_value(d.schedule.step_epochs), "step: epochs between decays")
      ("lr-min", po::value(&o.schedule.min_lr)->default_value(d.schedule.min_lr), "step: floor; cosine: final learning rate")
      ("warmup-steps", po::value(&o.schedule.warmup_steps)->default_value(d.schedule.warmup_steps), "steps of linear warm-up from 0");
  po::options_description red("Gradient reduction");
  red.add_options()
      ("bucket-mb", po::value(&o.bucket_mb)->default_value(d.bucket_mb), "MB (2^20 bytes): largest gradient bucket; a larger tensor is split")
      ("first-bucket-mb", po::value(&o.first_bucket_mb)->default_value(d.first_bucket_mb), "MB: cap of the first bucket (the last layers' gradients), which starts earliest")
      ("accumulation-steps", po::value(&o.accumulation_steps)->default_value(d.accumulation_steps), "micro-batches per step, summed locally and reduced once (like DDP's no_sync)")
      ("no-overlap", po::bool_switch(&o.no_overlap), "one blocking sum of all gradients after backward, no overlap (for comparison)");
  po::options_description ck("Checkpoints (docs/checkpoint.md)");
  ck.add_options()
      ("checkpoint-dir", po::value(&o.checkpoint_dir), "directory where rank 0 writes checkpoints (created if missing); none: no checkpoints")
      ("checkpoint-every", po::value(&o.checkpoint_every)->default_value(d.checkpoint_every), "steps between checkpoints (0 = only at the end of each epoch and of the run)")
      ("keep-checkpoints", po::value(&o.keep_checkpoints)->default_value(d.keep_checkpoints), "keep the newest N checkpoints plus the best by validation accuracy (0 = keep all)")
      ("resume", po::value(&o.resume), "auto: continue from the newest valid checkpoint in --checkpoint-dir (or start fresh and say so); or a checkpoint file")
      ("checkpoint-async", po::value(&o.checkpoint_async)->default_value(d.checkpoint_async), "true: rank 0 copies the state and writes it on a background thread while training goes on; false: writes before the next step");
  po::options_description sys("System");
  sys.add_options()
      ("device", po::value(&o.device)->default_value(d.device), "cpu | cuda | auto (auto: a GPU when one is visible, else the CPU); with cuda each rank takes GPU (node-local rank mod visible GPUs)")
      ("precision", po::value(&o.precision)->default_value(d.precision), "fp32 | tf32: float math of cuDNN and cuBLAS on the GPU (tf32: tensor cores, ~1e-3 relative error)")
      ("allow-gpu-sharing", po::bool_switch(&o.allow_gpu_sharing), "let more ranks than GPUs run on a node (they share GPUs round-robin)")
      ("threads", po::value(&o.threads)->default_value(d.threads), "threads per rank (0 = 1 when ranks share a node, else all cores)")
      ("collective-timeout", po::value(&o.collective_timeout)->default_value(d.collective_timeout), "seconds: a collective still unfinished after this ends the job, naming the step, bucket and collective (0 = wait forever)")
      ("skip-nonfinite-steps", po::bool_switch(&o.skip_nonfinite_steps), "skip (no update on any rank) and count a step whose loss or gradient is NaN or inf, instead of stopping with exit code 5");
  po::options_description rep("Reporting");
  rep.add_options()
      ("log-every", po::value(&o.log_every)->default_value(d.log_every), "steps between progress lines (0 = none)")
      ("eval-every", po::value(&o.eval_every)->default_value(d.eval_every), "steps between test evaluations (0 = only at the end)")
      ("eval-batch-size", po::value(&o.eval_batch_size)->default_value(d.eval_batch_size), "images per evaluation batch on rank 0")
      ("check-replicas-every", po::value(&o.check_replicas_every)->default_value(d.check_replicas_every), "steps between checks that all ranks hold identical parameters (0 = never)")
      ("metrics-file", po::value(&o.metrics_file), "write JSON lines of step / eval / final events (rank 0)")
      ("quiet", po::bool_switch(&o.quiet), "print only errors and the final summary")
      ("progress", po::value(&o.progress)->default_value(d.progress), "auto | bar | lines: rank 0's progress; auto = a live bar on a terminal, else a line every --log-every steps")
      ("tensorboard-dir", po::value(&o.tensorboard_dir), "write TensorBoard event files (scalars: loss, lr, images/s, accuracy, time split) into this directory (rank 0)")
      ("timeline", po::value(&o.timeline_file), "write a Chrome trace-event JSON of every rank's steps (data, forward, backward per layer, allreduce per bucket, optimizer, evaluation) to this file")
      ("report", po::value(&o.report_file), "write a self-contained HTML report (curves, where the time went) to this file at the end");
  po::options_description all("mnist_mpi " MNIST_MPI_VERSION " - data-parallel CNN training on MNIST.\n"
                              "Usage: mpirun -np N mnist_mpi [--config FILE] [options]\nOptions");
  all.add(general).add(data).add(model).add(train).add(red).add(ck).add(sys).add(rep);

  po::variables_map vm;
  std::string config_text;
  try {
    po::store(po::parse_command_line(argc, argv, all), vm);
    if (vm.count("help")) {
      std::ostringstream os;
      os << all;
      text = os.str();
      return ParseOutcome::kExitOk;
    }
    if (vm.count("version")) {
      text = "mnist_mpi " MNIST_MPI_VERSION "\n";
      return ParseOutcome::kExitOk;
    }
    if (vm.count("config")) {
      const std::string path = vm["config"].as<std::string>();
      std::ifstream f(path);
      if (!f) throw_error(ExitCode::kUsage, "--config: cannot open '" + path + "'");
      std::ostringstream whole;
      whole << f.rdbuf();
      config_text = whole.str();
      std::istringstream in(config_text);
      po::store(po::parse_config_file(in, all), vm);
    }
    po::notify(vm);
  } catch (const po::error& e) {
    // Boost builds what() by replacing %option%, %value%, ... in a template with the user's text, in
    // a loop that never ends when that text holds the same placeholder (found by fuzz_options:
    // "--b:%original_token%" hung the program). Such input gets our own message, without what().
    for (int i = 1; i <= argc; ++i) {
      const std::string_view where = i < argc ? std::string_view(argv[i]) : std::string_view(config_text);
      if (const char* p = boost_placeholder_in(where))
        throw_error(ExitCode::kUsage, std::string(i < argc ? "the command line" : "the --config file") +
                                          " holds '" + p + "', and an option in it is wrong; remove the '" + p +
                                          "' to see which (see --help)");
    }
    throw_error(ExitCode::kUsage, std::string(e.what()) + " (see --help)");
  }

  auto positive = [](std::int64_t v, const char* name, bool allow_zero) {
    if (v < 0 || (!allow_zero && v == 0))
      throw_error(ExitCode::kUsage, std::string("--") + name + " must be " + (allow_zero ? ">= 0" : "> 0") +
                                        ", got " + std::to_string(v));
  };
  positive(o.validation_size, "validation-size", true);
  positive(o.train_limit, "train-limit", true);
  positive(o.batch_size, "batch-size", true);
  positive(o.global_batch_size, "global-batch-size", true);
  positive(o.epochs, "epochs", false);
  positive(o.accumulation_steps, "accumulation-steps", false);
  positive(o.max_steps, "max-steps", true);
  positive(o.log_every, "log-every", true);
  positive(o.eval_every, "eval-every", true);
  positive(o.eval_batch_size, "eval-batch-size", false);
  positive(o.check_replicas_every, "check-replicas-every", true);
  positive(o.schedule.warmup_steps, "warmup-steps", true);
  if (!(o.bucket_mb > 0.0) || !(o.first_bucket_mb > 0.0))
    throw_error(ExitCode::kUsage, "--bucket-mb and --first-bucket-mb must be > 0");
  positive(o.checkpoint_every, "checkpoint-every", true);
  positive(o.keep_checkpoints, "keep-checkpoints", true);
  if (o.checkpoint_dir.empty() && o.resume == "auto")
    throw_error(ExitCode::kUsage, "--resume auto looks in --checkpoint-dir: give --checkpoint-dir DIR (or --resume FILE)");
  if (o.checkpoint_dir.empty() && o.checkpoint_every > 0)
    throw_error(ExitCode::kUsage, "--checkpoint-every needs --checkpoint-dir DIR to write into");
  if (o.progress != "auto" && o.progress != "bar" && o.progress != "lines")
    throw_error(ExitCode::kUsage, "--progress must be auto, bar or lines, got '" + o.progress + "'");
  if (o.threads < 0) throw_error(ExitCode::kUsage, "--threads must be >= 0");
  if (!(o.collective_timeout >= 0.0) || o.collective_timeout > 1e9)
    throw_error(ExitCode::kUsage, "--collective-timeout must be >= 0 seconds (0 = never), got " +
                                      std::to_string(o.collective_timeout));
  if ((o.batch_size == 0) == (o.global_batch_size == 0))
    throw_error(ExitCode::kUsage, "give exactly one of --batch-size (per rank) and --global-batch-size");
  if (!(o.schedule.base_lr > 0.0)) throw_error(ExitCode::kUsage, "--lr must be > 0");
  if (o.device != "cpu" && o.device != "auto" && o.device != "cuda")
    throw_error(ExitCode::kUsage, "--device must be cpu, cuda or auto, got '" + o.device + "'");
  if (o.precision != "fp32" && o.precision != "tf32")
    throw_error(ExitCode::kUsage, "--precision must be fp32 or tf32, got '" + o.precision + "'");

  std::ostringstream res;
  for (const auto& [name, value] : vm) {
    if (name == "help" || name == "version" || name == "config" || name == "metrics-file" ||
        name == "tensorboard-dir" || name == "timeline" || name == "report")
      continue;
    const boost::any& a = value.value();
    res << name << " = ";
    if (auto s = boost::any_cast<std::string>(&a)) res << *s;
    else if (auto i = boost::any_cast<std::int64_t>(&a)) res << *i;
    else if (auto u = boost::any_cast<std::uint64_t>(&a)) res << *u;
    else if (auto n = boost::any_cast<int>(&a)) res << *n;
    else if (auto f = boost::any_cast<double>(&a)) res << *f;
    else if (auto b = boost::any_cast<bool>(&a)) res << (*b ? "true" : "false");
    res << "\n";
  }
  o.resolved = res.str();
  return ParseOutcome::kRun;
}

}  // namespace mnist_mpi
