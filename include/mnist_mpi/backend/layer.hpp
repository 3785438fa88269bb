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

// One copy that a kernel keeps of its weights (a bf16 image, a blocked layout): Note [The
// parameters and their copies] in include/mnist_mpi/backend/parameter_store.hpp. Stale until made,
// and again when its weights change; in a model without a store (untracked) made at every pass.
struct KeptCopy {
  bool stale = true;
  // Whether the pass about to read the copy must make it first; afterwards it is current.
  bool take(bool tracked) {
    const bool make = stale || !tracked;
    stale = false;
    return make;
  }
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
  float* state = nullptr;            // batch norm: its running mean, then variance, in the model state
  Layout x_layout = Layout::kPlain;  // of x and dx
  Layout y_layout = Layout::kPlain;  // of y and dy
};

// Note [A weight gradient written once as integers]
// With --exact-sums a rank computes its chunks' gradients one after another, and each chunk's
// gradient is added into 64-bit integers (include/mnist_mpi/train/exact_sums.hpp). For a large
// weight that is one pass over the weight's floats and two over its integers per chunk, bound by
// memory (lenet's fc1 on 2 ranks, 5 chunks of 10: 13 MB of floats and 26 MB of integers a chunk,
// 5 ms of a 35 ms step). A kernel that can take its weight gradient over instead keeps what each
// chunk's weight gradient is made of (a fully connected layer: the chunk's input and output
// gradient, c rows each) and, once the last chunk's backward has reached it, computes the weight
// gradient a tile of rows at a time, every chunk's tile in turn, each handed to the sink while it
// is in cache: the integers are written once, and the weight's floats never. A chunk's tile is
// the same bits on whichever rank computes it (the same kernel on the same shapes), which is all
// the exact sums need.
class FixedPointSink {
 public:
  // One chunk's gradient of flat elements [offset, offset + n) of the gradient buffer, within one
  // parameter tensor: added into the integers (first: replacing them), or in a probe pass only
  // looked at for its largest magnitude.
  virtual void absorb_range(std::int64_t offset, const float* values, std::int64_t n, bool first) = 0;

 protected:
  ~FixedPointSink() = default;
};

class LayerKernel {
 public:
  virtual ~LayerKernel() = default;
  virtual void forward(const StepContext& ctx) = 0;
  // Writes dx (when bound) and this layer's parameter gradients (overwritten, not accumulated).
  virtual void backward(const StepContext& ctx) = 0;
  // --exact-sums (Note [A weight gradient written once as integers]): the kernel may take its
  // parameters' gradients over for up to `chunks` chunks of chunk_rows rows between finishes (a
  // backward call holds batch / chunk_rows of them); it returns how many elements it took from
  // weight_offset of the flat buffer on (its weight, then its bias; 0: none, the default). From
  // then on backward() leaves them unwritten in dw, and finish_weight_gradient() hands every
  // chunk's since the last finish to the sink, in chunk order (the first with first = true).
  virtual std::int64_t take_weight_gradient(int /*chunks*/, int /*chunk_rows*/, std::int64_t /*weight_offset*/,
                                            FixedPointSink& /*sink*/) {
    return 0;
  }
  virtual void finish_weight_gradient() {}

  // Note [The parameters and their copies] in include/mnist_mpi/backend/parameter_store.hpp.
  // The model was built on a parameter store, which from now on reports every change of the
  // parameters (parameters_changed): the kernel may keep its copies between passes.
  void track_copies() { copies_tracked_ = true; }
  // The parameters in [from, to) (of the flat buffer its weights are in) changed: a kernel that
  // keeps a copy of any of them makes that copy again, now or at its next pass that reads it.
  // image_written: the writer also wrote the plain bf16 image over [from, to) (plain_bf16_copy).
  virtual void parameters_changed(const float* /*from*/, const float* /*to*/, bool /*image_written*/) {}
  // A copy of some of its weights that is a plain bf16 image of them ([begin, end) of the flat
  // buffer, copy[i] the bf16 of begin[i]), which a writer of the parameters may write as it writes
  // them; none by default.
  struct PlainCopy {
    const float* begin = nullptr;
    const float* end = nullptr;
    std::uint16_t* copy = nullptr;
  };
  virtual PlainCopy plain_bf16_copy() const { return {}; }
  // The implementation chosen, for logs ("conv: jit:avx2").
  virtual std::string describe() const = 0;

 protected:
  bool copies_tracked_ = false;  // track_copies()
};

}  // namespace mnist_mpi
