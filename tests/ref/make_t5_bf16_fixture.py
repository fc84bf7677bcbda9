#!/usr/bin/env python3
"""bf16 / fp16 reference noise for fitllm's T5 under --precision bf16-mixed / 16-mixed (tests/test_t5_prec.c
t5_*_mixed_vs_autocast).

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0. Run from the repo
root after make_t5_fixture.py (same models, same batch):
    python tests/ref/make_t5_bf16_fixture.py [--out tests/fixtures] [--dtype bfloat16|float16]

For each tiny T5 (t5-tiny-relu, t5-tiny-gated) the fp32 model runs forward and backward under PyTorch's CPU
autocast to bfloat16 (the matmuls read bf16 operands, as fitllm's bf16-mixed reads its bf16 weight copy and
rounds the activations it multiplies) and is compared with the float64 run of make_t5_fixture.py. Writes
expected-bf16.safetensors next to expected.safetensors:
  noise_bf16.logits (F32 [1]): max |autocast logits - float64 logits|
  noise_bf16.loss   (F32 [1]): |autocast loss - float64 loss|
  noise_bf16.grad_l2 (F32 [1]): ||autocast gradients - float64 gradients||_2 over every parameter
--dtype float16 (16-mixed) writes expected-fp16.safetensors with noise_fp16.* the same way (autocast to float16 on
the CPU; no GradScaler: the tiny models' gradients are far from fp16's underflow).
PyTorch's own bf16 / fp16 error is the yardstick the C test holds fitllm's to (autocast also rounds the matmuls' outputs
to bf16, which fitllm keeps in fp32, so fitllm's error is expected below it).
"""
import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_t5_fixture import build, params, run  # noqa: E402


def make(out_dir, gated, seed, dtype):
    _, m = build(gated, seed)
    x = load_file(os.path.join(out_dir, "expected.safetensors"))
    batch = (x["src"], x["src_mask"], x["dec"], x["labels"])
    state = {n: p.detach().clone() for n, p in m.state_dict().items()}
    l64, s64, g64 = run(m, batch, torch.float64)
    m.float().load_state_dict(state)
    m.zero_grad()
    src, mask, dec, labels = batch
    with torch.autocast("cpu", dtype=dtype):
        out = m(input_ids=src.long(), attention_mask=mask.long(), decoder_input_ids=dec.long(), labels=labels.long())
    out.loss.backward()
    lb, sb = out.logits.detach().float(), out.loss.detach().float()
    gb = {n: p.grad.detach().clone() for n, p in params(m)}
    assert (l64.float() - x["logits"]).abs().max().item() == 0.0, "not make_t5_fixture.py's model"
    el = (lb.double() - l64).abs().max()
    es = (sb.double() - s64).abs()
    eg = torch.sqrt(sum(((gb[n].double() - g64[n]) ** 2).sum() for n in g64))
    gn = torch.sqrt(sum((g64[n] ** 2).sum() for n in g64))
    tag = "bf16" if dtype == torch.bfloat16 else "fp16"
    out = {f"noise_{tag}.logits": el.float().reshape(1), f"noise_{tag}.loss": es.float().reshape(1),
           f"noise_{tag}.grad_l2": eg.float().reshape(1)}
    save_file(out, os.path.join(out_dir, f"expected-{tag}.safetensors"))
    print(f"{out_dir}: autocast {tag} logits error {el.item():.3g} (scale {l64.abs().max().item():.3g}), loss error "
          f"{es.item():.3g}, gradient error {eg.item():.3g} (||g|| {gn.item():.3g})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    make(os.path.join(a.out, "t5-tiny-relu"), gated=False, seed=0, dtype=dt)
    make(os.path.join(a.out, "t5-tiny-gated"), gated=True, seed=10, dtype=dt)


if __name__ == "__main__":
    main()
