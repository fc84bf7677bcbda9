/* The cuBLASLt wrapper's contract (src/backend/cuda/cu_gemm.h) on its host stand-in.
 *
 * Column-major calls against a float64 reference written here from cuBLASLt's documented
 * semantics (op(A)[i,p] = A[i + p*lda] or A[p + i*lda], batches at element strides, beta 0 does
 * not read C), every transpose with padded leading dimensions and a strided batch with gaps;
 * then the row-major mapping the backend will use, against the CPU backend's gemm (the tested
 * reference) for every transpose, alpha/beta, padding (untouched) and bf16/f16 operands; and the
 * errors cuBLASLt would give. On a GPU the same calls go to fl_cu_gemm_cublaslt. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cu_gemm.h"
#include "fitllm/backend.h"
#include "fitllm/cuda.h"
#include "test.h"


FL_TEST(cuda_gemm_standin_column_major) {
    const int m = 5, n = 7, k = 9, batch = 3;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int bz = 0; bz < 2; bz++) {
                fl_test_rng r = {(unsigned long long)(100 + ta * 4 + tb * 2 + bz)};
                int64_t ra = ta ? k : m, ca = ta ? m : k, rb = tb ? n : k, cb = tb ? k : n;
                int64_t lda = ra + 2, ldb = rb + 3, ldc = m + 1;
                int64_t sa = lda * ca + 5, sb = ldb * cb + 1, sc = ldc * n + 4; /* gaps between batches */
                float *A = fl_test_frand(&r, (size_t)(sa * batch), -1, 1), *B = fl_test_frand(&r, (size_t)(sb * batch), -1, 1);
                float *C = fl_test_frand(&r, (size_t)(sc * batch), -1, 1);
                const float alpha = 0.7f, beta = bz ? 0.0f : -0.4f;
                if (bz)
                    for (int64_t i = 0; i < sc * batch; i++) C[i] = NAN; /* beta 0: C must not be read */
                float *C0 = malloc((size_t)(sc * batch) * sizeof(float));
                memcpy(C0, C, (size_t)(sc * batch) * sizeof(float));
                fl_cu_gemm_desc d = {ta, tb, m, n, k, alpha, beta, A, FL_F32, lda, sa, B, FL_F32, ldb, sb,
                                     C, FL_F32, ldc, sc, batch, FL_CU_EPI_NONE, NULL, NULL, 0, FL_F32, NULL};
                FL_REQUIRE_OK(fl_cu_gemm_standin(NULL, &d));
                int ok = 1;
                for (int b = 0; b < batch; b++)
                    for (int64_t j = 0; j < n; j++)
                        for (int64_t i = 0; i < ldc; i++) {
                            int64_t ci = b * sc + i + j * ldc;
                            if (i >= m) { /* padding rows of a column: untouched */
                                ok &= isnan(C0[ci]) ? isnan(C[ci]) : C[ci] == C0[ci];
                                continue;
                            }
                            double s = 0;
                            for (int64_t p = 0; p < k; p++)
                                s += (double)A[b * sa + (ta ? p + i * lda : i + p * lda)] *
                                     B[b * sb + (tb ? j + p * ldb : p + j * ldb)];
                            double want = alpha * s + (bz ? 0.0 : (double)beta * C0[ci]);
                            ok &= fabs(C[ci] - want) <= 1e-6 + 1e-5 * fabs(want);
                        }
                /* the gaps between batches: untouched */
                for (int b = 0; b < batch; b++)
                    for (int64_t i = ldc * n; i < sc; i++) {
                        int64_t ci = b * sc + i;
                        ok &= isnan(C0[ci]) ? isnan(C[ci]) : C[ci] == C0[ci];
                    }
                FL_CHECKF(ok, "column-major ta=%d tb=%d beta=%g wrong", ta, tb, beta);
                free(A); free(B); free(C); free(C0);
            }
}

/* The backend gemm through the row-major mapping vs fl_cpu_gemm, F32 and 16-bit operands. */
static void rowmajor_case(fl_backend *be, int ta, int tb, float beta, fl_dtype t16, fl_dtype tc) {
    const int M = 7, N = 13, K = 11;
    fl_test_rng r = {(unsigned long long)(ta * 2 + tb + 1 + 10 * t16 + 100 * tc)};
    int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    int lda = ac + 3, ldb = bc + 2, ldc = N + 5;
    size_t na = (size_t)ar * lda, nb = (size_t)br * ldb, nc = (size_t)M * ldc;
    float *Af = fl_test_frand(&r, na, -1, 1), *Bf = fl_test_frand(&r, nb, -1, 1), *Cf = fl_test_frand(&r, nc, -1, 1);
    size_t es = fl_dtype_size(t16), ec = fl_dtype_size(tc);
    void *A = malloc(na * es), *B = malloc(nb * es), *C1 = malloc(nc * ec), *C2 = malloc(nc * ec);
    FL_REQUIRE_OK(be->convert(be, A, t16, Af, FL_F32, na));
    FL_REQUIRE_OK(be->convert(be, B, t16, Bf, FL_F32, nb));
    FL_REQUIRE_OK(be->convert(be, C1, tc, Cf, FL_F32, nc));
    memcpy(C2, C1, nc * ec);
    float *c0 = malloc(nc * 4);
    FL_REQUIRE_OK(be->convert(be, c0, FL_F32, C2, tc, nc)); /* C as stored: the padding's reference */
    FL_REQUIRE_OK(fl_cu_gemm_rowmajor(fl_cu_gemm_standin, NULL, ta, tb, M, N, K, 0.7f, A, t16, lda, B, t16, ldb, beta,
                                      C1, tc, ldc, 1, 0, 0, 0));
    FL_REQUIRE_OK(be->gemm(be, ta, tb, M, N, K, 0.7f, A, t16, lda, B, t16, ldb, beta, C2, tc, ldc));
    float *c1 = malloc(nc * 4), *c2 = malloc(nc * 4);
    FL_REQUIRE_OK(be->convert(be, c1, FL_F32, C1, tc, nc));
    FL_REQUIRE_OK(be->convert(be, c2, FL_F32, C2, tc, nc));
    /* fp32 result: both accumulate exact products of the stored values (float64 here, fp32 there):
     * test_ops.c's gemm tolerance. A bf16 C is rounded once by each from slightly different fp32
     * values: one bf16 ulp (2^-8 relative) apart at most. */
    double rtol = tc == FL_BF16 ? 1.0 / 128 : 1e-5, atol = tc == FL_BF16 ? 1e-2 : 1e-6;
    int ok = 1;
    for (int i = 0; i < M; i++) {
        ok &= fl_test_allclose("rowmajor", c1 + (size_t)i * ldc, c2 + (size_t)i * ldc, N, rtol, atol);
        for (int j = N; j < ldc; j++) ok &= c1[(size_t)i * ldc + j] == c0[(size_t)i * ldc + j];
    }
    FL_CHECKF(ok, "row-major mapping ta=%d tb=%d beta=%g %s -> %s wrong", ta, tb, beta, fl_dtype_name(t16),
              fl_dtype_name(tc));
    free(Af); free(Bf); free(Cf); free(A); free(B); free(C1); free(C2); free(c1); free(c2); free(c0);
}

FL_TEST(cuda_gemm_rowmajor_vs_cpu) {
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            rowmajor_case(&be, ta, tb, 0.5f, FL_F32, FL_F32);
            rowmajor_case(&be, ta, tb, 0.0f, FL_F32, FL_F32);
            rowmajor_case(&be, ta, tb, 0.5f, FL_BF16, FL_F32);
            rowmajor_case(&be, ta, tb, 0.5f, FL_BF16, FL_BF16);
            rowmajor_case(&be, ta, tb, 1.0f, FL_F16, FL_F32);
        }
}

/* Row-major batched: the attention-style (B*NH) batch of small matmuls at element strides. */
FL_TEST(cuda_gemm_rowmajor_batched) {
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    const int M = 6, N = 5, K = 7, batch = 4, lda = K + 1, ldb = K, ldc = N + 2; /* A (M,K), B^T stored (N,K) */
    const int64_t sa = (int64_t)M * lda + 3, sb = (int64_t)N * ldb, sc = (int64_t)M * ldc + 1;
    fl_test_rng r = {77};
    float *A = fl_test_frand(&r, (size_t)(sa * batch), -1, 1), *B = fl_test_frand(&r, (size_t)(sb * batch), -1, 1);
    float *C1 = fl_test_frand(&r, (size_t)(sc * batch), -1, 1), *C2 = malloc((size_t)(sc * batch) * 4);
    memcpy(C2, C1, (size_t)(sc * batch) * 4);
    FL_REQUIRE_OK(fl_cu_gemm_rowmajor(fl_cu_gemm_standin, NULL, 0, 1, M, N, K, 1.0f, A, FL_F32, lda, B, FL_F32, ldb,
                                      1.0f, C1, FL_F32, ldc, batch, sa, sb, sc));
    for (int b = 0; b < batch; b++)
        FL_REQUIRE_OK(be.gemm(&be, 0, 1, M, N, K, 1.0f, A + b * sa, FL_F32, lda, B + b * sb, FL_F32, ldb, 1.0f,
                              C2 + b * sc, FL_F32, ldc));
    FL_CHECK(fl_test_allclose("batched", C1, C2, (size_t)(sc * batch), 1e-5, 1e-6));
    free(A); free(B); free(C1); free(C2);
}

FL_TEST(cuda_gemm_errors) {
    float x[64] = {0};
    fl_cu_gemm_desc d = {0, 0, 4, 3, 2, 1.0f, 0.0f, x, FL_F32, 4, 0, x, FL_F32, 2, 0, x, FL_F32, 4, 0, 1, FL_CU_EPI_NONE, NULL, NULL, 0, FL_F32,
                         NULL};
    FL_CHECK(fl_cu_gemm_standin(NULL, &d) == FL_OK);
    d.lda = 3; /* < m rows of A (op N) */
    FL_CHECK(fl_cu_gemm_standin(NULL, &d) == FL_ERR_INVALID);
    d.trans_a = 1; /* A stored k x m = 2 x 4: lda >= 2 now enough */
    FL_CHECK(fl_cu_gemm_standin(NULL, &d) == FL_OK);
    d.ldc = 3;
    FL_CHECK(fl_cu_gemm_standin(NULL, &d) == FL_ERR_INVALID);
    d.ldc = 4;
    d.tb = FL_BF16; /* mixed F32 x BF16: not a cuBLASLt type triple */
    FL_CHECK(fl_cu_gemm_standin(NULL, &d) == FL_ERR_UNSUPPORTED);
    d.tb = FL_F32;
    d.batch = 0;
    FL_CHECK(fl_cu_gemm_standin(NULL, &d) == FL_ERR_INVALID);
    if (fl_cuda_device_count(NULL, 0) == 0) { /* no CUDA build, plugin, driver or device: a clear refusal */
        fl_backend be;
        fl_status st = fl_backend_init_by_name("cuda", &be, 1);
        FL_CHECK(st == (fl_cuda_built() ? FL_ERR_UNSUPPORTED : FL_ERR_INVALID) && *fl_error_message());
    }
}

/* fl_cu_gemm_panel_rows (cu_gemm.h): against its contract, by brute force over rows 1..3000 and buffers of 1..1500
 * rows (every 7th): what fits is one panel; otherwise the panel is at most the buffer, a multiple of 128 (a buffer of
 * >= 1024 rows) or 8 (>= 8), so every panel's offset is (16-byte alignment for elements of >= 2 bytes); the count is
 * the fewest such panels can give (the largest such multiple that fits, dividing rows up); the last is not empty.
 * Named cases: TinyLlama's down projection (2,048 rows of 5,632 bf16 columns in a 16 MiB work area: 1,489 fit, the
 * split 1,489 + 559 put the second panel at a 2-byte offset) -> 1,024 + 1,024; nothing fits -> 0. */
FL_TEST(cuda_gemm_panel_rows) {
    FL_CHECK(fl_cu_gemm_panel_rows(2048, (int)((16u << 20) / (5632 * 2))) == 1024);
    FL_CHECK(fl_cu_gemm_panel_rows(2048, 2048) == 2048 && fl_cu_gemm_panel_rows(100, 5000) == 100);
    FL_CHECK(fl_cu_gemm_panel_rows(10, 0) == 0 && fl_cu_gemm_panel_rows(0, 4) == 1);
    FL_CHECK(fl_cu_gemm_panel_rows(200, 174) == 104 && fl_cu_gemm_panel_rows(400, 204) == 200);
    long cases = 0;
    for (int rows = 1; rows <= 3000; rows += 1 + rows / 64)
        for (int max = 1; max <= 1500; max += 7) {
            const int p = fl_cu_gemm_panel_rows(rows, max);
            cases++;
            if (rows <= max) {
                FL_CHECKF(p == rows, "rows %d max %d: %d (want one panel)", rows, max, p);
                continue;
            }
            const int q = max >= 1024 ? 128 : max >= 8 ? 8 : max >= 4 ? 4 : 1, cap = max / q * q;
            const int np = (rows + p - 1) / p, fewest = (rows + cap - 1) / cap;
            if (!(p >= 1 && p <= max && p % q == 0 && np == fewest && rows - (np - 1) * p > 0)) {
                FL_CHECKF(0, "rows %d max %d: panel %d (multiple of %d, %d panels, fewest %d)", rows, max, p, q, np,
                          fewest);
                return;
            }
        }
    FL_CHECK(cases > 10000);
}

/* The cuBLASLt plan cache (cu_gemm.h): every field the descriptors or the heuristic depend on
 * separates two keys, pointers of equal alignment do not; LRU eviction destroys exactly the least
 * recently used plan; free destroys the rest. */
static int g_destroyed[8];
static void count_destroy(void *plan) { g_destroyed[(int)(intptr_t)plan]++; }

FL_TEST(cuda_gemm_plan_cache) {
    _Alignas(256) static float buf[1024];
    fl_cu_gemm_desc d = {.trans_a = 0, .trans_b = 1, .m = 5, .n = 7, .k = 3, .alpha = 1, .beta = 0,
                         .A = buf, .ta = FL_F32, .lda = 5, .stride_a = 15,
                         .B = buf + 64, .tb = FL_F32, .ldb = 7, .stride_b = 21,
                         .C = buf + 128, .tc = FL_F32, .ldc = 5, .stride_c = 35, .batch = 1};
    fl_cu_gemm_key k0, k;
    fl_cu_gemm_key_of(&d, 1024, &k0);
    /* not in the key: pointers of the same alignment, alpha, beta, strides of a single matrix */
    fl_cu_gemm_desc e = d;
    e.A = buf + 256; e.B = buf + 512; e.C = buf + 768; e.alpha = 2; e.beta = 1; e.stride_a = 99;
    fl_cu_gemm_key_of(&e, 1024, &k);
    FL_CHECK(fl_cu_gemm_key_eq(&k0, &k));
    /* in the key: each of these alone makes another plan */
    for (int f = 0; f < 17; f++) {
        e = d;
        size_t ws = 1024;
        switch (f) {
        case 0: e.trans_a = 1; e.lda = 3; break;
        case 1: e.trans_b = 0; e.ldb = 3; break;
        case 2: e.m = 6; e.ldc = 6; e.lda = 6; break;
        case 3: e.n = 8; break;
        case 4: e.k = 4; break;
        case 5: e.ta = FL_BF16; e.tb = FL_BF16; break;
        case 6: e.tc = FL_BF16; e.ta = FL_BF16; e.tb = FL_BF16; break;
        case 7: e.lda = 6; break;
        case 8: e.ldb = 8; break;
        case 9: e.ldc = 6; break;
        case 10: e.batch = 2; break;
        case 11: e.A = buf + 1; break; /* 4-byte aligned sub-view */
        case 12: e.B = buf + 2; break;
        case 13: e.C = buf + 4; break;
        case 14: ws = 0; break;
        case 15: e.batch = 2; e.stride_b = 22; break;
        case 16: e.batch = 2; e.stride_c = 36; break;
        }
        fl_cu_gemm_key kb, kf;
        fl_cu_gemm_key_of(&e, ws, &kf);
        FL_CHECKF(!fl_cu_gemm_key_eq(&k0, &kf), "field %d ignored by the key", f);
        if (f == 15 || f == 16) { /* batched: the strides matter, against the same batch's key */
            fl_cu_gemm_desc b2 = d;
            b2.batch = 2;
            fl_cu_gemm_key_of(&b2, 1024, &kb);
            FL_CHECKF(!fl_cu_gemm_key_eq(&kb, &kf), "batched stride (field %d) ignored by the key", f);
        }
    }
    FL_CHECK(fl_cu_gemm_align_of(buf) == 256 && fl_cu_gemm_align_of(buf + 1) == 4 && fl_cu_gemm_align_of(buf + 2) == 8);

    /* LRU: capacity 3, plans 1..5 */
    memset(g_destroyed, 0, sizeof g_destroyed);
    fl_cu_gemm_cache c;
    FL_CHECK(fl_cu_gemm_cache_init(&c, 0, NULL) == FL_ERR_INVALID);
    FL_REQUIRE_OK(fl_cu_gemm_cache_init(&c, 3, count_destroy));
    fl_cu_gemm_key ks[6];
    for (int i = 1; i <= 5; i++) {
        e = d;
        e.m = 10 + i;
        e.ldc = e.lda = e.m;
        fl_cu_gemm_key_of(&e, 0, &ks[i]);
    }
    for (int i = 1; i <= 3; i++) {
        FL_CHECK(fl_cu_gemm_cache_get(&c, &ks[i]) == NULL);
        fl_cu_gemm_cache_put(&c, &ks[i], (void *)(intptr_t)i);
    }
    FL_CHECK(fl_cu_gemm_cache_get(&c, &ks[1]) == (void *)(intptr_t)1); /* 1 used: 2 is now the oldest */
    fl_cu_gemm_cache_put(&c, &ks[4], (void *)(intptr_t)4);
    FL_CHECK(g_destroyed[2] == 1 && g_destroyed[1] == 0 && g_destroyed[3] == 0);
    FL_CHECK(fl_cu_gemm_cache_get(&c, &ks[2]) == NULL);
    FL_CHECK(fl_cu_gemm_cache_get(&c, &ks[3]) == (void *)(intptr_t)3 && fl_cu_gemm_cache_get(&c, &ks[4]) == (void *)(intptr_t)4);
    fl_cu_gemm_cache_put(&c, &ks[5], (void *)(intptr_t)5); /* 1 is the oldest now */
    FL_CHECK(g_destroyed[1] == 1 && c.n == 3 && c.evictions == 2);
    FL_CHECK(c.hits == 3 && c.misses == 4);
    fl_cu_gemm_cache_free(&c);
    FL_CHECK(g_destroyed[1] == 1 && g_destroyed[2] == 1 && g_destroyed[3] == 1 && g_destroyed[4] == 1 &&
             g_destroyed[5] == 1);
}
