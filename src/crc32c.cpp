// CRC32C by slice-by-8 tables built once at first use, and the four-lane data digest (see
// include/mnist_mpi/crc32c.hpp).
#include "mnist_mpi/crc32c.hpp"

#include <array>
#include <cstring>

namespace mnist_mpi {
namespace {

using Tables = std::array<std::array<std::uint32_t, 256>, 8>;
const Tables& tables();

Tables make_tables() {
  constexpr std::uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial
  Tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t s = 1; s < 8; ++s)
    for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

// One CRC32C step over 8 bytes, with no inversion: what the SSE4.2 crc32 instruction computes.
inline std::uint32_t step8(const Tables& t, std::uint32_t c, std::uint64_t word) {
  const std::uint32_t lo = static_cast<std::uint32_t>(word) ^ c, hi = static_cast<std::uint32_t>(word >> 32);
  return t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^ t[3][hi & 0xffu] ^
         t[2][(hi >> 8) & 0xffu] ^ t[1][(hi >> 16) & 0xffu] ^ t[0][hi >> 24];
}

using Lanes = std::array<std::uint32_t, 4>;

// The four lanes over whole 32-byte blocks (Note [A digest of the training data]).
void lanes_portable(const unsigned char* p, std::size_t blocks, Lanes& c) {
  const Tables& t = tables();
  for (std::size_t b = 0; b < blocks; ++b, p += 32)
    for (std::size_t k = 0; k < 4; ++k) {
      std::uint64_t w;
      std::memcpy(&w, p + 8 * k, 8);
      c[k] = step8(t, c[k], w);
    }
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) void lanes_sse42(const unsigned char* p, std::size_t blocks, Lanes& c) {
  std::uint64_t c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
  for (std::size_t b = 0; b < blocks; ++b, p += 32) {
    std::uint64_t w[4];
    std::memcpy(w, p, 32);
    c0 = __builtin_ia32_crc32di(c0, w[0]);
    c1 = __builtin_ia32_crc32di(c1, w[1]);
    c2 = __builtin_ia32_crc32di(c2, w[2]);
    c3 = __builtin_ia32_crc32di(c3, w[3]);
  }
  c = {static_cast<std::uint32_t>(c0), static_cast<std::uint32_t>(c1), static_cast<std::uint32_t>(c2),
       static_cast<std::uint32_t>(c3)};
}
#endif

std::uint64_t mix64(std::uint64_t x) {  // splitmix64's finaliser
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint64_t digest(const unsigned char* p, std::size_t size, bool portable) {
  const std::size_t blocks = size / 32;
  Lanes c{~0u, ~0u, ~0u, ~0u};
#if defined(__x86_64__)
  static const bool sse42 = __builtin_cpu_supports("sse4.2");
  if (sse42 && !portable)
    lanes_sse42(p, blocks, c);
  else
#endif
    lanes_portable(p, blocks, c);
  (void)portable;
  c[0] = ~crc32c(p + blocks * 32, size - blocks * 32, ~c[0]);  // the tail, continuing lane 0
  const std::uint64_t a = c[0] | (std::uint64_t{c[1]} << 32), b = c[2] | (std::uint64_t{c[3]} << 32);
  return mix64(a ^ mix64(b ^ mix64(size)));
}

}  // namespace

std::uint64_t content_digest(const void* data, std::size_t size) {
  return digest(static_cast<const unsigned char*>(data), size, false);
}

std::uint64_t content_digest_portable(const void* data, std::size_t size) {
  return digest(static_cast<const unsigned char*>(data), size, true);
}

std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc) {
  const Tables& t = tables();
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  while (size >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian hosts only (x86-64, aarch64)
    c = step8(t, c, word);
    p += 8;
    size -= 8;
  }
  while (size-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xffu];
  return ~c;
}

}  // namespace mnist_mpi
