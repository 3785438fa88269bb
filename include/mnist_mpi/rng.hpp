// Counter-based random numbers: a value is a pure function of its keys, never of a stream's
// history. See Note [Dropout masks do not depend on the rank] in src/backend/cpu/dropout.cpp.
// Used for the sampler's permutation, parameter initialisation and dropout masks. The same
// functions compile for the host and for CUDA devices (MNIST_MPI_HD), so both backends draw the
// same dropout masks bit for bit.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MNIST_MPI_HD __host__ __device__
#else
#define MNIST_MPI_HD
#endif

namespace mnist_mpi::rng {

// splitmix64's finaliser: a bijective 64-bit mix with good avalanche.
MNIST_MPI_HD inline std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Hash of an ordered tuple of keys.
MNIST_MPI_HD inline std::uint64_t key(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0, std::uint64_t d = 0,
                                      std::uint64_t e = 0) {
  std::uint64_t h = mix(a);
  h = mix(h ^ b);
  h = mix(h ^ c);
  h = mix(h ^ d);
  return mix(h ^ e);
}

// Uniform in [0, 1) with 24 bits: exact in float.
MNIST_MPI_HD inline float uniform(std::uint64_t h) { return static_cast<float>(h >> 40) * (1.0f / 16777216.0f); }
// Uniform in (0, 1) with 53 bits.
MNIST_MPI_HD inline double uniform_open(std::uint64_t h) {
  return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Dropout, on both backends (Note [Dropout masks do not depend on the rank]): the key of one
// sample's mask, from the seed, the global step, the sample's position in the global batch and
// the layer index; and element i's scale within that sample: 0 (dropped) or keep_scale.
MNIST_MPI_HD inline std::uint64_t dropout_key(std::uint64_t seed, std::int64_t step, std::int64_t position, int layer) {
  return key(seed, 0xD80, static_cast<std::uint64_t>(step), static_cast<std::uint64_t>(position),
             static_cast<std::uint64_t>(layer));
}
MNIST_MPI_HD inline float dropout_scale(std::uint64_t sample_key, std::int64_t i, float rate, float keep_scale) {
  return uniform(mix(sample_key ^ static_cast<std::uint64_t>(i))) >= rate ? keep_scale : 0.0f;
}

}  // namespace mnist_mpi::rng
