#!/usr/bin/env bash
# Peer benchmark: mnist_mpi (build/mnist_mpi under mpirun) against PyTorch DDP (bench/torch_ddp.py).
#
#   bench/compare.sh [--model tiny|lenet|all] [--ranks 1|2] [--repeat K] [--max-steps S]
#                    [--epochs E] [--threads T] [--seed N] [--out DIR] [--timeout SEC]
#                    [--ours-only | --pytorch-only]
#
# Run from the repository root. For each model it alternates K times between our program and
# PyTorch (ours, pytorch, ours, pytorch, ...) with the same model, ranks, threads, seed and
# global batch, then prints a table with the median images/s over the repeats, the ratio
# ours/pytorch, the test accuracy (median), the peak RSS per rank (max over repeats) and the
# start-up time (median). Raw per-run JSON lines are kept in DIR/results.jsonl.
set -euo pipefail

PY=/usr/bin/python3
BIN=${MNIST_MPI_BIN:-build/mnist_mpi}  # override for testing
MODELS=tiny
RANKS=2
REPEAT=2
MAX_STEPS=0
EPOCHS=""
THREADS=1
SEED=""
OUT=""
TIMEOUT=0
RUN_OURS=1
RUN_TORCH=1

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "compare.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODELS="$2"; shift 2 ;;
    --ranks) RANKS="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --max-steps) MAX_STEPS="$2"; shift 2 ;;
    --epochs) EPOCHS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --seed) SEED="$2"; shift 2 ;;
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
[[ "$RANKS" =~ ^[1-9][0-9]*$ ]] || die "--ranks must be a positive integer"
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || die "--repeat must be a positive integer"
[[ "$MAX_STEPS" =~ ^[0-9]+$ ]] || die "--max-steps must be a non-negative integer"
[[ -z "$EPOCHS" || "$EPOCHS" =~ ^[0-9]+$ ]] || die "--epochs must be a non-negative integer"
[[ -d bench && -f bench/torch_ddp.py ]] || die "run me from the repository root (bench/torch_ddp.py not found)"
[[ -x "$PY" ]] || die "$PY not found (install Debian's python3-torch and python3-numpy)"
[[ -f data/mnist/train-images-idx3-ubyte || -f data/mnist/train-images-idx3-ubyte.gz ]] \
  || die "data/mnist/train-images-idx3-ubyte not found"

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

# Appends the normalised final record of one of our runs to $RESULTS.
record_ours() {  # model rep metrics_file wall_s
  "$PY" - "$1" "$2" "$3" "$4" "$RANKS" "$THREADS" >> "$RESULTS" <<'EOF'
import json, sys
model, rep, path, wall, ranks, threads = sys.argv[1:7]
final = None
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
if final is None:
    sys.exit(f"compare.sh: no final event in {path}")
rec = {"impl": "ours", "model": model, "repeat": int(rep), "ranks": final.get("world_size", int(ranks)),
       "threads": int(threads)}
for k in ("global_batch", "steps", "epochs", "images_per_s", "test_accuracy", "test_loss",
          "peak_rss_mb", "startup_s", "params_hash", "wall_s"):
    rec[k] = final.get(k)
rec["outer_wall_s"] = float(wall)
print(json.dumps(rec))
EOF
}

json_field() {  # file key
  "$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1]).get(sys.argv[2]) or "")' "$1" "$2"
}

for MODEL in $MODELS; do
  E="${EPOCHS:-$(default_epochs "$MODEL")}"
  S="${SEED:-$(config_seed "$MODEL")}"
  if [[ "$RUN_OURS" == 1 && ! -f "configs/$MODEL.ini" ]]; then
    echo "compare.sh: WARNING: configs/$MODEL.ini not found; skipping our program for $MODEL." >&2
    OURS_THIS=0
  else
    OURS_THIS=$RUN_OURS
  fi
  GB=""  # global batch: taken from our first run so that PyTorch uses the same one
  for ((rep = 1; rep <= REPEAT; rep++)); do
    if [[ "$OURS_THIS" == 1 ]]; then
      MF="$OUT/ours_${MODEL}_r${RANKS}_${rep}.jsonl"
      LOG="$OUT/ours_${MODEL}_r${RANKS}_${rep}.log"
      rm -f "$MF"
      args=(--config "configs/$MODEL.ini" --threads "$THREADS" --max-steps "$MAX_STEPS" --metrics-file "$MF")
      [[ "$MAX_STEPS" == 0 ]] && args+=(--epochs "$E")
      [[ -n "$SEED" ]] && args+=(--seed "$SEED")
      echo "== [$rep/$REPEAT] ours    $MODEL ranks=$RANKS: mpirun -np $RANKS $BIN ${args[*]}" >&2
      t0=$(date +%s.%N)
      if with_timeout env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS="$THREADS" \
          mpirun --oversubscribe -np "$RANKS" --bind-to core "$BIN" "${args[@]}" > "$LOG" 2>&1; then
        t1=$(date +%s.%N)
        if record_ours "$MODEL" "$rep" "$MF" "$("$PY" -c "print($t1-$t0)")"; then
          tail -1 "$RESULTS" >&2
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
      JF="$OUT/pytorch_${MODEL}_r${RANKS}_${rep}.json"
      LOG="$OUT/pytorch_${MODEL}_r${RANKS}_${rep}.log"
      rm -f "$JF"
      targs=(--model "$MODEL" --ranks "$RANKS" --threads "$THREADS" --epochs "$E" --max-steps "$MAX_STEPS"
             --json-file "$JF")
      [[ -n "$S" ]] && targs+=(--seed "$S")
      [[ -n "$GB" ]] && targs+=(--global-batch-size "$GB")
      echo "== [$rep/$REPEAT] pytorch $MODEL ranks=$RANKS: $PY bench/torch_ddp.py ${targs[*]}" >&2
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

echo
"$PY" - "$RESULTS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def med(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None
def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)
groups = {}
for r in rows:
    groups.setdefault((r["model"], r["ranks"]), {}).setdefault(r["impl"], []).append(r)
hdr = ["model", "ranks", "impl", "runs", "gbatch", "steps", "images/s", "ours/pytorch", "test_acc", "peak_rss_mb/rank", "startup_s"]
lines = [hdr]
for (model, ranks), by in sorted(groups.items()):
    ips = {impl: med([r.get("images_per_s") for r in rs]) for impl, rs in by.items()}
    ratio = ips["ours"] / ips["pytorch"] if ips.get("ours") and ips.get("pytorch") else None
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
        lines.append([model, str(ranks), impl, str(len(rs)), "/".join(map(str, gbs)) or "n/a",
                      fmt(med([r.get("steps") for r in rs]), ".0f"),
                      fmt(ips[impl], ".1f"), fmt(ratio, ".2f") if impl == "ours" else "",
                      fmt(med([r.get("test_accuracy") for r in rs]), ".4f"), rss,
                      fmt(med([r.get("startup_s") for r in rs]), ".2f")])
    if by.get("ours") and by.get("pytorch"):
        a = {r.get("global_batch") for r in by["ours"]}; b = {r.get("global_batch") for r in by["pytorch"]}
        if a != b:
            print(f"WARNING: {model} ranks={ranks}: global batch differs (ours {a}, pytorch {b})", file=sys.stderr)
w = [max(len(l[i]) for l in lines) for i in range(len(hdr))]
for i, l in enumerate(lines):
    print("  ".join(c.rjust(w[j]) if j >= 3 else c.ljust(w[j]) for j, c in enumerate(l)))
    if i == 0:
        print("  ".join("-" * x for x in w))
EOF
echo
echo "raw results: $RESULTS (logs in $OUT)"
exit "$FAILED"
