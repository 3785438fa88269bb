// The one JSON writer (see include/mnist_mpi/json.hpp).
#include "mnist_mpi/json.hpp"

#include <cmath>
#include <cstdint>

namespace mnist_mpi {

Json json_number(double v) {
  if (!std::isfinite(v)) return nullptr;
  // Below 2^53 every whole double is an exact int64 (and beyond it nlohmann's "1e+300" is shorter).
  if (v == std::trunc(v) && std::fabs(v) < 0x1p53) return static_cast<std::int64_t>(v);
  return v;
}

std::string json_text(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace mnist_mpi
