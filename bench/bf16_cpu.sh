#!/usr/bin/env bash
# --precision bf16 against fp32 on this CPU, side by side: for each seed, the
# recipe's whole budget in fp32 and then in bf16 (alternating, so both see the same load), and per
# run the test accuracy, the steady images/s (the final metrics event) and the wall time from start
# to exit. Then per precision the mean test accuracy and the median wall, and the bf16/fp32 ratio of
# images/s per seed and its median: the figures of docs/performance.md's bf16 tables.
#
#   bench/bf16_cpu.sh [CONFIG [SEEDS [RANKS]]]     e.g. bench/bf16_cpu.sh fast "1 2 3 4 5" 2
#
# CONFIG names configs/CONFIG.ini (default lenet); SEEDS defaults to "1 2 3 4 5"; RANKS to 2, each
# bound to a core. Needs build/mnist_mpi, data/mnist (scripts/fetch_mnist.sh) and a CPU with
# AVX512-BF16 or AMX (mnist_mpi refuses bf16 elsewhere, exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-lenet}
seeds=${2:-1 2 3 4 5}
ranks=${3:-2}
[ -x build/mnist_mpi ] || { echo "bench/bf16_cpu.sh: build/mnist_mpi is missing: build first (scripts/setup.sh)" >&2; exit 2; }
[ -f "configs/$config.ini" ] || { echo "bench/bf16_cpu.sh: configs/$config.ini does not exist" >&2; exit 2; }
if ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  echo "bench/bf16_cpu.sh: this CPU has neither AVX512-BF16 nor AMX-BF16: --precision bf16 is refused here" >&2
  exit 2
fi
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tsv=$work/runs.tsv
printf 'precision\tseed\ttest_accuracy\timages_per_s\twall_s\n' >"$tsv"
for s in $seeds; do
  for p in fp32 bf16; do
    m=$work/${p}_$s.jsonl
    start=$(date +%s.%N)
    if ! mpirun -np "$ranks" --bind-to core build/mnist_mpi --config "configs/$config.ini" --precision "$p" --seed "$s" \
      --metrics-file "$m" >"$work/${p}_$s.txt" 2>&1; then
      echo "bench/bf16_cpu.sh: the $p run of seed $s failed:" >&2
      tail -5 "$work/${p}_$s.txt" >&2
      exit 1
    fi
    end=$(date +%s.%N)
    /usr/bin/python3 - "$m" "$p" "$s" "$start" "$end" >>"$tsv" <<'EOF'
import json, sys
final = [json.loads(l) for l in open(sys.argv[1]) if '"event":"final"' in l.replace(" ", "")][-1]
print(f"{sys.argv[2]}\t{sys.argv[3]}\t{final['test_accuracy']:.4f}\t{final['images_per_s']:.0f}\t"
      f"{float(sys.argv[5]) - float(sys.argv[4]):.2f}")
EOF
    tail -1 "$tsv"
  done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/python3 - "$tsv" "$config" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
by = {p: {r["seed"]: r for r in rows if r["precision"] == p} for p in ("fp32", "bf16")}
seeds = [s for s in by["fp32"] if s in by["bf16"]]
print(f"\n{sys.argv[2]}: {len(seeds)} seeds")
means = {}
for p in ("fp32", "bf16"):
    acc = [100 * float(by[p][s]["test_accuracy"]) for s in seeds]
    means[p] = statistics.mean(acc)
    print(f"{p}: test accuracy {', '.join(f'{a:.2f}' for a in acc)} (mean {means[p]:.3f} %), "
          f"wall median {statistics.median(float(by[p][s]['wall_s']) for s in seeds):.2f} s")
ratios = [float(by["bf16"][s]["images_per_s"]) / float(by["fp32"][s]["images_per_s"]) for s in seeds]
print(f"bf16/fp32 images/s per seed: {', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f}x)")
print(f"mean accuracy, bf16 - fp32: {means['bf16'] - means['fp32']:+.3f} points")
EOF
