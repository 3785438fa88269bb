// Shared pieces of the CUDA backend: the per-rank context (device, compute stream, cuDNN and
// cuBLAS handles bound to it, the math mode), an owned device allocation, cuDNN descriptor
// holders, the layer factories (one file per layer kind, as in src/backend/cpu/), the gradient
// communicators (src/backend/cuda/nccl_communicator.cpp) and the launchers of our own kernels
// (src/backend/cuda/kernels.cu). Only the CUDA backend's own files include this.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/device.hpp"  // GpuPrecision
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/watchdog.hpp"  // DeviceWaitPolicy

namespace mnist_mpi::cuda {

// Note [One compute stream]
// Every kernel, cuDNN and cuBLAS call of a rank runs in order on ONE non-blocking stream, so
// layer after layer needs no events and the host never waits inside a step. The NCCL
// communicator adds a second stream for the gradient buckets and orders it against this one with
// events (Note [Buckets on the communication stream] in src/backend/cuda/nccl_communicator.cpp).
// The host waits only where it reads a value: wait_for_event() polls an event, with NCCL's
// asynchronous error check between polls and --collective-timeout as its deadline (Note [Device
// waits have a deadline] in include/mnist_mpi/comm/watchdog.hpp), so a failed or stalled
// collective can't hang a rank.
// Note [A step as one CUDA graph] (include/mnist_mpi/backend/backend.hpp): what changes from one
// training step to the next, in device memory, so that one captured graph replays every step. The
// kernels of a training step read these, graph or not: the same kernels, the same bits.
struct DeviceStepArgs {
  std::int64_t step = 0;  // the dropout key's step
  std::int64_t batch_offset =
      0;            // (step mod steps per epoch) x global batch: the gathers read order[offset + first + i]
  double lr = 0.0;  // the optimiser's step count computes the step's scalars from it
};

// The algorithms of one convolution's three directions (cuDNN's enums; -1: none), as rank 0 timed
// them for --conv-algos measured (Note [Choosing cuDNN algorithms] in conv.cpp).
struct MeasuredConv {
  int fwd = -1, bwd_data = -1, bwd_filter = -1;
};

struct Context {
  int device = 0;
  bool tf32 = false;
  bool bf16 = false;  // Note [bf16 on the GPU] in src/backend/cuda/cuda_backend.cpp
  // --conv-algos measured (Note [Choosing cuDNN algorithms] in conv.cpp): each training
  // convolution's way to take rank 0's choice once built, by layer index (registered while it lives).
  std::map<int, std::function<void(const MeasuredConv&)>> retune;
  cudaStream_t stream = nullptr;
  cudnnHandle_t cudnn = nullptr;
  cublasHandle_t cublas = nullptr;
  cudaEvent_t sync_event = nullptr;           // recorded by wait_for_stream()
  DeviceWaitPolicy wait;                      // timeout from the backend; check and abort from the NCCL communicator
  const DeviceStepArgs* step_args = nullptr;  // device memory: this training step's values
  DeviceStepArgs host_args;                   // the host's copy of the values last queued

  void wait_for_stream();              // returns once everything queued on `stream` has finished
  void wait_for_event(cudaEvent_t e);  // returns once e has completed (polling, with the hook)
};

// An owned device allocation (cudaMalloc at build, cudaFree at destruction).
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::int64_t n) : n_(n) {
    if (n <= 0) return;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), static_cast<std::size_t>(n) * sizeof(T)));
    // cudaMemset runs on the legacy default stream, which our non-blocking streams do not wait
    // for: finish it here (allocation happens only at build, never in the step loop).
    CUDA_CHECK(cudaMemset(p_, 0, static_cast<std::size_t>(n) * sizeof(T)));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~DeviceArray() {
    if (p_) cudaFree(p_);  // no check: a destructor must not throw
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  T* get() const { return p_; }
  std::int64_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  std::int64_t n_ = 0;
};

// cuDNN descriptors, destroyed with their owner.
struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  TensorDesc() { CUDNN_CHECK(cudnnCreateTensorDescriptor(&d)); }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  void set(int n, int c, int h, int w, cudnnDataType_t type = CUDNN_DATA_FLOAT) {  // (N, C, H, W), fully packed
    CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, type, n, c, h, w));
  }
};

// The gradient communicators the backend makes (Backend::make_gradient_communicator), in
// src/backend/cuda/nccl_communicator.cpp; both pass host collectives to `host` and must be
// destroyed before the backend. NCCL on c's GPU, its buckets ordered against c's compute stream;
// it sets c's wait hook to its asynchronous error check.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, Context& c);
// Ranks sharing a GPU: float collectives of at most `capacity` elements copied to host memory
// through `backend` and summed by `host`.
// Its int64 sums (--exact-sums: integer_sums, capacity + 2 of them) are staged through c's stream
// the same way.
std::unique_ptr<Communicator> make_staged_communicator(Communicator& host, Backend& backend, Context& c,
                                                       std::int64_t capacity, bool integer_sums);

// Layer factories (one file each).
std::unique_ptr<LayerKernel> make_conv(Context& c, const LayerSpec& l, int index, const LayerBuffers& b, bool training);
// Times every algorithm of each direction of layer l at this batch (cudnnFind*) and returns the
// fastest deterministic one within the workspace cap; the time of each in ms (for the banner).
MeasuredConv measure_conv(Context& c, const LayerSpec& l, int batch, bool needs_dx, double ms[3]);
std::unique_ptr<LayerKernel> make_fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training);
std::unique_ptr<LayerKernel> make_maxpool(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training);
std::unique_ptr<LayerKernel> make_relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training);
std::unique_ptr<LayerKernel> make_dropout(Context& c, const LayerSpec& l, int index, const LayerBuffers& b,
                                          bool training);
std::unique_ptr<LayerKernel> make_flatten(Context& c, const LayerSpec& l, const LayerBuffers& b);
std::unique_ptr<LayerKernel> make_batchnorm(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training);

// Launchers of our kernels (src/backend/cuda/kernels.cu), all on `s`, all checked.
// Adds per-row loss and correct counts into sums (double loss_sum, then correct as a double).
// With dlogits and guard: a non-finite loss sets dlogits[0] = NaN and ORs kNonfiniteLoss into
// *guard (Note [Non-finite steps] in include/mnist_mpi/backend/step_guard.hpp).
void launch_softmax_xent(cudaStream_t s, const float* logits, const std::int32_t* labels, int batch, int classes,
                         float* dlogits, float grad_scale, double* sums, int* guard);
// *guard |= kNonfiniteGradient when any of g[0, n) is NaN or inf.
void launch_finite_check(cudaStream_t s, const float* g, std::int64_t n, int* guard);
// *cell = NaN when *guard holds kNonfiniteGradient, else 0 (StepGuard::agree sums the cells).
void launch_flag_to_float(cudaStream_t s, const int* guard, float* cell);
// dlogits[0] = NaN and *guard |= kNonfiniteLoss (the testing hook of MNIST_MPI_FAULT=...:nan).
void launch_poison(cudaStream_t s, float* dlogits, int* guard);
// db[c] = sum over n and the plane of dy (N, C, plane), in a fixed order (deterministic).
void launch_bias_grad(cudaStream_t s, const float* dy, int n, int c, std::int64_t plane, float* db);
// y (N, C, plane) += b[c].
void launch_bias_add(cudaStream_t s, float* y, const float* b, int n, int c, std::int64_t plane);
// x[i] = images[idx[i]] / 255 and labels_out[i] = labels[idx[i]], idx = order[*offset + position + i]
// (offset in device memory, DeviceStepArgs::batch_offset; order null: idx = position + i).
void launch_gather(cudaStream_t s, const std::uint8_t* images, const std::uint8_t* labels, const std::int64_t* order,
                   const std::int64_t* offset, std::int64_t position, std::int64_t n, std::int64_t pixels, float* x,
                   std::int32_t* labels_out);
// The optimiser's step count on the device (Note [The optimiser's step count] in
// include/mnist_mpi/backend/optimizer_pass.hpp): t and the scalars of the step it last counted.
struct DeviceStepState {
  std::int64_t t = 0;
  OptimizerScalars scalars;
};
// One thread: unless *guard holds kNonfiniteGradient, ++state->t and state->scalars for *lr
// (device memory: DeviceStepArgs::lr).
void launch_count_step(cudaStream_t s, DeviceStepState* state, const int* guard, double beta1, double beta2,
                       const double* lr);
// The fused pass at state's step. guard (may be null): no update while *guard holds kNonfiniteGradient.
void launch_optimizer(cudaStream_t s, const OptimizerConfig& cfg, const DeviceStepState* state, float* p,
                      const float* g, float* m, float* v, std::int64_t n, const int* guard);
// The norms' layout on the device: kNormBins of include/mnist_mpi/exact_norm.hpp (which nvcc is
// not given: its host half holds 128-bit integers; cuda_backend.cpp checks the two agree).
constexpr int kLambNormBins = 32;
constexpr int kLambNormWords = 2 * kLambNormBins * 2;  // a slot: ({w, u}, bin, {low, high})
// LAMB's first phase (Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp): m, v,
// the direction over g, and (norms not null) the squares of p and of the direction added to
// norms[({w, u}, kNormBins, {low 32 bits, high bits})]; nothing while *guard holds kNonfiniteGradient.
void launch_lamb_direction(cudaStream_t s, const OptimizerConfig& cfg, const DeviceStepState* state, const float* p,
                           float* g, float* m, float* v, std::int64_t n, const int* guard, unsigned long long* norms);
// The second phase: p -= rate * u; nothing while *guard holds kNonfiniteGradient.
void launch_lamb_apply(cudaStream_t s, float* p, const float* u, std::int64_t n, float rate, const int* guard);
void launch_add(cudaStream_t s, float* dst, const float* src, std::int64_t n);
void launch_fill(cudaStream_t s, float* dst, float value, std::int64_t n);
void launch_scale(cudaStream_t s, float* x, float a, std::int64_t n);  // x[i] *= a
// --exact-sums (include/mnist_mpi/backend/fixed_point.hpp; Note [Fixed point on a GPU] in
// kernels.cu): q[i] (assign: =, else +=, wrapping) the fixed point of g[i] * scale; the values with
// !(|g[i]| < bound) counted in counters[0] (finite) and counters[1] (NaN, inf).
void launch_to_fixed(cudaStream_t s, const float* g, std::int64_t* q, std::int64_t n, double scale, float bound,
                     bool assign, std::int64_t* counters);
// *slot = max(*slot, bits of the largest finite |g[i]|).
void launch_max_finite_magnitude(cudaStream_t s, const float* g, std::int64_t n, std::uint32_t* slot);
// g[i] = float(double(q[i]) * unscale); *slot = max(*slot, bits of the largest |g[i]|).
void launch_from_fixed(cudaStream_t s, const std::int64_t* q, float* g, std::int64_t n, double unscale,
                       std::uint32_t* slot);
// Zero padding with (possibly asymmetric) margins: dst (N, C, H + top + bottom, W + left + right)
// from src (N, C, H, W); crop is its adjoint (the interior back).
void launch_pad(cudaStream_t s, const float* src, float* dst, int nc, int h, int w, int top, int left, int ph, int pw);
void launch_crop(cudaStream_t s, const float* src, float* dst, int nc, int h, int w, int top, int left, int ph, int pw);
// Dropout: scale (N, per_sample) from rng::dropout_scale and y = x * scale; backward dx = dy * scale.
// The key's step is *step (device memory: DeviceStepArgs::step).
void launch_dropout_forward(cudaStream_t s, const float* x, float* y, float* scale, int batch, std::int64_t per_sample,
                            std::uint64_t seed, const std::int64_t* step, std::int64_t first_sample, int layer,
                            float rate);
void launch_mul(cudaStream_t s, const float* a, const float* b, float* out, std::int64_t n);
// Batch norm over (N, C, plane), per channel (src/backend/cuda/batchnorm.cpp): training forward
// with the batch's statistics (kept in mean / inv_std for backward; running moved toward them),
// inference forward with running (mean, then variance), and backward (dscale, dshift; dx unless null).
void launch_batchnorm_forward_train(cudaStream_t s, const float* x, float* y, const float* scale, const float* shift,
                                    float* running, float* mean, float* inv_std, int batch, int channels,
                                    std::int64_t plane, double momentum, double eps);
void launch_batchnorm_forward_infer(cudaStream_t s, const float* x, float* y, const float* scale, const float* shift,
                                    const float* running, int batch, int channels, std::int64_t plane, double eps);
void launch_batchnorm_backward(cudaStream_t s, const float* x, const float* dy, float* dx, const float* scale,
                               const float* mean, const float* inv_std, float* dscale, float* dshift, int batch,
                               int channels, std::int64_t plane);
// y = x > 0 ? x : 0 and dx = dy * (x <= 0 ? 0 : 1), oneDNN's bits (Note [The ReLU, bit for bit]
// in kernels.cu).
void launch_relu_forward(cudaStream_t s, const float* x, float* y, std::int64_t n);
void launch_relu_backward(cudaStream_t s, const float* x, const float* dy, float* dx, std::int64_t n);
// bf16 (its bits in a uint16) from float, rounded to nearest even (as oneDNN's reorder on the CPU),
// and back (exact). Note [bf16 on the GPU] in cuda_backend.cpp.
void launch_to_bf16(cudaStream_t s, const float* x, std::uint16_t* y, std::int64_t n);
void launch_from_bf16(cudaStream_t s, const std::uint16_t* x, float* y, std::int64_t n);

}  // namespace mnist_mpi::cuda
