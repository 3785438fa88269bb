// The CPU backend (src/backend/cpu/: oneDNN plus our own loops), and the knobs only it has.
#pragma once

#include <memory>

#include "mnist_mpi/backend/backend.hpp"

namespace mnist_mpi {

// The CPU backend's cross-layer fusions (src/backend/cpu/conv.cpp), all on by default; tests and
// A/B runs turn them off to compare. Which apply to a model: Note [The fusion plan] in
// src/backend/cpu/fusion.cpp.
struct CpuFusions {
  bool pool_gradient = true;      // Note [The first convolution reads its pool's gradient]
  bool conv_pool_forward = true;  // Note [The first convolution and its pool in one pass]
  bool relu_into_pool = true;     // Note [A ReLU taken over by its max pool] (src/backend/cpu/pool.cpp)
  bool pool_backward_tiles = true;  // Note [A 2 x 2 pool's gradient in one pass] (src/backend/cpu/pool.cpp)
  // The kernels written with AVX2 intrinsics, where the CPU has AVX2 (and FMA); false: their
  // portable versions, which give the same bits (BlockedLayouts tests compare the two).
  bool avx2_kernels = true;
  // --precision bf16 (Note [bf16 on the CPU] in src/backend/cpu/cpu_backend.cpp): convolutions
  // after the first and fc layers multiply in bf16 (oneDNN's AVX512-BF16 / AMX kernels), and a
  // first convolution followed by a ReLU and a max pool in the pool's own bf16 pass; they
  // accumulate and write in fp32. make_cpu_backend refuses it (exit 2) on a CPU without them.
  bool bf16 = false;
};

// Whether this CPU has bf16 multiply instructions oneDNN uses (AVX512-BF16 or AMX-BF16).
bool cpu_has_bf16();

// --threads: the number of threads each rank's kernels use.
std::unique_ptr<Backend> make_cpu_backend(int threads, CpuFusions fusions = {});

}  // namespace mnist_mpi
