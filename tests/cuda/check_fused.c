/* fitllm_cuda_check, part 3: issue 30 item 4's kernels on the GPU against the emulator (the same sources),
 * and their speed at TinyLlama's shapes (B 4, T 2048: N 8192, C 2048, F 5632) against the unfused ops:
 * add_rmsnorm_forward vs add + rmsnorm_forward, and SwiGLU / GELU on the 128-bit path vs the element path
 * (the same data one float off). Timings: cudaEvent, median of 9 after 2 warm-ups, GB/s of the bytes each
 * kernel must move. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/cu_kernels.h"

int fl_cuda_check_fused(void);

static int g_bad;

static float *frnd(unsigned *s, size_t n, float lo, float hi) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[i] = lo + (hi - lo) * (float)(*s >> 8) / 16777216.0f;
    }
    return x;
}
static float *dnew(const float *h, size_t n, size_t pad) { /* n floats at +pad floats of a cudaMalloc'd block */
    float *d = NULL;
    if (cudaMalloc((void **)&d, (n + 8) * sizeof(float)) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc failed\n");
        exit(1);
    }
    if (h) cudaMemcpy(d + pad, h, n * sizeof(float), cudaMemcpyHostToDevice);
    return d + pad;
}
static void cmp(const char *op, const float *dgpu, const float *emu, size_t n, double rtol, double atol) {
    float *g = malloc(n * sizeof(float));
    cudaMemcpy(g, dgpu, n * sizeof(float), cudaMemcpyDeviceToHost);
    double mx = 0, worst = 0;
    int ok = 1;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(emu[i]));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)g[i] - emu[i]);
        worst = fmax(worst, d / (mx > 0 ? mx : 1));
        if (!(d <= rtol * fabs(emu[i]) + atol * (1 + mx))) ok = 0;
    }
    printf("%-34s %s  (max |diff| / max|ref| = %.2e)\n", op, ok ? "ok  " : "FAIL", worst);
    g_bad += !ok;
    free(g);
}

static int cmpf(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}
/* median ms of fn(arg) over 9 runs after 2 warm-ups (check_vec16.c times with it too) */
float fl_cuda_check_time_ms(void (*fn)(void *), void *arg);
float fl_cuda_check_time_ms(void (*fn)(void *), void *arg) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    float t[9];
    for (int k = 0; k < 11; k++) {
        cudaEventRecord(a, NULL);
        fn(arg);
        cudaEventRecord(b, NULL);
        cudaEventSynchronize(b);
        if (k >= 2) cudaEventElapsedTime(&t[k - 2], a, b);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    qsort(t, 9, sizeof t[0], cmpf);
    return t[4];
}

typedef struct {
    float *res, *out, *rstd, *a, *b, *w, *gu, *o, *dgu, *dy;
    int N, C, F;
} fz;
static void run_fused(void *p) {
    fz *z = p;
    fl_cuk_add_rmsnorm_forward(z->res, z->out, z->rstd, z->a, z->b, z->w, z->N, z->C, 1e-5f, NULL);
}
static void run_unfused(void *p) {
    fz *z = p;
    fl_cuk_add(z->res, z->a, z->b, (size_t)z->N * z->C, NULL);
    fl_cuk_rmsnorm_forward(z->out, z->rstd, z->res, z->w, z->N, z->C, 1e-5f, NULL);
}
static void run_swiglu_f(void *p) {
    fz *z = p;
    fl_cuk_swiglu_forward(z->o, z->gu, z->N, z->F, NULL);
}
static void run_swiglu_b(void *p) {
    fz *z = p;
    fl_cuk_swiglu_backward(z->dgu, z->dy, z->gu, z->N, z->F, NULL);
}

static void check_add_rmsnorm(int N, int C, int pad) {
    unsigned s = 7u + (unsigned)C;
    const size_t n = (size_t)N * C;
    float *a = frnd(&s, n, -2, 2), *b = frnd(&s, n, -2, 2), *w = frnd(&s, (size_t)C, 0.5f, 1.5f);
    float *res = malloc(n * 4), *out = malloc(n * 4), *rstd = malloc((size_t)N * 4);
    fl_cuemu_add_rmsnorm_forward(res, out, rstd, a, b, w, N, C, 1e-5f, NULL);
    fz z = {dnew(NULL, n, pad), dnew(NULL, n, pad), dnew(NULL, (size_t)N, 0), dnew(a, n, pad), dnew(b, n, pad),
            dnew(w, (size_t)C, pad), NULL, NULL, NULL, NULL, N, C, 0};
    run_fused(&z);
    if (cudaDeviceSynchronize() != cudaSuccess) {
        printf("add_rmsnorm_forward: launch failed\n");
        g_bad++;
        return;
    }
    char nm[96];
    snprintf(nm, sizeof nm, "add_rmsnorm res %dx%d%s", N, C, pad ? " (unaligned)" : "");
    cmp(nm, z.res, res, n, 0, 0); /* a + b: one rounding, the same on both */
    snprintf(nm, sizeof nm, "add_rmsnorm out %dx%d%s", N, C, pad ? " (unaligned)" : "");
    cmp(nm, z.out, out, n, 1e-5, 1e-6);
    if (N >= 4096) {
        float tf = fl_cuda_check_time_ms(run_fused, &z), tu = fl_cuda_check_time_ms(run_unfused, &z);
        double gb = (4.0 * n + C) * 4 / 1e9; /* a, b in; res, out out */
        printf("  add+rmsnorm %dx%d: fused %.3f ms (%.0f GB/s), add + rmsnorm %.3f ms\n", N, C, tf, gb / (tf * 1e-3), tu);
    }
    free(a); free(b); free(w); free(res); free(out); free(rstd);
}

static void check_swiglu(int N, int F) {
    unsigned s = 11u + (unsigned)F;
    const size_t n = (size_t)N * F;
    float *gu = frnd(&s, 2 * n, -4, 4), *dy = frnd(&s, n, -1, 1), *g0 = frnd(&s, 2 * n, -1, 1);
    float *o = malloc(n * 4), *dgu = malloc(2 * n * 4);
    memcpy(dgu, g0, 2 * n * 4);
    fl_cuemu_swiglu_forward(o, gu, N, F, NULL);
    fl_cuemu_swiglu_backward(dgu, dy, gu, N, F, NULL);
    for (int pad = 0; pad < 2; pad++) {
        fz z = {0};
        z.N = N;
        z.F = F;
        z.gu = dnew(gu, 2 * n, pad);
        z.o = dnew(NULL, n, pad);
        z.dgu = dnew(g0, 2 * n, pad);
        z.dy = dnew(dy, n, pad);
        run_swiglu_f(&z);
        run_swiglu_b(&z);
        if (cudaDeviceSynchronize() != cudaSuccess) {
            printf("swiglu: launch failed\n");
            g_bad++;
            return;
        }
        char nm[96];
        snprintf(nm, sizeof nm, "swiglu fwd %dx%d%s", N, F, pad ? " (element path)" : "");
        cmp(nm, z.o, o, n, 1e-5, 1e-6);
        snprintf(nm, sizeof nm, "swiglu bwd %dx%d%s", N, F, pad ? " (element path)" : "");
        cmp(nm, z.dgu, dgu, 2 * n, 1e-5, 1e-6);
        if (N >= 4096) {
            float tf = fl_cuda_check_time_ms(run_swiglu_f, &z), tb = fl_cuda_check_time_ms(run_swiglu_b, &z);
            printf("  swiglu %dx%d %s: forward %.3f ms (%.0f GB/s), backward %.3f ms (%.0f GB/s)\n", N, F,
                   pad ? "element path" : "128-bit", tf, 3.0 * n * 4 / 1e9 / (tf * 1e-3), tb,
                   7.0 * n * 4 / 1e9 / (tb * 1e-3));
        }
    }
    free(gu); free(dy); free(g0); free(o); free(dgu);
}

int fl_cuda_check_fused(void) {
    g_bad = 0;
    check_add_rmsnorm(7, 13, 0);
    check_add_rmsnorm(33, 1028, 0);
    check_add_rmsnorm(33, 1028, 1);
    check_add_rmsnorm(8192, 2048, 0);
    check_swiglu(7, 12);
    check_swiglu(8192, 5632);
    return g_bad;
}
