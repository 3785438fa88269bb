#!/usr/bin/env bash
# CTest 'slurm_multinode' (label slurm): launch/slurm/multinode.sbatch across two Slurm nodes,
# emulated on this host (two slurmd, tests/slurm/cluster.sh), one task of one CPU on each. The
# ranks start through mpirun inside the allocation (MNIST_MPI_LAUNCHER=mpirun; srun --mpi=pmix
# cannot put two emulated nodes on one host), must join into one world across both nodes and train.
# tests/slurm/nodes.sh runs the same job, with srun too, on nodes with network stacks of their own.
# Usage: multinode.sh MNIST_MPI REPO_ROOT        (exit 77 = skipped, with the reason printed)
set -uo pipefail
bin=$1 root=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cluster.sh
. "$here/cluster.sh"
slurm_test_begin "$root"  # MNIST check, install, $work, ok/bad, the EXIT trap (cluster.sh)
expect() {  # expect NAME FILE PATTERN: FILE matches the extended regex PATTERN
  if grep -qE -- "$3" "$2" 2>/dev/null; then ok "$1"; else bad "$1: $2 lacks /$3/"; fi
}

slurm_up "$work/slurm" 1 2 || { bad "cluster did not start"; exit 1; }
run=$work/run
mkdir -p "$run"
export MNIST_MPI=$bin MNIST_MPI_ROOT=$root MNIST_MPI_LAUNCHER=mpirun
out=$(timeout 150 sbatch --wait --parsable -D "$run" -J slurm-multi --ntasks-per-node=1 --cpus-per-task=1 \
  "$root/launch/slurm/multinode.sbatch" --config "$root/configs/tiny.ini" --data-dir "$root/data/mnist" \
  --train-limit 6000 --validation-size 500 --batch-size 50 --max-steps 40 --log-every 20 --metrics-file "$run/m.jsonl")
rc=$?
id=${out%%;*}
log=$run/slurm-multi-$id.out
if [ "$rc" -eq 0 ]; then ok "multinode.sbatch job $id finished with exit 0"; else bad "multinode.sbatch job '$id' exit $rc"; fi
expect "the job spans both nodes" "$log" "^multinode.sbatch: job $id 'slurm-multi' \(requeued 0 time\(s\)\) on n\[1-2\]: 2 task\(s\) x 1 CPU\(s\)"
expect "mpirun started the ranks" "$log" "running: mpirun --bind-to core --map-by slot:PE=1 "
expect "one world of 2 ranks" "$log" "^mnist_mpi [0-9.]+: 2 rank\(s\)"
expect "the program saw the job and both nodes" "$log" "^launch: mpirun, slurm job $id 'slurm-multi', nodes n\[1-2\]"
expect "it trained 40 steps on 2 ranks" "$run/m.jsonl" "\"event\":\"final\",\"test_accuracy\":0\.[89][0-9]*,.*\"steps\":40,.*\"world_size\":2,"
