#!/usr/bin/env bash
# The HTML report where it is used: headless Chromium (Debian's `chromium`,
# installed by scripts/setup.sh) lays out the training-time report (--report, 2 ranks, one of them
# slowed) and a `mnist_mpi report` of two runs, and tests/browser/check_report.html checks what a
# user sees: every chart there, as wide as the page, each series drawn, tick labels round and not
# overlapping, no text running out of a chart, every chart with a series drawn, the per-rank chart
# with one bar per rank; and no console error. A long run (200,000 steps, one loss spike) is drawn
# by `mnist_mpi report` into a page of at most 3 MB, in time, with the spike drawn to its height.
# Negative controls (the page told to expect 3 ranks, a page with a chart's series cut out, a
# spike higher than the one drawn) must fail, so the check can.
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

# A long run (Note [A bounded sample that keeps the extremes] in src/report/html_report.cpp): 200,000
# steps logged, in the shape of the first training's metrics file (its start, step, ranks,
# validation and final events, with times and values that vary), a loss spike of 9.5 at step
# 120,007. A ranks event every 10 steps, not at every step as --log-every 1 writes them: the
# per-rank series are still long enough to thin, and the file is a quarter the size, so that a
# sanitizer's build too reads it well within a generous 60 s.
python3 - "$work/a.jsonl" "$work/long.jsonl" <<'PY' || bad "writing a long run's metrics file"
import json, math, sys
events = [json.loads(l) for l in open(sys.argv[1])]
first = lambda kind: next(e for e in events if e["event"] == kind)
start, step, ranks, ev, final = (first(k) for k in ("start", "step", "ranks", "eval", "final"))
n, per_epoch = 200000, 1000
start.update(steps_per_epoch=per_epoch, total_steps=n)
final.update(steps=n, epochs=n // per_epoch)
line = lambda e: json.dumps(e, separators=(",", ":")) + "\n"
with open(sys.argv[2], "w") as f:
    f.write(line(start))
    for s in range(1, n + 1):
        loss = 9.5 if s == 120007 else 0.05 + 2.25 * math.exp(-s / 20000) + 0.02 * math.sin(s * 0.37)
        f.write(line(dict(step, step=s, epoch=(s - 1) // per_epoch + 1, loss=loss, lr=0.001,
                          images_per_s=70000 + 2000 * math.sin(s / 977))))
        if s % 10 == 0:
            scale = [1 + 0.2 * math.sin(s / 1000 + r["rank"]) for r in ranks["ranks"]]
            f.write(line(dict(ranks, step=s, ranks=[dict(r, compute_ms=r["compute_ms"] * k, wait_ms=r["wait_ms"] * k,
                                                         step_ms={p: v * k for p, v in r["step_ms"].items()})
                                                    for r, k in zip(ranks["ranks"], scale)])))
        if s % 2000 == 0:
            f.write(line(dict(ev, step=s, epoch=s // per_epoch, accuracy=0.99 - 0.5 * math.exp(-s / 20000),
                              loss=0.04 + 1.5 * math.exp(-s / 20000))))
    f.write(line(final))
PY
began=$SECONDS
timeout 120 "$bin" report "$work/long.jsonl" --out "$work/long.html" >"$work/l.log" 2>&1 ||
  bad "mnist_mpi report of a long run" "$work/l.log"
took=$((SECONDS - began)) bytes=$(stat -c %s "$work/long.html" 2>/dev/null || echo 0)
[ "$bytes" -gt 0 ] && [ "$bytes" -le 3000000 ] && [ "$took" -le 60 ] &&
  ok "a long run's report: $bytes bytes in ${took}s" ||
  bad "a long run's report: $bytes bytes (3 MB at most) in ${took}s (60 at most)"
# A chart with no series: train.html with the images/s line cut out.
python3 - "$work/train.html" "$work/noseries.html" <<'PY' || bad "cutting a series out of the report"
import re, sys
html, cut = re.subn(r'<g class="series" data-name="images/s \(all ranks\)".*?</g>', "", open(sys.argv[1]).read())
assert cut == 1, cut
open(sys.argv[2], "w").write(html)
PY

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
look long long.html "ranks=2&spike=9.5&$charts"
v=$(verdict long)
[ "$v" = ok ] && ok "a long run's report in Chromium, the loss spike drawn" || bad "a long run's report in Chromium: $v"
look control train.html "ranks=3&$charts"
v=$(verdict control)
case "$v" in
  *"2 ranks drawn, 3 expected"*) ok "negative control: a wrong rank count fails the check" ;;
  *) bad "negative control did not fail: $v" ;;
esac
look noseries noseries.html "ranks=2&$charts"
v=$(verdict noseries)
case "$v" in
  *"images/s: no series drawn"*) ok "negative control: a chart with no series fails the check" ;;
  *) bad "negative control (no series) did not fail: $v" ;;
esac
look nospike long.html "ranks=2&spike=19&$charts"
v=$(verdict nospike)
case "$v" in
  *"not the spike 19"*) ok "negative control: a spike the page does not draw fails the check" ;;
  *) bad "negative control (spike) did not fail: $v" ;;
esac
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
