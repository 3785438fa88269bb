#!/usr/bin/env bash
# The cost of --exact-sums on a GPU, in one command on the GPU machine, after scripts/gpu_check.sh
# (it reuses the bundle that left unpacked, or unpacks .gpu_bundle itself, and gpu_check's
# environment): lenet on one GPU, 1 rank, the default mode against --exact-sums with chunks of 10
# and of 50, in turn, ROUNDS times (no --cuda-graph: the exact mode refuses it, so the default runs
# without it too); then --exact-sums with chunks of 10 on 2 ranks (one GPU each where there are
# two, else both on the one GPU, summed through host memory), sharded and not. Prints the median
# images/s of each, the ratio to the default mode (the target on a GPU: at least 0.9), the
# step's time split, and every run's params_hash: the exact runs with chunks of 10 must all give
# the same one. Everything goes to $OUT/gpu_exact.txt too.
#
#   bench/gpu_exact.sh [STEPS] [ROUNDS]     # default 300 steps, 3 rounds
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
# shellcheck source=scripts/gpu_check.sh disable=SC2154  # b, work, out, bundle_dir, unpack_root: gpu_check's
source scripts/gpu_check.sh # defines b, work, out, bundle_dir, unpack_root and gpu_env; runs nothing
steps=${1:-300} rounds=${2:-3}
mkdir -p "$work" "$out"
if [ ! -x "$b/bin/mnist_mpi" ] && ! unpack_bundle; then
  echo "gpu_exact: no $b/bin/mnist_mpi and no $bundle_dir/bundle.tar.xz to unpack: run 'scripts/gpu_check.sh pack' where it builds, and carry $bundle_dir" >&2
  exit 2
fi
gpu_env
# gpu_check's smoke stage writes the GPU count; run alone, ask the driver.
gpus=$(gpu_count)
((gpus > 0)) || gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
two=(mpirun -np 2 "$b/bin/mnist_mpi")
((gpus >= 2)) || two+=(--allow-gpu-sharing)
declare -A cmd=(
  [default]="$b/bin/mnist_mpi"
  [exact10]="$b/bin/mnist_mpi --exact-sums"
  [exact50]="$b/bin/mnist_mpi --exact-sums --exact-chunk 50"
  [exact10_2ranks]="${two[*]} --exact-sums --shard-optimizer off"
  [exact10_2ranks_sharded]="${two[*]} --exact-sums --shard-optimizer on"
)
names=(default exact10 exact50)
run_one() {  # NAME ROUND
  # shellcheck disable=SC2086
  timeout 120 ${cmd[$1]} --config "$b/lenet.ini" --data-dir "$b/data" --device cuda --max-steps "$steps" \
    --log-every 0 --collective-timeout 30 --metrics-file "$work/exact_$1.$2.jsonl" >"$work/exact_$1.$2.txt" 2>&1 ||
    echo "gpu_exact: $1 round $2: exit code $? ($(tail -n 1 "$work/exact_$1.$2.txt"))"
}
for ((i = 0; i < rounds; i++)); do
  for name in "${names[@]}"; do run_one "$name" "$i"; done
done
run_one exact10_2ranks 0
run_one exact10_2ranks_sharded 0
grep -h "exact sums:" "$work/exact_exact10.0.txt" "$work/exact_exact10_2ranks.0.txt" 2>/dev/null | sort -u
python3 - "$work" "$rounds" <<'PY' | tee "$out/gpu_exact.txt"
import json, os, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
def finals(name, n):
    out = []
    for i in range(n):
        p = os.path.join(d, f"exact_{name}.{i}.jsonl")
        if os.path.exists(p):
            out += [e for e in map(json.loads, open(p)) if e.get("event") == "final"]
    return out
med = statistics.median
runs = {n: finals(n, rounds) for n in ("default", "exact10", "exact50")}
runs.update({n: finals(n, 1) for n in ("exact10_2ranks", "exact10_2ranks_sharded")})
base = med([e["images_per_s"] for e in runs["default"]]) if runs["default"] else float("nan")
print(f"{'run':<24}{'runs':>5}{'images/s':>10}{'ratio':>7}{'fwd ms':>8}{'bwd ms':>8}{'comm ms':>9}{'opt ms':>8}{'probes':>7}  params_hash")
for n, es in runs.items():
    if not es:
        print(f"{n:<24}{0:>5}  no final event")
        continue
    r = med([e["images_per_s"] for e in es])
    t = {k: med([e["step_ms"][k] for e in es]) for k in es[0]["step_ms"]}
    print(f"{n:<24}{len(es):>5}{r:>10.0f}{r / base:>7.2f}{t['forward']:>8.2f}{t['backward']:>8.2f}"
          f"{t['exposed_comm']:>9.2f}{t['optimizer']:>8.2f}{es[0].get('exact_sum_probes', 0):>7}"
          f"  {','.join(sorted({e['params_hash'] for e in es}))}")
hashes = {e["params_hash"] for n in ("exact10", "exact10_2ranks", "exact10_2ranks_sharded") for e in runs[n]}
print("exact sums, chunks of 10, on 1 and 2 ranks, sharded and not:",
      "ONE params_hash" if len(hashes) == 1 else f"{len(hashes)} different params_hash values: FAIL")
print("target on a GPU: --exact-sums at least 0.9 of the default mode's images/s")
PY
