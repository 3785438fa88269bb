#!/usr/bin/env bash
# How much of the gradient reduction is hidden behind backward: lenet on N ranks (default 2),
# --no-overlap against overlapped runs with several bucket caps, in one run; prints per-step
# backward, exposed communication, its share of the step, and the part of the blocking
# reduction's time that overlap hid. Then the reducer's bus bandwidth against MPI_Allreduce.
#   bench/overlap.sh [RANKS] [STEPS]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ranks=${1:-2} steps=${2:-60}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -x build/mnist_mpi ] || { echo "build first: scripts/setup.sh" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() {  # run NAME ARGS...
  local name=$1; shift
  mpirun -np "$ranks" --oversubscribe --bind-to core build/mnist_mpi --config configs/lenet.ini --max-steps "$steps" \
    --log-every 0 --quiet --metrics-file "$out/$name.jsonl" "$@" >/dev/null
}
run blocking --no-overlap
run buckets_4mb
run buckets_1mb --bucket-mb 1 --first-bucket-mb 0.25
run buckets_25mb --bucket-mb 25
/usr/bin/env python3 - "$out" <<'PY'
import json, sys, os
d = sys.argv[1]
def final(name):
    for line in open(os.path.join(d, name + ".jsonl")):
        e = json.loads(line)
        if e["event"] == "final": return e
base = final("blocking")
blocking = base["step_ms"]["exposed_comm"]
print(f"{'run':<14}{'buckets':>8}{'backward ms':>13}{'exposed ms':>12}{'share of step':>15}{'hidden':>9}{'images/s':>10}  params_hash")
for name in ["blocking", "buckets_4mb", "buckets_1mb", "buckets_25mb"]:
    e = final(name); t = e["step_ms"]
    step = sum(t.values())
    hidden = 1 - t["exposed_comm"] / blocking if name != "blocking" else 0.0
    print(f"{name:<14}{e['buckets']:>8}{t['backward']:>13.2f}{t['exposed_comm']:>12.2f}{t['exposed_comm']/step:>15.1%}{hidden:>9.0%}{e['images_per_s']:>10.0f}  {e['params_hash']}")
PY
[ -x build/reducer_bench ] && mpirun -np "$ranks" --oversubscribe --bind-to core build/reducer_bench 30
