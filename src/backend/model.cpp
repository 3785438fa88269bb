// Builds a model instance: allocates the activations (and their gradients when training), binds
// each layer's buffers and asks the backend for a kernel prepared for its shapes. After this,
// forward() and backward() only run prepared kernels: nothing is planned or allocated per step.
#include "mnist_mpi/backend/model.hpp"

#include <algorithm>
#include <optional>
#include <sstream>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

Model::Model(const ModelSpec& spec, int batch, Backend& backend, const float* params, float* grads, float* state,
             ModelPart part)
    : spec_(spec), state_(state), batch_(batch), training_(grads != nullptr) {
  MNIST_CHECK(state != nullptr || spec.state_count == 0, ExitCode::kRuntime,
              "Model: a model with batch norm needs its state buffer");
  const std::size_t L = spec.layers.size();
  first_ = part.first;
  end_ = part.end < 0 ? static_cast<int>(L) : part.end;
  MNIST_CHECK(first_ >= 0 && first_ < end_ && static_cast<std::size_t>(end_) <= L &&
                  (static_cast<std::size_t>(end_) == L || part.boundary != nullptr) &&
                  (!training_ || static_cast<std::size_t>(end_) == L || part.dboundary != nullptr),
              ExitCode::kRuntime, "Model: a part needs layers [first, end) of the spec and, short of the end, its output");
  act_ptr_.assign(L + 1, nullptr);
  dact_ptr_.assign(L + 1, nullptr);
  // Activation i is the input of layer i; flatten's output aliases its input.
  for (std::size_t i = static_cast<std::size_t>(first_); i <= static_cast<std::size_t>(end_); ++i) {
    const Shape s = spec.activation(i);
    const bool alias = i > static_cast<std::size_t>(first_) && spec.layers[i - 1].kind == LayerKind::kFlatten;
    if (i == static_cast<std::size_t>(end_) && i < L) {  // another part's input
      MNIST_CHECK(!alias, ExitCode::kRuntime, "Model: a part may not end after a flatten");
      act_ptr_[i] = part.boundary;
      dact_ptr_[i] = training_ ? part.dboundary : nullptr;
      continue;
    }
    if (alias) {
      act_ptr_[i] = act_ptr_[i - 1];
      dact_ptr_[i] = dact_ptr_[i - 1];
      continue;
    }
    // Note [Sizes of a model] in src/model/spec.cpp: s.size() fits int; times the batch, int64 is
    // checked too (check_model_fits_memory() normally refuses such a batch first).
    const std::optional<std::int64_t> n = checked_mul(batch, s.size());
    MNIST_CHECK(n.has_value(), ExitCode::kUsage,
                "a batch of " + std::to_string(batch) + " images of layer " + std::to_string(i) +
                    "'s input has more values than 64 bits can count; use a smaller --batch-size");
    acts_.push_back(backend.allocate(*n));
    act_ptr_[i] = acts_.back()->data();
    if (training_ && i > 0) {  // no gradient for the input image
      dacts_.push_back(backend.allocate(*n));
      dact_ptr_[i] = dacts_.back()->data();
    }
  }
  // Note [Activation layouts] in include/mnist_mpi/backend/layer.hpp: the backend may keep inner activations blocked.
  const std::vector<Layout> layouts = backend.activation_layouts(spec);
  MNIST_CHECK(layouts.size() == L + 1 && layouts.front() == Layout::kPlain && layouts.back() == Layout::kPlain,
              ExitCode::kRuntime, "backend '" + backend.name() + "' chose invalid activation layouts");
  std::vector<std::int64_t>& param_offset = weight_offset_;
  param_offset.assign(L, -1);
  for (const ParamTensor& p : spec.params)
    if (!p.is_bias) param_offset[static_cast<std::size_t>(p.layer)] = p.offset;
  std::vector<std::int64_t> state_offset(L, -1);
  for (const StateTensor& s : spec.state)
    if (state_offset[static_cast<std::size_t>(s.layer)] < 0) state_offset[static_cast<std::size_t>(s.layer)] = s.offset;
  backend.plan_model(spec, layouts, batch, first_, end_, training_);
  for (std::size_t i = static_cast<std::size_t>(first_); i < static_cast<std::size_t>(end_); ++i) {
    LayerBuffers b;
    b.batch = batch;
    b.x = act_ptr_[i];
    b.y = act_ptr_[i + 1];
    b.x_layout = layouts[i];
    b.y_layout = layouts[i + 1];
    if (training_) {
      b.dy = dact_ptr_[i + 1];
      b.dx = dact_ptr_[i];  // null for i == 0: the first layer computes no input gradient
    }
    if (param_offset[i] >= 0) {
      b.w = params + param_offset[i];
      if (grads) b.dw = grads + param_offset[i];
    }
    if (state_offset[i] >= 0) b.state = state + state_offset[i];
    kernels_.push_back(backend.make_layer(spec.layers[i], static_cast<int>(i), b, training_));
  }
}

// The sizes are checked first: the delegated constructor binds the kernels to the buffers.
Model::Model(const ModelSpec& spec, int batch, Backend& backend, ParameterStore& store, float* grads, ModelPart part)
    : Model(spec, batch, backend, checked_params(spec, store), grads, store.state(), part) {
  for (auto& k : kernels_) k->track_copies();
  store_ = &store;
  store.attach(this);
}

const float* Model::checked_params(const ModelSpec& spec, ParameterStore& store) {
  MNIST_CHECK(store.count() == spec.param_count && store.state_count() == spec.state_count, ExitCode::kRuntime,
              "Model: a parameter store of " + std::to_string(store.count()) + " parameters and " +
                  std::to_string(store.state_count()) + " values of state for a model of " +
                  std::to_string(spec.param_count) + " and " + std::to_string(spec.state_count));
  return store.data();
}

Model::~Model() {
  if (store_) store_->detach(this);
}

void Model::forward(const StepContext& ctx) {
  for (auto& k : kernels_) k->forward(ctx);
}

void Model::parameters_changed(const float* from, const float* to, bool images_written) {
  for (auto& k : kernels_) k->parameters_changed(from, to, images_written);
}

std::vector<LayerKernel::PlainCopy> Model::plain_bf16_copies() const {
  std::vector<LayerKernel::PlainCopy> copies;
  for (const auto& k : kernels_)
    if (const LayerKernel::PlainCopy c = k->plain_bf16_copy(); c.copy != nullptr) copies.push_back(c);
  std::sort(copies.begin(), copies.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  return copies;
}

void Model::backward(const StepContext& ctx, const std::function<void(int)>& on_layer_done) {
  for (int i = end_ - 1; i >= first_; --i) {
    kernels_[static_cast<std::size_t>(i - first_)]->backward(ctx);
    if (on_layer_done) on_layer_done(i);
  }
}

std::vector<Model::TakenWeight> Model::take_weight_gradients(int chunks, int chunk_rows, FixedPointSink& sink) {
  MNIST_CHECK(training_ && chunks >= 1 && chunk_rows >= 1 && batch_ % chunk_rows == 0, ExitCode::kRuntime,
              "take_weight_gradients: a training model, chunks >= 1 and chunks of rows that divide its batch");
  std::vector<TakenWeight> taken;
  for (int i = first_; i < end_; ++i) {
    const std::int64_t offset = weight_offset_[static_cast<std::size_t>(i)];
    if (offset < 0) continue;
    if (const std::int64_t n =
            kernels_[static_cast<std::size_t>(i - first_)]->take_weight_gradient(chunks, chunk_rows, offset, sink);
        n > 0)
      taken.push_back({i, offset, n});
  }
  return taken;
}

std::string Model::describe() const {
  std::ostringstream os;
  for (std::size_t i = static_cast<std::size_t>(first_); i < static_cast<std::size_t>(end_); ++i)
    os << "  layer " << i << " " << spec_.layers[i].text << " (" << spec_.layers[i].out.c << ","
       << spec_.layers[i].out.h << "," << spec_.layers[i].out.w << "): " << kernels_[i - static_cast<std::size_t>(first_)]->describe() << "\n";
  return os.str();
}

}  // namespace mnist_mpi
