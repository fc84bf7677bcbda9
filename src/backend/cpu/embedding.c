/* Token (+ learned position) embedding lookup and its backward.
 *
 * Backward scatters rows of dout into dwte at the token ids; ids repeat, so a
 * row-parallel scatter would race. Instead each thread owns a block of columns
 * of dwte and walks all (b,t) in order: no atomics, and the summation order per
 * element is fixed (it does not even depend on the thread count). */
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define COL_BLOCK 64

void fl_cpu_embedding_forward(const fl_backend *be, float *out /*(B,T,C)*/, const int32_t *ids /*(B,T)*/,
                              const float *wte /*(V,C)*/, const float *wpe /*(maxT,C) or NULL*/, int B, int T,
                              int C) {
    int N = B * T;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * C >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        int t = n % T;
        float *o = out + (size_t)n * C;
        const float *e = wte + (size_t)ids[n] * C;
        if (wpe) {
            const float *p = wpe + (size_t)t * C;
            /* FL_VECTORIZE: embedding_fwd */
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = e[c] + p[c];
        } else {
            memcpy(o, e, (size_t)C * sizeof(float));
        }
    }
}

void fl_cpu_embedding_backward(const fl_backend *be, float *dwte /*(V,C) or NULL*/, float *dwpe /*(maxT,C) or NULL*/,
                               const float *dout /*(B,T,C)*/, const int32_t *ids /*(B,T)*/, int B, int T, int C) {
    int N = B * T;
    if (dwte) {
        int nblk = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)B * T * C >= FL_CPU_PAR_MIN)
        for (int blk = 0; blk < nblk; blk++) {
            int c0 = blk * COL_BLOCK, c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;
            for (int n = 0; n < N; n++) {
                float *d = dwte + (size_t)ids[n] * C;
                const float *g = dout + (size_t)n * C;
                /* FL_VECTORIZE: embedding_bwd_wte */
#pragma omp simd
                for (int c = c0; c < c1; c++) d[c] += g[c];
            }
        }
    }
    if (dwpe) {
        /* Each position t is owned by one thread; batches are added in order. */
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)B * T * C >= FL_CPU_PAR_MIN)
        for (int t = 0; t < T; t++) {
            float *d = dwpe + (size_t)t * C;
            for (int b = 0; b < B; b++) {
                const float *g = dout + ((size_t)b * T + t) * C;
                /* FL_VECTORIZE: embedding_bwd_wpe */
#pragma omp simd
                for (int c = 0; c < C; c++) d[c] += g[c];
            }
        }
    }
}

/* ---- T5's relative position bias (backend.h's relbias_forward / relbias_backward) ----------------------------------
 * Query i and key j take bucket rb[j - i + Tq - 1]. The backward's order is the contract's (the GPU kernel's): per
 * diagonal r = j - i, 32 partial sums dealt by row (i mod 32), each in increasing i, combined as a warp's butterfly;
 * then each bucket's sum over its diagonals in increasing r, added to dtab once. Here a block of RB_DIAG diagonals at
 * a time: row i's elements on them are contiguous (j = i + r), so each row adds one vector into partial i mod 32. */
#define RB_DIAG 64

void fl_cpu_relbias_forward(const fl_backend *be, float *bias /*(NH,Tq,Tk)*/, const float *tab /*(NH,nb)*/,
                            const int32_t *rb /*(Tq+Tk-1)*/, int NH, int Tq, int Tk, int nb) {
    if (NH <= 0 || Tq <= 0 || Tk <= 0) return;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)NH * Tq * Tk >= FL_CPU_PAR_MIN)
    for (int hi = 0; hi < NH * Tq; hi++) {
        const int h = hi / Tq, i = hi % Tq;
        const int32_t *r = rb + (Tq - 1 - i); /* r[j]: bucket of (i, j) */
        const float *t = tab + (size_t)h * nb;
        float *o = bias + (size_t)hi * Tk;
        for (int j = 0; j < Tk; j++) o[j] = r[j] >= 0 && r[j] < nb ? t[r[j]] : 0.0f;
    }
}

fl_status fl_cpu_relbias_backward(const fl_backend *be, float *dtab /*(NH,nb)*/, const float *dbias /*(NH,Tq,Tk)*/,
                                  const int32_t *rb /*(Tq+Tk-1)*/, int NH, int Tq, int Tk, int nb) {
    if (NH < 0 || Tq < 0 || Tk < 0 || nb <= 0 || nb > FL_RELBIAS_MAX_BUCKETS)
        return fl_errorf(FL_ERR_INVALID, "%s relbias_backward: bad shape (NH %d, Tq %d, Tk %d, %d buckets: 1 .. %d)",
                         be->name, NH, Tq, Tk, nb, FL_RELBIAS_MAX_BUCKETS);
    if (NH == 0 || Tq == 0 || Tk == 0) return FL_OK;
    const int nd = Tq + Tk - 1;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)NH * Tq * Tk >= FL_CPU_PAR_MIN)
    for (int h = 0; h < NH; h++) {
        float acc[FL_RELBIAS_MAX_BUCKETS];
        float P[32][RB_DIAG];
        memset(acc, 0, (size_t)nb * sizeof *acc);
        for (int k0 = 0; k0 < nd; k0 += RB_DIAG) {
            const int kn = nd - k0 < RB_DIAG ? nd - k0 : RB_DIAG, r0 = k0 - (Tq - 1);
            memset(P, 0, sizeof P);
            for (int i = 0; i < Tq; i++) {
                /* diagonal r0 + kk meets row i at j = i + r0 + kk, inside [0, Tk) for kk in [lo, hi) */
                const int j0 = i + r0, lo = j0 < 0 ? -j0 : 0, hi = Tk - j0 < kn ? Tk - j0 : kn;
                if (lo >= hi) continue;
                float *p = P[i & 31];
                const float *d = dbias + ((size_t)h * Tq + i) * Tk + j0;
                /* FL_VECTORIZE: relbias_bwd_rows */
#pragma omp simd
                for (int kk = lo; kk < hi; kk++) p[kk] += d[kk];
            }
            for (int kk = 0; kk < kn; kk++) {
                float w[32];
                for (int s = 0; s < 32; s++) w[s] = P[s][kk];
                for (int off = 16; off > 0; off >>= 1)
                    for (int s = 0; s < off; s++) w[s] = w[s] + w[s + off];
                const int b = rb[k0 + kk];
                if (b >= 0 && b < nb) acc[b] += w[0];
            }
        }
        float *t = dtab + (size_t)h * nb;
        for (int b = 0; b < nb; b++) t[b] += acc[b];
    }
    return FL_OK;
}
