#!/usr/bin/env bash
# tests/e2e_lib.sh's check that no rank outlived mpirun, on the race it must survive and on the
# fault it must catch (Note [Ranks that mpirun killed]):
#   1. agreed usage errors whose ranks run at nice 19 beside a busy loop on every core (the load
#      that leaves a rank mpirun killed still there when mpirun returns; RUN_SERIAL in CTest):
#      every run passes, and the check had to wait for such a rank (else this test did not make
#      the race);
#   2. a process of the job that nobody killed is named at once;
#   3. a case whose output holds "terminate called" fails.
# Usage: e2e_lib_selftest.sh MNIST_MPI MAKE_SYNTHETIC_MNIST
set -uo pipefail
bin=$1 make_data=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_odls_base_sigkill_timeout=0  # as in the suite (tests/CMakeLists.txt): SIGKILL right after SIGTERM
work=$(mktemp -d)
hogs=""
trap '[ -z "$hogs" ] || kill $hogs 2>/dev/null; rm -rf "$work"' EXIT
"$make_data" "$work/data" 200 100 >/dev/null || { echo "cannot write synthetic data"; exit 1; }
passed=0 failed=0
source "$(dirname "${BASH_SOURCE[0]}")/e2e_lib.sh"  # expect()

for core in $(seq 0 $(($(nproc) - 1))); do
  taskset -c "$core" bash -c 'while :; do :; done' &
  hogs+="$! "
done
# Up to 25 runs, until one has made the race: it did in 4 of 10 runs here (2 vCPUs), so 25 runs
# without it would be a chance of 0.6^25, 3e-6.
runs=0
while [ $runs -lt 25 ] && [ "$killed_waits" -eq 0 ]; do
  runs=$((runs + 1)) i=$runs
  expect "agreed_error_under_load_$i" 2 60 "both name '$work/data/train-images-idx3-ubyte'" -- \
    mpirun -np 2 --oversubscribe nice -n 19 "$bin" --data-dir "$work/data" \
    --max-steps 5 --metrics-file "$work/data/train-images-idx3-ubyte"
done
kill $hogs; wait $hogs 2>/dev/null; hogs=""
echo "the check waited for a rank mpirun had killed in $killed_waits of $runs runs"
if [ "$killed_waits" -eq 0 ]; then
  echo "FAIL: no run left a killed rank behind, so the race was not made"; failed=$((failed + 1))
fi

# A process of the job (it carries $work/data in its command line) that nothing killed.
(exec -a "rank $work/data" sleep 30) &
stray=$!
sleep 0.2
left_behind
if [ "$left" = "$stray " ]; then
  echo "ok   stray_process_is_named: $stray"; passed=$((passed + 1))
else
  echo "FAIL stray_process_is_named: left_behind named '$left', expected '$stray '"; failed=$((failed + 1))
fi
kill "$stray"; wait "$stray" 2>/dev/null

# 3. A case whose output says "terminate called" fails, whatever else it matched.
before=$failed
expect terminate_is_a_failure nz 10 "abort" -- bash -c 'echo "terminate called without an active exception; abort" >&2; exit 134' >/dev/null
if [ $failed -eq $((before + 1)) ]; then
  failed=$before; passed=$((passed + 1)); echo "ok   terminate_is_a_failure"
else
  echo "FAIL terminate_is_a_failure: expect() let a \"terminate called\" through"; failed=$((before + 1))
fi

echo "passed $passed, failed $failed"
[ "$failed" -eq 0 ]
