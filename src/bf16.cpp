// The hot loops of bf16 on the wire (include/mnist_mpi/bf16.hpp): elementwise, without branches,
// built for AVX-512, AVX2 and the baseline (Note [One build for every x86-64] in
// include/mnist_mpi/cpu_clones.hpp), which give the same bits (integer rounding, no FMA).
#include "mnist_mpi/bf16.hpp"

#include "mnist_mpi/cpu_clones.hpp"

namespace mnist_mpi {

MNIST_MPI_CPU_CLONES void bf16_add(Bf16* __restrict out, const Bf16* __restrict in, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    out[i].bits = bf16_bits(bf16_to_float(out[i].bits) + bf16_to_float(in[i].bits));
}

MNIST_MPI_CPU_CLONES void bf16_encode_with_feedback(const float* __restrict g, float* __restrict e,
                                                    Bf16* __restrict wire, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = g[i] + e[i];
    const std::uint16_t b = bf16_bits(v);
    wire[i].bits = b;
    const float left = v - bf16_to_float(b);
    const bool finite = (std::bit_cast<std::uint32_t>(left) & 0x7f800000u) != 0x7f800000u;
    e[i] = finite ? left : 0.0f;
  }
}

MNIST_MPI_CPU_CLONES void bf16_decode(const Bf16* __restrict wire, float* __restrict grads, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) grads[i] = bf16_to_float(wire[i].bits);
}

}  // namespace mnist_mpi
