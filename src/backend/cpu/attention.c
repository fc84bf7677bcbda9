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
        float O[BQ * MAXHD];   // (BQ,HD) unnormalized output accumulator
        float m[BQ], l[BQ];    // (BQ) running max / running sum
        for (int r = 0; r < qn; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
            for (int d = 0; d < HD; d++) O[r * HD + d] = 0.0f;
        }
        int kend = q0 + qn; /* causal: keys 0..q0+qn-1 */
        for (int k0 = 0; k0 < kend; k0 += BK) {
            int kn = kend - k0 < BK ? kend - k0 : BK;
            load_transposed(Kt, K + (size_t)k0 * W, W, kn, HD);
            for (int r = 0; r < qn; r++) {
                int t = q0 + r;
                int jmax = t - k0 + 1 < kn ? t - k0 + 1 : kn; /* keys k0..k0+jmax-1 are visible */
                if (jmax <= 0) continue;
                const float *q = Q + (size_t)t * W;
                float s[BK]; // (BK) scores of row t against the tile
                for (int j = 0; j < BK; j++) s[j] = 0.0f;
                for (int d = 0; d < HD; d++) {
                    float qd = q[d] * scale;
#pragma omp simd
                    for (int j = 0; j < BK; j++) s[j] += qd * Kt[d * BK + j];
                }
                float smax = -INFINITY;
                for (int j = 0; j < jmax; j++) smax = s[j] > smax ? s[j] : smax;
                float mnew = smax > m[r] ? smax : m[r];
                float corr = fl_cpu_expf(m[r] - mnew); /* first tile: m=-inf -> ~0, O and l are 0 */
                float ps = 0.0f;
#pragma omp simd reduction(+ : ps)
                for (int j = 0; j < BK; j++) {
                    float p = j < jmax ? fl_cpu_expf(s[j] - mnew) : 0.0f;
                    s[j] = p;
                    ps += p;
                }
                l[r] = l[r] * corr + ps;
                m[r] = mnew;
                float *o = O + r * HD;
#pragma omp simd
                for (int d = 0; d < HD; d++) o[d] *= corr;
                for (int j = 0; j < jmax; j++) {
                    const float *v = V + (size_t)(k0 + j) * W;
                    float p = s[j];
#pragma omp simd
                    for (int d = 0; d < HD; d++) o[d] += p * v[d];
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
        float qs[MAXHD], dq[MAXHD];           // (HD) scaled query row, its dQ contribution
        float s[BK], dp[BK];                  // (BK) scores -> P, dP -> dS
        for (int k0 = 0; k0 < T; k0 += BK) {
            int kn = T - k0 < BK ? T - k0 : BK;
            load_transposed(Kt, K + (size_t)k0 * W, W, kn, HD);
            load_transposed(Vt, V + (size_t)k0 * W, W, kn, HD);
            memset(dK, 0, sizeof(float) * (size_t)kn * HD);
            memset(dV, 0, sizeof(float) * (size_t)kn * HD);
            for (int h = g * rep; h < (g + 1) * rep; h++) {
                const float *L = lse + ((size_t)b * NH + h) * T; // (T)
                for (int t = k0; t < T; t++) { /* causal: only rows t >= k0 see this tile */
                    int jmax = t - k0 + 1 < kn ? t - k0 + 1 : kn;
                    const float *q = base + (size_t)t * W + (size_t)h * HD;
                    const float *dO = dout + ((size_t)b * T + t) * OW + (size_t)h * HD;
                    const float *o = out + ((size_t)b * T + t) * OW + (size_t)h * HD;
                    float D = 0.0f;
#pragma omp simd reduction(+ : D)
                    for (int d = 0; d < HD; d++) D += dO[d] * o[d];
                    for (int j = 0; j < BK; j++) s[j] = dp[j] = 0.0f;
                    for (int d = 0; d < HD; d++) {
                        float qd = q[d] * scale, gd = dO[d];
                        qs[d] = qd;
#pragma omp simd
                        for (int j = 0; j < BK; j++) {
                            s[j] += qd * Kt[d * BK + j];
                            dp[j] += gd * Vt[d * BK + j];
                        }
                    }
                    float lt = L[t];
#pragma omp simd
                    for (int j = 0; j < BK; j++) {
                        float p = j < jmax ? fl_cpu_expf(s[j] - lt) : 0.0f;
                        s[j] = p;
                        dp[j] = p * (dp[j] - D); /* dS (without the scale) */
                    }
                    for (int d = 0; d < HD; d++) dq[d] = 0.0f;
                    for (int j = 0; j < jmax; j++) {
                        float p = s[j], ds = dp[j];
                        float *dv = dV + j * HD, *dk = dK + j * HD;
                        const float *kr = K + (size_t)(k0 + j) * W;
#pragma omp simd
                        for (int d = 0; d < HD; d++) {
                            dv[d] += p * dO[d];
                            dk[d] += ds * qs[d]; /* scale folded into qs */
                            dq[d] += ds * kr[d];
                        }
                    }
                    float *dqr = dbase + (size_t)t * W + (size_t)h * HD;
#pragma omp simd
                    for (int d = 0; d < HD; d++) dqr[d] += scale * dq[d];
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
