// `mnist_mpi export --checkpoint FILE --onnx model.onnx`: a checkpoint's model as an ONNX graph
// for inference (opset 13), built with ONNX's own protobuf classes, checked with ONNX's checker and
// strict shape inference before it is written. The graph, its names and its metadata keys are
// described in docs/model_use.md; nothing here runs the model (tests/check_onnx.py does, on its own).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mnist_mpi/checkpoint/checkpoint.hpp"
#include "mnist_mpi/model/spec.hpp"

namespace mnist_mpi {

inline constexpr std::int64_t kOnnxOpset = 13;
// One ONNX file is one protobuf message, which cannot exceed 2 GiB; the weights plus a margin for
// the graph must fit under it (the external-data form of ONNX is not written).
inline constexpr std::int64_t kOnnxMaxBytes = (std::int64_t{1} << 31) - (std::int64_t{1} << 20);

// Throws Error(kUsage) naming the first layer the ONNX file cannot hold. Every layer kind of the
// spec language maps to ONNX operators; what can fail is the size of one protobuf file.
void check_onnx_exportable(const ModelSpec& spec);  // defined in builds with ONNX only

struct OnnxExport {
  std::string bytes;                 // the serialized ModelProto
  int nodes = 0;                     // operators in the graph
  std::vector<std::string> dropped;  // layers left out of an inference graph: "9 dropout:0.5"
};

// The checkpoint's model as ONNX (Error kCheckpoint when the tensors do not match its spec,
// kUsage from check_onnx_exportable, kRuntime if ONNX's checker refuses what was built).
OnnxExport export_onnx(const Checkpoint& ck);

// The subcommand; argv[0] is "export". Returns the exit code (messages printed here).
int export_onnx_main(int argc, char** argv);

}  // namespace mnist_mpi
