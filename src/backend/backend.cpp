// What every backend shares: the defaults of include/mnist_mpi/backend/backend.hpp.
#include "mnist_mpi/backend/backend.hpp"

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/communicator.hpp"

namespace mnist_mpi {

namespace {

class CopiedThroughHost final : public HostCopy {
 public:
  CopiedThroughHost(Backend& backend, std::vector<float*> buffers, std::int64_t count)
      : backend_(backend), buffers_(std::move(buffers)) {
    host_.reserve(buffers_.size());
    for (std::size_t i = 0; i < buffers_.size(); ++i) host_.emplace_back(static_cast<std::size_t>(count));
  }
  float* host(std::size_t i) override { return host_.at(i).data(); }
  void to_host() override {
    for (std::size_t i = 0; i < buffers_.size(); ++i) backend_.download(buffers_[i], host_[i]);
  }
  void to_backend() override {
    for (std::size_t i = 0; i < buffers_.size(); ++i) backend_.upload(host_[i], buffers_[i]);
  }

 private:
  Backend& backend_;
  std::vector<float*> buffers_;
  std::vector<std::vector<float>> host_;
};

}  // namespace

std::unique_ptr<HostCopy> Backend::make_host_copy(std::vector<float*> buffers, std::int64_t count) {
  MNIST_CHECK(count >= 0, ExitCode::kRuntime, "a host copy of a negative size");
  return std::make_unique<CopiedThroughHost>(*this, std::move(buffers), count);
}

// A host backend's gradients are in host memory, which the world communicator sums itself.
std::unique_ptr<Communicator> Backend::make_gradient_communicator(Communicator&, std::int64_t, bool, bool) {
  return nullptr;
}

}  // namespace mnist_mpi
