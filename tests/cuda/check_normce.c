/* fitllm_cuda_check, part 7: the split column sums (the norm backwards' dw, norm.cu's colsum) and the split
 * cross-entropy (xent.cu) of the 2026-11-30 18:00 wave on the GPU against the emulator (the same sources, the same
 * order of every sum: a function of the shape), and their speed at TinyLlama-1.1B's shapes (rmsnorm_backward_w16 at
 * N 8192 x C 2048, cross_entropy_dbf16 over a head chunk of 262 rows x V 32000), GB/s of the bytes each call must
 * move (median of 9 after 2 warm-ups, cudaEvent). EXPERIMENTAL until this has run on a GPU.
 * Tolerances: the GPU may contract a multiply-add into an FMA and its expf / logf are not the host's bits, so each
 * side is within the fp32 bound of the exact value and the two within twice it: dw per column 2 gamma(N + 3) (|dw0| +
 * sum |dy x r|), gamma(m) = m u / (1 - m u), u = 2^-24; the loss 2 (e_s max(1, |lse|) + u |loss|), e_s = gamma(V + 8)
 * + 2 u (2 R + 2) + 4 u for logits within [-R, R] (tests/test_cuda_normce.c derives it); a gradient element g p
 * 2 (|g| p (e_s max(1, |lse|) + u |x - lse| + 4 u) + u |g|) plus bf16's ulp (2^-7 relative: both sides round).
 * "identical" is printed where the bits agree too. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/cu_kernels.h"
#include "fitllm/dtype.h"

int fl_cuda_check_normce(void);
float fl_cuda_check_time_ms(void (*fn)(void *), void *arg); /* check_fused.c: median of 9 after 2 warm-ups */
extern void *g_dev_work, *g_emu_work;                       /* cuda_check.c: FL_CU_NORM_WORK_BYTES each */

static int g_nbad;
#define NC_U 0x1p-24

static float *nc_rnd(unsigned *s, size_t n, float lo, float hi) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[i] = lo + (hi - lo) * (float)(*s >> 8) / 16777216.0f;
    }
    return x;
}
static void *nc_dev(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc failed\n");
        exit(1);
    }
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    return d;
}
static void nc_verdict(const char *what, int ok, double worst, int same) {
    printf("%-44s %s  (worst %.2e of the bound%s)\n", what, ok ? "ok  " : "FAIL", worst, same ? ", identical" : "");
    g_nbad += !ok;
}

typedef struct {
    float *dx, *dw, *dy, *r, *w;
    uint16_t *x16, *dx16;
    int N, C, with_dx;
} nc_norm;
static void nc_norm_run(void *p) {
    nc_norm *a = p;
    fl_cuk_rmsnorm_backward_w16(a->with_dx ? a->dx : NULL, a->with_dx ? a->dx16 : NULL, a->dw, a->dy, NULL, a->x16,
                                a->w, FL_F32, a->r, a->N, a->C, g_dev_work, NULL);
}

/* rmsnorm_backward_w16 over a bf16 input, an fp32 weight: dw against the emulator, then its speed */
static void check_norm(int N, int C, int timed) {
    unsigned s = 17u + (unsigned)C;
    const size_t nc = (size_t)N * C;
    float *x = nc_rnd(&s, nc, -2, 2), *dy = nc_rnd(&s, nc, -1, 1), *r = nc_rnd(&s, (size_t)N, 0.5f, 1.5f);
    float *w = nc_rnd(&s, (size_t)C, 0.5f, 1.5f), *dw0 = nc_rnd(&s, (size_t)C, -1, 1);
    uint16_t *x16 = malloc(nc * 2);
    fl_convert(x16, FL_BF16, x, FL_F32, nc);
    fl_convert(x, FL_F32, x16, FL_BF16, nc);
    float *dw = malloc((size_t)C * 4), *got = malloc((size_t)C * 4);
    memcpy(dw, dw0, (size_t)C * 4);
    fl_cuemu_rmsnorm_backward_w16(NULL, NULL, dw, dy, NULL, x16, w, FL_F32, r, N, C, g_emu_work, NULL);
    nc_norm a = {nc_dev(NULL, nc * 4), nc_dev(dw0, (size_t)C * 4), nc_dev(dy, nc * 4), nc_dev(r, (size_t)N * 4),
                 nc_dev(w, (size_t)C * 4), nc_dev(x16, nc * 2), nc_dev(NULL, nc * 2), N, C, 0};
    if (fl_cuk_rmsnorm_backward_w16(NULL, NULL, a.dw, a.dy, NULL, a.x16, a.w, FL_F32, a.r, N, C, g_dev_work, NULL) ||
        cudaDeviceSynchronize() != cudaSuccess) {
        printf("rmsnorm_backward_w16 %dx%d: launch failed\n", N, C);
        g_nbad++;
        return;
    }
    cudaMemcpy(got, a.dw, (size_t)C * 4, cudaMemcpyDeviceToHost);
    int ok = 1;
    double worst = 0;
    for (int c = 0; c < C; c++) {
        double sa = fabs(dw0[c]);
        for (int n = 0; n < N; n++) sa += fabs((double)dy[(size_t)n * C + c] * x[(size_t)n * C + c] * r[n]);
        const double tol = 2.0 * (N + 3) * NC_U / (1.0 - (N + 3) * NC_U) * sa, d = fabs((double)got[c] - dw[c]);
        worst = fmax(worst, d / tol);
        if (!(d <= tol)) ok = 0;
    }
    char nm[96];
    snprintf(nm, sizeof nm, "rmsnorm_backward_w16 dw %dx%d", N, C);
    nc_verdict(nm, ok, worst, !memcmp(got, dw, (size_t)C * 4));
    if (timed) {
        const float t_dw = fl_cuda_check_time_ms(nc_norm_run, &a);
        a.with_dx = 1;
        const float t_all = fl_cuda_check_time_ms(nc_norm_run, &a);
        /* dw: dy fp32 + x bf16 read; dx pass: dy, x, dx read, dx and dx16 written, then dw's pass */
        const double b_dw = 6.0 * nc, b_all = b_dw + (4.0 + 2 + 4 + 4 + 2) * nc;
        printf("  rmsnorm_backward_w16 %dx%d: dx+dw %.3f ms (%.0f GB/s), dw alone %.3f ms (%.0f GB/s)\n", N, C, t_all,
               b_all / (t_all * 1e-3) / 1e9, t_dw, b_dw / (t_dw * 1e-3) / 1e9);
    }
    cudaFree(a.dx), cudaFree(a.dw), cudaFree(a.dy), cudaFree(a.r), cudaFree(a.w), cudaFree(a.x16), cudaFree(a.dx16);
    free(x), free(dy), free(r), free(w), free(dw0), free(x16), free(dw), free(got);
}

typedef struct {
    float *loss, *x;
    uint16_t *d16;
    int32_t *tg;
    int N, V, ld, rc;
} nc_xent;
static void nc_xent_run(void *p) {
    nc_xent *a = p;
    a->rc |= fl_cuk_cross_entropy_dbf16(a->loss, a->d16, a->x, a->tg, a->N, a->V, a->ld, 0.37f, -100, g_dev_work, NULL);
}

/* cross_entropy_dbf16 (every third row ignored): the loss and the bf16 gradient against the emulator, its speed. ld
 * > V: the device's rows padded (the LM head's fl_logits_ld: GPT-2's 50,257 in rows of 50,264), NaN logits and a
 * sentinel gradient in the padding, which must stay unread and unwritten; the emulator's compact rows the reference */
static void check_xent(int N, int V, int ld, int timed) {
    unsigned s = 29u + (unsigned)V;
    const size_t nv = (size_t)N * V;
    const float R = 6.0f, gs = 0.37f;
    float *x = nc_rnd(&s, nv, -R, R), *loss = malloc((size_t)N * 4), *gl = malloc((size_t)N * 4);
    int32_t *tg = malloc((size_t)N * 4);
    for (int n = 0; n < N; n++) tg[n] = n % 3 == 2 ? -100 : (int32_t)(((unsigned)n * 2654435761u) % (unsigned)V);
    uint16_t *d16 = malloc(nv * 2), *g16 = malloc(nv * 2);
    fl_cuemu_cross_entropy_dbf16(loss, d16, x, tg, N, V, V, gs, -100, g_emu_work, NULL);
    const size_t np = (size_t)N * ld;
    float *xp = malloc(np * 4);
    uint16_t *p16 = malloc(np * 2);
    for (size_t i = 0; i < np; i++) xp[i] = i % ld < (size_t)V ? x[i / ld * V + i % ld] : NAN, p16[i] = 0x7e5a;
    nc_xent a = {nc_dev(NULL, (size_t)N * 4), nc_dev(xp, np * 4), nc_dev(p16, np * 2), nc_dev(tg, (size_t)N * 4), N, V,
                 ld, 0};
    nc_xent_run(&a);
    if (a.rc || cudaDeviceSynchronize() != cudaSuccess) {
        printf("cross_entropy_dbf16 %dx%d: launch failed\n", N, V);
        g_nbad++;
        return;
    }
    cudaMemcpy(gl, a.loss, (size_t)N * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(p16, a.d16, np * 2, cudaMemcpyDeviceToHost);
    int pad_ok = 1;
    for (size_t i = 0; i < np; i++) {
        if (i % ld < (size_t)V) g16[i / ld * V + i % ld] = p16[i];
        else pad_ok &= p16[i] == 0x7e5a;
    }
    const double es = (V + 8) * NC_U / (1.0 - (V + 8) * NC_U) + 2 * NC_U * (2 * R + 2) + 4 * NC_U;
    int ok_l = 1, ok_d = 1;
    double wl = 0, wd = 0;
    for (int n = 0; n < N; n++) {
        if (tg[n] == -100) {
            ok_l &= gl[n] == 0.0f;
            for (int v = 0; v < V; v++) ok_d &= g16[(size_t)n * V + v] == 0;
            continue;
        }
        const double lse = (double)loss[n] + x[(size_t)n * V + tg[n]], el = es * fmax(1.0, fabs(lse));
        const double tl = 2 * (el + NC_U * fabs(loss[n]));
        wl = fmax(wl, fabs((double)gl[n] - loss[n]) / tl);
        ok_l &= fabs((double)gl[n] - loss[n]) <= tl;
        for (int v = 0; v < V; v++) {
            const size_t i = (size_t)n * V + v;
            const double e = fl_bf16_to_f32(d16[i]), g = fl_bf16_to_f32(g16[i]);
            const double p = fabs(e + (v == tg[n] ? gs : 0.0)); /* g p, from the emulator's value */
            const double tol = 2 * (p * (el + NC_U * fabs(x[i] - lse) + 4 * NC_U) + NC_U * gs) + 0x1p-7 * fabs(e);
            wd = fmax(wd, fabs(g - e) / tol);
            ok_d &= fabs(g - e) <= tol;
        }
    }
    char nm[96], rows[32] = "";
    if (ld != V) snprintf(rows, sizeof rows, " (rows of %d)", ld);
    snprintf(nm, sizeof nm, "cross_entropy_dbf16 loss %dx%d%s", N, V, rows);
    nc_verdict(nm, ok_l, wl, !memcmp(gl, loss, (size_t)N * 4));
    snprintf(nm, sizeof nm, "cross_entropy_dbf16 dlogits16 %dx%d%s", N, V, rows);
    nc_verdict(nm, ok_d && pad_ok, wd, !memcmp(g16, d16, nv * 2));
    if (!pad_ok) printf("  cross_entropy_dbf16 %dx%d: the padding past column %d was written\n", N, V, V);
    if (timed) {
        const float t = fl_cuda_check_time_ms(nc_xent_run, &a);
        /* the logits read once and the bf16 gradient written: what the call must move (it reads them twice) */
        printf("  cross_entropy_dbf16 %dx%d%s: %.3f ms (%.0f GB/s of 6 bytes per logit)\n", N, V, rows, t,
               6.0 * nv / (t * 1e-3) / 1e9);
    }
    cudaFree(a.loss), cudaFree(a.x), cudaFree(a.d16), cudaFree(a.tg);
    free(x), free(loss), free(gl), free(tg), free(d16), free(g16), free(xp), free(p16);
}

int fl_cuda_check_normce(void) {
    /* (rows, columns or V, timed): odd shapes, then TinyLlama's */
    static const int norm[][3] = {{7, 13, 0}, {1000, 130, 0}, {8192, 2048, 1}};
    /* (rows, V, the rows' stride, timed): GPT-2's head chunk (166 rows of 50,257 in rows of 50,264) timed too */
    static const int xent[][4] = {{5, 7, 7, 0}, {9, 4099, 4099, 0}, {9, 4099, 4104, 0}, {262, 32000, 32000, 1},
                                  {166, 50257, 50264, 1}};
    g_nbad = 0;
    for (int k = 0; k < 3; k++) check_norm(norm[k][0], norm[k][1], norm[k][2]);
    for (int k = 0; k < 5; k++) check_xent(xent[k][0], xent[k][1], xent[k][2], xent[k][3]);
    return g_nbad;
}
