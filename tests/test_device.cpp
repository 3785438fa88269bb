// Device choice without a GPU (include/mnist_mpi/backend/device.hpp): every branch of
// choose_device() with made-up probes, the messages a user sees, and the dropout function that
// both backends share (rng::dropout_key / dropout_scale) against the CPU dropout layer.
#include <gtest/gtest.h>

#include <mpi.h>

#include <fstream>
#include <string>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/backend/device.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/rng.hpp"
#include "mnist_mpi/train/trainer.hpp"
#include "synthetic.hpp"

namespace mnist_mpi {
namespace {

GpuProbe gpus(int n) { return n > 0 ? GpuProbe{n, ""} : GpuProbe{0, "no CUDA device is visible"}; }

// The code and message of the Error that f throws (kOk and "" when it throws none).
template <typename F>
std::pair<ExitCode, std::string> error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ExitCode::kOk, ""};
}

TEST(DeviceChoice, CpuIsAlwaysTheCpu) {
  for (int n : {0, 1, 8}) {
    const DeviceChoice c = choose_device("cpu", true, gpus(n), 3, 4, false, "h");
    EXPECT_FALSE(c.cuda);
    EXPECT_TRUE(c.note.empty());
  }
}

TEST(DeviceChoice, AutoWithoutCudaBuildRunsOnTheCpuAndSaysSo) {
  const DeviceChoice c = choose_device("auto", false, gpus(0), 0, 2, false, "h");
  EXPECT_FALSE(c.cuda);
  EXPECT_EQ(c.note, "--device auto: this build has no CUDA backend, running on the CPU");
}

TEST(DeviceChoice, AutoWithoutGpuRunsOnTheCpuAndSaysWhy) {
  const DeviceChoice c = choose_device("auto", true, gpus(0), 0, 2, false, "h");
  EXPECT_FALSE(c.cuda);
  EXPECT_EQ(c.note, "--device auto: no usable GPU (no CUDA device is visible), running on the CPU");
}

TEST(DeviceChoice, AutoTakesTheGpuOfItsLocalRank) {
  const DeviceChoice c = choose_device("auto", true, gpus(4), 2, 4, false, "h");
  EXPECT_TRUE(c.cuda);
  EXPECT_EQ(c.gpu, 2);
  EXPECT_NE(c.note.find("4 GPU(s) visible, running on CUDA"), std::string::npos) << c.note;
}

TEST(DeviceChoice, CudaMapsLocalRankToGpuOneToOne) {
  for (int r = 0; r < 8; ++r) {
    const DeviceChoice c = choose_device("cuda", true, gpus(8), r, 8, false, "h");
    EXPECT_TRUE(c.cuda);
    EXPECT_EQ(c.gpu, r);
    EXPECT_TRUE(c.note.empty());
  }
}

TEST(DeviceChoice, CudaWithoutGpuIsADeviceErrorWithTheFix) {
  const auto [code, msg] = error_of([] { choose_device("cuda", true, gpus(0), 0, 1, false, "node7"); });
  EXPECT_EQ(code, ExitCode::kDevice);
  EXPECT_EQ(msg,
            "--device cuda: no usable GPU on node7: no CUDA device is visible; run where a GPU is visible, "
            "or use --device cpu");
}

TEST(DeviceChoice, CudaWithoutCudaBuildIsADeviceError) {
  const auto [code, msg] = error_of([] { choose_device("cuda", false, gpus(0), 0, 1, false, "h"); });
  EXPECT_EQ(code, ExitCode::kDevice);
  EXPECT_NE(msg.find("this build has no CUDA backend"), std::string::npos) << msg;
  EXPECT_NE(msg.find("-DMNIST_MPI_CUDA=ON"), std::string::npos) << msg;
}

TEST(DeviceChoice, MoreRanksThanGpusIsAnErrorUnlessSharingIsAllowed) {
  for (const char* dev : {"cuda", "auto"}) {
    const auto [code, msg] = error_of([&] { choose_device(dev, true, gpus(2), 1, 3, false, "node3"); });
    EXPECT_EQ(code, ExitCode::kDevice) << dev;
    EXPECT_NE(msg.find("3 ranks on node3 but only 2 GPU(s) visible"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--allow-gpu-sharing"), std::string::npos) << msg;
  }
  // Allowed: round-robin over the GPUs.
  const int expect[] = {0, 1, 0, 1, 0};
  for (int r = 0; r < 5; ++r) {
    const DeviceChoice c = choose_device("cuda", true, gpus(2), r, 5, true, "h");
    EXPECT_TRUE(c.cuda);
    EXPECT_EQ(c.gpu, expect[r]) << "local rank " << r;
  }
}

TEST(DeviceChoice, UnknownDeviceIsAUsageError) {
  EXPECT_EQ(error_of([] { choose_device("tpu", true, gpus(1), 0, 1, false, "h"); }).first, ExitCode::kUsage);
}

TEST(DeviceChoice, ProbeNeverThrowsAndExplainsAnEmptyAnswer) {
  const GpuProbe p = probe_gpus();  // on a machine without a GPU: count 0 and a reason in words
  if (p.count == 0)
    EXPECT_FALSE(p.why_none.empty());
  else
    EXPECT_TRUE(cuda_built());
}

// Note [Loading the CUDA module] in src/backend/device.cpp: a CPU run never maps the CUDA libraries
// (they cost a CPU rank ~150 MB of RSS when they were linked into the program). Trains two steps
// on --device cpu and looks at what this process has mapped; then, in a build with CUDA, a probe
// loads the module (and with it cuDNN and NCCL) and still answers in words.
TEST(DeviceModule, CpuRunNeverLoadsTheCudaLibraries) {
  auto mapped = [](const char* name) {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line))
      if (line.find(name) != std::string::npos) return true;
    return false;
  };
  if (cuda_module_loaded()) GTEST_SKIP() << "another test in this process loaded the CUDA module already";
  const std::string dir = testing::shared_synthetic_dir("device_module", 200, 50);
  Options o;
  o.data_dir = dir;
  o.validation_size = 20;
  o.model = "flatten,fc:10";
  o.global_batch_size = 20;
  o.max_steps = 2;
  o.threads = 1;
  o.quiet = true;
  o.log_every = 0;
  o.device = "cpu";
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  {
    Trainer t(o, *comm);
    t.run();
  }
  EXPECT_FALSE(cuda_module_loaded());
  for (const char* lib : {"libmnist_mpi_cuda", "libcudart", "libcudnn", "libcublas", "libnccl"})
    EXPECT_FALSE(mapped(lib)) << lib << " is mapped after a --device cpu run";
  const GpuProbe p = probe_gpus();  // --device auto / cuda ask this; it loads the module
  if (!cuda_built()) return;
  EXPECT_TRUE(cuda_module_loaded() || p.why_none.find("could not be loaded") != std::string::npos) << p.why_none;
  if (cuda_module_loaded()) {
    EXPECT_TRUE(mapped("libcudnn"));
  }
  if (p.count == 0) {
    EXPECT_FALSE(p.why_none.empty());
  }
}

TEST(DeviceOptions, PrecisionAndDeviceAreChecked) {
  auto parse = [](std::vector<const char*> args) {
    args.insert(args.begin(), "mnist_mpi");
    Options o;
    std::string text;
    parse_options(static_cast<int>(args.size()), args.data(), o, text);
    return o;
  };
  const Options o = parse({"--batch-size", "10", "--device", "cuda", "--precision", "tf32", "--allow-gpu-sharing"});
  EXPECT_EQ(o.device, "cuda");
  EXPECT_EQ(o.precision, "tf32");
  EXPECT_TRUE(o.allow_gpu_sharing);
  EXPECT_EQ(parse({"--batch-size", "10"}).precision, "fp32");
  EXPECT_EQ(error_of([&] { parse({"--batch-size", "10", "--precision", "fp16"}); }).first, ExitCode::kUsage);
  EXPECT_EQ(error_of([&] { parse({"--batch-size", "10", "--device", "gpu"}); }).first, ExitCode::kUsage);
  // Note [Choosing cuDNN algorithms] (src/backend/cuda/conv.cpp)
  EXPECT_EQ(parse({"--batch-size", "10"}).conv_algos, "heuristic");
  EXPECT_EQ(parse({"--batch-size", "10", "--device", "cuda", "--conv-algos", "measured"}).conv_algos, "measured");
  EXPECT_EQ(parse({"--batch-size", "10", "--device", "auto", "--conv-algos", "measured"}).conv_algos, "measured");
  const auto cpu = error_of([&] { parse({"--batch-size", "10", "--conv-algos", "measured"}); });  // --device cpu
  EXPECT_EQ(cpu.first, ExitCode::kUsage);
  EXPECT_NE(cpu.second.find("--device cpu has none"), std::string::npos) << cpu.second;
  const auto bad = error_of([&] { parse({"--batch-size", "10", "--conv-algos", "fastest"}); });
  EXPECT_EQ(bad.first, ExitCode::kUsage);
  EXPECT_NE(bad.second.find("--conv-algos must be heuristic or measured, got 'fastest'"), std::string::npos)
      << bad.second;
}

// The CPU dropout layer's mask is exactly rng::dropout_scale of rng::dropout_key, the functions the
// CUDA kernel calls (compiled for the device from the same header): so the masks can only agree.
TEST(SharedDropoutRng, CpuLayerUsesTheSharedFunction) {
  auto be = make_cpu_backend(1);
  const ModelSpec spec = parse_model_spec("flatten,dropout:0.3,fc:10", Shape{1, 4, 5}, 10);
  const LayerSpec& l = spec.layers.at(1);
  const int batch = 3;
  std::vector<float> x(static_cast<std::size_t>(batch * 20), 1.0f), y(x.size()), dy(x.size(), 1.0f), dx(x.size());
  LayerBuffers b;
  b.batch = batch;
  b.x = x.data();
  b.y = y.data();
  b.dy = dy.data();
  b.dx = dx.data();
  auto k = be->make_layer(l, 1, b, true);
  StepContext ctx{true, 1234, 77, 40};
  k->forward(ctx);
  const float keep = 1.0f / (1.0f - 0.3f);
  int dropped = 0;
  for (int n = 0; n < batch; ++n) {
    const std::uint64_t key = rng::dropout_key(1234, 77, 40 + n, 1);
    for (int i = 0; i < 20; ++i) {
      const float want = rng::dropout_scale(key, i, 0.3f, keep);
      EXPECT_EQ(y[static_cast<std::size_t>(n * 20 + i)], want) << "sample " << n << " element " << i;
      dropped += want == 0.0f ? 1 : 0;
    }
  }
  EXPECT_GT(dropped, 0);
  EXPECT_LT(dropped, batch * 20);
  // Pinned values: the mask function must never change silently (a resumed run replays masks).
  const std::uint64_t key = rng::dropout_key(42, 0, 0, 0);
  EXPECT_EQ(key, 0xe2c7e013727b2e6dULL);
  std::string kept;
  for (int i = 0; i < 32; ++i) kept += rng::dropout_scale(key, i, 0.5f, 2.0f) != 0.0f ? '1' : '0';
  EXPECT_EQ(kept, "01110001000111001010000000110000");
}

}  // namespace
}  // namespace mnist_mpi
