/* CUDA kernels of cu_kernels_train.h under the CPU emulator (embeddings, 8-bit AdamW, 4-bit
 * matmuls and dequantization, LoRA dropout), against the CPU backend at small odd shapes (partial
 * warps and tiles, rows whose 64-element quantization blocks straddle two rows, repeated ids).
 * Anchors:
 *   - embeddings, 8-bit AdamW (states AND parameters), dequantization (F32), the dropout mask:
 *     bit for bit against the CPU backend, which evaluates the same fp32 operations in the same
 *     order (the CPU ops are checked against float64 / bitsandbytes references in test_ops.c,
 *     test_adam8bit.c, test_quant4.c); the BF16 dequantization against RNE of the CPU's values;
 *   - the 4-bit matmuls: float64 dot products of the CPU's dequantized weights, within the fp32
 *     dot-product bound |err| <= gamma(K+1) * sum |a||b| (+ |beta y|), gamma(k) = k u / (1 - k u),
 *     u = 2^-24 (a derived bound, no tuned tolerance);
 *   - the masked dx update: float64 dx + t / (1 - p) within two roundings (the CPU build may fuse
 *     the multiply-add, the kernel rounds twice), and masked-out entries untouched bit for bit.
 * Every kernel runs twice under two emulator shuffle seeds: the same bits (determinism). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/dtype.h"
#include "fitllm/lora.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/cu_kernels_train.h"
#include "backend/cuda/emu/cu_emu.h"
#include "cuda_emu_test.h"
#include "q4_part.h"

static const uint64_t k_seeds[] = {0x51ed5eedull, 0xc0ffee11ull};

static void *dup_bytes(const void *x, size_t bytes) {
    void *y = malloc(bytes ? bytes : 1);
    memcpy(y, x, bytes);
    return y;
}
static fl_backend cpu2(void) {
    fl_backend be;
    fl_cpu_backend_init(&be, 2);
    return be;
}

/* ---- embeddings ------------------------------------------------------------------------------ */

static void embedding_case(int B, int T, int C, int V, int with_wpe) {
    fl_backend be = cpu2();
    fl_test_rng r = {(unsigned long long)(B * 1000003 + T * 1009 + C * 7 + V)};
    const int N = B * T;
    const size_t nc = (size_t)N * C;
    int32_t *ids = malloc(N * sizeof(int32_t));
    for (int n = 0; n < N; n++) ids[n] = (int32_t)(fl_test_rng_u64(&r) % (uint64_t)V);
    ids[N - 1] = ids[0]; /* at least one repeat, the last token in the first's group */
    float *wte = fl_test_frand(&r, (size_t)V * C, -1, 1), *wpe = with_wpe ? fl_test_frand(&r, (size_t)T * C, -1, 1) : NULL;
    float *out = malloc(nc * 4), *cout = malloc(nc * 4);
    be.embedding_forward(&be, cout, ids, wte, wpe, B, T, C);
    float *dout = fl_test_frand(&r, nc, -1, 1);
    float *dwte0 = fl_test_frand(&r, (size_t)V * C, -0.5f, 0.5f), *dwpe0 = fl_test_frand(&r, (size_t)T * C, -0.5f, 0.5f);
    float *cdwte = dup_bytes(dwte0, (size_t)V * C * 4), *cdwpe = dup_bytes(dwpe0, (size_t)T * C * 4);
    be.embedding_backward(&be, cdwte, with_wpe ? cdwpe : NULL, dout, ids, B, T, C);
    int32_t *work = malloc(FL_CU_EMB_WORK_INTS(N) * sizeof(int32_t));
    float *dwte[2], *dwpe[2];
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memset(out, 0xff, nc * 4);
        EMU_OK(fl_cuemu_embedding_forward(out, ids, wte, wpe, B, T, C, NULL));
        FL_CHECKF(memcmp(out, cout, nc * 4) == 0, "embedding_forward (B=%d T=%d C=%d wpe=%d): not the CPU's bits", B, T,
                  C, with_wpe);
        dwte[k] = dup_bytes(dwte0, (size_t)V * C * 4);
        dwpe[k] = dup_bytes(dwpe0, (size_t)T * C * 4);
        EMU_OK(fl_cuemu_embedding_backward(dwte[k], with_wpe ? dwpe[k] : NULL, dout, ids, B, T, C, work, NULL));
    }
    FL_CHECKF(memcmp(dwte[0], cdwte, (size_t)V * C * 4) == 0,
              "embedding_backward dwte (B=%d T=%d C=%d V=%d): not the CPU's bits", B, T, C, V);
    FL_CHECKF(memcmp(dwpe[0], cdwpe, (size_t)T * C * 4) == 0,
              "embedding_backward dwpe (B=%d T=%d C=%d): not the CPU's bits", B, T, C);
    FL_CHECK(memcmp(dwte[0], dwte[1], (size_t)V * C * 4) == 0 && memcmp(dwpe[0], dwpe[1], (size_t)T * C * 4) == 0);
    /* dwte NULL: only dwpe moves (and no work needed) */
    float *only = dup_bytes(dwpe0, (size_t)T * C * 4);
    EMU_OK(fl_cuemu_embedding_backward(NULL, only, dout, ids, B, T, C, NULL, NULL));
    FL_CHECK(memcmp(only, cdwpe, (size_t)T * C * 4) == 0 || !with_wpe);
    for (int k = 0; k < 2; k++) { free(dwte[k]); free(dwpe[k]); }
    free(only); free(ids); free(wte); free(wpe); free(out); free(cout); free(dout); free(dwte0); free(dwpe0);
    free(cdwte); free(cdwpe); free(work);
}

/* embedding_forward16 (16-bit table, one launch): the CPU's widen-then-add bits (the exact
 * widening of each row, then the one fp32 add of the position row) */
static void embedding16_case(fl_dtype dt, int B, int T, int C, int V, int with_wpe) {
    fl_backend be = cpu2();
    fl_test_rng r = {(uint64_t)(B * 131 + T * 7 + C + dt)};
    const int N = B * T;
    const size_t nc = (size_t)N * C;
    int32_t *ids = malloc(N * sizeof(int32_t));
    for (int n = 0; n < N; n++) ids[n] = (int32_t)(fl_test_rng_u64(&r) % (uint64_t)V);
    float *wte = fl_test_frand(&r, (size_t)V * C, -1, 1), *wpe = fl_test_frand(&r, (size_t)T * C, -1, 1);
    uint16_t *wte16 = malloc((size_t)V * C * 2), *wpe16 = malloc((size_t)T * C * 2);
    FL_REQUIRE_OK(fl_convert(wte16, dt, wte, FL_F32, (size_t)V * C));
    FL_REQUIRE_OK(fl_convert(wpe16, dt, wpe, FL_F32, (size_t)T * C));
    FL_REQUIRE_OK(fl_convert(wte, FL_F32, wte16, dt, (size_t)V * C)); /* the widened tables */
    FL_REQUIRE_OK(fl_convert(wpe, FL_F32, wpe16, dt, (size_t)T * C));
    float *out = malloc(nc * 4), *cout = malloc(nc * 4);
    be.embedding_forward(&be, cout, ids, wte, with_wpe ? wpe : NULL, B, T, C);
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memset(out, 0xff, nc * 4);
        EMU_OK(fl_cuemu_embedding_forward16(out, NULL, ids, wte16, with_wpe ? wpe16 : NULL, dt, B, T, C, NULL));
        FL_CHECKF(memcmp(out, cout, nc * 4) == 0, "embedding_forward16 (%s B=%d T=%d C=%d wpe=%d): not the CPU's bits",
                  fl_dtype_name(dt), B, T, C, with_wpe);
    }
    FL_CHECK(fl_cuemu_embedding_forward16(out, NULL, ids, wte, NULL, FL_F32, B, T, C, NULL) != 0); /* 16-bit tables only */
    /* out16 (the first residual row stored in bf16): the CPU's rounding of those bits, out its exact widening */
    uint16_t *want16 = malloc(nc * 2), *got16 = malloc(nc * 2);
    FL_REQUIRE_OK(fl_convert(want16, FL_BF16, cout, FL_F32, nc));
    FL_REQUIRE_OK(fl_convert(cout, FL_F32, want16, FL_BF16, nc));
    memset(got16, 0xff, nc * 2);
    EMU_OK(fl_cuemu_embedding_forward16(out, got16, ids, wte16, with_wpe ? wpe16 : NULL, dt, B, T, C, NULL));
    FL_CHECKF(!memcmp(got16, want16, nc * 2) && !memcmp(out, cout, nc * 4),
              "embedding_forward16 out16 (%s B=%d T=%d C=%d wpe=%d): not round16's bits", fl_dtype_name(dt), B, T, C,
              with_wpe);
    free(want16); free(got16);
    free(ids); free(wte); free(wpe); free(wte16); free(wpe16); free(out); free(cout);
}

/* round16: the 16-bit copy = the CPU's rounding, the fp32 view = its exact widening (odd n: a
 * partial warp and block; n > one grid stride) */
static void round16_case(fl_dtype dt, size_t n) {
    fl_test_rng r = {n * 3 + dt};
    float *x = fl_test_frand(&r, n, -300, 300), *want = malloc(n * 4), *got = malloc(n * 4);
    uint16_t *w16 = malloc(n * 2), *g16 = malloc(n * 2);
    FL_REQUIRE_OK(fl_convert(w16, dt, x, FL_F32, n));
    FL_REQUIRE_OK(fl_convert(want, FL_F32, w16, dt, n));
    memcpy(got, x, n * 4);
    memset(g16, 0xff, n * 2);
    EMU_OK(fl_cuemu_round16(g16, dt, got, n, NULL));
    FL_CHECKF(memcmp(g16, w16, n * 2) == 0 && memcmp(got, want, n * 4) == 0, "round16 %s n=%zu: not the CPU's bits",
              fl_dtype_name(dt), n);
    FL_CHECK(fl_cuemu_round16(g16, FL_F32, got, n, NULL) != 0);
    free(x); free(want); free(got); free(w16); free(g16);
}

/* convert_many: each segment the bits of one convert (bf16/fp16 <-> fp32, segments of different lengths:
 * empty, a partial block, more than one grid stride), the bytes after each segment untouched; too many
 * segments refused */
static void convert_many_case(fl_dtype dt, fl_dtype st) {
    enum { K = 5 };
    const size_t len[K] = {37, 0, 1, 300001, 256};
    void *dst[K], *want[K];
    const void *src[K];
    fl_test_rng r = {(uint64_t)(dt * 7 + st)};
    const size_t ds = dt == FL_F32 ? 4 : 2, ss = st == FL_F32 ? 4 : 2;
    for (int k = 0; k < K; k++) {
        float *f = fl_test_frand(&r, len[k] + 1, -100, 100);
        void *x = malloc((len[k] + 1) * ss);
        FL_REQUIRE_OK(fl_convert(x, st, f, FL_F32, len[k] + 1));
        src[k] = x;
        want[k] = malloc((len[k] + 1) * ds);
        dst[k] = malloc((len[k] + 1) * ds);
        memset(want[k], 0x5a, (len[k] + 1) * ds);
        memset(dst[k], 0x5a, (len[k] + 1) * ds);
        EMU_OK(fl_cuemu_convert(want[k], dt, x, st, len[k], NULL));
        free(f);
    }
    EMU_OK(fl_cuemu_convert_many(K, dst, dt, src, st, len, NULL));
    for (int k = 0; k < K; k++)
        FL_CHECKF(memcmp(dst[k], want[k], (len[k] + 1) * ds) == 0, "convert_many %s <- %s segment %d (%zu): not convert's bytes",
                  fl_dtype_name(dt), fl_dtype_name(st), k, len[k]);
    void *many_d[FL_CU_CONVERT_MANY_MAX + 1];
    const void *many_s[FL_CU_CONVERT_MANY_MAX + 1];
    size_t many_n[FL_CU_CONVERT_MANY_MAX + 1] = {0};
    for (int k = 0; k <= FL_CU_CONVERT_MANY_MAX; k++) many_d[k] = dst[0], many_s[k] = src[0];
    FL_CHECK(fl_cuemu_convert_many(FL_CU_CONVERT_MANY_MAX + 1, many_d, dt, many_s, st, many_n, NULL) != 0);
    for (int k = 0; k < K; k++) {
        free((void *)src[k]);
        free(dst[k]);
        free(want[k]);
    }
}

FL_TEST(cuda_more_convert_many) {
    convert_many_case(FL_F32, FL_BF16); /* the widening before a block's backward */
    convert_many_case(FL_BF16, FL_F32);
    convert_many_case(FL_F32, FL_F16);
}

FL_TEST(cuda_more_round16) {
    round16_case(FL_BF16, 1);
    round16_case(FL_BF16, 37);
    round16_case(FL_F16, 1000);
    round16_case(FL_BF16, 70001);
}

/* rmsnorm_forward_w16 / rmsnorm_backward_w16 (the norm weight read in 16 bits): the bits of the fp32-weight
 * kernels over the exactly widened weight (those are checked against float64 and the CPU in test_ops.c
 * under cuda-emu), forward (out, rstd) and backward (dx and dw accumulating into nonzero buffers); x
 * offset by off floats (off 1: the scalar path at C % 4 == 0). */
static void rmsnorm_w16_case(fl_dtype dt, int N, int C, int off) {
    fl_test_rng r = {(uint64_t)(N * 977 + C * 13 + off + dt)};
    const size_t nc = (size_t)N * C;
    float *xb = fl_test_frand(&r, nc + 4, -2, 2), *x = xb + off, *w = fl_test_frand(&r, (size_t)C, 0.5f, 1.5f);
    float *dy = fl_test_frand(&r, nc, -1, 1), *dx0 = fl_test_frand(&r, nc, -1, 1), *dw0 = fl_test_frand(&r, (size_t)C, -1, 1);
    uint16_t *w16 = malloc((size_t)C * 2);
    FL_REQUIRE_OK(fl_convert(w16, dt, w, FL_F32, (size_t)C));
    FL_REQUIRE_OK(fl_convert(w, FL_F32, w16, dt, (size_t)C)); /* the widened weight */
    float *o1 = malloc(nc * 4), *o2 = malloc(nc * 4), *r1 = malloc((size_t)N * 4), *r2 = malloc((size_t)N * 4);
    float *dx1 = dup_bytes(dx0, nc * 4), *dx2 = dup_bytes(dx0, nc * 4);
    float *dw1 = dup_bytes(dw0, (size_t)C * 4), *dw2 = dup_bytes(dw0, (size_t)C * 4);
    EMU_OK(fl_cuemu_rmsnorm_forward(o1, r1, x, w, N, C, 1e-5f, NULL));
    EMU_OK(fl_cuemu_rmsnorm_backward(dx1, dw1, dy, x, w, r1, N, C, EMU_WORK, NULL));
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memset(o2, 0xff, nc * 4);
        memcpy(dx2, dx0, nc * 4);
        memcpy(dw2, dw0, (size_t)C * 4);
        EMU_OK(fl_cuemu_rmsnorm_forward_w16(o2, NULL, r2, x, w16, dt, N, C, 1e-5f, NULL));
        EMU_OK(fl_cuemu_rmsnorm_backward_w16(dx2, NULL, dw2, dy, x, NULL, w16, dt, r2, N, C, EMU_WORK, NULL));
        FL_CHECKF(!memcmp(o1, o2, nc * 4) && !memcmp(r1, r2, (size_t)N * 4) && !memcmp(dx1, dx2, nc * 4) &&
                      !memcmp(dw1, dw2, (size_t)C * 4),
                  "rmsnorm w16 (%s N=%d C=%d off=%d): not the fp32-weight kernels' bits", fl_dtype_name(dt), N, C, off);
    }
    /* and the forward against float64 with the widened weight, at test_ops.c's RMSNorm tolerance */
    float *want = malloc(nc * 4);
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int c = 0; c < C; c++) ss += (double)x[(size_t)n * C + c] * x[(size_t)n * C + c];
        const double rr = 1.0 / sqrt(ss / C + 1e-5);
        for (int c = 0; c < C; c++) want[(size_t)n * C + c] = (float)(x[(size_t)n * C + c] * rr * w[c]);
    }
    FL_CHECK(fl_test_allclose("rmsnorm w16 out", o2, want, nc, 1e-5, 1e-6));
    free(want);
    /* out16: the bf16 copy = the CPU's rounding of the output, the fp32 output its exact widening (round16's bits) */
    uint16_t *c16 = malloc(nc * 2), *g16 = malloc(nc * 2);
    float *o3 = malloc(nc * 4);
    FL_REQUIRE_OK(fl_convert(c16, FL_BF16, o1, FL_F32, nc));
    FL_REQUIRE_OK(fl_convert(o1, FL_F32, c16, FL_BF16, nc));
    memset(g16, 0xff, nc * 2);
    EMU_OK(fl_cuemu_rmsnorm_forward_w16(o3, g16, r2, x, w16, dt, N, C, 1e-5f, NULL));
    FL_CHECKF(!memcmp(g16, c16, nc * 2) && !memcmp(o3, o1, nc * 4), "rmsnorm w16 (%s N=%d C=%d off=%d): out16 not the rounded output",
              fl_dtype_name(dt), N, C, off);
    /* out NULL (a stored slot's fp32 view nothing reads, issue 30 item 1): the same bf16 copy and rstd, vector and
     * scalar paths; with an fp32 weight too (bf16-mixed) */
    for (int f32w = 0; f32w < 2; f32w++) {
        memset(g16, 0xff, nc * 2);
        memset(r2, 0xff, (size_t)N * 4);
        EMU_OK(fl_cuemu_rmsnorm_forward_w16(NULL, g16, r2, x, f32w ? (const void *)w : w16, f32w ? FL_F32 : dt, N, C,
                                            1e-5f, NULL));
        FL_CHECKF(!memcmp(g16, c16, nc * 2) && !memcmp(r1, r2, (size_t)N * 4),
                  "rmsnorm w16 (%s N=%d C=%d off=%d f32w %d) out NULL: not the full path's out16 / rstd", fl_dtype_name(dt),
                  N, C, off, f32w);
    }
    FL_CHECK(fl_cuemu_rmsnorm_forward_w16(NULL, NULL, r2, x, w16, dt, N, C, 1e-5f, NULL) != 0); /* no output at all */
    /* dinp16: bf16 of the accumulated dx (the CPU's rounding of dx1), dx itself and dw the unrounded bits */
    memcpy(dx2, dx0, nc * 4);
    memcpy(dw2, dw0, (size_t)C * 4);
    memset(g16, 0xff, nc * 2);
    FL_REQUIRE_OK(fl_convert(c16, FL_BF16, dx1, FL_F32, nc));
    EMU_OK(fl_cuemu_rmsnorm_backward_w16(dx2, g16, dw2, dy, x, NULL, w16, dt, r2, N, C, EMU_WORK, NULL));
    FL_CHECKF(!memcmp(g16, c16, nc * 2) && !memcmp(dx2, dx1, nc * 4) && !memcmp(dw2, dw1, (size_t)C * 4),
              "rmsnorm w16 (%s N=%d C=%d off=%d): dinp16 not the rounded dx, or dx / dw changed", fl_dtype_name(dt), N, C,
              off);
    free(c16); free(g16); free(o3);
    FL_CHECK(fl_cuemu_rmsnorm_forward_w16(o2, NULL, r2, x, w, FL_F32, N, C, 1e-5f, NULL) != 0); /* 16-bit weights only */
    free(xb); free(w); free(dy); free(dx0); free(dw0); free(w16); free(o1); free(o2); free(r1); free(r2);
    free(dx1); free(dx2); free(dw1); free(dw2);
}

FL_TEST(cuda_more_rmsnorm_w16) {
    rmsnorm_w16_case(FL_BF16, 5, 64, 0);   /* 128-bit path, 16 threads */
    rmsnorm_w16_case(FL_BF16, 5, 64, 1);   /* misaligned x: the scalar path */
    rmsnorm_w16_case(FL_F16, 3, 37, 0);    /* odd C: partial warp */
    rmsnorm_w16_case(FL_BF16, 130, 300, 0); /* 75 threads; N > 128: two row groups in the dw column sum */
    rmsnorm_w16_case(FL_F16, 2, 1030, 0);  /* C / 4 > 256: several column steps per thread */
}

FL_TEST(cuda_more_embedding16) {
    embedding16_case(FL_BF16, 3, 7, 37, 11, 1);  /* partial warp of columns */
    embedding16_case(FL_BF16, 2, 5, 13, 1, 0);   /* one id, no positions (LLaMA) */
    embedding16_case(FL_F16, 4, 75, 300, 17, 1); /* two 256-column slices, fp16 */
    embedding16_case(FL_F16, 1, 3, 5, 4, 0);
    embedding16_case(FL_BF16, 2, 5, 64, 9, 1);  /* C % 8 == 0: 8 columns per thread, 128-bit accesses */
    embedding16_case(FL_F16, 1, 3, 2056, 5, 1); /* 257 groups of 8: two column steps per thread */
}

FL_TEST(cuda_more_embedding) {
    embedding_case(3, 7, 37, 11, 1);   /* partial warp of columns, many repeats */
    embedding_case(2, 5, 13, 1, 0);    /* every token the same id: one group of all */
    embedding_case(4, 75, 300, 17, 1); /* 300 tokens: all 8 rank slices busy; two 256-column slices */
}

/* ---- 8-bit AdamW ----------------------------------------------------------------------------- */

static void *to_type(const float *x, size_t n, fl_dtype t) {
    if (t == FL_F32) return dup_bytes(x, n * 4);
    uint16_t *h = malloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = t == FL_F16 ? fl_f32_to_f16(x[i]) : fl_f32_to_bf16(x[i]);
    return h;
}

static void adam8bit_case(size_t n, fl_dtype tp, fl_dtype tg) {
    fl_backend be = cpu2();
    fl_test_rng r = {(unsigned long long)n * 31 + tp * 7 + tg};
    const size_t sb = fl_adam8bit_state_bytes(n), ps = tp == FL_F32 ? 4 : 2, gs = tg == FL_F32 ? 4 : 2;
    float *p0 = fl_test_frand(&r, n, -1, 1);
    void *pc = to_type(p0, n, tp), *pe[2] = {to_type(p0, n, tp), to_type(p0, n, tp)};
    void *mc = calloc(1, sb + 8), *me[2] = {calloc(1, sb + 8), calloc(1, sb + 8)};
    fl_adam8bit_state stc, ste[2];
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&stc, n, mc));
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&ste[0], n, me[0]));
    FL_REQUIRE_OK(fl_adam8bit_state_bind(&ste[1], n, me[1]));
    for (int step = 1; step <= 3; step++) {
        float *g32 = fl_test_frand(&r, n, -2, 2);
        /* a few elements at several magnitudes (codes near 0 and both map ends), and inf/NaN gradients */
        for (size_t i = 0; i < n; i += 97) g32[i] *= 1e-4f;
        if (n > 600) {
            g32[5] = INFINITY;
            g32[300] = NAN;
            g32[n - 1] = -INFINITY;
        }
        void *g = to_type(g32, n, tg);
        const float wd = step == 2 ? 0.0f : 0.1f;
        FL_REQUIRE_OK(be.adam8bit_update(&be, pc, tp, g, tg, &stc, 1e-2f, 0.9f, 0.995f, 1e-6f, wd, step, 0.7f));
        for (int k = 0; k < 2; k++) {
            fl_cu_emu_set_seed(k_seeds[k]);
            EMU_OK(fl_cuemu_adam8bit_update(pe[k], tp, g, tg, &ste[k], 1e-2f, 0.9f, 0.995f, 1e-6f, wd, step, 0.7f, NULL));
        }
        free(g32); free(g);
    }
    FL_CHECKF(memcmp(pe[0], pc, n * ps) == 0, "adam8bit n=%zu p=%s g=%s: parameters differ from the CPU's", n,
              fl_dtype_name(tp), fl_dtype_name(tg));
    if (fl_adam8bit_is_8bit(n)) {
        size_t dq = 0, dv = 0;
        for (size_t i = 0; i < n; i++) {
            dq += stc.q_m[i] != ste[0].q_m[i];
            dv += stc.q_v[i] != ste[0].q_v[i];
        }
        FL_CHECKF(dq == 0 && dv == 0, "adam8bit n=%zu: %zu m codes and %zu v codes differ from the CPU's", n, dq, dv);
        FL_CHECK(memcmp(stc.absmax_m, ste[0].absmax_m, stc.n_blocks * 4) == 0);
        FL_CHECK(memcmp(stc.absmax_v, ste[0].absmax_v, stc.n_blocks * 4) == 0);
    } else {
        FL_CHECK(memcmp(stc.m, ste[0].m, n * 4) == 0 && memcmp(stc.v, ste[0].v, n * 4) == 0);
    }
    FL_CHECK(memcmp(pe[0], pe[1], n * ps) == 0 && memcmp(me[0], me[1], sb) == 0);
    (void)gs;
    free(p0); free(pc); free(pe[0]); free(pe[1]); free(mc); free(me[0]); free(me[1]);
}

FL_TEST(cuda_more_adam8bit) {
    float codes[512];
    EMU_OK(fl_cuemu_adam8bit_codes(codes, NULL));
    FL_CHECK(memcmp(codes, fl_adam8bit_code_signed, 1024) == 0 && memcmp(codes + 256, fl_adam8bit_code_unsigned, 1024) == 0);
    adam8bit_case(2 * FL_ADAM8BIT_MIN_SIZE + 77, FL_F32, FL_F32); /* 8-bit path, a partial last block */
    adam8bit_case(FL_ADAM8BIT_MIN_SIZE + 3, FL_BF16, FL_BF16);
    adam8bit_case(FL_ADAM8BIT_MIN_SIZE, FL_F32, FL_BF16);
    adam8bit_case(1000, FL_F32, FL_F32); /* fp32-state path */
    adam8bit_case(333, FL_BF16, FL_F32);
    adam8bit_case(FL_ADAM8BIT_MIN_SIZE + 3, FL_F16, FL_F16); /* 16-true: fp16 parameters and gradients */
    adam8bit_case(333, FL_F16, FL_F16);
    fl_adam8bit_state st = {0};
    st.n = 10;
    float d = 0;
    FL_CHECK(fl_cuemu_adam8bit_update(&d, FL_F16, &d, FL_F32, &st, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1, 1, NULL) == -1);
}

/* ---- 4-bit matmuls and dequantization -------------------------------------------------------- */

typedef struct {
    fl_q4_weight w;
    void *mem;
    float *deq; /* the CPU's fl_q4_dequantize */
} q4_fixture;

static int q4_make(q4_fixture *f, int rows, int cols, fl_q4_type t, int dq, fl_test_rng *r) {
    float *src = fl_test_frand(r, (size_t)rows * cols, -1, 1);
    for (int i = 0; i < cols && i < 64; i++) src[i] = 0.0f; /* a zero block (absmax 0) when cols >= 64 */
    f->mem = calloc(1, fl_q4_bytes((size_t)rows * cols, dq));
    f->deq = malloc((size_t)rows * cols * 4);
    int ok = fl_q4_bind(&f->w, rows, cols, t, dq, f->mem) == FL_OK && fl_q4_quantize(&f->w, src, 2) == FL_OK &&
             fl_q4_dequantize(&f->w, f->deq, 2) == FL_OK;
    free(src);
    return ok;
}
static void q4_free(q4_fixture *f) { free(f->mem); free(f->deq); }

/* |got - sum| <= gamma(K+1) * (sum |a||b| + |y0|): the fp32 evaluation bound of a length-K dot
 * product plus one more addition (beta = 1) */
static int dot_close(const char *what, const float *got, const double *want, const double *absum, size_t n, int K) {
    const double u = 1.0 / 16777216.0, gamma = (K + 1) * u / (1 - (K + 1) * u);
    for (size_t i = 0; i < n; i++)
        if (!(fabs(got[i] - want[i]) <= gamma * absum[i] + 1e-30)) {
            fprintf(stderr, "  %s: element %zu got %.9g want %.9g (bound %.3g)\n", what, i, got[i], want[i],
                    gamma * absum[i]);
            return 0;
        }
    return 1;
}

/* the kernels on f's weight (OUT, IN) against f.deq: the dequantized panel bit for bit, the matmuls within the fp32
 * dot-product bound of float64 sums over f.deq */
static void q4_check(q4_fixture *f_, int N, const char *mode, fl_test_rng *rp) {
    q4_fixture f = *f_;
    fl_test_rng r = *rp;
    const int OUT = f.w.rows, IN = f.w.cols;
    /* dequantize: a panel of rows into a strided F32 / BF16 destination */
    const int r0 = OUT > 3 ? 2 : 0, nr = OUT - r0 - (OUT > 5 ? 1 : 0), ldd = IN + 3;
    float *d32 = malloc((size_t)nr * ldd * 4);
    uint16_t *d16 = malloc((size_t)nr * ldd * 2);
    EMU_OK(fl_cuemu_q4_dequantize(d32, FL_F32, ldd, &f.w, r0, nr, NULL));
    EMU_OK(fl_cuemu_q4_dequantize(d16, FL_BF16, ldd, &f.w, r0, nr, NULL));
    int bad32 = 0, bad16 = 0;
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < IN; c++) {
            float want = f.deq[(size_t)(r0 + i) * IN + c];
            bad32 += memcmp(&d32[(size_t)i * ldd + c], &want, 4) != 0;
            bad16 += d16[(size_t)i * ldd + c] != fl_f32_to_bf16(want);
        }
    FL_CHECKF(bad32 == 0 && bad16 == 0, "q4_dequantize %s (%d x %d): %d f32 / %d bf16 values differ", mode, OUT, IN, bad32,
              bad16);
    /* and into rows of whole 16-byte units (ldd a multiple of 8: the 128-bit stores of the runs of 8 that start at a
     * multiple of 8), every row */
    {
        const int ld8 = (IN + 7) & ~7;
        float *e32 = malloc((size_t)OUT * ld8 * 4);
        uint16_t *e16 = malloc((size_t)OUT * ld8 * 2);
        const unsigned long v0 = fl_cu_emu_vec_accesses;
        EMU_OK(fl_cuemu_q4_dequantize(e32, FL_F32, ld8, &f.w, 0, OUT, NULL));
        EMU_OK(fl_cuemu_q4_dequantize(e16, FL_BF16, ld8, &f.w, 0, OUT, NULL));
        int bad = 0;
        for (int i = 0; i < OUT; i++)
            for (int c = 0; c < IN; c++) {
                const float want = f.deq[(size_t)i * IN + c];
                bad += memcmp(&e32[(size_t)i * ld8 + c], &want, 4) != 0 || e16[(size_t)i * ld8 + c] != fl_f32_to_bf16(want);
            }
        FL_CHECKF(bad == 0, "q4_dequantize %s (%d x %d) into rows of %d: %d values differ", mode, OUT, IN, ld8, bad);
        /* a row map or odd row lengths may leave no run aligned; whole 64-element rows always are */
        FL_CHECKF(IN % 64 || f.w.row_start || fl_cu_emu_vec_accesses > v0, "q4_dequantize %s (%d x %d): no 128-bit store",
                  mode, OUT, IN);
        free(e32), free(e16);
    }

    /* forward: y (N, OUT; ldy) = x @ deq^T + beta y */
    const int ldy = OUT + 5;
    float *x = fl_test_frand(&r, (size_t)N * IN, -1, 1), *y0 = fl_test_frand(&r, (size_t)N * ldy, -1, 1);
    const size_t nmax = (size_t)N * (ldy > IN ? ldy : IN);
    double *want = malloc(nmax * 8), *absum = malloc(nmax * 8);
    float *got = malloc((size_t)N * ldy * 4);
    for (int beta = 0; beta <= 1; beta++) {
        float *y[2];
        for (int k = 0; k < 2; k++) {
            fl_cu_emu_set_seed(k_seeds[k]);
            y[k] = dup_bytes(y0, (size_t)N * ldy * 4);
            EMU_OK(fl_cuemu_q4_matmul_forward(y[k], ldy, x, &f.w, N, (float)beta, NULL));
        }
        FL_CHECK(memcmp(y[0], y[1], (size_t)N * ldy * 4) == 0);
        size_t m = 0;
        int pad_ok = 1;
        for (int n = 0; n < N; n++) {
            for (int o = 0; o < OUT; o++, m++) {
                double s = beta ? y0[(size_t)n * ldy + o] : 0.0, a = fabs(s);
                for (int k = 0; k < IN; k++) {
                    double p = (double)x[(size_t)n * IN + k] * f.deq[(size_t)o * IN + k];
                    s += p;
                    a += fabs(p);
                }
                want[m] = s;
                absum[m] = a;
                got[m] = y[0][(size_t)n * ldy + o];
            }
            for (int o = OUT; o < ldy; o++) pad_ok &= y[0][(size_t)n * ldy + o] == y0[(size_t)n * ldy + o];
        }
        FL_CHECKF(dot_close("q4_matmul_forward", got, want, absum, m, IN), "forward %s N=%d %dx%d beta=%d", mode, N, OUT,
                  IN, beta);
        FL_CHECKF(pad_ok, "forward %s: columns past OUT in the row stride were written", mode);
        free(y[0]); free(y[1]);
    }

    /* backward: dx (N, IN) = dy (N, OUT; ldy) @ deq + beta dx */
    float *dy = fl_test_frand(&r, (size_t)N * ldy, -1, 1), *dx0 = fl_test_frand(&r, (size_t)N * IN, -1, 1);
    for (int beta = 0; beta <= 1; beta++) {
        float *dx[2];
        for (int k = 0; k < 2; k++) {
            fl_cu_emu_set_seed(k_seeds[k]);
            dx[k] = dup_bytes(dx0, (size_t)N * IN * 4);
            EMU_OK(fl_cuemu_q4_matmul_backward(dx[k], dy, ldy, &f.w, N, (float)beta, NULL));
        }
        FL_CHECK(memcmp(dx[0], dx[1], (size_t)N * IN * 4) == 0);
        size_t m = 0;
        for (int n = 0; n < N; n++)
            for (int k = 0; k < IN; k++, m++) {
                double s = beta ? dx0[m] : 0.0, a = fabs(s);
                for (int o = 0; o < OUT; o++) {
                    double p = (double)dy[(size_t)n * ldy + o] * f.deq[(size_t)o * IN + k];
                    s += p;
                    a += fabs(p);
                }
                want[m] = s;
                absum[m] = a;
            }
        FL_CHECKF(dot_close("q4_matmul_backward", dx[0], want, absum, m, OUT), "backward %s N=%d %dx%d beta=%d", mode, N,
                  OUT, IN, beta);
        free(dx[0]); free(dx[1]);
    }
    FL_CHECK(fl_cuemu_q4_matmul_forward(got, ldy, x, &f.w, N, 0.5f, NULL) == -1); /* beta must be 0 or 1 */
    free(d32); free(d16); free(x); free(y0); free(want); free(absum); free(got); free(dy); free(dx0);
}

static void q4_case(int N, int OUT, int IN, fl_q4_type t, int dq) {
    fl_test_rng r = {(unsigned long long)(N * 7919 + OUT * 131 + IN + t * 3 + dq)};
    q4_fixture f;
    FL_REQUIRE(q4_make(&f, OUT, IN, t, dq, &r));
    q4_check(&f, N, fl_q4_mode_name(t, dq), &r);
    q4_free(&f);
}

/* QLoRA where a tensor-parallel rank's part cuts the blocks (issue 35): the part (R, K) of a whole (RW, KW) quantized
 * as one, held as the whole blocks covering it with a row map (tests/q4_part.h); kind / a / b as q4p_starts. The
 * expected values are the whole's dequantized values at the part's elements (the CPU's fl_q4_dequantize of the whole),
 * so a wrong row map or block copy fails the bit check; the CPU's own dequantization of the part gives them too. */
static void q4_cut_case(int N, q4p_kind kind, int RW, int KW, int R, int K, int a, int b, fl_q4_type t, int dq) {
    fl_test_rng r = {(unsigned long long)(N * 7919 + RW * 131 + KW + R * 17 + K * 5 + kind + t * 3 + dq)};
    q4_fixture whole, part = {0};
    FL_REQUIRE(q4_make(&whole, RW, KW, t, dq, &r));
    size_t *starts = malloc((size_t)R * sizeof *starts);
    part.deq = malloc((size_t)R * K * sizeof(float));
    q4p_starts(kind, R, KW, a, b, starts);
    FL_REQUIRE(q4p_make(&whole.w, whole.deq, starts, R, K, &part.w, &part.mem, part.deq));
    FL_CHECK(part.w.row_start && part.w.double_quant == 0 && part.w.n_blocks >= ((size_t)R * K + 63) / 64);
    float *cpu = malloc((size_t)R * K * sizeof(float));
    FL_REQUIRE_OK(fl_q4_dequantize(&part.w, cpu, 1));
    FL_CHECKF(memcmp(cpu, part.deq, (size_t)R * K * sizeof(float)) == 0, "the CPU's dequantized cut part (%d x %d of "
              "%d x %d) differs from the whole's values", R, K, RW, KW);
    char mode[64];
    snprintf(mode, sizeof mode, "%s cut part %d x %d of %d x %d", fl_q4_mode_name(t, dq), R, K, RW, KW);
    q4_check(&part, N, mode, &r);
    free(cpu);
    free(starts);
    q4_free(&part);
    q4_free(&whole);
}

FL_TEST(cuda_more_q4_cut_blocks) {
    /* row-parallel: 43 of each row's 131 columns from column 45 (every row starts and ends mid-block; 19 x 37: partial
     * warps and tiles) */
    q4_cut_case(19, Q4P_COLS, 37, 131, 37, 43, 45, 0, FL_Q4_NF4, 0);
    q4_cut_case(19, Q4P_COLS, 37, 131, 37, 43, 45, 0, FL_Q4_FP4, 1); /* double-quantized whole: dequantized absmax */
    /* column-parallel: rows 37 .. 111 of a 150 x 70 whole (one run, cut at both ends; > one 128-row tile of N, K tail
     * of 6 in the forward) */
    q4_cut_case(133, Q4P_ROWS, 150, 70, 75, 70, 37, 0, FL_Q4_NF4, 1);
    /* a fused part (QKV / gate-up): rows 3 .. 22 and 60 .. 79 of a 90 x 45 whole, two runs of blocks */
    q4_cut_case(5, Q4P_FUSED, 90, 45, 40, 45, 3, 60, FL_Q4_FP4, 0);
}

/* The bf16 tensor-core matmuls (issue 30 item 7; EXPERIMENTAL): x / dy and the dequantized W rounded to bf16 (RNE) as
 * they load, products exact in fp32, fp32 sums (the emulator's mma adds its 16 products in order): against float64
 * sums of the RNE-rounded operands (rounded here, by fl_f32_to_bf16) within the same fp32 bound gamma(K+1) sum |a b|
 * (+ |beta y|). A GPU's tensor cores sum in an unspecified order with truncation: check_more.c doubles it there. */
static float rbf(float v) { return fl_bf16_to_f32(fl_f32_to_bf16(v)); }
/* a tensor-parallel part that cuts the blocks (the row map, issue 35): rows 37 .. 111 of a 150 x 70 nf4-dq whole */
static int q4_cut_rows(q4_fixture *whole, q4_fixture *part, fl_test_rng *r) {
    size_t starts[75];
    if (!q4_make(whole, 150, 70, FL_Q4_NF4, 1, r)) return 0;
    part->deq = malloc(75 * 70 * sizeof(float));
    q4p_starts(Q4P_ROWS, 75, 70, 37, 0, starts);
    return part->deq && q4p_make(&whole->w, whole->deq, starts, 75, 70, &part->w, &part->mem, part->deq);
}
static void q4_tc_check(const q4_fixture *f, int N, const char *mode, fl_test_rng *r, const fl_backend *be) {
    const int OUT = f->w.rows, IN = f->w.cols, ldy = OUT + 3, K[2] = {IN, OUT}, Nout[2] = {OUT, IN};
    float *x = fl_test_frand(r, (size_t)N * IN, -1, 1), *dy = fl_test_frand(r, (size_t)N * ldy, -1, 1);
    float *y0 = fl_test_frand(r, (size_t)N * ldy, -1, 1), *dx0 = fl_test_frand(r, (size_t)N * IN, -1, 1);
    const size_t nmax = (size_t)N * (ldy > IN ? ldy : IN);
    double *want = malloc(nmax * 8), *absum = malloc(nmax * 8);
    float *got = malloc(nmax * 4);
    for (int bwd = 0; bwd <= 1; bwd++)
        for (int beta = 0; beta <= 1; beta++) {
            float *o[2];
            const float *in = bwd ? dy : x, *o0 = bwd ? dx0 : y0;
            const int ldi = bwd ? ldy : IN, ldo = bwd ? IN : ldy;
            for (int k = 0; k < 2; k++) {
                fl_cu_emu_set_seed(k_seeds[k]);
                o[k] = dup_bytes(o0, (size_t)N * ldo * 4);
                if (be) /* through the backend's slots (FITLLM_CUDA_Q4's path of a bf16 run) */
                    FL_CHECK((bwd ? be->q4_matmul_backward(be, o[k], dy, ldy, &f->w, N, (float)beta)
                                  : be->q4_matmul_forward(be, o[k], ldy, x, &f->w, N, (float)beta)) == FL_OK &&
                             be->sync(be) == FL_OK);
                else
                    EMU_OK(bwd ? fl_cuemu_q4_matmul_backward_tc(o[k], dy, ldy, &f->w, N, (float)beta, NULL)
                               : fl_cuemu_q4_matmul_forward_tc(o[k], ldy, x, &f->w, N, (float)beta, NULL));
            }
            FL_CHECK(memcmp(o[0], o[1], (size_t)N * ldo * 4) == 0);
            size_t m = 0;
            int pad_ok = 1;
            for (int n = 0; n < N; n++) {
                for (int c = 0; c < Nout[bwd]; c++, m++) {
                    double s = beta ? o0[(size_t)n * ldo + c] : 0.0, a = fabs(s);
                    for (int k = 0; k < K[bwd]; k++) {
                        const float wv = bwd ? f->deq[(size_t)k * IN + c] : f->deq[(size_t)c * IN + k];
                        const double p = (double)rbf(in[(size_t)n * ldi + k]) * rbf(wv);
                        s += p;
                        a += fabs(p);
                    }
                    want[m] = s, absum[m] = a, got[m] = o[0][(size_t)n * ldo + c];
                }
                for (int c = Nout[bwd]; c < ldo; c++) pad_ok &= o[0][(size_t)n * ldo + c] == o0[(size_t)n * ldo + c];
            }
            FL_CHECKF(dot_close(bwd ? "q4_matmul_backward_tc" : "q4_matmul_forward_tc", got, want, absum, m, K[bwd]),
                      "%s %s N=%d %dx%d beta=%d", bwd ? "backward" : "forward", mode, N, OUT, IN, beta);
            FL_CHECKF(pad_ok, "%s tc %s: columns past the output in the row stride were written", mode,
                      bwd ? "backward" : "forward");
            free(o[0]), free(o[1]);
        }
    FL_CHECK(fl_cuemu_q4_matmul_forward_tc(got, ldy, x, &f->w, N, 0.5f, NULL) == -1); /* beta must be 0 or 1 */
    free(x), free(dy), free(y0), free(dx0), free(want), free(absum), free(got);
}

FL_TEST(cuda_more_q4_tc) {
    const struct { int N, OUT, IN; fl_q4_type t; int dq; } c[3] = {
        {19, 37, 131, FL_Q4_NF4, 1},  /* partial warps, tiles and k-steps; blocks straddle rows */
        {70, 130, 48, FL_Q4_FP4, 0},  /* two tiles of output columns and rows, K 48 (one and a half k-steps) */
        {1, 5, 3, FL_Q4_NF4, 0},      /* a 1-row x, K 3 */
    };
    const int light = fl_test_asan_light(); /* ASan's quick tier: the first shape (every path of the kernels) */
    for (int k = 0; k < (light ? 1 : 3); k++) {
        fl_test_rng r = {(unsigned long long)(1000 + k)};
        q4_fixture f;
        FL_REQUIRE(q4_make(&f, c[k].OUT, c[k].IN, c[k].t, c[k].dq, &r));
        q4_tc_check(&f, c[k].N, fl_q4_mode_name(c[k].t, c[k].dq), &r, NULL);
        q4_free(&f);
    }
    if (light) return; /* the row map under ASan: cuda_more_q4_cut_blocks, cuda_more_q4_bf16_paths */
    /* a tensor-parallel part that cuts the blocks (q4_cut_rows) */
    fl_test_rng r = {2000};
    q4_fixture whole, part = {0};
    FL_REQUIRE(q4_cut_rows(&whole, &part, &r));
    q4_tc_check(&part, 33, "nf4-dq cut part 75 x 70 of 150 x 70", &r, NULL);
    q4_free(&part);
    q4_free(&whole);
}

FL_TEST(cuda_more_q4_bf16_paths) {
    fl_test_rng r = {2000};
    q4_fixture whole, part = {0};
    FL_REQUIRE(q4_cut_rows(&whole, &part, &r));
    /* the switch, through the backend's q4_matmul slots in a bf16 run: tc (these kernels) and scratch (W dequantized
     * into a bf16 panel of the work area, then the F32 x bf16 GEMM: the same bf16 operands, the stand-in GEMM's
     * float64 sums rounded per panel; the backward adds its panels in fp32: within the same bound). scratch on 200 x
     * 3000 too: 174 rows of 3000 per 1 MiB panel of the emulator's work area, two panels (the backward accumulates) */
    const char *modes[2] = {"tc", "scratch"};
    q4_fixture big = {0};
    if (!fl_test_quick()) FL_REQUIRE(q4_make(&big, 200, 3000, FL_Q4_FP4, 1, &r));
    for (int k = 0; k < 2; k++) {
        fl_backend be;
        setenv("FITLLM_CUDA_Q4", modes[k], 1);
        FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
        be.set_compute_dtype(&be, FL_BF16);
        char m[80];
        snprintf(m, sizeof m, "FITLLM_CUDA_Q4=%s nf4-dq cut part", modes[k]);
        q4_tc_check(&part, 33, m, &r, &be);
        snprintf(m, sizeof m, "FITLLM_CUDA_Q4=%s fp4-dq 200 x 3000", modes[k]);
        if (k == 1 && !fl_test_quick()) q4_tc_check(&big, 3, m, &r, &be); /* the full tier: ~1 s of emulation */
        fl_backend_free(&be);
    }
    q4_free(&big);
    q4_free(&part);
    q4_free(&whole);
    /* anything else is refused by name */
    fl_backend be;
    setenv("FITLLM_CUDA_Q4", "bf16", 1);
    FL_CHECK(fl_backend_init_by_name("cuda-emu", &be, 1) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "FITLLM_CUDA_Q4=bf16: expected scratch") != NULL, "'%s'", fl_error_message());
    unsetenv("FITLLM_CUDA_Q4");
}

/* q4_matmul_forward16 / _backward16 (issue 30 items 1 and 7, FL_CAP_Q4X16): over x16 / dy16 = RNE(x / dy) they give
 * the bits of q4_matmul_forward / _backward on the fp32 x / dy in a bf16 run's tc and scratch paths (both round x / dy
 * to bf16 before any product: the claim checked bit for bit, each output element), N past the 64-row tile, rows and
 * columns at and across the 64-element blocks, a cut part (row map), row strides that take the 128-bit loads (a
 * multiple of 8) and those that do not, beta 0 and 1; scratch with K past the emulator's GEMM panel (its row panels).
 * Refused in an fp32 run; absent with FITLLM_CUDA_Q4=fp32 or FITLLM_CUDA_Q4X16=0; a bad knob named. */
static void q416_check(const fl_backend *be, const q4_fixture *f, int N, int ldy, const char *what, fl_test_rng *r) {
    const int OUT = f->w.rows, IN = f->w.cols;
    const size_t nx = (size_t)N * IN, ny = (size_t)N * ldy;
    float *x = fl_test_frand(r, nx, -2, 2), *dy = fl_test_frand(r, ny, -2, 2);
    float *y0 = fl_test_frand(r, ny, -1, 1), *dx0 = fl_test_frand(r, nx, -1, 1);
    uint16_t *x16 = malloc(nx * 2), *dy16 = malloc(ny * 2);
    for (size_t i = 0; i < nx; i++) x16[i] = fl_f32_to_bf16(x[i]);
    for (size_t i = 0; i < ny; i++) dy16[i] = fl_f32_to_bf16(dy[i]);
    for (int bwd = 0; bwd <= 1; bwd++)
        for (int beta = 0; beta <= 1; beta++) {
            const size_t n = bwd ? nx : ny;
            float *a = dup_bytes(bwd ? dx0 : y0, n * 4), *b = dup_bytes(bwd ? dx0 : y0, n * 4);
            fl_status s0 = bwd ? be->q4_matmul_backward(be, a, dy, ldy, &f->w, N, (float)beta)
                               : be->q4_matmul_forward(be, a, ldy, x, &f->w, N, (float)beta);
            fl_status s1 = bwd ? be->q4_matmul_backward16(be, b, dy16, ldy, &f->w, 1, N, (float)beta)
                               : be->q4_matmul_forward16(be, b, ldy, x16, &f->w, 1, N, (float)beta);
            FL_CHECKF(s0 == FL_OK && s1 == FL_OK && be->sync(be) == FL_OK, "%s %s: %s", what,
                      bwd ? "backward16" : "forward16", fl_error_message());
            size_t diff = 0;
            for (size_t i = 0; i < n; i++) diff += memcmp(&a[i], &b[i], 4) != 0;
            FL_CHECKF(diff == 0, "%s %s N=%d %dx%d ldy %d beta %d: %zu of %zu elements differ in bits from the fp32 op",
                      what, bwd ? "backward16" : "forward16", N, OUT, IN, ldy, beta, diff, n);
            free(a), free(b);
        }
    free(x), free(dy), free(y0), free(dx0), free(x16), free(dy16);
}

FL_TEST(cuda_more_q416_bits) {
    const struct { int N, OUT, IN, ldy; fl_q4_type t; int dq; } c[] = {
        {19, 37, 131, 40, FL_Q4_NF4, 1},  /* partial tiles, blocks straddling rows; x rows not 8-aligned, dy rows are */
        {70, 64, 128, 67, FL_Q4_NF4, 0},  /* rows and columns on the block edges, N past the 64-row tile; dy unaligned */
        {5, 130, 48, 136, FL_Q4_FP4, 0},  /* two tiles of output columns, K 48 (one and a half k-steps) */
        {40, 24, 1100, 24, FL_Q4_NF4, 1}, /* scratch: K 1100 over the emulator's GEMM panel (29 rows a panel) */
    };
    const char *modes[2] = {"tc", "scratch"};
    for (int k = 0; k < 2; k++) {
        fl_backend be;
        setenv("FITLLM_CUDA_Q4", modes[k], 1);
        FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
        FL_CHECKF((be.caps & FL_CAP_Q4X16) && be.q4_matmul_forward16 && be.q4_matmul_backward16,
                  "FITLLM_CUDA_Q4=%s: no FL_CAP_Q4X16 or its slots", modes[k]);
        if (!be.q4_matmul_forward16) { fl_backend_free(&be); continue; }
        /* an fp32 run computes its 4-bit matmuls in fp32: refused */
        float y = 0;
        uint16_t x16 = 0;
        fl_test_rng r = {3000 + (unsigned)k};
        q4_fixture f;
        FL_REQUIRE(q4_make(&f, 3, 5, FL_Q4_NF4, 0, &r));
        FL_CHECK(be.q4_matmul_forward16(&be, &y, 3, &x16, &f.w, 1, 1, 0.0f) == FL_ERR_UNSUPPORTED &&
                 strstr(fl_error_message(), "FITLLM_CUDA_Q4=tc or scratch only"));
        q4_free(&f);
        be.set_compute_dtype(&be, FL_BF16);
        for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
            if (fl_test_asan_light() && i) break;
            FL_REQUIRE(q4_make(&f, c[i].OUT, c[i].IN, c[i].t, c[i].dq, &r));
            char w[64];
            snprintf(w, sizeof w, "FITLLM_CUDA_Q4=%s %s", modes[k], fl_q4_mode_name(c[i].t, c[i].dq));
            q416_check(&be, &f, c[i].N, c[i].ldy, w, &r);
            q4_free(&f);
        }
        q4_fixture whole, part = {0};
        FL_REQUIRE(q4_cut_rows(&whole, &part, &r));
        q416_check(&be, &part, 33, 80, modes[k], &r); /* the row map (a tensor-parallel part cutting the blocks) */
        q4_free(&part);
        q4_free(&whole);
        FL_CHECK(be.q4_matmul_forward16(&be, &y, 3, &x16, NULL, 1, 1, 0.0f) == FL_ERR_INVALID);
        fl_backend_free(&be);
    }
    /* absent: the fp32 path, the knob off (with the default path too); a bad knob value named */
    const char *env[4][2] = {{"fp32", NULL}, {"tc", "0"}, {"scratch", "0"}, {NULL, "0"}};
    for (int k = 0; k < 4; k++) {
        fl_backend be;
        if (env[k][0]) setenv("FITLLM_CUDA_Q4", env[k][0], 1);
        else unsetenv("FITLLM_CUDA_Q4");
        if (env[k][1]) setenv("FITLLM_CUDA_Q4X16", env[k][1], 1);
        FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
        FL_CHECKF(!(be.caps & FL_CAP_Q4X16) && !be.q4_matmul_forward16 && !be.q4_matmul_backward16,
                  "FITLLM_CUDA_Q4=%s FITLLM_CUDA_Q4X16=%s: the bf16-input 4-bit slots are there", env[k][0] ? env[k][0] : "",
                  env[k][1] ? env[k][1] : "");
        fl_backend_free(&be);
        unsetenv("FITLLM_CUDA_Q4X16");
    }
    fl_backend be;
    setenv("FITLLM_CUDA_Q4", "tc", 1);
    setenv("FITLLM_CUDA_Q4X16", "yes", 1);
    FL_CHECK(fl_backend_init_by_name("cuda-emu", &be, 1) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "FITLLM_CUDA_Q4X16=yes: expected 1"));
    unsetenv("FITLLM_CUDA_Q4X16");
    unsetenv("FITLLM_CUDA_Q4");
}

/* 256-byte aligned host memory (aligned_alloc wants a size that is a multiple of the alignment) */
static void *al256_alloc(size_t n) { return aligned_alloc(256, (n + 255) / 256 * 256); }

/* q4_matmul_forward16 / _backward16 over nw stacked parts (a fused output: q|k|v, gate|up; backend.h): scratch
 * dequantizes the parts side by side into its panels, one GEMM a panel (TinyLlama's q|k|v and gate|up one GEMM each
 * where a GEMM a part took 3 and 2, the backward accumulating dx part after part); tc runs part after part, and so
 * does scratch with FITLLM_CUDA_Q4_STACK=0 (A/B: 3 GEMMs for the first stack, the same forward bits). Two
 * stacks: rows 40 + 16 + 16 of 136 columns (one panel: 1 GEMM where the parts took 3), and 100 + 60 + 72 of 3,000
 * (232 rows over the emulator's bf16 area of 185: two panels of 120 + 112, the first ending inside part 1, the second
 * holding part 1's last 20 rows and part 2: 2 GEMMs where the parts took 3). The forward: the bits of a call a part
 * (the emulator's GEMM sums do not depend on the split), no misaligned GEMM; the backward, beta 0 and 1: within the
 * fp32 dot-product bound (K the stacked rows) of float64 sums over the parts' bf16-rounded dequantized rows (and tc:
 * the bits of a call a part, beta 1 after the first). Bad counts, unequal columns and a short ldy refused by name. */
static void q416_parts_case(const fl_backend *be, int scratch, const int *rows, int IN, int want_gemms,
                            fl_test_rng *r) {
    enum { N = 8, NW = 3 };
    q4_fixture f[NW];
    fl_q4_weight ws[NW];
    int R = 0;
    for (int k = 0; k < NW; k++) {
        FL_REQUIRE(q4_make(&f[k], rows[k], IN, k == 1 ? FL_Q4_FP4 : FL_Q4_NF4, k != 2, r));
        ws[k] = f[k].w, R += rows[k];
    }
    const int ldy = R; /* y, dy rows: the stacked width (a multiple of 8 in both cases: aligned rows) */
    float *x = al256_alloc((size_t)N * IN * 4), *dy = al256_alloc((size_t)N * ldy * 4);
    uint16_t *x16 = al256_alloc((size_t)N * IN * 2), *dy16 = al256_alloc((size_t)N * ldy * 2);
    for (int i = 0; i < N * IN; i++) x[i] = fl_bf16_to_f32(x16[i] = fl_f32_to_bf16(fl_test_rng_uniform(r, -1, 1)));
    for (int i = 0; i < N * ldy; i++) dy[i] = fl_bf16_to_f32(dy16[i] = fl_f32_to_bf16(fl_test_rng_uniform(r, -1, 1)));
    const size_t ny = (size_t)N * ldy, nx = (size_t)N * IN;
    float *y[2], *dx[2];
    for (int i = 0; i < 2; i++) y[i] = al256_alloc(ny * 4), dx[i] = al256_alloc(nx * 4);
    const char *mode = scratch ? "scratch" : "tc";
    /* forward: stacked, then a call a part */
    unsigned long c0 = fl_cu_emu_gemm_calls, m0 = fl_cu_emu_gemm_misaligned;
    FL_CHECKF(be->q4_matmul_forward16(be, y[0], ldy, x16, ws, NW, N, 0.0f) == FL_OK && be->sync(be) == FL_OK,
              "%s forward16 of %d parts: %s", mode, NW, fl_error_message());
    if (scratch)
        FL_CHECKF(fl_cu_emu_gemm_calls - c0 == (unsigned long)want_gemms && fl_cu_emu_gemm_misaligned == m0,
                  "scratch forward16 %d rows of %d: %lu GEMMs (want %d), %lu misaligned (%s)", R, IN,
                  fl_cu_emu_gemm_calls - c0, want_gemms, fl_cu_emu_gemm_misaligned - m0, fl_cu_emu_gemm_misaligned_what);
    for (int k = 0, p0 = 0; k < NW; p0 += rows[k], k++)
        FL_CHECK(be->q4_matmul_forward16(be, y[1] + p0, ldy, x16, &ws[k], 1, N, 0.0f) == FL_OK);
    FL_CHECK(be->sync(be) == FL_OK);
    FL_CHECKF(!memcmp(y[0], y[1], ny * 4), "%s forward16: %d stacked parts not the bits of a call a part", mode, NW);
    /* backward, beta 0 then 1 (dx0 kept in dx[1]) */
    double *want = malloc(nx * 8), *absum = malloc(nx * 8);
    for (int beta = 0; beta <= 1; beta++) {
        for (size_t i = 0; i < nx; i++) dx[0][i] = dx[1][i] = fl_test_rng_uniform(r, -1, 1);
        for (int n = 0; n < N; n++)
            for (int c = 0; c < IN; c++) {
                double s = beta ? dx[1][(size_t)n * IN + c] : 0, a = fabs(s);
                for (int k = 0, p0 = 0; k < NW; p0 += rows[k], k++)
                    for (int j = 0; j < rows[k]; j++) {
                        const double p = (double)dy[(size_t)n * ldy + p0 + j] *
                                         fl_bf16_to_f32(fl_f32_to_bf16(f[k].deq[(size_t)j * IN + c]));
                        s += p, a += fabs(p);
                    }
                want[(size_t)n * IN + c] = s, absum[(size_t)n * IN + c] = a;
            }
        c0 = fl_cu_emu_gemm_calls, m0 = fl_cu_emu_gemm_misaligned;
        FL_CHECKF(be->q4_matmul_backward16(be, dx[0], dy16, ldy, ws, NW, N, (float)beta) == FL_OK &&
                      be->sync(be) == FL_OK, "%s backward16 of %d parts: %s", mode, NW, fl_error_message());
        if (scratch)
            FL_CHECKF(fl_cu_emu_gemm_calls - c0 == (unsigned long)want_gemms && fl_cu_emu_gemm_misaligned == m0,
                      "scratch backward16 %d rows of %d: %lu GEMMs (want %d), %lu misaligned", R, IN,
                      fl_cu_emu_gemm_calls - c0, want_gemms, fl_cu_emu_gemm_misaligned - m0);
        char what[64];
        snprintf(what, sizeof what, "%s backward16 %d stacked rows beta %d", mode, R, beta);
        FL_CHECK(dot_close(what, dx[0], want, absum, nx, R));
        if (!scratch) { /* tc: part after part, the bits of the calls a part */
            for (int k = 0, p0 = 0; k < NW; p0 += rows[k], k++)
                FL_CHECK(be->q4_matmul_backward16(be, dx[1], dy16 + p0, ldy, &ws[k], 1, N, k ? 1.0f : (float)beta) ==
                         FL_OK);
            FL_CHECK(be->sync(be) == FL_OK);
            FL_CHECKF(!memcmp(dx[0], dx[1], nx * 4), "tc backward16: stacked parts not the bits of a call a part");
        }
    }
    /* refused: no part, more than FL_Q4_MAX_PARTS, unequal columns, ldy short of the stacked rows */
    FL_CHECK(be->q4_matmul_forward16(be, y[0], ldy, x16, ws, 0, N, 0.0f) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "0 parts"));
    FL_CHECK(be->q4_matmul_backward16(be, dx[0], dy16, ldy, ws, FL_Q4_MAX_PARTS + 1, N, 0.0f) == FL_ERR_INVALID);
    fl_q4_weight odd[2] = {ws[0], ws[1]};
    odd[1].cols = IN - 1;
    FL_CHECK(be->q4_matmul_forward16(be, y[0], ldy, x16, odd, 2, N, 0.0f) == FL_ERR_INVALID);
    FL_CHECK(be->q4_matmul_forward16(be, y[0], R - 1, x16, ws, NW, N, 0.0f) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "ldy"));
    free(want), free(absum), free(x), free(dy), free(x16), free(dy16);
    for (int i = 0; i < 2; i++) free(y[i]), free(dx[i]);
    for (int k = 0; k < NW; k++) q4_free(&f[k]);
}

FL_TEST(cuda_more_q416_parts) {
    static const int small[3] = {40, 16, 16}, two_panels[3] = {100, 60, 72};
    /* tc, scratch, scratch with FITLLM_CUDA_Q4_STACK=0 (A/B: a GEMM a part, 3 GEMMs either stack) */
    for (int m = 0; m < 3; m++) {
        fl_backend be;
        setenv("FITLLM_CUDA_Q4", m ? "scratch" : "tc", 1);
        if (m == 2) setenv("FITLLM_CUDA_Q4_STACK", "0", 1);
        FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
        unsetenv("FITLLM_CUDA_Q4"), unsetenv("FITLLM_CUDA_Q4_STACK");
        be.set_compute_dtype(&be, FL_BF16);
        fl_test_rng r = {5100 + (unsigned)m};
        q416_parts_case(&be, m > 0, small, 136, m == 2 ? 3 : 1, &r);
        if (m == 1) q416_parts_case(&be, 1, two_panels, 3000, 2, &r); /* tc, a part at a time: no panels */
        fl_backend_free(&be);
    }
    fl_test_emu_knob_refused("FITLLM_CUDA_Q4_STACK");
}


/* Panels keep the GEMMs aligned (fl_cu_gemm_panel_rows; issue 30 item 3): cuBLASLt takes its fast kernels only for
 * 16-byte aligned operands and leading dimensions, so an op that cuts a matrix into panels must cut at offsets that
 * keep them so. The emulator counts every stand-in GEMM whose operands are not (fl_cu_emu_gemm_misaligned). Over
 * aligned buffers with leading dimensions of whole 16 bytes: FITLLM_CUDA_Q4=scratch at a 200 x 3000 4-bit weight,
 * more than one dequantized panel of the emulator's areas (1 MiB of work: 174 rows of 3000, which put the second
 * panel's y / dy at 8- / 4-byte offsets before; now 104 + 96), fp32 and bf16 inputs, forward and backward: no
 * misaligned GEMM, two panels each (the fewest), and the two inputs' bits equal (the same panels); the mixed-type
 * GEMM panels of flb_gemm (F32 x F16 with B's rows or K cut in panels of the emulator's 64 KiB: 42 rows of 384 fp32
 * before, 40 now; F32 x BF16 with A stored (K, M), K cut at 204 before, 200 now): no misaligned GEMM, the values within the fp32 dot-product
 * bound of float64 sums. */
FL_TEST(cuda_more_gemm_panels_aligned) {
    fl_test_rng r = {2100};
    q4_fixture f;
    FL_REQUIRE(q4_make(&f, 200, 3000, FL_Q4_NF4, 1, &r));
    fl_backend be;
    setenv("FITLLM_CUDA_Q4", "scratch", 1);
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    unsetenv("FITLLM_CUDA_Q4");
    be.set_compute_dtype(&be, FL_BF16);
    enum { N = 8 };
    const int OUT = 200, IN = 3000;
    float *x = al256_alloc((size_t)N * IN * 4), *dy = al256_alloc((size_t)N * OUT * 4);
    float *o = al256_alloc((size_t)N * IN * 4);
    uint16_t *x16 = al256_alloc((size_t)N * IN * 2), *dy16 = al256_alloc((size_t)N * OUT * 2);
    for (int i = 0; i < N * IN; i++) x[i] = fl_bf16_to_f32(x16[i] = fl_f32_to_bf16(fl_test_rng_uniform(&r, -1, 1)));
    for (int i = 0; i < N * OUT; i++) dy[i] = fl_bf16_to_f32(dy16[i] = fl_f32_to_bf16(fl_test_rng_uniform(&r, -1, 1)));
    float *ref[2] = {NULL, NULL};
    for (int in16 = 0; in16 <= 1; in16++)
        for (int bwd = 0; bwd <= 1; bwd++) {
            const unsigned long c0 = fl_cu_emu_gemm_calls, m0 = fl_cu_emu_gemm_misaligned;
            fl_status st = bwd ? (in16 ? be.q4_matmul_backward16(&be, o, dy16, OUT, &f.w, 1, N, 0.0f)
                                       : be.q4_matmul_backward(&be, o, dy, OUT, &f.w, N, 0.0f))
                               : (in16 ? be.q4_matmul_forward16(&be, o, OUT, x16, &f.w, 1, N, 0.0f)
                                       : be.q4_matmul_forward(&be, o, OUT, x, &f.w, N, 0.0f));
            FL_CHECKF(st == FL_OK && be.sync(&be) == FL_OK, "%s %s: %s", in16 ? "bf16" : "fp32",
                      bwd ? "backward" : "forward", fl_error_message());
            const unsigned long calls = fl_cu_emu_gemm_calls - c0, bad = fl_cu_emu_gemm_misaligned - m0;
            FL_CHECKF(bad == 0 && calls == 2, "q4 scratch %s %s 200 x 3000: %lu GEMMs (want 2 panels), %lu misaligned "
                      "(last: %s)", in16 ? "bf16" : "fp32", bwd ? "backward" : "forward", calls, bad,
                      fl_cu_emu_gemm_misaligned_what);
            const size_t n = (size_t)N * (bwd ? IN : OUT);
            if (!in16) ref[bwd] = dup_bytes(o, n * 4);
            else FL_CHECKF(ref[bwd] && memcmp(ref[bwd], o, n * 4) == 0, "q4 scratch %s: bf16 and fp32 inputs differ "
                           "in bits", bwd ? "backward" : "forward");
        }
    free(ref[0]), free(ref[1]);
    /* flb_gemm's mixed-type panels: (trans_a, trans_b, A type, B type, M, N, K) */
    const struct { int ta, tb; fl_dtype a, b; int M, N, K; } g[] = {
        {0, 1, FL_F32, FL_F16, 8, 100, 384},  /* B (N, K) widened 40 rows at a time (C + j0) */
        {0, 0, FL_F32, FL_F16, 8, 100, 400},  /* B (K, N): K in panels of 136 (A + k0; 163 before) */
        {1, 1, FL_F32, FL_BF16, 160, 8, 400}, /* A (K, M) rounded: K in panels of 200 (B + k0; 204 before) */
    };
    for (size_t i = 0; i < sizeof g / sizeof g[0]; i++) {
        const int M = g[i].M, Nn = g[i].N, K = g[i].K;
        const int lda = g[i].ta ? M : K, ldb = g[i].tb ? K : Nn;
        float *A = al256_alloc((size_t)M * K * 4);
        uint16_t *B = al256_alloc((size_t)K * Nn * 2);
        float *C = al256_alloc((size_t)M * Nn * 4);
        double *want = calloc((size_t)M * Nn, 8), *absum = calloc((size_t)M * Nn, 8);
        for (int k = 0; k < M * K; k++) A[k] = fl_test_rng_uniform(&r, -1, 1);
        for (int k = 0; k < K * Nn; k++)
            B[k] = g[i].b == FL_F16 ? fl_f32_to_f16(fl_test_rng_uniform(&r, -1, 1)) : fl_f32_to_bf16(fl_test_rng_uniform(&r, -1, 1));
        for (int m = 0; m < M; m++)
            for (int nn = 0; nn < Nn; nn++)
                for (int k = 0; k < K; k++) {
                    const float av = g[i].ta ? A[(size_t)k * lda + m] : A[(size_t)m * lda + k];
                    const uint16_t bv = g[i].tb ? B[(size_t)nn * ldb + k] : B[(size_t)k * ldb + nn];
                    const double p = (double)(g[i].b == FL_BF16 ? fl_bf16_to_f32(fl_f32_to_bf16(av)) : av) *
                                     (g[i].b == FL_F16 ? fl_f16_to_f32(bv) : fl_bf16_to_f32(bv));
                    want[(size_t)m * Nn + nn] += p, absum[(size_t)m * Nn + nn] += fabs(p);
                }
        const unsigned long c0 = fl_cu_emu_gemm_calls, m0 = fl_cu_emu_gemm_misaligned;
        FL_CHECKF(be.gemm(&be, g[i].ta, g[i].tb, M, Nn, K, 1.0f, A, FL_F32, lda, B, g[i].b, ldb, 0.0f, C, FL_F32, Nn) ==
                          FL_OK && be.sync(&be) == FL_OK, "gemm case %zu: %s", i, fl_error_message());
        const unsigned long calls = fl_cu_emu_gemm_calls - c0, bad = fl_cu_emu_gemm_misaligned - m0;
        FL_CHECKF(calls >= 2 && bad == 0, "gemm case %zu (%s x %s, %d x %d x %d): %lu GEMMs (want panels), %lu "
                  "misaligned (last: %s)", i, fl_dtype_name(g[i].a), fl_dtype_name(g[i].b), M, Nn, K, calls, bad,
                  fl_cu_emu_gemm_misaligned_what);
        char what[48];
        snprintf(what, sizeof what, "gemm panels case %zu", i);
        FL_CHECK(dot_close(what, C, want, absum, (size_t)M * Nn, K));
        free(A), free(B), free(C), free(want), free(absum);
    }
    free(x), free(dy), free(o), free(x16), free(dy16);
    fl_backend_free(&be);
    q4_free(&f);
}

/* FITLLM_CUDA_Q4 unset: a bf16 compute dtype's (bf16-true, bf16-mixed) 4-bit matmuls take scratch (bitsandbytes' way
 * with a bf16 compute dtype: the weight dequantized to bf16, bf16 operands, fp32 sums), every other one's (32-true and
 * 16-mixed: F32, 16-true: F16) the fp32 kernels. Checked through the backend's slots, bit for bit against the mode named
 * explicitly, each output element of the forward and the backward; the two modes differ on this case (else the check
 * could not fail); the bf16-input slots there by default, and the planner's facts (fl_backend_facts_of "cuda") say so */
FL_TEST(cuda_more_q4_default_mode) {
    enum { N = 19, OUT = 37, IN = 131, NY = N * OUT, NO = N * (OUT + IN) };
    fl_test_rng r = {4000};
    q4_fixture f;
    FL_REQUIRE(q4_make(&f, OUT, IN, FL_Q4_NF4, 1, &r));
    float *x = fl_test_frand(&r, (size_t)N * IN, -2, 2), *dy = fl_test_frand(&r, NY, -2, 2);
    const char *env[3] = {NULL, "fp32", "scratch"};
    const fl_dtype dt[3] = {FL_BF16, FL_F32, FL_F16};
    float *o[3][3]; /* [env][compute dtype]: y (N x OUT) then dx (N x IN) */
    for (int e = 0; e < 3; e++) {
        fl_backend be;
        if (env[e]) setenv("FITLLM_CUDA_Q4", env[e], 1);
        else unsetenv("FITLLM_CUDA_Q4");
        FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
        fl_backend_facts fa;
        FL_REQUIRE_OK(fl_backend_facts_of("cuda", &fa));
        FL_CHECKF(!(be.caps & FL_CAP_Q4X16) == (e == 1) && !(fa.caps & FL_CAP_Q4X16) == (e == 1),
                  "FITLLM_CUDA_Q4=%s: FL_CAP_Q4X16 %s on cuda-emu, %s in the planned cuda's facts", env[e] ? env[e] : "",
                  be.caps & FL_CAP_Q4X16 ? "set" : "not set", fa.caps & FL_CAP_Q4X16 ? "set" : "not set");
        for (int d = 0; d < 3; d++) {
            o[e][d] = calloc(NO, sizeof(float));
            be.set_compute_dtype(&be, dt[d]);
            FL_CHECKF(be.q4_matmul_forward(&be, o[e][d], OUT, x, &f.w, N, 0.0f) == FL_OK &&
                          be.q4_matmul_backward(&be, o[e][d] + NY, dy, OUT, &f.w, N, 0.0f) == FL_OK &&
                          be.sync(&be) == FL_OK,
                      "FITLLM_CUDA_Q4=%s %s: %s", env[e] ? env[e] : "", fl_dtype_name(dt[d]), fl_error_message());
        }
        fl_backend_free(&be);
    }
    unsetenv("FITLLM_CUDA_Q4");
    for (int d = 0; d < 3; d++) {
        const int want = d == 0 ? 2 : 1; /* bf16: scratch; F32, F16: fp32 */
        size_t diff = 0, modes = 0;
        for (size_t i = 0; i < NO; i++) {
            diff += memcmp(&o[0][d][i], &o[want][d][i], 4) != 0;
            modes += memcmp(&o[1][0][i], &o[2][0][i], 4) != 0;
        }
        FL_CHECKF(diff == 0, "FITLLM_CUDA_Q4 unset, compute %s: %zu of %d outputs differ in bits from FITLLM_CUDA_Q4=%s",
                  fl_dtype_name(dt[d]), diff, (int)NO, env[want]);
        FL_CHECKF(modes > 0, "bf16 compute: FITLLM_CUDA_Q4=fp32 and scratch give the same bits (the check cannot fail)");
    }
    for (int e = 0; e < 3; e++)
        for (int d = 0; d < 3; d++) free(o[e][d]);
    free(x), free(dy);
    q4_free(&f);
}

FL_TEST(cuda_more_q4) {
    q4_case(19, 37, 131, FL_Q4_NF4, 0);  /* odd everything: quantization blocks straddle rows, odd n */
    q4_case(19, 37, 131, FL_Q4_FP4, 1);
    q4_case(133, 150, 70, FL_Q4_NF4, 1); /* more than one 128 x 128 tile both ways, K tail of 6 */
    q4_case(5, 129, 64, FL_Q4_FP4, 0);
}

/* ---- LoRA dropout ---------------------------------------------------------------------------- */

FL_TEST(cuda_more_lora_dropout) {
    fl_backend be = cpu2();
    fl_test_rng r = {77};
    const int N = 13, in = 53, out = 29, rk = 4;
    const size_t n = (size_t)N * in;
    const float p = 0.3f, scaling = 2.0f;
    const uint64_t seed = 0x0123456789abcdefull;
    float *x = fl_test_frand(&r, n, -1, 1), *A = fl_test_frand(&r, (size_t)rk * in, -1, 1), *Bm = fl_test_frand(&r, (size_t)out * rk, -1, 1);
    float *h = malloc((size_t)N * rk * 4), *y = calloc((size_t)N * out, 4), *cxd = malloc(n * 4), *xd[2];
    FL_REQUIRE_OK(be.lora_forward(&be, y, out, h, cxd, x, A, Bm, N, in, out, rk, scaling, p, seed));
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        xd[k] = malloc(n * 4);
        EMU_OK(fl_cuemu_lora_dropout(xd[k], x, n, p, seed, NULL, NULL));
    }
    FL_CHECKF(memcmp(xd[0], cxd, n * 4) == 0, "lora_dropout: not the CPU's xd");
    FL_CHECK(memcmp(xd[0], xd[1], n * 4) == 0);
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) kept += fl_lora_dropout_keep(seed, i, p);
    FL_CHECK(kept > n / 2 && kept < n); /* the mask is not trivial at this p */

    /* backward's dx: the CPU's lora_backward against the composition the CUDA backend runs
     * (g = dy @ B, t = scaling * g @ A by GEMMs, then the kernel) */
    float *dy = fl_test_frand(&r, (size_t)N * out, -1, 1), *dx0 = fl_test_frand(&r, n, -1, 1), *cdx = dup_bytes(dx0, n * 4);
    float *work = malloc(((size_t)N * rk + n) * 4), *g = malloc((size_t)N * rk * 4), *t = malloc(n * 4);
    FL_REQUIRE_OK(be.lora_backward(&be, cdx, NULL, NULL, dy, out, cxd, h, A, Bm, N, in, out, rk, scaling, p, seed, work));
    FL_REQUIRE_OK(be.gemm(&be, 0, 0, N, rk, out, 1.0f, dy, FL_F32, out, Bm, FL_F32, rk, 0.0f, g, FL_F32, rk));
    FL_REQUIRE_OK(be.gemm(&be, 0, 0, N, in, rk, scaling, g, FL_F32, rk, A, FL_F32, in, 0.0f, t, FL_F32, in));
    float *dx[2];
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        dx[k] = dup_bytes(dx0, n * 4);
        EMU_OK(fl_cuemu_lora_dropout_dx(dx[k], t, n, p, seed, NULL, NULL));
    }
    FL_CHECK(memcmp(dx[0], dx[1], n * 4) == 0);
    const double u = 1.0 / 16777216.0, sc = fl_lora_dropout_scale(p);
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (!fl_lora_dropout_keep(seed, i, p)) {
            bad += memcmp(&dx[0][i], &dx0[i], 4) != 0 || memcmp(&cdx[i], &dx0[i], 4) != 0;
            continue;
        }
        double ts = (double)t[i] * sc, want = dx0[i] + ts;
        /* kernel: two roundings of the exact dx0 + t*sc (sc itself is the fp32 scale both use) */
        bad += !(fabs(dx[0][i] - want) <= 2 * u * (fabs(dx0[i]) + fabs(ts)) * (1 + u));
        /* the CPU's result is within the same bound (one fused rounding, or the same two) */
        bad += !(fabs(cdx[i] - want) <= 2 * u * (fabs(dx0[i]) + fabs(ts)) * (1 + u));
    }
    FL_CHECKF(bad == 0, "lora_dropout_dx: %d elements off", bad);
    /* the fused form the CUDA backend runs (lora_dx_fused: g @ A inside the masked update, no t): within the fp32
     * bound of float64 (r products and sums, the scaling, the 1 / (1 - p) and the add: gamma(r + 3) of the magnitudes),
     * dropped elements untouched bit for bit, the same bits under another emulator shuffle seed, with the seed read
     * from device memory, and through the cuda-emu backend's lora_backward (its GEMMs for g, then this kernel) */
    float *fx[3];
    for (int k = 0; k < 3; k++) {
        fl_cu_emu_set_seed(k_seeds[k & 1]);
        fx[k] = dup_bytes(dx0, n * 4);
        EMU_OK(fl_cuemu_lora_dx_fused(fx[k], g, A, N, in, rk, scaling, p, k == 2 ? 0 : seed, k == 2 ? &seed : NULL,
                                      NULL));
    }
    FL_CHECK(!memcmp(fx[0], fx[1], n * 4) && !memcmp(fx[0], fx[2], n * 4));
    fl_backend emu;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &emu, 1));
    float *edx = dup_bytes(dx0, n * 4), *ework = malloc(((size_t)N * rk + n) * 4);
    FL_REQUIRE_OK(emu.lora_backward(&emu, edx, NULL, NULL, dy, out, cxd, h, A, Bm, N, in, out, rk, scaling, p, seed, ework));
    FL_REQUIRE_OK(emu.sync(&emu));
    fl_backend_free(&emu);
    const double gm = (rk + 3) * u / (1 - (rk + 3) * u);
    int fbad = 0, ebad = 0;
    size_t moved = 0;
    for (int nn = 0; nn < N; nn++)
        for (int c = 0; c < in; c++) {
            const size_t i = (size_t)nn * in + c;
            if (!fl_lora_dropout_keep(seed, i, p)) {
                fbad += memcmp(&fx[0][i], &dx0[i], 4) != 0;
                ebad += memcmp(&edx[i], &dx0[i], 4) != 0;
                continue;
            }
            double dot = 0, mag = 0, edot = 0, emag = 0, gerr = 0;
            for (int k = 0; k < rk; k++) {
                const double pr = (double)g[(size_t)nn * rk + k] * A[(size_t)k * in + c];
                dot += pr, mag += fabs(pr);
                double ge = 0, gs = 0; /* g in float64 from dy and B, and its fp32 GEMM's bound gamma(out) sum |dy B| */
                for (int j = 0; j < out; j++) {
                    const double t2 = (double)dy[(size_t)nn * out + j] * Bm[(size_t)j * rk + k];
                    ge += t2, gs += fabs(t2);
                }
                edot += ge * A[(size_t)k * in + c], emag += fabs(ge * A[(size_t)k * in + c]);
                gerr += out * u / (1 - out * u) * gs * fabs(A[(size_t)k * in + c]);
            }
            const double want = dx0[i] + dot * scaling * sc, bound = gm * (fabs(dx0[i]) + mag * scaling * sc) + 1e-30;
            fbad += !(fabs(fx[0][i] - want) <= bound);
            moved += fx[0][i] != dx0[i];
            /* the backend's lora_backward: its g from its own GEMM (float64 g here, within that GEMM's bound) */
            const double ewant = dx0[i] + edot * scaling * sc;
            ebad += !(fabs(edx[i] - ewant) <= gm * (fabs(dx0[i]) + (emag + gerr) * scaling * sc) +
                                                   (1 + gm) * gerr * scaling * sc + 1e-30);
        }
    FL_CHECKF(fbad == 0 && ebad == 0 && moved > n / 3, "lora_dx_fused: %d elements off (the backend's lora_backward: %d); "
              "%zu of %zu moved", fbad, ebad, moved, n);
    FL_CHECK(fl_cuemu_lora_dx_fused(fx[0], g, A, N, in, rk, scaling, 0.0f, seed, NULL, NULL) == -1 &&
             fl_cuemu_lora_dx_fused(fx[0], g, A, N, in, 0, scaling, p, seed, NULL, NULL) == -1);
    for (int k = 0; k < 3; k++) free(fx[k]);
    free(edx), free(ework);
    FL_CHECK(fl_cuemu_lora_dropout(xd[0], x, n, 0.0f, seed, NULL, NULL) == -1); /* p = 0: no dropout kernel */
    /* the seed read from device memory (a CUDA graph's per-step slot) instead of the argument: the same bits */
    float *xs = malloc(n * 4), *dxs = dup_bytes(dx0, n * 4);
    EMU_OK(fl_cuemu_lora_dropout(xs, x, n, p, 0, &seed, NULL));
    EMU_OK(fl_cuemu_lora_dropout_dx(dxs, t, n, p, 0, &seed, NULL));
    FL_CHECK(xs && dxs && !memcmp(xs, xd[0], n * 4) && !memcmp(dxs, dx[0], n * 4));
    free(xs), free(dxs);
    free(x); free(A); free(Bm); free(h); free(y); free(cxd); free(xd[0]); free(xd[1]); free(dy); free(dx0); free(cdx);
    free(work); free(g); free(t); free(dx[0]); free(dx[1]);
}
#endif
