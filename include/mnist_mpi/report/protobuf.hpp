// A minimal protocol-buffers encoder (wire format only: varints, fixed32/fixed64, length-delimited
// fields), enough for TensorBoard's Event and Summary messages without a protobuf dependency.
// Nested messages are encoded into their own ProtoWriter and added with bytes().
//
//   ProtoWriter value; value.string(1, "train/loss"); value.float32(2, 0.25f);
//   ProtoWriter summary; summary.bytes(1, value.data());   // Summary { repeated Value value = 1; }
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace mnist_mpi {

class ProtoWriter {
 public:
  void varint(int field, std::uint64_t v);  // wire type 0 (int64, uint64, bool, enum)
  void int64(int field, std::int64_t v) { varint(field, static_cast<std::uint64_t>(v)); }
  void float64(int field, double v);             // wire type 1 (double)
  void float32(int field, float v);              // wire type 5 (float)
  void bytes(int field, std::string_view data);  // wire type 2 (string, bytes, nested message)
  void string(int field, std::string_view s) { bytes(field, s); }

  const std::string& data() const { return out_; }
  void clear() { out_.clear(); }

 private:
  void tag(int field, int wire_type);
  void raw_varint(std::uint64_t v);
  std::string out_;
};

}  // namespace mnist_mpi
