#!/usr/bin/env python3
"""No function in src/ or include/ is over 150 lines (docs/style.md, Note [Why a function is long]),
unless the comment just above it names that Note. Reads C++ and CUDA as text: comments and string
literals are blanked, then braces are matched; the outermost braces that follow a parameter list
are a function's body (a lambda inside it is part of it), and a table written as `x = {...}` is data.

Usage: check_function_length.py ROOT      (exit 1 naming every function over the limit)
       check_function_length.py --selftest
"""
import os
import re
import sys
import tempfile

LIMIT = 150
NOTE = "Why a function is long"


def blank(text):
    """The text with comments and string/char literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def long_functions(path, text):
    """(line, lines, head) of every function body over LIMIT lines without the Note above it."""
    # Preprocessor lines are not code: `#if defined(X)` before a namespace is no parameter list.
    code = re.sub(r"(?m)^[ \t]*#.*$", lambda m: " " * len(m.group(0)), blank(text))
    lines = text.split("\n")
    found = []
    stack = []  # per open brace: 'func', 'other'
    head_start = 0  # where the text before the next brace starts (after the last ; { or })
    func_open = None  # (line of the head, index) of the outermost function being read
    line = 1
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c in ";":
            head_start = i + 1
        elif c == "{":
            head = code[head_start:i]
            in_func = "func" in stack
            head_flat = " ".join(head.split())
            is_func = (not in_func and ")" in head_flat and "=" not in head_flat.split(")")[-1]
                       and not re.match(r"^(namespace|class|struct|union|enum)\b", head_flat)
                       and not re.search(r"=\s*$", head_flat))
            if is_func:
                # The head's first line: past blank lines and an access label (`public:`).
                m = re.match(r"\s*(?:(?:public|private|protected)\s*:)?\s*", head)
                func_open = line - head.count("\n") + head[: m.end()].count("\n")
                stack.append("func")
            else:
                stack.append("other")
            head_start = i + 1
        elif c == "}":
            kind = stack.pop() if stack else "other"
            if kind == "func" and "func" not in stack and func_open is not None:
                n = line - func_open + 1
                above = "\n".join(lines[max(0, func_open - 16): func_open])
                if n > LIMIT and NOTE not in above:
                    found.append((func_open, n, lines[func_open - 1].strip()[:80]))
                func_open = None
            head_start = i + 1
    return found


def check(root):
    bad = []
    for top in ("src", "include"):
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if f.endswith((".cpp", ".hpp", ".cu", ".cuh")):
                    p = os.path.join(d, f)
                    with open(p, encoding="utf-8") as fh:
                        for at, n, head in long_functions(p, fh.read()):
                            bad.append(f"{os.path.relpath(p, root)}:{at}: a function of {n} lines (over {LIMIT}): {head}")
    return bad


def selftest():
    body = "\n".join(f"  x += {k};  // }} {{ \"{{\"" for k in range(LIMIT + 5))
    cases = {
        "long": (f"int f(int x) {{\n{body}\n  return x;\n}}\n", 1),
        "noted": (f"// Note [{NOTE}]: one table.\nint f(int x) {{\n{body}\n  return x;\n}}\n", 0),
        "short": ("namespace a {\nint f() {\n  return 1;\n}\n}  // namespace a\n", 0),
        "table": ("constexpr int kT[] = {\n" + "\n".join(f"  {k}," for k in range(LIMIT + 5)) + "\n};\n", 0),
        "preprocessor": ("#if defined(X)\n#include <y.h>\n#endif\nnamespace a {\n" + "\n".join(f"int f{k}();" for k in range(LIMIT + 5)) + "\n}\n", 0),
        "member": (f"namespace a {{\nint A::f(int x) const {{\n  auto g = [&] {{ return 1; }};\n{body}\n  return x;\n}}\n}}\n", 1),
    }
    ok = True
    with tempfile.TemporaryDirectory() as t:
        for name, (text, want) in cases.items():
            got = long_functions(os.path.join(t, name + ".cpp"), text)
            if len(got) != want:
                print(f"selftest {name}: {len(got)} long functions found, {want} expected: {got}")
                ok = False
    print("selftest: " + ("every case as expected" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--selftest"]:
        sys.exit(selftest())
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    problems = check(sys.argv[1])
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} function(s) over {LIMIT} lines: cut them, or say why above each "
              f"(Note [{NOTE}] in docs/style.md)")
        sys.exit(1)
    print(f"no function over {LIMIT} lines in src/ and include/")
