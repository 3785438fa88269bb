// What each cuDNN convolution algorithm and each cuBLAS GEMM of the seed models costs on this GPU,
// in fp32 (FMA math) and tf32 (tensor-op math): the data behind Note [Choosing cuDNN algorithms]
// (src/backend/cuda/conv.cpp). For every layer and direction it lists cudnnFind's measured times
// (median of its own runs) with each algorithm's determinism, math and workspace, and marks with
// '*' the one the heuristics rule picks (cudnnGet*_v7, first deterministic within 256 MB), which
// is what mnist_mpi runs. Then the fc layers' three GEMMs, timed with events (median of 50).
//
//   build/cudnn_algos            # on a machine with a GPU; bundled by scripts/gpu_check.sh pack
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"  // CUDA_CHECK, CUDNN_CHECK, CUBLAS_CHECK: the project's messages

namespace {

struct ConvShape {
  const char* name;
  int n, c, h, w, k, r, pad;
};

constexpr std::size_t kCap = std::size_t{256} << 20;

const char* math_name(cudnnMathType_t m) {
  switch (m) {
    case CUDNN_DEFAULT_MATH:
      return "default";
    case CUDNN_TENSOR_OP_MATH:
      return "tensor_op";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION:
      return "tensor_op_conv";
    case CUDNN_FMA_MATH:
      return "fma";
  }
  return "?";
}

template <typename Perf>
int heuristic_pick(const std::vector<Perf>& perf, int got) {
  for (int i = 0; i < got; ++i)
    if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].determinism == CUDNN_DETERMINISTIC && perf[i].memory <= kCap)
      return static_cast<int>(perf[i].algo);
  return -1;
}

template <typename Perf>
void print(const char* dir, const std::vector<Perf>& found, int got, int picked) {
  float best_det = 1e30f;
  for (int i = 0; i < got; ++i)
    if (found[i].status == CUDNN_STATUS_SUCCESS && found[i].determinism == CUDNN_DETERMINISTIC)
      best_det = std::min(best_det, found[i].time);
  for (int i = 0; i < got; ++i) {
    const Perf& p = found[i];
    if (p.status != CUDNN_STATUS_SUCCESS) continue;
    std::printf("    %-11s algo %d %c %8.4f ms  %-14s %-13s %6.1f MB%s\n", dir, static_cast<int>(p.algo),
                static_cast<int>(p.algo) == picked ? '*' : ' ', static_cast<double>(p.time),
                p.determinism == CUDNN_DETERMINISTIC ? "deterministic" : "nondet", math_name(p.mathType),
                static_cast<double>(p.memory) / 1048576.0, p.time == best_det ? "  <- fastest deterministic" : "");
  }
}

void conv(cudnnHandle_t h, const ConvShape& s, bool tf32, void* ws) {
  cudnnTensorDescriptor_t x, y;
  cudnnFilterDescriptor_t w;
  cudnnConvolutionDescriptor_t cd;
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&x));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&y));
  CUDNN_CHECK(cudnnCreateFilterDescriptor(&w));
  CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&cd));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, s.n, s.c, s.h, s.w));
  CUDNN_CHECK(cudnnSetFilter4dDescriptor(w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, s.k, s.c, s.r, s.r));
  CUDNN_CHECK(cudnnSetConvolution2dDescriptor(cd, s.pad, s.pad, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  CUDNN_CHECK(cudnnSetConvolutionMathType(cd, tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH));
  int n, k, oh, ow;
  CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(cd, x, w, &n, &k, &oh, &ow));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, k, oh, ow));
  float *dx, *dw, *dy;
  CUDA_CHECK(cudaMalloc(&dx, sizeof(float) * s.n * s.c * s.h * s.w));
  CUDA_CHECK(cudaMalloc(&dw, sizeof(float) * s.k * s.c * s.r * s.r));
  CUDA_CHECK(cudaMalloc(&dy, sizeof(float) * n * k * oh * ow));
  CUDA_CHECK(cudaMemset(dx, 0, sizeof(float) * s.n * s.c * s.h * s.w));
  CUDA_CHECK(cudaMemset(dw, 0, sizeof(float) * s.k * s.c * s.r * s.r));
  CUDA_CHECK(cudaMemset(dy, 0, sizeof(float) * n * k * oh * ow));
  std::printf("  %s (%d,%d,%d,%d) -> %d, %dx%d, %s\n", s.name, s.n, s.c, s.h, s.w, s.k, s.r, s.r,
              tf32 ? "tf32" : "fp32");
  constexpr int kN = 16;
  int got = 0;
  {
    std::vector<cudnnConvolutionFwdAlgoPerf_t> heur(kN), found(kN);
    CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(h, x, w, cd, y, kN, &got, heur.data()));
    const int picked = heuristic_pick(heur, got);
    CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(h, x, dx, w, dw, cd, y, dy, kN, &got, found.data(), ws, kCap));
    print("forward", found, got, picked);
  }
  if (s.c > 1) {
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> heur(kN), found(kN);
    CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, w, y, cd, x, kN, &got, heur.data()));
    const int picked = heuristic_pick(heur, got);
    CUDNN_CHECK(
        cudnnFindConvolutionBackwardDataAlgorithmEx(h, w, dw, y, dy, cd, x, dx, kN, &got, found.data(), ws, kCap));
    print("bwd-data", found, got, picked);
  }
  {
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> heur(kN), found(kN);
    CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, x, y, cd, w, kN, &got, heur.data()));
    const int picked = heuristic_pick(heur, got);
    CUDNN_CHECK(
        cudnnFindConvolutionBackwardFilterAlgorithmEx(h, x, dx, y, dy, cd, w, dw, kN, &got, found.data(), ws, kCap));
    print("bwd-filter", found, got, picked);
  }
  CUDA_CHECK(cudaFree(dx));
  CUDA_CHECK(cudaFree(dw));
  CUDA_CHECK(cudaFree(dy));
  cudnnDestroyConvolutionDescriptor(cd);
  cudnnDestroyFilterDescriptor(w);
  cudnnDestroyTensorDescriptor(x);
  cudnnDestroyTensorDescriptor(y);
}

// C (m x n) = op(A) op(B), column-major as cuBLAS sees it; median of 50 timed runs.
double gemm_ms(cublasHandle_t b, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k) {
  float *a, *bb, *c;
  CUDA_CHECK(cudaMalloc(&a, sizeof(float) * m * k));
  CUDA_CHECK(cudaMalloc(&bb, sizeof(float) * k * n));
  CUDA_CHECK(cudaMalloc(&c, sizeof(float) * m * n));
  CUDA_CHECK(cudaMemset(a, 0, sizeof(float) * m * k));
  CUDA_CHECK(cudaMemset(bb, 0, sizeof(float) * k * n));
  const float one = 1.0f, zero = 0.0f;
  const int lda = ta == CUBLAS_OP_N ? m : k, ldb = tb == CUBLAS_OP_N ? k : n;
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 55; ++i) {
    CUDA_CHECK(cudaEventRecord(e0));
    CUBLAS_CHECK(cublasSgemm(b, ta, tb, m, n, k, &one, a, lda, bb, ldb, &zero, c, m));
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 5) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(bb));
  CUDA_CHECK(cudaFree(c));
  return ms[ms.size() / 2];
}

int run() {
  int dev = 0;
  CUDA_CHECK(cudaSetDevice(dev));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("cudnn_algos: %s, cuDNN %zu, cudnnFind's times (median of its runs), '*' the heuristics' pick\n",
              prop.name, cudnnGetVersion());
  cudnnHandle_t h;
  CUDNN_CHECK(cudnnCreate(&h));
  void* ws;
  CUDA_CHECK(cudaMalloc(&ws, kCap));
  const ConvShape shapes[] = {
      {"lenet conv1", 100, 1, 28, 28, 32, 5, 2},
      {"lenet conv2", 100, 32, 14, 14, 64, 5, 2},
      {"tiny conv1", 128, 1, 28, 28, 8, 3, 1},
      {"tiny conv2", 128, 8, 14, 14, 16, 3, 1},
  };
  for (bool tf32 : {false, true})
    for (const ConvShape& s : shapes) conv(h, s, tf32, ws);
  cublasHandle_t b;
  CUBLAS_CHECK(cublasCreate(&b));
  // lenet fc1: y (1024 x 100) = W (1024 x 3136) x (3136 x 100), as mnist_mpi's fc (row-major W (out, in)).
  struct Fc {
    const char* name;
    int batch, in, out;
  };
  for (const Fc& f : {Fc{"lenet fc1", 100, 3136, 1024}, Fc{"lenet fc2", 100, 1024, 10}}) {
    for (bool tf32 : {false, true}) {
      CUBLAS_CHECK(cublasSetMathMode(b, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
      const double fwd = gemm_ms(b, CUBLAS_OP_T, CUBLAS_OP_N, f.out, f.batch, f.in);
      const double bwd_data = gemm_ms(b, CUBLAS_OP_N, CUBLAS_OP_N, f.in, f.batch, f.out);
      const double bwd_w = gemm_ms(b, CUBLAS_OP_N, CUBLAS_OP_T, f.in, f.out, f.batch);
      std::printf("  %s (%d x %d -> %d) %s: forward %.4f ms, bwd-data %.4f ms, bwd-weights %.4f ms\n", f.name, f.batch,
                  f.in, f.out, tf32 ? "tf32" : "fp32", fwd, bwd_data, bwd_w);
    }
  }
  cublasDestroy(b);
  cudaFree(ws);
  cudnnDestroy(h);
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cudnn_algos: %s\n", e.what());
    return 1;
  }
}
