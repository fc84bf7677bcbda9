/* T5 (src/model/arch_t5.c, run by src/model/seq2seq.c) against transformers' T5ForConditionalGeneration:
 * tests/fixtures/t5-tiny-relu (v1.0: ReLU, tied head, decoder output scaled by d_model^-0.5) and t5-tiny-gated
 * (v1.1 / Flan: gated-GELU, untied lm_head) from tests/ref/make_t5_fixture.py: vocab 97, d_model 36, d_kv 10,
 * 3 heads (inner 30), d_ff 52, 2 encoder + 3 decoder blocks, 8 buckets up to distance 20; B 2 x source 13 (the
 * second's last 3 padded) x target 17 (the second's last 4 labels ignored).
 *
 * Tolerances. The reference is computed in float64 from the same fp32 weights; the fixture carries per tensor how
 * far PyTorch's own fp32 run lands from it (noise.*: logits 3.1e-6 / 4.4e-6 on a scale of 4; gradients up to
 * 1.2e-6). fitllm computes the same function in fp32 in other summation orders, so its error is of that order, not
 * the same bits: each tensor must be within 8 x PyTorch's fp32 error plus 16 fp32 roundings of its scale (the
 * floor where PyTorch happened to be nearly exact), as tests/test_bert.c. After 5 AdamW steps: the distance to the
 * float64 run, scaled by the tensor's max, within 4 x PyTorch fp32's own (as tests/test_model.c's golden tests),
 * elements with near-zero gradients held to Adam's bound only. Finite differences of the loss (in double over the
 * fp32 forward) check the relative bias tables' gradients (their path: buckets -> bias -> every block's scores).
 * Wrong ops are far outside: see t5_variants_are_distinct. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "model/model-impl.h"
#include "test.h"

static const fl_st_tensor *ref_t(const fl_st_file *f, const char *pre, const char *name) {
    char key[256];
    snprintf(key, sizeof key, "%s%s", pre, name);
    return fl_st_find(f, key);
}

static float f32_at(const fl_st_tensor *t) { return ((const float *)t->data)[0]; }

static double bound(const fl_st_tensor *noise, double scale) { return 8.0 * f32_at(noise) + 16.0 * FLT_EPSILON * scale; }

/* entry p's reference (HF orientation) in our orientation: a transposed-on-disk entry (the relative bias table,
 * stored (NH, buckets)) is transposed */
static void ours_from_ref(const fl_param_info *p, const fl_st_tensor *t, float *out) {
    const float *r = t->data;
    if (p->ndim == 2 && p->transposed_on_disk) {
        for (int64_t i = 0; i < p->shape[0]; i++)
            for (int64_t j = 0; j < p->shape[1]; j++) out[i * p->shape[1] + j] = r[j * p->shape[0] + i];
    } else {
        memcpy(out, r, p->numel * sizeof(float));
    }
}

typedef struct {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
    fl_st_file x;
    const fl_st_tensor *src, *mask, *dec, *labels;
    int B, Ts, Tt, n_valid;
} t5_case;

/* drop > 0: config.json's dropout_rate replaced by it, applied in training passes (fl_model_set_dropout) */
static fl_status open_case_ex(t5_case *c, const char *dir, int ckpt, float drop) {
    memset(c, 0, sizeof *c);
    FL_TRY(fl_test_backend(&c->be, 2));
    FL_TRY(fl_backend_pools_init(&c->be, &c->pool, &c->host, c->be.name, 0));
    FL_TRY(fl_hf_load_model(&c->m, dir, &c->be, &c->pool));
    char p[256];
    snprintf(p, sizeof p, "%s/expected.safetensors", dir);
    FL_TRY(fl_st_open(&c->x, p));
    c->src = fl_st_find(&c->x, "src"), c->mask = fl_st_find(&c->x, "src_mask");
    c->dec = fl_st_find(&c->x, "dec"), c->labels = fl_st_find(&c->x, "labels");
    if (!c->src || !c->mask || !c->dec || !c->labels) return fl_errorf(FL_ERR_FORMAT, "%s: fixture incomplete", dir);
    c->B = (int)c->src->shape[0], c->Ts = (int)c->src->shape[1], c->Tt = (int)c->dec->shape[1];
    for (int i = 0; i < c->B * c->Tt; i++) c->n_valid += ((const int32_t *)c->labels->data)[i] != FL_IGNORE_INDEX;
    FL_TRY(fl_model_alloc_grads(&c->m));
    c->m.act_ckpt = ckpt;
    if (drop > 0) c->m.cfg.dropout_rate = drop;
    FL_TRY(fl_model_set_dropout(&c->m, drop > 0));
    return fl_model_alloc_acts_s2s(&c->m, c->B, c->Ts, c->Tt);
}

static fl_status open_case(t5_case *c, const char *dir) { return open_case_ex(c, dir, 0, 0); }

static void close_case(t5_case *c) {
    fl_st_close(&c->x);
    fl_model_free(&c->m);
    fl_backend_pools_free(&c->pool, &c->host);
    fl_backend_free(&c->be);
}

static fl_status forward(t5_case *c, float grad_scale, float *logits, double *loss);

/* c's model saved into a fresh folder `name` (shards of at most `shard` bytes; 0: one file), loaded back in its place
 * (the folder's path in dir) and its loss; the caller compares it with the loss before */
static void save_reload(t5_case *c, const char *name, size_t shard, char *dir, size_t n, double *loss) {
    snprintf(dir, n, "%s/%s", fl_test_tmpdir(), name);
    fl_hf_set_max_shard_bytes(shard);
    FL_REQUIRE_OK(fl_hf_save_model(&c->m, dir));
    fl_hf_set_max_shard_bytes(0);
    fl_model m2;
    FL_REQUIRE_OK(fl_hf_load_model(&m2, dir, &c->be, &c->pool));
    fl_model_free(&c->m);
    c->m = m2;
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&c->m, c->B, c->Ts, c->Tt));
    FL_REQUIRE_OK(forward(c, 0, NULL, loss));
}

/* the mean loss of a (training) forward */
static fl_status forward(t5_case *c, float grad_scale, float *logits, double *loss) {
    FL_TRY(fl_model_forward_s2s(&c->m, c->src->data, c->mask->data, c->dec->data, c->labels->data, c->B, c->Ts, c->Tt,
                                grad_scale, logits));
    *loss = c->m.loss_sum / (double)c->m.n_valid;
    return FL_OK;
}

static const float *grad_host(const fl_model *m, const fl_param_info *p, float *buf) {
    m->be->to_host(m->be, buf, fl_model_grads_f32(m) + p->offset, p->numel * sizeof(float));
    return buf;
}

/* every gradient of m against the reference's grad.<name> within its bound (noise.<name>); gh, rf: scratch of the
 * model's size */
static void grads_vs(const fl_model *m, const fl_st_file *x, const char *dir, float *gh, float *rf) {
    double worst = 0;
    int checked = 0;
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *p = &m->layout.params[i];
        const fl_st_tensor *g = ref_t(x, "grad.", p->name), *gn = ref_t(x, "noise.", p->name);
        FL_CHECKF(g && gn && (size_t)(g->end - g->begin) == p->numel * 4, "%s: reference gradient of %s", dir, p->name);
        if (!g || !gn) continue;
        ours_from_ref(p, g, rf);
        grad_host(m, p, gh);
        double ge = 0, s = 0;
        for (size_t k = 0; k < p->numel; k++) ge = fmax(ge, fabs((double)gh[k] - rf[k])), s = fmax(s, fabs(rf[k]));
        FL_CHECKF(ge <= bound(gn, s), "%s: gradient of %s: error %.3g, bound %.3g (PyTorch fp32 %.3g, scale %.3g)", dir,
                  p->name, ge, bound(gn, s), f32_at(gn), s);
        worst = fmax(worst, ge / bound(gn, s));
        checked++;
    }
    FL_CHECK(checked == m->layout.n);
    printf("      %s: %d gradients, worst error %.2f of its bound\n", dir, checked, worst);
}

/* logits, loss, every gradient; then finite differences of the relative bias tables */
static void check_pass(const char *dir) {
    t5_case c;
    FL_REQUIRE_OK(open_case(&c, dir));
    fl_model *m = &c.m;
    FL_CHECK(m->cfg.arch == FL_ARCH_T5 && c.n_valid == c.B * c.Tt - 4);
    const size_t nl = (size_t)c.B * c.Tt * m->cfg.vocab_size;
    float *lg = malloc(nl * sizeof(float)), *gh = malloc(m->layout.numel * sizeof(float)),
          *rf = malloc(m->layout.numel * sizeof(float));
    FL_REQUIRE(lg && gh && rf);
    fl_model_zero_grads(m);
    double loss;
    FL_REQUIRE_OK(forward(&c, 1.0f / (float)c.n_valid, lg, &loss));
    const fl_st_tensor *rl = fl_st_find(&c.x, "logits"), *nlg = fl_st_find(&c.x, "noise.logits");
    const fl_st_tensor *rloss = fl_st_find(&c.x, "loss"), *nloss = fl_st_find(&c.x, "noise.loss");
    FL_REQUIRE(rl && nlg && rloss && nloss && (size_t)(rl->end - rl->begin) == nl * 4);
    double e = 0, sc = 0;
    for (size_t i = 0; i < nl; i++) {
        e = fmax(e, fabs((double)lg[i] - ((const float *)rl->data)[i]));
        sc = fmax(sc, fabs(((const float *)rl->data)[i]));
    }
    FL_CHECKF(e <= bound(nlg, sc), "%s: logits error %.3g, bound %.3g", dir, e, bound(nlg, sc));
    const double lref = ((const double *)rloss->data)[0], el = fabs(loss - lref);
    FL_CHECKF(el <= bound(nloss, lref), "%s: loss %.9f vs %.9f", dir, loss, lref);
    printf("      %s: logits error %.2g (PyTorch fp32 %.2g, bound %.2g), loss %.8f (ref %.8f)\n", dir, e, f32_at(nlg),
           bound(nlg, sc), loss, lref);
    FL_REQUIRE_OK(fl_model_backward_s2s(m));
    grads_vs(m, &c.x, dir, gh, rf);

    /* central finite differences of a few relative bias entries (encoder and decoder tables): the loss has scale ~5
     * and fp32 noise ~1e-6, so with a step of 1e-2 the quotient carries ~1e-4 of rounding and O(h^2 f''') of
     * truncation (observed: at most 1.9e-4, on an entry whose step crosses a ReLU kink, else 3e-5): 3e-4 + 2e-2 |g|
     * separates it from a wrong gradient (the entries are ~1e-2) */
    for (int g0 = 0; g0 < 2; g0++) {
        const int ti = fl_layout_role(&m->layout, 1 + (g0 ? m->cfg.n_layers : 0), FL_ROLE_REL_BIAS);
        FL_REQUIRE(ti >= 0);
        const fl_param_info *p = &m->layout.params[ti];
        grad_host(m, p, gh);
        const size_t ks[3] = {1, (size_t)m->cfg.rel_buckets + 2, p->numel - 1}; /* (head, bucket) (0,1) (1,2) (2,7) */
        for (int j = 0; j < 3; j++) {
            float *w = fl_model_params_f32(m) + fl_model_store_off(m, ti) + ks[j], w0, wv;
            FL_REQUIRE_OK(c.be.to_host(&c.be, &w0, w, sizeof w0));
            const float step = 1e-2f, an = gh[ks[j]];
            double l[2];
            for (int s = 0; s < 2; s++) {
                wv = w0 + (s ? -step : step);
                FL_REQUIRE_OK(c.be.to_device(&c.be, w, &wv, sizeof wv));
                FL_REQUIRE_OK(forward(&c, 0, NULL, &l[s]));
            }
            FL_REQUIRE_OK(c.be.to_device(&c.be, w, &w0, sizeof w0));
            const double num = (l[0] - l[1]) / (2.0 * step);
            FL_CHECKF(fabs(num - an) <= 3e-4 + 2e-2 * fabs(an), "%s: finite difference of %s[%zu]: %.6g vs backward %.6g",
                      dir, p->name, ks[j], num, an);
            if (getenv("FL_TEST_VERBOSE")) printf("      fd %s[%zu]: %.6g vs %.6g\n", p->name, ks[j], num, (double)an);
        }
    }
    free(lg), free(gh), free(rf);
    close_case(&c);
}

FL_TEST(t5_relu_tied_vs_transformers) { check_pass("tests/fixtures/t5-tiny-relu"); }
FL_TEST(t5_gated_untied_vs_transformers) { check_pass("tests/fixtures/t5-tiny-gated"); }

/* Dropout in training (tests/ref/make_t5_dropout_fixture.py: transformers in training mode with its nn.Dropout
 * modules replaced by fitllm's masks of the same seeds, p 0.2): the loss and every gradient within the bounds above,
 * so fitllm drops where transformers does, with the masks it says. A site in the wrong place, or a backward without
 * its mask, moves them far (the loss without dropout is 0.25 / 0.30 away; tests/test_t5_dropout.c) */
static void check_dropout(const char *dir) {
    char p[256];
    snprintf(p, sizeof p, "%s/expected-dropout.safetensors", dir);
    fl_st_file y;
    FL_REQUIRE_OK(fl_st_open(&y, p));
    const fl_st_tensor *seed = fl_st_find(&y, "seed"), *pr = fl_st_find(&y, "p"), *rloss = fl_st_find(&y, "loss");
    FL_REQUIRE(seed && pr && rloss);
    t5_case c;
    FL_REQUIRE_OK(open_case_ex(&c, dir, 0, f32_at(pr)));
    fl_model *m = &c.m;
    float *gh = malloc(m->layout.numel * sizeof(float)), *rf = malloc(m->layout.numel * sizeof(float));
    FL_REQUIRE(gh && rf);
    fl_model_zero_grads(m);
    fl_model_adapters_seed(m, (uint64_t)((const int64_t *)seed->data)[0]);
    double loss;
    FL_REQUIRE_OK(forward(&c, 1.0f / (float)c.n_valid, NULL, &loss));
    const double lref = ((const double *)rloss->data)[0];
    FL_CHECKF(fabs(loss - lref) <= bound(fl_st_find(&y, "noise.loss"), lref), "%s: loss with dropout %.9f vs %.9f",
              dir, loss, lref);
    printf("      %s: loss with dropout %.8f (ref %.8f)\n", dir, loss, lref);
    FL_REQUIRE_OK(fl_model_backward_s2s(m));
    grads_vs(m, &y, dir, gh, rf);
    free(gh), free(rf);
    close_case(&c);
    fl_st_close(&y);
}
FL_TEST(t5_relu_dropout_vs_transformers) { check_dropout("tests/fixtures/t5-tiny-relu"); }
FL_TEST(t5_gated_dropout_vs_transformers) { check_dropout("tests/fixtures/t5-tiny-gated"); }

/* 5 AdamW steps on the same batch (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter, as
 * torch.optim.AdamW over model.parameters()): each step's loss against PyTorch fp32's, the weights after against the
 * float64 run within 4 x PyTorch fp32's own distance to it (tests/test_model.c's golden rule: the distance of the
 * worst element scaled by the tensor's max; elements with 0 < |grad| < 1e-4 x their tensor's max move by +-lr on
 * noise in any precision and are held to Adam's bound only, at most 2% of them); the same steps at lr x 1.01 must
 * land over 10x that bar, so the check can fail. (At lr 1e-2 the ReLU variant's trajectory is fragile: the CPU
 * backend's GEMM rounding leaves the loss 3e-6 off PyTorch's at step 2 and 1e-3 off at step 5, the ref backend's
 * stays within 4e-7, PyTorch fp32's within 1e-7 of float64: a ReLU unit near its kink; the gated variant tracks.) */
/* 5 AdamW steps of c's model at lr (l5: PyTorch fp32's losses to check each step's against, or NULL) */
static void adam_steps(t5_case *c, const char *dir, float lr, const fl_st_tensor *l5) {
    fl_model *m = &c->m;
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.lr = lr, oc.beta1 = 0.9f, oc.beta2 = 0.95f, oc.eps = 1e-8f, oc.weight_decay = 0.1f;
    fl_optimizer o;
    FL_REQUIRE_OK(fl_optim_init(&o, m, &oc));
    for (int k = 0; k < 5; k++) {
        double loss;
        fl_model_zero_grads(m);
        FL_REQUIRE_OK(forward(c, 1.0f / (float)c->n_valid, NULL, &loss));
        const double rl = l5 ? ((const float *)l5->data)[k] : loss;
        FL_CHECKF(fabs(loss - rl) <= 1e-5 * fabs(rl), "%s: step %d loss %.8f vs PyTorch fp32 %.8f", dir, k + 1, loss, rl);
        if (l5 && getenv("FL_TEST_VERBOSE")) printf("      step %d: loss %.9f, PyTorch fp32 %.9f\n", k + 1, loss, rl);
        FL_REQUIRE_OK(fl_model_backward_s2s(m));
        FL_REQUIRE_OK(fl_optim_step(&o, oc.lr, 0.0f, NULL));
    }
    fl_optim_free(&o);
}

/* tensor i's weights on the host */
static void weights_host(t5_case *c, int i, float *w) {
    const fl_param_info *p = &c->m.layout.params[i];
    FL_REQUIRE_OK(c->be.to_host(&c->be, w, fl_model_params_f32(&c->m) + fl_model_store_off(&c->m, i),
                                p->numel * sizeof(float)));
}

static void check_adam(const char *dir) {
    t5_case c, cm; /* cm: the mutant, the same steps at lr x 1.01 (a wrong bias correction or schedule is worse) */
    FL_REQUIRE_OK(open_case(&c, dir));
    FL_REQUIRE_OK(open_case(&cm, dir));
    fl_model *m = &c.m;
    const fl_st_tensor *l5 = fl_st_find(&c.x, "loss5");
    FL_REQUIRE(l5 && l5->shape[0] == 5);
    const float lr = 1e-3f;
    adam_steps(&c, dir, lr, l5);
    adam_steps(&cm, dir, lr * 1.01f, NULL);
    float *w = malloc(m->layout.numel * sizeof(float)), *g1 = malloc(m->layout.numel * sizeof(float)),
          *p32 = malloc(m->layout.numel * sizeof(float));
    double *r64 = malloc(m->layout.numel * sizeof(double)), *pe = calloc((size_t)m->layout.n, sizeof(double));
    FL_REQUIRE(w && g1 && p32 && r64 && pe);
    float *wm = malloc(m->layout.numel * sizeof(float));
    FL_REQUIRE(wm);
    double e_torch = 0, worst = 0, worst_mut = 0;
    size_t excluded = 0, total = 0;
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *p = &m->layout.params[i];
        const fl_st_tensor *t32 = ref_t(&c.x, "after5.", p->name), *t64 = ref_t(&c.x, "after5_f64.", p->name),
                           *tg = ref_t(&c.x, "grad.", p->name);
        FL_CHECKF(t32 && t64 && tg && t64->dtype == FL_F64, "%s: reference after5 / after5_f64 / grad of %s", dir, p->name);
        if (!t32 || !t64 || !tg || t64->dtype != FL_F64) continue;
        weights_host(&c, i, w);
        weights_host(&cm, i, wm);
        ours_from_ref(p, t32, p32);
        ours_from_ref(p, tg, g1);
        const double *d64 = t64->data;
        for (size_t k = 0; k < p->numel; k++) { /* transposed as ours_from_ref */
            size_t src = k;
            if (p->ndim == 2 && p->transposed_on_disk) src = (k % p->shape[1]) * p->shape[0] + k / p->shape[1];
            r64[k] = d64[src];
        }
        double gmax = 0, pmax = 0, d_ours = 0, d_torch = 0, d_mut = 0;
        for (size_t k = 0; k < p->numel; k++) gmax = fmax(gmax, fabs(g1[k])), pmax = fmax(pmax, fabs(r64[k]));
        for (size_t k = 0; k < p->numel; k++) {
            const double d = fabs((double)w[k] - r64[k]);
            total++;
            if (g1[k] != 0.0f && fabs(g1[k]) < 1e-4 * gmax) {
                excluded++;
                FL_CHECKF(d <= 5 * lr * (1 + 0.1 * 5 * lr), "%s: %s[%zu] moved beyond Adam's bound", dir, p->name, k);
                continue;
            }
            d_ours = fmax(d_ours, d);
            d_torch = fmax(d_torch, fabs((double)p32[k] - r64[k]));
            d_mut = fmax(d_mut, fabs((double)wm[k] - r64[k]));
        }
        const double sc = pmax > 0 ? pmax : 1;
        pe[i] = d_ours / sc;
        e_torch = fmax(e_torch, d_torch / sc);
        worst = fmax(worst, pe[i]);
        worst_mut = fmax(worst_mut, d_mut / sc);
    }
    FL_CHECKF(e_torch > 0, "%s: PyTorch fp32 is bit-identical to float64 after 5 steps (fixture broken?)", dir);
    for (int i = 0; i < m->layout.n; i++)
        FL_CHECKF(pe[i] <= 4 * e_torch, "%s: %s after 5 AdamW steps: distance to float64 %.3g, over 4x PyTorch fp32's %.3g",
                  dir, m->layout.params[i].name, pe[i], e_torch);
    FL_CHECKF(excluded * 50 <= total, "%s: %zu of %zu elements have near-zero gradients", dir, excluded, total);
    FL_CHECKF(worst_mut > 10 * 4 * e_torch, "%s: lr off by 1%% lands at %.3g from float64, within 10x the bar %.3g", dir,
              worst_mut, 4 * e_torch);
    printf("      %s: after 5 AdamW steps, distance to float64: ours %.3g, PyTorch fp32 %.3g, lr off by 1%%: %.3g (%zu "
           "of %zu elements held to Adam's bound only)\n", dir, worst, e_torch, worst_mut, excluded, total);
    free(w), free(wm), free(g1), free(p32), free(r64), free(pe);
    close_case(&cm);
    close_case(&c);
}

FL_TEST(t5_relu_adamw_vs_transformers) { check_adam("tests/fixtures/t5-tiny-relu"); }
FL_TEST(t5_gated_adamw_vs_transformers) { check_adam("tests/fixtures/t5-tiny-gated"); }

/* A wrong op is far outside the bounds above: the relu variant without its head scaling, and either variant with
 * the source's padding mask ignored (the padded keys then take part in the encoder's and the cross-attention). */
FL_TEST(t5_variants_are_distinct) {
    const char *dirs[2] = {"tests/fixtures/t5-tiny-relu", "tests/fixtures/t5-tiny-gated"};
    for (int v = 0; v < 2; v++) {
        t5_case c;
        FL_REQUIRE_OK(open_case(&c, dirs[v]));
        const fl_st_tensor *rl = fl_st_find(&c.x, "logits");
        const size_t nl = (size_t)c.B * c.Tt * c.m.cfg.vocab_size;
        float *lg = malloc(nl * sizeof(float));
        FL_REQUIRE(lg && rl);
        for (int mut = 0; mut < 2; mut++) {
            if (mut == 0 && v == 1) continue;
            if (mut == 0) c.m.cfg.head_scale = 0;
            FL_REQUIRE_OK(fl_model_forward_s2s(&c.m, c.src->data, mut == 1 ? NULL : c.mask->data, c.dec->data, NULL,
                                               c.B, c.Ts, c.Tt, 0, lg));
            c.m.cfg.head_scale = v == 0;
            double e = 0;
            for (size_t i = 0; i < nl; i++) e = fmax(e, fabs((double)lg[i] - ((const float *)rl->data)[i]));
            FL_CHECKF(e > 0.1, "%s: %s moves the logits by only %.3g", dirs[v], mut ? "no mask" : "no head scaling", e);
            printf("      %s: %s: logits off by %.2g\n", dirs[v], mut ? "mask ignored" : "head unscaled", e);
        }
        free(lg);
        close_case(&c);
    }
}

/* config.json's variants, the checks that mix them, presets, and the folder written back in the same names */
static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    FL_REQUIRE(f);
    fputs(text, f);
    fclose(f);
}

FL_TEST(t5_config_keys_and_refusals) {
    fl_model_config c;
    FL_REQUIRE_OK(fl_hf_load_config("tests/fixtures/t5-tiny-relu/config.json", &c));
    FL_CHECK(c.arch == FL_ARCH_T5 && c.n_layers == 2 && c.n_dec_layers == 3 && c.head_dim == 10 && c.n_heads == 3 &&
             c.ffn_dim == 52 && !c.ffn_gated && c.tie_embeddings && c.head_scale && c.rel_buckets == 8 &&
             c.rel_max_dist == 20 && c.dec_start_id == 0 && c.eos_id == 1 && fabsf(c.norm_eps - 1e-6f) < 1e-12f);
    FL_REQUIRE_OK(fl_hf_load_config("tests/fixtures/t5-tiny-gated/config.json", &c));
    FL_CHECK(c.ffn_gated && !c.tie_embeddings && !c.head_scale);
    const char *base = "\"model_type\": \"t5\", \"d_model\": 8, \"d_kv\": 4, \"d_ff\": 12, \"num_layers\": 1, "
                       "\"num_heads\": 2, \"vocab_size\": 10";
    const struct { const char *extra, *msg; fl_status st; } bad[] = {
        {"\"feed_forward_proj\": \"gated-gelu\", \"is_gated_act\": false", "'is_gated_act' = false contradicts", FL_ERR_FORMAT},
        {"\"feed_forward_proj\": \"relu\", \"is_gated_act\": true", "'is_gated_act' = true contradicts", FL_ERR_FORMAT},
        {"\"feed_forward_proj\": \"gated-gelu\", \"dense_act_fn\": \"relu\"", "'dense_act_fn' = 'relu' contradicts",
         FL_ERR_FORMAT},
        {"\"feed_forward_proj\": \"gated-silu\"", "'feed_forward_proj' = 'gated-silu' is not supported", FL_ERR_UNSUPPORTED},
        {"\"num_decoder_layers\": 0", "num_decoder_layers", FL_ERR_FORMAT},
        {"\"relative_attention_num_buckets\": 1", "relative_attention_num_buckets", FL_ERR_FORMAT},
    };
    char path[512], text[1024];
    snprintf(path, sizeof path, "%s/t5-bad.json", fl_test_tmpdir());
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(text, sizeof text, "{%s, %s}", base, bad[i].extra);
        write_text(path, text);
        const fl_status s = fl_hf_load_config(path, &c);
        FL_CHECKF(s == bad[i].st && strstr(fl_error_message(), bad[i].msg), "%s: got %d '%s'", bad[i].extra, (int)s,
                  fl_error_message());
    }
    /* the presets: real shapes */
    FL_REQUIRE_OK(fl_preset_find("google/flan-t5-xxl", &c));
    FL_CHECK(c.arch == FL_ARCH_T5 && c.dim == 4096 && c.n_heads == 64 && c.ffn_dim == 10240 && c.n_layers == 24 &&
             c.n_dec_layers == 24 && c.ffn_gated && !c.tie_embeddings);
    FL_CHECKF(fl_sizing_param_count(&c) == 11135332352ull, "flan-t5-xxl: %zu parameters", fl_sizing_param_count(&c));
    FL_REQUIRE_OK(fl_preset_find("google-t5/t5-small", &c));
    FL_CHECKF(fl_sizing_param_count(&c) == 60506624ull, "t5-small: %zu parameters", fl_sizing_param_count(&c));
    FL_REQUIRE_OK(fl_preset_find("t5-micro", &c));
}

/* a folder missing a relative bias table, and one whose FFN tensors are the other variant's, are refused naming the
 * tensor; the model written back loads with the same loss */
FL_TEST(t5_weights_refusals_and_round_trip) {
    t5_case c;
    FL_REQUIRE_OK(open_case(&c, "tests/fixtures/t5-tiny-relu"));
    double l0, l1;
    FL_REQUIRE_OK(forward(&c, 0, NULL, &l0));
    char dir[512], p[1600];
    save_reload(&c, "t5-saved", 0, dir, sizeof dir, &l1);
    FL_CHECK(c.m.cfg.head_scale && c.m.cfg.tie_embeddings && !c.m.cfg.ffn_gated && c.m.cfg.n_dec_layers == 3);
    FL_CHECKF(l0 == l1, "saved and reloaded: loss %.9f vs %.9f", l1, l0);
    /* the saved tensors minus the encoder's relative bias table */
    fl_st_file f;
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    FL_REQUIRE_OK(fl_st_open(&f, p));
    fl_st_write_tensor *t = calloc((size_t)f.n_tensors, sizeof *t);
    FL_REQUIRE(t);
    int n = 0;
    for (int i = 0; i < f.n_tensors; i++) {
        const fl_st_tensor *s = &f.tensors[i];
        if (strstr(s->name, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias")) continue;
        t[n].name = s->name, t[n].dtype = s->dtype, t[n].src_dtype = s->dtype, t[n].ndim = s->ndim, t[n].data = s->data;
        for (int d = 0; d < s->ndim; d++) t[n].shape[d] = s->shape[d];
        n++;
    }
    char dir2[512];
    snprintf(dir2, sizeof dir2, "%s/t5-nobias", fl_test_tmpdir());
    snprintf(p, sizeof p, "mkdir -p %s && cp %s/config.json %s/", dir2, dir, dir2);
    FL_REQUIRE(system(p) == 0);
    snprintf(p, sizeof p, "%s/model.safetensors", dir2);
    FL_REQUIRE_OK(fl_st_write(p, t, n, NULL, NULL, 0));
    fl_model m3;
    fl_status s = fl_hf_load_model(&m3, dir2, &c.be, &c.pool);
    FL_CHECKF(s == FL_ERR_FORMAT && /* a malformed model folder: exit 1 */
                  strstr(fl_error_message(), "'encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight'"),
              "missing bias table: %d '%s'", (int)s, fl_error_message());
    /* the relu folder read as the gated variant: wi is not a tensor of that model */
    snprintf(p, sizeof p, "sed -i 's/\"feed_forward_proj\": \"relu\"/\"feed_forward_proj\": \"gated-gelu\"/; "
                          "s/\"dense_act_fn\": \"relu\"/\"dense_act_fn\": \"gelu_new\"/; "
                          "s/\"is_gated_act\": false/\"is_gated_act\": true/' %s/config.json", dir);
    FL_REQUIRE(system(p) == 0);
    s = fl_hf_load_model(&m3, dir, &c.be, &c.pool);
    FL_CHECKF(s != FL_OK && strstr(fl_error_message(), "DenseReluDense.wi"), "gated config, relu tensors: %d '%s'", (int)s,
              fl_error_message());
    free(t);
    fl_st_close(&f);
    close_case(&c);
}

/* Activation checkpointing on both stacks: each stack keeps its blocks' inputs and one block's slots, recomputed in
 * the backward (all but each stack's last block): the same loss and every gradient bit for bit, in less ACTS. */
FL_TEST(t5_checkpointing_same_bits) {
    t5_case c[2];
    for (int k = 0; k < 2; k++) FL_REQUIRE_OK(open_case_ex(&c[k], "tests/fixtures/t5-tiny-gated", k, 0));
    double loss[2];
    float *g[2];
    for (int k = 0; k < 2; k++) {
        fl_model_zero_grads(&c[k].m);
        FL_REQUIRE_OK(forward(&c[k], 1.0f / (float)c[k].n_valid, NULL, &loss[k]));
        FL_REQUIRE_OK(fl_model_backward_s2s(&c[k].m));
        g[k] = malloc(c[k].m.layout.numel * sizeof(float));
        FL_REQUIRE(g[k]);
        FL_REQUIRE_OK(c[k].be.to_host(&c[k].be, g[k], fl_model_grads_f32(&c[k].m), c[k].m.layout.numel * sizeof(float)));
    }
    const fl_model_config *cf = &c[1].m.cfg;
    FL_CHECKF(c[1].m.ckpt_recomputed == cf->n_layers - 1 + cf->n_dec_layers - 1, "%d blocks recomputed",
              c[1].m.ckpt_recomputed);
    FL_CHECK(loss[0] == loss[1] && memcmp(g[0], g[1], c[0].m.layout.numel * sizeof(float)) == 0);
    FL_CHECKF(c[1].m.sizes.acts_bytes < c[0].m.sizes.acts_bytes, "ACTS %zu with checkpointing, %zu without",
              c[1].m.sizes.acts_bytes, c[0].m.sizes.acts_bytes);
    printf("      ACTS %zu -> %zu bytes with checkpointing, gradients identical\n", c[0].m.sizes.acts_bytes,
           c[1].m.sizes.acts_bytes);
    for (int k = 0; k < 2; k++) free(g[k]), close_case(&c[k]);
}

/* The training step's two forward phases (src/train/step.c): fl_model_forward_s2s_body then fl_model_forward_head,
 * and the one backward fl_model_backward, give the bits of fl_model_forward_s2s + fl_model_backward_s2s (logits,
 * loss, every gradient); the head without a body before it, or twice, is refused. */
FL_TEST(t5_step_phases_same_bits) {
    t5_case c;
    FL_REQUIRE_OK(open_case(&c, "tests/fixtures/t5-tiny-gated"));
    fl_model *m = &c.m;
    const size_t nl = (size_t)c.B * c.Tt * m->cfg.vocab_size, np = m->layout.numel;
    float *lg[2] = {malloc(nl * sizeof(float)), malloc(nl * sizeof(float))};
    float *g[2] = {malloc(np * sizeof(float)), malloc(np * sizeof(float))};
    FL_REQUIRE(lg[0] && lg[1] && g[0] && g[1]);
    double loss[2];
    const float gs = 1.0f / (float)c.n_valid;
    FL_CHECK(fl_model_forward_head(m, NULL) == FL_ERR_INVALID && strstr(fl_error_message(), "fl_model_forward_s2s_body"));
    for (int k = 0; k < 2; k++) {
        fl_model_zero_grads(m);
        if (k == 0) {
            FL_REQUIRE_OK(fl_model_forward_s2s(m, c.src->data, c.mask->data, c.dec->data, c.labels->data, c.B, c.Ts,
                                               c.Tt, gs, lg[k]));
            FL_REQUIRE_OK(fl_model_backward_s2s(m));
        } else {
            FL_REQUIRE_OK(fl_model_forward_s2s_body(m, c.src->data, c.mask->data, c.dec->data, c.labels->data, c.B,
                                                    c.Ts, c.Tt, gs));
            FL_CHECK(fl_model_backward(m) == FL_ERR_INVALID); /* its head has not run: no training forward yet */
            FL_REQUIRE_OK(fl_model_forward_head(m, lg[k]));
            FL_CHECK(fl_model_forward_head(m, NULL) == FL_ERR_INVALID); /* one head per body */
            FL_REQUIRE_OK(fl_model_backward(m));
        }
        loss[k] = m->loss_sum;
        FL_REQUIRE_OK(c.be.to_host(&c.be, g[k], fl_model_grads_f32(m), np * sizeof(float)));
    }
    FL_CHECKF(loss[0] == loss[1], "loss %.9g (one call) vs %.9g (two phases)", loss[0], loss[1]);
    FL_CHECK(memcmp(lg[0], lg[1], nl * sizeof(float)) == 0 && memcmp(g[0], g[1], np * sizeof(float)) == 0);
    for (int k = 0; k < 2; k++) free(lg[k]), free(g[k]);
    close_case(&c);
}

/* Greedy decoding against transformers' generate(do_sample=False, max_new_tokens=12) of each source sequence (the
 * second with its padding masked), with the KV cache and without: the same ids (the relu model's are degenerate
 * repeats, the gated model's vary: a wrong cache would part from them). */
static void check_generate(const char *dir) {
    t5_case c;
    FL_REQUIRE_OK(open_case(&c, dir));
    for (int b = 0; b < c.B; b++) {
        char key[16];
        snprintf(key, sizeof key, "gen%d", b);
        const fl_st_tensor *g = fl_st_find(&c.x, key);
        FL_REQUIRE(g && g->ndim == 1);
        for (int cache = 0; cache < 2; cache++) {
            int32_t out[32];
            int n = 0;
            FL_REQUIRE_OK(fl_model_generate_s2s(&c.m, (const int32_t *)c.src->data + b * c.Ts,
                                                (const uint8_t *)c.mask->data + b * c.Ts, c.Ts, 12, cache, out, &n));
            FL_CHECKF(n == (int)g->shape[0], "%s: sequence %d (cache %d): %d ids, want %d", dir, b, cache, n,
                      (int)g->shape[0]);
            for (int i = 0; i < n && i < (int)g->shape[0]; i++)
                FL_CHECKF(out[i] == ((const int32_t *)g->data)[i], "%s: sequence %d (cache %d) token %d: %d, want %d", dir,
                          b, cache, i, out[i], ((const int32_t *)g->data)[i]);
        }
    }
    close_case(&c);
}

FL_TEST(t5_relu_greedy_vs_generate) { check_generate("tests/fixtures/t5-tiny-relu"); }
FL_TEST(t5_gated_greedy_vs_generate) { check_generate("tests/fixtures/t5-tiny-gated"); }

/* Sharded folders (model.safetensors.index.json) load as one; bad input is refused by name: a source longer than
 * the arena's limit, ids outside the vocabulary, a backward without a training forward. */
FL_TEST(t5_sharded_and_bad_input) {
    t5_case c;
    FL_REQUIRE_OK(open_case(&c, "tests/fixtures/t5-tiny-gated"));
    double l0, l1;
    FL_REQUIRE_OK(forward(&c, 0, NULL, &l0));
    char dir[512], p[600];
    save_reload(&c, "t5-shards", 40000, dir, sizeof dir, &l1); /* ~7 shards of the 288 kB model */
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(p, "r");
    FL_CHECKF(f != NULL, "no %s", p);
    if (f) fclose(f);
    FL_CHECKF(l0 == l1, "sharded: loss %.9f vs %.9f", l1, l0);
    /* a source longer than the arena's */
    fl_status s = fl_model_forward_s2s(&c.m, c.src->data, NULL, c.dec->data, NULL, 1, c.Ts + 1, c.Tt, 0, NULL);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "source 14"), "%d '%s'", (int)s, fl_error_message());
    int32_t bad[13];
    memcpy(bad, c.src->data, sizeof bad);
    bad[4] = 97;
    s = fl_model_forward_s2s(&c.m, bad, NULL, c.dec->data, NULL, 1, c.Ts, c.Tt, 0, NULL);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "source token id 97 at position 4"), "'%s'",
              fl_error_message());
    s = fl_model_backward_s2s(&c.m);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "training forward"), "'%s'", fl_error_message());
    /* the decoder-only entry points refuse an encoder-decoder */
    FL_CHECK(fl_model_forward(&c.m, c.src->data, NULL, 1, c.Ts, 0, NULL) == FL_ERR_UNSUPPORTED &&
             strstr(fl_error_message(), "fl_model_forward_s2s"));
    close_case(&c);
}

/* LoRA on every linear of the gated model under PEFT's T5 names (q, k, v, o match the self-attention of both
 * stacks and the decoder's cross-attention, whose k and v are rows of the fused k|v of the encoder output), r 4,
 * alpha 8, against PEFT 0.21.2 with the same A and B (tests/ref/make_t5_fixture.py, expected-lora.safetensors):
 * logits, loss and every adapter gradient within the bounds of t5_*_vs_transformers (8 x PyTorch fp32's distance to
 * float64 + 16 roundings of the scale); the base is frozen (no base gradients). */
FL_TEST(t5_lora_vs_peft) {
    const char *dir = "tests/fixtures/t5-tiny-gated";
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model(&m, dir, &be, &pool));
    fl_st_file x, y;
    FL_REQUIRE_OK(fl_st_open(&x, "tests/fixtures/t5-tiny-gated/expected.safetensors"));
    FL_REQUIRE_OK(fl_st_open(&y, "tests/fixtures/t5-tiny-gated/expected-lora.safetensors"));
    fl_lora_config lc;
    FL_REQUIRE_OK(fl_lora_config_init(&lc, &m.cfg, 4, 8.0f, 0.0f, 0, "q,k,v,o,wi_0,wi_1,wo"));
    FL_REQUIRE_OK(fl_model_lora_init(&m, &lc, 1));
    fl_lora_adapters v;
    FL_REQUIRE(fl_model_lora_adapters(&m, &v));
    FL_CHECKF(v.n_mods == 2 * 7 + 3 * 11, "%d modules", v.n_mods);
    for (int j = 0; j < v.n_mods; j++) { /* PEFT's A and B */
        const fl_st_tensor *A = ref_t(&y, "A.", v.mods[j].name), *Bt = ref_t(&y, "B.", v.mods[j].name);
        FL_REQUIRE(A && Bt);
        const size_t na = (size_t)v.cfg->r * v.mods[j].in, nb = (size_t)v.mods[j].out * v.cfg->r;
        FL_REQUIRE((size_t)(A->end - A->begin) == na * 4 && (size_t)(Bt->end - Bt->begin) == nb * 4);
        FL_REQUIRE_OK(be.to_device(&be, v.params + v.off[2 * j], A->data, na * 4));
        FL_REQUIRE_OK(be.to_device(&be, v.params + v.off[2 * j + 1], Bt->data, nb * 4));
    }
    const fl_st_tensor *src = fl_st_find(&x, "src"), *mask = fl_st_find(&x, "src_mask"), *dec = fl_st_find(&x, "dec"),
                       *lab = fl_st_find(&x, "labels");
    FL_REQUIRE(src && mask && dec && lab);
    const int B = (int)src->shape[0], Ts = (int)src->shape[1], Tt = (int)dec->shape[1];
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&m, B, Ts, Tt));
    const size_t nl = (size_t)B * Tt * m.cfg.vocab_size;
    float *lg = malloc(nl * sizeof(float)), *g = malloc(v.numel * sizeof(float));
    FL_REQUIRE(lg && g);
    FL_CHECK(fl_model_grads_f32(&m) == NULL); /* the base is frozen */
    fl_model_zero_grads(&m);
    FL_REQUIRE_OK(fl_model_forward_s2s(&m, src->data, mask->data, dec->data, lab->data, B, Ts, Tt, 1.0f / (B * Tt - 4), lg));
    FL_REQUIRE_OK(fl_model_backward_s2s(&m));
    const double loss = m.loss_sum / (double)m.n_valid, lref = ((const double *)fl_st_find(&y, "loss")->data)[0];
    FL_CHECKF(fabs(loss - lref) <= bound(fl_st_find(&y, "noise.loss"), lref), "loss %.9f vs PEFT %.9f", loss, lref);
    const fl_st_tensor *rl = fl_st_find(&y, "logits"), *nlg = fl_st_find(&y, "noise.logits");
    double e = 0, sc = 0;
    for (size_t i = 0; i < nl; i++)
        e = fmax(e, fabs((double)lg[i] - ((const float *)rl->data)[i])), sc = fmax(sc, fabs(((const float *)rl->data)[i]));
    FL_CHECKF(e <= bound(nlg, sc), "logits error %.3g, bound %.3g", e, bound(nlg, sc));
    FL_REQUIRE_OK(be.to_host(&be, g, v.grads, v.numel * sizeof(float)));
    double worst = 0;
    for (int j = 0; j < v.n_mods; j++)
        for (int ab = 0; ab < 2; ab++) {
            char key[160];
            snprintf(key, sizeof key, "noise.%s", ab ? "gB." : "gA.");
            const fl_st_tensor *r = ref_t(&y, ab ? "gB." : "gA.", v.mods[j].name), *nz = ref_t(&y, key, v.mods[j].name);
            FL_REQUIRE(r && nz);
            const size_t n = (size_t)(r->end - r->begin) / 4;
            const float *ours = g + v.off[2 * j + ab];
            double ge = 0, s = 0;
            for (size_t k = 0; k < n; k++)
                ge = fmax(ge, fabs((double)ours[k] - ((const float *)r->data)[k])), s = fmax(s, fabs(((const float *)r->data)[k]));
            FL_CHECKF(ge <= bound(nz, s), "%s of %s: error %.3g, bound %.3g", ab ? "dB" : "dA", v.mods[j].name, ge,
                      bound(nz, s));
            worst = fmax(worst, ge / bound(nz, s));
        }
    printf("      LoRA (%d modules): logits error %.2g (bound %.2g), loss %.8f (PEFT %.8f), %d gradients at worst %.2f of "
           "their bounds\n", v.n_mods, e, bound(nlg, sc), loss, lref, 2 * v.n_mods, worst);
    /* merged into the weights and saved, the folder gives the same loss (within fp32 roundings of W + s B A) */
    FL_REQUIRE_OK(fl_model_lora_merge(&m));
    FL_CHECK(fl_model_forward_s2s(&m, src->data, mask->data, dec->data, lab->data, B, Ts, Tt, 0, NULL) == FL_ERR_INVALID);
    char sdir[512];
    snprintf(sdir, sizeof sdir, "%s/t5-merged", fl_test_tmpdir());
    FL_REQUIRE_OK(fl_hf_save_model(&m, sdir));
    fl_model mm;
    FL_REQUIRE_OK(fl_hf_load_model(&mm, sdir, &be, &pool));
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&mm, B, Ts, Tt));
    FL_REQUIRE_OK(fl_model_forward_s2s(&mm, src->data, mask->data, dec->data, lab->data, B, Ts, Tt, 0, NULL));
    const double lm = mm.loss_sum / (double)mm.n_valid;
    FL_CHECKF(fabs(lm - lref) <= bound(fl_st_find(&y, "noise.loss"), lref), "merged: loss %.9f vs PEFT %.9f", lm, lref);
    fl_model_free(&mm);
    free(lg), free(g);
    fl_st_close(&x), fl_st_close(&y);
    fl_model_free(&m);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}
