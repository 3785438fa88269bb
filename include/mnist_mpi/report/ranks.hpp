// Every rank's step times, gathered to rank 0 (Note [Every rank's step times] in
// src/report/run_telemetry.cpp), and the one question they answer first: is one rank slower than the
// others, and what did it cost them (Note [Naming a straggler] in src/report/ranks.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mnist_mpi/run_facts.hpp"  // RankTimes, Straggler

namespace mnist_mpi {

// The threshold of Note [Naming a straggler]: a rank whose compute per step is this much above
// the median of the other ranks' is named.
inline constexpr double kStragglerThreshold = 0.15;

// Names the slowest rank if it is a straggler (steps: the steps the means are over).
Straggler find_straggler(const std::vector<RankTimes>& ranks, std::int64_t steps);
// The straggler in one line ("rank 3 on host B: backward 23 % slower than the median rank; the
// other ranks waited 4.1 s for it"), or "none" with the spread when no rank is one.
std::string straggler_text(const std::vector<RankTimes>& ranks, const Straggler& s);

}  // namespace mnist_mpi
