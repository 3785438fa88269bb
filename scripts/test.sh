#!/usr/bin/env bash
# The whole test suite: set up (packages, build), fetch MNIST (for the real-data test), then CTest:
# unit tests, multi-rank tests under mpirun with 1, 2 and 3 ranks, and end-to-end tests.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
scripts/fetch_mnist.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir build --output-on-failure --timeout 900 "$@"
