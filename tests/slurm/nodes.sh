#!/usr/bin/env bash
# CTest 'slurm_nodes' (labels slurm, multinode): launch/slurm/multinode.sbatch on a Slurm whose
# controller and two slurmd run on two nodes of their own (tests/netns_lib.sh: a network stack,
# address and hostname each, node1 and node2). The job's ranks start as Debian's Slurm and Open MPI
# allow it, through srun --mpi=pmix (the script's own choice), one task on each node; then the same
# job again with mpirun inside the allocation (MNIST_MPI_LAUNCHER=mpirun: mpirun starts its daemon
# on node2 through Slurm). Both must form one world across the two hosts, say so in the hosts line
# and train.
# Usage: nodes.sh MNIST_MPI REPO_ROOT        (exit 77 = skipped, with the reason printed)
set -uo pipefail
bin=$1 root=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cluster.sh
. "$here/cluster.sh"
# shellcheck source=../netns_lib.sh
. "$here/../netns_lib.sh"
slurm_test_begin "$root"  # MNIST check, install, $work, ok/bad, the EXIT trap (cluster.sh)
expect() {  # expect NAME FILE PATTERN: FILE matches the extended regex PATTERN
  if grep -qE -- "$3" "$2" 2>/dev/null; then ok "$1"; else bad "$1: $2 lacks /$3/"; fi
}
command -v ip >/dev/null && command -v nsenter >/dev/null ||
  slurm_skip "no ip or nsenter (iproute2, util-linux) for the nodes' namespaces"
nodes_make 2 || { bad "could not make the two nodes (network namespaces)"; exit 1; }
# Both traps: the cluster stopped (its clients on node1), then the nodes removed, then the verdict.
trap 'slurm_down; nodes_remove; slurm_test_finish' EXIT
trap 'exit 1' INT TERM

slurm_up "$work/slurm" 1 2 netns || { bad "cluster did not start"; exit 1; }
run=$work/run
mkdir -p "$run"

job() {  # job NAME LAUNCHER: multinode.sbatch, one task of one CPU on each node; sets $log, $id
  local name=$1 launcher=$2 out rc
  out=$(node_run 1 env MNIST_MPI="$bin" MNIST_MPI_ROOT="$root" ${launcher:+MNIST_MPI_LAUNCHER=$launcher} \
    timeout 150 sbatch --wait --parsable -D "$run" -J "$name" --ntasks-per-node=1 --cpus-per-task=1 \
    "$root/launch/slurm/multinode.sbatch" --config "$root/configs/tiny.ini" --data-dir "$root/data/mnist" \
    --train-limit 6000 --validation-size 500 --batch-size 50 --max-steps 40 --log-every 20 \
    --metrics-file "$run/$name.jsonl")
  rc=$?
  id=${out%%;*}
  log=$run/$name-$id.out
  if [ "$rc" -eq 0 ]; then ok "$name: job $id finished with exit 0"; else bad "$name: job '$id' exit $rc"; fi
  expect "$name: the job spans both nodes" "$log" \
    "^multinode.sbatch: job $id '$name' \(requeued 0 time\(s\)\) on node\[1-2\]: 2 task\(s\) x 1 CPU\(s\)"
  expect "$name: one world of 2 ranks" "$log" "^mnist_mpi [0-9.]+: 2 rank\(s\)"
  expect "$name: one rank on each host, each the first of its node" "$log" \
    "hosts: node1 rank 0 \(local 0\), node2 rank 1 \(local 0\)"
  expect "$name: it trained 40 steps on 2 ranks" "$run/$name.jsonl" \
    "\"event\":\"final\",\"test_accuracy\":0\.[89][0-9]*,.*\"steps\":40,.*\"world_size\":2,"
}

# srun where Slurm has the pmix plugin (Note [Which launcher inside the allocation]).
if grep -qw pmix <<<"$(node_run 1 srun --mpi=list 2>&1)"; then
  job nodes-srun ""
  expect "nodes-srun: srun started the ranks" "$log" "running: srun --mpi=pmix "
else
  echo "note: this Slurm has no pmix MPI plugin ('srun --mpi=list'): the srun job is not run"
fi
job nodes-mpirun mpirun
expect "nodes-mpirun: mpirun started the ranks" "$log" "running: mpirun --bind-to core --map-by slot:PE=1 "
