/* OPT's dropout in the decoder trainer's passes (config.json dropout / attention_dropout, fl_model_set_dropout: the
 * trainer turns it on; src/model/transformer.c, graph.c's decoder block): where transformers' OPTDecoderLayer drops in
 * training mode (the attention's and the FFN's outputs before their residual adds, the attention weights), with the
 * masks of the micro-batch seed (fl_model_adapters_seed), block 16 + l, T5's site numbers.
 *
 * Anchors: transformers in training mode with fitllm's masks (tests/ref/make_opt_dropout_fixture.py, golden-opt's batch,
 * p 0.2 at every site): the loss and every gradient within 8x PyTorch's fp32 noise (+ 16 roundings of the tensor's
 * scale), as the BLIP-2 dropout tests; the loss is far from the one without; an evaluation forward gives the bits of
 * the model without dropout; activation checkpointing the same bits. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/io.h"
#include "fitllm/model.h"
#include "test.h"

#define FIX "tests/fixtures/golden-opt"

static float f32_at(const fl_st_tensor *t) { return ((const float *)t->data)[0]; }
static double bound(const fl_st_tensor *noise, double scale) { return 8.0 * f32_at(noise) + 16.0 * FLT_EPSILON * scale; }

typedef struct {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_model m;
} opt_env;

/* golden-opt with dropout p on every site (p < 0: dropout off), checkpointing ckpt, the arena for B x T */
static void open_opt(opt_env *e, float p, int ckpt, int B, int T) {
    FL_REQUIRE_OK(fl_test_backend(&e->be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&e->be, &e->pool, &e->host, e->be.name, 0));
    FL_REQUIRE_OK(fl_hf_load_model(&e->m, FIX, &e->be, &e->pool));
    if (p >= 0) {
        e->m.cfg.dropout_rate = e->m.cfg.attn_dropout_rate = p;
        FL_REQUIRE_OK(fl_model_set_dropout(&e->m, 1));
    }
    e->m.act_ckpt = ckpt;
    FL_REQUIRE_OK(fl_model_alloc_grads(&e->m));
    FL_REQUIRE_OK(fl_model_alloc_acts(&e->m, B, T));
}

static void close_opt(opt_env *e) {
    fl_model_free(&e->m);
    fl_backend_pools_free(&e->pool, &e->host);
    fl_backend_free(&e->be);
}

/* a training pass with seed s: the mean loss, the gradients in g (host, may be NULL) */
static double pass(opt_env *e, const fl_st_tensor *ids, const fl_st_tensor *tg, long nv, uint64_t s, float *g) {
    const int B = (int)ids->shape[0], T = (int)ids->shape[1];
    fl_model_zero_grads(&e->m);
    fl_model_adapters_seed(&e->m, s);
    FL_REQUIRE_OK_R(fl_model_forward(&e->m, ids->data, tg->data, B, T, 1.0f / (float)nv, NULL), NAN);
    FL_REQUIRE_OK_R(fl_model_backward(&e->m), NAN);
    if (g) FL_REQUIRE_OK_R(e->be.to_host(&e->be, g, fl_model_grads_f32(&e->m), e->m.layout.numel * sizeof *g), NAN);
    return e->m.loss_sum / (double)e->m.n_valid;
}

FL_TEST(opt_dropout_vs_transformers) {
    fl_st_file gf, y;
    FL_REQUIRE_OK(fl_st_open(&gf, FIX "/golden.safetensors"));
    FL_REQUIRE_OK(fl_st_open(&y, FIX "/expected-dropout.safetensors"));
    const fl_st_tensor *ids = fl_st_find(&gf, "input_ids"), *tg = fl_st_find(&gf, "targets");
    const fl_st_tensor *l0 = fl_st_find(&gf, "loss"), *rloss = fl_st_find(&y, "loss"), *nloss = fl_st_find(&y, "noise.loss");
    const fl_st_tensor *seed = fl_st_find(&y, "seed"), *p = fl_st_find(&y, "p");
    FL_REQUIRE(ids && tg && l0 && rloss && nloss && seed && p);
    const int B = (int)ids->shape[0], T = (int)ids->shape[1];
    long nv = 0;
    for (int i = 0; i < B * T; i++) nv += ((const int32_t *)tg->data)[i] != FL_IGNORE_INDEX;
    opt_env e, ck, off;
    open_opt(&e, f32_at(p), 0, B, T), open_opt(&ck, f32_at(p), 1, B, T), open_opt(&off, -1, 0, B, T);
    const size_t n = e.m.layout.numel;
    float *g = malloc(n * sizeof *g), *gc = malloc(n * sizeof *gc), *t = malloc(n * sizeof *t);
    FL_REQUIRE(g && gc && t);
    const uint64_t S = (uint64_t)((const int64_t *)seed->data)[0];
    const double loss = pass(&e, ids, tg, nv, S, g), lref = ((const double *)rloss->data)[0], lnone = f32_at(l0);
    FL_CHECKF(fabs(loss - lref) <= bound(nloss, lref) && fabs(lref - lnone) > 100 * bound(nloss, lref),
              "loss %.9f vs %.9f (without dropout %.9f)", loss, lref, lnone);
    double worst = 0;
    int checked = 0;
    for (int i = 0; i < e.m.layout.n; i++) {
        const fl_param_info *pi = &e.m.layout.params[i];
        char gk[200], nk[208];
        snprintf(gk, sizeof gk, "grad.%s", pi->name);
        snprintf(nk, sizeof nk, "noise.%s", pi->name);
        const fl_st_tensor *r = fl_st_find(&y, gk), *rn = fl_st_find(&y, nk);
        FL_CHECKF(r && rn && (size_t)(r->end - r->begin) == pi->numel * 4, "reference gradient of %s", pi->name);
        if (!r || !rn) continue;
        const float *ours = g + pi->offset;
        if (pi->ndim == 2 && pi->transposed_on_disk) { /* ours (r, c) as the file's (c, r) */
            const int64_t R = pi->shape[0], Cc = pi->shape[1];
            for (int64_t a = 0; a < R; a++)
                for (int64_t j = 0; j < Cc; j++) t[j * R + a] = ours[a * Cc + j];
            ours = t;
        }
        double err = 0, sc = 0;
        for (size_t k = 0; k < pi->numel; k++) {
            err = fmax(err, fabs((double)ours[k] - ((const float *)r->data)[k]));
            sc = fmax(sc, fabs(((const float *)r->data)[k]));
        }
        FL_CHECKF(err <= bound(rn, sc), "gradient of %s: error %.3g, bound %.3g", pi->name, err, bound(rn, sc));
        worst = fmax(worst, err / bound(rn, sc));
        checked++;
    }
    FL_CHECK(checked == e.m.layout.n);
    /* checkpointing: the same bits; an evaluation forward: the bits without dropout */
    const double lc = pass(&ck, ids, tg, nv, S, gc);
    FL_CHECKF(lc == loss && memcmp(g, gc, n * sizeof *g) == 0, "checkpointing: loss %.9g vs %.9g", lc, loss);
    const size_t nl = (size_t)B * T * e.m.cfg.vocab_size;
    float *lg = malloc(nl * sizeof *lg), *lg0 = malloc(nl * sizeof *lg0);
    FL_REQUIRE(lg && lg0);
    FL_REQUIRE_OK(fl_model_forward(&e.m, ids->data, tg->data, B, T, 0.0f, lg));
    FL_REQUIRE_OK(fl_model_forward(&off.m, ids->data, tg->data, B, T, 0.0f, lg0)); /* logits: host memory */
    FL_CHECK(memcmp(lg, lg0, nl * sizeof *lg) == 0);
    printf("      p %.2f: loss %.8f (ref %.8f, without dropout %.8f); %d gradients, worst error %.2f of its bound\n",
           (double)f32_at(p), loss, lref, lnone, checked, worst);
    free(g), free(gc), free(t), free(lg), free(lg0);
    close_opt(&e), close_opt(&ck), close_opt(&off);
    fl_st_close(&gf), fl_st_close(&y);
}
