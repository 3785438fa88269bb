// The CUDA backend is a module of its own, build/libmnist_mpi_cuda.so, loaded with dlopen the first
// time a run asks for a GPU (--device cuda, or auto). A CPU rank never maps CUDA, cuDNN, cuBLAS or
// NCCL (a few hundred MB of libraries: peak RSS per CPU rank went from 113 to 269 MB when they were
// linked into the program), and a build with CUDA still runs --device cpu on a machine that lacks
// those libraries. This is the table the module hands to src/backend/device.cpp; both sides are
// built from this header in one build, and kCudaModuleAbi guards against a stale module file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/device.hpp"

namespace mnist_mpi {

inline constexpr int kCudaModuleAbi = 3;  // 2: the communicators are made by the backend; 3: GpuPrecision

struct CudaModule {
  int abi;                 // kCudaModuleAbi
  std::size_t table_size;  // sizeof(CudaModule)
  GpuProbe (*probe_gpus)();
  std::string (*describe_gpu)(int gpu);
  std::unique_ptr<Backend> (*make_backend)(int gpu, GpuPrecision precision);
};

}  // namespace mnist_mpi

// The module's one exported entry point.
extern "C" const mnist_mpi::CudaModule* mnist_mpi_cuda_module();
