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
#   - the DDP checkpoint resumes in one process; FULL_SHARD (auto's choice) refused naming the strategies that work.
# Usage: tests/mpi_t5_test.sh [build-dir]; skips (exit 0) without MPI or mpirun.
set -u
BUILD=${1:-build}
FL=$BUILD/fitllm
if [ ! -x "$BUILD/fitllm_comm_mpi_test" ] || ! command -v mpirun >/dev/null 2>&1; then
    echo "skip T5 MPI tests: no MPI build or no mpirun"
    exit 0
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1
pass=0; fail=0
T=$(mktemp -d /tmp/fitllm-mpi-t5-XXXXXX)
trap 'rm -rf "$T"' EXIT
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
timeout 120 mpirun -np 2 "$FL" finetune_full "${T5M[@]}" --devices 2 --out_dir "$T/t5-fsdp" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && grep -q "an encoder-decoder (t5) trains with ddp, deepspeed_stage_1, deepspeed_stage_2 or deepspeed_stage_2_offload only" "$T/out"; then
    ok "t5_fsdp_refused"
else
    bad "t5_fsdp_refused" "exit $rc"
fi

echo "T5 MPI tests: $pass passed, $fail failed"
[ $fail -eq 0 ]
