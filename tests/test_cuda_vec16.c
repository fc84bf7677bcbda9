/* The 128-bit paths of the memory-bound CUDA kernels (issue 30 item 4: uint4 / float4 accesses of 8 bf16 or 4 fp32
 * values, a scalar tail for odd sizes, the scalar loop for misaligned pointers) under the CPU emulator: add / add16,
 * round16, convert, convert_many, act_forward16 / act_backward16 (SwiGLU, tanh GELU, ReLU; in16 / out16 / din16),
 * AdamW (adamw_update_ex) and SGD (sgd_update_ex) over fp32 and 16-bit storage.
 * Anchor: bits. Each op runs twice on the same values: once on 16-byte aligned buffers (the vector path, which the
 * emulator's count of 128-bit accesses must show ran) and once on buffers one element off alignment (the scalar
 * path, the kernels as they were, checked against float64 and the CPU backend in test_cuda_emu.c, test_cuda_bf16.c
 * and test_cuda_more.c); every output must be the same bits. Sizes: below 8 (the tail only), 8k + 5 (groups and a
 * tail), SwiGLU widths that are and are not multiples of 8, and one add16 over more than one grid stride of groups
 * (1024 blocks x 256 threads x 8). The emulator also stops on a misaligned 128-bit access (a GPU faults). */
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

/* A test array: `bytes` of values at an aligned base (a[0]) and the same values one element (esz bytes) past a
 * 16-byte boundary (a[1]). */
typedef struct {
    unsigned char *buf[2];
    void *a[2];
    size_t bytes;
} twin;
static void twin_init(twin *t, const void *vals, size_t bytes, size_t esz) {
    t->bytes = bytes;
    for (int k = 0; k < 2; k++) {
        t->buf[k] = aligned_alloc(16, (bytes + 32 + 15) / 16 * 16);
        t->a[k] = t->buf[k] + (k ? 16 + esz : 0);
        if (vals) memcpy(t->a[k], vals, bytes);
        else memset(t->a[k], 0x5a, bytes);
    }
}
static int twin_same(const twin *t) { return !memcmp(t->a[0], t->a[1], t->bytes); }
static void twin_free(twin *t) { free(t->buf[0]), free(t->buf[1]); }

static float *frand(size_t n, int seed, float lo, float hi) {
    fl_test_rng r = {(uint64_t)seed * 7919u + n};
    return fl_test_frand(&r, n ? n : 1, lo, hi);
}
static void *narrow16(const float *x, size_t n, fl_dtype dt) {
    uint16_t *h = malloc(n * 2 + 2);
    FL_CHECK(fl_convert(h, dt, x, FL_F32, n) == FL_OK);
    return h;
}

/* the vector path ran in launch k == 0 (aligned) and no 128-bit access in k == 1 (misaligned) */
#define VEC_RAN(k, before, what)                                                                                      \
    FL_CHECKF((k) == 0 ? fl_cu_emu_vec_accesses > (before) : fl_cu_emu_vec_accesses == (before),                   \
              "%s: %lu 128-bit accesses on the %s buffers", what, fl_cu_emu_vec_accesses - (before),                \
              (k) == 0 ? "aligned" : "misaligned")

static void add_case(size_t n, int with16) {
    float *a = frand(n, 1, -3, 3), *b = frand(n, 2, -3, 3);
    twin ta, tb, to, t16;
    twin_init(&ta, a, n * 4, 4), twin_init(&tb, b, n * 4, 4), twin_init(&to, NULL, n * 4, 4);
    twin_init(&t16, NULL, n * 2, 2);
    for (int k = 0; k < 2; k++) {
        unsigned long v0 = fl_cu_emu_vec_accesses;
        if (with16)
            EMU_OK(fl_cuemu_add16(to.a[k], t16.a[k], ta.a[k], tb.a[k], n, NULL));
        else
            EMU_OK(fl_cuemu_add(to.a[k], ta.a[k], tb.a[k], n, NULL));
        if (n >= 8) VEC_RAN(k, v0, "add");
    }
    FL_CHECKF(twin_same(&to) && (!with16 || twin_same(&t16)), "add%s n=%zu: vector and scalar paths differ",
              with16 ? "16" : "", n);
    twin_free(&ta), twin_free(&tb), twin_free(&to), twin_free(&t16);
    free(a), free(b);
}

static void round16_case(fl_dtype dt, size_t n) {
    float *x = frand(n, 3, -100, 100);
    twin tx, td;
    twin_init(&tx, x, n * 4, 4), twin_init(&td, NULL, n * 2, 2);
    for (int k = 0; k < 2; k++) {
        unsigned long v0 = fl_cu_emu_vec_accesses;
        EMU_OK(fl_cuemu_round16(td.a[k], dt, tx.a[k], n, NULL));
        if (n >= 8) VEC_RAN(k, v0, "round16");
    }
    FL_CHECKF(twin_same(&tx) && twin_same(&td), "round16 %s n=%zu: vector and scalar paths differ", fl_dtype_name(dt),
              n);
    twin_free(&tx), twin_free(&td);
    free(x);
}

static void convert_case(fl_dtype dt, fl_dtype st, size_t n) {
    float *x = frand(n, 4, -70000, 70000);
    void *src = st == FL_F32 ? (void *)x : narrow16(x, n, st);
    const size_t ss = st == FL_F32 ? 4 : 2, ds = dt == FL_F32 ? 4 : 2;
    twin ts, td;
    twin_init(&ts, src, n * ss, ss), twin_init(&td, NULL, n * ds, ds);
    for (int k = 0; k < 2; k++) {
        unsigned long v0 = fl_cu_emu_vec_accesses;
        EMU_OK(fl_cuemu_convert(td.a[k], dt, ts.a[k], st, n, NULL));
        if (n >= 8) VEC_RAN(k, v0, "convert");
    }
    FL_CHECKF(twin_same(&td), "convert %s -> %s n=%zu: vector and scalar paths differ", fl_dtype_name(st),
              fl_dtype_name(dt), n);
    /* convert_many: an aligned segment and a misaligned one in one launch, each the bits of convert */
    twin tm;
    twin_init(&tm, NULL, n * ds, ds);
    void *dst[2] = {tm.a[0], tm.a[1]};
    const void *srcs[2] = {ts.a[0], ts.a[1]};
    const size_t len[2] = {n, n};
    EMU_OK(fl_cuemu_convert_many(2, dst, dt, srcs, st, len, NULL));
    FL_CHECKF(!memcmp(tm.a[0], td.a[0], n * ds) && !memcmp(tm.a[1], td.a[0], n * ds),
              "convert_many %s -> %s n=%zu: not convert's bits", fl_dtype_name(st), fl_dtype_name(dt), n);
    twin_free(&ts), twin_free(&td), twin_free(&tm);
    if (src != x) free(src);
    free(x);
}

/* act_forward16 and act_backward16 of kind over N rows of F outputs (SwiGLU: inputs (N, 2F)); in16: the input given
 * as its bf16 copy */
static void act_case(int kind, int N, int F, int in16) {
    const size_t no = (size_t)N * F, ni = kind == FL_CU_ACT16_SWIGLU ? 2 * no : no;
    float *x = frand(ni, 5, -4, 4), *dy = frand(no, 6, -1, 1), *d0 = frand(ni, 7, -1, 1);
    uint16_t *x16 = narrow16(x, ni, FL_BF16);
    twin tin, tin16, tout, to16, tdy, tdin, td16;
    twin_init(&tin, x, ni * 4, 4), twin_init(&tin16, x16, ni * 2, 2), twin_init(&tout, NULL, no * 4, 4);
    twin_init(&to16, NULL, no * 2, 2), twin_init(&tdy, dy, no * 4, 4), twin_init(&tdin, d0, ni * 4, 4);
    twin_init(&td16, NULL, ni * 2, 2);
    const int vec_expected = (kind != FL_CU_ACT16_SWIGLU || F % 8 == 0) && no >= 8;
    for (int k = 0; k < 2; k++) {
        unsigned long v0 = fl_cu_emu_vec_accesses;
        EMU_OK(fl_cuemu_act_forward16(kind, tout.a[k], to16.a[k], tin.a[k], in16 ? tin16.a[k] : NULL, N, F, NULL));
        EMU_OK(fl_cuemu_act_backward16(kind, tdin.a[k], td16.a[k], tdy.a[k], tin.a[k], in16 ? tin16.a[k] : NULL, N, F,
                                       NULL));
        if (vec_expected) VEC_RAN(k, v0, "act16");
    }
    FL_CHECKF(twin_same(&tout) && twin_same(&to16) && twin_same(&tin) && twin_same(&tdin) && twin_same(&td16),
              "act16 kind %d N=%d F=%d in16 %d: vector and scalar paths differ", kind, N, F, in16);
    twin_free(&tin), twin_free(&tin16), twin_free(&tout), twin_free(&to16), twin_free(&tdy), twin_free(&tdin);
    twin_free(&td16);
    free(x), free(dy), free(d0), free(x16);
}

/* AdamW then SGD (momentum, and a first step) on parameters of tp, gradients of tg, state of ts */
static void optim_case(fl_dtype tp, fl_dtype tg, fl_dtype ts, size_t n) {
    const size_t sp = tp == FL_F32 ? 4 : 2, sg = tg == FL_F32 ? 4 : 2, ss = ts == FL_F32 ? 4 : 2;
    float *p = frand(n, 8, -1, 1), *g = frand(n, 9, -0.1f, 0.1f), *m = frand(n, 10, -0.01f, 0.01f);
    float *v = frand(n, 11, 0, 0.001f);
    void *pp = tp == FL_F32 ? (void *)p : narrow16(p, n, tp), *gg = tg == FL_F32 ? (void *)g : narrow16(g, n, tg);
    void *mm = ts == FL_F32 ? (void *)m : narrow16(m, n, ts), *vv = ts == FL_F32 ? (void *)v : narrow16(v, n, ts);
    twin tp_, tg_, tm_, tv_;
    twin_init(&tp_, pp, n * sp, sp), twin_init(&tg_, gg, n * sg, sg), twin_init(&tm_, mm, n * ss, ss);
    twin_init(&tv_, vv, n * ss, ss);
    for (int k = 0; k < 2; k++) {
        unsigned long v0 = fl_cu_emu_vec_accesses;
        EMU_OK(fl_cuemu_adamw_update_ex(tp_.a[k], tp, tg_.a[k], tg, tm_.a[k], tv_.a[k], ts, n, 1e-3f, 0.9f, 0.95f,
                                        1e-8f, 0.1f, 3, 0.5f, NULL));
        EMU_OK(fl_cuemu_sgd_update_ex(tp_.a[k], tp, tg_.a[k], tg, tm_.a[k], ts, n, 1e-2f, 0.9f, 0.1f, 0.01f, 1, 0,
                                      0.5f, NULL));
        EMU_OK(fl_cuemu_sgd_update_ex(tp_.a[k], tp, tg_.a[k], tg, tv_.a[k], ts, n, 1e-2f, 0.9f, 0.0f, 0.0f, 0, 1,
                                      1.0f, NULL));
        if (n >= 8) VEC_RAN(k, v0, "optimizer");
    }
    FL_CHECKF(twin_same(&tp_) && twin_same(&tm_) && twin_same(&tv_),
              "adamw/sgd p %s g %s state %s n=%zu: vector and scalar paths differ", fl_dtype_name(tp), fl_dtype_name(tg),
              fl_dtype_name(ts), n);
    twin_free(&tp_), twin_free(&tg_), twin_free(&tm_), twin_free(&tv_);
    if (pp != p) free(pp);
    if (gg != g) free(gg);
    if (mm != m) free(mm);
    if (vv != v) free(vv);
    free(p), free(g), free(m), free(v);
}

FL_TEST(cuda_vec16_elementwise) {
    const size_t sizes[] = {5, 8, 8 * 37 + 5};
    for (size_t i = 0; i < 3; i++) {
        add_case(sizes[i], 0);
        add_case(sizes[i], 1);
        round16_case(FL_BF16, sizes[i]);
        round16_case(FL_F16, sizes[i]);
        convert_case(FL_BF16, FL_F32, sizes[i]);
        convert_case(FL_F32, FL_BF16, sizes[i]);
        convert_case(FL_F16, FL_BF16, sizes[i]);
        optim_case(FL_F32, FL_F32, FL_F32, sizes[i]);
        optim_case(FL_BF16, FL_BF16, FL_BF16, sizes[i]);
        optim_case(FL_F16, FL_F32, FL_F32, sizes[i]);
    }
    add_case((size_t)8 * 1024 * 256 + 8 * 3 + 5, 1); /* more than one grid stride of groups */
}

/* act_forward16 with FL_CU_ACT16_ROUND_IN (a stored input not rounded yet): the bits of round16 then act_forward16
 * over the rounded fp32 view (in16, in and out, out16), on the vector and the element path */
static void round_in_case(int kind, int N, int F) {
    const size_t no = (size_t)N * F, ni = kind == FL_CU_ACT16_SWIGLU ? 2 * no : no;
    float *x = frand(ni, 12, -4, 4), *x1 = malloc(ni * 4), *o1 = malloc(no * 4);
    uint16_t *h1 = malloc(ni * 2), *g1 = malloc(no * 2);
    memcpy(x1, x, ni * 4);
    EMU_OK(fl_cuemu_round16(h1, FL_BF16, x1, ni, NULL));
    EMU_OK(fl_cuemu_act_forward16(kind, o1, g1, x1, NULL, N, F, NULL));
    twin tin, tin16, tout, to16;
    twin_init(&tin, x, ni * 4, 4), twin_init(&tin16, NULL, ni * 2, 2), twin_init(&tout, NULL, no * 4, 4);
    twin_init(&to16, NULL, no * 2, 2);
    for (int k = 0; k < 2; k++) {
        EMU_OK(fl_cuemu_act_forward16(kind | FL_CU_ACT16_ROUND_IN, tout.a[k], to16.a[k], tin.a[k], tin16.a[k], N, F,
                                      NULL));
        FL_CHECKF(!memcmp(tin.a[k], x1, ni * 4) && !memcmp(tin16.a[k], h1, ni * 2) && !memcmp(tout.a[k], o1, no * 4) &&
                      !memcmp(to16.a[k], g1, no * 2),
                  "act_forward16 ROUND_IN kind %d N=%d F=%d (%s): not round16 + act_forward16's bits", kind, N, F,
                  k ? "misaligned" : "aligned");
    }
    FL_CHECK(fl_cuemu_act_forward16(kind | FL_CU_ACT16_ROUND_IN, tout.a[0], NULL, tin.a[0], NULL, N, F, NULL) != 0);
    twin_free(&tin), twin_free(&tin16), twin_free(&tout), twin_free(&to16);
    free(x), free(x1), free(o1), free(h1), free(g1);
}

FL_TEST(cuda_vec16_act16) {
    round_in_case(FL_CU_ACT16_GELU, 7, 45);
    round_in_case(FL_CU_ACT16_RELU, 3, 5);
    round_in_case(FL_CU_ACT16_SWIGLU, 3, 40);
    round_in_case(FL_CU_ACT16_SWIGLU, 2, 37);
    for (int in16 = 0; in16 < 2; in16++) {
        act_case(FL_CU_ACT16_SWIGLU, 3, 40, in16); /* F % 8 == 0: the vector path */
        act_case(FL_CU_ACT16_SWIGLU, 3, 37, in16); /* the scalar loop either way */
        act_case(FL_CU_ACT16_GELU, 7, 45, in16);   /* 315: 39 groups and a tail */
        act_case(FL_CU_ACT16_RELU, 1, 5, in16);    /* tail only */
        act_case(FL_CU_ACT16_RELU, 5, 24, in16);
    }
    /* SwiGLU past one grid-stride step (1024 blocks x 256 threads) of runs of 8: the row / column counters carried
     * across steps (fl_cu_rowcol: 263 rows of 1001 runs, the stride 262144 = 261 rows + 903 runs) */
    if (!fl_test_asan_light()) act_case(FL_CU_ACT16_SWIGLU, 263, 8008, 1); /* under ASan the small cases */
}
#else
FL_TEST(cuda_vec16_elementwise) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_vec16_act16) { fl_test_skip("no CUDA emulator in this build"); }
#endif
