#!/usr/bin/env bash
# End-to-end tests of the program as a user runs it: --help and --version, a small 2-rank run and
# its metrics file, and every bad input of issue 2 (bad options, missing / corrupt data, batch
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
check unknown_option 2 "unrecognised option '--bogus'" -- "${run2[@]}" --bogus 1
check bad_value 2 "epochs" -- "${run2[@]}" "${base[@]}" --batch-size 10 --epochs abc
check no_batch_given 2 "exactly one of --batch-size" -- "${run2[@]}" "${base[@]}"
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
check bad_precision 2 "--precision must be fp32 or tf32" -- "${run2[@]}" "${base[@]}" --batch-size 10 --precision fp16
check missing_config 2 "cannot open '$work/nope.ini'" -- "${run2[@]}" --config "$work/nope.ini"
check missing_data_dir 3 "$work/missing.*fetch_mnist.sh" -- "${run2[@]}" --data-dir "$work/missing" --batch-size 10
check batch_larger_than_data 2 "larger than the training split" -- "${run2[@]}" "${base[@]}" --batch-size 400
check validation_too_large 2 "--validation-size 5000 must be >= 0 and < the training count 600" -- "${run2[@]}" --data-dir "$work/good" --batch-size 10
check accumulation_indivisible 2 "does not divide by the 2 ranks x 3 accumulation steps" -- "${run2[@]}" "${base[@]}" --global-batch-size 100 --accumulation-steps 3
check global_batch_indivisible 2 "does not divide by the 2 ranks" -- "${run2[@]}" "${base[@]}" --global-batch-size 101

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

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
