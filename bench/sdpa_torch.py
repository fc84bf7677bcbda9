#!/usr/bin/env python3
# PyTorch's scaled_dot_product_attention forward + backward at fitllm's attention selftest shape, for the
# side-by-side with `fitllm selftest --only attention_choices` (tests/cuda/perf_session.sh step 5).
# Tested with torch 2.5-2.9 (enable_gqa needs 2.5+). Prints one line per backend PyTorch picks:
#   sdpa <backend> B4 T2048 NH32 NKV4 HD64 causal bf16: <us> us <TFLOP/s> TFLOP/s (forward + backward)
# FLOPs counted as the selftest does (causal: 2 B NH T^2 HD forward, 5 backward). Median of 5 after a warm-up.
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def run(backend, B, T, NH, NKV, HD, dtype):
    dev = "cuda"
    q = torch.randn(B, NH, T, HD, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, NKV, T, HD, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, NKV, T, HD, device=dev, dtype=dtype, requires_grad=True)
    do = torch.randn(B, NH, T, HD, device=dev, dtype=dtype)

    def step():
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=NKV != NH)
        o.backward(do)

    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    t = statistics.median(times)
    flop = 7.0 * B * NH * T * T * HD
    return t, flop / t * 1e-12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,2048,32,4,64", help="B,T,NH,NKV,HD (TinyLlama-1.1B: 4,2048,32,4,64)")
    args = ap.parse_args()
    B, T, NH, NKV, HD = (int(x) for x in args.shape.split(","))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            t, tf = run(be, B, T, NH, NKV, HD, torch.bfloat16)
            print(f"sdpa {name:9s} B{B} T{T} NH{NH} NKV{NKV} HD{HD} causal bf16: {t * 1e6:10.1f} us {tf:6.1f} TFLOP/s "
                  f"(forward + backward)")
        except RuntimeError as e:  # a backend that does not take the shape (e.g. cuDNN with GQA on old torch)
            print(f"sdpa {name:9s} not available: {str(e).splitlines()[0]}")


if __name__ == "__main__":
    main()
