/* fitllm CPU backend: GEMM.
 *
 * C(M,N) = alpha * op(A)(M,K) @ op(B)(K,N) + beta * C, row-major, lda/ldb/ldc
 * the row strides of the stored matrices (A is stored (M,K), or (K,M) when
 * transposed; B is (K,N), or (N,K) when transposed).
 *
 * The library is chosen at build time (CMake FL_GEMM; measurements and the
 * reason for the default are in docs/BENCHMARKS.md):
 *   FL_HAVE_ONEDNN   -> dnnl_sgemm (row-major, 'N'/'T'), threads from OpenMP;
 *   FL_HAVE_OPENBLAS -> cblas_sgemm(CblasRowMajor, ...), its own pthread pool;
 *   neither          -> fl_cpu_gemm_naive.
 *
 * Semantics we guarantee on every path (BLAS semantics, checked by
 * tests/test_gemm.c):
 *   - M == 0 or N == 0: nothing is touched;
 *   - K == 0 or alpha == 0: C = beta * C, A and B are not read;
 *   - beta == 0: C is not read (NaN/Inf garbage in C is overwritten).
 *
 * Threads. fl_cpu_gemm runs on be->n_threads threads (<= 0: the OpenMP
 * default). It must be called from serial code, not from inside one of our
 * OpenMP parallel regions.
 *   - oneDNN (built with DNNL_CPU_RUNTIME_OMP) runs on the same libgomp pool as
 *     our own kernels, sized by omp_set_num_threads on the calling thread; one
 *     pool, so no oversubscription.
 *   - OpenBLAS (pthread build) has its own pool. We call
 *     openblas_set_num_threads only when the count changes. Its workers
 *     busy-wait after every call (up to OPENBLAS_THREAD_TIMEOUT, default 2^28
 *     yield loops) while libgomp's workers busy-wait after every parallel region
 *     (GOMP_SPINCOUNT): on 2 vCPUs the two pools steal each other's cores when
 *     a GEMM follows an OpenMP kernel and vice versa. See docs/BENCHMARKS.md for
 *     the measured effect and the mitigation.
 */
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#if defined(FL_HAVE_ONEDNN)
#include <dnnl.h>
#elif defined(FL_HAVE_OPENBLAS)
#include <cblas.h>
/* OpenBLAS extension, declared by OpenBLAS's cblas.h but not by netlib's. */
void openblas_set_num_threads(int num_threads);
#endif

const char *fl_cpu_gemm_library(void) {
#if defined(FL_HAVE_ONEDNN)
    return "onednn";
#elif defined(FL_HAVE_OPENBLAS)
    return "openblas";
#else
    return "naive";
#endif
}

static int gemm_threads(const fl_backend *be) {
    int nt = be ? be->n_threads : 0;
    if (nt <= 0) nt = omp_get_max_threads();
    return nt > 0 ? nt : 1;
}

/* Argument checks shared by both entry points. */
static fl_status gemm_check(const char *who, int trans_a, int trans_b, int M, int N, int K, const void *A,
                            fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, const void *C, fl_dtype tc,
                            int ldc) {
    if (ta != FL_F32 || tb != FL_F32 || tc != FL_F32)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: dtypes A=%s B=%s C=%s not supported (F32 only)", who,
                         fl_dtype_name(ta), fl_dtype_name(tb), fl_dtype_name(tc));
    if (M < 0 || N < 0 || K < 0) return fl_errorf(FL_ERR_INVALID, "%s: negative size M=%d N=%d K=%d", who, M, N, K);
    if (M == 0 || N == 0) return FL_OK;
    if (!C || ldc < N) return fl_errorf(FL_ERR_INVALID, "%s: C=%p ldc=%d (N=%d)", who, C, ldc, N);
    if (K == 0) return FL_OK;
    int a_cols = trans_a ? M : K, b_cols = trans_b ? K : N;
    if (!A || lda < a_cols)
        return fl_errorf(FL_ERR_INVALID, "%s: A=%p lda=%d < %d (trans_a=%d)", who, A, lda, a_cols, trans_a);
    if (!B || ldb < b_cols)
        return fl_errorf(FL_ERR_INVALID, "%s: B=%p ldb=%d < %d (trans_b=%d)", who, B, ldb, b_cols, trans_b);
    return FL_OK;
}

/* C = beta * C (beta == 0: C = 0 without reading it). */
static void scale_c(float *C, int M, int N, int ldc, float beta, int nt) {
    if (beta == 1.0f) return;
#pragma omp parallel for num_threads(nt) schedule(static) if ((int64_t)M * N > 65536)
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc;
        if (beta == 0.0f)
            memset(c, 0, (size_t)N * sizeof(float));
        else
            for (int j = 0; j < N; j++) c[j] *= beta;
    }
}

fl_status fl_cpu_gemm_naive(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A_, fl_dtype ta, int lda, const void *B_, fl_dtype tb, int ldb, float beta,
                            void *C_, fl_dtype tc, int ldc) {
    FL_TRY(gemm_check("gemm_naive", trans_a, trans_b, M, N, K, A_, ta, lda, B_, tb, ldb, C_, tc, ldc));
    if (M == 0 || N == 0) return FL_OK;
    const float *A = A_, *B = B_;
    float *C = C_;
    int nt = gemm_threads(be);
    if (K == 0 || alpha == 0.0f) {
        scale_c(C, M, N, ldc, beta, nt);
        return FL_OK;
    }
    enum { TJ = 256 };
    /* Each C element is produced by one thread in a fixed k order: the result
     * does not depend on the thread count. */
#pragma omp parallel for num_threads(nt) schedule(static) if ((int64_t)M * N * K > 32768)
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc;
        for (int j0 = 0; j0 < N; j0 += TJ) {
            int nj = N - j0 < TJ ? N - j0 : TJ;
            double acc[TJ];
            if (trans_b) {
                /* B stored (N,K): row j of B is contiguous in k */
                for (int j = 0; j < nj; j++) {
                    const float *b = B + (size_t)(j0 + j) * ldb;
                    double s = 0;
                    for (int k = 0; k < K; k++) {
                        double a = trans_a ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                        s += a * b[k];
                    }
                    acc[j] = s;
                }
            } else {
                /* B stored (K,N): row k of B is contiguous in j */
                for (int j = 0; j < nj; j++) acc[j] = 0;
                for (int k = 0; k < K; k++) {
                    double a = trans_a ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                    const float *b = B + (size_t)k * ldb + j0;
                    for (int j = 0; j < nj; j++) acc[j] += a * b[j];
                }
            }
            for (int j = 0; j < nj; j++) {
                double v = (double)alpha * acc[j];
                if (beta != 0.0f) v += (double)beta * c[j0 + j];
                c[j0 + j] = (float)v;
            }
        }
    }
    return FL_OK;
}

#if defined(FL_HAVE_OPENBLAS)
/* Thread count last given to OpenBLAS (0: never set). Set from the (serial)
 * caller; the atomic keeps concurrent backends from tearing it. */
static _Atomic int g_blas_threads;
#endif

fl_status fl_cpu_gemm(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                      const void *A_, fl_dtype ta, int lda, const void *B_, fl_dtype tb, int ldb, float beta, void *C_,
                      fl_dtype tc, int ldc) {
#if defined(FL_HAVE_ONEDNN) || defined(FL_HAVE_OPENBLAS)
    FL_TRY(gemm_check("gemm", trans_a, trans_b, M, N, K, A_, ta, lda, B_, tb, ldb, C_, tc, ldc));
    if (M == 0 || N == 0) return FL_OK;
    const float *A = A_, *B = B_;
    float *C = C_;
    int nt = gemm_threads(be);
    if (K == 0 || alpha == 0.0f) {
        /* BLAS would do this too, but oneDNN rejects lda=0 etc. for K == 0, and
         * this way every library behaves the same. */
        scale_c(C, M, N, ldc, beta, nt);
        return FL_OK;
    }
#if defined(FL_HAVE_ONEDNN)
    if (omp_get_max_threads() != nt) omp_set_num_threads(nt);
    dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C,
                                  ldc);
    if (st != dnnl_success)
        return fl_errorf(FL_ERR_INTERNAL, "gemm: dnnl_sgemm(%c%c, M=%d N=%d K=%d, lda=%d ldb=%d ldc=%d) failed: %d",
                         trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, lda, ldb, ldc, (int)st);
#else
    if (g_blas_threads != nt) {
        openblas_set_num_threads(nt);
        g_blas_threads = nt;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                alpha, A, lda, B, ldb, beta, C, ldc);
#endif
    return FL_OK;
#else
    return fl_cpu_gemm_naive(be, trans_a, trans_b, M, N, K, alpha, A_, ta, lda, B_, tb, ldb, beta, C_, tc, ldc);
#endif
}
