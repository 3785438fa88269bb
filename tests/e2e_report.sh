#!/usr/bin/env bash
# End-to-end tests of seeing training: short runs on synthetic data with --tensorboard-dir,
# --timeline and --report, checked by tests/check_observability.py against the run's metrics file;
# the progress output on and off a terminal (a pty from util-linux's `script`); bad paths fail at
# setup with exit 2; nothing is written that was not asked for; and an output that cannot be written
# is reported once while the run goes on to exit code 7 (Note [When an output cannot be written]).
# Usage: e2e_report.sh MNIST_MPI MAKE_SYNTHETIC_MNIST REPO_ROOT
set -uo pipefail
bin=$(realpath "$1") make_data=$2 root=$3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$make_data" "$work/data" 600 100 || { echo "cannot write synthetic data"; exit 1; }
py=python3; [ -x /usr/bin/python3 ] && py=/usr/bin/python3  # Debian's, with python3-protobuf (scripts/setup.sh)
check_py="$py $root/tests/check_observability.py"
small="conv:3x3:4:same,relu,maxpool:2,flatten,fc:10"  # 5 layers
base=(--data-dir "$work/data" --validation-size 100 --model "$small" --threads 1 --epochs 2)
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; [ -n "${2:-}" ] && { echo "---- output:"; tail -20 "$2"; }; }
buckets_of() { grep -oE "gradients: [0-9]+ bucket" "$1" | grep -oE "[0-9]+"; }

# 1. Everything on, 2 ranks, several buckets in flight at once.
out=$work/run1
mkdir -p "$out"
if timeout 120 mpirun -np 2 --oversubscribe "$bin" "${base[@]}" --batch-size 25 --log-every 5 --eval-every 10 \
     --bucket-mb 0.005 --first-bucket-mb 0.002 --metrics-file "$out/m.jsonl" \
     --tensorboard-dir "$out/tb" --timeline "$out/timeline.json" --report "$out/report.html" >"$out/log" 2>&1; then
  ok "run with --tensorboard-dir --timeline --report"
  if $check_py --metrics "$out/m.jsonl" --ranks 2 --steps 20 --buckets "$(buckets_of "$out/log")" --layers 5 \
       --timeline "$out/timeline.json" --tensorboard "$out/tb" --report "$out/report.html" >"$out/check" 2>&1; then
    ok "$(tr '\n' ';' <"$out/check")"
  else bad "observability files" "$out/check"; fi
  if grep -q "where the time went" "$out/log" && grep -qE "^  exposed communication +[0-9.]+ +[0-9.]+%" "$out/log"; then
    ok "summary table printed"
  else bad "no summary table" "$out/log"; fi
  if ! grep -q $'\r' "$out/log" && grep -qE "^epoch 1 step 5/20 loss [0-9.]+ lr 0.001 [0-9]+ img/s$" "$out/log"; then
    ok "not a terminal: plain lines at --log-every, no bar"
  else bad "progress lines off a terminal" "$out/log"; fi
  if ls "$out/timeline.json.tmp" "$out/report.html.tmp" >/dev/null 2>&1; then bad "temporary files left"; else ok "no temporary files left"; fi
else bad "run with every output" "$out/log"; fi

# 2. 3 ranks, gradient accumulation and one blocking sum (unsharded: sharding is the CPU's default on
# 2+ ranks): still one allreduce span per bucket per step.
out=$work/run2
mkdir -p "$out"
if timeout 120 mpirun -np 3 --oversubscribe "$bin" "${base[@]}" --batch-size 10 --accumulation-steps 2 --no-overlap \
     --shard-optimizer off --max-steps 6 --log-every 3 --metrics-file "$out/m.jsonl" --timeline "$out/t.json" >"$out/log" 2>&1 &&
   $check_py --metrics "$out/m.jsonl" --ranks 3 --steps 6 --buckets "$(buckets_of "$out/log")" --layers 5 --micro 2 \
     --timeline "$out/t.json" >"$out/check" 2>&1; then
  ok "3 ranks, --accumulation-steps 2, --no-overlap: $(tr '\n' ';' <"$out/check")"
else bad "timeline with accumulation and no overlap" "$out/log"; cat "$out/check" 2>/dev/null; fi

# 3. Nothing asked for, nothing written: the working directory stays empty.
mkdir -p "$work/empty"
before=$(find "$work/data" -newer "$work/data" | wc -l)
if (cd "$work/empty" && timeout 120 mpirun -np 2 --oversubscribe "$bin" "${base[@]}" --batch-size 25 --max-steps 4 >"$work/run3.log" 2>&1) &&
   [ -z "$(ls -A "$work/empty")" ] && [ "$(find "$work/data" -newer "$work/data" | wc -l)" = "$before" ]; then
  ok "no option, no file: the working directory stays empty"
else bad "files written without being asked for: $(ls -A "$work/empty")" "$work/run3.log"; fi

# 4. On a terminal (a pty from `script`): a live bar redrawn with \r, ETA, no plain step lines.
if command -v script >/dev/null; then
  script -qec "mpirun -np 2 --oversubscribe $bin ${base[*]} --batch-size 25 --log-every 5" /dev/null >"$work/tty.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && grep -q $'\r'"epoch 1 \[" "$work/tty.log" && grep -qE "epoch 2 \[#{24}\] 10/10 loss [0-9.]+ [0-9]+ img/s took" "$work/tty.log" &&
     grep -q "ETA\|took" "$work/tty.log" && ! grep -qE "step 5/20 loss" "$work/tty.log" &&
     grep -q "epoch 1 step 10: validation accuracy" "$work/tty.log"; then
    ok "on a terminal: a progress bar per epoch, evaluation lines below it"
  else bad "progress bar on a terminal (exit $rc)" "$work/tty.log"; fi
  # mpirun gives its ranks a pty even when its own output goes to a file: still plain lines.
  script -qec "mpirun -np 2 --oversubscribe $bin ${base[*]} --batch-size 25 --log-every 5 >$work/redirected.log 2>&1" /dev/null >/dev/null 2>&1
  if ! grep -q $'\r' "$work/redirected.log" && grep -q "epoch 1 step 5/20 loss" "$work/redirected.log"; then
    ok "mpirun's output to a file from a terminal: plain lines (Note [Is rank 0 on a terminal?])"
  else bad "progress with mpirun redirected to a file" "$work/redirected.log"; fi
else
  echo "skip terminal tests: no 'script' (util-linux)"
fi

# 5. Bad paths and values fail at setup: one error line, exit 2 on every rank, nothing left behind.
touch "$work/a_file"
check_bad() {  # NAME PATTERN -- options...
  local name=$1 pattern=$2
  shift 3
  timeout 60 mpirun -np 2 --oversubscribe "$bin" "${base[@]}" --batch-size 25 "$@" >"$work/bad.out" 2>"$work/bad.err"
  local rc=$?
  if [ $rc -eq 2 ] && [ "$(grep -c "mnist_mpi: error" "$work/bad.err")" = 1 ] && grep -qE -- "$pattern" "$work/bad.err"; then
    ok "$name (exit 2)"
  else bad "$name: exit $rc" "$work/bad.err"; fi
}
check_bad timeline_dir_missing "--timeline '$work/nodir/t.json': its directory .* does not exist" -- --timeline "$work/nodir/t.json"
check_bad report_is_a_directory "--report '$work' is a directory" -- --report "$work"
check_bad tensorboard_under_a_file "--tensorboard-dir: cannot create the directory" -- --tensorboard-dir "$work/a_file/tb"
check_bad progress_value "--progress must be auto, bar or lines" -- --progress fancy
mkfifo "$work/fifo"  # opening it for writing would block until a reader comes
check_bad metrics_is_a_directory "--metrics-file '$work' is a directory" -- --metrics-file "$work"
check_bad metrics_is_a_fifo "--metrics-file '$work/fifo' is a FIFO" -- --metrics-file "$work/fifo"
check_bad tensorboard_is_a_fifo "--tensorboard-dir '$work/fifo' is a FIFO .*not a directory" -- --tensorboard-dir "$work/fifo"

# 6. An output that cannot be written: one warning naming it when it fails, the run finishes, the
# summary lists it, and every rank exits 7. The timeline and the report go through a link to
# /dev/full: a rename of PATH.tmp onto the link replaces only the link (the old code did that, and
# onto /dev/full itself as root it would replace the device node).
ln -s /dev/full "$work/full"
check_lost() {  # NAME WHAT FILE -- command...; stdout goes to $lost_stdout
  local name=$1 what=$2 file=$3 out=${lost_stdout:-$work/lost.out}
  shift 4
  timeout 60 "$@" >"$out" 2>"$work/lost.err"
  local rc=$?
  if [ $rc -eq 7 ] && [ "$(grep -c "mnist_mpi:" "$work/lost.err")" = 1 ] &&
     grep -qF "mnist_mpi: warning: cannot write $what '$file': write: No space left on device" "$work/lost.err" &&
     { [ "$out" = /dev/full ] || grep -qF "outputs lost (training finished; exit code 7):" "$out"; } &&
     { [ "$out" = /dev/full ] || grep -qF "  $what '$file' (write: " "$out"; } && [ -c /dev/full ]; then
    ok "$name (one warning, exit 7)"
  else bad "$name: exit $rc" "$work/lost.err"; fi
}
lost_run=(mpirun -np 2 --oversubscribe "$bin" "${base[@]}" --batch-size 25 --max-steps 4 --log-every 2)
check_lost metrics_on_a_full_disk "the metrics file (--metrics-file)" /dev/full -- \
  "${lost_run[@]}" --metrics-file /dev/full
check_lost timeline_on_a_full_disk "the timeline (--timeline)" "$work/full" -- "${lost_run[@]}" --timeline "$work/full"
check_lost report_on_a_full_disk "the report (--report)" "$work/full" -- "${lost_run[@]}" --report "$work/full"
# stdout on a full disk: rank 0 run directly (under mpirun, stdout is a pipe to mpirun).
lost_stdout=/dev/full check_lost stdout_on_a_full_disk "standard output (progress and summary)" /dev/full -- \
  "$bin" "${base[@]}" --batch-size 25 --max-steps 4 --log-every 2

# 9. Every rank's step times (Note [Naming a straggler] in src/report/ranks.cpp): rank 1
# sleeps 20 ms in every backward (MNIST_MPI_FAULT=1:slow:20) and is named, in the summary, in the
# final event and in the report's per-rank chart (one bar per rank, its own marked); the "ranks"
# events come at every log line with both ranks. An even run names none (300 steps: over 40, a
# hiccup of the shared machine once made a rank 20 % slower, a true but passing straggler).
out=$work/run9
mkdir -p "$out"
if MNIST_MPI_FAULT=1:slow:20 timeout 120 mpirun -np 2 --oversubscribe -x MNIST_MPI_FAULT "$bin" "${base[@]}" \
     --batch-size 25 --max-steps 30 --log-every 10 --metrics-file "$out/m.jsonl" --report "$out/r.html" >"$out/log" 2>&1 &&
   grep -qE "straggler: rank 1 on host [^ ]+: backward [0-9]+ % slower than the median rank" "$out/log" &&
   $py - "$out/m.jsonl" "$out/r.html" <<'PY'
import json, re, sys
events = [json.loads(l) for l in open(sys.argv[1])]
ranks = [e for e in events if e["event"] == "ranks"]
assert [e["step"] for e in ranks] == [10, 20, 30], [e["step"] for e in ranks]
assert all([r["rank"] for r in e["ranks"]] == [0, 1] for e in ranks)
final = [e for e in events if e["event"] == "final"][0]
assert final["straggler"]["rank"] == 1 and final["straggler"]["phase"] == "backward", final["straggler"]
slow, fast = final["ranks"][1], final["ranks"][0]
assert slow["step_ms"]["backward"] > fast["step_ms"]["backward"] + 15, final["ranks"]  # the 20 ms sleep
assert fast["wait_ms"] > 15, final["ranks"]  # rank 0 waited for it
html = open(sys.argv[2]).read()
bars = re.findall(r'<g class="rank" data-rank="(\d+)"[^>]*?( data-straggler="1")?>', html)
assert [(b[0], bool(b[1])) for b in bars] == [("0", False), ("1", True)], bars
assert 'data-name="rank 1 compute"' in html
PY
then ok "a slow rank is named: summary, final event, ranks events, report"
else bad "straggler not named" "$out/log"; fi
# The same under --exact-sums: the sleep is on its passes too, and the exact MAX that waits for the
# slow rank is the others' exposed communication, not their optimizer's compute.
if MNIST_MPI_FAULT=1:slow:20 timeout 120 mpirun -np 2 --oversubscribe -x MNIST_MPI_FAULT "$bin" "${base[@]}" \
     --batch-size 25 --max-steps 30 --log-every 10 --exact-sums >"$out/exact" 2>&1 &&
   grep -qE "straggler: rank 1 on host [^ ]+: backward [0-9]+ % slower than the median rank" "$out/exact"; then
  ok "a slow rank is named under --exact-sums"
else bad "straggler not named under --exact-sums" "$out/exact"; fi
# The even run's two ranks share one core. On a VM one vCPU can be slower than the other for a
# minute at a time, with no steal time to show for it (2026-12-06, 2 vCPUs: one rank a core named
# rank 1 40-64 % slower in 4 of 5 runs of this script, then 0 of 6 a few minutes later; one
# process on each core alone, 47.8k and 46.9k images/s): that is a straggler the tool rightly
# names, not one this check is about. Sharing a core, the ranks take turns (Note [Polling that
# gives way] in src/comm/mpi_communicator.cpp), and a slow core slows both alike: within 0-5 % of
# each other in 9 of 9 runs. A second run still decides, and a real fault names one in both.
even_run() {
  timeout 120 taskset -c 0 mpirun -np 2 --oversubscribe --bind-to none "$bin" "${base[@]}" --batch-size 100 \
    --max-steps 300 --log-every 100 >"$out/even$1" 2>&1 && grep -q "straggler: none" "$out/even$1"
}
if even_run ""; then
  ok "an even run names no straggler"
elif echo "the first even run: $(grep -o 'straggler: .*' "$out/even")" && even_run 2; then
  ok "an even run names no straggler (the second run; the first named one, above)"
else bad "an even run named a straggler twice" "$out/even2"; fi

# 10. `mnist_mpi report`: the straggler run's and an even run's metrics files in one
# page, each labelled (they share config and ranks, so the seed tells them apart); one file gives
# the training-time report's charts. A truncated file, one from another version, one without its
# final event and a missing --out are refused with one line naming the file and line (exit 3 / 2).
out=$work/run10
mkdir -p "$out"
timeout 120 mpirun -np 2 --oversubscribe "$bin" "${base[@]}" --batch-size 25 --max-steps 20 --log-every 10 --seed 7 \
  --metrics-file "$out/even.jsonl" >/dev/null 2>&1
if timeout 60 "$bin" report "$work/run9/m.jsonl" "$out/even.jsonl" --out "$out/both.html" >"$out/log" 2>&1 &&
   grep -q "report: $out/both.html (2 runs)" "$out/log" &&
   grep -q '>time per step by rank: conv:3x3:4:same,relu,maxpool:2,flatten,fc:10, 2 ranks, seed 42<' "$out/both.html" &&
   grep -q 'data-name="conv:3x3:4:same,relu,maxpool:2,flatten,fc:10, 2 ranks, seed 7: training loss"' "$out/both.html" &&
   grep -q 'data-straggler="1"' "$out/both.html"; then
  ok "report of two runs: overlaid, labelled by what differs"
else bad "report of two runs" "$out/log"; fi
if timeout 60 "$bin" report "$work/run9/m.jsonl" --out "$out/one.html" >"$out/log1" 2>&1 &&
   grep -q 'class="chart" data-title="compute per step by rank"' "$out/one.html"; then
  ok "report of one run: the training-time report's charts"
else bad "report of one run" "$out/log1"; fi
# A one-rank run says so, in the overlay too (its straggler line had been left blank there).
timeout 60 "$bin" "${base[@]}" --batch-size 25 --max-steps 4 --log-every 2 --metrics-file "$out/single.jsonl" >/dev/null 2>&1
if timeout 60 "$bin" report "$out/single.jsonl" "$out/even.jsonl" --out "$out/mixed.html" >/dev/null 2>&1 &&
   grep -q 'straggler: none (one rank)' "$out/mixed.html"; then ok "report of a one-rank run beside another: 'none (one rank)'"
else bad "report of a one-rank run beside another"; fi
refused() {  # NAME CODE PATTERN -- args
  local name=$1 want=$2 pattern=$3
  shift 4
  timeout 60 "$bin" report "$@" >"$out/r.out" 2>"$out/r.err"
  local rc=$?
  if [ "$rc" -eq "$want" ] && grep -qE -- "$pattern" "$out/r.err" && [ "$(grep -c "mnist_mpi report: error" "$out/r.err")" -eq 1 ]; then
    ok "report refuses $name (exit $rc)"
  else bad "report $name: exit $rc" "$out/r.err"; fi
}
head -c "$(( $(wc -c <"$out/even.jsonl") - 40 ))" "$out/even.jsonl" >"$out/cut.jsonl"
refused "a truncated file" 3 "cut.jsonl:[0-9]+: not a line of JSON" -- "$out/cut.jsonl" --out "$out/x.html"
sed '1s/"format":1,//' "$out/even.jsonl" >"$out/old.jsonl"
refused "another version's file" 3 "old.jsonl:1: a metrics file of an earlier version" -- "$out/old.jsonl" --out "$out/x.html"
grep -v '"event":"final"' "$out/even.jsonl" >"$out/unfinished.jsonl"
refused "a file without its final event" 3 "unfinished.jsonl: ends at line [0-9]+ without the run's final event" -- \
  "$out/unfinished.jsonl" --out "$out/x.html"
sed '2s/"step":[0-9]*/"step":"five"/' "$out/even.jsonl" >"$out/edited.jsonl"
refused "a field of the wrong type" 3 "edited.jsonl:2: the field \"step\" is not a whole number" -- \
  "$out/edited.jsonl" --out "$out/x.html"
refused "a missing --out" 2 "give one or more metrics files and --out FILE.html" -- "$out/even.jsonl"
# Note [No output is an input]: --out naming one of its metrics files is refused before anything
# is written; a FIFO (or a directory) is refused by name, not read (it would block).
cp "$out/even.jsonl" "$out/keep.jsonl"
refused "--out over its own metrics file" 2 "--out .*keep.jsonl" -- "$out/keep.jsonl" --out "$out/keep.jsonl"
cmp -s "$out/even.jsonl" "$out/keep.jsonl" || bad "report --out over its input changed the input"
mkfifo "$out/fifo.jsonl"
refused "a FIFO as a metrics file" 3 "fifo.jsonl.* FIFO" -- "$out/fifo.jsonl" --out "$out/x.html"
[ -e "$out/x.html" ] && bad "a refused report wrote its file"  # after every refusal that named x.html

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
