// The MPI Communicator over MPI_COMM_WORLD, on host buffers. The node-local rank comes from
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED). Every call goes through MPI_CHECK.
#include <mpi.h>

#include <limits>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"

namespace mnist_mpi {
namespace {

int checked_count(std::size_t n) {
  MNIST_CHECK(n <= static_cast<std::size_t>(std::numeric_limits<int>::max()), ExitCode::kRuntime,
              "collective of " + std::to_string(n) + " elements exceeds MPI's int count");
  return static_cast<int>(n);
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm parent) {
    MPI_CHECK(MPI_Comm_dup(parent, &comm_));
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_dup(comm_, &gather_));
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
    MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local_));
    MPI_CHECK(MPI_Comm_rank(local_, &local_rank_));
    MPI_CHECK(MPI_Comm_size(local_, &local_size_));
    char name[MPI_MAX_PROCESSOR_NAME];
    int len = 0;
    MPI_CHECK(MPI_Get_processor_name(name, &len));
    host_.assign(name, static_cast<std::size_t>(len));
  }
  ~MpiCommunicator() override {
    MPI_Comm_free(&local_);
    MPI_Comm_free(&gather_);
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  std::string host() const override { return host_; }

  void allreduce_sum(std::span<float> d) override {  // the same sums as start_allreduce_sum
    CommRequest r = start_allreduce_sum(d);
    wait(r);
  }
  void allreduce_sum(std::span<double> d) override {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, d.data(), checked_count(d.size()), MPI_DOUBLE, MPI_SUM, comm_));
  }
  void allreduce_max(std::span<std::int64_t> d) override {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, d.data(), checked_count(d.size()), MPI_INT64_T, MPI_MAX, comm_));
  }
  void allreduce_min(std::span<std::int64_t> d) override {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, d.data(), checked_count(d.size()), MPI_INT64_T, MPI_MIN, comm_));
  }
  // Note [Sums in rank order]
  // start_allreduce_sum does not call MPI_Iallreduce: Open MPI picks its allreduce algorithm by
  // message size, and with 3 or more ranks different algorithms add the ranks' values in
  // different orders, so the same gradients split into other buckets could give other bits. Here
  // every element is summed by one owner rank in ascending rank order, ((g0 + g1) + g2) + ...,
  // whatever the bucket: the range is cut into world-size chunks, chunk r goes to rank r
  // (MPI_Ialltoallv: a reduce-scatter's traffic), rank r adds the contributions in rank order, and
  // MPI_Iallgatherv returns the sums to everyone. Same bytes on the wire as a ring allreduce
  // (2 (n-1)/n of the buffer), and results bitwise independent of bucketing and of overlap.
  // Collectives on a communicator must start in the same order on every rank, but a scatter's
  // completion time differs between ranks; so the gathers run on a communicator of their own
  // (gather_) and start strictly in the order their requests were started (seq).
  CommRequest start_allreduce_sum(std::span<float> d) override {
    std::size_t slot = 0;
    while (slot < ops_.size() && ops_[slot].phase != Op::kFree) ++slot;
    if (slot == ops_.size()) ops_.emplace_back();  // grows to the number of buckets, once
    Op& op = ops_[slot];
    op.data = d;
    op.seq = next_seq_++;
    const auto n = static_cast<std::size_t>(size_);
    const auto count = static_cast<std::int64_t>(d.size());
    op.counts.resize(n);
    op.displs.resize(n);
    op.own.resize(n);
    op.own_displs.resize(n);
    for (std::size_t r = 0; r < n; ++r) {
      const std::int64_t b = count * static_cast<std::int64_t>(r) / size_;
      const std::int64_t e = count * static_cast<std::int64_t>(r + 1) / size_;
      op.displs[r] = checked_count(static_cast<std::size_t>(b));
      op.counts[r] = checked_count(static_cast<std::size_t>(e - b));
    }
    const int mine = op.counts[static_cast<std::size_t>(rank_)];
    for (std::size_t r = 0; r < n; ++r) {
      op.own[r] = mine;
      op.own_displs[r] = mine * static_cast<int>(r);
    }
    if (op.scratch.size() < n * static_cast<std::size_t>(mine)) op.scratch.resize(n * static_cast<std::size_t>(mine));
    if (size_ == 1) {
      op.phase = Op::kDone;
      ++next_gather_seq_;
    } else {
      MPI_CHECK(MPI_Ialltoallv(d.data(), op.counts.data(), op.displs.data(), MPI_FLOAT, op.scratch.data(),
                               op.own.data(), op.own_displs.data(), MPI_FLOAT, comm_, &op.request));
      op.phase = Op::kScatter;
    }
    return CommRequest{static_cast<std::int64_t>(slot)};
  }

  bool test(CommRequest& req) override {
    Op& op = checked_op(req);
    advance(op, false);
    return op.phase == Op::kDone;
  }

  void wait(CommRequest& req) override {
    Op& op = checked_op(req);
    advance(op, true);
    op.phase = Op::kFree;
    req.id = -1;
  }

  void broadcast(std::span<float> d, int root) override {
    MPI_CHECK(MPI_Bcast(d.data(), checked_count(d.size()), MPI_FLOAT, root, comm_));
  }
  void broadcast(std::span<std::uint8_t> d, int root) override {
    MPI_CHECK(MPI_Bcast(d.data(), checked_count(d.size()), MPI_UINT8_T, root, comm_));
  }
  void allgather(std::uint64_t value, std::span<std::uint64_t> out) override {
    MNIST_CHECK(out.size() == static_cast<std::size_t>(size_), ExitCode::kRuntime, "allgather: out.size() != world size");
    MPI_CHECK(MPI_Allgather(&value, 1, MPI_UINT64_T, out.data(), 1, MPI_UINT64_T, comm_));
  }
  void barrier() override { MPI_CHECK(MPI_Barrier(comm_)); }

 private:
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  MPI_Comm comm_ = MPI_COMM_NULL, gather_ = MPI_COMM_NULL, local_ = MPI_COMM_NULL;
  std::string host_;
  struct Op {
    enum Phase { kFree, kScatter, kScattered, kGather, kDone } phase = kFree;
    std::int64_t seq = 0;
    std::span<float> data;
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<int> counts, displs, own, own_displs;  // chunk r of data: [displs[r], +counts[r])
    std::vector<float> scratch;                        // (world, my chunk): the contributions to my chunk
  };

  Op& checked_op(const CommRequest& req) {
    MNIST_CHECK(req.active() && req.id < static_cast<std::int64_t>(ops_.size()) &&
                    ops_[static_cast<std::size_t>(req.id)].phase != Op::kFree,
                ExitCode::kRuntime, "test/wait on a request this communicator did not start");
    return ops_[static_cast<std::size_t>(req.id)];
  }

  // Moves op forward as far as it can go (block: until it is done).
  void advance(Op& op, bool block) {
    if (op.phase == Op::kScatter) {
      int done = 1;
      if (block) MPI_CHECK(MPI_Wait(&op.request, MPI_STATUS_IGNORE));
      else MPI_CHECK(MPI_Test(&op.request, &done, MPI_STATUS_IGNORE));
      if (!done) return;
      // Sum my chunk's contributions in rank order (Note [Sums in rank order]).
      const int mine = op.counts[static_cast<std::size_t>(rank_)];
      float* out = op.data.data() + op.displs[static_cast<std::size_t>(rank_)];
      const float* in = op.scratch.data();
      for (int i = 0; i < mine; ++i) {
        float acc = in[i];
        for (int r = 1; r < size_; ++r) acc += in[static_cast<std::ptrdiff_t>(r) * mine + i];
        out[i] = acc;
      }
      op.phase = Op::kScattered;
    }
    if (op.phase == Op::kScattered) {
      while (op.seq != next_gather_seq_) {  // an earlier request's gather must start first
        if (!block) return;
        Op* earlier = nullptr;
        for (Op& o : ops_)
          if (o.phase != Op::kFree && o.seq == next_gather_seq_) earlier = &o;
        MNIST_CHECK(earlier != nullptr, ExitCode::kRuntime, "allreduce requests out of order");
        advance(*earlier, true);
      }
      MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, op.data.data(), op.counts.data(),
                                op.displs.data(), MPI_FLOAT, gather_, &op.request));
      ++next_gather_seq_;
      op.phase = Op::kGather;
    }
    if (op.phase == Op::kGather) {
      int done = 1;
      if (block) MPI_CHECK(MPI_Wait(&op.request, MPI_STATUS_IGNORE));
      else MPI_CHECK(MPI_Test(&op.request, &done, MPI_STATUS_IGNORE));
      if (done) op.phase = Op::kDone;
    }
  }

  std::vector<Op> ops_;
  std::int64_t next_seq_ = 0, next_gather_seq_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD); }
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) { return std::make_unique<MpiCommunicator>(comm); }

}  // namespace mnist_mpi
