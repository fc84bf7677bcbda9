/* GEMM: fl_cpu_gemm (build's library) and fl_cpu_gemm_naive against a float64
 * reference, all transposes, odd sizes, strided submatrices, alpha/beta
 * combinations, BLAS beta == 0 semantics (C not read) and K == 0. */
#include <math.h>
#include <stdlib.h>

#include "backend/cpu/cpu-impl.h"
#include "test.h"

typedef fl_status (*gemm_fn)(const fl_backend *, int, int, int, int, int, float, const void *, fl_dtype, int,
                             const void *, fl_dtype, int, float, void *, fl_dtype, int);

/* float64 reference: C = alpha op(A) op(B) + beta C (beta == 0: C not read). */
static void ref_gemm(int ta, int tb, int M, int N, int K, double alpha, const float *A, int lda, const float *B,
                     int ldb, double beta, float *C, int ldc) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++) {
                double a = ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                double b = tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
                s += a * b;
            }
            double v = alpha * s;
            if (beta != 0) v += beta * C[(size_t)i * ldc + j];
            C[(size_t)i * ldc + j] = (float)v;
        }
}

/* One case: A, B, C are submatrices of larger buffers (row stride = cols + pad,
 * start offset 3) so lda/ldb/ldc differ from the logical widths. Padding and
 * the untouched part of C must survive. Returns 1 if ok. */
static int run_case(gemm_fn fn, const char *name, int ta, int tb, int M, int N, int K, float alpha, float beta,
                    int pad, int nan_c) {
    fl_backend be = {0};
    be.n_threads = 2;
    fl_test_rng rng = {(unsigned long long)(M * 1000003 + N * 1009 + K * 7 + ta * 2 + tb + pad * 13)};
    int a_rows = ta ? K : M, a_cols = ta ? M : K;
    int b_rows = tb ? N : K, b_cols = tb ? K : N;
    int lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
    size_t na = (size_t)(a_rows > 0 ? a_rows : 1) * lda + 3, nb = (size_t)(b_rows > 0 ? b_rows : 1) * ldb + 3;
    size_t nc = (size_t)M * ldc + 3;
    if (lda < 1) lda = 1;
    if (ldb < 1) ldb = 1;
    float *A = malloc(na * sizeof(float)), *B = malloc(nb * sizeof(float));
    float *C = malloc(nc * sizeof(float)), *R = malloc(nc * sizeof(float));
    fl_test_fill(&rng, A, na, -1, 1);
    fl_test_fill(&rng, B, nb, -1, 1);
    fl_test_fill(&rng, C, nc, -1, 1);
    if (nan_c) /* beta == 0: garbage (NaN/Inf) in C must not leak into the result */
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) C[3 + (size_t)i * ldc + j] = (i + j) % 2 ? NAN : INFINITY;
    memcpy(R, C, nc * sizeof(float));
    ref_gemm(ta, tb, M, N, K, alpha, A + 3, lda, B + 3, ldb, beta, R + 3, ldc);
    fl_status s = fn(&be, ta, tb, M, N, K, alpha, A + 3, FL_F32, lda, B + 3, FL_F32, ldb, beta, C + 3, FL_F32, ldc);
    char what[160];
    snprintf(what, sizeof what, "%s %c%c M=%d N=%d K=%d alpha=%g beta=%g pad=%d%s", name, ta ? 'T' : 'N',
             tb ? 'T' : 'N', M, N, K, alpha, beta, pad, nan_c ? " nanC" : "");
    int ok = s == FL_OK;
    if (!ok) fprintf(stderr, "  %s: status %s: %s\n", what, fl_status_name(s), fl_error_message());
    /* fp32 accumulation over K terms of size <= 1: error ~ K * 2^-24 * |terms|;
     * the absolute floor covers cancellation. Padding compared exactly. */
    double atol = 1e-5 * (K > 1 ? sqrt((double)K) : 1.0) * (fabs(alpha) + 1);
    ok = ok && fl_test_allclose(what, C, R, nc, 1e-5, atol);
    free(A);
    free(B);
    free(C);
    free(R);
    return ok;
}

static void check_all(gemm_fn fn, const char *name) {
    static const int sizes[][3] = {{7, 13, 37}, {67, 129, 65}, {1, 1, 1}, {1, 300, 5}, {33, 1, 17}, {130, 70, 300}};
    static const float ab[][2] = {{1, 0}, {1, 1}, {0.5f, -2}, {-1.5f, 0.25f}, {0, 0.5f}};
    int fails = 0;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
                for (size_t c = 0; c < sizeof ab / sizeof ab[0]; c++)
                    for (int pad = 0; pad <= 5; pad += 5)
                        fails += !run_case(fn, name, ta, tb, sizes[s][0], sizes[s][1], sizes[s][2], ab[c][0],
                                           ab[c][1], pad, 0);
            /* beta == 0 with NaN/Inf in C, strided and not */
            fails += !run_case(fn, name, ta, tb, 7, 13, 37, 1, 0, 0, 1);
            fails += !run_case(fn, name, ta, tb, 67, 129, 65, 0.75f, 0, 3, 1);
            /* K == 0: C = beta C (and beta == 0 -> zeros, even from NaN) */
            fails += !run_case(fn, name, ta, tb, 7, 13, 0, 1, 0.5f, 2, 0);
            fails += !run_case(fn, name, ta, tb, 7, 13, 0, 1, 0, 2, 1);
            fails += !run_case(fn, name, ta, tb, 7, 13, 0, 1, 1, 0, 0);
            /* a transposed B whose row stride is a multiple of 4 KiB: fl_cpu_gemm copies it into the
             * scratch with a padded stride first (gemm.c, FL_ALIAS_FLOATS); K a multiple of it and not */
            if (tb) {
                fails += !run_case(fn, name, ta, tb, 130, 260, 1024, 1, 0, 0, 1);
                fails += !run_case(fn, name, ta, tb, 131, 257, 1000, -0.5f, 0.75f, 24, 0);
            }
            /* M or N == 0: nothing touched */
            fails += !run_case(fn, name, ta, tb, 0, 13, 5, 1, 0.5f, 1, 0);
            fails += !run_case(fn, name, ta, tb, 7, 0, 5, 1, 0.5f, 1, 0);
        }
    FL_CHECKF(fails == 0, "%s: %d cases failed", name, fails);
}

FL_TEST(gemm_library_vs_f64) {
    fprintf(stderr, "  gemm library: %s\n", fl_cpu_gemm_library());
    check_all(fl_cpu_gemm, fl_cpu_gemm_library());
}

FL_TEST(gemm_naive_vs_f64) { check_all(fl_cpu_gemm_naive, "naive"); }

FL_TEST(gemm_unsupported_and_invalid) {
    fl_backend be = {0};
    be.n_threads = 2;
    float a[4] = {1, 2, 3, 4}, b[4] = {1, 0, 0, 1}, c[4] = {0};
    gemm_fn fns[2] = {fl_cpu_gemm, fl_cpu_gemm_naive};
    for (int f = 0; f < 2; f++) {
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_BF16, 2, b, FL_F32, 2, 0, c, FL_F32, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_F16, 2, b, FL_F32, 2, 0, c, FL_F32, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 2, b, FL_F32, 2, 0, c, FL_F64, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(strlen(fl_error_message()) > 0);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 1, b, FL_F32, 2, 0, c, FL_F32, 2) == FL_ERR_INVALID);
        FL_CHECK(fns[f](&be, 0, 1, 2, 2, 2, 1, a, FL_F32, 2, b, FL_F32, 1, 0, c, FL_F32, 2) == FL_ERR_INVALID);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 2, b, FL_F32, 2, 0, c, FL_F32, 1) == FL_ERR_INVALID);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 2, b, FL_F32, 2, 0, c, FL_F32, 2) == FL_OK);
        FL_CHECK(c[0] == 1 && c[1] == 2 && c[2] == 3 && c[3] == 4);
    }
}

/* Same inputs, 1 vs 2 threads, twice each: the naive path is bit-identical
 * across thread counts; the library is bit-identical run to run at a fixed
 * thread count. */
FL_TEST(gemm_deterministic) {
    int M = 96, N = 200, K = 150;
    fl_test_rng rng = {42};
    float *A = malloc(sizeof(float) * M * K), *B = malloc(sizeof(float) * K * N);
    float *C[4];
    fl_test_fill(&rng, A, (size_t)M * K, -1, 1);
    fl_test_fill(&rng, B, (size_t)K * N, -1, 1);
    for (int r = 0; r < 4; r++) C[r] = malloc(sizeof(float) * M * N);
    fl_backend be = {0};
    for (int r = 0; r < 4; r++) {
        be.n_threads = 1 + (r & 1);
        FL_REQUIRE_OK(fl_cpu_gemm_naive(&be, 0, 0, M, N, K, 1, A, FL_F32, K, B, FL_F32, N, 0, C[r], FL_F32, N));
    }
    for (int r = 1; r < 4; r++) FL_CHECK(memcmp(C[0], C[r], sizeof(float) * M * N) == 0);
    for (int r = 0; r < 4; r++) {
        be.n_threads = 2;
        FL_REQUIRE_OK(fl_cpu_gemm(&be, 0, 1, M, N, K, 1, A, FL_F32, K, B, FL_F32, K, 0, C[r], FL_F32, N));
    }
    for (int r = 1; r < 4; r++) FL_CHECK(memcmp(C[0], C[r], sizeof(float) * M * N) == 0);
    for (int r = 0; r < 4; r++) free(C[r]);
    free(A);
    free(B);
}
