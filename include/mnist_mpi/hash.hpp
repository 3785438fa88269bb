// The one hash of the program: 64-bit FNV-1a over bytes. Equal hashes of parameters mean
// bitwise-equal parameters for all practical purposes (params_hash); equal hashes of a text mean
// the same job description or host name. The replica check, every 100 steps by default, uses the
// faster content_digest (include/mnist_mpi/crc32c.hpp) instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mnist_mpi {

constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ULL;

inline std::uint64_t fnv1a(const void* data, std::size_t bytes, std::uint64_t h = kFnvOffset) {
  const auto* b = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    h ^= b[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

inline std::uint64_t fnv1a(std::string_view s) { return fnv1a(s.data(), s.size()); }

// The bytes of n floats: what params_hash and the replica check compare.
inline std::uint64_t hash_floats(const float* p, std::int64_t n) {
  return fnv1a(p, static_cast<std::size_t>(n) * sizeof(float));
}

// 16 lower-case hex digits.
std::string hex64(std::uint64_t v);

}  // namespace mnist_mpi
