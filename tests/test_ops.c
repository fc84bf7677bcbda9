/* Backend op tests, run against every registered backend (fl_backend_count(): cpu, ref,
 * later the opaque test backend and cuda) in the style of ggml's test-backend-ops: each op
 * test loops FL_FOR_EACH_BACKEND, and tests of the CPU backend's internals (its GEMM
 * libraries, schedules, thread counts, fl_cpu_expf) stay CPU-only.
 *
 * For every op: forward against an independent float64 reference written here
 * (simple loops, no tiling), and backward against central finite differences of
 * L = sum(out * R) (R random) evaluated on that float64 reference, so the FD
 * values are the exact gradient to ~1e-8 and any mismatch is the op's error.
 * Gradient buffers are pre-filled with nonzero values to check the += contract.
 * Also: determinism (two 2-thread runs bit-identical), RoPE tables incl. the
 * Llama-3 scaling, AdamW/SGD against double versions of the torch formulas,
 * and the GEMM (all transposes, strides, alpha/beta). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu-impl.h"
#include "backend/cuda/cuda-impl.h"
#include "fitllm/backend.h"
#include "fitllm/cpu.h"
#include "test.h"

/* ---- helpers ------------------------------------------------------------------ */

static double *d_of(const float *x, size_t n) {
    double *y = malloc((n ? n : 1) * sizeof(double));
    for (size_t i = 0; i < n; i++) y[i] = x[i];
    return y;
}
static float *f_of(const double *x, size_t n) {
    float *y = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) y[i] = (float)x[i];
    return y;
}
static double dot_d(const double *a, const float *r, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * r[i];
    return s;
}

static fl_backend cpu2(void) {
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    return be;
}

typedef double (*fd_loss)(void *ctx);

/* Compare got[i] with pre[i] + dL/dx[i], the derivative by central differences
 * (step eps, in double) of f with respect to x[i]. Checks all indices, or
 * nsample random ones when 0 < nsample < n. Tolerance |got - want| <= rtol*|want|
 * + atol*(1 + max|dL/dx|). Returns the number of mismatches (prints the first
 * unless quiet). pre may be NULL (gradient not pre-filled). */
/* The per-backend op tests differentiate the same float64 reference at the same point once per
 * backend: the last call's differences are kept and reused when the loss, its size, the point
 * (every bit of x) and the loss value there (which also depends on the context's other inputs) are
 * the same. */
static struct {
    fd_loss f;
    size_t n, m;
    unsigned long long xhash;
    double l0;
    double *fd;
} g_fd_memo;

static unsigned long long fd_hash(const double *x, size_t n) {
    unsigned long long h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        unsigned long long v;
        memcpy(&v, &x[i], 8);
        h = (h ^ v) * 1099511628211ull;
    }
    return h;
}

static int fd_compare(const char *what, const float *got, const float *pre, double *x, size_t n, fd_loss f, void *ctx,
                      size_t nsample, double rtol, double atol, int quiet) {
    size_t m = (nsample && nsample < n) ? nsample : n;
    size_t *idx = malloc(m * sizeof(size_t));
    double *fd = malloc(m * sizeof(double));
    fl_test_rng r = {12345};
    for (size_t k = 0; k < m; k++) idx[k] = m == n ? k : (size_t)(fl_test_rng_u64(&r) % n);
    const double eps = 1e-3;
    double maxabs = 0;
    const unsigned long long xh = fd_hash(x, n);
    const double l0 = f(ctx);
    int memo = g_fd_memo.fd && g_fd_memo.f == f && g_fd_memo.n == n && g_fd_memo.m == m && g_fd_memo.xhash == xh &&
               memcmp(&g_fd_memo.l0, &l0, sizeof l0) == 0;
    for (size_t k = 0; k < m && memo; k++) {
        fd[k] = g_fd_memo.fd[k];
        if (fabs(fd[k]) > maxabs) maxabs = fabs(fd[k]);
    }
    for (size_t k = 0; k < m && !memo; k++) {
        size_t i = idx[k];
        double x0 = x[i];
        x[i] = x0 + eps;
        double lp = f(ctx);
        x[i] = x0 - eps;
        double lm = f(ctx);
        x[i] = x0;
        fd[k] = (lp - lm) / (2 * eps);
        if (fabs(fd[k]) > maxabs) maxabs = fabs(fd[k]);
    }
    if (!memo) {
        free(g_fd_memo.fd);
        g_fd_memo.fd = malloc(m * sizeof(double));
        if (g_fd_memo.fd) {
            memcpy(g_fd_memo.fd, fd, m * sizeof(double));
            g_fd_memo.f = f;
            g_fd_memo.n = n;
            g_fd_memo.m = m;
            g_fd_memo.xhash = xh;
            g_fd_memo.l0 = l0;
        }
    }
    int bad = 0;
    for (size_t k = 0; k < m; k++) {
        size_t i = idx[k];
        double want = (pre ? pre[i] : 0.0) + fd[k];
        double d = fabs((double)got[i] - want);
        if (!(d <= rtol * fabs(want) + atol * (1 + maxabs))) {
            if (!bad && !quiet)
                fprintf(stderr, "  %s: grad mismatch at %zu: got %.9g want %.9g (fd %.9g, |diff| %.3g)\n", what, i,
                        got[i], want, fd[k], d);
            bad++;
        }
    }
    free(idx);
    free(fd);
    return bad;
}

#define FD_CHECK(what, got, pre, x, n, f, ctx, nsample)                                                 \
    FL_CHECKF(fd_compare(what, got, pre, x, n, f, ctx, nsample, 2e-4, 2e-5, 0) == 0,                   \
              "%s: analytic gradient differs from finite differences", what)

/* ---- the FD checker itself can fail -------------------------------------------- */

typedef struct { double *x; int n; } quad_ctx;
static double quad_loss(void *c) {
    quad_ctx *q = c;
    double s = 0;
    for (int i = 0; i < q->n; i++) s += 0.5 * q->x[i] * q->x[i] * q->x[i];
    return s;
}

FL_TEST(ops_fd_checker_detects_errors) {
    double x[5] = {0.3, -1.2, 2.0, 0.7, -0.4};
    quad_ctx c = {x, 5};
    float good[5], wrong[5];
    for (int i = 0; i < 5; i++) good[i] = (float)(1.5 * x[i] * x[i]);
    memcpy(wrong, good, sizeof good);
    wrong[3] *= 1.01f;
    FL_CHECK(fd_compare("good", good, NULL, x, 5, quad_loss, &c, 0, 2e-4, 2e-5, 1) == 0);
    FL_CHECK(fd_compare("wrong", wrong, NULL, x, 5, quad_loss, &c, 0, 2e-4, 2e-5, 1) == 1);
    /* forgetting to accumulate is caught too */
    float pre[5] = {1, 1, 1, 1, 1};
    FL_CHECK(fd_compare("noacc", good, pre, x, 5, quad_loss, &c, 0, 2e-4, 2e-5, 1) == 5);
}

/* ---- gemm ----------------------------------------------------------------------- */

static void gemm_case(fl_backend *be, fl_status (*fn)(const fl_backend *, int, int, int, int, int, float, const void *,
                                                      fl_dtype, int, const void *, fl_dtype, int, float, void *,
                                                      fl_dtype, int),
                      int ta, int tb, float beta, const char *what) {
    const int M = 7, N = 13, K = 11;
    fl_test_rng r = {(unsigned long long)(ta * 2 + tb + 1)};
    /* stored shapes with padded leading dimensions to exercise lda/ldb/ldc */
    int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int lda = ac + 3, ldb = bc + 2, ldc = N + 5;
    float *A = fl_test_frand(&r, (size_t)ar * lda, -1, 1), *B = fl_test_frand(&r, (size_t)br * ldb, -1, 1);
    float *C = fl_test_frand(&r, (size_t)M * ldc, -1, 1);
    if (beta == 0.0f)
        for (int i = 0; i < M * ldc; i++) C[i] = NAN; /* beta = 0 must not read C */
    float *C0 = fl_test_fdup(C, (size_t)M * ldc);
    const float alpha = 0.7f;
    fl_status st = fn(be, ta, tb, M, N, K, alpha, A, FL_F32, lda, B, FL_F32, ldb, beta, C, FL_F32, ldc);
    FL_CHECKF(st == FL_OK, "%s: status %d", what, st);
    float *want = fl_test_fdup(C0, (size_t)M * ldc);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += (double)(ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
            want[i * ldc + j] = (float)(alpha * s + (beta == 0.0f ? 0.0 : (double)beta * C0[i * ldc + j]));
        }
    /* compare the M x N block; padding columns must be untouched */
    int ok = 1;
    for (int i = 0; i < M; i++) {
        ok &= fl_test_allclose(what, C + i * ldc, want + i * ldc, N, 1e-5, 1e-6);
        for (int j = N; j < ldc; j++) ok &= isnan(C0[i * ldc + j]) ? isnan(C[i * ldc + j]) : C[i * ldc + j] == C0[i * ldc + j];
    }
    FL_CHECKF(ok, "%s (ta=%d tb=%d beta=%g) wrong", what, ta, tb, beta);
    free(A); free(B); free(C); free(C0); free(want);
}

FL_TEST(ops_gemm_all_transposes) {
    fl_backend be = cpu2();
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            gemm_case(&be, fl_cpu_gemm, ta, tb, 0.5f, "gemm");
            gemm_case(&be, fl_cpu_gemm, ta, tb, 0.0f, "gemm beta0");
            gemm_case(&be, fl_cpu_gemm_sized, ta, tb, 0.5f, "gemm_sized");
            gemm_case(&be, fl_cpu_gemm_naive, ta, tb, 0.5f, "gemm_naive");
            gemm_case(&be, fl_cpu_gemm_naive, ta, tb, 0.0f, "gemm_naive beta0");
        }
    FL_CHECK(be.gemm == fl_cpu_gemm_sized && be.gemm_name && strlen(be.gemm_name) > 0);
    /* every registered backend's gemm slot, the same cases */
    fl_backend bk;
    FL_FOR_EACH_BACKEND(bk, 2) {
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                gemm_case(&bk, bk.gemm, ta, tb, 0.5f, "be->gemm");
                gemm_case(&bk, bk.gemm, ta, tb, 0.0f, "be->gemm beta0");
            }
        FL_CHECK(bk.gemm_name && strlen(bk.gemm_name) > 0);
    }
}

FL_TEST(ops_gemm_fast_vs_naive) {
    fl_backend be = cpu2();
    fl_test_rng r = {77};
    const int M = 67, N = 45, K = 129;
    float *A = fl_test_frand(&r, (size_t)M * K, -1, 1), *B = fl_test_frand(&r, (size_t)K * N, -1, 1);
    float *C1 = fl_test_frand(&r, (size_t)M * N, -1, 1), *C2 = fl_test_fdup(C1, (size_t)M * N);
    FL_REQUIRE_OK(fl_cpu_gemm(&be, 0, 0, M, N, K, 1.0f, A, FL_F32, K, B, FL_F32, N, 1.0f, C1, FL_F32, N));
    FL_REQUIRE_OK(fl_cpu_gemm_naive(&be, 0, 0, M, N, K, 1.0f, A, FL_F32, K, B, FL_F32, N, 1.0f, C2, FL_F32, N));
    FL_CHECK(fl_test_allclose("fast vs naive", C1, C2, (size_t)M * N, 1e-4, 1e-5));
    /* unsupported dtypes are reported, not silently computed */
    FL_CHECK(fl_cpu_gemm(&be, 0, 0, M, N, K, 1.0f, A, FL_F64, K, B, FL_F32, N, 0.0f, C1, FL_F32, N) != FL_OK);
    FL_CHECK(fl_cpu_gemm_naive(&be, 0, 0, M, N, K, 1.0f, A, FL_F16, K, B, FL_F32, N, 0.0f, C1, FL_F32, N) ==
             FL_ERR_UNSUPPORTED);
    /* every registered backend's gemm slot against the naive loop, and its dtype refusals */
    fl_backend bk;
    FL_FOR_EACH_BACKEND(bk, 2) {
        memcpy(C1, C2, (size_t)M * N * 4);
        float *C3 = fl_test_fdup(C2, (size_t)M * N);
        FL_CHECK(bk.gemm(&bk, 0, 0, M, N, K, 1.0f, A, FL_F32, K, B, FL_F32, N, 1.0f, C1, FL_F32, N) == FL_OK);
        FL_CHECK(fl_cpu_gemm_naive(&be, 0, 0, M, N, K, 1.0f, A, FL_F32, K, B, FL_F32, N, 1.0f, C3, FL_F32, N) == FL_OK);
        FL_CHECK(fl_test_allclose("be->gemm vs naive", C1, C3, (size_t)M * N, 1e-4, 1e-5));
        FL_CHECK(bk.gemm(&bk, 0, 0, M, N, K, 1.0f, A, FL_F64, K, B, FL_F32, N, 0.0f, C1, FL_F32, N) != FL_OK);
        FL_CHECK(bk.gemm(&bk, 0, 0, M, N, K, 1.0f, A, FL_F16, K, B, FL_F32, N, 0.0f, C1, FL_F32, N) ==
                 FL_ERR_UNSUPPORTED);
        free(C3);
    }
    free(A); free(B); free(C1); free(C2);
}

/* ---- embedding ------------------------------------------------------------------ */

typedef struct { double *wte, *wpe; const int32_t *ids; const float *R; int B, T, C; double *out; } emb_ctx;
static void emb_ref(emb_ctx *c) {
    for (int n = 0; n < c->B * c->T; n++)
        for (int k = 0; k < c->C; k++)
            c->out[n * c->C + k] = c->wte[c->ids[n] * c->C + k] + (c->wpe ? c->wpe[(n % c->T) * c->C + k] : 0.0);
}
static double emb_loss(void *p) {
    emb_ctx *c = p;
    emb_ref(c);
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->C);
}

static void ops_embedding_on(fl_backend be) {
    fl_test_rng r = {1};
    const int B = 2, T = 5, C = 13, V = 11, maxT = 7;
    int32_t ids[10] = {3, 7, 3, 0, 10, 7, 7, 2, 3, 9}; /* repeats within and across batches */
    float *wte = fl_test_frand(&r, V * C, -1, 1), *wpe = fl_test_frand(&r, maxT * C, -1, 1);
    float *out = fl_test_frand(&r, B * T * C, -9, 9), *R = fl_test_frand(&r, B * T * C, -1, 1);
    emb_ctx c = {d_of(wte, V * C), NULL, ids, R, B, T, C, malloc(sizeof(double) * B * T * C)};
    for (int with_pe = 0; with_pe < 2; with_pe++) {
        c.wpe = with_pe ? d_of(wpe, maxT * C) : NULL;
        be.embedding_forward(&be, out, ids, wte, with_pe ? wpe : NULL, B, T, C);
        emb_ref(&c);
        float *want = f_of(c.out, B * T * C);
        FL_CHECK(fl_test_allclose("embedding fwd", out, want, B * T * C, 1e-6, 1e-7));
        free(want);
        float *dwte = fl_test_frand(&r, V * C, -1, 1), *pre_te = fl_test_fdup(dwte, V * C);
        float *dwpe = fl_test_frand(&r, maxT * C, -1, 1), *pre_pe = fl_test_fdup(dwpe, maxT * C);
        be.embedding_backward(&be, dwte, with_pe ? dwpe : NULL, R, ids, B, T, C);
        FD_CHECK("dwte", dwte, pre_te, c.wte, V * C, emb_loss, &c, 0);
        if (with_pe) FD_CHECK("dwpe", dwpe, pre_pe, c.wpe, maxT * C, emb_loss, &c, 0);
        else FL_CHECK(memcmp(dwpe, pre_pe, maxT * C * sizeof(float)) == 0);
        /* NULL dwte: skipped, dwpe still computed */
        float *dwpe2 = fl_test_fdup(pre_pe, maxT * C);
        be.embedding_backward(&be, NULL, dwpe2, R, ids, B, T, C);
        if (with_pe) FL_CHECK(memcmp(dwpe2, dwpe, maxT * C * sizeof(float)) == 0);
        free(dwte); free(pre_te); free(dwpe); free(pre_pe); free(dwpe2); free(c.wpe);
    }
    free(wte); free(wpe); free(out); free(R); free(c.wte); free(c.out);
}
FL_TEST(ops_embedding) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_embedding_on(be);
}

static void ops_embedding_backward_deterministic_on(fl_backend be) {
    fl_test_rng r = {2};
    const int B = 4, T = 33, C = 200, V = 7; /* few ids: heavy repetition */
    int32_t ids[4 * 33];
    for (int i = 0; i < B * T; i++) ids[i] = (int32_t)(fl_test_rng_u64(&r) % V);
    float *dout = fl_test_frand(&r, B * T * C, -1, 1);
    float *a = calloc(V * C, 4), *b = calloc(V * C, 4), *pa = calloc(T * C, 4), *pb = calloc(T * C, 4);
    be.embedding_backward(&be, a, pa, dout, ids, B, T, C);
    be.embedding_backward(&be, b, pb, dout, ids, B, T, C);
    FL_CHECK(memcmp(a, b, V * C * 4) == 0 && memcmp(pa, pb, T * C * 4) == 0);
    free(dout); free(a); free(b); free(pa); free(pb);
}
FL_TEST(ops_embedding_backward_deterministic) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_embedding_backward_deterministic_on(be);
}

/* ---- norms ------------------------------------------------------------------------ */

typedef struct { double *x, *w, *b; const float *R; int N, C, ln; double eps; double *out; } norm_ctx;
static void norm_ref(norm_ctx *c, double *mean, double *rstd) {
    for (int n = 0; n < c->N; n++) {
        const double *x = c->x + n * c->C;
        double mu = 0, v = 0;
        if (c->ln) {
            for (int k = 0; k < c->C; k++) mu += x[k];
            mu /= c->C;
        }
        for (int k = 0; k < c->C; k++) v += (x[k] - mu) * (x[k] - mu);
        double rs = 1.0 / sqrt(v / c->C + c->eps);
        for (int k = 0; k < c->C; k++)
            c->out[n * c->C + k] = (x[k] - mu) * rs * c->w[k] + (c->ln && c->b ? c->b[k] : 0.0);
        if (mean) mean[n] = mu;
        if (rstd) rstd[n] = rs;
    }
}
static double norm_loss(void *p) {
    norm_ctx *c = p;
    norm_ref(c, NULL, NULL);
    return dot_d(c->out, c->R, (size_t)c->N * c->C);
}

static void norm_test_on(fl_backend be, int ln) {
    fl_test_rng r = {3 + ln};
    const int N = 7, C = 13;
    const float eps = 1e-5f;
    float *x = fl_test_frand(&r, N * C, -2, 2), *w = fl_test_frand(&r, C, 0.5f, 1.5f), *b = fl_test_frand(&r, C, -1, 1);
    for (int k = 0; k < C; k++) x[2 * C + k] += 3.0f; /* a row with a large mean */
    float *R = fl_test_frand(&r, N * C, -1, 1), *out = malloc(N * C * 4), *mean = malloc(N * 4), *rstd = malloc(N * 4);
    norm_ctx c = {d_of(x, N * C), d_of(w, C), ln ? d_of(b, C) : NULL, R, N, C, ln, eps, malloc(8 * N * C)};
    double dmean[7], drstd[7];
    norm_ref(&c, dmean, drstd);
    float *want = f_of(c.out, N * C), *wr = malloc(N * 4), *wm = malloc(N * 4);
    for (int n = 0; n < N; n++) { wr[n] = (float)drstd[n]; wm[n] = (float)dmean[n]; }
    if (ln) be.layernorm_forward(&be, out, mean, rstd, x, w, b, N, C, eps);
    else be.rmsnorm_forward(&be, out, rstd, x, w, N, C, eps);
    FL_CHECK(fl_test_allclose(ln ? "layernorm out" : "rmsnorm out", out, want, N * C, 1e-5, 1e-6));
    FL_CHECK(fl_test_allclose("rstd", rstd, wr, N, 1e-5, 0));
    if (ln) FL_CHECK(fl_test_allclose("mean", mean, wm, N, 1e-5, 1e-6));

    float *dx = fl_test_frand(&r, N * C, -1, 1), *dw = fl_test_frand(&r, C, -1, 1), *db = fl_test_frand(&r, C, -1, 1);
    float *pdx = fl_test_fdup(dx, N * C), *pdw = fl_test_fdup(dw, C), *pdb = fl_test_fdup(db, C);
    if (ln) be.layernorm_backward(&be, dx, dw, db, R, x, w, mean, rstd, N, C);
    else be.rmsnorm_backward(&be, dx, dw, R, x, w, rstd, N, C);
    FD_CHECK("norm dinp", dx, pdx, c.x, N * C, norm_loss, &c, 0);
    FD_CHECK("norm dw", dw, pdw, c.w, C, norm_loss, &c, 0);
    if (ln) FD_CHECK("norm db", db, pdb, c.b, C, norm_loss, &c, 0);

    /* NULL parameter grads: skipped, dinp identical */
    float *dx2 = fl_test_fdup(pdx, N * C);
    if (ln) be.layernorm_backward(&be, dx2, NULL, NULL, R, x, w, mean, rstd, N, C);
    else be.rmsnorm_backward(&be, dx2, NULL, R, x, w, rstd, N, C);
    FL_CHECK(memcmp(dx2, dx, N * C * 4) == 0);

    /* determinism on a larger case, 2 threads, two runs (fewer rows under the CUDA emulator,
     * where every row is a block of fibers: 257 columns still cross a 256-thread block) */
    const int N2 = fl_test_backend_emulated(&be) ? 19 : 301, C2 = 257;
    float *x2 = fl_test_frand(&r, N2 * C2, -2, 2), *dy2 = fl_test_frand(&r, N2 * C2, -1, 1), *w2 = fl_test_frand(&r, C2, 0.5f, 1.5f);
    float *m2 = malloc(N2 * 4), *r2 = malloc(N2 * 4), *o2 = malloc(N2 * C2 * 4);
    if (ln) be.layernorm_forward(&be, o2, m2, r2, x2, w2, w2, N2, C2, eps);
    else be.rmsnorm_forward(&be, o2, r2, x2, w2, N2, C2, eps);
    float *ga = calloc(N2 * C2, 4), *gb = calloc(N2 * C2, 4), *wa = calloc(C2, 4), *wb = calloc(C2, 4);
    float *ba = calloc(C2, 4), *bb = calloc(C2, 4);
    for (int rep = 0; rep < 2; rep++) {
        float *g = rep ? gb : ga, *ww = rep ? wb : wa, *bbb = rep ? bb : ba;
        if (ln) be.layernorm_backward(&be, g, ww, bbb, dy2, x2, w2, m2, r2, N2, C2);
        else be.rmsnorm_backward(&be, g, ww, dy2, x2, w2, r2, N2, C2);
    }
    FL_CHECK(memcmp(ga, gb, N2 * C2 * 4) == 0 && memcmp(wa, wb, C2 * 4) == 0 && memcmp(ba, bb, C2 * 4) == 0);

    free(x); free(w); free(b); free(R); free(out); free(mean); free(rstd); free(c.x); free(c.w); free(c.b);
    free(c.out); free(want); free(wr); free(wm); free(dx); free(dw); free(db); free(pdx); free(pdw); free(pdb);
    free(dx2); free(x2); free(dy2); free(w2); free(m2); free(r2); free(o2); free(ga); free(gb); free(wa); free(wb);
    free(ba); free(bb);
}
static void norm_test(int ln) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) norm_test_on(be, ln);
}

FL_TEST(ops_rmsnorm) { norm_test(0); }
FL_TEST(ops_layernorm) { norm_test(1); }

/* ---- rope ------------------------------------------------------------------------- */

typedef struct { double *x; const float *cs, *sn; const float *R; int B, T, nh, HD, stride, pos0; double *out; } rope_ctx;
static void rope_ref(rope_ctx *c) {
    int H = c->HD / 2;
    memcpy(c->out, c->x, sizeof(double) * c->B * c->T * c->stride);
    for (int n = 0; n < c->B * c->T; n++) {
        int pos = c->pos0 + n % c->T;
        for (int h = 0; h < c->nh; h++)
            for (int j = 0; j < H; j++) {
                double co = c->cs[pos * H + j], si = c->sn[pos * H + j];
                const double *a = c->x + n * c->stride + h * c->HD;
                double *o = c->out + n * c->stride + h * c->HD;
                o[j] = a[j] * co - a[j + H] * si;
                o[j + H] = a[j + H] * co + a[j] * si;
            }
    }
}
static double rope_loss(void *p) {
    rope_ctx *c = p;
    rope_ref(c);
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->stride);
}

static void ops_rope_on(fl_backend be) {
    fl_test_rng r = {5};
    const int B = 2, T = 9, nh = 3, HD = 12, stride = 5 * 12 + 1, pos0 = 4, maxT = 16;
    float cs[16 * 6], sn[16 * 6];
    fl_rope_table_init(cs, sn, maxT, HD, 10000.0f, NULL);
    size_t n = (size_t)B * T * stride;
    float *x = fl_test_frand(&r, n, -1, 1), *R = fl_test_frand(&r, n, -1, 1);
    rope_ctx c = {d_of(x, n), cs, sn, R, B, T, nh, HD, stride, pos0, malloc(8 * n)};
    rope_ref(&c);
    float *want = f_of(c.out, n), *y = fl_test_fdup(x, n);
    be.rope_forward(&be, y, B, T, nh, HD, stride, cs, sn, pos0);
    FL_CHECK(fl_test_allclose("rope fwd", y, want, n, 1e-6, 1e-7)); /* heads beyond nh untouched too */
    /* backward overwrites: dx = R^T applied to the incoming gradient */
    float *dx = fl_test_fdup(R, n);
    be.rope_backward(&be, dx, B, T, nh, HD, stride, cs, sn, pos0);
    FD_CHECK("rope dx", dx, NULL, c.x, n, rope_loss, &c, 0);
    /* backward undoes forward (orthogonal) */
    be.rope_backward(&be, y, B, T, nh, HD, stride, cs, sn, pos0);
    FL_CHECK(fl_test_allclose("rope roundtrip", y, x, n, 1e-5, 1e-6));
    free(x); free(R); free(c.x); free(c.out); free(want); free(y); free(dx);
}
FL_TEST(ops_rope) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_rope_on(be);
}

/* Independent double version of HF _compute_llama3_parameters. */
static double llama3_inv_freq(int j, int HD, double theta, double factor, double lo, double hi, double old) {
    double inv = 1.0 / pow(theta, (double)(2 * j) / HD);
    double wl = 2 * M_PI / inv;
    if (wl < old / hi) return inv;          /* high frequency: unchanged */
    if (wl > old / lo) return inv / factor; /* low frequency: scaled */
    double sm = (old / wl - lo) / (hi - lo);
    return (1 - sm) * inv / factor + sm * inv;
}

FL_TEST(ops_rope_tables) {
    const int HD = 64, H = 32, maxT = 9000;
    float *cs = malloc(sizeof(float) * maxT * H), *sn = malloc(sizeof(float) * maxT * H);
    float *cs0 = malloc(sizeof(float) * maxT * H), *sn0 = malloc(sizeof(float) * maxT * H);
    /* Llama-3.2 config.json: theta 500000, factor 32, low 1, high 4, original 8192 */
    fl_rope_scaling sc = {FL_ROPE_LLAMA3, 32.0f, 1.0f, 4.0f, 8192};
    fl_rope_table_init(cs, sn, maxT, HD, 500000.0f, &sc);
    fl_rope_table_init(cs0, sn0, maxT, HD, 500000.0f, NULL);
    int bad = 0, n_low = 0, n_mid = 0, n_high = 0;
    for (int j = 0; j < H; j++) {
        double inv = llama3_inv_freq(j, HD, 500000.0, 32.0, 1.0, 4.0, 8192.0);
        double inv0 = 1.0 / pow(500000.0, (double)(2 * j) / HD);
        double wl = 2 * M_PI / inv0;
        n_high += wl < 2048; n_low += wl > 8192; n_mid += wl >= 2048 && wl <= 8192;
        int ps[] = {0, 1, 7, 100, 4095, 8191, 8999};
        for (int k = 0; k < 7; k++) {
            int p = ps[k];
            bad += fabs(cs[p * H + j] - cos(p * inv)) > 2e-7 || fabs(sn[p * H + j] - sin(p * inv)) > 2e-7;
            bad += fabs(cs0[p * H + j] - cos(p * inv0)) > 2e-7 || fabs(sn0[p * H + j] - sin(p * inv0)) > 2e-7;
        }
    }
    FL_CHECKF(bad == 0, "%d rope table entries off", bad);
    /* all three bands occur for this config, so the test covers each branch */
    FL_CHECKF(n_low > 0 && n_mid > 0 && n_high > 0, "bands low %d mid %d high %d", n_low, n_mid, n_high);
    /* spot values: j=0 is unscaled (inv 1); last j is divided by 32 */
    FL_CHECK(fabs(sn[1 * H + 0] - sin(1.0)) < 1e-7);
    double invl = 1.0 / pow(500000.0, 62.0 / 64) / 32;
    FL_CHECK(fabs(sn[8999 * H + 31] - sin(8999 * invl)) < 1e-7);
    FL_CHECK(fabs(sn[8999 * H + 31] - sn0[8999 * H + 31]) > 1e-4); /* scaling did change it */
    /* linear scaling: inv / factor */
    fl_rope_scaling lin = {FL_ROPE_LINEAR, 4.0f, 0, 0, 0};
    fl_rope_table_init(cs, sn, 100, HD, 10000.0f, &lin);
    bad = 0;
    for (int p = 0; p < 100; p++)
        for (int j = 0; j < H; j++) {
            double a = p * (1.0 / pow(10000.0, (double)(2 * j) / HD)) / 4.0;
            bad += fabs(cs[p * H + j] - cos(a)) > 2e-7 || fabs(sn[p * H + j] - sin(a)) > 2e-7;
        }
    FL_CHECKF(bad == 0, "%d linear-scaled entries off", bad);
    free(cs); free(sn); free(cs0); free(sn0);
}

/* ---- attention ---------------------------------------------------------------------- */

/* seen: the qkv of the last attn_loss (NULL before the first), dirty: a flag per output row (b, h, t) */
typedef struct { double *qkv; const float *R; int B, T, NH, NKV, HD; double *out, *lse, *p, *seen; char *dirty; } attn_ctx;
/* one output row (b, h, t) of the float64 reference (and its lse when asked) */
static void attn_row(attn_ctx *c, int b, int h, int t) {
    int W = (c->NH + 2 * c->NKV) * c->HD, rep = c->NH / c->NKV, HD = c->HD, T = c->T;
    double sc = 1.0 / sqrt((double)HD);
    int g = h / rep;
    const double *q = c->qkv + (b * T + t) * W + h * HD;
    double mx = -INFINITY;
    for (int j = 0; j < T; j++) {
        if (j > t) { c->p[j] = -INFINITY; continue; } /* explicit causal mask */
        const double *k = c->qkv + (b * T + j) * W + (c->NH + g) * HD;
        double s = 0;
        for (int d = 0; d < HD; d++) s += q[d] * k[d];
        c->p[j] = s * sc;
        if (c->p[j] > mx) mx = c->p[j];
    }
    double sum = 0;
    for (int j = 0; j < T; j++) sum += (c->p[j] = exp(c->p[j] - mx));
    double *o = c->out + (b * T + t) * c->NH * HD + h * HD;
    for (int d = 0; d < HD; d++) o[d] = 0;
    for (int j = 0; j < T; j++) {
        const double *v = c->qkv + (b * T + j) * W + (c->NH + c->NKV + g) * HD;
        for (int d = 0; d < HD; d++) o[d] += c->p[j] / sum * v[d];
    }
    if (c->lse) c->lse[(b * c->NH + h) * T + t] = mx + log(sum);
}
static void attn_ref(attn_ctx *c) {
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->NH; h++)
            for (int t = 0; t < c->T; t++) attn_row(c, b, h, t);
}
/* The loss of the finite differences: after the first call, only the rows whose inputs changed since the last call
 * are computed again (a query element: its row; a key or value element at position j: the rows t >= j of the heads
 * reading that kv head) - each row is the same function of the same inputs, so out and the loss are bit for bit
 * those of computing every row (make test's time: the reference was ~80% of ops_attention_* under ASan). */
static double attn_loss(void *p) {
    attn_ctx *c = p;
    const int W = (c->NH + 2 * c->NKV) * c->HD, HD = c->HD, T = c->T, rep = c->NH / c->NKV;
    const size_t nq = (size_t)c->B * T * W, rows = (size_t)c->B * c->NH * T;
    if (!c->seen) {
        attn_ref(c);
        c->seen = malloc(nq * sizeof(double));
        c->dirty = calloc(rows, 1);
        memcpy(c->seen, c->qkv, nq * sizeof(double));
    } else {
        for (size_t i = 0; i < nq; i++) {
            if (!memcmp(&c->seen[i], &c->qkv[i], sizeof(double))) continue;
            c->seen[i] = c->qkv[i];
            const int bt = (int)(i / W), col = (int)(i % W), b = bt / T, t = bt % T;
            if (col < c->NH * HD) {
                c->dirty[((size_t)b * c->NH + col / HD) * T + t] = 1;
                continue;
            }
            const int g = (col < (c->NH + c->NKV) * HD ? col - c->NH * HD : col - (c->NH + c->NKV) * HD) / HD;
            for (int h = g * rep; h < (g + 1) * rep; h++)
                for (int u = t; u < T; u++) c->dirty[((size_t)b * c->NH + h) * T + u] = 1;
        }
        for (int b = 0; b < c->B; b++)
            for (int h = 0; h < c->NH; h++)
                for (int t = 0; t < T; t++)
                    if (c->dirty[((size_t)b * c->NH + h) * T + t]) {
                        c->dirty[((size_t)b * c->NH + h) * T + t] = 0;
                        attn_row(c, b, h, t);
                    }
    }
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->NH * c->HD);
}

static void attn_case_on(fl_backend be, int B, int T, int NH, int NKV, int HD, size_t nsample) {
    fl_test_rng r = {(unsigned long long)(T * 1000 + HD * 10 + NH + NKV)};
    size_t W = (size_t)(NH + 2 * NKV) * HD, nq = (size_t)B * T * W, no = (size_t)B * T * NH * HD, nl = (size_t)B * NH * T;
    float *qkv = fl_test_frand(&r, nq, -1.5f, 1.5f), *R = fl_test_frand(&r, no, -1, 1);
    float *out = malloc(no * 4), *lse = malloc(nl * 4);
    attn_ctx c = {d_of(qkv, nq), R, B, T, NH, NKV, HD, malloc(8 * no), malloc(8 * nl), malloc(8 * T), NULL, NULL};
    attn_ref(&c);
    fl_attention_qkv_forward(&be, out, lse, qkv, B, T, NH, NKV, HD);
    float *want = f_of(c.out, no), *wl = f_of(c.lse, nl);
    char what[96];
    snprintf(what, sizeof what, "attn B%d T%d NH%d NKV%d HD%d (cpu level %s)", B, T, NH, NKV, HD,
             fl_cpu_level_name(fl_cpu_level()));
    FL_CHECKF(fl_test_allclose(what, out, want, no, 1e-5, 2e-6), "%s: forward out", what);
    FL_CHECKF(fl_test_allclose(what, lse, wl, nl, 1e-5, 1e-6), "%s: forward lse", what);

    float *dqkv = fl_test_frand(&r, nq, -1, 1), *pre = fl_test_fdup(dqkv, nq);
    fl_attention_qkv_backward(&be, dqkv, R, qkv, out, lse, B, T, NH, NKV, HD);
    double *lse_keep = c.lse;
    c.lse = NULL; /* the FD loss does not need lse */
    FD_CHECK(what, dqkv, pre, c.qkv, nq, attn_loss, &c, nsample);
    free(lse_keep);

    /* determinism: bit-identical across runs */
    float *d2 = fl_test_fdup(pre, nq), *d3 = fl_test_fdup(pre, nq);
    fl_attention_qkv_backward(&be, d2, R, qkv, out, lse, B, T, NH, NKV, HD);
    FL_CHECKF(memcmp(d2, dqkv, nq * 4) == 0, "%s: backward not deterministic", what);
    /* backends computing with the CPU kernels (cpu, ref): the same bits for every thread count
     * (1 = the reference backend, 2, 3) and both backward schedules (fused per kv head / split
     * into kv and query tiles) */
    if (be.device == FL_DEV_CPU) {
        fl_backend ref, be3;
        fl_ref_backend_init(&ref);
        fl_cpu_backend_init(&be3, 3);
        memcpy(d3, pre, nq * 4);
        fl_attention_qkv_backward(&ref, d3, R, qkv, out, lse, B, T, NH, NKV, HD);
        FL_CHECKF(memcmp(d3, dqkv, nq * 4) == 0, "%s: backward depends on thread count (1 vs 2)", what);
        const fl_backend *bes[3] = {&ref, &be, &be3};
        for (int k = 0; k < 3; k++)
            for (int split = 0; split < 2; split++) {
                memcpy(d3, pre, nq * 4);
                fl_cpu_attn_qkv_backward_sched(bes[k], d3, R, qkv, out, lse, B, T, NH, NKV, HD, split);
                FL_CHECKF(memcmp(d3, dqkv, nq * 4) == 0, "%s: backward differs with %d threads, %s schedule", what,
                          bes[k]->n_threads, split ? "split" : "fused");
            }
        memcpy(d3, pre, nq * 4);
        fl_attention_qkv_backward(&be3, d3, R, qkv, out, lse, B, T, NH, NKV, HD);
        FL_CHECKF(memcmp(d3, dqkv, nq * 4) == 0, "%s: backward depends on thread count (3)", what);
    }
    float *o2 = malloc(no * 4), *l2 = malloc(nl * 4);
    fl_attention_qkv_forward(&be, o2, l2, qkv, B, T, NH, NKV, HD);
    FL_CHECKF(memcmp(o2, out, no * 4) == 0 && memcmp(l2, lse, nl * 4) == 0, "%s: forward not deterministic", what);
    free(qkv); free(R); free(out); free(lse); free(c.qkv); free(c.out); free(c.p); free(c.seen); free(c.dirty); free(want);
    free(wl); free(dqkv);
    free(pre); free(d2); free(d3); free(o2); free(l2);
}
static void attn_case(int B, int T, int NH, int NKV, int HD, size_t nsample) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) attn_case_on(be, B, T, NH, NKV, HD, nsample);
    /* the tile products dispatch at run time (attn_mm.c): the cpu backend again at every lower
     * level this CPU has (the loop above ran the detected one) */
    for (int lv = FL_CPU_GENERIC; lv < (int)fl_cpu_level_detected(); lv++) {
        fl_cpu_set_level(lv);
        fl_cpu_backend_init(&be, 2);
        attn_case_on(be, B, T, NH, NKV, HD, nsample);
    }
    fl_cpu_set_level(-1);
}

FL_TEST(ops_attention_gqa) { attn_case(2, 37, 6, 2, 12, 500); }   /* ratio 3 */
FL_TEST(ops_attention_mha) { attn_case(2, 37, 6, 6, 12, 500); }   /* ratio 1 */
FL_TEST(ops_attention_ratio2) { attn_case(1, 70, 4, 2, 16, 400); } /* multiple key tiles, ragged end */
FL_TEST(ops_attention_hd48) { attn_case(1, 33, 4, 2, 48, 300); }
FL_TEST(ops_attention_hd64) { attn_case(2, 65, 2, 2, 64, 300); }
FL_TEST(ops_attention_hd128) { attn_case(1, 20, 3, 1, 128, 300); }
FL_TEST(ops_attention_t1) { attn_case(3, 1, 2, 1, 16, 0); }
/* one kv head at batch 1 (the lab's 1B-like model at micro batch 1): the split schedule's case */
FL_TEST(ops_attention_nkv1_b1) { attn_case(1, 75, 4, 1, 16, 400); }

/* ---- activations -------------------------------------------------------------------- */

typedef struct { double *x; const float *R; int N, F; double *out; int gelu; } act_ctx; /* gelu 2: ReLU, 3: GEGLU, 4: erf */
static void act_ref(act_ctx *c) {
    if (c->gelu == 4) { /* the exact GELU */
        for (int i = 0; i < c->N; i++) c->out[i] = 0.5 * c->x[i] * (1 + erf(c->x[i] / sqrt(2.0)));
        return;
    }
    if (c->gelu == 2) {
        for (int i = 0; i < c->N; i++) c->out[i] = c->x[i] > 0 ? c->x[i] : 0;
        return;
    }
    if (c->gelu == 1) {
        for (int i = 0; i < c->N; i++) {
            double x = c->x[i];
            c->out[i] = 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
        }
        return;
    }
    for (int n = 0; n < c->N; n++)
        for (int i = 0; i < c->F; i++) {
            double g = c->x[n * 2 * c->F + i], u = c->x[n * 2 * c->F + c->F + i];
            c->out[n * c->F + i] = c->gelu == 3 ? 0.5 * g * (1 + tanh(sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))) * u
                                                : g / (1 + exp(-g)) * u;
        }
}
static double act_loss(void *p) {
    act_ctx *c = p;
    act_ref(c);
    return dot_d(c->out, c->R, c->gelu == 1 || c->gelu == 2 || c->gelu == 4 ? (size_t)c->N : (size_t)c->N * c->F);
}

/* SwiGLU (gelu 0) and GEGLU (gelu 3: T5 v1.1's gated-GELU) on fused [gate | up] rows: against the float64 formula
 * and finite differences; saturated gates both ways */
static void ops_glu_on(fl_backend be, int kind) {
    fl_test_rng r = {kind ? 11u : 8u};
    const int N = 7, F = 13;
    const char *nm = kind ? "geglu" : "swiglu";
    float *gu = fl_test_frand(&r, N * 2 * F, -4, 4), *R = fl_test_frand(&r, N * F, -1, 1), *out = malloc(N * F * 4);
    gu[0] = kind ? -12.0f : -30.0f; gu[1] = kind ? 12.0f : 30.0f; /* saturated */
    if (kind) gu[2] = 0.0f;
    act_ctx c = {d_of(gu, N * 2 * F), R, N, F, malloc(8 * N * F), kind};
    act_ref(&c);
    float *want = f_of(c.out, N * F);
    (kind ? be.geglu_forward : be.swiglu_forward)(&be, out, gu, N, F);
    FL_CHECKF(fl_test_allclose(kind ? "geglu fwd" : "swiglu fwd", out, want, N * F, 1e-5, 1e-7), "%s fwd", nm);
    float *dgu = fl_test_frand(&r, N * 2 * F, -1, 1), *pre = fl_test_fdup(dgu, N * 2 * F);
    (kind ? be.geglu_backward : be.swiglu_backward)(&be, dgu, R, gu, N, F);
    FD_CHECK(kind ? "geglu dgu" : "swiglu dgu", dgu, pre, c.x, N * 2 * F, act_loss, &c, 0);
    free(gu); free(R); free(out); free(c.x); free(c.out); free(want); free(dgu); free(pre);
}
FL_TEST(ops_swiglu) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_glu_on(be, 0);
}
FL_TEST(ops_geglu) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_glu_on(be, 3);
}

/* The tanh GELU (exact 0) and the exact one (BLIP-2's "gelu"): against the float64 formula and finite differences,
 * saturated both ways and at 0; the two ops are told apart (they differ by up to ~1e-3 near x = -2) */
static void ops_gelu_on(fl_backend be, int exact) {
    fl_test_rng r = {exact ? 12u : 9u};
    const int n = 101;
    const char *nm = exact ? "gelu_erf" : "gelu";
    float *x = fl_test_frand(&r, n, -5, 5), *R = fl_test_frand(&r, n, -1, 1), *out = malloc(n * 4);
    x[0] = 0.0f; x[1] = 1e-3f; x[2] = -12.0f; x[3] = 12.0f;
    act_ctx c = {d_of(x, n), R, n, 0, malloc(8 * n), exact ? 4 : 1};
    act_ref(&c);
    float *want = f_of(c.out, n);
    (exact ? be.gelu_erf_forward : be.gelu_forward)(&be, out, x, n);
    FL_CHECKF(fl_test_allclose(exact ? "gelu_erf fwd" : "gelu fwd", out, want, n, exact ? 1e-6 : 1e-5, 1e-7), "%s fwd",
              nm);
    float *dx = fl_test_frand(&r, n, -1, 1), *pre = fl_test_fdup(dx, n);
    (exact ? be.gelu_erf_backward : be.gelu_backward)(&be, dx, R, x, n);
    FD_CHECK(exact ? "gelu_erf dinp" : "gelu dinp", dx, pre, c.x, n, act_loss, &c, 0);
    if (exact) {
        float *other = malloc(n * 4);
        be.gelu_forward(&be, other, x, n);
        double d = 0;
        for (int i = 0; i < n; i++) d = fmax(d, fabs((double)other[i] - out[i]));
        FL_CHECKF(d > 1e-4, "%s: exact and tanh GELU differ by %g only", be.name, d);
        free(other);
    }
    free(x); free(R); free(out); free(c.x); free(c.out); free(want); free(dx); free(pre);
}
FL_TEST(ops_gelu) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_gelu_on(be, 0);
}
FL_TEST(ops_gelu_erf) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_gelu_on(be, 1);
}

/* ReLU: exact forward; backward against finite differences away from the kink (|x| >= 0.05 >> the step),
 * and at 0 exactly no gradient (PyTorch's threshold_backward); a NaN passes forward */
static void ops_relu_on(fl_backend be) {
    fl_test_rng r = {10};
    const int n = 103;
    float *x = fl_test_frand(&r, n, -3, 3), *R = fl_test_frand(&r, n, -1, 1), *out = malloc(n * 4);
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) < 0.05f) x[i] = x[i] < 0 ? -0.05f : 0.05f;
    x[0] = 0.0f;
    act_ctx c = {d_of(x, n), R, n, 0, malloc(8 * n), 2};
    act_ref(&c);
    float *want = f_of(c.out, n);
    be.relu_forward(&be, out, x, n);
    FL_CHECK(memcmp(out, want, (size_t)n * 4) == 0); /* max(x, 0) is exact */
    float *dx = fl_test_frand(&r, n, -1, 1), *pre = fl_test_fdup(dx, n);
    be.relu_backward(&be, dx, R, x, n);
    FL_CHECKF(dx[0] == pre[0], "%s: relu gradient at 0 is %g, want none", be.name, (double)(dx[0] - pre[0]));
    FD_CHECK("relu dinp", dx + 1, pre + 1, c.x + 1, n - 1, act_loss, &c, 0);
    float nan_in = NAN, nan_out = 0;
    be.relu_forward(&be, &nan_out, &nan_in, 1);
    FL_CHECKF(isnan(nan_out), "%s: relu(NaN) = %g, want NaN (a diverged run must show)", be.name, (double)nan_out);
    free(x); free(R); free(out); free(c.x); free(c.out); free(want); free(dx); free(pre);
}
FL_TEST(ops_relu) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_relu_on(be);
}

/* ---- elementwise / bias / reductions --------------------------------------------------- */

static void ops_elementwise_on(fl_backend be) {
    fl_test_rng r = {10};
    const size_t n = 1001;
    float *a = fl_test_frand(&r, n, -2, 2), *b = fl_test_frand(&r, n, -2, 2), *o = malloc(n * 4);
    be.add(&be, o, a, b, n);
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= o[i] == a[i] + b[i];
    FL_CHECK(ok);
    float *a2 = fl_test_fdup(a, n);
    be.add(&be, a2, a2, b, n); /* aliasing */
    FL_CHECK(memcmp(a2, o, n * 4) == 0);
    be.scale(&be, a2, n, -0.5f);
    ok = 1;
    for (size_t i = 0; i < n; i++) ok &= a2[i] == o[i] * -0.5f;
    FL_CHECK(ok);
    double ss = 0;
    for (size_t i = 0; i < n; i++) ss += (double)a[i] * a[i];
    double got = be.sumsq(&be, a, FL_F32, n);
    FL_CHECKF(fabs(got - ss) <= 1e-12 * ss, "sumsq %.17g want %.17g", got, ss);
    FL_CHECK(be.sumsq(&be, a, FL_F32, n) == got); /* deterministic */
    FL_CHECK(be.sumsq(&be, a, FL_F32, 0) == 0.0 && be.sumsq(&be, a, FL_F32, 1) == (double)a[0] * a[0]);
    be.zero(&be, a2, n * 4);
    ok = 1;
    for (size_t i = 0; i < n; i++) ok &= a2[i] == 0.0f;
    FL_CHECK(ok);
    free(a); free(b); free(o); free(a2);
}
FL_TEST(ops_elementwise) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_elementwise_on(be);
}

/* The gradient norm's sums of squares and the gradient clear: the same result for 1, 2, 3 and 5
 * threads (ranges fixed by n), sizes on both sides of the parallel thresholds; the sum against a
 * double loop. */
static void ops_sumsq_zero_thread_independent_on(const char *name) {
    fl_backend be[4];
    const int nts[4] = {1, 2, 3, 5};
    for (int k = 0; k < 4; k++) FL_REQUIRE_OK(fl_backend_init_by_name(name, &be[k], nts[k]));
    fl_test_rng r = {77};
    const size_t sizes[] = {1, 4095, 20000, 1000003, (size_t)3 << 20};
    /* the CUDA emulator runs a fiber per GPU thread: its partition does not depend on the thread
     * count, so the three smaller sizes (below, at and across its partial-sum boundaries) suffice */
    const int nsizes = fl_test_backend_emulated(&be[0]) ? 3 : 5;
    float *x = fl_test_frand(&r, sizes[4], -3, 3);
    uint16_t *x16 = malloc(sizes[4] * 2), *xh = malloc(sizes[4] * 2);
    for (size_t i = 0; i < sizes[4]; i++) {
        x16[i] = fl_f32_to_bf16(x[i]);
        xh[i] = fl_f32_to_f16(x[i]);
    }
    for (int si = 0; si < nsizes; si++) {
        size_t n = sizes[si];
        double want = 0;
        for (size_t i = 0; i < n; i++) want += (double)x[i] * x[i];
        double g0 = be[0].sumsq(&be[0], x, FL_F32, n), b0 = be[0].sumsq(&be[0], x16, FL_BF16, n);
        double h0 = be[0].sumsq(&be[0], xh, FL_F16, n);
        /* double accumulation of n <= 3.2M positive terms: relative error <= n * 2^-53 */
        FL_CHECKF(fabs(g0 - want) <= 1e-9 * want, "n=%zu: sumsq %.17g want %.17g", n, g0, want);
        for (int k = 1; k < 4; k++) {
            FL_CHECKF(be[k].sumsq(&be[k], x, FL_F32, n) == g0, "n=%zu: f32 sumsq differs with %d threads", n, nts[k]);
            FL_CHECKF(be[k].sumsq(&be[k], x16, FL_BF16, n) == b0, "n=%zu: bf16 sumsq differs, %d threads", n, nts[k]);
            FL_CHECKF(be[k].sumsq(&be[k], xh, FL_F16, n) == h0, "n=%zu: f16 sumsq differs, %d threads", n, nts[k]);
        }
    }
    /* zero: an odd byte count above the parallel threshold (12 MiB + 3), the bytes around untouched */
    size_t nb = ((size_t)12 << 20) + 3;
    unsigned char *buf = malloc(nb + 2);
    for (int k = 0; k < 4; k++) {
        memset(buf, 0xab, nb + 2);
        be[k].zero(&be[k], buf + 1, nb);
        int bad = buf[0] != 0xab || buf[nb + 1] != 0xab;
        for (size_t i = 1; i <= nb; i++) bad |= buf[i] != 0;
        FL_CHECKF(!bad, "zero with %d threads", nts[k]);
    }
    free(x); free(x16); free(xh); free(buf);
    for (int k = 0; k < 4; k++) fl_backend_free(&be[k]);
}
FL_TEST(ops_sumsq_zero_thread_independent) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 1) ops_sumsq_zero_thread_independent_on(be.name);
}

typedef struct { double *b; const float *y0, *R; int N, OC; } bias_ctx;
static double bias_loss(void *p) {
    bias_ctx *c = p;
    double s = 0;
    for (int n = 0; n < c->N; n++)
        for (int o = 0; o < c->OC; o++) s += (c->y0[n * c->OC + o] + c->b[o]) * c->R[n * c->OC + o];
    return s;
}

static void ops_bias_on(fl_backend be) {
    fl_test_rng r = {11};
    const int N = 7, OC = 77; /* spans several column blocks, ragged */
    float *y = fl_test_frand(&r, N * OC, -1, 1), *b = fl_test_frand(&r, OC, -1, 1), *R = fl_test_frand(&r, N * OC, -1, 1);
    float *y0 = fl_test_fdup(y, N * OC);
    be.bias_forward(&be, y, b, N, OC);
    int ok = 1;
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) ok &= y[n * OC + o] == y0[n * OC + o] + b[o];
    FL_CHECK(ok);
    bias_ctx c = {d_of(b, OC), y0, R, N, OC};
    float *db = fl_test_frand(&r, OC, -1, 1), *pre = fl_test_fdup(db, OC);
    be.bias_backward(&be, db, R, N, OC);
    FD_CHECK("bias db", db, pre, c.b, OC, bias_loss, &c, 0);
    be.bias_backward(&be, NULL, R, N, OC); /* NULL: no-op, must not crash */
    free(y); free(b); free(R); free(y0); free(c.b); free(db); free(pre);
}
FL_TEST(ops_bias) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_bias_on(be);
}

/* ---- cross-entropy ------------------------------------------------------------------------ */

typedef struct { double *x; const int32_t *tg; int N, V; double gs; double *loss; } xent_ctx;
static double xent_ref(void *p) { /* returns grad_scale * sum of losses; fills loss[] */
    xent_ctx *c = p;
    double tot = 0;
    for (int n = 0; n < c->N; n++) {
        const double *x = c->x + (size_t)n * c->V;
        if (c->tg[n] == FL_IGNORE_INDEX) { c->loss[n] = 0; continue; }
        double mx = -INFINITY, s = 0;
        for (int v = 0; v < c->V; v++) mx = x[v] > mx ? x[v] : mx;
        for (int v = 0; v < c->V; v++) s += exp(x[v] - mx);
        c->loss[n] = mx + log(s) - x[c->tg[n]];
        tot += c->loss[n];
    }
    return c->gs * tot;
}

static void xent_case_on(fl_backend be, int N, int V, float spread, int ramp, size_t nsample) {
    fl_test_rng r = {(unsigned long long)V};
    float *x = fl_test_frand(&r, (size_t)N * V, -spread, spread);
    /* ramp: the max keeps growing chunk after chunk (exercises the online rescale) */
    if (ramp)
        for (int n = 0; n < N; n++)
            for (int v = 0; v < V; v++) x[(size_t)n * V + v] += 20.0f * v / V;
    int32_t *tg = malloc(N * 4);
    for (int n = 0; n < N; n++) tg[n] = (int32_t)(fl_test_rng_u64(&r) % V);
    tg[1] = FL_IGNORE_INDEX;
    tg[N - 1] = FL_IGNORE_INDEX;
    tg[0] = V - 1;
    const float gs = 0.37f;
    xent_ctx c = {d_of(x, (size_t)N * V), tg, N, V, gs, malloc(8 * N)};
    xent_ref(&c);
    float *want = f_of(c.loss, N), *loss = malloc(N * 4), *dl = malloc((size_t)N * V * 4);
    be.cross_entropy(&be, loss, dl, x, tg, N, V, gs, FL_IGNORE_INDEX);
    char what[64];
    snprintf(what, sizeof what, "xent N%d V%d", N, V);
    FL_CHECKF(fl_test_allclose(what, loss, want, N, 1e-5, 1e-6), "%s: loss", what);
    FD_CHECK(what, dl, NULL, c.x, (size_t)N * V, xent_ref, &c, nsample);
    int zero_ok = 1;
    for (int v = 0; v < V; v++) zero_ok &= dl[(size_t)V + v] == 0.0f && dl[(size_t)(N - 1) * V + v] == 0.0f;
    FL_CHECKF(zero_ok, "%s: ignored rows must have zero gradient", what);
    /* loss only (dlogits NULL) and in-place (dlogits aliases logits) agree */
    float *loss2 = malloc(N * 4), *xa = fl_test_fdup(x, (size_t)N * V);
    be.cross_entropy(&be, loss2, NULL, x, tg, N, V, gs, FL_IGNORE_INDEX);
    FL_CHECK(memcmp(loss2, loss, N * 4) == 0);
    be.cross_entropy(&be, loss2, xa, xa, tg, N, V, gs, FL_IGNORE_INDEX);
    FL_CHECK(memcmp(loss2, loss, N * 4) == 0 && memcmp(xa, dl, (size_t)N * V * 4) == 0);
    free(x); free(tg); free(c.x); free(c.loss); free(want); free(loss); free(dl); free(loss2); free(xa);
}
static void xent_case(int N, int V, float spread, int ramp, size_t nsample) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) xent_case_on(be, N, V, spread, ramp, nsample);
}

FL_TEST(ops_cross_entropy) { xent_case(9, 101, 3.0f, 0, 0); }
FL_TEST(ops_cross_entropy_chunks) { xent_case(5, 1301, 2.0f, 1, 800); }

/* ---- optimizers -------------------------------------------------------------------------- */

static void ops_adamw_on(fl_backend be) {
    fl_test_rng r = {12};
    const size_t n = 103;
    float *p = fl_test_frand(&r, n, -1, 1), *m = calloc(n, 4), *v = calloc(n, 4);
    double *dp = d_of(p, n), *dm = calloc(n, 8), *dv = calloc(n, 8);
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
    for (int step = 1; step <= 4; step++) {
        float *g = fl_test_frand(&r, n, -2, 2);
        g[0] = 0.0f;
        g[1] = 1e-6f;
        be.adamw_update(&be, p, FL_F32, g, FL_F32, m, v, FL_F32, n, lr, b1, b2, eps, wd, step, gs);
        double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
        for (size_t i = 0; i < n; i++) {
            double gi = (double)g[i] * gs;
            dp[i] *= 1 - (double)lr * wd;
            dm[i] = b1 * dm[i] + (1 - (double)b1) * gi;
            dv[i] = b2 * dv[i] + (1 - (double)b2) * gi * gi;
            dp[i] -= lr / bc1 * dm[i] / (sqrt(dv[i]) / sqrt(bc2) + eps);
        }
        free(g);
    }
    float *wp = f_of(dp, n), *wm = f_of(dm, n), *wv = f_of(dv, n);
    FL_CHECK(fl_test_allclose("adamw p", p, wp, n, 1e-5, 1e-7));
    /* m can cancel to far below |g| ~ 1, so its float error is ~ulp(|g|), not ulp(m) */
    FL_CHECK(fl_test_allclose("adamw m", m, wm, n, 1e-5, 1e-7));
    FL_CHECK(fl_test_allclose("adamw v", v, wv, n, 1e-5, 1e-9));
    free(p); free(m); free(v); free(dp); free(dm); free(dv); free(wp); free(wm); free(wv);
}
FL_TEST(ops_adamw) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_adamw_on(be);
}

static void sgd_case_on(fl_backend be, float mom, float damp, float wd, int nesterov) {
    fl_test_rng r = {13};
    const size_t n = 57;
    float *p = fl_test_frand(&r, n, -1, 1), *buf = mom != 0.0f ? calloc(n, 4) : NULL;
    double *dp = d_of(p, n), *db = calloc(n, 8);
    const float lr = 0.05f, gs = 0.8f;
    for (int step = 1; step <= 4; step++) {
        float *g = fl_test_frand(&r, n, -2, 2);
        be.sgd_update(&be, p, FL_F32, g, FL_F32, buf, FL_F32, n, lr, mom, damp, wd, nesterov, step == 1, gs);
        for (size_t i = 0; i < n; i++) {
            double d = (double)g[i] * gs + (double)wd * dp[i];
            if (mom != 0.0f) {
                db[i] = step == 1 ? d : mom * db[i] + (1 - (double)damp) * d;
                d = nesterov ? d + mom * db[i] : db[i];
            }
            dp[i] -= lr * d;
        }
        free(g);
    }
    float *wp = f_of(dp, n);
    char what[80];
    snprintf(what, sizeof what, "sgd mom %g damp %g wd %g nesterov %d", mom, damp, wd, nesterov);
    FL_CHECKF(fl_test_allclose(what, p, wp, n, 1e-5, 1e-7), "%s", what);
    if (buf) {
        float *wb = f_of(db, n);
        FL_CHECKF(fl_test_allclose(what, buf, wb, n, 1e-5, 1e-7), "%s: momentum buffer", what);
        free(wb);
    }
    free(p); free(buf); free(dp); free(db); free(wp);
}
static void sgd_case(float mom, float damp, float wd, int nesterov) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) sgd_case_on(be, mom, damp, wd, nesterov);
}

FL_TEST(ops_sgd) {
    sgd_case(0.0f, 0.0f, 0.0f, 0);
    sgd_case(0.0f, 0.0f, 0.01f, 0);
    sgd_case(0.9f, 0.1f, 0.01f, 0);
    sgd_case(0.9f, 0.0f, 0.01f, 1);
}

/* ---- backend tables ----------------------------------------------------------------------- */

FL_TEST(ops_backend_vtables) {
    fl_backend be, ref;
    FL_REQUIRE_OK(fl_cpu_backend_init(&be, 0));
    FL_REQUIRE_OK(fl_ref_backend_init(&ref));
    FL_CHECK(strcmp(be.name, "cpu") == 0 && be.device == FL_DEV_CPU && be.n_threads >= 1);
    FL_CHECK(strcmp(ref.name, "ref") == 0 && ref.n_threads == 1 && ref.gemm == fl_cpu_gemm_naive);
    /* every op slot is filled, in both backends: the table is every function pointer from gemm
     * to impl, which the struct keeps last (ops appended later land inside the checked range) */
    FL_CHECK(offsetof(fl_backend, impl) + sizeof(void *) == sizeof(fl_backend));
    size_t nslots = (offsetof(fl_backend, impl) - offsetof(fl_backend, gemm)) / sizeof(void (*)(void));
    const fl_backend *bs[2] = {&be, &ref};
    for (int k = 0; k < 2; k++) {
        void (*const *slots)(void) = (void (*const *)(void))&bs[k]->gemm;
        int missing = 0;
        for (size_t i = 0; i < nslots; i++) missing += slots[i] == NULL;
        FL_CHECKF(missing == 0, "%s: %d of %zu vtable slots are NULL", bs[k]->name, missing, nslots);
    }
    printf("      %zu op slots, all filled in cpu and ref\n", nslots);
    fl_cpu_backend_free(&be);
    /* the registry: cpu and ref first, every registered backend's table complete, named as listed */
    FL_CHECK(fl_backend_count() >= 2 && !strcmp(fl_backend_name(0), "cpu") && !strcmp(fl_backend_name(1), "ref"));
    FL_CHECK(fl_backend_name(-1) == NULL && fl_backend_name(fl_backend_count()) == NULL);
    fl_backend bk;
    FL_FOR_EACH_BACKEND(bk, 2) {
        void (*const *slots)(void) = (void (*const *)(void))&bk.gemm;
        int missing = 0;
        for (size_t i = 0; i < nslots; i++) missing += slots[i] == NULL;
        FL_CHECKF(missing == 0, "%s: %d of %zu vtable slots are NULL", bk.name, missing, nslots);
        FL_CHECK(bk.name && !strcmp(bk.name, fl_backend_name(bk_i_)) && fl_backend_description(bk_i_) != NULL);
        FL_CHECK(bk.n_threads >= 1);
    }
    /* the planner's null backend (skipped by the op loops: it computes nothing): registered, its
     * table complete too, for each backend it stands in for */
    static const char *stand_in[3] = {NULL, "cpu", "cuda"};
    for (int k = 0; k < 3; k++) {
        fl_backend nb;
        FL_REQUIRE_OK(k ? fl_null_backend_init_for(&nb, stand_in[k]) : fl_backend_init_by_name("null", &nb, 1));
        void (*const *slots)(void) = (void (*const *)(void))&nb.gemm;
        int missing = 0;
        for (size_t i = 0; i < nslots; i++) missing += slots[i] == NULL;
        FL_CHECKF(missing == 0, "null (%s): %d of %zu vtable slots are NULL", k ? stand_in[k] : "registry", missing,
                  nslots);
        FL_CHECK(fl_backend_discards(&nb) && fl_backend_host_memory(&nb) == (k == 1) && nb.pool_init != NULL);
        /* a stand-in answers supports_op as the backend it stands in for (a plan refuses what that run
         * would refuse at set-up); the registry's says yes */
        long differ = 0;
        for (int op = 0; op < FL_OP_COUNT; op++)
            for (int a = 0; a < FL_DTYPE_COUNT; a++)
                for (int b = 0; b < FL_DTYPE_COUNT; b++)
                    for (int c = 0; c < FL_DTYPE_COUNT; c++) {
                        int want = k == 1 ? fl_cpu_supports_op(NULL, (fl_op)op, (fl_dtype)a, (fl_dtype)b, (fl_dtype)c)
                                   : k == 2 ? fl_cuda_supports_op((fl_op)op, (fl_dtype)a, (fl_dtype)b, (fl_dtype)c)
                                            : 1;
                        differ += !nb.supports_op(&nb, (fl_op)op, (fl_dtype)a, (fl_dtype)b, (fl_dtype)c) != !want;
                    }
        FL_CHECKF(differ == 0, "null (%s): supports_op differs from the planned backend's in %ld cases",
                  k ? stand_in[k] : "registry", differ);
        fl_backend_free(&nb);
    }
    fl_backend nb;
    FL_CHECK(fl_null_backend_init_for(&nb, "tpu") == FL_ERR_INVALID);
    fl_backend none;
    FL_CHECK(fl_backend_init_by_name("no-such-backend", &none, 1) == FL_ERR_INVALID);
    FL_CHECK(strstr(fl_error_message(), "no-such-backend") && strstr(fl_error_message(), "cpu, ref"));
    FL_CHECK(fl_backend_init_by_name(NULL, &none, 1) == FL_ERR_INVALID);
}

/* ---- timing (informational) ------------------------------------------------------------------ */

static void ops_attention_hd_too_large_is_loud_on(fl_backend be) {
    /* HD beyond the fixed stack tiles must not silently compute garbage */
    const int B = 1, T = 3, NH = 1, NKV = 1, HD = FL_CPU_ATTN_MAX_HD + 2;
    size_t nq = (size_t)B * T * 3 * HD, no = (size_t)B * T * HD;
    float *qkv = calloc(nq, 4), *out = calloc(no, 4), *lse = calloc(T, 4), *dq = calloc(nq, 4);
    fl_attention_qkv_forward(&be, out, lse, qkv, B, T, NH, NKV, HD);
    fl_attention_qkv_backward(&be, dq, out, qkv, out, lse, B, T, NH, NKV, HD);
    FL_CHECK(isnan(out[0]) && isnan(lse[T - 1]) && isnan(dq[nq - 1]));
    free(qkv); free(out); free(lse); free(dq);
}
FL_TEST(ops_attention_hd_too_large_is_loud) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_attention_hd_too_large_is_loud_on(be);
}

/* ---- fl_cpu_expf (the vectorizable exp behind softmax, sigmoid, GELU) --------------------------- */

/* |got - exp(x)| in units of the float spacing at (float)exp(x). */
static double expf_ulps(float x) {
    double e = exp((double)x);
    float ef = (float)e;
    double ulp = (double)nextafterf(ef, INFINITY) - (double)ef;
    return fabs((double)fl_cpu_expf(x) - e) / ulp;
}

FL_TEST(ops_expf_accuracy) {
    /* Bound: 2 ulp, the accuracy documented in cpu-impl.h (degree-7 polynomial,
     * truncation < 1e-8 relative, plus rounding in the float evaluation). Sweep:
     * 2^22 evenly spaced points over [-87, 88], and every 101st float of either
     * sign (dense near 0, where |x| << 1 and rounding of r dominates). */
    double worst = 0;
    float worst_x = 0;
    const int npts = 1 << 22;
    for (int i = 0; i <= npts; i++) {
        float x = -87.0f + 175.0f * (float)((double)i / npts);
        if (x > 88.0f) x = 88.0f;
        double u = expf_ulps(x);
        if (!(u <= worst)) { worst = u; worst_x = x; }
    }
    for (uint32_t b = 0; b <= 0x42B00000u; b += 101) { /* 0x42B00000 = 88.0f */
        float x;
        memcpy(&x, &b, 4);
        double u = expf_ulps(x);
        if (!(u <= worst)) { worst = u; worst_x = x; }
        if (x <= 87.0f) {
            u = expf_ulps(-x);
            if (!(u <= worst)) { worst = u; worst_x = -x; }
        }
    }
    printf("  fl_cpu_expf: max error %.3f ulp at x = %.9g\n", worst, worst_x);
    FL_CHECKF(worst <= 2.0, "fl_cpu_expf error %.3f ulp at x = %.9g (bound 2 ulp)", worst, worst_x);
    FL_CHECK(fl_cpu_expf(0.0f) == 1.0f && fl_cpu_expf(-0.0f) == 1.0f);
    /* clamps: below -87 stands in for 0 (tiny, normal, never NaN), above 88 for overflow */
    const float tiny = (float)exp(-87.0) * (1.0f + 4 * FLT_EPSILON);
    float lo_vals[] = {-INFINITY, -1e30f, -1000.0f, -87.5f};
    for (int i = 0; i < 4; i++) {
        float y = fl_cpu_expf(lo_vals[i]);
        FL_CHECKF(y == fl_cpu_expf(-87.0f) && y > 0.0f && y <= tiny && isnormal(y), "expf(%g) = %g", lo_vals[i], y);
    }
    float hi_vals[] = {INFINITY, 1e30f, 1000.0f, 88.5f};
    for (int i = 0; i < 4; i++) {
        float y = fl_cpu_expf(hi_vals[i]);
        FL_CHECKF(y == fl_cpu_expf(88.0f) && isfinite(y) && expf_ulps(88.0f) <= 2.0, "expf(%g) = %g", hi_vals[i], y);
    }
    /* NaN in, NaN out (the old float->int conversion was UB here: UBSan aborted) */
    FL_CHECK(isnan(fl_cpu_expf(NAN)) && isnan(fl_cpu_expf(-NAN)));
    FL_CHECK(isnan(fl_cpu_sigmoidf(NAN)));
    /* the branch-free mask: +0 when dropped (whatever v is), v's exact bits when kept */
    FL_CHECK(fl_cpu_keepf(NAN, 0) == 0.0f && !signbit(fl_cpu_keepf(-INFINITY, 0)) && fl_cpu_keepf(-2.5f, 7) == -2.5f);
    FL_CHECK(isnan(fl_cpu_keepf(NAN, 1)) && signbit(fl_cpu_keepf(-0.0f, 1)));
    FL_CHECK(fl_cpu_sigmoidf(INFINITY) == 1.0f && fl_cpu_sigmoidf(-INFINITY) >= 0.0f &&
             fl_cpu_sigmoidf(-INFINITY) < 1e-37f);
}

static void ops_expf_vectorized_loop_matches_scalar_on(fl_backend be) {
    /* The cross-entropy gradient is a vectorized loop over fl_cpu_expf; it must
     * compute the same function (within the 2-ulp bound of each) on NaN, +-inf
     * and out-of-range logits as well: NaN logits give a NaN loss, not a crash. */
    const int V = 37;
    float x[37], dl[37], loss;
    for (int v = 0; v < V; v++) x[v] = -90.0f + 5.0f * v;
    int32_t tg = 3;
    be.cross_entropy(&be, &loss, dl, x, &tg, 1, V, 1.0f, FL_IGNORE_INDEX);
    double mx = x[V - 1], s = 0;
    for (int v = 0; v < V; v++) s += exp((double)x[v] - mx);
    double lse = mx + log(s);
    FL_CHECKF(fabs(loss - (lse - x[tg])) <= 1e-5 * fabs(lse - x[tg]), "loss %g want %g", loss, lse - x[tg]);
    int ok = 1;
    for (int v = 0; v < V; v++) {
        double want = exp((double)x[v] - lse) - (v == tg);
        /* relative: 2 ulp of the exp, 1 for the - 1 at the target, and the
         * argument's rounding (lse to float, then x - lse: half an ulp of each)
         * times d exp / exp = 1; absolute: exp(-87) stands in for smaller values */
        double p = exp((double)x[v] - lse);
        double tol = (3 + 0.5 * (fabs(lse) + fabs((double)x[v] - lse))) * FLT_EPSILON * p + 2e-38;
        if (!(fabs(dl[v] - want) <= tol)) ok = 0;
    }
    FL_CHECK(ok);
    x[5] = NAN;
    be.cross_entropy(&be, &loss, dl, x, &tg, 1, V, 1.0f, FL_IGNORE_INDEX);
    FL_CHECK(isnan(loss));
}
FL_TEST(ops_expf_vectorized_loop_matches_scalar) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) ops_expf_vectorized_loop_matches_scalar_on(be);
}
