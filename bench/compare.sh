#!/usr/bin/env bash
# Peer benchmark: mnist_mpi (build/mnist_mpi under mpirun) against PyTorch DDP (bench/torch_ddp.py).
#
#   bench/compare.sh [--model tiny|lenet|all] [--setups "2x1 1x2"] [--ranks R --threads T]
#                    [--repeat K] [--max-steps S] [--epochs E] [--eval-every N] [--target-acc A]
#                    [--seed N] [--data-dir DIR] [--out DIR] [--timeout SEC] [--ours-only | --pytorch-only]
#
# Run from the repository root. For each model and setup (RANKSxTHREADS: 2 ranks of 1 thread,
# 1 rank of 2 threads) it alternates K times between our program and PyTorch (ours, pytorch,
# ours, ...) with the same model, ranks, threads, seed and global batch, then prints a table:
# median steady images/s, the ratio ours/pytorch, the fraction of the machine's limit (FLOPs per
# training image from the layer shapes x images/s over the sgemm rate of the same cores, timed
# by build/gemm_rate in this run), the time to reach --target-acc test accuracy, the test
# accuracy, peak RSS per rank and start-up time. Raw per-run JSON lines: DIR/results.jsonl.
# Each run is cut off after --timeout seconds (default 3600, 0 = no limit) and counted as failed.
set -euo pipefail

PY=/usr/bin/python3
BIN=${MNIST_MPI_BIN:-build/mnist_mpi}  # override for testing
MODELS=tiny
SETUPS="2x1 1x2"
RANKS=""
REPEAT=2
MAX_STEPS=0
EPOCHS=""
THREADS=""
EVAL_EVERY=""
TARGET_ACC=""
SEED=""
DATA_DIR=data/mnist
OUT=""
TIMEOUT=3600  # a run that hangs is cut off and counted as failed; 0 = no limit
RUN_OURS=1
RUN_TORCH=1

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "compare.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODELS="$2"; shift 2 ;;
    --setups) SETUPS="$2"; shift 2 ;;
    --ranks) RANKS="$2"; shift 2 ;;
    --eval-every) EVAL_EVERY="$2"; shift 2 ;;
    --target-acc) TARGET_ACC="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --max-steps) MAX_STEPS="$2"; shift 2 ;;
    --epochs) EPOCHS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --seed) SEED="$2"; shift 2 ;;
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --ours-only) RUN_TORCH=0; shift ;;
    --pytorch-only) RUN_OURS=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done

[[ "$MODELS" == all ]] && MODELS="tiny lenet"
for m in $MODELS; do [[ "$m" == tiny || "$m" == lenet ]] || die "--model must be tiny, lenet or all"; done
if [[ -n "$RANKS" || -n "$THREADS" ]]; then SETUPS="${RANKS:-2}x${THREADS:-1}"; fi
for su in $SETUPS; do [[ "$su" =~ ^[1-9][0-9]*x[1-9][0-9]*$ ]] || die "setup '$su' is not RANKSxTHREADS (e.g. 2x1)"; done
[[ -z "$EVAL_EVERY" || "$EVAL_EVERY" =~ ^[0-9]+$ ]] || die "--eval-every must be a non-negative integer"
[[ -z "$TARGET_ACC" || "$TARGET_ACC" =~ ^0?\.[0-9]+$ ]] || die "--target-acc must be a fraction such as 0.96"
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || die "--repeat must be a positive integer"
[[ "$MAX_STEPS" =~ ^[0-9]+$ ]] || die "--max-steps must be a non-negative integer"
[[ -z "$EPOCHS" || "$EPOCHS" =~ ^[0-9]+$ ]] || die "--epochs must be a non-negative integer"
[[ -d bench && -f bench/torch_ddp.py ]] || die "run me from the repository root (bench/torch_ddp.py not found)"
[[ -x "$PY" ]] || die "$PY not found (install Debian's python3-torch and python3-numpy)"
[[ -f "$DATA_DIR/train-images-idx3-ubyte" || -f "$DATA_DIR/train-images-idx3-ubyte.gz" ]] \
  || die "$DATA_DIR/train-images-idx3-ubyte not found (fetch it with scripts/fetch_mnist.sh or give --data-dir)"

if [[ "$RUN_OURS" == 1 ]]; then
  if [[ ! -x "$BIN" ]]; then
    echo "compare.sh: WARNING: $BIN is missing or not executable (build it first:" \
         "cmake -B build && cmake --build build); running the PyTorch half only." >&2
    RUN_OURS=0
  elif ! command -v mpirun >/dev/null 2>&1; then
    echo "compare.sh: WARNING: mpirun not found on PATH; running the PyTorch half only." >&2
    RUN_OURS=0
  fi
fi
[[ "$RUN_OURS" == 1 || "$RUN_TORCH" == 1 ]] || die "nothing to run"

if [[ -z "$OUT" ]]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/mnist_compare.XXXXXX"); fi
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
FAILED=0

with_timeout() {
  if [[ "$TIMEOUT" != 0 ]]; then timeout "$TIMEOUT" "$@"; else "$@"; fi
}

default_epochs() { if [[ "$1" == tiny ]]; then echo 2; else echo 1; fi; }

# seed = N from the model's ini (any section), if present.
config_seed() {
  local ini="configs/$1.ini"
  [[ -f "$ini" ]] || return 0
  sed -n 's/^[[:space:]]*seed[[:space:]]*=[[:space:]]*\([0-9][0-9]*\).*$/\1/p' "$ini" | head -1
}

# Appends the normalised final record of one of our runs (with its test evaluations) to $RESULTS.
record_ours() {  # model rep metrics_file wall_s ranks threads
  "$PY" - "$1" "$2" "$3" "$4" "$5" "$6" >> "$RESULTS" <<'EOF'
import json, sys
model, rep, path, wall, ranks, threads = sys.argv[1:7]
final, evals = None, []
with open(path) as f:
    for line in f:
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("event") == "final":
            final = obj
        elif obj.get("event") == "eval" and obj.get("split") == "test":
            evals.append([obj.get("step"), obj.get("accuracy")])
if final is None:
    sys.exit(f"compare.sh: no final event in {path}")
rec = {"impl": "ours", "model": model, "repeat": int(rep), "ranks": final.get("world_size", int(ranks)),
       "threads": int(threads)}
for k in ("global_batch", "steps", "epochs", "images_per_s", "test_accuracy", "test_loss",
          "peak_rss_mb", "startup_s", "params_hash", "wall_s"):
    rec[k] = final.get(k)
rec["evals"] = evals
rec["outer_wall_s"] = float(wall)
print(json.dumps(rec))
EOF
}

json_field() {  # file key
  "$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1]).get(sys.argv[2]) or "")' "$1" "$2"
}

# The machine's limit: oneDNN sgemm on as many threads as the widest setup uses (best of a few calls).
LIMIT_THREADS=1
for su in $SETUPS; do r=${su%x*}; t=${su#*x}; if (( r * t > LIMIT_THREADS )); then LIMIT_THREADS=$((r * t)); fi; done
measure_gemm() {  # tag
  local gr=${GEMM_RATE_BIN:-build/gemm_rate}
  if [[ -x "$gr" ]]; then
    echo "== sgemm rate ($1), $LIMIT_THREADS threads: $gr" >&2
    if OMP_NUM_THREADS=$LIMIT_THREADS OMP_PROC_BIND=close OMP_PLACES=cores "$gr" --threads "$LIMIT_THREADS" \
        --seconds 3 > "$OUT/gemm_$1.json" 2>&1; then
      "$PY" -c 'import json,sys; r=json.loads(open(sys.argv[1]).read()); r["impl"]="gemm"; r["when"]=sys.argv[2]; print(json.dumps(r))' \
        "$OUT/gemm_$1.json" "$1" >> "$RESULTS"
      tail -1 "$RESULTS" >&2
    else
      echo "compare.sh: WARNING: $gr failed: $(tail -1 "$OUT/gemm_$1.json")" >&2
    fi
  else
    echo "compare.sh: WARNING: $gr not built; the limit column will be n/a" >&2
  fi
}
measure_gemm before

for MODEL in $MODELS; do
 for SETUP in $SETUPS; do
  R=${SETUP%x*}
  T=${SETUP#*x}
  E="${EPOCHS:-$(default_epochs "$MODEL")}"
  S="${SEED:-$(config_seed "$MODEL")}"
  EV="${EVAL_EVERY:-50}"
  if [[ "$RUN_OURS" == 1 && ! -f "configs/$MODEL.ini" ]]; then
    echo "compare.sh: WARNING: configs/$MODEL.ini not found; skipping our program for $MODEL." >&2
    OURS_THIS=0
  else
    OURS_THIS=$RUN_OURS
  fi
  # Placement: each rank on its own cores (one core per thread), its OpenMP threads kept there.
  if [[ "$T" == 1 ]]; then bind=(--bind-to core); else bind=(--map-by "slot:PE=$T" --bind-to core); fi
  GB=""  # global batch: taken from our first run so that PyTorch uses the same one
  for ((rep = 1; rep <= REPEAT; rep++)); do
    if [[ "$OURS_THIS" == 1 ]]; then
      MF="$OUT/ours_${MODEL}_${SETUP}_${rep}.jsonl"
      LOG="$OUT/ours_${MODEL}_${SETUP}_${rep}.log"
      rm -f "$MF"
      args=(--config "configs/$MODEL.ini" --threads "$T" --max-steps "$MAX_STEPS" --metrics-file "$MF"
            --eval-every "$EV" --data-dir "$DATA_DIR")
      [[ "$MAX_STEPS" == 0 ]] && args+=(--epochs "$E")
      [[ -n "$SEED" ]] && args+=(--seed "$SEED")
      echo "== [$rep/$REPEAT] ours    $MODEL ${R}x${T}: mpirun -np $R ${bind[*]} $BIN ${args[*]}" >&2
      t0=$(date +%s.%N)
      if with_timeout env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS="$T" \
          OMP_PROC_BIND=close OMP_PLACES=cores \
          mpirun --oversubscribe -np "$R" "${bind[@]}" "$BIN" "${args[@]}" > "$LOG" 2>&1; then
        t1=$(date +%s.%N)
        if record_ours "$MODEL" "$rep" "$MF" "$("$PY" -c "print($t1-$t0)")" "$R" "$T"; then
          tail -1 "$RESULTS" | cut -c1-300 >&2
          [[ -z "$GB" ]] && GB=$(json_field "$RESULTS" global_batch)
        else
          echo "compare.sh: ERROR: could not read our metrics from $MF (log: $LOG)" >&2; FAILED=1
        fi
      else
        echo "compare.sh: ERROR: our run failed (rc=$?); last lines of $LOG:" >&2
        tail -15 "$LOG" >&2 || true
        FAILED=1
      fi
    fi
    if [[ "$RUN_TORCH" == 1 ]]; then
      JF="$OUT/pytorch_${MODEL}_${SETUP}_${rep}.json"
      LOG="$OUT/pytorch_${MODEL}_${SETUP}_${rep}.log"
      rm -f "$JF"
      targs=(--model "$MODEL" --ranks "$R" --threads "$T" --epochs "$E" --max-steps "$MAX_STEPS"
             --eval-every "$EV" --data-dir "$DATA_DIR" --json-file "$JF")
      [[ -n "$S" ]] && targs+=(--seed "$S")
      [[ -n "$GB" ]] && targs+=(--global-batch-size "$GB")
      echo "== [$rep/$REPEAT] pytorch $MODEL ${R}x${T}: $PY bench/torch_ddp.py ${targs[*]}" >&2
      if with_timeout "$PY" bench/torch_ddp.py "${targs[@]}" > "$LOG" 2>&1 && [[ -s "$JF" ]]; then
        "$PY" -c 'import json,sys; r=json.loads(open(sys.argv[1]).read()); r["repeat"]=int(sys.argv[2]); print(json.dumps(r))' \
          "$JF" "$rep" >> "$RESULTS"
        grep '^pytorch ' "$LOG" >&2 || true
      else
        echo "compare.sh: ERROR: PyTorch run failed; last lines of $LOG:" >&2
        tail -15 "$LOG" >&2 || true
        FAILED=1
      fi
    fi
  done
 done
done
measure_gemm after

echo
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
"$PY" - "$RESULTS" "$TARGET_ACC" <<'EOF'
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
target_arg = sys.argv[2]
DEFAULT_TARGET = {"tiny": 0.96, "lenet": 0.97}


def med(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def model_spec(model):
    try:
        for line in open(f"configs/{model}.ini"):
            m = re.match(r"\s*model\s*=\s*(\S+)", line)
            if m:
                return m.group(1)
    except OSError:
        pass
    return None


def train_flops_per_image(spec):
    """2 x multiply-adds of the conv and fc layers: forward + backward-data (not for the first
    layer, which computes no input gradient) + backward-weights. Pooling, ReLU, bias, loss and the
    optimiser are left out (a few percent at most)."""
    c, h, w = 1, 28, 28
    total, first = 0.0, True
    for tok in spec.split(","):
        p = tok.split(":")
        if p[0] == "conv":
            kh, kw = map(int, p[1].split("x"))
            o = int(p[2])
            same = len(p) > 3 and p[3] == "same"
            s = int(p[4][1:]) if len(p) > 4 else 1
            oh = -(-h // s) if same else (h - kh) // s + 1
            ow = -(-w // s) if same else (w - kw) // s + 1
            total += 2.0 * kh * kw * c * o * oh * ow * (2 if first else 3)
            c, h, w, first = o, oh, ow, False
        elif p[0] == "fc":
            o = int(p[1])
            total += 2.0 * c * h * w * o * (2 if first else 3)
            c, h, w, first = o, 1, 1, False
        elif p[0] == "maxpool":
            k = int(p[1])
            s = int(p[2]) if len(p) > 2 else k
            h, w = (h - k) // s + 1, (w - k) // s + 1
    return total


def time_to(r, target):
    """Start-up plus the training time of the steps until the first test evaluation at or above
    target, at the run's steady rate (evaluations excluded); None if never reached."""
    ips, gb = r.get("images_per_s"), r.get("global_batch")
    for step, acc in r.get("evals") or []:
        if isinstance(acc, (int, float)) and acc >= target and ips and gb:
            return (r.get("startup_s") or 0.0) + step * gb / ips
    return None


gemm = [r for r in rows if r.get("impl") == "gemm"]
limit = max((r["gflops"] for r in gemm), default=None)
groups = {}
for r in rows:
    if r.get("impl") in ("ours", "pytorch"):
        groups.setdefault((r["model"], r["ranks"], r.get("threads", 1)), {}).setdefault(r["impl"], []).append(r)
hdr = ["model", "ranks x thr", "impl", "runs", "gbatch", "steps", "images/s", "ours/pt", "GFLOP/s", "of limit",
       "time to acc s", "test_acc", "peak_rss_mb/rank", "startup_s"]
lines = [hdr]
for (model, ranks, threads), by in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
    ips = {impl: med([r.get("images_per_s") for r in rs]) for impl, rs in by.items()}
    ratio = ips["ours"] / ips["pytorch"] if ips.get("ours") and ips.get("pytorch") else None
    spec = model_spec(model)
    fpi = train_flops_per_image(spec) if spec else None
    target = float(target_arg) if target_arg else DEFAULT_TARGET.get(model, 0.96)
    for impl in ("ours", "pytorch"):
        rs = by.get(impl)
        if not rs:
            continue
        rss_lists = [r.get("peak_rss_mb") for r in rs if isinstance(r.get("peak_rss_mb"), list)]
        if rss_lists:
            n = max(len(l) for l in rss_lists)
            rss = "/".join(fmt(max(l[i] for l in rss_lists if i < len(l)), ".0f") for i in range(n))
        else:
            rss = "n/a"
        gbs = sorted({r.get("global_batch") for r in rs if r.get("global_batch") is not None})
        gflops = ips[impl] * fpi * 1e-9 if ips[impl] and fpi else None
        lines.append([model, f"{ranks}x{threads}", impl, str(len(rs)), "/".join(map(str, gbs)) or "n/a",
                      fmt(med([r.get("steps") for r in rs]), ".0f"),
                      fmt(ips[impl], ".1f"), fmt(ratio, ".2f") if impl == "ours" else "",
                      fmt(gflops, ".1f"), fmt(gflops / limit if gflops and limit else None, ".0%"),
                      fmt(med([time_to(r, target) for r in rs]), ".1f") + f" (>={target:g})",
                      fmt(med([r.get("test_accuracy") for r in rs]), ".4f"), rss,
                      fmt(med([r.get("startup_s") for r in rs]), ".2f")])
    if by.get("ours") and by.get("pytorch"):
        a = {r.get("global_batch") for r in by["ours"]}; b = {r.get("global_batch") for r in by["pytorch"]}
        if a != b:
            print(f"WARNING: {model} {ranks}x{threads}: global batch differs (ours {a}, pytorch {b})", file=sys.stderr)
w = [max(len(l[i]) for l in lines) for i in range(len(hdr))]
for i, l in enumerate(lines):
    print("  ".join(c.rjust(w[j]) if j >= 3 else c.ljust(w[j]) for j, c in enumerate(l)))
    if i == 0:
        print("  ".join("-" * x for x in w))
print()
for model in sorted({k[0] for k in groups}):
    spec = model_spec(model)
    if spec:
        print(f"{model}: {train_flops_per_image(spec) / 1e6:.2f} MFLOP per training image "
              "(conv + fc: forward, backward-data, backward-weights)")
if gemm:
    print("limit: sgemm " + ", ".join(f"{r['when']} {r['gflops']:.1f} GFLOP/s ({r['threads']} threads, n={r['n']})"
                                      for r in gemm) + f"; the best, {limit:.1f}, is the limit")
EOF
echo
echo "raw results: $RESULTS (logs in $OUT)"
exit "$FAILED"
