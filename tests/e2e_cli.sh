#!/usr/bin/env bash
# End-to-end tests of the program as a user runs it: --help and --version, a small 2-rank run and
# its metrics file, and every bad input (bad options, missing / corrupt data, batch
# sizes): one clear message, the documented exit code on every rank, and no hang (timeouts).
# Usage: e2e_cli.sh MNIST_MPI MAKE_SYNTHETIC_MNIST REPO_ROOT
set -uo pipefail
bin=$1 make_data=$2 root=$3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$make_data" "$work/good" 600 100 || { echo "cannot write synthetic data"; exit 1; }
small="conv:3x3:4:same,relu,maxpool:2,flatten,fc:10"
passed=0 failed=0

# check NAME EXPECTED_CODE STDERR_PATTERN -- command...
check() {
  local name=$1 want=$2 pattern=$3
  shift 4
  local start=$SECONDS
  timeout 120 "$@" >"$work/out" 2>"$work/err"
  local rc=$? took=$((SECONDS - start))
  local ok=1
  if [ "$rc" -ne "$want" ]; then echo "FAIL $name: exit code $rc, expected $want"; ok=0; fi
  if [ -n "$pattern" ] && ! grep -qE -- "$pattern" "$work/err" "$work/out"; then
    echo "FAIL $name: output lacks /$pattern/"; ok=0
  fi
  if [ "$want" -ne 0 ]; then
    local n
    n=$(grep -c "mnist_mpi: error" "$work/err")
    if [ "$n" -ne 1 ]; then echo "FAIL $name: $n error lines on stderr, expected exactly 1"; ok=0; fi
    if [ "$took" -gt 30 ]; then echo "FAIL $name: took ${took}s to fail"; ok=0; fi
  fi
  if [ $ok -eq 1 ]; then
    passed=$((passed + 1)); echo "ok   $name (exit $rc, ${took}s)"
  else
    failed=$((failed + 1)); echo "---- stderr:"; head -20 "$work/err"; echo "---- stdout:"; tail -5 "$work/out"
  fi
}
run2=(mpirun -np 2 --oversubscribe "$bin")
base=(--data-dir "$work/good" --validation-size 100 --model "$small" --threads 1)

check help 0 "--batch-size arg \(=0\)" -- "$bin" --help
check help_lists_units 0 "images per rank per step" -- "$bin" --help
check version 0 "mnist_mpi [0-9]+\.[0-9]+" -- "$bin" --version
check config_files_parse 0 "batch: 100 global" -- "${run2[@]}" --config "$root/configs/lenet.ini" "${base[@]}" --max-steps 2 --log-every 1
check tiny_config_parses 0 "batch: 256 global, 128 per rank" -- "${run2[@]}" --config "$root/configs/tiny.ini" "${base[@]}" --max-steps 1
check fast_config_parses 0 "batch: 128 global, 64 per rank" -- "${run2[@]}" --config "$root/configs/fast.ini" "${base[@]}" --max-steps 1
check unknown_option 2 "unrecognised option '--bogus'" -- "${run2[@]}" --bogus 1
check bad_value 2 "epochs" -- "${run2[@]}" "${base[@]}" --batch-size 10 --epochs abc
check no_batch_given 0 "batch: 100 global, 50 per rank" -- "${run2[@]}" "${base[@]}" --max-steps 1  # lenet's recipe
check both_batches_given 2 "one of --batch-size \(per rank\) and --global-batch-size, not both" -- \
  "${run2[@]}" "${base[@]}" --batch-size 10 --global-batch-size 20
check bad_model_spec 2 "bad layer 'conv:3x3'" -- "${run2[@]}" --data-dir "$work/good" --validation-size 100 --batch-size 10 --model conv:3x3,fc:10
check bad_device 2 "--device must be" -- "${run2[@]}" "${base[@]}" --batch-size 10 --device tpu
# No GPU (CUDA_VISIBLE_DEVICES empty hides any there is): auto says why it runs on the CPU; cuda
# fails at once on every rank with one line in words (exit 6), in builds with or without CUDA.
nogpu=(env CUDA_VISIBLE_DEVICES= "${run2[@]}")
check device_auto_falls_back 0 "device auto: (this build has no CUDA backend|no usable GPU \\(.*\\)), running on the CPU" -- "${nogpu[@]}" "${base[@]}" --batch-size 10 --max-steps 1 --device auto
check cuda_unavailable 6 "error on rank 0 .*--device cuda: (no usable GPU on [^:]+: [a-z ]+|this build has no CUDA backend).*use --device cpu" -- "${nogpu[@]}" "${base[@]}" --batch-size 10 --device cuda
if grep -qE "cuda[A-Z][A-Za-z]+|CUDA call failed|error [0-9]+" "$work/err"; then
  failed=$((failed + 1)); echo "FAIL cuda_unavailable: the message shows CUDA error codes:"; cat "$work/err"
else passed=$((passed + 1)); echo "ok   cuda_unavailable message is in words: $(grep "mnist_mpi: error" "$work/err")"; fi
check bad_precision 2 "--precision must be fp32, tf32 or bf16" -- "${run2[@]}" "${base[@]}" --batch-size 10 --precision fp16
check missing_config 2 "--config '$work/nope.ini' does not exist" -- "${run2[@]}" --config "$work/nope.ini"
# Hostile input: a --config that is a directory was ignored (the run went on with the defaults);
# a FIFO blocked in open(). Class 8: a binary config wrote raw bytes, naming no file or line; a huge
# value or --model gave a line of its size. Class 7: non-finite option values were accepted.
mkdir "$work/dir.ini"
check config_is_a_directory 2 "--config '$work/dir.ini' is a directory, not a regular file" -- "${run2[@]}" --config "$work/dir.ini" "${base[@]}" --batch-size 10
mkfifo "$work/fifo.ini"
check config_is_a_fifo 2 "--config '$work/fifo.ini' is a FIFO \(named pipe\)" -- "${run2[@]}" --config "$work/fifo.ini" "${base[@]}" --batch-size 10
printf 'lr = 0.1\n\177ELF\002\001\001\000\000\033[2J = 1\n' >"$work/binary.ini"
check config_is_binary 2 "--config '$work/binary.ini' line 2: holds the control byte '\\\\x7f' at column 1" -- "${run2[@]}" --config "$work/binary.ini" "${base[@]}" --batch-size 10
long=$(head -c 100000 /dev/zero | tr '\0' 'q')
printf 'batch-size = 10\nepochs = %s\n' "$long" >"$work/long.ini"
check config_long_value 2 "--config '$work/long.ini' line 2: option 'epochs': the value 'qqq.*\\(99[0-9]{3} more bytes\\)" -- "${run2[@]}" --config "$work/long.ini"
check model_long_token 2 "model spec: bad layer 'qqq.*more bytes" -- "${run2[@]}" --data-dir "$work/good" --validation-size 100 --threads 1 --batch-size 10 --model "conv:3x3:4,$long,fc:10"
if awk 'length > 400 { found = 1 } END { exit !found }' "$work/err" || grep -q $'\033' "$work/err"; then
  failed=$((failed + 1)); echo "FAIL model_long_token: a line over 400 bytes or a raw escape byte on stderr"
else passed=$((passed + 1)); echo "ok   model_long_token message is short and escaped"; fi
check lr_inf 2 "--lr must be a finite number > 0, got inf" -- "${run2[@]}" "${base[@]}" --batch-size 10 --lr inf
check beta1_nan 2 "--beta1 must be in \\[0, 1\\), got nan" -- "${run2[@]}" "${base[@]}" --batch-size 10 --beta1 nan
check momentum_inf 2 "--momentum must be in \\[0, 1\\), got inf" -- "${run2[@]}" "${base[@]}" --batch-size 10 --optimizer sgd --momentum inf
# Class 4: a layer of 2.35e9 values per image segfaulted in init_params.
check model_over_32_bits 2 "layer 0 'conv:1:3000000' outputs 3000000x28x28 = 2352000000 values per image" -- "${run2[@]}" --data-dir "$work/good" --validation-size 100 --batch-size 10 --threads 1 --model conv:1:3000000,flatten,fc:10
check missing_data_dir 3 "$work/missing.*fetch_mnist.sh" -- "${run2[@]}" --data-dir "$work/missing" --batch-size 10
check batch_larger_than_data 2 "larger than the training split" -- "${run2[@]}" "${base[@]}" --batch-size 400
check validation_too_large 2 "--validation-size 5000 must be >= 0 and < the training count 600" -- "${run2[@]}" --data-dir "$work/good" --batch-size 10
# Note [Uneven slices]: a global batch that does not divide by the ranks (x accumulation steps) is
# split as evenly as it goes; only one smaller than the micro-batches is refused.
check global_batch_uneven 0 "batch: 101 global, 50-51 per rank" -- "${run2[@]}" "${base[@]}" --global-batch-size 101 --max-steps 3 --log-every 0
check accumulation_uneven 0 "batch: 100 global, 16-17 per rank" -- "${run2[@]}" "${base[@]}" --global-batch-size 100 --accumulation-steps 3 --max-steps 3 --log-every 0
check cuda_graph_on_cpu 2 "--cuda-graph needs --device cuda" -- "${run2[@]}" "${base[@]}" --batch-size 10 --cuda-graph --device cpu
check cuda_graph_with_timeline 2 "--timeline records each layer's host times, which a replayed CUDA graph does not have" -- "${run2[@]}" "${base[@]}" --batch-size 10 --cuda-graph --device cuda --timeline "$work/t.json"
if ! command -v nvidia-smi >/dev/null 2>&1; then  # a machine without GPUs: --device auto takes the CPU
  check cuda_graph_auto_without_gpu 2 "--cuda-graph needs a GPU, and --device auto found none" -- "${run2[@]}" "${base[@]}" --batch-size 10 --cuda-graph --device auto
fi
# Note [Choosing cuDNN algorithms] (src/backend/cuda/conv.cpp): refused with --device cpu; with
# --device auto on the CPU rank 0's table (of -1s, nothing timed) still goes to every rank when
# training starts (the same collective as on a GPU) and changes nothing: the heuristic run's bits.
check conv_algos_on_cpu 2 "--conv-algos measured times cuDNN's algorithms, and --device cpu has none" -- "${run2[@]}" "${base[@]}" --batch-size 10 --conv-algos measured
check conv_algos_bad 2 "--conv-algos must be heuristic or measured, got 'fastest'" -- "${run2[@]}" "${base[@]}" --batch-size 10 --conv-algos fastest
check conv_algos_measured_on_the_cpu 0 "running on the CPU" -- "${nogpu[@]}" "${base[@]}" --batch-size 10 --max-steps 3 --device auto --conv-algos measured
measured_hash=$(grep -oE "params_hash [0-9a-f]+" "$work/out")
check conv_algos_heuristic_on_the_cpu 0 "running on the CPU" -- "${nogpu[@]}" "${base[@]}" --batch-size 10 --max-steps 3 --device auto
heuristic_hash=$(grep -oE "params_hash [0-9a-f]+" "$work/out")
if [ -n "$measured_hash" ] && [ "$measured_hash" = "$heuristic_hash" ]; then
  passed=$((passed + 1)); echo "ok   conv_algos measured on the CPU changes nothing ($measured_hash)"
else
  failed=$((failed + 1)); echo "FAIL conv_algos measured on the CPU: '$measured_hash' against '$heuristic_hash'"
fi
check global_batch_below_ranks 2 "--global-batch-size 1 is smaller than the 2 ranks: every micro-batch needs at least one image; give at least 2" -- "${run2[@]}" "${base[@]}" --global-batch-size 1
check accumulation_below_parts 2 "--global-batch-size 5 is smaller than the 2 ranks x 3 accumulation steps" -- "${run2[@]}" "${base[@]}" --global-batch-size 5 --accumulation-steps 3

corrupt() {  # corrupt NAME: a fresh copy of the good data in $work/NAME
  rm -rf "${work:?}/$1"; cp -r "$work/good" "$work/$1"; echo "$work/$1"
}
d=$(corrupt truncated); head -c 100000 "$work/good/train-images-idx3-ubyte" >"$d/train-images-idx3-ubyte"
check truncated_images 3 "train-images-idx3-ubyte.*truncated" -- "${run2[@]}" --data-dir "$d" --batch-size 10
d=$(corrupt badmagic); printf '\x00\x00\x08\x04' | dd of="$d/t10k-images-idx3-ubyte" bs=1 seek=0 conv=notrunc status=none
check bad_magic 3 "t10k-images-idx3-ubyte.*magic" -- "${run2[@]}" --data-dir "$d" --batch-size 10
d=$(corrupt badlabel); printf '\x0c' | dd of="$d/train-labels-idx1-ubyte" bs=1 seek=11 conv=notrunc status=none
check label_out_of_range 3 "label 12 at index 3 is out of range" -- "${run2[@]}" --data-dir "$d" --batch-size 10
d=$(corrupt mismatch); "$make_data" "$work/other" 500 100; cp "$work/other/train-labels-idx1-ubyte" "$d/"
check count_mismatch 3 "600.*500|500.*600" -- "${run2[@]}" --data-dir "$d" --batch-size 10
d=$(corrupt missingfile); rm "$d/t10k-labels-idx1-ubyte"
check missing_file 3 "t10k-labels-idx1-ubyte.*fetch_mnist.sh" -- "${run2[@]}" --data-dir "$d" --batch-size 10
# Hostile input: what is there in place of an MNIST file is said, not "not found ... fetch it".
d=$(corrupt fifo); rm "$d/train-images-idx3-ubyte"; mkfifo "$d/train-images-idx3-ubyte"
check data_file_is_a_fifo 3 "MNIST file '$d/train-images-idx3-ubyte' is a FIFO \(named pipe\), not a regular file; replace it" -- "${run2[@]}" --data-dir "$d" --batch-size 10
d=$(corrupt devzero); rm "$d/t10k-images-idx3-ubyte"; ln -s /dev/zero "$d/t10k-images-idx3-ubyte"
check data_file_is_dev_zero 3 "t10k-images-idx3-ubyte' is a symbolic link to a character device \('/dev/zero'\)" -- "${run2[@]}" --data-dir "$d" --batch-size 10
check data_dir_is_a_file 3 "MNIST data directory '$work/good/t10k-labels-idx1-ubyte' is a regular file, not a directory" -- "${run2[@]}" --data-dir "$work/good/t10k-labels-idx1-ubyte" --batch-size 10
d=$(corrupt gz); gzip "$d"/*-ubyte
check gzipped_data_trains 0 "test accuracy" -- "${run2[@]}" --data-dir "$d" --validation-size 100 --model "$small" --threads 1 --batch-size 10 --max-steps 5

# A small run: the metrics file holds step, eval and final events with every field.
check metrics_run 0 "params_hash [0-9a-f]{16}" -- "${run2[@]}" "${base[@]}" --batch-size 25 --epochs 2 --log-every 5 --eval-every 10 --metrics-file "$work/m.jsonl"
for pat in '"event":"step".*"loss":' '"event":"eval","split":"validation"' '"event":"eval","split":"test"' \
           '"event":"final","test_accuracy":[0-9.]+,"test_loss":[0-9.]+,"steps":20,"epochs":2,"world_size":2,"global_batch":50,"wall_s":[0-9.]+,"images_per_s":[0-9.]+' \
           '"params_hash":"[0-9a-f]{16}"'; do
  if grep -qE "$pat" "$work/m.jsonl"; then passed=$((passed + 1)); echo "ok   metrics has /$pat/"
  else failed=$((failed + 1)); echo "FAIL metrics lacks /$pat/"; cat "$work/m.jsonl"; fi
done
# The same run again gives bitwise the same model (everything is seeded).
h1=$(grep -oE '"params_hash":"[0-9a-f]+"' "$work/m.jsonl")
"${run2[@]}" "${base[@]}" --batch-size 25 --epochs 2 --log-every 0 --quiet --metrics-file "$work/m2.jsonl" >/dev/null 2>&1
h2=$(grep -oE '"params_hash":"[0-9a-f]+"' "$work/m2.jsonl")
if [ -n "$h1" ] && [ "$h1" = "$h2" ]; then passed=$((passed + 1)); echo "ok   rerun is bitwise identical ($h1)"
else failed=$((failed + 1)); echo "FAIL rerun differs: $h1 vs $h2"; fi

# --target-accuracy (Note [Stopping at a target accuracy] in src/train/trainer.cpp): the run ends
# at the first validation check that reaches the target, on every rank; one that never reaches it
# runs to its end; a value outside [0, 1], or a target without a validation split, is a usage error.
check target_out_of_range 2 "--target-accuracy must be a fraction in \\[0, 1\\] \\(0 = off\\), got 1.5" -- "${run2[@]}" "${base[@]}" --batch-size 25 --target-accuracy 1.5
check target_negative 2 "--target-accuracy must be a fraction in \\[0, 1\\] \\(0 = off\\), got -0.1" -- "${run2[@]}" "${base[@]}" --batch-size 25 --target-accuracy=-0.1
check target_needs_validation 2 "--target-accuracy is checked on the validation split" -- "${run2[@]}" --data-dir "$work/good" --validation-size 0 --model "$small" --threads 1 --batch-size 25 --target-accuracy 0.5
check target_reached 0 "target accuracy 0.5000 reached after [0-9]+ steps" -- "${run2[@]}" "${base[@]}" --batch-size 25 --epochs 5 --weight-init xavier --lr 0.01 --log-every 0 --eval-every 2 --target-accuracy 0.5 --metrics-file "$work/t.jsonl"
check target_not_reached 0 "target accuracy 0.9000 not reached" -- "${run2[@]}" "${base[@]}" --batch-size 25 --epochs 1 --lr 1e-9 --log-every 0 --eval-every 2 --target-accuracy 0.9 --metrics-file "$work/t0.jsonl"
# The stop falls at the first check at or above the target, and the final event says where; the
# run that never reached it ran all its steps, with a validation check every 2 of them.
if verdict=$(/usr/bin/python3 - "$work/t.jsonl" 0.5 50 "$work/t0.jsonl" 0.9 10 <<'PY'
import json, sys
def read(path):
    ev = [json.loads(l) for l in open(path) if l.strip()]
    return [e for e in ev if e.get("event") == "eval" and e.get("split") == "validation"], \
           next(e for e in ev if e.get("event") == "final")
checks, final = read(sys.argv[1])
target, steps = float(sys.argv[2]), int(sys.argv[3])
first = next((c for c in checks if c["accuracy"] >= target), None)
t = final["target"]
assert first is not None, f"no validation check reached {target}: {checks}"
assert checks[-1] is first, f"checks went on after the one that reached the target: {checks}"
assert t["reached"] and t["step"] == first["step"] == final["steps"] < steps, f"target {t}, final steps {final['steps']}"
assert t["validation_accuracy"] == first["accuracy"] and t["time_from_process_start_s"] > 0, t
assert all(c["step"] % 2 == 0 for c in checks), checks
checks, final = read(sys.argv[4])
target, steps = float(sys.argv[5]), int(sys.argv[6])
t = final["target"]
assert not t["reached"] and t["step"] is None and final["steps"] == steps, (t, final["steps"])
assert [c["step"] for c in checks] == list(range(2, steps + 1, 2)), checks
assert all(c["accuracy"] < target for c in checks), checks
print(f"stopped at step {first['step']} of {int(sys.argv[3])}; the unreachable target ran all {steps} steps")
PY
); then passed=$((passed + 1)); echo "ok   target accuracy: $verdict"
else failed=$((failed + 1)); echo "FAIL target accuracy: $verdict"; cat "$work/t.jsonl" "$work/t0.jsonl"; fi

# Note [A singleton's own session directory]: a run without mpirun keeps out of Open MPI's shared
# session tree (<tmp>/ompi.<host>.<uid>) and removes its own. The shared tree's name is taken by a
# plain file here, so a run that used it would fail in MPI_Init (measured before the change: exit
# 1, "A call to mkdir was unable to create the desired directory").
tmp_here="$work/tmpdir"
mkdir -p "$tmp_here"
touch "$tmp_here/ompi.$(hostname | cut -d. -f1).$(id -u)"
check singleton_own_session_tree 0 "params_hash" -- env -u OMPI_MCA_orte_tmpdir_base TMPDIR="$tmp_here" \
  "$bin" "${base[@]}" --batch-size 10 --max-steps 1
left=$(find "$tmp_here" -mindepth 1 ! -name 'ompi.*' | head -5)
if [ -z "$left" ]; then passed=$((passed + 1)); echo "ok   the singleton's session tree is removed at exit"
else failed=$((failed + 1)); echo "FAIL the singleton left in its TMPDIR: $left"; fi

# --precision bf16 (Note [bf16 on the CPU] in src/backend/cpu/cpu_backend.cpp): where the CPU has
# bf16 instructions the fc layers (and convolutions after the first) say they run bf16 kernels, the
# ranks stay identical (a replica check every step), and an fp32 checkpoint resumes in bf16; where
# it has none, the run is refused at set-up. Refused with --exact-sums either way.
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  check bf16_runs_bf16_kernels 0 "layer 4 fc:10 .*: bf16 fc fwd" -- "${run2[@]}" "${base[@]}" --precision bf16 --max-steps 4 \
    --check-replicas-every 1 --checkpoint-dir "$work/bf16ck" --checkpoint-every 4
  "${run2[@]}" "${base[@]}" --max-steps 2 --checkpoint-dir "$work/fp32ck" --checkpoint-every 2 >/dev/null 2>&1
  check bf16_resumes_an_fp32_checkpoint 0 "precision fp32 -> bf16" -- "${run2[@]}" "${base[@]}" --precision bf16 \
    --max-steps 4 --resume auto --checkpoint-dir "$work/fp32ck" --checkpoint-every 2
  # Note [Weight copies kept between passes] (src/backend/cpu/bf16.cpp): the bf16 copies of the
  # weights are refreshed where the update and the gathers change them, and not made again by the
  # next pass. Sharded, with buckets of 1 KB that cut the weight tensors apart, each rank refreshes
  # its shards after the update and the others' after the gathers: the unsharded run's bits.
  bf16_base=(--data-dir "$work/good" --validation-size 100 --threads 1 --precision bf16
    --model "conv:5x5:16:same,relu,maxpool:2,conv:3x3:16:same,relu,maxpool:2,flatten,fc:32,fc:10")
  check bf16_copies_unsharded 0 "layer 7 fc:32 .*: bf16 fc fwd" -- "${run2[@]}" "${bf16_base[@]}" --max-steps 12 \
    --shard-optimizer off
  unsharded=$(grep -ho 'params_hash [0-9a-f]*' "$work/out" "$work/err" | head -1 | cut -d' ' -f2)
  # The test evaluation too (its batches after the first keep the copies of the first).
  tested=$(grep -ho 'test accuracy [0-9.]* loss [0-9.]*' "$work/out" "$work/err" | head -1)
  check bf16_copies_sharded_in_small_buckets 0 "params_hash ${unsharded:-none}" -- "${run2[@]}" "${bf16_base[@]}" \
    --max-steps 12 --shard-optimizer on --bucket-mb 0.001 --first-bucket-mb 0.001
  grep -hq "${tested:-no test line}" "$work/out" "$work/err" ||
    { failed=$((failed + 1)); echo "FAIL bf16_copies_sharded_in_small_buckets: not the unsharded run's ${tested:-test line}"; }
  # Not vacuous: 1 KB buckets cut the tensors apart (fc:32 alone has 25 K weights): more buckets than the 8 tensors.
  buckets=$(grep -ho 'gradients: [0-9]* bucket' "$work/out" "$work/err" | head -1 | grep -o '[0-9]*')
  [ "${buckets:-0}" -gt 8 ] ||
    { failed=$((failed + 1)); echo "FAIL bf16_copies_sharded_in_small_buckets: ${buckets:-no} buckets, not more than the 8 tensors"; }
  # An evaluation's first batch makes its copies anew: with evaluations at steps 4 and 8 before it,
  # the final test evaluation still reads the final weights (stale copies would give step 8's).
  check bf16_evaluation_copies 0 "params_hash ${unsharded:-none}" -- "${run2[@]}" "${bf16_base[@]}" --max-steps 12 \
    --shard-optimizer off --eval-every 4
  grep -hq "${tested:-no test line}" "$work/out" "$work/err" ||
    { failed=$((failed + 1)); echo "FAIL bf16_evaluation_copies: not the run's ${tested:-test line} without evaluations before"; }
  # A resumed bf16 run makes its copies anew at its first pass, with the rounding the optimiser's
  # copies had: the bits of the run that never stopped.
  "${run2[@]}" "${bf16_base[@]}" --max-steps 6 --shard-optimizer off --checkpoint-dir "$work/bf16resume" \
    --checkpoint-every 6 >/dev/null 2>&1
  check bf16_resume_keeps_the_bits 0 "params_hash ${unsharded:-none}" -- "${run2[@]}" "${bf16_base[@]}" \
    --max-steps 12 --shard-optimizer off --checkpoint-dir "$work/bf16resume" --resume auto
  grep -q "resuming from .*: step 6," "$work/out" "$work/err" ||
    { failed=$((failed + 1)); echo "FAIL bf16_resume_keeps_the_bits: the run did not resume from step 6"; }
else
  check bf16_refused_without_bf16_instructions 2 "needs a CPU with bf16 multiply instructions" -- \
    "${run2[@]}" "${base[@]}" --precision bf16 --max-steps 1
fi
check bf16_with_exact_sums_refused 2 "exact sums run the fp32 kernels only" -- \
  "${run2[@]}" "${base[@]}" --precision bf16 --exact-sums --max-steps 1
check exact_sums_with_cuda_graph_refused 2 "exact-sums with --cuda-graph: .* drop --cuda-graph" -- \
  "${run2[@]}" "${base[@]}" --exact-sums --cuda-graph --max-steps 1
check exact_sums_with_measured_algorithms_refused 2 "exact-sums with --conv-algos measured: .*drop --conv-algos measured" -- \
  "${run2[@]}" "${base[@]}" --exact-sums --device cuda --conv-algos measured --max-steps 1

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
