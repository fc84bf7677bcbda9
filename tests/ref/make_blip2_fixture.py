#!/usr/bin/env python3
"""Fixture for fitllm's BLIP-2 (src/model/arch_blip2.c, src/model/blip2.c, tests/test_blip2.c): a tiny random
transformers Blip2ForConditionalGeneration (OPT language model) saved as an HF folder, and what fitllm must reproduce.

Pinned versions (tests/ref/requirements.txt): torch 2.15.0, transformers 5.23.0, safetensors 0.8.0, numpy 2.4.6.
Run from the repo root:
    python tests/ref/make_blip2_fixture.py [--out tests/fixtures]

Sizes (odd on purpose): vision hidden 24, 3 heads, MLP 40, 2 blocks, 12x12 images of 4x4 patches (9 patches + the
class token); Q-Former hidden 20, 2 heads, MLP 36, 3 blocks, cross-attention every 2 (blocks 0 and 2) to the
24-wide image features, 5 query tokens; OPT vocab 103, hidden 28, 4 heads, MLP 44, 2 blocks; image_token_index 100.
hidden_act: the vision tower's "gelu" (the exact erf GELU, as the checkpoints), the Q-Former's "gelu_pytorch_tanh"
(both ops covered). Dropout 0.

blip2-tiny-opt/: config.json, model.safetensors (transformers 5's names: the vision qkv bias is one fused (3C)
tensor) and expected.safetensors:
  pixels (F32 B x 3 x 12 x 12), ids (I32 B x T: 5 image tokens, then the caption: BOS and 6 tokens; sequence 1's
  last 2 are padding id 1), labels (I32 B x 7: the caption, sequence 1's last 2 = -100), image_embeds (F32: the
  vision tower's output, float64 run rounded), query_output (F32: the Q-Former's), logits (F32 B x T x V), loss
  (F64 [1]), grad.<name> (F32: the float64 gradients of the mean loss), noise.<x> (F32 [1]: max |PyTorch fp32 -
  float64| of the same tensor: the fp32 noise the C test's tolerances are anchored on), gen0 / gen1 (I32:
  generate(do_sample=False, max_new_tokens=8) of each image from the fp32 weights: the tokens after the 5 image
  placeholders and BOS, eos included), genp0 (I32: the same for image 0 with the prompt ids 17 29 31 after BOS),
  loss5 (F32 [5]: PyTorch fp32's loss before each of 5 AdamW steps on the batch, lr 1e-3, betas (0.9, 0.95), eps 1e-8,
  weight decay 0.1, every parameter), after5.<name> (F32: PyTorch fp32's weights after them), after5_f64.<name> (F64:
  the same in float64).
And for the CLI (tests/cli_test.sh): preprocessor_config.json (BlipImageProcessor at 12x12, bicubic, CLIP's mean and
std) and expected-cli.json: the loss of the caption ids CLI_CAPTION for tests/fixtures/images/palette_45x31.png (the
processor's pixel_values, 5 placeholders then the caption; the mean cross-entropy of caption[1:]) and the greedy
caption of that image (generate(do_sample=False, max_new_tokens=8): the new ids).
Weights are redrawn larger than the init (unit-ish activations) so that attention is far from uniform.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import Blip2Config, Blip2ForConditionalGeneration, OPTConfig

B, NQ, TC, PAD = 2, 5, 7, 2
IMG_TOK, MAX_NEW = 100, 8
PROMPT = [17, 29, 31]


# the image parts of both fixtures
VC = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3, image_size=12, patch_size=4,
          hidden_act="gelu", layer_norm_eps=1e-6, qkv_bias=True, attention_dropout=0.0)
QC = dict(hidden_size=20, num_hidden_layers=3, num_attention_heads=2, intermediate_size=36, cross_attention_frequency=2,
          encoder_hidden_size=24, hidden_act="gelu_pytorch_tanh", hidden_dropout_prob=0.0,
          attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)


def redraw(m, seed):
    """every parameter redrawn (in named_parameters' order, one generator): norms 1 + 0.2 r, T5's relative bias tables
    r, other 1-D tensors and biases 0.2 r, the queries, class token, ViT positions and T5's shared table r, OPT's
    tied token table and positions 0.3 r (logits of a few units), the patch convolution and the linears r / sqrt(in)"""
    g = torch.Generator().manual_seed(seed)
    unit = ("query_tokens", "vision_model.embeddings.class_embedding", "vision_model.embeddings.position_embedding",
            "language_model.shared.weight")
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * r)
            elif "relative_attention_bias" in name:
                p.copy_(r)
            elif p.ndim == 1 or name.endswith("bias"):
                p.copy_(0.2 * r)
            elif name in unit:
                p.copy_(r)
            elif "embed_" in name:
                p.copy_(0.3 * r)
            elif p.ndim == 4:  # the patch convolution (C, 3, p, p)
                p.copy_(r / (p[0].numel()) ** 0.5)
            else:  # (out, in) linears
                p.copy_(r / p.shape[1] ** 0.5)


def build(seed):
    tc = OPTConfig(vocab_size=103, hidden_size=28, num_attention_heads=4, ffn_dim=44, num_hidden_layers=2,
                   max_position_embeddings=64, word_embed_proj_dim=28, dropout=0.0, attention_dropout=0.0,
                   bos_token_id=2, eos_token_id=2, pad_token_id=1)
    cfg = Blip2Config(vision_config=VC, qformer_config=QC, text_config=tc.to_dict(), num_query_tokens=NQ,
                      image_token_index=IMG_TOK)
    cfg._attn_implementation = "eager"
    for sub in (cfg.vision_config, cfg.qformer_config, cfg.text_config):
        sub._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = Blip2ForConditionalGeneration(cfg).eval()
    redraw(m, seed + 1)
    return cfg, m


def params(m):
    return [(n, p) for n, p in m.named_parameters() if n != "language_model.lm_head.weight"]


def opt_forward(m, batch, dtype):
    """logits and the caption loss: Blip2ForConditionalGeneration's own loss (logits[:, -labels:], then
    ForCausalLMLoss's shift) fails in 5.23 on a view of the sliced logits; the same formula written out: the caption's
    positions predict caption[1:]"""
    pixels, ids, labels = batch
    out = m(pixel_values=pixels.to(dtype), input_ids=ids.long())
    lg = out.logits[:, -labels.shape[1]:-1, :]
    out.loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels[:, 1:].reshape(-1).long(),
                                                 ignore_index=-100)
    return out


def adam5(m, batch, dtype):
    """5 AdamW steps on the batch over every parameter (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1)"""
    m = m.to(dtype)
    opt = torch.optim.AdamW([p for _, p in params(m)], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        out = opt_forward(m, batch, dtype)
        out.loss.backward()
        losses.append(out.loss.item())
        opt.step()
    return {n: p.detach().clone() for n, p in params(m)}, losses


def run(m, batch, dtype):
    m = m.to(dtype)
    m.zero_grad()
    pixels, ids, labels = batch
    out = opt_forward(m, batch, dtype)
    out.loss.backward()
    with torch.no_grad():
        img = m.vision_model(pixel_values=pixels.to(dtype)).last_hidden_state
        q = m.qformer(query_embeds=m.query_tokens.expand(B, -1, -1), encoder_hidden_states=img).last_hidden_state
    grads = {n: p.grad.detach().clone() for n, p in params(m)}
    return out.logits.detach(), out.loss.detach(), grads, img, q


CLI_IMAGE = "tests/fixtures/images/palette_45x31.png"
CLI_CAPTION = [2, 45, 17, 88, 9, 61]


def make_cli(m, out_dir):
    from PIL import Image
    from transformers import BlipImageProcessor
    proc = BlipImageProcessor(size={"height": 12, "width": 12})
    proc.save_pretrained(out_dir)
    pv = proc(images=Image.open(CLI_IMAGE), return_tensors="pt")["pixel_values"].float()
    ids = torch.tensor([[IMG_TOK] * NQ + CLI_CAPTION])
    with torch.no_grad():
        lg = m(pixel_values=pv, input_ids=ids).logits[0, NQ:-1]
        loss = torch.nn.functional.cross_entropy(lg, torch.tensor(CLI_CAPTION[1:])).item()
        gen = m.generate(pixel_values=pv, max_new_tokens=MAX_NEW, do_sample=False)[0][NQ + 1:].tolist()
    with open(os.path.join(out_dir, "expected-cli.json"), "w") as f:
        json.dump({"image": CLI_IMAGE, "caption": CLI_CAPTION, "loss": loss, "generate": gen}, f, indent=1)
    print(f"CLI: loss {loss:.6f}, greedy {gen}")


TS, TT, T5_IMG = 9, 6, 96
CLI_T5_SRC, CLI_T5_TGT = [17, 29], [45, 17, 88, 1]


def make_t5(out_dir, seed=20):
    """blip2-tiny-t5/: the Flan-T5 variant (text_config: T5 gated-GELU, vocab 97, d_model 36, d_kv 10, 3 heads, d_ff
    52, 2 encoder + 3 decoder blocks, 8 buckets up to distance 20, lm_head of its own as the checkpoints;
    image_token_index 96), the same vision tower and Q-Former sizes. expected.safetensors: pixels, ids (B x 9: 5
    placeholders then 4 prompt ids), labels (B x 6, the second's last 2 = -100), dec (the labels shifted right with
    the start token 0, -100 -> pad 0), logits (B x 6 x V), loss (T5's mean cross-entropy), grad.* and noise.* as for
    OPT; gen0 (I32: generate(do_sample=False, max_new_tokens=6) of image 0 with its ids: the decoder's ids after the
    start token). And preprocessor_config.json, expected-cli.json: the loss of CLI_T5_TGT given CLI_IMAGE and the
    source CLI_T5_SRC (after the placeholders), and the greedy decoding of that source."""
    from transformers import T5Config
    os.makedirs(out_dir, exist_ok=True)
    tc = T5Config(vocab_size=97, d_model=36, d_kv=10, d_ff=52, num_layers=2, num_decoder_layers=3, num_heads=3,
                  relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                  layer_norm_epsilon=1e-6, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    cfg = Blip2Config(vision_config=VC, qformer_config=QC, text_config=tc.to_dict(), num_query_tokens=NQ,
                      image_token_index=T5_IMG)
    cfg._attn_implementation = "eager"
    for sub in (cfg.vision_config, cfg.qformer_config, cfg.text_config):
        sub._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = Blip2ForConditionalGeneration(cfg).eval()
    lm = m.language_model
    lm.lm_head.weight = torch.nn.Parameter(torch.empty(tc.vocab_size, tc.d_model))  # its own, as flan-t5's
    redraw(m, seed + 1)
    prm = [(n, p) for n, p in m.named_parameters()]
    save_file({n: p.detach().contiguous() for n, p in prm}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    d = cfg.to_dict()
    d["text_config"]["tie_word_embeddings"] = False
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    g = torch.Generator().manual_seed(seed + 7)
    pixels = torch.randn(B, 3, 12, 12, generator=g)
    prompt = torch.randint(2, T5_IMG, (B, TS - NQ), generator=g, dtype=torch.int32)
    ids = torch.cat([torch.full((B, NQ), T5_IMG, dtype=torch.int32), prompt], dim=1)
    labels = torch.randint(2, T5_IMG, (B, TT), generator=g, dtype=torch.int32)
    labels[1, TT - 2:] = -100
    dec = lm._shift_right(labels.long()).int()
    state = {n: p.detach().clone() for n, p in m.state_dict().items()}
    res = {}
    for dt in (torch.float32, torch.float64):
        m.to(dt)
        m.zero_grad()
        o = m(pixel_values=pixels.to(dt), input_ids=ids.long(), labels=labels.long())
        o.loss.backward()
        res[dt] = (o.logits.detach(), o.loss.detach(), {n: p.grad.detach().clone() for n, p in prm})
    (l32, s32, g32), (l64, s64, g64) = res[torch.float32], res[torch.float64]
    m.float().load_state_dict(state)
    gen = m.generate(pixel_values=pixels[:1], input_ids=ids[:1].long(), max_new_tokens=TT, do_sample=False,
                     use_cache=False)[0]  # 5.23 sizes the cache by num_layers (fewer than the decoder blocks)
    gen = gen[1:].int() if gen[0] == 0 else gen.int()
    noise = lambda x, y: (x.double() - y).abs().max().float().reshape(1)
    out = {"pixels": pixels.contiguous(), "ids": ids, "labels": labels, "dec": dec, "logits": l64.float().contiguous(),
           "loss": s64.reshape(1), "noise.logits": noise(l32, l64), "noise.loss": noise(s32, s64),
           "gen0": gen.contiguous()}
    for n in g64:
        out["grad." + n] = g64[n].float().contiguous()
        out["noise." + n] = noise(g32[n], g64[n])
    save_file(out, os.path.join(out_dir, "expected.safetensors"))
    print(f"{out_dir}: loss {s64.item():.8f} (fp32 noise {noise(s32, s64).item():.3g}), logits noise "
          f"{noise(l32, l64).item():.3g}, {len(g64)} gradients; greedy {gen.tolist()}")
    # the CLI: the loss of a target given the image and a source (placeholders + CLI_T5_SRC), and the greedy decoding
    from PIL import Image
    from transformers import BlipImageProcessor
    proc = BlipImageProcessor(size={"height": 12, "width": 12})
    proc.save_pretrained(out_dir)
    pv = proc(images=Image.open(CLI_IMAGE), return_tensors="pt")["pixel_values"].float()
    src = torch.tensor([[T5_IMG] * NQ + CLI_T5_SRC])
    with torch.no_grad():
        cl = m(pixel_values=pv, input_ids=src, labels=torch.tensor([CLI_T5_TGT])).loss.item()
        cg = m.generate(pixel_values=pv, input_ids=src, max_new_tokens=6, do_sample=False, use_cache=False)[0]
    cg = (cg[1:] if cg[0] == 0 else cg).tolist()
    with open(os.path.join(out_dir, "expected-cli.json"), "w") as f:
        json.dump({"image": CLI_IMAGE, "source": CLI_T5_SRC, "target": CLI_T5_TGT, "loss": cl, "generate": cg}, f,
                  indent=1)
    print(f"CLI (T5): loss {cl:.6f}, greedy {cg}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    a = ap.parse_args()
    out_dir = os.path.join(a.out, "blip2-tiny-opt")
    os.makedirs(out_dir, exist_ok=True)
    cfg, m = build(0)
    m.save_pretrained(out_dir)
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(B, 3, 12, 12, generator=g)
    cap = torch.randint(3, IMG_TOK, (B, TC), generator=g, dtype=torch.int32)
    cap[:, 0] = 2  # BOS
    cap[1, TC - PAD:] = 1  # padding
    labels = cap.clone()
    labels[1, TC - PAD:] = -100
    ids = torch.cat([torch.full((B, NQ), IMG_TOK, dtype=torch.int32), cap], dim=1)
    batch = (pixels, ids, labels)
    state = {n: p.detach().clone() for n, p in m.state_dict().items()}
    l32, s32, g32, i32, q32 = run(m, batch, torch.float32)
    l64, s64, g64, i64, q64 = run(m, batch, torch.float64)
    m.float().load_state_dict(state)
    a32, loss5 = adam5(m, batch, torch.float32)
    m.load_state_dict({k: v.double() for k, v in state.items()})
    a64, _ = adam5(m, batch, torch.float64)
    m.float().load_state_dict(state)
    gen = []
    for b in range(B):
        o = m.generate(pixel_values=pixels[b:b + 1], max_new_tokens=MAX_NEW, do_sample=False)[0]
        gen.append(o[NQ + 1:].int())
    make_cli(m, out_dir)
    pids = torch.tensor([[IMG_TOK] * NQ + [2] + PROMPT])
    o = m.generate(pixel_values=pixels[:1], input_ids=pids, max_new_tokens=MAX_NEW, do_sample=False)[0]
    genp = o[pids.shape[1]:].int()
    noise = lambda x, y: (x.double() - y).abs().max().float().reshape(1)
    out = {"pixels": pixels.contiguous(), "ids": ids, "labels": labels, "logits": l64.float().contiguous(),
           "loss": s64.reshape(1), "noise.logits": noise(l32, l64), "noise.loss": noise(s32, s64),
           "image_embeds": i64.float().contiguous(), "noise.image_embeds": noise(i32, i64),
           "query_output": q64.float().contiguous(), "noise.query_output": noise(q32, q64),
           "gen0": gen[0].contiguous(), "gen1": gen[1].contiguous(), "genp0": genp.contiguous()}
    out["loss5"] = torch.tensor(loss5, dtype=torch.float32)
    for n in g64:
        out["grad." + n] = g64[n].float().contiguous()
        out["noise." + n] = noise(g32[n], g64[n])
        out["after5." + n] = a32[n].float().contiguous()
        out["after5_f64." + n] = a64[n].double().contiguous()
    save_file(out, os.path.join(out_dir, "expected.safetensors"))
    print(f"{out_dir}: loss {s64.item():.8f} (fp32 noise {noise(s32, s64).item():.3g}), logits noise "
          f"{noise(l32, l64).item():.3g} (scale {l64.abs().max().item():.3g}), {len(g64)} gradients, worst grad "
          f"noise {max(noise(g32[n], g64[n]).item() for n in g64):.3g}; greedy {gen[0].tolist()} {gen[1].tolist()} "
          f"prompt {genp.tolist()}")
    make_t5(os.path.join(a.out, "blip2-tiny-t5"))


if __name__ == "__main__":
    main()
