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
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/blip2.h"
#include "core/fs.h"
#include "fitllm/io.h"
#include "fitllm/train.h"
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

/* drop >= 0: every dropout rate of the three parts set to it and dropout on (fl_blip2_set_dropout) before the arena */
static fl_status open_case_drop(b2_case *c, float drop) {
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
    for (int k = 0; drop >= 0 && k < FL_BLIP2_PARTS; k++) {
        fl_model_config *mc = &fl_blip2_part(c->b, k)->cfg;
        mc->dropout_rate = k == FL_BLIP2_VISION ? 0.0f : drop; /* the vision tower drops its attention weights only */
        mc->attn_dropout_rate = drop;
    }
    if (drop >= 0) FL_TRY(fl_blip2_set_dropout(c->b, 1));
    return fl_blip2_alloc_acts(c->b, c->B, c->T);
}

static fl_status open_case(b2_case *c) { return open_case_drop(c, -1.0f); }

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

/* max |ours - ref| of n floats (ours on the host) and the reference's scale */
static double host_err(const float *h, const fl_st_tensor *r, size_t n, double *scale) {
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        e = fmax(e, fabs((double)h[i] - ((const float *)r->data)[i]));
        s = fmax(s, fabs(((const float *)r->data)[i]));
    }
    *scale = s;
    return e;
}

/* the same with ours on the device */
static double dev_err(const fl_backend *be, const float *dev, const fl_st_tensor *r, size_t n, double *scale) {
    float *h = malloc(n * sizeof *h);
    be->to_host(be, h, dev, n * sizeof *h);
    const double e = host_err(h, r, n, scale);
    free(h);
    return e;
}

/* Every part's gradient against the fixture's grad.<HF name> (the language model's under language_model.; an entry
 * stored transposed, T5's relative bias tables, compared in the file's orientation), within its bound; returns how
 * many were checked, *worst the largest error over its bound. */
static int check_grads(fl_blip2 *b, const fl_backend *be, const fl_st_file *x, double *worst) {
    int checked = 0;
    *worst = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        const fl_model *m = fl_blip2_part(b, k);
        for (int i = 0; i < m->layout.n; i++) {
            const fl_param_info *p = &m->layout.params[i];
            char gk[200], nk[208];
            snprintf(gk, sizeof gk, "grad.%s%s", k == FL_BLIP2_TEXT ? "language_model." : "", p->name);
            snprintf(nk, sizeof nk, "noise.%s", gk + 5);
            const fl_st_tensor *g = fl_st_find(x, gk), *gn = fl_st_find(x, nk);
            FL_CHECKF(g && gn && (size_t)(g->end - g->begin) == p->numel * 4, "reference gradient of %s", gk);
            if (!g || !gn) continue;
            float *h = malloc(p->numel * sizeof *h), *t = malloc(p->numel * sizeof *t);
            FL_REQUIRE_R(h && t, checked);
            be->to_host(be, h, fl_model_grads_f32(m) + p->offset, p->numel * sizeof *h);
            const int64_t r = p->shape[0], c = p->ndim == 2 ? p->shape[1] : 1;
            for (int64_t a = 0; a < r; a++) /* ours (r, c) as the file's (c, r) */
                for (int64_t j = 0; p->ndim == 2 && p->transposed_on_disk && j < c; j++) t[j * r + a] = h[a * c + j];
            double sc, ge = host_err(p->ndim == 2 && p->transposed_on_disk ? t : h, g, p->numel, &sc);
            FL_CHECKF(ge <= bound(gn, sc), "gradient of %s: error %.3g, bound %.3g (PyTorch fp32 %.3g, scale %.3g)",
                      gk + 5, ge, bound(gn, sc), f32_at(gn), sc);
            *worst = fmax(*worst, ge / bound(gn, sc));
            checked++;
            free(h), free(t);
        }
    }
    return checked;
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
    double sc, e = host_err(lg, rl, nl, &sc);
    FL_CHECKF(e <= bound(nlg, sc), "logits error %.3g, bound %.3g", e, bound(nlg, sc));
    const double lref = ((const double *)rloss->data)[0];
    FL_CHECKF(fabs(loss - lref) <= bound(nloss, lref), "loss %.9f vs %.9f", (double)loss, lref);
    printf("      logits error %.2g (PyTorch fp32 %.2g, bound %.2g), loss %.8f (ref %.8f)\n", e, f32_at(nlg),
           bound(nlg, sc), (double)loss, lref);
    FL_REQUIRE_OK(fl_blip2_backward(b));
    double worst;
    const int checked = check_grads(b, &c.be, &c.x, &worst);
    int total = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) total += fl_blip2_part(b, k)->layout.n;
    FL_CHECK(checked == total && total == 139);
    printf("      %d gradients, worst error %.2f of its bound\n", checked, worst);
    free(lg);
    close_case(&c);
}

/* Dropout in every part of the OPT variant (fl_blip2_set_dropout, the micro-batch seed of fl_model_adapters_seed on the
 * language model) against transformers in training mode with fitllm's masks (tests/ref/
 * make_blip2_opt_dropout_fixture.py: expected-dropout.safetensors, p 0.2 at every site: the vision tower's attention
 * weights; the Q-Former's embedding norm output, attention weights and dense outputs; OPT's attention weights and
 * sublayer outputs): the loss and all 139 gradients within 8x PyTorch's fp32 noise, as blip2_opt_vs_transformers; the
 * loss is far from the one without dropout. An evaluation forward (grad_scale 0) drops nothing: the logits' bits of
 * the model without dropout. */
FL_TEST(blip2_opt_dropout_vs_transformers) {
    fl_st_file y;
    FL_REQUIRE_OK(fl_st_open(&y, FIX "/expected-dropout.safetensors"));
    const fl_st_tensor *rloss = fl_st_find(&y, "loss"), *nloss = fl_st_find(&y, "noise.loss");
    const fl_st_tensor *seed = fl_st_find(&y, "seed"), *p = fl_st_find(&y, "p");
    FL_REQUIRE(rloss && nloss && seed && p);
    b2_case c, c0;
    FL_REQUIRE_OK(open_case_drop(&c, f32_at(p)));
    FL_REQUIRE_OK(open_case(&c0));
    fl_blip2 *b = c.b;
    fl_model_adapters_seed(fl_blip2_part(b, FL_BLIP2_TEXT), (uint64_t)((const int64_t *)seed->data)[0]);
    float loss, l0;
    FL_REQUIRE_OK(forward(&c, 1.0f / (float)c.n_valid, NULL, &loss));
    const double lref = ((const double *)rloss->data)[0], lnone = ((const double *)fl_st_find(&c.x, "loss")->data)[0];
    FL_CHECKF(fabs(loss - lref) <= bound(nloss, lref) && fabs(lref - lnone) > 100 * bound(nloss, lref),
              "loss %.9f vs %.9f (without dropout %.9f)", (double)loss, lref, lnone);
    FL_REQUIRE_OK(fl_blip2_backward(b));
    double worst;
    const int checked = check_grads(b, &c.be, &y, &worst);
    FL_CHECK(checked == 139);
    printf("      p %.2f: loss %.8f (ref %.8f, without dropout %.8f); %d gradients, worst error %.2f of its bound\n",
           (double)f32_at(p), (double)loss, lref, lnone, checked, worst);
    /* evaluation: no dropout, the bits of the model without it */
    const size_t nl = (size_t)c.B * c.T * b->cfg.text.vocab_size;
    float *lg = malloc(nl * sizeof *lg), *lg0 = malloc(nl * sizeof *lg0);
    FL_REQUIRE(lg && lg0);
    FL_REQUIRE_OK(forward(&c, 0, lg, &loss));
    FL_REQUIRE_OK(forward(&c0, 0, lg0, &l0));
    FL_CHECK(memcmp(lg, lg0, nl * sizeof *lg) == 0 && loss == l0);
    free(lg), free(lg0);
    close_case(&c0);
    close_case(&c);
    fl_st_close(&y);
}

/* Greedy captions = transformers' generate(do_sample=False, max_new_tokens=8) of each image, and of image 0 with a
 * prompt after BOS. */
FL_TEST(blip2_generate_vs_transformers) {
    b2_case c;
    FL_REQUIRE_OK(open_case(&c));
    const size_t img = (size_t)3 * 12 * 12;
    static const char *const keys[] = {"gen0", "gen1", "genp0"};
    const int32_t prompt[] = {17, 29, 31};
    for (int k = 0; k < 3; k++) {
        const fl_st_tensor *r = fl_st_find(&c.x, keys[k]);
        FL_REQUIRE(r);
        int32_t out[8];
        int n = 0;
        FL_REQUIRE_OK(fl_blip2_generate(c.b, (const float *)c.pixels->data + (k == 1 ? img : 0), k == 2 ? prompt : NULL,
                                        k == 2 ? 3 : 0, 8, out, &n, NULL));
        const int nr = (int)r->shape[0];
        int same = n == nr;
        for (int i = 0; same && i < n; i++) same = out[i] == ((const int32_t *)r->data)[i];
        FL_CHECKF(same, "%s: %d tokens, first %d (reference %d tokens, first %d)", keys[k], n, n ? out[0] : -1, nr,
                  nr ? ((const int32_t *)r->data)[0] : -1);
    }
    close_case(&c);
}

/* Central finite differences of the loss (in double over the fp32 forward) for the new ops' parameters: the class
 * token, a position row the patches read, the patch weight and bias, a query token, the language projection, and
 * the language model's position of a query row (its gradient comes from the injected rows). Loss ~5.4, fp32 noise
 * ~1e-6, step 1e-2: the quotient carries ~1e-4 of rounding plus O(h^2) truncation; 3e-4 + 2e-2 |g| separates it
 * from a wrong gradient (these entries' gradients are ~1e-3 to 1e-1). */
FL_TEST(blip2_new_ops_finite_differences) {
    b2_case c;
    FL_REQUIRE_OK(open_case(&c));
    fl_blip2 *b = c.b;
    fl_blip2_zero_grads(b);
    float loss;
    FL_REQUIRE_OK(forward(&c, 1.0f / (float)c.n_valid, NULL, &loss));
    FL_REQUIRE_OK(fl_blip2_backward(b));
    const struct { int part, group, role; size_t k; } at[] = {
        {0, 0, FL_ROLE_CLS_EMBED, 5},       {0, 0, FL_ROLE_POS_EMBED, 3 * 24 + 7}, {0, 0, FL_ROLE_PATCH_W, 17},
        {0, 0, FL_ROLE_PATCH_B, 2},         {1, 0, FL_ROLE_QUERY_EMBED, 2 * 20 + 3}, {1, 4, FL_ROLE_LMPROJ_W, 33},
        {1, 4, FL_ROLE_LMPROJ_B, 4},        {2, 0, FL_ROLE_POS_EMBED, (2 + 3) * 28 + 1},
    };
    for (size_t j = 0; j < sizeof at / sizeof at[0]; j++) {
        fl_model *m = fl_blip2_part(b, at[j].part);
        const int ti = fl_layout_role(&m->layout, at[j].group, (fl_param_role)at[j].role);
        FL_REQUIRE(ti >= 0 && at[j].k < m->layout.params[ti].numel);
        float an, w0, wv;
        FL_REQUIRE_OK(c.be.to_host(&c.be, &an, fl_model_grads_f32(m) + m->layout.params[ti].offset + at[j].k, 4));
        float *w = fl_model_params_f32(m) + fl_model_store_off(m, ti) + at[j].k;
        FL_REQUIRE_OK(c.be.to_host(&c.be, &w0, w, sizeof w0));
        const float step = 1e-2f;
        double l[2];
        for (int s = 0; s < 2; s++) {
            wv = w0 + (s ? -step : step);
            FL_REQUIRE_OK(c.be.to_device(&c.be, w, &wv, sizeof wv));
            float ls;
            FL_REQUIRE_OK(forward(&c, 0, NULL, &ls));
            l[s] = ls;
        }
        FL_REQUIRE_OK(c.be.to_device(&c.be, w, &w0, sizeof w0));
        const double num = (l[0] - l[1]) / (2.0 * step);
        FL_CHECKF(fabs(num - an) <= 3e-4 + 2e-2 * fabs(an) && fabs(an) > 1e-4, "%s[%zu]: finite difference %.6g vs "
                  "backward %.6g", m->layout.params[ti].name, at[j].k, num, (double)an);
        if (getenv("FL_TEST_VERBOSE")) printf("      fd %s[%zu]: %.6g vs %.6g\n", m->layout.params[ti].name, at[j].k, num,
                                              (double)an);
    }
    close_case(&c);
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    FL_REQUIRE(f);
    FL_REQUIRE(fwrite(data, 1, n, f) == n);
    fclose(f);
}

/* the fixture folder with config.json's `from` replaced by `to` (the weights as they are) */
static const char *bad_folder(const char *from, const char *to) {
    static char dir[512];
    char path[600];
    snprintf(dir, sizeof dir, "%s/blip2-bad", fl_test_tmpdir());
    FL_REQUIRE_OK_R(fl_fs_mkdir_p(dir), NULL);
    size_t n, nc;
    char *w = fl_test_slurp(FIX "/model.safetensors", &n), *cfg = fl_test_slurp(FIX "/config.json", &nc);
    FL_REQUIRE_R(w && cfg, NULL);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    write_file(path, w, n);
    char *hit = strstr(cfg, from);
    FL_REQUIRE_R(hit, NULL);
    char *out = malloc(strlen(cfg) + strlen(to) + 1);
    FL_REQUIRE_R(out, NULL);
    sprintf(out, "%.*s%s%s", (int)(hit - cfg), cfg, to, hit + strlen(from));
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_file(path, out, strlen(out));
    free(w), free(cfg), free(out);
    return dir;
}

/* inconsistent config keys, missing and unexpected tensors, ids without the right placeholders: refused by name */
FL_TEST(blip2_refusals) {
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    const struct { const char *from, *to, *msg; } bad[] = {
        {"\"encoder_hidden_size\": 24", "\"encoder_hidden_size\": 26", "qformer_config.encoder_hidden_size' = 26"},
        {"\"hidden_act\": \"gelu\",\n    \"hidden_size\": 24", "\"hidden_act\": \"quick_gelu\",\n    \"hidden_size\": 24",
         "'vision_config.hidden_act' = 'quick_gelu' is not supported"},
        {"\"image_token_index\": 100", "\"image_token_index\": 103", "'image_token_index' = 103"},
        {"\"use_decoder_only_language_model\": true", "\"use_decoder_only_language_model\": false",
         "use_decoder_only_language_model"},
        {"\"patch_size\": 4", "\"patch_size\": 5", "vision_model.embeddings.patch_embedding.weight"},
        {"\"num_hidden_layers\": 3", "\"num_hidden_layers\": 4", "'qformer.encoder.layer.3.attention.attention.query.weight' "
         "not found"},
        {"\"num_hidden_layers\": 3", "\"num_hidden_layers\": 2", "unexpected tensor 'qformer.encoder.layer.2."},
        {"\"cross_attention_frequency\": 2", "\"cross_attention_frequency\": 1", "'qformer.encoder.layer.1.crossattention"},
        {"\"layer_norm_eps\": 1e-06", "\"layer_norm_eps\": 0", "'vision_config.layer_norm_eps' = 0 must be a positive"},
        {"\"layer_norm_eps\": 1e-12", "\"layer_norm_eps\": -1e-12", "'qformer_config.layer_norm_eps' = -1e-12 must be"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fl_blip2 *b = NULL;
        const fl_status s = fl_blip2_load(&b, bad_folder(bad[i].from, bad[i].to), &be, &pool);
        FL_CHECKF(s != FL_OK && strstr(fl_error_message(), bad[i].msg), "%s: got %d '%s'", bad[i].to, (int)s,
                  fl_error_message());
        fl_blip2_free(b);
    }
    /* the language model's ids need exactly num_query_tokens placeholders */
    fl_blip2 *b = NULL;
    FL_REQUIRE_OK(fl_blip2_load(&b, FIX, &be, &pool));
    FL_REQUIRE_OK(fl_blip2_alloc_acts(b, 1, 6));
    float px[3 * 12 * 12] = {0};
    const int32_t four[6] = {100, 100, 100, 100, 2, 7}, bad_id[6] = {100, 100, 100, 100, 100, 103};
    FL_CHECK(fl_blip2_forward(b, px, four, NULL, 1, 6, 0, NULL, NULL) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "4 image tokens (id 100), not num_query_tokens = 5"));
    FL_CHECK(fl_blip2_forward(b, px, bad_id, NULL, 1, 6, 0, NULL, NULL) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "token id 103"));
    FL_CHECK(fl_blip2_backward(b) == FL_ERR_INVALID);
    fl_blip2_free(b);
    /* presets: the real shapes (parameter counts as transformers' Blip2ForConditionalGeneration, the tied head once) */
    fl_blip2_config c;
    FL_REQUIRE_OK(fl_blip2_preset("Salesforce/blip2-opt-2.7b", &c));
    FL_CHECK(c.vision.dim == 1408 && c.vision.n_layers == 39 && c.vision.max_seq == 257 && c.qformer.n_layers == 12 &&
             c.n_queries == 32 && c.text.dim == 2560 && c.image_token == 50265);
    /* transformers' count on the meta device (Blip2Config defaults with OPT-2.7b's text_config): 3,744,679,936 */
    FL_CHECKF(fl_blip2_param_count(&c) == 3744679936ull, "blip2-opt-2.7b: %zu parameters", fl_blip2_param_count(&c));
    /* the Flan-T5 variants: transformers' count on the meta device (3,876,648,448 and 12,098,000,384) ties lm_head to
     * the shared table, as an in-memory T5Config always does in transformers 5; the checkpoints carry their own
     * lm_head (vocab 32128 x d_model more) */
    FL_REQUIRE_OK(fl_blip2_preset("Salesforce/blip2-flan-t5-xl", &c));
    FL_CHECKF(fl_blip2_param_count(&c) == 3876648448ull + 32128ull * 2048, "blip2-flan-t5-xl: %zu",
              fl_blip2_param_count(&c));
    FL_REQUIRE_OK(fl_blip2_preset("blip2-flan-t5-xxl", &c));
    FL_CHECKF(fl_blip2_param_count(&c) == 12098000384ull + 32128ull * 4096 && c.text.arch == FL_ARCH_T5 &&
              c.image_token == 32100, "blip2-flan-t5-xxl: %zu", fl_blip2_param_count(&c));
    FL_CHECK(fl_blip2_preset("blip2-nope", &c) == FL_ERR_NOT_FOUND);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* The Flan-T5 variant (tests/fixtures/blip2-tiny-t5: the same image parts, T5 v1.1 gated-GELU with its own lm_head;
 * B 2 x source 9 (5 placeholders, 4 prompt ids) x target 6, the second's last 2 labels ignored): logits, T5's loss,
 * all 169 gradients (the relative bias tables' stored transposed), greedy decoding = generate(do_sample=False). */
FL_TEST(blip2_t5_vs_transformers) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_blip2 *b = NULL;
    fl_st_file x;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    FL_REQUIRE_OK(fl_blip2_load(&b, "tests/fixtures/blip2-tiny-t5", &be, &pool));
    FL_REQUIRE_OK(fl_st_open(&x, "tests/fixtures/blip2-tiny-t5/expected.safetensors"));
    const fl_st_tensor *px = fl_st_find(&x, "pixels"), *ids = fl_st_find(&x, "ids"), *dec = fl_st_find(&x, "dec");
    const fl_st_tensor *lab = fl_st_find(&x, "labels"), *rl = fl_st_find(&x, "logits"), *nlg = fl_st_find(&x, "noise.logits");
    const fl_st_tensor *rloss = fl_st_find(&x, "loss"), *nloss = fl_st_find(&x, "noise.loss"), *g0 = fl_st_find(&x, "gen0");
    FL_REQUIRE(px && ids && dec && lab && rl && nlg && rloss && nloss && g0);
    const int B = (int)ids->shape[0], Ts = (int)ids->shape[1], Tt = (int)lab->shape[1], V = b->cfg.text.vocab_size;
    int nv = 0;
    for (int i = 0; i < B * Tt; i++) nv += ((const int32_t *)lab->data)[i] != FL_IGNORE_INDEX;
    FL_CHECK(fl_blip2_alloc_acts(b, B, Ts) == FL_ERR_INVALID); /* an encoder-decoder: the _s2s arena */
    FL_REQUIRE_OK(fl_blip2_alloc_grads(b));
    FL_REQUIRE_OK(fl_blip2_alloc_acts_s2s(b, B, Ts, Tt));
    float *lg = malloc((size_t)B * Tt * V * sizeof *lg), loss;
    FL_REQUIRE(lg);
    FL_REQUIRE_OK(fl_blip2_forward_s2s(b, px->data, ids->data, dec->data, lab->data, B, Ts, Tt, 1.0f / (float)nv, lg,
                                       &loss));
    double sc, e = host_err(lg, rl, (size_t)B * Tt * V, &sc);
    const double lref = ((const double *)rloss->data)[0];
    FL_CHECKF(e <= bound(nlg, sc), "logits error %.3g, bound %.3g", e, bound(nlg, sc));
    FL_CHECKF(fabs(loss - lref) <= bound(nloss, lref), "loss %.9f vs %.9f", (double)loss, lref);
    printf("      T5 variant: logits error %.2g (PyTorch fp32 %.2g, bound %.2g), loss %.8f (ref %.8f)\n", e,
           f32_at(nlg), bound(nlg, sc), (double)loss, lref);
    FL_REQUIRE_OK(fl_blip2_backward(b));
    double worst;
    const int checked = check_grads(b, &be, &x, &worst);
    FL_CHECK(checked == 169);
    printf("      T5 variant: %d gradients, worst error %.2f of its bound\n", checked, worst);
    /* greedy decoding of image 0 with its source ids (placeholders, prompt) */
    int32_t out[16];
    int n = 0;
    const int np = Ts - b->cfg.n_queries;
    FL_REQUIRE_OK(fl_blip2_generate(b, px->data, (const int32_t *)ids->data + b->cfg.n_queries, np, 6, out, &n, NULL));
    int same = n == (int)g0->shape[0];
    for (int i = 0; same && i < n; i++) same = out[i] == ((const int32_t *)g0->data)[i];
    FL_CHECKF(same, "T5 variant greedy: %d tokens, first %d (reference %d, first %d)", n, n ? out[0] : -1,
              (int)g0->shape[0], ((const int32_t *)g0->data)[0]);
    free(lg);
    fl_st_close(&x);
    fl_blip2_free(b);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* Dropout in the Flan-T5 language model (text_config.dropout_rate; the fine-tuning's fl_model_set_dropout and
 * fl_model_adapters_seed) against transformers in training mode with fitllm's masks (tests/ref/
 * make_blip2_dropout_fixture.py: expected-dropout.safetensors, p 0.2, the micro-batch seed S): the loss and every
 * part's gradient within 8x PyTorch's fp32 noise, as blip2_t5_vs_transformers; the loss is not the one without. */
FL_TEST(blip2_t5_dropout_vs_transformers) {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_blip2 *b = NULL;
    fl_st_file x, y;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    FL_REQUIRE_OK(fl_blip2_load(&b, "tests/fixtures/blip2-tiny-t5", &be, &pool));
    FL_REQUIRE_OK(fl_st_open(&x, "tests/fixtures/blip2-tiny-t5/expected.safetensors"));
    FL_REQUIRE_OK(fl_st_open(&y, "tests/fixtures/blip2-tiny-t5/expected-dropout.safetensors"));
    const fl_st_tensor *px = fl_st_find(&x, "pixels"), *ids = fl_st_find(&x, "ids"), *dec = fl_st_find(&x, "dec");
    const fl_st_tensor *lab = fl_st_find(&x, "labels"), *l0 = fl_st_find(&x, "loss"), *rloss = fl_st_find(&y, "loss");
    const fl_st_tensor *nloss = fl_st_find(&y, "noise.loss"), *seed = fl_st_find(&y, "seed"), *p = fl_st_find(&y, "p");
    FL_REQUIRE(px && ids && dec && lab && l0 && rloss && nloss && seed && p);
    const int B = (int)ids->shape[0], Ts = (int)ids->shape[1], Tt = (int)lab->shape[1];
    int nv = 0;
    for (int i = 0; i < B * Tt; i++) nv += ((const int32_t *)lab->data)[i] != FL_IGNORE_INDEX;
    fl_model *lm = fl_blip2_part(b, FL_BLIP2_TEXT);
    lm->cfg.dropout_rate = f32_at(p);
    FL_REQUIRE_OK(fl_model_set_dropout(lm, 1));
    FL_REQUIRE_OK(fl_blip2_alloc_grads(b));
    FL_REQUIRE_OK(fl_blip2_alloc_acts_s2s(b, B, Ts, Tt));
    fl_model_adapters_seed(lm, (uint64_t)((const int64_t *)seed->data)[0]);
    float loss;
    FL_REQUIRE_OK(fl_blip2_forward_s2s(b, px->data, ids->data, dec->data, lab->data, B, Ts, Tt, 1.0f / (float)nv, NULL,
                                       &loss));
    const double lref = ((const double *)rloss->data)[0], lnone = ((const double *)l0->data)[0];
    FL_CHECKF(fabs(loss - lref) <= bound(nloss, lref) && fabs(lref - lnone) > 100 * bound(nloss, lref),
              "loss %.9f vs %.9f (without dropout %.9f)", (double)loss, lref, lnone);
    FL_REQUIRE_OK(fl_blip2_backward(b));
    double worst;
    const int checked = check_grads(b, &be, &y, &worst);
    FL_CHECK(checked == 169);
    printf("      p %.2f: loss %.8f (ref %.8f, without dropout %.8f); %d gradients, worst error %.2f of its bound\n",
           (double)f32_at(p), (double)loss, lref, lnone, checked, worst);
    fl_st_close(&x), fl_st_close(&y);
    fl_blip2_free(b);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* A config without image_token_index (the layout before transformers 5): the queries go in front of the ids. The
 * language model then sees the same rows as with the placeholders, so the logits and the loss are the same bits,
 * and so are the gradients of the image parts. */
FL_TEST(blip2_prepended_queries_same_bits) {
    b2_case c;
    FL_REQUIRE_OK(open_case(&c));
    const int V = c.b->cfg.text.vocab_size, NQ = c.b->cfg.n_queries, TC = c.T - NQ;
    float *l1 = malloc((size_t)c.B * c.T * V * sizeof *l1), *l2 = malloc((size_t)c.B * c.T * V * sizeof *l2), a, bl;
    FL_REQUIRE(l1 && l2);
    FL_REQUIRE_OK(forward(&c, 1.0f / (float)c.n_valid, l1, &a));
    FL_REQUIRE_OK(fl_blip2_backward(c.b));
    fl_model *q1 = fl_blip2_part(c.b, FL_BLIP2_QFORMER);
    float g1;
    FL_REQUIRE_OK(c.be.to_host(&c.be, &g1, fl_model_grads_f32(q1) + 7, sizeof g1));
    fl_blip2 *b = NULL;
    FL_REQUIRE_OK(fl_blip2_load(&b, bad_folder("\"image_token_index\": 100", "\"image_token_index\": null"), &c.be,
                                &c.pool));
    FL_CHECK(b->cfg.image_token == -1);
    FL_REQUIRE_OK(fl_blip2_alloc_grads(b));
    FL_REQUIRE_OK(fl_blip2_alloc_acts(b, c.B, TC));
    int32_t *ids = malloc((size_t)c.B * TC * sizeof *ids), *tg = malloc((size_t)c.B * TC * sizeof *tg);
    FL_REQUIRE(ids && tg);
    for (int n = 0; n < c.B; n++)
        for (int t = 0; t < TC; t++) {
            ids[n * TC + t] = ((const int32_t *)c.ids->data)[n * c.T + NQ + t];
            tg[n * TC + t] = c.targets[n * c.T + NQ + t];
        }
    FL_REQUIRE_OK(fl_blip2_forward(b, c.pixels->data, ids, tg, c.B, TC, 1.0f / (float)c.n_valid, l2, &bl));
    FL_CHECKF(a == bl && memcmp(l1, l2, (size_t)c.B * c.T * V * sizeof *l1) == 0, "loss %.9g vs %.9g", (double)a,
              (double)bl);
    FL_REQUIRE_OK(fl_blip2_backward(b));
    float g2;
    FL_REQUIRE_OK(c.be.to_host(&c.be, &g2, fl_model_grads_f32(fl_blip2_part(b, FL_BLIP2_QFORMER)) + 7, sizeof g2));
    FL_CHECKF(g1 == g2 && g1 != 0, "query_tokens gradient %.9g vs %.9g", (double)g1, (double)g2);
    free(ids), free(tg), free(l1), free(l2);
    fl_blip2_free(b);
    close_case(&c);
}

/* 5 AdamW steps of every part at lr (one optimizer per part, the same hyperparameters, as torch.optim.AdamW over
 * model.parameters()); l5: PyTorch fp32's losses to check each step's against, or NULL */
static void adam_steps(b2_case *c, float lr, const fl_st_tensor *l5) {
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.lr = lr, oc.beta1 = 0.9f, oc.beta2 = 0.95f, oc.eps = 1e-8f, oc.weight_decay = 0.1f;
    fl_optimizer o[FL_BLIP2_PARTS];
    for (int k = 0; k < FL_BLIP2_PARTS; k++) FL_REQUIRE_OK(fl_optim_init(&o[k], fl_blip2_part(c->b, k), &oc));
    for (int s = 0; s < 5; s++) {
        float loss;
        fl_blip2_zero_grads(c->b);
        FL_REQUIRE_OK(forward(c, 1.0f / (float)c->n_valid, NULL, &loss));
        const double rl = l5 ? ((const float *)l5->data)[s] : loss;
        FL_CHECKF(fabs(loss - rl) <= 1e-5 * fabs(rl), "step %d loss %.8f vs PyTorch fp32 %.8f", s + 1, (double)loss, rl);
        FL_REQUIRE_OK(fl_blip2_backward(c->b));
        for (int k = 0; k < FL_BLIP2_PARTS; k++) FL_REQUIRE_OK(fl_optim_step(&o[k], oc.lr, 0.0f, NULL));
    }
    for (int k = 0; k < FL_BLIP2_PARTS; k++) fl_optim_free(&o[k]);
}

/* The weights after 5 AdamW steps against the float64 run, within 4 x PyTorch fp32's own distance to it (the golden
 * rule of tests/test_t5.c: the worst element's distance scaled by its tensor's max; elements whose gradient is noise,
 * 0 < |grad| < 1e-4 x their tensor's max or < 10 x PyTorch fp32's error on that gradient, such as every key bias
 * (softmax ignores a shift shared by all keys: mathematically zero, rounding in any precision), move by +-lr with
 * the noise's sign and are held to Adam's bound only, at most 10% of them: OPT's 54 position rows past the 12 used
 * have no gradient at all, 1512 of the 41284 elements); the same steps at lr x 1.01 land over 10x the
 * bar, so the check can fail. Training of the whole model through the library: every part's optimizer. */
FL_TEST(blip2_adamw_vs_transformers) {
    b2_case c, cm;
    FL_REQUIRE_OK(open_case(&c));
    FL_REQUIRE_OK(open_case(&cm));
    const fl_st_tensor *l5 = fl_st_find(&c.x, "loss5");
    FL_REQUIRE(l5 && l5->shape[0] == 5);
    const float lr = 1e-3f;
    adam_steps(&c, lr, l5);
    adam_steps(&cm, lr * 1.01f, NULL);
    double e_torch = 0, worst = 0, worst_mut = 0, pe_max[FL_BLIP2_PARTS] = {0};
    size_t excluded = 0, total = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_model *m = fl_blip2_part(c.b, k), *mm = fl_blip2_part(cm.b, k);
        for (int i = 0; i < m->layout.n; i++) {
            const fl_param_info *p = &m->layout.params[i];
            char key[4][200];
            static const char *const pre[4] = {"after5.", "after5_f64.", "grad.", "noise."};
            for (int j = 0; j < 4; j++)
                snprintf(key[j], sizeof key[j], "%s%s%s", pre[j], k == FL_BLIP2_TEXT ? "language_model." : "", p->name);
            const fl_st_tensor *t32 = fl_st_find(&c.x, key[0]), *t64 = fl_st_find(&c.x, key[1]);
            const fl_st_tensor *tg = fl_st_find(&c.x, key[2]), *tn = fl_st_find(&c.x, key[3]);
            FL_CHECKF(t32 && t64 && tg && tn && t64->dtype == FL_F64, "reference after5 / after5_f64 / grad of %s",
                      p->name);
            if (!t32 || !t64 || !tg || !tn || t64->dtype != FL_F64) continue;
            const double gnoise = f32_at(tn); /* PyTorch fp32's error on this gradient */
            float *w = malloc(p->numel * 4), *wm = malloc(p->numel * 4);
            FL_REQUIRE(w && wm);
            FL_REQUIRE_OK(c.be.to_host(&c.be, w, fl_model_params_f32(m) + fl_model_store_off(m, i), p->numel * 4));
            FL_REQUIRE_OK(cm.be.to_host(&cm.be, wm, fl_model_params_f32(mm) + fl_model_store_off(mm, i), p->numel * 4));
            const float *p32 = t32->data, *g1 = tg->data;
            const double *r64 = t64->data;
            double gmax = 0, pmax = 0, d_ours = 0, d_torch = 0, d_mut = 0;
            for (size_t j = 0; j < p->numel; j++) gmax = fmax(gmax, fabs(g1[j])), pmax = fmax(pmax, fabs(r64[j]));
            for (size_t j = 0; j < p->numel; j++) {
                const double d = fabs((double)w[j] - r64[j]);
                total++;
                if ((g1[j] != 0.0f && fabs(g1[j]) < 1e-4 * gmax) || fabs(g1[j]) < 10 * gnoise) {
                    excluded++;
                    FL_CHECKF(d <= 5 * lr * (1 + 0.1 * 5 * lr), "%s[%zu] moved beyond Adam's bound", p->name, j);
                    continue;
                }
                d_ours = fmax(d_ours, d);
                d_torch = fmax(d_torch, fabs((double)p32[j] - r64[j]));
                d_mut = fmax(d_mut, fabs((double)wm[j] - r64[j]));
            }
            const double sc = pmax > 0 ? pmax : 1;
            e_torch = fmax(e_torch, d_torch / sc);
            pe_max[k] = fmax(pe_max[k], d_ours / sc);
            worst = fmax(worst, d_ours / sc);
            worst_mut = fmax(worst_mut, d_mut / sc);
            free(w), free(wm);
        }
    }
    FL_CHECKF(e_torch > 0, "PyTorch fp32 is bit-identical to float64 after 5 steps (fixture broken?)");
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        FL_CHECKF(pe_max[k] <= 4 * e_torch, "part %d after 5 AdamW steps: distance to float64 %.3g, over 4x PyTorch "
                  "fp32's %.3g", k, pe_max[k], e_torch);
    FL_CHECKF(excluded * 10 <= total, "%zu of %zu elements have near-zero gradients", excluded, total);
    FL_CHECKF(worst_mut > 10 * 4 * e_torch, "lr off by 1%% lands at %.3g from float64, within 10x the bar %.3g",
              worst_mut, 4 * e_torch);
    printf("      after 5 AdamW steps, distance to float64: ours %.3g, PyTorch fp32 %.3g, lr off by 1%%: %.3g (%zu of "
           "%zu elements held to Adam's bound only)\n", worst, e_torch, worst_mut, excluded, total);
    close_case(&cm);
    close_case(&c);
}
