// The optimiser as a backend runs it: one fused pass over a range of the flat buffers (SGD with
// momentum / Nesterov, Adam with PyTorch's bias correction, L2 weight decay; LAMB's two phases,
// Note [LAMB in two phases]) and the step count t
// it depends on, behind one interface each backend implements beside its kernels (the CPU's in
// src/backend/cpu/optimizer.cpp, the GPU's in src/backend/cuda/), and the per-step scalars (Adam's
// step size and bias correction, SGD's rate) computed from t and the learning rate by the same
// IEEE operations on the host and on a GPU. The optimiser of the training loop
// (include/mnist_mpi/train/optimizer.hpp) owns the state buffers and the shards and calls this.
// Compiled by g++ and by nvcc: on the device, the explicit round-to-nearest intrinsics keep nvcc
// from contracting a multiply and an add into one FMA, as -ffp-contract=off (CMakeLists.txt) keeps
// g++ from it.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>

#include "mnist_mpi/config/optimizer_config.hpp"

#ifdef __CUDACC__
#define MNIST_HOST_DEVICE __host__ __device__
#else
#define MNIST_HOST_DEVICE
#endif

namespace mnist_mpi {

class ParameterStore;

struct OptimizerScalars {
  float step_size = 0.0f;     // Adam: lr / (1 - beta1^t)
  float inv_sqrt_bc2 = 0.0f;  // Adam, LAMB: 1 / sqrt(1 - beta2^t)
  float inv_bc1 = 0.0f;       // LAMB: 1 / (1 - beta1^t) (its rate is applied in the second phase)
  float lr = 0.0f;            // SGD
};

namespace scalars_detail {
MNIST_HOST_DEVICE inline double mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
MNIST_HOST_DEVICE inline double div(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
MNIST_HOST_DEVICE inline double sqrt_rn(double a) {
#ifdef __CUDA_ARCH__
  return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
}  // namespace scalars_detail

// beta^t for t >= 0 by binary powering: the same bits wherever it runs, unlike the math
// libraries' pow (glibc's and CUDA's may differ in the last place).
MNIST_HOST_DEVICE inline double beta_power(double beta, std::int64_t t) {
  double result = 1.0, base = beta;
  for (; t > 0; t >>= 1) {
    if (t & 1) result = scalars_detail::mul(result, base);
    base = scalars_detail::mul(base, base);
  }
  return result;
}

// Step t (1-based) with learning rate lr, PyTorch's bias correction in double.
MNIST_HOST_DEVICE inline OptimizerScalars optimizer_scalars(double beta1, double beta2, double lr, std::int64_t t) {
  OptimizerScalars s;
  const double bc1 = 1.0 - beta_power(beta1, t), bc2 = 1.0 - beta_power(beta2, t);
  s.step_size = static_cast<float>(scalars_detail::div(lr, bc1));
  s.inv_sqrt_bc2 = static_cast<float>(scalars_detail::div(1.0, scalars_detail::sqrt_rn(bc2)));
  s.inv_bc1 = static_cast<float>(scalars_detail::div(1.0, bc1));
  s.lr = static_cast<float>(lr);
  return s;
}

// Note [The optimiser's step count]
// Adam's bias corrections depend on t, the number of steps applied so far. A step that the guard
// skips (Note [Non-finite steps] in include/mnist_mpi/backend/step_guard.hpp) must not count: on the
// CPU the step never calls begin_step, but on a device only the device knows in time whether a
// step was skipped. So the count lives with the backend's pass: begin_step counts the step unless
// the guard refuses it, and computes the step's scalars (above) where the pass reads them; on a
// device both happen in a one-thread kernel that reads the guard's flag. The scalars are computed
// by the same IEEE operations on the host and on a device, so both passes give the same bits
// (tests/test_gpu.cpp, OptimizerEqualsCpuBitForBit). read() is a synchronisation on a device:
// checkpoints ask for it, the step loop never does.
class OptimizerPass {
 public:
  virtual ~OptimizerPass() = default;
  // The step about to be applied, with learning rate lr: t += 1 unless the guard refused the step.
  virtual void begin_step(double lr) = 0;
  virtual std::int64_t read() = 0;       // t
  virtual void set(std::int64_t t) = 0;  // a checkpoint's count
  // params -= update(grads) over n elements at the begun step, with the moments m and v (v unused
  // by sgd); every pointer in the backend's memory. A pass made with a parameter store writes
  // parameters of that store and reports what it wrote to it (Note [The parameters and their
  // copies] in include/mnist_mpi/backend/parameter_store.hpp).
  virtual void update(float* params, const float* grads, float* m, float* v, std::int64_t n) = 0;

  // LAMB's two phases (Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp); the
  // optimiser calls these instead of update() for a kind whose traits say two_phase.
  // Room for `slots` tensors' squared norms (each: ||w||^2 and ||u||^2), all zero.
  virtual void set_norm_slots(std::int64_t slots) = 0;
  // The first phase over n elements at the begun step: the moments m and v, and the direction
  // u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w written over grads; with slot >= 0, the
  // squares of the n parameters and of the n directions added to that slot's sums (Note [Exact
  // squared norms] in include/mnist_mpi/exact_norm.hpp). The parameters are not changed.
  virtual void direction(const float* params, float* grads, float* m, float* v, std::int64_t n, std::int64_t slot) = 0;
  // Adds every slot's sums since the last call to limbs (slots x {w, u} x kNormWords int64, in
  // host memory) and sets them to zero. A synchronisation on a device.
  virtual void take_norms(std::span<std::int64_t> limbs) = 0;
  // The second phase: params -= rate * u over n elements (rate = lr * the tensor's trust ratio,
  // the same float on every backend), reported as update()'s.
  virtual void apply_direction(float* params, const float* u, std::int64_t n, float rate) = 0;
};

#ifndef __CUDACC__
// The CPU's pass on host memory (src/backend/cpu/optimizer.cpp): the CPU backend's, and that of an
// optimiser made without a backend (tests, benchmarks). With a store, it writes the plain bf16
// images of the parameters it updates in the same loop (Note [Weight copies kept between passes]
// in src/backend/cpu/bf16.cpp).
std::unique_ptr<OptimizerPass> make_host_optimizer_pass(const OptimizerConfig& cfg, ParameterStore* store = nullptr);
#endif

}  // namespace mnist_mpi
