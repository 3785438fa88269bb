// bfloat16: a float's sign, exponent and top 7 bits of mantissa, in 16 bits. One rounding for the
// whole program (the CPU kernels' weight copies, the bf16 gradient codec), with integer
// operations only, so that it vectorises for every ISA a loop is built for.
#pragma once

#include <bit>
#include <cstdint>

namespace mnist_mpi {

// The bf16 of f as VCVTNEPS2BF16 makes it: rounded to nearest even, a denormal to a zero of its
// sign, a NaN quiet. Bf16.TheRoundingIsTheInstructions checks it against the instruction.
inline std::uint16_t bf16_bits(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const std::uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u)  // NaN
                          : (u & 0x7f800000u) == 0        ? (u & 0x80000000u)  // zero, denormal
                                                          : rounded;
  return static_cast<std::uint16_t>(r >> 16);
}

inline float bf16_to_float(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

// A bf16 value as a collective moves it (ElementType::kBFloat16 in include/mnist_mpi/comm/communicator.hpp):
// the bits, and the sum of two (each addition rounded to bf16, as a bf16 adder does).
struct Bf16 {
  std::uint16_t bits = 0;
  Bf16& operator+=(Bf16 o) {
    bits = bf16_bits(bf16_to_float(bits) + bf16_to_float(o.bits));
    return *this;
  }
};

}  // namespace mnist_mpi

namespace mnist_mpi {

// The hot loops of bf16 on the wire (src/bf16.cpp, built as CPU clones): out[i] += in[i], each
// addition rounded to bf16 (Bf16::operator+=); and the bf16 codec's encoding with error feedback
// (Note [bf16 on the wire with error feedback] in src/train/codecs/bf16_codec.cpp):
// wire[i] = bf16(g[i] + e[i]), e[i] = what the rounding left out (0 where that is not finite).
void bf16_add(Bf16* out, const Bf16* in, std::int64_t n);
void bf16_encode_with_feedback(const float* g, float* e, Bf16* wire, std::int64_t n);
// grads[i] = float(wire[i]).
void bf16_decode(const Bf16* wire, float* grads, std::int64_t n);

}  // namespace mnist_mpi
