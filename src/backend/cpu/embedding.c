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
