// The protocol-buffers wire format (see include/mnist_mpi/report/protobuf.hpp): little-endian
// fixed-width fields, base-128 varints, and (tag, length, bytes) for strings and sub-messages.
#include "mnist_mpi/report/protobuf.hpp"

#include <bit>

namespace mnist_mpi {
namespace {

template <class U>
void put_le(std::string& out, U v) {  // little-endian, whatever the host's byte order
  for (std::size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

}  // namespace

void ProtoWriter::raw_varint(std::uint64_t v) {
  while (v >= 0x80u) {
    out_.push_back(static_cast<char>((v & 0x7fu) | 0x80u));
    v >>= 7;
  }
  out_.push_back(static_cast<char>(v));
}

void ProtoWriter::tag(int field, int wire_type) {
  raw_varint((static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint64_t>(wire_type));
}

void ProtoWriter::varint(int field, std::uint64_t v) {
  tag(field, 0);
  raw_varint(v);
}

void ProtoWriter::float64(int field, double v) {
  tag(field, 1);
  put_le(out_, std::bit_cast<std::uint64_t>(v));
}

void ProtoWriter::float32(int field, float v) {
  tag(field, 5);
  put_le(out_, std::bit_cast<std::uint32_t>(v));
}

void ProtoWriter::bytes(int field, std::string_view data) {
  tag(field, 2);
  raw_varint(data.size());
  out_.append(data);
}

}  // namespace mnist_mpi
