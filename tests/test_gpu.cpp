// GPU tests (CTest label `gpu`): every CUDA kernel against the CPU backend on seeded random
// inputs (fp32: relative 1e-5 of the tensor's largest value; tf32: 1e-2), dropout masks and the
// optimiser and data gather bit for bit, two training steps CPU against GPU, the NCCL sums with
// exactly predictable inputs, and world-size invariance on the GPU. Without a GPU (or in a build
// without CUDA) every test is SKIPPED with the reason printed, never passed. Each comparison
// prints its agreement figure ("agreement ...") for the closing note.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/cpu.hpp"
#include "mnist_mpi/backend/device.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/exact_sum.hpp"
#include "mnist_mpi/train/trainer.hpp"
#include "synthetic.hpp"
#include "test_util.hpp"  // world_rank, world_size, all_ranks, uniform

namespace mnist_mpi {
namespace {

// Distinct values (no ties in a pooling window), in a random order.
std::vector<float> distinct(std::size_t n, std::uint64_t seed) {
  std::vector<std::size_t> p(n);
  std::iota(p.begin(), p.end(), std::size_t{0});
  std::shuffle(p.begin(), p.end(), std::mt19937_64(seed));
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 0.01f * (static_cast<float>(p[i]) - 0.5f * static_cast<float>(n));
  return v;
}

// |gpu - cpu| <= rtol * (max |cpu| + |cpu|) everywhere: relative to the tensor's scale, so that
// a sum that cancels to nearly zero is not held to a relative bound it can't meet. Prints the
// agreement figure; on failure names the worst element.
void expect_agree(const std::string& what, const std::vector<float>& gpu, const std::vector<float>& cpu, double rtol) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double scale = 0.0;
  for (float v : cpu) scale = std::max(scale, std::abs(static_cast<double>(v)));
  std::size_t worst = 0, bad = 0;
  double worst_err = -1.0;
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    const double err = std::abs(static_cast<double>(gpu[i]) - cpu[i]);
    if (!(err <= rtol * (scale + std::abs(static_cast<double>(cpu[i]))))) ++bad;  // NaN counts as bad
    if (err > worst_err || std::isnan(err)) {
      worst_err = std::isnan(err) ? INFINITY : err;
      worst = i;
    }
  }
  if (world_rank() == 0)
    std::printf("agreement %-44s max |gpu-cpu| / max |cpu| = %.2e (%zu elements)\n", what.c_str(),
                scale > 0 ? worst_err / scale : worst_err, gpu.size());
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << gpu.size() << " elements out of tolerance (rtol " << rtol
                     << " of scale " << scale << "); worst at [" << worst << "]: gpu " << gpu[worst] << ", cpu "
                     << cpu[worst];
}

// The same bits, signed zeros told apart; two NaNs count as the same (a NaN's sign and payload are
// the hardware's: x86 keeps an operand's, a GPU gives its canonical NaN).
void expect_bitwise(const std::string& what, const std::vector<float>& gpu, const std::vector<float>& cpu) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < gpu.size(); ++i)
    if (std::memcmp(&gpu[i], &cpu[i], sizeof(float)) != 0 && !(std::isnan(gpu[i]) && std::isnan(cpu[i])) && bad++ == 0)
      first = i;
  if (world_rank() == 0)
    std::printf("agreement %-44s %zu of %zu elements differ in any bit\n", what.c_str(), bad, gpu.size());
  EXPECT_EQ(bad, 0u) << what << ": first difference at [" << first << "]: gpu " << gpu[first] << ", cpu " << cpu[first];
}

// Skips (with the reason) unless this build has the CUDA backend and a GPU is visible.
class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_built()) GTEST_SKIP() << "this build has no CUDA backend (configured without CUDA, cuDNN or NCCL)";
    const GpuProbe p = probe_gpus();
    if (p.count == 0) GTEST_SKIP() << "no usable GPU: " << p.why_none;
    gpus_ = p.count;
    gpu_ = world_rank() % p.count;
  }
  int gpus_ = 0, gpu_ = 0;
};

std::int64_t param_size(const LayerSpec& l) {
  if (l.kind == LayerKind::kConv)
    return static_cast<std::int64_t>(l.channels) * l.in.c * l.kernel_h * l.kernel_w + l.channels;
  if (l.kind == LayerKind::kFc) return static_cast<std::int64_t>(l.channels) * l.in.size() + l.channels;
  if (l.kind == LayerKind::kBatchNorm) return 2 * static_cast<std::int64_t>(l.channels);  // scale, shift
  return 0;
}

// One layer on one backend, with its buffers in that backend's memory.
struct Side {
  Backend& be;
  std::unique_ptr<Buffer> x, y, dy, dx, w, dw, state;
  std::unique_ptr<LayerKernel> k;
  Side(Backend& b, const LayerSpec& l, int index, int batch, const std::vector<float>& xv,
       const std::vector<float>& dyv, const std::vector<float>& wv)
      : be(b) {
    x = up(xv);
    y = be.allocate(static_cast<std::int64_t>(dyv.size()));
    dy = up(dyv);
    dx = be.allocate(static_cast<std::int64_t>(xv.size()));
    LayerBuffers lb;
    lb.batch = batch;
    lb.x = x->data();
    lb.y = y->data();
    lb.dy = dy->data();
    lb.dx = dx->data();
    if (!wv.empty()) {
      w = up(wv);
      dw = be.allocate(static_cast<std::int64_t>(wv.size()));
      lb.w = w->data();
      lb.dw = dw->data();
    }
    if (l.kind == LayerKind::kBatchNorm) {  // running mean 0.5, variance 0.5 (then moved by forward)
      state = up(std::vector<float>(2 * static_cast<std::size_t>(l.channels), 0.5f));
      lb.state = state->data();
    }
    k = be.make_layer(l, index, lb, true);
  }
  std::unique_ptr<Buffer> up(const std::vector<float>& v) {
    auto b = be.allocate(static_cast<std::int64_t>(v.size()));
    be.upload(v, b->data());
    return b;
  }
  std::vector<float> down(Buffer& b) {
    std::vector<float> v(static_cast<std::size_t>(b.size()));
    be.download(b.data(), v);
    return v;
  }
};

// How a layer's outputs must agree: within rtol of the tensor's scale, bit for bit, or y bit for
// bit and the gradients within rtol (a max pool whose windows overlap: an input's gradient is a
// sum over the windows that chose it, in an order that is the library's).
enum class Match { kClose, kBitwise, kBitwiseForward };

// Forward and backward of one layer on both backends, from the inputs x and dy; y, dx and dw
// compared.
void compare_layer_on(int gpu, const std::string& text, Shape input, int batch, bool tf32, double rtol, Match match,
                      const std::vector<float>& xv, const std::vector<float>& dyv) {
  const ModelSpec spec = parse_model_spec(text + ",flatten,fc:10", input, 10);
  const LayerSpec& l = spec.layers.at(0);
  ASSERT_EQ(xv.size(), static_cast<std::size_t>(batch * l.in.size()));
  ASSERT_EQ(dyv.size(), static_cast<std::size_t>(batch * l.out.size()));
  const std::vector<float> wv = uniform(static_cast<std::size_t>(param_size(l)), 13, -0.5f, 0.5f);
  auto cpu_be = make_cpu_backend(1);
  auto gpu_be = make_cuda_backend(gpu, tf32 ? GpuPrecision::kTf32 : GpuPrecision::kFp32);
  Side cpu(*cpu_be, l, 0, batch, xv, dyv, wv), dev(*gpu_be, l, 0, batch, xv, dyv, wv);
  StepContext ctx{true, 7, 3, 16};
  // Dropout reads the step from device memory (Note [A step as one CUDA graph]).
  gpu_be->set_step_args(ctx.step, 0.0, 0);
  cpu.k->forward(ctx);
  dev.k->forward(ctx);
  cpu.k->backward(ctx);
  dev.k->backward(ctx);
  const std::string name = text + (tf32 ? " tf32" : "");
  auto check = [&](const char* part, Buffer& g, Buffer& c, bool bitwise) {
    if (bitwise)
      expect_bitwise(name + " " + part, dev.down(g), cpu.down(c));
    else
      expect_agree(name + " " + part, dev.down(g), cpu.down(c), rtol);
  };
  check("y", *dev.y, *cpu.y, match != Match::kClose);
  check("dx", *dev.dx, *cpu.dx, match == Match::kBitwise);
  if (dev.dw) check("dw", *dev.dw, *cpu.dw, match == Match::kBitwise);
  if (dev.state) check("running statistics", *dev.state, *cpu.state, match == Match::kBitwise);
}

// The same on seeded random inputs (distinct_input: no two x equal, so no ties in a pool window).
void compare_layer(int gpu, const std::string& text, Shape input, int batch, bool tf32, double rtol,
                   bool distinct_input = false, Match match = Match::kClose) {
  const ModelSpec spec = parse_model_spec(text + ",flatten,fc:10", input, 10);
  const LayerSpec& l = spec.layers.at(0);
  const auto nx = static_cast<std::size_t>(batch * l.in.size()), ny = static_cast<std::size_t>(batch * l.out.size());
  compare_layer_on(gpu, text, input, batch, tf32, rtol, match, distinct_input ? distinct(nx, 11) : uniform(nx, 11),
                   uniform(ny, 12));
}

TEST_F(Gpu, ConvolutionMatchesCpu) {
  compare_layer(gpu_, "conv:5x5:8:same", {3, 12, 12}, 4, false, 1e-5);
  compare_layer(gpu_, "conv:3x3:5:valid", {2, 8, 8}, 3, false, 1e-5);
  compare_layer(gpu_, "conv:3x3:6:same:s2", {2, 10, 10}, 3, false, 1e-5);  // asymmetric same: padded
  compare_layer(gpu_, "conv:2x2:4:same", {3, 7, 7}, 2, false, 1e-5);       // asymmetric same: padded
}

TEST_F(Gpu, ConvolutionMatchesCpuInTf32) { compare_layer(gpu_, "conv:5x5:8:same", {3, 12, 12}, 4, true, 1e-2); }

TEST_F(Gpu, MaxPoolMatchesCpu) {
  compare_layer(gpu_, "maxpool:2", {3, 8, 8}, 3, false, 1e-6, true, Match::kBitwise);
  // Overlapping windows: an input chosen by several windows sums their gradients in the library's
  // order (the first GPU run: 2 of 324 a rounding apart), so dx agrees to rounding, y bit for bit.
  compare_layer(gpu_, "maxpool:3:2", {2, 9, 9}, 2, false, 1e-6, true, Match::kBitwiseForward);
}

TEST_F(Gpu, ReluMatchesCpu) { compare_layer(gpu_, "relu", {3, 5, 5}, 4, false, 0.0, false, Match::kBitwise); }

// Note [The ReLU, bit for bit] (src/backend/cuda/kernels.cu): signed zeros, NaNs, infinities and
// denormals, each with a negative and a positive gradient, give the CPU's bits both ways.
TEST_F(Gpu, ReluEdgeCasesMatchCpu) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity(),
              tiny = std::numeric_limits<float>::denorm_min() * 1000.0f;
  const std::vector<float> cases = {nan, -nan, 0.0f, -0.0f, 1.0f, -1.0f, inf, -inf, tiny, -tiny};
  std::vector<float> x, dy;
  for (float v : cases)
    for (float g : {-2.0f, 3.0f, -0.0f, nan, inf}) {
      x.push_back(v);
      dy.push_back(g);
    }
  x.resize(60, 0.5f);  // (2, 30, 1, 1)
  dy.resize(60, -0.25f);
  compare_layer_on(gpu_, "relu", {30, 1, 1}, 2, false, 0.0, Match::kBitwise, x, dy);
}

TEST_F(Gpu, FullyConnectedMatchesCpu) {
  compare_layer(gpu_, "fc:7", {3, 4, 4}, 5, false, 1e-5);
  compare_layer(gpu_, "fc:33", {50, 1, 1}, 9, false, 1e-5);
  compare_layer(gpu_, "fc:33", {50, 1, 1}, 9, true, 1e-2);
}

// Batch norm: its own kernels against the CPU's loops (both sum in double, in other orders), after
// a conv (statistics over N, H, W) and after an fc (over N); the running statistics too.
TEST_F(Gpu, BatchNormMatchesCpu) {
  compare_layer(gpu_, "batchnorm", {6, 9, 9}, 4, false, 1e-5);
  compare_layer(gpu_, "batchnorm:0.3:0.001", {40, 1, 1}, 8, false, 1e-5);
}

// The dropout masks are the CPU's, bit for bit (the same function, compiled for the device).
TEST_F(Gpu, DropoutMasksEqualCpu) {
  compare_layer(gpu_, "dropout:0.4", {4, 6, 6}, 5, false, 0.0, false, Match::kBitwise);
}

Split random_split(std::int64_t count, std::uint64_t seed) {
  Split s;
  s.count = count;
  s.rows = 28;
  s.cols = 28;
  std::mt19937_64 g(seed);
  s.pixels.resize(static_cast<std::size_t>(count * 784));
  s.labels.resize(static_cast<std::size_t>(count));
  for (auto& p : s.pixels) p = static_cast<std::uint8_t>(g() & 0xFF);
  for (auto& l : s.labels) l = static_cast<std::uint8_t>(g() % 10);
  return s;
}

// Note [bf16 on the GPU] (src/backend/cuda/cuda_backend.cpp): a model on the bf16 backend gives
// the fp32 GPU model's logits and every gradient tensor to bf16's precision, yet not its bits (the
// bf16 kernels ran); the first convolution stays float. As the CPU's
// Model.Bf16GradientsAreTheFp32OnesToBf16Precision, a linear model (no kinks to flip). Then the
// parameters change (as the optimiser changes them) and a second forward must follow them: a
// bf16 copy of the weights made once and kept would give the old parameters' logits.
TEST_F(Gpu, Bf16GradientsAreTheFp32OnesToBf16Precision) {
  auto be32 = make_cuda_backend(gpu_, GpuPrecision::kFp32);
  auto be16 = make_cuda_backend(gpu_, GpuPrecision::kBf16);
  EXPECT_EQ(be16->name(), "cuda (bf16)");
  const ModelSpec spec = parse_model_spec("conv:3x3:16:same,conv:3x3:32:same,flatten,fc:64,fc:10", {1, 28, 28}, 10);
  const int batch = 8;
  const auto P = static_cast<std::size_t>(spec.param_count);
  std::vector<float> params(P);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:0.1"), 42, params.data());
  std::vector<float> changed(P);
  init_params(spec, parse_init_spec("he"), parse_init_spec("constant:-0.2"), 43, changed.data());
  const Split split = random_split(40, 6);
  std::vector<float> logits[2], grads[2], logits_after[2];
  std::string described;
  Backend* bes[2] = {be32.get(), be16.get()};
  for (int side = 0; side < 2; ++side) {
    Backend& be = *bes[side];
    auto p = be.allocate(static_cast<std::int64_t>(P)), g = be.allocate(static_cast<std::int64_t>(P));
    be.upload(params, p->data());
    Model m(spec, batch, be, p->data(), g->data(), nullptr);
    if (side == 1) described = m.describe();
    auto src = be.make_data_source(split, batch);
    src->slice(3, batch, m.input());
    StepContext ctx;
    be.set_step_args(0, 0.0, 0);
    m.forward(ctx);
    be.softmax_cross_entropy(m.logits(), src->labels(), batch, 10, m.dlogits(), 1.0f / batch);
    m.backward(ctx);
    logits[side].resize(static_cast<std::size_t>(batch * 10));
    grads[side].resize(P);
    be.download(m.logits(), logits[side]);
    be.download(g->data(), grads[side]);
    be.upload(changed, p->data());
    m.forward(ctx);
    logits_after[side].resize(logits[side].size());
    be.download(m.logits(), logits_after[side]);
  }
  const std::string first_layer = described.substr(0, described.find('\n'));
  EXPECT_EQ(first_layer.find("bf16"), std::string::npos) << described;
  EXPECT_NE(described.find(", bf16 (y, dx and dW widened to float)"), std::string::npos) << described;
  EXPECT_NE(described.find("cublas gemm fc on bf16 copies"), std::string::npos) << described;
  const Distance d = distance(logits[0].data(), logits[1].data(), batch * 10);  // test_util.hpp
  EXPECT_LE(d.relative, 2e-2) << "logits off by " << d.relative << " of their norm";
  EXPECT_TRUE(d.differ) << "the bf16 model computed the fp32 bits: did its kernels run?";
  for (const ParamTensor& t : spec.params) {
    const Distance g = distance(grads[0].data() + t.offset, grads[1].data() + t.offset, t.size);
    EXPECT_LE(g.relative, 2e-2) << t.name << ": off by " << g.relative << " of its norm";
    EXPECT_TRUE(g.differ) << t.name << ": the fp32 bits";
  }
  const Distance after = distance(logits_after[0].data(), logits_after[1].data(), batch * 10);
  EXPECT_LE(after.relative, 2e-2) << "after the parameters changed, logits off by " << after.relative
                                  << ": the bf16 copies did not follow them?";
  EXPECT_GT(distance(logits_after[0].data(), logits[0].data(), batch * 10).relative, 0.1)
      << "the changed parameters did not change the fp32 logits: this check could not tell";
}

// The batch gather (pixels / 255, in the epoch's order) and the softmax cross-entropy on the
// labels it gathered: the same floats as the CPU's, the same loss.
TEST_F(Gpu, DataGatherAndLossMatchCpu) {
  const Split split = random_split(300, 5);
  std::vector<std::int64_t> order(300);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(9));
  const int batch = 37, classes = 10;
  auto cpu_be = make_cpu_backend(1);
  auto gpu_be = make_cuda_backend(gpu_, GpuPrecision::kFp32);
  const std::vector<float> logits = uniform(static_cast<std::size_t>(batch * classes), 21, -6.0f, 6.0f);
  std::vector<float> xs[2], ds[2];
  LossStats st[2];
  Backend* bes[2] = {cpu_be.get(), gpu_be.get()};
  for (int side = 0; side < 2; ++side) {
    Backend& be = *bes[side];
    auto src = be.make_data_source(split, batch);
    auto x = be.allocate(batch * 784), z = be.allocate(batch * classes), d = be.allocate(batch * classes);
    src->set_order(order);
    src->gather(123, batch, x->data());
    be.upload(logits, z->data());
    st[side] = be.softmax_cross_entropy(z->data(), src->labels(), batch, classes, d->data(), 0.25f);
    xs[side].resize(static_cast<std::size_t>(batch * 784));
    ds[side].resize(static_cast<std::size_t>(batch * classes));
    be.download(x->data(), xs[side]);
    be.download(d->data(), ds[side]);
  }
  expect_bitwise("gather (uint8 -> float, permuted)", xs[1], xs[0]);
  expect_agree("softmax xent dlogits", ds[1], ds[0], 1e-6);
  EXPECT_NEAR(st[1].loss_sum, st[0].loss_sum, 1e-10 * std::abs(st[0].loss_sum));
  EXPECT_EQ(st[1].correct, st[0].correct);
  if (world_rank() == 0)
    std::printf("agreement %-44s gpu %.12f cpu %.12f, correct %lld / %lld\n", "softmax xent loss sum", st[1].loss_sum,
                st[0].loss_sum, static_cast<long long>(st[1].correct), static_cast<long long>(st[0].correct));
}

// Note [The optimiser bit for bit] in src/backend/cuda/kernels.cu: three steps of Adam (with
// weight decay), of SGD with Nesterov momentum and of LAMB (two weight tensors around a bias: its
// exact norms on the device, Note [LAMB in two phases]) give the CPU's bits.
TEST_F(Gpu, OptimizerEqualsCpuBitForBit) {
  const std::int64_t n = 5000;
  for (const OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kSgd, OptimizerKind::kLamb}) {
    OptimizerConfig cfg;
    cfg.kind = kind;
    cfg.weight_decay = 1e-3;
    cfg.momentum = 0.9;
    cfg.nesterov = true;
    auto cpu_be = make_cpu_backend(1);
    auto gpu_be = make_cuda_backend(gpu_, GpuPrecision::kFp32);
    std::vector<float> out[2], mom[2];
    Backend* bes[2] = {cpu_be.get(), gpu_be.get()};
    for (int side = 0; side < 2; ++side) {
      Backend& be = *bes[side];
      Optimizer opt(cfg, n, be);
      opt.set_tensors({{0, 3000, true}, {3000, 3010, false}, {3010, n, true}});
      auto p = be.allocate(n), g = be.allocate(n);
      be.upload(uniform(static_cast<std::size_t>(n), 1), p->data());
      for (int t = 0; t < 3; ++t) {
        be.upload(uniform(static_cast<std::size_t>(n), 100 + static_cast<std::uint64_t>(t), -1e-2f, 1e-2f), g->data());
        be.set_step_args(t, 1e-3 * (t + 1), 0);  // the rate, from device memory on the GPU
        opt.step(p->data(), g->data(), 1e-3 * (t + 1));
      }
      out[side].resize(static_cast<std::size_t>(n));
      mom[side].resize(static_cast<std::size_t>(n));
      be.download(p->data(), out[side]);
      be.download(opt.first_moment().data(), mom[side]);
    }
    expect_bitwise(std::string(name_of(kind)) + " params after 3 steps", out[1], out[0]);
    expect_bitwise(std::string(name_of(kind)) + " first moment after 3 steps", mom[1], mom[0]);
  }
}

// A device buffer of int64 (FixedPointPasses::integers) read as bytes: Backend::download copies floats.
std::vector<std::int64_t> download_integers(Backend& be, std::span<const std::int64_t> device) {
  std::vector<std::int64_t> out(device.size());
  be.download(reinterpret_cast<const float*>(device.data()),
              std::span<float>(reinterpret_cast<float*>(out.data()), 2 * out.size()));
  return out;
}

// Note [Fixed point on a GPU] (src/backend/cuda/kernels.cu): the device's passes of --exact-sums
// give the host's integers, counters, largest magnitudes and floats bit for bit, on values of
// every exponent from 2^-149 to 2^4 (subnormals and zeros too), converted in pieces at offsets,
// and count the same values at the bound, beyond it, NaN and inf.
TEST_F(Gpu, FixedPointPassesGiveTheHostsBits) {
  const std::int64_t n = 100003, chunks = 7;
  auto be = make_cuda_backend(gpu_, GpuPrecision::kFp32);
  auto host = make_host_fixed_point_passes(n, 2);
  auto dev = be->make_fixed_point_passes(n, 2);
  ASSERT_EQ(dev->integers().size(), static_cast<std::size_t>(n + 2));
  std::mt19937_64 gen(29);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-149, 4);
  const auto chunk = [&] {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = std::ldexp(mantissa(gen), exponent(gen));
    v[0] = 0.0f;
    v[1] = -0.0f;
    v[2] = std::numeric_limits<float>::denorm_min();
    v[3] = std::nextafter(16.0f, 0.0f);  // the largest below 2^4
    return v;
  };
  const int shift = shift_for_limit(4, chunks);  // every value below 2^4
  const double scale = std::ldexp(1.0, shift), unscale = std::ldexp(1.0, -shift);
  const float bound = 16.0f;
  auto g = be->allocate(n);
  const std::int64_t cut = n / 3;
  for (std::int64_t j = 0; j < chunks; ++j) {
    const std::vector<float> v = chunk();
    be->upload(v, g->data());
    for (const auto& [at, len] : {std::pair{std::int64_t{0}, cut}, std::pair{cut, n - cut}}) {
      host->to_fixed(v.data() + at, at, len, scale, bound, j == 0);
      dev->to_fixed(g->data() + at, at, len, scale, bound, j == 0);
    }
    host->probe(v.data(), n, 0);
    dev->probe(g->data(), n, 0);
  }
  std::vector<std::uint32_t> mh(2), md(2);
  FixedPointCounts ch = host->read(mh), cd = dev->read(md);
  EXPECT_EQ(ch.out_of_range, 0);
  EXPECT_EQ(ch.nonfinite, 0);
  EXPECT_EQ(cd.out_of_range, 0);
  EXPECT_EQ(cd.nonfinite, 0);
  EXPECT_EQ(md[0], mh[0]) << "the probe's largest magnitude";
  const std::vector<std::int64_t> qd = download_integers(*be, dev->integers());
  const std::span<std::int64_t> qh = host->integers();
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < n; ++i) differ += qd[static_cast<std::size_t>(i)] != qh[static_cast<std::size_t>(i)];
  EXPECT_EQ(differ, 0) << "of " << n << " integers";
  // Back to float, the largest magnitude with them.
  std::vector<float> fh(static_cast<std::size_t>(n)), fd(static_cast<std::size_t>(n));
  host->from_fixed(0, fh.data(), n, unscale, 1);
  dev->from_fixed(0, g->data(), n, unscale, 1);
  be->download(g->data(), fd);
  host->read(mh);
  dev->read(md);
  expect_bitwise("fixed point back to float", fd, fh);
  EXPECT_EQ(md[1], mh[1]) << "the sums' largest magnitude";
  EXPECT_EQ(md[0], 0u) << "read() zeroes the slots";
  // Tiny values (a limit of 2^-120, so that subnormal inputs are integers and sums come back
  // subnormal: --ftz=false), converted back at an offset, then a sum too large for a float (the
  // largest magnitude is then inf's bits).
  {
    const int tiny = shift_for_limit(-120, chunks);
    const double ts = std::ldexp(1.0, tiny), tu = std::ldexp(1.0, -tiny);
    const float tb = std::ldexp(1.0f, -120);
    std::uniform_int_distribution<int> small(-149, -121);
    std::vector<float> vt(static_cast<std::size_t>(n));
    for (float& x : vt) x = std::ldexp(mantissa(gen), small(gen));
    be->upload(vt, g->data());
    host->to_fixed(vt.data(), 0, n, ts, tb, true);
    dev->to_fixed(g->data(), 0, n, ts, tb, true);
    std::fill(fh.begin(), fh.end(), 0.0f);
    be->upload(fh, g->data());
    host->from_fixed(cut, fh.data() + cut, n - cut, tu, 1);
    dev->from_fixed(cut, g->data() + cut, n - cut, tu, 1);
    be->download(g->data(), fd);
    ch = host->read(mh);
    cd = dev->read(md);
    EXPECT_EQ(ch.out_of_range, 0);
    EXPECT_EQ(cd.out_of_range, 0);
    expect_bitwise("fixed point of subnormals, back at an offset", fd, fh);
    EXPECT_EQ(md[1], mh[1]);
    EXPECT_GT(
        std::count_if(fh.begin() + cut, fh.end(), [](float x) { return x != 0.0f && std::fabs(x) < 1.17549435e-38f; }),
        1000)
        << "too few subnormal results: this part could not tell a flush to zero";
    host->from_fixed(0, fh.data(), n, std::ldexp(1.0, 200), 0);
    dev->from_fixed(0, g->data(), n, std::ldexp(1.0, 200), 0);
    be->download(g->data(), fd);
    host->read(mh);
    dev->read(md);
    expect_bitwise("fixed point back beyond float's range", fd, fh);
    EXPECT_EQ(mh[0], 0x7f800000u) << "the host's largest magnitude of sums beyond float's range";
    EXPECT_EQ(md[0], mh[0]);
  }
  // What cannot be held: at the bound, beyond it, NaN and inf, counted apart (the probe ignores
  // the non-finite ones).
  std::vector<float> bad(64, 1.0f);
  bad[5] = 16.0f;
  bad[6] = -40.0f;
  bad[7] = std::numeric_limits<float>::quiet_NaN();
  bad[8] = -std::numeric_limits<float>::infinity();
  bad[9] = std::numeric_limits<float>::max();
  be->upload(bad, g->data());
  host->zero_counters();
  dev->zero_counters();
  host->to_fixed(bad.data(), 100, 64, scale, bound, false);
  dev->to_fixed(g->data(), 100, 64, scale, bound, false);
  host->probe(bad.data(), 64, 0);
  dev->probe(g->data(), 64, 0);
  ch = host->read(mh);
  cd = dev->read(md);
  EXPECT_EQ(ch.out_of_range, 3);
  EXPECT_EQ(ch.nonfinite, 2);
  EXPECT_EQ(cd.out_of_range, ch.out_of_range);
  EXPECT_EQ(cd.nonfinite, ch.nonfinite);
  EXPECT_EQ(md[0], mh[0]);
  EXPECT_EQ(mh[0], std::bit_cast<std::uint32_t>(std::numeric_limits<float>::max()));
  dev->fill_nan(g->data(), 64);
  be->download(g->data(), std::span<float>(bad));
  EXPECT_EQ(std::count_if(bad.begin(), bad.end(), [](float x) { return std::isnan(x); }), 64);
  if (world_rank() == 0)
    std::printf("agreement fixed point, GPU against host: bitwise (%lld integers)\n", static_cast<long long>(n));
}

const std::string& data_dir() {
  static const std::string dir = testing::shared_synthetic_dir("gpu", 1200, 200);
  return dir;
}

Options options(const std::string& device, std::int64_t global_batch, std::int64_t steps) {
  Options o;
  o.data_dir = data_dir();
  o.validation_size = 100;
  o.model = "conv:3x3:4:same,relu,maxpool:2,conv:3x3:8:same,relu,maxpool:2,flatten,fc:32,relu,dropout:0.5,fc:10";
  o.global_batch_size = global_batch;
  o.max_steps = steps;
  o.threads = 1;
  o.quiet = true;
  o.log_every = 0;
  o.check_replicas_every = 0;
  o.eval_batch_size = 100;
  o.device = device;
  o.allow_gpu_sharing = true;
  // SGD: a step moves each parameter by lr * its gradient, so float differences stay float-sized
  // (Adam's first steps are ~lr * sign(g), which a tiny gradient's rounding can flip).
  o.optimizer.kind = OptimizerKind::kSgd;
  o.optimizer.momentum = 0.9;
  o.schedule.base_lr = 0.05;
  return o;
}

std::vector<float> train(MPI_Comm comm, const Options& o) {
  auto c = make_mpi_communicator(comm);
  Trainer t(o, *c);
  t.run();
  return t.params_to_host();
}

// Two whole training steps (data, forward, loss, backward, NCCL sum, optimiser) on one rank:
// CPU against GPU.
TEST_F(Gpu, TwoTrainingStepsMatchCpu) {
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank(), 0, &self);
  const std::vector<float> cpu = train(self, options("cpu", 32, 2));
  const std::vector<float> gpu = train(self, options("cuda", 32, 2));
  MPI_Comm_free(&self);
  expect_agree("two training steps: parameters", gpu, cpu, 1e-5);
}

// Note [Non-finite steps]: a NaN in rank 0's loss at step 3 (the MNIST_MPI_FAULT
// hook) stops the run with exit code 5 naming step 3 and rank 0, and no update reaches the
// parameters from step 3 on (the guard holds them until the host reads the verdict two steps
// later): they equal those of a run of 2 steps.
TEST_F(Gpu, NonFiniteStepStopsTheRunAndNothingReachesTheParameters) {
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank(), 0, &self);
  const std::vector<float> two_steps = train(self, options("cuda", 32, 2));
  {  // the trainer is destroyed before its communicator, and both before MPI_Comm_free
    setenv("MNIST_MPI_FAULT", "0:3:nan", 1);
    auto c = make_mpi_communicator(self);
    Trainer t(options("cuda", 32, 10), *c);
    unsetenv("MNIST_MPI_FAULT");
    ExitCode code = ExitCode::kOk;
    std::string msg;
    try {
      t.run();
    } catch (const Error& e) {
      code = e.code();
      msg = e.what();
    }
    EXPECT_EQ(code, ExitCode::kNumerical) << msg;
    EXPECT_NE(msg.find("non-finite gradient in step 3 (the loss was not finite on rank 0"), std::string::npos) << msg;
    const std::vector<float> p = t.params_to_host();
    EXPECT_TRUE(std::all_of(p.begin(), p.end(), [](float v) { return std::isfinite(v); }));
    expect_agree("parameters after a NaN in step 3 against 2 steps", p, two_steps, 1e-6);
  }
  MPI_Comm_free(&self);
}

// With --skip-nonfinite-steps the NaN step is skipped and counted, and the run goes on like the
// CPU's, which skips the same step. With Adam the skipped step must not count either (Note [The
// optimiser's step count]): the bias corrections of the later steps, and the step count that a
// checkpoint saves, are the CPU's.
TEST_F(Gpu, SkippedNonFiniteStepMatchesTheCpu) {
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank(), 0, &self);
  for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam}) {
    SCOPED_TRACE(name_of(kind));
    std::vector<float> out[2];
    std::int64_t skipped[2] = {0, 0}, steps[2] = {0, 0};
    const char* devices[2] = {"cpu", "cuda"};
    for (int side = 0; side < 2; ++side) {
      Options o = options(devices[side], 32, 6);
      o.skip_nonfinite_steps = true;
      o.optimizer.kind = kind;
      // Adam's update is about lr * sign(g) while |g| is far above eps: a gradient that is a
      // rounding away from zero then moves a parameter by +-lr on one side and not the other (the
      // first GPU run: 181 of 13242 parameters, worst 0.30 against 0.15). With eps = 1 the update is
      // about lr * m / (1 - beta1^t), smooth in g, and still depends on the step count t that the
      // skipped step must not advance (one step too many: 13 % off at t = 5).
      if (o.optimizer.kind == OptimizerKind::kAdam) o.optimizer.eps = 1.0;
      setenv("MNIST_MPI_FAULT", "0:3:nan", 1);
      auto c = make_mpi_communicator(self);
      Trainer t(o, *c);
      unsetenv("MNIST_MPI_FAULT");
      skipped[side] = t.run().skipped_steps;
      out[side] = t.params_to_host();
      steps[side] = t.optimizer().steps_taken();
    }
    EXPECT_EQ(skipped[0], 1);
    EXPECT_EQ(skipped[1], 1);
    EXPECT_EQ(steps[0], 5);
    EXPECT_EQ(steps[1], 5) << "the GPU counted the skipped step";
    expect_agree("6 steps with step 3 skipped", out[1], out[0], 1e-5);
  }
  MPI_Comm_free(&self);
}

// Note [A step as one CUDA graph]: the replayed graph gives the ungraphed step's bits, with dropout
// (its step from device memory), 2 accumulated micro-batches of uneven size (33 = 17 + 16), Adam
// and SGD (the rate and step count from device memory), across an epoch boundary (the order
// uploaded between replays: 1100 training images, 33 steps of 33 per epoch), and with a step that the
// testing hook poisons (run ungraphed, skipped) in the middle of the replays.
TEST_F(Gpu, GraphedStepsGiveTheUngraphedBits) {
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank(), 0, &self);
  // bf16 too (Note [bf16 on the GPU]): its copies of the weights are made inside the graph, so a
  // replay must see each step's new weights.
  for (const char* precision : {"fp32", "bf16"})
  for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam}) {
    for (bool poisoned : {false, true}) {
      SCOPED_TRACE(std::string(precision) + ", " + name_of(kind) + (poisoned ? ", step 12 poisoned" : ""));
      std::vector<float> out[2];
      std::int64_t steps[2] = {0, 0}, replays[2] = {0, 0};
      for (int graph = 0; graph < 2; ++graph) {
        Options o = options("cuda", 33, 40);
        o.precision = precision;
        o.optimizer.kind = kind;
        o.accumulation_steps = 2;
        o.allow_gpu_sharing = false;
        o.cuda_graph = graph == 1;
        o.skip_nonfinite_steps = true;
        if (poisoned) setenv("MNIST_MPI_FAULT", "0:12:nan", 1);
        auto c = make_mpi_communicator(self);
        Trainer t(o, *c);
        unsetenv("MNIST_MPI_FAULT");
        EXPECT_EQ(t.run().skipped_steps, poisoned ? 1 : 0);
        out[graph] = t.params_to_host();
        steps[graph] = t.optimizer().steps_taken();
        replays[graph] = t.graph_replays();
      }
      EXPECT_EQ(replays[0], 0);
      // The graph really ran: every step but the first (and the poisoned one) was a replay.
      EXPECT_EQ(replays[1], poisoned ? 38 : 39);
      EXPECT_EQ(steps[1], steps[0]);
      expect_bitwise("40 steps, graphed against ungraphed", out[1], out[0]);
    }
  }
  MPI_Comm_free(&self);
}

// The NCCL tests' start: a connected gradient communicator over every rank, and a device buffer of
// n elements holding (rank + 1) * (i % 1013), integer-valued so that every sum is exact (`host`
// holds the same values).
struct NcclRig {
  NcclRig(int gpu, std::int64_t n) : mpi(make_mpi_communicator(MPI_COMM_WORLD)), be(make_cuda_backend(gpu, GpuPrecision::kFp32)) {
    nccl = be->make_gradient_communicator(*mpi, n, false, /*integer_sums=*/true);
    if (!nccl) return;
    nccl->connect();
    host.resize(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      host[static_cast<std::size_t>(i)] = static_cast<float>((world_rank() + 1) * (i % 1013));
    buf = be->allocate(n);
    be->upload(host, buf->data());
    all = std::span<float>(buf->data(), static_cast<std::size_t>(n));
  }
  std::unique_ptr<Communicator> mpi;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Communicator> nccl;
  std::vector<float> host;
  std::unique_ptr<Buffer> buf;
  std::span<float> all;
};

// The NCCL tests: one GPU per rank (skipped otherwise) and an NcclRig of n elements, n not a
// multiple of 2, 3 or 4. Run on 1 rank and on 2 (tests/CMakeLists.txt, gpu_np2 of scripts/gpu_check.sh).
class GpuNccl : public Gpu {
 protected:
  static constexpr std::int64_t n = 100003;
  void SetUp() override {
    Gpu::SetUp();
    if (IsSkipped()) return;
    // Note [Ranks that are NCCL hosts of their own]: two ranks on one GPU, each with its own
    // NCCL_HOSTID (scripts/gpu_check.sh's nccl_hosts stage), are two NCCL hosts.
    if (world_size() > gpus_ && !ranks_are_nccl_hosts(*make_mpi_communicator(MPI_COMM_WORLD)))
      GTEST_SKIP() << "NCCL needs one GPU per rank, or ranks that are NCCL hosts of their own (NCCL_HOSTID): "
                   << world_size() << " ranks, " << gpus_ << " GPU(s)";
    rig_ = std::make_unique<NcclRig>(gpu_, n);
    ASSERT_NE(rig_->nccl, nullptr);
  }
  std::unique_ptr<NcclRig> rig_;
  const int world = world_size(), rank = world_rank();
};

// The NCCL sums: rank-dependent integer-valued floats give exactly predictable sums, for buckets
// started back to back (the reducer's pattern), a blocking sum and a broadcast.
TEST_F(GpuNccl, SumsAreExact) {
  auto& [mpi, be, nccl, host, buf, all] = *rig_;
  CommRequest r[3] = {nccl->start_allreduce_sum(all.subspan(0, 10)), nccl->start_allreduce_sum(all.subspan(10, 50000)),
                      nccl->start_allreduce_sum(all.subspan(50010))};
  for (CommRequest& q : r) nccl->wait(q);
  be->download(buf->data(), host);
  const double ranks_sum = world * (world + 1) / 2.0;
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < n; ++i)
    wrong += host[static_cast<std::size_t>(i)] != static_cast<float>(ranks_sum * static_cast<double>(i % 1013));
  EXPECT_EQ(wrong, 0) << "of " << n << " bucketed sums";
  nccl->allreduce_sum(all);  // again, blocking: now world * the sum
  be->download(buf->data(), host);
  wrong = 0;
  for (std::int64_t i = 0; i < n; ++i)
    wrong += host[static_cast<std::size_t>(i)] != static_cast<float>(world * ranks_sum * static_cast<double>(i % 1013));
  EXPECT_EQ(wrong, 0) << "of " << n << " blocking sums";
  std::vector<float> mine(static_cast<std::size_t>(n), static_cast<float>(rank + 7));
  be->upload(mine, buf->data());
  nccl->broadcast(all, 0);
  be->download(buf->data(), host);
  wrong = 0;
  for (float v : host) wrong += v != 7.0f;
  EXPECT_EQ(wrong, 0) << "of " << n << " broadcast elements";
  if (rank == 0) std::printf("agreement NCCL sums on %d rank(s): exact\n", world);
  EXPECT_TRUE(all_ranks(wrong == 0));
}

// Note [Shards] on NCCL (--shard-optimizer): a reduce-scatter leaves this rank's shard of an odd
// range (the last rank's longer) holding the exact sums, and an allgather of the shards, after
// each rank marks its own, gives every rank every rank's marked shard.
TEST_F(GpuNccl, ShardsAreExact) {
  auto& [mpi, be, nccl, host, buf, all] = *rig_;
  CommRequest r = nccl->start_reduce_scatter_sum(all);
  nccl->wait(r);
  be->download(buf->data(), host);
  const Shard mine = shard_of(n, rank, world);
  const double ranks_sum = world * (world + 1) / 2.0;
  std::int64_t wrong = 0;
  for (std::int64_t i = mine.begin; i < mine.end; ++i)
    wrong += host[static_cast<std::size_t>(i)] != static_cast<float>(ranks_sum * static_cast<double>(i % 1013));
  EXPECT_EQ(wrong, 0) << "of this rank's " << mine.size() << " reduce-scattered sums";
  for (std::int64_t i = mine.begin; i < mine.end; ++i) host[static_cast<std::size_t>(i)] = static_cast<float>(rank + 1);
  be->upload(host, buf->data());
  r = nccl->start_allgather_shards(all);
  nccl->wait(r);
  be->download(buf->data(), host);
  std::int64_t wrong_gathered = 0;
  for (int owner = 0; owner < world; ++owner) {
    const Shard s = shard_of(n, owner, world);
    for (std::int64_t i = s.begin; i < s.end; ++i)
      wrong_gathered += host[static_cast<std::size_t>(i)] != static_cast<float>(owner + 1);
  }
  EXPECT_EQ(wrong_gathered, 0) << "of " << n << " gathered elements";
  EXPECT_TRUE(all_ranks(wrong == 0 && wrong_gathered == 0));
}

// --exact-sums's buckets on NCCL: int64 sums and shards of integers written by the device's
// passes (rank-dependent values times 2^36) are exact, and so are the two counters summed after
// them; back in float the sums are the exactly predictable ones.
TEST_F(GpuNccl, IntegerSumsAreExact) {
  auto& [mpi, be, nccl, host, buf, all] = *rig_;
  if (world == 1)
    std::printf(
        "NOTE GpuNccl.IntegerSumsAreExact on 1 rank: NCCL's in-place sums change nothing there; this run "
        "checks the calls and the passes around them, not the sums between GPUs (that needs 2+ GPUs)\n");
  auto passes = be->make_fixed_point_passes(n, 1);
  const std::span<std::int64_t> q = passes->integers();
  const double scale = std::ldexp(1.0, 36), unscale = std::ldexp(1.0, -36);
  const double ranks_sum = world * (world + 1) / 2.0;
  const auto expected = [&](std::int64_t i) { return static_cast<float>(ranks_sum * static_cast<double>(i % 1013)); };
  for (const bool sharded : {false, true}) {
    be->upload(host, buf->data());  // (rank + 1) * (i % 1013)
    passes->zero_counters();
    passes->to_fixed(buf->data(), 0, n, scale, std::numeric_limits<float>::infinity(), true);
    passes->to_fixed(buf->data(), 0, 5, scale, 0.5f, false);  // elements 1-4 beyond: 4 a rank (and doubled)
    CommRequest r =
        sharded ? nccl->start_reduce_scatter_sum(q.subspan(0, n)) : nccl->start_allreduce_sum(q.subspan(0, n));
    CommRequest c = nccl->start_allreduce_sum(q.subspan(n));
    nccl->wait(r);
    nccl->wait(c);
    passes->from_fixed(0, buf->data(), n, unscale, 0);
    std::vector<std::uint32_t> top(1);
    const FixedPointCounts counts = passes->read(top);
    EXPECT_EQ(counts.out_of_range, 4 * world) << (sharded ? "sharded" : "whole");
    std::vector<float> got(static_cast<std::size_t>(n));
    be->download(buf->data(), got);
    const Shard mine = sharded ? shard_of(n, rank, world) : Shard{0, n};
    std::int64_t wrong = 0;
    for (std::int64_t i = mine.begin; i < mine.end; ++i)
      wrong += got[static_cast<std::size_t>(i)] != (i >= 1 && i <= 4 ? 2.0f : 1.0f) * expected(i);
    EXPECT_EQ(wrong, 0) << "of " << mine.size() << (sharded ? " reduce-scattered" : " summed") << " integers";
  }
  if (rank == 0) std::printf("agreement NCCL int64 sums on %d rank(s): exact\n", world);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// World-size invariance on the GPU: the same global batch on 1 rank and on all ranks gives the
// same parameters up to float summation order (the per-rank slices are summed by NCCL, or through
// the host when ranks share a GPU).
TEST_F(Gpu, TrajectoryDoesNotDependOnTheNumberOfRanks) {
  const int world = world_size();
  if (world == 1) GTEST_SKIP() << "needs mpirun with more than one rank";
  MPI_Comm first = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() == 0 ? 0 : MPI_UNDEFINED, 0, &first);
  std::vector<float> one;
  if (first != MPI_COMM_NULL) {
    one = train(first, options("cuda", 12 * world, 20));
    MPI_Comm_free(&first);
  }
  const std::vector<float> many = train(MPI_COMM_WORLD, options("cuda", 12 * world, 20));
  if (world_rank() == 0) expect_agree("1 rank vs " + std::to_string(world) + " ranks after 20 steps", many, one, 1e-4);
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// --exact-sums on the GPU (docs/reduction.md): the same parameters, bit for bit, whatever the
// buckets, the overlap, the sharding and the number of ranks (NCCL's int64 sums with a GPU each,
// sums through host memory with ranks sharing one); the default mode gives other bits (so the
// comparison can fail), and --cuda-graph and --conv-algos measured are refused with it.
TEST_F(Gpu, ExactSumsGiveTheSameBitsOnAnyNumberOfRanks) {
  Options o = options("cuda", 24, 12);
  o.exact_sums = true;
  o.exact_chunk = 4;          // 6 chunks: up to 6 ranks
  o.collective_timeout = 30;  // a rank that failed alone leaves the others' collectives waiting
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank(), 0, &self);
  std::vector<float> one;
  try {  // every rank on its own first: a failure here must not leave the others in a collective
    one = train(self, o);
    Options small = o;
    small.bucket_mb = 0.001;  // many buckets, tensors cut apart
    small.first_bucket_mb = 0.001;
    expect_bitwise("exact sums, 1 KB buckets against 4 MB", train(self, small), one);
    Options blocking = o;
    blocking.no_overlap = true;
    expect_bitwise("exact sums, --no-overlap against overlapped", train(self, blocking), one);
    Options plain = o;
    plain.exact_sums = false;
    const std::vector<float> other = train(self, plain);
    EXPECT_NE(std::memcmp(other.data(), one.data(), one.size() * sizeof(float)), 0)
        << "the default mode gave the exact mode's bits: the comparisons above could not fail";
    // ... and the exact mode trains the same model as the default mode, to rounding (as the ranks'
    // trajectories agree, Gpu.TrajectoryDoesNotDependOnTheNumberOfRanks): equal bits alone would
    // not catch sums that are wrong the same way on every rank.
    expect_agree("exact sums against the default mode, 12 steps", one, other, 1e-4);
    for (const bool graph : {true, false}) {
      Options refused = o;
      if (graph)
        refused.cuda_graph = true;
      else
        refused.conv_algos = "measured";
      auto c = make_mpi_communicator(self);
      try {
        Trainer t(refused, *c);
        t.run();
        ADD_FAILURE() << (graph ? "--cuda-graph" : "--conv-algos measured") << " with --exact-sums was not refused";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ExitCode::kUsage) << e.what();
      }
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << world_rank() << ": " << e.what();
  }
  MPI_Comm_free(&self);
  if (!all_ranks(!::testing::Test::HasFailure())) return;  // not into the world's runs with a rank failed
  if (world_size() > 1) {
    expect_bitwise("exact sums, 1 rank against " + std::to_string(world_size()), train(MPI_COMM_WORLD, o), one);
    Options sharded = o;
    sharded.shard_optimizer = Options::Sharding::kOn;
    expect_bitwise("exact sums, sharded on " + std::to_string(world_size()) + " ranks", train(MPI_COMM_WORLD, sharded),
                   one);
  }
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

// Note [Choosing cuDNN algorithms] (src/backend/cuda/conv.cpp): the algorithms rank 0 timed train
// the same model as the heuristics' to rounding (other algorithms sum in other orders), on a model
// with asymmetric 'same' padding too (4x4 and 2x2: the padded path). The choice is rank 0's on
// every rank (rank 0 builds with it, the others take it when training starts), so the replicas
// stay bitwise equal (the replica check runs every step and stops the run otherwise), with ranks
// on one GPU or on several.
TEST_F(Gpu, MeasuredConvolutionAlgorithmsTrainTheSameModel) {
  MPI_Comm self = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank(), 0, &self);
  // bf16 too: its measured algorithms, and its copies of an asymmetrically padded input.
  for (const char* precision : {"fp32", "bf16"})
  for (const char* model : {"", "conv:4x4:4:same,relu,maxpool:2,conv:2x2:8:same,relu,flatten,fc:16,relu,fc:10"}) {
    SCOPED_TRACE(std::string(precision) + ", " + (*model ? model : "the tests' model"));
    Options o = options("cuda", 32, 2);
    o.precision = precision;
    if (*model) o.model = model;
    const std::vector<float> heuristic = train(self, o);
    o.conv_algos = "measured";
    auto c = make_mpi_communicator(self);
    Trainer t(o, *c);
    t.run();
    const std::string layers = t.layer_descriptions();
    EXPECT_NE(layers.find("(measured)"), std::string::npos) << layers;
    if (std::string(precision) == "bf16") {  // the bf16 kernels ran, not the fp32 ones under a bf16 name
      EXPECT_NE(layers.find(", bf16 (y, dx and dW widened to float)"), std::string::npos) << layers;
    }
    if (*model) {
      EXPECT_NE(layers.find("asymmetric 'same'"), std::string::npos) << layers;
    }
    // bf16: other algorithms round their bf16 products' sums otherwise (bf16's 8 bits, not float's 24).
    expect_agree("2 steps, measured against heuristic algorithms", t.params_to_host(), heuristic,
                 std::string(precision) == "bf16" ? 1e-2 : 1e-5);
  }
  MPI_Comm_free(&self);
  if (world_size() > 1) {
    Options w = options("cuda", 12 * world_size(), 10);
    w.conv_algos = "measured";
    w.check_replicas_every = 1;
    auto c = make_mpi_communicator(MPI_COMM_WORLD);
    Trainer t(w, *c);
    t.run();
    const std::string layers = t.layer_descriptions();
    EXPECT_NE(layers.find("(measured)"), std::string::npos) << "rank " << world_rank() << ": " << layers;
    const std::vector<float> p = t.params_to_host();
    EXPECT_EQ(std::count_if(p.begin(), p.end(), [](float v) { return !std::isfinite(v); }), 0);  // no ASSERT: a
    // rank that returned here would leave the others in the broadcast below
    std::vector<float> root = p;
    MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
    expect_bitwise("measured algorithms, every rank against rank 0", p, root);
  }
  EXPECT_TRUE(all_ranks(!::testing::Test::HasFailure()));
}

}  // namespace
}  // namespace mnist_mpi
