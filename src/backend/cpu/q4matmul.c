/* Fused 4-bit dequantize-matmul (backend q4_matmul_forward / q4_matmul_backward, see
 * fitllm/backend.h and fitllm/quant4.h). Normal FP flags (FMA allowed): the result is checked
 * against dequantize-then-GEMM in float64 within fp32 rounding, not bit for bit. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/quant4.h"

/* ---- panel path (the default): dequantize-then-GEMM in panels --------------------------------
 * A panel of whole rows of deq(W) (at most FL_Q4_SCRATCH floats, 8 MiB) is dequantized into one
 * fixed scratch (allocated on first use, process-wide, mutex-guarded, kept until exit) and
 * multiplied with the backend's fp32 GEMM (oneDNN / OpenBLAS): the full dequantized layer never
 * exists, and the multiply runs at sgemm speed (the register-blocked fused kernel below reaches
 * about a fifth of it; it remains the fallback when the scratch cannot be allocated). Panel
 * sizes depend only on the shape, so results are deterministic for a fixed thread count.
 *   forward:  y[:, r0:r0+R] = x @ deq(W[r0:r0+R, :])^T (+ y when beta 1)
 *   backward: dx = sum over panels dy[:, r0:r0+R] @ deq(W[r0:r0+R, :]) (+ dx when beta 1) */
#define FL_Q4_SCRATCH FL_CPU_Q4_SCRATCH

static struct {
    pthread_mutex_t mu;
    float *buf;
    int failed;
} g_q4 = {PTHREAD_MUTEX_INITIALIZER, NULL, 0};

static void q4_dequant_panel(const fl_backend *be, const fl_q4_weight *w, int r0, int R, float *dst) {
    const int IN = w->cols;
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int r = 0; r < R; r += 8) {
        int nr = R - r < 8 ? R - r : 8;
        fl_q4_dequantize_tile(w, r0 + r, nr, 0, IN, dst + (size_t)r * IN, IN);
    }
}

/* 1: done via panels; 0: no scratch (caller runs the fused kernel). */
static int q4_panels(const fl_backend *be, int fwd, float *out, int ldo, const float *in, int ldi,
                     const fl_q4_weight *w, int N, float beta, fl_status *st) {
    const int OUT = w->rows, IN = w->cols;
    /* the lent scratch (fl_backend.set_scratch: the model's WORKSPACE), else the process-wide
     * fallback allocated on first use (op tests, tools) */
    float *buf = fl_cpu_scratch_part(1);
    int locked = !buf;
    if (locked) {
        pthread_mutex_lock(&g_q4.mu);
        if (!g_q4.buf && !g_q4.failed) {
            g_q4.buf = malloc(FL_Q4_SCRATCH * sizeof(float));
            g_q4.failed = g_q4.buf == NULL;
        }
        buf = g_q4.buf;
    }
    if (!buf || (size_t)IN > FL_Q4_SCRATCH) {
        if (locked) pthread_mutex_unlock(&g_q4.mu);
        return 0;
    }
    const int R = (int)((size_t)FL_Q4_SCRATCH / (size_t)IN < (size_t)OUT ? FL_Q4_SCRATCH / (size_t)IN : (size_t)OUT);
    *st = FL_OK;
    for (int r0 = 0; r0 < OUT && *st == FL_OK; r0 += R) {
        const int nr = OUT - r0 < R ? OUT - r0 : R;
        q4_dequant_panel(be, w, r0, nr, buf);
        if (fwd) /* out = y (N, OUT; ldy), in = x (N, IN) */
            *st = be->gemm(be, 0, 1, N, nr, IN, 1.0f, in, FL_F32, IN, buf, FL_F32, IN, beta, out + r0, FL_F32, ldo);
        else /* out = dx (N, IN), in = dy (N, OUT; ldy) */
            *st = be->gemm(be, 0, 0, N, IN, nr, 1.0f, in + r0, FL_F32, ldi, buf, FL_F32, IN,
                           r0 == 0 ? beta : 1.0f, out, FL_F32, IN);
    }
    if (locked) pthread_mutex_unlock(&g_q4.mu);
    return 1;
}

/* ---- fused dequantize-matmul (fallback) -----------------------------------------------------
 * Tiles of TR rows x TK columns of deq(W) (TR*TK*4 = 32 KB) are dequantized into a stack buffer
 * of the thread that owns them; the full dequantized layer never exists.
 * forward: threads split the OUTPUT columns (W rows) in TR-row panels; each (TR x TK) tile is
 *          transposed once and y[n, panel] += sum_k x[n, k] * tile^T[k, :] runs as 4-row x 32-wide
 *          register-blocked axpys (fixed order).
 * backward: threads split the INPUT columns (W columns) in TK-column panels; for each panel and
 *          each row tile, dx[:, panel] += dy[:, rtile] @ tile in 4-row x 32-column register blocks.
 * Each output element is produced by one thread in a fixed order: results do not depend on the
 * thread count. */
#define Q4_TR 32
#define Q4_TK 256

static fl_status q4_check(const fl_q4_weight *w, const char *who) {
    if (!w || !w->packed || w->rows <= 0 || w->cols <= 0)
        return fl_errorf(FL_ERR_INVALID, "%s: unbound 4-bit weight", who);
    return FL_OK;
}

fl_status fl_cpu_q4_matmul_forward(const fl_backend *be, float *y, int ldy, const float *x, const fl_q4_weight *w,
                                   int N, float beta) {
    FL_TRY(q4_check(w, "q4_matmul_forward"));
    if (beta != 0.0f && beta != 1.0f) return fl_errorf(FL_ERR_INVALID, "q4_matmul_forward: beta must be 0 or 1");
    fl_status st;
    if (N > 0 && q4_panels(be, 1, y, ldy, x, w->cols, w, N, beta, &st)) return st;
    const int OUT = w->rows, IN = w->cols;
    const int n_panels = (OUT + Q4_TR - 1) / Q4_TR;
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int p = 0; p < n_panels; p++) {
        float tile[Q4_TR * Q4_TK] __attribute__((aligned(64)));
        float tt[Q4_TK * Q4_TR] __attribute__((aligned(64))); /* tile transposed: (k, r), zero-padded rows */
        const int r0 = p * Q4_TR, nr = OUT - r0 < Q4_TR ? OUT - r0 : Q4_TR;
        if (beta == 0.0f)
            for (int n = 0; n < N; n++) memset(y + (size_t)n * ldy + r0, 0, nr * sizeof(float));
        for (int k0 = 0; k0 < IN; k0 += Q4_TK) {
            const int kk = IN - k0 < Q4_TK ? IN - k0 : Q4_TK;
            fl_q4_dequantize_tile(w, r0, nr, k0, k0 + kk, tile, Q4_TK);
            for (int k = 0; k < kk; k++) {
                for (int r = 0; r < nr; r++) tt[k * Q4_TR + r] = tile[r * Q4_TK + k];
                for (int r = nr; r < Q4_TR; r++) tt[k * Q4_TR + r] = 0.0f;
            }
            int n = 0;
            /* y[n, r0:r0+32] += sum_k x[n, k] * tt[k, :], four rows of x at a time */
            for (; n + 4 <= N; n += 4) {
                float a0[Q4_TR] = {0}, a1[Q4_TR] = {0}, a2[Q4_TR] = {0}, a3[Q4_TR] = {0};
                const float *x0 = x + (size_t)n * IN + k0, *x1 = x0 + IN, *x2 = x1 + IN, *x3 = x2 + IN;
                for (int k = 0; k < kk; k++) {
                    const float *t = tt + k * Q4_TR;
                    const float c0 = x0[k], c1 = x1[k], c2 = x2[k], c3 = x3[k];
                    for (int r = 0; r < Q4_TR; r++) {
                        a0[r] += c0 * t[r];
                        a1[r] += c1 * t[r];
                        a2[r] += c2 * t[r];
                        a3[r] += c3 * t[r];
                    }
                }
                float *y0 = y + (size_t)n * ldy + r0;
                for (int r = 0; r < nr; r++) {
                    y0[r] += a0[r];
                    y0[ldy + r] += a1[r];
                    y0[2 * (size_t)ldy + r] += a2[r];
                    y0[3 * (size_t)ldy + r] += a3[r];
                }
            }
            for (; n < N; n++) {
                float a0[Q4_TR] = {0};
                const float *x0 = x + (size_t)n * IN + k0;
                for (int k = 0; k < kk; k++) {
                    const float *t = tt + k * Q4_TR;
                    const float c0 = x0[k];
                    for (int r = 0; r < Q4_TR; r++) a0[r] += c0 * t[r];
                }
                float *y0 = y + (size_t)n * ldy + r0;
                for (int r = 0; r < nr; r++) y0[r] += a0[r];
            }
        }
    }
    return FL_OK;
}

fl_status fl_cpu_q4_matmul_backward(const fl_backend *be, float *dx, const float *dy, int ldy, const fl_q4_weight *w,
                                    int N, float beta) {
    FL_TRY(q4_check(w, "q4_matmul_backward"));
    if (beta != 0.0f && beta != 1.0f) return fl_errorf(FL_ERR_INVALID, "q4_matmul_backward: beta must be 0 or 1");
    fl_status st;
    if (N > 0 && q4_panels(be, 0, dx, w->cols, dy, ldy, w, N, beta, &st)) return st;
    const int OUT = w->rows, IN = w->cols;
    const int n_panels = (IN + Q4_TK - 1) / Q4_TK;
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int p = 0; p < n_panels; p++) {
        float tile[Q4_TR * Q4_TK] __attribute__((aligned(64)));
        const int k0 = p * Q4_TK, kk = IN - k0 < Q4_TK ? IN - k0 : Q4_TK;
        memset(tile, 0, sizeof tile); /* columns kk..TK-1 stay 0: the 32-wide loop reads them */
        if (beta == 0.0f)
            for (int n = 0; n < N; n++) memset(dx + (size_t)n * IN + k0, 0, kk * sizeof(float));
        for (int r0 = 0; r0 < OUT; r0 += Q4_TR) {
            const int nr = OUT - r0 < Q4_TR ? OUT - r0 : Q4_TR;
            fl_q4_dequantize_tile(w, r0, nr, k0, k0 + kk, tile, Q4_TK);
            /* dx[n, k0+kc : +32] += sum_r dy[n, r0+r] * tile[r, kc : kc+32], 4 rows x 32 in registers */
            for (int kc = 0; kc < kk; kc += 32) {
                const int kw = kk - kc < 32 ? kk - kc : 32;
                int n = 0;
                for (; n + 4 <= N; n += 4) {
                    float a0[32] = {0}, a1[32] = {0}, a2[32] = {0}, a3[32] = {0};
                    const float *g0 = dy + (size_t)n * ldy + r0, *g1 = g0 + ldy, *g2 = g1 + ldy, *g3 = g2 + ldy;
                    for (int r = 0; r < nr; r++) {
                        const float *t = tile + (size_t)r * Q4_TK + kc;
                        const float c0 = g0[r], c1 = g1[r], c2 = g2[r], c3 = g3[r];
                        for (int k = 0; k < 32; k++) {
                            a0[k] += c0 * t[k];
                            a1[k] += c1 * t[k];
                            a2[k] += c2 * t[k];
                            a3[k] += c3 * t[k];
                        }
                    }
                    float *d0 = dx + (size_t)n * IN + k0 + kc;
                    for (int k = 0; k < kw; k++) {
                        d0[k] += a0[k];
                        d0[IN + k] += a1[k];
                        d0[2 * (size_t)IN + k] += a2[k];
                        d0[3 * (size_t)IN + k] += a3[k];
                    }
                }
                for (; n < N; n++) {
                    float a0[32] = {0};
                    const float *g0 = dy + (size_t)n * ldy + r0;
                    for (int r = 0; r < nr; r++) {
                        const float *t = tile + (size_t)r * Q4_TK + kc;
                        const float c0 = g0[r];
                        for (int k = 0; k < 32; k++) a0[k] += c0 * t[k];
                    }
                    float *d0 = dx + (size_t)n * IN + k0 + kc;
                    for (int k = 0; k < kw; k++) d0[k] += a0[k];
                }
            }
        }
    }
    return FL_OK;
}
