"""4-bit (NF4 / FP4) quantization reference, bitsandbytes CUDA-kernel semantics
-> tests/fixtures/quant4-ref.safetensors.

What is reproduced (bitsandbytes csrc/kernels.cu, what bnb.functional.quantize_4bit does on a GPU,
i.e. what QLoRA / transformers' BitsAndBytesConfig(load_in_4bit=True) store):

  kQuantizeBlockwise<float, 64, 2, 0, NF4|FP4> over the row-major weight, n elements:
    per block of 64 (last one partial): absmax = max |x| (fp32);
    r = 1.0f / absmax (IEEE fp32 division; an all-zero block gives r = inf);
    code = dQuantizeNF4(x * r) or dQuantizeFP4(x * r): the kernel's decision trees with its
      float thresholds (x > t goes up; 0 * inf = NaN fails every comparison -> code 0);
    two codes per byte, element 2k in the HIGH nibble, 2k+1 in the low nibble (odd n: last
      low nibble 0); (n + 1) / 2 bytes.
  dequantize: NF4 lut[q] * absmax; FP4 (lut[q & 7] * (q & 8 ? -1 : 1)) * absmax (fp32).
  compress_statistics (double quantization, "-dq"):
    offset = absmax.mean(); bnb uses torch's fp32 mean; we define it as the float64 sum / n
      rounded to fp32 (deterministic; the script reports torch's value beside it);
    q_absmax, absmax_scale = quantize_blockwise(absmax - offset, blocksize=256) with the signed
      dynamic map create_dynamic_map(signed=True): kQuantizeBlockwise<float, 256, 2, 0,
      General8bit>, i.e. r = 1.0f / max|y| per 256 and dQuantize<0>(code, y * r) (binary search
      with the kernel's midpoint tie rules);
    dequantized absmax = code[q_absmax] * absmax_scale + offset (fp32, two roundings).

The reimplementation is cross-checked against bitsandbytes 0.50.2 itself on CPU (its CPU
quantize_4bit is a torch bucketize on the fp32 code midpoints, its CPU quantize_blockwise a C++
binary search on x / absmax, its CPU dequantize_4bit a native LUT kernel); the differences are
printed and explained in docs/ARCHITECTURE.md ("LoRA and QLoRA building blocks").

Usage (repo root):  /work/venv/bin/python tests/ref/quant4_ref.py [--out PATH]
"""
import argparse
import os

import numpy as np
import torch
from safetensors.torch import save_file

F32 = np.float32
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], F32)
NF4_TREE = [0.03979014977812767, 0.3893125355243683, 0.6427869200706482, 0.8614784181118011,
            0.5016634166240692, 0.2035212516784668, 0.2920137718319893, 0.1202552504837513,
            -0.33967943489551544, -0.13791173323988914, -0.045525018125772476, -0.23460740596055984,
            -0.6106329262256622, -0.4599952697753906, -0.8480964004993439]


def f32_literal(text):
    """A C/CUDA float literal "0.123f": the decimal rounded ONCE to the nearest float32 (ties to even).
    np.float32(0.123) would round twice (decimal -> double -> float) and can be one ulp off: it is for
    -0.8480964004993439f, which is therefore NOT the fp32 midpoint of the two lowest NF4 codes."""
    from fractions import Fraction
    q = Fraction(text)
    c = F32(float(q))
    best = None
    for cand in (np.nextafter(c, F32(-np.inf)), c, np.nextafter(c, F32(np.inf))):
        d = abs(Fraction(float(cand)) - q)
        key = (d, int(np.array(cand).view(np.uint32)) & 1)
        if best is None or key < best[0]:
            best = (key, cand)
    return F32(best[1])


_LIT = {}


def f(t):
    """The kernel's float literal t (its decimal text, exactly as in the source)."""
    if t not in _LIT:
        _LIT[t] = f32_literal(t)
    return _LIT[t]


FP4_LUT = np.array([f32_literal(v) for v in ["0.0", "0.005208333333", "0.66666667", "1.0", "0.33333333", "0.5",
                                               "0.16666667", "0.25"]], F32)


def q_nf4(x):
    """dQuantizeNF4, scalar (x: np.float32)."""
    if x > f("0.03979014977812767"):
        if x > f("0.3893125355243683"):
            if x > f("0.6427869200706482"):
                return 15 if x > f("0.8614784181118011") else 14
            return 13 if x > f("0.5016634166240692") else 12
        if x > f("0.2035212516784668"):
            return 11 if x > f("0.2920137718319893") else 10
        return 9 if x > f("0.1202552504837513") else 8
    if x > f("-0.33967943489551544"):
        if x > f("-0.13791173323988914"):
            return 7 if x > f("-0.045525018125772476") else 6
        return 5 if x > f("-0.23460740596055984") else 4
    if x > f("-0.6106329262256622"):
        return 3 if x > f("-0.4599952697753906") else 2
    return 1 if x > f("-0.8480964004993439") else 0


def q_fp4(x):
    """dQuantizeFP4, scalar."""
    sign = 8 if x < 0 else 0
    x = F32(abs(x))
    if x > f("0.29166667"):
        if x > f("0.583333"):
            return (3 if x > f("0.8333333") else 2) + sign
        return (5 if x > f("0.4166667") else 4) + sign
    if x > f("0.0859375"):
        return (7 if x > f("0.20833333") else 6) + sign
    return (1 if x > f("0.00260417") else 0) + sign


def quantize4(a, qt, bs=64):
    a = a.reshape(-1).astype(F32)
    n = a.size
    nb = (n + bs - 1) // bs
    absmax = np.zeros(nb, F32)
    codes = np.zeros(n + (n & 1), np.uint8)
    qf = q_nf4 if qt == "nf4" else q_fp4
    with np.errstate(divide="ignore", invalid="ignore"):
        for b in range(nb):
            blk = a[b * bs:(b + 1) * bs]
            m = F32(np.max(np.abs(blk)))
            absmax[b] = m
            r = F32(1.0) / m
            for j, v in enumerate(blk):
                codes[b * bs + j] = qf(F32(v * r))
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    return packed, absmax


def dequantize4(packed, absmax, n, qt, bs=64):
    codes = np.empty(packed.size * 2, np.uint8)
    codes[0::2] = packed >> 4
    codes[1::2] = packed & 15
    codes = codes[:n]
    if qt == "nf4":
        v = NF4[codes]
    else:
        v = (FP4_LUT[codes & 7] * np.where(codes & 8, F32(-1), F32(1))).astype(F32)
    return (v * np.repeat(absmax, bs)[:n]).astype(F32)


def dquantize(code, x):
    """dQuantize<0> (real kernel): binary search over the 256-entry code with midpoint ties."""
    pivot, upper_pivot, lower_pivot = 127, 255, 0
    lower, upper = F32(-1.0), F32(1.0)
    val = code[pivot]
    i = 64
    while i > 0:
        if x > val:
            lower_pivot, lower = pivot, val
            pivot += i
        else:
            upper_pivot, upper = pivot, val
            pivot -= i
        val = code[pivot]
        i >>= 1
    if upper_pivot == 255:
        upper = code[upper_pivot]
    if lower_pivot == 0:
        lower = code[lower_pivot]
    if x > val:
        mid = F32((upper + val) * F32(0.5))
        return upper_pivot if x > mid else pivot
    mid = F32((lower + val) * F32(0.5))
    return lower_pivot if x < mid else pivot


def quantize8(code, y, bs=256):
    n = y.size
    nb = (n + bs - 1) // bs
    scale = np.zeros(nb, F32)
    q = np.zeros(n, np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):
        for b in range(nb):
            blk = y[b * bs:(b + 1) * bs]
            m = F32(np.max(np.abs(blk)))
            scale[b] = m
            r = F32(1.0) / m
            for j, v in enumerate(blk):
                q[b * bs + j] = dquantize(code, F32(v * r))
    return q, scale


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/quant4-ref.safetensors")
    args = ap.parse_args()
    import bitsandbytes.functional as BF

    code8 = BF.create_dynamic_map(signed=True).numpy().astype(F32)
    assert np.array_equal(BF.get_4bit_type("nf4", device="cpu").numpy(), NF4)
    fp4_bnb = BF.get_4bit_type("fp4", device="cpu").numpy()
    fp4_ours = (FP4_LUT[np.arange(16) & 7] * np.where(np.arange(16) & 8, F32(-1), F32(1))).astype(F32)
    assert np.array_equal(fp4_bnb, fp4_ours), (fp4_bnb, fp4_ours)

    rng = np.random.default_rng(20240606)
    cases = {}
    # (rows, cols): odd sizes, a partial last block, an odd element count
    w1 = rng.standard_normal((37, 29)).astype(F32) * F32(0.05)   # 1073 elems: 16 full + 49
    w1.reshape(-1)[128:192] = 0.0                                  # an all-zero block (block 2)
    w1.reshape(-1)[5] = F32(0.05) * F32(3.9)                       # an outlier
    cases["a"] = w1
    w2 = rng.uniform(-1, 1, (64, 300)).astype(F32)                  # 19200 elems: 300 blocks, 2 dq blocks
    w2.reshape(-1)[640:704] = 0.0
    # exact code values and exact midpoints times a power-of-two absmax (tie rule)
    t = np.concatenate([NF4, (NF4[:-1] + NF4[1:]) / F32(2), fp4_ours, [F32(0.583333), F32(-0.0)]]).astype(F32)
    blk = np.zeros(64, F32)
    blk[:t.size] = t * F32(0.5)
    blk[t.size] = F32(0.5)          # absmax of block 16 is exactly 0.5 -> x * (1/absmax) is exact
    blk[t.size + 1:] = rng.uniform(-0.4, 0.4, 64 - t.size - 1).astype(F32)
    w2.reshape(-1)[1024:1088] = blk
    cases["b"] = w2
    w3 = rng.standard_normal((3, 7)).astype(F32)                    # 21 elements: one partial block
    cases["c"] = w3

    out = {"nf4_code": torch.from_numpy(NF4.copy()), "fp4_code": torch.from_numpy(fp4_ours),
           "dynamic_signed": torch.from_numpy(code8)}
    for name, w in cases.items():
        out[f"{name}.weight"] = torch.from_numpy(w.copy())
        n = w.size
        for qt in ("nf4", "fp4"):
            packed, absmax = quantize4(w, qt)
            deq = dequantize4(packed, absmax, n, qt)
            out[f"{name}.{qt}.packed"] = torch.from_numpy(packed)
            out[f"{name}.{qt}.absmax"] = torch.from_numpy(absmax)
            out[f"{name}.{qt}.deq"] = torch.from_numpy(deq.reshape(w.shape))
            # ---- bitsandbytes on CPU --------------------------------------------------
            bq, bst = BF.quantize_4bit(torch.from_numpy(w.copy()), blocksize=64, quant_type=qt)
            bq = bq.reshape(-1).numpy()
            bc = np.stack([bq >> 4, bq & 15], 1).reshape(-1)[:n]
            oc = np.stack([packed >> 4, packed & 15], 1).reshape(-1)[:n]
            diff = np.nonzero(bc != oc)[0]
            am_eq = np.array_equal(bst.absmax.numpy(), absmax)
            nz = int(np.sum((bc[diff] & 7) | (oc[diff] & 7)) if diff.size else 0)
            zb = int(np.sum(absmax[diff // 64] == 0)) if diff.size else 0
            print(f"   code diffs in all-zero blocks: {zb}; diffs that are not a +0/-0 FP4 code pair or a zero"
                  f" block: {0 if qt == 'fp4' and nz == 0 else diff.size - zb}")
            qs = BF.QuantState(absmax=torch.from_numpy(absmax), shape=torch.Size(w.shape), dtype=torch.float32,
                               blocksize=64, quant_type=qt)
            bdeq = BF.dequantize_4bit(torch.from_numpy(packed.reshape(-1, 1)), qs).numpy()
            print(f"{name} {qt}: n={n} bnb-cpu quantize_4bit: absmax equal={am_eq}, code diffs={diff.size}"
                  f" at {diff[:6].tolist()} (ours {oc[diff[:6]].tolist()} bnb {bc[diff[:6]].tolist()});"
                  f" bnb-cpu dequantize_4bit(our codes) == ours: {np.array_equal(bdeq.reshape(-1), deq)}")
            # ---- double quantization ---------------------------------------------------
            offset = F32(np.sum(absmax.astype(np.float64)) / absmax.size)
            y = (absmax - offset).astype(F32)
            qa, sc = quantize8(code8, y)
            deq_absmax = ((code8[qa] * np.repeat(sc, 256)[:absmax.size]).astype(F32) + offset).astype(F32)
            deq2 = dequantize4(packed, deq_absmax, n, qt)
            out[f"{name}.{qt}.offset"] = torch.tensor([offset])
            out[f"{name}.{qt}.q_absmax"] = torch.from_numpy(qa)
            out[f"{name}.{qt}.absmax_scale"] = torch.from_numpy(sc)
            out[f"{name}.{qt}.dq_absmax"] = torch.from_numpy(deq_absmax)
            out[f"{name}.{qt}.dq_deq"] = torch.from_numpy(deq2.reshape(w.shape))
            tq, tst = BF.quantize_4bit(torch.from_numpy(w.copy()), blocksize=64, quant_type=qt,
                                       compress_statistics=True)
            toff = F32(tst.offset.item())
            bqa, bsc = BF.quantize_blockwise(torch.from_numpy(y.copy()), blocksize=256)
            d8 = np.nonzero(bqa.numpy() != qa)[0]
            print(f"   dq: offset ours {offset!r} torch-mean {toff!r} (equal {offset == toff}); bnb-cpu "
                  f"quantize_blockwise(absmax-offset): scale equal {np.array_equal(bsc.absmax.numpy(), sc)},"
                  f" code diffs {d8.size}/{qa.size}")
            ddq = BF.dequantize_blockwise(torch.from_numpy(qa), absmax=torch.from_numpy(sc),
                                          code=torch.from_numpy(code8), blocksize=256).numpy() + offset
            print(f"   bnb-cpu dequantize_blockwise(our q) + offset == ours: {np.array_equal(ddq, deq_absmax)}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, args.out,
              metadata={"bitsandbytes": __import__("bitsandbytes").__version__, "torch": torch.__version__})
    print("wrote", args.out, os.path.getsize(args.out), "bytes")


if __name__ == "__main__":
    main()
