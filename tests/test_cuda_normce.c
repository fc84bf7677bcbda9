/* The split column sums (the norm backwards' dw / db, bias_backward16) and the split cross-entropy (the 2026-11-30
 * 18:00 wave, norm.cu's colsum and xent.cu) under the CPU emulator.
 * Anchors: float64 and bounds. Each column sum is checked against its float64 value within the fp32 summation bound
 * of its length: |got - exact| <= gamma(n + k) (|acc0| + sum |terms|), gamma(m) = m u / (1 - m u), u = 2^-24, n the
 * rows, k the roundings of a term (RMSNorm x * r then * dy: 2; LayerNorm (x - mean) * r * dy: 3; db: 0) plus the add
 * to the accumulator; the cross-entropy's loss and gradient against float64 softmax within the first-order bound of
 * its fp32 evaluation (below); bf16 outputs within that plus bf16's half ulp (2^-8 relative); bias_backward16's dy16
 * copy and the ignored rows (loss 0, gradient +0) bit for bit. Determinism: every result also equals, bit for bit,
 * the same call over the same data one element off 16-byte alignment (the element path: the same order, the order
 * a function of the shape alone) and a second run under another emulator shuffle seed. Shapes: N not a multiple of
 * the 128-row tile, C = 1, C not a multiple of 4, C past one 128-column block, N large enough for several tiles and
 * the tile cap of a wide C; V = 1, V not a multiple of 4, several chunks, TinyLlama's V 32000, rows with
 * ignore_index, dlogits aliasing logits. */
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

#define NC_U 0x1p-24
static double gam(double m) { return m * NC_U / (1.0 - m * NC_U); }

static float *nrnd(unsigned *s, size_t n, float lo, float hi, int off) {
    float *x = (float *)malloc((n + 4) * sizeof(float)) + off;
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        x[i] = lo + (hi - lo) * (float)(*s >> 8) / 16777216.0f;
    }
    return x;
}
/* the same values at +off elements (off 1: one float off 16-byte alignment) */
static float *nshift(const float *x, size_t n, int off) {
    float *y = (float *)malloc((n + 4) * sizeof(float)) + off;
    memcpy(y, x, n * sizeof(float));
    return y;
}
static int same_bits(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

/* one norm's column sums: ln (LayerNorm: mean, dw and db) or RMSNorm (dw; x16: its bf16-input variant) */
static void colsum_case(int ln, int x16, int N, int C) {
    unsigned s = 7u + (unsigned)(N * 31 + C);
    const size_t nc = (size_t)N * C;
    float *dy = nrnd(&s, nc, -1.0f, 1.0f, 0), *x = nrnd(&s, nc, -2.0f, 2.0f, 0);
    float *rstd = nrnd(&s, (size_t)N, 0.5f, 1.5f, 0), *mean = nrnd(&s, (size_t)N, -0.3f, 0.3f, 0);
    float *w = nrnd(&s, (size_t)C, 0.5f, 1.5f, 0), *dw0 = nrnd(&s, (size_t)C, -1.0f, 1.0f, 0);
    float *db0 = nrnd(&s, (size_t)C, -1.0f, 1.0f, 0);
    uint16_t *xb = malloc(nc * 2 + 16);
    FL_CHECK(fl_convert(xb, FL_BF16, x, FL_F32, nc) == FL_OK && fl_convert(x, FL_F32, xb, FL_BF16, nc) == FL_OK);
    float *dw[3], *db[3];
    for (int r = 0; r < 3; r++) { /* 0: aligned, 1: dy and x one element off (the element path), 2: another seed */
        const int off = r == 1;
        float *dyr = nshift(dy, nc, off), *xr = nshift(x, nc, off);
        uint16_t *xbr = malloc(nc * 2 + 16);
        memcpy(xbr + off, xb, nc * 2);
        dw[r] = nshift(dw0, (size_t)C, 0), db[r] = nshift(db0, (size_t)C, 0);
        fl_cu_emu_set_seed(r == 2 ? 0x9e3779b9ull : 0x5eedull);
        if (ln)
            EMU_OK(fl_cuemu_layernorm_backward(NULL, dw[r], db[r], dyr, xr, w, mean, rstd, N, C, EMU_WORK, NULL));
        else if (x16)
            EMU_OK(fl_cuemu_rmsnorm_backward_w16(NULL, NULL, dw[r], dyr, NULL, xbr + off, w, FL_F32, rstd, N, C,
                                                 EMU_WORK, NULL));
        else
            EMU_OK(fl_cuemu_rmsnorm_backward(NULL, dw[r], dyr, xr, w, rstd, N, C, EMU_WORK, NULL));
        free(dyr - off), free(xr - off), free(xbr);
    }
    fl_cu_emu_set_seed(0x5eedull);
    int ok = 1, det = 1;
    double worst = 0;
    for (int c = 0; c < C; c++) {
        double ew = dw0[c], aw = fabs(dw0[c]), eb = db0[c], ab = fabs(db0[c]);
        for (int n = 0; n < N; n++) {
            const double d = dy[(size_t)n * C + c], xv = x[(size_t)n * C + c];
            const double t = d * (ln ? (xv - mean[n]) * rstd[n] : xv * rstd[n]);
            ew += t, aw += fabs(t), eb += d, ab += fabs(d);
        }
        const double tw = gam(N + (ln ? 4 : 3)) * aw, tb = gam(N + 1) * ab;
        worst = fmax(worst, fabs(dw[0][c] - ew) / (tw > 0 ? tw : 1));
        if (!(fabs(dw[0][c] - ew) <= tw)) ok = 0;
        if (ln && !(fabs(db[0][c] - eb) <= tb)) ok = 0;
    }
    for (int r = 1; r < 3; r++)
        det &= same_bits(dw[0], dw[r], (size_t)C * 4) && (!ln || same_bits(db[0], db[r], (size_t)C * 4));
    FL_CHECKF(ok, "%s N %d C %d: dw / db outside the fp32 summation bound (worst %.3g of it)",
              ln ? "layernorm" : x16 ? "rmsnorm_w16" : "rmsnorm", N, C, worst);
    FL_CHECKF(det, "%s N %d C %d: the element path or another seed changed the bits", ln ? "layernorm" : "rmsnorm",
              N, C);
    for (int r = 0; r < 3; r++) free(dw[r]), free(db[r]);
    free(dy), free(x), free(rstd), free(mean), free(w), free(dw0), free(db0), free(xb);
}

/* bias_backward16: db accumulates the column sums of dy, dy16 = RNE(dy) bit for bit */
static void bias_case(int N, int OC) {
    unsigned s = 3u + (unsigned)(N + OC);
    const size_t n = (size_t)N * OC;
    float *dy = nrnd(&s, n, -1.0f, 1.0f, 0), *db0 = nrnd(&s, (size_t)OC, -1.0f, 1.0f, 0);
    float *db = nshift(db0, (size_t)OC, 0);
    uint16_t *d16 = malloc(n * 2 + 16), *want = malloc(n * 2 + 16);
    EMU_OK(fl_cuemu_bias_backward16(db, d16, dy, N, OC, EMU_WORK, NULL));
    FL_CHECK(fl_convert(want, FL_BF16, dy, FL_F32, n) == FL_OK);
    FL_CHECKF(same_bits(d16, want, n * 2), "bias_backward16 %dx%d: dy16 is not RNE(dy)", N, OC);
    int ok = 1;
    for (int c = 0; c < OC; c++) {
        double e = db0[c], a = fabs(db0[c]);
        for (int r = 0; r < N; r++) e += dy[(size_t)r * OC + c], a += fabs(dy[(size_t)r * OC + c]);
        if (!(fabs(db[c] - e) <= gam(N + 1) * a)) ok = 0;
    }
    FL_CHECKF(ok, "bias_backward16 %dx%d: db outside the fp32 summation bound", N, OC);
    free(dy), free(db0), free(db), free(d16), free(want);
}

FL_TEST(cuda_normce_colsum) {
    static const int shapes[][2] = {{1, 1}, {7, 1}, {300, 3}, {129, 130}, {1000, 2048}, {260, 9}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int N = shapes[k][0], C = shapes[k][1];
        colsum_case(0, 0, N, C);
        colsum_case(0, 1, N, C);
        colsum_case(1, 0, N, C);
        bias_case(N, C);
    }
    if (fl_test_quick()) return;
    colsum_case(0, 1, 8192, 2048); /* TinyLlama's: 64 tiles */
    colsum_case(1, 0, 31 * 128 + 5, 4100); /* the tile cap of a wide C: 31 tiles of 129 rows */
}

/* The float64 reference of a row and the bound of the kernel's fp32 evaluation against it: the chunk sums carry
 * gamma(V + 4) (each exp(x - M) one rounding of x - M, relative |x - M| u, expf's 2 ulps, the sum's V - 1 adds;
 * the merge's rescale the same again), so lse is within e_s = gamma(V + 8) + 2 u (2 R + 2) + 4 u (logf, + M) of its
 * value times max(1, |lse|); the loss adds u |loss|; a gradient element g p (p the exact probability) is within
 * |g| p (e_s + u |x - lse| + 4 u) + u |g| (the target's subtraction), bf16 output half an ulp (2^-8) more. */
static void xent_case(int N, int V, int dbf16, int alias) {
    unsigned s = 11u + (unsigned)(N * 7 + V);
    const size_t nv = (size_t)N * V;
    const float R = 6.0f, gs = 0.37f;
    float *x = nrnd(&s, nv, -R, R, 0);
    int32_t *tg = malloc((size_t)N * sizeof(int32_t));
    for (int n = 0; n < N; n++) {
        s = s * 1664525u + 1013904223u;
        tg[n] = n % 3 == 1 ? FL_IGNORE_INDEX : (int32_t)((s >> 8) % (unsigned)V);
    }
    float *loss[2], *dl[2];
    uint16_t *d16[2];
    for (int r = 0; r < 2; r++) { /* 0: aligned, 1: one element off (the element path) under another seed */
        const int off = r;
        float *xr = nshift(x, nv, off);
        loss[r] = malloc((size_t)N * 4);
        dl[r] = alias ? xr : dbf16 ? NULL : (float *)malloc((nv + 4) * 4) + off;
        d16[r] = dbf16 ? (uint16_t *)malloc(nv * 2 + 16) + off : NULL;
        fl_cu_emu_set_seed(r ? 0x9e3779b9ull : 0x5eedull);
        if (dbf16)
            EMU_OK(fl_cuemu_cross_entropy_dbf16(loss[r], d16[r], xr, tg, N, V, V, gs, FL_IGNORE_INDEX, EMU_WORK, NULL));
        else
            EMU_OK(fl_cuemu_cross_entropy(loss[r], dl[r], xr, tg, N, V, gs, FL_IGNORE_INDEX, EMU_WORK, NULL));
        if (!alias) free(xr - off);
    }
    fl_cu_emu_set_seed(0x5eedull);
    int ok_l = 1, ok_d = 1, ok_ig = 1;
    double wl = 0, wd = 0;
    for (int n = 0; n < N; n++) {
        const float *xr = x + (size_t)n * V;
        if (tg[n] == FL_IGNORE_INDEX) {
            ok_ig &= loss[0][n] == 0.0f && !signbit(loss[0][n]);
            for (int v = 0; v < V; v++) {
                const size_t i = (size_t)n * V + v;
                ok_ig &= dbf16 ? d16[0][i] == 0 : same_bits(&dl[0][i], &(float){0.0f}, 4);
            }
            continue;
        }
        double M = -INFINITY, S = 0;
        for (int v = 0; v < V; v++) M = fmax(M, xr[v]);
        for (int v = 0; v < V; v++) S += exp((double)xr[v] - M);
        const double lse = M + log(S), L = lse - xr[tg[n]];
        const double es = gam(V + 8) + 2 * NC_U * (2 * R + 2) + 4 * NC_U;
        const double tl = es * fmax(1.0, fabs(lse)) + NC_U * fabs(L);
        wl = fmax(wl, fabs(loss[0][n] - L) / tl);
        if (!(fabs(loss[0][n] - L) <= tl)) ok_l = 0;
        for (int v = 0; v < V; v++) {
            const size_t i = (size_t)n * V + v;
            const double p = exp((double)xr[v] - lse), want = gs * p - (v == tg[n] ? gs : 0.0);
            const double got = dbf16 ? fl_bf16_to_f32(d16[0][i]) : dl[0][i];
            double tol = gs * p * (es * fmax(1.0, fabs(lse)) + NC_U * fabs(xr[v] - lse) + 4 * NC_U) + NC_U * gs;
            if (dbf16) tol += 0x1p-8 * (fabs(want) + tol); /* bf16: 8 significant bits, RNE within 2^-8 relative */
            wd = fmax(wd, fabs(got - want) / tol);
            if (!(fabs(got - want) <= tol)) ok_d = 0;
        }
    }
    FL_CHECKF(ok_l, "cross_entropy%s %dx%d: a loss outside its bound (worst %.3g of it)", dbf16 ? "_dbf16" : "", N, V,
              wl);
    FL_CHECKF(ok_d, "cross_entropy%s %dx%d%s: a gradient outside its bound (worst %.3g of it)", dbf16 ? "_dbf16" : "",
              N, V, alias ? " (aliased)" : "", wd);
    FL_CHECKF(ok_ig, "cross_entropy %dx%d: an ignored row's loss or gradient is not +0", N, V);
    FL_CHECKF(same_bits(loss[0], loss[1], (size_t)N * 4) &&
                  (dbf16 ? same_bits(d16[0], d16[1], nv * 2) : same_bits(dl[0], dl[1], nv * 4)),
              "cross_entropy %dx%d: the element path or another seed changed the bits", N, V);
    for (int r = 0; r < 2; r++) {
        free(loss[r]);
        if (dbf16) free(d16[r] - r);
        else free(dl[r] - r);
    }
    free(x), free(tg);
}

FL_TEST(cuda_normce_xent) {
    static const int shapes[][2] = {{5, 1}, {3, 7}, {4, 101}, {4, 2 * 2048 + 3}, {3, 4100}, {2, 32000}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int N = shapes[k][0], V = shapes[k][1];
        xent_case(N, V, 0, 0);
        xent_case(N, V, 1, 0);
        xent_case(N, V, 0, 1);
    }
    if (fl_test_quick()) return;
    xent_case(262, 32000, 1, 0); /* TinyLlama's head chunk */
    xent_case(65538, 1, 0, 0);   /* two row groups (a grid's y is at most 65535) */
}
#else
FL_TEST(cuda_normce_colsum) { fl_test_skip("no CUDA emulator in this build"); }
FL_TEST(cuda_normce_xent) { fl_test_skip("no CUDA emulator in this build"); }
#endif
