#!/usr/bin/env bash
# Starts mnist_mpi on this machine with mpirun. CPU ranks: each bound to its own cores and running
# as many OpenMP threads (--threads); GPU ranks (--device cuda among the arguments): one per GPU,
# each with an equal share of the cores. Root flags only for root, --oversubscribe only when the
# ranks need more cores than there are. Everything after the launcher's options goes to mnist_mpi.
# Usage: launch/local.sh [-n RANKS] [-t THREADS_PER_RANK] [--dry-run] [--] [mnist_mpi options]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { echo "local.sh: $*" >&2; }
die() {  # die CODE MESSAGE
  local code=$1
  shift
  say "error: $*"
  exit "$code"
}
usage() { sed -n '2,6s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

ranks="" threads="" dry=0
while [ $# -gt 0 ]; do
  case $1 in
    -n | --ranks) [ $# -ge 2 ] || die 2 "$1 needs a number"; ranks=$2; shift 2 ;;
    -t | --threads-per-rank) [ $# -ge 2 ] || die 2 "$1 needs a number"; threads=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h | --help) usage; echo; echo "mnist_mpi's own options: build/mnist_mpi --help"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
args=("$@")
for v in "$ranks" "$threads"; do
  case $v in "" | [1-9] | [1-9][0-9] | [1-9][0-9][0-9]) ;; *) die 2 "-n and -t take a whole number >= 1, not '$v'" ;; esac
done

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

cmd=(mpirun -np "$ranks")
[ "$(id -u)" -eq 0 ] && cmd+=(--allow-run-as-root)
if [ $((ranks * threads)) -le "$cores" ]; then
  # Each rank gets THREADS cores of its own; OpenMP keeps its threads on them.
  cmd+=(--map-by "slot:PE=$threads" --bind-to core -x "OMP_NUM_THREADS=$threads" -x OMP_PROC_BIND=close -x OMP_PLACES=cores)
else
  say "note: $ranks rank(s) x $threads thread(s) need more than the $cores core(s) here: oversubscribing, unbound (slower)"
  cmd+=(--oversubscribe --bind-to none -x "OMP_NUM_THREADS=$threads")
fi
arg_given threads >/dev/null || args=(--threads "$threads" "${args[@]}")
cmd+=("$prog" "${args[@]}")
shown=("${cmd[@]}")
shown[${#cmd[@]} - ${#args[@]} - 1]=${prog#"$PWD"/}  # the program as a path from here, when it is below
say "$ranks rank(s) x $threads thread(s) on $cores core(s)${device:+, device $device}: ${shown[*]}"
[ "$dry" -eq 1 ] && exit 0
exec "${cmd[@]}"
