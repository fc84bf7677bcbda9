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
# (FL_ALLOC_VERBOSE=1: every saved tensor's shape and dtype on stderr.)
import contextlib, json, os, sys, tempfile, warnings
import torch
import transformers
import peft
import bitsandbytes
from transformers import (BitsAndBytesConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig,
                          OPTForCausalLM, T5Config, T5ForConditionalGeneration)

assert (torch.__version__.startswith("2.15.0") and transformers.__version__ == "5.23.0" and peft.__version__ == "0.21.2"
        and bitsandbytes.__version__ == "0.50.2"), (torch.__version__, transformers.__version__, peft.__version__,
                                                    bitsandbytes.__version__)
warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
DT = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "bf16-mixed": torch.float32, "16-mixed": torch.float32}
AMP = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


CLS = {GPT2Config: GPT2LMHeadModel, OPTConfig: OPTForCausalLM, LlamaConfig: LlamaForCausalLM,
       T5Config: T5ForConditionalGeneration}


def build(cfg, prec, quant):
    torch.manual_seed(0)
    if isinstance(cfg, T5Config):  # transformers 5 ties T5's head always; Flan-T5's checkpoints have their own
        m = T5ForConditionalGeneration(cfg)
        m.lm_head.weight = torch.nn.Parameter(m.shared.weight.detach().clone())
        return m.to(DT[prec])
    if isinstance(cfg, (GPT2Config, OPTConfig)):
        return CLS[type(cfg)](cfg).to(DT[prec])
    if not quant:
        return LlamaForCausalLM(cfg).to(DT[prec])
    d = tempfile.mkdtemp()
    LlamaForCausalLM(cfg).save_pretrained(d)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                           bnb_4bit_use_double_quant=False)
    return LlamaForCausalLM.from_pretrained(d, quantization_config=q, dtype=torch.float32, device_map="cpu")


def measure(B, T, prec, L, H, KV, d, ff, V, hd, ckpt=0, lora_r=0, quant="", optim="adamw", arch="llama", Tt=0, Ld=0):
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
    m = build(cfg, prec, quant)
    if ckpt:
        m.gradient_checkpointing_enable()
    if lora_r:
        m = peft.get_peft_model(m, peft.LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.05,
                                                   target_modules=["q_proj", "v_proj"]))
    m.train()
    pids = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in pids and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s.nbytes()
            if os.environ.get("FL_ALLOC_VERBOSE"):
                print("  saved", tuple(t.shape), t.dtype, s.nbytes(), file=sys.stderr)
        return t

    torch.manual_seed(1)
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, Tt)) if Tt else x
    amp = torch.autocast("cpu", dtype=AMP[prec]) if prec in AMP else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        out = m(input_ids=x, labels=y)
    saved = sum(seen.values())
    logits = out.logits.untyped_storage().nbytes()
    out.loss.backward()
    train = [p for p in m.parameters() if p.requires_grad]
    opt = {"adamw": lambda: torch.optim.AdamW(train, lr=1e-3), "sgd": lambda: torch.optim.SGD(train, lr=1e-3),
           "adamw8bit": lambda: bitsandbytes.optim.AdamW8bit(train, lr=1e-3)}[optim]()
    opt.step()
    params = sum(p.untyped_storage().nbytes() for p in m.parameters())
    qs_seen = {}  # by storage: PEFT's wrapper shows its base layer's weight as its own
    for mod in m.modules():
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        for t in (qs.absmax, qs.code) if qs is not None else ():
            qs_seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    qstate = sum(qs_seen.values())
    grads = sum(p.grad.untyped_storage().nbytes() for p in train)
    ostate = sum({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for st in opt.state.values()
                  for v in st.values() if torch.is_tensor(v)}.values())
    full = build(cfg, "32-true", "") if arch == "t5" else CLS[type(cfg)](cfg)
    row = dict(arch=arch) if arch != "llama" else {}
    if Tt:
        row.update(T_dec=Tt, dec_layers=Ld)
    return dict(row, B=B, T=T, precision=prec, ckpt=ckpt, lora_r=lora_r, quant=quant, optimizer=optim, layers=L,
                heads=H, kv_heads=KV, dim=d, ffn=ff, vocab=V, head_dim=hd,
                n_params=sum(p.numel() for p in full.parameters()),
                trainable=sum(p.numel() for p in train), params=params, quant_state=qstate, grads=grads,
                optim=ostate, saved=saved, logits=logits)


def main():
    SHAPES = ((2, 24, 1, 4, 4, 64, 172, 512, 16), (2, 24, 2, 4, 4, 64, 172, 512, 16), (1, 37, 2, 4, 2, 64, 172, 512, 16),
              (3, 20, 3, 8, 2, 96, 256, 300, 12))
    rows = []
    ARCH = sys.argv[1] if sys.argv[1:] in (["gpt2"], ["opt"], ["t5"]) else ""
    if ARCH == "t5":  # Flan-T5: B, T (encoder), L, H, KV, d, ff, V, head_dim, then the decoder's T and L
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
