#!/usr/bin/env python3
"""Greedy generation reference for stories260K (HF layout) -> tests/fixtures/stories260K-generate.json.

Run from the repo root:
    /work/venv/bin/python tests/ref/generate_ref.py [--model ../shared/data/stories260K-hf] \
        [--out tests/fixtures/stories260K-generate.json]

Two greedy runs with transformers (do_sample=False, float32, eager attention):
  1. from BOS alone, 200 new tokens: llama2.c's `run stories260K.bin -z tok512.bin -t 0.0 -n 200`
     (200 steps: BOS at position 0, 200 tokens sampled). Its output text is pinned by llama2.c's test_all.py
     (`expected_stdout`, repository karpathy/llama2.c); this script checks that the HF
     decode of the greedy ids equals it, so the fixture ties fitllm to both references.
  2. from "Once upon a time" (BOS + tokenizer ids), 50 new tokens.
"""
import argparse
import json

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

LLAMA2C_EXPECTED = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do. "
    "She said, \"I want to play with your ball, but I can't find it.\"\n"
    "Lily was sad and didn't know what to do. She said, \"I'm sorry, Lily. I didn't know what to do.\"\n"
    "Lily didn't want to help her mom, so she"
)


def greedy(model, ids, n):
    x = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        y = model.generate(x, max_new_tokens=n, do_sample=False, num_beams=1, eos_token_id=None,
                           pad_token_id=0, attention_mask=torch.ones_like(x))
    return y[0].tolist()[len(ids):]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="../shared/data/stories260K-hf")
    ap.add_argument("--out", default="tests/fixtures/stories260K-generate.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    bos_new = greedy(model, [1], 200)
    bos_text = tok.decode(bos_new, skip_special_tokens=True)
    assert bos_text == LLAMA2C_EXPECTED, f"HF greedy text differs from llama2.c's:\n{bos_text!r}"
    prompt = "Once upon a time"
    p_ids = tok(prompt, add_special_tokens=True)["input_ids"]
    assert p_ids[0] == 1
    p_new = greedy(model, p_ids, 50)
    out = {
        "bos_prompt": [1],
        "bos_new_tokens": bos_new,
        "bos_text": bos_text,
        "llama2c_expected_text": LLAMA2C_EXPECTED,
        "prompt": prompt,
        "prompt_ids": p_ids,
        "prompt_new_tokens": p_new,
        "prompt_text": tok.decode(p_ids + p_new, skip_special_tokens=True),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "note": "greedy (do_sample=False), no EOS stop; bos run = llama2.c run.c -t 0.0 -n 200",
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(bos_new)} + {len(p_new)} tokens")


if __name__ == "__main__":
    main()
