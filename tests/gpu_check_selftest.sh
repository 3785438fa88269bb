#!/usr/bin/env bash
# shellcheck disable=SC2034  # the settings assigned here are gpu_check.sh's, read by its functions
# scripts/gpu_check.sh's budget, timeouts and verdicts, without a GPU and without the program: it
# sources the script (which then runs nothing) and drives its stage runner with stand-in stages.
# Checks that the budget table fits the total and one device command; that a stage past its
# timeout is reported TIMEOUT (its processes killed) and the next stages still run; that a stage
# left with too little time is reported "not run: out of time"; that a budget is cut to what is
# left; that gtest output with every test skipped, or none run, is a FAIL (also through the real
# gpu_tests stage with a stand-in binary); and the bundle size check. A few seconds.
#
# Usage: tests/gpu_check_selftest.sh [REPO_ROOT]
set -uo pipefail
repo=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export GPU_CHECK_UNPACK_ROOT=$tmp/unpack
# shellcheck source=/dev/null
source "$repo/scripts/gpu_check.sh"
set +e

failures=0
check() {  # DESCRIPTION COMMAND...
  if "${@:2}"; then
    echo "ok   $1"
  else
    echo "FAIL $1"
    failures=$((failures + 1))
  fi
}
has() { grep -qF -- "$2" "$1"; }                     # FILE TEXT
tsv_is() { grep -q -- "^$2"$'\t'"$3"$'\t' "$1/stages.tsv"; }  # OUT STAGE RESULT

# --- The budget table
real_table=$budget_table real_total=$total_s
sum=$(budget_sum)
first=$(budget_stages | head -n 1)
check "the table's budgets sum to $sum s, at most 420 s" test "$sum" -le 420
check "the total deadline ($total_s s) is at most 420 s and covers the table" test "$total_s" -le 420 -a "$sum" -le "$total_s"
check "smoke is the first stage, at most 60 s ($first)" test "${first%% *}" = smoke -a "${first##* }" -le 60
while read -r name secs; do
  check "stage $name has a body and a positive budget" test "$(type -t "stage_$name")" = function -a "$secs" -gt 0
done < <(budget_stages)
nfiles=$(($(budget_stages | wc -l) + 2))
check "at most 8 files in \$OUT (a log per stage, stages.tsv, summary.txt: $nfiles)" test "$nfiles" -le 8

# --- The runner, with stand-in stages
cat >"$tmp/stages.sh" <<EOF
source "$repo/scripts/gpu_check.sh"
stage_quick() { note "fine"; }
stage_hang() { sleep 30 & echo \$! >"\$GPU_CHECK_WORK/hang.pid"; note "waiting"; wait; }
stage_fails() { echo "some output"; note "broke"; return 3; }
stage_after() { note "ran after the timeout"; }
stage_slow() { sleep 30; }
stage_next() { note "should not run"; }
EOF
stage_source=$tmp/stages.sh
gpu_env() { :; }  # no CUDA library search: nothing here loads one

# A: a stage past its timeout, then a failing one, then one that passes.
out=$tmp/a/out work=$tmp/a/work total_s=30 min_stage_s=1 grace_s=1
budget_table=$'quick 5 a\nhang 1 b\nfails 5 c\nafter 5 d'
start=$SECONDS
(run) >"$tmp/a.txt" 2>&1
rc=$?
check "a run with a failed stage exits non-zero" test "$rc" -ne 0
check "quick: PASS" tsv_is "$out" quick PASS
check "hang: TIMEOUT after its 1 s" tsv_is "$out" hang TIMEOUT
check "hang: its start line names its budget" has "$tmp/a.txt" "== stage hang start (budget 1 s)"
check "hang: its end line says TIMEOUT" has "$tmp/a.txt" "== stage hang end: TIMEOUT"
check "hang: its note says where it was" has "$out/stages.tsv" "killed at its 1 s timeout; last: waiting"
# (Killed means gone or a zombie: an orphan may wait for a PID 1 that does not reap.)
pid=$(cat "$work/hang.pid" 2>/dev/null)
state=$(awk '{ print $3 }' "/proc/$pid/stat" 2>/dev/null)
check "hang: the process it started was killed with it (pid ${pid:-?}, state ${state:-gone})" test -n "$pid" -a "${state:-Z}" = Z
[ -n "$pid" ] && [ "${state:-Z}" != Z ] && kill "$pid"
check "fails: FAIL with its note" grep -qE $'^fails\tFAIL\t[0-9]+\t5\tbroke$' "$out/stages.tsv"
check "fails: its output is in \$OUT/fails.log" has "$out/fails.log" "some output"
check "after: still runs after a TIMEOUT and a FAIL" tsv_is "$out" after PASS
check "the summary is written and names what failed" has "$out/summary.txt" "gpu_check: FAIL: hang TIMEOUT, fails FAIL"
check "scenario A took under 10 s ($((SECONDS - start)) s)" test $((SECONDS - start)) -lt 10

# B: the deadline: a budget cut to what is left, then a stage with no time left.
out=$tmp/b/out work=$tmp/b/work total_s=3 min_stage_s=1 grace_s=1
budget_table=$'slow 10 a\nnext 5 b'
(run) >"$tmp/b.txt" 2>&1
check "slow: its budget is cut to what is left of 3 s" grep -qE "== stage slow start \(budget [1-3] s, cut from 10 s" "$tmp/b.txt"
check "slow: TIMEOUT" tsv_is "$out" slow TIMEOUT
check "next: not run: out of time" grep -qE $'^next\tNOT_RUN\t0\t5\tnot run: out of time$' "$out/stages.tsv"
check "next: says so when it is skipped" has "$tmp/b.txt" "== stage next not run: out of time"
check "next: its body did not run" test ! -e "$out/next.log"
check "the summary is printed after it" has "$tmp/b.txt" "gpu_check: FAIL: slow TIMEOUT, next NOT_RUN"

# --- gtest verdicts
gtest_log() {  # FILE OK_COUNT FAILED_COUNT SKIPPED_COUNT
  local i
  {
    echo "[==========] Running tests."
    for ((i = 0; i < $2; i++)); do printf '[ RUN      ] Gpu.Ok%d\n[       OK ] Gpu.Ok%d (12 ms)\n' "$i" "$i"; done
    for ((i = 0; i < $3; i++)); do printf '[ RUN      ] Gpu.Bad%d\nx.cpp:1: Failure\n[  FAILED  ] Gpu.Bad%d (3 ms)\n' "$i" "$i"; done
    for ((i = 0; i < $4; i++)); do
      printf '[ RUN      ] Gpu.Skip%d\n/src/tests/test_gpu.cpp:82: Skipped\n%s\n\n[  SKIPPED ] Gpu.Skip%d (0 ms)\n' \
        "$i" "no usable GPU: no NVIDIA driver is loaded, or it is older than this build's CUDA runtime needs" "$i"
    done
    echo "[==========] done."
    echo "[  PASSED  ] $2 tests."
    (($4)) && echo "[  SKIPPED ] $4 tests, listed below:"
    for ((i = 0; i < $4; i++)); do echo "[  SKIPPED ] Gpu.Skip$i"; done
    (($3)) && echo "[  FAILED  ] $3 tests, listed below:"
    for ((i = 0; i < $3; i++)); do echo "[  FAILED  ] Gpu.Bad$i"; done
  } >"$1"
}
verdict() {  # LOG RC -> the note; returns gtest_verdict's status
  local rc
  : >"$tmp/note"
  STAGE_NOTE=$tmp/note gtest_verdict "$1" "$2" >/dev/null
  rc=$?
  cat "$tmp/note"
  return "$rc"
}
gtest_log "$tmp/skipped.txt" 0 0 12
v=$(verdict "$tmp/skipped.txt" 0)
check "every test skipped, exit code 0: FAIL" test $? -ne 0
check "... and the note says so, with the reason ($v)" grep -qF "every test skipped (0 passed, 0 failed, 12 skipped): 12 x no usable GPU: no NVIDIA driver" <<<"$v"
: >"$tmp/none.txt"
v=$(verdict "$tmp/none.txt" 0)
check "no test ran: FAIL ($v)" test $? -ne 0 -a "$v" = "no test ran (exit code 0)"
gtest_log "$tmp/some.txt" 2 0 1
v=$(verdict "$tmp/some.txt" 0)
check "2 passed, 1 skipped: PASS ($v)" test $? -eq 0
check "... with the skip reason in the note" grep -qF "2 passed, 0 failed, 1 skipped (skipped: 1 x no usable GPU" <<<"$v"
# As under mpirun, where stdout is a pseudo-terminal and gtest colours its result lines.
sed -E 's/^\[/\x1b[0;32m[/; s/\] /] \x1b[m/' "$tmp/some.txt" >"$tmp/coloured.txt"
check "the coloured log really has colour codes" grep -q $'\x1b\[0;32m\[       OK \] \x1b\[m' "$tmp/coloured.txt"
v=$(verdict "$tmp/coloured.txt" 0)
check "coloured: 2 passed, 1 skipped: PASS ($v)" test $? -eq 0 -a "${v%% (*}" = "2 passed, 0 failed, 1 skipped"
gtest_log "$tmp/failed.txt" 3 1 0
v=$(verdict "$tmp/failed.txt" 1)
check "a failed test: FAIL ($v)" test $? -ne 0 -a "$v" = "3 passed, 1 failed, 0 skipped (exit code 1)"
gtest_log "$tmp/crashed.txt" 3 0 0
v=$(verdict "$tmp/crashed.txt" 139)
check "all passed but the binary crashed: FAIL ($v)" test $? -ne 0

# The real gpu_tests stage, with a stand-in gpu_tests that skips everything (a driver too old).
mkdir -p "$GPU_CHECK_UNPACK_ROOT/mnist_gpu/bin"
printf '#!/bin/sh\ncat %q\n' "$tmp/skipped.txt" >"$GPU_CHECK_UNPACK_ROOT/mnist_gpu/bin/gpu_tests"
chmod +x "$GPU_CHECK_UNPACK_ROOT/mnist_gpu/bin/gpu_tests"
out=$tmp/c/out work=$tmp/c/work total_s=30 min_stage_s=1 stage_source=$repo/scripts/gpu_check.sh
budget_table='gpu_tests 10 x'
(run) >"$tmp/c.txt" 2>&1
check "stage gpu_tests with every test skipped: FAIL" grep -qE $'^gpu_tests\tFAIL\t[0-9]+\t10\tevery test skipped' "$out/stages.tsv"

# --- Two ranks on one GPU as NCCL hosts of their own (nccl_hosts_on_one_gpu, in stage gpu_np2),
# with stand-ins under the real mpirun: each rank records its NCCL_HOSTID; gpu_tests prints NCCL's
# socket channel line unless told not to; mnist_mpi writes a params_hash by its options.
bin=$GPU_CHECK_UNPACK_ROOT/mnist_gpu/bin
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1  # CI runs as root
cat >"$bin/gpu_tests" <<STANDIN
#!/bin/sh
echo "\$NCCL_HOSTID" >"$tmp/hostid.\${OMPI_COMM_WORLD_RANK:-x}"
[ "\${STANDIN_NO_SOCKET:-0}" = 1 ] || echo "host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0"
cat "$tmp/some.txt"
STANDIN
cat >"$bin/mnist_mpi" <<'STANDIN'
#!/bin/bash
m= h=1111111111111111
for a in "$@"; do case $a in --exact-sums) h=2222222222222222 ;; esac; done
prev=; for a in "$@"; do [ "$prev" = --metrics-file ] && m=$a; prev=$a; done
[ -n "${OMPI_COMM_WORLD_SIZE:-}" ] && echo "ranks share GPUs, each its own NCCL host (NCCL_HOSTID): gradients summed by NCCL"
[ -n "${OMPI_COMM_WORLD_SIZE:-}" ] && [[ " $* " == *" --shard-optimizer on "* ]] && h=${STANDIN_SHARDED_HASH:-$h}
[ "${OMPI_COMM_WORLD_RANK:-0}" = 0 ] && echo "{\"event\":\"final\",\"params_hash\":\"$h\"}" >"$m"
exit 0
STANDIN
chmod +x "$bin/gpu_tests" "$bin/mnist_mpi"
nccl_case() {  # NAME VAR=VALUE: runs nccl_hosts_on_one_gpu with VAR set; its note in $tmp/NAME.note
  local name=$1
  mkdir -p "$tmp/$name"
  : >"$tmp/$name.note"
  (export "$2"; work=$tmp/$name b=$GPU_CHECK_UNPACK_ROOT/mnist_gpu STAGE_NOTE=$tmp/$name.note; nccl_hosts_on_one_gpu) \
    >"$tmp/$name.txt" 2>&1
}
nccl_case nccl_ok STANDIN_NONE=1
rc=$?
check "NCCL hosts: passes with the stand-ins ($(tail -n 1 "$tmp/nccl_ok.note"))" test "$rc" -eq 0
[ "$rc" -eq 0 ] || tail -n 20 "$tmp/nccl_ok.txt"
check "... each rank had its own NCCL_HOSTID ($(cat "$tmp/hostid.0" "$tmp/hostid.1" 2>/dev/null | tr '\n' ' '))" \
  test -s "$tmp/hostid.0" -a -s "$tmp/hostid.1" -a "$(cat "$tmp/hostid.0" 2>/dev/null)" != "$(cat "$tmp/hostid.1" 2>/dev/null)"
nccl_case nccl_nosocket STANDIN_NO_SOCKET=1
rc=$?
check "NCCL hosts: no channel via NET/Socket in NCCL's log: FAIL" test "$rc" -ne 0 -a -n "$(grep 'via NET/Socket' "$tmp/nccl_nosocket.note")"
nccl_case nccl_hash STANDIN_SHARDED_HASH=3333333333333333
rc=$?
check "NCCL hosts: the sharded 2-rank hash not the 1-rank one: FAIL" test "$rc" -ne 0 -a -n "$(grep '2 sharded 3333333333333333' "$tmp/nccl_hash.note")"

# --- The bundle's size
mib=$((1024 * 1024))
check "a 30 MiB bundle with a 2 MiB tree fits" eval "bundle_fits $((30 * mib)) $((2 * mib)) >/dev/null"
msg=$(bundle_fits $((62 * mib)) $((3 * mib)))
check "a 62 MiB bundle with a 3 MiB tree does not" test $? -ne 0
check "... and it says how big each is ($msg)" grep -qF "the bundle is 62 MiB and the working tree that travels with it 3 MiB: more than the 64 MiB" <<<"$msg"

budget_table=$real_table total_s=$real_total
if ((failures)); then
  echo "gpu_check_selftest: $failures check(s) failed"
  for f in a b c; do [ -f "$tmp/$f.txt" ] && { echo "--- run $f:"; cat "$tmp/$f.txt"; }; done
  exit 1
fi
echo "gpu_check_selftest: all checks passed"
