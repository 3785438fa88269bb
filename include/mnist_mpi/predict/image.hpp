// Reading the images `mnist_mpi predict` classifies: PNG (libpng; 1-16 bit grey, grey+alpha, RGB,
// RGBA, palette; Note [Grey from colour and alpha] in src/predict/image.cpp) and PGM (P2 and P5,
// 8 or 16 bit), recognised by their first bytes, never by the file name. Every problem is an
// Error(kData) whose message says what is wrong and what to do; the caller names the file.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mnist_mpi {

// The largest image accepted: a bound checked before the pixels are allocated.
inline constexpr std::int64_t kMaxImageSide = 20000;
inline constexpr std::int64_t kMaxImagePixels = std::int64_t{64} << 20;

struct GreyImage {
  int width = 0, height = 0;
  std::vector<float> pixels;  // (height, width), row-major: 0 black, 1 white
  std::string format;         // as read: "PNG 8-bit RGBA", "PGM 16-bit"
  float at(int y, int x) const { return pixels[static_cast<std::size_t>(y) * width + x]; }
};

// Decodes a whole file image. Throws Error(kData, "problem -- fix").
GreyImage decode_image(std::span<const std::uint8_t> bytes);
// Reads and decodes a file (a regular file only: Note [Look before you open] in
// include/mnist_mpi/io/file_kind.hpp). Throws Error(kData) whose message names the file.
GreyImage read_image(const std::string& path);

}  // namespace mnist_mpi
