// The training loop's optimiser (state, shards, checkpoint state; the pass is the backend's:
// include/mnist_mpi/backend/optimizer_pass.hpp) and the learning-rate schedules.
#include "mnist_mpi/train/optimizer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/exact_norm.hpp"

namespace mnist_mpi {

Optimizer::Optimizer(const OptimizerConfig& cfg, std::int64_t count)
    : cfg_(cfg),
      count_(count),
      owned_{{0, count}},
      owned_offset_{0},
      state_size_(count),
      pass_(make_host_optimizer_pass(cfg)) {
  host_m_.assign(static_cast<std::size_t>(count), 0.0f);
  if (moments() == 2) host_v_.assign(static_cast<std::size_t>(count), 0.0f);
  m_ = host_m_;
  v_ = host_v_;
  set_tensors({{0, count, true}});
}

Optimizer::Optimizer(const OptimizerConfig& cfg, std::int64_t count, Backend& backend, ParameterStore* store)
    : Optimizer(cfg, count, backend, {{ParamRange{0, count}}}, 0, store) {
  every_rank_.clear();  // unsharded
}

Optimizer::Optimizer(const OptimizerConfig& cfg, std::int64_t count, Backend& backend,
                     std::vector<std::vector<ParamRange>> every_rank, int rank, ParameterStore* store)
    : cfg_(cfg),
      count_(count),
      owned_(every_rank.at(static_cast<std::size_t>(rank))),
      every_rank_(std::move(every_rank)),
      backend_(&backend),
      pass_(backend.make_optimizer_pass(cfg, store)) {
  std::int64_t prev_end = 0;
  for (const ParamRange& r : owned_) {  // Note [Sharded optimiser state]
    MNIST_CHECK(prev_end <= r.begin && r.begin < r.end && r.end <= count, ExitCode::kRuntime,
                "Optimizer: owned ranges must be non-empty, ascending, disjoint and inside the buffer");
    owned_offset_.push_back(state_size_);
    state_size_ += r.end - r.begin;
    prev_end = r.end;
  }
  // At least one element each, so that a rank that owns nothing still has buffers to point at.
  const std::int64_t n = std::max<std::int64_t>(state_size_, 1);
  buf_m_ = backend.allocate(n);  // zero-filled
  m_ = std::span<float>(buf_m_->data(), static_cast<std::size_t>(state_size_));
  if (moments() == 2) {
    buf_v_ = backend.allocate(n);
    v_ = std::span<float>(buf_v_->data(), static_cast<std::size_t>(state_size_));
  }
  std::vector<float*> moments{buf_m_->data()};
  if (buf_v_) moments.push_back(buf_v_->data());
  host_state_ = backend.make_host_copy(std::move(moments), n);  // Note [Host copies]
  set_tensors({{0, count, true}});
}

Optimizer::~Optimizer() = default;

void Optimizer::restore(const float* m, const float* v, std::int64_t steps_taken) {
  MNIST_CHECK(steps_taken >= 0, ExitCode::kCheckpoint, "optimizer state with a negative step count");
  if (backend_) {  // a copy on the CPU, an upload on a device; each owned range to its packed place
    for (std::size_t i = 0; i < owned_.size(); ++i) {
      const auto n = static_cast<std::size_t>(owned_[i].end - owned_[i].begin);
      const std::int64_t at = owned_offset_[i];
      backend_->upload(std::span<const float>(m + owned_[i].begin, n), m_.data() + at);
      if (moments() == 2) backend_->upload(std::span<const float>(v + owned_[i].begin, n), v_.data() + at);
    }
  } else {
    std::copy(m, m + count_, m_.begin());
    if (!v_.empty()) std::copy(v, v + count_, v_.begin());
  }
  pass_->set(steps_taken);
  begun_ = 0;
  phase_ = 0;
}

std::int64_t Optimizer::steps_taken() const { return pass_->read(); }

void Optimizer::begin_step(double lr) {
  pass_->begin_step(lr);
  ++begun_;
  lr_ = lr;
  phase_ = 1;
}

void Optimizer::step(float* params, const float* grads, double lr) {
  begin_step(lr);
  if (!two_phase()) {
    update(params, const_cast<float*>(grads), 0, count_);  // a one-pass kind does not write grads
    return;
  }
  float* u = nullptr;
  if (backend_) {
    if (!direction_) direction_ = backend_->allocate(count_);
    u = direction_->data();
    backend_->copy(u, grads, count_);
  } else {
    host_direction_.assign(grads, grads + count_);
    u = host_direction_.data();
  }
  update(params, u, 0, count_);
  finish_first_phase(nullptr);
  update_second(params, u, 0, count_);
}

std::int64_t Optimizer::state_offset(std::int64_t begin, std::int64_t end) const {
  // The first owned range ending after begin (few ranges: one per bucket at most).
  const auto it = std::upper_bound(owned_.begin(), owned_.end(), begin,
                                   [](std::int64_t b, const ParamRange& r) { return b < r.end; });
  MNIST_CHECK(it != owned_.end() && it->begin <= begin && end <= it->end, ExitCode::kRuntime,
              "Optimizer::update: [" + std::to_string(begin) + ", " + std::to_string(end) +
                  ") is not inside a range this optimizer owns");
  return owned_offset_[static_cast<std::size_t>(it - owned_.begin())] + (begin - it->begin);
}

void Optimizer::update(float* params, float* grads, std::int64_t begin, std::int64_t end) {
  MNIST_CHECK(begun_ > 0 && 0 <= begin && begin <= end && end <= count_, ExitCode::kRuntime,
              "Optimizer::update: range outside the buffer or no begin_step()");
  if (begin == end) return;
  const std::int64_t at = state_offset(begin, end);
  float* m = m_.data() + at;
  float* v = v_.empty() ? nullptr : v_.data() + at;  // sgd has no second moment
  if (!two_phase()) {
    pass_->update(params + begin, grads + begin, m, v, end - begin);
    return;
  }
  // Note [LAMB in two phases]: the first phase, tensor by tensor (each piece to its tensor's norms).
  MNIST_CHECK(phase_ == 1, ExitCode::kRuntime, "Optimizer::update: the first phase after the step's norms");
  for_tensor_parts(begin, end, [&](std::size_t t, std::int64_t lo, std::int64_t hi) {
    pass_->direction(params + lo, grads + lo, m + (lo - begin), v + (lo - begin), hi - lo, per_tensor_.slot[t]);
  });
}

template <typename F>
void Optimizer::for_tensor_parts(std::int64_t begin, std::int64_t end, F&& f) const {
  auto it = std::upper_bound(per_tensor_.ranges.begin(), per_tensor_.ranges.end(), begin,
                             [](std::int64_t b, const OptimizerTensor& t) { return b < t.end; });
  for (std::int64_t at = begin; at < end; ++it) {
    const std::int64_t hi = std::min(end, it->end);
    f(static_cast<std::size_t>(it - per_tensor_.ranges.begin()), at, hi);
    at = hi;
  }
}

void Optimizer::set_tensors(std::vector<OptimizerTensor> tensors) {
  std::int64_t expect = 0;
  for (const OptimizerTensor& t : tensors) {
    MNIST_CHECK(t.begin == expect && t.begin < t.end, ExitCode::kRuntime,
                "Optimizer::set_tensors: the tensors must be non-empty and follow each other from 0");
    expect = t.end;
  }
  MNIST_CHECK(expect == count_, ExitCode::kRuntime, "Optimizer::set_tensors: the tensors do not cover the buffer");
  per_tensor_.ranges = std::move(tensors);
  per_tensor_.slot.assign(per_tensor_.ranges.size(), -1);
  per_tensor_.slots = 0;
  for (std::size_t t = 0; t < per_tensor_.ranges.size(); ++t)
    if (per_tensor_.ranges[t].trust_ratio) per_tensor_.slot[t] = per_tensor_.slots++;
  per_tensor_.norm_sums.assign(static_cast<std::size_t>(per_tensor_.slots * 2 * kNormWords), 0);
  per_tensor_.ratios.assign(per_tensor_.ranges.size(), 1.0);
  per_tensor_.rates.assign(per_tensor_.ranges.size(), 0.0f);
  if (two_phase()) pass_->set_norm_slots(per_tensor_.slots);
}

std::span<std::int64_t> Optimizer::take_norm_sums() {
  MNIST_CHECK(two_phase() && phase_ == 1, ExitCode::kRuntime,
              "Optimizer::take_norm_sums: not the first phase of a two-phase optimizer");
  std::fill(per_tensor_.norm_sums.begin(), per_tensor_.norm_sums.end(), 0);
  pass_->take_norms(per_tensor_.norm_sums);
  return per_tensor_.norm_sums;
}

void Optimizer::finish_first_phase(std::span<const std::int64_t> summed) {
  MNIST_CHECK(two_phase() && phase_ == 1 && summed.size() == per_tensor_.norm_sums.size(), ExitCode::kRuntime,
              "Optimizer::finish_first_phase: not the first phase, or norms of another size");
  for (std::size_t t = 0; t < per_tensor_.ranges.size(); ++t) {
    double r = 1.0;
    if (per_tensor_.slot[t] >= 0) {
      const auto at = static_cast<std::size_t>(per_tensor_.slot[t] * 2 * kNormWords);
      r = trust_ratio(squared_norm_of_limbs(summed.subspan(at, kNormWords)),
                      squared_norm_of_limbs(summed.subspan(at + kNormWords, kNormWords)));
    }
    per_tensor_.ratios[t] = r;
    per_tensor_.rates[t] = static_cast<float>(lr_ * r);
  }
  phase_ = 2;
}

double Optimizer::finish_first_phase(Communicator* comm) {
  const std::span<std::int64_t> sums = take_norm_sums();
  double waited = 0.0;
  if (comm) {
    const auto t0 = std::chrono::steady_clock::now();
    comm->allreduce_sum(sums);  // Note [Exact squared norms]: exact, in any order
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  finish_first_phase(std::span<const std::int64_t>(sums));
  return waited;
}

void Optimizer::update_second(float* params, const float* u, std::int64_t begin, std::int64_t end) {
  MNIST_CHECK(phase_ == 2 && 0 <= begin && begin <= end && end <= count_, ExitCode::kRuntime,
              "Optimizer::update_second: range outside the buffer or before finish_first_phase()");
  if (begin == end) return;
  state_offset(begin, end);  // checks that the range is this rank's
  for_tensor_parts(begin, end, [&](std::size_t t, std::int64_t lo, std::int64_t hi) {
    pass_->apply_direction(params + lo, u + lo, hi - lo, per_tensor_.rates[t]);
  });
}

// Note [The optimiser's two moments in a step] (include/mnist_mpi/train/optimizer.hpp)
bool Optimizer::on_bucket(float* params, float* grads, ParamRange r) {
  update(params, grads, r.begin, r.end);  // a two-phase kind's first phase: the parameters unchanged
  return !two_phase();
}

double Optimizer::finish_step(float* params, float* grads, std::span<const ParamRange> ranges, Communicator* comm,
                              FunctionRef<bool()> agree, FunctionRef<void(std::size_t)> written) {
  if (!two_phase() || !agree()) return 0.0;
  const double waited = finish_first_phase(comm);
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    update_second(params, grads, ranges[k].begin, ranges[k].end);
    written(k);
  }
  return waited;
}

// Note [Sharded optimiser state] (include/mnist_mpi/train/optimizer.hpp): every rank's packed
// moments go to rank 0, which puts each rank's ranges where they belong in full-size buffers, the
// checkpoint's layout. One moment at a time, through one byte buffer that is kept for the next
// checkpoint.
void Optimizer::gather_state(Communicator& comm) {
  if (every_rank_.empty()) return;  // unsharded: checkpoint_moments() reads the moments themselves
  host_state_->to_host();
  const std::size_t mine = static_cast<std::size_t>(state_size_) * sizeof(float);
  for (int i = 0; i < moments(); ++i) {
    comm.gather(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(host_state_->host(i)), mine),
                gathered_, gathered_counts_, 0);
    if (comm.rank() != 0) continue;
    full_[i].resize(static_cast<std::size_t>(count_));
    const std::uint8_t* from = gathered_.data();
    for (const std::vector<ParamRange>& ranges : every_rank_)
      for (const ParamRange& s : ranges) {
        const auto bytes = static_cast<std::size_t>(s.end - s.begin) * sizeof(float);
        std::memcpy(full_[i].data() + s.begin, from, bytes);
        from += bytes;
      }
    MNIST_CHECK(from == gathered_.data() + gathered_.size(), ExitCode::kRuntime,
                "gathered optimizer state does not match the ranks' shards");
  }
}

Optimizer::Moments Optimizer::checkpoint_moments() {
  const bool two = moments() == 2;
  if (!every_rank_.empty()) return {full_[0].data(), two ? full_[1].data() : nullptr};  // gather_state()'s
  if (!host_state_) return {m_.data(), two ? v_.data() : nullptr};                     // in host memory already
  host_state_->to_host();
  return {host_state_->host(0), two ? host_state_->host(1) : nullptr};
}

double learning_rate(const ScheduleConfig& s, std::int64_t step, std::int64_t epoch, std::int64_t total_steps) {
  double lr = s.base_lr;
  if (s.kind == "step") {
    const double k = std::floor(static_cast<double>(epoch) / s.step_epochs);
    lr = std::max(s.base_lr * std::pow(s.gamma, k), s.min_lr);
  } else if (s.kind == "cosine") {
    const double span = static_cast<double>(std::max<std::int64_t>(total_steps - s.warmup_steps, 1));
    const double t = std::clamp(static_cast<double>(step - s.warmup_steps) / span, 0.0, 1.0);
    lr = s.min_lr + 0.5 * (s.base_lr - s.min_lr) * (1.0 + std::cos(3.141592653589793 * t));
  } else if (s.kind != "constant") {
    throw_error(ExitCode::kUsage, "--lr-schedule: unknown schedule '" + s.kind + "' (constant, step, cosine)");
  }
  if (step < s.warmup_steps) lr *= static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  return lr;
}

}  // namespace mnist_mpi
