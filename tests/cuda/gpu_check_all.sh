#!/usr/bin/env bash
# Every single-GPU check of the CUDA backend in one run (EXPERIMENTAL backend; for a machine with an
# NVIDIA GPU and a CUDA build of fitllm: build/fitllm with the CUDA plugin build/libfitllm_cuda.so
# beside it, e.g. configured elsewhere with cmake -DFL_CUDA=ON -DFL_CUDA_ARCHS=90 and the build folder
# carried here; the plugin needs the CUDA toolkit's libcublasLt and libnccl on the loader's path):
#   tests/cuda/gpu_check_all.sh [build-dir] [--bench]
#   1. fitllm_cuda_check: the real kernels against the emulated ones (tensor-core attention included);
#   2. fitllm selftest --accelerator cuda: every op against the CPU backend;
#   3. short trainings on built-in presets (no data files needed: Synthetic data), cuda against cpu: the
#      largest relative step-loss difference per run, within a bound per precision (fp32 1e-5: two fp32
#      evaluations of the same sums; bf16 2e-2: bf16's 2^-8 rounding of activations and weights);
#   4. fitllm lab --accelerator cuda (the quick suite, every row, planned = measured);
#   5. with --bench: bench-step at TinyLlama-1.1B's shapes (bf16-true, LoRA), and the same step in PyTorch
#      when python3 has torch and transformers (bench/bench_step_torch.py --device cuda).
# Exit 1 when a check fails. The session that ran it on an H100: docs/BENCHMARKS.md "GPU".
set -u
BUILD=${1:-build}
BENCH=0
[ "${2:-}" = "--bench" ] && BENCH=1
F=$BUILD/fitllm
T=$(mktemp -d /tmp/fitllm-gpu-XXXXXX)
# the logs come back with the device tool's $OUT (a failure on a lent GPU must be readable afterwards: its time is short)
keep_logs() { if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/gpu_check_logs" && cp "$T"/*.log "$OUT/gpu_check_logs/" 2>/dev/null; fi; rm -rf "$T"; }
trap keep_logs EXIT
fail=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || { echo "skip: no nvidia-smi"; exit 0; }
"$F" --version | grep -i cuda
if ! "$F" --version | grep -q "cuda: *compiled in"; then echo "skip: $F was built without CUDA"; exit 0; fi
# the plugin must be beside the binary (or named by FITLLM_CUDA_LIB) and load: else every check below fails the same way
if ! "$F" --version | grep -qE "cuda: .* [0-9]+ devices?: [0-9]"; then
    echo "FAIL: $F cannot use the GPU (the line above says why: plugin missing, driver, libraries)"; exit 1
fi

echo "== 1. fitllm_cuda_check"
if [ -x "$BUILD/fitllm_cuda_check" ]; then
    "$BUILD/fitllm_cuda_check" >"$T/check.log" 2>&1 || fail=1
    grep -E "FAIL" "$T/check.log" | head -20
    tail -1 "$T/check.log"
else
    echo "  (not built)"
fi

echo "== 2. fitllm selftest --accelerator cuda"
"$F" selftest --accelerator cuda >"$T/selftest.log" 2>&1 || fail=1
grep -i fail "$T/selftest.log" | head; tail -1 "$T/selftest.log"

echo "== 3. trainings, cuda vs cpu (8 steps, Synthetic data)"
common="--data Synthetic --train.max_steps 8 --train.global_batch_size 8 --train.micro_batch_size 4 \
--train.max_seq_length 128 --train.save_interval 100 --eval.interval 100 --train.log_interval 1 --seed 3 --overwrite true"
train() { # name bound args...
    local k=$1 bound=$2; shift 2
    for acc in cpu cuda; do
        # shellcheck disable=SC2086
        if ! "$F" "$@" $common --accelerator $acc --out_dir "$T/$k-$acc" >"$T/$k-$acc.log" 2>&1; then
            echo "FAIL $k on $acc: $(grep -i error "$T/$k-$acc.log" | head -1)"; fail=1; return
        fi
    done
    local d acc
    for acc in cpu cuda; do # no step losses is no comparison (not a pass)
        if [ "$(tail -n +2 "$T/$k-$acc/logs/metrics.csv" 2>/dev/null | wc -l)" -lt 8 ]; then
            echo "FAIL $k: $acc wrote no 8 steps' losses"; fail=1; return
        fi
    done
    d=$(paste -d' ' <(cut -d, -f4 "$T/$k-cpu/logs/metrics.csv" | tail -n +2) \
                    <(cut -d, -f4 "$T/$k-cuda/logs/metrics.csv" | tail -n +2) |
        awk 'NF == 2 && $1 != 0 {if ($2 !~ /^-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?$/) {bad=1; next}
                                  r=($1-$2)/$1; if(r<0)r=-r; if(r>m)m=r}
             END{if (bad) printf "nan"; else printf "%.2e", m}')
    if awk -v d="$d" -v b="$bound" 'BEGIN{exit !(d <= b)}'; then echo "ok   $k: max relative loss difference $d (bound $bound)"
    else echo "FAIL $k: max relative loss difference $d (bound $bound)"; fail=1; fi
}
train micro-fp32 1e-5 finetune_full micro --precision 32-true
train micro-bf16 2e-2 finetune_full micro --precision bf16-true
train micro-8bit 1e-5 finetune_full micro --precision 32-true --optimizer bnb.optim.AdamW8bit
# QLoRA with FITLLM_CUDA_Q4 at its default (empty: a value exported in the caller's shell does not leak in): 32-true
# takes the fp32 4-bit kernels, bf16-true scratch (the NF4 weight dequantized into a bf16 panel, then cuBLASLt)
FITLLM_CUDA_Q4= train micro-qlora 1e-5 finetune_lora micro --quantize bnb.nf4-dq
FITLLM_CUDA_Q4= train micro-qlora-bf16 2e-2 finetune_lora micro --quantize bnb.nf4 --precision bf16-true
# each bf16 4-bit path named (tc EXPERIMENTAL: x and the dequantized NF4 weight in bf16 on the tensor cores; fp32: the
# fp32 kernels, the default before 2026-11-30 evening)
FITLLM_CUDA_Q4=tc train micro-qlora-bf16-tc 2e-2 finetune_lora micro --quantize bnb.nf4 --precision bf16-true
FITLLM_CUDA_Q4=scratch train micro-qlora-bf16-scratch 2e-2 finetune_lora micro --quantize bnb.nf4 --precision bf16-true
FITLLM_CUDA_Q4=fp32 train micro-qlora-bf16-fp32 2e-2 finetune_lora micro --quantize bnb.nf4 --precision bf16-true
# CPU offload: on the GPU the update is staged through the page-locked host tier and runs on the host's cores
train micro-offload 1e-5 finetune_full micro --precision 32-true --strategy deepspeed_stage_2_offload
train micro-offload-nvme 1e-5 finetune_full micro --precision 32-true --strategy deepspeed_stage_2_offload \
    --offload_optimizer_device nvme --nvme_path "$T"
train gpt2-fp32 1e-5 finetune_full gpt2-micro --precision 32-true
train opt-fp32 1e-5 finetune_full opt-micro --precision 32-true
train small-bf16 2e-2 finetune_full small --precision bf16-true

echo "== 4. fitllm lab --accelerator cuda"
"$F" lab --suite quick --accelerator cuda --out_dir "$T/lab" >"$T/lab.log" 2>&1 || fail=1
grep -E "^  [a-z]" "$T/lab.log"

if [ $BENCH = 1 ]; then
    echo "== 5. TinyLlama-1.1B step (B 4, T 2048): fitllm, then PyTorch"
    for extra in "" "--lora 8"; do
        # shellcheck disable=SC2086
        "$F" bench-step tinyllama-1.1b --accelerator cuda --precision bf16-true $extra --micro-batch 4 --seq 2048 \
            --steps 5 --warmup 2 2>&1 | grep RESULT
        if python3 -c "import torch, transformers" 2>/dev/null; then
            # shellcheck disable=SC2086
            python3 "$(dirname "$0")/../../bench/bench_step_torch.py" --device cuda --shape tinyllama-1.1b \
                --precision bf16-true $extra --batch 4 --seq 2048 --steps 5 --warmup 2 2>&1 | grep RESULT
        fi
    done
fi
[ $fail = 0 ] && echo "gpu_check_all: every check passed" || echo "gpu_check_all: FAILED (logs: ${OUT:+$OUT/gpu_check_logs, }$T while it ran)"
exit $fail
