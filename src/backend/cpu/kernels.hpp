// The CPU backend's kernel factories, one per layer kind (one file each in src/backend/cpu/).
#pragma once

#include "mnist_mpi/backend/backend.hpp"
#include "src/backend/cpu/dnnl_util.hpp"

// Note [One build for every x86-64]
// The program is built for the baseline x86-64 so that one build runs on any host (the GPU bundle
// of scripts/gpu_check.sh runs on another machine). Our few hot loops are built three times with
// GCC's target_clones, for AVX-512, AVX2 and the baseline, and the loader picks one for the CPU
// through an ifunc. They add and compare lane by lane without FMA contraction, so the three give
// the same bits: the core is built with -ffp-contract=off, since GCC fuses a*b+c into an FMA in
// C++ even in ISO mode wherever the target has FMA (the AVX-512 clones did). Not under ThreadSanitizer: its runtime is not up yet when the
// loader runs the (instrumented) ifunc resolver, which crashed the tsan stage at load.
#if defined(__SANITIZE_THREAD__)
#define MNIST_MPI_CPU_CLONES
#else
#define MNIST_MPI_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace mnist_mpi::cpu {

std::unique_ptr<LayerKernel> make_conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training);
// Whether oneDNN has non-reference convolution kernels for these activation layouts (a probe for
// Note [Which activations are blocked]; with_dx: backward-data too).
bool conv_has_fast_kernels(const Context& c, const LayerSpec& l, Layout x_layout, Layout y_layout, bool with_dx);
std::unique_ptr<LayerKernel> make_fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training);
std::unique_ptr<LayerKernel> make_maxpool(const LayerSpec& l, const LayerBuffers& b, bool training);
std::unique_ptr<LayerKernel> make_relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training);
std::unique_ptr<LayerKernel> make_dropout(const LayerSpec& l, int index, const LayerBuffers& b, bool training);
std::unique_ptr<LayerKernel> make_flatten(const LayerSpec& l, const LayerBuffers& b);

}  // namespace mnist_mpi::cpu
