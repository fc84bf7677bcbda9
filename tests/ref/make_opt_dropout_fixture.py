#!/usr/bin/env python3
"""OPT's dropout reference for fitllm (tests/test_opt_dropout.c `opt_dropout_vs_transformers`): transformers'
OPTForCausalLM (tests/fixtures/golden-opt, its golden batch) in training mode with dropout p P and attention_dropout P,
each mask replaced by fitllm's of the same seed (tests/ref/make_blip2_opt_dropout_fixture.py's routing: OPTDecoderLayer's
functional dropout on the attention's output, then on the FFN's; OPTAttention's on its weights), so the places where
transformers' OPT drops and fitllm's decoder trainer's are checked to be the same, with the same masks.

Seeds: the micro-batch seed S; block l fl_dropout_seed(S, 16 + l); within it site 0 the attention output, 3 the FFN
output, 4 the attention weights (src/model/transformer.c, graph.c).

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0, numpy 2.4.6.
Run from the repo root:
    python tests/ref/make_opt_dropout_fixture.py [--fixture tests/fixtures/golden-opt]

Writes expected-dropout.safetensors there (make_t5_dropout_fixture.save()'s layout): loss (F64 [1]), grad.<name>
(F32: the float64 gradients of the mean loss), noise.loss / noise.<name> (F32 [1]), seed (I64 [1]), p (F32 [1]).
"""
import argparse
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import OPTForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_blip2_opt_dropout_fixture as b2d  # noqa: E402  (wrap(), fit_dropout)
import make_t5_dropout_fixture as t5d  # noqa: E402  (dropout_seed, SEED, P, save())


def install(m):
    S, P, ds = t5d.SEED, t5d.P, t5d.dropout_seed
    for l, layer in enumerate(m.model.decoder.layers):
        bs = ds(S, 16 + l)
        layer.dropout = P
        layer.self_attn.dropout = P
        b2d.wrap(layer, [ds(bs, 0), ds(bs, 3)])  # the attention's output, then the FFN's
        b2d.wrap(layer.self_attn, [ds(bs, 4)])


def run(d, ids, targets, dtype):
    m = OPTForCausalLM.from_pretrained(d, attn_implementation="eager").to(dtype)
    install(m)
    torch.nn.functional.dropout = b2d.fit_dropout
    m.train()
    logits = m(input_ids=ids.long()).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(),
                                             ignore_index=-100)
    loss.backward()
    torch.nn.functional.dropout = b2d.ORIG_DROPOUT
    return loss.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--fixture", default="tests/fixtures/golden-opt")
    d = a.parse_args().fixture
    g = load_file(os.path.join(d, "golden.safetensors"))
    ids, tg = g["input_ids"], g["targets"]
    t5d.save(d, run(d, ids, tg, torch.float32), run(d, ids, tg, torch.float64), g["loss"].double())


if __name__ == "__main__":
    main()
