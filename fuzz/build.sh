#!/bin/sh
# Build the libFuzzer harnesses (not part of the default build):
#   fuzz/build.sh  -> build-fuzz/fuzz_tokenizer_json
#                     build-fuzz/fuzz_json_dataset_json, build-fuzz/fuzz_json_dataset_jsonl
# Needs clang with libFuzzer (Debian: apt-get install clang libclang-rt-14-dev libpcre2-dev).
# Run:  build-fuzz/fuzz_tokenizer_json -max_total_time=600 -rss_limit_mb=2048 build-fuzz/corpus-tok fuzz/seeds-tok
#       build-fuzz/fuzz_json_dataset_json -max_total_time=600 -max_len=4096 build-fuzz/corpus-json fuzz/seeds/json
#       build-fuzz/fuzz_json_dataset_jsonl -max_total_time=600 -max_len=4096 build-fuzz/corpus-jsonl fuzz/seeds/jsonl
set -e
cd "$(dirname "$0")/.."
CC=${CC:-clang}
OUT=build-fuzz
mkdir -p "$OUT" "$OUT/corpus-tok" "$OUT/corpus-json" "$OUT/corpus-jsonl"
CFLAGS="-std=gnu11 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude -Isrc"
TOK="src/core/status.c src/io/json.c $(ls src/tokenizer/*.c)"
$CC $CFLAGS fuzz/fuzz_tokenizer_json.c $TOK -lpcre2-8 -lm -o "$OUT/fuzz_tokenizer_json"
echo "built $OUT/fuzz_tokenizer_json"
# datasets: the readers, SFT tokenization (built-in byte tokenizer), random_split, loader
DATA="$TOK src/io/fs.c $(ls src/data/*.c)"
$CC $CFLAGS fuzz/fuzz_json_dataset.c $DATA -lpcre2-8 -lm -o "$OUT/fuzz_json_dataset_json"
$CC $CFLAGS -DFL_FUZZ_JSONL fuzz/fuzz_json_dataset.c $DATA -lpcre2-8 -lm -o "$OUT/fuzz_json_dataset_jsonl"
echo "built $OUT/fuzz_json_dataset_json $OUT/fuzz_json_dataset_jsonl"
