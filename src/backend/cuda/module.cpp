// The entry point of build/libmnist_mpi_cuda.so (see src/backend/cuda_module.hpp): the GPU probe and
// description, which ask the CUDA runtime, and the factory of the backend (which makes its own
// gradient communicator: Backend::make_gradient_communicator).
#include <cuda_runtime.h>

#include <cstdlib>

#include "src/backend/cuda/cuda_backend.hpp"
#include "src/backend/cuda_module.hpp"

namespace mnist_mpi::cuda {

std::unique_ptr<Backend> make_backend(int device, GpuPrecision precision);

namespace {

GpuProbe probe() {
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
    case cudaErrorNoDevice:
      p.why_none = "no CUDA device is visible" + vis;
      break;
    case cudaErrorInsufficientDriver:
      p.why_none = "no NVIDIA driver is loaded, or it is older than this build's CUDA runtime needs";
      break;
    case cudaErrorDevicesUnavailable:
      p.why_none = "every GPU is busy or in exclusive-process mode" + vis;
      break;
    default:
      p.why_none = std::string("the CUDA runtime says: ") + cudaGetErrorString(rc) + vis;
      break;
  }
  return p;
}

std::string describe(int gpu) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, gpu));
  char bus[32] = {0};
  CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, gpu));
  return std::string(prop.name) + ", bus " + bus + ", " + std::to_string(prop.totalGlobalMem >> 30) + " GiB, sm_" +
         std::to_string(prop.major) + std::to_string(prop.minor);
}

constexpr CudaModule kModule{kCudaModuleAbi, sizeof(CudaModule), probe, describe, make_backend};

}  // namespace
}  // namespace mnist_mpi::cuda

extern "C" __attribute__((visibility("default"))) const mnist_mpi::CudaModule* mnist_mpi_cuda_module() {
  return &mnist_mpi::cuda::kModule;
}
