/* fitllm CUDA backend: GEMMs through cuBLASLt, behind one thin wrapper.
 *
 * fl_cu_gemm_desc is one cublasLtMatmul in cuBLASLt's own terms: COLUMN-MAJOR matrices,
 *   D (m x n) = alpha * op(A) (m x k) @ op(B) (k x n) + beta * C,   D == C (in place),
 * A stored as rows x cols = (trans_a ? k x m : m x k) with leading dimension lda >= rows (column
 * j starts at A + j*lda), B likewise ((trans_b ? n x k : k x n), ldb), C m x n with ldc >= m;
 * `batch` matrices, the i-th at A + i*stride_a elements (B, C likewise; strided batch); beta == 0
 * means C is not read (cuBLAS: C need not hold valid numbers); a 16-bit C read (beta != 0, no epilogue; the
 * backend's FL_OP_GEMM_ACC16) gives D = round(fp32(alpha op(A) op(B)) + beta C), the sum and beta C added in fp32 and
 * rounded to C's type once (cuBLASLt's fp32 scale type; the stand-in likewise). Compute type fp32
 * (CUBLAS_COMPUTE_32F: no TF32 for fp32 operands; bf16/fp16 tensor cores accumulate in fp32).
 * Types (ta, tb, tc): (F32, F32, F32), (BF16, BF16, F32), (BF16, BF16, BF16), (F16, F16, F32),
 * (F16, F16, F16).
 *
 * Two implementations of that contract: fl_cu_gemm_cublaslt (the CUDA plugin; device pointers) and
 * fl_cu_gemm_standin (always built: host loops implementing the documented semantics, float64
 * accumulation), which is what the tests run on machines without a GPU. fl_cu_gemm_rowmajor maps
 * the backend's row-major gemm (fitllm/backend.h) onto either: a row-major X is the column-major
 * X^T, so C = op(A) op(B) is computed as C^T = op(B)^T op(A)^T with A and B swapped. */
#ifndef FL_CU_GEMM_H
#define FL_CU_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/dtype.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int trans_a, trans_b; /* 0: CUBLAS_OP_N, 1: CUBLAS_OP_T */
    int m, n, k;
    float alpha, beta;
    const void *A;
    fl_dtype ta;
    int64_t lda, stride_a;
    const void *B;
    fl_dtype tb;
    int64_t ldb, stride_b;
    void *C;
    fl_dtype tc;
    int64_t ldc, stride_c;
    int batch; /* >= 1 */
    /* Epilogue (issue 30 item 3), fused into the matmul by cuBLASLt; batch 1 and tc F32 only. The sum
     * s = alpha op(A) op(B) + beta C is rounded to fp32 first, then FL_CU_EPI_BIAS: D[i, j] = s + bias[i] (one
     * fp32 add: a GEMM then the bias kernel, the same bits on the stand-in); FL_CU_EPI_GELU_AUX_BIAS (beta 0):
     * aux[i, j] = s + bias[i] (m x n, leading dimension ldaux >= m, fp32: the pre-activation the backward reads)
     * and D[i, j] = gelu_tanh(aux[i, j]) (the stand-in: the GELU kernels' formula, x sigmoid(2u)). bias has m
     * elements (the row-major output's columns) of type bias_t, D's type (fl_cu_gemm_lt_bias_ok: another is refused):
     * F32 (0, the default) or BF16 with a BF16 D (each element widened exactly, then the same fp32 add). FL_CU_EPI_BIAS also takes a BF16 C with beta 0 (tc BF16: D = RNE of the fp32 s + bias, one
     * rounding, as PyTorch's bf16 addmm). FL_CU_EPI_NONE (0): none. */
    int epilogue;
    const void *bias;
    float *aux;
    int64_t ldaux;
    fl_dtype bias_t; /* the bias's type (above) */
    /* The output (issue 30 items 1 and 3, the backend's gemm_res16): NULL (or C) in place, D == C; else a separate
     * matrix of C's type, layout and strides (ldc, stride_c) not overlapping C, which is then only read: D = round(
     * fp32(alpha op(A) op(B)) + beta C) as the 16-bit C read above (cuBLASLt's separate C and D pointers; no
     * epilogue). A bf16 run's residual add in its output projection: C the stored residual, D the sum's rows. */
    void *D;
} fl_cu_gemm_desc;
enum { FL_CU_EPI_NONE = 0, FL_CU_EPI_BIAS = 1, FL_CU_EPI_GELU_AUX_BIAS = 2 };

typedef fl_status (*fl_cu_gemm_fn)(void *ctx, const fl_cu_gemm_desc *d);

/* The checks cuBLASLt applies, with messages: m, n, k >= 0, batch >= 1, leading dimensions at least
 * the stored row counts (and >= 1), a supported type triple, non-NULL pointers when there is work. */
fl_status fl_cu_gemm_check(const fl_cu_gemm_desc *d);
/* cuBLASLt's rule for the epilogue's bias type (checked on cuBLASLt 13.0, sm_90, A/B BF16, compute 32F: a BF16 bias
 * with an F32 D and an F32 bias with a BF16 D are refused, CUBLAS_STATUS_INVALID_VALUE; matching types run). Its
 * documentation: CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE defaults to D's type, and its table of supported type
 * combinations gives a non-FP8 matmul only the bias type of D (other bias types are for the FP8 matmuls). FL_OK
 * without an epilogue or with bias_t == tc, else FL_ERR_UNSUPPORTED (the real wrapper's status for a cuBLASLt
 * refusal) naming both types. The stand-in applies it (it refuses what cuBLASLt refuses); the real wrapper leaves it
 * to cuBLASLt; the backend never asks for another combination (cuda-gemm-more-impl.h). */
fl_status fl_cu_gemm_lt_bias_ok(const fl_cu_gemm_desc *d);
/* Host stand-in (ctx unused): the contract above on host memory. */
fl_status fl_cu_gemm_standin(void *ctx, const fl_cu_gemm_desc *d);
/* The stand-in's calls with an epilogue so far, and those with the GELU one (tests: that a run took the fused path). */
extern unsigned long fl_cu_gemm_standin_epilogues, fl_cu_gemm_standin_gelus;

/* The backend's gemm (row-major, fitllm/backend.h: C(M,N) = alpha op(A) op(B) + beta C with row
 * strides lda, ldb, ldc) as one column-major call through fn; batch >= 1 matrices with element
 * strides stride_a, stride_b, stride_c (ignored when batch == 1). */
fl_status fl_cu_gemm_rowmajor(fl_cu_gemm_fn fn, void *ctx, int trans_a, int trans_b, int M, int N, int K, float alpha,
                              const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                              void *C, fl_dtype tc, int ldc, int batch, int64_t stride_a, int64_t stride_b,
                              int64_t stride_c);
/* The descriptor fl_cu_gemm_rowmajor passes (one matrix, no epilogue). */
void fl_cu_gemm_desc_rowmajor(fl_cu_gemm_desc *d, int trans_a, int trans_b, int M, int N, int K, float alpha,
                              const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                              void *C, fl_dtype tc, int ldc);
/* The same with an epilogue (one matrix): bias (N, of type bias_t) per column of the row-major C, aux (M, N) with row stride ldaux
 * for FL_CU_EPI_GELU_AUX_BIAS (column-major: bias per row of C^T, aux^T with leading dimension ldaux). */
fl_status fl_cu_gemm_rowmajor_epi(fl_cu_gemm_fn fn, void *ctx, int epilogue, const void *bias, fl_dtype bias_t,
                                  float *aux, int ldaux,
                                  int trans_a, int trans_b, int M, int N, int K, float alpha, const void *A,
                                  fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C,
                                  fl_dtype tc, int ldc);

/* Plan cache. A cublasLtMatmul needs an operation descriptor, three matrix layouts and an
 * algorithm from the heuristics (tens of microseconds of host time together, every call); a
 * training step issues the same few dozen GEMM shapes hundreds of times, so the real wrapper keeps
 * them per shape. The key is everything the descriptors and the heuristic query depend on: the
 * operations, m n k, the types, the leading dimensions, the batch and its strides (batch > 1), the epilogue
 * (its kind, aux's leading dimension and the bias / aux alignments; the pointers are set per call), whether D is a
 * matrix apart from C (and its alignment), and
 * the operands' alignments and the workspace size (the heuristic is told them: a sub-view of lesser alignment must not
 * reuse an algorithm chosen for 256-byte aligned operands). Pointers, alpha and beta are not in it:
 * they are passed to each matmul. At most `cap` plans, the least recently used one destroyed
 * (the destroy callback) when a new shape comes; the cache is host memory the library owns, like
 * cuBLASLt's own descriptors. The logic is host code, built and tested everywhere. */
typedef struct {
    int32_t v[18]; /* ..., the epilogue, the alignments of its bias and aux, the bias type, whether D is apart from C
                    * and D's alignment */
    int64_t ld[4], stride[3]; /* ld[3]: the epilogue's aux */
    uint64_t workspace_bytes;
} fl_cu_gemm_key;
/* workspace_bytes: the most workspace the heuristic may pick an algorithm for (a plan chosen with a
 * workspace must not run without it) */
void fl_cu_gemm_key_of(const fl_cu_gemm_desc *d, size_t workspace_bytes, fl_cu_gemm_key *k);
int fl_cu_gemm_key_eq(const fl_cu_gemm_key *a, const fl_cu_gemm_key *b);
/* Largest power of two (<= 256) dividing the address. */
uint32_t fl_cu_gemm_align_of(const void *p);
/* Panels of a matrix of `rows` rows (or columns) of which at most `max_rows` fit a buffer: the rows of every panel but
 * the last. The fewest panels, balanced, each a multiple of 128 rows (of 8 where max_rows < 1024, of 4 where < 8: a
 * buffer that small exists only in the emulator), so that a panel's offset into its matrix keeps the operands of its
 * GEMM 16-byte aligned (multiples of 8 for elements of >= 2 bytes, of 4 for fp32 ones): cuBLASLt's fast kernels want
 * 16 bytes; a panel of 1,489 rows put the next panel's operands at 2- or 4-byte alignment, where cuBLASLt can only
 * take its slow kernels. `rows` itself when it fits; 0 when max_rows < 1 (nothing fits). */
int fl_cu_gemm_panel_rows(int rows, int max_rows);

typedef struct {
    fl_cu_gemm_key key;
    uint64_t hash, used; /* used: the tick of the last hit (LRU) */
    void *plan;
} fl_cu_gemm_cache_entry;
typedef struct {
    fl_cu_gemm_cache_entry *e;
    int cap, n;
    uint64_t tick;
    size_t hits, misses, evictions;
    void (*destroy)(void *plan);
} fl_cu_gemm_cache;
#define FL_CU_GEMM_CACHE_CAP 256
fl_status fl_cu_gemm_cache_init(fl_cu_gemm_cache *c, int cap, void (*destroy)(void *plan));
/* The plan stored for k (a hit: counted, marked most recently used), or NULL (a miss: counted). */
void *fl_cu_gemm_cache_get(fl_cu_gemm_cache *c, const fl_cu_gemm_key *k);
/* Store a plan for k (not present): when full, the least recently used plan is destroyed first. */
void fl_cu_gemm_cache_put(fl_cu_gemm_cache *c, const fl_cu_gemm_key *k, void *plan);
/* Destroy every plan and the table. */
void fl_cu_gemm_cache_free(fl_cu_gemm_cache *c);

/* The real thing: defined in the CUDA plugin only (plugin/cu_gemm_lt.c; the GPU check programs link it).
 * ctx of fl_cu_gemm_cublaslt is an fl_cu_blas: a cuBLASLt handle, a device workspace lent by
 * the caller (from the accounting pool; 32 MiB lets the heuristics pick split-K algorithms on
 * H100) and the stream the matmuls are queued on. */
typedef struct {
    void *lt;               /* cublasLtHandle_t */
    void *workspace;        /* device memory, may be NULL with workspace_bytes 0 */
    size_t workspace_bytes;
    void *stream;           /* cudaStream_t, NULL: default stream */
    fl_cu_gemm_cache plans; /* descriptors, layouts and algorithm per GEMM shape */
} fl_cu_blas;
fl_status fl_cu_blas_init(fl_cu_blas *b, void *workspace, size_t workspace_bytes, void *stream);
void fl_cu_blas_free(fl_cu_blas *b);
fl_status fl_cu_gemm_cublaslt(void *ctx, const fl_cu_gemm_desc *d);

/* cuBLASLt's own rate for a shape (bench-step --profile; issue 30 item 3 asks each GEMM of a step to reach 80% of
 * it): up to FL_CU_GEMM_BENCH_ALGOS of the heuristic's algorithms for d's descriptors and the workspace, each
 * timed over reps matmuls after one warm-up (CUDA events on the stream; d's operands are overwritten in C). *best_ms
 * the fastest, *first_ms the heuristic's first (the plan cache's choice), *n_algos how many were timed. The
 * stand-in's version times its one loop by the host clock (best = first). ms per matmul. */
#define FL_CU_GEMM_BENCH_ALGOS 8
typedef fl_status (*fl_cu_gemm_bench_fn)(void *ctx, const fl_cu_gemm_desc *d, int reps, double *best_ms,
                                         double *first_ms, int *n_algos);
fl_status fl_cu_gemm_cublaslt_bench(void *ctx, const fl_cu_gemm_desc *d, int reps, double *best_ms, double *first_ms,
                                    int *n_algos);
fl_status fl_cu_gemm_standin_bench(void *ctx, const fl_cu_gemm_desc *d, int reps, double *best_ms, double *first_ms,
                                   int *n_algos);

#ifdef __cplusplus
}
#endif
#endif
