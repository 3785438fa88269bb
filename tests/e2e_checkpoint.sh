#!/usr/bin/env bash
# End-to-end tests of checkpoints, resuming and preemption, with the program as a user
# runs it: exact continuation (tiny, lenet with dropout, and batch norm with its running
# statistics: 2N steps straight == N + resume + N, bitwise), resuming on another number of ranks, signals on a rank and on mpirun (exit 75, then
# --resume auto), every bad checkpoint (exit 4 on every rank, one message naming the file), failed
# and killed writes (the previous checkpoint survives), retention, and `mnist_mpi evaluate`.
# Usage: e2e_checkpoint.sh MNIST_MPI MAKE_SYNTHETIC_MNIST REPO_ROOT
set -uo pipefail
bin=$1 make_data=$2 root=$3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
py=/usr/bin/python3  # Debian's python3 with python3-numpy (scripts/setup.sh)
reader=$root/scripts/read_checkpoint.py
work=$(mktemp -d)
immutable=""
trap '[ -n "$immutable" ] && chattr -i "$immutable" 2>/dev/null; rm -rf "$work"' EXIT
cd "$work" || exit 1
"$make_data" data 600 100 >/dev/null || { echo "cannot write synthetic data"; exit 1; }
"$py" -c 'import numpy' || { echo "FAIL: $py has no numpy (scripts/setup.sh installs python3-numpy)"; exit 1; }
small="conv:3x3:4:same,relu,maxpool:2,flatten,fc:32,relu,dropout:0.5,fc:10"
base=(--data-dir data --validation-size 100 --threads 1 --log-every 0)
sm=("${base[@]}" --model "$small" --global-batch-size 20)  # 500 training images: 25 steps per epoch
run2=(mpirun -np 2 --oversubscribe)
passed=0 failed=0

ok() { passed=$((passed + 1)); echo "ok   $1 [${SECONDS}s]"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; [ -f out ] && { echo "---- stdout:"; tail -5 out; }; [ -f err ] && { echo "---- stderr:"; head -8 err; }; }
hash_of() { grep -oE 'params_hash [0-9a-f]{16}' "$1" | awk '{print $2}'; }

# Runs a command (timeout 120 s) with stdout in out, stderr in err; sets rc.
run() { timeout 120 "$@" >out 2>err; rc=$?; }

# expect_fail NAME CODE PATTERN -- command: exit CODE, exactly one error line matching PATTERN.
expect_fail() {
  local name=$1 want=$2 pattern=$3
  shift 4
  run "$@"
  local n
  n=$(grep -c "mnist_mpi: error" err)
  if [ "$rc" -eq "$want" ] && [ "$n" -eq 1 ] && grep -qE -- "$pattern" err; then ok "$name (exit $rc)"
  else bad "$name: exit $rc (want $want), $n error lines, pattern /$pattern/"; fi
}

# A wrapper for one rank: records its pid and exit code in $STATE, forwards signals to it.
cat >rank.sh <<'EOF'
#!/bin/bash
r=${OMPI_COMM_WORLD_RANK:-0}
"$@" &
child=$!
echo "$child" >"$STATE/pid.$r"
for s in TERM INT USR1; do trap "kill -$s $child" $s; done
while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; done
echo "$rc" >"$STATE/code.$r"
exit "$rc"
EOF
chmod +x rank.sh
export STATE=$work/state
# Every rank's own exit code is checked after a peer failed: mpirun gives the others its default
# second between SIGTERM and SIGKILL (the suite sets 0, tests/CMakeLists.txt).
export OMPI_MCA_odls_base_sigkill_timeout=1
fresh_state() { rm -rf "$STATE"; mkdir -p "$STATE"; }
codes() { cat "$STATE"/code.* 2>/dev/null | sort | tr '\n' ' '; }
wait_for() {  # wait_for FILE_GLOB SECONDS
  local i
  for ((i = 0; i < $2 * 50; i++)); do compgen -G "$1" >/dev/null && return 0; sleep 0.02; done
  return 1
}

# ---- exact continuation ------------------------------------------------------------------------
exact() {  # exact NAME STEPS ARGS...: 2*STEPS straight == STEPS + --resume auto + STEPS, bitwise
  local name=$1 n=$2
  shift 2
  rm -rf "ck_$name"
  run "${run2[@]}" "$bin" "$@" --max-steps $((2 * n))
  local straight
  straight=$(hash_of out)
  run "${run2[@]}" "$bin" "$@" --max-steps "$n" --checkpoint-dir "ck_$name"
  run "${run2[@]}" "$bin" "$@" --max-steps $((2 * n)) --checkpoint-dir "ck_$name" --resume auto
  local resumed
  resumed=$(hash_of out)
  if grep -q "resuming from ck_$name/$(printf 'step-%08d.ckpt' "$n"): step $n" out && [ -n "$straight" ] &&
     [ "$straight" = "$resumed" ]; then
    ok "$name: $((2 * n)) steps straight == $n + resume + $n, params_hash $straight"
  else bad "$name: straight $straight, resumed $resumed"; fi
}
exact tiny_exact 100 --config "$root/configs/tiny.ini" "${base[@]}" --batch-size 16
exact lenet_dropout_exact 30 --config "$root/configs/lenet.ini" "${base[@]}" --global-batch-size 8
# --grad-compression bf16: every rank's residuals are in the checkpoint (CDEC, Note [Codec state on
# another number of ranks]), so the resumed run sends what the straight one would have, bit for bit;
# the same checkpoint resumed on 1 rank takes the residuals' sum and trains on.
exact tiny_bf16_wire 50 --config "$root/configs/tiny.ini" "${base[@]}" --batch-size 16 --grad-compression bf16
if "$py" - "$reader" ck_tiny_bf16_wire/step-00000100.ckpt <<'EOF2'
import sys, importlib.util
spec = importlib.util.spec_from_file_location("rc", sys.argv[1]); rc = importlib.util.module_from_spec(spec); spec.loader.exec_module(rc)
ck = rc.read_checkpoint(sys.argv[2])
c = ck["codec_state"]
print("codec state: %d ranks x %d, max |residual| %.3g" % (c.shape[0], c.shape[1], abs(c).max() if c.size else 0))
sys.exit(0 if c.shape == (2, ck["meta"]["param_count"]) and abs(c).max() > 0 and not (c[0] == c[1]).all() else 1)
EOF2
then ok "bf16 wire: the checkpoint holds both ranks' own residuals"
else bad "bf16 wire: the checkpoint's codec state"; fi
run "$bin" --config "$root/configs/tiny.ini" "${base[@]}" --batch-size 32 --grad-compression bf16 --max-steps 150 \
    --checkpoint-dir ck_tiny_bf16_wire --resume auto
if [ "$rc" -eq 0 ] && grep -q "resuming from ck_tiny_bf16_wire/step-00000100.ckpt: step 100" out; then
  ok "bf16 wire: a 2-rank checkpoint resumes on 1 rank"
else bad "bf16 wire: resume on 1 rank (rc $rc)"; fi
# --grad-compression powersgd: the checkpoint holds every rank's residuals and the warm-start
# factors (the same on both ranks: the state's last values), compression starting at step 20 of
# both runs; the resumed run is the straight one bit for bit, and resumes on 1 rank. Sharded or not,
# the same bits (the codec decodes the whole sum on every rank).
exact tiny_powersgd 50 --config "$root/configs/tiny.ini" "${base[@]}" --batch-size 16 --grad-compression powersgd:2 \
  --compression-start-steps 20
if "$py" - "$reader" ck_tiny_powersgd/step-00000100.ckpt <<'EOF2'
import sys, importlib.util
spec = importlib.util.spec_from_file_location("rc", sys.argv[1]); rc = importlib.util.module_from_spec(spec); spec.loader.exec_module(rc)
ck = rc.read_checkpoint(sys.argv[2])
c = ck["codec_state"]
shared = ck["codec_shared"]
own = c.shape[1] - shared
print("codec state: %d ranks x %d (%d shared), max |residual| %.3g" % (c.shape[0], c.shape[1], shared, abs(c[:, :own]).max()))
sys.exit(0 if c.shape[0] == 2 and 0 < shared < c.shape[1] and (c[0, own:] == c[1, own:]).all()
         and abs(c[:, :own]).max() > 0 and not (c[0, :own] == c[1, :own]).all() else 1)
EOF2
then ok "powersgd: the checkpoint holds both ranks' own residuals and one set of factors"
else bad "powersgd: the checkpoint's codec state"; fi
run "$bin" --config "$root/configs/tiny.ini" "${base[@]}" --batch-size 32 --grad-compression powersgd:2 \
    --compression-start-steps 20 --max-steps 120 --checkpoint-dir ck_tiny_powersgd --resume auto
if [ "$rc" -eq 0 ] && grep -q "resuming from ck_tiny_powersgd/step-00000100.ckpt: step 100" out; then
  ok "powersgd: a 2-rank checkpoint resumes on 1 rank"
else bad "powersgd: resume on 1 rank (rc $rc)"; fi
psgd_hashes=()
for shard in on off; do
  run "${run2[@]}" "$bin" --config "$root/configs/tiny.ini" "${base[@]}" --batch-size 16 --grad-compression powersgd:1 \
      --compression-start-steps 5 --max-steps 30 --shard-optimizer "$shard"
  psgd_hashes+=("$(hash_of out)")
done
if [ -n "${psgd_hashes[0]}" ] && [ "${psgd_hashes[0]}" = "${psgd_hashes[1]}" ]; then
  ok "powersgd: sharded and unsharded give the same bits (${psgd_hashes[0]})"
else bad "powersgd: sharded ${psgd_hashes[0]} unsharded ${psgd_hashes[1]}"; fi
# Batch norm: the running statistics (the checkpoint's STAT, which evaluation reads) continue bit for
# bit too, not only the parameters: the straight run's last checkpoint against the resumed run's.
bn=(--model "conv:3x3:4:same,batchnorm,relu,maxpool:2,flatten,fc:32,batchnorm:0.3,relu,fc:10" "${base[@]}"
    --global-batch-size 20)
rm -rf ck_bn_straight ck_bn
run "${run2[@]}" "$bin" "${bn[@]}" --max-steps 30 --checkpoint-dir ck_bn_straight
bn_straight=$(hash_of out)
bn_test_straight=$(grep -E '^test accuracy' out)
run "${run2[@]}" "$bin" "${bn[@]}" --max-steps 15 --checkpoint-dir ck_bn
run "${run2[@]}" "$bin" "${bn[@]}" --max-steps 30 --checkpoint-dir ck_bn --resume auto
if grep -q "resuming from ck_bn/step-00000015.ckpt" out && [ -n "$bn_straight" ] && [ "$(hash_of out)" = "$bn_straight" ] &&
   [ "$(grep -E '^test accuracy' out)" = "$bn_test_straight" ] &&
   "$py" - "$reader" ck_bn_straight/step-00000030.ckpt ck_bn/step-00000030.ckpt <<'EOF'
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("rc", sys.argv[1]); rc = importlib.util.module_from_spec(spec); spec.loader.exec_module(rc)
a, b = rc.read_checkpoint(sys.argv[2]), rc.read_checkpoint(sys.argv[3])
names = [t[0] for t in a["state_tensors"]]
assert names == ["6.bn.running_mean", "6.bn.running_var", "1.bn.running_mean", "1.bn.running_var"], names
for n in names:
    assert np.array_equal(a["model_state"][n].view(np.uint32), b["model_state"][n].view(np.uint32)), n
assert not np.array_equal(a["model_state"]["1.bn.running_var"], np.ones(4, np.float32)), "the statistics never moved"
EOF
then ok "batchnorm: 30 steps straight == 15 + resume + 15: params_hash $bn_straight, running statistics and test line bitwise"
else bad "batchnorm resume: straight $bn_straight ($bn_test_straight), resumed $(hash_of out) ($(grep -E '^test accuracy' out))"; fi

# ---- another number of ranks, same global batch: 2 ranks -> 1 rank, 2 ranks -> 3 ranks ----------
# close_to FILE: FILE's parameters against the 2-rank run that never stopped (summation order differs
# across rank counts, nothing else).
close_to() {
  "$py" - "$reader" ck_straight2/step-00000040.ckpt "$1" <<'EOF'
import sys, importlib.util
spec = importlib.util.spec_from_file_location("rc", sys.argv[1]); rc = importlib.util.module_from_spec(spec); spec.loader.exec_module(rc)
a = rc.read_checkpoint(sys.argv[2])["flat_params"]; b = rc.read_checkpoint(sys.argv[3])["flat_params"]
d = abs(a - b).max() / abs(a).max()
print("2 ranks straight vs %s: max |difference| / max |parameter| = %.3g" % (sys.argv[3], d))
sys.exit(0 if d < 1e-4 else 1)
EOF
}
run "${run2[@]}" "$bin" "${sm[@]}" --max-steps 40 --checkpoint-dir ck_straight2 --shard-optimizer off
straight2=$(hash_of out)
run "${run2[@]}" "$bin" "${sm[@]}" --max-steps 20 --checkpoint-dir ck_ranks --shard-optimizer off
rm -rf ck_ranks3 && mkdir ck_ranks3 && cp ck_ranks/step-00000020.ckpt ck_ranks3/
run "$bin" "${sm[@]}" --max-steps 40 --checkpoint-dir ck_ranks --resume auto
to1=$(hash_of out)
if [ "$rc" -eq 0 ] && grep -q "resuming from ck_ranks/step-00000020.ckpt: step 20, epoch 1, sample 400" out &&
   close_to ck_ranks/step-00000040.ckpt
then ok "2 ranks -> resume on 1 rank follows the 2-rank trajectory"
else bad "resume on another number of ranks"; fi
# The global batch of 20 does not divide by 3 ranks (7, 7, 6: Note [Uneven slices]).
run mpirun -np 3 --oversubscribe "$bin" "${sm[@]}" --max-steps 40 --checkpoint-dir ck_ranks3 --resume auto --shard-optimizer off
to3=$(hash_of out)
if [ "$rc" -eq 0 ] && grep -q "resuming from ck_ranks3/step-00000020.ckpt: step 20, epoch 1, sample 400" out &&
   grep -q "batch: 20 global, 6-7 per rank" out && close_to ck_ranks3/step-00000040.ckpt
then ok "2 ranks -> resume on 3 ranks (uneven slices) follows the 2-rank trajectory"
else bad "resume on 3 ranks, uneven slices"; fi

# ---- the sharded optimiser (--shard-optimizer) keeps today's format --------------------------------
# Rank 0 gathers the shards, so a sharded run's checkpoint is the unsharded run's, tensor for tensor
# (only CONF, the options, differs), and either resumes the other, on any number of ranks, to the
# same bits as the runs above.
same_state() {  # same_state A B: PARM, MOM1 and MOM2 bitwise equal
  "$py" - "$reader" "$1" "$2" <<'EOF'
import sys, importlib.util
import numpy as np
spec = importlib.util.spec_from_file_location("rc", sys.argv[1]); rc = importlib.util.module_from_spec(spec); spec.loader.exec_module(rc)
a, b = rc.read_checkpoint(sys.argv[2]), rc.read_checkpoint(sys.argv[3])
same = np.array_equal(a["flat_params"], b["flat_params"]) and len(a["second_moment"]) > 0 and all(
    np.array_equal(a[k][n], b[k][n]) for k in ("first_moment", "second_moment") for n in a[k])
print("%s vs %s: parameters and moments %s" % (sys.argv[2], sys.argv[3], "bitwise equal" if same else "DIFFER"))
sys.exit(0 if same else 1)
EOF
}
rm -rf ck_shard2 && run "${run2[@]}" "$bin" "${sm[@]}" --max-steps 20 --checkpoint-dir ck_shard2 --shard-optimizer
if [ "$rc" -eq 0 ] && grep -q "optimizer state: .* per rank at most (1/2 of .*, sharded)" out &&
   same_state ck_shard2/step-00000020.ckpt ck_ranks/step-00000020.ckpt
then ok "sharded on 2 ranks: the checkpoint holds the unsharded run's parameters and moments"
else bad "sharded checkpoint on 2 ranks"; fi
run "${run2[@]}" "$bin" "${sm[@]}" --max-steps 40 --resume ck_shard2/step-00000020.ckpt --shard-optimizer
if [ "$rc" -eq 0 ] && [ -n "$straight2" ] && [ "$(hash_of out)" = "$straight2" ]
then ok "sharded on 2 ranks, 20 + resume + 20 == the unsharded 40 steps straight ($straight2)"
else bad "sharded resume on 2 ranks: $(hash_of out), want $straight2"; fi
run "$bin" "${sm[@]}" --max-steps 40 --resume ck_shard2/step-00000020.ckpt
if [ "$rc" -eq 0 ] && [ -n "$to1" ] && [ "$(hash_of out)" = "$to1" ]
then ok "sharded 2 ranks -> unsharded 1 rank: bitwise the unsharded 2 -> 1 resume ($to1)"
else bad "sharded 2 ranks -> 1 rank: $(hash_of out), want $to1"; fi
rm -rf ck_shard3 && mkdir ck_shard3 && cp ck_ranks/step-00000020.ckpt ck_shard3/
run mpirun -np 3 --oversubscribe "$bin" "${sm[@]}" --max-steps 40 --checkpoint-dir ck_shard3 --resume auto --shard-optimizer
if [ "$rc" -eq 0 ] && [ -n "$to3" ] && [ "$(hash_of out)" = "$to3" ] &&
   same_state ck_shard3/step-00000040.ckpt ck_ranks3/step-00000040.ckpt
then ok "unsharded 2 ranks -> sharded 3 ranks: bitwise the unsharded 2 -> 3 resume ($to3), checkpoint too"
else bad "unsharded 2 ranks -> sharded 3 ranks: $(hash_of out), want $to3"; fi

# ---- refused resumes -----------------------------------------------------------------------------
c20=ck_ranks/step-00000020.ckpt
expect_fail other_model 4 "holds another model: its spec is '$small', this run's --model is 'fc:10'" -- \
  "${run2[@]}" "$bin" "${base[@]}" --model fc:10 --global-batch-size 20 --max-steps 40 --resume "$c20"
expect_fail other_global_batch 4 "global batch of 20 images, this run's is 40.*--global-batch-size 20" -- \
  "${run2[@]}" "$bin" "${base[@]}" --model "$small" --global-batch-size 40 --max-steps 40 --resume "$c20"
expect_fail past_the_end 4 "at step 20, past the end of this run \(10 steps\)" -- \
  "${run2[@]}" "$bin" "${sm[@]}" --max-steps 10 --resume "$c20"
expect_fail resume_auto_without_dir 2 "--resume auto looks in --checkpoint-dir" -- "$bin" "${sm[@]}" --resume auto

# ---- bad checkpoint files: exit 4 on every rank, one message naming the file --------------------
mkdir -p badck
cp "$c20" badck/flipped.ckpt
"$py" -c "import sys; f=open(sys.argv[1],'r+b'); f.seek(20000); b=f.read(1); f.seek(20000); f.write(bytes([b[0]^1]))" badck/flipped.ckpt
head -c 100000 "$c20" >badck/truncated.ckpt
cp "$c20" badck/magic.ckpt; printf 'XXXX' | dd of=badck/magic.ckpt bs=1 seek=0 conv=notrunc status=none
: >badck/empty.ckpt
"$py" - "$reader" "$c20" badck/version.ckpt <<'EOF'
import sys, struct, importlib.util
spec = importlib.util.spec_from_file_location("rc", sys.argv[1]); rc = importlib.util.module_from_spec(spec); spec.loader.exec_module(rc)
b = bytearray(open(sys.argv[2], "rb").read())
struct.pack_into("<I", b, 8, 7)                        # a well-formed version-7 header
struct.pack_into("<I", b, 12, rc.crc32c(bytes(b[:12])))
open(sys.argv[3], "wb").write(b)
EOF
for c in "flipped:section 'PARM' at byte [0-9]+ fails its CRC32C check" "truncated:truncated" \
         "magic:not a mnist_mpi checkpoint" "empty:the file is empty" "version:format version 7.*reads version 1"; do
  name=${c%%:*} pattern=${c#*:}
  fresh_state
  expect_fail "corrupt_$name" 4 "badck/$name.ckpt.*$pattern" -- "${run2[@]}" ./rank.sh "$bin" "${sm[@]}" --max-steps 40 --resume "badck/$name.ckpt"
  [ "$(codes)" = "4 4 " ] && ok "corrupt_$name: exit 4 on both ranks" || bad "corrupt_$name: rank exit codes $(codes)"
done
expect_fail missing_file 4 "checkpoint 'badck/nope.ckpt' does not exist" -- "${run2[@]}" "$bin" "${sm[@]}" --max-steps 40 --resume badck/nope.ckpt
expect_fail evaluate_corrupt 4 "badck/flipped.ckpt.*CRC32C" -- "$bin" evaluate --checkpoint badck/flipped.ckpt --data-dir data

# --resume auto skips a damaged newest checkpoint and takes the previous one.
mkdir -p autock && cp "$c20" autock/ && cp badck/truncated.ckpt autock/step-00000030.ckpt
run "${run2[@]}" "$bin" "${sm[@]}" --max-steps 40 --checkpoint-dir autock --resume auto
if [ "$rc" -eq 0 ] && grep -q "warning: checkpoint 'autock/step-00000030.ckpt' is unusable: it is truncated.*skips it" err &&
   grep -q "resuming from autock/step-00000020.ckpt" out; then ok "resume auto skips a damaged newest checkpoint"
else bad "resume auto with a damaged newest checkpoint (exit $rc)"; fi
# A directory holding only a half-written temporary file: a fresh start, said so.
mkdir -p tmpck && head -c 5000 "$c20" >tmpck/step-00000030.ckpt.tmp
run "${run2[@]}" "$bin" "${sm[@]}" --max-steps 5 --checkpoint-dir tmpck --resume auto
if [ "$rc" -eq 0 ] && grep -q "removed 'tmpck/step-00000030.ckpt.tmp', left by a write that did not finish" out &&
   grep -q "no valid checkpoint in 'tmpck'; starting from step 0" out && [ ! -e tmpck/step-00000030.ckpt.tmp ]; then
  ok "only a half-written temporary file: starts fresh and says so"
else bad "directory with only a temporary file (exit $rc)"; fi

# ---- unwritable directories and failed writes ---------------------------------------------------
echo x >afile
expect_fail dir_is_a_file 4 "cannot create the checkpoint directory 'afile/ck'.*choose a writable --checkpoint-dir" -- \
  "${run2[@]}" "$bin" "${sm[@]}" --max-steps 5 --checkpoint-dir afile/ck
mkdir -p rodir
if chattr +i rodir 2>/dev/null; then  # immutable: not even root may create files in it
  immutable=$work/rodir
  expect_fail readonly_dir 4 "checkpoint directory 'rodir' is not writable.*Operation not permitted" -- \
    "${run2[@]}" "$bin" "${sm[@]}" --max-steps 5 --checkpoint-dir rodir
  chattr -i rodir; immutable=""
  # The directory turns read-only during the run: exit 4 on every rank, the last checkpoint intact.
  fresh_state
  rm -rf rock; mkdir rock
  "${run2[@]}" ./rank.sh "$bin" "${sm[@]}" --max-steps 3000 --checkpoint-every 20 --checkpoint-dir rock >out 2>err &
  job=$!
  wait_for 'rock/step-*.ckpt' 60 && sleep 0.3
  chattr +i rock && immutable=$work/rock
  first=$(ls rock/*.ckpt | head -1); cp "$first" saved.ckpt
  wait $job; rc=$?
  chattr -i rock; immutable=""
  if [ "$(codes)" = "4 4 " ] && [ "$(grep -c 'mnist_mpi: error' err)" -eq 1 ] &&
     grep -q "cannot write checkpoint 'rock/step-[0-9]*.ckpt'.*previous checkpoints in 'rock' are untouched" err &&
     cmp -s "$first" saved.ckpt; then ok "directory turns read-only mid-run: exit 4 on both ranks, $first intact"
  else bad "read-only mid-run: codes $(codes), exit $rc"; fi
else
  echo "skip readonly_dir: chattr +i is not permitted here (needs CAP_LINUX_IMMUTABLE on ext4/xfs)"
fi
# Disk trouble during a write (RLIMIT_FSIZE, set on the running rank: write() fails with EFBIG).
# Steps enough that only the failed write ends the run: 3000 took 2.2 s here, and on a fast
# machine they could end before the limit was set (exit 0 and no failed write: a flake).
rm -rf fullck
(trap '' XFSZ; exec "$bin" "${sm[@]}" --max-steps 1000000 --checkpoint-every 20 --checkpoint-dir fullck >out 2>err) &
job=$!
# Bounded: a regression where the failed write no longer ends the run is killed after 120 s and
# fails here (exit 143), instead of running its million steps. (timeout(1) would put a process of
# its own between $job and the rank, and the limit below must reach the rank.)
(sleep 120 && kill "$job") >/dev/null 2>&1 &
deadline=$!
wait_for 'fullck/step-*.ckpt' 60 && sleep 0.2
# The newest file: rotation (--keep-checkpoints) may still remove an older one after a write that
# finished just before the limit (CI saw the oldest vanish between ls and cp on a loaded machine).
if prlimit --pid "$job" --fsize=100000:; then
  first=$(ls fullck/*.ckpt | tail -1) && cp "$first" saved.ckpt
else
  kill "$job"  # no limit set: the run would go on for its million steps
fi
wait $job; rc=$?
pkill -P "$deadline" sleep 2>/dev/null; kill "$deadline" 2>/dev/null  # the deadline and its sleep
if [ "$rc" -eq 4 ] && grep -q "cannot write checkpoint 'fullck/step-[0-9]*.ckpt': write failed after .* bytes: File too large.*untouched" err &&
   cmp -s "$first" saved.ckpt && ! compgen -G 'fullck/*.tmp' >/dev/null; then ok "failed write: exit 4, one message, $first intact, no temporary left"
else bad "failed write (exit $rc)"; fi
# The writer killed in the middle of a write (SIGXFSZ at the file-size limit, on rank 0 of 2):
# the half-written temporary file is left, the previous checkpoint is intact, --resume auto uses it.
fresh_state
rm -rf killck
"${run2[@]}" ./rank.sh "$bin" "${sm[@]}" --max-steps 300 --checkpoint-every 20 --checkpoint-dir killck >out 2>err &
job=$!
wait_for 'killck/step-*.ckpt' 60 && wait_for "$STATE/pid.0" 5
prlimit --pid "$(cat "$STATE/pid.0")" --fsize=100000:
wait $job
last_good=$(ls killck/*.ckpt | tail -1)
tmp=$(ls killck/*.tmp 2>/dev/null | head -1)
if [ -n "$tmp" ] && [ "$(stat -c %s "$tmp")" -eq 100000 ] && "$py" "$reader" "$last_good" >/dev/null; then
  ok "writer killed mid-write: $tmp has 100000 of $(stat -c %s "$last_good") bytes, $last_good is valid"
else bad "kill mid-write: tmp '$tmp', last good '$last_good'"; fi
run "${run2[@]}" "$bin" "${sm[@]}" --max-steps 300 --checkpoint-every 20 --checkpoint-dir killck --resume auto
if [ "$rc" -eq 0 ] && grep -q "resuming from $last_good" out && grep -q "removed '$tmp'" out; then
  ok "after the killed write --resume auto continues from $last_good"
else bad "resume after a killed write (exit $rc)"; fi

# ---- preemption ----------------------------------------------------------------------------------
pre=("${sm[@]}" --max-steps 300 --checkpoint-every 10)
run "${run2[@]}" "$bin" "${pre[@]}" --checkpoint-dir pre_straight
straight=$(hash_of out)
[ -n "$straight" ] || bad "the uninterrupted 2-rank run (exit $rc)"
# NAME DIR HOW: HOW signals a running job, then --resume auto must finish it. SIGTERM on mpirun
# reaches the ranks only after odls_base_sigkill_timeout (3 s here): that run is made long, stopped,
# and resumed for 20 more steps (so no hash comparison there).
preempt_case() {
  local name=$1 dir=$2 how=$3
  fresh_state
  rm -rf "$dir"
  case $how in
    rank1_TERM) "${run2[@]}" ./rank.sh "$bin" "${pre[@]}" --checkpoint-dir "$dir" >out 2>err & ;;
    single_INT) ./rank.sh "$bin" "${pre[@]}" --checkpoint-dir "$dir" >out 2>err & ;;
    mpirun_USR1) "${run2[@]}" "$bin" "${pre[@]}" --checkpoint-dir "$dir" >out 2>err & ;;
    # While mpirun waits odls_base_sigkill_timeout it does not read the ranks' output: a rank that
    # prints blocks in write() and never reaches the step boundary (gdb: rank 0 in pipe_write,
    # rank 1 spinning in the allreduce; CI lost the checkpoint so). So the ranks are --quiet, and
    # get 3 s instead of 1 to write, as docs/launching.md advises.
    mpirun_TERM) "${run2[@]}" --mca odls_base_sigkill_timeout 3 "$bin" "${sm[@]}" --quiet --max-steps 100000 \
                   --checkpoint-every 10 --checkpoint-dir "$dir" >out 2>err & ;;
  esac
  local job=$!
  wait_for "$dir/step-*.ckpt" 60
  case $how in
    rank1_TERM) kill -TERM "$(cat "$STATE/pid.1")" ;;
    single_INT) kill -INT "$(cat "$STATE/pid.0")" ;;
    mpirun_USR1) kill -USR1 $job ;;
    mpirun_TERM) kill -TERM $job ;;
  esac
  wait $job
  local jrc=$? ck
  ck=$(grep -oE "checkpoint $dir/step-[0-9]+\.ckpt written" err | awk '{print $2}')
  local want_codes="75 75 "
  [ "$how" = single_INT ] && want_codes="75 "
  local codes_ok=1
  case $how in
    rank1_TERM|single_INT) [ "$(codes)" = "$want_codes" ] || codes_ok=0 ;;
    mpirun_USR1) [ "$jrc" -eq 75 ] || codes_ok=0 ;;
    mpirun_TERM) [ "$jrc" -ne 0 ] || codes_ok=0 ;;  # mpirun itself exits 1 after a SIGTERM (docs/launching.md)
  esac
  if [ $codes_ok -eq 1 ] && [ -n "$ck" ] && "$py" "$reader" "$ck" >/dev/null; then
    ok "$name: stopped with a checkpoint ($ck; launcher exit $jrc, rank exits $(codes))"
  else bad "$name: mpirun exit $jrc, rank exits $(codes), checkpoint '$ck'"; return; fi
  local exact=1
  case $how in
    single_INT) exact=0; run "$bin" "${pre[@]}" --checkpoint-dir "$dir" --resume auto ;;
    mpirun_TERM) exact=0; local n=${ck##*step-}; n=$((10#${n%.ckpt}))
      run "${run2[@]}" "$bin" "${sm[@]}" --max-steps $((n + 20)) --checkpoint-dir "$dir" --resume auto ;;
    *) run "${run2[@]}" "$bin" "${pre[@]}" --checkpoint-dir "$dir" --resume auto ;;
  esac
  if [ "$rc" -eq 0 ] && grep -q "resuming from $ck" out && { [ $exact -eq 0 ] || [ "$(hash_of out)" = "$straight" ]; }; then
    ok "$name: --resume auto finished the run$([ $exact -eq 1 ] && echo ", params_hash $straight as the run never stopped")"
  else bad "$name: resume exit $rc, hash $(hash_of out) vs $straight"; fi
}
preempt_case "SIGTERM on rank 1" pre_term rank1_TERM
preempt_case "SIGUSR1 on mpirun (forwarded at once)" pre_usr1 mpirun_USR1
preempt_case "SIGTERM on mpirun, odls_base_sigkill_timeout 3, --quiet (reaches the ranks after 3 s, SIGKILL 3 s later)" pre_mterm mpirun_TERM
preempt_case "SIGINT on a single process" pre_int single_INT

# ---- evaluate, same bytes, retention ------------------------------------------------------------
run "$bin" "${sm[@]}" --max-steps 100 --checkpoint-every 5 --keep-checkpoints 2 --checkpoint-dir keepck --metrics-file m.jsonl
train_acc=$(grep -oE "^test accuracy [0-9.]+" out | awk '{print $3}')
run "$bin" evaluate --checkpoint keepck --data-dir data --threads 1
if [ "$rc" -eq 0 ] && grep -q "checkpoint keepck/step-00000100.ckpt: step 100" out &&
   grep -qE "^test: 100 images, accuracy $train_acc, loss [0-9.]+" out &&
   "$py" - out <<'EOF'
import sys, re
lines = open(sys.argv[1]).read().splitlines()
i = [k for k, l in enumerate(lines) if l.startswith("confusion matrix")][0]
rows = [list(map(int, l.split()))[1:] for l in lines[i + 2:i + 12]]
acc = float(re.search(r"accuracy ([0-9.]+)", [l for l in lines if l.startswith("test:")][0]).group(1))
assert len(rows) == 10 and all(len(r) == 10 for r in rows)
assert sum(map(sum, rows)) == 100, "the matrix counts every test image once"
assert abs(sum(rows[k][k] for k in range(10)) / 100 - acc) < 1e-9, "its diagonal is the accuracy"
EOF
then ok "evaluate: test accuracy $train_acc as the training run reported, 10x10 confusion matrix"
else bad "evaluate (exit $rc)"; cat out; fi
if "$py" - m.jsonl keepck <<'EOF'
import sys, json, os
ev = [json.loads(l) for l in open(sys.argv[1]) if '"split":"validation"' in l]
best = max(ev, key=lambda e: (e["accuracy"], e["step"]))["step"]  # the newest of equals
want = {"step-%08d.ckpt" % s for s in (95, 100, best)}
have = set(f for f in os.listdir(sys.argv[2]) if f.endswith(".ckpt"))
print("kept", sorted(have), "best by validation: step", best)
sys.exit(0 if have == want else 1)
EOF
then ok "--keep-checkpoints 2 keeps the newest two plus the best by validation accuracy"
else bad "retention"; fi
mkdir -p same1 same2
(cd same1 && "$bin" --data-dir ../data "${sm[@]:2}" --max-steps 30 --checkpoint-dir ck --quiet >/dev/null 2>&1)
(cd same2 && sleep 1 && "$bin" --data-dir ../data "${sm[@]:2}" --max-steps 30 --checkpoint-dir ck --quiet >/dev/null 2>&1)
if [ -s same1/ck/step-00000030.ckpt ] && cmp -s same1/ck/step-00000030.ckpt same2/ck/step-00000030.ckpt; then
  ok "the same state gives the same bytes (two runs, a second apart)"
else bad "same state, different bytes"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
