#!/usr/bin/env bash
# The whole test suite: set up (packages, build), fetch MNIST (for the real-data test), then CTest:
# unit tests, multi-rank tests under mpirun with 1 to 4 ranks, and end-to-end tests. Then the suite
# again under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan; all but the slurm, gpu,
# model_use, real_data and multinode labels), the rank's threads under ThreadSanitizer (build-tsan), and each libFuzzer
# target for a bounded time (build-fuzz, clang). Prints each stage's time at the end.
# MNIST_MPI_SANITIZERS=0 runs only the normal suite. Arguments go to the normal suite's ctest.
# At the end: every test that skipped and why (tests/skipped.py), and each stage's time.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

times=()
t0=$(date +%s)
last=$t0
stage() {  # closes the stage before (its time) and names the next
  local now
  now=$(date +%s)
  [ -z "${current:-}" ] || times+=("$(printf '  %-58s %4d s' "$current" $((now - last)))")
  current=$1
  last=$now
  [ -z "$1" ] || echo "== $1 ($(date +%T))"
}
junit=()  # STAGE=FILE: each suite's results, for the list of what skipped (tests/skipped.py)
summary() {
  stage ""
  if [ ${#junit[@]} -gt 0 ]; then
    echo "== skipped tests, and why"
    python3 tests/skipped.py "${junit[@]}" || true
  fi
  echo "== stage times"
  printf '%s\n' "${times[@]}"
  printf '  %-58s %4d s\n' "total" $(($(date +%s) - t0))
}
trap summary EXIT

stage "set-up: packages and the build (scripts/setup.sh test)"
scripts/setup.sh test
stage "MNIST (scripts/fetch_mnist.sh)"
scripts/fetch_mnist.sh
stage "the suite: build/"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Two tests at a time (the whole suite passed so with -j2 here, Slurm tests serialised by RESOURCE_LOCK).
junit+=("normal=$root/build/ctest-results.xml")
rm -f "$root/build/ctest-results.xml"  # not an earlier run's
ctest --test-dir build --output-on-failure --timeout 900 -j"$(nproc)" --output-junit "$root/build/ctest-results.xml" "$@"
[ "${MNIST_MPI_SANITIZERS:-1}" = 1 ] || exit 0

jobs=$(nproc)
supp="$root/tests/sanitizers"

# Leaks checked with the fast unwinder's short stacks: Open MPI's blocks are not counted or are
# named by their first frame (tests/sanitizers/lsan.supp). Set for the build too: it runs
# unit_tests (MPI_Init) to list the tests.
asan_env=(ASAN_OPTIONS="detect_leaks=1:detect_odr_violation=0"
          LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
          UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp")
# CPU code only (nvcc takes no -fsanitize, and nothing runs CUDA here); the Slurm tests exercise
# the job scripts, not the program, and the gpu tests only skip here: both stay in the normal run.
# So do the multinode tests: they place the same program's ranks on network stacks of their own
# (Open MPI's TCP between them); what they run of ours the e2e scripts run here.
stage "AddressSanitizer + UndefinedBehaviorSanitizer: build-asan"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Release -DMNIST_MPI_CUDA=OFF -DMNIST_MPI_SANITIZE=address,undefined >/dev/null
env "${asan_env[@]}" cmake --build build-asan -j"$jobs"
stage "AddressSanitizer + UndefinedBehaviorSanitizer: the suite"
junit+=("ASan+UBSan=$root/build-asan/ctest-results.xml")
rm -f "$root/build-asan/ctest-results.xml"
env "${asan_env[@]}" ctest --test-dir build-asan --output-on-failure --timeout 900 -j"$jobs" -LE "slurm|gpu|model_use|real_data|multinode" \
  --output-junit "$root/build-asan/ctest-results.xml"

stage "ThreadSanitizer: build-tsan (thread_tests)"
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Release -DMNIST_MPI_CUDA=OFF -DMNIST_MPI_SANITIZE=thread >/dev/null
cmake --build build-tsan -j"$jobs" --target thread_tests
stage "ThreadSanitizer: thread_tests on 2 and 3 ranks"
junit+=("TSan=$root/build-tsan/ctest-results.xml")
rm -f "$root/build-tsan/ctest-results.xml"
TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp" \
  ctest --test-dir build-tsan --output-on-failure --timeout 600 -L threads --output-junit "$root/build-tsan/ctest-results.xml"

stage "libFuzzer: build-fuzz"
cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DMNIST_MPI_FUZZ=ON >/dev/null
cmake --build build-fuzz -j"$jobs"
stage "libFuzzer: each target for its bounded time"
ctest --test-dir build-fuzz --output-on-failure -j"$jobs" -L fuzz  # one core each
