#!/usr/bin/env python3
"""PyTorch side of the tensor-parallel step benchmark (compare with `mpirun -np 2 fitllm ... --tensor_parallel 2`).

    /work/venv-graph/bin/python bench/bench_tp_torch.py --shape tiny --batch 2 --seq 256 \
        --steps 8 --warmup 2 --world 2 --threads 1

Versions measured: torch 2.15.0, transformers 5.23.0 (/work/venv-graph).

--world processes (torch.multiprocessing.spawn), each torch.set_num_threads(--threads), one gloo process group from
a file store (no ports), one 1-D DeviceMesh("cpu") over them. Same model and step as bench/bench_step_torch.py (its
SHAPES: LlamaForCausalLM, fp32, untied head, sdpa, AdamW lr 1e-4 wd 0.1, random init from one seed on every rank),
parallelized by DTensor's parallelize_module with Megatron's plan, as fitllm's --tensor_parallel splits it:
    q_proj, k_proj, v_proj, gate_proj, up_proj   ColwiseParallel   (heads / MLP columns split)
    o_proj, down_proj                            RowwiseParallel   (an all-reduce of the output)
    embed_tokens                                 RowwiseParallel(input_layouts=Replicate())  (vocabulary-parallel)
    lm_head                                      ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
and the cross-entropy under loss_parallel() (the vocabulary-parallel cross-entropy: no gathered logits). Norms are
replicated. Every rank of the group reads the same micro-batch (--batch sequences of --seq tokens: one group, no data
parallelism). One step = zero_grad(set_to_none=True), forward, cross-entropy, backward, AdamW step, loss.item().

Timing: rank 0's wall time per step, median over the timed steps after --warmup.
Memory per rank: the rank's parameter, gradient and AdamW state bytes (its DTensor shards' local tensors, counted),
and the process's peak RSS (ru_maxrss: the Python interpreter, torch's libraries and allocator caches included).
Prints (rank 0):
    RESULT impl=torch-tp world=2 median_ms=... tok_s=... state_bytes_per_rank=... maxrss_mib=... losses=[...]
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step_torch import SHAPES, llama_config  # noqa: E402  (one source for the shapes and their config)


def local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def block_plan(p):
    """Megatron's split of one LLaMA block whose modules are named p + "self_attn.q_proj" etc."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {p + n: ColwiseParallel() for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "mlp.gate_proj", "mlp.up_proj")}
    plan.update({p + n: RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")})
    return plan


def tp_plan(model, embed="model.embed_tokens", head="lm_head", layers="model.layers"):
    """The whole model's plan (bench_pp_torch.py: a stage's, with its own module names; None = not on the stage)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    if embed:
        plan[embed] = RowwiseParallel(input_layouts=Replicate())
    if head:
        plan[head] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    for i in range(len(model.get_submodule(layers))):
        plan.update(block_plan(f"{layers}.{i}."))
    return plan


def sp_plan(model):
    """--sp: Megatron's sequence parallelism as PyTorch's tensor-parallel tutorial writes it (torchtitan's plan): the
    norms SequenceParallel (the rank's T/N positions), an all-gather into the attention and the MLP (PrepareModuleInput
    to Replicate), o / down RowwiseParallel into Shard(1) (a reduce-scatter), the embedding's output Shard(1), lm_head
    reading the Shard(1) final norm."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan[p + "input_layernorm"] = SequenceParallel()
        plan[p + "post_attention_layernorm"] = SequenceParallel()
        plan[p + "self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                   desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan[p + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + n] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + n] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def worker(rank, args, store_path):
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=args.world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from transformers import LlamaForCausalLM
    import transformers

    s = SHAPES[args.shape]
    cfg = llama_config(s, args.seq)
    torch.manual_seed(args.seed)  # the same whole model on every rank, then each keeps its shards
    model = LlamaForCausalLM(cfg).float()
    model.train()
    mesh = init_device_mesh("cpu", (args.world,))
    parallelize_module(model, mesh, sp_plan(model) if args.sp else tp_plan(model))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    B, T, V = args.batch, args.seq, s["vocab_size"]
    g = torch.Generator().manual_seed(args.seed + 1)  # one micro-batch, the same on every rank of the group
    ids = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)
    pos = torch.arange(T).unsqueeze(0).expand(B, T)

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        # (--sp: the positions given, as the embedding's output holds T/N of them on a rank)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits  # sharded on the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))
            loss.backward()
        opt.step()
        lv = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
        losses.append(lv)
        if rank == 0:
            print(f"step {i}{' (warmup)' if i < args.warmup else ''}: {dt*1e3:.1f} ms loss {lv:.4f}",
                  file=sys.stderr, flush=True)

    pb = sum(local_bytes(p) for p in model.parameters())
    gb = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    ob = sum(local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    state = pb + gb + ob
    if rank == 0:
        odd = [f"{n} {tuple(p.grad.to_local().shape if hasattr(p.grad, 'to_local') else p.grad.shape)} for "
               f"{tuple(p.to_local().shape if hasattr(p, 'to_local') else p.shape)}"
               for n, p in model.named_parameters() if p.grad is not None and local_bytes(p.grad) != local_bytes(p)]
        print(f"# rank 0: parameters {pb} gradients {gb} AdamW state {ob} bytes"
              f"{'; gradients larger than their shard: ' + ', '.join(odd) if odd else ''}", file=sys.stderr)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, float(state)], dtype=torch.float64)
    gathered = [torch.zeros_like(rss) for _ in range(args.world)]
    dist.all_gather(gathered, rss)
    if rank == 0:
        med = statistics.median(times)
        print(f"# torch {torch.__version__} transformers {transformers.__version__} backend=gloo world={args.world} "
              f"threads/rank={args.threads} B={B} T={T}", file=sys.stderr)
        print(f"RESULT impl=torch-{'sp' if args.sp else 'tp'} shape={args.shape} world={args.world} median_ms={med*1e3:.1f} "
              f"tok_s={B*T/med:.1f} state_bytes_per_rank={'/'.join(str(int(x[1])) for x in gathered)} "
              f"maxrss_mib={'/'.join(f'{x[0]:.0f}' for x in gathered)} losses={[round(x, 6) for x in losses]}",
              flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, default=2, help="micro-batch of the group")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", type=int, default=2, help="tensor-parallel ranks")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism too (SequenceParallel norms)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as d:
        mp.spawn(worker, args=(args, os.path.join(d, "store")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
