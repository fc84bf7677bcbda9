#!/usr/bin/env bash
# T5 (an encoder-decoder, issue 31 item 3) trained over 2 MPI ranks (run by tests/mpi_test.sh, which counts its ok /
# FAIL lines): the tiny gated config at vocab 500 with the t5-tok Unigram tokenizer on tests/fixtures/t5-pairs (as
# tests/cli_test.sh), micro-batch 1 x 4 per step, 6 steps.
#   - DDP at 2 ranks against one process: the same micro-batches summed in another order (rank 0's two, rank 1's
#     two, then the all-reduce), so each of the 24 logged losses within fp32 reduction noise (1e-6 relative: 8 fp32
#     roundings);
#   - ZeRO-1, ZeRO-2 and ZeRO-2 with the optimizer offloaded: DDP's checkpoints bit for bit (weights and the AdamW
#     state: 2 x 99228 fp32 at the end of training_state.safetensors);
#   - rank 0's peaks per tag = `plan --devices 2` (as printed);
#   - the DDP checkpoint resumes in one process;
#   - FULL_SHARD / ZeRO-3 (the passes gather each unit, a block of either stack, the roots kept for the pass):
#     auto (FULL_SHARD with activation checkpointing per block) and deepspeed_stage_3 at 2 ranks against one process
#     (24 losses, 1e-6 as DDP: FSDP sums the ranks first, then the micro-batches, a reassociation of the same terms);
#     at accumulation 1 without clipping FULL_SHARD gives ZeRO-2's weights bit for bit (the reduce-scatter of
#     element i is DDP's rank-order sum, the update elementwise) in 32-true, bf16-mixed and bf16-true, at 2 and 3
#     ranks (3: units split unevenly), and ZeRO-3 with the parameters offloaded (cpu, nvme) too; a validation split
#     of 3 pairs at 2 ranks (a rank repeats a forward) and the evaluation sample (every rank decodes in step) give
#     DDP's val losses and text; rank 0's peaks per tag = `plan --devices 2 --strategy fsdp --rank 0`, the ranks'
#     peak totals = the plan's of rank 0 and 1; the FULL_SHARD checkpoint resumes in one process.
#   - pipeline parallelism (the end of the file): PP 2 and DP 2 x PP 2 ZeRO-2 against one process, plan = measured,
#     checkpoints resumed across grids, LoRA on the stages one process's bits, validation through the stages, TP 2 x PP 2, interleaved.
# Usage: tests/mpi_t5_test.sh [build-dir]; skips (exit 0) without MPI or mpirun.
set -u
BUILD=${1:-build}
FL=$BUILD/fitllm
if [ ! -x "$BUILD/fitllm_comm_mpi_test" ] || ! command -v mpirun >/dev/null 2>&1; then
    echo "skip T5 MPI tests: no MPI build or no mpirun"
    exit 0
fi
source "$(dirname "$0")/mpi_env.sh"   # root, oversubscription, 1 OpenMP thread, Open MPI's start-up
pass=0; fail=0
T=$(mktemp -d "${TMPDIR:-/tmp}"/fitllm-mpi-t5-XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
ok()  { echo "ok   $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; sed 's/^/     /' "$T/out" | tail -15; fail=$((fail+1)); }

mkdir -p "$T/t5m" && cp tests/fixtures/t5-tok/spiece.model tests/fixtures/t5-tok/tokenizer.json tests/fixtures/t5-tok/tokenizer_config.json "$T/t5m/"
sed 's/"vocab_size": 97/"vocab_size": 500/' tests/fixtures/t5-tiny-gated/config.json > "$T/t5m/config.json"
T5M=(--checkpoint_dir "$T/t5m" --init random --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json --train.max_steps 6
     --train.epochs 100 --train.global_batch_size 4 --train.micro_batch_size 1 --train.log_interval 1 --optimizer.lr 3e-3
     --train.lr_warmup_steps 2 --train.save_interval 3 --threads 1)
t5ok=1
timeout 300 "$FL" finetune_full "${T5M[@]}" --out_dir "$T/t5-one" >"$T/out" 2>&1 || { t5ok=0; bad "t5_one_process" "exit $?"; }
for st in ddp deepspeed_stage_1 deepspeed_stage_2 deepspeed_stage_2_offload; do
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" --devices 2 --strategy $st --out_dir "$T/t5-$st" >"$T/out-$st" 2>&1 \
        || { t5ok=0; cp "$T/out-$st" "$T/out"; bad "t5_np2_$st" "exit $?"; }
done
if [ $t5ok = 1 ]; then
    l1=$(awk -F, 'NR > 1 && $4 != "" { print $4 }' "$T/t5-one/logs/metrics.csv")
    l2=$(awk -F, 'NR > 1 && $4 != "" { print $4 }' "$T/t5-ddp/logs/metrics.csv")
    worst=$(paste <(echo "$l1") <(echo "$l2") | awk 'BEGIN { w = 0; n = 0 } { d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ }
        END { if (n != 24) print "count " n; else printf "%.2g", w }')
    if awk -v w="$worst" 'BEGIN { exit !(w ~ /^[0-9.e+-]+$/ && w + 0 <= 1e-6) }'; then
        ok "t5_ddp_np2_vs_one_process (24 losses, worst relative difference $worst)"
    else
        cp "$T/out-ddp" "$T/out"; bad "t5_ddp_np2_vs_one_process" "worst relative loss difference $worst"
    fi
    zsame=1
    for st in deepspeed_stage_1 deepspeed_stage_2 deepspeed_stage_2_offload; do
        for ck in step-000003 final; do
            cmp -s "$T/t5-ddp/$ck/model.safetensors" "$T/t5-$st/$ck/model.safetensors" || zsame=0
            cmp -s <(tail -c 793824 "$T/t5-ddp/$ck/training_state.safetensors") \
                   <(tail -c 793824 "$T/t5-$st/$ck/training_state.safetensors") || zsame=0
        done
    done
    if [ $zsame = 1 ]; then ok "t5_zero_np2 (ZeRO-1/2 and ZeRO-2 offload checkpoints = DDP's, bit for bit)"
    else bad "t5_zero_np2" "a ZeRO checkpoint differs from DDP's"; fi
    psame=1
    for st in ddp deepspeed_stage_2 deepspeed_stage_2_offload; do
        planned=$("$FL" plan "${T5M[@]}" --devices 2 --strategy $st --data.max_source_length 40 --data.max_target_length 15 |
                  awk '/^peak +reserved/ { for (i = 3; i <= 16; i += 2) printf "%s %s,", $i, $(i + 1) }')
        measured=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER) / { printf "%s %s,", $4, $5 }' "$T/out-$st" | head -c 400)
        [ -n "$planned" ] && [ "$planned" = "${measured:0:${#planned}}" ] || { psame=0; echo "     $st: planned $planned measured $measured"; }
    done
    if [ $psame = 1 ]; then ok "t5_np2_peaks_equal_plan (DDP, ZeRO-2, ZeRO-2 offload: rank 0's peak per tag)"
    else bad "t5_np2_peaks_equal_plan" "rank 0's peaks differ from the plan"; fi
    timeout 300 "$FL" finetune_full "${T5M[@]}" --resume "$T/t5-ddp/step-000003" --out_dir "$T/t5-res" >"$T/out" 2>&1; rc=$?
    if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000003 (step 3, iter 12)" "$T/out"; then
        ok "t5_ddp_checkpoint_resumes_in_one_process"
    else
        bad "t5_ddp_checkpoint_resumes_in_one_process" "exit $rc"
    fi
fi
# FULL_SHARD / ZeRO-3
losses() { awk -F, 'NR > 1 && $4 != "" { print $4 }' "$1/logs/metrics.csv"; }
worst_vs() { # worst relative difference of two runs' logged losses (or "count N")
    paste <(losses "$1") <(losses "$2") | awk 'BEGIN { w = 0; n = 0 } { d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ }
        END { if (n != 24) print "count " n; else printf "%.2g", w }'
}
for st in auto deepspeed_stage_3; do
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" --devices 2 --strategy $st --out_dir "$T/t5-z3-$st" >"$T/out-z3-$st" 2>&1; rc=$?
    w=$(worst_vs "$T/t5-one" "$T/t5-z3-$st" 2>/dev/null)
    if [ $rc -eq 0 ] && [ $t5ok = 1 ] && awk -v w="$w" 'BEGIN { exit !(w ~ /^[0-9.e+-]+$/ && w + 0 <= 1e-6) }'; then
        ok "t5_fsdp_np2_${st}_vs_one_process (24 losses, worst relative difference $w)"
    else
        cp "$T/out-z3-$st" "$T/out"; bad "t5_fsdp_np2_${st}_vs_one_process" "exit $rc, worst relative loss difference $w"
    fi
done
grep -q "data parallel (ZeRO-3 (FSDP FULL_SHARD), strategy auto: .*activation checkpointing per block" "$T/out-z3-auto" \
    && ok "t5_fsdp_auto_is_full_shard_with_act_ckpt" || { cp "$T/out-z3-auto" "$T/out"; bad "t5_fsdp_auto_is_full_shard_with_act_ckpt" "the run's description"; }
# accumulation 1 without clipping: FULL_SHARD's weights = ZeRO-2's bit for bit
A1=(--train.global_batch_size 2 --train.max_steps 4)
fsame=1
# the quick tier (make test) leaves out bf16-mixed (2 runs): FULL_SHARD's bf16-mixed path (the gathered units' bf16
# copies) runs in the unit pass's fsdp_threads_accum1_equals_zero2_bits (FITLLM_TEST_TIER is exported by tests/run_all.sh)
# and over MPI with a T5 stack in tests/mpi_blip2_test.sh's blip2_fsdp_np2_t5_mixed_deepspeed_stage_3 (DDP's bits)
A1P="32-true bf16-mixed bf16-true"; [ "${FITLLM_TEST_TIER:-quick}" = full ] || A1P="32-true bf16-true"
for p in $A1P; do
    for st in deepspeed_stage_2 fsdp; do
        timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${A1[@]}" --precision $p --devices 2 --strategy $st \
            --out_dir "$T/a1-$p-$st" >"$T/out" 2>&1 || { fsame=0; echo "     $p $st: exit $?"; tail -3 "$T/out"; }
    done
    cmp -s "$T/a1-$p-deepspeed_stage_2/final/model.safetensors" "$T/a1-$p-fsdp/final/model.safetensors" || { fsame=0; echo "     $p differs"; }
done
mkdir -p "$T/nv"
for st in fsdp_cpu_offload deepspeed_stage_3_offload_nvme; do
    extra=(); [ $st = deepspeed_stage_3_offload_nvme ] && extra=(--nvme_path "$T/nv")
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${A1[@]}" --devices 2 --strategy $st "${extra[@]}" \
        --out_dir "$T/a1-$st" >"$T/out" 2>&1 || { fsame=0; echo "     $st: exit $?"; tail -3 "$T/out"; }
    cmp -s "$T/a1-32-true-deepspeed_stage_2/final/model.safetensors" "$T/a1-$st/final/model.safetensors" || { fsame=0; echo "     $st differs"; }
done
# HYBRID_SHARD as 2 nodes x 1 rank (DDP's order: ZeRO-2's bits); sharded checkpoints saved by FULL_SHARD and resumed
hsame=1
timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${A1[@]}" --devices 1 --num_nodes 2 --strategy fsdp \
    --fsdp.sharding_strategy HYBRID_SHARD --out_dir "$T/a1-hybrid" >"$T/out" 2>&1 || { hsame=0; echo "     hybrid: exit $?"; tail -3 "$T/out"; }
cmp -s "$T/a1-32-true-deepspeed_stage_2/final/model.safetensors" "$T/a1-hybrid/final/model.safetensors" || { hsame=0; echo "     hybrid differs"; }
timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${A1[@]}" --devices 2 --strategy fsdp --fsdp.state_dict_type sharded \
    --out_dir "$T/a1-sh" >"$T/out" 2>&1 || { hsame=0; echo "     sharded save: exit $?"; tail -3 "$T/out"; }
[ -f "$T/a1-sh/step-000003/shard-00001-of-00002.safetensors" ] || { hsame=0; echo "     no sharded checkpoint"; }
timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${A1[@]}" --devices 2 --strategy fsdp --resume "$T/a1-sh/step-000003" \
    --out_dir "$T/a1-shr" >"$T/out" 2>&1 || { hsame=0; echo "     sharded resume: exit $?"; tail -3 "$T/out"; }
cmp -s "$T/a1-32-true-fsdp/final/model.safetensors" "$T/a1-shr/final/model.safetensors" || { hsame=0; echo "     sharded resume differs"; }
if [ $hsame = 1 ]; then ok "t5_fsdp_hybrid_and_sharded_ckpt (HYBRID 2 x 1 = ZeRO-2's bits; a sharded step-3 checkpoint resumed = the uninterrupted run's bits)"
else bad "t5_fsdp_hybrid_and_sharded_ckpt" "see above"; fi
A3=(--train.global_batch_size 3 --train.max_steps 4)
for st in deepspeed_stage_2 fsdp; do
    timeout 300 mpirun -np 3 "$FL" finetune_full "${T5M[@]}" "${A3[@]}" --devices 3 --strategy $st --out_dir "$T/a3-$st" >"$T/out" 2>&1 \
        || { fsame=0; echo "     np3 $st: exit $?"; tail -3 "$T/out"; }
done
cmp -s "$T/a3-deepspeed_stage_2/final/model.safetensors" "$T/a3-fsdp/final/model.safetensors" || { fsame=0; echo "     np3 differs"; }
if [ $fsame = 1 ]; then ok "t5_fsdp_equals_zero2_bits (accumulation 1: ${A1P// /, }, cpu and nvme parameter offload at 2 ranks, 32-true at 3)"
else bad "t5_fsdp_equals_zero2_bits" "a FULL_SHARD run's weights differ from ZeRO-2's"; fi
# validation (3 pairs over 2 ranks) and the evaluation sample under FULL_SHARD = DDP's (accumulation 1: the same weights)
VS=(--data.val_split_fraction 0.375 --eval.interval 3 --eval.max_new_tokens 6 --train.max_steps 6)
for st in ddp fsdp; do
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${A1[@]}" "${VS[@]}" --devices 2 --strategy $st --out_dir "$T/v-$st" >"$T/out-v-$st" 2>&1 || echo "     val $st: exit $?"
done
ev() { grep -E "val loss|^Recommend" -A1 "$1" | grep -v -E -- "^--|^Sav" | sed "s/, val time.*//"; }
if [ "$(ev "$T/out-v-ddp" | grep -c "val loss")" -ge 3 ] && [ "$(ev "$T/out-v-ddp")" = "$(ev "$T/out-v-fsdp")" ]; then
    ok "t5_fsdp_validation_and_sample_equal_ddp"
else
    cp "$T/out-v-fsdp" "$T/out"; bad "t5_fsdp_validation_and_sample_equal_ddp" "the val losses or the sample differ from DDP's"
fi
# memory: rank 0's peaks per tag and both ranks' totals = the plan
PL=(--devices 2 --strategy auto --data.max_source_length 40 --data.max_target_length 15)
planned=$("$FL" plan "${T5M[@]}" "${PL[@]}" --rank 0 | awk '/^peak +reserved/ { for (i = 3; i <= 16; i += 2) printf "%s %s,", $i, $(i + 1) }')
measured=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER) / { printf "%s %s,", $4, $5 }' "$T/out-z3-auto" | head -c 400)
range=$(awk '/^\| peak total, ranks min - max/ { print $8, $9, $11, $12 }' "$T/out-z3-auto")
exp_range=$(for r in 0 1; do "$FL" plan "${T5M[@]}" "${PL[@]}" --rank $r | awk '/^peak +reserved/ { printf "%s %s\n", $17, $18 }'; done | sort -g | paste -sd' ')
if [ -n "$planned" ] && [ "$planned" = "${measured:0:${#planned}}" ] && [ "$range" = "$exp_range" ]; then
    ok "t5_fsdp_peaks_equal_plan (rank 0 per tag: $planned; ranks' totals $range)"
else
    bad "t5_fsdp_peaks_equal_plan" "planned $planned measured $measured; totals planned $exp_range measured $range"
fi
timeout 300 "$FL" finetune_full "${T5M[@]}" --resume "$T/t5-z3-auto/step-000003" --out_dir "$T/t5-z3res" >"$T/out" 2>&1; rc=$?
# the logged loss is LitGPT's running mean over the accumulation's 4 micro-batches, which a resume starts empty:
# the last 9 of steps 4-6 (each a full window) compared
w=$(paste <(losses "$T/t5-z3-auto" | tail -9) <(losses "$T/t5-z3res" | tail -9) | awk '{ d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ } END { if (n != 9) print "count " n; else printf "%.2g", w }')
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000003 (step 3, iter 12)" "$T/out" \
    && awk -v w="$w" 'BEGIN { exit !(w ~ /^[0-9.e+-]+$/ && w + 0 <= 1e-6) }'; then
    ok "t5_fsdp_checkpoint_resumes_in_one_process (iters 16-24 within $w of the 2-rank run)"
else
    bad "t5_fsdp_checkpoint_resumes_in_one_process" "exit $rc, worst relative loss difference $w"
fi

# dropout (config.json dropout_rate 0.1): the masks follow the run's seed and the global micro-batch, so DDP at 2
# ranks draws what one process draws: its 24 losses within DDP's reduction noise of one process (1e-6 relative), and
# FULL_SHARD (auto: checkpointing per block, each block's masks drawn again in its recompute) the same
mkdir -p "$T/t5d" && cp "$T/t5m"/* "$T/t5d/" && sed -i 's/"dropout_rate": 0.0/"dropout_rate": 0.1/' "$T/t5d/config.json"
T5D=("${T5M[@]}" --checkpoint_dir "$T/t5d")
dok=1
timeout 300 "$FL" finetune_full "${T5D[@]}" --out_dir "$T/d-one" >"$T/out" 2>&1 || { dok=0; bad "t5_dropout_one_process" "exit $?"; }
for st in ddp auto; do
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5D[@]}" --devices 2 --strategy $st --out_dir "$T/d-$st" >"$T/out-d-$st" 2>&1 \
        || { dok=0; cp "$T/out-d-$st" "$T/out"; bad "t5_dropout_np2_$st" "exit $?"; }
done
for st in ddp auto; do
    [ $dok = 1 ] || break
    w=$(paste <(losses "$T/d-one") <(losses "$T/d-$st") | awk '{ d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ } END { if (n != 24) print "count " n; else printf "%.2g", w }')
    if awk -v w="$w" 'BEGIN { exit !(w ~ /^[0-9.e+-]+$/ && w + 0 <= 1e-6) }' && ! cmp -s "$T/d-one/final/model.safetensors" "$T/t5-one/final/model.safetensors"; then
        ok "t5_dropout_np2_${st}_vs_one_process (24 losses, worst relative difference $w)"
    else
        cp "$T/out-d-$st" "$T/out"; bad "t5_dropout_np2_${st}_vs_one_process" "worst relative loss difference $w"
    fi
done

# tensor parallelism (--tensor_parallel; tests/test_tp_t5_train.c has the bounds' reasons): the dropout folder with 4
# heads (d_ff 52: 26 a rank at TP 2), TP 2 at 2 ranks and DP 2 x TP 2 at 4 ranks against one process (24 losses within
# 1e-6 relative: the slices sum the same terms grouped by rank; the masks are one process's), then TP 2's consolidated
# step-3 checkpoint (one process's HF folder) resumed in one process: iterations 16-24 within 1e-6 of the TP 2 run
mkdir -p "$T/t5tp" && cp "$T/t5d"/* "$T/t5tp/" && sed -i 's/"num_heads": 3/"num_heads": 4/' "$T/t5tp/config.json"
T5P=("${T5M[@]}" --checkpoint_dir "$T/t5tp")
pok=1
timeout 300 "$FL" finetune_full "${T5P[@]}" --out_dir "$T/p-one" >"$T/out" 2>&1 || { pok=0; bad "t5_tp_one_process" "exit $?"; }
for grid in "2 2" "4 2"; do
    set -- $grid
    timeout 300 mpirun -np $1 "$FL" finetune_full "${T5P[@]}" --devices $1 --tensor_parallel $2 --strategy ddp \
        --out_dir "$T/p-$1-$2" >"$T/out-p-$1-$2" 2>&1 || { pok=0; cp "$T/out-p-$1-$2" "$T/out"; bad "t5_tp_np$1_tp$2" "exit $?"; }
    [ $pok = 1 ] || continue
    w=$(paste <(losses "$T/p-one") <(losses "$T/p-$1-$2") | awk '{ d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ } END { if (n != 24) print "count " n; else printf "%.2g", w }')
    if awk -v w="$w" 'BEGIN { exit !(w ~ /^[0-9.e+-]+$/ && w + 0 <= 1e-6) }' \
        && grep -q "^tensor parallel: $2 ranks per group x $(($1 / $2)) data-parallel group" "$T/out-p-$1-$2" \
        && [ -f "$T/p-$1-$2/final/model.safetensors" ]; then
        ok "t5_tp_np$1_tp$2_vs_one_process (24 losses, worst relative difference $w)"
    else
        cp "$T/out-p-$1-$2" "$T/out"; bad "t5_tp_np$1_tp$2_vs_one_process" "worst relative loss difference $w"
    fi
done
if [ $pok = 1 ]; then
    timeout 300 "$FL" finetune_full "${T5P[@]}" --resume "$T/p-2-2/step-000003" --out_dir "$T/p-r1" >"$T/out" 2>&1; rc=$?
    w=$(paste <(losses "$T/p-2-2" | tail -9) <(losses "$T/p-r1" | tail -9) | awk '{ d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ } END { if (n != 9) print "count " n; else printf "%.2g", w }')
    if [ $rc -eq 0 ] && awk -v w="$w" 'BEGIN { exit !(w ~ /^[0-9.e+-]+$/ && w + 0 <= 1e-6) }'; then
        ok "t5_tp_checkpoint_resumes_in_one_process (iters 16-24 within $w of the TP 2 run)"
    else
        bad "t5_tp_checkpoint_resumes_in_one_process" "exit $rc, worst relative loss difference $w"
    fi
fi
# a validation split and the evaluation sample under TP 2: the lead's group decodes together (its blocks' sums), so
# the val losses and the sampled text are one process's
if [ $pok = 1 ]; then
    EV=(--data.val_split_fraction 0.2 --eval.interval 2 --eval.max_new_tokens 8 --train.save_interval 0 --train.max_steps 4)
    timeout 300 "$FL" finetune_full "${T5P[@]}" "${EV[@]}" --out_dir "$T/pe-one" >"$T/out-pe1" 2>&1; rc=$?
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5P[@]}" "${EV[@]}" --devices 2 --tensor_parallel 2 --out_dir "$T/pe-2" \
        >"$T/out-pe2" 2>&1 || rc=$?
    ev() { grep -A1 "^Recommend a movie" "$1"; grep -o "val loss[: ]*[0-9.]*" "$1"; }
    if [ $rc -eq 0 ] && [ "$(ev "$T/out-pe2" | grep -c "val loss")" = 3 ] && diff <(ev "$T/out-pe1") <(ev "$T/out-pe2") >/dev/null; then
        ok "t5_tp_np2_validation_and_sample (val losses and the sampled text = one process's)"
    else
        cp "$T/out-pe2" "$T/out"; bad "t5_tp_np2_validation_and_sample" "exit $rc"
    fi
fi

# Pipeline parallelism (issue 35; src/model/seq2seq_stage.c): the stages split [encoder blocks; decoder blocks] (2 + 3
# here, split by cost [0, 3) [3, 5): the encoder and the decoder's first block, then two decoder blocks). Against one
# process: the shared embedding's and the relative bias tables' gradients are summed over the stages once per step
# (one process sums them micro-batch by micro-batch), so 1e-6 as DDP; PP 2 (1F1B) and DP 2 x PP 2 under ZeRO-2
# (GPipe); rank 0's peaks per tag = `plan --pipeline_parallel 2 --rank 0` (its ACTS with the micro-batch in flight) and
# the ranks' totals = the plan's of ranks 0 and 1; PP 2's step-3 checkpoint resumed in one process, and one process's
# at PP 2, continue within 1e-6 of one process resumed from its own.
if [ $t5ok = 1 ]; then
    losses() { awk -F, 'NR > 1 && $4 != "" { print $4 }' "$1/logs/metrics.csv"; }
    within() { # $1 $2 runs, $3 the last n losses: the worst relative difference, or "count N"
        paste <(losses "$1" | tail -n "$3") <(losses "$2" | tail -n "$3") | awk -v n0="$3" '{ d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ }
            END { if (n != n0) print "count " n; else printf "%.2g", w + 0 }'; }
    small() { awk -v w="$1" 'BEGIN { exit !(w ~ /^[0-9.e+-]+$/ && w + 0 <= 1e-6) }'; }
    PPA=(--devices 2 --pipeline_parallel 2)
    PPL=(--data.max_source_length 40 --data.max_target_length 15) # the plan's: the data's longest pair, as above
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${PPA[@]}" --out_dir "$T/pp-2" >"$T/out-pp2" 2>&1; rc=$?
    w=$(within "$T/t5-one" "$T/pp-2" 24)
    if [ $rc -eq 0 ] && small "$w"; then ok "t5_pp_np2_vs_one_process (24 losses, worst relative difference $w)"
    else cp "$T/out-pp2" "$T/out"; bad "t5_pp_np2_vs_one_process" "exit $rc, worst relative loss difference $w"; fi
    planned=$("$FL" plan "${T5M[@]}" "${PPA[@]}" "${PPL[@]}" --rank 0 | awk '/^peak +reserved/ { for (i = 3; i <= 16; i += 2) printf "%s %s,", $i, $(i + 1) }')
    measured=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER) / { printf "%s %s,", $4, $5 }' "$T/out-pp2" | head -c 400)
    exp_range=$(for r in 0 1; do "$FL" plan "${T5M[@]}" "${PPA[@]}" "${PPL[@]}" --rank $r | awk '/^peak +reserved/ { printf "%s %s\n", $17, $18 }'; done | sort -g | paste -sd' ')
    got_range=$(awk '/^\| peak total, ranks min - max/ { print $8, $9, $11, $12 }' "$T/out-pp2")
    if [ -n "$planned" ] && [ "$planned" = "${measured:0:${#planned}}" ] && [ "$got_range" = "$exp_range" ]; then
        ok "t5_pp_np2_peaks_equal_plan (rank 0 per tag, ranks' totals $got_range)"
    else bad "t5_pp_np2_peaks_equal_plan" "planned $planned measured $measured; totals $exp_range vs $got_range"; fi
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5M[@]}" --devices 4 --pipeline_parallel 2 --pipeline_schedule gpipe \
        --strategy deepspeed_stage_2 --out_dir "$T/pp-z2" >"$T/out-ppz" 2>&1; rc=$?
    w=$(within "$T/t5-one" "$T/pp-z2" 24)
    if [ $rc -eq 0 ] && small "$w"; then ok "t5_pp_np4_dp2_pp2_zero2_gpipe_vs_one_process (24 losses, worst $w)"
    else cp "$T/out-ppz" "$T/out"; bad "t5_pp_np4_dp2_pp2_zero2_gpipe_vs_one_process" "exit $rc, worst $w"; fi
    timeout 300 "$FL" finetune_full "${T5M[@]}" --resume "$T/t5-one/step-000003" --out_dir "$T/pp-r0" >"$T/out" 2>&1; rc=$?
    timeout 300 "$FL" finetune_full "${T5M[@]}" --resume "$T/pp-2/step-000003" --out_dir "$T/pp-r1" >"$T/out" 2>&1 || rc=$?
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" --devices 2 --pipeline_parallel 2 --resume "$T/t5-one/step-000003" \
        --out_dir "$T/pp-r2" >"$T/out" 2>&1 || rc=$?
    w1=$(within "$T/pp-r0" "$T/pp-r1" 12); w2=$(within "$T/pp-r0" "$T/pp-r2" 12)
    # LoRA (dropout 0.1) on the stages: each stage's adapters keyed by the whole model's module index, the base frozen (no
    # summed gradient): one process's losses, final/ and adapter bytes; PP 2's step-3 checkpoint resumed in one process
    # and one process's at PP 2 end on one process resumed's adapter bits
    LA=(--lora_r 4 --lora_dropout 0.1)
    timeout 300 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" --out_dir "$T/pl-1" >"$T/out" 2>&1; rc=$?
    timeout 300 mpirun -np 2 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" "${PPA[@]}" --out_dir "$T/pl-2" >"$T/out" 2>&1 || rc=$?
    timeout 300 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" --resume "$T/pl-1/step-000003" --out_dir "$T/pl-r0" >"$T/out" 2>&1 || rc=$?
    timeout 300 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" --resume "$T/pl-2/step-000003" --out_dir "$T/pl-r1" >"$T/out" 2>&1 || rc=$?
    timeout 300 mpirun -np 2 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" "${PPA[@]}" --resume "$T/pl-1/step-000003" \
        --out_dir "$T/pl-r2" >"$T/out" 2>&1 || rc=$?
    lsame=1
    [ "$(losses "$T/pl-1" | md5sum)" = "$(losses "$T/pl-2" | md5sum)" ] && [ "$(losses "$T/pl-1" | grep -c .)" = 24 ] || lsame=0
    for f in final/model.safetensors final/adapter/adapter_model.safetensors step-000003/adapter_model.safetensors; do
        cmp -s "$T/pl-1/$f" "$T/pl-2/$f" || lsame=0
    done
    for r in pl-r1 pl-r2; do cmp -s "$T/pl-r0/final/adapter/adapter_model.safetensors" "$T/$r/final/adapter/adapter_model.safetensors" || lsame=0; done
    if [ $rc -eq 0 ] && [ $lsame = 1 ]; then ok "t5_pp_np2_lora_equals_one_process (losses, final/, adapter; resumed across grids: bit for bit)"
    else bad "t5_pp_np2_lora_equals_one_process" "exit $rc, same $lsame"; fi
    # TP 2 x PP 2 (4 heads: the test config with num_heads 4): each stage's blocks split over its group; a decoder stage
    # before the decoder's end sums its blocks' parts of d(encoder output) over the group before adding the later
    # stages' (summing them again gave 5.5e-5): against one process 1e-6, the step-3 checkpoint resumed in one process,
    # rank 0's peaks per tag = the plan's (LoRA on this grid: 1.2e-8, checked by hand)
    mkdir -p "$T/t5m4" && cp "$T/t5m"/* "$T/t5m4/" && sed -i 's/"num_heads": 3/"num_heads": 4/' "$T/t5m4/config.json"
    T5Q=("${T5M[@]}"); T5Q[1]="$T/t5m4"
    TQ=(--devices 4 --tensor_parallel 2 --pipeline_parallel 2)
    timeout 300 "$FL" finetune_full "${T5Q[@]}" --out_dir "$T/tq-1" >"$T/out" 2>&1; rq=$?
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5Q[@]}" "${TQ[@]}" --out_dir "$T/tq-4" >"$T/out-tq" 2>&1 || rq=$?
    timeout 300 "$FL" finetune_full "${T5Q[@]}" --resume "$T/tq-1/step-000003" --out_dir "$T/tq-r0" >"$T/out" 2>&1 || rq=$?
    timeout 300 "$FL" finetune_full "${T5Q[@]}" --resume "$T/tq-4/step-000003" --out_dir "$T/tq-r1" >"$T/out" 2>&1 || rq=$?
    q1=$(within "$T/tq-1" "$T/tq-4" 24); q2=$(within "$T/tq-r0" "$T/tq-r1" 12)
    qp=$("$FL" plan "${T5Q[@]}" "${TQ[@]}" "${PPL[@]}" --rank 0 | awk '/^peak +reserved/ { for (i = 3; i <= 16; i += 2) printf "%s %s,", $i, $(i + 1) }')
    qm=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER) / { printf "%s %s,", $4, $5 }' "$T/out-tq" | head -c 400)
    [ -n "$qp" ] && [ "$qp" = "${qm:0:${#qp}}" ] || { rq=1; echo "     TP x PP rank 0: planned $qp measured $qm"; }
    if [ $rq -eq 0 ] && small "$q1" && small "$q2"; then
        ok "t5_pp_np4_tp2_pp2 (vs one process $q1, resumed in one process $q2; rank 0's peaks = plan)"
    else cp "$T/out-tq" "$T/out"; bad "t5_pp_np4_tp2_pp2" "exit $rq, worst $q1 / $q2"; fi
    # the interleaved schedule (2 chunks per rank: 4 virtual stages [0, 2) [2, 3) [3, 4) [4, 5)): the pipeline sum over
    # every chunk of every rank; against one process 1e-6, its step-3 checkpoint resumed in one process
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${PPA[@]}" --pipeline_schedule interleaved --out_dir "$T/pi-2" \
        >"$T/out-pi" 2>&1; ri=$?
    timeout 300 "$FL" finetune_full "${T5M[@]}" --resume "$T/pi-2/step-000003" --out_dir "$T/pi-r1" >"$T/out" 2>&1 || ri=$?
    i1=$(within "$T/t5-one" "$T/pi-2" 24); i2=$(within "$T/pp-r0" "$T/pi-r1" 12)
    if [ $ri -eq 0 ] && small "$i1" && small "$i2" && grep -q "virtual stages' blocks: \[0, 2) \[2, 3) \[3, 4) \[4, 5)" "$T/out-pi"; then
        ok "t5_pp_np2_interleaved (vs one process $i1, resumed in one process $i2)"
    else cp "$T/out-pi" "$T/out"; bad "t5_pp_np2_interleaved" "exit $ri, worst $i1 / $i2"; fi
    # a validation split (3 pairs) through the stages in turn: the val losses within 1e-6 of one process's (the weights
    # differ by the pipeline's sums' rounding); no evaluation sample on a pipeline (said by the decoder-only runs too)
    EV=(--data.val_split_fraction 0.2 --eval.interval 2 --eval.max_new_tokens 8 --train.save_interval 0 --train.max_steps 4)
    timeout 300 "$FL" finetune_full "${T5M[@]}" "${EV[@]}" --out_dir "$T/pv-1" >"$T/out" 2>&1; rv=$?
    timeout 300 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" "${EV[@]}" "${PPA[@]}" --out_dir "$T/pv-2" >"$T/out-ppv" 2>&1 || rv=$?
    vl() { awk -F, 'NR > 1 && $9 != "" { print $9 }' "$1/logs/metrics.csv"; }
    w=$(paste <(vl "$T/pv-1") <(vl "$T/pv-2") | awk '{ d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ } END { if (n != 2) print "count " n; else printf "%.2g", w + 0 }')
    if [ $rv -eq 0 ] && small "$w"; then ok "t5_pp_np2_validation (2 val losses within $w of one process's)"
    else cp "$T/out-ppv" "$T/out"; bad "t5_pp_np2_validation" "exit $rv, worst $w"; fi
    if [ $rc -eq 0 ] && small "$w1" && small "$w2"; then
        ok "t5_pp_checkpoints_resume_across_grids (PP 2 -> one process $w1, one process -> PP 2 $w2)"
    else bad "t5_pp_checkpoints_resume_across_grids" "exit $rc, worst $w1 / $w2"; fi
    # FULL_SHARD on the data axis (DP 2 x PP 2, 1F1B; each stage's units sharded over the axis, the root units gathered
    # again and their gradients reopened before each backward, the shared embedding's and tables' gradients made whole on
    # the axis before the pipeline's sum): one process's losses within 1e-6 (without regathering the roots after the
    # update: 4.3e-2), rank 0's peaks per tag and the ranks' totals = the plan's; the step-3 checkpoint resumed in one
    # process and one process's resumed on this grid within 1e-6 of one process resumed from its own; a validation
    # split (a rank's padding forward through the stages) within 1e-6 of one process's
    FA=(--devices 4 --pipeline_parallel 2 --strategy fsdp)
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5M[@]}" "${FA[@]}" --out_dir "$T/pf-4" >"$T/out-pf" 2>&1; rf=$?
    timeout 300 "$FL" finetune_full "${T5M[@]}" --resume "$T/pf-4/step-000003" --out_dir "$T/pf-r1" >"$T/out" 2>&1 || rf=$?
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5M[@]}" "${FA[@]}" --resume "$T/t5-one/step-000003" --out_dir "$T/pf-r2" \
        >"$T/out" 2>&1 || rf=$?
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5M[@]}" "${EV[@]}" "${FA[@]}" --out_dir "$T/pf-v" >"$T/out" 2>&1 || rf=$?
    f1=$(within "$T/t5-one" "$T/pf-4" 24); f2=$(within "$T/pp-r0" "$T/pf-r1" 12); f3=$(within "$T/pp-r0" "$T/pf-r2" 12)
    f4=$(paste <(vl "$T/pv-1") <(vl "$T/pf-v") | awk '{ d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ } END { if (n != 2) print "count " n; else printf "%.2g", w + 0 }')
    fp=$("$FL" plan "${T5M[@]}" "${FA[@]}" "${PPL[@]}" --rank 0 | awk '/^peak +reserved/ { for (i = 3; i <= 16; i += 2) printf "%s %s,", $i, $(i + 1) }')
    fm=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER) / { printf "%s %s,", $4, $5 }' "$T/out-pf" | head -c 400)
    fr=$(for r in 0 1; do "$FL" plan "${T5M[@]}" "${FA[@]}" "${PPL[@]}" --rank $r | awk '/^peak +reserved/ { printf "%s %s\n", $17, $18 }'; done | sort -g | paste -sd' ')
    fg=$(awk '/^\| peak total, ranks min - max/ { print $8, $9, $11, $12 }' "$T/out-pf")
    [ -n "$fp" ] && [ "$fp" = "${fm:0:${#fp}}" ] && [ "$fr" = "$fg" ] || { rf=1; echo "     planned $fp / $fr, measured $fm / $fg"; }
    if [ $rf -eq 0 ] && small "$f1" && small "$f2" && small "$f3" && small "$f4" && grep -q "ZeRO-3 (FSDP FULL_SHARD)" "$T/out-pf"; then
        ok "t5_pp_np4_dp2_pp2_full_shard (vs one process $f1, resumed in one process $f2, one process's resumed $f3, val $f4; peaks = plan)"
    else cp "$T/out-pf" "$T/out"; bad "t5_pp_np4_dp2_pp2_full_shard" "exit $rf, worst $f1 / $f2 / $f3 / $f4"; fi
    # ZeRO-3 under GPipe, FULL_SHARD under the interleaved schedule (each chunk's units on their own bookkeeping) and
    # HYBRID_SHARD as 2 nodes of 2 pipelines (8 ranks: FULL_SHARD in the node, replicated across): one process's losses
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5M[@]}" --devices 4 --pipeline_parallel 2 --strategy deepspeed_stage_3 \
        --pipeline_schedule gpipe --out_dir "$T/pf-z3" >"$T/out" 2>&1; rz=$?
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5M[@]}" "${FA[@]}" --pipeline_schedule interleaved --out_dir "$T/pf-i" \
        >>"$T/out" 2>&1 || rz=$?
    timeout 300 mpirun -np 8 "$FL" finetune_full "${T5M[@]}" --devices 4 --num_nodes 2 --pipeline_parallel 2 --strategy fsdp \
        --fsdp.sharding_strategy HYBRID_SHARD --out_dir "$T/pf-h" >>"$T/out" 2>&1 || rz=$?
    z1=$(within "$T/t5-one" "$T/pf-z3" 24); z2=$(within "$T/t5-one" "$T/pf-i" 24); z3=$(within "$T/t5-one" "$T/pf-h" 24)
    if [ $rz -eq 0 ] && small "$z1" && small "$z2" && small "$z3" && grep -q "data parallel (FSDP HYBRID_SHARD, strategy fsdp): 4 ranks" "$T/out"; then
        ok "t5_pp_zero3_gpipe_interleaved_hybrid (vs one process: ZeRO-3 GPipe $z1, FULL_SHARD interleaved $z2, HYBRID 2 x 2 $z3)"
    else bad "t5_pp_zero3_gpipe_interleaved_hybrid" "exit $rz, worst $z1 / $z2 / $z3"; fi
    # FULL_SHARD's parameter offload on T5's stages (DP 2 x PP 2, 1F1B): each rank's pieces of its units' parameters,
    # gradients and optimizer state in the host tier (fsdp_cpu_offload) or NVMe files: the device-resident FULL_SHARD
    # grid's (pf-4's) losses and final bytes, no NVMe file left
    mkdir -p "$T/pfo-nv"
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5M[@]}" --devices 4 --pipeline_parallel 2 --strategy fsdp_cpu_offload \
        --out_dir "$T/pfo-c" >"$T/out" 2>&1; ro=$?
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5M[@]}" --devices 4 --pipeline_parallel 2 \
        --strategy deepspeed_stage_3_offload_nvme --nvme_path "$T/pfo-nv" --out_dir "$T/pfo-n" >>"$T/out" 2>&1 || ro=$?
    same=1
    for d in pfo-c pfo-n; do
        cmp -s "$T/$d/final/model.safetensors" "$T/pf-4/final/model.safetensors" \
            && cmp -s <(cut -d, -f1-4 "$T/$d/logs/metrics.csv") <(cut -d, -f1-4 "$T/pf-4/logs/metrics.csv") || same=0
    done
    if [ $ro -eq 0 ] && [ $same = 1 ] && [ -d "$T/pfo-nv" ] && [ -z "$(ls -A "$T/pfo-nv")" ] \
        && grep -q "host tier (offload) PARAMS" "$T/out"; then
        ok "t5_pp_param_offload_full_shard_bytes (fsdp_cpu_offload and NVMe: FULL_SHARD's losses and final bytes, no file left)"
    else bad "t5_pp_param_offload_full_shard_bytes" "exit $ro"; fi
    # LoRA and QLoRA (bnb.nf4) under the interleaved schedule (PP 2 x 2 chunks: each chunk's adapters keyed by the whole
    # model's module index of its first block, the base frozen): one process's losses, final/ and adapter bytes; the
    # step-3 checkpoint resumed in one process ends on one process resumed's adapter bytes; DP 2 x PP 2 x 2 chunks under
    # fsdp (the adapters train as ZeRO-2) DDP's losses and adapter bytes
    IL=(--pipeline_schedule interleaved)
    timeout 300 mpirun -np 2 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" "${PPA[@]}" "${IL[@]}" --out_dir "$T/li-2" >"$T/out-li" 2>&1; rl=$?
    timeout 300 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" --resume "$T/li-2/step-000003" --out_dir "$T/li-r1" >>"$T/out" 2>&1 || rl=$?
    timeout 300 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" --quantize bnb.nf4 --out_dir "$T/lq-1" >>"$T/out" 2>&1 || rl=$?
    timeout 300 mpirun -np 2 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" --quantize bnb.nf4 "${PPA[@]}" "${IL[@]}" --out_dir "$T/lq-2" \
        >>"$T/out" 2>&1 || rl=$?
    timeout 300 mpirun -np 2 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" --devices 2 --out_dir "$T/ld-2" >>"$T/out" 2>&1 || rl=$?
    timeout 300 mpirun -np 4 "$FL" finetune_lora "${T5M[@]}" "${LA[@]}" --devices 4 --pipeline_parallel 2 "${IL[@]}" --strategy fsdp \
        --out_dir "$T/li-4" >>"$T/out" 2>&1 || rl=$?
    isame=1
    for p in "pl-1 li-2" "lq-1 lq-2" "ld-2 li-4"; do
        set -- $p
        [ "$(losses "$T/$1" | md5sum)" = "$(losses "$T/$2" | md5sum)" ] && [ "$(losses "$T/$2" | grep -c .)" = 24 ] || isame=0
        for f in final/model.safetensors final/adapter/adapter_model.safetensors; do cmp -s "$T/$1/$f" "$T/$2/$f" || isame=0; done
    done
    cmp -s "$T/pl-r0/final/adapter/adapter_model.safetensors" "$T/li-r1/final/adapter/adapter_model.safetensors" || isame=0
    # plan = measured: rank 0's peaks per tag and total, and the ranks' totals
    lp=$("$FL" plan "${T5M[@]}" --lora "${LA[@]}" "${PPA[@]}" "${IL[@]}" "${PPL[@]}" --rank 0 | awk '/^peak +reserved/ { for (i = 3; i <= 18; i += 2) printf "%s %s,", $i, $(i + 1) }')
    lm=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER|total) / { printf "%s %s,", $4, $5 }' "$T/out-li" | head -c 400)
    l1=$("$FL" plan "${T5M[@]}" --lora "${LA[@]}" "${PPA[@]}" "${IL[@]}" "${PPL[@]}" --rank 1 | awk '/^peak +reserved/ { print $17, $18 }')
    grep -q "^| peak total, ranks min - max *$l1 - " "$T/out-li" && [ -n "$lp" ] && [ "$lp" = "${lm:0:${#lp}}" ] || { isame=0; echo "     planned $lp / $l1, measured $lm"; }
    if [ $rl -eq 0 ] && [ $isame = 1 ] && grep -q "schedule interleaved" "$T/out-li"; then
        ok "t5_pp_lora_qlora_interleaved (PP 2 x 2 chunks LoRA and QLoRA, DP 2 x PP 2 x 2 fsdp, resumed: bit for bit; peaks = plan)"
    else bad "t5_pp_lora_qlora_interleaved" "exit $rl, same $isame"; fi
    # sequence parallelism on the stages (TP 2 x PP 2, the 4-head config): the streams cross as the rank's rows, the
    # encoder output whole, d(encoder output) as each rank's partial sum, reduce-scattered where the encoder's norm runs
    # (TP 2 x PP 3: on stage 0, which holds the encoder alone, from the later stages' sums): one process's losses within
    # 1e-6, the step-3 checkpoint resumed in one process, rank 0's peaks per tag and the ranks' totals = the plan's
    SQ=(--devices 4 --tensor_parallel 2 --pipeline_parallel 2 --sequence_parallel true)
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5Q[@]}" "${SQ[@]}" --out_dir "$T/sq-4" >"$T/out-sq" 2>&1; rs=$?
    timeout 300 "$FL" finetune_full "${T5Q[@]}" --resume "$T/sq-4/step-000003" --out_dir "$T/sq-r1" >"$T/out" 2>&1 || rs=$?
    timeout 300 mpirun -np 6 "$FL" finetune_full "${T5Q[@]}" --devices 6 --tensor_parallel 2 --pipeline_parallel 3 \
        --sequence_parallel true --out_dir "$T/sq-6" >>"$T/out" 2>&1 || rs=$?
    s1=$(within "$T/tq-1" "$T/sq-4" 24); s2=$(within "$T/tq-r0" "$T/sq-r1" 12); s3=$(within "$T/tq-1" "$T/sq-6" 24)
    sp=$("$FL" plan "${T5Q[@]}" "${SQ[@]}" "${PPL[@]}" --rank 0 | awk '/^peak +reserved/ { for (i = 3; i <= 16; i += 2) printf "%s %s,", $i, $(i + 1) }')
    sm=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER) / { printf "%s %s,", $4, $5 }' "$T/out-sq" | head -c 400)
    bytes() { awk '{ f = $2 == "GiB" ? 2^30 : $2 == "MiB" ? 2^20 : $2 == "KiB" ? 1024 : 1; printf "%.0f\n", $1 * f }'; }
    sr=$(for r in 0 1 2 3; do "$FL" plan "${T5Q[@]}" "${SQ[@]}" "${PPL[@]}" --rank $r | awk '/^peak +reserved/ { printf "%s %s\n", $17, $18 }'; done | bytes | sort -g | sed -n '1p;$p' | paste -sd' ')
    sg=$(awk '/^\| peak total, ranks min - max/ { print $8, $9; print $11, $12 }' "$T/out-sq" | bytes | paste -sd' ')
    [ -n "$sp" ] && [ "$sp" = "${sm:0:${#sp}}" ] && [ "$sr" = "$sg" ] || { rs=1; echo "     planned $sp / $sr, measured $sm / $sg"; }
    if [ $rs -eq 0 ] && small "$s1" && small "$s2" && small "$s3" && grep -q "^sequence parallel: " "$T/out-sq"; then
        ok "t5_pp_np4_tp2_pp2_sequence_parallel (vs one process $s1, resumed in one process $s2, TP 2 x PP 3 $s3; peaks = plan)"
    else cp "$T/out-sq" "$T/out"; bad "t5_pp_np4_tp2_pp2_sequence_parallel" "exit $rs, worst $s1 / $s2 / $s3"; fi
    # tensor parallelism inside the interleaved schedule (TP 2 x PP 2 x 2 chunks, the 4-head config: each
    # chunk its TP slice of its virtual stage, d(encoder output) back through every chunk, one clipping norm): one
    # process's losses within 1e-6, its step-3 checkpoint resumed in one process, TP 2 x PP 2 1F1B's step-3 checkpoint
    # resumed interleaved (against it resumed in one process, tq-r1), rank 0's peaks per tag = the plan's
    # (tests/test_tp_t5_train.c tpi_t5_train_*: gradients, SP, LoRA, 16-mixed, DP 2 x TP 2 x PP 2, opaque, cuda-emu)
    TI=("${TQ[@]}" --pipeline_schedule interleaved)
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5Q[@]}" "${TI[@]}" --out_dir "$T/ti-4" >"$T/out-ti" 2>&1; rt=$?
    timeout 300 "$FL" finetune_full "${T5Q[@]}" --resume "$T/ti-4/step-000003" --out_dir "$T/ti-r1" >"$T/out" 2>&1 || rt=$?
    timeout 300 mpirun -np 4 "$FL" finetune_full "${T5Q[@]}" "${TI[@]}" --resume "$T/tq-4/step-000003" --out_dir "$T/ti-r4" \
        >>"$T/out" 2>&1 || rt=$?
    t1=$(within "$T/tq-1" "$T/ti-4" 24); t2=$(within "$T/tq-r0" "$T/ti-r1" 12); t3=$(within "$T/tq-r1" "$T/ti-r4" 12)
    tp=$("$FL" plan "${T5Q[@]}" "${TI[@]}" "${PPL[@]}" --rank 0 | awk '/^peak +reserved/ { for (i = 3; i <= 16; i += 2) printf "%s %s,", $i, $(i + 1) }')
    tm=$(awk '/^\| peak (PARAMS|GRADS|OPTIM|ACTS|WORKSPACE|OTHER|GATHER) / { printf "%s %s,", $4, $5 }' "$T/out-ti" | head -c 400)
    [ -n "$tp" ] && [ "$tp" = "${tm:0:${#tp}}" ] || { rt=1; echo "     TP x PP interleaved rank 0: planned $tp measured $tm"; }
    if [ $rt -eq 0 ] && small "$t1" && small "$t2" && small "$t3" \
        && grep -q "virtual stages' blocks: \[0, 2) \[2, 3) \[3, 4) \[4, 5)" "$T/out-ti"; then
        ok "t5_ppi_np4_tp2_pp2 (vs one process $t1, resumed in one process $t2, 1F1B's resumed interleaved $t3; peaks = plan)"
    else cp "$T/out-ti" "$T/out"; bad "t5_ppi_np4_tp2_pp2" "exit $rt, worst $t1 / $t2 / $t3"; fi
fi

echo "T5 MPI tests: $pass passed, $fail failed"
[ $fail -eq 0 ]
