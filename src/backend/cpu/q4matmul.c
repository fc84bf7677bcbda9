/* Fused 4-bit dequantize-matmul (backend q4_matmul_forward / q4_matmul_backward, see
 * fitllm/backend.h and fitllm/quant4.h). Normal FP flags (FMA allowed): the result is checked
 * against dequantize-then-GEMM in float64 within fp32 rounding, not bit for bit. */
#include <string.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/quant4.h"

/* ---- fused dequantize-matmul --------------------------------------------------------------
 * Tiles of TR rows x TK columns of deq(W) (TR*TK*4 = 32 KB) are dequantized into a stack buffer
 * of the thread that owns them; the full dequantized layer never exists.
 * forward: threads split the OUTPUT columns (W rows) in TR-row panels; for each panel and each
 *          K tile, y[:, panel] += x[:, ktile] @ tile^T with 8-lane partial sums (fixed order).
 * backward: threads split the INPUT columns (W columns) in TK-column panels; for each panel and
 *          each row tile, acc[:, panel] += dy[:, rtile] @ tile, then dx += acc (or =).
 * Each output element is produced by one thread in a fixed order: results do not depend on the
 * thread count. */
#define Q4_TR 32
#define Q4_TK 256
#define Q4_LANES 8

static fl_status q4_check(const fl_q4_weight *w, const char *who) {
    if (!w || !w->packed || w->rows <= 0 || w->cols <= 0)
        return fl_errorf(FL_ERR_INVALID, "%s: unbound 4-bit weight", who);
    return FL_OK;
}

fl_status fl_cpu_q4_matmul_forward(const fl_backend *be, float *y, int ldy, const float *x, const fl_q4_weight *w,
                                   int N, float beta) {
    FL_TRY(q4_check(w, "q4_matmul_forward"));
    if (beta != 0.0f && beta != 1.0f) return fl_errorf(FL_ERR_INVALID, "q4_matmul_forward: beta must be 0 or 1");
    const int OUT = w->rows, IN = w->cols;
    const int n_panels = (OUT + Q4_TR - 1) / Q4_TR;
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int p = 0; p < n_panels; p++) {
        float tile[Q4_TR * Q4_TK] __attribute__((aligned(64)));
        const int r0 = p * Q4_TR, nr = OUT - r0 < Q4_TR ? OUT - r0 : Q4_TR;
        if (beta == 0.0f)
            for (int n = 0; n < N; n++) memset(y + (size_t)n * ldy + r0, 0, nr * sizeof(float));
        for (int k0 = 0; k0 < IN; k0 += Q4_TK) {
            const int kk = IN - k0 < Q4_TK ? IN - k0 : Q4_TK;
            fl_q4_dequantize_tile(w, r0, nr, k0, k0 + kk, tile, Q4_TK);
            const int kv = kk / Q4_LANES * Q4_LANES;
            for (int n = 0; n < N; n++) {
                const float *xr = x + (size_t)n * IN + k0;
                float *yr = y + (size_t)n * ldy + r0;
                int r = 0;
                for (; r + 4 <= nr; r += 4) {
                    float a0[Q4_LANES] = {0}, a1[Q4_LANES] = {0}, a2[Q4_LANES] = {0}, a3[Q4_LANES] = {0};
                    const float *t0 = tile + (size_t)r * Q4_TK, *t1 = t0 + Q4_TK, *t2 = t1 + Q4_TK, *t3 = t2 + Q4_TK;
                    for (int k = 0; k < kv; k += Q4_LANES)
                        for (int l = 0; l < Q4_LANES; l++) {
                            float xv = xr[k + l];
                            a0[l] += xv * t0[k + l];
                            a1[l] += xv * t1[k + l];
                            a2[l] += xv * t2[k + l];
                            a3[l] += xv * t3[k + l];
                        }
                    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
                    for (int l = 0; l < Q4_LANES; l++) { s0 += a0[l]; s1 += a1[l]; s2 += a2[l]; s3 += a3[l]; }
                    for (int k = kv; k < kk; k++) {
                        float xv = xr[k];
                        s0 += xv * t0[k]; s1 += xv * t1[k]; s2 += xv * t2[k]; s3 += xv * t3[k];
                    }
                    yr[r] += s0; yr[r + 1] += s1; yr[r + 2] += s2; yr[r + 3] += s3;
                }
                for (; r < nr; r++) {
                    float a0[Q4_LANES] = {0};
                    const float *t0 = tile + (size_t)r * Q4_TK;
                    for (int k = 0; k < kv; k += Q4_LANES)
                        for (int l = 0; l < Q4_LANES; l++) a0[l] += xr[k + l] * t0[k + l];
                    float s0 = 0;
                    for (int l = 0; l < Q4_LANES; l++) s0 += a0[l];
                    for (int k = kv; k < kk; k++) s0 += xr[k] * t0[k];
                    yr[r] += s0;
                }
            }
        }
    }
    return FL_OK;
}

fl_status fl_cpu_q4_matmul_backward(const fl_backend *be, float *dx, const float *dy, int ldy, const fl_q4_weight *w,
                                    int N, float beta) {
    FL_TRY(q4_check(w, "q4_matmul_backward"));
    if (beta != 0.0f && beta != 1.0f) return fl_errorf(FL_ERR_INVALID, "q4_matmul_backward: beta must be 0 or 1");
    const int OUT = w->rows, IN = w->cols;
    const int n_panels = (IN + Q4_TK - 1) / Q4_TK;
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int p = 0; p < n_panels; p++) {
        float tile[Q4_TR * Q4_TK] __attribute__((aligned(64)));
        const int k0 = p * Q4_TK, kk = IN - k0 < Q4_TK ? IN - k0 : Q4_TK;
        if (beta == 0.0f)
            for (int n = 0; n < N; n++) memset(dx + (size_t)n * IN + k0, 0, kk * sizeof(float));
        for (int r0 = 0; r0 < OUT; r0 += Q4_TR) {
            const int nr = OUT - r0 < Q4_TR ? OUT - r0 : Q4_TR;
            fl_q4_dequantize_tile(w, r0, nr, k0, k0 + kk, tile, Q4_TK);
            int n = 0;
            for (; n + 2 <= N; n += 2) {
                float acc0[Q4_TK] __attribute__((aligned(64)));
                float acc1[Q4_TK] __attribute__((aligned(64)));
                memset(acc0, 0, kk * sizeof(float));
                memset(acc1, 0, kk * sizeof(float));
                const float *g0 = dy + (size_t)n * ldy + r0, *g1 = g0 + ldy;
                for (int r = 0; r < nr; r++) {
                    const float *t = tile + (size_t)r * Q4_TK;
                    const float c0 = g0[r], c1 = g1[r];
                    for (int k = 0; k < kk; k++) {
                        acc0[k] += c0 * t[k];
                        acc1[k] += c1 * t[k];
                    }
                }
                float *d0 = dx + (size_t)n * IN + k0, *d1 = d0 + IN;
                for (int k = 0; k < kk; k++) { d0[k] += acc0[k]; d1[k] += acc1[k]; }
            }
            for (; n < N; n++) {
                float acc0[Q4_TK] __attribute__((aligned(64)));
                memset(acc0, 0, kk * sizeof(float));
                const float *g0 = dy + (size_t)n * ldy + r0;
                for (int r = 0; r < nr; r++) {
                    const float *t = tile + (size_t)r * Q4_TK;
                    const float c0 = g0[r];
                    for (int k = 0; k < kk; k++) acc0[k] += c0 * t[k];
                }
                float *d0 = dx + (size_t)n * IN + k0;
                for (int k = 0; k < kk; k++) d0[k] += acc0[k];
            }
        }
    }
    return FL_OK;
}
