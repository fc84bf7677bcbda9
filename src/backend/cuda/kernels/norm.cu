/* RMSNorm forward and backward (LLaMA), semantics of backend.h's rmsnorm_forward/backward.
 *
 * Forward and the input gradient: one block per row, the row's sum of squares (resp. the dot
 * product of backward) by a block reduction (warp shuffles, then one value per warp through
 * shared memory). The weight (and LayerNorm's bias, and the linears' bias) gradient is a sum over
 * rows, colsum below: per-tile partial sums into the caller's work, then a fixed-order sum of the
 * tiles (deterministic without atomics; the order a function of the shape). Rows with C % 4 == 0 and
 * aligned pointers are read and written 4 floats per 128-bit access (issue 30 item 4). Sums in float:
 * a row of a few thousand values loses ~1e-6 relative, inside the op tests' 1e-5. */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

/* Threads per row block: a multiple of 32 covering C, at most 256. */
static unsigned row_threads(int C) {
    unsigned t = ((unsigned)C + 31u) & ~31u;
    return t > 256u ? 256u : (t ? t : 32u);
}

/* The norm weight's element c, w of wt in {F32, BF16, F16}: a 16-bit weight (bf16/fp16 storage) widened
 * exactly in the kernel, the bits of widening the row first (the convert launch per norm per pass it replaces) */
FL_CU_DEV float nw(const void *w, int wt, int c) {
    if (wt == (int)FL_BF16) return fl_cu_bf16_to_f32(((const uint16_t *)w)[c]);
    if (wt == (int)FL_F16) return fl_cu_f16_to_f32(((const uint16_t *)w)[c]);
    return ((const float *)w)[c];
}
/* element i on of a row of type t (F32 or 16-bit) */
FL_CU_DEV const void *row_at(const void *p, int t, size_t i) {
    return t == (int)FL_F32 ? (const void *)((const float *)p + i) : (const void *)((const uint16_t *)p + i);
}
/* four of them from c (fp32: one 128-bit load, the caller checked the alignment; 16-bit: one 64-bit load where the
 * address allows, else four; the same values) */
FL_CU_DEV void nw4(const void *w, int wt, int c, float *g) {
    if (wt == (int)FL_F32) {
        fl_cu_ld4((const float *)w + c, g);
    } else if (((uintptr_t)((const uint16_t *)w + c) & 7u) == 0) {
        uint16_t h[4];
        fl_cu_ld4h((const uint16_t *)w + c, h);
        for (int k = 0; k < 4; k++) g[k] = wt == (int)FL_BF16 ? fl_cu_bf16_to_f32(h[k]) : fl_cu_f16_to_f32(h[k]);
    } else {
        for (int k = 0; k < 4; k++) g[k] = nw(w, wt, c + k);
    }
}


/* o = x * r * w over a row (the calling thread's columns; vec: 4 at a time, 128-bit accesses to o); x of type xt (F32:
 * 128-bit loads under vec; BF16: a bf16-stored row read as it is, its exact widening: the fused add + norm's second
 * pass); o16: the row's bf16 copy too (NULL: none); o NULL: o16 only (the fp32 view not kept) */
FL_CU_DEV void rms_scale_row(float *o, uint16_t *o16, const void *x, int xt, const void *w, int wt, float r, int C,
                             int vec) {
    if (vec) {
        for (int c = 4 * (int)threadIdx.x; c < C; c += 4 * (int)blockDim.x) {
            float v[4], g[4];
            nw4(x, xt, c, v);
            nw4(w, wt, c, g);
            for (int k = 0; k < 4; k++) v[k] = v[k] * r * g[k];
            fl_cu_keep16x4(o16, (size_t)c, v);
            if (o) fl_cu_st4(o + c, v);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float v = fl_cu_keep16(o16, (size_t)c, nw(x, xt, c) * r * nw(w, wt, c));
            if (o) o[c] = v;
        }
    }
}
/* the sum of squares over 4 values, in order (the vec paths of both forward kernels: one order, one set of bits) */
FL_CU_DEV float sumsq4(float ss, const float *v) {
    for (int k = 0; k < 4; k++) ss += v[k] * v[k];
    return ss;
}
/* the row's 1 / rms from the threads' partial sums of squares (a block reduction; every thread gets it) */
FL_CU_DEV float rms_rstd(float ss, float *buf, int C, float eps) {
    ss = fl_cu_block_sum(ss, buf);
    return 1.0f / sqrtf(ss / (float)C + eps); /* not rsqrtf: approximate on the GPU */
}

/* vec (C % 4 == 0, the pointers 16-byte aligned): 4 consecutive columns per thread and 128-bit accesses */
__global__ static void fl_cu_rmsnorm_fwd_k(float *out, uint16_t *out16, float *rstd, const float *inp, const void *w,
                                           int wt, int C, float eps, int vec) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    const float *x = inp + row * C;
    float *o = out ? out + row * C : NULL; /* NULL: the bf16 copy only (rmsnorm_forward_w16) */
    float ss = 0.0f;
    if (vec) {
        for (int c = 4 * (int)threadIdx.x; c < C; c += 4 * (int)blockDim.x) {
            float v[4];
            fl_cu_ld4(x + c, v);
            ss = sumsq4(ss, v);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) ss += x[c] * x[c];
    }
    const float r = rms_rstd(ss, buf, C, eps);
    rms_scale_row(o, out16 ? out16 + row * C : NULL, x, (int)FL_F32, w, wt, r, C, vec);
    if (threadIdx.x == 0 && rstd) rstd[row] = r;
}

/* The residual add fused with the next RMSNorm (add_rmsnorm_forward): res = a + b, out = res * r * w, one
 * pass over the row with the sum of squares, then the row again from res (each thread reads back what it
 * wrote: no barrier needed besides the reduction's; res may alias a or b, each element being read before
 * it is written by the same thread). vec: C % 4 == 0 and every pointer 16-byte aligned, 4 elements per
 * 128-bit access. */
__global__ static void fl_cu_add_rmsnorm_fwd_k(float *res, float *out, float *rstd, const float *a, const float *b,
                                               const float *w, int C, float eps, int vec) {
    __shared__ float buf[32];
    const size_t row = blockIdx.x;
    const float *pa = a + row * C, *pb = b + row * C;
    float *pr = res + row * C, *po = out + row * C;
    float ss = 0.0f;
    if (vec) {
        for (int c = 4 * (int)threadIdx.x; c < C; c += 4 * (int)blockDim.x) {
            float x[4], y[4];
            fl_cu_ld4(pa + c, x);
            fl_cu_ld4(pb + c, y);
            for (int k = 0; k < 4; k++) {
                x[k] += y[k];
                ss += x[k] * x[k];
            }
            fl_cu_st4(pr + c, x);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float v = pa[c] + pb[c];
            pr[c] = v;
            ss += v * v;
        }
    }
    ss = fl_cu_block_sum(ss, buf);
    const float r = 1.0f / sqrtf(ss / (float)C + eps);
    rms_scale_row(po, NULL, pr, (int)FL_F32, w, (int)FL_F32, r, C, vec);
    if (threadIdx.x == 0 && rstd) rstd[row] = r;
}

/* The residual add fused with the next norm under a bf16 store (add_norm_forward16, issue 30 item 4): add16's element
 * (the sum rounded to bf16 in res16, res (NULL or) its exact widening) returned widened: the value the norm reads */
FL_CU_DEV float add_keep16(float *res, uint16_t *res16, size_t c, float a, float b) {
    const float v = fl_cu_keep16(res16, c, a + b);
    if (res) res[c] = v;
    return v;
}
/* RMSNorm: one block per row, the threads' columns and sum order those of fl_cu_rmsnorm_fwd_k over the widened sum
 * (vec: its 4-wide mapping, chosen by the same test of out, res and an fp32 w; the a / b / res accesses 128-bit when
 * v4 says they are aligned too, else element by element: the same values), then rms_scale_row over res16 (each
 * thread reads back what it wrote). res may alias a or b (each element read before the same thread writes it). */
/* b of type bt: F32, or BF16 (add_norm_forward16_b16: the residual operand read as stored, its exact widening: the
 * bits of the fp32 view that holds it; 4 elements one 64-bit load under v4) */
__global__ static void fl_cu_add_rmsnorm16_k(float *res, uint16_t *res16, float *out, uint16_t *out16, float *rstd,
                                             const float *a, const void *b, int bt, const void *w, int wt, int C,
                                             float eps, int vec, int v4) {
    __shared__ float buf[32];
    const size_t row = blockIdx.x;
    const float *pa = a ? a + row * C : NULL; /* NULL: no add, b16 holds the sum already (res16 == b16, gemm_res16) */
    const void *pb = row_at(b, bt, row * C);
    float *pr = res ? res + row * C : NULL;
    uint16_t *r16 = res16 + row * C;
    float ss = 0.0f;
    if (vec) {
        for (int c = 4 * (int)threadIdx.x; c < C; c += 4 * (int)blockDim.x) {
            float x[4], y[4];
            if (!pa) { /* the stored sum as it is (exact in fp32: rounding it again is the identity, not written) */
                nw4(pb, bt, c, x);
                if (pr) fl_cu_st4(pr + c, x);
            } else if (v4) {
                fl_cu_ld4(pa + c, x);
                nw4(pb, bt, c, y);
                for (int k = 0; k < 4; k++) x[k] = x[k] + y[k];
                fl_cu_keep16x4(r16, (size_t)c, x);
                if (pr) fl_cu_st4(pr + c, x);
            } else {
                for (int k = 0; k < 4; k++) x[k] = add_keep16(pr, r16, (size_t)c + k, pa[c + k], nw(pb, bt, c + k));
            }
            ss = sumsq4(ss, x);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float v = pa ? add_keep16(pr, r16, (size_t)c, pa[c], nw(pb, bt, c)) : nw(pb, bt, c);
            if (!pa && pr) pr[c] = v;
            ss += v * v;
        }
    }
    const float r = rms_rstd(ss, buf, C, eps);
    rms_scale_row(out ? out + row * C : NULL, out16 + row * C, r16, (int)FL_BF16, w, wt, r, C, vec);
    if (threadIdx.x == 0 && rstd) rstd[row] = r;
}

/* dx += r * (dy*w - x*r * mean(dy*w * x*r)); dx16 (NULL or): bf16(dx) after the add, dx itself not rounded (the
 * residual gradient a norm backward finishes is the next LINEAR's dy: its bf16 operand without a convert) */
FL_CU_DEV void keep16_only(uint16_t *o16, size_t i, float v) {
    if (o16) o16[i] = fl_cu_f32_to_bf16(v);
}
/* the input inp of type xt: F32, or BF16 (a bf16 run's stored row read as it is: its exact widening, the bits
 * of widening it first) */
__global__ static void fl_cu_rmsnorm_bwd_dx_k(float *dinp, uint16_t *dinp16, const float *dout, const void *inp,
                                              int xt, const void *w, int wt, const float *rstd, int C, int vec) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    const void *x = row_at(inp, xt, row * C);
    const float *dy = dout + row * C;
    float *dx = dinp + row * C;
    uint16_t *dx16 = dinp16 ? dinp16 + row * C : NULL;
    float r = rstd[row], dot = 0.0f;
    if (vec) {
        for (int c = 4 * (int)threadIdx.x; c < C; c += 4 * (int)blockDim.x) {
            float xv[4], dv[4], g[4];
            nw4(x, xt, c, xv);
            fl_cu_ld4(dy + c, dv);
            nw4(w, wt, c, g);
            for (int k = 0; k < 4; k++) dot += (dv[k] * g[k]) * (xv[k] * r);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) dot += (dy[c] * nw(w, wt, c)) * (nw(x, xt, c) * r);
    }
    float mdot = fl_cu_block_sum(dot, buf) / (float)C;
    if (vec) {
        for (int c = 4 * (int)threadIdx.x; c < C; c += 4 * (int)blockDim.x) {
            float xv[4], dv[4], g[4], o[4];
            nw4(x, xt, c, xv);
            fl_cu_ld4(dy + c, dv);
            nw4(w, wt, c, g);
            fl_cu_ld4(dx + c, o);
            for (int k = 0; k < 4; k++) {
                o[k] += r * (dv[k] * g[k] - xv[k] * r * mdot);
                keep16_only(dx16, (size_t)c + k, o[k]);
            }
            fl_cu_st4(dx + c, o);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            dx[c] += r * (dy[c] * nw(w, wt, c) - nw(x, xt, c) * r * mdot);
            keep16_only(dx16, (size_t)c, dx[c]);
        }
    }
}

/* Column sums over N rows of C: dw[c] += sum_n dy[n,c] * xhat[n,c], db[c] += sum_n dy[n,c], with
 * xhat = x * rstd[n] (RMSNorm: mean NULL) or (x - mean[n]) * rstd[n] (LayerNorm). dw / db may be NULL.
 * Two launches, deterministic without atomics (the 2026-11-30 18:00 wave; the one-launch version ran C / 16 blocks,
 * each walking all N rows with four 4-byte loads in flight per thread: latency-bound, TinyLlama's rmsnorm_backward_w16
 * (dx and dw) took 152 us per call on an H200):
 *   1. fl_cu_colsum_part_k, grid (ceil(C / 128), P): block (x, p) sums the 128 columns [128 x, 128 x + 128) over the
 *      row tile [p R, min(N, (p + 1) R)), R = ceil(N / P); 8 warps, warp w takes the tile's rows w, w + 8, ... in
 *      order, lane l its 4 columns 128 x + 4 l.. (one 128-bit dout load, one 64-bit bf16 / 128-bit fp32 x load per
 *      row where C % 4 == 0 and the rows are aligned, else the same 4 elements one by one: the same sums), four rows'
 *      loads in flight; then thread j < 128 adds the 8 warps' sums of its column in warp order and writes the
 *      tile's partial to work (P x C floats for dw, then P x C for db), or adds it to dw / db when P = 1;
 *   2. fl_cu_colsum_fin_k, 32 columns x 8 slices per block: slice q sums the tiles q, q + 8, ... in order, then
 *      the 8 slice sums in slice order, added to dw / db.
 * P = ceil(N / 128) within [1, min(256, FL_CU_NORM_WORK_BYTES / (8 C))]: a function of (N, C) alone, so the order of
 * every sum (and the bits) is the same on every device; for N 8192, C 2048: P 64, 1024 blocks of 256 threads. */
#define FL_CU_CS_COLS 128
#define FL_CU_CS_WARPS 8
#define FL_CU_CS_ROWS 128 /* rows per tile aimed at */
FL_CU_DEV float cs_xhat(float x, const float *mean, const float *rstd, int n) {
    return mean ? (x - mean[n]) * rstd[n] : x * rstd[n];
}
/* row n's 4 columns from c of dout (d) and the input (x; xt F32 or BF16, not read when !x): vec one wide load each */
FL_CU_DEV void cs_load(const float *dout, const void *inp, int xt, size_t n, int c, int C, int vec, float *d,
                       float *x) {
    const size_t i = n * (size_t)C + (size_t)c;
    if (vec) {
        fl_cu_ld4(dout + i, d);
        if (inp) nw4(row_at(inp, xt, i), xt, 0, x);
        return;
    }
    for (int k = 0; k < 4; k++) {
        const int in = c + k < C;
        d[k] = in ? dout[i + k] : 0.0f;
        x[k] = in && inp ? nw(row_at(inp, xt, i), xt, k) : 0.0f;
    }
}
/* inp of type xt (F32 or BF16, as the dx kernel's; NULL: no dw); d16 (NULL or): each dout element read is also
 * stored there in bf16 (bias_backward16: a linear's bf16 dy) */
__global__ static void fl_cu_colsum_part_k(float *pw, float *pb, float *dw, float *db, const float *dout,
                                           const void *inp, int xt, const float *mean, const float *rstd, int N,
                                           int C, int R, uint16_t *d16, int vec) {
    __shared__ float sw[FL_CU_CS_WARPS * FL_CU_CS_COLS], sb[FL_CU_CS_WARPS * FL_CU_CS_COLS];
    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    const int c = (int)blockIdx.x * FL_CU_CS_COLS + 4 * lane, p = (int)blockIdx.y;
    const int r1 = (p + 1) * R < N ? (p + 1) * R : N;
    float aw[4] = {0.0f, 0.0f, 0.0f, 0.0f}, ab[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (c < C) {
        for (int n = p * R + warp; n < r1; n += 4 * FL_CU_CS_WARPS) { /* four rows' loads in flight; in row order */
            float d[4][4], x[4][4];
FL_CU_UNROLL
            for (int j = 0; j < 4; j++) /* constant trip counts: the arrays stay in registers */
                if (n + j * FL_CU_CS_WARPS < r1)
                    cs_load(dout, dw ? inp : NULL, xt, (size_t)(n + j * FL_CU_CS_WARPS), c, C, vec, d[j], x[j]);
FL_CU_UNROLL
            for (int j = 0; j < 4; j++) {
                const int nj = n + j * FL_CU_CS_WARPS;
                if (nj >= r1) break;
                if (d16) {
                    float t[4] = {d[j][0], d[j][1], d[j][2], d[j][3]};
                    if (vec) {
                        fl_cu_keep16x4(d16, (size_t)nj * C + c, t);
                    } else {
                        for (int k = 0; k < 4 && c + k < C; k++) d16[(size_t)nj * C + c + k] = fl_cu_f32_to_bf16(t[k]);
                    }
                }
FL_CU_UNROLL
                for (int k = 0; k < 4; k++) {
                    if (dw) aw[k] += d[j][k] * cs_xhat(x[j][k], mean, rstd, nj);
                    ab[k] += d[j][k];
                }
            }
        }
    }
    for (int k = 0; k < 4; k++) {
        sw[warp * FL_CU_CS_COLS + 4 * lane + k] = aw[k];
        sb[warp * FL_CU_CS_COLS + 4 * lane + k] = ab[k];
    }
    __syncthreads();
    const int j = (int)threadIdx.x, cj = (int)blockIdx.x * FL_CU_CS_COLS + j;
    if (j < FL_CU_CS_COLS && cj < C) {
        float tw = 0.0f, tb = 0.0f;
        for (int w = 0; w < FL_CU_CS_WARPS; w++) {
            tw += sw[w * FL_CU_CS_COLS + j];
            tb += sb[w * FL_CU_CS_COLS + j];
        }
        if (gridDim.y == 1) { /* one tile: the column's sum */
            if (dw) dw[cj] += tw;
            if (db) db[cj] += tb;
        } else {
            if (dw) pw[(size_t)p * C + cj] = tw;
            if (db) pb[(size_t)p * C + cj] = tb;
        }
    }
}
/* block: 32 columns x 8 slices; slice q sums the partials q, q + 8, ... in order, then slice 0 adds the 8 slice sums
 * in slice order (16 K threads for C 2048, 8 loads each: the partials, just written, come from the L2) */
#define FL_CU_CS_SLICES 8
__global__ static void fl_cu_colsum_fin_k(float *dw, float *db, const float *pw, const float *pb, int P, int C) {
    __shared__ float sw[FL_CU_CS_SLICES * 32], sb[FL_CU_CS_SLICES * 32];
    const int lc = (int)threadIdx.x & 31, q = (int)threadIdx.x >> 5, c = (int)blockIdx.x * 32 + lc;
    float tw = 0.0f, tb = 0.0f;
    if (c < C)
        for (int p = q; p < P; p += FL_CU_CS_SLICES) {
            if (dw) tw += pw[(size_t)p * C + c];
            if (db) tb += pb[(size_t)p * C + c];
        }
    sw[threadIdx.x] = tw;
    sb[threadIdx.x] = tb;
    __syncthreads();
    if (q != 0 || c >= C) return;
    tw = tb = 0.0f;
    for (int k = 0; k < FL_CU_CS_SLICES; k++) tw += sw[k * 32 + lc], tb += sb[k * 32 + lc];
    if (dw) dw[c] += tw;
    if (db) db[c] += tb;
}
/* The row tiles of an (N, C) column sum (see above) */
static int colsum_tiles(int N, int C) {
    const size_t cap = FL_CU_NORM_WORK_BYTES / (2 * sizeof(float) * (size_t)C);
    int P = (N + FL_CU_CS_ROWS - 1) / FL_CU_CS_ROWS;
    const int pmax = cap < 1 ? 1 : cap > 256 ? 256 : (int)cap;
    return P < 1 ? 1 : P > pmax ? pmax : P;
}
/* the launches; work: FL_CU_NORM_WORK_BYTES of device memory (NULL only where one tile does: -1 otherwise) */
static int colsum(float *dw, float *db, const float *dout, const void *inp, fl_dtype xt, const float *mean,
                   const float *rstd, int N, int C, uint16_t *d16, void *work, void *stream) {
    const int P = colsum_tiles(N, C);
    if (P > 1 && !work) return -1;
    const int R = (N + P - 1) / P;
    const int vec = C % 4 == 0 && fl_cu_aligned16(dout, xt == FL_F32 ? inp : NULL, NULL, NULL, NULL);
    float *pw = (float *)work, *pb = pw ? pw + (size_t)P * C : NULL;
    FL_CU_LAUNCH(fl_cu_colsum_part_k, dim3((unsigned)((C + FL_CU_CS_COLS - 1) / FL_CU_CS_COLS), (unsigned)P),
                 dim3(32 * FL_CU_CS_WARPS), 0, (fl_cu_stream)stream, pw, pb, dw, db, dout, inp, (int)xt, mean, rstd, N,
                 C, R, d16, vec);
    if (P > 1)
        FL_CU_LAUNCH(fl_cu_colsum_fin_k, dim3((unsigned)((C + 31) / 32)), dim3(32 * FL_CU_CS_SLICES), 0,
                     (fl_cu_stream)stream, dw, db, (const float *)pw, (const float *)pb, P, C);
    return 0;
}

/* wt F32 (rmsnorm_forward) or BF16/F16 (rmsnorm_forward_w16, out16 NULL or the bf16 copy) */
static int rmsnorm_fwd(float *out, void *out16, float *rstd, const float *inp, const void *w, fl_dtype wt, int N, int C,
                       float eps, void *stream) {
    if (N <= 0 || C <= 0) return 0;
#if FL_CU_EMULATED
    fl_cu_emu_norm_add_launches++;
#endif
    const int vec = C % 4 == 0 && fl_cu_aligned16(out, inp, wt == FL_F32 ? w : NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_rmsnorm_fwd_k, dim3((unsigned)N), dim3(row_threads(vec ? C / 4 : C)), 0, (fl_cu_stream)stream,
                 out, (uint16_t *)out16, rstd, inp, w, (int)wt, C, eps, vec);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(rmsnorm_forward)(float *out, float *rstd, const float *inp, const float *w, int N, int C,
                                       float eps, void *stream) {
    return rmsnorm_fwd(out, NULL, rstd, inp, w, FL_F32, N, C, eps, stream);
}
extern "C" int FL_CUK(rmsnorm_forward_w16)(float *out, void *out16, float *rstd, const float *inp, const void *w,
                                           fl_dtype wt, int N, int C, float eps, void *stream) {
    if (wt != FL_BF16 && wt != FL_F16 && !(wt == FL_F32 && out16)) return -1; /* fp32: with the bf16 copy only */
    if (!out && !out16) return -1; /* out NULL: the bf16 copy only */
    return rmsnorm_fwd(out, out16, rstd, inp, w, wt, N, C, eps, stream);
}

extern "C" int FL_CUK(add_rmsnorm_forward)(float *res, float *out, float *rstd, const float *a, const float *b,
                                           const float *w, int N, int C, float eps, void *stream) {
    if (N <= 0 || C <= 0) return 0;
#if FL_CU_EMULATED
    fl_cu_emu_norm_add_launches++;
#endif
    const int vec = C % 4 == 0 && fl_cu_aligned16(res, out, a, b, w);
    FL_CU_LAUNCH(fl_cu_add_rmsnorm_fwd_k, dim3((unsigned)N), dim3(row_threads(vec ? C / 4 : C)), 0,
                 (fl_cu_stream)stream, res, out, rstd, a, b, w, C, eps, vec);
    return fl_cu_launch_error();
}

/* inp of xt F32 or BF16 */
static int rmsnorm_bwd(float *dinp, void *dinp16, float *dw, const float *dout, const void *inp, fl_dtype xt,
                       const void *w, fl_dtype wt, const float *rstd, int N, int C, void *work, void *stream) {
    if (N <= 0 || C <= 0) return 0;
    if (dw && colsum_tiles(N, C) > 1 && !work) return -1;
    const int vec =
        C % 4 == 0 && fl_cu_aligned16(dinp, dout, xt == FL_F32 ? inp : NULL, wt == FL_F32 ? w : NULL, NULL);
    if (dinp)
        FL_CU_LAUNCH(fl_cu_rmsnorm_bwd_dx_k, dim3((unsigned)N), dim3(row_threads(vec ? C / 4 : C)), 0,
                     (fl_cu_stream)stream, dinp, (uint16_t *)dinp16, dout, inp, (int)xt, w, (int)wt, rstd, C, vec);
    if (dw) colsum(dw, NULL, dout, inp, xt, NULL, rstd, N, C, NULL, work, stream);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(rmsnorm_backward)(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                        const float *rstd, int N, int C, void *work, void *stream) {
    return rmsnorm_bwd(dinp, NULL, dw, dout, inp, FL_F32, w, FL_F32, rstd, N, C, work, stream);
}
/* inp16 (NULL or the input's bf16 copy): read instead of inp; wt: F32 only with inp16 or dinp16 (a bf16-mixed run's
 * fp32 norm weight over its bf16-stored input, or writing the next LINEAR's bf16 dy) */
extern "C" int FL_CUK(rmsnorm_backward_w16)(float *dinp, void *dinp16, float *dw, const float *dout, const float *inp,
                                            const void *inp16, const void *w, fl_dtype wt, const float *rstd, int N,
                                            int C, void *work, void *stream) {
    if (wt != FL_BF16 && wt != FL_F16 && !(wt == FL_F32 && (inp16 || dinp16))) return -1;
    return rmsnorm_bwd(dinp, dinp16, dw, dout, inp16 ? inp16 : inp, inp16 ? FL_BF16 : FL_F32, w, wt, rstd, N, C,
                       work, stream);
}

/* ---- LayerNorm (GPT-2, OPT): two block sums per row (mean, then the two-pass variance) ------------- */

/* w and b (NULL or) of wt (F32, or BF16/F16 storage widened exactly: the bits of widening them first); o16 (NULL
 * or) the output's bf16 copy, out then its exact widening (round16's bits) */
/* A LayerNorm row after its mean m: the two-pass variance, then o = (x - m) r w + b; x of type xt (F32, or BF16: the
 * fused add's stored sum read as it is, its exact widening); o NULL: o16 only. Returns r. */
FL_CU_DEV float ln_finish_row(float *o, uint16_t *o16, const void *x, int xt, float m, const void *w, const void *b,
                              int wt, int C, float eps, float *buf) {
    float v = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float xc = nw(x, xt, c);
        v += (xc - m) * (xc - m);
    }
    const float r = 1.0f / sqrtf(fl_cu_block_sum(v, buf) / (float)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float y = fl_cu_keep16(o16, (size_t)c, (nw(x, xt, c) - m) * r * nw(w, wt, c) + (b ? nw(b, wt, c) : 0.0f));
        if (o) o[c] = y;
    }
    return r;
}
__global__ static void fl_cu_layernorm_fwd_k(float *out, uint16_t *out16, float *mean, float *rstd, const float *inp,
                                             const void *w, const void *b, int wt, int C, float eps) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    const float *x = inp + row * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += x[c];
    float m = fl_cu_block_sum(s, buf) / (float)C;
    /* out NULL: the bf16 copy only */
    float r = ln_finish_row(out ? out + row * C : NULL, out16 ? out16 + row * C : NULL, x, (int)FL_F32, m, w, b, wt, C,
                            eps, buf);
    if (threadIdx.x == 0) {
        if (mean) mean[row] = m;
        if (rstd) rstd[row] = r;
    }
}
/* LayerNorm (add_norm_forward16): the sum of fl_cu_add_rmsnorm16_k's element path (LayerNorm's forward has one
 * mapping, one element per thread per step: its order), the mean over it, then ln_finish_row over res16 */
__global__ static void fl_cu_add_layernorm16_k(float *res, uint16_t *res16, float *out, uint16_t *out16, float *mean,
                                               float *rstd, const float *a, const void *b, int bt,
                                               const void *w, const void *bias, int wt, int C, float eps) {
    __shared__ float buf[32];
    const size_t row = blockIdx.x;
    const float *pa = a + row * C;
    const void *pb = row_at(b, bt, row * C);
    float *pr = res ? res + row * C : NULL;
    uint16_t *r16 = res16 + row * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += add_keep16(pr, r16, (size_t)c, pa[c], nw(pb, bt, c));
    const float m = fl_cu_block_sum(s, buf) / (float)C;
    const float r = ln_finish_row(out ? out + row * C : NULL, out16 + row * C, r16, (int)FL_BF16, m, w, bias, wt, C,
                                  eps, buf);
    if (threadIdx.x == 0) {
        if (mean) mean[row] = m;
        if (rstd) rstd[row] = r;
    }
}

/* dx += r * (dy*w - mean(dy*w) - xhat * mean(dy*w * xhat)); the input inp of type xt (F32, or a bf16 run's stored
 * row read as it is), w of wt; dx16 (NULL or): bf16(dx) after the add, dx not rounded (as the RMSNorm's) */
__global__ static void fl_cu_layernorm_bwd_dx_k(float *dinp, uint16_t *dinp16, const float *dout, const void *inp,
                                                int xt, const void *w, int wt, const float *mean, const float *rstd,
                                                int C) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    const void *x = row_at(inp, xt, row * C);
    const float *dy = dout + row * C;
    float *dx = dinp + row * C;
    uint16_t *dx16 = dinp16 ? dinp16 + row * C : NULL;
    float m = mean[row], r = rstd[row], s1 = 0.0f, s2 = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float g = dy[c] * nw(w, wt, c);
        s1 += g;
        s2 += g * ((nw(x, xt, c) - m) * r);
    }
    float m1 = fl_cu_block_sum(s1, buf) / (float)C;
    float m2 = fl_cu_block_sum(s2, buf) / (float)C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        dx[c] += r * (dy[c] * nw(w, wt, c) - m1 - (nw(x, xt, c) - m) * r * m2);
        keep16_only(dx16, (size_t)c, dx[c]);
    }
}

static int layernorm_fwd(float *out, void *out16, float *mean, float *rstd, const float *inp, const void *w,
                         const void *b, fl_dtype wt, int N, int C, float eps, void *stream) {
    if (N <= 0 || C <= 0) return 0;
#if FL_CU_EMULATED
    fl_cu_emu_norm_add_launches++;
#endif
    FL_CU_LAUNCH(fl_cu_layernorm_fwd_k, dim3((unsigned)N), dim3(row_threads(C)), 0, (fl_cu_stream)stream, out,
                 (uint16_t *)out16, mean, rstd, inp, w, b, (int)wt, C, eps);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(layernorm_forward)(float *out, float *mean, float *rstd, const float *inp, const float *w,
                                         const float *b, int N, int C, float eps, void *stream) {
    return layernorm_fwd(out, NULL, mean, rstd, inp, w, b, FL_F32, N, C, eps, stream);
}
/* w and b (NULL or) of wt: BF16/F16, or F32 with out16 only (as rmsnorm_forward_w16) */
extern "C" int FL_CUK(layernorm_forward_w16)(float *out, void *out16, float *mean, float *rstd, const float *inp,
                                             const void *w, const void *b, fl_dtype wt, int N, int C, float eps,
                                             void *stream) {
    if (wt != FL_BF16 && wt != FL_F16 && !(wt == FL_F32 && out16)) return -1;
    if (!out && !out16) return -1; /* out NULL: the bf16 copy only */
    return layernorm_fwd(out, out16, mean, rstd, inp, w, b, wt, N, C, eps, stream);
}

/* add_norm_forward16 (backend.h): one launch, one block per row. ln: LayerNorm (mean, bias), else RMSNorm. res16 and
 * out16 required (bf16), res / out NULL or the fp32 views; w (and bias) of wt F32 / BF16 / F16; b of bt (F32, or BF16:
 * add_norm_forward16_b16). -1: refused. */
static int add_norm16(int ln, float *res, void *res16, float *out, void *out16, float *mean, float *rstd,
                      const float *a, const void *b, fl_dtype bt, const void *w, const void *bias, fl_dtype wt, int N,
                      int C, float eps, void *stream) {
    if ((wt != FL_BF16 && wt != FL_F16 && wt != FL_F32) || !res16 || !out16 || !b || !w) return -1;
    if (!a && (ln || bt != FL_BF16 || res16 != b)) return -1; /* a NULL: RMSNorm of the stored sum b16 (res16 == b16) */
    if (N <= 0 || C <= 0) return 0;
#if FL_CU_EMULATED
    fl_cu_emu_norm_add_launches++;
#endif
    if (ln) {
        FL_CU_LAUNCH(fl_cu_add_layernorm16_k, dim3((unsigned)N), dim3(row_threads(C)), 0, (fl_cu_stream)stream, res,
                     (uint16_t *)res16, out, (uint16_t *)out16, mean, rstd, a, b, (int)bt, w, bias, (int)wt, C, eps);
        return fl_cu_launch_error();
    }
    /* the mapping rmsnorm_forward_w16 takes for (out, inp = res, w): its sum order */
    const int vec = C % 4 == 0 && fl_cu_aligned16(out, res, wt == FL_F32 ? w : NULL, NULL, NULL);
    const int v4 = vec && fl_cu_aligned16(a ? a : res, b, NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_add_rmsnorm16_k, dim3((unsigned)N), dim3(row_threads(vec ? C / 4 : C)), 0, (fl_cu_stream)stream,
                 res, (uint16_t *)res16, out, (uint16_t *)out16, rstd, a, b, (int)bt, w, (int)wt, C, eps, vec, v4);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(add_norm_forward16)(int ln, float *res, void *res16, float *out, void *out16, float *mean,
                                          float *rstd, const float *a, const float *b, const void *w, const void *bias,
                                          fl_dtype wt, int N, int C, float eps, void *stream) {
    return add_norm16(ln, res, res16, out, out16, mean, rstd, a, b, FL_F32, w, bias, wt, N, C, eps, stream);
}
/* backend.h's add_norm_forward16_b16 with a norm (out16 != NULL): b16 (N, C) bf16, the residual operand as stored */
extern "C" int FL_CUK(add_norm_forward16_b16)(int ln, float *res, void *res16, float *out, void *out16, float *mean,
                                              float *rstd, const float *a, const void *b16, const void *w,
                                              const void *bias, fl_dtype wt, int N, int C, float eps, void *stream) {
    return add_norm16(ln, res, res16, out, out16, mean, rstd, a, b16, FL_BF16, w, bias, wt, N, C, eps, stream);
}

static int layernorm_bwd(float *dinp, void *dinp16, float *dw, float *db, const float *dout, const void *inp,
                         fl_dtype xt, const void *w, fl_dtype wt, const float *mean, const float *rstd, int N, int C,
                         void *work, void *stream) {
    if (N <= 0 || C <= 0) return 0;
    if ((dw || db) && colsum_tiles(N, C) > 1 && !work) return -1;
    if (dinp)
        FL_CU_LAUNCH(fl_cu_layernorm_bwd_dx_k, dim3((unsigned)N), dim3(row_threads(C)), 0, (fl_cu_stream)stream, dinp,
                     (uint16_t *)dinp16, dout, inp, (int)xt, w, (int)wt, mean, rstd, C);
    if (dw || db) colsum(dw, db, dout, dw ? inp : NULL, xt, mean, rstd, N, C, NULL, work, stream);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(layernorm_backward)(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                                          const float *w, const float *mean, const float *rstd, int N, int C,
                                          void *work, void *stream) {
    return layernorm_bwd(dinp, NULL, dw, db, dout, inp, FL_F32, w, FL_F32, mean, rstd, N, C, work, stream);
}
/* as rmsnorm_backward_w16: inp16 (NULL or) the input's bf16 copy read instead of inp; wt BF16/F16, or F32 with inp16
 * or dinp16 */
extern "C" int FL_CUK(layernorm_backward_w16)(float *dinp, void *dinp16, float *dw, float *db, const float *dout,
                                              const float *inp, const void *inp16, const void *w, fl_dtype wt,
                                              const float *mean, const float *rstd, int N, int C, void *work,
                                              void *stream) {
    if (wt != FL_BF16 && wt != FL_F16 && !(wt == FL_F32 && (inp16 || dinp16))) return -1;
    return layernorm_bwd(dinp, dinp16, dw, db, dout, inp16 ? inp16 : inp, inp16 ? FL_BF16 : FL_F32, w, wt, mean, rstd,
                         N, C, work, stream);
}

/* db[c] += sum over the N rows of dy (the linears' bias gradient): the same column sum; dy16 (NULL or): bf16(dy) */
extern "C" int FL_CUK(bias_backward16)(float *db, void *dy16, const float *dy, int N, int OC, void *work,
                                        void *stream) {
    if (db && N > 0 && OC > 0 && colsum(NULL, db, dy, NULL, FL_F32, NULL, NULL, N, OC, (uint16_t *)dy16, work, stream))
        return -1;
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(bias_backward)(float *db, const float *dy, int N, int OC, void *work, void *stream) {
    return FL_CUK(bias_backward16)(db, NULL, dy, N, OC, work, stream);
}
