// Note [Naming a straggler] (src/report/ranks.cpp): which rank is named, for which phase, and what
// it cost the others; an even run names none.
#include <gtest/gtest.h>

#include <vector>

#include "mnist_mpi/comm/communicator.hpp"
#include "mnist_mpi/report/ranks.hpp"
#include "mnist_mpi/resilience/fault.hpp"
#include "mnist_mpi/check.hpp"

namespace mnist_mpi {
namespace {

RankTimes rank(int r, double forward_ms, double backward_ms, double wait_ms) {
  RankTimes t;
  t.rank = r;
  t.host = "node" + std::to_string(r);
  t.per_step = StepTiming{.data = 0.1e-3, .forward = forward_ms * 1e-3, .backward = backward_ms * 1e-3,
                          .exposed_comm = wait_ms * 1e-3, .optimizer = 1e-3};
  return t;
}

TEST(Straggler, AnEvenRunNamesNone) {
  const std::vector<RankTimes> even{rank(0, 5, 10, 0.5), rank(1, 5.2, 10.4, 0.3), rank(2, 4.9, 10.6, 0.4)};
  const Straggler s = find_straggler(even, 100);
  EXPECT_EQ(s.rank, -1);
  EXPECT_NE(straggler_text(even, s).find("none: the ranks' compute per step is within"), std::string::npos);
  EXPECT_EQ(find_straggler({rank(0, 5, 10, 0)}, 100).rank, -1);  // one rank: nobody to compare with
}

TEST(Straggler, TheSlowRankIsNamedWithItsPhaseAndTheOthersWait) {
  // Rank 3's backward is 3 ms longer: the others wait about that at every step.
  const std::vector<RankTimes> r{rank(0, 5, 10, 3.4), rank(1, 5, 10, 3.3), rank(2, 5.1, 10.1, 3.2),
                                 rank(3, 5, 13, 0.2)};
  const Straggler s = find_straggler(r, 1000);
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.host, "node3");
  EXPECT_EQ(s.phase, "backward");
  EXPECT_NEAR(s.phase_slower, 0.30, 1e-9);                  // 13 / 10
  EXPECT_NEAR(s.slower, 19.1 / 16.1 - 1, 1e-9);             // compute 19.1 against the others' median 16.1
  EXPECT_NEAR(s.others_waited_s, (3.2 + 3.1 + 3.0) / 3, 1e-9);  // 1000 steps x their wait beyond rank 3's
  EXPECT_EQ(straggler_text(r, s),
            "rank 3 on host node3: backward 30 % slower than the median rank (compute per step 19 % slower); the "
            "other ranks waited 3.1 s for it");
  // With two ranks the slow one is compared with the other, not with their mean.
  const std::vector<RankTimes> two{rank(0, 5, 10, 2), rank(1, 5, 12.5, 0)};
  EXPECT_EQ(find_straggler(two, 10).rank, 1);
  // Below the threshold: 10 % slower is noise.
  const std::vector<RankTimes> near{rank(0, 5, 10, 1), rank(1, 5, 11.6, 0)};
  EXPECT_EQ(find_straggler(near, 10).rank, -1);
}

TEST(Fault, ParsesASlowRank) {
  const Fault f = parse_fault("1:slow:25");
  EXPECT_EQ(f.kind, FaultKind::kSlow);
  EXPECT_EQ(f.slow_ms_for(1), 25);
  EXPECT_EQ(f.slow_ms_for(0), 0);
  EXPECT_THROW(parse_fault("1:slow:0"), Error);
  EXPECT_THROW(parse_fault("1:slow:x"), Error);
  EXPECT_THROW(parse_fault("1:slow:20001"), Error);
}

}  // namespace
}  // namespace mnist_mpi

namespace mnist_mpi {

// describe_placement (the "hosts:" line; tests/e2e_multinode.sh checks it on nodes of their own):
// hosts in the order of their first rank, each rank's node-local rank in the ranks' order.
TEST(Placement, NamesEachHostWithItsRanksAndTheirLocalRanks) {
  EXPECT_EQ(describe_placement({"node1", "node1", "node2", "node2"}, {0, 1, 0, 1}),
            "node1 ranks 0-1 (local 0-1), node2 ranks 2-3 (local 0-1)");
  EXPECT_EQ(describe_placement({"b", "a", "b", "a", "b"}, {0, 0, 1, 1, 2}),
            "b ranks 0,2,4 (local 0-2), a ranks 1,3 (local 0-1)");
  EXPECT_EQ(describe_placement({"n", "n"}, {1, 0}), "n ranks 0-1 (local 1,0)");  // as MPI gave them
  EXPECT_EQ(describe_placement({"solo"}, {0}), "solo rank 0 (local 0)");
}

}  // namespace mnist_mpi
