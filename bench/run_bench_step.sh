#!/usr/bin/env bash
# Training-step benchmark: fitllm (C) vs PyTorch, alternating rounds.
#
#   bench/run_bench_step.sh            # shapes: tiny small, 3 rounds each
#   ROUNDS=1 SHAPES="tiny" bench/run_bench_step.sh
#   TORCH_ONLY=1 bench/run_bench_step.sh   # skip the C side (e.g. no build yet)
#
# Env: FITLLM (default ./build/fitllm), FITLLM_PY (default /work/venv/bin/python),
#      ROUNDS (3), SHAPES ("tiny small"), STEPS (10), THREADS (2), BATCH (4), SEQ (256),
#      PRECISION (32-true, bf16-mixed or bf16-true), ACT_CKPT (0/1), LORA (rank, 0 = off),
#      QUANTIZE (QLoRA base, needs LORA: nf4 or nf4-dq; fitllm gets --quantize bnb.<mode>,
#      torch bitsandbytes 4-bit, see bench/bench_step_torch.py),
#      OUT (raw RESULT lines are appended there; default bench/out/bench_step-<date>.txt)
# Prints the median step table and a per-phase table (forward, head+loss, backward, optimizer).
set -euo pipefail
cd "$(dirname "$0")/.."

FITLLM=${FITLLM:-./build/fitllm}
PY=${FITLLM_PY:-/work/venv/bin/python}
ROUNDS=${ROUNDS:-3}
PRECISION=${PRECISION:-32-true}      # or bf16-mixed (torch: autocast bf16), bf16-true (torch: model.to(bf16))
ACT_CKPT=${ACT_CKPT:-0}              # 1: activation checkpointing on both sides
CKPT_ARG=""; [[ "$ACT_CKPT" == 1 ]] && CKPT_ARG="--act-ckpt"
LORA=${LORA:-0}                      # LoRA rank (both sides: q_proj+v_proj, alpha 2r); 0 = full fine-tune
[[ "$LORA" != 0 ]] && CKPT_ARG="$CKPT_ARG --lora $LORA"
QUANTIZE=${QUANTIZE:-}               # nf4 | nf4-dq (QLoRA, needs LORA); empty = no quantization
if [[ -n "$QUANTIZE" ]]; then
    [[ "$LORA" != 0 ]] || { echo "error: QUANTIZE=$QUANTIZE needs LORA=<rank> (QLoRA)" >&2; exit 2; }
    CKPT_ARG="$CKPT_ARG --quantize bnb.${QUANTIZE#bnb.}"
fi
SHAPES=${SHAPES:-"tiny small"}
STEPS=${STEPS:-10}
THREADS=${THREADS:-2}
BATCH=${BATCH:-4}
SEQ=${SEQ:-256}
TORCH_ONLY=${TORCH_ONLY:-0}
OUT=${OUT:-bench/out/bench_step-$(date -u +%Y%m%dT%H%M%SZ).txt}

if [[ "$TORCH_ONLY" != 1 && ! -x "$FITLLM" ]]; then
    echo "error: $FITLLM not found or not executable; build it first (e.g. make)," \
         "or set FITLLM=path, or TORCH_ONLY=1 to run the torch side only" >&2
    exit 2
fi
if ! "$PY" -c 'import torch, transformers' 2>/dev/null; then
    echo "error: $PY cannot import torch+transformers; set FITLLM_PY or" \
         "pip install -r tests/ref/requirements.txt" >&2
    exit 2
fi

mkdir -p "$(dirname "$OUT")"
: > "$OUT.tmp"
{
    echo "# $(date -u +%FT%TZ) host=$(hostname) nproc=$(nproc) cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
    echo "# rounds=$ROUNDS steps=$STEPS threads=$THREADS batch=$BATCH seq=$SEQ precision=$PRECISION act_ckpt=$ACT_CKPT lora=$LORA quantize=${QUANTIZE:-none} loadavg=$(cut -d" " -f1-3 /proc/loadavg)"
    echo "# note: other processes on this machine skew the timings; check loadavg is ~0 first"
} | tee -a "$OUT"

run_one() { # impl shape
    local impl=$1 shape=$2 line log
    log=$(mktemp)
    if [[ $impl == fitllm ]]; then
        "$FITLLM" bench-step --preset "$shape" --init random --micro-batch "$BATCH" \
            --seq "$SEQ" --steps "$STEPS" --threads "$THREADS" --precision "$PRECISION" $CKPT_ARG >"$log" 2>&1 || {
            echo "error: fitllm bench-step failed for $shape:" >&2; tail -20 "$log" >&2; rm -f "$log"; return 1; }
    else
        "$PY" bench/bench_step_torch.py --shape "$shape" --batch "$BATCH" --seq "$SEQ" \
            --steps "$STEPS" --warmup 2 --threads "$THREADS" --precision "$PRECISION" $CKPT_ARG >"$log" 2>&1 || {
            echo "error: torch bench failed for $shape:" >&2; tail -20 "$log" >&2; rm -f "$log"; return 1; }
    fi
    line=$(grep '^RESULT ' "$log" | tail -1 || true)
    rm -f "$log"
    if [[ -z $line ]]; then echo "error: no RESULT line from $impl $shape" >&2; return 1; fi
    echo "$line" | tee -a "$OUT"
    echo "$line" >> "$OUT.tmp"
}

for shape in $SHAPES; do
    for ((r = 1; r <= ROUNDS; r++)); do
        echo "== $shape round $r/$ROUNDS" >&2
        [[ "$TORCH_ONLY" == 1 ]] || run_one fitllm "$shape"
        run_one torch "$shape"
    done
done

# Table: median over rounds of each field per (shape, impl), and fitllm/torch ratio.
"$PY" - "$OUT.tmp" <<'PYEOF' | tee -a "$OUT"
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    kv = dict(tok.split("=", 1) for tok in line.split()[1:])
    rows.setdefault((kv["shape"], kv["impl"]), []).append(kv)
def med(lst, k):
    return statistics.median(float(x[k]) for x in lst)
print(f"{'shape':<7} {'impl':<7} {'n':>2} {'median_ms':>10} {'tok_s':>9} {'gflops':>8} {'peak_rss_mb':>11}")
shapes = []
for (s, i) in rows:
    if s not in shapes: shapes.append(s)
for s in shapes:
    for i in ("fitllm", "torch"):
        if (s, i) in rows:
            l = rows[(s, i)]
            print(f"{s:<7} {i:<7} {len(l):>2} {med(l,'median_ms'):>10.1f} {med(l,'tok_s'):>9.1f} "
                  f"{med(l,'gflops'):>8.2f} {med(l,'peak_rss_mb'):>11.1f}")
    if (s, "fitllm") in rows and (s, "torch") in rows:
        r = med(rows[(s, "fitllm")], "median_ms") / med(rows[(s, "torch")], "median_ms")
        print(f"{s:<7} ratio fitllm/torch median_ms = {r:.3f}  ({'fitllm faster' if r < 1 else 'torch faster'})")
# Phases (ms, median over rounds of each run's per-phase median): fwd = embedding + blocks + final
# norm, head = lm_head + cross-entropy forward and backward, bwd = the rest of the backward,
# opt = gradient norm + update. Both sides cut the step the same way (bench_step_torch.py).
ph = ("fwd_ms", "head_ms", "bwd_ms", "opt_ms")
if any(all(k in x for k in ph) for l in rows.values() for x in l):
    print(f"\n{'shape':<7} {'impl':<7} {'fwd_ms':>10} {'head_ms':>10} {'bwd_ms':>10} {'opt_ms':>10}")
    for s in shapes:
        for i in ("fitllm", "torch"):
            l = [x for x in rows.get((s, i), []) if all(k in x for k in ph)]
            if l:
                print(f"{s:<7} {i:<7} " + " ".join(f"{med(l, k):>10.1f}" for k in ph))
PYEOF
rm -f "$OUT.tmp"
echo "raw results: $OUT" >&2
