/* fitllm CUDA backend object: the fl_backend table (fitllm/backend.h) over the CUDA kernels.
 *
 * Written once, compiled twice (like the kernels): backend_cuda.c defines the FLB_* macros for
 * the real thing (fl_cuk_* launchers, cudaMemcpyAsync on one stream, cuBLASLt, cudaMalloc'd
 * pools) and emu/backend_cuemu.c for the CPU emulator (fl_cuemu_* launchers, memcpy, the
 * cuBLASLt stand-in, host memory), so `make test` runs this very file op by op against the CPU
 * backend (the "cuda-emu" backend the test suite registers) on machines without a GPU.
 *
 * The including file defines:
 *   FLB_NAME, FLB_DESC          backend name ("cuda" / "cuda-emu") and one line for --version
 *   FLB_K(name)                 the kernel launcher (fl_cuk_##name / fl_cuemu_##name)
 *   FLB_PREFIX(name)            the public functions' prefix (fl_cuda_##name / fl_cuemu_##name)
 *   flb_dev_alloc/free, flb_host_alloc/free (page-locked host memory), flb_h2d/d2h/d2d/memset, flb_stream_new/sync/free, flb_last_error
 *   flb_gemm_fn                 fl_cu_gemm_cublaslt / fl_cu_gemm_standin
 *   flb_comm_create(be,stream,..) the device communicator of several ranks (NCCL / its stand-in; staged)
 *   flb_device_name(buf, n)     the device's name (cudaDeviceProp.name; the emulator's own)
 *   flb_mark_new/record/ms/free profiling markers (CUDA events; the emulator: host clock readings)
 *   FLB_PANEL_BYTES, FLB_LT_WS_BYTES   scratch layout (see scratch below)
 *
 * Errors: CUDA reports kernel failures asynchronously, and many ops of the table return void.
 * A failed launch (or a missing kernel) is recorded as the backend's sticky error: every later
 * op that returns fl_status returns it, and sync / to_host return it, naming the first op that
 * failed. So a run stops at its next status check (at the latest the step's loss read-back).
 *
 * Scratch: the caller lends be->scratch_bytes of device memory from its pool (set_scratch, the
 * model's WORKSPACE region). Layout: [0, FLB_LT_WS_BYTES) cuBLASLt's workspace, then
 * FLB_PANEL_BYTES for the mixed-type GEMM panels (an F32 A rounded to bf16, an F16 B widened to
 * fp32, a panel of rows at a time so the scratch is bounded whatever the shape), then
 * FLB_WORK_BYTES of kernel work space (attention's D = rowsum(dout * out), the embedding
 * backward's token ranks; an op whose work does not fit fails naming the sizes). Ops run in
 * stream order, so one op's scratch is free again for the next. Without a lent scratch (op
 * tests, tools), a buffer of the same size is allocated once on first use.
 *
 * Memory: pool_init makes a pool whose arenas are device allocations; the tiny per-backend
 * "scalars" buffer (a found-inf flag and the sum-of-squares partials, < 9 KiB) is allocated at
 * init outside any pool. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cu_gemm.h"
#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/cu_kernels_be.h"
#include "backend/cuda/cu_kernels_train.h" /* (the graphs: 8-bit AdamW's update from a slot) */
#include "fitllm/backend.h"
#include "fitllm/lora.h"
#include "fitllm/perf.h"

/* the op scratch's work area (cuda-work-ops-impl.h) */
static void *flb_work(const fl_backend *be, size_t bytes, const char *op);
/* the column sums' and the cross-entropy's partial sums (cu_kernels.h), in that work area */
_Static_assert(FLB_WORK_BYTES >= FL_CU_NORM_WORK_BYTES, "the op work area holds the norm / cross-entropy partials");
#define FLB_NWORK(be, op) flb_work((be), FL_CU_NORM_WORK_BYTES, (op))

#include "backend/cuda/cuda-stage-impl.h"
#include "backend/cuda/cuda-input-impl.h"
#include "backend/cuda/cuda-graph-impl.h"

/* + 256: the lent region is re-aligned to 256 bytes (cuBLASLt's workspace, the panels) */
#define FLB_SCRATCH_BYTES ((size_t)FLB_LT_WS_BYTES + (size_t)FLB_PANEL_BYTES + (size_t)FLB_WORK_BYTES + 256)

typedef struct {
    void *stream;
    fl_cu_blas blas;       /* real build: the cuBLASLt handle (stand-in: unused) */
    void *scratch;         /* lent by the caller (set_scratch), or own_scratch */
    void *own_scratch;     /* allocated on first use when nothing is lent */
    size_t scratch_lent;   /* bytes lent with scratch (beyond FLB_SCRATCH_BYTES: attn_scratch_bytes' region) */
    double *scalars;       /* device: [0] sumsq result, [1..PARTS] partials; int flag after; the step scalars
                            * (FL_SS_MAX doubles, step_scalars) after that */
    fl_dtype compute;      /* set_compute_dtype: FL_BF16 = tensor-core attention where it applies */
    int attn;              /* FITLLM_CUDA_ATTN: fl_cudnn_attn_choice (cudnn-impl.h; cuda-work-ops-impl.h) */
    int epi;               /* FITLLM_CUDA_EPILOGUE (1 default); 0 after a refusal, | 2 / 4 after a bf16 bias's / D's */
    int det;               /* FITLLM_CUDA_DETERMINISTIC=1: the fa2 backward's dq in key-block order, no cuDNN backward */
    int fa2_bk;            /* FITLLM_CUDA_FA2_BK: 128 FL_CU_FA2_BK128, 64 FL_CU_FA2_BK64, unset 0 (fa2's own choice) */
    struct flb_cudnn *dnn; /* cuDNN's attention (the plugin, when it loaded: cuda-cudnn-impl.h), else NULL */
    fl_status err;         /* sticky: the first failure */
    char errmsg[384];
    char devname[256];     /* be->device_name */
    void **marks;          /* FL_PROF_MAX_MARKS markers, made on first use (profiling only) */
    fl_cu_counters count;  /* host round trips (FLB_PREFIX(backend_counters)) */
    flb_stage stage;       /* the page-locked ring of small uploads (cuda-stage-impl.h) */
    flb_graph graph;       /* FITLLM_CUDA_GRAPHS=1: the step's CUDA graphs (cuda-graph-impl.h) */
    flb_input in;          /* the input slots and the second stream (cuda-input-impl.h) */
    int ss_on;             /* FITLLM_CUDA_STEP_SCALARS (1 default): the step scalars' slots (backend.h) */
    int q4;                /* FITLLM_CUDA_Q4: a bf16 run's 4-bit matmuls (FLB_Q4_*, cuda-work-ops-impl.h; default scratch) */
    int q4_stack;          /* FITLLM_CUDA_Q4_STACK: scratch multiplies a fused output's 4-bit parts stacked (1) or one
                            * GEMM a part (0, A/B) */
} flb_impl;

#define FLB_IMPL(be) ((flb_impl *)(be)->impl)
enum { FLB_Q4_FP32 = 0, FLB_Q4_TC = 1, FLB_Q4_SCRATCH = 2 }; /* flb_impl.q4 */

static int flb_float3(fl_dtype t) { return t == FL_F32 || t == FL_BF16 || t == FL_F16; }

static void flb_set_error(const fl_backend *be, fl_status s, const char *op, const char *why) {
    flb_impl *im = FLB_IMPL(be);
    if (im->err != FL_OK) return;
    im->err = s;
    snprintf(im->errmsg, sizeof im->errmsg, "%s backend: %s: %s", FLB_NAME, op, why);
}
static fl_status flb_sticky(const fl_backend *be) {
    flb_impl *im = FLB_IMPL(be);
    if (im->err == FL_OK) return FL_OK;
    return fl_errorf(im->err, "%s", im->errmsg);
}
/* refused when a copy on the second stream is still to write p (cuda-input-ops-impl.h) */
static fl_status flb_in_check(const fl_backend *be, const void *p, const char *op);
/* A launcher's return: 0 ok, -1 bad arguments (types), else the CUDA / emulator error. */
static int flb_launch(const fl_backend *be, int rc, const char *op) {
    if (rc == 0) return 0;
    char why[256];
    if (rc == -1) snprintf(why, sizeof why, "unsupported arguments (dtype or shape)");
    else snprintf(why, sizeof why, "kernel launch failed: %s", flb_last_error(rc));
    flb_set_error(be, rc == -1 ? FL_ERR_UNSUPPORTED : FL_ERR_IO, op, why);
    return rc;
}
#define FLB_RUN(be, call, op) flb_launch((be), (call), (op))
/* A NULL tensor where the op reads or writes one: the sticky error, no launch (issue 30 item 1: a stored slot's fp32
 * view that was not carved is NULL, acts.c; an op that still reads or writes it fails here instead of touching
 * memory). 1: NULL found. */
static int flb_null(const fl_backend *be, const char *op, const void *const *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!p[i]) {
            flb_set_error(be, FL_ERR_INVALID, op, "a NULL tensor (an fp32 view that was not carved?)");
            return 1;
        }
    return 0;
}
#define FLB_NULL(be, op, ...)                                                                                        \
    flb_null((be), (op), (const void *const[]){__VA_ARGS__}, sizeof((const void *const[]){__VA_ARGS__}) / sizeof(void *))
#define FLB_RUN_S(be, call, op)                                                                                      \
    do {                                                                                                             \
        if (flb_launch((be), (call), (op))) return flb_sticky(be);                                                  \
    } while (0)

/* The op scratch, 256-byte aligned (cuBLASLt rejects a workspace of lesser alignment with
 * INVALID_VALUE; the model lends a region of its arena aligned to 64). */
static void *flb_scratch(const fl_backend *be) {
    flb_impl *im = FLB_IMPL(be);
    char *s = (char *)im->scratch;
    if (!s) {
        if (!im->own_scratch) im->own_scratch = flb_dev_alloc(FLB_SCRATCH_BYTES);
        if (!im->own_scratch) flb_set_error(be, FL_ERR_OOM, "scratch", "cannot allocate the op scratch");
        s = (char *)im->own_scratch;
    }
    if (!s) return NULL;
    return (void *)(((uintptr_t)s + 255) & ~(uintptr_t)255);
}

/* ============================== GEMM ============================== */

static int flb_gemm_types_ok(fl_dtype ta, fl_dtype tb, fl_dtype tc) { return fl_cuda_supports_op(FL_OP_GEMM, ta, tb, tc); }

/* The cuBLASLt context with its workspace (the scratch's head) and stream; NULL: no scratch (the sticky error). */
static fl_cu_blas *flb_blas(const fl_backend *be) {
    flb_impl *im = FLB_IMPL(be);
    void *s = flb_scratch(be);
    if (!s) return NULL;
    im->blas.workspace = FLB_LT_WS_BYTES ? s : NULL;
    im->blas.workspace_bytes = FLB_LT_WS_BYTES;
    im->blas.stream = im->stream;
    return &im->blas;
}

static fl_status flb_gemm_direct(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                                 const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                                 void *C, fl_dtype tc, int ldc) {
    fl_cu_blas *ctx = flb_blas(be);
    if (!ctx) return flb_sticky(be);
    fl_status st = fl_cu_gemm_rowmajor(flb_gemm_fn, ctx, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb,
                                       beta, C, tc, ldc, 1, 0, 0, 0);
    if (st != FL_OK) flb_set_error(be, st, "gemm", fl_error_message());
    return st;
}

static fl_status flb_gemm(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                          const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C,
                          fl_dtype tc, int ldc) {
    FL_TRY(flb_sticky(be));
    if (!flb_gemm_types_ok(ta, tb, tc))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm: types A=%s B=%s C=%s not supported", FLB_NAME,
                         fl_dtype_name(ta), fl_dtype_name(tb), fl_dtype_name(tc));
    if (M < 0 || N < 0 || K < 0) return fl_errorf(FL_ERR_INVALID, "%s gemm: bad shape %d x %d x %d", FLB_NAME, M, N, K);
    if (M == 0 || N == 0) return FL_OK;
    if (FLB_NULL(be, "gemm", C) || (K > 0 && FLB_NULL(be, "gemm", A, B))) return flb_sticky(be);
    void *s = flb_scratch(be);
    if (!s) return flb_sticky(be);
    char *panel = (char *)s + FLB_LT_WS_BYTES;
    const size_t pb = FLB_PANEL_BYTES;
    if (K == 0) { /* C = beta * C (nothing to multiply; the libraries disagree on k = 0) */
        if (tc == FL_F32) {
            FLB_RUN_S(be, FLB_K(scale2d)((float *)C, (size_t)ldc, M, N, beta, FLB_IMPL(be)->stream), "gemm (K = 0)");
            return FL_OK;
        }
        /* bf16 C: widened, scaled in fp32, rounded once (the CPU's order), a panel of rows at a time */
        int rows = (int)(pb / ((size_t)N * 4));
        if (rows < 1) return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm: N = %d too large for the panel", FLB_NAME, N);
        for (int i0 = 0; i0 < M; i0 += rows) {
            int mr = M - i0 < rows ? M - i0 : rows;
            uint16_t *Ci = (uint16_t *)C + (size_t)i0 * ldc;
            FLB_RUN_S(be, FLB_K(convert2d)(panel, FL_F32, (size_t)N, Ci, tc, (size_t)ldc, mr, N, FLB_IMPL(be)->stream),
                      "gemm (K = 0)");
            FLB_RUN_S(be, FLB_K(scale2d)((float *)panel, (size_t)N, mr, N, beta, FLB_IMPL(be)->stream), "gemm (K = 0)");
            FLB_RUN_S(be, FLB_K(convert2d)(Ci, tc, (size_t)ldc, panel, FL_F32, (size_t)N, mr, N, FLB_IMPL(be)->stream),
                      "gemm (K = 0)");
        }
        return FL_OK;
    }
    if (tc != FL_F32 && beta != 0.0f) FLB_IMPL(be)->count.gemm_acc16++; /* FL_OP_GEMM_ACC16 */
    if (ta == tb) /* the library's own types: (F32, F32), (BF16, BF16), (F16, F16) */
        return flb_gemm_direct(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
    if (ta == FL_F32 && tb == FL_BF16) {
        /* A rounded to bf16 (RNE) a panel at a time, then a bf16 x bf16 -> fp32 GEMM: the CPU's
         * semantics (an F32 A is rounded to bf16 first; products exact, fp32 accumulation). */
        if (!trans_a) { /* A (M, K): panels of rows of A = rows of C */
            int rows = fl_cu_gemm_panel_rows(M, (int)(pb / ((size_t)K * 2)));
            if (rows < 1) return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm: K = %d too large for the panel", FLB_NAME, K);
            for (int i0 = 0; i0 < M; i0 += rows) {
                int mr = M - i0 < rows ? M - i0 : rows;
                FLB_RUN_S(be, FLB_K(convert2d)(panel, FL_BF16, (size_t)K, (const float *)A + (size_t)i0 * lda, FL_F32,
                                               (size_t)lda, mr, K, FLB_IMPL(be)->stream), "gemm (bf16 panel)");
                FL_TRY(flb_gemm_direct(be, 0, trans_b, mr, N, K, alpha, panel, FL_BF16, K, B, tb, ldb, beta,
                                       (float *)C + (size_t)i0 * ldc, tc, ldc));
            }
        } else { /* A stored (K, M): panels over K, accumulated into C */
            int kr_max = fl_cu_gemm_panel_rows(K, (int)(pb / ((size_t)M * 2))); /* aligned offsets k0 */
            if (kr_max < 1) return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm: M = %d too large for the panel", FLB_NAME, M);
            for (int k0 = 0; k0 < K; k0 += kr_max) {
                int kr = K - k0 < kr_max ? K - k0 : kr_max;
                FLB_RUN_S(be, FLB_K(convert2d)(panel, FL_BF16, (size_t)M, (const float *)A + (size_t)k0 * lda, FL_F32,
                                               (size_t)lda, kr, M, FLB_IMPL(be)->stream), "gemm (bf16 panel)");
                const uint16_t *Bk = (const uint16_t *)B + (trans_b ? (size_t)k0 : (size_t)k0 * ldb);
                FL_TRY(flb_gemm_direct(be, 1, trans_b, M, N, kr, alpha, panel, FL_BF16, M, Bk, tb, ldb,
                                       k0 ? 1.0f : beta, C, tc, ldc));
            }
        }
        return FL_OK;
    }
    /* (F32, F16, F32): B widened exactly to fp32 a panel at a time, then an fp32 GEMM */
    if (trans_b) { /* B stored (N, K): panels of rows of B = columns of C */
        int rows = fl_cu_gemm_panel_rows(N, (int)(pb / ((size_t)K * 4))); /* C + j0 aligned */
        if (rows < 1) return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm: K = %d too large for the panel", FLB_NAME, K);
        for (int j0 = 0; j0 < N; j0 += rows) {
            int nr = N - j0 < rows ? N - j0 : rows;
            FLB_RUN_S(be, FLB_K(convert2d)(panel, FL_F32, (size_t)K, (const uint16_t *)B + (size_t)j0 * ldb, FL_F16,
                                           (size_t)ldb, nr, K, FLB_IMPL(be)->stream), "gemm (f16 panel)");
            FL_TRY(flb_gemm_direct(be, trans_a, 1, M, nr, K, alpha, A, FL_F32, lda, panel, FL_F32, K, beta,
                                   (float *)C + j0, tc, ldc));
        }
    } else { /* B stored (K, N): panels over K, accumulated */
        int kr_max = fl_cu_gemm_panel_rows(K, (int)(pb / ((size_t)N * 4))); /* A + k0 aligned */
        if (kr_max < 1) return fl_errorf(FL_ERR_UNSUPPORTED, "%s gemm: N = %d too large for the panel", FLB_NAME, N);
        for (int k0 = 0; k0 < K; k0 += kr_max) {
            int kr = K - k0 < kr_max ? K - k0 : kr_max;
            FLB_RUN_S(be, FLB_K(convert2d)(panel, FL_F32, (size_t)N, (const uint16_t *)B + (size_t)k0 * ldb, FL_F16,
                                           (size_t)ldb, kr, N, FLB_IMPL(be)->stream), "gemm (f16 panel)");
            const float *Ak = (const float *)A + (trans_a ? (size_t)k0 * lda : (size_t)k0);
            FL_TRY(flb_gemm_direct(be, trans_a, 0, M, N, kr, alpha, Ak, FL_F32, lda, panel, FL_F32, N,
                                   k0 ? 1.0f : beta, C, tc, ldc));
        }
    }
    return FL_OK;
}

#include "backend/cuda/cuda-gemm-more-impl.h" /* gemm_epilogue, gemm_bench */

/* ============================== ops over the kernels ============================== */
#define STREAM (FLB_IMPL(be)->stream)

static void flb_rmsnorm_forward(const fl_backend *be, float *out, float *rstd, const float *inp, const float *w, int N,
                                int C, float eps) {
    if (N > 0 && FLB_NULL(be, "rmsnorm_forward", out, inp)) return;
    FLB_RUN(be, FLB_K(rmsnorm_forward)(out, rstd, inp, w, N, C, eps, STREAM), "rmsnorm_forward");
}
static fl_status flb_add_rmsnorm_forward(const fl_backend *be, void *res, void *out, float *rstd, const void *a,
                                         const void *b, const float *w, fl_dtype t, int N, int C, float eps) {
    FL_TRY(flb_sticky(be));
    if (t != FL_F32)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s add_rmsnorm_forward: %s activations not supported", FLB_NAME,
                         fl_dtype_name(t));
    if (N < 0 || C <= 0) return fl_errorf(FL_ERR_INVALID, "%s add_rmsnorm_forward: bad shape %d x %d", FLB_NAME, N, C);
    FLB_RUN_S(be, FLB_K(add_rmsnorm_forward)((float *)res, (float *)out, rstd, (const float *)a, (const float *)b, w, N,
                                             C, eps, STREAM), "add_rmsnorm_forward");
    return FL_OK;
}
static void flb_rmsnorm_backward(const fl_backend *be, float *dinp, float *dw, const float *dout, const float *inp,
                                 const float *w, const float *rstd, int N, int C) {
    FLB_RUN(be, FLB_K(rmsnorm_backward)(dinp, dw, dout, inp, w, rstd, N, C, FLB_NWORK(be, "rmsnorm_backward"), STREAM), "rmsnorm_backward");
}
static void flb_rmsnorm_forward_w16(const fl_backend *be, float *out, void *out16, float *rstd, const float *inp,
                                    const void *w, fl_dtype wt, int N, int C, float eps) {
    if (N > 0 && FLB_NULL(be, "rmsnorm_forward_w16", out ? (const void *)out : out16, inp)) return;
    FLB_RUN(be, FLB_K(rmsnorm_forward_w16)(out, out16, rstd, inp, w, wt, N, C, eps, STREAM), "rmsnorm_forward_w16");
}
static void flb_rmsnorm_backward_w16(const fl_backend *be, float *dinp, void *dinp16, float *dw, const float *dout,
                                     const float *inp, const void *inp16, const void *w, fl_dtype wt,
                                     const float *rstd, int N, int C) {
    FLB_RUN(be, FLB_K(rmsnorm_backward_w16)(dinp, dinp16, dw, dout, inp, inp16, w, wt, rstd, N, C,
                                            FLB_NWORK(be, "rmsnorm_backward_w16"), STREAM),
            "rmsnorm_backward_w16");
}
static void flb_layernorm_forward(const fl_backend *be, float *out, float *mean, float *rstd, const float *inp,
                                  const float *w, const float *b, int N, int C, float eps) {
    if (N > 0 && FLB_NULL(be, "layernorm_forward", out, inp)) return;
    FLB_RUN(be, FLB_K(layernorm_forward)(out, mean, rstd, inp, w, b, N, C, eps, STREAM), "layernorm_forward");
}
static void flb_layernorm_backward(const fl_backend *be, float *dinp, float *dw, float *db, const float *dout,
                                   const float *inp, const float *w, const float *mean, const float *rstd, int N,
                                   int C) {
    FLB_RUN(be, FLB_K(layernorm_backward)(dinp, dw, db, dout, inp, w, mean, rstd, N, C, FLB_NWORK(be, "layernorm_backward"),
                                          STREAM),
            "layernorm_backward");
}
static void flb_layernorm_forward_w16(const fl_backend *be, float *out, void *out16, float *mean, float *rstd,
                                      const float *inp, const void *w, const void *b, fl_dtype wt, int N, int C,
                                      float eps) {
    if (N > 0 && FLB_NULL(be, "layernorm_forward_w16", out ? (const void *)out : out16, inp)) return;
    FLB_RUN(be, FLB_K(layernorm_forward_w16)(out, out16, mean, rstd, inp, w, b, wt, N, C, eps, STREAM),
            "layernorm_forward_w16");
}
static void flb_layernorm_backward_w16(const fl_backend *be, float *dinp, void *dinp16, float *dw, float *db,
                                       const float *dout, const float *inp, const void *inp16, const void *w,
                                       fl_dtype wt, const float *mean, const float *rstd, int N, int C) {
    FLB_RUN(be, FLB_K(layernorm_backward_w16)(dinp, dinp16, dw, db, dout, inp, inp16, w, wt, mean, rstd, N, C,
                                              FLB_NWORK(be, "layernorm_backward_w16"), STREAM),
            "layernorm_backward_w16");
}
static void flb_rope_forward(const fl_backend *be, float *x, int B, int T, int nh, int HD, size_t row_stride,
                             const float *cos_t, const float *sin_t, int pos0) {
    if (B > 0 && T > 0 && FLB_NULL(be, "rope_forward", x)) return;
    FLB_RUN(be, FLB_K(rope)(x, B, T, nh, HD, row_stride, cos_t, sin_t, pos0, 0, STREAM), "rope_forward");
}
static void flb_rope_backward(const fl_backend *be, float *dx, int B, int T, int nh, int HD, size_t row_stride,
                              const float *cos_t, const float *sin_t, int pos0) {
    FLB_RUN(be, FLB_K(rope)(dx, B, T, nh, HD, row_stride, cos_t, sin_t, pos0, 1, STREAM), "rope_backward");
}
static void flb_swiglu_forward(const fl_backend *be, float *out, const float *gu, int N, int F) {
    if (N > 0 && F > 0 && FLB_NULL(be, "swiglu_forward", out, gu)) return;
    FLB_RUN(be, FLB_K(swiglu_forward)(out, gu, N, F, STREAM), "swiglu_forward");
}
static void flb_swiglu_backward(const fl_backend *be, float *dgu, const float *dout, const float *gu, int N, int F) {
    if (N > 0 && F > 0 && FLB_NULL(be, "swiglu_backward", dgu, dout, gu)) return;
    FLB_RUN(be, FLB_K(swiglu_backward)(dgu, dout, gu, N, F, STREAM), "swiglu_backward");
}
static void flb_gelu_forward(const fl_backend *be, float *out, const float *inp, size_t n) {
    if (n && FLB_NULL(be, "gelu_forward", out, inp)) return;
    FLB_RUN(be, FLB_K(gelu_forward)(out, inp, n, STREAM), "gelu_forward");
}
static void flb_gelu_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n) {
    if (n && FLB_NULL(be, "gelu_backward", dinp, dout, inp)) return;
    FLB_RUN(be, FLB_K(gelu_backward)(dinp, dout, inp, n, STREAM), "gelu_backward");
}
static void flb_geglu_forward(const fl_backend *be, float *out, const float *gu, int N, int F) {
    FLB_RUN(be, FLB_K(geglu_forward)(out, gu, N, F, STREAM), "geglu_forward");
}
static void flb_geglu_backward(const fl_backend *be, float *dgu, const float *dout, const float *gu, int N, int F) {
    FLB_RUN(be, FLB_K(geglu_backward)(dgu, dout, gu, N, F, STREAM), "geglu_backward");
}
static void flb_relu_forward(const fl_backend *be, float *out, const float *inp, size_t n) {
    if (n && FLB_NULL(be, "relu_forward", out, inp)) return;
    FLB_RUN(be, FLB_K(relu_forward)(out, inp, n, STREAM), "relu_forward");
}
static void flb_relu_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n) {
    if (n && FLB_NULL(be, "relu_backward", dinp, dout, inp)) return;
    FLB_RUN(be, FLB_K(relu_backward)(dinp, dout, inp, n, STREAM), "relu_backward");
}
static void flb_gelu_erf_forward(const fl_backend *be, float *out, const float *inp, size_t n) {
    FLB_RUN(be, FLB_K(gelu_erf_forward)(out, inp, n, STREAM), "gelu_erf_forward");
}
static void flb_gelu_erf_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n) {
    FLB_RUN(be, FLB_K(gelu_erf_backward)(dinp, dout, inp, n, STREAM), "gelu_erf_backward");
}
static void flb_add(const fl_backend *be, float *out, const float *a, const float *b, size_t n) {
    if (n && FLB_NULL(be, "add", out, a, b)) return;
    FLB_RUN(be, FLB_K(add)(out, a, b, n, STREAM), "add");
}
static void flb_bias_forward(const fl_backend *be, float *y, const float *b, int N, int OC) {
    if (N > 0 && OC > 0 && FLB_NULL(be, "bias_forward", y, b)) return;
    FLB_RUN(be, FLB_K(bias_forward)(y, b, N, OC, STREAM), "bias_forward");
}
static void flb_bias_backward(const fl_backend *be, float *db, const float *dy, int N, int OC) {
    FLB_RUN(be, FLB_K(bias_backward)(db, dy, N, OC, FLB_NWORK(be, "bias_backward"), STREAM), "bias_backward");
}
static void flb_cross_entropy(const fl_backend *be, float *loss, float *dlogits, const float *logits,
                              const int32_t *targets, int N, int V, float grad_scale, int ignore_index) {
    if (flb_in_check(be, targets, "cross_entropy")) return;
    FLB_RUN(be, FLB_K(cross_entropy)(loss, dlogits, logits, targets, N, V, grad_scale, ignore_index,
                                     FLB_NWORK(be, "cross_entropy"), STREAM),
            "cross_entropy");
}
static fl_status flb_cross_entropy_dbf16(const fl_backend *be, float *loss, void *dlogits16, const float *logits,
                                         const int32_t *targets, int N, int V, int ld, float grad_scale,
                                         int ignore_index) {
    FL_TRY(flb_sticky(be));
    FL_TRY(flb_in_check(be, targets, "cross_entropy_dbf16"));
    if (ld < V)
        return fl_errorf(FL_ERR_INVALID, "%s cross_entropy_dbf16: row stride %d below the vocabulary %d", FLB_NAME, ld, V);
    FLB_RUN_S(be, FLB_K(cross_entropy_dbf16)(loss, dlogits16, logits, targets, N, V, ld, grad_scale, ignore_index,
                                             FLB_NWORK(be, "cross_entropy_dbf16"), STREAM),
              "cross_entropy_dbf16");
    return FL_OK;
}
static double flb_sumsq(const fl_backend *be, const void *x, fl_dtype t, size_t n) {
    const char *op = "sumsq";
    flb_impl *im = FLB_IMPL(be);
    double r = 0;
    if (flb_graph_flush(&im->graph, be) != FL_OK) return NAN;
    if (FLB_RUN(be, FLB_K(sumsq_ex)(im->scalars, im->scalars + 1, x, t, n, STREAM), op)) return NAN;
    im->count.d2h++;
    if (flb_d2h(&r, im->scalars, sizeof r, im->stream)) {
        flb_set_error(be, FL_ERR_IO, op, "copying the result to the host failed");
        return NAN;
    }
    return r;
}
/* ---- the step scalars (backend.h; issue 30 item 5): after the sumsq partials and the found-inf flag ---- */
#define FLB_SCALARS (2 + FL_CU_SUMSQ_PARTS + FL_SS_MAX)
static double *flb_step_scalars(const fl_backend *be, int n) {
    return n >= 0 && n <= FL_SS_MAX ? FLB_IMPL(be)->scalars + 2 + FL_CU_SUMSQ_PARTS : NULL;
}
/* dscale (device, or NULL: scale): the scale read when the kernels run (a CUDA graph's per-step slot) */
static fl_status flb_grad_norm_dev_s(const fl_backend *be, const void *g, fl_dtype tg, size_t n, float max_norm,
                                     float scale, int n_loss, double *ss, const float *dscale) {
    FL_TRY(flb_sticky(be));
    if (!flb_float3(tg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s grad_norm_dev: %s not supported", FLB_NAME, fl_dtype_name(tg));
    flb_impl *im = FLB_IMPL(be);
    FLB_RUN_S(be, FLB_K(sumsq_ex)(im->scalars, im->scalars + 1, g, tg, n, STREAM), "grad_norm_dev");
    if (n_loss < 0 || n_loss > FL_SS_MAX - FL_SS_LOSS)
        return fl_errorf(FL_ERR_INVALID, "%s grad_norm_dev: %d loss sums", FLB_NAME, n_loss);
    FLB_RUN_S(be, FLB_K(clip_scale)(ss, im->scalars, max_norm, scale, dscale, n_loss, STREAM), "grad_norm_dev");
    return FL_OK;
}
static fl_status flb_grad_norm_dev(const fl_backend *be, const void *g, fl_dtype tg, size_t n, float max_norm,
                                   float scale, int n_loss, double *ss) {
    return flb_grad_norm_dev_s(be, g, tg, n, max_norm, scale, n_loss, ss, NULL);
}
_Static_assert(FL_CU_SS_FOUND == FL_SS_FOUND && FL_CU_SS_LOSS == FL_SS_LOSS, "the step scalars' layout");
static fl_status flb_check_finite_dev_s(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                                        double *ss, const float *dinv) {
    FL_TRY(flb_sticky(be));
    if (!flb_float3(t))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s check_finite_dev: %s not supported", FLB_NAME, fl_dtype_name(t));
    FLB_RUN_S(be, FLB_K(check_finite_ss)(x, t, n, inv_scale, dinv, ss, STREAM), "check_finite_dev");
    return FL_OK;
}
static fl_status flb_check_finite_dev(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                                      double *ss) {
    return flb_check_finite_dev_s(be, x, t, n, inv_scale, ss, NULL);
}
static fl_status flb_loss_sum_dev(const fl_backend *be, const float *loss, const int32_t *targets, int N,
                                  int ignore_index, double *acc) {
    FL_TRY(flb_sticky(be));
    FL_TRY(flb_in_check(be, targets, "loss_sum_dev"));
    FLB_RUN_S(be, FLB_K(loss_sum)(acc, loss, targets, N, ignore_index, STREAM), "loss_sum_dev");
    return FL_OK;
}
static fl_status flb_adamw_update_ss(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m,
                                     void *v, fl_dtype ts, size_t n, float lr, float beta1, float beta2, float eps,
                                     float weight_decay, int step, const double *ss) {
    FL_TRY(flb_sticky(be));
    if (!flb_float3(tp) || !flb_float3(tg) || (ts != FL_F32 && ts != FL_BF16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s adamw_update_ss: p %s, g %s, state %s not supported", FLB_NAME,
                         fl_dtype_name(tp), fl_dtype_name(tg), fl_dtype_name(ts));
    FLB_RUN_S(be, FLB_K(adamw_update_ss)(p, tp, g, tg, m, v, ts, n, lr, beta1, beta2, eps, weight_decay, step, ss,
                                         STREAM), "adamw_update_ss");
    return FL_OK;
}
static fl_status flb_sgd_update_ss(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf,
                                   fl_dtype ts, size_t n, float lr, float momentum, float dampening,
                                   float weight_decay, int nesterov, int first_step, const double *ss) {
    FL_TRY(flb_sticky(be));
    if (!flb_float3(tp) || !flb_float3(tg) || (ts != FL_F32 && ts != FL_BF16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s sgd_update_ss: p %s, g %s, state %s not supported", FLB_NAME,
                         fl_dtype_name(tp), fl_dtype_name(tg), fl_dtype_name(ts));
    FLB_RUN_S(be, FLB_K(sgd_update_ss)(p, tp, g, tg, buf, ts, n, lr, momentum, dampening, weight_decay, nesterov,
                                       first_step, ss, STREAM), "sgd_update_ss");
    return FL_OK;
}
static void flb_scale(const fl_backend *be, float *x, size_t n, float s) {
    FLB_RUN(be, FLB_K(scale)(x, n, s, STREAM), "scale");
}
static fl_status flb_init_random(const fl_backend *be, void *dst, fl_dtype dt, size_t k0, size_t k1, size_t numel,
                                 int kind, double sd, uint64_t s) {
    (void)numel; /* every element is a function of its index alone */
    FL_TRY(flb_sticky(be));
    if (!flb_float3(dt))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s init_random: %s not supported", FLB_NAME, fl_dtype_name(dt));
    if (k1 > k0) FLB_RUN_S(be, FLB_K(init_random)(dst, dt, k0, k1 - k0, kind, sd, s, STREAM), "init_random");
    return FL_OK;
}
static void flb_zero(const fl_backend *be, void *x, size_t bytes) {
    FLB_IMPL(be)->count.zero_bytes += (long)bytes;
    if (bytes && flb_memset(x, 0, bytes, STREAM)) flb_set_error(be, FL_ERR_IO, "zero", "memset failed");
}
#include "backend/cuda/cuda-bf16-ops-impl.h" /* convert, round16, convert_many, the bf16-stored outputs */
static fl_status flb_adamw_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m,
                                     void *v, fl_dtype ts, size_t n, float lr, float beta1, float beta2, float eps,
                                     float weight_decay, int step, float grad_scale) {
    FL_TRY(flb_sticky(be));
    if (!flb_float3(tp) || !flb_float3(tg) || (ts != FL_F32 && ts != FL_BF16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s adamw_update: p %s, g %s, state %s not supported", FLB_NAME,
                         fl_dtype_name(tp), fl_dtype_name(tg), fl_dtype_name(ts));
    FLB_RUN_S(be, FLB_K(adamw_update_ex)(p, tp, g, tg, m, v, ts, n, lr, beta1, beta2, eps, weight_decay, step,
                                         grad_scale, STREAM), "adamw_update");
    return FL_OK;
}
static fl_status flb_sgd_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf,
                                   fl_dtype ts, size_t n, float lr, float momentum, float dampening,
                                   float weight_decay, int nesterov, int first_step, float grad_scale) {
    FL_TRY(flb_sticky(be));
    if (!flb_float3(tp) || !flb_float3(tg) || (ts != FL_F32 && ts != FL_BF16))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s sgd_update: p %s, g %s, state %s not supported", FLB_NAME,
                         fl_dtype_name(tp), fl_dtype_name(tg), fl_dtype_name(ts));
    FLB_RUN_S(be, FLB_K(sgd_update_ex)(p, tp, g, tg, buf, ts, n, lr, momentum, dampening, weight_decay, nesterov,
                                       first_step, grad_scale, STREAM), "sgd_update");
    return FL_OK;
}
static fl_status flb_check_finite(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                                  int *found_inf) {
    FL_TRY(flb_sticky(be));
    if (!flb_float3(t))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s check_finite: %s not supported", FLB_NAME, fl_dtype_name(t));
    flb_impl *im = FLB_IMPL(be);
    FL_TRY(flb_graph_flush(&im->graph, be));
    int *dflag = (int *)(im->scalars + 1 + FL_CU_SUMSQ_PARTS), h = *found_inf ? 1 : 0;
    im->count.h2d++;
    im->count.d2h++;
    if (flb_h2d(dflag, &h, sizeof h, im->stream)) return fl_errorf(FL_ERR_IO, "%s check_finite: copy failed", FLB_NAME);
    FLB_RUN_S(be, FLB_K(check_finite)(x, t, n, inv_scale, dflag, STREAM), "check_finite");
    if (flb_d2h(&h, dflag, sizeof h, im->stream)) return fl_errorf(FL_ERR_IO, "%s check_finite: copy failed", FLB_NAME);
    if (h) *found_inf = 1;
    return FL_OK;
}
static fl_status flb_accumulate16(const fl_backend *be, uint16_t *dst, fl_dtype t, const float *src, size_t n) {
    FL_TRY(flb_sticky(be));
    if (t != FL_BF16 && t != FL_F16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s accumulate16: %s not supported", FLB_NAME, fl_dtype_name(t));
    FLB_IMPL(be)->count.acc16_bytes += (long)(n * sizeof(float));
    FLB_RUN_S(be, FLB_K(accumulate16)(dst, t, src, n, STREAM), "accumulate16");
    return FL_OK;
}

/* The ops whose kernels live in cu_kernels_attn.h and cu_kernels_train.h. */
#include "backend/cuda/cuda-work-ops-impl.h"

#include "backend/cuda/cuda-lora-ops-impl.h" /* lora_forward / lora_backward, dropout */
#include "backend/cuda/cuda-tp-ops-impl.h" /* dropout_rows, vocab_stats, vocab_xent */
/* ============================== profiling markers ============================== */

/* Marker i recorded on the stream (made on first use: a profiled step needs ~2 per op). */
static fl_status flb_mark(const fl_backend *be, int i) {
    flb_impl *im = FLB_IMPL(be);
    if (i < 0 || i >= FL_PROF_MAX_MARKS)
        return fl_errorf(FL_ERR_INVALID, "%s mark: marker %d outside [0, %d)", FLB_NAME, i, FL_PROF_MAX_MARKS);
    if (!im->marks && !(im->marks = (void **)calloc(FL_PROF_MAX_MARKS, sizeof *im->marks)))
        return fl_errorf(FL_ERR_OOM, "%s mark: out of host memory", FLB_NAME);
    if (!im->marks[i] && flb_mark_new(&im->marks[i]))
        return fl_errorf(FL_ERR_IO, "%s mark: cannot create marker %d", FLB_NAME, i);
    FL_TRY(flb_graph_flush(&im->graph, be)); /* with FITLLM_CUDA_GRAPHS=1: a marker between graphs, never inside */
    if (flb_mark_record(im->marks[i], STREAM)) return fl_errorf(FL_ERR_IO, "%s mark: recording marker %d failed", FLB_NAME, i);
    return FL_OK;
}
static fl_status flb_mark_ms(const fl_backend *be, int i, int j, float *ms) {
    flb_impl *im = FLB_IMPL(be);
    *ms = 0;
    if (!im->marks || i < 0 || j < 0 || i >= FL_PROF_MAX_MARKS || j >= FL_PROF_MAX_MARKS || !im->marks[i] || !im->marks[j])
        return fl_errorf(FL_ERR_INVALID, "%s mark_ms: markers %d and %d were not recorded", FLB_NAME, i, j);
    if (flb_mark_elapsed(im->marks[i], im->marks[j], ms))
        return fl_errorf(FL_ERR_IO, "%s mark_ms: reading markers %d and %d failed", FLB_NAME, i, j);
    return FL_OK;
}

/* ============================== memory and the rest ============================== */

static void flb_set_scratch(const fl_backend *be, void *p, size_t bytes) {
    flb_impl *im = FLB_IMPL(be);
    im->scratch = (p && bytes >= FLB_SCRATCH_BYTES) ? p : NULL;
    im->scratch_lent = im->scratch ? bytes : 0;
}
static void flb_set_compute_dtype(const fl_backend *be, fl_dtype t) { FLB_IMPL(be)->compute = t; }
static fl_status flb_to_device(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    FL_TRY(flb_sticky(be));
    flb_impl *im = FLB_IMPL(be);
    FL_TRY(flb_graph_flush(&im->graph, be)); /* a direct call (set-up) inside a segment */
    im->count.h2d += bytes > 0;
    if (bytes && flb_stage_copy(&im->stage, &im->count, dst, src, bytes, STREAM))
        return fl_errorf(FL_ERR_IO, "%s to_device: copy of %zu bytes failed", FLB_NAME, bytes);
    return FL_OK;
}
#include "backend/cuda/cuda-input-ops-impl.h" /* input_slots, input_upload, input_wait */
static fl_status flb_to_host(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    FL_TRY(flb_sticky(be));
    FL_TRY(flb_graph_flush(&FLB_IMPL(be)->graph, be)); /* the graphs before it have run */
    FLB_IMPL(be)->count.d2h += bytes > 0;
    if (bytes && flb_d2h(dst, src, bytes, STREAM))
        return fl_errorf(FL_ERR_IO, "%s to_host: copy of %zu bytes failed", FLB_NAME, bytes);
    return flb_sticky(be);
}
static fl_status flb_copy(const fl_backend *be, void *dst, const void *src, size_t bytes) {
    FL_TRY(flb_sticky(be));
    if (bytes && flb_d2d(dst, src, bytes, STREAM))
        return fl_errorf(FL_ERR_IO, "%s copy: device copy of %zu bytes failed", FLB_NAME, bytes);
    return FL_OK;
}
static fl_status flb_sync(const fl_backend *be) {
    FL_TRY(flb_graph_flush(&FLB_IMPL(be)->graph, be));
    FLB_IMPL(be)->count.sync++;
    int rc = flb_stream_sync(STREAM);
    if (rc) flb_set_error(be, FL_ERR_IO, "sync", flb_last_error(rc));
    return flb_sticky(be);
}
static int flb_supports_op(const fl_backend *be, fl_op op, fl_dtype a, fl_dtype b, fl_dtype c) {
    (void)be;
    return fl_cuda_supports_op(op, a, b, c); /* one table (backend_cuda.c), which the planner reads too */
}
static fl_status flb_rope_tables(const fl_backend *be, float *cos_t, float *sin_t, int maxT, int HD, float theta,
                                 const fl_rope_scaling *scaling) {
    FL_TRY(flb_sticky(be));
    size_t n = (size_t)maxT * (size_t)(HD / 2);
    float *h = (float *)malloc(2 * n * sizeof(float) + 1); /* set-up only: 8 * maxT * HD/2 bytes */
    if (!h) return fl_errorf(FL_ERR_OOM, "%s rope_tables: no host memory for %zu values", FLB_NAME, 2 * n);
    fl_rope_table_init(h, h + n, maxT, HD, theta, scaling);
    fl_status s = flb_to_device(be, cos_t, h, n * sizeof(float));
    if (s == FL_OK) s = flb_to_device(be, sin_t, h + n, n * sizeof(float));
    if (s == FL_OK) s = flb_sync(be); /* the host buffer is freed next */
    free(h);
    return s;
}

static void *flb_pool_raw_alloc(size_t bytes, void *ud) {
    (void)ud;
    return flb_dev_alloc(bytes ? bytes : 1);
}
static void flb_pool_raw_free(void *ptr, size_t bytes, void *ud) {
    (void)bytes; (void)ud;
    flb_dev_free(ptr);
}
static fl_status flb_pool_init(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget) {
    (void)be;
    return fl_mem_pool_init_raw(p, name, FL_DEV_CUDA, budget, flb_pool_raw_alloc, flb_pool_raw_free, NULL);
}
/* the host tier of an offloaded run: page-locked host memory (flb_host_alloc), which the copies reach
 * at the link's speed */
static void *flb_host_raw_alloc(size_t bytes, void *ud) {
    (void)ud;
    return flb_host_alloc(bytes ? bytes : 1);
}
static void flb_host_raw_free(void *ptr, size_t bytes, void *ud) {
    (void)bytes; (void)ud;
    flb_host_free(ptr);
}
static fl_status flb_host_pool_init(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget) {
    (void)be;
    return fl_mem_pool_init_raw(p, name, FL_DEV_CUDA_HOST, budget, flb_host_raw_alloc, flb_host_raw_free, NULL);
}

/* The collectives of several ranks run after the ops queued on this backend's stream. */
static fl_status flb_comm_create_be(const fl_backend *be, struct fl_comm *host, struct fl_comm **out) {
    *out = NULL;
    FL_TRY(flb_sticky(be));
    flb_graph *g = &FLB_IMPL(be)->graph;
    if (g->on) { /* the collectives are not captured */
        FL_TRY(flb_graph_flush(g, be));
        flb_graph_give_up(g, "several ranks (the collectives are not captured)");
    }
    return flb_comm_create(be, FLB_IMPL(be)->stream, host, out);
}

static fl_status flb_run_graph(const fl_backend *be, const fl_oprec *op) {
    return flb_graph_run(&FLB_IMPL(be)->graph, be, op);
}

fl_status FLB_PREFIX(backend_init)(fl_backend *be, int n_threads) {
    (void)n_threads;
    memset(be, 0, sizeof *be);
    flb_impl *im = (flb_impl *)calloc(1, sizeof *im);
    if (!im) return fl_errorf(FL_ERR_OOM, "%s backend: out of host memory", FLB_NAME);
    be->impl = im;
    fl_status s = flb_device_init(&im->stream, &im->blas);
    if (s != FL_OK) {
        free(im);
        be->impl = NULL;
        return s;
    }
    im->scalars = (double *)flb_dev_alloc(FLB_SCALARS * sizeof(double));
    if (!im->scalars) {
        flb_device_free(im->stream, &im->blas);
        free(im);
        be->impl = NULL;
        return fl_errorf(FL_ERR_OOM, "%s backend: cannot allocate %zu bytes of device memory", FLB_NAME,
                         FLB_SCALARS * sizeof(double));
    }
    const char *ea = getenv("FITLLM_CUDA_ATTN");
    im->attn = fl_cudnn_attn_parse(ea);
    const char *ed = getenv("FITLLM_CUDA_DETERMINISTIC");
    im->det = ed && *ed && strcmp(ed, "0") != 0;
    /* FITLLM_CUDA_FA2_BK=128: the own attention backward in blocks of 128 keys, 8 warps (half the dq atomics; A/B);
     * =64: 64 even for a padded head size (whose default is 128 where the device has the shared memory) */
    const char *ebk = getenv("FITLLM_CUDA_FA2_BK");
    im->fa2_bk = !ebk ? 0 : !strcmp(ebk, "128") ? FL_CU_FA2_BK128 : !strcmp(ebk, "64") ? FL_CU_FA2_BK64 : 0;
    /* FITLLM_CUDA_HEAD_DBF16=0: the LM head's loss gradient in fp32 then converted (the same bits; for A/B timing) */
    const char *eh = getenv("FITLLM_CUDA_HEAD_DBF16");
    const int head_dbf16 = !eh || !*eh || !strcmp(eh, "1");
    /* FITLLM_CUDA_EPILOGUE=0: a linear's bias and GELU as kernels after the GEMM (A/B timing; issue 30 item 3) */
    const char *ee = getenv("FITLLM_CUDA_EPILOGUE");
    im->epi = !ee || !*ee || !strcmp(ee, "1");
    /* FITLLM_CUDA_PINNED=0: the inputs' uploads straight from the caller's pageable memory (A/B) */
    const char *ep = getenv("FITLLM_CUDA_PINNED");
    im->stage.on = !ep || !*ep || !strcmp(ep, "1");
    /* FITLLM_CUDA_STEP_SCALARS=0: the step reads its gradient norm and losses on the host as before (A/B) */
    const char *ess = getenv("FITLLM_CUDA_STEP_SCALARS");
    im->ss_on = !ess || !*ess || !strcmp(ess, "1");
    /* FITLLM_CUDA_GRAPHS=1 (experimental): the door captures the step as CUDA graphs and replays it (cuda-graph-impl.h) */
    /* FITLLM_CUDA_PREFETCH=0: no input slots; the model uploads each micro-batch's inputs on the stream (A/B) */
    const char *epf = getenv("FITLLM_CUDA_PREFETCH");
    im->in.on = !epf || !*epf || !strcmp(epf, "1");
    const char *eg = getenv("FITLLM_CUDA_GRAPHS");
    im->graph.on = eg && !strcmp(eg, "1");
    /* FITLLM_CUDA_VIEWS32=1: every stored slot keeps its fp32 view, and every fp32 result nothing reads is written
     * (RoPE's, the backward's activation / RoPE gradients: fl_block_only16) (no FL_CAP_VIEWS16; the same bits; A/B) */
    const char *ev = getenv("FITLLM_CUDA_VIEWS32");
    const int views32 = ev && !strcmp(ev, "1");
    /* FITLLM_CUDA_STREAM16=0: the residual adds read the stream's fp32 rows, each block's in its own buffer (no
     * FL_CAP_STREAM16; the same bits; A/B). Off with FITLLM_CUDA_VIEWS32=1 too. */
    const char *es16 = getenv("FITLLM_CUDA_STREAM16");
    const int stream16 = !views32 && (!es16 || !*es16 || !strcmp(es16, "1"));
    /* FITLLM_CUDA_Q4 (issue 30 item 7): a bf16 run's 4-bit matmuls dequantized a panel of rows at a time into a bf16
     * scratch for the GEMM (scratch, the default: bitsandbytes' way with a bf16 compute dtype), on bf16 tensor cores
     * with the NF4 / FP4 dequantization fused into the B load (tc, experimental), or the fp32 kernels (fp32). A run
     * whose compute dtype is not bf16 (32-true, 16-mixed, 16-true) takes the fp32 kernels whatever it says
     * (flb_q4_mode) */
    const char *eq = getenv("FITLLM_CUDA_Q4");
    im->q4 = !eq || !*eq || !strcmp(eq, "scratch") ? FLB_Q4_SCRATCH : !strcmp(eq, "tc") ? FLB_Q4_TC
             : !strcmp(eq, "fp32") ? FLB_Q4_FP32 : -1;
    /* FITLLM_CUDA_Q4X16 (issue 30 items 1 and 7; unset or 1: on, 0: off, A/B): under tc / scratch the 4-bit matmuls
     * over bf16 x / dy (q4_matmul_forward16 / _backward16, FL_CAP_Q4X16), so QLoRA's bases read the stored copies */
    /* FITLLM_CUDA_HEAD_GROUP (unset or 1: on, 0: off, A/B): a trained bf16 LM head's dW over several loss chunks in
     * one GEMM (FL_CAP_HEAD_GROUP, transformer.c); bits differ from one GEMM per chunk (fp32 sums in another order) */
    const char *ehg = getenv("FITLLM_CUDA_HEAD_GROUP");
    const int head_group = !ehg || !*ehg || !strcmp(ehg, "1");
    /* FITLLM_CUDA_Q4_STACK (unset or 1: on, 0: off, A/B): scratch dequantizes a fused output's 4-bit parts (q|k|v,
     * gate|up) side by side and multiplies them in one GEMM; 0: a GEMM a part, the backward adding into dx in turn */
    const char *eqs = getenv("FITLLM_CUDA_Q4_STACK");
    im->q4_stack = !eqs || !*eqs || !strcmp(eqs, "1") ? 1 : !strcmp(eqs, "0") ? 0 : -1;
    const char *eqx = getenv("FITLLM_CUDA_Q4X16");
    const int q4x16 = !eqx || !*eqx || !strcmp(eqx, "1") ? 1 : !strcmp(eqx, "0") ? 0 : -1;
    im->graph.state = im->graph.on ? FLB_G_FIRST : FLB_G_OFF;
    im->graph.stream = im->stream;
    im->graph.err = &im->err;
    im->graph.in = &im->in;
    s = im->attn < 0 ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_ATTN=%s: expected 'auto' (cuDNN's fused "
                                 "attention where it loads and takes the shape, else 'own'), 'cudnn' (cuDNN, "
                                 "experimental), 'own' (bf16 runs: the FlashAttention-2-structured kernels, "
                                 "experimental), 'legacy' (bf16 runs: the earlier tensor-core kernels) or 'fp32' "
                                 "(the fp32 kernels always)", FLB_NAME, ea)
        : eh && *eh && !head_dbf16 && strcmp(eh, "0")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_HEAD_DBF16=%s: expected 1 (the default: the "
                        "cross-entropy writes the LM head's gradient in bf16) or 0 (in fp32, then converted)",
                        FLB_NAME, eh)
        : ee && *ee && !im->epi && strcmp(ee, "0")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_EPILOGUE=%s: expected 1 (the default: a linear's bias "
                        "and GPT-2's GELU in cuBLASLt's epilogue) or 0 (as kernels after the GEMM)", FLB_NAME, ee)
        : ep && *ep && !im->stage.on && strcmp(ep, "0")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_PINNED=%s: expected 1 (the default: small uploads "
                        "through a page-locked ring) or 0 (straight from the caller's memory)", FLB_NAME, ep)
        : ess && *ess && !im->ss_on && strcmp(ess, "0")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_STEP_SCALARS=%s: expected 1 (the default: the step's "
                        "gradient norm, clip scale and losses stay on the device until its end) or 0 (read on the "
                        "host)", FLB_NAME, ess)
        : epf && *epf && !im->in.on && strcmp(epf, "0")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_PREFETCH=%s: expected 1 (the default: the next "
                        "micro-batch's inputs uploaded ahead on a second stream) or 0 (on the backend's stream, "
                        "before the micro-batch)", FLB_NAME, epf)
        : eg && *eg && !im->graph.on && strcmp(eg, "0")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_GRAPHS=%s: expected 0 (the default: the ops one by one) "
                        "or 1 (experimental: capture the training step as CUDA graphs and replay them)",
                        FLB_NAME, eg)
        : ev && *ev && !views32 && strcmp(ev, "0")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_VIEWS32=%s: expected 0 (the default: a bf16 run's "
                        "stored slots whose fp32 view nothing reads are written in bf16 only, their views not "
                        "allocated, and fp32 results nothing reads are not written) or 1 (every fp32 view and result "
                        "kept)", FLB_NAME, ev)
        : ehg && *ehg && !head_group && strcmp(ehg, "0")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_HEAD_GROUP=%s: expected 1 (the default: a trained bf16 "
                        "LM head's weight gradient over a group of loss chunks in one GEMM) or 0 (one GEMM per chunk)",
                        FLB_NAME, ehg)
        : es16 && *es16 && strcmp(es16, "0") && strcmp(es16, "1")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_STREAM16=%s: expected 1 (the default: a bf16 run's "
                        "residual adds read the stream's stored bf16 rows, its fp32 rows in one buffer) or 0 (the fp32 "
                        "rows, two buffers and the mid residual's view)", FLB_NAME, es16)
        : im->q4 < 0
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_Q4=%s: expected scratch (the default: a bf16 "
                        "run's 4-bit weights dequantized into a bf16 scratch for the GEMM), tc (experimental: on bf16 "
                        "tensor cores, dequantized in the load) or fp32 (the fp32 4-bit matmul kernels, as every "
                        "other precision's)", FLB_NAME, eq)
        : ebk && *ebk && strcmp(ebk, "64") && strcmp(ebk, "128")
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_FA2_BK=%s: expected 64 (the default at head size 64 "
                        "/ 128: the own attention backward in blocks of 64 keys, 4 warps) or 128 (8 warps, half the dq "
                        "adds; experimental; a padded head size's default)", FLB_NAME, ebk)
        : im->q4_stack < 0
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_Q4_STACK=%s: expected 1 (the default: a fused output's "
                        "4-bit parts dequantized side by side and multiplied in one GEMM) or 0 (one GEMM a part)",
                        FLB_NAME, eqs)
        : q4x16 < 0
            ? fl_errorf(FL_ERR_INVALID, "%s backend: FITLLM_CUDA_Q4X16=%s: expected 1 (the default: under "
                        "FITLLM_CUDA_Q4=tc or scratch a 4-bit linear reads its input's and its dy's stored bf16 "
                        "copies) or 0 (their fp32 values)", FLB_NAME, eqx)
            : flb_attn_init(im);
    if (s == FL_OK) s = flb_gelu16_init(be); /* FITLLM_CUDA_GELU16, the issue-30 bf16 slots (cuda-gemm-more-impl.h) */
    if (s != FL_OK) {
        flb_dev_free(im->scalars);
        flb_device_free(im->stream, &im->blas);
        free(im);
        be->impl = NULL;
        return s;
    }
    im->compute = FL_F32;
    if (im->graph.on && FLB_HOST_MEMORY) /* the host would read what a pending graph has not yet written */
        flb_graph_give_up(&im->graph, "the backend's memory is the host's");
#if defined(FLB_HAVE_CUDNN) && defined(FLB_CUDNN_NAMED_ONLY)
    /* the emulator's cuDNN (tests/cuda/sim_cudnn.c) computes on the host as it is called: a capture would not record
     * it, and a replay would leave the attention's results as the capture's (on a GPU cuDNN's kernels are captured) */
    if (im->graph.on && im->dnn) flb_graph_give_up(&im->graph, "the emulator's cuDNN runs on the host, not captured");
#endif
    if (im->graph.on && im->graph.state != FLB_G_EAGER) flb_graph_slots_init(&im->graph); /* per-step scalars */
    flb_device_name(im->devname, sizeof im->devname);
    be->device_name = im->devname;
    be->mark = flb_mark;
    be->mark_ms = flb_mark_ms;
    be->name = FLB_NAME;
    be->device = FL_DEV_CUDA;
    be->n_threads = 1;
    be->gemm_name = FLB_GEMM_NAME;
    be->gemm_widens16 = 1u << FL_F16; /* an F16 B is widened per call (the panels above); fl_cuda_gemm_widens16 */
    be->scratch_bytes = FLB_SCRATCH_BYTES;
    be->caps = FL_CAP_ASYNC | FL_CAP_COMPUTE_BF16 | (views32 ? 0u : FL_CAP_VIEWS16) | (stream16 ? FL_CAP_STREAM16 : 0u) |
               (FLB_HOST_MEMORY ? FL_CAP_HOST_MEMORY : FL_CAP_DEVICE_MEMORY) |
               (q4x16 && (im->q4 == FLB_Q4_TC || im->q4 == FLB_Q4_SCRATCH) ? FL_CAP_Q4X16 : 0u) |
               (head_group ? FL_CAP_HEAD_GROUP : 0u);
    be->set_compute_dtype = flb_set_compute_dtype;
    be->comm_create = flb_comm_create_be; /* several ranks: NCCL (or its CPU stand-in) on this stream */
    be->gemm = flb_gemm;
    be->gemm_epilogue = flb_gemm_epilogue;
    be->gemm_bench = flb_gemm_bench;
    be->embedding_forward = flb_embedding_forward;
    be->embedding_forward16 = flb_embedding_forward16;
    be->embedding_backward = flb_embedding_backward;
    be->relbias_forward = flb_relbias_forward;
    be->relbias_backward = flb_relbias_backward;
    be->rmsnorm_forward = flb_rmsnorm_forward;
    be->rmsnorm_backward = flb_rmsnorm_backward;
    be->rmsnorm_forward_w16 = flb_rmsnorm_forward_w16;
    be->rmsnorm_backward_w16 = flb_rmsnorm_backward_w16;
    be->add_rmsnorm_forward = flb_add_rmsnorm_forward;
    be->layernorm_forward = flb_layernorm_forward;
    be->layernorm_backward = flb_layernorm_backward;
    be->layernorm_forward_w16 = flb_layernorm_forward_w16;
    be->layernorm_backward_w16 = flb_layernorm_backward_w16;
    be->rope_forward = flb_rope_forward;
    be->rope_backward = flb_rope_backward;
    be->attention_forward = flb_attention_forward;
    be->attention_forward16 = flb_attention_forward16;
    be->attention_backward = flb_attention_backward;
    be->attention_backward16 = flb_attention_backward16;
    be->swiglu_forward = flb_swiglu_forward;
    be->swiglu_backward = flb_swiglu_backward;
    be->gelu_forward = flb_gelu_forward;
    be->gelu_backward = flb_gelu_backward;
    be->relu_forward = flb_relu_forward;
    be->relu_backward = flb_relu_backward;
    be->gelu_erf_forward = flb_gelu_erf_forward;
    be->gelu_erf_backward = flb_gelu_erf_backward;
    be->geglu_forward = flb_geglu_forward;
    be->geglu_backward = flb_geglu_backward;
    be->add = flb_add;
    be->bias_forward = flb_bias_forward;
    be->bias_backward = flb_bias_backward;
    be->cross_entropy = flb_cross_entropy;
    be->cross_entropy_dbf16 = head_dbf16 ? flb_cross_entropy_dbf16 : NULL;
#ifdef FLB_HAVE_CUDNN /* cuDNN's attention copies in the model's lent scratch (the planner counts them) */
    be->attn_scratch_bytes = im->dnn ? fl_cudnn_sdpa_scratch_bytes : NULL;
    /* the bf16 dO and gradients around cuDNN's graphs (FITLLM_CUDA_CUDNN_B16: the query says no when off) */
    be->attention_backward_b16 = im->dnn ? flb_attention_backward_b16 : NULL;
    be->attention_b16_ok = im->dnn ? flb_attention_b16_ok : NULL;
#endif
    be->adamw_update = flb_adamw_update;
    be->sgd_update = flb_sgd_update;
    be->sumsq = flb_sumsq;
    if (FLB_IMPL(be)->ss_on) { /* FITLLM_CUDA_STEP_SCALARS (1 default) */
        be->step_scalars = flb_step_scalars;
        be->grad_norm_dev = flb_grad_norm_dev;
        be->loss_sum_dev = flb_loss_sum_dev;
        be->adamw_update_ss = flb_adamw_update_ss;
        be->sgd_update_ss = flb_sgd_update_ss;
        be->check_finite_dev = flb_check_finite_dev;
        be->adam8bit_update_ss = flb_adam8bit_update_ss;
    }
    if (im->in.on && !FLB_HOST_MEMORY) { /* FITLLM_CUDA_PREFETCH (1 default); host memory: nothing to upload */
        be->input_slots = flb_input_slots;
        be->input_upload = flb_input_upload;
        be->input_wait = flb_input_wait;
    }
    be->scale = flb_scale;
    be->zero = flb_zero;
    be->init_random = flb_init_random;
    be->attention_decode = flb_attention_decode;
    be->convert = flb_convert;
    be->round16 = flb_round16;
    be->convert_many = flb_convert_many;
    be->act_forward16 = flb_act_forward16;
    be->add16 = flb_add16;
    be->rope_forward16 = flb_rope_forward16;
    be->act_backward16 = flb_act_backward16;
    be->rope_backward16 = flb_rope_backward16;
    be->check_finite = flb_check_finite;
    be->adam8bit_update = flb_adam8bit_update;
    be->q4_matmul_forward = flb_q4_matmul_forward;
    be->q4_matmul_backward = flb_q4_matmul_backward;
    be->q4_matmul_forward16 = be->caps & FL_CAP_Q4X16 ? flb_q4_matmul_forward16 : NULL;
    be->q4_matmul_backward16 = be->caps & FL_CAP_Q4X16 ? flb_q4_matmul_backward16 : NULL;
    be->lora_forward = flb_lora_forward;
    be->dropout = flb_dropout;
    flb_tp_ops_fill(be);
    be->lora_backward = flb_lora_backward;
    be->accumulate16 = flb_accumulate16;
    be->set_scratch = flb_set_scratch;
    be->to_device = flb_to_device;
    be->to_host = flb_to_host;
    be->copy = flb_copy;
    be->sync = flb_sync;
    be->supports_op = flb_supports_op;
    be->run = im->graph.on ? flb_run_graph : fl_backend_run_slots;
    be->rope_tables = flb_rope_tables;
    be->pool_init = flb_pool_init;
    be->host_pool_init = flb_host_pool_init;
    return FL_OK;
}

void FLB_PREFIX(backend_free)(fl_backend *be) {
    if (!be || !be->impl) return;
    flb_impl *im = FLB_IMPL(be);
    flb_stream_sync(im->stream);
    flb_graph_free_all(&im->graph); /* after the sync: a graph may still copy from its page-locked slots */
    if (im->own_scratch) flb_dev_free(im->own_scratch);
    if (im->scalars) flb_dev_free(im->scalars);
    flb_stage_free(&im->stage);
    flb_input_free(&im->in);
    flb_attn_free(im);
    if (im->marks)
        for (int i = 0; i < FL_PROF_MAX_MARKS; i++)
            if (im->marks[i]) flb_mark_free(im->marks[i]);
    free(im->marks);
    flb_device_free(im->stream, &im->blas);
    free(im);
    memset(be, 0, sizeof *be);
}

/* FITLLM_CUDA_GRAPHS=1: what the door does with the step (cuda-graph-impl.h); "" before two steps ran or without it. */
const char *FLB_PREFIX(backend_graph_verdict)(const fl_backend *be) { return FLB_IMPL(be)->graph.verdict; }
void FLB_PREFIX(backend_graph_stats)(const fl_backend *be, fl_cu_graph_stats *out) { *out = FLB_IMPL(be)->graph.st; }

/* The backend's own error state (tests; fl_backend has no slot for it): FL_OK, or the sticky error. */
fl_status FLB_PREFIX(backend_error)(const fl_backend *be) { return flb_sticky(be); }

/* The host round trips so far (tests: issue 30 item 5's count per step): a copy to the host waits for the
 * stream, and so does sync. */
void FLB_PREFIX(backend_counters)(const fl_backend *be, fl_cu_counters *out) { *out = FLB_IMPL(be)->count; }
