#!/usr/bin/env bash
# Issue 33's GPU runs (Verify: "whenever a GPU is available"), in one command of under 9 minutes (the device's
# time is short: run this, nothing else). Prepared here with tools/gpu_pack.sh; on the device, from the
# repository root, with .gpupack carried:
#   tests/cuda/lab_session.sh [bin-dir]      (default .gpupack/bin; or a CUDA build folder with fitllm)
# Writes to $OUT (default /tmp/fitllm-lab-out; the device tool brings that folder back):
#   env.txt                the GPU, driver, fitllm --version
#   plan/                  lab --scale real --suite full --plan-only --peer pytorch: every row's plan, the course's
#                          table and PyTorch's modelled figures (< 2 s, needs no GPU: the reference the runs meet)
#   quick/ quick.log       lab --scale real --suite quick --accelerator cuda --peer pytorch: the real-scale quick
#                          suite at the course's settings, timed (the issue's target: < 3 minutes on one H100/H200;
#                          rows.txt: each row's wall seconds, longest first: which rows dominate)
#   fsdp/ fsdp.log         lab --scale real --suite fsdp --accelerator cuda: the course's GPT-2-XL FSDP benchmark at
#                          its own settings (T 128, 16 GiB per rank; the 4 ranks share the one GPU through the staged
#                          communicator: say so beside the tables), 16-mixed and 32-true, with and without
#                          checkpointing
#   blip2/ blip2.log       lab --scale real --suite blip2 --accelerator cuda --peer pytorch: the course's BLIP-2
#                          image-caption sequence at the real shapes (blip2-opt-2.7b, -6.7b, Flan-T5-XXL; 80 GB),
#                          3 steps per row that fits, each beside what PyTorch would need
# Then record the tables (quick/report.md, fsdp/report.md, blip2/report.md) in docs/BENCHMARKS.md beside the
# course's numbers. Each step has its own timeout so one hang cannot eat the lease (at most 9 minutes in all).
# The plumbing is tested without a GPU (tests/cli_test.sh lab_session_plumbing): LAB_ACCEL=cpu (default cuda) and
# LAB_EXTRA=--plan-only (default none: extra arguments to every lab run) make every step a plan of seconds.
set -u
BIN=${1:-.gpupack/bin}
OUT=${OUT:-/tmp/fitllm-lab-out}
ACCEL=${LAB_ACCEL:-cuda}
EXTRA=${LAB_EXTRA:-}
mkdir -p "$OUT"
F=$BIN/fitllm
[ -x "$F" ] || { echo "lab_session: $F missing (tools/gpu_pack.sh here first, or name a CUDA build folder)"; exit 1; }
if [ -f .gpupack/libs.tar.xz ] && [ "$BIN" = .gpupack/bin ]; then # the pack's libraries the machine lacks
    LIB=$(mktemp -d /tmp/fitllm-libs-XXXXXX)
    tar -xJf .gpupack/libs.tar.xz -C "$LIB"
    for f in "$LIB"/*; do if ldconfig -p | grep -q "/$(basename "$f")\$"; then rm -f "$f"; fi; done
    export LD_LIBRARY_PATH="$LIB:/usr/local/cuda/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  "$F" --version; } | tee "$OUT/env.txt"

echo "== 1. the plans (no GPU needed): full suite at the real scale, --plan-only --peer pytorch"
timeout 30 "$F" lab --scale real --suite full --plan-only --peer pytorch --accelerator "$ACCEL" --out_dir "$OUT/plan" \
    >"$OUT/plan.log" 2>&1
echo "plan exit $?" | tee -a "$OUT/plan.log"

echo "== 2. the real-scale quick suite on the GPU (target: < 180 s)"
s=$(date +%s)
timeout 230 "$F" lab --scale real --suite quick --accelerator "$ACCEL" --peer pytorch $EXTRA --out_dir "$OUT/quick" \
    >"$OUT/quick.log" 2>&1
rc=$?
echo "quick exit $rc, $(( $(date +%s) - s )) s wall (target < 180 s)" | tee -a "$OUT/quick.log"
sed -n '/^experiment /,/^(MiB/p' "$OUT/quick.log"
if [ -f "$OUT/quick/results.json" ]; then # which rows dominate
    python3 - "$OUT/quick/results.json" >"$OUT/rows.txt" <<'EOF' || true
import json, sys
rows = json.load(open(sys.argv[1]))["experiments"]
for r in sorted(rows, key=lambda r: -r["wall_s"]):
    print(f'{r["name"]:18} {r["wall_s"]:7.1f} s  {r["verdict"]:5} ran={r["ran"]}')
EOF
    head -6 "$OUT/rows.txt"
fi

echo "== 3. the FSDP benchmark at its own settings (4 ranks share this GPU through the staged communicator)"
timeout 170 "$F" lab --scale real --suite fsdp --accelerator "$ACCEL" --peer pytorch $EXTRA --out_dir "$OUT/fsdp" \
    >"$OUT/fsdp.log" 2>&1
echo "fsdp exit $?" | tee -a "$OUT/fsdp.log"
grep -E "batch-size sweep|^ +[0-9]+\*? " "$OUT/fsdp.log" | head -40

echo "== 4. the course's BLIP-2 sequence at the real shapes (80 GB; 3 steps per row that fits)"
s=$(date +%s)
timeout 110 "$F" lab --scale real --suite blip2 --accelerator "$ACCEL" --peer pytorch $EXTRA --out_dir "$OUT/blip2" \
    >"$OUT/blip2.log" 2>&1
echo "blip2 exit $?, $(( $(date +%s) - s )) s wall" | tee -a "$OUT/blip2.log"
sed -n '/^experiment /,/^(MiB/p' "$OUT/blip2.log"
echo "lab_session: logs in $OUT"
