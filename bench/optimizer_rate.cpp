// Is the optimiser pass memory-bound? Times the fused Adam pass (the CPU backend's OptimizerPass,
// src/backend/cpu/optimizer.cpp) over lenet's 3,274,634 parameters against a pass with the same memory
// traffic and no arithmetic to speak of (4 streams read, 3 written, one add per stream), in
// alternating rounds on this thread.
//
//   build/optimizer_rate [--n N] [--rounds R]   -> one JSON line: medians in ms, GB/s of each
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mnist_mpi/backend/optimizer_pass.hpp"

namespace {

// The same loads and stores as Adam (p, g, m, v read; p, m, v written), one add each.
__attribute__((noinline)) void stream_pass(float* __restrict p, const float* __restrict g, float* __restrict m,
                                           float* __restrict v, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] += g[i];
    v[i] += g[i];
    p[i] += g[i];
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t n = 3274634;  // lenet's parameters
  int rounds = 30;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--n")
      n = std::atoll(argv[i + 1]);
    else if (a == "--rounds")
      rounds = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "optimizer_rate: unknown option %s (use --n N --rounds R)\n", a.c_str());
      return 2;
    }
  }
  if (n < 1024 || rounds < 3) {
    std::fprintf(stderr, "optimizer_rate: --n >= 1024, --rounds >= 3\n");
    return 2;
  }
  const auto sz = static_cast<std::size_t>(n);
  std::vector<float> p(sz), g(sz), m(sz, 0.0f), v(sz, 0.0f);
  for (std::size_t i = 0; i < sz; ++i) {
    p[i] = static_cast<float>(i % 1000) * 1e-4f;
    g[i] = static_cast<float>(i % 77) * 1e-5f - 3e-4f;
  }
  mnist_mpi::OptimizerConfig cfg;  // adam, PyTorch's defaults
  const auto pass = mnist_mpi::make_host_optimizer_pass(cfg);
  std::vector<double> adam, stream;
  using clock = std::chrono::steady_clock;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = clock::now();
    pass->begin_step(1e-3);  // the step's scalars, as the trainer's step computes them
    pass->update(p.data(), g.data(), m.data(), v.data(), n);
    auto t1 = clock::now();
    stream_pass(p.data(), g.data(), m.data(), v.data(), n);
    auto t2 = clock::now();
    adam.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    stream.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  const double bytes = 7.0 * sizeof(float) * static_cast<double>(n);
  const double a = median(adam), s = median(stream);
  std::printf(
      "{\"n\": %lld, \"rounds\": %d, \"adam_ms\": %.3f, \"stream_ms\": %.3f, \"adam_gb_s\": %.2f, "
      "\"stream_gb_s\": %.2f, \"adam_over_stream\": %.3f, \"check\": %g}\n",
      static_cast<long long>(n), rounds, a, s, bytes / a / 1e6, bytes / s / 1e6, a / s, p[sz / 3]);
  return 0;
}
