#!/usr/bin/env bash
# Starts mnist_mpi with mpirun, on this machine or on the hosts given. CPU ranks: each bound to its
# own cores and running as many OpenMP threads (--threads); GPU ranks (--device cuda among the
# arguments): one per GPU, each with an equal share of the cores. Root flags only for root,
# --oversubscribe only when the ranks need more cores than there are. A lost node ends the job:
# Open MPI is told to notice a silent daemon in about 11 s (TCP keepalive), and mpirun is stopped
# if it has not returned --grace seconds after the ranks on this machine ended (Note [A lost node
# ends the job]). Everything after the launcher's options goes to mnist_mpi.
# With --max-restarts N a job that loses a rank or a node starts again from its checkpoints on the
# hosts that still answer (Note [Restarts on the nodes that are left]).
# Usage: launch/local.sh [-n RANKS] [-t THREADS_PER_RANK] [--hosts H[:SLOTS],...] [--grace S]
#                        [--max-restarts N] [--min-ranks M] [--dry-run] [--] [mnist_mpi options]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { echo "local.sh: $*" >&2; }
die() {  # die CODE MESSAGE
  local code=$1
  shift
  say "error: $*"
  exit "$code"
}
usage() { sed -n '2,/^# *\[--max-restarts/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

ranks="" threads="" dry=0 hosts="" grace=20 max_restarts=0 min_ranks=1
while [ $# -gt 0 ]; do
  case $1 in
    -n | --ranks) [ $# -ge 2 ] || die 2 "$1 needs a number"; ranks=$2; shift 2 ;;
    -t | --threads-per-rank) [ $# -ge 2 ] || die 2 "$1 needs a number"; threads=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --hosts) [ $# -ge 2 ] || die 2 "$1 needs a list: node1:2,node2:2"; hosts=$2; shift 2 ;;
    --grace) [ $# -ge 2 ] || die 2 "$1 needs a number of seconds"; grace=$2; shift 2 ;;
    --max-restarts) [ $# -ge 2 ] || die 2 "$1 needs a number"; max_restarts=$2; shift 2 ;;
    --min-ranks) [ $# -ge 2 ] || die 2 "$1 needs a number"; min_ranks=$2; shift 2 ;;
    -h | --help) usage; echo; echo "mnist_mpi's own options: build/mnist_mpi --help"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
args=("$@")
for v in "$ranks" "$threads"; do
  case $v in "" | [1-9] | [1-9][0-9] | [1-9][0-9][0-9]) ;; *) die 2 "-n and -t take a whole number >= 1, not '$v'" ;; esac
done
case $grace in [1-9] | [1-9][0-9] | [1-9][0-9][0-9]) ;; *) die 2 "--grace takes a whole number of seconds from 1 to 999, not '$grace'" ;; esac
case $max_restarts in [0-9] | [1-9][0-9]) ;; *) die 2 "--max-restarts takes a whole number from 0 to 99, not '$max_restarts'" ;; esac
case $min_ranks in [1-9] | [1-9][0-9] | [1-9][0-9][0-9]) ;; *) die 2 "--min-ranks takes a whole number >= 1, not '$min_ranks'" ;; esac
slots=0  # --hosts: the ranks it holds (a host without :SLOTS holds 1)
if [ -n "$hosts" ]; then
  IFS=, read -r -a host_list <<<"$hosts"
  for h in "${host_list[@]}"; do
    [[ $h =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[1-9][0-9]{0,2})?$ ]] ||
      die 2 "--hosts takes HOST[:SLOTS] separated by commas (node1:2,node2:2), not '$h'"
    [[ $h == *:* ]] && slots=$((slots + ${h##*:})) || slots=$((slots + 1))
  done
  ranks=${ranks:-$slots}
  [ "$ranks" -le "$slots" ] || die 2 "-n $ranks but --hosts $hosts holds $slots rank(s)"
fi
ranks_asked=$ranks

prog=${MNIST_MPI:-$root/build/mnist_mpi}
[ -x "$prog" ] || die 2 "no program at $prog: build it (scripts/setup.sh) or set MNIST_MPI=/path/to/mnist_mpi"
command -v mpirun >/dev/null || die 2 "no mpirun on this machine: install Open MPI (scripts/setup.sh installs openmpi-bin)"

# Physical cores this process may run on (its affinity mask mapped to cores), else nproc.
cores=$(lscpu -p=CPU,CORE,SOCKET 2>/dev/null | awk -F, -v allowed="$(taskset -cp $$ 2>/dev/null | sed 's/.*: //')" '
  BEGIN { n = split(allowed, parts, ","); for (i = 1; i <= n; i++) {
            if (split(parts[i], r, "-") == 2) { for (c = r[1]; c <= r[2]; c++) ok[c] = 1 } else ok[parts[i]] = 1 } }
  /^#/ { next }
  (allowed == "" || ($1 in ok)) && !(($2 "," $3) in seen) { seen[$2 "," $3] = 1; count++ }
  END { print count + 0 }')
[ "${cores:-0}" -gt 0 ] || cores=$(nproc)

arg_given() {  # was --NAME among mnist_mpi's arguments? prints its value
  local prev=""
  for a in "${args[@]}"; do
    [ "$prev" = "--$1" ] && { echo "$a"; return 0; }
    case $a in --"$1"=*) echo "${a#--"$1"=}"; return 0 ;; esac
    prev=$a
  done
  return 1
}
device=$(arg_given device || true)

if [ "$device" = cuda ]; then
  gpus=0
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # set, even empty: CUDA sees only these
    gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c '^[0-9A-Za-z]' || true)
  elif command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  [ "$gpus" -gt 0 ] || die 6 "--device cuda but this machine shows no GPU (nvidia-smi lists none, CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-unset}'): run CPU ranks without --device cuda"
  ranks=${ranks:-$gpus}
  [ "$ranks" -le "$gpus" ] || die 6 "$ranks GPU ranks but $gpus GPU(s): one rank per GPU, use -n $gpus or fewer"
  threads=${threads:-$(( cores / ranks > 0 ? cores / ranks : 1 ))}
elif [ -z "$ranks" ]; then
  threads=${threads:-1}
  ranks=$(( cores / threads > 0 ? cores / threads : 1 ))
else
  threads=${threads:-$(( cores / ranks > 0 ? cores / ranks : 1 ))}
fi

arg_given threads >/dev/null || args=(--threads "$threads" "${args[@]}")
if [ "$max_restarts" -gt 0 ]; then
  arg_given checkpoint-dir >/dev/null ||
    die 2 "--max-restarts needs --checkpoint-dir DIR among mnist_mpi's options: a restart resumes from its checkpoints"
  ! arg_given batch-size >/dev/null ||
    die 2 "--max-restarts with --batch-size: a per-rank batch changes the global batch when ranks are lost; give --global-batch-size"
fi

make_cmd() {  # cmd: mpirun for $ranks ranks on $live_hosts (or this machine), then the program
  cmd=(mpirun -np "$ranks")
  [ -n "$live_hosts" ] && cmd+=(--host "$live_hosts")
  [ "$(id -u)" -eq 0 ] && cmd+=(--allow-run-as-root)
  # Note [A lost node ends the job]: a daemon whose link is cut is silent, and Open MPI notices only
  # through TCP keepalive, by default after 300 s + 9 x 20 s. 5 s + 3 x 2 s here, where the user's
  # environment does not say otherwise (OMPI_MCA_oob_tcp_keepalive_time).
  [ -n "${OMPI_MCA_oob_tcp_keepalive_time:-}" ] ||
    cmd+=(--mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3)
  if [ $((ranks * threads)) -le "$cores" ]; then
    # Each rank gets THREADS cores of its own; OpenMP keeps its threads on them.
    cmd+=(--map-by "slot:PE=$threads" --bind-to core -x "OMP_NUM_THREADS=$threads" -x OMP_PROC_BIND=close -x OMP_PLACES=cores)
  else
    say "note: $ranks rank(s) x $threads thread(s) need more than the $cores core(s) here: oversubscribing, unbound (slower)"
    cmd+=(--oversubscribe --bind-to none -x "OMP_NUM_THREADS=$threads")
  fi
  cmd+=("$prog" "${args[@]}")
  local shown=("${cmd[@]}")
  shown[${#cmd[@]} - ${#args[@]} - 1]=${prog#"$PWD"/}  # the program as a path from here, when it is below
  say "$ranks rank(s) x $threads thread(s) on $cores core(s)${device:+, device $device}: ${shown[*]}"
}
live_hosts=$hosts
make_cmd
[ "$dry" -eq 1 ] && exit 0

# Note [A lost node ends the job]
# A rank that stops or loses its link is caught by the ranks that still run: their collective
# watchdog (--collective-timeout) ends the job with MPI_Abort, and mpirun kills the ranks through
# their nodes' daemons. A node that cannot be reached cannot be told, and mpirun then never returns
# ("abort is already in progress"; Open MPI 4.1), holding the job's nodes. So mpirun runs in the
# background here: once the program's ranks on this machine have all ended, it gets --grace
# seconds to return, and is then stopped, with exit code 1 (the watchdog's) and the hosts of
# --hosts that do not answer a TCP connection named. When the keepalive notices the lost daemon first, Open MPI ends the job
# itself ("ORTE has lost communication with a remote daemon", or, as it also says of a daemon
# lost, "ORTE was unable to reliably start one or more daemons"), exit 205 or 1, and this script
# names the hosts that do not answer. A
# daemon on the cut-off node that has something to tell mpirun waits on TCP's own retries
# (Linux: tcp_retries2, about 15 minutes) before it goes; its rank has already ended by its own
# watchdog. Signals to this script go on to mpirun (SIGTERM: checkpoint and exit 75).
unanswered() {  # the hosts of --hosts that do not answer a TCP connection (to port 9) in 2 s, in parallel
  local h dir
  dir=$(mktemp -d)
  for h in ${host_list[@]+"${host_list[@]}"}; do
    h=${h%%:*}
    (timeout 2 bash -c "exec 3<>/dev/tcp/$h/9" 2>/dev/null; [ $? -eq 124 ] && echo "$h" >"$dir/$h") &  # refused: it answered
  done
  wait
  for h in ${host_list[@]+"${host_list[@]}"}; do [ -f "$dir/${h%%:*}" ] && printf ' %s' "${h%%:*}"; done
  rm -rf "$dir"
}
prog_name=$(basename "$prog" | cut -c1-15)
run_job() {  # runs cmd under watch; rc: its exit code
  "${cmd[@]}" &
  mpirun_pid=$!
  local sig seen=0 ended_at="" n lost
  for sig in TERM INT USR1 HUP; do trap "kill -$sig $mpirun_pid 2>/dev/null" "$sig"; done
  while running; do
    n=$(ranks_here)
    if [ "$n" -gt 0 ]; then
      seen=1 ended_at=""
    elif [ "$seen" = 1 ]; then
      ended_at=${ended_at:-$SECONDS}
      if [ $((SECONDS - ended_at)) -ge "$grace" ]; then
        lost=$(unanswered)
        say "error: mpirun has not returned $grace s after the ranks on this machine ended: a node cannot be reached${lost:+ (no answer from:$lost)}, so its daemon cannot be told to stop; stopping mpirun (exit 1). Ranks on a cut-off node end by their own collective watchdog"
        kill -TERM "$mpirun_pid" 2>/dev/null || true
        sleep 2
        kill -KILL "$mpirun_pid" 2>/dev/null || true
        wait "$mpirun_pid" 2>/dev/null || true
        rc=1
        return
      fi
    fi
    sleep 1
  done
  rc=0
  wait "$mpirun_pid" || rc=$?
  if [ "$rc" -ne 0 ] && [ -n "$hosts" ]; then  # Open MPI ended the job: say which host is lost, if one is
    lost=$(unanswered)
    [ -z "$lost" ] || say "error: mpirun ended with exit $rc; no answer from:$lost (a node lost: its link, or the node itself)"
  fi
}
ranks_here() {  # the program's processes below mpirun on this machine, but stopped (frozen) ones
  ps -e -o pid=,ppid=,stat=,comm= | awk -v root="$mpirun_pid" -v name="$prog_name" '
    { parent[$1] = $2; stat[$1] = $3; comm[$1] = $4 }
    END { n = 0; for (p in parent) { if (comm[p] != name || stat[p] ~ /^[TtZ]/) continue
            for (q = parent[p]; q != "" && q > 1; q = parent[q]) if (q == root) { n++; break } }
          print n }'
}
running() {  # mpirun alive, not a zombie waiting to be reaped
  local st
  st=$(ps -o stat= -p "$mpirun_pid" 2>/dev/null) || return 1
  [[ $st != Z* ]]
}

# Note [Restarts on the nodes that are left]
# With --max-restarts N, a job that ends with a rank or a node gone (exit 1: the watchdog, a rank's
# error, mpirun stopped above; 205: Open MPI lost a daemon; a rank or a daemon killed: the
# signal's number or 128 + it) starts again with --resume auto from its checkpoints, on the hosts
# of --hosts that answer a TCP connection then (one dropped before that answers again is taken
# back: the probe is made afresh each time), as many ranks as their slots (at most -n). The global
# batch is the options' (a per-rank --batch-size is refused with --max-restarts), so the
# trajectory is the one that lost nothing, and with --exact-sums the bits are too (a checkpoint
# resumes on any number of ranks). The exits a restart cannot mend (0; a usage, data or checkpoint
# error; a non-finite step; no GPU; an output; preemption's 75) end the script with them; so do
# fewer ranks than --min-ranks, and N restarts spent, each with a line. A frozen rank (stopped)
# counts as ended for --grace.
restarts=0
while :; do
  run_job
  case $rc in
    0 | 2 | 3 | 4 | 5 | 6 | 7 | 75) exit "$rc" ;;  # done, or what a restart cannot mend (docs/faults.md)
  esac
  [ "$max_restarts" -gt 0 ] || exit "$rc"
  [ "$restarts" -lt "$max_restarts" ] ||
    die "$rc" "the job ended with exit $rc and its $max_restarts restart(s) are spent (--max-restarts); not restarting"
  restarts=$((restarts + 1))
  lost=$(unanswered)
  live_hosts="" slots=0
  for h in ${host_list[@]+"${host_list[@]}"}; do
    [[ " $lost " == *" ${h%%:*} "* ]] && continue
    live_hosts+=${live_hosts:+,}$h
    [[ $h == *:* ]] && slots=$((slots + ${h##*:})) || slots=$((slots + 1))
  done
  if [ -n "$hosts" ]; then
    ranks=$(( slots < ranks_asked ? slots : ranks_asked ))
  fi
  [ "$ranks" -ge "$min_ranks" ] ||
    die "$rc" "the job ended with exit $rc; the hosts that answer hold $ranks rank(s), fewer than --min-ranks $min_ranks (no answer from:${lost:- none}); not restarting"
  arg_given resume >/dev/null || args+=(--resume auto)
  say "restart $restarts of $max_restarts: the job ended with exit $rc; no answer from:${lost:- none}; starting $ranks rank(s)${live_hosts:+ on $live_hosts} with --resume auto"
  make_cmd
done
