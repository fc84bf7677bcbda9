#!/bin/bash
# CPU and NVMe offload against the optimizer on the device, side by side: the same fitllm run (a model preset,
# AdamW, random init, synthetic data) three ways, alternating, ROUNDS rounds; per mode the median over rounds of
# the process's peak RSS (/usr/bin/time's maximum resident set) and of the training time per step (the trainer's
# box: training time / steps). The "device" is host memory here, so the optimizer state moves between pools of
# the same RAM (cpu), or out of RAM into files (nvme).
# Usage: bench/run_offload.sh [build] (env: MODEL=small STEPS=4 ROUNDS=3 NVME_DIR=/var/tmp/fitllm-nvme)
set -u
BUILD=${1:-build}
FL=$BUILD/fitllm
MODEL=${MODEL:-small}
STEPS=${STEPS:-4}
ROUNDS=${ROUNDS:-3}
NVME_DIR=${NVME_DIR:-/var/tmp/fitllm-nvme}
mkdir -p "$NVME_DIR"
T=$(mktemp -d /tmp/fitllm-offload-bench-XXXXXX)
trap 'rm -rf "$T"' EXIT
ARGS=(finetune_full "$MODEL" --data Synthetic --train.max_steps "$STEPS" --train.global_batch_size 1
      --train.micro_batch_size 1 --train.max_seq_length 64 --eval.interval 100000 --eval.final_validation false
      --eval.max_new_tokens 0 --quiet)
declare -A X=([device]="" [cpu]="--strategy deepspeed_stage_2_offload"
              [nvme]="--strategy deepspeed_stage_2_offload --offload_optimizer_device nvme --nvme_path $NVME_DIR")
echo "machine: $(lscpu | grep 'Model name' | sed 's/.*: *//'), $(nproc) CPUs; flags: $(grep -o -w -E 'avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "nvme_path $NVME_DIR on $(df --output=source,fstype "$NVME_DIR" | tail -1)"
for r in $(seq 1 "$ROUNDS"); do
    for mode in device cpu nvme; do
        rm -rf "$T/out"
        /usr/bin/time -f "%M" -o "$T/rss" "$FL" "${ARGS[@]}" ${X[$mode]} --out_dir "$T/out" >"$T/log" 2>&1 || { echo "FAIL $mode"; tail -3 "$T/log"; exit 1; }
        secs=$(grep "training time" "$T/log" | awk '{print $(NF-2)}')
        echo "$mode $r $(cat "$T/rss") $secs" | tee -a "$T/all"
    done
done
echo "mode      median peak RSS (MB)   median training time per step (s)"
for mode in device cpu nvme; do
    rss=$(awk -v m=$mode '$1==m{print $3}' "$T/all" | sort -n | awk '{a[NR]=$1}END{print a[int((NR+1)/2)]}')
    sec=$(awk -v m=$mode '$1==m{print $4}' "$T/all" | sort -g | awk '{a[NR]=$1}END{print a[int((NR+1)/2)]}')
    printf "%-8s  %10.0f             %8.3f\n" "$mode" "$(echo "$rss / 1024" | bc -l)" "$(echo "$sec / $STEPS" | bc -l)"
done
