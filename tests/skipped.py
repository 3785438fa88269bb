#!/usr/bin/env python3
"""Every test that skipped in a CTest run, and why: read from the JUnit files that
`ctest --output-junit FILE` writes (scripts/test.sh writes one per stage).

Two kinds are listed, grouped by reason:
  - tests CTest reports as skipped (GTEST_SKIP in a test of its own, exit code 77 of a script);
  - tests that passed with a part skipped inside them: a gtest under mpirun (one CTest entry
    for the whole binary) that printed "[  SKIPPED ]", or a script that printed a line starting
    with "SKIP" (e2e_exact_sums.sh's "SKIP (loud)").
So a green run on a CPU without bf16 instructions says which tests did not test bf16.

Usage: tests/skipped.py STAGE=JUNIT.xml ...   (a missing file is said, not an error)
"""
import re
import sys
import xml.etree.ElementTree as ET
from collections import OrderedDict

GTEST_SKIP = re.compile(r"^[^\n]*: Skipped\n(.*?)\n\[  SKIPPED \] (\S+)", re.M | re.S)
SLURM_SKIP = re.compile(r"^=== SKIPPED: (.*) ===$", re.M)
SCRIPT_SKIP = re.compile(r"^(SKIP\b.*)$", re.M)
# GoogleTest colours its lines under mpirun (a terminal there); CTest writes ESC as this text.
COLOUR = re.compile(r"(?:\[NON-XML-CHAR-0x1B\]|\x1b)\[[0-9;]*m")


def reasons(out):
    """(test inside, reason) pairs found in one test's output."""
    out = COLOUR.sub("", out)
    found = [(name, " ".join(msg.split())) for msg, name in GTEST_SKIP.findall(out)]
    found += [("", m) for m in SLURM_SKIP.findall(out)]
    found += [("", m) for m in SCRIPT_SKIP.findall(out)]
    return found


def main(args):
    total = 0
    for arg in args:
        stage, _, path = arg.partition("=")
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            print(f"  {stage}: no test results to read ({e})")
            continue
        groups = OrderedDict()  # reason -> names
        for case in root.iter("testcase"):
            name = case.get("name", "?")
            out_el = case.find("system-out")
            out = out_el.text if out_el is not None and out_el.text else ""
            skipped = case.get("status") == "notrun" and case.find("skipped") is not None
            found = reasons(out)
            if skipped:
                why = found[0][1] if found else "(no reason printed)"
                groups.setdefault(why, []).append(name)
            elif case.get("status") == "run":
                for inner, why in found:
                    groups.setdefault(why, []).append(f"{name} (passed; {inner or 'a part'} skipped)")
        count = sum(len(v) for v in groups.values())
        total += count
        print(f"  {stage}: {count} skipped" + (":" if count else ""))
        for why, names in groups.items():
            print(f"    {why}")
            for n in names:
                print(f"      {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
