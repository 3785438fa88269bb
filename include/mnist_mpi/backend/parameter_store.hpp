// The flat parameters of a run, their host image, and the copies that the backend's kernels keep
// of them: where the writers of the parameters and the kernels that read them meet, so that no
// caller of a model or an optimiser deals with a kernel's copy.
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
//   - whatever writes the parameters writes them through the store or says what it wrote:
//     changed() for a range of the backend's buffer, to_backend() for the host image, the
//     optimiser's pass for its ranges (Backend::make_optimizer_pass is given the store);
//   - each kernel decides what a change means for its copy: a training model's fc converts the
//     range while it is in cache, a convolution marks its copy to be made whole by its next pass,
//     an evaluation model's kernels mark theirs to be made at the next evaluation;
//   - a writer that can write a plain bf16 image in the same pass as the parameters (the CPU's
//     optimiser pass) asks for the images over its range (plain_bf16_images()) and then reports
//     changed(..., kImagesWritten), which leaves those images alone.
// A model built on a bare pointer has no store to tell it anything, so its kernels make their
// copies at every pass (what a test that changes the parameters between passes needs).
class ParameterStore {
 public:
  // count zero-filled parameters in the backend's memory, with a host image of them.
  ParameterStore(Backend& backend, std::int64_t count);
  ParameterStore(const ParameterStore&) = delete;
  ParameterStore& operator=(const ParameterStore&) = delete;
  ~ParameterStore();

  float* data() { return buffer_->data(); }
  const float* data() const { return buffer_->data(); }
  std::int64_t count() const { return count_; }
  std::span<float> span() { return {data(), static_cast<std::size_t>(count_)}; }

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

  // The plain bf16 images of ranges of the parameters (LayerKernel::PlainCopy) that a writer may
  // write as it writes the parameters, in the buffer's order; empty in fp32 and on a GPU.
  std::span<const LayerKernel::PlainCopy> plain_bf16_images() const { return images_; }

 private:
  friend class Model;
  void attach(Model* model);
  void detach(Model* model);

  std::int64_t count_;
  std::unique_ptr<Buffer> buffer_;
  std::unique_ptr<HostCopy> host_;
  std::vector<Model*> models_;
  std::vector<LayerKernel::PlainCopy> images_;
};

}  // namespace mnist_mpi
