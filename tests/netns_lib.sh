# Nodes of their own on one machine, for the multinode tests and bench/network.sh: source it (bash,
# as root). Note [Nodes as network namespaces]:
#
# Each node is a Linux network namespace with a UTS namespace of its own (its own interfaces,
# address and hostname: node1, node2, ...), its link a veth pair to a bridge that lives in a hub
# namespace of this harness's own, never in the machine's: nothing made here can reach, or be
# reached from, the machine's network, and two harnesses at once (each with its hub) cannot see
# each other even with the same addresses. mpirun runs on node 1 and starts Open MPI's daemon on
# the others through an rsh agent (tests/netns_agent.sh) that runs the daemon's command in that
# node's namespaces; Open MPI's TCP transport then carries the ranks' traffic between nodes
# (shared memory only between ranks of one node). A node's link can be shaped (tbf on both ends:
# this kernel has tbf, not netem), cut (its end of the bridge down) and its processes killed or
# frozen. Everything is named after this shell's PID (mnmpi<PID>-...) and removed by nodes_remove,
# which the EXIT/INT/TERM traps call; what a harness killed with SIGKILL left is removed by the next
# one (nodes_make removes the namespaces of every harness whose process is gone).
#
#   nodes_make N                  N nodes (1 <= N <= 16): node I has hostname nodeI, address 10.77.0.I
#   node_run I CMD...             CMD on node I (its network and UTS namespaces)
#   nodes_mpirun ARGS...          mpirun on node 1 with the agent and Open MPI's TCP on the nodes'
#                                 subnet; ARGS give --host nodeI:SLOTS,... and the program
#   node_shape I RATE             node I's link shaped to RATE both ways (tc rates: 10gbit, 500mbit)
#   node_unshape I                back to unshaped
#   node_cut I / node_restore I   node I's link down / up again
#   node_pids I                   the processes in node I's namespace
#   node_kill I                   SIGKILL them; node_freeze I / node_thaw I: SIGSTOP / SIGCONT
#   nodes_remove                  every namespace, mount and file made (also on exit)
#
# Traffic stays on addresses this harness made: Open MPI is told to use only 10.77.0.0/24
# (oob_tcp_if_include, btl_tcp_if_include), and each node sees nothing but its own link and lo.

NODES_PREFIX="mnmpi$$"
NODES_RUN_DIR="/run/mnist_mpi-nodes/$$"
NODES_SUBNET="10.77.0"
NODES_COUNT=0
NODES_AGENT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/netns_agent.sh"

nodes_fail() { echo "netns_lib: $*" >&2; return 1; }

# Removes what harnesses that are gone left behind (a test killed with SIGKILL runs no trap).
nodes_remove_stale() {
  local ns pid d
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^mnmpi[0-9]+-' || true); do
    pid=${ns#mnmpi}
    pid=${pid%%-*}
    kill -0 "$pid" 2>/dev/null && continue
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  for d in /run/mnist_mpi-nodes/*; do
    [ -d "$d" ] || continue
    pid=${d##*/}
    kill -0 "$pid" 2>/dev/null && continue
    for f in "$d"/uts-*; do [ -e "$f" ] && umount "$f" 2>/dev/null; done
    rm -rf "$d"
  done
}

nodes_make() {
  local n=$1 i
  [ "$(id -u)" = 0 ] || { nodes_fail "network namespaces need root"; return 1; }
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 16 ] || { nodes_fail "1 to 16 nodes, not '$n'"; return 1; }
  nodes_remove_stale
  trap nodes_remove EXIT
  trap 'nodes_remove; exit 130' INT
  trap 'nodes_remove; exit 143' TERM
  mkdir -p "$NODES_RUN_DIR" || return 1
  ip netns add "$NODES_PREFIX-hub" || { nodes_fail "cannot make a network namespace (ip netns add)"; return 1; }
  ip -n "$NODES_PREFIX-hub" link add br0 type bridge && ip -n "$NODES_PREFIX-hub" link set br0 up || return 1
  for ((i = 1; i <= n; i++)); do
    local ns="$NODES_PREFIX-n$i"
    ip netns add "$ns" || return 1
    # Both ends made inside the hub's namespace, the node's end then moved: the machine's own
    # namespace never holds either.
    ip -n "$NODES_PREFIX-hub" link add "h$i" type veth peer name eth0 netns "$ns" || return 1
    ip -n "$NODES_PREFIX-hub" link set "h$i" master br0 && ip -n "$NODES_PREFIX-hub" link set "h$i" up || return 1
    ip -n "$ns" addr add "$NODES_SUBNET.$i/24" dev eth0 && ip -n "$ns" link set eth0 up && ip -n "$ns" link set lo up || return 1
    touch "$NODES_RUN_DIR/uts-$i" && unshare --uts="$NODES_RUN_DIR/uts-$i" hostname "node$i" || return 1
    echo "$ns $NODES_RUN_DIR/uts-$i" >"$NODES_RUN_DIR/node$i"
    NODES_COUNT=$i
  done
  # The bridge forwards at once (no STP); wait until every link is up at both ends.
  for ((i = 1; i <= n; i++)); do
    local tries=0
    until ip -n "$NODES_PREFIX-n$i" -o link show eth0 | grep -q 'state UP' &&
          ip -n "$NODES_PREFIX-hub" -o link show "h$i" | grep -q 'state UP'; do
      tries=$((tries + 1))
      [ "$tries" -lt 50 ] || { nodes_fail "node$i's link did not come up"; return 1; }
      sleep 0.1
    done
  done
}

nodes_remove() {
  local i
  trap - EXIT INT TERM
  for ((i = 1; i <= NODES_COUNT; i++)); do
    ip netns pids "$NODES_PREFIX-n$i" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
  done
  for ((i = 1; i <= NODES_COUNT; i++)); do
    ip netns del "$NODES_PREFIX-n$i" 2>/dev/null
    umount "$NODES_RUN_DIR/uts-$i" 2>/dev/null
  done
  ip netns del "$NODES_PREFIX-hub" 2>/dev/null
  rm -rf "$NODES_RUN_DIR"
  rmdir /run/mnist_mpi-nodes 2>/dev/null
  NODES_COUNT=0
  return 0
}

node_ns() { echo "$NODES_PREFIX-n$1"; }

node_run() {
  local i=$1
  shift
  [ -f "$NODES_RUN_DIR/node$i" ] || { nodes_fail "no node $i"; return 1; }
  nsenter --net="/run/netns/$NODES_PREFIX-n$i" --uts="$NODES_RUN_DIR/uts-$i" -- "$@"
}

nodes_mpirun() {
  node_run 1 env NODES_RUN_DIR="$NODES_RUN_DIR" \
    OMPI_MCA_plm_rsh_agent="$NODES_AGENT" OMPI_MCA_oob_tcp_if_include="$NODES_SUBNET.0/24" \
    OMPI_MCA_btl_tcp_if_include="$NODES_SUBNET.0/24" timeout "${NODES_TIMEOUT:-600}" mpirun "$@"
}

# tbf on both ends of node I's link: its eth0 (what it sends) and the hub's h$I (what it receives).
# The bucket holds 2 ms at the rate, at least 256 KB (a GSO segment on a veth is up to 64 KB).
node_shape() {
  local i=$1 rate=$2 bits burst
  bits=$(python3 -c "import re,sys; m=re.fullmatch(r'([0-9.]+)([kmg]?)bit', sys.argv[1]);
sys.exit(1) if not m else print(int(float(m.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}[m.group(2)]))" "$rate") ||
    { nodes_fail "a rate like 10gbit or 500mbit, not '$rate'"; return 1; }
  burst=$((bits / 8 / 500))
  [ "$burst" -ge 262144 ] || burst=262144
  node_unshape "$i"
  ip netns exec "$NODES_PREFIX-n$i" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms &&
    ip netns exec "$NODES_PREFIX-hub" tc qdisc add dev "h$i" root tbf rate "$rate" burst "$burst" latency 50ms
}

node_unshape() {
  ip netns exec "$NODES_PREFIX-n$1" tc qdisc del dev eth0 root 2>/dev/null
  ip netns exec "$NODES_PREFIX-hub" tc qdisc del dev "h$1" root 2>/dev/null
  return 0
}

node_cut() { ip -n "$NODES_PREFIX-hub" link set "h$1" down; }
node_restore() { ip -n "$NODES_PREFIX-hub" link set "h$1" up; }
node_pids() { ip netns pids "$NODES_PREFIX-n$1" 2>/dev/null; }
node_kill() { node_pids "$1" | xargs -r kill -KILL 2>/dev/null; return 0; }
node_freeze() { node_pids "$1" | xargs -r kill -STOP 2>/dev/null; return 0; }
node_thaw() { node_pids "$1" | xargs -r kill -CONT 2>/dev/null; return 0; }
