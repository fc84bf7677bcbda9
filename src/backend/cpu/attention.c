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
 * Backward: work item = (b, kv head g). The item owns dK/dV of head g and the
 * dQ of the query heads in g's group, so no two threads ever write the same
 * element: no atomics, no races, and each element's summation order is fixed
 * (key tiles ascending, heads ascending, rows ascending), so the result is
 * bit-identical for any thread count. Per key tile, P = exp(S - lse) is
 * recomputed row by row and
 *   D_t = dO_t . O_t,  dV_j += P^T dO,  dP = dO V^T,  dS = P o (dP - D),
 *   dQ += scale dS K,  dK_j += scale dS^T Q.
 * dK/dV of the tile accumulate in stack buffers and are added once at the end.
 *
 * All buffers are fixed-size stack tiles (ops never allocate), sized for
 * HD <= FL_CPU_ATTN_MAX_HD. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define BQ 32 /* query rows per forward work item */
#define BK 32 /* keys per tile: two AVX-512 vectors of scores */
#define RB 4  /* query rows processed together (register blocking); the code below is unrolled for 4 */
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
    /* dynamic: late query tiles do more work; each item's result does not
     * depend on which thread runs it, so this stays deterministic. */
#pragma omp parallel for num_threads(be->n_threads) schedule(dynamic, 1)
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
#pragma omp simd reduction(+ : ps)
                    for (int j = 0; j < BK; j++) {
                        float p = j < jmax ? fl_cpu_expf(s[r][j] - mnew) : 0.0f;
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

void fl_cpu_attention_backward(const fl_backend *be, float *dqkv /*(B,T,(NH+2*NKV)*HD)*/,
                               const float *dout /*(B,T,NH*HD)*/, const float *qkv /*(B,T,(NH+2*NKV)*HD)*/,
                               const float *out /*(B,T,NH*HD)*/, const float *lse /*(B,NH,T)*/, int B, int T,
                               int NH, int NKV, int HD) {
    if (HD > MAXHD || HD <= 0 || NKV <= 0 || NH % NKV) {
        fill_nan(dqkv, (size_t)B * T * (NH + 2 * NKV) * HD);
        return;
    }
    const size_t W = (size_t)(NH + 2 * NKV) * HD, OW = (size_t)NH * HD;
    const int rep = NH / NKV;
    const float scale = 1.0f / sqrtf((float)HD);
    const int nitems = B * NKV;
#pragma omp parallel for num_threads(be->n_threads) schedule(dynamic, 1)
    for (int it = 0; it < nitems; it++) {
        int b = it / NKV, g = it % NKV;
        const float *base = qkv + (size_t)b * T * W;
        float *dbase = dqkv + (size_t)b * T * W;
        const float *K = base + (size_t)(NH + g) * HD;       // (T,HD) stride W
        const float *V = base + (size_t)(NH + NKV + g) * HD; // (T,HD) stride W
        float Kt[MAXHD * BK], Vt[MAXHD * BK]; // (HD,BK) transposed key / value tiles
        float dK[BK * MAXHD], dV[BK * MAXHD]; // (BK,HD) tile gradient accumulators
        float qs[RB][MAXHD], go[RB][MAXHD], dq[RB][MAXHD]; // (RB,HD) scaled q, dO, dQ of a row block
        float s[RB][BK], dp[RB][BK];                        // (RB,BK) scores -> P, dP -> dS
        float D[RB], lt[RB];                                // (RB) dO.O and lse per row
        int jm[RB];                                         // (RB) visible keys per row
        for (int k0 = 0; k0 < T; k0 += BK) {
            int kn = T - k0 < BK ? T - k0 : BK;
            load_transposed(Kt, K + (size_t)k0 * W, W, kn, HD);
            load_transposed(Vt, V + (size_t)k0 * W, W, kn, HD);
            memset(dK, 0, sizeof(float) * (size_t)kn * HD);
            memset(dV, 0, sizeof(float) * (size_t)kn * HD);
            for (int h = g * rep; h < (g + 1) * rep; h++) {
                const float *L = lse + ((size_t)b * NH + h) * T; // (T)
                /* causal: only rows t >= k0 see this tile; RB rows at a time so
                 * each Kt/Vt load and each dK/dV row update serves RB rows.
                 * Padding rows (t >= T) have zero q/dO and P = dS = 0. */
                for (int t0 = k0; t0 < T; t0 += RB) {
                    for (int r = 0; r < RB; r++) {
                        int t = t0 + r;
                        if (t < T) {
                            const float *q = base + (size_t)t * W + (size_t)h * HD;
                            const float *dO = dout + ((size_t)b * T + t) * OW + (size_t)h * HD;
                            const float *o = out + ((size_t)b * T + t) * OW + (size_t)h * HD;
                            float Dr = 0.0f;
#pragma omp simd reduction(+ : Dr)
                            for (int d = 0; d < HD; d++) Dr += dO[d] * o[d];
                            for (int d = 0; d < HD; d++) {
                                qs[r][d] = q[d] * scale;
                                go[r][d] = dO[d];
                            }
                            D[r] = Dr;
                            lt[r] = L[t];
                            jm[r] = t - k0 + 1 < kn ? t - k0 + 1 : kn;
                        } else {
                            for (int d = 0; d < HD; d++) qs[r][d] = go[r][d] = 0.0f;
                            D[r] = lt[r] = 0.0f;
                            jm[r] = 0;
                        }
                        for (int j = 0; j < BK; j++) s[r][j] = dp[r][j] = 0.0f;
                    }
                    for (int d = 0; d < HD; d++) {
                        const float *kt = Kt + d * BK, *vt = Vt + d * BK;
                        for (int r = 0; r < RB; r++) {
                            float a = qs[r][d], gd = go[r][d];
#pragma omp simd
                            for (int j = 0; j < BK; j++) {
                                s[r][j] += a * kt[j];
                                dp[r][j] += gd * vt[j];
                            }
                        }
                    }
                    int jmx = 0;
                    for (int r = 0; r < RB; r++) {
                        int jmax = jm[r];
                        float Lr = lt[r], Dr = D[r];
                        jmx = jmax > jmx ? jmax : jmx;
#pragma omp simd
                        for (int j = 0; j < BK; j++) {
                            float p = j < jmax ? fl_cpu_expf(s[r][j] - Lr) : 0.0f;
                            s[r][j] = p;
                            dp[r][j] = p * (dp[r][j] - Dr); /* dS (without the scale) */
                        }
                        for (int d = 0; d < HD; d++) dq[r][d] = 0.0f;
                    }
                    for (int j = 0; j < jmx; j++) {
                        float *dv = dV + j * HD, *dk = dK + j * HD;
                        const float *kr = K + (size_t)(k0 + j) * W;
                        float p0 = s[0][j], p1 = s[1][j], p2 = s[2][j], p3 = s[3][j];
                        float e0 = dp[0][j], e1 = dp[1][j], e2 = dp[2][j], e3 = dp[3][j];
#pragma omp simd
                        for (int d = 0; d < HD; d++) {
                            dv[d] += p0 * go[0][d] + p1 * go[1][d] + p2 * go[2][d] + p3 * go[3][d];
                            /* scale folded into qs */
                            dk[d] += e0 * qs[0][d] + e1 * qs[1][d] + e2 * qs[2][d] + e3 * qs[3][d];
                            float kd = kr[d];
                            dq[0][d] += e0 * kd;
                            dq[1][d] += e1 * kd;
                            dq[2][d] += e2 * kd;
                            dq[3][d] += e3 * kd;
                        }
                    }
                    for (int r = 0; r < RB && t0 + r < T; r++) {
                        float *dqr = dbase + (size_t)(t0 + r) * W + (size_t)h * HD;
#pragma omp simd
                        for (int d = 0; d < HD; d++) dqr[d] += scale * dq[r][d];
                    }
                }
            }
            for (int j = 0; j < kn; j++) {
                float *dkr = dbase + (size_t)(k0 + j) * W + (size_t)(NH + g) * HD;
                float *dvr = dbase + (size_t)(k0 + j) * W + (size_t)(NH + NKV + g) * HD;
#pragma omp simd
                for (int d = 0; d < HD; d++) {
                    dkr[d] += dK[j * HD + d];
                    dvr[d] += dV[j * HD + d];
                }
            }
        }
    }
}
