/* Issue 30 item 4: the fused memory-bound ops, on every registered backend (cuda-emu runs the CUDA kernels
 * under the emulator) against float64 references with test_ops.c's norm tolerances, odd shapes (partial
 * warps, C not a multiple of 4, one column), misaligned rows (the scalar path) and aliasing; on the CPU
 * backends the fused op is the two ops' bits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "test.h"

/* 64-byte aligned memory (aligned_alloc wants a size that is a multiple of the alignment) */
static void *al64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* res = a + b, out = rmsnorm(res) * w, in float64 from the fp32 inputs (res rounded to fp32 first, as the op) */
static void add_rmsnorm_ref(const float *a, const float *b, const float *w, int N, int C, double eps, float *res,
                            float *out, float *rstd) {
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int c = 0; c < C; c++) {
            res[(size_t)n * C + c] = a[(size_t)n * C + c] + b[(size_t)n * C + c]; /* one fp32 rounding: exact spec */
            ss += (double)res[(size_t)n * C + c] * res[(size_t)n * C + c];
        }
        double r = 1.0 / sqrt(ss / C + eps);
        rstd[n] = (float)r;
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = (float)(res[(size_t)n * C + c] * r * w[c]);
    }
}

static void add_rmsnorm_case(fl_backend *be, int N, int C, int misalign, int alias) {
    fl_test_rng r = {(unsigned long long)(N * 131 + C * 7 + misalign + 3 * alias)};
    const float eps = 1e-5f;
    const size_t n = (size_t)N * C, off = misalign ? 1 : 0;
    /* 64-byte aligned blocks, the tensors at +off floats (off 1: every row pointer misaligned) */
    float *ba = al64((n + 16) * 4), *bb = al64((n + 16) * 4), *bres = al64((n + 16) * 4);
    float *bout = al64((n + 16) * 4), *rstd = malloc((size_t)N * 4);
    float *x = fl_test_frand(&r, n, -2, 2), *y = fl_test_frand(&r, n, -2, 2), *w = fl_test_frand(&r, (size_t)C, 0.5f, 1.5f);
    FL_REQUIRE(ba && bb && bres && bout && rstd && x && y && w);
    float *a = ba + off, *b = bb + off, *res = alias ? a : bres + off, *out = bout + off;
    memcpy(a, x, n * 4);
    memcpy(b, y, n * 4);
    float *wres = malloc(n * 4), *wout = malloc(n * 4), *wr = malloc((size_t)N * 4);
    add_rmsnorm_ref(x, y, w, N, C, eps, wres, wout, wr);
    fl_status s = be->add_rmsnorm_forward(be, res, out, rstd, a, b, w, FL_F32, N, C, eps);
    FL_CHECKF(s == FL_OK, "[backend %s] N %d C %d: %s", be->name, N, C, fl_error_message());
    FL_CHECKF(memcmp(res, wres, n * 4) == 0, "[backend %s] N %d C %d misalign %d alias %d: res != a + b", be->name, N,
              C, misalign, alias);
    FL_CHECKF(fl_test_allclose("add_rmsnorm out", out, wout, n, 1e-5, 1e-6), "[backend %s] N %d C %d misalign %d",
              be->name, N, C, misalign);
    FL_CHECK(fl_test_allclose("add_rmsnorm rstd", rstd, wr, (size_t)N, 1e-5, 0));
    if (!strcmp(be->name, "cpu") || !strcmp(be->name, "ref")) { /* the two ops' bits */
        float *o2 = malloc(n * 4), *s2 = malloc(n * 4), *r2 = malloc((size_t)N * 4);
        be->add(be, s2, x, y, n);
        be->rmsnorm_forward(be, o2, r2, s2, w, N, C, eps);
        FL_CHECK(memcmp(o2, out, n * 4) == 0 && memcmp(r2, rstd, (size_t)N * 4) == 0);
        free(o2); free(s2); free(r2);
    }
    free(ba); free(bb); free(bres); free(bout); free(rstd); free(x); free(y); free(w); free(wres); free(wout); free(wr);
}

FL_TEST(fused_add_rmsnorm_forward) {
    static const int shapes[][2] = {{1, 1}, {3, 5}, {2, 3}, {7, 64}, {33, 260}, {5, 1000}, {2, 1028}, {4, 2052}};
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) {
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            for (int mis = 0; mis < 2; mis++) add_rmsnorm_case(&be, shapes[i][0], shapes[i][1], mis, 0);
        add_rmsnorm_case(&be, 9, 96, 0, 1); /* res = a, in place (the residual stream) */
        add_rmsnorm_case(&be, 9, 97, 0, 1);
        /* only fp32 activations so far: another dtype is refused, naming the op */
        float one = 1, o, rs;
        FL_CHECK(be.add_rmsnorm_forward(&be, &one, &o, &rs, &one, &one, &one, FL_BF16, 1, 1, 1e-5f) == FL_ERR_UNSUPPORTED &&
                 strstr(fl_error_message(), "add_rmsnorm_forward"));
    }
}

/* SwiGLU / GELU forward and backward: the 128-bit path (aligned buffers, F % 4 == 0) and the element path
 * (the same data one float off) give the same bits on every backend, and the CPU's values within fp32 noise.
 * The backward accumulates into a pre-filled gradient. */
typedef struct {
    float *p, *base;
} fbuf;
static fbuf fb_new(const float *src, size_t n, int off) {
    fbuf b;
    b.base = al64((n + 16) * 4);
    b.p = b.base + off;
    memcpy(b.p, src, n * 4);
    return b;
}
static void act_case(fl_backend *be, fl_backend *cpu, int glu, int N, int F) {
    fl_test_rng r = {(unsigned long long)(N * 17 + F * 3 + glu)};
    const size_t nin = glu ? (size_t)N * 2 * F : (size_t)N * F, nout = (size_t)N * F;
    float *x = fl_test_frand(&r, nin, -4, 4), *dy = fl_test_frand(&r, nout, -1, 1), *g0 = fl_test_frand(&r, nin, -1, 1);
    float *o[3], *dx[3];
    fl_backend *who[3] = {be, be, cpu};
    for (int k = 0; k < 3; k++) { /* k 0: aligned, 1: misaligned (element path), 2: the CPU */
        int off = k == 1;
        fbuf bx = fb_new(x, nin, off), bo = fb_new(dy, nout, off), bd = fb_new(dy, nout, off), bg = fb_new(g0, nin, off);
        if (glu) {
            who[k]->swiglu_forward(who[k], bo.p, bx.p, N, F);
            who[k]->swiglu_backward(who[k], bg.p, bd.p, bx.p, N, F);
        } else {
            who[k]->gelu_forward(who[k], bo.p, bx.p, nout);
            who[k]->gelu_backward(who[k], bg.p, bd.p, bx.p, nout);
        }
        o[k] = malloc(nout * 4);
        dx[k] = malloc(nin * 4);
        memcpy(o[k], bo.p, nout * 4);
        memcpy(dx[k], bg.p, nin * 4);
        free(bx.base); free(bo.base); free(bd.base); free(bg.base);
    }
    const char *what = glu ? "swiglu" : "gelu";
    FL_CHECKF(memcmp(o[0], o[1], nout * 4) == 0 && memcmp(dx[0], dx[1], nin * 4) == 0,
              "[backend %s] %s N %d F %d: the 128-bit path's bits differ from the element path's", be->name, what, N, F);
    FL_CHECKF(fl_test_allclose(what, o[0], o[2], nout, 1e-5, 1e-6), "[backend %s] %s N %d F %d forward", be->name, what,
              N, F);
    FL_CHECKF(fl_test_allclose(what, dx[0], dx[2], nin, 1e-5, 1e-6), "[backend %s] %s N %d F %d backward", be->name,
              what, N, F);
    for (int k = 0; k < 3; k++) { free(o[k]); free(dx[k]); }
    free(x); free(dy); free(g0);
}

FL_TEST(fused_act_vectorized_paths) {
    static const int shapes[][2] = {{1, 1}, {3, 8}, {5, 12}, {7, 13}, {2, 1028}, {3, 333}};
    fl_backend cpu, be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&cpu, 2));
    FL_FOR_EACH_BACKEND(be, 2) {
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            act_case(&be, &cpu, 1, shapes[i][0], shapes[i][1]);
            act_case(&be, &cpu, 0, shapes[i][0], shapes[i][1]); /* n = N F: multiples of 4 and tails of 1-3 */
        }
    }
    fl_cpu_backend_free(&cpu);
}

/* RMSNorm forward and the input gradient at widths where CUDA takes the 128-bit path (C % 4 == 0, aligned) and,
 * the same data one float off, the element path: against the float64 forward (test_ops.c's norm tolerance) and
 * the CPU backend's accumulated dx (fitllm_cuda_check's bound for a reordered fp32 row reduction). */
static void rms_case(fl_backend *be, fl_backend *cpu, int N, int C, int off) {
    fl_test_rng r = {(unsigned long long)(N * 5 + C + off)};
    const size_t n = (size_t)N * C;
    float *x = fl_test_frand(&r, n, -2, 2), *w = fl_test_frand(&r, (size_t)C, 0.5f, 1.5f);
    float *dy = fl_test_frand(&r, n, -1, 1), *g0 = fl_test_frand(&r, n, -1, 1);
    float *wout = malloc(n * 4), *wr = malloc((size_t)N * 4), *zero = calloc(n, 4), *tmp = malloc(n * 4);
    add_rmsnorm_ref(x, zero, w, N, C, 1e-5, tmp, wout, wr); /* x + 0 = x */
    fbuf bx = fb_new(x, n, off), bw = fb_new(w, (size_t)C, off), bo = fb_new(zero, n, off), bdy = fb_new(dy, n, off);
    fbuf bdx = fb_new(g0, n, off);
    float *rstd = malloc((size_t)N * 4), *cdx = malloc(n * 4), *crs = malloc((size_t)N * 4), *cout = malloc(n * 4);
    be->rmsnorm_forward(be, bo.p, rstd, bx.p, bw.p, N, C, 1e-5f);
    be->rmsnorm_backward(be, bdx.p, NULL, bdy.p, bx.p, bw.p, rstd, N, C);
    memcpy(cdx, g0, n * 4);
    cpu->rmsnorm_forward(cpu, cout, crs, x, w, N, C, 1e-5f);
    cpu->rmsnorm_backward(cpu, cdx, NULL, dy, x, w, crs, N, C);
    FL_CHECKF(fl_test_allclose("rmsnorm out", bo.p, wout, n, 1e-5, 1e-6), "[backend %s] N %d C %d off %d", be->name, N,
              C, off);
    FL_CHECK(fl_test_allclose("rmsnorm rstd", rstd, wr, (size_t)N, 1e-5, 0));
    FL_CHECKF(fl_test_allclose("rmsnorm dx", bdx.p, cdx, n, 2e-4, 2e-5), "[backend %s] N %d C %d off %d", be->name, N, C,
              off);
    free(bx.base); free(bw.base); free(bo.base); free(bdy.base); free(bdx.base);
    free(x); free(w); free(dy); free(g0); free(wout); free(wr); free(zero); free(tmp); free(rstd); free(cdx); free(crs);
    free(cout);
}

FL_TEST(fused_rmsnorm_vectorized_paths) {
    static const int shapes[][2] = {{3, 4}, {7, 64}, {5, 260}, {2, 1028}, {3, 2052}, {4, 13}};
    fl_backend cpu, be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&cpu, 2));
    FL_FOR_EACH_BACKEND(be, 2) {
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            for (int off = 0; off < 2; off++) rms_case(&be, &cpu, shapes[i][0], shapes[i][1], off);
    }
    fl_cpu_backend_free(&cpu);
}
