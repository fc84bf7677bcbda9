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

/* The epilogue's attributes (issue 30 item 3): its kind and aux's leading dimension once per plan (all: 1), the
 * bias and aux pointers every call (all: 0; the plan's descriptor is reused across calls). The bias is fp32: its
 * type defaults to D's, and an epilogue's D is F32 (cu_gemm_check). */
static cublasStatus_t lt_epilogue(cublasLtMatmulDesc_t op, const fl_cu_gemm_desc *d, int all) {
    const int gelu = d->epilogue == FL_CU_EPI_GELU_AUX_BIAS;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (all) {
        cublasLtEpilogue_t e = gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS;
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e);
        int64_t ld = d->ldaux;
        if (st == CUBLAS_STATUS_SUCCESS && gelu)
            st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld);
    }
    const void *bias = d->bias;
    void *aux = d->aux;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
    if (st == CUBLAS_STATUS_SUCCESS && gelu)
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
    return st;
}

/* The descriptors and the heuristic's algorithm for d's shape (a cache miss). */
static cublasStatus_t lt_plan_create(fl_cu_blas *b, const fl_cu_gemm_desc *d, lt_plan **out) {
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
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c);
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic(b->lt, q->op, q->la, q->lb, q->lc, q->lc, pref, 1, &heur, &found);
    if (st == CUBLAS_STATUS_SUCCESS && found == 0) st = CUBLAS_STATUS_NOT_SUPPORTED;
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS) {
        lt_plan_destroy(q);
        return st;
    }
    q->algo = heur.algo;
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
        st = lt_plan_create(b, d, &q);
        if (st == CUBLAS_STATUS_SUCCESS) fl_cu_gemm_cache_put(&b->plans, &key, q);
    }
    if (st == CUBLAS_STATUS_SUCCESS && d->epilogue != FL_CU_EPI_NONE) st = lt_epilogue(q->op, d, 0);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmul(b->lt, q->op, &d->alpha, d->A, q->la, d->B, q->lb, &d->beta, d->C, q->lc, d->C, q->lc,
                            &q->algo, b->workspace, b->workspace_bytes, (cudaStream_t)b->stream);
    if (st != CUBLAS_STATUS_SUCCESS)
        return fl_errorf(FL_ERR_UNSUPPORTED, "cuBLASLt matmul m=%d n=%d k=%d (%s,%s,%s) batch %d%s: %s", d->m, d->n,
                         d->k, fl_dtype_name(d->ta), fl_dtype_name(d->tb), fl_dtype_name(d->tc), d->batch,
                         d->epilogue == FL_CU_EPI_BIAS ? " bias epilogue"
                         : d->epilogue == FL_CU_EPI_GELU_AUX_BIAS ? " bias+GELU epilogue" : "",
                         cublasLtGetStatusString(st));
    return FL_OK;
}
