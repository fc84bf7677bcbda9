/* TEMPORARY naive GEMM so the CPU ops build and test on their own. The real
 * gemm.c (OpenBLAS / oneDNN) replaces this file at merge; the signatures match
 * src/backend/cpu/cpu-impl.h. */
#include "backend/cpu/cpu-impl.h"

const char *fl_cpu_gemm_library(void) { return "naive"; }

fl_status fl_cpu_gemm_naive(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A_, fl_dtype ta, int lda, const void *B_, fl_dtype tb, int ldb, float beta,
                            void *C_, fl_dtype tc, int ldc) {
    (void)be;
    if (ta != FL_F32 || tb != FL_F32 || tc != FL_F32)
        return fl_errorf(FL_ERR_UNSUPPORTED, "gemm: only F32 x F32 -> F32 is supported (got %s, %s, %s)",
                         fl_dtype_name(ta), fl_dtype_name(tb), fl_dtype_name(tc));
    const float *A = A_, *B = B_;
    float *C = C_;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) {
                float a = trans_a ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                float b = trans_b ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
                acc += a * b;
            }
            float *c = &C[(size_t)i * ldc + j];
            /* beta == 0 must not read C (it may hold garbage/NaN), as BLAS does. */
            *c = beta == 0.0f ? alpha * acc : alpha * acc + beta * *c;
        }
    return FL_OK;
}

fl_status fl_cpu_gemm(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                      const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C,
                      fl_dtype tc, int ldc) {
    return fl_cpu_gemm_naive(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
}
