#!/usr/bin/env python3
"""PyTorch side of the T5 training-step benchmark (compare with `fitllm bench-step t5-small --source-seq S --seq T`;
bench/run_bench_t5.sh runs both side by side; issue 31's performance target).

    /work/venv-graph/bin/python bench/bench_t5_torch.py --shape t5-small --batch 4 --source 128 --target 32 \
        --steps 5 --warmup 2 --threads 2
    python3 bench/bench_t5_torch.py --device cuda --dtype bf16 --dropout 0.1 --shape flan-t5-base --batch 8 \
        --source 512 --target 128 --attn sdpa      (the GPU peer of tests/cuda/device_quick.sh step 7c)

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0.

One step, as fitllm's bench-step (fl_step_run) does it: zero_grad(set_to_none=True), the forward of
T5ForConditionalGeneration with labels (its cross-entropy over the target), backward, gradient clipping to norm 1.0,
AdamW (lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.1), fp32 throughout, dropout 0 (bench-step runs its step without dropout), the
model randomly initialized (--dtype bf16: the model in bfloat16, fitllm's bf16-true; --dropout P: T5's dropout_rate, as
`bench-step --dropout`; --device cuda: on the GPU, synchronized before each step's clock stops; fused AdamW there), random source and target ids (every position real, no padding), the decoder input the
start token then the targets but their last. Prints one line (medians over the timed steps):
    RESULT impl=torch shape=t5-small median_ms=... tok_s=... gflops=... peak_rss_mb=...
tok_s counts source + target tokens; FLOPs as fitllm's fl_model_train_flops_s2s.
"""
import argparse
import resource
import statistics
import time

import torch
from transformers import T5Config, T5ForConditionalGeneration

SHAPES = {
    # the real t5-small (T5 v1.0: ReLU FFN, tied head scaled by d_model^-0.5): fitllm's preset t5-small
    "t5-small": dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8,
                     vocab_size=32128, feed_forward_proj="relu", tie_word_embeddings=True),
    # Flan-T5 (T5 v1.1: gated-GELU, untied head): fitllm's presets flan-t5-small / -base / -large / -xl
    "flan-t5-small": dict(d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_decoder_layers=8, num_heads=6,
                          vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "flan-t5-base": dict(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12, num_heads=12,
                         vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "flan-t5-large": dict(d_model=1024, d_kv=64, d_ff=2816, num_layers=24, num_decoder_layers=24, num_heads=16,
                          vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "flan-t5-xl": dict(d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_decoder_layers=24, num_heads=32,
                       vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    # fitllm's t5-micro (a Flan-T5 shape for quick runs)
    "t5-micro": dict(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
                     vocab_size=512, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                     relative_attention_num_buckets=32, relative_attention_max_distance=128),
}


def flops(c, B, Ts, Tt):
    """fl_model_train_flops_s2s (src/model/model.c)"""
    C, QD, F = c.d_model, c.num_heads * c.d_kv, c.d_ff
    FCW = 2 * F if c.is_gated_act else F
    Le, Ld, ns, nt = c.num_layers, c.num_decoder_layers, B * Ts, B * Tt
    self_, ffn, xq_o, xkv = 3 * QD * C + C * QD, FCW * C + C * F, 2 * QD * C, 2 * QD * C
    mat = Le * (self_ + ffn) * ns + (Ld * (self_ + xq_o + ffn) + c.vocab_size * C) * nt + Ld * xkv * ns
    attn = 12.0 * QD * (Le * ns * Ts + Ld * nt * Tt / 2.0 + Ld * nt * Ts)
    return 6.0 * mat + attn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="t5-small", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--source", type=int, default=128)
    ap.add_argument("--target", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = T5Config(dropout_rate=a.dropout, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **SHAPES[a.shape])
    cfg._attn_implementation = a.attn
    dev = torch.device(a.device)
    model = T5ForConditionalGeneration(cfg).train().to(dev)
    if a.dtype == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                            fused=a.device == "cuda")
    g = torch.Generator().manual_seed(a.seed)
    src = torch.randint(2, cfg.vocab_size, (a.batch, a.source), generator=g).to(dev)
    labels = torch.randint(2, cfg.vocab_size, (a.batch, a.target), generator=g).to(dev)
    dec = torch.cat([torch.zeros(a.batch, 1, dtype=torch.long, device=dev), labels[:, :-1]], dim=1)
    mask = torch.ones_like(src)
    times = []
    for k in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=src, attention_mask=mask, decoder_input_ids=dec, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if a.device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        print(f"  step {k + 1:3d}  loss {out.loss.item():.4f}  {ms:8.1f} ms{'  [warmup]' if k < a.warmup else ''}",
              flush=True)
        if k >= a.warmup:
            times.append(ms)
    med = statistics.median(times)
    toks = a.batch * (a.source + a.target) / (med / 1e3)
    gf = flops(cfg, a.batch, a.source, a.target) / (med / 1e3) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    gpu = ""
    if a.device == "cuda":
        gpu = f" max_memory_allocated_mb={torch.cuda.max_memory_allocated() / 2**20:.1f} gpu={torch.cuda.get_device_name()!r}"
    print(f"RESULT impl=torch shape={a.shape} median_ms={med:.2f} tok_s={toks:.1f} gflops={gf:.2f} "
          f"peak_rss_mb={rss:.1f} torch={torch.__version__} threads={torch.get_num_threads()} device={a.device} "
          f"dtype={a.dtype} dropout={a.dropout} attn={a.attn}{gpu}")


if __name__ == "__main__":
    main()
