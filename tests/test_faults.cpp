// Unit tests of the fault handling's small parts: the MNIST_MPI_FAULT parser, the finite-ness check, and
// which options must agree across ranks. (The faults themselves: tests/e2e_faults.sh.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/joined_thread.hpp"
#include "mnist_mpi/comm/consistency.hpp"
#include "mnist_mpi/resilience/fault.hpp"
#include "mnist_mpi/resilience/finite.hpp"

namespace mnist_mpi {
namespace {

TEST(Fault, ParsesRankStepKind) {
  const Fault f = parse_fault("1:17:stop");
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.step, 17);
  EXPECT_EQ(f.kind, FaultKind::kStop);
  EXPECT_TRUE(f.armed_for(1, 16));   // step 17 counts from 1: the loop's step 16
  EXPECT_FALSE(f.armed_for(0, 16));  // another rank
  EXPECT_FALSE(f.armed_for(1, 17));
  EXPECT_EQ(parse_fault("0:1:kill").kind, FaultKind::kKill);
  EXPECT_EQ(parse_fault("0:1:segv").kind, FaultKind::kSegv);
  EXPECT_EQ(parse_fault("0:1:throw").kind, FaultKind::kThrow);
  EXPECT_EQ(parse_fault("0:1:hang").kind, FaultKind::kHang);
  EXPECT_EQ(parse_fault("0:1:nan").kind, FaultKind::kNan);
  EXPECT_EQ(parse_fault("0:1:diverge").kind, FaultKind::kDiverge);
}

TEST(Fault, ParsesAThreadStart) {
  const Fault f = parse_fault("1:thread:checkpoint-writer");
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.kind, FaultKind::kThreadStart);
  EXPECT_EQ(f.thread, "checkpoint-writer");
  EXPECT_FALSE(f.armed_for(1, 0));  // never a step fault
  EXPECT_EQ(parse_fault("0:thread:communication").thread, "communication");
  EXPECT_EQ(parse_fault("0:thread:watchdog").thread, "watchdog");
  for (const char* bad : {"0:thread:", "0:thread:writer", "0:threads:watchdog", "x:thread:watchdog"})
    EXPECT_THROW(parse_fault(bad), Error) << bad;
}

TEST(Fault, ParsesALocalDropoutKey) {
  const Fault f = parse_fault("1:dropout:local");
  EXPECT_EQ(f.kind, FaultKind::kLocalDropoutKey);
  EXPECT_TRUE(f.local_dropout_key_for(1));
  EXPECT_FALSE(f.local_dropout_key_for(0));
  EXPECT_FALSE(f.armed_for(1, 0));  // never a step fault
  EXPECT_FALSE(parse_fault("1:slow:5").local_dropout_key_for(1));
  for (const char* bad : {"1:dropout:", "1:dropout:global", "1:dropouts:local", "x:dropout:local"})
    EXPECT_THROW(parse_fault(bad), Error) << bad;
}

// An owner like the Checkpointer: starts a thread waiting on its condition variable, then throws
// from its constructor (Note [Threads are joined on every path]). Its destructor never runs; the
// JoinedThread member must stop and join the thread while the mutex and condition variable exist.
class ThrowingOwner {
 public:
  explicit ThrowingOwner(std::atomic<bool>& exited) {
    thread_.start(
        [this, &exited] {
          std::unique_lock<std::mutex> lk(mu_);
          cv_.wait(lk, [this] { return quit_; });
          exited = true;
        },
        mu_, quit_, cv_);
    throw_error(ExitCode::kCheckpoint, "refused after the thread started");
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool quit_ = false;
  JoinedThread thread_;  // last
};

TEST(JoinedThread, AnOwnerWhoseConstructorThrowsJoinsItsThread) {
  std::atomic<bool> exited{false};
  // In a thread of its own with a deadline: a hang would otherwise hang the test binary.
  auto done = std::async(std::launch::async, [&] {
    try {
      ThrowingOwner owner(exited);
    } catch (const Error& e) {
      return e.code();
    }
    return ExitCode::kOk;
  });
  ASSERT_EQ(done.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "the owner's unwinding hung";
  EXPECT_EQ(done.get(), ExitCode::kCheckpoint);
  EXPECT_TRUE(exited.load());  // the thread was woken and returned before the join
}

TEST(JoinedThread, JoinIsIdempotentAndAThreadNeverStartedIsFine) {
  JoinedThread idle;
  idle.join();
  EXPECT_FALSE(idle.running());
  int runs = 0;
  JoinedThread t;
  t.start([&] { ++runs; }, {});
  t.join();
  t.join();
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(t.running());
}

TEST(Fault, RejectsMalformedValues) {
  for (const char* bad : {"", "1", "1:2", "1:2:", "x:2:kill", "1:y:kill", "-1:2:kill", "1:0:kill", "1:2:explode",
                          "1 :2:kill", "1:2x:kill", "1:2:kill:3"}) {
    try {
      parse_fault(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_NE(std::string(e.what()).find("RANK:STEP:KIND"), std::string::npos) << e.what();
    }
  }
}

TEST(Fault, ThrowKindThrowsARuntimeError) {
  try {
    fire_fault(parse_fault("0:3:throw"));
    ADD_FAILURE() << "did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kRuntime);
    EXPECT_NE(std::string(e.what()).find("rank 0 fails in step 3 on purpose"), std::string::npos);
  }
}

TEST(Finite, FindsEveryNonFiniteValueAnywhere) {
  std::vector<float> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = float(i) - 500.0f;
  v[3] = std::numeric_limits<float>::max();
  v[4] = -std::numeric_limits<float>::max();
  v[5] = std::numeric_limits<float>::denorm_min();
  v[6] = -0.0f;
  EXPECT_TRUE(all_finite(v.data(), std::int64_t(v.size())));
  EXPECT_TRUE(params_are_finite(v.data(), std::int64_t(v.size())));
  EXPECT_TRUE(all_finite(v.data(), 0));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    for (std::size_t at : {std::size_t{0}, std::size_t{1}, std::size_t{31}, std::size_t{998}, std::size_t{999}}) {
      std::vector<float> w = v;
      w[at] = bad;
      EXPECT_FALSE(all_finite(w.data(), std::int64_t(w.size()))) << bad << " at " << at;
      EXPECT_TRUE(all_finite(w.data(), std::int64_t(at))) << "the prefix before " << at << " is finite";
    }
  }
}

TEST(RanksAgree, PerNodeOptionsAreLeftOut) {
  EXPECT_EQ(agreed_options("batch-size = 10\ndata-dir = /a\nseed = 1\nthreads = 4\n"), "batch-size = 10\nseed = 1\n");
}

}  // namespace
}  // namespace mnist_mpi
