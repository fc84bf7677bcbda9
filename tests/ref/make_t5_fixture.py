#!/usr/bin/env python3
"""Fixtures for fitllm's T5 (src/model/arch_t5.c, src/model/seq2seq.c, tests/test_t5.c): tiny random
transformers T5ForConditionalGeneration models of both variants saved as HF folders, and what fitllm must
reproduce.

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0,
numpy 2.4.6, peft 0.21.2. Run from the repo root:
    python tests/ref/make_t5_fixture.py [--out tests/fixtures]

Variants (odd sizes: vocab 97, d_model 36, d_kv 10, 3 heads (inner 30 != d_model), d_ff 52, 2 encoder and 3
decoder blocks, 8 buckets up to distance 20, dropout 0):
  t5-tiny-relu   T5 v1.0: feed_forward_proj "relu", tied head with the decoder output scaled by d_model^-0.5
  t5-tiny-gated  T5 v1.1 / Flan: "gated-gelu" (gelu_new), untied lm_head, no scaling
A T5Config built in memory by transformers 5 always ties lm_head to shared.weight (it keeps only
scale_decoder_outputs from tie_word_embeddings); the v1.1 checkpoints (flan-t5-*) carry their own lm_head.weight
with tie_word_embeddings false, and from_pretrained keeps it untied when the file's values differ. So the gated
reference unties lm_head in memory (a parameter of its own) and the folder is written as those checkpoints are
(config.json with tie_word_embeddings false, model.safetensors with lm_head.weight; save_pretrained would drop
it); from_pretrained of that folder gives the fixture's loss (5.14351511 vs 5.14351509).

Each folder gets config.json + model.safetensors and expected.safetensors:
  src (I32 B x Ts), src_mask (U8 B x Ts: sequence 1's last 3 source tokens padded, id 0), dec (I32 B x Tt: the
  start token then the labels shifted right, as _shift_right), labels (I32 B x Tt: sequence 1's last 4 = -100),
  logits (F32, float64 run rounded), loss (F64 [1]), grad.<name> (F32: the float64 gradients of the mean loss),
  noise.logits / noise.loss / noise.<name> (F32 [1]: max |PyTorch fp32 - float64| of the same tensor: the fp32
  noise the C test anchors its tolerances on), after5.<name> (F32: PyTorch fp32 after 5 AdamW steps on the same
  batch, lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1), after5_f64.<name> (F64: the same in float64),
  loss5 (F32 [5]: the fp32 run's loss before each step), gen0 / gen1 (I32: generate(do_sample=False,
  max_new_tokens=12) of each source sequence with its mask, from the fp32 weights: the start token, then up to 12
  tokens, eos included; use_cache=False: transformers 5.23 sizes the decoder's cache by num_layers, an IndexError
  when num_decoder_layers is larger).
And expected-lora.safetensors in t5-tiny-gated (make_lora: PEFT 0.21.2 LoRA on q, k, v, o, wi_0, wi_1, wo).
Weights are redrawn larger than T5's init (unit-ish activations, a relative bias table of scale 1) so that
attention is far from uniform and the bias, the mask and the scaling all move the result.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import T5Config, T5ForConditionalGeneration

B, TS, TT = 2, 13, 17
PAD_SRC, PAD_TGT = 3, 4
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
MAX_NEW = 12


def build(gated, seed):
    kw = dict(vocab_size=97, d_model=36, d_kv=10, d_ff=52, num_layers=2, num_decoder_layers=3, num_heads=3,
              relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
              layer_norm_epsilon=1e-6, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    cfg = T5Config(feed_forward_proj="gated-gelu" if gated else "relu",
                   tie_word_embeddings=not gated, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = T5ForConditionalGeneration(cfg).eval()
    if gated:  # an lm_head of its own (see the docstring)
        m.lm_head.weight = torch.nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "layer_norm" in name:
                p.copy_(1.0 + 0.2 * r)
            elif "relative_attention_bias" in name:
                p.copy_(r)
            elif name == "shared.weight":
                p.copy_(r)
            else:  # (out, in) linears, lm_head
                p.copy_(r / p.shape[1] ** 0.5)
    assert m.config.scale_decoder_outputs == (not gated)
    assert (m.lm_head.weight is m.shared.weight) == (not gated)
    return cfg, m


def params(m):
    """(name, parameter) in HF names, without the tied aliases"""
    return [(n, p) for n, p in m.named_parameters()
            if n not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")]


def run(m, batch, dtype):
    m = m.to(dtype)
    m.zero_grad()
    src, mask, dec, labels = batch
    out = m(input_ids=src.long(), attention_mask=mask.long(), decoder_input_ids=dec.long(), labels=labels.long())
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.detach().clone() for n, p in params(m)}


def adam5(m, batch, dtype):
    m = m.to(dtype)
    opt = torch.optim.AdamW([p for _, p in params(m)], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    src, mask, dec, labels = batch
    losses = []
    for _ in range(5):
        opt.zero_grad()
        out = m(input_ids=src.long(), attention_mask=mask.long(), decoder_input_ids=dec.long(), labels=labels.long())
        out.loss.backward()
        losses.append(out.loss.item())
        opt.step()
    return {n: p.detach().clone() for n, p in params(m)}, losses


def config_json(cfg, gated):
    """what the checkpoints carry (T5 v1.0: tie_word_embeddings absent = true; Flan: false)"""
    c = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": cfg.d_model,
         "d_kv": cfg.d_kv, "d_ff": cfg.d_ff, "num_layers": cfg.num_layers,
         "num_decoder_layers": cfg.num_decoder_layers, "num_heads": cfg.num_heads,
         "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
         "relative_attention_max_distance": cfg.relative_attention_max_distance,
         "feed_forward_proj": cfg.feed_forward_proj, "dense_act_fn": cfg.dense_act_fn,
         "is_gated_act": cfg.is_gated_act, "layer_norm_epsilon": cfg.layer_norm_epsilon,
         "vocab_size": cfg.vocab_size, "n_positions": 512, "dropout_rate": 0.0,
         "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1, "is_encoder_decoder": True}
    if gated:
        c["tie_word_embeddings"] = False
    return c


def make(out_dir, gated, seed):
    os.makedirs(out_dir, exist_ok=True)
    cfg, m = build(gated, seed)
    save_file({n: p.detach().contiguous() for n, p in params(m)}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json(cfg, gated), f, indent=2)
    g = torch.Generator().manual_seed(seed + 7)
    src = torch.randint(2, cfg.vocab_size, (B, TS), generator=g, dtype=torch.int32)
    mask = torch.ones(B, TS, dtype=torch.uint8)
    mask[1, TS - PAD_SRC:] = 0
    src[1, TS - PAD_SRC:] = 0
    labels = torch.randint(2, cfg.vocab_size, (B, TT), generator=g, dtype=torch.int32)
    labels[1, TT - PAD_TGT:] = -100
    dec = m._shift_right(labels.long()).int()  # start token 0, then labels[:-1] with -100 -> pad 0
    batch = (src, mask, dec, labels)
    state = {n: p.detach().clone() for n, p in m.state_dict().items()}
    l32, s32, g32 = run(m, batch, torch.float32)
    l64, s64, g64 = run(m, batch, torch.float64)
    m.load_state_dict(state)
    a32, losses = adam5(m.float(), batch, torch.float32)
    m.load_state_dict({k: v.double() for k, v in state.items()})
    a64, _ = adam5(m, batch, torch.float64)
    m.float().load_state_dict(state)  # greedy decoding of each sequence (its padding masked) from the fp32 weights
    gen = [m.generate(input_ids=src[b:b + 1].long(), attention_mask=mask[b:b + 1].long(), max_new_tokens=MAX_NEW,
                      do_sample=False, use_cache=False)[0].int() for b in range(B)]
    noise = lambda a, b: (a.double() - b).abs().max().float().reshape(1)
    out = {"src": src, "src_mask": mask, "dec": dec, "labels": labels, "logits": l64.float().contiguous(),
           "loss": s64.reshape(1), "noise.logits": noise(l32, l64), "noise.loss": noise(s32, s64),
           "loss5": torch.tensor(losses, dtype=torch.float32), "gen0": gen[0].contiguous(), "gen1": gen[1].contiguous()}
    for n in g64:
        out["grad." + n] = g64[n].float().contiguous()
        out["noise." + n] = noise(g32[n], g64[n])
        out["after5." + n] = a32[n].float().contiguous()
        out["after5_f64." + n] = a64[n].double().contiguous()
    save_file(out, os.path.join(out_dir, "expected.safetensors"))
    print(f"{out_dir}: loss {s64.item():.8f} (fp32 noise {noise(s32, s64).item():.3g}), logits noise "
          f"{noise(l32, l64).item():.3g} (scale {l64.abs().max().item():.3g}), {len(g64)} gradients, "
          f"worst grad noise {max(noise(g32[n], g64[n]).item() for n in g64):.3g}; greedy {gen[0].tolist()} "
          f"{gen[1].tolist()}")


LORA_TARGETS = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]


def make_lora(out_dir, seed):
    """LoRA on every linear of the gated model (PEFT's T5 names; "q" etc. match the self- and the cross-attention of
    both stacks), r 4, alpha 8, no dropout, A and B drawn at random (B nonzero so that every path carries a
    gradient): expected-lora.safetensors with A.<module>, B.<module> (F32, PEFT's shapes), logits, loss,
    gA.<module> / gB.<module> (float64 gradients of the mean loss) and noise.* (PyTorch fp32's distance to them)."""
    from peft import LoraConfig, get_peft_model
    cfg, m = build(True, seed)
    pm = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(seed + 3)
    mods = {}
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if hasattr(mod, "lora_A") and "default" in mod.lora_A:
                a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
                a.copy_(torch.randn(a.shape, generator=g) / a.shape[1] ** 0.5)
                b.copy_(0.5 * torch.randn(b.shape, generator=g) / b.shape[1] ** 0.5)
                mods[name.replace("base_model.model.", "")] = mod
    x = dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(os.path.join(out_dir, "expected.safetensors")))
    src, mask, dec, labels = x["src"], x["src_mask"], x["dec"], x["labels"]
    res = {}
    for dt in (torch.float32, torch.float64):
        pm.to(dt)
        pm.zero_grad()
        o = pm(input_ids=src.long(), attention_mask=mask.long(), decoder_input_ids=dec.long(), labels=labels.long())
        o.loss.backward()
        res[dt] = (o.logits.detach(), o.loss.detach(),
                   {n: (md.lora_A["default"].weight.grad.clone(), md.lora_B["default"].weight.grad.clone())
                    for n, md in mods.items()})
    (l32, s32, g32), (l64, s64, g64) = res[torch.float32], res[torch.float64]
    noise = lambda a, b: (a.double() - b).abs().max().float().reshape(1)
    out = {"logits": l64.float().contiguous(), "loss": s64.reshape(1), "noise.logits": noise(l32, l64),
           "noise.loss": noise(s32, s64)}
    for n, md in mods.items():
        out["A." + n] = md.lora_A["default"].weight.detach().float().contiguous()
        out["B." + n] = md.lora_B["default"].weight.detach().float().contiguous()
        out["gA." + n], out["gB." + n] = g64[n][0].float().contiguous(), g64[n][1].float().contiguous()
        out["noise.gA." + n], out["noise.gB." + n] = noise(g32[n][0], g64[n][0]), noise(g32[n][1], g64[n][1])
    save_file(out, os.path.join(out_dir, "expected-lora.safetensors"))
    print(f"{out_dir} LoRA ({len(mods)} modules): loss {s64.item():.8f}, logits noise {noise(l32, l64).item():.3g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    a = ap.parse_args()
    make(os.path.join(a.out, "t5-tiny-relu"), gated=False, seed=0)
    make(os.path.join(a.out, "t5-tiny-gated"), gated=True, seed=10)
    make_lora(os.path.join(a.out, "t5-tiny-gated"), seed=10)


if __name__ == "__main__":
    main()
