#!/usr/bin/env bash
# The CUDA kernels' registers, stack frames and spills as ptxas reports them (-Xptxas -v), one line a kernel, the most
# registers first: the audit behind docs/ARCHITECTURE.md "Registers against block sizes". A block of T threads needs
# T x registers (rounded up to 8 a thread) <= 65,536 at launch, which the emulator cannot see; every kernel launched
# with more than 256 threads is declared __launch_bounds__ (FL_CU_BOUNDS, cu_compat.h), so ptxas holds it to that.
# Usage: tools/cuda_regs.sh [ARCH (default 90)] [OUT (default build-regs)]; needs nvcc (minutes: the attention kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${1:-90}
OUT=${2:-build-regs}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "tools/cuda_regs.sh: no nvcc (set NVCC=...)" >&2; exit 2; }
mkdir -p "$OUT"
for f in src/backend/cuda/kernels/*.cu; do
    b=$(basename "$f" .cu)
    "$NVCC" -O3 -DNDEBUG -DFL_HAVE_CUDA=1 -Iinclude -Isrc -std=c++17 -arch=sm_$ARCH -Xptxas -v -c "$f" \
        -o "$OUT/$b.o" >"$OUT/$b.log" 2>&1 || { echo "tools/cuda_regs.sh: $f did not compile (see $OUT/$b.log)" >&2; exit 1; }
done
# ptxas: "Compiling entry function 'NAME'", then "N bytes stack frame, S bytes spill stores, ..." and "Used R registers"
for l in "$OUT"/*.log; do
    awk -v F="$(basename "$l" .log).cu" '
        /Compiling entry function/ { n = $0; sub(/^[^'\'']*'\''/, "", n); sub(/'\''.*$/, "", n) }
        /bytes stack frame/ { st = $1; sp = $5 }
        /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") r = $(i + 1);
                                  if (n != "") printf "%4d regs %5d B stack %5d B spilled  %-14s %s\n", r, st, sp, F, n; n = "" }' "$l"
done | c++filt | sort -rn
