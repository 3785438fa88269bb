// Tests of the run's plan (include/mnist_mpi/train/run_plan.hpp), with no MPI and no backend: the
// batch sizes, steps, sharding and threads for a few option sets, and each refusal with its
// message and exit code.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/train/codec.hpp"
#include "mnist_mpi/train/run_plan.hpp"

namespace mnist_mpi {
namespace {

Options per_rank(std::int64_t batch) {
  Options o;
  o.batch_size = batch;
  return o;
}

Options global(std::int64_t batch) {
  Options o;
  o.global_batch_size = batch;
  return o;
}

JobFacts job(int world, int rank, std::int64_t train_count = 1000) {
  return JobFacts{
      .world = world, .rank = rank, .local_size = 1, .cuda = false, .train_count = train_count, .hardware_threads = 8};
}

// The message of the Error(kUsage) that plan_run throws (fails the test if none, or another code).
std::string refusal(const Options& o, const JobFacts& j) {
  try {
    plan_run(o, j);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "plan_run did not refuse";
  return {};
}

TEST(RunPlan, PerRankBatchTimesRanks) {
  Options o = per_rank(32);
  o.epochs = 3;
  const RunPlan p = plan_run(o, job(2, 1));
  EXPECT_EQ(p.batch, 32);
  EXPECT_EQ(p.global_batch, 64);
  EXPECT_EQ(p.accumulation, 1);
  EXPECT_EQ(p.rank_images, 32);
  EXPECT_EQ(p.steps_per_epoch, 1000 / 64);  // the last partial batch dropped
  EXPECT_EQ(p.total_steps, 3 * (1000 / 64));
  EXPECT_FALSE(p.exact());
  EXPECT_EQ(p.chunks(), 0);
}

TEST(RunPlan, UnevenGlobalBatchGivesTheFirstRanksOneMore) {  // Note [Uneven slices]: 100 on 8 ranks
  for (int r = 0; r < 8; ++r) {
    const RunPlan p = plan_run(global(100), job(8, r));
    EXPECT_EQ(p.global_batch, 100);
    EXPECT_EQ(p.batch, 13) << "the model holds the largest slice";
    EXPECT_EQ(p.rank_images, r < 4 ? 13 : 12) << r;
  }
}

TEST(RunPlan, MicroBatchesCountPerRank) {
  Options o = global(90);
  o.accumulation_steps = 2;  // 4 micro-batches: 23, 23, 22, 22
  EXPECT_EQ(plan_run(o, job(2, 0)).rank_images, 46);
  const RunPlan p = plan_run(o, job(2, 1));
  EXPECT_EQ(p.accumulation, 2);
  EXPECT_EQ(p.batch, 23);
  EXPECT_EQ(p.rank_images, 44);
}

TEST(RunPlan, ExactSumsRunOneChunkAtATime) {  // Note [Chunks of the global batch]
  Options o = global(90);
  o.exact_sums = true;
  o.threads = 4;
  const RunPlan p = plan_run(o, job(3, 2));
  EXPECT_TRUE(p.exact());
  EXPECT_EQ(p.exact_chunk, 10);  // the largest divisor of 90 up to 10
  EXPECT_EQ(p.chunks(), 9);
  EXPECT_EQ(p.batch, 10);
  EXPECT_EQ(p.my_chunks.first, 6);
  EXPECT_EQ(p.my_chunks.count, 3);
  EXPECT_EQ(p.rank_images, 30);
  EXPECT_EQ(p.threads, 1) << "one thread per rank";
}

TEST(RunPlan, MaxStepsOverrideEpochs) {
  Options o = per_rank(10);
  o.epochs = 5;
  o.max_steps = 7;
  EXPECT_EQ(plan_run(o, job(1, 0)).total_steps, 7);
}

TEST(RunPlan, ShardingAutoIsOnForTheCpuWithTwoOrMoreRanks) {
  Options o = per_rank(10);
  EXPECT_TRUE(plan_run(o, job(2, 0)).sharded);
  EXPECT_FALSE(plan_run(o, job(1, 0)).sharded);
  JobFacts gpu = job(2, 0);
  gpu.cuda = true;
  EXPECT_FALSE(plan_run(o, gpu).sharded) << "the CUDA path shards only when asked";
  o.shard_optimizer = Options::Sharding::kOn;
  EXPECT_TRUE(plan_run(o, gpu).sharded);
  o.shard_optimizer = Options::Sharding::kOff;
  EXPECT_FALSE(plan_run(o, job(2, 0)).sharded);
  // A compressing codec's sums reach every rank: auto leaves the optimiser whole; on asks for it.
  for (const char* codec : {"bf16", "powersgd", "auto"}) {
    o.grad_compression = codec;
    o.shard_optimizer = Options::Sharding::kAuto;
    EXPECT_FALSE(plan_run(o, job(2, 0)).sharded) << codec;
    o.shard_optimizer = Options::Sharding::kOn;
    EXPECT_TRUE(plan_run(o, job(2, 0)).sharded) << codec;
  }
}

TEST(RunPlan, AutoThreadsAreOnePerRankWhenRanksShareAHost) {
  Options o = per_rank(10);
  EXPECT_EQ(plan_run(o, job(1, 0)).threads, 8);  // every core
  JobFacts shared = job(2, 0);
  shared.local_size = 2;
  EXPECT_EQ(plan_run(o, shared).threads, 1);
  JobFacts unknown = job(1, 0);
  unknown.hardware_threads = 0;
  EXPECT_EQ(plan_run(o, unknown).threads, 1);
  o.threads = 3;
  EXPECT_EQ(plan_run(o, shared).threads, 3);
}

TEST(RunPlan, AGlobalBatchSmallerThanTheMicroBatchesIsRefused) {
  EXPECT_EQ(refusal(global(3), job(4, 0)),
            "--global-batch-size 3 is smaller than the 4 ranks: every micro-batch needs at least one image; give at "
            "least 4");
  Options o = global(6);
  o.accumulation_steps = 2;
  EXPECT_EQ(refusal(o, job(4, 0)),
            "--global-batch-size 6 is smaller than the 4 ranks x 2 accumulation steps (--accumulation-steps 2): every "
            "micro-batch needs at least one image; give a --global-batch-size of at least 8, or lower "
            "--accumulation-steps");
  // More micro-batches than images: the fix is fewer of them.
  EXPECT_EQ(refusal(o, job(4, 0, 7)),
            "--global-batch-size 6 is smaller than the 4 ranks x 2 accumulation steps (--accumulation-steps 2): every "
            "micro-batch needs at least one image; lower --accumulation-steps to at most 1 with 4 ranks");
}

TEST(RunPlan, AGlobalBatchLargerThanTheTrainingSplitIsRefused) {
  EXPECT_EQ(refusal(global(101), job(2, 0, 100)),
            "--global-batch-size 101 is larger than the training split (100 images): give at most 100");
}

// --grad-compression names a row of the codec table (src/train/codecs/codecs.cpp).
TEST(RunPlan, AGradientCodecNotInTheTableIsRefused) {
  Options o = global(100);
  o.grad_compression = "zstd";
  EXPECT_EQ(refusal(o, job(2, 0)), "unknown gradient codec 'zstd' (one of: none, bf16, powersgd[:RANK], auto[:RANK])");
  o.grad_compression = "bf16";
  EXPECT_NO_THROW(plan_run(o, job(2, 0)));
  o.grad_compression = "bf16:2";
  EXPECT_EQ(refusal(o, job(2, 0)), "--grad-compression bf16:2: bf16 takes no rank");
  for (const char* bad : {"powersgd:0", "powersgd:33", "powersgd:x", "powersgd:2x", "powersgd:"}) {
    o.grad_compression = bad;
    EXPECT_EQ(refusal(o, job(2, 0)), std::string("--grad-compression ") + bad +
                                         ": the rank must be a whole number from 1 to 32 (powersgd:2, say)");
  }
  o.grad_compression = "powersgd";
  EXPECT_EQ(find_codec(o.grad_compression).rank, 2);
  EXPECT_EQ(find_codec("powersgd:4").rank, 4);
}

// PowerSGD starts compressing at --compression-start-steps, a tenth of the run's steps when not given.
TEST(RunPlan, CompressionStartsAtATenthOfTheRunUnlessTold) {
  Options o = global(100);
  o.max_steps = 250;
  EXPECT_EQ(plan_run(o, job(2, 0)).compression_start_step, 25);
  o.compression_start_steps = 0;
  EXPECT_EQ(plan_run(o, job(2, 0)).compression_start_step, 0);
  o.compression_start_steps = 400;
  EXPECT_EQ(plan_run(o, job(2, 0)).compression_start_step, 400);
}

TEST(RunPlan, APerRankBatchTooLargeForTheSplitIsRefused) {
  EXPECT_EQ(refusal(per_rank(64), job(2, 0, 100)),
            "the global batch of 128 images (--batch-size 64 x 2 ranks x --accumulation-steps 1) is larger than the "
            "training split (100 images); lower --batch-size, or use fewer ranks");
  Options o = per_rank(64);
  o.accumulation_steps = 2;
  EXPECT_EQ(refusal(o, job(1, 0, 100)),
            "the global batch of 128 images (--batch-size 64 x 1 rank x --accumulation-steps 2) is larger than the "
            "training split (100 images); lower --batch-size or --accumulation-steps");
}

TEST(RunPlan, TheGlobalBatchSizeDecidesWhenGiven) {  // both given: refused earlier, by the options
  Options o = global(40);
  o.batch_size = 1000;
  const RunPlan p = plan_run(o, job(2, 0));
  EXPECT_EQ(p.global_batch, 40);
  EXPECT_EQ(p.batch, 20);
}

TEST(RunPlan, OverflowingSizesAreRefused) {
  const std::int64_t big = std::numeric_limits<std::int64_t>::max() / 2;
  EXPECT_EQ(refusal(per_rank(big), job(4, 0)),
            "the global batch of --batch-size " + std::to_string(big) +
                " x 4 ranks x --accumulation-steps 1 is too large to train (it overflows a 64-bit count)");
  Options o = per_rank(10);
  o.accumulation_steps = big;
  EXPECT_EQ(refusal(o, job(4, 0)), "4 ranks x --accumulation-steps " + std::to_string(big) +
                                       " is too large to train (it overflows a 64-bit count)");
  Options e = per_rank(1);
  e.epochs = big;
  EXPECT_EQ(refusal(e, job(1, 0)),
            "--epochs " + std::to_string(big) + " is too large to train (it overflows a 64-bit count)");
}

TEST(RunPlan, APerRankBatchBeyondAnIntIsRefused) {
  const std::int64_t g = std::int64_t{3} << 31;
  EXPECT_EQ(refusal(global(g), job(1, 0, g)),
            "a batch of " + std::to_string(g) +
                " images per rank is more than this program can hold; give a smaller --batch-size or "
                "--global-batch-size");
}

TEST(RunPlan, AChunkThatDoesNotDivideTheGlobalBatchIsRefused) {
  Options o = global(90);
  o.exact_sums = true;
  o.exact_chunk = 7;
  EXPECT_NE(refusal(o, job(1, 0)).find("90"), std::string::npos);
  o.exact_chunk = 30;  // 3 chunks
  EXPECT_NE(refusal(o, job(4, 0)).find("run on at most 3 ranks"), std::string::npos);
}

TEST(RunPlan, AnEmptyGlobalBatchIsRefused) {  // Options built in code with neither size
  EXPECT_EQ(refusal(Options{}, job(1, 0, 100)),
            "the global batch (0 images) is larger than the training split (100 images); lower --batch-size / "
            "--global-batch-size");
}

}  // namespace
}  // namespace mnist_mpi

namespace mnist_mpi {
namespace {

// Note [Choosing a codec per bucket from the link]: three buckets of 4 MB of floats (2 MB in bf16,
// 40 KB as PowerSGD factors in two sums), ready at 0, 5 and 10 ms, backward ending at 10 ms (the
// last bucket is ready then).
std::vector<BucketCosts> three_buckets() {
  std::vector<BucketCosts> b(3);
  for (int k = 0; k < 3; ++k) b[std::size_t(k)] = {0.005 * k, {4e6, 2e6, 4e4}, {1, 1, 2}};
  return b;
}

TEST(AutoCodec, AFastLinkKeepsTheFloatsWhereTheyHide) {
  // 10 GB/s and 100 us a sum: each bucket's floats take 0.5 ms, the first two end under backward;
  // the last ends 0.5 ms after it, bf16 0.3 ms and PowerSGD 0.204 ms: PowerSGD there only.
  EXPECT_EQ(choose_codecs(three_buckets(), 0.010, {100e-6, 10e9}), (std::vector<int>{0, 0, 2}));
  // 50 GB/s and 10 us: the last bucket's floats end 0.09 ms after backward, less than 2 % of its
  // 10 ms: what compressing it would save is less than its compute may cost. The floats.
  EXPECT_EQ(choose_codecs(three_buckets(), 0.010, {10e-6, 50e9}), (std::vector<int>{0, 0, 0}));
  // A link whose time is all latency (1 ms a sum): bf16 saves 0.2 % of the last bucket's time and
  // PowerSGD's second sum costs more: the floats everywhere.
  EXPECT_EQ(choose_codecs(three_buckets(), 0.010, {1e-3, 1e12}), (std::vector<int>{0, 0, 0}));
}

TEST(AutoCodec, ASlowerLinkCompressesNoMoreThanTheStepNeeds) {
  // 400 MB/s: floats 10 ms a bucket, bf16 5 ms, PowerSGD 0.1 ms. Bucket 0's floats fill backward's
  // 10 ms; buckets 1 and 2 as PowerSGD then end at 10.1 and 10.2 ms. bf16 on bucket 0 would end
  // the last at 10.1 ms: 0.1 ms, less than 2 % of backward, not worth its compute.
  EXPECT_EQ(choose_codecs(three_buckets(), 0.010, {0.0, 400e6}), (std::vector<int>{0, 2, 2}));
  // The same with 0.5 ms a sum (PowerSGD's two sums 1.1 ms): buckets 1 and 2 as PowerSGD end at
  // 6.6 and 11.1 ms after bucket 0 as bf16 (5.5 ms); bucket 0 as PowerSGD would end the last no
  // sooner, so it keeps the lesser compression.
  EXPECT_EQ(choose_codecs(three_buckets(), 0.010, {0.5e-3, 400e6}), (std::vector<int>{1, 2, 2}));
  // 100 MB/s: bf16 takes 20 ms a bucket: PowerSGD everywhere.
  EXPECT_EQ(choose_codecs(three_buckets(), 0.010, {50e-6, 100e6}), (std::vector<int>{2, 2, 2}));
  // Nothing to sum across ranks (an infinitely fast link): the floats.
  EXPECT_EQ(choose_codecs(three_buckets(), 0.010, {0.0, 1e30}), (std::vector<int>{0, 0, 0}));
}

}  // namespace
}  // namespace mnist_mpi
