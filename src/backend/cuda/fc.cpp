// Fully connected layer on cuBLAS: y = x W^T + b with W (O, I) row-major, the input (C, H, W) read
// as C*H*W values. cuBLAS is column-major, so each row-major product is written as its transpose
// (Note [Row-major products in cuBLAS]). Bias: our kernels (addition, fixed-order sum).
#include "src/backend/cuda/cuda_backend.hpp"

namespace mnist_mpi::cuda {
namespace {

// Note [Row-major products in cuBLAS]
// A row-major (R, C) matrix is a column-major (C, R) one. So with X (N, I), W (O, I), Y (N, O):
//   Y  = X W^T   is  Y'(O,N)  = W'^T (O,I) X'(I,N)      gemm(T, N, m=O, n=N, k=I, W, ldw=I, X, ldx=I, Y, ldy=O)
//   dX = dY W    is  dX'(I,N) = W'(I,O) dY'(O,N)        gemm(N, N, m=I, n=N, k=O, W, I, dY, O, dX, I)
//   dW = dY^T X  is  dW'(I,O) = X'(I,N) dY'^T (N,O)     gemm(N, T, m=I, n=O, k=N, X, I, dY, O, dW, I)
// where M' is M's memory read column-major. beta = 0: gradients are overwritten, not accumulated.
class Fc final : public LayerKernel {
 public:
  Fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) : c_(c), b_(b), out_(l.channels) {
    in_ = static_cast<int>(l.in.size());
    bias_ = b.w + static_cast<std::int64_t>(out_) * in_;
    desc_ = std::string("cublas sgemm fc, ") + (c.tf32 ? "tf32" : "fp32");
    if (c.bf16) {  // Note [bf16 on the GPU] in src/backend/cuda/cuda_backend.cpp
      desc_ = "cublas gemm fc on bf16 copies, float outputs";
      x16_ = DeviceArray<std::uint16_t>(static_cast<std::int64_t>(b.batch) * in_);
      w16_ = DeviceArray<std::uint16_t>(static_cast<std::int64_t>(out_) * in_);
      if (training) dy16_ = DeviceArray<std::uint16_t>(static_cast<std::int64_t>(b.batch) * out_);
    }
  }
  void forward(const StepContext&) override {
    const float one = 1.0f, zero = 0.0f;
    if (c_.bf16) {
      launch_to_bf16(c_.stream, b_.x, x16_.get(), x16_.size());
      launch_to_bf16(c_.stream, b_.w, w16_.get(), w16_.size());
      gemm_bf16(CUBLAS_OP_T, CUBLAS_OP_N, out_, b_.batch, in_, w16_.get(), in_, x16_.get(), in_, b_.y, out_);
    } else {
      CUBLAS_CHECK(cublasSgemm(c_.cublas, CUBLAS_OP_T, CUBLAS_OP_N, out_, b_.batch, in_, &one, b_.w, in_, b_.x, in_,
                               &zero, b_.y, out_));  // (N, O)
    }
    launch_bias_add(c_.stream, b_.y, bias_, b_.batch, out_, 1);
  }
  void backward(const StepContext&) override {
    const float one = 1.0f, zero = 0.0f;
    if (c_.bf16) {  // w16_ and x16_ are this step's forward's
      launch_to_bf16(c_.stream, b_.dy, dy16_.get(), dy16_.size());
      if (b_.dx) gemm_bf16(CUBLAS_OP_N, CUBLAS_OP_N, in_, b_.batch, out_, w16_.get(), in_, dy16_.get(), out_, b_.dx, in_);
      gemm_bf16(CUBLAS_OP_N, CUBLAS_OP_T, in_, out_, b_.batch, x16_.get(), in_, dy16_.get(), out_, b_.dw, in_);
    } else {
      if (b_.dx)
        CUBLAS_CHECK(cublasSgemm(c_.cublas, CUBLAS_OP_N, CUBLAS_OP_N, in_, b_.batch, out_, &one, b_.w, in_, b_.dy,
                                 out_, &zero, b_.dx, in_));  // (N, I)
      CUBLAS_CHECK(cublasSgemm(c_.cublas, CUBLAS_OP_N, CUBLAS_OP_T, in_, out_, b_.batch, &one, b_.x, in_, b_.dy, out_,
                               &zero, b_.dw, in_));  // (O, I)
    }
    launch_bias_grad(c_.stream, b_.dy, b_.batch, out_, 1, b_.dw + (bias_ - b_.w));  // (O)
  }
  std::string describe() const override { return desc_; }

 private:
  // C (float, column-major m x n) = op(A) op(B), A and B bf16: the same products as the sgemm
  // calls (Note [Row-major products in cuBLAS]), accumulated in float.
  void gemm_bf16(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const std::uint16_t* a, int lda,
                 const std::uint16_t* b, int ldb, float* out, int ldc) {
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK(cublasGemmEx(c_.cublas, ta, tb, m, n, k, &one, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &zero, out,
                              CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  Context& c_;
  LayerBuffers b_;
  int out_ = 0, in_ = 0;
  const float* bias_ = nullptr;
  std::string desc_;
  DeviceArray<std::uint16_t> x16_, w16_, dy16_;  // --precision bf16: the copies
};

}  // namespace

std::unique_ptr<LayerKernel> make_fc(Context& c, const LayerSpec& l, const LayerBuffers& b, bool training) {
  return std::make_unique<Fc>(c, l, b, training);
}

}  // namespace mnist_mpi::cuda
