// The threads of a rank, run under mpirun with 2 and 3 ranks and (scripts/test.sh) built with
// ThreadSanitizer: the collective watchdog's thread against the marks the step loop makes, and the
// reducer's buckets through a watched MPI communicator (where the communicator's own threads, if
// any, run too). Exactly predictable sums (integer-valued floats); verdicts allreduced.
#include <gtest/gtest.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/comm/watchdog.hpp"
#include "mnist_mpi/comm/consistency.hpp"
#include "mnist_mpi/train/reducer.hpp"
#include "test_util.hpp"  // world_rank, world_size, all_ranks, uniform

namespace mnist_mpi {
namespace {

constexpr const char* kSmall =
    "conv:3x3:4:same,relu,maxpool:2,conv:3x3:8:same,relu,maxpool:2,flatten,fc:32,relu,dropout:0.5,fc:10";

struct Fired {
  std::mutex m;
  std::vector<std::string> messages;
  CollectiveWatch::OnTimeout handler() {
    return [this](const std::string& msg) {
      std::lock_guard<std::mutex> lock(m);
      messages.push_back(msg);
    };
  }
  std::size_t count() {
    std::lock_guard<std::mutex> lock(m);
    return messages.size();
  }
};

// A collective marked longer than the limit fires the watch once, with the step (1-based), the
// bucket and the collective in the message.
TEST(CollectiveWatch, FiresOnceNamingStepBucketAndCollective) {
  Fired fired;
  {
    CollectiveWatch w(0.2, 0, "host", fired.handler(), 0.01);
    watch_set_step(41);
    watch_set_bucket(3);
    w.begin("wait for allreduce_sum");
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    w.end();
    watch_set_bucket(-1);
    watch_set_step(-1);
  }
  ASSERT_EQ(fired.count(), 1u);
  EXPECT_NE(fired.messages[0].find("collective timeout: wait for allreduce_sum in step 42, gradient bucket 3, "
                                   "has not finished after"),
            std::string::npos)
      << fired.messages[0];
}

// Many short collectives, marked from this thread while the watch thread polls every
// millisecond: never fires (and, under ThreadSanitizer, no data race between the two threads).
TEST(CollectiveWatch, ShortCollectivesNeverFire) {
  Fired fired;
  {
    CollectiveWatch w(0.5, 0, "host", fired.handler(), 0.001);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    std::int64_t n = 0;
    while (std::chrono::steady_clock::now() < until) {
      watch_set_step(n);
      WatchScope s(&w, "barrier");
      ++n;
    }
    EXPECT_GT(n, 1000);
  }
  EXPECT_EQ(fired.count(), 0u);
}

// With timeout 0 the watch starts no thread and never fires.
TEST(CollectiveWatch, ZeroTimeoutNeverFires) {
  Fired fired;
  {
    CollectiveWatch w(0.0, 0, "host", fired.handler(), 0.001);
    w.begin("barrier");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    w.end();
  }
  EXPECT_EQ(fired.count(), 0u);
}

// Note [Device waits have a deadline]: the poll loop of a host wait on a GPU, separated from the
// device calls (`ready` stands for cudaEventQuery, `check` for NCCL's error check, `abort` for
// ncclCommAbort).
TEST(DeviceWait, ReturnsWhenReadyCheckingBetweenPolls) {
  int polls = 0, checks = 0, aborts = 0;
  const DeviceWaitPolicy policy{5.0, [&] { ++checks; }, [&] { ++aborts; }};
  wait_until([&] { return ++polls == 100; }, policy, "a wait");
  EXPECT_EQ(polls, 100);
  EXPECT_EQ(checks, 99);  // between polls, not after the last
  EXPECT_EQ(aborts, 0);
}

// A wait that never ends: after the timeout the communicator is aborted once, then one error
// (exit code 1, as main() reports it before MPI_Abort) names the wait, step, bucket and option.
TEST(DeviceWait, ADeadlineAbortsThenThrowsOneLine) {
  int aborts = 0;
  const DeviceWaitPolicy policy{0.2, [] {}, [&] { ++aborts; }};
  watch_set_step(6);
  watch_set_bucket(1);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    wait_until([] { return false; }, policy, "a wait for the GPU's queue");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(e.code(), ExitCode::kRuntime);
    const std::string m = e.what();
    EXPECT_NE(m.find("device timeout: a wait for the GPU's queue in step 7, gradient bucket 1 has not finished after"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("(--collective-timeout 0.2)"), std::string::npos) << m;
    EXPECT_NE(m.find("the NCCL communicator was aborted"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_GE(took, 0.2);
    EXPECT_LT(took, 5.0);
  }
  watch_set_bucket(-1);
  watch_set_step(-1);
  EXPECT_EQ(aborts, 1);
}

// An error that the check finds (NCCL's asynchronous error) ends the wait at once, without the
// deadline's abort (the check aborts the communicator itself).
TEST(DeviceWait, AnErrorFromTheCheckEndsTheWait) {
  int aborts = 0, polls = 0;
  const DeviceWaitPolicy policy{60.0,
                                [&] {
                                  if (polls == 3) throw_error(ExitCode::kRuntime, "NCCL failed");
                                },
                                [&] { ++aborts; }};
  EXPECT_THROW(wait_until(
                   [&] {
                     ++polls;
                     return false;
                   },
                   policy, "a wait"),
               Error);
  EXPECT_EQ(polls, 3);
  EXPECT_EQ(aborts, 0);
}

// Timeout 0 (--collective-timeout 0) has no deadline: a slow wait returns.
TEST(DeviceWait, ZeroTimeoutWaitsAsLongAsItTakes) {
  const DeviceWaitPolicy policy{0.0, {}, [] { ADD_FAILURE() << "aborted without a deadline"; }};
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  wait_until([&] { return std::chrono::steady_clock::now() >= until; }, policy, "a wait");
  EXPECT_GE(std::chrono::steady_clock::now(), until);
}

// The reducer through a watched MPI communicator: exact sums for tiny and large buckets,
// overlapped, step after step, while the watch thread polls; the watch never fires.
TEST(CollectiveWatch, WatchedReducerSumsExactly) {
  const ModelSpec spec = parse_model_spec(kSmall, Shape{1, 28, 28}, 10);
  Fired fired;
  CollectiveWatch w(30.0, 0, "host", fired.handler(), 0.001);
  auto c = watch_communicator(make_mpi_communicator(MPI_COMM_WORLD), w);
  const int r = c->rank(), n = c->size();
  std::vector<float> grads(static_cast<std::size_t>(spec.param_count));
  std::int64_t wrong = 0;
  for (std::int64_t cap : {std::int64_t{64}, std::int64_t{4096}, spec.param_count}) {
    Reducer red(*c, grads, plan_buckets(spec, cap, cap), true);
    for (int step = 0; step < 5; ++step) {
      watch_set_step(step);
      for (std::size_t i = 0; i < grads.size(); ++i) grads[i] = float((r + 1) * int((i + step) % 11));
      for (int layer = int(spec.layers.size()) - 1; layer >= 0; --layer) red.on_layer_done(layer);
      red.finish();
      for (std::size_t i = 0; i < grads.size(); ++i)
        wrong += grads[i] != float(int((i + step) % 11) * n * (n + 1) / 2) ? 1 : 0;
    }
  }
  c->allreduce_max(std::span<std::int64_t>(&wrong, 1));
  EXPECT_EQ(wrong, 0);
  double v[1] = {1.0};
  c->allreduce_sum(std::span<double>(v, 1));
  EXPECT_EQ(v[0], double(n));
  std::vector<std::uint64_t> all(static_cast<std::size_t>(n));
  c->allgather(std::uint64_t(r) * 7, all);
  for (int k = 0; k < n; ++k) EXPECT_EQ(all[static_cast<std::size_t>(k)], std::uint64_t(k) * 7);
  c->barrier();
  EXPECT_EQ(fired.count(), 0u);
}

// Ranks with the same description pass; a rank whose lines differ from rank 0's fails with those
// lines in its message, and only the differing ranks fail.
TEST(RanksAgree, SameDescriptionPassesAndADifferenceIsNamed) {
  auto c = make_mpi_communicator(MPI_COMM_WORLD);
  const std::string same = "version = 1\nseed = 42\nmodel = fc:10\n";
  bool ok = true;
  try {
    check_ranks_agree(*c, same);
  } catch (const Error& e) {
    ok = false;
    ADD_FAILURE() << e.what();
  }
  EXPECT_TRUE(all_ranks(ok));
  if (c->size() < 2) GTEST_SKIP() << "the difference needs 2 ranks";
  const bool odd = c->rank() == c->size() - 1;  // the last rank gets another seed and a line more
  const std::string mine = odd ? "version = 1\nseed = 43\nmodel = fc:10\nextra = 1\n" : same;
  std::string message;
  try {
    check_ranks_agree(*c, mine);
  } catch (const Error& e) {
    message = e.what();
    EXPECT_EQ(e.code(), ExitCode::kUsage);
  }
  if (odd) {
    EXPECT_NE(message.find("rank " + std::to_string(c->rank()) +
                           " does not run the same job as rank 0: "
                           "extra = 1 here, (not set) on rank 0; seed = 43 here, 42 on rank 0"),
              std::string::npos)
        << message;
  } else {
    EXPECT_EQ(message, "");
  }
}

}  // namespace
}  // namespace mnist_mpi
