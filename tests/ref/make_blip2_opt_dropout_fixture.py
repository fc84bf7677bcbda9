#!/usr/bin/env python3
"""The dropout reference of BLIP-2's OPT variant for fitllm (tests/test_blip2.c `blip2_opt_dropout_vs_transformers`):
transformers' Blip2ForConditionalGeneration (tests/fixtures/blip2-tiny-opt) in training mode, every dropout p set to P
and each mask replaced by fitllm's of the same seed, so the places where transformers drops and fitllm's are checked
to be the same, with the same masks, together with every gradient through them:

  vision tower  the attention weights (Blip2Attention, vision_config.attention_dropout)
  Q-Former      its embedding LayerNorm's output (Blip2QFormerModel.dropout), the self- and cross-attention weights
                (attention_probs_dropout_prob), the three dense outputs before their residual add and LayerNorm
                (Blip2QFormerSelfOutput, Blip2QFormerOutput: hidden_dropout_prob)
  OPT           the attention weights (OPTAttention, attention_dropout), the attention and FFN outputs before their
                residual adds (OPTDecoderLayer, dropout). OPTDecoderLayer has no activation dropout, OPTDecoder no
                embedding dropout (transformers 5.23)

Seeds (src/model/blip2_pass.c, src/model/graph.h fl_dropout_seed; the mask is tests/ref/make_t5_dropout_fixture.py's
keep()): the micro-batch seed S; OPT block l: fl_dropout_seed(S, 16 + l); the vision tower's part seed
fl_dropout_seed(S, 8), the Q-Former's fl_dropout_seed(S, 9), their block l fl_dropout_seed(part, 16 + l), the
Q-Former's embedding fl_dropout_seed(part, 0); within a block the sites 0 self-attention output, 1 cross-attention
output, 3 FFN output, 4 self-attention weights, 5 cross-attention weights.

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0, numpy 2.4.6.
Run from the repo root (after make_blip2_fixture.py):
    python tests/ref/make_blip2_opt_dropout_fixture.py [--fixture tests/fixtures/blip2-tiny-opt]

Writes expected-dropout.safetensors there, as make_t5_dropout_fixture.save(): loss (F64 [1]), grad.<name> (F32: the
float64 gradients of the mean caption loss), noise.loss / noise.<name> (F32 [1]: max |PyTorch fp32 - float64|),
seed (I64 [1]: S), p (F32 [1]).
"""
import os
import sys

import torch
from transformers import Blip2ForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_blip2_dropout_fixture as b2t5  # noqa: E402  (make(): the batch, both runs, the file)
import make_t5_dropout_fixture as t5d  # noqa: E402  (FitDrop, dropout_seed, SEED, P)

ORIG_DROPOUT = torch.nn.functional.dropout


def fit_dropout(x, p=0.5, training=False, inplace=False):
    """nn.functional.dropout: fitllm's mask of the innermost wrapped module (t5d.CUR: its FitDrop's seeds in call
    order)"""
    if not training or p == 0:
        return x
    if not t5d.CUR:
        raise RuntimeError("a dropout outside the sites fitllm drops")
    return t5d.CUR[-1].fit_drop(x)


def wrap(mod, seeds):
    """mod's functional dropout calls take fitllm's masks of `seeds`, one per call in order"""
    t5d.wrap_attention(mod, seeds[0])
    mod.fit_drop = t5d.FitDrop(seeds)


def install(m):
    S, P, ds = t5d.SEED, t5d.P, t5d.dropout_seed
    vs, qs = ds(S, 8), ds(S, 9)
    for l, layer in enumerate(m.vision_model.encoder.layers):
        layer.self_attn.attention_dropout = P
        wrap(layer.self_attn, [ds(ds(vs, 16 + l), 4)])
    m.qformer.dropout = t5d.FitDrop([ds(qs, 0)])
    for l, layer in enumerate(m.qformer.encoder.layer):
        bs = ds(qs, 16 + l)
        layer.attention.attention.attention_dropout = P
        wrap(layer.attention.attention, [ds(bs, 4)])
        layer.attention.output.dropout = t5d.FitDrop([ds(bs, 0)])
        if layer.has_cross_attention:
            layer.crossattention.attention.attention_dropout = P
            wrap(layer.crossattention.attention, [ds(bs, 5)])
            layer.crossattention.output.dropout = t5d.FitDrop([ds(bs, 1)])
        layer.output_query.dropout = t5d.FitDrop([ds(bs, 3)])
    for l, layer in enumerate(m.language_model.model.decoder.layers):
        bs = ds(S, 16 + l)
        layer.dropout = P
        layer.self_attn.dropout = P
        wrap(layer, [ds(bs, 0), ds(bs, 3)])  # the attention's output, then the FFN's
        wrap(layer.self_attn, [ds(bs, 4)])


def run(d, batch, dtype):
    m = Blip2ForConditionalGeneration.from_pretrained(d, attn_implementation="eager").to(dtype)
    install(m)
    torch.nn.functional.dropout = fit_dropout
    m.train()
    pixels, ids, labels = batch
    out = m(pixel_values=pixels.to(dtype), input_ids=ids.long())
    lg = out.logits[:, -labels.shape[1]:-1, :]  # the caption's positions predict caption[1:] (make_blip2_fixture.py)
    loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels[:, 1:].reshape(-1).long(),
                                             ignore_index=-100)
    loss.backward()
    torch.nn.functional.dropout = ORIG_DROPOUT
    return loss.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def main():
    b2t5.make(run, "tests/fixtures/blip2-tiny-opt")


if __name__ == "__main__":
    main()
