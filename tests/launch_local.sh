#!/usr/bin/env bash
# CTest 'launch_local' (label e2e): launch/local.sh as a user runs it. A real 2-rank run on
# synthetic data; the mpirun lines it builds (cores bound and threads set when the ranks fit,
# --oversubscribe unbound only when they do not, --allow-run-as-root only for root, arguments
# passed through); GPU ranks on a machine without GPUs and bad launcher options: one clear line.
# Usage: launch_local.sh MNIST_MPI MAKE_SYNTHETIC_MNIST REPO_ROOT
set -uo pipefail
bin=$1 make_data=$2 root=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$make_data" "$work/data" 600 100 || { echo "cannot write synthetic data"; exit 1; }
export MNIST_MPI=$bin
passed=0 failed=0
# check NAME EXPECTED_CODE PATTERN -- launcher args...: exit code, and PATTERN in stdout+stderr
check() {
  local name=$1 want=$2 pattern=$3
  shift 4
  timeout 120 "$root/launch/local.sh" "$@" >"$work/out" 2>&1
  local rc=$?
  if [ "$rc" -eq "$want" ] && grep -qE -- "$pattern" "$work/out"; then
    passed=$((passed + 1)); echo "ok   $name (exit $rc)"
  else
    failed=$((failed + 1)); echo "FAIL $name: exit $rc (want $want), /$pattern/ $(grep -qE -- "$pattern" "$work/out" && echo found || echo 'not found')"
    tail -15 "$work/out"
  fi
}
cores=$(lscpu -p=CORE,SOCKET | grep -v '^#' | sort -u | wc -l)
root_flag=""; [ "$(id -u)" -eq 0 ] && root_flag="--allow-run-as-root "
root_only=$root_flag
# Note [A lost node ends the job] (launch/local.sh): Open MPI told to notice a silent daemon soon.
root_flag+="--mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3 "
# shellcheck disable=SC2054  # the commas are the model spec's
run=(--data-dir "$work/data" --validation-size 100 --model conv:3x3:4:same,relu,maxpool:2,flatten,fc:10 --batch-size 10 --max-steps 4 --log-every 2)

check runs_two_ranks 0 "^mnist_mpi [0-9.]+: 2 rank\(s\), backend cpu, 1 thread\(s\) per rank" -- -n 2 "${run[@]}"
check passes_arguments_through 0 "epoch 1 step 4/4" -- -n 2 "${run[@]}"
check default_one_rank_per_core 0 "mpirun -np $cores ${root_flag}--map-by slot:PE=1 --bind-to core -x OMP_NUM_THREADS=1 -x OMP_PROC_BIND=close -x OMP_PLACES=cores .*mnist_mpi --threads 1 --max-steps 3$" -- --dry-run --max-steps 3
check threads_per_rank 0 "mpirun -np 1 ${root_flag}--map-by slot:PE=$cores --bind-to core -x OMP_NUM_THREADS=$cores .* --threads $cores$" -- -n 1 --dry-run
check user_threads_kept 0 "mnist_mpi --threads 1$" -- -n 1 --dry-run --threads 1
check oversubscribes_only_when_needed 0 "mpirun -np $((cores + 1)) ${root_flag}--oversubscribe --bind-to none" -- -n $((cores + 1)) --dry-run
check oversubscribed_run_works 0 "^mnist_mpi [0-9.]+: $((cores + 1)) rank\(s\)" -- -n $((cores + 1)) "${run[@]}"
check program_errors_come_through 2 "mnist_mpi: error on rank 0 .*unrecognised option '--bogus'" -- -n 2 --bogus 1
check bad_rank_count 2 "^local.sh: error: -n and -t take a whole number >= 1, not '0'" -- -n 0
# --hosts: the ranks are the slots' sum (a host without :SLOTS holds one), passed to mpirun's --host.
check hosts_give_the_ranks 0 "mpirun -np 3 --host a:2,b ${root_flag}--oversubscribe --bind-to none" -- --hosts a:2,b --dry-run
check hosts_bad 2 "^local.sh: error: --hosts takes HOST\[:SLOTS\] separated by commas \(node1:2,node2:2\), not 'a b'" -- --hosts "a b"
check hosts_fewer_slots 2 "^local.sh: error: -n 4 but --hosts a:2,b holds 3 rank\(s\)" -- -n 4 --hosts a:2,b
check bad_grace 2 "^local.sh: error: --grace takes a whole number of seconds from 1 to 999, not '0'" -- --grace 0
# The user's own keepalive is kept.
OMPI_MCA_oob_tcp_keepalive_time=60 check users_keepalive_kept 0 "mpirun -np 1 ${root_only}--map-by" -- -n 1 --dry-run
MNIST_MPI=$work/nope check missing_program 2 "^local.sh: error: no program at $work/nope: build it" -- --dry-run
if command -v nvidia-smi >/dev/null 2>&1 && [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')" -gt 0 ]; then
  echo "=== NOTE: this machine has GPUs: the no-GPU case is not checked here ==="
else
  CUDA_VISIBLE_DEVICES='' check gpu_ranks_without_gpus 6 "^local.sh: error: --device cuda but this machine shows no GPU" -- --device cuda
fi
CUDA_VISIBLE_DEVICES=0,1 check gpu_ranks_one_per_gpu 0 "mpirun -np 2 .*mnist_mpi --threads [0-9]+ --device cuda$" -- --dry-run --device cuda
CUDA_VISIBLE_DEVICES=0,1 check more_gpu_ranks_than_gpus 6 "^local.sh: error: 3 GPU ranks but 2 GPU\(s\)" -- -n 3 --device cuda

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
