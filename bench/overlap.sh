#!/usr/bin/env bash
# How much of the gradient reduction is hidden behind backward: lenet on N ranks (default 2),
# --no-overlap against overlapped runs with several bucket caps, alternating REPEAT times in one
# run; prints the medians of per-step backward, exposed communication, its share of the step, the
# part of the blocking reduction's time that overlap hid, and images/s. Then the reducer's bus
# bandwidth against MPI_Allreduce (build/reducer_bench).
#   bench/overlap.sh [RANKS] [STEPS] [REPEAT]
# On a machine shared with other work, BENCH_RT=1 runs every rank under SCHED_FIFO (chrt, needs
# root) so that other processes cannot distort the comparison; the communication thread then takes
# one priority level above its rank (Note [A thread for the sums] in src/comm/mpi_communicator.cpp).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ranks=${1:-2} steps=${2:-60} repeat=${3:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -x build/mnist_mpi ] || { echo "build first: scripts/setup.sh" >&2; exit 2; }
rt=()
[ "${BENCH_RT:-0}" = 1 ] && rt=(chrt -f 10)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
configs=(${BENCH_CONFIGS:-blocking buckets_4mb buckets_2mb buckets_1mb buckets_25mb})
declare -A args=(
  [blocking]="--no-overlap"
  [buckets_4mb]="--bucket-mb 4 --first-bucket-mb 1"
  [buckets_2mb]="--bucket-mb 2 --first-bucket-mb 0.5"
  [buckets_1mb]="--bucket-mb 1 --first-bucket-mb 0.25"
  [buckets_25mb]="--bucket-mb 25 --first-bucket-mb 1"
)
echo "lenet, $ranks ranks, $steps steps per run, $repeat rounds; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((i = 0; i < repeat; i++)); do
  for name in "${configs[@]}"; do
    # shellcheck disable=SC2086
    "${rt[@]}" mpirun -np "$ranks" --oversubscribe --bind-to core --mca btl self,vader build/mnist_mpi \
      --config configs/lenet.ini --max-steps "$steps" --log-every 0 --quiet \
      --metrics-file "$out/$name.$i.jsonl" ${args[$name]} >/dev/null
  done
done
/usr/bin/env python3 - "$out" "$repeat" "${configs[@]}" <<'PY'
import json, os, statistics, sys
d, repeat, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def finals(name):
    out = []
    for i in range(repeat):
        for line in open(os.path.join(d, f"{name}.{i}.jsonl")):
            e = json.loads(line)
            if e["event"] == "final": out.append(e)
    return out
med = lambda xs: statistics.median(xs)
blocking = med([e["step_ms"]["exposed_comm"] for e in finals("blocking")])
print(f"{'run':<14}{'buckets':>8}{'backward ms':>13}{'exposed ms':>12}{'share of step':>15}{'hidden':>9}{'step ms':>9}{'images/s':>10}  params_hash")
for name in names:
    es = finals(name)
    t = {k: med([e["step_ms"][k] for e in es]) for k in es[0]["step_ms"]}
    step = med([sum(e["step_ms"].values()) for e in es])
    hidden = 1 - t["exposed_comm"] / blocking if name != "blocking" else 0.0
    hashes = sorted({e["params_hash"] for e in es})
    print(f"{name:<14}{es[0]['buckets']:>8}{t['backward']:>13.2f}{t['exposed_comm']:>12.2f}{t['exposed_comm']/step:>15.1%}"
          f"{hidden:>9.0%}{step:>9.2f}{med([e['images_per_s'] for e in es]):>10.0f}  {','.join(hashes)}")
PY
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
[ -x build/reducer_bench ] && "${rt[@]}" mpirun -np "$ranks" --oversubscribe --bind-to core --mca btl self,vader build/reducer_bench 30
