/* Private to kernels/attention.cu and kernels/attention_bwd.cu: the parameter block, tile
 * configurations and device helpers the attention kernels share (see attention.cu's header). */
#ifndef FL_CU_ATTN_COMMON_H
#define FL_CU_ATTN_COMMON_H

#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels_attn.h"

/* A read-only view of fp32 or bf16 elements (issue 30 item 1: the backward reads a bf16 run's stored q|k|v and
 * attention output in bf16, the widen-before-backward gone): x[i] is element i widened exactly (bf16: the fp32
 * view's value a widen launch would have written, so the same bits), x + n the view n elements on. From a
 * const float * implicitly (fp32). The type is uniform per launch: the branch does not diverge. */
struct fl_cu_fptr {
    const void *p;
    int b16;
    fl_cu_fptr() = default;
    __host__ __device__ fl_cu_fptr(const float *f) : p(f), b16(0) {}
    __host__ __device__ fl_cu_fptr(const void *x, int is16) : p(x), b16(is16) {}
    __device__ __forceinline__ float operator[](size_t i) const {
        return b16 ? fl_cu_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
    }
    __host__ __device__ fl_cu_fptr operator+(size_t n) const {
        return b16 ? fl_cu_fptr((const uint16_t *)p + n, 1) : fl_cu_fptr((const float *)p + n, 0);
    }
};

/* Everything a kernel needs, passed by value. Views as fl_attn_desc: row (b, t) of q at
 * q + (b*Tq + t)*ldq, head h at + h*HD (k, v, out, and the gradients likewise). q, k, v, out: fp32, or bf16 in
 * the backward of attention_backward16 (the same strides, in elements). */
struct fl_cu_attn_p {
    fl_cu_fptr q, k, v, out;
    const float *bias, *dout, *lse;
    const uint8_t *kmask;
    float *o, *l, *dq, *dk, *dv, *dbias, *Dsum; /* forward outputs; gradients; D scratch (B,NH,Tq) */
    uint16_t *o16; /* forward: NULL or the output's bf16 copy (out's layout), o then its widening (issue 30 item 1) */
    int *dq_lock; /* the fa2 backward's deterministic dq: one counter per (b, h, query tile), else NULL */
    int dbias_walk; /* the fa2 EX backward's dbias: 1, a block walks the batch (one owner, plain adds: deterministic);
                     * 0, a block per batch element adding by atomics (B times the blocks; bits may vary on a GPU) */
    /* the fa2 kernels' vector paths (attn_fa2.cu, fl_cu_fa_vec): vq: q, k, v aligned for them (16-byte rows, or a
     * padded head's chunks of 4; cp.async when bf16), else element pairs; vo: dout likewise (fp32); dq2: dq's element
     * pairs 8-byte aligned */
    int vq, vo, dq2;
    size_t ldq, ldk, ldv, ldo;
    int B, Tq, Tk, NH, NKV, HD, rep, causal;
    float scale;
    float drop_p, drop_sc; /* dropout on the weights (fl_attn_desc.drop_p; fp32 kernels only): p, 1 / (1 - p) */
    uint64_t drop_seed;
};

/* Tile shapes per head-dimension bucket D (HD <= D; dims HD..D-1 are zero in shared memory).
 * All kernels run 128 threads; a row (forward, dQ) or key (dK/dV) is owned by 8 consecutive
 * lanes, each holding every 8th key / dimension, so row reductions are 3 xor shuffles.
 *   forward / dQ: BQ query rows per block, RPT rows per thread (BQ/RPT*8 = 128), key tiles of BK;
 *   dK/dV: KBK keys per block, KRK keys per thread (KBK/KRK*8 = 128), query tiles of KBQ.
 * Shared memory (floats, rows padded to D+1: the row-major tiles serve both the q.k dot
 * products and the row updates without bank conflicts): at most ~75 KB (D = 128), under the
 * 99 KB an sm_86/89 block may opt in to. Measured on an H100 (B 2, NH 32, HD 64, T 1024/2048): a
 * 64-key forward tile, 128-row forward / dQ tiles, or 32- and 16-key dK/dV tiles (more blocks
 * for GQA) were all 1-50% slower than these. */
template <int D_> struct fl_cu_attn_cfg;
template <> struct fl_cu_attn_cfg<32> {
    enum { D = 32, BQ = 64, BK = 32, RPT = 4, QBQ = 64, QBK = 32, QRPT = 4, KBK = 64, KBQ = 32, KRK = 4 };
};
template <> struct fl_cu_attn_cfg<64> {
    enum { D = 64, BQ = 64, BK = 32, RPT = 4, QBQ = 64, QBK = 32, QRPT = 4, KBK = 64, KBQ = 32, KRK = 4 };
};
template <> struct fl_cu_attn_cfg<128> {
    enum { D = 128, BQ = 64, BK = 32, RPT = 4, QBQ = 32, QBK = 32, QRPT = 2, KBK = 32, KBQ = 32, KRK = 2 };
};
template <> struct fl_cu_attn_cfg<256> {
    enum { D = 256, BQ = 32, BK = 16, RPT = 2, QBQ = 16, QBK = 16, QRPT = 1, KBK = 16, KBQ = 16, KRK = 1 };
};
#define FL_CU_ATTN_THREADS 128

/* One past the last key query row t may see (causal: bottom-right aligned), in [0, Tk]. */
FL_CU_DEV int fl_cu_attn_key_limit(const fl_cu_attn_p &p, int t) {
    if (!p.causal) return p.Tk;
    long lim = (long)t + p.Tk - p.Tq + 1;
    return lim < 0 ? 0 : lim > p.Tk ? p.Tk : (int)lim;
}
/* Dropout on the attention weights: the factor of key j of query row t of head h, batch b (fitllm/lora.h's mask of
 * (drop_seed, ((b NH + h) Tq + t) Tk + j), the same integer arithmetic and float compare: the CPU's bits) */
FL_CU_DEV float fl_cu_attn_dropf(const fl_cu_attn_p &p, int b, int h, int t, int j) {
    const size_t i = (((size_t)b * p.NH + h) * p.Tq + t) * p.Tk + j;
    uint64_t z = p.drop_seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f) >= p.drop_p ? p.drop_sc : 0.0f;
}
/* First query row that sees key k (causal), in [0, Tq]. */
FL_CU_DEV int fl_cu_attn_first_row(const fl_cu_attn_p &p, int k) {
    if (!p.causal) return 0;
    long t = (long)k - (p.Tk - p.Tq);
    return t < 0 ? 0 : t > p.Tq ? p.Tq : (int)t;
}

/* dst (R, D+1) <- rows r0..r0+n-1 of a (rows, HD) view (row stride ld) times mul; rows >= n and
 * dims >= HD zero. Consecutive threads read consecutive dims (coalesced). A thread's loads go in groups of
 * FL_CU_ATTN_LOADS issued before the group's shared stores: a load followed at once by the store of its value
 * (the loop as first written) waits out one memory latency per element (the fa2 kernels' lesson,
 * docs/ARCHITECTURE.md "The tiles' loads"). The group loop stays rolled (unrolled, HD 128 / 256 spill). */
#define FL_CU_ATTN_LOADS 4 /* loads in flight per thread (8: HD-32 dq 208 registers against 128) */
template <int D, int R>
FL_CU_DEV void fl_cu_attn_load_tile(float *dst, fl_cu_fptr src, size_t ld, int n, int HD, float mul) {
    enum { IT = R * D / FL_CU_ATTN_THREADS, G = IT < FL_CU_ATTN_LOADS ? IT : FL_CU_ATTN_LOADS };
    static_assert(R * D % FL_CU_ATTN_THREADS == 0 && IT % G == 0, "whole steps of the block's threads");
    FL_CU_NO_UNROLL
    for (int g0 = 0; g0 < IT; g0 += G) {
        float x[G];
        FL_CU_UNROLL
        for (int j = 0; j < G; j++) {
            const int i = (g0 + j) * FL_CU_ATTN_THREADS + (int)threadIdx.x, r = i / D, d = i % D;
            x[j] = r < n && d < HD ? src[(size_t)r * ld + d] * mul : 0.0f;
        }
        FL_CU_UNROLL
        for (int j = 0; j < G; j++) {
            const int i = (g0 + j) * FL_CU_ATTN_THREADS + (int)threadIdx.x;
            dst[(i / D) * (D + 1) + i % D] = x[j];
        }
    }
}

/* Max / sum over the 8 lanes that own a row (all 8 get the same bits: xor butterfly). */
FL_CU_DEV float fl_cu_attn_max8(float v) {
    for (int o = 1; o < 8; o <<= 1) v = fmaxf(v, __shfl_xor_sync(FL_CU_FULL_MASK, v, o));
    return v;
}
FL_CU_DEV float fl_cu_attn_sum8(float v) {
    for (int o = 1; o < 8; o <<= 1) v += __shfl_xor_sync(FL_CU_FULL_MASK, v, o);
    return v;
}

/* D = dout . out, one warp per (b, h, t) row; rows of p.Dsum in (B, NH, Tq) order; launched with
 * (B*NH*Tq + 7) / 8 blocks of 256 threads. Shared by the fp32 and the tensor-core backward (a
 * template only so that a file that does not launch it has no unused function). */
template <int unused_> __global__ static void fl_cu_attn_dsum_k(fl_cu_attn_p p) {
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); // (b*NH + h)*Tq + t
    const size_t nrows = (size_t)p.B * p.NH * p.Tq;
    if (row >= nrows) return; /* the whole warp */
    const int t = (int)(row % p.Tq), h = (int)(row / p.Tq % p.NH);
    const size_t b = row / ((size_t)p.Tq * p.NH);
    const float *dO = p.dout + (b * p.Tq + t) * p.ldo + (size_t)h * p.HD;
    const fl_cu_fptr o = p.out + ((b * p.Tq + t) * p.ldo + (size_t)h * p.HD);
    float s = 0.0f;
    for (int d = lane; d < p.HD; d += 32) s += dO[d] * o[d];
    s = fl_cu_warp_sum(s);
    if (lane == 0) p.Dsum[row] = s;
}
static inline int fl_cu_attn_dsum_launch(const fl_cu_attn_p &p, void *stream) {
    const size_t nrows = (size_t)p.B * p.NH * p.Tq;
    FL_CU_LAUNCH(fl_cu_attn_dsum_k<0>, dim3((unsigned)((nrows + 7) / 8)), dim3(256), 0, (fl_cu_stream)stream, p);
    return fl_cu_launch_error();
}

/* Host-side argument checks shared by the launchers (0, or an FL_CU_ATTN_* code). */
static inline int fl_cu_attn_check(const fl_attn_desc *a, const void *out, const void *lse, const float *q,
                                   const float *k, const float *v, const float *bias, const float *dbias) {
    if (!a || !out || !lse || !q || !k || !v) return FL_CU_ATTN_INVALID;
    if (a->B < 0 || a->Tq < 0 || a->Tk < 0 || a->NH <= 0 || a->NKV <= 0 || a->HD <= 0 || a->NH % a->NKV)
        return FL_CU_ATTN_INVALID;
    if (a->HD > FL_CU_ATTN_MAX_HD) return FL_CU_ATTN_UNSUPPORTED;
    size_t wq = (size_t)a->NH * a->HD, wk = (size_t)a->NKV * a->HD;
    if (a->ldq < wq || a->ldo < wq || a->ldk < wk || a->ldv < wk) return FL_CU_ATTN_INVALID;
    if (dbias && !bias) return FL_CU_ATTN_INVALID;
    if (!(a->scale == a->scale) || a->scale - a->scale != 0.0f) return FL_CU_ATTN_INVALID; /* NaN or inf */
    if (!(a->drop_p >= 0.0f && a->drop_p < 1.0f)) return FL_CU_ATTN_INVALID;
    if (a->B > 65535 || a->NH > 65535) return FL_CU_ATTN_INVALID;                          /* grid y / z */
    return 0;
}

static inline fl_cu_attn_p fl_cu_attn_params(const fl_attn_desc *a) {
    fl_cu_attn_p p;
    memset(&p, 0, sizeof p);
    p.ldq = a->ldq;
    p.ldk = a->ldk;
    p.ldv = a->ldv;
    p.ldo = a->ldo;
    p.B = a->B;
    p.Tq = a->Tq;
    p.Tk = a->Tk;
    p.NH = a->NH;
    p.NKV = a->NKV;
    p.HD = a->HD;
    p.rep = a->NH / a->NKV;
    p.causal = a->causal != 0;
    p.scale = a->scale;
    p.drop_p = a->drop_p;
    p.drop_sc = a->drop_p > 0.0f ? 1.0f / (1.0f - a->drop_p) : 1.0f;
    p.drop_seed = a->drop_seed;
    return p;
}

/* the shapes a launcher's kernels take: tc 0, the fp32 kernels (every one the checks pass); 1, the tensor-core ones
 * (fl_cu_attention_tc_supported); 2, the fa2 ones (fl_cu_attention_fa2_supported) */
static inline int fl_cu_attn_takes(int tc, const fl_attn_desc *a, const float *bias) {
    return !tc || (tc == 2 ? fl_cu_attention_fa2_supported(a, bias) : fl_cu_attention_tc_supported(a, bias));
}

/* The launchers' shared prologue (attention.cu, attention_bwd.cu, attention_tc.cu, attn_fa2.cu): the
 * argument checks in their one order and the parameter block. tc: the tensor-core kernels' shapes
 * only (fl_cu_attn_takes). Returns 0 (*p ready), 1 (nothing to run: B or Tq is 0), or
 * an FL_CU_ATTN_* code. */
/* in16: q, k, v bf16 (attention_forward_*16; no bias then), else fp32 */
static inline int fl_cu_attn_fwd_setup(fl_cu_attn_p *p, const fl_attn_desc *a, float *out, void *out16, float *lse,
                                       const void *q, const void *k, const void *v, const float *bias,
                                       const uint8_t *kmask, int tc, int in16 = 0) {
    /* out NULL: the bf16 copy only (an fp32 view nothing reads; issue 30 item 1) */
    int rc = fl_cu_attn_check(a, out ? (const void *)out : out16, lse, (const float *)q, (const float *)k,
                              (const float *)v, bias, NULL);
    if (rc) return rc;
    if (in16 && bias) return FL_CU_ATTN_INVALID;
    if (!fl_cu_attn_takes(tc, a, bias)) return FL_CU_ATTN_UNSUPPORTED;
    if (a->B == 0 || a->Tq == 0) return 1;
    *p = fl_cu_attn_params(a);
    p->q = fl_cu_fptr(q, in16), p->k = fl_cu_fptr(k, in16), p->v = fl_cu_fptr(v, in16);
    p->bias = bias, p->kmask = kmask, p->o = out, p->l = lse;
    p->o16 = (uint16_t *)out16;
    return 0;
}
/* in16: q, k, v and out are bf16 (attention_backward16), else fp32 */
static inline int fl_cu_attn_bwd_setup(fl_cu_attn_p *p, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                       float *dbias, const float *dout, const void *q, const void *k, const void *v,
                                       const float *bias, const uint8_t *kmask, const void *out, const float *lse,
                                       void *work, int tc, int in16) {
    int rc = fl_cu_attn_check(a, out, lse, (const float *)q, (const float *)k, (const float *)v, bias, dbias);
    if (rc) return rc;
    if (!dq || !dk || !dv || !dout) return FL_CU_ATTN_INVALID;
    if (!fl_cu_attn_takes(tc, a, bias)) return FL_CU_ATTN_UNSUPPORTED;
    if (a->B == 0 || a->Tq == 0) return 1;
    if (!work) return FL_CU_ATTN_INVALID;
    *p = fl_cu_attn_params(a);
    p->q = fl_cu_fptr(q, in16), p->k = fl_cu_fptr(k, in16), p->v = fl_cu_fptr(v, in16), p->out = fl_cu_fptr(out, in16);
    p->bias = bias, p->kmask = kmask, p->dout = dout, p->lse = lse;
    p->dq = dq, p->dk = dk, p->dv = dv, p->dbias = dbias, p->Dsum = (float *)work;
    return 0;
}

/* Head-dimension bucket: the smallest of 32, 64, 128, 256 that holds HD. */
static inline int fl_cu_attn_bucket(int HD) { return HD <= 32 ? 32 : HD <= 64 ? 64 : HD <= 128 ? 128 : 256; }
#endif
