/* Issue 30 item 4: the fused memory-bound ops, on every registered backend (cuda-emu runs the CUDA kernels
 * under the emulator) against float64 references with test_ops.c's norm tolerances, odd shapes (partial
 * warps, C not a multiple of 4, one column), misaligned rows (the scalar path) and aliasing; on the CPU
 * backends the fused op is the two ops' bits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "test.h"

/* 64-byte aligned memory (aligned_alloc wants a size that is a multiple of the alignment) */
static void *al64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* res = a + b, out = rmsnorm(res) * w, in float64 from the fp32 inputs (res rounded to fp32 first, as the op) */
static void add_rmsnorm_ref(const float *a, const float *b, const float *w, int N, int C, double eps, float *res,
                            float *out, float *rstd) {
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int c = 0; c < C; c++) {
            res[(size_t)n * C + c] = a[(size_t)n * C + c] + b[(size_t)n * C + c]; /* one fp32 rounding: exact spec */
            ss += (double)res[(size_t)n * C + c] * res[(size_t)n * C + c];
        }
        double r = 1.0 / sqrt(ss / C + eps);
        rstd[n] = (float)r;
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = (float)(res[(size_t)n * C + c] * r * w[c]);
    }
}

static void add_rmsnorm_case(fl_backend *be, int N, int C, int misalign, int alias) {
    fl_test_rng r = {(unsigned long long)(N * 131 + C * 7 + misalign + 3 * alias)};
    const float eps = 1e-5f;
    const size_t n = (size_t)N * C, off = misalign ? 1 : 0;
    /* 64-byte aligned blocks, the tensors at +off floats (off 1: every row pointer misaligned) */
    float *ba = al64((n + 16) * 4), *bb = al64((n + 16) * 4), *bres = al64((n + 16) * 4);
    float *bout = al64((n + 16) * 4), *rstd = malloc((size_t)N * 4);
    float *x = fl_test_frand(&r, n, -2, 2), *y = fl_test_frand(&r, n, -2, 2), *w = fl_test_frand(&r, (size_t)C, 0.5f, 1.5f);
    FL_REQUIRE(ba && bb && bres && bout && rstd && x && y && w);
    float *a = ba + off, *b = bb + off, *res = alias ? a : bres + off, *out = bout + off;
    memcpy(a, x, n * 4);
    memcpy(b, y, n * 4);
    float *wres = malloc(n * 4), *wout = malloc(n * 4), *wr = malloc((size_t)N * 4);
    add_rmsnorm_ref(x, y, w, N, C, eps, wres, wout, wr);
    fl_status s = be->add_rmsnorm_forward(be, res, out, rstd, a, b, w, FL_F32, N, C, eps);
    FL_CHECKF(s == FL_OK, "[backend %s] N %d C %d: %s", be->name, N, C, fl_error_message());
    FL_CHECKF(memcmp(res, wres, n * 4) == 0, "[backend %s] N %d C %d misalign %d alias %d: res != a + b", be->name, N,
              C, misalign, alias);
    FL_CHECKF(fl_test_allclose("add_rmsnorm out", out, wout, n, 1e-5, 1e-6), "[backend %s] N %d C %d misalign %d",
              be->name, N, C, misalign);
    FL_CHECK(fl_test_allclose("add_rmsnorm rstd", rstd, wr, (size_t)N, 1e-5, 0));
    if (!strcmp(be->name, "cpu") || !strcmp(be->name, "ref")) { /* the two ops' bits */
        float *o2 = malloc(n * 4), *s2 = malloc(n * 4), *r2 = malloc((size_t)N * 4);
        be->add(be, s2, x, y, n);
        be->rmsnorm_forward(be, o2, r2, s2, w, N, C, eps);
        FL_CHECK(memcmp(o2, out, n * 4) == 0 && memcmp(r2, rstd, (size_t)N * 4) == 0);
        free(o2); free(s2); free(r2);
    }
    free(ba); free(bb); free(bres); free(bout); free(rstd); free(x); free(y); free(w); free(wres); free(wout); free(wr);
}

FL_TEST(fused_add_rmsnorm_forward) {
    static const int shapes[][2] = {{1, 1}, {3, 5}, {2, 3}, {7, 64}, {33, 260}, {5, 1000}, {2, 1028}, {4, 2052}};
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) {
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            for (int mis = 0; mis < 2; mis++) add_rmsnorm_case(&be, shapes[i][0], shapes[i][1], mis, 0);
        add_rmsnorm_case(&be, 9, 96, 0, 1); /* res = a, in place (the residual stream) */
        add_rmsnorm_case(&be, 9, 97, 0, 1);
        /* only fp32 activations so far: another dtype is refused, naming the op */
        float one = 1, o, rs;
        FL_CHECK(be.add_rmsnorm_forward(&be, &one, &o, &rs, &one, &one, &one, FL_BF16, 1, 1, 1e-5f) == FL_ERR_UNSUPPORTED &&
                 strstr(fl_error_message(), "add_rmsnorm_forward"));
    }
}

/* SwiGLU / GELU forward and backward: the 128-bit path (aligned buffers, F % 4 == 0) and the element path
 * (the same data one float off) give the same bits on every backend, and the CPU's values within fp32 noise.
 * The backward accumulates into a pre-filled gradient. */
typedef struct {
    float *p, *base;
} fbuf;
static fbuf fb_new(const float *src, size_t n, int off) {
    fbuf b;
    b.base = al64((n + 16) * 4);
    b.p = b.base + off;
    memcpy(b.p, src, n * 4);
    return b;
}
static void act_case(fl_backend *be, fl_backend *cpu, int glu, int N, int F) {
    fl_test_rng r = {(unsigned long long)(N * 17 + F * 3 + glu)};
    const size_t nin = glu ? (size_t)N * 2 * F : (size_t)N * F, nout = (size_t)N * F;
    float *x = fl_test_frand(&r, nin, -4, 4), *dy = fl_test_frand(&r, nout, -1, 1), *g0 = fl_test_frand(&r, nin, -1, 1);
    float *o[3], *dx[3];
    fl_backend *who[3] = {be, be, cpu};
    for (int k = 0; k < 3; k++) { /* k 0: aligned, 1: misaligned (element path), 2: the CPU */
        int off = k == 1;
        fbuf bx = fb_new(x, nin, off), bo = fb_new(dy, nout, off), bd = fb_new(dy, nout, off), bg = fb_new(g0, nin, off);
        if (glu) {
            who[k]->swiglu_forward(who[k], bo.p, bx.p, N, F);
            who[k]->swiglu_backward(who[k], bg.p, bd.p, bx.p, N, F);
        } else {
            who[k]->gelu_forward(who[k], bo.p, bx.p, nout);
            who[k]->gelu_backward(who[k], bg.p, bd.p, bx.p, nout);
        }
        o[k] = malloc(nout * 4);
        dx[k] = malloc(nin * 4);
        memcpy(o[k], bo.p, nout * 4);
        memcpy(dx[k], bg.p, nin * 4);
        free(bx.base); free(bo.base); free(bd.base); free(bg.base);
    }
    const char *what = glu ? "swiglu" : "gelu";
    FL_CHECKF(memcmp(o[0], o[1], nout * 4) == 0 && memcmp(dx[0], dx[1], nin * 4) == 0,
              "[backend %s] %s N %d F %d: the 128-bit path's bits differ from the element path's", be->name, what, N, F);
    FL_CHECKF(fl_test_allclose(what, o[0], o[2], nout, 1e-5, 1e-6), "[backend %s] %s N %d F %d forward", be->name, what,
              N, F);
    FL_CHECKF(fl_test_allclose(what, dx[0], dx[2], nin, 1e-5, 1e-6), "[backend %s] %s N %d F %d backward", be->name,
              what, N, F);
    for (int k = 0; k < 3; k++) { free(o[k]); free(dx[k]); }
    free(x); free(dy); free(g0);
}

FL_TEST(fused_act_vectorized_paths) {
    static const int shapes[][2] = {{1, 1}, {3, 8}, {5, 12}, {7, 13}, {2, 1028}, {3, 333}};
    fl_backend cpu, be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&cpu, 2));
    FL_FOR_EACH_BACKEND(be, 2) {
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            act_case(&be, &cpu, 1, shapes[i][0], shapes[i][1]);
            act_case(&be, &cpu, 0, shapes[i][0], shapes[i][1]); /* n = N F: multiples of 4 and tails of 1-3 */
        }
    }
    fl_cpu_backend_free(&cpu);
}

/* RMSNorm forward and the input gradient at widths where CUDA takes the 128-bit path (C % 4 == 0, aligned) and,
 * the same data one float off, the element path: against the float64 forward (test_ops.c's norm tolerance) and
 * the CPU backend's accumulated dx (fitllm_cuda_check's bound for a reordered fp32 row reduction). */
static void rms_case(fl_backend *be, fl_backend *cpu, int N, int C, int off) {
    fl_test_rng r = {(unsigned long long)(N * 5 + C + off)};
    const size_t n = (size_t)N * C;
    float *x = fl_test_frand(&r, n, -2, 2), *w = fl_test_frand(&r, (size_t)C, 0.5f, 1.5f);
    float *dy = fl_test_frand(&r, n, -1, 1), *g0 = fl_test_frand(&r, n, -1, 1);
    float *wout = malloc(n * 4), *wr = malloc((size_t)N * 4), *zero = calloc(n, 4), *tmp = malloc(n * 4);
    add_rmsnorm_ref(x, zero, w, N, C, 1e-5, tmp, wout, wr); /* x + 0 = x */
    fbuf bx = fb_new(x, n, off), bw = fb_new(w, (size_t)C, off), bo = fb_new(zero, n, off), bdy = fb_new(dy, n, off);
    fbuf bdx = fb_new(g0, n, off);
    float *rstd = malloc((size_t)N * 4), *cdx = malloc(n * 4), *crs = malloc((size_t)N * 4), *cout = malloc(n * 4);
    be->rmsnorm_forward(be, bo.p, rstd, bx.p, bw.p, N, C, 1e-5f);
    be->rmsnorm_backward(be, bdx.p, NULL, bdy.p, bx.p, bw.p, rstd, N, C);
    memcpy(cdx, g0, n * 4);
    cpu->rmsnorm_forward(cpu, cout, crs, x, w, N, C, 1e-5f);
    cpu->rmsnorm_backward(cpu, cdx, NULL, dy, x, w, crs, N, C);
    FL_CHECKF(fl_test_allclose("rmsnorm out", bo.p, wout, n, 1e-5, 1e-6), "[backend %s] N %d C %d off %d", be->name, N,
              C, off);
    FL_CHECK(fl_test_allclose("rmsnorm rstd", rstd, wr, (size_t)N, 1e-5, 0));
    FL_CHECKF(fl_test_allclose("rmsnorm dx", bdx.p, cdx, n, 2e-4, 2e-5), "[backend %s] N %d C %d off %d", be->name, N, C,
              off);
    free(bx.base); free(bw.base); free(bo.base); free(bdy.base); free(bdx.base);
    free(x); free(w); free(dy); free(g0); free(wout); free(wr); free(zero); free(tmp); free(rstd); free(cdx); free(crs);
    free(cout);
}

FL_TEST(fused_rmsnorm_vectorized_paths) {
    static const int shapes[][2] = {{3, 4}, {7, 64}, {5, 260}, {2, 1028}, {3, 2052}, {4, 13}};
    fl_backend cpu, be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&cpu, 2));
    FL_FOR_EACH_BACKEND(be, 2) {
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            for (int off = 0; off < 2; off++) rms_case(&be, &cpu, shapes[i][0], shapes[i][1], off);
    }
    fl_cpu_backend_free(&cpu);
}

/* ---- add_norm_forward16: the residual add fused with the next norm under a bf16 store (issue 30 item 4) ---------
 * Anchors: res16 is RNE of the fp32 sum bit for bit and res its widening (add16's spec); the norm of widen(res16) in
 * float64 bounds out16 (one bf16 rounding, 2^-8 |y|, plus the fp32 kernel's error, (C + 8) 2^-24 of the terms'
 * magnitude) and rstd / mean (the same fp32 bound); and the op is the SAME BITS as the two ops exec.c runs without it
 * (add16, or add and round16 / two converts; then the w16 norm, or the fp32 norm and the same rounding), every output.
 * Odd C, C % 8 == 0 and C % 4 == 0 only, more than one thread stride per row (C / 4 > 256), many rows, misaligned
 * pointers (all of them, or only a and b: the 4-wide mapping with element loads), res aliasing a, fp32 / bf16 / fp16
 * weights (bf16 / fp16 only where the backend has the w16 norms: refused by name otherwise), out == NULL and
 * res == NULL (cuda-emu: only the bf16 copies written; the composed op refuses them by name), two emulator seeds. */
#include "fitllm/dtype.h"
#ifdef FL_HAVE_CUDA_EMU
#include "backend/cuda/emu/cu_emu.h"
#endif

typedef struct {
    int ln, N, C, mis; /* mis 1: every tensor one float off; 2: a and b only */
    fl_dtype wt;
    int alias, no_out, no_res;
} an16_case;

static void an16_store_round(const fl_backend *be, uint16_t *x16, float *x, size_t n) {
    if (be->round16) {
        FL_CHECK(be->round16(be, x16, FL_BF16, x, n) == FL_OK);
        return;
    }
    FL_CHECK(be->convert(be, x16, FL_BF16, x, FL_F32, n) == FL_OK && be->convert(be, x, FL_F32, x16, FL_BF16, n) == FL_OK);
}
/* exec.c's two ops without the fused one */
static void an16_unfused(const fl_backend *be, const an16_case *k, float *res, uint16_t *res16, float *out,
                         uint16_t *out16, float *mean, float *rstd, const float *a, const float *b, const void *w,
                         const void *bias, float eps) {
    const size_t n = (size_t)k->N * k->C;
    if (be->add16)
        FL_CHECK(be->add16(be, res, res16, a, b, n) == FL_OK);
    else {
        be->add(be, res, a, b, n);
        an16_store_round(be, res16, res, n);
    }
    const int w16 = k->ln ? be->layernorm_forward_w16 != NULL : be->rmsnorm_forward_w16 != NULL;
    if (w16 && k->ln)
        be->layernorm_forward_w16(be, out, out16, mean, rstd, res, w, bias, k->wt, k->N, k->C, eps);
    else if (w16)
        be->rmsnorm_forward_w16(be, out, out16, rstd, res, w, k->wt, k->N, k->C, eps);
    else {
        if (k->ln)
            be->layernorm_forward(be, out, mean, rstd, res, w, bias, k->N, k->C, eps);
        else
            be->rmsnorm_forward(be, out, rstd, res, w, k->N, k->C, eps);
        an16_store_round(be, out16, out, n);
    }
}

static double an16_w(const void *w, fl_dtype wt, int c) {
    return wt == FL_F32 ? ((const float *)w)[c]
           : wt == FL_BF16 ? fl_bf16_to_f32(((const uint16_t *)w)[c]) : fl_f16_to_f32(((const uint16_t *)w)[c]);
}

static void an16_run(const fl_backend *be, const an16_case *k) {
    const int N = k->N, C = k->C;
    const size_t n = (size_t)N * C, oab = k->mis ? 1 : 0, orest = k->mis == 1 ? 1 : 0;
    const float eps = 1e-5f;
    fl_test_rng r = {(unsigned long long)(N * 977 + C * 13 + k->ln * 5 + k->wt * 3 + k->mis)};
    float *x = fl_test_frand(&r, n, -2, 2), *y = fl_test_frand(&r, n, -2, 2);
    float *wf = fl_test_frand(&r, (size_t)C, 0.5f, 1.5f), *bf = fl_test_frand(&r, (size_t)C, -0.5f, 0.5f);
    uint16_t *w16 = malloc((size_t)C * 2 + 2), *b16 = malloc((size_t)C * 2 + 2);
    FL_REQUIRE(x && y && wf && bf && w16 && b16);
    if (k->wt != FL_F32) { /* the 16-bit weight and bias */
        FL_REQUIRE_OK(fl_convert(w16, k->wt, wf, FL_F32, (size_t)C));
        FL_REQUIRE_OK(fl_convert(b16, k->wt, bf, FL_F32, (size_t)C));
    }
    const void *w = k->wt == FL_F32 ? (const void *)wf : w16, *bias = k->ln ? (k->wt == FL_F32 ? (const void *)bf : b16) : NULL;
    /* the fused op's buffers (set 0) and the unfused ops' (set 1); 64-byte aligned, the tensors at +off */
    float *ba[2], *bb[2], *bres[2], *bout[2], *mean[2], *rstd[2];
    uint16_t *b16r[2], *b16o[2];
    for (int s = 0; s < 2; s++) {
        ba[s] = al64((n + 16) * 4), bb[s] = al64((n + 16) * 4), bres[s] = al64((n + 16) * 4);
        bout[s] = al64((n + 16) * 4), b16r[s] = al64((n + 16) * 2), b16o[s] = al64((n + 16) * 2);
        mean[s] = malloc((size_t)N * 4), rstd[s] = malloc((size_t)N * 4);
        FL_REQUIRE(ba[s] && bb[s] && bres[s] && bout[s] && b16r[s] && b16o[s] && mean[s] && rstd[s]);
        memcpy(ba[s] + oab, x, n * 4);
        memcpy(bb[s] + oab, y, n * 4);
        memset(bres[s], 0x7f, (n + 16) * 4), memset(bout[s], 0x7f, (n + 16) * 4);
        memset(b16r[s], 0x7f, (n + 16) * 2), memset(b16o[s], 0x7f, (n + 16) * 2);
    }
    float *a0 = ba[0] + oab, *bv0 = bb[0] + oab;
    float *res0 = k->no_res ? NULL : k->alias ? a0 : bres[0] + orest, *out0 = k->no_out ? NULL : bout[0] + orest;
    uint16_t *r16 = b16r[0] + orest, *o16 = b16o[0] + orest;
    fl_status st = be->add_norm_forward16(be, k->ln, res0, r16, out0, o16, k->ln ? mean[0] : NULL, rstd[0], a0, bv0, w,
                                          bias, k->wt, N, C, eps);
    const int w16ok = k->ln ? be->layernorm_forward_w16 != NULL : be->rmsnorm_forward_w16 != NULL;
    if ((k->no_out || k->no_res) && !fl_test_backend_emulated(be)) { /* the composed op keeps the fp32 views */
        FL_CHECKF(st == FL_ERR_INVALID && strstr(fl_error_message(), "add_norm_forward16"), "[%s] NULL view: %d",
                  be->name, (int)st);
        goto done;
    }
    if (k->wt != FL_F32 && !w16ok) { /* the composed op over the fp32 norm: a 16-bit weight refused, named */
        FL_CHECKF(st == FL_ERR_UNSUPPORTED && strstr(fl_error_message(), "add_norm_forward16"), "[%s] wt %s: %d",
                  be->name, fl_dtype_name(k->wt), (int)st);
        goto done;
    }
    FL_CHECKF(st == FL_OK, "[%s] ln %d N %d C %d wt %s: %s", be->name, k->ln, N, C, fl_dtype_name(k->wt),
              fl_error_message());
    /* the spec: res16 = RNE(fp32 a + b), res its widening; the norm of widen(res16) in float64 */
    int ok16 = 1, okv = 1, oko = 1, oks = 1;
    for (int i = 0; i < N; i++) {
        double s1 = 0, s2 = 0, amag = 0;
        for (int c = 0; c < C; c++) {
            const size_t j = (size_t)i * C + c;
            const uint16_t h = fl_f32_to_bf16(x[j] + y[j]);
            ok16 &= r16[j] == h;
            if (res0) okv &= memcmp(&res0[j], &(float){fl_bf16_to_f32(h)}, 4) == 0;
            s1 += fl_bf16_to_f32(h), amag += fabs(fl_bf16_to_f32(h));
        }
        const double m = k->ln ? s1 / C : 0;
        for (int c = 0; c < C; c++) {
            const double v = fl_bf16_to_f32(r16[(size_t)i * C + c]) - m;
            s2 += v * v;
        }
        const double rs = 1.0 / sqrt(s2 / C + eps), fe = (C + 8) * 0x1p-24;
        oks &= fabs(rstd[0][i] - rs) <= fe * rs;
        if (k->ln) oks &= fabs(mean[0][i] - m) <= fe * amag / C;
        for (int c = 0; c < C; c++) {
            const size_t j = (size_t)i * C + c;
            const double xv = fl_bf16_to_f32(r16[j]), wv = an16_w(w, k->wt, c), bv = k->ln ? an16_w(bias, k->wt, c) : 0;
            const double want = (xv - m) * rs * wv + bv, got = fl_bf16_to_f32(o16[j]);
            const double scale = rs * (fabs(xv) + fabs(m)) * fabs(wv) + fabs(bv);
            oko &= fabs(got - want) <= 0x1p-8 * fabs(want) + fe * scale;
            if (out0) oko &= out0[j] == (float)got; /* the fp32 view: the bf16 copy's exact widening */
        }
    }
    FL_CHECKF(ok16 && okv, "[%s] ln %d N %d C %d mis %d: res16 != RNE(a + b) or res not its widening", be->name, k->ln,
              N, C, k->mis);
    FL_CHECKF(oko && oks, "[%s] ln %d N %d C %d wt %s mis %d: out16 / rstd / mean beyond the float64 bound", be->name,
              k->ln, N, C, fl_dtype_name(k->wt), k->mis);
    /* the same bits as the unfused ops (on fresh copies, with both fp32 views) */
    {
        float *a1 = ba[1] + oab, *res1 = k->alias ? a1 : bres[1] + orest, *out1 = bout[1] + orest;
        uint16_t *r16b = b16r[1] + orest, *o16b = b16o[1] + orest;
        an16_unfused(be, k, res1, r16b, out1, o16b, mean[1], rstd[1], a1, bb[1] + oab, w, bias, eps);
        int same = !memcmp(r16, r16b, n * 2) && !memcmp(o16, o16b, n * 2) && !memcmp(rstd[0], rstd[1], (size_t)N * 4);
        if (res0) same &= !memcmp(res0, res1, n * 4);
        if (out0) same &= !memcmp(out0, out1, n * 4);
        if (k->ln) same &= !memcmp(mean[0], mean[1], (size_t)N * 4);
        FL_CHECKF(same, "[%s] ln %d N %d C %d wt %s mis %d alias %d: not the bits of the unfused ops", be->name, k->ln, N,
                  C, fl_dtype_name(k->wt), k->mis, k->alias);
    }
done:
    for (int s = 0; s < 2; s++)
        free(ba[s]), free(bb[s]), free(bres[s]), free(bout[s]), free(b16r[s]), free(b16o[s]), free(mean[s]), free(rstd[s]);
    free(x), free(y), free(wf), free(bf), free(w16), free(b16);
}

FL_TEST(fused_add_norm_forward16) {
    /* odd C; C % 8 == 0; C % 4 == 0 only; C / 4 > 256 (two strides of the 4-wide mapping); many rows */
    static const int shapes[][2] = {{1, 1}, {3, 37}, {5, 64}, {4, 100}, {2, 1032}, {67, 12}};
    static const fl_dtype wts[3] = {FL_F32, FL_BF16, FL_F16};
    fl_backend be;
    FL_FOR_EACH_BACKEND(be, 2) {
        FL_REQUIRE(be.add_norm_forward16 != NULL);
        const int emu = fl_test_backend_emulated(&be);
        (void)emu;
        for (int ln = 0; ln < 2; ln++)
            for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
                for (int t = 0; t < 3; t++)
                    for (int mis = 0; mis < 3; mis++) {
                        an16_case k = {ln, shapes[i][0], shapes[i][1], mis, wts[t], 0, 0, 0};
                        an16_run(&be, &k);
                    }
        for (int ln = 0; ln < 2; ln++) {
            an16_case al = {ln, 9, 96, 0, FL_BF16, 1, 0, 0}; /* res = a, in place (the residual stream) */
            an16_run(&be, &al);
            an16_case no = {ln, 5, 64, 0, FL_BF16, 0, 1, 0}, nr = {ln, 3, 37, 0, FL_F32, 0, 1, 1};
            an16_run(&be, &no); /* out == NULL: only the bf16 copy (cuda-emu; refused by the composed op) */
            an16_run(&be, &nr); /* res and out NULL */
            an16_case many = {ln, 1030, 4, 0, FL_BF16, 0, 0, 0}; /* more blocks than add16's grid of 1024 (the fused
                                                                  * kernel: one block per row, no grid stride) */
            an16_run(&be, &many);
        }
#ifdef FL_HAVE_CUDA_EMU
        if (emu) { /* another interleaving of the emulated threads: the same bits */
            fl_cu_emu_set_seed(0xc0ffee11ull);
            for (int ln = 0; ln < 2; ln++) {
                an16_case k = {ln, 4, 100, 0, FL_BF16, 0, 0, 0};
                an16_run(&be, &k);
            }
            fl_cu_emu_set_seed(0x51ed5eedull);
        }
#endif
        /* bad arguments, named */
        float f = 1;
        uint16_t h = 0;
        FL_CHECK(be.add_norm_forward16(&be, 0, &f, NULL, &f, &h, NULL, &f, &f, &f, &f, NULL, FL_F32, 1, 1, 1e-5f) ==
                     FL_ERR_INVALID && strstr(fl_error_message(), "add_norm_forward16"));
        FL_CHECK(be.add_norm_forward16(&be, 0, &f, &h, &f, &h, NULL, &f, &f, &f, &f, NULL, FL_F32, 1, 0, 1e-5f) ==
                     FL_ERR_INVALID && strstr(fl_error_message(), "add_norm_forward16"));
    }
}
