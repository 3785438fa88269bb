# shellcheck shell=bash
# A throw-away Slurm cluster on localhost (one node, or several emulated ones) for the slurm-
# labelled tests (sourced): installs Debian's slurm-wlm and munge when missing (or skips the test
# LOUDLY, exit 77, when it cannot), starts munged, slurmctld and slurmd with a private key, socket,
# ports and state under one temp dir, and takes everything down again (slurm_down, run from the
# caller's EXIT trap).
# Processes are tracked by proctrack/linuxproc and bound by task/affinity, which need nothing from
# the host; the cgroup plugins depend on how the host mounts and delegates cgroups (v1 or v2), which
# varies between CI containers (proctrack/cgroup did work in the container this was written in).

SLURM_SKIP=77

slurm_skip() {  # loud on stdout (CTest shows it) and stderr
  local line="=== SKIPPED: $* ==="
  echo "$line"
  echo "$line" >&2
  exit "$SLURM_SKIP"
}

# Installs slurm-wlm and munge when a daemon or client is missing (scripts/setup.sh normally has).
# slurmd runs jobs as their users and must be root: the tests need root.
slurm_install() {
  [ "$(id -u)" -eq 0 ] || slurm_skip "the slurm tests start slurmd, which must run as root: run them as root (CI does)"
  local c missing=0
  for c in slurmctld slurmd sbatch scontrol munged; do command -v "$c" >/dev/null 2>&1 || missing=1; done
  [ "$missing" -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || slurm_skip "Slurm is not installed and there is no apt-get to install slurm-wlm and munge"
  echo "installing slurm-wlm and munge"
  # Two slurm tests may start at once: one installs, the other waits.
  if ! (flock 9; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null 2>&1 &&
          DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge; }) 9>"${TMPDIR:-/tmp}/mnist_mpi_slurm_install.lock"; then
    slurm_skip "installing slurm-wlm and munge failed (see apt-get's message above; no package mirror reachable?)"
  fi
  for c in slurmctld slurmd sbatch munged; do
    command -v "$c" >/dev/null 2>&1 || slurm_skip "slurm-wlm was installed but $c is still missing"
  done
}

# A port nothing listens on, below the kernel's ephemeral range: there a port can't be the local
# end of some other process's connection, which the connect test does not see (it finds listeners
# only) and which once made a slurmd's bind fail (Address already in use) with every test of the
# suite running beside it.
slurm_free_port() {
  local p _ low=32768
  read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || low=32768
  local first=20000 span=$((low - 20000))
  if ((span < 2000)); then first=$((low > 12000 ? low - 10000 : 1024)) span=2000; fi  # an unusual range
  for _ in $(seq 100); do
    p=$((first + RANDOM % span))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return 0; }
  done
  return 1
}

# Where the daemons and the clients run: here, unless slurm_up was asked for nodes of their own
# (then node I of tests/netns_lib.sh, and the clients on node 1, where the controller is).
slurm_on() {  # slurm_on NODE_INDEX CMD...
  local i=$1
  shift
  if [ "${SLURM_NETNS:-0}" = 1 ]; then node_run "$i" "$@"; else "$@"; fi
}
slurm_client() { slurm_on 1 "$@"; }

# slurm_up DIR CPUS [NODES [netns]]: a cluster whose files are all under DIR; exports SLURM_CONF
# for the caller. One node: this host's name, CPUS CPUs. NODES > 1: nodes n1..nN of CPUS CPUs each,
# all on this host, one slurmd each on its own port (jobs across them work with mpirun; srun
# --mpi=pmix cannot, as its per-step PMIx directory is the same path for every node of one host).
# 'netns': the nodes of tests/netns_lib.sh's nodes_make (sourced and called by the caller), node1..N
# at 10.77.0.I with hostnames of their own, the controller on node1, each slurmd on its node; each
# node's TmpFS (where srun --mpi=pmix puts its per-step PMIx directory) is its own, DIR/tmp/nodeI.
slurm_up() {
  SLURM_DIR=$1
  local cpus=$2 nodes=${3:-1} mode=${4:-} node ctld_port port i names=() lines="" ctld tmpfs=/tmp
  SLURM_NETNS=0 SLURM_IS_DOWN=0
  [ "$mode" = netns ] && SLURM_NETNS=1
  mkdir -p "$SLURM_DIR"/{state,spool,log}
  dd if=/dev/urandom of="$SLURM_DIR/munge.key" bs=1024 count=1 status=none
  chmod 400 "$SLURM_DIR/munge.key"
  munged --force --socket="$SLURM_DIR/munge.sock" --key-file="$SLURM_DIR/munge.key" \
    --log-file="$SLURM_DIR/log/munged.log" --pid-file="$SLURM_DIR/munged.pid" --seed-file="$SLURM_DIR/munged.seed" ||
    { echo "munged did not start"; return 1; }
  if [ "$SLURM_NETNS" = 1 ]; then
    # Each node has a network stack of its own: the usual ports are free on every one of them.
    ctld_port=6817 ctld="node1(10.77.0.1)" tmpfs="$SLURM_DIR/tmp/%n"
    for i in $(seq "$nodes"); do
      names+=("node$i")
      mkdir -p "$SLURM_DIR/spool/node$i" "$SLURM_DIR/tmp/node$i"
      lines+="NodeName=node$i NodeHostname=node$i NodeAddr=10.77.0.$i Port=6818 CPUs=$cpus State=UNKNOWN"$'\n'
    done
  else
    ctld_port=$(slurm_free_port) || { echo "no free TCP port"; return 1; }
    ctld="$(hostname -s)(127.0.0.1)"
    if [ "$nodes" -eq 1 ]; then names=("$(hostname -s)"); else for i in $(seq "$nodes"); do names+=("n$i"); done; fi
    for node in "${names[@]}"; do
      port=$(slurm_free_port) || { echo "no free TCP port"; return 1; }
      mkdir -p "$SLURM_DIR/spool/$node"
      lines+="NodeName=$node NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$port CPUs=$cpus State=UNKNOWN"$'\n'
    done
  fi
  # MinJobAge=4 keeps sbatch --wait polling every 2 s (it backs off to 32 s when MinJobAge is large).
  cat >"$SLURM_DIR/slurm.conf" <<CONF
ClusterName=mnistci
SlurmctldHost=$ctld
SlurmctldPort=$ctld_port
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SLURM_DIR/munge.sock
StateSaveLocation=$SLURM_DIR/state
TmpFS=$tmpfs
SlurmdSpoolDir=$SLURM_DIR/spool/%n
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd-%n.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
JobRequeue=1
ReturnToService=2
MinJobAge=4
KillWait=10
MailProg=/bin/true
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
${lines}PartitionName=ci Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF="$SLURM_DIR/slurm.conf"
  slurm_client slurmctld -c -f "$SLURM_CONF" || { echo "slurmctld did not start"; return 1; }
  i=0
  for node in "${names[@]}"; do
    i=$((i + 1))
    slurm_on "$i" slurmd -N "$node" -f "$SLURM_CONF" || { echo "slurmd for $node did not start"; return 1; }
  done
  for i in $(seq 60); do
    [ "$(slurm_client sinfo -h -o %T 2>/dev/null)" = idle ] && { echo "slurm: cluster up: ${names[*]}, $cpus CPU(s) each, controller $ctld port $ctld_port"; return 0; }
    sleep 0.5
  done
  echo "the nodes did not become idle in 30 s: sinfo says '$(slurm_client sinfo -h -o '%T %E' 2>&1)'"
  return 1
}

slurm_logs() {  # the daemons' logs, for a failing test
  local f
  for f in "$SLURM_DIR"/log/*.log; do echo "---- $f (last 15 lines)"; tail -15 "$f"; done
}

# Cancels every job, stops the daemons (pid files), and ends anything still running from DIR or
# from SLURM_SCAN_DIR (the jobs' working directory; the caller must not stand in it). Sets
# SLURM_LEFT to what had to be killed (empty when everything had ended by itself).
slurm_down() {
  [ -n "${SLURM_DIR-}" ] && [ -d "$SLURM_DIR" ] || return 0
  [ "${SLURM_IS_DOWN:-0}" = 0 ] || return 0  # already (a second call would lose SLURM_LEFT)
  local i pid f cmd left=""
  if [ -f "$SLURM_DIR/slurmctld.pid" ]; then
    slurm_client scancel --full --signal=KILL --user="$(id -un)" >/dev/null 2>&1
    for i in $(seq 30); do [ -z "$(slurm_client squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
    slurm_client scontrol shutdown >/dev/null 2>&1
  fi
  for f in "$SLURM_DIR"/slurmctld.pid "$SLURM_DIR"/slurmd-*.pid "$SLURM_DIR"/munged.pid; do
    pid=$(cat "$f" 2>/dev/null) || continue
    for i in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; [ "$i" -eq 1 ] && kill "$pid" 2>/dev/null; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && { kill -9 "$pid" 2>/dev/null; left="$left $(basename "$f" .pid)($pid)"; }
  done
  # Job processes: batch shells run from spool/, ranks work in SLURM_SCAN_DIR.
  for pid in $( { find /proc -mindepth 2 -maxdepth 2 -name cwd -lname "${SLURM_SCAN_DIR:-$SLURM_DIR}*" |
                  cut -d/ -f3; grep -lsF -- "$SLURM_DIR/spool" /proc/[0-9]*/cmdline | cut -d/ -f3; } 2>/dev/null | sort -u); do
    [ "$pid" = $$ ] && continue
    cmd=$( { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null) || continue
    kill -9 "$pid" 2>/dev/null && left="$left ${cmd:0:60}($pid)"
  done
  export SLURM_LEFT=$left SLURM_IS_DOWN=1
  [ -z "$left" ] || echo "slurm_down: had to kill what was still running:$left"
  unset SLURM_CONF
}

# The frame every Slurm test shares: real MNIST must be there, Slurm installed (or a loud skip),
# a scratch directory $work, the tallies with ok / bad, and an EXIT trap that stops the cluster,
# fails the test if anything was left running, shows the job log ($log, when set) and the
# daemons' logs on failure, and exits with the verdict.
slurm_test_begin() {  # slurm_test_begin REPO_ROOT
  [ -f "$1/data/mnist/train-images-idx3-ubyte" ] || [ -f "$1/data/mnist/train-images-idx3-ubyte.gz" ] ||
    { echo "FAIL: no MNIST in $1/data/mnist: run scripts/fetch_mnist.sh"; exit 1; }
  slurm_install
  work=$(mktemp -d)
  chmod 755 "$work"  # munged wants its socket's directories searchable
  export SLURM_SCAN_DIR=$work
  passed=0 failed=0
  trap slurm_test_finish EXIT
  trap 'exit 1' INT TERM
}
slurm_test_finish() {
  slurm_down
  if [ -n "${SLURM_LEFT-}" ]; then failed=$((failed + 1)); echo "FAIL processes were left running:$SLURM_LEFT"; fi
  [ "$failed" -eq 0 ] || { [ -z "${log-}" ] || { echo "---- job log"; cat "$log"; }; slurm_logs; } 2>/dev/null
  rm -rf "$work"
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ] && exit 0 || exit 1
}
ok() { passed=$((passed + 1)); echo "ok   $* [${SECONDS}s]"; }
bad() { failed=$((failed + 1)); echo "FAIL $*"; }
