// Tests of predict's image reading and MNIST-style preparation: PGM (P2, P5, 8 and 16 bit) and PNG
// (grey, 16-bit, RGB, RGBA, 1-bit) made here by hand (zlib and CRC only, not our decoder's libpng)
// decode to exact values; damaged files give Error(kData) saying what is wrong; the resampling
// weights; an MNIST-like digit passes unchanged; boxes are fitted into 20 and centred by mass;
// the ink colour is guessed from the border.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/predict/image.hpp"
#include "mnist_mpi/predict/mnist_style.hpp"

namespace mnist_mpi {
namespace {

using ::testing::HasSubstr;
using Bytes = std::vector<std::uint8_t>;

Bytes text_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

void put32(Bytes& b, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<std::uint8_t>(v >> s));
}

void chunk(Bytes& out, const char* tag, const Bytes& data) {
  put32(out, static_cast<std::uint32_t>(data.size()));
  Bytes td(tag, tag + 4);
  td.insert(td.end(), data.begin(), data.end());
  out.insert(out.end(), td.begin(), td.end());
  put32(out, static_cast<std::uint32_t>(crc32(0, td.data(), static_cast<uInt>(td.size()))));
}

// A PNG of `rows` (each row's bytes as stored, without the filter byte), written by hand.
Bytes make_png(int w, int h, int depth, int colour, const std::vector<Bytes>& rows) {
  Bytes out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  Bytes ihdr;
  put32(ihdr, static_cast<std::uint32_t>(w));
  put32(ihdr, static_cast<std::uint32_t>(h));
  ihdr.insert(ihdr.end(), {static_cast<std::uint8_t>(depth), static_cast<std::uint8_t>(colour), 0, 0, 0});
  chunk(out, "IHDR", ihdr);
  Bytes raw;
  for (const Bytes& r : rows) {
    raw.push_back(0);  // filter: none
    raw.insert(raw.end(), r.begin(), r.end());
  }
  uLongf n = compressBound(static_cast<uLong>(raw.size()));
  Bytes z(n);
  EXPECT_EQ(compress(z.data(), &n, raw.data(), static_cast<uLong>(raw.size())), Z_OK);
  z.resize(n);
  chunk(out, "IDAT", z);
  chunk(out, "IEND", {});
  return out;
}

void expect_data_error(const Bytes& b, const std::string& part) {
  try {
    decode_image(b);
    ADD_FAILURE() << "no error; expected one saying '" << part << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kData);
    EXPECT_THAT(e.what(), HasSubstr(part));
    EXPECT_THAT(e.what(), HasSubstr(" -- "));  // and what to do
  }
}

TEST(ImagePgm, BinaryAndAsciiEightBit) {
  Bytes p5 = text_bytes("P5\n# a comment\n3 2\n200\n");
  p5.insert(p5.end(), {0, 50, 100, 150, 200, 7});
  const GreyImage a = decode_image(p5);
  ASSERT_EQ(a.width, 3);
  ASSERT_EQ(a.height, 2);
  const std::vector<float> want{0.0f, 0.25f, 0.5f, 0.75f, 1.0f, static_cast<float>(7.0 / 200.0)};
  EXPECT_EQ(a.pixels, want);
  const GreyImage b = decode_image(text_bytes("P2 3 2 200\n0 50 100\n150 200 7\n"));
  EXPECT_EQ(b.pixels, want);
  EXPECT_EQ(b.format, "PGM P2 8-bit");
}

TEST(ImagePgm, SixteenBitIsBigEndian) {
  Bytes p = text_bytes("P5 2 1 65535\n");
  p.insert(p.end(), {0x12, 0x34, 0xff, 0xff});
  const GreyImage a = decode_image(p);
  EXPECT_EQ(a.pixels[0], static_cast<float>(0x1234 / 65535.0));
  EXPECT_EQ(a.pixels[1], 1.0f);
}

TEST(ImagePgm, DamagedFilesSayWhat) {
  Bytes short_raster = text_bytes("P5 4 4 255\n");
  short_raster.insert(short_raster.end(), 10, 0);
  expect_data_error(short_raster, "holds 10 bytes of pixels, its header says 16 (truncated)");
  expect_data_error(text_bytes("P5 0 3 255\n"), "0x3 pixels");
  expect_data_error(text_bytes("P2 2 1 9\n3 10\n"), "above the maximum value 9");
  expect_data_error(text_bytes("P5 2 x 255\n"), "height is not a number");
  expect_data_error(text_bytes("P5 2 2"), "ends before its maximum value");
  expect_data_error(text_bytes("P5 99999 99999 255\n"), "more than the");
  expect_data_error(text_bytes("P6 1 1 255\n"), "not a greyscale PGM");
  expect_data_error(text_bytes("hello"), "not a PNG or PGM image");
  expect_data_error({}, "empty");
}

TEST(ImagePng, GreyEightAndSixteenBit) {
  const GreyImage a = decode_image(make_png(3, 1, 8, 0, {{0, 128, 255}}));
  EXPECT_EQ(a.pixels, (std::vector<float>{0.0f, 128.0f / 255.0f, 1.0f}));
  EXPECT_EQ(a.format, "PNG 8-bit grey");
  const GreyImage b = decode_image(make_png(2, 1, 16, 0, {{0x12, 0x34, 0xff, 0xff}}));
  EXPECT_EQ(b.pixels, (std::vector<float>{0x1234 / 65535.0f, 1.0f}));
  const GreyImage c = decode_image(make_png(8, 1, 1, 0, {{0xa5}}));  // 1-bit: 1010 0101
  EXPECT_EQ(c.pixels, (std::vector<float>{1, 0, 1, 0, 0, 1, 0, 1}));
}

TEST(ImagePng, RgbIsLuma) {
  const GreyImage a = decode_image(make_png(3, 1, 8, 2, {{255, 0, 0, 0, 255, 0, 0, 0, 255}}));
  EXPECT_NEAR(a.pixels[0], 0.299f, 1e-6);
  EXPECT_NEAR(a.pixels[1], 0.587f, 1e-6);
  EXPECT_NEAR(a.pixels[2], 0.114f, 1e-6);
}

// Note [Grey from colour and alpha] in src/predict/image.cpp: transparency is paper, of the shade
// opposite to the ink's.
TEST(ImagePng, TransparentPixelsArePaper) {
  // Black ink (opaque) on a transparent canvas: the canvas turns white.
  const GreyImage dark = decode_image(make_png(3, 1, 8, 6, {{0, 0, 0, 255, 0, 0, 0, 0, 9, 9, 9, 0}}));
  EXPECT_EQ(dark.pixels, (std::vector<float>{0.0f, 1.0f, 1.0f}));
  // White ink, half covering one pixel: the canvas turns black.
  const GreyImage light =
      decode_image(make_png(3, 1, 8, 6, {{255, 255, 255, 255, 255, 255, 255, 0, 255, 255, 255, 51}}));
  EXPECT_EQ(light.pixels[0], 1.0f);
  EXPECT_EQ(light.pixels[1], 0.0f);
  EXPECT_NEAR(light.pixels[2], 0.2f, 1e-6);
  EXPECT_EQ(light.format, "PNG 8-bit RGBA");
}

TEST(ImagePng, DamagedFilesSayWhat) {
  const Bytes good = make_png(4, 4, 8, 0, {{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10, 11, 12}, {13, 14, 15, 16}});
  expect_data_error(Bytes(good.begin(), good.begin() + 40), "truncated");
  Bytes bad_crc = good;
  bad_crc[30] ^= 1;  // inside IHDR's checksummed bytes
  expect_data_error(bad_crc, "damaged PNG");
  expect_data_error(make_png(0, 1, 8, 0, {{}}), "width is zero");
}

TEST(Resample, TapsAreAreaOrBilinearWeights) {
  const auto same = resample_taps(5, 5);  // the identity
  for (int j = 0; j < 5; ++j) {
    ASSERT_EQ(same[static_cast<std::size_t>(j)].size(), 1u);
    EXPECT_EQ(same[static_cast<std::size_t>(j)][0].index, j);
    EXPECT_EQ(same[static_cast<std::size_t>(j)][0].weight, 1.0f);
  }
  const auto down = resample_taps(3, 2);  // out 0 covers [0, 1.5): weights 1/1.5 and 0.5/1.5
  ASSERT_EQ(down[0].size(), 2u);
  EXPECT_FLOAT_EQ(down[0][0].weight, 2.0f / 3.0f);
  EXPECT_FLOAT_EQ(down[0][1].weight, 1.0f / 3.0f);
  EXPECT_EQ(down[1][0].index, 1);
  EXPECT_FLOAT_EQ(down[1][0].weight, 1.0f / 3.0f);
  const auto up = resample_taps(2, 4);  // samples at -0.25 (clamped), 0.25, 0.75, 1.25 (clamped)
  EXPECT_EQ(up[0].size(), 1u);
  EXPECT_EQ(up[0][0].index, 0);
  EXPECT_FLOAT_EQ(up[1][0].weight, 0.75f);
  EXPECT_FLOAT_EQ(up[1][1].weight, 0.25f);
  EXPECT_FLOAT_EQ(up[2][0].weight, 0.25f);
  EXPECT_FLOAT_EQ(up[2][1].weight, 0.75f);
  EXPECT_EQ(up[3].size(), 1u);
  EXPECT_EQ(up[3][0].index, 1);
}

GreyImage canvas(int w, int h, float v) {
  GreyImage g;
  g.width = w;
  g.height = h;
  g.pixels.assign(static_cast<std::size_t>(w) * h, v);
  return g;
}

void fill(GreyImage& g, int y0, int y1, int x0, int x1, float v) {  // [y0, y1) x [x0, x1)
  for (int y = y0; y < y1; ++y)
    for (int x = x0; x < x1; ++x) g.pixels[static_cast<std::size_t>(y) * g.width + x] = v;
}

// Note [Like an MNIST digit]: a digit whose box is already 20 high, whose brightest pixel is 1 and
// whose centre of mass is within half a pixel of (14, 14) is left exactly as it is.
TEST(MnistStyle, AnMnistLikeDigitPassesUnchanged) {
  GreyImage g = canvas(28, 28, 0.0f);
  fill(g, 5, 24, 9, 20, 1.0f);  // rows 5..23, columns 9..19 (mean column 14)
  fill(g, 4, 5, 9, 20, 0.5f);   // row 4 at half: 20 rows in all, centre of mass row 13.74
  g.pixels[10 * 28 + 12] = 0.3f;
  const MnistStyle m = to_mnist_style(g, InkMode::kAuto);
  EXPECT_FALSE(m.inverted);
  EXPECT_EQ(m.box_h, 20);
  EXPECT_EQ(m.box_w, 11);
  EXPECT_EQ(m.pixels, g.pixels);
}

TEST(MnistStyle, ALargeDigitIsFittedInto20AndCentredByMass) {
  GreyImage g = canvas(300, 400, 0.0f);
  fill(g, 50, 250, 20, 150, 1.0f);  // 200 high, 130 wide
  const MnistStyle m = to_mnist_style(g, InkMode::kLightOnDark);
  EXPECT_EQ(m.fit_h, 20);
  EXPECT_EQ(m.fit_w, 13);  // 130 * 20 / 200
  // Area averaging of a solid block is the block; its centre (9.5, 6) goes to (14, 14), rounded
  // half away from zero: rows 5..24, columns 8..20.
  EXPECT_EQ(m.shift_y, 5);
  EXPECT_EQ(m.shift_x, 8);
  for (int y = 0; y < 28; ++y)
    for (int x = 0; x < 28; ++x) {
      const bool inside = y >= 5 && y < 25 && x >= 8 && x < 21;
      EXPECT_NEAR(m.pixels[static_cast<std::size_t>(y) * 28 + x], inside ? 1.0f : 0.0f, 1e-6) << y << "," << x;
    }
}

TEST(MnistStyle, ASmallDigitGrowsBilinearlyAndItsMassLandsNearTheCentre) {
  GreyImage g = canvas(9, 7, 0.0f);
  fill(g, 1, 5, 2, 4, 1.0f);  // 4 high, 2 wide, a dimmer pixel at its foot
  g.pixels[4 * 9 + 3] = 0.5f;
  const MnistStyle m = to_mnist_style(g, InkMode::kAuto);
  EXPECT_EQ(m.fit_h, 20);
  EXPECT_EQ(m.fit_w, 10);
  double mass = 0, my = 0, mx = 0;
  int y0 = 28, y1 = -1;
  for (int y = 0; y < 28; ++y)
    for (int x = 0; x < 28; ++x) {
      const double v = m.pixels[static_cast<std::size_t>(y) * 28 + x];
      mass += v, my += v * y, mx += v * x;
      if (v > 0) y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  EXPECT_EQ(y1 - y0 + 1, 20);
  EXPECT_LE(std::abs(my / mass - 14.0), 0.5);
  EXPECT_LE(std::abs(mx / mass - 14.0), 0.5);
}

TEST(MnistStyle, DarkInkOnLightPaperIsGuessedAndInverted) {
  GreyImage light = canvas(40, 60, 0.0f), dark = canvas(40, 60, 0.8f);  // grey paper
  fill(light, 10, 50, 15, 22, 0.9f);
  fill(dark, 10, 50, 15, 22, 0.1f);  // the same digit in dark pencil
  const MnistStyle a = to_mnist_style(light, InkMode::kAuto), b = to_mnist_style(dark, InkMode::kAuto);
  EXPECT_FALSE(a.inverted);
  EXPECT_TRUE(b.inverted);
  EXPECT_TRUE(b.guessed);
  EXPECT_FLOAT_EQ(b.border, 0.8f);
  ASSERT_EQ(a.pixels.size(), b.pixels.size());
  for (std::size_t i = 0; i < a.pixels.size(); ++i) EXPECT_NEAR(a.pixels[i], b.pixels[i], 1e-6);
  EXPECT_FLOAT_EQ(*std::max_element(b.pixels.begin(), b.pixels.end()), 1.0f);  // the pencil is full ink
  const MnistStyle forced = to_mnist_style(dark, InkMode::kDarkOnLight);  // --invert
  EXPECT_TRUE(forced.inverted);
  EXPECT_FALSE(forced.guessed);
  EXPECT_EQ(forced.pixels, b.pixels);
  // --no-invert on pencil: nothing is lighter than the paper, so no digit (and the message says so).
  EXPECT_THROW(to_mnist_style(dark, InkMode::kLightOnDark), Error);
}

TEST(MnistStyle, ABlankImageHasNoDigit) {
  try {
    to_mnist_style(canvas(10, 10, 0.3f), InkMode::kAuto);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kData);
    EXPECT_THAT(e.what(), HasSubstr("no digit"));
  }
}

}  // namespace
}  // namespace mnist_mpi
