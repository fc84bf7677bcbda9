#!/usr/bin/env python3
"""Fixture for fitllm's BERT encoder (src/model/arch_bert.c, tests/test_bert.c): a tiny random
transformers BertModel (no pooler) saved as an HF folder, and what fitllm must reproduce.

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0,
numpy 2.4.6. Run from the repo root:
    python tests/ref/make_bert_fixture.py [--out tests/fixtures/bert-tiny]

Writes config.json + model.safetensors (save_pretrained, fp32 weights) and expected.safetensors:
  ids, type_ids (I32, B x T), mask (U8, B x T: the second sequence's last 4 keys padded), R (F32,
  B x T x C: the loss is sum(hidden * R)),
  hidden (F32: last_hidden_state computed in float64 from the same fp32 weights, then rounded),
  grad.<name> (float64 gradients of the loss, rounded to fp32), and noise.hidden, noise.<name> (F32 [1]:
  max |PyTorch fp32 - float64| of the same tensor: the fp32 noise the C test anchors its tolerance on).
hidden_act is "gelu_new" (the tanh GELU fitllm has; BERT's "gelu" is the erf one). Weights are
redrawn larger than BertModel's init (std 0.02 would leave attention near uniform and the test weak).
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertModel

B, T = 2, 13
PAD = 4  # padded keys at the end of sequence 1


def build(seed=0):
    cfg = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=37, max_position_embeddings=64, type_vocab_size=2,
                     hidden_act="gelu_new", layer_norm_eps=1e-12, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = BertModel(cfg, add_pooling_layer=False).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.2 * r)
            elif name.endswith("bias"):
                p.copy_(0.2 * r)
            elif "embeddings" in name:
                p.copy_(0.7 * r)
            else:  # (out, in) linears: unit-ish activations
                p.copy_(r / p.shape[1] ** 0.5)
    return cfg, m


def run(m, ids, types, mask, R, dtype):
    m = m.to(dtype)
    m.zero_grad()
    h = m(input_ids=ids.long(), token_type_ids=types.long(), attention_mask=mask.long()).last_hidden_state
    (h * R.to(dtype)).sum().backward()
    return h.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/bert-tiny")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cfg, m = build()
    m.save_pretrained(a.out, safe_serialization=True)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g, dtype=torch.int32)
    types = torch.randint(0, 2, (B, T), generator=g, dtype=torch.int32)
    mask = torch.ones(B, T, dtype=torch.uint8)
    mask[1, T - PAD:] = 0
    R = torch.randn(B, T, cfg.hidden_size, generator=g)
    h32, g32 = run(m, ids, types, mask, R, torch.float32)
    h64, g64 = run(m, ids, types, mask, R, torch.float64)
    out = {"ids": ids, "type_ids": types, "mask": mask, "R": R.contiguous(), "hidden": h64.float().contiguous(),
           "noise.hidden": (h32.double() - h64).abs().max().float().reshape(1)}
    for n in g64:
        out["grad." + n] = g64[n].float().contiguous()
        out["noise." + n] = (g32[n].double() - g64[n]).abs().max().float().reshape(1)
    save_file(out, os.path.join(a.out, "expected.safetensors"))
    noise = (h32.double() - h64).abs().max().item()
    print(f"hidden: max |fp32 - fp64| {noise:.3g} (scale {h64.abs().max().item():.3g})")
    for n in g64:
        print(f"  {n}: fp32 noise {(g32[n].double() - g64[n]).abs().max().item():.3g}, "
              f"scale {g64[n].abs().max().item():.3g}")
    with open(os.path.join(a.out, "config.json")) as f:
        print("config:", json.load(f)["model_type"])


if __name__ == "__main__":
    main()
