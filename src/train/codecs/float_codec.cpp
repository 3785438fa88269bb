// The float codec (Note [A gradient codec] in include/mnist_mpi/train/codec.hpp): the bucket's
// floats summed in place, whole or (sharded) reduce-scattered. Nothing to encode or decode.
#include "mnist_mpi/train/codec.hpp"

namespace mnist_mpi {
namespace {

class FloatCodec final : public GradientCodec {
 public:
  explicit FloatCodec(const CodecBinding& b) : comm_(*b.comm), grads_(b.grads), sharded_(b.sharded) {}

  void start() override {
    request_ = sharded_ ? comm_.start_reduce_scatter_sum(grads_) : comm_.start_allreduce_sum(grads_);
  }
  bool in_flight() const override { return request_.active(); }
  void finish(std::chrono::steady_clock::time_point* completed) override { comm_.wait(request_, completed); }
  double wire_bytes() const override { return static_cast<double>(grads_.size_bytes()); }

 private:
  Communicator& comm_;
  std::span<float> grads_;
  bool sharded_;
  CommRequest request_;
};

}  // namespace

CodecFactory float_codec() {
  return [](const CodecBinding& b) { return std::make_unique<FloatCodec>(b); };
}

}  // namespace mnist_mpi
