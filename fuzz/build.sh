#!/bin/sh
# Build the libFuzzer harnesses (not part of the default build):
#   fuzz/build.sh            -> build-fuzz/fuzz_json_dataset_json, build-fuzz/fuzz_json_dataset_jsonl
# Run, e.g.:
#   mkdir -p fuzz/corpus-json && build-fuzz/fuzz_json_dataset_json -max_total_time=600 fuzz/corpus-json fuzz/seeds/json
# Needs clang with the fuzzer runtime (apt-get install -y clang libclang-rt-14-dev).
set -e
cd "$(dirname "$0")/.."
CC=${CC:-clang}
OUT=build-fuzz
mkdir -p "$OUT"
CFLAGS="-g -O1 -std=gnu11 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude -Isrc"
# the library pieces a dataset reader needs: status, JSON, fs helpers, tokenizers, data
LIB="src/core/status.c src/io/json.c src/io/fs.c $(ls src/data/*.c) $(ls src/tokenizer/*.c src/tok/*.c 2>/dev/null || true)"
LIBS="-lm"
ls src/tokenizer/*.c >/dev/null 2>&1 && LIBS="$LIBS -lpcre2-8"   # GPT-2 pre-tokenizer regex
$CC $CFLAGS fuzz/fuzz_json_dataset.c $LIB -o "$OUT/fuzz_json_dataset_json" $LIBS
$CC $CFLAGS -DFL_FUZZ_JSONL fuzz/fuzz_json_dataset.c $LIB -o "$OUT/fuzz_json_dataset_jsonl" $LIBS
echo "built $OUT/fuzz_json_dataset_json $OUT/fuzz_json_dataset_jsonl"
