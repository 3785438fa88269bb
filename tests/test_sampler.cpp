// Tests of the sampler: each epoch's permutation is a permutation, a pure function of (seed,
// epoch) and different across epochs and seeds; the ranks' slices of a global step together are
// exactly that step's window of the epoch's permutation (also across an epoch boundary and back);
// the last partial batch is dropped; a global batch larger than the dataset is a usage error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/data/sampler.hpp"

namespace mnist_mpi {
namespace {

TEST(Sampler, PermutationIsAPermutation) {
  for (std::int64_t n : {1, 2, 7, 1000}) {
    std::vector<std::int64_t> p = Sampler::permutation(n, 42, 0);
    ASSERT_EQ(static_cast<std::int64_t>(p.size()), n);
    std::sort(p.begin(), p.end());
    std::vector<std::int64_t> id(static_cast<std::size_t>(n));
    std::iota(id.begin(), id.end(), 0);
    EXPECT_EQ(p, id) << n;
  }
}

TEST(Sampler, PermutationDeterministicPerSeedAndEpoch) {
  const auto a = Sampler::permutation(1000, 42, 3);
  EXPECT_EQ(a, Sampler::permutation(1000, 42, 3));
  EXPECT_NE(a, Sampler::permutation(1000, 42, 4));
  EXPECT_NE(a, Sampler::permutation(1000, 43, 3));
  std::vector<std::int64_t> id(1000);
  std::iota(id.begin(), id.end(), 0);
  EXPECT_NE(a, id);
  // Well shuffled: few fixed points (about 1 expected).
  std::int64_t fixed = 0;
  for (std::size_t i = 0; i < a.size(); ++i) fixed += a[i] == static_cast<std::int64_t>(i) ? 1 : 0;
  EXPECT_LT(fixed, 10);
  // permute() in place gives the same, whatever the buffer held before.
  std::vector<std::int64_t> q(1000, -5);
  Sampler::permute(q, 42, 3);
  EXPECT_EQ(q, a);
}

TEST(Sampler, RankSlicesTileTheStepWindow) {
  const std::int64_t n = 1000, B = 50;
  Sampler sampler(n, B, 9);
  const std::int64_t spe = sampler.steps_per_epoch();
  ASSERT_EQ(spe, 20);  // 1000 / 50
  // Note [Uneven slices]: 50 on 3 ranks is 17, 17, 16; on 8 ranks two take 7 and six take 6.
  for (int world : {1, 2, 3, 4, 7, 8, 50}) {
    SCOPED_TRACE(world);
    const std::int64_t small = B / world, extra = B % world;
    for (std::int64_t step : {0, 1, 19, 20, 21, 45, 5}) {  // epoch 0, 1 (across the boundary), 0 again
      const std::int64_t epoch = step / spe, s = step % spe;
      const auto perm = Sampler::permutation(n, 9, epoch);
      std::vector<std::int64_t> all;
      std::int64_t first = 0;
      for (int r = 0; r < world; ++r) {
        const Slice sl = sampler.slice(step, r, world);
        EXPECT_EQ(sl.epoch, epoch);
        EXPECT_EQ(sl.first, first);
        ASSERT_EQ(sl.count, r < extra ? small + 1 : small) << "rank " << r;
        EXPECT_LE(sl.count, largest_part(B, world));
        first += sl.count;
        const auto order = sampler.order(sl.epoch);
        all.insert(all.end(), order.begin() + sl.position, order.begin() + sl.position + sl.count);
      }
      const std::vector<std::int64_t> want(perm.begin() + s * B, perm.begin() + (s + 1) * B);
      EXPECT_EQ(all, want) << "step " << step;
    }
  }
  EXPECT_EQ(largest_part(50, 3), 17);
  EXPECT_EQ(largest_part(50, 5), 10);
  EXPECT_EQ(largest_part(100, 8), 13);
}

// images_in_parts, the closed form the trainer counts a rank's images with, against the parts
// summed one by one, for every range of every split of a few batches.
TEST(Sampler, ImagesInPartsIsTheSumOfTheParts) {
  for (std::int64_t B : {1, 7, 50, 100, 101}) {
    for (std::int64_t parts = 1; parts <= B && parts <= 12; ++parts) {
      for (std::int64_t first = 0; first < parts; ++first) {
        std::int64_t sum = 0;
        for (std::int64_t n = 0; first + n <= parts; ++n) {
          ASSERT_EQ(images_in_parts(B, parts, first, n), sum) << B << " " << parts << " " << first << " " << n;
          if (first + n < parts) sum += part_count(B, parts, first + n);
        }
      }
      EXPECT_EQ(images_in_parts(B, parts, 0, parts), B);
    }
  }
}

TEST(Sampler, EpochCoversDistinctImages) {
  const std::int64_t n = 100, B = 30;
  Sampler sampler(n, B, 1);
  ASSERT_EQ(sampler.steps_per_epoch(), 3);
  std::vector<std::int64_t> seen;
  for (std::int64_t step = 0; step < 3; ++step) {
    const Slice sl = sampler.slice(step, 0, 1);
    const auto order = sampler.order(sl.epoch);
    seen.insert(seen.end(), order.begin() + sl.position, order.begin() + sl.position + sl.count);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "an image twice in one epoch";
  EXPECT_EQ(seen.size(), 90u);  // 10 images dropped this epoch
}

TEST(Sampler, StepsPerEpochAndBadBatch) {
  EXPECT_EQ(Sampler(60000, 64, 0).steps_per_epoch(), 937);
  EXPECT_EQ(Sampler(100, 100, 0).steps_per_epoch(), 1);
  EXPECT_EQ(Sampler(100, 99, 0).steps_per_epoch(), 1);
  try {
    Sampler s(100, 101, 0);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(e.what()).find("larger than the training split"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Sampler(100, 0, 0), Error);
}

}  // namespace
}  // namespace mnist_mpi
