#!/usr/bin/env python3
"""Reference forward of stories260K (HF layout) in ../shared/data/stories260K-hf.

Run from the repo root:
    /work/venv/bin/python tests/ref/stories_ref.py [--model ../shared/data/stories260K-hf] \
        [--out tests/fixtures/stories260K-ref.json]
"""
import argparse
import os
import sys

import torch
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import pick_tokens, reference  # noqa: E402

TEXT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="../shared/data/stories260K-hf")
    ap.add_argument("--out", default="tests/fixtures/stories260K-ref.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                             attn_implementation="eager")
    V = model.config.vocab_size
    tokens = pick_tokens(args.model, TEXT, 16, bos=1, vocab_limit=V)
    reference(model, tokens, args.out, {
        "model": "stories260K-hf", "text": TEXT,
        "note": "tokens[0] is BOS=1; loss = mean CE of logits[0..14] vs tokens[1..15]",
    })


if __name__ == "__main__":
    main()
