#!/usr/bin/env python3
"""PyTorch fp32 distance to the float64 anchor after 5 AdamW steps, with the metric of
tests/test_model.c. Usage: python tests/ref/golden_noise.py [DIR ...] where each DIR is a
make_golden.py --out folder of another fp32 run (other CPU / thread count)."""
import sys, torch
from safetensors.torch import load_file
def metric(g, after, dim, gpt2):
    worst=0.0
    for k in g:
        if not k.startswith("after5_f64."): continue
        n=k[len("after5_f64."):]
        ref=g[k]; p=after["after5."+n].double(); gr=g["grad."+n].double()
        gmax=gr.abs().max(); pmax=ref.abs().max()
        excl=(gr!=0)&(gr.abs()<1e-4*gmax)
        if gpt2 and "c_attn.bias" in n:
            idx=torch.arange(ref.numel()); excl|=(idx>=dim)&(idx<2*dim)
        d=(p-ref).abs().reshape(-1)[~excl.reshape(-1)]
        worst=max(worst,(d.max()/pmax).item())
    return worst
for m,dim,gpt2 in [("golden-llama",96,False),("golden-gpt2",64,True)]:
    g=load_file(f"tests/fixtures/{m}/golden.safetensors")
    res=[f"zen4-committed {metric(g,g,dim,gpt2):.3g}"]
    for alt in sys.argv[1:]:
        a=load_file(f"{alt}/{m}/golden.safetensors"); res.append(f"{alt} {metric(g,a,dim,gpt2):.3g}")
    print(m, *res)
