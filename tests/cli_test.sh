#!/usr/bin/env bash
# CLI-level checks: exit codes and messages for good and bad input, and that
# failures leave no partial output. Run by `make test` after the unit suite.
# Usage: tests/cli_test.sh [path/to/fitllm]
set -u
FITLLM=${1:-./build/fitllm}
DATA=${FITLLM_DATA:-../shared/data}
T=$(mktemp -d "${TMPDIR:-/tmp}"/fitllm-cli-XXXXXX)
pass=0; fail=0; skip=0
source "$(dirname "$0")/suite_lib.sh"   # per-case wall times ("ok NAME ... T ms"), the tier (full_tier, tier_skip)
trap 'rm -rf "$T"; fl_case_laps_end' EXIT

# expect NAME WANT_RC PATTERN -- cmd...  (the output and exit status stay in EXPECT_OUT / EXPECT_RC)
expect() {
    local name=$1 want=$2 pat=$3; shift 4
    EXPECT_OUT=$("$@" 2>&1); EXPECT_RC=$?
    expect_saved "$name" "$want" "$pat" "$EXPECT_OUT" "$EXPECT_RC"
}
# expect_saved NAME WANT_RC PATTERN OUT RC: expect's checks on the output of a command an earlier case ran (the same
# command, deterministic: run once)
expect_saved() {
    local name=$1 want=$2 pat=$3 out=$4 rc=$5
    if [ "$rc" -ne "$want" ]; then
        echo "FAIL $name: exit $rc, want $want"; echo "$out" | tail -5 | sed 's/^/     /'; fail=$((fail+1)); return
    fi
    if [ -n "$pat" ] && ! grep -qE -- "$pat" <<<"$out"; then
        echo "FAIL $name: output lacks /$pat/"; echo "$out" | tail -5 | sed 's/^/     /'; fail=$((fail+1)); return
    fi
    echo "ok   $name"; pass=$((pass+1))
}

expect help 0 "commands:" -- "$FITLLM" --help
expect help_lists_version 0 "--version" -- "$FITLLM" --help
expect version_gemm_library 0 "GEMM library (onednn|openblas|naive)" -- "$FITLLM" --version
expect version_backends 0 "backends: cpu, ref" -- "$FITLLM" --version
expect version_bf16_path 0 "bf16 gemm (onednn-matmul-bf16|(avx512-|avx2-)?widen\+sgemm|tiled)" -- "$FITLLM" --version
expect version_cpu_cap 0 "in use: generic\)" -- env FITLLM_CPU=generic "$FITLLM" --version
# the default thread count's source: OMP_NUM_THREADS's value when set (it was called "default"), else the CPUs
expect version_threads_omp_set 0 "^threads:  3 \(OMP_NUM_THREADS=3; " -- env OMP_NUM_THREADS=3 "$FITLLM" --version
expect version_threads_omp_unset 0 "^threads:  [0-9]+ \(OMP_NUM_THREADS unset: the $(nproc) CPUs this process may run on" -- env -u OMP_NUM_THREADS "$FITLLM" --version
expect version_cpu_cap_kernels 0 "adam8bit quantizer scalar-table, 16-bit conversions scalar, attention tiles portable" -- env FITLLM_CPU=generic "$FITLLM" --version
expect version_comm 0 "comm: +(MPI \(.+\)|single process only \(built without MPI\)); launched by none: single process" -- \
    env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u PMI_RANK -u SLURM_PROCID -u RANK "$FITLLM" --version
expect version_comm_launcher 0 "launched by Slurm \(srun\): rank 2 of 4, local rank 0" -- \
    env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u PMI_RANK SLURM_PROCID=2 SLURM_STEP_NUM_TASKS=4 SLURM_LOCALID=0 "$FITLLM" --version
expect unknown_command 2 "unknown command" -- "$FITLLM" frobnicate
expect loss_missing_tokens_file 2 "missing --tokens-file" -- "$FITLLM" loss micro
expect loss_unreadable_tokens 2 "nope.txt: cannot open" -- "$FITLLM" loss micro --tokens-file "$T/nope.txt"
printf '1 2 x 4\n' > "$T/bad.txt"
expect loss_bad_token 1 "bad.txt: token 3" -- "$FITLLM" loss micro --tokens-file "$T/bad.txt"
printf '1 2 999999 4\n' > "$T/oov.txt"
expect loss_token_out_of_vocab 2 "oov.txt: token [0-9]+ \(id [0-9]+\) is outside micro.s vocabulary \[0, 512\)" -- "$FITLLM" loss micro --tokens-file "$T/oov.txt"
expect loss_not_a_model 2 "neither a file, a folder nor a model preset" -- "$FITLLM" loss no-such-model --tokens-file "$T/oov.txt"
mkdir -p "$T/notmodel"
expect loss_folder_without_config 2 "config.json" -- "$FITLLM" loss "$T/notmodel" --tokens-file "$T/oov.txt"
printf '{"model_type": "mamba", "hidden_size": 8}' > "$T/notmodel/config.json"
expect loss_unknown_architecture 2 "mamba" -- "$FITLLM" loss "$T/notmodel" --tokens-file "$T/oov.txt"
# an encoder-decoder (T5): the target's loss given the source; transformers' T5ForConditionalGeneration(input_ids=
# [5 17 33 2 90 41 7], labels=[12 44 3 1]).loss of the same folder is 5.189550
echo "5 17 33 2 90 41 7" > "$T/t5src.txt"
echo "12 44 3 1" > "$T/t5tgt.txt"
expect loss_t5_target 0 "^loss 5\.18955[0-9]  ppl" -- "$FITLLM" loss tests/fixtures/t5-tiny-gated --tokens-file "$T/t5src.txt" --target-tokens-file "$T/t5tgt.txt"
expect loss_t5_needs_target 2 "encoder-decoder: give the target with --target-tokens-file" -- "$FITLLM" loss tests/fixtures/t5-tiny-gated --tokens-file "$T/t5src.txt"
expect loss_target_needs_s2s 2 "not an encoder-decoder" -- "$FITLLM" loss micro --tokens-file "$T/t5src.txt" --target-tokens-file "$T/t5tgt.txt"
# greedy decoding of an encoder-decoder: the ids of transformers' generate(do_sample=False, max_new_tokens=12) for
# the fixture's first source (tests/ref/make_t5_fixture.py: gen0)
expect generate_t5_greedy 0 "^45 10 45 87 95 55 65 12 22 65 12 22$" -- "$FITLLM" generate tests/fixtures/t5-tiny-gated --prompt-ids "51 17 68 69 57 71 45 10 4 92 4 91 89" --max_new_tokens 12 --temperature 0
# an encoder-decoder stops at every id of generation_config.json's eos_token_id list too (as transformers' generate:
# the greedy ids above end at 87 when it is one); it stopped at config.json's eos_token_id alone
mkdir -p "$T/t5eos" && cp tests/fixtures/t5-tiny-gated/config.json tests/fixtures/t5-tiny-gated/model.safetensors "$T/t5eos/"
printf '{"decoder_start_token_id": 0, "eos_token_id": [1, 87]}' > "$T/t5eos/generation_config.json"
expect generate_t5_eos_list 0 "^45 10 45 87$" -- "$FITLLM" generate "$T/t5eos" --prompt-ids "51 17 68 69 57 71 45 10 4 92 4 91 89" --max_new_tokens 12 --temperature 0
# sampling (issue 31 item 4; tests/test_t5_sample.c: seeded, the first token's distribution = the logits' softmax):
# top-k 1 is greedy at any temperature; a seed is named in the report
expect generate_t5_topk1_is_greedy 0 "^45 10 45 87 95 55 65 12 22 65 12 22$" -- "$FITLLM" generate tests/fixtures/t5-tiny-gated --prompt-ids "51 17 68 69 57 71 45 10 4 92 4 91 89" --max_new_tokens 12 --temperature 1.5 --top_k 1
expect generate_t5_sampling 0 "12 new tokens \(temperature 0.8, top_k 50, top_p 0.9, seed 5, stop" -- "$FITLLM" generate tests/fixtures/t5-tiny-gated --prompt-ids "51 17 68 69 57 71 45 10 4 92 4 91 89" --max_new_tokens 12 --top_p 0.9 --seed 5
# T5 decoding in generation's arena (fl_model_alloc_gen_s2s: the decoder's K/V cache and cross k|v, one row of the rest):
# the greedy ids of 2,000 / 300 new tokens are the training arena's (md5 of the earlier implementation's output), and
# --max_new_tokens 50000 plans linear bytes (it asked for 74.63 GiB of WORKSPACE, the decoder's NH x T x T bias and its
# gradient, and failed), sampling the ids 300 gave until its EOS
T5P=(--prompt-ids "51 17 68 69 57 71 45 10 4 92 4 91 89")
expect generate_t5_micro_greedy_2000_unchanged 0 "^ad6ad5818401a6147d24b391870ce1c9" -- bash -c '"$1" generate t5-micro "${@:2}" --max_new_tokens 2000 --temperature 0 2>/dev/null | md5sum' _ "$FITLLM" "${T5P[@]}"
expect generate_t5_gated_greedy_300_unchanged 0 "^89a1461ddcd322dcaa07ff1d6f43a6af" -- bash -c '"$1" generate tests/fixtures/t5-tiny-gated "${@:2}" --max_new_tokens 300 --temperature 0 2>/dev/null | md5sum' _ "$FITLLM" "${T5P[@]}"
expect generate_t5_relu_greedy_300_unchanged 0 "^1d157a1c008b3611216a81abe9ddd791" -- bash -c '"$1" generate tests/fixtures/t5-tiny-relu "${@:2}" --max_new_tokens 300 --temperature 0 2>/dev/null | md5sum' _ "$FITLLM" "${T5P[@]}"
expect generate_t5_max_new_50000 0 "13 source \+ 109 new tokens \(temperature 0.8, top_k 50, top_p 1, seed 5, stop: EOS\)" -- "$FITLLM" generate t5-micro "${T5P[@]}" --max_new_tokens 50000 --seed 5
expect generate_t5_max_new_50000_ids 0 "" -- bash -c '[ "$("$1" generate t5-micro "${@:2}" --max_new_tokens 50000 --seed 5 2>/dev/null)" = "$("$1" generate t5-micro "${@:2}" --max_new_tokens 300 --seed 5 2>/dev/null)" ]' _ "$FITLLM" "${T5P[@]}"
# --max_new_tokens 0 as a decoder-only model takes it (no new token; the T5 output is the new tokens: an empty line),
# where an encoder-decoder refused it ("must be positive")
expect generate_t5_zero_new_tokens 0 "^13 source \+ 0 new tokens \(greedy, stop: max_new_tokens\)" -- "$FITLLM" generate tests/fixtures/t5-tiny-gated "${T5P[@]}" --max_new_tokens 0 --temperature 0
expect generate_t5_zero_new_tokens_empty 0 "" -- bash -c '[ "$("$1" generate tests/fixtures/t5-tiny-gated "${@:2}" --max_new_tokens 0 2>/dev/null | od -An -c | tr -d " ")" = "\n" ]' _ "$FITLLM" "${T5P[@]}"
expect generate_t5_zero_new_tokens_batch 0 "^2 sources \(longest [0-9]+ tokens, padded\) \+ 0 new tokens at most" -- "$FITLLM" generate t5-micro --prompt a --prompt "b c" --max_new_tokens 0
expect generate_zero_new_tokens_decoder_only 0 "^4 prompt \+ 0 new tokens \(stop: max_new_tokens\)" -- "$FITLLM" generate micro --prompt-ids "5 6 7 8" --max_new_tokens 0
expect bench_bad_option 2 "unknown option" -- "$FITLLM" bench-step micro --frobnicate 3
expect bench_bad_number 2 "not an integer" -- "$FITLLM" bench-step micro --micro-batch x
expect bench_oom_exit_3 3 "out of memory" -- "$FITLLM" bench-step tiny --micro-batch 2 --seq 64 --steps 1 --max-memory 64MB
expect bench_ok 0 "RESULT impl=fitllm .* fwd_ms=[0-9.]+ head_ms=[0-9.]+ bwd_ms=[0-9.]+ opt_ms=[0-9.]+" -- \
    "$FITLLM" bench-step micro --micro-batch 2 --seq 32 --steps 2 --warmup 0
# --profile: every backend op of the timed steps, grouped; the groups' sum is inside the step's time (the CPU has
# no device name: no MFU line; MFU's table and the CUDA path are tests/test_perf.c's)
expect bench_profile 0 "PROFILE gemm_ms=[0-9.]+ attn_ms=[0-9.]+ norm_ms=[0-9.]+ elem_ms=[0-9.]+ loss_ms=[0-9.]+ optim_ms=[0-9.]+ copy_ms=[0-9.]+ sum_ms" -- \
    "$FITLLM" bench-step micro --micro-batch 2 --seq 32 --steps 2 --warmup 1 --profile
# --accelerator (EXPERIMENTAL CUDA backend): auto runs on the GPU when the build has CUDA and one is
# visible (here: none, so the CPU); cpu runs on the CPU; cuda without a build or device is refused
# with the reason
expect version_cuda 0 "cuda: +(not compiled in \(.*\); this machine: .+|compiled in as a plugin \(experimental; CUDA [0-9.]+, sm [0-9,]+\): .+; .+)" -- "$FITLLM" --version
expect accelerator_auto_ok 0 "RESULT impl=fitllm" -- "$FITLLM" bench-step micro --micro-batch 1 --seq 16 --steps 1 --warmup 0 --accelerator auto
expect accelerator_bad 2 "--accelerator must be auto, cpu or cuda \(got 'gpu'\)" -- "$FITLLM" bench-step micro --accelerator gpu
CUDA_WHY="(this fitllm was built without CUDA|no NVIDIA driver|NVIDIA driver too old|no GPU|no CUDA device visible|the CUDA plugin .* is missing)"
expect accelerator_cuda_refused 2 "--accelerator cuda: $CUDA_WHY" -- \
    "$FITLLM" finetune_full micro --accelerator cuda --out_dir "$T/xcuda"
expect accelerator_help 0 "EXPERIMENTAL" -- "$FITLLM" generate --help
# fitllm selftest: the CPU backend against the reference (the CUDA one needs a GPU)
expect selftest_cpu_small 0 "selftest: [0-9]+ of [0-9]+ cases ok$" -- "$FITLLM" selftest --accelerator cpu --small
# its training runs (micro, 4 steps; with offload: the update staged through the host tier) on the opaque backend
expect selftest_opaque_training 0 "ok +train_step offload \(deepspeed_stage_2_offload\) +max relative loss difference 0\.00e\+00" -- \
    "$FITLLM" selftest --backend opaque --only train_step
expect selftest_only_none 2 "no case matches --only 'no-such-op'" -- "$FITLLM" selftest --accelerator cpu --small --only no-such-op
expect selftest_cuda_refused 2 "--accelerator cuda: $CUDA_WHY" -- \
    "$FITLLM" selftest --accelerator cuda
# The CUDA plugin (docs/ARCHITECTURE.md "CUDA plugin"): fitllm maps nothing of CUDA until a GPU is
# asked for and usable, and tells the driver's states apart. A stand-in libcuda.so.1 built with the
# tests (tests/cuda/fake_libcuda.c) plays the driver.
FAKE_DRV=$(dirname "$FITLLM")/fake-driver
if ! ldconfig -p 2>/dev/null | grep -q "libcuda\.so\.1 "; then
    expect version_no_driver 0 "cuda: .*no NVIDIA driver \(libcuda\.so\.1 not found\)" -- "$FITLLM" --version
else echo "skip version_no_driver: this machine has an NVIDIA driver"; skip=$((skip+1)); fi
if [ -e "$FAKE_DRV/libcuda.so.1" ] && "$FITLLM" --version | grep -q "cuda: *compiled in"; then
    expect version_driver_too_old 0 "cuda: .*NVIDIA driver too old: it supports CUDA 11\.0, this build needs CUDA [0-9]+\.0 or newer" -- \
        env LD_LIBRARY_PATH="$FAKE_DRV" FITLLM_FAKE_CUDA_VERSION=11000 "$FITLLM" --version
    expect accelerator_cuda_driver_too_old 1 "--accelerator cuda: NVIDIA driver too old" -- \
        env LD_LIBRARY_PATH="$FAKE_DRV" FITLLM_FAKE_CUDA_VERSION=11000 "$FITLLM" finetune_full micro --accelerator cuda --out_dir "$T/xcuda"
    expect version_driver_no_gpu 0 "cuda: .*no GPU \(NVIDIA driver for CUDA 99\.0 found, but it sees no device\)" -- \
        env LD_LIBRARY_PATH="$FAKE_DRV" FITLLM_FAKE_CUDA_VERSION=99000 "$FITLLM" --version
    # a driver that claims a GPU: the plugin is opened (its symbols resolve against fitllm's) and the
    # CUDA runtime's own refusal of the stand-in comes back as a clean error
    expect accelerator_cuda_plugin_loads 1 "--accelerator cuda: no CUDA device visible to the CUDA runtime \(cudaGetDeviceCount: " -- \
        env LD_LIBRARY_PATH="$FAKE_DRV" FITLLM_FAKE_CUDA_VERSION=99000 FITLLM_FAKE_CUDA_DEVICES=1 \
        "$FITLLM" finetune_full micro --accelerator cuda --out_dir "$T/xcuda"
    expect accelerator_cuda_plugin_missing 1 "--accelerator cuda: the CUDA plugin $T/none/libfitllm_cuda\.so is missing \(.*make build CUDA=1" -- \
        env FITLLM_CUDA_LIB="$T/none/libfitllm_cuda.so" "$FITLLM" finetune_full micro --accelerator cuda --out_dir "$T/xcuda"
    expect accelerator_auto_plugin_missing 0 "RESULT impl=fitllm" -- env FITLLM_CUDA_LIB="$T/none/libfitllm_cuda.so" \
        "$FITLLM" bench-step micro --micro-batch 1 --seq 16 --steps 1 --warmup 0
elif [ -e "$FAKE_DRV/libcuda.so.1" ]; then
    expect version_driver_without_cuda 0 "cuda: +not compiled in .*; this machine: no GPU \(NVIDIA driver for CUDA 11\.0 found" -- \
        env LD_LIBRARY_PATH="$FAKE_DRV" FITLLM_FAKE_CUDA_VERSION=11000 "$FITLLM" --version
else echo "skip fake-driver checks: $FAKE_DRV/libcuda.so.1 not built"; skip=$((skip+1)); fi
# What a CPU run costs beyond its tagged memory (the memory report's peak): the program, its libraries
# and the allocator's slack, ~15 MiB; a build that mapped the CUDA libraries at start paid 200 MiB more.
out=$("$FITLLM" bench-step micro --micro-batch 2 --seq 32 --steps 2 --warmup 0 --accelerator cpu 2>&1)
peak=$(awk '/^peak +reserved/{v=$(NF-1); u=$NF; m=(u=="GiB")?1024:(u=="MiB")?1:(u=="KiB")?1/1024:1/1048576; print v*m}' <<<"$out")
rss=$(grep -o "peak_rss_mb=[0-9.]*" <<<"$out" | cut -d= -f2)
if [ -n "$peak" ] && [ -n "$rss" ] && awk -v r="$rss" -v p="$peak" 'BEGIN{exit !(r <= p + 40)}'; then
    echo "ok   rss_vs_tagged_peak (peak RSS $rss MiB, tagged peak $peak MiB)"; pass=$((pass+1))
else echo "FAIL rss_vs_tagged_peak: peak RSS ${rss:-?} MiB > tagged peak ${peak:-?} MiB + 40 MiB"; fail=$((fail+1)); fi
if [ -x /usr/bin/time ] && ! ldconfig -p 2>/dev/null | grep -q "libcuda\.so\.1 "; then # (with a GPU, --version opens the plugin)
    rss=$(/usr/bin/time -f "%M" "$FITLLM" --version 2>&1 >/dev/null | tail -1)
    if [ "${rss:-999999}" -lt 20480 ]; then echo "ok   version_rss (${rss} KB)"; pass=$((pass+1))
    else echo "FAIL version_rss: fitllm --version peaked at ${rss:-?} KB (want < 20 MB)"; fail=$((fail+1)); fi
else echo "skip version_rss: no /usr/bin/time, or an NVIDIA driver here"; skip=$((skip+1)); fi
expect selftest_bad_backend 2 "unknown backend 'nope'" -- "$FITLLM" selftest --backend nope
expect selftest_null_backend 2 "--backend null: the null backend computes nothing" -- "$FITLLM" selftest --backend null
expect pretrain_initial_checkpoint_missing 2 "/nonexistent-fitllm: no such folder" -- "$FITLLM" pretrain --initial_checkpoint_dir /nonexistent-fitllm --model_name micro --data Synthetic --out_dir "$T/pz"
# an initial checkpoint of another shape than model_name's: a configuration error naming both shapes (it was a tensor's
# "expected shape ... (from config.json)", the checkpoint's config.json blamed for model_name's shape, exit 1)
if [ -d "$DATA/stories260K-hf" ]; then
    expect pretrain_initial_checkpoint_other_shape 2 "initial_checkpoint_dir .*stories260K-hf holds another shape than the model pretrain builds \(tiny\): its config.json has vocab 512, dim 64" -- \
        "$FITLLM" pretrain --model_name tiny --initial_checkpoint_dir "$DATA/stories260K-hf" --data Synthetic --train.max_steps 1 --out_dir "$T/pz2"
    expect pretrain_initial_checkpoint_same_shape 0 "Saved the final model" -- "$FITLLM" pretrain --model_config "$DATA/stories260K-hf/config.json" \
        --initial_checkpoint_dir "$DATA/stories260K-hf" --tokenizer_dir "$DATA/stories260K-hf" --data TextFiles --data.train_data_path "$DATA/text" \
        --train.max_seq_length 32 --train.max_steps 1 --train.global_batch_size 1 --train.micro_batch_size 1 --eval.final_validation false --out_dir "$T/pz3"
fi
# plan for a GPU without one: the CUDA backend's op scratch (80 MiB) in WORKSPACE
expect plan_cuda 0 "peak +reserved" -- "$FITLLM" plan micro --accelerator cuda --precision bf16-true --train.micro_batch_size 1
# issue 33: Synthetic samples with lengths drawn from Alpaca's measured table; plan sizes T for the longest draw
# (tests/test_lengths.c: quantiles within the DKW bound, planned == measured), a bad table names file and line
expect plan_data_lengths 0 "T = 402: the longest of the 2000 \+ 100 samples whose lengths are drawn from recipes/data/alpaca-lengths.tsv \(seed 42; median 118, max 406" -- "$FITLLM" plan micro --data.lengths recipes/data/alpaca-lengths.tsv --train.max_seq_length 512
printf '0\t10\n0.5\tabc\n1\t20\n' > "$T/bad-lengths.tsv"
expect plan_data_lengths_bad 1 "data.lengths: .*/bad-lengths.tsv:2: quantile 0.5 has no length" -- "$FITLLM" plan micro --data.lengths "$T/bad-lengths.tsv"
expect train_data_lengths_bad 1 "data.lengths: .*/bad-lengths.tsv:2: quantile 0.5 has no length" -- "$FITLLM" finetune_full micro --data.lengths "$T/bad-lengths.tsv" --out_dir "$T/badlen" --train.max_steps 1
# a data option of another data class was ignored without a word (Alpaca trained, the table unread): refused as
# LitGPT's jsonargparse refuses init_args a class does not have, naming the option, the class and what it takes
expect data_option_other_class 2 "option 'data.lengths' is not an option of data class Alpaca, which takes json_path, .*; data.lengths is an option of Synthetic" -- \
    "$FITLLM" finetune_full micro --data Alpaca --data.lengths recipes/data/alpaca-lengths.tsv --out_dir "$T/dk1"
expect data_option_n_train_alpaca 2 "option 'data.n_train' is not an option of data class Alpaca2k" -- "$FITLLM" plan micro --data Alpaca2k --data.n_train 16
expect data_option_default_class 2 "option 'data.json_path' is not an option of data class Synthetic \(finetune_full's default\)" -- \
    "$FITLLM" finetune_full micro --data.json_path "$T/a.json" --out_dir "$T/dk2"
expect data_option_textfiles 2 "option 'data.prompt_style' is not an option of data class TextFiles, which takes train_data_path, val_data_path" -- \
    "$FITLLM" pretrain --model_name micro --data TextFiles --data.train_data_path "$T" --data.prompt_style alpaca --out_dir "$T/dk3"
printf 'data:\n  class_path: Synthetic\n  init_args:\n    json_path: a.json\n' > "$T/dk.yaml"
expect data_option_recipe 2 "dk.yaml:4: option 'data.json_path' is not an option of data class Synthetic" -- "$FITLLM" finetune_full micro --config "$T/dk.yaml" --out_dir "$T/dk4"
# Idle OpenMP workers sleep by default (fl_cpu_process_init re-executes with OMP_WAIT_POLICY=passive);
# an explicit choice of the user stands. libgomp prints its settings with OMP_DISPLAY_ENV (the last
# block is the one of the process that runs).
if env OMP_DISPLAY_ENV=verbose "$FITLLM" --help 2>&1 | grep -q "GOMP_SPINCOUNT"; then
    gomp_env() { env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u KMP_BLOCKTIME OMP_DISPLAY_ENV=verbose "$@" "$FITLLM" --help 2>&1 |
        grep -E "OMP_WAIT_POLICY|GOMP_SPINCOUNT" | tail -2 | tr -d "\n "; }
    expect omp_passive_by_default 0 "OMP_WAIT_POLICY='PASSIVE'GOMP_SPINCOUNT='0'" -- gomp_env
    expect omp_user_policy_kept 0 "OMP_WAIT_POLICY='ACTIVE'" -- gomp_env OMP_WAIT_POLICY=active
    expect omp_user_spincount_kept 0 "GOMP_SPINCOUNT='5000'" -- gomp_env GOMP_SPINCOUNT=5000
else
    echo "skip omp_passive_by_default: not libgomp"; skip=$((skip+1))
fi

# training commands: configuration errors are usage errors (2), OOM is 3
printf 'train:\n  micro_batch_size: 4\n   global_batch_size: [\n' > "$T/bad.yaml"
expect finetune_bad_yaml 2 "bad.yaml:" -- "$FITLLM" finetune_full micro --config "$T/bad.yaml"
expect finetune_unknown_key 2 "did you mean 'train.micro_batch_size'" -- "$FITLLM" finetune_full micro --train.micro_bach_size 2
expect finetune_not_divisible 2 "not divisible" -- "$FITLLM" finetune_full micro --train.global_batch_size 6 --train.micro_batch_size 4 --out_dir "$T/x3"
expect finetune_negative_batch 2 "'-1' must be positive: an integer in \[1, " -- "$FITLLM" finetune_full micro --train.micro_batch_size -1 --out_dir "$T/x4"
expect finetune_unknown_option_last 2 "unknown option 'bogus'" -- "$FITLLM" finetune_full micro --bogus
# a negative or too high LR floor, a negative clipping norm: refused before training (were run: gradient ascent)
expect finetune_negative_min_lr 2 "train.min_lr -1 must be a finite number >= 0" -- "$FITLLM" finetune_full micro --data Synthetic --train.global_batch_size 1 --train.max_steps 12 --train.lr_warmup_steps 2 --train.min_lr -1 --out_dir "$T/oz"
expect finetune_min_lr_above_lr 0 "lr 1e-05, min_lr 6e-05 \(above lr: the rate stays at lr after the warm-up, no decay" -- \
    "$FITLLM" finetune_full micro --optimizer.lr 1e-5 --train.max_steps 1 --train.global_batch_size 1 --eval.max_new_tokens 0 --out_dir "$T/ozl"
expect finetune_negative_max_norm 2 "train.max_norm -1: give a positive gradient clipping norm, or 0 / null for no clipping" -- "$FITLLM" finetune_full micro --train.max_norm -1 --out_dir "$T/oz"
[ ! -e "$T/oz" ] && echo "ok   finetune_lr_refusals_write_nothing" && pass=$((pass+1)) || { echo "FAIL finetune_lr_refusals_write_nothing"; fail=$((fail+1)); }
expect demo_negative_lr 2 "option --lr: '-1' must be a positive finite number" -- "$FITLLM" demo --lr -1 --steps 1
expect demo_inf_lr 2 "option --lr: 'inf' must be a positive finite number" -- "$FITLLM" demo --lr inf --steps 1
expect finetune_missing_value 2 "option --train.max_steps needs a value" -- "$FITLLM" finetune_full micro --train.max_steps
# images (src/image): decode, the BLIP processor's pixel_values and its dump, bad files named
IMG=tests/fixtures/images
expect image_info_size 0 "rgba_37x53.png: 37 x 53 RGB" -- "$FITLLM" image-info "$IMG/rgba_37x53.png"
expect image_info_pixel_values 0 "pixel_values: 3 x 30 x 40 float32 \(resize bicubic, rescale on, normalize on\).*fnv1a64 [0-9a-f]{16}" -- \
    "$FITLLM" image-info "$IMG/prog_50x33.jpg" --processor "$IMG" --dump "$T/pv.f32"
expect image_info_dump_size 0 "^14400$" -- stat -c %s "$T/pv.f32"
if rm -f "$T/pv-null" && mknod "$T/pv-null" c 1 3 2>/dev/null; then # root: a node of /dev/null's numbers, written in place
    expect image_info_dump_null_device 0 "wrote .*pv-null" -- "$FITLLM" image-info "$IMG/prog_50x33.jpg" --processor "$IMG" --dump "$T/pv-null"
    [ -c "$T/pv-null" ] && { echo "ok   image_info_dump_null_device_kept"; pass=$((pass+1)); } ||
        { echo "FAIL image_info_dump_null_device_kept"; fail=$((fail+1)); }
fi
expect image_info_missing 2 "nope.png: cannot open image" -- "$FITLLM" image-info "$T/nope.png"
expect image_info_cmyk 2 "bad_cmyk_8x8.jpg: CMYK JPEG is not supported" -- "$FITLLM" image-info "$IMG/bad_cmyk_8x8.jpg"
head -c 1000 "$IMG/rgb420_97x61.jpg" > "$T/trunc.jpg"
expect image_info_truncated 1 "trunc.jpg: truncated JPEG" -- "$FITLLM" image-info "$T/trunc.jpg"
expect image_info_dump_needs_processor 2 "--dump needs --processor" -- "$FITLLM" image-info "$IMG/one_1x1.png" --dump "$T/x"
expect image_info_bad_processor 2 "preprocessor_config.json" -- "$FITLLM" image-info "$IMG/one_1x1.png" --processor "$T"
expect image_info_help 0 "BlipImageProcessorPil" -- "$FITLLM" image-info --help
# BLIP-2 (issue 32 items 1 and 4): loss of a caption after the image's query tokens and greedy captioning against
# transformers (tests/fixtures/blip2-tiny-opt/expected-cli.json: loss 5.6369219, generate 32 x 8); bad input named
B2=tests/fixtures/blip2-tiny-opt
printf '2 45 17 88 9 61\n' > "$T/cap.txt"
expect blip2_loss_image 0 "loss 5\.6369(0[7-9]|[12][0-9]|3[0-7])  ppl [0-9.]+  tokens 5  image" -- "$FITLLM" loss "$B2" --image "$IMG/palette_45x31.png" --tokens-file "$T/cap.txt"
expect blip2_generate_image 0 "^32 32 32 32 32 32 32 32$" -- "$FITLLM" generate "$B2" --image "$IMG/palette_45x31.png" --max_new_tokens 8
expect blip2_loss_needs_image 2 "model_type 'blip-2' is a composite" -- "$FITLLM" loss "$B2" --tokens-file "$T/cap.txt"
expect blip2_loss_missing_image 2 "nope.png: cannot open image" -- "$FITLLM" loss "$B2" --image "$T/nope.png" --tokens-file "$T/cap.txt"
expect blip2_loss_cmyk 2 "bad_cmyk_8x8.jpg: CMYK JPEG is not supported" -- "$FITLLM" loss "$B2" --image "$IMG/bad_cmyk_8x8.jpg" --tokens-file "$T/cap.txt"
expect blip2_image_not_blip2 2 "--image: .* is not a BLIP-2 folder" -- "$FITLLM" loss tests/fixtures/golden-opt --image "$IMG/one_1x1.png" --tokens-file "$T/cap.txt"
expect blip2_generate_prompt_needs_tokenizer 2 "no tokenizer found" -- "$FITLLM" generate "$B2" --image "$IMG/one_1x1.png" --prompt "a photo of"
expect blip2_generate_sampling 2 "captioning is greedy only" -- "$FITLLM" generate "$B2" --image "$IMG/one_1x1.png" --temperature 0.7
# --max_new_tokens as the LM path takes it: 0 generates nothing; beyond the context the caption stops there (the 5
# queries, BOS and 58 new tokens fill the OPT fixture's 64 positions: tests/test_blip2_train.c blip2_generate_stops_at_context)
expect blip2_generate_zero_new 0 "^0 new tokens \(greedy, stop: max_new_tokens\)" -- "$FITLLM" generate "$B2" --image "$IMG/one_1x1.png" --max_new_tokens 0
expect blip2_generate_context_limit 0 "^58 new tokens \(greedy, stop: context limit\)" -- "$FITLLM" generate "$B2" --image "$IMG/one_1x1.png" --max_new_tokens 100000
B2T=tests/fixtures/blip2-tiny-t5
printf '17 29\n' > "$T/t5src.txt"; printf '45 17 88 1\n' > "$T/t5tgt.txt"
expect blip2_t5_loss_image 0 "loss 4\.5621(3[4-9]|[45][0-9]|6[0-4])  ppl [0-9.]+  tokens 4  image" -- "$FITLLM" loss "$B2T" --image "$IMG/palette_45x31.png" --tokens-file "$T/t5src.txt" --target-tokens-file "$T/t5tgt.txt"
expect blip2_t5_generate_image 0 "^95 19 59 19 73 19$" -- "$FITLLM" generate "$B2T" --image "$IMG/palette_45x31.png" --prompt-ids "17 29" --max_new_tokens 6
expect blip2_t5_loss_needs_target 2 "give the target with --target-tokens-file" -- "$FITLLM" loss "$B2T" --image "$IMG/palette_45x31.png" --tokens-file "$T/t5src.txt"
expect blip2_opt_loss_no_target 2 "has a decoder-only language model" -- "$FITLLM" loss "$B2" --image "$IMG/palette_45x31.png" --tokens-file "$T/cap.txt" --target-tokens-file "$T/t5tgt.txt"
mkdir -p "$T/b2np" && cp "$B2/config.json" "$B2/model.safetensors" "$T/b2np/"
expect blip2_no_processor 2 "no preprocessor_config.json" -- "$FITLLM" loss "$T/b2np" --image "$IMG/one_1x1.png" --tokens-file "$T/cap.txt"
# BLIP-2 image-caption fine-tuning (issue 32 item 3, fl_blip2_train: src/train/blip2_train.c): the 14 shipped test images, each
# with a NAME.txt caption of token ids (the fixture has no tokenizer); 8 AdamW steps of micro batch 2 on the Q-Former
# and the language model (vision frozen). The loss falls (step 8 below step 1 by > 0.5 nats), the saved folder
# reloads with a lower caption loss than the base (transformers loads it and gives the same loss:
# tests/ref/blip2_finetune_check.py); LoRA writes the merged folder and the PEFT adapter (PEFT's loss = fitllm's)
mkdir -p "$T/b2caps"; k=0
for f in "$IMG"/*.png "$IMG"/*.jpg; do
    case "$f" in *bad_*) continue ;; esac
    k=$((k+1)); cp "$f" "$T/b2caps/"; b=$(basename "$f"); printf '%d %d 9 11 %d\n' $((k*3)) $((k+40)) $((k*2+20)) > "$T/b2caps/${b%.*}.txt"
done
printf '2 3 41 9 11 22\n' > "$T/b2cap.txt"
B2RUN=(--data JSON --data.json_path "$T/b2caps" --train.max_steps 8 --train.micro_batch_size 2 --train.global_batch_size 2 --optimizer.lr 0.003 --train.lr_warmup_steps 0)
b2out=$("$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --out_dir "$T/b2full" 2>&1); rc=$?
l1=$(sed -n 's/^step 1\/8 loss \([0-9.]*\).*/\1/p' <<<"$b2out"); l8=$(sed -n 's/^step 8\/8 loss \([0-9.]*\).*/\1/p' <<<"$b2out")
if [ $rc -eq 0 ] && [ -n "$l1" ] && [ -n "$l8" ] && awk -v a="$l1" -v b="$l8" 'BEGIN{exit !(b < a - 0.5)}' && grep -q "vision tower frozen" <<<"$b2out" && grep -q "^epoch 1 average loss" <<<"$b2out"; then
    echo "ok   blip2_finetune_full_loss_falls ($l1 -> $l8)"; pass=$((pass+1))
else echo "FAIL blip2_finetune_full_loss_falls: rc $rc, $l1 -> $l8"; echo "$b2out" | tail -5; fail=$((fail+1)); fi
lb=$("$FITLLM" loss "$B2" --image "$IMG/palette_45x31.png" --tokens-file "$T/b2cap.txt" 2>&1 | sed -n 's/^loss \([0-9.]*\).*/\1/p')
lf=$("$FITLLM" loss "$T/b2full/final" --image "$IMG/palette_45x31.png" --tokens-file "$T/b2cap.txt" 2>&1 | sed -n 's/^loss \([0-9.]*\).*/\1/p')
if [ -n "$lb" ] && [ -n "$lf" ] && awk -v a="$lb" -v b="$lf" 'BEGIN{exit !(b < a - 0.5)}'; then
    echo "ok   blip2_finetune_full_reloads ($lb -> $lf)"; pass=$((pass+1))
else echo "FAIL blip2_finetune_full_reloads: base '$lb', trained '$lf'"; fail=$((fail+1)); fi
expect blip2_finetune_lora 0 "saved .*b2lora/final \(weights with the LoRA adapters merged; adapter/: PEFT\)" -- "$FITLLM" finetune_lora "$B2" "${B2RUN[@]}" --optimizer.lr 0.02 --lora_r 4 --out_dir "$T/b2lora"
expect blip2_lora_adapter 0 '"r": 4' -- cat "$T/b2lora/final/adapter/adapter_config.json"
expect blip2_lora_reloads 0 "^loss [0-9.]+  ppl" -- "$FITLLM" loss "$T/b2lora/final" --image "$IMG/palette_45x31.png" --tokens-file "$T/b2cap.txt"
expect blip2_finetune_vision_too 0 "trains vision qformer lm" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 1 --blip2.train vision,qformer,lm --out_dir "$T/b2vis"
expect blip2_finetune_memory_by_part 0 "memory by part \(MiB\): vision PARAMS 0\.0[0-9]+ GRADS 0\.000 OPTIM 0\.000; qformer PARAMS [0-9.]+ GRADS 0\.0[1-9][0-9]* OPTIM" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 1 --out_dir "$T/b2mem"
expect blip2_finetune_bad_part 2 "blip2.train: unknown part 'text'" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --blip2.train text --out_dir "$T/b2x"
expect blip2_finetune_precision 2 "--precision 16-true: BLIP-2 fine-tuning runs 32-true, bf16-true and bf16-mixed only" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --precision 16-true --out_dir "$T/b2x"
# what the loop does not do is refused by name, exit 2, no folder written
for v in "--train.max_time 60|--train.max_time: BLIP-2 fine-tuning stops at train.max_steps" \
         "--train.max_tokens 1000|--train.max_tokens: BLIP-2 fine-tuning stops at train.max_steps" \
         "--train.lr_warmup_fraction 0.1|--train.lr_warmup_fraction: BLIP-2 fine-tuning warms up over" \
         "--eval.initial_validation true|--eval.initial_validation true: BLIP-2 fine-tuning validates every"; do
    read -r -a opt <<<"${v%%|*}"
    expect "blip2_finetune_refuses_${opt[0]#--}" 2 "${v#*|}" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" "${opt[@]}" --out_dir "$T/b2ref"
done
# QLoRA (tests/test_blip2_qlora.c: the dequantized model's logits and loss bit for bit, the adapters' gradients within
# fp32 noise): every part's block linears in 4 bits, the adapters on the language model; the loss falls, both variants
for m in "$B2" tests/fixtures/blip2-tiny-t5; do
    b2out=$("$FITLLM" finetune_lora "$m" "${B2RUN[@]}" --optimizer.lr 0.02 --lora_r 4 --quantize bnb.nf4 --precision bf16-true --out_dir "$T/b2q" 2>&1); rc=$?
    l1=$(sed -n 's/^step 1\/8 loss \([0-9.]*\).*/\1/p' <<<"$b2out"); l8=$(sed -n 's/^step 8\/8 loss \([0-9.]*\).*/\1/p' <<<"$b2out")
    expect "blip2_finetune_qlora_${m##*-}" 0 "" -- awk -v rc=$rc -v a="$l1" -v b="$l8" 'BEGIN { exit !(rc == 0 && a > 3 && b < a - 0.5) }'
done
expect blip2_refused_runs_write_nothing 1 "" -- test -e "$T/b2ref"
expect blip2_finetune_precision_16mixed 2 "--precision 16-mixed: BLIP-2 fine-tuning runs 32-true, bf16-true and bf16-mixed only" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --precision 16-mixed --out_dir "$T/b2x"
# activation checkpointing on the three stacks (train.activation_checkpointing true: each keeps its blocks' inputs and
# one block's slots per block graph, recomputed in the backward): the same final weights bit for bit as without it,
# OPT and T5, every part trained, LoRA with dropout; ACTS smaller (the first peak row's ACTS column)
for m in "$B2" tests/fixtures/blip2-tiny-t5; do
    for v in all lora; do
        c=finetune_full; x=(--blip2.train vision,qformer,lm); [ $v = lora ] && c=finetune_lora && x=(--lora_r 4 --lora_dropout 0.1)
        rm -rf "$T/b2c0" "$T/b2c1"
        a=$("$FITLLM" $c "$m" "${B2RUN[@]}" --train.max_steps 3 "${x[@]}" --out_dir "$T/b2c0" 2>&1 | awk '/^peak/ { print $9 $10; exit }')
        b=$("$FITLLM" $c "$m" "${B2RUN[@]}" --train.max_steps 3 "${x[@]}" --train.activation_checkpointing true --out_dir "$T/b2c1" 2>&1 | awk '/^peak/ { print $9 $10; exit }')
        expect "blip2_act_ckpt_same_bits_${m##*-}_$v" 0 "" -- bash -c 'cmp "$1/final/model.safetensors" "$2/final/model.safetensors" && [ "${3%KiB}" != "$3" ] && [ "${4%KiB}" != "$4" ] && awk -v a="${3%KiB}" -v b="${4%KiB}" "BEGIN { exit !(b < 0.8 * a) }" || { echo "ACTS $3 -> $4"; exit 1; }' _ "$T/b2c0" "$T/b2c1" "$a" "$b"
    done
done
# CPU optimizer offload (deepspeed_stage_{1,2}_offload, one process: the state in the host tier, the update on the
# host's kernels): the same bits as the run without it (the CPU backend's kernels either way), OPTIM 0 in the device
# pool and the state in the host tier's report
b2out=$("$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --strategy deepspeed_stage_2_offload --out_dir "$T/b2off" 2>&1)
expect blip2_offload_same_bits 0 "" -- cmp "$T/b2full/final/model.safetensors" "$T/b2off/final/model.safetensors"
expect blip2_offload_optim_on_host 0 "" -- bash -c 'awk "/^peak/ { n++; if (n == 1) dev = \$7 \$8; if (n == 2) host = \$7 \$8 } END { exit !(dev == \"0B\" && host != \"0B\" && host != \"\") }" <<<"$1" && grep -q "^host tier (CPU offload: the optimizer state, outside the device.s budget)" <<<"$1"' _ "$b2out"
# parameter offload in one process (fsdp_cpu_offload: every part's parameters, gradients and optimizer state in the host
# tier, each unit brought up for its use): the plain run's bits, PARAMS / GRADS / OPTIM 0 in the device pool
b2out=$("$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --strategy fsdp_cpu_offload --out_dir "$T/b2poff" 2>&1)
expect blip2_param_offload_same_bits 0 "" -- cmp "$T/b2full/final/model.safetensors" "$T/b2poff/final/model.safetensors"
expect blip2_param_offload_on_host 0 "" -- bash -c 'awk "/^peak/ { n++; if (n == 1) dev = \$3 \$4 \$5 \$6 \$7 \$8; if (n == 2) host = \$3 \$4 } END { exit !(dev == \"0B0B0B\" && host != \"0B\" && host != \"\") }" <<<"$1" && grep -q "^host tier (CPU offload: the optimizer state, the parameters. and gradients. shards" <<<"$1"' _ "$b2out"
# NVMe (deepspeed_stage_3_offload_nvme: the parameters' and gradients' shards and the optimizer state in files under
# out_dir, unlinked at creation): the plain run's bits, the nvme tier in the report, no file left behind
b2out=$("$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --strategy deepspeed_stage_3_offload_nvme --out_dir "$T/b2nv" 2>&1)
expect blip2_nvme_offload_same_bits 0 "" -- cmp "$T/b2full/final/model.safetensors" "$T/b2nv/final/model.safetensors"
expect blip2_nvme_offload_tier 0 "" -- bash -c 'grep -q "^nvme tier (the parameters. and gradients. shards and the optimizer state in files under" <<<"$1" && [ "$(ls -A "$2" | sort | tr "\n" " ")" = "final logs " ]' _ "$b2out" "$T/b2nv"
planned=$("$FITLLM" plan "$B2" "${B2RUN[@]}" --strategy deepspeed_stage_3_offload_nvme 2>&1 | sed -n 's/^nvme (offload) *//p')
measured=$(sed -n '/^nvme tier/,$p' <<<"$b2out" | sed -n 's/^peak *//p' | head -1)
expect blip2_plan_nvme_tier 0 "" -- bash -c '[ -n "$1" ] && [ "$1" = "$2" ] || { echo "planned: $1"; echo "measured: $2"; exit 1; }' _ "$planned" "$measured"
# bf16-mixed (tests/test_blip2_prec.c: within 2 x PyTorch autocast's bf16 error of the float64 run) and bf16-true
# (tests/test_blip2_bf16true.c: bf16-mixed's logits and loss on bf16-exact weights, its gradients rounded once): the
# loss falls as under 32-true (step 8 below step 1 by > 0.5 nats), both variants; bf16-true's PARAMS are half
for m in "$B2" tests/fixtures/blip2-tiny-t5; do
    for pr in bf16-mixed bf16-true; do
        b2out=$("$FITLLM" finetune_full "$m" "${B2RUN[@]}" --precision $pr --out_dir "$T/b2bm" 2>&1); rc=$?
        l1=$(sed -n 's/^step 1\/8 loss \([0-9.]*\).*/\1/p' <<<"$b2out"); l8=$(sed -n 's/^step 8\/8 loss \([0-9.]*\).*/\1/p' <<<"$b2out")
        n=bf16_mixed; [ $pr = bf16-true ] && n=bf16_true
        expect "blip2_finetune_${n}_${m##*-}" 0 "" -- awk -v rc=$rc -v a="$l1" -v b="$l8" 'BEGIN { exit !(rc == 0 && a > 3 && b < a - 0.5) }'
    done
done
expect blip2_bf16_true_params_half 0 "memory by part \(MiB\): vision PARAMS 0\.020 GRADS 0\.000 OPTIM 0\.000; qformer PARAMS 0\.027 GRADS 0\.027 OPTIM 0\.054" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 1 --precision bf16-true --out_dir "$T/b2x"
expect blip2_finetune_needs_captions 2 "trains on image captions: --data JSON --data.json_path" -- "$FITLLM" finetune_full "$B2" --out_dir "$T/b2x"
mkdir -p "$T/b2bad" && cp "$IMG/one_1x1.png" "$IMG/rgb_13x7.png" "$T/b2bad/" && printf '3 4\n' > "$T/b2bad/one_1x1.txt"
expect blip2_finetune_missing_txt 2 "rgb_13x7.png has no caption file rgb_13x7.txt" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --data.json_path "$T/b2bad" --out_dir "$T/b2x"
printf 'a red square\n' > "$T/b2bad/rgb_13x7.txt"
expect blip2_finetune_text_without_tokenizer 1 "caption of .*rgb_13x7.png: the checkpoint has no tokenizer" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --data.json_path "$T/b2bad" --out_dir "$T/b2x"
head -c 300 "$IMG/rgb420_97x61.jpg" > "$T/b2bad/rgb_13x7.jpg"; rm "$T/b2bad/rgb_13x7.png"; printf '5 6\n' > "$T/b2bad/rgb_13x7.txt"
expect blip2_finetune_truncated_image 1 "rgb_13x7.jpg: corrupt JPEG" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --data.json_path "$T/b2bad" --out_dir "$T/b2x"
# the Flan-T5 variant (labels = the caption + EOS, the decoder's input shifted from the start token): the loss falls,
# the folder reloads lower; LoRA on q, v (the lab's); the image parts alone are refused (T5 trains its lm)
b2out=$("$FITLLM" finetune_full tests/fixtures/blip2-tiny-t5 "${B2RUN[@]}" --out_dir "$T/b2t5" 2>&1); rc=$?
l1=$(sed -n 's/^step 1\/8 loss \([0-9.]*\).*/\1/p' <<<"$b2out"); l8=$(sed -n 's/^step 8\/8 loss \([0-9.]*\).*/\1/p' <<<"$b2out")
printf '17 29\n' > "$T/b2t5src.txt"; printf '3 41 9 11 1\n' > "$T/b2t5tgt.txt"
lb=$("$FITLLM" loss tests/fixtures/blip2-tiny-t5 --image "$IMG/palette_45x31.png" --tokens-file "$T/b2t5src.txt" --target-tokens-file "$T/b2t5tgt.txt" 2>&1 | sed -n 's/^loss \([0-9.]*\).*/\1/p')
lf=$("$FITLLM" loss "$T/b2t5/final" --image "$IMG/palette_45x31.png" --tokens-file "$T/b2t5src.txt" --target-tokens-file "$T/b2t5tgt.txt" 2>&1 | sed -n 's/^loss \([0-9.]*\).*/\1/p')
if [ $rc -eq 0 ] && [ -n "$l8" ] && [ -n "$lf" ] && awk -v a="$l1" -v b="$l8" -v c="$lb" -v d="$lf" 'BEGIN{exit !(b < a - 0.3 && d < c - 0.3)}'; then
    echo "ok   blip2_t5_finetune_full (steps $l1 -> $l8, reloaded $lb -> $lf)"; pass=$((pass+1))
else echo "FAIL blip2_t5_finetune_full: rc $rc, steps $l1 -> $l8, reloaded $lb -> $lf"; echo "$b2out" | tail -3; fail=$((fail+1)); fi
expect blip2_t5_finetune_lora 0 "saved .*b2t5l/final" -- "$FITLLM" finetune_lora tests/fixtures/blip2-tiny-t5 "${B2RUN[@]}" --lora_r 4 --out_dir "$T/b2t5l"
expect blip2_t5_lora_adapter 0 '"task_type": "SEQ_2_SEQ_LM"' -- cat "$T/b2t5l/final/adapter/adapter_config.json"
# a BLIP-2 LoRA checkpoint outside --resume (the adapter's modules language_model.<module>, as PEFT names them):
# merge_lora merges the last step's adapter into its BLIP-2 base, the run's final/ byte for byte
# (tests/test_blip2_entry.c blip2_merge_peft_equals_final); generate --image takes the merged folder, the step folder,
# a run folder without final/ (its newest step) and --adapter on the base alike (the trained caption, not the base's)
"$FITLLM" finetune_lora "$B2T" "${B2RUN[@]}" --lora_r 4 --optimizer.lr 0.05 --train.save_interval 8 --out_dir "$T/b2t5s" >/dev/null 2>&1
expect blip2_merge_lora 0 "merged -> .*b2t5m \(config.json, model.safetensors, the processor's files: a BLIP-2 folder" -- "$FITLLM" merge_lora "$T/b2t5s/step-000008" --out_dir "$T/b2t5m"
expect blip2_merge_lora_equals_final 0 "" -- cmp "$T/b2t5s/final/model.safetensors" "$T/b2t5m/model.safetensors"
B2GEN=(--image "$IMG/palette_45x31.png" --prompt-ids "17 29" --max_new_tokens 6)
b2cap=$("$FITLLM" generate "$T/b2t5s/final" "${B2GEN[@]}" 2>/dev/null)
expect blip2_lora_caption_trained 0 "" -- bash -c '[ -n "$1" ] && [ "$1" != "$2" ]' _ "$b2cap" "$("$FITLLM" generate "$B2T" "${B2GEN[@]}" 2>/dev/null)"
mkdir -p "$T/b2t5r" && cp -r "$T/b2t5s/step-000008" "$T/b2t5r/"
for w in merged:"$T/b2t5m" step:"$T/b2t5s/step-000008" run:"$T/b2t5r"; do
    expect "blip2_generate_lora_${w%%:*}" 0 "^$b2cap\$" -- "$FITLLM" generate "${w#*:}" "${B2GEN[@]}"
done
expect blip2_generate_adapter 0 "^$b2cap\$" -- "$FITLLM" generate "$B2T" --adapter "$T/b2t5s/final/adapter" "${B2GEN[@]}"
expect blip2_generate_final_own_adapter 2 "already has the adapter .*final/adapter merged in" -- "$FITLLM" generate "$T/b2t5s/final" --adapter "$T/b2t5s/final/adapter" "${B2GEN[@]}"
expect blip2_merge_lora_not_blip2_base 2 "the adapter's base model '.*golden-opt' is not a BLIP-2 folder" -- "$FITLLM" merge_lora "$T/b2t5s/step-000008" --base tests/fixtures/golden-opt --out_dir "$T/b2x"
expect blip2_t5_finetune_needs_lm 2 "the Flan-T5 variant trains its language model" -- "$FITLLM" finetune_full tests/fixtures/blip2-tiny-t5 "${B2RUN[@]}" --blip2.train qformer --out_dir "$T/b2x"
printf '{"image": "one_1x1.png", "caption": "3 4"}\n{"image": "one_1x1.png"}\n' > "$T/b2bad/c.jsonl"
expect blip2_finetune_jsonl_key 1 'c.jsonl: line 2: key "text" \(or "caption"\): missing' -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --data.json_path "$T/b2bad/c.jsonl" --out_dir "$T/b2x"
# BLIP-2 memory (issue 32 item 5, src/cli/cmd_blip2_plan.c): plan runs the fine-tuning's own set-up and first step on
# the null backend, so with captions cut to train.max_seq_length (every micro-batch that long) each phase's reserved
# and live bytes per tag and the peak equal the run's memory report, for both variants: full, LoRA, the vision tower
# trained too, SGD with momentum, gradient accumulation, bf16-mixed, 8-bit AdamW, CPU offload (its host tier: below),
# activation checkpointing
for m in "$B2" tests/fixtures/blip2-tiny-t5; do
    for v in full lora vis sgd accum mixed q8 offload ckpt btrue qlora; do
        case $v in
            qlora) c=finetune_lora; x=(--lora_r 4 --quantize bnb.nf4-dq --precision bf16-true) ;;
            btrue) c=finetune_full; x=(--precision bf16-true --blip2.train vision,qformer,lm) ;;
            ckpt) c=finetune_full; x=(--train.activation_checkpointing true --blip2.train vision,qformer,lm) ;;
            full) c=finetune_full; x=() ;; lora) c=finetune_lora; x=(--lora_r 4) ;;
            q8) c=finetune_full; x=(--optimizer bnb.optim.AdamW8bit) ;;
            offload) c=finetune_full; x=(--strategy deepspeed_stage_2_offload) ;;
            mixed) c=finetune_full; x=(--precision bf16-mixed) ;;
            vis) c=finetune_full; x=(--blip2.train vision,qformer,lm) ;;
            sgd) c=finetune_full; x=(--optimizer SGD --optimizer.momentum 0.9) ;;
            accum) c=finetune_full; x=(--train.micro_batch_size 3 --train.global_batch_size 6) ;;
        esac
        px=(); [ $c = finetune_lora ] && px=(--lora)
        planned=$("$FITLLM" plan "$m" "${B2RUN[@]}" --train.max_seq_length 4 "${x[@]}" "${px[@]}" 2>&1 | awk '/^(after_|before_)/ { print; getline; print } /^peak/')
        measured=$("$FITLLM" $c "$m" "${B2RUN[@]}" --train.max_seq_length 4 --train.max_steps 2 "${x[@]}" --out_dir "$T/b2pm" 2>&1 | awk '/^host tier/ { exit } /^(after_|before_)/ { print; getline; print } /^peak/')
        expect "blip2_plan_equals_measured_${m##*-}_$v" 0 "" -- bash -c '[ "$(grep -c . <<<"$1")" = 11 ] && [ "$1" = "$2" ] || { echo "planned:"; echo "$1"; echo "measured:"; echo "$2"; exit 1; }' _ "$planned" "$measured"
    done
done
# CPU offload: the planned host tier (the optimizer state) = the run's host tier report, per tag
planned=$("$FITLLM" plan "$B2" "${B2RUN[@]}" --train.max_seq_length 4 --strategy deepspeed_stage_2_offload 2>&1 | awk '/^host \(offload\)/ { $1 = $2 = ""; print }')
measured=$("$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_seq_length 4 --train.max_steps 2 --strategy deepspeed_stage_2_offload --out_dir "$T/b2pm" 2>&1 | awk '/^host tier/ { h = 1 } h && /^peak/ { $1 = ""; print }')
expect blip2_plan_offload_host_tier 0 "" -- bash -c '[ -n "$1" ] && [ "$(echo $1)" = "$(echo $2)" ] || { echo "planned: $1"; echo "measured: $2"; exit 1; }' _ "$planned" "$measured"
# ACTS by part (the first step's arena: each part's residual stream, saved slots and norms, the adapters' share): the
# four add up to the after_fwd row's ACTS (KiB; the parts printed in MiB to 3 decimals)
b2out=$("$FITLLM" finetune_lora "$B2" "${B2RUN[@]}" --train.max_steps 1 --lora_r 4 --out_dir "$T/b2ap" 2>&1)
expect blip2_acts_by_part_sum 0 "" -- bash -c 'a=$(sed -n "s/^activations by part.*: vision ACTS \([0-9.]*\); qformer ACTS \([0-9.]*\); lm ACTS \([0-9.]*\); LoRA adapters ACTS \([0-9.]*\)$/\1 \2 \3 \4/p" <<<"$1"); t=$(awk "/^after_fwd/ && \$10 == \"KiB\" { print \$9 }" <<<"$1"); awk -v a="$a" -v t="$t" "BEGIN { n = split(a, v, \" \"); s = 0; for (i = 1; i <= n; i++) s += v[i] * 1024; d = s - t; exit !(n == 4 && v[1] > 0 && v[4] > 0 && d < 2.1 && d > -2.1) }"' _ "$b2out"
# train.memory_snapshot_interval N: the course's per-phase memory lines (allocated, the peak so far, per tag) at the
# four phases of steps 1, 2 and every N-th (8 steps, N 3: steps 1, 2, 3, 6 = 16 lines); off by default
b2out=$("$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 6 --train.memory_snapshot_interval 3 --out_dir "$T/b2ms" 2>&1)
expect blip2_memory_snapshot_interval 0 "" -- bash -c '[ "$(grep -cE "^memory step [1236] (before_fwd|after_fwd|after_bwd|after_opt_step) +allocated [0-9.]+ KiB, peak [0-9.]+ KiB: PARAMS" <<<"$1")" = 16 ] && [ "$(grep -c "^memory step" <<<"$1")" = 16 ]' _ "$b2out"
expect blip2_memory_snapshot_off 1 "" -- grep -q "^memory step" <<<"$("$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 2 --out_dir "$T/b2ms2" 2>&1)"
# step checkpoints and resume (train.save_interval, --resume PATH|true|auto): out_dir/step-N is an HF BLIP-2 folder
# (under LoRA the PEFT adapter) + training_state.safetensors + COMMITTED; a run resumed from step 3 gives steps 4-6
# and the final weights of the uninterrupted run bit for bit (OPT and T5 x full AdamW with clipping, LoRA with
# dropout, bf16-mixed, SGD + momentum, the vision tower trained, 8-bit AdamW, SGD + momentum offloaded to the host); a
# checkpoint of another run is refused by name
for m in "$B2" tests/fixtures/blip2-tiny-t5; do
    for v in full lora mixed sgd q8 offload btrue qlora vis; do
        case $v in
            qlora) c=finetune_lora; x=(--lora_r 4 --lora_dropout 0.1 --quantize bnb.nf4) ;;
            btrue) c=finetune_full; x=(--precision bf16-true --train.max_norm 1.0 --blip2.train vision,qformer,lm) ;;
            full) c=finetune_full; x=(--train.max_norm 1.0) ;; lora) c=finetune_lora; x=(--lora_r 4 --lora_dropout 0.1) ;;
            q8) c=finetune_full; x=(--optimizer bnb.optim.AdamW8bit) ;;
            offload) c=finetune_full; x=(--strategy deepspeed_stage_1_offload --optimizer SGD --optimizer.momentum 0.9) ;;
            mixed) c=finetune_full; x=(--precision bf16-mixed) ;; sgd) c=finetune_full; x=(--optimizer SGD --optimizer.momentum 0.9) ;;
            vis) c=finetune_full; x=(--blip2.train vision,qformer,lm) ;;
        esac
        RR=("${B2RUN[@]}" --train.max_steps 6 --train.global_batch_size 4 "${x[@]}")
        rm -rf "$T/b2ra" "$T/b2rb"
        a=$("$FITLLM" $c "$m" "${RR[@]}" --train.save_interval 3 --out_dir "$T/b2ra" 2>&1 | grep '^step [4-6]/')
        b=$("$FITLLM" $c "$m" "${RR[@]}" --resume "$T/b2ra/step-000003" --out_dir "$T/b2rb" 2>&1 | grep '^step [4-6]/')
        expect "blip2_resume_bit_identical_${m##*-}_$v" 0 "" -- bash -c '[ "$(grep -c . <<<"$1")" = 3 ] && [ "$1" = "$2" ] && cmp "$3/final/model.safetensors" "$4/final/model.safetensors" && { [ ! -d "$3/final/adapter" ] || cmp "$3/final/adapter/adapter_model.safetensors" "$4/final/adapter/adapter_model.safetensors"; } || { echo "$1 / $2"; exit 1; }' _ "$a" "$b" "$T/b2ra" "$T/b2rb"
    done
done
expect blip2_step_checkpoint_loads 0 "^loss [0-9.]+  ppl" -- "$FITLLM" loss "$T/b2ra/step-000003" --image "$IMG/palette_45x31.png" --tokens-file "$T/t5src.txt" --target-tokens-file "$T/t5tgt.txt"
expect blip2_resume_true_newest 0 "Resuming training from .*b2ra/step-000006 \(step 6\)" -- "$FITLLM" finetune_full tests/fixtures/blip2-tiny-t5 "${B2RUN[@]}" --train.max_steps 6 --train.global_batch_size 4 --blip2.train vision,qformer,lm --resume true --out_dir "$T/b2ra"
# logs/metrics.csv (LitGPT's columns): one row per step; the resume from the last step keeps rows 1-6 once each
# (iter counts the micro-batches: 2 a step at global batch 4, micro-batch 2)
expect blip2_metrics_rows_kept_on_resume 0 "" -- bash -c '[ "$(awk -F, "NR > 1 && \$4 != \"\" { printf \"%s \", \$1 }" "$1")" = "2 4 6 8 10 12 " ]' _ "$T/b2ra/logs/metrics.csv"
# the resume checks of the trainer (src/train/resume_check.c) with BLIP-2's model and keys: refused with the key, both
# values and the way on (exit 2), notes for what only changes the steps to come
B2T5=(finetune_full tests/fixtures/blip2-tiny-t5 "${B2RUN[@]}")
expect blip2_resume_other_parts 2 "the checkpoint's run had blip2.train vision,qformer,lm, this run gives qformer,lm \(the saved state holds those parts' weights and optimizer state\)\. Resume it with the checkpoint's settings \(--blip2.train vision,qformer,lm\)" -- "$FITLLM" "${B2T5[@]}" --resume "$T/b2ra/step-000003" --out_dir "$T/b2x"
expect blip2_resume_other_optimizer 2 "the checkpoint's run had optimizer AdamW, this run gives SGD \(the saved state is that optimizer's\)" -- "$FITLLM" "${B2T5[@]}" --blip2.train vision,qformer,lm --optimizer SGD --resume "$T/b2ra/step-000003" --out_dir "$T/b2x"
expect blip2_resume_other_data 2 "the checkpoint's run had data.val_split_fraction 0.05, this run gives 0.25 \(it decides which samples train" -- "$FITLLM" "${B2T5[@]}" --blip2.train vision,qformer,lm --data.val_split_fraction 0.25 --resume "$T/b2ra/step-000003" --out_dir "$T/b2x"
expect blip2_resume_other_seed 2 "the checkpoint's run had seed 1337, this run gives 3 \(it shuffles the captions" -- "$FITLLM" "${B2T5[@]}" --blip2.train vision,qformer,lm --seed 3 --resume "$T/b2ra/step-000003" --out_dir "$T/b2x"
expect blip2_resume_other_model 2 "the checkpoint was trained from model 'tests/fixtures/blip2-tiny-t5', this run's model is 'tests/fixtures/blip2-tiny-opt', another architecture \(its config.json: text_config.model_type t5 there, opt here\)" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --blip2.train vision,qformer,lm --resume "$T/b2ra/step-000003" --out_dir "$T/b2x"
expect blip2_resume_lr_said 0 "note: --resume: the checkpoint's run had optimizer.lr 0.003, this run gives 0.002: the resumed steps' learning-rate" -- "$FITLLM" "${B2T5[@]}" --blip2.train vision,qformer,lm --train.max_steps 4 --optimizer.lr 0.002 --resume "$T/b2ra/step-000003" --out_dir "$T/b2lr"
rm -rf "$T/b2unc" && cp -r "$T/b2ra/step-000003" "$T/b2unc" && rm "$T/b2unc/COMMITTED"
expect blip2_resume_not_committed 2 "--resume .*b2unc: not a committed checkpoint \(no COMMITTED file\)" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --resume "$T/b2unc" --out_dir "$T/b2x"
# final/ as the trainer's: full fine-tuning's holds the training state (--resume final/ goes on), a LoRA run's the
# merged model and its adapter only (refused by name)
expect blip2_resume_final 0 "Resuming training from .*b2ra/final \(step 6\)" -- "$FITLLM" "${B2T5[@]}" --blip2.train vision,qformer,lm --train.max_steps 7 --train.global_batch_size 4 --resume "$T/b2ra/final" --out_dir "$T/b2fin"
"$FITLLM" finetune_lora "$B2" "${B2RUN[@]}" --train.max_steps 1 --out_dir "$T/b2lf" >/dev/null 2>&1
expect blip2_resume_lora_final_no_state 2 "--resume .*b2lf/final: no training state \(training_state.safetensors\) there: a LoRA run's final/ folder holds the merged model and its adapter only" -- "$FITLLM" finetune_lora "$B2" "${B2RUN[@]}" --resume "$T/b2lf/final" --out_dir "$T/b2x"
expect blip2_resume_true_none 2 "--resume true: .*b2none: no such output folder" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --resume true --out_dir "$T/b2none"
expect blip2_resume_auto_none 0 "^step 8/8 loss" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --resume auto --out_dir "$T/b2none"
# a full disk while saving (fault injection: every write after step 1's checkpoint fails) as the trainer's: the error
# names the last committed checkpoint and --resume auto; nothing of the failed save is left (the temporary folder
# removed), the committed step whole with its hyperparameters.yaml (tests/test_blip2_entry.c sweeps every write)
expect blip2_disk_full_names_checkpoint 1 "error: saving checkpoint .*/b2df/step-000002: .*No space left on device; the last committed checkpoint is '.*/b2df/step-000001' \(to continue from it, run the same command with --resume auto\)" -- \
    env FITLLM_FAULT_DISK_FULL_AFTER_STEP=1 "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 3 --train.save_interval 1 --out_dir "$T/b2df"
expect blip2_disk_full_leaves_nothing 0 "" -- bash -c '[ "$(ls -A "$1" | tr "\n" " ")" = "logs step-000001 " ] && [ -f "$1/step-000001/COMMITTED" ] && [ -f "$1/step-000001/hyperparameters.yaml" ] || { ls -A "$1"; exit 1; }' _ "$T/b2df"
# validation (data.val_split_fraction: the last floor(n f) shuffled records, random_split's lengths): the val loss every
# eval.interval steps and the final evaluation; the training split is what resume checks
b2out=$("$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --data.val_split_fraction 0.25 --eval.interval 2 --out_dir "$T/b2val" 2>&1)
expect blip2_val_split 0 "^11 train / 3 val records \(data.val_split_fraction 0.25\)" -- printf '%s\n' "$b2out"
expect blip2_val_every_interval 0 "" -- bash -c '[ "$(grep -cE "^step [246] val loss [0-9.]+$" <<<"$1")" = 3 ]' _ "$b2out"
expect blip2_val_final 0 "^Final evaluation \| val loss: [0-9.]+ \| val ppl: [0-9.]+" -- printf '%s\n' "$b2out"
# metrics.csv of the validated run: 8 step rows (loss, iter_time, learning_rate, the step's caption targets) and the
# val_loss rows of steps 2, 4, 6 and the final evaluation
expect blip2_metrics_csv 0 "" -- bash -c 'h=$(head -1 "$1"); [ "${h%%,mem_params*}" = "iter,step,epoch,loss,iter_time,tokens,total_tokens,learning_rate,val_loss,val_ppl,tok_s" ] && [ "$(awk -F, "NR > 1 && \$4 != \"\" && \$5 > 0 && \$6 > 0 && \$8 > 0" "$1" | wc -l)" = 8 ] && [ "$(awk -F, "NR > 1 && \$9 != \"\" { printf \"%s \", \$2 }" "$1")" = "2 4 6 8 " ]' _ "$T/b2val/logs/metrics.csv"
# one schema for BLIP-2 and language-model runs (README "Logs and metrics"), LitGPT's meanings: iter counts the
# micro-batches, step the optimizer steps done after it (0 before the first step ends), tokens this rank's share of
# total_tokens (one rank: equal); at global batch 4 of micro-batches of 2 the LM logs iters 1 (step 0) and 2 (step 1),
# BLIP-2 (a row per step) iter 2 at step 1, 4 at step 2
"$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 2 --train.global_batch_size 4 --out_dir "$T/b2sch" >/dev/null 2>&1
"$FITLLM" finetune_full micro --data.n_train 20 --data.n_val 2 --train.micro_batch_size 2 --train.global_batch_size 4 \
    --train.max_steps 2 --train.max_seq_length 32 --eval.max_new_tokens 0 --out_dir "$T/lmsch" >/dev/null 2>&1
expect metrics_schema_lm_blip2 0 "" -- bash -c '[ "$(head -1 "$1")" = "$(head -1 "$2")" ] &&
    [ "$(awk -F, "NR > 1 && \$4 != \"\" && \$6 == \$7 { printf \"%s:%s \", \$1, \$2 }" "$1")" = "2:1 4:2 " ] &&
    [ "$(awk -F, "NR > 1 && \$4 != \"\" && \$6 == \$7 { printf \"%s:%s \", \$1, \$2 }" "$2")" = "1:0 2:1 3:1 4:2 " ]' \
    _ "$T/b2sch/logs/metrics.csv" "$T/lmsch/logs/metrics.csv"
# the lab's real shapes anywhere: blip2-opt-2.7b at micro batch 8 fits 80 GB (32 is the largest micro-batch of a global
# 64: the frozen vision tower saves no activations), 64 at once is out of memory (the course's baseline 64/1 32-true
# OOM: 81.57 GB planned, the arena's WORKSPACE the allocation that fails); refusals name the option
expect blip2_plan_opt27b_fits 0 "largest micro_batch_size that fits: 32 \(accumulation 2 for global batch 64\)" -- "$FITLLM" plan blip2-opt-2.7b --device-memory 80GB --train.micro_batch_size 8 --train.global_batch_size 64
expect blip2_plan_opt27b_64_oom 3 "OUT OF MEMORY during setup \(before_fwd\): WORKSPACE for BLIP-2 activations for B=64" -- "$FITLLM" plan Salesforce/blip2-opt-2.7b --device-memory 80GB --train.micro_batch_size 64 --train.global_batch_size 64
expect blip2_plan_json 0 '"source": "BLIP-2 preset"' -- "$FITLLM" plan blip2-micro --json
expect blip2_plan_fsdp_rank 0 "FULL_SHARD over 2 ranks: each rank holds its shard of every part" -- "$FITLLM" plan "$B2" --devices 2 --strategy fsdp
expect blip2_plan_ddp_rank 0 "DDP over 2 ranks: each rank holds the whole model" -- "$FITLLM" plan "$B2" --devices 2
# --help's BLIP-2 paragraph names what fine-tuning runs (bf16-true, FULL_SHARD / ZeRO-3, HYBRID_SHARD, parameter and
# NVMe offload) and the strategy auto rule the plan above and the run follow (DDP)
expect blip2_help_current 0 "" -- bash -c 'h=$("$1" finetune_full --help | sed -n "/BLIP-2 folders/,/exit codes/p"); for w in "32-true, bf16-true or bf16-mixed" "FSDP FULL_SHARD" HYBRID_SHARD "parameter offload" deepspeed_stage_3_offload_nvme "strategy auto is DDP here"; do grep -q -- "$w" <<<"$h" || { echo "lacks: $w"; exit 1; }; done' _ "$FITLLM"
expect blip2_plan_refuses_target_len 2 "--target-len: a BLIP-2 plan sizes the caption with --seq-len" -- "$FITLLM" plan blip2-micro --target-len 8
expect blip2_plan_seq_len 0 "captions of 7 tokens" -- "$FITLLM" plan "$B2" --seq-len 7
# bench-step times fine-tuning steps on random pixels and captions (the folder's weights, or a preset's random ones)
expect blip2_bench_step 0 "^RESULT impl=fitllm shape=.*blip2-tiny-opt median_ms=[0-9.]+ tok_s=[0-9.]+ images_s=" -- "$FITLLM" bench-step "$B2" --micro-batch 2 --seq 6 --steps 2 --warmup 1
expect blip2_bench_step_t5_lora 0 "trains lm \(LoRA\)" -- "$FITLLM" bench-step tests/fixtures/blip2-tiny-t5 --micro-batch 2 --seq 6 --steps 1 --warmup 0 --lora 4
expect blip2_bench_step_act_ckpt 0 "AdamW, trains .*, activation checkpointing" -- "$FITLLM" bench-step blip2-micro --micro-batch 1 --seq 4 --steps 1 --warmup 0 --act-ckpt
expect blip2_bench_step_refuses_quantize 2 "--quantize: BLIP-2 steps run 32-true, bf16-true or bf16-mixed without quantization" -- "$FITLLM" bench-step blip2-micro --lora 4 --quantize bnb.nf4
expect blip2_bench_step_refuses_16_true 2 "--precision: BLIP-2 steps run 32-true, bf16-true or bf16-mixed" -- "$FITLLM" bench-step blip2-micro --precision 16-true
expect blip2_bench_step_bf16_true 0 "bf16-true, AdamW" -- "$FITLLM" bench-step blip2-micro --micro-batch 1 --seq 4 --steps 1 --warmup 0 --precision bf16-true
expect blip2_bench_step_bf16_mixed 0 "bf16-mixed, AdamW" -- "$FITLLM" bench-step blip2-micro --micro-batch 1 --seq 4 --steps 1 --warmup 0 --precision bf16-mixed
# T5 folders (issue 31): tokenizer.json (Unigram) and a folder with only spiece.model give HF's ids
expect tokenize_t5_folder 0 "^63 46 9 153 123 499 1$" -- "$FITLLM" tokenize tests/fixtures/t5-tok --text "Hello  world <extra_id_0>"
mkdir -p "$T/t5spm" && cp tests/fixtures/t5-tok/spiece.model "$T/t5spm/"
expect tokenize_t5_spiece_only 0 "^63 46 9 153 123 499 1$" -- "$FITLLM" tokenize "$T/t5spm" --text "Hello  world <extra_id_0>"
expect tokenize_t5_info 0 "kind spm-unigram, vocab 500, bos -1, eos 1, pad 0" -- "$FITLLM" tokenize "$T/t5spm" --text x --info
expect tokenize_t5_decode 0 "^Hello world$" -- "$FITLLM" tokenize "$T/t5spm" --decode "63 46 9 153 123 499 1" --skip-special 1
printf 'garbage' > "$T/t5spm/spiece.model"
expect tokenize_t5_bad_spiece 1 "t5spm/spiece.model: " -- "$FITLLM" tokenize "$T/t5spm" --text x
expect tokenize_decode_out_of_range 2 "token id 99999 \(position 2\) is outside the vocabulary of [0-9]+ ids" -- "$FITLLM" tokenize bytes --decode "65 99999"
expect finetune_zero_batch 2 "must be positive" -- "$FITLLM" finetune_full micro --train.micro_batch_size 0 --out_dir "$T/x4"
expect finetune_lora_ok 0 "Saved the PEFT adapter" -- "$FITLLM" finetune_lora micro --train.max_steps 3 --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/lora" --quiet
expect finetune_qlora_ok 0 "Saved the PEFT adapter" -- "$FITLLM" finetune_lora micro --quantize bnb.nf4-dq --precision bf16-true --train.max_steps 3 --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/l2" --quiet
expect finetune_qlora_mixed 2 "quantization and mixed precision" -- "$FITLLM" finetune_lora micro --quantize bnb.nf4 --precision bf16-mixed --out_dir "$T/l2b"
expect finetune_qlora_bad_mode 2 "nf4" -- "$FITLLM" finetune_lora micro --quantize bnb.int8 --out_dir "$T/l2c"
expect finetune_lora_bad_r 2 "lora_r must be positive" -- "$FITLLM" finetune_lora micro --lora_r 0 --out_dir "$T/l3"
expect finetune_lora_bad_target 2 "valid" -- "$FITLLM" finetune_lora micro --lora_target_modules qq_proj --out_dir "$T/l4"
expect finetune_lora_head_tied 2 "lm_head is tied to the input embeddings" -- "$FITLLM" finetune_lora micro --lora_head true --out_dir "$T/l5"
expect finetune_precision_unknown 2 "16-mixed" -- "$FITLLM" finetune_full micro --precision 8-true --out_dir "$T/x5"
# T5 training (issue 31 item 2): finetune_full / finetune_lora of an encoder-decoder on JSON input/output pairs
# (tests/fixtures/t5-pairs/README.md): the loss falls, resume ends on the uninterrupted run's bits, the final folders
# load back (loss, generate), LoRA with T5's module names merges; what is not supported is refused at set-up
mkdir -p "$T/t5m" && cp tests/fixtures/t5-tok/spiece.model tests/fixtures/t5-tok/tokenizer.json tests/fixtures/t5-tok/tokenizer_config.json "$T/t5m/"
sed 's/"vocab_size": 97/"vocab_size": 500/' tests/fixtures/t5-tiny-gated/config.json > "$T/t5m/config.json"
T5A=(--checkpoint_dir "$T/t5m" --init random --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json
     --train.max_steps 20 --train.epochs 100 --train.global_batch_size 4 --train.micro_batch_size 2 --train.log_interval 2
     --optimizer.lr 3e-3 --train.lr_warmup_steps 2 --train.save_interval 10)
expect t5_finetune_full 0 "source/target pairs from .*longest source 40, target 15 tokens" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5run"
t5_losses=$(awk -F, 'NR > 1 && $4 != "" { print $4 }' "$T/t5run/logs/metrics.csv" 2>/dev/null)
t5_first=$(head -1 <<<"$t5_losses"); t5_last=$(tail -1 <<<"$t5_losses")
expect t5_finetune_loss_falls 0 "" -- awk -v a="$t5_first" -v b="$t5_last" 'BEGIN { exit !(a > 6.0 && b < a - 1.0) }'
mkdir -p "$T/t5res" && cp -r "$T/t5run/step-000010" "$T/t5res/"
expect t5_finetune_resume 0 "Resuming training from .*step-000010 \(step 10, iter 20\)" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5res" --resume auto
expect t5_finetune_resume_bitexact 0 "" -- cmp "$T/t5run/final/model.safetensors" "$T/t5res/final/model.safetensors"
expect t5_finetune_loss_back 0 "^loss [0-9.]+  ppl .* model .*t5run/final" -- "$FITLLM" loss "$T/t5run/final" --tokens-file "$T/t5src.txt" --target-tokens-file "$T/t5tgt.txt"
expect t5_finetune_generate 0 "source \+ 5 new tokens \(greedy" -- "$FITLLM" generate "$T/t5run/final" --prompt "question: what is two plus two?" --max_new_tokens 5 --temperature 0
# several --prompt: one batch (the sources padded and masked); each line = that prompt decoded alone
t5_p=("question: what is two plus two?" "question: what colour is the sky?" "hi")
t5_alone=$(for p in "${t5_p[@]}"; do "$FITLLM" generate "$T/t5run/final" --prompt "$p" --max_new_tokens 6 --temperature 0 2>/dev/null; done)
expect t5_generate_batch 0 "3 sources \(longest [0-9]+ tokens, padded\) \+ [0-9]+ new tokens at most \(greedy\)" -- "$FITLLM" generate "$T/t5run/final" --prompt "${t5_p[0]}" --prompt "${t5_p[1]}" --prompt "${t5_p[2]}" --max_new_tokens 6 --temperature 0
expect t5_generate_batch_rows_alone 0 "" -- bash -c '[ "$(printf "%s\n" "$1" | wc -l)" = 3 ] && [ "$1" = "$("$2" generate "$3" --prompt "$4" --prompt "$5" --prompt "$6" --max_new_tokens 6 --temperature 0 2>/dev/null)" ]' _ "$t5_alone" "$FITLLM" "$T/t5run/final" "${t5_p[@]}"
# the source ends with </s> as transformers' tokenizer(text) ends it (the ids `tokenize` prints) and as training's
# sources do; an empty prompt is the source [</s>] (it was refused: "encodes to no tokens")
t5_n=$("$FITLLM" tokenize "$T/t5m" --text "question: what is two plus two?" 2>/dev/null | wc -w)
expect t5_generate_source_ends_with_eos 0 "^$t5_n source \+ 5 new tokens" -- "$FITLLM" generate "$T/t5run/final" --prompt "question: what is two plus two?" --max_new_tokens 5 --temperature 0
expect t5_generate_empty_prompt 0 "^1 source \+ 3 new tokens" -- "$FITLLM" generate "$T/t5run/final" --prompt "" --max_new_tokens 3 --temperature 0
expect t5_generate_batch_decoder_only 2 "2 --prompt: several prompts are decoded as one batch for an encoder-decoder \(T5\) only" -- "$FITLLM" generate micro --prompt a --prompt b --max_new_tokens 2
expect t5_finetune_lora 0 "Saved the PEFT adapter" -- "$FITLLM" finetune_lora "${T5A[@]}" --out_dir "$T/t5lora" --lora_query true --lora_key true --lora_value true --lora_projection true --lora_mlp true
# a LoRA run on random weights (--init random) keeps them once in out_dir/base, which its adapters name: a step
# checkpoint generates and merges, and the last step's adapter (final/adapter's) merged into base/ is final/ byte for byte
expect_saved t5_lora_random_base_said 0 "note: the base model's weights are random \(--init random, seed 1337\): saved once to '.*t5lora/base'" "$EXPECT_OUT" "$EXPECT_RC"
expect t5_lora_random_base_named 0 '"base_model_name_or_path": ".*/t5lora/base"' -- cat "$T/t5lora/step-000010/adapter_config.json"
expect t5_lora_random_base_generate 0 "is a LoRA adapter: base model .*t5lora/base with it merged" -- "$FITLLM" generate "$T/t5lora/step-000010" --prompt hi --max_new_tokens 3
expect t5_lora_random_base_merge 0 "" -- bash -c '"$1" merge_lora "$2/step-000020" --out_dir "$3" >/dev/null && cmp "$3/model.safetensors" "$2/final/model.safetensors"' _ "$FITLLM" "$T/t5lora" "$T/t5lora-m"
# an adapter of an older fitllm names the --init random folder (config.json alone): refused, saying why
cp -r "$T/t5lora/step-000010" "$T/t5old" && sed -i "s|\"base_model_name_or_path\": \"[^\"]*\"|\"base_model_name_or_path\": \"$T/t5m\"|" "$T/t5old/adapter_config.json"
expect t5_lora_old_random_base 2 "the base model '.*t5m' \(base_model_name_or_path\) is a model shape without weights .*init random, seed 1337" -- "$FITLLM" merge_lora "$T/t5old" --out_dir "$T/t5old-m"
expect t5_finetune_lora_targets 0 '"target_modules": \["q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"\]' -- cat "$T/t5lora/final/adapter/adapter_config.json"
# a LoRA run (dropout 0.1: its masks are seeded by the global micro-batch) resumed from step 10 ends on the
# uninterrupted run's adapter bits
T5L=("${T5A[@]}" --lora_query true --lora_value true --lora_mlp true --lora_dropout 0.1)
expect t5_lora_dropout_run 0 "Saved the PEFT adapter" -- "$FITLLM" finetune_lora "${T5L[@]}" --out_dir "$T/t5lr"
mkdir -p "$T/t5lr2" && cp -r "$T/t5lr/step-000010" "$T/t5lr2/"
expect t5_lora_resume 0 "Resuming training from .*step-000010 \(step 10, iter 20\)" -- "$FITLLM" finetune_lora "${T5L[@]}" --out_dir "$T/t5lr2" --resume auto
expect t5_lora_resume_bitexact 0 "" -- cmp "$T/t5lr/final/adapter/adapter_model.safetensors" "$T/t5lr2/final/adapter/adapter_model.safetensors"
expect t5_finetune_lora_task_type 0 '"task_type": "SEQ_2_SEQ_LM"' -- cat "$T/t5lora/final/adapter/adapter_config.json"
expect t5_finetune_lora_generate 0 "source \+ 5 new tokens \(greedy" -- "$FITLLM" generate "$T/t5lora/final" --prompt "question: what colour is the sky?" --max_new_tokens 5 --temperature 0
expect t5_finetune_truncates 0 "8 sources, 7 targets truncated\); longest source 8, target 4 tokens" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5trunc" --train.max_steps 1 --data.max_source_length 8 --data.max_target_length 4
# the evaluation sample of an encoder-decoder: the instruction as the source, sampled at temperature 0.8 inside the
# training arena; the final evaluation's sample is `fitllm generate` on the final weights with the run's seed (1337),
# a sample past the arena is skipped naming the sizes, and the weights equal those of that run (the sample trains nothing)
T5E=("${T5A[@]}" --train.max_steps 4 --train.save_interval 0 --data.val_split_fraction 0.25 --eval.interval 2)
t5_sample=$("$FITLLM" finetune_full "${T5E[@]}" --eval.max_new_tokens 5 --out_dir "$T/t5ev" 2>&1 | grep -A1 "^Recommend a movie" | tail -1)
expect t5_eval_sample_is_generate 0 "" -- bash -c '[ -n "$1" ] && [ "$1" = "$("$2" generate "$3" --prompt "Recommend a movie for me to watch during the weekend and explain the reason." --max_new_tokens 5 --temperature 0.8 --seed 1337 2>/dev/null)" ]' _ "$t5_sample" "$FITLLM" "$T/t5ev/final"
expect t5_eval_sample_skipped 0 "sample generation skipped: a source of [0-9]+ tokens and eval.max_new_tokens 50 do not fit the training arena's source 40 / target 15 tokens" -- "$FITLLM" finetune_full "${T5E[@]}" --eval.max_new_tokens 50 --out_dir "$T/t5ev2"
expect t5_eval_sample_trains_nothing 0 "" -- cmp "$T/t5ev/final/model.safetensors" "$T/t5ev2/final/model.safetensors"
expect t5_finetune_refuses_qlora_mixed 2 "quantize 'bnb.nf4' with precision 'bf16-mixed': quantization and mixed precision are not supported together" -- "$FITLLM" finetune_lora "${T5A[@]}" --out_dir "$T/t5x2" --quantize bnb.nf4 --precision bf16-mixed
expect t5_finetune_refuses_synthetic 2 "trains on input/output pairs: give --data JSON.*--data Synthetic is not supported" -- "$FITLLM" finetune_full --checkpoint_dir "$T/t5m" --init random --out_dir "$T/t5x3"
# T5 precisions and optimizers (issue 31 item 2): bf16-mixed (tests/test_t5_prec.c: within 2 x PyTorch autocast's
# bf16 error), 8-bit AdamW, QLoRA on NF4 (the dequantized model's logits and adapter gradients) train and the loss
# falls; bf16-true (bf16 storage: tests/test_t5_bf16true.c, the bf16-mixed pass's bits and bf16(its gradients)) too,
# its peaks per tag = plan's; 16-mixed / 16-true likewise (tests/test_t5_prec.c: within 2 x PyTorch's fp16 autocast
# error, overflowing steps skipped), QLoRA under 16-true and bf16-true too
T5Q=(--train.max_steps 12 --train.save_interval 0 --overwrite true)
for v in bf16mixed bf16true adam8bit qlora fp16mixed fp16true qlorabf16true qlorafp16true; do
    case $v in
        bf16mixed) cmd=finetune_full; extra=(--precision bf16-mixed) ;;
        bf16true) cmd=finetune_full; extra=(--precision bf16-true) ;;
        adam8bit) cmd=finetune_full; extra=(--optimizer bnb.optim.AdamW8bit) ;;
        qlora) cmd=finetune_lora; extra=(--quantize bnb.nf4-dq --lora_mlp true --optimizer.lr 1e-2) ;;
        fp16mixed) cmd=finetune_full; extra=(--precision 16-mixed) ;;
        fp16true) cmd=finetune_full; extra=(--precision 16-true) ;;
        qlorabf16true) cmd=finetune_lora; extra=(--quantize bnb.nf4-dq --lora_mlp true --lora_query true --lora_value true
                                                 --optimizer.lr 2e-2 --train.max_steps 20 --precision bf16-true) ;;
        qlorafp16true) cmd=finetune_lora; extra=(--quantize bnb.fp4 --lora_mlp true --lora_query true --lora_value true
                                                 --optimizer.lr 2e-2 --train.max_steps 20 --precision 16-true) ;;
    esac
    expect "t5_finetune_$v" 0 "Saved|saved" -- "$FITLLM" $cmd "${T5A[@]}" "${T5Q[@]}" "${extra[@]}" --out_dir "$T/t5$v"
    l=$(awk -F, 'NR > 1 && $4 != "" { print $4 }' "$T/t5$v/logs/metrics.csv" 2>/dev/null)
    expect "t5_finetune_${v}_loss_falls" 0 "" -- awk -v a="$(head -1 <<<"$l")" -v b="$(tail -1 <<<"$l")" 'BEGIN { exit !(a > 6.0 && b < a - 0.3) }'
done
t5_planned=$("$FITLLM" plan "${T5A[@]}" --precision bf16-true --data.max_source_length 40 --data.max_target_length 15 2>/dev/null |
             awk '/^peak +reserved/ { for (i = 3; i <= 16; i += 2) printf "%s %s,", $i, $(i + 1) }')
"$FITLLM" finetune_full "${T5A[@]}" "${T5Q[@]}" --train.max_steps 2 --precision bf16-true --out_dir "$T/t5bp" >"$T/t5bp.log" 2>&1
t5_measured=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER) / { printf "%s %s,", $4, $5 }' "$T/t5bp.log")
expect t5_bf16true_peaks_equal_plan 0 "" -- bash -c '[ -n "$1" ] && [ "$1" = "$2" ] || { echo "planned $1 measured $2"; exit 1; }' _ "$t5_planned" "$t5_measured"
expect t5_bf16true_stores_bf16 0 '"dtype":"BF16"' -- bash -c 'head -c 300 "$1" | tr -d "\\0"' _ "$T/t5bf16true/final/model.safetensors"
expect t5_finetune_qlora_loads 0 "source \+ 3 new tokens \(greedy" -- "$FITLLM" generate "$T/t5qlora/final" --prompt "question: what colour is the sky?" --max_new_tokens 3 --temperature 0
expect t5_fp16true_stores_fp16 0 '"dtype":"F16"' -- bash -c 'head -c 300 "$1" | tr -d "\\0"' _ "$T/t5fp16true/final/model.safetensors"
expect t5_finetune_qlora_fp16true_loads 0 "source \+ 3 new tokens \(greedy" -- "$FITLLM" generate "$T/t5qlorafp16true/final" --prompt "question: what colour is the sky?" --max_new_tokens 3 --temperature 0
# ZeRO-3 with the optimizer and the parameters offloaded (the sharded store gathered by the encoder-decoder passes
# unit by unit; one process: each unit copied up from the host tier / NVMe files and its gradient back): the plain
# run's weights bit for bit
mkdir -p "$T/t5nv"
for st in deepspeed_stage_3_offload fsdp_cpu_offload deepspeed_stage_3_offload_nvme; do
    extra=(); [ $st = deepspeed_stage_3_offload_nvme ] && extra=(--nvme_path "$T/t5nv")
    expect "t5_finetune_${st}" 0 "Saved|saved" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5-$st" --strategy $st "${extra[@]}"
    # the memory report names the tier of each (OPTIM was "in the offload tier"; the nvme tier's pages said to be
    # "a few pieces of host memory" the host tier showed none of)
    [ $st = deepspeed_stage_3_offload_nvme ] && expect_saved t5_nvme_report_names_tiers 0 \
        "of PARAMS and GRADS in the nvme tier below, of OPTIM in the nvme tier below;.*nvme tier \(.*mapped: the kernel pages in" \
        "$(tr '\n' ' ' <<<"$EXPECT_OUT")" "$EXPECT_RC"
    expect "t5_finetune_${st}_bitexact" 0 "" -- cmp "$T/t5run/final/model.safetensors" "$T/t5-$st/final/model.safetensors"
done
expect t5_finetune_zero3_poff_cpu 0 "Saved|saved" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5x6" --strategy deepspeed_stage_3_offload --offload_param_device cpu
expect t5_finetune_zero3_poff_cpu_bitexact 0 "" -- cmp "$T/t5run/final/model.safetensors" "$T/t5x6/final/model.safetensors"
expect t5_refuses_no_folder 2 "pretrain: an encoder-decoder" -- "$FITLLM" pretrain --model_config "$T/t5m/config.json" --tokenizer_dir "$T/t5m" --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json --out_dir "$T/t5x7"
expect t5_refused_run_leaves_no_folder 1 "" -- test -e "$T/t5x7/final"
# a validation split (data.val_split_fraction: LitGPT's random_split, tests/test_s2s.c against torch): the val loss
# at each evaluation, the final evaluation, val_loss in the metrics
expect t5_finetune_val_split 0 "8 source/target pairs .*; 6 train / 2 val pairs \(data.val_split_fraction 0.25\)" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5val" --data.val_split_fraction 0.25 --eval.interval 5 --overwrite true
expect t5_finetune_val_metrics 0 "" -- awk -F, 'NR > 1 && $9 != "" { n++; l = $9 } END { exit !(n == 4 && l > 4 && l < 6.2) }' "$T/t5val/logs/metrics.csv"
expect t5_finetune_val_final 0 "^Final evaluation \| val loss: [0-9.]+ \| val ppl" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5val2" --data.val_split_fraction 0.25 --train.max_steps 3 --eval.interval 2
# T5 memory (issue 31 item 4): plan sizes the source (--seq-len, else data.max_source_length) and the target
# (--target-len, else data.max_target_length), planned = measured per tag (tests/test_plan.c plan_equals_runtime_t5);
# a shorter source is suggested when it does not fit; bench-step times a T5 step with a source of --source-seq
expect plan_t5_lengths 0 "source 8, target 4, precision 32-true" -- "$FITLLM" plan "$T/t5m" --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json --data.max_source_length 8 --data.max_target_length 4
# train.max_seq_length (LitGPT's sample limit) caps the source in training and in the plan alike
expect t5_finetune_max_seq_length_caps_source 0 "\(8 sources, 0 targets truncated\); longest source 8, target 15 tokens" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5msl" --train.max_steps 1 --train.max_seq_length 8
expect plan_t5_max_seq_length_caps_source 0 "source 8 tokens \(train.max_seq_length\), target 4" -- "$FITLLM" plan "$T/t5m" --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json --train.max_seq_length 8 --data.max_target_length 4
expect plan_t5_len_options 0 "global batch 16, source 64, target 16," -- "$FITLLM" plan t5-small --seq-len 64 --target-len 16
expect plan_t5_needs_source 2 "an encoder-decoder \(t5-small\) needs a source length: give --seq-len or --data.max_source_length" -- "$FITLLM" plan t5-small --data.max_source_length 0
# (t5-small's dropout_rate 0.1 trains with dropout: its TEMP buffer, B x source x d_model floats of WORKSPACE, moved
# the suggestion from 881 to 875 tokens)
expect plan_t5_suggests_source 3 "max_seq_length +fits: --data.max_source_length 877 " -- "$FITLLM" plan t5-small --seq-len 4096 --target-len 64 --train.micro_batch_size 4 --train.global_batch_size 4 --device-memory 2GB
t5p_out=$EXPECT_OUT t5p_rc=$EXPECT_RC   # the same plan (2.6 CPU s) for the two variant checks below
expect_saved plan_t5_bf16true_variant 3 "bf16-true +does not fit: bf16 parameters" "$t5p_out" "$t5p_rc"
expect plan_t5_qlora_variant 3 "qlora +does not fit: LoRA on a 4-bit base" -- "$FITLLM" plan t5-small --seq-len 4096 --target-len 64 --train.micro_batch_size 4 --train.global_batch_size 4 --device-memory 2GB --precision bf16-mixed
expect_saved plan_t5_param_offload_variant 3 "param_offload +does not fit: the parameters, gradients and optimizer state in files" "$t5p_out" "$t5p_rc"
expect bench_step_t5 0 "t5, 238592 params, L=2\+2 C=64 .*B=2 source 24 target 16, 32-true" -- "$FITLLM" bench-step t5-micro --micro-batch 2 --seq 16 --source-seq 24 --steps 2 --warmup 1 --threads 2
# --dropout: the step with config.json's dropout as fine-tuning applies it (T5's 0.1 on every site); a model without
# dropout of its own and BLIP-2's steps refuse it by name
expect bench_step_t5_dropout 0 "32-true, AdamW, dropout 0.1 / attention 0.1, " -- "$FITLLM" bench-step t5-micro --micro-batch 2 --seq 16 --source-seq 24 --steps 2 --warmup 1 --threads 2 --dropout
# the profile times the dropout kernels too (its "elementwise" group; T5 / OPT / BLIP-2 training with dropout)
expect bench_step_t5_dropout_profile 0 "    dropout +[0-9.]+ +[0-9.]+% +[1-9]" -- "$FITLLM" bench-step t5-micro --micro-batch 2 --seq 16 --source-seq 24 --steps 1 --warmup 0 --threads 2 --dropout --profile
expect bench_step_dropout_refused 2 "LLaMA has no dropout of its own" -- "$FITLLM" bench-step micro --dropout --steps 1
expect bench_step_blip2_dropout_refused 2 "--dropout: BLIP-2 steps run" -- "$FITLLM" bench-step blip2-micro --dropout --steps 1
expect bench_step_source_seq_decoder_only 2 "--source-seq: micro is not an encoder-decoder" -- "$FITLLM" bench-step micro --source-seq 4 --steps 1
expect t5_finetune_act_ckpt 0 "precision 32-true, activation checkpointing" -- "$FITLLM" finetune_full "${T5A[@]}" --out_dir "$T/t5ckpt" --train.activation_checkpointing true
expect t5_finetune_act_ckpt_bitexact 0 "" -- cmp "$T/t5run/final/model.safetensors" "$T/t5ckpt/final/model.safetensors"
# config.json's dropout_rate: read, written back, range-checked; applied in training (tests/test_t5_dropout.c, and
# against transformers: tests/test_t5.c), which training says. The masks follow the run's seed and the global micro-batch:
# a run resumed from step 2 ends on the uninterrupted run's bits, activation checkpointing gives the same bits, and
# the weights are not those of the same run without dropout
mkdir -p "$T/t5d" && cp "$T/t5m"/* "$T/t5d/" && sed -i 's/"dropout_rate": 0.0/"dropout_rate": 0.1/' "$T/t5d/config.json"
T5D=(--init random --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json --train.max_steps 4
     --train.global_batch_size 4 --train.micro_batch_size 2 --train.save_interval 2)
expect t5_dropout_rate_noted 0 "note: config.json dropout_rate 0.1 is applied in training \(embeddings, attention weights, sublayer outputs, FFN, final norms; not in evaluation or generation\)" -- "$FITLLM" finetune_full --checkpoint_dir "$T/t5d" "${T5D[@]}" --out_dir "$T/t5dr"
mkdir -p "$T/t5dr2" && cp -r "$T/t5dr/step-000002" "$T/t5dr2/"
expect t5_dropout_resume 0 "Resuming training from .*step-000002 \(step 2, iter 4\)" -- "$FITLLM" finetune_full --checkpoint_dir "$T/t5d" "${T5D[@]}" --out_dir "$T/t5dr2" --resume auto
expect t5_dropout_resume_bitexact 0 "" -- cmp "$T/t5dr/final/model.safetensors" "$T/t5dr2/final/model.safetensors"
expect t5_dropout_act_ckpt 0 "activation checkpointing" -- "$FITLLM" finetune_full --checkpoint_dir "$T/t5d" "${T5D[@]}" --out_dir "$T/t5dr3" --train.activation_checkpointing true
expect t5_dropout_act_ckpt_bitexact 0 "" -- cmp "$T/t5dr/final/model.safetensors" "$T/t5dr3/final/model.safetensors"
expect t5_dropout_zero_run 0 "Saved|saved" -- "$FITLLM" finetune_full --checkpoint_dir "$T/t5m" "${T5D[@]}" --out_dir "$T/t5dr0"
expect t5_dropout_changes_training 1 "" -- cmp -s "$T/t5dr/final/model.safetensors" "$T/t5dr0/final/model.safetensors"
expect t5_dropout_rate_written_back 0 '"dropout_rate": 0.1,' -- cat "$T/t5dr/final/config.json"
sed -i 's/"dropout_rate": 0.1/"dropout_rate": 1.5/' "$T/t5d/config.json"
expect t5_dropout_rate_range 1 "config.json: key 'dropout_rate' = 1.5 must be in \[0, 1\)" -- "$FITLLM" loss "$T/t5d" --tokens-file "$T/t5src.txt" --target-tokens-file "$T/t5tgt.txt"
expect t5_pretrain_refused 2 "pretrain: an encoder-decoder \(t5\) is fine-tuned only" -- "$FITLLM" pretrain --model_config "$T/t5m/config.json" --tokenizer_dir "$T/t5m" --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json --out_dir "$T/t5x5"
# LitGPT recipes: a command-line value overrides the recipe's however it is spelled; names of models
R=tests/fixtures/litgpt-recipes
expect plan_recipe_devices_space 0 "FITS" -- "$FITLLM" plan llama-2-7b --config "$R/finetune/llama-2-7b/full.yaml" --devices 1 --device-memory 80GB
expect plan_recipe_devices_eq 0 "FITS" -- "$FITLLM" plan llama-2-7b --config "$R/finetune/llama-2-7b/full.yaml" --devices=auto --device-memory 80GB
expect plan_recipe_devices_4 0 "FSDP FULL_SHARD \(ZeRO-3\) over 4 ranks" -- "$FITLLM" plan llama-2-7b --config "$R/finetune/llama-2-7b/full.yaml" --device-memory 80GB
# several ranks are rehearsed as threads: too many is a clear refusal (exit 2), not the threads communicator's limit
# the run line as the run's header: the batch over the data-parallel ranks (it printed a rank's 4 as the global batch)
expect plan_devices_global_batch 0 "run: micro_batch 2 x accumulation 2 x 2 ranks = global batch 8," -- "$FITLLM" plan micro --devices 2 --train.micro_batch_size 2 --train.global_batch_size 8
expect plan_too_many_ranks 2 "4800 ranks \(devices 8 x num_nodes 600\): a plan rehearses every rank as a thread of this process, at most 4096" -- "$FITLLM" plan micro --devices 8 --num_nodes 600 --train.global_batch_size 4800
# --rank beyond a one-device run's was planned as rank 0, unsaid; an unknown model exits 2 as everywhere; a path that is
# not there is said so (not an unknown preset); --largest has no JSON form (it printed its table)
expect plan_rank_one_device 2 "plan --rank 5: the run has one rank \(0\)" -- "$FITLLM" plan micro --rank 5
expect plan_path_missing 2 "checkpoint_dir './no/such/dir': no such file or folder" -- "$FITLLM" plan ./no/such/dir
expect plan_largest_json_refused 2 "--largest prints a table only \(no JSON form yet\)" -- "$FITLLM" plan --largest tiny --json
expect plan_litgpt_model_name 0 "FITS" -- "$FITLLM" plan TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T --device-memory 80GB
# OPT (BLIP-2's language model): the plan of its real shape, a full fine-tune of the test shape saved as an HF
# folder whose loss `fitllm loss` reads back, and LoRA with OPT's module names
# 16-true (fp16 parameters) with 8-bit AdamW: planned, suggested, and trained (its step losses track plain AdamW's:
# tests/test_prec.c prec_adam8bit_16bit_params holds the update to the fp32 kernel's rounding). The plan answers
# supports_op as the planned backend does (tests/test_ops.c compares the tables).
expect plan_16true_adam8bit 0 "peak" -- "$FITLLM" plan micro --precision 16-true --optimizer bnb.optim.AdamW8bit
expect plan_16true_suggests_adam8bit 3 "adam8bit +does not fit: about 2 bytes of state" -- \
    "$FITLLM" plan micro --precision 16-true --device-memory 12MB
expect finetune_16true_adam8bit 0 "Saved the final model" -- "$FITLLM" finetune_full micro --precision 16-true \
    --optimizer bnb.optim.AdamW8bit --train.max_steps 3 --train.global_batch_size 2 --train.micro_batch_size 2 \
    --out_dir "$T/f16a8" --quiet
expect plan_opt_27b 0 "FITS" -- "$FITLLM" plan facebook/opt-2.7b --device-memory 80GB
expect finetune_opt_ok 0 "Saved the final model" -- "$FITLLM" finetune_full opt-micro --train.max_steps 2 \
    --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/opt" --quiet
echo "1 2 3 4 5 6" > "$T/opt_ids.txt"
expect loss_opt_saved 0 "loss" -- "$FITLLM" loss "$T/opt/final" --tokens-file "$T/opt_ids.txt"
expect finetune_lora_opt_targets 0 "Saved the PEFT adapter" -- "$FITLLM" finetune_lora opt-micro --lora_projection true \
    --lora_mlp true --train.max_steps 1 --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/optl" --quiet
expect finetune_lora_opt_bad_target 2 "out_proj, fc1, fc2" -- "$FITLLM" finetune_lora opt-micro --lora_target_modules o_proj \
    --out_dir "$T/optl2"
expect pretrain_unknown_model_near 2 "nearest: tinyllama-1.1b" -- "$FITLLM" pretrain --model_name tinyllama-1b --data Synthetic --out_dir "$T/o2"
expect finetune_underscore_int 0 "Saved the final model" -- "$FITLLM" finetune_full micro --train.max_tokens 10_000 --train.max_steps 1 \
    --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/us" --quiet
# options of another command are errors naming the command that takes them (never silently ignored)
# data parallel: --devices N without a launcher starts its ranks through mpirun (tests/mpi_test.sh);
# where it cannot (FITLLM_MPIRUN=none, a build without MPI, a rank of its own mpirun that sees no
# launcher) and across nodes (the hosts are unknown) it prints the exact mpirun command;
# what is not implemented yet (_HYBRID_SHARD_ZERO2, parameter offload) says so, never mapped
# onto something else
NOLAUNCH=(env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u PMI_RANK -u PMI_SIZE -u SLURM_PROCID -u RANK -u WORLD_SIZE
          -u FITLLM_LAUNCHED)
for pat in "--devices 2 asks for 2 ranks .*not started by a launcher and cannot start them itself \((FITLLM_MPIRUN=none|this fitllm was built without MPI)" \
           "^  mpirun -np 2 .*--bind-to none .*fitllm finetune_full micro --devices 2 --out_dir '?$T/d1"; do
    expect ddp_devices_without_launcher 2 "$pat" -- "${NOLAUNCH[@]}" FITLLM_MPIRUN=none "$FITLLM" finetune_full micro --devices 2 --out_dir "$T/d1"
done
if "$FITLLM" --version | grep -q "built without MPI"; then
    expect ddp_devices_needs_mpi_build 2 "built without MPI, which multi-process training needs: apt-get install openmpi-bin libopenmpi-dev" -- \
        "${NOLAUNCH[@]}" "$FITLLM" finetune_full micro --devices 2 --out_dir "$T/d1"
else
    expect ddp_self_launch_no_recursion 2 "started by fitllm's own mpirun \(FITLLM_LAUNCHED is set\) but sees no Open MPI rank variables" -- \
        "${NOLAUNCH[@]}" FITLLM_LAUNCHED=1 "$FITLLM" finetune_full micro --devices 2 --out_dir "$T/d1"
fi
for pat in "--devices 2 x --num_nodes 2 asks for 4 ranks on 2 machines, .*hostfile, one line per node \('HOST slots=2'\)" \
           "^  mpirun -np 4 --hostfile HOSTS --map-by ppr:2:node .*fitllm finetune_full micro --devices 2 --num_nodes 2 --out_dir"; do
    expect ddp_nodes_without_launcher 2 "$pat" -- "${NOLAUNCH[@]}" "$FITLLM" finetune_full micro --devices 2 --num_nodes 2 --out_dir "$T/d1"
done
# torchrun's variables: fitllm's ranks need mpirun, said at once (it advised --devices 2 first, which then said this)
expect torchrun_says_mpirun 2 "launched with torchrun-style variables \(RANK=0, WORLD_SIZE=2\) but without an MPI launcher.*start them with mpirun instead: \`mpirun -np 2 fitllm" -- \
    "${NOLAUNCH[@]}" RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 "$FITLLM" finetune_full micro --out_dir "$T/d1"
# --devices auto is this process's one device, said so, against a launcher's 2 ranks (rank 0's view: it stops before
# MPI starts); "1 rank", not "1 ranks"
expect devices_auto_under_launcher 2 "--devices 1 \(auto: this process's one CPU device\) x --num_nodes 1 = 1 rank, but Open MPI \(mpirun\) started 2: give --devices 2 .* or start 1 rank$" -- \
    "${NOLAUNCH[@]}" OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 "$FITLLM" finetune_full micro --devices auto --out_dir "$T/d1"
[ -e "$T/d1" ] && { echo "FAIL ddp_without_launcher_writes_nothing: $T/d1 exists"; fail=$((fail+1)); }
# parameter offload (issue 34 item 2): the shards of the parameters and gradients in the host tier or NVMe files;
# the memory report says so; refused with a strategy that keeps stage 3's optimizer on the device
expect deepspeed_not_yet 2 "strategy 'deepspeed' is not implemented yet" -- "$FITLLM" finetune_full micro --strategy deepspeed --out_dir "$T/d2"
expect fsdp_cpu_offload_trains 0 "host tier \(offload\) PARAMS +1015\.75 KiB" -- "$FITLLM" finetune_full micro \
    --strategy fsdp_cpu_offload --train.max_steps 2 --train.global_batch_size 2 --train.micro_batch_size 2 \
    --train.max_seq_length 32 --out_dir "$T/poff1"
mkdir -p "$T/poffn"
expect zero3_offload_nvme_trains 0 "nvme tier \(offload\) PARAMS +1015\.75 KiB" -- "$FITLLM" finetune_full micro \
    --strategy deepspeed_stage_3_offload_nvme --nvme_path "$T/poffn" --train.max_steps 2 --train.global_batch_size 2 \
    --train.micro_batch_size 2 --train.max_seq_length 32 --out_dir "$T/poff2"
[ -z "$(ls -A "$T/poffn")" ] || { echo "FAIL zero3_offload_nvme_leaves_no_file: $(ls "$T/poffn")"; fail=$((fail+1)); }
# the disk failing a write-back mid-run (an injected ENOSPC): exit 1, the error and the last committed checkpoint named
expect zero3_offload_nvme_disk_fails_mid_run 1 "No space left on device \(injected.*the last committed checkpoint is '$T/poff3/step-0000(06|08|10)'" -- \
    env FITLLM_TEST_NVME_FAIL_AFTER=300 "$FITLLM" finetune_full micro --strategy deepspeed_stage_3_offload_nvme \
    --train.max_steps 12 --train.save_interval 2 --train.global_batch_size 2 --train.micro_batch_size 2 \
    --train.max_seq_length 32 --out_dir "$T/poff3"
# the eval sample under parameter offload (host tier and NVMe files): the units fetched one by one for every decoded
# token, as training fetches them; the same weights (final checkpoints byte for byte) decode the same samples, both
# evaluations' text byte for byte, as the device-resident one-process run's (its dense generation path); not skipped
POFFE=(micro --train.max_steps 2 --train.global_batch_size 2 --train.micro_batch_size 2 --train.max_seq_length 32
       --eval.interval 1 --eval.max_new_tokens 8 --threads 1)
poff_samples() { "$FITLLM" finetune_full "${POFFE[@]}" "$@" 2>&1 | grep -a -A1 "^Recommend a movie"; }
mkdir -p "$T/poff4n"
poff_s0=$(poff_samples --out_dir "$T/poff4a")
for st in fsdp_cpu_offload deepspeed_stage_3_offload_nvme; do
    extra=(); [ $st = deepspeed_stage_3_offload_nvme ] && extra=(--nvme_path "$T/poff4n")
    # (two samples, each a prompt line and a non-empty continuation)
    expect "poff_eval_sample_${st}" 0 "" -- bash -c '[ "$(grep -a -c "^Recommend a movie" <<<"$1")" = 2 ] \
        && [ "$(grep -a -v -c -e "^Recommend a movie" -e "^--\$" -e "^\$" <<<"$1")" = 2 ] \
        && [ "$1" = "$2" ] && cmp "$3/final/model.safetensors" "$4/final/model.safetensors"' _ "$poff_s0" \
        "$(poff_samples --strategy $st "${extra[@]}" --out_dir "$T/poff4-$st")" "$T/poff4a" "$T/poff4-$st"
done
[ -z "$(ls -A "$T/poff4n")" ] || { echo "FAIL poff_eval_sample_leaves_no_file: $(ls "$T/poff4n")"; fail=$((fail+1)); }
# its memory is planned: the sample's phase is this run's peak, and the plan's peak is the budget it runs in (one byte
# less: out of memory in the evaluation)
need=$("$FITLLM" plan "${POFFE[@]}" --strategy fsdp_cpu_offload --json | grep -o '"peak": {[^}]*}' | grep -o '"total": [0-9]*' | grep -o '[0-9]*$')
expect poff_eval_sample_plan_fits 0 "Saved the final model" -- "$FITLLM" finetune_full "${POFFE[@]}" --strategy fsdp_cpu_offload \
    --out_dir "$T/poff5" --max-memory "${need}B"
expect poff_eval_sample_plan_exact 3 "out of memory during validation" -- "$FITLLM" finetune_full "${POFFE[@]}" \
    --strategy fsdp_cpu_offload --out_dir "$T/poff6" --max-memory "$((need - 1))B"
# the largest model that fits a machine: this one (23 GiB RAM, 60 GB disk), fp32 AdamW: 3B with everything on NVMe
expect plan_largest 0 "largest model that fits: open-llama-3b \(3.43 B parameters\), --strategy deepspeed_stage_3_offload_nvme" -- \
    "$FITLLM" plan --largest tiny --host-memory 23GiB --disk 60GB --train.micro_batch_size 1 --train.max_seq_length 17
expect plan_largest_gpu 0 "open-llama-13b +13.02 B parameters: fits --strategy deepspeed_stage_3_offload --offload_param_device cpu" -- \
    "$FITLLM" plan --largest tiny --accelerator cuda --device-memory 24GB --host-memory 128GB --precision bf16-true \
    --train.micro_batch_size 1 --train.max_seq_length 512
expect plan_largest_none 3 "largest model that fits: none of the presets" -- "$FITLLM" plan --largest tiny --host-memory 1GB --disk 1GB
# the DP x TP x PP grid for micro on 8 CPU ranks of 3 MiB under DDP, the evaluation sample's generation planned as the
# run makes it (DP 8 needs 5.70 MiB, PP 2 3.96, TP 2 2.98, TP 4 1.67; without the sample 4.86, 3.59, 2.52, 1.35:
# tests/test_plan_grid.c checks each against the per-rank plans); TP 8 and PP 8 are refused with the trainer's words
GRID=(micro --devices 8 --strategy ddp --train.micro_batch_size 1 --train.global_batch_size 16 --train.max_seq_length 33)
expect plan_suggest_grid 0 "suggested grid: DP 4 x TP 2 x PP 1: --tensor_parallel 2 \(largest rank 0 needs 2.98 MiB\)" -- \
    "$FITLLM" plan --suggest "${GRID[@]}" --device-memory 3MiB
expect plan_suggest_grid_generation_off 0 "suggested grid: DP 4 x TP 2 x PP 1: --tensor_parallel 2 \(largest rank 0 needs 2.52 MiB\)" -- \
    "$FITLLM" plan --suggest "${GRID[@]}" --device-memory 3MiB --generation off
expect plan_suggest_grid_refusals 0 " 1 +8 +1 .*not with this run: --tensor_parallel 8: the model's 4 key/value heads" -- \
    "$FITLLM" plan --suggest "${GRID[@]}" --device-memory 3MiB
expect plan_suggest_grid_json 0 '"suggested": \{"dp": 4, "tp": 2, "pp": 1\}' -- bash -c "'$FITLLM' plan --suggest ${GRID[*]} \
    --device-memory 3MiB --json | tr '\n' ' ' | grep '\"kind\": \"grid_suggestion\"' | grep '\"dp\": 1, \"tp\": 8, \"pp\": 1, \"verdict\": \"refused\", \"why\": \"--tensor_parallel 8'"
expect plan_suggest_grid_none 3 "suggested grid: none fits" -- "$FITLLM" plan --suggest "${GRID[@]}" --device-memory 1MiB
# CPU ranks share the host's RAM: a grid that does not fit names it (with an offload's host tier, the same RAM, added),
# and --host-memory replacing --device-memory is said, not silent
expect plan_suggest_grid_cpu_host_tier 0 " 4 +1 +2 +deepspeed_stage_2_offload +3\.03 MiB .*out of host memory: 3\.03 MiB \+ host tier 330\.38 KiB \(offload: the same RAM\) per rank > 3\.00 MiB \(the host's RAM shared by the ranks\)" -- \
    "$FITLLM" plan --suggest micro --devices 8 --strategy deepspeed_stage_2_offload --train.micro_batch_size 1 \
    --train.global_batch_size 16 --train.max_seq_length 33 --host-memory 24MiB
expect plan_suggest_grid_host_replaces_device 0 "note: --host-memory 24\.00 MiB replaces --device-memory 3\.00 MiB: a CPU rank's memory is the host's RAM \(3\.00 MiB for each of 8 rank" -- \
    "$FITLLM" plan --suggest "${GRID[@]}" --host-memory 24MiB --device-memory 3MiB
# the largest micro batch searched from the global batch down: said when that cap binds (a larger one might fit)
expect plan_largest_micro_capped 0 "largest micro_batch_size that fits: 4 \(accumulation 1 for global batch 4; capped at the global batch 4\)" -- \
    "$FITLLM" plan micro --device-memory 1GB --train.global_batch_size 4 --train.micro_batch_size 1 --train.max_seq_length 33
# a CPU run: its host tier is its device's RAM, so offloading the optimizer there frees nothing (said); the disk does
expect plan_cpu_offload_on_cpu 3 "cpu_offload +not with this run: on a CPU the device is the host's RAM.*nvme_offload +does not fit: the optimizer state \(OPTIM 1\.98 MiB\) in files on a disk" -- \
    bash -c "'$FITLLM' plan micro --device-memory 3MiB --train.global_batch_size 4 --train.micro_batch_size 1 --train.max_seq_length 33 | tr '\n' ' '; exit \${PIPESTATUS[0]}"
expect plan_suggest_grid_no_memory 2 "each rank's memory is needed \(--device-memory SIZE" -- "$FITLLM" plan --suggest "${GRID[@]}"
# the lab's grid rows (full suite): lab-7b, which no single 298 MiB device holds, split by TP 2 and PP 2; each rank's
# measured peak equals its plan (PP: the largest stage's)
expect lab_grid_rows 0 "tp-2 +lab-7b +1x4x2 +32-true +AdamW +fits +yes +([0-9.]+) +\1 .*pp-2 +lab-7b +1x4x2 +32-true +AdamW +fits +yes +[0-9.]+-([0-9.]+) +\2 " -- \
    bash -c "'$FITLLM' lab --only tp-2,pp-2 --steps 1 --out_dir '$T/lab-grid' | tr '\n' ' '"
# the 3D grid's row (TP 2 x PP 2 of lab-7b, 4 ranks as threads): the largest rank's measured peak = its plan
expect lab_grid_row_tp2_pp2 0 "tp2-pp2 +lab-7b +1x4x4 +32-true +AdamW +fits +yes +[0-9.]+-([0-9.]+) +\1 " -- \
    bash -c "'$FITLLM' lab --only tp2-pp2 --steps 1 --out_dir '$T/lab-grid3' | tr '\n' ' '"
expect plan_suggest_and_largest 2 "--largest and --suggest are two questions" -- "$FITLLM" plan --suggest --largest "${GRID[@]}" \
    --device-memory 3MiB
expect plan_largest_needs_host_memory 2 "a CPU machine needs its host memory \(--host-memory SIZE\)" -- "$FITLLM" plan --largest tiny
expect plan_largest_bad_disk 2 "--disk" -- "$FITLLM" plan --largest tiny --host-memory 8GB --disk lots
expect offload_param_device_needs_zero3_offload 2 "offload_param_device cpu offloads ZeRO-3's parameter shards.*strategy is 'deepspeed_stage_3'" -- \
    "$FITLLM" finetune_full micro --strategy deepspeed_stage_3 --offload_param_device cpu --out_dir "$T/d2"
# an option the strategy would not use is refused, never ignored (this ran plain ZeRO-3 before)
expect zero3_offload_device_needs_offload 2 "offload_optimizer_device cpu offloads the optimizer .*strategy is 'deepspeed_stage_3'.*add _offload" -- \
    "$FITLLM" finetune_full micro --strategy deepspeed_stage_3 --offload_optimizer_device cpu --out_dir "$T/d2"
expect nvme_path_needs_nvme 2 "nvme_path '$T/nvme' is the folder of offload_optimizer_device nvme" -- \
    "$FITLLM" finetune_full micro --strategy deepspeed_stage_3_offload --nvme_path "$T/nvme" --out_dir "$T/d2"
expect sharding_needs_fsdp 2 "fsdp.sharding_strategy FULL_SHARD applies to --strategy fsdp; this run's strategy is 'deepspeed_stage_2'" -- \
    "$FITLLM" finetune_full micro --strategy deepspeed_stage_2 --fsdp.sharding_strategy FULL_SHARD --out_dir "$T/d2"
# fsdp.backward_prefetch likewise (it was ignored under ddp)
expect prefetch_needs_fsdp 2 "fsdp.backward_prefetch false applies to the units FSDP gathers .*this run's strategy is 'ddp'" -- \
    "$FITLLM" finetune_full micro --strategy ddp --fsdp.backward_prefetch false --out_dir "$T/d2"
# CPU offload (ZeRO-Offload): trains, reports the host tier beside the device's memory; the planner
# prints the host tier's row and suggests it where the optimizer state does not fit; 8-bit AdamW refused
expect offload_trains_with_host_tier 0 "host tier \(offload\) OPTIM +1\.98 MiB" -- "$FITLLM" finetune_full micro \
    --strategy deepspeed_stage_2_offload --train.max_steps 2 --train.global_batch_size 2 --train.micro_batch_size 2 \
    --train.max_seq_length 32 --out_dir "$T/off1"
expect offload_8bit_refused 2 "CPU offload of AdamW8bit is not supported" -- "$FITLLM" finetune_full micro \
    --strategy deepspeed_stage_2_offload --optimizer bnb.optim.AdamW8bit --out_dir "$T/off2"
expect plan_offload_host_row 0 "^host \(offload\) +reserved +0 B +0 B +1\.98 MiB" -- "$FITLLM" plan micro --strategy deepspeed_stage_2_offload
expect plan_suggests_offload 3 "cpu_offload +fits: --strategy deepspeed_stage_2_offload" -- "$FITLLM" plan open-llama-7b \
    --device-memory 80GB --train.micro_batch_size 1 --train.global_batch_size 1 --train.max_seq_length 1025 --accelerator cuda
# ZeRO-3 with the optimizer offloaded: the rank's shard of the state in the host tier (half of micro's 1.98 MiB at 2
# ranks); suggested under ZeRO-3 where the state is what does not fit
expect plan_zero3_offload_host_row 0 "^host \(offload\) +reserved +0 B +0 B +1015\.75 KiB" -- "$FITLLM" plan micro \
    --devices 2 --strategy deepspeed_stage_3_offload
expect plan_suggests_zero3_offload 3 "cpu_offload +fits: --strategy deepspeed_stage_3_offload" -- "$FITLLM" plan open-llama-7b \
    --devices 4 --strategy deepspeed_stage_3 --device-memory 25GiB --train.micro_batch_size 1 --train.global_batch_size 4 \
    --train.max_seq_length 1025 --accelerator cuda
# a disk that cannot take the state at set-up (a file-size limit stands in for a full disk): an I/O error naming
# the folder, no OOM advice, no file left
mkdir -p "$T/nvf"
expect offload_nvme_full_disk 1 "NVMe offload: .* cannot reserve [0-9]+ bytes in '$T/nvf'.*free space there or give another --nvme_path" -- \
    bash -c "ulimit -f 64; trap '' XFSZ; exec \"\$0\" \"\$@\"" "$FITLLM" finetune_full micro --strategy deepspeed_stage_3_offload \
    --offload_optimizer_device nvme --nvme_path "$T/nvf" --out_dir "$T/off6"
[ -z "$(ls -A "$T/nvf")" ] || { echo "FAIL offload_nvme_full_disk_leaves_no_files: $(ls -A "$T/nvf")"; fail=$((fail+1)); }
# --tensor_parallel (the runs themselves: tests/mpi_test.sh, tests/test_tp_train.c): a grid it does not divide, a
# model it does not split (naming the key); the plan of one rank's slice; with offload (DP 2 x TP 2 under ZeRO-2
# offload) the host tier's row holds the rank's chunk of its slice's AdamW state: 130368 floats x 2 / 2 = 509.25 KiB
expect tp_not_dividing_devices 2 "tensor_parallel 2 does not divide devices x num_nodes = 1 rank \(" -- \
    "$FITLLM" finetune_full micro --tensor_parallel 2 --out_dir "$T/tp1"
expect tp_plan_heads_not_divisible 2 "--tensor_parallel 3: the model's 8 attention heads \(num_attention_heads\) do not split evenly over 3 ranks" -- \
    "$FITLLM" plan micro --devices 3 --tensor_parallel 3
expect tp_plan_offload_host_tier 0 "^host \(offload\) +reserved +0 B +0 B +509\.25 KiB" -- \
    "$FITLLM" plan micro --devices 4 --tensor_parallel 2 --strategy deepspeed_stage_2_offload
# micro (V 512, C 64, F 172, 5 layers, 8 / 4 heads of 8, tied) at TP 2, by hand: embeddings 256 x 64 (vocabulary
# slice) + 5 x (2 x 64 norms + q 32 x 64 + k, v 16 x 64 + o 64 x 32 + gate, up 86 x 64 + down 64 x 86) + 64 =
# 130368 floats = 509.25 KiB (573.25 KiB with the embeddings whole)
expect tp_plan_slice 0 "^after_load +reserved +509\.25 KiB" -- "$FITLLM" plan micro --devices 4 --tensor_parallel 2 --strategy ddp
# the 3D grid's rank 3 of TP 2 x PP 2 (the second tensor-parallel rank of stage 1: blocks [3, 5) of micro's 5), by hand:
# embeddings 256 x 64 (vocabulary slice, on every stage) + 2 x (2 x 64 norms + q 32 x 64 + k, v 16 x 64 + o 64 x 32
# + gate, up 86 x 64 + down 64 x 86) + 64 = 62016 floats = 242.25 KiB; LoRA on the slices with dropout on a
# row-parallel target (down_proj: each row's mask at the whole's columns) plans
expect tpp_plan_stage_slice 0 "^after_load +reserved +242\.25 KiB" -- \
    "$FITLLM" plan micro --devices 4 --tensor_parallel 2 --pipeline_parallel 2 --strategy ddp --rank 3
expect tp_plan_lora_dropout_row_parallel 0 "^after_load +reserved" -- \
    "$FITLLM" plan micro --lora --devices 2 --tensor_parallel 2 --lora_mlp true --lora_dropout 0.1
# --pipeline_parallel (EXPERIMENTAL; the runs: tests/mpi_test.sh, tests/test_pp_train.c): a grid it does not divide, an
# unknown schedule, the plan of one stage, the help's label
expect pp_not_dividing_devices 2 "--pipeline_parallel 2 does not divide devices x num_nodes = 1 rank \(" -- \
    "$FITLLM" finetune_full micro --pipeline_parallel 2 --out_dir "$T/pp1"
expect pp_unknown_schedule 2 "--pipeline_schedule 'zigzag': expected gpipe, 1f1b or interleaved" -- \
    "$FITLLM" finetune_full micro --devices 2 --pipeline_parallel 2 --pipeline_schedule zigzag --out_dir "$T/pp2"
expect pp_plan_stage 0 "pipeline parallel 2 \(EXPERIMENTAL, schedule 1f1b\): rank 1 is stage 1" -- \
    "$FITLLM" plan micro --devices 2 --pipeline_parallel 2 --rank 1
expect pp_help_experimental 0 "pipeline_parallel.*EXPERIMENTAL" -- "$FITLLM" finetune_full --help
# the plan's pipeline step: the split by the blocks' training FLOPs (micro's lm_head puts block 4 alone on the last
# stage), the bubble and the expected step in block times, in ms with --block-ms; a bad --block-ms refused
PPPLAN=(plan micro --devices 4 --pipeline_parallel 4 --pipeline_schedule gpipe --strategy ddp --train.micro_batch_size 2
        --train.global_batch_size 8 --train.max_seq_length 48)
expect pp_plan_split_by_cost 0 "blocks per stage \(balanced by training FLOPs at T = 48, lm_head's on the last\): \[0, 1\) \[1, 2\) \[2, 4\) \[4, 5\)" -- \
    "$FITLLM" "${PPPLAN[@]}"
expect pp_plan_bubble 0 "pipeline: expected step [0-9.]+ block times \(.*\), bubble [0-9.]+% \(equal stages: 42.9%\)" -- \
    "$FITLLM" "${PPPLAN[@]}"
# the interleaved schedule's estimate beside 1F1B's (2 chunks per rank; Megatron-LM's order)
expect pp_plan_interleaved 0 "pipeline: interleaved 1F1B with 2 chunks per rank \(virtual stages; --pipeline_schedule interleaved\) would take [0-9.]+ block times, bubble [0-9.]+% \(equal stages: 11.1%\)" -- \
    "$FITLLM" plan micro --devices 2 --pipeline_parallel 2 --strategy ddp --train.micro_batch_size 2 --train.global_batch_size 8
expect pp_plan_block_ms 0 "pipeline: expected step [0-9.]+ ms .* at --block-ms" -- "$FITLLM" "${PPPLAN[@]}" --block-ms 6
# the interleaved schedule planned as it runs (--pipeline_chunks 2: micro's 5 blocks in 4 virtual stages, rank 1's two
# chunks), and the refusals: chunks out of range, more virtual stages than blocks
PPIPLAN=(plan micro --devices 2 --pipeline_parallel 2 --pipeline_schedule interleaved --pipeline_chunks 2 --strategy ddp
         --train.micro_batch_size 2 --train.global_batch_size 8 --train.max_seq_length 48)
expect pp_plan_interleaved_run 0 "interleaved, 2 stages x 2 chunks .*: \[0, 1\) \[1, 2\) \[2, 4\) \[4, 5\)" -- "$FITLLM" "${PPIPLAN[@]}" --rank 1
expect pp_plan_interleaved_bubble 0 "bubble [0-9.]+% \(equal virtual stages: \(S-1\)/\(M V\+S-1\) = 11.1%\)" -- "$FITLLM" "${PPIPLAN[@]}"
expect pp_interleaved_chunks_range 2 "--pipeline_chunks 9: 1 to 8 model chunks per rank" -- "$FITLLM" "${PPIPLAN[@]}" --pipeline_chunks 9
expect pp_interleaved_too_many_chunks 2 "--pipeline_parallel 2 x --pipeline_chunks 3: 6 virtual stages for a model of 5 blocks" -- \
    "$FITLLM" "${PPIPLAN[@]}" --pipeline_chunks 3
expect pp_plan_block_ms_refused 2 "--block-ms: '0' is not a positive time in milliseconds" -- "$FITLLM" "${PPPLAN[@]}" --block-ms 0
# --bucket_size: ZeRO-2 offload of a 7B model at micro 4 over 4 MPI ranks planned a 19.99 GiB WORKSPACE peak (the
# whole buffer's reduce-scatter scratch, 3/4 of 25.1 GiB of gradients); in buckets of 256 MiB (the default) 1.57 GiB
expect plan_bucket_bounds_zero2_workspace 0 "^peak +reserved +25\.10 GiB +25\.10 GiB +0 B +64\.84 GiB +1\.57 GiB" -- \
    "$FITLLM" plan open-llama-7b --devices 4 --strategy deepspeed_stage_2_offload --train.micro_batch_size 4
expect plan_unbucketed_zero2_workspace 0 "^peak +reserved +25\.10 GiB +25\.10 GiB +0 B +64\.84 GiB +19\.99 GiB" -- \
    "$FITLLM" plan open-llama-7b --devices 4 --strategy deepspeed_stage_2_offload --train.micro_batch_size 4 --bucket_size null
expect plan_bucket_note 0 "gradient reductions in buckets of 1\.00 MiB \(--bucket_size\)" -- "$FITLLM" plan micro --devices 2 \
    --strategy deepspeed_stage_2 --bucket_size 1MiB
expect plan_bucket_json 0 '"zero_stage": 2, "bucket_size": 268435456' -- "$FITLLM" plan micro --devices 2 --strategy deepspeed_stage_2 --json
expect bucket_size_bare_number 2 "bucket_size" -- "$FITLLM" finetune_full micro --bucket_size 4096 --out_dir "$T/d2"
# NVMe offload: the state in files under nvme_path (none left behind); a folder that cannot take them and nvme
# without an offload strategy are refused, named
mkdir -p "$T/nvme"
expect offload_nvme_trains 0 "nvme tier \(offload\) OPTIM +1\.98 MiB" -- "$FITLLM" finetune_full micro \
    --strategy deepspeed_stage_2_offload --offload_optimizer_device nvme --nvme_path "$T/nvme" --train.max_steps 2 \
    --train.global_batch_size 2 --train.micro_batch_size 2 --train.max_seq_length 32 --out_dir "$T/off3"
[ -z "$(ls -A "$T/nvme")" ] || { echo "FAIL offload_nvme_leaves_no_files: $(ls -A "$T/nvme")"; fail=$((fail+1)); }
expect offload_nvme_bad_path 2 "nvme offload: cannot create a file in '/nonexistent-fitllm': .*\(nvme_path\)" -- \
    "$FITLLM" finetune_full micro --strategy deepspeed_stage_2_offload --offload_optimizer_device nvme \
    --nvme_path /nonexistent-fitllm --out_dir "$T/off4"
expect offload_nvme_needs_offload 2 "offload_optimizer_device nvme offloads the optimizer of --strategy deepspeed_stage_2_offload" -- \
    "$FITLLM" finetune_full micro --offload_optimizer_device nvme --out_dir "$T/off5"
expect plan_offload_nvme_row 0 "^nvme \(offload\) +reserved +0 B +0 B +1\.98 MiB" -- "$FITLLM" plan micro \
    --strategy deepspeed_stage_2_offload --offload_optimizer_device nvme
expect zero_hybrid_zero2_not_yet 2 "fsdp.sharding_strategy '_HYBRID_SHARD_ZERO2' is not implemented yet \(SHARD_GRAD_OP within a node" -- "$FITLLM" finetune_full micro --strategy fsdp --fsdp.sharding_strategy _HYBRID_SHARD_ZERO2 --out_dir "$T/d2"
expect zero_sharding_unknown 2 "fsdp.sharding_strategy 'ZERO9': unknown" -- "$FITLLM" finetune_full micro --strategy fsdp --fsdp.sharding_strategy ZERO9 --out_dir "$T/d2"
# one process: every strategy trains as one process does (FULL_SHARD of one rank holds everything)
expect fsdp_one_process 0 "Saved the final model" -- "$FITLLM" finetune_full micro --strategy fsdp --train.max_steps 1 \
    --train.global_batch_size 2 --train.micro_batch_size 2 --train.max_seq_length 32 --out_dir "$T/f1" --quiet
expect zero_stage2_one_process 0 "Saved the final model" -- "$FITLLM" finetune_full micro --strategy deepspeed_stage_2 --train.max_steps 1 \
    --train.global_batch_size 2 --train.micro_batch_size 2 --train.max_seq_length 32 --out_dir "$T/z1" --quiet
expect ddp_strategy_unknown 2 "strategy 'horovod': unknown" -- "$FITLLM" pretrain --model_name micro --strategy horovod --out_dir "$T/d3"
expect finetune_full_quantize 2 "'quantize' applies to finetune_lora only" -- "$FITLLM" finetune_full micro --quantize bnb.nf4 --out_dir "$T/o1"
expect finetune_full_lora_r 2 "'lora_r' applies to finetune_lora only" -- "$FITLLM" finetune_full micro --lora_r 4 --out_dir "$T/o1"
# pretrain's ways of naming the model on a fine-tune: --initial_checkpoint_dir replaced the positional model unsaid,
# --model_name / --model_config were ignored
expect finetune_full_initial_checkpoint_dir 2 "option 'initial_checkpoint_dir' applies to pretrain only .*finetune_full takes its model from checkpoint_dir" -- \
    "$FITLLM" finetune_full micro --initial_checkpoint_dir "$DATA/stories260K-hf" --out_dir "$T/o1"
expect finetune_lora_model_name 2 "option 'model_name' applies to pretrain only" -- "$FITLLM" finetune_lora micro --model_name gpt2 --out_dir "$T/o1"
expect pretrain_lora_r 2 "pretrain trains without LoRA" -- "$FITLLM" pretrain --model_name micro --lora_alpha 4 --out_dir "$T/o1"
printf 'quantize: bnb.nf4\n' > "$T/q.yaml"
expect finetune_full_yaml_quantize 2 "q.yaml:1: option 'quantize' applies to finetune_lora only" -- "$FITLLM" finetune_full micro --config "$T/q.yaml" --out_dir "$T/o1"
# a key given twice in one mapping of a recipe (a leaf, or a second train: mapping that PyYAML would take whole and
# fitllm merged): refused, naming both lines
printf 'train:\n  max_steps: 2\n  max_steps: 5\n' > "$T/dup1.yaml"; printf 'train:\n  global_batch_size: 4\ntrain:\n  max_steps: 5\n' > "$T/dup2.yaml"
expect yaml_duplicate_leaf 2 "dup1.yaml:3: 'train.max_steps' is given twice in the same mapping \(first at line 2\)" -- "$FITLLM" finetune_full micro --config "$T/dup1.yaml" --out_dir "$T/o1"
expect yaml_duplicate_mapping 2 "dup2.yaml:3: 'train' is given twice in the same mapping \(first at line 1\)" -- "$FITLLM" finetune_full micro --config "$T/dup2.yaml" --out_dir "$T/o1"
expect plan_quantize_without_lora 2 "plan ... --lora" -- "$FITLLM" plan tinyllama-1.1b --quantize bnb.nf4
# no LoRA / quantize option (prose may name the finetune_lora command, as --pipeline_parallel's does)
if "$FITLLM" finetune_full --help | grep -qE -- "--(lora|quantize)" || "$FITLLM" pretrain --help | grep -qE -- "--(lora|quantize)"; then
    echo "FAIL help_no_lora_options"; fail=$((fail+1)); else echo "ok   help_no_lora_options"; pass=$((pass+1)); fi
expect finetune_lora_help_lists_lora 0 "--lora_r" -- "$FITLLM" finetune_lora --help
# train.max_time ends the run like max_steps: final validation and final/
expect finetune_max_time 0 "train.max_time \(0.5 s\) reached after step [0-9]+ of [0-9]+" -- "$FITLLM" finetune_full micro --train.max_time 0.5 \
    --train.max_steps 100000 --train.global_batch_size 2 --train.micro_batch_size 2 --eval.max_new_tokens 0 --out_dir "$T/mt" --quiet
if [ -d "$T/mt/final" ]; then echo "ok   finetune_max_time_final"; pass=$((pass+1)); else echo "FAIL finetune_max_time_final"; fail=$((fail+1)); fi
expect finetune_max_time_bad 2 "train.max_time must be a positive number" -- "$FITLLM" finetune_full micro --train.max_time 0 --out_dir "$T/mt0"
expect finetune_max_seq_length_1 2 "max_seq_length 1: a sample needs at least 2 tokens" -- "$FITLLM" finetune_full micro --train.max_seq_length 1 --out_dir "$T/s1"
# ---- stopping by a signal, a dead rank, a full disk, finite divergence (issue 28) ----
# A run in the background; the signal goes after its first step, found by polling its metrics file
# (flushed per row) rather than by a fixed sleep (a busy 2-core machine).
start_run() { local n=$1; shift; "$@" >"$T/$n.log" 2>"$T/$n.err" & BG=$!; }
# wait_for FILE ERE: up to 300 s, while the run lives
wait_for() {
    local i
    for i in $(seq 3000); do grep -qE -- "$2" "$1" 2>/dev/null && return 0; kill -0 "$BG" 2>/dev/null || return 1; sleep 0.1; done
    return 1
}
# stopped NAME WANT_RC ERE: the background run's exit status, its stderr, and a log that ends with a whole line
stopped() {
    local name=$1 want=$2 pat=$3 rc i
    # a run that does not stop must not hang the suite: 300 s, then SIGKILL (polled: a watchdog subshell killed
    # right after its fork could still run this script's EXIT trap)
    for i in $(seq 3000); do kill -0 "$BG" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$BG" 2>/dev/null && kill -KILL "$BG"
    wait "$BG"; rc=$?
    if [ "$rc" -ne "$want" ]; then echo "FAIL $name: exit $rc, want $want"; tail -5 "$T/$name.err" | sed 's/^/     /'; fail=$((fail+1)); return 1; fi
    if ! grep -qE -- "$pat" "$T/$name.err"; then echo "FAIL $name: stderr lacks /$pat/"; tail -5 "$T/$name.err" | sed 's/^/     /'; fail=$((fail+1)); return 1; fi
    if [ ! -s "$T/$name.log" ] || [ -n "$(tail -c1 "$T/$name.log")" ]; then echo "FAIL $name: the log does not end with a whole line"; fail=$((fail+1)); return 1; fi
    echo "ok   $name"; pass=$((pass+1))
}
SIGRUN=(finetune_full micro --train.max_steps 100000 --train.global_batch_size 2 --train.micro_batch_size 2 --eval.max_new_tokens 0)
FIRST_STEP="^[0-9]+,1,"   # a metrics row of step 1
# Ctrl-C: stops after the step, exit 130, says how to resume. The signal goes to the command alone (a terminal's
# Ctrl-C reaches the process group, and a second SIGINT there means "stop now": a race seen under load, the run then
# stopping mid-checkpoint with the generic resume message), once its first step is in metrics.csv (it was a fixed 6 s
# of training: 7.7 CPU s of make test)
start_run finetune_ctrl_c "$FITLLM" "${SIGRUN[@]}" --train.save_interval 1 --out_dir "$T/ctrlc"
wait_for "$T/ctrlc/logs/metrics.csv" "$FIRST_STEP"; kill -INT $BG
stopped finetune_ctrl_c 130 "stopped by SIGINT \(Ctrl-C\) after step [0-9]+; the last checkpoint is '.*step-[0-9]+': to continue, run the same command with --resume auto"
# SIGTERM (Slurm, Kubernetes) and SIGUSR1 (Slurm's --signal=USR1 pre-emption notice) act as Ctrl-C: the step
# finishes, its checkpoint is committed (train.save_on_signal, default true), named; exit 128 + the signal
for sg in TERM:143 USR1:138; do
    name=finetune_sig${sg%%:*}; rc=${sg##*:}
    start_run $name "$FITLLM" "${SIGRUN[@]}" --train.save_interval 100000 --out_dir "$T/$name"
    wait_for "$T/$name/logs/metrics.csv" "$FIRST_STEP"; kill -${sg%%:*} $BG
    stopped $name $rc "stopped by SIG${sg%%:*} after step ([0-9]+); the last checkpoint is '.*/step-0*\1': to continue, run the same command with --resume auto" &&
        { ls "$T/$name"/step-*/COMMITTED >/dev/null 2>&1 || { echo "FAIL ${name}_checkpoint: no committed step-*"; fail=$((fail+1)); }; }
done
start_run sigterm_no_save "$FITLLM" "${SIGRUN[@]}" --train.save_interval 100000 --train.save_on_signal false --out_dir "$T/sns"
wait_for "$T/sns/logs/metrics.csv" "$FIRST_STEP"; kill -TERM $BG
stopped sigterm_no_save 143 "stopped by SIGTERM after step [0-9]+, before any checkpoint was committed \(train.save_interval 100000, train.save_on_signal false\)"
ls "$T/sns"/step-* >/dev/null 2>&1 && { echo "FAIL sigterm_no_save_no_checkpoint"; fail=$((fail+1)); }
# a second signal stops at once (long steps: 128 micro-batches, so it lands within the step), naming the checkpoint
start_run sigterm_twice "$FITLLM" finetune_full micro --train.max_steps 100000 --train.global_batch_size 256 \
    --train.micro_batch_size 2 --eval.max_new_tokens 0 --train.save_interval 1 --out_dir "$T/s2x"
# the first signal must land inside step 3, not in step 2's checkpoint save after its metrics row (that stops
# after step 2 with no step left for the second signal): wait for step 2's commit, then into the long step
wait_for "$T/s2x/logs/metrics.csv" "^[0-9]+,2,"
for _ in $(seq 300); do [ -e "$T/s2x/step-000002/COMMITTED" ] && break; sleep 0.1; done
sleep 0.5; kill -TERM $BG
wait_for "$T/sigterm_twice.err" "SIGTERM: stopping after this step"; kill -TERM $BG
stopped sigterm_twice 143 "stopped at once by SIGTERM; the last committed checkpoint is '.*/step-0+[1-9]'"
# --resume auto over an out_dir whose only step folder was never committed: a fresh start, said (it was silent)
RA=(finetune_full micro --data Synthetic --train.global_batch_size 1 --eval.max_new_tokens 0 --train.max_steps 1)
# --overwrite starts over: the previous run's checkpoints go (they stayed beside the new run's, and --resume auto
# took the old run's newest)
"$FITLLM" "${RA[@]}" --train.max_steps 4 --train.save_interval 2 --quiet true --out_dir "$T/ovw" >/dev/null 2>&1
expect overwrite_removes_old_checkpoints 0 "note: --overwrite: the previous run's checkpoints in '.*/ovw' removed \((step-00000[24]|final)(, (step-00000[24]|final)){2}\)" -- \
    "$FITLLM" "${RA[@]}" --out_dir "$T/ovw" --overwrite true
expect overwrite_left_only_its_own 0 "^final logs $" -- bash -c "ls '$T/ovw' | tr '\\n' ' '"
# resuming with another optimizer is a configuration error (2, was 1), naming the option
expect resume_other_optimizer 2 "the checkpoint's run had optimizer AdamW, this run gives SGD \(the saved state is that optimizer's\)\. Resume it with the checkpoint's settings \(--optimizer AdamW\)" -- \
    "$FITLLM" "${RA[@]}" --optimizer SGD --resume "$T/ovw/final" --out_dir "$T/ovw-sgd"
# another model's checkpoint (same tensor shapes) or settings the saved state depends on: refused (2) naming both
# values and the way on; a copy of the model in another folder, or a setting that only changes the steps to come: a
# note (src/train/resume_check.c; they were all taken without a word)
for m in m-copy m-rope; do
    mkdir -p "$T/$m" && cp "$T/ovw/final/"{config.json,model.safetensors,tokenizer.json,tokenizer_config.json} "$T/$m/"
done
sed -i 's/"rope_theta": 10000.0/"rope_theta": 500000.0/' "$T/m-rope/config.json"
expect resume_other_model 2 "trained from model 'micro', this run's model is '.*/m-rope', another architecture \(its config.json: rope_theta 10000 there, 500000 here\)" -- \
    "$FITLLM" finetune_full "$T/m-rope" "${RA[@]:2}" --resume "$T/ovw/final" --out_dir "$T/ovw-rope"
expect resume_model_copy_said 0 "note: --resume: the checkpoint was trained from 'micro', this run names '.*/m-copy': the same architecture" -- \
    "$FITLLM" finetune_full "$T/m-copy" "${RA[@]:2}" --train.max_steps 2 --resume "$T/ovw/final" --out_dir "$T/ovw-copy"
expect resume_other_data_seed 2 "the checkpoint's run had data.seed 42, this run gives 3 .*Resume it with the checkpoint's settings \(--data.seed 42\), or start a new run without --resume \(with --overwrite" -- \
    "$FITLLM" "${RA[@]}" --data.seed 3 --resume "$T/ovw/final" --out_dir "$T/ovw-seed"
"$FITLLM" finetune_lora micro "${RA[@]:2}" --train.save_interval 1 --quiet true --out_dir "$T/lra" >/dev/null 2>&1
expect resume_other_lora_alpha 2 "the checkpoint's run had lora_alpha 16.0, this run gives 32.0 \(the saved adapters are scaled by lora_alpha / r" -- \
    "$FITLLM" finetune_lora micro "${RA[@]:2}" --lora_alpha 32 --resume "$T/lra/step-000001" --out_dir "$T/lra-a"
expect resume_lora_dropout_said 0 "note: --resume: the checkpoint's run had lora_dropout 0.05, this run gives 0.1: the resumed steps drop" -- \
    "$FITLLM" finetune_lora micro "${RA[@]:2}" --train.max_steps 2 --lora_dropout 0.1 --resume "$T/lra/step-000001" --out_dir "$T/lra-d"
"$FITLLM" "${RA[@]}" --train.save_interval 1 --quiet true --out_dir "$T/ra" >/dev/null 2>&1
rm -rf "$T/ra/final"; rm -f "$T/ra/step-000001/COMMITTED"
expect resume_path_missing 2 "--resume 'yes': no such checkpoint folder" -- "$FITLLM" "${RA[@]}" --out_dir "$T/ra-y" --resume yes
expect resume_auto_uncommitted_said 0 "note: --resume auto: no committed checkpoint in '.*/ra' \(step-000001 has no COMMITTED marker" -- \
    "$FITLLM" "${RA[@]}" --out_dir "$T/ra" --resume auto
# a second signal while the first one's checkpoint is being written (slowed): stops at once and removes the
# checkpoint's temporary folder (it was left behind, its model.safetensors.tmp half written)
start_run ctrl_c_twice_in_save env FITLLM_FAULT_WRITE_DELAY_MS=300 "$FITLLM" "${SIGRUN[@]}" --train.save_interval 100000 --out_dir "$T/s2s"
wait_for "$T/s2s/logs/metrics.csv" "$FIRST_STEP"; kill -INT $BG
for _ in $(seq 600); do compgen -G "$T/s2s/.tmp-*" >/dev/null && break; kill -0 $BG 2>/dev/null || break; sleep 0.05; done
kill -INT $BG
stopped ctrl_c_twice_in_save 130 "stopped at once by SIGINT \(Ctrl-C\); no checkpoint was committed" &&
    { compgen -G "$T/s2s/.tmp-*" >/dev/null && { echo "FAIL ctrl_c_twice_in_save_left: $(ls -a "$T/s2s")"; fail=$((fail+1)); } ||
      { echo "ok   ctrl_c_twice_in_save_left"; pass=$((pass+1)); }; }
# BLIP-2 fine-tuning under a stop signal (its own loop, the trainer's handler): after the step, that step's checkpoint
# committed (train.save_on_signal), exit 143, no final/; --resume auto goes on from it; save_on_signal false: none
start_run blip2_sigterm "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 100000 --train.save_interval 1000000 --out_dir "$T/b2sig"
wait_for "$T/blip2_sigterm.log" "^step 3/100000 " && kill -TERM $BG
stopped blip2_sigterm 143 "stopped by SIGTERM after step [0-9]+; the last checkpoint is '.*/b2sig/step-0+[1-9][0-9]*': to continue, run the same command with --resume auto"
b2s=$(ls -d "$T/b2sig"/step-* 2>/dev/null | head -1); b2s=$((10#${b2s##*step-}))
expect blip2_sigterm_no_final 1 "" -- test -e "$T/b2sig/final"
expect blip2_sigterm_resumes 0 "^step $((b2s + 2))/$((b2s + 2)) loss" -- "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps $((b2s + 2)) --train.save_interval 1000000 --resume auto --out_dir "$T/b2sig"
start_run blip2_sigterm_no_save "$FITLLM" finetune_full "$B2" "${B2RUN[@]}" --train.max_steps 100000 --train.save_interval 1000000 --train.save_on_signal false --out_dir "$T/b2sns"
wait_for "$T/blip2_sigterm_no_save.log" "^step 3/100000 " && kill -TERM $BG
stopped blip2_sigterm_no_save 143 "stopped by SIGTERM after step [0-9]+, before any checkpoint was committed \(train.save_interval 1000000, train.save_on_signal false\)"
# fitllm lab under a stop signal: the row's step finishes, no report is written, the runs' temporary folder (TMPDIR)
# is removed, exit 128 + the signal; a second signal stops at once and removes it too. Steps of ~1 s (grad-accum,
# one thread), the signal sent inside step 2 (after step 1's metrics row).
LT="$T/labsig_tmp"; mkdir -p "$LT"
LABSIG=(lab --only grad-accum --steps 256 --threads 1)
lab_step1() {
    local i f
    for i in $(seq 3000); do
        f=$(ls "$LT"/fitllm-lab-*/grad-accum/logs/metrics.csv 2>/dev/null | head -1)
        [ -n "$f" ] && grep -qE -- "$FIRST_STEP" "$f" && return 0
        kill -0 "$BG" 2>/dev/null || return 1; sleep 0.1
    done
    return 1
}
# lab_left NAME OUT: nothing left in the temporary folder, no report in OUT
lab_left() {
    if [ -n "$(ls -A "$LT")" ] || [ -e "$2/report.md" ]; then
        echo "FAIL $1_left: $(ls -A "$LT" | head -3) $(ls "$2" 2>/dev/null | head -3)"; fail=$((fail+1)); rm -rf "${LT:?}"/*
    else echo "ok   $1_left"; pass=$((pass+1)); fi
}
start_run lab_ctrl_c env TMPDIR="$LT" "$FITLLM" "${LABSIG[@]}" --out_dir "$T/labsig1"
lab_step1; kill -INT $BG
stopped lab_ctrl_c 130 "stopped by SIGINT \(Ctrl-C\) after 0 rows; no report written$"
lab_left lab_ctrl_c "$T/labsig1"
start_run lab_sigterm_twice env TMPDIR="$LT" "$FITLLM" "${LABSIG[@]}" --out_dir "$T/labsig2"
lab_step1; sleep 0.2; kill -TERM $BG
wait_for "$T/lab_sigterm_twice.err" "SIGTERM: stopping the lab after this step"; kill -TERM $BG
stopped lab_sigterm_twice 143 "stopped at once by SIGTERM; no report written; its temporary folder removed$"
lab_left lab_sigterm_twice "$T/labsig2"
# a reader that goes away (| head): the lab ends at the next row it prints, removes its folder, dies of SIGPIPE
env TMPDIR="$LT" "$FITLLM" lab --only baseline,reduced-batch,grad-accum --out_dir "$T/labsig3" 2>"$T/lab_pipe.err" | head -1 >/dev/null
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 141 ] && [ ! -s "$T/lab_pipe.err" ]; then echo "ok   lab_pipe_closed"; pass=$((pass+1))
else echo "FAIL lab_pipe_closed: exit $rc, want 141 (SIGPIPE), stderr: $(head -c 300 "$T/lab_pipe.err")"; fail=$((fail+1)); fi
lab_left lab_pipe_closed "$T/labsig3"
# --devices 2: the launcher stays, forwards the stop to the ranks and exits as one process would
if "$FITLLM" --version | grep -q "comm: *MPI (Open MPI" && command -v mpirun >/dev/null; then
    MPIENV=("${NOLAUNCH[@]}" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1)
    DPRUN=(finetune_full micro --devices 2 --strategy ddp --train.max_steps 100000 --train.global_batch_size 4
           --train.micro_batch_size 2 --eval.max_new_tokens 0)
    start_run ddp_ctrl_c "${MPIENV[@]}" "$FITLLM" "${DPRUN[@]}" --train.save_interval 100000 --out_dir "$T/dpi"
    wait_for "$T/dpi/logs/metrics.csv" "$FIRST_STEP"; kill -INT $BG
    stopped ddp_ctrl_c 130 "stopped by SIGINT \(Ctrl-C\) after the ranks' last step; the last committed checkpoint is '.*/step-0+[1-9][0-9]*'"
    start_run ddp_sigterm "${MPIENV[@]}" "$FITLLM" "${DPRUN[@]}" --train.save_interval 100000 --out_dir "$T/dpt"
    wait_for "$T/dpt/logs/metrics.csv" "$FIRST_STEP"; kill -TERM $BG
    stopped ddp_sigterm 143 "stopped by SIGTERM after the ranks' last step; the last committed checkpoint is '.*/step-0+[1-9]"
    # a rank killed (SIGKILL: it says nothing), rank 0 or the other: the launcher names the last checkpoint
    for which in first last; do
        start_run ddp_rank_killed_$which "${MPIENV[@]}" "$FITLLM" "${DPRUN[@]}" --train.save_interval 1 --out_dir "$T/dpk$which"
        wait_for "$T/dpk$which/logs/metrics.csv" "^[0-9]+,3,"
        MPIRUN_PID=$(pgrep -P $BG); RANK_PID=$([ -n "$MPIRUN_PID" ] && pgrep -P "$MPIRUN_PID" | if [ $which = first ]; then head -1; else tail -1; fi)
        [ -n "$RANK_PID" ] && kill -KILL "$RANK_PID"
        stopped ddp_rank_killed_$which 137 "the ranks failed \(mpirun's status 137; .*\); the last committed checkpoint is '.*/step-0+[1-9]"
    done
    # a full disk on rank 0 (fault injection, below): its message and the launcher's name the last committed checkpoint
    expect ddp_disk_full 1 "rank 0 of 2 aborting: .*No space left on device; the last committed checkpoint is '.*/step-000001'" -- \
        env FITLLM_FAULT_DISK_FULL_AFTER_STEP=1 "${MPIENV[@]}" "$FITLLM" "${DPRUN[@]}" --train.max_steps 5 --train.save_interval 1 --out_dir "$T/dpdf"
else
    echo "skip ddp_ctrl_c, ddp_sigterm, ddp_rank_killed, ddp_disk_full: this fitllm has no Open MPI, or no mpirun here"; skip=$((skip+1))
fi
# a full disk while saving (fault injection: every write after step 1's checkpoint fails): the last committed one named
expect disk_full_names_checkpoint 1 "No space left on device; the last committed checkpoint is '.*/step-000001' \(to continue from it, run the same command with --resume auto\)" -- \
    env FITLLM_FAULT_DISK_FULL_AFTER_STEP=1 "$FITLLM" finetune_full micro --train.max_steps 5 --train.global_batch_size 2 \
    --train.micro_batch_size 2 --train.save_interval 1 --eval.max_new_tokens 0 --out_dir "$T/dfull"
# finite divergence: lr 50 sends the loss far above a uniform guess's ln(512) = 6.2: exit 1, no final/, the last good
# checkpoint named (step 2 of a healthy run, resumed at lr 50); off: exit 0, and the perplexity prints as inf
DIVRUN=(finetune_full micro --train.global_batch_size 2 --train.micro_batch_size 2 --eval.max_new_tokens 0)
"$FITLLM" "${DIVRUN[@]}" --train.max_steps 2 --train.save_interval 2 --out_dir "$T/lr50" >/dev/null 2>&1; rm -rf "$T/lr50/final"
expect diverge_lr50 1 "training diverged at step [0-9]+ .*above 8.24, a uniform guess's loss ln\(vocab\) = 6.238 \+ 2.*stopped without saving final/ \(the last good checkpoint, '.*/step-000002', is kept" -- \
    "$FITLLM" "${DIVRUN[@]}" --resume "$T/lr50/step-000002" --optimizer.lr 50 --train.lr_warmup_steps 0 --train.max_steps 60 --train.save_interval 1 --out_dir "$T/lr50"
[ -e "$T/lr50/final" ] && { echo "FAIL diverge_lr50_no_final"; fail=$((fail+1)); }
# with the check off the run ends normally; where its loss went depends on the CPU's float path (lr 50 is
# chaotic: 718 on a native Zen 4 build, 22 on a generic one), so the perplexity is checked against the loss:
# above 20 nats (e^20) it prints inf, below it is exp(loss) (the unit test diverge_* pins the formatting)
ppl_ok() { awk -v l="$1" -v p="$2" 'BEGIN { if (l == "" || p == "") exit 1; if (l > 20) exit !(p == "inf");
                                            d = p / exp(l) - 1; exit !(d < 1e-3 && d > -1e-3) }'; }
expect diverge_lr50_check_off 0 "Final evaluation \| val loss: [0-9]+\.[0-9]+ \| val ppl: " -- \
    "$FITLLM" "${DIVRUN[@]}" --optimizer.lr 50 --train.lr_warmup_steps 0 --train.max_steps 60 --train.divergence_check false --out_dir "$T/lr50off"
printf '1 2 3 4 5 6 7 8 9 10\n' > "$T/ten.txt"
out=$("$FITLLM" loss "$T/lr50off/final" --tokens-file "$T/ten.txt" 2>&1)
l=$(awk '/^loss/ {print $2}' <<<"$out"); p=$(awk '/^loss/ {print $4}' <<<"$out")
if ppl_ok "$l" "$p" && awk -v l="$l" 'BEGIN { exit !(l > 6.238 + 2) }'; then echo "ok   loss_ppl_inf (loss $l, ppl $p)"; pass=$((pass+1))
else echo "FAIL loss_ppl_inf: loss '$l' ppl '$p' (want above ln 512 + 2, and ppl inf above 20 nats)"; fail=$((fail+1)); fi
expect loss_ppl_finite 0 "^loss [0-9.]+  ppl [0-9]+\.[0-9]{4} " -- "$FITLLM" loss micro --tokens-file "$T/ten.txt"
# a llama2.c model file without --tokenizer_dir: the tokenizer beside it (tok512.bin), named, and carried to final/;
# a model without tokenizer files says the built-in byte tokenizer is used
if [ -f "$DATA/stories260K/stories260K.bin" ] && [ -f "$DATA/stories260K/tok512.bin" ]; then
    expect tok_beside_model_file 0 "tokenizer: llama2c from '.*stories260K'" -- "$FITLLM" finetune_full "$DATA/stories260K/stories260K.bin" \
        --train.max_steps 1 --train.global_batch_size 2 --train.micro_batch_size 2 --eval.max_new_tokens 0 --out_dir "$T/tokb"
    cmp -s "$DATA/stories260K/tok512.bin" "$T/tokb/final/tok512.bin" && { echo "ok   tok_beside_model_file_copied"; pass=$((pass+1)); } \
        || { echo "FAIL tok_beside_model_file_copied"; fail=$((fail+1)); }
    # the same file alone: its pretrained vocabulary is not the byte tokenizer's: refused as generate refuses it (the
    # bytes' ids trained it on the wrong tokens, reported as divergence), nothing written; --tokenizer_dir gives it
    mkdir -p "$T/lb2"; cp "$DATA/stories260K/stories260K.bin" "$T/lb2/"
    expect tok_model_file_alone_refused 2 "lb2/stories260K.bin: no tokenizer found beside the model file .*vocab_size 512.*--tokenizer_dir" -- \
        "$FITLLM" finetune_full "$T/lb2/stories260K.bin" --data Synthetic --train.max_steps 1 --train.global_batch_size 1 --out_dir "$T/obin"
    [ ! -e "$T/obin" ] && { echo "ok   tok_model_file_alone_wrote_nothing"; pass=$((pass+1)); } || { echo "FAIL tok_model_file_alone_wrote_nothing"; fail=$((fail+1)); }
    expect tok_model_file_alone_given 0 "tokenizer: llama2c from '.*tok512.bin'" -- "$FITLLM" finetune_full "$T/lb2/stories260K.bin" \
        --tokenizer_dir "$DATA/stories260K/tok512.bin" --data Synthetic --train.max_steps 1 --train.global_batch_size 1 --eval.max_new_tokens 0 \
        --eval.final_validation false --out_dir "$T/obin2"
else
    echo "skip tok_beside_model_file: no $DATA/stories260K/stories260K.bin and tok512.bin"; skip=$((skip+1))
fi
expect tok_builtin_named 0 "tokenizer: bytes \(built in: no tokenizer files with the model; --tokenizer_dir gives one\)" -- \
    "$FITLLM" finetune_full micro --train.max_steps 1 --train.global_batch_size 2 --train.micro_batch_size 2 --eval.max_new_tokens 0 --out_dir "$T/tokm"
expect finetune_16_true_ok 0 "Saved the final model" -- "$FITLLM" finetune_full micro --precision 16-true --train.max_steps 3 --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/x5b" --quiet
expect finetune_oom 3 "out of memory" -- "$FITLLM" finetune_full tiny --max_memory 100MB --out_dir "$T/x6" --train.max_steps 1
if [ -d "$T/x6/final" ] || ls "$T/x6"/step-* >/dev/null 2>&1; then echo "FAIL finetune_oom_no_output"; fail=$((fail+1)); else echo "ok   finetune_oom_no_output"; pass=$((pass+1)); fi
expect finetune_tiny_ok 0 "Saved the final model" -- "$FITLLM" finetune_full micro --train.max_steps 3 --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/x7" --quiet
expect pretrain_ok 0 "Saved the final model" -- "$FITLLM" pretrain --model_name micro --data Synthetic --train.max_steps 2 --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/x8" --quiet
# --threads above the CPUs this process may run on (nproc): warned once, naming both; not at nproc
NCPU=$(nproc)
printf '1 2 3 4 5\n' > "$T/ids5.txt"
expect threads_above_cores_warned 0 "warning: --threads $((NCPU + 1)) is more than the $NCPU CPU cores this process can run on: .*slows the run down" -- \
    "$FITLLM" loss micro --tokens-file "$T/ids5.txt" --threads $((NCPU + 1))
expect threads_at_cores_not_warned 0 "" -- bash -c '! "$1" loss micro --tokens-file "$2" --threads "$3" 2>&1 | grep -q "warning: --threads"' _ "$FITLLM" "$T/ids5.txt" "$NCPU"
expect threads_above_cores_train_once 0 "^1$" -- bash -c '"$1" pretrain --model_name micro --data Synthetic --train.max_steps 1 --train.global_batch_size 2 --train.micro_batch_size 2 --eval.max_new_tokens 0 --eval.final_validation false --threads "$2" --out_dir "$3" 2>&1 | grep -c "warning: --threads $2 is more than"' _ "$FITLLM" $((NCPU + 1)) "$T/thr"
# a model_config with two bad fields: both in one refusal (exit 2), not one a run; their types too
printf 'model_config:\n  n_layer: 2\n  n_embd: 32\n  n_head: 4\n  intermediate_size: 64\n  vocab_size: 512\n  block_size: 64\n  norm_class_name: RMSNorm\n  mlp_class_name: LLaMAMLP\n  rotary_percentage: 1.0\n  parallel_residual: false\n  bias: false\n' > "$T/mc.yaml"
expect model_config_two_unbuildable_fields 2 "model_config.rope_interleave = true \(set rope_interleave: false\); model_config.bias = true \(set bias: false\): fitllm builds LLaMA-style" -- \
    "$FITLLM" pretrain --config "$T/mc.yaml" --data Synthetic --model_config.bias true --model_config.rope_interleave true --out_dir "$T/mc3"
expect model_config_two_bad_types 2 "model_config.n_layer': 'two' is not an integer; option 'model_config.bias': 'maybe' is not a boolean" -- \
    "$FITLLM" pretrain --config "$T/mc.yaml" --model_config.n_layer two --model_config.bias maybe --out_dir "$T/mc3"
# a pretrain from that model_config mapping (no name): the header says where the model came from (it printed
# "model: model_config, N parameters ()")
MC=(--data Synthetic --train.max_steps 1 --train.global_batch_size 2 --train.micro_batch_size 2 --eval.max_new_tokens 0 --eval.final_validation false)
expect pretrain_model_config_header_source 0 "^model: model_config, [0-9]+ parameters \(model_config: 11 fields set, the rest litgpt.Config's defaults\); tokenizer" -- \
    "$FITLLM" pretrain --config "$T/mc.yaml" "${MC[@]}" --out_dir "$T/mc1"
expect pretrain_initial_weights_header 0 "^model: model_config, [0-9]+ parameters \(model_config: 11 fields set, the rest litgpt.Config's defaults; weights from [^ ]*/mc1/final\); " -- \
    "$FITLLM" pretrain --config "$T/mc.yaml" "${MC[@]}" --initial_checkpoint_dir "$T/mc1/final" --out_dir "$T/mc2"
# hyperparameters.yaml's init: what the run started from (a from-scratch pretrain said "pretrained"); from that
# run's weights (initial_checkpoint_dir) it says pretrained
expect pretrain_scratch_hparams_init_random 0 "" -- grep -qx "init: random" "$T/mc1/final/hyperparameters.yaml"
expect pretrain_initial_weights_hparams_init_pretrained 0 "" -- grep -qx "init: pretrained" "$T/mc2/final/hyperparameters.yaml"

# ---- fitllm plan: exit 0 fits, 3 OOM, 2 usage / not available ----
expect plan_fits 0 "verdict: FITS" -- "$FITLLM" plan tinyllama-1.1b --device-memory 80GB --train.micro_batch_size 4 --train.global_batch_size 32 --train.max_seq_length 1025
expect plan_oom_exit_3 3 "verdict: OUT OF MEMORY during setup" -- "$FITLLM" plan tinyllama-1.1b --device-memory 80GB --train.micro_batch_size 32 --train.global_batch_size 32 --train.max_seq_length 1025
expect plan_oom_suggests 3 "largest micro_batch_size that fits: 16" -- "$FITLLM" plan --model tinyllama-1.1b --device-memory 80GB --train.micro_batch_size 32 --train.global_batch_size 32 --train.max_seq_length 1025
expect plan_json 3 '"verdict": "oom"' -- "$FITLLM" plan open-llama-7b --device-memory 80GB --json
expect plan_qlora_fits 0 "verdict: FITS" -- "$FITLLM" plan open-llama-7b --lora --quantize bnb.nf4-dq --precision bf16-true --device-memory 24GB --train.micro_batch_size 1 --train.max_seq_length 513
expect plan_no_budget_unknown 0 "verdict: UNKNOWN: no --device-memory / --max-memory given" -- "$FITLLM" plan tinyllama-1.1b
if "$FITLLM" plan tinyllama-1.1b | grep -q "FITS"; then echo "FAIL plan_no_budget_not_fits"; fail=$((fail+1)); else echo "ok   plan_no_budget_not_fits"; pass=$((pass+1)); fi
expect plan_no_budget_json 0 '"verdict": "unknown"' -- "$FITLLM" plan tinyllama-1.1b --json
expect plan_absurd_peak 0 "more than any single machine has" -- "$FITLLM" plan llama-3-8b --train.micro_batch_size 4096 --train.global_batch_size 4096
expect plan_devices_2 0 "data parallel \(DDP\) over 2 ranks: the memory of ONE rank" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --strategy ddp
# --strategy auto (the default) per command, as LitGPT: finetune_full FULL_SHARD, finetune_lora DDP over the
# adapters, pretrain FULL_SHARD (HYBRID_SHARD on one node), on CPUs and GPUs (a device communicator)
expect plan_auto_full_fsdp 0 "strategy auto: fsdp FULL_SHARD, as LitGPT's finetune_full" -- "$FITLLM" plan tinyllama-1.1b --devices 2
expect plan_auto_full_fsdp_gpu 0 "strategy auto: fsdp FULL_SHARD, as LitGPT's finetune_full" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --accelerator cuda
expect plan_auto_8bit_fsdp_gpu 0 "strategy auto: fsdp FULL_SHARD, as LitGPT's finetune_full" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --accelerator cuda --optimizer bnb.optim.AdamW8bit
# LitGPT's FSDP checkpoints each block's activations: auto's FSDP too, unless told otherwise
expect plan_auto_full_actckpt 0 "AdamW, activation checkpointing on" -- "$FITLLM" plan tinyllama-1.1b --devices 2
expect plan_auto_full_actckpt_off 0 "AdamW, activation checkpointing off" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --train.activation_checkpointing false
expect plan_ddp_no_actckpt 0 "AdamW, activation checkpointing off" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --strategy ddp
expect plan_auto_full_fsdp_mem 0 "FSDP FULL_SHARD \(ZeRO-3\) over 2 ranks" -- "$FITLLM" plan tinyllama-1.1b --devices 2
expect plan_auto_lora_ddp 0 "strategy auto: DDP over the adapters" -- "$FITLLM" plan tinyllama-1.1b --lora --devices 2
expect plan_auto_lora_ddp_mem 0 "data parallel \(DDP\) over 2 ranks" -- "$FITLLM" plan tinyllama-1.1b --lora --devices 2
expect plan_auto_8bit_fsdp 0 "strategy auto: fsdp FULL_SHARD, as LitGPT's finetune_full" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --optimizer bnb.optim.AdamW8bit
expect plan_auto_16true_fsdp 0 "strategy auto: fsdp FULL_SHARD, as LitGPT's finetune_full" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --precision 16-true
expect plan_strategy_fsdp 0 "FSDP FULL_SHARD \(ZeRO-3\) over 2 ranks: rank 1's memory" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --strategy fsdp --rank 1
expect plan_fsdp_8bit 0 "FSDP FULL_SHARD \(ZeRO-3\) over 2 ranks" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --strategy deepspeed_stage_3 --optimizer bnb.optim.AdamW8bit
expect plan_hybrid_rank 0 "FSDP HYBRID_SHARD over 2 nodes of 2 ranks: rank 3's memory" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --num_nodes 2 --strategy fsdp --fsdp.sharding_strategy HYBRID_SHARD --rank 3
# (one node: HYBRID_SHARD is FULL_SHARD)
expect plan_hybrid_one_node 0 "FSDP FULL_SHARD \(ZeRO-3\) over 2 ranks" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --strategy fsdp --fsdp.sharding_strategy HYBRID_SHARD
expect plan_zero1_rank 0 "ZeRO-1 over 4 ranks: rank 3's memory: OPTIM for its chunk" -- "$FITLLM" plan tinyllama-1.1b --devices 4 --strategy deepspeed_stage_1 --rank 3
expect plan_zero_rank_range 2 "plan --rank 4: the run has ranks 0..3" -- "$FITLLM" plan tinyllama-1.1b --devices 4 --strategy deepspeed_stage_2 --rank 4
expect plan_zero_8bit 0 "ZeRO-2 over 2 ranks" -- "$FITLLM" plan tinyllama-1.1b --devices 2 --strategy deepspeed_stage_2 --optimizer bnb.optim.AdamW8bit
printf 'strategy: fsdp\ndevices: 2\nfsdp:\n  sharding_strategy: SHARD_GRAD_OP\n' > "$T/zero2.yaml"
expect plan_zero2_yaml 0 "ZeRO-2 over 2 ranks" -- "$FITLLM" plan micro --config "$T/zero2.yaml"
expect plan_zero_json 0 '"rank": 1, "zero_stage": 2' -- "$FITLLM" plan micro --config "$T/zero2.yaml" --rank 1 --json
# OPTIM per rank, by hand: tinyllama has n = 1100048384 parameters, AdamW fp32 keeps 8 bytes each;
# 4 ranks: n/4 each = 2200096768 bytes; 3 ranks: n = 3 x 366682794 + 2, so ranks 0 and 1 hold
# 366682795 elements (2933462360 bytes) and rank 2 366682794 (2933462352)
expect plan_zero1_optim_quarter 0 '"peak": \{"PARAMS": 4400193536, "GRADS": 4400193536, "OPTIM": 2200096768,' -- \
    "$FITLLM" plan tinyllama-1.1b --devices 4 --strategy deepspeed_stage_1 --json
expect plan_zero2_optim_rank1_of_3 0 '"OPTIM": 2933462360, "ACTS"' -- \
    "$FITLLM" plan tinyllama-1.1b --devices 3 --train.global_batch_size 3 --strategy deepspeed_stage_2 --rank 1 --json
# FULL_SHARD splits every unit on its own: tinyllama's embeddings (65536000 = 3 x 21845333 + 1) and each of
# its 22 blocks (44044288 = 3 x 14681429 + 1) give rank 0 one element more, the head group (65538048) divides:
# rank 0 holds 21845334 + 22 x 14681430 + 21846016 = 366682810 elements (GRADS 4 bytes, AdamW 8 bytes each),
# ranks 1 and 2 366682787
expect plan_fsdp_rank0_of_3 0 '"GRADS": 1466731240, "OPTIM": 2933462480, "ACTS"' -- \
    "$FITLLM" plan tinyllama-1.1b --devices 3 --train.global_batch_size 3 --strategy fsdp --rank 0 --json
expect plan_fsdp_rank2_of_3 0 '"GRADS": 1466731148, "OPTIM": 2933462296, "ACTS"' -- \
    "$FITLLM" plan tinyllama-1.1b --devices 3 --train.global_batch_size 3 --strategy deepspeed_stage_3 --rank 2 --json
expect plan_zero2_optim_rank2_of_3 0 '"OPTIM": 2933462352, "ACTS"' -- \
    "$FITLLM" plan tinyllama-1.1b --devices 3 --train.global_batch_size 3 --strategy deepspeed_stage_2 --rank 2 --json
expect plan_bad_size 2 "not a size" -- "$FITLLM" plan tinyllama-1.1b --device-memory lots
expect plan_unknown_model 2 "neither a model folder nor a preset" -- "$FITLLM" plan no-such-model
expect plan_help 0 "--device-memory" -- "$FITLLM" plan --help
expect plan_7b_full_oom 3 "OUT OF MEMORY" -- "$FITLLM" plan open-llama-7b --device-memory 80GB --train.max_seq_length 513
expect plan_7b_lora_fits 0 "verdict: FITS" -- "$FITLLM" plan open-llama-7b --lora --device-memory 80GB --train.max_seq_length 513
# reserved vs live per phase: the plan and the run's memory report show activations live after forward only
expect plan_live_rows 0 "^after_fwd +reserved" -- "$FITLLM" plan micro --device-memory 1GB --train.max_seq_length 33
expect plan_json_live 0 '"live": \{"PARAMS"' -- "$FITLLM" plan micro --device-memory 1GB --json
out=$("$FITLLM" finetune_full micro --data Synthetic --train.max_seq_length 33 --train.max_steps 1 --train.global_batch_size 2 \
      --train.micro_batch_size 2 --eval.final_validation false --out_dir "$T/live1" 2>&1)
# ACTS is column 6 of a "live" row (after the phase row, "live", PARAMS, GRADS, OPTIM; sizes print as "N unit")
acts_fwd=$(awk '/^after_fwd/ { f = 1; next } f && $1 == "live" { print $8 $9; exit }' <<<"$out")
acts_bwd=$(awk '/^after_bwd/ { f = 1; next } f && $1 == "live" { print $8 $9; exit }' <<<"$out")
if [ -n "$acts_fwd" ] && [ "$acts_fwd" != "0B" ] && [ "$acts_bwd" = "0B" ]; then echo "ok   run_report_live_acts"; pass=$((pass+1))
else echo "FAIL run_report_live_acts: after_fwd ACTS live '$acts_fwd', after_bwd '$acts_bwd'"; echo "$out" | grep -A1 -E "^(after|before)" | sed 's/^/     /'; fail=$((fail+1)); fi

# ---- finetune_full out of memory: phase, tag, requested vs available, breakdown, what to try, exit 3,
# nothing written when set-up fails; a failure at evaluation keeps logs/ but writes no final/ ----
TR=(--data Synthetic --data.n_train 16 --data.n_val 2 --train.global_batch_size 4 --train.micro_batch_size 4 --train.max_seq_length 33 --train.max_steps 1 --eval.interval 1 --eval.max_iters 1 --eval.final_validation false --quiet)
expect ft_oom_setup 3 "what to try" -- "$FITLLM" finetune_full micro "${TR[@]}" --eval.max_new_tokens 0 --out_dir "$T/oom1" --max-memory 5MB
out=$("$FITLLM" finetune_full micro "${TR[@]}" --eval.max_new_tokens 0 --out_dir "$T/oom1" --max-memory 5MB 2>&1)
if grep -q "out of memory during setup: ACTS requested" <<<"$out" && grep -q "available" <<<"$out" && grep -q "OPTIM" <<<"$out" \
   && grep -q "micro_batch" <<<"$out" && [ ! -e "$T/oom1" ]; then echo "ok   ft_oom_setup_report_no_output"; pass=$((pass+1))
else echo "FAIL ft_oom_setup_report_no_output"; echo "$out" | tail -12 | sed 's/^/     /'; fail=$((fail+1)); fi
# budget = the planned training peak: training fits, the evaluation sample's KV cache does not
need=$("$FITLLM" plan micro "${TR[@]}" --eval.max_new_tokens 8 --generation off --json | grep -o '"peak": {[^}]*}' | grep -o '"total": [0-9]*' | grep -o '[0-9]*$')
expect ft_oom_at_eval 3 "out of memory during validation" -- "$FITLLM" finetune_full micro "${TR[@]}" --eval.max_new_tokens 8 --out_dir "$T/oom2" --max-memory "${need}B"
if [ -d "$T/oom2/logs" ] && [ ! -e "$T/oom2/final" ]; then echo "ok   ft_oom_at_eval_no_final"; pass=$((pass+1))
else echo "FAIL ft_oom_at_eval_no_final"; ls -R "$T/oom2" 2>&1 | head | sed 's/^/     /'; fail=$((fail+1)); fi
expect plan_predicts_eval_oom 3 "OUT OF MEMORY during validation \(eval_generate\)" -- "$FITLLM" plan micro "${TR[@]}" --eval.max_new_tokens 8 --max-memory "${need}B"
# the planner's null backend as FITLLM_BACKEND=null: a device the host cannot read, so every path of a run
# (LoRA merge, checkpoint, sample) goes through the backend's copies and nothing faults; the bytes are zeros
expect null_backend_lora_run 0 "peak total" -- env FITLLM_BACKEND=null "$FITLLM" finetune_lora micro "${TR[@]}" --out_dir "$T/null-lora"

# a multi-rank run's summary gives the peak as the range over its ranks (the course's convention)
expect ranks_peak_range 0 "peak total, ranks min - max +[0-9.]+ [KMG]iB - [0-9.]+ [KMG]iB" -- "$FITLLM" finetune_full micro --devices 2 --strategy fsdp --train.max_steps 1 --data Synthetic --out_dir "$T/ranks-range"
# ... and its throughput as the whole job's (metrics.csv's tok_s is one rank's)
expect_saved ranks_throughput_all_ranks 0 "tokens/s \(with prompt\) +[0-9.]+ \(all 2 ranks\)" "$EXPECT_OUT" "$EXPECT_RC"
expect_saved ranks_tflops_all_ranks 0 "TFLOP/s \(model FLOPs\) +[0-9.]+ \(all 2 ranks\)" "$EXPECT_OUT" "$EXPECT_RC"
# on a GPU the training summary adds NVML's utilization and memory (FITLLM_GPU_MONITOR=on forces it beside a CPU
# run): without NVML it says why; with the tests' NVML stand-in (10 % and 30 % alternately, 5 GiB) the mean +- std
expect gpu_monitor_absent 0 "GPU utilization: not sampled .NVML not loaded ./nonexistent/libnvidia-ml.so.1" -- env FITLLM_GPU_MONITOR=on FITLLM_NVML_LIB=/nonexistent/libnvidia-ml.so.1 "$FITLLM" finetune_full micro --devices 1 --train.max_steps 1 --data Synthetic --out_dir "$T/gpumon1"
FAKE_NVML="$(dirname "$FITLLM")/libfitllm_fake_nvml.so"
if [ -f "$FAKE_NVML" ]; then
    expect gpu_monitor_nvml 0 "GPU utilization .NVML, device 0, [0-9]+ samples.: [123][0-9].[0-9] \\+- [0-9]+.[0-9] %, device memory used 5.00 \\+- 0.00 GiB" -- env FITLLM_GPU_MONITOR=on FITLLM_NVML_LIB="$(cd "$(dirname "$FAKE_NVML")" && pwd)/libfitllm_fake_nvml.so" "$FITLLM" finetune_full micro --devices 1 --train.max_steps 4 --data Synthetic --out_dir "$T/gpumon2"
fi
# ---- fitllm lab: the quick suite (make demo) with its verdicts, files and charts ----
expect lab_bad_suite 2 "not quick, full, ci or fsdp" -- "$FITLLM" lab --suite huge
# an --out_dir that cannot hold the report is refused before any row runs (the rows ran, then the writing failed);
# an empty --only ran the whole suite
echo x > "$T/labfile"
expect lab_out_dir_is_file 2 "--out_dir '.*labfile' is a file, not a folder" -- "$FITLLM" lab --only sgd --out_dir "$T/labfile"
expect lab_out_dir_under_file 2 "--out_dir '.*labfile/sub': '.*labfile' is a file, not a folder" -- "$FITLLM" lab --only sgd --out_dir "$T/labfile/sub"
expect lab_only_empty 2 "--only needs a list of experiment names" -- "$FITLLM" lab --only ""
expect lab_help_by_name 0 "tp2-pp2 tp2-sp" -- "$FITLLM" lab --help
expect lab_bad_only 2 "unknown experiment" -- "$FITLLM" lab --only nope --out_dir "$T/lab0"
# a row the plan says OOM is decided by its plan (not trained); --run-oom trains it to the same refusal (ACTS of
# batch 32 at the lab's T 64: 312.64 MiB at its former T 62 x 64 / 62, the arena being linear in T)
expect lab_oom_planned 0 "baseline: OOM during setup: ACTS 322.73 MiB requested, 232.75 MiB available \(planned; not run\)" -- "$FITLLM" lab --only baseline --out_dir "$T/lab-oom1"
# the course's runs at its settings beside fitllm's plan: verdicts, its memory readings, why fitllm differs (bytes)
expect lab_course_runs 0 "reduced-batch +tinyllama-1.1b +32-true +8x4 \\| fits +30.41 \\| fits +[0-9.]+ +-[0-9.]+%" -- "$FITLLM" lab --only baseline --out_dir "$T/lab-course"
expect lab_course_report 0 "" -- bash -c "grep -q '^## The course.s runs beside fitllm.s plan' '$T/lab-course/report.md' && grep -q 'B x T x V x 4 = 32 x 511 x 32000 x 4 = 2.09 GB' '$T/lab-course/report.md' && grep -q '\"course_runs\"' '$T/lab-course/results.json'"
# issue 33: --peer pytorch: PyTorch's allocation of the course's runs beside fitllm's plan (measured categories,
# modelled peak: tests/test_lab.c lab_peer_pytorch_matches_torch), as ratios, in the console, report.md and JSON
expect lab_peer_pytorch 0 "reduced-batch +29.59 +14.82 +1.57 \| +28.71 +0.970 \| +30.41 +0.973" -- "$FITLLM" lab --only baseline --peer pytorch --out_dir "$T/lab-peer"
expect lab_peer_pytorch_files 0 "" -- bash -c "grep -q '^### PyTorch beside fitllm' '$T/lab-peer/report.md' && grep -q '\"pytorch\": {\"params\"' '$T/lab-peer/results.json'"
# GPT-2 in the PyTorch model (tests/fixtures/pytorch-alloc-gpt2.json): the fsdp suite's rows, checkpointed ones too
expect lab_peer_fsdp_gpt2 0 "amp-b8-ckpt +gpt2-xl +128 +[0-9.]+ fits +\| +[0-9.]+ fits .*measured: 16-mixed, adamw, checkpointing; modelled: the peak, one layer's recompute, FSDP's shards" -- bash -c "'$FITLLM' lab --suite fsdp --peer pytorch --plan-only --only amp-b8-ckpt --out_dir '$T/lab-peer-fsdp' | tr '\n' ' '"
expect lab_peer_bad 2 "--peer: 'tensorflow' is not pytorch" -- "$FITLLM" lab --peer tensorflow
# --peer pytorch for the lab's own rows at the real scale: QLoRA (PEFT + bitsandbytes NF4, measured categories;
# modelled: the peak, the dequantized weight, CUDA's dropout mask) on open-llama-7b at T 1024; at --scale real the
# 4-rank rows (n/a on one device) still get PyTorch's per-rank figure (DDP's buckets modelled)
expect lab_peer_rows 0 "qlora +open-llama-7b +1024 +14.39 fits +\| +[0-9.]+ fits +[0-9.]+ .*measured: 32-true, adamw, QLoRA NF4 r16; modelled: the peak, the dequantized weight, CUDA's dropout mask" -- bash -c "'$FITLLM' lab --only qlora --steps 1 --peer pytorch --out_dir '$T/lab-peer-rows' | tr '\n' ' '"
expect lab_peer_rows_files 0 "" -- bash -c "grep -q '^### PyTorch would need' '$T/lab-peer-rows/report.md' && grep -q '\"pytorch_basis\": \"measured: 32-true, adamw, QLoRA NF4 r16' '$T/lab-peer-rows/results.json'"
expect lab_peer_rows_real 0 "ddp +tinyllama-1.1b +[0-9]+ +[0-9.]+ fits .*modelled: the peak, DDP's gradient buckets" -- bash -c "'$FITLLM' lab --scale real --only ddp --peer pytorch --out_dir '$T/lab-peer-real' | tr '\n' ' '"
# --plan-only: no row trains, the real scale's verdicts are the plans' (seconds); where the plan differs from the
# course's table the row says why (the baseline fits: PyTorch's fp32 logits, its modelled peak at T 511)
expect lab_plan_only 0 "--plan-only: no row +trained.* baseline \(the course's run\): fitllm fits where the course ran out of memory: .* at T 511" -- bash -c "'$FITLLM' lab --scale real --plan-only --only baseline,reduced-batch --out_dir '$T/lab-plan-only' | tr '\n' ' '"
expect lab_plan_only_json 0 "" -- bash -c "grep -q '\"course_why\": \"fitllm is leaner than the course' '$T/lab-plan-only/results.json' && grep -q '\"course_gb\": 30.41' '$T/lab-plan-only/results.json'"
expect lab_run_oom 0 "baseline +OOM .*ACTS 322.73 MiB requested, 232.75 MiB available$" -- "$FITLLM" lab --only baseline --run-oom --out_dir "$T/lab-oom2"
# --scale real (an 80 GB GPU's run; here only what needs no memory): a bad scale, the fsdp suite refused,
# the 4-rank rows n/a naming the launch they need, the report saying which scale it is
expect lab_bad_scale 2 "not lab or real" -- "$FITLLM" lab --scale huge
# the fsdp suite at the real scale (the course's 4 x 16 GiB): its rows need a device of 4 x 16 GiB (the ranks share it)
# or mpirun; on a machine with less, n/a naming both, with the real-scale plan beside the course's figures
expect lab_real_fsdp_suite 0 "amp-b9: at real scale the 4 ranks of 16.00 GiB each need one device" -- "$FITLLM" lab --scale real --suite fsdp --only amp-b9 --out_dir "$T/labrealf"
expect lab_real_ranks_na 0 "ddp: at real scale the 4 ranks need 4 devices .mpirun -np 4 fitllm finetune_full tinyllama-1.1b --devices 4" -- "$FITLLM" lab --scale real --only ddp,fsdp --out_dir "$T/labreal"
# a row that would run needs the 80 GB device: on a machine with less (this one's RAM), n/a naming both
if [ "$(awk '/MemTotal/ {print $2}' /proc/meminfo)" -lt 78000000 ]; then
    expect lab_real_needs_device 0 "baseline: at real scale this row needs the 74.51 GiB device: the cpu backend has" -- \
        "$FITLLM" lab --scale real --only baseline --out_dir "$T/labreal3" --accelerator cpu
fi
# the real scale's data: a TextFiles folder whose samples are T + 1 = 1025 tokens (byte text), enough for the
# largest global batch (32) x steps (1) + 16 samples; a run on it has T = min(1024, the model's context)
# issue 33: the real scale draws Alpaca's lengths (recipes/data/alpaca-lengths.tsv); --lengths fixed keeps every
# sample T + 1 = 1025 tokens of byte text (the two tests below)
expect lab_real_lengths 0 "sample lengths drawn from\s+recipes/data/alpaca-lengths.tsv \(median 118, p95 320, max 406 tokens\), cut to max_seq_length 512" -- bash -c "'$FITLLM' lab --scale real --only reduced-batch --out_dir '$T/labrealL' | tr '\n' ' '"
# one sample set for every row of the suite (the most samples any row reads: its T does not depend on --only):
# the longest of that draw is 398 tokens, T 397 (reduced-batch's own 8 x 4 samples alone: 326, T 325)
expect lab_real_lengths_T 0 "^reduced-batch,tinyllama-1.1b,tinyllama-1.1b,8,1,397," -- cat "$T/labrealL/results.csv"
expect lab_real_lengths_bad 1 "lab --lengths: .*/bad-lengths.tsv:2: quantile 0.5 has no length" -- "$FITLLM" lab --scale real --only reduced-batch --lengths "$T/bad-lengths.tsv" --out_dir "$T/labrealB"
expect lab_real_text_data 0 "" -- bash -c "'$FITLLM' lab --scale real --only ddp --steps 1 --lengths fixed --keep-runs --out_dir '$T/labreal4' >/dev/null && \
    test \$(stat -c %s '$T/labreal4/runs/real-scale-text/1-train.txt') -ge 49200 && test -s '$T/labreal4/runs/real-scale-text/0-val.txt'"
expect lab_real_text_T 0 "longest input 512" -- "$FITLLM" finetune_full micro --data TextFiles \
    --data.train_data_path "$T/labreal4/runs/real-scale-text" --train.max_seq_length 1025 --train.max_steps 1 \
    --train.global_batch_size 2 --train.micro_batch_size 2 --out_dir "$T/labreal5"
expect lab_real_report 0 "" -- bash -c "grep -q '^## Scale: real' '$T/labreal/report.md' && grep -q '\"scale\": \"real\"' '$T/labreal/results.json' && grep -q 'real scale: tinyllama-1.1b' <('$FITLLM' lab --scale real --only ddp --out_dir '$T/labreal2')"
# issue 33: the rows on the course's own data (--data: Alpaca-style records; at --scale real the recipes'
# data/alpaca2k/alpaca2k.json when the working directory has it): short records make batches shorter than T (the
# metrics' tokens), the real scale plans at max_seq_length 512 with the given tokenizer; bad paths name themselves
printf '[{"instruction": "Say hi.", "input": "", "output": "hi"}, {"instruction": "Add 1 and 2.", "input": "", "output": "3"}]\n' >"$T/lab-short.json"
expect lab_data_rows 0 "the rows fine-tune on .*lab-short.json \(tokenizer: +the +built-in +bytes\).* reduced-batch +fits" -- bash -c "'$FITLLM' lab --only reduced-batch --steps 1 --data '$T/lab-short.json' --keep-runs --out_dir '$T/labdata' | tr '\n' ' '"
expect lab_data_tokens 0 "" -- bash -c "awk -F, 'NR == 2 { exit !(\$6 > 0 && \$6 < 8 * 64) }' '$T/labdata/runs/reduced-batch/logs/metrics.csv'"
# a real model's tokenizer at the lab scale (its models have the vocabulary / 16): refused before any row (every row
# failed, exit 1); the lab-scale rows' default data: different samples, so DDP's and accumulation's losses differ from
# one micro batch's and agree with each other (the rows trained on one template text, every loss the same)
expect lab_tokenizer_lab_scale 2 "lab --tokenizer .*llama2-tokenizer: its 32000 ids do not fit the lab scale's models \(lab-1b ... have 2000" -- "$FITLLM" lab --only reduced-batch --steps 1 --data "$T/lab-short.json" --tokenizer "$DATA/llama2-tokenizer" --out_dir "$T/labtok"
expect lab_default_data_samples_differ 0 "" -- bash -c "'$FITLLM' lab --only grad-accum --steps 1 --keep-runs --out_dir '$T/labdd' >/dev/null && awk -F, 'NR > 1 { n++; v[\$4] = 1 } END { exit !(n == 4 && length(v) == 4) }' '$T/labdd/runs/grad-accum/logs/metrics.csv'"
expect lab_data_auto 0 "real scale: the rows fine-tune on data/alpaca2k/alpaca2k.json \(tokenizer: .*llama2-tokenizer\), each sample cut +to +max_seq_length +512" -- bash -c "mkdir -p '$T/labauto/data/alpaca2k' && cp '$T/lab-short.json' '$T/labauto/data/alpaca2k/alpaca2k.json' && cd '$T/labauto' && '$(readlink -f "$FITLLM")' lab --scale real --plan-only --only reduced-batch --tokenizer '$(readlink -f "$DATA")/llama2-tokenizer' --out_dir '$T/labauto/out' | tr '\n' ' '"
expect lab_data_missing 1 "lab --data .*/nope.json: no such file" -- "$FITLLM" lab --only baseline --data "$T/nope.json" --out_dir "$T/labdx"
expect lab_tokenizer_alone 2 "lab --tokenizer .*: only with --data" -- "$FITLLM" lab --only baseline --tokenizer "$T" --out_dir "$T/labdx"
expect lab_data_fsdp 2 "lab --data / --tokenizer: the quick and full suites' rows" -- "$FITLLM" lab --suite fsdp --only b1 --data "$T/lab-short.json" --out_dir "$T/labdx"
# issue 32 item 5: the course's BLIP-2 sequence (--suite blip2): the real shapes' verdicts anywhere (--plan-only:
# the fine-tuning's own set-up on the null backend standing in for an 80 GB GPU), the lab scale trained on synthetic
# images and captions through fl_blip2_train; what BLIP-2 fine-tuning refuses in this build is n/a by name
expect lab_blip2_real_plan 0 "baseline +opt-2.7b +64x1 +32-true +AdamW +OOM +yes .*reduced-batch +opt-2.7b +8x1 +32-true +AdamW +fits +yes .*lora +t5-xxl +4x1 .* fits +yes" -- bash -c "'$FITLLM' lab --suite blip2 --scale real --plan-only --out_dir '$T/labb2r' | tr '\n' ' '"
expect lab_blip2_real_baseline_why 0 "baseline\\*\\*: OOM during setup: WORKSPACE 1.97 GiB requested, 522.15 MiB available \(planned; not run\).*\\*\\*baseline\\*\\* \(the course's run\): fitllm plans 81.57 GB \(OOM on 80 GB; the course: OOM\), PyTorch's model 64.10 GB \(fits\)\. PyTorch peaks as the backward starts" -- bash -c "tr '\\n' ' ' < '$T/labb2r/report.md'"
expect lab_blip2_real_fsdp 0 "fsdp +t5-xxl +1x1x4 +32-true +AdamW +fits +yes" -- bash -c "'$FITLLM' lab --suite blip2 --scale real --plan-only --only fsdp --out_dir '$T/labb2f' | tr '\n' ' '"
expect lab_blip2_lab 0 "reduced-batch +lab-opt-2.7b +8x1 +32-true +AdamW +fits +yes .*ddp +lab-opt-2.7b +8x2x4 .* fits +yes" -- bash -c "'$FITLLM' lab --suite blip2 --only baseline,reduced-batch,ddp --steps 2 --out_dir '$T/labb2' | tr '\n' ' '"
expect lab_blip2_files 0 "" -- bash -c "grep -q '^## How the BLIP-2 lab is scaled' '$T/labb2/report.md' && grep -q '\"ref_model\": \"blip2-opt-2.7b\"' '$T/labb2/results.json' && grep -q '^reduced-batch,lab-blip2-opt-2.7b,blip2-opt-2.7b,8,1,4,' '$T/labb2/results.csv'"
expect lab_blip2_bad_only 2 "unknown experiment 'nope' in suite blip2" -- "$FITLLM" lab --suite blip2 --only nope --out_dir "$T/labb2x"
# --peer pytorch for BLIP-2 (HF Blip2ForConditionalGeneration, tests/ref/pytorch_alloc.py blip2): every row at the
# real shapes, even those fitllm refuses; LoRA / QLoRA rows say they are not modelled
expect lab_blip2_peer 0 "baseline +blip2-opt-2.7b +50 +64.10 fits +\| +[0-9.]+ OOM .*bf16-true +blip2-opt-2.7b +50 +[0-9.]+ fits .*even-larger +blip2-flan-t5-xxl +50 +[0-9.]+ OOM .*lora +blip2-flan-t5-xxl +50 +[0-9.]+ fits .*measured: 32-true, adamw, LoRA r16.*why fitllm differs: fitllm - PyTorch = .*qlora +blip2-flan-t5-xxl +50 +[0-9.]+ fits .*QLoRA NF4 r16" -- bash -c "'$FITLLM' lab --suite blip2 --scale real --plan-only --peer pytorch --out_dir '$T/labb2p' | tr '\n' ' '"
expect lab_blip2_peer_files 0 "" -- bash -c "grep -q '^### PyTorch would need' '$T/labb2p/report.md' && grep -q '\"pytorch_basis\": \"measured: 32-true, adamw, checkpointing' '$T/labb2p/results.json' && grep -q '\"pytorch_why\": \"why fitllm differs: verdicts: the course OOM, fitllm OOM, PyTorch fits' '$T/labb2p/results.json' && grep -q '| why fitllm differs |' '$T/labb2p/report.md' && grep -q \"title 'PyTorch'\" '$T/labb2p/charts.gp' && grep -q '\"ddp\"' '$T/labb2p/charts.gp' && ! grep -q 'reserved\]' '$T/labb2p/charts.gp'"
# a run that marks its live bytes (the language lab's; BLIP-2's above too: fl_blip2_live) draws them, with no
# [reserved] mark
expect lab_phases_live_marked 0 "" -- bash -c "'$FITLLM' lab --suite ci --only reduced-batch --steps 1 --out_dir '$T/labph' >/dev/null && grep -q '\"reduced-batch\"' '$T/labph/charts.gp' && ! grep -q 'reserved\]' '$T/labph/charts.gp'"
# tests/cuda/lab_session.sh (issue 33's GPU session: the plans, the quick suite, the fsdp and blip2 suites) without a
# GPU: on the CPU with every step --plan-only, each step's exit 0 and files where the device tool fetches them
expect lab_session_plumbing 0 "plan exit 0 .*quick exit 0, [0-9]+ s wall .*fsdp exit 0 .*blip2 exit 0, [0-9]+ s wall .*baseline +opt-2.7b +64x1" -- bash -c "OUT='$T/labsess' LAB_ACCEL=cpu LAB_EXTRA=--plan-only tests/cuda/lab_session.sh '$(dirname "$FITLLM")' 2>&1 | tr '\n' ' '"
expect lab_session_files 0 "" -- bash -c "cd '$T/labsess' && test -s env.txt && test -s plan/report.md && test -s quick/results.json && test -s fsdp/report.md && test -s blip2/report.md && grep -q '^### PyTorch would need' blip2/report.md"
t0=$(date +%s)
# --steps 1 (make test time: 37 -> 17 CPU s): the verdicts, files and charts checked below are those of 2 steps. The
# quick tier leaves out the rows of the ci suite that lab_ci_suite_verdicts trains and asserts in the release unit pass
# (the same table rows: their verdicts, planned = measured, more): even-larger-b1, sgd, ddp, fsdp (21 -> 16 CPU s)
LABQ_CI=" even-larger-b1 sgd ddp fsdp "; LABQ=()
full_tier || LABQ=(--only baseline,reduced-batch,grad-accum,grad-accum-lr,bf16-true,bf16-mixed,larger-model,even-larger,adam8bit,act-ckpt,cpu-offload,lora,qlora,fsdp-larger-batch)
expect lab_quick 0 "wrote" -- "$FITLLM" lab --suite quick --steps 1 "${LABQ[@]}" --out_dir "$T/lab"
echo "     (quick suite: $(( $(date +%s) - t0 )) s)"
if [ -f "$T/lab/results.csv" ]; then
    v() { awk -F, -v n="$1" '$1 == n { print $10 }' "$T/lab/results.csv"; }
    ok=1
    for pair in baseline:OOM reduced-batch:fits grad-accum:fits grad-accum-lr:fits larger-model:fits even-larger:OOM cpu-offload:fits \
                even-larger-b1:OOM sgd:fits adam8bit:fits act-ckpt:fits bf16-mixed:fits lora:fits bf16-true:fits qlora:fits ddp:fits fsdp:fits \
                fsdp-larger-batch:fits; do
        [ ${#LABQ[@]} -gt 0 ] && [[ $LABQ_CI == *" ${pair%%:*} "* ]] && continue
        got=$(v "${pair%%:*}"); [ "$got" = "${pair#*:}" ] || { echo "     ${pair%%:*}: $got, want ${pair#*:}"; ok=0; }
    done
    grep -q "NO" <(awk -F, 'NR > 1 { print $12 }' "$T/lab/results.csv") && { echo "     a verdict differs from the lab's"; ok=0; }
    for f in report.md results.json; do [ -s "$T/lab/$f" ] || { echo "     missing $f"; ok=0; }; done
    if command -v gnuplot >/dev/null; then [ -s "$T/lab/memory.png" ] && [ -s "$T/lab/step_time.png" ] || { echo "     no charts"; ok=0; }; fi
    if [ $ok = 1 ]; then echo "ok   lab_quick_verdicts_and_files"; pass=$((pass+1)); else echo "FAIL lab_quick_verdicts_and_files"; fail=$((fail+1)); fi
    # charts.gp redraws from its own folder, as its first line says (paths relative to it)
    if command -v gnuplot >/dev/null; then
        rm -f "$T/lab/"*.png
        expect lab_charts_from_folder 0 "" -- bash -c "cd '$T/lab' && gnuplot charts.gp && test -s memory.png && test -s phases.png && test -s step_time.png"
    fi
    # the report shows reserved vs live per phase and time per sample with the reason a row costs more
    expect lab_report_live_and_per_sample 0 "" -- bash -c "grep -q 'Reserved and live memory per phase' '$T/lab/report.md' && grep -q 'ms/sample' '$T/lab/report.md' && grep -q 'recomputes every block.s forward but the last' '$T/lab/report.md' && grep -q 'after_fwd,live' '$T/lab/phases.csv'"
fi

# fitllm lab --suite fsdp (the GPT-2-XL FSDP batch-size sweep; the whole sweep takes minutes, the library test
# runs three rows): one row per setting through the CLI, its sweep tables and chart data; a batch name of another
# suite is a usage error
expect lab_fsdp_bad_only 2 "unknown experiment 'sgd' in suite fsdp" -- "$FITLLM" lab --suite fsdp --only sgd --out_dir "$T/labf0"
expect lab_fsdp_rows 0 "batch-size sweep, activation checkpointing on" -- "$FITLLM" lab --suite fsdp --only b1,b1-ckpt --steps 1 --out_dir "$T/labf"
# its report.md describes the course's FSDP benchmark's scaling (16 GiB per rank of gpt2-xl), not TinyLlama's 80 GB
expect lab_fsdp_report_scaling 0 "Budget per rank\*\* = 16 GiB x params\(lab-gpt2-xl\) / params\(gpt2-xl\)" -- cat "$T/labf/report.md"
if grep -q "TinyLlama-1.1B on one 80 GB GPU\|on an 80 GB" "$T/labf/report.md"; then echo "FAIL lab_fsdp_report_not_tinyllama"; fail=$((fail+1))
else echo "ok   lab_fsdp_report_not_tinyllama"; pass=$((pass+1)); fi
expect lab_fsdp_bad_precision 2 "not 32-true or 16-mixed" -- "$FITLLM" lab --suite fsdp --precision bf16-true --out_dir "$T/labf1"
expect lab_fsdp_bad_model 2 "not gpt2-xl or gpt2-xxl" -- "$FITLLM" lab --suite fsdp --model gpt2-huge --out_dir "$T/labf1"
expect lab_fsdp_bad_prefetch 2 "is not on .BACKWARD_PRE, true. or off" -- "$FITLLM" lab --suite fsdp --fsdp.backward_prefetch maybe --out_dir "$T/labf1"
expect lab_fsdp_bad_peak 2 "--peak-tflops: 'x' is not a positive number" -- "$FITLLM" lab --suite fsdp --peak-tflops x --out_dir "$T/labf1"
# the course's AMP row with the course's figures beside it (batch 8: 14992 MB), prefetch off, MFU from the given peak
expect lab_fsdp_amp_course 0 "    8\\* fits .* [0-9.]+% \\| fits +[0-9.]+ \\|  14992  88.1   36.80    1676" -- "$FITLLM" lab --suite fsdp --only amp-b8 --steps 1 --fsdp.backward_prefetch off --peak-tflops 1 --out_dir "$T/labf2"
expect lab_fsdp_xxl 0 "suite fsdp: lab-gpt2-xxl" -- "$FITLLM" lab --suite fsdp --model gpt2-xxl --only amp-b8-ckpt --steps 1 --out_dir "$T/labf3"
expect lab_fsdp_report 0 "" -- bash -c "grep -q '^## Batch-size sweep' '$T/labf/report.md' && grep -q '^| \*\*1\*\* | fits | fits |' '$T/labf/report.md' && test -s '$T/labf/sweep.dat' && grep -q \"'sweep.png'\" '$T/labf/charts.gp'"

# PEFT LoRA adapters: merge_lora writes a merged HF folder; generate --adapter merges in memory
expect merge_lora_ok 0 "merged" -- "$FITLLM" merge_lora tests/fixtures/peft-llama --base tests/fixtures/golden-llama --out_dir "$T/merged"
a=$("$FITLLM" generate "$T/merged" --prompt-ids "1 2 3" --max_new_tokens 6 --temperature 0 2>/dev/null)
b=$("$FITLLM" generate tests/fixtures/golden-llama --adapter tests/fixtures/peft-llama --prompt-ids "1 2 3" --max_new_tokens 6 --temperature 0 2>/dev/null)
c=$("$FITLLM" generate tests/fixtures/golden-llama --prompt-ids "1 2 3" --max_new_tokens 6 --temperature 0 2>/dev/null)
if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" != "$c" ]; then echo "ok   generate_adapter_equals_merged"; pass=$((pass+1)); else echo "FAIL generate_adapter_equals_merged: '$a' '$b' '$c'"; fail=$((fail+1)); fi
# lm_head adapter (PEFT-written, with lm_head.base_layer.weight): merge_lora == generate --adapter
expect merge_lora_head_ok 0 "merged" -- "$FITLLM" merge_lora tests/fixtures/peft-llama-head --base tests/fixtures/golden-llama --out_dir "$T/merged-head"
a=$("$FITLLM" generate "$T/merged-head" --prompt-ids "1 2 3" --max_new_tokens 6 --temperature 0 2>/dev/null)
b=$("$FITLLM" generate tests/fixtures/golden-llama --adapter tests/fixtures/peft-llama-head --prompt-ids "1 2 3" --max_new_tokens 6 --temperature 0 2>/dev/null)
if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" != "$c" ]; then echo "ok   generate_head_adapter_equals_merged"; pass=$((pass+1)); else echo "FAIL generate_head_adapter_equals_merged: '$a' '$b' '$c'"; fail=$((fail+1)); fi
# per-module r and alpha (PEFT's rank_pattern / alpha_pattern; test_lora.c peft_rank_pattern_merge_vs_peft): merged on
# the opaque backend (merge_lora's device path) == generate --adapter (the host's)
expect merge_lora_rank_pattern 0 "merged" -- env FITLLM_BACKEND=opaque "$FITLLM" merge_lora tests/fixtures/peft-llama-pattern --base tests/fixtures/golden-llama --out_dir "$T/merged-pat"
a=$("$FITLLM" generate "$T/merged-pat" --prompt-ids "1 2 3" --max_new_tokens 6 --temperature 0 2>/dev/null)
b=$("$FITLLM" generate tests/fixtures/golden-llama --adapter tests/fixtures/peft-llama-pattern --prompt-ids "1 2 3" --max_new_tokens 6 --temperature 0 2>/dev/null)
if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" != "$c" ]; then echo "ok   generate_rank_pattern_adapter_equals_merged"; pass=$((pass+1)); else echo "FAIL generate_rank_pattern_adapter_equals_merged: '$a' '$b' '$c'"; fail=$((fail+1)); fi
expect merge_lora_base_missing 2 "peft-llama/adapter_config.json: base model 'golden-llama' \(base_model_name_or_path\) not found.*give the base model folder with --base <dir>" -- "$FITLLM" merge_lora tests/fixtures/peft-llama --out_dir "$T/m2"
expect generate_adapter_base_missing 2 "base model 'golden-llama' .*not found.*fitllm generate <base_dir> --adapter tests/fixtures/peft-llama" -- "$FITLLM" generate tests/fixtures/peft-llama --prompt-ids "1 2"
expect merge_lora_wrong_base 2 "peft-llama" -- "$FITLLM" merge_lora tests/fixtures/peft-llama --base tests/fixtures/golden-gpt2 --out_dir "$T/m3"
expect merge_lora_not_adapter 2 "adapter_config.json" -- "$FITLLM" merge_lora "$T" --base tests/fixtures/golden-llama
# --out_dir the base model's folder (an adapter naming it would then merge onto merged weights) or the adapter's:
# refused, the base unchanged
cp -r tests/fixtures/golden-llama "$T/base-copy"; cp -r tests/fixtures/peft-llama "$T/peft-copy"
expect merge_lora_out_is_base 2 "--out_dir '.*/base-copy' is the base model's folder .*: the merge would overwrite it" -- \
    "$FITLLM" merge_lora "$T/peft-copy" --base "$T/base-copy" --out_dir "$T/base-copy"
expect merge_lora_out_is_base_unchanged 0 "" -- cmp tests/fixtures/golden-llama/model.safetensors "$T/base-copy/model.safetensors"
expect merge_lora_out_is_adapter 2 "--out_dir '.*/peft-copy/' is the adapter's folder" -- \
    "$FITLLM" merge_lora "$T/peft-copy" --base "$T/base-copy" --out_dir "$T/peft-copy/"
# Ctrl-C / SIGTERM while convert, merge_lora or a checkpoint writes (each write slowed by the testing aid
# FITLLM_FAULT_WRITE_DELAY_MS so that the signal lands inside it): the file or folder under way is removed, the message
# says what is left, exit 128 + the signal. stop_write NAME SIG RC ERE GLOB -- cmd...: the signal once GLOB exists;
# afterwards nothing may match it
stop_write() {
    local name=$1 sig=$2 want=$3 pat=$4 glob=$5 i rc; shift 6
    env FITLLM_FAULT_WRITE_DELAY_MS=200 "$@" >"$T/$name.log" 2>"$T/$name.err" & BG=$!
    for i in $(seq 600); do compgen -G "$glob" >/dev/null && break; kill -0 $BG 2>/dev/null || break; sleep 0.05; done
    kill -"$sig" $BG; wait $BG; rc=$?
    if [ $rc -ne "$want" ] || ! grep -qE -- "$pat" "$T/$name.err" || compgen -G "$glob" >/dev/null; then
        echo "FAIL $name: exit $rc (want $want); left: $(compgen -G "$glob" | head -2 | tr '\n' ' ')"
        sed 's/^/     /' "$T/$name.err" | tail -3; fail=$((fail+1))
    else echo "ok   $name"; pass=$((pass+1)); fi
}
stop_write convert_ctrl_c INT 130 "fitllm convert: stopped by SIGINT \(Ctrl-C\); nothing was written$" "$T/cv-int*" -- \
    "$FITLLM" convert tests/fixtures/golden-llama "$T/cv-int"
stop_write merge_lora_sigterm TERM 143 "fitllm merge_lora: stopped by SIGTERM; nothing was written$" "$T/mg-int*" -- \
    "$FITLLM" merge_lora "$T/peft-copy" --base "$T/base-copy" --out_dir "$T/mg-int"

# sharded checkpoints (--fsdp.state_dict_type sharded) in one process: one shard file, no model.safetensors in a step
# checkpoint; merge_shards writes the model.safetensors a full checkpoint holds; bad input named, exit 2
SH=(micro --data.n_train 13 --data.n_val 3 --train.micro_batch_size 2 --train.global_batch_size 2 --train.max_steps 2
    --train.save_interval 2 --train.max_seq_length 32 --eval.max_new_tokens 0 --eval.final_validation false --threads 1)
expect sharded_save 0 "Saved the final model" -- "$FITLLM" finetune_full "${SH[@]}" --fsdp.state_dict_type sharded --out_dir "$T/shs"
# FULL_SHARD with sharded checkpoints (one process: one rank holds every unit whole; the threads
# and MPI tests run its per-unit pieces)
expect fsdp_sharded_ckpt 0 "Saved the final model" -- "$FITLLM" finetune_full "${SH[@]}" --strategy fsdp --fsdp.state_dict_type sharded --out_dir "$T/shfs"
expect sharded_full_twin 0 "Saved the final model" -- "$FITLLM" finetune_full "${SH[@]}" --out_dir "$T/shf"
expect merge_shards_ok 0 "merged .*step-000002 -> .*shm \(config.json, model.safetensors" -- "$FITLLM" merge_shards "$T/shs/step-000002" --out "$T/shm"
if [ -f "$T/shs/step-000002/shard-00000-of-00001.safetensors" ] && [ ! -e "$T/shs/step-000002/model.safetensors" ] \
    && cmp -s "$T/shm/model.safetensors" "$T/shf/step-000002/model.safetensors"; then
    echo "ok   merge_shards_equals_full_checkpoint"; pass=$((pass+1))
else
    echo "FAIL merge_shards_equals_full_checkpoint"; fail=$((fail+1))
fi
expect merge_shards_help 0 "usage: fitllm merge_shards <ckpt_dir>" -- "$FITLLM" merge_shards --help
expect merge_shards_missing_arg 2 "missing <ckpt_dir>" -- "$FITLLM" merge_shards
expect merge_shards_not_sharded 2 "shf/step-000002: not a sharded checkpoint .*holds model.safetensors already" -- "$FITLLM" merge_shards "$T/shf/step-000002" --out "$T/shx"
cp -r "$T/shs/step-000002" "$T/shbad" && rm -f "$T/shbad/shard-00000-of-00001.safetensors"
expect merge_shards_missing_file 2 "shbad/shard-00000-of-00001.safetensors: missing" -- "$FITLLM" merge_shards "$T/shbad" --out "$T/shx"
expect resume_sharded_missing_file 2 "shard-00000-of-00001.safetensors: missing" -- "$FITLLM" finetune_full "${SH[@]}" --resume "$T/shbad" --out_dir "$T/shr"
expect generate_sharded_hint 2 "a sharded checkpoint: write its Hugging Face folder with fitllm merge_shards" -- "$FITLLM" generate "$T/shs/step-000002" --prompt-ids "1 2"
expect sharded_bad_value 2 "fsdp.state_dict_type 'shard': unknown \(full or sharded\)" -- "$FITLLM" finetune_full "${SH[@]}" --fsdp.state_dict_type shard --out_dir "$T/shy"
expect sharded_lora_refused 2 "finetune_lora's checkpoints are PEFT adapters" -- "$FITLLM" finetune_lora "${SH[@]}" --fsdp.state_dict_type sharded --out_dir "$T/shz"
[ ! -e "$T/shx" ] && [ ! -e "$T/shr/final" ] && { echo "ok   sharded_bad_input_writes_nothing"; pass=$((pass+1)); } || { echo "FAIL sharded_bad_input_writes_nothing"; fail=$((fail+1)); }

if [ -d "$DATA/stories260K-hf" ]; then
    printf '1 403 407 261 378 434 2 9 19 5\n' > "$T/ids.txt"
    expect loss_real_model 0 "loss [0-9.]+" -- "$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/ids.txt" --dump-logits "$T/logits.f32"
    sz=$(stat -c %s "$T/logits.f32" 2>/dev/null || echo 0)
    if [ "$sz" -eq $((9 * 512 * 4)) ]; then echo "ok   dump_logits_size"; pass=$((pass+1)); else echo "FAIL dump_logits_size: $sz bytes"; fail=$((fail+1)); fi
    expect loss_dump_unwritable 1 "cannot write logits" -- "$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/ids.txt" --dump-logits /proc/nope/x.f32
    # a dump through a symlink replaces its target (the link kept); into a FIFO or a device node it writes in place
    # (as root a rename replaced /dev/full by a regular file, and reported success)
    echo old > "$T/dl-real.f32"; ln -sfn dl-real.f32 "$T/dl-link.f32"; rm -f "$T/dl-pipe"; mkfifo "$T/dl-pipe"
    "$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/ids.txt" --dump-logits "$T/dl-link.f32" >/dev/null 2>&1
    ( exec 3<"$T/dl-pipe"; wc -c <&3 >"$T/dl-pipe.n" ) & rdr=$!
    "$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/ids.txt" --dump-logits "$T/dl-pipe" >/dev/null 2>&1 &
    wtr=$!; { sleep 60; kill $rdr $wtr 2>/dev/null; } & guard=$!; wait $wtr; wait $rdr; kill $guard 2>/dev/null
    if [ -L "$T/dl-link.f32" ] && [ "$(stat -c %s "$T/dl-real.f32")" -eq $((9 * 512 * 4)) ] && [ -p "$T/dl-pipe" ] &&
        [ "$(cat "$T/dl-pipe.n" 2>/dev/null)" = $((9 * 512 * 4)) ]; then
        echo "ok   loss_dump_link_and_fifo_kept"; pass=$((pass+1))
    else echo "FAIL loss_dump_link_and_fifo_kept: $(ls -l "$T"/dl-* | tr '\n' ' ')"; fail=$((fail+1)); fi
    if rm -f "$T/dl-full" && mknod "$T/dl-full" c 1 7 2>/dev/null; then # root: a node of /dev/full's numbers
        expect loss_dump_full_device 1 "cannot write logits: .*dl-full: write failed: No space left on device" -- \
            "$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/ids.txt" --dump-logits "$T/dl-full"
        [ -c "$T/dl-full" ] && { echo "ok   loss_dump_full_device_kept"; pass=$((pass+1)); } ||
            { echo "FAIL loss_dump_full_device_kept: $(ls -l "$T/dl-full")"; fail=$((fail+1)); }
    fi
    # a truncated safetensors copy of a real model
    mkdir -p "$T/trunc"; cp "$DATA/stories260K-hf/config.json" "$T/trunc/"
    head -c 5000 "$DATA/stories260K-hf/model.safetensors" > "$T/trunc/model.safetensors"
    expect loss_truncated_safetensors 1 "model.safetensors" -- "$FITLLM" loss "$T/trunc" --tokens-file "$T/ids.txt"
    # training commands end to end on the real model (synthetic and Alpaca data)
    expect finetune_synthetic 0 "Saved the final model" -- "$FITLLM" finetune_full --config recipes/cpu/stories260k-full-synthetic.yaml \
        --out_dir "$T/ft-syn" --train.max_steps 10 --eval.interval 5 --train.save_interval 5 --quiet
    expect generate_from_final 0 "" -- "$FITLLM" generate "$T/ft-syn/final" --prompt "Once upon a time" --max_new_tokens 8 --temperature 0
    # loss takes a run folder as generate does: its final/ (it said "folder has no config.json")
    expect loss_run_folder 0 "is a run folder: its final checkpoint .*ft-syn/final" -- "$FITLLM" loss "$T/ft-syn" --tokens-file "$T/ids.txt"
    expect loss_run_folder_same 0 "" -- bash -c '[ "$("$1" loss "$2" --tokens-file "$3" 2>/dev/null | cut -d" " -f1-4)" = "$("$1" loss "$2/final" --tokens-file "$3" 2>/dev/null | cut -d" " -f1-4)" ]' _ "$FITLLM" "$T/ft-syn" "$T/ids.txt"
    mkdir -p "$T/ft-empty/logs"
    expect loss_run_folder_no_ckpt 2 "ft-empty: a run folder without a committed checkpoint yet" -- "$FITLLM" loss "$T/ft-empty" --tokens-file "$T/ids.txt"
    expect finetune_alpaca 0 "Final evaluation" -- "$FITLLM" finetune_full --config recipes/cpu/stories260k-full-alpaca.yaml \
        --data.json_path "$DATA/instruct/alpaca-tiny.json" --out_dir "$T/ft-alp" --train.epochs 1 --quiet
    expect finetune_used_out_dir 2 "holds another run" -- "$FITLLM" finetune_full "$DATA/stories260K-hf" --out_dir "$T/ft-syn" --train.max_steps 1
    expect finetune_resume_auto 0 "Resuming training from" -- "$FITLLM" finetune_full --config recipes/cpu/stories260k-full-synthetic.yaml \
        --out_dir "$T/ft-syn" --train.max_steps 12 --train.save_interval 5 --resume auto --quiet
    expect finetune_init_random 0 "loss train: 6\.2" -- "$FITLLM" finetune_full "$DATA/stories260K-hf" --init random \
        --train.max_steps 1 --train.global_batch_size 1 --eval.final_validation false --out_dir "$T/x9" --quiet
    # a LoRA run's resume over another base than its adapters were trained on: random weights (--init random) then
    # the folder's pretrained ones, and the reverse, refused naming the --init that resumes it (the adapters went on
    # over the new base silently and named the old one)
    LI=(finetune_lora "$DATA/stories260K-hf" --data Synthetic --train.max_steps 2 --train.save_interval 1
        --train.global_batch_size 1 --eval.final_validation false --eval.max_new_tokens 0 --quiet)
    "$FITLLM" "${LI[@]}" --init random --train.max_steps 1 --out_dir "$T/li-r" >/dev/null 2>&1
    "$FITLLM" "${LI[@]}" --train.max_steps 1 --out_dir "$T/li-p" >/dev/null 2>&1
    expect lora_resume_random_base_as_pretrained 2 "trained over random base weights \(init random\), this run would train them over the pretrained ones.*--init random" -- \
        "$FITLLM" "${LI[@]}" --out_dir "$T/li-r" --resume auto
    expect lora_resume_pretrained_base_as_random 2 "trained over pretrained base weights \(init pretrained\), this run would train them over random ones.*--init pretrained" -- \
        "$FITLLM" "${LI[@]}" --init random --out_dir "$T/li-p" --resume auto
    expect lora_resume_random_base_same_init 0 "Resuming training from" -- "$FITLLM" "${LI[@]}" --init random --out_dir "$T/li-r" --resume auto
    # pretrain's evaluation sample continues a validation text (the first .txt file), not the Alpaca instruction
    mkdir -p "$T/ptxt"
    for i in $(seq 40); do echo "Lily and Ben went to the park to play with a big red ball. They ran and laughed all day."; done > "$T/ptxt/a.txt"
    head -c 20000 "$DATA/text/tinystories-val-prefix.txt" > "$T/ptxt/b.txt"
    out=$("$FITLLM" pretrain --model_config "$DATA/stories260K-hf/config.json" --tokenizer_dir "$DATA/stories260K-hf" \
          --data TextFiles --data.train_data_path "$T/ptxt" --train.max_seq_length 64 --train.max_steps 1 \
          --train.global_batch_size 2 --train.micro_batch_size 2 --eval.interval 1 --eval.max_new_tokens 8 --out_dir "$T/pt-gen" 2>&1)
    if grep -q "^Lily and Ben went to the park" <<<"$out" && ! grep -q "Recommend a movie" <<<"$out"; then echo "ok   pretrain_sample_continues_val_text"; pass=$((pass+1))
    else echo "FAIL pretrain_sample_continues_val_text"; echo "$out" | grep -vE "reserved|live" | tail -8 | sed 's/^/     /'; fail=$((fail+1)); fi
    # a diverged run stops: the step, the value and a hint, exit 1, no final/, the good checkpoints kept
    expect finetune_diverged 1 "diverged at step 3 \(iter 9\): the loss is NaN.*lower the learning rate" -- "$FITLLM" finetune_full "$DATA/stories260K-hf" \
        --data JSON --data.json_path "$DATA/instruct/alpaca-tiny.json" --train.max_seq_length 128 --train.micro_batch_size 4 \
        --train.max_steps 4 --train.save_interval 1 --optimizer.lr 1e30 --eval.max_new_tokens 0 --out_dir "$T/div"
    if [ ! -e "$T/div/final" ] && [ -d "$T/div/step-000001" ]; then echo "ok   finetune_diverged_no_final"; pass=$((pass+1)); else echo "FAIL finetune_diverged_no_final"; fail=$((fail+1)); fi
    # a checkpoint holding a NaN weight is refused, naming the tensor (model folder and --resume)
    poke_nan() { # first 4 data bytes of a safetensors file := f32 NaN
        local hl; hl=$(od -An -t u8 -N8 "$1" | tr -d ' ')
        printf '\x00\x00\xc0\x7f' | dd of="$1" bs=1 seek=$((8 + hl)) conv=notrunc status=none
    }
    mkdir -p "$T/nanmodel"; cp "$DATA/stories260K-hf"/* "$T/nanmodel/"; poke_nan "$T/nanmodel/model.safetensors"
    expect load_nan_weights 1 "tensor '[a-z_.0-9]+' holds a non-finite value" -- "$FITLLM" generate "$T/nanmodel" --prompt "Once" --max_new_tokens 2
    # convert refuses it as the loaders do (it copied it without a word): exit 1, nothing written
    expect convert_nan_weights 1 "nanmodel/model.safetensors: tensor '[a-z_.0-9]+' holds a non-finite value \(inf/NaN\) at element 0" -- \
        "$FITLLM" convert "$T/nanmodel" "$T/nanconv"
    [ -z "$(ls -d "$T"/nanconv* 2>/dev/null)" ] && { echo "ok   convert_nan_wrote_nothing"; pass=$((pass+1)); } || { echo "FAIL convert_nan_wrote_nothing"; fail=$((fail+1)); }
    poke_nan "$T/div/step-000001/model.safetensors"
    expect resume_nan_weights 1 "step-000001/model.safetensors: tensor '[a-z_.0-9]+' holds a non-finite value" -- "$FITLLM" finetune_full "$DATA/stories260K-hf" \
        --data JSON --data.json_path "$DATA/instruct/alpaca-tiny.json" --train.max_seq_length 128 --train.micro_batch_size 4 \
        --train.max_steps 4 --out_dir "$T/div" --resume "$T/div/step-000001"
    # stdout and stderr to one file: the generated text ends its line before the statistics; an error
    # comes after the training lines printed before it
    "$FITLLM" generate "$DATA/stories260K-hf" --prompt "Once" --max_new_tokens 4 --temperature 0 > "$T/gen.txt" 2>&1
    if sed -n 2p "$T/gen.txt" | grep -qE "^[0-9]+ prompt \+ [0-9]+ new tokens"; then echo "ok   generate_stats_own_line"; pass=$((pass+1));
    else echo "FAIL generate_stats_own_line"; sed 's/^/     /' "$T/gen.txt"; fail=$((fail+1)); fi
    # generate stops at every EOS id of generation_config.json (else config.json), an id or a list, plus the
    # tokenizer's, as transformers' generate: greedy from BOS with eos_token_id [2, 13] it stops at the first 13, a
    # sequence of 63 tokens, BOS and 62 new (transformers' generate(do_sample=False) on this folder); --prompt-ids loads
    # no tokenizer, so the ids are the files' alone (it stopped at none and ran to 100)
    mkdir -p "$T/eosl" && cp "$DATA/stories260K-hf"/* "$T/eosl/"
    sed -i 's/"eos_token_id": 2,/"eos_token_id": [2, 13],/' "$T/eosl/config.json"
    EOSG=(--prompt-ids 1 --temperature 0 --max_new_tokens 100)
    expect generate_eos_config_list 0 "^1 prompt \+ 62 new tokens \(stop: EOS\).*; EOS ids 2 13 \(config.json\)$" -- "$FITLLM" generate "$T/eosl" "${EOSG[@]}"
    expect generate_eos_config_list_last 0 " 13$" -- bash -c '"$1" generate "$2" "${@:3}" 2>/dev/null' _ "$FITLLM" "$T/eosl" "${EOSG[@]}"
    # generation_config.json's list wins over config.json's (transformers' GenerationConfig.from_pretrained)
    printf '{"bos_token_id": 1, "eos_token_id": [2]}' > "$T/eosl/generation_config.json"
    expect generate_eos_generation_config_first 0 "^1 prompt \+ 100 new tokens \(stop: max_new_tokens\).*EOS ids 2 \(generation_config.json\)$" -- "$FITLLM" generate "$T/eosl" "${EOSG[@]}"
    printf '{"eos_token_id": 13}' > "$T/eosl/generation_config.json"
    sed -i 's/"eos_token_id": \[2, 13\],/"eos_token_id": 2,/' "$T/eosl/config.json"
    expect generate_eos_generation_config 0 "^1 prompt \+ 62 new tokens \(stop: EOS\).*EOS ids 13 \(generation_config.json\)$" -- "$FITLLM" generate "$T/eosl" "${EOSG[@]}"
    # with the text (the tokenizer's EOS added; the streamed text stops where the ids did)
    expect generate_eos_with_tokenizer 0 "^1 prompt \+ 62 new tokens \(stop: EOS\).*EOS ids 13 2 \(generation_config.json \+ the tokenizer\)$" -- \
        "$FITLLM" generate "$T/eosl" --prompt "" --temperature 0 --max_new_tokens 100
    printf '{"eos_token_id": "</s>"}' > "$T/eosl/generation_config.json"
    expect generate_eos_bad_generation_config 1 "generation_config.json: key 'eos_token_id' must be a token id or a list of token ids" -- "$FITLLM" generate "$T/eosl" "${EOSG[@]}"
    # an empty prompt with a tokenizer that adds no BOS (GPT-2's): the hint names the model's id to start from
    expect generate_empty_prompt_hint 2 "the prompt encodes to no tokens \(and the tokenizer adds no BOS\): to start from nothing, give --prompt-ids 50256 \(the model's BOS token\)" -- \
        "$FITLLM" generate "$DATA/tiny-gpt2-hf" --prompt "" --max_new_tokens 2
    # ... and with none asked, the empty prompt is printed as it is, as any prompt is (--help)
    expect generate_empty_prompt_none_asked 0 "0 prompt \+ 0 new tokens \(stop: max_new_tokens\); nothing run" -- \
        "$FITLLM" generate "$DATA/tiny-gpt2-hf" --prompt "" --max_new_tokens 0
    # --max_new_tokens 0: a prompt longer than the context (1,499 tokens here, the context 512) printed as it is
    LONGP=$(head -c 3000 "$DATA/text/tinystories-val-prefix.txt")
    expect generate_long_prompt_none_asked 0 "^[0-9]{4} prompt \+ 0 new tokens \(stop: max_new_tokens\); nothing run" -- "$FITLLM" generate "$DATA/stories260K-hf" --prompt "$LONGP" --max_new_tokens 0
    expect generate_long_prompt_printed 0 "" -- bash -c '[ "$("$1" generate "$2" --prompt "$3" --max_new_tokens 0 2>/dev/null)" = "$3" ]' _ "$FITLLM" "$DATA/stories260K-hf" "$LONGP"
    # convert takes a llama2.c .bin (as README's "Checkpoints in" says): the folder's logits are the .bin's (the loss of
    # the same ids, printed to 6 decimals, and the dumped logits byte for byte), its tokenizer (tok512.bin) copied
    expect convert_llama2c_bin 0 "converted .*stories260K.bin -> .*cv260 \([0-9]+ tensors, safetensors\)" -- "$FITLLM" convert "$DATA/stories260K/stories260K.bin" "$T/cv260"
    lb=$("$FITLLM" loss "$DATA/stories260K/stories260K.bin" --tokens-file "$T/ids.txt" --dump-logits "$T/lg-bin.f32" 2>&1 | head -1 | cut -d' ' -f1-4)
    lc=$("$FITLLM" loss "$T/cv260" --tokens-file "$T/ids.txt" --dump-logits "$T/lg-cv.f32" 2>&1 | head -1 | cut -d' ' -f1-4)
    if [ -n "$lb" ] && [ "$lb" = "$lc" ] && cmp -s "$T/lg-bin.f32" "$T/lg-cv.f32" && [ -f "$T/cv260/tok512.bin" ]; then
        echo "ok   convert_llama2c_bin_same_logits"; pass=$((pass+1))
    else echo "FAIL convert_llama2c_bin_same_logits: '$lb' vs '$lc'"; ls "$T/cv260" | sed 's/^/     /'; fail=$((fail+1)); fi
    expect convert_llama2c_generates 0 "^Once upon a time" -- "$FITLLM" generate "$T/cv260" --prompt "Once upon a time" --max_new_tokens 4 --temperature 0
    expect convert_not_a_bin 2 "notes.txt: a file: convert takes a model folder or a llama2.c .bin" -- bash -c 'echo x > "$2/notes.txt"; "$1" convert "$2/notes.txt" "$2/cvx"' _ "$FITLLM" "$T"
    "$FITLLM" finetune_full "$DATA/stories260K-hf" --data JSON --data.json_path "$DATA/instruct/alpaca-tiny.json" --train.max_seq_length 128 \
        --train.micro_batch_size 4 --train.max_steps 3 --optimizer.lr 1e30 --eval.max_new_tokens 0 --out_dir "$T/div2" > "$T/div2.txt" 2>&1
    if tail -n 1 "$T/div2.txt" | grep -q "error: training diverged" && grep -q "^Epoch" "$T/div2.txt"; then echo "ok   error_after_training_lines"; pass=$((pass+1));
    else echo "FAIL error_after_training_lines"; tail -3 "$T/div2.txt" | sed 's/^/     /'; fail=$((fail+1)); fi
    mkdir -p "$T/emptycfg"; cp "$DATA/stories260K-hf"/* "$T/emptycfg/"; : > "$T/emptycfg/config.json"
    expect generate_empty_config 1 "error: [^ ]*emptycfg/config.json:1:1: expected a value" -- "$FITLLM" generate "$T/emptycfg" --prompt "Once" --max_new_tokens 2
    # a config.json that does not belong to the weights fails at once (no minutes of allocation)
    mkdir -p "$T/absurd"; cp "$DATA/stories260K-hf"/* "$T/absurd/"
    sed -i 's/"num_hidden_layers": *[0-9]*/"num_hidden_layers": 1000000000/' "$T/absurd/config.json"
    expect generate_absurd_layers 1 "num_hidden_layers' = 1000000000 is beyond any real model" -- timeout 20 "$FITLLM" generate "$T/absurd" --prompt "Once" --max_new_tokens 2
    sed -i 's/"num_hidden_layers": *[0-9]*/"num_hidden_layers": 7/' "$T/absurd/config.json"
    expect generate_config_layers_mismatch 1 "says 7 layers \(num_hidden_layers\) but the weights in .* hold 5" -- "$FITLLM" generate "$T/absurd" --prompt "Once" --max_new_tokens 2
    # nothing to learn from: every target masked (prompts masked, responses cut by max_seq_length)
    expect finetune_all_masked 2 "nothing to learn from: every target token of the 95 training samples is masked" -- "$FITLLM" finetune_full "$DATA/stories260K-hf" \
        --data JSON --data.json_path "$DATA/instruct/alpaca-tiny.json" --data.mask_prompt true --train.max_seq_length 8 --train.max_steps 2 --out_dir "$T/masked"
    # a first micro-batch whose every target is masked (its samples cut inside their prompts) has no loss yet: the log
    # says so (it printed "nan"; metrics.csv leaves the cell empty)
    expect mask_prompt_no_target_yet 0 "^Epoch 1 \| iter 1 step 1 \| loss train: n/a \(no target tokens\), val: n/a" -- \
        "$FITLLM" finetune_full "$DATA/stories260K-hf" --data JSON --data.json_path "$DATA/instruct/alpaca-tiny.json" \
        --data.mask_prompt true --train.max_seq_length 128 --train.micro_batch_size 2 --train.global_batch_size 2 \
        --train.max_steps 1 --train.log_interval 1 --eval.max_new_tokens 0 --eval.final_validation false --threads 1 \
        --out_dir "$T/masked1"
    # ---- LoRA outputs: every step-N/ is a PEFT adapter that merge_lora and generate take as it is;
    # final/ and the run folder lead to final/adapter; merge_lora writes a complete HF folder ----
    FL_ABS=$(cd "$(dirname "$FITLLM")" && pwd)/$(basename "$FITLLM")
    LR=("$DATA/stories260K-hf" --data JSON --data.json_path "$DATA/instruct/alpaca-tiny.json" --train.max_seq_length 64
        --train.micro_batch_size 2 --train.global_batch_size 2 --train.save_interval 2 --optimizer.lr 0.05 --eval.max_new_tokens 0 --quiet)
    expect lora_run_steps 0 "Saved the PEFT adapter" -- "$FITLLM" finetune_lora "${LR[@]}" --train.max_steps 4 --out_dir "$T/lo"
    # the adapter's floats as PEFT writes them (0.05, not the float's %.9g 0.0500000007)
    expect lora_config_floats 0 '"lora_alpha": 16,$' -- grep -A1 '"lora_alpha"' "$T/lo/step-000002/adapter_config.json"
    expect lora_config_dropout 0 '"lora_dropout": 0.05,$' -- grep '"lora_dropout"' "$T/lo/step-000002/adapter_config.json"
    ok=1
    for s in step-000002 step-000004; do for f in adapter_config.json adapter_model.safetensors training_state.safetensors tokenizer.json; do
        [ -f "$T/lo/$s/$f" ] || { echo "     missing $s/$f"; ok=0; }; done
        # no config.json: transformers would take the folder for a full model instead of loading the adapter's base
        [ ! -e "$T/lo/$s/config.json" ] || { echo "     $s/config.json"; ok=0; }; done
    # the base by its absolute path, so the adapter works from any directory
    want_base=$(cd "$DATA/stories260K-hf" && pwd -P)
    grep -q "\"base_model_name_or_path\": \"$want_base\"" "$T/lo/step-000002/adapter_config.json" || { echo "     base not absolute:"; grep base_model "$T/lo/step-000002/adapter_config.json"; ok=0; }
    if [ $ok = 1 ]; then echo "ok   lora_step_holds_adapter"; pass=$((pass+1)); else echo "FAIL lora_step_holds_adapter"; fail=$((fail+1)); fi
    # the tokenizer files: the checkpoint's own (the run's tokenizer, as its help says), named so (they came from the
    # base, said to be its folder, though the step carries the run's)
    expect merge_lora_step 0 "adapter: .*/lo/step-000004$" -- "$FITLLM" merge_lora "$T/lo/step-000004"
    expect_saved merge_lora_step_tokenizer_own 0 "2 tokenizer files from .*/lo/step-000004: the checkpoint's, the run's\)" "$EXPECT_OUT" "$EXPECT_RC"
    ok=1
    for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do [ -f "$T/lo/step-000004/merged/$f" ] || { echo "     merged/ lacks $f"; ok=0; }; done
    if [ $ok = 1 ]; then echo "ok   merge_lora_output_is_complete"; pass=$((pass+1)); else echo "FAIL merge_lora_output_is_complete"; fail=$((fail+1)); fi
    # generate: the merged step, the step folder itself (adapter merged in memory) and base --adapter step agree, and differ from the base
    gen() { "$FITLLM" generate "$@" --prompt "Once upon a time" --max_new_tokens 12 --temperature 0 2>/dev/null; }
    a=$(gen "$T/lo/step-000004/merged"); b=$(gen "$T/lo/step-000004"); c=$(gen "$DATA/stories260K-hf" --adapter "$T/lo/step-000004"); d=$(gen "$DATA/stories260K-hf")
    if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$c" ] && [ "$a" != "$d" ]; then echo "ok   generate_lora_step_and_merged"; pass=$((pass+1))
    else echo "FAIL generate_lora_step_and_merged: '$a' '$b' '$c' '$d'"; fail=$((fail+1)); fi
    expect generate_lora_step_says_base 0 "is a LoRA adapter: base model $want_base" -- "$FITLLM" generate "$T/lo/step-000002" --prompt "Once" --max_new_tokens 2
    # final/ -> final/adapter; the run folder -> final/adapter; merging final/adapter gives final/ (same arithmetic: identical logits)
    expect merge_lora_final 0 "adapter: .*/lo/final/adapter \(the PEFT adapter of the checkpoint\)" -- "$FITLLM" merge_lora "$T/lo/final" --out_dir "$T/lo-m-final"
    expect merge_lora_run_folder 0 "adapter: .*/lo/final/adapter \(the final adapter of the run\)" -- "$FITLLM" merge_lora "$T/lo" --out_dir "$T/lo-m-run"
    # final/ is the merged model: its own adapter on top would apply it twice (it did, silently)
    expect generate_final_with_its_adapter 2 "lo/final already has the adapter .*lo/final/adapter merged in" -- \
        "$FITLLM" generate "$T/lo/final" --adapter "$T/lo/final/adapter" --prompt-ids "1 2" --max_new_tokens 1
    printf '1 403 407 261 378 434 2 9 19 5\n' > "$T/lo-ids.txt"
    "$FITLLM" loss "$T/lo/final" --tokens-file "$T/lo-ids.txt" --dump-logits "$T/lo-l1.f32" >/dev/null 2>&1
    "$FITLLM" loss "$T/lo-m-final" --tokens-file "$T/lo-ids.txt" --dump-logits "$T/lo-l2.f32" >/dev/null 2>&1
    "$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/lo-ids.txt" --dump-logits "$T/lo-l0.f32" >/dev/null 2>&1
    if [ -s "$T/lo-l1.f32" ] && cmp -s "$T/lo-l1.f32" "$T/lo-l2.f32" && ! cmp -s "$T/lo-l1.f32" "$T/lo-l0.f32"; then echo "ok   merge_lora_final_equals_final"; pass=$((pass+1))
    else echo "FAIL merge_lora_final_equals_final"; fail=$((fail+1)); fi
    # FITLLM_BACKEND=opaque (a testing aid): the same run, merge, loss and generation on the backend whose
    # tensor memory the host cannot read outside its ops give the same bytes as the CPU backend
    expect opaque_lora_run 0 "Saved the PEFT adapter" -- env FITLLM_BACKEND=opaque "$FITLLM" finetune_lora "${LR[@]}" --train.max_steps 4 --out_dir "$T/lo-opq"
    ok=1
    for f in final/adapter/adapter_model.safetensors final/model.safetensors step-000002/adapter_model.safetensors; do
        cmp -s "$T/lo/$f" "$T/lo-opq/$f" || { echo "     $f differs"; ok=0; }; done
    FITLLM_BACKEND=opaque "$FITLLM" merge_lora "$T/lo/final" --out_dir "$T/lo-m-opq" >/dev/null 2>&1 || ok=0
    cmp -s "$T/lo-m-final/model.safetensors" "$T/lo-m-opq/model.safetensors" || { echo "     merge_lora differs"; ok=0; }
    FITLLM_BACKEND=opaque "$FITLLM" loss "$T/lo/final" --tokens-file "$T/lo-ids.txt" --dump-logits "$T/lo-l3.f32" >/dev/null 2>&1
    cmp -s "$T/lo-l1.f32" "$T/lo-l3.f32" || { echo "     loss --dump-logits differs"; ok=0; }
    e=$(FITLLM_BACKEND=opaque gen "$T/lo/step-000004")
    [ -n "$e" ] && [ "$e" = "$b" ] || { echo "     generate differs: '$e' vs '$b'"; ok=0; }
    if [ $ok = 1 ]; then echo "ok   opaque_backend_same_bytes_as_cpu"; pass=$((pass+1)); else echo "FAIL opaque_backend_same_bytes_as_cpu"; fail=$((fail+1)); fi
    expect backend_env_unknown 2 "unknown backend 'nope' \(this build has: cpu, ref, opaque" -- env FITLLM_BACKEND=nope "$FITLLM" loss "$T/lo/final" --tokens-file "$T/lo-ids.txt"
    # from another working directory (the run used a relative checkpoint_dir)
    expect merge_lora_other_cwd 0 "merged -> m-cwd" -- bash -c "cd '$T' && '$FL_ABS' merge_lora lo/step-000002 --out_dir m-cwd"
    expect generate_merged_other_cwd 0 "" -- bash -c "cd / && '$FL_ABS' generate '$T/m-cwd' --prompt Once --max_new_tokens 4"
    # a base that is not there: the path tried and --base; --base rescues it
    mkdir -p "$T/lo-bad"; cp "$T/lo/step-000002"/adapter_* "$T/lo-bad/"
    sed -i 's|"base_model_name_or_path": "[^"]*"|"base_model_name_or_path": "nowhere/base-model"|' "$T/lo-bad/adapter_config.json"
    expect merge_lora_bad_base 2 "lo-bad/adapter_config.json: base model 'nowhere/base-model' \(base_model_name_or_path\) not found .*--base <dir>" -- "$FITLLM" merge_lora "$T/lo-bad"
    expect merge_lora_bad_base_rescued 0 "base: $DATA/stories260K-hf" -- "$FITLLM" merge_lora "$T/lo-bad" --base "$DATA/stories260K-hf"
    # a step folder's adapter merged in memory (as generate): the loss of merge_lora's output of the same step
    expect loss_on_adapter_folder 0 "is a LoRA adapter: base model .* with it merged in memory" -- "$FITLLM" loss "$T/lo/step-000002" --tokens-file "$T/lo-ids.txt"
    a=$("$FITLLM" loss "$T/lo/step-000002" --tokens-file "$T/lo-ids.txt" 2>/dev/null | sed 's/  model .*//')
    b=$("$FITLLM" loss "$T/m-cwd" --tokens-file "$T/lo-ids.txt" 2>/dev/null | sed 's/  model .*//')
    if [ -n "$a" ] && [ "$a" = "$b" ]; then echo "ok   loss_on_adapter_equals_merged"; pass=$((pass+1))
    else echo "FAIL loss_on_adapter_equals_merged: '$a' vs merge_lora's '$b'"; fail=$((fail+1)); fi
    expect merge_lora_not_lora 2 "a model folder, not a LoRA adapter" -- "$FITLLM" merge_lora "$DATA/stories260K-hf" --out_dir "$T/lo-x"
    # resume from a step folder (holding a merge_lora output); rotation removes old steps whole
    expect lora_resume_from_step 0 "Resuming training from .*step-000004" -- "$FITLLM" finetune_lora "${LR[@]}" --train.max_steps 6 \
        --train.keep_checkpoints 1 --out_dir "$T/lo" --resume "$T/lo/step-000004"
    if [ ! -e "$T/lo/step-000002" ] && [ ! -e "$T/lo/step-000004" ] && [ -f "$T/lo/step-000006/adapter_config.json" ] && \
       [ -z "$(ls -A "$T/lo" | grep -E 'trash|^\.tmp')" ]; then echo "ok   lora_rotation_removes_whole_steps"; pass=$((pass+1))
    else echo "FAIL lora_rotation_removes_whole_steps"; ls -A "$T/lo" | sed 's/^/     /'; fail=$((fail+1)); fi
    expect finetune_not_a_model 2 "checkpoint_dir .*nope-model.: no such file or folder" -- "$FITLLM" finetune_full "$T/nope-model" --out_dir "$T/x1"
    expect finetune_missing_data 2 "nope.json" -- "$FITLLM" finetune_full "$DATA/stories260K-hf" --data JSON --data.json_path "$T/nope.json" --out_dir "$T/x2"
    # ---- LitGPT's config_hub recipes, unedited (tests/fixtures/litgpt-recipes): only the data and
    # checkpoint paths (and sizes, to keep this fast) are given on the command line
    R=tests/fixtures/litgpt-recipes
    expect litgpt_recipe_finetune_full 0 "Saved the final model" -- "$FITLLM" finetune_full --config "$R/finetune/tiny-llama/full.yaml" \
        --checkpoint_dir "$DATA/stories260K-hf" --data.download_dir "$DATA/instruct" --data.file_name alpaca-tiny.json \
        --train.max_steps 2 --train.global_batch_size 4 --train.max_seq_length 128 --eval.max_new_tokens 0 --out_dir "$T/lg-ft" --quiet
    # hyperparameters.yaml: one mapping per group for any YAML reader, and --config of it reproduces the run
    H="$T/lg-ft/final/hyperparameters.yaml"
    if command -v python3 >/dev/null && python3 -c "import yaml" 2>/dev/null; then
        expect hyperparameters_pyyaml 0 "^ok$" -- python3 -c "
import yaml, sys
d = yaml.safe_load(open(sys.argv[1]))
t, o = d['train'], d['optimizer']
assert t['global_batch_size'] == 4 and t['micro_batch_size'] == 4 and t['max_steps'] == 2 and t['max_seq_length'] == 128, t
assert t['lr_warmup_steps'] == 1000 and t['max_tokens'] is None and t['min_lr'] == 6e-05, t
assert d['eval']['interval'] == 25 and d['eval']['max_new_tokens'] is None and d['precision'] == 'bf16-true', d
assert o['init_args']['lr'] == 0.0002 and o['init_args']['betas'] == [0.9, 0.95] and d['max_memory'] is None, o
assert d['data']['init_args']['val_split_fraction'] == 0.03847 and d['devices'] == 1 and d['resume'] is False, d
print('ok')" "$H"
    else
        echo "skip hyperparameters_pyyaml: no python3 with PyYAML"; skip=$((skip+1))
    fi
    expect hyperparameters_rerun 0 "Saved the final model" -- "$FITLLM" finetune_full --config "$H" --out_dir "$T/lg-ft2"
    if [ -s "$T/lg-ft/logs/metrics.csv" ] && cmp -s <(cut -d, -f1-4 "$T/lg-ft/logs/metrics.csv") <(cut -d, -f1-4 "$T/lg-ft2/logs/metrics.csv"); then
        echo "ok   hyperparameters_rerun_same_losses"; pass=$((pass+1))
    else echo "FAIL hyperparameters_rerun_same_losses"; fail=$((fail+1)); fi
    sed "s|^out_dir: .*|out_dir: $T/lg-ft2|" "$H" > "$T/h1.yaml"
    if cmp -s "$T/h1.yaml" "$T/lg-ft2/final/hyperparameters.yaml"; then echo "ok   hyperparameters_rerun_same_config"; pass=$((pass+1))
    else echo "FAIL hyperparameters_rerun_same_config"; diff "$T/h1.yaml" "$T/lg-ft2/final/hyperparameters.yaml" | head -5; fail=$((fail+1)); fi
    HL=$(find "$T/lora" -name hyperparameters.yaml | head -1)
    if [ -n "$HL" ] && head -1 "$HL" | grep -q "^# fitllm finetune_lora:"; then echo "ok   hyperparameters_lora_header"; pass=$((pass+1))
    else echo "FAIL hyperparameters_lora_header: ${HL:-no hyperparameters.yaml}"; fail=$((fail+1)); fi
    # pretrain: the recipe's data TinyStories is replaced by --data TextFiles (merged before checking);
    # model_config mapping, devices: auto
    expect litgpt_recipe_pretrain 0 "Saved the final model" -- "$FITLLM" pretrain --config "$R/pretrain/tinystories.yaml" \
        --data TextFiles --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/stories260K-hf" \
        --train.max_steps 2 --train.global_batch_size 2 --train.micro_batch_size 1 --train.max_seq_length 32 --out_dir "$T/lg-pt" --quiet
    # debug.yaml: pythia-14m (GPT-NeoX) is refused by name; another model, logger_name tensorboard noted,
    # max_seq_length from the model's context (LitGPT: block_size)
    expect litgpt_recipe_pythia 2 "pythia-14m.*GPT-NeoX" -- "$FITLLM" pretrain --config "$R/pretrain/debug.yaml" \
        --data TextFiles --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/stories260K-hf" --out_dir "$T/lg-pd"
    expect litgpt_recipe_tensorboard 0 "logger_name tensorboard: fitllm writes CSV metrics" -- "$FITLLM" pretrain --config "$R/pretrain/debug.yaml" \
        --model_name micro --data TextFiles --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/stories260K-hf" \
        --train.max_steps 1 --train.global_batch_size 5 --out_dir "$T/lg-pd" --quiet
    # (--eval.final_validation false: the final pass over $DATA/text's 21,011 validation blocks took 8-14 s; small cases run it)
    expect pretrain_textfiles_context 0 "longest input 512" -- "$FITLLM" pretrain --model_name micro --data TextFiles \
        --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/stories260K-hf" --train.max_steps 1 --train.global_batch_size 1 \
        --train.micro_batch_size 1 --devices auto --train.max_tokens 100_000 --eval.final_validation false --out_dir "$T/lg-ctx" --quiet
else
    echo "skip real-model CLI checks: $DATA not found (set FITLLM_DATA)"; skip=$((skip+1))
fi

# ---- models by name: fitllm download against a Hub stand-in on the loopback (tests/hub/hub_server.c),
# repo ids resolved from the download folder and a Hugging Face cache layout, the note on random weights ----
HUBSRV="$(dirname "$FITLLM")/fitllm_hub_server"
FLA=$(cd "$(dirname "$FITLLM")" && pwd)/$(basename "$FITLLM")   # env -C runs it from another folder
HT="$T/hub"; mkdir -p "$HT/work" "$HT/empty-cache"
export HF_HUB_CACHE="$HT/empty-cache"   # never the user's own cache
unset HF_TOKEN FITLLM_CHECKPOINTS
# the first line of the output of a run on a preset says that its weights are random
out=$("$FITLLM" finetune_full gpt2-micro --data Synthetic --train.max_steps 1 --train.global_batch_size 1 \
      --train.micro_batch_size 1 --out_dir "$T/rnd" --quiet 2>&1 | head -1)
if grep -q "random initialization (no weights were loaded): 'gpt2-micro' is a model preset" <<<"$out"; then
    echo "ok   preset_random_note_first_line"; pass=$((pass+1))
else echo "FAIL preset_random_note_first_line: first line '$out'"; fail=$((fail+1)); fi
# (its whole output is kept: tg_generate_preset_gpt2 below checks the same run, the 124M preset built once)
GPT2_OUT=$("$FITLLM" generate gpt2 --prompt_ids "1 2" --max_new_tokens 1 2>&1)
out=$(head -1 <<<"$GPT2_OUT")
if grep -q "random initialization (no weights were loaded): .*fitllm download openai-community/gpt2" <<<"$out"; then
    echo "ok   preset_random_note_names_download"; pass=$((pass+1))
else echo "FAIL preset_random_note_names_download: first line '$out'"; fail=$((fail+1)); fi
# a repo id that is not downloaded is not a random model: where it looked, what to run, the preset for its shape
expect repo_id_not_downloaded 2 "TinyLlama-1.1B-Chat-v1.0 is not downloaded: .*$HT/empty-cache.*run \`fitllm download TinyLlama/TinyLlama-1.1B-Chat-v1.0\` first \(or give the preset name 'tinyllama-1.1b'" -- \
    env -C "$HT/work" "$FLA" finetune_full TinyLlama/TinyLlama-1.1B-Chat-v1.0 --data Synthetic --out_dir "$T/nd"
expect repo_id_not_downloaded_loss 2 "run \`fitllm download karpathy/stories260K\` first" -- \
    env -C "$HT/work" "$FLA" loss karpathy/stories260K --tokens-file "$T/oov.txt"
# the TinyLlama recipe's checkpoints/ORG/NAME: the download command, no preset (random weights) suggested
out=$(env -C "$HT/work" "$FLA" finetune_full --config "$PWD/recipes/tiny-llama-full.yaml" 2>&1); rc=$?
if [ $rc -eq 2 ] && grep -q "run \`fitllm download TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T\`" <<<"$out" \
   && ! grep -q "nearest" <<<"$out"; then echo "ok   recipe_suggests_download"; pass=$((pass+1))
else echo "FAIL recipe_suggests_download: exit $rc"; echo "$out" | tail -3 | sed 's/^/     /'; fail=$((fail+1)); fi
expect plan_repo_id_shape 0 "FITS" -- env -C "$HT/work" "$FLA" plan TinyLlama/TinyLlama-1.1B-Chat-v1.0 --device-memory 80GB
# plan needs no weights: the recipe's checkpoints/ORG/NAME, not downloaded, is planned as its preset's shape
expect plan_recipe_shape 0 "model: tinyllama-1.1b \(preset\)" -- env -C "$HT/work" "$FLA" plan --config "$PWD/recipes/tiny-llama-full.yaml" --device-memory 80GB

if [ -x "$HUBSRV" ] && [ -f "$DATA/stories260K-hf/model.safetensors" ]; then
    SRC="$DATA/stories260K-hf"
    for r in stories260K gated bad; do mkdir -p "$HT/root/fitllm-test/$r"; cp "$SRC"/* "$HT/root/fitllm-test/$r/"; done
    chmod -R u+w "$HT/root"
    (cd "$HT/root/fitllm-test/stories260K" && sha256sum model.safetensors > .sha256)   # an LFS file: its sha256
    cp "$HT/root/fitllm-test/stories260K/.sha256" "$HT/root/fitllm-test/gated/"
    echo "hf_secret" > "$HT/root/fitllm-test/gated/.token"
    (cd "$HT/root/fitllm-test/bad" && sha256sum config.json | sed 's/config.json/model.safetensors/' > .sha256)  # a wrong one
    mkdir -p "$HT/root/fitllm-test/noweights" && cp "$SRC/config.json" "$HT/root/fitllm-test/noweights/"
    hub_start() {   # the stand-in, with server options; HUBPID, HUBURL
        rm -f "$HT/port"
        "$HUBSRV" --root "$HT/root" --port-file "$HT/port" --log "$HT/log" --max-seconds 300 "$@" &
        HUBPID=$!
        for _ in $(seq 100); do [ -s "$HT/port" ] && break; sleep 0.05; done
        HUBURL="http://127.0.0.1:$(cat "$HT/port" 2>/dev/null)"
    }
    hub_stop() { kill "$HUBPID" 2>/dev/null; wait "$HUBPID" 2>/dev/null; }
    CK="$HT/work/checkpoints/fitllm-test/stories260K"
    if "$FITLLM" download --help | grep -q "access_token" && ! "$FITLLM" download a/b 2>&1 | grep -q "without libcurl"; then
        hub_start
        D() { env -C "$HT/work" HF_ENDPOINT="$HUBURL" "$FLA" download "$@"; }
        expect download_ok 0 "model.safetensors: 1.0 MB, sha256 ok.*" -- D fitllm-test/stories260K
        if cmp -s "$CK/model.safetensors" "$SRC/model.safetensors" && cmp -s "$CK/tokenizer.json" "$SRC/tokenizer.json" \
           && [ -f "$CK/config.json" ] && [ -z "$(find "$CK" -name '*.part')" ]; then echo "ok   download_files_identical"; pass=$((pass+1))
        else echo "FAIL download_files_identical"; ls -la "$CK" | sed 's/^/     /'; fail=$((fail+1)); fi
        expect download_again_skips 0 "model.safetensors: already complete" -- D fitllm-test/stories260K
        expect download_401_gated 2 "fitllm-test/gated is gated or private \(HTTP 401.*no access token was given.*--access_token" -- D fitllm-test/gated
        expect download_403_bad_token 2 "HTTP 403.*the token given was refused" -- D fitllm-test/gated --access_token wrong
        [ ! -e "$HT/work/checkpoints/fitllm-test/gated" ] && echo "ok   download_refused_leaves_nothing" && pass=$((pass+1)) \
            || { echo "FAIL download_refused_leaves_nothing"; fail=$((fail+1)); }
        expect download_token_ok 0 "Saved fitllm-test/gated" -- D fitllm-test/gated --access_token hf_secret
        expect download_hf_token_env 0 "Saved fitllm-test/gated" -- env HF_TOKEN=hf_secret HF_ENDPOINT="$HUBURL" "$FITLLM" download fitllm-test/gated --checkpoint_dir "$HT/alt"
        expect download_404 2 "no model repo fitllm-test/nope on http://127.0.0.1:[0-9]+ \(HTTP 404" -- D fitllm-test/nope
        expect download_bad_revision 2 "has no revision 'v9'" -- D fitllm-test/stories260K --revision v9
        expect download_no_weights 2 "no weights fitllm reads" -- D fitllm-test/noweights
        expect download_checksum_mismatch 1 "model.safetensors: checksum mismatch: the Hub says sha256 [0-9a-f]{64}, the download has $(sha256sum "$SRC/model.safetensors" | cut -c1-64)" -- D fitllm-test/bad
        [ -z "$(find "$HT/work/checkpoints" -path '*bad*' -type f)" ] && echo "ok   download_checksum_mismatch_no_files" && pass=$((pass+1)) \
            || { echo "FAIL download_checksum_mismatch_no_files"; find "$HT/work/checkpoints" -path '*bad*'; fail=$((fail+1)); }
        expect download_bad_repo_id 2 "not a Hugging Face repo id" -- D not-a-repo
        expect download_lists_known 0 "TinyLlama/TinyLlama-1.1B-Chat-v1.0 +\(tinyllama-1.1b\)" -- D
        # a repo with pytorch_model.bin only (stories260K in bf16, written by torch): converted to safetensors beside
        # it (LitGPT's --convert_checkpoint, default true), the same loss as the .bin; false keeps the .bin only
        mkdir -p "$HT/root/fitllm-test/binonly"; cp tests/fixtures/torch/stories260K-bf16/* "$SRC/tokenizer.json" "$HT/root/fitllm-test/binonly/"
        printf '1 72 101 108 108 111 32 119 111 114 108 100\n' > "$HT/toksb.txt"
        wantb=$("$FITLLM" loss "$HT/root/fitllm-test/binonly" --tokens-file "$HT/toksb.txt" 2>/dev/null | awk '{print $2}')
        expect download_bin_converted 0 "converted pytorch_model\*.bin to safetensors \([0-9]+ tensors\)" -- D fitllm-test/binonly
        CB="$HT/work/checkpoints/fitllm-test/binonly"
        [ -f "$CB/model.safetensors" ] && [ -f "$CB/pytorch_model.bin" ] && [ -z "$(find "$CB" -name '.fitllm-convert*')" ] \
            && echo "ok   download_bin_converted_files" && pass=$((pass+1)) || { echo "FAIL download_bin_converted_files"; ls -la "$CB" | sed 's/^/     /'; fail=$((fail+1)); }
        rm -f "$CB/pytorch_model.bin"   # the loss below is the safetensors' then
        expect download_bin_converted_same_loss 0 "loss $wantb " -- env -C "$HT/work" "$FLA" loss fitllm-test/binonly --tokens-file "$HT/toksb.txt"
        expect download_bin_no_convert 0 "Saved fitllm-test/binonly" -- D fitllm-test/binonly --convert_checkpoint false --checkpoint_dir "$HT/nc"
        [ -f "$HT/nc/fitllm-test/binonly/pytorch_model.bin" ] && [ ! -e "$HT/nc/fitllm-test/binonly/model.safetensors" ] \
            && echo "ok   download_bin_no_convert_keeps_bin" && pass=$((pass+1)) || { echo "FAIL download_bin_no_convert_keeps_bin"; fail=$((fail+1)); }
        hub_stop
        expect download_network_failure 1 "network error fetching the file list" -- env HF_ENDPOINT=http://127.0.0.1:1 "$FITLLM" download fitllm-test/stories260K --checkpoint_dir "$HT/nf"
        # a connection cut mid-file: resumed with a Range request in the same run
        rm -rf "$HT/work/checkpoints"; : > "$HT/log"; hub_start --drop-after 300000 --drop-once
        expect download_resume_in_run 0 "connection lost at 300.0 kB .*resuming" -- D fitllm-test/stories260K
        grep -q "GET /cdn/fitllm-test/stories260K/model.safetensors range=bytes=300000-" "$HT/log" && cmp -s "$CK/model.safetensors" "$SRC/model.safetensors" \
            && echo "ok   download_resume_in_run_range" && pass=$((pass+1)) || { echo "FAIL download_resume_in_run_range"; fail=$((fail+1)); }
        hub_stop
        # cut every time: the run fails after its retries, keeps the .part, the folder is not a model yet
        rm -rf "$HT/work/checkpoints"; : > "$HT/log"; hub_start --drop-after 200000
        expect download_interrupted 1 "network error downloading model.safetensors at 600000 of 1044984 bytes.*kept in .*model.safetensors.part: run the same command again to resume" -- D fitllm-test/stories260K
        [ -f "$CK/model.safetensors.part" ] && [ ! -e "$CK/model.safetensors" ] && [ ! -e "$CK/config.json" ] \
            && echo "ok   download_interrupted_no_final_files" && pass=$((pass+1)) || { echo "FAIL download_interrupted_no_final_files"; ls -la "$CK"; fail=$((fail+1)); }
        expect download_interrupted_not_a_model 2 "karpathy|fitllm-test/stories260K is not downloaded" -- env -C "$HT/work" "$FLA" loss fitllm-test/stories260K --tokens-file "$T/oov.txt"
        hub_stop
        : > "$HT/log"; hub_start
        expect download_resume_next_run 0 "model.safetensors: resuming at 600.0 kB of 1.0 MB" -- D fitllm-test/stories260K
        grep -q "range=bytes=600000-" "$HT/log" && cmp -s "$CK/model.safetensors" "$SRC/model.safetensors" \
            && echo "ok   download_resume_next_run_range" && pass=$((pass+1)) || { echo "FAIL download_resume_next_run_range"; fail=$((fail+1)); }
        hub_stop
        # by name from the download folder: the same loss as the folder itself
        printf '1 72 101 108 108 111 32 119 111 114 108 100\n' > "$HT/toks.txt"
        want=$("$FITLLM" loss "$SRC" --tokens-file "$HT/toks.txt" 2>/dev/null | awk '{print $2}')
        expect load_from_download_dir 0 "loss $want .*model fitllm-test/stories260K" -- env -C "$HT/work" "$FLA" loss fitllm-test/stories260K --tokens-file "$HT/toks.txt"
    else
        expect download_without_libcurl 1 "built without libcurl" -- "$FITLLM" download fitllm-test/stories260K
    fi
    # a Hugging Face cache as huggingface_hub writes it: refs/main -> snapshots/<rev>/ -> symlinks into blobs/
    HC="$HT/hf-home/hub/models--karpathy--stories260K"; mkdir -p "$HC/refs" "$HC/blobs" "$HC/snapshots/0a1b2c3d"
    printf 0a1b2c3d > "$HC/refs/main"
    for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
        h=$(sha256sum "$SRC/$f" | cut -c1-64); cp "$SRC/$f" "$HC/blobs/$h"; ln -s "../../blobs/$h" "$HC/snapshots/0a1b2c3d/$f"
    done
    printf '1 72 101 108 108 111\n' > "$HT/toks2.txt"
    want=$("$FITLLM" loss "$SRC" --tokens-file "$HT/toks2.txt" 2>/dev/null | awk '{print $2}')
    expect load_from_hf_cache_hf_home 0 "loss $want " -- env -u HF_HUB_CACHE HF_HOME="$HT/hf-home" "$FITLLM" loss karpathy/stories260K --tokens-file "$HT/toks2.txt"
    expect load_from_hf_cache_hub_cache 0 "loss $want " -- env HF_HUB_CACHE="$HT/hf-home/hub" "$FITLLM" loss karpathy/stories260K --tokens-file "$HT/toks2.txt"
    expect generate_from_hf_cache 0 "karpathy/stories260K is .*snapshots/0a1b2c3d \(the Hugging Face cache\)" -- \
        env HF_HUB_CACHE="$HT/hf-home/hub" "$FITLLM" generate karpathy/stories260K --prompt "Once upon a time" --max_new_tokens 4
    # LitGPT's recipe path checkpoints/ORG/NAME finds the cache's copy (here stories260K stands in for TinyLlama)
    mv "$HT/hf-home/hub/models--karpathy--stories260K" "$HT/hf-home/hub/models--TinyLlama--TinyLlama-1.1B-intermediate-step-1431k-3T"
    expect recipe_from_hf_cache 0 "checkpoints/TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T is .*models--TinyLlama--TinyLlama-1.1B-intermediate-step-1431k-3T/snapshots/0a1b2c3d \(the Hugging Face cache\)" -- \
        env -C "$HT/work" HF_HUB_CACHE="$HT/hf-home/hub" "$FLA" finetune_full --config "$PWD/recipes/tiny-llama-full.yaml" --data Synthetic \
        --precision 32-true --train.max_steps 1 --train.global_batch_size 1 --train.micro_batch_size 1 --out_dir "$T/rc" --quiet
    if [ -d "$T/lo/final/adapter" ]; then   # merge_lora: base_model_name_or_path a repo id, found in the cache
        cp -r "$T/lo/final/adapter" "$HT/ad"
        sed -i 's|"base_model_name_or_path": *"[^"]*"|"base_model_name_or_path": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"|' "$HT/ad/adapter_config.json"
        expect merge_lora_base_repo_id 0 "base: .*models--TinyLlama--TinyLlama-1.1B-intermediate-step-1431k-3T/snapshots/0a1b2c3d" -- \
            env HF_HUB_CACHE="$HT/hf-home/hub" "$FITLLM" merge_lora "$HT/ad" --out_dir "$HT/merged"
    fi
else
    echo "skip download and Hugging Face cache checks: no $HUBSRV or $DATA/stories260K-hf"; skip=$((skip+1))
fi

# ---- train, then generate (issue 28): every checkpoint folder carries its tokenizer (the built-in
# byte tokenizer as tokenizer.json); generate takes a checkpoint, a step, a run folder, a LoRA run, a
# preset; a path that is not there is said to be so ----
G=(--data Synthetic --data.n_train 16 --data.n_val 2 --train.global_batch_size 2 --train.micro_batch_size 2 --train.max_seq_length 33
   --train.max_steps 2 --train.save_interval 1 --eval.max_new_tokens 0 --quiet)
gq() { "$FITLLM" generate "$@" --prompt "Once upon" --max_new_tokens 6 --temperature 0 2>/dev/null; }
expect tg_full_run 0 "Saved the final model" -- "$FITLLM" finetune_full micro "${G[@]}" --out_dir "$T/tg"
expect tg_lora_run 0 "Saved the PEFT adapter" -- "$FITLLM" finetune_lora micro "${G[@]}" --optimizer.lr 0.05 --out_dir "$T/tgl"
ok=1
for f in tg/step-000001 tg/final tgl/step-000001 tgl/final tgl/final/adapter; do for n in tokenizer.json tokenizer_config.json; do
    [ -f "$T/$f/$n" ] || { echo "     missing $f/$n"; ok=0; }; done; done
if [ $ok = 1 ]; then echo "ok   tg_checkpoints_carry_byte_tokenizer"; pass=$((pass+1)); else echo "FAIL tg_checkpoints_carry_byte_tokenizer"; fail=$((fail+1)); fi
expect tg_generate_final 0 "^Once upon" -- "$FITLLM" generate "$T/tg/final" --prompt "Once upon" --max_new_tokens 4
expect tg_generate_step 0 "^Once upon" -- "$FITLLM" generate "$T/tg/step-000001" --prompt "Once upon" --max_new_tokens 4
expect tg_generate_run_folder 0 "is a run folder: its final checkpoint .*/tg/final" -- "$FITLLM" generate "$T/tg" --prompt "Once upon" --max_new_tokens 4
a=$(gq "$T/tg/final"); b=$(gq "$T/tg"); c=$(gq "$T/tg/step-000001")
if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" != "$c" ]; then echo "ok   tg_run_folder_is_final"; pass=$((pass+1)); else echo "FAIL tg_run_folder_is_final: '$a' '$b' '$c'"; fail=$((fail+1)); fi
# a run folder without final/ yet: its newest committed step (step-000002 uncommitted: step-000001)
mkdir -p "$T/tg-nof"; cp -r "$T/tg/step-000001" "$T/tg/step-000002" "$T/tg-nof/"; rm "$T/tg-nof/step-000002/COMMITTED"
expect tg_generate_run_no_final 0 "newest checkpoint .*tg-nof/step-000001 \(no final/ yet\)" -- "$FITLLM" generate "$T/tg-nof" --prompt Once --max_new_tokens 2
# LoRA run: the run folder is final/ (the merged model), which equals the base + final/adapter in memory (the preset's
# random weights, kept in the run's base/); without final/ the newest step, a PEFT adapter on that base with the run's
# byte tokenizer
expect tg_generate_lora_run 0 "is a run folder: its final checkpoint .*/tgl/final" -- "$FITLLM" generate "$T/tgl" --prompt Once --max_new_tokens 2
a=$(gq "$T/tgl"); b=$(gq "$T/tgl/final/adapter"); c=$(gq micro)
if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" != "$c" ]; then echo "ok   tg_lora_final_equals_base_plus_adapter"; pass=$((pass+1)); else echo "FAIL tg_lora_final_equals_base_plus_adapter: '$a' '$b' '$c'"; fail=$((fail+1)); fi
mkdir -p "$T/tgl-nof"; cp -r "$T/tgl/step-000001" "$T/tgl/step-000002" "$T/tgl-nof/"
expect tg_generate_lora_run_no_final 0 "step-000002 is a LoRA adapter: base model .*/tgl/base with it merged" -- "$FITLLM" generate "$T/tgl-nof" --prompt Once --max_new_tokens 2
# presets: random init with the built-in byte tokenizer, said first
expect tg_generate_preset 0 "^fitllm generate: random initialization \(no weights were loaded\): 'micro' is a model preset" -- "$FITLLM" generate micro --max_new_tokens 2
# (the run of preset_random_note_names_download above: building the 124M preset takes seconds)
expect tg_generate_preset_gpt2 0 "'gpt2' is a model preset \(seed 1337\) with the built-in byte tokenizer" -- printf '%s\n' "$GPT2_OUT"
# what is not there
expect tg_generate_no_such_folder 2 "error: no such folder: /nonexistent/final$" -- "$FITLLM" generate /nonexistent/final
expect tg_generate_no_such_relative 2 "error: no such folder: out/no-such-run/lora$" -- "$FITLLM" generate out/no-such-run/lora
expect tg_generate_not_a_preset 2 "'nosuch' is neither a folder nor a model preset .*nearest: " -- "$FITLLM" generate nosuch
mkdir -p "$T/tg-empty/logs"
expect tg_generate_run_not_saved 2 "tg-empty: a run folder without a committed checkpoint yet" -- "$FITLLM" generate "$T/tg-empty"
mkdir -p "$T/tg-none"
expect tg_generate_not_a_model 2 "tg-none: not a model folder \(no config.json\), a PEFT adapter folder" -- "$FITLLM" generate "$T/tg-none"
# a checkpoint of an older fitllm (no tokenizer file): the way out is named, and works
cp -r "$T/tg/final" "$T/tg-old"; rm -f "$T/tg-old"/tokenizer*
expect tg_generate_old_checkpoint 2 "no tokenizer found .*--tokenizer bytes" -- "$FITLLM" generate "$T/tg-old" --prompt Once
a=$(gq "$T/tg/final"); b=$(gq "$T/tg-old" --tokenizer bytes)
if [ -n "$a" ] && [ "$a" = "$b" ]; then echo "ok   tg_tokenizer_bytes_equals_written"; pass=$((pass+1)); else echo "FAIL tg_tokenizer_bytes_equals_written: '$a' '$b'"; fail=$((fail+1)); fi
# merge_lora onto a trained byte-tokenizer base: the merged folder carries the tokenizer and generates
expect tg_merge_lora 0 "2 tokenizer files from" -- "$FITLLM" merge_lora "$T/tgl/final" --base "$T/tg/final" --out_dir "$T/tg-merged"
expect tg_generate_merged 0 "^Once" -- "$FITLLM" generate "$T/tg-merged" --prompt Once --max_new_tokens 2
if [ -d "$DATA/stories260K-hf" ]; then
    # real tokenizers travel: tokenizer.json (stories260K-hf), a llama2.c tok512.bin given as a file, GPT-2's files
    expect tg_real_full 0 "Saved the final model" -- "$FITLLM" finetune_full "$DATA/stories260K-hf" "${G[@]}" --out_dir "$T/tgr"
    cmp -s "$DATA/stories260K-hf/tokenizer.json" "$T/tgr/step-000001/tokenizer.json" && cmp -s "$DATA/stories260K-hf/tokenizer.json" "$T/tgr/final/tokenizer.json" \
        && { echo "ok   tg_real_tokenizer_copied"; pass=$((pass+1)); } || { echo "FAIL tg_real_tokenizer_copied"; fail=$((fail+1)); }
    expect tg_real_generate_run 0 "^Once upon" -- "$FITLLM" generate "$T/tgr" --prompt "Once upon" --max_new_tokens 4
    # (--eval.final_validation false: the final pass over $DATA/text's 21,011 validation blocks took 8-14 s; small cases run it)
    expect tg_l2c_pretrain 0 "Saved the final model" -- "$FITLLM" pretrain --model_name micro --data TextFiles --data.train_data_path "$DATA/text" \
        --tokenizer_dir "$DATA/stories260K/tok512.bin" --train.max_steps 1 --train.global_batch_size 1 --train.micro_batch_size 1 \
        --train.max_seq_length 32 --eval.final_validation false --out_dir "$T/tgb" --quiet
    cmp -s "$DATA/stories260K/tok512.bin" "$T/tgb/final/tok512.bin" && { echo "ok   tg_l2c_tokenizer_file_copied"; pass=$((pass+1)); } \
        || { echo "FAIL tg_l2c_tokenizer_file_copied"; ls "$T/tgb/final" | sed 's/^/     /'; fail=$((fail+1)); }
    expect tg_l2c_generate 0 "^Once upon" -- "$FITLLM" generate "$T/tgb" --prompt "Once upon" --max_new_tokens 4
    expect tg_qlora_run 0 "Saved the PEFT adapter" -- "$FITLLM" finetune_lora "$DATA/stories260K-hf" "${G[@]}" --quantize bnb.nf4 --out_dir "$T/tgq"
    expect tg_qlora_generate_run 0 "^Once upon" -- "$FITLLM" generate "$T/tgq" --prompt "Once upon" --max_new_tokens 4
    expect tg_qlora_generate_step 0 "^Once upon" -- "$FITLLM" generate "$T/tgq/step-000001" --prompt "Once upon" --max_new_tokens 4
    expect tg_gpt2_run 0 "Saved the final model" -- "$FITLLM" finetune_full "$DATA/tiny-gpt2-hf" "${G[@]}" --out_dir "$T/tgg"
    ok=1; for f in tokenizer.json vocab.json merges.txt; do cmp -s "$DATA/tiny-gpt2-hf/$f" "$T/tgg/step-000001/$f" || { echo "     $f"; ok=0; }; done
    if [ $ok = 1 ]; then echo "ok   tg_gpt2_tokenizer_copied"; pass=$((pass+1)); else echo "FAIL tg_gpt2_tokenizer_copied"; fail=$((fail+1)); fi
    expect tg_gpt2_generate_run 0 "^Once upon" -- "$FITLLM" generate "$T/tgg" --prompt "Once upon" --max_new_tokens 4
fi

# PyTorch checkpoints in (tests/fixtures/torch, written by torch: tests/ref/make_torch_fixtures.py) and
# fitllm convert: the tiny model as pytorch_model.bin / shards / lit_model.pth converts to the very bytes
# of its safetensors twin; hostile files are refused by name and leave nothing behind
TF=tests/fixtures/torch
expect convert_bin 0 "converted .* \(21 tensors, safetensors\)" -- "$FITLLM" convert "$TF/tiny-bin" "$T/cv-bin"
cmp -s "$T/cv-bin/model.safetensors" "$TF/tiny-st/model.safetensors" && cmp -s "$T/cv-bin/config.json" "$TF/tiny-bin/config.json" \
    && { echo "ok   convert_bin_bytes_equal_safetensors"; pass=$((pass+1)); } || { echo "FAIL convert_bin_bytes_equal_safetensors"; fail=$((fail+1)); }
expect convert_lit_sharded 0 "converted" -- "$FITLLM" convert "$TF/tiny-lit-old" "$T/cv-lit" --max-shard-size 20KB
[ -f "$T/cv-lit/model-00003-of-00003.safetensors" ] && [ -f "$T/cv-lit/model.safetensors.index.json" ] && [ ! -e "$T/cv-lit/model.safetensors" ] \
    && { echo "ok   convert_shards_written"; pass=$((pass+1)); } || { echo "FAIL convert_shards_written"; ls "$T/cv-lit" | sed 's/^/     /'; fail=$((fail+1)); }
expect convert_sharded_back 0 "converted" -- "$FITLLM" convert "$T/cv-lit" "$T/cv-lit1"
cmp -s "$T/cv-lit1/model.safetensors" "$TF/tiny-st/model.safetensors" \
    && { echo "ok   convert_lit_bytes_equal_safetensors"; pass=$((pass+1)); } || { echo "FAIL convert_lit_bytes_equal_safetensors"; fail=$((fail+1)); }
expect convert_dst_exists 2 "cv-bin: already exists" -- "$FITLLM" convert "$TF/tiny-sharded" "$T/cv-bin"
expect convert_usage 2 "needs <src_dir> and <dst_dir>" -- "$FITLLM" convert "$TF/tiny-bin"
expect convert_bad_size 2 "needs a size such as 5GB" -- "$FITLLM" convert "$TF/tiny-bin" "$T/cv-x" --max-shard-size 5XB
# the units README documents for sizes (save_pretrained's "5GiB" too); a bare number is refused, never taken as bytes
expect convert_shard_kib 0 "converted" -- "$FITLLM" convert "$TF/tiny-bin" "$T/cv-kib" --max-shard-size 20KiB
[ -f "$T/cv-kib/model-00003-of-00003.safetensors" ] && [ -f "$T/cv-kib/model.safetensors.index.json" ] \
    && { echo "ok   convert_shard_kib_shards"; pass=$((pass+1)); } || { echo "FAIL convert_shard_kib_shards"; ls "$T/cv-kib" | sed 's/^/     /'; fail=$((fail+1)); }
expect convert_shard_gib 0 "converted" -- "$FITLLM" convert "$TF/tiny-bin" "$T/cv-gib" --max-shard-size 5GiB
expect convert_shard_mib_lower 0 "converted" -- "$FITLLM" convert "$TF/tiny-bin" "$T/cv-mib" --max-shard-size 500mib
expect convert_shard_bare_number 2 "'1000000' has no unit: write 1000000GB" -- "$FITLLM" convert "$TF/tiny-bin" "$T/cv-bare" --max-shard-size 1000000
expect convert_shard_zero 2 "0 bytes would put no tensor in a shard" -- "$FITLLM" convert "$TF/tiny-bin" "$T/cv-bare" --max-shard-size 0GB
expect convert_help 0 "usage: fitllm convert" -- "$FITLLM" convert --help
mkdir -p "$T/evil"; cp "$TF/tiny-bin/config.json" "$T/evil/"; cp "$TF/evil.bin" "$T/evil/pytorch_model.bin"; rm -f /tmp/fitllm-torch-pwned
expect convert_evil_refused 1 "evil/pytorch_model.bin: pickle global posix.system is not allowed \(only torch state dicts are read" -- \
    "$FITLLM" convert "$T/evil" "$T/cv-evil"
expect loss_evil_refused 1 "pickle global posix.system is not allowed" -- "$FITLLM" loss "$T/evil" --tokens-file "$T/oov.txt"
[ ! -e /tmp/fitllm-torch-pwned ] && [ -z "$(ls -d "$T"/cv-evil* 2>/dev/null)" ] \
    && { echo "ok   evil_ran_nothing_wrote_nothing"; pass=$((pass+1)); } || { echo "FAIL evil_ran_nothing_wrote_nothing"; fail=$((fail+1)); }
# LitGPT's own folder (lit_model.pth + model_config.yaml, no config.json) loads; a field fitllm cannot build is named
printf '1 5 9 13 7 3\n' > "$T/tiny-ids.txt"
expect loss_lit_yaml_folder 0 "loss [0-9.]+" -- "$FITLLM" loss "$TF/tiny-lit-yaml" --tokens-file "$T/tiny-ids.txt"
mkdir -p "$T/litpar"; cp "$TF/tiny-lit-yaml"/* "$T/litpar/"; sed -i 's/^parallel_residual: false/parallel_residual: true/' "$T/litpar/model_config.yaml"
expect loss_lit_yaml_unsupported 2 "model_config.yaml.*parallel_residual" -- "$FITLLM" loss "$T/litpar" --tokens-file "$T/tiny-ids.txt"
mkdir -p "$T/legacy"; cp "$TF/tiny-bin/config.json" "$T/legacy/"; cp "$TF/legacy.bin" "$T/legacy/pytorch_model.bin"
expect loss_legacy_refused 2 "legacy/pytorch_model.bin: a legacy \(non-zip\) torch.save file" -- "$FITLLM" loss "$T/legacy" --tokens-file "$T/oov.txt"
if [ -d "$DATA/stories260K-hf" ]; then
    # stories260K in bf16 as pytorch_model.bin: loss, the same loss after convert, a short fine-tune from it
    mkdir -p "$T/sbin"; cp "$TF/stories260K-bf16"/* "$DATA/stories260K-hf/tokenizer.json" "$T/sbin/"
    # "Once upon a time, there was a little girl named Lily. She loved to play outside in the park." (BOS first)
    echo "1 403 407 261 378 432 383 286 261 376 298 315 421 395 317 426 338 401 396 267 337 410 408 419 292 411 322 265 282 295 433 426" > "$T/sids.txt"
    expect loss_torch_bin 0 "loss [0-9.]+" -- "$FITLLM" loss "$T/sbin" --tokens-file "$T/sids.txt"
    expect convert_stories_bin 0 "converted" -- "$FITLLM" convert "$T/sbin" "$T/sbin-st"
    lb=$("$FITLLM" loss "$T/sbin" --tokens-file "$T/sids.txt" 2>&1 | awk '/^loss/ {print $2}')
    lc=$("$FITLLM" loss "$T/sbin-st" --tokens-file "$T/sids.txt" 2>&1 | awk '/^loss/ {print $2}')
    lf=$("$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/sids.txt" 2>&1 | awk '/^loss/ {print $2}')
    # the bf16 weights' loss: identical after convert, and within bf16 rounding (measured 2.3e-5) of the fp32 model's 0.1804
    [ -n "$lb" ] && [ "$lb" = "$lc" ] && [ -f "$T/sbin-st/tokenizer.json" ] && awk -v a="$lb" -v b="$lf" 'BEGIN { d = a - b; exit !(d < 0.005 && d > -0.005) }' \
        && { echo "ok   loss_bin_equals_converted_near_fp32"; pass=$((pass+1)); } || { echo "FAIL loss_bin_equals_converted_near_fp32: $lb vs $lc vs fp32 $lf"; fail=$((fail+1)); }
    expect finetune_from_torch_bin 0 "Saved the final model" -- "$FITLLM" finetune_full "$T/sbin" --train.max_steps 2 \
        --train.global_batch_size 1 --eval.final_validation false --out_dir "$T/ft-bin" --quiet
fi

# ---- issue 28, the small things: sizes need a unit; paged optimizers refused; did you mean; the
# warm-up fraction alone; clamps said; the memory report names its backend; TextFiles names its
# validation text; no progress bar or escapes in a log, the DDP iteration time once ----
expect size_no_unit_plan 2 "'80' has no unit: write 80GB \(10\^9 bytes\) or 80GiB" -- "$FITLLM" plan micro --device-memory 80
expect size_no_unit_max_memory 2 "option 'max_memory': '80' has no unit" -- "$FITLLM" finetune_full micro --max-memory 80 --out_dir "$T/sz"
printf 'max_memory: 80\n' > "$T/sz.yaml"
expect size_no_unit_recipe 2 "sz.yaml:1: option 'max_memory': '80' has no unit" -- "$FITLLM" finetune_full micro --config "$T/sz.yaml" --out_dir "$T/sz"
expect size_no_unit_bench 2 "--max-memory: '80' has no unit" -- "$FITLLM" bench-step micro --max-memory 80
expect size_bytes_unit 3 "budget 80 B" -- "$FITLLM" plan micro --device-memory 80B
expect optimizer_paged_refused 2 "PagedAdamW' is not implemented: paged optimizers keep their state in CUDA managed memory.*deepspeed_stage_2_offload.*AdamW8bit" -- \
    "$FITLLM" finetune_full micro --optimizer bnb.optim.PagedAdamW --out_dir "$T/pg"
expect optimizer_paged8_refused 2 "PagedAdamW8bit' is not implemented" -- "$FITLLM" finetune_full micro --optimizer bnb.optim.PagedAdamW8bit --out_dir "$T/pg"
expect did_you_mean_generate_flag 2 "unknown option '--max_new_tokns' \(did you mean '--max_new_tokens'\?\)" -- "$FITLLM" generate micro --max_new_tokns 3
expect generate_flag_needs_value 2 "option '--prompt' needs a value" -- "$FITLLM" generate micro --prompt
# a prompt that fills the context (micro: 512) leaves no position for a new token: refused as a longer one is, where
# it ended at once with 0 new tokens; --max_new_tokens 0 prints it; 511 tokens get the one new token there is room for
P511=$(for i in $(seq 511); do printf '%d ' $((i % 500 + 1)); done)
expect generate_prompt_fills_context 2 "prompt of 512 tokens fills the model's context of 512, leaving no position for a new token: shorten the prompt \(--prompt / --prompt-ids\) to at most 511 tokens" -- \
    "$FITLLM" generate micro --prompt-ids "$P511 7" --max_new_tokens 5 --temperature 0
expect generate_prompt_over_context 2 "prompt of 513 tokens exceeds the model's context of 512: shorten the prompt" -- "$FITLLM" generate micro --prompt-ids "$P511 7 8" --max_new_tokens 5
expect generate_prompt_fills_context_none_asked 0 "512 prompt \+ 0 new tokens \(stop: max_new_tokens\)" -- "$FITLLM" generate micro --prompt-ids "$P511 7" --max_new_tokens 0
expect generate_prompt_one_position_left 0 "511 prompt \+ 1 new tokens \(stop: context limit\)" -- "$FITLLM" generate micro --prompt-ids "$P511" --max_new_tokens 5 --temperature 0
# --max_new_tokens 0 prints any prompt, nothing run: one past the context was refused (as with new tokens asked) while
# one that filled it was printed; the one new token above is timed without a per-token rate (it was "0.00 ms/token")
expect generate_prompt_over_context_none_asked 0 "^513 prompt \+ 0 new tokens \(stop: max_new_tokens\); nothing run" -- "$FITLLM" generate micro --prompt-ids "$P511 7 8" --max_new_tokens 0
expect generate_one_token_no_rate 0 "" -- bash -c '! "$1" generate micro --prompt-ids "$2" --max_new_tokens 5 --temperature 0 2>&1 | grep -q "ms/token"' _ "$FITLLM" "$P511"
expect did_you_mean_command 2 "unknown command 'finetune_ful' \(did you mean 'finetune_full'\?\)" -- "$FITLLM" finetune_ful micro
expect did_you_mean_bench_flag 2 "unknown option '--micro-bach' \(did you mean '--micro-batch'\?\)" -- "$FITLLM" bench-step micro --micro-bach 2
expect did_you_mean_plan_flag 2 "unknown option 'device-memroy' \(did you mean '--device-memory'\?\)" -- "$FITLLM" plan micro --device-memroy 80GB
expect did_you_mean_recipe_key 2 "unknown option 'train.micro_bach_size' \(did you mean 'train.micro_batch_size'\?\)" -- \
    "$FITLLM" finetune_full micro --train.micro_bach_size 2
expect warmup_fraction_alone 0 "warmup 1;" -- "$FITLLM" finetune_full micro "${TR[@]}" --train.lr_warmup_fraction 0.5 --out_dir "$T/wf"
expect warmup_both_given 2 "train.lr_warmup_fraction 0.5 and train.lr_warmup_steps 3 are both given: remove one" -- \
    "$FITLLM" finetune_full micro "${TR[@]}" --train.lr_warmup_fraction 0.5 --train.lr_warmup_steps 3 --out_dir "$T/wf2"
expect clamp_max_seq_length_said 0 "note: train.max_seq_length 4096 is more than the model's 512 positions" -- \
    "$FITLLM" finetune_full micro "${TR[@]}" --train.max_seq_length 4096 --out_dir "$T/cl"
expect clamp_warmup_said 0 "note: the warm-up of 100 steps \(train.lr_warmup_steps\) is longer than the run's 1 steps" -- \
    "$FITLLM" finetune_full micro "${TR[@]}" --out_dir "$T/cl2"
# (--eval.interval 100: the step's validation and sample on opaque, an mprotect per op, took 7.9 of its 8 s; the
# header is what this case checks)
for be in ref opaque; do
    expect memory_report_names_$be 0 "^memory report \($be\)" -- env FITLLM_BACKEND=$be "$FITLLM" finetune_full micro "${TR[@]}" --eval.interval 100 --out_dir "$T/mr-$be"
done
if [ -d "$DATA/text" ]; then
    # (--eval.final_validation false: the final pass over $DATA/text's 21,011 validation blocks took 8-14 s; small cases run it)
    # plan = measured for TextFiles: its blocks are max_seq_length + 1 tokens, so T = max_seq_length (the plan used
    # max_seq_length - 1, as for instruction samples: 5.41 MiB planned for a 5.46 MiB run)
    TFP=(--data TextFiles --data.train_data_path "$DATA/text" --train.max_seq_length 32 --train.micro_batch_size 2 --train.global_batch_size 2)
    tf_plan=$("$FITLLM" plan micro "${TFP[@]}" --generation off 2>/dev/null | awk '$1 == "peak" { print $(NF-1), $NF }')
    expect plan_textfiles_equals_run 0 "peak total +$tf_plan \|" -- "$FITLLM" pretrain --model_name micro "${TFP[@]}" --tokenizer_dir "$DATA/stories260K-hf" \
        --train.max_steps 1 --eval.final_validation false --out_dir "$T/tfp"
    # too little train text: the message names the train files and the file LitGPT's rule took for validation
    mkdir -p "$T/tfsmall" && printf 'Once upon a time there was a cat.\n' > "$T/tfsmall/a.txt" && : > "$T/tfsmall/b.txt"
    expect textfiles_too_short_names_files 1 "1 tokens in the train files \(b.txt\), fewer than one block of max_seq_length\+1 = 9; a.txt validates" -- \
        "$FITLLM" pretrain --model_name micro --data TextFiles --data.train_data_path "$T/tfsmall" --tokenizer_dir "$DATA/stories260K-hf" \
        --train.max_steps 1 --train.global_batch_size 1 --train.micro_batch_size 1 --train.max_seq_length 8 --out_dir "$T/tfs" --quiet
    expect textfiles_names_val_file 0 "^validation: tinyshakespeare.txt, the first .txt of train_data_path in sorted order" -- \
        "$FITLLM" pretrain --model_name micro --data TextFiles --data.train_data_path "$DATA/text" --tokenizer_dir "$DATA/stories260K-hf" \
        --train.max_steps 1 --train.global_batch_size 1 --train.micro_batch_size 1 --train.max_seq_length 32 --eval.final_validation false --out_dir "$T/tf1" --quiet
    expect clamp_longest_sample_said 0 "note: the longest sample has 1030 input tokens, more than the model's 512 positions" -- \
        "$FITLLM" finetune_full "$DATA/stories260K-hf" --data JSON --data.json_path "$DATA/instruct/alpaca-tiny.json" --train.max_steps 1 \
        --train.global_batch_size 1 --eval.max_iters 1 --eval.final_validation false --eval.max_new_tokens 0 --out_dir "$T/cl3" --quiet
    # the data line counts every sample not used whole, cut by train.max_seq_length or by the model's context: 18 of
    # alpaca-tiny's 100 have more than 513 tokens with this tokenizer (max_seq_length 513: the dataset cuts them all),
    # and null or 600 (the context cuts them to 513 tokens) counted 0 and 10; the notes say what was given and used
    expect_saved data_cut_count_null 0 "^data: JSON, 95 train / 5 val samples, 18 truncated to 513 tokens \(the model's context: 512 inputs\)" "$EXPECT_OUT" "$EXPECT_RC"
    expect_saved note_cut_count_null 0 "are cut to that \(train.max_seq_length null\): 18 of them" "$EXPECT_OUT" "$EXPECT_RC"
    CUT=(finetune_full "$DATA/stories260K-hf" --data JSON --data.json_path "$DATA/instruct/alpaca-tiny.json" --train.max_steps 1
         --train.global_batch_size 1 --eval.max_iters 1 --eval.final_validation false --eval.max_new_tokens 0 --quiet)
    expect data_cut_count_513 0 "^data: JSON, 95 train / 5 val samples, 18 truncated to 513 tokens \(train.max_seq_length\)" -- \
        "$FITLLM" "${CUT[@]}" --train.max_seq_length 513 --out_dir "$T/cl4"
    expect_saved note_max_seq_length_513 0 "note: train.max_seq_length 513 is more than the model's 512 positions \(its context\), but a sample of 513 tokens has 512 inputs .*: the limit is used as given" "$EXPECT_OUT" "$EXPECT_RC"
    expect data_cut_count_600 0 "^data: JSON, 95 train / 5 val samples, 18 truncated to 513 tokens \(the model's context: 512 inputs\)" -- \
        "$FITLLM" "${CUT[@]}" --train.max_seq_length 600 --out_dir "$T/cl5"
    expect_saved note_max_seq_length_600 0 "note: train.max_seq_length 600 is more than .* samples longer than 513 tokens \(512 inputs and the last one's target\) are cut to that, not to 600 tokens: 18 of them" "$EXPECT_OUT" "$EXPECT_RC"
    # samples cut inside their prompt (the Alpaca template is longer than 48 tokens here) train on the template alone:
    # said (every sample's loss was the same, with no word why)
    expect note_cut_inside_prompt 0 "note: 2000 of the 2000 training samples keep none of their response: cut to 48 tokens inside their prompt \(prompt style alpaca\)" -- \
        "$FITLLM" finetune_full "$DATA/stories260K-hf" --data Synthetic --train.max_seq_length 48 --train.max_steps 1 \
        --train.global_batch_size 1 --eval.max_iters 1 --eval.final_validation false --eval.max_new_tokens 0 --out_dir "$T/cl6" --quiet
    # the CPU recipe validates on TinyStories (its one train file's last 5%), not on Shakespeare
    mkdir -p "$T/rcp/run" && ln -s "$(cd "$DATA/.." && pwd)" "$T/rcp/shared"
    expect recipe_validates_on_tinystories 0 "^validation: the last 5% of the blocks of tinystories-val-prefix.txt" -- \
        bash -c "cd '$T/rcp/run' && '$(cd "$(dirname "$FITLLM")" && pwd)/$(basename "$FITLLM")' pretrain --config '$PWD/recipes/cpu/micro-pretrain-tinystories.yaml' \
        --train.max_steps 1 --train.global_batch_size 8 --eval.max_iters 1 --out_dir '$T/tf2' --quiet"
else
    echo "skip textfiles_names_val_file: $DATA/text not found"; skip=$((skip+1))
fi
# --devices 2 started by fitllm itself, stdout a pipe: the ranks' stdout is mpirun's pseudo-terminal,
# yet no progress bar or terminal escapes; a round's iteration time once; bytes sent in words
if "$FITLLM" --version | grep -q "^comm: *MPI" && command -v mpirun >/dev/null 2>&1; then
    out=$("${NOLAUNCH[@]}" OMP_NUM_THREADS=1 OMPI_MCA_rmaps_base_oversubscribe=1 "$FITLLM" finetune_full micro --data Synthetic \
          --data.n_train 16 --data.n_val 2 --train.global_batch_size 4 --train.micro_batch_size 1 --train.max_seq_length 33 \
          --train.max_steps 1 --eval.final_validation false --eval.max_new_tokens 0 --devices 2 --strategy ddp --out_dir "$T/ddp-log" 2>&1)
    if [ $? -eq 0 ] && ! grep -q $'[\r\x1b]' <<<"$out" && ! grep -q '\[#' <<<"$out" \
       && grep -q "iter 1 step 0 .*| iter time: " <<<"$out" && grep -q "iter 2 step 0 .*| rank 1's micro-batch, in parallel with iter 1$" <<<"$out" \
       && grep -q "= 1.00 x the model's gradients (1015.75 KiB) |" <<<"$out"; then echo "ok   ddp_log_plain_time_once"; pass=$((pass+1))
    else echo "FAIL ddp_log_plain_time_once"; echo "$out" | cat -v | grep -E "iter|\^\[|gradients" | head -8 | sed 's/^/     /'; fail=$((fail+1)); fi
else
    echo "skip ddp_log_plain_time_once: no MPI build or no mpirun"; skip=$((skip+1))
fi
# T5 under --tensor_parallel: heads (num_heads) or d_ff that N does not split are refused at set-up, naming T5's keys
expect tp_t5_heads_not_divisible 2 "--tensor_parallel 3: the model's 4 attention heads \(num_heads\) do not split evenly over 3 ranks" -- \
    "$FITLLM" plan t5-micro --devices 3 --tensor_parallel 3
expect tp_t5_d_ff_not_divisible 2 "--tensor_parallel 3: the model's 52 feed-forward width \(d_ff\) do not split evenly" -- \
    "$FITLLM" plan tests/fixtures/t5-tiny-gated --devices 3 --tensor_parallel 3

# sequence parallelism (--sequence_parallel true with --tensor_parallel): the plan's ACTS at TP 2 of micro (B 1 x T 32:
# 545.94 KiB, TP alone 598.62 KiB; the threads tests check plan = measured), refused without a tensor-parallel group,
# and the lab's tp2-sp row (lab-7b, its measured peak = its plan)
expect sp_plan_acts_below_tp 0 "^peak +reserved +509\.25 KiB +509\.25 KiB +1018\.50 KiB +545\.94 KiB" -- \
    "$FITLLM" plan micro --devices 2 --tensor_parallel 2 --sequence_parallel true --train.max_seq_length 33
expect sp_without_tensor_parallel 2 "--sequence_parallel splits the rows of a tensor-parallel group: give --tensor_parallel N" -- \
    "$FITLLM" plan micro --sequence_parallel true
expect lab_grid_row_tp2_sp 0 "tp2-sp +lab-7b +1x4x2 +32-true +AdamW +fits +yes +([0-9.]+) +\1 " -- \
    bash -c "'$FITLLM' lab --only tp2-sp --steps 1 --out_dir '$T/lab-sp' | tr '\n' ' '"

# BLIP-2's Flan-T5 language model drops in training (text_config.dropout_rate, the T5 trainer's masks): a copy of the
# fixture at rate 0.3 says so, its losses are not rate 0's, and a run resumed from step 3 gives steps 4-6 and the final
# weights of the uninterrupted run bit for bit (the masks follow the run seed and the global micro-batch)
mkdir -p "$T/b2drop" && cp tests/fixtures/blip2-tiny-t5/*.json tests/fixtures/blip2-tiny-t5/model.safetensors "$T/b2drop/"
sed -i 's/"dropout_rate": 0.0,/"dropout_rate": 0.3,/' "$T/b2drop/config.json"
DR=("${B2RUN[@]}" --train.max_steps 6 --train.global_batch_size 4)
d0=$("$FITLLM" finetune_full tests/fixtures/blip2-tiny-t5 "${DR[@]}" --out_dir "$T/b2d0" 2>&1 | grep '^step [1-6]/')
da=$("$FITLLM" finetune_full "$T/b2drop" "${DR[@]}" --train.save_interval 3 --out_dir "$T/b2da" 2>&1)
db=$("$FITLLM" finetune_full "$T/b2drop" "${DR[@]}" --resume "$T/b2da/step-000003" --out_dir "$T/b2db" 2>&1 | grep '^step [4-6]/')
expect blip2_t5_dropout_said 0 "^text_config.dropout_rate 0.3 is applied in training" -- echo "$da"
expect blip2_t5_dropout_changes_loss 0 "" -- bash -c '[ "$(grep -c . <<<"$1")" = 6 ] && [ "$(grep -c "^step [1-6]/" <<<"$2")" = 6 ] && [ "$(head -1 <<<"$1")" != "$(grep "^step 1/" <<<"$2")" ]' _ "$d0" "$da"
expect blip2_t5_dropout_resume_bit_identical 0 "" -- bash -c '[ "$(grep -c . <<<"$2")" = 3 ] && [ "$(grep "^step [4-6]/" <<<"$1")" = "$2" ] && cmp "$3/final/model.safetensors" "$4/final/model.safetensors"' _ "$da" "$db" "$T/b2da" "$T/b2db"

# BLIP-2's OPT variant drops in every part (the vision tower's attention weights, the Q-Former's embedding norm, dense
# outputs and attention weights, OPT's sublayer outputs and attention weights; the masks: run seed, global micro-batch):
# a copy of the fixture at rate 0.3 everywhere says so, its losses are not rate 0's, a run resumed from step 3 and one
# with activation checkpointing give the uninterrupted run's losses and final weights bit for bit, plan = measured
mkdir -p "$T/b2odrop" && cp "$B2"/*.json "$B2"/model.safetensors "$T/b2odrop/"
sed -i -E 's/"(dropout|attention_dropout|hidden_dropout_prob|attention_probs_dropout_prob)": 0.0/"\1": 0.3/' "$T/b2odrop/config.json"
DR=("${B2RUN[@]}" --train.max_steps 6 --train.global_batch_size 4 --blip2.train vision,qformer,lm)
d0=$("$FITLLM" finetune_full "$B2" "${DR[@]}" --out_dir "$T/b2od0" 2>&1 | grep '^step [1-6]/')
da=$("$FITLLM" finetune_full "$T/b2odrop" "${DR[@]}" --train.save_interval 3 --out_dir "$T/b2oda" 2>&1)
db=$("$FITLLM" finetune_full "$T/b2odrop" "${DR[@]}" --resume "$T/b2oda/step-000003" --out_dir "$T/b2odb" 2>&1 | grep '^step [4-6]/')
dc=$("$FITLLM" finetune_full "$T/b2odrop" "${DR[@]}" --train.activation_checkpointing true --out_dir "$T/b2odc" 2>&1 | grep '^step [1-6]/')
expect blip2_opt_dropout_said 0 "" -- bash -c 'grep -q "^text_config.dropout 0.3 / attention_dropout 0.3 are applied in training" <<<"$1" && grep -q "^qformer_config.hidden_dropout_prob 0.3 / attention_probs_dropout_prob 0.3 are applied" <<<"$1" && grep -q "^vision_config.attention_dropout 0.3 is applied" <<<"$1"' _ "$da"
expect blip2_opt_dropout_changes_loss 0 "" -- bash -c '[ "$(grep -c . <<<"$1")" = 6 ] && [ "$(grep -c "^step [1-6]/" <<<"$2")" = 6 ] && [ "$(head -1 <<<"$1")" != "$(grep "^step 1/" <<<"$2")" ]' _ "$d0" "$da"
expect blip2_opt_dropout_resume_bit_identical 0 "" -- bash -c '[ "$(grep -c . <<<"$2")" = 3 ] && [ "$(grep "^step [4-6]/" <<<"$1")" = "$2" ] && cmp "$3/final/model.safetensors" "$4/final/model.safetensors"' _ "$da" "$db" "$T/b2oda" "$T/b2odb"
expect blip2_opt_dropout_checkpointing_bit_identical 0 "" -- bash -c '[ "$(grep -c . <<<"$2")" = 6 ] && [ "$(grep "^step [1-6]/" <<<"$1")" = "$2" ] && cmp "$3/final/model.safetensors" "$4/final/model.safetensors"' _ "$da" "$dc" "$T/b2oda" "$T/b2odc"
for x in "" "--train.activation_checkpointing true"; do
    planned=$("$FITLLM" plan "$T/b2odrop" "${B2RUN[@]}" --train.max_seq_length 4 --blip2.train vision,qformer,lm $x 2>&1 | awk '/^(after_|before_)/ { print; getline; print } /^peak/')
    measured=$("$FITLLM" finetune_full "$T/b2odrop" "${B2RUN[@]}" --train.max_seq_length 4 --train.max_steps 2 --blip2.train vision,qformer,lm $x --out_dir "$T/b2odpm" 2>&1 | awk '/^host tier/ { exit } /^(after_|before_)/ { print; getline; print } /^peak/')
    expect "blip2_opt_dropout_plan_equals_measured${x:+_ckpt}" 0 "" -- bash -c '[ "$(grep -c . <<<"$1")" = 11 ] && [ "$1" = "$2" ] || { echo "planned:"; echo "$1"; echo "measured:"; echo "$2"; exit 1; }' _ "$planned" "$measured"
done
# OPT's dropout in the decoder trainer (config.json dropout / attention_dropout where OPTDecoderLayer drops; masks: run
# seed, global micro-batch, block, site): a tiny OPT folder at 0.3 says so and writes the rates back, its losses are not
# rate 0's, a run resumed from step 3 and one with activation checkpointing end on the uninterrupted run's losses and
# weights bit for bit, plan = measured
mkdir -p "$T/optd" && cp tests/fixtures/golden-opt/config.json "$T/optd/"
sed -i -E 's/"(dropout|attention_dropout)": 0.0/"\1": 0.3/; s/"vocab_size": 257/"vocab_size": 264/' "$T/optd/config.json"
OD=(--data Synthetic --train.max_steps 6 --train.micro_batch_size 2 --train.global_batch_size 4 --train.max_seq_length 16 --train.lr_warmup_steps 0)
"$FITLLM" pretrain --model_config "$T/optd/config.json" "${OD[@]}" --train.max_steps 1 --out_dir "$T/optd1" >/dev/null 2>&1
OM="$T/optd1/final"; mkdir -p "$T/optd0" && cp "$OM"/*.json "$OM"/model.safetensors "$T/optd0/"
sed -i -E 's/"(dropout|attention_dropout)": [0-9.]+/"\1": 0.0/' "$T/optd0/config.json"
olines() { grep '(step)' <<<"$1" | grep -o 'iter [0-9]* step [0-9]* | loss train: [0-9.]*'; } # each step's last micro-batch
oa=$("$FITLLM" finetune_full "$OM" "${OD[@]}" --train.save_interval 3 --out_dir "$T/oda" 2>&1)
ob=$("$FITLLM" finetune_full "$OM" "${OD[@]}" --resume "$T/oda/step-000003" --out_dir "$T/odb" 2>&1)
oc=$("$FITLLM" finetune_full "$OM" "${OD[@]}" --train.activation_checkpointing true --out_dir "$T/odc" 2>&1)
o0=$("$FITLLM" finetune_full "$T/optd0" "${OD[@]}" --out_dir "$T/od0" 2>&1)
expect opt_dropout_said 0 "" -- bash -c 'grep -q "^note: config.json dropout 0.3 / attention_dropout 0.3 are applied in training" <<<"$1" && grep -q "\"dropout\": 0.3," "$2/final/config.json" && ! grep -q "dropout .* are applied" <<<"$3"' _ "$oa" "$T/oda" "$o0"
expect opt_dropout_changes_loss 0 "" -- bash -c '[ "$(grep -c . <<<"$1")" = 6 ] && [ "$(grep -c . <<<"$2")" = 6 ] && [ "$1" != "$2" ]' _ "$(olines "$oa")" "$(olines "$o0")"
expect opt_dropout_resume_bit_identical 0 "" -- bash -c '[ "$(grep -c . <<<"$2")" = 3 ] && [ "$(tail -3 <<<"$1")" = "$2" ] && cmp "$3/final/model.safetensors" "$4/final/model.safetensors"' _ "$(olines "$oa")" "$(olines "$ob")" "$T/oda" "$T/odb"
expect opt_dropout_checkpointing_bit_identical 0 "" -- bash -c '[ "$(grep -c . <<<"$2")" = 6 ] && [ "$1" = "$2" ] && cmp "$3/final/model.safetensors" "$4/final/model.safetensors"' _ "$(olines "$oa")" "$(olines "$oc")" "$T/oda" "$T/odc"
for x in "" "--train.activation_checkpointing true" "--precision bf16-mixed"; do
    planned=$("$FITLLM" plan "$OM" "${OD[@]}" $x 2>&1 | awk '/^(after_|before_)/ { print; getline; print } /^peak/')
    measured=$("$FITLLM" finetune_full "$OM" "${OD[@]}" --train.max_steps 2 $x --out_dir "$T/odpm${x##* }" 2>&1 | awk '/^host tier/ { exit } /^(after_|before_)/ { print; getline; print } /^peak/')
    expect "opt_dropout_plan_equals_measured${x:+_${x##* }}" 0 "" -- bash -c '[ "$(grep -c . <<<"$1")" = 11 ] && [ "$1" = "$2" ] || { echo "planned:"; echo "$1"; echo "measured:"; echo "$2"; exit 1; }' _ "$planned" "$measured"
done
# fp16's overflow path (FITLLM_FAULT_GRAD_OVERFLOW, test-only: fitllm/fault.h; tests/test_fp16_fault.c runs the
# grids): +inf in the gradients at step 2 skips that update, halves the scale, and the summary counts the skip; a
# malformed value is refused naming the variable
FF=(--precision 16-mixed --train.max_steps 3 --train.global_batch_size 4 --train.micro_batch_size 4 --eval.final_validation false)
expect fp16_fault_overflow_skipped 0 "fp16 steps \(loss scaling\) +1 skipped, scale 32768" -- bash -c 'o=$(FITLLM_FAULT_GRAD_OVERFLOW=2 "$@" 2>&1) && grep -q "^step 2: inf/NaN in the fp16 gradients: update skipped, loss scale -> 32768" <<<"$o" && echo "$o"' _ "$FITLLM" finetune_full micro "${FF[@]}" --out_dir "$T/ffo"
expect fp16_fault_bad_value 2 "FITLLM_FAULT_GRAD_OVERFLOW: '2:x' is not STEP\[:RANK\]" -- env FITLLM_FAULT_GRAD_OVERFLOW=2:x "$FITLLM" finetune_full micro "${FF[@]}" --out_dir "$T/ffx"

# --strategy auto on TP / PP grids (src/plan/plan_auto.c; tests/test_plan_auto.c checks the rule against every
# rank's plan): the first of DDP, ZeRO-1, ZeRO-2, FULL_SHARD, the offloads whose every rank fits --max_memory, the
# reason printed (micro: DDP's largest rank 9.97 MiB at TP 2, 17.77 MiB at PP 2; ZeRO-1's 9.47 / 17.13 MiB); no
# budget: DDP, saying so. (`finetune_full ... --devices 4 --tensor_parallel 2 --max_memory 9.5MiB` under mpirun prints
# the same note and trains in the budget.)
expect tp_auto_strategy_by_plan 0 "note: strategy auto: deepspeed_stage_1 on the data axis of DP 2 x TP 2 x PP 1: every rank's plan fits the budget 9.60 MiB" -- \
    bash -c '"$@" | grep -q "before it: ddp needs [0-9.]* MiB on rank" && "$@"' _ "$FITLLM" plan micro --devices 4 --tensor_parallel 2 --max_memory 9.6MiB
expect pp_auto_strategy_by_plan 0 "note: strategy auto: deepspeed_stage_1 on the data axis of DP 2 x TP 1 x PP 2: every rank's plan fits the budget 17.45 MiB" -- \
    "$FITLLM" plan micro --devices 4 --pipeline_parallel 2 --max_memory 17.45MiB
expect tpp_auto_strategy_no_budget 0 "note: strategy auto: DDP on the data axis of DP 2 x TP 2 x PP 2 \(no memory budget given" -- \
    "$FITLLM" plan micro --devices 8 --tensor_parallel 2 --pipeline_parallel 2
# T5 with --pipeline_parallel (issue 35; runs: tests/test_pp_t5.c, tests/mpi_t5_test.sh): the split of [encoder blocks;
# decoder blocks] by training FLOPs (and into virtual stages); the plan of TP 2 x PP 2 with sequence parallelism and of
# FULL_SHARD on the data axis (which the trainer runs)
T5PP=(plan "$T/t5m" --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json --devices 2 --pipeline_parallel 2)
expect t5_pp_plan_split 0 "blocks per stage \(balanced by training FLOPs at T = 64, lm_head's on the last\): \[0, 1\) \[1, 3\) \[3, 4\) \[4, 5\)" -- \
    "$FITLLM" "${T5PP[@]}" --devices 4 --pipeline_parallel 4 --train.max_seq_length 64
mkdir -p "$T/t5m4" && cp "$T/t5m"/* "$T/t5m4/" && sed -i 's/"num_heads": 3/"num_heads": 4/' "$T/t5m4/config.json" # heads TP 2 splits
expect t5_pp_plan_sequence_parallel 0 "pipeline parallel 2 \(EXPERIMENTAL, schedule 1f1b\): rank 2 is stage 1" -- \
    "$FITLLM" plan "$T/t5m4" "${T5PP[@]:2}" --devices 4 --tensor_parallel 2 --pipeline_parallel 2 --sequence_parallel true --rank 2
expect t5_pp_plan_tp2_pp2 0 "pipeline parallel 2 \(EXPERIMENTAL, schedule 1f1b\): rank 3 is stage 1" -- \
    "$FITLLM" plan "$T/t5m4" "${T5PP[@]:2}" --devices 4 --tensor_parallel 2 --pipeline_parallel 2 --rank 3
expect t5_pp_plan_full_shard 0 "pipeline parallel 2 \(EXPERIMENTAL, schedule 1f1b\) x FSDP: rank 0 is stage 0" -- \
    "$FITLLM" "${T5PP[@]}" --devices 4 --strategy fsdp
expect t5_pp_plan_interleaved 0 "blocks per virtual stage \(balanced by training FLOPs at T = 64, lm_head's on the last\): \[0, 1\) \[1, 3\) \[3, 4\) \[4, 5\)" -- \
    "$FITLLM" "${T5PP[@]}" --pipeline_schedule interleaved --train.max_seq_length 64
# offload on the stages (issue 35; runs: tests/test_pp_offload.c, mpirun ppo_cli_*): rank 0's host tier under
# fsdp_cpu_offload at DP 2 x PP 2, by hand: stage 0 of micro holds 169152 floats (its blocks, a copy of the embeddings
# and head), rank 0's piece of the axis' half 84576 = 330.38 KiB of parameters, as much gradient, twice that of AdamW
# state (660.75 KiB)
expect pp_plan_offload_host_tier 0 "^host \(offload\) +reserved +330\.38 KiB +330\.38 KiB +660\.75 KiB" -- \
    "$FITLLM" plan micro --devices 4 --pipeline_parallel 2 --strategy fsdp_cpu_offload
# TP inside the interleaved schedule: the plan runs the grid (rank 1: tensor-parallel rank 1 of stage 0, its two
# chunks' slices); T5's chunks under TP refused by name before any collective
expect ppi_plan_tp_stage 0 "pipeline parallel 2 \(EXPERIMENTAL, schedule interleaved\): rank 1 is stage 0" -- \
    "$FITLLM" plan micro --devices 4 --tensor_parallel 2 --pipeline_parallel 2 --pipeline_schedule interleaved \
    --train.global_batch_size 8 --train.micro_batch_size 2 --rank 1
# T5's chunks run TP inside the interleaved schedule too (tests/test_tp_t5_train.c tpi_t5_train_*: plan = measured per rank)
expect ppi_plan_t5_tp 0 "pipeline parallel 2 \(EXPERIMENTAL, schedule interleaved\): rank 1 is stage 0" -- \
    "$FITLLM" plan "$T/t5m4" "${T5PP[@]:2}" --devices 4 --tensor_parallel 2 --pipeline_parallel 2 --pipeline_schedule interleaved --rank 1

# tests/cuda/perf_session.sh's plumbing on a CPU (PERF_DRY=1: each command logged with its FITLLM_CUDA_* settings, not
# run): every A/B switch of its steps reaches a command with each value (step 11: FITLLM_CUDA_PREFETCH, issue 30)
expect perf_session_dry 0 "^plumbing ok$" -- bash -c 'PERF_DRY=1 OUT="$1" tests/cuda/perf_session.sh "$(dirname "$2")" >/dev/null 2>&1
    for v in FITLLM_CUDA_PREFETCH=0 FITLLM_CUDA_PREFETCH=1 "FITLLM_CUDA_GRAPHS=1 FITLLM_CUDA_PREFETCH=0" \
        FITLLM_CUDA_STEP_SCALARS=0 FITLLM_CUDA_GRAPHS=1 FITLLM_CUDA_PINNED=0 FITLLM_CUDA_EPILOGUE=0 FITLLM_CUDA_ATTN=own \
        "FITLLM_CUDA_GRAPHS=1 FITLLM_CUDA_STEP_SCALARS=0 .*--optimizer SGD" \
        "FITLLM_CUDA_GRAPHS=0 FITLLM_CUDA_STEP_SCALARS=0 .*--optimizer bnb.optim.AdamW8bit" \
        "FITLLM_CUDA_GRAPHS=1 FITLLM_CUDA_STEP_SCALARS=1 .*--optimizer bnb.optim.AdamW8bit" FITLLM_CUDA_GELU16=0 \
        FITLLM_CUDA_GELU16=1 FITLLM_CUDA_VIEWS32=1 FITLLM_CUDA_VIEWS32=0 FITLLM_CUDA_XBLOCK_NORM=1 \
        FITLLM_CUDA_XBLOCK_NORM=0 FITLLM_CUDA_DW16=1 FITLLM_CUDA_DW16=0 FITLLM_CUDA_LORA16=1 FITLLM_CUDA_LORA16=0 \
        FITLLM_CUDA_Q4X16=1 FITLLM_CUDA_Q4X16=0 FITLLM_CUDA_STREAM16=1 FITLLM_CUDA_STREAM16=0 \
        FITLLM_CUDA_RESGEMM=1 FITLLM_CUDA_RESGEMM=0; do
        grep -h "^DRY .*$v" "$1"/*.log | grep -qE "fitllm (bench-step|finetune_full) " || { echo "no command with $v"; exit 1; }
    done; echo "plumbing ok"' _ "$T/pdry" "$FITLLM"
# its step 14 (issue 35): tensor parallelism's device ops (vocab_xent, dropout_rows) reach the GPU's selftest
expect perf_session_dry_tp_ops 0 "^plumbing ok$" -- bash -c 'PERF_DRY=1 OUT="$1" tests/cuda/perf_session.sh "$(dirname "$2")" >/dev/null 2>&1
    for op in vocab_xent dropout_rows; do
        grep -q "^DRY .*fitllm selftest --accelerator cuda --only $op\$" "$1/tp-$op.log" || { echo "no selftest of $op"; exit 1; }
    done; echo "plumbing ok"' _ "$T/pdry-tp" "$FITLLM"
# PERF_STEPS splits the session into calls the device's 10-minute limit takes: only the steps named run
expect perf_session_steps 0 "^steps ok$" -- bash -c 'PERF_DRY=1 PERF_STEPS=2,18-22 OUT="$1" tests/cuda/perf_session.sh \
    "$(dirname "$2")" 2>&1 | grep "^== " | cut -d. -f1 | tr "\n" " " | grep -qx "== 2 == 18 == 19 == 20 == 21 == 22 " && echo "steps ok"' \
    _ "$T/psteps" "$FITLLM"
# tests/cuda/device_quick.sh (a lent GPU's first call) with stand-ins for the packed fitllm, nvidia-smi and python3: a
# cuDNN refusal brings back both debug logs (step 2c), the small preset's CPU / GPU losses pass when equal and fail on
# a NaN GPU loss or on no losses at all
expect device_quick_plumbing 0 "^device_quick plumbing ok$" -- tests/cuda/device_quick_test.sh "$T/dquick"
# fitllm_emu (the command line over the CUDA emulator, a developer's tool: tests/cuda/fitllm_emu.c): a bf16-true step's
# profile lists every op the CUDA backend issues; no conversion op among them (issue 30 item 1's ratchet, as
# cuda_emu_bf16_true_convert_launches counts the kernels)
EMU="$(dirname "$FITLLM")/fitllm_emu"
if [ -x "$EMU" ]; then
    expect emu_bf16_step_no_convert 0 "^no conversion op: ok$" -- bash -c 'out=$(FITLLM_BACKEND=cuda-emu "$1" bench-step micro \
        --precision bf16-true --profile --steps 1 --warmup 0 --seq 16 --micro-batch 1 2>&1) || { echo "$out"; exit 1; }
        echo "$out" | grep -qE "^ +gemm +[0-9.]+ .* 53 " || { echo "$out"; echo "no gemm row with 53 calls"; exit 1; }
        echo "$out" | grep -qE "^ +gemm_res16 +[0-9.]+ .* 10 " || { echo "$out"; echo "no gemm_res16 row with 10 calls (o and down, 5 blocks)"; exit 1; }
        echo "$out" | grep -E "^ +(convert|convert_many|round16) " && exit 1; echo "no conversion op: ok"' _ "$EMU"
else
    echo "skip emu_bf16_step_no_convert: no fitllm_emu beside $FITLLM (a build without the CUDA emulator)"; skip=$((skip+1))
fi
# T5's attention (a learned relative bias, dropout on the weights) on the fa2 kernels' EX path: a bf16-true fine-tune
# of a T5 with head size 64 and dropout_rate 0.1 on cuda-emu; its losses differ from the fp32 attention kernels'
# (FITLLM_CUDA_ATTN=fp32: so the EX kernels ran) and both stay within 2^-8 relative (bf16's rounding of the stored
# activations, the precision's own limit) of the CPU backend's at every step (the kernels against float64:
# tests/test_cuda_attn.c cuda_attn_fa2)
if [ -x "$EMU" ]; then
    expect t5_fa2_bias_dropout_emu 0 "^t5 fa2 ok" -- tests/t5_fa2_emu_test.sh "$FITLLM" "$EMU" "$T/t5e"
else
    echo "skip t5_fa2_bias_dropout_emu: no fitllm_emu beside $FITLLM"; skip=$((skip+1))
fi
echo
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
