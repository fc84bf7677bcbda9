#!/usr/bin/env bash
# BLIP-2 image-caption fine-tuning over 2 MPI ranks (DDP, ZeRO-1/2; run by tests/mpi_test.sh, which counts its ok / FAIL lines):
# the tiny OPT and Flan-T5 fixtures on the 14 shipped test images with token-id captions (as tests/cli_test.sh),
# micro-batch 2, global batch 4 (one micro-batch per rank per step), 6 steps.
#   - against one process (two micro-batches accumulated): rank 0 runs global micro-batch 0 and rank 1 micro-batch 1,
#     their gradients and losses summed by the all-reduce, so each step's loss equals one process's within fp32
#     reduction noise (1e-6 relative: 8 fp32 roundings; printed to 6 decimals), full fine-tuning and LoRA, both
#     variants, bf16-mixed and QLoRA (its adapters fp32); rank 0 alone prints and writes;
#   - bf16-true: the first step's loss equal; then each rank's bf16 gradient is rounded before the sum where one
#     process adds the second micro-batch's fp32 gradient into the first's bf16 one, so the steps part within the
#     precision's noise: each loss within the largest distance over the run's steps of bf16-mixed from 32-true (the
#     bf16 matmul operands' rounding) or of bf16-true from bf16-mixed (the bf16 storage's: weights, gradients and
#     state rounded, of which the gradient sum's rounding order is a part), whichever is larger (noise_btrue);
#   - started without a launcher (--devices 2: fitllm runs mpirun itself): the explicit run's losses;
#   - DDP's step checkpoint resumes in one process (its weights are one process's: the same training state);
#   - rank 0's memory report = `plan --devices 2` (every phase, reserved and live per tag);
#   - ZeRO-1 / ZeRO-2 (and with CPU offload) = DDP bit for bit, their checkpoints DDP's byte for byte;
#   - ranks that read different captions are refused at start-up (exit 2, naming the rank and the folder it read);
#   - what DDP does not run is refused on every rank, exit 2, naming the option; a corrupt image read by one rank ends
#     the job non-zero within seconds, naming the file.
# Usage: tests/mpi_blip2_test.sh [build-dir]; skips (exit 0) without MPI or mpirun.
set -u
BUILD=${1:-build}
FL=$BUILD/fitllm
if [ ! -x "$BUILD/fitllm_comm_mpi_test" ] || ! command -v mpirun >/dev/null 2>&1; then
    echo "skip BLIP-2 MPI tests: no MPI build or no mpirun"
    exit 0
fi
source "$(dirname "$0")/mpi_env.sh"   # root, oversubscription, 1 OpenMP thread, Open MPI's start-up
pass=0; fail=0
T=$(mktemp -d "${TMPDIR:-/tmp}"/fitllm-mpi-b2-XXXXXX)
trap 'rm -rf "$T"' EXIT
ok()  { echo "ok   $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; sed 's/^/     /' "$T/out" | tail -15; fail=$((fail+1)); }

IMG=tests/fixtures/images
mkdir -p "$T/caps"; k=0
for f in "$IMG"/*.png "$IMG"/*.jpg; do
    case "$f" in *bad_*) continue ;; esac
    k=$((k+1)); cp "$f" "$T/caps/"; b=$(basename "$f"); printf '%d %d 9 11 %d\n' $((k*3)) $((k+40)) $((k*2+20)) > "$T/caps/${b%.*}.txt"
done
RUN=(--data JSON --data.json_path "$T/caps" --train.max_steps 6 --train.micro_batch_size 2 --train.global_batch_size 4
     --optimizer.lr 0.003 --train.lr_warmup_steps 0 --threads 1 --quiet true)
losses() { grep -E '^step [0-9]+/6 loss' "$1" | awk '{ print $4 }'; }
# every line of a and b within 1e-6 relative (+ the printed 6 decimals' half unit)
same() { paste -d' ' <(printf '%s\n' "$1") <(printf '%s\n' "$2") |
         awk 'NF != 2 { bad = 1 } { d = $1 - $2; if (d < 0) d = -d; if (d > 1e-6 * $1 + 5e-7) bad = 1; n++ } END { exit bad || n != 6 }'; }
# bf16-true: the first lines equal, every line of a and b within tol
near() { paste -d' ' <(printf '%s\n' "$1") <(printf '%s\n' "$2") |
         awk -v tol="$3" 'NF != 2 { bad = 1 } { d = $1 - $2; if (d < 0) d = -d; if (d > tol || (n == 0 && d > 0)) bad = 1; n++ } END { exit bad || n != 6 || tol <= 0 }'; }
# the largest distance between two runs' losses
dist() { paste -d' ' <(printf '%s\n' "$1") <(printf '%s\n' "$2") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > m) m = d } END { print m + 0 }'; }
# bf16-true's noise for model M (its one-process 32-true, bf16-mixed and bf16-true logs): see the header
noise_btrue() {
    local a b
    a=$(dist "$(losses "$T/one-$1-full.log")" "$(losses "$T/one-$1-mixed.log")")
    b=$(dist "$(losses "$T/one-$1-btrue.log")" "$(losses "$T/one-$1-mixed.log")")
    awk -v a="$a" -v b="$b" 'BEGIN { print (a > b ? a : b) }'
}

for m in opt t5; do
    for v in full lora mixed btrue qlora; do
        c=finetune_full; x=(); [ $v = lora ] && c=finetune_lora && x=(--lora_r 4)
        [ $v = mixed ] && x=(--precision bf16-mixed)
        [ $v = btrue ] && x=(--precision bf16-true)
        [ $v = qlora ] && c=finetune_lora && x=(--lora_r 4 --quantize bnb.nf4 --precision bf16-true)
        M=tests/fixtures/blip2-tiny-$m
        timeout 300 "$FL" $c "$M" "${RUN[@]}" "${x[@]}" --out_dir "$T/one-$m-$v" >"$T/one" 2>&1 || { cp "$T/one" "$T/out"; bad "blip2_one_${m}_$v" "exit $?"; continue; }
        cp "$T/one" "$T/one-$m-$v.log"
        timeout 300 mpirun -np 2 "$FL" $c "$M" "${RUN[@]}" "${x[@]}" --devices 2 --train.save_interval 3 --out_dir "$T/ddp-$m-$v" >"$T/out" 2>&1; rc=$?
        a=$(losses "$T/one"); b=$(losses "$T/out"); cp "$T/out" "$T/ddp-$m-$v.log"
        tol=0; eq() { same "$1" "$2"; }
        if [ $v = btrue ]; then
            tol=$(noise_btrue $m)
            eq() { near "$1" "$2" "$tol"; }
        fi
        if [ $rc -eq 0 ] && eq "$a" "$b" && [ "$(grep -c 'over 2 ranks (DDP)' "$T/out")" = 1 ] && [ "$(grep -c '^saved ' "$T/out")" = 3 ] \
            && [ -f "$T/ddp-$m-$v/step-000003/COMMITTED" ] && [ -d "$T/ddp-$m-$v/final" ]; then
            ok "blip2_ddp_np2_${m}_$v (losses = one process's$([ $v = btrue ] && echo " within $tol"): $(tr '\n' ' ' <<<"$b"))"
        else
            echo "one process: $a" >>"$T/out"; bad "blip2_ddp_np2_${m}_$v" "exit $rc"
        fi
    done
done
# the launcher started by fitllm itself: the explicit run's losses
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --out_dir "$T/self" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "^fitllm: starting 2 ranks: .*mpirun -np 2" "$T/out" && [ -n "$(losses "$T/out")" ] &&
    [ "$(losses "$T/out")" = "$(losses "$T/ddp-opt-full.log")" ]; then
    ok "blip2_ddp_self_launched"
else bad "blip2_ddp_self_launched" "exit $rc"; fi
# metrics.csv: the schema of one process (README "Logs and metrics"): iter (micro-batches: 2 a step), step and
# total_tokens (every rank's caption targets) one process's, tokens a rank's share (half; one process: all)
cols() { awk -F, -v h="$2" 'NR > 1 && $4 != "" { printf "%s,%s,%s ", $1, $2, $7; if ($6 * h != $7) printf "BAD " }' "$1/logs/metrics.csv"; }
a=$(cols "$T/one-opt-full" 1); b=$(cols "$T/ddp-opt-full" 2)
if [ -n "$a" ] && [ "$a" = "$b" ] && [[ "$a" == 2,1,* ]] && [[ "$a" != *BAD* ]]; then ok "blip2_ddp_metrics_schema"
else echo "one process: $a; DDP: $b" >"$T/out"; bad "blip2_ddp_metrics_schema" "iter, step, tokens or total_tokens"; fi
# DDP's checkpoint in one process: steps 4-6 as one process's within reduction noise
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --resume "$T/ddp-opt-full/step-000003" --out_dir "$T/res" >"$T/out" 2>&1; rc=$?
a=$(grep -E '^step [4-6]/6 loss' "$T/out" | awk '{ print $4 }'); b=$(losses "$T/one-opt-full.log" | tail -3)
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000003 (step 3)" "$T/out" && [ "$(grep -c . <<<"$a")" = 3 ] &&
    paste -d' ' <(printf '%s\n' "$a") <(printf '%s\n' "$b") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * $1) bad = 1 } END { exit bad }'; then
    ok "blip2_ddp_checkpoint_resumes_in_one_process"
else bad "blip2_ddp_checkpoint_resumes_in_one_process" "exit $rc"; fi
# rank 0's memory report (every phase's reserved and live bytes per tag, the peak) = `plan --devices 2`
PR=(--data JSON --data.json_path "$T/caps" --train.max_steps 2 --train.micro_batch_size 2 --train.global_batch_size 8 --train.max_seq_length 4 --threads 1)
planned=$("$FL" plan tests/fixtures/blip2-tiny-opt "${PR[@]}" --devices 2 2>&1 | awk '/^(after_|before_)/ { print; getline; print } /^peak/')
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${PR[@]}" --devices 2 --out_dir "$T/pm" >"$T/out" 2>&1; rc=$?
measured=$(awk '/^(after_|before_)/ { print; getline; print } /^peak/' "$T/out")
if [ $rc -eq 0 ] && [ "$(grep -c . <<<"$planned")" = 11 ] && [ "$planned" = "$measured" ]; then ok "blip2_ddp_rank0_peaks_equal_plan"
else printf 'planned:\n%s\n' "$planned" >>"$T/out"; bad "blip2_ddp_rank0_peaks_equal_plan" "exit $rc"; fi
# ZeRO-1 / ZeRO-2 (src/train/blip2_dist.c: each rank keeps its chunk of every trained part's optimizer state and
# updates it, then one all-gather of the part's parameters; ZeRO-2 reduce-scatters the gradients) and their CPU
# offload give DDP's bits: the final weights (LoRA: and the adapter) and the step-3 checkpoint (its training state
# gathered into the one-process form, byte for byte), OPT full fine-tuning and T5 LoRA
for m in opt t5; do
    c=finetune_full; x=(); v=full; [ $m = t5 ] && c=finetune_lora && x=(--lora_r 4) && v=lora
    for st in deepspeed_stage_1 deepspeed_stage_2 deepspeed_stage_2_offload; do
        D="$T/z-$m-$st"; R="$T/ddp-$m-$v"
        timeout 300 mpirun -np 2 "$FL" $c tests/fixtures/blip2-tiny-$m "${RUN[@]}" "${x[@]}" --devices 2 --strategy $st \
            --train.save_interval 3 --out_dir "$D" >"$T/out" 2>&1; rc=$?
        if [ $rc -eq 0 ] && grep -q "over 2 ranks (ZeRO-[12])" "$T/out" && cmp -s "$R/final/model.safetensors" "$D/final/model.safetensors" &&
            cmp -s "$R/step-000003/training_state.safetensors" "$D/step-000003/training_state.safetensors" &&
            { [ $v = full ] || cmp -s "$R/final/adapter/adapter_model.safetensors" "$D/final/adapter/adapter_model.safetensors"; }; then
            ok "blip2_zero_${m}_${st}_ddp_bits"
        else bad "blip2_zero_${m}_${st}_ddp_bits" "exit $rc"; fi
    done
done
# rank 0's memory report under ZeRO-1 / ZeRO-2 (its chunk of each part's state) = `plan --devices 2 --strategy ...`
for st in deepspeed_stage_1 deepspeed_stage_2; do
    planned=$("$FL" plan tests/fixtures/blip2-tiny-opt "${PR[@]}" --devices 2 --strategy $st 2>&1 | awk '/^(after_|before_)/ { print; getline; print } /^peak/')
    timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${PR[@]}" --devices 2 --strategy $st --out_dir "$T/pz" >"$T/out" 2>&1; rc=$?
    measured=$(awk '/^(after_|before_)/ { print; getline; print } /^peak/' "$T/out")
    ddpopt=$(grep '^peak' "$T/out" | head -1 | awk '{ print $7 $8 }')
    if [ $rc -eq 0 ] && [ "$(grep -c . <<<"$planned")" = 11 ] && [ "$planned" = "$measured" ] && grep -q "^memory of rank 0 (ZeRO-" "$T/out"; then
        ok "blip2_${st}_rank0_peaks_equal_plan (OPTIM $ddpopt)"
    else printf 'planned:\n%s\n' "$planned" >>"$T/out"; bad "blip2_${st}_rank0_peaks_equal_plan" "exit $rc"; fi
done
# a ZeRO-2 checkpoint (the gathered state) resumed under DDP: steps 4-6 give DDP's final weights bit for bit
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 \
    --resume "$T/z-opt-deepspeed_stage_2/step-000003" --out_dir "$T/zr" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000003 (step 3)" "$T/out" &&
    cmp -s "$T/ddp-opt-full/final/model.safetensors" "$T/zr/final/model.safetensors"; then ok "blip2_zero2_checkpoint_resumes_under_ddp"
else bad "blip2_zero2_checkpoint_resumes_under_ddp" "exit $rc"; fi
# refusals: every rank refuses the same way, exit 2, the option named once
timeout 120 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --strategy deepspeed_stage_2 \
    --optimizer bnb.optim.AdamW8bit --out_dir "$T/x" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c -- "with --optimizer AdamW8bit: BLIP-2 step checkpoints and --resume of the 8-bit state" "$T/out")" = 1 ]; then
    ok "blip2_zero_refuses_8bit_checkpoints"; else bad "blip2_zero_refuses_8bit_checkpoints" "exit $rc"; fi
timeout 120 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --train.global_batch_size 6 --out_dir "$T/x" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && grep -q "train.global_batch_size 6 is not divisible by devices x micro_batch_size = 2 x 2" "$T/out"; then
    ok "blip2_ddp_refuses_uneven_split"; else bad "blip2_ddp_refuses_uneven_split" "exit $rc"; fi
# a set-up error every rank hits (an unknown part): the ranks agree, every one returns, rank 0 says it once, exit 2
timeout 120 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --blip2.train text --out_dir "$T/x" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c "blip2.train: unknown part 'text'" "$T/out")" = 1 ]; then
    ok "blip2_ddp_setup_error_said_once"; else bad "blip2_ddp_setup_error_said_once" "exit $rc"; fi
# a corrupt image read by one rank: the job ends, non-zero, within the timeout, naming the file
mkdir -p "$T/bad" && cp "$IMG/one_1x1.png" "$IMG/rgb_13x7.png" "$T/bad/" && printf '3 4 5\n' > "$T/bad/one_1x1.txt"
head -c 300 "$IMG/rgb420_97x61.jpg" > "$T/bad/zz.jpg"; printf '5 6 7\n' > "$T/bad/zz.txt"; printf '7 8 9\n' > "$T/bad/rgb_13x7.txt"
cp "$IMG/one_1x1.png" "$T/bad/aa.png"; printf '9 10 11\n' > "$T/bad/aa.txt"
timeout 120 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt --data JSON --data.json_path "$T/bad" --train.max_steps 4 \
    --train.micro_batch_size 1 --train.global_batch_size 2 --threads 1 --devices 2 --out_dir "$T/x2" >"$T/out" 2>&1; rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "zz.jpg: corrupt JPEG" "$T/out" && [ ! -d "$T/x2/final" ]; then
    ok "blip2_ddp_corrupt_image_ends_job (exit $rc)"; else bad "blip2_ddp_corrupt_image_ends_job" "exit $rc"; fi

# ranks that read different captions (each reads data.json_path relative to its own working directory; rank 1's copy
# has one caption's ids changed): refused after loading, naming the rank, the split's fingerprints and the folder it
# read, before anything is written (exit 2, said once); the same copy on both trains
mkdir -p "$T/ra" "$T/rb" "$T/rc" && cp -r "$T/caps" "$T/ra/caps" && cp -r "$T/caps" "$T/rb/caps" && cp -r "$T/caps" "$T/rc/caps"
f=$(ls "$T/rb/caps"/*.txt | head -1); printf '5 6 7 8\n' > "$f"
DRUN=(finetune_full "$(readlink -f tests/fixtures/blip2-tiny-opt)" --data JSON --data.json_path caps --train.max_steps 1
      --train.micro_batch_size 2 --train.global_batch_size 4 --threads 1 --quiet true --devices 2)
timeout 120 mpirun -np 2 sh -c 'cd "$1/$([ "$OMPI_COMM_WORLD_RANK" = 1 ] && echo "$2" || echo ra)" && shift 2 && exec "$0" "$@"' \
    "$(readlink -f "$FL")" "$T" rb "${DRUN[@]}" --out_dir "$T/dx" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c "rank 1 of 2: the ranks read different data: rank 1 has 'training set: 14 records, [0-9]* caption tokens, fingerprint [0-9a-f]*' where rank 0 has 'training set: 14 records, [0-9]* caption tokens, fingerprint [0-9a-f]*' (rank 1 read data.json_path 'caps' (.*/rb/caps); every rank must read the same data files" "$T/out")" = 1 ] \
    && [ ! -e "$T/dx" ]; then
    ok "blip2_ddp_data_mismatch (exit $rc)"; else bad "blip2_ddp_data_mismatch" "exit $rc"; fi
timeout 120 mpirun -np 2 sh -c 'cd "$1/$([ "$OMPI_COMM_WORLD_RANK" = 1 ] && echo "$2" || echo ra)" && shift 2 && exec "$0" "$@"' \
    "$(readlink -f "$FL")" "$T" rc "${DRUN[@]}" --out_dir "$T/dy" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && [ -f "$T/dy/final/model.safetensors" ]; then
    ok "blip2_ddp_data_same_copies"; else bad "blip2_ddp_data_same_copies" "exit $rc"; fi

# FSDP FULL_SHARD / ZeRO-3 (src/train/blip2_dist.c: every part sharded unit by unit, the passes gather and
# reduce-scatter each unit): at one micro-batch per rank and step without clipping each element's reduced gradient is
# DDP's rank-order sum and the update elementwise, so the losses are one process's within reduction noise (as DDP's)
# and the final weights and the step-3 checkpoint (gathered into the one-process form) are DDP's byte for byte; OPT
# (fsdp) and Flan-T5 (deepspeed_stage_3) in 32-true, bf16-mixed and bf16-true
for m in opt t5; do
    st=fsdp; [ $m = t5 ] && st=deepspeed_stage_3
    for v in full mixed btrue; do
        x=(); [ $v = mixed ] && x=(--precision bf16-mixed); [ $v = btrue ] && x=(--precision bf16-true)
        D="$T/fs-$m-$v"; R="$T/ddp-$m-$v"
        timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-$m "${RUN[@]}" "${x[@]}" --devices 2 --strategy $st \
            --train.save_interval 3 --out_dir "$D" >"$T/out" 2>&1; rc=$?
        a=$(losses "$T/out"); b=$(losses "$T/one-$m-$v.log")
        eq() { same "$1" "$2"; }
        [ $v = btrue ] && eq() { near "$1" "$2" "$(noise_btrue $m)"; }
        if [ $rc -eq 0 ] && eq "$b" "$a" && grep -q "over 2 ranks (FULL_SHARD)" "$T/out" && cmp -s "$R/final/model.safetensors" "$D/final/model.safetensors" &&
            cmp -s "$R/step-000003/training_state.safetensors" "$D/step-000003/training_state.safetensors"; then
            ok "blip2_fsdp_np2_${m}_${v}_${st} (losses = one process's, weights and checkpoint = DDP's: $(tr '\n' ' ' <<<"$a"))"
        else echo "one process: $b" >>"$T/out"; bad "blip2_fsdp_np2_${m}_${v}_$st" "exit $rc"; fi
    done
done
# FULL_SHARD with the shards' optimizer state offloaded to the host (deepspeed_stage_3_offload): the bits of FULL_SHARD
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --strategy deepspeed_stage_3_offload \
    --quiet false --out_dir "$T/fso" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && cmp -s "$T/fs-opt-full/final/model.safetensors" "$T/fso/final/model.safetensors" && grep -q "^host tier" "$T/out"; then
    ok "blip2_fsdp_offload_equal_fsdp_bits"
else bad "blip2_fsdp_offload_equal_fsdp_bits" "exit $rc"; fi
# the FULL_SHARD checkpoint resumes in one process (steps 4-6 as one process's within reduction noise) and at 2 ranks
# under FULL_SHARD (the uninterrupted run's final weights bit for bit)
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --resume "$T/fs-opt-full/step-000003" --out_dir "$T/fr1" >"$T/out" 2>&1; rc=$?
a=$(grep -E '^step [4-6]/6 loss' "$T/out" | awk '{ print $4 }'); b=$(losses "$T/one-opt-full.log" | tail -3)
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000003 (step 3)" "$T/out" && [ "$(grep -c . <<<"$a")" = 3 ] &&
    paste -d' ' <(printf '%s\n' "$a") <(printf '%s\n' "$b") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-6 * $1 + 5e-7) bad = 1 } END { exit bad }'; then
    ok "blip2_fsdp_checkpoint_resumes_in_one_process"
else bad "blip2_fsdp_checkpoint_resumes_in_one_process" "exit $rc"; fi
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --strategy fsdp \
    --resume "$T/fs-opt-full/step-000003" --out_dir "$T/fr2" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && cmp -s "$T/fs-opt-full/final/model.safetensors" "$T/fr2/final/model.safetensors"; then
    ok "blip2_fsdp_checkpoint_resumes_under_fsdp_bits"
else bad "blip2_fsdp_checkpoint_resumes_under_fsdp_bits" "exit $rc"; fi
# a DDP checkpoint (the one-process form) resumed under FULL_SHARD: steps 4-6 give DDP's final weights bit for bit
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --strategy fsdp \
    --resume "$T/ddp-opt-full/step-000003" --out_dir "$T/fr3" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000003 (step 3)" "$T/out" &&
    cmp -s "$T/ddp-opt-full/final/model.safetensors" "$T/fr3/final/model.safetensors"; then ok "blip2_fsdp_resumes_ddp_checkpoint_bits"
else bad "blip2_fsdp_resumes_ddp_checkpoint_bits" "exit $rc"; fi
# 3 ranks (the units split unevenly; 2 micro-batches of 1 each per step) against one process (6 accumulated), with a
# validation split (every rank runs the validation forwards: each gathers from every rank): the losses and val losses
# within 1e-6; its step-3 checkpoint resumed by FULL_SHARD at 2 ranks: steps 4-6 as one process's within 1e-6
R3=(--data JSON --data.json_path "$T/caps" --train.max_steps 6 --train.micro_batch_size 1 --train.global_batch_size 6
    --optimizer.lr 0.003 --train.lr_warmup_steps 0 --threads 1 --quiet true --data.val_split_fraction 0.15 --eval.interval 3)
vl() { grep -E '^step [0-9]+ val loss|^Final evaluation' "$1" | sed 's/.*val loss:* \([0-9.]*\).*/\1/'; }
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${R3[@]}" --out_dir "$T/o3" >"$T/o3.log" 2>&1
timeout 300 mpirun -np 3 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${R3[@]}" --devices 3 --strategy fsdp \
    --train.save_interval 3 --out_dir "$T/f3" >"$T/out" 2>&1; rc=$?
a=$(losses "$T/out"); b=$(losses "$T/o3.log")
if [ $rc -eq 0 ] && same "$b" "$a" && grep -q "over 3 ranks (FULL_SHARD)" "$T/out" && [ "$(vl "$T/out" | grep -c .)" = 2 ] &&
    paste -d' ' <(vl "$T/o3.log") <(vl "$T/out") | awk 'NF != 2 { bad = 1 } { d = $1 - $2; if (d < 0) d = -d; if (d > 1e-6 * $1 + 5e-4) bad = 1 } END { exit bad }'; then
    ok "blip2_fsdp_np3_validation (losses = one process's: $(tr '\n' ' ' <<<"$a"))"
else echo "one process: $b" >>"$T/out"; bad "blip2_fsdp_np3_validation" "exit $rc"; fi
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${R3[@]}" --devices 2 --strategy fsdp \
    --resume "$T/f3/step-000003" --out_dir "$T/f32" >"$T/out" 2>&1; rc=$?
a=$(grep -E '^step [4-6]/6 loss' "$T/out" | awk '{ print $4 }'); b=$(losses "$T/o3.log" | tail -3)
if [ $rc -eq 0 ] && [ "$(grep -c . <<<"$a")" = 3 ] &&
    paste -d' ' <(printf '%s\n' "$a") <(printf '%s\n' "$b") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-6 * $1 + 5e-7) bad = 1 } END { exit bad }'; then
    ok "blip2_fsdp_np3_checkpoint_resumes_at_np2"
else bad "blip2_fsdp_np3_checkpoint_resumes_at_np2" "exit $rc"; fi
# rank 0's memory report under FULL_SHARD (its shards, the gathered units in GATHER) = `plan --devices 2 --strategy fsdp`
# (the plan rehearses the ranks as threads), every part trained, with activation checkpointing
for x in "" "--blip2.train vision,qformer,lm --train.activation_checkpointing true"; do
    planned=$("$FL" plan tests/fixtures/blip2-tiny-opt "${PR[@]}" $x --devices 2 --strategy fsdp 2>&1 | awk '/^(after_|before_)/ { print; getline; print } /^peak/')
    timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${PR[@]}" $x --devices 2 --strategy fsdp --out_dir "$T/pf" >"$T/out" 2>&1; rc=$?
    measured=$(awk '/^(after_|before_)/ { print; getline; print } /^peak/' "$T/out")
    if [ $rc -eq 0 ] && [ "$(grep -c . <<<"$planned")" = 11 ] && [ "$planned" = "$measured" ] && grep -q "GATHER" "$T/out"; then
        ok "blip2_fsdp_rank0_peaks_equal_plan${x:+ (every part, checkpointing)}"
    else printf 'planned:\n%s\n' "$planned" >>"$T/out"; bad "blip2_fsdp_rank0_peaks_equal_plan" "exit $rc"; fi
done
# HYBRID_SHARD (FULL_SHARD within each node's --devices ranks, replicated across --num_nodes): 2 nodes of 1 rank sum
# in DDP's rank order, so the final weights and the step-3 checkpoint are DDP's byte for byte and the losses one
# process's within 1e-6; its checkpoint resumed under HYBRID_SHARD gives the uninterrupted run's bytes; 2 nodes of 2
# ranks (one micro-batch each, 4 per step) against one process (4 accumulated) within 1e-6; rank 0's report = the plan
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --strategy fsdp --fsdp.sharding_strategy HYBRID_SHARD \
    --devices 1 --num_nodes 2 --train.save_interval 3 --out_dir "$T/hy" >"$T/out" 2>&1; rc=$?
a=$(losses "$T/out"); b=$(losses "$T/one-opt-full.log")
if [ $rc -eq 0 ] && same "$b" "$a" && grep -q "over 2 ranks (HYBRID_SHARD)" "$T/out" && cmp -s "$T/ddp-opt-full/final/model.safetensors" "$T/hy/final/model.safetensors" &&
    cmp -s "$T/ddp-opt-full/step-000003/training_state.safetensors" "$T/hy/step-000003/training_state.safetensors"; then
    ok "blip2_hybrid_shard_2x1_ddp_bits (losses = one process's: $(tr '\n' ' ' <<<"$a"))"
else echo "one process: $b" >>"$T/out"; bad "blip2_hybrid_shard_2x1_ddp_bits" "exit $rc"; fi
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --strategy fsdp --fsdp.sharding_strategy HYBRID_SHARD \
    --devices 1 --num_nodes 2 --resume "$T/hy/step-000003" --out_dir "$T/hyr" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000003 (step 3)" "$T/out" && cmp -s "$T/hy/final/model.safetensors" "$T/hyr/final/model.safetensors"; then
    ok "blip2_hybrid_shard_checkpoint_resumes_bits"
else bad "blip2_hybrid_shard_checkpoint_resumes_bits" "exit $rc"; fi
R4=(--data JSON --data.json_path "$T/caps" --train.max_steps 6 --train.micro_batch_size 1 --train.global_batch_size 4
    --optimizer.lr 0.003 --train.lr_warmup_steps 0 --threads 1 --quiet true)
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${R4[@]}" --out_dir "$T/o4" >"$T/o4.log" 2>&1
timeout 300 mpirun -np 4 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${R4[@]}" --strategy fsdp --fsdp.sharding_strategy HYBRID_SHARD \
    --devices 2 --num_nodes 2 --train.save_interval 3 --out_dir "$T/hy4" >"$T/out" 2>&1; rc=$?
a=$(losses "$T/out"); b=$(losses "$T/o4.log")
if [ $rc -eq 0 ] && same "$b" "$a" && grep -q "over 4 ranks (HYBRID_SHARD)" "$T/out"; then
    ok "blip2_hybrid_shard_2x2_np4 (losses = one process's: $(tr '\n' ' ' <<<"$a"))"
else echo "one process: $b" >>"$T/out"; bad "blip2_hybrid_shard_2x2_np4" "exit $rc"; fi
# its step-3 checkpoint (one process's form) resumed in one process: steps 4-6 as one process's within 1e-6
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${R4[@]}" --resume "$T/hy4/step-000003" --out_dir "$T/hy41" >"$T/out" 2>&1; rc=$?
a=$(grep -E '^step [4-6]/6 loss' "$T/out" | awk '{ print $4 }'); b=$(losses "$T/o4.log" | tail -3)
if [ $rc -eq 0 ] && [ "$(grep -c . <<<"$a")" = 3 ] &&
    paste -d' ' <(printf '%s\n' "$a") <(printf '%s\n' "$b") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-6 * $1 + 5e-7) bad = 1 } END { exit bad }'; then
    ok "blip2_hybrid_shard_np4_checkpoint_resumes_in_one_process"
else bad "blip2_hybrid_shard_np4_checkpoint_resumes_in_one_process" "exit $rc"; fi
PH=(--data JSON --data.json_path "$T/caps" --train.max_steps 2 --train.micro_batch_size 2 --train.global_batch_size 8 --train.max_seq_length 4 --threads 1)
planned=$("$FL" plan tests/fixtures/blip2-tiny-opt "${PH[@]}" --devices 2 --num_nodes 2 --strategy fsdp --fsdp.sharding_strategy HYBRID_SHARD 2>&1 | awk '/^(after_|before_)/ { print; getline; print } /^peak/')
timeout 300 mpirun -np 4 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${PH[@]}" --devices 2 --num_nodes 2 --strategy fsdp \
    --fsdp.sharding_strategy HYBRID_SHARD --out_dir "$T/ph" >"$T/out" 2>&1; rc=$?
measured=$(awk '/^(after_|before_)/ { print; getline; print } /^peak/' "$T/out")
if [ $rc -eq 0 ] && [ "$(grep -c . <<<"$planned")" = 11 ] && [ "$planned" = "$measured" ] && grep -q "GATHER" "$T/out"; then
    ok "blip2_hybrid_shard_rank0_peaks_equal_plan"
else printf 'planned:\n%s\n' "$planned" >>"$T/out"; bad "blip2_hybrid_shard_rank0_peaks_equal_plan" "exit $rc"; fi
# 8-bit AdamW on FULL_SHARD's shards: one process's 8-bit arithmetic on DDP's reduced gradients (a block cut by a rank
# edge takes the max of its parts' absmax), so the losses are one process's (8-bit) within 1e-6, the final weights
# DDP's byte for byte, and the step-3 checkpoint
# (each rank's pieces gathered into the one-process layout) too; resumed under FULL_SHARD: the uninterrupted bytes;
# DDP's 8-bit checkpoint resumed under FULL_SHARD: DDP's final bytes
A8=(--optimizer bnb.optim.AdamW8bit --train.save_interval 3)
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --optimizer bnb.optim.AdamW8bit --out_dir "$T/o8" >"$T/o8.log" 2>&1
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" "${A8[@]}" --devices 2 --out_dir "$T/d8" >"$T/d8.log" 2>&1
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" "${A8[@]}" --devices 2 --strategy fsdp --out_dir "$T/f8" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && same "$(losses "$T/o8.log")" "$(losses "$T/out")" && [ -f "$T/d8/final/model.safetensors" ] && cmp -s "$T/d8/final/model.safetensors" "$T/f8/final/model.safetensors" &&
    cmp -s "$T/d8/step-000003/training_state.safetensors" "$T/f8/step-000003/training_state.safetensors" && grep -q "over 2 ranks (FULL_SHARD)" "$T/out"; then
    ok "blip2_fsdp_adamw8bit_ddp_bits (losses = one process's: $(losses "$T/out" | tr '\n' ' '))"
else cat "$T/d8.log" >>"$T/out"; bad "blip2_fsdp_adamw8bit_ddp_bits" "exit $rc"; fi
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" "${A8[@]}" --devices 2 --strategy fsdp \
    --resume "$T/f8/step-000003" --out_dir "$T/f8r" >"$T/out" 2>&1; rc=$?
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" "${A8[@]}" --devices 2 --strategy fsdp \
    --resume "$T/d8/step-000003" --out_dir "$T/f8d" >>"$T/out" 2>&1; rc2=$?
if [ $rc -eq 0 ] && [ $rc2 -eq 0 ] && [ "$(grep -c "Resuming training from .*step-000003 (step 3)" "$T/out")" = 2 ] &&
    cmp -s "$T/f8/final/model.safetensors" "$T/f8r/final/model.safetensors" && cmp -s "$T/d8/final/model.safetensors" "$T/f8d/final/model.safetensors"; then
    ok "blip2_fsdp_adamw8bit_checkpoint_resumes_bits"
else bad "blip2_fsdp_adamw8bit_checkpoint_resumes_bits" "exit $rc $rc2"; fi
# the FULL_SHARD 8-bit checkpoint at another world size: resumed in one process, steps 4-6 as DDP's resumed the same way
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --optimizer bnb.optim.AdamW8bit --resume "$T/f8/step-000003" --out_dir "$T/f81" >"$T/out" 2>&1; rc=$?
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --optimizer bnb.optim.AdamW8bit --resume "$T/d8/step-000003" --out_dir "$T/d81" >"$T/d81.log" 2>&1
if [ $rc -eq 0 ] && [ "$(grep -cE '^step [4-6]/6 loss' "$T/out")" = 3 ] && cmp -s "$T/d81/final/model.safetensors" "$T/f81/final/model.safetensors"; then
    ok "blip2_fsdp_adamw8bit_checkpoint_resumes_in_one_process"
else bad "blip2_fsdp_adamw8bit_checkpoint_resumes_in_one_process" "exit $rc"; fi
# parameter offload (fsdp_cpu_offload: the parts' shards, their gradients and the optimizer in the host tier): the
# arithmetic of FULL_SHARD, so its final weights and step-3 checkpoint are FULL_SHARD's bytes; resumed under it: the
# uninterrupted bytes; in one process the plain run's final weights; rank 0's report (device and host tier) = the plan;
# NVMe (deepspeed_stage_3_offload_nvme: the shards and the optimizer state in files under out_dir) the same way
for v in "po|fsdp_cpu_offload|host tier|cpu" "pn|deepspeed_stage_3_offload_nvme|nvme tier|nvme"; do
    IFS='|' read -r d st tier name <<<"$v"
    timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --strategy "$st" \
        --train.save_interval 3 --quiet false --out_dir "$T/$d" >"$T/out" 2>&1; rc=$?
    if [ $rc -eq 0 ] && cmp -s "$T/fs-opt-full/final/model.safetensors" "$T/$d/final/model.safetensors" && grep -q "^$tier" "$T/out" &&
        cmp -s "$T/fs-opt-full/step-000003/training_state.safetensors" "$T/$d/step-000003/training_state.safetensors"; then
        ok "blip2_fsdp_${name}_offload_equal_fsdp_bits"
    else bad "blip2_fsdp_${name}_offload_equal_fsdp_bits" "exit $rc"; fi
done
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --devices 2 --strategy fsdp_cpu_offload \
    --resume "$T/po/step-000003" --out_dir "$T/por" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000003 (step 3)" "$T/out" && cmp -s "$T/po/final/model.safetensors" "$T/por/final/model.safetensors"; then
    ok "blip2_fsdp_cpu_offload_checkpoint_resumes_bits"
else bad "blip2_fsdp_cpu_offload_checkpoint_resumes_bits" "exit $rc"; fi
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --strategy fsdp_cpu_offload --out_dir "$T/po1" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && cmp -s "$T/one-opt-full/final/model.safetensors" "$T/po1/final/model.safetensors"; then
    ok "blip2_fsdp_cpu_offload_one_process_bits"
else bad "blip2_fsdp_cpu_offload_one_process_bits" "exit $rc"; fi
dev() { awk '/^(after_|before_)/ { print; getline; print } /^peak/ { print; exit }'; }
planned=$("$FL" plan tests/fixtures/blip2-tiny-opt "${PH[@]}" --devices 2 --strategy fsdp_cpu_offload 2>&1)
timeout 300 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${PH[@]}" --devices 2 --strategy fsdp_cpu_offload --out_dir "$T/pp" >"$T/out" 2>&1; rc=$?
ph=$(grep '^host (offload) ' <<<"$planned" | sed 's/^host (offload) *//'); mh=$(sed -n '/^host tier/,$p' "$T/out" | grep '^peak' | sed 's/^peak *//')
if [ $rc -eq 0 ] && [ "$(dev <<<"$planned" | grep -c .)" = 11 ] && [ "$(dev <<<"$planned")" = "$(dev <"$T/out")" ] && [ -n "$ph" ] && [ "$ph" = "$mh" ]; then
    ok "blip2_fsdp_cpu_offload_rank0_peaks_equal_plan (host tier: $(sed "s/  */ /g" <<<"$mh"))"
else printf 'planned:\n%s\n' "$planned" >>"$T/out"; bad "blip2_fsdp_cpu_offload_rank0_peaks_equal_plan" "exit $rc"; fi
# what FSDP does not run for BLIP-2: refused on every rank, exit 2, the option named once
timeout 120 mpirun -np 2 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --strategy fsdp_cpu_offload --optimizer bnb.optim.AdamW8bit \
    --devices 2 --out_dir "$T/x" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c -- "CPU offload of AdamW8bit is not supported" "$T/out")" = 1 ]; then ok "blip2_fsdp_refuses_8bit_offload"
else bad "blip2_fsdp_refuses_8bit_offload" "exit $rc"; fi
timeout 120 mpirun -np 2 "$FL" finetune_lora tests/fixtures/blip2-tiny-opt "${RUN[@]}" --lora_r 4 --strategy fsdp_cpu_offload --devices 2 --out_dir "$T/x" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && grep -q -- "parameter offload (offload_param_device cpu, --strategy fsdp_cpu_offload) shards and offloads the full model's parameters; finetune_lora" "$T/out"; then
    ok "blip2_fsdp_refuses_param_offload_under_lora"
else bad "blip2_fsdp_refuses_param_offload_under_lora" "exit $rc"; fi

# dropout in every part of the OPT variant (rate 0.3 at each site; masks from the run seed and the global micro-batch):
# 2 ranks = one process's losses, and not the losses without dropout
mkdir -p "$T/odrop" && cp tests/fixtures/blip2-tiny-opt/*.json tests/fixtures/blip2-tiny-opt/model.safetensors "$T/odrop/"
sed -i -E 's/"(dropout|attention_dropout|hidden_dropout_prob|attention_probs_dropout_prob)": 0.0/"\1": 0.3/' "$T/odrop/config.json"
timeout 300 "$FL" finetune_full tests/fixtures/blip2-tiny-opt "${RUN[@]}" --blip2.train vision,qformer,lm --out_dir "$T/od0" >"$T/zero" 2>&1
timeout 300 "$FL" finetune_full "$T/odrop" "${RUN[@]}" --blip2.train vision,qformer,lm --out_dir "$T/od1" >"$T/one" 2>&1
timeout 300 mpirun -np 2 "$FL" finetune_full "$T/odrop" "${RUN[@]}" --blip2.train vision,qformer,lm --devices 2 --out_dir "$T/od2" >"$T/out" 2>&1; rc=$?
a=$(losses "$T/one"); b=$(losses "$T/out")
if [ $rc -eq 0 ] && same "$a" "$b" && [ "$a" != "$(losses "$T/zero")" ] && grep -q "^qformer_config.hidden_dropout_prob 0.3" "$T/out"; then
    ok "blip2_ddp_np2_opt_dropout (losses = one process's: $(tr '\n' ' ' <<<"$b"))"
else echo "one process: $a" >>"$T/out"; bad "blip2_ddp_np2_opt_dropout" "exit $rc"; fi

echo "BLIP-2 MPI tests: $pass passed, $fail failed"
[ $fail -eq 0 ]
