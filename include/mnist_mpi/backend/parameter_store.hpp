// The flat parameters of a run and its model state, their host images, and the copies that the
// backend's kernels keep of the parameters: where the writers of the parameters and the kernels
// that read them meet, so that no caller of a model or an optimiser deals with a kernel's copy.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/backend/layer.hpp"

namespace mnist_mpi {

class Model;

// Note [The parameters and their copies]
// A backend's kernel may keep a private copy of its weights: a bf16 image, oneDNN's blocked
// layout (Note [Weight copies kept between passes] in src/backend/cpu/bf16.cpp). Such a copy must
// be made again after its weights change, and only then: made at every pass, lenet's fc1 bf16
// copy cost 5 % of a bf16 step, and as much again for every batch of an evaluation. The store
// holds the parameters, and every model built on it (Model's store constructor) is told by the
// store, not by its caller, which ranges changed:
//   - whatever writes the parameters writes them through the store, which then tells the models
//     (Note [Writes that report themselves]): a Lease of a range, to_backend() for the host
//     image, the optimiser's pass for its ranges (Backend::make_optimizer_pass is given the store);
//   - each kernel decides what a change means for its copy: a training model's fc converts the
//     range while it is in cache, a convolution marks its copy to be made whole by its next pass,
//     an evaluation model's kernels mark theirs to be made at the next evaluation;
//   - a writer that can write a plain bf16 image in the same pass as the parameters (the CPU's
//     optimiser pass) asks for the images over its range (plain_bf16_images()) and then reports
//     changed(..., kImagesWritten), which leaves those images alone.
// A model built on a bare pointer has no store to tell it anything, so its kernels make their
// copies at every pass (what a test that changes the parameters between passes needs).
//
// The store also holds the model state (Note [State that is not trained] in
// include/mnist_mpi/model/spec.hpp: batch norm's running statistics), so that a layer with state
// needs nothing of its own in the trainer, the checkpoint writer or the commands that load a model.
// Note [Writes that report themselves]
// A write the store is not told of leaves a kernel's copy stale: the next pass computes with the
// old weights, silently. So the parameters in the backend's memory are writable only through the
// store: write(begin, end) lends the range as a Lease, and the lease, when it ends (also when an
// exception passes), reports the range as changed, so a writer cannot forget to. The writers
// that report finer than a lease, range by range as they go, ask for the buffer by a name that
// says so (data_for_reporting_writers()): the optimiser's pass (its ranges, and the bf16 images it
// writes itself) and the sharded optimiser's gathers (Reducer::finish_gathers). data() is for
// readers only.
class ParameterStore {
 public:
  // count zero-filled parameters and state_count values of model state in the backend's memory,
  // each with a host image.
  ParameterStore(Backend& backend, std::int64_t count, std::int64_t state_count = 0);
  ParameterStore(const ParameterStore&) = delete;
  ParameterStore& operator=(const ParameterStore&) = delete;
  ~ParameterStore();

  const float* data() const { return buffer_->data(); }
  std::int64_t count() const { return count_; }

  // [begin, end) of the parameters, lent for writing; reported as changed when the lease ends.
  class Lease {
   public:
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { store_.changed(span_.data(), span_.data() + span_.size()); }
    std::span<float> span() const { return span_; }
    float* data() const { return span_.data(); }

   private:
    friend class ParameterStore;
    Lease(ParameterStore& store, std::span<float> span) : store_(store), span_(span) {}
    ParameterStore& store_;
    std::span<float> span_;
  };
  Lease write(std::int64_t begin, std::int64_t end);
  Lease write_all() { return write(0, count_); }
  // The buffer, for the writers that report what they write themselves, range by range (Note
  // [Writes that report themselves]); nobody else.
  float* data_for_reporting_writers() { return buffer_->data(); }

  // The host image: read() copies the parameters into it and returns it; host() is the image
  // itself, to be filled and then written with to_backend(), which tells every model.
  const float* read();
  float* host();
  void to_backend();

  // What a writer reports: the parameters in [from, to) of data() changed, and whether it also
  // wrote the plain bf16 images over that range (plain_bf16_images()).
  enum class Images { kStale, kWritten };
  void changed(const float* from, const float* to, Images images = Images::kStale);
  void changed(std::int64_t begin, std::int64_t end) { changed(data() + begin, data() + end); }
  void changed_all() { changed(0, count_); }

  // The model state (null when state_count is 0), as the parameters: read() and host() its host
  // image, to_backend() to write it. Kernels keep no copy of it.
  float* state() { return state_ ? state_->data() : nullptr; }
  std::int64_t state_count() const { return state_count_; }
  std::span<float> state_span() { return {state(), static_cast<std::size_t>(state_count_)}; }
  const float* read_state();
  float* state_host();
  void state_to_backend();

  // The plain bf16 images of ranges of the parameters (LayerKernel::PlainCopy) that a writer may
  // write as it writes the parameters, in the buffer's order; empty in fp32 and on a GPU.
  std::span<const LayerKernel::PlainCopy> plain_bf16_images() const { return images_; }

 private:
  friend class Model;
  void attach(Model* model);
  void detach(Model* model);

  std::int64_t count_, state_count_;
  std::unique_ptr<Buffer> buffer_, state_;
  std::unique_ptr<HostCopy> host_, state_host_;
  std::vector<Model*> models_;
  std::vector<LayerKernel::PlainCopy> images_;
};

}  // namespace mnist_mpi
