/* fitllm CUDA backend, in the CUDA plugin: the cuBLASLt wrapper (contract: cu_gemm.h); its
 * stand-in, checks and plan cache are in libfitllm (cu_gemm.c). */
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "backend/cuda/cu_gemm.h"
#include "backend/cuda/plugin/cudart.h"

static cudaDataType_t cu_type(fl_dtype t) {
    return t == FL_F32 ? CUDA_R_32F : t == FL_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}


/* One GEMM shape's cuBLASLt objects (the plan cache's value). */
typedef struct {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
} lt_plan;

static void lt_plan_destroy(void *p) {
    lt_plan *q = p;
    if (!q) return;
    if (q->lc) cublasLtMatrixLayoutDestroy(q->lc);
    if (q->lb) cublasLtMatrixLayoutDestroy(q->lb);
    if (q->la) cublasLtMatrixLayoutDestroy(q->la);
    if (q->op) cublasLtMatmulDescDestroy(q->op);
    free(q);
}

fl_status fl_cu_blas_init(fl_cu_blas *b, void *workspace, size_t workspace_bytes, void *stream) {
    memset(b, 0, sizeof *b);
    char why[256];
    if (fl_cudart_device_count(why, sizeof why) == 0) /* cublasLtCreate would fail (and leak) */
        return fl_errorf(FL_ERR_UNSUPPORTED, "cuBLASLt: no CUDA device visible (%s)", why);
    FL_TRY(fl_cu_gemm_cache_init(&b->plans, FL_CU_GEMM_CACHE_CAP, lt_plan_destroy));
    cublasLtHandle_t h;
    cublasStatus_t st = cublasLtCreate(&h);
    if (st != CUBLAS_STATUS_SUCCESS) {
        fl_cu_gemm_cache_free(&b->plans);
        return fl_errorf(FL_ERR_UNSUPPORTED, "cuBLASLt: cublasLtCreate failed (%s)", cublasLtGetStatusString(st));
    }
    b->lt = h;
    b->workspace = workspace;
    b->workspace_bytes = workspace_bytes;
    b->stream = stream;
    return FL_OK;
}

void fl_cu_blas_free(fl_cu_blas *b) {
    fl_cu_gemm_cache_free(&b->plans); /* the descriptors before the handle */
    if (b->lt) cublasLtDestroy((cublasLtHandle_t)b->lt);
    memset(b, 0, sizeof *b);
}

static cublasStatus_t layout(cublasLtMatrixLayout_t *l, fl_dtype t, int64_t rows, int64_t cols, int64_t ld, int batch,
                             int64_t stride) {
    cublasStatus_t st = cublasLtMatrixLayoutCreate(l, cu_type(t), (uint64_t)rows, (uint64_t)cols, ld);
    if (st != CUBLAS_STATUS_SUCCESS || batch == 1) return st;
    int32_t bc = batch;
    st = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride);
    return st;
}

/* The epilogue's attributes (issue 30 item 3): its kind, aux's leading dimension and the bias type once per plan
 * (all: 1), the bias and aux pointers every call (all: 0; the plan's descriptor is reused across calls). An fp32
 * bias with an F32 D (and a BF16 one with a BF16 D) takes the default type, D's; another (a BF16 bias with an F32 D,
 * an F32 bias with a BF16 D) is declared with CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE and cuBLASLt refuses it
 * (CUBLAS_STATUS_INVALID_VALUE on 13.0 / sm_90: fl_cu_gemm_lt_bias_ok, cu_gemm.h): the backend never asks for one,
 * fitllm_cuda_check does, to see the refusal the stand-in copies. */
static cublasStatus_t lt_epilogue(cublasLtMatmulDesc_t op, const fl_cu_gemm_desc *d, int all) {
    const int gelu = d->epilogue == FL_CU_EPI_GELU_AUX_BIAS;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (all) {
        cublasLtEpilogue_t e = gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS;
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e);
        int64_t ld = d->ldaux;
        if (st == CUBLAS_STATUS_SUCCESS && gelu)
            st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld);
        if (st == CUBLAS_STATUS_SUCCESS && d->bias_t != d->tc) { /* a type other than D's (the default) */
            cudaDataType_t bt = cu_type(d->bias_t);
            st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt);
        }
    }
    const void *bias = d->bias;
    void *aux = d->aux;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
    if (st == CUBLAS_STATUS_SUCCESS && gelu)
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
    return st;
}

/* The descriptors and the heuristic's algorithm for d's shape (a cache miss): the first of up to n_req results
 * (heur[0 .. *found), the heuristic's order) is the plan's. */
static cublasStatus_t lt_plan_create(fl_cu_blas *b, const fl_cu_gemm_desc *d, lt_plan **out,
                                     cublasLtMatmulHeuristicResult_t *heur, int n_req, int *found) {
    *out = NULL;
    lt_plan *q = calloc(1, sizeof *q);
    if (!q) return CUBLAS_STATUS_ALLOC_FAILED;
    cublasLtMatmulPreference_t pref = NULL;
    cublasStatus_t st = cublasLtMatmulDescCreate(&q->op, CUBLAS_COMPUTE_32F, CUDA_R_32F); /* fp32: no TF32 */
    cublasOperation_t opa = d->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, opb = d->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulDescSetAttribute(q->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulDescSetAttribute(q->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
    if (st == CUBLAS_STATUS_SUCCESS && d->epilogue != FL_CU_EPI_NONE) st = lt_epilogue(q->op, d, 1);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = layout(&q->la, d->ta, d->trans_a ? d->k : d->m, d->trans_a ? d->m : d->k, d->lda, d->batch, d->stride_a);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = layout(&q->lb, d->tb, d->trans_b ? d->n : d->k, d->trans_b ? d->k : d->n, d->ldb, d->batch, d->stride_b);
    if (st == CUBLAS_STATUS_SUCCESS) st = layout(&q->lc, d->tc, d->m, d->n, d->ldc, d->batch, d->stride_c);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceCreate(&pref);
    /* the heuristics assume 256-byte aligned operands unless told otherwise, and our operands are
     * often sub-views (a head, a row offset) */
    uint64_t ws = b->workspace_bytes;
    uint32_t al_a = fl_cu_gemm_align_of(d->A), al_b = fl_cu_gemm_align_of(d->B), al_c = fl_cu_gemm_align_of(d->C);
    uint32_t al_d = d->D ? fl_cu_gemm_align_of(d->D) : al_c; /* a D apart from C (gemm_res16): C's layout */
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d);
    *found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic(b->lt, q->op, q->la, q->lb, q->lc, q->lc, pref, n_req, heur, found);
    if (st == CUBLAS_STATUS_SUCCESS && *found == 0) st = CUBLAS_STATUS_NOT_SUPPORTED;
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS) {
        lt_plan_destroy(q);
        return st;
    }
    q->algo = heur[0].algo;
    *out = q;
    return CUBLAS_STATUS_SUCCESS;
}

fl_status fl_cu_gemm_cublaslt(void *ctx, const fl_cu_gemm_desc *d) {
    fl_cu_blas *b = ctx;
    fl_status s = fl_cu_gemm_check(d);
    if (s != FL_OK) return s;
    if (d->m == 0 || d->n == 0) return FL_OK;
    fl_cu_gemm_key key;
    fl_cu_gemm_key_of(d, b->workspace_bytes, &key);
    lt_plan *q = fl_cu_gemm_cache_get(&b->plans, &key);
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (!q) {
        cublasLtMatmulHeuristicResult_t heur;
        int found;
        st = lt_plan_create(b, d, &q, &heur, 1, &found);
        if (st == CUBLAS_STATUS_SUCCESS) fl_cu_gemm_cache_put(&b->plans, &key, q);
    }
    if (st == CUBLAS_STATUS_SUCCESS && d->epilogue != FL_CU_EPI_NONE) st = lt_epilogue(q->op, d, 0);
    void *out = d->D ? d->D : d->C; /* D: C's layout (q->lc), the sum written apart from C (gemm_res16) */
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmul(b->lt, q->op, &d->alpha, d->A, q->la, d->B, q->lb, &d->beta, d->C, q->lc, out, q->lc,
                            &q->algo, b->workspace, b->workspace_bytes, (cudaStream_t)b->stream);
    if (st != CUBLAS_STATUS_SUCCESS)
        return fl_errorf(FL_ERR_UNSUPPORTED, "cuBLASLt matmul m=%d n=%d k=%d (%s,%s,%s) batch %d%s: %s", d->m, d->n,
                         d->k, fl_dtype_name(d->ta), fl_dtype_name(d->tb), fl_dtype_name(d->tc), d->batch,
                         d->epilogue == FL_CU_EPI_BIAS ? " bias epilogue"
                         : d->epilogue == FL_CU_EPI_GELU_AUX_BIAS ? " bias+GELU epilogue" : "",
                         cublasLtGetStatusString(st));
    return FL_OK;
}

/* cuBLASLt's own rate for d's shape (cu_gemm.h; bench-step --profile, issue 30 item 3). */
fl_status fl_cu_gemm_cublaslt_bench(void *ctx, const fl_cu_gemm_desc *d, int reps, double *best_ms, double *first_ms,
                                    int *n_algos) {
    fl_cu_blas *b = ctx;
    *best_ms = *first_ms = -1;
    *n_algos = 0;
    FL_TRY(fl_cu_gemm_check(d));
    if (d->m == 0 || d->n == 0 || reps < 1) return FL_OK;
    cublasLtMatmulHeuristicResult_t heur[FL_CU_GEMM_BENCH_ALGOS];
    int found = 0;
    lt_plan *q = NULL;
    cublasStatus_t st = lt_plan_create(b, d, &q, heur, FL_CU_GEMM_BENCH_ALGOS, &found);
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaError_t ce = cudaSuccess;
    if (st == CUBLAS_STATUS_SUCCESS) ce = cudaEventCreate(&e0);
    if (st == CUBLAS_STATUS_SUCCESS && ce == cudaSuccess) ce = cudaEventCreate(&e1);
    cudaStream_t s = (cudaStream_t)b->stream;
    for (int a = 0; st == CUBLAS_STATUS_SUCCESS && ce == cudaSuccess && a < found; a++) {
        if (heur[a].workspaceSize > b->workspace_bytes) continue;
        if (d->epilogue != FL_CU_EPI_NONE) st = lt_epilogue(q->op, d, 0);
        for (int r = -1; st == CUBLAS_STATUS_SUCCESS && r < reps; r++) { /* r = -1: the warm-up */
            if (r == 0) ce = cudaEventRecord(e0, s);
            st = cublasLtMatmul(b->lt, q->op, &d->alpha, d->A, q->la, d->B, q->lb, &d->beta, d->C, q->lc,
                                d->D ? d->D : d->C, q->lc, &heur[a].algo, b->workspace, b->workspace_bytes, s);
        }
        float ms = 0;
        if (st == CUBLAS_STATUS_SUCCESS && ce == cudaSuccess) ce = cudaEventRecord(e1, s);
        if (st == CUBLAS_STATUS_SUCCESS && ce == cudaSuccess) ce = cudaEventSynchronize(e1);
        if (st == CUBLAS_STATUS_SUCCESS && ce == cudaSuccess) ce = cudaEventElapsedTime(&ms, e0, e1);
        if (st != CUBLAS_STATUS_SUCCESS || ce != cudaSuccess) break;
        const double per = (double)ms / reps;
        if (a == 0) *first_ms = per;
        if (*best_ms < 0 || per < *best_ms) *best_ms = per;
        (*n_algos)++;
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    lt_plan_destroy(q);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        return fl_errorf(FL_ERR_IO, "cuBLASLt bench m=%d n=%d k=%d: %s", d->m, d->n, d->k, cudaGetErrorString(ce));
    }
    if (st != CUBLAS_STATUS_SUCCESS)
        return fl_errorf(FL_ERR_UNSUPPORTED, "cuBLASLt bench m=%d n=%d k=%d (%s,%s,%s): %s", d->m, d->n, d->k,
                         fl_dtype_name(d->ta), fl_dtype_name(d->tb), fl_dtype_name(d->tc), cublasLtGetStatusString(st));
    return FL_OK;
}
