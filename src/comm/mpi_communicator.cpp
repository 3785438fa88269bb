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
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  std::string host() const override { return host_; }

  void allreduce_sum(std::span<float> d) override {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, d.data(), checked_count(d.size()), MPI_FLOAT, MPI_SUM, comm_));
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
  CommRequest start_allreduce_sum(std::span<float> d) override {
    MPI_Request r;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, d.data(), checked_count(d.size()), MPI_FLOAT, MPI_SUM, comm_, &r));
    requests_.push_back(r);
    return CommRequest{static_cast<std::int64_t>(requests_.size()) - 1};
  }
  void wait(CommRequest& req) override {
    MNIST_CHECK(req.active() && req.id < static_cast<std::int64_t>(requests_.size()), ExitCode::kRuntime,
                "wait on a request this communicator did not start");
    MPI_CHECK(MPI_Wait(&requests_[static_cast<std::size_t>(req.id)], MPI_STATUS_IGNORE));
    req.id = -1;
    bool all_done = true;
    for (MPI_Request r : requests_) all_done = all_done && r == MPI_REQUEST_NULL;
    if (all_done) requests_.clear();  // capacity is kept: no allocation in the steady state
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
  MPI_Comm comm_ = MPI_COMM_NULL, local_ = MPI_COMM_NULL;
  std::string host_;
  std::vector<MPI_Request> requests_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() { return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD); }
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) { return std::make_unique<MpiCommunicator>(comm); }

}  // namespace mnist_mpi
