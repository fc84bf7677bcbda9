#!/usr/bin/env bash
# The one command for a lent GPU machine (its time is short: run this, nothing else). Prepared here with
# tools/gpu_pack.sh; on the device, from the repository root, with .gpupack carried:
#   tests/cuda/device_session.sh [--quick]
# Writes every log to $OUT (the device tool brings that folder back): env.txt, gpu_check.log (tests/cuda/
# gpu_check_all.sh with --bench: the kernel checks, selftest, cuda-vs-cpu trainings, the lab, and the TinyLlama
# step beside PyTorch eager), and profile.log (bench-step --profile when this build has it).
# --quick: the checks without the benchmarks. Each step has its own timeout so one hang cannot eat the lease.
set -u
OUT=${OUT:-/tmp/fitllm-device-out}
mkdir -p "$OUT"
PACK=.gpupack
[ -x "$PACK/bin/fitllm" ] || { echo "device_session: $PACK/bin/fitllm missing: run tools/gpu_pack.sh here first"; exit 1; }
. "$(dirname "$0")/gpupack_env.sh"
gpupack_env "$PACK" "$PACK/bin/fitllm"
LIB=$GPUPACK_LIBS
{
    date -u; nvidia-smi; lscpu | grep -m1 'Model name'; echo "libraries taken from the pack: $(ls "$LIB" | tr '\n' ' ')"
    ldd "$PACK/bin/fitllm" | grep 'not found' || echo "ldd: nothing missing"
    "$PACK/bin/fitllm" --version
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
bench=--bench
[ "${1:-}" = "--quick" ] && bench=
# shellcheck disable=SC2086
timeout 420 tests/cuda/gpu_check_all.sh "$PACK/bin" $bench >"$OUT/gpu_check.log" 2>&1
echo "gpu_check_all exit $? after ${SECONDS} s of the session" >>"$OUT/gpu_check.log"
tail -40 "$OUT/gpu_check.log"
if [ -n "$bench" ] && "$PACK/bin/fitllm" bench-step --help 2>&1 | grep -q -- '--profile'; then
    timeout 120 "$PACK/bin/fitllm" bench-step tinyllama-1.1b --accelerator cuda --precision bf16-true --micro-batch 4 \
        --seq 2048 --steps 5 --warmup 2 --profile >"$OUT/profile.log" 2>&1
    tail -30 "$OUT/profile.log"
fi
echo "device_session: done after ${SECONDS} s" | tee -a "$OUT/env.txt"
