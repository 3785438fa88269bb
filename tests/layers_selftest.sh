#!/usr/bin/env bash
# tests/check_layers.py can fail: on a tree with docs/style.md's Layers table and one include
# turned upward (data/ including train/), one sideways (config/ including data/, the same layer)
# and one from a folder the table lacks, it exits 1 naming each; without them it passes.
# Usage: layers_selftest.sh REPO_ROOT
set -uo pipefail
root=$1
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/docs" "$t/src/data" "$t/src/config" "$t/src/newfolder" "$t/include/mnist_mpi/train"
cp "$root/docs/style.md" "$t/docs/"
printf '#include "mnist_mpi/check.hpp"\n#include "mnist_mpi/io/file_kind.hpp"\n' >"$t/src/data/ok.cpp"
printf '#include "mnist_mpi/data/idx.hpp"\n' >"$t/include/mnist_mpi/train/ok.hpp"
failed=0
python3 "$root/tests/check_layers.py" "$t" >"$t/out" || { echo "FAIL a tree in order was refused"; cat "$t/out"; failed=1; }
printf '#include "mnist_mpi/train/trainer.hpp"\n' >>"$t/src/data/ok.cpp"
printf '#include "mnist_mpi/data/idx.hpp"\n' >"$t/src/config/side.cpp"
printf '#include "mnist_mpi/check.hpp"\n' >"$t/src/newfolder/x.cpp"
if python3 "$root/tests/check_layers.py" "$t" >"$t/out"; then echo "FAIL the broken tree passed"; failed=1; fi
for want in "src/data/ok.cpp:3: data \(layer 3\) includes mnist_mpi/train/trainer.hpp \(train, layer 8\): an include up" \
            "src/config/side.cpp:1: config \(layer 3\) includes mnist_mpi/data/idx.hpp \(data, layer 3\): an include sideways" \
            "src/newfolder/x.cpp: its folder 'newfolder' is not in docs/style.md's Layers table"; do
  grep -qE "$want" "$t/out" || { echo "FAIL no line /$want/"; failed=1; }
done
cat "$t/out"
[ $failed -eq 0 ] && echo "1 passed, 0 failed"
exit $failed
