#!/usr/bin/env bash
# Using a trained model on real MNIST: `mnist_mpi export` round trips for both shipped
# configs, the blog's network with stride 2, asymmetric SAME and VALID padding, and a spec that
# puts a conv after an fc, a model with batch norm, each checked by tests/check_onnx.py against `mnist_mpi evaluate`; then
# `mnist_mpi predict` on test digits written as images (tests/predict_images.py) and on bad files.
# Short runs (tens of steps): the point is the same numbers from two evaluators, not accuracy.
# The data comes from scripts/fetch_mnist.sh, as for tests/e2e_real_mnist.sh.
# Usage: e2e_model_use.sh MNIST_MPI REPO_ROOT
set -uo pipefail
bin=$1 root=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
data=${MNIST_DATA_DIR:-$root/data/mnist}
if [ ! -f "$data/t10k-images-idx3-ubyte" ]; then
  echo "FAIL: real MNIST is not in $data; run scripts/fetch_mnist.sh first"
  exit 1
fi
py=/usr/bin/python3  # Debian's, with python3-onnx and python3-numpy (scripts/setup.sh)
"$py" -c 'import numpy, onnx' || { echo "FAIL: $py lacks numpy or onnx (scripts/setup.sh installs them)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
fail() { failed=$((failed + 1)); echo "FAIL $1"; [ -f "$work/out" ] && tail -20 "$work/out"; }

# round_trip NAME STEPS CONFIG [--model SPEC]: train, export, evaluate with logits, check_onnx.py.
round_trip() {
  local name=$1 steps=$2 config=$3
  shift 3
  local t0=$SECONDS
  if ! "$bin" --config "$config" "$@" --data-dir "$data" --max-steps "$steps" --threads 2 --log-every 0 \
       --checkpoint-dir "$work/$name" >"$work/out" 2>&1; then fail "$name: training"; return; fi
  local hash ck
  hash=$(grep -oE '^params_hash [0-9a-f]{16}' "$work/out" | cut -d' ' -f2)
  ck=$(ls "$work/$name"/step-*.ckpt | tail -1)
  if ! "$bin" export --checkpoint "$ck" --onnx "$work/$name.onnx" >"$work/out" 2>&1; then fail "$name: export"; return; fi
  cat "$work/out"
  if ! "$bin" evaluate --checkpoint "$ck" --data-dir "$data" --threads 2 --logits-file "$work/$name.npy" >"$work/out" 2>&1
  then fail "$name: evaluate"; return; fi
  local acc
  acc=$(grep -oE '^test: 10000 images, accuracy [0-9.]+' "$work/out" | grep -oE '[0-9.]+$')
  if "$py" "$root/tests/check_onnx.py" "$work/$name.onnx" "$ck" "$data" "$work/$name.npy" "$acc" \
       --params-hash "$hash" >"$work/out" 2>&1; then
    grep -E '^(ONNX graph|logits)' "$work/out"
    ok "$name: export round trip, $steps steps ($((SECONDS - t0)) s)"
  else fail "$name: check_onnx.py"; fi
}

round_trip tiny 100 "$root/configs/tiny.ini"
round_trip lenet 20 "$root/configs/lenet.ini"
# The blog's network without activations, with a stride-2 conv whose SAME padding is asymmetric
# (28 -> 14: one row above, two below), a VALID conv of stride 2 and a pool of stride 1.
round_trip blog_strided 100 "$root/configs/tiny.ini" \
  --model "conv:5x5:8:same:s2,conv:3x3:16:valid:s2,maxpool:2:1,flatten,fc:10"
# An fc before a conv (a Reshape back to 4-D), an fc straight after a conv (a Flatten), dropout inside.
round_trip fc_then_conv 60 "$root/configs/tiny.ini" \
  --model "conv:4x4:4:same,relu,fc:32,relu,conv:1x1:16,dropout:0.3,fc:10"
# Batch norm after a conv (BatchNormalization on (N, C, H, W)) and after an fc (on (N, C)), its
# running statistics from the checkpoint's STAT section: evaluate and the ONNX graph must use them.
round_trip batchnorm 60 "$root/configs/tiny.ini" \
  --model "conv:5x5:8:same,batchnorm,relu,maxpool:2,flatten,fc:32,batchnorm:0.2,relu,fc:10"

# ---- predict ------------------------------------------------------------------------------------
ck=$(ls "$work/tiny"/step-*.ckpt 2>/dev/null | tail -1)
if [ -z "$ck" ]; then fail "predict: no tiny checkpoint to predict with"; else
  imgs=$work/images
  "$py" "$root/tests/predict_images.py" make "$data" "$work/tiny.npy" "$imgs" || fail "predict: making the images"
  mapfile -t files < <(awk -v d="$imgs" '{print d "/" $1}' "$imgs/manifest.txt")
  if "$bin" predict --checkpoint "$ck" --json "${files[@]}" >"$work/predict.json" 2>"$work/out" &&
     "$py" "$root/tests/predict_images.py" verify "$imgs" "$work/predict.json" "$work/tiny.npy" >"$work/out" 2>&1; then
    cat "$work/out"; ok "predict: ${#files[@]} images of test digits (PNG, PGM, inverted, 200x300 RGBA) as labelled"
  else fail "predict: test digits"; fi
  # The text form: one line per image, FILE: DIGIT PROBABILITY  top3 ..., and --invert / --no-invert.
  "$bin" predict --checkpoint "$ck" "$imgs/wb_7.png" "$imgs/bw_3.png" >"$work/out" 2>&1
  if [ "$(wc -l <"$work/out")" -eq 2 ] &&
     grep -qE "^$imgs/wb_7.png: 7 [01]\.[0-9]{4}  top3 7:[01]\.[0-9]{4} [0-9]:[01]\.[0-9]{4} [0-9]:[01]\.[0-9]{4}  not inverted \(guessed: border 0\.00\)$" "$work/out" &&
     grep -qE "^$imgs/bw_3.png: 3 .* inverted \(guessed: border 1\.00\)$" "$work/out"; then ok "predict: text lines"
  else fail "predict: text lines"; fi
  if "$bin" predict --checkpoint "$ck" --invert "$imgs/bw_3.png" >"$work/out" 2>&1 && grep -qE ": 3 .*inverted \(--invert\)$" "$work/out" &&
     "$bin" predict --checkpoint "$ck" --no-invert "$imgs/wb_3.png" >"$work/out" 2>&1 && grep -qE ": 3 .*not inverted \(--no-invert\)$" "$work/out"
  then ok "predict: --invert and --no-invert"; else fail "predict: --invert and --no-invert"; fi

  # Bad files among good ones: one line each on stderr naming the file, the good ones classified, exit 3.
  bad=$work/bad
  mkdir -p "$bad/a_directory.png"
  head -c 300 "$imgs/big_2.png" >"$bad/truncated.png"
  "$py" - "$imgs/wb_4.png" "$bad/corrupt.png" "$bad/zero_width.png" <<'EOF'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[60] ^= 0x55  # inside IDAT: its CRC no longer matches
open(sys.argv[2], "wb").write(b)
# A PNG of 0 x 1 pixels, its chunks' checksums right.
import struct, zlib
def chunk(tag, data):
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
open(sys.argv[3], "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 1, 8, 0, 0, 0, 0)) +
                              chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b""))
EOF
  printf 'P5\n0 0\n255\n' >"$bad/empty.pgm"
  printf 'P5\n28 28\n255\n%s' "short" >"$bad/short.pgm"
  echo "digit: seven" >"$bad/notes.txt"
  : >"$bad/zero_bytes.png"
  { printf 'P5\n4 4\n255\n'; head -c 16 /dev/zero; } >"$bad/blank.pgm"
  names=(missing.png a_directory.png truncated.png corrupt.png empty.pgm short.pgm zero_width.png notes.txt zero_bytes.png
         blank.pgm)
  args=("$imgs/wb_1.png")
  for n in "${names[@]}"; do args+=("$bad/$n"); done
  args+=("$imgs/bw_8.png")
  "$bin" predict --checkpoint "$ck" "${args[@]}" >"$work/stdout" 2>"$work/stderr"
  rc=$?
  cat "$work/stderr"
  good=1
  [ $rc -eq 3 ] || { echo "  exit code $rc, expected 3"; good=0; }
  [ "$(wc -l <"$work/stderr")" -eq ${#names[@]} ] || { echo "  expected ${#names[@]} lines on stderr"; good=0; }
  for n in "${names[@]}"; do
    grep -qE "^mnist_mpi predict: image '$bad/$n'.*( -- |; )" "$work/stderr" || { echo "  no line for $n"; good=0; }
  done
  grep -qE "^$imgs/wb_1.png: 1 " "$work/stdout" && grep -qE "^$imgs/bw_8.png: 8 " "$work/stdout" ||
    { echo "  the good images were not classified:"; cat "$work/stdout"; good=0; }
  if [ $good -eq 1 ]; then ok "predict: ${#names[@]} bad files reported, one line each, the good ones classified, exit 3"
  else failed=$((failed + 1)); echo "FAIL predict: bad files"; fi

  # A checkpoint of another format version (its header checksum made right): exit 4, saying so.
  "$py" - "$ck" "$work/v2.ckpt" "$root/scripts" <<'EOF'
import struct, sys
sys.path.insert(0, sys.argv[3])
from read_checkpoint import crc32c
b = bytearray(open(sys.argv[1], "rb").read())
b[8:12] = struct.pack("<I", 2)
b[12:16] = struct.pack("<I", crc32c(bytes(b[:12])))
open(sys.argv[2], "wb").write(b)
EOF
  "$bin" predict --checkpoint "$work/v2.ckpt" "$imgs/wb_1.png" >"$work/out" 2>&1
  rc=$?
  if [ $rc -eq 4 ] && [ "$(wc -l <"$work/out")" -eq 1 ] && grep -q "format version 2" "$work/out"; then
    cat "$work/out"; ok "predict: a checkpoint of format version 2 (exit 4)"
  else fail "predict: a checkpoint of format version 2 (exit $rc)"; fi
  "$bin" export --checkpoint "$work/v2.ckpt" --onnx "$work/v2.onnx" >"$work/out" 2>&1
  rc=$?
  if [ $rc -eq 4 ] && grep -q "format version 2" "$work/out" && [ ! -e "$work/v2.onnx" ]; then ok "export: a checkpoint of format version 2 (exit 4)"
  else fail "export: a checkpoint of format version 2 (exit $rc)"; fi
fi

echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
