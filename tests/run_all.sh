#!/usr/bin/env bash
# `make test`'s stages, in order, with one summary at the end:
#   tracked-sizes  tests/check_tracked_sizes.sh (no tracked file over 5 MB)
#   unit           $BUILD/fitllm_tests (the release build's unit tests; FITLLM_TEST_JOBS processes)
#   alloc-check    $BUILD/fitllm_alloc_check (allocations above 1 MiB go through the pool)
#   cuda-check     $BUILD/fitllm_cuda_check (CUDA builds only: real kernels vs emulated ones)
#   vectorized     tests/check_vectorized.sh (the marked hot loops still vectorize)
#   cli            tests/cli_test.sh (exit codes and messages of the CLI)
#   mpi            tests/mpi_test.sh (mpirun -np 2 and 4)
#   fuzz-smoke     quick tier: every harness's seeds (and the shared files fuzz/run.sh adds) replayed once through
#                  the ASan build's replay binaries ($ASAN_BUILD/fuzz-replay: the harnesses linked with
#                  fuzz/replay_main.c by `make asan-build`), FUZZ_JOBS at a time (FUZZ_REPLAY=DIR fuzz/run_all.sh);
#                  full tier: fuzz/build.sh (clang, libFuzzer) then every harness for FUZZ_SMOKE_TIME s from its
#                  seeds (fuzz/run_all.sh; a crash input is kept in build-fuzz/artifacts/)
#   asan           `make asan`: the unit tests again under ASan+UBSan+LSan ($ASAN_BUILD); after a unit or cli stage the pass
#                  starts in the background as soon as its build ends (one test worker at nice 19 beside the MPI
#                  stage, on the core the builds leave), and gets its FITLLM_TEST_JOBS-th worker when this stage
#                  begins (tests/main.c FITLLM_TEST_JOBS_MORE); the stage prints its log when it ends
# Two tiers (FITLLM_TEST_TIER in the environment; README "Two tiers"; tests/test.h says where a new test goes):
#   quick (default; `make test`, what CI runs, <= 15 min on 2 busy cores with its builds): every code path
#          once. Sweeps keep one case per path, tests that only re-run release-pass code at bigger shapes or more
#          steps (bit-identity sweeps, emulated-GPU runs) skip under ASan (fl_test_asan_budget) or run a subset
#          (fl_test_asan_light) - every fault-injection, bad-input, resume and checkpoint-failure path still runs
#          under ASan -, CLI/MPI cases that repeat other cases' paths are left out (tier_skip, naming those),
#          and the fuzz stage replays every harness's seeds under ASan + UBSan (no clang build, no mutation: the
#          seeds' replay is what catches regressions; it was 3 s of libFuzzer per harness, 63 CPU s of clang build
#          and ~55 of fuzzing before 2026-11-30).
#   full   (`make test-full`, FITLLM_TEST_TIER=full): everything, in both passes (the old FITLLM_TEST_ASAN_ALL=1),
#          the long CLI / MPI cases and 10 s of libFuzzer per harness from its seeds (the clang build). Run it before a release, or after changing
#          what a sweep covers.
# When unit or cli runs before fuzz-smoke and/or asan, their builds (the full tier's fuzz/build.sh at FUZZ_OPT="-O0
# -gline-tables-only", 63 CPU s from scratch (-O1 -g: ~100 quiet); then `make asan-build`, ~295 CPU s with tests/*.c
# at -O1, the library at -O2, and the replay binaries) run one after the other at nice 19 in the background from the
# first of those stages on (ASAN_PREBUILD=0: not; from the unit stage since 2026-11-30: its thread-rank tests' waits
# leave about a third of a core): the CLI
# and MPI cases keep about one core busy (151 and 141 CPU s in 139 and 179 s of cases on 2 quiet cores), the builds
# take the other (~340 CPU s spare, ~340 CPU s of builds); fuzz-smoke and asan wait for theirs (logs:
# $BUILD/test-logs/fuzz-build.log, asan-build.log). The unit logs give each test's CPU and wall time
# (`ok   NAME  [cpu C ms]  T ms`): `make test` is CPU-bound on 2 cores (~1,900 CPU s in all from a clean
# checkout), so CPU seconds are what a change to it is measured in.
# Every stage runs even after one fails. Each stage's output is shown as it runs and kept in
# $BUILD/test-logs/<stage>.log; its counts are its last line of the form "N passed, N failed[, N
# skipped]" (a stage that prints none counts as one check: passed when it exits 0). A stage that
# exits non-zero counts at least one failure. The end: a table (stage, result, counts, wall time)
# and one line "make test: N passed, N failed, N skipped"; the exit status is 1 when any stage failed.
# Usage: tests/run_all.sh (from the Makefile: BUILD, ASAN_FILTER, JOBS, FUZZ_JOBS, FITLLM_TEST_TIER in the environment)
#        tests/run_all.sh STAGE...   runs only the stages named (e.g. tests/run_all.sh unit cli)
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
ASAN_BUILD=${ASAN_BUILD:-build-asan}
MAKE=${MAKE:-make}
ASAN_FILTER=${ASAN_FILTER:-}
FITLLM_TEST_TIER=${FITLLM_TEST_TIER:-quick}
case $FITLLM_TEST_TIER in
quick) FUZZ_SMOKE_TIME=${FUZZ_SMOKE_TIME:-0} ;; # the replay (fuzz-smoke below): no libFuzzer time
full)  FUZZ_SMOKE_TIME=${FUZZ_SMOKE_TIME:-10} ;;
*) echo "tests/run_all.sh: FITLLM_TEST_TIER must be quick or full (got '$FITLLM_TEST_TIER')"; exit 2 ;;
esac
export FITLLM_TEST_TIER
FUZZ_JOBS=${FUZZ_JOBS:-2}
# the smoke run's clang build: -O0 (a quarter of -O1's compile time with ASan + coverage; fuzz/build.sh)
export FUZZ_OPT=${FUZZ_OPT:--O0 -gline-tables-only}
# the unit tests (release and ASan) in this many processes (tests/main.c, FITLLM_TEST_JOBS): one per
# core, at least 2 (most tests keep one core busy), at most 4
if [ -z "${FITLLM_TEST_JOBS:-}" ]; then
    FITLLM_TEST_JOBS=$(nproc 2>/dev/null || echo 2)
    [ "$FITLLM_TEST_JOBS" -lt 2 ] && FITLLM_TEST_JOBS=2
    [ "$FITLLM_TEST_JOBS" -gt 4 ] && FITLLM_TEST_JOBS=4
fi
export FITLLM_TEST_JOBS
LOGS=$BUILD/test-logs
mkdir -p "$LOGS"

# The tests' scratch files (checkpoints, offload files, the CLI's and MPI's runs: ~6 GB written by the unit stage,
# ~1.5 GB at once by the CLI's) go to a memory folder when there is room: on a disk the writes and the checkpoints'
# fsyncs cost the unit stage 21% of its wall time and the CLI / MPI stages 12% (docs/BENCHMARKS.md "make test's
# time"). FITLLM_TEST_TMP=auto (default): a fresh folder under /dev/shm when it has 4 GiB free and
# the machine 8 GiB available, else TMPDIR (or /tmp) as before; =disk: never; a TMPDIR set by the caller is kept.
FITLLM_TEST_TMP=${FITLLM_TEST_TMP:-auto}
case $FITLLM_TEST_TMP in
auto | disk) ;;
*) echo "tests/run_all.sh: FITLLM_TEST_TMP must be auto or disk (got '$FITLLM_TEST_TMP')"; exit 2 ;;
esac
if [ "$FITLLM_TEST_TMP" = auto ] && [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then
    shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }')
    mem_avail=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo 2>/dev/null)
    if [ "${shm_free:-0}" -ge $((4 * 1024 * 1024)) ] && [ "${mem_avail:-0}" -ge $((8 * 1024 * 1024)) ] &&
        FL_TEST_SHM=$(mktemp -d /dev/shm/fitllm-make-test-XXXXXX 2>/dev/null); then
        export TMPDIR=$FL_TEST_SHM
        trap 'rm -rf "$FL_TEST_SHM"' EXIT
    fi
fi
echo "tests/run_all.sh: scratch files under ${TMPDIR:-/tmp} (FITLLM_TEST_TMP=$FITLLM_TEST_TMP)"

STAGES=(tracked-sizes unit alloc-check cuda-check vectorized cli mpi fuzz-smoke asan)
stage_cmd() {
    case $1 in
    tracked-sizes) tests/check_tracked_sizes.sh ;;
    unit)          "./$BUILD/fitllm_tests" ;;
    alloc-check)   "./$BUILD/fitllm_alloc_check" ;;
    cuda-check)    "./$BUILD/fitllm_cuda_check" ;;
    vectorized)    tests/check_vectorized.sh "$BUILD" ;;
    cli)           tests/cli_test.sh "./$BUILD/fitllm" ;;
    mpi)           tests/mpi_test.sh "$BUILD" ;;
    fuzz-smoke)    local t0=$SECONDS
                   if [ "$FITLLM_TEST_TIER" = quick ]; then # the seeds replayed through the ASan build's binaries
                       if [ $want_prebuild = 1 ]; then prebuild_wait asan-build || return 1
                       else "$MAKE" --no-print-directory asan-build || return 1; fi
                       FUZZ_REPLAY="$ASAN_BUILD/fuzz-replay" fuzz/run_all.sh 0 "$FUZZ_JOBS"
                       return
                   fi
                   if [ $want_prebuild_fuzz = 1 ]; then
                       prebuild_wait fuzz-build || return 1
                   else
                       fuzz/build.sh || return 1
                       echo "fuzz-smoke: clang build $((SECONDS - t0)) s"
                   fi
                   FUZZ_FRESH=1 fuzz/run_all.sh "$FUZZ_SMOKE_TIME" "$FUZZ_JOBS" ;;
    asan)          prebuild_wait asan-build || return 1
                   if [ $want_early_asan = 1 ]; then # started by the background chain with one worker: a second now
                       touch "$LOGS/asan-more"
                       while [ ! -f "$LOGS/asan-tests.rc" ] && kill -0 "$PREBUILD_PID" 2>/dev/null; do sleep 1; done
                       echo "asan: the pass started in the background at the end of its build, one worker until this" \
                            "stage, $FITLLM_TEST_JOBS since"
                       cat "$LOGS/asan-tests.out"
                       return "$(cat "$LOGS/asan-tests.rc" 2>/dev/null || echo 1)"
                   fi
                   "$MAKE" --no-print-directory asan ASAN_FILTER="$ASAN_FILTER" ;;
    *) echo "tests/run_all.sh: unknown stage '$1' (stages: ${STAGES[*]})"; return 2 ;;
    esac
}

[ $# -gt 0 ] && STAGES=("$@")

# the background builds (above): started before the unit (or cli) stage, one after the other at nice 19 - the clang fuzz
# build first when fuzz-smoke runs after cli (it was a serial ~100 CPU s at the start of that stage), then the ASan
# build when asan runs after cli -, each waited for by its stage (a pipeline's subshell: it polls for the exit
# status file each build leaves, $LOGS/<build>.rc, and whether the chain still runs)
PREBUILD_PID=
prebuild_start() {
    rm -f "$LOGS/fuzz-build.rc" "$LOGS/asan-build.rc" "$LOGS/asan-tests.rc" "$LOGS/asan-more"
    ( if [ $want_prebuild_fuzz = 1 ]; then
          nice -n 19 fuzz/build.sh >"$LOGS/fuzz-build.log" 2>&1
          echo $? >"$LOGS/fuzz-build.rc"
      fi
      if [ $want_prebuild = 1 ]; then
          nice -n 19 "$MAKE" --no-print-directory asan-build >"$LOGS/asan-build.log" 2>&1
          rc=$?
          echo $rc >"$LOGS/asan-build.rc"
          # the ASan pass itself, on the core the builds leave while the MPI stage runs: one worker at nice 19, its
          # second when the asan stage begins ($LOGS/asan-more; tests/main.c FITLLM_TEST_JOBS_MORE)
          if [ $rc = 0 ] && [ $want_early_asan = 1 ]; then
              more="$PWD/$LOGS/asan-more:$FITLLM_TEST_JOBS" # (expanded before the one-worker setting below)
              ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 FITLLM_TEST_JOBS=1 FITLLM_TEST_JOBS_MORE="$more" \
                  nice -n 19 "./$ASAN_BUILD/fitllm_tests" $ASAN_FILTER >"$LOGS/asan-tests.out" 2>&1
              echo $? >"$LOGS/asan-tests.rc"
          fi
      fi ) &
    PREBUILD_PID=$!
    PREBUILD_T0=$SECONDS
}
prebuild_wait() { # asan-build | fuzz-build
    [ -n "$PREBUILD_PID" ] || return 0
    while [ ! -f "$LOGS/$1.rc" ] && kill -0 "$PREBUILD_PID" 2>/dev/null; do sleep 1; done
    local rc
    rc=$(cat "$LOGS/$1.rc" 2>/dev/null || echo 1)
    echo "${1%-build}: the ${1%-build} build ran in the background from the unit / cli stage on ($((SECONDS - PREBUILD_T0)) s since; exit $rc)"
    [ "$rc" -eq 0 ] || { tail -n 30 "$LOGS/$1.log"; return 1; }
}
want_prebuild=0        # 1 when asan runs after cli
want_prebuild_fuzz=0   # 1 when fuzz-smoke runs after cli
want_early_asan=0      # 1 when asan runs after cli: its pass starts in the background when its build ends
if [ "${ASAN_PREBUILD:-1}" != 0 ]; then
    seen_cli=0
    for st in "${STAGES[@]}"; do
        { [ "$st" = unit ] || [ "$st" = cli ]; } && seen_cli=1
        [ "$st" = asan ] && [ $seen_cli = 1 ] && want_prebuild=1 && want_early_asan=1
        [ "$st" = fuzz-smoke ] && [ $seen_cli = 1 ] && [ "$FITLLM_TEST_TIER" = full ] && want_prebuild_fuzz=1
        [ "$st" = fuzz-smoke ] && [ $seen_cli = 1 ] && [ "$FITLLM_TEST_TIER" = quick ] && want_prebuild=1
    done
fi
declare -a R_NAME R_RES R_P R_F R_S R_T
tp=0; tf=0; ts=0; nfail=0; t_all=$SECONDS
for st in "${STAGES[@]}"; do
    log=$LOGS/$st.log
    if [ "$st" = cuda-check ] && [ ! -x "./$BUILD/fitllm_cuda_check" ]; then
        R_NAME+=("$st"); R_RES+=("not built"); R_P+=(0); R_F+=(0); R_S+=(0); R_T+=(0)
        continue
    fi
    # the background chain from the first of the unit and cli stages on (the unit pass leaves a third of a core in its
    # thread-rank tests' waits; the chain at nice 19 takes what the stages leave)
    { [ "$st" = unit ] || [ "$st" = cli ]; } && [ -z "$PREBUILD_PID" ] && [ $((want_prebuild + want_prebuild_fuzz)) -gt 0 ] &&
        prebuild_start
    echo
    echo "==== make test: $st ($FITLLM_TEST_TIER tier) ===="
    t0=$SECONDS
    stage_cmd "$st" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    dt=$((SECONDS - t0))
    line=$(grep -aE '[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1)
    if [ -n "$line" ]; then
        p=$(grep -oE '[0-9]+ passed' <<<"$line" | tail -n 1 | cut -d' ' -f1)
        f=$(grep -oE '[0-9]+ failed' <<<"$line" | tail -n 1 | cut -d' ' -f1)
        s=$(grep -oE '[0-9]+ skipped' <<<"$line" | tail -n 1 | cut -d' ' -f1)
        s=${s:-0}
    elif [ "$rc" -eq 0 ]; then
        p=1; f=0; s=0
    else
        p=0; f=1; s=0
    fi
    # a crash after the count line (a leak report at exit, a signal) is still a failure
    [ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
    res=ok
    [ "$rc" -ne 0 ] && { res="FAILED (exit $rc)"; nfail=$((nfail + 1)); }
    R_NAME+=("$st"); R_RES+=("$res"); R_P+=("$p"); R_F+=("$f"); R_S+=("$s"); R_T+=("$dt")
    tp=$((tp + p)); tf=$((tf + f)); ts=$((ts + s))
done

total=$((SECONDS - t_all))
echo
echo "==== make test: summary, $FITLLM_TEST_TIER tier (logs in $LOGS/) ===="
printf '%-14s %-18s %7s %7s %7s %9s\n' stage result passed failed skipped time
for i in "${!R_NAME[@]}"; do
    printf '%-14s %-18s %7d %7d %7d %6d:%02d\n' "${R_NAME[$i]}" "${R_RES[$i]}" "${R_P[$i]}" "${R_F[$i]}" \
        "${R_S[$i]}" $((R_T[i] / 60)) $((R_T[i] % 60))
done
printf '%-14s %-18s %7d %7d %7d %6d:%02d\n' total "$nfail stage(s) failed" "$tp" "$tf" "$ts" $((total / 60)) \
    $((total % 60))
echo "make test: $tp passed, $tf failed, $ts skipped"
[ "$nfail" -eq 0 ]
