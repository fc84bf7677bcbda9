#!/bin/sh
# Run one harness (built by fuzz/build.sh) for SECONDS with its seeds:
#   fuzz/run.sh NAME SECONDS [extra libFuzzer flags...]
# Working corpus: build-fuzz/corpus-<name>/ (kept between runs, so a rerun resumes);
# seeds: fuzz/seeds-*/ (fuzz/make_seeds.py) plus the matching files of $FITLLM_DATA
# (default ../shared/data; copied into the corpus, missing ones skipped). Crash,
# leak, timeout and OOM inputs go to build-fuzz/artifacts/<name>/; the log to
# build-fuzz/logs/<name>.log; its last line (cov, ft, corpus, execs) is printed.
# A harness not named in the table below (a new fuzz/fuzz_NAME.c) runs with max_len 8192
# ($FUZZ_MAX_LEN) and the seeds in fuzz/seeds-NAME/ (or fuzz/seeds-fuzz_NAME/, fuzz/seeds/NAME/).
# FUZZ_FRESH=1 (the smoke run of `make test`): the corpus is build-fuzz/smoke/corpus-<name>/,
# emptied first, so the run starts from the seeds only; its log is build-fuzz/smoke/<name>.log.
# FUZZ_REPLAY=DIR (`make test`'s quick tier): no libFuzzer and no mutation: DIR/NAME (the sanitizer build's replay
# binary, fuzz/replay_main.c; DIR = build-asan/fuzz-replay) runs once on every seed and the shared files above, each
# cut to max_len as libFuzzer cuts them; SECONDS is ignored; the log is DIR/logs/NAME.log.
# Exit status: non-zero when libFuzzer (or the replay) found something.
set -e
cd "$(dirname "$0")/.."
name=$1
secs=${2:-600}
[ -n "$name" ] && shift || { echo "usage: fuzz/run.sh NAME SECONDS [flags]"; exit 2; }
[ $# -gt 0 ] && shift
DATA=${FITLLM_DATA:-../shared/data}
OUT=${FUZZ_REPLAY:-build-fuzz}
short=${name#fuzz_}
corpus=$OUT/corpus-$short
mkdir -p "$OUT/artifacts/$name" "$OUT/logs"
[ -x "$OUT/$name" ] || { echo "fuzz/run.sh: $OUT/$name not built (${FUZZ_REPLAY:+make asan-build: }fuzz/build.sh)"; exit 2; }
SEP='
@@FILE@@
'
# copy a shared data file into the corpus if present
shared() { [ -f "$DATA/$1" ] && cp "$DATA/$1" "$corpus/shared-$(echo "$1" | tr / _)" || true; }
case $name in
fuzz_json_dataset_json)  maxlen=4096;  seeds=fuzz/seeds/json; corpus=$OUT/corpus-json ;;
fuzz_json_dataset_jsonl) maxlen=4096;  seeds=fuzz/seeds/jsonl; corpus=$OUT/corpus-jsonl ;;
fuzz_dataset_dir_json)   maxlen=8192;  seeds=fuzz/seeds-data-dir ;;
fuzz_dataset_dir_textfiles) maxlen=8192; seeds=fuzz/seeds-textfiles ;;
fuzz_tokenizer_json)     maxlen=32768; seeds=fuzz/seeds-tok; corpus=$OUT/corpus-tok ;;
fuzz_tokenizer_model)    maxlen=16384; seeds=fuzz/seeds-tok-model ;;
fuzz_tokenizer_llama2c)  maxlen=8192;  seeds=fuzz/seeds-tok-llama2c ;;
fuzz_tokenizer_dir)      maxlen=32768; seeds=fuzz/seeds-tok-dir ;;
fuzz_safetensors)        maxlen=4096;  seeds=fuzz/seeds-st ;;
fuzz_hf_config)          maxlen=4096;  seeds=fuzz/seeds-hf-config ;;
fuzz_hf_folder)          maxlen=16384; seeds=fuzz/seeds-hf-folder ;;
fuzz_llama2c)            maxlen=8192;  seeds=fuzz/seeds-llama2c ;;
fuzz_peft)               maxlen=8192;  seeds=fuzz/seeds-peft ;;
fuzz_recipe_yaml)        maxlen=4096;  seeds=fuzz/seeds-recipe ;;
fuzz_recipe_overrides)   maxlen=1024;  seeds=fuzz/seeds-overrides ;;
fuzz_image_png)          maxlen=16384; seeds=fuzz/seeds-image-png ;;
fuzz_image_jpeg)         maxlen=16384; seeds=fuzz/seeds-image-jpeg ;;
*)  maxlen=${FUZZ_MAX_LEN:-8192}; seeds=
    for d in fuzz/seeds-$short fuzz/seeds-$name fuzz/seeds/$short; do [ -d "$d" ] && { seeds=$d; break; }; done
    [ -n "$seeds" ] || { seeds=$OUT/no-seeds; mkdir -p "$seeds"; echo "fuzz/run.sh: note: no fuzz/seeds-$short/ for $name" >&2; } ;;
esac
# fuzz/corpus/<short>/: the regression corpus (inputs libFuzzer found, merged to the coverage-distinct ones with
# -merge=1; docs/FUZZING.md): read with the seeds by the campaigns and by the replay
regress=
[ -d "fuzz/corpus/$short" ] && regress=fuzz/corpus/$short
log=$OUT/logs/$name.log
if [ -n "${FUZZ_REPLAY:-}" ]; then
    corpus=$OUT/replay-corpus/$short
    rm -rf "$corpus"
elif [ "${FUZZ_FRESH:-0}" = 1 ]; then
    corpus=$OUT/smoke/corpus-$short
    log=$OUT/smoke/$name.log
    rm -rf "$corpus"
fi
mkdir -p "$corpus"
case $name in
fuzz_json_dataset_json)  shared instruct/alpaca-tiny.json ;;
fuzz_dataset_dir_textfiles)
    [ -f "$DATA/text/tinystories-val-prefix.txt" ] &&
        { head -c 3000 "$DATA/text/tinystories-val-prefix.txt"; printf '%s' "$SEP"; head -c 1000 "$DATA/text/tinyshakespeare.txt"; } \
        > "$corpus/shared-text" || true ;;
fuzz_tokenizer_json)     shared stories260K-hf/tokenizer.json ;;
fuzz_tokenizer_llama2c)  shared stories260K/tok512.bin ;;
fuzz_tokenizer_dir)
    d=$DATA/stories260K-hf
    [ -f "$d/tokenizer.json" ] &&
        { cat "$d/tokenizer.json"; printf '%s' "$SEP"; cat "$d/config.json"; printf '%s%s' "$SEP" "$SEP"; cat "$d/tokenizer_config.json"; } \
        > "$corpus/shared-stories260K-hf" || true ;;
fuzz_safetensors)        shared stories260K-hf/model.safetensors ;;  # longer than max_len: its header is what counts
fuzz_hf_config)          shared stories260K-hf/config.json; shared tiny-gpt2-hf/config.json ;;
fuzz_llama2c)            shared stories260K/stories260K.bin ;;       # likewise: the header
fuzz_recipe_yaml)        for f in recipes/*.yaml recipes/cpu/*.yaml; do cp "$f" "$corpus/recipe-$(basename "$f")"; done ;;
esac
export OMP_NUM_THREADS=1
rc=0
if [ -n "${FUZZ_REPLAY:-}" ]; then
    ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} timeout 300 "$OUT/$name" -max_len=$maxlen "$corpus" "$seeds" $regress > "$log" 2>&1 || rc=$?
    echo "$name: rc=$rc $(grep -E '^replay: [0-9]+ inputs' "$log" || echo 'replay: did not finish')"
    [ $rc -eq 0 ] || { grep -E 'ERROR|SUMMARY|check failed' "$log" | head -5; grep -E '^replay: ' "$log" | tail -1; echo "  log: $log"; }
    exit $rc
fi
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} "$OUT/$name" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=$maxlen \
    -timeout=30 -print_final_stats=1 -artifact_prefix="$OUT/artifacts/$name/" "$@" "$corpus" "$seeds" $regress > "$log" 2>&1 || rc=$?
last=$(grep -E '^#[0-9]+' "$log" | tail -1)
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
echo "$name: rc=$rc ${secs}s execs=$execs | $last"
[ $rc -eq 0 ] || { grep -E 'ERROR|SUMMARY|Test unit written' "$log" | head -5; echo "  log: $log"; }
exit $rc
