"""PyTorch checkpoint fixtures for tests/test_torch_ckpt.c and tests/cli_test.sh.

Run by hand from the repository root (torch 2.15.0, as tests/ref/README.md pins):

    /work/venv-torch/bin/python tests/ref/make_torch_fixtures.py [--data /work/shared/data]

Writes tests/fixtures/torch/:

  tiny-st/        config.json + model.safetensors: the reference, a tiny random LLaMA (hidden 32,
                  2 layers, 4 heads, 2 kv heads, intermediate 48, vocab 64, untied head) in mixed
                  dtypes (layer 0 BF16, layer 1 F16, the rest F32), written by the small safetensors
                  writer below (no safetensors package needed).
  tiny-bin/       the same tensors through torch.save as pytorch_model.bin (an OrderedDict with
                  _metadata, as Module.state_dict() gives; q/k/v of layer 0 are row slices of one
                  fused storage, so storage offsets are exercised).
  tiny-sharded/   the same as pytorch_model-00001-of-00002.bin, -00002-of-00002.bin and
                  pytorch_model.bin.index.json (transformers' names and index format).
  tiny-lit/       the same as LitGPT's lit_model.pth (attn.qkv.weight = [q; k; v], LitGPT >= 0.5).
  tiny-lit-yaml/  lit_model.pth as tiny-lit/ with LitGPT's model_config.yaml instead of config.json.
  tiny-lit-old/   the same with the older interleaved attn.attn.weight (per kv group: q heads, k, v),
                  wrapped as {"model": state_dict} the way Lightning Fabric saves training checkpoints.
  evil.bin        torch.save of an object whose __reduce__ is os.system("touch /tmp/fitllm-torch-pwned"):
                  must be refused by name, never run.
  legacy.bin      the pre-1.6 non-zip format (_use_new_zipfile_serialization=False).
  stories260K-bf16/  stories260K-hf (real TinyStories weights) re-saved by torch in bfloat16 as
                  pytorch_model.bin + its config.json (torch_dtype bfloat16); ~0.5 MB.

and the fuzz seeds fuzz/seeds-torch/ (fuzz/fuzz_torch.c): a few small torch.save files (dtypes, shared
storages with offsets, a Lightning-style wrapper, protocol 4, evil, legacy), each under 4 KB.
"""
import argparse
import collections
import json
import os
import struct

import torch

OUT = "tests/fixtures/torch"
NH, NKV, HD, C, FF, V, L = 4, 2, 8, 32, 48, 64, 2

ST_DT = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        b = bytes(t.contiguous().clone().untyped_storage())  # clone: a view's storage holds more
        header[name] = {"dtype": ST_DT[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    inv = {v: k for k, v in ST_DT.items()}
    out = collections.OrderedDict()
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, en = e["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[b:en]), dtype=inv[e["dtype"]]).reshape(e["shape"]).clone()
    return out


def tiny_config():
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": C, "intermediate_size": FF, "num_hidden_layers": L, "num_attention_heads": NH,
        "num_key_value_heads": NKV, "vocab_size": V, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def tiny_tensors():
    g = torch.Generator().manual_seed(28)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05
    t = collections.OrderedDict()
    t["model.embed_tokens.weight"] = r(V, C)
    for i in range(L):
        dt = torch.bfloat16 if i == 0 else torch.float16
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + r(C)).to(dt)
        t[p + "self_attn.q_proj.weight"] = r(NH * HD, C).to(dt)
        t[p + "self_attn.k_proj.weight"] = r(NKV * HD, C).to(dt)
        t[p + "self_attn.v_proj.weight"] = r(NKV * HD, C).to(dt)
        t[p + "self_attn.o_proj.weight"] = r(C, NH * HD).to(dt)
        t[p + "post_attention_layernorm.weight"] = (1 + r(C)).to(dt)
        t[p + "mlp.gate_proj.weight"] = r(FF, C).to(dt)
        t[p + "mlp.up_proj.weight"] = r(FF, C).to(dt)
        t[p + "mlp.down_proj.weight"] = r(C, FF).to(dt)
    t["model.norm.weight"] = 1 + r(C)
    t["lm_head.weight"] = r(V, C)
    return t


def as_state_dict(t):
    sd = collections.OrderedDict(t)
    sd._metadata = collections.OrderedDict([("", {"version": 1}), ("model", {"version": 1})])
    return sd


def folder(name, cfg):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return d


def lit_names(t, interleaved):
    m = {"input_layernorm": "norm_1", "self_attn.o_proj": "attn.proj", "post_attention_layernorm": "norm_2",
         "mlp.gate_proj": "mlp.fc_1", "mlp.up_proj": "mlp.fc_2", "mlp.down_proj": "mlp.proj"}
    out = collections.OrderedDict()
    out["transformer.wte.weight"] = t["model.embed_tokens.weight"]
    for i in range(L):
        p = f"model.layers.{i}."
        q, k, v = (t[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        if interleaved:
            qpk = NH // NKV
            parts = []
            for grp in range(NKV):
                parts += [q[grp * qpk * HD:(grp + 1) * qpk * HD], k[grp * HD:(grp + 1) * HD], v[grp * HD:(grp + 1) * HD]]
            out[f"transformer.h.{i}.attn.attn.weight"] = torch.cat(parts)
        else:
            out[f"transformer.h.{i}.attn.qkv.weight"] = torch.cat([q, k, v])
        for hf, lit in m.items():
            out[f"transformer.h.{i}.{lit}.weight"] = t[p + hf + ".weight"]
    out["transformer.ln_f.weight"] = t["model.norm.weight"]
    out["lm_head.weight"] = t["lm_head.weight"]
    return out


LIT_YAML = f"""attention_logit_softcapping: null
attention_scores_scalar: null
bias: false
block_size: 64
gelu_approximate: none
head_size: {HD}
hf_config:
  name: tiny-llama
  org: fitllm
intermediate_size: {FF}
lm_head_bias: false
mlp_class_name: LLaMAMLP
n_embd: {C}
n_expert: 0
n_expert_per_token: 0
n_head: {NH}
n_layer: {L}
n_query_groups: {NKV}
name: tiny-llama
norm_class_name: RMSNorm
norm_eps: 1.0e-05
padded_vocab_size: {V}
padding_multiple: 64
parallel_residual: false
rope_base: 10000
rope_condense_ratio: 1
rotary_percentage: 1.0
scale_embeddings: false
shared_attention_norm: false
vocab_size: {V}
"""


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/fitllm-torch-pwned",))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.environ.get("FITLLM_DATA", "../shared/data"))
    a = ap.parse_args()
    assert torch.__version__.startswith("2.15.0"), torch.__version__
    torch.manual_seed(0)
    cfg = tiny_config()
    t = tiny_tensors()
    write_safetensors(os.path.join(folder("tiny-st", cfg), "model.safetensors"), t)

    # pytorch_model.bin: layer 0's q, k, v as row slices of one storage (offsets 0, NH*HD*C, ...)
    sd = collections.OrderedDict(t)
    p = "model.layers.0.self_attn."
    fused = torch.cat([t[p + "q_proj.weight"], t[p + "k_proj.weight"], t[p + "v_proj.weight"]])
    sd[p + "q_proj.weight"], sd[p + "k_proj.weight"], sd[p + "v_proj.weight"] = fused.split([NH * HD, NKV * HD, NKV * HD])
    torch.save(as_state_dict(sd), os.path.join(folder("tiny-bin", cfg), "pytorch_model.bin"))

    # sharded as transformers' save_pretrained(safe_serialization=False) names them
    d = folder("tiny-sharded", cfg)
    names = list(t)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    wm = {}
    for k, part in enumerate(halves):
        fn = f"pytorch_model-{k + 1:05d}-of-00002.bin"
        torch.save(as_state_dict(collections.OrderedDict((n, t[n]) for n in part)), os.path.join(d, fn))
        wm.update({n: fn for n in part})
    total = sum(x.numel() * x.element_size() for x in t.values())
    with open(os.path.join(d, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2)

    torch.save(lit_names(t, False), os.path.join(folder("tiny-lit", cfg), "lit_model.pth"))
    d = os.path.join(OUT, "tiny-lit-yaml")  # LitGPT's own folder: model_config.yaml, no config.json
    os.makedirs(d, exist_ok=True)
    torch.save(lit_names(t, False), os.path.join(d, "lit_model.pth"))
    with open(os.path.join(d, "model_config.yaml"), "w") as f:  # as litgpt download writes it (sorted keys)
        f.write(LIT_YAML)
    torch.save({"model": lit_names(t, True), "iter_num": 7},
               os.path.join(folder("tiny-lit-old", cfg), "lit_model.pth"))

    torch.save({"x": Evil()}, os.path.join(OUT, "evil.bin"))
    torch.save({"w": torch.ones(3)}, os.path.join(OUT, "legacy.bin"), _use_new_zipfile_serialization=False)

    src = os.path.join(a.data, "stories260K-hf")
    with open(os.path.join(src, "config.json")) as f:
        scfg = json.load(f)
    scfg["torch_dtype"] = "bfloat16"
    st = read_safetensors(os.path.join(src, "model.safetensors"))
    bf = as_state_dict(collections.OrderedDict((n, x.to(torch.bfloat16)) for n, x in st.items()))
    torch.save(bf, os.path.join(folder("stories260K-bf16", scfg), "pytorch_model.bin"))
    seeds = "fuzz/seeds-torch"
    os.makedirs(seeds, exist_ok=True)
    a = torch.arange(6, dtype=torch.float32)
    small = collections.OrderedDict([("a", a.reshape(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16)),
                                     ("c", a[2:]), ("d", torch.zeros(2, dtype=torch.float16)), ("e", torch.tensor(1.5, dtype=torch.float64))])
    torch.save(as_state_dict(small), os.path.join(seeds, "small.bin"))
    torch.save(small, os.path.join(seeds, "proto4.bin"), pickle_protocol=4)
    torch.save({"model": {"transformer.wte.weight": torch.ones(4, 2)}, "iter_num": 1}, os.path.join(seeds, "lit.pth"))
    torch.save({"x": torch.nn.Parameter(torch.ones(2))}, os.path.join(seeds, "param.bin"))
    torch.save({"x": Evil()}, os.path.join(seeds, "evil.bin"))
    torch.save({"w": torch.ones(3)}, os.path.join(seeds, "legacy.bin"), _use_new_zipfile_serialization=False)
    for root, _, files in list(os.walk(OUT)) + list(os.walk(seeds)):
        for fn in files:
            print(os.path.join(root, fn), os.path.getsize(os.path.join(root, fn)))


if __name__ == "__main__":
    main()
