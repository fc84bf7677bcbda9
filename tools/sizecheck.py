#!/usr/bin/env python3
"""The code style's size limits, checked (docs/ARCHITECTURE.md "One model core"; issue 29 item 6).

Lists the C files of src/ and include/ (and, with --all, tests/ and bench/) over --file-lines lines (default 1000) and
their functions over --func-lines lines (default 150: the style says "under ~150"), a function counted from the line
of its name to its closing brace. Exit 1 when something is over, 0 otherwise.

Usage: tools/sizecheck.py [--root DIR] [--file-lines N] [--func-lines N] [--all]
Needs only Python 3; comments, strings and preprocessor lines are blanked (lines kept) before the braces are matched.
"""
import argparse
import importlib.util
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("callpath", os.path.join(HERE, "callpath.py"))
callpath = importlib.util.module_from_spec(spec)
spec.loader.exec_module(callpath)



def blank(text):
    """Comments, string/char literals and preprocessor lines (with their continuations) blanked, lines kept."""
    out = callpath.strip(text, keep_lines=True)
    lines, pp = [], False
    for l in out.split("\n"):
        if pp or l.lstrip().startswith("#"):
            pp = l.rstrip().endswith("\\")
            l = ""
        lines.append(l)
    return "\n".join(lines)


def functions(text):
    """(name, first line, last line) of each top-level function definition (a name, its parameters, a brace)."""
    out = []
    for name, i, _, j, end in callpath.top_level_defs(text, callpath.KEYWORDS):
        if name == "FL_TEST":  # a test: named by its argument
            name = text[i + len(name):end - 1].split("(", 1)[1].strip()
        out.append((name, text.count("\n", 0, i) + 1, text.count("\n", 0, j) + 1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.join(HERE, ".."))
    ap.add_argument("--file-lines", type=int, default=1000)
    ap.add_argument("--func-lines", type=int, default=150)
    ap.add_argument("--all", action="store_true", help="tests/ and bench/ too")
    a = ap.parse_args()
    over = 0
    tops = ("src", "include") + (("tests", "bench") if a.all else ())
    for top in tops:
        for d, _, files in sorted(os.walk(os.path.join(a.root, top))):
            for f in sorted(files):
                if not f.endswith((".c", ".h", ".cu", ".cuh")):
                    continue
                path = os.path.join(d, f)
                rel = os.path.relpath(path, a.root)
                raw = open(path, errors="replace").read()
                nl = raw.count("\n")
                if nl > a.file_lines:
                    print(f"{rel}: {nl} lines (file limit {a.file_lines})")
                    over += 1
                for name, first, last in functions(blank(raw)):
                    if last - first + 1 > a.func_lines:
                        print(f"{rel}:{first}: {name}: {last - first + 1} lines (function limit {a.func_lines})")
                        over += 1
    print(f"sizecheck: {over} over the limits ({', '.join(tops)})")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
