// The fixed-point codec of --exact-sums (Note [A gradient codec] in
// include/mnist_mpi/train/codec.hpp): the bucket's 64-bit integers, which ExactSums
// (include/mnist_mpi/train/exact_sums.hpp) made of this rank's chunks while backward ran, summed
// exactly, whole or (sharded) reduce-scattered; the last bucket's codec also sums the two counters
// after the flat buffer's integers. ExactSums::to_float turns the sums back once every bucket is in.
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/codec.hpp"

namespace mnist_mpi {
namespace {

class FixedPointCodec final : public GradientCodec {
 public:
  FixedPointCodec(const CodecBinding& b, std::span<std::int64_t> integers)
      : comm_(*b.comm),
        mine_(integers.subspan(static_cast<std::size_t>(b.offset), b.grads.size())),
        counters_(b.last ? integers.subspan(static_cast<std::size_t>(b.total)) : std::span<std::int64_t>()),
        sharded_(b.sharded) {}

  void start() override {
    request_ = sharded_ ? comm_.start_reduce_scatter_sum(mine_) : comm_.start_allreduce_sum(mine_);
    if (!counters_.empty()) counted_ = comm_.start_allreduce_sum(counters_);  // whole, on every rank
  }
  bool in_flight() const override { return request_.active(); }
  void finish(std::chrono::steady_clock::time_point* completed) override {
    comm_.wait(request_, completed);
    if (counted_.active()) comm_.wait(counted_);
  }

 private:
  Communicator& comm_;
  std::span<std::int64_t> mine_, counters_;
  bool sharded_;
  CommRequest request_, counted_;
};

}  // namespace

CodecFactory fixed_point_codec(std::span<std::int64_t> integers) {
  return [integers](const CodecBinding& b) -> std::unique_ptr<GradientCodec> {
    MNIST_CHECK(static_cast<std::int64_t>(integers.size()) >= b.total + 2 &&
                    b.offset + static_cast<std::int64_t>(b.grads.size()) <= b.total,
                ExitCode::kRuntime, "fixed-point codec: the integers must cover the gradient buffer and its counters");
    return std::make_unique<FixedPointCodec>(b, integers);
  };
}

}  // namespace mnist_mpi
