#!/usr/bin/env bash
# --offload_update_overlap on pipeline stages, on and off side by side: `mpirun -np S fitllm pretrain` of a LLaMA
# preset (SHAPE, default small: 12 layers, C 768, F 2048, vocab 32000, 0.13 B parameters) as S pipeline stages x 1
# thread each, STRATEGY (default fsdp_cpu_offload: each stage's parameters, gradients and AdamW fp32 state in the host
# tier) without clipping (--train.max_norm 0: the switch needs it), micro-batch B x T tokens, MICRO micro-batches per
# step, so that each stage's update is a visible part of its step. Alternating on / off (ABBA), ROUNDS rounds; per run the
# median of logs/metrics.csv's step times after WARMUP steps (iter_time x MICRO), per mode the median over rounds.
# The losses must be the same in both modes (the same bits: tests/test_pp_offload.c
# pp_offload_update_overlap_keeps_the_bits); the log's "update overlap" line says, per stage, how many units' updates
# had finished on the fetch worker when the stage's schedule ended and when the step's wait began, of those queued.
# Env: FITLLM (./build/fitllm), SHAPE (small), STAGES (2), SCHEDULE (1f1b), CHUNKS (2, interleaved only), STRATEGY
#   (fsdp_cpu_offload), BATCH (1), SEQ (16), MICRO (4), STEPS (5 timed), WARMUP (1), ROUNDS (3), THREADS (1),
#   DATA (/work/shared/data or ../shared/data).
set -euo pipefail
cd "$(dirname "$0")/.."
FITLLM=${FITLLM:-./build/fitllm}
SHAPE=${SHAPE:-small}; STAGES=${STAGES:-2}; SCHEDULE=${SCHEDULE:-1f1b}; CHUNKS=${CHUNKS:-2}
STRATEGY=${STRATEGY:-fsdp_cpu_offload}; BATCH=${BATCH:-1}; SEQ=${SEQ:-16}; MICRO=${MICRO:-4}
STEPS=${STEPS:-5}; WARMUP=${WARMUP:-1}; ROUNDS=${ROUNDS:-3}; THREADS=${THREADS:-1}
DATA=${DATA:-$( [ -d ../shared/data ] && echo ../shared/data || echo /work/shared/data )}
MPIRUN=(mpirun --oversubscribe -np "$STAGES")
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
[ -x "$FITLLM" ] || { echo "error: $FITLLM not found" >&2; exit 2; }
TMP=$(mktemp -d /tmp/pp-upd-bench-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
echo "# $(date -u +%FT%TZ) nproc=$(nproc) cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1) shape=$SHAPE stages=$STAGES" \
     "schedule=$SCHEDULE strategy=$STRATEGY B=$BATCH T=$SEQ micro=$MICRO threads/rank=$THREADS steps=$STEPS+$WARMUP" \
     "loadavg=$(cut -d' ' -f1-3 /proc/loadavg)"
one() { # on|off round
    local d="$TMP/$1-$2" sw=true
    [ "$1" = off ] && sw=false
    FITLLM_THREADS=$THREADS OMP_NUM_THREADS=1 "${MPIRUN[@]}" /usr/bin/time -f "MAXRSS_KB %M" "$FITLLM" pretrain \
        --model_name "$SHAPE" --data TextFiles --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/llama2-tokenizer" \
        --train.max_seq_length "$SEQ" --train.micro_batch_size "$BATCH" --train.global_batch_size $((MICRO * BATCH)) \
        --train.max_steps $((STEPS + WARMUP)) --train.lr_warmup_steps 0 --train.max_norm 0 --threads "$THREADS" \
        --devices "$STAGES" --pipeline_parallel "$STAGES" --pipeline_schedule "$SCHEDULE" --strategy "$STRATEGY" \
        $([ "$SCHEDULE" = interleaved ] && echo "--pipeline_chunks $CHUNKS") --offload_update_overlap "$sw" \
        --eval.interval 100000 --eval.final_validation false --eval.max_new_tokens 0 --train.save_interval 100000 \
        --out_dir "$d" >"$d.log" 2>&1 || { echo "fitllm $1 failed:" >&2; tail -5 "$d.log" >&2; return 1; }
    python3 - "$d/logs/metrics.csv" "$d.log" "$1" "$2" "$WARMUP" "$MICRO" <<'EOF'
import csv, re, statistics, sys
path, log, mode, rnd, warm, m = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
rows = [r for r in csv.DictReader(open(path)) if r["iter_time"] not in ("", "nan") and int(r["iter"]) % m == 0]
t = [m * float(r["iter_time"]) for r in rows][warm:]
text = open(log).read()
rss = sorted(int(v) // 1024 for v in re.findall(r"MAXRSS_KB (\d+)", text))
ov = re.findall(r"update overlap: ([^\n]*)", text)
print(f"round={rnd} mode={mode} median_s={statistics.median(t):.3f} steps_s={'/'.join(f'{x:.2f}' for x in t)} "
      f"rss_mib={'/'.join(map(str, rss))} losses={[round(float(r['loss']), 6) for r in rows]} "
      f"overlap=[{'; '.join(ov)}]")
EOF
}
for r in $(seq "$ROUNDS"); do # on first in odd rounds, off first in even ones (ABBA: a drifting load hits both alike)
    if [ $((r % 2)) = 1 ]; then order="on off"; else order="off on"; fi
    for mode in $order; do one "$mode" "$r" | tee -a "$TMP/all"; done
done
for mode in on off; do
    grep "mode=$mode " "$TMP/all" | sed 's/.*median_s=\([0-9.]*\).*/\1/' | sort -n |
        awk -v m="$mode" '{v[NR] = $1} END {printf "# median over rounds, overlap %s: %s s/step (%d rounds)\n", m, v[int((NR + 1) / 2)], NR}'
done
echo "# loadavg at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
