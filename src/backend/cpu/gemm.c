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
 * Dtypes (ta, tb, tc): F32xF32->F32; BF16xBF16->F32|BF16 and F32xBF16->F32 (see "bf16"
 * below); F32xF16->F32 and F16xF16->F32 (the fp16 policies: 16-mixed multiplies f32
 * activations by an f16 weight copy, 16-true has f16 weights). Anything else: UNSUPPORTED.
 *
 * fp16 semantics (all paths). This CPU has no fp16 arithmetic, so F16 operands are widened
 * exactly to fp32 (every f16 value, subnormals included, is an fp32 value) and the product is
 * an fp32 GEMM: an F32 A is NOT rounded to f16 (unlike F32xBF16, which rounds A to bf16), and
 * C = alpha * op(A) op(B) + beta * C is computed in fp32, with the BLAS edge semantics above.
 * Library builds widen op(B) (and an F16 A) block by block into one fixed fp32 scratch
 * (FL_WIDEN_SCRATCH, allocated once, process-wide, mutex-guarded) and call the library sgemm per
 * block; see "widen + sgemm" below.
 *
 * bf16 paths (fl_cpu_gemm_bf16_path; FITLLM_BF16_GEMM=tiled|widen forces one): oneDNN's bf16
 * matmul on CPUs with avx512_bf16 (usable at FITLLM_CPU's level, include/fitllm/cpu.h); else
 * the fp16 scheme above with bf16 widening ("widen + sgemm"), which runs at sgemm speed; naive
 * builds use the tiled kernel.
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
#include <stdlib.h>
#include <string.h>

#include <omp.h>
#include <pthread.h>

#include "backend/cpu/cpu-impl.h"
#include "core/cvt.h"
#include "fitllm/cpu.h"

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
    if (nt <= 0) nt = fl_cpu_default_threads();
    return nt > 0 ? nt : 1;
}

static int gemm_types_ok(fl_dtype ta, fl_dtype tb, fl_dtype tc) {
    if (ta == FL_F32 && tb == FL_F32 && tc == FL_F32) return 1;
    if (ta == FL_BF16 && tb == FL_BF16 && (tc == FL_F32 || tc == FL_BF16)) return 1;
    if (ta == FL_F32 && tb == FL_BF16 && tc == FL_F32) return 1;
    if ((ta == FL_F32 || ta == FL_F16) && tb == FL_F16 && tc == FL_F32) return 1;
    return 0;
}

/* Argument checks shared by both entry points. */
static fl_status gemm_check(const char *who, int trans_a, int trans_b, int M, int N, int K, const void *A,
                            fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, const void *C, fl_dtype tc,
                            int ldc) {
    if (!gemm_types_ok(ta, tb, tc))
        return fl_errorf(FL_ERR_UNSUPPORTED,
                         "%s: dtypes A=%s B=%s C=%s not supported (F32xF32->F32, BF16xBF16->F32, F32xBF16->F32, "
                         "BF16xBF16->BF16, F32xF16->F32, F16xF16->F32)",
                         who, fl_dtype_name(ta), fl_dtype_name(tb), fl_dtype_name(tc));
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


/* ---- bf16 ------------------------------------------------------------------------------
 * Semantics (all paths): an F32 A paired with a BF16 B is rounded to bf16 (RNE) first, so
 * every product is of two bf16 values; products are summed in fp32 (naive: in double, the
 * reference), then C = alpha*sum + beta*C in fp32 with a BF16 C widened for beta and rounded
 * (RNE) once on store. beta == 0: C is not read. */

/* op(A)[i][k] as the bf16 value (in a float). */
static inline float a_bf16(const void *A, fl_dtype ta, int trans_a, int lda, int i, int k) {
    size_t idx = trans_a ? (size_t)k * lda + i : (size_t)i * lda + k;
    if (ta == FL_BF16) return fl_bf16_to_f32(((const uint16_t *)A)[idx]);
    return fl_bf16_to_f32(fl_f32_to_bf16(((const float *)A)[idx]));
}
/* op(A)[i][k] paired with a B of type tb: bf16 rules above for a BF16 B; with an F16 B an F16 A
 * is widened and an F32 A used as is. */
static inline float a_lowp(const void *A, fl_dtype ta, fl_dtype tb, int trans_a, int lda, int i, int k) {
    if (tb == FL_BF16) return a_bf16(A, ta, trans_a, lda, i, k);
    size_t idx = trans_a ? (size_t)k * lda + i : (size_t)i * lda + k;
    if (ta == FL_F16) return fl_f16_to_f32(((const uint16_t *)A)[idx]);
    return ((const float *)A)[idx];
}
static inline float b_lowp(const void *B, fl_dtype tb, int trans_b, int ldb, int k, int j) {
    size_t idx = trans_b ? (size_t)j * ldb + k : (size_t)k * ldb + j;
    uint16_t h = ((const uint16_t *)B)[idx];
    return tb == FL_F16 ? fl_f16_to_f32(h) : fl_bf16_to_f32(h);
}
static inline float b_bf16(const void *B, int trans_b, int ldb, int k, int j) {
    size_t idx = trans_b ? (size_t)j * ldb + k : (size_t)k * ldb + j;
    return fl_bf16_to_f32(((const uint16_t *)B)[idx]);
}
static inline float c_load(const void *C, fl_dtype tc, size_t idx) {
    return tc == FL_F32 ? ((const float *)C)[idx] : fl_bf16_to_f32(((const uint16_t *)C)[idx]);
}
static inline void c_store(void *C, fl_dtype tc, size_t idx, float v) {
    if (tc == FL_F32)
        ((float *)C)[idx] = v;
    else
        ((uint16_t *)C)[idx] = fl_f32_to_bf16(v);
}

/* C = beta * C for any C type (beta == 0: zeros, C not read). */
static void scale_c_any(void *C, fl_dtype tc, int M, int N, int ldc, float beta, int nt) {
    if (tc == FL_F32) {
        scale_c(C, M, N, ldc, beta, nt);
        return;
    }
    if (beta == 1.0f) return;
#pragma omp parallel for num_threads(nt) schedule(static) if ((int64_t)M * N > 65536)
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            size_t idx = (size_t)i * ldc + j;
            c_store(C, tc, idx, beta == 0.0f ? 0.0f : beta * c_load(C, tc, idx));
        }
}

/* Reference kernel for every non-F32 combination (bf16 and fp16 rules above): products of the
 * widened operands summed in double, alpha/beta applied in double, one rounding on store. */
static fl_status gemm_lowp_naive(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                                 const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                                 void *C, fl_dtype tc, int ldc) {
    int nt = gemm_threads(be);
    if (K == 0 || alpha == 0.0f) {
        scale_c_any(C, tc, M, N, ldc, beta, nt);
        return FL_OK;
    }
#pragma omp parallel for num_threads(nt) schedule(static) if ((int64_t)M * N * K > 32768)
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += (double)a_lowp(A, ta, tb, trans_a, lda, i, k) * (double)b_lowp(B, tb, trans_b, ldb, k, j);
            size_t idx = (size_t)i * ldc + j;
            double v = (double)alpha * s;
            if (beta != 0.0f) v += (double)beta * c_load(C, tc, idx);
            c_store(C, tc, idx, (float)v);
        }
    return FL_OK;
}

/* The checks and edge cases shared by the public bf16 entry points: arguments, B must be BF16,
 * empty C, and K == 0 or alpha == 0 (C = beta * C). *done = 1: nothing left to compute. */
static fl_status bf16_entry(const char *who, const fl_backend *be, int trans_a, int trans_b, int M, int N, int K,
                            float alpha, const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb,
                            float beta, void *C, fl_dtype tc, int ldc, int *done) {
    *done = 1;
    FL_TRY(gemm_check(who, trans_a, trans_b, M, N, K, A, ta, lda, B, tb, ldb, C, tc, ldc));
    if (tb != FL_BF16) return fl_errorf(FL_ERR_UNSUPPORTED, "%s: B must be BF16 (got %s)", who, fl_dtype_name(tb));
    if (M == 0 || N == 0) return FL_OK;
    if (K == 0 || alpha == 0.0f) {
        scale_c_any(C, tc, M, N, ldc, beta, gemm_threads(be));
        return FL_OK;
    }
    *done = 0;
    return FL_OK;
}

/* Portable bf16 GEMM: (MB x NB) output tiles, one per task, K in KB slices widened to fp32
 * stack tiles; fp32 accumulators; a fixed k order per element (deterministic for any thread
 * count). Used by naive builds (no library sgemm to widen into), FITLLM_BF16_GEMM=tiled and
 * the tests; 6-13 GFLOP/s on Zen 3, where widening to the library sgemm reaches its speed. */
fl_status fl_cpu_gemm_bf16_tiled(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                                 const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb,
                                 float beta, void *C, fl_dtype tc, int ldc) {
    int done = 0;
    FL_TRY(bf16_entry("gemm_bf16_tiled", be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc,
                      ldc, &done));
    if (done) return FL_OK;
    int nt = gemm_threads(be);
    enum { MB = 32, NB = 128, KB = 128 };
    int mt = (M + MB - 1) / MB, ntl = (N + NB - 1) / NB;
    long tiles = (long)mt * ntl;
#pragma omp parallel for num_threads(nt) schedule(static) if ((int64_t)M * N * K > 32768)
    for (long t = 0; t < tiles; t++) {
        int i0 = (int)(t / ntl) * MB, j0 = (int)(t % ntl) * NB;
        int mb = M - i0 < MB ? M - i0 : MB, nb = N - j0 < NB ? N - j0 : NB;
        float acc[MB][NB], at[MB][KB], bt[KB][NB];
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < nb; j++) acc[i][j] = 0.0f;
        for (int k0 = 0; k0 < K; k0 += KB) {
            int kb = K - k0 < KB ? K - k0 : KB;
            for (int i = 0; i < mb; i++)
                for (int k = 0; k < kb; k++) at[i][k] = a_bf16(A, ta, trans_a, lda, i0 + i, k0 + k);
            for (int k = 0; k < kb; k++)
                for (int j = 0; j < nb; j++) bt[k][j] = b_bf16(B, trans_b, ldb, k0 + k, j0 + j);
            for (int i = 0; i < mb; i++)
                for (int k = 0; k < kb; k++) {
                    float a = at[i][k];
                    for (int j = 0; j < nb; j++) acc[i][j] += a * bt[k][j];
                }
        }
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < nb; j++) {
                size_t idx = (size_t)(i0 + i) * ldc + j0 + j;
                float v = alpha * acc[i][j];
                if (beta != 0.0f) v += beta * c_load(C, tc, idx);
                c_store(C, tc, idx, v);
            }
    }
    return FL_OK;
}

/* ---- the widening scratch ----------------------------------------------------------------
 * The widened operand blocks of "widen + sgemm" below and oneDNN's bf16 copy of an F32 A live
 * in one fp32 scratch of FL_WIDEN_SCRATCH floats: the part the caller lent (fl_backend
 * .set_scratch, from its pool: the model lends its WORKSPACE region), else a process-wide
 * fallback allocated on first use and kept until exit (op tests, tools; one mutex guards it). */
#define FL_WIDEN_SCRATCH FL_CPU_WIDEN_SCRATCH

static struct {
    pthread_mutex_t mu;
    float *scratch;
    int alloc_failed;
    size_t cap; /* test hook: elements of the scratch to use (0: all) */
} g_ws = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The scratch for this call (lent, or the fallback locked and allocated on first use; NULL if
 * it cannot be allocated) and its usable elements. ws_release(locked) in every case. */
static float *ws_get(size_t *cap, int *locked) {
    pthread_mutex_lock(&g_ws.mu);
    *cap = g_ws.cap ? g_ws.cap : FL_WIDEN_SCRATCH;
    float *lent = fl_cpu_scratch_part(0);
    if (lent) {
        pthread_mutex_unlock(&g_ws.mu);
        *locked = 0;
        return lent;
    }
    *locked = 1;
    if (!g_ws.scratch && !g_ws.alloc_failed) {
        g_ws.scratch = malloc(FL_WIDEN_SCRATCH * sizeof(float));
        g_ws.alloc_failed = !g_ws.scratch;
    }
    return g_ws.scratch;
}
static void ws_release(int locked) {
    if (locked) pthread_mutex_unlock(&g_ws.mu);
}

void fl_cpu_gemm_widen_set_scratch_cap(size_t n) {
    pthread_mutex_lock(&g_ws.mu);
    /* >= 512: a BF16 C keeps a quarter (and a pre-widened A another), the rest room for blocks */
    g_ws.cap = n == 0 || n >= FL_WIDEN_SCRATCH ? 0 : n < 512 ? 512 : n;
    pthread_mutex_unlock(&g_ws.mu);
}

static fl_status gemm_widen(const fl_backend *be, int nt, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                            void *C, fl_dtype tc, int ldc);

int fl_cpu_has_avx512bf16(void) { return (fl_cpu_features() & FL_CPU_F_AVX512BF16) ? 1 : 0; }

#if defined(FL_HAVE_ONEDNN)
/* oneDNN bf16 matmul primitives, cached.
 *
 * Creating a primitive costs ~0.1-1 ms (JIT), so created primitives are kept in a small
 * process-wide table (FL_BF16_CACHE entries, least recently used replaced) keyed by everything
 * baked into them: transposes, M, N, K, lda, ldb, ldc, A/C dtypes, alpha (output scale) and
 * beta (sum post-op). The table, the engine/stream and the primitive execution are guarded by
 * one mutex, so fl_cpu_gemm with bf16 types is thread-safe but serialized across callers
 * (the CPU backend calls it from serial code anyway, see the top of this file). The table
 * lives until exit (oneDNN objects are never freed; they stay reachable, so leak checkers
 * are quiet).
 *
 * F32 x BF16: oneDNN 2.6 has no f32-src/bf16-weights matmul, so op(A) is converted to bf16
 * (RNE, parallel) in row blocks into the widening scratch (FL_BF16_SCRATCH bf16 elements),
 * each block one matmul call with lda = K. */
#define FL_BF16_CACHE 48
#define FL_BF16_SCRATCH (FL_WIDEN_SCRATCH * 2) /* bf16 elements in the fp32 scratch */

typedef struct {
    int used, failed;
    int ta, tb, M, N, K, lda, ldb, ldc;
    fl_dtype a, c;
    float alpha, beta;
    dnnl_primitive_t prim;
    dnnl_memory_t ma, mb, mc;
    unsigned long last;
} mm_entry;

static struct {
    pthread_mutex_t mu;
    int tried, ok;
    dnnl_engine_t eng;
    dnnl_stream_t strm;
    mm_entry e[FL_BF16_CACHE];
    unsigned long tick;
} g_mm = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int mm_init_locked(void) {
    if (g_mm.tried) return g_mm.ok;
    g_mm.tried = 1;
    if (dnnl_engine_create(&g_mm.eng, dnnl_cpu, 0) != dnnl_success) return 0;
    if (dnnl_stream_create(&g_mm.strm, g_mm.eng, dnnl_stream_default_flags) != dnnl_success) return 0;
    g_mm.ok = 1;
    return 1;
}

static void mm_entry_free(mm_entry *e) {
    if (e->prim) dnnl_primitive_destroy(e->prim);
    if (e->ma) dnnl_memory_destroy(e->ma);
    if (e->mb) dnnl_memory_destroy(e->mb);
    if (e->mc) dnnl_memory_destroy(e->mc);
    memset(e, 0, sizeof *e);
}

/* Find or create the primitive (caller holds the mutex). NULL: oneDNN cannot do it. */
static mm_entry *mm_get_locked(int ta, int tb, int M, int N, int K, int lda, int ldb, int ldc, fl_dtype a,
                               fl_dtype c, float alpha, float beta) {
    mm_entry *victim = &g_mm.e[0];
    for (int i = 0; i < FL_BF16_CACHE; i++) {
        mm_entry *e = &g_mm.e[i];
        if (e->used && e->ta == ta && e->tb == tb && e->M == M && e->N == N && e->K == K && e->lda == lda &&
            e->ldb == ldb && e->ldc == ldc && e->a == a && e->c == c && e->alpha == alpha && e->beta == beta) {
            e->last = ++g_mm.tick;
            return e->failed ? NULL : e;
        }
        if (!e->used || (victim->used && e->last < victim->last)) victim = e;
    }
    mm_entry_free(victim);
    mm_entry *e = victim;
    e->used = 1;
    e->ta = ta, e->tb = tb, e->M = M, e->N = N, e->K = K, e->lda = lda, e->ldb = ldb, e->ldc = ldc;
    e->a = a, e->c = c, e->alpha = alpha, e->beta = beta;
    e->last = ++g_mm.tick;
    e->failed = 1;
    dnnl_memory_desc_t da, db, dc;
    dnnl_dims_t sa = {M, K}, sb = {K, N}, sc = {M, N};
    dnnl_dims_t st_a = {ta ? 1 : lda, ta ? lda : 1}, st_b = {tb ? 1 : ldb, tb ? ldb : 1}, st_c = {ldc, 1};
    if (dnnl_memory_desc_init_by_strides(&da, 2, sa, dnnl_bf16, st_a) != dnnl_success) return NULL;
    if (dnnl_memory_desc_init_by_strides(&db, 2, sb, dnnl_bf16, st_b) != dnnl_success) return NULL;
    if (dnnl_memory_desc_init_by_strides(&dc, 2, sc, c == FL_BF16 ? dnnl_bf16 : dnnl_f32, st_c) != dnnl_success)
        return NULL;
    dnnl_matmul_desc_t md;
    if (dnnl_matmul_desc_init(&md, &da, &db, NULL, &dc) != dnnl_success) return NULL;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    int ok = dnnl_primitive_attr_create(&attr) == dnnl_success;
    if (ok && alpha != 1.0f) ok = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha) == dnnl_success;
    if (ok && beta != 0.0f) {
        ok = dnnl_post_ops_create(&po) == dnnl_success && dnnl_post_ops_append_sum(po, beta) == dnnl_success &&
             dnnl_primitive_attr_set_post_ops(attr, po) == dnnl_success;
    }
    if (ok) ok = dnnl_primitive_desc_create(&pd, &md, attr, g_mm.eng, NULL) == dnnl_success;
    if (ok) ok = dnnl_primitive_create(&e->prim, pd) == dnnl_success;
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (ok) ok = dnnl_memory_create(&e->ma, &da, g_mm.eng, DNNL_MEMORY_NONE) == dnnl_success;
    if (ok) ok = dnnl_memory_create(&e->mb, &db, g_mm.eng, DNNL_MEMORY_NONE) == dnnl_success;
    if (ok) ok = dnnl_memory_create(&e->mc, &dc, g_mm.eng, DNNL_MEMORY_NONE) == dnnl_success;
    if (!ok) {
        mm_entry_free(e);
        e->used = 1, e->failed = 1;
        e->ta = ta, e->tb = tb, e->M = M, e->N = N, e->K = K, e->lda = lda, e->ldb = ldb, e->ldc = ldc;
        e->a = a, e->c = c, e->alpha = alpha, e->beta = beta, e->last = g_mm.tick;
        return NULL;
    }
    e->failed = 0;
    return e;
}

static int mm_exec_locked(mm_entry *e, const void *A, const void *B, void *C) {
    if (dnnl_memory_set_data_handle(e->ma, (void *)A) != dnnl_success) return 0;
    if (dnnl_memory_set_data_handle(e->mb, (void *)B) != dnnl_success) return 0;
    if (dnnl_memory_set_data_handle(e->mc, C) != dnnl_success) return 0;
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, e->ma}, {DNNL_ARG_WEIGHTS, e->mb}, {DNNL_ARG_DST, e->mc}};
    if (dnnl_primitive_execute(e->prim, g_mm.strm, 3, args) != dnnl_success) return 0;
    return dnnl_stream_wait(g_mm.strm) == dnnl_success;
}

/* 1: done; 0: oneDNN cannot (caller falls back). */
static int gemm_bf16_onednn(int nt, int trans_a, int trans_b, int M, int N, int K, float alpha, const void *A,
                            fl_dtype ta, int lda, const void *B, int ldb, float beta, void *C, fl_dtype tc, int ldc) {
    int done = 0;
    pthread_mutex_lock(&g_mm.mu);
    if (!mm_init_locked()) goto out;
    if (omp_get_max_threads() != nt) omp_set_num_threads(nt);
    if (ta == FL_BF16) {
        mm_entry *e = mm_get_locked(trans_a, trans_b, M, N, K, lda, ldb, ldc, FL_BF16, tc, alpha, beta);
        done = e && mm_exec_locked(e, A, B, C);
        goto out;
    }
    /* F32 A: convert row blocks of op(A) to bf16 (row-major, lda = K) */
    if ((size_t)K > FL_BF16_SCRATCH) goto out;
    size_t wcap;
    int wlocked;
    uint16_t *S = (uint16_t *)ws_get(&wcap, &wlocked); /* all FL_BF16_SCRATCH bf16 elements (not capped) */
    if (!S) {
        ws_release(wlocked);
        goto out;
    }
    int rows = (int)(FL_BF16_SCRATCH / (size_t)K);
    if (rows > M) rows = M;
    const float *Af = A;
    size_t csz = tc == FL_BF16 ? 2 : 4;
    for (int r0 = 0; r0 < M; r0 += rows) {
        int mb = M - r0 < rows ? M - r0 : rows;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int i = 0; i < mb; i++) {
            if (!trans_a) {
                fl_cvt_f32_to_bf16(S + (size_t)i * K, Af + (size_t)(r0 + i) * lda, (size_t)K);
                continue;
            }
            for (int k = 0; k < K; k++) S[(size_t)i * K + k] = fl_f32_to_bf16(Af[(size_t)k * lda + (r0 + i)]);
        }
        mm_entry *e = mm_get_locked(0, trans_b, mb, N, K, K, ldb, ldc, FL_BF16, tc, alpha, beta);
        if (!e || !mm_exec_locked(e, S, B, (char *)C + (size_t)r0 * ldc * csz)) {
            ws_release(wlocked);
            if (r0 == 0) goto out;
            /* a later block failed after earlier ones were written: finish with the widening
             * path (same semantics) so C is consistent */
            pthread_mutex_unlock(&g_mm.mu);
            fl_status s = gemm_widen(NULL, nt, trans_a, trans_b, M - r0, N, K, alpha,
                                   trans_a ? (const void *)(Af + r0) : (const void *)(Af + (size_t)r0 * lda),
                                   FL_F32, lda, B, FL_BF16, ldb, beta, (char *)C + (size_t)r0 * ldc * csz, tc, ldc);
            return s == FL_OK;
        }
    }
    ws_release(wlocked);
    done = 1;
out:
    pthread_mutex_unlock(&g_mm.mu);
    return done;
}
#endif

fl_status fl_cpu_gemm_naive(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A_, fl_dtype ta, int lda, const void *B_, fl_dtype tb, int ldb, float beta,
                            void *C_, fl_dtype tc, int ldc) {
    FL_TRY(gemm_check("gemm_naive", trans_a, trans_b, M, N, K, A_, ta, lda, B_, tb, ldb, C_, tc, ldc));
    if (M == 0 || N == 0) return FL_OK;
    if (ta != FL_F32 || tb != FL_F32 || tc != FL_F32)
        return gemm_lowp_naive(be, trans_a, trans_b, M, N, K, alpha, A_, ta, lda, B_, tb, ldb, beta, C_, tc, ldc);
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

/* The build's fp32 GEMM on checked arguments with M, N, K > 0 and alpha != 0. */
static fl_status sgemm_f32(const fl_backend *be, int nt, int trans_a, int trans_b, int M, int N, int K, float alpha,
                           const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc) {
#if defined(FL_HAVE_ONEDNN)
    (void)be;
    if (omp_get_max_threads() != nt) omp_set_num_threads(nt);
    dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C,
                                  ldc);
    if (st != dnnl_success)
        return fl_errorf(FL_ERR_INTERNAL, "gemm: dnnl_sgemm(%c%c, M=%d N=%d K=%d, lda=%d ldb=%d ldc=%d) failed: %d",
                         trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, lda, ldb, ldc, (int)st);
    return FL_OK;
#elif defined(FL_HAVE_OPENBLAS)
    (void)be;
    if (g_blas_threads != nt) {
        openblas_set_num_threads(nt);
        g_blas_threads = nt;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                alpha, A, lda, B, ldb, beta, C, ldc);
    return FL_OK;
#else
    (void)be;
    fl_backend tmp = {0};
    tmp.n_threads = nt;
    return fl_cpu_gemm_naive(&tmp, trans_a, trans_b, M, N, K, alpha, A, FL_F32, lda, B, FL_F32, ldb, beta, C, FL_F32,
                             ldc);
#endif
}

/* ---- widen + sgemm (bf16 and fp16) -------------------------------------------------------
 * F32xF16, F16xF16, BF16xBF16 and F32xBF16 (semantics at the top of this file and under
 * "bf16"), on CPUs where a library sgemm beats a 16-bit kernel (every CPU for fp16; CPUs
 * without avx512_bf16 for bf16: a bf16 x bf16 product is exact in fp32, so the widened
 * problem is the bf16 problem and only the summation order differs from the reference).
 *
 * op(B) is widened to fp32 in (kb x nb) blocks, kept in B's stored orientation (so the
 * widening reads whole rows and the sgemm keeps trans_b), into one fixed scratch of
 * FL_WIDEN_SCRATCH floats, allocated once on first use and kept until exit (process-wide,
 * shared by bf16 and fp16); A goes into the scratch's second half in (mb x kb) blocks when it
 * is 16-bit, or F32 paired with a BF16 B (rounded to bf16, RNE, then widened: the documented
 * F32xBF16 semantics). Each block is one library sgemm on the matching C tile, beta for the
 * first K block and 1 after. A BF16 C is computed tile by tile in an fp32 part of the scratch
 * (beta != 0: the tile widened first), then rounded (RNE) once on store. With the default
 * scratch the training shapes up to K = 2048 x N = 1024 are a single call per operand block;
 * the widening (core/cvt.c's SIMD rows, run-time dispatch; one OpenMP thread per 512 Ki
 * elements, see widen_threads; the calling thread in OpenBLAS builds) costs a few percent of
 * the sgemm. The scratch and the calls are
 * guarded by one mutex (thread-safe, serialized across callers). If the scratch cannot be
 * allocated, the double-accumulating reference kernel runs (same semantics, slow). */
/* Row converters to fp32: 16-bit storage widened exactly, or F32 rounded to bf16. */
typedef enum { W_NONE, W_BF16, W_F16, W_F32_ROUND_BF16, W_F32 } widen_kind; /* W_F32: a plain copy */

/* One widening: dst(rows, cols), row stride ldd = widen(src(rows, cols), row stride lds). */
typedef struct {
    float *dst;
    int ldd;
    const void *src;
    widen_kind w;
    int rows, cols, lds;
} widen_job;

static void widen_row(const widen_job *j, int r) {
    float *d = j->dst + (size_t)r * j->ldd;
    if (j->w == W_F32)
        memcpy(d, (const float *)j->src + (size_t)r * j->lds, (size_t)j->cols * sizeof(float));
    else if (j->w == W_F32_ROUND_BF16)
        fl_cvt_f32_round_bf16(d, (const float *)j->src + (size_t)r * j->lds, (size_t)j->cols);
    else if (j->w == W_BF16)
        fl_cvt_bf16_to_f32(d, (const uint16_t *)j->src + (size_t)r * j->lds, (size_t)j->cols);
    else
        fl_cvt_f16_to_f32(d, (const uint16_t *)j->src + (size_t)r * j->lds, (size_t)j->cols);
}

/* Threads for widening `work` elements: one per FL_WIDEN_PER_THREAD (at most nt). A parallel
 * region ends in a barrier, and on an oversubscribed machine (2 vCPUs shared with other
 * processes) a preempted thread holds it for a time slice: measured on Zen 3 under load, the
 * training shapes ran at ~2-3x the sgemm time with 2 widening threads and ~1.0x with one. One
 * thread widens 512 Ki elements in ~0.3 ms, a few percent of the GEMMs that come with them;
 * larger blocks (bigger models, many cores) get more threads. */
#define FL_WIDEN_PER_THREAD ((int64_t)1 << 19)
static int widen_threads(int64_t work, int nt) {
    int64_t t = work / FL_WIDEN_PER_THREAD;
    return t < 1 ? 1 : t > nt ? nt : (int)t;
}

/* Run 1 or 2 widenings in one parallel region (one barrier, see widen_threads). */
static void widen_jobs(const widen_job *j, int nj, int nt) {
    int rows0 = j[0].rows, total = rows0 + (nj > 1 ? j[1].rows : 0);
    int64_t work = (int64_t)j[0].rows * j[0].cols + (nj > 1 ? (int64_t)j[1].rows * j[1].cols : 0);
    int t = widen_threads(work, nt);
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
    for (int r = 0; r < total; r++) {
        if (r < rows0)
            widen_row(&j[0], r);
        else
            widen_row(&j[1], r - rows0);
    }
}

static void widen_rows(float *dst, int ldd, const void *src, widen_kind w, int rows, int cols, int lds, int nt) {
    widen_job j = {dst, ldd, src, w, rows, cols, lds};
    widen_jobs(&j, 1, nt);
}

/* dst(rows, cols), row stride ldd = bf16 RNE of src(rows, cols), row stride lds. */
static void narrow_rows_bf16(uint16_t *dst, int ldd, const float *src, int lds, int rows, int cols, int nt) {
    int t = widen_threads((int64_t)rows * cols, nt);
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
    for (int r = 0; r < rows; r++) fl_cvt_f32_to_bf16(dst + (size_t)r * ldd, src + (size_t)r * lds, (size_t)cols);
}

static const char *elem_at(const void *p, fl_dtype t, size_t idx) { return (const char *)p + idx * fl_dtype_size(t); }

/* Block size for splitting n into ceil(n / most) equal blocks (most >= 1). */
static int balanced(int n, size_t most) {
    if (most < 1) most = 1;
    if ((size_t)n <= most) return n;
    int nblk = (int)(((size_t)n + most - 1) / most);
    return (n + nblk - 1) / nblk;
}

/* Row stride of a (rows x cols) scratch block: cols, or cols + 16 when cols is a multiple of
 * 256 floats (1 KiB) and the block still fits in cap: power-of-two strides map the rows of a
 * panel onto the same cache sets (4K aliasing), which cost 1.5-2.4x on the K = 1024 dW shapes. */
/* A row stride of this many floats (4 KiB) or a multiple maps every row of a panel onto the same
 * L1 sets. oneDNN's sgemm with such a transposed B (stored (N,K), ldb = K): the small model's
 * down projection forward (1024 x 768 x 2048, ldb 2048) ran at 147-175 GFLOP/s against 197-203
 * with ldb 2064 (Zen 4, 2 threads); every forward GEMM of a C = 2048 model (TinyLlama) has it.
 * fl_cpu_gemm copies such a B into the scratch with a padded stride first when it fits in one
 * block (one pass over N x K floats, 1/M of the product's work). Larger B (TinyLlama's qkv,
 * 2560 x 2048) measured no slower unpadded (214 GFLOP/s), and split into K blocks they lost
 * more than the padding gained, so they go to the library as they are. */
#define FL_ALIAS_FLOATS 1024

static int scratch_ld(int rows, int cols, size_t cap) {
    return cols % 256 == 0 && (size_t)rows * (cols + 16) <= cap ? cols + 16 : cols;
}

/* fp32 C (M,N) ldc = alpha op(A) op(B) + beta C with A, B widened block by block into
 * scratch[0, cap). wa: how A is widened (W_NONE: an F32 A used in place). Blocks: all of K
 * when op(B) fits, else K slices at least 256 deep (so N blocks stay wide: the sgemm needs
 * M, N and K of a few hundred to run at full speed) and as much of N as fits; M blocks as
 * the A half allows; every split balanced. 1/16 of each half is left for stride padding. */
static fl_status widen_sgemm_f32c(const fl_backend *be, int nt, int trans_a, int trans_b, int M, int N, int K,
                                  float alpha, const void *A, fl_dtype ta, widen_kind wa, int lda, const void *B,
                                  widen_kind wb, int ldb, float beta, float *C, int ldc, float *scratch, size_t cap) {
    /* scratch: B blocks in [0, bcap), A blocks in [bcap, cap) */
    size_t bcap = wa != W_NONE ? cap / 2 : cap, acap = cap - bcap;
    size_t bfit = bcap - bcap / 16, afit = acap - acap / 16;
    int kb;
    if ((size_t)K * N <= bfit) {
        kb = K;
    } else {
        size_t deep = bfit / 64 < 256 ? bfit / 64 : 256, k_all_n = bfit / (size_t)N;
        size_t k = k_all_n > deep ? k_all_n : deep;
        kb = balanced(K, k < 1 ? 1 : k);
    }
    int nb = balanced(N, bfit / (size_t)kb);
    int mb = wa == W_NONE ? M : balanced(M, afit / (size_t)kb);
    float *SB = scratch, *SA = scratch + bcap;
    const fl_dtype tb = wb == W_F32 ? FL_F32 : FL_BF16; /* B's element size (BF16 and F16: 2 bytes) */
#if defined(FL_HAVE_OPENBLAS)
    /* widen on the calling thread: an OpenMP region right before each OpenBLAS call makes the
     * two spinning thread pools steal each other's cores (see the top of this file) */
    int wnt = 1;
#else
    int wnt = nt;
#endif
    for (int k0 = 0; k0 < K; k0 += kb) {
        int kc = K - k0 < kb ? K - k0 : kb;
        float bk = k0 == 0 ? beta : 1.0f;
        int a_ready = 0; /* mb == M: the widened A block of this k0 is reused for every j0 */
        int ldsa = 0;
        for (int j0 = 0; j0 < N; j0 += nb) {
            int nc = N - j0 < nb ? N - j0 : nb;
            widen_job jobs[2]; /* [0]: B's block until the first sgemm; then A's blocks */
            if (trans_b) { /* stored (N,K): rows j0.., cols k0.. -> SB (nc, kc) */
                widen_job jb = {SB, scratch_ld(nc, kc, bcap), elem_at(B, tb, (size_t)j0 * ldb + k0), wb, nc, kc, ldb};
                jobs[0] = jb;
            } else { /* stored (K,N): rows k0.., cols j0.. -> SB (kc, nc) */
                widen_job jb = {SB, scratch_ld(kc, nc, bcap), elem_at(B, tb, (size_t)k0 * ldb + j0), wb, kc, nc, ldb};
                jobs[0] = jb;
            }
            int ldsb = jobs[0].ldd;
            for (int i0 = 0; i0 < M; i0 += mb) {
                int mc = M - i0 < mb ? M - i0 : mb;
                int nj = i0 == 0 ? 1 : 0;
                const float *Ap;
                int ldap;
                if (wa == W_NONE) {
                    const float *Af = A;
                    Ap = trans_a ? Af + (size_t)k0 * lda + i0 : Af + (size_t)i0 * lda + k0;
                    ldap = lda;
                } else {
                    if (!a_ready) {
                        if (trans_a) { /* stored (K,M): rows k0.., cols i0.. -> SA (kc, mc) */
                            widen_job ja = {SA, scratch_ld(kc, mc, acap), elem_at(A, ta, (size_t)k0 * lda + i0), wa,
                                            kc, mc, lda};
                            jobs[nj++] = ja;
                        } else { /* stored (M,K): rows i0.., cols k0.. -> SA (mc, kc) */
                            widen_job ja = {SA, scratch_ld(mc, kc, acap), elem_at(A, ta, (size_t)i0 * lda + k0), wa,
                                            mc, kc, lda};
                            jobs[nj++] = ja;
                        }
                        ldsa = jobs[nj - 1].ldd;
                        a_ready = mb == M;
                    }
                    Ap = SA;
                    ldap = ldsa;
                }
                if (nj > 0) widen_jobs(jobs, nj, wnt); /* B's block (first i0) and A's: one region */
                FL_TRY(sgemm_f32(be, nt, trans_a, trans_b, mc, nc, kc, alpha, Ap, ldap, SB, ldsb, bk,
                                 C + (size_t)i0 * ldc + j0, ldc));
            }
        }
    }
    return FL_OK;
}

/* Checked arguments, M, N, K > 0, alpha != 0; tb is BF16 or F16 (with the types of
 * gemm_types_ok). */
static fl_status gemm_widen(const fl_backend *be, int nt, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                            void *C, fl_dtype tc, int ldc) {
    widen_kind wb = tb == FL_BF16 ? W_BF16 : W_F16;
    widen_kind wa = ta == FL_BF16 ? W_BF16 : ta == FL_F16 ? W_F16 : tb == FL_BF16 ? W_F32_ROUND_BF16 : W_NONE;
    size_t cap;
    int locked;
    float *S = ws_get(&cap, &locked);
    if (!S) {
        ws_release(locked);
        return gemm_lowp_naive(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
    }
    fl_status s = FL_OK;
    if (tc == FL_F32) {
        s = widen_sgemm_f32c(be, nt, trans_a, trans_b, M, N, K, alpha, A, ta, wa, lda, B, wb, ldb, beta, C, ldc, S,
                             cap);
        ws_release(locked);
        return s;
    }
#if defined(FL_HAVE_OPENBLAS)
    int wnt = 1;
#else
    int wnt = nt;
#endif
    /* BF16 C: (mr x nr) tiles of C accumulate in fp32 in the scratch's last quarter. When
     * op(A) fits in a quarter too it is widened once up front, and the tiles span all M rows
     * where they can, so that neither operand is widened more than once. */
    size_t ccap = cap / 4, rest = cap - ccap;
    float *SC = S + rest;
    int a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
    int lda_w = scratch_ld(a_rows, a_cols, cap / 4);
    if ((size_t)a_rows * lda_w <= cap / 4) {
        rest -= cap / 4;
        float *SA = S + rest;
        widen_rows(SA, lda_w, A, wa, a_rows, a_cols, lda, wnt);
        A = SA, ta = FL_F32, wa = W_NONE, lda = lda_w;
    }
    int mr, nr;
    if ((size_t)M * N <= ccap) {
        mr = M, nr = N;
    } else if (ccap / (size_t)M >= 64) {
        mr = M, nr = balanced(N, ccap / (size_t)M);
    } else if (ccap / (size_t)N >= 64) {
        nr = N, mr = balanced(M, ccap / (size_t)N);
    } else {
        size_t side = 64;
        while ((side * 2) * (side * 2) <= ccap) side *= 2;
        mr = balanced(M, side), nr = balanced(N, ccap / (size_t)mr);
    }
    uint16_t *Cb = C;
    for (int i0 = 0; i0 < M && s == FL_OK; i0 += mr) {
        int mc = M - i0 < mr ? M - i0 : mr;
        const void *Ai = elem_at(A, ta, trans_a ? (size_t)i0 : (size_t)i0 * lda);
        for (int j0 = 0; j0 < N && s == FL_OK; j0 += nr) {
            int nc = N - j0 < nr ? N - j0 : nr;
            const void *Bj = elem_at(B, tb, trans_b ? (size_t)j0 * ldb : (size_t)j0);
            uint16_t *Ct = Cb + (size_t)i0 * ldc + j0;
            int ldsc = scratch_ld(mc, nc, ccap);
            if (beta != 0.0f) widen_rows(SC, ldsc, Ct, W_BF16, mc, nc, ldc, wnt);
            s = widen_sgemm_f32c(be, nt, trans_a, trans_b, mc, nc, K, alpha, Ai, ta, wa, lda, Bj, wb, ldb, beta, SC,
                                 ldsc, S, rest);
            if (s == FL_OK) narrow_rows_bf16(Ct, ldc, SC, ldsc, mc, nc, wnt);
        }
    }
    ws_release(locked);
    return s;
}

/* The bf16 path for fl_cpu_gemm: FITLLM_BF16_GEMM=tiled|widen forces one (read once); else
 * oneDNN's bf16 matmul where the CPU has avx512_bf16 (faster there than widening), widening to
 * the library sgemm in library builds, the tiled kernel in naive builds (faster than the
 * naive sgemm). */
typedef enum { BF16_ONEDNN, BF16_WIDEN, BF16_TILED } bf16_path_t;
static pthread_once_t g_bf16_env_once = PTHREAD_ONCE_INIT;
static int g_bf16_env = -1;
static void bf16_env_read(void) {
    const char *env = getenv("FITLLM_BF16_GEMM");
    if (env && !strcmp(env, "tiled")) g_bf16_env = BF16_TILED;
    if (env && !strcmp(env, "widen")) g_bf16_env = BF16_WIDEN;
}

static bf16_path_t bf16_path(void) {
    pthread_once(&g_bf16_env_once, bf16_env_read);
    if (g_bf16_env >= 0) return (bf16_path_t)g_bf16_env;
#if defined(FL_HAVE_ONEDNN)
    if (fl_cpu_has_avx512bf16()) return BF16_ONEDNN;
#endif
#if defined(FL_HAVE_ONEDNN) || defined(FL_HAVE_OPENBLAS)
    return BF16_WIDEN;
#else
    return BF16_TILED;
#endif
}

fl_status fl_cpu_gemm_bf16_widen(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                                 const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb,
                                 float beta, void *C, fl_dtype tc, int ldc) {
    int done = 0;
    FL_TRY(bf16_entry("gemm_bf16_widen", be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc,
                      ldc, &done));
    if (done) return FL_OK;
    return gemm_widen(be, gemm_threads(be), trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
}

/* Checked arguments, M, N > 0, bf16 types. */
static fl_status gemm_bf16(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                           const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                           void *C, fl_dtype tc, int ldc) {
    int nt = gemm_threads(be);
    if (K == 0 || alpha == 0.0f) {
        scale_c_any(C, tc, M, N, ldc, beta, nt);
        return FL_OK;
    }
    bf16_path_t p = bf16_path();
    if (p == BF16_TILED)
        return fl_cpu_gemm_bf16_tiled(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
#if defined(FL_HAVE_ONEDNN)
    if (p == BF16_ONEDNN &&
        gemm_bf16_onednn(nt, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, ldb, beta, C, tc, ldc))
        return FL_OK;
    /* a shape oneDNN rejects: widen (same semantics) */
#endif
    return gemm_widen(be, nt, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
}

const char *fl_cpu_gemm_bf16_path(void) {
    bf16_path_t p = bf16_path();
    if (p == BF16_ONEDNN) return "onednn-matmul-bf16";
    if (p == BF16_TILED) return "tiled";
    fl_cpu_level_t l = fl_cpu_level();
    return l >= FL_CPU_AVX512 ? "avx512-widen+sgemm" : l >= FL_CPU_AVX2 ? "avx2-widen+sgemm" : "widen+sgemm";
}

unsigned fl_cpu_gemm_widens16(void) {
#if defined(FL_HAVE_ONEDNN) || defined(FL_HAVE_OPENBLAS)
    /* gemm_f16 always widens; bf16 unless oneDNN's native bf16 matmul (or the forced tiled kernel) runs */
    return (1u << FL_F16) | (bf16_path() == BF16_WIDEN ? 1u << FL_BF16 : 0u);
#else
    return 0; /* naive builds: no library sgemm to run the widened problem faster */
#endif
}

const char *fl_cpu_gemm_f16_path(void) {
    return fl_cpu_level() >= FL_CPU_AVX2 ? "f16c-widen+sgemm" : "widen+sgemm";
}

/* Checked arguments, M, N > 0, tb == F16, tc == F32. */
static fl_status gemm_f16(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                          const void *A, fl_dtype ta, int lda, const void *B, int ldb, float beta, void *C, int ldc) {
    int nt = gemm_threads(be);
    if (K == 0 || alpha == 0.0f) {
        scale_c(C, M, N, ldc, beta, nt);
        return FL_OK;
    }
    return gemm_widen(be, nt, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, FL_F16, ldb, beta, C, FL_F32, ldc);
}

fl_status fl_cpu_gemm(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                      const void *A_, fl_dtype ta, int lda, const void *B_, fl_dtype tb, int ldb, float beta, void *C_,
                      fl_dtype tc, int ldc) {
    FL_TRY(gemm_check("gemm", trans_a, trans_b, M, N, K, A_, ta, lda, B_, tb, ldb, C_, tc, ldc));
    if (M == 0 || N == 0) return FL_OK;
    if (tb == FL_F16) return gemm_f16(be, trans_a, trans_b, M, N, K, alpha, A_, ta, lda, B_, ldb, beta, C_, ldc);
    if (ta != FL_F32 || tb != FL_F32 || tc != FL_F32)
        return gemm_bf16(be, trans_a, trans_b, M, N, K, alpha, A_, ta, lda, B_, tb, ldb, beta, C_, tc, ldc);
#if defined(FL_HAVE_ONEDNN) || defined(FL_HAVE_OPENBLAS)
    int nt = gemm_threads(be);
    if (K == 0 || alpha == 0.0f) {
        /* BLAS would do this too, but oneDNN rejects lda=0 etc. for K == 0, and
         * this way every library behaves the same. */
        scale_c(C_, M, N, ldc, beta, nt);
        return FL_OK;
    }
    if (trans_b && ldb % FL_ALIAS_FLOATS == 0 && M >= 128 && N >= 256 && K >= 256 &&
        (size_t)N * (K + 16) <= FL_WIDEN_SCRATCH - FL_WIDEN_SCRATCH / 16) {
        /* 4 KiB aliasing: copy B into the scratch with a padded stride, one block (widen + sgemm) */
        size_t cap;
        int locked;
        float *S = ws_get(&cap, &locked);
        fl_status s = S && (size_t)N * (K + 16) <= cap - cap / 16
                          ? widen_sgemm_f32c(be, nt, trans_a, 1, M, N, K, alpha, A_, FL_F32, W_NONE, lda, B_, W_F32,
                                             ldb, beta, C_, ldc, S, cap)
                          : sgemm_f32(be, nt, trans_a, trans_b, M, N, K, alpha, A_, lda, B_, ldb, beta, C_, ldc);
        ws_release(locked);
        return s;
    }
    return sgemm_f32(be, nt, trans_a, trans_b, M, N, K, alpha, A_, lda, B_, ldb, beta, C_, ldc);
#else
    return fl_cpu_gemm_naive(be, trans_a, trans_b, M, N, K, alpha, A_, ta, lda, B_, tb, ldb, beta, C_, tc, ldc);
#endif
}
