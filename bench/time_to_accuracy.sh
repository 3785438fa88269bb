#!/usr/bin/env bash
# Time to accuracy, wall clock: a config's recipe (configs/NAME.ini: fast, lenet, tiny, or a path)
# with mnist_mpi and with PyTorch DDP (bench/torch_ddp.py --config: the model built from the same
# layer spec, the same initialisers, optimiser, schedule, batch, budget, data split and data order),
# alternating in one run, one round per seed.
#
#   bench/time_to_accuracy.sh [--config NAME] [--target A] [--ranks R] [--eval-every N] [--epochs E]
#                             [--repeat K | --seeds "S1 S2 ..."] [--data-dir DIR] [--out DIR]
#                             [--ours-only | --pytorch-only]
#
# Run from the repository root. Without --target each run trains the config's whole budget (its
# epochs) and the figure is the wall time of that run with its test accuracy (e.g. the fast
# recipe, seeds 1-5). With --target both sides stop by one rule: the ranks evaluate the validation
# split (the last 5000 training images) every N steps and at each epoch's end, and every rank stops
# when it reaches A; E epochs is the cap. Each round runs ours, then PyTorch. Printed per run and
# as medians: the wall time of the whole command as the shell saw it (launcher, start-up, training,
# the checks, the final test evaluation and exit), the time to the stop decision from the process
# start (ours: the first line of main on rank 0; PyTorch: the launcher's process start), the step,
# the test accuracy at that point, and the ratio PyTorch / ours of the shell wall times. Where the
# 99 % check falls is luck of the random numbers: --seeds runs one round per seed (both sides with
# that seed; --repeat K repeats seed 42), and the table adds the median over the rounds of each
# round's own ratio.
set -euo pipefail

PY=/usr/bin/python3
BIN=${MNIST_MPI_BIN:-build/mnist_mpi}
CONFIG=lenet
TARGET=""
RANKS=2
EVAL_EVERY=110  # 5 checks per epoch of 550 steps (global batch 100)
EPOCHS=10
REPEAT=2
SEEDS=""
DATA_DIR=data/mnist
OUT=""
RUN_OURS=1
RUN_TORCH=1

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "time_to_accuracy.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG="$2"; shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    --ranks) RANKS="$2"; shift 2 ;;
    --eval-every) EVAL_EVERY="$2"; shift 2 ;;
    --epochs) EPOCHS="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --seeds) SEEDS="$2"; shift 2 ;;
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --ours-only) RUN_TORCH=0; shift ;;
    --pytorch-only) RUN_OURS=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option: $1" ;;
  esac
done
[[ -z "$TARGET" || "$TARGET" =~ ^0?\.[0-9]+$ ]] || die "--target must be a fraction such as 0.99"
if [[ -f "$CONFIG" ]]; then CONFIG_FILE=$CONFIG; else CONFIG_FILE=configs/$CONFIG.ini; fi
[[ -f "$CONFIG_FILE" ]] || die "no config $CONFIG (neither a file nor configs/$CONFIG.ini)"
[[ "$RANKS" =~ ^[1-9][0-9]*$ && "$EVAL_EVERY" =~ ^[1-9][0-9]*$ && "$EPOCHS" =~ ^[1-9][0-9]*$ &&
   "$REPEAT" =~ ^[1-9][0-9]*$ ]] || die "--ranks, --eval-every, --epochs and --repeat must be positive integers"
if [[ -n "$SEEDS" ]]; then
  for s in $SEEDS; do [[ "$s" =~ ^[0-9]+$ ]] || die "--seeds must be non-negative integers, e.g. \"42 1 2\""; done
  read -r -a SEED_LIST <<< "$SEEDS"
else
  SEED_LIST=(); for ((k = 0; k < REPEAT; k++)); do SEED_LIST+=(42); done
fi
REPEAT=${#SEED_LIST[@]}
[[ -f bench/torch_ddp.py && -d configs ]] || die "run me from the repository root"
[[ "$RUN_OURS" == 0 || -x "$BIN" ]] || die "$BIN not found: build it first (or give --pytorch-only)"
[[ "$RUN_TORCH" == 0 || -x "$PY" ]] || die "$PY not found (install Debian's python3-torch and python3-numpy)"

if [[ -z "$OUT" ]]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/mnist_tta.XXXXXX"); fi
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
now() { date +%s.%N; }

# One JSON line per run: impl, shell wall time, and the run's own target fields.
record() {  # impl rep seed shell_wall_s file (ours: metrics JSONL; pytorch: its JSON)
  "$PY" - "$@" >> "$RESULTS" <<'EOF'
import json, sys
impl, rep, seed, wall, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
final = None
for line in open(path):
    try:
        obj = json.loads(line)
    except ValueError:
        continue
    if impl == "pytorch" or obj.get("event") == "final":
        final = obj
if final is None:
    sys.exit(f"time_to_accuracy.sh: no final record in {path}")
t = final.get("target", final)  # ours nests the target fields
print(json.dumps({"impl": impl, "repeat": rep, "seed": seed, "shell_wall_s": round(wall, 3),
                  "reached": t.get("reached", t.get("target_reached")),
                  "step": t.get("step", t.get("target_step")),
                  "validation_accuracy": t.get("validation_accuracy", t.get("target_validation_accuracy")),
                  "time_to_target_s": t.get("time_from_process_start_s", t.get("time_to_target_s")),
                  "test_accuracy": final.get("test_accuracy"), "peak_rss_mb": final.get("peak_rss_mb")}))
EOF
  tail -1 "$RESULTS" >&2
}

STOP=()  # the whole budget, or the target's rule
[[ -n "$TARGET" ]] && STOP=(--epochs "$EPOCHS" --eval-every "$EVAL_EVERY" --target-accuracy "$TARGET")
for ((rep = 1; rep <= REPEAT; rep++)); do
  SEED=${SEED_LIST[rep - 1]}
  if [[ "$RUN_OURS" == 1 ]]; then
    MF="$OUT/ours_$rep.jsonl"
    rm -f "$MF"
    cmd=(mpirun -np "$RANKS" --bind-to core "$BIN" --config "$CONFIG_FILE" --data-dir "$DATA_DIR"
         "${STOP[@]}" --seed "$SEED" --metrics-file "$MF" --quiet)
    echo "== [$rep/$REPEAT] seed $SEED, ours: ${cmd[*]}" >&2
    t0=$(now)
    env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 "${cmd[@]}" \
      > "$OUT/ours_$rep.log" 2>&1 || die "our run failed; see $OUT/ours_$rep.log"
    record ours "$rep" "$SEED" "$("$PY" -c "print($(now) - $t0)")" "$MF"
  fi
  if [[ "$RUN_TORCH" == 1 ]]; then
    JF="$OUT/pytorch_$rep.json"
    cmd=("$PY" bench/torch_ddp.py --config "$CONFIG_FILE" --ranks "$RANKS" --threads 1 --data-dir "$DATA_DIR"
         "${STOP[@]}" --seed "$SEED" --json-file "$JF")
    echo "== [$rep/$REPEAT] seed $SEED, pytorch: ${cmd[*]}" >&2
    t0=$(now)
    "${cmd[@]}" > "$OUT/pytorch_$rep.log" 2>&1 || die "the PyTorch run failed; see $OUT/pytorch_$rep.log"
    record pytorch "$rep" "$SEED" "$("$PY" -c "print($(now) - $t0)")" "$JF"
  fi
done

"$PY" - "$RESULTS" "$TARGET" "$RANKS" "$CONFIG_FILE" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
target, ranks, config = sys.argv[2], sys.argv[3], sys.argv[4]
goal = f"to validation accuracy {target}" if target else "the whole budget"
print(f"{config}, {ranks} ranks x 1 thread, {goal}; wall = the whole command as the shell saw it")
by = {(x["impl"], x["repeat"]): x for x in rows}
reps = sorted({x["repeat"] for x in rows})
print(f"{'seed':>6} {'ours wall s':>12} {'ours test':>10} {'pytorch wall s':>15} {'pytorch test':>13} {'ratio':>7}")
ratios = []
for k in reps:
    o, p = by.get(("ours", k)), by.get(("pytorch", k))
    seed = (o or p)["seed"]
    cell = lambda x, key, fmt: format(x[key], fmt) if x and x.get(key) is not None else "-"
    ratio = p["shell_wall_s"] / o["shell_wall_s"] if o and p else None
    if ratio:
        ratios.append(ratio)
    print(f"{seed:>6} {cell(o, 'shell_wall_s', '.2f'):>12} {cell(o, 'test_accuracy', '.4f'):>10} "
          f"{cell(p, 'shell_wall_s', '.2f'):>15} {cell(p, 'test_accuracy', '.4f'):>13} "
          f"{format(ratio, '.2f') + 'x' if ratio else '-':>7}")
for impl in ("ours", "pytorch"):
    r = [x for x in rows if x["impl"] == impl]
    if not r:
        continue
    acc = [x["test_accuracy"] for x in r if x["test_accuracy"] is not None]
    line = (f"{impl}: median wall {statistics.median(x['shell_wall_s'] for x in r):.2f} s, "
            f"mean test accuracy {100 * statistics.mean(acc):.2f} %")
    if target:
        line += f", reached the target in {sum(bool(x['reached']) for x in r)} of {len(r)}"
    rss = [max(x["peak_rss_mb"][i] for x in r) for i in range(len(r[0]["peak_rss_mb"] or []))]
    if rss:
        line += ", peak RSS per rank " + "/".join(f"{v:.0f}" for v in rss) + " MB"
    print(line)
if ratios:
    print(f"PyTorch / ours: median of the seeds' ratios {statistics.median(ratios):.2f}x")
print("per run: " + sys.argv[1])
EOF
