/* Elementwise ops, bias, and the deterministic sum of squares (grad-norm clipping).
 *
 * Everything here is either purely elementwise (any partition gives the same
 * bits) or a reduction whose partition does not depend on the thread count
 * (bias columns, the fixed ranges of fl_cpu_sum_parts), so results are
 * reproducible for any thread count. */
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

/* Column block owned by one thread in column-parallel reductions: wide enough
 * for two AVX-512 vectors, small enough to spread OC=768 over many threads. */
#define COL_BLOCK 32

void fl_cpu_zero(const fl_backend *be, void *x, size_t bytes) {
    /* Gradients and backward scratch: large clears run on all threads, each a contiguous
     * 4 KiB-aligned piece; small ones are not worth a parallel region. */
    const size_t par_min = (size_t)8 << 20;
    int nt = be->n_threads;
    if (nt <= 1 || bytes < par_min) {
        if (bytes) memset(x, 0, bytes);
        return;
    }
    size_t npg = (bytes + 4095) / 4096;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int c = 0; c < nt; c++) {
        size_t b = npg * c / nt * 4096, e = npg * (c + 1) / nt * 4096;
        if (e > bytes) e = bytes;
        if (e > b) memset((char *)x + b, 0, e - b);
    }
}

void fl_cpu_scale(const fl_backend *be, float *x /*(n)*/, size_t n, float s) {
    /* FL_VECTORIZE: scale */
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

void fl_cpu_add(const fl_backend *be, float *out /*(n)*/, const float *a /*(n)*/, const float *b /*(n)*/, size_t n) {
    /* out may alias a or b: each element is read before it is written. */
    /* FL_VECTORIZE: add */
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void fl_cpu_bias_forward(const fl_backend *be, float *y /*(N,OC)*/, const float *b /*(OC)*/, int N, int OC) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * OC >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        float *yr = y + (size_t)n * OC;
        /* FL_VECTORIZE: bias_fwd */
#pragma omp simd
        for (int o = 0; o < OC; o++) yr[o] += b[o];
    }
}

void fl_cpu_bias_backward(const fl_backend *be, float *db /*(OC)*/, const float *dy /*(N,OC)*/, int N, int OC) {
    if (!db) return;
    /* Parallel over column blocks; each column is summed over rows in order by
     * one thread, so the result does not even depend on the thread count. */
    int nblk = (OC + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * OC >= FL_CPU_PAR_MIN)
    for (int blk = 0; blk < nblk; blk++) {
        int c0 = blk * COL_BLOCK, c1 = c0 + COL_BLOCK < OC ? c0 + COL_BLOCK : OC;
        float acc[COL_BLOCK]; // (COL_BLOCK) column partial sums
        for (int c = 0; c < COL_BLOCK; c++) acc[c] = 0.0f;
        for (int n = 0; n < N; n++) {
            const float *r = dy + (size_t)n * OC;
            /* FL_VECTORIZE: bias_bwd */
            for (int c = c0; c < c1; c++) acc[c - c0] += r[c];
        }
        for (int c = c0; c < c1; c++) db[c] += acc[c - c0];
    }
}

double fl_cpu_sumsq_f32(const fl_backend *be, const float *x /*(n)*/, size_t n) {
    /* Fixed ranges (fl_cpu_sum_parts: set by n, not by the thread count), each summed in order,
     * partials added in range order: the same bits for any thread count. */
    const int P = fl_cpu_sum_parts(n);
    double part[FL_CPU_SUM_PARTS]; // (P) per-range partial sums
#pragma omp parallel for num_threads(be->n_threads > 0 ? be->n_threads : 1) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (int c = 0; c < P; c++) {
        size_t i0 = n * (size_t)c / (size_t)P, i1 = n * (size_t)(c + 1) / (size_t)P;
        double s = 0.0;
        /* FL_VECTORIZE: sumsq */
#pragma omp simd reduction(+ : s)
        for (size_t i = i0; i < i1; i++) s += (double)x[i] * (double)x[i];
        part[c] = s;
    }
    double s = 0.0;
    for (int c = 0; c < P; c++) s += part[c];
    return s;
}
