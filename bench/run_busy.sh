#!/usr/bin/env bash
# Shared-machine benchmark: a 1-step finetune_full on stories260K-hf, idle and with one
# competing busy process (a shell spin loop on one core), alternating, R rounds each.
# Prints each run's wall time and the medians; the target is busy/idle <= 2 (issue #11).
#
#   bench/run_busy.sh                 # R=5, default threads (all cores)
#   R=7 THREADS=1 bench/run_busy.sh
#   EXTRA="--precision bf16-true" bench/run_busy.sh
# Env: FITLLM (./build/fitllm), FITLLM_DATA (../shared/data), R (5), THREADS (0 = default),
#      EXTRA (more fitllm options).
set -euo pipefail
cd "$(dirname "$0")/.."
FITLLM=${FITLLM:-./build/fitllm}
DATA=${FITLLM_DATA:-../shared/data}
R=${R:-5}
THREADS=${THREADS:-0}
EXTRA=${EXTRA:-}
MODEL="$DATA/stories260K-hf"
[[ -d "$MODEL" ]] || { echo "error: $MODEL not found (set FITLLM_DATA)" >&2; exit 2; }
TARG=""; [[ "$THREADS" != 0 ]] && TARG="--threads $THREADS"

one() { # prints wall seconds of one 1-step run
    local out; out=$(mktemp -d)
    local t0 t1
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    "$FITLLM" finetune_full "$MODEL" --data Synthetic --train.max_steps 1 --train.micro_batch_size 4 \
        --train.max_seq_length 128 --out_dir "$out/run" $TARG $EXTRA >/dev/null 2>&1 \
        || { echo "error: fitllm run failed (rerun by hand to see why)" >&2; rm -rf "$out"; exit 1; }
    t1=$(date +%s.%N)
    rm -rf "$out"
    awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f\n", b - a}'
}
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

echo "# $(date -u +%FT%TZ) cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1) nproc=$(nproc) loadavg=$(cut -d' ' -f1-3 /proc/loadavg)"
echo "# OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-<unset>} GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-<unset>} threads=${THREADS} extra='${EXTRA}'"
one >/dev/null  # warm-up (page cache)
idle=() busy=()
for ((r = 0; r < R; r++)); do
    idle+=("$(one)")
    sh -c 'while :; do :; done' & spin=$!
    sleep 0.2
    busy+=("$(one)")
    kill "$spin"; wait "$spin" 2>/dev/null || true
    echo "round $((r + 1)): idle ${idle[-1]} s, busy ${busy[-1]} s"
done
mi=$(printf '%s\n' "${idle[@]}" | median)
mb=$(printf '%s\n' "${busy[@]}" | median)
awk -v i="$mi" -v b="$mb" 'BEGIN {printf "median idle %.3f s, busy %.3f s, busy/idle %.2f\n", i, b, b / i}'
