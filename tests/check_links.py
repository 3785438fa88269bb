#!/usr/bin/env python3
"""Every relative link and #anchor in the documentation resolves.

Checked: the Markdown links [text](target) of README.md, docs/*.md and bench/README.md (a file or
folder in the repository, and the heading or <a id> an #anchor names, GitHub's way), and every
`docs/NAME.md#anchor` written anywhere else in the tree (configs, scripts, bench, sources, tests),
since a comment that sends a reader to a section is a link too. Links to other sites are not
fetched.

Usage: check_links.py REPO_ROOT        exit 0, or 1 with one line per broken link
       check_links.py --selftest       the check fails on a tree with each kind of broken link
"""
import os
import re
import sys
import tempfile

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
DOC_REF = re.compile(r"(?<![\w/.-])((?:\.\./)*docs/[\w.-]+\.md)#([\w-]+)")
FENCE = re.compile(r"^\s*(```|~~~)")
SOURCE_EXT = (".md", ".ini", ".sh", ".py", ".cpp", ".hpp", ".cu", ".txt", ".cmake")


def slug(heading):
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation gone, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and _ (Unicode too)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, seen, fenced = set(), {}, False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if FENCE.match(line):
                    fenced = not fenced
                    continue
                if fenced:
                    continue
                m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
                if m:
                    base = slug(m.group(2))
                    n = seen.get(base, 0)
                    seen[base] = n + 1
                    found.add(base if n == 0 else f"{base}-{n}")
                for a in re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line):
                    found.add(a)
        cache[path] = found
    return cache[path]


def check_target(root, source, target, problems, where):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return
    path, _, anchor = target.partition("#")
    if path:
        full = os.path.normpath(os.path.join(os.path.dirname(source), path))
        if os.path.isabs(path) or not full.startswith(root):
            problems.append(f"{where}: {target}: not a path inside the repository")
            return
        if not os.path.exists(full):
            problems.append(f"{where}: {target}: {os.path.relpath(full, root)} does not exist")
            return
    else:
        full = source
    if anchor and full.endswith(".md") and anchor not in anchors(full):
        problems.append(f"{where}: {target}: no heading or anchor '#{anchor}' in {os.path.relpath(full, root)}")


def markdown_files(root):
    files = [os.path.join(root, "README.md"), os.path.join(root, "bench", "README.md")]
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return [f for f in files if os.path.isfile(f)]


def tree_files(root):
    for top in ("configs", "scripts", "bench", "src", "include", "tests", "launch", "docs", "README.md",
                "CMakeLists.txt"):
        p = os.path.join(root, top)
        if os.path.isfile(p):
            yield p
        for d, dirs, names in os.walk(p):
            dirs[:] = [x for x in dirs if x not in ("corpus", "__pycache__")]
            for n in sorted(names):
                if n.endswith(SOURCE_EXT):
                    yield os.path.join(d, n)


def check(root):
    root = os.path.abspath(root)
    problems = []
    checked = markdown_files(root)
    for md in checked:
        fenced = False
        with open(md, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if FENCE.match(line):
                    fenced = not fenced
                    continue
                if fenced:
                    continue
                line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
                where = f"{os.path.relpath(md, root)}:{no}"
                for target in LINK.findall(line) + IMAGE.findall(line):
                    check_target(root, md, target, problems, where)
    for path in tree_files(root):
        if os.path.abspath(path) == os.path.abspath(__file__) or path in checked:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for no, line in enumerate(f, 1):
                for doc, anchor in DOC_REF.findall(line):
                    full = os.path.join(root, re.sub(r"^(\.\./)*", "", doc))
                    where = f"{os.path.relpath(path, root)}:{no}"
                    if not os.path.isfile(full):
                        problems.append(f"{where}: {doc}#{anchor}: {doc} does not exist")
                    elif anchor not in anchors(full):
                        problems.append(f"{where}: {doc}#{anchor}: no heading or anchor '#{anchor}' in {doc}")
    return problems


def selftest():
    with tempfile.TemporaryDirectory() as t:
        os.makedirs(os.path.join(t, "docs"))
        os.makedirs(os.path.join(t, "configs"))

        def write(rel, text):
            with open(os.path.join(t, rel), "w", encoding="utf-8") as f:
                f.write(text)

        write("docs/a.md", "# A `--flag`, and more!\n## Twice\n## Twice\n<a id=\"kept\"></a>\n"
                           "```\n# not a heading\n```\n")
        good = ("# R\n[a](docs/a.md) [b](docs/a.md#a---flag-and-more) [c](docs/a.md#twice-1) "
                "[d](docs/a.md#kept) [e](#r) [f](https://example.invalid/x#y) `[g](nowhere.md)`\n")
        write("README.md", good)
        write("configs/x.ini", "# see docs/a.md#twice\n")
        assert check(t) == [], check(t)
        cases = {
            "README.md": [good + "[h](docs/missing.md)\n", good + "[i](docs/a.md#twice-2)\n",
                          good + "[j](docs/a.md#not-a-heading)\n", good + "[k](#nowhere)\n",
                          good + "[l](../outside.md)\n"],
            "configs/x.ini": ["# see docs/a.md#the-fast-recipe\n", "# see docs/b.md#x\n"],
        }
        for rel, texts in cases.items():
            for text in texts:
                saved = open(os.path.join(t, rel), encoding="utf-8").read()
                write(rel, text)
                assert len(check(t)) == 1, (text, check(t))
                write(rel, saved)
    print("check_links.py selftest: every kind of broken link was found")
    return 0


def main():
    if sys.argv[1:] == ["--selftest"]:
        return selftest()
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    problems = check(sys.argv[1])
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} broken link(s): fix the target or the heading it names")
        return 1
    print("every relative link and anchor resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
