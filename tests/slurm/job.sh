#!/usr/bin/env bash
# CTest 'slurm_job' (label slurm): the CPU job script under a real one-node Slurm (tests/slurm/
# cluster.sh). sbatch --wait runs launch/slurm/cpu.sbatch with 2 tasks on 6000 real MNIST images:
# it must train (test accuracy >= 0.85 after 60 steps), log Slurm's job in its start-up line and
# metrics, and write a checkpoint. Then the bad inputs: a global batch the tasks cannot split, a
# config the program rejects, the GPU job on a node without GPUs, a job script run outside Slurm.
# Usage: job.sh MNIST_MPI REPO_ROOT        (exit 77 = skipped, with the reason printed)
set -uo pipefail
bin=$1 root=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cluster.sh
. "$here/cluster.sh"
slurm_test_begin "$root"  # MNIST check, install, $work, ok/bad, the EXIT trap (cluster.sh)
expect() {  # expect NAME FILE PATTERN: FILE matches the extended regex PATTERN
  if grep -qE -- "$3" "$2" 2>/dev/null; then ok "$1"; else bad "$1: $2 lacks /$3/"; echo "----"; tail -30 "$2"; fi
}

slurm_up "$work/slurm" 2 || { bad "cluster did not start"; exit 1; }
run=$work/run
mkdir -p "$run"
export MNIST_MPI=$bin MNIST_MPI_ROOT=$root
data=(--data-dir "$root/data/mnist" --train-limit 6000 --validation-size 500)
small=(--config "$root/configs/tiny.ini" "${data[@]}" --batch-size 50 --max-steps 60 --log-every 20
       --metrics-file "$run/m.jsonl" --checkpoint-every 20)
# shellcheck disable=SC2054  # the commas are the model spec's
other=("${data[@]}" --model conv:3x3:4:same,relu,maxpool:2,flatten,fc:10 --max-steps 5)

# 1. The real thing: 2 tasks, sbatch --wait.
start=$SECONDS
out=$(timeout 100 sbatch --wait --parsable -D "$run" -J slurm-ci -n 2 "$root/launch/slurm/cpu.sbatch" "${small[@]}")
rc=$?
id=${out%%;*}
log=$run/slurm-ci-$id.out
if [ "$rc" -eq 0 ]; then ok "cpu.sbatch job $id finished with exit 0 in $((SECONDS - start)) s"; else bad "cpu.sbatch job '$id' exit $rc"; cat "$log"; fi
expect "log names the launcher and the job" "$log" "^launch: srun, slurm job $id 'slurm-ci' step 0"
expect "2 ranks joined by srun --mpi=pmix" "$log" "^mnist_mpi [0-9.]+: 2 rank\(s\)"
expect "ranks bound to their cores" "$log" "running: srun --mpi=pmix .*--cpu-bind=cores"
expect "script reports success" "$log" "^cpu.sbatch: finished"
expect "metrics start event has the Slurm job" "$run/m.jsonl" "\"event\":\"start\",.*\"world_size\":2,.*\"launcher\":\"srun\",\"slurm_job_id\":\"$id\",\"slurm_job_name\":\"slurm-ci\""
expect "metrics final event: 60 steps on 2 ranks, Slurm job" "$run/m.jsonl" "\"event\":\"final\".*\"steps\":60,.*\"world_size\":2,.*\"slurm_job_id\":\"$id\""
acc=$(grep -oE '"event":"final","test_accuracy":[0-9.]+' "$run/m.jsonl" | grep -oE '[0-9.]+$')
if [ -n "$acc" ] && awk -v a="$acc" 'BEGIN { exit !(a >= 0.85) }'; then ok "it trained: test accuracy $acc >= 0.85"
else bad "it did not train: test accuracy '${acc}' (want >= 0.85)"; fi
n=$(find "$run/checkpoints/slurm-ci" -name 'step-*.ckpt' 2>/dev/null | wc -l)
if [ "$n" -gt 0 ]; then ok "checkpoint written to checkpoints/slurm-ci ($n file(s))"; else bad "no checkpoint in $run/checkpoints/slurm-ci"; fi
expect "the last checkpoint is the final step's" "$log" "^checkpoint after step 60: .*checkpoints/slurm-ci/step-00000060.ckpt"

# 2. A global batch smaller than the job's tasks (one that merely does not divide is split unevenly:
#    Note [Uneven slices]): the script says so before starting any rank.
timeout 60 sbatch --wait --parsable -D "$run" -J bad-batch -n 2 "$root/launch/slurm/cpu.sbatch" "${other[@]}" \
  --global-batch-size 1 >"$work/id" 2>&1
rc=$?
log=$run/bad-batch-$(cut -d';' -f1 "$work/id").out
if [ "$rc" -eq 2 ]; then ok "global batch below the tasks: exit 2"; else bad "global batch below the tasks: exit $rc, expected 2"; fi
expect "global batch below the tasks: names the fix" "$log" "^cpu.sbatch: error: --global-batch-size 1 is smaller than this job's 2 task\(s\): every rank needs at least one image; submit with --ntasks=1 or fewer"
if grep -q "running:" "$log"; then bad "global batch below the tasks: ranks were started anyway"; else ok "global batch below the tasks: no rank started"; fi

# 3. A batch split the program rejects (here through accumulation steps): its one message, exit 2,
#    and the job is not requeued.
timeout 60 sbatch --wait --parsable -D "$run" -J bad-accum -n 2 "$root/launch/slurm/cpu.sbatch" "${other[@]}" \
  --global-batch-size 5 --accumulation-steps 3 >"$work/id" 2>&1
rc=$?
log=$run/bad-accum-$(cut -d';' -f1 "$work/id").out
if [ "$rc" -eq 2 ]; then ok "program usage error: exit 2"; else bad "program usage error: exit $rc, expected 2"; fi
expect "program usage error: one clear line" "$log" "mnist_mpi: error on rank 0 .*--global-batch-size 5 is smaller than the 2 ranks x 3 accumulation steps"
n=$(grep -c 'mnist_mpi: error' "$log")
if [ "$n" -eq 1 ]; then ok "program usage error: exactly one error line"; else bad "program usage error: $n error lines"; fi
expect "program usage error: not requeued" "$log" "^cpu.sbatch: error: mnist_mpi ended with exit code 2 .*not requeued"

# 4. The GPU job where there are no GPUs: Slurm refuses the gres at submission; the script itself,
#    run on a node without GPUs, stops with exit 6 before starting anything.
timeout 30 sbatch -D "$run" "$root/launch/slurm/gpu.sbatch" >"$work/gpu.out" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then ok "gpu.sbatch refused by a cluster without GPUs (exit $rc)"; else bad "gpu.sbatch was accepted by a cluster without GPUs"; fi
expect "gpu.sbatch refusal names the GPU request" "$work/gpu.out" "gres|GRES|generic resource"
timeout 60 srun -D "$run" -n 1 -J gpu-check bash "$root/launch/slurm/gpu.sbatch" "${other[@]}" --batch-size 10 >"$work/gpu2.out" 2>&1
rc=$?
if [ "$rc" -eq 6 ]; then ok "gpu.sbatch on a node without GPUs: exit 6"; else bad "gpu.sbatch on a node without GPUs: exit $rc, expected 6"; fi
expect "gpu.sbatch on a node without GPUs: names the fix" "$work/gpu2.out" "^gpu.sbatch: error: no GPU visible on .*submit to a partition with GPUs"

# 5. A job script run outside Slurm.
(cd "$root" && env -u SLURM_JOB_ID bash launch/slurm/cpu.sbatch --max-steps 1) >"$work/noslurm.out" 2>&1
rc=$?
if [ "$rc" -eq 2 ]; then ok "job script outside Slurm: exit 2"; else bad "job script outside Slurm: exit $rc, expected 2"; fi
expect "job script outside Slurm: names the fix" "$work/noslurm.out" "^cpu.sbatch: error: not inside a Slurm job .*sbatch launch/slurm/cpu.sbatch"
