"""bf16-true references for the golden LLaMA and GPT-2 under two legitimate bf16 orderings, to anchor
fitllm's bf16-true (issue 30: every activation stored in bf16) and to measure the precision's own noise.

Pinned: torch 2.15.0, transformers 5.23.0, safetensors 0.8.0 (/work/venv-graph; the script refuses others).

For each model (tests/fixtures/golden-llama, golden-gpt2: the batch and loss of make_golden.py):
  ref  model.to(torch.bfloat16), attn_implementation="eager" (the attention scores, softmax (fp32 inside,
       cast back) and the weighted sum as separate bf16 ops), forward, loss on logits.float(), backward:
       bf16 weights, activations and gradients, as make_golden_prec.py's bf16-true (LLaMA: the script checks
       that it reproduces golden-bf16-true.safetensors bit for bit).
  alt  the same with attn_implementation="sdpa" (PyTorch's fused scaled-dot-product attention: scores and
       softmax in one kernel, other rounding points and summation order): an equally legitimate bf16 run.
Writes
  tests/fixtures/golden-gpt2/golden-bf16-true.safetensors      "logits", "loss", "grad.<name>" of ref
  tests/fixtures/golden-<m>/golden-bf16-true-alt.safetensors   the same tensors of alt
(logits and gradients widened to fp32). The distance between ref and alt (max |a - b| / max |b| per tensor)
is the bf16 noise a third implementation (fitllm's) is held to: tests/test_bf16true.c
bf16_true_vs_pytorch_orders_*.

    /work/venv-graph/bin/python tests/ref/make_golden_bf16_orders.py
"""
import sys

import torch
import torch.nn.functional as F
import transformers
import safetensors
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

PINS = {"torch": "2.15.0", "transformers": "5.23.0", "safetensors": "0.8.0"}


def check_pins():
    have = {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
            "safetensors": safetensors.__version__}
    bad = {k: v for k, v in have.items() if v != PINS[k]}
    if bad:
        sys.exit(f"make_golden_bf16_orders.py: pinned {PINS}, found {bad}")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(d, attn, ids, tgt):
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation=attn)
    m.train()
    m = m.to(torch.bfloat16)
    logits = m(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    V = logits.shape[-1]
    loss = F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1), ignore_index=-100)
    loss.backward()
    out = {"logits": logits.detach().float().contiguous(), "loss": loss.detach().reshape(1).float()}
    for n, p in m.named_parameters():
        if p.grad is None:  # a tied head shares the embedding's
            continue
        assert p.grad.dtype == torch.bfloat16, n
        out["grad." + n] = p.grad.detach().float().contiguous()
    return out


def meta(policy):
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
            "policy": policy, "command": " ".join(sys.argv),
            "loss": "F.cross_entropy(logits.float().view(-1,V), targets.view(-1).long(), ignore_index=-100)"}


def main():
    check_pins()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    for name in ("golden-llama", "golden-gpt2"):
        d = f"tests/fixtures/{name}"
        g = load_file(f"{d}/golden.safetensors")
        ids, tgt = g["input_ids"].long(), g["targets"].long()
        ref, alt = run(d, "eager", ids, tgt), run(d, "sdpa", ids, tgt)
        per = {k: rel(alt[k], ref[k]) for k in ref if k.startswith("grad.")}
        srt = sorted(per.values())
        print(f"{name}: loss eager {ref['loss'].item():.6f} sdpa {alt['loss'].item():.6f} fp32 {g['loss'].item():.6f}; "
              f"sdpa vs eager: logits {rel(alt['logits'], ref['logits']):.3e}, grads worst {srt[-1]:.3e} "
              f"median {srt[len(srt) // 2]:.3e}")
        for k in sorted(per):
            print(f"    {k:<52} {per[k]:.3e}  (eager vs fp32 {rel(ref[k], g[k]):.3e})")
        pol = "bf16-true: model.to(torch.bfloat16), attn_implementation=%s, forward/backward in bf16"
        if name == "golden-llama":  # ref is make_golden_prec.py's committed fixture
            old = load_file(f"{d}/golden-bf16-true.safetensors")
            same = all(torch.equal(old[k], v) for k, v in ref.items())
            print(f"  eager reproduces golden-bf16-true.safetensors bit for bit: {same}")
            assert same
        else:
            save_file(ref, f"{d}/golden-bf16-true.safetensors", metadata=meta(pol % "eager"))
        save_file(alt, f"{d}/golden-bf16-true-alt.safetensors", metadata=meta(pol % "sdpa"))


if __name__ == "__main__":
    main()
