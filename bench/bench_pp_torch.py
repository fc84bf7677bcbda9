#!/usr/bin/env python3
"""PyTorch side of the pipeline-parallel step benchmark (compare with `mpirun -np S fitllm ... --pipeline_parallel S`).

    /work/venv-graph/bin/python bench/bench_pp_torch.py --shape tiny --batch 2 --micro 4 --seq 128 \
        --split 0,5,6 --schedule 1f1b --steps 6 --warmup 2 --threads 1
    /work/venv-graph/bin/python bench/bench_pp_torch.py --shape tiny --batch 2 --micro 4 --seq 128 \
        --split 0,1,2,5,6 --schedule interleaved --chunks 2 --steps 6 --warmup 2 --threads 1

Pinned: torch 2.15.0 (CPU), transformers 5.23.0 (the venv's; torch.distributed.pipelining is part of torch).
--stages = (len(split) - 1) / --chunks processes (torch.multiprocessing.spawn), each torch.set_num_threads(--threads), one
gloo process group from a file store (no ports). The model is bench/bench_step_torch.py's (its SHAPES:
LlamaForCausalLM, fp32, untied head, sdpa, AdamW lr 1e-4 wd 0.1, random init from one seed on every rank); stage s
keeps decoder layers [split[s], split[s+1]) (the first also the embeddings, the last the final norm and lm_head; the
rest of the model is dropped), wrapped in torch.distributed.pipelining.PipelineStage and driven by Schedule1F1B or
ScheduleGPipe with --micro micro-batches (--schedule interleaved: ScheduleInterleaved1F1B, each rank holding
--chunks PipelineStages, chunk c of rank s being virtual stage c x stages + s with layers [split[v], split[v+1]),
as fitllm's `--pipeline_schedule interleaved --pipeline_chunks V`; the micro-batches a multiple of the stages) of --batch sequences of --seq tokens per step (random ids and targets, the
same on every rank), F.cross_entropy per micro-batch. One step = zero_grad(set_to_none=True), schedule.step (the
forwards and backwards, activations and their gradients sent point to point over gloo), AdamW on the stage's
parameters, a barrier (fitllm's step ends with the losses' broadcast from the last stage: a synchronisation too).

Timing: rank 0's wall time per step, median over the timed steps after --warmup. Memory: each rank's peak resident
set (getrusage ru_maxrss: the whole process, Python and torch included). Prints (rank 0):
    RESULT impl=torch-pp-1f1b shape=tiny stages=2 split=0,5,6 median_ms=... tok_s=... rss_mib=a/b losses=[...]
"""
import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step_torch import SHAPES  # noqa: E402  (one source for the shapes)


class Stage(nn.Module):
    """Layers [first, last) of a LlamaForCausalLM; the embeddings on the first stage, norm + head on the last."""

    def __init__(self, model, first, last, is_first, is_last):
        super().__init__()
        self.config = model.config
        self.embed = model.model.embed_tokens if is_first else None
        self.layers = nn.ModuleList(model.model.layers[first:last])
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if is_last else None
        self.head = model.lm_head if is_last else None

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask

        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        pe = self.rotary(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def worker(rank, args, split, store_path):
    import gc

    torch.set_num_threads(args.threads)
    V = args.chunks if args.schedule == "interleaved" else 1
    NV = len(split) - 1  # virtual stages
    S = NV // V          # processes
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=S)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[args.shape]
    cfg = LlamaConfig(**s, max_position_embeddings=max(1024, args.seq), rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
                      bos_token_id=1, eos_token_id=2, use_cache=False, attn_implementation="sdpa")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).float()
    vs = [c * S + rank for c in range(V)]  # this rank's virtual stages
    mods = [Stage(model, split[v], split[v + 1], v == 0, v == NV - 1) for v in vs]
    for m in mods:
        m.train()
    del model
    gc.collect()
    stages = [PipelineStage(m, v, NV, torch.device("cpu")) for m, v in zip(mods, vs)]

    def loss_fn(out, tgt):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

    if args.schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=args.micro, loss_fn=loss_fn)
    else:
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        sched = kind(stages[0], n_microbatches=args.micro, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab, N = s["vocab_size"], args.micro * args.batch
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        x = torch.randint(vocab, (N, args.seq), generator=gen)
        y = torch.randint(vocab, (N, args.seq), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == S - 1:
            mb = []
            sched.step(target=y, losses=mb)
            losses.append(round(float(sum(v.item() for v in mb) / len(mb)), 6))
        else:
            sched.step()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB -> MiB
    info = [None] * S
    dist.all_gather_object(info, (rss, losses))
    if rank == 0:
        med = statistics.median(times[args.warmup:])
        print(f"RESULT impl=torch-pp-{args.schedule}{'' if V == 1 else f'x{V}'} shape={args.shape} stages={S} split={','.join(map(str, split))} "
              f"median_ms={med * 1e3:.1f} tok_s={N * args.seq / med:.1f} "
              f"rss_mib={'/'.join(f'{r[0]:.0f}' for r in info)} losses={info[-1][1]}", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(k for k, v in SHAPES.items() if "arch" not in v), default="tiny")
    ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--split", default="0,3,6", help="the stages' first layers and the layer count")
    ap.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved"], default="1f1b")
    ap.add_argument("--chunks", type=int, default=2, help="interleaved: model chunks (virtual stages) per rank")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    split = [int(v) for v in args.split.split(",")]
    L = SHAPES[args.shape]["num_hidden_layers"]
    if len(split) < 3 or split[0] != 0 or split[-1] != L or any(a >= b for a, b in zip(split, split[1:])):
        sys.exit(f"--split {args.split}: need 0 = s0 < s1 < ... < {L} (the layer count), two stages or more")
    V = args.chunks if args.schedule == "interleaved" else 1
    if V < 1 or (len(split) - 1) % V or (len(split) - 1) // V < 2:
        sys.exit(f"--split {args.split} --chunks {V}: need (stages x chunks) + 1 entries, two stages or more")
    S = (len(split) - 1) // V
    if V > 1 and args.micro % S:
        sys.exit(f"--micro {args.micro}: interleaved needs a multiple of the stages ({S})")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args, split, os.path.join(d, "store")), nprocs=S, join=True)


if __name__ == "__main__":
    main()
