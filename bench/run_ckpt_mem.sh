#!/usr/bin/env bash
# Peak RSS of each rank of a 2-rank FSDP FULL_SHARD run that saves consolidated checkpoints, for one
# or more fitllm binaries side by side (alternating rounds). Usage:
#   bench/run_ckpt_mem.sh [MODEL] [ROUNDS] BIN [BIN ...]     (MODEL: a preset, default small)
# Each run: random init, 1 step of AdamW at micro batch 1 x 2 ranks, one checkpoint (step-000001)
# plus final/, so the peak includes the save. Prints "BIN rank R maxrss_kb N" per rank and round.
set -u
MODEL=${1:-small}; shift || true
ROUNDS=${1:-3}; shift || true
[ $# -ge 1 ] || { echo "usage: $0 [MODEL] [ROUNDS] BIN [BIN ...]" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
for round in $(seq 1 "$ROUNDS"); do
    for bin in "$@"; do
        rm -rf "$T/out"
        mpirun -np 2 --oversubscribe --bind-to none sh -c \
            'exec /usr/bin/time -f "rank $OMPI_COMM_WORLD_RANK maxrss_kb %M" "$0" "$@" >/dev/null' \
            "$bin" finetune_full "$MODEL" --data.n_train 51 --data.n_val 7 --train.micro_batch_size 1 \
            --train.global_batch_size 2 --train.max_steps 1 --train.save_interval 1 --train.max_seq_length 48 \
            --eval.max_new_tokens 0 --eval.final_validation false --threads 1 --devices 2 --strategy fsdp \
            --out_dir "$T/out" 2>&1 | sed -n "s|^rank|$bin round $round rank|p"
    done
done
