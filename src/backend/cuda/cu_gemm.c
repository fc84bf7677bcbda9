/* fitllm CUDA backend: the cuBLASLt wrapper's host stand-in, argument checks, plan cache and the
 * row-major mapping (contract: cu_gemm.h). The wrapper itself is in the CUDA plugin
 * (plugin/cu_gemm_lt.c). */
#include "backend/cuda/cu_gemm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int type_ok(fl_dtype ta, fl_dtype tb, fl_dtype tc) {
    if (ta == FL_F32) return tb == FL_F32 && tc == FL_F32;
    if (ta == FL_BF16) return tb == FL_BF16 && (tc == FL_F32 || tc == FL_BF16);
    if (ta == FL_F16) return tb == FL_F16 && (tc == FL_F32 || tc == FL_F16);
    return 0;
}

fl_status fl_cu_gemm_check(const fl_cu_gemm_desc *d) {
    if (d->m < 0 || d->n < 0 || d->k < 0 || d->batch < 1)
        return fl_errorf(FL_ERR_INVALID, "cu_gemm: bad shape m=%d n=%d k=%d batch=%d", d->m, d->n, d->k, d->batch);
    if (!type_ok(d->ta, d->tb, d->tc))
        return fl_errorf(FL_ERR_UNSUPPORTED, "cu_gemm: types A=%s B=%s C=%s not supported", fl_dtype_name(d->ta),
                         fl_dtype_name(d->tb), fl_dtype_name(d->tc));
    int64_t ra = d->trans_a ? d->k : d->m, rb = d->trans_b ? d->n : d->k;
    if (d->lda < (ra > 1 ? ra : 1) || d->ldb < (rb > 1 ? rb : 1) || d->ldc < (d->m > 1 ? d->m : 1))
        return fl_errorf(FL_ERR_INVALID,
                         "cu_gemm: leading dimension too small (column-major: lda=%lld needs >= %lld, ldb=%lld "
                         ">= %lld, ldc=%lld >= %d)",
                         (long long)d->lda, (long long)ra, (long long)d->ldb, (long long)rb, (long long)d->ldc, d->m);
    if (d->m && d->n && (!d->C || (d->k && (!d->A || !d->B))))
        return fl_errorf(FL_ERR_INVALID, "cu_gemm: NULL matrix");
    if (d->D && d->D != d->C) { /* a separate output: C's layout, C read only, no overlap */
        if (d->epilogue != FL_CU_EPI_NONE || d->beta == 0.0f)
            return fl_errorf(FL_ERR_UNSUPPORTED, "cu_gemm: an output D apart from C takes no epilogue and a C read "
                             "(beta != 0; epilogue %d, beta %g)", d->epilogue, (double)d->beta);
        const size_t es = fl_dtype_size(d->tc);
        const size_t span = ((size_t)(d->batch - 1) * (size_t)d->stride_c + (size_t)(d->n - 1) * (size_t)d->ldc +
                             (size_t)d->m) * es;
        const char *c = (const char *)d->C, *o = (const char *)d->D;
        if (d->m && d->n && c < o + span && o < c + span)
            return fl_errorf(FL_ERR_INVALID, "cu_gemm: the output D overlaps C (%zu bytes each, %td apart)", span,
                             o - c);
    }
    if (d->epilogue != FL_CU_EPI_NONE) {
        if (d->epilogue != FL_CU_EPI_BIAS && d->epilogue != FL_CU_EPI_GELU_AUX_BIAS)
            return fl_errorf(FL_ERR_INVALID, "cu_gemm: unknown epilogue %d", d->epilogue);
        /* a BF16 D (C) with the bias epilogue: a bf16 run's stored linear output (beta 0: C not read) */
        const int d16 = d->tc == FL_BF16 && d->epilogue == FL_CU_EPI_BIAS && d->beta == 0.0f;
        if (d->batch != 1 || (d->tc != FL_F32 && !d16))
            return fl_errorf(FL_ERR_UNSUPPORTED, "cu_gemm: an epilogue takes one matrix and an F32 C (or BF16 with the "
                             "bias epilogue and beta 0) (batch %d, C %s)", d->batch, fl_dtype_name(d->tc));
        if (!d->bias) return fl_errorf(FL_ERR_INVALID, "cu_gemm: epilogue without a bias");
        if (d->bias_t != FL_F32 && d->bias_t != FL_BF16)
            return fl_errorf(FL_ERR_UNSUPPORTED, "cu_gemm: a %s bias (F32 or BF16)", fl_dtype_name(d->bias_t));
        if (d->epilogue == FL_CU_EPI_GELU_AUX_BIAS && (!d->aux || d->ldaux < (d->m > 1 ? d->m : 1) || d->beta != 0.0f))
            return fl_errorf(FL_ERR_INVALID, "cu_gemm: GELU epilogue needs aux with ldaux >= m (ldaux=%lld, m=%d) and "
                             "beta 0 (%g)", (long long)d->ldaux, d->m, (double)d->beta);
    }
    return FL_OK;
}

/* The GELU kernels' formula (kernels/act.cu, the CPU's act.c): x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3),
 * in fp32 without contraction (CMake builds this file with -ffp-contract=off, as the emulated kernels): the
 * stand-in's GELU epilogue gives the bits of a GEMM, the bias kernel and the GELU kernel on the emulator. */
static float epi_gelu(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x * (1.0f / (1.0f + expf(-(2.0f * u))));
}

static double ld_elem(const void *p, fl_dtype t, int64_t i) {
    if (t == FL_F32) return ((const float *)p)[i];
    if (t == FL_BF16) return fl_bf16_to_f32(((const uint16_t *)p)[i]);
    return fl_f16_to_f32(((const uint16_t *)p)[i]);
}

unsigned long fl_cu_gemm_standin_epilogues, fl_cu_gemm_standin_gelus;

fl_status fl_cu_gemm_lt_bias_ok(const fl_cu_gemm_desc *d) {
    if (d->epilogue == FL_CU_EPI_NONE || d->bias_t == d->tc) return FL_OK;
    return fl_errorf(FL_ERR_UNSUPPORTED, "cuBLASLt matmul m=%d n=%d k=%d (%s,%s,%s) batch %d %s epilogue: a %s bias with "
                     "a %s D (cuBLASLt takes a bias of D's type: an unsupported value or parameter was passed to the "
                     "function)", d->m, d->n, d->k, fl_dtype_name(d->ta), fl_dtype_name(d->tb), fl_dtype_name(d->tc),
                     d->batch, d->epilogue == FL_CU_EPI_GELU_AUX_BIAS ? "bias+GELU" : "bias",
                     fl_dtype_name(d->bias_t), fl_dtype_name(d->tc));
}

/* One element of C from its fp64 sum over p (in order from p = 0): alpha, beta C, the epilogue, C's type; written to
 * D (C's layout: C itself in place) */
static void standin_store(const fl_cu_gemm_desc *d, char *C, char *D, int i, int j, double acc) {
    int64_t ci = i + (int64_t)j * d->ldc;
    double v = (double)d->alpha * acc;
    if (d->tc != FL_F32 && d->beta != 0.0f && d->epilogue == FL_CU_EPI_NONE) {
        /* a 16-bit C read (FL_OP_GEMM_ACC16, gemm_res16): the sum rounded to fp32, beta C added in fp32, then one
         * rounding to C's type, as cuBLASLt's fp32 compute and scale type (and accumulate16 after a
         * GEMM into a zeroed fp32 buffer: the same bits) */
        float f = (float)v + d->beta * (float)ld_elem(C, d->tc, ci);
        if (d->tc == FL_BF16) ((uint16_t *)D)[ci] = fl_f32_to_bf16(f);
        else ((uint16_t *)D)[ci] = fl_f32_to_f16(f);
        return;
    }
    if (d->beta != 0.0f) v += (double)d->beta * ld_elem(C, d->tc, ci); /* beta 0: C not read */
    if (d->epilogue != FL_CU_EPI_NONE) { /* rounded to fp32, then the epilogue in fp32 (a BF16 D: then RNE) */
        float f = (float)v + (float)ld_elem(d->bias, d->bias_t, i); /* BF16: widened exactly */
        if (d->epilogue == FL_CU_EPI_GELU_AUX_BIAS) {
            d->aux[i + (int64_t)j * d->ldaux] = f;
            f = epi_gelu(f);
        }
        if (d->tc == FL_BF16) ((uint16_t *)D)[ci] = fl_f32_to_bf16(f);
        else ((float *)D)[ci] = f;
    } else if (d->tc == FL_F32) ((float *)D)[ci] = (float)v;
    else if (d->tc == FL_BF16) ((uint16_t *)D)[ci] = fl_f32_to_bf16((float)v);
    else ((uint16_t *)D)[ci] = fl_f32_to_f16((float)v);
}

/* A 4 x 4 tile of sums: acc[4 jj + ii] = sum over p, in order, of a[4p + ii] b[4p + jj] in fp64. Each product of two
 * fp32 values is exact in fp64, so each element is the same chain of fp64 additions as one sum at a time (and the
 * same with or without fused multiply-adds); sixteen independent chains instead of one at a time */
static void standin_tile(const float *a, const float *b, int k, double *acc) {
    double s[16] = {0};
    for (int p = 0; p < k; p++, a += 4, b += 4)
        for (int jj = 0; jj < 4; jj++)
            for (int ii = 0; ii < 4; ii++) s[4 * jj + ii] += (double)a[ii] * (double)b[jj];
    memcpy(acc, s, sizeof s);
}

/* The host stand-in: C = alpha op(A) op(B) + beta C, each element's sum over p in fp64 in order (the operands are
 * 16- or 32-bit floats, exact in fp32), then rounded. op(A) is packed once per matrix in 4-row panels and op(B) per
 * 4 columns, contiguous in p, and 4 x 4 elements are summed at a time: the bits of one element at a time, faster. */
fl_status fl_cu_gemm_standin(void *ctx, const fl_cu_gemm_desc *d) {
    (void)ctx;
    fl_status s = fl_cu_gemm_check(d);
    if (s == FL_OK) s = fl_cu_gemm_lt_bias_ok(d); /* what cuBLASLt refuses at the call (CUBLAS_STATUS_INVALID_VALUE) */
    if (s != FL_OK) return s;
    if (d->epilogue != FL_CU_EPI_NONE) fl_cu_gemm_standin_epilogues++;
    if (d->epilogue == FL_CU_EPI_GELU_AUX_BIAS) fl_cu_gemm_standin_gelus++;
    if (d->m == 0 || d->n == 0) return FL_OK;
    const int mb = (d->m + 3) / 4, kk = d->k;
    float *ap = malloc(((size_t)mb * kk * 4 + (size_t)kk * 4 + 1) * sizeof(float));
    if (!ap) return fl_errorf(FL_ERR_OOM, "cu_gemm stand-in: out of host memory for a %d x %d panel", d->m, d->k);
    float *bp = ap + (size_t)mb * kk * 4;
    for (int b = 0; b < d->batch; b++) {
        const char *A = (const char *)d->A + (size_t)(b * d->stride_a) * fl_dtype_size(d->ta);
        const char *B = (const char *)d->B + (size_t)(b * d->stride_b) * fl_dtype_size(d->tb);
        char *C = (char *)d->C + (size_t)(b * d->stride_c) * fl_dtype_size(d->tc);
        char *D = d->D ? (char *)d->D + (size_t)(b * d->stride_c) * fl_dtype_size(d->tc) : C;
        /* op(A)[i,p]: A[i + p*lda] (N) or A[p + i*lda] (T); rows past m are zeros (computed, not stored) */
        for (int ib = 0; ib < mb; ib++)
            for (int p = 0; p < kk; p++)
                for (int ii = 0; ii < 4; ii++) {
                    const int i = 4 * ib + ii;
                    ap[((size_t)ib * kk + p) * 4 + ii] =
                        i < d->m ? (float)ld_elem(A, d->ta, d->trans_a ? p + (int64_t)i * d->lda : i + (int64_t)p * d->lda)
                                 : 0.0f;
                }
        for (int j0 = 0; j0 < d->n; j0 += 4) {
            /* op(B)[p,j]: B[p + j*ldb] (N) or B[j + p*ldb] (T) */
            for (int p = 0; p < kk; p++)
                for (int jj = 0; jj < 4; jj++) {
                    const int j = j0 + jj;
                    bp[(size_t)p * 4 + jj] =
                        j < d->n ? (float)ld_elem(B, d->tb, d->trans_b ? j + (int64_t)p * d->ldb : p + (int64_t)j * d->ldb)
                                 : 0.0f;
                }
            for (int ib = 0; ib < mb; ib++) {
                double acc[16];
                standin_tile(ap + (size_t)ib * kk * 4, bp, kk, acc);
                for (int jj = 0; jj < 4 && j0 + jj < d->n; jj++)
                    for (int ii = 0; ii < 4 && 4 * ib + ii < d->m; ii++)
                        standin_store(d, C, D, 4 * ib + ii, j0 + jj, acc[4 * jj + ii]);
            }
        }
    }
    free(ap);
    return FL_OK;
}

fl_status fl_cu_gemm_standin_bench(void *ctx, const fl_cu_gemm_desc *d, int reps, double *best_ms, double *first_ms,
                                   int *n_algos) {
    *best_ms = *first_ms = -1;
    *n_algos = 0;
    FL_TRY(fl_cu_gemm_check(d));
    if (reps < 1) return FL_OK;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int r = 0; r < reps; r++) FL_TRY(fl_cu_gemm_standin(ctx, d));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *best_ms = *first_ms = ((double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-6) / reps;
    *n_algos = 1;
    return FL_OK;
}

fl_status fl_cu_gemm_rowmajor(fl_cu_gemm_fn fn, void *ctx, int trans_a, int trans_b, int M, int N, int K, float alpha,
                              const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                              void *C, fl_dtype tc, int ldc, int batch, int64_t stride_a, int64_t stride_b,
                              int64_t stride_c) {
    fl_cu_gemm_desc d;
    fl_cu_gemm_desc_rowmajor(&d, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
    d.batch = batch, d.stride_a = stride_b, d.stride_b = stride_a, d.stride_c = stride_c; /* A and B swapped */
    return fn(ctx, &d);
}

void fl_cu_gemm_desc_rowmajor(fl_cu_gemm_desc *d, int trans_a, int trans_b, int M, int N, int K, float alpha,
                              const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                              void *C, fl_dtype tc, int ldc) {
    /* Row-major X (r x c, row stride ld) is column-major X^T (c x r, leading dimension ld). So
     * C^T (N x M) = op(B)^T (N x K) @ op(A)^T (K x M): cuBLASLt's A is our B with our trans_b
     * (the stored row-major K x N, not transposed, reads as column-major N x K = op(B)^T), its
     * B is our A with our trans_a. */
    *d = (fl_cu_gemm_desc){
        .trans_a = trans_b, .trans_b = trans_a, .m = N, .n = M, .k = K, .alpha = alpha, .beta = beta,
        .A = B, .ta = tb, .lda = ldb, .B = A, .tb = ta, .ldb = lda, .C = C, .tc = tc, .ldc = ldc, .batch = 1,
    };
}

fl_status fl_cu_gemm_rowmajor_epi(fl_cu_gemm_fn fn, void *ctx, int epilogue, const void *bias, fl_dtype bias_t,
                                  float *aux, int ldaux,
                                  int trans_a, int trans_b, int M, int N, int K, float alpha, const void *A,
                                  fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C,
                                  fl_dtype tc, int ldc) {
    /* the row-major output's columns are cuBLASLt's rows, so the bias is per row of C^T */
    fl_cu_gemm_desc d;
    fl_cu_gemm_desc_rowmajor(&d, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
    d.epilogue = epilogue, d.bias = bias, d.bias_t = bias_t, d.aux = aux, d.ldaux = ldaux;
    return fn(ctx, &d);
}

/* ---- the plan cache (cu_gemm.h) ---------------------------------------------------------------- */

int fl_cu_gemm_panel_rows(int rows, int max_rows) {
    if (max_rows < 1) return 0;
    if (rows <= max_rows) return rows > 0 ? rows : 1;
    const int q = max_rows >= 1024 ? 128 : max_rows >= 8 ? 8 : max_rows >= 4 ? 4 : 1; /* 128: <= 1/8 unused */
    const int cap = max_rows / q * q;               /* >= q */
    const int np = (int)(((int64_t)rows + cap - 1) / cap); /* the fewest panels of at most cap rows */
    const int per = (int)(((int64_t)rows + np - 1) / np);  /* balanced: <= cap */
    return (per + q - 1) / q * q;                   /* a multiple of q, still <= cap */
}

uint32_t fl_cu_gemm_align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1;
    return al;
}

void fl_cu_gemm_key_of(const fl_cu_gemm_desc *d, size_t workspace_bytes, fl_cu_gemm_key *k) {
    memset(k, 0, sizeof *k); /* every byte defined: keys compare as memory */
    int32_t v[] = {d->trans_a, d->trans_b, d->m, d->n, d->k, (int32_t)d->ta, (int32_t)d->tb, (int32_t)d->tc, d->batch,
                   (int32_t)fl_cu_gemm_align_of(d->A), (int32_t)fl_cu_gemm_align_of(d->B),
                   (int32_t)fl_cu_gemm_align_of(d->C), d->epilogue,
                   d->epilogue ? (int32_t)fl_cu_gemm_align_of(d->bias) : 0,
                   d->epilogue == FL_CU_EPI_GELU_AUX_BIAS ? (int32_t)fl_cu_gemm_align_of(d->aux) : 0,
                   d->epilogue ? (int32_t)d->bias_t : 0, d->D && d->D != d->C,
                   d->D && d->D != d->C ? (int32_t)fl_cu_gemm_align_of(d->D) : 0};
    memcpy(k->v, v, sizeof v);
    k->ld[0] = d->lda;
    k->ld[1] = d->ldb;
    k->ld[2] = d->ldc;
    k->ld[3] = d->epilogue == FL_CU_EPI_GELU_AUX_BIAS ? d->ldaux : 0;
    k->workspace_bytes = workspace_bytes;
    if (d->batch > 1) { /* one matrix: the strides are not read */
        k->stride[0] = d->stride_a;
        k->stride[1] = d->stride_b;
        k->stride[2] = d->stride_c;
    }
}

int fl_cu_gemm_key_eq(const fl_cu_gemm_key *a, const fl_cu_gemm_key *b) { return !memcmp(a, b, sizeof *a); }

static uint64_t key_hash(const fl_cu_gemm_key *k) { /* FNV-1a over the key's bytes */
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

fl_status fl_cu_gemm_cache_init(fl_cu_gemm_cache *c, int cap, void (*destroy)(void *plan)) {
    memset(c, 0, sizeof *c);
    if (cap < 1) return fl_errorf(FL_ERR_INVALID, "cu_gemm plan cache: capacity %d", cap);
    c->e = calloc((size_t)cap, sizeof *c->e);
    if (!c->e) return fl_errorf(FL_ERR_OOM, "cu_gemm plan cache: %d entries", cap);
    c->cap = cap;
    c->destroy = destroy;
    return FL_OK;
}

void *fl_cu_gemm_cache_get(fl_cu_gemm_cache *c, const fl_cu_gemm_key *k) {
    uint64_t h = key_hash(k);
    for (int i = 0; i < c->n; i++)
        if (c->e[i].hash == h && fl_cu_gemm_key_eq(&c->e[i].key, k)) {
            c->e[i].used = ++c->tick;
            c->hits++;
            return c->e[i].plan;
        }
    c->misses++;
    return NULL;
}

void fl_cu_gemm_cache_put(fl_cu_gemm_cache *c, const fl_cu_gemm_key *k, void *plan) {
    int slot = c->n;
    if (c->n == c->cap) { /* full: the least recently used goes */
        slot = 0;
        for (int i = 1; i < c->n; i++)
            if (c->e[i].used < c->e[slot].used) slot = i;
        if (c->destroy) c->destroy(c->e[slot].plan);
        c->evictions++;
    } else {
        c->n++;
    }
    c->e[slot].key = *k;
    c->e[slot].hash = key_hash(k);
    c->e[slot].used = ++c->tick;
    c->e[slot].plan = plan;
}

void fl_cu_gemm_cache_free(fl_cu_gemm_cache *c) {
    for (int i = 0; i < c->n; i++)
        if (c->destroy) c->destroy(c->e[i].plan);
    free(c->e);
    memset(c, 0, sizeof *c);
}
