// Device choice (see include/mnist_mpi/backend/device.hpp): the decision is plain logic; the
// probes ask the CUDA runtime only in builds with the CUDA backend, and turn its answers into
// words (a user who asked for a GPU on a machine without one gets a sentence, not an error code).
#include "mnist_mpi/backend/device.hpp"

#include <cstdlib>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/communicator.hpp"

#if MNIST_MPI_HAVE_CUDA
#include <cuda_runtime.h>
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
    c.note = "--device auto: " + std::to_string(gpus.count) + " GPU(s) visible, running on CUDA (GPU = node-local rank mod " +
             std::to_string(gpus.count) + ")";
  return c;
}

#if MNIST_MPI_HAVE_CUDA

bool cuda_built() { return true; }

GpuProbe probe_gpus() {
  GpuProbe p;
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc == cudaSuccess && n > 0) {
    p.count = n;
    return p;
  }
  cudaGetLastError();  // clear it: the answer is in words below
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string vis = visible ? std::string(" (CUDA_VISIBLE_DEVICES='") + visible + "')" : std::string();
  switch (rc) {
    case cudaSuccess:
    case cudaErrorNoDevice: p.why_none = "no CUDA device is visible" + vis; break;
    case cudaErrorInsufficientDriver:
      p.why_none = "no NVIDIA driver is loaded, or it is older than this build's CUDA runtime needs";
      break;
    case cudaErrorDevicesUnavailable: p.why_none = "every GPU is busy or in exclusive-process mode" + vis; break;
    default: p.why_none = std::string("the CUDA runtime says: ") + cudaGetErrorString(rc) + vis; break;
  }
  return p;
}

std::string describe_gpu(int gpu) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, gpu));
  char bus[32] = {0};
  CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, gpu));
  return std::string(prop.name) + ", bus " + bus + ", " +
         std::to_string(prop.totalGlobalMem >> 30) + " GiB, sm_" + std::to_string(prop.major) +
         std::to_string(prop.minor);
}

#else

bool cuda_built() { return false; }
GpuProbe probe_gpus() { return GpuProbe{0, "this build has no CUDA backend"}; }
std::string describe_gpu(int) { return "none (no CUDA backend in this build)"; }
std::unique_ptr<Backend> make_cuda_backend(int, bool) {
  throw_error(ExitCode::kDevice, "this build has no CUDA backend; rebuild with -DMNIST_MPI_CUDA=ON");
}
std::unique_ptr<Communicator> make_nccl_communicator(Communicator&, Backend&) {
  throw_error(ExitCode::kDevice, "this build has no NCCL communicator; rebuild with -DMNIST_MPI_CUDA=ON");
}
std::unique_ptr<Communicator> make_staged_communicator(Communicator&, Backend&, std::int64_t) {
  throw_error(ExitCode::kDevice, "this build has no CUDA backend; rebuild with -DMNIST_MPI_CUDA=ON");
}

#endif

}  // namespace mnist_mpi
