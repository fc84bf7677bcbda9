"""Check that a folder written by fitllm (a checkpoint's final/ or step-*/) loads in
transformers unchanged and gives the same loss as fitllm on the same tokens.

    /work/venv/bin/python tests/ref/check_hf_folder.py out/cpu/stories260k-synthetic/final \
        --ids "1 403 407 261 378 434 2 9 19 5" --fitllm ./build/fitllm

Prints transformers' loss and fitllm's (`fitllm loss`), and exits 1 if they differ by more
than 1e-5 relative. Not part of `make test` (needs the reference stack).
"""
import argparse
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--ids", default="1 403 407 261 378 434 2 9 19 5")
    ap.add_argument("--fitllm", default="./build/fitllm")
    a = ap.parse_args()
    ids = [int(x) for x in a.ids.split()]
    model = AutoModelForCausalLM.from_pretrained(a.folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        logits = model(x).logits[0, :-1]
        ref = torch.nn.functional.cross_entropy(logits, x[0, 1:]).item()
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(a.ids)
        f.flush()
        out = subprocess.run([a.fitllm, "loss", a.folder, "--tokens-file", f.name], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr)
        sys.exit(1)
    ours = float(out.stdout.split()[1])
    print(f"transformers loss {ref:.7f}  fitllm loss {ours:.7f}  ({type(model).__name__} loaded from {a.folder})")
    sys.exit(0 if abs(ours - ref) <= 1e-5 * abs(ref) else 1)


if __name__ == "__main__":
    main()
