#!/bin/sh
# Build the libFuzzer harnesses (not part of the default build) into build-fuzz/ with clang:
# a CMake build of this repository configured with FL_FUZZ=ON (fuzz/harnesses.cmake), ASan+UBSan
# (FL_SANITIZE) and libFuzzer coverage (-fsanitize=fuzzer-no-link) on every object, naive GEMM,
# no MPI, no CUDA. The harnesses link the same `fitllm` library target as the CLI and the tests,
# so new sources under src/ and the libraries the library links are picked up without edits
# here; every fuzz/fuzz_*.c is a harness (one binary, or one per "// fuzz-build: NAME DEFINE"
# line in it). build-fuzz/harnesses.txt lists the binaries.
# Run them: `make fuzz` (FUZZ_TIME seconds each, default 600), `make fuzz-smoke`, fuzz/run.sh NAME
# SECONDS for one. Needs clang with libFuzzer and libomp (Debian: apt-get install clang
# libclang-rt-dev libomp-dev; `make test` installs them when run as root).
# Environment: CC/CXX (default clang/clang++), JOBS (default: the number of cores), FUZZ_OPT (the optimization
# and debug flags, default "-O1 -g": what a long campaign wants; `make test`'s smoke run builds with
# "-O0 -gline-tables-only", a quarter of the compile time (clang with ASan + coverage: exec.c, run_config.c,
# plan.c, safetensors.c 9.4 CPU s at -O1 -g, 2.2 at -O0 -gline-tables-only) for 3 s per harness from the seeds,
# where the seeds' replay is what counts; changing FUZZ_OPT rebuilds build-fuzz/).
set -e
cd "$(dirname "$0")/.."
CC=${CC:-clang}
CXX=${CXX:-clang++}
OUT=build-fuzz
FUZZ_OPT=${FUZZ_OPT:--O1 -g}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
PKGS="clang libclang-rt-dev libomp-dev"
command -v "$CC" >/dev/null 2>&1 || { echo "fuzz/build.sh: $CC not found (apt-get install $PKGS)" >&2; exit 1; }
mkdir -p "$OUT"
rm -rf "$OUT/obj" "$OUT/libfitllm_fuzz.a"   # left by the script's earlier, hand-listed build
# libFuzzer is a separate package from clang on Debian: say which one is missing
probe=$(mktemp -d)
printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }\n' > "$probe/p.c"
if ! "$CC" -fsanitize=fuzzer,address,undefined "$probe/p.c" -o "$probe/p" > "$probe/log" 2>&1; then
    echo "fuzz/build.sh: $CC cannot link a libFuzzer program (apt-get install $PKGS):" >&2
    head -5 "$probe/log" >&2; rm -rf "$probe"; exit 1
fi
rm -rf "$probe"
# -Wno-pass-failed: clang at -O1 reports every `#pragma omp simd` loop it leaves scalar (noise here)
if ! cmake -S . -B "$OUT" -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_C_FLAGS_RELWITHDEBINFO="$FUZZ_OPT" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$FUZZ_OPT" \
        -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link -Wno-pass-failed" -DFL_FUZZ=ON -DFL_SANITIZE=ON \
        -DFL_GEMM=naive -DFL_NATIVE=OFF -DFL_CUDA=OFF -DFL_MPI=OFF > "$OUT/configure.log" 2>&1; then
    cat "$OUT/configure.log" >&2; echo "fuzz/build.sh: configuring $OUT failed (above)" >&2; exit 1
fi
cmake --build "$OUT" -j "$JOBS" --target fuzz_all
echo "fuzz/build.sh: built $(wc -l < "$OUT/harnesses.txt") harnesses in $OUT/: $(tr '\n' ' ' < "$OUT/harnesses.txt")"
