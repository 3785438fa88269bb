// The double-precision reference layers and loss declared in tests/reference.hpp: direct loops
// over every output element, with index arithmetic written out in full, so each can be checked
// by eye. Used only by the tests.
#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace mnist_mpi::ref {

std::vector<double> conv2d(const LayerSpec& l, int batch, const std::vector<double>& x, const std::vector<double>& w) {
  const int C = l.in.c, H = l.in.h, W = l.in.w, O = l.out.c, OH = l.out.h, OW = l.out.w;
  const int KH = l.kernel_h, KW = l.kernel_w, S = l.stride;
  const std::size_t bias_at = static_cast<std::size_t>(O) * C * KH * KW;
  std::vector<double> y(static_cast<std::size_t>(batch) * O * OH * OW, 0.0);
  for (int n = 0; n < batch; ++n)
    for (int o = 0; o < O; ++o)
      for (int oh = 0; oh < OH; ++oh)
        for (int ow = 0; ow < OW; ++ow) {
          double acc = w[bias_at + static_cast<std::size_t>(o)];
          for (int c = 0; c < C; ++c)
            for (int kh = 0; kh < KH; ++kh)
              for (int kw = 0; kw < KW; ++kw) {
                const int ih = oh * S - l.pad_top + kh;
                const int iw = ow * S - l.pad_left + kw;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;  // zero padding
                acc += w[((static_cast<std::size_t>(o) * C + c) * KH + kh) * KW + kw] *
                       x[((static_cast<std::size_t>(n) * C + c) * H + ih) * W + iw];
              }
          y[((static_cast<std::size_t>(n) * O + o) * OH + oh) * OW + ow] = acc;
        }
  return y;
}

std::vector<double> maxpool(const LayerSpec& l, int batch, const std::vector<double>& x) {
  const int C = l.in.c, H = l.in.h, W = l.in.w, OH = l.out.h, OW = l.out.w;
  std::vector<double> y(static_cast<std::size_t>(batch) * C * OH * OW, 0.0);
  for (int n = 0; n < batch; ++n)
    for (int c = 0; c < C; ++c)
      for (int oh = 0; oh < OH; ++oh)
        for (int ow = 0; ow < OW; ++ow) {
          double m = -INFINITY;
          for (int kh = 0; kh < l.kernel_h; ++kh)
            for (int kw = 0; kw < l.kernel_w; ++kw) {
              const int ih = oh * l.stride + kh, iw = ow * l.stride + kw;
              m = std::max(m, x[((static_cast<std::size_t>(n) * C + c) * H + ih) * W + iw]);
            }
          y[((static_cast<std::size_t>(n) * C + c) * OH + oh) * OW + ow] = m;
        }
  return y;
}

std::vector<double> relu(const std::vector<double>& x) {
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] > 0.0 ? x[i] : 0.0;
  return y;
}

std::vector<double> fc(const LayerSpec& l, int batch, const std::vector<double>& x, const std::vector<double>& w) {
  const auto I = static_cast<std::size_t>(l.in.size());
  const auto O = static_cast<std::size_t>(l.channels);
  std::vector<double> y(static_cast<std::size_t>(batch) * O, 0.0);
  for (std::size_t n = 0; n < static_cast<std::size_t>(batch); ++n)
    for (std::size_t o = 0; o < O; ++o) {
      double acc = w[O * I + o];
      for (std::size_t i = 0; i < I; ++i) acc += w[o * I + i] * x[n * I + i];
      y[n * O + o] = acc;
    }
  return y;
}

SoftmaxXent softmax_cross_entropy(const std::vector<double>& logits, const std::vector<std::int32_t>& labels, int batch,
                                  int classes, double grad_scale) {
  SoftmaxXent r;
  r.dlogits.assign(static_cast<std::size_t>(batch) * classes, 0.0);
  for (int n = 0; n < batch; ++n) {
    const double* z = logits.data() + static_cast<std::size_t>(n) * classes;
    int am = 0;
    for (int k = 1; k < classes; ++k)
      if (z[k] > z[am]) am = k;
    double sum = 0.0;
    for (int k = 0; k < classes; ++k) sum += std::exp(z[k] - z[am]);
    const double lse = z[am] + std::log(sum);
    const int y = labels[static_cast<std::size_t>(n)];
    r.loss_sum += lse - z[y];
    r.correct += am == y ? 1 : 0;
    for (int k = 0; k < classes; ++k)
      r.dlogits[static_cast<std::size_t>(n) * classes + k] = (std::exp(z[k] - lse) - (k == y ? 1.0 : 0.0)) * grad_scale;
  }
  return r;
}

}  // namespace mnist_mpi::ref
