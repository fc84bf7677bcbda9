/* T5 with 16-bit parameter storage (bf16-true's store: src/model/seq2seq.c widens the final norms' weights and the
 * relative bias tables into the store's fp32 staging, stages each layout group's gradients in fp32 and adds them into
 * the bf16 gradients once per pass), on tests/fixtures/t5-tiny-relu (tied head) and t5-tiny-gated.
 *
 * Anchor (as tests/test_bf16true.c for the decoder-only models): the bf16-mixed path on the same bf16-exact weights,
 * itself checked against PyTorch's autocast in tests/test_t5_prec.c. Both read the same bf16 values in every matmul
 * and the same widened 1-D values, so the logits and the loss are the same bits, and every bf16 gradient is the fp32
 * gradient rounded once. The one exception is the shared embedding (both stacks, and with a tied head the head too
 * add into it in turn): each addition rounds to bf16 again, so it is held to one bf16 ulp (2^-8) of its scale per
 * addition. A missed stage (a gradient left in the fp32 staging, or flushed into the wrong group) leaves gradients
 * zero or doubled: far outside.
 *
 * 16-true (fp16 storage) is held to 16-mixed the same way on fp16-exact weights (fp16's ulp 2^-11 for the embedding),
 * with the gradients scaled by 1024 / (valid targets) as a loss scale would (fp16's range: the unscaled gradients of
 * these tiny models would round to subnormals, where a conversion that flushes them is not PyTorch's rounding). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/io.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "test.h"

typedef struct {
    fl_dtype dt;                      /* FL_BF16 or FL_F16 */
    fl_precision_kind mixed, true16;
    float grad_scale;                 /* times 1 / (valid targets) */
    double ulp;                       /* the 16-bit format's unit roundoff */
    const char *mn, *tn;
} s16_case;
static const s16_case k_bf16 = {FL_BF16, FL_PREC_BF16_MIXED, FL_PREC_BF16_TRUE, 1.0f, 1.0 / 256, "bf16-mixed", "bf16-true"};
static const s16_case k_fp16 = {FL_F16, FL_PREC_16_MIXED, FL_PREC_16_TRUE, 1024.0f, 1.0 / 2048, "16-mixed", "16-true"};

static uint16_t to16(const s16_case *c, float x) { return c->dt == FL_F16 ? fl_f32_to_f16(x) : fl_f32_to_bf16(x); }
static float from16(const s16_case *c, uint16_t h) { return c->dt == FL_F16 ? fl_f16_to_f32(h) : fl_bf16_to_f32(h); }

static void vs_mixed(const char *dir, const s16_case *c) {
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    char p[256];
    snprintf(p, sizeof p, "%s/expected.safetensors", dir);
    fl_st_file x;
    FL_REQUIRE_OK(fl_st_open(&x, p));
    const fl_st_tensor *src = fl_st_find(&x, "src"), *mask = fl_st_find(&x, "src_mask"), *dec = fl_st_find(&x, "dec"),
                       *lab = fl_st_find(&x, "labels");
    FL_REQUIRE(src && mask && dec && lab);
    const int B = (int)src->shape[0], Ts = (int)src->shape[1], Tt = (int)dec->shape[1];
    int nv = 0;
    for (int i = 0; i < B * Tt; i++) nv += ((const int32_t *)lab->data)[i] != FL_IGNORE_INDEX;

    const float gs = c->grad_scale / (float)nv;
    /* A: fp32 storage with 16-bit-exact weights under the mixed policy (its 16-bit copy equals the master) */
    fl_model a;
    FL_REQUIRE_OK(fl_hf_load_model(&a, dir, &be, &pool));
    const size_t P = a.layout.numel;
    float *w = malloc(P * sizeof(float)), *g32 = malloc(P * sizeof(float));
    uint16_t *g16 = malloc(P * sizeof(uint16_t));
    FL_REQUIRE(w && g32 && g16);
    FL_REQUIRE_OK(be.to_host(&be, w, fl_model_params_f32(&a), P * sizeof(float))); /* device memory: copied */
    for (size_t i = 0; i < P; i++) w[i] = from16(c, to16(c, w[i]));
    FL_REQUIRE_OK(be.to_device(&be, fl_model_params_f32(&a), w, P * sizeof(float)));
    FL_REQUIRE_OK(fl_model_set_precision(&a, fl_precision_get(c->mixed)));
    FL_REQUIRE_OK(fl_model_alloc_grads(&a));
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&a, B, Ts, Tt));
    const size_t nl = (size_t)B * Tt * a.cfg.vocab_size;
    float *la = malloc(nl * sizeof(float)), *lb = malloc(nl * sizeof(float));
    FL_REQUIRE(la && lb);
    fl_model_zero_grads(&a);
    FL_REQUIRE_OK(fl_model_forward_s2s(&a, src->data, mask->data, dec->data, NULL, B, Ts, Tt, 0, la));
    FL_REQUIRE_OK(fl_model_forward_s2s(&a, src->data, mask->data, dec->data, lab->data, B, Ts, Tt, gs, NULL));
    FL_REQUIRE_OK(fl_model_backward_s2s(&a));

    /* B: 16-bit storage holding the same values, the *-true policy */
    fl_model b;
    fl_model_storage stor = {.param_dtype = c->dt};
    FL_REQUIRE_OK(fl_model_init_ex(&b, &a.cfg, &be, &pool, &stor));
    FL_CHECK(fl_model_params_f32(&b) == NULL && fl_model_params_16(&b) != NULL);
    for (int i = 0; i < b.layout.n; i++) fl_model_write_param(&b, i, w + a.layout.params[i].offset);
    FL_REQUIRE_OK(fl_model_set_precision(&b, fl_precision_get(c->true16)));
    FL_REQUIRE_OK(fl_model_alloc_grads(&b));
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&b, B, Ts, Tt));
    fl_model_zero_grads(&b);
    FL_REQUIRE_OK(fl_model_forward_s2s(&b, src->data, mask->data, dec->data, NULL, B, Ts, Tt, 0, lb));
    FL_CHECKF(memcmp(la, lb, nl * sizeof(float)) == 0, "%s: %s logits differ from %s's", dir, c->tn, c->mn);
    FL_REQUIRE_OK(fl_model_forward_s2s(&b, src->data, mask->data, dec->data, lab->data, B, Ts, Tt, gs, NULL));
    FL_CHECKF(b.loss_sum == a.loss_sum, "%s: loss sum %.9g vs %.9g", dir, b.loss_sum, a.loss_sum);
    FL_REQUIRE_OK(fl_model_backward_s2s(&b));
    FL_REQUIRE_OK(be.to_host(&be, g32, fl_model_grads_f32(&a), P * sizeof(float)));
    FL_REQUIRE_OK(be.to_host(&be, g16, fl_model_grads_16(&b), P * sizeof(uint16_t)));

    const int adds = a.cfg.tie_embeddings ? 3 : 2; /* the shared embedding: encoder, decoder (, head) */
    size_t mism = 0;
    double worst_emb = 0;
    int nonzero = 0;
    for (int i = 0; i < b.layout.n; i++) {
        const fl_param_info *pi = &b.layout.params[i];
        const float *ga = g32 + pi->offset;
        const uint16_t *gb = g16 + pi->offset;
        double mx = 0, m16 = 0;
        for (size_t k = 0; k < pi->numel; k++) mx = fmax(mx, fabs(ga[k])), m16 = fmax(m16, fabs(from16(c, gb[k])));
        nonzero += m16 > 0;
        for (size_t k = 0; k < pi->numel; k++) {
            if (i == 0) { /* layout entry 0: the shared token embedding */
                const double d = fabs((double)from16(c, gb[k]) - ga[k]);
                if (mx > 0) worst_emb = fmax(worst_emb, d / mx);
            } else if (gb[k] != to16(c, ga[k]) && mism++ < 5) {
                fl_test_fail(__FILE__, __LINE__, "%s %s %s[%zu]: 16-bit gradient %g, fp32 %g", dir, c->tn, pi->name, k,
                             from16(c, gb[k]), ga[k]);
            }
        }
    }
    FL_CHECKF(mism == 0, "%s %s: %zu gradients are not the once-rounded fp32 gradient", dir, c->tn, mism);
    FL_CHECKF(nonzero == b.layout.n, "%s: %d of %d gradients are all zero", dir, b.layout.n - nonzero, b.layout.n);
    FL_CHECKF(worst_emb <= adds * c->ulp, "%s: shared embedding gradient off by %.3g of its scale (%d additions)", dir,
              worst_emb, adds);
    printf("      %s %s: logits and loss = %s's bits; %d gradients = 16-bit(fp32), the embedding's within %.2g of "
           "its scale\n", dir, c->tn, c->mn, b.layout.n - 1, worst_emb);

    /* an AdamW step on the 16-bit store runs (its state bf16; fp16's fp32) */
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    fl_optimizer o;
    FL_REQUIRE_OK(fl_optim_init(&o, &b, &oc));
    FL_REQUIRE_OK(fl_optim_step(&o, 1e-3f, 1.0f, NULL));
    fl_optim_free(&o);
    free(la), free(lb), free(w), free(g32), free(g16);
    fl_model_free(&b);
    fl_model_free(&a);
    fl_st_close(&x);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}

FL_TEST(t5_relu_bf16_storage_vs_mixed) { vs_mixed("tests/fixtures/t5-tiny-relu", &k_bf16); }
FL_TEST(t5_gated_bf16_storage_vs_mixed) { vs_mixed("tests/fixtures/t5-tiny-gated", &k_bf16); }
FL_TEST(t5_relu_fp16_storage_vs_mixed) { vs_mixed("tests/fixtures/t5-tiny-relu", &k_fp16); }
FL_TEST(t5_gated_fp16_storage_vs_mixed) { vs_mixed("tests/fixtures/t5-tiny-gated", &k_fp16); }
