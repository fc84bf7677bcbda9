"""Check that a finetune_lora checkpoint (step-N/ or final/) is used by PEFT and transformers as
fitllm uses it, and that merge_lora's output is a complete HF folder:

    /work/venv/bin/python tests/ref/check_lora_outputs.py out/lora/step-000002 \
        --ids "1 403 407 261 378 434 2 9 19 5" --fitllm ./build/fitllm

1. the adapter (step-N/, or final/adapter) loads with PeftModel.from_pretrained on the base its
   adapter_config.json names (base_model_name_or_path, run from a directory other than the
   training's), and with transformers' AutoModelForCausalLM.from_pretrained(step-N/) (transformers
   loads the base and the adapter itself when it finds adapter_config.json);
2. `fitllm merge_lora <dir> --out_dir TMP` writes TMP, which AutoModelForCausalLM and
   AutoTokenizer load as they are;
3. the logits of PEFT (1.), of transformers on TMP and of `fitllm loss TMP --dump-logits` agree:
   max |diff| <= 1e-4 * max(1, max |logit|) (fp32 sums of a few hundred terms in different
   orders differ by ~1e-6 relative; 1e-4 leaves room and still catches a missing or wrong-scale
   adapter, whose effect after a few steps is ~1e-2 or more); and they differ from the base's by
   more than that (the adapter is not a no-op).
Exits 1 on any failure. Not part of `make test` (needs the reference stack).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--ids", default="1 403 407 261 378 434 2 9 19 5")
    ap.add_argument("--fitllm", default="./build/fitllm")
    a = ap.parse_args()
    fitllm = os.path.abspath(a.fitllm)
    ckpt = os.path.abspath(a.checkpoint)
    ids = [int(x) for x in a.ids.split()]
    adapter = ckpt if os.path.isfile(os.path.join(ckpt, "adapter_config.json")) else os.path.join(ckpt, "adapter")
    base = json.load(open(os.path.join(adapter, "adapter_config.json")))["base_model_name_or_path"]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # not the training's directory: the base must be found from here
        base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        lb = logits_of(base_model, ids)
        lp = logits_of(PeftModel.from_pretrained(base_model, adapter).eval(), ids)
        lt = logits_of(AutoModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval(), ids)
        merged = os.path.join(tmp, "merged")
        out = subprocess.run([fitllm, "merge_lora", ckpt, "--out_dir", merged], capture_output=True, text=True)
        print(out.stdout.strip())
        if out.returncode != 0:
            print(out.stderr)
            sys.exit(1)
        lm = logits_of(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval(), ids)
        tok = AutoTokenizer.from_pretrained(merged)
        print(f"tokenizer from {merged}: {type(tok).__name__}, 'Once upon' -> {tok('Once upon')['input_ids']}")
        with open("ids.txt", "w") as f:
            f.write(a.ids)
        out = subprocess.run([fitllm, "loss", merged, "--tokens-file", "ids.txt", "--dump-logits", "l.f32"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr)
            sys.exit(1)
        lf = np.fromfile("l.f32", dtype=np.float32).reshape(len(ids) - 1, -1)
    tol = 1e-4 * max(1.0, float(np.abs(lp).max()))
    V = lf.shape[1]
    checks = [
        ("transformers(adapter folder) vs PEFT", lt, lp),
        ("transformers(merged) vs PEFT", lm, lp),
        ("fitllm loss(merged) vs PEFT", lf, lp[:-1, :V]),
    ]
    for name, x, y in checks:
        d = float(np.abs(x[:, :V] - y[:, :V]).max())
        good = d <= tol
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {name}: max |diff| {d:.3g} (tolerance {tol:.3g})")
    d = float(np.abs(lp - lb).max())
    good = d > tol
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} the adapter changes the logits: max |diff| vs the base {d:.3g}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
