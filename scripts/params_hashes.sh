#!/usr/bin/env bash
# The params_hash of a fixed set of short runs on real MNIST: fp32 tiny and lenet on 1 and 2 ranks,
# lenet with the optimizer unsharded, --exact-sums on 2 and 3 ranks, batch norm, lamb (sharded, and
# exact on 3 ranks), bf16 (when this CPU has AVX512_BF16), a run with micro-batches, and sgd. A
# change that must keep the bits (a refactor) prints the same lines before and after; a change that
# moves them says why in its commit.
# The bits depend on the kernels oneDNN picks for this CPU: compare lines printed on one machine.
#
# Usage: scripts/params_hashes.sh [BUILD_DIR]   (default build/; needs data/mnist: scripts/fetch_mnist.sh)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=$(cd "${1:-$root/build}" && pwd)/mnist_mpi
[ -x "$bin" ] || { echo "params_hashes.sh: no $bin: build first (scripts/setup.sh)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$root"

run() {  # NAME RANKS ARGS...
  local name=$1 np=$2 hash
  shift 2
  local out rc=0
  out=$(mpirun -np "$np" --oversubscribe "$bin" --data-dir data/mnist --log-every 0 --max-steps 40 \
             --eval-every 0 "$@" 2>&1) || rc=$?
  if [ "$rc" -eq 0 ]; then
    hash=$(sed -n 's/^params_hash //p' <<<"$out")
  else
    hash="FAILED (exit $rc): $(grep -m1 'error' <<<"$out")"
  fi
  printf '%-36s %s\n' "$name" "${hash:-FAILED: no params_hash line}"
}

run "tiny, 1 rank" 1 --config configs/tiny.ini
run "tiny, 2 ranks" 2 --config configs/tiny.ini
run "lenet, 1 rank" 1 --config configs/lenet.ini
run "lenet, 2 ranks" 2 --config configs/lenet.ini
run "lenet, 2 ranks, unsharded" 2 --config configs/lenet.ini --shard-optimizer off
run "lenet, 2 ranks, sgd momentum" 2 --config configs/lenet.ini --optimizer sgd --lr 0.05 --momentum 0.9
run "lenet, 1 rank, 2 micro-batches" 1 --config configs/lenet.ini --accumulation-steps 2
run "lenet --exact-sums, 2 ranks" 2 --config configs/lenet.ini --exact-sums
run "tiny --exact-sums, 3 ranks" 3 --config configs/tiny.ini --exact-sums --batch-size 40
run "lenet_bn (batch norm), 2 ranks" 2 --config configs/lenet_bn.ini
run "lenet lamb, 2 ranks" 2 --config configs/lenet_lamb.ini
run "lenet lamb --exact-sums, 3 ranks" 3 --config configs/lenet_lamb.ini --exact-sums --global-batch-size 90
if grep -q avx512_bf16 /proc/cpuinfo; then
  run "lenet bf16, 2 ranks" 2 --config configs/lenet.ini --precision bf16
  run "fast bf16, 3 ranks, 0.2 MB buckets" 3 --config configs/fast.ini --precision bf16 --bucket-mb 0.2
else
  echo "bf16: not run (this CPU has no AVX512_BF16)"
fi
