#!/bin/sh
# Build the libFuzzer harnesses (not part of the default build) into build-fuzz/:
# the library (src/ without the CLI; naive GEMM, no BLAS) is compiled once with
# ASan+UBSan and fuzzer coverage into build-fuzz/libfitllm_fuzz.a, then one binary
# per harness (a harness built twice with a -D switch gives two binaries):
#   fuzz_json_dataset_json / _jsonl      .json / .jsonl instruction datasets (records, SFT, loader)
#   fuzz_dataset_dir_json / _textfiles   fl_data_load on a folder: train.json/val.json, TextFiles .txt
#   fuzz_tokenizer_json                  tokenizer.json
#   fuzz_tokenizer_model                 SentencePiece tokenizer.model (protobuf)
#   fuzz_tokenizer_llama2c               llama2.c tokenizer .bin (tok512.bin)
#   fuzz_tokenizer_dir                   tokenizer folder side files (tokenizer_config.json, ...)
#   fuzz_safetensors                     safetensors files (header + data section)
#   fuzz_hf_config                       HF config.json (then the parameter layout)
#   fuzz_hf_folder                       HF model folder: config.json + model.safetensors
#   fuzz_llama2c                         llama2.c .bin checkpoints
#   fuzz_peft                            PEFT adapter folder (adapter_config.json + adapter_model.safetensors)
#   fuzz_recipe_yaml                     YAML recipes (fl_cfg_apply_yaml, then validate, write back)
#   fuzz_recipe_overrides                dotted command-line overrides (fl_cfg_set)
# Run them all: `make fuzz` (FUZZ_TIME seconds each, default 600) or `make fuzz-smoke`;
# fuzz/run.sh NAME SECONDS runs one. Needs clang 14 with libFuzzer and libomp
# (Debian: apt-get install clang libclang-rt-14-dev libomp-14-dev libpcre2-dev libyaml-dev).
set -e
cd "$(dirname "$0")/.."
CC=${CC:-clang}
OUT=build-fuzz
JOBS=${JOBS:-2}
mkdir -p "$OUT/obj"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
BASE="-std=gnu11 -O1 -g -fopenmp -Iinclude -Isrc $SAN"
LIBS="-lpcre2-8 -lyaml -lm"

# ---- the library (rebuilt when a source or any header is newer than its object) ----
newest_h=$(ls -t include/fitllm/*.h src/*/*.h src/backend/cpu/*.h src/backend/cuda/*.h 2>/dev/null | head -1)
export CC BASE OUT newest_h
# (not the CLI; not the MPI communicator, which needs mpicc's flags; the CUDA host code without CUDA)
ls src/*/*.c src/backend/cpu/*.c src/backend/cuda/*.c | grep -v -e '^src/cli/' -e '^src/comm/comm_mpi\.c$' | xargs -P "$JOBS" -I{} sh -c '
  o="$OUT/obj/$(echo {} | tr / _ ).o"
  if [ ! -f "$o" ] || [ {} -nt "$o" ] || [ "$newest_h" -nt "$o" ]; then
    $CC $BASE -fsanitize=fuzzer-no-link -c {} -o "$o" || exit 255
  fi'
rm -f "$OUT/libfitllm_fuzz.a"
ar rcs "$OUT/libfitllm_fuzz.a" "$OUT"/obj/*.o

# ---- harnesses: name source [defines] ----
harness() {
    name=$1; src=$2; shift 2
    $CC $BASE -fsanitize=fuzzer "$@" "$src" "$OUT/libfitllm_fuzz.a" $LIBS -o "$OUT/$name"
    echo "built $OUT/$name"
}
harness fuzz_json_dataset_json  fuzz/fuzz_json_dataset.c
harness fuzz_json_dataset_jsonl fuzz/fuzz_json_dataset.c -DFL_FUZZ_JSONL
harness fuzz_dataset_dir_json   fuzz/fuzz_dataset_dir.c
harness fuzz_dataset_dir_textfiles fuzz/fuzz_dataset_dir.c -DFL_FUZZ_TEXTFILES
harness fuzz_tokenizer_json     fuzz/fuzz_tokenizer_json.c
harness fuzz_tokenizer_model    fuzz/fuzz_tokenizer_file.c -DFL_FUZZ_SPM
harness fuzz_tokenizer_llama2c  fuzz/fuzz_tokenizer_file.c -DFL_FUZZ_LLAMA2C
harness fuzz_tokenizer_dir      fuzz/fuzz_tokenizer_file.c -DFL_FUZZ_DIR
harness fuzz_safetensors        fuzz/fuzz_safetensors.c
harness fuzz_hf_config          fuzz/fuzz_hf.c
harness fuzz_hf_folder          fuzz/fuzz_hf.c -DFL_FUZZ_FOLDER
harness fuzz_llama2c            fuzz/fuzz_llama2c.c
harness fuzz_peft               fuzz/fuzz_peft.c
harness fuzz_recipe_yaml        fuzz/fuzz_recipe.c
harness fuzz_recipe_overrides   fuzz/fuzz_recipe.c -DFL_FUZZ_OVERRIDES
