#!/usr/bin/env bash
# The HTML report where it is used: headless Chromium (Debian's `chromium`,
# installed by scripts/setup.sh) lays out the training-time report (--report, 2 ranks, one of them
# slowed) and a `mnist_mpi report` of two runs, and tests/browser/check_report.html checks what a
# user sees: every chart there, as wide as the page, each series drawn, tick labels round and not
# overlapping, no text running out of a chart, the per-rank chart with one bar per rank; and no
# console error. A negative control (the page told to expect 3 ranks) must fail, so the check can.
# Usage: e2e_browser.sh MNIST_MPI MAKE_SYNTHETIC_MNIST REPO_ROOT
set -uo pipefail
bin=$(realpath "$1") make_data=$2 root=$3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
browser=$(command -v chromium || command -v chromium-browser) || {
  echo "FAIL no chromium: install it (scripts/setup.sh does, from Debian's package 'chromium')"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$make_data" "$work/data" 600 100 || { echo "cannot write synthetic data"; exit 1; }
cp "$root/tests/browser/check_report.html" "$work/"
base=(--data-dir "$work/data" --validation-size 100 --model "conv:3x3:8:same,relu,maxpool:2,flatten,fc:10" --threads 1)
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; [ -n "${2:-}" ] && { echo "---- output:"; tail -20 "$2"; }; }

MNIST_MPI_FAULT=1:slow:10 timeout 120 mpirun -np 2 --oversubscribe -x MNIST_MPI_FAULT "$bin" "${base[@]}" --batch-size 25 \
  --epochs 3 --log-every 5 --eval-every 20 --metrics-file "$work/a.jsonl" --report "$work/train.html" >"$work/a.log" 2>&1 ||
  bad "training with --report" "$work/a.log"
timeout 120 mpirun -np 2 --oversubscribe "$bin" "${base[@]}" --batch-size 25 --epochs 3 --log-every 5 --seed 9 \
  --metrics-file "$work/b.jsonl" >"$work/b.log" 2>&1 || bad "second training" "$work/b.log"
timeout 60 "$bin" report "$work/a.jsonl" "$work/b.jsonl" --out "$work/two.html" >"$work/r.log" 2>&1 ||
  bad "mnist_mpi report" "$work/r.log"

# look NAME PAGE QUERY: the page's verdict (the JSON of #result) in $work/NAME.json, stderr in NAME.err
look() {
  timeout 90 "$browser" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir="$work/profile" \
    --allow-file-access-from-files --enable-logging=stderr \
    --v=0 --virtual-time-budget=10000 --dump-dom "file://$work/check_report.html?report=$2&$3" \
    >"$work/$1.dom" 2>"$work/$1.err"
  sed -n 's|.*<pre id="result">\(.*\)</pre>.*|\1|p' "$work/$1.dom" >"$work/$1.json"
}
verdict() {  # NAME: "ok", or the failures
  python3 - "$work/$1.json" "$work/$1.err" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read().strip()
try:
    v = json.loads(text)
except ValueError:
    print("the page gave no verdict: " + text[:200]); sys.exit()
errors = [l for l in open(sys.argv[2], errors="replace") if re.search(r"CONSOLE.*(Uncaught|Error|error)", l)]
problems = v["failures"] + ["console: " + e.strip() for e in errors]
print("ok" if not problems else "; ".join(problems)[:2000])
PY
}
charts="charts=loss|accuracy|images/s|time%20per%20step%20by%20rank|compute%20per%20step%20by%20rank"
look train train.html "ranks=2&$charts"
v=$(verdict train)
[ "$v" = ok ] && ok "training-time report in Chromium: charts, series, round ticks, 2 ranks, no console error" ||
  bad "training-time report in Chromium: $v"
look two two.html "ranks=2&charts=loss|accuracy|images/s"
v=$(verdict two)
[ "$v" = ok ] && ok "report of two runs in Chromium" || bad "report of two runs in Chromium: $v"
look control train.html "ranks=3&$charts"
v=$(verdict control)
case "$v" in
  *"2 ranks drawn, 3 expected"*) ok "negative control: a wrong rank count fails the check" ;;
  *) bad "negative control did not fail: $v" ;;
esac
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
