/* Causal grouped-query self-attention, flash-attention-2 style on the CPU.
 *
 * Layout: qkv rows (b,t) are [q (NH*HD) | k (NKV*HD) | v (NKV*HD)]; query head
 * h reads kv head h / (NH/NKV). Scores are scaled by 1/sqrt(HD).
 *
 * Forward: work item = (b, h, tile of BQ query rows). Keys are visited in tiles
 * of BK up to the diagonal; the query tile is transposed once into QsT (HD,BQ)
 * and each key tile's scores come out transposed, S^T = K (scale Q)^T, one
 * query row per vector lane, so the online softmax (running max m, running sum
 * l, rescaled accumulator O) has no horizontal sums; then O += P V. The (T,T)
 * score matrix never exists. We store lse = m + log(l).
 *
 * Backward: per key tile and block of BQ query rows, P = exp(S - lse) is
 * recomputed and
 *   D_t = dO_t . O_t,  dV_j += P^T dO,  dP = dO V^T,  dS = P o (dP - D),
 *   dQ += scale dS K,  dK_j += scale dS^T Q.
 * Every product is a tile product of fl_cpu_attn_mm (attn_mm.c: register tiles,
 * run-time dispatch, one multiply-add chain per element in a fixed order).
 * Every output element is owned by exactly one work item (no atomics, no
 * races) and summed in a fixed order, so the result is bit-identical for any
 * thread count; the two schedules (fused / split, see "backward" below) give
 * the same bits too.
 *
 * All buffers are fixed-size stack tiles (ops never allocate), sized for
 * HD <= FL_CPU_ATTN_MAX_HD. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define BK FL_CPU_ATTN_BK /* keys per tile; also query rows per block (tiles and blocks align) */
#define BQ BK             /* query rows per forward work item and per backward row block */
#define MAXHD FL_CPU_ATTN_MAX_HD

/* Transpose rows k0..k0+kn-1 of one head (row stride W) into Kt (HD, BK);
 * columns kn..BK-1 are zeroed so full-width score loops read defined data. */
static inline void load_transposed(float *restrict Kt /*(HD,BK)*/, const float *src, size_t W, int kn, int HD) {
    for (int d = 0; d < HD; d++)
        for (int j = kn; j < BK; j++) Kt[d * BK + j] = 0.0f;
    for (int j = 0; j < kn; j++) {
        const float *r = src + (size_t)j * W; // (HD) row of key j
        for (int d = 0; d < HD; d++) Kt[d * BK + j] = r[d];
    }
}

static void fill_nan(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = NAN;
}

void fl_cpu_attn_qkv_forward(const fl_backend *be, float *out /*(B,T,NH*HD)*/, float *lse /*(B,NH,T)*/,
                              const float *qkv /*(B,T,(NH+2*NKV)*HD)*/, int B, int T, int NH, int NKV, int HD) {
    if (HD > MAXHD || HD <= 0 || NKV <= 0 || NH % NKV) {
        fill_nan(out, (size_t)B * T * NH * HD);
        fill_nan(lse, (size_t)B * NH * T);
        return;
    }
    const size_t W = (size_t)(NH + 2 * NKV) * HD, OW = (size_t)NH * HD;
    const int rep = NH / NKV, nqt = (T + BQ - 1) / BQ;
    const float scale = 1.0f / sqrtf((float)HD);
    const int nitems = B * NH * nqt;
    const int par = (int64_t)B * NH * T * T * HD >= FL_CPU_ATTN_PAR_MIN;
    /* dynamic: late query tiles do more work; each item's result does not
     * depend on which thread runs it, so this stays deterministic. */
#pragma omp parallel for num_threads(be->n_threads) schedule(dynamic, 1) if (par)
    for (int it = 0; it < nitems; it++) {
        int qt = nqt - 1 - it % nqt; /* heaviest tiles first */
        int h = (it / nqt) % NH, b = it / (nqt * NH);
        int g = h / rep;
        int q0 = qt * BQ, qn = T - q0 < BQ ? T - q0 : BQ;
        const float *Q = qkv + (size_t)b * T * W + (size_t)h * HD;                 // (T,HD) stride W
        const float *K = qkv + (size_t)b * T * W + (size_t)(NH + g) * HD;          // (T,HD) stride W
        const float *V = qkv + (size_t)b * T * W + (size_t)(NH + NKV + g) * HD;    // (T,HD) stride W
        float QsT[MAXHD * BQ]; // (HD,BQ) query tile transposed, pre-scaled by 1/sqrt(HD); columns >= qn zero
        float O[BQ * MAXHD];   // (qn,HD) unnormalized output accumulator
        float ST[BK * BQ];     // (kn,BQ) scores of the key tile, transposed; then probabilities
        float m[BQ], l[BQ];    // (BQ) running max / running sum per query row
        float mx[BQ], corr[BQ], ps[BQ];
        for (int d = 0; d < HD; d++)
            for (int r = qn; r < BQ; r++) QsT[d * BQ + r] = 0.0f;
        for (int r = 0; r < qn; r++) {
            const float *q = Q + (size_t)(q0 + r) * W;
            for (int d = 0; d < HD; d++) {
                QsT[d * BQ + r] = q[d] * scale;
                O[r * HD + d] = 0.0f;
            }
        }
        for (int r = 0; r < BQ; r++) m[r] = -INFINITY, l[r] = 0.0f;
        int kend = q0 + qn; /* causal: keys 0..q0+qn-1 */
        for (int k0 = 0; k0 < kend; k0 += BK) {
            int kn = kend - k0 < BK ? kend - k0 : BK;
            /* S^T = K (scale Q)^T: (kn,BQ), one query row per lane, so the online softmax below
             * runs down the keys with no horizontal reductions */
            fl_cpu_attn_mm(ST, BQ, K + (size_t)k0 * W, (int)W, 1, QsT, BQ, kn, BQ, HD, 0);
            /* key k0+j is visible to row r iff r >= k0 + j - q0 (rows past qn see every key:
             * their scores are 0 and their results are dropped) */
            for (int r = 0; r < BQ; r++) mx[r] = -INFINITY, ps[r] = 0.0f;
            for (int j = 0; j < kn; j++) {
                const float *st = ST + j * BQ;
                int rmin = k0 + j - q0;
                /* FL_VECTORIZE: attn_fwd_max */
#pragma omp simd
                for (int r = 0; r < BQ; r++) {
                    float v = fl_cpu_selectf(st[r], -INFINITY, r >= rmin);
                    mx[r] = v > mx[r] ? v : mx[r];
                }
            }
#pragma omp simd
            for (int r = 0; r < BQ; r++) {
                float mnew = mx[r] > m[r] ? mx[r] : m[r];
                corr[r] = fl_cpu_expf(m[r] - mnew); /* first tile: m=-inf -> ~0, O and l are 0 */
                m[r] = mnew;
            }
            for (int j = 0; j < kn; j++) {
                float *st = ST + j * BQ;
                int rmin = k0 + j - q0;
                /* FL_VECTORIZE: attn_fwd_exp */
#pragma omp simd
                for (int r = 0; r < BQ; r++) {
                    /* keepf, not ?: (a ?: keeps this loop scalar: cpu-impl.h) */
                    float p = fl_cpu_keepf(fl_cpu_expf(st[r] - m[r]), r >= rmin);
                    st[r] = p;
                    ps[r] += p;
                }
            }
            for (int r = 0; r < qn; r++) {
                l[r] = l[r] * corr[r] + ps[r];
                float *o = O + r * HD, c = corr[r];
#pragma omp simd
                for (int d = 0; d < HD; d++) o[d] *= c;
            }
            /* O += P V: A(r,j) = P^T[j][r]; masked entries of P are exactly 0 */
            fl_cpu_attn_mm(O, HD, ST, 1, BQ, V + (size_t)k0 * W, (int)W, qn, HD, kn, 1);
        }
        for (int r = 0; r < qn; r++) {
            int t = q0 + r;
            float inv = 1.0f / l[r];
            float *dst = out + ((size_t)b * T + t) * OW + (size_t)h * HD;
#pragma omp simd
            for (int d = 0; d < HD; d++) dst[d] = O[r * HD + d] * inv;
            lse[((size_t)b * NH + h) * T + t] = m[r] + logf(l[r]);
        }
    }
}

/* ---- backward ----------------------------------------------------------------------
 * Unit of work: a block of BQ query rows t0.. of head h against the key tile at k0 (both
 * aligned to BK, so a block is a query tile): S = (scale Q) K^T and dP = dO V^T (BQ,BK),
 * P = exp(S - lse), dS = P o (dP - D), then dV += P^T dO and dK += dS^T (scale Q) into the
 * tile's accumulators and, when asked, dQ of the block += scale (dS K). Five tile products
 * (fl_cpu_attn_mm), each a chain over its inner dimension in ascending order.
 * Two schedules with bit-identical results (both run block_grads below on the same blocks):
 *  - fused: item = (b, kv head g); owns dK/dV of g and dQ of g's query heads.
 *    Least work, but only B*NKV items: the 1B-like lab model (NKV 1) at micro
 *    batch 1 would run on one thread.
 *  - split: items (b, g, key tile) own that tile's dK/dV (all of g's heads, all
 *    rows t >= k0), items (b, h, query tile) own dQ of those rows (key tiles
 *    ascending up to the diagonal). P and dP are computed by both (7 products per
 *    block and tile instead of 5, and the exp twice), but the work spreads over
 *    B*NKV*T/BK + B*NH*T/BK items; both kinds write disjoint parts of dqkv, so
 *    they share one parallel loop.
 * Per element the summation order is the same in both: dK/dV of key j sum over
 * heads ascending, then rows ascending, into a zeroed tile added once;
 * dQ of row t adds scale * (its key tile's sum) for key tiles ascending. */

typedef struct {
    const float *qkv;  // (B,T,W)
    const float *dout; // (B,T,OW)
    const float *out;  // (B,T,OW)
    const float *lse;  // (B,NH,T)
    float *dqkv;       // (B,T,W)
    int T, NH, NKV, HD, rep;
    size_t W, OW;
    float scale;
} attn_bw;

/* Per-thread buffers of one block against one tile (about 50 KB at HD 256, on the stack). */
typedef struct {
    float qs[BQ * MAXHD]; // (qn,HD) scale * q of the block
    float dq[BQ * MAXHD]; // (qn,HD) dS K of the block
    float s[BQ * BK];     // (qn,BK) scores -> P
    float dp[BQ * BK];    // (qn,BK) dP -> dS
} attn_blk;

/* Block t0 (qn = min(BQ, T - t0) rows, t0 >= k0) of head h of batch b against the key tile at
 * k0 (kn keys; Kt/Vt transposed, zero past kn): unless dV is NULL, adds P^T dO into dV and
 * dS^T (scale q) into dK (first jmx rows of the (BK,HD) tiles); with_dq, adds scale * dS K
 * into the block's dQ rows of dqkv. noinline: both schedules run this very code. */
__attribute__((noinline)) static void block_grads(const attn_bw *a, attn_blk *w, const float *Kt /*(HD,BK)*/,
                                                  const float *Vt /*(HD,BK)*/, float *dK /*(BK,HD)*/,
                                                  float *dV /*(BK,HD)*/, int b, int h, int k0, int kn, int t0,
                                                  int with_dq) {
    const int T = a->T, HD = a->HD, qn = T - t0 < BQ ? T - t0 : BQ;
    const float *Q = a->qkv + ((size_t)b * T + t0) * a->W + (size_t)h * HD;   // (qn,HD) stride W
    const float *dO = a->dout + ((size_t)b * T + t0) * a->OW + (size_t)h * HD; // (qn,HD) stride OW
    const float *O = a->out + ((size_t)b * T + t0) * a->OW + (size_t)h * HD;   // (qn,HD) stride OW
    const float *L = a->lse + ((size_t)b * a->NH + h) * T + t0;                // (qn)
    for (int i = 0; i < qn; i++)
        for (int d = 0; d < HD; d++) w->qs[i * HD + d] = Q[(size_t)i * a->W + d] * a->scale;
    fl_cpu_attn_mm(w->s, BK, w->qs, HD, 1, Kt, BK, qn, BK, HD, 0);           /* S = (scale Q) K^T */
    fl_cpu_attn_mm(w->dp, BK, dO, (int)a->OW, 1, Vt, BK, qn, BK, HD, 0);     /* dP = dO V^T */
    for (int i = 0; i < qn; i++) {
        const float *o = O + (size_t)i * a->OW, *go = dO + (size_t)i * a->OW;
        float Dr = 0.0f;
#pragma omp simd reduction(+ : Dr)
        for (int d = 0; d < HD; d++) Dr += go[d] * o[d];
        int j = t0 + i - k0 + 1, jmax = j < kn ? j : kn; /* >= 1: t0 >= k0 */
        float Lr = L[i], *s = w->s + i * BK, *dp = w->dp + i * BK;
        /* FL_VECTORIZE: attn_bwd_exp */
#pragma omp simd
        for (int j2 = 0; j2 < BK; j2++) {
            float p = fl_cpu_keepf(fl_cpu_expf(s[j2] - Lr), j2 < jmax);
            s[j2] = p;
            dp[j2] = p * (dp[j2] - Dr);
        }
    }
    int jmx = t0 + qn - k0 < kn ? t0 + qn - k0 : kn; /* keys some row of the block sees */
    if (dV) {
        fl_cpu_attn_mm(dV, HD, w->s, 1, BK, dO, (int)a->OW, jmx, HD, qn, 1); /* dV += P^T dO */
        fl_cpu_attn_mm(dK, HD, w->dp, 1, BK, w->qs, HD, jmx, HD, qn, 1);     /* dK += dS^T (scale Q) */
    }
    if (!with_dq) return;
    const float *K = a->qkv + ((size_t)b * T + k0) * a->W + (size_t)(a->NH + h / a->rep) * HD; // (jmx,HD) stride W
    fl_cpu_attn_mm(w->dq, HD, w->dp, BK, 1, K, (int)a->W, qn, HD, jmx, 0); /* dS K */
    for (int i = 0; i < qn; i++) {
        float *dqr = a->dqkv + ((size_t)b * T + t0 + i) * a->W + (size_t)h * HD;
        const float *dq = w->dq + i * HD;
#pragma omp simd
        for (int d = 0; d < HD; d++) dqr[d] += a->scale * dq[d];
    }
}

/* Key tile k0 of kv head g: dK/dV over every head of g's group and every row
 * t >= k0, added into dqkv; with_dq: also the dQ contributions of this tile
 * (only when the caller owns all of the group's dQ rows: the fused schedule). */
static void kv_tile(const attn_bw *a, attn_blk *w, int b, int g, int k0, int with_dq) {
    const int T = a->T, HD = a->HD;
    const float *K = a->qkv + (size_t)b * T * a->W + (size_t)(a->NH + g) * HD;          // (T,HD) stride W
    const float *V = a->qkv + (size_t)b * T * a->W + (size_t)(a->NH + a->NKV + g) * HD; // (T,HD) stride W
    float Kt[MAXHD * BK], Vt[MAXHD * BK]; // (HD,BK) transposed key / value tiles
    float dK[BK * MAXHD], dV[BK * MAXHD]; // (BK,HD) tile gradient accumulators
    int kn = T - k0 < BK ? T - k0 : BK;
    load_transposed(Kt, K + (size_t)k0 * a->W, a->W, kn, HD);
    load_transposed(Vt, V + (size_t)k0 * a->W, a->W, kn, HD);
    memset(dK, 0, sizeof(float) * (size_t)kn * HD);
    memset(dV, 0, sizeof(float) * (size_t)kn * HD);
    for (int h = g * a->rep; h < (g + 1) * a->rep; h++)
        for (int t0 = k0; t0 < T; t0 += BQ) /* causal: only rows t >= k0 see this tile */
            block_grads(a, w, Kt, Vt, dK, dV, b, h, k0, kn, t0, with_dq);
    float *dbase = a->dqkv + (size_t)b * T * a->W;
    for (int j = 0; j < kn; j++) {
        float *dkr = dbase + (size_t)(k0 + j) * a->W + (size_t)(a->NH + g) * HD;
        float *dvr = dbase + (size_t)(k0 + j) * a->W + (size_t)(a->NH + a->NKV + g) * HD;
#pragma omp simd
        for (int d = 0; d < HD; d++) {
            dkr[d] += dK[j * HD + d];
            dvr[d] += dV[j * HD + d];
        }
    }
}

/* dQ of query rows q0..q0+BQ-1 of head h: key tiles 0..q0 ascending (the query
 * tile is aligned with the key tiles, so the last one is the diagonal). */
static void q_tile(const attn_bw *a, attn_blk *w, int b, int h, int q0) {
    const int T = a->T, HD = a->HD, g = h / a->rep;
    const float *K = a->qkv + (size_t)b * T * a->W + (size_t)(a->NH + g) * HD;          // (T,HD) stride W
    const float *V = a->qkv + (size_t)b * T * a->W + (size_t)(a->NH + a->NKV + g) * HD; // (T,HD) stride W
    float Kt[MAXHD * BK], Vt[MAXHD * BK]; // (HD,BK) transposed key / value tiles
    for (int k0 = 0; k0 <= q0; k0 += BK) {
        int kn = T - k0 < BK ? T - k0 : BK;
        load_transposed(Kt, K + (size_t)k0 * a->W, a->W, kn, HD);
        load_transposed(Vt, V + (size_t)k0 * a->W, a->W, kn, HD);
        block_grads(a, w, Kt, Vt, NULL, NULL, b, h, k0, kn, q0, 1);
    }
}

/* 1 if the split schedule is expected to finish clearly first: the fused one takes
 * ceil(n/nt) rounds of 5 units per item; the split one about 8 n / nt (measured on one
 * thread: 1.46-1.89x the fused time at HD 8-64 with the tile products, Zen 4). Split only
 * for a 1.5x gain: when the machine is shared the extra threads may not run, and then the
 * split is that much slower (so 2 threads and one item stay fused; 3 or more threads split). */
int fl_cpu_attn_use_split(int n_fused, int nt) {
    if (nt <= 1) return 0;
    long rounds = (n_fused + nt - 1) / nt;
    return 2L * 5 * rounds * nt >= 3L * 8 * n_fused;
}

void fl_cpu_attn_qkv_backward_sched(const fl_backend *be, float *dqkv, const float *dout, const float *qkv,
                                     const float *out, const float *lse, int B, int T, int NH, int NKV, int HD,
                                     int split) {
    if (HD > MAXHD || HD <= 0 || NKV <= 0 || NH % NKV) {
        fill_nan(dqkv, (size_t)B * T * (NH + 2 * NKV) * HD);
        return;
    }
    const attn_bw a = {qkv, dout, out, lse, dqkv, T, NH, NKV, HD, NH / NKV, (size_t)(NH + 2 * NKV) * HD,
                       (size_t)NH * HD, 1.0f / sqrtf((float)HD)};
    /* small work on the calling thread (FL_CPU_ATTN_PAR_MIN), where the fused schedule does least */
    const int nt = be->n_threads > 0 && (int64_t)B * NH * T * T * HD >= FL_CPU_ATTN_PAR_MIN ? be->n_threads : 1;
    if (split < 0) split = fl_cpu_attn_use_split(B * NKV, nt);
    if (!split) {
        const int nitems = B * NKV;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int it = 0; it < nitems; it++) {
            attn_blk w;
            int b = it / NKV, g = it % NKV;
            for (int k0 = 0; k0 < T; k0 += BK) kv_tile(&a, &w, b, g, k0, 1);
        }
        return;
    }
    /* split: kv items first, key tiles ascending (the first ones see the most
     * rows), then dQ items, query tiles descending (the last ones see the most
     * keys): heaviest first for the dynamic schedule. */
    const int nkt = (T + BK - 1) / BK, n_kv = B * NKV * nkt, n_q = B * NH * nkt;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int it = 0; it < n_kv + n_q; it++) {
        attn_blk w;
        if (it < n_kv) {
            int kt = it / (B * NKV), bg = it % (B * NKV);
            kv_tile(&a, &w, bg / NKV, bg % NKV, kt * BK, 0);
        } else {
            int i = it - n_kv, qt = nkt - 1 - i / (B * NH), bh = i % (B * NH);
            q_tile(&a, &w, bh / NH, bh % NH, qt * BK);
        }
    }
}
