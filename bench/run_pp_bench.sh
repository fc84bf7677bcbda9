#!/usr/bin/env bash
# Pipeline-parallel step benchmark: fitllm --pipeline_parallel (mpirun) vs torch.distributed.pipelining (gloo),
# S processes x 1 thread, the same LLaMA shape, micro-batches and schedule, alternating rounds (ABAB).
#
#   bench/run_pp_bench.sh                       # tiny, 2 stages, B=2, 4 micro-batches, T=128, 3 rounds
#   ROUNDS=1 STEPS=3 bench/run_pp_bench.sh      # quick look
#
# fitllm: `mpirun -np S fitllm pretrain --model_name SHAPE --devices S --pipeline_parallel S --pipeline_schedule K`
#   on TextFiles (tinystories text, llama2 tokenizer) so that every sample is exactly T tokens; micro-batch B, global
#   batch MICRO x B (MICRO micro-batches per step). Its split is its own (the blocks' training FLOPs, lm_head's on
#   the last stage: tiny at 2 stages is [0, 5) [5, 6), the head weighing ~9 blocks), printed by `fitllm plan`.
#   Step time = logs/metrics.csv iter_time x MICRO (a pipelined step gives each micro-batch an equal share), median
#   over the steps after WARMUP. Memory: each rank's peak resident set (/usr/bin/time %M) and its pool peak (the
#   result box's "peak total, ranks min - max").
# torch: bench/bench_pp_torch.py with the same split (SPLIT, default fitllm's) and schedule; with EVEN=1 also the
#   count-balanced split 0,3,6 (what a split by layer count gives), to show what the cost balance buys.
# interleaved (SCHEDULES="interleaved"): fitllm --pipeline_chunks CHUNKS, torch ScheduleInterleaved1F1B with
#   --chunks CHUNKS on ISPLIT (the S x CHUNKS virtual stages' first layers; default fitllm's for tiny x 2 x 2,
#   printed in its log as "virtual stages' blocks"); EVEN=1 does not apply.
# Compositions (issue 35; CASES="tp2-interleaved dp2-zero2-offload dp2-fsdp-offload", 4 ranks; `make bench-pp-compose`):
#   the same init and data on both sides (bench_pp_torch.py --prepare: a random SHAPE model saved as HF safetensors,
#   read by fitllm's --initial_checkpoint_dir and torch's from_pretrained; a text file of exactly global-batch blocks
#   of T + 1 tokens, every block in every step, so the step-1 losses must agree: printed as "loss check").
#   tp2-interleaved    fitllm --tensor_parallel 2 --pipeline_parallel 2 --pipeline_schedule interleaved
#                      --pipeline_chunks CHUNKS; torch ScheduleInterleaved1F1B over TP-parallelized stage modules
#                      (bench_pp_torch.py --tp 2: DTensor parallelize_module, loss_parallel), split ISPLIT.
#   dp2-zero2-offload  fitllm DP 2 x PP 2 1f1b --strategy deepspeed_stage_2_offload; torch 1f1b over FSDP2 stages
#                      (--dp 2 --fsdp grad_op --offload: reshard_after_forward=False + CPUOffloadPolicy), split SPLIT.
#   dp2-fsdp-offload   fitllm DP 2 x PP 2 1f1b --strategy fsdp_cpu_offload; torch --dp 2 --fsdp full --offload.
#   t5-pp2             fitllm finetune_full on a T5 folder (T5, default t5-small, random, saved by --prepare with
#                      tests/fixtures/t5-tok's tokenizer), PP 2 1f1b, JSON pairs cut to SOURCE (128) + SEQ tokens;
#                      torch --t5: T5ForConditionalGeneration cut by hand into PipelineStages at T5SPLIT (fitllm's
#                      split over the encoder's then the decoder's blocks; t5-small: 0,8,12), tied head summed.
#   The sides alternate (odd rounds torch first, even rounds fitllm first). Step = iter_time x MICRO (fitllm), rank
#   0's wall time (torch), medians; memory: fitllm's pool peak (ranks min - max) and rank 0's host tier, torch's
#   local state bytes per rank (parameters + gradients + AdamW), both sides' peak RSS per rank.
# Env: FITLLM (./build/fitllm), FITLLM_PY (/work/venv-graph/bin/python), SHAPE (tiny), STAGES (2), BATCH (2),
#   MICRO (4), SEQ (128), STEPS (6 timed), WARMUP (2), ROUNDS (3), SCHEDULES ("1f1b gpipe"), SPLIT (0,5,6),
#   EVEN (1), CHUNKS (2), ISPLIT (0,1,2,5,6), CASES (empty: the schedules above), DATA (/work/shared/data or ../shared/data), OUT (bench/out/pp-<date>.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

FITLLM=${FITLLM:-./build/fitllm}
PY=${FITLLM_PY:-/work/venv-graph/bin/python}
SHAPE=${SHAPE:-tiny}
STAGES=${STAGES:-2}
BATCH=${BATCH:-2}
MICRO=${MICRO:-4}
SEQ=${SEQ:-128}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-2}
ROUNDS=${ROUNDS:-3}
SCHEDULES=${SCHEDULES:-1f1b gpipe}
SPLIT=${SPLIT:-0,5,6}
CHUNKS=${CHUNKS:-2}
ISPLIT=${ISPLIT:-0,1,2,5,6}
EVEN=${EVEN:-1}
CASES=${CASES:-}
T5=${T5:-t5-small}
SOURCE=${SOURCE:-128}
T5SPLIT=${T5SPLIT:-0,8,12}
DATA=${DATA:-$( [ -d ../shared/data ] && echo ../shared/data || echo /work/shared/data )}
OUT=${OUT:-bench/out/pp-$(date -u +%Y%m%dT%H%M%SZ).txt}
NP=$STAGES; [ -n "$CASES" ] && NP=$((2 * STAGES))
MPIBASE=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && MPIBASE+=(--allow-run-as-root)
MPIRUN=("${MPIBASE[@]}" -np "$NP")

[ -x "$FITLLM" ] || { echo "error: $FITLLM not found (cmake --build build --target fitllm_cli)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "error: mpirun not found (apt-get install openmpi-bin)" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "error: /usr/bin/time not found (apt-get install time)" >&2; exit 2; }
[ -d "$DATA/text" ] && [ -d "$DATA/llama2-tokenizer" ] || { echo "error: $DATA/text or $DATA/llama2-tokenizer missing" >&2; exit 2; }
"$PY" -c 'import torch.distributed.pipelining, transformers' 2>/dev/null || { echo "error: $PY cannot import torch.distributed.pipelining + transformers" >&2; exit 2; }

mkdir -p "$(dirname "$OUT")"
TMP=$(mktemp -d /tmp/pp-bench-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
{
    echo "# $(date -u +%FT%TZ) host=$(hostname) nproc=$(nproc) cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
    echo "# shape=$SHAPE stages=$STAGES threads/rank=1 B=$BATCH micro=$MICRO T=$SEQ global_batch=$((MICRO * BATCH)) steps=$STEPS warmup=$WARMUP rounds=$ROUNDS split=$SPLIT loadavg=$(cut -d' ' -f1-3 /proc/loadavg)"
} | tee -a "$OUT"

fitllm_one() { # schedule -> prints "RESULT impl=fitllm-pp-<schedule> ..."
    local k=$1 d="$TMP/f-$1-$RANDOM"
    OMP_NUM_THREADS=1 "${MPIRUN[@]}" /usr/bin/time -f "MAXRSS_KB %M" "$FITLLM" pretrain --model_name "$SHAPE" \
        --data TextFiles --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/llama2-tokenizer" \
        --train.max_seq_length "$SEQ" --train.micro_batch_size "$BATCH" --train.global_batch_size $((MICRO * BATCH)) \
        --train.max_steps $((STEPS + WARMUP)) --train.lr_warmup_steps 0 --threads 1 --devices "$STAGES" \
        --pipeline_parallel "$STAGES" --pipeline_schedule "$k" --strategy ddp \
        $([ "$k" = interleaved ] && echo "--pipeline_chunks $CHUNKS") \
        --eval.interval 100000 --eval.final_validation false --eval.max_new_tokens 0 --train.save_interval 100000 \
        --out_dir "$d" >"$d.log" 2>&1 || { echo "fitllm $k failed:" >&2; tail -5 "$d.log" >&2; return 1; }
    "$PY" - "$d/logs/metrics.csv" "$d.log" "$k" "$WARMUP" "$((MICRO * BATCH * SEQ))" "$MICRO" <<'EOF'
import csv, re, statistics, sys
path, log, k, warm, tok, m = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
rows = [r for r in csv.DictReader(open(path)) if r["iter_time"] not in ("", "nan") and int(r["iter"]) % m == 0]
t = [m * float(r["iter_time"]) for r in rows][warm:]
med = statistics.median(t)
text = open(log).read()
rss = [int(v) / 1024 for v in re.findall(r"MAXRSS_KB (\d+)", text)]
pool = re.search(r"peak total, ranks min - max +([0-9.]+ \w+) - ([0-9.]+ \w+)", text)
split = re.search(r"stage 0 holds blocks \[(\d+), (\d+)\)", text)
vsplit = re.search(r"virtual stages' blocks:([^\n]*)", text)
if vsplit:
    k += " vblocks=" + vsplit.group(1).strip().replace(" ", "")
print(f"RESULT impl=fitllm-pp-{k} median_ms={med*1e3:.1f} tok_s={tok/med:.1f} steps={len(t)} "
      f"stage0_blocks=[{split.group(1)},{split.group(2)}) rss_mib={'/'.join(f'{v:.0f}' for v in sorted(rss))} "
      f"pool_peak={pool.group(1)}..{pool.group(2)} losses={[round(float(r['loss']), 6) for r in rows]}"
      if pool and split else "RESULT impl=fitllm-pp-%s parse-error" % k)
EOF
}

torch_one() { # schedule split
    OMP_NUM_THREADS=1 "$PY" bench/bench_pp_torch.py --shape "$SHAPE" --batch "$BATCH" --micro "$MICRO" --seq "$SEQ" \
        --split "$2" --schedule "$1" --chunks "$CHUNKS" --steps "$STEPS" --warmup "$WARMUP" --threads 1 2>"$TMP/t.err" | grep '^RESULT' \
        || { echo "torch $1 $2 failed:" >&2; tail -5 "$TMP/t.err" >&2; return 1; }
}

case_flags() { # case -> "DP|fitllm flags|torch flags"
    case $1 in
        tp2-interleaved) echo "1|--tensor_parallel 2 --pipeline_schedule interleaved --pipeline_chunks $CHUNKS --strategy ddp|--tp 2 --schedule interleaved --chunks $CHUNKS --split $ISPLIT" ;;
        dp2-zero2-offload) echo "2|--pipeline_schedule 1f1b --strategy deepspeed_stage_2_offload|--dp 2 --fsdp grad_op --offload --schedule 1f1b --split $SPLIT" ;;
        dp2-fsdp-offload) echo "2|--pipeline_schedule 1f1b --strategy fsdp_cpu_offload|--dp 2 --fsdp full --offload --schedule 1f1b --split $SPLIT" ;;
        t5-pp2) echo "1|--pipeline_schedule 1f1b --strategy ddp|--t5 $T5 --source $SOURCE --schedule 1f1b --split $T5SPLIT" ;;
        *) echo "error: unknown case $1 (tp2-interleaved dp2-zero2-offload dp2-fsdp-offload t5-pp2)" >&2; return 2 ;;
    esac
}

compose_fitllm() { # case -> "RESULT impl=fitllm-<case> ..."
    local c=$1 dp ff tf d="$TMP/f-$1-$RANDOM"
    IFS='|' read -r dp ff tf <<<"$(case_flags "$c")"
    local prep="$TMP/prep$((MICRO * BATCH * dp))"
    local model=(pretrain --model_name "$SHAPE" --initial_checkpoint_dir "$prep/init" --data TextFiles
        --data.train_data_path "$prep/text" --data.val_data_path "$prep/text" --tokenizer_dir "$DATA/llama2-tokenizer"
        --train.max_seq_length "$SEQ") np=$NP
    [ "$c" = t5-pp2 ] && prep=$TMP/prep-t5 np=$STAGES model=(finetune_full --checkpoint_dir "$prep/init" --data JSON
        --data.json_path "$prep/pairs/train.json" --data.max_source_length "$SOURCE" --data.max_target_length "$SEQ")
    # shellcheck disable=SC2086  # ff holds several flags
    OMP_NUM_THREADS=1 "${MPIBASE[@]}" -np "$np" /usr/bin/time -f "MAXRSS_KB %M" "$FITLLM" "${model[@]}" \
        --train.micro_batch_size "$BATCH" --train.global_batch_size $((MICRO * BATCH * dp)) \
        --train.max_steps $((STEPS + WARMUP)) --train.lr_warmup_steps 0 --threads 1 --devices "$np" \
        --optimizer.lr 1e-4 --optimizer.weight_decay 0.1 --pipeline_parallel "$STAGES" $ff \
        --eval.interval 100000 --eval.final_validation false --eval.max_new_tokens 0 --train.save_interval 100000 \
        --out_dir "$d" >"$d.log" 2>&1 || { echo "fitllm $c failed:" >&2; tail -5 "$d.log" >&2; return 1; }
    local tok=$((MICRO * BATCH * dp * SEQ)); [ "$c" = t5-pp2 ] && tok=$((MICRO * BATCH * (SOURCE + SEQ)))
    "$PY" - "$d/logs/metrics.csv" "$d.log" "$c" "$WARMUP" "$tok" "$MICRO" "$((MICRO * dp))" <<'PYEOF'
import csv, re, statistics, sys
path, log, c, warm, tok, m, per = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
rows = [r for r in csv.DictReader(open(path)) if r["iter_time"] not in ("", "nan") and int(r["iter"]) % per == 0]
t = [m * float(r["iter_time"]) for r in rows][warm:]  # iter_time = the step's time / the micro-batches per pipeline
med = statistics.median(t)
text = open(log).read()
rss = [int(v) / 1024 for v in re.findall(r"MAXRSS_KB (\d+)", text)]
pool = re.search(r"peak total, ranks min - max +([0-9.]+ \w+) - ([0-9.]+ \w+)", text)
host = re.search(r"host tier \(offload\) total +([0-9.]+ \w+)", text)
print(f"RESULT impl=fitllm-{c} median_ms={med*1e3:.1f} tok_s={tok/med:.1f} steps={len(t)} "
      f"rss_mib={'/'.join(f'{v:.0f}' for v in sorted(rss))} "
      f"pool_peak={pool.group(1).replace(' ', '')}..{pool.group(2).replace(' ', '')}"
      f"{' host_rank0=' + host.group(1).replace(' ', '') if host else ''} "
      f"losses={[round(float(r['loss']), 6) for r in rows]}" if pool else f"RESULT impl=fitllm-{c} parse-error")
PYEOF
}

compose_torch() { # case -> "RESULT impl=torch-<case> ..."
    local c=$1 dp ff tf
    IFS='|' read -r dp ff tf <<<"$(case_flags "$c")"
    local prep="$TMP/prep$((MICRO * BATCH * dp))"
    [ "$c" = t5-pp2 ] && prep=$TMP/prep-t5
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 "$PY" bench/bench_pp_torch.py --shape "$SHAPE" --batch "$BATCH" --micro "$MICRO" --seq "$SEQ" \
        $tf --steps "$STEPS" --warmup "$WARMUP" --threads 1 --init "$prep/init" --ids "$prep/ids.json" \
        2>"$TMP/t.err" | grep '^RESULT' | sed "s/impl=torch-pp-[^ ]*/impl=torch-$c/" \
        || { echo "torch $c failed:" >&2; tail -5 "$TMP/t.err" >&2; return 1; }
}

if [ -n "$CASES" ]; then
    echo "# cases=$CASES ranks=$NP chunks=$CHUNKS split=$SPLIT isplit=$ISPLIT torch=$("$PY" -c 'import torch, transformers; print(torch.__version__, "transformers", transformers.__version__)') fitllm=$("$FITLLM" --version 2>/dev/null | head -1)" | tee -a "$OUT"
    for c in $CASES; do
        IFS='|' read -r dp _ _ <<<"$(case_flags "$c")"
        n=$((MICRO * BATCH * dp))
        if [ "$c" = t5-pp2 ]; then
            "$PY" bench/bench_pp_torch.py --prepare "$TMP/prep-t5" --t5 "$T5" --blocks "$n" --source "$SOURCE" \
                --seq "$SEQ" >/dev/null 2>"$TMP/prep.err" || { echo "prepare failed:" >&2; tail -5 "$TMP/prep.err" >&2; exit 1; }
            continue
        fi
        [ -d "$TMP/prep$n" ] || "$PY" bench/bench_pp_torch.py --prepare "$TMP/prep$n" --blocks "$n" --shape "$SHAPE" \
            --seq "$SEQ" --tokenizer "$DATA/llama2-tokenizer" >/dev/null 2>"$TMP/prep.err" ||
            { echo "prepare failed:" >&2; tail -5 "$TMP/prep.err" >&2; exit 1; }
    done
    for r in $(seq "$ROUNDS"); do
        for c in $CASES; do
            echo "# round $r $c $(date -u +%TZ) loadavg=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"
            if [ $((r % 2)) = 1 ]; then order="torch fitllm"; else order="fitllm torch"; fi
            for side in $order; do "compose_$side" "$c" | sed "s/^/round=$r /" | tee -a "$OUT"; done
        done
    done
    echo "# end $(date -u +%TZ) loadavg=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT"
    # shellcheck disable=SC2086
    "$PY" - "$OUT" $CASES <<'PYEOF' | tee -a "$OUT"
import re, statistics, sys, collections
ms, l1 = collections.defaultdict(dict), collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"round=(\d+) RESULT impl=(fitllm|torch)-(\S+) .*median_ms=([0-9.]+).* losses=\[([-0-9.e]+)", line)
    if m:
        ms[m.group(3)].setdefault(int(m.group(1)), {})[m.group(2)] = float(m.group(4))
        l1[(m.group(3), m.group(2))].append(float(m.group(5)))
for c in sys.argv[2:]:
    both = [v for v in ms[c].values() if len(v) == 2]
    if not both:
        continue
    f, t = [v["fitllm"] for v in both], [v["torch"] for v in both]
    ratios = [v["fitllm"] / v["torch"] for v in both]
    print(f"# {c}: fitllm {statistics.median(f):.1f} ms, torch {statistics.median(t):.1f} ms (medians of {len(f)} rounds); "
          f"fitllm/torch {statistics.median(f) / statistics.median(t):.3f} "
          f"(per round {' / '.join(f'{x:.2f}' for x in ratios)}, median {statistics.median(ratios):.3f})")
    a, b = l1[(c, "fitllm")][0], l1[(c, "torch")][0]
    print(f"# {c} loss check, step 1 (same init, same blocks): fitllm {a:.6f} torch {b:.6f} "
          f"|diff| {abs(a - b):.1e} (relative {abs(a - b) / abs(b):.1e})")
PYEOF
    exit 0
fi

for r in $(seq "$ROUNDS"); do
    for k in $SCHEDULES; do
        sp=$SPLIT; [ "$k" = interleaved ] && sp=$ISPLIT
        torch_one "$k" "$sp" | sed "s/^/round=$r /" | tee -a "$OUT"
        fitllm_one "$k" | sed "s/^/round=$r /" | tee -a "$OUT"
        if [ "$EVEN" = 1 ] && [ "$k" != interleaved ]; then torch_one "$k" 0,3,6 | sed "s/^/round=$r /" | tee -a "$OUT"; fi
    done
done
echo "# medians over rounds (ms/step):" | tee -a "$OUT"
"$PY" - "$OUT" <<'EOF' | tee -a "$OUT"
import re, statistics, sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"round=\d+ RESULT impl=(\S+)(?:.* split=(\S+))?.* median_ms=([0-9.]+)", line)
    if m:
        runs[m.group(1) + (" split=" + m.group(2) if m.group(2) else "")].append(float(m.group(3)))
for k, v in runs.items():
    print(f"# {k}: median {statistics.median(v):.1f} ms (rounds: {' / '.join(f'{x:.1f}' for x in v)})")
EOF
