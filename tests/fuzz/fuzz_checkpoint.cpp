// libFuzzer target: the checkpoint reader (src/checkpoint/checkpoint.cpp) on hostile files. The first
// byte picks the way in: the decoder on the bytes as they are; the decoder after the harness has
// recomputed every CRC32C (so that mutations get past the checksums and reach the fields behind
// them); or the cheap META-only reader on the bytes written to a file. Every outcome must be a
// checkpoint or an Error(kCheckpoint): no crash, leak, hang or huge allocation.
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_util.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/checkpoint/checkpoint.hpp"
#include "mnist_mpi/crc32c.hpp"

namespace {

std::uint64_t le64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
void put32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

// The layout of docs/checkpoint.md: a 16-byte header (magic, version, crc of both), then sections
// of tag[4], u32 crc(tag, length, payload), u64 length, payload, zero padding to 8 bytes.
void fix_crcs(std::vector<std::uint8_t>& b) {
  if (b.size() < 16) return;
  put32(b.data() + 12, mnist_mpi::crc32c(b.data(), 12));
  std::size_t at = 16;
  while (at + 16 <= b.size()) {
    const std::uint64_t len = le64(b.data() + at + 8);
    if (len > b.size() - at - 16) break;
    std::uint32_t c = mnist_mpi::crc32c(b.data() + at, 4);
    c = mnist_mpi::crc32c(b.data() + at + 8, 8, c);
    c = mnist_mpi::crc32c(b.data() + at + 16, static_cast<std::size_t>(len), c);
    put32(b.data() + at + 4, c);
    at += 16 + static_cast<std::size_t>((len + 7) / 8 * 8);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const int mode = data[0] % 3;
  std::vector<std::uint8_t> bytes(data + 1, data + size);
  try {
    if (mode == 2) {
      const std::string path = mnist_mpi::fuzz::write_file("fuzz.ckpt", bytes.data(), bytes.size(), false);
      mnist_mpi::read_checkpoint_meta(path);
    } else {
      if (mode == 1) fix_crcs(bytes);
      const mnist_mpi::Checkpoint ck = mnist_mpi::decode_checkpoint(bytes, "fuzz.ckpt");
      if (ck.params.size() * sizeof(float) > bytes.size()) __builtin_trap();  // decoded data come from the file
    }
  } catch (const mnist_mpi::Error& e) {
    if (e.code() != mnist_mpi::ExitCode::kCheckpoint) __builtin_trap();
  }
  return 0;
}
