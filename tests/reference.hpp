// Plain double-precision reference implementations of the layers and the loss, written as the
// textbook loops (no blocking, no tricks) so they are obviously right. The layer tests compare
// the backend's float kernels against these. Layouts match the backend: activations NCHW, conv
// weight (O, I, KH, KW) then bias (O), fc weight (O, I) with I in C, H, W order then bias (O).
#pragma once

#include <cstdint>
#include <vector>

#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi::ref {

// Convolution with the layer's stride and (possibly asymmetric) padding; zeros outside the input.
// x: (N, in.c, in.h, in.w); w: weight then bias; returns (N, out.c, out.h, out.w).
std::vector<double> conv2d(const LayerSpec& l, int batch, const std::vector<double>& x, const std::vector<double>& w);
// Max pooling, no padding. Returns (N, out.c, out.h, out.w).
std::vector<double> maxpool(const LayerSpec& l, int batch, const std::vector<double>& x);
std::vector<double> relu(const std::vector<double>& x);
// y = x W^T + b with the input (C, H, W) read as C*H*W values.
std::vector<double> fc(const LayerSpec& l, int batch, const std::vector<double>& x, const std::vector<double>& w);

struct SoftmaxXent {
  double loss_sum = 0.0;        // sum over the batch of -log softmax(z)[label]
  std::int64_t correct = 0;     // argmax == label (first maximum wins)
  std::vector<double> dlogits;  // (softmax - onehot) * grad_scale
};
SoftmaxXent softmax_cross_entropy(const std::vector<double>& logits, const std::vector<std::int32_t>& labels, int batch,
                                  int classes, double grad_scale);

}  // namespace mnist_mpi::ref
