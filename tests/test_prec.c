/* Precision kernels: bf16 GEMM (library path, tiled fallback, naive reference) against float64
 * with bf16-rounded inputs; fp16 GEMM (F32xF16, F16xF16: library, blocked, naive) against
 * float64 with the f16 operand values; bulk convert; AdamW/SGD over bf16/f16 storage against double
 * versions of the same formulas (then RNE); check_finite; the dynamic loss scaler's state
 * machine (torch GradScaler); 8-bit AdamW against the bitsandbytes-kernel reference fixture
 * (tests/ref/adam8bit_ref.py) and its inf/NaN rule. Run: fitllm_tests prec */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/cpu.h"
#include "fitllm/io.h"
#include "fitllm/loss_scale.h"
#include "fitllm/train.h"
#include "test.h"

typedef fl_status (*gemm_fn)(const fl_backend *, int, int, int, int, int, float, const void *, fl_dtype, int,
                             const void *, fl_dtype, int, float, void *, fl_dtype, int);

static float bf(float x) { return fl_bf16_to_f32(fl_f32_to_bf16(x)); }
static uint16_t *to_bf16(const float *x, size_t n) {
    uint16_t *y = malloc((n ? n : 1) * 2);
    for (size_t i = 0; i < n; i++) y[i] = fl_f32_to_bf16(x[i]);
    return y;
}

/* The float64 reference's operands, gathered once per case: row i of op(A) at a + i K and column j of op(B) at
 * b + j K, contiguous in k (rounded to bf16 first when rnd is set). The references below add the same products in
 * the same order as reading the operands in place, in a fraction of the time (make test's time). */
static void ref_operands(const float *Af, const float *Bf, int tra, int trb, int M, int N, int K, int lda, int ldb,
                         int rnd, double **a, double **b) {
    *a = malloc(((size_t)M * K + 1) * sizeof(double));
    *b = malloc(((size_t)N * K + 1) * sizeof(double));
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) {
            float x = tra ? Af[3 + (size_t)k * lda + i] : Af[3 + (size_t)i * lda + k];
            (*a)[(size_t)i * K + k] = rnd ? bf(x) : x;
        }
    for (int j = 0; j < N; j++)
        for (int k = 0; k < K; k++) {
            float x = trb ? Bf[3 + (size_t)j * ldb + k] : Bf[3 + (size_t)k * ldb + j];
            (*b)[(size_t)j * K + k] = rnd ? bf(x) : x;
        }
}

/* ---- bf16 GEMM -------------------------------------------------------------------------- */

/* Bound on the error of an fp32 evaluation of alpha * sum_k a_k b_k + beta * c: a term passes
 * through at most K + 3 roundings of relative size <= u = 2^-24 (its product when not exact in
 * fp32 (F32 x F16; bf16 x bf16 and f16 x f16 are exact), the kb - 1 adds of its K block in any
 * order, alpha's multiply, and one add into C per K block: kb - 1 + ceil(K / kb) <= K), and
 * beta * c two; so |err| <= gamma(n) * (|alpha| sum_k |a_k b_k| + |beta c|) with
 * gamma(n) = n u / (1 - n u) (Higham, Accuracy and Stability, 3.1), n = K + 3; we take the
 * rounder n = 2K + 2 >= K + 3. */
static double fp32_dot_bound(int K, double mag) {
    double nu = (2.0 * K + 2) * ldexp(1, -24);
    return nu / (1 - nu) * mag;
}

/* One case; A/B/C are submatrices (row stride cols+pad, offset 3) of larger buffers. The
 * float64 reference uses the bf16-rounded operands; tolerance = fp32_dot_bound plus, for a
 * BF16 C, the final rounding to bf16 (half an ulp: <= 2^-8 of the value). Padding and the
 * untouched part of C are compared exactly. */
static int bf16_case(const fl_backend *bep, gemm_fn fn, const char *name, fl_dtype ta, fl_dtype tc, int tra, int trb,
                     int M, int N, int K, float alpha, float beta, int pad, int nan_c) {
    fl_backend be = *bep;
    fl_test_rng rng = {(unsigned long long)(M * 7919 + N * 104729 + K * 31 + tra * 2 + trb + pad * 5 + ta * 3 + tc)};
    int a_rows = tra ? K : M, a_cols = tra ? M : K, b_rows = trb ? N : K, b_cols = trb ? K : N;
    int lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
    if (lda < 1) lda = 1;
    if (ldb < 1) ldb = 1;
    size_t na = (size_t)(a_rows > 0 ? a_rows : 1) * lda + 3, nb = (size_t)(b_rows > 0 ? b_rows : 1) * ldb + 3;
    size_t nc = (size_t)M * ldc + 3;
    float *Af = malloc(na * 4), *Bf = malloc(nb * 4), *Cf = malloc(nc * 4);
    fl_test_fill(&rng, Af, na, -1, 1);
    fl_test_fill(&rng, Bf, nb, -1, 1);
    fl_test_fill(&rng, Cf, nc, -1, 1);
    if (tc == FL_BF16)
        for (size_t i = 0; i < nc; i++) Cf[i] = bf(Cf[i]);
    if (nan_c)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) Cf[3 + (size_t)i * ldc + j] = (i + j) % 2 ? NAN : INFINITY;
    uint16_t *Ab = to_bf16(Af, na), *Bb = to_bf16(Bf, nb), *Cb = to_bf16(Cf, nc);
    /* reference */
    double *R = malloc(nc * sizeof(double)), *T = malloc(nc * sizeof(double)), *ra, *rb;
    for (size_t i = 0; i < nc; i++) R[i] = Cf[i], T[i] = 0;
    ref_operands(Af, Bf, tra, trb, M, N, K, lda, ldb, 1, &ra, &rb);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            const double *ai = ra + (size_t)i * K, *bj = rb + (size_t)j * K;
            double s = 0, sa = 0;
            for (int k = 0; k < K; k++) {
                s += ai[k] * bj[k];
                sa += fabs(ai[k] * bj[k]);
            }
            size_t idx = 3 + (size_t)i * ldc + j;
            double v = alpha * s;
            if (beta != 0) v += (double)beta * Cf[idx];
            T[idx] = fp32_dot_bound(K, fabs(alpha) * sa + fabs(beta != 0 ? beta * Cf[idx] : 0)) + 1e-30;
            if (tc == FL_BF16) T[idx] += (fabs(v) + T[idx]) * (1.0 / 256);
            R[idx] = v;
        }
    void *C = tc == FL_F32 ? (void *)Cf : (void *)Cb;
    const void *A = ta == FL_F32 ? (const void *)(Af + 3) : (const void *)(Ab + 3);
    void *Cp = tc == FL_F32 ? (void *)(Cf + 3) : (void *)(Cb + 3);
    fl_status st = fn(&be, tra, trb, M, N, K, alpha, A, ta, lda, Bb + 3, FL_BF16, ldb, beta, Cp, tc, ldc);
    int ok = st == FL_OK, bad = 0;
    if (!ok) fprintf(stderr, "  %s: %s\n", name, fl_error_message());
    for (size_t i = 0; ok && i < nc; i++) {
        double got = tc == FL_F32 ? ((float *)C)[i] : fl_bf16_to_f32(((uint16_t *)C)[i]);
        int in_c = 0;
        if (i >= 3) {
            size_t r = (i - 3) / ldc, c = (i - 3) % ldc;
            in_c = r < (size_t)M && c < (size_t)N;
        }
        int good = in_c ? fabs(got - R[i]) <= T[i] : (got == R[i] || (isnan(got) && isnan(R[i])));
        if (!good) {
            if (!bad)
                fprintf(stderr, "  %s %s x BF16 -> %s %c%c M=%d N=%d K=%d a=%g b=%g pad=%d: [%zu] got %.9g want %.9g tol %.3g\n",
                        name, fl_dtype_name(ta), fl_dtype_name(tc), tra ? 'T' : 'N', trb ? 'T' : 'N', M, N, K, alpha,
                        beta, pad, i, got, R[i], T[i]);
            bad++;
        }
    }
    free(Af), free(Bf), free(Cf), free(Ab), free(Bb), free(Cb), free(R), free(T), free(ra), free(rb);
    return ok && !bad;
}

/* The kernels of the CPU backend called directly run with a bare table of 2 threads. */
static fl_backend bare2(void) {
    fl_backend be = {0};
    be.name = "cpu";
    be.n_threads = 2;
    return be;
}

/* Every case of one dtype combination (or the whole set) through fn on be. A combination the
 * backend refuses (FL_ERR_UNSUPPORTED on a 1x1x1 probe) is reported by fl_test_unsupported:
 * a failure on cpu and ref, a skip with a message elsewhere. */
static int gemm_combo_unsupported(const fl_backend *be, gemm_fn fn, fl_dtype ta, fl_dtype tb, fl_dtype tc) {
    float af = 1, cf = 0;
    uint16_t a16 = 0x3f80, b16 = tb == FL_F16 ? 0x3c00 : 0x3f80, c16 = 0;
    fl_status st = fn(be, 0, 0, 1, 1, 1, 1.0f, ta == FL_F32 ? (const void *)&af : (const void *)&a16, ta, 1, &b16, tb, 1,
                      0.0f, tc == FL_F32 ? (void *)&cf : (void *)&c16, tc, 1);
    char what[96];
    snprintf(what, sizeof what, "gemm %s x %s -> %s", fl_dtype_name(ta), fl_dtype_name(tb), fl_dtype_name(tc));
    return fl_test_unsupported(be, st, what);
}

/* Which (size s, alpha/beta k, padding) cases of a sweep run: all of them, except on the CUDA emulator's stand-in
 * GEMM (float64 loops: one padding per case) and under ASan in the quick tier (fl_test_asan_light: one alpha/beta
 * pair per size, in turn, with one padding - every size, transposition, dtype combination, alpha/beta pair,
 * padding and edge case still runs under the sanitizers; the release pass runs the whole sweep). */
static int sweep_case(const fl_backend *be, size_t s, size_t k, int pad) {
    if ((fl_test_backend_emulated(be) || fl_test_asan_light()) && pad != (int)(k % 2) * 5) return 0;
    return !fl_test_asan_light() || k == s % 4;
}

static void bf16_check_all_on(const fl_backend *be, gemm_fn fn, const char *name) {
    static const int sizes[][3] = {{7, 13, 37}, {67, 129, 65}, {1, 1, 1}, {33, 1, 17}, {130, 70, 300}, {5, 300, 3},
                                   {301, 7, 9}};
    static const float ab[][2] = {{1, 0}, {1, 1}, {0.5f, -2}, {-1.5f, 0.25f}};
    static const fl_dtype combos[][2] = {{FL_BF16, FL_F32}, {FL_F32, FL_F32}, {FL_BF16, FL_BF16}};
    int fails = 0, n = 0;
    for (int c = 0; c < 3; c++)
        for (int tra = 0; tra < 2; tra++)
            for (int trb = 0; trb < 2; trb++) {
                fl_dtype ta = combos[c][0], tc = combos[c][1];
                if (tra == 0 && trb == 0 && gemm_combo_unsupported(be, fn, ta, FL_BF16, tc)) {
                    trb = tra = 2; /* the whole combination */
                    break;
                }
                for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
                    for (size_t k = 0; k < sizeof ab / sizeof ab[0]; k++)
                        for (int pad = 0; pad <= 5; pad += 5, n++) {
                            if (!sweep_case(be, s, k, pad)) continue;
                            fails += !bf16_case(be, fn, name, ta, tc, tra, trb, sizes[s][0], sizes[s][1], sizes[s][2],
                                                ab[k][0], ab[k][1], pad, 0);
                        }
                fails += !bf16_case(be, fn, name, ta, tc, tra, trb, 67, 129, 65, 0.75f, 0, 3, 1); /* beta 0: C not read */
                fails += !bf16_case(be, fn, name, ta, tc, tra, trb, 7, 13, 0, 1, 0.5f, 2, 0);   /* K == 0 */
                fails += !bf16_case(be, fn, name, ta, tc, tra, trb, 7, 13, 0, 1, 0, 2, 1);
                fails += !bf16_case(be, fn, name, ta, tc, tra, trb, 7, 13, 5, 0, 2, 0, 0);      /* alpha == 0 */
                fails += !bf16_case(be, fn, name, ta, tc, tra, trb, 0, 13, 5, 1, 0.5f, 1, 0);   /* M == 0 */
                n += 5;
            }
    FL_CHECKF(fails == 0, "%s: %d of %d bf16 cases failed", name, fails, n);
}
static void bf16_check_all(gemm_fn fn, const char *name) {
    fl_backend be = bare2();
    bf16_check_all_on(&be, fn, name);
}

FL_TEST(prec_gemm_bf16_library_vs_f64) {
    fprintf(stderr, "  bf16 gemm path: %s (avx512_bf16: %d)\n", fl_cpu_gemm_bf16_path(), fl_cpu_has_avx512bf16());
    bf16_check_all(fl_cpu_gemm, "gemm");
}
/* Every registered backend's gemm slot, the same cases and bounds. */
FL_TEST(prec_gemm_bf16_backends_vs_f64) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) bf16_check_all_on(&be, be.gemm, be.name);
}
FL_TEST(prec_gemm_bf16_tiled_vs_f64) { bf16_check_all(fl_cpu_gemm_bf16_tiled, "tiled"); }

/* The widening path (fl_cpu_gemm's bf16 path on CPUs without avx512_bf16) at every SIMD level
 * the CPU has (fl_cpu_set_level; the levels it lacks are reported and skipped), with the whole
 * scratch and with the scratch capped to 2560 floats: a BF16 C then gets 640-float tiles (all
 * four tile shapes: whole C, full rows, full columns (301x7), square-ish) and, for the larger
 * shapes, K / N / M blocks (e.g. 130x70x300 BF16 A: kb = 20, nb = 35, mb = 65), so the K
 * blocks (beta on the first only), the C tiles (widened for beta, rounded once after the last
 * K block), the pre-widened A of a BF16 C and the tile offsets all run. */
FL_TEST(prec_gemm_bf16_widen_vs_f64) {
    for (int l = FL_CPU_GENERIC; l <= FL_CPU_AVX512; l++) {
        if (l > (int)fl_cpu_level_detected()) {
            fprintf(stderr, "  level %s: not on this CPU, skipped\n", fl_cpu_level_name((fl_cpu_level_t)l));
            continue;
        }
        fl_cpu_set_level(l);
        char name[64];
        if (l == (int)fl_cpu_level_detected()) { /* the widening kernels' tails run at every level below */
            snprintf(name, sizeof name, "widen-%s", fl_cpu_level_name((fl_cpu_level_t)l));
            bf16_check_all(fl_cpu_gemm_bf16_widen, name);
        }
        fl_cpu_gemm_widen_set_scratch_cap(2560);
        snprintf(name, sizeof name, "widen-%s-blocked", fl_cpu_level_name((fl_cpu_level_t)l));
        bf16_check_all(fl_cpu_gemm_bf16_widen, name);
        fl_cpu_gemm_widen_set_scratch_cap(0);
    }
    fl_cpu_set_level(-1);
}
FL_TEST(prec_gemm_bf16_naive_vs_f64) { bf16_check_all(fl_cpu_gemm_naive, "naive"); }

FL_TEST(prec_gemm_bf16_unsupported_and_deterministic) {
    fl_backend be = {0};
    be.n_threads = 2;
    float a[4] = {1, 2, 3, 4}, c[4];
    uint16_t b[4];
    gemm_fn fns[4] = {fl_cpu_gemm, fl_cpu_gemm_naive, fl_cpu_gemm_bf16_tiled, fl_cpu_gemm_bf16_widen};
    for (int f = 0; f < 4; f++) {
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, b, FL_BF16, 2, a, FL_F32, 2, 0, c, FL_F32, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 2, b, FL_BF16, 2, 0, c, FL_BF16, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, b, FL_F16, 2, b, FL_BF16, 2, 0, c, FL_F32, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, b, FL_BF16, 1, b, FL_BF16, 2, 0, c, FL_F32, 2) == FL_ERR_INVALID);
    }
    /* run-to-run identical (library at 2 threads); tiled identical for 1 and 2 threads */
    int M = 96, N = 200, K = 150;
    fl_test_rng rng = {7};
    float *A = malloc(4 * M * K), *Bf = malloc(4 * K * N), *C[4];
    fl_test_fill(&rng, A, (size_t)M * K, -1, 1);
    fl_test_fill(&rng, Bf, (size_t)K * N, -1, 1);
    uint16_t *B = to_bf16(Bf, (size_t)K * N);
    for (int r = 0; r < 4; r++) C[r] = malloc(4 * M * N);
    for (int r = 0; r < 2; r++) FL_REQUIRE_OK(fl_cpu_gemm(&be, 0, 1, M, N, K, 1, A, FL_F32, K, B, FL_BF16, K, 0, C[r], FL_F32, N));
    FL_CHECK(memcmp(C[0], C[1], 4 * M * N) == 0);
    for (int r = 2; r < 4; r++) {
        be.n_threads = r - 1;
        FL_REQUIRE_OK(fl_cpu_gemm_bf16_tiled(&be, 0, 1, M, N, K, 1, A, FL_F32, K, B, FL_BF16, K, 0, C[r], FL_F32, N));
    }
    FL_CHECK(memcmp(C[2], C[3], 4 * M * N) == 0);
    /* library vs tiled on a training-like shape */
    FL_CHECK(fl_test_allclose("library vs tiled", C[0], C[2], (size_t)M * N, 1e-5, 1e-4));
    for (int r = 0; r < 4; r++) free(C[r]);
    free(A), free(Bf), free(B);
}

/* ---- fp16 GEMM -------------------------------------------------------------------------- */

static float hf(float x) { return fl_f16_to_f32(fl_f32_to_f16(x)); }
static uint16_t *to_f16(const float *x, size_t n) {
    uint16_t *y = malloc((n ? n : 1) * 2);
    for (size_t i = 0; i < n; i++) y[i] = fl_f32_to_f16(x[i]);
    return y;
}

/* One F32xF16->F32 or F16xF16->F32 case, same layout as bf16_case. B's values (and A's when A
 * is F16) are f16 values, some f16 subnormals among them; the float64 reference uses exactly
 * those values and an F32 A as is (not rounded to f16). Tolerance: fp32_dot_bound (an f16 x
 * F32 product is not exact in fp32: one more rounding each, covered by the bound's 2K + 2).
 * Padding and the untouched part of C: exact. */
static int f16_case(const fl_backend *bep, gemm_fn fn, const char *name, fl_dtype ta, int tra, int trb, int M, int N,
                    int K, float alpha, float beta, int pad, int nan_c) {
    fl_backend be = *bep;
    fl_test_rng rng = {(unsigned long long)(M * 7907 + N * 104723 + K * 37 + tra * 2 + trb + pad * 11 + ta * 5)};
    int a_rows = tra ? K : M, a_cols = tra ? M : K, b_rows = trb ? N : K, b_cols = trb ? K : N;
    int lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
    if (lda < 1) lda = 1;
    if (ldb < 1) ldb = 1;
    size_t na = (size_t)(a_rows > 0 ? a_rows : 1) * lda + 3, nb = (size_t)(b_rows > 0 ? b_rows : 1) * ldb + 3;
    size_t nc = (size_t)M * ldc + 3;
    float *Af = malloc(na * 4), *Bf = malloc(nb * 4), *Cf = malloc(nc * 4);
    fl_test_fill(&rng, Af, na, -1, 1);
    fl_test_fill(&rng, Bf, nb, -1, 1);
    fl_test_fill(&rng, Cf, nc, -1, 1);
    for (size_t i = 0; i < nb; i += 7) Bf[i] *= 1e-4f; /* f16 subnormals (< 2^-14) */
    for (size_t i = 0; i < nb; i++) Bf[i] = hf(Bf[i]);
    if (ta == FL_F16)
        for (size_t i = 0; i < na; i++) Af[i] = hf(Af[i]);
    if (nan_c)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) Cf[3 + (size_t)i * ldc + j] = (i + j) % 2 ? NAN : INFINITY;
    uint16_t *Ah = to_f16(Af, na), *Bh = to_f16(Bf, nb);
    double *R = malloc(nc * sizeof(double)), *T = malloc(nc * sizeof(double)), *ra, *rb;
    for (size_t i = 0; i < nc; i++) R[i] = Cf[i], T[i] = 0;
    ref_operands(Af, Bf, tra, trb, M, N, K, lda, ldb, 0, &ra, &rb);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            const double *ai = ra + (size_t)i * K, *bj = rb + (size_t)j * K;
            double s = 0, sa = 0;
            for (int k = 0; k < K; k++) {
                s += ai[k] * bj[k];
                sa += fabs(ai[k] * bj[k]);
            }
            size_t idx = 3 + (size_t)i * ldc + j;
            double v = alpha * s;
            if (beta != 0) v += (double)beta * Cf[idx];
            T[idx] = fp32_dot_bound(K, fabs(alpha) * sa + fabs(beta != 0 ? beta * Cf[idx] : 0)) + 1e-30;
            R[idx] = v;
        }
    const void *A = ta == FL_F32 ? (const void *)(Af + 3) : (const void *)(Ah + 3);
    fl_status st = fn(&be, tra, trb, M, N, K, alpha, A, ta, lda, Bh + 3, FL_F16, ldb, beta, Cf + 3, FL_F32, ldc);
    int ok = st == FL_OK, bad = 0;
    if (!ok) fprintf(stderr, "  %s: %s\n", name, fl_error_message());
    for (size_t i = 0; ok && i < nc; i++) {
        double got = Cf[i];
        int in_c = 0;
        if (i >= 3) {
            size_t r = (i - 3) / ldc, c = (i - 3) % ldc;
            in_c = r < (size_t)M && c < (size_t)N;
        }
        int good = in_c ? fabs(got - R[i]) <= T[i] : (got == R[i] || (isnan(got) && isnan(R[i])));
        if (!good) {
            if (!bad)
                fprintf(stderr, "  %s %s x F16 -> F32 %c%c M=%d N=%d K=%d a=%g b=%g pad=%d: [%zu] got %.9g want %.9g tol %.3g\n",
                        name, fl_dtype_name(ta), tra ? 'T' : 'N', trb ? 'T' : 'N', M, N, K, alpha, beta, pad, i, got,
                        R[i], T[i]);
            bad++;
        }
    }
    free(Af), free(Bf), free(Cf), free(Ah), free(Bh), free(R), free(T), free(ra), free(rb);
    return ok && !bad;
}

static void f16_check_all_on(const fl_backend *be, gemm_fn fn, const char *name) {
    static const int sizes[][3] = {{7, 13, 37}, {67, 129, 65}, {1, 1, 1}, {33, 1, 17}, {130, 70, 300}, {5, 300, 3}};
    static const float ab[][2] = {{1, 0}, {1, 1}, {0.5f, -2}, {-1.5f, 0.25f}};
    static const fl_dtype tas[2] = {FL_F32, FL_F16};
    int fails = 0, n = 0;
    for (int c = 0; c < 2; c++)
        for (int tra = 0; tra < 2; tra++)
            for (int trb = 0; trb < 2; trb++) {
                fl_dtype ta = tas[c];
                if (tra == 0 && trb == 0 && gemm_combo_unsupported(be, fn, ta, FL_F16, FL_F32)) {
                    trb = tra = 2; /* the whole combination */
                    break;
                }
                for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
                    for (size_t k = 0; k < sizeof ab / sizeof ab[0]; k++)
                        for (int pad = 0; pad <= 5; pad += 5, n++) {
                            if (!sweep_case(be, s, k, pad)) continue;
                            fails += !f16_case(be, fn, name, ta, tra, trb, sizes[s][0], sizes[s][1], sizes[s][2], ab[k][0],
                                               ab[k][1], pad, 0);
                        }
                fails += !f16_case(be, fn, name, ta, tra, trb, 67, 129, 65, 0.75f, 0, 3, 1); /* beta 0: C not read */
                fails += !f16_case(be, fn, name, ta, tra, trb, 7, 13, 37, 1, 0, 0, 1);
                fails += !f16_case(be, fn, name, ta, tra, trb, 7, 13, 0, 1, 0.5f, 2, 0);    /* K == 0 */
                fails += !f16_case(be, fn, name, ta, tra, trb, 7, 13, 0, 1, 0, 2, 1);       /* K == 0, beta 0 */
                fails += !f16_case(be, fn, name, ta, tra, trb, 7, 13, 5, 0, 2, 0, 0);       /* alpha == 0 */
                fails += !f16_case(be, fn, name, ta, tra, trb, 7, 13, 5, 0, 0, 1, 1);       /* alpha == 0, beta 0 */
                fails += !f16_case(be, fn, name, ta, tra, trb, 0, 13, 5, 1, 0.5f, 1, 0);    /* M == 0 */
                fails += !f16_case(be, fn, name, ta, tra, trb, 7, 0, 5, 1, 0.5f, 1, 0);     /* N == 0 */
                n += 8;
            }
    FL_CHECKF(fails == 0, "%s: %d of %d f16 cases failed", name, fails, n);
}
static void f16_check_all(gemm_fn fn, const char *name) {
    fl_backend be = bare2();
    f16_check_all_on(&be, fn, name);
}

FL_TEST(prec_gemm_f16_library_vs_f64) {
    fprintf(stderr, "  f16 gemm path: %s (%s)\n", fl_cpu_gemm_f16_path(), fl_cpu_gemm_library());
    f16_check_all(fl_cpu_gemm, "gemm");
}
FL_TEST(prec_gemm_f16_backends_vs_f64) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) f16_check_all_on(&be, be.gemm, be.name);
}
FL_TEST(prec_gemm_f16_naive_vs_f64) { f16_check_all(fl_cpu_gemm_naive, "naive"); }

/* The same cases with the scratch capped to 2560 floats: for the larger shapes K, N and (F16 A)
 * M are split into several blocks (e.g. 130x70x300 with an F16 A: kb = 20, nb = 35, mb = 65),
 * so the per-block beta (first K block only) and the C tile offsets are exercised. */
FL_TEST(prec_gemm_f16_blocked_vs_f64) {
    fl_cpu_gemm_widen_set_scratch_cap(2560);
    f16_check_all(fl_cpu_gemm, "gemm-blocked");
    fl_cpu_gemm_widen_set_scratch_cap(0);
}

/* Widening is exact: with A = 1 and K = 1, C = op(B) for every f16 bit pattern (subnormals,
 * +-0, +-inf, the largest finite 65504; NaN stays NaN), both transposes, F32 and F16 A. C is
 * compared with ==: the sgemm's 0 + 1 * (-0) may give +0. */
FL_TEST(prec_gemm_f16_widen_exact) {
    fl_backend be = {0};
    be.n_threads = 2;
    int N = 65536;
    uint16_t *B = malloc((size_t)N * 2), one_h = 0x3c00;
    float *C = malloc((size_t)N * 4), one = 1.0f;
    for (int j = 0; j < N; j++) B[j] = (uint16_t)j;
    for (int ah = 0; ah < 2; ah++)
        for (int trb = 0; trb < 2; trb++) {
            for (int j = 0; j < N; j++) C[j] = NAN;
            const void *A = ah ? (const void *)&one_h : (const void *)&one;
            FL_REQUIRE_OK(fl_cpu_gemm(&be, 0, trb, 1, N, 1, 1.0f, A, ah ? FL_F16 : FL_F32, 1, B, FL_F16, trb ? 1 : N,
                                      0.0f, C, FL_F32, N));
            int bad = 0;
            for (int j = 0; j < N; j++) {
                float want = fl_f16_to_f32((uint16_t)j);
                bad += isnan(want) ? !isnan(C[j]) : C[j] != want; /* -0 may come back +0 (0 + 1*-0) */
            }
            FL_CHECKF(bad == 0, "A=%s trans_b=%d: %d f16 values not widened exactly", ah ? "F16" : "F32", trb, bad);
        }
    free(B), free(C);
}

FL_TEST(prec_gemm_f16_unsupported_and_deterministic) {
    fl_backend be = {0};
    be.n_threads = 2;
    float a[4] = {1, 2, 3, 4}, c[4];
    uint16_t h[4] = {0x3c00, 0, 0, 0x3c00};
    gemm_fn fns[2] = {fl_cpu_gemm, fl_cpu_gemm_naive};
    for (int f = 0; f < 2; f++) {
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 2, h, FL_F16, 2, 0, h, FL_F16, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, h, FL_F16, 2, h, FL_F16, 2, 0, h, FL_F16, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, h, FL_F16, 2, a, FL_F32, 2, 0, c, FL_F32, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, h, FL_BF16, 2, h, FL_F16, 2, 0, c, FL_F32, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(fns[f](&be, 0, 0, 2, 2, 2, 1, h, FL_F16, 2, h, FL_BF16, 2, 0, c, FL_F32, 2) == FL_ERR_UNSUPPORTED);
        FL_CHECK(strstr(fl_error_message(), "F32xF16->F32") != NULL);
        FL_CHECK(fns[f](&be, 0, 1, 2, 2, 2, 1, a, FL_F32, 2, h, FL_F16, 1, 0, c, FL_F32, 2) == FL_ERR_INVALID);
        FL_REQUIRE_OK(fns[f](&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 2, h, FL_F16, 2, 0, c, FL_F32, 2));
        FL_CHECK(c[0] == 1 && c[1] == 2 && c[2] == 3 && c[3] == 4);
    }
    FL_CHECK(fl_cpu_gemm_bf16_tiled(&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 2, h, FL_F16, 2, 0, c, FL_F32, 2) ==
             FL_ERR_UNSUPPORTED);
    /* run-to-run identical at a fixed thread count; library vs naive on a training-like shape */
    int M = 96, N = 200, K = 150;
    fl_test_rng rng = {11};
    float *A = malloc(4 * M * K), *Bf = malloc(4 * K * N), *C[3];
    fl_test_fill(&rng, A, (size_t)M * K, -1, 1);
    fl_test_fill(&rng, Bf, (size_t)K * N, -1, 1);
    uint16_t *B = to_f16(Bf, (size_t)K * N);
    for (int r = 0; r < 3; r++) C[r] = malloc(4 * M * N);
    for (int r = 0; r < 2; r++)
        FL_REQUIRE_OK(fl_cpu_gemm(&be, 0, 1, M, N, K, 1, A, FL_F32, K, B, FL_F16, K, 0, C[r], FL_F32, N));
    FL_CHECK(memcmp(C[0], C[1], 4 * M * N) == 0);
    FL_REQUIRE_OK(fl_cpu_gemm_naive(&be, 0, 1, M, N, K, 1, A, FL_F32, K, B, FL_F16, K, 0, C[2], FL_F32, N));
    FL_CHECK(fl_test_allclose("f16 library vs naive", C[0], C[2], (size_t)M * N, 1e-5, 1e-4));
    for (int r = 0; r < 3; r++) free(C[r]);
    free(A), free(Bf), free(B);
}

/* ---- convert ---------------------------------------------------------------------------- */

static void prec_convert_on(fl_backend be) {
    size_t n = 100003;
    float *x = malloc(n * 4), *y = malloc(n * 4);
    uint16_t *h = malloc(n * 2), *h2 = malloc(n * 2);
    fl_test_rng rng = {99};
    for (size_t i = 0; i < n; i++) {
        union { uint32_t u; float f; } v = {(uint32_t)fl_test_rng_u64(&rng)};
        x[i] = v.f; /* every bit pattern: NaN, inf, subnormals, ties */
    }
    float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f, 65504.0f, 65520.0f, 1.00390625f, 1.01171875f};
    memcpy(x, specials, sizeof specials);
    const fl_dtype ts[3] = {FL_F32, FL_BF16, FL_F16};
    for (int d = 1; d < 3; d++) {
        FL_REQUIRE_OP(&be, be.convert(&be, h, ts[d], x, FL_F32, n));
        int bad = 0;
        for (size_t i = 0; i < n; i++) {
            uint16_t want = ts[d] == FL_BF16 ? fl_f32_to_bf16(x[i]) : fl_f32_to_f16(x[i]);
            bad += h[i] != want;
        }
        FL_CHECKF(bad == 0, "F32 -> %s: %d mismatches", fl_dtype_name(ts[d]), bad);
        FL_REQUIRE_OP(&be, be.convert(&be, y, FL_F32, h, ts[d], n));
        bad = 0;
        for (size_t i = 0; i < n; i++) {
            float want = ts[d] == FL_BF16 ? fl_bf16_to_f32(h[i]) : fl_f16_to_f32(h[i]);
            bad += memcmp(&y[i], &want, 4) != 0;
        }
        FL_CHECKF(bad == 0, "%s -> F32: %d mismatches", fl_dtype_name(ts[d]), bad);
        /* 16 -> other 16 through f32 */
        fl_dtype o = ts[3 - d];
        FL_REQUIRE_OP(&be, be.convert(&be, h2, o, h, ts[d], n));
        bad = 0;
        for (size_t i = 0; i < n; i++) {
            float f = ts[d] == FL_BF16 ? fl_bf16_to_f32(h[i]) : fl_f16_to_f32(h[i]);
            uint16_t want = o == FL_BF16 ? fl_f32_to_bf16(f) : fl_f32_to_f16(f);
            bad += h2[i] != want;
        }
        FL_CHECKF(bad == 0, "%s -> %s: %d mismatches", fl_dtype_name(ts[d]), fl_dtype_name(o), bad);
    }
    /* RNE spot checks: 1 + 2^-8 is a bf16 tie -> even (1.0); 1 + 3*2^-8 -> 1 + 2^-6 */
    FL_CHECK(fl_f32_to_bf16(1.00390625f) == 0x3f80);
    FL_CHECK(fl_f32_to_bf16(1.01171875f) == 0x3f82);
    FL_CHECK(be.convert(&be, h, FL_I32, x, FL_F32, 4) == FL_ERR_UNSUPPORTED);
    free(x), free(y), free(h), free(h2);
}
FL_TEST(prec_convert) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) prec_convert_on(be);
}

/* ---- optimizer updates over reduced-precision storage ---------------------------------- */

static void *alloc_t(fl_dtype t, size_t n) { return malloc((n ? n : 1) * fl_dtype_size(t)); }
static float ld(const void *x, fl_dtype t, size_t i) {
    if (t == FL_F32) return ((const float *)x)[i];
    if (t == FL_BF16) return fl_bf16_to_f32(((const uint16_t *)x)[i]);
    return fl_f16_to_f32(((const uint16_t *)x)[i]);
}
static void st_(void *x, fl_dtype t, size_t i, float v) {
    if (t == FL_F32) ((float *)x)[i] = v;
    else if (t == FL_BF16) ((uint16_t *)x)[i] = fl_f32_to_bf16(v);
    else ((uint16_t *)x)[i] = fl_f32_to_f16(v);
}
/* Error of got against the double reference `want`, in units of the allowed error: half an
 * ulp of the storage type at want (the single RNE on store) plus fp32 evaluation error,
 * 16 * 2^-24 * mag, where mag is the sum of |terms| (cancellation makes relative error
 * meaningless for the fp32 part). <= 1 passes. */
static double err_units(float got, double want, fl_dtype t, double mag) {
    double u = t == FL_BF16 ? 1.0 / 256 : t == FL_F16 ? 1.0 / 2048 : 1.0 / 16777216;
    int e;
    frexp(fabs(want) > 1e-38 ? fabs(want) : 1e-38, &e);
    double half_ulp = ldexp(u, e - 1);
    if (t == FL_F16 && half_ulp < ldexp(1, -25)) half_ulp = ldexp(1, -25);
    if (t == FL_BF16 && half_ulp < ldexp(1, -134)) half_ulp = ldexp(1, -134);
    return fabs((double)got - want) / (half_ulp * 1.0001 + 16 * ldexp(1, -24) * mag + 1e-300);
}

static void prec_adamw_sgd_mixed_vs_double_on(fl_backend be) {
    const fl_dtype combos[][3] = {{FL_BF16, FL_BF16, FL_BF16}, {FL_F32, FL_F32, FL_BF16}, {FL_F32, FL_BF16, FL_F32},
                                  {FL_BF16, FL_F32, FL_F32},   {FL_F16, FL_F16, FL_F32},  {FL_F32, FL_F32, FL_F32}};
    size_t n = 5003;
    for (size_t c = 0; c < sizeof combos / sizeof combos[0]; c++) {
        fl_dtype tp = combos[c][0], tg = combos[c][1], ts = combos[c][2];
        void *p = alloc_t(tp, n), *g = alloc_t(tg, n), *m = alloc_t(ts, n), *v = alloc_t(ts, n);
        fl_test_rng rng = {1000 + c};
        for (size_t i = 0; i < n; i++) {
            st_(p, tp, i, fl_test_rng_uniform(&rng, -1, 1));
            st_(m, ts, i, fl_test_rng_uniform(&rng, -0.01f, 0.01f));
            st_(v, ts, i, fl_test_rng_uniform(&rng, 0, 1e-4f));
        }
        double worst_p = 0, worst_s = 0;
        for (int step = 1; step <= 3; step++) {
            for (size_t i = 0; i < n; i++) st_(g, tg, i, fl_test_rng_uniform(&rng, -0.1f, 0.1f));
            float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
            double *rp = malloc(n * 8), *rm = malloc(n * 8), *rv = malloc(n * 8), *mg = malloc(n * 24);
            double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
            for (size_t i = 0; i < n; i++) {
                double gi = (double)ld(g, tg, i) * gs, p0 = ld(p, tp, i), pi = p0 * (1 - (double)lr * wd);
                double m0 = ld(m, ts, i), v0 = ld(v, ts, i);
                double mi = b1 * m0 + (1 - (double)b1) * gi;
                double vi = b2 * v0 + (1 - (double)b2) * gi * gi;
                double upd = lr / bc1 * mi / (sqrt(vi) / sqrt(bc2) + eps);
                rp[i] = pi - upd;
                rm[i] = mi, rv[i] = vi;
                /* magnitudes; the update's own relative error (~8 fp32 roundings) scales |upd| */
                mg[3 * i] = fabs(p0) + 4 * fabs(upd) + fabs(upd) * 4 * (fabs(m0) + fabs(gi)) / fmax(fabs(mi), 1e-30);
                mg[3 * i + 1] = fabs(m0) + fabs(gi);
                mg[3 * i + 2] = v0 + gi * gi;
            }
            FL_REQUIRE_OP(&be, be.adamw_update(&be, p, tp, g, tg, m, v, ts, n, lr, b1, b2, eps, wd, step, gs));
            for (size_t i = 0; i < n; i++) {
                worst_p = fmax(worst_p, err_units(ld(p, tp, i), rp[i], tp, mg[3 * i]));
                worst_s = fmax(worst_s, fmax(err_units(ld(m, ts, i), rm[i], ts, mg[3 * i + 1]),
                                             err_units(ld(v, ts, i), rv[i], ts, mg[3 * i + 2])));
            }
            free(rp), free(rm), free(rv), free(mg);
        }
        FL_CHECKF(worst_p <= 1 && worst_s <= 1, "adamw p=%s g=%s s=%s: worst error %.3g (p), %.3g (state) of allowed",
                  fl_dtype_name(tp), fl_dtype_name(tg), fl_dtype_name(ts), worst_p, worst_s);
        /* SGD with momentum and nesterov, then plain */
        for (int mode = 0; mode < 2; mode++) {
            float lr = 0.05f, mom = mode ? 0.0f : 0.9f, damp = 0.1f, wd = 0.01f, gs = 2.0f;
            for (int first = 1; first >= 0; first--) {
                double *rp = malloc(n * 8), *rb = malloc(n * 8), *mp = malloc(n * 8), *mb = malloc(n * 8);
                for (size_t i = 0; i < n; i++) {
                    double g0 = (double)ld(g, tg, i) * gs, p0 = ld(p, tp, i), b0 = mom != 0 ? ld(m, ts, i) : 0;
                    double d = g0 + (double)wd * p0, dm = fabs(g0) + fabs(wd * p0);
                    if (mom != 0) {
                        double b = first ? d : mom * b0 + (1 - (double)damp) * d;
                        rb[i] = b;
                        mb[i] = first ? dm : fabs(mom * b0) + dm;
                        dm += mom * mb[i];
                        d = d + mom * b; /* nesterov */
                    }
                    rp[i] = p0 - (double)lr * d;
                    mp[i] = fabs(p0) + 2 * lr * dm;
                }
                FL_REQUIRE_OP(&be, be.sgd_update(&be, p, tp, g, tg, mom != 0 ? m : NULL, ts, n, lr, mom, damp, wd, 1, first, gs));
                double wp = 0, wb = 0;
                for (size_t i = 0; i < n; i++) {
                    wp = fmax(wp, err_units(ld(p, tp, i), rp[i], tp, mp[i]));
                    if (mom != 0) wb = fmax(wb, err_units(ld(m, ts, i), rb[i], ts, mb[i]));
                }
                FL_CHECKF(wp <= 1 && wb <= 1, "sgd p=%s g=%s s=%s mom=%g: worst error %.3g (p), %.3g (buf) of allowed",
                          fl_dtype_name(tp), fl_dtype_name(tg), fl_dtype_name(ts), mom, wp, wb);
                free(rp), free(rb), free(mp), free(mb);
            }
        }
        free(p), free(g), free(m), free(v);
    }
    FL_CHECK(be.adamw_update(&be, NULL, FL_F64, NULL, FL_F32, NULL, NULL, FL_F32, 1, 1, 0.9f, 0.9f, 1e-8f, 0, 1, 1) ==
             FL_ERR_UNSUPPORTED);
    FL_CHECK(be.sgd_update(&be, NULL, FL_F32, NULL, FL_F32, NULL, FL_F16, 1, 1, 0, 0, 0, 0, 1, 1) == FL_ERR_UNSUPPORTED);
}
FL_TEST(prec_adamw_sgd_mixed_vs_double) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) prec_adamw_sgd_mixed_vs_double_on(be);
}

/* ---- loss scaling ----------------------------------------------------------------------- */

static void prec_check_finite_on(fl_backend be) {
    size_t n = 70001;
    float *x = malloc(n * 4);
    uint16_t *h = malloc(n * 2);
    fl_test_rng rng = {5};
    fl_test_fill(&rng, x, n, -100, 100);
    const fl_dtype ts[3] = {FL_F32, FL_BF16, FL_F16};
    float bads[3] = {INFINITY, -INFINITY, NAN};
    size_t where[3] = {0, n / 2, n - 1};
    for (int d = 0; d < 3; d++) {
        const void *src = x;
        /* the inputs in 16 bits by the host conversion (same RNE as the convert op): the op under
         * test here is check_finite, whatever convert the backend has */
        if (d) { fl_convert(h, ts[d], x, FL_F32, n); src = h; }
        int found = 0;
        FL_REQUIRE_OP(&be, be.check_finite(&be, src, ts[d], n, 1.0f / 65536, &found));
        FL_CHECK(found == 0);
        for (int b = 0; b < 3; b++)
            for (int w = 0; w < 3; w++) {
                float keep = x[where[w]];
                x[where[w]] = bads[b];
                if (d) { fl_convert(h, ts[d], x, FL_F32, n); src = h; }
                found = 0;
                FL_REQUIRE_OP(&be, be.check_finite(&be, src, ts[d], n, 0.5f, &found));
                FL_CHECKF(found == 1, "%s: %g at %zu not found", fl_dtype_name(ts[d]), bads[b], where[w]);
                x[where[w]] = keep;
            }
    }
    /* the check is on x * inv_scale (torch unscales then checks): overflow counts */
    float big[3] = {1e38f, 2.0f, -3e38f};
    int found = 0;
    FL_REQUIRE_OP(&be, be.check_finite(&be, big, FL_F32, 3, 1.0f, &found));
    FL_CHECK(found == 0);
    FL_REQUIRE_OP(&be, be.check_finite(&be, big, FL_F32, 3, 4.0f, &found));
    FL_CHECK(found == 1);
    /* found_inf is only ever set, so calls over several ranges OR together */
    FL_REQUIRE_OP(&be, be.check_finite(&be, big, FL_F32, 2, 1.0f, &found));
    FL_CHECK(found == 1);
    free(x), free(h);
}
FL_TEST(prec_check_finite) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) prec_check_finite_on(be);
}

FL_TEST(prec_loss_scale_state_machine) {
    fl_loss_scale ls;
    fl_loss_scale_init(&ls);
    FL_CHECK(ls.scale == 65536.0f && ls.growth_interval == 2000 && ls.growth_factor == 2.0f &&
             ls.backoff_factor == 0.5f && ls.growth_tracker == 0);
    FL_CHECK(fl_loss_scale_inv(&ls) == 1.0f / 65536);
    /* 1999 clean steps: no growth; the 2000th doubles and resets the tracker */
    for (int i = 0; i < 1999; i++) FL_CHECK(fl_loss_scale_update(&ls, 0) == 0);
    FL_CHECK(ls.scale == 65536.0f && ls.growth_tracker == 1999);
    FL_CHECK(fl_loss_scale_update(&ls, 0) == 0);
    FL_CHECK(ls.scale == 131072.0f && ls.growth_tracker == 0 && ls.n_growths == 1);
    /* overflow: skip, halve, reset the clean-step counter */
    for (int i = 0; i < 1500; i++) fl_loss_scale_update(&ls, 0);
    FL_CHECK(fl_loss_scale_update(&ls, 1) == 1);
    FL_CHECK(ls.scale == 65536.0f && ls.growth_tracker == 0 && ls.n_skipped == 1);
    /* the 1500 clean steps before the overflow do not count: growth needs 2000 fresh ones */
    for (int i = 0; i < 1999; i++) fl_loss_scale_update(&ls, 0);
    FL_CHECK(ls.scale == 65536.0f);
    fl_loss_scale_update(&ls, 0);
    FL_CHECK(ls.scale == 131072.0f);
    /* consecutive overflows halve each time; torch has no floor: 2^17 -> ... -> 2^-149 -> 0 */
    int k = 0;
    while (ls.scale > 0.0f && k < 400) {
        FL_CHECK(fl_loss_scale_update(&ls, 1) == 1);
        k++;
    }
    FL_CHECKF(k == 17 + 149 + 1 && ls.scale == 0.0f, "reached 0 after %d backoffs", k);
    FL_CHECK(fl_loss_scale_inv(&ls) == 0.0f);
    /* growth that would overflow keeps the scale but resets the tracker (torch) */
    FL_REQUIRE_OK(fl_loss_scale_init_ex(&ls, 0x1p127f, 2.0f, 0.5f, 3, 0.0f));
    for (int i = 0; i < 3; i++) fl_loss_scale_update(&ls, 0);
    FL_CHECK(ls.scale == 0x1p127f && ls.growth_tracker == 0 && ls.n_growths == 0);
    /* optional floor */
    FL_REQUIRE_OK(fl_loss_scale_init_ex(&ls, 4.0f, 2.0f, 0.5f, 2000, 1.0f));
    for (int i = 0; i < 5; i++) fl_loss_scale_update(&ls, 1);
    FL_CHECK(ls.scale == 1.0f);
    /* growth_interval 1 grows every clean step */
    FL_REQUIRE_OK(fl_loss_scale_init_ex(&ls, 1.0f, 2.0f, 0.5f, 1, 0.0f));
    fl_loss_scale_update(&ls, 0);
    fl_loss_scale_update(&ls, 0);
    FL_CHECK(ls.scale == 4.0f);
    /* inverse in double then float (torch: scale.double().reciprocal().float()) */
    FL_REQUIRE_OK(fl_loss_scale_init_ex(&ls, 3.0f, 2.0f, 0.5f, 10, 0.0f));
    FL_CHECK(fl_loss_scale_inv(&ls) == (float)(1.0 / 3.0));
    FL_CHECK(fl_loss_scale_init_ex(&ls, 0.0f, 2.0f, 0.5f, 10, 0.0f) == FL_ERR_INVALID);
    FL_CHECK(fl_loss_scale_init_ex(&ls, 1.0f, 1.0f, 0.5f, 10, 0.0f) == FL_ERR_INVALID);
    FL_CHECK(fl_loss_scale_init_ex(&ls, 1.0f, 2.0f, 1.0f, 10, 0.0f) == FL_ERR_INVALID);
    FL_CHECK(fl_loss_scale_init_ex(&ls, 1.0f, 2.0f, 0.5f, 0, 0.0f) == FL_ERR_INVALID);
}

/* ---- 8-bit AdamW ------------------------------------------------------------------------- */

FL_TEST(prec_adam8bit_layout_and_codes) {
    FL_CHECK(fl_adam8bit_state_bytes(0) == 0);
    FL_CHECK(fl_adam8bit_state_bytes(4095) == 8 * 4095);
    FL_CHECK(fl_adam8bit_state_bytes(4096) == 2 * 4096 + 8 * 16);
    FL_CHECK(fl_adam8bit_state_bytes(5000) == 10000 + 8 * 20);
    FL_CHECK(fl_adam8bit_state_bytes(4097) == 8196 + 8 * 17); /* 8194 padded to 4 */
    fl_adam8bit_state st;
    void *mem = calloc(1, fl_adam8bit_state_bytes(4097));
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&st, 4097, mem));
    FL_CHECK(st.n_blocks == 17 && st.q_m == mem && st.q_v == st.q_m + 4097 && st.m == NULL);
    FL_CHECK((char *)(st.absmax_v + 17) <= (char *)mem + fl_adam8bit_state_bytes(4097));
    FL_CHECK((uintptr_t)st.absmax_m % 4 == 0);
    free(mem);
    const float *cs = fl_adam8bit_code_signed, *cu = fl_adam8bit_code_unsigned;
    int sorted = 1;
    for (int i = 1; i < 256; i++) sorted &= cs[i] > cs[i - 1] && cu[i] > cu[i - 1];
    FL_CHECK(sorted);
    FL_CHECK(cs[127] == 0.0f && cs[255] == 1.0f && cu[0] == 0.0f && cu[255] == 1.0f);
    /* codes map to themselves; otherwise the nearest code (ties: the kernel's rule) */
    fl_test_rng rng = {3};
    int bad = 0;
    for (int s = 0; s < 2; s++) {
        const float *code = s ? cs : cu;
        for (int i = 0; i < 256; i++) bad += fl_adam8bit_quantize(code, s, code[i]) != i;
        for (int t = 0; t < 20000; t++) {
            float x = fl_test_rng_uniform(&rng, s ? -1 : 0, 1);
            if (t % 2) x = x * x * x * x * x; /* small magnitudes */
            int q = fl_adam8bit_quantize(code, s, x), best = 0;
            for (int i = 1; i < 256; i++)
                if (fabsf(code[i] - x) < fabsf(code[best] - x)) best = i;
            if (q != best && fabsf(code[q] - x) != fabsf(code[best] - x)) bad++;
        }
    }
    FL_CHECKF(bad == 0, "%d quantization mismatches", bad);
}

/* Load a tensor from the fixture as floats (F32) or bytes (U8); returns NULL if missing. */
static const void *fx(const fl_st_file *f, const char *name, fl_dtype t, size_t n) {
    const fl_st_tensor *x = fl_st_find(f, name);
    if (!x || x->dtype != t || x->end - x->begin != n * fl_dtype_size(t)) {
        fl_test_fail(__FILE__, __LINE__, "fixture tensor %s missing or wrong shape", name);
        return NULL;
    }
    return x->data;
}

static void prec_adam8bit_vs_bnb_reference_on(fl_backend be) {
    fl_st_file f;
    FL_REQUIRE_OK(fl_st_open(&f, "tests/fixtures/adam8bit-ref.safetensors"));
    const float *cs = fx(&f, "code_signed", FL_F32, 256), *cu = fx(&f, "code_unsigned", FL_F32, 256);
    const float *hp = fx(&f, "hparams", FL_F32, 8);
    if (!cs || !cu || !hp) { fl_st_close(&f); return; }
    FL_CHECK(memcmp(cs, fl_adam8bit_code_signed, 1024) == 0);
    FL_CHECK(memcmp(cu, fl_adam8bit_code_unsigned, 1024) == 0);
    float lr = hp[0], b1 = hp[1], b2 = hp[2], eps = hp[3], wd = hp[4], gs = hp[5];
    int steps = (int)hp[6], K = (int)hp[7];
    const char *names[2] = {"a", "b"};
    size_t ns[2] = {5000, 3000};
    for (int t = 0; t < 2; t++) {
        size_t n = ns[t];
        char key[64];
#define KEY(s) (snprintf(key, sizeof key, "%s.%s", names[t], s), key)
        const float *p0 = fx(&f, KEY("p0"), FL_F32, n), *grads = fx(&f, KEY("grads"), FL_F32, n * K);
        const float *hist = fx(&f, KEY("params"), FL_F32, n * steps);
        if (!p0 || !grads || !hist) break;
        float *p = malloc(n * 4);
        memcpy(p, p0, n * 4);
        void *mem = calloc(1, fl_adam8bit_state_bytes(n));
        fl_adam8bit_state st;
        FL_REQUIRE_OK(fl_adam8bit_state_bind(&st, n, mem));
        FL_CHECK(fl_adam8bit_is_8bit(n) == (t == 0));
        double worst = 0;
        size_t ndiff = 0;
        for (int s = 1; s <= steps; s++) {
            FL_REQUIRE_OP(&be, be.adam8bit_update(&be, p, FL_F32, grads + (size_t)((s - 1) % K) * n, FL_F32, &st, lr, b1, b2,
                                             eps, wd, s, gs));
            const float *want = hist + (size_t)(s - 1) * n;
            for (size_t i = 0; i < n; i++) {
                double d = fabs((double)p[i] - want[i]);
                worst = fmax(worst, d);
                ndiff += d != 0;
            }
        }
        /* Tolerance: the C kernel performs the reference's float32 operation sequence, so
         * params agree to a few fp32 ulps of |p| <= ~5 (libm powf/sqrtf are correctly
         * rounded or identical); a state code that flips on a midpoint tie moves an element
         * by at most lr * (code spacing) ~ 1e-4 on later steps. */
        fprintf(stderr, "  adam8bit %s (n=%zu, %s): max|dp| over %d steps %.3g, %zu element-steps differ\n", names[t], n,
                t == 0 ? "8-bit" : "fp32 state", steps, worst, ndiff);
        FL_CHECKF(worst <= 1e-4, "%s: params differ by %.3g", names[t], worst);
        if (t == 0) {
            const uint8_t *qm = fx(&f, "a.q_m", FL_U8, n), *qv = fx(&f, "a.q_v", FL_U8, n);
            const float *am = fx(&f, "a.absmax_m", FL_F32, st.n_blocks), *av = fx(&f, "a.absmax_v", FL_F32, st.n_blocks);
            if (qm && qv && am && av) {
                size_t dm = 0, dv = 0, far = 0;
                for (size_t i = 0; i < n; i++) {
                    dm += qm[i] != st.q_m[i];
                    dv += qv[i] != st.q_v[i];
                    far += abs((int)qm[i] - st.q_m[i]) > 1 || abs((int)qv[i] - st.q_v[i]) > 1;
                }
                double ra = 0;
                for (size_t b = 0; b < st.n_blocks; b++) {
                    ra = fmax(ra, fabs(am[b] - st.absmax_m[b]) / fmax(am[b], 1e-30));
                    ra = fmax(ra, fabs(av[b] - st.absmax_v[b]) / fmax(av[b], 1e-30));
                }
                fprintf(stderr, "  adam8bit a: final codes differ m %zu, v %zu of %zu; absmax rel diff %.3g\n", dm, dv, n, ra);
                FL_CHECKF(dm + dv <= n / 500 && far == 0, "codes differ: m %zu v %zu (|diff|>1: %zu)", dm, dv, far);
                FL_CHECKF(ra <= 1e-5, "absmax rel diff %.3g", ra);
            }
            /* the fixture's gradient set K-1 has inf/NaN at 10, 300, 4999: params untouched */
        } else {
            const float *m = fx(&f, "b.m", FL_F32, n), *v = fx(&f, "b.v", FL_F32, n);
            if (m && v) {
                FL_CHECK(fl_test_allclose("b.m", st.m, m, n, 1e-5, 1e-9));
                FL_CHECK(fl_test_allclose("b.v", st.v, v, n, 1e-5, 1e-12));
            }
        }
        free(p), free(mem);
#undef KEY
    }
    fl_st_close(&f);
}
FL_TEST(prec_adam8bit_vs_bnb_reference) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) prec_adam8bit_vs_bnb_reference_on(be);
}

static void prec_adam8bit_nonfinite_rule_on(fl_backend be) {
    size_t n = 5000;
    float *p = malloc(n * 4), *p2 = malloc(n * 4), *g = malloc(n * 4), *g2 = malloc(n * 4);
    fl_test_rng rng = {11};
    fl_test_fill(&rng, p, n, -1, 1);
    memcpy(p2, p, n * 4);
    size_t bytes = fl_adam8bit_state_bytes(n);
    void *m1 = calloc(1, bytes), *m2 = calloc(1, bytes);
    fl_adam8bit_state s1, s2;
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&s1, n, m1));
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&s2, n, m2));
    for (int step = 1; step <= 3; step++) {
        fl_test_fill(&rng, g, n, -0.1f, 0.1f);
        memcpy(g2, g, n * 4);
        if (step == 3) { g2[5] = NAN; g2[700] = INFINITY; g2[701] = -INFINITY; }
        float *keep = malloc(n * 4);
        memcpy(keep, p2, n * 4);
        FL_REQUIRE_OP(&be, be.adam8bit_update(&be, p, FL_F32, g, FL_F32, &s1, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 1.0f));
        FL_REQUIRE_OP(&be, be.adam8bit_update(&be, p2, FL_F32, g2, FL_F32, &s2, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 1.0f));
        if (step == 3) {
            size_t idx[3] = {5, 700, 701};
            for (int k = 0; k < 3; k++) {
                size_t i = idx[k], b = i / 256;
                FL_CHECKF(p2[i] == keep[i], "p[%zu] changed on a non-finite gradient", i);
                /* m and v of that element are reset to 0 (bnb kernel), i.e. dequantize to 0 */
                FL_CHECK(fl_adam8bit_code_signed[s2.q_m[i]] * s2.absmax_m[b] == 0.0f);
                FL_CHECK(fl_adam8bit_code_unsigned[s2.q_v[i]] * s2.absmax_v[b] == 0.0f);
            }
            /* blocks without a non-finite gradient are exactly the clean run */
            for (size_t b = 0; b < s1.n_blocks; b++) {
                if (b == 0 || b == 2) continue;
                size_t i0 = b * 256, i1 = i0 + 256 < n ? i0 + 256 : n;
                FL_CHECK(memcmp(p + i0, p2 + i0, (i1 - i0) * 4) == 0);
                FL_CHECK(memcmp(s1.q_m + i0, s2.q_m + i0, i1 - i0) == 0 && s1.absmax_m[b] == s2.absmax_m[b]);
            }
            /* the other elements of the affected blocks were still updated */
            FL_CHECK(p2[6] != keep[6] && p2[702] != keep[702]);
        }
        free(keep);
    }
    /* bf16 and fp16 parameters and gradients are accepted (prec_adam8bit_16bit_params: their values); others are not */
    uint16_t *pb = to_bf16(p, n), *gb = to_bf16(g, n);
    FL_REQUIRE_OP(&be, be.adam8bit_update(&be, pb, FL_BF16, gb, FL_BF16, &s1, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, 4, 1.0f));
    FL_CHECK(be.adam8bit_update(&be, pb, FL_F64, gb, FL_BF16, &s1, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, 4, 1.0f) ==
             FL_ERR_UNSUPPORTED);
    FL_CHECK(be.adam8bit_update(&be, pb, FL_BF16, gb, FL_I32, &s1, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, 4, 1.0f) ==
             FL_ERR_UNSUPPORTED);
    FL_CHECK(be.supports_op(&be, FL_OP_ADAM8BIT, FL_F16, FL_F16, FL_F32) && !be.supports_op(&be, FL_OP_ADAM8BIT, FL_F64, FL_F32, FL_F32));
    /* determinism: 1 vs 2 threads */
    be.n_threads = 1;
    memset(m1, 0, bytes);
    memset(m2, 0, bytes);
    memcpy(p2, p, n * 4);
    FL_REQUIRE_OP(&be, be.adam8bit_update(&be, p, FL_F32, g, FL_F32, &s1, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1.0f));
    be.n_threads = 2;
    FL_REQUIRE_OP(&be, be.adam8bit_update(&be, p2, FL_F32, g, FL_F32, &s2, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1.0f));
    FL_CHECK(memcmp(p, p2, n * 4) == 0 && memcmp(m1, m2, bytes) == 0);
    free(p), free(p2), free(g), free(g2), free(m1), free(m2), free(pb), free(gb);
}
/* 16-bit parameters (bf16-true, 16-true): bnb's kernels load T, compute in fp32 and store (T)(p). With
 * weight decay 0 the update is one rounding of the fp32 result, so a 16-bit run must give, every step,
 * the 16-bit rounding of the fp32 run (anchored to bnb by prec_adam8bit_vs_bnb_reference) on the same
 * widened inputs (p re-rounded after each step to stay in step), and the same state bytes (the state
 * sees only the 16-bit-exact gradients; the fp32-state path rounds the unscaled gradient to T first, as
 * bnb does). Both the 8-bit path (n 5000) and the fp32-state one (n 3000), with a loss scale (grad_scale
 * 1/128) as 16-true uses it. */
static void adam8bit_16bit_on(fl_backend be, fl_dtype dt) {
    size_t ns[2] = {5000, 3000};
    for (int t = 0; t < 2; t++) {
        size_t n = ns[t];
        fl_test_rng rng = {(unsigned long long)(31 + t + 10 * dt)};
        float *p = malloc(n * 4), *g = malloc(n * 4);
        uint16_t *ph = malloc(n * 2), *gh = malloc(n * 2);
        fl_test_fill(&rng, p, n, -1, 1);
        for (size_t i = 0; i < n; i++) { /* 16-bit-exact values on both sides */
            ph[i] = dt == FL_BF16 ? fl_f32_to_bf16(p[i]) : fl_f32_to_f16(p[i]);
            p[i] = dt == FL_BF16 ? fl_bf16_to_f32(ph[i]) : fl_f16_to_f32(ph[i]);
        }
        size_t bytes = fl_adam8bit_state_bytes(n);
        void *m32 = calloc(1, bytes), *m16 = calloc(1, bytes);
        fl_adam8bit_state s32, s16;
        FL_REQUIRE_OK(fl_adam8bit_state_bind(&s32, n, m32));
        FL_REQUIRE_OK(fl_adam8bit_state_bind(&s16, n, m16));
        size_t bad = 0, moved = 0;
        for (int step = 1; step <= 3; step++) {
            fl_test_fill(&rng, g, n, -40.0f, 40.0f); /* a scaled gradient (x 128) */
            const int q8 = fl_adam8bit_is_8bit(n);
            for (size_t i = 0; i < n; i++) {
                gh[i] = dt == FL_BF16 ? fl_f32_to_bf16(g[i]) : fl_f32_to_f16(g[i]);
                g[i] = dt == FL_BF16 ? fl_bf16_to_f32(gh[i]) : fl_f16_to_f32(gh[i]);
                /* the fp32-state kernel (kOptimizer32bit2State) rounds the UNSCALED gradient to T,
                 * (T)(gnorm_scale * g): the fp32 run gets that value and scale 1 */
                if (!q8) {
                    float u = g[i] * (1.0f / 128);
                    g[i] = dt == FL_BF16 ? fl_bf16_to_f32(fl_f32_to_bf16(u)) : fl_f16_to_f32(fl_f32_to_f16(u));
                }
            }
            FL_REQUIRE_OP(&be, be.adam8bit_update(&be, p, FL_F32, g, FL_F32, &s32, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f, step,
                                                  q8 ? 1.0f / 128 : 1.0f));
            FL_REQUIRE_OP(&be, be.adam8bit_update(&be, ph, dt, gh, dt, &s16, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.0f, step,
                                                  1.0f / 128));
            for (size_t i = 0; i < n; i++) {
                uint16_t want = dt == FL_BF16 ? fl_f32_to_bf16(p[i]) : fl_f32_to_f16(p[i]);
                float before = dt == FL_BF16 ? fl_bf16_to_f32(want) : fl_f16_to_f32(want);
                bad += ph[i] != want;
                moved += before != p[i]; /* the fp32 run left the 16-bit grid: the rounding mattered */
                p[i] = before;
            }
            FL_CHECKF(memcmp(m32, m16, bytes) == 0, "%s n=%zu step %d: the state differs", fl_dtype_name(dt), n, step);
        }
        FL_CHECKF(bad == 0 && moved > n, "%s n=%zu: %zu of %zu parameters are not the rounding of the fp32 update "
                  "(%zu rounded)", fl_dtype_name(dt), n, bad, 3 * n, moved);
        free(p), free(g), free(ph), free(gh), free(m32), free(m16);
    }
}

FL_TEST(prec_adam8bit_16bit_params) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) {
        adam8bit_16bit_on(be, FL_BF16);
        adam8bit_16bit_on(be, FL_F16);
    }
}

FL_TEST(prec_adam8bit_nonfinite_rule) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) prec_adam8bit_nonfinite_rule_on(be);
}

/* The absmax floor (fl_adam8bit_state.floor_m / floor_v), FULL_SHARD's way to update a block that two
 * ranks hold parts of (src/train/optim.c): one tensor of 4396 elements (its last block partial) cut
 * at 1000, inside block 3. Each side updates its whole blocks as they are; each part of block 3 first
 * on a copy (the part's own absmax), then for real with the max of both parts as its floor; each side
 * keeps its own copy of block 3's scales. Over 3 steps every parameter, code and scale must equal
 * the uncut tensor's update bit for bit (max is exact), and the floor must matter: at some step the
 * parts' own maxima differ. */
FL_TEST(prec_adam8bit_absmax_floor_splits_a_block) {
    fl_backend be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&be, 2));
    enum { N = 4396, CUT = 1000, B = FL_ADAM8BIT_BLOCK };
    fl_test_rng r = {7};
    float *p0 = fl_test_frand(&r, N, -1, 1), *pw = malloc(N * 4), *ps = malloc(N * 4);
    memcpy(pw, p0, N * 4), memcpy(ps, p0, N * 4);
    const size_t sb = fl_adam8bit_state_bytes(N);
    void *mw = calloc(1, sb), *ms = calloc(1, sb);
    fl_adam8bit_state w, s;
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&w, N, mw));
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&s, N, ms));
    float rm[2] = {0, 0}; /* the right side's copy of block 3's scales (m, v); s holds the left's */
    const size_t b3 = CUT / B, s3 = b3 * B, e3 = s3 + B;
    int differ = 0;
    for (int step = 1; step <= 3; step++) {
        float *g = fl_test_frand(&r, N, -2, 2);
        for (size_t i = s3; i < CUT; i++) g[i] *= step == 2 ? 0.01f : 1.0f; /* the parts' maxima trade places */
        for (size_t i = CUT; i < e3; i++) g[i] *= step == 2 ? 1.0f : 0.01f;
        FL_REQUIRE_OK(be.adam8bit_update(&be, pw, FL_F32, g, FL_F32, &w, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 1.0f));
        /* the views: [0, s3) whole, [s3, CUT) left part, [CUT, e3) right part, [e3, N) whole */
        fl_adam8bit_state v[4];
        const size_t x[4] = {0, s3, CUT, e3}, y[4] = {s3, CUT, e3, N};
        float part[2][2]; /* pass 1: each part's own max |m|, max v */
        for (int k = 0; k < 4; k++) {
            memset(&v[k], 0, sizeof v[k]);
            v[k].n = y[k] - x[k];
            v[k].n_blocks = (v[k].n + B - 1) / B;
            v[k].q_m = s.q_m + x[k], v[k].q_v = s.q_v + x[k];
            v[k].absmax_m = k == 2 ? &rm[0] : s.absmax_m + x[k] / B;
            v[k].absmax_v = k == 2 ? &rm[1] : s.absmax_v + x[k] / B;
            if (k != 1 && k != 2) continue;
            float cp[B], ca[2] = {v[k].absmax_m[0], v[k].absmax_v[0]};
            uint8_t cq[2 * B];
            memcpy(cp, ps + x[k], v[k].n * 4), memcpy(cq, v[k].q_m, v[k].n), memcpy(cq + B, v[k].q_v, v[k].n);
            fl_adam8bit_state c = v[k];
            c.q_m = cq, c.q_v = cq + B, c.absmax_m = ca, c.absmax_v = ca + 1;
            FL_REQUIRE_OK(be.adam8bit_update(&be, cp, FL_F32, g + x[k], FL_F32, &c, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.01f,
                                             step, 1.0f));
            part[k - 1][0] = ca[0], part[k - 1][1] = ca[1];
        }
        differ |= part[0][0] != part[1][0];
        float fl[2] = {fmaxf(part[0][0], part[1][0]), fmaxf(part[0][1], part[1][1])};
        for (int k = 0; k < 4; k++) {
            if (k == 1 || k == 2) v[k].floor_m = &fl[0], v[k].floor_v = &fl[1];
            FL_REQUIRE_OK(be.adam8bit_update(&be, ps + x[k], FL_F32, g + x[k], FL_F32, &v[k], 1e-2f, 0.9f, 0.999f, 1e-8f,
                                             0.01f, step, 1.0f));
        }
        free(g);
        FL_CHECKF(!memcmp(pw, ps, N * 4) && !memcmp(w.q_m, s.q_m, 2 * (size_t)N) &&
                      !memcmp(w.absmax_m, s.absmax_m, w.n_blocks * 4) && !memcmp(w.absmax_v, s.absmax_v, w.n_blocks * 4) &&
                      !memcmp(&w.absmax_m[b3], &rm[0], 4) && !memcmp(&w.absmax_v[b3], &rm[1], 4),
                  "step %d: the cut tensor's update differs from the whole one's", step);
    }
    FL_CHECK(differ); /* the floor was needed */
    free(p0), free(pw), free(ps), free(mw), free(ms);
    fl_backend_free(&be);
}

FL_TEST(prec_ref_backend_wired) {
    fl_backend be;
    FL_REQUIRE_OK(fl_ref_backend_init(&be));
    FL_CHECK(be.convert && be.adamw_update && be.sgd_update && be.check_finite && be.adam8bit_update);
    float a[4] = {1, 2, 3, 4}, c[4];
    uint16_t b[4] = {0x3f80, 0, 0, 0x3f80};
    FL_REQUIRE_OK(be.gemm(&be, 0, 0, 2, 2, 2, 1, a, FL_F32, 2, b, FL_BF16, 2, 0, c, FL_F32, 2));
    FL_CHECK(c[0] == 1 && c[1] == 2 && c[2] == 3 && c[3] == 4);
}

/* The branch-free quantizer equals bitsandbytes' search as written in the kernel
 * (kept here verbatim as the reference) on random values, every code, every
 * midpoint and their neighbouring floats. */
static uint8_t bnb_search_ref(const float *code, int is_signed, float x) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = is_signed ? -1.0f : 0.0f, upper = 1.0f;
    float val = code[pivot];
    for (int i = 64; i > 0; i >>= 1) {
        if (x > val) { lower_pivot = pivot; lower = val; pivot += i; }
        else { upper_pivot = pivot; upper = val; pivot -= i; }
        val = code[pivot];
    }
    if (x > val) { float mid = (upper + val) * 0.5f; return (uint8_t)(x > mid ? upper_pivot : pivot); }
    float mid = (lower + val) * 0.5f;
    return (uint8_t)(x < mid ? lower_pivot : pivot);
}

FL_TEST(prec_adam8bit_quantize_equals_bnb_search) {
    fl_test_rng r = {99};
    long bad = 0, n = 0;
    for (int sgn = 0; sgn < 2; sgn++) {
        const float *code = sgn ? fl_adam8bit_code_signed : fl_adam8bit_code_unsigned;
        float lo = sgn ? -1.0f : 0.0f;
        float xs[1000];
        uint8_t qs[1000];
        for (int k = 0; k < 1000; k++) {
            for (int j = 0; j < 1000; j++) xs[j] = fl_test_rng_uniform(&r, lo, 1.0f);
            fl_adam8bit_quantize_n(code, sgn, xs, 1000, qs); /* the vector path */
            for (int j = 0; j < 1000; j++, n++) {
                uint8_t want = bnb_search_ref(code, sgn, xs[j]);
                bad += qs[j] != want;
                bad += fl_adam8bit_quantize(code, sgn, xs[j]) != want;
            }
        }
        for (int c = 0; c < 256; c++) {
            float pts[3] = {code[c], c < 255 ? (code[c] + code[c + 1]) * 0.5f : code[c], 0};
            pts[2] = nextafterf(pts[1], 2.0f);
            for (int q = 0; q < 3; q++)
                for (int d = -2; d <= 2; d++, n++) {
                    float x = pts[q];
                    for (int s = 0; s < (d < 0 ? -d : d); s++) x = nextafterf(x, d < 0 ? -2.0f : 2.0f);
                    uint8_t v16[16];
                    float x16[16];
                    for (int l = 0; l < 16; l++) x16[l] = x;
                    fl_adam8bit_quantize_n(code, sgn, x16, 16, v16);
                    bad += fl_adam8bit_quantize(code, sgn, x) != bnb_search_ref(code, sgn, x);
                    bad += v16[7] != bnb_search_ref(code, sgn, x);
                }
        }
    }
    FL_CHECKF(bad == 0, "%ld of %ld values quantize differently", bad, n);
}

/* ---- which dtype combinations each registered backend supports ------------------------------ */

/* Probes every dtype-parameterized op of each registered backend on tiny inputs and prints what
 * it supports, one line per op (ggml's test-backend-ops "supported" column). The combinations
 * backend.h documents are required of cpu and ref (an UNSUPPORTED there fails, through
 * fl_test_unsupported); other backends' gaps are reported as skips. Undocumented combinations
 * must be refused with UNSUPPORTED by every backend, never computed silently. */
static void support_line(const char *be_name, const char *op, int ok, int n, const char *list) {
    printf("      %-6s %-16s %2d/%-2d %s\n", be_name, op, ok, n, list);
}

static void support_on(fl_backend be) {
    float f[8] = {1, 2, 3, 4, 5, 6, 7, 8}, g[8] = {0.5f, 0.25f, 0.125f, 1, 1, 1, 1, 1}, m[8] = {0}, v[8] = {0};
    float c32[8];
    uint16_t h[8], hb[8], hc[8];
    for (int i = 0; i < 8; i++) hb[i] = fl_f32_to_bf16(f[i]), h[i] = fl_f32_to_f16(f[i]);
    char list[512];
    int ok, n;
    const char *dn[3] = {"f32", "bf16", "f16"};
    const fl_dtype dt[3] = {FL_F32, FL_BF16, FL_F16};
    /* gemm: the six documented (ta, tb, tc) combinations, then three it must refuse */
    static const fl_dtype gm[6][3] = {{FL_F32, FL_F32, FL_F32},  {FL_BF16, FL_BF16, FL_F32}, {FL_F32, FL_BF16, FL_F32},
                                      {FL_BF16, FL_BF16, FL_BF16}, {FL_F32, FL_F16, FL_F32},  {FL_F16, FL_F16, FL_F32}};
    list[0] = 0, ok = 0, n = 6;
    for (int k = 0; k < 6; k++) {
        const void *A = gm[k][0] == FL_F32 ? (const void *)f : gm[k][0] == FL_BF16 ? (const void *)hb : (const void *)h;
        const void *B = gm[k][1] == FL_F32 ? (const void *)f : gm[k][1] == FL_BF16 ? (const void *)hb : (const void *)h;
        void *C = gm[k][2] == FL_F32 ? (void *)c32 : (void *)hc;
        fl_status st = be.gemm(&be, 0, 0, 2, 2, 2, 1.0f, A, gm[k][0], 2, B, gm[k][1], 2, 0.0f, C, gm[k][2], 2);
        char what[64];
        snprintf(what, sizeof what, "gemm %s x %s -> %s", fl_dtype_name(gm[k][0]), fl_dtype_name(gm[k][1]),
                 fl_dtype_name(gm[k][2]));
        if (fl_test_unsupported(&be, st, what)) continue;
        FL_CHECKF(st == FL_OK, "%s: %s", what, fl_error_message());
        ok += st == FL_OK;
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", *list ? " " : "", what + 5);
    }
    support_line(be.name, "gemm", ok, n, list);
    FL_CHECK(be.gemm(&be, 0, 0, 2, 2, 2, 1.0f, h, FL_F16, 2, f, FL_F32, 2, 0.0f, c32, FL_F32, 2) == FL_ERR_UNSUPPORTED);
    FL_CHECK(be.gemm(&be, 0, 0, 2, 2, 2, 1.0f, f, FL_F32, 2, h, FL_F16, 2, 0.0f, hc, FL_F16, 2) == FL_ERR_UNSUPPORTED);
    FL_CHECK(be.gemm(&be, 0, 0, 2, 2, 2, 1.0f, f, FL_F64, 2, f, FL_F32, 2, 0.0f, c32, FL_F32, 2) != FL_OK);
    /* convert: every pair of {F32, BF16, F16} */
    list[0] = 0, ok = 0, n = 9;
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 3; s++) {
            const void *src = s == 0 ? (const void *)f : s == 1 ? (const void *)hb : (const void *)h;
            void *dst = d == 0 ? (void *)c32 : (void *)hc;
            fl_status st = be.convert(&be, dst, dt[d], src, dt[s], 8);
            char what[48];
            snprintf(what, sizeof what, "convert %s->%s", dn[s], dn[d]);
            if (fl_test_unsupported(&be, st, what)) continue;
            FL_CHECKF(st == FL_OK, "%s: %s", what, fl_error_message());
            ok += st == FL_OK;
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", *list ? " " : "", what + 8);
        }
    support_line(be.name, "convert", ok, n, list);
    FL_CHECK(be.convert(&be, hc, FL_I32, f, FL_F32, 4) == FL_ERR_UNSUPPORTED);
    /* AdamW / SGD with p, g in {F32, BF16, F16} and state in {F32, BF16} */
    for (int opt = 0; opt < 2; opt++) {
        list[0] = 0, ok = 0, n = 18;
        for (int tp = 0; tp < 3; tp++)
            for (int tg = 0; tg < 3; tg++)
                for (int ts = 0; ts < 2; ts++) {
                    float p[8], gg[8];
                    memcpy(p, f, sizeof p), memcpy(gg, g, sizeof gg), memset(m, 0, sizeof m), memset(v, 0, sizeof v);
                    fl_status st = opt == 0 ? be.adamw_update(&be, p, dt[tp], gg, dt[tg], m, v, dt[ts], 4, 1e-3f, 0.9f,
                                                                 0.999f, 1e-8f, 0.01f, 1, 1.0f)
                                            : be.sgd_update(&be, p, dt[tp], gg, dt[tg], m, dt[ts], 4, 1e-3f, 0.9f, 0.0f,
                                                               0.01f, 0, 1, 1.0f);
                    char what[64];
                    snprintf(what, sizeof what, "%s p %s g %s state %s", opt ? "sgd_update_ex" : "adamw_update_ex",
                             dn[tp], dn[tg], dn[ts]);
                    if (fl_test_unsupported(&be, st, what)) continue;
                    FL_CHECKF(st == FL_OK, "%s: %s", what, fl_error_message());
                    ok += st == FL_OK;
                    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s/%s/%s", *list ? " " : "", dn[tp],
                             dn[tg], dn[ts]);
                }
        support_line(be.name, opt ? "sgd_update_ex" : "adamw_update_ex", ok, n, list);
    }
    /* check_finite, accumulate16 */
    list[0] = 0, ok = 0, n = 3;
    for (int d = 0; d < 3; d++) {
        int found = 0;
        fl_status st = be.check_finite(&be, d == 0 ? (const void *)f : d == 1 ? (const void *)hb : (const void *)h, dt[d],
                                       8, 1.0f, &found);
        char what[48];
        snprintf(what, sizeof what, "check_finite %s", dn[d]);
        if (fl_test_unsupported(&be, st, what)) continue;
        FL_CHECKF(st == FL_OK && found == 0, "%s: %s", what, fl_error_message());
        ok += st == FL_OK;
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", *list ? " " : "", dn[d]);
    }
    support_line(be.name, "check_finite", ok, n, list);
    list[0] = 0, ok = 0, n = 2;
    for (int d = 1; d < 3; d++) {
        memcpy(hc, d == 1 ? hb : h, sizeof hc);
        fl_status st = be.accumulate16(&be, hc, dt[d], g, 8);
        char what[48];
        snprintf(what, sizeof what, "accumulate16 %s", dn[d]);
        if (fl_test_unsupported(&be, st, what)) continue;
        FL_CHECKF(st == FL_OK, "%s: %s", what, fl_error_message());
        ok += st == FL_OK;
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", *list ? " " : "", dn[d]);
    }
    support_line(be.name, "accumulate16", ok, n, list);
    /* 8-bit AdamW (n below the 8-bit minimum: bnb's fp32-state kernel), p and g in {F32, BF16} */
    size_t sb = fl_adam8bit_state_bytes(4);
    void *mem = calloc(1, sb);
    fl_adam8bit_state st8;
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&st8, 4, mem));
    list[0] = 0, ok = 0, n = 4;
    for (int tp = 0; tp < 2; tp++)
        for (int tg = 0; tg < 2; tg++) {
            float p32[4];
            uint16_t p16[4], g16[4];
            memcpy(p32, f, sizeof p32);
            memcpy(p16, hb, sizeof p16), memcpy(g16, hb, sizeof g16);
            fl_status st = be.adam8bit_update(&be, tp ? (void *)p16 : (void *)p32, dt[tp], tg ? (const void *)g16 : (const void *)g,
                                              dt[tg], &st8, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1.0f);
            char what[64];
            snprintf(what, sizeof what, "adam8bit_update p %s g %s", dn[tp], dn[tg]);
            if (fl_test_unsupported(&be, st, what)) continue;
            FL_CHECKF(st == FL_OK, "%s: %s", what, fl_error_message());
            ok += st == FL_OK;
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s/%s", *list ? " " : "", dn[tp], dn[tg]);
        }
    support_line(be.name, "adam8bit_update", ok, n, list);
    free(mem);
}

FL_TEST(prec_backend_support_report) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) support_on(be);
}

/* supports_op answers what the kernels do: for every (a, b, c) over {F32, BF16, F16, F64} the op
 * returns FL_ERR_UNSUPPORTED exactly when supports_op says 0 (model set-up trusts the answer). */
static void supports_matches_on(fl_backend be) {
    const fl_dtype dt[4] = {FL_F32, FL_BF16, FL_F16, FL_F64};
    double buf[6][8]; /* room for 8 elements of any dtype, per operand */
    size_t mism = 0, yes = 0;
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++)
            for (int c = 0; c < 4; c++) {
                memset(buf, 0, sizeof buf);
                fl_status st[4];
                st[0] = be.gemm(&be, 0, 0, 2, 2, 2, 1.0f, buf[0], dt[a], 2, buf[1], dt[b], 2, 0.0f, buf[2], dt[c], 2);
                st[1] = c == 0 ? be.convert(&be, buf[0], dt[a], buf[1], dt[b], 4) : FL_OK;
                st[2] = be.adamw_update(&be, buf[0], dt[a], buf[1], dt[b], buf[2], buf[3], dt[c], 4, 1e-3f, 0.9f,
                                           0.999f, 1e-8f, 0.0f, 1, 1.0f);
                st[3] = be.sgd_update(&be, buf[0], dt[a], buf[1], dt[b], buf[2], dt[c], 4, 1e-3f, 0.9f, 0.0f, 0.0f,
                                         0, 1, 1.0f);
                const fl_op ops[4] = {FL_OP_GEMM, FL_OP_CONVERT, FL_OP_ADAMW, FL_OP_SGD};
                for (int k = 0; k < 4; k++) {
                    if (k == 1 && c != 0) continue;
                    int says = be.supports_op(&be, ops[k], dt[a], dt[b], k == 1 ? FL_F32 : dt[c]);
                    int does = st[k] != FL_ERR_UNSUPPORTED;
                    yes += says;
                    if (says != does && mism++ < 5)
                        fl_test_fail(__FILE__, __LINE__, "%s: %s(%s, %s, %s): supports_op %d, the op %s", be.name,
                                     fl_op_name(ops[k]), fl_dtype_name(dt[a]), fl_dtype_name(dt[b]), fl_dtype_name(dt[c]),
                                     says, does ? "runs" : "refuses");
                }
            }
    FL_CHECKF(mism == 0, "%s: supports_op disagrees with the kernels %zu times", be.name, mism);
    FL_CHECK(yes > 0);
    printf("      %s: supports_op agrees with gemm, convert, adamw_update_ex, sgd_update_ex (%zu combinations supported)\n",
           be.name, yes);
}

FL_TEST(prec_supports_op_matches_kernels) {
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 1) supports_matches_on(be);
}

/* A backend without bf16 matmuls or bf16 optimizer state: set-up refuses the policies that need
 * them, naming the op and dtypes, before anything runs (fl_model_set_precision, fl_optim_init). */
static int no_bf16_gemm(const fl_backend *be, fl_op op, fl_dtype a, fl_dtype b, fl_dtype c) {
    if (op == FL_OP_GEMM && (a == FL_BF16 || b == FL_BF16)) return 0;
    if ((op == FL_OP_ADAMW || op == FL_OP_SGD) && c == FL_BF16) return 0;
    return fl_cpu_supports_op(be, op, a, b, c);
}

FL_TEST(prec_setup_refuses_unsupported_ops) {
    fl_backend be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&be, 1));
    be.supports_op = no_bf16_gemm;
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    fl_model m;
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    FL_CHECK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_BF16_MIXED)) == FL_ERR_UNSUPPORTED);
    FL_CHECKF(strstr(fl_error_message(), "gemm(F32, BF16, F32)") && strstr(fl_error_message(), "bf16-mixed"), "%s",
              fl_error_message());
    FL_REQUIRE_OK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_16_MIXED))); /* fp16 matmuls are there */
    fl_model_free(&m);
    fl_model_storage st = {.param_dtype = FL_BF16};
    FL_REQUIRE_OK(fl_model_init_ex(&m, &c, &be, &pool, &st));
    FL_CHECK(fl_model_set_precision(&m, fl_precision_get(FL_PREC_BF16_TRUE)) == FL_ERR_UNSUPPORTED);
    fl_model_free(&m);
    /* the optimizer: bf16 state refused at fl_optim_init */
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.state_dtype = FL_BF16;
    fl_optimizer o;
    FL_CHECK(fl_optim_init(&o, &m, &oc) == FL_ERR_UNSUPPORTED);
    FL_CHECKF(strstr(fl_error_message(), "adamw_update") != NULL, "%s", fl_error_message());
    fl_optim_free(&o);
    fl_model_free(&m);
    FL_CHECK(pool.cur_total == 0);
    fl_mem_pool_free(&pool);
}
