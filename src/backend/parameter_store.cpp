// The parameters, their host image and the models that read them (Note [The parameters and their
// copies] in include/mnist_mpi/backend/parameter_store.hpp).
#include "mnist_mpi/backend/parameter_store.hpp"

#include <algorithm>

#include "mnist_mpi/backend/model.hpp"
#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

ParameterStore::ParameterStore(Backend& backend, std::int64_t count, std::int64_t state_count)
    : count_(count),
      state_count_(state_count),
      buffer_(backend.allocate(count)),
      host_(backend.make_host_copy({buffer_->data()}, count)) {
  if (state_count == 0) return;
  state_ = backend.allocate(state_count);
  state_host_ = backend.make_host_copy({state_->data()}, state_count);
}

ParameterStore::~ParameterStore() = default;

const float* ParameterStore::read() {
  host_->to_host();
  return host_->host(0);
}

float* ParameterStore::host() { return host_->host(0); }

void ParameterStore::to_backend() {
  host_->to_backend();
  changed_all();
}

const float* ParameterStore::read_state() {
  if (!state_) return nullptr;
  state_host_->to_host();
  return state_host_->host(0);
}

float* ParameterStore::state_host() { return state_ ? state_host_->host(0) : nullptr; }

void ParameterStore::state_to_backend() {
  if (state_) state_host_->to_backend();
}

ParameterStore::Lease ParameterStore::write(std::int64_t begin, std::int64_t end) {
  MNIST_CHECK(0 <= begin && begin <= end && end <= count_, ExitCode::kRuntime,
              "ParameterStore::write: a range outside the parameters");
  return Lease(*this, {buffer_->data() + begin, static_cast<std::size_t>(end - begin)});
}

void ParameterStore::changed(const float* from, const float* to, Images images) {
  MNIST_CHECK(data() <= from && from <= to && to <= data() + count_, ExitCode::kRuntime,
              "ParameterStore::changed: a range outside the parameters");
  if (from == to) return;
  for (Model* m : models_) m->parameters_changed(from, to, images == Images::kWritten);
}

void ParameterStore::attach(Model* model) {
  models_.push_back(model);
  for (const LayerKernel::PlainCopy& c : model->plain_bf16_copies()) {
    const bool overlaps = std::any_of(images_.begin(), images_.end(), [&](const LayerKernel::PlainCopy& o) {
      return c.begin < o.end && o.begin < c.end;
    });
    MNIST_CHECK(!overlaps, ExitCode::kRuntime,
                "ParameterStore: two training models keep plain bf16 images of the same parameters");
    images_.push_back(c);
  }
  std::sort(images_.begin(), images_.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
}

void ParameterStore::detach(Model* model) {
  std::erase(models_, model);
  for (const LayerKernel::PlainCopy& c : model->plain_bf16_copies())
    std::erase_if(images_, [&](const LayerKernel::PlainCopy& o) { return o.copy == c.copy; });
}

}  // namespace mnist_mpi
