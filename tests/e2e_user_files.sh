#!/usr/bin/env bash
# User files, end to end: nothing the user gave is destroyed, and a first run with no options
# trains lenet on the data it finds.
#  1. An output that names an input (or another output), by name, through a link, or named like a
#     file the checkpointer writes: exit 2 on every rank, both options named, the input untouched
#     (Note [No output is an input] in include/mnist_mpi/io/file_roles.hpp).
#  2. A result that cannot be written is not a success: predict and evaluate on a full disk, export
#     over a read-only file (Note [A read-only output is not replaced]).
#  3. Closed standard descriptors (Note [Closed standard descriptors]).
#  4. The same data on every rank: contents compared, not sizes (Note [The same data on every rank]).
#  5. A product of options out of range names every factor.
#  6. Commands, a stray word, and the data found without --data-dir (Note [Where the data is found]).
# The literal `mpirun -np 2 ./mnist_mpi` on real MNIST is in tests/e2e_real_mnist.sh.
# Usage: e2e_user_files.sh MNIST_MPI MAKE_SYNTHETIC_MNIST
set -uo pipefail
bin=$(realpath "$1") make_data=$(realpath "$2") here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset MNIST_MPI_DATA_DIR
work=$(mktemp -d)
trap 'kill -KILL $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
"$make_data" "$work/data" 600 100 >/dev/null || { echo "cannot write synthetic data"; exit 1; }
cd "$work" || exit 1
small="conv:3x3:4:same,relu,maxpool:2,flatten,fc:10"
opts=(--validation-size 100 --threads 1 --log-every 0 --model "$small")
base=(--data-dir "$work/data" "${opts[@]}" --batch-size 10)
passed=0 failed=0
source "$here/e2e_lib.sh"  # expect()
run2=(mpirun -np 2 --oversubscribe "$bin")
job=("${run2[@]}" "${base[@]}")
fail() { echo "FAIL $1"; failed=$((failed + 1)); }
digest() { sha256sum <"$1"; }
# untouched NAME FILE DIGEST: the file still holds what it held.
untouched() { [ -f "$2" ] && [ "$(digest "$2")" = "$3" ] || fail "$1: '$2' was changed or removed"; }

"${job[@]}" --max-steps 10 --checkpoint-dir ck >/dev/null 2>&1 || fail "could not write the checkpoint ck"
ckpt=ck/step-00000010.ckpt

# 1. Outputs that name inputs or other outputs.
f=data/train-images-idx3-ubyte; d=$(digest $f)
expect metrics_file_is_the_training_images 2 30 \
  "error on rank 0 .*--metrics-file '$f' and --data-dir \(the training images\) '$work/$f' are the same file: writing the output would destroy the input" -- \
  "${job[@]}" --max-steps 5 --metrics-file $f
untouched metrics_file_is_the_training_images $f "$d"
f=data/train-labels-idx1-ubyte; d=$(digest $f); ln -s $f labels.json
expect timeline_through_a_symbolic_link 2 30 \
  "--timeline 'labels.json' and --data-dir \(the training labels\) '$work/$f' are the same file" -- \
  "${job[@]}" --max-steps 5 --timeline labels.json
untouched timeline_through_a_symbolic_link $f "$d"
f=data/t10k-images-idx3-ubyte; d=$(digest $f); ln $f hard.html
expect report_through_a_hard_link 2 30 "--report 'hard.html' and --data-dir \(the test images\) .* are the same file" -- \
  "${job[@]}" --max-steps 5 --report hard.html
untouched report_through_a_hard_link $f "$d"
d=$(digest $ckpt)
expect report_is_the_resumed_checkpoint 2 30 "--report and --resume both name '$ckpt'" -- \
  "${job[@]}" --max-steps 20 --resume $ckpt --report $ckpt
expect report_is_the_newest_checkpoint 2 30 \
  "--report and --checkpoint-dir \(its checkpoint step-00000010.ckpt\) both name '$ckpt'" -- \
  "${job[@]}" --max-steps 20 --checkpoint-dir ck --resume auto --report $ckpt
untouched report_is_the_newest_checkpoint $ckpt "$d"
printf 'max-steps = 5\n' >run.ini; d=$(digest run.ini)
expect metrics_file_is_the_config 2 30 "--metrics-file and --config both name 'run.ini'" -- \
  "${job[@]}" --config run.ini --metrics-file run.ini
untouched metrics_file_is_the_config run.ini "$d"
expect timeline_and_report_on_one_file 2 30 "--timeline and --report both name 'same.json': one output would replace the other" -- \
  "${job[@]}" --max-steps 5 --timeline same.json --report same.json
[ ! -e same.json ] || fail "timeline_and_report_on_one_file: the file was created"
expect metrics_file_named_like_a_coming_checkpoint 2 30 \
  "--metrics-file 'ck/step-00000020.ckpt' is a name that --checkpoint-dir 'ck' writes or removes" -- \
  "${job[@]}" --max-steps 20 --checkpoint-dir ck --resume auto --metrics-file ck/step-00000020.ckpt
[ ! -e ck/step-00000020.ckpt ] || fail "metrics_file_named_like_a_coming_checkpoint: the file was created"
cp run.ini ck/step-00000030.ckpt.tmp  # what the checkpointer removes at start as a write that did not finish
expect config_named_like_a_checkpoint_temporary 2 30 \
  "--config 'ck/step-00000030.ckpt.tmp' is a name that --checkpoint-dir 'ck' writes or removes .*the run would destroy it" -- \
  "${job[@]}" --checkpoint-dir ck --config ck/step-00000030.ckpt.tmp
untouched config_named_like_a_checkpoint_temporary ck/step-00000030.ckpt.tmp "$d"
rm ck/step-00000030.ckpt.tmp
d=$(digest ck/.mnist_mpi.lock)
expect metrics_file_is_the_lock_file 2 30 "--metrics-file and --checkpoint-dir \(its lock file\) both name 'ck/.mnist_mpi.lock'" -- \
  "${job[@]}" --max-steps 20 --checkpoint-dir ck --resume auto --metrics-file ck/.mnist_mpi.lock
untouched metrics_file_is_the_lock_file ck/.mnist_mpi.lock "$d"
cp $ckpt ck/step-00000040.ckpt.tmp; d=$(digest ck/step-00000040.ckpt.tmp)  # a copy, named like a leftover temporary
expect resume_from_a_name_the_checkpointer_removes 2 30 \
  "--resume 'ck/step-00000040.ckpt.tmp' is a name that --checkpoint-dir 'ck' writes or removes .*the run would destroy it" -- \
  "${job[@]}" --max-steps 50 --checkpoint-dir ck --resume ck/step-00000040.ckpt.tmp
untouched resume_from_a_name_the_checkpointer_removes ck/step-00000040.ckpt.tmp "$d"
rm ck/step-00000040.ckpt.tmp
expect metrics_file_named_like_a_tensorboard_file 2 30 "is a name that --tensorboard-dir 'tb' writes" -- \
  "${job[@]}" --max-steps 5 --tensorboard-dir tb --metrics-file tb/events.out.tfevents.1.x
expect resume_auto_still_finds_the_newest 0 60 "resuming from ck/step-00000010.ckpt: step 10" -- \
  "${job[@]}" --max-steps 12 --checkpoint-dir ck --resume auto
expect outputs_on_dev_null_share_it 0 60 "params_hash" -- \
  "${job[@]}" --max-steps 5 --metrics-file /dev/null --timeline /dev/null --report /dev/null
d=$(digest $ckpt)
expect export_onto_a_checkpoint_of_its_directory 2 30 "--onnx and --checkpoint \(its step-00000010.ckpt\) both name '$ckpt'" -- \
  "$bin" export --checkpoint ck --onnx $ckpt
untouched export_onto_a_checkpoint_of_its_directory $ckpt "$d"
f=data/t10k-labels-idx1-ubyte; d=$(digest $f)
expect logits_onto_the_test_labels 2 30 "--logits-file and --data-dir \(the test labels\) both name '$f'" -- \
  "$bin" evaluate --checkpoint ck --data-dir data --logits-file $f
untouched logits_onto_the_test_labels $f "$d"
{ printf 'P5\n28 28\n255\n'; head -c 784 /dev/urandom; } >0.pgm; d=$(digest 0.pgm)
expect prepared_image_onto_its_input 2 30 "--save-prepared './0.pgm' and an image argument '0.pgm' are the same file" -- \
  "$bin" predict --checkpoint ck --save-prepared . 0.pgm
untouched prepared_image_onto_its_input 0.pgm "$d"

# 2. A result that cannot be written is not a success (exit 7, said once, naming the errno).
expect predict_stdout_on_a_full_disk 7 30 "cannot write standard output '/dev/full': write: No space left on device" -- \
  bash -c '"$0" predict --checkpoint ck 0.pgm >/dev/full' "$bin"
[ "$(grep -c "cannot write standard output" "$work/out")" = 1 ] || fail "predict_stdout_on_a_full_disk: said more than once"
expect evaluate_stdout_on_a_full_disk 7 60 "cannot write standard output '/dev/full': write: No space left on device" -- \
  bash -c '"$0" evaluate --checkpoint ck --data-dir data >/dev/full' "$bin"
echo "keep me" >ro.onnx; chmod a-w ro.onnx; d=$(digest ro.onnx)
expect export_over_a_read_only_file 7 30 "ONNX file 'ro.onnx' is read-only .*so it is not replaced" -- \
  "$bin" export --checkpoint ck --onnx ro.onnx
untouched export_over_a_read_only_file ro.onnx "$d"
echo "keep me" >ro.json; chmod a-w ro.json; d=$(digest ro.json)
expect report_over_a_read_only_file 2 30 "--report 'ro.json' is read-only" -- "${job[@]}" --max-steps 5 --report ro.json
untouched report_over_a_read_only_file ro.json "$d"

# 3. Closed standard descriptors: opened on /dev/null first, so nothing of ours lands in a pipe
#    or a file that took the number; a closed stdout is still a lost output (exit 7).
expect train_with_stdout_closed 7 60 "cannot write standard output \(progress and summary\) 'descriptor 1': it was closed" -- \
  bash -c 'exec "$0" "$@" >&-' "$bin" "${base[@]}" --max-steps 5
grep -q "pipe:\[" "$work/out" && fail "train_with_stdout_closed: a message names a pipe that took descriptor 1"
expect predict_with_stdout_closed 7 30 "cannot write standard output: it was closed when the program started" -- \
  bash -c 'exec "$0" "$@" >&-' "$bin" predict --checkpoint ck 0.pgm
# (That each closed descriptor really becomes /dev/null: StandardStreams.* in tests/test_file_roles.cpp.)
expect train_runs_with_stdin_and_stderr_closed 0 60 "params_hash" -- \
  bash -c 'exec "$0" "$@" <&- 2>&-' "$bin" "${base[@]}" --max-steps 5

# 4. The same data on every rank: contents, not sizes. A copy elsewhere, or gzipped, is the same data.
cp -r data data_copy; cp -r data data_gz; gzip data_gz/train-images-idx3-ubyte  # named data_*: expect() finds ranks left behind
expect same_data_in_other_directories 0 60 "params_hash" -- \
  mpirun -np 1 "$bin" "${base[@]}" --max-steps 5 : -np 1 "$bin" "${opts[@]}" --batch-size 10 --data-dir "$work/data_gz" --max-steps 5
python3 - data_copy/train-images-idx3-ubyte <<'EOF'  # one pixel of one image, made different
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(16 + 784 * 42 + 400)
    b = f.read(1)[0]
    f.seek(16 + 784 * 42 + 400)
    f.write(bytes([(b + 1) % 256]))
EOF
expect one_pixel_differs_on_one_rank 3 30 \
  "the training images \(train-images-idx3-ubyte\) differ: rank 0 \(host '[^']+'\) has [0-9a-f]{16}, rank 1 \(host '[^']+'\) has [0-9a-f]{16}" -- \
  mpirun -np 1 "$bin" "${base[@]}" --max-steps 5 : -np 1 "$bin" "${opts[@]}" --batch-size 10 --data-dir "$work/data_copy" --max-steps 5

# 5. A product of options out of range names every factor and a fix that can work.
nobatch=(--data-dir "$work/data" "${opts[@]}")
expect accumulation_too_large_for_the_global_batch 2 30 \
  "--global-batch-size 100 is smaller than the 2 ranks x 1000000000 accumulation steps \(--accumulation-steps 1000000000\).*lower --accumulation-steps to at most 50 with 2 ranks" -- \
  "${run2[@]}" "${nobatch[@]}" --global-batch-size 100 --accumulation-steps 1000000000
expect per_rank_batch_times_accumulation_too_large 2 30 \
  "the global batch of 100000000000 images \(--batch-size 50 x 2 ranks x --accumulation-steps 1000000000\) is larger than the training split \(500 images\); lower --batch-size or --accumulation-steps, or use fewer ranks" -- \
  "${run2[@]}" "${nobatch[@]}" --batch-size 50 --accumulation-steps 1000000000

# 6. Commands, stray words, and where the data is found.
expect not_a_command 2 30 "'evalute' is not a command or an option of mnist_mpi .*train \(the default\), evaluate, export, predict" -- \
  "$bin" evalute --checkpoint ck
expect stray_word_on_two_ranks 2 30 "error on rank 0 .*'stray' is not a command or an option" -- \
  "${job[@]}" --max-steps 5 stray
expect help_lists_the_commands 0 30 "predict +classify digit images" -- "$bin" --help
expect train_is_the_default_command 0 60 "params_hash" -- "$bin" train "${base[@]}" --max-steps 2
expect data_from_the_environment 0 60 "test images from $work/data" -- \
  env MNIST_MPI_DATA_DIR="$work/data" "$bin" "${opts[@]}" --max-steps 2
mkdir -p inner/data && ln -s "$work/data" inner/data/mnist
expect data_under_the_current_directory 0 60 "test images from data/mnist" -- \
  bash -c 'cd inner && exec "$0" "$@"' "$bin" "${opts[@]}" --max-steps 2
mkdir empty
expect data_variable_naming_no_data 3 30 "MNIST_MPI_DATA_DIR is '$work/empty', which holds none of the four MNIST files" -- \
  env MNIST_MPI_DATA_DIR="$work/empty" "$bin" "${opts[@]}" --max-steps 2
expect show_config_needs_no_data 0 30 "options of the run that wrote it" -- \
  env MNIST_MPI_DATA_DIR="$work/empty" "$bin" evaluate --checkpoint ck --show-config
expect default_recipe_and_rss_per_rank 0 60 \
  "batch: 100 global, 50 per rank.*|peak RSS per rank [0-9]+\.[0-9], [0-9]+\.[0-9] MB" -- \
  "${run2[@]}" "${nobatch[@]}" --max-steps 2
grep -q "batch: 100 global, 50 per rank" "$work/out" || fail "default_recipe_and_rss_per_rank: not lenet's global batch of 100"
grep -qE "peak RSS per rank [0-9]+\.[0-9], [0-9]+\.[0-9] MB" "$work/out" || fail "default_recipe_and_rss_per_rank: RSS not in words"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
