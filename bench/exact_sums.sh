#!/usr/bin/env bash
# --exact-sums against the default mode, side by side in one run: lenet (chunks of 10 and of 50)
# and tiny, on N ranks (default 2), alternating REPEAT times; prints the medians of images/s, the
# ratio to the default mode, the time split of a step (forward, backward with the conversions to
# fixed point, exposed communication, optimizer with the conversion back) and the params_hash.
# The targets: lenet >= 0.75 and tiny >= 0.9 of the default mode's images/s.
#   bench/exact_sums.sh [RANKS] [STEPS] [REPEAT]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ranks=${1:-2} steps=${2:-100} repeat=${3:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -x build/mnist_mpi ] || { echo "build first: scripts/setup.sh" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
declare -A args=(
  [lenet_default]="--config configs/lenet.ini"
  [lenet_exact10]="--config configs/lenet.ini --exact-sums"
  [lenet_exact50]="--config configs/lenet.ini --exact-sums --exact-chunk 50"
  [tiny_default]="--config configs/tiny.ini"
  [tiny_exact]="--config configs/tiny.ini --exact-sums"
)
names=(lenet_default lenet_exact10 lenet_exact50 tiny_default tiny_exact)
echo "$ranks ranks, $steps steps per run, $repeat rounds; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((i = 0; i < repeat; i++)); do
  for name in "${names[@]}"; do
    # shellcheck disable=SC2086
    mpirun -np "$ranks" --oversubscribe --bind-to core build/mnist_mpi ${args[$name]} --max-steps "$steps" \
      --log-every 0 --quiet --metrics-file "$out/$name.$i.jsonl" >/dev/null
  done
done
/usr/bin/env python3 - "$out" "$repeat" "${names[@]}" <<'PY'
import json, os, statistics, sys
d, repeat, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def finals(name):
    return [e for i in range(repeat) for e in map(json.loads, open(os.path.join(d, f"{name}.{i}.jsonl")))
            if e["event"] == "final"]
med = statistics.median
rate = {n: med([e["images_per_s"] for e in finals(n)]) for n in names}
print(f"{'run':<15}{'chunk':>6}{'images/s':>10}{'ratio':>7}{'fwd ms':>8}{'bwd ms':>8}{'comm ms':>9}{'opt ms':>8}{'probes':>7}  params_hash")
for n in names:
    es = finals(n)
    t = {k: med([e["step_ms"][k] for e in es]) for k in es[0]["step_ms"]}
    base = rate[n.split("_")[0] + "_default"]
    print(f"{n:<15}{es[0].get('exact_chunk', 0):>6}{rate[n]:>10.0f}{rate[n] / base:>7.2f}{t['forward']:>8.2f}"
          f"{t['backward']:>8.2f}{t['exposed_comm']:>9.2f}{t['optimizer']:>8.2f}{es[0].get('exact_sum_probes', 0):>7}"
          f"  {','.join(sorted({e['params_hash'] for e in es}))}")
PY
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
