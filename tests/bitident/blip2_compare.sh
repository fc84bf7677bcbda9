#!/usr/bin/env bash
# Does a change train BLIP-2 bit-identically? fitllm_bitident drives the decoder trainer only, so this runs a matrix
# of short BLIP-2 caption fine-tunings (fl_blip2_train through the CLI) with two fitllm binaries on the same machine
# and compares every step's printed loss and the saved weights byte for byte (final/model.safetensors, and the PEFT
# adapter under LoRA).
#
#   tests/bitident/blip2_compare.sh OLD_FITLLM NEW_FITLLM [BACKEND...]   (default: cpu ref opaque; FITLLM_BACKEND)
#   FITLLM_B2CMP_ONLY=SUBSTR: the cases whose name contains it
# Exit 0: identical; 1: different (the case and what differs are named); 2: cannot run.
set -u
old=${1:?usage: blip2_compare.sh OLD_FITLLM NEW_FITLLM [BACKEND...]}
new=${2:?usage: blip2_compare.sh OLD_FITLLM NEW_FITLLM [BACKEND...]}
shift 2
for f in "$old" "$new"; do [ -x "$f" ] || { echo "blip2_compare.sh: $f is not an executable"; exit 2; }; done
backends=("$@")
[ ${#backends[@]} -eq 0 ] && backends=(cpu ref opaque)
here=$(cd "$(dirname "$0")/../.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
# the CLI suite's captions: the shipped test images, each with a caption of token ids
mkdir -p "$T/caps"; k=0
for f in "$here"/tests/fixtures/images/*.png "$here"/tests/fixtures/images/*.jpg; do
    case "$f" in *bad_*) continue ;; esac
    k=$((k+1)); cp "$f" "$T/caps/"; b=$(basename "$f"); printf '%d %d 9 11 %d\n' $((k*3)) $((k+40)) $((k*2+20)) > "$T/caps/${b%.*}.txt"
done
RUN=(--data JSON --data.json_path "$T/caps" --train.max_steps 3 --train.micro_batch_size 2 --train.global_batch_size 2
     --optimizer.lr 0.003 --train.lr_warmup_steps 0)
# name|command|options
cases=(
    "all|finetune_full|--blip2.train vision,qformer,lm"
    "default|finetune_full|"
    "lora|finetune_lora|--lora_r 4 --lora_dropout 0.1"
    "bf16mixed|finetune_full|--precision bf16-mixed --blip2.train vision,qformer,lm"
    "ckpt|finetune_full|--blip2.train vision,qformer,lm --train.activation_checkpointing true"
    "sgd-accum2|finetune_full|--optimizer SGD --optimizer.momentum 0.9 --train.global_batch_size 4"
    "offload|finetune_full|--strategy deepspeed_stage_2_offload"
    "adamw8bit|finetune_full|--optimizer bnb.optim.AdamW8bit"
)
n=0 bad=0
for be in "${backends[@]}"; do
    for m in blip2-tiny-opt blip2-tiny-t5; do
        for c in "${cases[@]}"; do
            name="$be-${m#blip2-tiny-}-${c%%|*}"
            [ -n "${FITLLM_B2CMP_ONLY:-}" ] && [ "${name#*"$FITLLM_B2CMP_ONLY"}" = "$name" ] && continue
            rest=${c#*|}; cmd=${rest%%|*}; read -r -a opt <<<"${rest#*|}"
            for side in old new; do
                bin=$old; [ $side = new ] && bin=$new
                FITLLM_BACKEND=$be "$bin" "$cmd" "$here/tests/fixtures/$m" "${RUN[@]}" "${opt[@]}" --out_dir "$T/$side" \
                    >"$T/$side.log" 2>&1
                echo "rc $?" >>"$T/$side.log"
            done
            grep -q "^step 3/3 loss" "$T/new.log" || { echo "FAILED $name (new build):"; tail -3 "$T/new.log"; bad=$((bad+1)); }
            n=$((n+1))
            why=""
            diff <(grep -E '^(step|epoch|rc)' "$T/old.log") <(grep -E '^(step|epoch|rc)' "$T/new.log") >"$T/d" || why="losses"
            for f in final/model.safetensors final/adapter/adapter_model.safetensors; do
                [ -e "$T/old/$f" ] || [ -e "$T/new/$f" ] || continue
                cmp -s "$T/old/$f" "$T/new/$f" || why="$why $f"
            done
            if [ -n "$why" ]; then
                bad=$((bad+1)); echo "DIFFERENT $name: $why"; head -6 "$T/d"
            fi
            rm -rf "$T/old" "$T/new"
        done
    done
done
if [ $bad -eq 0 ]; then echo "blip2 bitident: IDENTICAL: $n cases (${backends[*]})"; exit 0; fi
echo "blip2 bitident: $bad of $n cases DIFFERENT"
exit 1
