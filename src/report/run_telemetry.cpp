// The training loop's clocks, loss windows and every rank's step times
// (include/mnist_mpi/report/run_telemetry.hpp).
#include "mnist_mpi/report/run_telemetry.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <limits>
#include <span>
#include <string>

#include "mnist_mpi/report/ranks.hpp"

namespace mnist_mpi {

std::vector<std::uint64_t> gather_peak_rss_kib(Communicator& comm) {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::vector<std::uint64_t> rss(static_cast<std::size_t>(comm.size()));
  comm.allgather(static_cast<std::uint64_t>(ru.ru_maxrss), rss);  // KiB
  return rss;
}

// Note [Timing a step]
// On a GPU the host only queues work, so a step's host time says little. So on every backend the
// steady rate is the wall time from a synchronisation after the warm-up steps (the first 10, when
// the run has more) to one after the last step, less the time spent evaluating, writing
// checkpoints and comparing replicas (--check-replicas-every: a download of the parameters and a
// hash, which on a GPU also drains the stream). The per-step agreement on a signal stays in: it
// is a collective of every step. The per-step parts are host times (queueing times on a GPU),
// averaged over the same steps.
RunClock RunClock::starting(std::int64_t first_step, std::int64_t total_steps) {
  RunClock c;
  c.run = c.window = std::chrono::steady_clock::now();
  c.warmup = total_steps - first_step > kWarmupSteps ? kWarmupSteps : 0;
  return c;
}

void RunClock::start_steady(Backend& backend) {
  backend.synchronize();
  steady = std::chrono::steady_clock::now();
  excluded_at_steady = excluded_s;
}

void RunClock::end_steady(Backend& backend) {
  backend.synchronize();
  steady_s = seconds_since(steady) - (excluded_s - excluded_at_steady);
}

double RunClock::images_per_s(std::int64_t steps, std::int64_t global_batch) const {
  return steady_s > 0 ? static_cast<double>(steps * global_batch) / steady_s : 0.0;
}

void RunClock::exclude(std::chrono::steady_clock::time_point since) {
  excluded_s += std::chrono::duration<double>(pause_window(since)).count();
}

std::chrono::steady_clock::duration RunClock::pause_window(std::chrono::steady_clock::time_point since) {
  const auto d = std::chrono::steady_clock::now() - since;
  window += d;
  return d;
}

double LossWindow::log(Communicator& comm, Monitor& monitor, LossMeter& meter, std::int64_t step, double lr,
                       std::chrono::steady_clock::time_point window_start) {
  double v[2] = {meter.read().loss_sum, static_cast<double>(images_)};  // a GPU syncs here
  meter.reset();
  comm.allreduce_sum(std::span<double>(v, 2));
  const double loss = v[1] > 0 ? v[0] / v[1] : std::numeric_limits<double>::quiet_NaN();
  if (comm.rank() == 0) {
    const double ips = v[1] / seconds_since(window_start);
    monitor.on_log(step, loss, lr, ips);
  }
  images_ = 0;
  return loss;
}

// Note [Every rank's step times]
// Rank 0's own step times say little about the others, and a slow rank shows on it only as
// waiting. So each rank sums its phase times (data, forward, backward, exposed communication,
// optimizer) and at every log line, where the ranks already meet for the training loss, one small
// gather (10 doubles a rank, into buffers made at start) brings every rank's window to rank 0: the
// "ranks" metrics event and the report's per-rank charts; and each rank's sums over the steady
// steps so far (RunClock::sum, the first 10 left out as from the step rate: their one-off costs
// differ from rank to rank), for every rank's means over the run and Note [Naming a straggler].
// Nothing is added to the steps between log lines; without --log-every the one gather is at the
// end. Its cost: docs/performance.md#every-ranks-step-times.
void RankTimesGather::start(Communicator& comm, Monitor& monitor) {
  // Here, in the trainer's run(), and not in its constructor: a collective there would leave the
  // ranks whose options parsed waiting in it while one that failed waits in main's set-up
  // agreement (tests/e2e_faults.sh, bad_option_on_one_rank).
  rank0_ = comm.rank() == 0;
  const std::vector<std::string> hosts = gather_hosts(comm, 0);
  if (comm.size() > 1) {
    const std::vector<int> locals = gather_local_ranks(comm, 0);
    if (rank0_) monitor.on_placement(describe_placement(hosts, locals));
  }
  if (!rank0_) return;
  const auto world = static_cast<std::size_t>(comm.size());
  gathered_.assign(world * kRankValues, 0.0);
  means_.assign(world, RankTimes{});
  sums_.assign(world, RankTimes{});
  for (std::size_t r = 0; r < world; ++r) {
    means_[r].rank = sums_[r].rank = static_cast<int>(r);
    means_[r].host = sums_[r].host = hosts.at(r);
  }
}

void RankTimesGather::gather(Communicator& comm, Monitor& monitor, const StepTiming& s, std::int64_t step,
                             std::int64_t steady_steps) {
  std::int64_t n = 0;  // the same on every rank: steps since the last log line
  const StepTiming w = monitor.take_window(n);
  const double mine[kRankValues] = {w.data, w.forward, w.backward, w.exposed_comm, w.optimizer,
                                    s.data, s.forward, s.backward, s.exposed_comm, s.optimizer};
  comm.gather(std::span<const double>(mine, kRankValues), std::span<double>(gathered_), 0);
  if (!rank0_) return;
  const auto timing = [](const double* g) {
    return StepTiming{.data = g[0], .forward = g[1], .backward = g[2], .exposed_comm = g[3], .optimizer = g[4]};
  };
  for (std::size_t r = 0; r < sums_.size(); ++r) {
    const double* g = gathered_.data() + kRankValues * r;
    means_[r].per_step = timing(g).mean_over(n);
    sums_[r].per_step = timing(g + 5);
  }
  steps_ = steady_steps;
  if (n > 0) monitor.on_ranks(step + 1, means_);
}

void RankTimesGather::final_facts(FinalFacts& facts) const {
  if (!rank0_ || steps_ <= 0) return;
  facts.ranks = sums_;
  for (RankTimes& r : facts.ranks) r.per_step = r.per_step.mean_over(steps_);
  facts.straggler = find_straggler(facts.ranks, steps_);
}

}  // namespace mnist_mpi
