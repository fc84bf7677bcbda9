#!/bin/bash
# Parameter offload's fetch worker (--offload_overlap) on and off, side by side: bench/poff_demo (pretrain, AdamW
# fp32, the parameters, gradients and optimizer state in NVMe files) on a smaller LLaMA shape (default L=12 C=1024
# F=2816 vocab 32000: 0.22 B parameters, 3.5 GB of files), alternating on/off, ROUNDS rounds of STEPS steps; per
# mode the median over rounds of the mean step time of steps 2..STEPS (step 1 carries the random init) and of
# the disk bytes per step (the process's /proc/self/io), and the peak RSS. Same bits either way
# (tests/test_poff.c poff_overlap_keeps_the_bits).
# WHAT=update: the same for the host update unit by unit on that worker (--offload_update_overlap; without clipping,
# MAX_NORM 0, which it needs), the fetch worker on in both; TIER=cpu: the parameters and the state in host memory
# (fsdp_cpu_offload) in place of the NVMe files.
# Usage: bench/run_poff_overlap.sh [build] (env: L=12 C=1024 F=2816 STEPS=3 ROUNDS=3 T=16 NVME_DIR=/var/tmp/fitllm-poff
#        WHAT=fetch|update TIER=nvme|cpu)
set -u
WHAT=${WHAT:-fetch}; TIER=${TIER:-nvme}
BUILD=${1:-build}
L=${L:-12}; C=${C:-1024}; F=${F:-2816}; STEPS=${STEPS:-3}; ROUNDS=${ROUNDS:-3}; TT=${T:-16}
NVME_DIR=${NVME_DIR:-/var/tmp/fitllm-poff}
mkdir -p "$NVME_DIR"
W=$(mktemp -d /tmp/fitllm-poff-bench-XXXXXX)
trap 'rm -rf "$W"' EXIT
cat > "$W/config.json" <<JSON
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": $C,
 "intermediate_size": $F, "num_attention_heads": $((C / 128)), "num_key_value_heads": $((C / 128)),
 "num_hidden_layers": $L, "max_position_embeddings": 2048, "rms_norm_eps": 1e-06, "tie_word_embeddings": false,
 "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2}
JSON
echo "$WHAT overlap on/off, tier $TIER; machine: $(lscpu | grep 'Model name' | sed 's/.*: *//'), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "nvme_path $NVME_DIR on $(df --output=source,fstype "$NVME_DIR" | tail -1)"
for r in $(seq 1 "$ROUNDS"); do
    for mode in true false; do
        if [ "$WHAT" = update ]; then sw=(true "$mode" 0); else sw=("$mode" true 1.0); fi
        /usr/bin/time -f "%M" -o "$W/rss" "$BUILD/poff_demo" "$W/config.json" "$NVME_DIR" "$STEPS" "$TT" "$W/out" "${sw[@]}" \
            "$TIER" >"$W/log" 2>&1 || { echo "FAIL $WHAT overlap $mode"; tail -3 "$W/log"; exit 1; }
        # "step k: loss X, S s, disk read R GB, written W GB ..." for k >= 2
        read -r secs rd wr < <(grep '^step ' "$W/log" | awk -F'[ ,]+' '$2+0 >= 2 {s += $5; r += $9; w += $12; n++}
            END {printf "%.2f %.2f %.2f\n", s / n, r / n, w / n}')
        echo "overlap=$mode round $r: $secs s/step, read $rd GB, written $wr GB per step, peak RSS $(( $(cat "$W/rss") / 1024 )) MB" | tee -a "$W/all"
    done
done
for mode in true false; do
    grep "overlap=$mode " "$W/all" | awk '{print $4}' | sort -n |
        awk -v m="$mode" '{v[NR] = $1} END {printf "median overlap=%s: %s s/step over %d rounds\n", m, v[int((NR + 1) / 2)], NR}'
done
[ -z "$(ls -A "$NVME_DIR")" ] && echo "no file left in $NVME_DIR" || echo "FILES LEFT in $NVME_DIR"
