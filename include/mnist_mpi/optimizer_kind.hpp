// The optimisers the program knows, and what the rest of it needs to know of each: one row per
// kind. At the bottom of the tree (docs/style.md, "Layers"): the options, the model's memory
// estimate, the backends, the checkpoint format and the report all read it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace mnist_mpi {

enum class OptimizerKind : std::uint8_t { kAdam, kSgd, kLamb };

// A kind's row: its name (the --optimizer value and the text in messages), how many moment
// buffers of the parameters' size it keeps (state and checkpoint bytes), its code in the
// checkpoint format (docs/checkpoint.md: never reused, so an old file names the same optimiser),
// and whether its update needs every bucket's gradients before it may change a parameter (LAMB's
// per-tensor norms: Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp).
struct OptimizerTraits {
  OptimizerKind kind;
  const char* name;
  int moments;  // float buffers of the parameter count: sgd's momentum; adam's and lamb's m and v
  std::uint32_t checkpoint_code;
  bool two_phase;
};

inline constexpr OptimizerTraits kOptimizerTraits[] = {
    {OptimizerKind::kAdam, "adam", 2, 0, false},
    {OptimizerKind::kSgd, "sgd", 1, 1, false},
    {OptimizerKind::kLamb, "lamb", 2, 2, true},
};

constexpr const OptimizerTraits& traits(OptimizerKind k) {
  for (const OptimizerTraits& t : kOptimizerTraits)
    if (t.kind == k) return t;
  return kOptimizerTraits[0];  // unreachable: every kind has its row
}
inline const char* name_of(OptimizerKind k) { return traits(k).name; }
// The kind named `name`, or none.
inline std::optional<OptimizerKind> optimizer_kind_named(std::string_view name) {
  for (const OptimizerTraits& t : kOptimizerTraits)
    if (name == t.name) return t.kind;
  return std::nullopt;
}
// The kind stored as `code` in a checkpoint, or none.
inline std::optional<OptimizerKind> optimizer_kind_of_code(std::uint32_t code) {
  for (const OptimizerTraits& t : kOptimizerTraits)
    if (code == t.checkpoint_code) return t.kind;
  return std::nullopt;
}
// "adam | sgd | lamb": the names, for --help and messages.
inline std::string optimizer_names(const char* separator = " | ") {
  std::string s;
  for (const OptimizerTraits& t : kOptimizerTraits) s += (s.empty() ? "" : separator) + std::string(t.name);
  return s;
}

}  // namespace mnist_mpi
