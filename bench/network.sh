#!/usr/bin/env bash
# Links at cluster speeds: 2 nodes x 1 rank, each node a network namespace of its own
# (tests/netns_lib.sh, Note [Nodes as network namespaces]) and each rank on a core of its own, the
# nodes' links unshaped and shaped (tbf, both ways) to 10, 5, 2, 1 and 0.5 Gbit/s. On each link:
#   - lenet and the fast recipe (configs/lenet.ini, configs/fast.ini): images/s, and per step the
#     backward and the exposed communication (what the step waited for the sums after backward);
#   - lenet with the overlap off (--no-overlap) and with buckets of 1 and 16 MB (4 MB is the default);
#   - lenet and fast with bf16 on the wire (--grad-compression bf16), lenet with PowerSGD of rank
#     1, 2 and 4 and fast with rank 2 (--grad-compression powersgd:R, compressing from the first step);
#   - lenet and fast with --grad-compression auto (its choice printed);
#   - PyTorch DDP (bench/torch_ddp.py, gloo) on the same link, same network, batch and one core a rank:
#     plain, with fp16_compress_hook and with powerSGD_hook of rank 2 (where python3-torch is installed;
#     Debian's 1.13 on CPU runs neither bf16_compress_hook, which needs NCCL, nor powerSGD_hook);
#   - the communicator's sum against its size (build/reducer_bench --sizes), 1 KB to 16 MB.
# Prints a table of ratios and writes every number to a TSV (default bench/network.tsv) that
# bench/scaling.py fits its model on. About 15 minutes on 2 cores (--quick: unshaped and 1 Gbit/s
# only, fewer steps).
# Usage (as root, after scripts/setup.sh and scripts/fetch_mnist.sh):
#   bench/network.sh [--quick] [--out FILE] [BUILD_DIR]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
quick=0 tsv=$root/bench/network.tsv build=$root/build
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --out) tsv=$2; shift ;;
    *) build=$1 ;;
  esac
  shift
done
bin=$build/mnist_mpi reducer=$build/reducer_bench
[ "$(id -u)" = 0 ] || { echo "network.sh: network namespaces need root" >&2; exit 2; }
[ -x "$bin" ] && [ -x "$reducer" ] || { echo "network.sh: no $bin or $reducer: build first (scripts/setup.sh)" >&2; exit 2; }
[ -f "$root/data/mnist/train-images-idx3-ubyte" ] || { echo "network.sh: no data/mnist: scripts/fetch_mnist.sh" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# shellcheck source=../tests/netns_lib.sh
. "$root/tests/netns_lib.sh"
work=$(mktemp -d)
nodes_make 2 || exit 1
trap 'nodes_remove; rm -rf "$work"' EXIT
cores=$(nproc)

links=(unshaped 10gbit 5gbit 2gbit 1gbit 500mbit)
steps=60
if ((quick)); then links=(unshaped 1gbit); steps=30; fi
printf 'kind\tlink\tname\timages_per_s\tbackward_ms\texposed_ms\tstep_ms\tbytes\tbuckets\n' >"$tsv"

# One rank per node, rank r pinned to core r (mod the cores): the nodes do not share a core.
pinned=(bash -c 'exec taskset -c $((OMPI_COMM_WORLD_RANK % '"$cores"')) "$@"' pinned)
train() {  # LINK NAME ARGS...: one mnist_mpi run on the two nodes, a "train" row
  local link=$1 name=$2
  shift 2
  local m=$work/$name.$link.jsonl
  nodes_mpirun --host node1:1,node2:1 -np 2 --bind-to none "${pinned[@]}" "$bin" --data-dir "$root/data/mnist" \
    --threads 1 --max-steps "$steps" --log-every 0 --eval-every 0 --metrics-file "$m" "$@" >"$work/$name.$link.out" 2>&1 ||
    { echo "network.sh: $name on $link failed:" >&2; tail -5 "$work/$name.$link.out" >&2; return 1; }
  python3 - "$m" "$link" "$name" >>"$tsv" <<'PY'
import json, sys
f = next(e for e in map(json.loads, open(sys.argv[1])) if e.get("event") == "final")
s = f["step_ms"]
step = sum(s[k] for k in ("data", "forward", "backward", "exposed_comm", "optimizer"))
print("train", sys.argv[2], sys.argv[3], "%.1f" % f["images_per_s"], "%.3f" % s["backward"], "%.3f" % s["exposed_comm"],
      "%.3f" % step, f["reduced_bytes_per_step"], f["buckets"], sep="\t")
PY
}
torch_ddp() {  # LINK NAME HOOK: PyTorch DDP on the two nodes, lenet's recipe, a "train" row NAME
  local link=$1 name=$2 hook=$3 r pids=()
  for r in 0 1; do
    node_run $((r + 1)) env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 taskset -c $((r % cores)) /usr/bin/python3 \
      "$root/bench/torch_ddp.py" --config "$root/configs/lenet.ini" --data-dir "$root/data/mnist" --ranks 2 \
      --rank "$r" --master 10.77.0.1:29517 --max-steps "$steps" --json-file "$work/torch.$link.$r.json" \
      --hook "$hook" >"$work/torch.$link.$r.out" 2>&1 &
    pids+=($!)
  done
  local bad=0
  for r in "${pids[@]}"; do wait "$r" || bad=1; done
  ((bad == 0)) || { echo "network.sh: torch DDP ($hook) on $link failed:" >&2; tail -5 "$work/torch.$link.0.out" >&2; return 1; }
  python3 - "$work/torch.$link.0.json" "$link" "$name" >>"$tsv" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print("train", sys.argv[2], sys.argv[3], "%.1f" % j["images_per_s"], "", "", "", "", "", sep="\t")
PY
}

for link in "${links[@]}"; do
  if [ "$link" = unshaped ]; then node_unshape 1; node_unshape 2; else node_shape 1 "$link" && node_shape 2 "$link" || exit 1; fi
  echo "== link $link ($(date +%T))"
  train "$link" lenet --config "$root/configs/lenet.ini"
  train "$link" lenet_no_overlap --config "$root/configs/lenet.ini" --no-overlap
  train "$link" lenet_1mb --config "$root/configs/lenet.ini" --bucket-mb 1 --first-bucket-mb 1
  train "$link" lenet_16mb --config "$root/configs/lenet.ini" --bucket-mb 16 --first-bucket-mb 16
  train "$link" fast --config "$root/configs/fast.ini"
  train "$link" fast_no_overlap --config "$root/configs/fast.ini" --no-overlap
  train "$link" lenet_bf16_wire --config "$root/configs/lenet.ini" --grad-compression bf16
  train "$link" fast_bf16_wire --config "$root/configs/fast.ini" --grad-compression bf16
  for r in 1 2 4; do  # compressing from the first step: the rate of a compressed step
    train "$link" lenet_powersgd$r --config "$root/configs/lenet.ini" --grad-compression powersgd:$r --compression-start-steps 0
  done
  train "$link" fast_powersgd2 --config "$root/configs/fast.ini" --grad-compression powersgd:2 --compression-start-steps 0
  for model in lenet fast; do  # auto: chooses at step 4 (the steady rate starts at step 10)
    train "$link" ${model}_auto --config "$root/configs/$model.ini" --grad-compression auto --compression-start-steps 0 &&
      grep -h "gradient codec (auto" "$work/${model}_auto.$link.out" | sed "s/^/  $link $model: /"
  done
  if /usr/bin/python3 -c "import torch" 2>/dev/null; then
    torch_ddp "$link" torch_lenet none
    # PyTorch 1.13 (Debian's) on CPU: bf16_compress_hook needs CUDA and NCCL, and powerSGD_hook
    # aborts in gloo ("op.preamble.length <= op.nbytes"): fp16_compress_hook is its hook that runs.
    torch_ddp "$link" torch_lenet_fp16 fp16
    torch_ddp "$link" torch_lenet_powersgd2 powersgd:2 || true
  fi
  nodes_mpirun --host node1:1,node2:1 -np 2 --bind-to none "${pinned[@]}" "$reducer" --sizes 15 2>"$work/sizes.err" |
    awk -v link="$link" '$1 == "sum" { printf "sum\t%s\t\t\t\t\t%s\t%s\t\n", link, $3, $2 }' >>"$tsv"
done
# The backward's per-layer timeline of each model (link-independent compute), for the model's
# bucket timing (bench/scaling.py).
for model in lenet fast; do
  nodes_mpirun --host node1:1,node2:1 -np 2 --bind-to none "${pinned[@]}" "$bin" --data-dir "$root/data/mnist" --threads 1 \
    --config "$root/configs/$model.ini" --max-steps 40 --log-every 0 --eval-every 0 --timeline "${tsv%.tsv}.$model.timeline.json" \
    >/dev/null 2>&1 || echo "network.sh: the $model timeline run failed" >&2
done

# The table: each link's rate as a fraction of the unshaped one, and mnist_mpi against PyTorch.
python3 - "$tsv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
train = {(r["link"], r["name"]): r for r in rows if r["kind"] == "train"}
links = list(dict.fromkeys(r["link"] for r in rows))
names = list(dict.fromkeys(r["name"] for r in rows if r["kind"] == "train"))
print("images/s (fraction of unshaped); backward / exposed communication ms per step")
print("%-17s" % "run" + "".join("%22s" % l for l in links))
for n in names:
    base = float(train[("unshaped", n)]["images_per_s"]) if ("unshaped", n) in train else None
    cells = []
    for l in links:
        r = train.get((l, n))
        if not r:
            cells.append("%22s" % "-"); continue
        ips = float(r["images_per_s"])
        frac = " (%.2f)" % (ips / base) if base else ""
        cells.append("%22s" % ("%.0f%s" % (ips, frac)))
    print("%-17s" % n + "".join(cells))
    if train.get((links[0], n), {}).get("backward_ms"):
        print("%-17s" % "  bwd/exposed ms" + "".join("%22s" % ("%s / %s" % (train[(l, n)]["backward_ms"], train[(l, n)]["exposed_ms"]) if (l, n) in train and train[(l, n)]["backward_ms"] else "-") for l in links))
for ours, theirs in (("lenet", "torch_lenet"), ("lenet_bf16_wire", "torch_lenet_fp16"),
                     ("lenet_auto", "torch_lenet_fp16"), ("lenet_powersgd2", "torch_lenet_powersgd2")):
    print("mnist_mpi %s / PyTorch DDP %s: " % (ours, theirs) + ", ".join(
        "%s %.2f" % (l, float(train[(l, ours)]["images_per_s"]) / float(train[(l, theirs)]["images_per_s"]))
        for l in links if (l, ours) in train and (l, theirs) in train))
sums = [r for r in rows if r["kind"] == "sum"]
if sums:
    print("the communicator's sum of BYTES, ms (2 ranks):")
    sizes = list(dict.fromkeys(r["bytes"] for r in sums))
    print("%-10s" % "bytes" + "".join("%12s" % l for l in links))
    for b in sizes:
        print("%-10s" % b + "".join("%12s" % next((r["step_ms"] for r in sums if r["link"] == l and r["bytes"] == b), "-") for l in links))
PY
echo "network.sh: every number in $tsv"
