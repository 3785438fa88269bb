// Preemption signals (Note [The preemption flag] in src/resilience/preemption.cpp): once installed,
// SIGTERM / SIGINT / SIGUSR1 are blocked in the installing thread and in every thread it starts,
// one thread of their own records them, and a storm of them while oneDNN's JIT GEMM runs (the
// kernel that corrupted the heap when a signal landed in it: slurm_requeue aborted with
// "corrupted size vs. prev_size") leaves the heap and the results intact.
#include <gtest/gtest.h>
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "mnist_mpi/resilience/preemption.hpp"

namespace mnist_mpi {
namespace {

bool blocked_here(int signo) {
  sigset_t cur;
  sigemptyset(&cur);
  pthread_sigmask(SIG_BLOCK, nullptr, &cur);
  return sigismember(&cur, signo) == 1;
}

// Waits up to 5 s for the flag.
int wait_for_flag() {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (preemption_signal() == 0 && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return preemption_signal();
}

TEST(Preemption, SignalsAreBlockedInComputeThreadsAndStillRecorded) {
  install_preemption_handlers();
  install_preemption_handlers();  // idempotent: one signal thread
  clear_preemption_signal();
  for (int s : {SIGTERM, SIGINT, SIGUSR1}) EXPECT_TRUE(blocked_here(s)) << signal_name(s);
  bool child_blocked = false;
  std::thread([&] { child_blocked = blocked_here(SIGUSR1) && blocked_here(SIGTERM); }).join();
  EXPECT_TRUE(child_blocked) << "a thread started after the install must inherit the mask";

  ASSERT_EQ(kill(getpid(), SIGUSR1), 0);
  EXPECT_EQ(wait_for_flag(), SIGUSR1);
  // The first signal wins until the flag is cleared.
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(preemption_signal(), SIGUSR1);
  clear_preemption_signal();
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  EXPECT_EQ(wait_for_flag(), SIGTERM);
  clear_preemption_signal();
  EXPECT_STREQ(signal_name(SIGINT), "SIGINT");
  EXPECT_STREQ(signal_name(SIGHUP), ("signal " + std::to_string(SIGHUP)).c_str());
}

// The fc:1024 layer's GEMM shape at 50 images per rank (the slurm_requeue model), run for about
// a second while another thread sends SIGUSR1 to the process every ~20 us. Before the signal
// thread, a handler on the computing thread corrupted the heap: glibc aborted a few frees later.
TEST(Preemption, SignalStormDuringJitGemmKeepsHeapAndResultsIntact) {
  install_preemption_handlers();
  clear_preemption_signal();
  constexpr dnnl_dim_t M = 50, N = 1024, K = 3136;
  std::vector<float> a(M * K), b(K * N), c(M * N), first(M * N);
  std::srand(7);
  for (auto& v : a) v = static_cast<float>(std::rand() % 17 - 8) / 8.0f;
  for (auto& v : b) v = static_cast<float>(std::rand() % 13 - 6) / 16.0f;
  ASSERT_EQ(dnnl_sgemm('N', 'N', M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, first.data(), N), dnnl_success);

  std::atomic<bool> stop{false};
  std::atomic<long> sent{0};
  std::thread storm([&] {
    while (!stop.load()) {
      if (kill(getpid(), SIGUSR1) == 0) ++sent;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(1200);
  int calls = 0, differing = 0;
  while (std::chrono::steady_clock::now() < end) {
    ASSERT_EQ(dnnl_sgemm('N', 'N', M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N), dnnl_success);
    if (std::memcmp(c.data(), first.data(), c.size() * sizeof(float)) != 0) ++differing;
    ++calls;
    // Exercise the allocator the way a training step does, so a damaged heap shows at once.
    std::vector<std::vector<char>> churn;
    for (int i = 0; i < 16; ++i) churn.emplace_back(static_cast<std::size_t>(64 << (i % 12)), static_cast<char>(i));
  }
  stop = true;
  storm.join();
  EXPECT_GT(sent.load(), 1000) << "the storm did not happen";
  EXPECT_GT(calls, 10);
  EXPECT_EQ(differing, 0) << "GEMM results changed under signals";
  EXPECT_EQ(wait_for_flag(), SIGUSR1);
  clear_preemption_signal();
}

}  // namespace
}  // namespace mnist_mpi
