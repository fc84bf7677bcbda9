#!/bin/sh
# The attention GPU check (tests/cuda/check_attn.c) as a program of its own, built without
# libfitllm: nvcc for the real kernels, g++ for the emulated ones, on a machine with a GPU and
# nvcc but not the CPU build's libraries. Usage: tests/cuda/check_attn.sh [outdir] (FL_CUDA_ARCH=90).
set -e
cd "$(dirname "$0")/../.."
O=${1:-/tmp/fl_check_attn}
NVCC=${NVCC:-nvcc}
ARCH=${FL_CUDA_ARCH:-90}
CUDA_INC=$(dirname "$(command -v "$NVCC")")/../include
mkdir -p "$O"
for f in attention attention_bwd attention_tc; do
    "$NVCC" -O3 -arch=sm_$ARCH --Werror=all-warnings -Xptxas=--warn-on-spills -Iinclude -Isrc \
        -c src/backend/cuda/kernels/$f.cu -o "$O/$f.gpu.o"
    g++ -O2 -fno-exceptions -fno-rtti -ffp-contract=off -fno-math-errno -Iinclude -Isrc -x c++ \
        -c src/backend/cuda/kernels/$f.cu -o "$O/$f.emu.o"
done
gcc -O2 -Iinclude -Isrc -c src/backend/cuda/emu/cu_emu.c -o "$O/cu_emu.o"
gcc -O2 -DFL_CHECK_ATTN_MAIN -Iinclude -Isrc -I"$CUDA_INC" -c tests/cuda/check_attn.c -o "$O/check_attn.o"
"$NVCC" -arch=sm_$ARCH -o "$O/check_attn" "$O"/*.o -lm
"$O/check_attn"
