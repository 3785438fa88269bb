#!/usr/bin/env bash
# --optimizer lamb end to end (Note [LAMB in two phases] in include/mnist_mpi/train/optimizer.hpp)
# on synthetic data: lenet with dropout on 2 ranks trains to the same params_hash sharded, unsharded
# and with other buckets (a bucket, a shard and a tensor cut anywhere: the norms are exact); with
# --exact-sums the same params_hash on 1, 2 and 3 ranks; bf16 sharded = unsharded (on a CPU with
# AVX512_BF16); adam on the same runs differs (so the comparison can fail); 2N steps straight ==
# N + --resume auto + N, bitwise; and the refusals: a lamb checkpoint resumed by adam (and the
# other way), lamb with --cuda-graph.
# Usage: e2e_lamb.sh MNIST_MPI MAKE_SYNTHETIC_MNIST
set -uo pipefail
bin=$1 make_data=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$make_data" "$work/data" 1200 200 || { echo "cannot write synthetic data"; exit 1; }
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
fail() { failed=$((failed + 1)); echo "FAIL $1"; }
source "$here/e2e_lib.sh"  # expect()
lenet="conv:5x5:32:same,relu,maxpool:2,conv:5x5:64:same,relu,maxpool:2,flatten,fc:1024,relu,dropout:0.5,fc:10"
common=(--data-dir "$work/data" --validation-size 0 --model "$lenet" --global-batch-size 60 --log-every 0
        --eval-every 0 --seed 7)
lamb=(--optimizer lamb --lr 0.003)

# run NAME NP ARGS...: trains (lamb, 10 steps unless ARGS say otherwise), keeps the params_hash in
# $work/NAME ("none" when the run failed).
run() {
  local name=$1 np=$2
  shift 2
  local args=("$@")
  [[ " $* " == *" --optimizer "* ]] || args+=("${lamb[@]}")
  [[ " $* " == *" --max-steps "* ]] || args+=(--max-steps 10)
  if timeout 300 mpirun -np "$np" --oversubscribe "$bin" "${common[@]}" "${args[@]}" >"$work/$name.out" 2>&1; then
    grep -oE '^params_hash [0-9a-f]{16}' "$work/$name.out" | awk '{print $2}' >"$work/$name"
  else
    fail "$name: exit code $?"; tail -15 "$work/$name.out"; echo none >"$work/$name"
  fi
}
same() {  # same WHAT REFERENCE NAME...
  local what=$1 ref=$2
  shift 2
  local n
  for n in "$@"; do
    if [ "$(cat "$work/$ref")" = none ] || [ -z "$(cat "$work/$ref")" ]; then fail "$what: $ref gave no hash"
    elif [ "$(cat "$work/$n")" = "$(cat "$work/$ref")" ]; then ok "$what: $n = $ref ($(cat "$work/$n"))"
    else fail "$what: $n gives '$(cat "$work/$n")', $ref '$(cat "$work/$ref")'"; fi
  done
}

run sharded 2
run unsharded 2 --shard-optimizer off
run buckets 2 --bucket-mb 0.3 --first-bucket-mb 0.05
run no_overlap 2 --no-overlap
same "sharded or not, any buckets" sharded unsharded buckets no_overlap
run adam 2 --optimizer adam --lr 0.001
[ "$(cat "$work/adam")" != "$(cat "$work/sharded")" ] && ok "adam gives other parameters ($(cat "$work/adam"))" ||
  fail "adam gives lamb's parameters: the comparisons above prove nothing"

for np in 1 2 3; do run "exact_np$np" "$np" --exact-sums; done
run exact_np3_unsharded 3 --exact-sums --shard-optimizer off
same "--exact-sums on any number of ranks" exact_np1 exact_np2 exact_np3 exact_np3_unsharded

if grep -q avx512_bf16 /proc/cpuinfo; then
  run bf16_sharded 2 --precision bf16
  run bf16_unsharded 2 --precision bf16 --shard-optimizer off
  same "bf16 (the fc weights' copies written in the second phase)" bf16_sharded bf16_unsharded
else
  echo "bf16: not run (this CPU has no AVX512_BF16)"
fi

# Exact continuation: the moments, the step count and the weights are all a lamb step depends on.
run straight 2 --max-steps 20
run first_half 2 --max-steps 10 --checkpoint-dir "$work/ck"
run resumed 2 --max-steps 20 --checkpoint-dir "$work/ck" --resume auto
if grep -q "resuming from $work/ck/step-00000010.ckpt: step 10" "$work/resumed.out"; then
  same "20 steps straight == 10 + resume + 10" straight resumed
else fail "the resumed run did not resume from step 10"; tail -5 "$work/resumed.out"; fi

# Refusals: exit 4 for another optimiser's state, as for adam <-> sgd (e2e_hostile.sh); 2 for the pair.
expect lamb_checkpoint_resumed_by_adam 4 60 "holds lamb state, this run's --optimizer is adam" -- \
  mpirun -np 2 --oversubscribe "$bin" "${common[@]}" --optimizer adam --max-steps 20 --checkpoint-dir "$work/ck" \
  --resume auto
run adam_first 2 --optimizer adam --max-steps 10 --checkpoint-dir "$work/ck_adam"
expect adam_checkpoint_resumed_by_lamb 4 60 "holds adam state, this run's --optimizer is lamb" -- \
  mpirun -np 2 --oversubscribe "$bin" "${common[@]}" "${lamb[@]}" --max-steps 20 --checkpoint-dir "$work/ck_adam" \
  --resume auto
expect lamb_with_cuda_graph 2 30 "--optimizer lamb with --cuda-graph: .*drop --cuda-graph" -- \
  "$bin" "${common[@]}" "${lamb[@]}" --device cuda --cuda-graph

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
