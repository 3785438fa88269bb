// The layer interface: a kernel made once per layer by a backend (Backend::make_layer), bound to
// its buffers for the model's lifetime, run forward and backward with the step's context. What a
// kernel is told about its buffers and their layouts is here; how a backend computes it is in
// src/backend/cpu/ and src/backend/cuda/, one file per layer kind.
#pragma once

#include <cstdint>
#include <string>

namespace mnist_mpi {

// What one forward / backward call needs to know besides its buffers.
struct StepContext {
  bool training = true;
  std::uint64_t seed = 0;
  std::int64_t step = 0;          // global step (dropout key)
  std::int64_t first_sample = 0;  // position of this batch's row 0 within the global batch
};

// Note [Activation layouts]
// How one activation buffer holds its (N, C, H, W) values. kPlain is NCHW. kBlockedB is oneDNN's
// nChwBc: (N, C/B, H, W, B), channels in blocks of B, only where B divides C (so the buffer has
// the plain size). A backend may keep activations between its own layers blocked so that no
// layer converts per step; the model's input, its logits and anything a flatten or fc reads stay
// plain. The backend chooses (Backend::activation_layouts) and every kernel is told the layouts of
// its x / dx and y / dy.
enum class Layout { kPlain, kBlocked8, kBlocked16 };

// Buffers of one layer, fixed for the model's lifetime (kernels bind them once, at build).
struct LayerBuffers {
  int batch = 0;
  const float* x = nullptr;          // (N, in.c, in.h, in.w)
  float* y = nullptr;                // (N, out.c, out.h, out.w)
  const float* dy = nullptr;         // like y; null in an inference model
  float* dx = nullptr;               // like x; null when no input gradient is needed (the first layer)
  const float* w = nullptr;          // this layer's weight, then bias, in the flat parameter buffer
  float* dw = nullptr;               // the same range of the flat gradient buffer; null for inference
  Layout x_layout = Layout::kPlain;  // of x and dx
  Layout y_layout = Layout::kPlain;  // of y and dy
};

class LayerKernel {
 public:
  virtual ~LayerKernel() = default;
  virtual void forward(const StepContext& ctx) = 0;
  // Writes dx (when bound) and this layer's parameter gradients (overwritten, not accumulated).
  virtual void backward(const StepContext& ctx) = 0;
  // The implementation chosen, for logs ("conv: jit:avx2").
  virtual std::string describe() const = 0;
};

}  // namespace mnist_mpi
