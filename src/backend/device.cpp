// Device choice (see include/mnist_mpi/backend/device.hpp): the decision is plain logic; the
// probes ask the CUDA runtime only in builds with the CUDA backend, through the module that holds
// it (Note [Loading the CUDA module]), and turn its answers into words (a user who asked for a
// GPU on a machine without one gets a sentence, not an error code).
#include "mnist_mpi/backend/device.hpp"

#include <cstdlib>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/check.hpp"

#if MNIST_MPI_HAVE_CUDA
#include <dlfcn.h>

#include "src/backend/cuda_module.hpp"
#endif

namespace mnist_mpi {

DeviceChoice choose_device(const std::string& requested, bool built, const GpuProbe& gpus, int local_rank,
                           int local_size, bool allow_sharing, const std::string& host) {
  DeviceChoice c;
  if (requested == "cpu") return c;
  MNIST_CHECK(requested == "auto" || requested == "cuda", ExitCode::kUsage,
              "--device must be cpu, cuda or auto, got '" + requested + "'");
  if (!built) {
    MNIST_CHECK(requested == "auto", ExitCode::kDevice,
                "--device cuda: this build has no CUDA backend (it was configured without CUDA, cuDNN or NCCL); "
                "rebuild with -DMNIST_MPI_CUDA=ON where they are installed, or use --device cpu");
    c.note = "--device auto: this build has no CUDA backend, running on the CPU";
    return c;
  }
  if (gpus.count == 0) {
    MNIST_CHECK(requested == "auto", ExitCode::kDevice,
                "--device cuda: no usable GPU on " + host + ": " + gpus.why_none +
                    "; run where a GPU is visible, or use --device cpu");
    c.note = "--device auto: no usable GPU (" + gpus.why_none + "), running on the CPU";
    return c;
  }
  MNIST_CHECK(local_size <= gpus.count || allow_sharing, ExitCode::kDevice,
              "--device " + requested + ": " + std::to_string(local_size) + " ranks on " + host + " but only " +
                  std::to_string(gpus.count) + " GPU(s) visible; start at most " + std::to_string(gpus.count) +
                  " ranks per node, or pass --allow-gpu-sharing to let ranks share GPUs");
  c.cuda = true;
  c.gpu = local_rank % gpus.count;
  if (requested == "auto")
    c.note = "--device auto: " + std::to_string(gpus.count) +
             " GPU(s) visible, running on CUDA (GPU = node-local rank mod " + std::to_string(gpus.count) + ")";
  return c;
}

#if MNIST_MPI_HAVE_CUDA

// Note [Loading the CUDA module]
// The CUDA backend lives in libmnist_mpi_cuda.so next to libmnist_mpi_core.so (both in build/);
// MNIST_MPI_CUDA_MODULE names another file. It is opened once, on the first question about GPUs,
// which only a run with --device cuda or auto asks (src/train/rig.cpp). If it cannot be opened
// (cuDNN, cuBLAS or NCCL missing on this machine, say), the probe finds no GPU and says why, so
// --device auto falls back to the CPU and --device cuda stops with that reason.
namespace {

struct LoadedModule {
  const CudaModule* table = nullptr;
  std::string error;  // why table is null
};

std::string module_path() {
  if (const char* env = std::getenv("MNIST_MPI_CUDA_MODULE"); env && *env) return env;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&module_path), &info) != 0 && info.dli_fname) {
    const std::string self = info.dli_fname;
    const auto slash = self.rfind('/');
    if (slash != std::string::npos) return self.substr(0, slash + 1) + "libmnist_mpi_cuda.so";
  }
  return "libmnist_mpi_cuda.so";
}

const LoadedModule& cuda_module() {
  static const LoadedModule loaded = [] {
    LoadedModule m;
    const std::string path = module_path();
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      m.error = "the CUDA backend module could not be loaded (" + std::string(e ? e : path) +
                "); install CUDA, cuDNN, cuBLAS and NCCL where this build expects them, or rebuild";
      return m;
    }
    using Entry = const CudaModule* (*)();
    auto entry = reinterpret_cast<Entry>(dlsym(h, "mnist_mpi_cuda_module"));
    const CudaModule* t = entry ? entry() : nullptr;
    if (!t || t->abi != kCudaModuleAbi || t->table_size != sizeof(CudaModule)) {
      m.error = "'" + path + "' is not this build's CUDA backend module (rebuild: cmake --build build)";
      return m;
    }
    m.table = t;
    return m;
  }();
  return loaded;
}

const CudaModule& require_module() {
  const LoadedModule& m = cuda_module();
  if (!m.table) throw_error(ExitCode::kDevice, m.error);
  return *m.table;
}

}  // namespace

bool cuda_built() { return true; }

GpuProbe probe_gpus() {
  const LoadedModule& m = cuda_module();
  if (!m.table) return GpuProbe{0, m.error};
  return m.table->probe_gpus();
}

std::string describe_gpu(int gpu) { return require_module().describe_gpu(gpu); }

std::unique_ptr<Backend> make_cuda_backend(int device, GpuPrecision precision) {
  return require_module().make_backend(device, precision);
}

bool cuda_module_loaded() {
  void* h = dlopen(module_path().c_str(), RTLD_LAZY | RTLD_NOLOAD);  // a handle only if it is mapped already
  if (h) dlclose(h);
  return h != nullptr;
}

#else

bool cuda_built() { return false; }
GpuProbe probe_gpus() { return GpuProbe{0, "this build has no CUDA backend"}; }
std::string describe_gpu(int) { return "none (no CUDA backend in this build)"; }
bool cuda_module_loaded() { return false; }
std::unique_ptr<Backend> make_cuda_backend(int, GpuPrecision) {
  throw_error(ExitCode::kDevice, "this build has no CUDA backend; rebuild with -DMNIST_MPI_CUDA=ON");
}

#endif

std::unique_ptr<Backend> make_backend(const DeviceChoice& device, int threads, const std::string& precision) {
  if (device.cuda)
    return make_cuda_backend(device.gpu, precision == "tf32"   ? GpuPrecision::kTf32
                                         : precision == "bf16" ? GpuPrecision::kBf16
                                                               : GpuPrecision::kFp32);
  CpuFusions kernels;
  kernels.bf16 = precision == "bf16";
  return make_cpu_backend(threads, kernels);
}

}  // namespace mnist_mpi
