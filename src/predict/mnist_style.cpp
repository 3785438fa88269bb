// MNIST's preprocessing, for `mnist_mpi predict` (include/mnist_mpi/predict/mnist_style.hpp):
// ink colour, background removal, bounding box, fitting into 20x20, centring by centre of mass.
// Decoding the file is src/predict/image.cpp; running the model is src/predict/predict.cpp.
#include "mnist_mpi/predict/mnist_style.hpp"

#include <algorithm>
#include <cmath>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

float border_median(const GreyImage& img) {
  std::vector<float> b;
  for (int x = 0; x < img.width; ++x) {
    b.push_back(img.at(0, x));
    if (img.height > 1) b.push_back(img.at(img.height - 1, x));
  }
  for (int y = 1; y + 1 < img.height; ++y) {
    b.push_back(img.at(y, 0));
    if (img.width > 1) b.push_back(img.at(y, img.width - 1));
  }
  std::nth_element(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(b.size() / 2), b.end());
  return b[b.size() / 2];
}

std::vector<std::vector<ResampleTap>> resample_taps(int in, int out) {
  std::vector<std::vector<ResampleTap>> taps(static_cast<std::size_t>(out));
  const double scale = static_cast<double>(in) / out;  // input samples per output sample
  for (int j = 0; j < out; ++j) {
    auto& t = taps[static_cast<std::size_t>(j)];
    if (out < in) {  // the output pixel covers [j*scale, (j+1)*scale) of the input: area weights
      const double lo = j * scale, hi = (j + 1) * scale;
      for (int i = static_cast<int>(std::floor(lo)); i < in && i < hi; ++i) {
        const double overlap = std::min<double>(hi, i + 1) - std::max<double>(lo, i);
        if (overlap > 0) t.push_back({i, static_cast<float>(overlap / scale)});
      }
    } else {  // pixel centres aligned: output j samples input position (j + 0.5) * scale - 0.5
      const double pos = std::clamp((j + 0.5) * scale - 0.5, 0.0, static_cast<double>(in - 1));
      const int i0 = static_cast<int>(std::floor(pos));
      const auto frac = static_cast<float>(pos - i0);
      t.push_back({i0, 1.0f - frac});
      if (frac > 0.0f) t.push_back({std::min(i0 + 1, in - 1), frac});
    }
  }
  return taps;
}

// Note [Like an MNIST digit]
// MNIST's digits were size-normalised to fit a 20x20 box with their aspect ratio kept
// (anti-aliased), then centred in the 28x28 field by their centre of mass, shifted by whole
// pixels. This does the same, in float and without any threshold on the result:
//  1. ink: a light border (median above 0.5) is paper, so the image is inverted (--invert and
//     --no-invert decide instead); MNIST's ink is light on black.
//  2. background: the border's shade becomes 0 and the brightest pixel 1, linearly, clamped: a
//     grey paper or a grey pencil looks like MNIST's black field and white ink.
//  3. the bounding box of every pixel above 0 is cut out and scaled so that its longer side is 20
//     (the shorter rounded), by area averaging when it shrinks and bilinearly when it grows.
//  4. its centre of mass (pixel centres at whole coordinates) is moved to (14, 14) of the field,
//     rounded to whole pixels as the original was: MNIST's test digits have theirs within half a
//     pixel of (14, 14), so rounding moves them by nothing (docs/model_use.md has the command).
// A digit of MNIST itself whose box is already 20 and whose brightest pixel is 1 goes through
// unchanged (tests/test_predict.cpp). Not handled: noise above the border's shade in a photo
// widens the box (clean the picture first), and several digits in one image are one digit.
MnistStyle to_mnist_style(const GreyImage& img, InkMode mode, int size, int box) {
  MnistStyle r;
  r.size = size;
  r.border = border_median(img);
  r.guessed = mode == InkMode::kAuto;
  r.inverted = mode == InkMode::kDarkOnLight || (mode == InkMode::kAuto && r.border > 0.5f);
  auto value = [&](int y, int x) { return r.inverted ? 1.0f - img.at(y, x) : img.at(y, x); };
  const float background = r.inverted ? 1.0f - r.border : r.border;
  float peak = background;
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) peak = std::max(peak, value(y, x));
  if (!(peak > background))
    throw_error(ExitCode::kData,
                std::string("no digit: no pixel is ") + (r.inverted ? "darker" : "lighter") +
                    " than the border's shade -- give an image of a digit" +
                    (r.guessed ? std::string(r.inverted ? " (inverted: its border is light; --no-invert if it is ink)"
                                                        : " (its border is dark; --invert if it is ink)")
                               : std::string()));
  // (1, 2) ink in [0, 1] over the whole image, and (3) its bounding box.
  std::vector<float> ink(static_cast<std::size_t>(img.width) * img.height);
  int x0 = img.width, y0 = img.height, x1 = -1, y1 = -1;
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) {
      const float v = std::clamp((value(y, x) - background) / (peak - background), 0.0f, 1.0f);
      ink[static_cast<std::size_t>(y) * img.width + x] = v;
      if (v > 0.0f) x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  r.box_x = x0, r.box_y = y0, r.box_w = x1 - x0 + 1, r.box_h = y1 - y0 + 1;
  const int longer = std::max(r.box_w, r.box_h);
  r.fit_w = std::max(1, static_cast<int>(std::lround(static_cast<double>(r.box_w) * box / longer)));
  r.fit_h = std::max(1, static_cast<int>(std::lround(static_cast<double>(r.box_h) * box / longer)));
  const auto tx = resample_taps(r.box_w, r.fit_w), ty = resample_taps(r.box_h, r.fit_h);
  std::vector<float> rows(static_cast<std::size_t>(r.box_h) * r.fit_w);  // (box_h, fit_w): x resampled
  for (int y = 0; y < r.box_h; ++y)
    for (int j = 0; j < r.fit_w; ++j) {
      float s = 0.0f;
      for (const ResampleTap& t : tx[static_cast<std::size_t>(j)])
        s += t.weight * ink[static_cast<std::size_t>(y0 + y) * img.width + x0 + t.index];
      rows[static_cast<std::size_t>(y) * r.fit_w + j] = s;
    }
  std::vector<float> fit(static_cast<std::size_t>(r.fit_h) * r.fit_w);  // (fit_h, fit_w)
  double mass = 0.0, my = 0.0, mx = 0.0;
  for (int i = 0; i < r.fit_h; ++i)
    for (int j = 0; j < r.fit_w; ++j) {
      float s = 0.0f;
      for (const ResampleTap& t : ty[static_cast<std::size_t>(i)])
        s += t.weight * rows[static_cast<std::size_t>(t.index) * r.fit_w + j];
      fit[static_cast<std::size_t>(i) * r.fit_w + j] = s;
      mass += s, my += static_cast<double>(s) * i, mx += static_cast<double>(s) * j;
    }
  // (4) whole-pixel shift of the centre of mass to (size/2, size/2).
  const double centre = size / 2.0;
  r.shift_y = static_cast<int>(std::lround(centre - my / mass));
  r.shift_x = static_cast<int>(std::lround(centre - mx / mass));
  r.pixels.assign(static_cast<std::size_t>(size) * size, 0.0f);
  for (int i = 0; i < r.fit_h; ++i)
    for (int j = 0; j < r.fit_w; ++j) {
      const int y = i + r.shift_y, x = j + r.shift_x;
      if (y >= 0 && y < size && x >= 0 && x < size)
        r.pixels[static_cast<std::size_t>(y) * size + x] = fit[static_cast<std::size_t>(i) * r.fit_w + j];
    }
  return r;
}

}  // namespace mnist_mpi
