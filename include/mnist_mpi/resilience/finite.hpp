// Finite-ness checks over flat float buffers: one vectorisable pass over the exponent bits, no
// branches per element. The trainer checks the reduced gradient of every step with all_finite();
// the checkpoint writer must check params_are_finite() before it writes (no checkpoint
// with non-finite parameters).
#pragma once

#include <cstdint>

namespace mnist_mpi {

// True when none of p[0, n) is NaN or +-inf.
bool all_finite(const float* p, std::int64_t n);
inline bool params_are_finite(const float* params, std::int64_t n) { return all_finite(params, n); }

}  // namespace mnist_mpi
