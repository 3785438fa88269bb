// Naming a straggler from every rank's step times (include/mnist_mpi/report/ranks.hpp).
#include "mnist_mpi/report/ranks.hpp"

#include <algorithm>
#include <cstdio>

namespace mnist_mpi {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The median of f over every rank but `skip`.
template <class F>
double median_of_others(const std::vector<RankTimes>& ranks, std::size_t skip, F f) {
  std::vector<double> v;
  for (std::size_t i = 0; i < ranks.size(); ++i)
    if (i != skip) v.push_back(f(ranks[i]));
  return median(v);
}

}  // namespace

// Note [Naming a straggler]
// In data parallelism every rank waits at each step's sums for the slowest, so one slow rank
// (a busy or throttled core, a slower node, a noisy neighbour) slows all of them, and on rank 0's
// own numbers it shows only as "exposed communication". So every rank's means per phase reach
// rank 0, and a rank is named when its compute per step (data, forward, backward, optimizer: what
// it does itself, its wait left out) is more than kStragglerThreshold (15 %) above the median of
// the other ranks' (the others', so that with 2 ranks the slow one is compared with the fast one,
// not with their mean). 15 %: with one rank per core (2 ranks on this project's 2-core VMs) the
// ranks' compute differed by up to 8 % (tiny, lenet and fast, two runs each, 2026-12-05), so a
// smaller threshold would name ranks that are merely noisy; a rank 15 % slower costs every other
// rank about that much of its step, which is worth a line. (3 ranks on those 2 cores share one,
// and the rank that gets less of it is 20-50 % slower and is named: a real straggler.) The phase named is where its time per step exceeds the others'
// median the most, and what it cost is the other ranks' wait (their exposed communication) beyond
// its own, over the run.
Straggler find_straggler(const std::vector<RankTimes>& ranks, std::int64_t steps) {
  Straggler s;
  if (ranks.size() < 2) return s;
  std::size_t worst = 0;
  double worst_excess = -1e300;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const double m = median_of_others(ranks, i, [](const RankTimes& r) { return r.compute(); });
    const double excess = m > 0 ? ranks[i].compute() / m - 1.0 : 0.0;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (!(worst_excess > kStragglerThreshold)) return s;
  const RankTimes& r = ranks[worst];
  s.rank = r.rank;
  s.host = r.host;
  s.slower = worst_excess;
  struct Phase {
    const char* name;
    double StepTiming::*field;
  };
  const Phase phases[] = {{"data", &StepTiming::data},
                          {"forward", &StepTiming::forward},
                          {"backward", &StepTiming::backward},
                          {"optimizer", &StepTiming::optimizer}};
  double most = -1e300;
  for (const Phase& p : phases) {
    const double m = median_of_others(ranks, worst, [&](const RankTimes& o) { return o.per_step.*p.field; });
    const double over = r.per_step.*p.field - m;
    if (over > most) {
      most = over;
      s.phase = p.name;
      s.phase_slower = m > 0 ? r.per_step.*p.field / m - 1.0 : 0.0;
    }
  }
  double waited = 0;
  for (std::size_t i = 0; i < ranks.size(); ++i)
    if (i != worst) waited += std::max(0.0, ranks[i].per_step.exposed_comm - r.per_step.exposed_comm);
  s.others_waited_s = waited / static_cast<double>(ranks.size() - 1) * static_cast<double>(steps);
  return s;
}

std::string straggler_text(const std::vector<RankTimes>& ranks, const Straggler& s) {
  char b[320];
  if (s.rank < 0) {
    double lo = 1e300, hi = 0;
    for (const RankTimes& r : ranks) {
      lo = std::min(lo, r.compute());
      hi = std::max(hi, r.compute());
    }
    if (ranks.size() < 2 || lo <= 0) return "none (one rank)";
    std::snprintf(b, sizeof b, "none: the ranks' compute per step is within %.0f %% of each other (%.0f %% names one)",
                  100.0 * (hi / lo - 1.0), 100.0 * kStragglerThreshold);
    return b;
  }
  std::snprintf(b, sizeof b,
                "rank %d on host %s: %s %.0f %% slower than the median rank (compute per step %.0f %% slower); "
                "the other ranks waited %.1f s for it",
                s.rank, s.host.c_str(), s.phase.c_str(), 100.0 * s.phase_slower, 100.0 * s.slower,
                s.others_waited_s);
  return b;
}

}  // namespace mnist_mpi
