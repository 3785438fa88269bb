// reducer_bench: bus bandwidth of the reducer (lenet's gradient buffer cut into buckets, summed in
// rank order, Note [Sums in rank order]) against a bare MPI_Allreduce of the same total size, in
// the same run. busbw = algbw * 2 (n - 1) / n, as nccl-tests define it. Times are medians over the
// iterations of the slowest rank.
//   mpirun -np 2 build/bench/reducer_bench [iterations]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/model/spec.hpp"
#include "mnist_mpi/train/reducer.hpp"

using namespace mnist_mpi;

int main(int argc, char** argv) {
  mnist_mpi::init_mpi(&argc, &argv);
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const int n = comm->size();
  const ModelSpec spec = parse_model_spec(
      "conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10",
      Shape{1, 28, 28}, 10);
  std::vector<float> grads(static_cast<std::size_t>(spec.param_count), 1.0f);
  const double bytes = static_cast<double>(grads.size() * sizeof(float));
  const double bus = n > 1 ? 2.0 * (n - 1) / n : 1.0;
  // The median over iterations of the slowest rank's time: one iteration disturbed by another
  // process on these shared cores does not move it.
  std::vector<double> times(static_cast<std::size_t>(iters));
  auto time_it = [&](auto&& f) {
    f();  // warm-up
    for (double& t : times) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = std::chrono::steady_clock::now();
      f();
      t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  const double t_mpi = time_it([&] {
    MPI_Allreduce(MPI_IN_PLACE, grads.data(), static_cast<int>(grads.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  });
  if (comm->rank() == 0) {
    std::printf("lenet gradients: %.1f MB, %d ranks, median of %d iterations\n", bytes / 1048576.0, n, iters);
    std::printf("%-34s %9s %12s %12s %8s\n", "collective", "time ms", "algbw GB/s", "busbw GB/s", "vs MPI");
    std::printf("%-34s %9.2f %12.2f %12.2f %8.2f\n", "MPI_Allreduce (whole buffer)", 1e3 * t_mpi,
                bytes / t_mpi / 1e9, bytes / t_mpi / 1e9 * bus, 1.0);
  }
  for (double mb : {0.25, 1.0, 4.0, 25.0, 1000.0}) {
    const auto cap = static_cast<std::int64_t>(mb * 1048576.0 / sizeof(float));
    Reducer red(*comm, grads, plan_buckets(spec, cap, std::min<std::int64_t>(cap, 262144)), true);
    const double t = time_it([&] {
      for (int layer = static_cast<int>(spec.layers.size()) - 1; layer >= 0; --layer) red.on_layer_done(layer);
      red.finish();
    });
    if (comm->rank() == 0) {
      char name[64];
      std::snprintf(name, sizeof name, "reducer, %zu bucket(s) <= %g MB", red.buckets().size(), mb);
      std::printf("%-34s %9.2f %12.2f %12.2f %8.2f\n", name, 1e3 * t, bytes / t / 1e9, bytes / t / 1e9 * bus, t_mpi / t);
    }
  }
  comm.reset();
  MPI_Finalize();
  return 0;
}
