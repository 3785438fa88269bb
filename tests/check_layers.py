#!/usr/bin/env python3
"""The layering of folders (docs/style.md, "Layers"): every #include under src/ and include/ goes to
the file's own folder or to a lower layer, never sideways to another folder of the same layer or up.

Usage: check_layers.py REPO_ROOT   (exit 0: every include in order; 1: each offending one printed)
The table is read from REPO_ROOT/docs/style.md, so the picture and the check cannot disagree.
"""
import pathlib
import re
import sys


def layers(style: pathlib.Path) -> dict:
    """folder -> layer number, from the table's rows: | 3 | `config`, `data` | ... |"""
    table = {}
    for line in style.read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            for folder in re.findall(r"`([^`]+)`", m.group(2)):
                table[folder] = int(m.group(1))
    return table


def folder_of(path: str) -> str:
    """The folder a repository path or an include path belongs to: src/train/x.cpp, mnist_mpi/train/x.hpp
    and include/mnist_mpi/train/x.hpp are in train; a file at the top of src/ or include/mnist_mpi/ in base."""
    if path == "src/main.cpp":
        return "main"
    for prefix in ("include/mnist_mpi/", "mnist_mpi/", "src/"):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    parts = path.split("/")
    return parts[0] if len(parts) > 1 else "base"


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    table = layers(root / "docs" / "style.md")
    if not table:
        print("check_layers: no Layers table in docs/style.md")
        return 1
    bad, checked = [], 0
    files = [p for d in ("src", "include") for p in sorted((root / d).rglob("*"))
             if p.suffix in (".cpp", ".hpp", ".cu", ".cuh", ".h")]
    for f in files:
        rel = f.relative_to(root).as_posix()
        src = folder_of(rel)
        if src not in table:
            bad.append(f"{rel}: its folder '{src}' is not in docs/style.md's Layers table")
            continue
        for number, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m or not (m.group(1).startswith("mnist_mpi/") or m.group(1).startswith("src/")):
                continue
            checked += 1
            dst = folder_of(m.group(1))
            if dst == src:
                continue
            if dst not in table:
                bad.append(f"{rel}:{number}: includes {m.group(1)}, whose folder '{dst}' is not in the Layers table")
            elif table[dst] >= table[src]:
                way = "up" if table[dst] > table[src] else "sideways"
                bad.append(f"{rel}:{number}: {src} (layer {table[src]}) includes {m.group(1)} "
                           f"({dst}, layer {table[dst]}): an include {way}")
    for b in bad:
        print(b)
    print(f"check_layers: {checked} includes in {len(files)} files, {len(bad)} out of order")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
