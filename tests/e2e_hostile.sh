#!/usr/bin/env bash
# Hostile cases, end to end on 2 ranks: an error right after a thread has started
# (Note [Threads are joined on every path]), a refused resume while the checkpoint writer runs,
# FIFOs and directories where a checkpoint is expected (Note [Look before you open]), ranks that
# disagree before the first collective (Note [Every rank takes part in the set-up agreement]),
# and two jobs on one checkpoint directory (Note [One job per checkpoint directory]). Each case
# checks the exit code, the time the job took to end, the message, and that no rank was left.
# Usage: e2e_hostile.sh MNIST_MPI MAKE_SYNTHETIC_MNIST
set -uo pipefail
bin=$(realpath "$1") make_data=$(realpath "$2") here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'kill -KILL $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
"$make_data" "$work/data" 600 100 >/dev/null || { echo "cannot write synthetic data"; exit 1; }
cd "$work" || exit 1
small="conv:3x3:4:same,relu,maxpool:2,flatten,fc:10"
opts=(--validation-size 100 --threads 1 --batch-size 10 --log-every 0 --model "$small")
base=(--data-dir "$work/data" "${opts[@]}")
passed=0 failed=0
source "$here/e2e_lib.sh"  # expect()
run2=(mpirun -np 2 --oversubscribe "$bin")
job=("${run2[@]}" "${base[@]}")

# A checkpoint of sgd at step 10 to refuse.
"${job[@]}" --optimizer sgd --max-steps 10 --checkpoint-dir ck >/dev/null 2>&1 || echo "FAIL could not write ck"

# 1. An error after a thread has started: one line, the same exit code on every rank, in seconds.
#    (Before: the writer thread was still waiting when the Checkpointer's constructor threw; the
#    rank hung in pthread_cond_destroy or died with "terminate called without an active exception".)
expect refused_resume_other_optimizer 4 30 "error on rank 0 .*holds sgd state, this run's --optimizer is adam" -- \
  "${job[@]}" --optimizer adam --max-steps 20 --checkpoint-dir ck --resume auto
expect refused_resume_past_max_steps 4 30 "is at step 10, past the end of this run \(5 steps\)" -- \
  "${job[@]}" --optimizer sgd --max-steps 5 --checkpoint-dir ck --resume auto
for t in 0:checkpoint-writer 1:communication 1:watchdog; do
  expect "throw_after_start_${t#*:}" 1 30 "error on rank ${t%%:*} .*fails right after starting its ${t#*:} thread" -- \
    env MNIST_MPI_FAULT="${t%%:*}:thread:${t#*:}" "${job[@]}" --optimizer sgd --max-steps 20 --checkpoint-dir ck_t
done

# 2. Not a regular file where a checkpoint is expected: said as what it is, and never waited on.
mkfifo ck/step-00000011.ckpt  # named like the newest checkpoint
expect fifo_as_newest_checkpoint 0 30 "step-00000011.ckpt' is a FIFO \(named pipe\), not a regular file.*skips it" -- \
  "${job[@]}" --optimizer sgd --max-steps 12 --checkpoint-dir ck --resume auto
grep -q "resuming from ck/step-00000010.ckpt: step 10" "$work/out" ||
  { echo "FAIL fifo_as_newest_checkpoint did not resume from step 10"; failed=$((failed + 1)); }
rm -f ck/step-00000011.ckpt ck/step-00000012.ckpt
mkfifo pipe.ckpt; mkdir dir.ckpt; ln -s /dev/zero zero.ckpt
expect resume_fifo 4 30 "checkpoint 'pipe.ckpt' is a FIFO \(named pipe\), not a regular file" -- "${job[@]}" --max-steps 20 --resume pipe.ckpt
expect resume_directory 4 30 "checkpoint 'dir.ckpt' is a directory, not a regular file" -- "${job[@]}" --max-steps 20 --resume dir.ckpt
expect resume_link_to_dev_zero 4 30 "checkpoint 'zero.ckpt' is a symbolic link to a character device \('/dev/zero'\)" -- \
  "${job[@]}" --max-steps 20 --resume zero.ckpt
expect evaluate_fifo 4 30 "checkpoint 'pipe.ckpt' is a FIFO" -- "$bin" evaluate --checkpoint pipe.ckpt --data-dir "$work/data"

# 3. Ranks that disagree before the first collective: an MPMD launch where one rank is given
#    --version. (Before: the training rank waited in the set-up agreement for --collective-timeout.)
expect mpmd_version_and_run 2 30 "some were given --help or --version, others a run" -- \
  mpirun -np 1 "$bin" --version : -np 1 "$bin" "${base[@]}" --max-steps 20
expect mpmd_run_and_help 2 30 "some were given --help or --version, others a run" -- \
  mpirun -np 1 "$bin" "${base[@]}" --max-steps 20 : -np 1 "$bin" --help

# 4. A --max-steps near 2^63 runs (nothing is reserved in proportion to it; it ended in
#    std::bad_alloc before) and stops cleanly on SIGTERM.
expect huge_max_steps 75 30 "stopped by SIGTERM after step [0-9]+ of 9223372036854775807" -- \
  timeout --preserve-status -s TERM 4 "$bin" "${base[@]}" --max-steps 9223372036854775807

# 6. Two jobs, one checkpoint directory: the second is refused at set-up naming the holder, and
#    the first one's files are untouched; a job that died holds nothing.
ln -s data other  # the first job's command line must not look like a rank left behind to expect()
"${run2[@]}" "${opts[@]}" --data-dir "$work/other" --max-steps 100000 --checkpoint-dir shared --checkpoint-every 50 --collective-timeout 60 >first.out 2>&1 &
first=$!
for _ in $(seq 1 300); do grep -qs pid shared/.mnist_mpi.lock && break; sleep 0.1; done
holder=$(sed -n 's/.*pid \([0-9]*\).*/\1/p' shared/.mnist_mpi.lock)
expect second_job_refused 4 30 "checkpoint directory 'shared' is in use by another job \('host .*, pid $holder" -- \
  "${job[@]}" --max-steps 20 --checkpoint-dir shared --resume auto
kill -0 "$first" 2>/dev/null || { echo "FAIL the first job did not survive the second"; failed=$((failed + 1)); cat first.out; }
[ -n "$holder" ] && kill -KILL "$holder"  # rank 0 dies: the kernel releases its lock
wait "$first" 2>/dev/null
expect lock_released_by_a_dead_job 0 60 "checkpoint after step 20: shared/step-00000020.ckpt" -- \
  "${job[@]}" --max-steps 20 --checkpoint-dir shared

# CONF holds the resolved batch sizes and no host paths: the same training state written from two
# data directories into two checkpoint directories gives byte-identical files (docs/checkpoint.md).
"${run2[@]}" "${opts[@]}" --data-dir "$work/data" --max-steps 3 --checkpoint-dir conf_a >/dev/null 2>&1
"${run2[@]}" "${opts[@]}" --data-dir "$work/other" --max-steps 3 --checkpoint-dir conf_b >/dev/null 2>&1
if cmp -s conf_a/step-00000003.ckpt conf_b/step-00000003.ckpt &&
   "$bin" evaluate --checkpoint conf_a/step-00000003.ckpt --show-config 2>&1 | grep -q "^global-batch-size = 20$" &&
   ! "$bin" evaluate --checkpoint conf_a/step-00000003.ckpt --show-config 2>&1 | grep -qE "^(data-dir|checkpoint-dir) ="; then
  passed=$((passed + 1)); echo "ok   same state from other paths: identical checkpoint files, CONF resolved"
else
  failed=$((failed + 1)); echo "FAIL checkpoints of the same state differ, or CONF is not resolved"
  "$bin" evaluate --checkpoint conf_a/step-00000003.ckpt --show-config 2>&1 | tail -30
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
