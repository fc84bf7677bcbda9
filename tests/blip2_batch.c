/* tests/blip2_batch.h */
#include "blip2_batch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend_op.h"
#include "fitllm/lora.h"
#include "test.h"

void b2_env_open(b2_env *e) {
    FL_REQUIRE_OK(fl_test_backend(&e->be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&e->be, &e->pool, &e->host, e->be.name, 0));
}

void b2_env_close(b2_env *e) {
    fl_backend_pools_free(&e->pool, &e->host);
    fl_backend_free(&e->be);
}

void b2_batch_open(b2_batch *c, const char *dir, int t5) {
    char p[300];
    memset(c, 0, sizeof *c);
    c->t5 = t5;
    snprintf(p, sizeof p, "%s/expected.safetensors", dir);
    FL_REQUIRE_OK(fl_st_open(&c->x, p));
    const fl_st_tensor *px = fl_st_find(&c->x, "pixels"), *ids = fl_st_find(&c->x, "ids"), *lab = fl_st_find(&c->x, "labels");
    FL_REQUIRE(px && ids && lab);
    c->px = px->data, c->ids = ids->data;
    c->B = (int)ids->shape[0], c->T = (int)ids->shape[1];
    const int TC = (int)lab->shape[1], NQ = c->T - TC;
    const int32_t *l = lab->data;
    if (t5) { /* the labels are the targets; the decoder reads them shifted from the start token */
        const fl_st_tensor *dec = fl_st_find(&c->x, "dec");
        FL_REQUIRE(dec);
        c->dec = dec->data, c->Tt = TC;
        FL_REQUIRE(c->tg = malloc((size_t)c->B * TC * sizeof *c->tg));
        for (int i = 0; i < c->B * TC; i++) c->tg[i] = l[i], c->n_valid += l[i] != FL_IGNORE_INDEX;
        return;
    }
    FL_REQUIRE(c->tg = malloc((size_t)c->B * c->T * sizeof *c->tg)); /* row NQ + i predicts caption[i + 1] */
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->T; t++) {
            const int i = t - NQ, v = i >= 0 && i + 1 < TC ? l[b * TC + i + 1] : FL_IGNORE_INDEX;
            c->tg[b * c->T + t] = v;
            c->n_valid += v != FL_IGNORE_INDEX;
        }
}

void b2_batch_close(b2_batch *c) {
    free(c->tg);
    fl_st_close(&c->x);
    memset(c, 0, sizeof *c);
}

size_t b2_batch_logits(const b2_batch *c, const fl_blip2 *b) {
    return (size_t)c->B * (c->t5 ? c->Tt : c->T) * (size_t)fl_blip2_get_config(b)->text.vocab_size;
}

void b2_batch_fwd_bwd(fl_blip2 *b, const b2_batch *c, float *lg, float *out) {
    float loss = 0;
    *out = NAN;
    fl_blip2_zero_grads(b);
    fl_model *lm = fl_blip2_part(b, FL_BLIP2_TEXT);
    fl_lora_adapters ad;
    if (fl_model_lora_adapters(lm, &ad)) FL_RUN(lm->be, zero, ad.grads, ad.numel * sizeof(float));
    if (c->t5) {
        FL_REQUIRE_OK(fl_blip2_alloc_acts_s2s(b, c->B, c->T, c->Tt));
        FL_REQUIRE_OK(fl_blip2_forward_s2s(b, c->px, c->ids, c->dec, c->tg, c->B, c->T, c->Tt, 1.0f / (float)c->n_valid,
                                           lg, &loss));
    } else {
        FL_REQUIRE_OK(fl_blip2_alloc_acts(b, c->B, c->T));
        FL_REQUIRE_OK(fl_blip2_forward(b, c->px, c->ids, c->tg, c->B, c->T, 1.0f / (float)c->n_valid, lg, &loss));
    }
    FL_REQUIRE_OK(fl_blip2_backward(b));
    *out = loss;
}
