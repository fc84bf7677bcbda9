#!/usr/bin/env python3
# What PyTorch allocates for a LLaMA fine-tune step, measured on the CPU for small shapes: the anchor of the lab's
# `--peer pytorch` allocation model (src/lab/lab_peer.c; issue 33). Per configuration it records
#   params     bytes of the parameters (model dtype: 32-true, the mixed precisions and QLoRA's unquantized ones fp32,
#              bf16-true bf16; QLoRA's quantized linears: bitsandbytes' packed 4-bit uint8, n / 2 bytes)
#   quant      QLoRA: bytes of the 4-bit weights' quantization state (absmax, fp32 per 64-block, and the NF4 code)
#   trainable  number of trainable parameters (LoRA: the adapters)
#   grads      bytes of the .grad tensors after backward
#   optim      bytes of the optimizer's state after one step (AdamW: exp_avg, exp_avg_sq in the parameter dtype and a
#              fp32 step counter per tensor; SGD without momentum: none; bitsandbytes' AdamW8bit: per tensor of at
#              least 4096 elements two uint8 states, two 256-entry fp32 maps and fp32 absmax per 256-block, smaller
#              tensors fp32 states)
#   saved      bytes of the distinct storages autograd saves for backward during the forward (saved_tensors_hooks;
#              parameters excluded): what a training step keeps alive between forward and backward. Under autocast
#              (bf16-mixed, 16-mixed) that includes the 16-bit copies of every linear's weight (autocast's cache);
#              with activation checkpointing (HF gradient_checkpointing_enable, reentrant) each layer's input
#   logits     bytes of the (B, T, V) logits the forward returns (HF keeps them in the output)
# with HF transformers' LlamaForCausalLM, attn_implementation="sdpa" (on the CPU: the flash kernel, which saves
# q, k, v, out and the fp32 logsumexp, as the GPU's flash / memory-efficient kernels do) and its own loss (logits
# upcast to fp32, cross entropy over the shifted labels); LoRA through PEFT (the lab's: query and value, dropout
# 0.05), QLoRA through bitsandbytes (NF4, no double quantization, compute dtype fp32: the lab's 32-true row).
# Autocast runs on the CPU here (torch.autocast("cpu")): its cast lists differ from CUDA's in ops this model does not
# use; linear, matmul and scaled_dot_product_attention run in 16 bits on both. Only the forward's saved tensors and
# the state sizes are measured here; the peak (what is live at once in backward), the recomputation under
# checkpointing and the CUDA caching allocator's rounding are modelled in C, not measured (no GPU).
# GPT-2 (`gpt2` as the first argument; the fsdp suite's gpt2-xl): HF GPT2LMHeadModel with sdpa, tied head, dropout
# off (fitllm's GPT-2 has none), full fine-tunes at every precision, checkpointing and SGD. OPT (`opt`: BLIP-2's
# language model): HF OPTForCausalLM, pre-norm, tied head, dropout off (as fitllm's OPT), the same setups as GPT-2.
# Flan-T5 (`t5`): HF T5ForConditionalGeneration, gated GELU, its own head (transformers 5 ties T5's head whatever the
# config says; Flan-T5's checkpoints have one: untied here), dropout off, encoder length T and decoder (labels) length
# T_dec, every precision, checkpointing at 32-true, bf16-true and 16-mixed, SGD. Its self-attention passes a position
# bias that needs a gradient, so the CPU's sdpa takes the math path (fp32 q, k^T, v, probabilities saved).
# Pinned: torch==2.15.0, transformers==5.23.0, peft==0.21.2, bitsandbytes==0.50.2 (the venv /work/venv-graph). Run:
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py > tests/fixtures/pytorch-alloc.json
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py gpt2 > tests/fixtures/pytorch-alloc-gpt2.json
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py opt > tests/fixtures/pytorch-alloc-opt.json
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py t5 > tests/fixtures/pytorch-alloc-t5.json
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py blip2 > tests/fixtures/pytorch-alloc-blip2.json
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py peft > tests/fixtures/pytorch-alloc-peft.json
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py 8bit > tests/fixtures/pytorch-alloc-8bit.json
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py extra > tests/fixtures/pytorch-alloc-extra.json
# `peft`: LoRA and QLoRA beyond LLaMA's 32-true rows: LLaMA's QLoRA in bf16 and with double quantization ("nf4-dq"),
# OPT and Flan-T5 under LoRA and QLoRA (fp32, bf16), BLIP-2 under LoRA and QLoRA (PEFT on the whole model, targets
# the language model's query and value). Quantized models go through save_pretrained / from_pretrained with the
# BitsAndBytesConfig, as QLoRA loads a checkpoint. bitsandbytes' dequantized weight (MatMul4Bit: forward and backward
# each dequantize one weight to the compute dtype and drop it) is modelled in C from its source, not measured.
# `extra`: what no lab row used before: GPT-2 under PEFT LoRA (Conv1D c_attn, PEFT's default; with `targets`
# ["c_attn", "c_proj"] also both c_proj, the suffix matching attn.c_proj and mlp.c_proj) at every precision and
# checkpointed, LLaMA's, OPT's and Flan-T5's LoRA under autocast and checkpointing (LLaMA's QLoRA checkpointed),
# BLIP-2 with bitsandbytes' AdamW8bit and under LoRA with autocast or checkpointing. Under autocast a frozen linear saves the 16-bit copy of its weight where its input needs a
# gradient (autocast caches only the casts of weights that need one); with checkpointing PEFT makes the embeddings'
# output need a gradient, so every block saves its input.
# (FL_ALLOC_VERBOSE=1: every saved tensor's shape and dtype on stderr.)
import contextlib, json, os, sys, tempfile, warnings, weakref
import torch
import transformers
import peft
import bitsandbytes
from transformers import (BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig,
                          OPTForCausalLM, T5Config, T5ForConditionalGeneration, Blip2Config,
                          Blip2ForConditionalGeneration)

assert (torch.__version__.startswith("2.15.0") and transformers.__version__ == "5.23.0" and peft.__version__ == "0.21.2"
        and bitsandbytes.__version__ == "0.50.2"), (torch.__version__, transformers.__version__, peft.__version__,
                                                    bitsandbytes.__version__)
warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
DT = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "bf16-mixed": torch.float32, "16-mixed": torch.float32}
AMP = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


CLS = {GPT2Config: GPT2LMHeadModel, OPTConfig: OPTForCausalLM, LlamaConfig: LlamaForCausalLM,
       T5Config: T5ForConditionalGeneration}


def untie_t5(m):  # transformers 5 ties T5's head always; Flan-T5's checkpoints have their own
    m.lm_head.weight = torch.nn.Parameter(m.shared.weight.detach().clone())
    return m


def nf4_config(prec, quant):
    """bitsandbytes NF4 as QLoRA loads it: compute in the run's dtype (bf16-true: bf16; else fp32), double
    quantization for "nf4-dq"."""
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=DT[prec],
                              bnb_4bit_use_double_quant=quant == "nf4-dq")


def build(cfg, prec, quant):
    torch.manual_seed(0)
    if not quant:
        m = CLS[type(cfg)](cfg)
        return (untie_t5(m) if isinstance(cfg, T5Config) else m).to(DT[prec])
    d = tempfile.mkdtemp()
    m = CLS[type(cfg)](cfg)
    (untie_t5(m) if isinstance(cfg, T5Config) else m).save_pretrained(d)
    m = CLS[type(cfg)].from_pretrained(d, quantization_config=nf4_config(prec, quant), dtype=DT[prec],
                                       device_map="cpu")
    if isinstance(cfg, T5Config) and m.lm_head.weight.data_ptr() == m.shared.weight.data_ptr():
        untie_t5(m)
    return m


def quant_bytes(m):
    """bytes of the 4-bit weights' quantization state: absmax and the NF4 code, with double quantization the uint8
    absmax, its own fp32 absmax (state2), its 256-entry code and the offset; by storage (PEFT's wrapper shows its base
    layer's weight as its own)."""
    seen = {}
    for mod in m.modules():
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        if qs is None:
            continue
        ts = [qs.absmax, qs.code]
        if getattr(qs, "nested", False):
            ts += [qs.state2.absmax, qs.state2.code, qs.offset]
        for t in ts:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "opt": ["q_proj", "v_proj"], "t5": ["q", "v"], "gpt2": ["c_attn"]}


class Saved:
    """saved_tensors_hooks' pack: every tensor autograd saves, held weakly; after the forward, the bytes of the distinct
    storages still held (a graph branch nothing needs, such as a frozen checkpointed block's, is freed at once, and
    its address may be reused), parameters excluded."""

    def __init__(self, model):
        self.pids = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.refs = []

    def pack(self, t):
        self.refs.append(weakref.ref(t))
        return t

    def total(self):
        seen = {}
        for r in self.refs:
            t = r()
            if t is None:
                continue
            st = t.untyped_storage()
            if st.data_ptr() not in self.pids and st.data_ptr() not in seen:
                seen[st.data_ptr()] = st.nbytes()
                if os.environ.get("FL_ALLOC_VERBOSE"):
                    print("  saved", tuple(t.shape), t.dtype, st.nbytes(), file=sys.stderr)
        return sum(seen.values())


def prepare(m, ckpt, lora_r, targets):
    """HF checkpointing, PEFT LoRA (r, alpha 2r, dropout 0.05 on targets), train mode; the saved-tensor counter."""
    if ckpt:
        m.gradient_checkpointing_enable()
    if lora_r:
        m = peft.get_peft_model(m, peft.LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.05,
                                                   target_modules=targets))
    m.train()
    return m, Saved(m)


def step(m, sv, prec, optim, **inputs):
    """One training step (the forward under autocast for the mixed precisions, backward, the optimizer's step): the
    measured sizes of the row, in the fixtures' order."""
    amp = torch.autocast("cpu", dtype=AMP[prec]) if prec in AMP else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(sv.pack, lambda t: t), amp:
        out = m(**inputs)
    saved = sv.total()
    logits = out.logits.untyped_storage().nbytes()
    out.loss.backward()
    train = [p for p in m.parameters() if p.requires_grad]
    opt = {"adamw": lambda: torch.optim.AdamW(train, lr=1e-3), "sgd": lambda: torch.optim.SGD(train, lr=1e-3),
           "adamw8bit": lambda: bitsandbytes.optim.AdamW8bit(train, lr=1e-3)}[optim]()
    opt.step()
    ostate = sum({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for st in opt.state.values()
                  for v in st.values() if torch.is_tensor(v)}.values())
    return m, dict(trainable=sum(p.numel() for p in train), params=sum(p.untyped_storage().nbytes() for p in
                   m.parameters()), grads=sum(p.grad.untyped_storage().nbytes() for p in train), optim=ostate,
                   saved=saved, logits=logits)


def measure(B, T, prec, L, H, KV, d, ff, V, hd, ckpt=0, lora_r=0, quant="", optim="adamw", arch="llama", Tt=0, Ld=0,
            targets=None):
    if arch == "gpt2":  # n_inner = ff; dropout off
        cfg = GPT2Config(vocab_size=V, n_embd=d, n_inner=ff, n_layer=L, n_head=H, n_positions=256, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa", use_cache=False)
    elif arch == "opt":  # pre-norm, tied head, ReLU, biases; dropout off (fitllm's OPT has none); head_dim = d / H
        cfg = OPTConfig(vocab_size=V, hidden_size=d, ffn_dim=ff, num_hidden_layers=L, num_attention_heads=H,
                        max_position_embeddings=256, word_embed_proj_dim=d, do_layer_norm_before=True, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, attn_implementation="sdpa",
                        use_cache=False)
    elif arch == "t5":  # Flan-T5: gated GELU, untied head; encoder T, decoder (labels) Tt; dropout off
        cfg = T5Config(vocab_size=V, d_model=d, d_kv=hd, d_ff=ff, num_layers=L, num_decoder_layers=Ld, num_heads=H,
                       dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=False, use_cache=False,
                       decoder_start_token_id=0, pad_token_id=0)
    else:
        cfg = LlamaConfig(vocab_size=V, hidden_size=d, intermediate_size=ff, num_hidden_layers=L,
                          num_attention_heads=H, num_key_value_heads=KV, head_dim=hd, max_position_embeddings=256,
                          attn_implementation="sdpa", tie_word_embeddings=False, use_cache=False)
    m, sv = prepare(build(cfg, prec, quant), ckpt, lora_r, targets or LORA_TARGETS.get(arch))
    torch.manual_seed(1)
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, Tt)) if Tt else x
    m, got = step(m, sv, prec, optim, input_ids=x, labels=y)
    full = build(cfg, "32-true", "") if arch == "t5" else CLS[type(cfg)](cfg)
    row = dict(arch=arch) if arch != "llama" else {}
    if Tt:
        row.update(T_dec=Tt, dec_layers=Ld)
    if targets:  # the rows with their own LoRA targets (pytorch_alloc.py extra)
        row.update(targets=targets)
    return dict(row, B=B, T=T, precision=prec, ckpt=ckpt, lora_r=lora_r, quant=quant, optimizer=optim, layers=L,
                heads=H, kv_heads=KV, dim=d, ffn=ff, vocab=V, head_dim=hd,
                n_params=sum(p.numel() for p in full.parameters()), trainable=got["trainable"],
                params=got["params"], quant_state=quant_bytes(m), grads=got["grads"], optim=got["optim"],
                saved=got["saved"], logits=got["logits"])


def measure_blip2(B, L, prec, lm, vis, qf, NQ, txt, ckpt=0, optim="adamw", lora_r=0, quant=""):
    """BLIP-2 (HF Blip2ForConditionalGeneration, transformers 5: NQ image-token placeholders in the ids) as fitllm's
    BLIP-2 fine-tuning runs it: the vision tower frozen, the Q-Former (with the query tokens and the language
    projection) and the language model trained; OPT: the ids are the placeholders then the L caption tokens, the
    labels the caption; Flan-T5: the placeholders are the encoder's input, the caption the labels. bf16-true keeps
    the Q-Former and the query tokens in fp32 as from_pretrained(dtype=bfloat16) does (_keep_in_fp32_modules).
    vis: (layers, heads, dim, ffn, image, patch); qf: (layers, heads, dim, ffn, cross every); txt: measure()'s shape
    tail (L, H, KV, d, ff, V, head_dim[, decoder layers]). lora_r: PEFT LoRA on the whole model with the language
    model's query and value as targets (T5's q, v; OPT's q_proj, v_proj: no Q-Former or vision module has those
    names), everything else frozen, the Q-Former too; quant "nf4" / "nf4-dq": loaded through bitsandbytes (every
    linear but the head and the Q-Former, which _keep_in_fp32_modules keeps out, in NF4; compute in the run's
    dtype)."""
    Lt, H, KV, d, ff, V, hd = txt[:7]
    vc = dict(num_hidden_layers=vis[0], num_attention_heads=vis[1], hidden_size=vis[2], intermediate_size=vis[3],
              image_size=vis[4], patch_size=vis[5], attention_dropout=0.0)
    qc = dict(num_hidden_layers=qf[0], num_attention_heads=qf[1], hidden_size=qf[2], intermediate_size=qf[3],
              cross_attention_frequency=qf[4], encoder_hidden_size=vis[2], hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0)
    if lm == "opt":
        tc = OPTConfig(vocab_size=V, hidden_size=d, ffn_dim=ff, num_hidden_layers=Lt, num_attention_heads=H,
                       max_position_embeddings=256, word_embed_proj_dim=d, do_layer_norm_before=True, dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0)
    else:
        tc = T5Config(vocab_size=V, d_model=d, d_kv=hd, d_ff=ff, num_layers=Lt, num_decoder_layers=txt[7],
                      num_heads=H, dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                      decoder_start_token_id=0, pad_token_id=0)
    cfg = Blip2Config(vision_config=vc, qformer_config=qc, text_config=tc.to_dict(), num_query_tokens=NQ,
                      image_token_index=V - 1)
    cfg._attn_implementation = "sdpa"
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = Blip2ForConditionalGeneration(cfg)
    if lm == "t5":  # Flan-T5's own head (transformers 5 ties it)
        untie_t5(m.language_model)
    n_params = sum(p.numel() for p in m.parameters())
    if quant:
        tmp = tempfile.mkdtemp()
        m.save_pretrained(tmp)
        m = Blip2ForConditionalGeneration.from_pretrained(tmp, quantization_config=nf4_config(prec, quant),
                                                          dtype=DT[prec], device_map="cpu")
        lmm = m.language_model
        if lm == "t5" and lmm.lm_head.weight.data_ptr() == lmm.shared.weight.data_ptr():
            untie_t5(lmm)
    else:
        m = m.to(DT[prec])
        if prec == "bf16-true":
            m.qformer.float()
            m.query_tokens.data = m.query_tokens.data.float()
    for p in m.vision_model.parameters():
        p.requires_grad_(False)
    m, sv = prepare(m, ckpt, lora_r, LORA_TARGETS[lm])
    torch.manual_seed(1)
    px = torch.randn(B, 3, vis[4], vis[4]).to(DT[prec])
    cap = torch.randint(0, V - 1, (B, L))
    img = torch.full((B, NQ), V - 1)
    ids, labels = (torch.cat([img, cap], 1), torch.cat([torch.full((B, NQ), -100), cap], 1)) if lm == "opt" else \
        (img, cap)
    m, got = step(m, sv, prec, optim, pixel_values=px, input_ids=ids, labels=labels)
    row = dict(arch="blip2", lm=lm, B=B, T=L, precision=prec, ckpt=ckpt, optimizer=optim, vision=list(vis),
               qformer=list(qf), queries=NQ, text=list(txt), n_params=n_params, **got)
    if lora_r or quant:  # the older rows' fields unchanged
        row.update(lora_r=lora_r, quant=quant, quant_state=quant_bytes(m))
    return row


def main():
    SHAPES = ((2, 24, 1, 4, 4, 64, 172, 512, 16), (2, 24, 2, 4, 4, 64, 172, 512, 16), (1, 37, 2, 4, 2, 64, 172, 512, 16),
              (3, 20, 3, 8, 2, 96, 256, 300, 12))
    rows = []
    ARCH = sys.argv[1] if sys.argv[1:] in (["gpt2"], ["opt"], ["t5"], ["blip2"], ["peft"], ["8bit"], ["extra"]) else ""
    if ARCH == "extra":  # LoRA for GPT-2 (PEFT on the Conv1D c_attn, and c_attn + c_proj), LoRA under autocast and
        # with checkpointing (LLaMA, GPT-2, OPT, Flan-T5; QLoRA checkpointed), BLIP-2 with AdamW8bit
        for s in ((2, 24, 2, 4, 2, 64, 192, 512, 16), (3, 20, 3, 8, 2, 96, 256, 300, 12)):
            for prec, ck in (("bf16-mixed", 0), ("16-mixed", 0), ("32-true", 1), ("bf16-true", 1), ("bf16-mixed", 1)):
                rows.append(measure(*s[:2], prec, *s[2:], ckpt=ck, lora_r=8))
            rows.append(measure(*s[:2], "32-true", *s[2:], ckpt=1, lora_r=8, quant="nf4"))
        for s in ((2, 24, 1, 4, 4, 64, 256, 512, 16), (1, 37, 2, 4, 4, 64, 172, 300, 16)):
            for prec, ck in (("32-true", 0), ("bf16-true", 0), ("bf16-mixed", 0), ("16-mixed", 0), ("32-true", 1),
                             ("bf16-mixed", 1)):
                rows.append(measure(*s[:2], prec, *s[2:], ckpt=ck, lora_r=8, arch="gpt2"))
            for prec in ("32-true", "bf16-true", "bf16-mixed"):
                rows.append(measure(*s[:2], prec, *s[2:], lora_r=8, arch="gpt2", targets=["c_attn", "c_proj"]))
        for s in ((2, 24, 1, 4, 4, 64, 256, 512, 16), (3, 20, 3, 6, 6, 96, 384, 300, 16)):
            for prec, ck in (("bf16-mixed", 0), ("16-mixed", 0), ("32-true", 1), ("bf16-mixed", 1)):
                rows.append(measure(*s[:2], prec, *s[2:], ckpt=ck, lora_r=8, arch="opt"))
        VIS, QF = ((1, 2, 32, 64, 8, 4), (2, 2, 24, 48, 12, 4)), ((2, 4, 48, 96, 2), (3, 2, 32, 80, 1))
        TXT = {"opt": ((1, 4, 4, 64, 128, 300, 16), (2, 2, 2, 48, 96, 200, 24)),
               "t5": ((1, 4, 4, 64, 96, 300, 16, 1), (2, 2, 2, 48, 80, 200, 32, 2))}
        for lm in ("opt", "t5"):
            for i, (B, L, NQ) in enumerate(((2, 6, 3), (1, 5, 4))):
                for prec in ("32-true", "bf16-true"):
                    rows.append(measure_blip2(B, L, prec, lm, VIS[i], QF[i], NQ, TXT[lm][i], optim="adamw8bit"))
                for prec, ck in (("bf16-mixed", 0), ("32-true", 1)):  # LoRA under autocast, checkpointed
                    rows.append(measure_blip2(B, L, prec, lm, VIS[i], QF[i], NQ, TXT[lm][i], ckpt=ck, lora_r=8))
        for s in ((2, 24, 1, 4, 4, 64, 96, 512, 16, 10, 1), (3, 20, 2, 4, 4, 96, 256, 300, 32, 12, 3)):  # Flan-T5
            for prec, ck in (("bf16-mixed", 0), ("16-mixed", 0), ("32-true", 1), ("bf16-true", 1), ("bf16-mixed", 1)):
                rows.append(measure(*s[:2], prec, *s[2:9], ckpt=ck, lora_r=8, arch="t5", Tt=s[9], Ld=s[10]))
        SHAPES = ()
    elif ARCH == "8bit":  # bitsandbytes' AdamW8bit on GPT-2's, OPT's and Flan-T5's full fine-tunes (fp32 and bf16)
        for arch, S in (("gpt2", ((2, 24, 1, 4, 4, 64, 256, 512, 16), (1, 37, 2, 4, 4, 64, 172, 300, 16))),
                        ("opt", ((2, 24, 1, 4, 4, 64, 256, 512, 16), (1, 37, 2, 4, 4, 64, 172, 300, 16)))):
            for s in S:
                for prec in ("32-true", "bf16-true"):
                    rows.append(measure(*s[:2], prec, *s[2:], optim="adamw8bit", arch=arch))
        for s in ((2, 24, 1, 4, 4, 64, 96, 512, 16, 10, 1), (1, 37, 2, 4, 4, 64, 172, 300, 16, 5, 2)):
            for prec in ("32-true", "bf16-true"):
                rows.append(measure(*s[:2], prec, *s[2:9], optim="adamw8bit", arch="t5", Tt=s[9], Ld=s[10]))
        SHAPES = ()
    elif ARCH == "peft":  # LoRA and QLoRA beyond LLaMA's 32-true rows: bf16 compute, double quantization, OPT, T5, BLIP-2
        for s in ((2, 24, 2, 4, 2, 64, 192, 512, 16), (3, 20, 3, 8, 2, 96, 256, 300, 12)):
            rows.append(measure(*s[:2], "bf16-true", *s[2:], lora_r=8, quant="nf4"))
            rows.append(measure(*s[:2], "32-true", *s[2:], lora_r=8, quant="nf4-dq"))
            rows.append(measure(*s[:2], "bf16-true", *s[2:], lora_r=4, quant="nf4-dq"))
        for s in ((2, 24, 1, 4, 4, 64, 256, 512, 16), (3, 20, 3, 6, 6, 96, 384, 300, 16)):
            for prec, q in (("32-true", ""), ("bf16-true", ""), ("32-true", "nf4"), ("bf16-true", "nf4-dq")):
                rows.append(measure(*s[:2], prec, *s[2:], lora_r=8, quant=q, arch="opt"))
        for s in ((2, 24, 1, 4, 4, 64, 96, 512, 16, 10, 1), (3, 20, 2, 4, 4, 96, 256, 300, 32, 12, 3)):
            for prec, q in (("32-true", ""), ("bf16-true", ""), ("32-true", "nf4"), ("bf16-true", "nf4-dq")):
                rows.append(measure(*s[:2], prec, *s[2:9], lora_r=8, quant=q, arch="t5", Tt=s[9], Ld=s[10]))
        VIS, QF = ((1, 2, 32, 64, 8, 4), (2, 2, 24, 48, 12, 4)), ((2, 4, 48, 96, 2), (3, 2, 32, 80, 1))
        TXT = {"opt": ((1, 4, 4, 64, 128, 300, 16), (2, 2, 2, 48, 96, 200, 24)),
               "t5": ((1, 4, 4, 64, 96, 300, 16, 1), (2, 2, 2, 48, 80, 200, 32, 2))}
        for lm in ("opt", "t5"):
            for i, (B, L, NQ) in enumerate(((2, 6, 3), (1, 5, 4))):
                for prec, q in (("32-true", ""), ("bf16-true", ""), ("32-true", "nf4"), ("bf16-true", "nf4")):
                    rows.append(measure_blip2(B, L, prec, lm, VIS[i], QF[i], NQ, TXT[lm][i], lora_r=8, quant=q))
        SHAPES = ()
    elif ARCH == "blip2":  # vision (L, H, d, ff, image, patch), Q-Former (L, H, d, ff, cross every), queries, text
        VIS, QF = ((1, 2, 32, 64, 8, 4), (2, 2, 24, 48, 12, 4)), ((2, 4, 48, 96, 2), (3, 2, 32, 80, 1))
        TXT = {"opt": ((1, 4, 4, 64, 128, 300, 16), (2, 2, 2, 48, 96, 200, 24)),
               "t5": ((1, 4, 4, 64, 96, 300, 16, 1), (2, 2, 2, 48, 80, 200, 32, 2))}
        for lm in ("opt", "t5"):
            for i, (B, L, NQ) in enumerate(((2, 6, 3), (1, 5, 4))):
                for prec in ("32-true", "bf16-true", "bf16-mixed", "16-mixed"):
                    rows.append(measure_blip2(B, L, prec, lm, VIS[i], QF[i], NQ, TXT[lm][i]))
                rows.append(measure_blip2(B, L, "32-true", lm, VIS[i], QF[i], NQ, TXT[lm][i], ckpt=1))
                rows.append(measure_blip2(B, L, "32-true", lm, VIS[i], QF[i], NQ, TXT[lm][i], optim="sgd"))
        SHAPES = ()
    elif ARCH == "t5":  # Flan-T5: B, T (encoder), L, H, KV, d, ff, V, head_dim, then the decoder's T and L
        S = ((2, 24, 1, 4, 4, 64, 96, 512, 16, 10, 1), (1, 37, 2, 4, 4, 64, 172, 300, 16, 5, 2),
             (3, 20, 2, 4, 4, 96, 256, 300, 32, 12, 3))
        for prec in ("32-true", "bf16-true", "bf16-mixed", "16-mixed"):
            for s in S:
                rows.append(measure(*s[:2], prec, *s[2:9], arch="t5", Tt=s[9], Ld=s[10]))
        for s in S[1:]:
            for prec in ("32-true", "bf16-true", "16-mixed"):
                rows.append(measure(*s[:2], prec, *s[2:9], ckpt=1, arch="t5", Tt=s[9], Ld=s[10]))
            rows.append(measure(*s[:2], "32-true", *s[2:9], optim="sgd", arch="t5", Tt=s[9], Ld=s[10]))
        SHAPES = ()
    elif ARCH:  # GPT-2, OPT: every precision at three shapes, then checkpointing and SGD
        G = ((2, 24, 1, 4, 4, 64, 256, 512, 16), (1, 37, 2, 4, 4, 64, 172, 300, 16), (3, 20, 3, 6, 6, 96, 384, 300, 16))
        for prec in ("32-true", "bf16-true", "bf16-mixed", "16-mixed"):
            for s in G:
                rows.append(measure(*s[:2], prec, *s[2:], arch=ARCH))
        for s in G[1:]:
            rows.append(measure(*s[:2], "32-true", *s[2:], ckpt=1, arch=ARCH))
            rows.append(measure(*s[:2], "16-mixed", *s[2:], ckpt=1, arch=ARCH))
            rows.append(measure(*s[:2], "32-true", *s[2:], optim="sgd", arch=ARCH))
        SHAPES = ()
    for prec in ("32-true", "bf16-true") if not rows else ():  # full fine-tunes (the first anchor)
        for s in SHAPES:
            rows.append(measure(*s[:2], prec, *s[2:]))
    for prec in ("bf16-mixed", "16-mixed") if SHAPES else ():  # autocast
        for s in SHAPES[1:]:
            rows.append(measure(*s[:2], prec, *s[2:]))
    for s in SHAPES[1:]:  # the other lab rows' setups, each at three shapes
        rows.append(measure(*s[:2], "32-true", *s[2:], ckpt=1))
        rows.append(measure(*s[:2], "32-true", *s[2:], optim="sgd"))
        rows.append(measure(*s[:2], "32-true", *s[2:], optim="adamw8bit"))
        rows.append(measure(*s[:2], "32-true", *s[2:], lora_r=4))
        rows.append(measure(*s[:2], "32-true", *s[2:], lora_r=8, quant="nf4"))
    if SHAPES:
        rows.append(measure(2, 24, "bf16-mixed", 2, 4, 2, 64, 192, 512, 16, ckpt=1))
        rows.append(measure(2, 24, "bf16-true", 2, 4, 2, 64, 192, 512, 16, lora_r=4))
    head = json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                       "bitsandbytes": bitsandbytes.__version__})
    print(head[:-1] + ', "rows": [\n ' + ",\n ".join(json.dumps(r) for r in rows) + "\n]}")


if __name__ == "__main__":
    main()
