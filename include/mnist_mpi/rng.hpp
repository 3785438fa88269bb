// Counter-based random numbers: a value is a pure function of its keys, never of a stream's
// history. See Note [Dropout masks do not depend on the rank] in src/backend/cpu/dropout.cpp.
// Used for the sampler's permutation, parameter initialisation and dropout masks.
#pragma once

#include <cstdint>

namespace mnist_mpi::rng {

// splitmix64's finaliser: a bijective 64-bit mix with good avalanche.
inline std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Hash of an ordered tuple of keys.
inline std::uint64_t key(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0, std::uint64_t d = 0,
                         std::uint64_t e = 0) {
  std::uint64_t h = mix(a);
  h = mix(h ^ b);
  h = mix(h ^ c);
  h = mix(h ^ d);
  return mix(h ^ e);
}

// Uniform in [0, 1) with 24 bits: exact in float.
inline float uniform(std::uint64_t h) { return static_cast<float>(h >> 40) * (1.0f / 16777216.0f); }
// Uniform in (0, 1) with 53 bits.
inline double uniform_open(std::uint64_t h) { return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

}  // namespace mnist_mpi::rng
