// CRC32C (Castagnoli, the polynomial of iSCSI, ext4 and TFRecord): one checksum for every file
// format we write (checkpoints, TensorBoard event files). Software slice-by-8, no CPU features
// assumed, so it gives the same bits on every machine; ~1-2 GB/s, far above what we checksum. The
// data digest uses the SSE4.2 instruction where there is one (Note [A digest of the training data]).
#pragma once

#include <cstddef>
#include <cstdint>

namespace mnist_mpi {

// crc32c(data) for a whole buffer; pass the previous result as `crc` to continue a running one:
// crc32c(b, nb, crc32c(a, na)) == crc32c(a followed by b).
std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc = 0);

// Note [A digest of the training data]
// The ranks compare what they are about to train on (check_same_data() in
// include/mnist_mpi/comm/consistency.hpp), so each rank digests the decoded contents of its
// four MNIST files at start-up: 55 MB, which one CRC stream (one 3-cycle crc32 instruction per 8
// bytes, each waiting for the last) would take ~7 ms over, a few percent of lenet's start. The
// digest therefore runs four independent CRC32C streams, lane k taking the 8-byte words at offsets
// 32i + 8k (the tail's bytes go to lane 0), so the CPU overlaps them; the four CRCs and the length
// are mixed into 64 bits. It is not the CRC32C of the buffer, only a function of its bytes: with
// the SSE4.2 instruction or with the tables (any other CPU) it gives the same value, so ranks on
// different CPUs agree.
std::uint64_t content_digest(const void* data, std::size_t size);
// The same digest from the tables alone, whatever the CPU: what content_digest() must equal.
std::uint64_t content_digest_portable(const void* data, std::size_t size);

// TFRecord's masked form: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
inline std::uint32_t crc32c_masked(std::uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace mnist_mpi
