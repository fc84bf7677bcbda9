#!/bin/sh
# Build the libFuzzer harnesses (not part of the default build):
#   fuzz/build.sh            -> build-fuzz/fuzz_tokenizer_json
# Needs clang with libFuzzer (Debian: apt-get install clang libclang-rt-14-dev libpcre2-dev).
# Run:  build-fuzz/fuzz_tokenizer_json -max_total_time=600 -rss_limit_mb=2048 build-fuzz/corpus-tok fuzz/seeds-tok
set -e
cd "$(dirname "$0")/.."
CC=${CC:-clang}
OUT=build-fuzz
mkdir -p "$OUT" "$OUT/corpus-tok"
SRCS="src/core/status.c src/io/json.c $(ls src/tokenizer/*.c)"
$CC -std=gnu11 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Iinclude -Isrc fuzz/fuzz_tokenizer_json.c $SRCS -lpcre2-8 -lm -o "$OUT/fuzz_tokenizer_json"
echo "built $OUT/fuzz_tokenizer_json"
