/* LoRA branch ops (backend lora_forward / lora_backward; semantics in fitllm/backend.h).
 * Four small GEMMs through be->gemm plus the dropout mask (fitllm/lora.h: a pure function of
 * (seed, element index), so it is the same for any thread count and backward regenerates it). */
#include <omp.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/lora.h"

fl_status fl_cpu_lora_forward(const fl_backend *be, float *y, int ldy, float *h, float *xd, const float *x,
                              const float *A, const float *B, int N, int in, int out, int r, float scaling,
                              float dropout, uint64_t seed) {
    FL_TRY(fl_lora_check_args("lora_forward", N, in, out, r, ldy, dropout));
    if (N == 0) return FL_OK;
    const float *xb = x;
    if (dropout > 0.0f) {
        if (!xd) return fl_errorf(FL_ERR_INVALID, "lora_forward: dropout %g needs the xd buffer", (double)dropout);
        const float sc = fl_lora_dropout_scale(dropout);
        const size_t n = (size_t)N * in;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
        for (size_t i = 0; i < n; i++) xd[i] = fl_lora_dropout_keep(seed, i, dropout) ? x[i] * sc : 0.0f;
        xb = xd;
    }
    /* h (N, r) = xb (N, in) @ A^T */
    FL_TRY(be->gemm(be, 0, 1, N, r, in, 1.0f, xb, FL_F32, in, A, FL_F32, in, 0.0f, h, FL_F32, r));
    /* y (N, out) += scaling * h @ B^T */
    FL_TRY(be->gemm(be, 0, 1, N, out, r, scaling, h, FL_F32, r, B, FL_F32, r, 1.0f, y, FL_F32, ldy));
    return FL_OK;
}

fl_status fl_cpu_lora_backward(const fl_backend *be, float *dx, float *dA, float *dB, const float *dy, int ldy,
                               const float *xb, const float *h, const float *A, const float *B, int N, int in,
                               int out, int r, float scaling, float dropout, uint64_t seed, float *work) {
    FL_TRY(fl_lora_check_args("lora_backward", N, in, out, r, ldy, dropout));
    if (N == 0) return FL_OK;
    if (!work) return fl_errorf(FL_ERR_INVALID, "lora_backward: NULL work buffer");
    /* dB (out, r) += scaling * dy^T (out, N) @ h (N, r) */
    if (dB) FL_TRY(be->gemm(be, 1, 0, out, r, N, scaling, dy, FL_F32, ldy, h, FL_F32, r, 1.0f, dB, FL_F32, r));
    if (!dA && !dx) return FL_OK;
    /* g (N, r) = dy @ B */
    float *g = work;
    FL_TRY(be->gemm(be, 0, 0, N, r, out, 1.0f, dy, FL_F32, ldy, B, FL_F32, r, 0.0f, g, FL_F32, r));
    /* dA (r, in) += scaling * g^T @ xb */
    if (dA) FL_TRY(be->gemm(be, 1, 0, r, in, N, scaling, g, FL_F32, r, xb, FL_F32, in, 1.0f, dA, FL_F32, in));
    if (!dx) return FL_OK;
    if (dropout == 0.0f) {
        /* dx (N, in) += scaling * g @ A */
        FL_TRY(be->gemm(be, 0, 0, N, in, r, scaling, g, FL_F32, r, A, FL_F32, in, 1.0f, dx, FL_F32, in));
        return FL_OK;
    }
    float *t = work + (size_t)N * r;
    FL_TRY(be->gemm(be, 0, 0, N, in, r, scaling, g, FL_F32, r, A, FL_F32, in, 0.0f, t, FL_F32, in));
    const float sc = fl_lora_dropout_scale(dropout);
    const size_t n = (size_t)N * in;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++)
        if (fl_lora_dropout_keep(seed, i, dropout)) dx[i] += t[i] * sc;
    return FL_OK;
}

/* backend.h dropout: the LoRA branch's mask on any tensor (T5's dropout), overwriting (in place too) or adding */
fl_status fl_cpu_dropout(const fl_backend *be, float *y, const float *x, size_t n, float p, uint64_t seed,
                         int accumulate) {
    if (!(p >= 0.0f && p < 1.0f)) return fl_errorf(FL_ERR_INVALID, "dropout: p %g outside [0, 1)", (double)p);
    if (n && (!y || !x)) return fl_errorf(FL_ERR_INVALID, "dropout: NULL buffer (n=%zu)", n);
    const float sc = fl_lora_dropout_scale(p);
    /* (a small tensor on one thread: each element's mask is a function of its index alone, so the same bits) */
    if (accumulate) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
        for (size_t i = 0; i < n; i++)
            if (fl_lora_dropout_keep(seed, i, p)) y[i] += x[i] * sc;
    } else {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
        for (size_t i = 0; i < n; i++) y[i] = fl_lora_dropout_keep(seed, i, p) ? x[i] * sc : 0.0f;
    }
    return FL_OK;
}

/* backend.h dropout_rows: dropout's mask at index r stride + j of row r (keep(seed, i0 + j) is keep(seed + i0 K, j):
 * the bits of one dropout call per row at the row's shifted seed) */
fl_status fl_cpu_dropout_rows(const fl_backend *be, float *y, const float *x, int rows, size_t w, size_t stride, float p,
                              uint64_t seed, int accumulate) {
    if (!(p >= 0.0f && p < 1.0f)) return fl_errorf(FL_ERR_INVALID, "dropout_rows: p %g outside [0, 1)", (double)p);
    if (rows < 0 || stride < w)
        return fl_errorf(FL_ERR_INVALID, "dropout_rows: %d rows of %zu values, row stride %zu (< the width)", rows, w,
                         stride);
    if (rows && w && (!y || !x)) return fl_errorf(FL_ERR_INVALID, "dropout_rows: NULL buffer (%d rows)", rows);
    const float sc = fl_lora_dropout_scale(p);
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)rows * w >= FL_CPU_PAR_MIN)
    for (int r = 0; r < rows; r++) {
        float *yr = y + (size_t)r * w;
        const float *xr = x + (size_t)r * w;
        const size_t i0 = (size_t)r * stride;
        if (accumulate) {
            for (size_t j = 0; j < w; j++)
                if (fl_lora_dropout_keep(seed, i0 + j, p)) yr[j] += xr[j] * sc;
        } else {
            for (size_t j = 0; j < w; j++) yr[j] = fl_lora_dropout_keep(seed, i0 + j, p) ? xr[j] * sc : 0.0f;
        }
    }
    return FL_OK;
}
