#!/usr/bin/env python3
"""Batched greedy generation of fitllm's T5 (tests/test_t5_gen.c) against transformers' generate on a padded batch.

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0. Run from the repo
root after make_t5_fixture.py (same models):
    python tests/ref/make_t5_batch_gen_fixture.py [--out tests/fixtures]

For each tiny T5 (t5-tiny-relu, t5-tiny-gated) a batch of B = 4 sources of 5 to 11 tokens, right-padded with id 0
to the longest (attention_mask 0 there), is decoded by generate(do_sample=False, max_new_tokens=MAX_NEW,
use_cache=False) in ONE call: every row starts from the start token, a row that has produced eos continues with
pad (0), and the call ends when every row has or at MAX_NEW tokens. The random tiny models rarely emit their eos
(id 1), so the stop id is chosen from a first run without one: a token that some rows produce before MAX_NEW and
others never (one not first in any row if there is one) (generate's eos_token_id; the C test sets the model's eos id to it), so a row ending early, a row
running to MAX_NEW and the padding after eos are all checked. Writes expected-gen-batch.safetensors:
  src (I32 B x Ts), src_mask (U8 B x Ts), eos (I32 [1]: the stop id),
  gen (I32 B x L: generate's output, start token included, pad after eos).
"""
import argparse
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_t5_fixture import build  # noqa: E402

NB, MAX_NEW = 4, 12


def make(out_dir, gated, seed):
    cfg, m = build(gated, seed)
    m = m.float().eval()
    eos = None
    for sd in range(seed + 100, seed + 150):  # the first batch with such a token (the relu model's rows often repeat one)
        g = torch.Generator().manual_seed(sd)
        lens = torch.randint(5, 12, (NB,), generator=g)
        ts = int(lens.max())
        src = torch.zeros(NB, ts, dtype=torch.int32)
        mask = torch.zeros(NB, ts, dtype=torch.uint8)
        for b in range(NB):
            src[b, :lens[b]] = torch.randint(2, cfg.vocab_size, (int(lens[b]),), generator=g, dtype=torch.int32)
            mask[b, :lens[b]] = 1
        kw = dict(input_ids=src.long(), attention_mask=mask.long(), max_new_tokens=MAX_NEW, do_sample=False,
                  use_cache=False)
        with torch.no_grad():
            free = m.generate(eos_token_id=None, **kw).int()
            # the stop id: in some rows, absent from others; the earliest such past the first new token, else at it
            for t in list(range(2, free.shape[1])) + [1]:
                for c in free[:, t].tolist():
                    rows = [c in free[b, 1:].tolist() for b in range(NB)]
                    if c != cfg.pad_token_id and any(rows) and not all(rows) and (t == 1 or c not in free[:, 1].tolist()):
                        eos = c
                        break
                if eos is not None:
                    break
        if eos is not None:
            break
    assert eos is not None, "no batch has a token that stops some rows and not others"
    with torch.no_grad():
        gen = m.generate(eos_token_id=eos, **kw).int()
    save_file({"src": src.contiguous(), "src_mask": mask.contiguous(), "eos": torch.tensor([eos], dtype=torch.int32),
               "gen": gen.contiguous()},
              os.path.join(out_dir, "expected-gen-batch.safetensors"))
    print(f"{out_dir}: source seed {sd}, stop id {eos}, source lengths {lens.tolist()}, generated\n{gen.tolist()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    a = ap.parse_args()
    make(os.path.join(a.out, "t5-tiny-relu"), gated=False, seed=0)
    make(os.path.join(a.out, "t5-tiny-gated"), gated=True, seed=10)


if __name__ == "__main__":
    main()
