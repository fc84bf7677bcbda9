#!/usr/bin/env python3
"""PyTorch side of the consolidated-checkpoint memory benchmark (bench/run_ckpt_mem.sh is fitllm's).

    /work/venv/bin/python bench/ckpt_mem_torch.py --shape small [--world 2]

--world processes (torch.multiprocessing.spawn), gloo over a file store, 1 thread each. The model of
bench/bench_step_torch.py's SHAPES (LlamaForCausalLM, fp32, untied head), FSDP2 (fully_shard on every
decoder layer, then the root: FULL_SHARD), AdamW; one step on micro batch 1 x 48 random tokens per
rank; then the consolidated checkpoint as PyTorch's documented way of writing one file set:
get_state_dict(model, opt, StateDictOptions(full_state_dict=True, cpu_offload=True)) (rank 0 receives
the full model and optimizer state in CPU memory, the other ranks take part in the gathers), rank 0
writes model.safetensors and torch.save's the optimizer state. Prints per rank the RSS after the
imports (the process baseline: torch + transformers) and the peak RSS (ru_maxrss) at the end:
    RESULT impl=torch-fsdp2 shape=small rank=R import_rss_kb=... peak_rss_kb=...
"""
import argparse
import os
import resource
import sys
import tempfile


def rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def worker(rank, args, store_path, out_dir):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_step_torch import SHAPES
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from safetensors.torch import save_file

    import_rss = rss_kb()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=args.world)
    s = SHAPES[args.shape]
    cfg = LlamaConfig(**s, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(2 + rank)
    ids = torch.randint(0, s["vocab_size"], (1, 48), generator=g)
    loss = F.cross_entropy(model(input_ids=ids).logits.view(-1, s["vocab_size"]), ids.view(-1))
    loss.backward()
    opt.step()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=opts)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in msd.items()}, os.path.join(out_dir, "model.safetensors"))
        torch.save(osd, os.path.join(out_dir, "optimizer.pt"))
    dist.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"RESULT impl=torch-fsdp2 shape={args.shape} rank={rank} import_rss_kb={import_rss} peak_rss_kb={peak} "
          f"torch={torch.__version__}", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(args, os.path.join(d, "store"), d), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
