// The bf16 codec (--grad-compression bf16; Note [A gradient codec] in
// include/mnist_mpi/train/codec.hpp): each bucket sent and summed in bf16, half the bytes of
// floats, with error feedback.
//
// Note [bf16 on the wire with error feedback]
// Rank r sends b = bf16(g + e), its bucket's gradient plus its residual e, and keeps
// e = (g + e) - float(b), what the rounding left out, for the next step: so over the steps every
// rank's gradients reach the sum whole, only later (Seide et al. 2014; Karimireddy et al. 2019),
// where plain bf16 on the wire (PyTorch's bf16_compress_hook) drops them. The sum is of bf16
// values in rank order, each addition rounded to bf16 (Note [Sums in rank order]), and decoded
// once into the bucket's floats: the same bits on every rank, so replicas stay equal. A
// non-finite g + e is sent as it is (the step guard sees it in the sum) and leaves a zero
// residual, so that a step the guard skips does not poison the steps after it. The residuals
// belong to their rank: a checkpoint holds every rank's (docs/checkpoint.md).
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/bf16.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/codec.hpp"

namespace mnist_mpi {
namespace {

class Bf16Codec final : public GradientCodec {
 public:
  explicit Bf16Codec(const CodecBinding& b)
      : comm_(*b.comm),
        grads_(b.grads),
        wire_(b.grads.size()),
        residual_(b.grads.size(), 0.0f),
        sharded_(b.sharded),
        receives_(b.receives) {}

  void start() override {
    bf16_encode_with_feedback(grads_.data(), residual_.data(), wire_.data(), static_cast<std::int64_t>(grads_.size()));
    request_ = sharded_ ? comm_.start_reduce_scatter_sum(wire_) : comm_.start_allreduce_sum(wire_);
  }
  bool in_flight() const override { return request_.active(); }
  void finish(std::chrono::steady_clock::time_point* completed) override {
    comm_.wait(request_, completed);
    bf16_decode(wire_.data() + receives_.begin, grads_.data() + receives_.begin, receives_.size());
  }
  std::span<float> state() override { return residual_; }
  double wire_bytes() const override { return static_cast<double>(wire_.size() * sizeof(Bf16)); }

 private:
  Communicator& comm_;
  std::span<float> grads_;
  std::vector<Bf16> wire_;
  std::vector<float> residual_;  // this rank's error feedback
  bool sharded_;
  Shard receives_;  // what finish() decodes
  CommRequest request_;
};

}  // namespace

CodecFactory bf16_codec() {
  return [](const CodecBinding& b) -> std::unique_ptr<GradientCodec> {
    MNIST_CHECK(b.backend == nullptr || b.backend->host_buffers(), ExitCode::kRuntime,
                "the bf16 codec runs on host memory (its CUDA form is not written yet)");
    return std::make_unique<Bf16Codec>(b);
  };
}

}  // namespace mnist_mpi
