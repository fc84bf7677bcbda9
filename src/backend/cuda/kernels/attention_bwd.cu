/* Attention backward, semantics of backend.h's attention_backward and attention_backward_ex
 * (ACCUMULATES into dq, dk, dv and, when given, dbias). The forward: attention.cu.
 *
 * The standard deterministic flash-attention-2 split, three kernels on the stream:
 *  1. D[b,h,t] = dout . out per query row (one warp per row) into the caller's `work`;
 *  2. dK/dV: block = (key tile of KBK keys, kv head g, batch b); loops over the query heads of
 *     g's group ascending and, per head, the query tiles that can see the tile ascending:
 *     P = exp(S - lse) and dS = P o (dP - D) (dP = dO V^T) of the (query tile, key tile) pair,
 *     through shared memory, then dV += P^T dO and dK += dS^T (scale q) in registers; added once
 *     to dk / dv at the end. A key belongs to 8 consecutive lanes (every 8th dimension each);
 *  3. dQ (and dbias): block = (query tile, head h, batch b), the forward's layout: key tiles
 *     ascending up to the tile's causal limit, dQ += scale dS K in registers, added once. With
 *     dbias the block takes (query tile, h) and walks the batch ascending, so each dbias element
 *     (a sum over b) has one owner and needs no batch-sized scratch.
 * P and dS are computed by both 2 and 3 (7 dot-product rows per (query, key) pair instead of 5)
 * so that nothing is shared between blocks: every output element has one owner that adds its
 * parts in a fixed order, no atomics, the same bits every run. Hidden keys (mask, causal limit,
 * tile end) and rows with no visible key (lse -inf) get P = dS = +0 exactly. */
#include "backend/cuda/kernels/attn_common.h"

/* ---- dK / dV --------------------------------------------------------------------------------- */

template <class C> __global__ static void fl_cu_attn_dkdv_k(fl_cu_attn_p p) {
    enum { D = C::D, BK = C::KBK, BQ = C::KBQ, RK = C::KRK, DP = D + 1, QP = BQ + 1, RQ = BQ / 8, DPT = D / 8 };
    FL_CU_DYN_SMEM(float, sm);
    float *Ks = sm;            // (BK, DP)
    float *Vs = Ks + BK * DP;  // (BK, DP)
    float *Qs = Vs + BK * DP;  // (BQ, DP) q * scale
    float *Gs = Qs + BQ * DP;  // (BQ, DP) dout
    float *Pt = Gs + BQ * DP;  // (BK, QP) P transposed
    float *St = Pt + BK * QP;  // (BK, QP) dS transposed
    __shared__ float Ls[BQ], Ds[BQ]; // lse, D of the query tile's rows
    __shared__ int lims[BQ];         // one past each row's last visible key (0: padding row)
    __shared__ int km[BK];
    const int tx = threadIdx.x & 7, ky = threadIdx.x >> 3;
    const int g = blockIdx.y, b = blockIdx.z, HD = p.HD;
    const int k0 = blockIdx.x * BK, kn = p.Tk - k0 < BK ? p.Tk - k0 : BK;
    fl_cu_attn_load_tile<D, BK>(Ks, p.k + ((size_t)b * p.Tk + k0) * p.ldk + (size_t)g * HD, p.ldk, kn, HD, 1.0f);
    fl_cu_attn_load_tile<D, BK>(Vs, p.v + ((size_t)b * p.Tk + k0) * p.ldv + (size_t)g * HD, p.ldv, kn, HD, 1.0f);
    for (int j = threadIdx.x; j < BK; j += FL_CU_ATTN_THREADS)
        km[j] = j < kn && (!p.kmask || p.kmask[(size_t)b * p.Tk + k0 + j]);
    float ak[RK][DPT], av[RK][DPT];
    for (int i = 0; i < RK; i++)
        for (int c = 0; c < DPT; c++) ak[i][c] = av[i][c] = 0.0f;
    const int tstart = fl_cu_attn_first_row(p, k0);
    for (int h = g * p.rep; h < (g + 1) * p.rep; h++) {
        for (int t0 = tstart; t0 < p.Tq; t0 += BQ) {
            const int rn = p.Tq - t0 < BQ ? p.Tq - t0 : BQ;
            __syncthreads(); /* the previous tile's Qs / Gs / Pt / St are read */
            fl_cu_attn_load_tile<D, BQ>(Qs, p.q + ((size_t)b * p.Tq + t0) * p.ldq + (size_t)h * HD, p.ldq, rn, HD,
                                        p.scale);
            fl_cu_attn_load_tile<D, BQ>(Gs, p.dout + ((size_t)b * p.Tq + t0) * p.ldo + (size_t)h * HD, p.ldo, rn,
                                        HD, 1.0f);
            for (int r = threadIdx.x; r < BQ; r += FL_CU_ATTN_THREADS) {
                size_t row = ((size_t)b * p.NH + h) * p.Tq + t0 + r;
                Ls[r] = r < rn ? p.lse[row] : 0.0f;
                Ds[r] = r < rn ? p.Dsum[row] : 0.0f;
                lims[r] = r < rn ? fl_cu_attn_key_limit(p, t0 + r) : 0;
            }
            __syncthreads();
            float s[RK][RQ], dp[RK][RQ];
            for (int i = 0; i < RK; i++)
                for (int c = 0; c < RQ; c++) s[i][c] = dp[i][c] = 0.0f;
            for (int d = 0; d < D; d++) {
                float qv[RQ], gv[RQ], kv[RK], vv[RK];
                for (int c = 0; c < RQ; c++) {
                    qv[c] = Qs[(tx + 8 * c) * DP + d];
                    gv[c] = Gs[(tx + 8 * c) * DP + d];
                }
                for (int i = 0; i < RK; i++) {
                    kv[i] = Ks[(ky * RK + i) * DP + d];
                    vv[i] = Vs[(ky * RK + i) * DP + d];
                }
                for (int i = 0; i < RK; i++)
                    for (int c = 0; c < RQ; c++) {
                        s[i][c] += qv[c] * kv[i];
                        dp[i][c] += gv[c] * vv[i];
                    }
            }
            for (int i = 0; i < RK; i++) {
                const int j = ky * RK + i;
                for (int c = 0; c < RQ; c++) {
                    const int r = tx + 8 * c;
                    float pv = 0.0f, ds = 0.0f;
                    if (km[j] && k0 + j < lims[r]) {
                        float sv = s[i][c];
                        if (p.bias) sv += p.bias[((size_t)h * p.Tq + t0 + r) * p.Tk + k0 + j];
                        pv = expf(sv - Ls[r]);
                        if (p.drop_p > 0.0f) { /* dV reads the dropped weights, dS = P o (f dP - D) */
                            const float f = fl_cu_attn_dropf(p, b, h, t0 + r, k0 + j);
                            ds = pv * (f * dp[i][c] - Ds[r]);
                            pv *= f;
                        } else {
                            ds = pv * (dp[i][c] - Ds[r]);
                        }
                    }
                    Pt[j * QP + r] = pv;
                    St[j * QP + r] = ds;
                }
            }
            __syncthreads(); /* Pt, St complete */
            for (int r = 0; r < rn; r++) {
                float gv[DPT], qv[DPT];
                for (int c = 0; c < DPT; c++) {
                    gv[c] = Gs[r * DP + tx + 8 * c];
                    qv[c] = Qs[r * DP + tx + 8 * c];
                }
                for (int i = 0; i < RK; i++) {
                    const float pv = Pt[(ky * RK + i) * QP + r], ds = St[(ky * RK + i) * QP + r];
                    for (int c = 0; c < DPT; c++) {
                        av[i][c] += pv * gv[c];
                        ak[i][c] += ds * qv[c]; /* scale is in Qs */
                    }
                }
            }
        }
    }
    for (int i = 0; i < RK; i++) {
        const int j = ky * RK + i;
        if (j >= kn) continue;
        float *dkr = p.dk + ((size_t)b * p.Tk + k0 + j) * p.ldk + (size_t)g * HD;
        float *dvr = p.dv + ((size_t)b * p.Tk + k0 + j) * p.ldv + (size_t)g * HD;
        for (int c = 0; c < DPT; c++) {
            const int d = tx + 8 * c;
            if (d < HD) {
                dkr[d] += ak[i][c];
                dvr[d] += av[i][c];
            }
        }
    }
}

/* ---- dQ (and dbias) ---------------------------------------------------------------------------- */

template <class C> __global__ static void fl_cu_attn_dq_k(fl_cu_attn_p p) {
    enum { D = C::D, BQ = C::QBQ, BK = C::QBK, RPT = C::QRPT, DP = D + 1, KP = BK + 1, KPT = BK / 8, DPT = D / 8 };
    FL_CU_DYN_SMEM(float, sm);
    float *Qs = sm;           // (BQ, DP) q * scale
    float *Gs = Qs + BQ * DP; // (BQ, DP) dout
    float *Ks = Gs + BQ * DP; // (BK, DP)
    float *Vs = Ks + BK * DP; // (BK, DP)
    float *Ss = Vs + BK * DP; // (BQ, KP) dS of the tile
    __shared__ int km[BK];
    const int tx = threadIdx.x & 7, ry = threadIdx.x >> 3;
    const int qt = (int)gridDim.x - 1 - (int)blockIdx.x; /* causal: the heaviest tiles start first */
    const int h = blockIdx.y, g = h / p.rep, HD = p.HD;
    const int q0 = qt * BQ, qn = p.Tq - q0 < BQ ? p.Tq - q0 : BQ;
    const int kend = fl_cu_attn_key_limit(p, q0 + qn - 1);
    /* with dbias one block walks the whole batch (one owner per dbias element) */
    const int b0 = p.dbias ? 0 : (int)blockIdx.z, b1 = p.dbias ? p.B : b0 + 1;
    int lim[RPT];
    for (int i = 0; i < RPT; i++) {
        int r = ry * RPT + i;
        lim[i] = r < qn ? fl_cu_attn_key_limit(p, q0 + r) : 0;
    }
    for (int b = b0; b < b1; b++) {
        __syncthreads(); /* the previous batch element's tiles are read */
        fl_cu_attn_load_tile<D, BQ>(Qs, p.q + ((size_t)b * p.Tq + q0) * p.ldq + (size_t)h * HD, p.ldq, qn, HD,
                                    p.scale);
        fl_cu_attn_load_tile<D, BQ>(Gs, p.dout + ((size_t)b * p.Tq + q0) * p.ldo + (size_t)h * HD, p.ldo, qn, HD,
                                    1.0f);
        float L[RPT], Dr[RPT], acc[RPT][DPT];
        for (int i = 0; i < RPT; i++) {
            int r = ry * RPT + i;
            size_t row = ((size_t)b * p.NH + h) * p.Tq + q0 + r;
            L[i] = r < qn ? p.lse[row] : 0.0f;
            Dr[i] = r < qn ? p.Dsum[row] : 0.0f;
            for (int c = 0; c < DPT; c++) acc[i][c] = 0.0f;
        }
        const fl_cu_fptr K = p.k + (size_t)b * p.Tk * p.ldk + (size_t)g * HD; // (Tk, HD) stride ldk
        const fl_cu_fptr V = p.v + (size_t)b * p.Tk * p.ldv + (size_t)g * HD; // (Tk, HD) stride ldv
        for (int k0 = 0; k0 < kend; k0 += BK) {
            const int kn = kend - k0 < BK ? kend - k0 : BK;
            __syncthreads(); /* the previous tile's Ks / Ss are read */
            fl_cu_attn_load_tile<D, BK>(Ks, K + (size_t)k0 * p.ldk, p.ldk, kn, HD, 1.0f);
            fl_cu_attn_load_tile<D, BK>(Vs, V + (size_t)k0 * p.ldv, p.ldv, kn, HD, 1.0f);
            for (int j = threadIdx.x; j < BK; j += FL_CU_ATTN_THREADS)
                km[j] = j < kn && (!p.kmask || p.kmask[(size_t)b * p.Tk + k0 + j]);
            __syncthreads();
            float s[RPT][KPT], dp[RPT][KPT];
            for (int i = 0; i < RPT; i++)
                for (int c = 0; c < KPT; c++) s[i][c] = dp[i][c] = 0.0f;
            for (int d = 0; d < D; d++) {
                float qv[RPT], gv[RPT], kv[KPT], vv[KPT];
                for (int i = 0; i < RPT; i++) {
                    qv[i] = Qs[(ry * RPT + i) * DP + d];
                    gv[i] = Gs[(ry * RPT + i) * DP + d];
                }
                for (int c = 0; c < KPT; c++) {
                    kv[c] = Ks[(tx + 8 * c) * DP + d];
                    vv[c] = Vs[(tx + 8 * c) * DP + d];
                }
                for (int i = 0; i < RPT; i++)
                    for (int c = 0; c < KPT; c++) {
                        s[i][c] += qv[i] * kv[c];
                        dp[i][c] += gv[i] * vv[c];
                    }
            }
            for (int i = 0; i < RPT; i++) {
                const int r = ry * RPT + i;
                float *dbr = p.dbias && r < qn ? p.dbias + ((size_t)h * p.Tq + q0 + r) * p.Tk + k0 : NULL;
                for (int c = 0; c < KPT; c++) {
                    const int j = tx + 8 * c;
                    float ds = 0.0f;
                    if (km[j] && k0 + j < lim[i]) {
                        float sv = s[i][c];
                        if (p.bias) sv += p.bias[((size_t)h * p.Tq + q0 + r) * p.Tk + k0 + j];
                        const float f = p.drop_p > 0.0f ? fl_cu_attn_dropf(p, b, h, q0 + r, k0 + j) : 1.0f;
                        ds = expf(sv - L[i]) * (p.drop_p > 0.0f ? f * dp[i][c] - Dr[i] : dp[i][c] - Dr[i]);
                    }
                    Ss[r * KP + j] = ds;
                    if (dbr && j < kn) dbr[j] += ds;
                }
            }
            __syncthreads(); /* Ss complete */
            for (int j = 0; j < kn; j++) {
                float kv[DPT];
                for (int c = 0; c < DPT; c++) kv[c] = Ks[j * DP + tx + 8 * c];
                for (int i = 0; i < RPT; i++) {
                    const float e = Ss[(ry * RPT + i) * KP + j];
                    for (int c = 0; c < DPT; c++) acc[i][c] += e * kv[c];
                }
            }
        }
        for (int i = 0; i < RPT; i++) {
            const int r = ry * RPT + i;
            if (r >= qn) continue;
            float *dqr = p.dq + ((size_t)b * p.Tq + q0 + r) * p.ldq + (size_t)h * HD;
            for (int c = 0; c < DPT; c++) {
                const int d = tx + 8 * c;
                if (d < HD) dqr[d] += p.scale * acc[i][c];
            }
        }
    }
}

template <class C> static int fl_cu_attn_bwd_launch(const fl_cu_attn_p &p, void *stream) {
    enum { D = C::D };
    int rc = fl_cu_attn_dsum_launch(p, stream);
    if (rc) return rc;
    if (p.Tk > 0) {
        const size_t smem = sizeof(float) * (2 * (size_t)C::KBK * (D + 1) + 2 * (size_t)C::KBQ * (D + 1) +
                                             2 * (size_t)C::KBK * (C::KBQ + 1));
        if (FL_CU_SMEM_OPTIN(fl_cu_attn_dkdv_k<C>, smem)) return fl_cu_launch_error();
        dim3 grid((unsigned)((p.Tk + C::KBK - 1) / C::KBK), (unsigned)p.NKV, (unsigned)p.B);
        FL_CU_LAUNCH(fl_cu_attn_dkdv_k<C>, grid, dim3(FL_CU_ATTN_THREADS), smem, (fl_cu_stream)stream, p);
        if ((rc = fl_cu_launch_error())) return rc;
    }
    const size_t smem = sizeof(float) * (2 * (size_t)C::QBQ * (D + 1) + 2 * (size_t)C::QBK * (D + 1) +
                                         (size_t)C::QBQ * (C::QBK + 1));
    if (FL_CU_SMEM_OPTIN(fl_cu_attn_dq_k<C>, smem)) return fl_cu_launch_error();
    dim3 grid((unsigned)((p.Tq + C::QBQ - 1) / C::QBQ), (unsigned)p.NH, (unsigned)(p.dbias ? 1 : p.B));
    FL_CU_LAUNCH(fl_cu_attn_dq_k<C>, grid, dim3(FL_CU_ATTN_THREADS), smem, (fl_cu_stream)stream, p);
    return fl_cu_launch_error();
}

/* in16: q, k, v and out bf16 (attention_backward_ex16) */
static int attn_bwd_ex(const fl_attn_desc *a, float *dq, float *dk, float *dv, float *dbias, const float *dout,
                       const void *q, const void *k, const void *v, const float *bias, const uint8_t *kmask,
                       const void *out, const float *lse, void *work, int in16, void *stream) {
    fl_cu_attn_p p;
    int rc = fl_cu_attn_bwd_setup(&p, a, dq, dk, dv, dbias, dout, q, k, v, bias, kmask, out, lse, work, 0, in16);
    if (rc) return rc < 0 ? rc : 0;
    switch (fl_cu_attn_bucket(a->HD)) {
    case 32: return fl_cu_attn_bwd_launch<fl_cu_attn_cfg<32> >(p, stream);
    case 64: return fl_cu_attn_bwd_launch<fl_cu_attn_cfg<64> >(p, stream);
    case 128: return fl_cu_attn_bwd_launch<fl_cu_attn_cfg<128> >(p, stream);
    default: return fl_cu_attn_bwd_launch<fl_cu_attn_cfg<256> >(p, stream);
    }
}

extern "C" int FL_CUK(attention_backward_ex)(const fl_attn_desc *a, float *dq, float *dk, float *dv, float *dbias,
                                             const float *dout, const float *q, const float *k, const float *v,
                                             const float *bias, const uint8_t *kmask, const float *out,
                                             const float *lse, void *work, void *stream) {
    return attn_bwd_ex(a, dq, dk, dv, dbias, dout, q, k, v, bias, kmask, out, lse, work, 0, stream);
}
extern "C" int FL_CUK(attention_backward_ex16)(const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                               const float *dout, const void *q16, const void *k16, const void *v16,
                                               const uint8_t *kmask, const void *out16, const float *lse, void *work,
                                               void *stream) {
    return attn_bwd_ex(a, dq, dk, dv, NULL, dout, q16, k16, v16, NULL, kmask, out16, lse, work, 1, stream);
}

extern "C" int FL_CUK(attention_backward)(float *dqkv, const float *dout, const float *qkv, const float *out,
                                          const float *lse, int B, int T, int NH, int NKV, int HD, void *work,
                                          void *stream) {
    fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    if (!qkv || !dqkv || NKV <= 0 || HD <= 0) return HD > FL_CU_ATTN_MAX_HD ? FL_CU_ATTN_UNSUPPORTED : FL_CU_ATTN_INVALID;
    const size_t ko = (size_t)NH * HD, vo = (size_t)(NH + NKV) * HD;
    return FL_CUK(attention_backward_ex)(&a, dqkv, dqkv + ko, dqkv + vo, NULL, dout, qkv, qkv + ko, qkv + vo, NULL,
                                         NULL, out, lse, work, stream);
}
