#!/usr/bin/env python3
"""Write the small seed files of fuzz/seeds-*/ (committed; rerun only to change them).

Plain Python (struct/json, no third-party modules). The tiny SentencePiece seed
is cut from ../shared/data/llama2-tokenizer/tokenizer.model when that exists.
Multi-file seeds join their files with the harnesses' separator FZ_SEP
(fuzz/fuzz_util.h).
Usage: python3 fuzz/make_seeds.py   (from the repository root)
"""
import json
import os
import struct

SEP = b"\n@@FILE@@\n"
DATA = os.environ.get("FITLLM_DATA", "../shared/data")


def put(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def st_file(tensors, meta=None):
    """safetensors bytes: tensors = [(name, dtype, shape, raw bytes)]."""
    header, off, blob = {}, 0, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name, dt, shape, raw in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blob += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + blob


def f32(n, start=0.0):
    return struct.pack("<%df" % n, *[start + 0.01 * i for i in range(n)])


def numel(shape):
    p = 1
    for s in shape:
        p *= s
    return p


# ---- safetensors ----
put("fuzz/seeds-st/two.safetensors",
    st_file([("a", "F32", (2, 3), f32(6)), ("b", "BF16", (4,), b"\x80\x3f" * 4)], {"format": "pt"}))
put("fuzz/seeds-st/dtypes.safetensors",
    st_file([("x", "F16", (2, 2), b"\x00\x3c" * 4), ("y", "I64", (1,), struct.pack("<q", -1)),
             ("z", "U8", (0, 3), b""), ("w", "F64", (), struct.pack("<d", 1.5)), ("i", "I32", (2,), b"\x01\0\0\0" * 2)]))
put("fuzz/seeds-st/empty.safetensors", st_file([]))

# ---- tiny models: LLaMA (V 8, C 8, L 1, NH 2, NKV 1, F 12, T 4) and GPT-2 (V 8, C 8, L 1, NH 2, T 4) ----
llama_cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 12,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 8,
             "max_position_embeddings": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 4}}
C, F, V, KV = 8, 12, 8, 4
llama_t = [("model.embed_tokens.weight", (V, C)), ("model.layers.0.input_layernorm.weight", (C,)),
           ("model.layers.0.self_attn.q_proj.weight", (C, C)), ("model.layers.0.self_attn.k_proj.weight", (KV, C)),
           ("model.layers.0.self_attn.v_proj.weight", (KV, C)), ("model.layers.0.self_attn.o_proj.weight", (C, C)),
           ("model.layers.0.post_attention_layernorm.weight", (C,)), ("model.layers.0.mlp.gate_proj.weight", (F, C)),
           ("model.layers.0.mlp.up_proj.weight", (F, C)), ("model.layers.0.mlp.down_proj.weight", (C, F)),
           ("model.norm.weight", (C,)), ("lm_head.weight", (V, C))]
gpt2_cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2,
            "vocab_size": 8, "n_positions": 4, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
gpt2_t = [("wte.weight", (V, C)), ("wpe.weight", (4, C)), ("h.0.ln_1.weight", (C,)), ("h.0.ln_1.bias", (C,)),
          ("h.0.attn.c_attn.weight", (C, 3 * C)), ("h.0.attn.c_attn.bias", (3 * C,)),
          ("h.0.attn.c_proj.weight", (C, C)), ("h.0.attn.c_proj.bias", (C,)), ("h.0.ln_2.weight", (C,)),
          ("h.0.ln_2.bias", (C,)), ("h.0.mlp.c_fc.weight", (C, 4 * C)), ("h.0.mlp.c_fc.bias", (4 * C,)),
          ("h.0.mlp.c_proj.weight", (4 * C, C)), ("h.0.mlp.c_proj.bias", (C,)), ("ln_f.weight", (C,)),
          ("ln_f.bias", (C,))]


def model_st(ts, dt="F32"):
    out = []
    for n, s in ts:
        raw = f32(numel(s)) if dt == "F32" else b"\x80\x3f" * numel(s)
        out.append((n, dt, s, raw))
    return st_file(out, {"format": "pt"})


put("fuzz/seeds-hf-config/llama.json", json.dumps(llama_cfg, indent=1).encode())
put("fuzz/seeds-hf-config/gpt2.json", json.dumps(gpt2_cfg, indent=1).encode())
put("fuzz/seeds-hf-folder/llama", json.dumps(llama_cfg).encode() + SEP + model_st(llama_t))
put("fuzz/seeds-hf-folder/gpt2-bf16", json.dumps(gpt2_cfg).encode() + SEP + model_st(gpt2_t, "BF16"))
half = len(llama_t) // 2
s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
index = {"metadata": {"total_size": 0}, "weight_map": {n: (s1 if i < half else s2) for i, (n, _) in enumerate(llama_t)}}
put("fuzz/seeds-hf-folder/llama-sharded",
    json.dumps(llama_cfg).encode() + SEP + b"" + SEP + json.dumps(index).encode() + SEP + model_st(llama_t[:half]) +
    SEP + model_st(llama_t[half:]))

# ---- llama2.c checkpoints: header (dim, hidden, layers, heads, kv_heads, vocab, seq) + fp32 ----
def l2c(dim, hid, nl, nh, nkv, vocab, seq):
    hs = dim // nh
    kv = nkv * hs
    n = vocab * dim + nl * (2 * dim + 2 * dim * dim + 2 * kv * dim + 3 * hid * dim) + dim + seq * hs
    if vocab < 0:
        n = -vocab * dim * 2 + nl * (2 * dim + 2 * dim * dim + 2 * kv * dim + 3 * hid * dim) + dim + seq * hs
    return struct.pack("<7i", dim, hid, nl, nh, nkv, vocab, seq) + f32(n)


put("fuzz/seeds-llama2c/shared.bin", l2c(8, 12, 1, 2, 1, 8, 4))
put("fuzz/seeds-llama2c/unshared.bin", l2c(4, 8, 2, 2, 2, -6, 3))

# ---- PEFT adapters for the harness's tiny models (LLaMA C 16, KV 8, F 24; GPT-2 C 16) ----
def adapter(cfg, mods, r):
    ts = []
    for name, in_, out in mods:
        ts.append(("base_model.model.%s.lora_A.weight" % name, "F32", (r, in_), f32(r * in_)))
        ts.append(("base_model.model.%s.lora_B.weight" % name, "F32", (out, r), f32(out * r)))
    return json.dumps(cfg).encode() + SEP + st_file(ts, {"format": "pt"})


lcfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "use_rslora": False,
        "fan_in_fan_out": False, "inference_mode": True}
put("fuzz/seeds-peft/llama", adapter(lcfg, [("model.layers.0.self_attn.q_proj", 16, 16),
                                            ("model.layers.1.self_attn.v_proj", 16, 8)], 2))
gcfg = dict(lcfg, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, use_rslora=True, r=1,
            base_model_name_or_path="base")
put("fuzz/seeds-peft/gpt2", adapter(gcfg, [("transformer.h.0.attn.c_attn", 16, 48),
                                           ("transformer.h.1.mlp.c_fc", 16, 64)], 1))
head = dict(lcfg, target_modules=["lm_head"], r=1)
put("fuzz/seeds-peft/llama-head", json.dumps(head).encode() + SEP + st_file(
    [("base_model.model.lm_head.lora_A.weight", "F32", (1, 16), f32(16)),
     ("base_model.model.lm_head.lora_B.weight", "BF16", (32, 1), b"\x80\x3f" * 32),
     ("base_model.model.lm_head.base_layer.weight", "F16", (32, 16), b"\x00\x3c" * 512)]))

# ---- recipes and overrides ----
put("fuzz/seeds-recipe/litgpt.yaml", b"""checkpoint_dir: checkpoints/x
out_dir: out/x
precision: bf16-true
lora_r: 8
lora_alpha: 16
lora_query: true
data:
  class_path: litgpt.data.JSON
  init_args:
    json_path: data/a.json
    mask_prompt: false
    val_split_fraction: 0.1
    prompt_style: alpaca
train:
  global_batch_size: 8
  micro_batch_size: 2
  lr_warmup_steps: 10
  max_seq_length: 64
  max_steps: ~
eval:
  interval: 10
optimizer:
  class_path: torch.optim.AdamW
  init_args:
    lr: 0.0003
    weight_decay: 0.02
    betas: [0.9, 0.95]
seed: 1337
""")
put("fuzz/seeds-recipe/flow.yaml", b"{train: {micro_batch_size: 4, epochs: 2}, data: {class_path: TextFiles, "
    b"init_args: {train_data_path: 'a', val_data_path: \"b\\u00e9\"}}, lora_target_modules: 'q_proj,v_proj'}\n")
put("fuzz/seeds-recipe/alias.yaml", b"m0: &m0 {}\nm1: &m1 {a: *m0, b: *m0}\nm2: &m2 {a: *m1, b: *m1}\n"
    b"train: &t\n  micro_batch_size: 2\neval: {interval: 3}\n")
put("fuzz/seeds-overrides/a", b"train.micro_batch_size=4\ntrain.global_batch_size=16\noptimizer.lr=1e-3\n"
    b"data.class_path=litgpt.data.Alpaca\ndata.init_args.json_path=x.json\nprecision=bf16-mixed\nseed=7\n"
    b"train.max_steps=null\nlora_r=4\nquiet\n")
put("fuzz/seeds-overrides/b", b"optimizer=SGD\noptimizer.momentum=0.9\ntrain.lr_warmup_fraction=0.1\n"
    b"eval.max_new_tokens=0\nresume=auto\nmax_memory=2G\nthreads=2\nlogger_name=jsonl\n")

# ---- tokenizer folders: tokenizer.json + config.json, special_tokens_map.json, tokenizer_config.json ----
with open("fuzz/seeds-tok/sp.json", "rb") as f:
    sp = f.read()
put("fuzz/seeds-tok-dir/sp", sp + SEP + b'{"bos_token_id": 1, "eos_token_id": [2, 0]}' + SEP +
    b'{"bos_token": {"content": "<s>"}, "eos_token": "</s>"}' + SEP +
    b'{"add_bos_token": false, "add_eos_token": true, "bos_token": null}')
put("fuzz/seeds-tok-dir/sp-cfg", sp + SEP + SEP + SEP + b'{"eos_token": {"content": "<unk>"}, "add_bos_token": true}')

# ---- llama2.c tokenizer (max_token_length, then (score, len, bytes) per token) ----
toks = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [("<0x%02X>" % i).encode() for i in range(256)] + \
       [b" ", b"e", b"t", b" t", b"he", b" the", b"ll", b"o", b"llo", b"h", b"hello"]
out = struct.pack("<i", 8)
for i, t in enumerate(toks):
    out += struct.pack("<fi", -float(i), len(t)) + t
put("fuzz/seeds-tok-llama2c/tiny.bin", out)

# ---- SentencePiece tokenizer.model: the first 300 pieces of LLaMA's, with its specs ----
def varint(b, i):
    v, s = 0, 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return v, i


spm = os.path.join(DATA, "llama2-tokenizer/tokenizer.model")
if os.path.exists(spm):
    b = open(spm, "rb").read()
    i, keep, n_piece = 0, b"", 0
    while i < len(b):
        start = i
        key, i = varint(b, i)
        f, wt = key >> 3, key & 7
        if wt == 2:
            ln, i = varint(b, i)
            i += ln
        elif wt == 0:
            _, i = varint(b, i)
        elif wt == 5:
            i += 4
        elif wt == 1:
            i += 8
        if f == 1:
            n_piece += 1
            if n_piece > 300:
                continue
        keep += b[start:i]
    put("fuzz/seeds-tok-model/llama300.model", keep)

# ---- dataset folders: train.json / val.json / train.jsonl / val.jsonl; TextFiles parts ----
def rd(p):
    with open(p, "rb") as f:
        return f.read()


js, jl = rd("fuzz/seeds/json/s1.json"), rd("fuzz/seeds/jsonl/s1.jsonl")
put("fuzz/seeds-data-dir/json", js + SEP + rd("fuzz/seeds/json/s2.json"))
put("fuzz/seeds-data-dir/jsonl", SEP + SEP + jl + SEP + rd("fuzz/seeds/jsonl/s2.jsonl"))
put("fuzz/seeds-data-dir/mixed", js + SEP + SEP + SEP + jl)
put("fuzz/seeds-textfiles/two", b"Once upon a time there was a cat.\n" + SEP + b"  The cat sat.  \r\n\t" + SEP +
    "caf\u00e9 \U0001F600 end".encode())
put("fuzz/seeds-textfiles/val", b"V" + b"training text " * 8 + SEP + b"more\n\n" + SEP + b"validation text")
