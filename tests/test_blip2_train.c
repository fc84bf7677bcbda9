/* BLIP-2 training pieces under the fine-tuning (src/train/blip2_train.c): frozen parts
 * (fl_blip2_alloc_grads_parts: the trained parts' gradients are the bits of a run where every part trains), LoRA on
 * the language model (the identity at PEFT's init; the adapters' gradients against central finite differences of the
 * loss) and fl_blip2_save (the folder reloads to the same logits, bit for bit). The fixture is
 * tests/fixtures/blip2-tiny-opt (tests/ref/make_blip2_fixture.py). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fs.h"
#include "fitllm/blip2.h"
#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "model/blip2-impl.h"
#include "test.h"

#define FIX "tests/fixtures/blip2-tiny-opt"

typedef struct {
    fl_backend be;
    fl_mem_pool pool, host;
    fl_blip2 *b;
    fl_st_file x;
    const float *px;
    const int32_t *ids;
    int B, T, n_valid;
    int32_t *tg;
} tc;

/* the fixture's batch (5 placeholders + a caption of 7; row NQ + i predicts caption[i + 1]); grads for `parts` */
static void open_tc(tc *c, int parts) {
    memset(c, 0, sizeof *c);
    FL_REQUIRE_OK(fl_test_backend(&c->be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&c->be, &c->pool, &c->host, c->be.name, 0));
    FL_REQUIRE_OK(fl_blip2_load(&c->b, FIX, &c->be, &c->pool));
    FL_REQUIRE_OK(fl_st_open(&c->x, FIX "/expected.safetensors"));
    const fl_st_tensor *px = fl_st_find(&c->x, "pixels"), *ids = fl_st_find(&c->x, "ids"), *lab = fl_st_find(&c->x, "labels");
    FL_REQUIRE(px && ids && lab);
    c->px = px->data, c->ids = ids->data;
    c->B = (int)ids->shape[0], c->T = (int)ids->shape[1];
    const int TC = (int)lab->shape[1], NQ = c->T - TC;
    c->tg = malloc((size_t)c->B * c->T * sizeof *c->tg);
    FL_REQUIRE(c->tg);
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->T; t++) {
            const int i = t - NQ, v = i >= 0 && i + 1 < TC ? ((const int32_t *)lab->data)[b * TC + i + 1] : FL_IGNORE_INDEX;
            c->tg[b * c->T + t] = v;
            c->n_valid += v != FL_IGNORE_INDEX;
        }
    FL_REQUIRE_OK(fl_blip2_alloc_grads_parts(c->b, parts));
}

static void close_tc(tc *c) {
    free(c->tg);
    fl_st_close(&c->x);
    fl_blip2_free(c->b);
    fl_backend_pools_free(&c->pool, &c->host);
    fl_backend_free(&c->be);
}

static void train_fwd_bwd(tc *c, float *loss) {
    FL_REQUIRE_OK(fl_blip2_alloc_acts(c->b, c->B, c->T));
    fl_blip2_zero_grads(c->b);
    FL_REQUIRE_OK(fl_blip2_forward(c->b, c->px, c->ids, c->tg, c->B, c->T, 1.0f / (float)c->n_valid, NULL, loss));
    FL_REQUIRE_OK(fl_blip2_backward(c->b));
}

/* part k's gradients on the host (numel floats, malloc'd) */
static void grads_of(tc *c, int k, size_t *n, float **out) {
    fl_model *m = fl_blip2_part(c->b, k);
    *n = m->layout.numel;
    float *h = *out = malloc(*n * sizeof *h);
    FL_REQUIRE(h && fl_model_grads_f32(m));
    FL_REQUIRE_OK(c->be.to_host(&c->be, h, fl_model_grads_f32(m), *n * sizeof *h));
}

/* A frozen vision tower (the fine-tuning default) and a frozen Q-Former: the parts that train get the same gradient
 * bits as when every part trains (the skipped backward only ever fed the frozen parts); no part at all is refused. */
FL_TEST(blip2_frozen_parts_same_grads) {
    tc all, two, lm;
    open_tc(&all, 7);
    open_tc(&two, 1 << FL_BLIP2_QFORMER | 1 << FL_BLIP2_TEXT);
    open_tc(&lm, 1 << FL_BLIP2_TEXT);
    float la, l2, l1;
    train_fwd_bwd(&all, &la), train_fwd_bwd(&two, &l2), train_fwd_bwd(&lm, &l1);
    FL_CHECKF(la == l2 && la == l1, "loss %.9g / %.9g / %.9g", (double)la, (double)l2, (double)l1);
    FL_CHECK(fl_model_grads_f32(fl_blip2_part(two.b, FL_BLIP2_VISION)) == NULL);
    for (int k = FL_BLIP2_QFORMER; k <= FL_BLIP2_TEXT; k++) {
        size_t n, n2;
        float *g, *g2;
        grads_of(&all, k, &n, &g), grads_of(&two, k, &n2, &g2);
        double mx = 0;
        for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(g[i]));
        FL_CHECKF(n == n2 && memcmp(g, g2, n * sizeof *g) == 0 && mx > 0, "part %d: gradients differ with the vision "
                  "tower frozen", k);
        if (k == FL_BLIP2_TEXT) {
            float *g1;
            grads_of(&lm, k, &n2, &g1);
            FL_CHECKF(memcmp(g, g1, n * sizeof *g) == 0, "the language model's gradients differ with the image parts frozen");
            free(g1);
        }
        free(g), free(g2);
    }
    close_tc(&all), close_tc(&two), close_tc(&lm);
    tc none;
    open_tc(&none, 0);
    FL_REQUIRE_OK(fl_blip2_alloc_acts(none.b, none.B, none.T));
    FL_CHECK(fl_blip2_forward(none.b, none.px, none.ids, none.tg, none.B, none.T, 1.0f, NULL, NULL) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "a part that trains"));
    close_tc(&none);
}

static void loss_only(tc *c, float *loss) {
    FL_REQUIRE_OK(fl_blip2_forward(c->b, c->px, c->ids, c->tg, c->B, c->T, 0, NULL, loss));
}

/* LoRA (q_proj, v_proj, r 4, no dropout) on the language model with the image parts frozen: at PEFT's init (B = 0) the
 * loss is the base's bits; after B is set, d(loss)/d(adapter element) equals central finite differences (double
 * steps of 1e-2 on fp32: 3e-4 + 2% as tests/test_blip2.c's), A and B of both modules, both layers. */
FL_TEST(blip2_lora_language_model) {
    tc c;
    open_tc(&c, 0);
    fl_model *lm = fl_blip2_part(c.b, FL_BLIP2_TEXT);
    fl_lora_config lc;
    FL_REQUIRE_OK(fl_lora_config_init(&lc, &lm->cfg, 4, 8.0f, 0.0f, 0, "q_proj,v_proj"));
    FL_REQUIRE_OK(fl_blip2_alloc_acts(c.b, c.B, c.T));
    float base, l0, tl;
    loss_only(&c, &base);
    FL_REQUIRE_OK(fl_model_lora_init(lm, &lc, 11));
    FL_REQUIRE_OK(fl_blip2_alloc_acts(c.b, c.B, c.T)); /* the adapters' activations too */
    loss_only(&c, &l0);
    FL_CHECKF(l0 == base, "LoRA at init changes the loss");
    fl_lora_adapters ad;
    FL_REQUIRE(fl_model_lora_adapters(lm, &ad) && ad.n_mods == 4);
    float *h = malloc(ad.numel * sizeof *h), *g = malloc(ad.numel * sizeof *g);
    FL_REQUIRE(h && g);
    FL_REQUIRE_OK(c.be.to_host(&c.be, h, ad.params, ad.numel * sizeof *h));
    for (size_t i = 0; i < ad.numel; i++) /* B away from zero, so A gets a gradient too */
        if (i >= ad.off[1] && (i < ad.off[2] || (i >= ad.off[3] && i < ad.off[4]) || (i >= ad.off[5] && i < ad.off[6]) ||
                               i >= ad.off[7]))
            h[i] = 0.05f * (float)((int)(i * 7 % 11) - 5);
    FL_REQUIRE_OK(c.be.to_device(&c.be, ad.params, h, ad.numel * sizeof *h));
    train_fwd_bwd(&c, &tl);
    FL_REQUIRE_OK(c.be.to_host(&c.be, g, ad.grads, ad.numel * sizeof *g));
    int checked = 0;
    for (int j = 0; j < 2 * ad.n_mods; j++) {
        const size_t at = ad.off[j] + 3; /* an element of A_j / B_j */
        const float w0 = h[at], step = 1e-2f;
        float l[2];
        for (int sgn = 0; sgn < 2; sgn++) {
            h[at] = w0 + (sgn ? -step : step);
            FL_REQUIRE_OK(c.be.to_device(&c.be, ad.params, h, ad.numel * sizeof *h));
            loss_only(&c, &l[sgn]);
        }
        h[at] = w0;
        FL_REQUIRE_OK(c.be.to_device(&c.be, ad.params, h, ad.numel * sizeof *h));
        const double num = ((double)l[0] - l[1]) / (2.0 * step), an = g[at];
        FL_CHECKF(fabs(num - an) <= 3e-4 + 2e-2 * fabs(an) && fabs(an) > 1e-4, "%s %c[3]: finite difference %.6g vs "
                  "backward %.6g", ad.mods[j / 2].name, j % 2 ? 'B' : 'A', num, an);
        checked++;
    }
    FL_CHECK(checked == 8);
    free(h), free(g);
    close_tc(&c);
}

/* fl_blip2_save then fl_blip2_load: the same logits, bit for bit (after a change to the weights, so a save of the
 * source files would fail it). */
FL_TEST(blip2_save_reload_same_bits) {
    tc c;
    open_tc(&c, 7);
    fl_model *q = fl_blip2_part(c.b, FL_BLIP2_QFORMER);
    float v = 0.25f;
    FL_REQUIRE_OK(c.be.to_device(&c.be, fl_model_params_f32(q) + 5, &v, sizeof v));
    const size_t NL = (size_t)c.B * c.T * c.b->cfg.text.vocab_size;
    float *l1 = malloc(NL * sizeof *l1), *l2 = malloc(NL * sizeof *l2), a, b2;
    FL_REQUIRE(l1 && l2);
    FL_REQUIRE_OK(fl_blip2_alloc_acts(c.b, c.B, c.T));
    FL_REQUIRE_OK(fl_blip2_forward(c.b, c.px, c.ids, c.tg, c.B, c.T, 0, l1, &a));
    char dir[600];
    snprintf(dir, sizeof dir, "%s/blip2-saved", fl_test_tmpdir());
    FL_REQUIRE_OK(fl_blip2_save(c.b, FIX, dir));
    fl_blip2 *r = NULL;
    FL_REQUIRE_OK(fl_blip2_load(&r, dir, &c.be, &c.pool));
    FL_REQUIRE_OK(fl_blip2_alloc_acts(r, c.B, c.T));
    FL_REQUIRE_OK(fl_blip2_forward(r, c.px, c.ids, c.tg, c.B, c.T, 0, l2, &b2));
    FL_CHECKF(a == b2 && memcmp(l1, l2, NL * sizeof *l1) == 0, "reloaded loss %.9g vs %.9g", (double)b2, (double)a);
    char pp[700];
    snprintf(pp, sizeof pp, "%s/preprocessor_config.json", dir);
    FL_CHECK(fl_fs_is_file(pp));
    fl_blip2_free(r);
    free(l1), free(l2);
    close_tc(&c);
}

/* Greedy captioning with the KV cache (the image parts once, the projected queries injected into the prefill, one
 * decode step per token) against the whole sequence through fl_blip2_forward again for every token (the path it
 * replaced), 24 tokens for each image of the fixture: the same ids. (`blip2_generate_vs_transformers` holds the
 * first 8 to transformers' generate.) */
FL_TEST(blip2_generate_cache_equals_full_forward) {
    tc c;
    open_tc(&c, 0);
    const int V = c.b->cfg.text.vocab_size, NQ = c.b->cfg.n_queries, S = c.b->cfg.vision.image_size, MAX = 24;
    int32_t ids[64], out[32];
    float *lg = malloc((size_t)(NQ + 1 + MAX) * V * sizeof *lg);
    FL_REQUIRE(lg);
    for (int img = 0; img < c.B; img++) {
        const float *px = c.px + (size_t)img * 3 * S * S;
        int n = 0;
        FL_REQUIRE_OK(fl_blip2_generate(c.b, px, NULL, 0, MAX, out, &n, NULL));
        int T = 0;
        for (int i = 0; i < NQ; i++) ids[T++] = c.b->cfg.image_token;
        ids[T++] = c.b->cfg.bos_id;
        int same = n > 0, k = 0;
        for (; same && k < n; k++) {
            FL_REQUIRE_OK(fl_blip2_alloc_acts(c.b, 1, T));
            FL_REQUIRE_OK(fl_blip2_forward(c.b, px, ids, NULL, 1, T, 0, lg, NULL));
            const float *last = lg + (size_t)(T - 1) * V;
            int best = 0;
            for (int v = 1; v < V; v++)
                if (last[v] > last[best]) best = v;
            same = best == out[k];
            ids[T++] = best;
        }
        FL_CHECKF(same && (n == MAX || out[n - 1] == c.b->cfg.eos_id), "image %d: token %d of %d differs", img, k, n);
    }
    free(lg);
    close_tc(&c);
}

/* Frozen parts save nothing (PyTorch's autograd saves nothing where no gradient flows): a part that trains nothing,
 * with no part before it that trains, is carved lean when the arena is allocated: 0 saved bytes, and its ACTS are the
 * checkpointed carve's less L - 1 of its L + 1 residual buffers (two in turn). The same loss and gradients as when
 * every part trains: blip2_frozen_parts_same_grads; a lean forward's logits: blip2_save_reload_same_bits. A training
 * forward that would need a lean part's activations (gradients allocated after the arena) is refused by name. */
FL_TEST(blip2_frozen_parts_save_nothing) {
    tc all, two, lm, ck;
    float l;
    open_tc(&all, 7), open_tc(&two, 6), open_tc(&lm, 4), open_tc(&ck, 7);
    FL_REQUIRE_OK(fl_blip2_set_act_ckpt(ck.b, 1));
    train_fwd_bwd(&all, &l), train_fwd_bwd(&two, &l), train_fwd_bwd(&lm, &l), train_fwd_bwd(&ck, &l);
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        const size_t sa = fl_blip2_acts_saved_bytes(all.b, k), s2 = fl_blip2_acts_saved_bytes(two.b, k),
                     s1 = fl_blip2_acts_saved_bytes(lm.b, k);
        FL_CHECKF(sa > 0 && sa == fl_blip2_acts_bytes(all.b, k), "part %d: every part trains: saved %zu of %zu", k, sa,
                  fl_blip2_acts_bytes(all.b, k));
        FL_CHECKF((k == FL_BLIP2_VISION) == (s2 == 0) && (k == FL_BLIP2_TEXT) == (s1 > 0), "part %d: saved %zu with the "
                  "vision tower frozen, %zu with only the language model trained", k, s2, s1);
        if (k == FL_BLIP2_TEXT) continue;
        const fl_model_config *mc = &fl_blip2_part(lm.b, k)->cfg;
        const size_t N = (size_t)lm.B * (k == FL_BLIP2_VISION ? (size_t)mc->max_seq : (size_t)lm.b->cfg.n_queries);
        const size_t res = (N * (size_t)mc->dim * sizeof(float) + 63) / 64 * 64, L = (size_t)mc->n_layers;
        FL_CHECKF(fl_blip2_acts_bytes(lm.b, k) + (L - 1) * res == fl_blip2_acts_bytes(ck.b, k) &&
                      fl_blip2_acts_bytes(lm.b, k) < fl_blip2_acts_bytes(all.b, k),
                  "part %d: lean ACTS %zu, checkpointed %zu, all %zu (residual %zu, L %zu)", k,
                  fl_blip2_acts_bytes(lm.b, k), fl_blip2_acts_bytes(ck.b, k), fl_blip2_acts_bytes(all.b, k), res, L);
    }
    FL_CHECK(fl_blip2_acts_bytes(two.b, 0) == fl_blip2_acts_bytes(lm.b, 0));
    close_tc(&all), close_tc(&two), close_tc(&lm), close_tc(&ck);
    tc none;
    open_tc(&none, 0);
    FL_REQUIRE_OK(fl_blip2_alloc_acts(none.b, none.B, none.T));
    for (int k = 0; k < FL_BLIP2_PARTS; k++) FL_CHECK(fl_blip2_acts_saved_bytes(none.b, k) == 0);
    FL_REQUIRE_OK(fl_blip2_alloc_grads_parts(none.b, 1 << FL_BLIP2_QFORMER));
    FL_CHECK(fl_blip2_forward(none.b, none.px, none.ids, none.tg, none.B, none.T, 1.0f, NULL, NULL) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "saves no activations of the Q-Former"));
    FL_REQUIRE_OK(fl_blip2_alloc_acts(none.b, none.B, none.T));
    FL_REQUIRE_OK(fl_blip2_forward(none.b, none.px, none.ids, none.tg, none.B, none.T, 1.0f, NULL, NULL));
    FL_CHECK(fl_blip2_acts_saved_bytes(none.b, FL_BLIP2_VISION) == 0 &&
             fl_blip2_acts_saved_bytes(none.b, FL_BLIP2_TEXT) > 0);
    close_tc(&none);
}

/* Captioning stops as fl_generate does (`fitllm generate`'s LM path): max_new 0 gives no token; a max_new beyond the
 * context stops when the sequence (queries, BOS, new tokens) reaches the language model's context (why: the context
 * limit), its ids the first of a shorter run's; a prompt filling the context leaves no room (0 tokens, the context
 * limit), one beyond it is refused. */
FL_TEST(blip2_generate_stops_at_context) {
    tc c;
    open_tc(&c, 0);
    const int NQ = c.b->cfg.n_queries, ctx = c.b->cfg.text.max_seq, head = NQ + 1;
    int32_t *out = malloc((size_t)ctx * sizeof *out), *prompt = calloc((size_t)ctx + 1, sizeof *prompt), few[8];
    FL_REQUIRE(out && prompt);
    int n = -1, nf = 0;
    fl_gen_stop why = FL_GEN_STOP_CALLBACK;
    FL_REQUIRE_OK(fl_blip2_generate(c.b, c.px, NULL, 0, 0, out, &n, &why));
    FL_CHECKF(n == 0 && why == FL_GEN_STOP_MAX_TOKENS, "max_new 0: %d tokens, why %d", n, (int)why);
    FL_REQUIRE_OK(fl_blip2_generate(c.b, c.px, NULL, 0, 100000, out, &n, &why));
    FL_REQUIRE_OK(fl_blip2_generate(c.b, c.px, NULL, 0, 8, few, &nf, NULL));
    FL_CHECKF(n == ctx - head && why == FL_GEN_STOP_CONTEXT && nf == 8 && !memcmp(out, few, sizeof few),
              "max_new 100000: %d tokens (the context leaves %d), why %d", n, ctx - head, (int)why);
    for (int i = 0; i < ctx; i++) prompt[i] = 3 + i % 7;
    FL_REQUIRE_OK(fl_blip2_generate(c.b, c.px, prompt, ctx - head, 5, out, &n, &why));
    FL_CHECKF(n == 0 && why == FL_GEN_STOP_CONTEXT, "a prompt filling the context: %d tokens, why %d", n, (int)why);
    FL_CHECK(fl_blip2_generate(c.b, c.px, prompt, ctx - head + 1, 5, out, &n, &why) == FL_ERR_INVALID &&
             strstr(fl_error_message(), "exceed the language model's context of"));
    FL_CHECK(fl_blip2_generate(c.b, c.px, NULL, 0, -1, out, &n, &why) == FL_ERR_INVALID);
    free(out), free(prompt);
    close_tc(&c);
}
