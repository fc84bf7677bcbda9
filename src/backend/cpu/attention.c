/* Causal grouped-query self-attention, flash-attention-2 style on the CPU.
 *
 * Layout: qkv rows (b,t) are [q (NH*HD) | k (NKV*HD) | v (NKV*HD)]; query head
 * h reads kv head h / (NH/NKV). Scores are scaled by 1/sqrt(HD).
 *
 * Forward: work item = (b, h, tile of BQ query rows). Keys are visited in tiles
 * of BK up to the diagonal; each key tile is transposed once into Kt (HD,BK) so
 * a score row is HD broadcast-FMAs over a BK-wide vector (no horizontal sums).
 * An online softmax (running max m, running sum l, rescaled accumulator O)
 * means the (T,T) score matrix never exists. We store lse = m + log(l).
 *
 * Backward: per key tile, P = exp(S - lse) is recomputed row by row and
 *   D_t = dO_t . O_t,  dV_j += P^T dO,  dP = dO V^T,  dS = P o (dP - D),
 *   dQ += scale dS K,  dK_j += scale dS^T Q.
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

#define BQ 32 /* query rows per forward work item */
#define BK FL_CPU_ATTN_BK /* keys per tile: two AVX-512 vectors of scores */
#define RB FL_CPU_ATTN_RB /* query rows processed together (register blocking); the code below is unrolled for 4 */
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

void fl_cpu_attention_forward(const fl_backend *be, float *out /*(B,T,NH*HD)*/, float *lse /*(B,NH,T)*/,
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
        float Kt[MAXHD * BK];  // (HD,BK) transposed key tile
        float Qs[BQ * MAXHD];  // (BQ,HD) query tile, pre-scaled by 1/sqrt(HD); rows >= qn zero
        float O[BQ * MAXHD];   // (BQ,HD) unnormalized output accumulator
        float m[BQ], l[BQ];    // (BQ) running max / running sum
        for (int r = 0; r < BQ; r++) {
            for (int d = 0; d < HD; d++) Qs[r * HD + d] = O[r * HD + d] = 0.0f;
            if (r < qn) {
                const float *q = Q + (size_t)(q0 + r) * W;
                for (int d = 0; d < HD; d++) Qs[r * HD + d] = q[d] * scale;
            }
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        int kend = q0 + qn; /* causal: keys 0..q0+qn-1 */
        for (int k0 = 0; k0 < kend; k0 += BK) {
            int kn = kend - k0 < BK ? kend - k0 : BK;
            load_transposed(Kt, K + (size_t)k0 * W, W, kn, HD);
            /* RB query rows at a time: every Kt / V load feeds RB FMAs. */
            for (int r0 = 0; r0 < qn; r0 += RB) {
                float s[RB][BK]; // (RB,BK) scores, then probabilities
                int jm[RB];      // visible keys per row (0 for padding rows)
                for (int r = 0; r < RB; r++) {
                    int t = q0 + r0 + r, j = t - k0 + 1;
                    jm[r] = r0 + r >= qn ? 0 : j < kn ? j : kn;
                    for (int j2 = 0; j2 < BK; j2++) s[r][j2] = 0.0f;
                }
                for (int d = 0; d < HD; d++) {
                    const float *kt = Kt + d * BK;
                    for (int r = 0; r < RB; r++) {
                        float a = Qs[(r0 + r) * HD + d];
#pragma omp simd
                        for (int j = 0; j < BK; j++) s[r][j] += a * kt[j];
                    }
                }
                int jmx = 0;
                for (int r = 0; r < RB; r++) {
                    int rr = r0 + r, jmax = jm[r];
                    jmx = jmax > jmx ? jmax : jmx;
                    if (jmax <= 0) { /* padding row (or no visible key): contributes nothing */
                        for (int j = 0; j < BK; j++) s[r][j] = 0.0f;
                        continue;
                    }
                    float smax = -INFINITY;
                    for (int j = 0; j < jmax; j++) smax = s[r][j] > smax ? s[r][j] : smax;
                    float mnew = smax > m[rr] ? smax : m[rr];
                    float corr = fl_cpu_expf(m[rr] - mnew); /* first tile: m=-inf -> ~0, O and l are 0 */
                    float ps = 0.0f;
                    /* FL_VECTORIZE: attn_fwd_exp */
#pragma omp simd reduction(+ : ps)
                    for (int j = 0; j < BK; j++) {
                        /* keepf, not ?: (a ?: keeps this loop scalar: cpu-impl.h) */
                        float p = fl_cpu_keepf(fl_cpu_expf(s[r][j] - mnew), j < jmax);
                        s[r][j] = p;
                        ps += p;
                    }
                    l[rr] = l[rr] * corr + ps;
                    m[rr] = mnew;
                    float *o = O + rr * HD;
#pragma omp simd
                    for (int d = 0; d < HD; d++) o[d] *= corr;
                }
                /* O[r] += P[r,j] V[j]; masked / padding entries of P are exactly 0. */
                float *o0 = O + r0 * HD, *o1 = o0 + HD, *o2 = o1 + HD, *o3 = o2 + HD;
                for (int j = 0; j < jmx; j++) {
                    const float *v = V + (size_t)(k0 + j) * W;
                    float p0 = s[0][j], p1 = s[1][j], p2 = s[2][j], p3 = s[3][j];
#pragma omp simd
                    for (int d = 0; d < HD; d++) {
                        float vd = v[d];
                        o0[d] += p0 * vd;
                        o1[d] += p1 * vd;
                        o2[d] += p2 * vd;
                        o3[d] += p3 * vd;
                    }
                }
            }
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
 * Two schedules with bit-identical results (both run the same three row-block
 * functions below in the same per-element order):
 *  - fused: item = (b, kv head g); owns dK/dV of g and dQ of g's query heads.
 *    Least work, but only B*NKV items: the 1B-like lab model (NKV 1) at micro
 *    batch 1 would run on one thread.
 *  - split: items (b, g, key tile) own that tile's dK/dV (all of g's heads, all
 *    rows t >= k0), items (b, h, query tile) own dQ of those rows (key tiles
 *    ascending up to the diagonal). P and dP are computed by both, so it does
 *    7 HD-long FMA rows per (query, key) pair instead of 5 (1.55-1.8x the time
 *    on one thread, with the second exp), but spreads over
 *    B*NKV*T/BK + B*NH*T/BK items; both kinds write disjoint parts of dqkv, so
 *    they share one parallel loop.
 * Per element the summation order is the same in both: dK/dV of key j sum over
 * heads ascending, then row blocks ascending, into a zeroed tile added once;
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

/* Per-thread state of RB query rows against one key tile (cpu-impl.h). */
typedef fl_cpu_attn_rows attn_rows;

/* Rows t0..t0+RB-1 of head h of batch b against the key tile at k0 (kn keys,
 * transposed in Kt/Vt): P = exp(S - lse) into r->s, dS = P o (dP - D) into
 * r->dp. Padding rows (t >= T) get zero q/dO and P = dS = 0. Returns the
 * largest visible key count of the block. noinline: the fused and the split
 * schedule must run the very same code (bit-identical results). */
__attribute__((noinline)) static int rows_probs(const attn_bw *a, attn_rows *r, const float *Kt /*(HD,BK)*/,
                                                const float *Vt /*(HD,BK)*/, int b, int h, int k0, int kn, int t0) {
    const int T = a->T, HD = a->HD;
    const float *base = a->qkv + (size_t)b * T * a->W;
    const float *L = a->lse + ((size_t)b * a->NH + h) * T; // (T)
    for (int i = 0; i < RB; i++) {
        int t = t0 + i;
        if (t < T) {
            const float *q = base + (size_t)t * a->W + (size_t)h * HD;
            const float *dO = a->dout + ((size_t)b * T + t) * a->OW + (size_t)h * HD;
            const float *o = a->out + ((size_t)b * T + t) * a->OW + (size_t)h * HD;
            float Dr = 0.0f;
#pragma omp simd reduction(+ : Dr)
            for (int d = 0; d < HD; d++) Dr += dO[d] * o[d];
            for (int d = 0; d < HD; d++) {
                r->qs[i][d] = q[d] * a->scale;
                r->go[i][d] = dO[d];
            }
            r->D[i] = Dr;
            r->lt[i] = L[t];
            r->jm[i] = t - k0 + 1 < kn ? t - k0 + 1 : kn;
        } else {
            for (int d = 0; d < HD; d++) r->qs[i][d] = r->go[i][d] = 0.0f;
            r->D[i] = r->lt[i] = 0.0f;
            r->jm[i] = 0;
        }
        for (int j = 0; j < BK; j++) r->s[i][j] = r->dp[i][j] = 0.0f;
    }
    for (int d = 0; d < HD; d++) {
        const float *kt = Kt + d * BK, *vt = Vt + d * BK;
        for (int i = 0; i < RB; i++) {
            float q = r->qs[i][d], gd = r->go[i][d];
#pragma omp simd
            for (int j = 0; j < BK; j++) {
                r->s[i][j] += q * kt[j];
                r->dp[i][j] += gd * vt[j];
            }
        }
    }
    int jmx = 0;
    for (int i = 0; i < RB; i++) {
        int jmax = r->jm[i];
        float Lr = r->lt[i], Dr = r->D[i];
        jmx = jmax > jmx ? jmax : jmx;
        /* FL_VECTORIZE: attn_bwd_exp */
#pragma omp simd
        for (int j = 0; j < BK; j++) {
            float p = fl_cpu_keepf(fl_cpu_expf(r->s[i][j] - Lr), j < jmax);
            r->s[i][j] = p;
            r->dp[i][j] = p * (r->dp[i][j] - Dr);
        }
    }
    return jmx;
}

/* dV_j += P^T dO and dK_j += dS^T (scale q) for the first jmx keys of the tile. */
/* noinline and shared with attention_ex.c: every schedule of both kernels runs this very code. */
__attribute__((noinline)) void fl_cpu_attn_rows_dkdv(const attn_rows *r, float *dK /*(BK,HD)*/, float *dV /*(BK,HD)*/,
                                                     int jmx, int HD) {
    for (int j = 0; j < jmx; j++) {
        float *dv = dV + j * HD, *dk = dK + j * HD;
        float p0 = r->s[0][j], p1 = r->s[1][j], p2 = r->s[2][j], p3 = r->s[3][j];
        float e0 = r->dp[0][j], e1 = r->dp[1][j], e2 = r->dp[2][j], e3 = r->dp[3][j];
        /* FL_VECTORIZE: attn_bwd_dkdv */
#pragma omp simd
        for (int d = 0; d < HD; d++) {
            dv[d] += p0 * r->go[0][d] + p1 * r->go[1][d] + p2 * r->go[2][d] + p3 * r->go[3][d];
            /* scale folded into qs */
            dk[d] += e0 * r->qs[0][d] + e1 * r->qs[1][d] + e2 * r->qs[2][d] + e3 * r->qs[3][d];
        }
    }
}

/* dQ_t += scale * sum_j dS_tj K_j over the first jmx keys of the tile at k0. */
__attribute__((noinline)) static void rows_dq(const attn_bw *a, attn_rows *r, int b, int h, int g, int k0, int jmx,
                                              int t0) {
    const int T = a->T, HD = a->HD;
    const float *K = a->qkv + (size_t)b * T * a->W + (size_t)(a->NH + g) * HD; // (T,HD) stride W
    for (int i = 0; i < RB; i++)
        for (int d = 0; d < HD; d++) r->dq[i][d] = 0.0f;
    for (int j = 0; j < jmx; j++) {
        const float *kr = K + (size_t)(k0 + j) * a->W;
        float e0 = r->dp[0][j], e1 = r->dp[1][j], e2 = r->dp[2][j], e3 = r->dp[3][j];
#pragma omp simd
        for (int d = 0; d < HD; d++) {
            float kd = kr[d];
            r->dq[0][d] += e0 * kd;
            r->dq[1][d] += e1 * kd;
            r->dq[2][d] += e2 * kd;
            r->dq[3][d] += e3 * kd;
        }
    }
    for (int i = 0; i < RB && t0 + i < T; i++) {
        float *dqr = a->dqkv + ((size_t)b * T + t0 + i) * a->W + (size_t)h * HD;
#pragma omp simd
        for (int d = 0; d < HD; d++) dqr[d] += a->scale * r->dq[i][d];
    }
}

/* Key tile k0 of kv head g: dK/dV over every head of g's group and every row
 * t >= k0, added into dqkv; with_dq: also the dQ contributions of this tile
 * (only when the caller owns all of the group's dQ rows: the fused schedule). */
static void kv_tile(const attn_bw *a, attn_rows *r, int b, int g, int k0, int with_dq) {
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
        /* causal: only rows t >= k0 see this tile; RB rows at a time so each
         * Kt/Vt load and each dK/dV row update serves RB rows */
        for (int t0 = k0; t0 < T; t0 += RB) {
            int jmx = rows_probs(a, r, Kt, Vt, b, h, k0, kn, t0);
            fl_cpu_attn_rows_dkdv(r, dK, dV, jmx, HD);
            if (with_dq) rows_dq(a, r, b, h, g, k0, jmx, t0);
        }
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

/* dQ of query rows q0..q0+BK-1 of head h: key tiles 0..q0 ascending (the query
 * tile is aligned with the key tiles, so the last one is the diagonal). */
static void q_tile(const attn_bw *a, attn_rows *r, int b, int h, int q0) {
    const int T = a->T, HD = a->HD, g = h / a->rep;
    const float *K = a->qkv + (size_t)b * T * a->W + (size_t)(a->NH + g) * HD;          // (T,HD) stride W
    const float *V = a->qkv + (size_t)b * T * a->W + (size_t)(a->NH + a->NKV + g) * HD; // (T,HD) stride W
    float Kt[MAXHD * BK], Vt[MAXHD * BK]; // (HD,BK) transposed key / value tiles
    int qend = q0 + BK < T ? q0 + BK : T;
    for (int k0 = 0; k0 <= q0; k0 += BK) {
        int kn = T - k0 < BK ? T - k0 : BK;
        load_transposed(Kt, K + (size_t)k0 * a->W, a->W, kn, HD);
        load_transposed(Vt, V + (size_t)k0 * a->W, a->W, kn, HD);
        for (int t0 = q0; t0 < qend; t0 += RB) {
            int jmx = rows_probs(a, r, Kt, Vt, b, h, k0, kn, t0);
            rows_dq(a, r, b, h, g, k0, jmx, t0);
        }
    }
}

/* 1 if the split schedule is expected to finish clearly first: the fused one takes
 * ceil(n/nt) rounds of 5 units per item; the split one about 8 n / nt (measured on one
 * thread: 1.55-1.8x the fused time at HD 16-64). Split only for a 1.5x gain: when the
 * machine is shared the extra threads may not run, and then the split is that much slower
 * (so 2 threads and one item stay fused; 3 or more threads split). */
int fl_cpu_attn_use_split(int n_fused, int nt) {
    if (nt <= 1) return 0;
    long rounds = (n_fused + nt - 1) / nt;
    return 2L * 5 * rounds * nt >= 3L * 8 * n_fused;
}

void fl_cpu_attention_backward(const fl_backend *be, float *dqkv /*(B,T,(NH+2*NKV)*HD)*/,
                               const float *dout /*(B,T,NH*HD)*/, const float *qkv /*(B,T,(NH+2*NKV)*HD)*/,
                               const float *out /*(B,T,NH*HD)*/, const float *lse /*(B,NH,T)*/, int B, int T,
                               int NH, int NKV, int HD) {
    fl_cpu_attention_backward_sched(be, dqkv, dout, qkv, out, lse, B, T, NH, NKV, HD, -1);
}

void fl_cpu_attention_backward_sched(const fl_backend *be, float *dqkv, const float *dout, const float *qkv,
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
            attn_rows r;
            int b = it / NKV, g = it % NKV;
            for (int k0 = 0; k0 < T; k0 += BK) kv_tile(&a, &r, b, g, k0, 1);
        }
        return;
    }
    /* split: kv items first, key tiles ascending (the first ones see the most
     * rows), then dQ items, query tiles descending (the last ones see the most
     * keys): heaviest first for the dynamic schedule. */
    const int nkt = (T + BK - 1) / BK, n_kv = B * NKV * nkt, n_q = B * NH * nkt;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int it = 0; it < n_kv + n_q; it++) {
        attn_rows r;
        if (it < n_kv) {
            int kt = it / (B * NKV), bg = it % (B * NKV);
            kv_tile(&a, &r, bg / NKV, bg % NKV, kt * BK, 0);
        } else {
            int i = it - n_kv, qt = nkt - 1 - i / (B * NH), bh = i % (B * NH);
            q_tile(&a, &r, bh / NH, bh % NH, qt * BK);
        }
    }
}
