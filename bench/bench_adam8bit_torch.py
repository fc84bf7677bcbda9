"""bitsandbytes' AdamW8bit on the CPU: one step over a flat fp32 parameter of n elements (8-bit block-wise state),
the median of reps after one warm-up, milliseconds. The peer of bench/adam8bit_bench.c (same n, threads, lr,
betas, eps, weight decay); bench/run_adam8bit_bench.sh runs both in turn.
Usage: bench_adam8bit_torch.py [threads=2] [n=26000000] [reps=5]"""
import statistics
import sys
import time

import bitsandbytes as bnb
import torch


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 26_000_000
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(7)
    p = torch.nn.Parameter((torch.rand(n, generator=gen) - 0.5) * 0.04)
    opt = bnb.optim.AdamW8bit([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p.grad = (torch.rand(n, generator=gen) - 0.5) * 2e-3
    ts = []
    for r in range(reps + 1):  # r 0: the warm-up
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    st = opt.state[p]
    assert st["state1"].dtype == torch.uint8, "bitsandbytes kept fp32 state (not the 8-bit path)"
    t = sorted(ts[1:])
    print(f"RESULT bitsandbytes {bnb.__version__} AdamW8bit (torch {torch.__version__}) n={n} threads={threads} "
          f"median_ms={statistics.median(t) * 1e3:.1f} min_ms={t[0] * 1e3:.1f} max_ms={t[-1] * 1e3:.1f}")


if __name__ == "__main__":
    main()
