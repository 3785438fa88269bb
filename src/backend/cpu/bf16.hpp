// The CPU backend's bf16 conversions (src/backend/cpu/bf16.cpp): one rounding for every copy of
// the weights, whether a pass, a refresh or the optimiser makes it (Note [Weight copies kept
// between passes] in bf16.cpp).
#pragma once

#include <cstdint>

#include "mnist_mpi/bf16.hpp"

namespace mnist_mpi::cpu {

// Whether this CPU has AVX512-BF16 (CPUID.7.1:EAX[5]).
bool cpu_has_avx512_bf16();

using ::mnist_mpi::bf16_bits;  // the one rounding (include/mnist_mpi/bf16.hpp)

// n floats to bf16, as bf16_bits (with the instruction where the CPU has it).
void to_bf16(const float* src, std::uint16_t* dst, std::int64_t n);

}  // namespace mnist_mpi::cpu
