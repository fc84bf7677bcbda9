/* fitllm selftest cases (selftest-impl.h; run by selftest.c's fl_backend_selftest): one function
 * per op family. Shapes are odd
 * on purpose (tile and block edges) and large enough that the timings mean something on a GPU. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/selftest-impl.h"
#include "fitllm/adam8bit.h"
#include "fitllm/lora.h"
#include "fitllm/quant4.h"

#define U32 0x1p-24
#define U16 0x1p-8

/* ---- GEMM --------------------------------------------------------------------------------- */
static void *st_as(const float *x, size_t n, fl_dtype t) { /* host copy of x stored as t */
    if (t == FL_F32) return fl_st_dup(x, n);
    uint16_t *h = malloc(n * 2 + 1);
    for (size_t i = 0; i < n && h; i++) h[i] = t == FL_BF16 ? fl_f32_to_bf16(x[i]) : fl_f32_to_f16(x[i]);
    return h;
}
static double st_val(const void *p, fl_dtype t, size_t i, fl_dtype round_to) {
    float v = t == FL_F32 ? ((const float *)p)[i]
                          : t == FL_BF16 ? fl_bf16_to_f32(((const uint16_t *)p)[i]) : fl_f16_to_f32(((const uint16_t *)p)[i]);
    if (round_to == FL_BF16) v = fl_bf16_to_f32(fl_f32_to_bf16(v));
    return v;
}
typedef struct {
    int ta_, tb_, M, N, K, lda, ldb, ldc;
    fl_dtype ta, tb, tc;
    const void *A, *B;
    void *C;
} st_gemm_arg;
static void st_gemm_run(st_ctx *c, void *p) {
    st_gemm_arg *a = p;
    c->dev->gemm(c->dev, a->ta_, a->tb_, a->M, a->N, a->K, 1.0f, a->A, a->ta, a->lda, a->B, a->tb, a->ldb, 0.0f, a->C,
                 a->tc, a->ldc);
}
static void st_case_gemm(st_ctx *c, int ta_, int tb_, int M, int N, int K, fl_dtype ta, fl_dtype tb, fl_dtype tc,
                         float beta) {
    char name[96];
    snprintf(name, sizeof name, "gemm %s%s %dx%dx%d %s.%s->%s%s", ta_ ? "T" : "N", tb_ ? "T" : "N", M, N, K,
             fl_dtype_name(ta), fl_dtype_name(tb), fl_dtype_name(tc), beta != 0 ? " +C" : "");
    if (!fl_st_want(c, name)) return;
    int ra = ta_ ? K : M, ca = ta_ ? M : K, rb = tb_ ? N : K, cb = tb_ ? K : N;
    int lda = ca + 3, ldb = cb + 1, ldc = N + 2; /* padded rows: strides exercised */
    float *A = fl_st_frand(c, (size_t)ra * lda, -1, 1), *B = fl_st_frand(c, (size_t)rb * ldb, -1, 1);
    float *C0 = fl_st_frand(c, (size_t)M * ldc, -1, 1);
    void *Ah = st_as(A, (size_t)ra * lda, ta), *Bh = st_as(B, (size_t)rb * ldb, tb);
    void *Cr = st_as(C0, (size_t)M * ldc, tc), *Cd = st_as(C0, (size_t)M * ldc, tc);
    size_t cb_ = (size_t)M * ldc * fl_dtype_size(tc);
    fl_status sr = c->ref->gemm(c->ref, ta_, tb_, M, N, K, 1.0f, Ah, ta, lda, Bh, tb, ldb, beta, Cr, tc, ldc);
    st_bufs b = {0};
    void *dA = fl_st_up(c, &b, Ah, (size_t)ra * lda * fl_dtype_size(ta));
    void *dB = fl_st_up(c, &b, Bh, (size_t)rb * ldb * fl_dtype_size(tb));
    void *dC = fl_st_up(c, &b, Cd, cb_);
    fl_status sd = b.failed ? FL_ERR_IO : c->dev->gemm(c->dev, ta_, tb_, M, N, K, 1.0f, dA, ta, lda, dB, tb, ldb, beta,
                                                      dC, tc, ldc);
    fl_st_down(c, &b, Cd, dC, cb_);
    /* mag[i,j] = sum_k |a_ik b_kj| + |beta c_ij| with the operands as both backends see them */
    fl_dtype rnd = (tb == FL_BF16) ? FL_BF16 : FL_F32;
    double *mag = calloc((size_t)M * N, sizeof(double));
    float *fr = malloc((size_t)M * N * 4), *fd = malloc((size_t)M * N * 4);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += fabs(st_val(Ah, ta, ta_ ? (size_t)k * lda + i : (size_t)i * lda + k, rnd) *
                          st_val(Bh, tb, tb_ ? (size_t)j * ldb + k : (size_t)k * ldb + j, rnd));
            mag[(size_t)i * N + j] = s + fabs(beta * C0[(size_t)i * ldc + j]);
            fr[(size_t)i * N + j] = (float)st_val(Cr, tc, (size_t)i * ldc + j, FL_F32);
            fd[(size_t)i * N + j] = (float)st_val(Cd, tc, (size_t)i * ldc + j, FL_F32);
        }
    st_cmp r = {0, sr == FL_OK};
    /* a bf16 C: the two fp32 results may round to neighbouring bf16 values (one ulp more) */
    if (tc == FL_BF16)
        for (size_t i = 0; i < (size_t)M * N; i++) mag[i] += fabs(fr[i]) * (2 * U16 / U32) / (K + 2) / 2; /* 2 u16 = one bf16 ulp */
    fl_st_compare(&r, fd, fr, mag, 0, (size_t)M * N, 2, K, U32, 1e-30);
    st_gemm_arg ga = {ta_, tb_, M, N, K, lda, ldb, ldc, ta, tb, tc, dA, dB, dC};
    double t = (sd == FL_OK && !b.failed) ? fl_st_time(c, st_gemm_run, &ga) : -1;
    fl_st_report(c, name, &r, sd != FL_OK || b.failed, t);
    fl_st_free(c, &b);
    free(A); free(B); free(C0); free(Ah); free(Bh); free(Cr); free(Cd); free(mag); free(fr); free(fd);
}

/* ---- generic: up to 5 float inputs, up to 3 float outputs (accumulated ones start non-zero) ---- */
typedef struct {
    const char *name;
    int n_in, n_out;
    size_t in_n[5], out_n[3];
    float in_lo[5], in_hi[5];
    int out_acc[3]; /* 1: the op accumulates into it: starts random in [-1, 1]; 2: in [0, 1] */
    double tol;
    int L;
    void (*op)(const fl_backend *be, float **in, float **out, const int *shape);
    int shape[8];
} st_gen;
typedef struct {
    const st_gen *g;
    float **in, **out;
} st_gen_arg;
static void st_gen_run(st_ctx *c, void *p) {
    st_gen_arg *a = p;
    a->g->op(c->dev, a->in, a->out, a->g->shape);
}
static void st_case_gen(st_ctx *c, const st_gen *g) {
    if (!fl_st_want(c, g->name)) return;
    float *hin[5] = {0}, *hr[3] = {0}, *hd[3] = {0}, *din[5] = {0}, *dout[3] = {0};
    st_bufs b = {0};
    for (int i = 0; i < g->n_in; i++) {
        hin[i] = fl_st_frand(c, g->in_n[i], g->in_lo[i], g->in_hi[i]);
        din[i] = fl_st_up(c, &b, hin[i], g->in_n[i] * 4);
    }
    for (int o = 0; o < g->n_out; o++) {
        hr[o] = g->out_acc[o] == 2 ? fl_st_frand(c, g->out_n[o], 0, 1) /* a second moment: >= 0 */
                : g->out_acc[o] ? fl_st_frand(c, g->out_n[o], -1, 1) : calloc(g->out_n[o] + 1, 4);
        hd[o] = fl_st_dup(hr[o], g->out_n[o]);
        dout[o] = fl_st_up(c, &b, hd[o], g->out_n[o] * 4);
    }
    g->op(c->ref, hin, hr, g->shape);
    if (!b.failed) g->op(c->dev, din, dout, g->shape);
    fl_status s = c->dev->sync(c->dev);
    st_cmp r = {0, 1};
    for (int o = 0; o < g->n_out; o++) {
        fl_st_down(c, &b, hd[o], dout[o], g->out_n[o] * 4);
        fl_st_compare(&r, hd[o], hr[o], NULL, 0, g->out_n[o], g->tol, g->L, U32, 0);
    }
    st_gen_arg ga = {g, din, dout};
    double t = (s == FL_OK && !b.failed) ? fl_st_time(c, st_gen_run, &ga) : -1;
    fl_st_report(c, g->name, &r, s != FL_OK || b.failed, t);
    fl_st_free(c, &b);
    for (int i = 0; i < 5; i++) free(hin[i]);
    for (int o = 0; o < 3; o++) { free(hr[o]); free(hd[o]); }
}

/* shapes: s[0..] as each op documents */
static void op_rms_f(const fl_backend *be, float **i, float **o, const int *s) {
    be->rmsnorm_forward(be, o[0], o[1], i[0], i[1], s[0], s[1], 1e-5f);
}
static void op_rms_b(const fl_backend *be, float **i, float **o, const int *s) {
    /* i: dout, x, w, rstd (rstd computed by the op's forward: pass the backend's own) */
    be->rmsnorm_forward(be, o[2], i[3], i[1], i[2], s[0], s[1], 1e-5f);
    be->rmsnorm_backward(be, o[0], o[1], i[0], i[1], i[2], i[3], s[0], s[1]);
}
static void op_ln_f(const fl_backend *be, float **i, float **o, const int *s) {
    be->layernorm_forward(be, o[0], o[1], o[2], i[0], i[1], i[2], s[0], s[1], 1e-5f);
}
static void op_ln_b(const fl_backend *be, float **i, float **o, const int *s) {
    /* i: dout, x, w, mean|rstd scratch (2N) */
    be->layernorm_forward(be, o[2], i[3], i[3] + s[0], i[1], i[2], i[2], s[0], s[1], 1e-5f);
    be->layernorm_backward(be, o[0], o[1], o[1] + s[1], i[0], i[1], i[2], i[3], i[3] + s[0], s[0], s[1]);
}
static void op_swiglu_f(const fl_backend *be, float **i, float **o, const int *s) {
    be->swiglu_forward(be, o[0], i[0], s[0], s[1]);
}
static void op_swiglu_b(const fl_backend *be, float **i, float **o, const int *s) {
    be->swiglu_backward(be, o[0], i[0], i[1], s[0], s[1]);
}
static void op_gelu_f(const fl_backend *be, float **i, float **o, const int *s) {
    be->gelu_forward(be, o[0], i[0], (size_t)s[0]);
}
static void op_gelu_b(const fl_backend *be, float **i, float **o, const int *s) {
    be->gelu_backward(be, o[0], i[0], i[1], (size_t)s[0]);
}
static void op_relu_f(const fl_backend *be, float **i, float **o, const int *s) {
    be->relu_forward(be, o[0], i[0], (size_t)s[0]);
}
static void op_relu_b(const fl_backend *be, float **i, float **o, const int *s) {
    be->relu_backward(be, o[0], i[0], i[1], (size_t)s[0]);
}
static void op_add(const fl_backend *be, float **i, float **o, const int *s) { be->add(be, o[0], i[0], i[1], (size_t)s[0]); }
static void op_bias_f(const fl_backend *be, float **i, float **o, const int *s) {
    be->bias_forward(be, o[0], i[0], s[0], s[1]);
}
static void op_bias_b(const fl_backend *be, float **i, float **o, const int *s) {
    be->bias_backward(be, o[0], i[0], s[0], s[1]);
}
static void op_scale(const fl_backend *be, float **i, float **o, const int *s) {
    (void)i;
    be->scale(be, o[0], (size_t)s[0], 0.37f);
}
static void op_rope(const fl_backend *be, float **i, float **o, const int *s) {
    /* o[0]: x (B*T rows of stride s[4]) rotated in place forward then backward by pos0 s[5]; i: cos, sin */
    be->rope_forward(be, o[0], s[0], s[1], s[2], s[3], (size_t)s[4], i[0], i[1], s[5]);
    be->rope_backward(be, o[1], s[0], s[1], s[2], s[3], (size_t)s[4], i[0], i[1], s[5]);
}
static void op_adamw(const fl_backend *be, float **i, float **o, const int *s) {
    be->adamw_update(be, o[0], FL_F32, i[0], FL_F32, o[1], o[2], FL_F32, (size_t)s[0], 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f,
                     3, 0.5f);
}
static void op_sgd(const fl_backend *be, float **i, float **o, const int *s) {
    be->sgd_update(be, o[0], FL_F32, i[0], FL_F32, o[1], FL_F32, (size_t)s[0], 1e-2f, 0.9f, 0.1f, 0.01f, 1, 0, 1.0f);
}
static void op_attn(const fl_backend *be, float **i, float **o, const int *s) {
    /* s: B T NH NKV HD; i[0] qkv, i[1] dout; o[0] out, o[1] lse, o[2] dqkv */
    if (fl_attention_qkv_forward(be, o[0], o[1], i[0], s[0], s[1], s[2], s[3], s[4]) != FL_OK) return;
    fl_attention_qkv_backward(be, o[2], i[1], i[0], o[0], o[1], s[0], s[1], s[2], s[3], s[4]);
}
static void op_decode(const fl_backend *be, float **i, float **o, const int *s) {
    /* s: T NH NKV HD Tmax; i[0] q, i[1] kcache, i[2] vcache */
    be->attention_decode(be, o[0], i[0], i[1], i[2], s[0], s[1], s[2], s[3], (size_t)s[4] * s[3]);
}
static void op_attn_ex(const fl_backend *be, float **i, float **o, const int *s) {
    /* s: B Tq Tk NH NKV HD causal; i: q k v dout bias; o: out|lse, dq|dk|dv, dbias */
    fl_attn_desc a = {s[0], s[1], s[2], s[3], s[4], s[5], (size_t)s[3] * s[5], (size_t)s[4] * s[5],
                      (size_t)s[4] * s[5], (size_t)s[3] * s[5], 1.0f / sqrtf((float)s[5]), s[6], 0, 0};
    size_t nq = (size_t)s[0] * s[1] * s[3] * s[5], nk = (size_t)s[0] * s[2] * s[4] * s[5];
    float *out = o[0], *lse = o[0] + nq;
    if (be->attention_forward(be, &a, out, lse, i[0], i[1], i[2], i[4], NULL) != FL_OK) return;
    be->attention_backward(be, &a, o[1], o[1] + nq, o[1] + nq + nk, o[2], i[3], i[0], i[1], i[2], i[4], NULL, out, lse);
}

static void st_cases_generic(st_ctx *c) {
    const int N = c->small ? 19 : 517, C = c->small ? 40 : 768, F = c->small ? 45 : 1377, n = c->small ? 3001 : 1000003;
    static const char *const ops[16] = {"rmsnorm_forward", "rmsnorm_backward", "layernorm_forward", "layernorm_backward",
                                        "swiglu_forward", "swiglu_backward", "gelu_forward", "gelu_backward", "add",
                                        "scale", "bias_forward", "bias_backward", "adamw_update", "sgd_update",
                                        "relu_forward", "relu_backward"};
    char nm[16][64];
    for (int k = 0; k < 16; k++) {
        if (k < 4) snprintf(nm[k], sizeof nm[k], "%s %dx%d", ops[k], N, C);
        else if (k < 6 || k == 10 || k == 11) snprintf(nm[k], sizeof nm[k], "%s %dx%d", ops[k], N, F);
        else snprintf(nm[k], sizeof nm[k], "%s %d", ops[k], n);
    }
    st_gen g[] = {
        {nm[0], 2, 2, {(size_t)N * C, C}, {(size_t)N * C, N}, {-2, 0.5f}, {2, 1.5f}, {0, 0}, 4, C,
         op_rms_f, {N, C}},
        {nm[1], 4, 3, {(size_t)N * C, (size_t)N * C, C, N}, {(size_t)N * C, C, (size_t)N * C},
         {-1, -2, 0.5f, 0}, {1, 2, 1.5f, 1}, {1, 1, 0}, 8, N, op_rms_b, {N, C}},
        {nm[2], 3, 3, {(size_t)N * C, C, C}, {(size_t)N * C, N, N}, {-2, 0.5f, -1}, {2, 1.5f, 1},
         {0, 0, 0}, 4, C, op_ln_f, {N, C}},
        {nm[3], 4, 3, {(size_t)N * C, (size_t)N * C, C, 2 * (size_t)N},
         {(size_t)N * C, 2 * (size_t)C, (size_t)N * C}, {-1, -2, 0.5f, 0}, {1, 2, 1.5f, 1}, {1, 1, 0}, 8, N, op_ln_b,
         {N, C}},
        {nm[4], 1, 1, {(size_t)N * 2 * F}, {(size_t)N * F}, {-4}, {4}, {0}, 8, 1, op_swiglu_f,
         {N, F}},
        {nm[5], 2, 1, {(size_t)N * F, (size_t)N * 2 * F}, {(size_t)N * 2 * F}, {-1, -4}, {1, 4},
         {1}, 8, 1, op_swiglu_b, {N, F}},
        {nm[6], 1, 1, {(size_t)n}, {(size_t)n}, {-5}, {5}, {0}, 8, 1, op_gelu_f, {n}},
        {nm[7], 2, 1, {(size_t)n, (size_t)n}, {(size_t)n}, {-1, -5}, {1, 5}, {1}, 8, 1, op_gelu_b,
         {n}},
        {nm[8], 2, 1, {(size_t)n, (size_t)n}, {(size_t)n}, {-1, -1}, {1, 1}, {0}, 1, 1, op_add, {n}},
        {nm[9], 0, 1, {0}, {(size_t)n}, {0}, {0}, {1}, 1, 1, op_scale, {n}},
        {nm[10], 1, 1, {(size_t)F}, {(size_t)N * F}, {-1}, {1}, {1}, 1, 1, op_bias_f, {N, F}},
        {nm[11], 1, 1, {(size_t)N * F}, {(size_t)F}, {-1}, {1}, {1}, 2, N, op_bias_b, {N, F}},
        {nm[12], 1, 3, {(size_t)n}, {(size_t)n, (size_t)n, (size_t)n}, {-1}, {1}, {1, 1, 2}, 16, 1,
         op_adamw, {n}},
        {nm[13], 1, 2, {(size_t)n}, {(size_t)n, (size_t)n}, {-1}, {1}, {1, 1}, 8, 1, op_sgd, {n}},
        {nm[14], 1, 1, {(size_t)n}, {(size_t)n}, {-5}, {5}, {0}, 1, 1, op_relu_f, {n}},
        {nm[15], 2, 1, {(size_t)n, (size_t)n}, {(size_t)n}, {-1, -5}, {1, 5}, {1}, 1, 1, op_relu_b, {n}},
    };
    for (size_t k = 0; k < sizeof g / sizeof g[0]; k++) st_case_gen(c, &g[k]);
    /* RoPE: B 3, T 129, 5 heads of HD 64 in rows of stride 5*64+7, positions from 11 */
    {
        int B = 3, T = c->small ? 9 : 129, nh = 5, HD = c->small ? 16 : 64, stride = nh * HD + 7, pos0 = 11, maxT = 256;
        float *cs = malloc((size_t)maxT * HD / 2 * 4), *sn = malloc((size_t)maxT * HD / 2 * 4);
        fl_rope_table_init(cs, sn, maxT, HD, 10000.0f, NULL);
        st_gen gr = {"rope_forward+backward", 2, 2, {(size_t)maxT * HD / 2, (size_t)maxT * HD / 2},
                     {(size_t)B * T * stride, (size_t)B * T * stride}, {0, 0}, {0, 0}, {1, 1}, 8, 2, op_rope,
                     {B, T, nh, HD, stride, pos0}};
        /* the generic case fills inputs randomly: RoPE needs the real tables, so run it by hand */
        if (fl_st_want(c, gr.name)) {
            float *x = fl_st_frand(c, gr.out_n[0], -1, 1), *xr = fl_st_dup(x, gr.out_n[0]), *xr2 = fl_st_dup(x, gr.out_n[0]);
            float *hd0 = fl_st_dup(x, gr.out_n[0]), *hd1 = fl_st_dup(x, gr.out_n[0]);
            float *in_r[2] = {cs, sn}, *out_r[2] = {xr, xr2};
            op_rope(c->ref, in_r, out_r, gr.shape);
            st_bufs b = {0};
            float *din[2] = {fl_st_up(c, &b, cs, gr.in_n[0] * 4), fl_st_up(c, &b, sn, gr.in_n[1] * 4)};
            float *dout[2] = {fl_st_up(c, &b, x, gr.out_n[0] * 4), fl_st_up(c, &b, x, gr.out_n[0] * 4)};
            if (!b.failed) op_rope(c->dev, din, dout, gr.shape);
            fl_status s = c->dev->sync(c->dev);
            fl_st_down(c, &b, hd0, dout[0], gr.out_n[0] * 4);
            fl_st_down(c, &b, hd1, dout[1], gr.out_n[0] * 4);
            st_cmp r = {0, 1};
            fl_st_compare(&r, hd0, xr, NULL, 0, gr.out_n[0], 8, 2, U32, 0);
            fl_st_compare(&r, hd1, xr2, NULL, 0, gr.out_n[0], 8, 2, U32, 0);
            st_gen_arg ga = {&gr, din, dout};
            double t = (s == FL_OK && !b.failed) ? fl_st_time(c, st_gen_run, &ga) : -1;
            fl_st_report(c, gr.name, &r, s != FL_OK || b.failed, t);
            fl_st_free(c, &b);
            free(x); free(xr); free(xr2); free(hd0); free(hd1);
        }
        free(cs); free(sn);
    }
}

/* cross_entropy_dbf16 on the device buffers of st_case_xent (d16 reuses its gradient buffer): the loss as
 * cross_entropy's bound, the gradient within it plus one bf16 rounding (2^-8 |ref|) */
static void st_xent_dbf16(st_ctx *c, int N, int V, const float *dx, const int32_t *dt, float *dl, uint16_t *d16,
                          const float *lr, const float *gr, float *ld, float *gd) {
    st_bufs b = {0};
    fl_status s = c->dev->cross_entropy_dbf16(c->dev, dl, d16, dx, dt, N, V, V, 0.25f, FL_IGNORE_INDEX);
    if (s == FL_OK) s = c->dev->sync(c->dev);
    uint16_t *h16 = malloc((size_t)N * V * 2);
    fl_st_down(c, &b, ld, dl, (size_t)N * 4);
    fl_st_down(c, &b, h16, d16, (size_t)N * V * 2);
    for (size_t i = 0; i < (size_t)N * V; i++) gd[i] = fl_bf16_to_f32(h16[i]);
    st_cmp r = {0, 1};
    fl_st_compare(&r, ld, lr, NULL, 20, N, 8, V, U32, 0);
    fl_st_compare(&r, gd, gr, NULL, -1, (size_t)N * V, (8.0 * (V + 2) + 0x1p16) / (V + 2), V, U32, 1e-12);
    char name[64];
    snprintf(name, sizeof name, "cross_entropy_dbf16 %dx%d", N, V);
    fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
    free(h16);
}

/* cross-entropy: targets are int32 (a few ignored) */
static void st_case_xent(st_ctx *c, int N, int V) {
    char name[64];
    snprintf(name, sizeof name, "cross_entropy %dx%d", N, V);
    if (!fl_st_want(c, name)) return;
    float *x = fl_st_frand(c, (size_t)N * V, -6, 6);
    int32_t *tg = malloc((size_t)N * 4);
    for (int i = 0; i < N; i++) tg[i] = i % 7 == 3 ? FL_IGNORE_INDEX : (int32_t)(fl_st_rand(c, 0, 1) * (V - 1));
    float *lr = calloc(N, 4), *gr = calloc((size_t)N * V, 4), *ld = calloc(N, 4), *gd = calloc((size_t)N * V, 4);
    c->ref->cross_entropy(c->ref, lr, gr, x, tg, N, V, 0.25f, FL_IGNORE_INDEX);
    st_bufs b = {0};
    float *dx = fl_st_up(c, &b, x, (size_t)N * V * 4), *dl = fl_st_up(c, &b, NULL, (size_t)N * 4);
    float *dg = fl_st_up(c, &b, NULL, (size_t)N * V * 4);
    int32_t *dt = fl_st_up(c, &b, tg, (size_t)N * 4);
    if (!b.failed) c->dev->cross_entropy(c->dev, dl, dg, dx, dt, N, V, 0.25f, FL_IGNORE_INDEX);
    fl_status s = c->dev->sync(c->dev);
    fl_st_down(c, &b, ld, dl, (size_t)N * 4);
    fl_st_down(c, &b, gd, dg, (size_t)N * V * 4);
    st_cmp r = {0, 1};
    /* loss: logsumexp over V terms of magnitude <= e^12 relative: L = V, mag = max |loss| + 12 */
    fl_st_compare(&r, ld, lr, NULL, 20, N, 8, V, U32, 0);
    /* dlogits = 0.25 (p_i - y_i): p_i = exp(x_i - max) / sum carries the sum's relative error */
    fl_st_compare(&r, gd, gr, NULL, -1, (size_t)N * V, 8, V, U32, 1e-12);
    fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
    if (c->dev->cross_entropy_dbf16 && !b.failed) /* the LM head's bf16-gradient variant (issue 30 item 4) */
        st_xent_dbf16(c, N, V, dx, dt, dl, (uint16_t *)dg, lr, gr, ld, gd);
    fl_st_free(c, &b);
    free(x); free(tg); free(lr); free(gr); free(ld); free(gd);
}

/* embedding forward and backward: ids int32 */
static void st_case_embedding(st_ctx *c, int B, int T, int C, int V) {
    char name[80];
    snprintf(name, sizeof name, "embedding_forward+backward %dx%dx%d V=%d", B, T, C, V);
    if (!fl_st_want(c, name)) return;
    size_t n = (size_t)B * T;
    int32_t *ids = malloc(n * 4);
    for (size_t i = 0; i < n; i++) ids[i] = (int32_t)(i % 5 == 0 ? 17 : fl_st_rand(c, 0, 1) * (V - 1)); /* repeats */
    float *wte = fl_st_frand(c, (size_t)V * C, -1, 1), *wpe = fl_st_frand(c, (size_t)T * C, -1, 1);
    float *dout = fl_st_frand(c, n * C, -1, 1);
    float *or_ = calloc(n * C, 4), *od = calloc(n * C, 4);
    float *gr = fl_st_frand(c, (size_t)V * C, -1, 1), *gd = fl_st_dup(gr, (size_t)V * C);
    float *pr = fl_st_frand(c, (size_t)T * C, -1, 1), *pd = fl_st_dup(pr, (size_t)T * C);
    c->ref->embedding_forward(c->ref, or_, ids, wte, wpe, B, T, C);
    c->ref->embedding_backward(c->ref, gr, pr, dout, ids, B, T, C);
    st_bufs b = {0};
    int32_t *di = fl_st_up(c, &b, ids, n * 4);
    float *dw = fl_st_up(c, &b, wte, (size_t)V * C * 4), *dp = fl_st_up(c, &b, wpe, (size_t)T * C * 4);
    float *ddo = fl_st_up(c, &b, dout, n * C * 4), *dov = fl_st_up(c, &b, NULL, n * C * 4);
    float *dg = fl_st_up(c, &b, gd, (size_t)V * C * 4), *dpg = fl_st_up(c, &b, pd, (size_t)T * C * 4);
    double t0 = fl_st_now();
    if (!b.failed) {
        c->dev->embedding_forward(c->dev, dov, di, dw, dp, B, T, C);
        c->dev->embedding_backward(c->dev, dg, dpg, ddo, di, B, T, C);
    }
    fl_status s = c->dev->sync(c->dev);
    double t = fl_st_now() - t0;
    fl_st_down(c, &b, od, dov, n * C * 4);
    fl_st_down(c, &b, gd, dg, (size_t)V * C * 4);
    fl_st_down(c, &b, pd, dpg, (size_t)T * C * 4);
    st_cmp r = {0, 1};
    fl_st_compare(&r, od, or_, NULL, 2, n * C, 2, 1, U32, 0);
    fl_st_compare(&r, gd, gr, NULL, 0, (size_t)V * C, 2, (int)n, U32, 0);
    fl_st_compare(&r, pd, pr, NULL, 0, (size_t)T * C, 2, B, U32, 0);
    fl_st_report(c, name, &r, s != FL_OK || b.failed, t);
    fl_st_free(c, &b);
    free(ids); free(wte); free(wpe); free(dout); free(or_); free(od); free(gr); free(gd); free(pr); free(pd);
}

/* T5's relative position bias: relbias_forward (copies: exact) and relbias_backward (the contract's order, the
 * CPU's bits; checked within the fp32 summation bound of each bucket's terms), timed at the shape given */
static void st_case_relbias(st_ctx *c, int NH, int T, int nb) {
    char name[80];
    snprintf(name, sizeof name, "relbias_forward+backward NH%d T%d buckets %d", NH, T, nb);
    if (!fl_st_want(c, name)) return;
    const int nd = 2 * T - 1;
    const size_t nbias = (size_t)NH * T * T, ntab = (size_t)NH * nb;
    int32_t *rb = malloc((size_t)nd * 4);
    for (int k = 0; k < nd; k++) { /* a T5-like map: one bucket each near the diagonal, then wider bins */
        const int rel = k - (T - 1), n = rel < 0 ? -rel : rel, half = nb / 2, near = half / 2;
        const int bin = n < near ? n : near + (int)(log2((double)n / near) * 2);
        rb[k] = (rel > 0 ? half : 0) + (bin < half - 1 ? bin : half - 1);
    }
    float *tab = fl_st_frand(c, ntab, -1, 1), *dbias = fl_st_frand(c, nbias, -1, 1);
    float *br = calloc(nbias, 4), *bd = calloc(nbias, 4), *gr = fl_st_frand(c, ntab, -1, 1);
    float *gd = fl_st_dup(gr, ntab);
    double *mag = calloc(ntab, sizeof *mag);
    int terms = 0;
    for (size_t e = 0; e < ntab; e++) mag[e] = fabs(gr[e]);
    for (int h = 0; h < NH; h++)
        for (int i = 0; i < T; i++)
            for (int j = 0; j < T; j++) mag[(size_t)h * nb + rb[j - i + T - 1]] += fabs(dbias[((size_t)h * T + i) * T + j]);
    for (int k = 0; k < nd; k++) terms += T - (k < T ? T - 1 - k : k - (T - 1)); /* every element: a loose L */
    c->ref->relbias_forward(c->ref, br, tab, rb, NH, T, T, nb);
    fl_status s = c->ref->relbias_backward(c->ref, gr, dbias, rb, NH, T, T, nb);
    st_bufs b = {0};
    int32_t *drb = fl_st_up(c, &b, rb, (size_t)nd * 4);
    float *dtab = fl_st_up(c, &b, tab, ntab * 4), *dbi = fl_st_up(c, &b, NULL, nbias * 4);
    float *ddb = fl_st_up(c, &b, dbias, nbias * 4), *dg = fl_st_up(c, &b, gd, ntab * 4);
    double t0 = fl_st_now();
    if (!b.failed && s == FL_OK) {
        c->dev->relbias_forward(c->dev, dbi, dtab, drb, NH, T, T, nb);
        s = c->dev->relbias_backward(c->dev, dg, ddb, drb, NH, T, T, nb);
    }
    fl_status s2 = c->dev->sync(c->dev);
    double t = fl_st_now() - t0;
    fl_st_down(c, &b, bd, dbi, nbias * 4);
    fl_st_down(c, &b, gd, dg, ntab * 4);
    st_cmp r = {0, 1};
    fl_st_compare(&r, bd, br, NULL, 0, nbias, 0, 1, U32, 0); /* copies: exact */
    fl_st_compare(&r, gd, gr, mag, 0, ntab, 1, terms / NH, U32, 0);
    fl_st_report(c, name, &r, s != FL_OK || s2 != FL_OK || b.failed, t);
    fl_st_free(c, &b);
    free(rb); free(tab); free(dbias); free(br); free(bd); free(gr); free(gd); free(mag);
}

/* attention (fused causal QKV): forward out/lse and backward dqkv */
static void st_case_attention(st_ctx *c, int B, int T, int NH, int NKV, int HD) {
    char name[80];
    snprintf(name, sizeof name, "attention fwd+bwd B%d T%d NH%d NKV%d HD%d", B, T, NH, NKV, HD);
    size_t W = (size_t)(NH + 2 * NKV) * HD, nqkv = (size_t)B * T * W, no = (size_t)B * T * NH * HD;
    st_gen g = {"", 2, 3, {nqkv, no}, {no, (size_t)B * NH * T, nqkv}, {-1.5f, -1}, {1.5f, 1}, {0, 0, 1}, 8, T,
                op_attn, {B, T, NH, NKV, HD}};
    g.name = name;
    st_case_gen(c, &g);
}
static void st_case_decode(st_ctx *c, int T, int NH, int NKV, int HD, int Tmax) {
    char name[80];
    snprintf(name, sizeof name, "attention_decode T%d NH%d NKV%d HD%d", T, NH, NKV, HD);
    st_gen g = {"", 3, 1, {(size_t)NH * HD, (size_t)NKV * Tmax * HD, (size_t)NKV * Tmax * HD}, {(size_t)NH * HD},
                {-1.5f, -1.5f, -1}, {1.5f, 1.5f, 1}, {0}, 8, T, op_decode, {T, NH, NKV, HD, Tmax}};
    g.name = name;
    st_case_gen(c, &g);
}
static void st_case_attention_ex(st_ctx *c, int B, int Tq, int Tk, int NH, int NKV, int HD, int causal) {
    char name[96];
    snprintf(name, sizeof name, "attention_ex fwd+bwd B%d Tq%d Tk%d NH%d NKV%d HD%d%s", B, Tq, Tk, NH, NKV, HD,
             causal ? " causal+bias" : " bias");
    size_t nq = (size_t)B * Tq * NH * HD, nk = (size_t)B * Tk * NKV * HD, nb = (size_t)NH * Tq * Tk;
    st_gen g = {"", 5, 3, {nq, nk, nk, nq, nb}, {nq + (size_t)B * NH * Tq, nq + 2 * nk, nb},
                {-1.5f, -1.5f, -1, -1, -0.5f}, {1.5f, 1.5f, 1, 1, 0.5f}, {0, 1, 1}, 8, Tk, op_attn_ex,
                {B, Tq, Tk, NH, NKV, HD, causal}};
    g.name = name;
    st_case_gen(c, &g);
}

/* 16-bit conversions (bit-exact), sumsq, check_finite, accumulate16, adamw_update in bf16 */
static void st_case_lowp(st_ctx *c) {
    const size_t n = c->small ? 3001 : 1000003;
    float *x = fl_st_frand(c, n, -70000, 70000); /* beyond f16's range: inf on overflow, the same on both */
    const char *name = "convert f32->bf16->f16->f32 (bits)";
    if (fl_st_want(c, name)) {
        uint16_t *r16 = malloc(n * 2), *h16 = malloc(n * 2), *rb = malloc(n * 2), *db = malloc(n * 2);
        float *rf = malloc(n * 4), *df = malloc(n * 4);
        c->ref->convert(c->ref, rb, FL_BF16, x, FL_F32, n);
        c->ref->convert(c->ref, r16, FL_F16, rb, FL_BF16, n);
        c->ref->convert(c->ref, rf, FL_F32, r16, FL_F16, n);
        st_bufs b = {0};
        void *dx = fl_st_up(c, &b, x, n * 4), *d1 = fl_st_up(c, &b, NULL, n * 2), *d2 = fl_st_up(c, &b, NULL, n * 2);
        void *d3 = fl_st_up(c, &b, NULL, n * 4);
        fl_status s = b.failed ? FL_ERR_IO : c->dev->convert(c->dev, d1, FL_BF16, dx, FL_F32, n);
        if (s == FL_OK) s = c->dev->convert(c->dev, d2, FL_F16, d1, FL_BF16, n);
        if (s == FL_OK) s = c->dev->convert(c->dev, d3, FL_F32, d2, FL_F16, n);
        fl_st_down(c, &b, db, d1, n * 2);
        fl_st_down(c, &b, h16, d2, n * 2);
        fl_st_down(c, &b, df, d3, n * 4);
        st_cmp r = {0, memcmp(rb, db, n * 2) == 0 && memcmp(r16, h16, n * 2) == 0 && memcmp(rf, df, n * 4) == 0};
        fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
        fl_st_free(c, &b);
        free(r16); free(h16); free(rb); free(db); free(rf); free(df);
    }
    name = "sumsq f32 / bf16";
    if (fl_st_want(c, name)) {
        uint16_t *xb = malloc(n * 2);
        for (size_t i = 0; i < n; i++) xb[i] = fl_f32_to_bf16(x[i] * 1e-3f);
        double r1 = c->ref->sumsq(c->ref, x, FL_F32, n), r2 = c->ref->sumsq(c->ref, xb, FL_BF16, n);
        st_bufs b = {0};
        void *dx = fl_st_up(c, &b, x, n * 4), *dxb = fl_st_up(c, &b, xb, n * 2);
        double d1 = b.failed ? NAN : c->dev->sumsq(c->dev, dx, FL_F32, n);
        double d2 = b.failed ? NAN : c->dev->sumsq(c->dev, dxb, FL_BF16, n);
        fl_status s = c->dev->sync(c->dev);
        /* double sums of n non-negative terms in any order: within 2 n 2^-53 of each other */
        double bnd = 2.0 * (double)n * 0x1p-53;
        st_cmp r = {fmax(fabs(d1 - r1) / (bnd * r1), fabs(d2 - r2) / (bnd * r2)),
                    fabs(d1 - r1) <= bnd * r1 && fabs(d2 - r2) <= bnd * r2};
        fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
        fl_st_free(c, &b);
        free(xb);
    }
    name = "check_finite f32 (finite, then one inf)";
    if (fl_st_want(c, name)) {
        float *y = fl_st_frand(c, n, -1, 1);
        st_bufs b = {0};
        float *dy = fl_st_up(c, &b, y, n * 4);
        int f1 = 0, f2 = 0;
        fl_status s = b.failed ? FL_ERR_IO : c->dev->check_finite(c->dev, dy, FL_F32, n, 0.5f, &f1);
        y[n / 2 + 7] = INFINITY;
        if (s == FL_OK) s = c->dev->to_device(c->dev, dy, y, n * 4);
        if (s == FL_OK) s = c->dev->check_finite(c->dev, dy, FL_F32, n, 0.5f, &f2);
        st_cmp r = {0, f1 == 0 && f2 == 1};
        fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
        fl_st_free(c, &b);
        free(y);
    }
    name = "accumulate16 bf16 += f32";
    if (fl_st_want(c, name)) {
        uint16_t *acc = malloc(n * 2), *accd = malloc(n * 2);
        for (size_t i = 0; i < n; i++) acc[i] = fl_f32_to_bf16(x[i] * 1e-4f);
        memcpy(accd, acc, n * 2);
        float *y = fl_st_frand(c, n, -3, 3);
        fl_status s0 = c->ref->accumulate16(c->ref, acc, FL_BF16, y, n);
        st_bufs b = {0};
        void *da = fl_st_up(c, &b, accd, n * 2), *dy = fl_st_up(c, &b, y, n * 4);
        fl_status s = b.failed ? FL_ERR_IO : c->dev->accumulate16(c->dev, da, FL_BF16, dy, n);
        fl_st_down(c, &b, accd, da, n * 2);
        /* one fp32 add then one RNE rounding: the same bits */
        st_cmp r = {0, s0 == FL_OK && memcmp(acc, accd, n * 2) == 0};
        fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
        fl_st_free(c, &b);
        free(acc); free(accd); free(y);
    }
    name = "adamw_update bf16 params, bf16 grads, bf16 state";
    if (fl_st_want(c, name)) {
        uint16_t *p = malloc(n * 2), *g = malloc(n * 2), *m = malloc(n * 2), *v = malloc(n * 2);
        for (size_t i = 0; i < n; i++) {
            p[i] = fl_f32_to_bf16(fl_st_rand(c, -1, 1));
            g[i] = fl_f32_to_bf16(fl_st_rand(c, -1, 1));
            m[i] = fl_f32_to_bf16(fl_st_rand(c, -0.1f, 0.1f));
            v[i] = fl_f32_to_bf16(fl_st_rand(c, 0, 0.01f));
        }
        st_bufs b = {0};
        void *dp = fl_st_up(c, &b, p, n * 2), *dg = fl_st_up(c, &b, g, n * 2), *dm = fl_st_up(c, &b, m, n * 2);
        void *dv = fl_st_up(c, &b, v, n * 2);
        fl_status s0 = c->ref->adamw_update(c->ref, p, FL_BF16, g, FL_BF16, m, v, FL_BF16, n, 1e-3f, 0.9f, 0.999f,
                                               1e-8f, 0.01f, 5, 1.0f);
        fl_status s = b.failed ? FL_ERR_IO
                               : c->dev->adamw_update(c->dev, dp, FL_BF16, dg, FL_BF16, dm, dv, FL_BF16, n, 1e-3f,
                                                         0.9f, 0.999f, 1e-8f, 0.01f, 5, 1.0f);
        uint16_t *pd = malloc(n * 2);
        fl_st_down(c, &b, pd, dp, n * 2);
        /* fp32 evaluation on both (an FMA or sqrt ulp apart) then one bf16 rounding: equal, or one
         * bf16 ulp apart where the fp32 values straddle a rounding boundary */
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
            int d = (int)p[i] - (int)pd[i];
            if (d > 1 || d < -1) bad++;
        }
        st_cmp r = {(double)bad, s0 == FL_OK && bad == 0};
        fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
        fl_st_free(c, &b);
        free(p); free(g); free(m); free(v); free(pd);
    }
    free(x);
}

/* 8-bit AdamW: parameters after 3 steps (the states are quantized the same way by both) */
static void st_case_adam8bit(st_ctx *c, size_t n) {
    char name[64];
    snprintf(name, sizeof name, "adam8bit_update n=%zu (3 steps)", n);
    if (!fl_st_want(c, name)) return;
    size_t sb = fl_adam8bit_state_bytes(n);
    float *p = fl_st_frand(c, n, -1, 1), *pd = fl_st_dup(p, n), *g = fl_st_frand(c, n, -1, 1);
    void *sr = calloc(1, sb + 64);
    fl_adam8bit_state str, std_;
    fl_status s0 = fl_adam8bit_state_bind(&str, n, sr);
    st_bufs b = {0};
    void *ds = fl_st_up(c, &b, NULL, sb);
    float *dp = fl_st_up(c, &b, p, n * 4), *dg = fl_st_up(c, &b, g, n * 4);
    fl_status s = b.failed ? FL_ERR_IO : fl_adam8bit_state_bind(&std_, n, ds);
    for (int step = 1; step <= 3 && s0 == FL_OK; step++) {
        s0 = c->ref->adam8bit_update(c->ref, p, FL_F32, g, FL_F32, &str, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 1.0f);
        if (s == FL_OK)
            s = c->dev->adam8bit_update(c->dev, dp, FL_F32, dg, FL_F32, &std_, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step,
                                        1.0f);
    }
    fl_st_down(c, &b, pd, dp, n * 4);
    /* Same fp32 formula on both sides, so the 8-bit codes agree except where a value sits on a
     * quantization midpoint and an FMA or sqrt ulp tips it to the neighbouring code. So: every
     * parameter within fp32 noise (8 ulp of |p| <= 1.1), except at most 0.1% of them, and those
     * within the trivial bound (each side moves at most lr * (1-b1)/sqrt(1-b2) * 1.05 per step). */
    size_t far = 0;
    double worst = 0, trivial = 2 * 3 * 1e-3 * (0.1 / sqrt(0.001)) * 1.05;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)pd[i] - p[i]);
        if (d > 8 * 1.1 * U32) far++;
        if (d / trivial > worst) worst = d / trivial;
    }
    st_cmp r = {worst, s0 == FL_OK && far <= n / 1000 && worst <= 1};
    fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
    fl_st_free(c, &b);
    free(p); free(pd); free(g); free(sr);
}

/* NF4 4-bit matmul forward and backward */
static void st_case_q4(st_ctx *c, int N, int rows, int cols, int dq) {
    char name[80];
    snprintf(name, sizeof name, "q4_matmul nf4%s fwd+bwd N%d %dx%d", dq ? "+dq" : "", N, rows, cols);
    if (!fl_st_want(c, name)) return;
    size_t nw = (size_t)rows * cols, qb = fl_q4_bytes(nw, dq);
    float *W = fl_st_frand(c, nw, -0.1f, 0.1f), *x = fl_st_frand(c, (size_t)N * cols, -1, 1);
    float *dy = fl_st_frand(c, (size_t)N * rows, -1, 1);
    void *hq = calloc(1, qb + 64);
    fl_q4_weight wq, wd;
    fl_status s0 = fl_q4_bind(&wq, rows, cols, FL_Q4_NF4, dq, hq);
    if (s0 == FL_OK) s0 = fl_q4_quantize(&wq, W, 1);
    float *yr = calloc((size_t)N * rows, 4), *yd = calloc((size_t)N * rows, 4);
    float *xr = calloc((size_t)N * cols, 4), *xd = calloc((size_t)N * cols, 4);
    if (s0 == FL_OK) s0 = c->ref->q4_matmul_forward(c->ref, yr, rows, x, &wq, N, 0.0f);
    if (s0 == FL_OK) s0 = c->ref->q4_matmul_backward(c->ref, xr, dy, rows, &wq, N, 0.0f);
    st_bufs b = {0};
    void *dq_ = fl_st_up(c, &b, hq, qb);
    float *dx = fl_st_up(c, &b, x, (size_t)N * cols * 4), *ddy = fl_st_up(c, &b, dy, (size_t)N * rows * 4);
    float *dyo = fl_st_up(c, &b, NULL, (size_t)N * rows * 4), *dxo = fl_st_up(c, &b, NULL, (size_t)N * cols * 4);
    fl_status s = b.failed ? FL_ERR_IO : fl_q4_bind(&wd, rows, cols, FL_Q4_NF4, dq, dq_);
    if (s == FL_OK) s = c->dev->q4_matmul_forward(c->dev, dyo, rows, dx, &wd, N, 0.0f);
    if (s == FL_OK) s = c->dev->q4_matmul_backward(c->dev, dxo, ddy, rows, &wd, N, 0.0f);
    fl_st_down(c, &b, yd, dyo, (size_t)N * rows * 4);
    fl_st_down(c, &b, xd, dxo, (size_t)N * cols * 4);
    st_cmp r = {0, s0 == FL_OK};
    /* mag: |x| <= 1, |deq(W)| <= 0.1 * (1 + 2^-7): sum of K terms <= 0.11 K; L = K */
    fl_st_compare(&r, yd, yr, NULL, 0.11 * cols, (size_t)N * rows, 2, cols, U32, 0);
    fl_st_compare(&r, xd, xr, NULL, 0.11 * rows, (size_t)N * cols, 2, rows, U32, 0);
    fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
    fl_st_free(c, &b);
    free(W); free(x); free(dy); free(hq); free(yr); free(yd); free(xr); free(xd);
}

/* LoRA forward + backward with dropout */
static void st_case_lora(st_ctx *c, int N, int in, int out, int r_, float p) {
    char name[80];
    snprintf(name, sizeof name, "lora fwd+bwd N%d %d->%d r%d dropout %.2f", N, in, out, r_, (double)p);
    if (!fl_st_want(c, name)) return;
    float *x = fl_st_frand(c, (size_t)N * in, -1, 1), *A = fl_st_frand(c, (size_t)r_ * in, -0.1f, 0.1f);
    float *B = fl_st_frand(c, (size_t)out * r_, -0.1f, 0.1f), *dy = fl_st_frand(c, (size_t)N * out, -1, 1);
    float *y0 = fl_st_frand(c, (size_t)N * out, -1, 1);
    size_t nw = (size_t)N * r_ + (size_t)N * in;
    float *yr = fl_st_dup(y0, (size_t)N * out), *hr = calloc((size_t)N * r_, 4), *xdr = calloc((size_t)N * in, 4);
    float *dxr = calloc((size_t)N * in, 4), *dAr = calloc((size_t)r_ * in, 4), *dBr = calloc((size_t)out * r_, 4);
    float *wr = calloc(nw, 4);
    fl_status s0 = c->ref->lora_forward(c->ref, yr, out, hr, xdr, x, A, B, N, in, out, r_, 2.0f, p, 99);
    if (s0 == FL_OK)
        s0 = c->ref->lora_backward(c->ref, dxr, dAr, dBr, dy, out, p > 0 ? xdr : x, hr, A, B, N, in, out, r_, 2.0f, p, 99,
                                   wr);
    st_bufs b = {0};
    float *dx_ = fl_st_up(c, &b, x, (size_t)N * in * 4), *dA_ = fl_st_up(c, &b, A, (size_t)r_ * in * 4);
    float *dB_ = fl_st_up(c, &b, B, (size_t)out * r_ * 4), *ddy = fl_st_up(c, &b, dy, (size_t)N * out * 4);
    float *dyv = fl_st_up(c, &b, y0, (size_t)N * out * 4), *dh = fl_st_up(c, &b, NULL, (size_t)N * r_ * 4);
    float *dxd = fl_st_up(c, &b, NULL, (size_t)N * in * 4), *ddx = fl_st_up(c, &b, NULL, (size_t)N * in * 4);
    float *ddA = fl_st_up(c, &b, NULL, (size_t)r_ * in * 4), *ddB = fl_st_up(c, &b, NULL, (size_t)out * r_ * 4);
    float *dw = fl_st_up(c, &b, NULL, nw * 4);
    fl_status s = b.failed ? FL_ERR_IO
                           : c->dev->lora_forward(c->dev, dyv, out, dh, dxd, dx_, dA_, dB_, N, in, out, r_, 2.0f, p, 99);
    if (s == FL_OK)
        s = c->dev->lora_backward(c->dev, ddx, ddA, ddB, ddy, out, p > 0 ? dxd : dx_, dh, dA_, dB_, N, in, out, r_, 2.0f,
                                  p, 99, dw);
    float *yd = malloc((size_t)N * out * 4), *dxh = malloc((size_t)N * in * 4), *dAh = malloc((size_t)r_ * in * 4);
    float *dBh = malloc((size_t)out * r_ * 4);
    fl_st_down(c, &b, yd, dyv, (size_t)N * out * 4);
    fl_st_down(c, &b, dxh, ddx, (size_t)N * in * 4);
    fl_st_down(c, &b, dAh, ddA, (size_t)r_ * in * 4);
    fl_st_down(c, &b, dBh, ddB, (size_t)out * r_ * 4);
    st_cmp r = {0, s0 == FL_OK};
    double sc = 1.0 / (1.0 - p);
    /* chains of two products: magnitudes bounded by the factors' bounds (|x|, |dy| <= 1, |A|, |B| <= 0.1) */
    fl_st_compare(&r, yd, yr, NULL, 1 + 2 * 0.01 * in * r_ * sc, (size_t)N * out, 4, in + r_, U32, 0);
    fl_st_compare(&r, dBh, dBr, NULL, 2 * 0.1 * in * sc * N, (size_t)out * r_, 4, N + in, U32, 0);
    fl_st_compare(&r, dAh, dAr, NULL, 2 * 0.1 * out * sc * N, (size_t)r_ * in, 4, N + out, U32, 0);
    fl_st_compare(&r, dxh, dxr, NULL, 2 * 0.01 * out * r_ * sc, (size_t)N * in, 4, out + r_, U32, 0);
    fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
    fl_st_free(c, &b);
    free(x); free(A); free(B); free(dy); free(y0); free(yr); free(hr); free(xdr); free(dxr); free(dAr); free(dBr);
    free(wr); free(yd); free(dxh); free(dAh); free(dBh);
}

/* tensor parallelism's ops (issue 35): the vocabulary-parallel cross-entropy over P slices of a V-wide row (each
 * rank's vocab_stats, the statistics assembled in rank order as the group's all-gather would, vocab_xent; the bounds
 * of cross_entropy's case: the same sums), and dropout_rows against the reference's (the same mask) */
static void st_case_vocab_xent(st_ctx *c, int N, int V, int P) {
    char name[64];
    snprintf(name, sizeof name, "vocab_xent %dx%d over %d slices", N, V, P);
    if (!fl_st_want(c, name)) return;
    float *x = fl_st_frand(c, (size_t)N * V, -6, 6), *h = malloc((size_t)N * V * 4);
    int32_t *tg = malloc((size_t)N * 4);
    double *ar = malloc((size_t)P * N * 3 * 8), *ad = malloc((size_t)P * N * 3 * 8);
    float *lr = calloc(N, 4), *ld = calloc(N, 4), *gr = calloc((size_t)N * V, 4), *gd = calloc((size_t)N * V, 4);
    for (int i = 0; i < N; i++) tg[i] = i % 7 == 3 ? FL_IGNORE_INDEX : (int32_t)(fl_st_rand(c, 0, 1) * (V - 1));
    st_bufs b = {0};
    int32_t *dt = fl_st_up(c, &b, tg, (size_t)N * 4);
    double *dst = fl_st_up(c, &b, NULL, (size_t)N * 3 * 8), *dall = fl_st_up(c, &b, NULL, (size_t)P * N * 3 * 8);
    float *dl = fl_st_up(c, &b, NULL, (size_t)N * 4);
    fl_status s = b.failed ? FL_ERR_IO : FL_OK, s0 = FL_OK;
    for (int pass = 0; pass < 2; pass++) /* the statistics, then the losses and gradients */
        for (int k = 0, at = 0; k < P; k++) {
            const int lo = (int)((long long)k * V / P), n = (int)((long long)(k + 1) * V / P) - lo;
            for (int i = 0; i < N; i++) memcpy(h + (size_t)at + (size_t)i * n, x + (size_t)i * V + lo, (size_t)n * 4);
            float *hk = h + at, *dx = fl_st_up(c, &b, hk, (size_t)N * n * 4);
            if (pass == 0) {
                if (s0 == FL_OK) s0 = c->ref->vocab_stats(c->ref, ar + (size_t)k * N * 3, hk, tg, N, n, lo);
                if (s == FL_OK && !b.failed) s = c->dev->vocab_stats(c->dev, dst, dx, dt, N, n, lo);
                fl_st_down(c, &b, ad + (size_t)k * N * 3, dst, (size_t)N * 3 * 8);
            } else {
                if (s0 == FL_OK)
                    s0 = c->ref->vocab_xent(c->ref, lr, gr + at, hk, ar, tg, N, n, lo, P, k, V, 0.25f, FL_IGNORE_INDEX);
                if (s == FL_OK && !b.failed)
                    s = c->dev->vocab_xent(c->dev, dl, dx, dx, dall, dt, N, n, lo, P, k, V, 0.25f, FL_IGNORE_INDEX);
                fl_st_down(c, &b, gd + at, dx, (size_t)N * n * 4);
                fl_st_down(c, &b, ld, dl, (size_t)N * 4);
            }
            at += N * n;
            if (pass == 0 && k == P - 1 && !b.failed && c->dev->to_device(c->dev, dall, ad, (size_t)P * N * 3 * 8) != FL_OK)
                b.failed = 1;
        }
    st_cmp r = {0, s0 == FL_OK};
    fl_st_compare(&r, ld, lr, NULL, 20, N, 8, V, U32, 0); /* cross_entropy's bounds */
    fl_st_compare(&r, gd, gr, NULL, -1, (size_t)N * V, 8, V, U32, 1e-12);
    fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
    fl_st_free(c, &b);
    free(x); free(h); free(tg); free(ar); free(ad); free(lr); free(ld); free(gr); free(gd);
}

static void st_case_dropout_rows(st_ctx *c, int rows, int w, int stride, float p) {
    char name[64];
    snprintf(name, sizeof name, "dropout_rows %dx%d stride %d p %.2f", rows, w, stride, (double)p);
    if (!fl_st_want(c, name)) return;
    const size_t n = (size_t)rows * w;
    float *x = fl_st_frand(c, n, -1, 1), *y0 = fl_st_frand(c, n, -1, 1), *yr = fl_st_dup(y0, n), *yd = malloc(n * 4);
    st_bufs b = {0};
    float *dx = fl_st_up(c, &b, x, n * 4), *dy = fl_st_up(c, &b, y0, n * 4);
    fl_status s0 = c->ref->dropout_rows(c->ref, yr, x, rows, (size_t)w, (size_t)stride, p, 77, 1);
    fl_status s = b.failed ? FL_ERR_IO : c->dev->dropout_rows(c->dev, dy, dx, rows, (size_t)w, (size_t)stride, p, 77, 1);
    fl_st_down(c, &b, yd, dy, n * 4);
    st_cmp r = {0, s0 == FL_OK};
    fl_st_compare(&r, yd, yr, NULL, 1 + 1 / (1 - p), n, 2, 1, U32, 0); /* y + x / (1 - p): one or two roundings */
    fl_st_report(c, name, &r, s != FL_OK || b.failed, -1);
    fl_st_free(c, &b);
    free(x); free(y0); free(yr); free(yd);
}

void fl_st_run_all(st_ctx *c) {
    /* small: the shapes of `make test`, where the backend may run under the CUDA emulator (a fiber
     * per GPU thread); still odd, still across tile and block edges */
    const int sm = c->small;
    /* GEMMs: every type combination of the contract, transposes, odd shapes; C accumulated */
    const int M = sm ? 37 : 517, N = sm ? 67 : 767, K = sm ? 45 : 384;
    st_case_gemm(c, 0, 1, M, N, K, FL_F32, FL_F32, FL_F32, 0);
    st_case_gemm(c, 0, 0, M, K, N, FL_F32, FL_F32, FL_F32, 1);
    st_case_gemm(c, 1, 0, N, K, M, FL_F32, FL_F32, FL_F32, 1);
    st_case_gemm(c, 0, 1, M, N, K, FL_F32, FL_BF16, FL_F32, 0);
    st_case_gemm(c, 1, 0, N, K, M, FL_F32, FL_BF16, FL_F32, 1);
    st_case_gemm(c, 1, 0, N, K, M, FL_BF16, FL_BF16, FL_F32, 1);
    st_case_gemm(c, 0, 1, M, N, K, FL_BF16, FL_BF16, FL_BF16, 1);
    st_case_gemm(c, 0, 1, M, N, K, FL_F32, FL_F16, FL_F32, 0);
    st_case_gemm(c, 0, 0, M, K, N, FL_F32, FL_F16, FL_F32, 1);
    st_case_gemm(c, 0, 1, M, N, K, FL_F16, FL_F16, FL_F32, 0);
    if (!sm) st_case_gemm(c, 0, 1, 1024, 1024, 1024, FL_BF16, FL_BF16, FL_F32, 0);
    st_cases_generic(c);
    st_case_xent(c, sm ? 5 : 67, sm ? 1001 : 32000);
    st_case_embedding(c, sm ? 2 : 4, sm ? 17 : 257, sm ? 40 : 768, sm ? 301 : 32000);
    st_case_relbias(c, sm ? 3 : 12, sm ? 45 : 512, 32); /* full: Flan-T5-base's encoder at source 512 */
    st_case_attention(c, 2, sm ? 37 : 257, sm ? 4 : 8, 2, sm ? 16 : 64);
    if (!sm) st_case_attention(c, 1, 1024, 16, 16, 128);
    st_case_attention(c, sm ? 1 : 2, sm ? 9 : 33, 6, 3, sm ? 24 : 48);
    st_case_decode(c, sm ? 23 : 300, sm ? 4 : 16, sm ? 2 : 4, sm ? 16 : 64, sm ? 40 : 512);
    st_case_attention_ex(c, sm ? 1 : 2, sm ? 7 : 77, sm ? 19 : 129, sm ? 4 : 8, sm ? 2 : 4, sm ? 16 : 64, 0);
    st_case_attention_ex(c, sm ? 1 : 2, sm ? 19 : 129, sm ? 19 : 129, 4, 4, sm ? 8 : 32, 1);
    st_case_lowp(c);
    st_case_adam8bit(c, sm ? 5003 : 1000003);
    st_case_adam8bit(c, sm ? 301 : 3001);
    st_case_q4(c, sm ? 5 : 67, sm ? 96 : 1536, sm ? 64 : 512, 0);
    st_case_q4(c, sm ? 5 : 67, sm ? 64 : 512, sm ? 320 : 1536, 1);
    st_case_lora(c, sm ? 17 : 257, sm ? 40 : 768, sm ? 56 : 1024, sm ? 4 : 8, 0.0f);
    st_case_lora(c, sm ? 17 : 257, sm ? 40 : 768, sm ? 56 : 1024, sm ? 4 : 8, 0.1f);
    st_case_vocab_xent(c, sm ? 5 : 67, sm ? 1001 : 32000, sm ? 3 : 8);
    st_case_dropout_rows(c, sm ? 13 : 257, sm ? 37 : 1376, sm ? 111 : 5504, 0.1f);
}
