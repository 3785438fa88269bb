// The PowerSGD codec (--grad-compression powersgd[:RANK]; Note [A gradient codec] in
// include/mnist_mpi/train/codec.hpp): each weight matrix of a bucket sent as two rank-RANK
// factors, with error feedback and a warm start.
//
// Note [PowerSGD in this reducer]
// Vogels, Karimireddy and Jaggi 2019, as PyTorch DDP's powerSGD_hook does it, on this reducer's
// buckets. In its bucket the codec finds the weight matrices: a conv's (O, I, KH, KW) as
// O x I*KH*KW, an fc's (O, I) as it is, and of a tensor the bucket holds only a part of (one larger
// than the cap is split across buckets) the whole rows inside the bucket. A matrix is compressed
// where its factors take less than half its size ((rows + cols) x RANK x 2 < rows x cols: DDP's
// min_compression_rate); the rest of the bucket (biases, small matrices, a split tensor's partial
// rows) goes as floats. With M_r = G_r + E_r on rank r (its gradient plus its residual):
//   1. start(): P_r = M_r Q, Q the warm-start factor (the same on every rank); every matrix's P_r
//      and the bucket's floats in one sum, P = sum of P_r;
//   2. advance() (Note [A codec's later collectives]): each P orthonormalised column by column
//      (Gram-Schmidt in double), Q_r = M_r^T P, every matrix's in one sum, Q = sum of Q_r;
//   3. finish(): the matrix's sum taken as P Q^T (= P P^T sum of M_r), E_r = M_r - P Q^T / ranks
//      kept for the next step, and Q kept as the next step's start.
// What the factors leave out stays in the residuals (they sum to sum M_r - P Q^T), so over the
// steps every gradient reaches the sum (error feedback). The sums are in rank order (Note [Sums in
// rank order]), and the orthogonalisation and P Q^T are the codec's own loops, not a BLAS whose
// kernels depend on the CPU: every rank decodes the same bits, so replicas stay equal. Only the
// rank's own products (M_r Q, M_r^T P) go to oneDNN's sgemm. The bucket's P goes while backward
// runs, and its Q as the next bucket starts, so the two sums in sequence that cost DDP's hook
// speed (pytorch#74148) overlap backward too, but the last bucket's.
// Before --compression-start-steps the codec sends the floats (the first steps move the weights
// most: DDP's start_powerSGD_iter). A non-finite M_r makes the sums non-finite on every rank (the
// step guard sees it): the residual is then zeroed and Q not kept, so a step the guard skips does
// not poison the steps after it. State (docs/checkpoint.md, CDEC): the rank's residuals, then the
// Q factors, which are the same on every rank (shared_state_size()).
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/resilience/finite.hpp"
#include "mnist_mpi/rng.hpp"
#include "mnist_mpi/train/codec.hpp"

namespace mnist_mpi {
namespace {

constexpr std::uint64_t kFactorStream = 0x70736764;  // "psgd": the first Q's random keys

struct Matrix {             // whole rows of one weight tensor, in the bucket
  std::int64_t at = 0;      // its first element, within the bucket
  std::int64_t rows = 0, cols = 0;
  std::int64_t flat = 0;    // its first element in the flat buffer (the first Q's key)
  std::int64_t p_at = 0;    // its P (rows x rank, row-major) in wire_p_
  std::int64_t q_at = 0;    // its Q^T (rank x cols, row-major) in wire_q_ and in the warm start
  std::int64_t e_at = 0;    // its residual (rows x cols) in state_
};

struct Floats {  // elements sent whole
  std::int64_t at = 0, size = 0;  // within the bucket
  std::int64_t wire_at = 0;       // in wire_p_
};

void sgemm(char ta, char tb, std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
           const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  const dnnl_status_t s = dnnl_sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
  MNIST_CHECK(s == dnnl_success, ExitCode::kRuntime, "PowerSGD: oneDNN's sgemm failed (status " + std::to_string(s) + ")");
}

class PowerSgdCodec final : public GradientCodec {
 public:
  PowerSgdCodec(const CodecBinding& b, int rank, std::int64_t start_step, std::uint64_t seed,
                std::span<const ParamTensor> tensors)
      : comm_(*b.comm), grads_(b.grads), sharded_(b.sharded), rank_(rank), start_step_(start_step) {
    plan(b.offset, tensors);
    std::int64_t residuals = 0, p = 0, q = 0;
    for (Matrix& m : matrices_) {
      m.e_at = residuals;
      m.p_at = p;
      m.q_at = q;
      residuals += m.rows * m.cols;
      p += m.rows * rank_;
      q += rank_ * m.cols;
      scratch_rows_ = std::max(scratch_rows_, m.rows);
    }
    for (Floats& f : floats_) {
      f.wire_at = p;
      p += f.size;
    }
    residuals_ = residuals;
    state_.assign(static_cast<std::size_t>(residuals + q), 0.0f);
    wire_p_.resize(static_cast<std::size_t>(p));
    wire_q_.resize(static_cast<std::size_t>(q));
    scratch_.resize(static_cast<std::size_t>(scratch_rows_ * rank_));
    for (const Matrix& m : matrices_)  // the first Q: the same on every rank, from the seed
      for (std::int64_t i = 0; i < rank_ * m.cols; ++i)
        warm()[m.q_at + i] = 2.0f * rng::uniform(rng::key(seed, kFactorStream, static_cast<std::uint64_t>(m.flat),
                                                 static_cast<std::uint64_t>(i))) - 1.0f;
  }

  void begin_step(std::int64_t step) override { compressing_ = step >= start_step_ && !matrices_.empty(); }

  void start() override {
    if (!compressing_) {  // the floats, as the float codec sends them
      request_ = sharded_ ? comm_.start_reduce_scatter_sum(grads_) : comm_.start_allreduce_sum(grads_);
      phase_ = Phase::kFloats;
      return;
    }
    for (const Matrix& m : matrices_) {
      float* M = state_.data() + m.e_at;
      const float* g = grads_.data() + m.at;
      const std::int64_t n = m.rows * m.cols;
      for (std::int64_t i = 0; i < n; ++i) M[i] += g[i];
      sgemm('N', 'T', m.rows, rank_, m.cols, M, m.cols, warm() + m.q_at, m.cols, wire_p_.data() + m.p_at, rank_);
    }
    for (const Floats& f : floats_) std::copy_n(grads_.data() + f.at, f.size, wire_p_.data() + f.wire_at);
    request_ = comm_.start_allreduce_sum(std::span<float>(wire_p_));
    phase_ = Phase::kP;
  }

  void advance() override {
    if (phase_ != Phase::kP) return;
    comm_.wait(request_);
    for (const Matrix& m : matrices_) {
      float* P = wire_p_.data() + m.p_at;
      orthonormalise(P, m.rows);
      sgemm('T', 'N', rank_, m.cols, m.rows, P, rank_, state_.data() + m.e_at, m.cols, wire_q_.data() + m.q_at, m.cols);
    }
    request_ = comm_.start_allreduce_sum(std::span<float>(wire_q_));
    phase_ = Phase::kQ;
  }

  bool in_flight() const override { return phase_ != Phase::kIdle; }

  void finish(std::chrono::steady_clock::time_point* completed) override {
    if (phase_ == Phase::kFloats) {
      comm_.wait(request_, completed);
      phase_ = Phase::kIdle;
      return;
    }
    advance();
    comm_.wait(request_, completed);
    const float share = 1.0f / static_cast<float>(comm_.size());
    for (const Matrix& m : matrices_) decode(m, share);
    for (const Floats& f : floats_) std::copy_n(wire_p_.data() + f.wire_at, f.size, grads_.data() + f.at);
    phase_ = Phase::kIdle;
  }

  std::span<float> state() override { return state_; }
  std::int64_t shared_state_size() const override { return static_cast<std::int64_t>(state_.size()) - residuals_; }
  double wire_bytes() const override {
    return matrices_.empty() ? static_cast<double>(grads_.size_bytes())
                             : static_cast<double>((wire_p_.size() + wire_q_.size()) * sizeof(float));
  }

 private:
  enum class Phase { kIdle, kFloats, kP, kQ };

  float* warm() { return state_.data() + residuals_; }

  // The bucket's matrices and the runs of floats between them.
  void plan(std::int64_t offset, std::span<const ParamTensor> tensors) {
    const std::int64_t lo = offset, hi = offset + static_cast<std::int64_t>(grads_.size());
    std::int64_t floats_from = lo;  // where the run of floats not yet recorded begins (flat)
    const auto floats_to = [&](std::int64_t end) {
      if (end > floats_from) floats_.push_back({floats_from - lo, end - floats_from, 0});
      floats_from = end;
    };
    for (const ParamTensor& t : tensors) {
      const std::int64_t a = std::max(lo, t.offset), e = std::min(hi, t.offset + t.size);
      if (a >= e || t.is_bias || t.shape.size() < 2 || t.shape[0] <= 0) continue;
      const std::int64_t cols = t.size / t.shape[0];
      const std::int64_t r0 = (a - t.offset + cols - 1) / cols, r1 = (e - t.offset) / cols;
      const std::int64_t rows = r1 - r0;
      if (rows <= 0 || (rows + cols) * rank_ * 2 >= rows * cols) continue;  // sent as floats
      const std::int64_t begin = t.offset + r0 * cols;
      floats_to(begin);
      matrices_.push_back({begin - lo, rows, cols, begin});
      floats_from = begin + rows * cols;
    }
    floats_to(hi);
  }

  // P (rows x rank, row-major) made orthonormal column by column, in double (modified
  // Gram-Schmidt); a column with nothing left of it becomes zero, and a non-finite one stays so.
  void orthonormalise(float* P, std::int64_t rows) {
    double* d = scratch_.data();
    for (int c = 0; c < rank_; ++c)
      for (std::int64_t i = 0; i < rows; ++i) d[c * rows + i] = P[i * rank_ + c];
    for (int c = 0; c < rank_; ++c) {
      double* v = d + c * rows;
      for (int j = 0; j < c; ++j) {
        const double* u = d + j * rows;
        double dot = 0;
        for (std::int64_t i = 0; i < rows; ++i) dot += v[i] * u[i];
        for (std::int64_t i = 0; i < rows; ++i) v[i] -= dot * u[i];
      }
      double norm = 0;
      for (std::int64_t i = 0; i < rows; ++i) norm += v[i] * v[i];
      norm = std::sqrt(norm);
      const double scale = norm > 1e-30 ? 1.0 / norm : (std::isfinite(norm) ? 0.0 : norm);
      for (std::int64_t i = 0; i < rows; ++i) v[i] *= scale;
    }
    for (int c = 0; c < rank_; ++c)
      for (std::int64_t i = 0; i < rows; ++i) P[i * rank_ + c] = static_cast<float>(d[c * rows + i]);
  }

  // The matrix's sum P Q^T into the gradients, the residual M - P Q^T / ranks, and Q kept.
  void decode(const Matrix& m, float share) {
    const float* P = wire_p_.data() + m.p_at;
    const float* Qt = wire_q_.data() + m.q_at;
    const bool ok = all_finite(P, m.rows * rank_) && all_finite(Qt, rank_ * m.cols);
    for (std::int64_t i = 0; i < m.rows; ++i) {
      float* g = grads_.data() + m.at + i * m.cols;
      float* M = state_.data() + m.e_at + i * m.cols;
      std::fill_n(g, m.cols, 0.0f);
      for (int c = 0; c < rank_; ++c) {
        const float p = P[i * rank_ + c];
        const float* q = Qt + c * m.cols;
        for (std::int64_t k = 0; k < m.cols; ++k) g[k] += p * q[k];
      }
      if (ok) {
        for (std::int64_t k = 0; k < m.cols; ++k) M[k] -= g[k] * share;
      } else {  // the step guard sees it on every rank, in every shard
        std::fill_n(g, m.cols, std::numeric_limits<float>::quiet_NaN());
        std::fill_n(M, m.cols, 0.0f);
      }
    }
    if (ok) std::copy_n(Qt, rank_ * m.cols, warm() + m.q_at);
  }

  Communicator& comm_;
  std::span<float> grads_;
  bool sharded_;
  int rank_;
  std::int64_t start_step_;
  std::vector<Matrix> matrices_;
  std::vector<Floats> floats_;
  std::int64_t residuals_ = 0;   // state_'s first part: the residuals (M_r between the steps' start and finish)
  std::vector<float> state_;     // the residuals, then the warm-start Q^T of every matrix
  std::vector<float> wire_p_;    // every matrix's P, then the floats
  std::vector<float> wire_q_;    // every matrix's Q^T
  std::vector<double> scratch_;  // orthonormalise's columns
  std::int64_t scratch_rows_ = 0;
  bool compressing_ = false;
  Phase phase_ = Phase::kIdle;
  CommRequest request_;
};

}  // namespace

CodecFactory powersgd_codec(int rank, std::int64_t start_step, std::uint64_t seed, std::span<const ParamTensor> tensors) {
  MNIST_CHECK(rank >= 1 && rank <= kMaxPowerSgdRank, ExitCode::kUsage,
              "PowerSGD's rank must be from 1 to " + std::to_string(kMaxPowerSgdRank));
  return [=](const CodecBinding& b) -> std::unique_ptr<GradientCodec> {
    MNIST_CHECK(b.backend == nullptr || b.backend->host_buffers(), ExitCode::kRuntime,
                "the PowerSGD codec runs on host memory (its CUDA form is not written yet)");
    return std::make_unique<PowerSgdCodec>(b, rank, start_step, seed, tensors);
  };
}

}  // namespace mnist_mpi
