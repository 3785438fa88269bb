#!/usr/bin/env bash
# The GPU check of issue 5, in two halves, because the GPU machine cannot build mnist_mpi (it has
# CUDA's compiler and PyTorch with cuDNN, cuBLAS and NCCL as Python wheels, but no Open MPI, Boost
# or oneDNN, and no network):
#
#   scripts/gpu_check.sh pack   # HERE, after a CUDA build (scripts/setup.sh): writes
#                               # .gpu_bundle/bundle.tar.xz = build/mnist_mpi, build/tests/gpu_tests,
#                               # build/libmnist_mpi_core.so and the CUDA module build/libmnist_mpi_cuda.so,
#                               # the non-CUDA shared libraries they need (Open MPI with its
#                               # plugins, Boost, oneDNN, ...) and MNIST; git ignores it
#   scripts/gpu_check.sh run    # THERE, in the repo root, with .gpu_bundle carried: unpacks, links
#                               # the binaries against the GPU machine's CUDA / cuDNN / cuBLAS / NCCL
#                               # (PyTorch's wheels), runs the gpu tests, trains lenet for one epoch
#                               # (fp32, then tf32), runs PyTorch eager on the same GPU, and prints a
#                               # summary for the closing note.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bundle_dir=.gpu_bundle
mode=${1:-}

pack() {
  set -e
  local bin=build/mnist_mpi tests=build/tests/gpu_tests module=build/libmnist_mpi_cuda.so
  [ -x "$bin" ] && [ -x "$tests" ] || { echo "gpu_check: build first (scripts/setup.sh)"; exit 1; }
  [ -f "$module" ] && ldd "$module" | grep -q libcudnn || { echo "gpu_check: no CUDA module $module (configure with -DMNIST_MPI_CUDA=ON)"; exit 1; }
  [ -f data/mnist/train-images-idx3-ubyte ] || scripts/fetch_mnist.sh
  local tmp
  tmp=$(mktemp -d)
  local b=$tmp/mnist_gpu
  mkdir -p "$b/bin" "$b/lib" "$b/ompi/lib/openmpi3" "$b/ompi/share" "$b/data"
  cp "$bin" "$tests" "$b/bin/"
  cp "$module" build/libmnist_mpi_core.so "$b/lib/"  # the loader looks for the module next to the core
  cp -L "$(command -v orterun || command -v mpirun)" "$b/bin/mpirun"
  cp -L "$(command -v orted)" "$b/bin/orted"
  local plugins
  plugins=$(dirname "$(find /usr/lib -path '*openmpi*' -name 'mca_pml_ob1.so' | head -1)")
  cp -L "$plugins"/*.so "$b/ompi/lib/openmpi3/"
  cp -rL /usr/share/openmpi "$b/ompi/share/"
  # Every shared library the binaries and plugins load, except the C / C++ runtime (the GPU
  # machine's are newer) and CUDA's (taken from the GPU machine, matching its driver).
  local skip='linux-vdso|ld-linux|/libc\.so|/libm\.so|/libdl\.so|/libpthread\.so|/librt\.so|/libstdc\+\+|/libgcc_s|libcuda\.so|libcudart|libcublas|libcudnn|libnccl|libnvrtc|libnvJitLink'
  for f in "$b/bin/"* "$b/lib/"libmnist_mpi_*.so "$b/ompi/lib/openmpi3/"*.so; do
    ldd "$f" 2>/dev/null | awk '/=> \//{print $3}' | grep -vE "$skip" || true
  done | sort -u | while read -r lib; do cp -Ln "$lib" "$b/lib/" 2>/dev/null || true; done
  cp data/mnist/*-ubyte "$b/data/"
  cp configs/lenet.ini "$b/"
  mkdir -p "$bundle_dir"
  echo "gpu_check: packing $(du -sh "$b" | cut -f1) (xz; a minute or two) ..."
  tar -C "$tmp" -cf - mnist_gpu | xz -T0 -6 >"$bundle_dir/bundle.tar.xz"
  rm -rf "$tmp"
  ls -la "$bundle_dir/bundle.tar.xz"
  echo "gpu_check: carry $bundle_dir to the GPU machine and run: bash scripts/gpu_check.sh run"
}

run() {
  local out=${OUT:-/tmp/gpu_check_out}
  mkdir -p "$out"
  local b=/tmp/mnist_gpu
  [ -f "$bundle_dir/bundle.tar.xz" ] || { echo "gpu_check: no $bundle_dir/bundle.tar.xz: run 'scripts/gpu_check.sh pack' where it builds"; exit 1; }
  rm -rf "$b" && tar -C /tmp -xJf "$bundle_dir/bundle.tar.xz" || exit 1
  echo "== machine"; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  # CUDA libraries: the GPU machine's CUDA, then PyTorch's wheels (cuDNN, cuBLAS, NCCL, cudart).
  local wheels
  wheels=$(python3 -c 'import glob, os, nvidia; print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/*/lib/lib*.so*")})))' 2>/dev/null)
  export LD_LIBRARY_PATH="$b/lib:/usr/local/cuda/lib64:${wheels}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OPAL_PREFIX=$b/ompi OMPI_MCA_mca_base_component_path=$b/ompi/lib/openmpi3 PATH=$b/bin:$PATH
  export OMPI_MCA_ess_singleton_isolated=1 OMPI_MCA_mca_base_component_show_load_errors=0
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1
  echo "== libraries"; ldd "$b/bin/mnist_mpi" "$b/lib/libmnist_mpi_cuda.so" | grep -E "mnist_mpi|cudnn|cublas|nccl|cudart|not found"
  if ldd "$b/bin/mnist_mpi" "$b/lib/libmnist_mpi_cuda.so" | grep -q "not found"; then echo "gpu_check: unresolved libraries (above)"; exit 1; fi
  local gpus
  gpus=$(nvidia-smi -L | grep -c '^GPU')
  echo "== gpu tests (one process)"
  timeout 300 "$b/bin/gpu_tests" 2>&1 | tee "$out/gpu_tests.txt"
  echo "gpu_tests exit ${PIPESTATUS[0]}"
  if [ "$gpus" -ge 2 ]; then
    echo "== gpu tests under mpirun -np 2 (NCCL on 2 GPUs)"
    timeout 300 mpirun -np 2 "$b/bin/gpu_tests" --gtest_filter='Gpu.Nccl*:Gpu.Trajectory*' 2>&1 | tee "$out/gpu_tests_np2.txt"
  fi
  local ranks=1 run=("$b/bin/mnist_mpi")
  if [ "$gpus" -ge 2 ]; then ranks=2; run=(mpirun -np 2 "$b/bin/mnist_mpi"); fi
  for prec in fp32 tf32; do
    echo "== mnist_mpi lenet, 1 epoch, $ranks rank(s), --precision $prec"
    timeout 240 "${run[@]}" --config "$b/lenet.ini" --data-dir "$b/data" --device cuda --precision "$prec" --epochs 1 \
      --log-every 110 --metrics-file "$out/lenet_$prec.jsonl" 2>&1 | tee "$out/lenet_$prec.txt"
  done
  echo "== PyTorch eager, same network, batch and data, one GPU"
  timeout 240 python3 bench/torch_gpu.py --data-dir "$b/data" --json 2>&1 | tee "$out/torch.txt"
  timeout 240 python3 bench/torch_gpu.py --data-dir "$b/data" --tf32 --json 2>&1 | tee "$out/torch_tf32.txt"
  echo "== summary"
  grep -hE "^agreement" "$out/gpu_tests.txt" || true
  grep -hE "PASSED|FAILED|SKIPPED \]|tests? ran" "$out/gpu_tests.txt" | tail -5 || true
  for prec in fp32 tf32; do
    echo "mnist_mpi $prec: $(grep -hE 'images/s steady' "$out/lenet_$prec.txt") | $(grep -hE '^test accuracy' "$out/lenet_$prec.txt")"
  done
  grep -h "^pytorch eager" "$out/torch.txt" "$out/torch_tf32.txt" || true
}

case "$mode" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: scripts/gpu_check.sh pack|run   (see the comment at the top)"; exit 2 ;;
esac
