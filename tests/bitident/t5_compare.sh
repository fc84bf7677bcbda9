#!/usr/bin/env bash
# Does a change train T5 bit-identically? fitllm_bitident drives the decoder trainer only, so this runs a matrix of
# short T5 fine-tunings (finetune_full / finetune_lora on tests/fixtures/t5-pairs through the CLI) with two fitllm
# binaries on the same machine and compares every logged loss and the saved weights byte for byte
# (final/model.safetensors, and the PEFT adapter under LoRA). Models: the v1.0 (ReLU, tied head) and v1.1
# (gated-GELU) test configs with head size 10 (the attention's portable tile paths) and a v1.0 one with head size 64
# and 40 relative-position buckets (the vector tile paths, t5-small's head size), random init.
#
#   tests/bitident/t5_compare.sh OLD_FITLLM NEW_FITLLM [BACKEND...]   (default: cpu ref opaque; FITLLM_BACKEND)
#   FITLLM_T5CMP_ONLY=SUBSTR: the cases whose name contains it
# Exit 0: identical; 1: different (the case and what differs are named); 2: cannot run.
set -u
old=${1:?usage: t5_compare.sh OLD_FITLLM NEW_FITLLM [BACKEND...]}
new=${2:?usage: t5_compare.sh OLD_FITLLM NEW_FITLLM [BACKEND...]}
shift 2
for f in "$old" "$new"; do [ -x "$f" ] || { echo "t5_compare.sh: $f is not an executable"; exit 2; }; done
backends=("$@")
[ ${#backends[@]} -eq 0 ] && backends=(cpu ref opaque)
here=$(cd "$(dirname "$0")/../.." && pwd)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
tok="$here/tests/fixtures/t5-tok"
for m in relu gated; do
    mkdir -p "$T/m-$m"; cp "$tok/spiece.model" "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$T/m-$m/"
    sed 's/"vocab_size": 97/"vocab_size": 500/' "$here/tests/fixtures/t5-tiny-$m/config.json" >"$T/m-$m/config.json"
done
mkdir -p "$T/m-hd64"; cp "$tok/spiece.model" "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$T/m-hd64/"
sed -e 's/"vocab_size": 97/"vocab_size": 500/' -e 's/"d_kv": 10/"d_kv": 64/' -e 's/"d_model": 36/"d_model": 64/' \
    -e 's/"num_heads": 3/"num_heads": 2/' -e 's/"relative_attention_num_buckets": 8/"relative_attention_num_buckets": 40/' \
    "$here/tests/fixtures/t5-tiny-relu/config.json" >"$T/m-hd64/config.json"
RUN=(--init random --data JSON --data.json_path "$here/tests/fixtures/t5-pairs/pairs.json" --train.max_steps 4
     --train.epochs 100 --train.global_batch_size 4 --train.micro_batch_size 2 --train.log_interval 1
     --optimizer.lr 3e-3 --train.lr_warmup_steps 0)
# name|command|options
cases=(
    "full|finetune_full|"
    "lora|finetune_lora|--lora_query true --lora_value true --lora_mlp true --lora_dropout 0.1"
    "bf16mixed|finetune_full|--precision bf16-mixed"
    "ckpt|finetune_full|--train.activation_checkpointing true"
)
n=0 bad=0
for be in "${backends[@]}"; do
    for m in relu gated hd64; do
        for c in "${cases[@]}"; do
            name="$be-$m-${c%%|*}"
            [ -n "${FITLLM_T5CMP_ONLY:-}" ] && [ "${name#*"$FITLLM_T5CMP_ONLY"}" = "$name" ] && continue
            rest=${c#*|}; cmd=${rest%%|*}; read -r -a opt <<<"${rest#*|}"
            for side in old new; do
                bin=$old; [ $side = new ] && bin=$new
                FITLLM_BACKEND=$be "$bin" "$cmd" --checkpoint_dir "$T/m-$m" "${RUN[@]}" "${opt[@]}" --out_dir "$T/$side" \
                    >"$T/$side.log" 2>&1
                echo "rc $?" >>"$T/$side.log"
            done
            grep -q "^rc 0" "$T/new.log" || { echo "FAILED $name (new build):"; tail -3 "$T/new.log"; bad=$((bad+1)); }
            n=$((n+1))
            why=""
            for side in old new; do awk -F, 'NR > 1 { print $4 }' "$T/$side/logs/metrics.csv" >"$T/$side.loss" 2>/dev/null; done
            cmp -s "$T/old.loss" "$T/new.loss" || why="losses"
            [ -s "$T/new.loss" ] || why="$why (no losses logged)"
            for f in final/model.safetensors final/adapter/adapter_model.safetensors; do
                [ -e "$T/old/$f" ] || [ -e "$T/new/$f" ] || continue
                cmp -s "$T/old/$f" "$T/new/$f" || why="$why $f"
            done
            if [ -n "$why" ]; then
                bad=$((bad+1)); echo "DIFFERENT $name: $why"; diff "$T/old.loss" "$T/new.loss" | head -4
            fi
            rm -rf "$T/old" "$T/new"
        done
    done
done
if [ $bad -eq 0 ]; then echo "t5 bitident: IDENTICAL: $n cases (${backends[*]})"; exit 0; fi
echo "t5 bitident: $bad of $n cases DIFFERENT"
exit 1
