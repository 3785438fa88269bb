// Tests of the CPU backend's layer kernels, one layer at a time and as a whole small model: the
// forward against the double reference (tests/reference.cpp), the backward against central finite
// differences of L = sum(y * r) through the kernel's own forward (dy = r), dx == nullptr for a
// first layer, and dropout's mask (rate, scale, reuse in backward, independence from the batch
// split, identity at inference).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <map>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/backend/model.hpp"
#include <oneapi/dnnl/dnnl.hpp>

#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/train/optimizer.hpp"
#include "reference.hpp"
#include "test_util.hpp"  // world_rank, world_size, all_ranks, uniform

namespace mnist_mpi {
namespace {

// n distinct values spaced `gap` apart, in a random order, centred on zero.
std::vector<float> distinct(std::size_t n, std::uint64_t seed, float gap) {
  std::vector<std::size_t> p(n);
  std::iota(p.begin(), p.end(), std::size_t{0});
  std::shuffle(p.begin(), p.end(), std::mt19937_64(seed));
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = gap * (static_cast<float>(p[i]) - 0.5f * static_cast<float>(n) + 0.5f);
  return v;
}

// Values with |v| in [0.05, 1.05]: at least 0.05 away from ReLU's kink.
std::vector<float> away_from_zero(std::size_t n, std::uint64_t seed) {
  std::vector<float> v = uniform(n, seed, 0.05f, 1.05f);
  std::mt19937_64 g(seed ^ 0xABCDu);
  for (float& x : v)
    if (g() & 1u) x = -x;
  return v;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// |got - ref| <= atol + rtol * |ref| everywhere; on failure names the worst element.
void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<double>& ref, double atol,
                  double rtol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t worst = 0;
  double worst_excess = -1e300;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - ref[i]);
    const double excess = err - (atol + rtol * std::abs(ref[i]));
    if (!(excess <= 0.0)) ++bad;  // NaN counts as bad
    if (excess > worst_excess || std::isnan(excess)) {
      worst_excess = std::isnan(excess) ? 1e300 : excess;
      worst = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements out of tolerance (atol " << atol
                     << ", rtol " << rtol << "); worst at [" << worst << "]: got " << got[worst] << ", expected "
                     << ref[worst];
}

LayerSpec layer_of(const std::string& text, Shape input, int classes, std::size_t index = 0) {
  return parse_model_spec(text, input, classes).layers.at(index);
}

std::int64_t param_size(const LayerSpec& l) {
  if (l.kind == LayerKind::kConv)
    return static_cast<std::int64_t>(l.channels) * l.in.c * l.kernel_h * l.kernel_w + l.channels;
  if (l.kind == LayerKind::kFc) return static_cast<std::int64_t>(l.channels) * l.in.size() + l.channels;
  return 0;
}

// One layer kernel with its own buffers. Values can be changed in place between calls: the
// kernel binds the pointers once.
struct Rig {
  LayerSpec l;
  int batch;
  std::vector<float> x, y, dy, dx, w, dw;
  std::unique_ptr<LayerKernel> k;

  Rig(Backend& be, const LayerSpec& spec, int n, std::uint64_t seed, bool with_dx = true, bool training = true,
      int index = 0, Layout x_layout = Layout::kPlain, Layout y_layout = Layout::kPlain)
      : l(spec), batch(n) {
    const auto in = static_cast<std::size_t>(n * l.in.size()), out = static_cast<std::size_t>(n * l.out.size());
    const auto np = static_cast<std::size_t>(param_size(l));
    x = uniform(in, seed);
    y.assign(out, 0.0f);
    dy = uniform(out, seed + 1);
    dx.assign(with_dx ? in : 0, 0.0f);
    w = uniform(np, seed + 2, -0.5f, 0.5f);
    dw.assign(np, 0.0f);
    LayerBuffers b;
    b.batch = n;
    b.x = x.data();
    b.y = y.data();
    b.x_layout = x_layout;
    b.y_layout = y_layout;
    if (training) {
      b.dy = dy.data();
      b.dx = with_dx ? dx.data() : nullptr;
    }
    if (np > 0) {
      b.w = w.data();
      if (training) b.dw = dw.data();
    }
    k = be.make_layer(l, index, b, training);
  }

  // L = sum(y * dy): dy plays the part of the fixed random r.
  double loss() const {
    double s = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) s += static_cast<double>(y[i]) * dy[i];
    return s;
  }
};

int block_of(Layout layout) { return layout == Layout::kBlocked8 ? 8 : layout == Layout::kBlocked16 ? 16 : 1; }

// Index of plain (n, c, h, w) in a buffer of `layout` (Note [Activation layouts] in include/mnist_mpi/backend/layer.hpp).
std::size_t at(Layout layout, Shape s, int n, int c, int h, int w) {
  const int b = block_of(layout);
  return ((((static_cast<std::size_t>(n) * (s.c / b) + c / b) * s.h + h) * s.w + w) * b) + c % b;
}

// A plain (N, C, H, W) vector from one in `layout`, or the other way.
template <typename T>
std::vector<T> relayout(const std::vector<T>& v, int batch, Shape s, Layout from, Layout to) {
  std::vector<T> out(v.size());
  for (int n = 0; n < batch; ++n)
    for (int c = 0; c < s.c; ++c)
      for (int h = 0; h < s.h; ++h)
        for (int w = 0; w < s.w; ++w) out[at(to, s, n, c, h, w)] = v[at(from, s, n, c, h, w)];
  return out;
}

// Central differences of rig.loss() with respect to every element of `var` (x or w of the rig),
// against `analytic`.
void check_fd(const std::string& what, Rig& rig, std::vector<float>& var, const std::vector<float>& analytic, float h,
              double atol, double rtol) {
  ASSERT_EQ(var.size(), analytic.size()) << what;
  StepContext ctx;
  std::vector<double> numeric(var.size());
  for (std::size_t i = 0; i < var.size(); ++i) {
    const float v = var[i];
    const float vp = v + h, vm = v - h;
    var[i] = vp;
    rig.k->forward(ctx);
    const double lp = rig.loss();
    var[i] = vm;
    rig.k->forward(ctx);
    const double lm = rig.loss();
    var[i] = v;
    numeric[i] = (lp - lm) / (static_cast<double>(vp) - static_cast<double>(vm));
  }
  rig.k->forward(ctx);
  expect_close(what, analytic, numeric, atol, rtol);
}

// Forward against the reference, then dx, dw (and db) against finite differences. dw is filled
// with garbage first: backward must overwrite it, not accumulate into it.
// x_layout / y_layout: the layouts the kernel is built for; x, y, dy and dx are held in them, the
// reference works on plain copies.
void check_layer(const std::string& text, Shape input, int classes, int batch, std::uint64_t seed,
                 double fwd_atol = 1e-4, double fwd_rtol = 1e-4, Layout x_layout = Layout::kPlain,
                 Layout y_layout = Layout::kPlain, int threads = 1) {
  SCOPED_TRACE(text + " x block " + std::to_string(block_of(x_layout)) + " y block " +
               std::to_string(block_of(y_layout)) + ", " + std::to_string(threads) + " thread(s)");
  auto be = make_cpu_backend(threads);
  const LayerSpec l = layer_of(text, input, classes);
  Rig rig(*be, l, batch, seed, true, true, 0, x_layout, y_layout);
  // Copied in place (never assigned): the kernel holds the buffer's address.
  if (l.kind == LayerKind::kMaxPool) {
    const std::vector<float> v = distinct(rig.x.size(), seed, 0.03f);
    std::copy(v.begin(), v.end(), rig.x.begin());
  }
  if (l.kind == LayerKind::kRelu) {
    const std::vector<float> v = away_from_zero(rig.x.size(), seed);
    std::copy(v.begin(), v.end(), rig.x.begin());
  }
  StepContext ctx;
  rig.k->forward(ctx);

  std::vector<double> ref;
  const std::vector<double> x_plain = to_double(relayout(rig.x, batch, l.in, x_layout, Layout::kPlain));
  switch (l.kind) {
    case LayerKind::kConv:
      ref = ref::conv2d(l, batch, x_plain, to_double(rig.w));
      break;
    case LayerKind::kFc:
      ref = ref::fc(l, batch, x_plain, to_double(rig.w));
      break;
    case LayerKind::kMaxPool:
      ref = ref::maxpool(l, batch, x_plain);
      break;
    case LayerKind::kRelu:
      ref = ref::relu(x_plain);
      break;
    default:
      FAIL() << "not a reference layer";
  }
  expect_close("forward", rig.y, relayout(ref, batch, l.out, Layout::kPlain, y_layout), fwd_atol, fwd_rtol);

  std::fill(rig.dx.begin(), rig.dx.end(), 7.0f);
  std::fill(rig.dw.begin(), rig.dw.end(), 7.0f);
  rig.k->backward(ctx);
  const std::vector<float> dx = rig.dx, dw = rig.dw;
  const float h = 1e-2f;
  // Float kernels, float steps: the observed error is ~1e-5 relative; a wrong kernel is off by O(1).
  check_fd("dx", rig, rig.x, dx, h, 2e-4, 2e-3);
  if (!rig.w.empty()) {
    const std::size_t nw = rig.w.size() - static_cast<std::size_t>(l.channels);
    check_fd("dw and db", rig, rig.w, dw, h, 2e-4, 2e-3);
    // The bias gradient is the sum of dy over the batch and the output positions.
    const int plane = l.out.h * l.out.w;
    const std::vector<float> dy_plain = relayout(rig.dy, batch, l.out, y_layout, Layout::kPlain);
    std::vector<double> db(static_cast<std::size_t>(l.channels), 0.0);
    for (int n = 0; n < batch; ++n)
      for (int o = 0; o < l.channels; ++o)
        for (int p = 0; p < plane; ++p)
          db[static_cast<std::size_t>(o)] += dy_plain[(static_cast<std::size_t>(n) * l.channels + o) * plane + p];
    expect_close("db = sum dy", std::vector<float>(dw.begin() + static_cast<std::ptrdiff_t>(nw), dw.end()), db, 1e-4,
                 1e-4);
  }
  // A second backward gives the same gradients (overwritten, not accumulated).
  rig.k->backward(ctx);
  EXPECT_EQ(rig.dx, dx);
  EXPECT_EQ(rig.dw, dw);
}

TEST(Layers, ConvSame3x3) {
  const LayerSpec l = layer_of("conv:3x3:4:same,fc:10", {2, 7, 7}, 10);
  EXPECT_EQ(l.out, (Shape{4, 7, 7}));
  EXPECT_EQ(l.pad_top, 1);
  EXPECT_EQ(l.pad_bottom, 1);
  check_layer("conv:3x3:4:same,fc:10", {2, 7, 7}, 10, 2, 11);
}

TEST(Layers, ConvSameEvenKernelPadsMoreAtTheEnd) {
  // 4x4 SAME on 7x7: total padding 3, TensorFlow puts 1 before and 2 after.
  const LayerSpec l = layer_of("conv:4x4:3:same,fc:10", {2, 7, 7}, 10);
  EXPECT_EQ(l.out, (Shape{3, 7, 7}));
  EXPECT_EQ(l.pad_top, 1);
  EXPECT_EQ(l.pad_bottom, 2);
  EXPECT_EQ(l.pad_left, 1);
  EXPECT_EQ(l.pad_right, 2);
  check_layer("conv:4x4:3:same,fc:10", {2, 7, 7}, 10, 2, 12);
}

TEST(Layers, ConvSameNonSquareKernel) {
  const LayerSpec l = layer_of("conv:2x3:3:same,fc:10", {2, 6, 5}, 10);
  EXPECT_EQ(l.out, (Shape{3, 6, 5}));
  EXPECT_EQ(l.pad_top, 0);
  EXPECT_EQ(l.pad_bottom, 1);
  EXPECT_EQ(l.pad_left, 1);
  EXPECT_EQ(l.pad_right, 1);
  check_layer("conv:2x3:3:same,fc:10", {2, 6, 5}, 10, 2, 13);
}

TEST(Layers, ConvValid) {
  const LayerSpec l = layer_of("conv:3x3:4:valid,fc:10", {2, 7, 7}, 10);
  EXPECT_EQ(l.out, (Shape{4, 5, 5}));
  check_layer("conv:3x3:4:valid,fc:10", {2, 7, 7}, 10, 3, 14);
}

TEST(Layers, ConvSameStride2Asymmetric) {
  // 3x3 stride 2 SAME on 8x8: out 4, total padding 1, all of it at the bottom / right.
  const LayerSpec l = layer_of("conv:3x3:4:same:s2,fc:10", {2, 8, 8}, 10);
  EXPECT_EQ(l.out, (Shape{4, 4, 4}));
  EXPECT_EQ(l.pad_top, 0);
  EXPECT_EQ(l.pad_bottom, 1);
  EXPECT_EQ(l.pad_left, 0);
  EXPECT_EQ(l.pad_right, 1);
  check_layer("conv:3x3:4:same:s2,fc:10", {2, 8, 8}, 10, 2, 15);
}

TEST(Layers, ConvSameStride2OddInput) {
  const LayerSpec l = layer_of("conv:3x3:4:same:s2,fc:10", {2, 7, 7}, 10);
  EXPECT_EQ(l.out, (Shape{4, 4, 4}));
  check_layer("conv:3x3:4:same:s2,fc:10", {2, 7, 7}, 10, 2, 16);
}

TEST(Layers, ConvValidStride2) {
  const LayerSpec l = layer_of("conv:3x3:4:valid:s2,fc:10", {2, 7, 7}, 10);
  EXPECT_EQ(l.out, (Shape{4, 3, 3}));
  check_layer("conv:3x3:4:valid:s2,fc:10", {2, 7, 7}, 10, 2, 17);
}

TEST(Layers, MaxPool2DropsTheLastRowAndColumn) {
  const LayerSpec l = layer_of("maxpool:2,fc:10", {2, 7, 7}, 10);
  EXPECT_EQ(l.out, (Shape{2, 3, 3}));
  check_layer("maxpool:2,fc:10", {2, 7, 7}, 10, 3, 21, 0.0, 0.0);  // a max is exact
}

TEST(Layers, MaxPoolOverlappingWindows) {
  const LayerSpec l = layer_of("maxpool:3:2,fc:10", {2, 7, 7}, 10);
  EXPECT_EQ(l.out, (Shape{2, 3, 3}));
  check_layer("maxpool:3:2,fc:10", {2, 7, 7}, 10, 2, 22, 0.0, 0.0);
}

TEST(Layers, Relu) { check_layer("relu,fc:10", {2, 7, 7}, 10, 2, 31, 0.0, 0.0); }

// Blocked activations (Note [Activation layouts]): every kernel that may be given them, in each
// combination the CPU backend can choose, against the same reference and finite differences.
TEST(BlockedLayouts, Conv) {
  // Small shapes: the finite differences run one forward per element of x and w.
  for (Layout b : {Layout::kBlocked8, Layout::kBlocked16}) {
    const std::string c = std::to_string(block_of(b));  // channels: one block
    // A first convolution (one input channel, plain) writing blocked output.
    check_layer("conv:5x5:" + c + ":same,fc:10", {1, 6, 6}, 10, 2, 81, 1e-4, 1e-4, Layout::kPlain, b);
    // The same with its images shared out between 2 threads (3 images: uneven chunks).
    check_layer("conv:5x5:" + c + ":same,fc:10", {1, 6, 6}, 10, 3, 91, 1e-4, 1e-4, Layout::kPlain, b, 2);
    // Blocked to blocked, odd sizes and a stride.
    check_layer("conv:3x3:" + c + ":same,fc:10", {block_of(b), 5, 5}, 10, 1, 82, 1e-4, 1e-4, b, b);
    check_layer("conv:3x3:" + c + ":valid:s2,fc:10", {block_of(b), 5, 5}, 10, 2, 83, 1e-4, 1e-4, b, b);
    // A first convolution with a stride whose padded image is narrower than the input (Wp 5 < W 6).
    check_layer("conv:3x3:" + c + ":valid:s2,fc:10", {1, 6, 6}, 10, 2, 93, 1e-4, 1e-4, Layout::kPlain, b);
    // Blocked to plain, and plain to blocked.
    check_layer("conv:3x3:4:same,fc:10", {block_of(b), 4, 4}, 10, 1, 84, 1e-4, 1e-4, b, Layout::kPlain);
    check_layer("conv:3x3:" + c + ":same,fc:10", {4, 4, 4}, 10, 1, 85, 1e-4, 1e-4, Layout::kPlain, b);
  }
}

TEST(BlockedLayouts, MaxPool) {
  for (Layout b : {Layout::kBlocked8, Layout::kBlocked16}) {
    check_layer("maxpool:2,fc:10", {16, 7, 7}, 10, 2, 86, 0.0, 0.0, b, b);
    check_layer("maxpool:2,fc:10", {32, 4, 4}, 10, 2, 87, 0.0, 0.0, b, Layout::kPlain);  // before flatten
    check_layer("maxpool:3:2,fc:10", {16, 7, 7}, 10, 1, 88, 0.0, 0.0, b, b);             // overlapping
    check_layer("maxpool:2,fc:10", {16, 7, 7}, 10, 3, 92, 0.0, 0.0, b, b, 2);            // samples on 2 threads
  }
}

TEST(BlockedLayouts, Relu) {
  for (Layout b : {Layout::kBlocked8, Layout::kBlocked16})
    check_layer("relu,fc:10", {16, 5, 5}, 10, 2, 89, 0.0, 0.0, b, b);
}

TEST(BlockedLayouts, BackendKeepsInnerActivationsBlocked) {
  auto be = make_cpu_backend(1);
  const ModelSpec lenet = parse_model_spec(
      "conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10",
      {1, 28, 28}, 10);
  const std::vector<Layout> l = be->activation_layouts(lenet);
  ASSERT_EQ(l.size(), lenet.layers.size() + 1);
  const Layout b = l[1];
  EXPECT_NE(b, Layout::kPlain);
  for (std::size_t i = 1; i <= 5; ++i) EXPECT_EQ(l[i], b) << i;                        // conv .. the last pool's input
  for (std::size_t i : {0, 6, 7, 8, 9, 10, 11}) EXPECT_EQ(l[i], Layout::kPlain) << i;  // input, flatten, fc, logits
  // Channels that no block divides, and a ReLU between a conv and an fc, stay plain.
  const ModelSpec odd =
      parse_model_spec("conv:3x3:6:same,relu,maxpool:2,conv:3x3:16:same,relu,flatten,fc:10", {1, 8, 8}, 10);
  for (Layout x : be->activation_layouts(odd)) EXPECT_EQ(x, Layout::kPlain);
  // tiny: 8 channels, then 16. Where oneDNN runs AVX-512 each activation is one block of its
  // channels (NHWC, Note [A block size per activation] in src/backend/cpu/cpu_backend.cpp),
  // elsewhere blocks of 8 throughout.
  const bool avx512 = dnnl::get_effective_cpu_isa() >= dnnl::cpu_isa::avx512_core;
  const ModelSpec tiny =
      parse_model_spec("conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 28, 28}, 10);
  EXPECT_EQ(be->activation_layouts(tiny),
            (std::vector<Layout>{Layout::kPlain, Layout::kBlocked8, Layout::kBlocked8,
                                 avx512 ? Layout::kBlocked16 : Layout::kBlocked8, Layout::kPlain, Layout::kPlain,
                                 Layout::kPlain}));
  // 24 channels, then 32: blocks of 8 and 16 would be three and two blocks, not NHWC, and oneDNN
  // has no fast kernels from nChw8c into nChw16c, so blocks of 8 throughout on every CPU.
  const ModelSpec wide = parse_model_spec(
      "conv:3x3:24:same,relu,maxpool:2,conv:3x3:32:same,relu,maxpool:2,flatten,fc:10", {1, 12, 12}, 10);
  const std::vector<Layout> w = be->activation_layouts(wide);
  for (std::size_t i = 1; i <= 5; ++i) EXPECT_EQ(w[i], Layout::kBlocked8) << i;
}

TEST(Layers, Fc) { check_layer("fc:12,fc:10", {18, 1, 1}, 10, 3, 41); }

TEST(Layers, WideFcForwardMatchesTheReference) {
  // lenet's fc1 (3136 -> 1024) at the training and the evaluation batch: on AVX-512 its forward is a
  // oneDNN matmul reading the (O, I) weights as an (I, O) matrix in `ba` order (Note [The fc
  // forward as a matmul] in src/backend/cpu/fc.cpp), elsewhere the inner product.
  auto be = make_cpu_backend(1);
  const LayerSpec l = layer_of("fc:1024,fc:10", {64, 7, 7}, 10);
  for (const auto& [batch, training] : {std::pair{50, true}, std::pair{7, false}}) {
    SCOPED_TRACE("batch " + std::to_string(batch) + (training ? ", training" : ", inference"));
    Rig rig(*be, l, batch, 44, true, training);
    // Not only right but on the path meant: the matmul where oneDNN runs AVX-512 (its brgemm).
    const bool avx512 = dnnl::get_effective_cpu_isa() >= dnnl::cpu_isa::avx512_core;
    EXPECT_EQ(rig.k->describe().find("fc fwd matmul brg") != std::string::npos, avx512) << rig.k->describe();
    StepContext ctx;
    rig.k->forward(ctx);
    expect_close("forward", rig.y, ref::fc(l, batch, to_double(rig.x), to_double(rig.w)), 1e-4, 1e-4);
  }
}

TEST(Layers, FcOnChwInputReadsCHWOrder) {
  // No flatten: the fc reads (C, H, W) as C*H*W values, in C, H, W order.
  const LayerSpec l = layer_of("fc:10", {2, 3, 3}, 10);
  EXPECT_EQ(l.in, (Shape{2, 3, 3}));
  check_layer("fc:10", {2, 3, 3}, 10, 3, 42);
}

TEST(Layers, NoInputGradientForAFirstLayer) {
  // Every kernel kind accepts dx == nullptr and still writes its parameter gradients.
  auto be = make_cpu_backend(1);
  const ModelSpec spec = parse_model_spec("conv:3x3:2:same,relu,maxpool:2,dropout:0.5,flatten,fc:10", {1, 6, 6}, 10);
  for (std::size_t i = 0; i < spec.layers.size(); ++i) {
    SCOPED_TRACE(spec.layers[i].text);
    Rig rig(*be, spec.layers[i], 2, 50 + i, /*with_dx=*/false, true, static_cast<int>(i));
    StepContext ctx;
    ctx.seed = 3;
    rig.k->forward(ctx);
    std::fill(rig.dw.begin(), rig.dw.end(), 7.0f);
    rig.k->backward(ctx);
    if (spec.layers[i].kind == LayerKind::kConv || spec.layers[i].kind == LayerKind::kFc) {
      // Compare with the same layer built with an input gradient.
      Rig full(*be, spec.layers[i], 2, 50 + i, true, true, static_cast<int>(i));
      full.k->forward(ctx);
      full.k->backward(ctx);
      EXPECT_EQ(rig.dw, full.dw);
      EXPECT_TRUE(std::none_of(rig.dw.begin(), rig.dw.end(), [](float v) { return v == 7.0f; }));
    }
  }
}

TEST(Layers, InferenceKernelsMatchTraining) {
  auto be = make_cpu_backend(1);
  const ModelSpec spec = parse_model_spec("conv:3x3:3:same,relu,maxpool:2,fc:10", {2, 6, 6}, 10);
  for (std::size_t i = 0; i < spec.layers.size(); ++i) {
    SCOPED_TRACE(spec.layers[i].text);
    Rig train(*be, spec.layers[i], 2, 60 + i, true, true);
    Rig infer(*be, spec.layers[i], 2, 60 + i, true, false);
    StepContext ctx;
    train.k->forward(ctx);
    ctx.training = false;
    infer.k->forward(ctx);
    for (std::size_t j = 0; j < train.y.size(); ++j) ASSERT_NEAR(infer.y[j], train.y[j], 1e-5) << j;
  }
}

TEST(Layers, FlattenCopiesOrAliases) {
  auto be = make_cpu_backend(1);
  const LayerSpec l = layer_of("flatten,fc:10", {2, 3, 3}, 10);
  EXPECT_EQ(l.out, (Shape{18, 1, 1}));
  Rig rig(*be, l, 3, 70);
  StepContext ctx;
  rig.k->forward(ctx);
  EXPECT_EQ(rig.y, rig.x);
  rig.k->backward(ctx);
  EXPECT_EQ(rig.dx, rig.dy);

  // Aliased, as the model builds it: nothing moves.
  std::vector<float> a = uniform(54, 71), d = uniform(54, 72);
  const std::vector<float> a0 = a, d0 = d;
  LayerBuffers b;
  b.batch = 3;
  b.x = a.data();
  b.y = a.data();
  b.dy = d.data();
  b.dx = d.data();
  auto k = be->make_layer(l, 0, b, true);
  k->forward(ctx);
  k->backward(ctx);
  EXPECT_EQ(a, a0);
  EXPECT_EQ(d, d0);
}

// ---- dropout ----

struct DropoutRig {
  std::vector<float> x, y, dy, dx;
  std::unique_ptr<LayerKernel> k;
  DropoutRig(Backend& be, const LayerSpec& l, int batch, int index, bool training, std::uint64_t seed) {
    const auto n = static_cast<std::size_t>(batch * l.in.size());
    x = uniform(n, seed, 0.5f, 1.5f);  // never zero: a zero output means a dropped element
    y.assign(n, -1.0f);
    dy = uniform(n, seed + 1, 0.5f, 1.5f);
    dx.assign(n, -1.0f);
    LayerBuffers b;
    b.batch = batch;
    b.x = x.data();
    b.y = y.data();
    if (training) {
      b.dy = dy.data();
      b.dx = dx.data();
    }
    k = be.make_layer(l, index, b, training);
  }
};

TEST(Dropout, RateScaleAndBackwardMask) {
  auto be = make_cpu_backend(1);
  for (float rate : {0.5f, 0.2f}) {
    SCOPED_TRACE(rate);
    LayerSpec l = layer_of("dropout:0.5,fc:10", {4, 16, 16}, 10);
    l.drop_rate = rate;
    const int batch = 4;
    DropoutRig r(*be, l, batch, 3, true, 80);
    StepContext ctx;
    ctx.seed = 1234;
    ctx.step = 5;
    r.k->forward(ctx);
    const float keep_scale = 1.0f / (1.0f - rate);
    std::size_t dropped = 0;
    for (std::size_t i = 0; i < r.y.size(); ++i) {
      if (r.y[i] == 0.0f) {
        ++dropped;
      } else {
        ASSERT_FLOAT_EQ(r.y[i], r.x[i] * keep_scale) << i;
      }
    }
    const double n = static_cast<double>(r.y.size());
    const double frac = static_cast<double>(dropped) / n;
    const double sd = std::sqrt(rate * (1.0 - rate) / n);  // 4096 elements: sd < 0.008
    EXPECT_NEAR(frac, rate, 5 * sd) << dropped << " of " << r.y.size() << " dropped";
    // Each row is dropped at about the rate too (the mask is not one row repeated).
    const std::size_t per = static_cast<std::size_t>(l.in.size());
    for (int row = 0; row + 1 < batch; ++row)
      EXPECT_FALSE(std::equal(r.y.begin() + static_cast<std::ptrdiff_t>(row * per),
                              r.y.begin() + static_cast<std::ptrdiff_t>((row + 1) * per),
                              r.y.begin() + static_cast<std::ptrdiff_t>((row + 1) * per),
                              [](float a, float b) { return (a == 0.0f) == (b == 0.0f); }))
          << "rows " << row << " and " << row + 1 << " share a mask";

    r.k->backward(ctx);
    for (std::size_t i = 0; i < r.y.size(); ++i) {
      if (r.y[i] == 0.0f)
        ASSERT_EQ(r.dx[i], 0.0f) << i;
      else
        ASSERT_FLOAT_EQ(r.dx[i], r.dy[i] * keep_scale) << i;
    }
  }
}

std::vector<bool> kept(const std::vector<float>& y) {
  std::vector<bool> m(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) m[i] = y[i] != 0.0f;
  return m;
}

TEST(Dropout, MaskDependsOnGlobalRowNotOnBatchSplit) {
  auto be = make_cpu_backend(1);
  const LayerSpec l = layer_of("dropout:0.5,fc:10", {2, 5, 5}, 10);
  const int index = 2;
  DropoutRig whole(*be, l, 4, index, true, 90);
  DropoutRig half(*be, l, 2, index, true, 91);
  StepContext ctx;
  ctx.seed = 77;
  ctx.step = 12;
  ctx.first_sample = 0;
  whole.k->forward(ctx);
  const std::vector<bool> mw = kept(whole.y);
  const std::size_t per = 50, n_half = 2 * per;
  for (std::int64_t first : {0, 2}) {
    ctx.first_sample = first;
    half.k->forward(ctx);
    const std::vector<bool> mh = kept(half.y);
    const std::vector<bool> expect(
        mw.begin() + static_cast<std::ptrdiff_t>(first * 50),
        mw.begin() + static_cast<std::ptrdiff_t>(first * 50 + static_cast<std::int64_t>(n_half)));
    EXPECT_EQ(mh, expect) << "first_sample " << first;
  }
  // Another step, seed or layer index gives another mask.
  auto mask_of = [&](std::uint64_t seed, std::int64_t step, int layer) {
    DropoutRig r(*be, l, 4, layer, true, 90);
    StepContext c;
    c.seed = seed;
    c.step = step;
    r.k->forward(c);
    return kept(r.y);
  };
  EXPECT_EQ(mask_of(77, 12, index), mw);
  EXPECT_NE(mask_of(77, 13, index), mw);
  EXPECT_NE(mask_of(78, 12, index), mw);
  EXPECT_NE(mask_of(77, 12, index + 1), mw);
}

TEST(Dropout, InferenceIsTheIdentity) {
  auto be = make_cpu_backend(1);
  const LayerSpec l = layer_of("dropout:0.5,fc:10", {2, 5, 5}, 10);
  StepContext ctx;
  ctx.seed = 5;
  ctx.training = false;
  DropoutRig infer(*be, l, 3, 0, false, 100);
  infer.k->forward(ctx);
  EXPECT_EQ(infer.y, infer.x);
  // A training kernel run with training = false (evaluation) is the identity too.
  DropoutRig train(*be, l, 3, 0, true, 101);
  train.k->forward(ctx);
  EXPECT_EQ(train.y, train.x);
}

// ---- a whole model ----

// The double reference of "conv:3x3:4:same,relu,maxpool:2,flatten,fc:10": returns the logits
// and, in *pattern, the ReLU signs and max-pool argmaxes (a change means a kink was crossed).
std::vector<double> ref_model(const ModelSpec& spec, int batch, const std::vector<double>& x,
                              const std::vector<double>& params, std::vector<int>* pattern) {
  auto slice = [&](int layer) {
    std::int64_t begin = -1, end = -1;
    for (const ParamTensor& p : spec.params)
      if (p.layer == layer) {
        if (!p.is_bias)
          begin = p.offset;
        else
          end = p.offset + p.size;
      }
    return std::vector<double>(params.begin() + begin, params.begin() + end);
  };
  const LayerSpec& conv = spec.layers[0];
  const LayerSpec& pool = spec.layers[2];
  const std::vector<double> z = ref::conv2d(conv, batch, x, slice(0));
  const std::vector<double> a = ref::relu(z);
  pattern->clear();
  for (double v : z) pattern->push_back(v > 0.0 ? 1 : 0);
  const int C = pool.in.c, H = pool.in.h, W = pool.in.w;
  for (int n = 0; n < batch; ++n)
    for (int c = 0; c < C; ++c)
      for (int oh = 0; oh < pool.out.h; ++oh)
        for (int ow = 0; ow < pool.out.w; ++ow) {
          int best = -1;
          double bv = 0.0;
          for (int kh = 0; kh < 2; ++kh)
            for (int kw = 0; kw < 2; ++kw) {
              const double v = a[((static_cast<std::size_t>(n) * C + c) * H + oh * 2 + kh) * W + ow * 2 + kw];
              if (v > 0.0 && (best < 0 || v > bv)) {
                best = kh * 2 + kw;
                bv = v;
              }
            }
          pattern->push_back(best);
        }
  const std::vector<double> p = ref::maxpool(pool, batch, a);
  return ref::fc(spec.layers[4], batch, p, slice(4));
}

// The CPU backend with every activation plain: the layouts every kernel was first written for.
class PlainLayouts final : public Backend {
 public:
  std::string name() const override { return "cpu (plain layouts)"; }
  std::unique_ptr<Buffer> allocate(std::int64_t count) override { return be_->allocate(count); }
  std::unique_ptr<LayerKernel> make_layer(const LayerSpec& spec, int index, const LayerBuffers& buffers,
                                          bool training) override {
    return be_->make_layer(spec, index, buffers, training);
  }
  void plan_model(const ModelSpec& spec, const std::vector<Layout>& layouts, int batch, int first, int end,
                  bool training) override {
    be_->plan_model(spec, layouts, batch, first, end, training);
  }
  void softmax_cross_entropy(const float* logits, const std::int32_t* labels, int batch, int classes, float* dlogits,
                             float grad_scale, LossMeter& meter) override {
    be_->softmax_cross_entropy(logits, labels, batch, classes, dlogits, grad_scale, meter);
  }
  std::unique_ptr<LossMeter> make_loss_meter() override { return be_->make_loss_meter(); }
  std::unique_ptr<DataSource> make_data_source(const Split& split, int batch) override {
    return be_->make_data_source(split, batch);
  }
  std::unique_ptr<OptimizerPass> make_optimizer_pass(const OptimizerConfig& cfg, ParameterStore* store) override {
    return be_->make_optimizer_pass(cfg, store);
  }
  void add(float* dst, const float* src, std::int64_t n) override { be_->add(dst, src, n); }
  void copy(float* dst, const float* src, std::int64_t n) override { be_->copy(dst, src, n); }
  void scale(float* x, float a, std::int64_t n) override { be_->scale(x, a, n); }
  void upload(std::span<const float> host, float* dst) override { be_->upload(host, dst); }
  void download(const float* src, std::span<float> host) override { be_->download(src, host); }
  std::unique_ptr<StepGuard> make_step_guard(bool keep_verdict) override { return be_->make_step_guard(keep_verdict); }

 private:
  std::unique_ptr<Backend> be_ = make_cpu_backend(1);
};

void step_on(Model& m, Backend& be, const std::vector<float>& x, const std::vector<std::int32_t>& labels, int batch);

TEST(BlockedLayouts, ModelMatchesThePlainOne) {
  // Two convs, ReLUs and pools with blocked activations between them (the last pool writes plain
  // for flatten), against the same model with every activation plain; and tiny's shape, whose
  // activations on AVX-512 are one block each of two sizes, 8 then 16 (Notes [A block size per
  // activation] and [One block is NHWC]).
  for (const char* text : {"conv:3x3:16:same,relu,maxpool:2,conv:3x3:16:same,relu,maxpool:2,flatten,fc:10",
                           "conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10"}) {
    SCOPED_TRACE(text);
    auto be = make_cpu_backend(1);
    PlainLayouts plain_be;
    const ModelSpec spec = parse_model_spec(text, {1, 12, 12}, 10);
    ASSERT_NE(be->activation_layouts(spec)[1], Layout::kPlain);
    ASSERT_NE(be->activation_layouts(spec)[3], Layout::kPlain);
    const int batch = 4;
    std::vector<float> params(static_cast<std::size_t>(spec.param_count));
    init_params(spec, parse_init_spec("he"), parse_init_spec("constant:0.1"), 5, params.data());
    std::vector<float> g_blocked(params.size(), 7.0f), g_plain(params.size(), 7.0f);
    Model blocked(spec, batch, *be, params.data(), g_blocked.data());
    Model plain(spec, batch, plain_be, params.data(), g_plain.data());
    const std::vector<float> x = uniform(static_cast<std::size_t>(batch * 144), 6);
    const std::vector<std::int32_t> labels{1, 4, 9, 0};
    for (Model* m : {&blocked, &plain}) step_on(*m, *be, x, labels, batch);
    const std::vector<float> lb(blocked.logits(), blocked.logits() + batch * 10);
    const std::vector<float> lp(plain.logits(), plain.logits() + batch * 10);
    expect_close("logits", lb, to_double(lp), 1e-5, 1e-4);
    expect_close("gradients", g_blocked, to_double(g_plain), 1e-5, 1e-4);
  }
}

// Note [The first convolution reads its pool's gradient] in src/backend/cpu/conv.cpp: the first
// convolution rebuilding its dy from the pool's gradient gives the bits of the pool writing dx.
// One step of m on (x, labels): forward, then (a training model) the loss gradient and backward.
void step_on(Model& m, Backend& be, const std::vector<float>& x, const std::vector<std::int32_t>& labels, int batch) {
  StepContext ctx;
  std::copy(x.begin(), x.end(), m.input());
  m.forward(ctx);
  if (!m.training()) return;
  be.softmax_cross_entropy(m.logits(), labels.data(), batch, 10, m.dlogits(), 1.0f / static_cast<float>(batch));
  m.backward(ctx);
}

// Whether a and b hold the same bits element by element (-0 is not +0, a NaN equals its own bits).
::testing::AssertionResult same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " against " << b.size() << " elements";
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]))
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " against " << b[i];
  return ::testing::AssertionSuccess();
}

// Layer `layer`'s weight (or bias) tensor; Error when it has none.
const ParamTensor& param_of(const ModelSpec& spec, int layer, bool is_bias) {
  const auto t = std::find_if(spec.params.begin(), spec.params.end(),
                              [&](const ParamTensor& p) { return p.layer == layer && p.is_bias == is_bias; });
  MNIST_CHECK(t != spec.params.end(), ExitCode::kRuntime,
              "layer " + std::to_string(layer) + " has no " + (is_bias ? "bias" : "weight"));
  return *t;
}

TEST(BlockedLayouts, PoolGradientIntoFirstConvIsBitwiseTheSame) {
  struct Case {
    std::string model;
    Shape input;
    int batch, threads;
    bool fused;  // whether the backend may hand the pool's gradient to the convolution
  };
  const std::vector<Case> cases{
      {"conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 12, 12}, 4, 1, true},   // tiny's
      // 8 output channels, not 16: for 1 -> 16 AVX-512 hosts have a oneDNN weight-gradient kernel,
      // so no own loop and nothing to fuse there.
      {"conv:5x5:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 8, 8}, 3, 2, true},     // 2 threads
      {"conv:3x3:8:valid,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 10, 10}, 2, 1, true},  // no padding
      // 3 input channels: oneDNN has a weight-gradient kernel for that input, so no own loop.
      {"conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {3, 12, 8}, 3, 2, false},
      {"conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10",
       {1, 13, 13},
       2,
       1,
       false},                                                                                   // odd: no tiling
      {"conv:3x3:8:same,maxpool:3:2,conv:3x3:16:same,flatten,fc:10", {1, 12, 12}, 2, 1, false},  // overlapping windows
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.model + " on " + std::to_string(k.input.h) + "x" + std::to_string(k.input.w));
    // The forward pass oneDNN's either way, so that only the gradient's path differs.
    auto fused_be = make_cpu_backend(k.threads, {.pool_gradient = true, .conv_pool_forward = false});
    auto apart_be = make_cpu_backend(k.threads, {.pool_gradient = false, .conv_pool_forward = false});
    const ModelSpec spec = parse_model_spec(k.model, k.input, 10);
    ASSERT_NE(fused_be->activation_layouts(spec)[1], Layout::kPlain);
    std::vector<float> params(static_cast<std::size_t>(spec.param_count));
    init_params(spec, parse_init_spec("he"), parse_init_spec("constant:0.1"), 17, params.data());
    std::vector<float> g_fused(params.size(), 7.0f), g_apart(params.size(), 3.0f);
    Model fused(spec, k.batch, *fused_be, params.data(), g_fused.data());
    Model apart(spec, k.batch, *apart_be, params.data(), g_apart.data());
    const std::string said = "reading the max pool's gradient";
    EXPECT_EQ(fused.describe().find(said) != std::string::npos, k.fused) << fused.describe();
    EXPECT_EQ(apart.describe().find(said), std::string::npos) << apart.describe();
    const std::vector<float> x = uniform(static_cast<std::size_t>(k.batch) * k.input.size(), 23);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(k.batch));
    for (int n = 0; n < k.batch; ++n) labels[static_cast<std::size_t>(n)] = (3 * n + 1) % 10;
    for (int step = 0; step < 2; ++step) {  // twice: the second backward overwrites the first
      for (Model* m : {&fused, &apart}) step_on(*m, *fused_be, x, labels, k.batch);
      ASSERT_TRUE(same_bits(g_fused, g_apart)) << "gradients";
      // Not vacuous: the first convolution's weight gradient is not zero.
      const ParamTensor& first = param_of(spec, 0, false);
      const auto w0 = g_fused.begin() + first.offset;
      EXPECT_TRUE(std::any_of(w0, w0 + first.size, [](float v) { return v != 0.0f; }));
    }
  }
}

// Note [The first convolution and its pool in one pass] in src/backend/cpu/conv.cpp: the pool
// computing the convolution before it gives oneDNN's outputs (the same fused multiply-adds in the
// same order: bitwise on the CPUs measured, checked here to float rounding since oneDNN's kernel
// differs per CPU), the same argmax (so the same gradients), in training and in inference.
TEST(BlockedLayouts, FirstConvAndPoolInOnePass) {
  struct Case {
    std::string model;
    Shape input;
    int batch, threads;
    bool fused;
  };
  const std::vector<Case> cases{
      {"conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 12, 12}, 4, 1, true},   // tiny's
      {"conv:5x5:16:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 8, 8}, 3, 2, true},    // 2 threads
      {"conv:3x3:8:valid,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 10, 10}, 2, 1, true},  // no padding
      {"conv:2x2:8:same,maxpool:2,conv:3x3:8:same,maxpool:2,flatten,fc:10", {1, 8, 6}, 2, 1, true},      // even kernel
      // Five interior windows per row (two pairs and a single), not square.
      {"conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 12, 14}, 2, 1, true},
      {"conv:5x5:8:same,maxpool:2,conv:3x3:8:same,maxpool:2,flatten,fc:10", {1, 8, 10}, 2, 1, true},
      // Taps not known at compile time: 7 x 7 (pad 3), and 3 x 5 (kh != kw).
      {"conv:7x7:8:same,maxpool:2,conv:3x3:8:same,maxpool:2,flatten,fc:10", {1, 16, 14}, 2, 2, true},
      {"conv:3x5:8:same,maxpool:2,conv:3x3:8:same,maxpool:2,flatten,fc:10", {1, 10, 12}, 2, 1, true},
      {"conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 13, 13}, 2, 1, false},  // odd
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.model + " on " + std::to_string(k.input.h) + "x" + std::to_string(k.input.w));
    auto fused_be = make_cpu_backend(k.threads);
    auto apart_be = make_cpu_backend(k.threads, {.pool_gradient = false, .conv_pool_forward = false});
    // The hand-written AVX2 kernels against their portable versions (std::fma): the same bits.
    auto portable_be = make_cpu_backend(k.threads, {.avx2_kernels = false});
    const ModelSpec spec = parse_model_spec(k.model, k.input, 10);
    ASSERT_NE(fused_be->activation_layouts(spec)[1], Layout::kPlain);
    std::vector<float> params(static_cast<std::size_t>(spec.param_count));
    init_params(spec, parse_init_spec("he"), parse_init_spec("normal:0.1"), 29, params.data());
    std::vector<float> g_fused(params.size(), 7.0f), g_apart(params.size(), 3.0f), g_portable(params.size(), 5.0f);
    Model fused(spec, k.batch, *fused_be, params.data(), g_fused.data());
    Model apart(spec, k.batch, *apart_be, params.data(), g_apart.data());
    Model portable(spec, k.batch, *portable_be, params.data(), g_portable.data());
    Model fused_eval(spec, k.batch, *fused_be, params.data(), nullptr);
    const std::string said = "computes the convolution before it";
    EXPECT_EQ(fused.describe().find(said) != std::string::npos, k.fused) << fused.describe();
    EXPECT_EQ(fused_eval.describe().find(said) != std::string::npos, k.fused) << fused_eval.describe();
    EXPECT_EQ(portable.describe().find(said) != std::string::npos, k.fused) << portable.describe();
    EXPECT_EQ(apart.describe().find(said), std::string::npos) << apart.describe();
    const std::vector<float> x = uniform(static_cast<std::size_t>(k.batch) * k.input.size(), 31);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(k.batch));
    for (int n = 0; n < k.batch; ++n) labels[static_cast<std::size_t>(n)] = (7 * n + 2) % 10;
    for (Model* m : {&fused, &apart, &fused_eval, &portable}) step_on(*m, *fused_be, x, labels, k.batch);
    const std::size_t nl = static_cast<std::size_t>(k.batch) * 10;
    const std::vector<float> lf(fused.logits(), fused.logits() + nl), la(apart.logits(), apart.logits() + nl),
        le(fused_eval.logits(), fused_eval.logits() + nl);
    expect_close("logits", lf, to_double(la), 1e-5, 1e-5);
    expect_close("logits in inference", le, to_double(la), 1e-5, 1e-5);
    expect_close("gradients", g_fused, to_double(g_apart), 1e-5, 1e-4);
    const std::vector<float> lp(portable.logits(), portable.logits() + nl);
    EXPECT_TRUE(same_bits(lf, lp)) << "the AVX2 kernels and their portable versions gave other logits";
    EXPECT_TRUE(same_bits(g_fused, g_portable)) << "the AVX2 kernels and their portable versions gave other gradients";
  }
}

// Note [The first convolution in bf16] (src/backend/cpu/bf16.cpp): under --precision
// bf16 the max pool after a first convolution and its ReLU computes all three in bf16. Its output
// is the double reference's on the bf16-rounded image and weights (bf16 products are exact in
// fp32: only the order of the fp32 sums differs); its inference pass gives the training pass's
// bits; its gradients are the unfused bf16 model's (the convolution in fp32) to bf16's precision.
// Window rows of 14 (runs of 4 windows and single ones), 4, 3 and 9 wide; odd, even and non-square
// kernels; no padding; 2 channel blocks; 2 threads.
TEST(BlockedLayouts, FirstConvReluPoolInBf16) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no bf16 instructions";
  struct Case {
    std::string model;
    Shape input;
    int batch, threads;
  };
  const std::vector<Case> cases{
      {"conv:5x5:32:same,relu,maxpool:2,conv:3x3:16:same,relu,maxpool:2,flatten,fc:10", {1, 28, 28}, 3, 1},  // lenet's
      {"conv:3x3:16:valid,relu,maxpool:2,conv:3x3:16:same,relu,maxpool:2,flatten,fc:10", {1, 10, 10}, 3, 2},
      {"conv:2x2:16:same,relu,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 8, 6}, 2, 1},
      {"conv:3x5:16:same,relu,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 10, 18}, 2, 1},
      {"conv:7x7:16:same,relu,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10", {1, 12, 12}, 2, 1},
  };
  const auto bf = [](float v) {  // round to nearest even, to bf16
    std::uint32_t u = std::bit_cast<std::uint32_t>(v);
    u += 0x7fffu + ((u >> 16) & 1u);
    return std::bit_cast<float>(u & 0xffff0000u);
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.model + " on " + std::to_string(k.input.h) + "x" + std::to_string(k.input.w));
    auto fused_be = make_cpu_backend(k.threads, {.bf16 = true});
    auto apart_be = make_cpu_backend(k.threads, {.conv_pool_forward = false, .bf16 = true});
    const ModelSpec spec = parse_model_spec(k.model, k.input, 10);
    ASSERT_EQ(fused_be->activation_layouts(spec)[3], Layout::kBlocked16);
    std::vector<float> params(static_cast<std::size_t>(spec.param_count));
    init_params(spec, parse_init_spec("he"), parse_init_spec("normal:0.1"), 37, params.data());
    // The first convolution's weights and the image already bf16 (the pass rounds them again, to
    // themselves): the unfused model's fp32 convolution then sums the same products, in another
    // order, and the two differ by fp32 rounding alone, not by bf16's.
    const ParamTensor& w0 = param_of(spec, 0, false);
    std::transform(params.begin() + w0.offset, params.begin() + w0.offset + w0.size, params.begin() + w0.offset, bf);
    std::vector<float> g_fused(params.size(), 7.0f), g_apart(params.size(), 3.0f);
    Model fused(spec, k.batch, *fused_be, params.data(), g_fused.data());
    Model apart(spec, k.batch, *apart_be, params.data(), g_apart.data());
    Model fused_eval(spec, k.batch, *fused_be, params.data(), nullptr);
    const std::string said = "computes the convolution before the ReLU in bf16";
    EXPECT_NE(fused.describe().find(said), std::string::npos) << fused.describe();
    EXPECT_NE(fused_eval.describe().find(said), std::string::npos) << fused_eval.describe();
    EXPECT_EQ(apart.describe().find(said), std::string::npos) << apart.describe();
    std::vector<float> x = uniform(static_cast<std::size_t>(k.batch) * k.input.size(), 41);
    std::transform(x.begin(), x.end(), x.begin(), bf);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(k.batch));
    for (int n = 0; n < k.batch; ++n) labels[static_cast<std::size_t>(n)] = (5 * n + 3) % 10;
    for (Model* m : {&fused, &apart, &fused_eval}) step_on(*m, *fused_be, x, labels, k.batch);

    // The pool's output against the reference on bf16-rounded inputs.
    const LayerSpec& conv = spec.layers[0];
    const Shape pooled = spec.activation(3);
    const std::int64_t taps = static_cast<std::int64_t>(conv.kernel_h) * conv.kernel_w;
    const auto tensor = [&](bool is_bias) { return params.data() + param_of(spec, 0, is_bias).offset; };
    const float *w = tensor(false), *bias = tensor(true);
    std::vector<double> want(static_cast<std::size_t>(k.batch) * pooled.size());
    for (int n = 0; n < k.batch; ++n)
      for (int o = 0; o < conv.channels; ++o)
        for (int i = 0; i < pooled.h; ++i)
          for (int j = 0; j < pooled.w; ++j) {
            double best = 0.0;  // the ReLU's
            for (int q = 0; q < 4; ++q) {
              const int h = 2 * i + q / 2, ww = 2 * j + q % 2;
              double sum = bias[o];
              for (int kh = 0; kh < conv.kernel_h; ++kh)
                for (int kw = 0; kw < conv.kernel_w; ++kw) {
                  const int ih = h + kh - conv.pad_top, iw = ww + kw - conv.pad_left;
                  if (ih < 0 || ih >= k.input.h || iw < 0 || iw >= k.input.w) continue;
                  sum += static_cast<double>(bf(w[o * taps + kh * conv.kernel_w + kw])) *
                         bf(x[static_cast<std::size_t>((n * k.input.h + ih) * k.input.w + iw)]);
                }
              best = std::max(best, sum);
            }
            want[static_cast<std::size_t>(((n * conv.channels + o) * pooled.h + i) * pooled.w + j)] = best;
          }
    const std::size_t np = static_cast<std::size_t>(k.batch) * pooled.size();
    const std::vector<float> got = relayout(std::vector<float>(fused.activation(3), fused.activation(3) + np), k.batch,
                                            pooled, Layout::kBlocked16, Layout::kPlain);
    expect_close("pooled", got, want, 1e-5, 1e-5);
    const std::vector<float> got_eval =
        relayout(std::vector<float>(fused_eval.activation(3), fused_eval.activation(3) + np), k.batch, pooled,
                 Layout::kBlocked16, Layout::kPlain);
    EXPECT_TRUE(same_bits(got, got_eval)) << "inference";
    // Not vacuous: some windows are positive, some are cut to 0 by the ReLU.
    EXPECT_TRUE(std::any_of(want.begin(), want.end(), [](double v) { return v > 0.0; }));
    EXPECT_TRUE(std::any_of(want.begin(), want.end(), [](double v) { return v == 0.0; }));
    // The gradients (the convolution's weight gradient reads the pool's argmax and dy).
    for (const ParamTensor& t : spec.params) {
      const Distance d = distance(g_apart.data() + t.offset, g_fused.data() + t.offset, t.size);
      EXPECT_LE(d.relative, 1e-4) << t.name << ": off by " << d.relative << " of its norm";
    }
    // Note [The first convolution's weight gradient in bf16]: for 3 x 3 and 5 x 5, dW is the double
    // sum of the bf16-rounded dy times x (already bf16) and db the sum of dy: the unfused model's,
    // from the dy its pool wrote, against that reference; the fused model's, formed from its pool's
    // gradient, argmax and output in registers, against the unfused model's.
    const bool own = (conv.kernel_h == 5 && conv.kernel_w == 5) || (conv.kernel_h == 3 && conv.kernel_w == 3);
    EXPECT_EQ(fused.describe().find("bwd-weights own bf16 loop with the bias reading the max pool's gradient") !=
                  std::string::npos,
              own)
        << fused.describe();
    EXPECT_EQ(apart.describe().find("bwd-weights own bf16 loop") != std::string::npos, own) << apart.describe();
    const Shape out = spec.activation(1);
    const std::size_t no = static_cast<std::size_t>(k.batch) * out.size();
    const std::vector<float> dy =
        relayout(std::vector<float>(apart.activation_gradient(1), apart.activation_gradient(1) + no), k.batch, out,
                 Layout::kBlocked16, Layout::kPlain);
    std::vector<double> dw_want(static_cast<std::size_t>(conv.channels * taps), 0.0), db_want(conv.channels, 0.0);
    for (int n = 0; n < k.batch; ++n)
      for (int o = 0; o < conv.channels; ++o)
        for (int h = 0; h < out.h; ++h)
          for (int ww = 0; ww < out.w; ++ww) {
            const float d32 = dy[static_cast<std::size_t>(((n * conv.channels + o) * out.h + h) * out.w + ww)];
            const double d = own ? bf(d32) : d32;
            db_want[static_cast<std::size_t>(o)] += d32;
            for (int kh = 0; kh < conv.kernel_h; ++kh)
              for (int kw = 0; kw < conv.kernel_w; ++kw) {
                const int ih = h + kh - conv.pad_top, iw = ww + kw - conv.pad_left;
                if (ih < 0 || ih >= k.input.h || iw < 0 || iw >= k.input.w) continue;
                dw_want[static_cast<std::size_t>(o * taps + kh * conv.kernel_w + kw)] +=
                    d * x[static_cast<std::size_t>((n * k.input.h + ih) * k.input.w + iw)];
              }
          }
    const ParamTensor& b0 = param_of(spec, 0, true);
    for (const auto& [t, ref_sum] : {std::pair{&w0, &dw_want}, std::pair{&b0, &db_want}}) {
      const std::vector<float> w32(ref_sum->begin(), ref_sum->end());
      const Distance ref = distance(w32.data(), g_apart.data() + t->offset, t->size);
      EXPECT_LE(ref.relative, 1e-5) << t->name << " (dy from memory): off by " << ref.relative;
      const Distance fa = distance(g_apart.data() + t->offset, g_fused.data() + t->offset, t->size);
      EXPECT_LE(fa.relative, 1e-5) << t->name << " (dy from the pool): off by " << fa.relative;
    }
  }
}

// Note [The first convolution's weight gradient in bf16]: a 2 x 2 max pool right after the first
// convolution (no ReLU between: the fp32 pass computes both) hands its gradient and argmax over
// without a mask; the bf16 weight gradient then gives the bits it gives reading the dy the pool
// writes when it may not hand it over. (A null mask read as a ReLU's had crashed here.)
TEST(BlockedLayouts, Bf16FirstConvReadsAPoolWithoutAReLU) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no bf16 instructions";
  auto fused_be = make_cpu_backend(1, {.bf16 = true});
  auto apart_be = make_cpu_backend(1, {.pool_gradient = false, .bf16 = true});
  const ModelSpec spec = parse_model_spec(
      "conv:5x5:16:same,maxpool:2,relu,conv:3x3:16:same,relu,maxpool:2,flatten,fc:10", {1, 12, 12}, 10);
  std::vector<float> params(static_cast<std::size_t>(spec.param_count));
  init_params(spec, parse_init_spec("he"), parse_init_spec("normal:0.1"), 59, params.data());
  const int batch = 3;
  std::vector<float> g_fused(params.size(), 7.0f), g_apart(params.size(), 3.0f);
  Model fused(spec, batch, *fused_be, params.data(), g_fused.data());
  Model apart(spec, batch, *apart_be, params.data(), g_apart.data());
  EXPECT_NE(fused.describe().find("own bf16 loop with the bias reading the max pool's gradient"), std::string::npos)
      << fused.describe();
  EXPECT_EQ(apart.describe().find("reading the max pool's gradient"), std::string::npos) << apart.describe();
  const std::vector<float> x = uniform(static_cast<std::size_t>(batch) * 144, 61);
  const std::vector<std::int32_t> labels{2, 5, 8};
  for (Model* m : {&fused, &apart}) step_on(*m, *fused_be, x, labels, batch);
  EXPECT_TRUE(same_bits(g_fused, g_apart)) << "gradients";
  const ParamTensor& w0 = param_of(spec, 0, false);
  EXPECT_TRUE(std::any_of(g_fused.begin() + w0.offset, g_fused.begin() + w0.offset + w0.size,
                          [](float v) { return v != 0.0f; }));
}

// Note [A pool's gradient straight into bf16] (src/backend/cpu/pool.cpp): under --precision bf16
// the pool before flatten writes the bf16 dy of the convolution before its ReLU, and that
// convolution's bias gradient; the model where the convolution converts an fp32 dy (the pool's
// one-pass gradient off) gets the same bits for every other gradient (the same rounding) and the
// bias's to float rounding (another order of the sums). Two channel blocks, 2 threads.
TEST(BlockedLayouts, PoolWritesTheBf16GradientOfTheConvolution) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no bf16 instructions";
  for (const int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    auto fused_be = make_cpu_backend(threads, {.bf16 = true});
    auto apart_be = make_cpu_backend(threads, {.pool_backward_tiles = false, .bf16 = true});
    const ModelSpec spec = parse_model_spec(
        "conv:5x5:16:same,relu,maxpool:2,conv:3x3:32:same,relu,maxpool:2,flatten,fc:10", {1, 16, 16}, 10);
    std::vector<float> params(static_cast<std::size_t>(spec.param_count));
    init_params(spec, parse_init_spec("he"), parse_init_spec("normal:0.1"), 47, params.data());
    const int batch = 3;
    std::vector<float> g_fused(params.size(), 7.0f), g_apart(params.size(), 3.0f);
    Model fused(spec, batch, *fused_be, params.data(), g_fused.data());
    Model apart(spec, batch, *apart_be, params.data(), g_apart.data());
    EXPECT_NE(fused.describe().find("writes the convolution's dy in bf16"), std::string::npos) << fused.describe();
    EXPECT_NE(fused.describe().find("dy in bf16 and the bias's gradient from the max pool"), std::string::npos)
        << fused.describe();
    EXPECT_EQ(apart.describe().find("dy in bf16"), std::string::npos) << apart.describe();
    const std::vector<float> x = uniform(static_cast<std::size_t>(batch) * 256, 53);
    const std::vector<std::int32_t> labels{1, 4, 7};
    for (Model* m : {&fused, &apart}) step_on(*m, *fused_be, x, labels, batch);
    for (const ParamTensor& t : spec.params) {
      const std::vector<float> a(g_apart.begin() + t.offset, g_apart.begin() + t.offset + t.size),
          f(g_fused.begin() + t.offset, g_fused.begin() + t.offset + t.size);
      if (t.layer == 3 && t.is_bias) {
        const Distance d = distance(a.data(), f.data(), t.size);
        EXPECT_LE(d.relative, 1e-6) << t.name << ": off by " << d.relative;
        EXPECT_GT(std::abs(a[0]), 0.0f) << t.name << " is zero: this check could not tell";
      } else {
        EXPECT_TRUE(same_bits(a, f)) << t.name;
      }
    }
  }
}

// Note [A ReLU taken over by its max pool] in src/backend/cpu/pool.cpp: the pool applying the ReLU
// before it, both ways, gives the bits of the two layers apart: logits in training and inference,
// and every gradient, in every layout the pool runs on (plain, blocked, blocked in and plain out,
// overlapping windows), with ReLU inputs that are often negative (whole windows of them).
TEST(BlockedLayouts, ReluTakenOverByThePoolIsBitwiseTheSame) {
  struct Case {
    std::string model;
    Shape input;
    int batch, threads;
    int taken;  // how many ReLUs a pool takes over
  };
  const std::vector<Case> cases{
      {"conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:32,relu,fc:10",
       {1, 12, 12},
       3,
       1,
       2},  // lenet's shape (its fc ReLU has no pool after it)
      {"conv:3x3:8:same,relu,maxpool:2,conv:3x3:16:same,relu,maxpool:2,flatten,fc:10", {1, 12, 12}, 4, 2, 2},
      {"conv:3x3:4:same,relu,maxpool:2,flatten,fc:10", {3, 8, 8}, 2, 1, 1},          // plain layouts
      {"conv:3x3:16:same,relu,maxpool:3:2,flatten,fc:10", {1, 11, 11}, 2, 1, 1},     // overlapping windows
      {"conv:3x3:8:same,relu,maxpool:2,relu,flatten,fc:10", {1, 10, 10}, 2, 1, 1},   // a ReLU after the pool
      {"relu,maxpool:2,conv:3x3:8:same,relu,maxpool:2,flatten,fc:10", {1, 8, 8}, 2, 1, 2},  // a first-layer ReLU
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.model + " on " + std::to_string(k.input.c) + "x" + std::to_string(k.input.h));
    auto fused_be = make_cpu_backend(k.threads);
    auto apart_be = make_cpu_backend(k.threads, {.relu_into_pool = false});
    const ModelSpec spec = parse_model_spec(k.model, k.input, 10);
    std::vector<float> params(static_cast<std::size_t>(spec.param_count));
    // Biases around zero: many ReLU inputs are negative, so windows of only non-positive values
    // (ties at 0 after the ReLU) are common.
    init_params(spec, parse_init_spec("he"), parse_init_spec("normal:0.3"), 37, params.data());
    std::vector<float> g_fused(params.size(), 7.0f), g_apart(params.size(), 3.0f);
    Model fused(spec, k.batch, *fused_be, params.data(), g_fused.data());
    Model apart(spec, k.batch, *apart_be, params.data(), g_apart.data());
    Model fused_eval(spec, k.batch, *fused_be, params.data(), nullptr);
    Model apart_eval(spec, k.batch, *apart_be, params.data(), nullptr);
    const auto count = [](const std::string& s, const std::string& what) {
      int n = 0;
      for (std::size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
      return n;
    };
    const std::string said = "applies the ReLU before it";
    EXPECT_EQ(count(fused.describe(), said), k.taken) << fused.describe();
    EXPECT_EQ(count(fused_eval.describe(), said), k.taken) << fused_eval.describe();
    EXPECT_EQ(count(apart.describe(), said), 0) << apart.describe();
    const std::vector<float> x = uniform(static_cast<std::size_t>(k.batch) * k.input.size(), 41, -1.0f, 1.0f);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(k.batch));
    for (int n = 0; n < k.batch; ++n) labels[static_cast<std::size_t>(n)] = (3 * n + 5) % 10;
    for (int step = 0; step < 2; ++step) {  // twice: the second pass overwrites the first
      for (Model* m : {&fused, &apart, &fused_eval, &apart_eval}) step_on(*m, *fused_be, x, labels, k.batch);
      const std::size_t nl = static_cast<std::size_t>(k.batch) * 10;
      EXPECT_TRUE(same_bits({fused.logits(), fused.logits() + nl}, {apart.logits(), apart.logits() + nl})) << "logits";
      EXPECT_TRUE(same_bits({fused_eval.logits(), fused_eval.logits() + nl},
                            {apart_eval.logits(), apart_eval.logits() + nl}))
          << "logits in inference";
      ASSERT_TRUE(same_bits(g_fused, g_apart)) << "gradients";
      // Not vacuous: the first layer with parameters has a non-zero weight gradient.
      const auto first = std::find_if(spec.params.begin(), spec.params.end(), [](const ParamTensor& p) { return !p.is_bias; });
      ASSERT_NE(first, spec.params.end());
      const auto w0 = g_fused.begin() + first->offset;
      EXPECT_TRUE(std::any_of(w0, w0 + first->size, [](float v) { return v != 0.0f; }));
    }
  }
}

// Note [A 2 x 2 pool's gradient in one pass] (src/backend/cpu/pool.cpp): the one-pass backward
// writes the scatter's bits, in every layout pair the pool runs on, with ties in the windows (the
// first maximum wins) and a dy of -0, +0 and both signs; a 7 x 7 input, and a y in another layout,
// keep the scatter. Then
// whole models with ReLUs taken over by their pools: the same logits and gradients either way.
TEST(BlockedLayouts, PoolGradientInOnePassIsBitwiseTheSame) {
  const std::vector<std::pair<Layout, Layout>> layouts{{Layout::kPlain, Layout::kPlain},
                                                       {Layout::kBlocked8, Layout::kBlocked8},
                                                       {Layout::kBlocked16, Layout::kBlocked16},
                                                       {Layout::kBlocked8, Layout::kPlain},
                                                       {Layout::kBlocked16, Layout::kPlain}};
  for (const auto& [xl, yl] : layouts) {
    for (const Shape in : {Shape{16, 6, 8}, Shape{16, 7, 7}}) {
      SCOPED_TRACE("x block " + std::to_string(block_of(xl)) + ", y block " + std::to_string(block_of(yl)) + ", " +
                   std::to_string(in.h) + "x" + std::to_string(in.w));
      const ModelSpec spec = parse_model_spec("maxpool:2,flatten,fc:10", in, 10);
      const LayerSpec& l = spec.layers.at(0);
      auto one_pass = make_cpu_backend(1), scatter = make_cpu_backend(1, {.pool_backward_tiles = false});
      Rig a(*one_pass, l, 3, 51, true, true, 0, xl, yl), b(*scatter, l, 3, 51, true, true, 0, xl, yl);
      // Every layout pair in one pass where the windows cover the input exactly (blocked into
      // plain through a blocked copy of dy).
      EXPECT_EQ(a.k->describe().find("dx in one pass") != std::string::npos, in.h == 6)
          << a.k->describe();
      EXPECT_EQ(b.k->describe().find("dx in one pass"), std::string::npos) << b.k->describe();
      for (std::size_t i = 0; i < a.x.size(); ++i)  // coarse values: ties in many windows
        a.x[i] = b.x[i] = std::round(a.x[i] * 2.0f) / 2.0f;
      for (std::size_t i = 0; i < a.dy.size(); ++i) {
        const float v = i % 5 == 0 ? -0.0f : i % 7 == 0 ? 0.0f : a.dy[i];
        a.dy[i] = b.dy[i] = v;
      }
      std::fill(a.dx.begin(), a.dx.end(), 9.0f);  // every element must be written
      std::fill(b.dx.begin(), b.dx.end(), 5.0f);
      StepContext ctx;
      a.k->forward(ctx);
      b.k->forward(ctx);
      ASSERT_TRUE(same_bits(a.y, b.y));
      a.k->backward(ctx);
      b.k->backward(ctx);
      EXPECT_TRUE(same_bits(a.dx, b.dx)) << "dx";
    }
  }
  for (const char* model : {"conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:32,relu,fc:10",
                            // a pool without a ReLU, between two convolutions (not the first: its pool's
                            // gradient is the first convolution's, Note [The first convolution reads its
                            // pool's gradient])
                            "conv:3x3:8:same,relu,conv:3x3:16:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10"}) {
    SCOPED_TRACE(model);
    const ModelSpec spec = parse_model_spec(model, {1, 12, 12}, 10);
    auto one_pass_be = make_cpu_backend(1), scatter_be = make_cpu_backend(1, {.pool_backward_tiles = false});
    std::vector<float> params(static_cast<std::size_t>(spec.param_count));
    init_params(spec, parse_init_spec("he"), parse_init_spec("normal:0.3"), 53, params.data());
    std::vector<float> g_one(params.size(), 7.0f), g_scatter(params.size(), 3.0f);
    Model one(spec, 3, *one_pass_be, params.data(), g_one.data());
    Model apart(spec, 3, *scatter_be, params.data(), g_scatter.data());
    EXPECT_NE(one.describe().find("dx in one pass"), std::string::npos) << one.describe();
    const std::vector<float> x = uniform(static_cast<std::size_t>(3) * 144, 55, -1.0f, 1.0f);
    step_on(one, *one_pass_be, x, {1, 4, 7}, 3);
    step_on(apart, *scatter_be, x, {1, 4, 7}, 3);
    EXPECT_TRUE(same_bits(g_one, g_scatter)) << "gradients";
  }
}

// A NaN into a ReLU and its pool: oneDNN's ReLU makes it 0, so a window [NaN, 5] pools to 5. The
// pool applying the ReLU must give the same, though a max over the raw values would keep the NaN
// (it comes first, and nothing compares greater than a NaN) and a ReLU after it would give 0.
TEST(BlockedLayouts, ANaNThroughAReluTakenOverByItsPool) {
  const ModelSpec spec = parse_model_spec("relu,maxpool:2,flatten,fc:10", {1, 4, 4}, 10);
  std::vector<float> params(static_cast<std::size_t>(spec.param_count));
  init_params(spec, parse_init_spec("he"), parse_init_spec("zeros"), 3, params.data());
  std::vector<float> x = uniform(2 * 16, 5);
  x[0] = std::numeric_limits<float>::quiet_NaN();  // sample 0: the first element of window (0, 0)
  x[1] = 5.0f;
  std::vector<std::vector<float>> logits;
  for (bool fuse : {true, false}) {
    auto be = make_cpu_backend(1, {.relu_into_pool = fuse});
    Model m(spec, 2, *be, params.data(), nullptr, nullptr);
    EXPECT_EQ(m.describe().find("applies the ReLU before it") != std::string::npos, fuse) << m.describe();
    step_on(m, *be, x, {0, 1}, 2);
    logits.emplace_back(m.logits(), m.logits() + 20);
  }
  EXPECT_TRUE(same_bits(logits[0], logits[1]));
  EXPECT_TRUE(std::all_of(logits[1].begin(), logits[1].end(), [](float v) { return std::isfinite(v); }))
      << "oneDNN's ReLU no longer makes a NaN 0: the pool's ReLU must follow it";
}

// Note [A weight gradient written once as integers] (include/mnist_mpi/backend/layer.hpp): an fc
// layer that took its parameters' gradients over writes neither its weight's nor its bias's, and
// hands each chunk's to the sink, the weight's in tiles (the last one shorter), first chunk first:
// the gradient of a plain backward on that chunk. The tiles sum in the same order as the plain
// kernel here, but another CPU may pick other kernels, hence the tolerance.
TEST(Model, TakenFcWeightGradientIsEachChunksWeightGradient) {
  auto be = make_cpu_backend(1);
  // 3000 inputs: tiles of 14 rows of 37 (a tile and its integers fit 512 KiB), so 14, 14, 9.
  const ModelSpec spec = parse_model_spec("fc:37,relu,fc:10", {3000, 1, 1}, 10);
  const int batch = 4, chunks = 3;
  const auto P = static_cast<std::size_t>(spec.param_count);
  std::vector<float> params(P);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:0.1"), 42, params.data());
  std::vector<float> plain_grads(P), taken_grads(P);
  Model plain(spec, batch, *be, params.data(), plain_grads.data());
  Model taken(spec, batch, *be, params.data(), taken_grads.data());
  struct Recorder final : FixedPointSink {
    std::vector<std::vector<float>> got;   // per chunk, the flat gradient buffer
    std::vector<int> calls;                // per element, over every chunk
    std::map<std::int64_t, int> chunk_at;  // per tile offset: the chunk it is at
    void absorb_range(std::int64_t offset, const float* v, std::int64_t n, bool first) override {
      int& j = chunk_at[offset];
      j = first ? 0 : j + 1;
      ASSERT_LT(j, static_cast<int>(got.size()));
      for (std::int64_t i = 0; i < n; ++i) {
        got[static_cast<std::size_t>(j)][static_cast<std::size_t>(offset + i)] = v[i];
        ++calls[static_cast<std::size_t>(offset + i)];
      }
    }
  } sink;
  sink.got.assign(chunks, std::vector<float>(P));
  sink.calls.assign(P, 0);
  const std::vector<Model::TakenWeight> took = taken.take_weight_gradients(chunks, batch, sink);
  ASSERT_EQ(took.size(), 2u);  // both fc layers, each its weight and bias
  for (const Model::TakenWeight& t : took) ASSERT_EQ(t.size, t.layer == 0 ? 37 * 3000 + 37 : 10 * 37 + 10);
  EXPECT_NE(taken.describe().find("weight gradient as integers in tiles of 14 rows"), std::string::npos)
      << taken.describe();
  std::vector<std::vector<float>> want;
  for (int j = 0; j < chunks; ++j) {
    const std::vector<float> x = uniform(static_cast<std::size_t>(batch * 3000), 100 + static_cast<std::uint64_t>(j));
    const std::vector<std::int32_t> labels{1, 4, 9, static_cast<std::int32_t>(j)};
    std::fill(taken_grads.begin(), taken_grads.end(), 7.0f);
    step_on(plain, *be, x, labels, batch);
    step_on(taken, *be, x, labels, batch);
    want.push_back(plain_grads);
    for (const Model::TakenWeight& t : took)
      for (std::int64_t i = t.offset; i < t.offset + t.size; ++i)
        ASSERT_EQ(taken_grads[static_cast<std::size_t>(i)], 7.0f) << "a taken gradient was written";
  }
  for (const Model::TakenWeight& t : took) taken.finish_weight_gradient(t.layer);
  for (const Model::TakenWeight& t : took)
    for (std::int64_t i = t.offset; i < t.offset + t.size; ++i) {
      const auto u = static_cast<std::size_t>(i);
      ASSERT_EQ(sink.calls[u], chunks) << "element " << i;
      for (std::size_t j = 0; j < static_cast<std::size_t>(chunks); ++j)
        ASSERT_NEAR(sink.got[j][u], want[j][u], 1e-6 + 1e-5 * std::fabs(want[j][u])) << "chunk " << j << " element " << i;
    }
  // A finish starts the count again; more backward calls than chunks before it is an error.
  const std::vector<float> x = uniform(static_cast<std::size_t>(batch * 3000), 7);
  const std::vector<std::int32_t> labels{0, 1, 2, 3};
  for (int j = 0; j < chunks; ++j) step_on(taken, *be, x, labels, batch);
  EXPECT_THROW(step_on(taken, *be, x, labels, batch), Error);
}

// Note [The row-wise tail at the rank's batch] (src/train/exact_pipeline.cpp): head models at batch c, each
// writing its rows of the tail's input, and the tail at batch k c compute what the whole model
// computes chunk by chunk at batch c: the logits, the input gradient at the boundary, every chunk's
// fc weight and bias gradient handed over by the tail, and every chunk's conv gradient from its head.
// (Bit for bit where the kernels agree, which the step checks at set-up; here to a tolerance.)
TEST(Model, HeadsAndTailComputeTheWholeModelChunkByChunk) {
  auto be = make_cpu_backend(1);
  const ModelSpec spec = parse_model_spec("conv:3x3:16:same,relu,maxpool:2,flatten,fc:12,relu,fc:10", {1, 12, 12}, 10);
  const int c = 2, k = 3, first = 3;  // the tail: flatten, fc, relu, fc
  const auto P = static_cast<std::size_t>(spec.param_count);
  std::vector<float> params(P);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:0.1"), 42, params.data());
  std::vector<float> whole_grads(P), part_grads(P);
  Model whole(spec, c, *be, params.data(), whole_grads.data());
  Model tail(spec, k * c, *be, params.data(), part_grads.data(), nullptr, ModelPart{first, -1});
  const std::int64_t row = spec.layers[first - 1].out.size(), pixels = spec.input.size();
  std::vector<std::unique_ptr<Model>> heads;
  for (int j = 0; j < k; ++j)
    heads.push_back(std::make_unique<Model>(
        spec, c, *be, params.data(), part_grads.data(), nullptr,
        ModelPart{0, first, const_cast<float*>(tail.activation(first)) + j * c * row,
                  const_cast<float*>(tail.activation_gradient(first)) + j * c * row}));
  EXPECT_EQ(tail.first_layer(), first);
  EXPECT_EQ(heads[0]->end_layer(), first);
  EXPECT_EQ(tail.describe().find("layer 0 "), std::string::npos) << tail.describe();
  EXPECT_NE(tail.describe().find("layer 6 "), std::string::npos) << tail.describe();
  struct Recorder final : FixedPointSink {
    std::map<std::int64_t, std::vector<std::vector<float>>> got;  // per range start: each chunk's values
    void absorb_range(std::int64_t offset, const float* v, std::int64_t n, bool first_chunk) override {
      auto& chunks = got[offset];
      if (first_chunk) chunks.clear();
      chunks.emplace_back(v, v + n);
    }
  } sink;
  const std::vector<Model::TakenWeight> took = tail.take_weight_gradients(k, c, sink);
  ASSERT_EQ(took.size(), 2u);
  const std::vector<float> x = uniform(static_cast<std::size_t>(k * c * pixels), 5);
  const std::vector<float> dl = uniform(static_cast<std::size_t>(k * c * 10), 6, -0.1f, 0.1f);
  const auto near = [](float want, float got) { return std::fabs(want - got) <= 1e-6f + 1e-5f * std::fabs(want); };
  // The whole model, chunk by chunk.
  std::vector<std::vector<float>> want_grads;
  std::vector<float> want_logits, want_dboundary;
  for (int j = 0; j < k; ++j) {
    const StepContext ctx{true, 3, 0, j * c};
    std::copy_n(x.data() + j * c * pixels, c * pixels, whole.input());
    whole.forward(ctx);
    want_logits.insert(want_logits.end(), whole.logits(), whole.logits() + c * 10);
    std::copy_n(dl.data() + j * c * 10, c * 10, whole.dlogits());
    whole.backward(ctx);
    want_dboundary.insert(want_dboundary.end(), whole.activation_gradient(first),
                          whole.activation_gradient(first) + c * row);
    want_grads.push_back(whole_grads);
  }
  // Heads per chunk, the tail at k c.
  for (int j = 0; j < k; ++j) {
    std::copy_n(x.data() + j * c * pixels, c * pixels, heads[static_cast<std::size_t>(j)]->input());
    heads[static_cast<std::size_t>(j)]->forward(StepContext{true, 3, 0, j * c});
  }
  tail.forward(StepContext{true, 3, 0, 0});
  for (std::size_t i = 0; i < want_logits.size(); ++i) ASSERT_TRUE(near(want_logits[i], tail.logits()[i])) << i;
  std::copy(dl.begin(), dl.end(), tail.dlogits());
  std::fill(part_grads.begin(), part_grads.end(), 7.0f);
  tail.backward(StepContext{true, 3, 0, 0});
  for (std::size_t i = 0; i < want_dboundary.size(); ++i)
    ASSERT_TRUE(near(want_dboundary[i], tail.activation_gradient(first)[i])) << i;
  for (const Model::TakenWeight& t : took) tail.finish_weight_gradient(t.layer);
  for (const Model::TakenWeight& t : took) {
    for (std::int64_t i = t.offset; i < t.offset + t.size; ++i)
      ASSERT_EQ(part_grads[static_cast<std::size_t>(i)], 7.0f) << "a taken gradient was written";
    std::int64_t seen = 0;
    for (const auto& [offset, chunks] : sink.got) {
      if (offset < t.offset || offset >= t.offset + t.size) continue;
      ASSERT_EQ(chunks.size(), static_cast<std::size_t>(k)) << "every chunk's values, once";
      for (std::size_t j = 0; j < chunks.size(); ++j)
        for (std::size_t i = 0; i < chunks[j].size(); ++i)
          ASSERT_TRUE(near(want_grads[j][static_cast<std::size_t>(offset) + i], chunks[j][i]))
              << "chunk " << j << " element " << offset + static_cast<std::int64_t>(i);
      seen += static_cast<std::int64_t>(chunks[0].size());
    }
    EXPECT_EQ(seen, t.size) << "layer " << t.layer << ": its weight and bias";
  }
  std::vector<std::int64_t> conv;  // the head's parameters: the conv's weight and bias
  for (const ParamTensor& t : spec.params)
    if (t.layer == 0)
      for (std::int64_t i = t.offset; i < t.offset + t.size; ++i) conv.push_back(i);
  ASSERT_EQ(conv.size(), 16u * 9 + 16);
  for (int j = 0; j < k; ++j) {
    heads[static_cast<std::size_t>(j)]->backward(StepContext{true, 3, 0, j * c});
    for (const std::int64_t i : conv)
      ASSERT_TRUE(near(want_grads[static_cast<std::size_t>(j)][static_cast<std::size_t>(i)],
                       part_grads[static_cast<std::size_t>(i)]))
          << "chunk " << j << " conv element " << i << ": " << want_grads[static_cast<std::size_t>(j)][static_cast<std::size_t>(i)] << " vs " << part_grads[static_cast<std::size_t>(i)];
  }
  // A part short of the end needs its boundary, and may not end after a flatten.
  EXPECT_THROW(Model(spec, c, *be, params.data(), part_grads.data(), nullptr, ModelPart{0, first}), Error);
  std::vector<float> buf(static_cast<std::size_t>(c * row)), dbuf(buf.size());
  EXPECT_THROW(Model(spec, c, *be, params.data(), part_grads.data(), nullptr, ModelPart{0, first + 1, buf.data(), dbuf.data()}),
               Error);
}

// Note [bf16 on the CPU] (src/backend/cpu/cpu_backend.cpp): the bf16 model's logits and every
// gradient tensor agree with the fp32 model's to bf16's precision (8 bits), yet differ from them
// (the bf16 kernels ran), and the first convolution stays fp32. A linear model: with ReLUs and
// pools, a unit whose input lies a bf16 rounding from a kink sends its gradient elsewhere, and a
// few such flips move a gradient tensor by several percent. On a CPU without bf16 instructions
// the backend is refused instead.
TEST(Model, Bf16GradientsAreTheFp32OnesToBf16Precision) {
  CpuFusions bf16;
  bf16.bf16 = true;
  if (!cpu_has_bf16()) {
    EXPECT_THROW(make_cpu_backend(1, bf16), Error);
    GTEST_SKIP() << "this CPU has no bf16 instructions: the refusal is what there is to test";
  }
  auto be32 = make_cpu_backend(1);
  auto be16 = make_cpu_backend(1, bf16);
  const ModelSpec spec =
      parse_model_spec("conv:3x3:16:same,conv:3x3:32:same,flatten,fc:64,fc:10", {1, 12, 12}, 10);
  const int batch = 8;
  const auto P = static_cast<std::size_t>(spec.param_count);
  std::vector<float> params(P), g32(P), g16(P);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:0.1"), 42, params.data());
  Model m32(spec, batch, *be32, params.data(), g32.data());
  Model m16(spec, batch, *be16, params.data(), g16.data());
  EXPECT_EQ(m16.describe().find("layer 0 conv:3x3:16:same (16,12,12): bf16"), std::string::npos) << m16.describe();
  EXPECT_NE(m16.describe().find("layer 1 conv:3x3:32:same (32,12,12): bf16 conv fwd"), std::string::npos)
      << m16.describe();
  const std::vector<float> x = uniform(static_cast<std::size_t>(batch * 144), 5);
  const std::vector<std::int32_t> labels{0, 1, 2, 3, 4, 5, 6, 7};
  step_on(m32, *be32, x, labels, batch);
  step_on(m16, *be16, x, labels, batch);
  // Relative to the tensor's norm.
  const Distance logits = distance(m32.logits(), m16.logits(), batch * 10);
  EXPECT_LE(logits.relative, 2e-2) << "logits off by " << logits.relative << " of their norm";
  EXPECT_TRUE(logits.differ) << "the bf16 model computed the fp32 bits: did its kernels run?";
  for (const ParamTensor& t : spec.params) {
    const Distance d = distance(g32.data() + t.offset, g16.data() + t.offset, t.size);
    EXPECT_LE(d.relative, 2e-2) << t.name << ": off by " << d.relative << " of its norm";
    EXPECT_TRUE(d.differ) << t.name << ": the fp32 bits";
  }
  // The parameters change (as the optimiser changes them): the bf16 copies must follow them.
  const std::vector<float> before(m32.logits(), m32.logits() + batch * 10);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:-0.2"), 43, params.data());
  m32.forward(StepContext{});
  m16.forward(StepContext{});
  const Distance after = distance(m32.logits(), m16.logits(), batch * 10);
  EXPECT_LE(after.relative, 2e-2) << "after the parameters changed, logits off by " << after.relative;
  EXPECT_GT(distance(m32.logits(), before.data(), batch * 10).relative, 0.1)
      << "the changed parameters did not change the fp32 logits: this check could not tell";
}

// Note [The parameters and their copies] (include/mnist_mpi/backend/parameter_store.hpp): a model
// built on a store keeps its kernels' bf16 copies of the weights between passes and makes again
// the part of every copy that a reported change touches. After the parameters change in three
// ranges (one ends inside the second convolution's weights, one inside the first fc's), each
// reported, a pass gives the logits and gradients of a model on a bare pointer, which makes its
// copies at every pass; a change not reported leaves the stale copies' logits (so the store's
// model does skip the conversions), while the same change through a lease is reported by itself.
// The optimiser's pass writes the fc copies in its own loop,
// and an evaluation model on the same store makes its copies again at its next pass.
TEST(Model, Bf16WeightCopiesAreRefreshedWhereTheParametersChanged) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no bf16 instructions";
  auto be = make_cpu_backend(1, {.bf16 = true});
  // The fast recipe's layers: blocked activations, so the second convolution's backward-data reads
  // a copy of its weights of its own.
  const ModelSpec spec = parse_model_spec(
      "conv:5x5:16:same,relu,maxpool:2,conv:3x3:32:same,relu,maxpool:2,flatten,fc:64,fc:10", {1, 28, 28}, 10);
  const int batch = 4;
  const auto P = static_cast<std::size_t>(spec.param_count);
  ParameterStore store(*be, spec.param_count);
  float* params = store.host();  // the CPU's host image is the buffer itself
  ASSERT_EQ(params, store.data());
  std::vector<float> g_kept(P), g_fresh(P);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:0.1"), 42, params);
  Model kept(spec, batch, *be, store, g_kept.data());
  Model fresh(spec, batch, *be, store.data(), g_fresh.data());
  const std::vector<float> x = uniform(static_cast<std::size_t>(batch * 784), 5);
  const std::vector<std::int32_t> labels{0, 1, 2, 3};
  const auto pass = [&](Model& m, std::vector<float>* logits) {
    std::copy(x.begin(), x.end(), m.input());
    m.forward(StepContext{});
    if (logits) logits->assign(m.logits(), m.logits() + batch * 10);
    if (!m.training()) return;
    be->softmax_cross_entropy(m.logits(), labels.data(), batch, 10, m.dlogits(), 1.0f / batch);
    m.backward(StepContext{});
  };
  std::vector<float> lk, lf;
  pass(kept, &lk);  // the copies made
  const auto offset_of = [&](const std::string& name) {
    const auto t =
        std::find_if(spec.params.begin(), spec.params.end(), [&](const ParamTensor& p) { return p.name == name; });
    EXPECT_NE(t, spec.params.end()) << name;
    return t == spec.params.end() ? std::size_t{0} : static_cast<std::size_t>(t->offset);
  };
  const std::size_t conv2_w = offset_of("3.conv.weight"), fc1_w = offset_of("7.fc.weight");
  std::vector<std::size_t> cuts{0, conv2_w + 100, fc1_w + 1000, P};
  std::sort(cuts.begin(), cuts.end());  // the flat buffer holds the last layer first
  std::vector<float> other(P);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:-0.2"), 43, other.data());
  for (std::size_t r = 0; r + 1 < cuts.size(); ++r) {  // as the optimiser's buckets: change, then report
    std::copy(other.begin() + cuts[r], other.begin() + cuts[r + 1], params + cuts[r]);
    store.changed(static_cast<std::int64_t>(cuts[r]), static_cast<std::int64_t>(cuts[r + 1]));
  }
  pass(kept, &lk);
  pass(fresh, &lf);
  EXPECT_TRUE(same_bits(lk, lf)) << "logits after the reported changes";
  EXPECT_TRUE(same_bits(g_kept, g_fresh)) << "gradients after the reported changes";
  // Changed without a report, one kernel's weights at a time: its kept copy is stale, and the
  // store's model reads it (a kernel that made its copy anyway would give the fresh logits).
  for (const std::size_t w : {conv2_w, fc1_w}) {
    store.changed_all();
    pass(kept, &lk);  // every copy current
    for (std::size_t i = w; i < w + 100; ++i) params[i] *= 0.5f;
    pass(kept, &lk);
    pass(fresh, &lf);
    EXPECT_FALSE(same_bits(lk, lf)) << (w == conv2_w ? "the second convolution" : "the first fc")
                                    << " made its copy though no change was reported";
  }
  // The same changes made through a lease (Note [Writes that report themselves]): reported when
  // the lease ends, so the store's model computes with them.
  for (const std::size_t w : {conv2_w, fc1_w}) {
    store.changed_all();
    pass(kept, &lk);
    {
      const ParameterStore::Lease lease = store.write(static_cast<std::int64_t>(w), static_cast<std::int64_t>(w + 100));
      for (float& v : lease.span()) v *= 0.5f;
    }
    pass(kept, &lk);
    pass(fresh, &lf);
    EXPECT_TRUE(same_bits(lk, lf)) << (w == conv2_w ? "the second convolution" : "the first fc")
                                   << " kept a stale copy after a write through a lease";
  }
  // The fc layers' copies are plain: the optimiser's pass writes them in its own loop, which it
  // can only do for the ranges the store names, exactly the fc weights.
  std::vector<std::pair<const float*, const float*>> named, want;
  for (const LayerKernel::PlainCopy& c : store.plain_bf16_images()) named.emplace_back(c.begin, c.end);
  for (const ParamTensor& t : spec.params)
    if (!t.is_bias && spec.layers[static_cast<std::size_t>(t.layer)].kind == LayerKind::kFc)
      want.emplace_back(params + t.offset, params + t.offset + t.size);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(named, want) << "the plain images are the fc weights, in the buffer's order";
  ASSERT_EQ(want.size(), 2u);
  // A report makes again the part it names, not more: the first fc's weights [1000, 2000) changed
  // beside the first range, which alone is reported, and the copies are stale.
  store.changed_all();
  pass(kept, &lk);  // every copy current again
  ASSERT_EQ(cuts[1], fc1_w + 1000);
  for (std::size_t i = cuts[0]; i < fc1_w + 2000; ++i) params[i] *= 0.5f;
  store.changed(static_cast<std::int64_t>(cuts[0]), static_cast<std::int64_t>(cuts[1]));
  pass(kept, &lk);
  pass(fresh, &lf);
  EXPECT_FALSE(same_bits(lk, lf)) << "a report of the first range made the fc weights past it too";
  // The optimiser's pass over the whole buffer in the pieces of a step's buckets, writing the fc
  // images itself; and an evaluation model on the same store, whose copies were made before.
  store.changed_all();
  Model eval(spec, batch, *be, store, nullptr);
  Model eval_fresh(spec, batch, *be, store.data(), nullptr);
  std::vector<float> le, lef, le_before;
  pass(eval, &le_before);
  OptimizerConfig cfg;
  cfg.kind = OptimizerKind::kAdam;
  Optimizer opt(cfg, spec.param_count, *be, &store);
  opt.begin_step(0.05);
  for (std::size_t r = 0; r + 1 < cuts.size(); ++r)
    opt.update(params, g_kept.data(), static_cast<std::int64_t>(cuts[r]), static_cast<std::int64_t>(cuts[r + 1]));
  pass(kept, &lk);
  pass(fresh, &lf);
  EXPECT_TRUE(same_bits(lk, lf)) << "logits after the optimiser's pass wrote the parameters and the fc images";
  pass(eval, &le);
  pass(eval_fresh, &lef);
  EXPECT_TRUE(same_bits(le, lef)) << "the evaluation model's logits after the optimiser's pass";
  EXPECT_FALSE(same_bits(le, le_before)) << "the step did not change the logits: this check could not tell";
}

TEST(Model, GradientOfEveryParameterTensor) {
  auto be = make_cpu_backend(1);
  const ModelSpec spec = parse_model_spec("conv:3x3:4:same,relu,maxpool:2,flatten,fc:10", {1, 8, 8}, 10);
  ASSERT_EQ(spec.params.size(), 4u);
  const int batch = 3;
  std::vector<float> params(static_cast<std::size_t>(spec.param_count)), grads(params.size(), 7.0f);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:0.1"), 42, params.data());
  Model model(spec, batch, *be, params.data(), grads.data(), nullptr);
  ASSERT_TRUE(model.training());
  const std::vector<float> x = uniform(static_cast<std::size_t>(batch * 64), 43);
  std::copy(x.begin(), x.end(), model.input());
  const std::vector<std::int32_t> labels{3, 7, 0};
  StepContext ctx;
  ctx.seed = 9;

  auto loss_at = [&] {
    model.forward(ctx);
    return be->softmax_cross_entropy(model.logits(), labels.data(), batch, 10, nullptr, 1.0f).loss_sum / batch;
  };

  // Forward against the reference.
  model.forward(ctx);
  std::vector<int> base_pattern, pattern;
  const std::vector<double> ref_logits = ref_model(spec, batch, to_double(x), to_double(params), &base_pattern);
  expect_close("logits", std::vector<float>(model.logits(), model.logits() + batch * 10), ref_logits, 1e-4, 1e-4);

  const LossStats st = be->softmax_cross_entropy(model.logits(), labels.data(), batch, 10, model.dlogits(),
                                                 1.0f / static_cast<float>(batch));
  const ref::SoftmaxXent rs = ref::softmax_cross_entropy(ref_logits, labels, batch, 10, 1.0 / batch);
  EXPECT_NEAR(st.loss_sum, rs.loss_sum, 1e-4);
  std::vector<int> done;
  model.backward(ctx, [&](int layer) { done.push_back(layer); });
  EXPECT_EQ(done, (std::vector<int>{4, 3, 2, 1, 0}));
  EXPECT_TRUE(std::none_of(grads.begin(), grads.end(), [](float g) { return g == 7.0f; }));

  // Two numeric gradients of every element: central differences of the double reference with a
  // tiny step (kinks almost never crossed), and of the float model itself with a float-sized step
  // (elements whose step crosses a ReLU / max-pool kink skipped: the difference is meaningless
  // there).
  const std::vector<double> xd = to_double(x);
  auto ref_loss = [&](const std::vector<double>& pd) {
    std::vector<int> unused;
    return ref::softmax_cross_entropy(ref_model(spec, batch, xd, pd, &unused), labels, batch, 10, 1.0).loss_sum / batch;
  };
  for (const ParamTensor& t : spec.params) {
    SCOPED_TRACE(t.name);
    std::vector<float> all_analytic, analytic;
    std::vector<double> numeric_ref, numeric;
    std::size_t skipped = 0, skipped_ref = 0;
    for (std::int64_t i = t.offset; i < t.offset + t.size; ++i) {
      const auto u = static_cast<std::size_t>(i);
      std::vector<double> pd = to_double(params);
      const double hd = 1e-6, v0 = pd[u];
      bool kink_ref = false;
      pd[u] = v0 + hd;
      const double rp = ref_loss(pd);
      ref_model(spec, batch, xd, pd, &pattern);
      kink_ref = kink_ref || pattern != base_pattern;
      pd[u] = v0 - hd;
      const double rm = ref_loss(pd);
      ref_model(spec, batch, xd, pd, &pattern);
      kink_ref = kink_ref || pattern != base_pattern;
      if (kink_ref) {
        ++skipped_ref;
      } else {
        all_analytic.push_back(grads[u]);
        numeric_ref.push_back((rp - rm) / (2 * hd));
      }

      const float h = 3e-3f, v = params[u], vp = v + h, vm = v - h;
      bool kink = false;
      for (float pv : {vp, vm}) {
        pd[u] = pv;
        ref_model(spec, batch, xd, pd, &pattern);
        kink = kink || pattern != base_pattern;
      }
      if (kink) {
        ++skipped;
        continue;
      }
      params[u] = vp;
      const double lp = loss_at();
      params[u] = vm;
      const double lm = loss_at();
      params[u] = v;
      analytic.push_back(grads[u]);
      numeric.push_back((lp - lm) / (static_cast<double>(vp) - static_cast<double>(vm)));
    }
    EXPECT_LE(skipped_ref, 1u);
    EXPECT_LE(skipped, static_cast<std::size_t>(t.size) / 2) << "too many kinks: choose another seed";
    expect_close("gradient vs the double reference", all_analytic, numeric_ref, 1e-4, 1e-3);
    expect_close("gradient vs the float model", analytic, numeric, 3e-4, 1e-2);
  }
}

}  // namespace
}  // namespace mnist_mpi
