// An image of any size made to look like an MNIST digit, the way MNIST's digits were made: light
// ink on a black field, the digit's bounding box fitted into 20x20 (aspect kept, anti-aliased),
// then placed in the 28x28 field so that its centre of mass is at the centre. The steps and the
// choices behind them: Note [Like an MNIST digit] in src/predict/mnist_style.cpp.
#pragma once

#include <string>
#include <vector>

#include "mnist_mpi/predict/image.hpp"

namespace mnist_mpi {

enum class InkMode {
  kAuto,         // guess from the border: a light border is paper, so the image is inverted
  kDarkOnLight,  // --invert: dark ink on light paper, inverted
  kLightOnDark,  // --no-invert: light ink on a dark field, as MNIST
};

struct MnistStyle {
  std::vector<float> pixels;  // (size, size) row-major, 0 background .. 1 ink, as the trainer's input
  int size = 0;
  bool inverted = false;
  bool guessed = false;                            // the ink colour was guessed from the border (InkMode::kAuto)
  float border = 0.0f;                             // the median of the border pixels, before inversion
  int box_x = 0, box_y = 0, box_w = 0, box_h = 0;  // the digit's bounding box in the image
  int fit_w = 0, fit_h = 0;                        // its size after fitting into the box
  int shift_x = 0, shift_y = 0;                    // where the fitted digit's top-left landed
};

// The median of the pixels on the image's outer rows and columns.
float border_median(const GreyImage& img);

// One axis of a resampling from `in` to `out` samples: out[j] = sum of weight * in[index].
struct ResampleTap {
  int index;
  float weight;
};
// Area average (box filter) when out < in, bilinear with pixel centres aligned when out >= in
// (the identity when out == in).
std::vector<std::vector<ResampleTap>> resample_taps(int in, int out);

// size: the model's input side (28); box: the side the digit is fitted into (20). Throws
// Error(kData) when the image holds no digit (no pixel differs from the border's shade).
MnistStyle to_mnist_style(const GreyImage& img, InkMode mode, int size = 28, int box = 20);

}  // namespace mnist_mpi
