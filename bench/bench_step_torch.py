#!/usr/bin/env python3
"""PyTorch side of the training-step benchmark (compare with `fitllm bench-step`).

    /work/venv/bin/python bench/bench_step_torch.py --shape tiny --batch 4 --seq 256 \
        --steps 10 --warmup 2 --threads 2

One step = zero_grad(set_to_none=True), forward, F.cross_entropy on random targets,
backward, AdamW step. fp32, LLaMA, untied head, no biases, sdpa attention.
Prints one line:
    RESULT impl=torch shape=tiny median_ms=... tok_s=... gflops=... peak_rss_mb=...
FLOPs per step = 6*N*B*T + 6*L*B*T*T*hidden, N = all linear weights incl. lm_head,
excluding embeddings.
"""
import argparse
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "tiny": dict(hidden_size=288, num_hidden_layers=6, num_attention_heads=6,
                 num_key_value_heads=6, intermediate_size=768, vocab_size=32000),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, intermediate_size=2048, vocab_size=32000),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true",
                    help="bf16-mixed = torch.autocast(cpu, bfloat16) around forward+loss")
    ap.add_argument("--lora", type=int, default=0,
                    help="LoRA rank (peft LoraConfig r, alpha 2r, q_proj+v_proj, dropout 0); base frozen")
    ap.add_argument("--act-ckpt", action="store_true",
                    help="activation checkpointing (model.gradient_checkpointing_enable, torch.utils.checkpoint)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import LlamaConfig, LlamaForCausalLM
    import transformers

    s = SHAPES[args.shape]
    cfg = LlamaConfig(**s, max_position_embeddings=1024, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False, hidden_act="silu",
                      bos_token_id=1, eos_token_id=2, use_cache=False,
                      attn_implementation="sdpa")
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).float()
    model.train()
    if args.act_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], bias="none",
                                                 task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.1)

    B, T, V = args.batch, args.seq, s["vocab_size"]
    L, H = s["num_hidden_layers"], s["hidden_size"]
    n_lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    n_all = sum(p.numel() for p in model.parameters())
    flops = 6 * n_lin * B * T + 6 * L * B * T * T * H

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)

    import contextlib
    amp = (torch.autocast(device_type="cpu", dtype=torch.bfloat16) if args.precision == "bf16-mixed"
           else contextlib.nullcontext())

    def step():
        opt.zero_grad(set_to_none=True)
        with amp:
            logits = model(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits.view(-1, V).float(), tgt.view(-1))
        loss.backward()
        opt.step()
        return loss.item()

    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
        print(f"step {i}{' (warmup)' if i < args.warmup else ''}: {dt*1e3:.1f} ms loss {loss:.4f}",
              file=sys.stderr, flush=True)

    med = statistics.median(times)
    tok_s = B * T / med
    gflops = flops / med / 1e9
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"# torch {torch.__version__} transformers {transformers.__version__} "
          f"threads={args.threads} params={n_all} linear_params={n_lin} "
          f"flops_per_step={flops} B={B} T={T}", file=sys.stderr)
    print(f"RESULT impl=torch shape={args.shape} median_ms={med*1e3:.1f} tok_s={tok_s:.1f} "
          f"gflops={gflops:.2f} peak_rss_mb={rss_mb:.1f}", flush=True)


if __name__ == "__main__":
    main()
