// libFuzzer target: the IDX reader (src/data/idx.cpp) on hostile files. The first byte picks the
// reader (images or labels) and the form: raw bytes, the bytes gzip-compressed by the harness
// (hostile content in a valid stream), or the bytes as a .gz file themselves (a hostile stream).
// Every outcome must be a value or an Error(kData): no crash, leak, hang or huge allocation.
#include <cstdint>

#include "fuzz_util.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/data/idx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const int mode = data[0] % 6;
  const bool images = mode % 2 == 0;
  const int form = mode / 2;  // 0 raw, 1 compressed here, 2 given as a .gz file
  const std::string name = std::string(images ? "images" : "labels") + (form == 0 ? "" : ".gz");
  const std::string path = mnist_mpi::fuzz::write_file(name, data + 1, size - 1, form == 1);
  try {
    if (images) {
      const mnist_mpi::IdxImages im = mnist_mpi::read_idx_images(path);
      if (im.pixels.size() != static_cast<std::size_t>(im.count) * static_cast<std::size_t>(im.rows * im.cols))
        __builtin_trap();  // a returned file must be as big as its header says
    } else {
      const mnist_mpi::IdxLabels lb = mnist_mpi::read_idx_labels(path, 10);
      if (lb.labels.size() != static_cast<std::size_t>(lb.count)) __builtin_trap();
      for (std::uint8_t v : lb.labels)
        if (v >= 10) __builtin_trap();
    }
  } catch (const mnist_mpi::Error& e) {
    if (e.code() != mnist_mpi::ExitCode::kData) __builtin_trap();
  }
  return 0;
}
