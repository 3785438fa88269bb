// What the ranks' data comparison costs at start-up (Note [A digest of the training data] in
// include/mnist_mpi/crc32c.hpp): load_mnist() of a directory (read, decode, check, digest), and
// on a copy of its images the four-lane digest against the tables-only digest and one CRC32C
// stream, in alternating rounds. Prediction written before it ran: the digest is memory-bound at
// some 10-30 GB/s, ~2-5 ms for MNIST's 55 MB, under 5 % of lenet's start-up.
//
//   build/digest_rate [DATA_DIR] [--rounds R]   -> one JSON line: medians in ms, and GB/s of each
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mnist_mpi/crc32c.hpp"
#include "mnist_mpi/data/idx.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "data/mnist";
  int rounds = 7;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
      rounds = std::max(1, std::atoi(argv[++i]));
    else
      dir = argv[i];
  }
  std::vector<double> load, digest, portable, crc;
  std::size_t bytes = 0;
  volatile std::uint64_t sink = 0;
  for (int r = 0; r < rounds; ++r) {
    auto t = Clock::now();
    const mnist_mpi::Mnist m = mnist_mpi::load_mnist(dir, 5000, 0);
    load.push_back(ms_since(t));
    std::vector<std::uint8_t> all(m.train.pixels);
    all.insert(all.end(), m.validation.pixels.begin(), m.validation.pixels.end());
    all.insert(all.end(), m.test.pixels.begin(), m.test.pixels.end());
    bytes = all.size();
    t = Clock::now();
    sink = sink + mnist_mpi::content_digest(all.data(), all.size());
    digest.push_back(ms_since(t));
    t = Clock::now();
    sink = sink + mnist_mpi::content_digest_portable(all.data(), all.size());
    portable.push_back(ms_since(t));
    t = Clock::now();
    sink = sink + mnist_mpi::crc32c(all.data(), all.size());
    crc.push_back(ms_since(t));
  }
  const auto gbs = [&](double ms) { return static_cast<double>(bytes) / ms / 1e6; };
  std::printf(
      "{\"bytes\": %zu, \"rounds\": %d, \"load_mnist_ms\": %.2f, \"digest_ms\": %.2f, \"digest_gb_s\": %.1f, "
      "\"digest_portable_ms\": %.2f, \"digest_portable_gb_s\": %.1f, \"crc32c_ms\": %.2f, \"crc32c_gb_s\": %.1f}\n",
      bytes, rounds, median(load), median(digest), gbs(median(digest)), median(portable), gbs(median(portable)),
      median(crc), gbs(median(crc)));
  return sink == 42 ? 1 : 0;  // keeps the sums
}
