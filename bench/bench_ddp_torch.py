#!/usr/bin/env python3
"""PyTorch side of the data-parallel step benchmark (compare with `mpirun -np 2 fitllm ... --devices 2`).

    /work/venv/bin/python bench/bench_ddp_torch.py --shape tiny --batch 4 --seq 256 \
        --steps 10 --warmup 2 --world 2 --threads 1 [--mode ddp|fsdp2|fsdp2_grad_op]

--world processes (torch.multiprocessing.spawn), each torch.set_num_threads(--threads), one
gloo process group initialised from a file store (no ports). Same model and step as
bench/bench_step_torch.py (its SHAPES: LlamaForCausalLM, fp32, untied head, sdpa, AdamW lr 1e-4
wd 0.1, random init from one seed on every rank), micro-batch --batch per rank, so the global
batch is world x batch sequences of --seq tokens; every rank draws its own random ids/targets.
One step = zero_grad(set_to_none=True), forward, F.cross_entropy, backward (DDP all-reduces its
buckets during backward), AdamW step, loss.item().

--mode ddp:   DistributedDataParallel (default buckets, 25 MB); the bytes all-reduced per step are
              COUNTED by a comm hook that does what the default hook does (divide by world,
              all_reduce) and adds up the bucket sizes; a ring all-reduce of S bytes sends
              2 (N-1)/N S per rank (ZeRO's "2 psi"), that part is by formula.
--mode fsdp2: torch.distributed.fsdp.fully_shard on every decoder layer and then the root
              (FULL_SHARD, reshard after forward). Bytes by ZeRO-3's formula (3 psi: all-gather
              in forward and backward, reduce-scatter), not counted.
--mode fsdp2_grad_op: the same with reshard_after_forward=False (SHARD_GRAD_OP, ZeRO-2-like:
              one all-gather per step, kept through backward, reduce-scatter): 2 psi by formula.

Timing: rank 0's wall time per step (the collectives keep the ranks in step); median over the
timed steps after --warmup. Prints (rank 0):
    RESULT impl=torch-ddp shape=tiny world=2 median_ms=... tok_s=... allreduce_bytes=... ...
tok_s counts the global batch (world x B x T tokens per step).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step_torch import SHAPES  # noqa: E402  (one source for the shapes)


def worker(rank, args, store_path):
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=args.world)
    from transformers import LlamaConfig, LlamaForCausalLM
    import transformers

    s = SHAPES[args.shape]
    cfg = LlamaConfig(**s, max_position_embeddings=max(1024, args.seq), rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False, hidden_act="silu",
                      bos_token_id=1, eos_token_id=2, use_cache=False,
                      attn_implementation="sdpa")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)  # same init on every rank (DDP broadcasts rank 0's anyway)
    model = LlamaForCausalLM(cfg).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    counted = {"bytes": 0}
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
        ws = args.world

        def counting_allreduce_hook(state, bucket):
            # the default hook's work (allreduce_hook: divide by world, all_reduce), plus a count
            t = bucket.buffer()
            state["bytes"] += t.numel() * t.element_size()
            fut = dist.all_reduce(t.div_(ws), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(counted, counting_allreduce_hook)
    else:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError as e:
            sys.exit(f"error: fully_shard not available in torch {torch.__version__}: {e}")
        raf = args.mode == "fsdp2"  # fsdp2_grad_op: keep the gathered parameters through backward
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=raf)
        fully_shard(model, reshard_after_forward=raf)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    B, T, V = args.batch, args.seq, s["vocab_size"]
    g = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own micro-batch
    ids = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)

    times, losses = [], []
    bytes_per_step = 0
    for i in range(args.warmup + args.steps):
        before = counted["bytes"]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.view(-1, V).float(), tgt.view(-1))
        loss.backward()
        opt.step()
        lv = loss.item()
        dt = time.perf_counter() - t0
        bytes_per_step = counted["bytes"] - before
        if i >= args.warmup:
            times.append(dt)
        losses.append(lv)
        if rank == 0:
            print(f"step {i}{' (warmup)' if i < args.warmup else ''}: {dt*1e3:.1f} ms loss(rank0) {lv:.4f}",
                  file=sys.stderr, flush=True)

    # mean loss over ranks = the global batch's loss (equal micro-batches)
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    lt /= args.world
    if rank == 0:
        med = statistics.median(times)
        N = args.world
        psi_bytes = n_params * 4
        if args.mode == "ddp":
            comm = (f"allreduce_bytes={bytes_per_step} (counted by a comm hook; psi*4={psi_bytes}) "
                    f"ring_sent_per_rank={2*(N-1)/N*bytes_per_step:.0f} (formula 2(N-1)/N)")
        elif args.mode == "fsdp2":
            comm = f"zero3_bytes_formula={3*psi_bytes} (3 psi, not counted)"
        else:
            comm = f"zero2_bytes_formula={2*psi_bytes} (2 psi, not counted)"
        print(f"# torch {torch.__version__} transformers {transformers.__version__} mode={args.mode} "
              f"backend=gloo world={N} threads/rank={args.threads} params={n_params} B/rank={B} T={T} "
              f"global_batch={N*B} losses(global mean)={[round(x, 6) for x in lt.tolist()]}", file=sys.stderr)
        print(f"RESULT impl=torch-{args.mode} shape={args.shape} world={N} median_ms={med*1e3:.1f} "
              f"tok_s={N*B*T/med:.1f} {comm}", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["ddp", "fsdp2", "fsdp2_grad_op"], default="ddp")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as d:
        mp.spawn(worker, args=(args, os.path.join(d, "store")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
