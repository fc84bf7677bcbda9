/* T5's dropout in training (issue 31; src/model/seq2seq.c, the block graphs' DROPOUT ops in src/model/arch_t5.c,
 * backend.h's dropout op, the attention ops' fl_attn_desc.drop_p): transformers' T5 drops after the embeddings, on
 * the attention weights, after each sublayer (self-attention, cross-attention, FFN) before its residual add, inside
 * the FFN before wo, and after each stack's final norm (the places and masks against transformers: tests/test_t5.c
 * t5_*_dropout_vs_transformers).
 *
 * Anchors, none of them fitllm's own output:
 *   - the mask statistics: the op on 2^20 ones keeps a fraction within 4.5 sigma of 1 - p (binomial), every kept
 *     value 1 / (1 - p) exactly; two sites' masks agree as often as independent ones would (within 4.5 sigma);
 *   - dropout off (no dropout_on, an evaluation forward, or dropout_rate 0): the bits of the model without dropout;
 *   - the same micro-batch seed twice: the same bits; another seed: another loss;
 *   - central finite differences of the loss (float64 sums of fp32 per-token losses) on a fixed mask (the same seed
 *     for every evaluation) against the backward's gradients: the backward must regenerate the forward's masks at
 *     every site. The test can fail: the gradient without dropout differs from the finite differences by far more
 *     than the bound at the checked entries (checked below), so a backward that ignored a site's mask would too;
 *   - activation checkpointing (the blocks recomputed in the backward with the same masks): the same bits. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "model/model-impl.h"
#include "test.h"

#define FIX "tests/fixtures/t5-tiny-gated"

typedef struct {
    int B, Ts, Tt, nv;
    const int32_t *src, *dec, *lab;
    const uint8_t *mask;
} drop_batch;

static void batch(const fl_st_file *x, drop_batch *b) {
    const fl_st_tensor *src = fl_st_find(x, "src"), *mask = fl_st_find(x, "src_mask"), *dec = fl_st_find(x, "dec"),
                       *lab = fl_st_find(x, "labels");
    FL_REQUIRE(src && mask && dec && lab);
    *b = (drop_batch){(int)src->shape[0], (int)src->shape[1], (int)dec->shape[1], 0, src->data, dec->data, lab->data,
                      mask->data};
    for (int i = 0; i < b->B * b->Tt; i++) b->nv += b->lab[i] != FL_IGNORE_INDEX;
}

/* the fixture's model with dropout_rate p, dropping in training passes when on (fl_model_set_dropout), checkpointed
 * when ckpt */
static void load(fl_model *m, fl_backend *be, fl_mem_pool *pool, const drop_batch *b, float p, int on, int ckpt) {
    FL_REQUIRE_OK(fl_hf_load_model(m, FIX, be, pool));
    m->cfg.dropout_rate = p;
    FL_REQUIRE_OK(fl_model_set_dropout(m, on));
    m->act_ckpt = ckpt;
    FL_REQUIRE_OK(fl_model_alloc_grads(m));
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(m, b->B, b->Ts, b->Tt));
}

/* a training forward + backward under micro-batch seed `seed`: the mean loss, the gradients into g (or NULL) */
static double train_pass(fl_model *m, const drop_batch *b, uint64_t seed, float *g) {
    fl_model_zero_grads(m);
    fl_model_adapters_seed(m, seed);
    FL_REQUIRE_OK_R(fl_model_forward_s2s(m, b->src, b->mask, b->dec, b->lab, b->B, b->Ts, b->Tt, 1.0f / (float)b->nv,
                                         NULL), NAN);
    const double loss = m->loss_sum / (double)b->nv;
    FL_REQUIRE_OK_R(fl_model_backward_s2s(m), NAN);
    if (g) m->be->to_host(m->be, g, fl_model_grads_f32(m), m->layout.numel * sizeof(float));
    return loss;
}

/* the same training forward's loss without the backward (the finite differences' evaluations) */
static double train_loss(fl_model *m, const drop_batch *b, uint64_t seed) {
    fl_model_adapters_seed(m, seed);
    FL_REQUIRE_OK_R(fl_model_forward_s2s(m, b->src, b->mask, b->dec, b->lab, b->B, b->Ts, b->Tt, 1.0f / (float)b->nv,
                                         NULL), NAN);
    return m->loss_sum / (double)b->nv;
}

FL_TEST(t5_dropout_mask_statistics) {
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    const size_t n = (size_t)1 << 20;
    float *h = malloc(n * sizeof(float)), *h2 = malloc(n * sizeof(float)), *d = NULL;
    FL_REQUIRE(h && h2);
    FL_REQUIRE_OK(fl_mem_alloc(&pool, FL_TAG_OTHER, n * sizeof(float), (void **)&d));
    const float ps[3] = {0.1f, 0.5f, 0.9f};
    for (int k = 0; k < 3; k++) {
        const float p = ps[k];
        for (size_t i = 0; i < n; i++) h[i] = 1.0f;
        FL_REQUIRE_OK(be.to_device(&be, d, h, n * sizeof(float)));
        FL_REQUIRE_OK(FL_RUN(&be, dropout, d, d, n, p, fl_dropout_seed(42, 16), 0));
        FL_REQUIRE_OK(be.to_host(&be, h, d, n * sizeof(float)));
        /* a second site of the same micro-batch */
        for (size_t i = 0; i < n; i++) h2[i] = 1.0f;
        FL_REQUIRE_OK(be.to_device(&be, d, h2, n * sizeof(float)));
        FL_REQUIRE_OK(FL_RUN(&be, dropout, d, d, n, p, fl_dropout_seed(42, 17), 0));
        FL_REQUIRE_OK(be.to_host(&be, h2, d, n * sizeof(float)));
        const float sc = fl_lora_dropout_scale(p);
        size_t kept = 0, both = 0, bad = 0;
        for (size_t i = 0; i < n; i++) {
            kept += h[i] != 0.0f;
            both += h[i] != 0.0f && h2[i] != 0.0f;
            bad += h[i] != 0.0f && h[i] != sc;
        }
        const double q = 1.0 - p, sd = sqrt(n * q * (1 - q)), sd2 = sqrt(n * q * q * (1 - q * q));
        printf("      p %.1f: kept %zu of %zu (expected %.0f +- %.0f), both sites %zu (expected %.0f +- %.0f)\n", p,
               kept, n, n * q, sd, both, n * q * q, sd2);
        FL_CHECKF(fabs((double)kept - n * q) <= 4.5 * sd, "p %g: kept %zu, expected %.0f +- %.0f", p, kept, n * q, sd);
        FL_CHECKF(fabs((double)both - n * q * q) <= 4.5 * sd2, "p %g: both sites kept %zu", p, both);
        FL_CHECKF(bad == 0, "p %g: %zu kept values are not 1 / (1 - p)", p, bad);
    }
    /* accumulate: y += mask(x) with the same mask */
    for (size_t i = 0; i < n; i++) h[i] = 2.0f;
    FL_REQUIRE_OK(be.to_device(&be, d, h, n * sizeof(float)));
    float *x = NULL;
    FL_REQUIRE_OK(fl_mem_alloc(&pool, FL_TAG_OTHER, n * sizeof(float), (void **)&x));
    for (size_t i = 0; i < n; i++) h2[i] = 1.0f;
    FL_REQUIRE_OK(be.to_device(&be, x, h2, n * sizeof(float)));
    FL_REQUIRE_OK(FL_RUN(&be, dropout, d, x, n, 0.5f, 7, 1));
    FL_REQUIRE_OK(be.to_host(&be, h, d, n * sizeof(float)));
    size_t wrong = 0;
    for (size_t i = 0; i < n; i++) wrong += h[i] != (fl_lora_dropout_keep(7, i, 0.5f) ? 4.0f : 2.0f);
    FL_CHECKF(wrong == 0, "accumulate: %zu values off", wrong);
    FL_CHECK(FL_RUN(&be, dropout, d, x, n, 1.0f, 7, 0) != FL_OK); /* p outside [0, 1) */
    fl_mem_free(&pool, x);
    fl_mem_free(&pool, d);
    free(h), free(h2);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

/* dropout off gives the bits of the model without it: dropout_rate 0.1 with dropout_on for an evaluation forward
 * (the graphs' DROPOUT ops copy), and without dropout_on for training; on, the same seed twice gives the same bits,
 * another seed another loss, and checkpointing the same bits */
FL_TEST(t5_dropout_off_same_bits_on_deterministic) {
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    fl_st_file x;
    FL_REQUIRE_OK(fl_st_open(&x, FIX "/expected.safetensors"));
    drop_batch b;
    batch(&x, &b);
    fl_model m0, m1;
    load(&m0, &be, &pool, &b, 0.0f, 0, 0);
    const size_t P = m0.layout.numel, NL = (size_t)b.B * b.Tt * m0.cfg.vocab_size;
    float *g0 = malloc(P * sizeof(float)), *g1 = malloc(P * sizeof(float)), *g2 = malloc(P * sizeof(float));
    float *l0 = malloc(NL * sizeof(float)), *l1 = malloc(NL * sizeof(float));
    FL_REQUIRE(g0 && g1 && g2 && l0 && l1);
    const double a0 = train_pass(&m0, &b, 5, g0);
    FL_REQUIRE_OK(fl_model_forward_s2s(&m0, b.src, b.mask, b.dec, b.lab, b.B, b.Ts, b.Tt, 0, l0));
    fl_model_free(&m0);

    /* dropout_rate 0.1 without dropout_on: training is today's */
    load(&m1, &be, &pool, &b, 0.1f, 0, 0);
    double a1 = train_pass(&m1, &b, 5, g1);
    FL_CHECKF(a1 == a0 && same_bits(g0, g1, P), "dropout_rate 0.1 not on: loss %.9g vs %.9g", a1, a0);
    fl_model_free(&m1);

    /* on: evaluation has no dropout (the graph's DROPOUT ops copy): the logits' bits; training differs */
    load(&m1, &be, &pool, &b, 0.1f, 1, 0);
    FL_REQUIRE_OK(fl_model_forward_s2s(&m1, b.src, b.mask, b.dec, b.lab, b.B, b.Ts, b.Tt, 0, l1));
    FL_CHECKF(same_bits(l0, l1, NL), "evaluation with dropout_rate 0.1 on: logits differ from dropout 0");
    a1 = train_pass(&m1, &b, 5, g1);
    const double a2 = train_pass(&m1, &b, 5, g2);
    FL_CHECKF(a1 == a2 && same_bits(g1, g2, P), "the same seed twice: loss %.9g vs %.9g", a1, a2);
    const double a3 = train_pass(&m1, &b, 6, NULL);
    printf("      loss without dropout %.7f, with (seed 5) %.7f, (seed 6) %.7f\n", a0, a1, a3);
    FL_CHECKF(a1 != a0 && a3 != a1, "dropout changes nothing: %.9g %.9g %.9g", a0, a1, a3);
    fl_model_free(&m1);

    /* dropout 0 on: today's bits (the graphs are the ones without dropout) */
    load(&m1, &be, &pool, &b, 0.0f, 1, 0);
    const double a4 = train_pass(&m1, &b, 5, g2);
    FL_CHECKF(a4 == a0 && same_bits(g0, g2, P), "dropout_rate 0 on: loss %.9g vs %.9g", a4, a0);
    fl_model_free(&m1);

    /* activation checkpointing: the recomputed blocks draw the same masks */
    load(&m1, &be, &pool, &b, 0.1f, 1, 1);
    const double a5 = train_pass(&m1, &b, 5, g2);
    FL_CHECKF(a5 == a1 && same_bits(g1, g2, P), "checkpointing with dropout: loss %.9g vs %.9g", a5, a1);
    FL_CHECK(m1.ckpt_recomputed > 0);
    fl_model_free(&m1);

    free(g0), free(g1), free(g2), free(l0), free(l1);
    fl_st_close(&x);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* central finite differences of the training loss on a fixed mask (p 0.5: every site's mask moves the gradient
 * far) at each tensor's two largest gradient entries: tensors behind every site (the shared embedding: the
 * embeddings' dropout; o / EncDecAttention.o / wo: the sublayers'; wi_0 / wi_1: the FFN's; the final norms; the
 * relative bias and a cross-attention q: the attention weights') */
FL_TEST(t5_dropout_gradients_finite_differences) {
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    fl_st_file x;
    FL_REQUIRE_OK(fl_st_open(&x, FIX "/expected.safetensors"));
    drop_batch b;
    batch(&x, &b);
    fl_model m;
    load(&m, &be, &pool, &b, 0.0f, 0, 0);
    const size_t P = m.layout.numel;
    float *g = malloc(P * sizeof(float)), *gn = malloc(P * sizeof(float)), *w = malloc(P * sizeof(float));
    FL_REQUIRE(g && gn && w);
    train_pass(&m, &b, 9, gn); /* no dropout */
    fl_model_free(&m);
    load(&m, &be, &pool, &b, 0.5f, 1, 0);
    train_pass(&m, &b, 9, g);
    float *pd = fl_model_params_f32(&m);
    FL_REQUIRE_OK(be.to_host(&be, w, pd, P * sizeof(float)));
    static const char *const names[] = {
        "shared.weight",
        "encoder.block.0.layer.0.SelfAttention.o.weight",
        "encoder.block.1.layer.1.DenseReluDense.wo.weight",
        "encoder.block.0.layer.1.DenseReluDense.wi_0.weight",
        "decoder.block.0.layer.0.SelfAttention.o.weight",
        "decoder.block.2.layer.1.EncDecAttention.o.weight",
        "decoder.block.1.layer.2.DenseReluDense.wi_1.weight",
        "decoder.block.2.layer.2.DenseReluDense.wo.weight",
        "encoder.final_layer_norm.weight",
        "decoder.final_layer_norm.weight",
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "decoder.block.1.layer.1.EncDecAttention.q.weight",
    };
    const double h = 2e-3;
    double worst = 0, far_min = INFINITY;
    int n = 0;
    for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
        const int pi = fl_layout_find(&m.layout, names[k]);
        FL_REQUIRE(pi >= 0);
        const fl_param_info *e = &m.layout.params[pi];
        size_t best[2] = {0, 0};
        for (size_t i = 1; i < e->numel; i++) { /* the two largest |gradient| entries */
            const float v = fabsf(g[e->offset + i]);
            if (v > fabsf(g[e->offset + best[0]])) best[1] = best[0], best[0] = i;
            else if (i != best[0] && v > fabsf(g[e->offset + best[1]])) best[1] = i;
        }
        for (int j = 0; j < 2; j++) {
            const size_t o = e->offset + best[j];
            const float w0 = w[o];
            float v = w0 + (float)h;
            FL_REQUIRE_OK(be.to_device(&be, pd + o, &v, sizeof v));
            const double lp = train_loss(&m, &b, 9);
            v = w0 - (float)h;
            FL_REQUIRE_OK(be.to_device(&be, pd + o, &v, sizeof v));
            const double lm = train_loss(&m, &b, 9);
            FL_REQUIRE_OK(be.to_device(&be, pd + o, &w0, sizeof w0));
            /* the step actually taken (w0 +- h rounded to fp32) */
            const double fd = (lp - lm) / ((double)(w0 + (float)h) - (double)(w0 - (float)h));
            /* bound: the central difference's rounding (the fp32 loss to ~1e-6, over 2h = 4e-3: 2.5e-4) and its
             * truncation (h^2 times the third derivative: 1% of these entries; at h 1e-2 it reached 10%) */
            const double err = fabs(fd - g[o]), bound = 3e-4 + 0.01 * fabs(fd);
            const double err_nodrop = fabs(fd - gn[o]);
            if (err / bound > worst) worst = err / bound;
            if (err_nodrop / bound < far_min) far_min = err_nodrop / bound;
            FL_CHECKF(err <= bound, "%s[%zu]: gradient %.6g vs finite differences %.6g (bound %.2g)", names[k],
                      best[j], g[o], fd, bound);
            n++;
        }
    }
    printf("      %d entries: worst %.2f of the bound; the gradient without dropout at least %.1f x the bound away\n",
           n, worst, far_min);
    FL_CHECKF(far_min > 1.0, "the checked entries cannot tell the masks apart (%.2f)", far_min);
    fl_model_free(&m);
    free(g), free(gn), free(w);
    fl_st_close(&x);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

/* ---- the attention op's dropout against a float64 loop (fl_attn_desc.drop_p) ------------------------------------ */

/* the float64 attention of one (b, h, t) row with the weights dropped by factor f (fitllm/lora.h's mask); backward
 * given dO: dq, dk, dv, dbias added */
typedef struct {
    int B, Tq, Tk, NH, HD, causal;
    float p;
    uint64_t seed;
} ref_attn;

static double ref_factor(const ref_attn *r, int b, int h, int t, int j) {
    const size_t i = (((size_t)b * r->NH + h) * r->Tq + t) * r->Tk + j;
    return fl_lora_dropout_keep(r->seed, i, r->p) ? (double)fl_lora_dropout_scale(r->p) : 0.0;
}

static void ref_attention(const ref_attn *r, const float *q, const float *k, const float *v, const float *bias,
                          const uint8_t *km, const float *dO, double *out, double *dq, double *dk, double *dv,
                          double *dbias) {
    const int C = r->NH * r->HD, HD = r->HD;
    double P[128], S[128];
    for (int b = 0; b < r->B; b++)
        for (int h = 0; h < r->NH; h++)
            for (int t = 0; t < r->Tq; t++) {
                const float *qr = q + ((size_t)b * r->Tq + t) * C + h * HD, *g = dO + ((size_t)b * r->Tq + t) * C + h * HD;
                double mx = -INFINITY, sum = 0, D = 0;
                for (int j = 0; j < r->Tk; j++) {
                    const int vis = km[b * r->Tk + j] && (!r->causal || j <= t + r->Tk - r->Tq);
                    double s = bias[((size_t)h * r->Tq + t) * r->Tk + j];
                    for (int d = 0; d < HD; d++) s += (double)qr[d] * k[((size_t)b * r->Tk + j) * C + h * HD + d];
                    S[j] = vis ? s : -INFINITY;
                    if (S[j] > mx) mx = S[j];
                }
                for (int j = 0; j < r->Tk; j++) sum += P[j] = S[j] == -INFINITY ? 0 : exp(S[j] - mx);
                double *o = out + ((size_t)b * r->Tq + t) * C + h * HD;
                for (int j = 0; j < r->Tk; j++) {
                    P[j] /= sum;
                    const double pd = P[j] * ref_factor(r, b, h, t, j);
                    for (int d = 0; d < HD; d++) {
                        o[d] += pd * v[((size_t)b * r->Tk + j) * C + h * HD + d];
                        dv[((size_t)b * r->Tk + j) * C + h * HD + d] += pd * g[d];
                    }
                }
                for (int d = 0; d < HD; d++) D += g[d] * o[d];
                for (int j = 0; j < r->Tk; j++) {
                    double dpd = 0;
                    for (int d = 0; d < HD; d++) dpd += g[d] * (double)v[((size_t)b * r->Tk + j) * C + h * HD + d];
                    const double ds = P[j] * (ref_factor(r, b, h, t, j) * dpd - D);
                    dbias[((size_t)h * r->Tq + t) * r->Tk + j] += ds;
                    for (int d = 0; d < HD; d++) {
                        dq[((size_t)b * r->Tq + t) * C + h * HD + d] += ds * k[((size_t)b * r->Tk + j) * C + h * HD + d];
                        dk[((size_t)b * r->Tk + j) * C + h * HD + d] += ds * qr[d];
                    }
                }
            }
}

static float urand(uint64_t *s) { /* [-1, 1) */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (float)((z ^ (z >> 31)) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

static float *dev_copy(fl_backend *be, fl_mem_pool *pool, const void *h, size_t bytes) {
    void *d = NULL;
    FL_REQUIRE_OK_R(fl_mem_alloc(pool, FL_TAG_OTHER, bytes, &d), NULL);
    FL_REQUIRE_OK_R(be->to_device(be, d, h, bytes), NULL);
    return d;
}

static double max_err(const float *dev_host, const double *ref, size_t n, double *scale) {
    double e = 0;
    *scale = 0;
    for (size_t i = 0; i < n; i++) e = fmax(e, fabs(dev_host[i] - ref[i])), *scale = fmax(*scale, fabs(ref[i]));
    return e;
}

/* several key and query tiles (Tq 40, Tk 70 / 40 causal), a key padding mask and a bias, p 0.3: out and every
 * gradient within 1e-5 of their scale of the float64 loop with the same mask (fp32 sums of ~70 terms: ~1e-6); the
 * undropped result is far (the test can fail) */
FL_TEST(t5_dropout_attention_op_vs_float64) {
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    for (int causal = 0; causal < 2; causal++) {
        ref_attn r = {2, 40, causal ? 40 : 70, 2, 12, causal, 0.3f, 0x5eed + causal};
        const int C = r.NH * r.HD;
        const size_t nq = (size_t)r.B * r.Tq * C, nk = (size_t)r.B * r.Tk * C, nb = (size_t)r.NH * r.Tq * r.Tk;
        float *hq = malloc(nq * 4), *hk = malloc(nk * 4), *hv = malloc(nk * 4), *hb = malloc(nb * 4), *hg = malloc(nq * 4);
        uint8_t *hm = malloc((size_t)r.B * r.Tk);
        double *ro = calloc(nq, 8), *rdq = calloc(nq, 8), *rdk = calloc(nk, 8), *rdv = calloc(nk, 8), *rdb = calloc(nb, 8);
        float *got = malloc((nb > nk ? nb : nk) * 4);
        FL_REQUIRE(hq && hk && hv && hb && hg && hm && ro && rdq && rdk && rdv && rdb && got);
        uint64_t s = 99 + causal;
        for (size_t i = 0; i < nq; i++) hq[i] = urand(&s) * 0.5f, hg[i] = urand(&s);
        for (size_t i = 0; i < nk; i++) hk[i] = urand(&s) * 0.5f, hv[i] = urand(&s);
        for (size_t i = 0; i < nb; i++) hb[i] = urand(&s);
        for (int i = 0; i < r.B * r.Tk; i++) hm[i] = i % r.Tk < r.Tk - 5 * (i / r.Tk); /* row 1: its last 5 padded */
        ref_attention(&r, hq, hk, hv, hb, hm, hg, ro, rdq, rdk, rdv, rdb);
        fl_attn_desc a = {r.B, r.Tq, r.Tk, r.NH, r.NH, r.HD, C, C, C, C, 1.0f, causal, r.p, r.seed};
        float *q = dev_copy(&be, &pool, hq, nq * 4), *k = dev_copy(&be, &pool, hk, nk * 4),
              *v = dev_copy(&be, &pool, hv, nk * 4), *bias = dev_copy(&be, &pool, hb, nb * 4),
              *g = dev_copy(&be, &pool, hg, nq * 4);
        uint8_t *km = (uint8_t *)dev_copy(&be, &pool, hm, (size_t)r.B * r.Tk);
        memset(got, 0, (nb > nk ? nb : nk) * 4);
        float *out = dev_copy(&be, &pool, got, nq * 4), *dq = dev_copy(&be, &pool, got, nq * 4),
              *dk = dev_copy(&be, &pool, got, nk * 4), *dv = dev_copy(&be, &pool, got, nk * 4),
              *db = dev_copy(&be, &pool, got, nb * 4), *lse = dev_copy(&be, &pool, got, (size_t)r.B * r.NH * r.Tq * 4);
        FL_REQUIRE_OK(FL_RUN(&be, attention_forward, &a, out, lse, q, k, v, bias, km));
        FL_REQUIRE_OK(FL_RUN(&be, attention_backward, &a, dq, dk, dv, db, g, q, k, v, bias, km, out, lse));
        const struct { const char *name; float *d; const double *ref; size_t n; } cmp[5] = {
            {"out", out, ro, nq}, {"dq", dq, rdq, nq}, {"dk", dk, rdk, nk}, {"dv", dv, rdv, nk}, {"dbias", db, rdb, nb}};
        for (int i = 0; i < 5; i++) {
            FL_REQUIRE_OK(be.to_host(&be, got, cmp[i].d, cmp[i].n * 4));
            double sc, e = max_err(got, cmp[i].ref, cmp[i].n, &sc);
            printf("      %s p %.1f: %s error %.2g (scale %.2g)\n", causal ? "causal" : "bidirectional", r.p,
                   cmp[i].name, e, sc);
            FL_CHECKF(e <= 1e-5 * sc, "%s %s: error %.3g of scale %.3g", causal ? "causal" : "bidir", cmp[i].name, e, sc);
        }
        /* without dropout the output is far from the dropped reference */
        a.drop_p = 0;
        FL_REQUIRE_OK(FL_RUN(&be, attention_forward, &a, out, lse, q, k, v, bias, km));
        FL_REQUIRE_OK(be.to_host(&be, got, out, nq * 4));
        double sc, e = max_err(got, ro, nq, &sc);
        FL_CHECKF(e > 100 * 1e-5 * sc, "undropped output %.3g from the dropped reference", e);
        a.drop_p = 1.0f;
        FL_CHECK(FL_RUN(&be, attention_forward, &a, out, lse, q, k, v, bias, km) == FL_ERR_INVALID);
        free(hq), free(hk), free(hv), free(hb), free(hg), free(hm), free(ro), free(rdq), free(rdk), free(rdv), free(rdb);
        free(got);
        void *dev[12] = {q, k, v, bias, g, km, out, dq, dk, dv, db, lse};
        for (int i = 0; i < 12; i++) fl_mem_free(&pool, dev[i]);
    }
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}
