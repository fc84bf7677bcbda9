/* fitllm selftest: the attention kernels a bf16 run may get (FITLLM_CUDA_ATTN=cudnn / own / legacy)
 * side by side against float64 (include/fitllm/selftest.h: fl_selftest_attention_choices).
 *
 * The anchor is independent of every kernel: a float64 softmax attention written here from the
 * fl_attn_desc contract (causal, grouped heads), on the inputs rounded to bf16 as the kernels read
 * them. The kernels round P, dO and dS to bf16 too (FlashAttention's and cuDNN's scheme) and
 * accumulate in fp32, so each output element must be within 8 u * max|ref| of the tensor (u = 2^-8,
 * bf16's unit roundoff; a wrong mask, scale or lost tile is off by O(max|ref|)). The log-sum-exp is
 * fp32 arithmetic on exact bf16 products: within 8 u (1 + |lse|). Timings: median of 5 forward +
 * backward calls, with TFLOP/s counted as FlashAttention does (causal: half of 4 B NH T^2 HD forward,
 * 2.5 times that backward). A T5-shaped case (t5: non-causal, scale 1, a relative-position-like bias (NH, T, T) with
 * its gradient, dropout 0.1 on the weights with the ops' mask, fitllm/lora.h's) checks the own kernels' EX path
 * (cuDNN and legacy take neither: the fp32 kernels), through the fp32 calls only (a bias has no stored-operand call);
 * dbias is held to 8 u max|ref| too. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/dtype.h"
#include "fitllm/lora.h"
#include "fitllm/selftest.h"

#include "backend/selftest-impl.h"

typedef struct {
    int B, T, NH, NKV, HD, check; /* check 0: timed only (too large for the float64 reference) */
    int t5; /* T5's attention: non-causal, scale 1, a bias with its gradient, dropout (see the header) */
} at_shape;
#define AT_T5_DROP 0.1f
#define AT_T5_SEED 0x7e5ull

/* the attention descriptor of a shape (compact rows) */
static fl_attn_desc at_desc(const at_shape *s) {
    fl_attn_desc a = {s->B, s->T, s->T, s->NH, s->NKV, s->HD, (size_t)s->NH * s->HD, (size_t)s->NKV * s->HD,
                      (size_t)s->NKV * s->HD, (size_t)s->NH * s->HD, s->t5 ? 1.0f : (float)(1.0 / sqrt((double)s->HD)),
                      !s->t5, s->t5 ? AT_T5_DROP : 0.0f, s->t5 ? AT_T5_SEED : 0};
    return a;
}

/* float64 forward + backward of one grouped-head attention (q, k, v, dout rounded already): causal, or (t5) with the
 * bias (NH, T, T) added to unscaled scores and dropout's factors on the weights; dbias (t5) summed over the batch */
static void at_ref(const at_shape *s, const float *q, const float *k, const float *v, const float *dout,
                   const float *bias, double *out, double *lse, double *dq, double *dk, double *dv, double *dbias) {
    const int B = s->B, T = s->T, NH = s->NH, NKV = s->NKV, HD = s->HD, G = NH / NKV;
    const fl_attn_desc a = at_desc(s);
    const double sc = a.scale, fk = a.drop_p > 0 ? (double)fl_lora_dropout_scale(a.drop_p) : 1.0;
    double *p = malloc(sizeof(double) * T), *dp = malloc(sizeof(double) * T), *f = malloc(sizeof(double) * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float *qr = q + ((size_t)(b * T + t) * NH + h) * HD, *dor = dout + ((size_t)(b * T + t) * NH + h) * HD;
                const int n = s->t5 ? T : t + 1; /* the keys row t sees */
                double mx = -INFINITY, z = 0;
                for (int j = 0; j < n; j++) {
                    const float *kr = k + ((size_t)(b * T + j) * NKV + h / G) * HD;
                    double d = 0;
                    for (int e = 0; e < HD; e++) d += (double)qr[e] * kr[e];
                    p[j] = d * sc + (bias ? bias[((size_t)h * T + t) * T + j] : 0.0);
                    mx = fmax(mx, p[j]);
                    const size_t di = (((size_t)b * NH + h) * T + t) * T + j;
                    f[j] = a.drop_p > 0 ? (fl_lora_dropout_keep(a.drop_seed, di, a.drop_p) ? fk : 0.0) : 1.0;
                }
                for (int j = 0; j < n; j++) z += (p[j] = exp(p[j] - mx));
                double *o = out + ((size_t)(b * T + t) * NH + h) * HD, D = 0;
                lse[((size_t)b * NH + h) * T + t] = mx + log(z);
                for (int e = 0; e < HD; e++) o[e] = 0;
                for (int j = 0; j < n; j++) {
                    const float *vr = v + ((size_t)(b * T + j) * NKV + h / G) * HD;
                    p[j] /= z;
                    double d = 0;
                    for (int e = 0; e < HD; e++) o[e] += p[j] * f[j] * vr[e], d += (double)dor[e] * vr[e];
                    dp[j] = d;
                    D += p[j] * f[j] * d;
                }
                double *dqr = dq + ((size_t)(b * T + t) * NH + h) * HD;
                for (int j = 0; j < n; j++) {
                    const size_t kv = ((size_t)(b * T + j) * NKV + h / G) * HD;
                    const double ds = p[j] * (f[j] * dp[j] - D);
                    if (dbias) dbias[((size_t)h * T + t) * T + j] += ds;
                    for (int e = 0; e < HD; e++) {
                        dqr[e] += ds * sc * k[kv + e];
                        dk[kv + e] += ds * sc * qr[e];
                        dv[kv + e] += p[j] * f[j] * dor[e];
                    }
                }
            }
    free(p), free(dp), free(f);
}

/* worst |dev - ref| / bound over n elements; bound = 8 u max|ref| (lse: 8 u (1 + |ref|)) */
static double at_worst(const float *dev, const double *ref, size_t n, int per_elem) {
    const double u = 1.0 / 256;
    double mx = 0, w = 0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[i]));
    for (size_t i = 0; i < n; i++) {
        double bound = 8 * u * (per_elem ? 1 + fabs(ref[i]) : mx) + 1e-30, d = fabs(dev[i] - ref[i]);
        w = d != d ? INFINITY : fmax(w, d / bound);
    }
    return w;
}

typedef struct {
    const fl_backend *be;
    fl_attn_desc a;
    float *d[11]; /* device: q k v out lse dout dq dk dv, (t5) bias dbias */
    /* in16: a bf16 run's stored operands: q|k|v bf16 rows of W = (NH + 2 NKV) HD (attention_forward_in16 /
     * attention_backward16, the calls a bf16 model makes: cuDNN reads them in place), O's bf16 copy, and dq|dk|dv
     * accumulated in fp32 rows of the same width */
    int in16, W;
    uint16_t *qkv16, *out16;
    float *dqkv;
    /* in16 2: attention_backward_b16 (cuDNN's backward in bf16: dO and d(q|k|v) rows in bf16, written) */
    uint16_t *dout16, *dqkv16;
} at_run;
static void at_step(st_ctx *c, void *arg) {
    (void)c;
    at_run *r = arg;
    const fl_backend *be = r->be;
    if (r->in16) {
        const size_t ok = (size_t)r->a.NH * r->a.HD, ov = ok + (size_t)r->a.NKV * r->a.HD;
        if (be->attention_forward_in16(be, &r->a, r->d[3], r->out16, r->d[4], r->qkv16, r->qkv16 + ok, r->qkv16 + ov,
                                       NULL) != FL_OK)
            return;
        if (r->in16 == 2)
            be->attention_backward_b16(be, &r->a, NULL, NULL, NULL, r->dqkv16, r->dqkv16 + ok, r->dqkv16 + ov, r->dout16,
                                       r->qkv16, r->qkv16 + ok, r->qkv16 + ov, r->out16, r->d[4]);
        else
            be->attention_backward16(be, &r->a, r->dqkv, r->dqkv + ok, r->dqkv + ov, r->d[5], r->qkv16, r->qkv16 + ok,
                                     r->qkv16 + ov, NULL, r->out16, r->d[4]);
        return;
    }
    if (be->attention_forward(be, &r->a, r->d[3], r->d[4], r->d[0], r->d[1], r->d[2], r->d[9], NULL) == FL_OK)
        be->attention_backward(be, &r->a, r->d[6], r->d[7], r->d[8], r->d[10], r->d[5], r->d[0], r->d[1], r->d[2],
                               r->d[9], NULL, r->d[3], r->d[4]);
}

/* rows (B T, W) <-> the compact (B T, n) columns [off, off + n) of them; to_rows 1: compact -> rows (bf16) */
static void at_rows(const at_shape *s, int W, size_t off, size_t n, float *compact, uint16_t *rows16, float *rows32,
                    int to_rows) {
    for (size_t r = 0; r < (size_t)s->B * s->T; r++)
        for (size_t e = 0; e < n; e++) {
            if (to_rows) rows16[r * W + off + e] = fl_f32_to_bf16(compact[r * n + e]);
            else compact[r * n + e] = rows32[r * W + off + e];
        }
}

/* one choice at one shape (in16 1: through the bf16-stored calls; 2: with the backward in bf16, attention_backward_b16):
 * 0 ok (or not compared), 1 mismatch or failure, -1 not run (in16 2: the backend does not take the call so) */
static int at_case(st_ctx *c, const char *choice, const at_shape *s, int in16, FILE *out) {
    const fl_backend *be = c->dev;
    const size_t nq = (size_t)s->B * s->T * s->NH * s->HD, nk = (size_t)s->B * s->T * s->NKV * s->HD,
                 nl = (size_t)s->B * s->NH * s->T;
    const size_t nb = s->t5 ? (size_t)s->NH * s->T * s->T : 0; /* the bias and its gradient */
    float *h[11] = {0};
    const size_t len[11] = {nq, nk, nk, nq, nl, nq, nq, nk, nk, nb, nb};
    st_bufs bufs = {0};
    at_run r = {be, at_desc(s), {0}, 0, 0, NULL, NULL, NULL, NULL, NULL};
    for (int i = 0; i < 11; i++) {
        if (!len[i]) continue;
        h[i] = i < 3 || i == 5 || i == 9 ? fl_st_frand(c, len[i], -1.0f, 1.0f) : calloc(len[i], sizeof(float));
        if (i < 3 || i == 5)
            for (size_t e = 0; h[i] && e < len[i]; e++) h[i][e] = fl_bf16_to_f32(fl_f32_to_bf16(h[i][e]));
        r.d[i] = fl_st_up(c, &bufs, h[i], len[i] * sizeof(float));
    }
    const size_t qn = (size_t)s->NH * s->HD, kn = (size_t)s->NKV * s->HD, rows = (size_t)s->B * s->T;
    float *dqkv_h = NULL;
    if (in16) { /* q|k|v interleaved in bf16 (the values are bf16 already: exact), their gradients' fp32 rows */
        r.in16 = in16, r.W = (int)(qn + 2 * kn);
        r.a.ldq = r.a.ldk = r.a.ldv = (size_t)r.W;
        uint16_t *qkv = calloc(rows * r.W, sizeof(uint16_t));
        dqkv_h = calloc(rows * r.W, sizeof(float));
        if (qkv && dqkv_h) {
            at_rows(s, r.W, 0, qn, h[0], qkv, NULL, 1);
            at_rows(s, r.W, qn, kn, h[1], qkv, NULL, 1);
            at_rows(s, r.W, qn + kn, kn, h[2], qkv, NULL, 1);
        } else {
            bufs.failed = 1;
        }
        r.qkv16 = qkv ? fl_st_up(c, &bufs, qkv, rows * r.W * sizeof(uint16_t)) : NULL;
        r.out16 = fl_st_up(c, &bufs, NULL, nq * sizeof(uint16_t));
        r.dqkv = fl_st_up(c, &bufs, NULL, rows * r.W * sizeof(float));
        free(qkv);
        if (in16 == 2) { /* dO in bf16 (its values are bf16's already), the gradients' bf16 rows */
            uint16_t *d16 = calloc(nq, sizeof(uint16_t));
            for (size_t e = 0; d16 && e < nq; e++) d16[e] = fl_f32_to_bf16(h[5][e]);
            r.dout16 = d16 ? fl_st_up(c, &bufs, d16, nq * sizeof(uint16_t)) : NULL;
            r.dqkv16 = fl_st_up(c, &bufs, NULL, rows * r.W * sizeof(uint16_t));
            if (!d16) bufs.failed = 1;
            free(d16);
            const int ok = !bufs.failed && be->attention_b16_ok &&
                           be->attention_b16_ok(be, &r.a, r.qkv16, r.qkv16 + qn, r.qkv16 + qn + kn, r.out16);
            if (!ok) { /* not this backend's call: nothing to compare */
                fl_st_free(c, &bufs);
                for (int i = 0; i < 11; i++) free(h[i]);
                free(dqkv_h);
                return -1;
            }
        }
    }
    char name[96];
    snprintf(name, sizeof name, "attention %-6s B%d T%d NH%d NKV%d HD%d %s%s", choice, s->B, s->T, s->NH, s->NKV,
             s->HD, s->t5 ? "t5 bias dropout" : "causal", in16 == 2 ? " b16" : in16 ? " in16" : "");
    int bad = bufs.failed;
    if (!bad) at_step(c, &r);
    fl_status st = bad ? FL_ERR_OOM : be->sync(be);
    double worst = 0;
    if (st == FL_OK && s->check) {
        double *ref[11] = {0};
        for (int i = 3; i < 11; i++) ref[i] = i == 5 || i == 9 || !len[i] ? NULL : calloc(len[i], sizeof(double));
        at_ref(s, h[0], h[1], h[2], h[5], h[9], ref[3], ref[4], ref[6], ref[7], ref[8], ref[10]);
        if (in16 == 2) { /* the bf16 rows, widened */
            uint16_t *d16 = calloc(rows * r.W, sizeof(uint16_t));
            if (d16) fl_st_down(c, &bufs, d16, r.dqkv16, rows * r.W * sizeof(uint16_t));
            for (size_t e = 0; d16 && e < rows * r.W; e++) dqkv_h[e] = fl_bf16_to_f32(d16[e]);
            if (!d16) bufs.failed = 1;
            free(d16);
        } else if (in16) {
            fl_st_down(c, &bufs, dqkv_h, r.dqkv, rows * r.W * sizeof(float));
        }
        if (in16) { /* dq, dk, dv from their rows */
            at_rows(s, r.W, 0, qn, h[6], NULL, dqkv_h, 0);
            at_rows(s, r.W, qn, kn, h[7], NULL, dqkv_h, 0);
            at_rows(s, r.W, qn + kn, kn, h[8], NULL, dqkv_h, 0);
        }
        for (int i = 3; i < 11; i++) {
            if (i == 5 || i == 9 || !len[i]) continue;
            if (i < 6 || !in16) fl_st_down(c, &bufs, h[i], r.d[i], len[i] * sizeof(float));
            worst = fmax(worst, at_worst(h[i], ref[i], len[i], i == 4));
            free(ref[i]);
        }
        bad = bufs.failed || !(worst <= 1.0);
    }
    double t = st == FL_OK ? fl_st_time(c, at_step, &r) : -1;
    double flop = (s->t5 ? 14.0 : 7.0) * s->B * s->NH * (double)s->T * s->T * s->HD; /* causal forward 2, backward 5 */
    if (st != FL_OK) fprintf(out, "  %-52s FAIL  (%s)\n", name, fl_error_message());
    else if (s->check)
        fprintf(out, "  %-52s %s  worst %.2e of bound  %10.1f us  %6.1f TFLOP/s\n", name, bad ? "FAIL" : "ok  ", worst,
                t * 1e6, flop / t * 1e-12);
    else fprintf(out, "  %-52s time  %10.1f us  %6.1f TFLOP/s (forward + backward)\n", name, t * 1e6, flop / t * 1e-12);
    fl_st_free(c, &bufs);
    for (int i = 0; i < 11; i++) free(h[i]);
    free(dqkv_h);
    return st != FL_OK || bad;
}

fl_status fl_selftest_attention_choices(const char *name, int small, FILE *out, fl_selftest_result *res) {
    static const char *choices[] = {"cudnn", "own", "legacy"};
    /* HD 100 (OpenLLaMA 3B): the own kernels pad it to their 128 tiles, cuDNN to 104 (zero-padded copies); HD 80
     * (BLIP-2 OPT-2.7b): cuDNN where its engines take it, else the own kernels padded; legacy: the fp32 kernels */
    /* and T5's (Flan-T5-base's heads: 12 of 64; timed at its B 8, source 512) */
    const at_shape small_shapes[] = {{1, 40, 4, 2, 64, 1, 0}, {1, 33, 2, 1, 128, 1, 0}, {1, 37, 4, 2, 100, 1, 0},
                                     {1, 29, 2, 2, 80, 1, 0}, {2, 35, 2, 2, 64, 1, 1}};
    const at_shape big_shapes[] = {{1, 512, 8, 2, 64, 1, 0}, {1, 256, 4, 4, 128, 1, 0}, {1, 256, 4, 2, 100, 1, 0},
                                   {1, 256, 4, 2, 80, 1, 0}, {2, 128, 4, 4, 64, 1, 1}, {4, 2048, 32, 4, 64, 0, 0},
                                   {1, 2048, 32, 32, 100, 0, 0}, {8, 512, 12, 12, 64, 0, 1}};
    const at_shape *shapes = small ? small_shapes : big_shapes;
    const int nshapes = small ? 5 : 8;
    memset(res, 0, sizeof *res);
    const char *env = getenv("FITLLM_CUDA_ATTN");
    char *saved = env ? strdup(env) : NULL;
    fprintf(out, "selftest: attention kernels of bf16 runs (FITLLM_CUDA_ATTN) against float64 (bound: 8 u max|ref|, "
                 "u = 2^-8)\n");
    for (int k = 0; k < 3; k++) {
        setenv("FITLLM_CUDA_ATTN", choices[k], 1);
        fl_backend be;
        if (fl_backend_init_by_name(name, &be, 0) != FL_OK) {
            fprintf(out, "  attention %-6s not available: %s\n", choices[k], fl_error_message());
            continue;
        }
        st_ctx c;
        memset(&c, 0, sizeof c);
        c.dev = &be, c.out = out, c.rng = 0xa77e;
        if (be.pool_init(&be, &c.pool, "selftest-attn", 0) == FL_OK) {
            if (be.set_compute_dtype) be.set_compute_dtype(&be, FL_BF16);
            /* each shape through the fp32 calls, then through a bf16 run's stored-operand calls where the backend has
             * them (cuDNN reads those in place) */
            /* and (in16 2) with cuDNN's backward in bf16 where the backend runs it (attention_backward_b16) */
            const int modes = 1 + (be.attention_forward_in16 && be.attention_backward16) + (be.attention_backward_b16 != NULL);
            for (int in16 = 0; in16 < modes; in16++)
                for (int i = 0; i < nshapes; i++) {
                    if (in16 && shapes[i].t5) continue; /* a bias has no stored-operand call */
                    const int rc = at_case(&c, choices[k], &shapes[i], in16, out);
                    if (rc < 0) continue;
                    res->n_cases += shapes[i].check;
                    res->n_fail += rc;
                }
            if (be.set_compute_dtype) be.set_compute_dtype(&be, FL_F32);
            fl_mem_pool_free(&c.pool);
        }
        fl_backend_free(&be);
    }
    if (saved) setenv("FITLLM_CUDA_ATTN", saved, 1);
    else unsetenv("FITLLM_CUDA_ATTN");
    free(saved);
    return FL_OK;
}
