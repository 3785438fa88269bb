// Helpers shared by the libFuzzer targets: a private scratch directory per fuzzing process and a
// way to put the fuzzer's bytes into a file there (the readers under test take paths).
#pragma once

#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace mnist_mpi::fuzz {

inline const std::string& scratch_dir() {
  // Made once and never freed (still reachable, so not a leak): the exit handler that removes
  // the directory runs after static strings are gone.
  static const std::string* dir = [] {
    std::string tmpl = (std::filesystem::temp_directory_path() / "mnist_mpi_fuzz_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) std::abort();
    auto* d = new std::string(tmpl);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return d;
  }();
  return *dir;
}

// Writes bytes to scratch_dir()/name, as they are or gzip-compressed; returns the path.
inline std::string write_file(const std::string& name, const std::uint8_t* data, std::size_t size, bool gzip) {
  const std::string path = scratch_dir() + "/" + name;
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb1");
    if (f == nullptr) std::abort();
    if (size > 0 && gzwrite(f, data, static_cast<unsigned>(size)) != static_cast<int>(size)) std::abort();
    gzclose(f);
  } else {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) std::abort();
    if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
    std::fclose(f);
  }
  return path;
}

}  // namespace mnist_mpi::fuzz
