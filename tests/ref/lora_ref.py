"""LoRA linear reference with PEFT (peft.tuners.lora.Linear around torch.nn.Linear)
-> tests/fixtures/lora-ref.safetensors.

Case "a": in 37, out 29, r 5, alpha 10 (scaling 2), N 11 rows, dropout 0 (exact), fp32.
Case "b": use_rslora (scaling alpha/sqrt(r)), in 16, out 24, r 4, alpha 6, N 7.
Stored per case: x, W (frozen base, with bias), A (r, in), B (out, r), dy, and PEFT's y, dx, dA, dB
(autograd of sum(y * dy)). Usage (repo root): /work/venv/bin/python tests/ref/lora_ref.py
"""
import argparse
import os

import peft
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file


class M(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.proj = torch.nn.Linear(i, o)

    def forward(self, x):
        return self.proj(x)


def case(tag, i, o, r, alpha, n, rs, out):
    g = torch.Generator().manual_seed(ord(tag) + 7)
    base = M(i, o)
    with torch.no_grad():
        base.proj.weight.copy_(torch.randn(o, i, generator=g) * 0.2)
        base.proj.bias.copy_(torch.randn(o, generator=g) * 0.1)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["proj"], use_rslora=rs)
    pm = get_peft_model(base, cfg)
    lin = pm.base_model.model.proj
    with torch.no_grad():
        lin.lora_B["default"].weight.copy_(torch.randn(o, r, generator=g) * 0.3)
    x = torch.randn(n, i, generator=g).requires_grad_(True)
    dy = torch.randn(n, o, generator=g)
    y = pm(x)
    (y * dy).sum().backward()
    A = lin.lora_A["default"].weight
    B = lin.lora_B["default"].weight
    assert lin.base_layer.weight.grad is None
    print(tag, "scaling", lin.scaling["default"])
    out.update({f"{tag}.x": x.detach(), f"{tag}.W": lin.base_layer.weight.detach(), f"{tag}.bias": lin.base_layer.bias.detach(),
                f"{tag}.A": A.detach(), f"{tag}.B": B.detach(), f"{tag}.dy": dy, f"{tag}.y": y.detach(),
                f"{tag}.dx": x.grad, f"{tag}.dA": A.grad, f"{tag}.dB": B.grad,
                f"{tag}.scaling": torch.tensor([lin.scaling["default"]], dtype=torch.float32)})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/lora-ref.safetensors")
    args = ap.parse_args()
    out = {}
    case("a", 37, 29, 5, 10, 11, False, out)
    case("b", 16, 24, 4, 6, 7, True, out)
    save_file({k: v.contiguous().float() for k, v in out.items()}, args.out,
              metadata={"peft": peft.__version__, "torch": torch.__version__})
    print("wrote", args.out, os.path.getsize(args.out))


if __name__ == "__main__":
    main()
