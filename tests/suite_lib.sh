# Sourced by tests/cli_test.sh and tests/mpi_test.sh after their early exits (after pass/fail/skip are set).
#
# The tier (README "Two tiers", tests/test.h): FITLLM_TEST_TIER=full (`make test-full`) runs every case; unset or
# "quick" (`make test`) leaves out the cases that only repeat paths other quick-tier cases run. A long case (> ~5 s)
# whose paths others cover goes in the full tier only:
#   if full_tier; then
#       ...the case(s)...
#   else tier_skip NAME "the quick-tier cases that cover its paths"; fi
# First look for a cheaper equivalent in both tiers where the case's checks allow it (no tolerance loosened): e.g.
# the TextFiles pretrain cases skip the final validation pass none of their checks reads (8-14 s each), lab_quick
# trains one step per row (its verdicts and files are those of two).
FITLLM_TEST_TIER=${FITLLM_TEST_TIER:-quick}
# The runtimes' settings fl_cpu_process_init gives a fitllm process by executing itself again (OMP_WAIT_POLICY=passive,
# and OPENBLAS_THREAD_TIMEOUT=4 for an OpenBLAS build), exported once here when the caller chose none: each fitllm
# process the scripts start then starts once, with the same settings (a start costs ~22 ms of CPU with its 50 shared
# libraries: `fitllm --version` 45 -> 23 ms; the CLI stage 181.9 -> 172.3 CPU s, MPI 140.6 -> 134.2, one run each on
# 2 Zen 3 vCPUs, docs/BENCHMARKS.md "make test's time"). The CLI's omp_* cases unset them to check the default.
if [ -z "${OMP_WAIT_POLICY:-}${GOMP_SPINCOUNT:-}${KMP_BLOCKTIME:-}" ]; then export OMP_WAIT_POLICY=passive; fi
if [ -z "${OPENBLAS_THREAD_TIMEOUT:-}" ]; then export OPENBLAS_THREAD_TIMEOUT=4; fi
full_tier() { [ "$FITLLM_TEST_TIER" = full ]; }
tier_skip() { echo "skip $1: full tier only (FITLLM_TEST_TIER=full); the quick tier covers it in $2"; skip=$((skip + 1)); }

# Per-case times: each result line the script prints ("ok ...", "FAIL ...", "skip ...") gets the CPU time (user +
# system of the script's finished child processes, /proc/PID/stat) and the wall time since the previous result line
# (a case's set-up before its check counts to it): "ok   NAME ...  [cpu C ms]  T ms", the wall time last like
# fitllm_tests' lines. On a loaded machine compare the CPU times (wall times of waiting, multi-threaded cases grow
# with the load). The slowest cases of a log:
#   awk '/^ok/ { print $(NF-1), $2 }' build/test-logs/cli.log | sort -rn | head                 (wall)
#   sed -nE 's/^ok +([^ ]+).*\[cpu ([0-9]+) ms\].*/\2 \1/p' build/test-logs/cli.log | sort -rn | head   (CPU)
# (bash 5: EPOCHREALTIME). The script's EXIT trap calls fl_case_laps_end so that the last lines come out before it ends.
FL_CASE_LAPS_MAIN=$$
FL_CASE_LAPS_TICK_MS=$((1000 / $(getconf CLK_TCK 2>/dev/null || echo 100)))
fl_case_laps_cpu_ms() { # user + system ms of the main script's children that have ended (cutime + cstime)
    local st f
    read -r st < "/proc/$FL_CASE_LAPS_MAIN/stat" 2>/dev/null || { echo 0; return; }
    read -ra f <<< "${st##*) }"
    echo $(((f[13] + f[14]) * FL_CASE_LAPS_TICK_MS))
}
fl_case_laps_filter() {
    local line now prev=${EPOCHREALTIME//[.,]/} cpu cprev
    cprev=$(fl_case_laps_cpu_ms)
    while IFS= read -r line; do
        case $line in
        "ok "*|"FAIL "*|"skip "*)
            now=${EPOCHREALTIME//[.,]/}
            cpu=$(fl_case_laps_cpu_ms)
            printf '%s  [cpu %d ms]  %d ms\n' "$line" $((cpu - cprev)) $(((now - prev) / 1000)); prev=$now; cprev=$cpu ;;
        *) printf '%s\n' "$line" ;;
        esac
    done
}
exec > >(fl_case_laps_filter)
FL_CASE_LAPS_PID=$!
# close the filter's input and give it up to 5 s to print what is left (a stray background process holding
# stdout would keep it open: then the script ends anyway)
fl_case_laps_end() {
    exec >&-
    local i
    for i in $(seq 100); do kill -0 "$FL_CASE_LAPS_PID" 2>/dev/null || return 0; sleep 0.05; done
}
