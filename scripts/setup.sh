#!/usr/bin/env bash
# Installs what mnist_mpi needs from Debian 12's packages (only what is missing), then configures
# and builds it into build/ (build/mnist_mpi, the tests). Safe to run again and again.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# ocl-icd-opencl-dev: only a Recommends of libdnnl-dev, but dnnl's CMake package fails without OpenCL.
# python3-numpy: scripts/read_checkpoint.py, used by tests/e2e_checkpoint.sh.
# python3, python3-protobuf: tests/check_observability.py (JSON, and Google's parser of our event files).
# nlohmann-json3-dev: the one JSON writer (metrics file, timeline, report data).
# libonnx-dev, libprotobuf-dev: `mnist_mpi export` (ONNX); libpng-dev: `mnist_mpi predict` (PNG).
# python3-onnx: tests/check_onnx.py (the checker and shape inference on the exported file); libopenblas0-pthread:
# numpy's matrix products in that check's own evaluator (Debian's reference BLAS took minutes for lenet).
packages=(build-essential cmake pkg-config openmpi-bin libopenmpi-dev libboost-program-options-dev
          libdnnl-dev ocl-icd-opencl-dev zlib1g-dev libgtest-dev libgmock-dev googletest python3-numpy
          python3 python3-protobuf nlohmann-json3-dev libonnx-dev libprotobuf-dev libpng-dev python3-onnx
          libopenblas0-pthread
          slurm-wlm munge  # Slurm: the slurm-labelled tests start a private one-node cluster
          clang libclang-rt-14-dev  # clang + its runtime: libFuzzer targets (tests/fuzz)
          chromium)  # headless: tests/e2e_browser.sh opens the HTML report as a user's browser lays it out
command -v npm >/dev/null 2>&1 || packages+=(npm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The CUDA backend is built whenever nvcc is there (on PATH or in CUDA's standard location); then
# cuDNN, cuBLAS and NCCL must be found too (MNIST_MPI_CUDA=ON makes a missing one a configure
# error). Without nvcc: the CPU-only build (AUTO). MNIST_MPI_CUDA=OFF in the environment forces it.
cuda=${MNIST_MPI_CUDA:-AUTO}
if [ "$cuda" = AUTO ] && { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then cuda=ON; fi
echo "setup: MNIST_MPI_CUDA=$cuda"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMNIST_MPI_BUILD_TESTS=ON -DMNIST_MPI_CUDA="$cuda"
cmake --build build -j"$(nproc)"
