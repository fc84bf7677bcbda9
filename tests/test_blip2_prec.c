/* BLIP-2 under bf16-mixed (fl_blip2_set_precision: fp32 master weights, the matmuls reading each part's bf16 copy with
 * fp32 accumulation) against transformers under PyTorch's CPU autocast to bfloat16 (tests/ref/make_blip2_bf16_fixture.py,
 * expected-bf16.safetensors in tests/fixtures/blip2-tiny-opt and blip2-tiny-t5), both variants:
 *  - one training forward: the logits' and the loss's distance to the float64 run within 2 x autocast's (both round
 *    the matmul operands to bf16, so both land about bf16's unit roundoff times the scale away, differently: autocast
 *    also rounds each matmul's output where fitllm keeps fp32), and beyond 30 x PyTorch fp32's own error (the bf16
 *    copy really is what the matmuls read);
 *  - 5 AdamW steps on the batch (lr 1e-3, betas (0.9, 0.95), weight decay 0.1, every part): each step's loss within
 *    2 x autocast's largest distance to the float64 steps, and the last one further from fp32's than fp32 noise.
 * fp16 storage (16-true) and loss scaling (16-mixed) are refused by name (bf16-true: tests/test_blip2_bf16true.c). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/blip2.h"
#include "fitllm/io.h"
#include "fitllm/train.h"
#include "blip2_batch.h"
#include "test.h"

typedef struct {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_blip2 *b;
    b2_batch d;   /* the batch; d.x: expected.safetensors */
    fl_st_file r; /* expected-bf16.safetensors */
    int t5;
} pc;

static void open_pc(pc *c, const char *dir, int t5) {
    char p[300];
    memset(c, 0, sizeof *c);
    c->t5 = t5;
    FL_REQUIRE_OK(fl_test_backend(&c->be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&c->be, &c->pool, &c->host, c->be.name, 0));
    FL_REQUIRE_OK(fl_blip2_load(&c->b, dir, &c->be, &c->pool));
    b2_batch_open(&c->d, dir, t5);
    snprintf(p, sizeof p, "%s/expected-bf16.safetensors", dir);
    FL_REQUIRE_OK(fl_st_open(&c->r, p));
}

static void close_pc(pc *c) {
    b2_batch_close(&c->d);
    fl_st_close(&c->r);
    fl_blip2_free(c->b);
    fl_backend_pools_free(&c->pool, &c->host);
    fl_backend_free(&c->be);
}

/* a training forward (logits into lg, may be NULL) and the backward; the mean loss into *out */
static void fwd_bwd(pc *c, float *lg, double *out) {
    float l;
    b2_batch_fwd_bwd(c->b, &c->d, lg, &l);
    *out = l;
}

static double f_at(const fl_st_file *f, const char *name, int i) {
    const fl_st_tensor *t = fl_st_find(f, name);
    FL_CHECKF(t != NULL, "reference tensor %s", name);
    if (!t) return NAN;
    return t->dtype == FL_F64 ? ((const double *)t->data)[i] : ((const float *)t->data)[i];
}

static double max_err(const float *a, const float *b, size_t n) {
    double e = 0;
    for (size_t i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - (double)b[i]));
    return e;
}

static void check_variant(const char *dir, int t5) {
    pc c;
    open_pc(&c, dir, t5);
    fl_precision p;
    FL_REQUIRE_OK(fl_precision_find("bf16-mixed", &p));
    FL_REQUIRE_OK(fl_blip2_set_precision(c.b, &p));
    FL_REQUIRE_OK(fl_blip2_alloc_grads_parts(c.b, 7));
    const size_t n = b2_batch_logits(&c.d, c.b);
    float *lg = malloc(n * sizeof *lg);
    FL_REQUIRE(lg);
    double loss;
    fwd_bwd(&c, lg, &loss);
    const fl_st_tensor *l64 = fl_st_find(&c.d.x, "logits"), *lac = fl_st_find(&c.r, "logits");
    FL_REQUIRE(l64 && lac && l64->end - l64->begin == n * 4 && lac->end - lac->begin == n * 4);
    const double e = max_err(lg, l64->data, n), e_ac = max_err(lac->data, l64->data, n);
    const double noise = f_at(&c.d.x, "noise.logits", 0), lref = f_at(&c.d.x, "loss", 0);
    FL_CHECKF(e <= 2 * e_ac, "%s: logits %.3g from float64, over 2 x autocast's %.3g", dir, e, e_ac);
    FL_CHECKF(e > 30 * noise, "%s: logits %.3g from float64, within 30 x fp32 noise %.3g: no bf16 compute?", dir, e,
              noise);
    const double le = fabs(loss - lref), le_ac = fabs(f_at(&c.r, "loss", 0) - lref);
    FL_CHECKF(le <= 2 * le_ac, "%s: loss %.7f, %.3g from float64, over 2 x autocast's %.3g", dir, loss, le, le_ac);
    printf("      %s bf16-mixed: logits %.3g from float64 (autocast %.3g, fp32 noise %.2g), loss %.6f (float64 %.6f, "
           "autocast %.6f)\n", t5 ? "T5" : "OPT", e, e_ac, noise, loss, lref, f_at(&c.r, "loss", 0));
    free(lg);
    /* 5 AdamW steps on a fresh copy */
    close_pc(&c);
    open_pc(&c, dir, t5);
    FL_REQUIRE_OK(fl_blip2_set_precision(c.b, &p));
    FL_REQUIRE_OK(fl_blip2_alloc_grads_parts(c.b, 7));
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.lr = 1e-3f, oc.beta1 = 0.9f, oc.beta2 = 0.95f, oc.eps = 1e-8f, oc.weight_decay = 0.1f;
    fl_optimizer o[FL_BLIP2_PARTS];
    for (int k = 0; k < FL_BLIP2_PARTS; k++) FL_REQUIRE_OK(fl_optim_init(&o[k], fl_blip2_part(c.b, k), &oc));
    double bar = 0, ours[5];
    for (int s = 0; s < 5; s++) bar = fmax(bar, fabs(f_at(&c.r, "loss5", s) - f_at(&c.r, "loss5_f64", s)));
    for (int s = 0; s < 5; s++) {
        fwd_bwd(&c, NULL, &ours[s]);
        const double r64 = f_at(&c.r, "loss5_f64", s);
        FL_CHECKF(fabs(ours[s] - r64) <= 2 * bar, "%s step %d: loss %.7f, float64 %.7f: over 2 x autocast's %.3g", dir,
                  s + 1, ours[s], r64, bar);
        for (int k = 0; k < FL_BLIP2_PARTS; k++) FL_REQUIRE_OK(fl_optim_step(&o[k], oc.lr, 0.0f, NULL));
    }
    const double d32 = fabs(ours[4] - f_at(&c.r, "loss5_f32", 4));
    FL_CHECKF(d32 > 1e-5, "%s: step 5's loss is fp32's (%.3g apart): no bf16 compute?", dir, d32);
    printf("      %s bf16-mixed, 5 AdamW steps: %.6f .. %.6f (autocast %.6f .. %.6f, float64 .. %.6f; bound %.3g)\n",
           t5 ? "T5" : "OPT", ours[0], ours[4], f_at(&c.r, "loss5", 0), f_at(&c.r, "loss5", 4),
           f_at(&c.r, "loss5_f64", 4), 2 * bar);
    for (int k = 0; k < FL_BLIP2_PARTS; k++) fl_optim_free(&o[k]);
    close_pc(&c);
}

FL_TEST(blip2_bf16_mixed_vs_autocast) {
    check_variant("tests/fixtures/blip2-tiny-opt", 0);
    check_variant("tests/fixtures/blip2-tiny-t5", 1);
}

FL_TEST(blip2_precision_refusals) {
    pc c;
    open_pc(&c, "tests/fixtures/blip2-tiny-opt", 0);
    static const char *const no[] = {"16-true", "16-mixed"}; /* bf16-true: tests/test_blip2_bf16true.c */
    for (int i = 0; i < 2; i++) {
        fl_precision p;
        FL_REQUIRE_OK(fl_precision_find(no[i], &p));
        FL_CHECK(fl_blip2_set_precision(c.b, &p) == FL_ERR_UNSUPPORTED);
        FL_CHECKF(strstr(fl_error_message(), no[i]) != NULL, "refusal names %s: %s", no[i], fl_error_message());
    }
    close_pc(&c);
}
