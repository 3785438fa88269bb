#!/usr/bin/env bash
# The main job: set up (packages, build), fetch MNIST, and train the StackOverflow network
# (configs/lenet.ini) on 2 ranks. Extra arguments go to mnist_mpi, e.g. `--epochs 10`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh train
scripts/fetch_mnist.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun -np 2 --oversubscribe --bind-to core build/mnist_mpi --config configs/lenet.ini "$@"
