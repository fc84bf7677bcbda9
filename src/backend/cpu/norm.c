/* RMSNorm (LLaMA) and LayerNorm (GPT-2), forward and backward.
 *
 * Row statistics are accumulated in double (C is up to a few thousand; float
 * would lose ~1e-6 relative, double costs nothing measurable here). Forward and
 * the input-gradient part of backward are parallel over rows. The weight/bias
 * gradients are reductions over rows, so they run in a second pass that is
 * parallel over column blocks, each column summed over rows in row order by a
 * single thread: deterministic without atomics, independent of thread count. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define COL_BLOCK 32

void fl_cpu_rmsnorm_forward(const fl_backend *be, float *out /*(N,C)*/, float *rstd /*(N)*/,
                            const float *inp /*(N,C)*/, const float *w /*(C)*/, int N, int C, float eps) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * C >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        double ss = 0.0;
        /* FL_VECTORIZE: rmsnorm_sumsq */
#pragma omp simd reduction(+ : ss)
        for (int c = 0; c < C; c++) ss += (double)x[c] * x[c];
        float r = (float)(1.0 / sqrt(ss / C + (double)eps));
        /* FL_VECTORIZE: rmsnorm_out */
#pragma omp simd
        for (int c = 0; c < C; c++) o[c] = x[c] * r * w[c];
        if (rstd) rstd[n] = r;
    }
}

void fl_cpu_rmsnorm_backward(const fl_backend *be, float *dinp /*(N,C)*/, float *dw /*(C) or NULL*/,
                             const float *dout /*(N,C)*/, const float *inp /*(N,C)*/, const float *w /*(C)*/,
                             const float *rstd /*(N)*/, int N, int C) {
    /* y = xhat * w, xhat = x * r.  dxhat = dy * w;
     * dx = r * (dxhat - xhat * mean(dxhat * xhat)). */
    if (dinp) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * C >= FL_CPU_PAR_MIN)
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float r = rstd[n];
            double dot = 0.0;
            /* FL_VECTORIZE: rmsnorm_bwd_dot */
#pragma omp simd reduction(+ : dot)
            for (int c = 0; c < C; c++) dot += (double)(dy[c] * w[c]) * (x[c] * r);
            float mdot = (float)(dot / C);
            /* FL_VECTORIZE: rmsnorm_bwd_dx */
#pragma omp simd
            for (int c = 0; c < C; c++) dx[c] += r * (dy[c] * w[c] - x[c] * r * mdot);
        }
    }
    if (dw) {
        int nblk = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * C >= FL_CPU_PAR_MIN)
        for (int blk = 0; blk < nblk; blk++) {
            int c0 = blk * COL_BLOCK, c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;
            float acc[COL_BLOCK] = {0}; // (COL_BLOCK) partial dw of this column block
            for (int n = 0; n < N; n++) {
                const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
                float r = rstd[n];
                /* FL_VECTORIZE: rmsnorm_dw */
                for (int c = c0; c < c1; c++) acc[c - c0] += dy[c] * (x[c] * r);
            }
            for (int c = c0; c < c1; c++) dw[c] += acc[c - c0];
        }
    }
}

void fl_cpu_layernorm_forward(const fl_backend *be, float *out /*(N,C)*/, float *mean /*(N)*/, float *rstd /*(N)*/,
                              const float *inp /*(N,C)*/, const float *w /*(C)*/, const float *b /*(C) or NULL*/,
                              int N, int C, float eps) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * C >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *o = out + (size_t)n * C;
        double s = 0.0;
        /* FL_VECTORIZE: layernorm_sum */
#pragma omp simd reduction(+ : s)
        for (int c = 0; c < C; c++) s += x[c];
        double mu = s / C;
        /* Two-pass (biased) variance: no cancellation for large-mean rows. */
        double v = 0.0;
        /* FL_VECTORIZE: layernorm_var */
#pragma omp simd reduction(+ : v)
        for (int c = 0; c < C; c++) {
            double d = x[c] - mu;
            v += d * d;
        }
        float m = (float)mu, r = (float)(1.0 / sqrt(v / C + (double)eps));
        if (b) {
            /* FL_VECTORIZE: layernorm_out_bias */
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = (x[c] - m) * r * w[c] + b[c];
        } else {
            /* FL_VECTORIZE: layernorm_out */
#pragma omp simd
            for (int c = 0; c < C; c++) o[c] = (x[c] - m) * r * w[c];
        }
        if (mean) mean[n] = m;
        if (rstd) rstd[n] = r;
    }
}

void fl_cpu_layernorm_backward(const fl_backend *be, float *dinp /*(N,C)*/, float *dw /*(C) or NULL*/,
                               float *db /*(C) or NULL*/, const float *dout /*(N,C)*/, const float *inp /*(N,C)*/,
                               const float *w /*(C)*/, const float *mean /*(N)*/, const float *rstd /*(N)*/, int N,
                               int C) {
    /* dxhat = dy * w;  dx = r * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)). */
    if (dinp) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * C >= FL_CPU_PAR_MIN)
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            float *dx = dinp + (size_t)n * C;
            float m = mean[n], r = rstd[n];
            double s1 = 0.0, s2 = 0.0;
            /* FL_VECTORIZE: layernorm_bwd_dots */
#pragma omp simd reduction(+ : s1, s2)
            for (int c = 0; c < C; c++) {
                float g = dy[c] * w[c];
                s1 += g;
                s2 += (double)g * ((x[c] - m) * r);
            }
            float m1 = (float)(s1 / C), m2 = (float)(s2 / C);
            /* FL_VECTORIZE: layernorm_bwd_dx */
#pragma omp simd
            for (int c = 0; c < C; c++) dx[c] += r * (dy[c] * w[c] - m1 - (x[c] - m) * r * m2);
        }
    }
    if (dw || db) {
        int nblk = (C + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * C >= FL_CPU_PAR_MIN)
        for (int blk = 0; blk < nblk; blk++) {
            int c0 = blk * COL_BLOCK, c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;
            float aw[COL_BLOCK] = {0}, ab[COL_BLOCK] = {0}; // (COL_BLOCK) partial dw, db
            for (int n = 0; n < N; n++) {
                const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
                float m = mean[n], r = rstd[n];
                /* FL_VECTORIZE: layernorm_dw_db */
                for (int c = c0; c < c1; c++) {
                    aw[c - c0] += dy[c] * ((x[c] - m) * r);
                    ab[c - c0] += dy[c];
                }
            }
            if (dw)
                for (int c = c0; c < c1; c++) dw[c] += aw[c - c0];
            if (db)
                for (int c = c0; c < c1; c++) db[c] += ab[c - c0];
        }
    }
}
