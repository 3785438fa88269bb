# shellcheck shell=bash
# Shared by the job scripts in launch/slurm/ (sourced, not run): checks the job and its arguments,
# picks the launcher (srun --mpi=pmix, or mpirun inside the allocation), adds --checkpoint-dir
# (one per job name) and --resume auto, runs the ranks as one step, forwards a preemption signal
# to them, and requeues the job when they stopped for preemption (exit 75 after a checkpoint).
# See docs/launching.md. Every message starts with the script's name.

mm_say() { echo "${MM_SCRIPT:-mnist_mpi job}: $*" >&2; }
mm_die() {  # mm_die CODE MESSAGE: one line naming the problem and the fix, then exit CODE
  local code=$1
  shift
  mm_say "error: $*"
  exit "$code"
}

# Was --NAME given among the program's arguments (as --NAME V or --NAME=V)? Prints its value.
mm_arg() {
  local name=$1 prev=""
  shift
  for a in "$@"; do
    if [ "$prev" = "--$name" ]; then echo "$a"; return 0; fi
    case $a in --"$name"=*) echo "${a#--"$name"=}"; return 0 ;; esac
    prev=$a
  done
  [ "$prev" = "--$name" ] && { echo ""; return 0; }
  return 1
}

# Note [Which launcher inside the allocation]
# Measured on Debian 12 (Open MPI 4.1.4, slurm-wlm 22.05.8, PMIx 4.2.2): 'srun --mpi=pmix' starts
# the ranks and MPI joins them; 'srun --mpi=pmi2' (and --mpi=none) fail inside MPI_Init ("OMPI was
# not built with SLURM's PMI support": Debian's Open MPI has only PMIx); mpirun inside the
# allocation works too (it reads the allocation; on other nodes it starts its daemons with srun).
# srun is preferred: every rank is a task Slurm knows, binds and signals (scancel --signal reaches
# the ranks directly, with the right SLURM_LOCALID), with no daemon in between. mpirun is the
# fallback where Slurm has no pmix plugin, and MNIST_MPI_LAUNCHER=srun|mpirun forces one. Both run
# across nodes with network stacks and hostnames of their own (tests/slurm/nodes.sh); srun's PMIx
# plugin needs each node's TmpFS to be its own (its per-step directory is made there).
mm_pick_launcher() {
  MM_LAUNCHER=${MNIST_MPI_LAUNCHER:-auto}
  # Whole outputs are captured before matching: under pipefail, 'cmd | grep -q' fails when grep
  # stops reading early and cmd dies of SIGPIPE.
  local plugins
  plugins=$(srun --mpi=list 2>&1)
  if [ "$MM_LAUNCHER" = auto ]; then
    if grep -qw pmix <<<"$plugins"; then MM_LAUNCHER=srun; else MM_LAUNCHER=mpirun; fi
  fi
  case $MM_LAUNCHER in
    srun) grep -qw pmix <<<"$plugins" ||
            mm_die 2 "MNIST_MPI_LAUNCHER=srun but this Slurm has no pmix MPI plugin ('srun --mpi=list'); unset MNIST_MPI_LAUNCHER to use mpirun" ;;
    mpirun) command -v mpirun >/dev/null ||
              mm_die 2 "no mpirun on $(hostname) and no pmix plugin in Slurm: install Open MPI (openmpi-bin) on the nodes" ;;
    *) mm_die 2 "MNIST_MPI_LAUNCHER must be srun, mpirun or auto, not '$MM_LAUNCHER'" ;;
  esac
}

# How many GPUs this node shows the job: Slurm's CUDA_VISIBLE_DEVICES when it allocated GPUs,
# else nvidia-smi's list.
mm_visible_gpus() {
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # set, even empty: CUDA sees only these
    case $CUDA_VISIBLE_DEVICES in NoDevFiles | -1) echo 0 ;; *) echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c . || true ;; esac
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  else
    echo 0
  fi
}

# The ranks as one step, in the background; USR1 or TERM to the batch shell is passed on as USR1
# (Note [Why the batch shell takes the signal]). Sets MM_RC to the step's exit code.
mm_run_step() {
  MM_SIGNALLED=""
  "$@" &
  MM_STEP_PID=$!
  trap 'mm_forward USR1' USR1
  trap 'mm_forward TERM' TERM
  while :; do
    wait "$MM_STEP_PID"
    MM_RC=$?
    kill -0 "$MM_STEP_PID" 2>/dev/null || break  # a trapped signal interrupted wait: wait again
  done
  trap - USR1 TERM
}
mm_forward() {
  MM_SIGNALLED=$1
  mm_say "$(date -u +%FT%TZ) got SIG$1: asking the ranks to write a checkpoint and stop (SIGUSR1 to the step)"
  kill -USR1 "$MM_STEP_PID" 2>/dev/null
}

# Note [Why the batch shell takes the signal]
# The scripts ask for --signal=B:USR1@120: 120 s before the time limit Slurm signals the batch
# shell, not the steps. The shell then knows the job is ending and passes SIGUSR1 to its one step
# (srun and mpirun both forward SIGUSR1 to every rank), so it works the same with either launcher;
# without B: the signal goes to the steps only, which mpirun on a single node does not have (its
# ranks are children of the batch shell) and the signal would be lost. 'scancel --signal=USR1 JOB'
# reaches srun's ranks directly; 'scancel --batch --signal=USR1 JOB' goes through the shell. Either
# way the ranks checkpoint, exit 75, and the script requeues the job.

# mm_job KIND ARGS...: the whole job. KIND: cpu or gpu.
mm_job() {
  local kind=$1
  shift
  local args=("$@")
  [ -n "${SLURM_JOB_ID-}" ] ||
    mm_die 2 "not inside a Slurm job (SLURM_JOB_ID is unset): submit it with 'sbatch $MM_SCRIPT_PATH [options]', or run on this machine with launch/local.sh"
  local prog=${MNIST_MPI:-$MM_ROOT/build/mnist_mpi}
  [ -x "$prog" ] || mm_die 2 "no program at $prog: build it (scripts/setup.sh) or set MNIST_MPI=/path/to/mnist_mpi"
  local tasks=${SLURM_NTASKS:-1} cpt=${SLURM_CPUS_PER_TASK:-1} nodes=${SLURM_JOB_NUM_NODES:-1}

  # Every task needs at least one image of the global batch (the program splits it as evenly as
  # it goes: Note [Uneven slices]); say so before any rank starts.
  local gb
  if gb=$(mm_arg global-batch-size "${args[@]}") && [ -n "$gb" ] && [ "$gb" != 0 ]; then
    case $gb in *[!0-9]*) ;; *)
      if [ "$gb" -lt "$tasks" ]; then
        mm_die 2 "--global-batch-size $gb is smaller than this job's $tasks task(s): every rank needs at least one image; submit with --ntasks=$gb or fewer, or give a larger --global-batch-size"
      fi ;;
    esac
  fi

  if [ "$kind" = gpu ]; then
    local gpus per_node=$(( (tasks + nodes - 1) / nodes ))
    gpus=$(mm_visible_gpus)
    [ "$gpus" -gt 0 ] ||
      mm_die 6 "no GPU visible on $(hostname) (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-unset}', nvidia-smi lists none): submit to a partition with GPUs (sbatch -p PARTITION --gres=gpu:N), or use launch/slurm/cpu.sbatch"
    [ "$gpus" -ge "$per_node" ] ||
      mm_die 6 "$(hostname) shows $gpus GPU(s) but the job runs $per_node task(s) per node, one per GPU: submit with --ntasks-per-node=$gpus (or --gres=gpu:$per_node)"
    mm_arg device "${args[@]}" >/dev/null || args=(--device cuda "${args[@]}")
  fi

  # One checkpoint directory per job name, so that a requeued job (same id) and a resubmitted one
  # (same name) both resume where the last one stopped.
  # Relative to the job's working directory (sbatch -D, else where sbatch ran).
  local ckpt=${MNIST_MPI_CHECKPOINT_ROOT:-$PWD/checkpoints}/${SLURM_JOB_NAME}
  mkdir -p "$ckpt" || mm_die 4 "cannot create the checkpoint directory $ckpt: set MNIST_MPI_CHECKPOINT_ROOT to a writable shared directory"
  mm_arg checkpoint-dir "${args[@]}" >/dev/null || args=(--checkpoint-dir "$ckpt" "${args[@]}")
  mm_arg resume "${args[@]}" >/dev/null || args=(--resume auto "${args[@]}")
  mm_arg threads "${args[@]}" >/dev/null || args=(--threads "$cpt" "${args[@]}")
  export OMP_NUM_THREADS=$cpt OMP_PLACES=cores OMP_PROC_BIND=close

  mm_pick_launcher
  local cmd
  if [ "$MM_LAUNCHER" = srun ]; then
    # --cpus-per-task must be given again: srun does not inherit it from sbatch since Slurm 22.05.
    cmd=(srun --mpi=pmix --kill-on-bad-exit=0 --cpus-per-task="$cpt" --cpu-bind=cores "$prog" "${args[@]}")
  else
    cmd=(mpirun --bind-to core --map-by "slot:PE=$cpt" -x OMP_NUM_THREADS -x OMP_PLACES -x OMP_PROC_BIND)
    [ "$(id -u)" -eq 0 ] && cmd+=(--allow-run-as-root)
    # A node whose link is cut: its daemon is silent, and Open MPI notices through TCP keepalive,
    # by default after 8 minutes; in about 11 s here (Note [A lost node ends the job] in
    # launch/local.sh), unless the environment says otherwise. srun's tasks have no daemon: Slurm
    # ends a step whose node stops answering after its SlurmdTimeout.
    [ -n "${OMPI_MCA_oob_tcp_keepalive_time:-}" ] ||
      cmd+=(--mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3)
    cmd+=("$prog" "${args[@]}")
  fi
  mm_say "job $SLURM_JOB_ID '$SLURM_JOB_NAME' (requeued ${SLURM_RESTART_COUNT:-0} time(s)) on ${SLURM_JOB_NODELIST-?}: $tasks task(s) x $cpt CPU(s)${ckpt:+, checkpoints in ${ckpt#"$PWD"/}}"
  mm_say "running: ${cmd[*]//"$PWD"\//}"
  mm_run_step "${cmd[@]}"

  case $MM_RC in
    0) mm_say "finished"; exit 0 ;;
    75)
      local from=${ckpt#"$PWD"/}
      from=${from:-step 0}
      mm_say "the ranks wrote a checkpoint and stopped (exit 75)${MM_SIGNALLED:+ after SIG$MM_SIGNALLED}: requeueing job $SLURM_JOB_ID; it resumes from $from"
      if scontrol requeue "$SLURM_JOB_ID"; then
        # Slurm ends this shell as it requeues the job. Short sleeps: a long one outlives the
        # killed shell where Slurm tracks processes by ancestry (proctrack/linuxproc, measured).
        for _ in $(seq 60); do sleep 1; done
        exit 75
      fi
      mm_die 75 "could not requeue job $SLURM_JOB_ID (was it submitted with --no-requeue?): submit the same script again with --job-name=$SLURM_JOB_NAME, it resumes from $from" ;;
    *) mm_die "$MM_RC" "mnist_mpi ended with exit code $MM_RC (its message is above; codes in docs/faults.md): not requeued" ;;
  esac
}
