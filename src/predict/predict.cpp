// The `predict` subcommand (include/mnist_mpi/predict/predict.hpp): options, the checkpoint's model
// on the chosen device, each image read, prepared and classified, and the lines or JSON printed.
// Reading images is src/predict/image.cpp; MNIST's preprocessing is src/predict/mnist_style.cpp.
#include "mnist_mpi/predict/predict.hpp"

#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <thread>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/device.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/checkpoint/evaluate_checkpoint.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/json.hpp"
#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/predict/image.hpp"
#include "mnist_mpi/predict/mnist_style.hpp"

namespace po = boost::program_options;

namespace mnist_mpi {
namespace {

constexpr int kPredictBatch = 64;

struct Outcome {
  std::string file;
  std::string error;  // empty: classified
  MnistStyle prepared;
  std::string format;
  std::vector<float> probabilities;
};

// The classes by probability, highest first (ties: the lower class first).
std::vector<int> ranking(const std::vector<float>& p) {
  std::vector<int> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
  return order;
}

std::string ink_text(const MnistStyle& m) {
  if (!m.guessed) return m.inverted ? "inverted (--invert)" : "not inverted (--no-invert)";
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s (guessed: border %.2f)", m.inverted ? "inverted" : "not inverted", m.border);
  return buf;
}

// FILE: DIGIT PROBABILITY  top3 D:P D:P D:P  INK (top3 as many as the model has classes, up to 3).
void print_line(const Outcome& o) {
  const std::vector<int> r = ranking(o.probabilities);
  const auto p = [&](std::size_t k) { return o.probabilities[static_cast<std::size_t>(r[k])]; };
  std::string top;
  for (std::size_t k = 0; k < 3 && k < r.size(); ++k) {
    char item[32];
    std::snprintf(item, sizeof item, " %d:%.4f", r[k], p(k));
    top += item;
  }
  std::printf("%s: %d %.4f  top3%s  %s\n", o.file.c_str(), r[0], p(0), top.c_str(), ink_text(o.prepared).c_str());
}

Json outcome_json(const Outcome& o) {
  Json j;
  j["file"] = o.file;
  if (!o.error.empty()) {
    j["error"] = o.error;
    return j;
  }
  const std::vector<int> r = ranking(o.probabilities);
  j["digit"] = r[0];
  j["probability"] = json_number(o.probabilities[static_cast<std::size_t>(r[0])]);
  Json top = Json::array();
  for (std::size_t k = 0; k < 3 && k < r.size(); ++k)
    top.push_back({{"digit", r[k]}, {"probability", json_number(o.probabilities[static_cast<std::size_t>(r[k])])}});
  j["top3"] = top;
  Json all = Json::array();
  for (float p : o.probabilities) all.push_back(json_number(p));
  j["probabilities"] = all;
  j["format"] = o.format;
  j["inverted"] = o.prepared.inverted;
  j["ink_guessed"] = o.prepared.guessed;
  j["border"] = json_number(o.prepared.border);
  j["box"] = {o.prepared.box_x, o.prepared.box_y, o.prepared.box_w, o.prepared.box_h};
  return j;
}

// The prepared (size x size) input as an 8-bit PGM, to see what the model was given.
std::string prepared_path(const std::string& dir, std::size_t index) {
  return dir + "/" + std::to_string(index) + ".pgm";
}

void save_prepared(const std::string& dir, std::size_t index, const Outcome& o) {
  const std::string path = prepared_path(dir, index);
  std::string bytes = "P5\n" + std::to_string(o.prepared.size) + " " + std::to_string(o.prepared.size) + "\n255\n";
  for (float v : o.prepared.pixels) bytes += static_cast<char>(std::lround(std::clamp(v, 0.0f, 1.0f) * 255.0f));
  std::FILE* f = std::fopen(path.c_str(), "wb");
  const bool ok = f && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  if ((f && std::fclose(f) != 0) || !ok)
    throw_error(ExitCode::kOutput, "cannot write " + quote_input(path) + " (--save-prepared): check the directory");
}

std::string host_name() {
  char h[256] = {0};
  return ::gethostname(h, sizeof h - 1) == 0 ? std::string(h) : std::string("this machine");
}

}  // namespace

std::vector<std::vector<float>> classify(const Checkpoint& ck, Backend& backend,
                                         const std::vector<std::vector<float>>& inputs) {
  const ModelSpec spec = checkpoint_model_spec(ck);
  std::vector<std::vector<float>> out;
  if (inputs.empty()) return out;
  const std::unique_ptr<ParameterStore> params = checkpoint_parameters(ck, spec, backend);
  const int batch = static_cast<int>(std::min<std::size_t>(inputs.size(), kPredictBatch));
  Model model(spec, batch, backend, *params, nullptr);
  const int classes = spec.num_classes();
  const auto pixels = static_cast<std::size_t>(spec.input.size());
  std::vector<float> x(static_cast<std::size_t>(batch) * pixels);        // (batch, 1, H, W)
  std::vector<float> logits(static_cast<std::size_t>(batch) * classes);  // (batch, classes)
  StepContext ctx;
  ctx.training = false;
  for (std::size_t first = 0; first < inputs.size(); first += static_cast<std::size_t>(batch)) {
    const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(batch), inputs.size() - first);
    std::fill(x.begin(), x.end(), 0.0f);
    for (std::size_t i = 0; i < n; ++i) {
      MNIST_CHECK(inputs[first + i].size() == pixels, ExitCode::kRuntime, "classify: an input of the wrong size");
      std::copy(inputs[first + i].begin(), inputs[first + i].end(),
                x.begin() + static_cast<std::ptrdiff_t>(i * pixels));
    }
    backend.upload(x, model.input());
    model.forward(ctx);
    backend.download(model.logits(), logits);
    for (std::size_t i = 0; i < n; ++i) {  // softmax in double, from the largest logit down
      const float* l = logits.data() + i * static_cast<std::size_t>(classes);
      const double top = *std::max_element(l, l + classes);
      double sum = 0.0;
      for (int c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(l[c]) - top);
      std::vector<float> p(static_cast<std::size_t>(classes));
      for (int c = 0; c < classes; ++c) p[static_cast<std::size_t>(c)] = static_cast<float>(std::exp(l[c] - top) / sum);
      out.push_back(std::move(p));
    }
  }
  return out;
}

// Long on purpose (Note [Why a function is long] in docs/style.md): the option table, then one
// ordered sequence (checkpoint, device, each image, the model, the output, the exit code).
int predict_main(int argc, char** argv) {
  std::string checkpoint, device = "cpu", save_dir;
  std::vector<std::string> images;
  int threads = 0;
  po::options_description desc(
      "mnist_mpi " MNIST_MPI_VERSION
      " predict - classify digit images (PNG or PGM, any size) with a checkpoint's model.\n"
      "Usage: mnist_mpi predict --checkpoint FILE|DIR [options] IMAGE... (one process, no mpirun)\n"
      "Each image is made to look like an MNIST digit first (docs/model_use.md). Output: one line per image,\n"
      "  FILE: DIGIT PROBABILITY  top3 D:P D:P D:P  INK\n"
      "Exit code: 0 every image classified; 3 an image could not be read (the others are still classified);\n"
      "2 bad option; 4 bad checkpoint; 6 no usable GPU for --device cuda; 7 an output (--save-prepared or\n"
      "standard output) could not be written\nOptions");
  desc.add_options()("help,h", "print this help and exit")(
      "checkpoint", po::value(&checkpoint), "checkpoint file, or a --checkpoint-dir (its newest valid checkpoint)")(
      "invert", "the images are dark ink on light paper: invert them (default: guessed from each image's border)")(
      "no-invert", "the images are light ink on a dark field, as MNIST: never invert")(
      "json", "print one JSON document (every image, with all class probabilities) instead of lines")(
      "device", po::value(&device)->default_value(device),
      "cpu | cuda | auto (cpu by default: a few images do not pay for starting a GPU)")(
      "threads", po::value(&threads)->default_value(threads), "CPU threads (0 = all cores)")(
      "save-prepared", po::value(&save_dir),
      "write what the model sees, each image as DIR/INDEX.pgm (28x28, INDEX from 0 in argument order)")(
      "image", po::value(&images), "image files (positional)");
  po::positional_options_description pos;
  pos.add("image", -1);
  return run_subcommand(
      "predict", "mnist_mpi predict", desc, &pos, argc, argv, [&](const po::variables_map& vm) -> int {
        if (checkpoint.empty() || images.empty())
          throw_error(ExitCode::kUsage, "give --checkpoint FILE and one or more images (see mnist_mpi predict --help)");
        if (vm.count("invert") && vm.count("no-invert"))
          throw_error(ExitCode::kUsage, "--invert and --no-invert contradict each other; give at most one");
        if (threads < 0) throw_error(ExitCode::kUsage, "--threads must be >= 0");
        const InkMode ink = vm.count("invert")      ? InkMode::kDarkOnLight
                            : vm.count("no-invert") ? InkMode::kLightOnDark
                                                    : InkMode::kAuto;
        {  // Note [No output is an input]: the prepared images must not overwrite the ones given
          FileRoles roles;
          declare_checkpoint_input(checkpoint, roles);
          for (std::size_t i = 0; i < images.size(); ++i)
            roles.input("an image argument", images[i]);
          for (std::size_t i = 0; !save_dir.empty() && i < images.size(); ++i)
            roles.output("--save-prepared", prepared_path(save_dir, i));
          roles.check();
          for (std::size_t i = 0; !save_dir.empty() && i < images.size(); ++i)  // before the work
            check_output_path(prepared_path(save_dir, i), "--save-prepared", ExitCode::kOutput);
        }
        std::string chosen;
        const Checkpoint ck = pick_checkpoint(checkpoint, chosen);
        MNIST_CHECK(ck.input.c == 1 && ck.input.h == ck.input.w, ExitCode::kCheckpoint,
                    "the checkpoint's model takes " + std::to_string(ck.input.c) + "x" + std::to_string(ck.input.h) +
                        "x" + std::to_string(ck.input.w) + " inputs; predict prepares square grey images only");
        const DeviceChoice dev =
            choose_device(device, cuda_built(), device == "cpu" ? GpuProbe{} : probe_gpus(), 0, 1, false, host_name());
        if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        auto backend = make_backend(dev, threads, "fp32");

        const int size = ck.input.h, box = static_cast<int>(std::lround(ck.input.h * 20.0 / 28.0));
        std::vector<Outcome> outcomes(images.size());
        std::vector<std::vector<float>> inputs;
        std::vector<std::size_t> which;  // outcomes[which[k]] is inputs[k]
        for (std::size_t i = 0; i < images.size(); ++i) {
          Outcome& o = outcomes[i];
          o.file = images[i];
          try {
            const GreyImage img = read_image(images[i]);
            o.format = img.format;
            try {
              o.prepared = to_mnist_style(img, ink, size, box);
            } catch (const Error& e) {
              throw_error(e.code(), "image " + quote_input(images[i]) + ": " + e.what());
            }
            if (!save_dir.empty()) save_prepared(save_dir, i, o);
            inputs.push_back(o.prepared.pixels);
            which.push_back(i);
          } catch (const Error& e) {
            if (e.code() != ExitCode::kData) throw;
            o.error = e.what();
            std::fprintf(stderr, "mnist_mpi predict: %s\n", e.what());
          }
        }
        const std::vector<std::vector<float>> p = classify(ck, *backend, inputs);
        for (std::size_t k = 0; k < p.size(); ++k) outcomes[which[k]].probabilities = p[k];
        if (vm.count("json")) {
          Json doc;
          doc["checkpoint"] = chosen;
          doc["step"] = ck.meta.step;
          doc["model"] = ck.spec;
          doc["device"] = backend->name();
          Json list = Json::array();
          for (const Outcome& o : outcomes) list.push_back(outcome_json(o));
          doc["images"] = list;
          std::printf("%s\n", json_text(doc).c_str());
        } else {
          for (const Outcome& o : outcomes)
            if (o.error.empty()) print_line(o);
        }
        return inputs.size() == images.size() ? 0 : static_cast<int>(ExitCode::kData);
      });
}

}  // namespace mnist_mpi
