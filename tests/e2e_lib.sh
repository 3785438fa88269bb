# Shared by the end-to-end fault scripts (tests/e2e_faults.sh, tests/e2e_hostile.sh); sourced, not
# run. The caller sets $work (a scratch directory whose path every rank's command line holds, so
# that ranks left behind can be found) and the counters passed=0 failed=0.

# expect NAME CODE MAX_SECONDS PATTERN -- command...   (CODE "nz": any non-zero exit code)
# Runs the command (killed after 120 s), then checks its exit code, that it ended within
# MAX_SECONDS, that its output matches the extended regex PATTERN, and that no rank outlived it.
expect() {
  local name=$1 want=$2 max_s=$3 pattern=$4
  shift 5
  local t0 rc took ok=1
  t0=${EPOCHREALTIME/./}  # microseconds
  timeout 120 "$@" >"$work/out" 2>&1
  rc=$?
  took=$(( (${EPOCHREALTIME/./} - t0) / 100000 ))  # tenths of a second
  took="$((took / 10)).$((took % 10))"
  if [ "$want" = nz ]; then
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then echo "FAIL $name: exit code $rc, expected non-zero (124: hung)"; ok=0; fi
  elif [ "$rc" -ne "$want" ]; then echo "FAIL $name: exit code $rc, expected $want"; ok=0; fi
  if [ "${took%.*}" -ge "$max_s" ]; then echo "FAIL $name: took ${took}s, limit ${max_s}s"; ok=0; fi
  if ! grep -qE -- "$pattern" "$work/out"; then echo "FAIL $name: output lacks /$pattern/"; ok=0; fi
  # No rank may be left behind (stopped or spinning).
  local left  # ranks carry $work in their command line; "dat[a]" keeps grep from finding itself
  left=$(grep -lsE -- "$work/dat[a]" /proc/[0-9]*/cmdline | cut -d/ -f3 | tr '\n' ' ')
  if [ -n "$left" ]; then echo "FAIL $name: process(es) $left outlived mpirun"; ok=0; kill -KILL $left; fi
  if [ $ok -eq 1 ]; then passed=$((passed + 1)); echo "ok   $name (exit $rc, ${took}s)"
  else failed=$((failed + 1)); echo "---- output:"; tail -25 "$work/out"; fi
}
