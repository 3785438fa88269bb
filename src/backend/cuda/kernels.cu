// Our own CUDA kernels, where cuDNN and cuBLAS have nothing: softmax cross-entropy with its
// gradient, bias gradients and bias addition, the batch gather (uint8 -> [0, 1] floats), the fused
// optimiser pass, dropout, padding, --exact-sums's fixed-point conversions and small elementwise
// helpers. Each is written to compute the
// same float operations as the CPU code it mirrors; the GPU tests compare them
// (tests/test_gpu.cpp).
#include <cuda_bf16.h>
#include <math_constants.h>

#include <cmath>

#include "mnist_mpi/rng.hpp"
#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

// Grid-stride loop over [0, n).
#define MNIST_GRID_LOOP(k, n)                                                                      \
  for (std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < (n); \
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

// One block: each thread takes rows, as the CPU reference does (first maximum wins, log-sum-exp
// in double); the block then adds the rows' losses in a fixed tree order, so the sum does not
// depend on timing.
__global__ void softmax_xent_kernel(const float* __restrict__ logits, const std::int32_t* __restrict__ labels,
                                    int batch, int classes, float* __restrict__ dlogits, float grad_scale,
                                    double* __restrict__ sums, int* __restrict__ guard) {
  __shared__ double loss_part[kThreads];
  __shared__ double correct_part[kThreads];
  double loss = 0.0, correct = 0.0;
  for (int n = threadIdx.x; n < batch; n += blockDim.x) {
    const float* z = logits + static_cast<std::ptrdiff_t>(n) * classes;  // (classes)
    int argmax = 0;
    for (int k = 1; k < classes; ++k)
      if (z[k] > z[argmax]) argmax = k;
    const double m = z[argmax];
    double sum = 0.0;
    for (int k = 0; k < classes; ++k) sum += exp(static_cast<double>(z[k]) - m);
    const double lse = m + log(sum);
    const int y = labels[n];
    loss += lse - z[y];
    correct += argmax == y ? 1.0 : 0.0;
    if (dlogits) {
      float* d = dlogits + static_cast<std::ptrdiff_t>(n) * classes;
      for (int k = 0; k < classes; ++k) {
        const double p = exp(static_cast<double>(z[k]) - lse);
        d[k] = static_cast<float>((p - (k == y ? 1.0 : 0.0)) * grad_scale);
      }
    }
  }
  loss_part[threadIdx.x] = loss;
  correct_part[threadIdx.x] = correct;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) {
      loss_part[threadIdx.x] += loss_part[threadIdx.x + half];
      correct_part[threadIdx.x] += correct_part[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sums[0] += loss_part[0];
    sums[1] += correct_part[0];
    // Note [Non-finite steps]: a non-finite loss makes the gradient non-finite too
    // (the CPU trainer does the same), so that every rank's reduced gradient shows it.
    if (guard && !isfinite(loss_part[0])) {
      dlogits[0] = CUDART_NAN_F;
      atomicOr(guard, StepGuard::kNonfiniteLoss);
    }
  }
}

// ORs kNonfiniteGradient into *guard when any of g[0, n) is NaN or inf (one atomic per block).
__global__ void finite_check_kernel(const float* __restrict__ g, std::int64_t n, int* __restrict__ guard) {
  int bad = 0;
  MNIST_GRID_LOOP(i, n) bad |= !isfinite(g[i]);
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(guard, StepGuard::kNonfiniteGradient);
}

__global__ void flag_to_float_kernel(const int* __restrict__ guard, float* __restrict__ cell) {
  *cell = (*guard & StepGuard::kNonfiniteGradient) ? CUDART_NAN_F : 0.0f;
}

__global__ void poison_kernel(float* __restrict__ dlogits, int* __restrict__ guard) {
  dlogits[0] = CUDART_NAN_F;
  atomicOr(guard, StepGuard::kNonfiniteLoss);
}

// One block per channel; double partial sums added in a fixed tree order.
__global__ void bias_grad_kernel(const float* __restrict__ dy, int n, int c, std::int64_t plane,
                                 float* __restrict__ db) {
  __shared__ double part[kThreads];
  const int ch = blockIdx.x;
  const std::int64_t per_channel = static_cast<std::int64_t>(n) * plane;
  double acc = 0.0;
  for (std::int64_t k = threadIdx.x; k < per_channel; k += blockDim.x) {
    const std::int64_t img = k / plane, at = k - img * plane;
    acc += dy[(img * c + ch) * plane + at];
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[ch] = static_cast<float>(part[0]);
}

__global__ void bias_add_kernel(float* __restrict__ y, const float* __restrict__ b, int c, std::int64_t plane,
                                std::int64_t total) {
  MNIST_GRID_LOOP(k, total) y[k] += b[(k / plane) % c];
}

__global__ void gather_kernel(const std::uint8_t* __restrict__ images, const std::uint8_t* __restrict__ labels,
                              const std::int64_t* __restrict__ order, const std::int64_t* __restrict__ offset,
                              std::int64_t position, std::int64_t n, std::int64_t pixels, float* __restrict__ x,
                              std::int32_t* __restrict__ labels_out) {
  constexpr float kScale = 1.0f / 255.0f;  // the CPU's conversion, bit for bit
  const std::int64_t at = position + (offset ? *offset : 0);
  MNIST_GRID_LOOP(k, n * pixels) {
    const std::int64_t i = k / pixels, p = k - i * pixels;
    const std::int64_t idx = order ? order[at + i] : at + i;
    x[k] = static_cast<float>(images[idx * pixels + p]) * kScale;
    if (p == 0) labels_out[i] = labels[idx];
  }
}

// Note [The optimiser bit for bit]
// The CPU pass (src/backend/cpu/optimizer.cpp) is compiled without FMA contraction (ISO C++ mode), so each
// multiply and add rounds on its own. nvcc would contract a * b + c into one FMA; the explicit
// round-to-nearest intrinsics below forbid that and keep the CPU's evaluation order, so the GPU
// pass gives the same bits as the CPU one (tests/test_gpu.cpp checks equality, not closeness).
// guard: the flag of Note [Non-finite steps]; no update while it holds kNonfiniteGradient.
// The step's scalars come from the device's step count (DeviceStepState, made by
// count_step_kernel from the same expressions as the host's: include/mnist_mpi/backend/optimizer_pass.hpp).
__global__ void count_step_kernel(DeviceStepState* __restrict__ state, const int* __restrict__ guard, double beta1,
                                  double beta2, const double* __restrict__ lr) {
  if (guard && (*guard & StepGuard::kNonfiniteGradient)) return;  // a skipped step does not count
  state->t += 1;
  state->scalars = optimizer_scalars(beta1, beta2, *lr, state->t);
}

__global__ void adam_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                            float* __restrict__ v, std::int64_t n, float wd, float b1, float one_minus_b1, float b2,
                            float one_minus_b2, const DeviceStepState* __restrict__ state, float eps,
                            const int* __restrict__ guard) {
  if (guard && (*guard & StepGuard::kNonfiniteGradient)) return;
  const float step_size = state->scalars.step_size, inv_sqrt_bc2 = state->scalars.inv_sqrt_bc2;
  MNIST_GRID_LOOP(i, n) {
    const float gi = __fadd_rn(g[i], __fmul_rn(wd, p[i]));
    const float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(one_minus_b1, gi));
    const float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(one_minus_b2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), inv_sqrt_bc2), eps);
    p[i] = __fsub_rn(p[i], __fdiv_rn(__fmul_rn(step_size, mi), denom));
  }
}

__global__ void sgd_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, std::int64_t n,
                           float wd, float mu, bool nesterov, const DeviceStepState* __restrict__ state,
                           const int* __restrict__ guard) {
  if (guard && (*guard & StepGuard::kNonfiniteGradient)) return;
  const float lr = state->scalars.lr;
  MNIST_GRID_LOOP(i, n) {
    float gi = __fadd_rn(g[i], __fmul_rn(wd, p[i]));
    if (mu != 0.0f) {
      const float mi = __fadd_rn(__fmul_rn(mu, m[i]), gi);
      m[i] = mi;
      gi = nesterov ? __fadd_rn(gi, __fmul_rn(mu, mi)) : mi;
    }
    p[i] = __fsub_rn(p[i], __fmul_rn(lr, gi));
  }
}

// LAMB's two phases (Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp), in the
// CPU pass's order of operations (Note [The optimiser bit for bit]). The squares go to the norms
// as in Note [Exact squared norms] (include/mnist_mpi/exact_norm.hpp), whose split of a float
// into a bin and a 62-bit word is repeated here: each word's low 32 bits and high 30 bits are
// added to two 64-bit limbs of its bin, first in the block's shared memory, then once per block
// into the slot's limbs in device memory. Unsigned integer additions: exact in any order, so the
// same sums as the host's whatever the blocks and the atomics' order. A limb takes less than 2^32
// per element, so a slot stays exact up to 2^32 elements a step (DeviceOptimizerPass checks).
__device__ __forceinline__ void add_square_to(unsigned long long* bins, float x) {
  const unsigned b = __float_as_uint(x);
  const unsigned e = (b >> 23) & 0xffu;
  const unsigned long long s = (b & 0x7fffffu) | (e != 0 ? 0x800000u : 0u);
  const unsigned ee = e != 0 ? e : 1u;
  const unsigned long long word = (s * s) << (2 * (ee & 7u));
  unsigned long long* bin = bins + 2 * (ee >> 3);  // kLambNormBins bins of 8 exponents
  atomicAdd(bin, word & 0xffffffffull);
  atomicAdd(bin + 1, word >> 32);
}

__global__ void lamb_direction_kernel(const float* __restrict__ p, float* __restrict__ g, float* __restrict__ m,
                                      float* __restrict__ v, std::int64_t n, float wd, float b1, float one_minus_b1,
                                      float b2, float one_minus_b2, float eps,
                                      const DeviceStepState* __restrict__ state, const int* __restrict__ guard,
                                      unsigned long long* __restrict__ norms) {
  if (guard && (*guard & StepGuard::kNonfiniteGradient)) return;  // the same for every thread
  constexpr int kWords = kLambNormWords;                             // ({w, u}, bin, {low, high})
  __shared__ unsigned long long bins[kWords];
  for (int k = static_cast<int>(threadIdx.x); k < kWords; k += static_cast<int>(blockDim.x)) bins[k] = 0;
  __syncthreads();
  const float inv_bc1 = state->scalars.inv_bc1, inv_sqrt_bc2 = state->scalars.inv_sqrt_bc2;
  MNIST_GRID_LOOP(i, n) {
    const float gi = g[i], pi = p[i];
    const float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(one_minus_b1, gi));
    const float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(one_minus_b2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), inv_sqrt_bc2), eps);
    const float u = __fadd_rn(__fdiv_rn(__fmul_rn(mi, inv_bc1), denom), __fmul_rn(wd, pi));
    g[i] = u;
    if (norms) {
      add_square_to(bins, pi);
      add_square_to(bins + kLambNormWords / 2, u);
    }
  }
  if (!norms) return;
  __syncthreads();
  for (int k = static_cast<int>(threadIdx.x); k < kWords; k += static_cast<int>(blockDim.x))
    if (bins[k] != 0) atomicAdd(norms + k, bins[k]);
}

__global__ void lamb_apply_kernel(float* __restrict__ p, const float* __restrict__ u, std::int64_t n, float rate,
                                  const int* __restrict__ guard) {
  if (guard && (*guard & StepGuard::kNonfiniteGradient)) return;
  MNIST_GRID_LOOP(i, n) p[i] = __fsub_rn(p[i], __fmul_rn(rate, u[i]));
}

__global__ void add_kernel(float* __restrict__ dst, const float* __restrict__ src, std::int64_t n) {
  MNIST_GRID_LOOP(i, n) dst[i] = __fadd_rn(dst[i], src[i]);
}

__global__ void fill_kernel(float* __restrict__ dst, float value, std::int64_t n) {
  MNIST_GRID_LOOP(i, n) dst[i] = value;
}

__global__ void mul_kernel(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                           std::int64_t n) {
  MNIST_GRID_LOOP(i, n) out[i] = __fmul_rn(a[i], b[i]);
}

// Note [The ReLU, bit for bit]
// oneDNN's ReLU (on AVX2 and AVX-512 alike) is y = x > 0 ? x : +0 (a NaN gives +0, a denormal
// passes) and dx = dy * (x <= 0 ? 0 : 1): a negative dy where x <= 0 gives -0, and a NaN x passes
// dy. cuDNN's backward gives +0 there (the first GPU run found 77 of 300 elements differing in the
// sign of a zero), so the GPU has its own kernels, with the CPU's bits for every input
// (tests/test_gpu.cpp, ReluMatchesCpu and ReluEdgeCasesMatchCpu).
__global__ void relu_forward_kernel(const float* __restrict__ x, float* __restrict__ y, std::int64_t n) {
  MNIST_GRID_LOOP(i, n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

__global__ void relu_backward_kernel(const float* __restrict__ x, const float* __restrict__ dy, float* __restrict__ dx,
                                     std::int64_t n) {
  MNIST_GRID_LOOP(i, n) dx[i] = __fmul_rn(dy[i], x[i] <= 0.0f ? 0.0f : 1.0f);
}

__global__ void pad_kernel(const float* __restrict__ src, float* __restrict__ dst, std::int64_t nc, int h, int w,
                           int top, int left, int ph, int pw) {
  MNIST_GRID_LOOP(k, nc * ph * pw) {
    const std::int64_t plane = k / (static_cast<std::int64_t>(ph) * pw);
    const int at = static_cast<int>(k - plane * ph * pw);
    const int i = at / pw - top, j = at % pw - left;
    dst[k] = (i >= 0 && i < h && j >= 0 && j < w) ? src[(plane * h + i) * w + j] : 0.0f;
  }
}

__global__ void crop_kernel(const float* __restrict__ src, float* __restrict__ dst, std::int64_t nc, int h, int w,
                            int top, int left, int ph, int pw) {
  MNIST_GRID_LOOP(k, nc * h * w) {
    const std::int64_t plane = k / (static_cast<std::int64_t>(h) * w);
    const int at = static_cast<int>(k - plane * h * w);
    const int i = at / w + top, j = at % w + left;
    dst[k] = src[(plane * ph + i) * pw + j];
  }
}

__global__ void dropout_kernel(const float* __restrict__ x, float* __restrict__ y, float* __restrict__ scale,
                               std::int64_t total, std::int64_t per_sample, std::uint64_t seed,
                               const std::int64_t* __restrict__ step_at, std::int64_t first_sample, int layer,
                               float rate, float keep_scale) {
  const std::int64_t step = *step_at;
  MNIST_GRID_LOOP(k, total) {
    const std::int64_t n = k / per_sample, i = k - n * per_sample;
    const std::uint64_t key = rng::dropout_key(seed, step, first_sample + n, layer);
    const float s = rng::dropout_scale(key, i, rate, keep_scale);
    scale[k] = s;
    y[k] = __fmul_rn(x[k], s);
  }
}

}  // namespace

void launch_softmax_xent(cudaStream_t s, const float* logits, const std::int32_t* labels, int batch, int classes,
                         float* dlogits, float grad_scale, double* sums, int* guard) {
  softmax_xent_kernel<<<1, kThreads, 0, s>>>(logits, labels, batch, classes, dlogits, grad_scale, sums,
                                             dlogits ? guard : nullptr);
  CUDA_CHECK_LAUNCH(softmax_xent_kernel);
}

void launch_finite_check(cudaStream_t s, const float* g, std::int64_t n, int* guard) {
  if (n <= 0) return;
  finite_check_kernel<<<blocks_for(n), kThreads, 0, s>>>(g, n, guard);
  CUDA_CHECK_LAUNCH(finite_check_kernel);
}

void launch_flag_to_float(cudaStream_t s, const int* guard, float* cell) {
  flag_to_float_kernel<<<1, 1, 0, s>>>(guard, cell);
  CUDA_CHECK_LAUNCH(flag_to_float_kernel);
}

void launch_poison(cudaStream_t s, float* dlogits, int* guard) {
  poison_kernel<<<1, 1, 0, s>>>(dlogits, guard);
  CUDA_CHECK_LAUNCH(poison_kernel);
}

void launch_bias_grad(cudaStream_t s, const float* dy, int n, int c, std::int64_t plane, float* db) {
  bias_grad_kernel<<<static_cast<unsigned>(c), kThreads, 0, s>>>(dy, n, c, plane, db);
  CUDA_CHECK_LAUNCH(bias_grad_kernel);
}

void launch_bias_add(cudaStream_t s, float* y, const float* b, int n, int c, std::int64_t plane) {
  const std::int64_t total = static_cast<std::int64_t>(n) * c * plane;
  bias_add_kernel<<<blocks_for(total), kThreads, 0, s>>>(y, b, c, plane, total);
  CUDA_CHECK_LAUNCH(bias_add_kernel);
}

void launch_gather(cudaStream_t s, const std::uint8_t* images, const std::uint8_t* labels, const std::int64_t* order,
                   const std::int64_t* offset, std::int64_t position, std::int64_t n, std::int64_t pixels, float* x,
                   std::int32_t* labels_out) {
  gather_kernel<<<blocks_for(n * pixels), kThreads, 0, s>>>(images, labels, order, offset, position, n, pixels, x,
                                                            labels_out);
  CUDA_CHECK_LAUNCH(gather_kernel);
}

void launch_count_step(cudaStream_t s, DeviceStepState* state, const int* guard, double beta1, double beta2,
                       const double* lr) {
  count_step_kernel<<<1, 1, 0, s>>>(state, guard, beta1, beta2, lr);
  CUDA_CHECK_LAUNCH(count_step_kernel);
}

void launch_optimizer(cudaStream_t s, const OptimizerConfig& cfg, const DeviceStepState* state, float* p,
                      const float* g, float* m, float* v, std::int64_t n, const int* guard) {
  const float wd = static_cast<float>(cfg.weight_decay);  // as the CPU pass computes them
  if (cfg.kind == OptimizerKind::kAdam) {
    const float b1 = static_cast<float>(cfg.beta1), b2 = static_cast<float>(cfg.beta2);
    const float eps = static_cast<float>(cfg.eps);
    adam_kernel<<<blocks_for(n), kThreads, 0, s>>>(p, g, m, v, n, wd, b1, 1.0f - b1, b2, 1.0f - b2, state, eps, guard);
    CUDA_CHECK_LAUNCH(adam_kernel);
  } else {
    sgd_kernel<<<blocks_for(n), kThreads, 0, s>>>(p, g, m, n, wd, static_cast<float>(cfg.momentum), cfg.nesterov, state,
                                                  guard);
    CUDA_CHECK_LAUNCH(sgd_kernel);
  }
}

void launch_lamb_direction(cudaStream_t s, const OptimizerConfig& cfg, const DeviceStepState* state, const float* p,
                           float* g, float* m, float* v, std::int64_t n, const int* guard,
                           unsigned long long* norms) {
  if (n <= 0) return;
  const float b1 = static_cast<float>(cfg.beta1), b2 = static_cast<float>(cfg.beta2);  // as the CPU pass
  lamb_direction_kernel<<<blocks_for(n), kThreads, 0, s>>>(p, g, m, v, n, static_cast<float>(cfg.weight_decay), b1,
                                                           1.0f - b1, b2, 1.0f - b2, static_cast<float>(cfg.eps),
                                                           state, guard, norms);
  CUDA_CHECK_LAUNCH(lamb_direction_kernel);
}

void launch_lamb_apply(cudaStream_t s, float* p, const float* u, std::int64_t n, float rate, const int* guard) {
  if (n <= 0) return;
  lamb_apply_kernel<<<blocks_for(n), kThreads, 0, s>>>(p, u, n, rate, guard);
  CUDA_CHECK_LAUNCH(lamb_apply_kernel);
}

void launch_add(cudaStream_t s, float* dst, const float* src, std::int64_t n) {
  add_kernel<<<blocks_for(n), kThreads, 0, s>>>(dst, src, n);
  CUDA_CHECK_LAUNCH(add_kernel);
}

void launch_fill(cudaStream_t s, float* dst, float value, std::int64_t n) {
  fill_kernel<<<blocks_for(n), kThreads, 0, s>>>(dst, value, n);
  CUDA_CHECK_LAUNCH(fill_kernel);
}

namespace {
__global__ void scale_kernel(float* x, float a, std::int64_t n) {
  MNIST_GRID_LOOP(i, n) { x[i] = __fmul_rn(x[i], a); }
}
}  // namespace

void launch_scale(cudaStream_t s, float* x, float a, std::int64_t n) {
  if (n <= 0) return;
  scale_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, a, n);
  CUDA_CHECK_LAUNCH(scale_kernel);
}

void launch_mul(cudaStream_t s, const float* a, const float* b, float* out, std::int64_t n) {
  mul_kernel<<<blocks_for(n), kThreads, 0, s>>>(a, b, out, n);
  CUDA_CHECK_LAUNCH(mul_kernel);
}

void launch_relu_forward(cudaStream_t s, const float* x, float* y, std::int64_t n) {
  if (n <= 0) return;
  relu_forward_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
  CUDA_CHECK_LAUNCH(relu_forward_kernel);
}

void launch_relu_backward(cudaStream_t s, const float* x, const float* dy, float* dx, std::int64_t n) {
  if (n <= 0) return;
  relu_backward_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, dy, dx, n);
  CUDA_CHECK_LAUNCH(relu_backward_kernel);
}

namespace {
__global__ void to_bf16_kernel(const float* x, __nv_bfloat16* y, std::int64_t n) {
  MNIST_GRID_LOOP(i, n) { y[i] = __float2bfloat16_rn(x[i]); }
}
__global__ void from_bf16_kernel(const __nv_bfloat16* x, float* y, std::int64_t n) {
  MNIST_GRID_LOOP(i, n) { y[i] = __bfloat162float(x[i]); }
}
}  // namespace

void launch_to_bf16(cudaStream_t s, const float* x, std::uint16_t* y, std::int64_t n) {
  if (n <= 0) return;
  to_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, reinterpret_cast<__nv_bfloat16*>(y), n);
  CUDA_CHECK_LAUNCH(to_bf16_kernel);
}

void launch_from_bf16(cudaStream_t s, const std::uint16_t* x, float* y, std::int64_t n) {
  if (n <= 0) return;
  from_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(reinterpret_cast<const __nv_bfloat16*>(x), y, n);
  CUDA_CHECK_LAUNCH(from_bf16_kernel);
}

// Note [Fixed point on a GPU]
// --exact-sums's conversions (include/mnist_mpi/backend/fixed_point.hpp) give the host loops' bits
// (src/backend/fixed_point.cpp): x * 2^shift is exact in double, and __double2ll_rn rounds it to
// nearest, ties to even, as the host's addition of 1.5 * 2^52 does for |v| < 2^51 (Note [Fixed
// point without a conversion instruction] in include/mnist_mpi/exact_sum.hpp); back, __ll2double_rn
// is the correctly rounded int64 -> double of the host's split conversion, the product with 2^-shift
// is exact, and __double2float_rn is the host's rounding to float (no flush to zero: the module is
// built with --ftz=false). The additions wrap around in unsigned arithmetic, as on the host. Each
// thread counts its values out of range and non-finite and adds its counts with one atomic each
// (exact: integers); a block's largest magnitude goes to its slot with one atomicMax (of bits,
// which order like the magnitudes). tests/test_gpu.cpp compares both with the host passes.
namespace {
constexpr unsigned kWarps = kThreads / 32;

// The largest of every thread's m into *slot (every thread of the block calls it).
__device__ void block_max_to(unsigned m, unsigned* slot) {
  __shared__ unsigned warp_max[kWarps];
  for (int o = 16; o > 0; o /= 2) m = max(m, __shfl_down_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31u) == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned b = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) b = max(b, warp_max[w]);
    if (b != 0) atomicMax(slot, b);
  }
}

__global__ void to_fixed_kernel(const float* __restrict__ g, long long* __restrict__ q, std::int64_t n, double scale,
                                float bound, bool assign, unsigned long long* __restrict__ counters) {
  unsigned long long beyond = 0, nonfinite = 0;
  MNIST_GRID_LOOP(i, n) {
    const float x = g[i];
    const long long v = __double2ll_rn(__dmul_rn(static_cast<double>(x), scale));
    q[i] =
        assign ? v : static_cast<long long>(static_cast<unsigned long long>(q[i]) + static_cast<unsigned long long>(v));
    const float a = fabsf(x);
    const bool finite = a <= 3.402823466e38f;  // FLT_MAX; false for NaN
    beyond += !(a < bound) && finite;
    nonfinite += !finite;
  }
  if (beyond) atomicAdd(counters, beyond);
  if (nonfinite) atomicAdd(counters + 1, nonfinite);
}

__global__ void max_finite_magnitude_kernel(const float* __restrict__ g, std::int64_t n, unsigned* __restrict__ slot) {
  unsigned m = 0;
  MNIST_GRID_LOOP(i, n) {
    const unsigned a = __float_as_uint(g[i]) & 0x7fffffffu;
    m = max(m, a < 0x7f800000u ? a : 0u);  // NaN and inf count as 0
  }
  block_max_to(m, slot);
}

__global__ void from_fixed_kernel(const long long* __restrict__ q, float* __restrict__ g, std::int64_t n,
                                  double unscale, unsigned* __restrict__ slot) {
  unsigned m = 0;
  MNIST_GRID_LOOP(i, n) {
    const float v = __double2float_rn(__dmul_rn(__ll2double_rn(q[i]), unscale));
    g[i] = v;
    m = max(m, __float_as_uint(v) & 0x7fffffffu);
  }
  block_max_to(m, slot);
}
}  // namespace

void launch_to_fixed(cudaStream_t s, const float* g, std::int64_t* q, std::int64_t n, double scale, float bound,
                     bool assign, std::int64_t* counters) {
  if (n <= 0) return;
  static_assert(sizeof(long long) == sizeof(std::int64_t));
  to_fixed_kernel<<<blocks_for(n), kThreads, 0, s>>>(g, reinterpret_cast<long long*>(q), n, scale, bound, assign,
                                                     reinterpret_cast<unsigned long long*>(counters));
  CUDA_CHECK_LAUNCH(to_fixed_kernel);
}

void launch_max_finite_magnitude(cudaStream_t s, const float* g, std::int64_t n, std::uint32_t* slot) {
  if (n <= 0) return;
  max_finite_magnitude_kernel<<<blocks_for(n), kThreads, 0, s>>>(g, n, slot);
  CUDA_CHECK_LAUNCH(max_finite_magnitude_kernel);
}

void launch_from_fixed(cudaStream_t s, const std::int64_t* q, float* g, std::int64_t n, double unscale,
                       std::uint32_t* slot) {
  if (n <= 0) return;
  from_fixed_kernel<<<blocks_for(n), kThreads, 0, s>>>(reinterpret_cast<const long long*>(q), g, n, unscale, slot);
  CUDA_CHECK_LAUNCH(from_fixed_kernel);
}

void launch_pad(cudaStream_t s, const float* src, float* dst, int nc, int h, int w, int top, int left, int ph, int pw) {
  const std::int64_t total = static_cast<std::int64_t>(nc) * ph * pw;
  pad_kernel<<<blocks_for(total), kThreads, 0, s>>>(src, dst, nc, h, w, top, left, ph, pw);
  CUDA_CHECK_LAUNCH(pad_kernel);
}

void launch_crop(cudaStream_t s, const float* src, float* dst, int nc, int h, int w, int top, int left, int ph,
                 int pw) {
  const std::int64_t total = static_cast<std::int64_t>(nc) * h * w;
  crop_kernel<<<blocks_for(total), kThreads, 0, s>>>(src, dst, nc, h, w, top, left, ph, pw);
  CUDA_CHECK_LAUNCH(crop_kernel);
}

void launch_dropout_forward(cudaStream_t s, const float* x, float* y, float* scale, int batch, std::int64_t per_sample,
                            std::uint64_t seed, const std::int64_t* step, std::int64_t first_sample, int layer,
                            float rate) {
  const float keep_scale = 1.0f / (1.0f - rate);  // as the CPU computes it
  const std::int64_t total = static_cast<std::int64_t>(batch) * per_sample;
  dropout_kernel<<<blocks_for(total), kThreads, 0, s>>>(x, y, scale, total, per_sample, seed, step, first_sample, layer,
                                                        rate, keep_scale);
  CUDA_CHECK_LAUNCH(dropout_kernel);
}


// ---- Batch norm (src/backend/cuda/batchnorm.cpp): one block per channel, sums in double reduced
// ---- in a fixed tree, so a channel's statistics are the same bits on every run.
namespace {
// The sum of v over the block's threads (kThreads, a power of two), in every thread.
__device__ double block_sum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();
  return total;
}

// Element i of channel c's values: sample i / plane, position i % plane (NCHW).
__device__ std::int64_t bn_at(std::int64_t i, int c, int channels, std::int64_t plane) {
  return ((i / plane) * channels + c) * plane + i % plane;
}

__global__ void bn_forward_train_kernel(const float* x, float* y, const float* scale, const float* shift,
                                        float* running, float* mean_out, float* inv_std_out, int batch, int channels,
                                        std::int64_t plane, double momentum, double eps) {
  __shared__ double shared[kThreads];
  const int c = blockIdx.x;
  const std::int64_t m = static_cast<std::int64_t>(batch) * plane;
  double sum = 0.0;
  for (std::int64_t i = threadIdx.x; i < m; i += kThreads) sum += x[bn_at(i, c, channels, plane)];
  const double mu = block_sum(sum, shared) / static_cast<double>(m);
  double sq = 0.0;
  for (std::int64_t i = threadIdx.x; i < m; i += kThreads) {
    const double d = x[bn_at(i, c, channels, plane)] - mu;
    sq += d * d;
  }
  const double total_sq = block_sum(sq, shared);
  const double biased = total_sq / static_cast<double>(m);
  const float mean = static_cast<float>(mu), var = static_cast<float>(biased);
  const float inv_std = static_cast<float>(1.0 / sqrt(static_cast<double>(var) + eps));
  if (threadIdx.x == 0) {
    const double unbiased = m > 1 ? total_sq / static_cast<double>(m - 1) : biased;
    running[c] = static_cast<float>((1.0 - momentum) * running[c] + momentum * mu);
    running[channels + c] = static_cast<float>((1.0 - momentum) * running[channels + c] + momentum * unbiased);
    mean_out[c] = mean;
    inv_std_out[c] = inv_std;
  }
  const float a = __fmul_rn(scale[c], inv_std), b = __fsub_rn(shift[c], __fmul_rn(mean, a));
  for (std::int64_t i = threadIdx.x; i < m; i += kThreads) {
    const std::int64_t at = bn_at(i, c, channels, plane);
    y[at] = __fadd_rn(__fmul_rn(x[at], a), b);
  }
}

__global__ void bn_forward_infer_kernel(const float* x, float* y, const float* scale, const float* shift,
                                        const float* running, int channels, std::int64_t plane, std::int64_t n,
                                        double eps) {
  MNIST_GRID_LOOP(k, n) {
    const int c = static_cast<int>((k / plane) % channels);
    const float inv_std = static_cast<float>(1.0 / sqrt(static_cast<double>(running[channels + c]) + eps));
    const float a = __fmul_rn(scale[c], inv_std), b = __fsub_rn(shift[c], __fmul_rn(running[c], a));
    y[k] = __fadd_rn(__fmul_rn(x[k], a), b);
  }
}

__global__ void bn_backward_kernel(const float* x, const float* dy, float* dx, const float* scale, const float* mean_in,
                                   const float* inv_std_in, float* dscale, float* dshift, int batch, int channels,
                                   std::int64_t plane) {
  __shared__ double shared[kThreads];
  const int c = blockIdx.x;
  const std::int64_t m = static_cast<std::int64_t>(batch) * plane;
  const float mean = mean_in[c], inv_std = inv_std_in[c];
  double ds = 0.0, dsc = 0.0;
  for (std::int64_t i = threadIdx.x; i < m; i += kThreads) {
    const std::int64_t at = bn_at(i, c, channels, plane);
    ds += dy[at];
    dsc += static_cast<double>(dy[at]) * __fmul_rn(__fsub_rn(x[at], mean), inv_std);
  }
  const double sum_dy = block_sum(ds, shared), sum_dy_xhat = block_sum(dsc, shared);
  if (threadIdx.x == 0) {
    dscale[c] = static_cast<float>(sum_dy_xhat);
    dshift[c] = static_cast<float>(sum_dy);
  }
  if (!dx) return;
  const float k = static_cast<float>(scale[c] * inv_std / static_cast<double>(m));
  const float fm = static_cast<float>(m), a = static_cast<float>(sum_dy), b = static_cast<float>(sum_dy_xhat);
  for (std::int64_t i = threadIdx.x; i < m; i += kThreads) {
    const std::int64_t at = bn_at(i, c, channels, plane);
    const float x_hat = __fmul_rn(__fsub_rn(x[at], mean), inv_std);
    dx[at] = __fmul_rn(k, __fsub_rn(__fsub_rn(__fmul_rn(fm, dy[at]), a), __fmul_rn(x_hat, b)));
  }
}
}  // namespace

void launch_batchnorm_forward_train(cudaStream_t s, const float* x, float* y, const float* scale, const float* shift,
                                    float* running, float* mean, float* inv_std, int batch, int channels,
                                    std::int64_t plane, double momentum, double eps) {
  bn_forward_train_kernel<<<channels, kThreads, 0, s>>>(x, y, scale, shift, running, mean, inv_std, batch, channels,
                                                        plane, momentum, eps);
  CUDA_CHECK_LAUNCH(bn_forward_train_kernel);
}

void launch_batchnorm_forward_infer(cudaStream_t s, const float* x, float* y, const float* scale, const float* shift,
                                    const float* running, int batch, int channels, std::int64_t plane, double eps) {
  const std::int64_t n = static_cast<std::int64_t>(batch) * channels * plane;
  if (n <= 0) return;
  bn_forward_infer_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, scale, shift, running, channels, plane, n, eps);
  CUDA_CHECK_LAUNCH(bn_forward_infer_kernel);
}

void launch_batchnorm_backward(cudaStream_t s, const float* x, const float* dy, float* dx, const float* scale,
                               const float* mean, const float* inv_std, float* dscale, float* dshift, int batch,
                               int channels, std::int64_t plane) {
  bn_backward_kernel<<<channels, kThreads, 0, s>>>(x, dy, dx, scale, mean, inv_std, dscale, dshift, batch, channels,
                                                   plane);
  CUDA_CHECK_LAUNCH(bn_backward_kernel);
}

}  // namespace mnist_mpi::cuda
