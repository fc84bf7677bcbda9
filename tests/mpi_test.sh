#!/usr/bin/env bash
# The MPI implementation of fl_comm and DDP / ZeRO training under mpirun (run by `make test` and ctest):
#   - tensor parallelism at 2 and 4 ranks (tests/mpi/tp_mpi_test.c) against one process, PyTorch and float64;
#     through the CLI (--tensor_parallel): TP 2, TP 4, DP 2 x TP 2 (DDP, ZeRO-2), TP 2 x PP 2 and LoRA at TP 2 against one process's losses, the
#     consolidated checkpoint resumed at TP 1 and 4, a killed rank ending the grid;
#   - DDP training at 2 and 4 ranks, ZeRO-1/2 at 2, 3 and 4 (16-true at 2) and FULL_SHARD (AdamW, 8-bit AdamW) at 2,
#     ZeRO-3 with the optimizer offloaded (cpu, nvme) at 3 = the device-resident ZeRO-3 checkpoints
#     against one process
#     (tests/mpi/ddp_mpi_test.c), the CLI under mpirun (rank 0 reports and writes; its checkpoint
#     resumes in one process; ZeRO's checkpoints equal DDP's; --devices mismatch), and started
#     without a launcher (it runs mpirun itself: the same bits, root and oversubscription handled);
#     a sharded checkpoint saved at 3 ranks resumes at 2 and merge_shards consolidates it (also FULL_SHARD's);
#     HYBRID_SHARD with 2 ranks as 2 nodes (= DDP's checkpoints), 4 as 2 x 2 and 4 x 1 (ddp_mpi_test.c: every
#     peak = the plan, MPI = threads) and pretrain's auto across nodes;
#   - every collective/dtype/op/count at 2 and 4 ranks, checked against the specification, float64,
#     a second run and the threads implementation's bits (tests/mpi/comm_mpi_test.c);
#   - faults: one rank calls fl_comm_abort, or exits non-zero without a word, while the others wait:
#     every rank must end, the job non-zero, within seconds, the output naming the rank; a training
#     rank killed: the same, and rank 0 names the last committed checkpoint; a training rank stopped
#     (kill -STOP): the job ends after FITLLM_COMM_TIMEOUT, naming the wait, the step and the checkpoint; ranks with different
#     configurations, model files, fitllm builds or data refuse at start-up naming the difference;
#   - torchrun-style variables without mpirun, srun without an MPI plugin, another MPI's launcher:
#     refused, naming what to run instead;
#   - two nodes: one rank in each of two network namespaces over TCP (tests/netns_test.sh);
#   - BLIP-2 fine-tuning under DDP (tests/mpi_blip2_test.sh); sequence parallelism (tests/mpi_sp_test.sh).
# Skips (exit 0, with the reason) when the build has no MPI or mpirun is missing.
# Usage: tests/mpi_test.sh [build-dir]
set -u
BUILD=${1:-build}
BIN=$BUILD/fitllm_comm_mpi_test
if [ ! -x "$BIN" ]; then
    echo "skip MPI tests: $BUILD has no MPI (fitllm_comm_mpi_test not built; apt-get install openmpi-bin libopenmpi-dev, then configure again)"
    echo "MPI tests: 0 passed, 0 failed, 1 skipped"
    exit 0
fi
if ! command -v mpirun >/dev/null 2>&1; then
    echo "skip MPI tests: mpirun not found (apt-get install openmpi-bin)"
    echo "MPI tests: 0 passed, 0 failed, 1 skipped"
    exit 0
fi
# root, oversubscription, one OpenMP thread per rank, Open MPI's start-up trimmed to shared memory
source "$(dirname "$0")/mpi_env.sh"
pass=0; fail=0; skip=0
T=$(mktemp -d "${TMPDIR:-/tmp}"/fitllm-mpi-XXXXXX)
source "$(dirname "$0")/suite_lib.sh"   # per-case wall times ("ok NAME ... T ms"), the tier (full_tier, tier_skip)
trap 'rm -rf "$T"; fl_case_laps_end' EXIT

ok()  { echo "ok   $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1: $2"; sed 's/^/     /' "$T/out" | tail -15; fail=$((fail+1)); }
now() { date +%s.%N; }
# signal_rank JOB PID SIG: send SIG to the rank PID of JOB, wait up to 60 s for JOB to end (still running: end it and
# its mpirun, so that the time check fails and nothing is left behind); sets rc (JOB's status) and secs (signal to end)
signal_rank() {
    local t0 mp
    mp=$(awk '/^PPid:/ { print $2 }' "/proc/$2/status" 2>/dev/null)
    t0=$(now); kill -"$3" "$2"
    for _ in $(seq 600); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$1" 2>/dev/null && { kill -CONT "$2" 2>/dev/null; kill "$mp" 2>/dev/null; sleep 2; kill -9 "$1" 2>/dev/null; }
    wait "$1"; rc=$?
    secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
}
# rank_pid JOB R: the pid of world rank R of the job started in the background as JOB (timeout -> mpirun -> rank, or
# fitllm -> mpirun -> rank: a child or grandchild of JOB)
rank_pid() {
    local st p pp gp
    for st in /proc/[0-9]*/status; do
        p=${st#/proc/}; p=${p%/status}
        pp=$(awk '/^PPid:/ { print $2 }' "$st" 2>/dev/null); gp=""
        [ -n "$pp" ] && gp=$(awk '/^PPid:/ { print $2 }' "/proc/$pp/status" 2>/dev/null)
        [ "$pp" = "$1" ] || [ "$gp" = "$1" ] || continue
        tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && echo "$p"
    done
}
# run_case NAME SECS CMD...: runs CMD under `timeout SECS` (SIGKILL 15 s after that) with its output in $T/out; sets
# rc to CMD's own exit status, captured at once (`cmd || { x=0; bad ... "exit $?"; }` read the assignment's 0). On
# failure reports NAME as FAIL, naming a time-out as one (124/137: still running at SECS), and returns 1.
run_case() {
    local name=$1 secs=$2 t0 took
    shift 2
    t0=$(now)
    timeout -k 15 "$secs" "$@" >"$T/out" 2>&1
    rc=$?
    [ $rc -eq 0 ] && return 0
    took=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }')
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        bad "$name" "timed out: still running at the ${secs} s limit (exit $rc after $took s; a loaded disk or machine?)"
    else
        bad "$name" "exit $rc after $took s"
    fi
    return 1
}

for np in 2 4; do
    timeout 600 mpirun -np $np "$BIN" >"$T/out" 2>&1; rc=$?
    if [ $rc -eq 0 ] && grep -q "comm mpi test: $np ranks .* 0 failures" "$T/out"; then
        ok "mpi_collectives_np$np ($(grep -o '[0-9]* checks' "$T/out"))"
    else
        bad "mpi_collectives_np$np" "exit $rc"
    fi
done

# DDP and ZeRO-1/2 training (tests/mpi/ddp_mpi_test.c): each scenario vs one process and vs the
# threads twin; ZeRO also vs DDP (same bits) and each rank's memory vs the plan; 3 ranks: ZeRO only
# (an odd split of the parameters)
DDP=$BUILD/fitllm_ddp_mpi_test
for np in 2 3 4; do
    mkdir -p "$T/ddp$np"
    timeout 600 mpirun -np $np "$DDP" "$T/ddp$np" >"$T/out" 2>&1; rc=$?
    if [ $rc -eq 0 ] && grep -q "ddp mpi test: $np ranks, .* 0 failures" "$T/out"; then
        ok "ddp_training_np$np ($(grep -o '[0-9]* checks' "$T/out"))"
        grep "vs one process" "$T/out" | sed 's/^ */     /'
    else
        bad "ddp_training_np$np" "exit $rc"
    fi
done

# tensor parallelism (tests/mpi/tp_mpi_test.c): the golden LLaMA (2 ranks), GPT-2 and OPT (2 and 4) sliced over
# MPI ranks vs one process, PyTorch and float64 (tests/tp_ref.h), and the same group as threads (the same bits)
TPB=$BUILD/fitllm_tp_mpi_test
for np in 2 4; do
    timeout 600 mpirun -np $np "$TPB" >"$T/out" 2>&1; rc=$?
    if [ $rc -eq 0 ] && grep -q "tp mpi test: $np ranks, .* 0 failures" "$T/out"; then
        ok "tp_training_np$np ($(grep -o '[0-9]* checks' "$T/out"))"
        grep "TP $np: losses within" "$T/out" | sed 's/^ */     /'
    else
        bad "tp_training_np$np" "exit $rc"
    fi
done

# the CLI under mpirun: rank 0 alone reports and writes; its checkpoint resumes in one process
FL=$BUILD/fitllm
# (--strategy ddp: these are DDP's cases; auto is FULL_SHARD for finetune_full; a later --strategy overrides it)
ARGS=(micro --data.n_train 51 --data.n_val 7 --train.micro_batch_size 2 --train.global_batch_size 8
      --train.max_steps 4 --train.save_interval 2 --train.max_seq_length 48 --eval.max_new_tokens 0 --threads 1 --strategy ddp)
timeout 300 mpirun -np 2 "$FL" finetune_full "${ARGS[@]}" --devices 2 --out_dir "$T/cli" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && [ "$(grep -c "Saved the final model" "$T/out")" = 1 ] && grep -q "x 2 ranks = global batch 8" "$T/out" \
    && grep -q "data parallel (DDP" "$T/out" && [ -f "$T/cli/final/model.safetensors" ] && [ -f "$T/cli/logs/metrics.csv" ]; then
    ok "ddp_cli_np2 (one report, final/ and logs from rank 0)"
else
    bad "ddp_cli_np2" "exit $rc"
fi
# the bytes each step sent (metrics.csv comm_sent, counted by fl_comm): DDP's all-reduce at 2 ranks sends
# 2 (N-1)/N psi = psi, the fp32 gradients (4 bytes x the parameters the run reports), plus the step's loss
# statistics (a few doubles)
nparam=$(sed -n 's/^model: .*, \([0-9]*\) parameters.*/\1/p' "$T/out" | head -1)
col=$(head -1 "$T/cli/logs/metrics.csv" | tr ',' '\n' | grep -n '^comm_sent$' | cut -d: -f1)
sent=$(awk -F, -v c="${col:-0}" 'NR > 1 && $c != "" { print $c }' "$T/cli/logs/metrics.csv" | sort -u)
if [ -n "$nparam" ] && [ -n "$col" ] && [ "$(wc -l <<<"$sent")" = 1 ] && [ -n "$sent" ] \
    && [ "$sent" -ge $((4 * nparam)) ] && [ "$sent" -le $((4 * nparam + 1024)) ]; then
    ok "ddp_cli_bytes_sent_per_step ($sent bytes per step, psi = $((4 * nparam)))"
else
    bad "ddp_cli_bytes_sent_per_step" "parameters '$nparam', comm_sent '$sent'"
fi
# metrics.csv at 2 ranks (README "Logs and metrics", LitGPT's meanings): total_tokens counts both ranks' micro-batches,
# tokens is a rank's share (half); iter counts every rank's micro-batch (4 a step here: 2 ranks x accumulation 2), step
# the steps done after it (0 at iter 1); the validation rows too
if awk -F, 'NR > 1 { if ($7 == "" || $7 != 2 * $6) bad = 1; if ($4 != "") { n++; if (n == 1 && !($1 == 1 && $2 == 0)) bad = 1
    if ($2 != int($1 / 4)) bad = 1 } } END { exit bad || n != 16 }' "$T/cli/logs/metrics.csv"; then
    ok "ddp_cli_metrics_tokens_per_rank"
else
    sed 's/^/     /' "$T/cli/logs/metrics.csv" | cut -d, -f1-7 | head -8
    bad "ddp_cli_metrics_tokens_per_rank" "metrics.csv's iter, step, tokens, total_tokens"
fi
# each row's iter_time is the micro-batch's time on the rank that ran it (iteration i: rank (i - 1) % 2), gathered
# with the losses; rank 1's rows repeated rank 0's time of the same round
if awk -F, 'NR > 1 && $4 != "" { if ($1 % 2 == 1) t0 = $5; else if ($5 != t0) d++; n++ } END { exit !(n == 16 && d > 0) }' \
    "$T/cli/logs/metrics.csv"; then
    ok "ddp_cli_metrics_iter_time_per_rank"
else
    bad "ddp_cli_metrics_iter_time_per_rank" "rank 1's rows repeat rank 0's iter_time"
fi
timeout 300 "$FL" finetune_full "${ARGS[@]}" --resume "$T/cli/step-000002" --out_dir "$T/cli1" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000002 (step 2, iter 8)" "$T/out"; then
    ok "ddp_checkpoint_resumes_in_one_process"
else
    bad "ddp_checkpoint_resumes_in_one_process" "exit $rc"
fi
# no launcher: the same command line starts its 2 ranks itself through mpirun (as root without Open
# MPI's root variables, which this script exports for its own mpirun calls) and trains what the explicit
# mpirun run trained: the same checkpoints, bit for bit (weights; AdamW's m and v, 2 x 260032 fp32 at
# the end of training_state.safetensors, whose header holds the wall time), and the same logged losses
SELF_ENV=(env -u OMPI_ALLOW_RUN_AS_ROOT -u OMPI_ALLOW_RUN_AS_ROOT_CONFIRM -u OMPI_MCA_rmaps_base_oversubscribe
          -u OMP_NUM_THREADS -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u FITLLM_LAUNCHED)
timeout 300 "${SELF_ENV[@]}" "$FL" finetune_full "${ARGS[@]}" --devices 2 --out_dir "$T/self" >"$T/out" 2>&1; rc=$?
want_root=""; [ "$(id -u)" = 0 ] && want_root=" --allow-run-as-root"
if [ $rc -eq 0 ] && [ "$(grep -c "^fitllm: starting 2 ranks: [^ ]*mpirun -np 2$want_root .*--bind-to none .*fitllm finetune_full micro " "$T/out")" = 1 ] \
    && [ "$(grep -c "Saved the final model" "$T/out")" = 1 ] \
    && cmp -s "$T/cli/final/model.safetensors" "$T/self/final/model.safetensors" \
    && cmp -s "$T/cli/step-000002/model.safetensors" "$T/self/step-000002/model.safetensors" \
    && cmp -s <(tail -c 2080256 "$T/cli/step-000002/training_state.safetensors") \
              <(tail -c 2080256 "$T/self/step-000002/training_state.safetensors") \
    && [ -s "$T/self/logs/metrics.csv" ] \
    && cmp -s <(cut -d, -f1-4,8,9 "$T/cli/logs/metrics.csv") <(cut -d, -f1-4,8,9 "$T/self/logs/metrics.csv"); then
    ok "ddp_cli_self_launch_np2 (= the explicit mpirun run: checkpoints and losses)"
else
    bad "ddp_cli_self_launch_np2" "exit $rc"
fi
timeout 120 mpirun -np 2 "$FL" finetune_full "${ARGS[@]}" --devices 3 --train.global_batch_size 12 --out_dir "$T/cli3" >"$T/out" 2>&1; rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c "devices 3 x --num_nodes 1 = 3 ranks, but Open MPI (mpirun) started 2" "$T/out")" = 1 ]; then
    ok "ddp_devices_mismatch (exit $rc, one message)"
else
    bad "ddp_devices_mismatch" "exit $rc"
fi
# the same mismatch with a global batch 3 does not divide: the launcher's count is said, not the batch (review round 6:
# "train.global_batch_size 8 is not divisible by devices x micro_batch_size = 3 x 1" sent the user to the batch)
timeout 120 mpirun -np 2 "$FL" finetune_full "${ARGS[@]}" --devices 3 --train.global_batch_size 8 --out_dir "$T/cli3b" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c "but Open MPI (mpirun) started 2: give --devices 2" "$T/out")" = 1 ] && ! grep -q "not divisible" "$T/out"; then
    ok "ddp_devices_mismatch_before_the_batch (exit $rc, one message)"
else
    bad "ddp_devices_mismatch_before_the_batch" "exit $rc: $(grep -m1 error "$T/out")"
fi
# a usage error and --help under mpirun: said once (rank 0), not once per rank
timeout 120 mpirun -np 2 "$FL" finetune_full "${ARGS[@]}" --devices 2 --bogus 1 --out_dir "$T/cli3c" >"$T/out" 2>&1; rc=$?
timeout 120 mpirun -np 2 "$FL" finetune_full --help >"$T/out2" 2>&1; rc2=$?
if [ $rc -eq 2 ] && [ "$(grep -c "unknown option" "$T/out")" = 1 ] && [ $rc2 -eq 0 ] && [ "$(grep -c "^usage: fitllm finetune_full" "$T/out2")" = 1 ]; then
    ok "usage_error_and_help_once_under_mpirun"
else
    bad "usage_error_and_help_once_under_mpirun" "exit $rc / $rc2: $(grep -c "unknown option" "$T/out") messages, $(grep -c "^usage: fitllm finetune_full" "$T/out2") usages"
fi

# ZeRO through the CLI at 3 ranks (SGD with momentum, so there is a sharded state to save): rank 0
# gathers the state chunks, so ZeRO-1's and ZeRO-2's checkpoints hold the bits of DDP's (weights and
# the momentum buffer: 260032 fp32 values, the data section at the end of training_state.safetensors);
# one process resumes them
ZARGS=(micro --data.n_train 51 --data.n_val 7 --train.micro_batch_size 2 --train.global_batch_size 6 --train.max_steps 4
       --train.save_interval 2 --train.max_seq_length 48 --eval.max_new_tokens 0 --threads 1 --devices 3
       --optimizer.class_path SGD --optimizer.momentum 0.9 --optimizer.lr 0.05)
zok=1
# (DDP's 3 ranks start themselves: more ranks than cores here, so also Open MPI's oversubscription)
run_case "zero_cli_np3_ddp" 300 "${SELF_ENV[@]}" "$FL" finetune_full "${ZARGS[@]}" --strategy ddp --out_dir "$T/z-ddp" || zok=0
want_over=""; [ "$(nproc)" -lt 3 ] && want_over=" .*--oversubscribe"
grep -q -- "^fitllm: starting 3 ranks: [^ ]*mpirun -np 3$want_over" "$T/out" || { zok=0; bad "zero_cli_np3_ddp" "no self-launch line"; }
# (deepspeed_stage_2_offload: the momentum in the host tier, streamed from there into the checkpoint; first, so the
# report checked below is ZeRO-2's)
for st in deepspeed_stage_2_offload deepspeed_stage_1 deepspeed_stage_2; do
    run_case "zero_cli_np3_$st" 300 mpirun -np 3 "$FL" finetune_full "${ZARGS[@]}" --strategy $st --out_dir "$T/z-$st" || zok=0
done
if [ $zok = 1 ]; then
    zsame=1
    for st in deepspeed_stage_1 deepspeed_stage_2 deepspeed_stage_2_offload; do
        for ck in step-000002 final; do
            cmp -s "$T/z-ddp/$ck/model.safetensors" "$T/z-$st/$ck/model.safetensors" || zsame=0
            cmp -s <(tail -c 1040128 "$T/z-ddp/$ck/training_state.safetensors") \
                   <(tail -c 1040128 "$T/z-$st/$ck/training_state.safetensors") || zsame=0
        done
    done
    if [ $zsame = 1 ] && grep -q "data parallel (ZeRO-2, strategy deepspeed_stage_2): 3 ranks" "$T/out" \
        && grep -q "memory of rank 0 (ZeRO-2: OPTIM holds its chunk's state, 86678 of 260032 elements" "$T/out"; then
        ok "zero_cli_np3 (ZeRO-1/2 and ZeRO-2 offload checkpoints = DDP's, bit for bit)"
    else
        bad "zero_cli_np3" "checkpoints differ from DDP's ($zsame) or the report lacks ZeRO-2's lines"
    fi
    timeout 300 "$FL" finetune_full "${ZARGS[@]}" --devices 1 --resume "$T/z-deepspeed_stage_2/step-000002" --out_dir "$T/z1" >"$T/out" 2>&1; rc=$?
    if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000002 (step 2, iter 6)" "$T/out"; then
        ok "zero_checkpoint_resumes_in_one_process"
    else
        bad "zero_checkpoint_resumes_in_one_process" "exit $rc"
    fi
fi

# ZeRO-3 with the optimizer offloaded (deepspeed_stage_3_offload: each rank's momentum shard in the host tier; nvme:
# in files) at 3 MPI ranks: the checkpoints (step 2 and final) of the device-resident ZeRO-3 run byte for byte, the
# host tier in rank 0's report; its step-2 checkpoint resumed by deepspeed_stage_3 (no offload) ends on the same bytes
# the weights and the momentum (the data section's tail) of two runs' step-2 and final checkpoints, byte for byte
same_ckpts() {
    local ck
    for ck in step-000002 final; do
        cmp -s "$1/$ck/model.safetensors" "$2/$ck/model.safetensors" || return 1
        cmp -s <(tail -c 1040128 "$1/$ck/training_state.safetensors") <(tail -c 1040128 "$2/$ck/training_state.safetensors") || return 1
    done
}
z3ok=1
mkdir -p "$T/nv3"
for st in deepspeed_stage_3 deepspeed_stage_3_offload nvme; do
    if [ $st = nvme ]; then extra=(--strategy deepspeed_stage_3_offload --offload_optimizer_device nvme --nvme_path "$T/nv3")
    else extra=(--strategy $st); fi
    run_case "zero3_offload_cli_np3_$st" 300 mpirun -np 3 "$FL" finetune_full "${ZARGS[@]}" "${extra[@]}" --out_dir "$T/z3-$st" || z3ok=0
    [ $st = deepspeed_stage_3_offload ] && { grep -q "host tier (CPU offload: the optimizer state" "$T/out" || { z3ok=0; bad "zero3_offload_cli_np3" "no host tier in the report"; }; }
done
[ -z "$(ls -A "$T/nv3")" ] || { z3ok=0; bad "zero3_offload_nvme_leaves_no_files" "$(ls -A "$T/nv3")"; }
if [ $z3ok = 1 ]; then
    timeout 300 mpirun -np 3 "$FL" finetune_full "${ZARGS[@]}" --strategy deepspeed_stage_3 \
        --resume "$T/z3-deepspeed_stage_3_offload/step-000002" --out_dir "$T/z3-res" >"$T/out" 2>&1 || z3ok=0
    for st in deepspeed_stage_3_offload nvme; do same_ckpts "$T/z3-deepspeed_stage_3" "$T/z3-$st" || z3ok=0; done
    cmp -s "$T/z3-deepspeed_stage_3/final/model.safetensors" "$T/z3-res/final/model.safetensors" || z3ok=0
    if [ $z3ok = 1 ]; then
        ok "zero3_offload_cli_np3 (cpu and nvme checkpoints = ZeRO-3's, bit for bit; resumed without offload: the same)"
    else
        bad "zero3_offload_cli_np3" "checkpoints differ from the device-resident ZeRO-3 run's, or the resume failed"
    fi
fi

# Parameter offload (fsdp_cpu_offload: the parameter and gradient shards in the host tier; deepspeed_stage_3_offload_nvme:
# in files) at 1, 2 and 3 MPI ranks: the checkpoints (step 2 and final) of the device-resident ZeRO-3 run at the same
# size byte for byte (one rank: the one-process run's); the tier in rank 0's report; no file left
pok=1
mkdir -p "$T/pnv"
for np in 1 2 3; do
    for st in deepspeed_stage_3 fsdp_cpu_offload deepspeed_stage_3_offload_nvme; do
        extra=(--strategy $st); [ $st = deepspeed_stage_3_offload_nvme ] && extra+=(--nvme_path "$T/pnv")
        # (about 5 s alone; the NVMe runs msync each piece they drop, so another job's disk traffic stretches them:
        # a generous limit, and a time-out reported as one)
        run_case "param_offload_cli_np${np}_$st" 600 mpirun -np $np "$FL" finetune_full "${ZARGS[@]}" --devices $np \
            --train.global_batch_size 12 "${extra[@]}" --out_dir "$T/p$np-$st" || { pok=0; continue; }
        [ $st = fsdp_cpu_offload ] && { grep -q "host tier (offload) PARAMS" "$T/out" || { pok=0; bad "param_offload_cli_np$np" "no host-tier PARAMS in the report"; }; }
    done
    base="$T/p$np-deepspeed_stage_3"
    for st in fsdp_cpu_offload deepspeed_stage_3_offload_nvme; do same_ckpts "$base" "$T/p$np-$st" || pok=0; done
done
[ -z "$(ls -A "$T/pnv")" ] || { pok=0; bad "param_offload_nvme_leaves_no_files" "$(ls -A "$T/pnv")"; }
if [ $pok = 1 ]; then
    ok "param_offload_cli_np123 (host and nvme parameter offload checkpoints = the device-resident ZeRO-3's, bit for bit)"
else
    bad "param_offload_cli_np123" "checkpoints differ from the device-resident run's, or a run failed"
fi

# the eval sample under sharded parameters at 3 ranks (every rank decodes in step: each token's units are gathered
# from all of them; rank 0 prints): device-resident ZeRO-3 and NVMe parameter offload print, at both evaluations,
# DDP's text byte for byte (rank 0's dense generation; SGD without clipping at accumulation 1: the same final weights,
# checked), and leave no file
gok=1
mkdir -p "$T/gnv"
for st in ddp deepspeed_stage_3 deepspeed_stage_3_offload_nvme; do
    extra=(--strategy $st); [ $st = deepspeed_stage_3_offload_nvme ] && extra+=(--nvme_path "$T/gnv")
    run_case "sharded_eval_sample_np3_$st" 600 mpirun -np 3 "$FL" finetune_full "${ZARGS[@]}" --eval.interval 2 \
        --eval.max_new_tokens 8 "${extra[@]}" --out_dir "$T/g-$st" || { gok=0; continue; }
    grep -a -A1 "^Recommend a movie" "$T/out" >"$T/g-$st.txt"
done
if [ $gok = 1 ] && [ "$(grep -a -c "^Recommend a movie" "$T/g-ddp.txt")" = 2 ] \
    && [ "$(grep -a -v -c -e "^Recommend a movie" -e "^--$" -e "^$" "$T/g-ddp.txt")" = 2 ] \
    && cmp -s "$T/g-ddp/final/model.safetensors" "$T/g-deepspeed_stage_3_offload_nvme/final/model.safetensors" \
    && cmp -s "$T/g-ddp.txt" "$T/g-deepspeed_stage_3.txt" && cmp -s "$T/g-ddp.txt" "$T/g-deepspeed_stage_3_offload_nvme.txt" \
    && [ -z "$(ls -A "$T/gnv")" ]; then
    ok "sharded_eval_sample_np3 (ZeRO-3 and NVMe parameter offload: 2 samples = DDP's, byte for byte)"
elif [ $gok = 1 ]; then
    bad "sharded_eval_sample_np3" "samples or weights differ from DDP's, or missing: '$(cat -v "$T/g-ddp.txt")' vs $(:
        )'$(cat -v "$T/g-deepspeed_stage_3_offload_nvme.txt")', nvme files: $(ls -A "$T/gnv" | wc -l)"
fi
# the ranks must pick the same token at every step of a sharded sample: rank 1 sampling with another seed
# (FITLLM_TEST_SAMPLE_SEED_SKEW=1) ends the run, non-zero, with an error naming rank 1 and the step (not a hang in
# mismatched gathers, not rank 0's text printed as the model's)
timeout -k 15 300 mpirun -np 3 -x FITLLM_TEST_SAMPLE_SEED_SKEW=1 "$FL" finetune_full "${ZARGS[@]}" --eval.interval 2 \
    --eval.max_new_tokens 8 --strategy fsdp_cpu_offload --out_dir "$T/g-skew" >"$T/out" 2>&1; rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 137 ] \
    && grep -q "sharded generation (the evaluation sample after step 2): rank 1 picked token" "$T/out"; then
    ok "sharded_eval_sample_ranks_disagree_np3 (exit $rc, rank 1 and step 2 named)"
else
    bad "sharded_eval_sample_ranks_disagree_np3" "exit $rc"
fi

# sharded checkpoints (--fsdp.state_dict_type sharded) through the CLI: saved by ZeRO-2 at 3 ranks (each rank writes
# its ranges; no model.safetensors in a step checkpoint), resumed by ZeRO-1 at 2 ranks: the bits of the 2-rank resume
# of the FULL checkpoint of the same run (final weights and momentum); merge_shards (offline, no mpirun) writes the
# full checkpoint's model.safetensors byte for byte
SARGS=("${ZARGS[@]}" --train.global_batch_size 12 --devices 3 --strategy deepspeed_stage_2)
RARGS=("${ZARGS[@]}" --train.global_batch_size 12 --devices 2 --strategy deepspeed_stage_1)
sok=1
run_case "sharded_save_np3" 300 mpirun -np 3 "$FL" finetune_full "${SARGS[@]}" --fsdp.state_dict_type sharded --out_dir "$T/sh3" || sok=0
run_case "sharded_full_twin_np3" 300 mpirun -np 3 "$FL" finetune_full "${SARGS[@]}" --out_dir "$T/fu3" || sok=0
if [ $sok = 1 ]; then
    S2="$T/sh3/step-000002"
    if [ "$(ls "$S2"/shard-0000?-of-00003.safetensors | wc -l)" = 3 ] && [ ! -e "$S2/model.safetensors" ] && [ -f "$S2/COMMITTED" ]; then
        ok "sharded_save_np3 (3 shard files, one marker)"
    else
        bad "sharded_save_np3" "unexpected files: $(ls "$S2" | tr '\n' ' ')"
    fi
    timeout 300 mpirun -np 2 "$FL" finetune_full "${RARGS[@]}" --resume "$S2" --out_dir "$T/shr2" >"$T/out" 2>&1; rc=$?
    grep -q "Resuming training from .*step-000002 (step 2, iter 12)" "$T/out" || rc=99
    timeout 300 mpirun -np 2 "$FL" finetune_full "${RARGS[@]}" --resume "$T/fu3/step-000002" --out_dir "$T/fur2" >"$T/out" 2>&1 || rc=98
    if [ $rc -eq 0 ] && cmp -s "$T/shr2/final/model.safetensors" "$T/fur2/final/model.safetensors" \
        && cmp -s <(tail -c 1040128 "$T/shr2/final/training_state.safetensors") <(tail -c 1040128 "$T/fur2/final/training_state.safetensors"); then
        ok "sharded_saved_np3_resumed_np2 (= the full checkpoint's resume, bit for bit)"
    else
        bad "sharded_saved_np3_resumed_np2" "exit $rc or the final weights/momentum differ from the full checkpoint's resume"
    fi
    "$FL" merge_shards "$S2" --out "$T/shm" >"$T/out" 2>&1; rc=$?
    if [ $rc -eq 0 ] && cmp -s "$T/shm/model.safetensors" "$T/fu3/step-000002/model.safetensors"; then
        ok "merge_shards (= the full checkpoint's model.safetensors)"
    else
        bad "merge_shards" "exit $rc or its model.safetensors differs from the full checkpoint's"
    fi
fi
# FULL_SHARD through the CLI at 2 ranks: rank 0's consolidated checkpoint (units gathered one at a
# time) resumes in one process
timeout 300 mpirun -np 2 "$FL" finetune_full "${ARGS[@]}" --devices 2 --strategy fsdp --out_dir "$T/fsdp" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "data parallel (ZeRO-3 (FSDP FULL_SHARD), strategy fsdp): 2 ranks" "$T/out" \
    && grep -q "memory of rank 0 (ZeRO-3 (FSDP FULL_SHARD): PARAMS, GRADS and OPTIM hold its shard" "$T/out" \
    && [ -f "$T/fsdp/final/model.safetensors" ]; then
    ok "fsdp_cli_np2"
else
    bad "fsdp_cli_np2" "exit $rc"
fi
timeout 300 "$FL" finetune_full "${ARGS[@]}" --resume "$T/fsdp/step-000002" --out_dir "$T/fsdp1" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000002 (step 2, iter 8)" "$T/out"; then
    ok "fsdp_checkpoint_resumes_in_one_process"
else
    bad "fsdp_checkpoint_resumes_in_one_process" "exit $rc"
fi
# HYBRID_SHARD with the 2 ranks presented as 2 nodes of 1 (--devices 1 --num_nodes 2: the shard groups follow
# --devices, whatever the launcher's local ranks): each node's shard is the whole model and the gradients are
# all-reduced across the nodes in rank order, DDP's sum; at accumulation 1 without clipping the checkpoints hold
# DDP's bits (weights and the momentum buffer). The bare-instruction prompt makes the micro-batches differ (the
# Alpaca template's first 47 tokens are the same in every sample). Then pretrain's auto across the 2 nodes is HYBRID.
HARGS=(micro --data.n_train 51 --data.n_val 7 --data.prompt_style default --train.micro_batch_size 2
       --train.global_batch_size 4 --train.max_steps 3 --train.save_interval 2 --train.max_seq_length 20
       --eval.max_new_tokens 0 --threads 1 --devices 1 --num_nodes 2
       --optimizer.class_path SGD --optimizer.momentum 0.9 --optimizer.lr 0.05)
hok=1
run_case "hybrid_cli_np2_ddp" 300 mpirun -np 2 "$FL" finetune_full "${HARGS[@]}" --strategy ddp --out_dir "$T/hy-ddp" || hok=0
run_case "hybrid_cli_np2" 300 mpirun -np 2 "$FL" finetune_full "${HARGS[@]}" --strategy fsdp --fsdp.sharding_strategy HYBRID_SHARD \
    --out_dir "$T/hy" || hok=0
if [ $hok = 1 ]; then
    hsame=1
    for ck in step-000002 final; do
        cmp -s "$T/hy-ddp/$ck/model.safetensors" "$T/hy/$ck/model.safetensors" || hsame=0
        cmp -s <(tail -c 1040128 "$T/hy-ddp/$ck/training_state.safetensors") \
               <(tail -c 1040128 "$T/hy/$ck/training_state.safetensors") || hsame=0
    done
    if [ $hsame = 1 ] && grep -q "data parallel (FSDP HYBRID_SHARD, strategy fsdp): 2 ranks" "$T/out" \
        && grep -q "then an all-reduce of the piece across the nodes" "$T/out"; then
        ok "hybrid_cli_np2_as_2_nodes (checkpoints = DDP's, bit for bit)"
    else
        bad "hybrid_cli_np2_as_2_nodes" "checkpoints differ from DDP's ($hsame) or the report lacks HYBRID's lines"
    fi
fi
timeout 300 mpirun -np 2 "$FL" pretrain --model_name micro --data Synthetic --train.max_tokens 400 --train.micro_batch_size 2 \
    --train.global_batch_size 4 --train.max_seq_length 20 --eval.max_new_tokens 0 --threads 1 --devices 1 --num_nodes 2 \
    --out_dir "$T/hy-pt" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "data parallel (FSDP HYBRID_SHARD, strategy auto: fsdp HYBRID_SHARD, as LitGPT's pretrain" "$T/out"; then
    ok "hybrid_pretrain_auto_across_nodes"
else
    bad "hybrid_pretrain_auto_across_nodes" "exit $rc"
fi
# the same FULL_SHARD run with sharded checkpoints: each rank writes its pieces of every unit (a list of ranges per
# buffer); merge_shards and final/'s export = the consolidated run's model.safetensors, and one process resumes it
# to the bits of resuming the consolidated checkpoint
timeout 300 mpirun -np 2 "$FL" finetune_full "${ARGS[@]}" --devices 2 --strategy fsdp --fsdp.state_dict_type sharded \
    --out_dir "$T/fsdps" >"$T/out" 2>&1; rc=$?
"$FL" merge_shards "$T/fsdps/step-000002" --out "$T/fsdpm" >>"$T/out" 2>&1 || rc=97
timeout 300 "$FL" finetune_full "${ARGS[@]}" --resume "$T/fsdps/step-000002" --out_dir "$T/fsdps1" >>"$T/out" 2>&1 || rc=96
if [ $rc -eq 0 ] && grep -q "ranges.params" "$T/fsdps/step-000002/shard-00001-of-00002.safetensors" \
    && cmp -s "$T/fsdpm/model.safetensors" "$T/fsdp/step-000002/model.safetensors" \
    && cmp -s "$T/fsdps/final/model.safetensors" "$T/fsdp/final/model.safetensors" \
    && cmp -s "$T/fsdps1/final/model.safetensors" "$T/fsdp1/final/model.safetensors"; then
    ok "fsdp_sharded_ckpt_np2 (merge_shards, final/ and the resume = the consolidated run's bytes)"
else
    bad "fsdp_sharded_ckpt_np2" "exit $rc or a model.safetensors differs from the consolidated run's"
fi

# ranks started with different command lines refuse at start-up, naming the difference (once)
timeout 120 mpirun -np 2 sh -c 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then S=3; else S=4; fi; exec "$0" finetune_full "$@" --train.max_steps $S' \
    "$FL" "${ARGS[@]}" --devices 2 --out_dir "$T/cli4" >"$T/out" 2>&1; rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c "rank 1 of 2: the ranks were started with different configurations: rank 1 has '  max_steps: 3' where rank 0 has '  max_steps: 4'" "$T/out")" = 1 ]; then
    ok "ddp_config_mismatch (exit $rc)"
else
    bad "ddp_config_mismatch" "exit $rc"
fi

# ... or different model files (rank 1's model.safetensors is another checkpoint's), or different fitllm
# builds (a copy of the binary whose version text differs in one byte): refused before anything is loaded
cp -r "$T/cli/step-000002" "$T/m0" && cp -r "$T/m0" "$T/m1" && cp "$T/cli/final/model.safetensors" "$T/m1/"
MARGS=("${ARGS[@]:1}") # without the preset: the model folder comes first
timeout 120 mpirun -np 2 sh -c 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then M=$1/m1; else M=$1/m0; fi; shift; exec "$0" finetune_full "$M" "$@"' \
    "$FL" "$T" "${MARGS[@]}" --devices 2 --out_dir "$T/cli5" >"$T/out" 2>&1; rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c "rank 1 of 2: the ranks were started with different model files: rank 1 has 'checkpoint_dir model.safetensors: [0-9]* bytes, fingerprint [0-9a-f]*' where rank 0 has 'checkpoint_dir model.safetensors: " "$T/out")" = 1 ] \
    && [ ! -e "$T/cli5" ]; then
    ok "ddp_model_files_mismatch (exit $rc)"
else
    bad "ddp_model_files_mismatch" "exit $rc"
fi
V=$("$FL" --version | head -1 | sed -n 's/^fitllm \([^ ]*\)\( (git \(.*\))\)\{0,1\}$/\1 \3/p')
cp "$FL" "$T/fitllm-other" && V="$V" perl -0777 -pi -e 's/\Q$ENV{V}\E\x00/"X" . substr($ENV{V}, 1) . "\x00"/e' "$T/fitllm-other"
if cmp -s "$FL" "$T/fitllm-other"; then
    bad "ddp_version_mismatch" "could not find the version text '$V' in $FL to make a different build"
else
    timeout 120 mpirun -np 2 sh -c 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then B=$1; else B=$0; fi; shift; exec "$B" finetune_full "$@"' \
        "$FL" "$T/fitllm-other" "${ARGS[@]}" --devices 2 --out_dir "$T/cli6" >"$T/out" 2>&1; rc=$?
    if [ $rc -ne 0 ] && [ "$(grep -cF "rank 1 of 2: the ranks were started with different fitllm versions: rank 1 has 'fitllm X${V:1}' where rank 0 has 'fitllm $V'" "$T/out")" = 1 ]; then
        ok "ddp_version_mismatch (exit $rc)"
    else
        bad "ddp_version_mismatch" "exit $rc"
    fi
fi

# ... or different data: each rank reads data.json_path relative to its own working directory, rank 1's holds the
# same records reversed (the same samples and tokens, another training split): refused after loading, naming the
# rank, the split's fingerprints and the file it read, before anything is written; the same copy on both trains
mkdir -p "$T/da" "$T/db" "$T/dc"
for i in $(seq 1 24); do printf '{"instruction": "Name the number %d.", "input": "", "output": "It is %d."}\n' $i $i; done >"$T/da/d.jsonl"
tac "$T/da/d.jsonl" >"$T/db/d.jsonl" && cp "$T/da/d.jsonl" "$T/dc/d.jsonl"
DARGS=(micro --data JSON --data.json_path d.jsonl --data.prompt_style default --train.micro_batch_size 2 --train.global_batch_size 4 --train.max_steps 2
       --train.max_seq_length 48 --eval.max_new_tokens 0 --threads 1 --strategy ddp --devices 2)
timeout 120 mpirun -np 2 sh -c 'cd "$1/$([ "$OMPI_COMM_WORLD_RANK" = 1 ] && echo "$2" || echo da)" && shift 2 && exec "$0" "$@"' \
    "$(readlink -f "$FL")" "$T" db finetune_full "${DARGS[@]}" --out_dir "$T/cli7" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c "rank 1 of 2: the ranks read different data: rank 1 has 'training set: 23 samples, [0-9]* tokens, fingerprint [0-9a-f]*' where rank 0 has 'training set: 23 samples, [0-9]* tokens, fingerprint [0-9a-f]*' (rank 1 read data.json_path 'd.jsonl' (.*/db/d.jsonl); every rank must read the same data files" "$T/out")" = 1 ] \
    && [ ! -e "$T/cli7" ]; then
    ok "ddp_data_mismatch (exit $rc)"
else
    bad "ddp_data_mismatch" "exit $rc"
fi
timeout 120 mpirun -np 2 sh -c 'cd "$1/$([ "$OMPI_COMM_WORLD_RANK" = 1 ] && echo "$2" || echo da)" && shift 2 && exec "$0" "$@"' \
    "$(readlink -f "$FL")" "$T" dc finetune_full "${DARGS[@]}" --out_dir "$T/cli8" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && [ -f "$T/cli8/final/model.safetensors" ]; then
    ok "ddp_data_same_copies"
else
    bad "ddp_data_same_copies" "exit $rc"
fi

# a rank that dies during training (SIGKILL, after a checkpoint was committed): the job ends within
# seconds, non-zero; the launcher names the rank, rank 0 the last committed checkpoint (the newest
# step-* with its COMMITTED marker; training goes on between the kill and the end). Started without a
# launcher: fitllm stays as mpirun's parent (it forwards stop signals) and exits with mpirun's status.
"${SELF_ENV[@]}" "$FL" finetune_full "${ARGS[@]}" --train.max_steps 100000 --train.epochs 100000 --devices 2 --out_dir "$T/die" >"$T/out" 2>&1 &
job=$! # fitllm, then (exec) mpirun
for _ in $(seq 600); do [ -f "$T/die/step-000002/COMMITTED" ] && break; sleep 0.1; done
r1=$(rank_pid "$job" 1) # (the launcher stays as mpirun's parent)
if [ -z "$r1" ]; then
    kill "$job" 2>/dev/null; wait "$job"
    bad "ddp_dead_rank_names_checkpoint" "rank 1 not found (step-000002 committed: $([ -f "$T/die/step-000002/COMMITTED" ] && echo yes || echo no))"
else
    signal_rank "$job" "$r1" 9
    last=$(sed -n "s/.*rank 0 of 2: ended by the launcher .*the last committed checkpoint is '\([^']*\)' (to continue from it, run the same command with --resume auto).*/\1/p" "$T/out")
    if [ $rc -ne 0 ] && awk -v s="$secs" 'BEGIN { exit !(s <= 20) }' && grep -q "rank 1 .* exited on signal 9" "$T/out" \
        && [ -n "$last" ] && [ -f "$last/COMMITTED" ] && case "$last" in "$T/die/step-"*) true ;; *) false ;; esac; then
        ok "ddp_dead_rank_names_checkpoint (exit $rc in $secs s; ${last#$T/die/})"
    else
        bad "ddp_dead_rank_names_checkpoint" "exit $rc in $secs s, checkpoint named: '$last'"
    fi
fi

# a rank killed during a parameter fetch (parameter offload on NVMe, after step 2's checkpoint was committed): rank 1
# is held inside its next fetch (FITLLM_TEST_FETCH_HOLD: the file names the rank; it writes its pid to FILE.held and
# waits there), then SIGKILLed; the job ends within seconds, non-zero, the launcher names the rank, rank 0 the last
# committed checkpoint; the NVMe folder keeps no file
mkdir -p "$T/pdie-nv"
"${SELF_ENV[@]}" FITLLM_TEST_FETCH_HOLD="$T/hold" "$FL" finetune_full "${ARGS[@]}" --strategy deepspeed_stage_3_offload_nvme \
    --nvme_path "$T/pdie-nv" --train.max_steps 100000 --train.epochs 100000 --devices 2 --out_dir "$T/pdie" >"$T/out" 2>&1 &
job=$!
for _ in $(seq 600); do [ -f "$T/pdie/step-000002/COMMITTED" ] && break; sleep 0.1; done
echo 1 >"$T/hold"
for _ in $(seq 600); do [ -s "$T/hold.held" ] && break; sleep 0.1; done
r1=$(cat "$T/hold.held" 2>/dev/null)
if [ -z "$r1" ]; then
    kill "$job" 2>/dev/null; wait "$job"
    bad "param_offload_dead_rank_names_checkpoint" "rank 1 was not held in a fetch"
else
    signal_rank "$job" "$r1" 9
    last=$(sed -n "s/.*rank 0 of 2: ended by the launcher .*the last committed checkpoint is '\([^']*\)' (to continue from it, run the same command with --resume auto).*/\1/p" "$T/out")
    if [ $rc -ne 0 ] && awk -v s="$secs" 'BEGIN { exit !(s <= 20) }' && grep -q "rank 1 .* exited on signal 9" "$T/out" \
        && [ -n "$last" ] && [ -f "$last/COMMITTED" ] && case "$last" in "$T/pdie/step-"*) true ;; *) false ;; esac \
        && [ -z "$(ls -A "$T/pdie-nv")" ]; then
        ok "param_offload_dead_rank_names_checkpoint (exit $rc in $secs s; ${last#$T/pdie/})"
    else
        bad "param_offload_dead_rank_names_checkpoint" "exit $rc in $secs s, checkpoint named: '$last', nvme files: $(ls -A "$T/pdie-nv" | wc -l)"
    fi
fi

# tensor parallelism through the CLI (--tensor_parallel; tests/test_tp_train.c has the bounds' reasons): TP 2 at 2
# ranks and the grid DP 2 x TP 2 at 4 ranks train one process's losses within 1e-6 relative at every step
# (metrics.csv), rank 0 alone reports; the consolidated step-2 checkpoint of TP 2 resumes in one process and at
# TP 4, each continuing the TP 2 run's losses within 1e-6
TARGS=(micro --data.n_train 51 --data.n_val 7 --train.micro_batch_size 2 --train.global_batch_size 8
       --train.max_steps 4 --train.save_interval 2 --train.max_seq_length 48 --eval.max_new_tokens 4 --threads 1)
# the logged loss (a running mean over a step's G = 4 iterations) from iteration $2 on: a resumed run's window
# starts empty, so its rows compare from a whole window after the resume point
loss_col() { awk -F, -v a="${2:-1}" 'NR > 1 && $4 != "" && $1 >= a { print $1, $4 }' "$1/logs/metrics.csv"; }
# worst relative difference of the losses of the iterations both logs have (2: an iteration missing)
loss_rel() { join <(loss_col "$1" "${3:-1}") <(loss_col "$2" "${3:-1}") | awk -v n="$(loss_col "$1" "${3:-1}" | wc -l)" '
    { r = ($2 - $3) / $3; if (r < 0) r = -r; if (r > w) w = r; k++ } END { if (k < n || k == 0) w = 2; printf "%.3g", w }'; }
timeout 300 "$FL" finetune_full "${TARGS[@]}" --out_dir "$T/tp-one" >"$T/out" 2>&1 || bad "tp_cli_one_process" "exit $?"
for grid in "2 2 ddp" "4 2 ddp" "4 4 ddp" "4 2 deepspeed_stage_2"; do
    set -- $grid
    timeout 300 mpirun -np $1 "$FL" finetune_full "${TARGS[@]}" --devices $1 --tensor_parallel $2 --strategy $3 \
        --out_dir "$T/tp$1-$2-$3" >"$T/out" 2>&1; rc=$?
    w=$(loss_rel "$T/tp$1-$2-$3" "$T/tp-one" 2>/dev/null)
    if [ $rc -eq 0 ] && [ "$(grep -c "Saved the final model" "$T/out")" = 1 ] \
        && grep -q "^tensor parallel: $2 ranks per group x $(($1 / $2)) data-parallel group" "$T/out" \
        && grep -q "lm_head vocabulary-parallel ($((512 / $2)) of the 512 rows" "$T/out" \
        && grep -q "^model: micro, 260032 parameters" "$T/out" && [ -f "$T/tp$1-$2-$3/final/model.safetensors" ] \
        && awk -v w="$w" 'BEGIN { exit !(w <= 1e-6) }'; then
        ok "tp_cli_np$1_tp$2_$3 (losses within $w of one process)"
    else
        bad "tp_cli_np$1_tp$2_$3" "exit $rc, losses within '$w'"
    fi
done
timeout 300 "$FL" finetune_full "${TARGS[@]}" --resume "$T/tp2-2-ddp/step-000002" --out_dir "$T/tp-r1" >"$T/out" 2>&1; rc=$?
w=$(loss_rel "$T/tp-r1" "$T/tp2-2-ddp" 12 2>/dev/null) # resumed at iteration 8
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 4 --tensor_parallel 4 \
    --resume "$T/tp2-2-ddp/step-000002" --out_dir "$T/tp-r4" >>"$T/out" 2>&1 || rc=$?
w4=$(loss_rel "$T/tp-r4" "$T/tp2-2-ddp" 12 2>/dev/null)
if [ $rc -eq 0 ] && [ "$(grep -c "Resuming training from .*step-000002 (step 2, iter 8)" "$T/out")" = 2 ] \
    && awk -v a="$w" -v b="$w4" 'BEGIN { exit !(a <= 1e-6 && b <= 1e-6) }'; then
    ok "tp_cli_checkpoint_resumes_at_tp1_and_tp4 (later losses within $w and $w4)"
else
    bad "tp_cli_checkpoint_resumes_at_tp1_and_tp4" "exit $rc, losses within '$w' / '$w4'"
fi
# pipeline parallelism through the CLI (--pipeline_parallel, EXPERIMENTAL; tests/test_pp_model.c has the bit-identity
# of untied models): micro ties lm_head to its token table, so its two gradients are summed across the first and last
# stage instead of micro-batch by micro-batch, and clipping's norm is a sum over the stages: PP 2 (1F1B), PP 4 (GPipe)
# and DP 2 x PP 2 (DDP, ZeRO-2 and FULL_SHARD on the data axis) train one process's losses within 1e-6 relative at every step, rank 0 alone reports, and the final
# folder holds the files and the tensor layout one process writes, the lead prints the stages' measured times and the
# schedule simulated on them; PP 2's step-2 checkpoint resumes in one process
# and continues PP 2's losses within 1e-6; the refusals name the option
# the 3D grid (the 5th field: TP 2 x PP 2 at 4 ranks; tests/test_tp_train.c has the bounds' reasons) the same, and
# its step-2 checkpoint resumes in one process too
for grid in "2 2 1f1b ddp" "4 4 gpipe ddp" "4 2 1f1b ddp" "4 2 1f1b deepspeed_stage_2" "4 2 1f1b fsdp" "4 2 1f1b ddp 2"; do
    set -- $grid
    tp=${5:-1}; TPA=(); [ "$tp" = 1 ] || TPA=(--tensor_parallel "$tp")
    sfx=$([ "$4" = ddp ] || echo "_$4")$([ "$tp" = 1 ] || echo "_tp$tp")
    timeout 300 mpirun -np $1 "$FL" finetune_full "${TARGS[@]}" --devices $1 --pipeline_parallel $2 --pipeline_schedule $3 \
        --strategy $4 "${TPA[@]}" --out_dir "$T/pp$1-$2-$3$sfx" >"$T/out" 2>&1; rc=$?
    w=$(loss_rel "$T/pp$1-$2-$3$sfx" "$T/tp-one" 2>/dev/null)
    if [ $rc -eq 0 ] && [ "$(grep -c "Saved the final model" "$T/out")" = 1 ] \
        && grep -q "^pipeline parallel (EXPERIMENTAL): $2 stages x $(($1 / $2 / tp)) pipeline" "$T/out" \
        && { [ "$tp" = 1 ] || grep -q "^tensor parallel: $tp ranks per group x $(($1 / $2 / tp)) data-parallel group" "$T/out"; } \
        && [ "$(grep -cE "^pipeline timing \(EXPERIMENTAL\): forward \+ backward of a micro-batch per stage \(ms\):( [0-9.]+ \+ [0-9.]+){$2}; the $3 schedule on these times: [0-9.]+ ms per step, bubble [0-9.]+%" "$T/out")" = 1 ] \
        && grep -q "^model: micro, 260032 parameters" "$T/out" \
        && [ "$(ls "$T/pp$1-$2-$3$sfx/final")" = "$(ls "$T/tp-one/final")" ] \
        && [ "$(stat -c %s "$T/pp$1-$2-$3$sfx/final/model.safetensors")" = "$(stat -c %s "$T/tp-one/final/model.safetensors")" ] \
        && awk -v w="$w" 'BEGIN { exit !(w <= 1e-6) }'; then
        ok "pp_cli_np$1_pp$2_$3$sfx (losses within $w of one process)"
    else
        bad "pp_cli_np$1_pp$2_$3$sfx" "exit $rc, losses within '$w'"
    fi
done
for case in "pp2-2-1f1b pp" "pp4-2-1f1b_tp2 tpp"; do
    set -- $case
    timeout 300 "$FL" finetune_full "${TARGS[@]}" --resume "$T/$1/step-000002" --out_dir "$T/$1-r1" >"$T/out" 2>&1; rc=$?
    w=$(loss_rel "$T/$1-r1" "$T/$1" 12 2>/dev/null) # resumed at iteration 8
    if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000002 (step 2, iter 8)" "$T/out" \
        && awk -v a="$w" 'BEGIN { exit !(a <= 1e-6) }'; then
        ok "$2_cli_checkpoint_resumes_in_one_process (later losses within $w)"
    else
        bad "$2_cli_checkpoint_resumes_in_one_process" "exit $rc, losses within '$w'"
    fi
done
# a LoRA run (name, its out_dir, one process's; $rc its exit): one process's losses within 1e-6 relative, one PEFT
# adapter saved, final/ and final/adapter with one process's files
lora_files_case() {
    local w; w=$(loss_rel "$2" "$3" 2>/dev/null)
    if [ $rc -eq 0 ] && [ "$(grep -c "Saved the PEFT adapter" "$T/out")" = 1 ] && [ "$(ls "$2/final")" = "$(ls "$3/final")" ] \
        && [ "$(ls "$2/final/adapter")" = "$(ls "$3/final/adapter")" ] && awk -v w="$w" 'BEGIN { exit !(w <= 1e-6) }' \
        && cmp -s "$2/base/model.safetensors" "$3/base/model.safetensors"; then
        ok "$1 (losses within $w of one process)"
    else
        bad "$1" "exit $rc, losses within '$w'"
    fi
}
# the same, the losses one process's bits and final/model.safetensors and the PEFT adapter one process's bytes
lora_bits_case() {
    local w; w=$(loss_rel "$2" "$3" 2>/dev/null)
    if [ $rc -eq 0 ] && [ "$w" = 0 ] && cmp -s "$2/final/model.safetensors" "$3/final/model.safetensors" \
        && cmp -s "$2/final/adapter/adapter_model.safetensors" "$3/final/adapter/adapter_model.safetensors" \
        && cmp -s "$2/base/model.safetensors" "$3/base/model.safetensors"; then
        ok "$1 (losses and final/ one process's bits)"
    else
        bad "$1" "exit $rc, losses within '$w'"
    fi
}
# LoRA on the slices through the CLI (finetune_lora --tensor_parallel 2 at 2 ranks, adapters on q, v and the MLP,
# dropout 0): one process's losses within 1e-6 relative, final/ and final/adapter with one process's files; the
# preset's random base kept in base/ (the whole model made again on rank 0) one process's bytes
LARGS=("${TARGS[@]}" --lora_mlp true --lora_dropout 0)
timeout 300 "$FL" finetune_lora "${LARGS[@]}" --out_dir "$T/tpl-one" >"$T/out" 2>&1 || bad "tp_lora_cli_one_process" "exit $?"
timeout 300 mpirun -np 2 "$FL" finetune_lora "${LARGS[@]}" --devices 2 --tensor_parallel 2 --strategy ddp \
    --out_dir "$T/tpl2" >"$T/out" 2>&1; rc=$?
lora_files_case tp_lora_cli_np2_tp2 "$T/tpl2" "$T/tpl-one"
# LoRA on the stages (dropout 0.05, LitGPT's default): PP 2 under mpirun logs one process's losses exactly, and its
# final/ (stage 0 merges the gathered adapters into the gathered base) and final/adapter are one process's bytes
timeout 300 "$FL" finetune_lora "${TARGS[@]}" --out_dir "$T/pp-lora-one" >"$T/out" 2>&1 || bad "pp_cli_lora_one_process" "exit $?"
timeout 300 mpirun -np 2 "$FL" finetune_lora "${TARGS[@]}" --devices 2 --pipeline_parallel 2 --out_dir "$T/pp-lora2" \
    >"$T/out" 2>&1; rc=$?
lora_bits_case pp_cli_np2_pp2_lora "$T/pp-lora2" "$T/pp-lora-one"
# the interleaved schedule (--pipeline_schedule interleaved --pipeline_chunks 2: each rank two chunks of micro's 5
# blocks, Megatron's order) at PP 2 and DP 2 x PP 2: one process's losses within 1e-6 relative (the tied table's and
# the norm's sums, as above), one process's final files, the bubble measured beside the simulator's (S-1)/(M V+S-1);
# PP 2's step-2 checkpoint resumes in one process
for grid in "2 2" "4 2"; do
    set -- $grid
    timeout 300 mpirun -np $1 "$FL" finetune_full "${TARGS[@]}" --devices $1 --pipeline_parallel $2 --strategy ddp \
        --pipeline_schedule interleaved --pipeline_chunks 2 --out_dir "$T/ppi$1-$2" >"$T/out" 2>&1; rc=$?
    w=$(loss_rel "$T/ppi$1-$2" "$T/tp-one" 2>/dev/null)
    M=$((8 / ($1 / $2) / 2))
    if [ $rc -eq 0 ] && [ "$(grep -c "Saved the final model" "$T/out")" = 1 ] \
        && grep -q "^interleaved (EXPERIMENTAL): 2 model chunks per rank" "$T/out" \
        && grep -qE "^pipeline timing \(EXPERIMENTAL\): forward \+ backward of a micro-batch per virtual stage \(ms\):( [0-9.]+ \+ [0-9.]+){4}; the interleaved schedule" "$T/out" \
        && grep -qE "^pipeline bubble \(EXPERIMENTAL\): measured -?[0-9.]+%.*simulated on the measured times [0-9.]+%, equal stages \(S-1\)/\(M V\+S-1\) = [0-9.]+% \(S 2, M $M, V 2\)" "$T/out" \
        && [ "$(ls "$T/ppi$1-$2/final")" = "$(ls "$T/tp-one/final")" ] \
        && [ "$(stat -c %s "$T/ppi$1-$2/final/model.safetensors")" = "$(stat -c %s "$T/tp-one/final/model.safetensors")" ] \
        && awk -v w="$w" 'BEGIN { exit !(w <= 1e-6) }'; then
        ok "pp_cli_np$1_pp$2_interleaved (losses within $w of one process)"
    else
        bad "pp_cli_np$1_pp$2_interleaved" "exit $rc, losses within '$w'"
    fi
done
timeout 300 "$FL" finetune_full "${TARGS[@]}" --resume "$T/ppi2-2/step-000002" --out_dir "$T/ppi-r1" >"$T/out" 2>&1; rc=$?
w=$(loss_rel "$T/ppi-r1" "$T/ppi2-2" 12 2>/dev/null)
if [ $rc -eq 0 ] && grep -q "Resuming training from .*step-000002 (step 2, iter 8)" "$T/out" \
    && awk -v a="$w" 'BEGIN { exit !(a <= 1e-6) }'; then
    ok "ppi_cli_checkpoint_resumes_in_one_process (later losses within $w)"
else
    bad "ppi_cli_checkpoint_resumes_in_one_process" "exit $rc, losses within '$w'"
fi
# LoRA on the 3D grid (TP 2 x PP 2 at 4 ranks, adapters on q, v and the MLP, dropout 0): one process's losses within
# 1e-6 relative, final/ and final/adapter (the PEFT folder) with one process's files
timeout 300 mpirun -np 4 "$FL" finetune_lora "${LARGS[@]}" --devices 4 --tensor_parallel 2 --pipeline_parallel 2 \
    --strategy ddp --out_dir "$T/tppl4" >"$T/out" 2>&1; rc=$?
lora_files_case tpp_lora_cli_np4_tp2_pp2 "$T/tppl4" "$T/tpl-one"
# QLoRA on the stages (--quantize bnb.nf4-dq, PP 2): each stage keeps the whole model's 4-bit stores as they are, so
# the losses are one process's bits and final/ (the merged model) and final/adapter one process's bytes
QARGS=("${TARGS[@]}" --quantize bnb.nf4-dq)
timeout 300 "$FL" finetune_lora "${QARGS[@]}" --out_dir "$T/ppq-one" >"$T/out" 2>&1 || bad "pp_cli_qlora_one_process" "exit $?"
timeout 300 mpirun -np 2 "$FL" finetune_lora "${QARGS[@]}" --devices 2 --pipeline_parallel 2 --out_dir "$T/ppq2" \
    >"$T/out" 2>&1; rc=$?
lora_bits_case pp_cli_np2_pp2_qlora "$T/ppq2" "$T/ppq-one"
pp_refused() { # name, pattern, ranks, arguments...
    local name=$1 pat=$2 np=$3; shift 3
    timeout 120 mpirun -np "$np" "$FL" "$@" --threads 1 >"$T/out" 2>&1; local rc=$?
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q -- "$pat" "$T/out"; then ok "$name"; else bad "$name" "exit $rc"; fi
}
# refused_once NAME PATTERN ARGS...: what every rank refuses alike (a grid the ranks do not fill, a batch the ranks do
# not divide) is said once, by rank 0, and the job exits 2 (a usage error) cleanly: no MPI_Abort banner, no advice
# about checkpoints (the grid's refusal was each rank's own error before: both aborted the job, advising
# --overwrite; the batch's was printed by every rank)
refused_once() {
    local name=$1 pat=$2; shift 2
    timeout 120 mpirun -np 2 "$FL" "$@" --threads 1 >"$T/out" 2>&1; local rc=$?
    if [ $rc -eq 2 ] && [ "$(grep -c -- "$pat" "$T/out")" = 1 ] && ! grep -Eq "MPI_ABORT|aborting|no checkpoint was committed" "$T/out"; then
        ok "$name"
    else
        bad "$name" "exit $rc, $(grep -c -- "$pat" "$T/out") lines with the reason"
    fi
}
refused_once grid_refused_once_exit_2 "fitllm finetune_full: error: --tensor_parallel 2 with --pipeline_parallel 2: this run has 2 ranks, not a multiple of 4" \
    finetune_full micro --devices 2 --tensor_parallel 2 --pipeline_parallel 2 --out_dir "$T/g2"
refused_once batch_refused_once_exit_2 "train.global_batch_size 6 is not divisible by devices x micro_batch_size = 2 x 2" \
    finetune_full micro --devices 2 --train.global_batch_size 6 --train.micro_batch_size 2 --out_dir "$T/g3"
pp_refused pp_more_stages_than_layers "--pipeline_parallel 6: the model has 5 layers" 6 finetune_full micro --devices 6 \
    --pipeline_parallel 6 --train.global_batch_size 6 --out_dir "$T/pp-x1"
# HYBRID_SHARD on the data axis runs where a node holds whole pipelines: nodes of one rank do not (QLoRA where a rank's
# part cuts a 4-bit block runs: tp_qlora_cut_blocks_np4 below)
pp_refused pp_hybrid_shard_refused "HYBRID_SHARD on the data-parallel axis of a grid of 2 model-parallel ranks" 4 \
    finetune_full micro --devices 1 --num_nodes 4 --pipeline_parallel 2 --strategy fsdp --fsdp.sharding_strategy HYBRID_SHARD --out_dir "$T/pp-x3"
# T5 runs on pipeline stages (tests/mpi_t5_test.sh): FULL_SHARD / HYBRID on their data axis, LoRA under interleaved,
# the offloads too (t5_pp_param_offload_full_shard_bytes; decoders: ppo_cli_np4_pp2_interleaved_fsdp_cpu_offload below)

# a rank of the grid killed during training (rank 3: the second tensor-parallel rank of data-parallel group 1):
# the whole job ends within seconds, non-zero, the launcher naming the rank
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 4 --tensor_parallel 2 --strategy ddp \
    --train.max_steps 100000 --train.epochs 100000 --out_dir "$T/tp-die" >"$T/out" 2>&1 &
job=$!
for _ in $(seq 600); do [ -f "$T/tp-die/step-000002/COMMITTED" ] && break; sleep 0.1; done
r3=$(rank_pid "$job" 3)
if [ -z "$r3" ]; then
    kill "$job" 2>/dev/null; wait "$job"
    bad "tp_dead_rank_ends_the_grid" "rank 3 not found"
else
    signal_rank "$job" "$r3" 9
    if [ $rc -ne 0 ] && awk -v s="$secs" 'BEGIN { exit !(s <= 20) }' && grep -q "rank 3 .* exited on signal 9" "$T/out"; then
        ok "tp_dead_rank_ends_the_grid (exit $rc in $secs s)"
    else
        bad "tp_dead_rank_ends_the_grid" "exit $rc in $secs s"
    fi
fi

# a rank that stops without dying (kill -STOP: no error, no exit, so the launcher sees nothing): the other's wait for
# it ends after FITLLM_COMM_TIMEOUT seconds (here 2; default 600), naming the collective, the step and the last
# committed checkpoint, and ends the job non-zero (it waited forever, silently, before)
FITLLM_COMM_TIMEOUT=2 timeout 300 mpirun -np 2 "$FL" finetune_full "${ARGS[@]}" --devices 2 --train.max_steps 100000 \
    --train.epochs 100000 --out_dir "$T/stop" >"$T/out" 2>&1 &
job=$!
for _ in $(seq 600); do [ -f "$T/stop/step-000002/COMMITTED" ] && break; sleep 0.1; done
r1=$(rank_pid "$job" 1)
if [ -z "$r1" ]; then
    kill "$job" 2>/dev/null; wait "$job"
    bad "mpi_stopped_rank_times_out" "rank 1 not found"
else
    signal_rank "$job" "$r1" STOP
    if [ $rc -eq 1 ] && awk -v s="$secs" 'BEGIN { exit !(s >= 2 && s <= 20) }' \
        && grep -Eq "rank 0 of 2: .* did not complete in 2 s: another rank stopped.*FITLLM_COMM_TIMEOUT.*this rank was past step [0-9]+; the last committed checkpoint is '$T/stop/step-0000[0-9][0-9]'" "$T/out"; then
        ok "mpi_stopped_rank_times_out (exit $rc in $secs s)"
    else
        bad "mpi_stopped_rank_times_out" "exit $rc in $secs s"
    fi
fi

# SIGTERM to your own mpirun's ranks (what its Ctrl-C sends them, a second before SIGKILL) ends them at once: rank 0
# names the last committed checkpoint and says what stops after the step instead (SIGUSR1 to mpirun); sent here to
# rank 0 itself, which takes it as mpirun's
timeout 300 mpirun -np 2 "$FL" finetune_full "${ARGS[@]}" --devices 2 --train.max_steps 100000 --train.epochs 100000 \
    --out_dir "$T/term" >"$T/out" 2>&1 &
job=$!
for _ in $(seq 600); do [ -f "$T/term/step-000002/COMMITTED" ] && break; sleep 0.1; done
r0=$(rank_pid "$job" 0)
if [ -n "$r0" ]; then signal_rank "$job" "$r0" TERM; else kill "$job"; wait "$job"; rc=$?; fi
if [ -n "$r0" ] && [ $rc -ne 0 ] && grep -q "rank 0 of 2: ended by the launcher .*the last committed checkpoint is '$T/term/step-0000[0-9]*' .*; to stop a run after its step instead, send SIGUSR1 to mpirun (kill -USR1 <its pid>)" "$T/out"; then
    ok "mpi_sigterm_names_checkpoint_and_sigusr1"
else
    bad "mpi_sigterm_names_checkpoint_and_sigusr1" "exit $rc (rank 0: '$r0')"
fi

# faults: every rank ends promptly, non-zero, and the output names the rank at fault
fault() {
    local name=$1 mode=$2 pat=$3
    local t0 t1 rc
    t0=$(now)
    timeout 60 mpirun -np 4 "$BIN" "$mode" >"$T/out" 2>&1; rc=$?
    t1=$(now)
    local secs
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then bad "$name" "exit $rc after ${secs} s (want non-zero, before the 60 s timeout)"; return; fi
    if awk -v s="$secs" 'BEGIN { exit !(s > 20) }'; then bad "$name" "took ${secs} s"; return; fi
    if ! grep -qE -- "$pat" "$T/out"; then bad "$name" "output lacks /$pat/"; return; fi
    if grep -q "barrier returned" "$T/out"; then bad "$name" "a rank went on past the failure"; return; fi
    ok "$name (exit $rc in ${secs} s)"
}
fault mpi_abort_ends_all_ranks abort "rank 3 of 4 aborting: abort test"
fault mpi_dead_rank_ends_all_ranks die "Exit code: +7"
fault mpi_abort_on_a_split_ends_all_ranks abort_split "rank 1 of 2 aborting: abort test"

# torchrun-style variables without an MPI launcher: refused with the command to run
env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE RANK=1 WORLD_SIZE=2 "$BIN" >"$T/out" 2>&1; rc=$?
if [ $rc -ne 0 ] && grep -q "mpirun -np 2 fitllm" "$T/out"; then ok "mpi_torchrun_without_mpirun"; else bad "mpi_torchrun_without_mpirun" "exit $rc"; fi

# a launcher whose rank count MPI does not see (each process a singleton): refused, naming the fix
env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2 SLURM_LOCALID=0 \
    timeout 60 "$BIN" >"$T/out" 2>&1; rc=$?
if [ $rc -ne 0 ] && grep -q "Slurm (srun) says rank 0 of 2 but MPI .* sees rank 0 of 1: srun needs .*--mpi=pmix" "$T/out"; then
    ok "mpi_srun_without_pmix"; else bad "mpi_srun_without_pmix" "exit $rc"; fi
env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE PMI_RANK=1 PMI_SIZE=2 timeout 60 "$BIN" >"$T/out" 2>&1; rc=$?
if [ $rc -ne 0 ] && grep -q "says rank 1 of 2 but MPI .* sees rank 0 of 1: .*use the mpirun of the MPI fitllm was built with" "$T/out"; then
    ok "mpi_foreign_launcher"; else bad "mpi_foreign_launcher" "exit $rc"; fi

# two nodes for real: one rank in each of two network namespaces, Open MPI over TCP (tests/netns_test.sh;
# prints SKIP where it may not create namespaces)
# (its one-node reference: the explicit 2-rank run of the same arguments above)
"$(dirname "$0")/netns_test.sh" "$BUILD" "$T/cli" >"$T/out" 2>&1; rc=$?
grep -E "^(ok|FAIL|SKIP)" "$T/out"
if [ $rc -eq 0 ] && grep -q "^SKIP" "$T/out"; then skip=$((skip+1))
elif [ $rc -eq 0 ]; then pass=$((pass+1)); else bad "netns_two_nodes" "exit $rc"; fi

# BLIP-2 image-caption fine-tuning over 2 ranks (tests/mpi_blip2_test.sh: DDP against one process, OPT and Flan-T5,
# full and LoRA; the self-started launcher; DDP's checkpoint resumed in one process; refusals; a rank's corrupt image)
t_sub=$SECONDS  # its lines come out together at its end: the first one's lap time is the whole script's
"$(dirname "$0")/mpi_blip2_test.sh" "$BUILD" >"$T/out" 2>&1; rc=$?
grep -E "^(ok|FAIL|     )" "$T/out"
echo "     (tests/mpi_blip2_test.sh: $((SECONDS - t_sub)) s for its $(grep -cE '^(ok|FAIL)' "$T/out") cases)"
pass=$((pass + $(grep -c '^ok' "$T/out"))); fail=$((fail + $(grep -c '^FAIL' "$T/out")))
[ $rc -eq 0 ] || [ "$(grep -c '^FAIL' "$T/out")" -gt 0 ] || bad "mpi_blip2" "exit $rc"

# T5, an encoder-decoder, over 2 ranks (tests/mpi_t5_test.sh: DDP against one process, ZeRO-1/2 and ZeRO-2 offload
# against DDP, rank 0's peaks against the plan)
t_sub=$SECONDS  # its lines come out together at its end: the first one's lap time is the whole script's
"$(dirname "$0")/mpi_t5_test.sh" "$BUILD" >"$T/out" 2>&1; rc=$?
grep -E "^(ok|FAIL|     )" "$T/out"
echo "     (tests/mpi_t5_test.sh: $((SECONDS - t_sub)) s for its $(grep -cE '^(ok|FAIL)' "$T/out") cases)"
pass=$((pass + $(grep -c '^ok' "$T/out"))); fail=$((fail + $(grep -c '^FAIL' "$T/out")))
[ $rc -eq 0 ] || [ "$(grep -c '^FAIL' "$T/out")" -gt 0 ] || bad "mpi_t5" "exit $rc"

# sequence parallelism (--sequence_parallel with --tensor_parallel) over 2 and 4 ranks (tests/mpi_sp_test.sh: against one
# process and TP alone, the checkpoint resumed in one process, rank 0's peaks = the plan, TP 2 x PP 2, T5 with its
# evaluation sample, LoRA dropout on the row-parallel linears, a sequence length the group does not divide)
t_sub=$SECONDS  # its lines come out together at its end: the first one's lap time is the whole script's
"$(dirname "$0")/mpi_sp_test.sh" "$BUILD" >"$T/out" 2>&1; rc=$?
grep -E "^(ok|FAIL|     )" "$T/out"
echo "     (tests/mpi_sp_test.sh: $((SECONDS - t_sub)) s for its $(grep -cE '^(ok|FAIL)' "$T/out") cases)"
pass=$((pass + $(grep -c '^ok' "$T/out"))); fail=$((fail + $(grep -c '^FAIL' "$T/out")))
[ $rc -eq 0 ] || [ "$(grep -c '^FAIL' "$T/out")" -gt 0 ] || bad "mpi_sp" "exit $rc"

# OPT's dropout in the decoder trainer (config.json dropout / attention_dropout 0.3; masks: run seed, global micro-batch):
# DDP over 2 ranks = one process's losses (metrics.csv, each iteration within 1e-6 relative), not the losses at rate 0
mkdir -p "$T/optd" && sed -E 's/"(dropout|attention_dropout)": 0.0/"\1": 0.3/; s/"vocab_size": 257/"vocab_size": 264/' \
    tests/fixtures/golden-opt/config.json >"$T/optd/config.json"
OD=(--data Synthetic --train.max_steps 4 --train.micro_batch_size 2 --train.global_batch_size 8 --train.max_seq_length 16
    --train.lr_warmup_steps 0 --threads 1 --strategy ddp --eval.max_new_tokens 0)
"$FL" pretrain --model_config "$T/optd/config.json" "${OD[@]}" --train.max_steps 1 --out_dir "$T/optd1" >/dev/null 2>&1
mkdir -p "$T/optz" && cp "$T/optd1/final"/*.json "$T/optd1/final/model.safetensors" "$T/optz/"
sed -i -E 's/"(dropout|attention_dropout)": [0-9.]+/"\1": 0.0/' "$T/optz/config.json"
mloss() { awk -F, 'NR > 1 { print $4 }' "$1/logs/metrics.csv"; }
timeout 300 "$FL" finetune_full "$T/optd1/final" "${OD[@]}" --out_dir "$T/od1" >"$T/out" 2>&1
timeout 300 "$FL" finetune_full "$T/optz" "${OD[@]}" --out_dir "$T/od0" >>"$T/out" 2>&1
timeout 300 mpirun -np 2 "$FL" finetune_full "$T/optd1/final" "${OD[@]}" --devices 2 --out_dir "$T/od2" >>"$T/out" 2>&1; rc=$?
a=$(mloss "$T/od1"); b=$(mloss "$T/od2")
if [ $rc -eq 0 ] && [ -n "$a" ] && [ "$a" != "$(mloss "$T/od0")" ] && grep -q "dropout 0.3 / attention_dropout 0.3 are applied" "$T/out" &&
    paste -d' ' <(printf '%s\n' "$a") <(printf '%s\n' "$b") | awk 'NF != 2 { bad = 1 } { d = $1 - $2; if (d < 0) d = -d; if (d > 1e-6 * $1) bad = 1; n++ } END { exit bad || n < 4 }'; then
    ok "opt_dropout_ddp_np2 (losses = one process's: $(tr '\n' ' ' <<<"$b"))"
else
    bad "opt_dropout_ddp_np2" "exit $rc"
fi

# FULL_SHARD / ZeRO-3 and HYBRID_SHARD on the data axis of a tensor-parallel grid (issue 35; tests/test_tp_train.c has
# the bounds): DP 2 x TP 2 under fsdp at 4 ranks against one process (TARGS' tp-one), every logged loss within 1e-6
# relative, the report's memory line naming the pieces; DP 2 x PP 2 under HYBRID_SHARD as 2 nodes of one pipeline;
# the fsdp grid's step-2 checkpoint (one process's files) resumed in one process
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 4 --tensor_parallel 2 --strategy fsdp \
    --out_dir "$T/tpf" >"$T/out" 2>&1; rc=$?
w=$(loss_rel "$T/tpf" "$T/tp-one" 2>/dev/null)
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 2 --num_nodes 2 --pipeline_parallel 2 --strategy fsdp \
    --fsdp.sharding_strategy HYBRID_SHARD --out_dir "$T/pph" >>"$T/out" 2>&1 || rc=$?
wh=$(loss_rel "$T/pph" "$T/tp-one" 2>/dev/null)
timeout 300 "$FL" finetune_full "${TARGS[@]}" --resume "$T/tpf/step-000002" --out_dir "$T/tpf-r1" >>"$T/out" 2>&1 || rc=$?
wr=$(loss_rel "$T/tpf-r1" "$T/tpf" 12 2>/dev/null)
if [ $rc -eq 0 ] && grep -q "tensor parallel 2 x ZeRO-3 (FSDP FULL_SHARD): PARAMS, GRADS and OPTIM hold its slice.*the rank's pieces" "$T/out" \
    && grep -q "data parallel (FSDP HYBRID_SHARD, strategy fsdp)" "$T/out" \
    && awk -v a="$w" -v b="$wh" -v c="$wr" 'BEGIN { exit !(a <= 1e-6 && b <= 1e-6 && c <= 1e-6) }'; then
    ok "tp_cli_np4_tp2_fsdp_and_pp2_hybrid (losses within $w and $wh of one process; resumed within $wr)"
else
    bad "tp_cli_np4_tp2_fsdp_and_pp2_hybrid" "exit $rc, losses within '$w' / '$wh', resumed '$wr'"
fi

# the interleaved schedule with ZeRO-2 on the data axis and 16-mixed's loss scaling (DP 2 x PP 2 x 2 chunks, 4 ranks):
# a one-process 16-mixed run's losses within 1e-6 relative (pp_train_threads_interleaved_zero_and_fp16's bar), its
# final files; the step-2 checkpoint (each chunk's state gathered over the axis) resumes in one process
# ppi_check NAME RUN ONE RESUMED: the run's losses within 1e-6 relative of one process's, its final files one
# process's, the resumed run's later losses within 1e-6 of the run's (rc: the commands' exit)
ppi_check() {
    local w w1; w=$(loss_rel "$2" "$3" 2>/dev/null); w1=$(loss_rel "$4" "$2" 12 2>/dev/null)
    if [ $rc -eq 0 ] && [ "$(ls "$2/final")" = "$(ls "$3/final")" ] \
        && awk -v w="$w" -v a="$w1" 'BEGIN { exit !(w <= 1e-6 && a <= 1e-6) }'; then
        ok "$1 (losses within $w of one process, resumed in one process within $w1)"
    else
        bad "$1" "exit $rc, losses within '$w', resumed within '$w1'"
    fi
}
timeout 300 "$FL" finetune_full "${TARGS[@]}" --precision 16-mixed --out_dir "$T/ppz-one" >"$T/out" 2>&1 \
    || bad "ppi_cli_zero2_fp16_one_process" "exit $?"
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --precision 16-mixed --devices 4 --pipeline_parallel 2 \
    --strategy deepspeed_stage_2 --pipeline_schedule interleaved --pipeline_chunks 2 --out_dir "$T/ppz4" >"$T/out" 2>&1; rc=$?
timeout 300 "$FL" finetune_full "${TARGS[@]}" --precision 16-mixed --resume "$T/ppz4/step-000002" --out_dir "$T/ppz-r1" \
    >>"$T/out" 2>&1 || rc=$?
ppi_check ppi_cli_np4_pp2_zero2_fp16 "$T/ppz4" "$T/ppz-one" "$T/ppz-r1"

# LoRA under the interleaved schedule (PP 2 x 2 chunks at 2 ranks, LitGPT's dropout 0.05: each chunk's adapters keyed
# by the whole model's module index): one process's losses and final/ bytes (pp-lora-one above); the step-2
# checkpoint (the virtual stages' adapters and AdamW state gathered in order) resumes in one process bit for bit
timeout 300 mpirun -np 2 "$FL" finetune_lora "${TARGS[@]}" --devices 2 --pipeline_parallel 2 --pipeline_schedule interleaved \
    --pipeline_chunks 2 --out_dir "$T/ppi-lora2" >"$T/out" 2>&1; rc=$?
timeout 300 "$FL" finetune_lora "${TARGS[@]}" --resume "$T/ppi-lora2/step-000002" --out_dir "$T/ppi-lora-r1" \
    >>"$T/out" 2>&1 || rc=$?
w=$(loss_rel "$T/ppi-lora2" "$T/pp-lora-one" 2>/dev/null)
w1=$(loss_rel "$T/ppi-lora-r1" "$T/pp-lora-one" 12 2>/dev/null)
if [ $rc -eq 0 ] && [ "$w" = 0 ] && [ "$w1" = 0 ] \
    && cmp -s "$T/ppi-lora2/final/model.safetensors" "$T/pp-lora-one/final/model.safetensors" \
    && cmp -s "$T/ppi-lora2/final/adapter/adapter_model.safetensors" "$T/pp-lora-one/final/adapter/adapter_model.safetensors"; then
    ok "ppi_cli_np2_pp2_lora (losses and final/ one process's bits; resumed in one process, the same bits)"
else
    bad "ppi_cli_np2_pp2_lora" "exit $rc, losses within '$w', resumed within '$w1'"
fi

# offload on the slices (issue 35): DP 2 x TP 2 under fsdp_cpu_offload at 4 ranks (each rank's pieces of its slice's
# parameters, gradients and state in the host tier) logs the device-resident grid's losses (tpf's above) and writes its
# final weights byte for byte; tpf's step-2 checkpoint resumed under fsdp_cpu_offload ends on the same final weights
# (tests/test_tp_train.c: ZeRO-1/2/3 offload and NVMe too)
# same_run A B: run A logged B's losses (metrics' first four columns) and wrote B's final weights, byte for byte
same_run() {
    cmp -s "$1/final/model.safetensors" "$2/final/model.safetensors" \
        && cmp -s <(cut -d, -f1-4 "$1/logs/metrics.csv") <(cut -d, -f1-4 "$2/logs/metrics.csv")
}
rc=0
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 4 --tensor_parallel 2 --strategy fsdp_cpu_offload \
    --out_dir "$T/tpo" >"$T/out" 2>&1 || rc=$?
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 4 --tensor_parallel 2 --strategy fsdp_cpu_offload \
    --resume "$T/tpf/step-000002" --out_dir "$T/tpo-r" >>"$T/out" 2>&1 || rc=$?
if [ $rc -eq 0 ] && same_run "$T/tpo" "$T/tpf" && cmp -s "$T/tpo-r/final/model.safetensors" "$T/tpf/final/model.safetensors" \
    && grep -q "host tier (offload) PARAMS  *254.62 KiB" "$T/out"; then
    ok "tp_cli_np4_tp2_fsdp_cpu_offload (the device-resident grid's bytes; its checkpoint resumed with offload)"
else
    bad "tp_cli_np4_tp2_fsdp_cpu_offload" "exit $rc"
fi

# QLoRA where a rank's part cuts a 4-bit block (issue 35): micro's o_proj (32 of 64 columns per rank) and down_proj (86
# of 172) at TP 2 x PP 2 over 4 ranks keep the whole blocks covering their parts: one process's QLoRA losses within
# 1e-6 relative (tests/test_tp_train.c tp_train_threads_qlora_cut_blocks_*), final/ and final/adapter with its files
QARGS=("${LARGS[@]}" --quantize bnb.nf4)
rc=0
timeout 300 "$FL" finetune_lora "${QARGS[@]}" --out_dir "$T/tpq-one" >"$T/out" 2>&1 || rc=$?
timeout 300 mpirun -np 4 "$FL" finetune_lora "${QARGS[@]}" --devices 4 --tensor_parallel 2 --pipeline_parallel 2 \
    --strategy ddp --out_dir "$T/tpq4" >>"$T/out" 2>&1 || rc=$?
w=$(loss_rel "$T/tpq4" "$T/tpq-one" 2>/dev/null)
if [ $rc -eq 0 ] && [ "$(ls "$T/tpq4/final")" = "$(ls "$T/tpq-one/final")" ] \
    && [ "$(ls "$T/tpq4/final/adapter")" = "$(ls "$T/tpq-one/final/adapter")" ] \
    && awk -v w="$w" 'BEGIN { exit !(w <= 1e-6) }'; then
    ok "tp_qlora_cut_blocks_np4 (TP 2 x PP 2: losses within $w of one process)"
else
    bad "tp_qlora_cut_blocks_np4" "exit $rc, losses within '$w'"
fi

# FULL_SHARD on the data axis under the interleaved schedule (DP 2 x PP 2 x 2 chunks at 4 ranks: each chunk sharded
# unit by unit over the axis on its own): one process's losses (tp-one) within 1e-6 relative, its final files; the
# step-2 checkpoint (each chunk's units gathered over the axis, then the virtual stages) resumes in one process
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 4 --pipeline_parallel 2 --strategy fsdp \
    --pipeline_schedule interleaved --pipeline_chunks 2 --out_dir "$T/ppif4" >"$T/out" 2>&1; rc=$?
timeout 300 "$FL" finetune_full "${TARGS[@]}" --resume "$T/ppif4/step-000002" --out_dir "$T/ppif-r1" >>"$T/out" 2>&1 || rc=$?
ppi_check ppi_cli_np4_pp2_fsdp "$T/ppif4" "$T/tp-one" "$T/ppif-r1"

# fp16's overflow verdict across processes (FITLLM_FAULT_GRAD_OVERFLOW, fitllm/fault.h): +inf injected into rank 1's
# gradients at step 2 of a 16-mixed TP 2 run; rank 0, which prints, skips that step too and counts it (the threads
# version: tests/test_fp16_fault.c)
timeout 300 env FITLLM_FAULT_GRAD_OVERFLOW=2:1 mpirun -np 2 "$FL" finetune_full micro --devices 2 --tensor_parallel 2 \
    --precision 16-mixed --train.max_steps 3 --train.global_batch_size 4 --train.micro_batch_size 2 \
    --eval.final_validation false --out_dir "$T/ffm" >"$T/out" 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "^step 2: inf/NaN in the fp16 gradients: update skipped, loss scale -> 32768" "$T/out" \
    && grep -q "fp16 steps (loss scaling) *1 skipped, scale 32768" "$T/out"; then
    ok "fp16_fault_np2_tp2_rank1_overflow_skipped_on_rank0"
else
    bad "fp16_fault_np2_tp2_rank1_overflow_skipped_on_rank0" "exit $rc"
fi

# offload on the stages (issue 35): DP 2 x PP 2 x 2 chunks under fsdp_cpu_offload (each chunk's pieces of its units'
# parameters, gradients and state in the host tier) logs the device-resident grid's losses (ppif4's above) and writes
# its step-2 and final weights byte for byte; its step-2 checkpoint resumed in one process without offload ends on the
# device grid's resumed weights (tests/test_pp_offload.c: ZeRO-1/2 offload, NVMe, GPipe / 1F1B, the 3D grid)
rc=0
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 4 --pipeline_parallel 2 --strategy fsdp_cpu_offload \
    --pipeline_schedule interleaved --pipeline_chunks 2 --out_dir "$T/ppio4" >"$T/out" 2>&1 || rc=$?
timeout 300 "$FL" finetune_full "${TARGS[@]}" --resume "$T/ppio4/step-000002" --out_dir "$T/ppio-r1" >>"$T/out" 2>&1 || rc=$?
if [ $rc -eq 0 ] && same_run "$T/ppio4" "$T/ppif4" \
    && cmp -s "$T/ppio4/step-000002/model.safetensors" "$T/ppif4/step-000002/model.safetensors" \
    && cmp -s "$T/ppio-r1/final/model.safetensors" "$T/ppif-r1/final/model.safetensors" \
    && grep -q "host tier (offload) PARAMS  *394.50 KiB" "$T/out"; then
    ok "ppo_cli_np4_pp2_interleaved_fsdp_cpu_offload (the device-resident grid's bytes; resumed in one process)"
else
    bad "ppo_cli_np4_pp2_interleaved_fsdp_cpu_offload" "exit $rc"
fi
# tensor parallelism inside the interleaved schedule (TP 2 x PP 2 x 2 chunks at 4 ranks: each chunk its slice of its
# virtual stage, their blocks' sums over the group, one clipping norm over every chunk): one process's losses (tp-one)
# within 1e-6 relative (tests/test_tp_train.c tpi_train_*), its final files; the step-2 checkpoint (each chunk gathered
# over the group, then the virtual stages) resumes in one process
timeout 300 mpirun -np 4 "$FL" finetune_full "${TARGS[@]}" --devices 4 --tensor_parallel 2 --pipeline_parallel 2 \
    --pipeline_schedule interleaved --pipeline_chunks 2 --out_dir "$T/ppit4" >"$T/out" 2>&1; rc=$?
timeout 300 "$FL" finetune_full "${TARGS[@]}" --resume "$T/ppit4/step-000002" --out_dir "$T/ppit-r1" >>"$T/out" 2>&1 || rc=$?
ppi_check ppi_cli_np4_tp2_pp2 "$T/ppit4" "$T/tp-one" "$T/ppit-r1"
# T5's chunks run TP inside the interleaved schedule too: tests/mpi_t5_test.sh t5_ppi_np4_tp2_pp2 (one process's losses,
# checkpoints resumed across grids; tests/test_tp_t5_train.c tpi_t5_train_*)
# --offload_update_overlap on the stages (issue 35): PP 2 under fsdp_cpu_offload without clipping (which the switch
# needs): each stage's units' host updates on its fetch worker beside the rest of the schedule log the losses and
# write the final weights of the same run with the switch off, byte for byte (tests/test_pp_offload.c
# pp_offload_update_overlap_keeps_the_bits), and the run's end counts the units' updates that ran there per stage
rc=0
timeout 300 mpirun -np 2 "$FL" finetune_full "${TARGS[@]}" --devices 2 --pipeline_parallel 2 --strategy fsdp_cpu_offload \
    --train.max_norm 0 --offload_update_overlap false --out_dir "$T/ppu-off" >"$T/out" 2>&1 || rc=$?
grep -q "^update overlap:" "$T/out" && rc=9
timeout 300 mpirun -np 2 "$FL" finetune_full "${TARGS[@]}" --devices 2 --pipeline_parallel 2 --strategy fsdp_cpu_offload \
    --train.max_norm 0 --out_dir "$T/ppu-on" >"$T/out" 2>&1 || rc=$?
if [ $rc -eq 0 ] && same_run "$T/ppu-on" "$T/ppu-off" \
    && grep -Eq "^update overlap: .* per stage: [0-9]+ / [0-9]+ / [1-9][0-9]* [0-9]+ / [0-9]+ / [1-9]" "$T/out"; then
    ok "ppu_cli_np2_pp2_update_overlap_same_bytes (per stage, units' updates done at the schedule's end / at the wait / queued: $(sed -n 's/^update overlap: .*per stage: //p' "$T/out"))"
else
    bad "ppu_cli_np2_pp2_update_overlap_same_bytes" "exit $rc"
fi

echo
echo "MPI tests: $pass passed, $fail failed, $skip skipped"
[ $fail -eq 0 ]
