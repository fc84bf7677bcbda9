/* fitllm_cuda_check, part 6: the step scalars (issue 30 item 5, 2026-11-29 15:40 wave; EXPERIMENTAL until this has
 * run on a GPU): the kernels that keep a step's gradient norm, clip scale and loss sums on the device.
 *   - clip_scale after sumsq_ex: the norm and the update's scale from the GPU's own sum, bit for bit the host's
 *     double arithmetic on that sum (fl_optim_step's); a NaN gradient gives a NaN scale;
 *   - check_finite_ss (fp16's overflow flag in the step scalars) = check_finite's verdict;
 *   - loss_sum over TinyLlama's micro-batch (8192 tokens, every 7th ignored): the host's sum in index order, bits;
 *   - adamw_update_ss / sgd_update_ss with the scale read on the device: the bits of adamw_update_ex /
 *     sgd_update_ex given the same scale (the same kernel body), and nothing changed under a NaN scale;
 *   - the time of loss_sum (8192 and 16384 losses: one adding thread over shared memory) and of clip_scale, which
 *     the step pays instead of a copy to the host and its wait (median of 9 after 2 warm-ups, cudaEvent). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/cu_kernels.h"
#include "fitllm/dtype.h"

int fl_cuda_check_ss(void);
float fl_cuda_check_time_ms(void (*fn)(void *), void *arg); /* check_fused.c: median of 9 after 2 warm-ups */

static int g_bad;

static void *dput(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc failed\n");
        exit(1);
    }
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    else cudaMemset(d, 0, bytes);
    return d;
}
static void say(const char *what, int ok, const char *detail) {
    printf("%-40s %s  (%s)\n", what, ok ? "ok  " : "FAIL", detail);
    g_bad += !ok;
}

static void check_clip_and_update(size_t n, int with_nan) {
    unsigned s = 11u + (unsigned)n;
    float *g = malloc(n * 4), *p = malloc(n * 4), *m = malloc(n * 4), *v = malloc(n * 4);
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        g[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 0.04f;
        p[i] = (float)(s >> 9) / 8388608.0f - 1.0f, m[i] = g[i] * 0.3f, v[i] = g[i] * g[i];
    }
    if (with_nan) g[n / 3] = NAN;
    float *dg = dput(g, n * 4), *dpa = dput(p, n * 4), *dma = dput(m, n * 4), *dva = dput(v, n * 4);
    float *dpb = dput(p, n * 4), *dmb = dput(m, n * 4), *dvb = dput(v, n * 4);
    double *dss = dput(NULL, (FL_CU_SS_LOSS + 1) * sizeof(double));
    double *dwork = dput(NULL, (1 + FL_CU_SUMSQ_PARTS) * sizeof(double));
    const float max_norm = 0.5f, scale = 1.0f;
    int rc = fl_cuk_sumsq_ex(dwork, dwork + 1, dg, FL_F32, n, NULL);
    rc = rc || fl_cuk_clip_scale(dss, dwork, max_norm, scale, NULL, 0, NULL);
    double sq = 0, h[2] = {0, 0};
    cudaMemcpy(&sq, dwork, sizeof sq, cudaMemcpyDeviceToHost);
    cudaMemcpy(h, dss, sizeof h, cudaMemcpyDeviceToHost);
    const double norm = sqrt(sq) * scale, c = max_norm / (norm + 1e-6);
    const float sc = c < 1.0 ? (float)(c * scale) : scale;
    char line[256];
    snprintf(line, sizeof line, "norm %.17g, scale %.9g; host on the GPU's sum: %.17g, %.9g", h[0], h[1], norm,
             (double)sc);
    say(with_nan ? "clip_scale (a NaN gradient)" : "clip_scale", !rc && (with_nan ? isnan(h[1]) : h[0] == norm &&
                                                                              h[1] == (double)sc), line);
    /* fp16's overflow flag (check_finite_ss) = check_finite's verdict, in ss[FL_CU_SS_FOUND] */
    int *dflag = dput(NULL, sizeof(int)), hf = -1;
    double hfound = -1;
    rc = rc || fl_cuk_check_finite_ss(dg, FL_F32, n, 1.0f, NULL, dss, NULL) ||
         fl_cuk_check_finite(dg, FL_F32, n, 1.0f, dflag, NULL);
    cudaMemcpy(&hf, dflag, sizeof hf, cudaMemcpyDeviceToHost);
    cudaMemcpy(&hfound, dss + FL_CU_SS_FOUND, sizeof hfound, cudaMemcpyDeviceToHost);
    snprintf(line, sizeof line, "flag %g, check_finite %d", hfound, hf);
    say("check_finite_ss", !rc && hfound == (double)with_nan && hf == with_nan, line);
    cudaFree(dflag);
    rc = fl_cuk_adamw_update_ss(dpa, FL_F32, dg, FL_F32, dma, dva, FL_F32, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3, dss,
                                NULL);
    if (!with_nan)
        rc = rc || fl_cuk_adamw_update_ex(dpb, FL_F32, dg, FL_F32, dmb, dvb, FL_F32, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                                          3, sc, NULL);
    rc = rc || fl_cuk_sgd_update_ss(dpa, FL_F32, dg, FL_F32, dma, FL_F32, n, 1e-2f, 0.9f, 0.0f, 0.01f, 0, 0, dss, NULL);
    if (!with_nan)
        rc = rc || fl_cuk_sgd_update_ex(dpb, FL_F32, dg, FL_F32, dmb, FL_F32, n, 1e-2f, 0.9f, 0.0f, 0.01f, 0, 0, sc, NULL);
    rc = rc || cudaDeviceSynchronize() != cudaSuccess;
    float *a = malloc(n * 4), *b = malloc(n * 4);
    int same = !rc;
    const float *pa[3] = {dpa, dma, dva}, *pb[3] = {dpb, dmb, dvb}, *h0[3] = {p, m, v};
    for (int k = 0; k < 3; k++) {
        cudaMemcpy(a, pa[k], n * 4, cudaMemcpyDeviceToHost);
        if (with_nan) memcpy(b, h0[k], n * 4);
        else cudaMemcpy(b, pb[k], n * 4, cudaMemcpyDeviceToHost);
        same &= !memcmp(a, b, n * 4);
    }
    say(with_nan ? "adamw/sgd_update_ss under a NaN scale" : "adamw/sgd_update_ss vs _ex", same,
        with_nan ? "parameters and state unchanged: bits" : "the same scale passed by value: bits");
    cudaFree(dg), cudaFree(dpa), cudaFree(dma), cudaFree(dva), cudaFree(dpb), cudaFree(dmb), cudaFree(dvb);
    cudaFree(dss), cudaFree(dwork);
    free(g), free(p), free(m), free(v), free(a), free(b);
}

typedef struct {
    double *acc;
    const float *loss;
    const int32_t *tg;
    int N;
} ls_arg;
static void run_loss_sum(void *x) {
    const ls_arg *a = x;
    fl_cuk_loss_sum(a->acc, a->loss, a->tg, a->N, -100, NULL);
}
static void run_clip(void *x) {
    double *d = x;
    fl_cuk_clip_scale(d + 2, d, 1.0f, 1.0f, NULL, 0, NULL);
}

static void check_loss_sum(int N) {
    unsigned s = 3u + (unsigned)N;
    float *l = malloc((size_t)N * 4);
    int32_t *tg = malloc((size_t)N * 4);
    double host = 0;
    for (int i = 0; i < N; i++) {
        s = s * 1664525u + 1013904223u;
        l[i] = 10.0f * (float)(s >> 8) / 16777216.0f;
        tg[i] = i % 7 == 3 ? -100 : i % 1000;
        if (tg[i] != -100) host += l[i];
    }
    /* acc: run_clip's step scalars start at acc + 2 */
    ls_arg a = {dput(NULL, (2 + FL_CU_SS_LOSS + 1) * sizeof(double)), dput(l, (size_t)N * 4), dput(tg, (size_t)N * 4), N};
    double got = 0;
    int rc = fl_cuk_loss_sum(a.acc, a.loss, a.tg, N, -100, NULL) || cudaDeviceSynchronize() != cudaSuccess;
    cudaMemcpy(&got, a.acc, sizeof got, cudaMemcpyDeviceToHost);
    const float ms = fl_cuda_check_time_ms(run_loss_sum, &a);
    const float mc = fl_cuda_check_time_ms(run_clip, a.acc);
    char line[256];
    snprintf(line, sizeof line, "%d losses: %.17g vs host %.17g; %.1f us (clip_scale %.1f us)", N, got, host,
             1e3 * ms, 1e3 * mc);
    say("loss_sum", !rc && got == host, line);
    cudaFree(a.acc), cudaFree((void *)a.loss), cudaFree((void *)a.tg);
    free(l), free(tg);
}

int fl_cuda_check_ss(void) {
    g_bad = 0;
    printf("-- part 6: the step scalars (issue 30 item 5)\n");
    check_clip_and_update((size_t)3 * 65536 + 1029, 0);
    check_clip_and_update(1029, 1);
    check_loss_sum(8192);
    check_loss_sum(16384);
    return g_bad;
}
