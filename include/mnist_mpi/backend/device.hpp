// Which device a rank computes on (--device auto|cpu|cuda): the node-local rank picks GPU
// local_rank mod the visible GPUs; more ranks on a node than GPUs is an error unless
// --allow-gpu-sharing. choose_device() is the pure decision (unit-tested without a GPU);
// probe_gpus() and describe_gpu() ask the CUDA runtime (in builds with CUDA).
#pragma once

#include <memory>
#include <string>

namespace mnist_mpi {

class Backend;  // include/mnist_mpi/backend/backend.hpp

struct GpuProbe {
  int count = 0;         // usable GPUs visible to this process
  std::string why_none;  // when count == 0: why, in words (no driver, no device, CUDA_VISIBLE_DEVICES)
};

struct DeviceChoice {
  bool cuda = false;
  int gpu = -1;      // index among the visible GPUs
  std::string note;  // how auto was resolved (printed by rank 0), empty otherwise
};

// requested: "auto" | "cpu" | "cuda". cuda_built: this build has the CUDA backend. Throws
// Error(kDevice) with one line naming the problem and the fix.
DeviceChoice choose_device(const std::string& requested, bool cuda_built, const GpuProbe& gpus, int local_rank,
                           int local_size, bool allow_sharing, const std::string& host);

// The backend of a chosen device: the CUDA backend on its GPU (precision tf32: TF32 tensor cores
// for float math; bf16: Note [bf16 on the GPU] in src/backend/cuda/cuda_backend.cpp), else the CPU
// backend with `threads` threads per rank (precision bf16: Note [bf16 on the CPU] in
// src/backend/cpu/cpu_backend.cpp; refused on a CPU without bf16, exit 2).
std::unique_ptr<Backend> make_backend(const DeviceChoice& device, int threads, const std::string& precision);

// The arithmetic of the GPU's convolutions and products (--precision): float on FMA units, float
// inputs on TF32 tensor cores, or bf16 copies of the inputs on bf16 tensor cores.
enum class GpuPrecision { kFp32, kTf32, kBf16 };

// The CUDA backend on GPU `device` (already chosen, see include/mnist_mpi/backend/device.hpp). Only
// in builds with CUDA (MNIST_MPI_HAVE_CUDA); elsewhere it throws Error(kDevice).
std::unique_ptr<Backend> make_cuda_backend(int device, GpuPrecision precision);

bool cuda_built();
GpuProbe probe_gpus();              // never throws; count 0 in builds without CUDA
std::string describe_gpu(int gpu);  // "NVIDIA H200, bus 0000:19:00.0, 139 GiB, sm_90"
// Whether the CUDA backend module (build/libmnist_mpi_cuda.so) is loaded in this process; asking
// does not load it. A run with --device cpu never loads it (tests/test_device.cpp).
bool cuda_module_loaded();

}  // namespace mnist_mpi
