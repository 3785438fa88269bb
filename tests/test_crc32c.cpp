// CRC32C against published check values (RFC 3720 appendix B.4 and the "123456789" check value),
// continuation of a running checksum, and the TFRecord mask.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mnist_mpi/crc32c.hpp"

namespace mnist_mpi {
namespace {

TEST(Crc32c, KnownVectors) {
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(check.data(), check.size()), 0xe3069283u);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
  std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xff), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[static_cast<std::size_t>(i)] = static_cast<unsigned char>(i);
    dec[static_cast<std::size_t>(i)] = static_cast<unsigned char>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8a9136aau);  // RFC 3720 B.4
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62a8ab43u);
  EXPECT_EQ(crc32c(inc.data(), inc.size()), 0x46dd794eu);
  EXPECT_EQ(crc32c(dec.data(), dec.size()), 0x113fdb5cu);
}

TEST(Crc32c, RunningChecksumEqualsWhole) {
  std::vector<unsigned char> buf(1000);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 131 + 7);
  const std::uint32_t whole = crc32c(buf.data(), buf.size());
  for (std::size_t cut : {0u, 1u, 7u, 8u, 9u, 500u, 999u, 1000u})
    EXPECT_EQ(crc32c(buf.data() + cut, buf.size() - cut, crc32c(buf.data(), cut)), whole) << cut;
}

TEST(Crc32c, TfRecordMask) {
  // mask(0) = 0xa282ead8; mask(1) = (1 << 17) + 0xa282ead8.
  EXPECT_EQ(crc32c_masked(0u), 0xa282ead8u);
  EXPECT_EQ(crc32c_masked(1u), 0xa282ead8u + (1u << 17));
}

}  // namespace
}  // namespace mnist_mpi
