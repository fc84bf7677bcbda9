#!/usr/bin/env python3
"""Reference forward of the real tiny HF GPT-2 checkpoint in ../shared/data/tiny-gpt2-hf.

Run from the repo root:
    /work/venv/bin/python tests/ref/tiny_gpt2_ref.py [--model ../shared/data/tiny-gpt2-hf] \
        [--out tests/fixtures/tiny-gpt2-ref.json]
"""
import argparse
import os
import sys

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import pick_tokens, reference  # noqa: E402

TEXT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="../shared/data/tiny-gpt2-hf")
    ap.add_argument("--out", default="tests/fixtures/tiny-gpt2-ref.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel.from_pretrained(args.model, dtype=torch.float32,
                                            attn_implementation="eager")
    V = model.config.vocab_size
    tokens = pick_tokens(args.model, TEXT, 16, vocab_limit=V)
    reference(model, tokens, args.out, {
        "model": "tiny-gpt2-hf", "text": TEXT,
        "note": "loss = mean CE of logits[0..14] vs tokens[1..15]; eval mode (dropout off)",
    })


if __name__ == "__main__":
    main()
