#!/usr/bin/env python3
"""PyTorch side of the training-step benchmark (compare with `fitllm bench-step`).

    /work/venv/bin/python bench/bench_step_torch.py --shape tiny --batch 4 --seq 256 \
        --steps 10 --warmup 2 --threads 2

One step = zero_grad(set_to_none=True), forward, F.cross_entropy on random targets,
backward, AdamW step. fp32, LLaMA, untied head, no biases, sdpa attention.

Precision (--precision): 32-true (default); bf16-mixed = torch.autocast(cpu, bfloat16) around
forward + loss, fp32 weights and AdamW; bf16-true = model.to(torch.bfloat16), AdamW on the bf16
parameters (bf16 optimizer state), LoRA adapters kept bf16 too. The loss is always computed on
logits.float().

QLoRA (--quantize nf4 | nf4-dq, also spelled bnb.nf4 / bnb.nf4-dq as fitllm does; needs --lora R):
the random model is written to a temporary folder by a child process (so its fp32 copy does not
count in peak_rss_mb), then loaded with transformers BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=<dq>, bnb_4bit_compute_dtype=float32, or
bfloat16 with --precision bf16-true; --bnb-compute-dtype overrides): every nn.Linear of the
decoder layers becomes a bitsandbytes Linear4bit (blocksize 64), lm_head, embeddings and norms
stay unquantized; PEFT then puts LoRA on q_proj+v_proj (peft.tuners.lora.bnb.Linear4bit).
prepare_model_for_kbit_training is not called. Runs on CPU with bitsandbytes >= 0.49 (its CPU
backend; without the optional `kernels` package it dequantizes and calls torch matmul).
Phases (as `fitllm bench-step` reports them): the step runs the decoder body (embedding + blocks +
final norm) and the head separately: hidden = model.model(ids); h = hidden.detach().requires_grad_();
loss = cross_entropy(lm_head(h)); loss.backward() (head+loss: lm_head and CE forward and their
backward, which gives h.grad); hidden.backward(h.grad) (the body's backward); then the AdamW step.
Same math as one loss.backward() (the chain rule cut at the hidden states); --no-phases times the
plain single-backward step instead (phase fields then absent) to check the cut costs nothing.
Prints one line (phase fields: medians over the timed steps):
    RESULT impl=torch shape=tiny median_ms=... tok_s=... gflops=... peak_rss_mb=... fwd_ms=...
        head_ms=... bwd_ms=... opt_ms=...
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

def llama_config(s, seq):
    """The benchmarks' LlamaConfig of shape s (a SHAPES entry) for sequences of seq tokens: fp32 rmsnorm 1e-5,
    rope 10000, untied head, no biases, SiLU, sdpa (as fitllm's LLaMA presets)"""
    from transformers import LlamaConfig
    cfg = LlamaConfig(**s, max_position_embeddings=max(1024, seq), rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False, hidden_act="silu",
                      bos_token_id=1, eos_token_id=2, use_cache=False,
                      attn_implementation="sdpa")
    cfg._attn_implementation = "sdpa"
    return cfg


SHAPES = {
    "tiny": dict(hidden_size=288, num_hidden_layers=6, num_attention_heads=6,
                 num_key_value_heads=6, intermediate_size=768, vocab_size=32000),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, intermediate_size=2048, vocab_size=32000),
    # TinyLlama-1.1B's shapes (the preset tinyllama-1.1b of fitllm)
    "tinyllama-1.1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, intermediate_size=5632, vocab_size=32000),
    # OPT-125m's shapes (fitllm's preset opt-125m; OPTForCausalLM: LayerNorm, biases, ReLU, learned
    # positions, tied head; dropout off as fitllm has none)
    "opt-125m": dict(arch="opt", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     ffn_dim=3072, vocab_size=50272),
}


def load_quantized(args, cfg, quant, bf16_true):
    """Random model -> temp folder (child process) -> from_pretrained with a 4-bit bnb config."""
    import os
    import subprocess
    import tempfile
    try:
        import bitsandbytes as bnb
        from transformers import BitsAndBytesConfig, LlamaForCausalLM
    except ImportError as e:
        sys.exit(f"error: --quantize needs bitsandbytes (pip install bitsandbytes): {e}")
    cd = args.bnb_compute_dtype
    cd = torch.bfloat16 if (cd == "bfloat16" or (cd == "auto" and bf16_true)) else torch.float32
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                            bnb_4bit_use_double_quant=(quant == "nf4-dq"), bnb_4bit_compute_dtype=cd)
    with tempfile.TemporaryDirectory(prefix="bench_step_q4_") as d:
        cmd = [sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--seed", str(args.seed),
               "--threads", str(args.threads), "--_save-random", d]
        subprocess.run(cmd, check=True)
        try:
            model = LlamaForCausalLM.from_pretrained(
                d, quantization_config=qc, dtype=torch.bfloat16 if bf16_true else torch.float32,
                device_map="cpu", attn_implementation="sdpa")
        except Exception as e:  # noqa: BLE001
            sys.exit(f"error: bitsandbytes {bnb.__version__} could not load a 4-bit model on CPU: {e}")
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    print(f"# bitsandbytes {bnb.__version__}: {n4} Linear4bit layers ({quant}, compute {cd}), "
          f"lm_head {type(model.lm_head).__name__}", file=sys.stderr)
    if n4 == 0:
        sys.exit("error: no layer was quantized")
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", choices=["32-true", "bf16-mixed", "bf16-true"], default="32-true",
                    help="bf16-mixed = torch.autocast(cpu, bfloat16) around forward+loss; "
                         "bf16-true = model.to(bfloat16), AdamW on bf16 params")
    ap.add_argument("--quantize", default="", metavar="nf4|nf4-dq",
                    help="QLoRA base: bitsandbytes 4-bit NF4 (nf4-dq: double-quantized absmax); needs --lora")
    ap.add_argument("--bnb-compute-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="bnb_4bit_compute_dtype (auto: bfloat16 for bf16-true, else float32)")
    ap.add_argument("--_save-random", dest="save_random", default="", help=argparse.SUPPRESS)
    ap.add_argument("--lora", type=int, default=0,
                    help="LoRA rank (peft LoraConfig r, alpha 2r, q_proj+v_proj, dropout 0); base frozen")
    ap.add_argument("--act-ckpt", action="store_true",
                    help="activation checkpointing (model.gradient_checkpointing_enable, torch.utils.checkpoint)")
    ap.add_argument("--no-phases", dest="phases", action="store_false",
                    help="one loss.backward() per step, no per-phase times")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the model, data and optimizer on the GPU (timings synchronized; peak memory "
                         "= torch.cuda.max_memory_allocated); bf16-mixed autocasts on cuda")
    args = ap.parse_args()
    quant = args.quantize[4:] if args.quantize.startswith("bnb.") else args.quantize
    if quant not in ("", "nf4", "nf4-dq"):
        ap.error(f"--quantize {args.quantize!r}: supported: nf4, nf4-dq (or bnb.nf4, bnb.nf4-dq)")
    if quant and not args.lora and not args.save_random:
        ap.error("--quantize needs --lora R (QLoRA: the 4-bit base is frozen)")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    from transformers import LlamaConfig, LlamaForCausalLM
    import transformers

    s = dict(SHAPES[args.shape])
    if s.pop("arch", "llama") == "opt":
        from transformers import OPTConfig, OPTForCausalLM
        if quant:
            sys.exit("bench_step_torch.py: --quantize is for the LLaMA shapes")
        LlamaForCausalLM = OPTForCausalLM  # noqa: N806 (the same calls below)
        s["num_key_value_heads"] = s["num_attention_heads"]
        cfg = OPTConfig(hidden_size=s["hidden_size"], num_hidden_layers=s["num_hidden_layers"],
                        num_attention_heads=s["num_attention_heads"], ffn_dim=s["ffn_dim"],
                        vocab_size=s["vocab_size"], max_position_embeddings=max(2048, args.seq),
                        word_embed_proj_dim=s["hidden_size"], do_layer_norm_before=True, enable_bias=True,
                        activation_function="relu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        layerdrop=0.0, tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa")
    else:
        cfg = llama_config(s, args.seq)
    cfg._attn_implementation = "sdpa"
    bf16_true = args.precision == "bf16-true"
    if args.save_random:  # child process of the --quantize path: write the random fp32 model
        LlamaForCausalLM(cfg).float().save_pretrained(args.save_random, safe_serialization=True)
        return
    if quant:
        model = load_quantized(args, cfg, quant, bf16_true)
    else:
        model = LlamaForCausalLM(cfg).float()
        if bf16_true:
            model = model.to(torch.bfloat16)
        model = model.to(dev)
    model.train()
    if args.act_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], bias="none",
                                                 task_type="CAUSAL_LM"),
                               autocast_adapter_dtype=not bf16_true)  # bf16-true: bf16 adapters too
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.1)

    B, T, V = args.batch, args.seq, s["vocab_size"]
    L, H = s["num_hidden_layers"], s["hidden_size"]
    # logical sizes (a bnb Linear4bit is an nn.Linear whose weight holds packed bytes)
    n_lin = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    n_all = sum(p.quant_state.shape.numel() if getattr(p, "quant_state", None) is not None else p.numel()
                for p in model.parameters())
    flops = 6 * n_lin * B * T + 6 * L * B * T * T * H

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    tgt = torch.randint(0, V, (B, T), generator=g).to(dev)

    import contextlib
    amp = (torch.autocast(device_type=args.device, dtype=torch.bfloat16) if args.precision == "bf16-mixed"
           else contextlib.nullcontext())

    def step():
        opt.zero_grad(set_to_none=True)
        with amp:
            logits = model(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits.view(-1, V).float(), tgt.view(-1))
        loss.backward()
        opt.step()
        return loss.item(), None

    base = model.get_base_model() if args.lora else model  # LlamaForCausalLM (PEFT layers inside)
    body, head = (base.model.decoder if hasattr(base.model, "decoder") else base.model), base.lm_head

    def step_phases():
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        with amp:
            hidden = body(input_ids=ids, use_cache=False).last_hidden_state  # (B, T, C) after the final norm
        sync()
        t1 = time.perf_counter()
        h = hidden.detach().requires_grad_(True)
        with amp:
            loss = F.cross_entropy(head(h).view(-1, V).float(), tgt.view(-1))
        loss.backward()  # head + loss, forward and backward: h.grad
        sync()
        t2 = time.perf_counter()
        hidden.backward(h.grad)
        sync()
        t3 = time.perf_counter()
        opt.step()
        sync()
        t4 = time.perf_counter()
        return loss.item(), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)

    times, phases = [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        loss, ph = step_phases() if args.phases else step()
        sync()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
            phases.append(ph)
        pt = f" (fwd {ph[0]*1e3:.1f}, head+loss {ph[1]*1e3:.1f}, bwd {ph[2]*1e3:.1f}, opt {ph[3]*1e3:.1f})" if ph else ""
        print(f"step {i}{' (warmup)' if i < args.warmup else ''}: {dt*1e3:.1f} ms{pt} loss {loss:.4f}",
              file=sys.stderr, flush=True)

    med = statistics.median(times)
    phase_kv = ""
    if args.phases:
        phase_kv = "".join(f" {k}_ms={statistics.median(p[j] for p in phases)*1e3:.2f}"
                           for j, k in enumerate(("fwd", "head", "bwd", "opt")))
    tok_s = B * T / med
    gflops = flops / med / 1e9
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if args.device == "cuda":  # the GPU's peak, as fitllm's report counts its device pool
        rss_mb = torch.cuda.max_memory_allocated() / 2**20
    print(f"# torch {torch.__version__} transformers {transformers.__version__} "
          f"precision={args.precision} quantize={quant or 'none'} lora={args.lora} "
          f"dtypes={sorted({str(p.dtype).replace('torch.', '') for p in model.parameters()})} "
          f"threads={args.threads} params={n_all} linear_params={n_lin} "
          f"flops_per_step={flops} B={B} T={T}", file=sys.stderr)
    print(f"RESULT impl=torch shape={args.shape} median_ms={med*1e3:.1f} tok_s={tok_s:.1f} "
          f"gflops={gflops:.2f} peak_rss_mb={rss_mb:.1f}{phase_kv}", flush=True)


if __name__ == "__main__":
    main()
