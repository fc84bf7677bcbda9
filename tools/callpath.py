#!/usr/bin/env python3
"""The trainer step's call path, counted (docs/ARCHITECTURE.md "The step's call path, counted").

Walks the static call tree of a function (default: train_step in src/train/trainer.c) in source
order and prints the files it enters and how often it climbs back up the layers:

- a call to a function defined in the tree (src/, include/) is a visit to the file that defines it
  (a static function of the caller's file first, then a global one); each function is expanded at
  its first call only and its later calls are not counted (the call tree of the call graph, depth
  first: each call edge once); --every counts every call as a visit (descending at the first);
- a function-like macro (FL_TRY, a file's own PP_GATHER) is a visit to the file that defines it,
  and its body's calls are its own (the calls in its arguments are the caller's, made first); so is a
  header's static (inline) function (store.h's fl_store_off), unless --no-inline (the rule before
  2026-11-29, which did not see them);
- a call through a backend table (`be->op(...)`) is a visit to include/fitllm/backend.h (the
  contract; which backend runs is a run-time choice); other calls through pointers are not
  followed (listed with --verbose);
- layers, top to bottom: cli, lab/plan, train/config, model/lora, backend, comm/mem/core (a header of
  include/fitllm/ belongs to its module). A climb is a step of the path from a file of a lower
  layer to one of a higher layer (a return, or a call upward).

Usage: tools/callpath.py [--root DIR] [--file src/train/trainer.c] [--func train_step] [--verbose] [--no-inline]
Needs only Python 3 (no compiler); comments, strings and preprocessor lines but #define are dropped.
"""
import argparse
import os
import re
import sys

LAYER = {"cli": 0, "lab": 1, "plan": 1, "config": 2, "train": 2, "model": 3, "lora": 3, "backend": 4,
         "comm": 5, "mem": 5, "core": 5}
HEADER_MODULE = {"status": "core", "mem": "mem", "backend": "backend", "model": "model", "train": "train",
                 "lora": "lora", "comm": "comm", "generate": "model", "plan": "plan", "lab": "lab",
                 "backend_op": "backend"}
KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "do", "else", "case", "defined",
            "_Alignof", "_Static_assert", "__attribute__", "typeof"}


def layer_of(path):
    parts = path.split("/")
    if parts[0] == "include":
        base = os.path.splitext(parts[-1])[0]
        return LAYER.get(HEADER_MODULE.get(base, "core"), 5)
    if parts[0] == "src" and len(parts) > 2:
        return LAYER.get(parts[1], 3)
    return 3


def strip(text, keep_lines=False):
    """Comments and string/char literals out (lengths kept), continuation lines joined; keep_lines: every newline
    kept instead (a block comment's too; a literal ends at its line's end) and continuations left as they are."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(" " + ("\n" * text.count("\n", i, j) if keep_lines else ""))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and not (keep_lines and text[j] == "\n"):
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    s = "".join(out)
    return s if keep_lines else s.replace("\\\n", " ")


def match_paren(s, i):
    """Index after the ')' matching the '(' at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "(":
            depth += 1
        elif s[j] == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(s)



DEF_RE = re.compile(r"(\w+)\s*\(")


def top_level_defs(text, keywords=None):
    """Top-level function definitions of stripped text (NAME(...) { at brace depth 0): (name, start of the name,
    its opening brace, its closing brace, the end of its parameter list), in source order. Shared with
    tools/sizecheck.py."""
    keywords = KEYWORDS if keywords is None else keywords
    depth, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif depth == 0:
            m = DEF_RE.match(text, i)
            if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
                end = match_paren(text, m.end() - 1)
                k = end
                while k < n and text[k] in " \t\n":
                    k += 1
                if k < n and text[k] == "{" and m.group(1) not in keywords:
                    d = 0
                    for j in range(k, n):
                        if text[j] == "{":
                            d += 1
                        elif text[j] == "}":
                            d -= 1
                            if d == 0:
                                break
                    yield m.group(1), i, k, j, end
                    i = j + 1
                    continue
                i = m.end()
                continue
        i += 1

def scan(root):
    funcs = {}     # name -> {file: body}  (static and global definitions)
    statics = {}   # (file, name) -> body
    macros = {}    # name -> (file, body)
    for top in ("src", "include"):
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if not f.endswith((".c", ".h")):
                    continue
                path = os.path.relpath(os.path.join(d, f), root)
                text = strip(open(os.path.join(root, path), errors="replace").read())
                lines = []
                for line in text.split("\n"):
                    m = re.match(r"\s*#\s*define\s+(\w+)\(([^)]*)\)\s*(.*)", line)
                    if m:
                        macros.setdefault(m.group(1), (path, m.group(3)))
                    lines.append("" if line.lstrip().startswith("#") else line)
                text = "\n".join(lines)
                for name, i, k, j, _ in top_level_defs(text):
                    body = text[k + 1:j]
                    head = text[max(0, text.rfind("\n", 0, i)):i]
                    if re.search(r"\bstatic\b", head):
                        statics[(path, name)] = body
                    else:
                        funcs.setdefault(name, {})[path] = body
    return funcs, statics, macros


def calls_in(body):
    """Calls in source order: ('fn', name) | ('be', op) | ('ptr', expr); arguments before the call."""
    out = []
    for m in re.finditer(r"(->|\.)?\s*(\b\w+)\s*\(", body):
        arrow, name = m.group(1), m.group(2)
        if name in KEYWORDS:
            continue
        if arrow:
            pre = body[max(0, m.start() - 12):m.start()]
            out.append((m.end(), ("be", name) if re.search(r"\bbe$", pre.rstrip()) else ("ptr", name)))
        else:
            # a call's arguments run before it: order by the closing parenthesis
            out.append((match_paren(body, m.end() - 1), ("fn", name)))
    out.sort(key=lambda t: t[0])
    return [c for _, c in out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--file", default="src/train/trainer.c")
    ap.add_argument("--func", default="train_step")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--every", action="store_true", help="count every call (default: a function's first call only)")
    ap.add_argument("--no-inline", action="store_true", help="a header's static function is no visit (the old rule)")
    a = ap.parse_args()
    funcs, statics, macros = scan(a.root)
    header_statics = {}
    for (path, name), body in ([] if a.no_inline else sorted(statics.items())):
        if path.endswith(".h"):
            header_statics.setdefault(name, (path, body))
    path_files = []
    unresolved = set()
    expanded = set()

    def resolve(name, file):
        if (file, name) in statics:
            return file, statics[(file, name)]
        if name in funcs:
            defs = funcs[name]
            f = file if file in defs else sorted(defs)[0]
            return f, defs[f]
        if name in macros:
            return macros[name][0], macros[name][1]
        if name in header_statics:
            return header_statics[name]
        return None, None

    def walk(file, body, depth):
        for kind, name in calls_in(body):
            if kind == "be":
                if ("be", name) in expanded and not a.every:
                    continue
                expanded.add(("be", name))
                path_files.append("include/fitllm/backend.h")
                path_files.append(file)
                continue
            if kind == "ptr":
                unresolved.add(name)
                continue
            f, b = resolve(name, file)
            if f is None:
                continue
            key = (f, name)
            if key in expanded and not a.every:
                continue
            path_files.append(f)
            if a.verbose:
                print("  " * depth + f"{name}  [{f}]")
            if key not in expanded:
                expanded.add(key)
                walk(f, b, depth + 1)
            path_files.append(file)

    f, body = resolve(a.func, a.file)
    if body is None:
        sys.exit(f"callpath: {a.func} not found in {a.file}")
    path_files.append(a.file)
    walk(a.file, body, 0)
    seq = [p for i, p in enumerate(path_files) if i == 0 or p != path_files[i - 1]]
    climbs = sum(1 for i in range(1, len(seq)) if layer_of(seq[i]) < layer_of(seq[i - 1]))
    files = sorted(set(seq))
    print(f"{a.func} ({a.file}): {len(files)} files entered, {len(seq) - 1} file changes, {climbs} climbs")
    for x in files:
        print(f"  L{layer_of(x)} {x}")
    if a.verbose:
        by = {}
        for i in range(1, len(seq)):
            if layer_of(seq[i]) < layer_of(seq[i - 1]):
                by[(seq[i - 1], seq[i])] = by.get((seq[i - 1], seq[i]), 0) + 1
        print("climbs by (from, to):")
        for (f, t), n in sorted(by.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4d}  {f} -> {t}")
    if a.verbose and unresolved:
        print("not followed (calls through pointers): " + " ".join(sorted(unresolved)))


if __name__ == "__main__":
    main()
