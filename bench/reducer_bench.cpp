// reducer_bench: bus bandwidth of the reducer (lenet's gradient buffer cut into buckets, summed in
// rank order, Note [Sums in rank order]) against a bare MPI_Allreduce of the same total size, in
// the same run. busbw = algbw * 2 (n - 1) / n, as nccl-tests define it. Times are medians over the
// iterations of the slowest rank.
//   mpirun -np 2 build/reducer_bench [iterations]
// With --sizes, the time of one sum against its size instead (bench/network.sh fits its per-message
// and per-byte costs on each link, bench/scaling.py): the communicator's allreduce_sum, the one the
// reducer starts for each bucket, of 1 KB to 16 MB, a line each: "sum BYTES MEDIAN_MS".
//   mpirun -np 2 build/reducer_bench --sizes [iterations]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/train/reducer.hpp"

using namespace mnist_mpi;

namespace {
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The slowest rank's seconds for f(), the ranks started together.
template <class F>
double timed(F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  f();
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

// "sum BYTES MEDIAN_MS" for sums of 1 KB to 16 MB (x4 each time), the slowest rank's time.
void time_against_size(Communicator& comm, int iters) {
  std::vector<float> buf(4 * 1048576, 1.0f);
  for (std::size_t n = 256; n <= buf.size(); n *= 4) {
    const std::span<float> data(buf.data(), n);
    comm.allreduce_sum(data);  // warm-up
    std::vector<double> t(static_cast<std::size_t>(iters));
    for (double& ti : t) ti = timed([&] { comm.allreduce_sum(data); });
    if (comm.rank() == 0) std::printf("sum %zu %.4f\n", n * sizeof(float), 1e3 * median_of(t));
  }
}
}  // namespace

int main(int argc, char** argv) {
  mnist_mpi::init_mpi(&argc, &argv);
  const bool sizes = argc > 1 && std::strcmp(argv[1], "--sizes") == 0;
  const int arg = sizes ? 2 : 1;
  const int iters = argc > arg ? std::atoi(argv[arg]) : 20;
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  if (sizes) {
    time_against_size(*comm, iters);
    comm.reset();
    mnist_mpi::finalize_mpi();
    return 0;
  }
  const int n = comm->size();
  const ModelSpec spec = parse_model_spec(
      "conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10",
      Shape{1, 28, 28}, 10);
  std::vector<float> grads(static_cast<std::size_t>(spec.param_count), 1.0f);
  const double bytes = static_cast<double>(grads.size() * sizeof(float));
  const double bus = n > 1 ? 2.0 * (n - 1) / n : 1.0;
  // Every iteration times the bare MPI_Allreduce and then each reducer configuration back to back
  // (the slowest rank's time of each), so that a slow spell of these shared cores hits all of them
  // alike; the table shows medians over the iterations, and "vs MPI" is the median of the
  // per-iteration ratios. (Timing the configurations one block after another gave ratios that
  // moved by 0.3 between runs on this machine.)
  const double caps[] = {0.25, 1.0, 4.0, 25.0, 1000.0};
  constexpr int kConfigs = 5;
  std::vector<std::unique_ptr<Reducer>> reducers;
  for (double mb : caps) {
    const auto cap = static_cast<std::int64_t>(mb * 1048576.0 / sizeof(float));
    reducers.push_back(
        std::make_unique<Reducer>(*comm, grads, plan_buckets(spec, cap, std::min<std::int64_t>(cap, 262144)), true));
  }
  auto mpi_sum = [&] {
    MPI_Allreduce(MPI_IN_PLACE, grads.data(), static_cast<int>(grads.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  };
  auto reduce = [&](Reducer& red) {
    for (int layer = static_cast<int>(spec.layers.size()) - 1; layer >= 0; --layer) red.on_layer_done(layer);
    red.finish();
  };
  mpi_sum();  // warm-up
  for (auto& r : reducers) reduce(*r);
  std::vector<double> t_mpi(static_cast<std::size_t>(iters));
  std::vector<std::vector<double>> t_red(kConfigs, std::vector<double>(static_cast<std::size_t>(iters)));
  std::vector<std::vector<double>> ratio = t_red;
  for (int it = 0; it < iters; ++it) {
    const auto i = static_cast<std::size_t>(it);
    t_mpi[i] = timed(mpi_sum);
    for (int c = 0; c < kConfigs; ++c) {
      t_red[static_cast<std::size_t>(c)][i] = timed([&] { reduce(*reducers[static_cast<std::size_t>(c)]); });
      ratio[static_cast<std::size_t>(c)][i] = t_mpi[i] / t_red[static_cast<std::size_t>(c)][i];
    }
  }
  if (comm->rank() == 0) {
    const double tm = median_of(t_mpi);
    std::printf("lenet gradients: %.1f MB, %d ranks, median of %d iterations\n", bytes / 1048576.0, n, iters);
    std::printf("%-34s %9s %12s %12s %8s\n", "collective", "time ms", "algbw GB/s", "busbw GB/s", "vs MPI");
    std::printf("%-34s %9.2f %12.2f %12.2f %8.2f\n", "MPI_Allreduce (whole buffer)", 1e3 * tm, bytes / tm / 1e9,
                bytes / tm / 1e9 * bus, 1.0);
    for (int c = 0; c < kConfigs; ++c) {
      const double t = median_of(t_red[static_cast<std::size_t>(c)]);
      char name[64];
      std::snprintf(name, sizeof name, "reducer, %zu bucket(s) <= %g MB",
                    reducers[static_cast<std::size_t>(c)]->buckets().size(), caps[c]);
      std::printf("%-34s %9.2f %12.2f %12.2f %8.2f\n", name, 1e3 * t, bytes / t / 1e9, bytes / t / 1e9 * bus,
                  median_of(ratio[static_cast<std::size_t>(c)]));
    }
  }
  reducers.clear();
  comm.reset();
  mnist_mpi::finalize_mpi();
  return 0;
}
