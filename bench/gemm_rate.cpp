// The machine's limit for bench/compare.sh: the single-precision matrix-multiply rate of these
// cores, timed on oneDNN's sgemm (the library our kernels use) with a large square problem.
//
//   build/gemm_rate [--threads T] [--n N] [--seconds S]   -> one JSON line {"gflops": ...}
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  int threads = 1, n = 2048;
  double seconds = 2.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--threads")
      threads = std::atoi(argv[i + 1]);
    else if (a == "--n")
      n = std::atoi(argv[i + 1]);
    else if (a == "--seconds")
      seconds = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr, "gemm_rate: unknown option %s (use --threads T --n N --seconds S)\n", a.c_str());
      return 2;
    }
  }
  if (threads < 1 || n < 64 || seconds <= 0.0) {
    std::fprintf(stderr, "gemm_rate: --threads >= 1, --n >= 64, --seconds > 0\n");
    return 2;
  }
  omp_set_num_threads(threads);
  const auto sz = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  std::vector<float> a(sz), b(sz), c(sz, 0.0f);
  for (std::size_t i = 0; i < sz; ++i) {
    a[i] = static_cast<float>(i % 7) * 0.1f;
    b[i] = static_cast<float>(i % 5) * 0.1f;
  }
  const auto gemm = [&] { return dnnl_sgemm('N', 'N', n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n); };
  if (gemm() != dnnl_success) {
    std::fprintf(stderr, "gemm_rate: dnnl_sgemm failed\n");
    return 1;
  }
  // Best of several timed calls: the rate the cores reach, not the load of the moment.
  double best = 1e300, total = 0.0;
  int calls = 0;
  while (total < seconds || calls < 3) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt);
    total += dt;
    ++calls;
  }
  const double flop = 2.0 * n * static_cast<double>(n) * n;
  std::printf("{\"gflops\": %.2f, \"gflops_mean\": %.2f, \"threads\": %d, \"n\": %d, \"calls\": %d}\n",
              flop / best * 1e-9, flop * calls / total * 1e-9, threads, n, calls);
  return 0;
}
