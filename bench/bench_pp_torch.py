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
from bench_step_torch import SHAPES, llama_config  # noqa: E402  (one source for the shapes and config)


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


def stage_tp_plan(mod):
    """--tp: Megatron's plan on a Stage's modules, bench_tp_torch.py's tp_plan (column-parallel q/k/v/gate/up,
    row-parallel o/down, the embedding's vocabulary rows, lm_head's vocabulary columns read by loss_parallel's
    cross-entropy; the norms replicated)."""
    from bench_tp_torch import tp_plan

    return tp_plan(mod, "embed" if mod.embed is not None else None, "head" if mod.head is not None else None, "layers")


def local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(rank, args, split, store_path):
    import contextlib
    import gc
    import json

    torch.set_num_threads(args.threads)
    V = args.chunks if args.schedule == "interleaved" else 1
    NV = len(split) - 1  # virtual stages
    S = NV // V          # pipeline stages
    W = args.dp * S * args.tp
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=W)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from transformers import LlamaForCausalLM

    # ranks: tp fastest, then pp, then dp (rank = (d * S + s) * tp + t)
    mesh = init_device_mesh("cpu", (args.dp, S, args.tp), mesh_dim_names=("dp", "pp", "tp"))
    d, ps = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    s = SHAPES[args.shape]
    cfg = llama_config(s, args.seq)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = (LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32, attn_implementation="sdpa")
             if args.init else LlamaForCausalLM(cfg)).float()
    vs = [c * S + ps for c in range(V)]  # this rank's virtual stages
    mods = [Stage(model, split[v], split[v + 1], v == 0, v == NV - 1) for v in vs]
    for m in mods:
        m.train()
    del model
    gc.collect()
    if args.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module
        for m in mods:
            parallelize_module(m, mesh["tp"], stage_tp_plan(m))
    if args.fsdp != "none":
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        pol = CPUOffloadPolicy(pin_memory=False) if args.offload else OffloadPolicy()
        for m in mods:  # each block a unit, then the stage (its embeddings / norm / head)
            for layer in m.layers:
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=args.fsdp == "full", offload_policy=pol)
            fully_shard(m, mesh=mesh["dp"], reshard_after_forward=args.fsdp == "full", offload_policy=pol)
    stages = [PipelineStage(m, v, NV, torch.device("cpu"), group=mesh["pp"].get_group()) for m, v in zip(mods, vs)]

    def loss_fn(out, tgt):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

    if args.schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=args.micro, loss_fn=loss_fn)
    else:
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        sched = kind(stages[0], n_microbatches=args.micro, loss_fn=loss_fn)
    if args.tp > 1:  # the vocabulary-parallel cross-entropy (lm_head's output stays sharded on the vocabulary)
        from torch.distributed.tensor.parallel import loss_parallel
        ctx = loss_parallel
    else:
        ctx = contextlib.nullcontext
    opt = torch.optim.AdamW([p for m in mods for p in m.parameters()], lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed + 1)
    vocab, N = s["vocab_size"], args.micro * args.batch
    fixed = None
    if args.ids:  # the same blocks every step (the data-parallel group d reads its N of them)
        blocks = torch.tensor(json.load(open(args.ids)), dtype=torch.long)
        if blocks.shape != (N * args.dp, args.seq + 1):
            sys.exit(f"{args.ids}: blocks {tuple(blocks.shape)}, need ({N * args.dp}, {args.seq + 1})")
        fixed = blocks[d * N:(d + 1) * N]
    last = ps == S - 1  # holds the last (virtual) stage
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        if fixed is not None:
            x, y = fixed[:, :-1].contiguous(), fixed[:, 1:].contiguous()
        else:
            x = torch.randint(vocab, (N, args.seq), generator=gen)
            y = torch.randint(vocab, (N, args.seq), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with ctx():
            if ps == 0:
                sched.step(x)
            elif last:
                mb = []
                sched.step(target=y, losses=mb)
                lv = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in mb]
                losses.append(float(sum(v.item() for v in lv) / len(lv)))
            else:
                sched.step()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB -> MiB
    state = (sum(local_bytes(p) for m in mods for p in m.parameters())
             + sum(local_bytes(p.grad) for m in mods for p in m.parameters() if p.grad is not None)
             + sum(local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()))
    info = [None] * W
    dist.all_gather_object(info, (rss, state, losses, last))
    if rank == 0:
        med = statistics.median(times[args.warmup:])
        # the step's loss: the mean over the data-parallel groups' last stages (tensor-parallel ranks agree)
        ll = [r[2] for r in info if r[3]]
        step_losses = [round(sum(v[i] for v in ll) / len(ll), 6) for i in range(len(ll[0]))]
        tag = args.schedule + ("" if V == 1 else f"x{V}") + (f"-tp{args.tp}" if args.tp > 1 else "") + \
            (f"-dp{args.dp}" if args.dp > 1 else "") + ("" if args.fsdp == "none" else f"-fsdp_{args.fsdp}") + \
            ("-offload" if args.offload else "")
        print(f"RESULT impl=torch-pp-{tag} shape={args.shape} world={W} stages={S} split={','.join(map(str, split))} "
              f"median_ms={med * 1e3:.1f} tok_s={N * args.dp * args.seq / med:.1f} "
              f"rss_mib={'/'.join(f'{r[0]:.0f}' for r in info)} "
              f"state_mib={'/'.join(f'{r[1] / 2**20:.1f}' for r in info)} losses={step_losses}", flush=True)
    dist.destroy_process_group()


class T5Stage(nn.Module):
    """Blocks [first, last) of a T5ForConditionalGeneration, counted over the encoder's blocks then the decoder's (as
    fitllm's split prints them: t5-small's 12). The first stage holds the shared embeddings (the encoder's input and
    the decoder's) and must hold the whole encoder and its final norm (the only splits this script builds: fitllm's
    at 2 stages, e.g. [0, 8) [8, 12)); it sends (encoder output, decoder stream, the decoder's self-attention
    position bias once its first block ran); the last stage holds the decoder's final norm and lm_head (tied to the
    shared table in T5 v1.0: its gradient is summed with the first stage's, see worker_t5)."""

    def __init__(self, model, first, last):
        super().__init__()
        c = model.config
        Le, Ld = c.num_layers, c.num_decoder_layers
        self.is_first, self.is_last = first == 0, last == Le + Ld
        self.scale = c.d_model ** -0.5 if c.tie_word_embeddings else None
        self.dcfg = model.decoder.config
        self.shared = model.shared if self.is_first else None
        self.enc = nn.ModuleList(model.encoder.block[:Le]) if self.is_first else None
        self.enc_norm = model.encoder.final_layer_norm if self.is_first else None
        self.dec = nn.ModuleList(model.decoder.block[max(first, Le) - Le:last - Le])
        self.dec_norm = model.decoder.final_layer_norm if self.is_last else None
        self.head = model.lm_head if self.is_last else None

    def forward(self, *xs):
        from transformers.masking_utils import create_causal_mask

        if self.is_first:
            src, dec = xs
            h, b = self.shared(src), None
            for blk in self.enc:
                h, b, _ = blk(h, None, b)
            enc, d, db = self.enc_norm(h), self.shared(dec), None
        else:
            enc, d = xs[0], xs[1]
            db = xs[2] if len(xs) > 2 else None
        mask = create_causal_mask(config=self.dcfg, inputs_embeds=d, attention_mask=None, past_key_values=None)
        for blk in self.dec:
            d, db, _ = blk(d, mask, db, enc, None, None)
        if self.is_last:
            d = self.dec_norm(d)
            return self.head(d * self.scale if self.scale else d)
        return tuple(t.contiguous() for t in ((enc, d, db) if db is not None else (enc, d)))  # gloo sends


def t5_config(shape):
    from transformers import T5Config
    from bench_t5_torch import SHAPES as T5_SHAPES

    return T5Config(**T5_SHAPES[shape], dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                    eos_token_id=1, use_cache=False)


def worker_t5(rank, args, split, store_path):
    """--t5 SHAPE: T5ForConditionalGeneration on len(split) - 1 stages (GPipe / 1F1B), one pipeline, no TP."""
    import gc
    import json

    torch.set_num_threads(args.threads)
    S = len(split) - 1
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=S)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(args.seed)
    model = (T5ForConditionalGeneration.from_pretrained(args.init, dtype=torch.float32) if args.init
             else T5ForConditionalGeneration(t5_config(args.t5))).float()
    tied = model.config.tie_word_embeddings
    mod = T5Stage(model, split[rank], split[rank + 1])
    mod.train()
    del model
    gc.collect()
    ends = dist.new_group([0, S - 1])  # the shared table's two copies (tied head): gradients summed
    stage = PipelineStage(mod, rank, S, torch.device("cpu"))

    def loss_fn(out, tgt):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

    kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    sched = kind(stage, n_microbatches=args.micro, loss_fn=loss_fn)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-4, weight_decay=0.1)
    N, vocab = args.micro * args.batch, mod.dcfg.vocab_size
    if args.ids:
        j = json.load(open(args.ids))
        src, tgt = torch.tensor(j["src"]), torch.tensor(j["tgt"])
        if src.shape != (N, args.source) or tgt.shape != (N, args.seq):
            sys.exit(f"{args.ids}: src {tuple(src.shape)} tgt {tuple(tgt.shape)}, need ({N}, {args.source}) ({N}, {args.seq})")
    else:
        g = torch.Generator().manual_seed(args.seed + 1)
        src, tgt = torch.randint(2, vocab, (N, args.source), generator=g), torch.randint(2, vocab, (N, args.seq), generator=g)
    dec = torch.cat([torch.zeros(N, 1, dtype=torch.long), tgt[:, :-1]], 1)  # decoder_start (pad) + targets but the last
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(src, dec)
        elif rank == S - 1:
            mb = []
            sched.step(target=tgt, losses=mb)
            losses.append(float(sum(v.item() for v in mb) / len(mb)))
        else:
            sched.step()
        if tied and rank in (0, S - 1):
            w = mod.shared.weight if rank == 0 else mod.head.weight
            dist.all_reduce(w.grad, group=ends)
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    state = (sum(local_bytes(p) for p in mod.parameters())
             + sum(local_bytes(p.grad) for p in mod.parameters() if p.grad is not None)
             + sum(local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()))
    info = [None] * S
    dist.all_gather_object(info, (rss, state, losses))
    if rank == 0:
        med = statistics.median(times[args.warmup:])
        print(f"RESULT impl=torch-pp-t5-{args.schedule} shape={args.t5} world={S} stages={S} split={','.join(map(str, split))} "
              f"median_ms={med * 1e3:.1f} tok_s={N * (args.source + args.seq) / med:.1f} "
              f"rss_mib={'/'.join(f'{r[0]:.0f}' for r in info)} "
              f"state_mib={'/'.join(f'{r[1] / 2**20:.1f}' for r in info)} losses={[round(v, 6) for v in info[-1][2]]}",
              flush=True)
    dist.destroy_process_group()


def prepare_t5(args):
    """--prepare DIR --t5 SHAPE: DIR/init (a random T5 saved as HF safetensors, with the tokenizer of --t5_tokenizer:
    fitllm reads it with --checkpoint_dir), DIR/pairs/{train,val}.json (--blocks records whose source and target both
    run past --source / --seq tokens, so every sample is cut to exactly those lengths, EOS included) and DIR/ids.json
    (their ids, cut as HF's truncation=True: the data of --ids)."""
    import json
    import random
    import shutil
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    init = os.path.join(args.prepare, "init")
    os.makedirs(os.path.join(args.prepare, "pairs"), exist_ok=True)
    torch.manual_seed(args.seed)
    T5ForConditionalGeneration(t5_config(args.t5)).float().save_pretrained(init, safe_serialization=True)
    for f in ("spiece.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(args.t5_tokenizer, f), init)
    tok = AutoTokenizer.from_pretrained(init)
    rnd = random.Random(args.seed)
    words = "the a cat dog runs fox jumps over lazy quick brown hello world good morning translate pig latin".split()
    recs = [{"input": "summarize: " + " ".join(rnd.choice(words) for _ in range(4 * args.source)),
             "output": " ".join(rnd.choice(words) for _ in range(4 * args.seq))} for _ in range(args.blocks)]
    src = [tok(r["input"], truncation=True, max_length=args.source)["input_ids"] for r in recs]
    tgt = [tok(r["output"], truncation=True, max_length=args.seq)["input_ids"] for r in recs]
    if any(len(s) != args.source for s in src) or any(len(t) != args.seq for t in tgt):
        sys.exit("prepare_t5: a record is shorter than --source / --seq tokens")
    for f in ("train.json", "val.json"):
        json.dump(recs, open(os.path.join(args.prepare, "pairs", f), "w"), indent=1)
    json.dump({"src": src, "tgt": tgt}, open(os.path.join(args.prepare, "ids.json"), "w"))
    print(f"prepared {args.prepare}: {args.blocks} pairs of {args.source} + {args.seq} tokens")


def prepare(args):
    """--prepare DIR: the shared inputs of a same-init run: DIR/init (the random model, saved as HF safetensors: fitllm
    reads it with --initial_checkpoint_dir), DIR/text/train.txt (TinyStories lines, as many as make exactly --blocks
    blocks of --seq + 1 tokens for a TextFiles loader: BOS + the stripped text, the tail under one block dropped) and
    DIR/ids.json (those blocks, for --ids). With every block in each step, the step's mean loss does not depend on
    the order either side reads them in."""
    import json
    from transformers import AutoTokenizer, LlamaForCausalLM

    os.makedirs(os.path.join(args.prepare, "text"), exist_ok=True)
    torch.manual_seed(args.seed)
    cfg = llama_config(SHAPES[args.shape], args.seq)
    LlamaForCausalLM(cfg).float().save_pretrained(os.path.join(args.prepare, "init"), safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    need = args.blocks * (args.seq + 1)
    text, ids = "", []
    for line in open(args.text, encoding="utf-8"):
        text += line
        ids = tok(text.strip())["input_ids"]
        if ids[0] != tok.bos_token_id:
            ids = [tok.bos_token_id] + ids
        if len(ids) >= need:
            break
    if len(ids) < need or len(ids) >= need + args.seq + 1:
        sys.exit(f"--text {args.text}: {len(ids)} tokens, need {need} to {need + args.seq}")
    open(os.path.join(args.prepare, "text", "train.txt"), "w", encoding="utf-8").write(text)
    blocks = [ids[i * (args.seq + 1):(i + 1) * (args.seq + 1)] for i in range(args.blocks)]
    json.dump(blocks, open(os.path.join(args.prepare, "ids.json"), "w"))
    print(f"prepared {args.prepare}: {args.blocks} blocks of {args.seq + 1} tokens ({len(ids)} tokens)")


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
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (DTensor, Megatron's plan)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel pipelines (FSDP2 with --fsdp, else plain copies)")
    ap.add_argument("--fsdp", choices=["none", "full", "grad_op"], default="none",
                    help="FSDP2 fully_shard on the stages over the data axis: full = reshard after forward (ZeRO-3), "
                         "grad_op = keep the gathered parameters until the backward (ZeRO-2's sharding)")
    ap.add_argument("--offload", action="store_true", help="FSDP2 CPUOffloadPolicy (parameters, gradients, optimizer)")
    ap.add_argument("--init", help="HF folder to start from (--prepare writes one) instead of the seed's random init")
    ap.add_argument("--ids", help="JSON blocks of seq + 1 token ids (--prepare writes them): the data of every step")
    ap.add_argument("--prepare", help="write DIR/init, DIR/text/train.txt, DIR/ids.json and exit (see prepare())")
    ap.add_argument("--blocks", type=int, default=8, help="--prepare: blocks (= the global batch)")
    ap.add_argument("--text", default="/work/shared/data/text/tinystories-val-prefix.txt", help="--prepare: text")
    ap.add_argument("--tokenizer", default="/work/shared/data/llama2-tokenizer", help="--prepare: tokenizer folder")
    ap.add_argument("--t5", help="a T5 shape of bench_t5_torch.py (t5-small, t5-micro): T5ForConditionalGeneration on "
                    "the stages (--split over the encoder's blocks then the decoder's; one pipeline)")
    ap.add_argument("--source", type=int, default=128, help="--t5: source tokens (--seq: target tokens)")
    ap.add_argument("--t5_tokenizer", default="tests/fixtures/t5-tok", help="--t5 --prepare: tokenizer files")
    args = ap.parse_args()
    if args.prepare:
        return prepare_t5(args) if args.t5 else prepare(args)
    if args.t5:
        from bench_t5_torch import SHAPES as T5_SHAPES
        split = [int(v) for v in args.split.split(",")]
        c = T5_SHAPES[args.t5]
        L, Le = c["num_layers"] + c["num_decoder_layers"], c["num_layers"]
        if len(split) < 3 or split[0] != 0 or split[-1] != L or split[1] < Le or any(
                a >= b for a, b in zip(split, split[1:])):
            sys.exit(f"--split {args.split}: need 0 < s1 < ... < {L} with s1 >= {Le} (the first stage holds the encoder)")
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(worker_t5, args=(args, split, os.path.join(d, "store")), nprocs=len(split) - 1, join=True)
        return
    if args.dp > 1 and args.fsdp == "none":
        sys.exit("--dp > 1 needs --fsdp full|grad_op (the pipelines' gradients are reduced by FSDP2)")
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
        mp.spawn(worker, args=(args, split, os.path.join(d, "store")), nprocs=S * args.tp * args.dp, join=True)


if __name__ == "__main__":
    main()
