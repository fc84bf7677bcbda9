#!/usr/bin/env python3
"""bf16-mixed anchor for fitllm's BLIP-2 fine-tuning (tests/test_blip2_train.c blip2_bf16_mixed_vs_autocast): the
fixtures tests/fixtures/blip2-tiny-opt and blip2-tiny-t5 (tests/ref/make_blip2_fixture.py) run by transformers under
PyTorch's CPU autocast to bfloat16 (fp32 master weights, bf16 matmul operands), as Lightning's bf16-mixed does.

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0.
Run from the repo root:
    python tests/ref/make_blip2_bf16_fixture.py

Writes expected-bf16.safetensors into each fixture folder, for the batch of its expected.safetensors:
  logits (F32: under autocast), loss (F64 [1]: under autocast), loss5 (F64 [5]: the loss before each of 5 AdamW steps
  on the batch under autocast, lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, every parameter; fp32 master
  weights), loss5_f32 (F64 [5]: the same steps in fp32, no autocast), loss5_f64 (F64 [5]: in float64).
The OPT variant's loss is the caption's (logits[:, -labels:] predicting labels[1:], as make_blip2_fixture.py writes it
out); the T5 variant's is transformers' own (labels, the decoder's input shifted from the start token).
"""
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import Blip2ForConditionalGeneration

LR, STEPS = 1e-3, 5


def load(d, dtype):
    m = Blip2ForConditionalGeneration.from_pretrained(d, dtype=dtype, attn_implementation="eager").eval()
    return m


def loss_of(m, x, t5, dtype):
    pixels, ids = x["pixels"].to(dtype), x["ids"].long()
    if t5:
        o = m(pixel_values=pixels, input_ids=ids, labels=x["labels"].long())
        return o.logits, o.loss
    labels = x["labels"].long()
    o = m(pixel_values=pixels, input_ids=ids)
    lg = o.logits[:, -labels.shape[1]:-1, :].float()
    loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)
    return o.logits, loss


def steps(d, x, t5, dtype, autocast):
    m = load(d, dtype)
    prm = [p for n, p in m.named_parameters() if n != "language_model.lm_head.weight" or t5]
    opt = torch.optim.AdamW(prm, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = loss_of(m, x, t5, dtype)
        loss.backward()
        out.append(loss.item())
        opt.step()
    return torch.tensor(out, dtype=torch.float64)


def main():
    for name, t5 in (("blip2-tiny-opt", False), ("blip2-tiny-t5", True)):
        d = os.path.join("tests/fixtures", name)
        x = load_file(os.path.join(d, "expected.safetensors"))
        m = load(d, torch.float32)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            lg, loss = loss_of(m, x, t5, torch.float32)
        out = {"logits": lg.float().contiguous(), "loss": torch.tensor([loss.item()], dtype=torch.float64),
               "loss5": steps(d, x, t5, torch.float32, True), "loss5_f32": steps(d, x, t5, torch.float32, False),
               "loss5_f64": steps(d, x, t5, torch.float64, False)}
        save_file(out, os.path.join(d, "expected-bf16.safetensors"))
        e = (out["logits"].double() - x["logits"].double()).abs().max().item()
        print(f"{name}: autocast loss {loss.item():.6f} (float64 {x['loss'].item():.6f}), logits {e:.3g} from float64; "
              f"5 steps autocast {out['loss5'].tolist()}, fp32 {out['loss5_f32'].tolist()}, f64 {out['loss5_f64'].tolist()}")


if __name__ == "__main__":
    main()
