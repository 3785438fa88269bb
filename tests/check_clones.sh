#!/bin/bash
# Our hot CPU loops must run as the AVX2 / AVX-512 clones (Note [One build for every x86-64] in
# include/mnist_mpi/cpu_clones.hpp), not as a function of their own built for the baseline x86-64.
# GCC leaves a loop outside the clones when the cloned function calls a helper it does not inline
# or when the loop sits in an OpenMP region of a helper (the region becomes a function of its own):
# until this check, tiny's first-convolution weight gradient and both max-pool forwards ran SSE.
# Usage: check_clones.sh LIBRARY
set -euo pipefail
lib=$1
command -v objdump >/dev/null || { echo "check_clones: objdump (binutils) is missing" >&2; exit 1; }
dis=$(mktemp)
trap 'rm -f "$dis"' EXIT
objdump -d --no-show-raw-insn -C "$lib" >"$dis"

# The hot kernels: every function whose name holds one of these must be one of the clones.
# (Anchored at '::': pooled_image_weight_grad_3x3 and conv_pool_avx2 are AVX2 by hand, checked below.)
kernels='::(image_weight_grad|pool_forward_blocked|bias_grad_blocked|expand_pooled_dy|adam_pass|to_fixed_loop|from_fixed_pass|bf16_add|bf16_encode_with_feedback|bf16_decode)'
heads=$(grep -E '^[0-9a-f]+ <.*>:$' "$dis" | grep -E "$kernels" | grep -v -E '\[clone \.cold\]|@plt>') || true
[ -n "$heads" ] || { echo "check_clones: no hot kernel found in $lib" >&2; exit 1; }
bad=$(grep -v -E '\[clone \.(avx2|avx512f|default|resolver)\]' <<<"$heads") || true
if [ -n "$bad" ]; then
  echo "check_clones: these hot loops are built for the baseline x86-64 only, outside the clones:" >&2
  echo "$bad" >&2
  echo "fix: mark their helpers [[gnu::always_inline]] and keep OpenMP regions out of the cloned functions" >&2
  exit 1
fi

# And the AVX2 clones do run 8 lanes wide: each holds ymm instructions.
fail=0
for k in image_weight_grad8 image_weight_grad16 pool_forward_blocked8 pool_forward_blocked16 bias_grad_blocked8 \
  bias_grad_blocked16 expand_pooled_dy8 expand_pooled_dy16 to_fixed_loop from_fixed_pass 'adam_pass(.*) \[clone \._omp_fn\.0\]'; do
  n=$(awk -v re="::$k.*\\\\[clone \\\\.avx2\\\\]>:\$" '$0 ~ re {f=1; next} f && /^$/ {exit} f' "$dis" | grep -c ymm) || true
  if [ "$n" -eq 0 ]; then
    echo "check_clones: the AVX2 clone of $k has no ymm instruction (or is missing)" >&2
    fail=1
  fi
done
# The kernels written with AVX2 intrinsics (a target attribute, no clones) hold ymm instructions.
for k in 'pooled_image_weight_grad_3x3' 'conv_pool_avx2<3, 3>'; do
  n=$(awk -v k="::$k(" 'index($0, k) && /^[0-9a-f]+ <.*>:$/ {f=1; next} f && /^$/ {exit} f' "$dis" | grep -c ymm) || true
  if [ "$n" -eq 0 ]; then
    echo "check_clones: the AVX2 kernel $k has no ymm instruction (or is missing)" >&2
    fail=1
  fi
done
[ "$fail" -eq 0 ] || exit 1
echo "check_clones: $(wc -l <<<"$heads") hot-loop functions, all clones; every AVX2 clone and kernel 8 lanes wide"
