// The one interface every backend implements: a layer kernel prepared for its shapes and buffers
// at model build, the softmax cross-entropy loss, and buffer allocation. The CPU backend
// (src/backend/cpu/, oneDNN plus small loops) is the reference; a CUDA backend plugs in here.
// Layers and the trainer never know which backend they run on.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mnist_mpi/model/spec.hpp"

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
  const float* x = nullptr;  // (N, in.c, in.h, in.w)
  float* y = nullptr;        // (N, out.c, out.h, out.w)
  const float* dy = nullptr; // like y; null in an inference model
  float* dx = nullptr;       // like x; null when no input gradient is needed (the first layer)
  const float* w = nullptr;  // this layer's weight, then bias, in the flat parameter buffer
  float* dw = nullptr;       // the same range of the flat gradient buffer; null for inference
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

struct LossStats {
  double loss_sum = 0.0;  // sum over the batch of -log softmax(logits)[label]
  std::int64_t correct = 0;
};

// A device-side float buffer owned by a backend.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual float* data() = 0;
  virtual std::int64_t size() const = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual std::unique_ptr<Buffer> allocate(std::int64_t count) = 0;  // zero-filled
  // The layout of every activation of the model (layers.size() + 1 entries: entry i is layer i's
  // input; the first and the last must be kPlain). Default: all plain.
  virtual std::vector<Layout> activation_layouts(const ModelSpec& spec) const {
    return std::vector<Layout>(spec.layers.size() + 1, Layout::kPlain);
  }
  // index: the layer's position in the spec (dropout key). training=false builds inference only.
  virtual std::unique_ptr<LayerKernel> make_layer(const LayerSpec& spec, int index,
                                                  const LayerBuffers& buffers, bool training) = 0;
  // Softmax cross-entropy from logits (N, classes), computed stably via log-sum-exp. When dlogits
  // is non-null writes dlogits = (softmax - onehot) * grad_scale.
  virtual LossStats softmax_cross_entropy(const float* logits, const std::int32_t* labels, int batch,
                                          int classes, float* dlogits, float grad_scale) = 0;
};

// --threads: the number of threads each rank's kernels use.
std::unique_ptr<Backend> make_cpu_backend(int threads);

}  // namespace mnist_mpi
