// PNG and PGM decoding for `mnist_mpi predict` (include/mnist_mpi/predict/image.hpp): libpng for
// PNG, a small reader for PGM, both to one grey float image. What the pixels then go through to
// look like an MNIST digit is src/predict/mnist_style.cpp.
#include "mnist_mpi/predict/image.hpp"

#if MNIST_MPI_HAVE_PNG
#include <png.h>
#endif

#include <cctype>
#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/io/file_kind.hpp"

namespace mnist_mpi {
namespace {

constexpr std::uint64_t kMaxImageFileBytes = std::uint64_t{512} << 20;

[[noreturn]] void bad_image(const std::string& problem, const std::string& fix) {
  throw_error(ExitCode::kData, problem + " -- " + fix);
}

void check_size(std::int64_t w, std::int64_t h, const char* format) {
  if (w <= 0 || h <= 0)
    bad_image(std::string("the ") + format + " image has " + std::to_string(w) + "x" + std::to_string(h) +
                  " pixels, none to classify",
              "give an image with a digit in it");
  if (w > kMaxImageSide || h > kMaxImageSide || w * h > kMaxImagePixels)
    bad_image(std::string("the ") + format + " image is " + std::to_string(w) + "x" + std::to_string(h) +
                  " pixels, more than the " + std::to_string(kMaxImageSide) + " per side and " +
                  std::to_string(kMaxImagePixels) + " in all that predict reads",
              "scale it down first");
}

#if MNIST_MPI_HAVE_PNG
// Note [Grey from colour and alpha]
// Colour becomes grey as ITU-R BT.601 luma (0.299 R + 0.587 G + 0.114 B, what PIL's convert("L")
// computes) on the sample values as stored: no gamma curve, because MNIST's pixels are plain
// intensities too. A transparent pixel is paper: the image is composited onto black when its ink
// (the alpha-weighted mean of its opaque colour) is light, and onto white when the ink is dark,
// so that a digit drawn on a transparent canvas in either colour stays visible. Which of the two
// is ink and which paper is decided afterwards, from the border (src/predict/mnist_style.cpp).
void composite_alpha(std::vector<float>& grey, const std::vector<float>& alpha) {
  double ink = 0.0, weight = 0.0;
  for (std::size_t i = 0; i < grey.size(); ++i) {
    ink += static_cast<double>(grey[i]) * alpha[i];
    weight += alpha[i];
  }
  const float paper = (weight > 0.0 && ink / weight < 0.5) ? 1.0f : 0.0f;
  for (std::size_t i = 0; i < grey.size(); ++i) grey[i] = alpha[i] * grey[i] + (1.0f - alpha[i]) * paper;
}

// ---- PNG -------------------------------------------------------------------------------------

struct PngSource {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0, pos = 0;
  char message[256] = {0};
  char warning[256] = {0};  // the last warning: libpng often explains an error in one first
};

void png_read_memory(png_structp png, png_bytep out, std::size_t n) {
  auto* s = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > s->size - s->pos) png_error(png, "the file ends before the image does (truncated)");
  std::memcpy(out, s->data + s->pos, n);
  s->pos += n;
}

void png_on_error(png_structp png, png_const_charp msg) {
  auto* s = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(s->message, sizeof s->message, "%s", msg);
  png_longjmp(png, 1);
}

void png_on_warning(png_structp png, png_const_charp msg) {  // damaged ancillary chunks: skipped by libpng
  auto* s = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(s->warning, sizeof s->warning, "%s", msg);
}

// Note [libpng's longjmp]
// libpng reports errors by longjmp back to the setjmp below. Every C++ object this function uses
// is constructed before the setjmp and only refilled after it, so the jump skips no destructor;
// the message is copied into PngSource by png_on_error and the error thrown from our own frame.
GreyImage decode_png(std::span<const std::uint8_t> bytes) {
  PngSource src;
  src.data = bytes.data();
  src.size = bytes.size();
  GreyImage img;
  std::vector<std::uint8_t> raw;
  std::vector<png_bytep> rows;
  std::vector<float> alpha;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
  if (png == nullptr) throw_error(ExitCode::kRuntime, "libpng could not start (out of memory?)");
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    throw_error(ExitCode::kRuntime, "libpng could not start (out of memory?)");
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    bad_image(std::string("a damaged PNG (libpng: ") + src.message +
                  (src.warning[0] ? std::string("; ") + src.warning : std::string()) + ")",
              "give a whole, undamaged PNG or PGM file");
  }
  png_set_read_fn(png, &src, png_read_memory);
  png_set_user_limits(png, static_cast<png_uint_32>(kMaxImageSide), static_cast<png_uint_32>(kMaxImageSide));
  png_read_info(png, info);
  const auto w = static_cast<std::int64_t>(png_get_image_width(png, info));
  const auto h = static_cast<std::int64_t>(png_get_image_height(png, info));
  const int source_depth = png_get_bit_depth(png, info);
  const int color = png_get_color_type(png, info);
  if (w > kMaxImageSide || h > kMaxImageSide || w * h > kMaxImagePixels) {  // (libpng refuses 0 and its limits)
    png_destroy_read_struct(&png, &info, nullptr);
    check_size(w, h, "PNG");  // throws
  }
  png_set_palette_to_rgb(png);          // palette -> RGB (alpha from tRNS below)
  png_set_expand_gray_1_2_4_to_8(png);  // 1, 2, 4-bit grey -> 8
  png_set_tRNS_to_alpha(png);           // a transparent colour -> an alpha channel
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const int channels = png_get_channels(png, info);  // 1 G, 2 GA, 3 RGB, 4 RGBA
  const int depth = png_get_bit_depth(png, info);    // 8 or 16 (big-endian samples)
  const std::size_t row_bytes = png_get_rowbytes(png, info);
  raw.resize(row_bytes * static_cast<std::size_t>(h));
  rows.resize(static_cast<std::size_t>(h));
  for (std::int64_t y = 0; y < h; ++y) rows[static_cast<std::size_t>(y)] = raw.data() + y * row_bytes;
  png_read_image(png, rows.data());
  png_destroy_read_struct(&png, &info, nullptr);

  const bool has_alpha = channels == 2 || channels == 4;
  const float scale = depth == 16 ? 1.0f / 65535.0f : 1.0f / 255.0f;
  auto sample = [&](std::size_t y, std::int64_t x, int c) {
    const std::uint8_t* p = rows[y] + (x * channels + c) * (depth / 8);
    return static_cast<float>(depth == 16 ? (p[0] << 8) | p[1] : p[0]) * scale;
  };
  img.width = static_cast<int>(w);
  img.height = static_cast<int>(h);
  img.pixels.resize(static_cast<std::size_t>(w * h));
  if (has_alpha) alpha.resize(img.pixels.size());
  for (std::size_t y = 0; y < static_cast<std::size_t>(h); ++y)
    for (std::int64_t x = 0; x < w; ++x) {
      const std::size_t i = y * static_cast<std::size_t>(w) + static_cast<std::size_t>(x);
      img.pixels[i] = channels >= 3 ? 0.299f * sample(y, x, 0) + 0.587f * sample(y, x, 1) + 0.114f * sample(y, x, 2)
                                    : sample(y, x, 0);
      if (has_alpha) alpha[i] = sample(y, x, channels - 1);
    }
  if (has_alpha) composite_alpha(img.pixels, alpha);
  static const char* kColour[] = {"grey", "?", "RGB", "palette", "grey+alpha", "?", "RGBA"};
  img.format = "PNG " + std::to_string(source_depth) + "-bit " + (color >= 0 && color <= 6 ? kColour[color] : "?");
  return img;
}

#else

GreyImage decode_png(std::span<const std::uint8_t>) {
  throw_error(ExitCode::kUsage,
              "this mnist_mpi was built without libpng (libpng-dev was missing when it was configured), so it "
              "reads PGM images only: convert the image to PGM, or run `bash scripts/setup.sh use`, which "
              "installs libpng-dev and rebuilds");
}

#endif  // MNIST_MPI_HAVE_PNG

// ---- PGM -------------------------------------------------------------------------------------

// P2 (ASCII) or P5 (binary): "P5" whitespace width whitespace height whitespace maxval, '#'
// comments to the end of a line anywhere before maxval, then one whitespace byte and the raster,
// rows top to bottom, samples of 1 byte (maxval < 256) or 2 bytes big-endian.
class PgmReader {
 public:
  explicit PgmReader(std::span<const std::uint8_t> b) : b_(b) {}

  std::int64_t number(const char* what) {
    for (;;) {
      while (pos_ < b_.size() && std::isspace(b_[pos_])) ++pos_;
      if (pos_ < b_.size() && b_[pos_] == '#') {
        while (pos_ < b_.size() && b_[pos_] != '\n' && b_[pos_] != '\r') ++pos_;
        continue;
      }
      break;
    }
    if (pos_ >= b_.size()) bad_image(std::string("the PGM file ends before its ") + what + " (truncated)", kFix);
    std::int64_t v = 0;
    const std::size_t start = pos_;
    while (pos_ < b_.size() && std::isdigit(b_[pos_]) && v <= kMaxImagePixels) v = v * 10 + (b_[pos_++] - '0');
    if (pos_ == start) bad_image(std::string("the PGM header's ") + what + " is not a number", kFix);
    return v;
  }

  GreyImage read() {
    const bool ascii = b_[1] == '2';
    const std::int64_t w = number("width"), h = number("height"), maxval = number("maximum value");
    check_size(w, h, "PGM");
    if (maxval < 1 || maxval > 65535)
      bad_image("the PGM maximum value is " + std::to_string(maxval) + ", not in 1..65535", kFix);
    GreyImage img;
    img.width = static_cast<int>(w);
    img.height = static_cast<int>(h);
    img.pixels.resize(static_cast<std::size_t>(w * h));
    const int bytes = maxval > 255 ? 2 : 1;
    img.format = std::string("PGM ") + (ascii ? "P2 " : "P5 ") + (bytes == 2 ? "16-bit" : "8-bit");
    if (!ascii) {
      if (pos_ >= b_.size() || !std::isspace(b_[pos_])) bad_image("the PGM header does not end in whitespace", kFix);
      ++pos_;
      const std::size_t need = img.pixels.size() * static_cast<std::size_t>(bytes);
      if (b_.size() - pos_ < need)
        bad_image("the PGM file holds " + std::to_string(b_.size() - pos_) + " bytes of pixels, its header says " +
                      std::to_string(need) + " (truncated)",
                  kFix);
    }
    for (std::size_t i = 0; i < img.pixels.size(); ++i) {
      std::int64_t v = 0;
      if (ascii) {
        v = number("pixels");
      } else {
        const std::uint8_t* p = b_.data() + pos_ + i * static_cast<std::size_t>(bytes);
        v = bytes == 2 ? (p[0] << 8) | p[1] : p[0];
      }
      if (v > maxval)
        bad_image("a PGM pixel is " + std::to_string(v) + ", above the maximum value " + std::to_string(maxval), kFix);
      img.pixels[i] = static_cast<float>(static_cast<double>(v) / static_cast<double>(maxval));
    }
    return img;
  }

 private:
  static constexpr const char* kFix = "give a whole, undamaged PGM or PNG file";
  std::span<const std::uint8_t> b_;
  std::size_t pos_ = 2;  // after the magic number
};

std::string first_bytes(std::span<const std::uint8_t> bytes) {
  const std::size_t n = std::min<std::size_t>(bytes.size(), 8);
  return quote_input(std::string_view(reinterpret_cast<const char*>(bytes.data()), n));
}

}  // namespace

GreyImage decode_image(std::span<const std::uint8_t> bytes) {
  static const std::uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.empty()) bad_image("the file is empty", "give a PNG or PGM image");
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPngSignature, 8) == 0) return decode_png(bytes);
  if (bytes.size() >= 2 && bytes[0] == 'P' && (bytes[1] == '2' || bytes[1] == '5')) return PgmReader(bytes).read();
  if (bytes.size() >= 2 && bytes[0] == 'P' && bytes[1] != 0 && std::strchr("13467", bytes[1]) != nullptr)
    bad_image(std::string("a Netpbm P") + static_cast<char>(bytes[1]) + " file, not a greyscale PGM (P2 or P5)",
              "convert it to PGM or PNG");
  bad_image("not a PNG or PGM image (it starts with " + first_bytes(bytes) + ")", "give a PNG or PGM file");
}

GreyImage read_image(const std::string& path) {
  const std::vector<std::uint8_t> bytes =
      read_regular_file(path, "image", ExitCode::kData, "give a PNG or PGM file", kMaxImageFileBytes,
                        [&](std::uint64_t size) {
                          throw_error(ExitCode::kData, "image " + quote_input(path) + ": it is " +
                                                           std::to_string(size) + " bytes, more than the " +
                                                           std::to_string(kMaxImageFileBytes) +
                                                           " predict reads -- give a PNG or PGM file");
                        });
  try {
    return decode_image(bytes);
  } catch (const Error& e) {
    throw_error(e.code(), "image " + quote_input(path) + ": " + e.what());
  }
}

}  // namespace mnist_mpi
