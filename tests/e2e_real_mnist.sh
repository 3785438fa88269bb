#!/usr/bin/env bash
# Real MNIST: the blog's tiny network as configs/tiny.ini trains it (2 epochs) on 2 ranks must reach at least
# 98 % test accuracy (98.2 % measured). It was 1 epoch and 97 %, which runs gave at 96.97-97.03 %:
# one test image either side of the line, so any change of rounding flipped it.
# The data comes from scripts/fetch_mnist.sh (the README's test command runs it first).
# Usage: e2e_real_mnist.sh MNIST_MPI REPO_ROOT
set -euo pipefail
bin=$1 root=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
data=${MNIST_DATA_DIR:-$root/data/mnist}
if [ ! -f "$data/train-images-idx3-ubyte" ]; then
  echo "FAIL: real MNIST is not in $data; run scripts/fetch_mnist.sh first"
  exit 1
fi
m=$(mktemp)
trap 'rm -f "$m"' EXIT
timeout 600 mpirun -np 2 --oversubscribe --bind-to core "$bin" --config "$root/configs/tiny.ini" --data-dir "$data" \
  --threads 1 --log-every 100 --metrics-file "$m"
acc=$(grep -oE '"event":"final","test_accuracy":[0-9.]+' "$m" | grep -oE '[0-9.]+$')
echo "tiny, 2 epochs (configs/tiny.ini), 2 ranks: test accuracy $acc (need >= 0.98)"
awk -v a="$acc" 'BEGIN { exit !(a >= 0.98) }' && echo "1 passed, 0 failed" || { echo "0 passed, 1 failed"; exit 1; }
