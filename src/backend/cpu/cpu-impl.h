/* fitllm: CPU backend internals shared between the kernel files. */
#ifndef FITLLM_CPU_IMPL_H
#define FITLLM_CPU_IMPL_H

#include "fitllm/backend.h"

/* GEMM (gemm.c). Same contract as fl_backend.gemm: row-major
 * C(M,N) = alpha * op(A)(M,K) @ op(B)(K,N) + beta * C; beta == 0 means C is not
 * read (BLAS semantics). fl_cpu_gemm uses the library chosen at build time;
 * fl_cpu_gemm_naive is the portable reference (double accumulation). */
fl_status fl_cpu_gemm(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha, const void *A,
                      fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C, fl_dtype tc,
                      int ldc);
fl_status fl_cpu_gemm_naive(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                            void *C, fl_dtype tc, int ldc);
/* "onednn", "openblas" or "naive": the library fl_cpu_gemm calls in this build. */
const char *fl_cpu_gemm_library(void);

#endif
