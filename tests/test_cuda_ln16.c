/* LayerNorm over 16-bit weights and biases and a bf16 saved input (issue 30 item 1: a GPT-2 / OPT step under a
 * 16-bit store or bf16 activations launches no convert around its norms): layernorm_forward_w16 /
 * layernorm_backward_w16 under the CPU emulator.
 * Anchor: bits. Each must equal the fp32 LayerNorm launcher run over the exactly widened weight, bias and input
 * (what the widen / round16 / convert launches they replace left in the fp32 views; that launcher is checked
 * against float64 and the CPU backend in test_cuda_emu.c's cuda_emu_layernorm), bit for bit: out, mean, rstd,
 * out16 (= RNE(out), out its widening), dx and dw / db accumulating into nonzero buffers, dinp16 (= RNE(dx), dx not
 * rounded); and the forward against the CPU backend at cuda_emu_layernorm's tolerance. Odd shapes (partial warps,
 * C > 256: several columns per thread, N > 128: several column-sum row groups), no bias, bf16 and fp16 storage, fp32
 * weights with a bf16 copy (bf16-mixed), two emulator shuffle seeds, and the refused argument combinations. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/dtype.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/emu/cu_emu.h"
#include "cuda_emu_test.h"

static const uint64_t k_seeds[] = {0x5eed1a16ull, 0x1a7e0b16ull};

/* x16 = RNE(x) in dt, x = its widening */
static uint16_t *narrow(float *x, size_t n, fl_dtype dt) {
    uint16_t *x16 = malloc(n * 2);
    FL_CHECK(fl_convert(x16, dt, x, FL_F32, n) == FL_OK && fl_convert(x, FL_F32, x16, dt, n) == FL_OK);
    return x16;
}
static float *dup4(const float *x, size_t n) {
    float *y = malloc(n * 4);
    memcpy(y, x, n * 4);
    return y;
}

/* wt: the storage of w and b (BF16/F16; F32: bf16-mixed, the fp32 weight with bf16 copies) */
static void ln16_case(fl_dtype wt, int N, int C, int with_bias) {
    fl_test_rng r = {(uint64_t)(N * 131 + C * 7 + wt * 3 + with_bias)};
    const size_t nc = (size_t)N * C;
    const float eps = 1e-5f;
    float *x = fl_test_frand(&r, nc, -2, 2), *w = fl_test_frand(&r, (size_t)C, 0.5f, 1.5f);
    float *b = fl_test_frand(&r, (size_t)C, -1, 1), *dy = fl_test_frand(&r, nc, -1, 1);
    for (int k = 0; k < C; k++) x[(size_t)(N / 2) * C + k] += 3.0f; /* a row with a large mean */
    float *dx0 = fl_test_frand(&r, nc, -1, 1), *dw0 = fl_test_frand(&r, (size_t)C, -1, 1);
    float *db0 = fl_test_frand(&r, (size_t)C, -1, 1);
    uint16_t *x16 = narrow(x, nc, FL_BF16); /* the stored input; x its widening */
    uint16_t *w16 = wt == FL_F32 ? NULL : narrow(w, (size_t)C, wt), *b16 = wt == FL_F32 ? NULL : narrow(b, (size_t)C, wt);
    const void *wp = wt == FL_F32 ? (const void *)w : w16, *bp = !with_bias ? NULL : wt == FL_F32 ? (const void *)b : b16;
    const float *bf = with_bias ? b : NULL;
    /* the fp32 launcher over the widened values: the reference bits */
    float *o1 = malloc(nc * 4), *m1 = malloc((size_t)N * 4), *r1 = malloc((size_t)N * 4);
    float *dx1 = dup4(dx0, nc), *dw1 = dup4(dw0, (size_t)C), *db1 = dup4(db0, (size_t)C);
    EMU_OK(fl_cuemu_layernorm_forward(o1, m1, r1, x, w, bf, N, C, eps, NULL));
    EMU_OK(fl_cuemu_layernorm_backward(dx1, dw1, db1, dy, x, w, m1, r1, N, C, EMU_WORK, NULL));
    uint16_t *o16w = malloc(nc * 2), *dx16w = malloc(nc * 2);
    FL_REQUIRE_OK(fl_convert(dx16w, FL_BF16, dx1, FL_F32, nc));
    float *o1w = dup4(o1, nc);
    FL_REQUIRE_OK(fl_convert(o16w, FL_BF16, o1w, FL_F32, nc));
    FL_REQUIRE_OK(fl_convert(o1w, FL_F32, o16w, FL_BF16, nc)); /* round16's fp32 view */
    /* the CPU backend on the same values, at cuda_emu_layernorm's tolerance */
    fl_backend cpu;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &cpu, 1));
    float *oc = malloc(nc * 4), *mc = malloc((size_t)N * 4), *rc = malloc((size_t)N * 4);
    cpu.layernorm_forward(&cpu, oc, mc, rc, x, w, bf, N, C, eps);
    fl_backend_free(&cpu);
    float *o2 = malloc(nc * 4), *m2 = malloc((size_t)N * 4), *r2 = malloc((size_t)N * 4), *dx2 = malloc(nc * 4);
    float *dw2 = malloc((size_t)C * 4), *db2 = malloc((size_t)C * 4);
    uint16_t *g16 = malloc(nc * 2);
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        if (wt != FL_F32) { /* no bf16 copy: the fp32 kernel's bits */
            memset(o2, 0xff, nc * 4);
            EMU_OK(fl_cuemu_layernorm_forward_w16(o2, NULL, m2, r2, x, wp, bp, wt, N, C, eps, NULL));
            FL_CHECKF(!memcmp(o1, o2, nc * 4) && !memcmp(m1, m2, (size_t)N * 4) && !memcmp(r1, r2, (size_t)N * 4),
                      "layernorm_forward_w16 (%s N=%d C=%d bias %d): not the fp32 kernel's bits", fl_dtype_name(wt), N,
                      C, with_bias);
        }
        memset(g16, 0xff, nc * 2);
        EMU_OK(fl_cuemu_layernorm_forward_w16(o2, g16, m2, r2, x, wp, bp, wt, N, C, eps, NULL));
        FL_CHECKF(!memcmp(g16, o16w, nc * 2) && !memcmp(o2, o1w, nc * 4) && !memcmp(r1, r2, (size_t)N * 4),
                  "layernorm_forward_w16 out16 (%s N=%d C=%d): not the fp32 kernel + round16", fl_dtype_name(wt), N, C);
        /* out NULL (an fp32 view nothing reads, issue 30 item 1): the same copy and statistics */
        memset(g16, 0xff, nc * 2);
        memset(m2, 0xff, (size_t)N * 4);
        memset(r2, 0xff, (size_t)N * 4);
        EMU_OK(fl_cuemu_layernorm_forward_w16(NULL, g16, m2, r2, x, wp, bp, wt, N, C, eps, NULL));
        FL_CHECKF(!memcmp(g16, o16w, nc * 2) && !memcmp(m1, m2, (size_t)N * 4) && !memcmp(r1, r2, (size_t)N * 4),
                  "layernorm_forward_w16 out NULL (%s N=%d C=%d): not the full path's out16 / statistics",
                  fl_dtype_name(wt), N, C);
        for (int in16 = 0; in16 < 2; in16++) {
            if (wt == FL_F32 && !in16) continue; /* an fp32 weight needs a bf16 copy to read or write */
            memcpy(dx2, dx0, nc * 4);
            memcpy(dw2, dw0, (size_t)C * 4);
            memcpy(db2, db0, (size_t)C * 4);
            memset(g16, 0xff, nc * 2);
            EMU_OK(fl_cuemu_layernorm_backward_w16(dx2, g16, dw2, db2, dy, in16 ? NULL : x, in16 ? x16 : NULL, wp, wt,
                                                   m1, r1, N, C, EMU_WORK, NULL));
            FL_CHECKF(!memcmp(dx1, dx2, nc * 4) && !memcmp(dw1, dw2, (size_t)C * 4) &&
                          !memcmp(db1, db2, (size_t)C * 4) && !memcmp(g16, dx16w, nc * 2),
                      "layernorm_backward_w16 (%s N=%d C=%d in16 %d): not the fp32 kernel's bits + dinp16 = RNE(dx)",
                      fl_dtype_name(wt), N, C, in16);
        }
    }
    FL_CHECK(fl_test_allclose("layernorm w16 out vs cpu", o1, oc, nc, 1e-5, 1e-6));
    FL_CHECK(fl_test_allclose("layernorm w16 mean vs cpu", m1, mc, (size_t)N, 1e-5, 1e-6));
    /* refused: an fp32 weight without a bf16 copy (the fp32 ops are layernorm_forward / _backward), other dtypes */
    FL_CHECK(fl_cuemu_layernorm_forward_w16(o2, NULL, m2, r2, x, w, bf, FL_F32, N, C, eps, NULL) != 0);
    FL_CHECK(fl_cuemu_layernorm_backward_w16(dx2, NULL, dw2, db2, dy, x, NULL, w, FL_F32, m1, r1, N, C, EMU_WORK, NULL) != 0);
    FL_CHECK(fl_cuemu_layernorm_forward_w16(o2, g16, m2, r2, x, w, bf, FL_F64, N, C, eps, NULL) != 0);
    FL_CHECK(fl_cuemu_layernorm_forward_w16(NULL, NULL, m2, r2, x, wp, bp, wt, N, C, eps, NULL) != 0); /* no output */
    free(x); free(w); free(b); free(dy); free(dx0); free(dw0); free(db0); free(x16); free(w16); free(b16);
    free(o1); free(m1); free(r1); free(dx1); free(dw1); free(db1); free(o16w); free(dx16w); free(o1w);
    free(oc); free(mc); free(rc); free(o2); free(m2); free(r2); free(dx2); free(dw2); free(db2); free(g16);
}

FL_TEST(cuda_ln16_layernorm_w16) {
    ln16_case(FL_BF16, 5, 64, 1);    /* 64 threads */
    ln16_case(FL_BF16, 3, 37, 1);    /* partial warp */
    ln16_case(FL_F16, 4, 97, 0);     /* fp16 storage, no bias */
    ln16_case(FL_BF16, 3, 300, 1);   /* C > 256: two columns per thread */
    ln16_case(FL_F32, 7, 13, 1);     /* bf16-mixed: fp32 weight, bf16 copies */
    ln16_case(FL_F32, 260, 9, 0);    /* N >= 256: two row groups in the dw / db column sum */
}
#else
FL_TEST(cuda_ln16_layernorm_w16) { fl_test_skip("no CUDA emulator in this build"); }
#endif
