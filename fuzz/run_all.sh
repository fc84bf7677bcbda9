#!/bin/sh
# Run every harness (or those named) for SECONDS each, JOBS at a time, at nice 19:
#   fuzz/run_all.sh SECONDS JOBS [NAME...]
# Every harness: the binaries fuzz/build.sh built (build-fuzz/harnesses.txt, every fuzz/fuzz_*.c).
# Prints one summary line per harness (fuzz/run.sh), then "fuzz: N passed, N failed, 0 skipped"
# (failed = libFuzzer found a crash, leak, timeout, OOM or sanitizer report; the input is in
# build-fuzz/artifacts/<name>/), and fails if any harness found something.
# FUZZ_FRESH=1 starts each from its seeds only (`make test-full`'s smoke run; fuzz/run.sh).
# FUZZ_REPLAY=DIR: the seeds replayed once through DIR's replay binaries instead (`make test`'s quick tier: DIR =
# build-asan/fuzz-replay, built by `make asan-build`; fuzz/replay_main.c); SECONDS is then ignored.
cd "$(dirname "$0")/.."
secs=${1:-600}
jobs=${2:-2}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
OUT=${FUZZ_REPLAY:-build-fuzz}
list=$OUT/harnesses.txt
[ -f "$list" ] || { echo "fuzz/run_all.sh: $list missing: run ${FUZZ_REPLAY:+make asan-build (the replay binaries) or }fuzz/build.sh first"; exit 2; }
names=${*:-$(cat "$list")}
mkdir -p $OUT/logs
sum=$OUT/logs/summary.txt
[ "${FUZZ_FRESH:-0}" = 1 ] && sum=$OUT/logs/smoke-summary.txt
: > "$sum"
echo $names | tr ' ' '\n' | grep . |
    xargs -P "$jobs" -I{} sh -c "nice -n 19 fuzz/run.sh {} $secs >> $sum 2>&1"
cat "$sum"
pass=$(grep -c ': rc=0 ' "$sum")
fail=$(echo $names | wc -w); fail=$((fail - pass))
if [ "$fail" -gt 0 ]; then
    echo "fuzz: failing harnesses: $(grep -E '^fuzz_[a-z0-9_]*: rc=[1-9]' "$sum" | cut -d: -f1 | tr '\n' ' ')(crash inputs in build-fuzz/artifacts/<name>/)"
fi
echo "fuzz: $pass passed, $fail failed, 0 skipped"
[ "$fail" -eq 0 ]
