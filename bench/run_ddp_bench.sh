#!/usr/bin/env bash
# Data-parallel step benchmark: fitllm DDP / ZeRO-2 / FSDP (mpirun) vs PyTorch DDP / FSDP2 (gloo),
# 2 processes x 1 thread, same LLaMA shape, same global batch, alternating rounds (ABAB).
#
#   bench/run_ddp_bench.sh                      # tiny, B=2 per rank, T=256, 3 rounds
#   ROUNDS=1 STEPS=4 bench/run_ddp_bench.sh     # quick look
#
# fitllm: `mpirun -np 2 fitllm pretrain --model_name SHAPE --devices 2 --threads 1` on TextFiles
#   (tinystories text, llama2 tokenizer, vocab 32000 as the preset) so every sample is exactly
#   T tokens (blocks of max_seq_length+1; Synthetic's samples are short and padded per batch, so
#   they would not give a fixed T); micro_batch B, global batch 2B (no accumulation).
#   Step time = logs/metrics.csv iter_time of rank 0 (forward + backward with its bucketed
#   all-reduce + the remaining reduction + optimizer update), median over the steps after WARMUP.
# torch: bench/bench_ddp_torch.py --mode ddp (and fsdp2_grad_op = FSDP2 with
#   reshard_after_forward=False, the ZeRO-2-like sharding, as the partner of fitllm's ZeRO-2; fsdp2 =
#   FULL_SHARD, the partner of fitllm's `--strategy fsdp`).
# Env: FITLLM (./build/fitllm), FITLLM_PY (/work/venv/bin/python), SHAPE (tiny), BATCH (2 per
#   rank), SEQ (256), STEPS (8 timed), WARMUP (2), ROUNDS (3), ZERO2 (1: also ZeRO-2 vs FSDP2),
#   FSDP (1: also fitllm FSDP FULL_SHARD vs FSDP2 fully_shard),
#   SINGLE (0; 1: also ONE process x 1 thread with one rank's micro-batch B on each side, the
#   step without communication: 1 - single/DDP estimates the communication share of the DDP
#   step, memory-bandwidth contention between the two ranks included),
#   DATA (/work/shared/data or ../shared/data), OUT (bench/out/ddp-<date>.txt).
# Prints every result line, then the medians over rounds and the ratios fitllm/PyTorch (target <= 0.7).
set -euo pipefail
cd "$(dirname "$0")/.."

FITLLM=${FITLLM:-./build/fitllm}
PY=${FITLLM_PY:-/work/venv/bin/python}
SHAPE=${SHAPE:-tiny}
BATCH=${BATCH:-2}
SEQ=${SEQ:-256}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-3}
ZERO2=${ZERO2:-1}
FSDP=${FSDP:-1}
DATA=${DATA:-$( [ -d ../shared/data ] && echo ../shared/data || echo /work/shared/data )}
OUT=${OUT:-bench/out/ddp-$(date -u +%Y%m%dT%H%M%SZ).txt}
MPIRUN=(mpirun --oversubscribe -np 2)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)

[ -x "$FITLLM" ] || { echo "error: $FITLLM not found (cmake --build build --target fitllm_cli)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "error: mpirun not found (apt-get install openmpi-bin)" >&2; exit 2; }
[ -d "$DATA/text" ] && [ -d "$DATA/llama2-tokenizer" ] || { echo "error: $DATA/text or $DATA/llama2-tokenizer missing" >&2; exit 2; }
"$PY" -c 'import torch, transformers' 2>/dev/null || { echo "error: $PY cannot import torch+transformers" >&2; exit 2; }

mkdir -p "$(dirname "$OUT")"
TMP=$(mktemp -d /tmp/ddp-bench-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
{
    echo "# $(date -u +%FT%TZ) host=$(hostname) nproc=$(nproc) cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
    echo "# shape=$SHAPE ranks=2 threads/rank=1 B/rank=$BATCH T=$SEQ global_batch=$((2 * BATCH)) steps=$STEPS warmup=$WARMUP rounds=$ROUNDS loadavg=$(cut -d' ' -f1-3 /proc/loadavg)"
} | tee -a "$OUT"

fitllm_one() { # strategy|single -> prints "RESULT impl=fitllm-<strategy> ..."
    local st=$1 d="$TMP/f-$1-$RANDOM" n=2 launch=("${MPIRUN[@]}")
    local dp=(--devices 2 --strategy "$st")
    [ "$st" = single ] && { n=1; launch=(); dp=(--devices 1); }
    OMP_NUM_THREADS=1 "${launch[@]}" "$FITLLM" pretrain --model_name "$SHAPE" --data TextFiles \
        --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/llama2-tokenizer" \
        --train.max_seq_length "$SEQ" --train.micro_batch_size "$BATCH" --train.global_batch_size $((n * BATCH)) \
        --train.max_steps $((STEPS + WARMUP)) --train.lr_warmup_steps 0 --threads 1 "${dp[@]}" \
        --eval.interval 100000 --eval.final_validation false --eval.max_new_tokens 0 --train.save_interval 100000 \
        --quiet --out_dir "$d" >"$d.log" 2>&1 || { echo "fitllm $st failed:" >&2; tail -5 "$d.log" >&2; return 1; }
    # one row per (rank, micro-batch) of the step; with no accumulation every row of a step carries
    # rank 0's whole step time: take the step's last row (iter % n == 0)
    "$PY" - "$d/logs/metrics.csv" "$st" "$WARMUP" "$((n * BATCH * SEQ))" "$n" <<'EOF'
import csv, statistics, sys
path, st, warm, tok, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rows = [r for r in csv.DictReader(open(path)) if r["iter_time"] not in ("", "nan") and int(r["iter"]) % n == 0]
t = [float(r["iter_time"]) for r in rows][warm:]
losses = [round(float(r["loss"]), 6) for r in rows]
med = statistics.median(t)
# bytes rank 0 sent per step, counted by fl_comm (metrics.csv comm_sent; absent in one process)
sent = sorted({r.get("comm_sent", "") for r in rows} - {""})
print(f"RESULT impl=fitllm-{st} median_ms={med*1e3:.1f} tok_s={tok/med:.1f} steps={len(t)} "
      f"sent_bytes_per_step={'/'.join(sent) if sent else 0} losses={losses}")
EOF
}

torch_single() { # one process x 1 thread, one rank's micro-batch (bench_step_torch.py's step)
    OMP_NUM_THREADS=1 "$PY" bench/bench_step_torch.py --shape "$SHAPE" --batch "$BATCH" --seq "$SEQ" \
        --steps "$STEPS" --warmup "$WARMUP" --threads 1 --no-phases 2>"$TMP/t.log" | grep '^RESULT' \
        | sed 's/impl=torch /impl=torch-single /' || { echo "torch single failed:" >&2; tail -5 "$TMP/t.log" >&2; return 1; }
}

torch_one() { # mode
    OMP_NUM_THREADS=1 "$PY" bench/bench_ddp_torch.py --mode "$1" --shape "$SHAPE" --batch "$BATCH" --seq "$SEQ" \
        --steps "$STEPS" --warmup "$WARMUP" --world 2 --threads 1 2>"$TMP/t.log" | grep '^RESULT' \
        || { echo "torch $1 failed:" >&2; tail -5 "$TMP/t.log" >&2; return 1; }
}

for r in $(seq "$ROUNDS"); do
    echo "# round $r $(date -u +%TZ) loadavg=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"
    torch_one ddp | sed "s/^/round=$r /" | tee -a "$OUT"
    fitllm_one ddp | sed "s/^/round=$r /" | tee -a "$OUT"
    if [ "$ZERO2" = 1 ]; then
        torch_one fsdp2_grad_op | sed "s/^/round=$r /" | tee -a "$OUT"
        fitllm_one deepspeed_stage_2 | sed "s/^/round=$r /" | tee -a "$OUT"
    fi
    if [ "$FSDP" = 1 ]; then
        torch_one fsdp2 | sed "s/^/round=$r /" | tee -a "$OUT"
        fitllm_one fsdp | sed "s/^/round=$r /" | tee -a "$OUT"
    fi
    if [ "${SINGLE:-0}" = 1 ]; then
        torch_single | sed "s/^/round=$r /" | tee -a "$OUT"
        fitllm_one single | sed "s/^/round=$r /" | tee -a "$OUT"
    fi
done
echo "# end $(date -u +%TZ) loadavg=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"

"$PY" - "$OUT" <<'EOF'
import re, statistics, sys
med = {}
for line in open(sys.argv[1]):
    m = re.search(r"RESULT impl=(\S+).*?median_ms=([\d.]+)", line)
    if m:
        med.setdefault(m.group(1), []).append(float(m.group(2)))
print("\nimpl                        median over rounds (ms/step)   rounds")
for k, v in med.items():
    print(f"{k:<28}{statistics.median(v):>12.1f}   {v}")
def ratio(a, b):
    if a in med and b in med:
        print(f"{a} / {b} = {statistics.median(med[a]) / statistics.median(med[b]):.3f}  (target <= 0.7)")
print()
ratio("fitllm-ddp", "torch-ddp")
ratio("fitllm-deepspeed_stage_2", "torch-fsdp2_grad_op")
ratio("fitllm-deepspeed_stage_2", "torch-ddp")
ratio("fitllm-fsdp", "torch-fsdp2")
for a, b in (("fitllm-single", "fitllm-ddp"), ("torch-single", "torch-ddp")):
    if a in med and b in med:
        print(f"{b}: communication share ~ 1 - single/DDP = "
              f"{1 - statistics.median(med[a]) / statistics.median(med[b]):.2f}")
EOF
