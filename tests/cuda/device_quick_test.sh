#!/usr/bin/env bash
# tests/cuda/device_quick.sh's plumbing on a CPU, with stand-ins for the packed fitllm, nvidia-smi and python3 (the
# script itself only ever runs on a lent GPU, a few minutes in a session that may never come):
#   tests/cuda/device_quick_test.sh WORKDIR      prints "device_quick plumbing ok" and exits 0, else what failed
# Cases: (1) cuDNN refusing a graph triggers step 2c, whose two debug logs come back xz-compressed; (2) the small
# preset's CPU / GPU comparison passes on equal losses, (3) fails on a NaN GPU loss, (4) fails when a side wrote no
# losses (not a vacuous pass), (5) without a refusal there is no step 2c, (6) step 7c times Flan-T5-base with
# --dropout on the default kernels, then with FITLLM_CUDA_ATTN=fp32; (7) step 6 / 6b run QLoRA with the profile,
# FITLLM_CUDA_Q4_STACK unset then 0; (8) step 5b runs the full step with FITLLM_CUDA_CUDNN_B16=0 and the profile.
set -u
W=${1:?usage: device_quick_test.sh WORKDIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$W" && mkdir -p "$W/repo/tests/cuda" "$W/repo/bench" "$W/repo/.gpupack/bin" "$W/shim" || exit 1
cp "$ROOT/tests/cuda/device_quick.sh" "$ROOT/tests/cuda/gpupack_env.sh" "$W/repo/tests/cuda/"
cp "$ROOT/bench/sdpa_torch.py" "$W/repo/bench/"
# the packed fitllm: FAKE_REFUSE=1 says cuDNN refused; FAKE_LOSS (default 5.5) is every step's GPU loss, FAKE_NOLOG=1
# writes no metrics; a debug log where CUDNN_LOGDEST_DBG names one
cat >"$W/repo/.gpupack/bin/fitllm" <<'EOF'
#!/usr/bin/env bash
[ -n "${CUDNN_LOGDEST_DBG:-}" ] && for i in $(seq 1 500); do echo "I! CuDNN (v91900) node $i"; done >"$CUDNN_LOGDEST_DBG"
[ "${FAKE_REFUSE:-0}" = 1 ] && echo "fitllm: cuda backend: cuDNN attention forward graph refused (stand-in): the own kernels" >&2
case "$1" in
--version) echo "fitllm stand-in"; echo "cudnn: 9.19" ;;
finetune_full)
    out= acc=
    while [ $# -gt 0 ]; do case "$1" in --out_dir) out=$2; shift ;; --accelerator) acc=$2; shift ;; esac; shift; done
    [ "${FAKE_NOLOG:-0}" = 1 ] && exit 0
    mkdir -p "$out/logs" && echo "iter,step,epoch,loss" >"$out/logs/metrics.csv"
    loss=5.5; [ "$acc" = cuda ] && loss=${FAKE_LOSS:-5.5}
    for i in 1 2 3 4 5 6 7 8; do echo "$i,$i,0,$loss" >>"$out/logs/metrics.csv"; done ;;
*) echo "median 1.0 ms/step"; echo "attention kernels ${FITLLM_CUDA_ATTN:-auto}: $*"
   echo "q4 stack ${FITLLM_CUDA_Q4_STACK:-1}"; echo "cudnn b16 ${FITLLM_CUDA_CUDNN_B16:-1}" ;;
esac
exit 0
EOF
printf '#!/usr/bin/env bash\n[ -n "${CUDNN_LOGDEST_DBG:-}" ] && echo "torch graph" >"$CUDNN_LOGDEST_DBG"\necho "python3 $*"\nexit 0\n' >"$W/shim/python3"
printf '#!/usr/bin/env bash\necho "stand-in GPU, 0, 1 MiB"\n' >"$W/shim/nvidia-smi"
chmod +x "$W/repo/.gpupack/bin/fitllm" "$W/shim/python3" "$W/shim/nvidia-smi"
quick() { # OUT-NAME env...: the script's summary
    (cd "$W/repo" && env PATH="$W/shim:$PATH" OUT="$W/$1" "${@:2}" bash tests/cuda/device_quick.sh 120 2>&1)
}
bad=0
no() { echo "FAIL: $*"; bad=1; }
s=$(quick o1 FAKE_REFUSE=1)
grep -q "^== 2c\." <<<"$s" || no "a refusal ran no step 2c"
for f in cudnn-ours cudnn-torch; do
    [ -s "$W/o1/$f.txt.xz" ] && xz -dc "$W/o1/$f.txt.xz" | grep -qE "CuDNN|torch graph" || no "no $f.txt.xz with the log"
    [ -e "$W/o1/$f.txt" ] && no "$f.txt left uncompressed"
done
grep -q "^ok   small-bf16: max relative loss difference 0.00e+00" <<<"$s" || no "equal losses did not pass"
grep -q "^attention kernels auto: bench-step flan-t5-base .*--dropout" "$W/o1/t5.log" 2>/dev/null || no "step 7c: no t5 run"
grep -q "^attention kernels fp32: bench-step flan-t5-base .*--dropout" "$W/o1/t5fp32.log" 2>/dev/null ||
    no "step 7c: no FITLLM_CUDA_ATTN=fp32 run"
grep -q "^python3 bench/bench_t5_torch.py --device cuda --dtype bf16 --dropout 0.1 --shape flan-t5-base" "$W/o1/t5torch.log" \
    2>/dev/null || no "step 7c: no PyTorch T5 run"
for n in qlora:1 qlora-parts:0; do # step 6 / 6b: QLoRA with the profile, stacked then a GEMM a part
    grep -q "^attention kernels auto: bench-step tinyllama-1.1b .*--quantize bnb.nf4 --profile" "$W/o1/${n%:*}.log" \
        2>/dev/null && grep -q "^q4 stack ${n#*:}$" "$W/o1/${n%:*}.log" || no "step 6: no ${n%:*} run (FITLLM_CUDA_Q4_STACK=${n#*:})"
done
grep -q "^attention kernels auto: bench-step tinyllama-1.1b .*--profile" "$W/o1/f32grads.log" 2>/dev/null &&
    grep -q "^cudnn b16 0$" "$W/o1/f32grads.log" || no "step 5b: no FITLLM_CUDA_CUDNN_B16=0 run with the profile"
s=$(quick o2 FAKE_LOSS=nan)
grep -q "^== 2c\." <<<"$s" && no "step 2c without a refusal"
grep -q "^FAIL small-bf16: max relative loss difference nan" <<<"$s" || no "a NaN GPU loss did not fail"
s=$(quick o3 FAKE_NOLOG=1)
grep -q "^FAIL small-bf16: cuda wrote no 8 steps' losses" <<<"$s" || no "missing losses did not fail"
grep -q "^ok   small-bf16" <<<"$s" && no "missing losses passed"
[ $bad = 0 ] && echo "device_quick plumbing ok"
exit $bad
