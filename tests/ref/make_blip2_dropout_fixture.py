#!/usr/bin/env python3
"""The dropout reference of BLIP-2's Flan-T5 language model for fitllm (tests/test_blip2.c
`blip2_t5_dropout_vs_transformers`): transformers' Blip2ForConditionalGeneration (tests/fixtures/blip2-tiny-t5) in
training mode with its T5's nn.Dropout modules and attention-weight dropout replaced by fitllm's masks, exactly as
tests/ref/make_t5_dropout_fixture.py does for T5 alone (its install(), the same seed S and p): so the places where
transformers drops inside BLIP-2's language model (after the encoder's embeddings, which hold the projected queries in
the placeholders' rows, after each sublayer, inside the FFN, after each final norm, on the attention weights) and
fitllm's are checked to be the same, with the same masks, together with every gradient of the image parts through
them. The vision tower and the Q-Former keep their own dropout at 0 (the fixture's config; fitllm applies none there).

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0, numpy 2.4.6.
Run from the repo root (after make_blip2_fixture.py):
    python tests/ref/make_blip2_dropout_fixture.py [--fixture tests/fixtures/blip2-tiny-t5]

Writes expected-dropout.safetensors there: loss (F64 [1]: the float64 run), grad.<name> (F32: the float64 gradients of
the mean loss, every parameter), noise.loss / noise.<name> (F32 [1]: max |PyTorch fp32 - float64|), seed (I64 [1]:
the micro-batch seed S), p (F32 [1]).
"""
import argparse
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import Blip2ForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_t5_dropout_fixture as t5d  # noqa: E402  (install(), SEED, P, save(): the T5 dropout reference's)

ORIG_DROPOUT = torch.nn.functional.dropout


def any_dropout(x, p=0.5, training=False, inplace=False):
    """inside a T5Attention: fitllm's mask (t5d); elsewhere (the vision tower, the Q-Former: p 0) torch's own"""
    return t5d.attn_dropout(x, p, training, inplace) if t5d.CUR else ORIG_DROPOUT(x, p, training, inplace)


def run(d, batch, dtype):
    m = Blip2ForConditionalGeneration.from_pretrained(d, attn_implementation="eager").to(dtype)
    lm = m.language_model
    for mod in lm.modules():  # the attention's p (the eager function passes it to the patched dropout)
        if hasattr(mod, "has_relative_attention_bias"):
            mod.dropout = t5d.P
    t5d.install(lm)
    torch.nn.functional.dropout = any_dropout
    m.train()
    pixels, ids, labels = batch
    out = m(pixel_values=pixels.to(dtype), input_ids=ids.long(), labels=labels.long())
    out.loss.backward()
    torch.nn.functional.dropout = ORIG_DROPOUT
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def make(run_fn, default):
    """--fixture (default) 's expected-dropout.safetensors from run_fn(dir, batch, dtype) on its expected.safetensors
    batch (also tests/ref/make_blip2_opt_dropout_fixture.py's)"""
    a = argparse.ArgumentParser()
    a.add_argument("--fixture", default=default)
    d = a.parse_args().fixture
    x = load_file(os.path.join(d, "expected.safetensors"))
    batch = (x["pixels"], x["ids"], x["labels"])
    t5d.save(d, run_fn(d, batch, torch.float32), run_fn(d, batch, torch.float64), x["loss"])


def main():
    make(run, "tests/fixtures/blip2-tiny-t5")


if __name__ == "__main__":
    main()
