#!/usr/bin/env bash
# Real MNIST: the blog's tiny network as configs/tiny.ini trains it (2 epochs) on 2 ranks must reach at least
# 98 % test accuracy (98.2 % measured). It was 1 epoch and 97 %, which runs gave at 96.97-97.03 %:
# one test image either side of the line, so any change of rounding flipped it.
# The lenet family, one epoch on 2 ranks, at least 98.0 % each (a fault that costs a point fails):
# lenet's recipe as `mpirun -np 2 ./mnist_mpi` in the build directory, literally (no options, the
# source tree's data); lenet with batch norm (configs/lenet_bn.ini); lenet with LAMB
# (configs/lenet_lamb.ini, lr 0.003). Measured (docs/performance.md): lenet seed 42 98.36 % (the
# README's real run; 98.50 % on an older AVX-512 machine), seeds 1-5 98.44-98.80 %; lenet_bn
# 98.57 %; lamb 98.61 %. The bar is 0.36 points under the lowest of them, the margin for another
# CPU's kernels: their rounding moves a run by a tenth or two of a point (98.36 and 98.50 % for
# the same seed on two machines), and the seeds spread over 0.36 points.
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
passed=0 failed=0
awk -v a="$acc" 'BEGIN { exit !(a >= 0.98) }' && passed=$((passed + 1)) || failed=$((failed + 1))

# lenet with batch norm (configs/lenet_bn.ini), one epoch on 2 ranks.
bar=0.980  # the lenet family's (above)
timeout 600 mpirun -np 2 --oversubscribe --bind-to core "$bin" --config "$root/configs/lenet_bn.ini" --data-dir "$data" \
  --threads 1 --log-every 100 --metrics-file "$m"
acc=$(grep -oE '"event":"final","test_accuracy":[0-9.]+' "$m" | grep -oE '[0-9.]+$')
echo "lenet with batch norm, 1 epoch (configs/lenet_bn.ini), 2 ranks: test accuracy $acc (need >= $bar)"
awk -v a="$acc" -v b="$bar" 'BEGIN { exit !(a >= b) }' && passed=$((passed + 1)) || failed=$((failed + 1))

# Literally, when the data is the source tree's (where the program finds it without options).
env=()
[ "$(realpath "$data")" = "$(realpath "$root/data/mnist")" ] || env=(MNIST_MPI_DATA_DIR="$data")
rc=0
out=$(cd "$(dirname "$bin")" && env "${env[@]}" timeout 600 mpirun -np 2 ./mnist_mpi 2>&1) || rc=$?
echo "$out" | grep -E "^(data|batch|test accuracy|params_hash)"
lenet=$(echo "$out" | sed -n 's/^test accuracy \([0-9.]*\) .*/\1/p')
if [ $rc -eq 0 ] && echo "$out" | grep -q "batch: 100 global, 50 per rank; 550 steps per epoch, 550 steps" &&
   awk -v a="$lenet" -v b="$bar" 'BEGIN { exit !(a >= b) }'; then
  passed=$((passed + 1)); echo "mpirun -np 2 ./mnist_mpi: lenet, test accuracy $lenet (need >= $bar)"
else
  failed=$((failed + 1)); echo "FAIL mpirun -np 2 ./mnist_mpi: exit code $rc, test accuracy '$lenet'"; echo "$out" | tail -20
fi

rc=0
out=$(timeout 600 mpirun -np 2 --oversubscribe --bind-to core "$bin" --config "$root/configs/lenet_lamb.ini" \
  --data-dir "$data" --log-every 0 2>&1) || rc=$?
lamb=$(echo "$out" | sed -n 's/^test accuracy \([0-9.]*\) .*/\1/p')
if [ $rc -eq 0 ] && awk -v a="$lamb" -v b="$bar" 'BEGIN { exit !(a >= b) }'; then
  passed=$((passed + 1)); echo "lenet with lamb (configs/lenet_lamb.ini), 2 ranks: test accuracy $lamb (need >= $bar)"
else
  failed=$((failed + 1)); echo "FAIL lenet with lamb: exit code $rc, test accuracy '$lamb'"; echo "$out" | tail -20
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
