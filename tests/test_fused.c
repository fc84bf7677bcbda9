/* Issue 30 item 4: the fused memory-bound ops, on every registered backend (cuda-emu runs the CUDA kernels
 * under the emulator) against float64 references with test_ops.c's norm tolerances, odd shapes (partial
 * warps, C not a multiple of 4, one column), misaligned rows (the scalar path) and aliasing; on the CPU
 * backends the fused op is the two ops' bits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "test.h"

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
    float *ba = aligned_alloc(64, (n + 16) * 4), *bb = aligned_alloc(64, (n + 16) * 4), *bres = aligned_alloc(64, (n + 16) * 4);
    float *bout = aligned_alloc(64, (n + 16) * 4), *rstd = malloc((size_t)N * 4);
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
