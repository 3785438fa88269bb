#!/usr/bin/env bash
# CTest 'netns_lib_selftest' (label multinode): the harness of tests/netns_lib.sh does what its
# tests rely on (Note [Nodes as network namespaces]): nodes with their own hostname, address and
# only their own link; a listener on one node reached from another, and not once that node's link
# is cut, and again once it is restored; a shaped link carrying no more than its rate; a node's
# processes frozen, thawed and killed; everything removed at the end, and what a harness killed
# with SIGKILL left removed by the next one.
# Usage: netns_lib_selftest.sh          (exit 77 = skipped: not root, or no network namespaces)
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ "$(id -u)" = 0 ] || { echo "SKIP: network namespaces need root"; exit 77; }
ip netns add "mnmpi-probe$$" 2>/dev/null || { echo "SKIP: this kernel or container gives no network namespaces"; exit 77; }
ip netns del "mnmpi-probe$$"
# shellcheck source=netns_lib.sh
. "$here/netns_lib.sh"
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
fail() { failed=$((failed + 1)); echo "FAIL $1"; }
check() { local name=$1; shift; if "$@"; then ok "$name"; else fail "$name"; fi; }
# within SECONDS CMD...: CMD succeeds within SECONDS, polled (a signal's effect, a process started
# in the background, a listener's start take their time under load).
within() {
  local end=$(($(date +%s) + $1))
  shift
  until "$@"; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 0.05; done
}
state_of() { awk '{print $3}' "/proc/$1/stat" 2>/dev/null; }

nodes_make 3 || { echo "FAIL nodes_make 3"; exit 1; }
check "each node has its own hostname" test "$(node_run 1 hostname) $(node_run 2 hostname) $(node_run 3 hostname)" = "node1 node2 node3"
check "node 2 has its address and lo, nothing else" \
  test "$(node_run 2 ip -o -4 addr show | awk '{print $2, $4}' | sort | tr '\n' ' ')" = "eth0 10.77.0.2/24 lo 127.0.0.1/8 "
check "no node has a default route (nothing leaves the harness's bridge)" \
  test -z "$(node_run 1 ip route show default; node_run 2 ip route show default)"
check "the machine's own namespace holds none of the links" test -z "$(ip -o link show | grep -E ' h[0-9]+[@:]')"

# A listener on node 2; a connection from node 1, within SECONDS; SEND bytes to it, timed.
serve() {  # serve NODE PORT: accepts connections and reads each to its end
  node_run "$1" python3 -c '
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(4)
while True:
    c, _ = s.accept()
    while c.recv(1 << 16): pass
    c.close()' "$2" &
  within 10 node_run "$1" python3 -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()' "$2" 2>/dev/null
}
send() {  # send NODE ADDRESS PORT BYTES TIMEOUT: prints the seconds taken, or "failed"
  node_run "$1" python3 -c '
import socket, sys, time
addr, port, n, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
t = time.monotonic()
try:
    s = socket.create_connection((addr, port), timeout=timeout)
    buf = bytes(1 << 16); left = n
    while left > 0:
        left -= s.send(buf[:min(left, len(buf))])
    s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
    print("%.3f" % (time.monotonic() - t))
except OSError:
    print("failed")' "$2" "$3" "$4" "$5"
}
serve 2 5001
t=$(send 1 10.77.0.2 5001 100000 5)
check "node 1 reaches a listener on node 2 ($t s)" test "$t" != failed
node_cut 2
t=$(send 1 10.77.0.2 5001 100000 2)
check "node 2 cut off: node 1 cannot reach it ($t)" test "$t" = failed
node_restore 2
t=$(send 1 10.77.0.2 5001 100000 5)
check "node 2 restored: reached again ($t s)" test "$t" != failed
# 4 MB through a link shaped to 20 Mbit/s take at least (4 MB - its 256 KB bucket) / 2.5 MB/s = 1.5 s.
node_shape 2 20mbit
t=$(send 1 10.77.0.2 5001 4000000 30)
check "20 Mbit/s: 4 MB took $t s, at least 1.4" python3 -c "import sys; sys.exit(not ('$t' != 'failed' and float('$t') >= 1.4))"
node_unshape 2
t=$(send 1 10.77.0.2 5001 4000000 30)
check "unshaped again: 4 MB took $t s, under 1.4" python3 -c "import sys; sys.exit(not ('$t' != 'failed' and float('$t') < 1.4))"
if node_shape 2 fast 2>/dev/null; then fail "a rate that is not one was taken"; else ok "a rate that is not one is refused"; fi

node_run 3 sleep 300 &
within 10 test -n "$(node_pids 3)"
pid=$(node_pids 3 | head -1)
check "node 3's process is listed ($pid)" test -n "$pid"
node_freeze 3
check "frozen: stopped" within 10 eval '[ "$(state_of "$pid")" = T ]'
node_thaw 3
check "thawed: running again" within 10 eval '[ "$(state_of "$pid")" = S ]'
node_kill 3
wait "$pid" 2>/dev/null
check "killed: gone" within 10 test ! -e "/proc/$pid"

prefix=$NODES_PREFIX
nodes_remove
kill %1 2>/dev/null  # the listener's nsenter (its python died with the namespace's processes)
check "nodes_remove removed every namespace" test -z "$(ip netns list | grep "^$prefix-")"
check "nodes_remove removed its files and mounts" test ! -e "/run/mnist_mpi-nodes/$$"

# A harness killed with SIGKILL runs no trap: the next nodes_make removes what it left.
bash -c ". '$here/netns_lib.sh'; nodes_make 2 && echo \$NODES_PREFIX >'/tmp/netns_selftest_prefix.$$' && kill -KILL \$\$"
stale=$(cat "/tmp/netns_selftest_prefix.$$" 2>/dev/null)
rm -f "/tmp/netns_selftest_prefix.$$"
check "a killed harness left its namespaces ($stale)" test -n "$stale" -a -n "$(ip netns list | grep "^$stale-")"
nodes_remove_stale
check "the next harness removed them" test -z "$(ip netns list | grep "^$stale-")" -a ! -e "/run/mnist_mpi-nodes/${stale#mnmpi}"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
