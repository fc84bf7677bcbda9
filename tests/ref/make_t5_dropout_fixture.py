#!/usr/bin/env python3
"""The T5 dropout reference for fitllm (tests/test_t5_dropout.c `t5_dropout_vs_transformers`): transformers'
T5ForConditionalGeneration in training mode with its nn.Dropout modules replaced by fitllm's masks, so that the
places where transformers drops (after the embeddings, after each self-attention, cross-attention and FFN sublayer
before the residual add, inside the FFN before wo, after each stack's final norm) and fitllm's are checked to be the
same, with the same masks.

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0, numpy 2.4.6.
Run from the repo root (after make_t5_fixture.py):
    python tests/ref/make_t5_dropout_fixture.py [--fixtures tests/fixtures]

fitllm's mask (fitllm/lora.h fl_lora_dropout_keep, backend.h dropout): element i of a tensor is kept iff the top 24
bits of splitmix64(seed + (i + 1) * 0x9E3779B97F4A7C15), as a float32 in [0, 1), are >= p; kept values are
multiplied by the float32 1 / (1 - p). The seeds (src/model/seq2seq.c, src/model/graph.h fl_dropout_seed, src/model/
arch_t5.c): for the micro-batch seed S, stack s's embedding uses fl_dropout_seed(S, 2s), its final norm's output
fl_dropout_seed(S, 2s + 1); block b (0 .. Le-1 the encoder's, Le .. the decoder's) has the seed
fl_dropout_seed(S, 16 + b) and its sites fl_dropout_seed(that, site): 0 self-attention output, 1 cross-attention
output, 2 the FFN's activation, 3 the FFN's output, 4 the self-attention's weights, 5 the cross-attention's weights.
The element index runs over the (B, T, width) tensor row-major, for the weights over (B, NH, Tq, Tk). transformers'
eager attention drops its weights with nn.functional.dropout (p = the config's dropout_rate, 0 in the fixture):
patched here to fitllm's mask of the attention module that is running.

Writes expected-dropout.safetensors into tests/fixtures/t5-tiny-relu and t5-tiny-gated: loss (F64 [1]: float64
run), grad.<name> (F32: the float64 gradients of the mean loss), noise.loss / noise.<name> (F32 [1]: max |PyTorch
fp32 - float64|), seed (I64 [1]: S), p (F32 [1]).
"""
import argparse
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import T5ForConditionalGeneration

SEED, P = 20261129, 0.2
M64 = (1 << 64) - 1


def dropout_seed(base, site):
    """src/model/graph.h fl_dropout_seed"""
    k = 0xD6E8FEB86659FD93
    z = base ^ (((site + 1) * k) & M64)
    z = ((z ^ (z >> 32)) * k) & M64
    z = ((z ^ (z >> 32)) * k) & M64
    return z ^ (z >> 32)


def keep(seed, n, p):
    """fitllm/lora.h fl_lora_dropout_keep for i in [0, n)"""
    with np.errstate(over="ignore"):
        i = np.arange(1, n + 1, dtype=np.uint64)
        z = np.uint64(seed) + i * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    u = (z >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    return u >= np.float32(p)


class FitDrop(torch.nn.Module):
    """nn.Dropout with fitllm's mask; seeds: one per call in order (a stack's module runs for the embeddings, then
    for the final norm's output)"""

    def __init__(self, seeds):
        super().__init__()
        self.seeds, self.calls = seeds, 0

    def forward(self, x):
        seed = self.seeds[self.calls % len(self.seeds)]
        self.calls += 1
        sc = np.float32(1.0) / (np.float32(1.0) - np.float32(P))
        m = torch.from_numpy(keep(seed, x.numel(), P).reshape(x.shape))
        return x * (m.to(x.dtype) * float(sc))


CUR = []  # the T5Attention running (its weights' seed): set around its forward


def attn_dropout(x, p=0.5, training=False, inplace=False):
    if not CUR:
        raise RuntimeError("nn.functional.dropout outside a T5Attention")
    return CUR[-1].fit_drop(x) if training and p > 0 else x


def wrap_attention(att, seed):
    att.fit_drop = FitDrop([seed])
    fwd = att.forward

    def forward(*a, **kw):
        CUR.append(att)
        try:
            return fwd(*a, **kw)
        finally:
            CUR.pop()
    att.forward = forward


def install(m):
    torch.nn.functional.dropout = attn_dropout  # only the eager attention calls it (the modules below are replaced)
    le = len(m.encoder.block)
    for s, stack in enumerate([m.encoder, m.decoder]):
        stack.dropout = FitDrop([dropout_seed(SEED, 2 * s), dropout_seed(SEED, 2 * s + 1)])
        for l, blk in enumerate(stack.block):
            bs = dropout_seed(SEED, 16 + (le if s else 0) + l)
            blk.layer[0].dropout = FitDrop([dropout_seed(bs, 0)])
            wrap_attention(blk.layer[0].SelfAttention, dropout_seed(bs, 4))
            if s:
                blk.layer[1].dropout = FitDrop([dropout_seed(bs, 1)])
                wrap_attention(blk.layer[1].EncDecAttention, dropout_seed(bs, 5))
            ff = blk.layer[-1]
            ff.dropout = FitDrop([dropout_seed(bs, 3)])
            ff.DenseReluDense.dropout = FitDrop([dropout_seed(bs, 2)])


def params(m):
    return [(n, p) for n, p in m.named_parameters()
            if n not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")]


def run(d, batch, dtype):
    m = T5ForConditionalGeneration.from_pretrained(d, attn_implementation="eager").to(dtype)
    for mod in m.modules():  # the attention's p (the eager function passes it to the patched dropout)
        if hasattr(mod, "has_relative_attention_bias"):
            mod.dropout = P
    install(m)
    m.train()
    src, mask, dec, labels = batch
    out = m(input_ids=src.long(), attention_mask=mask.long(), decoder_input_ids=dec.long(), labels=labels.long())
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in params(m)}


def make(d):
    x = load_file(os.path.join(d, "expected.safetensors"))
    batch = (x["src"], x["src_mask"], x["dec"], x["labels"])
    save(d, run(d, batch, torch.float32), run(d, batch, torch.float64), x["loss"])


def save(d, r32, r64, loss_without):
    """expected-dropout.safetensors in d from the fp32 and float64 runs' (loss, gradients) (also
    tests/ref/make_blip2_dropout_fixture.py's)"""
    (s32, g32), (s64, g64) = r32, r64
    noise = lambda a, b: (a.double() - b).abs().max().float().reshape(1)
    out = {"loss": s64.reshape(1), "noise.loss": noise(s32, s64), "seed": torch.tensor([SEED], dtype=torch.int64),
           "p": torch.tensor([P], dtype=torch.float32)}
    for n in g64:
        out["grad." + n] = g64[n].float().contiguous()
        out["noise." + n] = noise(g32[n], g64[n])
    save_file(out, os.path.join(d, "expected-dropout.safetensors"))
    print(f"{d}: loss with dropout {s64.item():.8f} (without: {loss_without.item():.8f}), fp32 noise "
          f"{noise(s32, s64).item():.3g}, {len(g64)} gradients, worst grad noise "
          f"{max(noise(g32[n], g64[n]).item() for n in g64):.3g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tests/fixtures")
    a = ap.parse_args()
    for v in ("t5-tiny-relu", "t5-tiny-gated"):
        make(os.path.join(a.fixtures, v))


if __name__ == "__main__":
    main()
