// The CPU backend's kernel factories, one per layer kind (one file each in src/backend/cpu/).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "src/backend/cpu/bf16.hpp"
#include "src/backend/cpu/dnnl_util.hpp"
#include "src/backend/cpu/fusion.hpp"

#include "mnist_mpi/cpu_clones.hpp"  // MNIST_MPI_CPU_CLONES: Note [One build for every x86-64]

namespace mnist_mpi::cpu {

// first: the model's first layer (no bf16 oneDNN kernels for it under --precision bf16: Note [bf16 on the CPU]).
// f: its part in the fusion plan (Note [The fusion plan] in fusion.cpp); a default one fuses nothing.
std::unique_ptr<LayerKernel> make_conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training, bool first,
                                       const LayerFusion& f);
// How a convolution's weight gradient is computed: oneDNN's kernel (fp32 or bf16), the own fp32
// loop (Note [Weight gradient of a plain-input convolution] in conv.cpp) or the own bf16 one (Note
// [The first convolution's weight gradient in bf16] in bf16.cpp), as the convolution built in
// training at this batch will choose.
enum class ConvWeightGrad { kOneDnn, kOwnLoop, kOwnBf16 };
ConvWeightGrad conv_weight_grad(const Context& c, const LayerSpec& l, Layout x_layout, Layout y_layout, int batch,
                                bool first);
// Whether oneDNN has non-reference convolution kernels for these activation layouts (a probe for
// Note [Which activations are blocked]; with_dx: backward-data too).
bool conv_has_fast_kernels(const Context& c, const LayerSpec& l, Layout x_layout, Layout y_layout, bool with_dx);
// Note [The first convolution and its pool in one pass] in conv.cpp: whether a convolution may be
// computed by the max pool after it, and that pass (block: B of the blocked layouts; wt: scratch
// of the layer's weight count; arg may be null).
bool first_conv_pool_fits(const LayerSpec& conv, Layout x_layout, Layout y_layout);
// That pass's view of convolution `conv` with buffers b.
FirstConvForward first_conv_forward(const Context& c, const LayerSpec& conv, const LayerBuffers& b);
void first_conv_pool_forward(const FirstConvForward& f, int block, int batch, float* wt, float* y, std::int32_t* arg);
// Note [The first convolution in bf16] in bf16.cpp: the first convolution, its ReLU and
// its 2 x 2 max pool in one bf16 pass, for a convolution that first_conv_pool_fits (blocked 16)
// and, per these, whose channels are whole blocks of 16 on a CPU with AVX512-BF16.
bool first_conv_relu_pool_bf16_fits(const LayerSpec& conv);
class FirstConvBf16 {
 public:
  FirstConvBf16(const LayerSpec& conv, int threads);
  // The pool's y and arg (may be null), blocked (N, O/16, PH, PW, 16), from f's x, weights and bias.
  void forward(const FirstConvForward& f, int batch, float* y, std::int32_t* arg);

 private:
  int threads_;
  std::int64_t scratch_size_ = 0;       // one padded bf16 image
  std::vector<std::uint16_t> scratch_;  // one a thread
  std::vector<std::uint16_t> packed_;   // (O/16, KH, JP, 16, 2) bf16
};
// Note [The first convolution's weight gradient in bf16] in bf16.cpp: for a first convolution
// (one input channel, stride 1, 3 x 3 or 5 x 5, blocks of 16 channels, even output width) under
// --precision bf16 on a CPU with AVX512-BF16.
bool first_conv_weight_grad_bf16_fits(const LayerSpec& conv);
class FirstConvWeightGradBf16 {
 public:
  FirstConvWeightGradBf16(const LayerSpec& conv, int threads);
  // dw (O, 1, KH, KW) and db (O) from x (N, 1, H, W) and dy (N, O/16, OH, OW, 16), both fp32, or,
  // where pooled.dy is set, from the pool's gradient instead of dy (pooled.y: the mask of the ReLU).
  void run(int batch, const float* x, const float* dy, const PooledGradient& pooled, float* dw, float* db);

 private:
  LayerSpec l_;
  int threads_;
  std::int64_t scratch_size_ = 0;
  std::vector<std::uint16_t> scratch_;  // one padded bf16 image a thread
  std::vector<double> partial_;         // (O/16, KH * KW, 16) a thread
  std::vector<double> bias_;            // (O) a thread
};
std::unique_ptr<LayerKernel> make_fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training);
// A max pool's 2 x 2 windows with stride 2 cover its input exactly: every input element in one window.
bool exact_2x2(const LayerSpec& pool);
std::unique_ptr<LayerKernel> make_maxpool(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training,
                                          const LayerFusion& f);
std::unique_ptr<LayerKernel> make_relu(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training,
                                       const LayerFusion& f);
std::unique_ptr<LayerKernel> make_dropout(const LayerSpec& l, int index, const LayerBuffers& b, bool training);
std::unique_ptr<LayerKernel> make_flatten(const LayerSpec& l, const LayerBuffers& b);
std::unique_ptr<LayerKernel> make_batchnorm(const LayerSpec& l, const LayerBuffers& b, bool training);

}  // namespace mnist_mpi::cpu
