/* FlashAttention-2-structured tensor-core attention ("own" kernels, FITLLM_CUDA_ATTN=own, the
 * default for bf16 runs): the semantics and roundings of attention_tc.cu (bf16 operands Q, K, V,
 * P, dO, dS; fp32 scores, online softmax, lse, accumulators), no bias; HD 64, or any even HD in (64, 128] run by the
 * 128 tiles with the head zero-padded (loads zero its columns >= HD, stores skip them: the padding adds exact zeros
 * to every product, so the semantics are those of the tc kernels at HD).
 * EXPERIMENTAL: verified under the CUDA emulator and compiled for sm_90; not yet timed on a GPU.
 *
 * What differs from attention_tc.cu (the "legacy" tensor-core kernels):
 *  - every fragment comes from row-major bf16 tiles through ldmatrix (x4: one instruction per A
 *    fragment or per two B fragments), the transposed operands (V in O = P V; Q, dO in dK, dV;
 *    K in dQ) through ldmatrix.trans: no transposed shared-memory copies;
 *  - forward, HD 64: 128 query rows per block, 2 m-tiles per warp sharing each K / V fragment;
 *  - backward in one pass (FlashAttention-2's split): block = (64 keys, kv head, batch), warp per
 *    16 keys; per query head of the group and query tile, S^T and dP^T by mma, P^T and dS^T once,
 *    dV += P^T dO and dK += dS^T Q in registers, dS^T to shared memory, then the block's dQ
 *    contribution dS K by mma (warps split over query rows / dims) added to dq with atomicAdd.
 *    5 matmuls per tile pair instead of the legacy 7. dK / dV have one owner each (same bits
 *    every run); dq's fp32 adds across key blocks run in a varying order on a GPU (bits may
 *    differ run to run, as FlashAttention-2's and PyTorch's); the emulator runs blocks in order.
 * Causal: query tiles before a key block's first visible row are never visited, key tiles past a
 * block's last visible key never loaded; a warp whose rows (keys) see nothing of a tile skips its
 * products. D = dO.O by fl_cu_attn_dsum_k (attn_common.h), from the fp32 out. */
#include "backend/cuda/kernels/attn_common.h"
#include "backend/cuda/kernels/attn_mma.h"

/* BQ: forward query rows per block (MT m-tiles per warp); BBQ: backward query-tile rows. */
template <int D_> struct fl_cu_fa_cfg;
template <> struct fl_cu_fa_cfg<64> {
    enum { D = 64, BQ = 128, MT = 2, BK = 64, BBQ = 64 };
};
template <> struct fl_cu_fa_cfg<128> {
    enum { D = 128, BQ = 64, MT = 1, BK = 64, BBQ = 32 };
};
/* The forward's query tile: EX kernels (a bias or dropout: their per-score registers) one m-tile per warp */
template <int D, int EX> struct fl_cu_fa_fcfg {
    enum { BQ = EX ? 64 : fl_cu_fa_cfg<D>::BQ, MT = EX ? 1 : fl_cu_fa_cfg<D>::MT };
};

/* ---- the tiles' loads ------------------------------------------------------------------------- */

/* Rows 0..n-1 of a (rows, hd) view of q, k, v (or dO) into a bf16 tile (pitch P), rows >= n and columns >= hd zero
 * (PADH: hd < D, a head size padded to the tile's D). vec (fl_cu_fa_vec): cp.async from a bf16 view, 128-bit loads
 * from an fp32 one, in chunks of 8 elements (every view 16-byte aligned with whole 16-byte row strides) or, PADH, of
 * 4 (hd % 4 == 0, rows 8- (bf16) or 16-byte (fp32) aligned); else fl_cu_tc_load's element pairs. The same bits every
 * way. */
template <int D, int R, int NTH = FL_CU_TC_THREADS, int PADH = 0>
FL_CU_DEV void fl_cu_fa_tile(uint16_t *dst, int P, fl_cu_fptr src, size_t ld, int n, int vec, int hd) {
    if (!PADH && vec && src.b16) fl_cu_tc_cp_tile<D, R, NTH>(dst, P, (const uint16_t *)src.p, ld, n);
    else if (!PADH && vec) fl_cu_tc_ld_tile32<D, R, NTH>(dst, P, (const float *)src.p, ld, n);
    else if (PADH && vec && src.b16) fl_cu_tc_cp8_tile<D, R, NTH>(dst, P, (const uint16_t *)src.p, ld, n, hd);
    else if (PADH && vec) fl_cu_tc_ld_tile32n<D, R, NTH>(dst, P, (const float *)src.p, ld, n, hd);
    else fl_cu_tc_load<D, R, NTH>(dst, P, NULL, 0, src, ld, n, PADH ? hd : D);
}

/* ---- forward ---------------------------------------------------------------------------------- */

/* Key tile k0 (kn keys) into a buffer of keys (BK, P) then values (BK, P), and its key mask. */
template <int D, int BK, int PADH>
FL_CU_DEV void fl_cu_fa_kv(const fl_cu_attn_p &p, uint16_t *buf, int *km, fl_cu_fptr K, fl_cu_fptr V, int k0, int kn,
                           int b) {
    enum { P = D + FL_CU_TC_PAD };
    fl_cu_fa_tile<D, BK, FL_CU_TC_THREADS, PADH>(buf, P, K + (size_t)k0 * p.ldk, p.ldk, kn, p.vq, p.HD);
    fl_cu_fa_tile<D, BK, FL_CU_TC_THREADS, PADH>(buf + BK * P, P, V + (size_t)k0 * p.ldv, p.ldv, kn, p.vq, p.HD);
    for (int j = threadIdx.x; j < BK; j += FL_CU_TC_THREADS)
        km[j] = j < kn && (!p.kmask || p.kmask[(size_t)b * p.Tk + k0 + j]);
}

/* One m-tile's online-softmax update for a key tile (FlashAttention-2's): the scores s (log2 units after scaling;
 * invisible ones -inf unless full: every one visible), the running max m and sum l of the lane's two rows, the
 * output accumulator o rescaled, and P = exp2(s - m) as the bf16 A fragments of P V. */
/* EX (fl_cu_fa_ex: a bias or dropout): bv, the bias of the lane's scores (natural units), joins the visible ones;
 * P V takes P times dropout's factors of rows t0 / t0 + 8 (global), l the softmax's own sum (the CPU's order). */
template <int NT, int DT, int EX>
FL_CU_DEV void fl_cu_fa_softmax(float (&s)[NT][4], float (&m_)[2], float (&l_)[2], float (&o)[DT][4],
                                uint32_t (&pa)[NT / 2][4], const int *kmc, int k0, const int (&lim)[2], int full,
                                float sl2, const float (&bv)[NT][4], const fl_cu_attn_p &p, int b, int h, int t0) {
    const int tq = threadIdx.x & 3;
    float mx[2] = {-INFINITY, -INFINITY};
    FL_CU_UNROLL
    for (int nt = 0; nt < NT; nt++)
        FL_CU_UNROLL
        for (int i = 0; i < 4; i++) {
            const int j = nt * 8 + 2 * tq + (i & 1), x = i >> 1;
            const int vis = full || (kmc[j] && k0 + j < lim[x]);
            if (EX && p.bias) s[nt][i] = vis ? s[nt][i] * sl2 + bv[nt][i] * FL_CU_LOG2E : -INFINITY;
            else s[nt][i] = vis ? s[nt][i] * sl2 : -INFINITY;
            mx[x] = fmaxf(mx[x], s[nt][i]);
        }
    float c[2], ps[2] = {0.0f, 0.0f};
    FL_CU_UNROLL
    for (int x = 0; x < 2; x++) {
        for (int off = 1; off < 4; off <<= 1) mx[x] = fmaxf(mx[x], __shfl_xor_sync(FL_CU_FULL_MASK, mx[x], off));
        const float mn = fmaxf(m_[x], mx[x]);
        /* nothing visible yet: the state stays (m = -inf, l = 0, o = 0) */
        c[x] = mn == -INFINITY ? 1.0f : exp2f(m_[x] - mn);
        m_[x] = mn;
    }
    FL_CU_UNROLL
    for (int nt = 0; nt < NT; nt++)
        FL_CU_UNROLL
        for (int i = 0; i < 4; i++) {
            const int x = i >> 1;
            const float pv = !full && s[nt][i] == -INFINITY ? 0.0f : exp2f(s[nt][i] - m_[x]);
            s[nt][i] = pv;
            ps[x] += pv;
            if (EX && p.drop_p > 0.0f) s[nt][i] = pv * fl_cu_attn_dropf(p, b, h, t0 + 8 * x, k0 + nt * 8 + 2 * tq + (i & 1));
        }
    FL_CU_UNROLL
    for (int x = 0; x < 2; x++) l_[x] = l_[x] * c[x] + ps[x];
    FL_CU_UNROLL
    for (int dt = 0; dt < DT; dt++)
        FL_CU_UNROLL
        for (int i = 0; i < 4; i++) o[dt][i] *= c[i >> 1];
    FL_CU_UNROLL
    for (int kk = 0; kk < NT / 2; kk++) fl_cu_tc_acc_to_a(pa[kk], s[2 * kk], s[2 * kk + 1]);
}

/* Key tiles double-buffered: tile i+1's copies (cp.async from a bf16 run's stored q|k|v) are issued before tile
 * i's products, and land while they run. A warp's m-tile whose rows all see all of a whole tile (no key mask,
 * below the causal diagonal) skips the per-element visibility tests (the same values: every score visible). */
template <int D, int PADH, int EX> __global__ static void fl_cu_fa_fwd_k(fl_cu_attn_p p) {
    enum { BQ = fl_cu_fa_fcfg<D, EX>::BQ, MT = fl_cu_fa_fcfg<D, EX>::MT, BK = fl_cu_fa_cfg<D>::BK,
           P = D + FL_CU_TC_PAD, NT = BK / 8, DT = D / 8, DK = D / 16, PK = BK / 16 };
    FL_CU_DYN_SMEM(uint16_t, sm);
    uint16_t *Qs = sm;            // (BQ, P) the query tile
    uint16_t *KVs = Qs + BQ * P;  // 2 buffers of (BK, P) keys then (BK, P) values (row-major: ldmatrix.trans
                                  // gives P V's B fragments)
    __shared__ int km[2][BK];     // key exists and is not padding
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int qt = (int)gridDim.x - 1 - (int)blockIdx.x; /* causal: the heaviest tiles start first */
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.rep;
    const int q0 = qt * BQ, qn = p.Tq - q0 < BQ ? p.Tq - q0 : BQ;
    const int hd = PADH ? p.HD : D; /* PADH: a head padded to D's tiles */
    fl_cu_fa_tile<D, BQ, FL_CU_TC_THREADS, PADH>(Qs, P, p.q + ((size_t)b * p.Tq + q0) * p.ldq + (size_t)h * hd, p.ldq, qn,
                                                 p.vq, hd);
    /* m-tile mt of the warp: rows w0 + 16 mt ..; lane rows r[mt][0] = .. + g, r[mt][1] = .. + g + 8 */
    const int w0 = warp * 16 * MT;
    int lim[MT][2], mend[MT], mfull[MT];
    FL_CU_UNROLL
    for (int mt = 0; mt < MT; mt++) {
        FL_CU_UNROLL
        for (int x = 0; x < 2; x++) {
            const int r = w0 + 16 * mt + g + 8 * x;
            lim[mt][x] = r < qn ? fl_cu_attn_key_limit(p, q0 + r) : 0;
        }
        const int first = w0 + 16 * mt, last = first + 15 < qn ? first + 15 : qn - 1;
        mend[mt] = last >= first ? fl_cu_attn_key_limit(p, q0 + last) : 0; /* keys the m-tile sees */
        /* keys every row of the m-tile sees (the first row's limit: the least), 0 with a padding row */
        mfull[mt] = first + 15 < qn && !p.kmask ? fl_cu_attn_key_limit(p, q0 + first) : 0;
    }
    const int kend = qn > 0 ? fl_cu_attn_key_limit(p, q0 + qn - 1) : 0;
    const float sl2 = p.scale * FL_CU_LOG2E; /* scores in log2 units: exp2f */
    float m_[MT][2], l_[MT][2], o[MT][DT][4];
    FL_CU_UNROLL
    for (int mt = 0; mt < MT; mt++) {
        m_[mt][0] = m_[mt][1] = -INFINITY;
        l_[mt][0] = l_[mt][1] = 0.0f;
        FL_CU_UNROLL
        for (int dt = 0; dt < DT; dt++)
            FL_CU_UNROLL
            for (int i = 0; i < 4; i++) o[mt][dt][i] = 0.0f;
    }
    const fl_cu_fptr K = p.k + (size_t)b * p.Tk * p.ldk + (size_t)kvh * hd;
    const fl_cu_fptr V = p.v + (size_t)b * p.Tk * p.ldv + (size_t)kvh * hd;
    const int nkt = (kend + BK - 1) / BK;
    if (nkt > 0) fl_cu_fa_kv<D, BK, PADH>(p, KVs, km[0], K, V, 0, kend < BK ? kend : BK, b);
    /* EX with a bias: its (h, row, key) entries of the lane's scores, loaded before the tile's products */
    const float *Bq = EX && p.bias ? p.bias + ((size_t)h * p.Tq + q0) * p.Tk : NULL;
    fl_cu_cp_commit(); /* the query tile and key tile 0 */
    for (int it = 0; it < nkt; it++) {
        const int k0 = it * BK, kn = kend - k0 < BK ? kend - k0 : BK, cur = it & 1;
        if (it + 1 < nkt) { /* into the buffer every warp finished with at the end of tile it - 1 */
            const int k1 = k0 + BK;
            fl_cu_fa_kv<D, BK, PADH>(p, KVs + (cur ^ 1) * 2 * BK * P, km[cur ^ 1], K, V, k1,
                                     kend - k1 < BK ? kend - k1 : BK, b);
        }
        fl_cu_cp_commit();
        fl_cu_cp_wait<1>(); /* all but the newest group: tile it (and the query tile) landed */
        __syncthreads();
        const uint16_t *Ks = KVs + cur * 2 * BK * P, *Vs = Ks + BK * P;
        const int *kmc = km[cur];
        if (k0 < mend[0] || k0 < mend[MT - 1]) { /* some row of this warp sees the tile */
            float s[MT][NT][4], bv[MT][NT][4];
            if (EX && Bq)
                FL_CU_UNROLL
                for (int mt = 0; mt < MT; mt++)
                    FL_CU_UNROLL
                    for (int nt = 0; nt < NT; nt++)
                        FL_CU_UNROLL
                        for (int i = 0; i < 4; i++) {
                            const int r = w0 + 16 * mt + g + 8 * (i >> 1), j = nt * 8 + 2 * tq + (i & 1);
                            bv[mt][nt][i] = r < qn && j < kn ? Bq[(size_t)r * p.Tk + k0 + j] : 0.0f;
                        }
            FL_CU_UNROLL
            for (int mt = 0; mt < MT; mt++)
                FL_CU_UNROLL
                for (int nt = 0; nt < NT; nt++)
                    FL_CU_UNROLL
                    for (int i = 0; i < 4; i++) s[mt][nt][i] = 0.0f;
            FL_CU_UNROLL
            for (int kk = 0; kk < DK; kk++) {
                uint32_t qa[MT][4];
                FL_CU_UNROLL
                for (int mt = 0; mt < MT; mt++) fl_cu_ldm_a(qa[mt], Qs, P, w0 + 16 * mt, kk * 16);
                FL_CU_UNROLL
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t bf[4];
                    fl_cu_ldm_b(bf, Ks, P, np * 16, kk * 16);
                    FL_CU_UNROLL
                    for (int mt = 0; mt < MT; mt++) {
                        if (k0 >= mend[mt]) continue; /* warp-uniform */
                        fl_cu_mma_pair(s[mt][2 * np], s[mt][2 * np + 1], qa[mt], bf);
                    }
                }
            }
            uint32_t pa[MT][PK][4];
            FL_CU_UNROLL
            for (int mt = 0; mt < MT; mt++) /* full: warp-uniform, every score of the m-tile visible */
                fl_cu_fa_softmax<NT, DT, EX>(s[mt], m_[mt], l_[mt], o[mt], pa[mt], kmc, k0, lim[mt],
                                             kn == BK && k0 + BK <= mfull[mt], sl2, bv[mt], p, b, h,
                                             q0 + w0 + 16 * mt + g);
            FL_CU_UNROLL
            for (int kk = 0; kk < PK; kk++)
                FL_CU_UNROLL
                for (int dp = 0; dp < DT / 2; dp++) {
                    uint32_t bf[4];
                    fl_cu_ldm_bt(bf, Vs, P, dp * 16, kk * 16);
                    FL_CU_UNROLL
                    for (int mt = 0; mt < MT; mt++) {
                        if (k0 >= mend[mt]) continue;
                        fl_cu_mma_pair(o[mt][2 * dp], o[mt][2 * dp + 1], pa[mt][kk], bf);
                    }
                }
        }
        __syncthreads(); /* every warp is done with buffer cur: tile it + 2 may go there */
    }
    fl_cu_cp_wait<0>(); /* no copy outlives the block (no key tile: the query tile's) */
    const size_t at = ((size_t)b * p.Tq + q0) * p.ldo + (size_t)h * hd;
    float *O = p.o ? p.o + at : NULL; /* NULL: the bf16 copy only */
    uint16_t *O16 = p.o16 ? p.o16 + at : NULL; /* bf16 stored: the output's copy too */
    float *L = p.l + ((size_t)b * p.NH + h) * p.Tq + q0;
    FL_CU_UNROLL
    for (int mt = 0; mt < MT; mt++)
        FL_CU_UNROLL
        for (int x = 0; x < 2; x++) {
            float l = l_[mt][x]; /* each lane holds a partial l of its own columns: the row's 4 lanes sum */
            for (int off = 1; off < 4; off <<= 1) l += __shfl_xor_sync(FL_CU_FULL_MASK, l, off);
            const int r = w0 + 16 * mt + g + 8 * x;
            if (r >= qn) continue;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f; /* no visible key: 0 */
            FL_CU_UNROLL
            for (int dt = 0; dt < DT; dt++) {
                const int d = dt * 8 + 2 * tq;
                if (PADH && d >= hd) continue; /* a padded head's zero columns (HD even: the pair's both) */
                const size_t i = (size_t)r * p.ldo + d;
                fl_cu_put16(O, O16, i, o[mt][dt][2 * x] * inv);
                fl_cu_put16(O, O16, i + 1, o[mt][dt][2 * x + 1] * inv);
            }
            if (tq == 0) L[r] = l > 0.0f ? m_[mt][x] * FL_CU_LN2 + logf(l) : -INFINITY;
        }
}

/* ---- backward: one pass, dQ by atomic adds ---------------------------------------------------- */

/* The block's dQ contribution of one query tile: dS (in dSs as (keys, queries) row-major) times K,
 * the block's BK / 16 warps split over the tile's m-tiles and, when there are more warps, over the dims. */
template <int D, int BQ, int BK, int PADH>
FL_CU_DEV void fl_cu_fa_dq_tile(const fl_cu_attn_p &p, const uint16_t *dSs, const uint16_t *Ks, float *dQ, int rn,
                                int hd) {
    enum { P = D + FL_CU_TC_PAD, SP = BQ + FL_CU_TC_PAD, MQ = BQ / 16, WPM = BK / 16 / MQ, NTW = D / 8 / WPM };
    static_assert(WPM * MQ == BK / 16 && NTW % 2 == 0, "the warps cover the tile's m-tiles and dims");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int mq = warp / WPM, n0 = (warp % WPM) * NTW * 8;
    float acc[NTW][4];
    FL_CU_UNROLL
    for (int nt = 0; nt < NTW; nt++)
        FL_CU_UNROLL
        for (int i = 0; i < 4; i++) acc[nt][i] = 0.0f;
    FL_CU_UNROLL
    for (int kk = 0; kk < BK / 16; kk++) {
        uint32_t a[4];
        fl_cu_ldm_at(a, dSs, SP, mq * 16, kk * 16);
        FL_CU_UNROLL
        for (int np = 0; np < NTW / 2; np++) {
            uint32_t bf[4];
            fl_cu_ldm_bt(bf, Ks, P, n0 + np * 16, kk * 16);
            fl_cu_mma_pair(acc[2 * np], acc[2 * np + 1], a, bf);
        }
    }
    FL_CU_UNROLL
    for (int nt = 0; nt < NTW; nt++)
        FL_CU_UNROLL
        for (int x = 0; x < 2; x++) {
            const int r = mq * 16 + g + 8 * x, d = n0 + nt * 8 + 2 * tq;
            if (r < rn && (!PADH || d < hd))
                fl_cu_atomic_add2(dQ + (size_t)r * p.ldq + d, p.scale * acc[nt][2 * x], p.scale * acc[nt][2 * x + 1],
                                  p.dq2);
        }
}

/* P^T = exp2(S^T - lse) and dS^T = P^T (dP^T - D) in place of S^T, dP^T (the warp's keys j0 / j1 against the tile's
 * rows), zero where a row does not see the key, unless full (every row sees every key of the warp).
 * EX (fl_cu_fa_ex): the bias of those scores (natural units, read here) joins S^T; with dropout's factors f of the forward's
 * (row t0 + r, key k0 + j) P^T becomes f P^T (dV's) and dS^T = P^T (f dP^T - D); dbias += dS^T in fp32 (p.dbias_walk:
 * one owner, the block walking the batch; else by atomics, as dq's). */
template <int NQ, int EX>
FL_CU_DEV void fl_cu_fa_pds(float (&s)[NQ][4], float (&dp)[NQ][4], const int *km, const int *lc, const float *Lc,
                            const float *Dc, int k0, int j0, int j1, float sl2, int full, const fl_cu_attn_p &p, int b,
                            int h, int t0) {
    const int tq = threadIdx.x & 3;
    /* element i of n-tile nt: key j0 (i < 2) or j1, query row nt*8 + 2tq + (i & 1) */
    FL_CU_UNROLL
    for (int nt = 0; nt < NQ; nt++)
        FL_CU_UNROLL
        for (int i = 0; i < 4; i++) {
            const int r = nt * 8 + 2 * tq + (i & 1), j = i < 2 ? j0 : j1;
            float pv = 0.0f, ds = 0.0f;
            if (full || (km[j] && k0 + j < lc[r])) {
                if (!EX) {
                    pv = exp2f(s[nt][i] * sl2 - Lc[r]);
                    ds = pv * (dp[nt][i] - Dc[r]);
                } else {
                    const size_t e = ((size_t)h * p.Tq + t0 + r) * p.Tk + k0 + j; /* bias / dbias entry */
                    pv = exp2f((p.bias ? s[nt][i] * sl2 + p.bias[e] * FL_CU_LOG2E : s[nt][i] * sl2) - Lc[r]);
                    if (p.drop_p > 0.0f) {
                        const float f = fl_cu_attn_dropf(p, b, h, t0 + r, k0 + j);
                        ds = pv * (dp[nt][i] * f - Dc[r]);
                        pv *= f;
                    } else {
                        ds = pv * (dp[nt][i] - Dc[r]);
                    }
                    if (p.dbias && p.dbias_walk) p.dbias[e] += ds;
                    else if (p.dbias) fl_cu_atomic_add(p.dbias + e, ds);
                }
            }
            s[nt][i] = pv;
            dp[nt][i] = ds;
        }
}

/* The row statistics of query tile t0 (rn rows) of head h into one buffer: lse (log2 units), D, key limits. */
template <int BQ, int NTH>
FL_CU_DEV void fl_cu_fa_rows(const fl_cu_attn_p &p, float *Ls, float *Ds, int *lims, int b, int h, int t0, int rn) {
    for (int r = threadIdx.x; r < BQ; r += NTH) {
        const size_t row = ((size_t)b * p.NH + h) * p.Tq + t0 + r;
        Ls[r] = r < rn ? p.lse[row] * FL_CU_LOG2E : 0.0f;
        Ds[r] = r < rn ? p.Dsum[row] : 0.0f;
        lims[r] = r < rn ? fl_cu_attn_key_limit(p, t0 + r) : 0;
    }
}

/* One batch element b of the block's keys (fl_cu_fa_bwd_k): the shared buffers and the block's registers start
 * afresh (the caller syncs between elements). */
template <int D, int BK, int PADH, int EX>
FL_CU_DEV void fl_cu_fa_bwd_b(const fl_cu_attn_p &p, int b, uint16_t *sm, float (&Ls)[2][fl_cu_fa_cfg<D>::BBQ],
                              float (&Ds)[2][fl_cu_fa_cfg<D>::BBQ], int (&lims)[2][fl_cu_fa_cfg<D>::BBQ],
                              int (&km)[BK]) {
    enum { NTH = 2 * BK, BQ = fl_cu_fa_cfg<D>::BBQ, P = D + FL_CU_TC_PAD, SP = BQ + FL_CU_TC_PAD, NQ = BQ / 8,
           DT = D / 8, DK = D / 16, QK = BQ / 16, GI = BQ * (D / 8) / NTH, PF = D == 64 && !EX };
    uint16_t *Ks = sm;               // (BK, P) keys
    uint16_t *Vs = Ks + BK * P;      // (BK, P) values
    uint16_t *Q2 = Vs + BK * P;      // 2 x (BQ, P) query tiles
    uint16_t *G2 = Q2 + 2 * BQ * P;  // 2 x (BQ, P) their dO
    uint16_t *dSs = G2 + 2 * BQ * P; // (BK, SP) dS^T: keys x query rows
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int kvh = blockIdx.y;
    const int k0 = blockIdx.x * BK, kn = p.Tk - k0 < BK ? p.Tk - k0 : BK;
    const int hd = PADH ? p.HD : D; /* PADH: a head padded to D's tiles */
    /* dO's vector loads (p.vo), except in a padded head's 64-key blocks: there its chunks of 4 beside Q's 8-byte
     * cp.async need more than the 255 registers (ptxas spills; element pairs, the same bits) */
    const int vo = PADH && BK == 64 ? 0 : p.vo;
    fl_cu_fa_tile<D, BK, NTH, PADH>(Ks, P, p.k + ((size_t)b * p.Tk + k0) * p.ldk + (size_t)kvh * hd, p.ldk, kn, p.vq, hd);
    fl_cu_fa_tile<D, BK, NTH, PADH>(Vs, P, p.v + ((size_t)b * p.Tk + k0) * p.ldv + (size_t)kvh * hd, p.ldv, kn, p.vq, hd);
    for (int j = threadIdx.x; j < BK; j += NTH)
        km[j] = j < kn && (!p.kmask || p.kmask[(size_t)b * p.Tk + k0 + j]);
    const int kw = warp * 16; /* the warp's keys kw..kw+15 of the tile */
    const int j0 = kw + g, j1 = j0 + 8;
    const int wfirst = fl_cu_attn_first_row(p, k0 + kw); /* the first row that sees any of them */
    const float sl2 = p.scale * FL_CU_LOG2E;
    float ak[DT][4], av[DT][4];
    FL_CU_UNROLL
    for (int dt = 0; dt < DT; dt++)
        FL_CU_UNROLL
        for (int i = 0; i < 4; i++) ak[dt][i] = av[dt][i] = 0.0f;
    int tstart = fl_cu_attn_first_row(p, k0);
    if (p.dq_lock) tstart -= tstart % BQ; /* deterministic dq: tiles at multiples of BQ, one counter each */
    const int ntiles = (p.Tq + BQ - 1) / BQ;
    /* pair i: query head kvh rep + i / nth, tile tstart + (i % nth) BQ */
    const int nth = tstart < p.Tq ? (p.Tq - tstart + BQ - 1) / BQ : 0, npair = p.rep * nth;
    const size_t qrow = (size_t)b * p.Tq;
    if (npair > 0) {
        const int h = kvh * p.rep, rn = p.Tq - tstart < BQ ? p.Tq - tstart : BQ;
        fl_cu_fa_tile<D, BQ, NTH, PADH>(Q2, P, p.q + (qrow + tstart) * p.ldq + (size_t)h * hd, p.ldq, rn, p.vq, hd);
        const fl_cu_fptr G0 = fl_cu_fptr(p.dout + (qrow + tstart) * p.ldo + (size_t)h * hd);
        fl_cu_fa_tile<D, BQ, NTH, PADH>(G2, P, G0, p.ldo, rn, vo, hd);
        fl_cu_fa_rows<BQ, NTH>(p, Ls[0], Ds[0], lims[0], b, h, tstart, rn);
    }
    fl_cu_cp_commit(); /* K, V and pair 0's Q */
    for (int pi = 0; pi < npair; pi++) {
        const int cur = pi & 1, h = kvh * p.rep + pi / nth, t0 = tstart + (pi % nth) * BQ;
        const int rn = p.Tq - t0 < BQ ? p.Tq - t0 : BQ;
        float gx[PF ? GI : 1][8]; /* pair pi + 1's dO in flight (PF) */
        if (pi + 1 < npair) { /* into the buffers every warp finished with in pair pi - 1 */
            const int h1 = kvh * p.rep + (pi + 1) / nth, t1 = tstart + ((pi + 1) % nth) * BQ;
            const int rn1 = p.Tq - t1 < BQ ? p.Tq - t1 : BQ;
            fl_cu_fa_tile<D, BQ, NTH, PADH>(Q2 + (cur ^ 1) * BQ * P, P, p.q + (qrow + t1) * p.ldq + (size_t)h1 * hd,
                                            p.ldq, rn1, p.vq, hd);
            if (PF && p.vo)
                fl_cu_tc_ld32_regs<D, BQ, PF ? GI : 1, NTH>(gx, 0, p.dout + (qrow + t1) * p.ldo + (size_t)h1 * hd,
                                                           p.ldo, rn1);
        }
        fl_cu_cp_commit();
        fl_cu_cp_wait<1>(); /* all but the newest group: K, V and pair pi's Q landed */
        __syncthreads();
        const uint16_t *Qs = Q2 + cur * BQ * P, *Gs = G2 + cur * BQ * P;
        const float *Lc = Ls[cur], *Dc = Ds[cur];
        const int *lc = lims[cur];
        float s[NQ][4], dp[NQ][4];
        FL_CU_UNROLL
        for (int nt = 0; nt < NQ; nt++)
            FL_CU_UNROLL
            for (int i = 0; i < 4; i++) s[nt][i] = dp[nt][i] = 0.0f;
        /* warp-uniform: keys past the tile end, or no row of the tile sees them: dS^T = 0 */
        const int active = kw < kn && t0 + rn > wfirst;
        if (active) {
            FL_CU_UNROLL
            for (int kk = 0; kk < DK; kk++) { /* S^T = K Q^T, dP^T = V dO^T */
                uint32_t ka[4], va[4];
                fl_cu_ldm_a(ka, Ks, P, kw, kk * 16);
                fl_cu_ldm_a(va, Vs, P, kw, kk * 16);
                FL_CU_UNROLL
                for (int np = 0; np < NQ / 2; np++) {
                    uint32_t bf[4];
                    fl_cu_ldm_b(bf, Qs, P, np * 16, kk * 16);
                    fl_cu_mma_pair(s[2 * np], s[2 * np + 1], ka, bf);
                    fl_cu_ldm_b(bf, Gs, P, np * 16, kk * 16);
                    fl_cu_mma_pair(dp[2 * np], dp[2 * np + 1], va, bf);
                }
            }
            /* every row sees the warp's 16 keys: the first row's limit is the least */
            fl_cu_fa_pds<NQ, EX>(s, dp, km, lc, Lc, Dc, k0, j0, j1, sl2,
                                 !p.kmask && kw + 16 <= kn && rn == BQ && lc[0] >= k0 + kw + 16, p, b, h, t0);
            FL_CU_UNROLL
            for (int kk = 0; kk < QK; kk++) { /* dV += P^T dO, dK += dS^T Q */
                uint32_t pa[4], da[4];
                fl_cu_tc_acc_to_a(pa, s[2 * kk], s[2 * kk + 1]);
                fl_cu_tc_acc_to_a(da, dp[2 * kk], dp[2 * kk + 1]);
                FL_CU_UNROLL
                for (int np = 0; np < DT / 2; np++) {
                    uint32_t bf[4];
                    fl_cu_ldm_bt(bf, Gs, P, np * 16, kk * 16);
                    fl_cu_mma_pair(av[2 * np], av[2 * np + 1], pa, bf);
                    fl_cu_ldm_bt(bf, Qs, P, np * 16, kk * 16);
                    fl_cu_mma_pair(ak[2 * np], ak[2 * np + 1], da, bf);
                }
            }
        }
        /* dS^T (bf16, as the A operand above) to shared memory: rows j0 / j1, query pairs */
        FL_CU_UNROLL
        for (int nt = 0; nt < NQ; nt++) {
            const int c = nt * 8 + 2 * tq;
            *reinterpret_cast<uint32_t *>(dSs + j0 * SP + c) = fl_cu_pack_bf16(dp[nt][0], dp[nt][1]);
            *reinterpret_cast<uint32_t *>(dSs + j1 * SP + c) = fl_cu_pack_bf16(dp[nt][2], dp[nt][3]);
        }
        __syncthreads(); /* dS^T of every warp; every warp is done with pair pi - 1's buffers long since */
        int *lock = p.dq_lock ? p.dq_lock + ((size_t)b * p.NH + h) * ntiles + t0 / BQ : NULL;
        if (lock) fl_cu_dq_wait(lock, (int)blockIdx.x); /* key blocks 0..x-1 all visit this tile */
        fl_cu_fa_dq_tile<D, BQ, BK, PADH>(p, dSs, Ks, p.dq + (qrow + t0) * p.ldq + (size_t)h * hd, rn, hd);
        if (lock) fl_cu_dq_post(lock);
        if (pi + 1 < npair) { /* pair pi + 1's dO and row statistics into the other buffers */
            const int h1 = kvh * p.rep + (pi + 1) / nth, t1 = tstart + ((pi + 1) % nth) * BQ;
            const int rn1 = p.Tq - t1 < BQ ? p.Tq - t1 : BQ;
            uint16_t *Gn = G2 + (cur ^ 1) * BQ * P;
            if (PF && p.vo) fl_cu_tc_st32_regs<D, BQ, PF ? GI : 1, NTH>(Gn, P, gx, 0);
            else fl_cu_fa_tile<D, BQ, NTH, PADH>(Gn, P, fl_cu_fptr(p.dout + (qrow + t1) * p.ldo + (size_t)h1 * hd), p.ldo,
                                                 rn1, vo, hd);
            fl_cu_fa_rows<BQ, NTH>(p, Ls[cur ^ 1], Ds[cur ^ 1], lims[cur ^ 1], b, h1, t1, rn1);
        }
    }
    fl_cu_cp_wait<0>();
    float *dK = p.dk + ((size_t)b * p.Tk + k0) * p.ldk + (size_t)kvh * hd;
    float *dV = p.dv + ((size_t)b * p.Tk + k0) * p.ldv + (size_t)kvh * hd;
    FL_CU_UNROLL
    for (int dt = 0; dt < DT; dt++) {
        const int d = dt * 8 + 2 * tq;
        if (PADH && d >= hd) continue; /* a padded head's zero columns */
        FL_CU_UNROLL
        for (int i = 0; i < 4; i++) {
            const int j = i < 2 ? j0 : j1;
            if (j >= kn) continue;
            dK[(size_t)j * p.ldk + d + (i & 1)] += p.scale * ak[dt][i];
            dV[(size_t)j * p.ldv + d + (i & 1)] += av[dt][i];
        }
    }
}

/* The block walks its (query head, query tile) pairs as one sequence, double-buffered: pair i+1's Q tile is
 * issued (cp.async from a bf16 run's stored q) and, at HD 64 with an aligned dO, its dO tile's fp32 loads are in
 * registers (PF) before pair i's products; dO is packed and the row statistics stored after them. A warp whose
 * 16 keys every row of the tile sees (no key mask, below the causal diagonal) skips the visibility tests.
 * EX with dbias under FL_CU_FA2_DET (p.dbias_walk): the block walks the batch (grid z 1), so every dbias element has
 * one owner (plain adds in batch order: the same bits every run); else batch element blockIdx.z (dbias by atomics). */
template <int D, int BK, int PADH, int EX> __global__ static void fl_cu_fa_bwd_k(fl_cu_attn_p p) {
    enum { BQ = fl_cu_fa_cfg<D>::BBQ };
    FL_CU_DYN_SMEM(uint16_t, sm);
    __shared__ float Ls[2][BQ], Ds[2][BQ]; // lse (log2 units), D of the tile's rows
    __shared__ int lims[2][BQ];            // one past each row's last visible key (0: padding row)
    __shared__ int km[BK];
    if (!EX || !p.dbias_walk)
        fl_cu_fa_bwd_b<D, BK, PADH, EX>(p, (int)blockIdx.z, sm, Ls, Ds, lims, km);
    else
        for (int b = 0; b < p.B; b++) {
            if (b) __syncthreads(); /* every warp done with the previous element's tiles */
            fl_cu_fa_bwd_b<D, BK, PADH, EX>(p, b, sm, Ls, Ds, lims, km);
        }
}

/* ---- launchers -------------------------------------------------------------------------------- */

template <int D, int PADH, int EX> static int fl_cu_fa_fwd_launch(const fl_cu_attn_p &p, void *stream) {
    enum { BQ = fl_cu_fa_fcfg<D, EX>::BQ, BK = fl_cu_fa_cfg<D>::BK, P = D + FL_CU_TC_PAD };
    const size_t smem = 2 * ((size_t)BQ * P + 4 * (size_t)BK * P); /* bf16: Qs, 2 x (Ks, Vs) */
    if (FL_CU_SMEM_OPTIN((fl_cu_fa_fwd_k<D, PADH, EX>), smem)) return fl_cu_launch_error();
    dim3 grid((unsigned)((p.Tq + BQ - 1) / BQ), (unsigned)p.NH, (unsigned)p.B);
    FL_CU_LAUNCH((fl_cu_fa_fwd_k<D, PADH, EX>), grid, dim3(FL_CU_TC_THREADS), smem, (fl_cu_stream)stream, p);
    return fl_cu_launch_error();
}

__global__ static void fl_cu_fa_zero_k(int *x, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) x[i] = 0;
}

/* FL_CU_FA_NO_SMEM (nothing launched) when the device refuses the 128-key blocks' shared memory (HD 128: 115 KB,
 * over the 99 KB of sm_86/89): the caller runs the 64-key blocks then. Else 0 or a CUDA error. */
#define FL_CU_FA_NO_SMEM (-100)
template <int D, int BK, int PADH, int EX> static int fl_cu_fa_bwd_launch(const fl_cu_attn_p &p, void *stream) {
    enum { BQ = fl_cu_fa_cfg<D>::BBQ, P = D + FL_CU_TC_PAD };
    /* bf16: Ks, Vs, 2 x (Qs, Gs), dS^T */
    const size_t smem = 2 * (2 * (size_t)BK * P + 4 * (size_t)BQ * P + (size_t)BK * (BQ + FL_CU_TC_PAD));
    if (FL_CU_SMEM_OPTIN((fl_cu_fa_bwd_k<D, BK, PADH, EX>), smem)) {
        const int rc = fl_cu_launch_error(); /* (consumed) */
        return BK > 64 ? FL_CU_FA_NO_SMEM : rc;
    }
    int rc = fl_cu_attn_dsum_launch(p, stream);
    if (rc || p.Tk == 0) return rc;
    if (p.dq_lock) {
        const size_t n = (size_t)p.B * p.NH * ((p.Tq + BQ - 1) / BQ);
        FL_CU_LAUNCH(fl_cu_fa_zero_k, dim3((unsigned)((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024)), dim3(256), 0,
                     (fl_cu_stream)stream, p.dq_lock, n);
        if ((rc = fl_cu_launch_error())) return rc;
    }
    /* EX with dbias, deterministic: a block walks the batch (one owner per dbias element) */
    dim3 grid((unsigned)((p.Tk + BK - 1) / BK), (unsigned)p.NKV, (unsigned)(EX && p.dbias_walk ? 1 : p.B));
    FL_CU_LAUNCH((fl_cu_fa_bwd_k<D, BK, PADH, EX>), grid, dim3(2 * BK), smem, (fl_cu_stream)stream, p);
    return fl_cu_launch_error();
}

/* The vector paths' conditions (p.vq, p.vo, p.dq2): base pointers aligned and row strides whole 16-byte (dq: 8-byte)
 * units, so that every row (and head: HD is 64 or 128) starts aligned; for a padded head, chunks of 4 elements
 * (8 bytes bf16, 16 fp32). Otherwise the element-pair loads: the same bits (tests/test_cuda_attn_paths.c). */
/* a head size the kernels pad to their 128 tiles (fl_cu_attention_fa2_supported's sizes but 64 and 128) */
static int fl_cu_fa_padded(int HD) { return HD != 64 && HD != 128; }

static void fl_cu_fa_vec(fl_cu_attn_p *p, int in16) {
    if (!fl_cu_fa_padded(p->HD)) { /* whole 16-byte chunks of 8 elements */
        const size_t e = in16 ? 8 : 4; /* elements per 16 bytes */
        p->vq = fl_cu_aligned16(p->q.p, p->k.p, p->v.p, NULL, NULL) && p->ldq % e == 0 && p->ldk % e == 0 &&
                p->ldv % e == 0;
        p->vo = p->dout && fl_cu_aligned16(p->dout, NULL, NULL, NULL, NULL) && p->ldo % 4 == 0;
    } else { /* chunks of 4 elements, rows 8- (bf16) / 16-byte (fp32) aligned when the views are and HD, the strides
              * are multiples of 4 (head h starts h HD on) */
        const uintptr_t m = (uintptr_t)p->q.p | (uintptr_t)p->k.p | (uintptr_t)p->v.p;
        p->vq = p->HD % 4 == 0 && m % (in16 ? 8u : 16u) == 0 && p->ldq % 4 == 0 && p->ldk % 4 == 0 && p->ldv % 4 == 0;
        p->vo = p->dout && p->HD % 4 == 0 && fl_cu_aligned16(p->dout, NULL, NULL, NULL, NULL) && p->ldo % 4 == 0;
    }
    p->dq2 = p->dq && ((uintptr_t)p->dq & 7u) == 0 && p->ldq % 2 == 0;
}

/* ex (fl_cu_fa_ex): a bias or dropout, HD 64 / 128 only (fl_cu_attention_fa2_supported) */
static int fl_cu_fa_ex(const fl_attn_desc *a, const float *bias) { return bias || a->drop_p > 0.0f; }

/* in16: q, k, v bf16 (no bias then: the setup refuses it) */
static int fa_fwd(const fl_attn_desc *a, float *out, void *out16, float *lse, const void *q, const void *k,
                  const void *v, const float *bias, const uint8_t *kmask, int in16, void *stream) {
    fl_cu_attn_p p;
    int rc = fl_cu_attn_fwd_setup(&p, a, out, out16, lse, q, k, v, bias, kmask, 2, in16);
    if (rc) return rc < 0 ? rc : 0;
    fl_cu_fa_vec(&p, in16);
    if (fl_cu_fa_ex(a, bias)) /* a bias or dropout: HD 64 or 128 */
        return a->HD == 64 ? fl_cu_fa_fwd_launch<64, 0, 1>(p, stream) : fl_cu_fa_fwd_launch<128, 0, 1>(p, stream);
    /* HD 64 / 128: their own tiles; another size (fl_cu_attention_fa2_supported) padded to 128's (PADH) */
    return a->HD == 64    ? fl_cu_fa_fwd_launch<64, 0, 0>(p, stream)
           : a->HD == 128 ? fl_cu_fa_fwd_launch<128, 0, 0>(p, stream)
                          : fl_cu_fa_fwd_launch<128, 1, 0>(p, stream);
}
extern "C" int FL_CUK(attention_forward_fa2)(const fl_attn_desc *a, float *out, void *out16, float *lse,
                                             const float *q, const float *k, const float *v, const uint8_t *kmask, void *stream) {
    return fa_fwd(a, out, out16, lse, q, k, v, NULL, kmask, 0, stream);
}
extern "C" int FL_CUK(attention_forward_fa2_b)(const fl_attn_desc *a, float *out, void *out16, float *lse,
                                               const float *q, const float *k, const float *v, const float *bias,
                                               const uint8_t *kmask, void *stream) {
    return fa_fwd(a, out, out16, lse, q, k, v, bias, kmask, 0, stream);
}
extern "C" int FL_CUK(attention_forward_fa2_16)(const fl_attn_desc *a, float *out, void *out16, float *lse,
                                                const void *q16, const void *k16, const void *v16,
                                                const uint8_t *kmask, void *stream) {
    return fa_fwd(a, out, out16, lse, q16, k16, v16, NULL, kmask, 1, stream);
}

extern "C" int FL_CUK(attention_backward_fa2)(const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                              const float *dout, const float *q, const float *k, const float *v,
                                              const uint8_t *kmask, const float *out, const float *lse, void *work,
                                              void *stream) {
    return FL_CUK(attention_backward_fa2_ex)(a, dq, dk, dv, dout, q, k, v, kmask, out, lse, work, 0, stream);
}

static int fa_bwd_run(const fl_cu_attn_p &p, int HD, int flags, void *stream) {
    int rc;
    /* a padded head: 128-key blocks unless 64 were asked for (their dO by element pairs: the registers) */
    if ((flags & FL_CU_FA2_BK128) || (fl_cu_fa_padded(HD) && !(flags & FL_CU_FA2_BK64))) {
        rc = HD == 64    ? fl_cu_fa_bwd_launch<64, 128, 0, 0>(p, stream)
             : HD == 128 ? fl_cu_fa_bwd_launch<128, 128, 0, 0>(p, stream)
                         : fl_cu_fa_bwd_launch<128, 128, 1, 0>(p, stream);
        if (rc != FL_CU_FA_NO_SMEM) return rc;
    }
    return HD == 64    ? fl_cu_fa_bwd_launch<64, 64, 0, 0>(p, stream)
           : HD == 128 ? fl_cu_fa_bwd_launch<128, 64, 0, 0>(p, stream)
                       : fl_cu_fa_bwd_launch<128, 64, 1, 0>(p, stream);
}
/* a bias or dropout (EX): HD 64 or 128, never padded; 128-key blocks at HD 64 only when asked for (HD 128's spill) */
static int fa_bwd_run_ex(const fl_cu_attn_p &p, int HD, int flags, void *stream) {
    if (HD == 64 && (flags & FL_CU_FA2_BK128)) {
        const int rc = fl_cu_fa_bwd_launch<64, 128, 0, 1>(p, stream);
        if (rc != FL_CU_FA_NO_SMEM) return rc;
    }
    return HD == 64 ? fl_cu_fa_bwd_launch<64, 64, 0, 1>(p, stream) : fl_cu_fa_bwd_launch<128, 64, 0, 1>(p, stream);
}

/* in16: q, k, v and out bf16 (attention_backward_fa2_16; no bias then) */
static int fa_bwd(const fl_attn_desc *a, float *dq, float *dk, float *dv, float *dbias, const float *dout,
                  const void *q, const void *k, const void *v, const float *bias, const uint8_t *kmask,
                  const void *out, const float *lse, void *work, int flags, int in16, void *stream) {
    fl_cu_attn_p p;
    int rc = fl_cu_attn_bwd_setup(&p, a, dq, dk, dv, dbias, dout, q, k, v, bias, kmask, out, lse, work, 2, in16);
    if (rc) return rc < 0 ? rc : 0;
    /* the counters after D's rows (work of fl_cu_attention_work_bytes_det) */
    if (flags & FL_CU_FA2_DET) p.dq_lock = (int *)(p.Dsum + (size_t)a->B * a->NH * a->Tq);
    p.dbias_walk = dbias && (flags & FL_CU_FA2_DET); /* else dbias by atomics over a block per batch element */
    fl_cu_fa_vec(&p, in16);
    return fl_cu_fa_ex(a, bias) ? fa_bwd_run_ex(p, a->HD, flags, stream) : fa_bwd_run(p, a->HD, flags, stream);
}
extern "C" int FL_CUK(attention_backward_fa2_ex)(const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                                 const float *dout, const float *q, const float *k, const float *v,
                                                 const uint8_t *kmask, const float *out, const float *lse, void *work,
                                                 int flags, void *stream) {
    return fa_bwd(a, dq, dk, dv, NULL, dout, q, k, v, NULL, kmask, out, lse, work, flags, 0, stream);
}
extern "C" int FL_CUK(attention_backward_fa2_b)(const fl_attn_desc *a, float *dq, float *dk, float *dv, float *dbias,
                                                const float *dout, const float *q, const float *k, const float *v,
                                                const float *bias, const uint8_t *kmask, const float *out,
                                                const float *lse, void *work, int flags, void *stream) {
    return fa_bwd(a, dq, dk, dv, dbias, dout, q, k, v, bias, kmask, out, lse, work, flags, 0, stream);
}
extern "C" int FL_CUK(attention_backward_fa2_16)(const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                                 const float *dout, const void *q16, const void *k16, const void *v16,
                                                 const uint8_t *kmask, const void *out16, const float *lse, void *work,
                                                 int flags, void *stream) {
    return fa_bwd(a, dq, dk, dv, NULL, dout, q16, k16, v16, NULL, kmask, out16, lse, work, flags, 1, stream);
}
