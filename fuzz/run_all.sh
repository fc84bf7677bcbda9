#!/bin/sh
# Run every harness (or those named) for SECONDS each, JOBS at a time, at nice 19:
#   fuzz/run_all.sh SECONDS JOBS [NAME...]
# Prints one summary line per harness (fuzz/run.sh) and fails if any harness found something.
cd "$(dirname "$0")/.."
secs=${1:-600}
jobs=${2:-2}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] && shift
ALL="fuzz_safetensors fuzz_hf_config fuzz_hf_folder fuzz_llama2c fuzz_peft fuzz_recipe_yaml fuzz_recipe_overrides
     fuzz_tokenizer_json fuzz_tokenizer_model fuzz_tokenizer_llama2c fuzz_tokenizer_dir
     fuzz_json_dataset_json fuzz_json_dataset_jsonl fuzz_dataset_dir_json fuzz_dataset_dir_textfiles"
names=${*:-$ALL}
mkdir -p build-fuzz/logs
: > build-fuzz/logs/summary.txt
echo $names | tr ' ' '\n' | grep . |
    xargs -P "$jobs" -I{} sh -c "nice -n 19 fuzz/run.sh {} $secs >> build-fuzz/logs/summary.txt 2>&1"
cat build-fuzz/logs/summary.txt
! grep -q 'rc=[1-9]' build-fuzz/logs/summary.txt
