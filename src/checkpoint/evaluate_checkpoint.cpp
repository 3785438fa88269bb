// The `evaluate` subcommand (include/mnist_mpi/checkpoint/evaluate_checkpoint.hpp): the checkpoint's
// model on the CPU backend, evaluated batch by batch like rank 0's evaluation in the trainer.
#include "mnist_mpi/checkpoint/evaluate_checkpoint.hpp"

#include "mnist_mpi/config/options.hpp"

#include <boost/program_options.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <thread>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/io/file_roles.hpp"
#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/model/spec.hpp"

namespace po = boost::program_options;

namespace mnist_mpi {
namespace {

std::string config_value(const std::string& config, const std::string& key, const std::string& fallback) {
  const auto lines = key_value_lines(config);
  const auto it = lines.find(key);
  return it == lines.end() ? fallback : it->second;
}

// The logits as a NumPy .npy file (format 1.0): float32 little-endian, shape (count, classes), so
// that a test compares them with another evaluator's (tests/check_onnx.py) without our code.
void write_npy(const std::string& path, const std::vector<float>& v, std::int64_t rows, int cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string bytes = "\x93NUMPY\x01";
  bytes += '\0';
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  std::FILE* f = std::fopen(path.c_str(), "wb");
  const bool ok = f && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const int e = errno;
  if (f && std::fclose(f) != 0 && ok)
    throw_error(ExitCode::kOutput, "cannot write --logits-file " + quote_input(path) + ": " + std::strerror(errno));
  if (!ok) throw_error(ExitCode::kOutput, "cannot write --logits-file " + quote_input(path) + ": " + std::strerror(e));
}

}  // namespace

Checkpoint pick_checkpoint(const std::string& path, std::string& chosen) {
  namespace fs = std::filesystem;
  std::error_code ec;
  chosen = path;
  if (!fs::is_directory(path, ec)) return load_checkpoint(path);
  for (const auto& [step, name] : list_checkpoints(path)) {
    chosen = path + "/" + name;
    try {
      return load_checkpoint(chosen);
    } catch (const Error& e) {
      std::fprintf(stderr, "mnist_mpi: warning: %s -- skipped\n", e.what());
    }
  }
  throw_error(ExitCode::kCheckpoint, "no valid checkpoint in directory '" + path +
                                         "'; give a checkpoint file or the --checkpoint-dir of a run");
}

void declare_checkpoint_input(const std::string& path, FileRoles& roles) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return roles.input("--checkpoint", path);
  for (const auto& [step, name] : list_checkpoints(path)) roles.input("--checkpoint (its " + name + ")", path + "/" + name);
}

std::unique_ptr<ParameterStore> checkpoint_parameters(const Checkpoint& ck, const ModelSpec& spec, Backend& backend) {
  auto store = std::make_unique<ParameterStore>(backend, spec.param_count, spec.state_count);
  std::copy(ck.params.begin(), ck.params.end(), store->host());  // the sizes: checkpoint_model_spec
  store->to_backend();
  std::copy(ck.model_state.begin(), ck.model_state.end(), store->state_host());
  store->state_to_backend();
  return store;
}

CheckpointEvaluation evaluate_checkpoint(const Checkpoint& ck, const Split& split, int batch, int threads,
                                         bool keep_logits) {
  const ModelSpec spec = checkpoint_model_spec(ck);
  MNIST_CHECK(split.rows == ck.input.h && split.cols == ck.input.w && ck.input.c == 1, ExitCode::kData,
              "the data's images are " + std::to_string(split.rows) + "x" + std::to_string(split.cols) +
                  ", the checkpoint's model takes " + std::to_string(ck.input.h) + "x" + std::to_string(ck.input.w));
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto backend = make_cpu_backend(threads);
  const std::unique_ptr<ParameterStore> params = checkpoint_parameters(ck, spec, *backend);
  const int eb = static_cast<int>(std::clamp<std::int64_t>(split.count, 1, batch));
  Model model(spec, eb, *backend, *params, nullptr);
  const int classes = spec.num_classes();
  CheckpointEvaluation r;
  r.classes = classes;
  r.count = split.count;
  r.confusion.assign(static_cast<std::size_t>(classes) * static_cast<std::size_t>(classes), 0);
  if (keep_logits) r.logits.reserve(static_cast<std::size_t>(split.count * classes));
  std::vector<std::int32_t> labels(static_cast<std::size_t>(eb));
  const std::int64_t pixels = static_cast<std::int64_t>(split.rows) * split.cols;
  StepContext ctx;
  ctx.training = false;
  double loss = 0.0;
  std::int64_t correct = 0;
  for (std::int64_t first = 0; first < split.count; first += eb) {
    const std::int64_t n = std::min<std::int64_t>(eb, split.count - first);
    float* x = model.input();  // (eb, 1, 28, 28)
    const std::uint8_t* src = split.image(first);
    for (std::int64_t k = 0; k < n * pixels; ++k) x[k] = static_cast<float>(src[k]) * (1.0f / 255.0f);
    for (std::int64_t i = 0; i < n; ++i)
      labels[static_cast<std::size_t>(i)] = split.labels[static_cast<std::size_t>(first + i)];
    model.forward(ctx);
    const LossStats s =
        backend->softmax_cross_entropy(model.logits(), labels.data(), static_cast<int>(n), classes, nullptr, 0.0f);
    loss += s.loss_sum;
    correct += s.correct;
    const float* logits = model.logits();  // (eb, classes), host memory on the CPU backend
    if (keep_logits) r.logits.insert(r.logits.end(), logits, logits + n * classes);
    for (std::int64_t i = 0; i < n; ++i) {
      const float* row = logits + i * classes;
      const auto pred = static_cast<std::int64_t>(std::max_element(row, row + classes) - row);
      r.confusion[static_cast<std::size_t>(labels[static_cast<std::size_t>(i)] * classes + pred)] += 1;
    }
  }
  if (split.count > 0) {
    r.loss = loss / static_cast<double>(split.count);
    r.accuracy = static_cast<double>(correct) / static_cast<double>(split.count);
  }
  return r;
}

int evaluate_checkpoint_main(int argc, char** argv) {
  std::string checkpoint, data_dir, split_name = "test", logits_file;
  std::int64_t batch = 250;
  int threads = 0;
  po::options_description desc(
      "mnist_mpi " MNIST_MPI_VERSION
      " evaluate - accuracy, loss and confusion matrix of a checkpoint.\n"
      "Usage: mnist_mpi evaluate --checkpoint FILE|DIR [options] (one process, no mpirun)\n"
      "Exit code: 0 evaluated; 2 bad option; 3 data missing or corrupt; 4 bad checkpoint; 7 standard output or\n"
      "--logits-file could not be written\nOptions");
  desc.add_options()("help,h", "print this help and exit")(
      "checkpoint", po::value(&checkpoint), "checkpoint file, or a --checkpoint-dir (its newest valid checkpoint)")(
      "data-dir", po::value(&data_dir),
      "directory with the four MNIST IDX files; default: found as the trainer finds it (docs/usage.md)")(
      "split", po::value(&split_name)->default_value(split_name),
      "test | validation (the validation split of the checkpoint's run)")(
      "eval-batch-size", po::value(&batch)->default_value(batch), "images per evaluation batch")(
      "threads", po::value(&threads)->default_value(threads), "threads (0 = all cores)")(
      "logits-file", po::value(&logits_file),
      "also write every image's logits to this NumPy .npy file: float32, (images, classes), in split order")(
      "show-config", "print the checkpoint's state and the options of the run that wrote it, then exit");
  return run_subcommand(
      "evaluate", "mnist_mpi", desc, nullptr, argc, argv, [&](const po::variables_map& vm) -> int {
        if (checkpoint.empty()) throw_error(ExitCode::kUsage, "give --checkpoint FILE (see mnist_mpi evaluate --help)");
        if (split_name != "test" && split_name != "validation")
          throw_error(ExitCode::kUsage, "--split must be test or validation, got '" + split_name + "'");
        if (batch <= 0 || threads < 0)
          throw_error(ExitCode::kUsage, "--eval-batch-size must be > 0 and --threads >= 0");
        const bool show_config = vm.count("show-config") > 0;  // reads the checkpoint alone
        if (!show_config) {
          data_dir = find_mnist_dir(data_dir);  // Note [Where the data is found]
          FileRoles roles;                      // Note [No output is an input]
          declare_checkpoint_input(checkpoint, roles);
          declare_mnist_inputs(data_dir, roles);
          if (!logits_file.empty()) roles.output("--logits-file", logits_file);
          roles.check();
        }
        std::string path;
        const Checkpoint ck = pick_checkpoint(checkpoint, path);
        const CheckpointMeta& m = ck.meta;
        std::printf("checkpoint %s: step %lld of %lld (epoch %lld), model %s, %lld parameters\n", path.c_str(),
                    static_cast<long long>(m.step), static_cast<long long>(m.total_steps),
                    static_cast<long long>(m.epoch), ck.spec.c_str(), static_cast<long long>(m.param_count));
        if (show_config) {
          std::printf(
              "global batch %lld, seed %llu, %lld ranks, optimizer %s (%lld steps), next lr %.6g, "
              "validation accuracy %.4f\noptions of the run that wrote it:\n%s",
              static_cast<long long>(m.global_batch), static_cast<unsigned long long>(m.seed),
              static_cast<long long>(m.world_size), name_of(checkpoint_optimizer(m)),
              static_cast<long long>(m.optimizer_steps), m.next_lr, m.validation_accuracy, ck.config.c_str());
          return 0;
        }
        if (!logits_file.empty())
          check_output_path(logits_file, "--logits-file", ExitCode::kOutput);  // before the work
        const std::int64_t val = std::stoll(config_value(ck.config, "validation-size", "5000"));
        const std::int64_t limit = std::stoll(config_value(ck.config, "train-limit", "0"));
        const Mnist data = load_mnist(data_dir, split_name == "test" ? 0 : val, split_name == "test" ? 0 : limit);
        const Split& split = split_name == "test" ? data.test : data.validation;
        const CheckpointEvaluation r =
            evaluate_checkpoint(ck, split, static_cast<int>(batch), threads, !logits_file.empty());
        if (!logits_file.empty()) write_npy(logits_file, r.logits, r.count, r.classes);
        std::printf("%s: %lld images, accuracy %.4f, loss %.4f\n", split_name.c_str(), static_cast<long long>(r.count),
                    r.accuracy, r.loss);
        std::printf("confusion matrix (rows: true label, columns: predicted label):\n      ");
        for (int c = 0; c < r.classes; ++c) std::printf("%6d", c);
        std::printf("\n");
        for (int t = 0; t < r.classes; ++t) {
          std::printf("%6d", t);
          for (int c = 0; c < r.classes; ++c)
            std::printf("%6lld", static_cast<long long>(r.confusion[static_cast<std::size_t>(t * r.classes + c)]));
          std::printf("\n");
        }
        return 0;
      });
}

}  // namespace mnist_mpi
