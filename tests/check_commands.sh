#!/usr/bin/env bash
# Every command src/main.cpp dispatches (its kSubcommands table, and train) is listed by
# `mnist_mpi --help`, named by the unknown-command message, has a section in docs/usage.md
# ("### mnist_mpi NAME") and a --help of its own that exits 0 and lists its exit codes; and the
# check fails when any of those is missing (it runs itself on damaged copies first).
# Usage: check_commands.sh MNIST_MPI REPO_ROOT
set -uo pipefail
bin=$1 root=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The names main.cpp dispatches: the rows of kSubcommands ({"NAME", function}), and train.
dispatched() {
  sed -n '/kSubcommands\[\] = {/,/^};/p' "$1" | sed -n 's/^ *{"\([a-z]*\)", *[a-z_]*},.*/\1/p'
  echo train
}

# check MAIN_CPP USAGE_MD: prints one line per problem; exit 1 when there is one.
check() {
  local main_cpp=$1 usage=$2 bad=0 help unknown names
  names=$(dispatched "$main_cpp")
  [ "$(wc -l <<<"$names")" -ge 5 ] || { echo "found only $(wc -w <<<"$names") commands in $main_cpp"; bad=1; }
  help=$("$bin" --help) || { echo "mnist_mpi --help exits non-zero"; bad=1; }
  unknown=$("$bin" evalute 2>&1 >/dev/null)
  for c in $names; do
    grep -qE "^  $c +[a-z(]" <<<"$help" || { echo "$c: not in mnist_mpi --help's Commands"; bad=1; }
    grep -qE "the commands: .*\\b$c\\b" <<<"$unknown" || { echo "$c: not named by the unknown-command message"; bad=1; }
    grep -qE "^### mnist_mpi $c\$" "$usage" || { echo "$c: no '### mnist_mpi $c' section in docs/usage.md"; bad=1; }
    if [ "$c" != train ]; then
      local out
      out=$("$bin" "$c" --help 2>&1) || { echo "$c: mnist_mpi $c --help exits non-zero"; bad=1; }
      grep -q "^Usage: mnist_mpi $c" <<<"$out" || { echo "$c: its --help has no usage line"; bad=1; }
      grep -qE "^ +mnist_mpi ([a-z]+\|)*$c(\|[a-z]+)* \[options\] \(one process" <<<"$help" ||
        { echo "$c: not in mnist_mpi --help's usage lines"; bad=1; }
      grep -q "Exit code" <<<"$out" || { echo "$c: its --help lists no exit codes"; bad=1; }
    else
      grep -q "Exit code" <<<"$help" || { echo "train: mnist_mpi --help lists no exit codes"; bad=1; }
    fi
  done
  return $bad
}

# The check itself fails on a command missing from docs/usage.md, and on one main.cpp dispatches
# that the program does not list.
sed 's/^### mnist_mpi report$/### report/' "$root/docs/usage.md" >"$work/usage.md"
check "$root/src/main.cpp" "$work/usage.md" >/dev/null && { echo "FAIL: a command missing from docs/usage.md passed"; exit 1; }
sed 's/^\( *\){"report", report_main},/\1{"report", report_main},\n\1{"lint", lint_main},/' "$root/src/main.cpp" >"$work/main.cpp"
grep -q '"lint"' "$work/main.cpp" || { echo "FAIL: could not add a command to a copy of main.cpp"; exit 1; }
check "$work/main.cpp" "$root/docs/usage.md" >/dev/null && { echo "FAIL: a dispatched command missing from --help passed"; exit 1; }

if check "$root/src/main.cpp" "$root/docs/usage.md"; then
  echo "ok: $(dispatched "$root/src/main.cpp" | tr '\n' ' ')in --help, the unknown-command message and docs/usage.md"
else
  exit 1
fi
