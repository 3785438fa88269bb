// The codecs a user picks by name (include/mnist_mpi/train/codec.hpp). The fixed-point codec is
// not among them: --exact-sums chooses it, with the chunked pipeline that makes its integers.
#include <string>

#include "mnist_mpi/bf16.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/codec.hpp"

namespace mnist_mpi {
namespace {

constexpr CodecRow kCodecs[] = {
    {"none", "the float gradients as they are", &float_codec, sizeof(float)},
    {"bf16", "bf16 on the wire (half the bytes), with error feedback", &bf16_codec, sizeof(Bf16)},
};

}  // namespace

const CodecRow& find_codec(std::string_view name) {
  std::string names;
  for (const CodecRow& row : kCodecs) {
    if (row.name == name) return row;
    names += (names.empty() ? "" : ", ") + std::string(row.name);
  }
  throw_error(ExitCode::kUsage, "unknown gradient codec '" + std::string(name) + "' (one of: " + names + ")");
}

}  // namespace mnist_mpi
