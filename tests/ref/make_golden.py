#!/usr/bin/env python3
"""Golden fixtures for fitllm: forward logits, loss, gradients and 5 AdamW steps
of three small random HF models (LLaMA with GQA, GPT-2 with tied embeddings, OPT).

Run from the repo root:
    /work/venv/bin/python tests/ref/make_golden.py [--out tests/fixtures]

Writes tests/fixtures/golden-llama/, golden-gpt2/ and golden-opt/ (--only NAME: just that one), each with
config.json + model.safetensors (HF save_pretrained, initial weights) and
golden.safetensors (see tests/ref/README.md for the exact contents).
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

B, T, V = 2, 40, 257
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
NSTEPS = 5


def make_batch(seed):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (B, T + 1), generator=g)
    input_ids = seq[:, :T].contiguous()
    targets = seq[:, 1:].contiguous()  # next tokens
    # ~10% ignored: fixed ones at the start and the last position, plus random.
    mask = torch.rand((B, T), generator=g) < 0.06
    mask[0, 0] = True
    mask[0, 1] = True
    mask[1, 0] = True
    mask[0, T - 1] = True
    mask[1, T - 1] = True
    targets[mask] = -100
    return input_ids.to(torch.int32), targets.to(torch.int32)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           targets.reshape(-1).long(), ignore_index=-100)


def init_llama(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


def init_gpt2(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_ln = ".ln_" in name or name.startswith("ln_f") or ".ln_f." in name
            if is_ln and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif is_ln and name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


def init_opt(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_ln = "layer_norm" in name
            if is_ln and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif is_ln and name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


def param_for_saved_names(model, saved_names):
    """Map each tensor name written by save_pretrained to the live Parameter."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for n in saved_names:
        if n in params:
            out[n] = params[n]
        else:
            # save_pretrained may strip the base-model prefix; try to add it back.
            cands = [k for k in params if k.endswith("." + n)]
            if len(cands) != 1:
                raise KeyError(f"cannot map saved tensor {n!r} to a parameter: {cands}")
            out[n] = params[cands[0]]
    # every trainable parameter must be covered exactly once
    live = {id(p) for p in model.parameters()}
    covered = {id(p) for p in out.values()}
    if live != covered:
        missing = [k for k, p in model.named_parameters() if id(p) not in covered]
        raise RuntimeError(f"parameters not in the saved file: {missing}")
    if len(covered) != len(out):
        raise RuntimeError("a parameter appears twice in the saved file")
    return out


def pnames_of(model):
    return {id(p): k for k, p in model.named_parameters()}


ADD_F64_ONLY = False


def build_golden(model, outdir, batch_seed, cmd):
    os.makedirs(outdir, exist_ok=True)
    model.save_pretrained(outdir, safe_serialization=True)
    saved = load_file(os.path.join(outdir, "model.safetensors"))
    pmap = param_for_saved_names(model, sorted(saved.keys()))
    for n, p in pmap.items():
        assert saved[n].shape == p.shape and saved[n].dtype == torch.float32, n
        assert torch.equal(saved[n], p.detach()), n

    input_ids, targets = make_batch(batch_seed)
    ids = input_ids.long()

    # float64 cross-check of the float32 forward/backward (reported only)
    m64 = type(model)(model.config).double()
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    m64.train()
    l64 = loss_fn(m64(input_ids=ids).logits, targets)
    l64.backward()
    g64 = {k: p.grad.detach().clone() for k, p in m64.named_parameters()}
    opt64 = torch.optim.AdamW(m64.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for _ in range(NSTEPS):
        opt64.zero_grad()
        loss_fn(m64(input_ids=ids).logits, targets).backward()
        opt64.step()
    p64 = {k: p.detach().clone() for k, p in m64.named_parameters()}
    del m64, opt64

    golden_path = os.path.join(outdir, "golden.safetensors")
    if ADD_F64_ONLY:
        # Keep the committed float32 tensors (PyTorch's fp32 kernels round differently on
        # different CPUs: AVX-512 vs AVX2) and add the float64 anchors, which do not depend
        # on the CPU beyond float64 rounding.
        with safe_open(golden_path, "pt") as f:
            meta = dict(f.metadata() or {})
        old = load_file(golden_path)
        assert torch.equal(old["input_ids"], input_ids) and torch.equal(old["targets"], targets)
        for n, p in pmap.items():
            old["after5_f64." + n] = p64[pnames_of(model)[id(p)]].contiguous().clone()
        meta["after5_f64"] = "float64 run of the same 5 AdamW steps (added with --add-f64)"
        save_file(old, golden_path, metadata=meta)
        print(f"  added {len(pmap)} after5_f64 tensors to {golden_path}")
        return

    out = {"input_ids": input_ids, "targets": targets}
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = loss_fn(logits, targets)
    loss.backward()
    out["logits"] = logits.detach().float().contiguous()
    out["loss"] = loss.detach().float().reshape(1)
    pnames = pnames_of(model)
    worst = 0.0
    for n, p in pmap.items():
        assert p.grad is not None, n
        out["grad." + n] = p.grad.detach().float().contiguous().clone()
        ref = g64[pnames[id(p)]]
        rel = ((p.grad.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, rel)
    print(f"  loss f32={loss.item():.8f} f64={l64.item():.8f}  "
          f"max grad rel err f32 vs f64 = {worst:.2e}")

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD)
    losses = []
    for _ in range(NSTEPS):
        opt.zero_grad()
        l = loss_fn(model(input_ids=ids).logits, targets)
        losses.append(l.item())
        l.backward()
        opt.step()
    out["losses5"] = torch.tensor(losses, dtype=torch.float32)
    for n, p in pmap.items():
        out["after5." + n] = p.detach().float().contiguous().clone()
    print("  losses5:", " ".join(f"{x:.6f}" for x in losses))
    d = max((p.detach().double() - p64[pnames[id(p)]]).abs().max().item() for p in pmap.values())
    print(f"  after5 max abs diff f32 vs f64 = {d:.2e}")
    # The float64 run of the same 5 steps from the same weights: the anchor the multi-step
    # check measures both implementations against (torch fp32's own distance to it is the
    # noise floor of this regime; see tests/ref/README.md).
    for n, p in pmap.items():
        out["after5_f64." + n] = p64[pnames[id(p)]].contiguous().clone()

    meta = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "optimizer": json.dumps({"name": "torch.optim.AdamW", "lr": LR, "betas": list(BETAS),
                                 "eps": EPS, "weight_decay": WD, "steps": NSTEPS,
                                 "amsgrad": False, "maximize": False}),
        "loss": "F.cross_entropy(logits.view(-1,V), targets.view(-1).long(), ignore_index=-100), mean over non-ignored; no label shifting",
        "batch": json.dumps({"B": B, "T": T, "V": V, "seed": batch_seed,
                             "n_ignored": int((targets == -100).sum())}),
        "tied": json.dumps(bool(getattr(model.config, "tie_word_embeddings", False))),
        "command": cmd,
    }
    save_file(out, os.path.join(outdir, "golden.safetensors"), metadata=meta)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--add-f64", action="store_true",
                    help="only add the float64 after5_f64.* anchors to the existing golden.safetensors")
    ap.add_argument("--only", choices=["llama", "gpt2", "opt"],
                    help="write only this fixture (the others' fp32 tensors depend on the CPU that made them)")
    args = ap.parse_args()
    global ADD_F64_ONLY
    ADD_F64_ONLY = args.add_f64
    cmd = "python tests/ref/make_golden.py " + " ".join(sys.argv[1:])
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)

    if args.only in (None, "llama"):
        make_llama(args, cmd)
    if args.only in (None, "gpt2"):
        make_gpt2(args, cmd)
    if args.only in (None, "opt"):
        make_opt(args, cmd)


def make_llama(args, cmd):
    cfg = LlamaConfig(
        hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=16, intermediate_size=160, vocab_size=V, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
        attn_implementation="eager", dtype=torch.float32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    m = LlamaForCausalLM(cfg).float()
    init_llama(m, seed=1234)
    print("golden-llama")
    build_golden(m, os.path.join(args.out, "golden-llama"), batch_seed=42, cmd=cmd)


def make_gpt2(args, cmd):
    cfg = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=V,
        layer_norm_epsilon=1e-5, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        tie_word_embeddings=True, bos_token_id=V - 1, eos_token_id=V - 1,
        attn_implementation="eager", dtype=torch.float32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(5678)
    m = GPT2LMHeadModel(cfg).float()
    init_gpt2(m, seed=5678)
    assert m.lm_head.weight is m.transformer.wte.weight
    print("golden-gpt2")
    build_golden(m, os.path.join(args.out, "golden-gpt2"), batch_seed=43, cmd=cmd)


def make_opt(args, cmd):
    # OPT: pre-norm LayerNorm blocks with biases, learned positions (table offset 2), ReLU, tied head
    cfg = OPTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96, vocab_size=V,
        max_position_embeddings=64, word_embed_proj_dim=64, do_layer_norm_before=True,
        activation_function="relu", enable_bias=True, layer_norm_elementwise_affine=True,
        dropout=0.0, attention_dropout=0.0, layerdrop=0.0, tie_word_embeddings=True,
        pad_token_id=1, bos_token_id=2, eos_token_id=2,
        attn_implementation="eager", dtype=torch.float32)
    cfg._attn_implementation = "eager"
    torch.manual_seed(9012)
    m = OPTForCausalLM(cfg).float()
    init_opt(m, seed=9012)
    assert m.lm_head.weight is m.model.decoder.embed_tokens.weight
    print("golden-opt")
    build_golden(m, os.path.join(args.out, "golden-opt"), batch_seed=44, cmd=cmd)


if __name__ == "__main__":
    main()
