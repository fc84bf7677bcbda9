#!/usr/bin/env bash
# T5 training-step benchmark (issue 31's performance target: fitllm <= 0.8 x transformers' time): `fitllm bench-step`
# against transformers' T5ForConditionalGeneration (bench/bench_t5_torch.py), fp32 AdamW, the same shapes, side by
# side in alternating rounds (the order within a round alternates too), medians over the rounds.
#
#   bench/run_bench_t5.sh                         # t5-small, B 4, source 128, target 32, 3 rounds
#   ROUNDS=5 SOURCE=256 TARGET=64 bench/run_bench_t5.sh
#
# Env: FITLLM (./build/fitllm), FITLLM_PY (/work/venv-graph/bin/python), SHAPE (t5-small), BATCH (4), SOURCE (128),
#      TARGET (32), ROUNDS (3), STEPS (3), WARMUP (1), THREADS (2),
#      OUT (raw RESULT lines appended there; default bench/out/bench_t5-<date>.txt)
# Prints each run's RESULT line, then per impl the median over rounds and the per-round ratio fitllm/torch.
set -euo pipefail
cd "$(dirname "$0")/.."
FITLLM=${FITLLM:-./build/fitllm}
PY=${FITLLM_PY:-/work/venv-graph/bin/python}
SHAPE=${SHAPE:-t5-small}
BATCH=${BATCH:-4}
SOURCE=${SOURCE:-128}
TARGET=${TARGET:-32}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-1}
THREADS=${THREADS:-2}
OUT=${OUT:-bench/out/bench_t5-$(date -u +%Y%m%dT%H%M%SZ).txt}
[[ -x "$FITLLM" ]] || { echo "error: $FITLLM not found; build first (make build) or set FITLLM" >&2; exit 2; }
"$PY" -c 'import torch, transformers' 2>/dev/null || {
    echo "error: $PY cannot import torch+transformers; set FITLLM_PY or pip install -r tests/ref/requirements.txt" >&2; exit 2; }
mkdir -p "$(dirname "$OUT")"
: > "$OUT.tmp"
{
    echo "# $(date -u +%FT%TZ) host=$(hostname) nproc=$(nproc) cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
    echo "# flags: $(lscpu 2>/dev/null | sed -n 's/^Flags: *//p' | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512bw|avx512vl|avx512_bf16|amx_bf16|fma)$' | tr '\n' ' ')"
    echo "# $("$FITLLM" --version 2>&1 | grep -iE 'gemm library' | head -1)"
    echo "# shape=$SHAPE batch=$BATCH source=$SOURCE target=$TARGET rounds=$ROUNDS steps=$STEPS warmup=$WARMUP threads=$THREADS"
} | tee -a "$OUT"
run_one() { # impl
    local impl=$1 log line
    log=$(mktemp)
    if [[ $impl == fitllm ]]; then
        "$FITLLM" bench-step "$SHAPE" --micro-batch "$BATCH" --source-seq "$SOURCE" --seq "$TARGET" --steps "$STEPS" \
            --warmup "$WARMUP" --threads "$THREADS" >"$log" 2>&1 || { tail -20 "$log" >&2; rm -f "$log"; return 1; }
    else
        "$PY" bench/bench_t5_torch.py --shape "$SHAPE" --batch "$BATCH" --source "$SOURCE" --target "$TARGET" \
            --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" >"$log" 2>&1 || { tail -20 "$log" >&2; rm -f "$log"; return 1; }
    fi
    line=$(grep '^RESULT ' "$log" | tail -1)
    rm -f "$log"
    echo "$line loadavg=$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$OUT" "$OUT.tmp"
}
for ((r = 1; r <= ROUNDS; r++)); do
    echo "== round $r/$ROUNDS" >&2
    if ((r % 2)); then run_one fitllm; run_one torch; else run_one torch; run_one fitllm; fi
done
"$PY" - "$OUT.tmp" <<'PYEOF' | tee -a "$OUT"
import statistics, sys
rows = {"fitllm": [], "torch": []}
for line in open(sys.argv[1]):
    kv = dict(t.split("=", 1) for t in line.split()[1:] if "=" in t)
    rows[kv["impl"]].append(kv)
med = lambda l, k: statistics.median(float(x[k]) for x in l)
for i in ("fitllm", "torch"):
    l = rows[i]
    print(f"{i:<7} rounds {len(l)}  median_ms {med(l, 'median_ms'):10.1f}  tok_s {med(l, 'tok_s'):8.1f}  "
          f"gflops {med(l, 'gflops'):7.2f}  peak_rss_mb {med(l, 'peak_rss_mb'):8.1f}")
r = [float(a["median_ms"]) / float(b["median_ms"]) for a, b in zip(rows["fitllm"], rows["torch"])]
print(f"fitllm/torch time per round: {' '.join(f'{x:.3f}' for x in r)}; median {statistics.median(r):.3f} "
      f"(target <= 0.8)")
PYEOF
rm -f "$OUT.tmp"
echo "raw results: $OUT" >&2
