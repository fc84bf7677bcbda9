#!/usr/bin/env python3
# What PyTorch allocates for a LLaMA full fine-tune step, measured on the CPU for small shapes: the anchor of
# the lab's `--peer pytorch` allocation model (src/lab/lab_peer.c; issue 33). Per configuration it records
#   params     bytes of the parameters (model dtype: 32-true fp32, bf16-true bf16)
#   grads      bytes of the .grad tensors after backward
#   optim      bytes of torch.optim.AdamW's state after one step (exp_avg, exp_avg_sq in the parameter dtype;
#              the step counters, one fp32 scalar per parameter, counted too)
#   saved      bytes of the distinct storages autograd saves for backward during the forward (saved_tensors_hooks;
#              parameters excluded): what a training step keeps alive between forward and backward
#   logits     bytes of the (B, T, V) logits the forward returns (HF keeps them in the output)
# with HF transformers' LlamaForCausalLM, attn_implementation="sdpa" (on the CPU: the flash kernel, which saves
# q, k, v, out and the fp32 logsumexp, as the GPU's flash / memory-efficient kernels do) and its own loss
# (logits upcast to fp32, cross entropy over the shifted labels). Only the forward's saved tensors and the
# state sizes are measured here; the peak (what is live at once in backward) and the CUDA caching allocator's
# rounding are modelled in C, not measured (no GPU).
# Pinned: torch==2.15.0, transformers==5.23.0 (the venv /work/venv-graph). Run:
#   /work/venv-graph/bin/python tests/ref/pytorch_alloc.py > tests/fixtures/pytorch-alloc.json
import json, sys
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

assert torch.__version__.startswith("2.15.0") and transformers.__version__ == "5.23.0", (torch.__version__,
                                                                                     transformers.__version__)


def measure(B, T, dtype, L, H, KV, d, ff, V, hd):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=d, intermediate_size=ff, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=KV, head_dim=hd, max_position_embeddings=256, attn_implementation="sdpa",
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).to(dtype)
    pids = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in pids:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    x = torch.randint(0, V, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = m(input_ids=x, labels=x)
    saved = sum(seen.values())
    logits = out.logits.untyped_storage().nbytes()
    out.loss.backward()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt.step()
    params = sum(p.untyped_storage().nbytes() for p in m.parameters())
    grads = sum(p.grad.untyped_storage().nbytes() for p in m.parameters())
    optim = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return dict(B=B, T=T, precision="32-true" if dtype == torch.float32 else "bf16-true", layers=L, heads=H,
                kv_heads=KV, dim=d, ffn=ff, vocab=V, head_dim=hd, n_params=sum(p.numel() for p in m.parameters()),
                params=params, grads=grads, optim=optim, saved=saved, logits=logits)


rows = []
for dtype in (torch.float32, torch.bfloat16):
    for (B, T, L, H, KV, d, ff, V, hd) in ((2, 24, 1, 4, 4, 64, 172, 512, 16), (2, 24, 2, 4, 4, 64, 172, 512, 16),
                                          (1, 37, 2, 4, 2, 64, 172, 512, 16), (3, 20, 3, 8, 2, 96, 256, 300, 12)):
        rows.append(measure(B, T, dtype, L, H, KV, d, ff, V, hd))
json.dump({"torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}, sys.stdout, indent=1)
print()
