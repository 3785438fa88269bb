#!/usr/bin/env bash
# tests/skipped.py on a JUnit file of the three kinds of skip it must list, and a passed test
# it must not: a test CTest skipped (GTEST_SKIP, its reason; plain, and in GoogleTest's colours as
# under mpirun), a gtest under mpirun that passed with one test skipped inside, a script that
# printed "SKIP (loud): ...".
# Usage: skipped_selftest.sh REPO_ROOT
set -uo pipefail
root=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/r.xml" <<'XML'
<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="(empty)" tests="4" failures="0" disabled="0" skipped="1" hostname="" time="1" timestamp="2026-12-07T09:00:00">
  <testcase name="Layers.Bf16ConvMatchesFp32" classname="Layers.Bf16ConvMatchesFp32" time="0.01" status="notrun">
    <skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>
    <system-out>[ RUN      ] Layers.Bf16ConvMatchesFp32
tests/test_layers.cpp:861: Skipped
this CPU has no bf16 instructions

[  SKIPPED ] Layers.Bf16ConvMatchesFp32 (0 ms)
</system-out>
  </testcase>
  <testcase name="mpi_tests_np2" classname="mpi_tests_np2" time="3" status="run">
    <system-out>[ RUN      ] Distributed.Other
[       OK ] Distributed.Other (3 ms)
[ RUN      ] Sharding.Bf16Images
tests/test_distributed.cpp:700: Skipped
this CPU has no bf16 instructions
[  SKIPPED ] Sharding.Bf16Images (0 ms)
</system-out>
  </testcase>
  <testcase name="gpu_np2.GpuNccl.SumsAreExact" classname="gpu_np2.GpuNccl.SumsAreExact" time="0.1" status="notrun">
    <skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>
    <system-out>[NON-XML-CHAR-0x1B][0;32m[ RUN      ] [NON-XML-CHAR-0x1B][mGpuNccl.SumsAreExact
tests/test_gpu.cpp:90: Skipped
no usable GPU: no NVIDIA driver is loaded
[NON-XML-CHAR-0x1B][0;32m[  SKIPPED ] [NON-XML-CHAR-0x1B][mGpuNccl.SumsAreExact (98 ms)
</system-out>
  </testcase>
  <testcase name="e2e_exact_sums" classname="e2e_exact_sums" time="30" status="run">
    <system-out>ok   exact: np1 = np2
SKIP (loud): the row-wise tail is untested here
</system-out>
  </testcase>
  <testcase name="e2e_cli" classname="e2e_cli" time="30" status="run">
    <system-out>ok   all cases (no skip here: "SKIP" only counts at the start of a line)
</system-out>
  </testcase>
</testsuite>
XML
out=$(python3 "$root/tests/skipped.py" "normal=$work/r.xml" "asan=$work/missing.xml")
echo "$out"
fail=0
want() { grep -qF -- "$1" <<<"$out" || { echo "FAIL: the list lacks: $1"; fail=1; }; }
want "normal: 4 skipped:"
want "    no usable GPU: no NVIDIA driver is loaded"
want "      gpu_np2.GpuNccl.SumsAreExact"
want "    this CPU has no bf16 instructions"
want "      Layers.Bf16ConvMatchesFp32"
want "      mpi_tests_np2 (passed; Sharding.Bf16Images skipped)"
want "    SKIP (loud): the row-wise tail is untested here"
want "      e2e_exact_sums (passed; a part skipped)"
want "asan: no test results to read"
if grep -q "e2e_cli\|Distributed.Other" <<<"$out"; then echo "FAIL: a test with nothing skipped is listed"; fail=1; fi
[ $fail -eq 0 ] && echo "ok   tests/skipped.py lists every skip and its reason"
exit $fail
