#!/usr/bin/env bash
# Open MPI's rsh agent for the nodes of tests/netns_lib.sh (Note [Nodes as network namespaces]):
# called as `netns_agent.sh HOST COMMAND...` for each node mpirun starts a daemon on, it runs the
# command, as rsh would on that host, in the node's network and UTS namespaces. HOST is nodeI or
# its address 10.77.0.I; NODES_RUN_DIR (set by nodes_mpirun) names the harness's nodes.
set -u
host=$1
shift
# Open MPI may put options before the host, as it would for ssh; none are expected here.
case $host in
  node[0-9]*) i=${host#node} ;;
  10.77.0.[0-9]*) i=${host##*.} ;;
  *) echo "netns_agent: no node '$host' (nodeI or 10.77.0.I)" >&2; exit 255 ;;
esac
entry="${NODES_RUN_DIR:?netns_agent: NODES_RUN_DIR not set (use nodes_mpirun)}/node$i"
[ -f "$entry" ] || { echo "netns_agent: node$i is not one of this harness's nodes ($entry)" >&2; exit 255; }
read -r ns uts <"$entry"
exec nsenter --net="/run/netns/$ns" --uts="$uts" -- /bin/sh -c "$*"
