#!/usr/bin/env bash
# The fast recipe on a GPU, in one command on the GPU machine, after scripts/gpu_check.sh (it
# reuses the bundle that left unpacked, or unpacks .gpu_bundle itself, and gpu_check's
# environment): the fast recipe (configs/fast.ini, its whole budget, data resident on the GPU,
# --cuda-graph) on one GPU in fp32, tf32 and bf16 for each seed, then PyTorch eager on the same
# recipe (bench/torch_gpu.py --config: the same spec, initialisers, optimiser, schedule, batch,
# epochs and data order) in the same three precisions. Per run: training time (mnist_mpi: the final
# event's wall_s, first step to last, which also holds its validation pass at the end of epoch 1,
# 5,000 images; PyTorch: first step to last, synchronised, which holds cudnn.benchmark's tuning in
# its first steps: its time from the second step on is in the tsv's note), test accuracy,
# images/s. Then per implementation and precision: the median training time, the mean test
# accuracy, and PyTorch's time over ours. The target: training at most 0.25 s and mean test
# accuracy at least 99 %. Everything goes to $OUT/gpu_fast.tsv and $OUT/gpu_fast.txt too.
#
#   bench/gpu_fast.sh [SEEDS]     # default "1 2 3 4 5"; about 3 minutes on an H200 (estimate)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
# shellcheck source=scripts/gpu_check.sh disable=SC2154  # b, work, out, bundle_dir, unpack_root: gpu_check's
source scripts/gpu_check.sh # defines b, work, out, bundle_dir, unpack_root and gpu_env; runs nothing
seeds=${1:-"1 2 3 4 5"}
mkdir -p "$work" "$out"
if [ ! -x "$b/bin/mnist_mpi" ] && ! unpack_bundle; then
  echo "gpu_fast: no $b/bin/mnist_mpi and no $bundle_dir/bundle.tar.xz to unpack: run 'scripts/gpu_check.sh pack' where it builds, and carry $bundle_dir" >&2
  exit 2
fi
gpu_env
tsv=$out/gpu_fast.tsv
printf 'impl\tprecision\tseed\ttrain_s\ttest_accuracy\timages_per_s\tnote\n' >"$tsv"
row() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$tsv"; }

for prec in fp32 tf32 bf16; do
  for s in $seeds; do
    m=$work/fast_${prec}_$s.jsonl
    # Both sides read configs/fast.ini of this tree (the repo root is the working directory).
    timeout 90 "$b/bin/mnist_mpi" --config configs/fast.ini --data-dir "$b/data" --device cuda --cuda-graph \
      --precision "$prec" --seed "$s" --log-every 0 --metrics-file "$m" >"$work/fast_${prec}_$s.txt" 2>&1
    rc=$?
    if [ "$rc" != 0 ]; then
      row mnist_mpi "$prec" "$s" nan nan nan "exit code $rc: $(tail -n 1 "$work/fast_${prec}_$s.txt")"
      continue
    fi
    if ! python3 - "$m" "$prec" "$s" >>"$tsv" 2>/dev/null <<'PY'; then
import json, sys
final = [e for e in map(json.loads, open(sys.argv[1])) if e.get("event") == "final"][-1]
print("\t".join(["mnist_mpi", sys.argv[2], sys.argv[3], f"{final['wall_s']:.4f}", f"{final['test_accuracy']:.4f}",
                 f"{final['images_per_s']:.0f}", ""]))
PY
      row mnist_mpi "$prec" "$s" nan nan nan "no final event in $m"
    fi
    tail -n 1 "$tsv"
  done
done

(
  unset LD_LIBRARY_PATH # PyTorch loads its own CUDA libraries
  for prec in fp32 tf32 bf16; do
    flag=()
    [ "$prec" = fp32 ] || flag=(--"$prec")
    for s in $seeds; do
      line=$(timeout 120 python3 bench/torch_gpu.py --data-dir "$b/data" --config configs/fast.ini --seed "$s" \
        "${flag[@]}" --json 2>"$work/torch_fast_${prec}_$s.err" | tail -n 1)
      if ! python3 - "$prec" "$s" "$line" >>"$tsv" 2>/dev/null <<'PY'; then
import json, sys
r = json.loads(sys.argv[3])
print("\t".join(["pytorch", sys.argv[1], sys.argv[2], f"{r['train_s']:.4f}", f"{r['test_accuracy']:.4f}",
                 f"{r['images_per_s']:.0f}", f"from the second step: {r['train_after_first_step_s']} s"]))
PY
        row pytorch "$prec" "$s" nan nan nan "failed: $(tail -n 1 "$work/torch_fast_${prec}_$s.err")"
      fi
      tail -n 1 "$tsv"
    done
  done
)

python3 - "$tsv" <<'PY' | tee "$out/gpu_fast.txt"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
def num(x):
    try:
        return float(x)
    except ValueError:
        return float("nan")
groups = {}
for r in rows:
    groups.setdefault((r["impl"], r["precision"]), []).append(r)
print(f"{'impl':<10}{'precision':<10}{'runs':>5}{'train s (median)':>18}{'test acc (mean)':>17}  each seed's accuracy")
med = {}
for (impl, prec), rs in groups.items():
    ok = [r for r in rs if r["train_s"] != "nan"]
    t = statistics.median(num(r["train_s"]) for r in ok) if ok else float("nan")
    acc = statistics.mean(num(r["test_accuracy"]) for r in ok) if ok else float("nan")
    med[(impl, prec)] = t
    print(f"{impl:<10}{prec:<10}{len(ok):>3}/{len(rs):<1}{t:>18.3f}{100 * acc:>16.2f}%  "
          + ", ".join(f"{100 * num(r['test_accuracy']):.2f}" for r in ok))
for prec in ("fp32", "tf32", "bf16"):
    ours, theirs = med.get(("mnist_mpi", prec)), med.get(("pytorch", prec))
    if ours and theirs and ours == ours and theirs == theirs:
        print(f"{prec}: PyTorch eager / mnist_mpi training time = {theirs / ours:.2f}x")
print("target: mnist_mpi's training at most 0.25 s, mean test accuracy at least 99 %")
PY
