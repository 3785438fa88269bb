// MNIST_MPI_CHECK_RANGE(p, n, write): in a file the sanitized build compiles without
// AddressSanitizer's per-access checks, the one check of a whole array that stands for them.
#pragma once

#include <cstddef>

// Note [Hot loops checked by their ranges]
// Under AddressSanitizer every load and store is checked against the shadow memory, and a loop
// with checks in it does not vectorise: the fixed-point conversion of --exact-sums
// (src/backend/fixed_point.cpp) took 19 % of a lenet --exact-sums run under ASan (perf, 2 ranks,
// 12 steps, 2026-12-07) against 2.8 % of the same run in the normal build. A loop that reads and
// writes exactly a[0, n), b[0, n), ... makes the same accesses as one check of each whole range.
// So the sanitized build compiles such a file without ASan's instrumentation (-fno-sanitize=address
// and -DMNIST_MPI_ASAN_RANGES in CMakeLists.txt; UndefinedBehaviorSanitizer stays), and every
// pass in it calls MNIST_MPI_CHECK_RANGE(a, n, write) for each array it touches first: a range that
// reaches into memory ASan has poisoned (past an allocation, freed, a stack redzone) is reported as
// ASan reports a bad access, with the address, the allocation and the stack, and the process
// ends. (A function attribute, no_sanitize_address, on the loops alone was tried: GCC then inlines
// no instrumented function into them, std::max and std::bit_cast became calls, and the loop took
// longer than before.) Only for files whose loops index their arrays by the loop's own i in [0, n);
// the death test ExactSum.HostPassesRangesAreCheckedUnderAddressSanitizer shows an array one
// element short caught in each direction.
#if defined(MNIST_MPI_ASAN_RANGES)
#include <sanitizer/asan_interface.h>
namespace mnist_mpi {
[[gnu::noinline]] inline void asan_check_range(const void* p, std::size_t bytes, bool write) {
  if (void* bad = __asan_region_is_poisoned(const_cast<void*>(p), bytes))
    __asan_report_error(__builtin_return_address(0), __builtin_frame_address(0), __builtin_frame_address(0), bad,
                        write ? 1 : 0, 1);
}
}  // namespace mnist_mpi
#define MNIST_MPI_CHECK_RANGE(p, n, write) \
  ::mnist_mpi::asan_check_range((p), static_cast<std::size_t>(n) * sizeof(*(p)), (write))
#else
#define MNIST_MPI_CHECK_RANGE(p, n, write) static_cast<void>(0)
#endif
