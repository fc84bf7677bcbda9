#!/usr/bin/env python3
"""The files one training step actually enters (docs/ARCHITECTURE.md "The step's call path, counted"), beside
tools/callpath.py's static count.

Runs `fitllm bench-step` (default: tests/fixtures/golden-llama, a 3-layer LLaMA from a Hugging Face folder, a full
fine-tune in fp32, one process, one thread, one timed step of 16 tokens, no warm-up) under valgrind's callgrind with
collection on inside fl_step_run only, then maps every function that ran there to the file that defines it with
callpath.py's scan of src/ and include/ (a static function
whose name several files define goes to those of them that ran another function, else to each of them). Functions the
compiler inlined into their caller do not appear: they are counted with their caller's file (the figure is then a
lower bound for a static inline of another file; a header's static inline is the case). The backend's kernels are
reported apart (the static count stops at the door, include/fitllm/backend_op.h).

Usage: tools/callpath_dyn.py [--build build] [--verbose] [-- extra bench-step options]
Needs valgrind (callgrind, callgrind_annotate) and a built fitllm; nothing else.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callpath  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("extra", nargs="*", help="bench-step options (after --)")
    a = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    exe = os.path.join(a.build, "fitllm")
    model = os.path.join(root, "tests/fixtures/golden-llama")
    args = a.extra or [model, "--micro-batch", "1", "--seq", "16", "--steps", "1", "--warmup", "0", "--threads", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        # the settings fl_cpu_process_init would otherwise re-exec the program to set (valgrind refuses that exec)
        env = dict(os.environ, FITLLM_THREADS="1", OMP_WAIT_POLICY="passive", OPENBLAS_THREAD_TIMEOUT="4")
        cmd = ["valgrind", "--tool=callgrind", "--toggle-collect=fl_step_run", f"--callgrind-out-file={out}", exe,
               "bench-step"] + args
        r = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            sys.exit("callpath_dyn: " + " ".join(cmd) + " failed:\n" + r.stderr[-2000:])
        ann = subprocess.run(["callgrind_annotate", "--threshold=100", out], capture_output=True, text=True).stdout
        names = set()
        for line in ann.splitlines():  # "  1,234 (12.3%)  file:function [object]": functions with instructions run
            m = re.match(r"\s*[\d,]+\s+(?:\([^)]*\)\s+)?\S*?:(\w+)", line)
            if m:
                names.add(m.group(1))
    funcs, statics, macros = callpath.scan(root)
    by_name = {}
    for (f, n) in statics:
        by_name.setdefault(n, set()).add(f)
    for n, defs in funcs.items():
        by_name.setdefault(n, set()).update(defs)
    # a name one file alone defines says that file ran; a name several define (a static carve_acts) goes to those of
    # them that ran something else, or to all of them when none did
    ran = {next(iter(by_name[n])) for n in names if len(by_name.get(n, ())) == 1}
    files, backend, seen = set(), set(), {}
    for n in sorted(names):
        defs = sorted(by_name.get(n, ()))
        for f in [f for f in defs if f in ran] or defs:
            (backend if f.startswith("src/backend/") else files).add(f)
            seen.setdefault(f, []).append(n)
    print(f"fl_step_run ({' '.join(args)}): {len(files)} files entered outside the backend, "
          f"{len(backend)} backend files (kernels)")
    for f in sorted(files):
        print(f"  L{callpath.layer_of(f)} {f}" + (f"  ({', '.join(seen[f])})" if a.verbose else ""))
    if a.verbose:
        for f in sorted(backend):
            print(f"  backend {f}  ({', '.join(seen[f])})")


if __name__ == "__main__":
    main()
