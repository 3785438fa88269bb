#!/usr/bin/env bash
# CTest 'slurm_requeue' (label slurm): preemption under a real one-node Slurm (tests/slurm/
# cluster.sh). A 2-task launch/slurm/cpu.sbatch job is signalled twice while it trains: first
# through the batch shell (scancel --batch --signal=USR1, the path --signal=B:USR1@120 takes),
# then straight to the ranks (scancel --signal=USR1). Each time the ranks must write a checkpoint
# and exit 75, the script must requeue the job, and the requeued job must resume from the
# checkpoint; in the end the model must be bitwise the one an uninterrupted job trains.
# Usage: requeue.sh MNIST_MPI REPO_ROOT        (exit 77 = skipped, with the reason printed)
set -uo pipefail
bin=$1 root=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cluster.sh
. "$here/cluster.sh"
slurm_test_begin "$root"  # MNIST check, install, $work, ok/bad, the EXIT trap (cluster.sh)
expect_n() {  # expect_n NAME FILE PATTERN N: PATTERN on exactly N lines of FILE
  local n
  n=$(grep -cE -- "$3" "$2" 2>/dev/null)
  if [ "$n" -eq "$4" ]; then ok "$1"; else bad "$1: /$3/ on $n line(s) of $2, expected $4"; fi
}
# wait_for SECONDS COMMAND...: polls COMMAND every 0.2 s until it succeeds
wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@"; do [ "$SECONDS" -lt "$end" ] || return 1; sleep 0.2; done
}
state() { squeue -h -j "$id" -o %T 2>/dev/null; }
is_pending() { [ "$(state)" = PENDING ]; }
log_has() { grep -qE -- "$1" "$log" 2>/dev/null; }
# The last step a progress line reports, in the log's last run.
last_step() { grep -oE '^epoch [0-9]+ step [0-9]+/' "$log" 2>/dev/null | tail -1 | grep -oE '[0-9]+/$' | tr -d /; }
past_step() { local s; s=$(last_step); [ -n "$s" ] && [ "$s" -ge "$1" ]; }

slurm_up "$work/slurm" 2 || { bad "cluster did not start"; exit 1; }
run=$work/run
mkdir -p "$run"
export MNIST_MPI=$bin MNIST_MPI_ROOT=$root
train=(--config "$root/configs/tiny.ini" --data-dir "$root/data/mnist" --train-limit 6000 --validation-size 500
       --batch-size 50 --max-steps 120 --log-every 5 --checkpoint-every 10
       # lenet's layers: a step of ~50 ms keeps the run long enough for two signals to land mid-run
       # (tiny's 120 steps take under a second with the blocked kernels)
       --model conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10)

# The job that is preempted twice; sbatch --wait returns when the job has really ended.
timeout 200 sbatch --wait --parsable -D "$run" -J slurm-rq -n 2 "$root/launch/slurm/cpu.sbatch" "${train[@]}" \
  --metrics-file "$run/m.jsonl" >"$work/sbatch.out" 2>&1 &
waiter=$!
wait_for 20 grep -qE '^[0-9]+' "$work/sbatch.out" || { bad "sbatch printed no job id: $(cat "$work/sbatch.out")"; exit 1; }
id=$(grep -oE '^[0-9]+' "$work/sbatch.out")
log=$run/slurm-rq-$id.out

preempt() {  # preempt N HOW AFTER_STEP: signal the job once it is past AFTER_STEP; it must requeue
  local n=$1 how=$2 after=$3 stopped
  if ! wait_for 60 past_step "$after"; then bad "preemption $n: the job never got past step $after (state $(state))"; return 1; fi
  if [ "$how" = batch ]; then scancel --batch --signal=USR1 "$id"; else scancel --signal=USR1 "$id"; fi
  if ! wait_for 40 is_pending; then bad "preemption $n ($how): job $id was not requeued (state $(state))"; return 1; fi
  stopped=$(last_step)
  ok "preemption $n (scancel ${how/direct/--signal=USR1}): job $id stopped after step $stopped and was requeued"
  # Slurm holds a requeued job for ~120 s (EligibleTime); let it start now, but 3 s after the requeue, not within the
  # second of the requeue: slurmd revokes the old run's credential with a timestamp in whole
  # seconds and kills a batch job whose credential is not newer ("Killing non-startable batch
  # JobId=1: Job credential revoked" in CI, where the job was allocated 0.6 s after the requeue).
  sleep 3
  scontrol update JobId="$id" StartTime=now || bad "scontrol update StartTime=now failed"
  if ! wait_for 60 log_has "^cpu.sbatch: job $id 'slurm-rq' \(requeued $n time\(s\)\)"; then bad "preemption $n: the job did not start again"; return 1; fi
  ok "preemption $n: job $id started again (requeued $n time(s))"
}
preempt 1 batch 20 && preempt 2 direct 60
wait "$waiter"
rc=$?
if [ "$rc" -eq 0 ]; then ok "sbatch --wait: the job ended with exit 0"; else bad "sbatch --wait: exit $rc"; fi

expect_n "the batch shell forwarded SIGUSR1 once" "$log" "^cpu.sbatch: .* got SIGUSR1: asking the ranks to write a checkpoint" 1
expect_n "the ranks stopped with exit 75 twice and the script requeued" "$log" "^cpu.sbatch: the ranks wrote a checkpoint and stopped \(exit 75\).*requeueing job $id; it resumes from checkpoints/slurm-rq$" 2
expect_n "three runs of the job" "$log" "^cpu.sbatch: job $id 'slurm-rq' \(requeued [0-2] time\(s\)\)" 3
expect_n "each run resumes with --resume auto from checkpoints/slurm-rq" "$log" "running: srun .* --resume auto --checkpoint-dir checkpoints/slurm-rq " 3
expect_n "two runs resumed from a checkpoint" "$log" "^resuming from .*slurm-rq.*: step [1-9][0-9]*" 2
if grep -qE '"event":"final".*"steps":120,.*"slurm_job_id":"'"$id"'","slurm_job_name":"slurm-rq","slurm_restart_count":2' "$run/m.jsonl"; then
  ok "final metrics: 120 steps, job $id, requeued twice"
else bad "final metrics event lacks 120 steps / restart count 2"; cat "$run/m.jsonl"; fi

# The same training uninterrupted: the model must be bitwise the same.
timeout 120 sbatch --wait --parsable -D "$run" -J slurm-straight -n 2 "$root/launch/slurm/cpu.sbatch" "${train[@]}" \
  --metrics-file "$run/straight.jsonl" >/dev/null 2>&1 || bad "the uninterrupted job failed"
h1=$(grep -oE '"params_hash":"[0-9a-f]+"' "$run/m.jsonl" | tail -1)
h2=$(grep -oE '"params_hash":"[0-9a-f]+"' "$run/straight.jsonl" | tail -1)
if [ -n "$h1" ] && [ "$h1" = "$h2" ]; then ok "preempted twice and resumed = uninterrupted, bitwise ($h1)"
else bad "resumed model differs from the uninterrupted one: '$h1' vs '$h2'"; fi
