// The per-step scalars of the fused optimiser pass (Adam's step size and bias correction, SGD's
// rate), computed from the step count t and the learning rate by the same IEEE operations on the
// host and on a GPU (Note [The optimiser's step count] in include/mnist_mpi/backend/backend.hpp).
// Compiled by g++ and by nvcc: on the device, the explicit round-to-nearest intrinsics keep nvcc
// from contracting a multiply and an add into one FMA, as -ffp-contract=off (CMakeLists.txt) keeps
// g++ from it.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MNIST_HOST_DEVICE __host__ __device__
#else
#define MNIST_HOST_DEVICE
#endif

namespace mnist_mpi {

struct OptimizerScalars {
  float step_size = 0.0f;     // Adam: lr / (1 - beta1^t)
  float inv_sqrt_bc2 = 0.0f;  // Adam: 1 / sqrt(1 - beta2^t)
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
  s.lr = static_cast<float>(lr);
  return s;
}

}  // namespace mnist_mpi
