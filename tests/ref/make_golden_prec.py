"""bf16-true and 16-mixed references for tests/fixtures/golden-llama: the same model, batch and
loss as make_golden.py / make_golden_bf16.py, under two more precision policies. Writes

  tests/fixtures/golden-llama/golden-bf16-true.safetensors
      model.to(torch.bfloat16) (every weight bf16, eager attention), forward, loss on
      logits.float(), backward (bf16 gradients, stored widened to fp32), then ONE
      torch.optim.AdamW step on the bf16 parameters (bf16 optimizer state, single-tensor
      for-loop implementation: foreach=False, fused=False) with make_golden.py's
      hyperparameters. Tensors: "logits", "loss", "grad.<name>", "after1.<name>".
  tests/fixtures/golden-llama/golden-16-mixed.safetensors
      fp32 master weights, torch.autocast("cpu", dtype=torch.float16) around forward + loss,
      (loss * 2**16).backward(), every fp32 gradient then divided by 2**16.
      Tensors: "logits", "loss", "grad.<name>".

"logits" is stored as fp32 (the bf16 / fp16 values widened), "loss" as fp32 (1,), gradients as
fp32. It also prints, for information, each policy's distance to the fp32 golden
(golden.safetensors): max |x - x_fp32| / max |x_fp32| per tensor (worst over the grads).

    /work/venv/bin/python tests/ref/make_golden_prec.py
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

D = "tests/fixtures/golden-llama"
# make_golden.py's AdamW hyperparameters (its 5-step run)
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
SCALE = 2.0 ** 16


def load_model():
    m = LlamaForCausalLM.from_pretrained(D, dtype=torch.float32, attn_implementation="eager")
    m.train()
    return m


def ce(logits, tgt):
    V = logits.shape[-1]
    return F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1), ignore_index=-100)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def report(tag, out, g, prefix="grad."):
    print(f"{tag}: loss {out['loss'].item():.6f} (fp32 {g['loss'].item():.6f}, "
          f"abs diff {abs(out['loss'].item() - g['loss'].item()):.2e})")
    print(f"  logits max|d|/max|ref| = {rel(out['logits'], g['logits']):.3e}")
    per = {k: rel(v, g[k]) for k, v in out.items() if k.startswith(prefix)}
    worst = max(per, key=per.get)
    med = sorted(per.values())[len(per) // 2]
    print(f"  grads  worst {per[worst]:.3e} ({worst}), median {med:.3e}")
    for k in sorted(per):
        print(f"    {k:<52} {per[k]:.3e}")
    return per


def meta_common():
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0],
            "loss": "F.cross_entropy(logits.float().view(-1,V), targets.view(-1).long(), ignore_index=-100), mean over non-ignored; no label shifting",
            "command": " ".join(sys.argv)}


def bf16_true(g, ids, tgt):
    model = load_model().to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    loss = ce(logits, tgt)
    loss.backward()
    out = {"logits": logits.detach().float().contiguous(), "loss": loss.detach().reshape(1).float()}
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.bfloat16, name
        out["grad." + name] = p.grad.detach().float().contiguous()
    per = report("bf16-true", out, g)

    # one AdamW step on the bf16 params; other implementations compared for information
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    results = {}
    for impl, kw in (("forloop", dict(foreach=False, fused=False)),
                     ("foreach", dict(foreach=True, fused=False)),
                     ("fused", dict(foreach=False, fused=True))):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(init[n])
                p.grad = grads[n].clone()
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                    weight_decay=WD, **kw)
            opt.step()
        except Exception as e:  # noqa: BLE001
            print(f"  AdamW {impl}: not available ({e})")
            continue
        st = opt.state[next(iter(model.parameters()))]
        results[impl] = {n: p.detach().clone() for n, p in model.named_parameters()}
        print(f"  AdamW {impl}: state dtype exp_avg {st['exp_avg'].dtype}")
    after = results["forloop"]
    for impl in ("foreach", "fused"):
        if impl in results:
            nd = sum(int((results[impl][n] != after[n]).sum()) for n in after)
            print(f"  after1 {impl} vs forloop: {nd} of {sum(v.numel() for v in after.values())} elements differ")
    nchg = {n: int((after[n] == init[n]).sum()) for n in after}
    norms = [n for n in after if n.endswith("norm.weight")]
    zrows = int((grads["model.embed_tokens.weight"].abs().sum(1) == 0).sum())
    print(f"  after1: {sum(nchg.values())} elements unchanged by the step: norm weights "
          f"{sum(nchg[n] for n in norms)} of {sum(after[n].numel() for n in norms)} (values ~1: "
          f"bf16 half-ulp >= 2^-9 > lr), embed_tokens {nchg['model.embed_tokens.weight']} "
          f"({zrows} rows with zero grad: decay-only, 1-lr*wd rounds back), others "
          f"{sum(v for n, v in nchg.items() if n not in norms and n != 'model.embed_tokens.weight')}")
    for n, v in after.items():
        out["after1." + n] = v.float().contiguous()

    # fp32 one-step reference (informative): same step from the fp32 weights and fp32 grads
    m32 = load_model()
    with torch.no_grad():
        for n, p in m32.named_parameters():
            p.grad = g["grad." + n].clone()
    torch.optim.AdamW(m32.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      foreach=False).step()
    a = {n: rel(out["after1." + n], p.detach()) for n, p in m32.named_parameters()}
    w = max(a, key=a.get)
    print(f"  after1 vs fp32 one-step: worst max|d|/max|ref| {a[w]:.3e} ({w})")

    meta = meta_common()
    meta["policy"] = ("bf16-true: model.to(torch.bfloat16) (weights rounded to nearest-even bf16), "
                      "eager attention, forward in bf16, loss on logits.float(), backward -> bf16 grads "
                      "(stored widened to fp32); logits stored widened to fp32")
    meta["optimizer"] = json.dumps({"name": "torch.optim.AdamW", "lr": LR, "betas": list(BETAS),
                                    "eps": EPS, "weight_decay": WD, "steps": 1, "amsgrad": False,
                                    "foreach": False, "fused": False,
                                    "implementation": "single-tensor for-loop (_single_tensor_adamw), "
                                    "params and exp_avg/exp_avg_sq in bf16",
                                    "stored": "after1.<name> = bf16 params after the step, widened to fp32"})
    save_file(out, f"{D}/golden-bf16-true.safetensors", metadata=meta)
    os.chmod(f"{D}/golden-bf16-true.safetensors", 0o644)
    return out, per


def mixed16(g, ids, tgt):
    model = load_model()
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        logits = model(input_ids=ids).logits
        loss = ce(logits, tgt)
    print(f"16-mixed: autocast logits dtype {logits.dtype}, loss dtype {loss.dtype}")
    assert logits.dtype == torch.float16, "CPU autocast float16 not effective"
    (loss * SCALE).backward()
    out = {"logits": logits.detach().float().contiguous(), "loss": loss.detach().reshape(1).float()}
    gmax = 0.0
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        gr = p.grad.detach() / SCALE
        assert torch.isfinite(gr).all(), f"non-finite gradient in {name}"
        gmax = max(gmax, gr.abs().max().item())
        out["grad." + name] = gr.contiguous()
    print(f"  all grads finite; max |grad| {gmax:.4e} (scaled: {gmax * SCALE:.4e})")
    per = report("16-mixed", out, g)
    meta = meta_common()
    meta["policy"] = ("16-mixed: fp32 master weights; torch.autocast(cpu, float16) around forward + loss "
                      "(real CPU fp16 autocast, not emulated); (loss * 2**16).backward(); "
                      "fp32 grads divided by 2**16 (= GradScaler(init_scale=2**16).unscale_); "
                      "no inf/nan in any grad; logits (fp16) stored widened to fp32")
    meta["loss_scale"] = json.dumps(SCALE)
    save_file(out, f"{D}/golden-16-mixed.safetensors", metadata=meta)
    os.chmod(f"{D}/golden-16-mixed.safetensors", 0o644)
    return out, per


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    g = load_file(f"{D}/golden.safetensors")
    ids, tgt = g["input_ids"].long(), g["targets"].long()
    bf16_true(g, ids, tgt)
    mixed16(g, ids, tgt)
    # bf16-mixed (committed fixture) for comparison
    try:
        bm = load_file(f"{D}/golden-bf16-mixed.safetensors")
        report("bf16-mixed (existing fixture)", bm, g)
    except FileNotFoundError:
        pass


if __name__ == "__main__":
    main()
