#!/usr/bin/env bash
# 8-bit AdamW on the CPU, fitllm against bitsandbytes' AdamW8bit, in turn ROUNDS times (the machine's load drifts):
#   PY=/path/to/venv/bin/python bench/run_adam8bit_bench.sh [threads=2] [n=26000000] [rounds=3]
# Needs build/adam8bit_bench (make build) and a python with torch and bitsandbytes (tests/ref/requirements.txt).
set -eu
T=${1:-2} N=${2:-26000000} R=${3:-3} PY=${PY:-python3}
B=${BUILD:-build}/adam8bit_bench
[ -x "$B" ] || { echo "run_adam8bit_bench: $B missing (make build)"; exit 1; }
"$PY" -c "import bitsandbytes, torch" 2>/dev/null || { echo "run_adam8bit_bench: $PY lacks torch / bitsandbytes"; exit 1; }
echo "$(date -u) $(lscpu | sed -n 's/^Model name: *//p') threads $T n $N"
for r in $(seq 1 "$R"); do
    OMP_NUM_THREADS=$T "$B" "$T" "$N" 5
    "$PY" "$(dirname "$0")/bench_adam8bit_torch.py" "$T" "$N" 5
done
