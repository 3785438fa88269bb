// Unit tests of issue 8's small parts: the MNIST_MPI_FAULT parser, the finite-ness check, and
// which options must agree across ranks. (The faults themselves: tests/e2e_faults.sh.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/consistency.hpp"
#include "mnist_mpi/train/fault.hpp"
#include "mnist_mpi/train/finite.hpp"

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
