"""bf16-mixed reference for tests/fixtures/golden-llama: the same model, batch and loss as
make_golden.py, with forward + loss under torch.autocast("cpu", dtype=torch.bfloat16)
(PyTorch's bf16-mixed: fp32 master weights, matmuls with bf16 operands and fp32
accumulation). Writes tests/fixtures/golden-llama/golden-bf16-mixed.safetensors with
"logits", "loss" and "grad.<name>" (fp32 gradients of the fp32 master weights).

    /work/venv/bin/python tests/ref/make_golden_bf16.py
"""
import json
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

D = "tests/fixtures/golden-llama"


def main():
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(D, dtype=torch.float32, attn_implementation="eager")
    model.train()
    g = load_file(f"{D}/golden.safetensors")
    ids, tgt = g["input_ids"].long(), g["targets"].long()
    V = model.config.vocab_size
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1), ignore_index=-100)
    loss.backward()
    out = {"logits": logits.float().detach().contiguous(), "loss": loss.detach().reshape(1).float()}
    sd = model.state_dict()
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().float().contiguous()
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "policy": "torch.autocast(cpu, bfloat16) around forward + loss",
            "command": " ".join(sys.argv)}
    save_file(out, f"{D}/golden-bf16-mixed.safetensors", metadata=meta)
    print(f"bf16-mixed loss {loss.item():.6f} (fp32 reference {g['loss'].item():.6f}); {len(out)} tensors")


if __name__ == "__main__":
    main()
