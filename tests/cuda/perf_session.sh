#!/usr/bin/env bash
# Issue 30's speed measurements on a lent GPU (the device's time is short: about 10 minutes for all 22 steps, not
# measured since step 9; PERF_STEPS below splits it into two calls):
#   tests/cuda/perf_session.sh [bin-dir]          (default .gpupack/bin, made here by tools/gpu_pack.sh; or a
#                                                  CUDA build folder with fitllm, libfitllm_cuda.so, fitllm_cuda_check)
# Writes to $OUT (default /tmp/fitllm-perf-out) and prints the summary:
#   1. fitllm_cuda_check, the fused / 128-bit kernels part (tests/cuda/check_fused.c): GPU vs emulator, and
#      add+RMSNorm fused vs add + rmsnorm, SwiGLU 128-bit vs element path at TinyLlama's shapes (~1 min);
#   2. bench-step tinyllama-1.1b bf16-true B 4 T 2048 (5 steps after 2 warm-ups): the step, its MFU (the GPU's
#      dense bf16 peak from the table), then the same with --profile (per-op times by group, CUDA events);
#   3. the same for LoRA r 8 (q, v);
#   4. a 6-step finetune_full of the `small` preset on Synthetic data: the trainer's summary with its MFU row;
#   5. attention alone at TinyLlama's shape (B 4, T 2048, 32/4 heads, HD 64, causal, bf16, forward + backward):
#      `fitllm selftest --only attention_choices` (cuDNN's fused SDPA, the own FA2-structured and the legacy
#      kernels, each checked against float64 at smaller shapes, then timed: TFLOP/s), bench/sdpa_torch.py
#      (PyTorch's sdpa: flash, cudnn, efficient backends) beside it, and the TinyLlama step with
#      FITLLM_CUDA_ATTN=own against the default (auto: cuDNN where it loads);
#   6. GPT-2 (124M, 32-true and bf16-true, B 8 T 1024): cuBLASLt's bias / bias+GELU epilogues against
#      FITLLM_CUDA_EPILOGUE=0, and the TinyLlama step with FITLLM_CUDA_PINNED=0 (pageable uploads) against the ring;
#   7. CUDA graphs: the TinyLlama step and the `small` preset's (launch-bound: B 8, T 256) with FITLLM_CUDA_GRAPHS=1
#      against 0 (bench-step's 2 warm-ups: step 1 op by op, step 2 captured, the timed steps replayed), and the
#      line saying how many graphs a step became or why it stays op by op.
#   8. GPT-2 (124M, B 8 T 1024) bf16-true and bf16-mixed with --profile: the LayerNorm kernels over 16-bit weights
#      and saved inputs (layernorm_*_w16: no convert around the norms; the "elementwise" group's convert share)
#      (step 1 also checks them and the 128-bit elementwise paths against the element path: tests/cuda/check_vec16.c).
#   9. the step scalars (issue 30 item 5: the gradient norm, clip scale and loss sums on the device, one read per
#      step): the TinyLlama step, the `small` preset's (launch-bound) and the trainer's 2-micro-batch steps with
#      clipping, each with FITLLM_CUDA_STEP_SCALARS=1 (the default) against 0 (the host reads), and with graphs.
#  10. fp16's overflow check on the device (16-mixed: the flag read with the step's one copy, no wait before the
#      update): the `small` preset's step and the trainer's 2-micro-batch clipped steps, FITLLM_CUDA_STEP_SCALARS=1
#      against 0 (check_finite read back mid-step), with and without graphs; the trainer's overflow lines side by side.
#  11. the next micro-batch's inputs uploaded ahead on a second stream (FITLLM_CUDA_PREFETCH=1, the default, against
#      0): the TinyLlama step, the `small` preset's under graphs (the uploads inside the graphs: the line with the
#      graphs' ops and those outside) and the trainer's 4-micro-batch steps (where the copy overlaps the compute).
#  12. SGD (momentum) and 8-bit AdamW on the step scalars (their update reading the scale on the device; both inside
#      the graphs): the trainer's 2-micro-batch clipped steps with FITLLM_CUDA_STEP_SCALARS=1 against 0, each also with
#      FITLLM_CUDA_GRAPHS=1 (the verdict line: how many graphs; 8-bit AdamW's per-tensor updates captured since the
#      2026-11-30 00:35 wave).
#  13. QLoRA's 4-bit matmuls (issue 30 item 7): the TinyLlama QLoRA step (nf4, LoRA r 8) with FITLLM_CUDA_Q4=fp32 (the
#      fp32 kernels), tc (bf16 tensor cores, NF4 dequantized in the load) and scratch (dequantized into a bf16 panel,
#      then cuBLASLt), and step 1's kernel timings of both 4-bit kernels (q4_matmul_* lines of fitllm_cuda_check).
#      Each mode is named: since the 2026-11-30 evening wave a bf16 run's default is scratch (H200: 324 ms a step
#      against fp32's 1530 ms and tc's 1613 ms), so the unset knob is the scratch row, fp32 the former default.
#  14. tensor parallelism's device ops (issue 35, EXPERIMENTAL: emulator-verified): `fitllm selftest --accelerator cuda
#      --only vocab_xent` and `--only dropout_rows` (the vocabulary-parallel cross-entropy's row statistics and combine
#      kernels, the row-strided dropout, on the GPU against the CPU backend at a 32000-token vocabulary over 8 slices).
#  15. bf16 activations' bias + GELU in the GEMM's epilogue (FITLLM_CUDA_GELU16=1 against 0, the default: the GELU
#      of the bf16-rounded pre-activation after the GEMM): GPT-2 (124M, B 8 T 1024) bf16-true and bf16-mixed steps, and
#      the profile's GEMM / elementwise groups of bf16-true with each (either way the bf16-true linears' biases are
#      read in bf16 by the epilogue, c_attn writes q|k|v in bf16 only and its bf16 dy comes from its bias-gradient
#      kernel: 0 conversion launches per 2 emulated gpt2-micro steps, not 36; the profile's convert / round16 rows
#      show any left).
#  16. bf16 storage without the unread fp32 views (issue 30 item 1): the TinyLlama step and GPT-2's bf16-true step with
#      FITLLM_CUDA_VIEWS32=1 (every stored slot's fp32 view written and allocated, the earlier layout) against 0 (the
#      default: ln1 / att / ln2 / gate|up / act in bf16 only, and RoPE's q|k|v and the backward's d(gate|up) / d(q|k|v)
#      not written in fp32); bench-step's memory line shows WORKSPACE.
#  17. the cross-block residual add + norm (issue 30 item 4): the TinyLlama step and GPT-2's bf16-true step with
#      FITLLM_CUDA_XBLOCK_NORM=1 (the default: a block's last add fused with the next block's ln_1 / the final norm)
#      against 0 (each block's own add: one launch and one write + read-back of the row more per block and pass).
#  18. bf16 weight gradients written by their GEMMs (issue 30 item 1): the TinyLlama step with FITLLM_CUDA_DW16=1 (the
#      default: a block's dW GEMMs BF16,BF16->BF16 in place in the bf16 gradient) against 0 (staged in fp32, zeroed
#      and added back by accumulate16: 704 MB more traffic per block and micro-batch), with the profile's GEMM rows.
#  19. LoRA / QLoRA bf16 without conversions (issue 30 items 1 and 7): the TinyLlama LoRA r 8 q,v and QLoRA (nf4)
#      steps with FITLLM_CUDA_LORA16=1 (the default: the frozen bases' dx GEMMs read a bf16 dy their producers write,
#      adapters with dropout read their dropped copies) against 0 (a dy panel conversion in every frozen dx GEMM,
#      ln1 widened before each block's backward).
#  20. QLoRA's 4-bit bases over bf16 inputs (issue 30 items 1 and 7): the TinyLlama QLoRA (nf4) step under
#      FITLLM_CUDA_Q4=tc and scratch with FITLLM_CUDA_Q4X16=1 (the default: q4_matmul_forward16 / _backward16 read the
#      stored bf16 x and the bf16 dy; the att, ln2, act fp32 views and the bases' fp32 dy not written) against 0, with
#      the profile's GEMM rows.
#  21. the residual stream held in bf16 (issue 30 item 1): the TinyLlama step and GPT-2's bf16-true step with
#      FITLLM_CUDA_STREAM16=1 (the default: the residual adds read the stream's stored bf16 rows, the mid residual's
#      fp32 sum not written, one fp32 rows buffer) against 0 (the fp32 rows: 128 MiB more traffic per block and
#      forward pass, 2 buffers more WORKSPACE); bench-step's memory line shows WORKSPACE.
#  22. the residual add inside its projection's GEMM (issue 30 items 1 and 3): the TinyLlama step with
#      FITLLM_CUDA_RESGEMM=1 (the default: o and down write the residual sum's bf16 rows, cuBLASLt's C the stored
#      residual, D the sum) against 0 (their fp32 outputs, then the add: 256 MiB more traffic per block and forward
#      pass), with the profile's GEMM rows (gemm_res16's shapes).
#  23. the split column sums and cross-entropy (the 2026-11-30 18:00 wave; no knob: the old kernels are gone): the
#      TinyLlama step's profile rows of rmsnorm_backward_w16 (152 us per call at main b188d93 on the H200; expected
#      ~45-60 us) and cross_entropy_dbf16 (97 us; expected ~15-25 us), and fitllm_cuda_check's timing lines of both
#      (GB/s at 8192 x 2048 and 262 x 32000).
# PERF_DRY=1: the plumbing only, on any machine (tests/cli_test.sh perf_session_dry): each command is written to its
# log as "DRY <the FITLLM_CUDA_* settings> <command>" instead of run (bin-dir may be a CPU build's).
# Each step has its own timeout. Compare with docs/BENCHMARKS.md "GPU" (H100: 356 ms, 15.7% MFU at 58c0c5e's
# kernels; the issue's H200: 302 ms, 18.5%).
set -u
BIN=${1:-.gpupack/bin}
OUT=${OUT:-/tmp/fitllm-perf-out}
mkdir -p "$OUT"
if [ "${PERF_DRY:-0}" = 1 ]; then
    timeout() { shift; echo "DRY $(env | grep '^FITLLM_CUDA_' | sort | tr '\n' ' ')$*"; }
    nvidia-smi() { echo "DRY nvidia-smi"; }
fi
F=$BIN/fitllm
[ -x "$F" ] || { echo "perf_session: $F missing (tools/gpu_pack.sh here first, or name a CUDA build folder)"; exit 1; }
. "$(dirname "$0")/gpupack_env.sh"
if [ "${PERF_DRY:-0}" != 1 ]; then # the pack's libraries the machine lacks (a CUDA build folder: none), cuDNN
    if [ "$BIN" = .gpupack/bin ]; then gpupack_env .gpupack "$F"; else gpupack_env /nonexistent "$F"; fi
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader; "$F" --version | grep -i cuda; } \
    | tee "$OUT/env.txt"

bench() { # name timeout args...
    local name=$1 t=$2; shift 2
    timeout "$t" "$F" bench-step tinyllama-1.1b --accelerator cuda --precision bf16-true --micro-batch 4 --seq 2048 \
        --steps 5 --warmup 2 "$@" >"$OUT/$name.log" 2>&1
    echo "bench-step $name exit $?" >>"$OUT/$name.log"
    grep -E "^median|^MFU|^RESULT|exit" "$OUT/$name.log"
}
# ab_both KNOB TAG: the TinyLlama step and GPT-2's bf16-true step with KNOB=1 then 0
ab_both() {
    local v
    for v in 1 0; do
        export "$1=$v"
        bench "$2-$v" 60
        gpt2_ab bf16-true "$2$v" "$1=$v"
        unset "$1"
    done
}
# ab_profile KNOB TAG ROWS [args]: the TinyLlama step with --profile, KNOB=1 then 0, and the profile's ROWS (egrep)
ab_profile() {
    local knob=$1 tag=$2 rows=$3 v
    shift 3
    for v in 1 0; do
        export "$knob=$v"
        bench "$tag-$v" 60 --profile "$@"
        unset "$knob"
        sed -n '/^profile/,/^PROFILE/p' "$OUT/$tag-$v.log" | grep -E "$rows" | head -8
    done
}
gpt2_ab() { # precision log-tag label (the A/B switch set by the caller): a GPT-2 step (124M, B 8, T 1024)
    timeout 60 "$F" bench-step gpt2 --accelerator cuda --precision "$1" --micro-batch 8 --seq 1024 --steps 5 \
        --warmup 2 >"$OUT/gpt2-$1-$2.log" 2>&1
    echo "gpt2 $1 $3 exit $?: $(grep -E '^median' "$OUT/gpt2-$1-$2.log")"
}
# PERF_STEPS (default: all): the steps to run, e.g. "1-5,18" (the device's calls are limited to 10 minutes: run the
# session in two calls, PERF_STEPS=1-9 then 10-22, when it does not fit one)
want_step() {
    local n=$1 part a b
    [ -z "${PERF_STEPS:-}" ] && return 0
    for part in ${PERF_STEPS//,/ }; do
        a=${part%-*}; b=${part#*-}
        [ "$n" -ge "$a" ] && [ "$n" -le "$b" ] && return 0
    done
    return 1
}
if want_step 1; then
echo "== 1. fused and 128-bit kernels (fitllm_cuda_check)"
if [ -x "$BIN/fitllm_cuda_check" ]; then
    timeout 150 "$BIN/fitllm_cuda_check" >"$OUT/cuda_check.log" 2>&1
    echo "fitllm_cuda_check exit $?" >>"$OUT/cuda_check.log"
    grep -E "q4_matmul|q4 tc|add_rmsnorm|swiglu|add\+rmsnorm|add\+layernorm|gemm epilogue|gemm bench|layernorm_.*_w16|128-bit|clip_scale|check_finite_ss|loss_sum|_update_ss|FAIL|all ok|FAILED|exit" \
        "$OUT/cuda_check.log"
else
    echo "  (fitllm_cuda_check not in $BIN)"
fi

fi
if want_step 2; then
echo "== 2. TinyLlama-1.1B full bf16-true, B 4, T 2048"
bench full 60
bench full-profile 60 --profile
sed -n '/^profile/,/^PROFILE/p' "$OUT/full-profile.log"
fi
if want_step 3; then
echo "== 3. LoRA r 8"
bench lora 60 --lora 8
fi
if want_step 4; then
echo "== 4. the trainer's summary (small preset, Synthetic data, 6 steps)"
timeout 60 "$F" finetune_full small --accelerator cuda --precision bf16-true --data Synthetic --train.max_steps 6 \
    --train.global_batch_size 8 --train.micro_batch_size 8 --train.max_seq_length 1024 --train.save_interval 100 \
    --eval.interval 100 --train.log_interval 1 --overwrite true --out_dir "$OUT/small-run" >"$OUT/train.log" 2>&1
echo "finetune_full exit $?" >>"$OUT/train.log"
grep -E "TFLOP/s|MFU|exit" "$OUT/train.log"
fi
if want_step 5; then
echo "== 5. attention: cuDNN vs own vs PyTorch sdpa (TinyLlama shape, forward + backward)"
timeout 120 "$F" selftest --accelerator cuda --only attention_choices >"$OUT/attn_choices.log" 2>&1
echo "selftest attention_choices exit $?" >>"$OUT/attn_choices.log"
grep -E "attention |not available|cuDNN|exit" "$OUT/attn_choices.log"
if python3 -c "import torch" 2>/dev/null; then
    timeout 90 python3 "$(dirname "$0")/../../bench/sdpa_torch.py" >"$OUT/sdpa_torch.log" 2>&1
    echo "sdpa_torch exit $?" >>"$OUT/sdpa_torch.log"
    cat "$OUT/sdpa_torch.log"
fi
FITLLM_CUDA_ATTN=own bench full-own 60
grep -E "cuDNN" "$OUT/full.log" "$OUT/full-own.log" | head -5
fi
if want_step 6; then
echo "== 6. GEMM epilogues (GPT-2) and pinned uploads (A/B)"
for p in 32-true bf16-true; do
    for e in 1 0; do
        FITLLM_CUDA_EPILOGUE=$e gpt2_ab $p epi$e FITLLM_CUDA_EPILOGUE=$e
    done
done
FITLLM_CUDA_PINNED=0 bench full-nopin 60
fi
if want_step 7; then
echo "== 7. CUDA graphs (FITLLM_CUDA_GRAPHS=1 against 0, EXPERIMENTAL)"
FITLLM_CUDA_GRAPHS=1 bench full-graphs 60
grep -E "FITLLM_CUDA_GRAPHS" "$OUT/full-graphs.log" | head -3
for g in 0 1; do
    FITLLM_CUDA_GRAPHS=$g timeout 60 "$F" bench-step small --accelerator cuda --precision bf16-true --micro-batch 8 \
        --seq 256 --steps 10 --warmup 2 >"$OUT/small-graphs$g.log" 2>&1
    echo "small bf16-true FITLLM_CUDA_GRAPHS=$g exit $?: $(grep -E '^median' "$OUT/small-graphs$g.log")"
    grep -E "FITLLM_CUDA_GRAPHS" "$OUT/small-graphs$g.log" | head -2
done
fi
if want_step 8; then
echo "== 8. GPT-2 bf16 with the LayerNorm w16 kernels (profile)"
for p in bf16-true bf16-mixed; do
    timeout 60 "$F" bench-step gpt2 --accelerator cuda --precision $p --micro-batch 8 --seq 1024 --steps 5 --warmup 2 \
        --profile >"$OUT/gpt2-$p-profile.log" 2>&1
    echo "gpt2 $p --profile exit $?: $(grep -E '^median' "$OUT/gpt2-$p-profile.log")"
    sed -n '/^profile/,/^PROFILE/p' "$OUT/gpt2-$p-profile.log" | grep -E "norm|elementwise|convert" | head -6
done
fi
if want_step 9; then
echo "== 9. step scalars: the norm, clip scale and losses on the device (FITLLM_CUDA_STEP_SCALARS=1 against 0)"
for v in 1 0; do
    FITLLM_CUDA_STEP_SCALARS=$v bench full-ss$v 60
    for g in 0 1; do
        FITLLM_CUDA_STEP_SCALARS=$v FITLLM_CUDA_GRAPHS=$g timeout 60 "$F" bench-step small --accelerator cuda \
            --precision bf16-true --micro-batch 8 --seq 256 --steps 10 --warmup 2 >"$OUT/small-ss$v-graphs$g.log" 2>&1
        echo "small bf16-true STEP_SCALARS=$v GRAPHS=$g exit $?: $(grep -E '^median' "$OUT/small-ss$v-graphs$g.log")"
        grep -E "FITLLM_CUDA_GRAPHS" "$OUT/small-ss$v-graphs$g.log" | head -1
    done
    FITLLM_CUDA_STEP_SCALARS=$v timeout 60 "$F" finetune_full small --accelerator cuda --precision bf16-true \
        --data Synthetic --train.max_steps 8 --train.global_batch_size 8 --train.micro_batch_size 4 \
        --train.max_seq_length 256 --train.max_norm 1.0 --train.save_interval 100 --eval.interval 100 \
        --train.log_interval 1 --overwrite true --out_dir "$OUT/small-ss$v" >"$OUT/train-ss$v.log" 2>&1
    echo "finetune_full STEP_SCALARS=$v exit $?: $(grep -E 'iter 16 ' "$OUT/train-ss$v.log" | head -1)"
done
fi
if want_step 10; then
echo "== 10. fp16 loss scaling: the overflow check on the device (FITLLM_CUDA_STEP_SCALARS=1 against 0, 16-mixed)"
for v in 1 0; do
    for g in 0 1; do
        FITLLM_CUDA_STEP_SCALARS=$v FITLLM_CUDA_GRAPHS=$g timeout 60 "$F" bench-step small --accelerator cuda \
            --precision 16-mixed --micro-batch 8 --seq 256 --steps 10 --warmup 2 >"$OUT/small-fp16-ss$v-graphs$g.log" 2>&1
        echo "small 16-mixed STEP_SCALARS=$v GRAPHS=$g exit $?: $(grep -E '^median' "$OUT/small-fp16-ss$v-graphs$g.log")"
    done
    FITLLM_CUDA_STEP_SCALARS=$v timeout 60 "$F" finetune_full small --accelerator cuda --precision 16-mixed \
        --data Synthetic --train.max_steps 8 --train.global_batch_size 8 --train.micro_batch_size 4 \
        --train.max_seq_length 256 --train.max_norm 1.0 --train.save_interval 100 --eval.interval 100 \
        --train.log_interval 1 --overwrite true --out_dir "$OUT/small-fp16-ss$v" >"$OUT/train-fp16-ss$v.log" 2>&1
    echo "finetune_full 16-mixed STEP_SCALARS=$v exit $?: $(grep -E 'iter 16 ' "$OUT/train-fp16-ss$v.log" | head -1)"
    grep -E "update skipped" "$OUT/train-fp16-ss$v.log" | head -3
done
fi
if want_step 11; then
echo "== 11. the next micro-batch's inputs ahead on a second stream (FITLLM_CUDA_PREFETCH=1 against 0, EXPERIMENTAL)"
for v in 1 0; do
    FITLLM_CUDA_PREFETCH=$v bench full-pf$v 60
    FITLLM_CUDA_PREFETCH=$v FITLLM_CUDA_GRAPHS=1 timeout 60 "$F" bench-step small --accelerator cuda \
        --precision bf16-true --micro-batch 8 --seq 256 --steps 10 --warmup 2 >"$OUT/small-pf$v-graphs1.log" 2>&1
    echo "small bf16-true PREFETCH=$v GRAPHS=1 exit $?: $(grep -E '^median' "$OUT/small-pf$v-graphs1.log")"
    grep -E "FITLLM_CUDA_GRAPHS" "$OUT/small-pf$v-graphs1.log" | head -1
    FITLLM_CUDA_PREFETCH=$v timeout 60 "$F" finetune_full small --accelerator cuda --precision bf16-true \
        --data Synthetic --train.max_steps 6 --train.global_batch_size 16 --train.micro_batch_size 4 \
        --train.max_seq_length 256 --train.save_interval 100 --eval.interval 100 --train.log_interval 1 \
        --overwrite true --out_dir "$OUT/small-pf$v" >"$OUT/train-pf$v.log" 2>&1
    echo "finetune_full PREFETCH=$v exit $?: $(grep -E 'iter 24 ' "$OUT/train-pf$v.log" | head -1)"
done
fi
if want_step 12; then
echo "== 12. SGD and 8-bit AdamW on the step scalars (FITLLM_CUDA_STEP_SCALARS=1 against 0; SGD under graphs)"
for opt in SGD bnb.optim.AdamW8bit; do
    for v in 1 0; do
        for g in 0 1; do
            [ "$v" = 0 ] && [ "$g" = 1 ] && [ "$opt" != SGD ] && continue # (the host path's 8-bit: between the graphs)
            FITLLM_CUDA_STEP_SCALARS=$v FITLLM_CUDA_GRAPHS=$g timeout 60 "$F" finetune_full small --accelerator cuda \
                --precision bf16-true --optimizer "$opt" --optimizer.momentum 0.9 --data Synthetic --train.max_steps 8 \
                --train.global_batch_size 8 --train.micro_batch_size 4 --train.max_seq_length 256 --train.max_norm 1.0 \
                --train.save_interval 100 --eval.interval 100 --train.log_interval 1 --overwrite true \
                --out_dir "$OUT/opt-$opt-ss$v-g$g" >"$OUT/train-$opt-ss$v-g$g.log" 2>&1
            echo "finetune_full $opt STEP_SCALARS=$v GRAPHS=$g exit $?: $(grep -E 'iter 16 ' "$OUT/train-$opt-ss$v-g$g.log" | head -1)"
            grep -E "FITLLM_CUDA_GRAPHS" "$OUT/train-$opt-ss$v-g$g.log" | head -1
        done
    done
done
fi
if want_step 13; then
echo "== 13. QLoRA's 4-bit matmuls: FITLLM_CUDA_Q4=fp32 | tc | scratch (TinyLlama, nf4, LoRA r 8)"
for q in fp32 tc scratch; do
    FITLLM_CUDA_Q4=$q bench qlora-q4$q 90 --lora 8 --quantize bnb.nf4
done
fi
if want_step 14; then
echo "== 14. tensor parallelism's device ops: the vocabulary-parallel cross-entropy, the row-strided dropout (selftest)"
for op in vocab_xent dropout_rows; do
    timeout 60 "$F" selftest --accelerator cuda --only $op >"$OUT/tp-$op.log" 2>&1
    echo "selftest $op exit $?" >>"$OUT/tp-$op.log"
    grep -E "$op|cases ok|FAIL|exit" "$OUT/tp-$op.log"
done
fi
if want_step 15; then
echo "== 15. bf16 bias + GELU in the GEMM's epilogue: FITLLM_CUDA_GELU16=1 against 0 (GPT-2, EXPERIMENTAL)"
for p in bf16-true bf16-mixed; do
    for v in 1 0; do
        FITLLM_CUDA_GELU16=$v gpt2_ab $p gelu16$v FITLLM_CUDA_GELU16=$v
    done
done
for v in 1 0; do
    FITLLM_CUDA_GELU16=$v timeout 60 "$F" bench-step gpt2 --accelerator cuda --precision bf16-true --micro-batch 8 \
        --seq 1024 --steps 3 --warmup 2 --profile >"$OUT/gpt2-gelu16$v-profile.log" 2>&1
    echo "gpt2 bf16-true FITLLM_CUDA_GELU16=$v --profile exit $?"
    sed -n '/^profile/,/^PROFILE/p' "$OUT/gpt2-gelu16$v-profile.log" | grep -E "GEMM|elementwise|gelu|round16" | head -6
done
fi
if want_step 16; then
echo "== 16. bf16 storage without the unread fp32 views: FITLLM_CUDA_VIEWS32=1 (every view kept) against 0 (EXPERIMENTAL)"
ab_both FITLLM_CUDA_VIEWS32 views32
fi
if want_step 17; then
echo "== 17. the cross-block add + norm: FITLLM_CUDA_XBLOCK_NORM=1 (the default) against 0 (EXPERIMENTAL)"
ab_both FITLLM_CUDA_XBLOCK_NORM xblock
fi
if want_step 18; then
echo "== 18. bf16 weight gradients by their GEMMs: FITLLM_CUDA_DW16=1 (the default) against 0 (EXPERIMENTAL)"
ab_profile FITLLM_CUDA_DW16 dw16 "GEMM|accumulate16|zero"
fi
if want_step 19; then
echo "== 19. LoRA / QLoRA bf16 without conversions: FITLLM_CUDA_LORA16=1 (the default) against 0 (EXPERIMENTAL)"
for v in 1 0; do
    FITLLM_CUDA_LORA16=$v bench lora16-$v 60 --lora 8
    FITLLM_CUDA_LORA16=$v bench qlora16-$v 90 --lora 8 --quantize bnb.nf4
done
fi
if want_step 20; then
echo "== 20. QLoRA 4-bit bases over bf16 inputs: FITLLM_CUDA_Q4X16=1 (the default) against 0, Q4 tc / scratch (EXPERIMENTAL)"
for q in tc scratch; do
    for v in 1 0; do
        FITLLM_CUDA_Q4=$q FITLLM_CUDA_Q4X16=$v bench q4x16-$q-$v 90 --lora 8 --quantize bnb.nf4 --profile
        sed -n '/^profile/,/^PROFILE/p' "$OUT/q4x16-$q-$v.log" | grep -E "q4_matmul|convert" | head -6
    done
done
fi
if want_step 21; then
echo "== 21. the residual stream held in bf16: FITLLM_CUDA_STREAM16=1 (the default) against 0 (EXPERIMENTAL)"
ab_both FITLLM_CUDA_STREAM16 stream16
fi
if want_step 22; then
echo "== 22. the residual add inside its projection's GEMM: FITLLM_CUDA_RESGEMM=1 (the default) against 0 (EXPERIMENTAL)"
ab_profile FITLLM_CUDA_RESGEMM resgemm "gemm|norm"
fi
if want_step 23; then
echo "== 23. the split column sums and cross-entropy: the profile's rows and the kernel timings (no knob, EXPERIMENTAL)"
bench normce 60 --profile
sed -n '/^profile/,/^PROFILE/p' "$OUT/normce.log" | grep -E "^ *(norm|embedding\+loss|rmsnorm_backward|cross_entropy|layernorm_backward|bias_backward)" | head -8
if [ -x "$BIN/fitllm_cuda_check" ]; then
    timeout 150 "$BIN/fitllm_cuda_check" >"$OUT/cuda_check-normce.log" 2>&1
    grep -E "rmsnorm_backward_w16|cross_entropy_dbf16|FAILED|all ok" "$OUT/cuda_check-normce.log"
fi
fi
