"""QLoRA end to end on a real model: stories260K-hf loaded by transformers + bitsandbytes in NF4 with
double quantization, then a PEFT LoRA adapter on top
-> tests/fixtures/qlora-ref.safetensors and tests/fixtures/qlora-adapter/ (tests/test_qlora.c).

  model   ../shared/data/stories260K-hf with BitsAndBytesConfig(load_in_4bit=True,
          bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
          bnb_4bit_compute_dtype=torch.float32), device_map="cpu": every linear of the blocks
          (q,k,v,o,gate,up,down) becomes a bnb Linear4bit; embeddings, norms (and the tied head)
          stay fp32. bitsandbytes quantizes on CPU here (its CPU path, not the CUDA kernel: see
          quant4_ref.py for the differences; this script counts them for this model).
  ids     (2, 32) int32: BOS + the tokenizer's ids of two TinyStories-like sentences, cut to 32.
  deq.<hf module>.weight  f32 (out, in): bnb.functional.dequantize_4bit(weight, quant_state) of
          every Linear4bit, i.e. what the 4-bit layer multiplies by (double-quantized absmax).
  logits_base  f32 (2, 32, 512): the 4-bit model's logits (eval).
  adapter PEFT LoraConfig(r=4, lora_alpha=8, lora_dropout=0, target_modules q_proj, v_proj,
          down_proj), lora_A = PEFT's kaiming init under torch.manual_seed(1234),
          lora_B = N(0,1) * 0.05 under torch.manual_seed(4321) (nonzero, so the adapter matters);
          saved with save_pretrained to tests/fixtures/qlora-adapter/.
  logits_lora  f32 (2, 32, 512): the PeftModel's logits (eval: base 4-bit linear + scaling*B A x,
          unmerged, as QLoRA training runs).

Usage (repo root):  /work/venv/bin/python tests/ref/qlora_ref.py [--model DIR] [--out PATH] [--adapter DIR]
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SENTENCES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
    "with her big red ball and her friend Tom.",
    "One day, a small dog found a shiny stone near the river. He was very happy and ran home to "
    "show it to his mom and dad.",
]
T = 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="../shared/data/stories260K-hf")
    ap.add_argument("--out", default="tests/fixtures/qlora-ref.safetensors")
    ap.add_argument("--adapter", default="tests/fixtures/qlora-adapter")
    args = ap.parse_args()

    import bitsandbytes as bnb
    import bitsandbytes.functional as BF
    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from _common import pick_tokens
    import quant4_ref as q4

    torch.use_deterministic_algorithms(True)
    ids = [pick_tokens(args.model, s, T, bos=1, vocab_limit=512) for s in SENTENCES]
    ids_t = torch.tensor(ids, dtype=torch.long)

    bcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=bcfg, device_map="cpu",
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()
    # bnb's CPU inference fast path (AVX512-BF16 machines, eval, no grad) repacks the weight for a bf16
    # gemm kernel and needs out % 32 == 0 (gate/up have 172 rows); switch it off everywhere so every
    # Linear4bit runs the portable fallback: fp32 dequantize_4bit, then an fp32 matmul.
    for mod in model.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.support_avx512bf16_for_cpu = False

    # ---- dequantized weights -------------------------------------------------------------------
    from safetensors.numpy import load_file
    orig = load_file(os.path.join(args.model, "model.safetensors"))
    out = {"ids": torch.tensor(ids, dtype=torch.int32)}
    n_mod = n_el = n_cuda_diff = n_code_diff = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, bnb.nn.Linear4bit):
            continue
        w = mod.weight
        qs = w.quant_state
        assert qs.quant_type == "nf4" and qs.blocksize == 64 and qs.nested, (name, qs.quant_type, qs.blocksize)
        deq = BF.dequantize_4bit(w.data, qs).float().contiguous()
        out[f"deq.{name}.weight"] = deq
        n_mod += 1
        n_el += deq.numel()
        # informative: the same weight under the CUDA kernel's rules (quant4_ref.py, what fitllm does)
        src = orig[f"{name}.weight"].astype(np.float32)
        packed, absmax = q4.quantize4(src, "nf4")
        offset = np.float32(np.sum(absmax.astype(np.float64)) / absmax.size)
        code8 = BF.create_dynamic_map(signed=True).numpy().astype(np.float32)
        qa, sc = q4.quantize8(code8, (absmax - offset).astype(np.float32))
        dq_absmax = ((code8[qa] * np.repeat(sc, 256)[:absmax.size]).astype(np.float32) + offset).astype(np.float32)
        cuda = q4.dequantize4(packed, dq_absmax, src.size, "nf4").reshape(src.shape)
        n_cuda_diff += int(np.sum(cuda != deq.numpy()))
        bq = w.data.reshape(-1).numpy()
        bc = np.stack([bq >> 4, bq & 15], 1).reshape(-1)[:src.size]
        oc = np.stack([packed >> 4, packed & 15], 1).reshape(-1)[:src.size]
        n_code_diff += int(np.sum(bc != oc))
        print(f"{name}: {tuple(deq.shape)} offset bnb {float(qs.offset):.9g} ours {float(offset):.9g}; "
              f"codes != CUDA rules: {int(np.sum(bc != oc))}; deq != CUDA rules: {int(np.sum(cuda != deq.numpy()))}")
    print(f"{n_mod} Linear4bit modules, {n_el} elements; bnb-cpu vs CUDA-rule reimplementation: "
          f"{n_code_diff} codes differ, {n_cuda_diff} dequantized elements differ")

    with torch.no_grad():
        logits_base = model(input_ids=ids_t).logits.float().contiguous()
    out["logits_base"] = logits_base

    # ---- PEFT LoRA on the 4-bit model ----------------------------------------------------------
    lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                      bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(1234)
    pm = get_peft_model(model, lcfg)
    torch.manual_seed(4321)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.05)
    pm.eval()
    with torch.no_grad():
        logits_lora = pm(input_ids=ids_t).logits.float().contiguous()
    out["logits_lora"] = logits_lora
    print("max |logits_lora - logits_base| =", float((logits_lora - logits_base).abs().max()),
          " max |logits_base| =", float(logits_base.abs().max()))
    if os.path.isdir(args.adapter):
        shutil.rmtree(args.adapter)
    pm.save_pretrained(args.adapter, safe_serialization=True)
    for extra in os.listdir(args.adapter):  # keep only the two files PEFT needs (README.md is boilerplate)
        if extra not in ("adapter_config.json", "adapter_model.safetensors"):
            os.remove(os.path.join(args.adapter, extra))

    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "bitsandbytes": bnb.__version__, "python": sys.version.split()[0],
            "quant": json.dumps({"quant_type": "nf4", "double_quant": True, "blocksize": 64,
                                 "compute_dtype": "float32", "device": "cpu"}),
            "lora": json.dumps({"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"],
                                "A_seed": 1234, "B": "randn*0.05, seed 4321"}),
            "bnb_cpu_vs_cuda_rules": json.dumps({"codes_differ": n_code_diff, "deq_differ": n_cuda_diff,
                                                 "elements": n_el}),
            "sentences": json.dumps(SENTENCES), "command": "tests/ref/qlora_ref.py"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    save_file(out, args.out, metadata=meta)
    print("wrote", args.out, os.path.getsize(args.out), "bytes;", args.adapter,
          sum(os.path.getsize(os.path.join(args.adapter, f)) for f in os.listdir(args.adapter)), "bytes")


if __name__ == "__main__":
    main()
