/* The CUDA kernels that write a bf16-stored activation themselves (issue 30 item 1: act_forward16, add16,
 * rope_forward16, and the backward halves act_backward16 / rope_backward16 that leave a bf16 copy of the
 * gradient for the next LINEAR; backend.h), under the CPU emulator. Anchors:
 *   - bits: each is the fp32 kernel of the same op (checked against float64 and the CPU backend in
 *     test_cuda_emu.c / test_ops.c) followed by round16 (checked against the CPU's RNE in test_cuda_more.c):
 *     the bf16 copy must be that rounding bit for bit and the fp32 view its exact widening; with a bf16-only
 *     input (act_forward16's in16) the fp32 input view must be the exact widening too;
 *   - float64: the stored value within one bf16 rounding (2^-8 relative) plus the fp32 op's own error (near64:
 *     a derived bound, no tuned tolerance);
 *   - odd shapes (partial warps, one element, more elements than one grid stride), aliasing (add16 in place),
 *     two emulator shuffle seeds (the same bits), and refused kinds / shapes. */
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

static const uint64_t k_seeds[] = {0x51ed5eedull, 0xc0ffee11ull};


/* want16 = RNE(y), y = its widening (what round16 leaves) */
static void round_ref(float *y, uint16_t *want16, size_t n) {
    FL_REQUIRE_OK(fl_convert(want16, FL_BF16, y, FL_F32, n));
    FL_REQUIRE_OK(fl_convert(y, FL_F32, want16, FL_BF16, n));
}

/* |got - want64| <= 2^-8 |want| + 1e-6 |want| + atol: one bf16 rounding (half an ulp: 2^-9 relative, taken
 * twice for the fp32 value's own error) of an fp32 result within a few ulps relative (plus atol: the fp32
 * op's absolute error where terms cancel) of want */
static int near64(const char *what, const float *got, const double *want, size_t n, double atol) {
    for (size_t i = 0; i < n; i++) {
        const double w = want[i], tol = ldexp(fabs(w), -8) + 1e-6 * fabs(w) + atol;
        if (!(fabs((double)got[i] - w) <= tol)) {
            fprintf(stderr, "      %s[%zu] = %.9g, float64 %.9g (tolerance %.3g)\n", what, i, got[i], w, tol);
            return 0;
        }
    }
    return 1;
}

/* the fp32 kernels of each kind (emulated): the reference bits of the act16 ops; paired: [gate | up] rows of 2F */
static int act_paired(int kind) { return kind == FL_CU_ACT16_SWIGLU || kind == FL_CU_ACT16_GEGLU; }
static void act_fwd32(int kind, float *y, const float *x, int N, int F) {
    if (kind == FL_CU_ACT16_SWIGLU) EMU_OK(fl_cuemu_swiglu_forward(y, x, N, F, NULL));
    else if (kind == FL_CU_ACT16_GEGLU) EMU_OK(fl_cuemu_geglu_forward(y, x, N, F, NULL));
    else if (kind == FL_CU_ACT16_GELU) EMU_OK(fl_cuemu_gelu_forward(y, x, (size_t)N * F, NULL));
    else EMU_OK(fl_cuemu_relu_forward(y, x, (size_t)N * F, NULL));
}
static void act_bwd32(int kind, float *dx, const float *dy, const float *x, int N, int F) {
    if (kind == FL_CU_ACT16_SWIGLU) EMU_OK(fl_cuemu_swiglu_backward(dx, dy, x, N, F, NULL));
    else if (kind == FL_CU_ACT16_GEGLU) EMU_OK(fl_cuemu_geglu_backward(dx, dy, x, N, F, NULL));
    else if (kind == FL_CU_ACT16_GELU) EMU_OK(fl_cuemu_gelu_backward(dx, dy, x, (size_t)N * F, NULL));
    else EMU_OK(fl_cuemu_relu_backward(dx, dy, x, (size_t)N * F, NULL));
}

static double act64(int kind, double g, double u) {
    if (kind == FL_CU_ACT16_SWIGLU) return g / (1.0 + exp(-g)) * u;
    if (kind == FL_CU_ACT16_GEGLU) return 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u;
    if (kind == FL_CU_ACT16_GELU) return 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
    return g < 0 ? 0.0 : g;
}

/* act_forward16 of kind over N rows of F outputs; bf16_in: the input given as its bf16 copy only */
static void act16_case(int kind, int N, int F, int bf16_in) {
    const int W = act_paired(kind) ? 2 * F : F; /* input row width */
    const size_t ni = (size_t)N * W, no = (size_t)N * F;
    fl_test_rng r = {(uint64_t)(kind * 1009 + N * 31 + F + bf16_in)};
    float *x = fl_test_frand(&r, ni, -6, 6), *y1 = malloc(no * 4), *y2 = malloc(no * 4), *xin = malloc(ni * 4);
    uint16_t *x16 = malloc(ni * 2), *want16 = malloc(no * 2), *got16 = malloc(no * 2);
    if (bf16_in) round_ref(x, x16, ni); /* x: the widened input the fp32 kernel sees */
    act_fwd32(kind, y1, x, N, F); /* the fp32 kernel, then the rounding */
    round_ref(y1, want16, no);
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memset(y2, 0xff, no * 4);
        memset(got16, 0xff, no * 2);
        if (bf16_in) memset(xin, 0xff, ni * 4);
        else memcpy(xin, x, ni * 4);
        EMU_OK(fl_cuemu_act_forward16(kind, y2, got16, xin, bf16_in ? x16 : NULL, N, F, NULL));
        FL_CHECKF(!memcmp(got16, want16, no * 2) && !memcmp(y2, y1, no * 4) && !memcmp(xin, x, ni * 4),
                  "act_forward16 kind %d N=%d F=%d in16=%d: not the fp32 kernel's value rounded (or the input view)", kind,
                  N, F, bf16_in);
    }
    /* out NULL (the act's fp32 view nothing reads, issue 30 item 1): the same copy; with in16 also in NULL (the
     * fp32 view of a bf16-only input not filled) */
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memset(got16, 0xff, no * 2);
        if (!bf16_in) memcpy(xin, x, ni * 4);
        EMU_OK(fl_cuemu_act_forward16(kind, NULL, got16, bf16_in ? NULL : xin, bf16_in ? x16 : NULL, N, F, NULL));
        FL_CHECKF(!memcmp(got16, want16, no * 2), "act_forward16 kind %d N=%d F=%d in16=%d out NULL: not the full path's "
                  "copy", kind, N, F, bf16_in);
    }
    double *want = malloc(no * sizeof(double));
    for (int n = 0; n < N; n++)
        for (int f = 0; f < F; f++) {
            const float *row = x + (size_t)n * W;
            want[(size_t)n * F + f] = act64(kind, row[f], act_paired(kind) ? row[F + f] : 1.0);
        }
    FL_CHECK(near64("act_forward16", y2, want, no, 1e-12));
    /* out16 NULL: the fp32 kernel's bits (the bf16-input-only use) */
    if (bf16_in) {
        EMU_OK(fl_cuemu_act_forward16(kind, y2, NULL, xin, x16, N, F, NULL));
        float *y0 = malloc(no * 4);
        act_fwd32(kind, y0, x, N, F);
        FL_CHECKF(!memcmp(y0, y2, no * 4), "act_forward16 kind %d without out16: not the fp32 kernel's bits", kind);
        free(y0);
    }
    free(want); free(x); free(y1); free(y2); free(xin); free(x16); free(want16); free(got16);
}

FL_TEST(cuda_bf16_act_forward16) {
    for (int in16 = 0; in16 < 2; in16++) {
        act16_case(FL_CU_ACT16_SWIGLU, 3, 37, in16); /* partial warp */
        act16_case(FL_CU_ACT16_SWIGLU, 1, 1, in16);
        act16_case(FL_CU_ACT16_GELU, 130, 300, in16); /* several blocks */
        act16_case(FL_CU_ACT16_RELU, 7, 33, in16);
        act16_case(FL_CU_ACT16_GEGLU, 3, 37, in16); /* T5 v1.1's: scalar (F % 8), then the 128-bit path */
        act16_case(FL_CU_ACT16_GEGLU, 9, 64, in16);
    }
    act16_case(FL_CU_ACT16_SWIGLU, 5, 60001, 1); /* more than one grid stride (1024 x 256) */
    float y = 0, x = 0;
    uint16_t y16 = 0;
    FL_CHECK(fl_cuemu_act_forward16(7, &y, &y16, &x, NULL, 1, 1, NULL) != 0); /* no such kind */
    FL_CHECK(fl_cuemu_act_forward16(FL_CU_ACT16_RELU, NULL, NULL, &x, NULL, 1, 1, NULL) != 0); /* no output */
    FL_CHECK(fl_cuemu_act_forward16(FL_CU_ACT16_RELU, &y, &y16, NULL, NULL, 1, 1, NULL) != 0); /* no input */
    FL_CHECK(fl_cuemu_act_forward16(FL_CU_ACT16_RELU | FL_CU_ACT16_ROUND_IN, &y, &y16, NULL, &y16, 1, 1, NULL) != 0);
}

/* add16: out = a + b stored; in place (out == a) as the graph's residual add */
static void add16_case(size_t n) {
    fl_test_rng r = {n * 7 + 1};
    float *a = fl_test_frand(&r, n, -50, 50), *b = fl_test_frand(&r, n, -50, 50), *want = malloc(n * 4);
    float *got = malloc(n * 4);
    uint16_t *w16 = malloc(n * 2), *g16 = malloc(n * 2);
    double *w64 = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) want[i] = a[i] + b[i], w64[i] = (double)a[i] + b[i];
    round_ref(want, w16, n);
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memcpy(got, a, n * 4);
        memset(g16, 0xff, n * 2);
        EMU_OK(fl_cuemu_add16(got, g16, got, b, n, NULL));
        FL_CHECKF(!memcmp(got, want, n * 4) && !memcmp(g16, w16, n * 2), "add16 n=%zu: not (a + b) rounded", n);
    }
    FL_CHECK(near64("add16", got, w64, n, 0));
    free(a); free(b); free(want); free(got); free(w16); free(g16); free(w64);
}

FL_TEST(cuda_bf16_add16) {
    add16_case(1);
    add16_case(37);
    add16_case(300001);
}

/* rope_forward16 / rope_backward16 (bwd) from x under both seeds: got and g16 equal want and w16 bit for bit; then
 * with no fp32 output (out NULL, issue 30 item 1: a rotated q|k|v or d(q|k|v) no op reads in fp32): the same g16,
 * x not written */
static void rope16_same(int bwd, const float *x, float *got, uint16_t *g16, const float *want, const uint16_t *w16,
                        int B, int T, int nh, int HD, int width, const float *cs, const float *sn, int pos0) {
    const size_t n = (size_t)B * T * width;
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memcpy(got, x, n * 4);
        memset(g16, 0xff, n * 2);
        if (bwd) EMU_OK(fl_cuemu_rope_backward16(got, g16, got, B, T, nh, HD, width, cs, sn, pos0, NULL));
        else EMU_OK(fl_cuemu_rope_forward16(got, g16, got, B, T, nh, HD, width, cs, sn, pos0, NULL));
        FL_CHECKF(!memcmp(got, want, n * 4) && !memcmp(g16, w16, n * 2),
                  "rope_%s16 B=%d T=%d nh=%d HD=%d width=%d: not the fp32 rope + its bf16 copy (forward: x rounded)",
                  bwd ? "backward" : "forward", B, T, nh, HD, width);
        memcpy(got, x, n * 4);
        memset(g16, 0xff, n * 2);
        if (bwd) EMU_OK(fl_cuemu_rope_backward16(NULL, g16, got, B, T, nh, HD, width, cs, sn, pos0, NULL));
        else EMU_OK(fl_cuemu_rope_forward16(NULL, g16, got, B, T, nh, HD, width, cs, sn, pos0, NULL));
        FL_CHECKF(!memcmp(got, x, n * 4) && !memcmp(g16, w16, n * 2),
                  "rope_%s16 out NULL B=%d T=%d nh=%d HD=%d width=%d: %s", bwd ? "backward" : "forward", B, T, nh, HD,
                  width, memcmp(got, x, n * 4) ? "wrote its input" : "not the full path's bf16 copy");
    }
    if (bwd) { /* x and out NULL (attention_backward_b16's bf16 gradients): x16 rotated in place, the bits of the call
                * over its widening, the columns past the heads untouched */
        uint16_t *x16 = malloc(n * 2), *r16 = malloc(n * 2);
        float *xw = malloc(n * 4);
        FL_REQUIRE_OK(fl_convert(x16, FL_BF16, x, FL_F32, n));
        FL_REQUIRE_OK(fl_convert(xw, FL_F32, x16, FL_BF16, n));
        EMU_OK(fl_cuemu_rope_backward16(NULL, r16, xw, B, T, nh, HD, width, cs, sn, pos0, NULL));
        EMU_OK(fl_cuemu_rope_backward16(NULL, x16, NULL, B, T, nh, HD, width, cs, sn, pos0, NULL));
        FL_CHECKF(!memcmp(x16, r16, n * 2), "rope_backward16 in place on bf16 B=%d T=%d nh=%d HD=%d width=%d: not the "
                  "bits over its widening", B, T, nh, HD, width);
        free(x16), free(r16), free(xw);
        /* in place with an fp32 output: refused */
        FL_CHECK(fl_cuemu_rope_backward16(got, g16, NULL, B, T, nh, HD, width, cs, sn, pos0, NULL) != 0);
    }
    /* no output at all, or no input: refused */
    FL_CHECK(fl_cuemu_rope_forward16(NULL, NULL, got, B, T, nh, HD, width, cs, sn, pos0, NULL) != 0);
    FL_CHECK(fl_cuemu_rope_forward16(NULL, g16, NULL, B, T, nh, HD, width, cs, sn, pos0, NULL) != 0);
    FL_CHECK(fl_cuemu_rope_backward16(NULL, NULL, NULL, B, T, nh, HD, width, cs, sn, pos0, NULL) != 0);
}

/* rope_forward16 over fused q|k|v rows: nh rotated heads of HD, then tail floats stored only */
static void rope16_case(int B, int T, int nh, int HD, int tail, int pos0) {
    const int width = nh * HD + tail, H = HD / 2, maxT = pos0 + T;
    const size_t n = (size_t)B * T * width;
    fl_test_rng r = {(uint64_t)(B * 131 + T * 17 + nh * 5 + HD + tail)};
    float *x = fl_test_frand(&r, n, -3, 3), *cs = malloc((size_t)maxT * H * 4), *sn = malloc((size_t)maxT * H * 4);
    for (int t = 0; t < maxT; t++)
        for (int j = 0; j < H; j++) {
            const double th = t * pow(10000.0, -2.0 * j / HD);
            cs[(size_t)t * H + j] = (float)cos(th), sn[(size_t)t * H + j] = (float)sin(th);
        }
    float *want = malloc(n * 4), *got = malloc(n * 4);
    uint16_t *w16 = malloc(n * 2), *g16 = malloc(n * 2);
    memcpy(want, x, n * 4);
    EMU_OK(fl_cuemu_rope(want, B, T, nh, HD, (size_t)width, cs, sn, pos0, 0, NULL));
    double *w64 = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) w64[i] = want[i]; /* the fp32 rotation: float64 checked below on the rotated part */
    for (size_t row = 0; row < (size_t)B * T; row++) {
        const int t = (int)(row % T);
        for (int h = 0; h < nh; h++)
            for (int j = 0; j < H; j++) {
                const double c = cs[(size_t)(pos0 + t) * H + j], s = sn[(size_t)(pos0 + t) * H + j];
                const float *a = x + row * width + (size_t)h * HD;
                w64[row * width + (size_t)h * HD + j] = a[j] * c - a[j + H] * s;
                w64[row * width + (size_t)h * HD + j + H] = a[j + H] * c + a[j] * s;
            }
    }
    round_ref(want, w16, n);
    rope16_same(0, x, got, g16, want, w16, B, T, nh, HD, width, cs, sn, pos0);
    /* |x0 c| + |x1 s| <= 2 * 3: two products and a sum rounded in fp32, 3 * 2^-24 * 6 */
    FL_CHECK(near64("rope_forward16", want, w64, n, 3 * 6 * ldexp(1, -24))); /* = got, bit for bit (above) */
    /* the backward: rope_backward's bits in dx (unrounded) and their bf16 copy over the whole rows */
    memcpy(want, x, n * 4);
    EMU_OK(fl_cuemu_rope(want, B, T, nh, HD, (size_t)width, cs, sn, pos0, 1, NULL));
    FL_REQUIRE_OK(fl_convert(w16, FL_BF16, want, FL_F32, n));
    rope16_same(1, x, got, g16, want, w16, B, T, nh, HD, width, cs, sn, pos0);
    FL_CHECK(fl_cuemu_rope_forward16(got, g16, got, B, T, nh, HD + 1, width, cs, sn, pos0, NULL) != 0); /* odd HD */
    FL_CHECK(fl_cuemu_rope_forward16(got, g16, got, B, T, nh + 1, HD, nh * HD, cs, sn, pos0, NULL) != 0); /* narrow */
    free(x); free(cs); free(sn); free(want); free(got); free(w16); free(g16); free(w64);
}

FL_TEST(cuda_bf16_rope_forward16) {
    rope16_case(2, 5, 3, 8, 8, 3);     /* GQA 2:1 q|k|v: 3 rotated heads, V stored only; pos0 > 0 */
    rope16_case(1, 7, 2, 6, 0, 0);     /* no tail */
    rope16_case(3, 33, 12, 64, 256, 0); /* head size 64, several blocks */
    if (!fl_test_asan_light()) rope16_case(2, 300, 12, 64, 256, 5); /* more than one grid stride (1,024 x 256) */
}

/* act_backward16: din += the fp32 backward's terms (accumulating into a nonzero din) and din16 = RNE(din), din
 * itself unrounded: the bits of the fp32 kernel followed by a convert */
static void act16_bwd_case(int kind, int N, int F) {
    const int W = act_paired(kind) ? 2 * F : F;
    const size_t ni = (size_t)N * W, no = (size_t)N * F;
    fl_test_rng r = {(uint64_t)(kind * 7919 + N * 13 + F)};
    float *x = fl_test_frand(&r, ni, -6, 6), *dy = fl_test_frand(&r, no, -1, 1), *d0 = fl_test_frand(&r, ni, -1, 1);
    float *want = malloc(ni * 4), *got = malloc(ni * 4);
    uint16_t *w16 = malloc(ni * 2), *g16 = malloc(ni * 2);
    memcpy(want, d0, ni * 4);
    act_bwd32(kind, want, dy, x, N, F);
    FL_REQUIRE_OK(fl_convert(w16, FL_BF16, want, FL_F32, ni));
    for (int k = 0; k < 2; k++) {
        fl_cu_emu_set_seed(k_seeds[k]);
        memcpy(got, d0, ni * 4);
        memset(g16, 0xff, ni * 2);
        EMU_OK(fl_cuemu_act_backward16(kind, got, g16, dy, x, NULL, N, F, NULL));
        FL_CHECKF(!memcmp(got, want, ni * 4) && !memcmp(g16, w16, ni * 2),
                  "act_backward16 kind %d N=%d F=%d: not the fp32 backward + its bf16 copy", kind, N, F);
    }
    FL_CHECK(fl_cuemu_act_backward16(kind, got, NULL, dy, x, NULL, N, F, NULL) != 0); /* the copy is the point */
    /* din NULL (issue 30 item 1: a d(in) only the LINEAR before reads, in bf16): the full path's copy over a zeroed
     * din, both seeds, with the input in fp32 and in bf16; no output at all, or no dy: refused */
    uint16_t *z16 = malloc(ni * 2);
    for (int in16 = 0; in16 < 2; in16++) {
        uint16_t *xb = malloc(ni * 2);
        FL_REQUIRE_OK(fl_convert(xb, FL_BF16, x, FL_F32, ni));
        memset(got, 0, ni * 4);
        EMU_OK(fl_cuemu_act_backward16(kind, got, z16, dy, in16 ? NULL : x, in16 ? xb : NULL, N, F, NULL));
        for (int k = 0; k < 2; k++) {
            fl_cu_emu_set_seed(k_seeds[k]);
            memset(g16, 0xff, ni * 2);
            EMU_OK(fl_cuemu_act_backward16(kind, NULL, g16, dy, in16 ? NULL : x, in16 ? xb : NULL, N, F, NULL));
            FL_CHECKF(!memcmp(g16, z16, ni * 2), "act_backward16 din NULL kind %d N=%d F=%d in16 %d: not the copy of the "
                      "update of a zeroed din", kind, N, F, in16);
        }
        free(xb);
    }
    FL_CHECK(fl_cuemu_act_backward16(kind, NULL, NULL, dy, x, NULL, N, F, NULL) != 0);
    FL_CHECK(fl_cuemu_act_backward16(kind, NULL, g16, NULL, x, NULL, N, F, NULL) != 0);
    free(z16);
    /* in16 (a bf16 run's stored input read as it is, issue 30 item 1): the fp32 backward over its exact widening,
     * with and without the copy */
    uint16_t *x16 = malloc(ni * 2);
    round_ref(x, x16, ni); /* x: the widened input */
    memcpy(want, d0, ni * 4);
    act_bwd32(kind, want, dy, x, N, F);
    FL_REQUIRE_OK(fl_convert(w16, FL_BF16, want, FL_F32, ni));
    for (int with16 = 0; with16 < 2; with16++) {
        memcpy(got, d0, ni * 4);
        memset(g16, 0xff, ni * 2);
        EMU_OK(fl_cuemu_act_backward16(kind, got, with16 ? g16 : NULL, dy, NULL, x16, N, F, NULL));
        FL_CHECKF(!memcmp(got, want, ni * 4) && (with16 ? !memcmp(g16, w16, ni * 2) : g16[0] == 0xffff),
                  "act_backward16 in16 kind %d N=%d F=%d: not the fp32 backward over the widened input", kind, N, F);
    }
    free(x16);
    free(x); free(dy); free(d0); free(want); free(got); free(w16); free(g16);
}

FL_TEST(cuda_bf16_act_backward16) {
    act16_bwd_case(FL_CU_ACT16_SWIGLU, 3, 37);
    act16_bwd_case(FL_CU_ACT16_SWIGLU, 2, 60001); /* more than one grid stride */
    act16_bwd_case(FL_CU_ACT16_GELU, 130, 300);
    act16_bwd_case(FL_CU_ACT16_RELU, 7, 33);
    act16_bwd_case(FL_CU_ACT16_SWIGLU, 1, 1);
    act16_bwd_case(FL_CU_ACT16_GEGLU, 3, 37); /* T5 v1.1's: scalar, then the 128-bit path */
    act16_bwd_case(FL_CU_ACT16_GEGLU, 9, 64);
}
/* attention_forward16 (the three forward kernels' out16): out16 = RNE(out of the same launcher without it) and out
 * its exact widening, lse unchanged, the padding columns of a strided out16 untouched; causal GQA with a partial
 * query tile, fp32 kernels at odd HD (8, 24) and the tensor-core ones (tc, fa2) at HD 64; two shuffle seeds. */
typedef int (*fwd16_fn)(const fl_attn_desc *, float *, void *, float *, const float *, const float *, const float *,
                        const uint8_t *, void *);
static int fwd16_ex(const fl_attn_desc *a, float *o, void *o16, float *l, const float *q, const float *k,
                    const float *v, const uint8_t *m, void *st) {
    return fl_cuemu_attention_forward_ex(a, o, o16, l, q, k, v, NULL, m, st);
}
/* causal self-attention over fused q|k|v rows (width *W, rows *N), out rows padded by pad */
static fl_attn_desc qkv_desc(int B, int T, int NH, int NKV, int HD, int pad, size_t *W, size_t *N) {
    fl_attn_desc a = {.B = B, .Tq = T, .Tk = T, .NH = NH, .NKV = NKV, .HD = HD, .scale = 1.0f / sqrtf((float)HD),
                      .causal = 1};
    *W = (size_t)(NH + 2 * NKV) * HD, *N = (size_t)B * T;
    a.ldq = a.ldk = a.ldv = *W;
    a.ldo = (size_t)NH * HD + (size_t)pad;
    return a;
}
static void attn16_case(fwd16_fn f, const char *kn, int B, int T, int NH, int NKV, int HD, int pad) {
    fl_test_rng r = {(uint64_t)(B * 131 + T * 7 + HD + pad)};
    size_t W, N;
    fl_attn_desc a = qkv_desc(B, T, NH, NKV, HD, pad, &W, &N);
    float *qkv = fl_test_frand(&r, N * W, -1, 1), *q = qkv, *k = qkv + (size_t)NH * HD, *v = k + (size_t)NKV * HD;
    const size_t no = N * a.ldo, nl = (size_t)B * NH * T;
    float *o1 = malloc(no * 4), *o2 = malloc(no * 4), *l1 = malloc(nl * 4), *l2 = malloc(nl * 4);
    uint16_t *w16 = malloc(no * 2), *g16 = malloc(no * 2);
    memset(o1, 0, no * 4);
    EMU_OK(f(&a, o1, NULL, l1, q, k, v, NULL, NULL));
    round_ref(o1, w16, no);
    for (int s = 0; s < 2; s++) {
        fl_cu_emu_set_seed(k_seeds[s]);
        memset(o2, 0, no * 4);
        memset(g16, 0xab, no * 2);
        EMU_OK(f(&a, o2, g16, l2, q, k, v, NULL, NULL));
        int ok = !memcmp(l1, l2, nl * 4), pad_ok = 1;
        for (size_t n = 0; n < N; n++)
            for (size_t c = 0; c < a.ldo; c++) {
                const size_t i = n * a.ldo + c;
                if (c < (size_t)NH * HD) ok &= o2[i] == o1[i] && g16[i] == w16[i];
                else pad_ok &= g16[i] == 0xabab && o2[i] == 0.0f;
            }
        FL_CHECKF(ok && pad_ok, "attention_forward16 %s B%d T%d NH%d/%d HD%d pad %d: %s", kn, B, T, NH, NKV, HD, pad,
                  ok ? "wrote the padding" : "out16 not RNE(out), out not its widening, or lse changed");
        /* out NULL (the attention output's fp32 view nothing reads, issue 30 item 1): the same copy and lse */
        memset(g16, 0xab, no * 2);
        memset(l2, 0xff, nl * 4);
        EMU_OK(f(&a, NULL, g16, l2, q, k, v, NULL, NULL));
        ok = !memcmp(l1, l2, nl * 4), pad_ok = 1;
        for (size_t n = 0; n < N; n++)
            for (size_t c = 0; c < a.ldo; c++) {
                const size_t i = n * a.ldo + c;
                if (c < (size_t)NH * HD) ok &= g16[i] == w16[i];
                else pad_ok &= g16[i] == 0xabab;
            }
        FL_CHECKF(ok && pad_ok, "attention_forward16 %s B%d T%d NH%d/%d HD%d pad %d out NULL: %s", kn, B, T, NH, NKV, HD,
                  pad, ok ? "wrote the padding" : "out16 or lse not the full path's");
    }
    FL_CHECK(f(&a, NULL, NULL, l2, q, k, v, NULL, NULL) != 0); /* no output at all */
    free(qkv); free(o1); free(o2); free(l1); free(l2); free(w16); free(g16);
}

FL_TEST(cuda_bf16_attention_forward16) {
    attn16_case(fwd16_ex, "fp32", 2, 7, 4, 2, 8, 0);
    attn16_case(fwd16_ex, "fp32", 1, 70, 3, 1, 24, 5);  /* 2 query tiles, a partial one; strided out */
    attn16_case(fl_cuemu_attention_forward_tc, "tc", 1, 19, 2, 1, 64, 8);
    attn16_case(fl_cuemu_attention_forward_fa2, "fa2", 2, 67, 2, 2, 64, 0);
    attn16_case(fl_cuemu_attention_forward_fa2, "fa2", 1, 33, 2, 1, 128, 8);
}

/* attention_forward_*16 (issue 30 item 1: a bf16 run's q|k|v slot written by its GEMM in bf16 only): out, out16 and
 * lse the bits of the fp32 launcher over the exact widening of q16|k16|v16, for the three forward kernels (causal
 * GQA, partial query tiles, a strided out, odd fp32-kernel HD, tc / fa2 at HD 64 and 128), two shuffle seeds; the
 * backend slot (cuda-emu) the bits of attention_forward16 over the widened copy; cpu / ref / opaque have none. */
typedef int (*fwdin16_fn)(const fl_attn_desc *, float *, void *, float *, const void *, const void *, const void *,
                          const uint8_t *, void *);
static void attn_in16_case(fwd16_fn f32, fwdin16_fn f16, const char *kn, int B, int T, int NH, int NKV, int HD,
                           int pad) {
    fl_test_rng r = {(uint64_t)(B * 17 + T * 3 + HD + pad)};
    size_t W, N;
    fl_attn_desc a = qkv_desc(B, T, NH, NKV, HD, pad, &W, &N);
    float *qkv = fl_test_frand(&r, N * W, -1, 1);
    uint16_t *q16 = malloc(N * W * 2);
    round_ref(qkv, q16, N * W); /* qkv: the exact widening of q16 */
    const size_t no = N * a.ldo, nl = (size_t)B * NH * T, QD = (size_t)NH * HD, KVD = (size_t)NKV * HD;
    float *o1 = calloc(no, 4), *o2 = malloc(no * 4), *l1 = malloc(nl * 4), *l2 = malloc(nl * 4);
    uint16_t *w16 = calloc(no, 2), *g16 = malloc(no * 2);
    EMU_OK(f32(&a, o1, w16, l1, qkv, qkv + QD, qkv + QD + KVD, NULL, NULL));
    for (int s = 0; s < 2; s++) {
        fl_cu_emu_set_seed(k_seeds[s]);
        memset(o2, 0, no * 4);
        memset(g16, 0, no * 2);
        EMU_OK(f16(&a, o2, g16, l2, q16, q16 + QD, q16 + QD + KVD, NULL, NULL));
        FL_CHECKF(!memcmp(o1, o2, no * 4) && !memcmp(w16, g16, no * 2) && !memcmp(l1, l2, nl * 4),
                  "attention_forward %s in16 B%d T%d NH%d/%d HD%d pad %d: not the fp32 launcher's bits over the "
                  "widened q|k|v", kn, B, T, NH, NKV, HD, pad);
        memset(g16, 0, no * 2); /* out NULL: the copy and lse alone (issue 30 item 1) */
        memset(l2, 0xff, nl * 4);
        EMU_OK(f16(&a, NULL, g16, l2, q16, q16 + QD, q16 + QD + KVD, NULL, NULL));
        FL_CHECKF(!memcmp(w16, g16, no * 2) && !memcmp(l1, l2, nl * 4),
                  "attention_forward %s in16 B%d T%d NH%d/%d HD%d pad %d out NULL: not the full path's out16 / lse", kn,
                  B, T, NH, NKV, HD, pad);
    }
    free(qkv); free(q16); free(o1); free(o2); free(l1); free(l2); free(w16); free(g16);
}
static int fwd16_tc(const fl_attn_desc *a, float *o, void *o16, float *l, const float *q, const float *k,
                    const float *v, const uint8_t *m, void *st) {
    return fl_cuemu_attention_forward_tc(a, o, o16, l, q, k, v, m, st);
}
static int fwdin16_ex(const fl_attn_desc *a, float *o, void *o16, float *l, const void *q, const void *k,
                      const void *v, const uint8_t *m, void *st) {
    return fl_cuemu_attention_forward_ex16(a, o, o16, l, q, k, v, m, st);
}

FL_TEST(cuda_bf16_attention_forward_in16) {
    attn_in16_case(fwd16_ex, fwdin16_ex, "fp32", 2, 7, 4, 2, 8, 0);
    attn_in16_case(fwd16_ex, fwdin16_ex, "fp32", 1, 70, 3, 1, 24, 5); /* a partial query tile; strided out */
    attn_in16_case(fwd16_tc, fl_cuemu_attention_forward_tc16, "tc", 1, 19, 2, 1, 64, 8);
    attn_in16_case(fl_cuemu_attention_forward_fa2, fl_cuemu_attention_forward_fa2_16, "fa2", 2, 67, 2, 2, 64, 0);
    attn_in16_case(fl_cuemu_attention_forward_fa2, fl_cuemu_attention_forward_fa2_16, "fa2", 1, 33, 2, 1, 128, 8);
    static const char *const others[] = {"cpu", "ref", "opaque"};
    for (int k = 0; k < 3; k++) {
        fl_backend o;
        FL_REQUIRE_OK(fl_backend_init_by_name(others[k], &o, 1));
        FL_CHECKF(o.attention_forward_in16 == NULL, "%s has attention_forward_in16 (tested here on cuda-emu only)",
                  others[k]);
        fl_backend_free(&o);
    }
    fl_backend be; /* the slot: its kernel choice over the same rows, against attention_forward16 */
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_REQUIRE(be.attention_forward_in16 != NULL);
    enum { B = 1, T = 9, NH = 2, NKV = 1, HD = 8, W = (NH + 2 * NKV) * HD };
    const fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    fl_test_rng r = {0x9e16};
    float *qkv = fl_test_frand(&r, T * W, -1, 1), o1[T * NH * HD], o2[T * NH * HD], l1[NH * T], l2[NH * T];
    uint16_t q16[T * W], w16[T * NH * HD], g16[T * NH * HD];
    round_ref(qkv, q16, (size_t)T * W);
    FL_CHECK(be.attention_forward16(&be, &a, o1, w16, l1, qkv, qkv + NH * HD, qkv + (NH + NKV) * HD, NULL, NULL) ==
             FL_OK);
    FL_CHECK(be.attention_forward_in16(&be, &a, o2, g16, l2, q16, q16 + NH * HD, q16 + (NH + NKV) * HD, NULL) == FL_OK);
    FL_CHECK(!memcmp(o1, o2, sizeof o1) && !memcmp(w16, g16, sizeof w16) && !memcmp(l1, l2, sizeof l1));
    /* the slots with out NULL: the bf16 copy alone (issue 30 item 1), the same bits; neither output: refused */
    memset(g16, 0, sizeof g16);
    FL_CHECK(be.attention_forward_in16(&be, &a, NULL, g16, l2, q16, q16 + NH * HD, q16 + (NH + NKV) * HD, NULL) == FL_OK);
    FL_CHECK(!memcmp(w16, g16, sizeof w16) && !memcmp(l1, l2, sizeof l1));
    memset(g16, 0, sizeof g16);
    FL_CHECK(be.attention_forward16(&be, &a, NULL, g16, l2, qkv, qkv + NH * HD, qkv + (NH + NKV) * HD, NULL, NULL) ==
             FL_OK);
    FL_CHECK(!memcmp(w16, g16, sizeof w16) && !memcmp(l1, l2, sizeof l1));
    FL_CHECK(be.attention_forward_in16(&be, &a, NULL, NULL, l2, q16, q16 + NH * HD, q16 + (NH + NKV) * HD, NULL) != FL_OK);
    free(qkv);
    fl_backend_free(&be);
}

/* bias_backward16 (a biased linear's bias gradient that leaves its bf16 dy, issue 30 item 1): db the bits of
 * bias_backward (the same column sum) and within the fp32 sum's bound of a float64 one, dy16 = RNE(dy) bit for bit;
 * odd shapes (a partial 16-column block, row groups G = N / 128 with the 4-row unrolled loop and its tail, one row),
 * two shuffle seeds; bad arguments refused by name; cpu / ref / opaque do not have the slot (the model converts). */
static void bias16_case(const fl_backend *be, int N, int OC) {
    fl_test_rng r = {(uint64_t)(N * 31 + OC)};
    const size_t n = (size_t)N * OC;
    float *dy = fl_test_frand(&r, n, -2, 2), *db0 = fl_test_frand(&r, (size_t)OC, -1, 1);
    float *d1 = malloc((size_t)OC * 4), *d2 = malloc((size_t)OC * 4);
    uint16_t *w16 = malloc(n * 2), *g16 = malloc(n * 2);
    FL_REQUIRE_OK(fl_convert(w16, FL_BF16, dy, FL_F32, n));
    memcpy(d1, db0, (size_t)OC * 4);
    be->bias_backward(be, d1, dy, N, OC);
    for (int s = 0; s < 2; s++) {
        fl_cu_emu_set_seed(k_seeds[s]);
        memcpy(d2, db0, (size_t)OC * 4);
        memset(g16, 0xab, n * 2);
        FL_CHECK(be->bias_backward16(be, d2, g16, dy, N, OC) == FL_OK);
        FL_CHECKF(!memcmp(d1, d2, (size_t)OC * 4) && !memcmp(g16, w16, n * 2),
                  "bias_backward16 N %d OC %d: db not bias_backward's bits or dy16 not RNE(dy)", N, OC);
    }
    int ok = 1;
    for (int c = 0; c < OC; c++) { /* float64: an fp32 sum of N + 1 terms within (N + 1) 2^-24 of their magnitude */
        double want = db0[c], mag = fabs(db0[c]);
        for (int i = 0; i < N; i++) want += dy[(size_t)i * OC + c], mag += fabs(dy[(size_t)i * OC + c]);
        ok &= fabs(d2[c] - want) <= (N + 1) * 0x1p-24 * mag;
    }
    FL_CHECKF(ok, "bias_backward16 N %d OC %d: db beyond the fp32 sum's bound of float64", N, OC);
    free(dy), free(db0), free(d1), free(d2), free(w16), free(g16);
}

FL_TEST(cuda_bf16_bias_backward16) {
    static const char *const others[] = {"cpu", "ref", "opaque"};
    for (int k = 0; k < 3; k++) {
        fl_backend o;
        FL_REQUIRE_OK(fl_backend_init_by_name(others[k], &o, 1));
        FL_CHECKF(o.bias_backward16 == NULL, "%s has bias_backward16 (this test checks only cuda-emu's)", others[k]);
        fl_backend_free(&o);
    }
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cuda-emu", &be, 1));
    FL_REQUIRE(be.bias_backward16 != NULL);
    bias16_case(&be, 7, 37);
    bias16_case(&be, 517, 19); /* 4 row groups: the unrolled rows and a tail */
    bias16_case(&be, 1, 1);
    float x[4] = {0};
    uint16_t h[4];
    FL_CHECK(be.bias_backward16(&be, x, NULL, x, 2, 2) == FL_ERR_INVALID && strstr(fl_error_message(), "dy16"));
    FL_CHECK(be.bias_backward16(&be, x, h, x, -1, 2) == FL_ERR_INVALID && strstr(fl_error_message(), "N -1"));
    fl_backend_free(&be);
}
#else
FL_TEST(cuda_bf16_bias_backward16) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_bf16_attention_forward_in16) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_bf16_act_forward16) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_bf16_attention_forward16) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_bf16_add16) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_bf16_rope_forward16) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_bf16_act_backward16) { fl_test_skip("no CUDA emulator in this build"); }
#endif
