"""8-bit AdamW reference (bitsandbytes semantics) -> tests/fixtures/adam8bit-ref.safetensors.

What is reproduced: the CUDA kernel kOptimizerStatic8bit2StateBlockwise<float, ADAM, 256, 1>
(bitsandbytes csrc/cuda/optimizers.cu; older trees: csrc/kernels.cu) and, for tensors with fewer
than min_8bit_size = 4096 elements, kOptimizer32bit2State<float, ADAM> (fp32 state), i.e. what
bnb.optim.AdamW8bit / Adam8bit do on a GPU. All arithmetic is float32 in the kernel's order
(numpy float32 scalars and arrays, no fused multiply-add), so the C kernel can match bit for bit
up to libm differences:

  per block of 256 (state codes q_m, q_v; absmax_m, absmax_v):
    g finite:   v = code_u[q_v]*absmax_v * b2 + ((1-b2)*g)*g      (g = g_raw * gnorm_scale)
                m = code_s[q_m]*absmax_m * b1 + (1-b1)*g
    g inf/NaN:  m = v = 0 (the element's state is RESET, not kept), parameter untouched
    absmax_* = max |.| over the block (the reset zeros included)
    c1 = 1 - powf(b1, t); c2 = sqrtf(1 - powf(b2, t)); step_size = (-lr*c2)/c1
    p = p + step_size * (m / (sqrtf(v) + c2*eps)); then if wd > 0: p = p * (1 - lr*wd)
    q_m = quantize_2D<signed>(m / absmax_m) (+ sign fix), q_v = quantize_2D<unsigned>(v / absmax_v)
  fp32 path: same update without the inf/NaN rule (m, v float32, no quantization).

The 256-entry code tables come from bitsandbytes.functional.create_dynamic_map(signed=True/False)
(max_exponent_bits 7) when bitsandbytes is importable; they are stored in the fixture.

bitsandbytes 0.50.2 runs on CPU here, but its CPU optimizer path
(backends/cpu/ops.py _optimizer_update_8bit_blockwise_cpu) is a different algorithm: weight decay
before the update, no inf/NaN rule, and quantization through quantize_blockwise_cpu. This script
runs it on the same data (wd = 0, no inf/NaN) and prints how far it is from the kernel
reimplementation, so the machinery (maps, blocks, absmax, dequantization) is cross-checked
against the real library.

Usage (repo root):  /work/venv/bin/python tests/ref/adam8bit_ref.py [--out PATH]
"""
import argparse
import os

import numpy as np
import torch
from safetensors.torch import save_file

F32 = np.float32
BLOCK = 256
MIN_8BIT = 4096


def code_tables():
    import bitsandbytes.functional as BF
    s = BF.create_dynamic_map(signed=True).numpy().astype(F32)
    u = BF.create_dynamic_map(signed=False).numpy().astype(F32)
    return s, u


def quantize_2d(code, x, signed):
    """quantize_2D<SIGNED> from the kernel, vectorized over x (float32)."""
    x = x.astype(F32)
    n = x.shape[0]
    pivot = np.full(n, 127, np.int64)
    upper_pivot = np.full(n, 255, np.int64)
    lower_pivot = np.zeros(n, np.int64)
    lower = np.full(n, F32(-1.0) if signed else F32(0.0), F32)
    upper = np.full(n, F32(1.0), F32)
    val = code[pivot]
    i = 64
    while i > 0:
        gt = x > val
        lower_pivot = np.where(gt, pivot, lower_pivot)
        lower = np.where(gt, val, lower)
        upper_pivot = np.where(gt, upper_pivot, pivot)
        upper = np.where(gt, upper, val)
        pivot = np.where(gt, pivot + i, pivot - i)
        val = code[pivot]
        i >>= 1
    gt = x > val
    mid_up = ((upper + val) * F32(0.5)).astype(F32)
    mid_lo = ((lower + val) * F32(0.5)).astype(F32)
    res = np.where(gt, np.where(x > mid_up, upper_pivot, pivot), np.where(x < mid_lo, lower_pivot, pivot))
    return res


def step8(p, g_raw, qm, qv, am, av, cs, cu, lr, b1, b2, eps, wd, t, gscale):
    n = p.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    c1 = F32(1) - np.power(b1, F32(t))
    c2 = np.sqrt(F32(1) - np.power(b2, F32(t)))
    step_size = F32(-lr * c2) / c1
    fin = np.isfinite(g_raw)
    g = np.where(fin, g_raw, F32(0)).astype(F32) * gscale
    blk = np.arange(n) // BLOCK
    v = cu[qv] * av[blk]
    v = v * b2 + ((F32(1) - b2) * g) * g
    m = cs[qm] * am[blk]
    m = m * b1 + (F32(1) - b1) * g
    m = np.where(fin, m, F32(0)).astype(F32)
    v = np.where(fin, v, F32(0)).astype(F32)
    pad = nb * BLOCK - n
    am_new = np.abs(np.concatenate([m, np.zeros(pad, F32)])).reshape(nb, BLOCK).max(1).astype(F32)
    av_new = np.abs(np.concatenate([v, np.zeros(pad, F32)])).reshape(nb, BLOCK).max(1).astype(F32)
    # the last partial block: only valid items enter the max (zeros are harmless: max >= 0)
    upd = p + step_size * (m / (np.sqrt(v) + c2 * eps))
    if wd > 0:
        upd = upd * (F32(1) - lr * wd)
    p_new = np.where(fin, upd, p).astype(F32)
    with np.errstate(invalid="ignore", divide="ignore"):
        xm = (m / am_new[blk]).astype(F32)
        xv = (v / av_new[blk]).astype(F32)
    qm_new = quantize_2d(cs, xm, True)
    sb_code = np.signbit(cs[qm_new])
    sb_m = np.signbit(m)
    fix = sb_code != sb_m
    qm_new = np.where(fix & (m > 0), qm_new + 1, np.where(fix, qm_new - 1, qm_new)) % 256
    qv_new = quantize_2d(cu, xv, False)
    return p_new, qm_new.astype(np.uint8), qv_new.astype(np.uint8), am_new, av_new


def step32(p, g, m, v, lr, b1, b2, eps, wd, t, gscale):
    g = (g * gscale).astype(F32)
    c1 = F32(1) - np.power(b1, F32(t))
    c2 = np.sqrt(F32(1) - np.power(b2, F32(t)))
    step_size = F32(-lr * c2) / c1
    m = (m * b1 + (F32(1) - b1) * g).astype(F32)
    v = (v * b2 + ((F32(1) - b2) * g) * g).astype(F32)
    p = (p + step_size * (m / (np.sqrt(v) + eps * c2))).astype(F32)
    if wd > 0:
        p = (p * (F32(1) - lr * wd)).astype(F32)
    return p, m, v


def make_grads(rng, n, k, inject):
    # per-block magnitudes over ~4 decades so the dynamic map's exponent range is exercised
    scale = np.exp(rng.uniform(-6, 2, size=(n + BLOCK - 1) // BLOCK)).astype(F32)
    gs = []
    for j in range(k):
        g = (rng.standard_normal(n).astype(F32) * np.repeat(scale, BLOCK)[:n]).astype(F32)
        g[rng.integers(0, n, size=n // 50)] = 0  # exact zeros
        gs.append(g)
    if inject:
        gs[k - 1][10] = np.nan
        gs[k - 1][300] = -np.inf
        gs[k - 1][4999 if n > 4999 else n - 1] = np.inf
    return np.stack(gs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/adam8bit-ref.safetensors")
    args = ap.parse_args()
    cs, cu = code_tables()
    lr, b1, b2, eps, wd, gscale = F32(1e-2), F32(0.9), F32(0.999), F32(1e-8), F32(1e-2), F32(1.0)
    steps, K = 20, 4
    rng = np.random.default_rng(1234)
    na, nb_ = 5000, 3000
    pa0 = rng.standard_normal(na).astype(F32)
    pb0 = rng.standard_normal(nb_).astype(F32)
    ga = make_grads(rng, na, K, True)
    gb = make_grads(rng, nb_, K, False)

    # --- tensor a: 8-bit path (5000 >= 4096), 20 blocks (last one has 136 items)
    nblk = (na + BLOCK - 1) // BLOCK
    p = pa0.copy()
    qm = np.zeros(na, np.uint8)   # bnb: zeros_like(p, dtype=uint8), absmax zeros
    qv = np.zeros(na, np.uint8)
    am = np.zeros(nblk, F32)
    av = np.zeros(nblk, F32)
    pa_hist = []
    for t in range(1, steps + 1):
        p, qm, qv, am, av = step8(p, ga[(t - 1) % K], qm, qv, am, av, cs, cu, lr, b1, b2, eps, wd, t, gscale)
        pa_hist.append(p.copy())

    # --- tensor b: fp32 state path (3000 < 4096)
    q = pb0.copy()
    m = np.zeros(nb_, F32)
    v = np.zeros(nb_, F32)
    pb_hist = []
    for t in range(1, steps + 1):
        q, m, v = step32(q, gb[(t - 1) % K], m, v, lr, b1, b2, eps, wd, t, gscale)
        pb_hist.append(q.copy())

    T = lambda x: torch.from_numpy(np.ascontiguousarray(x))
    tensors = {
        "code_signed": T(cs), "code_unsigned": T(cu),
        "hparams": T(np.array([lr, b1, b2, eps, wd, gscale, steps, K], F32)),
        "a.p0": T(pa0), "a.grads": T(ga), "a.params": T(np.stack(pa_hist)),
        "a.q_m": T(qm), "a.q_v": T(qv), "a.absmax_m": T(am), "a.absmax_v": T(av),
        "b.p0": T(pb0), "b.grads": T(gb), "b.params": T(np.stack(pb_hist)), "b.m": T(m), "b.v": T(v),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    save_file(tensors, args.out, metadata={"generator": "tests/ref/adam8bit_ref.py",
                                           "semantics": "bitsandbytes kOptimizerStatic8bit2StateBlockwise ADAM, blocksize 256"})
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    cross_check_bnb(cs, cu, pa0, ga, lr, b1, b2, eps, steps, K)


def cross_check_bnb(cs, cu, p0, grads, lr, b1, b2, eps, steps, K):
    """bitsandbytes' own CPU AdamW8bit vs the kernel reimplementation, wd = 0, no inf/NaN."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001
        print("bitsandbytes not importable:", e)
        return
    grads = np.nan_to_num(grads.copy(), nan=0.0, posinf=0.0, neginf=0.0)
    n = p0.shape[0]
    par = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = bnb.optim.AdamW8bit([par], lr=float(lr), betas=(float(b1), float(b2)), eps=float(eps), weight_decay=0.0)
    nblk = (n + BLOCK - 1) // BLOCK
    p, qm, qv = p0.copy(), np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    am, av = np.zeros(nblk, F32), np.zeros(nblk, F32)
    for t in range(1, steps + 1):
        par.grad = torch.from_numpy(grads[(t - 1) % K].copy())
        opt.step()
        p, qm, qv, am, av = step8(p, grads[(t - 1) % K], qm, qv, am, av, cs, cu, lr, b1, b2, eps, F32(0), t, F32(1))
    st = opt.state[par]
    pb = par.detach().numpy()
    print(f"bitsandbytes {bnb.__version__} CPU AdamW8bit ran: state1 {st['state1'].dtype}, "
          f"{st['absmax1'].numel()} blocks; qmap equal to create_dynamic_map: "
          f"{np.array_equal(st['qmap1'].numpy(), cs)} / {np.array_equal(st['qmap2'].numpy(), cu)}")
    print(f"  vs kernel reimplementation after {steps} steps (wd=0): max|dp| = {np.abs(pb - p).max():.3e} "
          f"(max|p| {np.abs(p).max():.3f}), q_m equal {np.mean(st['state1'].numpy() == qm) * 100:.2f}%, "
          f"|dq_m|<=1 {np.mean(np.abs(st['state1'].numpy().astype(int) - qm) <= 1) * 100:.2f}%, "
          f"q_v equal {np.mean(st['state2'].numpy() == qv) * 100:.2f}%, "
          f"absmax_m rel diff {np.max(np.abs(st['absmax1'].numpy() - am) / np.maximum(am, 1e-30)):.2e}")


if __name__ == "__main__":
    main()
