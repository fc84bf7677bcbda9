/* BLIP-2 (src/model/arch_blip2.c, blip2.c, blip2_pass.c) against transformers' Blip2ForConditionalGeneration:
 * tests/fixtures/blip2-tiny-opt from tests/ref/make_blip2_fixture.py (vision 24 wide, 3 heads, 2 blocks, 12x12
 * images of 4x4 patches; Q-Former 20 wide, 2 heads, 3 blocks, cross-attention in blocks 0 and 2, 5 queries; OPT
 * vocab 103, 28 wide, 4 heads, 2 blocks; B 2 x 12 ids: 5 image placeholders and a caption of 7, the second's last 2
 * labels ignored).
 *
 * Tolerances as tests/test_t5.c: the reference runs in float64 from the same fp32 weights and the fixture carries
 * PyTorch fp32's own distance to it per tensor (noise.*); fitllm computes the same function in fp32 in other orders,
 * so each tensor must be within 8 x that plus 16 fp32 roundings of its scale. Central finite differences of the
 * loss check the new ops' gradients (the class token, a position, the patch weight, a query token) independently of
 * the reference. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/blip2.h"
#include "fitllm/io.h"
#include "model/blip2-impl.h"
#include "test.h"

#define FIX "tests/fixtures/blip2-tiny-opt"

static float f32_at(const fl_st_tensor *t) { return ((const float *)t->data)[0]; }
static double bound(const fl_st_tensor *noise, double scale) { return 8.0 * f32_at(noise) + 16.0 * FLT_EPSILON * scale; }

typedef struct {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_blip2 *b;
    fl_st_file x;
    const fl_st_tensor *pixels, *ids, *labels;
    int B, T, n_valid;
    int32_t *targets; /* labels as next-token targets at the caption's positions */
} b2_case;

static fl_status open_case(b2_case *c) {
    memset(c, 0, sizeof *c);
    FL_TRY(fl_test_backend(&c->be, 2));
    FL_TRY(fl_backend_pools_init(&c->be, &c->pool, &c->host, c->be.name, 0));
    FL_TRY(fl_blip2_load(&c->b, FIX, &c->be, &c->pool));
    FL_TRY(fl_st_open(&c->x, FIX "/expected.safetensors"));
    c->pixels = fl_st_find(&c->x, "pixels"), c->ids = fl_st_find(&c->x, "ids"), c->labels = fl_st_find(&c->x, "labels");
    if (!c->pixels || !c->ids || !c->labels) return fl_errorf(FL_ERR_FORMAT, "fixture incomplete");
    c->B = (int)c->ids->shape[0], c->T = (int)c->ids->shape[1];
    const int TC = (int)c->labels->shape[1], NQ = c->T - TC;
    const int32_t *lab = c->labels->data;
    c->targets = malloc((size_t)c->B * c->T * sizeof *c->targets);
    if (!c->targets) return FL_ERR_OOM;
    /* HF: logits[:, -TC:] shifted against labels[:, 1:]: row NQ + i predicts caption[i + 1] */
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->T; t++) {
            const int i = t - NQ;
            const int v = i >= 0 && i + 1 < TC ? lab[b * TC + i + 1] : FL_IGNORE_INDEX;
            c->targets[b * c->T + t] = v;
            c->n_valid += v != FL_IGNORE_INDEX;
        }
    FL_TRY(fl_blip2_alloc_grads(c->b));
    return fl_blip2_alloc_acts(c->b, c->B, c->T);
}

static void close_case(b2_case *c) {
    free(c->targets);
    fl_st_close(&c->x);
    fl_blip2_free(c->b);
    fl_backend_pools_free(&c->pool, &c->host);
    fl_backend_free(&c->be);
}

static fl_status forward(b2_case *c, float grad_scale, float *logits, float *loss) {
    return fl_blip2_forward(c->b, c->pixels->data, c->ids->data, c->targets, c->B, c->T, grad_scale, logits, loss);
}

/* max |ours - ref| of n floats (ours on the device) and the reference's scale */
static double dev_err(const fl_backend *be, const float *dev, const fl_st_tensor *r, size_t n, double *scale) {
    float *h = malloc(n * sizeof *h);
    be->to_host(be, h, dev, n * sizeof *h);
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        e = fmax(e, fabs((double)h[i] - ((const float *)r->data)[i]));
        s = fmax(s, fabs(((const float *)r->data)[i]));
    }
    free(h);
    *scale = s;
    return e;
}

static void check_stage(b2_case *c, const char *name, const float *dev, size_t n) {
    const fl_st_tensor *r = fl_st_find(&c->x, name), *nz = NULL;
    char k[64];
    snprintf(k, sizeof k, "noise.%s", name);
    nz = fl_st_find(&c->x, k);
    FL_REQUIRE(r && nz && (size_t)(r->end - r->begin) == n * 4);
    double s, e = dev_err(&c->be, dev, r, n, &s);
    FL_CHECKF(e <= bound(nz, s), "%s error %.3g, bound %.3g", name, e, bound(nz, s));
    printf("      %s: error %.2g (PyTorch fp32 %.2g, bound %.2g)\n", name, e, f32_at(nz), bound(nz, s));
}

FL_TEST(blip2_opt_vs_transformers) {
    b2_case c;
    FL_REQUIRE_OK(open_case(&c));
    fl_blip2 *b = c.b;
    FL_CHECK(c.n_valid == 2 * 6 - 2 && b->cfg.image_token == 100 && b->cfg.n_queries == 5);
    const size_t V = (size_t)b->cfg.text.vocab_size, nl = (size_t)c.B * c.T * V;
    float *lg = malloc(nl * sizeof *lg), loss;
    FL_REQUIRE(lg);
    fl_blip2_zero_grads(b);
    FL_REQUIRE_OK(forward(&c, 1.0f / (float)c.n_valid, lg, &loss));
    check_stage(&c, "image_embeds", b->st[0].nout, (size_t)c.B * b->st[0].T * b->cfg.vision.dim);
    check_stage(&c, "query_output", b->st[1].res[b->st[1].L], (size_t)c.B * b->cfg.n_queries * b->cfg.qformer.dim);
    const fl_st_tensor *rl = fl_st_find(&c.x, "logits"), *nlg = fl_st_find(&c.x, "noise.logits");
    const fl_st_tensor *rloss = fl_st_find(&c.x, "loss"), *nloss = fl_st_find(&c.x, "noise.loss");
    FL_REQUIRE(rl && nlg && rloss && nloss && (size_t)(rl->end - rl->begin) == nl * 4);
    double e = 0, sc = 0;
    for (size_t i = 0; i < nl; i++) {
        e = fmax(e, fabs((double)lg[i] - ((const float *)rl->data)[i]));
        sc = fmax(sc, fabs(((const float *)rl->data)[i]));
    }
    FL_CHECKF(e <= bound(nlg, sc), "logits error %.3g, bound %.3g", e, bound(nlg, sc));
    const double lref = ((const double *)rloss->data)[0];
    FL_CHECKF(fabs(loss - lref) <= bound(nloss, lref), "loss %.9f vs %.9f", (double)loss, lref);
    printf("      logits error %.2g (PyTorch fp32 %.2g, bound %.2g), loss %.8f (ref %.8f)\n", e, f32_at(nlg),
           bound(nlg, sc), (double)loss, lref);
    FL_REQUIRE_OK(fl_blip2_backward(b));
    double worst = 0;
    int checked = 0, total = 0;
    static const char *const pre[FL_BLIP2_PARTS] = {"grad.", "grad.", "grad.language_model."};
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        const fl_model *m = fl_blip2_part(b, k);
        total += m->layout.n;
        for (int i = 0; i < m->layout.n; i++) {
            const fl_param_info *p = &m->layout.params[i];
            char gk[160], nk[200];
            snprintf(gk, sizeof gk, "%s%s", pre[k], p->name);
            snprintf(nk, sizeof nk, "noise.%s", gk + 5);
            const fl_st_tensor *g = fl_st_find(&c.x, gk), *gn = fl_st_find(&c.x, nk);
            FL_CHECKF(g && gn && (size_t)(g->end - g->begin) == p->numel * 4, "reference gradient of %s", gk);
            if (!g || !gn) continue;
            double s, ge = dev_err(&c.be, fl_model_grads_f32(m) + p->offset, g, p->numel, &s);
            FL_CHECKF(ge <= bound(gn, s), "gradient of %s: error %.3g, bound %.3g (PyTorch fp32 %.3g, scale %.3g)",
                      gk + 5, ge, bound(gn, s), f32_at(gn), s);
            worst = fmax(worst, ge / bound(gn, s));
            checked++;
        }
    }
    FL_CHECK(checked == total && total == 139);
    printf("      %d gradients, worst error %.2f of its bound\n", checked, worst);
    free(lg);
    close_case(&c);
}
