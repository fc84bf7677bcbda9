#!/usr/bin/env bash
# T5's attention (a learned relative position bias, dropout on the weights) on the fa2 kernels' EX path
# (kernels/attn_fa2.cu; tests/cli_test.sh t5_fa2_bias_dropout_emu): a bf16-true fine-tune of a T5 with head size 64
# and dropout_rate 0.1, 4 steps of 2 micro-batches, on the CPU backend, on cuda-emu (the fa2 kernels) and on cuda-emu with
# FITLLM_CUDA_ATTN=fp32 (the fp32 kernels). Passes when every run logs 8 finite losses, the fa2 run's differ from the
# fp32 kernels' (so the EX kernels ran), and both stay within 2^-8 relative of the CPU's at every step (bf16's
# rounding of the stored activations: the precision's own limit). The kernels themselves are checked against float64
# with the dropout mask in tests/test_cuda_attn.c (cuda_attn_fa2).
# usage: t5_fa2_emu_test.sh FITLLM FITLLM_EMU OUT_DIR
set -u
fitllm=$1 emu=$2 out=$3
mkdir -p "$out/m"
cp tests/fixtures/t5-tok/spiece.model tests/fixtures/t5-tok/tokenizer.json tests/fixtures/t5-tok/tokenizer_config.json "$out/m/"
sed -e 's/"vocab_size": 97/"vocab_size": 500/' -e 's/"d_model": 36/"d_model": 128/' -e 's/"d_kv": 10/"d_kv": 64/' \
    -e 's/"num_heads": 3/"num_heads": 2/' -e 's/"dropout_rate": 0.0/"dropout_rate": 0.1/' \
    tests/fixtures/t5-tiny-gated/config.json > "$out/m/config.json"
grep -q '"d_kv": 64' "$out/m/config.json" && grep -q '"dropout_rate": 0.1' "$out/m/config.json" ||
    { echo "the fixture's config did not take the edits"; exit 1; }
args=(--checkpoint_dir "$out/m" --init random --data JSON --data.json_path tests/fixtures/t5-pairs/pairs.json
      --train.max_steps 4 --train.epochs 100 --train.global_batch_size 4 --train.micro_batch_size 2
      --train.log_interval 1 --optimizer.lr 3e-3 --train.lr_warmup_steps 1 --train.save_interval 100
      --precision bf16-true)
run() { # NAME BINARY [ENV...]
    local name=$1 bin=$2; shift 2
    if ! env "$@" "$bin" finetune_full "${args[@]}" --out_dir "$out/$name" > "$out/$name.log" 2>&1; then
        echo "$name: the run failed"; tail -3 "$out/$name.log"; exit 1
    fi
    awk -F, 'NR > 1 && $4 != "" { print $4 }' "$out/$name/logs/metrics.csv" > "$out/$name.loss"
}
run cpu "$fitllm"
run fa2 "$emu" FITLLM_BACKEND=cuda-emu
run f32 "$emu" FITLLM_BACKEND=cuda-emu FITLLM_CUDA_ATTN=fp32
grep -q "dropout_rate 0.1 is applied in training" "$out/fa2.log" || { echo "dropout was not applied"; exit 1; }
paste "$out/cpu.loss" "$out/fa2.loss" "$out/f32.loss" | awk '
    { n++
      d = $2 - $1; e = $3 - $1; if (d < 0) d = -d; if (e < 0) e = -e
      if (!(d <= $1 / 256 && e <= $1 / 256) || $1 != $1 + 0) { printf "step %d: cpu %s fa2 %s fp32 kernels %s\n", n, $1, $2, $3; bad = 1 }
      if ($2 != $3) differ = 1
      if (d > w) w = d }
    END { if (n < 8 || bad || !differ) { printf "micro-batches %d, fa2 and fp32 kernels differ: %d\n", n, differ; exit 1 }
          printf "t5 fa2 ok: %d micro-batches, worst |fa2 - cpu| %.3g, loss %s -> %s\n", n, w, first, $1 }
    NR == 1 { first = $1 }'
