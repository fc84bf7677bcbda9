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
from safetensors.torch import load_file, save_file
from transformers import Blip2ForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_t5_dropout_fixture as t5d  # noqa: E402  (install(), SEED, P: the T5 dropout reference's masks)

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


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--fixture", default="tests/fixtures/blip2-tiny-t5")
    d = a.parse_args().fixture
    x = load_file(os.path.join(d, "expected.safetensors"))
    batch = (x["pixels"], x["ids"], x["labels"])
    s32, g32 = run(d, batch, torch.float32)
    s64, g64 = run(d, batch, torch.float64)
    noise = lambda u, v: (u.double() - v).abs().max().float().reshape(1)
    out = {"loss": s64.reshape(1), "noise.loss": noise(s32, s64), "seed": torch.tensor([t5d.SEED], dtype=torch.int64),
           "p": torch.tensor([t5d.P], dtype=torch.float32)}
    for n in g64:
        out["grad." + n] = g64[n].float().contiguous()
        out["noise." + n] = noise(g32[n], g64[n])
    save_file(out, os.path.join(d, "expected-dropout.safetensors"))
    print(f"{d}: loss with dropout {s64.item():.8f} (without: {x['loss'].item():.8f}), fp32 noise "
          f"{noise(s32, s64).item():.3g}, {len(g64)} gradients, worst grad noise "
          f"{max(noise(g32[n], g64[n]).item() for n in g64):.3g}")


if __name__ == "__main__":
    main()
