/* Dropout in BLIP-2 (issue 32): the Flan-T5 language model's text_config.dropout_rate applied by the T5 interpreter's
 * DROPOUT sites (src/model/seq2seq.c, arch_t5.c; their places and masks against transformers: tests/test_t5.c
 * t5_*_dropout_vs_transformers), with the projected queries injected into the encoder's embedding rows before its
 * dropout, as transformers' T5 stack drops its inputs_embeds; and the OPT variant's every part (fl_blip2_set_dropout:
 * the vision tower's attention weights, the Q-Former's embedding norm output, dense outputs and attention weights,
 * OPT's sublayer outputs and attention weights; their places and masks against transformers: tests/test_blip2.c
 * blip2_opt_dropout_vs_transformers). The fine-tuning (src/train/blip2_train.c) turns it on and seeds each
 * micro-batch (fl_model_adapters_seed: run seed, global micro-batch).
 *
 * Anchors, none of them fitllm's own output with dropout:
 *   - rate 0 with dropout on, and an evaluation forward at rate 0.5: the bits of the model without dropout;
 *   - the same seed twice: the same bits; another seed: another loss;
 *   - central finite differences of the loss on a fixed mask (the same seed for every evaluation) against the
 *     backward's gradients of every part (vision tower, Q-Former with its projection, language model): the backward
 *     must regenerate the forward's masks at every site, the encoder's embedding site included (the injected rows'
 *     gradient leaves through it). The test can fail: the gradient without dropout is far from the finite
 *     differences at the checked entries (checked below);
 *   - activation checkpointing: the same bits. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blip2_batch.h"
#include "fitllm/model.h"
#include "test.h"

static const char *fix(int t5) { return t5 ? "tests/fixtures/blip2-tiny-t5" : "tests/fixtures/blip2-tiny-opt"; }

/* The fixture with every part trained and dropout at rate p (on: fl_blip2_set_dropout): T5's language model's
 * dropout_rate; the OPT variant's every rate (the vision tower has its attention weights' only). */
static void open_drop(b2_env *e, int t5, float p, int on, int ckpt, fl_blip2 **out) {
    fl_blip2 *b = *out = NULL;
    FL_REQUIRE_OK(fl_blip2_load(&b, fix(t5), &e->be, &e->pool));
    *out = b;
    for (int k = t5 ? FL_BLIP2_TEXT : 0; k < FL_BLIP2_PARTS; k++) {
        fl_model_config *c = &fl_blip2_part(b, k)->cfg;
        c->dropout_rate = k == FL_BLIP2_VISION ? 0.0f : p;
        if (!t5) c->attn_dropout_rate = p;
    }
    FL_REQUIRE_OK(fl_blip2_set_dropout(b, on));
    FL_REQUIRE_OK(fl_blip2_set_act_ckpt(b, ckpt));
    FL_REQUIRE_OK(fl_blip2_alloc_grads(b));
}

/* every part's gradients, one array (host) */
static size_t all_numel(fl_blip2 *b) {
    size_t n = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) n += fl_blip2_part(b, k)->layout.numel;
    return n;
}

static void grads_to(fl_blip2 *b, const fl_backend *be, float *g) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        const fl_model *m = fl_blip2_part(b, k);
        FL_REQUIRE_OK(be->to_host(be, g, fl_model_grads_f32(m), m->layout.numel * sizeof *g));
        g += m->layout.numel;
    }
}

/* a training pass with the micro-batch seed s: the loss, the gradients (g may be NULL) */
static float pass(fl_blip2 *b, const b2_batch *c, const fl_backend *be, uint64_t s, float *g) {
    float loss;
    fl_model_adapters_seed(fl_blip2_part(b, FL_BLIP2_TEXT), s);
    b2_batch_fwd_bwd(b, c, NULL, &loss); /* NAN if a step failed (the test fails there) */
    if (g) grads_to(b, be, g);
    return loss;
}

static float eval_loss(fl_blip2 *b, const b2_batch *c) {
    float loss = NAN;
    if (c->t5)
        FL_REQUIRE_OK_R(fl_blip2_forward_s2s(b, c->px, c->ids, c->dec, c->tg, c->B, c->T, c->Tt, 0.0f, NULL, &loss),
                        NAN);
    else
        FL_REQUIRE_OK_R(fl_blip2_forward(b, c->px, c->ids, c->tg, c->B, c->T, 0.0f, NULL, &loss), NAN);
    return loss;
}

static void off_same_bits_seeded(int t5) {
    b2_env e;
    b2_env_open(&e);
    b2_batch c;
    b2_batch_open(&c, fix(t5), t5);
    fl_blip2 *off, *zero, *on, *ck;
    open_drop(&e, t5, 0.5f, 0, 0, &off), open_drop(&e, t5, 0.0f, 1, 0, &zero), open_drop(&e, t5, 0.5f, 1, 0, &on);
    open_drop(&e, t5, 0.5f, 1, 1, &ck);
    const size_t n = all_numel(off);
    float *g0 = malloc(n * sizeof *g0), *gz = malloc(n * sizeof *gz), *g1 = malloc(n * sizeof *g1),
          *g2 = malloc(n * sizeof *g2);
    FL_REQUIRE(g0 && gz && g1 && g2);
    const float l0 = pass(off, &c, &e.be, 7, g0), lz = pass(zero, &c, &e.be, 7, gz);
    FL_CHECKF(l0 == lz && memcmp(g0, gz, n * sizeof *g0) == 0, "rate 0: loss %.9g vs %.9g without dropout", (double)lz,
              (double)l0);
    const float l1 = pass(on, &c, &e.be, 7, g1), l2 = pass(on, &c, &e.be, 7, g2), l3 = pass(on, &c, &e.be, 8, NULL);
    FL_CHECKF(l1 == l2 && memcmp(g1, g2, n * sizeof *g1) == 0, "the same seed: loss %.9g vs %.9g", (double)l1,
              (double)l2);
    FL_CHECKF(l1 != l0 && l3 != l1, "rate 0.5: loss %.9g (seed 7), %.9g (seed 8), %.9g without dropout", (double)l1,
              (double)l3, (double)l0);
    const float le = eval_loss(on, &c), le0 = eval_loss(off, &c);
    FL_CHECKF(le == le0, "an evaluation forward drops: %.9g vs %.9g", (double)le, (double)le0);
    const float lc = pass(ck, &c, &e.be, 7, g2);
    FL_CHECKF(lc == l1 && memcmp(g1, g2, n * sizeof *g1) == 0, "checkpointing: loss %.9g vs %.9g", (double)lc,
              (double)l1);
    printf("      rate 0.5: loss %.6f (seed 7), %.6f (seed 8); without dropout %.6f\n", (double)l1, (double)l3,
           (double)l0);
    free(g0), free(gz), free(g1), free(g2);
    fl_blip2_free(off), fl_blip2_free(zero), fl_blip2_free(on), fl_blip2_free(ck);
    b2_batch_close(&c);
    b2_env_close(&e);
}

FL_TEST(blip2_t5_dropout_off_same_bits_seeded) { off_same_bits_seeded(1); }
FL_TEST(blip2_opt_dropout_off_same_bits_seeded) { off_same_bits_seeded(0); }

/* The backward against central finite differences at the two largest-gradient entries of a few tensors of every
 * part (a fixed mask: seed 9 for every evaluation). */
static void finite_differences(int t5) {
    b2_env e;
    b2_env_open(&e);
    b2_batch c;
    b2_batch_open(&c, fix(t5), t5);
    fl_blip2 *off, *b;
    open_drop(&e, t5, 0.5f, 0, 0, &off), open_drop(&e, t5, 0.5f, 1, 0, &b);
    const size_t n = all_numel(b);
    float *g = malloc(n * sizeof *g), *gn = malloc(n * sizeof *gn);
    FL_REQUIRE(g && gn);
    pass(off, &c, &e.be, 9, gn);
    pass(b, &c, &e.be, 9, g);
    const double h = 2e-3;
    double worst = 0, far_min = INFINITY;
    int checked = 0;
    size_t base = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_model *m = fl_blip2_part(b, k);
        float *pd = fl_model_params_f32(m);
        const int np = m->layout.n, pick[4] = {0, np / 3, (2 * np) / 3, np - 1};
        for (int q = 0; q < 4; q++) {
            const fl_param_info *pi = &m->layout.params[pick[q]];
            size_t best[2] = {0, pi->numel > 1 ? 1 : 0};
            for (size_t i = 1; i < pi->numel; i++) { /* the two largest |gradient| entries */
                const float v = fabsf(g[base + pi->offset + i]);
                if (v > fabsf(g[base + pi->offset + best[0]])) best[1] = best[0], best[0] = i;
                else if (i != best[0] && v > fabsf(g[base + pi->offset + best[1]])) best[1] = i;
            }
            for (int j = 0; j < 2; j++) {
                const size_t o = pi->offset + best[j];
                float w0, v;
                FL_REQUIRE_OK(e.be.to_host(&e.be, &w0, pd + o, sizeof w0));
                v = w0 + (float)h;
                FL_REQUIRE_OK(e.be.to_device(&e.be, pd + o, &v, sizeof v));
                const double lp = pass(b, &c, &e.be, 9, NULL);
                v = w0 - (float)h;
                FL_REQUIRE_OK(e.be.to_device(&e.be, pd + o, &v, sizeof v));
                const double lm = pass(b, &c, &e.be, 9, NULL);
                FL_REQUIRE_OK(e.be.to_device(&e.be, pd + o, &w0, sizeof w0));
                const double fd = (lp - lm) / ((double)(w0 + (float)h) - (double)(w0 - (float)h));
                /* bound: the fp32 mean loss's rounding (~5e-7 at a loss of ~5) over 2h (2.5e-4) and the central
                 * difference's truncation (h^2 times the third derivative: 1%), as tests/test_t5_dropout.c's */
                const double gr = g[base + o], err = fabs(fd - gr), bound = 3e-4 + 0.01 * fabs(fd);
                const double err_nodrop = fabs(fd - gn[base + o]);
                if (err / bound > worst) worst = err / bound;
                if (fabs(fd) > 10 * bound && err_nodrop / bound < far_min) far_min = err_nodrop / bound;
                FL_CHECKF(err <= bound, "part %d %s[%zu]: gradient %.6g vs finite differences %.6g (bound %.2g)", k,
                          pi->name, best[j], gr, fd, bound);
                checked++;
            }
        }
        base += m->layout.numel;
    }
    printf("      %d entries in 3 parts: worst %.2f of the bound; the gradient without dropout at least %.1f x the "
           "bound away\n", checked, worst, far_min);
    FL_CHECKF(far_min > 1.0, "the checked entries cannot tell the masks apart (%.2f)", far_min);
    free(g), free(gn);
    fl_blip2_free(off), fl_blip2_free(b);
    b2_batch_close(&c);
    b2_env_close(&e);
}

FL_TEST(blip2_t5_dropout_gradients_finite_differences) { finite_differences(1); }
FL_TEST(blip2_opt_dropout_gradients_finite_differences) { finite_differences(0); }
