// How a run makes and sums each step's gradient, chosen once from the plan: the summed mode (each
// rank's micro-batches, its buckets in the codec the options name; src/train/gradient_pipeline.cpp)
// or --exact-sums's (the global batch's chunks in 64-bit fixed point and the fixed-point codec;
// src/train/exact_pipeline.cpp, include/mnist_mpi/train/exact_sums.hpp). The rig asks the mode for
// its parts and for what a checkpoint keeps of it, and names no mode itself.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "mnist_mpi/backend/backend.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/train/codec.hpp"
#include "mnist_mpi/train/gradient_pipeline.hpp"
#include "mnist_mpi/train/run_plan.hpp"

namespace mnist_mpi {

class GradientMode {
 public:
  virtual ~GradientMode() = default;
  virtual CodecFactory codec() const = 0;  // each bucket's codec
  // The pipeline of the step (made once, on the step's parts).
  virtual std::unique_ptr<GradientPipeline> pipeline(const StepParts& parts, const StepShape& shape) = 0;
  virtual double reduced_bytes() const = 0;  // summed per step; 0: the codecs say (Reducer::wire_bytes)
  // What a checkpoint keeps of the mode (the exact sums' limits of the next step; none summed) and
  // puts back at resume.
  virtual std::span<const std::int32_t> limits() const { return {}; }
  virtual void restore_limits(std::span<const std::int32_t> /*limits*/) {}
  virtual std::int64_t probes() const { return 0; }  // steps computed again (the "final" event's)
};

// The mode of the plan (RunPlan::chunks() > 0: the exact sums), its buffers in the backend's memory.
// report: told what --grad-compression auto chose (may be empty).
std::unique_ptr<GradientMode> make_gradient_mode(const Options& options, const RunPlan& plan, const ModelSpec& spec,
                                                 Backend& backend, CodecReport report = {});
// The exact sums' mode (src/train/exact_pipeline.cpp).
std::unique_ptr<GradientMode> make_exact_mode(const RunPlan& plan, const ModelSpec& spec, Backend& backend);

}  // namespace mnist_mpi
