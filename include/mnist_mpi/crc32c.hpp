// CRC32C (Castagnoli, the polynomial of iSCSI, ext4 and TFRecord): one checksum for every file
// format we write (checkpoints, TensorBoard event files). Software slice-by-8, no CPU features
// assumed, so it gives the same bits on every machine; ~1-2 GB/s, far above what we checksum.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mnist_mpi {

// crc32c(data) for a whole buffer; pass the previous result as `crc` to continue a running one:
// crc32c(b, nb, crc32c(a, na)) == crc32c(a followed by b).
std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc = 0);

// TFRecord's masked form: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
inline std::uint32_t crc32c_masked(std::uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace mnist_mpi
