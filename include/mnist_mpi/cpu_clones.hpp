// MNIST_MPI_CPU_CLONES: a hot loop built for AVX-512, AVX2 and the baseline x86-64, for the CPU
// kernels (src/backend/cpu/) and the optimiser's pass (src/train/optimizer.cpp).
#pragma once

// Note [One build for every x86-64]
// The program is built for the baseline x86-64 so that one build runs on any host (the GPU bundle
// of scripts/gpu_check.sh runs on another machine). Our few hot loops are built three times with
// GCC's target_clones, for AVX-512, AVX2 and the baseline, and the loader picks one for the CPU
// through an ifunc. They add and compare lane by lane without FMA contraction, so the three give
// the same bits: the core is built with -ffp-contract=off, since GCC fuses a*b+c into an FMA in
// C++ even in ISO mode wherever the target has FMA (the AVX-512 clones did). Only what is inlined
// into a cloned function is cloned with it: a helper template GCC chose not to inline, or an OpenMP
// region (outlined into a function of its own) inside a helper, stays baseline code, which is how
// the first convolution's weight gradient and the max-pool forward ran SSE until 2026-12-04. So the
// helpers are [[gnu::always_inline]], parallel loops call the clones rather than sit in them, and
// tests/check_clones.sh (the hot_loops_cloned test) fails on any hot loop left outside the clones.
// Not under ThreadSanitizer: its runtime is not up yet when the loader runs the (instrumented) ifunc
// resolver, which crashed the tsan stage at load. Nor under AddressSanitizer: the clones are the same
// source, so one copy shows every memory error they could make, and three copies cost its build time.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define MNIST_MPI_CPU_CLONES
#else
#define MNIST_MPI_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
