/* T5 gradient accumulation (issue 31 item 2): micro-batch 2 x 2 accumulated = one batch of 4. src/train/step.c runs
 * each micro-batch's forward + backward with grad scale 1 / (the step's target tokens) and lets the gradients add up
 * in the buffer; the one-batch step scales by the same count. So the two give the same gradients (hence the same
 * update) and the same loss sum, up to fp32 summation order.
 *
 * The batch: tests/fixtures/t5-tiny-gated's two rows (source 13, target 17, the second's last 3 source positions
 * padded and last 4 labels ignored) plus two more built like the second (one of them with other token ids). The
 * second micro-batch is cut to its longest source 10 / target 13 (padding to the longest in the micro-batch, as the
 * loader does), so the padding mask and ignored labels are exercised: the padded positions must add nothing.
 *
 * Tolerance, anchored independently of fitllm: per tensor the fixture's noise.<name> (PyTorch fp32's distance to the
 * float64 gradient of the same function, tests/ref/make_t5_fixture.py); each run may be that far from the exact value
 * (8 x it + 16 fp32 roundings of the scale, as tests/test_t5.c), so the two runs within twice that. The test can
 * fail: LitGPT-style per-micro-batch means (each micro-batch's mean loss / 2, here 30 and 26 target tokens) move
 * the gradients far outside that bound, checked below. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/io.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "test.h"

#define FIX "tests/fixtures/t5-tiny-gated"

typedef struct {
    int B, Ts, Tt;
    int32_t *src, *dec, *lab;
    uint8_t *mask;
} acc_batch;

static int remap(int t, int V) { return 2 + (t * 7 + 3) % (V - 2); }

/* the 4-row batch: fixture rows 0, 1, 1, and row 1 with remapped ids (its decoder input = start + labels[:-1]) */
static void build_batch(const fl_st_file *x, int V, acc_batch *b) {
    const fl_st_tensor *src = fl_st_find(x, "src"), *mask = fl_st_find(x, "src_mask"), *dec = fl_st_find(x, "dec"),
                       *lab = fl_st_find(x, "labels");
    FL_REQUIRE(src && mask && dec && lab && src->shape[0] == 2);
    const int Ts = (int)src->shape[1], Tt = (int)dec->shape[1];
    *b = (acc_batch){4, Ts, Tt, malloc(4 * Ts * sizeof(int32_t)), malloc(4 * Tt * sizeof(int32_t)),
                     malloc(4 * Tt * sizeof(int32_t)), malloc(4 * (size_t)Ts)};
    FL_REQUIRE(b->src && b->dec && b->lab && b->mask);
    const int32_t *s = src->data, *d = dec->data, *l = lab->data;
    const uint8_t *mk = mask->data;
    for (int r = 0; r < 4; r++) {
        const int f = r == 0 ? 0 : 1;
        for (int j = 0; j < Ts; j++) {
            b->mask[r * Ts + j] = mk[f * Ts + j];
            b->src[r * Ts + j] = r == 3 && mk[f * Ts + j] ? remap(s[f * Ts + j], V) : s[f * Ts + j];
        }
        for (int j = 0; j < Tt; j++) {
            const int32_t lj = l[f * Tt + j];
            b->lab[r * Tt + j] = r == 3 && lj != FL_IGNORE_INDEX ? remap(lj, V) : lj;
            b->dec[r * Tt + j] = d[f * Tt + j];
        }
        if (r == 3)
            for (int j = 1; j < Tt; j++)
                if (b->lab[r * Tt + j - 1] != FL_IGNORE_INDEX) b->dec[r * Tt + j] = b->lab[r * Tt + j - 1];
    }
}

/* rows [r0, r0 + n) of b cut to source Ts / target Tt (a micro-batch padded to its own longest) */
static void rows(const acc_batch *b, int r0, int n, int Ts, int Tt, acc_batch *o) {
    *o = (acc_batch){n, Ts, Tt, malloc(n * Ts * sizeof(int32_t)), malloc(n * Tt * sizeof(int32_t)),
                     malloc(n * Tt * sizeof(int32_t)), malloc((size_t)n * Ts)};
    FL_REQUIRE(o->src && o->dec && o->lab && o->mask);
    for (int r = 0; r < n; r++) {
        for (int j = 0; j < Ts; j++) {
            o->src[r * Ts + j] = b->src[(r0 + r) * b->Ts + j];
            o->mask[r * Ts + j] = b->mask[(r0 + r) * b->Ts + j];
        }
        for (int j = 0; j < Tt; j++) {
            o->dec[r * Tt + j] = b->dec[(r0 + r) * b->Tt + j];
            o->lab[r * Tt + j] = b->lab[(r0 + r) * b->Tt + j];
        }
    }
}

static void free_batch(acc_batch *b) { free(b->src), free(b->dec), free(b->lab), free(b->mask); }

static int n_valid(const acc_batch *b) {
    int n = 0;
    for (int i = 0; i < b->B * b->Tt; i++) n += b->lab[i] != FL_IGNORE_INDEX;
    return n;
}

/* forward + backward of mb (grad scale gs), adding into m's gradients; its loss sum added to *ls */
static void pass(fl_model *m, const acc_batch *mb, float gs, double *ls) {
    FL_REQUIRE_OK(fl_model_forward_s2s(m, mb->src, mb->mask, mb->dec, mb->lab, mb->B, mb->Ts, mb->Tt, gs, NULL));
    *ls += m->loss_sum;
    FL_REQUIRE_OK(fl_model_backward_s2s(m));
}

static void grads(const fl_model *m, float *out) {
    m->be->to_host(m->be, out, fl_model_grads_f32(m), m->layout.numel * sizeof(float));
}

static void load(fl_model *m, fl_backend *be, fl_mem_pool *pool, int B, int Ts, int Tt) {
    FL_REQUIRE_OK(fl_hf_load_model(m, FIX, be, pool));
    FL_REQUIRE_OK(fl_model_alloc_grads(m));
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(m, B, Ts, Tt));
    fl_model_zero_grads(m);
}

FL_TEST(t5_accumulation_2x2_equals_batch_4) {
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    fl_st_file x;
    FL_REQUIRE_OK(fl_st_open(&x, FIX "/expected.safetensors"));
    fl_model m;
    FL_REQUIRE_OK(fl_hf_load_model(&m, FIX, &be, &pool));
    const int V = m.cfg.vocab_size;
    fl_model_free(&m);
    acc_batch all = {0}, mb0 = {0}, mb1 = {0};
    build_batch(&x, V, &all);
    rows(&all, 0, 2, all.Ts, all.Tt, &mb0);
    rows(&all, 2, 2, all.Ts - 3, all.Tt - 4, &mb1); /* rows 2, 3: 10 source tokens, 13 labels */
    const int N = n_valid(&all), n0 = n_valid(&mb0), n1 = n_valid(&mb1);
    FL_REQUIRE(N == n0 + n1 && n0 == 30 && n1 == 26);

    /* one batch of 4 */
    load(&m, &be, &pool, 4, all.Ts, all.Tt);
    const size_t P = m.layout.numel;
    float *ga = malloc(P * sizeof(float)), *gb = malloc(P * sizeof(float)), *g0 = malloc(P * sizeof(float));
    FL_REQUIRE(ga && gb && g0);
    double la = 0, lb = 0;
    pass(&m, &all, 1.0f / (float)N, &la);
    grads(&m, ga);
    fl_model_free(&m);

    /* micro-batch 2, accumulated twice (as step.c: grad scale 1 / the step's tokens; no zeroing in between) */
    load(&m, &be, &pool, 2, all.Ts, all.Tt);
    pass(&m, &mb0, 1.0f / (float)N, &lb);
    grads(&m, g0);
    pass(&m, &mb1, 1.0f / (float)N, &lb);
    grads(&m, gb);

    FL_CHECKF(fabs(la - lb) <= 2.0 * (8.0 * ((const float *)fl_st_find(&x, "noise.loss")->data)[0] * N +
                                      16.0 * FLT_EPSILON * la),
              "loss sum: batch 4 %.9f, 2 x 2 accumulated %.9f", la, lb);
    double worst = 0;
    int wrong_far = 0;
    for (int i = 0; i < m.layout.n; i++) {
        const fl_param_info *p = &m.layout.params[i];
        char key[256];
        snprintf(key, sizeof key, "noise.%s", p->name);
        const fl_st_tensor *nz = fl_st_find(&x, key);
        FL_CHECKF(nz != NULL, "%s: no noise for %s", FIX, p->name);
        if (!nz) continue;
        double e = 0, ew = 0, s = 0;
        for (size_t k = p->offset; k < p->offset + p->numel; k++) {
            /* LitGPT's per-micro-batch means: (g0_sum / n0 + g1_sum / n1) / 2 with g_sum = g * N */
            const double wrong = 0.5 * ((double)g0[k] * N / n0 + ((double)gb[k] - g0[k]) * N / n1);
            e = fmax(e, fabs((double)ga[k] - gb[k]));
            ew = fmax(ew, fabs((double)ga[k] - wrong));
            s = fmax(s, fabs((double)ga[k]));
        }
        const double bound = 2.0 * (8.0 * ((const float *)nz->data)[0] + 16.0 * FLT_EPSILON * s);
        FL_CHECKF(e <= bound, "gradient of %s: batch 4 vs 2 x 2 accumulated: %.3g, bound %.3g (scale %.3g)", p->name, e,
                  bound, s);
        worst = fmax(worst, e / bound);
        wrong_far += ew > 10.0 * bound;
    }
    /* the check discriminates: per-micro-batch means land far outside the bound on most tensors */
    FL_CHECKF(wrong_far >= m.layout.n / 2, "per-micro-batch means outside 10 x the bound on only %d of %d tensors",
              wrong_far, m.layout.n);
    printf("      loss sum %.8f vs %.8f; %d gradients, worst %.2f of the bound; per-micro-batch means: %d far off\n", la,
           lb, m.layout.n, worst, wrong_far);
    free(ga), free(gb), free(g0);
    free_batch(&all), free_batch(&mb0), free_batch(&mb1);
    fl_model_free(&m);
    fl_st_close(&x);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}
