// The CPU backend's bf16 conversions (src/backend/cpu/bf16.cpp): one rounding for every copy of
// the weights, whether a pass, a refresh or the optimiser makes it (Note [Weight copies kept
// between passes] in bf16.cpp).
#pragma once

#include <bit>
#include <cstdint>

namespace mnist_mpi::cpu {

// Whether this CPU has AVX512-BF16 (CPUID.7.1:EAX[5]).
bool cpu_has_avx512_bf16();

// The bf16 of f as VCVTNEPS2BF16 makes it: rounded to nearest even, a denormal to a zero of its
// sign, a NaN quiet. Integer operations only, so that it vectorises for every ISA the optimiser's
// loop is built for; Bf16.TheRoundingIsTheInstructions checks it against the instruction.
inline std::uint16_t bf16_bits(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const std::uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u)  // NaN
                          : (u & 0x7f800000u) == 0        ? (u & 0x80000000u)  // zero, denormal
                                                          : rounded;
  return static_cast<std::uint16_t>(r >> 16);
}

// n floats to bf16, as bf16_bits (with the instruction where the CPU has it).
void to_bf16(const float* src, std::uint16_t* dst, std::int64_t n);

}  // namespace mnist_mpi::cpu
