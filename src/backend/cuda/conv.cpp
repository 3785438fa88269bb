// 2-D convolution on cuDNN: forward, backward-data and backward-filter, with the algorithm of each
// and one workspace chosen once at model build (Note [Choosing cuDNN algorithms]: cuDNN's
// heuristics, the first deterministic one). Bias: cudnnAddTensor forward, our fixed-order kernel backward. TensorFlow's
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
// skipped. The choice is printed per layer in the banner (describe()). Ranks on different GPU
// models could still choose differently; the replica check (--check-replicas-every) would stop
// such a run, naming the ranks.
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

class Conv final : public LayerKernel {
 public:
  Conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) : c_(c), l_(l), b_(b) {
    padded_ = l.pad_top != l.pad_bottom || l.pad_left != l.pad_right;
    ph_ = l.in.h + (padded_ ? l.pad_top + l.pad_bottom : 0);
    pw_ = l.in.w + (padded_ ? l.pad_left + l.pad_right : 0);
    if (padded_) {
      xpad_ = DeviceArray<float>(static_cast<std::int64_t>(b.batch) * l.in.c * ph_ * pw_);
      if (training && b.dx) dxpad_ = DeviceArray<float>(xpad_.size());
    }
    x_.set(b.batch, l.in.c, ph_, pw_);              // (N, C, H, W) as the convolution sees it
    y_.set(b.batch, l.channels, l.out.h, l.out.w);  // (N, O, OH, OW)
    bias_.set(1, l.channels, 1, 1);                 // (1, O, 1, 1)
    CUDNN_CHECK(cudnnCreateFilterDescriptor(&w_));
    CUDNN_CHECK(cudnnSetFilter4dDescriptor(w_, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, l.channels, l.in.c, l.kernel_h,
                                           l.kernel_w));  // (O, I, KH, KW)
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv_));
    const int pad_h = padded_ ? 0 : l.pad_top, pad_w = padded_ ? 0 : l.pad_left;
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(conv_, pad_h, pad_w, l.stride, l.stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                                CUDNN_DATA_FLOAT));
    // fp32: FMA kernels only, no TF32 tensor cores; tf32: cuDNN's default math, which on sm_80 and
    // later lets float convolutions use TF32 tensor cores.
    CUDNN_CHECK(cudnnSetConvolutionMathType(conv_, c.tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH));
    int n = 0, oc = 0, oh = 0, ow = 0;
    CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(conv_, x_.d, w_, &n, &oc, &oh, &ow));
    MNIST_CHECK(n == b.batch && oc == l.channels && oh == l.out.h && ow == l.out.w, ExitCode::kRuntime,
                "cuDNN's output shape for '" + l.text + "' differs from the spec's");
    bias_ptr_ = b.w + static_cast<std::int64_t>(l.channels) * l.in.c * l.kernel_h * l.kernel_w;

    std::size_t ws = 0;
    {
      std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(kMaxAlgos);
      int got = 0;
      CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(c.cudnn, x_.d, w_, conv_, y_.d, kMaxAlgos, &got, perf.data()));
      const auto& p = pick(perf, got, kWorkspaceCap, "forward");
      fwd_ = p.algo;
      ws = std::max(ws, p.memory);
      desc_ = std::string("cudnn conv fwd ") + fwd_name(fwd_);
    }
    if (training && b.dx) {
      std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(kMaxAlgos);
      int got = 0;
      CUDNN_CHECK(
          cudnnGetConvolutionBackwardDataAlgorithm_v7(c.cudnn, w_, y_.d, conv_, x_.d, kMaxAlgos, &got, perf.data()));
      const auto& p = pick(perf, got, kWorkspaceCap, "backward-data");
      bwd_data_ = p.algo;
      ws = std::max(ws, p.memory);
      desc_ += std::string(", bwd-data ") + bwd_data_name(bwd_data_);
    }
    if (training) {
      std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(kMaxAlgos);
      int got = 0;
      CUDNN_CHECK(
          cudnnGetConvolutionBackwardFilterAlgorithm_v7(c.cudnn, x_.d, y_.d, conv_, w_, kMaxAlgos, &got, perf.data()));
      const auto& p = pick(perf, got, kWorkspaceCap, "backward-filter");
      bwd_filter_ = p.algo;
      ws = std::max(ws, p.memory);
      desc_ += std::string(", bwd-filter ") + bwd_filter_name(bwd_filter_);
    }
    workspace_ = DeviceArray<std::uint8_t>(static_cast<std::int64_t>(ws));
    if (padded_) desc_ += " (input padded into a buffer: asymmetric 'same')";
    desc_ += (c.tf32 ? ", tf32" : ", fp32");
  }
  ~Conv() override {
    cudnnDestroyConvolutionDescriptor(conv_);
    cudnnDestroyFilterDescriptor(w_);
  }

  void forward(const StepContext&) override {
    const float one = 1.0f, zero = 0.0f;
    const float* xin = b_.x;
    if (padded_) {
      launch_pad(c_.stream, b_.x, xpad_.get(), b_.batch * l_.in.c, l_.in.h, l_.in.w, l_.pad_top, l_.pad_left, ph_, pw_);
      xin = xpad_.get();
    }
    CUDNN_CHECK(cudnnConvolutionForward(c_.cudnn, &one, x_.d, xin, w_, b_.w, conv_, fwd_, workspace_.get(),
                                        static_cast<std::size_t>(workspace_.size()), &zero, y_.d, b_.y));
    CUDNN_CHECK(cudnnAddTensor(c_.cudnn, &one, bias_.d, bias_ptr_, &one, y_.d, b_.y));
  }

  void backward(const StepContext&) override {
    const float one = 1.0f, zero = 0.0f;
    const float* xin = padded_ ? xpad_.get() : b_.x;  // the padded input of this step's forward
    if (b_.dx) {
      float* dxout = padded_ ? dxpad_.get() : b_.dx;
      CUDNN_CHECK(cudnnConvolutionBackwardData(c_.cudnn, &one, w_, b_.w, y_.d, b_.dy, conv_, bwd_data_,
                                               workspace_.get(), static_cast<std::size_t>(workspace_.size()), &zero,
                                               x_.d, dxout));
      if (padded_)
        launch_crop(c_.stream, dxpad_.get(), b_.dx, b_.batch * l_.in.c, l_.in.h, l_.in.w, l_.pad_top, l_.pad_left, ph_,
                    pw_);
    }
    CUDNN_CHECK(cudnnConvolutionBackwardFilter(c_.cudnn, &one, x_.d, xin, y_.d, b_.dy, conv_, bwd_filter_,
                                               workspace_.get(), static_cast<std::size_t>(workspace_.size()), &zero, w_,
                                               b_.dw));
    float* dbias = b_.dw + (bias_ptr_ - b_.w);
    launch_bias_grad(c_.stream, b_.dy, b_.batch, l_.channels, static_cast<std::int64_t>(l_.out.h) * l_.out.w, dbias);
  }
  std::string describe() const override { return desc_; }

 private:
  Context& c_;
  LayerSpec l_;
  LayerBuffers b_;
  bool padded_ = false;
  int ph_ = 0, pw_ = 0;
  DeviceArray<float> xpad_, dxpad_;  // (N, C, PH, PW) when padded_
  TensorDesc x_, y_, bias_;
  cudnnFilterDescriptor_t w_ = nullptr;
  cudnnConvolutionDescriptor_t conv_ = nullptr;
  cudnnConvolutionFwdAlgo_t fwd_{};
  cudnnConvolutionBwdDataAlgo_t bwd_data_{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter_{};
  DeviceArray<std::uint8_t> workspace_;
  const float* bias_ptr_ = nullptr;
  std::string desc_;
};

}  // namespace

std::unique_ptr<LayerKernel> make_conv(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Conv>(c, l, b, training);
}

}  // namespace mnist_mpi::cuda
