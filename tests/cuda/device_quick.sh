#!/usr/bin/env bash
# A lent GPU's last few minutes: the checks and timings of one change, most important first, inside a budget.
# Prepared here with tools/gpu_pack.sh; on the device, from the repository root, with .gpupack carried:
#   tests/cuda/device_quick.sh [budget-seconds]      (default 180)
# Writes every log to $OUT (default /tmp/fitllm-quick-out) and prints a summary. Each step gets its own timeout,
# no more than what is left of the budget (a step that cannot get 15 s is skipped, said so), in this order:
#   1. `fitllm selftest --accelerator cuda --only attention_choices`: cuDNN's fused attention (and the own kernels)
#      against float64 at small shapes, forward + backward (T5's bias, dbias and dropout too), then timed at
#      TinyLlama's shape and Flan-T5-base's (the copies path: the selftest's operands are fp32);
#   2. the TinyLlama-1.1B bf16-true step (B 4, T 2048) with --profile (the attention's share, whether cuDNN ran);
#   2b. the same step on the own kernels (FITLLM_CUDA_ATTN=own: their tiles' pipelined loads), and with
#      FITLLM_CUDA_FA2_BK=128 (the backward's 128-key blocks, A/B), each with the profile's attention rows;
#   2c. only when cuDNN refused a graph: cuDNN's debug logs (CUDNN_LOGLEVEL_DBG=3) of our graphs (selftest) and of
#      PyTorch's sdpa at TinyLlama's shape, xz-compressed in $OUT: the evidence for the next graph fix;
#   3. the `small` preset (head size 64: cuDNN's graphs, reading the stored bf16 q, k, v in place), 8 bf16-true
#      training steps on the CPU and on the GPU: the largest relative step-loss difference (bound 2e-2, as
#      gpu_check_all.sh);
#   4. the TinyLlama LoRA r 8 step; 5. the full step with FITLLM_CUDA_CUDNN_DIRECT=0 (the copies, A/B); 5b. with
#   FITLLM_CUDA_CUDNN_B16=0 (cuDNN's backward with fp32 dO and gradients around it, A/B, the profile's rows);
#   6. the TinyLlama QLoRA nf4 step (the default 4-bit mode) with its profile (the 4-bit GEMMs' rows), 6b. (run after
#   7c) with FITLLM_CUDA_Q4_STACK=0 (a GEMM per 4-bit part: A/B); 7. the full step with FITLLM_CUDA_HEAD_GROUP=0 (A/B, with
#   the profile's head GEMM rows); 7b. GPT-2 124M bf16-true (B 8, T 1024) with --profile (72.8 ms a step on the
#   H200 of 2026-11-30, ~2x what its GEMMs and attention account for: the profile says where the rest goes; since
#   2026-12-01 the head's logits rows are padded to 50,264, whose three GEMMs were misaligned: the head's gemm rows);
#   7c. Flan-T5-base bf16-true with --dropout (B 8, source 512, target 128): its attention (relative bias, dropout)
#   on the fa2 EX kernels, then FITLLM_CUDA_ATTN=fp32 (the fp32 kernels it ran before; A/B), and PyTorch's step at the
#   same settings (bench/bench_t5_torch.py --device cuda --dtype bf16 --dropout 0.1);
#   8. fitllm_cuda_check with what is left.
# tests/cuda/device_quick.sh --small-ref (here, after tools/gpu_pack.sh): step 3's CPU side with the packed binary,
# written to .gpupack/ref/small-cpu-metrics.csv and carried with the pack (the device then trains on the GPU only).
set -u
SMALL_COMMON="--data Synthetic --train.max_steps 8 --train.global_batch_size 8 --train.micro_batch_size 4 \
--train.max_seq_length 128 --train.save_interval 100 --eval.interval 100 --train.log_interval 1 --seed 3 --overwrite true"
if [ "${1:-}" = --small-ref ]; then
    R=$(mktemp -d /tmp/fitllm-ref-XXXXXX)
    # shellcheck disable=SC2086
    .gpupack/bin/fitllm finetune_full small --precision bf16-true $SMALL_COMMON --accelerator cpu --out_dir "$R" \
        >"$R.log" 2>&1 || { tail -5 "$R.log"; exit 1; }
    mkdir -p .gpupack/ref && cp "$R/logs/metrics.csv" .gpupack/ref/small-cpu-metrics.csv && rm -rf "$R" "$R.log"
    echo "device_quick: .gpupack/ref/small-cpu-metrics.csv written"; cat .gpupack/ref/small-cpu-metrics.csv
    exit 0
fi
BUDGET=${1:-180}
OUT=${OUT:-/tmp/fitllm-quick-out}
mkdir -p "$OUT"
PACK=.gpupack
F=$PACK/bin/fitllm
[ -x "$F" ] || { echo "device_quick: $F missing: run tools/gpu_pack.sh here first"; exit 1; }
. "$(dirname "$0")/gpupack_env.sh"
gpupack_env "$PACK" "$F"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; "$F" --version | grep -E "fitllm|cuda|cudnn"; } \
    2>&1 | tee "$OUT/env.txt"
left() { echo $((BUDGET - SECONDS)); }
# run NAME WANT-SECONDS command...: under min(WANT, what is left); the log in $OUT/NAME.log
run() {
    local name=$1 want=$2 t
    shift 2
    t=$(left)
    [ "$t" -gt "$want" ] && t=$want
    if [ "$t" -lt 15 ]; then echo "== $name: skipped (${t} s left of the budget)"; return 1; fi
    timeout "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name exit $rc (limit $t s, at ${SECONDS} s)" >>"$OUT/$name.log"
    return $rc
}
step() { # the TinyLlama step: NAME WANT extra-args...
    local name=$1 want=$2
    shift 2
    run "$name" "$want" "$F" bench-step tinyllama-1.1b --accelerator cuda --precision bf16-true --micro-batch 4 \
        --seq 2048 --steps 5 --warmup 2 "$@"
    [ -f "$OUT/$name.log" ] && grep -E "^median [0-9]|^MFU|cuDNN|exit" "$OUT/$name.log" | head -6
}

echo "== 1. attention choices (cuDNN, own, legacy against float64; timed at TinyLlama's shape)"
run attn 45 "$F" selftest --accelerator cuda --only attention_choices
grep -E "attention |cuDNN|not available|exit" "$OUT/attn.log"
echo "   (planned without a GPU, tests/fixtures/cudnn-engines.txt: an H200 gets engine 2 forward, 6 backward (an H100,"
echo "    sm_90 too, was not planned); an A100 1 and 7; the cuDNN lines above name the engines this GPU's heuristics chose)"

echo "== 2. TinyLlama-1.1B bf16-true step with the profile"
step full 35 --profile
sed -n '/^profile/,/^  GEMM shapes/p' "$OUT/full.log" | grep -E "attention|GEMM  |norm  |elementwise|embedding|optimizer|copies|sum of ops"

echo "== 2b. the step on the own attention kernels, 64- then 128-key backward blocks"
FITLLM_CUDA_ATTN=own step own 35 --profile
[ -f "$OUT/own.log" ] && grep -E "^ +attention" "$OUT/own.log" | head -4
FITLLM_CUDA_ATTN=own FITLLM_CUDA_FA2_BK=128 step own128 35 --profile
[ -f "$OUT/own128.log" ] && grep -E "^ +attention" "$OUT/own128.log" | head -4

if grep -q "cuDNN attention.*refused" "$OUT/attn.log" "$OUT/full.log" 2>/dev/null; then
    # cuDNN matches its fused engines' graphs node for node: the next fix compares its debug log of our graphs with
    # the one of PyTorch's (the frontend's) at the same shape, as the 2026-11-30 session did by hand
    echo "== 2c. cuDNN refused a graph: its debug logs of ours and of PyTorch's sdpa (compressed in \$OUT)"
    CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG="$OUT/cudnn-ours.txt" run cudnn-ours 40 "$F" selftest --accelerator cuda \
        --only attention_choices
    CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG="$OUT/cudnn-torch.txt" run cudnn-torch 45 python3 bench/sdpa_torch.py
    for f in "$OUT/cudnn-ours.txt" "$OUT/cudnn-torch.txt"; do
        [ -f "$f" ] && head -c 30000000 "$f" | xz -6 >"$f.xz" && rm -f "$f" && ls -l "$f.xz"
    done
fi

echo "== 3. the small preset (HD 64: cuDNN in a training), 8 bf16-true steps, cuda against cpu"
T=$(mktemp -d /tmp/fitllm-quick-XXXXXX)
ok=1
accs="cuda cpu"
# the CPU side made ahead on the machine that packed (the same binary: tools/gpu_pack.sh --small-ref) saves device time
if [ -f "$PACK/ref/small-cpu-metrics.csv" ]; then
    mkdir -p "$T/cpu/logs" && cp "$PACK/ref/small-cpu-metrics.csv" "$T/cpu/logs/metrics.csv" && accs=cuda
    echo "   (the CPU side from $PACK/ref/small-cpu-metrics.csv)"
fi
for acc in $accs; do
    # shellcheck disable=SC2086
    run "small-$acc" 60 "$F" finetune_full small --precision bf16-true $SMALL_COMMON --accelerator $acc --out_dir "$T/$acc" ||
        ok=0
    [ -f "$OUT/small-$acc.log" ] && grep -E "cuDNN|error" "$OUT/small-$acc.log" | head -3
done
for acc in cpu cuda; do # a run that wrote no step losses is no comparison (not a pass)
    if [ "$(tail -n +2 "$T/$acc/logs/metrics.csv" 2>/dev/null | wc -l)" -lt 8 ]; then
        ok=0 && echo "FAIL small-bf16: $acc wrote no 8 steps' losses ($T/$acc/logs/metrics.csv)"
    fi
done
if [ $ok = 1 ]; then
    d=$(paste -d' ' <(cut -d, -f4 "$T/cpu/logs/metrics.csv" | tail -n +2) <(cut -d, -f4 "$T/cuda/logs/metrics.csv" | tail -n +2) |
        awk 'NF == 2 && $1 != 0 {if ($2 !~ /^-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?$/) {bad=1; next}
                                  r=($1-$2)/$1; if(r<0)r=-r; if(r>m)m=r}
             END{if (bad) printf "nan"; else printf "%.2e", m}')
    awk -v d="$d" 'BEGIN{exit !(d <= 2e-2)}' && echo "ok   small-bf16: max relative loss difference $d (bound 2e-2)" ||
        echo "FAIL small-bf16: max relative loss difference $d (bound 2e-2)"
    paste -d' ' <(cut -d, -f4 "$T/cpu/logs/metrics.csv") <(cut -d, -f4 "$T/cuda/logs/metrics.csv") >"$OUT/small-losses.txt"
fi
rm -rf "$T"

echo "== 4. TinyLlama LoRA r 8"
step lora 30 --lora 8
echo "== 5. the full step with FITLLM_CUDA_CUDNN_DIRECT=0 (compact copies first)"
FITLLM_CUDA_CUDNN_DIRECT=0 step copies 30
echo "== 5b. the full step with FITLLM_CUDA_CUDNN_B16=0 (cuDNN's backward with fp32 dO and gradients, converted: A/B)"
FITLLM_CUDA_CUDNN_B16=0 step f32grads 30 --profile
for n in full f32grads; do
    [ -f "$OUT/$n.log" ] && grep -E "^ +(attention_backward(16|_b16)|rope_backward16|zero) " "$OUT/$n.log" | sed "s/^/$n: /"
done
echo "== 6. TinyLlama QLoRA nf4 r 8 (the default 4-bit mode, scratch), with the profile (6b below: the A/B)"
step qlora 30 --lora 8 --quantize bnb.nf4 --profile
[ -f "$OUT/qlora.log" ] && grep -E "^ +q4_matmul_(forward|backward)16 " "$OUT/qlora.log" | head -2
echo "== 7. the full step with FITLLM_CUDA_HEAD_GROUP=0 (the LM head's dW one GEMM per chunk, A/B)"
FITLLM_CUDA_HEAD_GROUP=0 step headchunk 30 --profile
[ -f "$OUT/headchunk.log" ] && grep -E "^ +32000 +2048 " "$OUT/headchunk.log" "$OUT/full.log" | head -4
echo "== 7b. GPT-2 124M bf16-true, B 8, T 1024, with the profile"
run gpt2 30 "$F" bench-step gpt2 --accelerator cuda --precision bf16-true --micro-batch 8 --seq 1024 --steps 5 \
    --warmup 2 --profile
[ -f "$OUT/gpt2.log" ] && grep -E "^median [0-9]|^MFU|cuDNN|^  [A-Za-z+]+ +[0-9.]+ +[0-9.]+%|exit| 50257 " "$OUT/gpt2.log" |
    head -20
echo "== 7c. Flan-T5-base bf16-true with dropout (B 8, source 512, target 128): T5's attention (bias, dropout) on"
echo "       the fa2 EX kernels, then on the fp32 kernels (FITLLM_CUDA_ATTN=fp32: A/B)"
T5S=(bench-step flan-t5-base --accelerator cuda --precision bf16-true --micro-batch 8 --source-seq 512 --seq 128
     --steps 5 --warmup 2 --dropout --profile)
run t5 30 "$F" "${T5S[@]}"
FITLLM_CUDA_ATTN=fp32 run t5fp32 30 "$F" "${T5S[@]}"
# PyTorch beside it (transformers' T5, bf16 weights, eager attention: T5's position bias; fused AdamW)
run t5torch 45 python3 bench/bench_t5_torch.py --device cuda --dtype bf16 --dropout 0.1 --shape flan-t5-base \
    --batch 8 --source 512 --target 128 --attn eager --steps 5 --warmup 2
[ -f "$OUT/t5torch.log" ] && grep -E "^RESULT|Error|exit" "$OUT/t5torch.log" | head -3
for n in t5 t5fp32; do
    [ -f "$OUT/$n.log" ] && grep -E "^median [0-9]|^  attention +[0-9.]+|exit" "$OUT/$n.log" | sed "s/^/$n: /" | head -4
done
echo "== 6b. QLoRA with FITLLM_CUDA_Q4_STACK=0 (a GEMM per 4-bit part instead of q|k|v and gate|up stacked: A/B)"
FITLLM_CUDA_Q4_STACK=0 step qlora-parts 30 --lora 8 --quantize bnb.nf4 --profile
[ -f "$OUT/qlora-parts.log" ] && grep -E "^ +q4_matmul_(forward|backward)16 " "$OUT/qlora-parts.log" | head -2
echo "== 8. fitllm_cuda_check"
if run check 150 "$PACK/bin/fitllm_cuda_check"; then :; fi
[ -f "$OUT/check.log" ] && grep -E "FAIL|all ok|FAILED|exit" "$OUT/check.log" | head -20
echo "device_quick: done after ${SECONDS} s (budget ${BUDGET} s)"
