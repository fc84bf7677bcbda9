/* The cu_kernels_train.h kernels on a GPU (fl_cuk_*) against the emulated ones (fl_cuemu_*, which
 * tests/test_cuda_more.c checks against the CPU backend) at small odd shapes, and against the CPU
 * backend at realistic shapes, with cudaEvent timings of the latter (called from cuda_check.c's
 * main; one line per check, like its report()). Expectations:
 *   - embeddings, T5's relative bias, 8-bit AdamW, the F32 dequantization, the dropout kernels: the same bits (the
 *     kernels use no contraction-prone expression: explicit __fmul_rn / __fadd_rn where the CPU
 *     rounds twice, IEEE division and sqrt);
 *   - the 4-bit matmuls: the same FMA sequence as the emulator (fmaf in a fixed order), so the
 *     same bits are expected there too; against the CPU backend (another summation order) a
 *     sample of rows within the fp32 dot-product bound of float64, and all values within 1e-4
 *     relative to the largest. The 4-bit kernels also on tensor-parallel parts that cut the blocks (a row map:
 *     q4_cut, issue 35).
 * Returns the number of failed checks. */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/cu_kernels_train.h"
#include "fitllm/backend.h"
#include "fitllm/dtype.h"
#include "fitllm/lora.h"
#include "../q4_part.h"

static int m_fail;

static void *dcopy(const void *h, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) { fprintf(stderr, "cudaMalloc(%zu) failed\n", bytes); exit(1); }
    if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    return d;
}
static void hcopy(void *h, const void *d, size_t bytes) {
    if (cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) { fprintf(stderr, "cudaMemcpy failed\n"); exit(1); }
}
static float *rnd(unsigned *s, size_t n, float lo, float hi) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[i] = lo + (hi - lo) * (float)(*s >> 8) / 16777216.0f;
    }
    return x;
}
static int synced(int rc) { return rc == 0 && cudaDeviceSynchronize() == cudaSuccess; }
static void bits(const char *op, int launched, const void *gpu, const void *ref, size_t bytes) {
    int ok = launched && memcmp(gpu, ref, bytes) == 0;
    size_t diff = 0;
    if (launched)
        for (size_t i = 0; i < bytes; i++) diff += ((const unsigned char *)gpu)[i] != ((const unsigned char *)ref)[i];
    printf("%-28s %s  (%s)\n", op, ok ? "ok  " : "FAIL", !launched ? "launch failed" : diff ? "bytes differ" : "identical bits");
    if (!ok) { m_fail++; if (launched) printf("%-28s       %zu of %zu bytes differ\n", "", diff, bytes); }
}
/* fp32 arrays bit for bit, except that a NaN equals any NaN: the GPU writes the canonical NaN
 * (0x7fffffff) where x86 writes its default NaN (0xffc00000, inf/inf) or propagates the input's
 * payload, so NaN bits differ by design, not by a fault (the 8-bit path skips non-finite gradients;
 * the fp32 path, bnb's kOptimizer32bit2State, lets them through). */
static void bits_f32(const char *op, int launched, const float *gpu, const float *ref, size_t n) {
    size_t diff = 0, nan = 0;
    for (size_t i = 0; launched && i < n; i++) {
        if (isnan(gpu[i]) && isnan(ref[i])) { nan++; continue; }
        diff += memcmp(gpu + i, ref + i, 4) != 0;
    }
    int ok = launched && diff == 0;
    printf("%-28s %s  (%s", op, ok ? "ok  " : "FAIL", !launched ? "launch failed" : diff ? "values differ" : "identical bits");
    if (launched && nan) printf(", %zu NaN on both", nan);
    printf(")\n");
    if (!ok) { m_fail++; if (launched) printf("%-28s       %zu of %zu values differ\n", "", diff, n); }
}
static void close_to(const char *op, int launched, const float *gpu, const float *ref, size_t n, double rel_max) {
    double mx = 0, worst = 0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[i]));
    int same = launched && memcmp(gpu, ref, n * 4) == 0;
    for (size_t i = 0; launched && i < n; i++) {
        double d = fabs((double)gpu[i] - ref[i]) / (mx > 0 ? mx : 1);
        if (!(d <= worst)) worst = d; /* NaN -> worst NaN */
    }
    int ok = launched && worst <= rel_max;
    printf("%-28s %s  (max |diff| / max|ref| = %.2e%s)\n", op, ok ? "ok  " : "FAIL", worst, same ? ", identical" : "");
    if (!ok) m_fail++;
}
static float elapsed(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms, a, b);
    return ms;
}

/* out = the mean ms of `call` over reps launches on the default stream (events e0, e1 around them) */
#define TIMED_MS(out, e0, e1, reps, call)                                                                             \
    do {                                                                                                              \
        cudaEventRecord((e0), 0);                                                                                     \
        for (int t_ = 0; t_ < (reps); t_++) (void)(call);                                                            \
        cudaEventRecord((e1), 0);                                                                                     \
        (out) = elapsed((e0), (e1)) / (float)(reps);                                                                 \
    } while (0)

/* ---- embeddings ---------------------------------------------------------------------------- */
static void emb_small(int B, int T, int C, int V) {
    unsigned s = 11;
    const int N = B * T;
    const size_t nc = (size_t)N * C;
    int32_t *ids = malloc(N * 4);
    for (int n = 0; n < N; n++) ids[n] = (int32_t)((n * 7919u + 13u) % (unsigned)V);
    float *wte = rnd(&s, (size_t)V * C, -1, 1), *wpe = rnd(&s, (size_t)T * C, -1, 1), *dout = rnd(&s, nc, -1, 1);
    float *dwte = rnd(&s, (size_t)V * C, -1, 1), *dwpe = rnd(&s, (size_t)T * C, -1, 1), *out = malloc(nc * 4);
    float *g = malloc(((size_t)V * C > nc ? (size_t)V * C : nc) * 4);
    int32_t *work = malloc(FL_CU_EMB_WORK_INTS(N) * 4);
    int32_t *dI = dcopy(ids, N * 4), *dWk = dcopy(NULL, FL_CU_EMB_WORK_INTS(N) * 4);
    float *dWte = dcopy(wte, (size_t)V * C * 4), *dWpe = dcopy(wpe, (size_t)T * C * 4), *dO = dcopy(NULL, nc * 4);
    float *dDo = dcopy(dout, nc * 4), *dDwte = dcopy(dwte, (size_t)V * C * 4), *dDwpe = dcopy(dwpe, (size_t)T * C * 4);
    fl_cuemu_embedding_forward(out, ids, wte, wpe, B, T, C, NULL);
    fl_cuemu_embedding_backward(dwte, dwpe, dout, ids, B, T, C, work, NULL);
    int ok = synced(fl_cuk_embedding_forward(dO, dI, dWte, dWpe, B, T, C, NULL));
    hcopy(g, dO, nc * 4);
    bits("embedding_forward", ok, g, out, nc * 4);
    ok = synced(fl_cuk_embedding_backward(dDwte, dDwpe, dDo, dI, B, T, C, dWk, NULL));
    hcopy(g, dDwte, (size_t)V * C * 4);
    bits("embedding_backward dwte", ok, g, dwte, (size_t)V * C * 4);
    hcopy(g, dDwpe, (size_t)T * C * 4);
    bits("embedding_backward dwpe", ok, g, dwpe, (size_t)T * C * 4);
    cudaFree(dI); cudaFree(dWk); cudaFree(dWte); cudaFree(dWpe); cudaFree(dO); cudaFree(dDo); cudaFree(dDwte); cudaFree(dDwpe);
    free(ids); free(wte); free(wpe); free(dout); free(dwte); free(dwpe); free(out); free(g); free(work);
}

/* B*T = 8192 tokens, V = 32000, C = 2048: GPU against the CPU backend (the same bits), timed.
 * zipf: log-uniform ids (id 0 about 7% of the tokens: the longest group a real text has). */
static void emb_big(int zipf) {
    const int B = 8, T = 1024, C = 2048, V = 32000, N = B * T;
    const size_t nc = (size_t)N * C, vc = (size_t)V * C;
    unsigned s = 12 + zipf;
    int32_t *ids = malloc(N * 4);
    for (int n = 0; n < N; n++) {
        s = s * 1664525u + 1013904223u;
        double u = (double)(s >> 8) / 16777216.0;
        ids[n] = zipf ? (int32_t)(floor(pow((double)V, u)) - 1) : (int32_t)(u * V);
        if (ids[n] < 0) ids[n] = 0;
        if (ids[n] >= V) ids[n] = V - 1;
    }
    float *dout = rnd(&s, nc, -1, 1), *dwte = calloc(vc, 4), *g = malloc(vc * 4);
    fl_backend be;
    fl_cpu_backend_init(&be, 0);
    be.embedding_backward(&be, dwte, NULL, dout, ids, B, T, C);
    int32_t *dI = dcopy(ids, N * 4), *dWk = dcopy(NULL, FL_CU_EMB_WORK_INTS(N) * 4);
    float *dDo = dcopy(dout, nc * 4), *dDwte = dcopy(NULL, vc * 4);
    cudaMemset(dDwte, 0, vc * 4);
    int ok = synced(fl_cuk_embedding_backward(dDwte, NULL, dDo, dI, B, T, C, dWk, NULL));
    hcopy(g, dDwte, vc * 4);
    bits(zipf ? "embedding_bwd 8192x2048 zipf" : "embedding_bwd 8192x2048", ok, g, dwte, vc * 4);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const int reps = 20;
    float ms;
    TIMED_MS(ms, e0, e1, reps, fl_cuk_embedding_backward(dDwte, NULL, dDo, dI, B, T, C, dWk, NULL));
    /* bytes that must move: dout once, and each touched dwte row read and written */
    printf("%-28s time %.3f ms  (%s ids, %.0f GB/s of dout read)\n", "  embedding_backward", ms, zipf ? "zipf" : "uniform",
           nc * 4 / (ms * 1e-3) / 1e9);
    float *dOut = dcopy(NULL, nc * 4), *dWte = dcopy(NULL, vc * 4);
    TIMED_MS(ms, e0, e1, reps, fl_cuk_embedding_forward(dOut, dI, dWte, NULL, B, T, C, NULL));
    printf("%-28s time %.3f ms  (%.0f GB/s read+write)\n", "  embedding_forward", ms, 2.0 * nc * 4 / (ms * 1e-3) / 1e9);
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    cudaFree(dI); cudaFree(dWk); cudaFree(dDo); cudaFree(dDwte); cudaFree(dOut); cudaFree(dWte);
    fl_cpu_backend_free(&be);
    free(ids); free(dout); free(dwte); free(g);
}

/* ---- 8-bit AdamW: GPU against the CPU backend (the same bits), 3 steps with inf/NaN gradients -- */
static void adam8bit_check(size_t n, fl_dtype tp, int timed) {
    unsigned s = 21;
    const size_t ps = tp == FL_F32 ? 4 : 2, sb = fl_adam8bit_state_bytes(n);
    float *p32 = rnd(&s, n, -1, 1), *g = rnd(&s, n, -2, 2);
    g[7] = INFINITY;
    g[n / 2] = NAN;
    void *p = malloc(n * ps);
    for (size_t i = 0; i < n; i++) {
        if (tp == FL_F32) ((float *)p)[i] = p32[i];
        else ((uint16_t *)p)[i] = tp == FL_F16 ? fl_f32_to_f16(p32[i]) : fl_f32_to_bf16(p32[i]);
    }
    void *mem = calloc(1, sb), *hp = malloc(n * ps), *hm = malloc(sb);
    fl_adam8bit_state st, dst;
    fl_adam8bit_state_bind(&st, n, mem);
    void *dP = dcopy(p, n * ps), *dG = dcopy(g, n * 4), *dMem = dcopy(mem, sb);
    fl_adam8bit_state_bind(&dst, n, dMem);
    fl_backend be;
    fl_cpu_backend_init(&be, 0);
    int ok = 1;
    for (int step = 1; step <= 3; step++) {
        be.adam8bit_update(&be, p, tp, g, FL_F32, &st, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 0.5f);
        ok &= synced(fl_cuk_adam8bit_update(dP, tp, dG, FL_F32, &dst, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 0.5f, NULL));
    }
    char name[64];
    hcopy(hp, dP, n * ps);
    snprintf(name, sizeof name, "adam8bit n=%zu %s p", n, fl_dtype_name(tp));
    if (tp == FL_F32) bits_f32(name, ok, hp, p, n);
    else bits(name, ok, hp, p, n * ps);
    hcopy(hm, dMem, sb);
    snprintf(name, sizeof name, "adam8bit n=%zu state", n);
    if (!fl_adam8bit_is_8bit(n)) bits_f32(name, ok, hm, mem, sb / 4); /* fp32 m, v */
    else bits(name, ok, hm, mem, sb);
    if (timed) {
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0, 0);
        for (int i = 0; i < 10; i++)
            fl_cuk_adam8bit_update(dP, tp, dG, FL_F32, &dst, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 4 + i, 0.5f, NULL);
        cudaEventRecord(e1, 0);
        float ms = elapsed(e0, e1) / 10;
        printf("%-28s time %.3f ms  (%.0f GB/s of p, g, states)\n", "  adam8bit_update", ms,
               (double)n * (2 * ps + 4 + 4) / (ms * 1e-3) / 1e9);
        cudaEventDestroy(e0); cudaEventDestroy(e1);
    }
    fl_cpu_backend_free(&be);
    cudaFree(dP); cudaFree(dG); cudaFree(dMem);
    free(p32); free(g); free(p); free(mem); free(hp); free(hm);
}

/* ---- 4-bit ----------------------------------------------------------------------------------- */
typedef struct {
    fl_q4_weight h, d; /* host copy, device copy (same layout) */
    void *hmem, *dmem;
    size_t bytes;
} q4pair;

static void q4_make(q4pair *q, int rows, int cols, fl_q4_type t, int dq, unsigned seed) {
    unsigned s = seed;
    float *w = rnd(&s, (size_t)rows * cols, -1, 1);
    q->bytes = fl_q4_bytes((size_t)rows * cols, dq);
    q->hmem = calloc(1, q->bytes);
    fl_q4_bind(&q->h, rows, cols, t, dq, q->hmem);
    fl_q4_quantize(&q->h, w, 0);
    q->dmem = dcopy(q->hmem, q->bytes);
    fl_q4_bind(&q->d, rows, cols, t, dq, q->dmem);
    free(w);
}
static void q4_free(q4pair *q) { free(q->hmem); cudaFree(q->dmem); }

/* QLoRA where a tensor-parallel rank's part cuts the blocks (issue 35; EXPERIMENTAL until run here): the part (R, K)
 * of a whole (RW, KW), kind / a / b as tests/q4_part.h's q4p_starts, held as the whole blocks covering it with the row
 * map (the map travels in the same buffer: device pointers after fl_q4_bind_mapped on the device copy) */
static int q4_make_cut(q4pair *q, q4p_kind kind, int RW, int KW, int R, int K, int a, int b, fl_q4_type t, int dq) {
    q4pair whole;
    q4_make(&whole, RW, KW, t, dq, 33);
    float *wdeq = malloc((size_t)RW * KW * 4), *deq = malloc((size_t)R * K * 4);
    size_t *starts = malloc((size_t)R * sizeof *starts);
    fl_q4_dequantize(&whole.h, wdeq, 0);
    q4p_starts(kind, R, KW, a, b, starts);
    int ok = q4p_make(&whole.h, wdeq, starts, R, K, &q->h, &q->hmem, deq);
    if (ok) {
        q->bytes = fl_q4_weight_bytes(&q->h);
        q->dmem = dcopy(q->hmem, q->bytes);
        ok = fl_q4_bind_mapped(&q->d, R, K, t, q->h.n_blocks, q->dmem) == FL_OK;
    }
    free(wdeq), free(deq), free(starts);
    q4_free(&whole);
    return ok;
}

/* the GPU's kernels on q (OUT, IN) against the emulator's: the dequantized panel and the matmuls */
static void q4_run(q4pair *qp, int N, const char *mode) {
    q4pair q = *qp;
    const int OUT = q.h.rows, IN = q.h.cols;
    unsigned s = 32;
    char name[96];
    float *x = rnd(&s, (size_t)N * IN, -1, 1), *dy = rnd(&s, (size_t)N * OUT, -1, 1), *y = rnd(&s, (size_t)N * OUT, -1, 1);
    float *dx = rnd(&s, (size_t)N * IN, -1, 1), *deq = malloc((size_t)OUT * IN * 4);
    float *g = malloc(((size_t)N > (size_t)OUT ? (size_t)N : (size_t)OUT) * (IN > OUT ? IN : OUT) * 4);
    float *dX = dcopy(x, (size_t)N * IN * 4), *dDy = dcopy(dy, (size_t)N * OUT * 4), *dY = dcopy(y, (size_t)N * OUT * 4);
    float *dDx = dcopy(dx, (size_t)N * IN * 4), *dDeq = dcopy(NULL, (size_t)OUT * IN * 4);
    fl_cuemu_q4_dequantize(deq, FL_F32, IN, &q.h, 0, OUT, NULL);
    int ok = synced(fl_cuk_q4_dequantize(dDeq, FL_F32, IN, &q.d, 0, OUT, NULL));
    hcopy(g, dDeq, (size_t)OUT * IN * 4);
    snprintf(name, sizeof name, "q4_dequantize %s f32", mode);
    bits(name, ok, g, deq, (size_t)OUT * IN * 4);
    fl_cuemu_q4_matmul_forward(y, OUT, x, &q.h, N, 1.0f, NULL);
    ok = synced(fl_cuk_q4_matmul_forward(dY, OUT, dX, &q.d, N, 1.0f, NULL));
    hcopy(g, dY, (size_t)N * OUT * 4);
    snprintf(name, sizeof name, "q4_matmul_forward %s", mode);
    close_to(name, ok, g, y, (size_t)N * OUT, 1e-6);
    fl_cuemu_q4_matmul_backward(dx, dy, OUT, &q.h, N, 1.0f, NULL);
    ok = synced(fl_cuk_q4_matmul_backward(dDx, dDy, OUT, &q.d, N, 1.0f, NULL));
    hcopy(g, dDx, (size_t)N * IN * 4);
    snprintf(name, sizeof name, "q4_matmul_backward %s", mode);
    close_to(name, ok, g, dx, (size_t)N * IN, 1e-6);
    /* the bf16 tensor-core variants (beta 0) against the emulator's: the same bf16 operands, the sums' order and
     * rounding differ (cu_mma.h): within 1e-4 of the largest, as the big case against the CPU */
    for (int bwd = 0; bwd <= 1; bwd++) {
        float *h = bwd ? dx : y, *d = bwd ? dDx : dY;
        const size_t n = (size_t)N * (bwd ? IN : OUT);
        if (bwd) {
            fl_cuemu_q4_matmul_backward_tc(h, dy, OUT, &q.h, N, 0.0f, NULL);
            ok = synced(fl_cuk_q4_matmul_backward_tc(d, dDy, OUT, &q.d, N, 0.0f, NULL));
        } else {
            fl_cuemu_q4_matmul_forward_tc(h, OUT, x, &q.h, N, 0.0f, NULL);
            ok = synced(fl_cuk_q4_matmul_forward_tc(d, OUT, dX, &q.d, N, 0.0f, NULL));
        }
        hcopy(g, d, n * 4);
        snprintf(name, sizeof name, "q4_matmul_%s_tc %s", bwd ? "backward" : "forward", mode);
        close_to(name, ok, g, h, n, 1e-4);
        /* over the bf16 copy of x / dy (q4_matmul_forward16 / _backward16's kernels, issue 30 items 1 and 7): the GPU's
         * bits of the fp32 variant just run (the same tile, the same mma order) */
        const size_t na = (size_t)N * (bwd ? OUT : IN);
        uint16_t *a16 = malloc(na * 2);
        for (size_t i = 0; i < na; i++) a16[i] = fl_f32_to_bf16((bwd ? dy : x)[i]);
        void *dA16 = dcopy(a16, na * 2);
        float *g16 = malloc(n * 4);
        ok = synced(bwd ? fl_cuk_q4_matmul_backward16_tc(d, dA16, OUT, &q.d, N, 0.0f, NULL)
                        : fl_cuk_q4_matmul_forward16_tc(d, OUT, dA16, &q.d, N, 0.0f, NULL));
        hcopy(g16, d, n * 4);
        snprintf(name, sizeof name, "q4_matmul_%s16_tc %s", bwd ? "backward" : "forward", mode);
        bits(name, ok, g16, g, n * 4);
        cudaFree(dA16);
        free(a16), free(g16);
    }
    cudaFree(dX); cudaFree(dDy); cudaFree(dY); cudaFree(dDx); cudaFree(dDeq);
    free(x); free(dy); free(y); free(dx); free(deq); free(g);
}

static void q4_small(int N, int OUT, int IN, fl_q4_type t, int dq) {
    q4pair q;
    q4_make(&q, OUT, IN, t, dq, 31);
    q4_run(&q, N, fl_q4_mode_name(t, dq));
    q4_free(&q);
}

static void q4_cut(int N, q4p_kind kind, int RW, int KW, int R, int K, int a, int b, fl_q4_type t, int dq) {
    q4pair q = {0};
    char mode[96];
    snprintf(mode, sizeof mode, "%s cut %dx%d of %dx%d", fl_q4_mode_name(t, dq), R, K, RW, KW);
    if (!q4_make_cut(&q, kind, RW, KW, R, K, a, b, t, dq)) {
        printf("FAIL %-40s (the part not built)\n", mode);
        m_fail++;
    } else {
        q4_run(&q, N, mode);
    }
    q4_free(&q);
}

static float q4_rbf(float v) { return fl_bf16_to_f32(fl_f32_to_bf16(v)); } /* RNE to bf16 and back */
/* 10 launches of a 4-bit matmul kernel (fwd, else bwd), timed with the events; out / in: device buffers */
typedef int (*q4_fn)(float *, int, const float *, const fl_q4_weight *, int, float, void *);
typedef int (*q4_bwd_fn)(float *, const float *, int, const fl_q4_weight *, int, float, void *);
static void q4_time(const char *name, const char *kind, q4_fn fwd, q4_bwd_fn bwd, float *out, const float *in,
                    const fl_q4_weight *w, int N, double flop, cudaEvent_t e0, cudaEvent_t e1) {
    const int reps = 10;
    cudaEventRecord(e0, 0);
    for (int i = 0; i < reps; i++) {
        if (fwd) fwd(out, w->rows, in, w, N, 0.0f, NULL);
        else bwd(out, in, w->rows, w, N, 0.0f, NULL);
    }
    cudaEventRecord(e1, 0);
    const float ms = elapsed(e0, e1) / reps;
    printf("%-28s time %.3f ms  (%.1f TFLOP/s %s)\n", name, ms, flop / (ms * 1e-3) / 1e12, kind);
}

/* N = 4096 rows, in = out = 2048, nf4-dq: GPU against the CPU backend, sampled rows against
 * float64 within the fp32 dot-product bound, timed. */
static void q4_big(void) {
    const int N = 4096, OUT = 2048, IN = 2048;
    q4pair q;
    q4_make(&q, OUT, IN, FL_Q4_NF4, 1, 41);
    unsigned s = 42;
    const size_t nx = (size_t)N * IN, ny = (size_t)N * OUT;
    float *x = rnd(&s, nx, -1, 1), *dy = rnd(&s, ny, -1, 1), *y = malloc(ny * 4), *dx = malloc(nx * 4);
    float *gy = malloc(ny * 4), *gdx = malloc(nx * 4), *deq = malloc((size_t)OUT * IN * 4);
    fl_q4_dequantize(&q.h, deq, 0);
    fl_backend be;
    fl_cpu_backend_init(&be, 0);
    be.q4_matmul_forward(&be, y, OUT, x, &q.h, N, 0.0f);
    be.q4_matmul_backward(&be, dx, dy, OUT, &q.h, N, 0.0f);
    float *dX = dcopy(x, nx * 4), *dDy = dcopy(dy, ny * 4), *dY = dcopy(NULL, ny * 4), *dDx = dcopy(NULL, nx * 4);
    int okf = synced(fl_cuk_q4_matmul_forward(dY, OUT, dX, &q.d, N, 0.0f, NULL));
    int okb = synced(fl_cuk_q4_matmul_backward(dDx, dDy, OUT, &q.d, N, 0.0f, NULL));
    hcopy(gy, dY, ny * 4);
    hcopy(gdx, dDx, nx * 4);
    close_to("q4_fwd 4096x2048x2048 vs cpu", okf, gy, y, ny, 1e-4);
    close_to("q4_bwd 4096x2048x2048 vs cpu", okb, gdx, dx, nx, 1e-4);
    /* 16 sampled rows of each against float64 and the bound gamma(K) * sum |a b| */
    const double u = 1.0 / 16777216.0, gam = (IN + 1) * u / (1 - (IN + 1) * u);
    int bad = 0;
    for (int si = 0; si < 16; si++) {
        int n = (si * 257 + 3) % N;
        for (int o = 0; o < OUT; o++) {
            double sf = 0, af = 0, sb = 0, ab = 0;
            for (int k = 0; k < IN; k++) {
                double pf = (double)x[(size_t)n * IN + k] * deq[(size_t)o * IN + k];
                sf += pf; af += fabs(pf);
            }
            bad += !(fabs(gy[(size_t)n * OUT + o] - sf) <= gam * af);
            for (int r = 0; r < OUT; r++) {
                double pb = (double)dy[(size_t)n * OUT + r] * deq[(size_t)r * IN + o];
                sb += pb; ab += fabs(pb);
            }
            bad += !(fabs(gdx[(size_t)n * IN + o] - sb) <= gam * ab);
        }
    }
    printf("%-28s %s  (16 rows of y and dx within the fp32 dot bound: %d outside)\n", "q4 4096x2048x2048 vs f64",
           bad ? "FAIL" : "ok  ", bad);
    m_fail += bad != 0;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const int reps = 10;
    const double flop = 2.0 * N * OUT * IN;
    q4_time("  q4_matmul_forward", "fp32", fl_cuk_q4_matmul_forward, NULL, dY, dX, &q.d, N, flop, e0, e1);
    q4_time("  q4_matmul_backward", "fp32", NULL, fl_cuk_q4_matmul_backward, dDx, dDy, &q.d, N, flop, e0, e1);
    float ms;
    /* the bf16 tensor-core variants (issue 30 item 7, EXPERIMENTAL): 16 sampled rows against float64 sums of the
     * bf16-rounded operands within twice the fp32 dot bound (the tensor cores' order and truncation), timed beside */
    okf = synced(fl_cuk_q4_matmul_forward_tc(dY, OUT, dX, &q.d, N, 0.0f, NULL));
    okb = synced(fl_cuk_q4_matmul_backward_tc(dDx, dDy, OUT, &q.d, N, 0.0f, NULL));
    hcopy(gy, dY, ny * 4);
    hcopy(gdx, dDx, nx * 4);
    bad = !okf || !okb;
    for (int si = 0; si < 16 && okf && okb; si++) {
        int n = (si * 257 + 3) % N;
        for (int o = 0; o < OUT; o++) {
            double sf = 0, af = 0, sb = 0, ab = 0;
            for (int k = 0; k < IN; k++) {
                double pf = (double)q4_rbf(x[(size_t)n * IN + k]) * q4_rbf(deq[(size_t)o * IN + k]);
                sf += pf; af += fabs(pf);
            }
            bad += !(fabs(gy[(size_t)n * OUT + o] - sf) <= 2 * gam * af);
            for (int r = 0; r < OUT; r++) {
                double pb = (double)q4_rbf(dy[(size_t)n * OUT + r]) * q4_rbf(deq[(size_t)r * IN + o]);
                sb += pb; ab += fabs(pb);
            }
            bad += !(fabs(gdx[(size_t)n * IN + o] - sb) <= 2 * gam * ab);
        }
    }
    printf("%-28s %s  (16 rows of y and dx, bf16 operands, within 2x the fp32 dot bound: %d outside)\n",
           "q4 tc 4096x2048x2048 vs f64", bad ? "FAIL" : "ok  ", bad);
    m_fail += bad != 0;
    q4_time("  q4_matmul_forward_tc", "bf16 mma", fl_cuk_q4_matmul_forward_tc, NULL, dY, dX, &q.d, N, flop, e0, e1);
    q4_time("  q4_matmul_backward_tc", "bf16 mma", NULL, fl_cuk_q4_matmul_backward_tc, dDx, dDy, &q.d, N, flop, e0,
            e1);
    float *dDeq = dcopy(NULL, (size_t)OUT * IN * 4);
    cudaEventRecord(e0, 0);
    for (int i = 0; i < reps; i++) fl_cuk_q4_dequantize(dDeq, FL_F32, IN, &q.d, 0, OUT, NULL);
    cudaEventRecord(e1, 0);
    ms = elapsed(e0, e1) / reps;
    printf("%-28s time %.3f ms  (2048 x 2048 -> f32, %.0f GB/s written)\n", "  q4_dequantize", ms,
           (double)OUT * IN * 4 / (ms * 1e-3) / 1e9);
    hcopy(gy, dDeq, (size_t)OUT * IN * 4);
    bits("q4_dequantize nf4-dq 2048^2", 1, gy, deq, (size_t)OUT * IN * 4);
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    cudaFree(dX); cudaFree(dDy); cudaFree(dY); cudaFree(dDx); cudaFree(dDeq);
    fl_cpu_backend_free(&be);
    free(x); free(dy); free(y); free(dx); free(gy); free(gdx); free(deq);
    q4_free(&q);
}

/* ---- LoRA dropout ---------------------------------------------------------------------------- */
static void lora_check(size_t n) {
    unsigned s = 51;
    const float p = 0.1f;
    const uint64_t seed = 0xfeedfacecafebeefull;
    float *x = rnd(&s, n, -1, 1), *t = rnd(&s, n, -1, 1), *dx = rnd(&s, n, -1, 1);
    float *xd = malloc(n * 4), *g = malloc(n * 4), *want = malloc(n * 4);
    const float sc = fl_lora_dropout_scale(p);
    for (size_t i = 0; i < n; i++) want[i] = fl_lora_dropout_keep(seed, i, p) ? x[i] * sc : 0.0f;
    float *dX = dcopy(x, n * 4), *dT = dcopy(t, n * 4), *dDx = dcopy(dx, n * 4), *dXd = dcopy(NULL, n * 4);
    int ok = synced(fl_cuk_lora_dropout(dXd, dX, n, p, seed, NULL, NULL));
    hcopy(g, dXd, n * 4);
    bits("lora_dropout (CPU mask)", ok, g, want, n * 4);
    fl_cuemu_lora_dropout_dx(dx, t, n, p, seed, NULL, NULL);
    ok = synced(fl_cuk_lora_dropout_dx(dDx, dT, n, p, seed, NULL, NULL));
    hcopy(g, dDx, n * 4);
    bits("lora_dropout_dx", ok, g, dx, n * 4);
    /* the backward's fused form (g @ A inside the masked update): the emulator's bits (each operation rounded, k in
     * order), at a LoRA rank of 8 over rows of 256 (n / 256 rows; rank 8's A and g from the same draws) */
    const int in = 256, N = (int)(n / 256), rk = 8;
    float *gr = rnd(&s, (size_t)N * rk, -1, 1), *A = rnd(&s, (size_t)rk * in, -1, 1), *fdx = rnd(&s, n, -1, 1);
    float *dG = dcopy(gr, (size_t)N * rk * 4), *dA = dcopy(A, (size_t)rk * in * 4), *dF = dcopy(fdx, n * 4);
    fl_cuemu_lora_dx_fused(fdx, gr, A, N, in, rk, 2.0f, p, seed, NULL, NULL);
    ok = synced(fl_cuk_lora_dx_fused(dF, dG, dA, N, in, rk, 2.0f, p, seed, NULL, NULL));
    hcopy(g, dF, n * 4);
    bits("lora_dx_fused (rank 8)", ok, g, fdx, (size_t)N * in * 4);
    cudaFree(dG); cudaFree(dA); cudaFree(dF);
    free(gr); free(A); free(fdx);
    cudaFree(dX); cudaFree(dT); cudaFree(dDx); cudaFree(dXd);
    free(x); free(t); free(dx); free(xd); free(g); free(want);
}

/* ---- RoPE's backward in place on bf16 rows (attention_backward_b16's gradients, exec.c) ------------------------
 * rope_backward16 with no fp32 input or output: the rotated pairs read from the bf16 rows and rounded back there, the
 * columns past them untouched (bit for bit); the rotated values within one bf16 unit of the emulator's (nvcc fuses
 * x0 c - x1 s into an FMA where the emulator, -ffp-contract=off, rounds the product: an fp32 difference that can move
 * a bf16 rounding), TinyLlama's q|k|v rows: 32 + 4 rotated heads of 64, then v */
static void rope16_inplace_check(int B, int T, int nh, int HD, int width) {
    const int H = HD / 2;
    const size_t n = (size_t)B * T * width;
    unsigned s = 61;
    float *x = rnd(&s, n, -2, 2), *cs = malloc((size_t)T * H * 4), *sn = malloc((size_t)T * H * 4);
    uint16_t *h16 = malloc(n * 2), *g16 = malloc(n * 2);
    for (size_t i = 0; i < n; i++) h16[i] = fl_f32_to_bf16(x[i]);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < H; j++) {
            const double th = t * pow(10000.0, -2.0 * j / HD);
            cs[(size_t)t * H + j] = (float)cos(th), sn[(size_t)t * H + j] = (float)sin(th);
        }
    void *d16 = dcopy(h16, n * 2);
    float *dC = dcopy(cs, (size_t)T * H * 4), *dS = dcopy(sn, (size_t)T * H * 4);
    const int ok = synced(fl_cuk_rope_backward16(NULL, d16, NULL, B, T, nh, HD, width, dC, dS, 0, NULL));
    size_t vdiff = 0;
    hcopy(g16, d16, n * 2);
    for (size_t r = 0; r < (size_t)B * T; r++) /* v: as it was */
        for (int c = nh * HD; c < width; c++) vdiff += g16[r * width + c] != h16[r * width + c];
    fl_cuemu_rope_backward16(NULL, h16, NULL, B, T, nh, HD, width, cs, sn, 0, NULL);
    float *gf = malloc(n * 4), *ef = malloc(n * 4);
    for (size_t i = 0; i < n; i++) gf[i] = fl_bf16_to_f32(g16[i]), ef[i] = fl_bf16_to_f32(h16[i]);
    close_to("rope_backward16 bf16 in place", ok && vdiff == 0, gf, ef, n, 1.0 / 128);
    if (vdiff) printf("%-28s       %zu of v's elements written\n", "", vdiff);
    cudaFree(d16); cudaFree(dC); cudaFree(dS);
    free(x); free(cs); free(sn); free(h16); free(g16); free(gf); free(ef);
}

/* ---- T5's relative position bias -------------------------------------------------------------
 * relbias_forward / relbias_backward (backend.h: the contract's order, the CPU backend's bits) at a small odd
 * shape (against the emulator) and at Flan-T5-base's encoder (12 heads, T 512, 32 buckets; against the CPU
 * backend), timed, with the per-head embedding_backward over the T^2 elements the model ran before (its rank is
 * O((T^2)^2): one head, one run). */
static int32_t rb_t5(int rel, int nb) { /* bidirectional, max distance 128 (T5's) */
    const int half = nb / 2, me = half / 2, ret = rel > 0 ? half : 0, n = rel < 0 ? -rel : rel;
    if (n < me) return ret + n;
    const int v = me + (int)(logf((float)n / me) / (float)log(128.0 / me) * (float)(half - me));
    return ret + (v < half - 1 ? v : half - 1);
}
static void relbias_check(int NH, int T, int nb, int big) {
    const int nd = 2 * T - 1;
    const size_t nbias = (size_t)NH * T * T, ntab = (size_t)NH * nb;
    unsigned s = 31 + big;
    int32_t *rb = malloc((size_t)nd * 4);
    for (int k = 0; k < nd; k++) rb[k] = rb_t5(k - (T - 1), nb);
    float *tab = rnd(&s, ntab, -1, 1), *dbias = rnd(&s, nbias, -1, 1), *dtab = rnd(&s, ntab, -1, 1);
    float *bias = malloc(nbias * 4), *dt = malloc(ntab * 4), *g = malloc(nbias * 4);
    memcpy(dt, dtab, ntab * 4);
    fl_backend be;
    fl_cpu_backend_init(&be, 0);
    if (big) {
        be.relbias_forward(&be, bias, tab, rb, NH, T, T, nb);
        be.relbias_backward(&be, dt, dbias, rb, NH, T, T, nb);
    } else {
        float *w = malloc(FL_CU_RELBIAS_WORK_FLOATS(NH, T, T) * 4);
        fl_cuemu_relbias_forward(bias, tab, rb, NH, T, T, nb, NULL);
        fl_cuemu_relbias_backward(dt, dbias, rb, NH, T, T, nb, w, NULL);
        free(w);
    }
    int32_t *dRb = dcopy(rb, (size_t)nd * 4);
    float *dTab = dcopy(tab, ntab * 4), *dBias = dcopy(NULL, nbias * 4), *dDbias = dcopy(dbias, nbias * 4);
    float *dDt = dcopy(dtab, ntab * 4), *dW = dcopy(NULL, FL_CU_RELBIAS_WORK_FLOATS(NH, T, T) * 4);
    char name[64];
    int ok = synced(fl_cuk_relbias_forward(dBias, dTab, dRb, NH, T, T, nb, NULL));
    hcopy(g, dBias, nbias * 4);
    snprintf(name, sizeof name, "relbias_forward %dx%d", NH, T);
    bits(name, ok, g, bias, nbias * 4);
    ok = synced(fl_cuk_relbias_backward(dDt, dDbias, dRb, NH, T, T, nb, dW, NULL));
    hcopy(g, dDt, ntab * 4);
    snprintf(name, sizeof name, "relbias_backward %dx%d", NH, T);
    bits(name, ok, g, dt, ntab * 4);
    if (big) {
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        float mb, mf, me;
        TIMED_MS(mb, e0, e1, 20, fl_cuk_relbias_backward(dDt, dDbias, dRb, NH, T, T, nb, dW, NULL));
        TIMED_MS(mf, e0, e1, 20, fl_cuk_relbias_forward(dBias, dTab, dRb, NH, T, T, nb, NULL));
        /* before: per head, embedding_backward over T^2 "tokens" of width 1 (the (T, T) bucket of each element) */
        const size_t tt = (size_t)T * T;
        int32_t *bk = malloc(tt * 4);
        for (int i = 0; i < T; i++)
            for (int j = 0; j < T; j++) bk[(size_t)i * T + j] = rb[j - i + T - 1];
        int32_t *dBk = dcopy(bk, tt * 4), *dEw = dcopy(NULL, FL_CU_EMB_WORK_INTS(tt) * 4);
        TIMED_MS(me, e0, e1, 1, fl_cuk_embedding_backward(dDt, NULL, dDbias, dBk, 1, (int)tt, 1, dEw, NULL));
        printf("%-28s time %.3f ms backward (%.0f GB/s of dbias read), %.3f ms forward; before: %.3f ms a head "
               "(embedding_backward over T^2), x %d heads = %.1f ms\n", "  relbias", mb, nbias * 4 / (mb * 1e-3) / 1e9,
               mf, me, NH, me * NH);
        cudaEventDestroy(e0); cudaEventDestroy(e1);
        cudaFree(dBk); cudaFree(dEw);
        free(bk);
    }
    cudaFree(dRb); cudaFree(dTab); cudaFree(dBias); cudaFree(dDbias); cudaFree(dDt); cudaFree(dW);
    fl_cpu_backend_free(&be);
    free(rb); free(tab); free(dbias); free(dtab); free(bias); free(dt); free(g);
}

int fl_cuda_check_more(void) {
    m_fail = 0;
    float codes[512], *dC = dcopy(NULL, sizeof codes);
    int ok = synced(fl_cuk_adam8bit_codes(dC, NULL));
    hcopy(codes, dC, sizeof codes);
    cudaFree(dC);
    bits("adam8bit code tables", ok, codes, fl_adam8bit_code_signed, 1024);
    bits("adam8bit code tables (u)", ok, codes + 256, fl_adam8bit_code_unsigned, 1024);
    emb_small(3, 7, 37, 11);
    emb_small(4, 75, 300, 17);
    emb_big(0);
    emb_big(1);
    relbias_check(3, 45, 32, 0);
    relbias_check(12, 512, 32, 1); /* Flan-T5-base's encoder at source 512 */
    adam8bit_check(2 * FL_ADAM8BIT_MIN_SIZE + 77, FL_BF16, 0);
    adam8bit_check(1000, FL_F32, 0);
    adam8bit_check(FL_ADAM8BIT_MIN_SIZE + 5, FL_F16, 0); /* 16-true: fp16 parameters (not yet run on a GPU) */
    adam8bit_check((size_t)1 << 24, FL_F32, 1);
    q4_small(19, 37, 131, FL_Q4_NF4, 0);
    q4_small(133, 150, 70, FL_Q4_FP4, 1);
    q4_cut(19, Q4P_COLS, 37, 131, 37, 43, 45, 0, FL_Q4_NF4, 1); /* as test_cuda_more.c's cuda_more_q4_cut_blocks */
    q4_cut(133, Q4P_ROWS, 150, 70, 75, 70, 37, 0, FL_Q4_FP4, 0);
    q4_cut(5, Q4P_FUSED, 90, 45, 40, 45, 3, 60, FL_Q4_NF4, 0);
    q4_big();
    lora_check(100003);
    rope16_inplace_check(2, 37, 36, 64, 40 * 64); /* TinyLlama's q|k|v rows: 32 + 4 heads rotated, v after */
    return m_fail;
}
