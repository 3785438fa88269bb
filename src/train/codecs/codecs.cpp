// The codecs a user picks by name (include/mnist_mpi/train/codec.hpp). The fixed-point codec is
// not among them: --exact-sums chooses it, with the chunked pipeline that makes its integers.
#include <charconv>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/codec.hpp"

namespace mnist_mpi {
namespace {

constexpr CodecRow kCodecs[] = {
    {"none", "the float gradients as they are", [](const CodecArgs&) { return float_codec(); }, 0},
    {"bf16", "bf16 on the wire (half the bytes), with error feedback", [](const CodecArgs&) { return bf16_codec(); },
     0},
    {"powersgd", "each weight matrix as two rank-RANK factors (powersgd:RANK, default 2), with error feedback",
     [](const CodecArgs& a) { return powersgd_codec(a.rank, a.start_step, a.seed, a.tensors); }, 2, true},
    {"auto", "per bucket none, bf16 or powersgd:RANK, chosen from the measured link and backward's timing",
     &auto_codec, 2, true},
};

}  // namespace

CodecChoice find_codec(std::string_view text) {
  const std::size_t colon = text.find(':');
  const std::string_view name = text.substr(0, colon);
  std::string names;
  for (const CodecRow& row : kCodecs) {
    names += (names.empty() ? "" : ", ") + std::string(row.name) + (row.default_rank > 0 ? "[:RANK]" : "");
    if (row.name != name) continue;
    if (colon == std::string_view::npos) return {&row, row.default_rank};
    const std::string_view digits = text.substr(colon + 1);
    int rank = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
    MNIST_CHECK(row.default_rank > 0, ExitCode::kUsage,
                "--grad-compression " + std::string(text) + ": " + std::string(name) + " takes no rank");
    MNIST_CHECK(ec == std::errc() && end == digits.data() + digits.size() && rank >= 1 && rank <= kMaxPowerSgdRank,
                ExitCode::kUsage,
                "--grad-compression " + std::string(text) + ": the rank must be a whole number from 1 to " +
                    std::to_string(kMaxPowerSgdRank) + " (" + std::string(name) + ":2, say)");
    return {&row, rank};
  }
  throw_error(ExitCode::kUsage, "unknown gradient codec '" + std::string(text) + "' (one of: " + names + ")");
}

}  // namespace mnist_mpi
