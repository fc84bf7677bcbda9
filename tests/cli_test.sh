#!/usr/bin/env bash
# CLI-level checks: exit codes and messages for good and bad input, and that
# failures leave no partial output. Run by `make test` after the unit suite.
# Usage: tests/cli_test.sh [path/to/fitllm]
set -u
FITLLM=${1:-./build/fitllm}
DATA=${FITLLM_DATA:-../shared/data}
T=$(mktemp -d /tmp/fitllm-cli-XXXXXX)
trap 'rm -rf "$T"' EXIT
pass=0; fail=0; skip=0

# expect NAME WANT_RC PATTERN -- cmd...
expect() {
    local name=$1 want=$2 pat=$3; shift 4
    local out rc
    out=$("$@" 2>&1); rc=$?
    if [ "$rc" -ne "$want" ]; then
        echo "FAIL $name: exit $rc, want $want"; echo "$out" | tail -5 | sed 's/^/     /'; fail=$((fail+1)); return
    fi
    if [ -n "$pat" ] && ! grep -qE -- "$pat" <<<"$out"; then
        echo "FAIL $name: output lacks /$pat/"; echo "$out" | tail -5 | sed 's/^/     /'; fail=$((fail+1)); return
    fi
    echo "ok   $name"; pass=$((pass+1))
}

expect help 0 "commands:" -- "$FITLLM" --help
expect unknown_command 2 "unknown command" -- "$FITLLM" frobnicate
expect loss_missing_tokens_file 2 "missing --tokens-file" -- "$FITLLM" loss micro
expect loss_unreadable_tokens 1 "nope.txt: cannot open" -- "$FITLLM" loss micro --tokens-file "$T/nope.txt"
printf '1 2 x 4\n' > "$T/bad.txt"
expect loss_bad_token 1 "bad.txt: token 3" -- "$FITLLM" loss micro --tokens-file "$T/bad.txt"
printf '1 2 999999 4\n' > "$T/oov.txt"
expect loss_token_out_of_vocab 1 "outside the vocabulary" -- "$FITLLM" loss micro --tokens-file "$T/oov.txt"
expect loss_not_a_model 1 "neither a file, a folder nor a model preset" -- "$FITLLM" loss no-such-model --tokens-file "$T/oov.txt"
mkdir -p "$T/notmodel"
expect loss_folder_without_config 1 "config.json" -- "$FITLLM" loss "$T/notmodel" --tokens-file "$T/oov.txt"
printf '{"model_type": "bert", "hidden_size": 8}' > "$T/notmodel/config.json"
expect loss_unknown_architecture 1 "bert" -- "$FITLLM" loss "$T/notmodel" --tokens-file "$T/oov.txt"
expect bench_bad_option 2 "unknown option" -- "$FITLLM" bench-step micro --frobnicate 3
expect bench_bad_number 2 "not an integer" -- "$FITLLM" bench-step micro --micro-batch x
expect bench_oom_exit_3 3 "out of memory" -- "$FITLLM" bench-step tiny --micro-batch 2 --seq 64 --steps 1 --max-memory 64MB
expect bench_ok 0 "RESULT impl=fitllm" -- "$FITLLM" bench-step micro --micro-batch 2 --seq 32 --steps 2 --warmup 0

if [ -d "$DATA/stories260K-hf" ]; then
    printf '1 403 407 261 378 434 2 9 19 5\n' > "$T/ids.txt"
    expect loss_real_model 0 "loss [0-9.]+" -- "$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/ids.txt" --dump-logits "$T/logits.f32"
    sz=$(stat -c %s "$T/logits.f32" 2>/dev/null || echo 0)
    if [ "$sz" -eq $((9 * 512 * 4)) ]; then echo "ok   dump_logits_size"; pass=$((pass+1)); else echo "FAIL dump_logits_size: $sz bytes"; fail=$((fail+1)); fi
    expect loss_dump_unwritable 1 "cannot write logits" -- "$FITLLM" loss "$DATA/stories260K-hf" --tokens-file "$T/ids.txt" --dump-logits /proc/nope/x.f32
    # a truncated safetensors copy of a real model
    mkdir -p "$T/trunc"; cp "$DATA/stories260K-hf/config.json" "$T/trunc/"
    head -c 5000 "$DATA/stories260K-hf/model.safetensors" > "$T/trunc/model.safetensors"
    expect loss_truncated_safetensors 1 "model.safetensors" -- "$FITLLM" loss "$T/trunc" --tokens-file "$T/ids.txt"
else
    echo "skip real-model CLI checks: $DATA not found (set FITLLM_DATA)"; skip=$((skip+1))
fi

echo
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
