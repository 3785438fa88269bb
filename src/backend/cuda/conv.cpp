// 2-D convolution on cuDNN: forward, backward-data and backward-filter, with the algorithm of each
// and one workspace chosen once at model build (Note [Choosing cuDNN algorithms]: cuDNN's
// heuristics, the first deterministic one, or with --conv-algos measured the fastest deterministic
// one rank 0 timed). Bias: cudnnAddTensor forward, our fixed-order kernel backward. TensorFlow's
// `same` padding can be asymmetric (the extra row / column at the end), which cuDNN can't express:
// then the input is zero-padded into a buffer made at build and the convolution is `valid`.
#include <algorithm>
#include <vector>

#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi::cuda {
namespace {

const char* fwd_name(cudnnConvolutionFwdAlgo_t a) {
  switch (a) {
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM:
      return "implicit_gemm";
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM:
      return "implicit_precomp_gemm";
    case CUDNN_CONVOLUTION_FWD_ALGO_GEMM:
      return "gemm";
    case CUDNN_CONVOLUTION_FWD_ALGO_DIRECT:
      return "direct";
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT:
      return "fft";
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING:
      return "fft_tiling";
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD:
      return "winograd";
    case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED:
      return "winograd_nonfused";
    default:
      return "other";
  }
}
const char* bwd_data_name(cudnnConvolutionBwdDataAlgo_t a) {
  switch (a) {
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_0:
      return "algo0";
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_1:
      return "algo1";
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT:
      return "fft";
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING:
      return "fft_tiling";
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD:
      return "winograd";
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED:
      return "winograd_nonfused";
    default:
      return "other";
  }
}
const char* bwd_filter_name(cudnnConvolutionBwdFilterAlgo_t a) {
  switch (a) {
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0:
      return "algo0";
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1:
      return "algo1";
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT:
      return "fft";
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3:
      return "algo3";
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED:
      return "winograd_nonfused";
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING:
      return "fft_tiling";
    default:
      return "other";
  }
}

// Note [Choosing cuDNN algorithms]
// cudnnFind* times every algorithm on this GPU and sorts by the time it measured, so when two are
// close the choice can change from run to run and from rank to rank, and with it the bits (each
// algorithm sums in its own order). cudnnGet*_v7 asks cuDNN's heuristics instead: for one GPU
// model, cuDNN version, shape and math type it answers the same list every time, on every rank.
// Of that list (sorted by expected speed) we take the first that is supported, deterministic
// and fits the workspace cap; runs must repeat bit for bit, so a faster non-deterministic one is
// skipped. This is --conv-algos heuristic, the default: every run, and a resume, repeat the bits.
// The heuristics can be far off. On an H200 with cuDNN 9.19 (bench/cudnn_algos.cpp, docs/gpu.md)
// their tf32 picks for lenet took 1.14 ms per step where the fastest deterministic ones took
// 0.43 ms, and lenet ran slower in tf32 than in fp32. --conv-algos measured: rank 0 times each
// training convolution's algorithms (cudnnFind*) in its set-up, local work, and rebuilds its
// training convolutions with the fastest deterministic one within the cap; once training starts
// (after the ranks agreed that set-up went well everywhere) it broadcasts its choice and the other
// ranks rebuild theirs the same way (Backend::time_convolutions and use_measured_convolutions,
// Rig::connect), so the ranks still hold the same bits. Every
// convolution is first built with the heuristics' choice; a training one then registers its
// rebuild in Context::retune. A later run, or a resume, may measure differently and round differently. A rank whose
// GPU cannot run rank 0's choice stops, naming it. The choice is printed per layer in the banner
// (describe()). With heuristics, ranks on different GPU models could still choose differently; the
// replica check (--check-replicas-every) would stop such a run, naming the ranks.
template <typename Perf>
const Perf& pick(const std::vector<Perf>& perf, int returned, std::size_t cap, const char* what) {
  for (int i = 0; i < returned; ++i) {
    const Perf& p = perf[static_cast<std::size_t>(i)];
    if (p.status == CUDNN_STATUS_SUCCESS && p.determinism == CUDNN_DETERMINISTIC && p.memory <= cap) return p;
  }
  throw_error(ExitCode::kRuntime, std::string("cuDNN offers no deterministic ") + what +
                                      " algorithm for this layer within the workspace cap");
}

constexpr std::size_t kWorkspaceCap = std::size_t{256} << 20;  // per layer and direction
constexpr int kMaxAlgos = 16;

// Note [bf16 on the GPU] in cuda_backend.cpp: the first layer's convolution stays float.
bool conv_in_bf16(const Context& c, bool first_layer) { return c.bf16 && !first_layer; }

// A convolution as cuDNN sees it: x (N, C, PH, PW) with the asymmetric 'same' padding made
// explicit (padded: PH, PW include it and cuDNN pads nothing), w (O, I, KH, KW), y (N, O, OH, OW);
// x, w and y in float, or in bf16 (Note [bf16 on the GPU] in cuda_backend.cpp: cuDNN's
// PSEUDO_BFLOAT16 configuration, float accumulation).
struct ConvDescs {
  bool padded = false, bf16 = false;
  int ph = 0, pw = 0;
  TensorDesc x, y, bias;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;

  ConvDescs(const Context& c, const LayerSpec& l, int batch, bool in_bf16) : bf16(in_bf16) {
    padded = l.pad_top != l.pad_bottom || l.pad_left != l.pad_right;
    ph = l.in.h + (padded ? l.pad_top + l.pad_bottom : 0);
    pw = l.in.w + (padded ? l.pad_left + l.pad_right : 0);
    const cudnnDataType_t type = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
    x.set(batch, l.in.c, ph, pw, type);
    y.set(batch, l.channels, l.out.h, l.out.w, type);
    bias.set(1, l.channels, 1, 1);
    CUDNN_CHECK(cudnnCreateFilterDescriptor(&w));
    CUDNN_CHECK(cudnnSetFilter4dDescriptor(w, type, CUDNN_TENSOR_NCHW, l.channels, l.in.c, l.kernel_h, l.kernel_w));
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
    const int pad_h = padded ? 0 : l.pad_top, pad_w = padded ? 0 : l.pad_left;
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(conv, pad_h, pad_w, l.stride, l.stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                                CUDNN_DATA_FLOAT));
    // fp32: FMA kernels only, no TF32 tensor cores; tf32: cuDNN's default math, which on sm_80 and
    // later lets float convolutions use TF32 tensor cores; bf16: tensor cores.
    CUDNN_CHECK(cudnnSetConvolutionMathType(conv, math(c, bf16)));
    int n = 0, oc = 0, oh = 0, ow = 0;
    CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(conv, x.d, w, &n, &oc, &oh, &ow));
    MNIST_CHECK(n == batch && oc == l.channels && oh == l.out.h && ow == l.out.w, ExitCode::kRuntime,
                "cuDNN's output shape for '" + l.text + "' differs from the spec's");
  }
  ~ConvDescs() {
    cudnnDestroyConvolutionDescriptor(conv);
    cudnnDestroyFilterDescriptor(w);
  }
  ConvDescs(const ConvDescs&) = delete;
  ConvDescs& operator=(const ConvDescs&) = delete;
  static cudnnMathType_t math(const Context& c, bool bf16) {
    return bf16 ? CUDNN_TENSOR_OP_MATH : c.tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
  }
};

// Of cudnnFind's results (sorted by measured time), the first that ran, is deterministic, fits
// the cap and used the descriptor's math (the rule keeps TF32 out of an fp32 run; bf16 inputs are
// bf16 arithmetic whatever math cuDNN reports); -1 if none did.
template <typename Perf>
int fastest(const std::vector<Perf>& perf, int returned, cudnnMathType_t math, double& ms) {
  for (int i = 0; i < returned; ++i) {
    const Perf& p = perf[static_cast<std::size_t>(i)];
    const bool same_math = p.mathType == math || math == CUDNN_TENSOR_OP_MATH;
    if (p.status == CUDNN_STATUS_SUCCESS && p.determinism == CUDNN_DETERMINISTIC && p.memory <= kWorkspaceCap &&
        same_math) {
      ms = static_cast<double>(p.time);
      return static_cast<int>(p.algo);
    }
  }
  return -1;
}

// The workspace that `what` (algorithm algo) of layer l needs, or a stop that names it when cuDNN
// cannot run it here (a choice rank 0 measured on another GPU model).
std::size_t measured_workspace(cudnnStatus_t status, std::size_t bytes, const LayerSpec& l, const char* what,
                               const std::string& algo) {
  MNIST_CHECK(status == CUDNN_STATUS_SUCCESS, ExitCode::kRuntime,
              "cuDNN cannot run the " + std::string(what) + " algorithm " + algo + " of layer '" + l.text +
                  "' on this rank's GPU (" + cudnnGetErrorString(status) +
                  "); rank 0 measured it on its own GPU. Run with --conv-algos heuristic, or with the same GPU "
                  "model on every rank");
  MNIST_CHECK(bytes <= kWorkspaceCap, ExitCode::kRuntime,
              "the " + std::string(what) + " algorithm " + algo + " of layer '" + l.text +
                  "' needs more workspace here than the cap; run with --conv-algos heuristic");
  return bytes;
}

class Conv final : public LayerKernel {
 public:
  Conv(Context& c, const LayerSpec& l, int index, const LayerBuffers& b, bool training)
      : c_(c), l_(l), b_(b), d_(c, l, b.batch, conv_in_bf16(c, index == 0)) {
    padded_ = d_.padded;
    ph_ = d_.ph;
    pw_ = d_.pw;
    const std::int64_t nx = static_cast<std::int64_t>(b.batch) * l.in.c * ph_ * pw_,
                       ny = static_cast<std::int64_t>(b.batch) * l.channels * l.out.h * l.out.w,
                       nw = static_cast<std::int64_t>(l.channels) * l.in.c * l.kernel_h * l.kernel_w;
    if (padded_) {
      xpad_ = DeviceArray<float>(nx);
      if (training && b.dx) dxpad_ = DeviceArray<float>(xpad_.size());
    }
    if (d_.bf16) {  // Note [bf16 on the GPU] in cuda_backend.cpp: the copies, made once
      x16_ = DeviceArray<std::uint16_t>(nx);
      w16_ = DeviceArray<std::uint16_t>(nw);
      y16_ = DeviceArray<std::uint16_t>(ny);
      if (training) {
        dy16_ = DeviceArray<std::uint16_t>(ny);
        dw16_ = DeviceArray<std::uint16_t>(nw);
        if (b.dx) dx16_ = DeviceArray<std::uint16_t>(nx);
      }
    }
    bias_ptr_ = b.w + static_cast<std::int64_t>(l.channels) * l.in.c * l.kernel_h * l.kernel_w;
    use_heuristics(training);
    if (training) {  // rank 0's timed choice replaces them (Backend::use_measured_convolutions)
      index_ = index;
      c.retune[index] = [this](const MeasuredConv& m) { use_measured(m); };
    }
  }
  ~Conv() override {
    if (index_ >= 0) c_.retune.erase(index_);
  }
  Conv(const Conv&) = delete;
  Conv& operator=(const Conv&) = delete;
  void forward(const StepContext&) override {
    const float one = 1.0f, zero = 0.0f;
    const float* xin = b_.x;
    if (padded_) {
      launch_pad(c_.stream, b_.x, xpad_.get(), b_.batch * l_.in.c, l_.in.h, l_.in.w, l_.pad_top, l_.pad_left, ph_, pw_);
      xin = xpad_.get();
    }
    const void *x = xin, *w = b_.w;
    void* y = b_.y;
    if (d_.bf16) {  // Note [bf16 on the GPU] in cuda_backend.cpp: bf16 copies in, y widened after
      launch_to_bf16(c_.stream, xin, x16_.get(), x16_.size());
      launch_to_bf16(c_.stream, b_.w, w16_.get(), w16_.size());
      x = x16_.get(), w = w16_.get(), y = y16_.get();
    }
    CUDNN_CHECK(cudnnConvolutionForward(c_.cudnn, &one, d_.x.d, x, d_.w, w, d_.conv, fwd_, workspace_.get(),
                                        static_cast<std::size_t>(workspace_.size()), &zero, d_.y.d, y));
    if (d_.bf16) {
      launch_from_bf16(c_.stream, y16_.get(), b_.y, y16_.size());
      launch_bias_add(c_.stream, b_.y, bias_ptr_, b_.batch, l_.channels, static_cast<std::int64_t>(l_.out.h) * l_.out.w);
    } else {
      CUDNN_CHECK(cudnnAddTensor(c_.cudnn, &one, d_.bias.d, bias_ptr_, &one, d_.y.d, b_.y));
    }
  }

  void backward(const StepContext&) override {
    const float one = 1.0f, zero = 0.0f;
    const void *x = padded_ ? xpad_.get() : b_.x, *w = b_.w, *dy = b_.dy;  // x: this step's forward's input
    void *dx = padded_ ? dxpad_.get() : b_.dx, *dw = b_.dw;
    if (d_.bf16) {  // Note [bf16 on the GPU]: x16_ and w16_ are this step's forward's; dx, dW widened after
      launch_to_bf16(c_.stream, b_.dy, dy16_.get(), dy16_.size());
      x = x16_.get(), w = w16_.get(), dy = dy16_.get(), dx = dx16_.get(), dw = dw16_.get();
    }
    if (b_.dx) {
      CUDNN_CHECK(cudnnConvolutionBackwardData(c_.cudnn, &one, d_.w, w, d_.y.d, dy, d_.conv, bwd_data_,
                                               workspace_.get(), static_cast<std::size_t>(workspace_.size()), &zero,
                                               d_.x.d, dx));
      if (d_.bf16) launch_from_bf16(c_.stream, dx16_.get(), padded_ ? dxpad_.get() : b_.dx, dx16_.size());
      if (padded_)
        launch_crop(c_.stream, dxpad_.get(), b_.dx, b_.batch * l_.in.c, l_.in.h, l_.in.w, l_.pad_top, l_.pad_left, ph_,
                    pw_);
    }
    CUDNN_CHECK(cudnnConvolutionBackwardFilter(c_.cudnn, &one, d_.x.d, x, d_.y.d, dy, d_.conv, bwd_filter_,
                                               workspace_.get(), static_cast<std::size_t>(workspace_.size()), &zero,
                                               d_.w, dw));
    if (d_.bf16) launch_from_bf16(c_.stream, dw16_.get(), b_.dw, dw16_.size());
    float* dbias = b_.dw + (bias_ptr_ - b_.w);
    launch_bias_grad(c_.stream, b_.dy, b_.batch, l_.channels, static_cast<std::int64_t>(l_.out.h) * l_.out.w, dbias);
  }
  std::string describe() const override {
    return desc_ + (padded_ ? " (input padded into a buffer: asymmetric 'same')" : "") +
           (d_.bf16 ? ", bf16 (y, dx and dW widened to float)" : c_.tf32 ? ", tf32" : ", fp32");
  }

 private:
  // --conv-algos heuristic: the first deterministic algorithm of cuDNN's heuristics per direction.
  void use_heuristics(bool training) {
    std::size_t ws = 0;
    {
      std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(kMaxAlgos);
      int got = 0;
      CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(c_.cudnn, d_.x.d, d_.w, d_.conv, d_.y.d, kMaxAlgos, &got,
                                                         perf.data()));
      const auto& p = pick(perf, got, kWorkspaceCap, "forward");
      fwd_ = p.algo;
      ws = std::max(ws, p.memory);
      desc_ = std::string("cudnn conv fwd ") + fwd_name(fwd_);
    }
    if (training && b_.dx) {
      std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(kMaxAlgos);
      int got = 0;
      CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(c_.cudnn, d_.w, d_.y.d, d_.conv, d_.x.d, kMaxAlgos, &got,
                                                              perf.data()));
      const auto& p = pick(perf, got, kWorkspaceCap, "backward-data");
      bwd_data_ = p.algo;
      ws = std::max(ws, p.memory);
      desc_ += std::string(", bwd-data ") + bwd_data_name(bwd_data_);
    }
    if (training) {
      std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(kMaxAlgos);
      int got = 0;
      CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(c_.cudnn, d_.x.d, d_.y.d, d_.conv, d_.w, kMaxAlgos,
                                                                &got, perf.data()));
      const auto& p = pick(perf, got, kWorkspaceCap, "backward-filter");
      bwd_filter_ = p.algo;
      ws = std::max(ws, p.memory);
      desc_ += std::string(", bwd-filter ") + bwd_filter_name(bwd_filter_);
    }
    workspace_ = DeviceArray<std::uint8_t>(static_cast<std::int64_t>(ws));
  }

  // --conv-algos measured: rank 0's choice (a training model: every direction it needs), before
  // the first step; the workspace is made again.
  void use_measured(const MeasuredConv& m) {
    MNIST_CHECK(
        m.fwd >= 0 && m.bwd_filter >= 0 && (!b_.dx || m.bwd_data >= 0), ExitCode::kRuntime,
        "--conv-algos measured: no deterministic algorithm was measured for a direction of layer '" + l_.text + "'");
    std::size_t ws = 0, bytes = 0;
    fwd_ = static_cast<cudnnConvolutionFwdAlgo_t>(m.fwd);
    // Each size is asked for first, then read: as one call's arguments, `bytes` could be read
    // before the call that writes it (the first GPU run did, and ran with too small a workspace).
    cudnnStatus_t st = cudnnGetConvolutionForwardWorkspaceSize(c_.cudnn, d_.x.d, d_.w, d_.conv, d_.y.d, fwd_, &bytes);
    ws = std::max(ws, measured_workspace(st, bytes, l_, "forward", fwd_name(fwd_)));
    desc_ = std::string("cudnn conv fwd ") + fwd_name(fwd_);
    if (b_.dx) {
      bwd_data_ = static_cast<cudnnConvolutionBwdDataAlgo_t>(m.bwd_data);
      st = cudnnGetConvolutionBackwardDataWorkspaceSize(c_.cudnn, d_.w, d_.y.d, d_.conv, d_.x.d, bwd_data_, &bytes);
      ws = std::max(ws, measured_workspace(st, bytes, l_, "backward-data", bwd_data_name(bwd_data_)));
      desc_ += std::string(", bwd-data ") + bwd_data_name(bwd_data_);
    }
    bwd_filter_ = static_cast<cudnnConvolutionBwdFilterAlgo_t>(m.bwd_filter);
    st = cudnnGetConvolutionBackwardFilterWorkspaceSize(c_.cudnn, d_.x.d, d_.y.d, d_.conv, d_.w, bwd_filter_, &bytes);
    ws = std::max(ws, measured_workspace(st, bytes, l_, "backward-filter", bwd_filter_name(bwd_filter_)));
    desc_ += std::string(", bwd-filter ") + bwd_filter_name(bwd_filter_) + " (measured)";
    workspace_ = DeviceArray<std::uint8_t>(static_cast<std::int64_t>(ws));
  }

  Context& c_;
  LayerSpec l_;
  LayerBuffers b_;
  ConvDescs d_;
  bool padded_ = false;
  int ph_ = 0, pw_ = 0;
  DeviceArray<float> xpad_, dxpad_;  // (N, C, PH, PW) when padded_
  DeviceArray<std::uint16_t> x16_, w16_, y16_, dy16_, dw16_, dx16_;  // bf16 copies (Note [bf16 on the GPU])
  cudnnConvolutionFwdAlgo_t fwd_{};
  cudnnConvolutionBwdDataAlgo_t bwd_data_{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter_{};
  DeviceArray<std::uint8_t> workspace_;
  const float* bias_ptr_ = nullptr;
  std::string desc_;
  int index_ = -1;  // a training convolution's layer index (its entry in Context::retune)
};

}  // namespace

std::unique_ptr<LayerKernel> make_conv(Context& c, const LayerSpec& l, int index, const LayerBuffers& b,
                                       bool training) {
  return std::make_unique<Conv>(c, l, index, b, training);
}

MeasuredConv measure_conv(Context& c, const LayerSpec& l, int batch, bool needs_dx, double ms[3]) {
  const ConvDescs d(c, l, batch, conv_in_bf16(c, /*first_layer=*/!needs_dx));  // only the first layer needs no dx
  const cudnnMathType_t math = ConvDescs::math(c, d.bf16);
  MeasuredConv m;
  ms[0] = ms[1] = ms[2] = 0.0;
  int got = 0;
  {
    std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(kMaxAlgos);
    CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithm(c.cudnn, d.x.d, d.w, d.conv, d.y.d, kMaxAlgos, &got, perf.data()));
    m.fwd = fastest(perf, got, math, ms[0]);
  }
  if (needs_dx) {
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(kMaxAlgos);
    CUDNN_CHECK(
        cudnnFindConvolutionBackwardDataAlgorithm(c.cudnn, d.w, d.y.d, d.conv, d.x.d, kMaxAlgos, &got, perf.data()));
    m.bwd_data = fastest(perf, got, math, ms[1]);
  }
  {
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(kMaxAlgos);
    CUDNN_CHECK(
        cudnnFindConvolutionBackwardFilterAlgorithm(c.cudnn, d.x.d, d.y.d, d.conv, d.w, kMaxAlgos, &got, perf.data()));
    m.bwd_filter = fastest(perf, got, math, ms[2]);
  }
  return m;
}

}  // namespace mnist_mpi::cuda
