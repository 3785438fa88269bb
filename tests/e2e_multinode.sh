#!/usr/bin/env bash
# CTest 'e2e_multinode' (label multinode): ranks on nodes of their own (tests/netns_lib.sh, Note
# [Nodes as network namespaces]): each node a network and UTS namespace with its own address and
# hostname, mpirun on node 1 starting Open MPI's daemons on the others through an rsh agent, the
# ranks' sums over TCP between nodes and shared memory within one.
#   - 2 nodes x 2 ranks form one world of 4; the "hosts:" line (printed as training starts) names both hosts with their ranks, the
#     node-local ranks 0 and 1 on each; replicas stay bitwise equal (the check every 5 steps and
#     at the end passes), and a rank made to diverge on node 2 is caught across the link;
#   - a slow rank is named as the straggler on the host it runs on, on either node;
#   - --exact-sums gives one params_hash on 1 node x 4 ranks, 2 x 2 and 4 x 1, and the same as
#     4 ranks started by a plain mpirun on this machine;
#   - --grad-compression auto compresses lenet's large buckets on a link shaped to 1 Gbit/s;
#   - a node's link cut mid-run ends the job started by launch/local.sh --hosts, whether the
#     watchdog or Open MPI's keepalive notices first (Note [A lost node ends the job]), and with
#     --max-restarts the job goes on on the nodes left with the bits of the run that lost nothing.
# Usage: e2e_multinode.sh MNIST_MPI MAKE_SYNTHETIC_MNIST REPO_ROOT    (exit 77 = skipped: not root, no netns)
set -uo pipefail
bin=$1 make_data=$2 root=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ "$(id -u)" = 0 ] || { echo "SKIP: network namespaces need root"; exit 77; }
ip netns add "mnmpi-probe$$" 2>/dev/null || { echo "SKIP: this kernel or container gives no network namespaces"; exit 77; }
ip netns del "mnmpi-probe$$"
# shellcheck source=netns_lib.sh
. "$here/netns_lib.sh"
work=$(mktemp -d)
nodes_make 4 || { echo "FAIL nodes_make 4"; rm -rf "$work"; exit 1; }
trap 'nodes_remove; rm -rf "$work"' EXIT
"$make_data" "$work/data" 1200 200 >/dev/null || { echo "cannot write synthetic data"; exit 1; }
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
fail() { failed=$((failed + 1)); echo "FAIL $1"; }
has() {  # has NAME FILE PATTERN (extended regex)
  if grep -qE -- "$3" "$2"; then ok "$1"; else fail "$1: no /$3/ in $2:"; head -30 "$2"; fi
}
export NODES_TIMEOUT=120  # no case takes more than seconds; a hang fails, it does not stall the suite
common=(--data-dir "$work/data" --validation-size 0 --log-every 10 --seed 3)

# run NAME HOSTS NP ARGS...: trains on the nodes; $work/NAME.out, $work/NAME.rc
run() {
  local name=$1 hosts=$2 np=$3
  shift 3
  nodes_mpirun --host "$hosts" -np "$np" "$bin" "${common[@]}" "$@" >"$work/$name.out" 2>&1
  echo $? >"$work/$name.rc"
}
hash_of() { sed -n 's/^params_hash //p' "$work/$1.out"; }

# One world across two nodes.
run world "node1:2,node2:2" 4 --config "$root/configs/tiny.ini" --max-steps 20 --check-replicas-every 5
if [ "$(cat "$work/world.rc")" = 0 ]; then ok "2 nodes x 2 ranks trained (replica checks every 5 steps passed)"
else fail "2 x 2: exit $(cat "$work/world.rc")"; tail -20 "$work/world.out"; fi
has "one world of 4 ranks" "$work/world.out" "^mnist_mpi [0-9.]+: 4 rank\(s\)"
has "the hosts line names both hosts, local ranks 0 and 1 on each" "$work/world.out" \
  "^hosts: node1 ranks 0-1 \(local 0-1\), node2 ranks 2-3 \(local 0-1\)$"
MNIST_MPI_FAULT=3:6:diverge run diverge "node1:2,node2:2" 4 --config "$root/configs/tiny.ini" --max-steps 20 --check-replicas-every 1
if [ "$(cat "$work/diverge.rc")" = 1 ] && grep -qE "replicas diverged after step 6: rank 3" "$work/diverge.out"; then
  ok "rank 3 on node 2 made to diverge: caught across the link (exit 1)"
else fail "diverge on node 2: exit $(cat "$work/diverge.rc")"; grep -E "error|diverged" "$work/diverge.out" | head -5; fi

# The straggler's host: a rank slowed by 40 ms a step on node 2, then one on node 1.
MNIST_MPI_FAULT=2:slow:40 run slow2 "node1:2,node2:2" 4 --config "$root/configs/tiny.ini" --max-steps 40
has "a slow rank 2 is named on node2" "$work/slow2.out" "straggler: rank 2 on host node2: "
MNIST_MPI_FAULT=1:slow:40 run slow1 "node1:2,node2:2" 4 --config "$root/configs/tiny.ini" --max-steps 40
has "a slow rank 1 is named on node1" "$work/slow1.out" "straggler: rank 1 on host node1: "

# --exact-sums: the same bits on any placement of 4 ranks.
exact=(--config "$root/configs/tiny.ini" --max-steps 30 --batch-size 40 --exact-sums)
run exact_1x4 "node1:4" 4 "${exact[@]}"
run exact_2x2 "node1:2,node2:2" 4 "${exact[@]}"
run exact_4x1 "node1:1,node2:1,node3:1,node4:1" 4 "${exact[@]}"
timeout 120 mpirun -np 4 --oversubscribe "$bin" "${common[@]}" "${exact[@]}" >"$work/exact_here.out" 2>&1
has "4 x 1: four hosts" "$work/exact_4x1.out" "^hosts: node1 rank 0 \(local 0\), node2 rank 1 \(local 0\), node3 rank 2 \(local 0\), node4 rank 3 \(local 0\)$"
h=$(hash_of exact_here)
for n in exact_1x4 exact_2x2 exact_4x1; do
  if [ -n "$h" ] && [ "$(hash_of $n)" = "$h" ]; then ok "--exact-sums $n: params_hash $h, as 4 ranks on this machine"
  else fail "--exact-sums $n: params_hash '$(hash_of $n)', on this machine '$h' (exit $(cat "$work/$n.rc"))"; tail -5 "$work/$n.out"; fi
done

# --grad-compression auto on a slow link (Note [Choosing a codec per bucket from the link]): the two
# nodes' links shaped to 1 Gbit/s, where each of lenet's three 4 MB buckets of fc:1024's weight takes
# about 34 ms as floats against a backward of a few ms: the choice compresses them (bf16 or
# PowerSGD, whichever the measured link makes faster), the same on both ranks (replicas checked
# every step after it).
node_shape 1 1gbit && node_shape 2 1gbit || fail "tc tbf on the nodes' links"
run auto "node1:1,node2:1" 2 --config "$root/configs/lenet.ini" --global-batch-size 20 --max-steps 8 \
  --grad-compression auto --compression-start-steps 0 --check-replicas-every 1
node_unshape 1
node_unshape 2
if [ "$(cat "$work/auto.rc")" = 0 ]; then ok "auto on a 1 Gbit/s link trained (replicas equal every step)"
else fail "auto: exit $(cat "$work/auto.rc")"; tail -20 "$work/auto.out"; fi
has "auto on a 1 Gbit/s link compresses fc:1024's buckets" "$work/auto.out" \
  "^gradient codec \(auto, at step 4\): the link sums at [0-9.]+ Gbit/s .* bucket 0 [a-z0-9:]+, 1 (bf16|powersgd:2), 2 (bf16|powersgd:2), 3 (bf16|powersgd:2), 4 "

# Every job ended with its mpirun: nothing is left on the nodes (a rank mpirun killed may take a
# moment to go: Note [Ranks that mpirun killed] in tests/e2e_lib.sh).
for i in 1 2 3 4; do
  for _ in $(seq 50); do [ -z "$(node_pids "$i")" ] && break; sleep 0.1; done
  if [ -z "$(node_pids "$i")" ]; then ok "nothing left on node$i"
  else fail "left on node$i: $(node_pids "$i" | xargs -r ps -o pid=,args= -p | head -3)"; fi
done

# Note [A lost node ends the job] (launch/local.sh): node 2's link cut mid-run, the job started by
# launch/local.sh --hosts on node 1 (the harness's agent, the nodes by address so that the
# launcher can probe them). (a) The watchdog first (--collective-timeout 3, before the launcher's
# 11 s keepalive): rank 0 ends the job, mpirun cannot reach node 2's daemon and does not return, and
# the launcher stops it --grace 5 s after the ranks here ended, naming the host that does not
# answer: exit 1. (b) The keepalive first (--collective-timeout 60): Open MPI itself ends the job,
# the launcher names the host, and nothing is left on either node. Each within 40 s of the cut.
local_sh() {  # NAME HOSTS ARGS...: launch/local.sh --hosts HOSTS --grace 5 on node 1, in the
  local name=$1 hosts=$2  # background, mnist_mpi given ARGS; $work/NAME.out
  shift 2
  node_run 1 env NODES_RUN_DIR="$NODES_RUN_DIR" OMPI_MCA_plm_rsh_agent="$NODES_AGENT" \
    OMPI_MCA_oob_tcp_if_include="$NODES_SUBNET.0/24" OMPI_MCA_btl_tcp_if_include="$NODES_SUBNET.0/24" \
    MNIST_MPI="$bin" timeout 120 "$root/launch/local.sh" --hosts "$hosts" --grace 5 -- "${common[@]}" \
    --config "$root/configs/tiny.ini" --max-steps 100000 --eval-every 0 "$@" >"$work/$name.out" 2>&1 </dev/null &
}
cut_case() {  # NAME TIMEOUT: trains, cuts node 2's link once training runs, times the end
  local name=$1 pid t0 i
  local_sh "$name" "$NODES_SUBNET.1:1,$NODES_SUBNET.2:1" --collective-timeout "$2"
  pid=$!
  # Well into training (Open MPI reports a daemon lost in its first seconds as one it could not start).
  for ((i = 0; i < 600; i++)); do grep -qE "^epoch [0-9]+ step 300/" "$work/$name.out" && break; sleep 0.1; done
  node_cut 2
  t0=$SECONDS
  wait "$pid"
  echo $? >"$work/$name.rc"
  echo $((SECONDS - t0)) >"$work/$name.secs"
  node_restore 2
  for ((i = 0; i < 100; i++)); do  # node 2 answers again (a refused connection: rc 1, not a timeout)
    node_run 1 timeout 1 bash -c "exec 3<>/dev/tcp/$NODES_SUBNET.2/9" 2>/dev/null
    [ $? -eq 1 ] && break
    sleep 0.1
  done
}
cut_case cut_watchdog 3
if [ "$(cat "$work/cut_watchdog.rc")" = 1 ] && [ "$(cat "$work/cut_watchdog.secs")" -le 40 ] &&
   grep -q "collective timeout: " "$work/cut_watchdog.out" &&
   grep -q "local.sh: error: mpirun has not returned 5 s after the ranks on this machine ended: a node cannot be reached (no answer from: $NODES_SUBNET.2)" "$work/cut_watchdog.out"; then
  ok "a cut link, the watchdog first: the job ended $(cat "$work/cut_watchdog.secs") s after the cut, exit 1, the lost host named"
else fail "a cut link, the watchdog first: exit $(cat "$work/cut_watchdog.rc") after $(cat "$work/cut_watchdog.secs") s"; grep -vE "^\[node" "$work/cut_watchdog.out" | tail -12; fi
[ -z "$(node_pids 1)" ] && ok "nothing left on node1 after the cut" || fail "left on node1: $(node_pids 1 | xargs -r ps -o args= -p | head -3)"
node_kill 2  # its daemon waits on TCP's retries to tell mpirun its rank ended (the note)
cut_case cut_keepalive 60
if [ "$(cat "$work/cut_keepalive.rc")" != 0 ] && [ "$(cat "$work/cut_keepalive.secs")" -le 40 ] &&
   grep -qE "^local.sh: error: mpirun ended with exit [0-9]+; no answer from: $NODES_SUBNET.2 " "$work/cut_keepalive.out" &&
   ! grep -q "collective timeout" "$work/cut_keepalive.out"; then
  ok "a cut link, the keepalive first: Open MPI ended the job $(cat "$work/cut_keepalive.secs") s after the cut (exit $(cat "$work/cut_keepalive.rc")), the lost host named"
else fail "a cut link, the keepalive first: exit $(cat "$work/cut_keepalive.rc") after $(cat "$work/cut_keepalive.secs") s"; grep -vE "^(\[node|epoch|  layer)" "$work/cut_keepalive.out" | tail -25; fi
for i in 1 2; do
  for _ in $(seq 50); do [ -z "$(node_pids "$i")" ] && break; sleep 0.1; done
  [ -z "$(node_pids "$i")" ] && ok "nothing left on node$i after the keepalive's end" ||
    fail "left on node$i: $(node_pids "$i" | xargs -r ps -o args= -p | head -3)"
done

# Note [Restarts on the nodes that are left] (launch/local.sh): 3 nodes x 1 rank, --exact-sums,
# a checkpoint every 10 steps, rank 0 slowed by 50 ms a step (the fault hook) so that the cut lands
# mid-run; node 3's link cut after step 30 of 60. The job ends, the launcher
# starts it again on nodes 1 and 2 with --resume auto, and the run ends with the params_hash of
# the one that lost nothing (3 ranks, no cut). Then the same with --min-ranks 3: one line, exit 1,
# no restart.
restart_args=(--model "conv:3x3:4:same,relu,maxpool:2,flatten,fc:10" --global-batch-size 60 --exact-sums
              --max-steps 60 --checkpoint-every 10 --collective-timeout 3)
run restart_ref "node1:1,node2:1,node3:1" 3 "${restart_args[@]}" --checkpoint-dir "$work/ck_restart_ref"
restart_case() {  # NAME MIN_RANKS [FAULT]: node 3 cut (or its processes killed, or frozen) after step 30
  local name=$1 pid i fault=${3:-cut}
  rm -rf "$work/ck_$name"
  node_run 1 env NODES_RUN_DIR="$NODES_RUN_DIR" OMPI_MCA_plm_rsh_agent="$NODES_AGENT" \
    OMPI_MCA_oob_tcp_if_include="$NODES_SUBNET.0/24" OMPI_MCA_btl_tcp_if_include="$NODES_SUBNET.0/24" \
    MNIST_MPI="$bin" MNIST_MPI_FAULT=0:slow:50 timeout 150 "$root/launch/local.sh" --hosts "$NODES_SUBNET.1:1,$NODES_SUBNET.2:1,$NODES_SUBNET.3:1" \
    --grace 5 --max-restarts 2 --min-ranks "$2" -- "${common[@]}" "${restart_args[@]}" --checkpoint-dir "$work/ck_$name" \
    >"$work/$name.out" 2>&1 </dev/null &
  pid=$!
  for ((i = 0; i < 600; i++)); do grep -qE "^epoch [0-9]+ step 30/60" "$work/$name.out" && break; sleep 0.1; done
  "node_$fault" 3
  wait "$pid"
  echo $? >"$work/$name.rc"
  node_restore 3
  node_thaw 3
  node_kill 3  # what is left of the first job there (Note [A lost node ends the job])
}
restart_case restart 2
ref=$(hash_of restart_ref)
lost_at=$(sed -n 's/.*collective timeout: .* in step \([0-9]*\).*/\1/p' "$work/restart.out" | head -1)
if [ "$(cat "$work/restart.rc")" = 0 ] && [ -n "$ref" ] && [ "$(hash_of restart)" = "$ref" ] &&
   [ "${lost_at:-0}" -gt 30 ] && [ "${lost_at:-99}" -lt 60 ] &&
   grep -qE "^local.sh: restart 1 of 2: the job ended with exit (1|205); no answer from: $NODES_SUBNET.3; starting 2 rank\(s\) on $NODES_SUBNET.1:1,$NODES_SUBNET.2:1 with --resume auto" "$work/restart.out" &&
   grep -qE "resuming from .*step-000000[0-9]0.ckpt" "$work/restart.out"; then
  ok "node 3 lost in step $lost_at of 60: restarted on nodes 1-2 from a checkpoint, params_hash $ref as the run that lost nothing"
  grep -E "^local.sh: (restart|error)|^mnist_mpi: error|resuming from|^params_hash" "$work/restart.out" | sed 's/^/     | /' 
else fail "restart: exit $(cat "$work/restart.rc"), params_hash '$(hash_of restart)' against '$ref'"; grep -E "^local.sh|resuming|params_hash|error" "$work/restart.out" | head -12; fi
# Node 3's processes killed, then frozen (SIGSTOP), after step 30: node 3 still answers (its
# kernel does), so the launcher starts again on all three nodes (a new daemon and rank there), and
# the run ends with the same bits.
for fault in kill freeze; do
  restart_case "restart_$fault" 2 "$fault"
  if [ "$(cat "$work/restart_$fault.rc")" = 0 ] && [ "$(hash_of "restart_$fault")" = "$ref" ] &&
     grep -qE "^local.sh: restart 1 of 2: the job ended with exit [0-9]+; no answer from: none; starting 3 rank\(s\)" "$work/restart_$fault.out"; then
    ok "node 3's processes $([ "$fault" = kill ] && echo killed || echo frozen) after step 30: restarted on the three nodes, params_hash $ref as the run that lost nothing"
  else fail "restart after node 3 ${fault}: exit $(cat "$work/restart_$fault.rc"), params_hash '$(hash_of "restart_$fault")'"; grep -E "^local.sh|resuming|params_hash|error" "$work/restart_$fault.out" | head -8; fi
done
restart_case restart_min 3
if [ "$(cat "$work/restart_min.rc")" != 0 ] &&
   grep -q "^local.sh: error: the job ended with exit [0-9]*; the hosts that answer hold 2 rank(s), fewer than --min-ranks 3 (no answer from: $NODES_SUBNET.3); not restarting" "$work/restart_min.out" &&
   ! grep -q "local.sh: restart 1" "$work/restart_min.out"; then
  ok "fewer ranks left than --min-ranks: one line, exit $(cat "$work/restart_min.rc"), no restart"
else fail "restart --min-ranks 3: exit $(cat "$work/restart_min.rc")"; grep -E "^local.sh" "$work/restart_min.out" | head -5; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
