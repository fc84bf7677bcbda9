/* The backward kernels reading a bf16 run's stored activations directly (issue 30 item 1: no widen-before-backward):
 * rmsnorm_backward_w16's inp16 and the attention backwards' bf16 q, k, v, out (attention_backward_ex16 / _tc16 /
 * _fa2_16, the backend's attention_backward16), under the CPU emulator (act_backward16's in16: test_cuda_bf16.c).
 * Anchor: bits. Each must equal the fp32-input launcher of the same op run over the exactly widened copies
 * (what the widen launch left in the fp32 views; those launchers are checked against float64 and the CPU
 * backend in test_cuda_emu.c / test_cuda_attn.c / test_ops.c), bit for bit, for every output and accumulated
 * gradient; odd shapes (partial warps and tiles, strided q|k|v and out rows, GQA), the vector (C % 4 == 0) and
 * scalar paths, two emulator shuffle seeds, and the refused argument combinations. A kernel reading a bf16
 * element as fp32 (or at an fp32 offset) fails these. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/dtype.h"
#include "test.h"

#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/cu_kernels.h"
#include "backend/cuda/cu_kernels_attn.h"
#include "backend/cuda/emu/cu_emu.h"
#include "cuda_emu_test.h"

static const uint64_t k_seeds[] = {0x5eed0b16ull, 0xb0a710ffull};

/* x16 = RNE(x), x = its widening: the stored copy and the fp32 view a widen launch rebuilds */
static uint16_t *stored16(float *x, size_t n) {
    uint16_t *x16 = malloc(n * 2);
    FL_CHECK(fl_convert(x16, FL_BF16, x, FL_F32, n) == FL_OK && fl_convert(x, FL_F32, x16, FL_BF16, n) == FL_OK);
    return x16;
}
static float *dup4(const float *x, size_t n) {
    float *y = malloc(n * 4);
    memcpy(y, x, n * 4);
    return y;
}

/* rmsnorm_backward_w16 with inp16: dx (and dinp16) and dw accumulating into nonzero buffers, the bits of the
 * fp32-input kernel over the widened input; weights fp32 (bf16-mixed) and bf16 (bf16-true) */
static void rms_in16_case(fl_dtype wt, int N, int C, int with16) {
    fl_test_rng r = {(uint64_t)(N * 31 + C * 7 + wt + with16)};
    const size_t nc = (size_t)N * C;
    float *x = fl_test_frand(&r, nc, -2, 2), *w = fl_test_frand(&r, (size_t)C, 0.5f, 1.5f);
    float *dy = fl_test_frand(&r, nc, -1, 1), *dx0 = fl_test_frand(&r, nc, -1, 1);
    float *dw0 = fl_test_frand(&r, (size_t)C, -1, 1), *rs = malloc((size_t)N * 4), *o = malloc(nc * 4);
    uint16_t *x16 = stored16(x, nc), *w16 = malloc((size_t)C * 2);
    FL_REQUIRE_OK(fl_convert(w16, FL_BF16, w, FL_F32, (size_t)C));
    FL_REQUIRE_OK(fl_convert(w, FL_F32, w16, FL_BF16, (size_t)C));
    const void *wp = wt == FL_F32 ? (const void *)w : (const void *)w16;
    EMU_OK(fl_cuemu_rmsnorm_forward(o, rs, x, w, N, C, 1e-5f, NULL));
    float *dx1 = dup4(dx0, nc), *dw1 = dup4(dw0, (size_t)C), *dx2 = malloc(nc * 4), *dw2 = malloc((size_t)C * 4);
    uint16_t *d1 = malloc(nc * 2), *d2 = malloc(nc * 2);
    if (wt == FL_F32) {
        EMU_OK(fl_cuemu_rmsnorm_backward(dx1, dw1, dy, x, w, rs, N, C, EMU_WORK, NULL));
        FL_REQUIRE_OK(fl_convert(d1, FL_BF16, dx1, FL_F32, nc));
    } else {
        EMU_OK(fl_cuemu_rmsnorm_backward_w16(dx1, d1, dw1, dy, x, NULL, w16, wt, rs, N, C, EMU_WORK, NULL));
    }
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memcpy(dx2, dx0, nc * 4);
        memcpy(dw2, dw0, (size_t)C * 4);
        memset(d2, 0xff, nc * 2);
        EMU_OK(fl_cuemu_rmsnorm_backward_w16(dx2, with16 ? d2 : NULL, dw2, dy, NULL, x16, wp, wt, rs, N, C, EMU_WORK, NULL));
        FL_CHECKF(!memcmp(dx1, dx2, nc * 4) && !memcmp(dw1, dw2, (size_t)C * 4) &&
                      (!with16 || !memcmp(d1, d2, nc * 2)),
                  "rmsnorm_backward_w16 inp16 (w %s N=%d C=%d): not the bits over the widened input", fl_dtype_name(wt),
                  N, C);
    }
    /* an fp32 weight is taken only with a bf16 copy to read or write (the fp32 ops are rmsnorm_forward / _backward) */
    FL_CHECK(fl_cuemu_rmsnorm_backward_w16(dx2, NULL, dw2, dy, x, NULL, w, FL_F32, rs, N, C, EMU_WORK, NULL) != 0);
    FL_CHECK(fl_cuemu_rmsnorm_forward_w16(dx2, NULL, rs, x, w, FL_F32, N, C, 1e-5f, NULL) != 0);
    if (wt == FL_F32) { /* bf16-mixed's forward: out16 = round16 of the fp32 kernel's output, out its widening */
        float *o2 = malloc(nc * 4), *r2 = malloc((size_t)N * 4);
        uint16_t *o16 = malloc(nc * 2);
        uint16_t *w16o = stored16(o, nc); /* o: the fp32 kernel's output, now widened as round16 leaves it */
        EMU_OK(fl_cuemu_rmsnorm_forward_w16(o2, o16, r2, x, w, FL_F32, N, C, 1e-5f, NULL));
        FL_CHECKF(!memcmp(o16, w16o, nc * 2) && !memcmp(o2, o, nc * 4) && !memcmp(r2, rs, (size_t)N * 4),
                  "rmsnorm_forward_w16 fp32 weight out16 (N=%d C=%d): not the fp32 kernel + round16", N, C);
        free(o2); free(r2); free(o16); free(w16o);
    }
    free(x); free(w); free(dy); free(dx0); free(dw0); free(rs); free(o); free(x16); free(w16);
    free(dx1); free(dw1); free(dx2); free(dw2); free(d1); free(d2);
}

FL_TEST(cuda_bf16_rmsnorm_backward_in16) {
    rms_in16_case(FL_BF16, 5, 64, 1);   /* vector path */
    rms_in16_case(FL_BF16, 3, 37, 0);   /* scalar path, partial warp */
    rms_in16_case(FL_F32, 130, 96, 0);  /* bf16-mixed: fp32 weight; several colsum row groups */
    rms_in16_case(FL_F32, 2, 5, 1);
}

/* The attention backwards over bf16 q|k|v rows (fused, row stride W + pad) and a bf16 output (row stride ldo):
 * dq|dk|dv (accumulating into nonzero buffers) the bits of the fp32 launcher over the widened copies. */
typedef int (*bwd32_fn)(const fl_attn_desc *, float *, float *, float *, const float *, const float *, const float *,
                        const float *, const uint8_t *, const float *, const float *, void *, void *);
typedef int (*bwd16_fn)(const fl_attn_desc *, float *, float *, float *, const float *, const void *, const void *,
                        const void *, const uint8_t *, const void *, const float *, void *, void *);
static int b32_ex(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, const float *q,
                  const float *k, const float *v, const uint8_t *m, const float *o, const float *l, void *w, void *st) {
    return fl_cuemu_attention_backward_ex(a, dq, dk, dv, NULL, dout, q, k, v, NULL, m, o, l, w, st);
}
static int b32_fa(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, const float *q,
                  const float *k, const float *v, const uint8_t *m, const float *o, const float *l, void *w, void *st) {
    return fl_cuemu_attention_backward_fa2_ex(a, dq, dk, dv, dout, q, k, v, m, o, l, w, 1, st);
}
static int b16_fa(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, const void *q,
                  const void *k, const void *v, const uint8_t *m, const void *o, const float *l, void *w, void *st) {
    return fl_cuemu_attention_backward_fa2_16(a, dq, dk, dv, dout, q, k, v, m, o, l, w, 1, st);
}
static void attn_bwd16_case(bwd32_fn f32, bwd16_fn f16, const char *kn, int B, int T, int NH, int NKV, int HD,
                            int pad, int masked) {
    fl_test_rng r = {(uint64_t)(B * 131 + T * 7 + HD + pad + masked)};
    fl_attn_desc a = {.B = B, .Tq = T, .Tk = T, .NH = NH, .NKV = NKV, .HD = HD, .scale = 1.0f / sqrtf((float)HD),
                      .causal = 1};
    const size_t W = (size_t)(NH + 2 * NKV) * HD + (size_t)pad, N = (size_t)B * T, qo = (size_t)NH * HD;
    const size_t ko = qo + (size_t)NKV * HD;
    a.ldq = a.ldk = a.ldv = W;
    a.ldo = (size_t)NH * HD + (size_t)pad;
    const size_t nx = N * W, no = N * a.ldo, nl = (size_t)B * NH * T;
    float *qkv = fl_test_frand(&r, nx, -1, 1), *dout = fl_test_frand(&r, no, -1, 1), *d0 = fl_test_frand(&r, nx, -1, 1);
    uint16_t *qkv16 = stored16(qkv, nx);
    float *out = malloc(no * 4), *lse = malloc(nl * 4);
    memset(out, 0, no * 4);
    uint8_t *mask = NULL;
    if (masked) {
        mask = malloc(N);
        for (size_t i = 0; i < N; i++) mask[i] = (uint8_t)(i % 5 != 3);
    }
    EMU_OK(fl_cuemu_attention_forward_ex(&a, out, NULL, lse, qkv, qkv + qo, qkv + ko, NULL, mask, NULL));
    uint16_t *out16 = stored16(out, no);
    void *work = malloc(fl_cu_attention_work_bytes_det(B, NH, T));
    float *want = dup4(d0, nx), *got = malloc(nx * 4);
    EMU_OK(f32(&a, want, want + qo, want + ko, dout, qkv, qkv + qo, qkv + ko, mask, out, lse, work, NULL));
    for (int s = 0; s < 2; s++) {
        fl_cu_emu_set_seed(k_seeds[s]);
        memcpy(got, d0, nx * 4);
        EMU_OK(f16(&a, got, got + qo, got + ko, dout, qkv16, qkv16 + qo, qkv16 + ko, mask, out16, lse, work, NULL));
        FL_CHECKF(!memcmp(got, want, nx * 4), "attention backward16 %s B%d T%d NH%d/%d HD%d pad %d%s: not the bits over "
                  "the widened q|k|v and out", kn, B, T, NH, NKV, HD, pad, masked ? " masked" : "");
    }
    free(qkv); free(dout); free(d0); free(qkv16); free(out); free(lse); free(mask); free(out16); free(work);
    free(want); free(got);
}

FL_TEST(cuda_bf16_attention_backward16) {
    attn_bwd16_case(b32_ex, fl_cuemu_attention_backward_ex16, "fp32", 2, 7, 4, 2, 8, 0, 0);
    attn_bwd16_case(b32_ex, fl_cuemu_attention_backward_ex16, "fp32", 1, 70, 3, 1, 24, 5, 1); /* partial tiles */
    attn_bwd16_case(fl_cuemu_attention_backward_tc, fl_cuemu_attention_backward_tc16, "tc", 1, 19, 2, 1, 64, 8, 0);
    attn_bwd16_case(b32_fa, b16_fa, "fa2", 2, 67, 2, 2, 64, 0, 0);
    attn_bwd16_case(b32_fa, b16_fa, "fa2", 1, 33, 2, 1, 128, 8, 1);
}

#else
FL_TEST(cuda_bf16_rmsnorm_backward_in16) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_bf16_attention_backward16) { fl_test_skip("no CUDA emulator in this build"); }
#endif
