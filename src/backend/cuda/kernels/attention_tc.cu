/* Tensor-core attention (bf16 mma.m16n8k16, fp32 accumulation): forward and backward for runs
 * whose compute dtype is bf16, the semantics of attention_forward_ex / attention_backward_ex
 * without bias, with Q, K, V, P, dO and dS rounded to bf16 (round to nearest even) as the
 * operands of the products, everything else fp32: scores, the online softmax, lse, D = dO.O
 * (from the fp32 out), the accumulators and the outputs. That is what a bf16 PyTorch run's
 * flash attention computes. HD 64 and 128 only (the launchers return FL_CU_ATTN_UNSUPPORTED
 * otherwise, or with a bias: the backend then runs the fp32 kernels of attention.cu /
 * attention_bwd.cu, which stay the reference and the 32-true path). lse is the fp32 kernels'
 * (natural log, -inf for a row without a visible key), so either backward takes either forward.
 * Fragment layouts and the emulation: cu_mma.h. 128 threads = 4 warps per block everywhere.
 *
 * Forward (FlashAttention-2): block = (64 query rows, head h, batch b), warp w owns rows
 * 16w..16w+15; its Q fragments (bf16) stay in registers. Key tiles of 64: K row-major and V
 * transposed (bf16, rows padded by 8 elements: the fragment reads of a warp hit 32 distinct
 * banks) in shared memory; S = Q K^T by mma, masked (causal limit, kmask, tile end) and scaled
 * into log2 units, the online softmax in fp32 registers (row max / sum over the 4 lanes of a row:
 * 2 xor shuffles), P rounded to bf16 straight from the accumulator registers into A fragments,
 * O += P V by mma; at the end O / l and lse. A warp whose rows see no key of the tile skips it.
 *
 * Backward (FlashAttention-2's split, the fp32 backward's structure: no atomics, one owner per
 * output element, the same bits every run): D = dO.O (fl_cu_attn_dsum_k); dK/dV: block = (64
 * keys, kv head, batch), warp w owns keys 16w.., K, V, a query tile's Q and dO (row-major and
 * transposed) in shared memory; per query head of the group and query tile: S^T = K Q^T and
 * dP^T = V dO^T by mma, P^T = exp(S^T - lse), dS^T = P^T (dP^T - D), then dV += P^T dO and
 * dK += dS^T Q by mma (P^T, dS^T rounded to bf16 from the accumulators); dQ: block = (64 query
 * rows, head, batch): S = Q K^T, dP = dO V^T, dS, dQ += dS K by mma over the key tiles. So every
 * matmul of the backward is on tensor cores; P and dS are computed twice (dK/dV and dQ kernels)
 * as in the fp32 backward. */
#include "backend/cuda/cu_mma.h"
#include "backend/cuda/kernels/attn_common.h"
#include "backend/cuda/kernels/attn_mma.h"

/* Tile shapes per head dimension D. PAD: bf16 elements added to each shared-memory row (a row of
 * n elements + 8 is n/2 + 4 words: the 8 row groups x 4 lanes of a fragment read fall in 32
 * distinct banks when n/2 is a multiple of 32, and 8 x (n/2+4) spread them otherwise). */
template <int D_> struct fl_cu_tc_cfg;
template <> struct fl_cu_tc_cfg<64> {
    enum { D = 64, FBK = 64, KBQ = 64, QBK = 64 };
};
template <> struct fl_cu_tc_cfg<128> {
    enum { D = 128, FBK = 64, KBQ = 32, QBK = 32 };
};
/* ---- forward ---------------------------------------------------------------------------------- */

template <int D> __global__ static void fl_cu_tc_fwd_k(fl_cu_attn_p p) {
    enum { BQ = 64, BK = fl_cu_tc_cfg<D>::FBK, KP = D + FL_CU_TC_PAD, VP = BK + FL_CU_TC_PAD, NT = BK / 8,
           DT = D / 8, DK = D / 16, PK = BK / 16 };
    FL_CU_DYN_SMEM(uint16_t, sm);
    uint16_t *Ks = sm;           // (BK, KP) keys, bf16
    uint16_t *Vt = Ks + BK * KP; // (D, VP) values transposed, bf16
    __shared__ int km[BK];       // key exists and is not padding
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int qt = (int)gridDim.x - 1 - (int)blockIdx.x; /* causal: the heaviest tiles start first */
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.rep;
    const int q0 = qt * BQ, qn = p.Tq - q0 < BQ ? p.Tq - q0 : BQ;
    const int r0 = warp * 16 + g, r1 = r0 + 8; /* the lane's two rows in the tile */
    const fl_cu_fptr Q = p.q + ((size_t)b * p.Tq + q0) * p.ldq + (size_t)h * D;
    uint32_t qa[DK][4];
    for (int kk = 0; kk < DK; kk++) {
        qa[kk][0] = fl_cu_tc_ld2(Q, p.ldq, r0, qn, kk * 16 + 2 * tq);
        qa[kk][1] = fl_cu_tc_ld2(Q, p.ldq, r1, qn, kk * 16 + 2 * tq);
        qa[kk][2] = fl_cu_tc_ld2(Q, p.ldq, r0, qn, kk * 16 + 8 + 2 * tq);
        qa[kk][3] = fl_cu_tc_ld2(Q, p.ldq, r1, qn, kk * 16 + 8 + 2 * tq);
    }
    const int lim0 = r0 < qn ? fl_cu_attn_key_limit(p, q0 + r0) : 0, lim1 = r1 < qn ? fl_cu_attn_key_limit(p, q0 + r1) : 0;
    /* keys the block's rows see / the warp's rows see (warp-uniform) */
    const int kend = qn > 0 ? fl_cu_attn_key_limit(p, q0 + qn - 1) : 0;
    const int wlast = warp * 16 + 15 < qn ? warp * 16 + 15 : qn - 1;
    const int wend = wlast >= warp * 16 ? fl_cu_attn_key_limit(p, q0 + wlast) : 0;
    const float sl2 = p.scale * FL_CU_LOG2E; /* scores in log2 units: exp2f */
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f, o[DT][4];
    for (int dt = 0; dt < DT; dt++)
        for (int i = 0; i < 4; i++) o[dt][i] = 0.0f;
    const fl_cu_fptr K = p.k + (size_t)b * p.Tk * p.ldk + (size_t)kvh * D; // (Tk, D) stride ldk
    const fl_cu_fptr V = p.v + (size_t)b * p.Tk * p.ldv + (size_t)kvh * D; // (Tk, D) stride ldv
    for (int k0 = 0; k0 < kend; k0 += BK) {
        const int kn = kend - k0 < BK ? kend - k0 : BK;
        __syncthreads(); /* the previous tile's Ks / Vt are read */
        fl_cu_tc_load<D, BK>(Ks, KP, NULL, 0, K + (size_t)k0 * p.ldk, p.ldk, kn);
        fl_cu_tc_load<D, BK>(NULL, 0, Vt, VP, V + (size_t)k0 * p.ldv, p.ldv, kn);
        for (int j = threadIdx.x; j < BK; j += FL_CU_TC_THREADS)
            km[j] = j < kn && (!p.kmask || p.kmask[(size_t)b * p.Tk + k0 + j]);
        __syncthreads();
        if (k0 >= wend) continue; /* no row of this warp sees the tile (warp-uniform) */
        float s[NT][4];
        for (int nt = 0; nt < NT; nt++) {
            for (int i = 0; i < 4; i++) s[nt][i] = 0.0f;
            for (int kk = 0; kk < DK; kk++) {
                uint32_t bf[2];
                fl_cu_tc_frag_b(bf, Ks, KP, nt * 8, kk * 16);
                fl_cu_mma_bf16_16816(s[nt], qa[kk], bf, s[nt]);
            }
        }
        float mx0 = -INFINITY, mx1 = -INFINITY;
        for (int nt = 0; nt < NT; nt++)
            for (int i = 0; i < 4; i++) {
                const int j = nt * 8 + 2 * tq + (i & 1);
                const int vis = km[j] && k0 + j < (i < 2 ? lim0 : lim1);
                s[nt][i] = vis ? s[nt][i] * sl2 : -INFINITY;
                if (i < 2) mx0 = fmaxf(mx0, s[nt][i]);
                else mx1 = fmaxf(mx1, s[nt][i]);
            }
        for (int off = 1; off < 4; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(FL_CU_FULL_MASK, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FL_CU_FULL_MASK, mx1, off));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        /* nothing visible yet: the state stays (m = -inf, l = 0, o = 0) */
        const float c0 = mn0 == -INFINITY ? 1.0f : exp2f(m0 - mn0), c1 = mn1 == -INFINITY ? 1.0f : exp2f(m1 - mn1);
        float ps0 = 0.0f, ps1 = 0.0f;
        for (int nt = 0; nt < NT; nt++)
            for (int i = 0; i < 4; i++) {
                const float mn = i < 2 ? mn0 : mn1;
                const float pv = s[nt][i] == -INFINITY ? 0.0f : exp2f(s[nt][i] - mn);
                s[nt][i] = pv;
                if (i < 2) ps0 += pv;
                else ps1 += pv;
            }
        l0 = l0 * c0 + ps0;
        l1 = l1 * c1 + ps1;
        m0 = mn0;
        m1 = mn1;
        for (int dt = 0; dt < DT; dt++) {
            o[dt][0] *= c0;
            o[dt][1] *= c0;
            o[dt][2] *= c1;
            o[dt][3] *= c1;
        }
        for (int kk = 0; kk < PK; kk++) {
            uint32_t pa[4];
            fl_cu_tc_acc_to_a(pa, s[2 * kk], s[2 * kk + 1]);
            for (int dt = 0; dt < DT; dt++) {
                uint32_t bf[2];
                fl_cu_tc_frag_b(bf, Vt, VP, dt * 8, kk * 16);
                fl_cu_mma_bf16_16816(o[dt], pa, bf, o[dt]);
            }
        }
    }
    /* each lane holds a partial l of its own columns: the row's 4 lanes sum them */
    for (int off = 1; off < 4; off <<= 1) {
        l0 += __shfl_xor_sync(FL_CU_FULL_MASK, l0, off);
        l1 += __shfl_xor_sync(FL_CU_FULL_MASK, l1, off);
    }
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f; /* no visible key: 0 */
    const size_t at = ((size_t)b * p.Tq + q0) * p.ldo + (size_t)h * D;
    float *O = p.o ? p.o + at : NULL; /* NULL: the bf16 copy only */
    uint16_t *O16 = p.o16 ? p.o16 + at : NULL; /* bf16 stored: the output's copy too */
    for (int dt = 0; dt < DT; dt++) {
        const int d = dt * 8 + 2 * tq;
        const size_t i0 = (size_t)r0 * p.ldo + d, i1 = (size_t)r1 * p.ldo + d;
        if (r0 < qn) {
            fl_cu_put16(O, O16, i0, o[dt][0] * inv0);
            fl_cu_put16(O, O16, i0 + 1, o[dt][1] * inv0);
        }
        if (r1 < qn) {
            fl_cu_put16(O, O16, i1, o[dt][2] * inv1);
            fl_cu_put16(O, O16, i1 + 1, o[dt][3] * inv1);
        }
    }
    if (tq == 0) {
        float *L = p.l + ((size_t)b * p.NH + h) * p.Tq + q0;
        if (r0 < qn) L[r0] = l0 > 0.0f ? m0 * FL_CU_LN2 + logf(l0) : -INFINITY;
        if (r1 < qn) L[r1] = l1 > 0.0f ? m1 * FL_CU_LN2 + logf(l1) : -INFINITY;
    }
}

/* ---- backward: dK / dV ------------------------------------------------------------------------ */

template <int D> __global__ static void fl_cu_tc_dkdv_k(fl_cu_attn_p p) {
    enum { BK = 64, BQ = fl_cu_tc_cfg<D>::KBQ, KP = D + FL_CU_TC_PAD, TP = BQ + FL_CU_TC_PAD, NQ = BQ / 8, DT = D / 8,
           DK = D / 16, QK = BQ / 16 };
    FL_CU_DYN_SMEM(uint16_t, sm);
    uint16_t *Ks = sm;           // (BK, KP) keys
    uint16_t *Vs = Ks + BK * KP; // (BK, KP) values
    uint16_t *Qs = Vs + BK * KP; // (BQ, KP) the query tile
    uint16_t *Gs = Qs + BQ * KP; // (BQ, KP) its dO
    uint16_t *Qt = Gs + BQ * KP; // (D, TP) Q transposed
    uint16_t *Gt = Qt + D * TP;  // (D, TP) dO transposed
    __shared__ float Ls[BQ], Ds[BQ]; // lse (log2 units), D of the tile's rows
    __shared__ int lims[BQ];         // one past each row's last visible key (0: padding row)
    __shared__ int km[BK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int k0 = blockIdx.x * BK, kn = p.Tk - k0 < BK ? p.Tk - k0 : BK;
    fl_cu_tc_load<D, BK>(Ks, KP, NULL, 0, p.k + ((size_t)b * p.Tk + k0) * p.ldk + (size_t)kvh * D, p.ldk, kn);
    fl_cu_tc_load<D, BK>(Vs, KP, NULL, 0, p.v + ((size_t)b * p.Tk + k0) * p.ldv + (size_t)kvh * D, p.ldv, kn);
    for (int j = threadIdx.x; j < BK; j += FL_CU_TC_THREADS)
        km[j] = j < kn && (!p.kmask || p.kmask[(size_t)b * p.Tk + k0 + j]);
    const int kw = warp * 16; /* the warp's keys kw..kw+15 of the tile */
    const int j0 = kw + g, j1 = j0 + 8;
    const int wfirst = fl_cu_attn_first_row(p, k0 + kw); /* the first row that sees any of them */
    const float sl2 = p.scale * FL_CU_LOG2E;
    float ak[DT][4], av[DT][4];
    for (int dt = 0; dt < DT; dt++)
        for (int i = 0; i < 4; i++) ak[dt][i] = av[dt][i] = 0.0f;
    const int tstart = fl_cu_attn_first_row(p, k0);
    for (int h = kvh * p.rep; h < (kvh + 1) * p.rep; h++) {
        for (int t0 = tstart; t0 < p.Tq; t0 += BQ) {
            const int rn = p.Tq - t0 < BQ ? p.Tq - t0 : BQ;
            __syncthreads(); /* the previous tile's Qs / Gs / Qt / Gt / Ls / Ds are read */
            fl_cu_tc_load<D, BQ>(Qs, KP, Qt, TP, p.q + ((size_t)b * p.Tq + t0) * p.ldq + (size_t)h * D, p.ldq, rn);
            fl_cu_tc_load<D, BQ>(Gs, KP, Gt, TP, p.dout + ((size_t)b * p.Tq + t0) * p.ldo + (size_t)h * D, p.ldo, rn);
            for (int r = threadIdx.x; r < BQ; r += FL_CU_TC_THREADS) {
                const size_t row = ((size_t)b * p.NH + h) * p.Tq + t0 + r;
                Ls[r] = r < rn ? p.lse[row] * FL_CU_LOG2E : 0.0f;
                Ds[r] = r < rn ? p.Dsum[row] : 0.0f;
                lims[r] = r < rn ? fl_cu_attn_key_limit(p, t0 + r) : 0;
            }
            __syncthreads();
            /* warp-uniform skips: keys past the tile end, or no row of the tile sees them */
            if (kw >= kn || t0 + rn <= wfirst) continue;
            float s[NQ][4], dp[NQ][4];
            for (int nt = 0; nt < NQ; nt++)
                for (int i = 0; i < 4; i++) s[nt][i] = dp[nt][i] = 0.0f;
            for (int kk = 0; kk < DK; kk++) { /* the warp's K / V fragments once per k-step */
                uint32_t ka[4], va[4];
                fl_cu_tc_frag_a(ka, Ks, KP, kw, kk * 16);
                fl_cu_tc_frag_a(va, Vs, KP, kw, kk * 16);
                for (int nt = 0; nt < NQ; nt++) {
                    uint32_t bf[2];
                    fl_cu_tc_frag_b(bf, Qs, KP, nt * 8, kk * 16);
                    fl_cu_mma_bf16_16816(s[nt], ka, bf, s[nt]);
                    fl_cu_tc_frag_b(bf, Gs, KP, nt * 8, kk * 16);
                    fl_cu_mma_bf16_16816(dp[nt], va, bf, dp[nt]);
                }
            }
            /* element i of n-tile nt: key j0 (i < 2) or j1, query row nt*8 + 2tq + (i & 1) */
            for (int nt = 0; nt < NQ; nt++)
                for (int i = 0; i < 4; i++) {
                    const int r = nt * 8 + 2 * tq + (i & 1), j = i < 2 ? j0 : j1;
                    float pv = 0.0f, ds = 0.0f;
                    if (km[j] && k0 + j < lims[r]) {
                        pv = exp2f(s[nt][i] * sl2 - Ls[r]);
                        ds = pv * (dp[nt][i] - Ds[r]);
                    }
                    s[nt][i] = pv;
                    dp[nt][i] = ds;
                }
            for (int kk = 0; kk < QK; kk++) {
                uint32_t pa[4], da[4];
                fl_cu_tc_acc_to_a(pa, s[2 * kk], s[2 * kk + 1]);
                fl_cu_tc_acc_to_a(da, dp[2 * kk], dp[2 * kk + 1]);
                for (int dt = 0; dt < DT; dt++) {
                    uint32_t bf[2];
                    fl_cu_tc_frag_b(bf, Gt, TP, dt * 8, kk * 16);
                    fl_cu_mma_bf16_16816(av[dt], pa, bf, av[dt]);
                    fl_cu_tc_frag_b(bf, Qt, TP, dt * 8, kk * 16);
                    fl_cu_mma_bf16_16816(ak[dt], da, bf, ak[dt]);
                }
            }
        }
    }
    float *dK = p.dk + ((size_t)b * p.Tk + k0) * p.ldk + (size_t)kvh * D;
    float *dV = p.dv + ((size_t)b * p.Tk + k0) * p.ldv + (size_t)kvh * D;
    for (int dt = 0; dt < DT; dt++) {
        const int d = dt * 8 + 2 * tq;
        for (int i = 0; i < 4; i++) {
            const int j = i < 2 ? j0 : j1;
            if (j >= kn) continue;
            dK[(size_t)j * p.ldk + d + (i & 1)] += p.scale * ak[dt][i];
            dV[(size_t)j * p.ldv + d + (i & 1)] += av[dt][i];
        }
    }
}

/* ---- backward: dQ ----------------------------------------------------------------------------- */

template <int D> __global__ static void fl_cu_tc_dq_k(fl_cu_attn_p p) {
    enum { BQ = 64, BK = fl_cu_tc_cfg<D>::QBK, KP = D + FL_CU_TC_PAD, TP = BK + FL_CU_TC_PAD, NT = BK / 8, DT = D / 8,
           DK = D / 16, PK = BK / 16 };
    FL_CU_DYN_SMEM(uint16_t, sm);
    uint16_t *Qs = sm;           // (BQ, KP) the query tile
    uint16_t *Gs = Qs + BQ * KP; // (BQ, KP) its dO
    uint16_t *Ks = Gs + BQ * KP; // (BK, KP) keys
    uint16_t *Vs = Ks + BK * KP; // (BK, KP) values
    uint16_t *Kt = Vs + BK * KP; // (D, TP) keys transposed
    __shared__ int km[BK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int qt = (int)gridDim.x - 1 - (int)blockIdx.x; /* causal: the heaviest tiles start first */
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.rep;
    const int q0 = qt * BQ, qn = p.Tq - q0 < BQ ? p.Tq - q0 : BQ;
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    fl_cu_tc_load<D, BQ>(Qs, KP, NULL, 0, p.q + ((size_t)b * p.Tq + q0) * p.ldq + (size_t)h * D, p.ldq, qn);
    fl_cu_tc_load<D, BQ>(Gs, KP, NULL, 0, p.dout + ((size_t)b * p.Tq + q0) * p.ldo + (size_t)h * D, p.ldo, qn);
    const size_t lrow = ((size_t)b * p.NH + h) * p.Tq + q0;
    const float L0 = r0 < qn ? p.lse[lrow + r0] * FL_CU_LOG2E : 0.0f, L1 = r1 < qn ? p.lse[lrow + r1] * FL_CU_LOG2E : 0.0f;
    const float D0 = r0 < qn ? p.Dsum[lrow + r0] : 0.0f, D1 = r1 < qn ? p.Dsum[lrow + r1] : 0.0f;
    const int lim0 = r0 < qn ? fl_cu_attn_key_limit(p, q0 + r0) : 0, lim1 = r1 < qn ? fl_cu_attn_key_limit(p, q0 + r1) : 0;
    const int kend = fl_cu_attn_key_limit(p, q0 + qn - 1);
    const int wlast = warp * 16 + 15 < qn ? warp * 16 + 15 : qn - 1;
    const int wend = wlast >= warp * 16 ? fl_cu_attn_key_limit(p, q0 + wlast) : 0;
    const float sl2 = p.scale * FL_CU_LOG2E;
    float acc[DT][4];
    for (int dt = 0; dt < DT; dt++)
        for (int i = 0; i < 4; i++) acc[dt][i] = 0.0f;
    const fl_cu_fptr K = p.k + (size_t)b * p.Tk * p.ldk + (size_t)kvh * D; // (Tk, D) stride ldk
    const fl_cu_fptr V = p.v + (size_t)b * p.Tk * p.ldv + (size_t)kvh * D; // (Tk, D) stride ldv
    for (int k0 = 0; k0 < kend; k0 += BK) {
        const int kn = kend - k0 < BK ? kend - k0 : BK;
        __syncthreads(); /* the previous tile's Ks / Vs / Kt are read */
        fl_cu_tc_load<D, BK>(Ks, KP, Kt, TP, K + (size_t)k0 * p.ldk, p.ldk, kn);
        fl_cu_tc_load<D, BK>(Vs, KP, NULL, 0, V + (size_t)k0 * p.ldv, p.ldv, kn);
        for (int j = threadIdx.x; j < BK; j += FL_CU_TC_THREADS)
            km[j] = j < kn && (!p.kmask || p.kmask[(size_t)b * p.Tk + k0 + j]);
        __syncthreads(); /* also: Qs / Gs written (first tile) */
        if (k0 >= wend) continue; /* no row of this warp sees the tile (warp-uniform) */
        float s[NT][4], dp[NT][4];
        for (int nt = 0; nt < NT; nt++)
            for (int i = 0; i < 4; i++) s[nt][i] = dp[nt][i] = 0.0f;
        for (int kk = 0; kk < DK; kk++) { /* the warp's Q / dO fragments once per k-step */
            uint32_t qa[4], ga[4];
            fl_cu_tc_frag_a(qa, Qs, KP, warp * 16, kk * 16);
            fl_cu_tc_frag_a(ga, Gs, KP, warp * 16, kk * 16);
            for (int nt = 0; nt < NT; nt++) {
                uint32_t bf[2];
                fl_cu_tc_frag_b(bf, Ks, KP, nt * 8, kk * 16);
                fl_cu_mma_bf16_16816(s[nt], qa, bf, s[nt]);
                fl_cu_tc_frag_b(bf, Vs, KP, nt * 8, kk * 16);
                fl_cu_mma_bf16_16816(dp[nt], ga, bf, dp[nt]);
            }
        }
        for (int nt = 0; nt < NT; nt++)
            for (int i = 0; i < 4; i++) {
                const int j = nt * 8 + 2 * tq + (i & 1);
                float ds = 0.0f;
                if (km[j] && k0 + j < (i < 2 ? lim0 : lim1)) {
                    const float pv = exp2f(s[nt][i] * sl2 - (i < 2 ? L0 : L1));
                    ds = pv * (dp[nt][i] - (i < 2 ? D0 : D1));
                }
                dp[nt][i] = ds;
            }
        for (int kk = 0; kk < PK; kk++) {
            uint32_t da[4];
            fl_cu_tc_acc_to_a(da, dp[2 * kk], dp[2 * kk + 1]);
            for (int dt = 0; dt < DT; dt++) {
                uint32_t bf[2];
                fl_cu_tc_frag_b(bf, Kt, TP, dt * 8, kk * 16);
                fl_cu_mma_bf16_16816(acc[dt], da, bf, acc[dt]);
            }
        }
    }
    float *dQ = p.dq + ((size_t)b * p.Tq + q0) * p.ldq + (size_t)h * D;
    for (int dt = 0; dt < DT; dt++) {
        const int d = dt * 8 + 2 * tq;
        for (int i = 0; i < 4; i++) {
            const int r = i < 2 ? r0 : r1;
            if (r < qn) dQ[(size_t)r * p.ldq + d + (i & 1)] += p.scale * acc[dt][i];
        }
    }
}

/* ---- launchers -------------------------------------------------------------------------------- */

template <int D> static int fl_cu_tc_fwd_launch(const fl_cu_attn_p &p, void *stream) {
    enum { BK = fl_cu_tc_cfg<D>::FBK };
    const size_t smem = 2 * ((size_t)BK * (D + FL_CU_TC_PAD) + (size_t)D * (BK + FL_CU_TC_PAD));
    if (FL_CU_SMEM_OPTIN(fl_cu_tc_fwd_k<D>, smem)) return fl_cu_launch_error();
    dim3 grid((unsigned)((p.Tq + 63) / 64), (unsigned)p.NH, (unsigned)p.B);
    FL_CU_LAUNCH(fl_cu_tc_fwd_k<D>, grid, dim3(FL_CU_TC_THREADS), smem, (fl_cu_stream)stream, p);
    return fl_cu_launch_error();
}

template <int D> static int fl_cu_tc_bwd_launch(const fl_cu_attn_p &p, void *stream) {
    enum { KBQ = fl_cu_tc_cfg<D>::KBQ, QBK = fl_cu_tc_cfg<D>::QBK, KP = D + FL_CU_TC_PAD };
    int rc = fl_cu_attn_dsum_launch(p, stream);
    if (rc) return rc;
    if (p.Tk > 0) {
        const size_t smem = 2 * (2 * (size_t)64 * KP + 2 * (size_t)KBQ * KP + 2 * (size_t)D * (KBQ + FL_CU_TC_PAD));
        if (FL_CU_SMEM_OPTIN(fl_cu_tc_dkdv_k<D>, smem)) return fl_cu_launch_error();
        dim3 grid((unsigned)((p.Tk + 63) / 64), (unsigned)p.NKV, (unsigned)p.B);
        FL_CU_LAUNCH(fl_cu_tc_dkdv_k<D>, grid, dim3(FL_CU_TC_THREADS), smem, (fl_cu_stream)stream, p);
        if ((rc = fl_cu_launch_error())) return rc;
    }
    const size_t smem = 2 * (2 * (size_t)64 * KP + 2 * (size_t)QBK * KP + (size_t)D * (QBK + FL_CU_TC_PAD));
    if (FL_CU_SMEM_OPTIN(fl_cu_tc_dq_k<D>, smem)) return fl_cu_launch_error();
    dim3 grid((unsigned)((p.Tq + 63) / 64), (unsigned)p.NH, (unsigned)p.B);
    FL_CU_LAUNCH(fl_cu_tc_dq_k<D>, grid, dim3(FL_CU_TC_THREADS), smem, (fl_cu_stream)stream, p);
    return fl_cu_launch_error();
}

static int tc_fwd(const fl_attn_desc *a, float *out, void *out16, float *lse, const void *q, const void *k,
                  const void *v, const uint8_t *kmask, int in16, void *stream) {
    fl_cu_attn_p p;
    int rc = fl_cu_attn_fwd_setup(&p, a, out, out16, lse, q, k, v, NULL, kmask, 1, in16);
    if (rc) return rc < 0 ? rc : 0;
    return a->HD == 64 ? fl_cu_tc_fwd_launch<64>(p, stream) : fl_cu_tc_fwd_launch<128>(p, stream);
}
extern "C" int FL_CUK(attention_forward_tc)(const fl_attn_desc *a, float *out, void *out16, float *lse,
                                            const float *q, const float *k, const float *v, const uint8_t *kmask, void *stream) {
    return tc_fwd(a, out, out16, lse, q, k, v, kmask, 0, stream);
}
extern "C" int FL_CUK(attention_forward_tc16)(const fl_attn_desc *a, float *out, void *out16, float *lse,
                                              const void *q16, const void *k16, const void *v16, const uint8_t *kmask,
                                              void *stream) {
    return tc_fwd(a, out, out16, lse, q16, k16, v16, kmask, 1, stream);
}

/* in16: q, k, v and out bf16 (attention_backward_tc16) */
static int tc_bwd(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, const void *q,
                  const void *k, const void *v, const uint8_t *kmask, const void *out, const float *lse, void *work,
                  int in16, void *stream) {
    fl_cu_attn_p p;
    int rc = fl_cu_attn_bwd_setup(&p, a, dq, dk, dv, NULL, dout, q, k, v, NULL, kmask, out, lse, work, 1, in16);
    if (rc) return rc < 0 ? rc : 0;
    return a->HD == 64 ? fl_cu_tc_bwd_launch<64>(p, stream) : fl_cu_tc_bwd_launch<128>(p, stream);
}
extern "C" int FL_CUK(attention_backward_tc)(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout,
                                             const float *q, const float *k, const float *v, const uint8_t *kmask,
                                             const float *out, const float *lse, void *work, void *stream) {
    return tc_bwd(a, dq, dk, dv, dout, q, k, v, kmask, out, lse, work, 0, stream);
}
extern "C" int FL_CUK(attention_backward_tc16)(const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                               const float *dout, const void *q16, const void *k16, const void *v16,
                                               const uint8_t *kmask, const void *out16, const float *lse, void *work,
                                               void *stream) {
    return tc_bwd(a, dq, dk, dv, dout, q16, k16, v16, kmask, out16, lse, work, 1, stream);
}

/* ---- the mma check: one warp, D = A B + C with the fragments loaded per cu_mma.h's table --------- */

__global__ static void fl_cu_mma_check_k(float *d, const uint16_t *A, const uint16_t *B, const float *C) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint32_t a[4], b[2];
    float c[4], o[4];
    for (int i = 0; i < 4; i++) {
        const int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1); /* a[1]: row + 8; a[2]: col + 8 */
        a[i] = (uint32_t)A[row * 16 + col] | ((uint32_t)A[row * 16 + col + 1] << 16);
    }
    for (int i = 0; i < 2; i++) {
        const int kr = 2 * t + 8 * i; /* B is (16 k, 8 n) row-major here */
        b[i] = (uint32_t)B[kr * 8 + g] | ((uint32_t)B[(kr + 1) * 8 + g] << 16);
    }
    for (int i = 0; i < 4; i++) c[i] = C[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
    fl_cu_mma_bf16_16816(o, a, b, c);
    for (int i = 0; i < 4; i++) d[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = o[i];
}

extern "C" int FL_CUK(mma_bf16_check)(float *d, const uint16_t *a, const uint16_t *b, const float *c, void *stream) {
    FL_CU_LAUNCH(fl_cu_mma_check_k, dim3(1), dim3(32), 0, (fl_cu_stream)stream, d, a, b, c);
    return fl_cu_launch_error();
}
