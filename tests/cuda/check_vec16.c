/* fitllm_cuda_check, part 5: the 2026-11-29 12:30 wave's issue 30 kernels on the GPU against the emulator (the same
 * sources), and their speed (EXPERIMENTAL until this has run on a GPU):
 *   - layernorm_forward_w16 / layernorm_backward_w16 (GPT-2 / OPT under bf16: 16-bit w and b, out16, a bf16 saved
 *     input, dinp16) at GPT-2 124M's rows (N 8192, C 768) and an odd shape;
 *   - the 128-bit paths (8 bf16 or 2 x 4 fp32 per access) of add16, round16, convert, act_forward16 /
 *     act_backward16 and AdamW over bf16 storage, against the element path (the same data one element off
 *     alignment) at TinyLlama's shapes (N 8192, C 2048, F 5632; AdamW over 64M parameters), GB/s of the bytes
 *     each kernel must move (median of 9 after 2 warm-ups, cudaEvent).
 * Tolerances: conversions, roundings and adds must be bit-identical (one IEEE rounding on both sides); the rest
 * relative 1e-5 (the GPU's expf / FMA contraction), bf16 copies (and an fp32 output that is a bf16 copy's widening)
 * within one bf16 ulp (2^-7 relative). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/cu_kernels.h"
#include "fitllm/dtype.h"

int fl_cuda_check_vec16(void);

static int g_bad;
extern void *g_dev_work, *g_emu_work; /* cuda_check.c: the norm backwards' work (FL_CU_NORM_WORK_BYTES) */

static float *frnd(unsigned *s, size_t n, float lo, float hi) {
    float *x = malloc(n * sizeof(float) + 16);
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[i] = lo + (hi - lo) * (float)(*s >> 8) / 16777216.0f;
    }
    return x;
}
/* bytes at +off bytes of a cudaMalloc'd block (off: 0 aligned, else one element off) */
static void *dnew(const void *h, size_t bytes, size_t off) {
    unsigned char *d = NULL;
    if (cudaMalloc((void **)&d, bytes + 64) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc failed\n");
        exit(1);
    }
    if (h) cudaMemcpy(d + off, h, bytes, cudaMemcpyHostToDevice);
    return d + off;
}
static void dfree(void *d, size_t off) { cudaFree((unsigned char *)d - off); }
/* a device array against the emulator's: fp32 (rtol; 0: bits) or 16-bit (tol in bf16 ulps; 0: bits) */
static void cmpv(const char *op, const void *dgpu, const void *emu, size_t n, int is16, double rtol) {
    const size_t es = is16 ? 2 : 4;
    unsigned char *g = malloc(n * es);
    cudaMemcpy(g, dgpu, n * es, cudaMemcpyDeviceToHost);
    int ok = 1;
    double worst = 0;
    if (rtol == 0) {
        ok = !memcmp(g, emu, n * es);
    } else {
        for (size_t i = 0; i < n; i++) {
            double a = is16 ? fl_bf16_to_f32(((uint16_t *)g)[i]) : ((float *)g)[i];
            double b = is16 ? fl_bf16_to_f32(((const uint16_t *)emu)[i]) : ((const float *)emu)[i];
            double d = fabs(a - b), tol = (is16 ? 0x1p-7 : rtol) * fabs(b) + 1e-6;
            worst = fmax(worst, d / (fabs(b) + 1e-6));
            if (!(d <= tol)) ok = 0;
        }
    }
    printf("%-40s %s  (%s, worst rel %.2e)\n", op, ok ? "ok  " : "FAIL", rtol == 0 ? "bits" : "tolerance", worst);
    g_bad += !ok;
    free(g);
}
float fl_cuda_check_time_ms(void (*fn)(void *), void *arg); /* check_fused.c: median of 9 after 2 warm-ups */

/* ---- LayerNorm over 16-bit weights ---- */
static void check_ln16(int N, int C) {
    unsigned s = 5u + (unsigned)C;
    const size_t nc = (size_t)N * C;
    float *x = frnd(&s, nc, -2, 2), *w = frnd(&s, (size_t)C, 0.5f, 1.5f), *b = frnd(&s, (size_t)C, -1, 1);
    float *dy = frnd(&s, nc, -1, 1);
    uint16_t *x16 = malloc(nc * 2), *w16 = malloc((size_t)C * 2), *b16 = malloc((size_t)C * 2);
    fl_convert(x16, FL_BF16, x, FL_F32, nc);
    fl_convert(w16, FL_BF16, w, FL_F32, (size_t)C);
    fl_convert(b16, FL_BF16, b, FL_F32, (size_t)C);
    float *o = malloc(nc * 4), *m = malloc((size_t)N * 4), *r = malloc((size_t)N * 4), *dx = calloc(nc, 4);
    float *dw = calloc((size_t)C, 4), *db = calloc((size_t)C, 4);
    uint16_t *o16 = malloc(nc * 2), *dx16 = malloc(nc * 2);
    fl_cuemu_layernorm_forward_w16(o, o16, m, r, x, w16, b16, FL_BF16, N, C, 1e-5f, NULL);
    fl_cuemu_layernorm_backward_w16(dx, dx16, dw, db, dy, NULL, x16, w16, FL_BF16, m, r, N, C, g_emu_work, NULL);
    float *dX = dnew(x, nc * 4, 0), *dO = dnew(NULL, nc * 4, 0), *dM = dnew(NULL, (size_t)N * 4, 0);
    float *dR = dnew(NULL, (size_t)N * 4, 0), *dDY = dnew(dy, nc * 4, 0), *dDX = dnew(NULL, nc * 4, 0);
    float *dDW = dnew(NULL, (size_t)C * 4, 0), *dDB = dnew(NULL, (size_t)C * 4, 0);
    uint16_t *dX16 = dnew(x16, nc * 2, 0), *dW16 = dnew(w16, (size_t)C * 2, 0), *dB16 = dnew(b16, (size_t)C * 2, 0);
    uint16_t *dO16 = dnew(NULL, nc * 2, 0), *dDX16 = dnew(NULL, nc * 2, 0);
    cudaMemset(dDX, 0, nc * 4);
    cudaMemset(dDW, 0, (size_t)C * 4);
    cudaMemset(dDB, 0, (size_t)C * 4);
    int rc = fl_cuk_layernorm_forward_w16(dO, dO16, dM, dR, dX, dW16, dB16, FL_BF16, N, C, 1e-5f, NULL);
    /* the backward from the emulator's statistics (the GPU's may differ in the last bit) */
    cudaMemcpy(dM, m, (size_t)N * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dR, r, (size_t)N * 4, cudaMemcpyHostToDevice);
    rc |= fl_cuk_layernorm_backward_w16(dDX, dDX16, dDW, dDB, dDY, NULL, dX16, dW16, FL_BF16, dM, dR, N, C, g_dev_work, NULL);
    if (rc || cudaDeviceSynchronize() != cudaSuccess) {
        printf("layernorm w16 %dx%d: launch failed\n", N, C);
        g_bad++;
        return;
    }
    char nm[96];
    /* with out16, out is its exact widening (ln_finish_row's fl_cu_keep16, round16's bits): on the GPU bit for bit,
     * and against the emulator the bound of out16, one bf16 ulp. The GPU contracts (x - m) r w + b into an FMA
     * (nvcc's default; the emulator does not) and sums the variance with FMAs: fp32 results a few ulps apart, which
     * the bf16 rounding turns into a one-ulp difference wherever they straddle a rounding boundary (about 2^-15 of
     * the elements: at 1024 x 768 the H200 showed some, the smaller shapes by chance none). The fp32 kernel math is
     * held to 1e-5 by the out-only run below (out16 NULL: no rounding). */
    {
        uint16_t *g16 = malloc(nc * 2);
        float *g = malloc(nc * 4);
        cudaMemcpy(g16, dO16, nc * 2, cudaMemcpyDeviceToHost);
        cudaMemcpy(g, dO, nc * 4, cudaMemcpyDeviceToHost);
        int wid = 1;
        for (size_t i = 0; i < nc; i++) wid &= g[i] == fl_bf16_to_f32(g16[i]);
        snprintf(nm, sizeof nm, "layernorm_forward_w16 out = out16 %dx%d", N, C);
        printf("%-40s %s  (bits: out the widening of out16 on the GPU)\n", nm, wid ? "ok  " : "FAIL");
        g_bad += !wid;
        free(g16), free(g);
    }
    snprintf(nm, sizeof nm, "layernorm_forward_w16 out %dx%d", N, C);
    cmpv(nm, dO, o, nc, 0, 0x1p-7);
    snprintf(nm, sizeof nm, "layernorm_forward_w16 out16 %dx%d", N, C);
    cmpv(nm, dO16, o16, nc, 1, 1);
    { /* out only (out16 NULL): the fp32 result, relative 1e-5 */
        float *o32 = malloc(nc * 4);
        fl_cuemu_layernorm_forward_w16(o32, NULL, m, r, x, w16, b16, FL_BF16, N, C, 1e-5f, NULL);
        float *dM2 = dnew(NULL, (size_t)N * 4, 0), *dR2 = dnew(NULL, (size_t)N * 4, 0);
        const int rc2 = fl_cuk_layernorm_forward_w16(dO, NULL, dM2, dR2, dX, dW16, dB16, FL_BF16, N, C, 1e-5f, NULL);
        snprintf(nm, sizeof nm, "layernorm_forward_w16 out32 %dx%d", N, C);
        if (rc2 || cudaDeviceSynchronize() != cudaSuccess) {
            printf("%-40s FAIL  (launch failed)\n", nm);
            g_bad++;
        } else
            cmpv(nm, dO, o32, nc, 0, 1e-5);
        cudaFree(dM2), cudaFree(dR2), free(o32);
    }
    snprintf(nm, sizeof nm, "layernorm_backward_w16 dinp %dx%d", N, C);
    cmpv(nm, dDX, dx, nc, 0, 2e-4);
    snprintf(nm, sizeof nm, "layernorm_backward_w16 dw %dx%d", N, C);
    cmpv(nm, dDW, dw, (size_t)C, 0, 2e-4);
    snprintf(nm, sizeof nm, "layernorm_backward_w16 db %dx%d", N, C);
    cmpv(nm, dDB, db, (size_t)C, 0, 2e-4);
    cudaFree(dX); cudaFree(dO); cudaFree(dM); cudaFree(dR); cudaFree(dDY); cudaFree(dDX); cudaFree(dDW); cudaFree(dDB);
    cudaFree(dX16); cudaFree(dW16); cudaFree(dB16); cudaFree(dO16); cudaFree(dDX16);
    free(x); free(w); free(b); free(dy); free(x16); free(w16); free(b16); free(o); free(m); free(r); free(dx);
    free(dw); free(db); free(o16); free(dx16);
}

/* ---- the 128-bit paths against the element path ---- */
typedef struct {
    void *a, *b, *o, *o16, *x, *x16, *g, *m, *v;
    size_t n;
    int N, F;
} vz;
static void run_add16(void *p) {
    vz *z = p;
    fl_cuk_add16(z->o, z->o16, z->a, z->b, z->n, NULL);
}
static void run_round16(void *p) {
    vz *z = p;
    fl_cuk_round16(z->o16, FL_BF16, z->o, z->n, NULL);
}
static void run_convert(void *p) {
    vz *z = p;
    fl_cuk_convert(z->o, FL_F32, z->x16, FL_BF16, z->n, NULL);
}
static void run_swiglu16(void *p) {
    vz *z = p;
    fl_cuk_act_forward16(FL_CU_ACT16_SWIGLU, z->o, z->o16, z->x, z->x16, z->N, z->F, NULL);
}
static void run_swiglu16_bwd(void *p) {
    vz *z = p;
    fl_cuk_act_backward16(FL_CU_ACT16_SWIGLU, z->g, z->o16, z->a, NULL, z->x16, z->N, z->F, NULL);
}
static void run_adamw16(void *p) {
    vz *z = p;
    fl_cuk_adamw_update_ex(z->x16, FL_BF16, z->o16, FL_BF16, z->m, z->v, FL_BF16, z->n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f,
                           3, 1.0f, NULL);
}

/* one kernel on aligned (off 0) and misaligned device copies: the outputs against the emulator's (emu: small shapes)
 * or, at the large shapes (the emulator would take minutes), the element path's against the 128-bit path's; then
 * both timed */
static void emu_run(void (*fn)(void *), vz *e) {
    if (fn == run_add16) fl_cuemu_add16(e->o, e->o16, e->a, e->b, e->n, NULL);
    if (fn == run_round16) fl_cuemu_round16(e->o16, FL_BF16, e->o, e->n, NULL);
    if (fn == run_convert) fl_cuemu_convert(e->o, FL_F32, e->x16, FL_BF16, e->n, NULL);
    if (fn == run_swiglu16) fl_cuemu_act_forward16(FL_CU_ACT16_SWIGLU, e->o, e->o16, e->x, e->x16, e->N, e->F, NULL);
    if (fn == run_swiglu16_bwd)
        fl_cuemu_act_backward16(FL_CU_ACT16_SWIGLU, e->g, e->o16, e->a, NULL, e->x16, e->N, e->F, NULL);
    if (fn == run_adamw16)
        fl_cuemu_adamw_update_ex(e->x16, FL_BF16, e->o16, FL_BF16, e->m, e->v, FL_BF16, e->n, 1e-4f, 0.9f, 0.95f, 1e-8f,
                                 0.1f, 3, 1.0f, NULL);
}
static void vec_case(const char *name, void (*fn)(void *), vz *h, const size_t *bytes, const int *is16, int n_out,
                     const int *outs, double rtol, double gbytes, int emu) {
    void *const *hp = (void *const *)h;
    float ms[2];
    vz e = *h; /* the reference outputs: the emulator's, or the GPU's 128-bit path's */
    void **ep = (void **)&e;
    for (int k = 0; k < 9; k++)
        if (hp[k]) {
            ep[k] = malloc(bytes[k] + 16);
            memcpy(ep[k], hp[k], bytes[k]);
        }
    if (emu) emu_run(fn, &e);
    for (int off = 0; off < 2; off++) {
        vz z = *h;
        void **zp = (void **)&z;
        for (int k = 0; k < 9; k++)
            if (hp[k]) zp[k] = dnew(hp[k], bytes[k], off ? (is16[k] ? 2 : 4) : 0);
        fn(&z);
        if (cudaDeviceSynchronize() != cudaSuccess) {
            printf("%s: launch failed\n", name);
            g_bad++;
            return;
        }
        for (int j = 0; j < n_out; j++) {
            const int k = outs[j];
            if (!emu && off == 0) { /* the 128-bit path's outputs become the reference */
                cudaMemcpy(ep[k], zp[k], bytes[k], cudaMemcpyDeviceToHost);
                continue;
            }
            char nm[96];
            snprintf(nm, sizeof nm, "%s [%d]%s%s", name, k, off ? " (element path)" : "", emu ? "" : " vs 128-bit");
            cmpv(nm, zp[k], ep[k], bytes[k] / (is16[k] ? 2 : 4), is16[k], rtol);
        }
        ms[off] = fl_cuda_check_time_ms(fn, &z);
        for (int k = 0; k < 9; k++)
            if (hp[k]) dfree(zp[k], off ? (is16[k] ? 2 : 4) : 0);
    }
    for (int k = 0; k < 9; k++) free(ep[k]);
    printf("  %s: 128-bit %.3f ms (%.0f GB/s), element path %.3f ms (%.0f GB/s)\n", name, ms[0],
           gbytes / 1e9 / (ms[0] * 1e-3), ms[1], gbytes / 1e9 / (ms[1] * 1e-3));
}

static void check_vec(int N, int C, int F, size_t n_opt, int emu) {
    unsigned s = 99;
    const size_t nc = (size_t)N * C, nf = (size_t)N * F;
    vz h = {0};
    size_t bytes[9] = {0};
    int is16[9] = {0};
    /* add16 over (N, C): a, b fp32 in; o fp32, o16 bf16 out */
    h.n = nc;
    h.a = frnd(&s, nc, -2, 2), h.b = frnd(&s, nc, -2, 2), h.o = frnd(&s, nc, 0, 1), h.o16 = calloc(nc, 2);
    bytes[0] = bytes[1] = bytes[2] = nc * 4, bytes[3] = nc * 2, is16[3] = 1;
    vec_case("add16", run_add16, &h, bytes, is16, 2, (const int[]){2, 3}, 0, nc * 14.0, emu);
    vec_case("round16", run_round16, &h, bytes, is16, 2, (const int[]){2, 3}, 0, nc * 10.0, emu);
    free(h.a), free(h.b), free(h.o), free(h.o16);
    memset(&h, 0, sizeof h), memset(bytes, 0, sizeof bytes), memset(is16, 0, sizeof is16);
    /* convert bf16 -> fp32 (N, C) */
    h.n = nc;
    h.o = calloc(nc, 4), h.x16 = calloc(nc, 2);
    for (size_t i = 0; i < nc; i++) ((uint16_t *)h.x16)[i] = (uint16_t)(0x3f00u + (i * 7919u) % 0x300u);
    bytes[2] = nc * 4, bytes[5] = nc * 2, is16[5] = 1;
    vec_case("convert bf16->fp32", run_convert, &h, bytes, is16, 1, (const int[]){2}, 0, nc * 6.0, emu);
    free(h.o), free(h.x16);
    memset(&h, 0, sizeof h), memset(bytes, 0, sizeof bytes), memset(is16, 0, sizeof is16);
    /* SwiGLU forward16 from a bf16-only input (N, 2F) and its backward16 */
    h.N = N, h.F = F;
    float *gu = frnd(&s, 2 * nf, -4, 4);
    h.x16 = malloc(2 * nf * 2);
    fl_convert(h.x16, FL_BF16, gu, FL_F32, 2 * nf);
    h.x = calloc(2 * nf, 4), h.o = calloc(nf, 4), h.o16 = calloc(2 * nf, 2), h.a = frnd(&s, nf, -1, 1);
    h.g = frnd(&s, 2 * nf, -1, 1);
    bytes[0] = nf * 4, bytes[2] = nf * 4, bytes[3] = 2 * nf * 2, bytes[4] = 2 * nf * 4, bytes[5] = 2 * nf * 2;
    bytes[6] = 2 * nf * 4;
    is16[3] = is16[5] = 1;
    vec_case("act_forward16 swiglu", run_swiglu16, &h, bytes, is16, 3, (const int[]){2, 3, 4}, 1e-5, nf * 18.0, emu);
    vec_case("act_backward16 swiglu", run_swiglu16_bwd, &h, bytes, is16, 2, (const int[]){6, 3}, 1e-5, nf * 28.0, emu);
    free(gu), free(h.x16), free(h.x), free(h.o), free(h.o16), free(h.a), free(h.g);
    memset(&h, 0, sizeof h), memset(bytes, 0, sizeof bytes), memset(is16, 0, sizeof is16);
    /* AdamW over bf16 parameters, gradients and state (x16 p, o16 g, m, v) */
    h.n = n_opt;
    float *t = frnd(&s, n_opt, -1, 1);
    h.x16 = malloc(n_opt * 2), h.o16 = malloc(n_opt * 2), h.m = malloc(n_opt * 2), h.v = malloc(n_opt * 2);
    fl_convert(h.x16, FL_BF16, t, FL_F32, n_opt);
    for (size_t i = 0; i < n_opt; i++) t[i] *= 0.01f;
    fl_convert(h.o16, FL_BF16, t, FL_F32, n_opt);
    fl_convert(h.m, FL_BF16, t, FL_F32, n_opt);
    for (size_t i = 0; i < n_opt; i++) t[i] = t[i] * t[i];
    fl_convert(h.v, FL_BF16, t, FL_F32, n_opt);
    bytes[5] = bytes[3] = bytes[7] = bytes[8] = n_opt * 2;
    is16[5] = is16[3] = is16[7] = is16[8] = 1;
    vec_case("adamw bf16", run_adamw16, &h, bytes, is16, 3, (const int[]){5, 7, 8}, 1e-5, n_opt * 14.0, emu);
    free(t), free(h.x16), free(h.o16), free(h.m), free(h.v);
}

int fl_cuda_check_vec16(void) {
    g_bad = 0;
    check_ln16(7, 13);
    check_ln16(33, 769);
    check_ln16(1024, 768); /* GPT-2 124M rows (fewer: the emulator runs the reference) */
    check_vec(5, 37, 40, 1001, 1);             /* odd sizes: groups of 8 and a tail; against the emulator */
    check_vec(8192, 2048, 5632, 64u << 20, 0); /* TinyLlama's rows; AdamW over 64M parameters */
    return g_bad;
}
