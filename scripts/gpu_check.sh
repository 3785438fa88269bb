#!/usr/bin/env bash
# The GPU check, in two halves, because the GPU machine cannot build mnist_mpi (it has CUDA's
# compiler and PyTorch with cuDNN, cuBLAS and NCCL as Python wheels, but no Open MPI, Boost or
# oneDNN, and no network):
#
#   scripts/gpu_check.sh pack   # HERE, after a CUDA build (scripts/setup.sh): writes
#                               # .gpu_bundle/bundle.tar.xz = build/mnist_mpi, build/tests/gpu_tests,
#                               # build/libmnist_mpi_core.so and the CUDA module build/libmnist_mpi_cuda.so,
#                               # the non-CUDA shared libraries they need (Open MPI with its
#                               # plugins, Boost, oneDNN, ...), MNIST, the configs and BUILD_INFO (the
#                               # CUDA, cuDNN and NCCL it was built with); git ignores it. It refuses
#                               # a bundle that would not fit, with the working tree, in the 64 MiB
#                               # the GPU machine is sent, and lists what is big.
#   scripts/gpu_check.sh run    # THERE, in the repo root, with .gpu_bundle carried: the stages below,
#                               # then a summary.
#
# The GPU machine takes commands of at most 600 s and a few minutes in all, so `run` keeps
# to a budget. Each stage has its own timeout (the table), cut to what is left of the total
# (total_s); a stage with less than min_stage_s left is not started and is reported "not run: out
# of time". Every stage prints "== stage NAME start (budget N s)" and "== stage NAME end:
# PASS|FAIL|TIMEOUT (M s)", and as soon as it ends appends a line to $OUT/stages.tsv (stage,
# result, seconds, budget, note) and leaves its whole log in $OUT/NAME.log (written as it runs):
# a run killed from outside still tells where it stopped. The summary ($OUT/summary.txt and the
# end of the output) is printed whatever failed; the exit code is 0 only when every stage passed.
# At most 8 files come back from $OUT: stages.tsv, summary.txt and the six logs.
#
# Budget: the table is the data `run` uses. It sums to 405 s; total_s = 420 leaves 15 s for the
# library search before the first stage, the kill grace and the summary. Before it had a budget
# the check could take 1,260 s on one GPU (300 + 4 x 240), more than one command may.
#
# stage       timeout_s  what it runs
read -r -d '' budget_table <<'EOF' || true
smoke              50  unpack; GPU, driver, CUDA runtime and driver, cuDNN, cuBLAS, NCCL versions; the libraries ldd resolves; 20 steps of tiny, 1 rank, --device cuda, listing what it loaded at run time (was 60 s)
gpu_tests          60  gpu_tests in one process (with the CUDA graph against the ungraphed step, bitwise); every test skipped, or none run, is a FAIL (was 90 s; the first GPU run took 9 s)
gpu_np2            75  gpu_tests under mpirun -np 2: NCCL sums and shards (floats and --exact-sums's integers), and world-size invariance with 2+ GPUs, with one GPU invariance, both ranks on it; --exact-sums's bits on 2 ranks against 1; with one GPU the same again with each rank its own NCCL host (NCCL_HOSTID, sockets on lo), then lenet on those 2 ranks: --exact-sums sharded against 1 rank, --cuda-graph against ungraphed (was 55 s)
lenet             110  lenet, 1 epoch, 1 rank (2 with 2+ GPUs), --precision fp32 then tf32, each without and with --cuda-graph (the rates, params_hash equal), then with --cuda-graph --conv-algos measured; then build/cudnn_algos, cudnnFind's time for every convolution algorithm of lenet and tiny with the heuristics' pick marked, and the fc GEMMs; then the same three runs in --precision bf16 (Note [bf16 on the GPU]); every run must reach 97 % test accuracy (was 130 s, before it lenet_fp32 70 s + lenet_tf32 55 s; the whole check took 86 s on the last GPU)
sharded            40  lenet, 100 steps, --shard-optimizer off and on: 1 rank (NCCL), then 2 ranks (NCCL with 2+ GPUs, else both on the one GPU): params_hash equal each time (new)
torch              70  PyTorch eager, same network and data: fp32 (at most 50 s), then tf32 (the rest); LD_LIBRARY_PATH unset (was 85 s)
EOF
total_s=420
min_stage_s=10     # a stage with less left than this is not started
grace_s=5          # after a stage's timeout: TERM, then KILL this much later
torch_fp32_s=50    # the torch stage's first run; the second gets the rest

set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
self=$root/scripts/gpu_check.sh
stage_source=$self          # each stage runs as: bash -c 'source $stage_source; stage_NAME'
bundle_dir=.gpu_bundle
unpack_root=${GPU_CHECK_UNPACK_ROOT:-/tmp}   # the self-test points it elsewhere
b=$unpack_root/mnist_gpu    # the unpacked bundle
out=${OUT:-/tmp/gpu_check_out}
work=${GPU_CHECK_WORK:-/tmp/gpu_check_work}   # scratch: metrics, loader traces, notes
carry_limit=$((64 * 1024 * 1024))             # what one call sends to the GPU machine, in all

# ---------------------------------------------------------------------------------------------
# The budget

# "NAME SECONDS" per stage, in order.
budget_stages() { awk 'NF >= 2 { print $1, $2 }' <<<"$budget_table"; }
budget_sum() { awk 'NF >= 2 { s += $2 } END { print s + 0 }' <<<"$budget_table"; }

# Appends one line to $out/stages.tsv. Tabs and newlines in the note become spaces.
record() {  # NAME RESULT SECONDS BUDGET NOTE
  local note=${5//$'\t'/ }
  note=${note//$'\n'/ }
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$note" >>"$out/stages.tsv"
}

# A stage body's one-line verdict, for stages.tsv and the end line (the last one written wins).
note() { [ -n "${STAGE_NOTE:-}" ] && printf '%s\n' "$*" >>"$STAGE_NOTE"; printf 'gpu_check: %s\n' "$*"; }

# Seconds the running stage has left (its bodies use this for inner timeouts).
stage_left() { echo $((${STAGE_END:-$(($(date +%s) + 60))} - $(date +%s))); }

# Runs stage NAME in a process of its own under `timeout`, with budget min(BUDGET, what is left of
# the deadline), its output in $out/NAME.log. The body's exit code: 0 = PASS, anything else = FAIL;
# killed at its timeout = TIMEOUT.
run_stage() {  # NAME BUDGET
  local name=$1 budget=$2 left t start rc secs result note_text=""
  left=$((deadline - SECONDS))
  if ((left < min_stage_s)); then
    echo "== stage $name not run: out of time ($left s left of $total_s s; its budget $budget s)"
    record "$name" NOT_RUN 0 "$budget" "not run: out of time"
    return 0
  fi
  t=$((budget < left ? budget : left))
  if ((t < budget)); then
    echo "== stage $name start (budget $t s, cut from $budget s: what is left)"
  else
    echo "== stage $name start (budget $t s)"
  fi
  current_stage=$name stage_start=$SECONDS stage_budget=$budget
  : >"$work/$name.note"
  start=$SECONDS
  # In the background and waited for, so that a signal to this script is handled at once (on_signal).
  # shellcheck disable=SC2016  # $1 and $2 are the inner shell's
  STAGE_NOTE=$work/$name.note STAGE_END=$(($(date +%s) + t)) \
    timeout -k "$grace_s" "$t" bash -c 'source "$1" && "stage_$2"' gpu_check "$stage_source" "$name" \
    >"$out/$name.log" 2>&1 </dev/null &
  stage_pid=$!
  wait "$stage_pid"
  rc=$?
  secs=$((SECONDS - start))
  current_stage="" stage_pid=""
  case $rc in
    0) result=PASS ;;
    124 | 137) result=TIMEOUT ;;
    *) result=FAIL ;;
  esac
  [ -s "$work/$name.note" ] && note_text=$(tail -n 1 "$work/$name.note")
  if [ "$result" = TIMEOUT ]; then
    note_text="killed at its $t s timeout${note_text:+; last: $note_text}"
  elif [ "$result" = FAIL ] && [ -z "$note_text" ]; then
    note_text="exit code $rc"
  fi
  record "$name" "$result" "$secs" "$budget" "$note_text"
  show_log "$out/$name.log"
  echo "== stage $name end: $result ($secs s)${note_text:+: $note_text}"
}

# A stage's log on the console: all of it when short, else its start and end (the file has it all).
show_log() {
  local n
  n=$(wc -l <"$1")
  if ((n <= 80)); then
    cat "$1"
  else
    head -n 20 "$1"
    echo "[... $((n - 80)) lines: the whole log is $1 ...]"
    tail -n 60 "$1"
  fi
}

# LOG without terminal colour codes. Under mpirun a rank's stdout is a pseudo-terminal, so gtest
# colours its result lines (ESC[0;32m[       OK ] ESC[m...) unless told not to; the first GPU
# run counted "no test ran" for a run whose test had passed.
uncoloured() { sed -E 's/\x1b\[[0-9;]*m//g' "$1"; }

# gtest's per-test result lines in LOG: "passed failed skipped".
gtest_counts() {
  local p f s text
  text=$(uncoloured "$1")
  p=$(grep -cE '^\[ +OK \] .*\([0-9]+ ms\)$' <<<"$text")
  f=$(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)$' <<<"$text")
  s=$(grep -cE '^\[  SKIPPED \] .*\([0-9]+ ms\)$' <<<"$text")
  echo "$p $f $s"
}

# The reasons given for skipped tests in LOG (the line after gtest's "file:line: Skipped"), each
# once.
gtest_skip_reasons() {
  uncoloured "$1" | grep -A1 -E ': Skipped$' | grep -vE ': Skipped$|^--$' | sed '/^$/d' | sort | uniq -c |
    sed -E 's/^ *([0-9]+) /\1 x /'
}

# The verdict on a gtest run: LOG and the binary's exit code. PASS needs at least one test passed,
# none failed and exit code 0: a driver too old for the build's CUDA runtime makes gpu_tests exit 0
# with every test skipped, and that is a FAIL here. Prints the verdict; returns 0 for PASS.
gtest_verdict() {  # LOG RC
  local log=$1 rc=$2 p f s reasons
  read -r p f s < <(gtest_counts "$log")
  reasons=$(gtest_skip_reasons "$log" | head -n 5 | paste -sd ';' -)
  local counts="$p passed, $f failed, $s skipped"
  if ((p + f + s == 0)); then
    note "no test ran (exit code $rc)"
    return 1
  elif ((f > 0 || rc != 0)); then
    note "$counts (exit code $rc)"
    return 1
  elif ((p == 0)); then
    note "every test skipped ($counts): ${reasons:-no reason printed}"
    return 1
  fi
  note "$counts${reasons:+ (skipped: $reasons)}"
}

# ---------------------------------------------------------------------------------------------
# The GPU machine's environment (run in the main shell; the stages inherit it)

gpu_env() {
  # CUDA libraries: the GPU machine's CUDA, then PyTorch's wheels (cuDNN, cuBLAS, NCCL, cudart).
  local wheels
  wheels=$(timeout 20 python3 -c 'import glob, os, nvidia; print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/*/lib/lib*.so*")})))' 2>/dev/null)
  echo "gpu_check: CUDA libraries from /usr/local/cuda/lib64 and PyTorch's wheels: ${wheels:-none found}"
  export LD_LIBRARY_PATH="$b/lib:/usr/local/cuda/lib64:${wheels}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OPAL_PREFIX=$b/ompi OMPI_MCA_mca_base_component_path=$b/ompi/lib/openmpi3 PATH=$b/bin:$PATH
  export OMPI_MCA_ess_singleton_isolated=1 OMPI_MCA_mca_base_component_show_load_errors=0
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1
  export PYTHONUNBUFFERED=1
  export PMIX_MCA_pcompress_base_silence_warning=1  # the bundle's PMIx has no zlib: a warning per mpirun
}

gpu_count() { cat "$work/gpus" 2>/dev/null || echo 0; }

# The bundle into $b (stage smoke; bench/gpu_fast.sh when no check ran before it).
unpack_bundle() { rm -rf "$b" && mkdir -p "$unpack_root" && tar -C "$unpack_root" -xJf "$bundle_dir/bundle.tar.xz"; }

# ---------------------------------------------------------------------------------------------
# The stages. Each runs in a process of its own (stdout and stderr: $out/NAME.log), reports its
# verdict with `note` and returns 0 for PASS.

# The libraries the CUDA module resolves (ldd), as key=path for the version probe.
cuda_lib_paths() {
  ldd "$b/lib/libmnist_mpi_cuda.so" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {
    if ($1 ~ /^libcudart\.so/) print "cudart=" $3
    else if ($1 ~ /^libcudnn\.so/) print "cudnn=" $3
    else if ($1 ~ /^libcublas\.so/) print "cublas=" $3
    else if ($1 ~ /^libnccl\.so/) print "nccl=" $3 }'
}

# Versions from the libraries themselves (ctypes), and whether the driver can run this runtime.
probe_versions() {
  # shellcheck disable=SC2046  # one key=path argument per line
  timeout 20 python3 - $(cuda_lib_paths) <<'PY'
import ctypes, sys
paths = dict(a.split("=", 1) for a in sys.argv[1:])
problems = []

def load(key):
    p = paths.get(key)
    if not p:
        print(f"{key}: not resolved (ldd, above)")
        problems.append(f"{key} not found")
        return None
    try:
        return ctypes.CDLL(p)
    except OSError as e:
        print(f"{key}: cannot load {p}: {e}")
        problems.append(f"cannot load {key}")
        return None

def cuda(v):  # 1000 * major + 10 * minor
    return f"{v // 1000}.{v % 1000 // 10}"

rt = load("cudart")
if rt:
    r, d, n = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(r))
    rt.cudaDriverGetVersion(ctypes.byref(d))
    print(f"CUDA runtime {cuda(r.value)}, the driver's CUDA "
          f"{cuda(d.value) if d.value else 'none (no driver is loaded)'} ({paths['cudart']})")
    if d.value == 0:
        problems.append("no NVIDIA driver is loaded")
    elif d.value // 1000 < r.value // 1000:
        problems.append(f"driver too old: it supports CUDA {cuda(d.value)}, the runtime is {cuda(r.value)}")
    elif d.value < r.value:
        print(f"note: the driver (CUDA {cuda(d.value)}) is older than the runtime ({cuda(r.value)}): "
              "CUDA's minor version compatibility covers it, except PTX compiled by a newer compiler")
    rt.cudaGetErrorString.restype = ctypes.c_char_p
    rc = rt.cudaGetDeviceCount(ctypes.byref(n))
    if rc:
        problems.append("cudaGetDeviceCount: " + rt.cudaGetErrorString(rc).decode())
    else:
        print(f"CUDA devices visible: {n.value}")
dnn = load("cudnn")
if dnn:
    dnn.cudnnGetVersion.restype = ctypes.c_size_t
    dnn.cudnnGetCudartVersion.restype = ctypes.c_size_t
    v = dnn.cudnnGetVersion()
    s = f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 90000 else f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
    print(f"cuDNN {s} (built for CUDA {cuda(dnn.cudnnGetCudartVersion())}; {paths['cudnn']})")
blas = load("cublas")
if blas:
    parts = []
    for prop in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        x = ctypes.c_int()
        blas.cublasGetProperty(prop, ctypes.byref(x))
        parts.append(str(x.value))
    print(f"cuBLAS {'.'.join(parts)} ({paths['cublas']})")
nc = load("nccl")
if nc:
    x = ctypes.c_int()
    nc.ncclGetVersion(ctypes.byref(x))
    v = x.value
    s = f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
    print(f"NCCL {s} ({paths['nccl']})")
if problems:
    print("problem: " + "; ".join(problems))
sys.exit(1 if problems else 0)
PY
}

stage_smoke() {
  local bundle=$bundle_dir/bundle.tar.xz failed=() what gpu driver rc t0 t
  echo "-- bundle"
  if [ ! -f "$bundle" ]; then
    note "no $bundle: run 'scripts/gpu_check.sh pack' where it builds, and carry $bundle_dir"
    return 1
  fi
  if ! unpack_bundle; then note "could not unpack $bundle"; return 1; fi
  cat "$b/BUILD_INFO" 2>/dev/null || echo "(no BUILD_INFO in this bundle)"

  echo "-- machine"
  timeout 20 nvidia-smi || failed+=("nvidia-smi failed or hung (no driver?)")
  what=$(timeout 20 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  gpu=${what%%,*} driver=${what##*, }
  timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU' >"$work/gpus"
  echo "GPUs visible: $(gpu_count)"

  echo "-- libraries the program, the tests and the CUDA module link (ldd)"
  ldd "$b/bin/mnist_mpi" "$b/bin/gpu_tests" "$b/lib/libmnist_mpi_cuda.so" |
    grep -E "^/|mnist_mpi|cudnn|cublas|nccl|cudart|libmpi|dnnl|not found"
  what=$(ldd "$b/bin/mnist_mpi" "$b/bin/gpu_tests" "$b/lib/libmnist_mpi_cuda.so" | grep "not found" | awk '{print $1}' | sort -u | paste -sd ' ' -)
  [ -n "$what" ] && failed+=("unresolved: $what")

  echo "-- versions, from the libraries resolved above"
  probe_versions >"$work/versions.txt" 2>&1
  rc=$?
  cat "$work/versions.txt"
  what=$(grep '^problem: ' "$work/versions.txt" | tail -n 1 | cut -c10-)
  [ "$rc" = 0 ] || failed+=("${what:-the version probe ended with exit code $rc}")

  # What the binaries load at run time is invisible to ldd: the CUDA module (dlopen), cuDNN's
  # sub-libraries, Open MPI's components. The dynamic loader's trace lists every library whose
  # initialiser ran; Open MPI and cuDNN are asked to say what failed to load.
  echo "-- 20 steps of configs/tiny.ini on 1 rank, --device cuda"
  rm -f "$work"/ld.*
  t0=$SECONDS
  LD_DEBUG=files LD_DEBUG_OUTPUT=$work/ld OMPI_MCA_mca_base_component_show_load_errors=1 \
    CUDNN_LOGLEVEL_DBG=1 CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG=stderr NCCL_DEBUG=WARN \
    "$b/bin/mnist_mpi" --config "$b/tiny.ini" --data-dir "$b/data" --device cuda --max-steps 20 \
    --log-every 5 --collective-timeout 30 2>&1 | tee "$work/smoke_run.txt"
  rc=${PIPESTATUS[0]}
  t=$((SECONDS - t0))
  [ "$rc" = 0 ] || failed+=("20 steps of tiny: exit code $rc")

  echo "-- loaded at run time (ldd does not show these)"
  grep -h 'calling init:' "$work"/ld.* 2>/dev/null | awk '{print $NF}' | sort -u >"$work/loaded.txt"
  grep -E 'mnist_mpi|cudnn|cublas|nccl|cudart|libcuda\.so' "$work/loaded.txt"
  echo "Open MPI components: $(grep -c '/mca_' "$work/loaded.txt")"
  grep -q 'libmnist_mpi_cuda' "$work/loaded.txt" || failed+=("the CUDA module was not loaded")
  grep -q 'libcudnn_' "$work/loaded.txt" || echo "note: no cuDNN sub-library (libcudnn_*) was loaded"
  grep -q '/mca_' "$work/loaded.txt" || echo "note: no Open MPI component was loaded"

  echo "-- what failed to load or run (errors in the output above)"
  what=$(grep -hE 'unable to open|cannot open shared object|error while loading|Could not load library|CUDNN_STATUS_[A-Z_]+|NCCL WARN|mnist_mpi: error' \
    "$work/smoke_run.txt" | sort -u)
  if [ -n "$what" ]; then head -n 20 <<<"$what"; else echo "(nothing)"; fi

  if ((${#failed[@]})); then
    note "$(printf '%s; ' "${failed[@]}" | sed 's/; $//')"
    return 1
  fi
  note "${gpu:-?}, driver ${driver:-?}; $(grep -E '^(CUDA runtime|cuDNN|NCCL)' "$work/versions.txt" | sed 's/ (.*//' | paste -sd ';' - | sed 's/;/; /g'); 20 steps in $t s"
}

stage_gpu_tests() {
  [ -x "$b/bin/gpu_tests" ] || { note "no $b/bin/gpu_tests (smoke did not unpack the bundle)"; return 1; }
  "$b/bin/gpu_tests" --gtest_color=no 2>&1 | tee "$work/gpu_tests.txt"
  gtest_verdict "$work/gpu_tests.txt" "${PIPESTATUS[0]}"
}

stage_gpu_np2() {
  local filter=Gpu.TrajectoryDoesNotDependOnTheNumberOfRanks:Gpu.MeasuredConvolutionAlgorithmsTrainTheSameModel
  filter+=:Gpu.ExactSumsGiveTheSameBitsOnAnyNumberOfRanks
  [ -x "$b/bin/gpu_tests" ] || { note "no $b/bin/gpu_tests (smoke did not unpack the bundle)"; return 1; }
  if (($(gpu_count) >= 2)); then
    filter="GpuNccl.*:$filter"
    echo "-- 2 ranks, one GPU each: NCCL sums and shards"
  else
    echo "-- 2 ranks sharing the one GPU: gradients summed through host memory (NCCL needs a GPU per rank)"
  fi
  mpirun -np 2 "$b/bin/gpu_tests" --gtest_color=no --gtest_filter="$filter" 2>&1 | tee "$work/gpu_np2.txt"
  gtest_verdict "$work/gpu_np2.txt" "${PIPESTATUS[0]}" || return 1
  (($(gpu_count) >= 2)) || nccl_hosts_on_one_gpu
}

# Note [Ranks that are NCCL hosts of their own] (include/mnist_mpi/comm/communicator.hpp): with one
# GPU, its two ranks each their own NCCL host (NCCL_HOSTID; sockets on lo, the only interface both
# share) sum through NCCL as two nodes would: NCCL between ranks, which one GPU otherwise never
# runs. gpu_tests' NCCL and world-size tests, then lenet, 60 steps: --exact-sums, sharded, on the
# two ranks against one rank (params_hash equal), and --cuda-graph against ungraphed on the two.
# NCCL's own log must say the ranks' channels go through its socket transport.
nccl_hosts() {  # ARGS...: mpirun -np 2, each rank its own NCCL_HOSTID
  mpirun -np 2 -x NCCL_SOCKET_IFNAME=lo -x NCCL_IB_DISABLE=1 -x NCCL_DEBUG=INFO -x NCCL_DEBUG_SUBSYS=INIT,NET \
    bash -c 'NCCL_HOSTID=gpu-check-rank$OMPI_COMM_WORLD_RANK exec "$@"' nccl_hosts "$@"
}
nccl_hosts_on_one_gpu() {
  local filter=GpuNccl.*:Gpu.TrajectoryDoesNotDependOnTheNumberOfRanks:Gpu.ExactSumsGiveTheSameBitsOnAnyNumberOfRanks
  echo "-- 2 ranks on the one GPU, each its own NCCL host (NCCL_HOSTID): NCCL over sockets"
  nccl_hosts "$b/bin/gpu_tests" --gtest_color=no --gtest_filter="$filter" 2>&1 | tee "$work/gpu_np2_nccl.txt"
  local rc=${PIPESTATUS[0]} verdict
  verdict=$(gtest_verdict "$work/gpu_np2_nccl.txt" "$rc") || { note "NCCL hosts: gpu_tests $verdict"; return 1; }
  if grep -qE '^\[  SKIPPED \] GpuNccl' <(uncoloured "$work/gpu_np2_nccl.txt"); then
    note "NCCL hosts: the GpuNccl tests skipped: the ranks were not taken for NCCL hosts"; return 1
  fi
  if ! grep -qE 'via NET/Socket' "$work/gpu_np2_nccl.txt"; then
    note "NCCL hosts: NCCL's log names no channel via NET/Socket"; return 1
  fi
  local lenet=(--config "$b/lenet.ini" --data-dir "$b/data" --device cuda --max-steps 60 --log-every 30
               --collective-timeout 30 --allow-gpu-sharing) name h=()
  for name in one exact graph eager; do
    local run=(nccl_hosts "$b/bin/mnist_mpi") extra=()
    case $name in
      one) run=("$b/bin/mnist_mpi"); extra=(--exact-sums) ;;
      exact) extra=(--exact-sums --shard-optimizer on) ;;
      graph) extra=(--cuda-graph) ;;
    esac
    echo "-- lenet, 60 steps, ${name}: ${run[*]:0:2} ${extra[*]}"
    "${run[@]}" "${lenet[@]}" "${extra[@]}" --metrics-file "$work/nccl_$name.jsonl" 2>&1 | tee "$work/nccl_$name.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { note "NCCL hosts: lenet $name exit code $rc"; return 1; }
    if [ "$name" != one ] && ! grep -q 'each its own NCCL host' "$work/nccl_$name.txt"; then
      note "NCCL hosts: lenet $name's banner does not say NCCL sums between NCCL hosts"; return 1
    fi
    h+=("$(final_hash "$work/nccl_$name.jsonl")")
  done
  echo "agreement NCCL hosts: --exact-sums 1 rank ${h[0]}, 2 ranks sharded ${h[1]}; --cuda-graph ${h[2]}, ungraphed ${h[3]}"
  if [ -z "${h[0]}" ] || [ "${h[0]}" != "${h[1]}" ] || [ -z "${h[2]}" ] || [ "${h[2]}" != "${h[3]}" ]; then
    note "NCCL hosts: params_hash --exact-sums 1 rank ${h[0]:-none} vs 2 sharded ${h[1]:-none}; graph ${h[2]:-none} vs ungraphed ${h[3]:-none}"
    return 1
  fi
  note "NCCL hosts on one GPU (sockets): gpu_tests passed; --exact-sums 2 ranks sharded = 1 rank (${h[0]}); --cuda-graph = ungraphed (${h[2]})"
}

# PRECISION: the ungraphed step, then --cuda-graph (Note [A step as one CUDA graph]), both with the
# heuristics' convolution algorithms (their params_hash must be equal), then --cuda-graph with
# --conv-algos measured (Note [Choosing cuDNN algorithms]: other algorithms, other bits).
# A run's last params_hash (its metrics file), and "images/s steady, test accuracy A" (its output).
final_hash() { grep -ohE '"params_hash":"[0-9a-f]+"' "$1" 2>/dev/null | tail -n 1 | cut -d'"' -f4; }
rate_and_accuracy() { echo "$(grep -hE 'images/s steady' "$1" | cut -d, -f1), $(grep -hE '^test accuracy' "$1" | cut -d' ' -f1-3)"; }

lenet_precision() {
  local prec=$1 ranks=1 run=("$b/bin/mnist_mpi") rc how tag hashes=() rates=()
  [ -x "$b/bin/mnist_mpi" ] || { note "no $b/bin/mnist_mpi (smoke did not unpack the bundle)"; return 1; }
  if (($(gpu_count) >= 2)); then ranks=2 run=(mpirun -np 2 "$b/bin/mnist_mpi"); fi
  for how in eager graph measured; do
    tag=${prec}_$how
    local extra=()
    [ "$how" = eager ] || extra+=(--cuda-graph)
    [ "$how" = measured ] && extra+=(--conv-algos measured)
    echo "-- mnist_mpi lenet, 1 epoch, $ranks rank(s) on $(gpu_count) GPU(s), --precision $prec ${extra[*]:-(no graph)}"
    "${run[@]}" --config "$b/lenet.ini" --data-dir "$b/data" --device cuda --precision "$prec" --epochs 1 "${extra[@]}" \
      --log-every 110 --collective-timeout 30 --metrics-file "$work/lenet_$tag.jsonl" 2>&1 | tee "$work/lenet_$tag.txt"
    rc=${PIPESTATUS[0]}
    echo "-- the metrics file's last event"
    tail -n 1 "$work/lenet_$tag.jsonl" 2>/dev/null
    if [ "$rc" != 0 ]; then note "$how: exit code $rc${rates[*]:+; before it: ${rates[*]}}"; return 1; fi
    if [ "$how" = measured ] && ! grep -q '(measured)' "$work/lenet_$tag.txt"; then
      note "measured: the banner names no convolution built with measured algorithms"
      return 1
    fi
    hashes+=("$(final_hash "$work/lenet_$tag.jsonl")")
    rates+=("$how: $(rate_and_accuracy "$work/lenet_$tag.txt")")
    # One epoch of lenet reaches 98.4-98.8 % in every precision measured (fp32 and tf32 on an
    # H200, fp32 and bf16 on CPUs): below 97 % the precision's training is broken, not unlucky.
    local acc
    acc=$(grep -ohE '"test_accuracy":[0-9.]+' "$work/lenet_$tag.jsonl" | tail -n 1 | cut -d: -f2)
    if ! awk -v a="${acc:-0}" 'BEGIN { exit !(a >= 0.97) }'; then
      note "$how: test accuracy ${acc:-none} after one epoch, below 97 %: ${rates[*]}"
      return 1
    fi
  done
  if [ -z "${hashes[0]}" ] || [ "${hashes[0]}" != "${hashes[1]}" ]; then
    note "params_hash without the graph ${hashes[0]:-none}, with it ${hashes[1]:-none}: the graph changes the bits; ${rates[*]}"
    return 1
  fi
  note "${rates[0]} | ${rates[1]} | params_hash ${hashes[0]} both | ${rates[2]}, params_hash ${hashes[2]:-none}"
}
# Note [Sharded optimiser state] (include/mnist_mpi/train/optimizer.hpp) on the device: the sharded
# run's params_hash is the unsharded one's, on 1 rank and on 2.
stage_sharded() {
  local ranks mode rc hash verdict=() bad=0 launch
  [ -x "$b/bin/mnist_mpi" ] || { note "no $b/bin/mnist_mpi (smoke did not unpack the bundle)"; return 1; }
  for ranks in 1 2; do
    launch=("$b/bin/mnist_mpi")
    ((ranks == 2)) && launch=(mpirun -np 2 "$b/bin/mnist_mpi")
    ((ranks == 2 && $(gpu_count) < 2)) && launch+=(--allow-gpu-sharing)
    local hashes=()
    for mode in off on; do
      echo "-- lenet, 100 steps, $ranks rank(s), --shard-optimizer $mode"
      "${launch[@]}" --config "$b/lenet.ini" --data-dir "$b/data" --device cuda --max-steps 100 --log-every 50 \
        --shard-optimizer "$mode" --collective-timeout 30 --metrics-file "$work/sharded_${ranks}_$mode.jsonl" 2>&1 |
        tee "$work/sharded_${ranks}_$mode.txt"
      rc=${PIPESTATUS[0]}
      hash=$(final_hash "$work/sharded_${ranks}_$mode.jsonl")
      [ "$rc" = 0 ] || { bad=1; hash="exit code $rc"; }
      hashes+=("${hash:-none}")
    done
    if [ "${hashes[0]}" != "${hashes[1]}" ] || ! [[ "${hashes[0]}" =~ ^[0-9a-f]{16}$ ]]; then bad=1; fi
    verdict+=("$ranks rank(s): off ${hashes[0]}, on ${hashes[1]}")
  done
  note "$(printf '%s; ' "${verdict[@]}" | sed 's/; $//')"
  return "$bad"
}

# One lenet run per precision, the cuDNN algorithms' costs behind them (bench/cudnn_algos.cpp).
stage_lenet() {
  local rc=0 notes=() sink=${STAGE_NOTE:-/dev/null}
  lenet_precision fp32 || rc=1
  notes+=("fp32: $(tail -n 1 "$sink" 2>/dev/null)")
  lenet_precision tf32 || rc=1
  notes+=("tf32: $(tail -n 1 "$sink" 2>/dev/null)")
  if [ -x "$b/bin/cudnn_algos" ]; then
    echo "-- build/cudnn_algos"
    "$b/bin/cudnn_algos" 2>&1 | tee "$work/algos.txt"
    local arc=${PIPESTATUS[0]}
    ((arc == 0)) || rc=1
    notes+=("cudnn_algos: exit code $arc, $(grep -c '<- fastest' "$work/algos.txt") directions timed")
  else
    notes+=("cudnn_algos: not in the bundle")
    rc=1
  fi
  lenet_precision bf16 || rc=1  # Note [bf16 on the GPU]: its first run on a GPU
  notes+=("bf16: $(tail -n 1 "$sink" 2>/dev/null)")
  note "$(printf '%s || ' "${notes[@]}" | sed 's/ || $//')"
  return "$rc"
}

how_it_ended() { case $1 in 0) echo ok ;; 124 | 137) echo "timed out" ;; *) echo "exit code $1" ;; esac; }

stage_torch() {
  # PyTorch brings its own CUDA libraries: the bundle's and the wheels' paths must not shadow them.
  (
    unset LD_LIBRARY_PATH
    local rc1 rc2 left
    left=$(($(stage_left) - 3))
    ((left < torch_fp32_s)) || left=$torch_fp32_s
    echo "-- PyTorch eager, fp32 (TF32 off), at most $left s"
    timeout -k 2 "$left" python3 bench/torch_gpu.py --data-dir "$b/data" --json 2>&1 | tee "$work/torch.txt"
    rc1=${PIPESTATUS[0]}
    left=$(($(stage_left) - 3))
    if ((left < 10)); then
      echo "-- PyTorch eager, tf32: not run, $left s left"
      rc2=124
    else
      echo "-- PyTorch eager, tf32, at most $left s"
      timeout -k 2 "$left" python3 bench/torch_gpu.py --data-dir "$b/data" --tf32 --json 2>&1 | tee "$work/torch_tf32.txt"
      rc2=${PIPESTATUS[0]}
    fi
    local lines
    lines=$(grep -h '^pytorch eager' "$work/torch.txt" "$work/torch_tf32.txt" 2>/dev/null | sed 's/^pytorch eager on //' | paste -sd '|' -)
    if [ "$rc1" != 0 ] || [ "$rc2" != 0 ]; then
      note "fp32: $(how_it_ended "$rc1"), tf32: $(how_it_ended "$rc2")${lines:+; $lines}"
      return 1
    fi
    note "$lines"
  )
}

# ---------------------------------------------------------------------------------------------

summary() {
  local failed
  failed=$(awk -F'\t' 'NR > 1 && $2 != "PASS" { printf "%s%s %s", sep, $1, $2; sep = ", " }' "$out/stages.tsv")
  {
    echo "== summary ($((SECONDS - run_start)) s of $total_s s)"
    awk -F'\t' 'NR > 1 { printf "%-11s %-8s %4s s of %4s s  %s\n", $1, $2, $3, $4, $5 }' "$out/stages.tsv"
    if grep -qsE '^agreement' "$out/gpu_tests.log" "$out/gpu_np2.log"; then
      echo "-- agreement with the CPU (gpu_tests)"
      grep -hsE '^agreement' "$out/gpu_tests.log" "$out/gpu_np2.log"
    fi
    if [ -n "$failed" ]; then echo "gpu_check: FAIL: $failed"; else echo "gpu_check: PASS"; fi
  } | tee "$out/summary.txt"
  [ -z "$failed" ]
}

on_signal() {
  echo "gpu_check: stopped from outside${current_stage:+ during stage $current_stage}"
  [ -n "${stage_pid:-}" ] && kill -TERM "$stage_pid" 2>/dev/null  # timeout passes it on to the stage
  [ -n "${current_stage:-}" ] && record "$current_stage" STOPPED $((SECONDS - stage_start)) "$stage_budget" "stopped from outside"
  summary
  exit 143
}

run() {
  run_start=$SECONDS
  deadline=$((SECONDS + total_s))
  current_stage="" stage_pid=""
  export OUT=$out GPU_CHECK_WORK=$work
  mkdir -p "$out"
  rm -rf "$work" && mkdir -p "$work"
  rm -f "$out/stages.tsv" "$out/summary.txt"
  printf 'stage\tresult\tseconds\tbudget\tnote\n' >"$out/stages.tsv"
  trap on_signal TERM INT HUP
  echo "gpu_check: $(budget_stages | wc -l) stages, budget $(budget_sum) s, deadline $total_s s; results in $out/stages.tsv"
  gpu_env
  local name budget
  while read -r name budget; do
    run_stage "$name" "$budget"
  done < <(budget_stages)
  trap - TERM INT HUP
  summary
}

# What the bundle was built with, for the smoke stage to print beside what the GPU machine has.
build_info() {
  local cache=build/CMakeCache.txt dir
  echo "bundle built from $(git describe --always --dirty 2>/dev/null || echo '?') on $(uname -m), $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "nvcc: $(nvcc --version 2>/dev/null | grep -E 'release' || grep -h '^CMAKE_CUDA_COMPILER:' "$cache" 2>/dev/null)"
  dir=$(grep -h '^CUDNN_INCLUDE_DIR:' "$cache" 2>/dev/null | cut -d= -f2)
  echo "cuDNN headers: $(grep -hE '^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) ' "$dir"/cudnn_version.h "$dir"/cudnn.h 2>/dev/null | awk '{print $3}' | head -n 3 | paste -sd . -)"
  dir=$(grep -h '^NCCL_INCLUDE_DIR:' "$cache" 2>/dev/null | cut -d= -f2)
  echo "NCCL headers: $(grep -hE '^#define NCCL_(MAJOR|MINOR|PATCH) ' "$dir"/nccl.h 2>/dev/null | awk '{print $3}' | paste -sd . -)"
  echo "Open MPI: $(mpirun --version 2>/dev/null | head -n 1)"
}

# Bytes of what a call sends besides carried paths: tracked files and untracked ones git does not
# ignore.
tree_bytes() {
  git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'
}

# Whether a bundle of BUNDLE bytes fits, with the working tree's TREE bytes, in what one call
# carries; says so when not.
bundle_fits() {  # BUNDLE TREE
  local mib=$((1024 * 1024))
  if (($1 + $2 > carry_limit)); then
    echo "gpu_check: the bundle is $(($1 / mib)) MiB and the working tree that travels with it $(($2 / mib)) MiB: more than the $((carry_limit / mib)) MiB a call to the GPU machine carries"
    return 1
  fi
  echo "gpu_check: the bundle is $(($1 / mib)) MiB, the working tree $(($2 / mib)) MiB: $((($1 + $2) / mib)) of $((carry_limit / mib)) MiB"
}

pack() {
  set -e
  local bin=build/mnist_mpi tests=build/tests/gpu_tests module=build/libmnist_mpi_cuda.so
  # shellcheck disable=SC2015  # the message when either test fails
  [ -x "$bin" ] && [ -x "$tests" ] || { echo "gpu_check: build first (scripts/setup.sh)"; exit 1; }
  # shellcheck disable=SC2015
  [ -f "$module" ] && ldd "$module" | grep -q libcudnn || { echo "gpu_check: no CUDA module $module (configure with -DMNIST_MPI_CUDA=ON)"; exit 1; }
  [ -f data/mnist/train-images-idx3-ubyte ] || scripts/fetch_mnist.sh
  local tmp
  tmp=$(mktemp -d)
  local b=$tmp/mnist_gpu
  mkdir -p "$b/bin" "$b/lib" "$b/ompi/lib/openmpi3" "$b/ompi/share" "$b/data"
  cp "$bin" "$tests" "$b/bin/"
  [ -x build/cudnn_algos ] && cp build/cudnn_algos "$b/bin/"  # for the lenet stage
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
  cp configs/lenet.ini configs/tiny.ini "$b/"
  build_info >"$b/BUILD_INFO"
  mkdir -p "$bundle_dir"
  echo "gpu_check: packing $(du -sh "$b" | cut -f1) (xz; a minute or two) ..."
  tar -C "$tmp" -cf - mnist_gpu | xz -T0 -6 >"$bundle_dir/bundle.tar.xz"
  if ! bundle_fits "$(stat -c %s "$bundle_dir/bundle.tar.xz")" "$(tree_bytes)"; then
    echo "gpu_check: the largest parts, before compression:"
    (cd "$tmp" && find mnist_gpu -type f -printf '%s %p\n' | sort -rn | head -n 15 | awk '{ printf "  %6.1f MiB  %s\n", $1 / 1048576, $2 }')
    rm -f "$bundle_dir/bundle.tar.xz"
    rm -rf "$tmp"
    echo "gpu_check: no bundle written"
    exit 1
  fi
  rm -rf "$tmp"
  ls -la "$bundle_dir/bundle.tar.xz"
  echo "gpu_check: carry $bundle_dir to the GPU machine and run: bash scripts/gpu_check.sh run"
}

main() {
  cd "$root" || exit 1
  case "${1:-}" in
    pack) pack ;;
    run) run ;;
    budget) echo "$budget_table"; echo "sum $(budget_sum) s; deadline $total_s s" ;;
    *) echo "usage: scripts/gpu_check.sh pack|run|budget   (see the comment at the top)"; exit 2 ;;
  esac
}

# Sourced (by the stages, and by tests/gpu_check_selftest.sh): define everything, run nothing.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi
