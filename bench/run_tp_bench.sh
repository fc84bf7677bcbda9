#!/usr/bin/env bash
# Tensor-parallel step benchmark: fitllm --tensor_parallel N (mpirun) vs PyTorch DTensor parallelize_module (gloo),
# N processes x 1 thread, the same LLaMA shape, one tensor-parallel group reading one micro-batch, alternating rounds.
#
#   bench/run_tp_bench.sh                      # tiny, TP 2, B=2, T=256, 3 rounds
#   SP=1 bench/run_tp_bench.sh                 # with sequence parallelism on both sides (fitllm --sequence_parallel
#                                              #   true; PyTorch SequenceParallel norms: bench_tp_torch.py --sp)
#   ROUNDS=1 STEPS=3 bench/run_tp_bench.sh     # quick look
#
# fitllm: `mpirun -np N fitllm pretrain --model_name SHAPE --devices N --tensor_parallel N --threads 1` on TextFiles
#   (tinystories text, llama2 tokenizer: every sample exactly T tokens), micro-batch B = global batch (one group).
#   Step time = logs/metrics.csv iter_time of rank 0, median over the steps after WARMUP; memory per rank = rank 0's
#   metrics.csv mem_params + mem_grads + mem_optim (the slice's parameters, gradients and AdamW state) and mem_peak
#   (the pool's peak, activations included), and every rank's peak RSS (/usr/bin/time %M).
# torch: bench/bench_tp_torch.py (Megatron's plan through DTensor: column-parallel q/k/v/gate/up, row-parallel o/down,
#   vocabulary-parallel embedding and lm_head, loss_parallel's cross-entropy), its state bytes and peak RSS per rank.
# Env: FITLLM (./build/fitllm), FITLLM_PY (/work/venv-graph/bin/python), SHAPE (tiny), TP (2), BATCH (2), SEQ (256),
#   STEPS (6 timed), WARMUP (2), ROUNDS (3), DATA (../shared/data), OUT (bench/out/tp-<date>.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

FITLLM=${FITLLM:-./build/fitllm}
PY=${FITLLM_PY:-/work/venv-graph/bin/python}
SHAPE=${SHAPE:-tiny}
TP=${TP:-2}
BATCH=${BATCH:-2}
SEQ=${SEQ:-256}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-3}
SP=${SP:-0}
KIND=$([ "$SP" = 1 ] && echo sp || echo tp)
SPF=(); SPT=(); [ "$SP" = 1 ] && SPF=(--sequence_parallel true) && SPT=(--sp)
DATA=${DATA:-$( [ -d ../shared/data ] && echo ../shared/data || echo /work/shared/data )}
OUT=${OUT:-bench/out/tp-$(date -u +%Y%m%dT%H%M%SZ).txt}
MPIRUN=(mpirun --oversubscribe -np "$TP")
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)

[ -x "$FITLLM" ] || { echo "error: $FITLLM not found (cmake --build build)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "error: mpirun not found (apt-get install openmpi-bin)" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "error: /usr/bin/time not found (apt-get install time)" >&2; exit 2; }
[ -d "$DATA/text" ] && [ -d "$DATA/llama2-tokenizer" ] || { echo "error: $DATA/text or $DATA/llama2-tokenizer missing" >&2; exit 2; }
"$PY" -c 'import torch, transformers; import torch.distributed.tensor.parallel' 2>/dev/null ||
    { echo "error: $PY cannot import torch (with torch.distributed.tensor.parallel) + transformers" >&2; exit 2; }

mkdir -p "$(dirname "$OUT")"
TMP=$(mktemp -d /tmp/tp-bench-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
{
    echo "# $(date -u +%FT%TZ) host=$(hostname) nproc=$(nproc) cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
    echo "# shape=$SHAPE tp=$TP sp=$SP threads/rank=1 B=$BATCH T=$SEQ steps=$STEPS warmup=$WARMUP rounds=$ROUNDS loadavg=$(cut -d' ' -f1-3 /proc/loadavg)"
} | tee -a "$OUT"

fitllm_one() { # prints "RESULT impl=fitllm-tp ..."
    local d="$TMP/f-$RANDOM"
    OMP_NUM_THREADS=1 "${MPIRUN[@]}" /usr/bin/time -f "maxrss_kb=%M" "$FITLLM" pretrain --model_name "$SHAPE" \
        --data TextFiles --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/llama2-tokenizer" \
        --train.max_seq_length "$SEQ" --train.micro_batch_size "$BATCH" --train.global_batch_size "$BATCH" \
        --train.max_steps $((STEPS + WARMUP)) --train.lr_warmup_steps 0 --threads 1 --devices "$TP" \
        --tensor_parallel "$TP" "${SPF[@]}" --eval.interval 100000 --eval.final_validation false --eval.max_new_tokens 0 \
        --train.save_interval 100000 --quiet --out_dir "$d" >"$d.log" 2>&1 ||
        { echo "fitllm failed:" >&2; tail -5 "$d.log" >&2; return 1; }
    "$PY" - "$d/logs/metrics.csv" "$WARMUP" "$((BATCH * SEQ))" "$d.log" "$KIND" <<'EOF'
import csv, re, statistics, sys
path, warm, tok, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = [r for r in csv.DictReader(open(path)) if r["iter_time"] not in ("", "nan")]
t = [float(r["iter_time"]) for r in rows][warm:]
last = rows[-1]
state = sum(int(float(last[k])) for k in ("mem_params", "mem_grads", "mem_optim"))
rss = re.findall(r"maxrss_kb=(\d+)", open(log).read())
med = statistics.median(t)
print(f"RESULT impl=fitllm-{sys.argv[5]} median_ms={med*1e3:.1f} tok_s={tok/med:.1f} steps={len(t)} "
      f"state_bytes_rank0={state} pool_peak_rank0={int(float(last['mem_peak']))} "
      f"maxrss_mib={'/'.join(f'{int(x)/1024:.0f}' for x in rss)} losses={[round(float(r['loss']), 6) for r in rows]}")
EOF
}

torch_one() {
    OMP_NUM_THREADS=1 "$PY" bench/bench_tp_torch.py --shape "$SHAPE" --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" \
        --warmup "$WARMUP" --world "$TP" --threads 1 "${SPT[@]}" 2>"$TMP/t.log" | grep '^RESULT' ||
        { echo "torch failed:" >&2; tail -5 "$TMP/t.log" >&2; return 1; }
    grep '^# rank 0' "$TMP/t.log" | tee -a "$OUT" >&2
}

for r in $(seq "$ROUNDS"); do
    echo "# round $r $(date -u +%TZ) loadavg=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"
    torch_one | sed "s/^/round=$r /" | tee -a "$OUT"
    fitllm_one | sed "s/^/round=$r /" | tee -a "$OUT"
done
echo "# end $(date -u +%TZ) loadavg=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"

"$PY" bench/rounds_summary.py "$OUT" fitllm-$KIND/torch-$KIND
