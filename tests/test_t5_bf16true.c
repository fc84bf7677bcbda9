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
 * zero or doubled: far outside. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/io.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "test.h"

static float r16(float x) { return fl_bf16_to_f32(fl_f32_to_bf16(x)); }

static void vs_mixed(const char *dir) {
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

    /* A: fp32 storage with bf16-exact weights under bf16-mixed (its bf16 copy equals the master) */
    fl_model a;
    FL_REQUIRE_OK(fl_hf_load_model(&a, dir, &be, &pool));
    const size_t P = a.layout.numel;
    float *w = malloc(P * sizeof(float)), *g32 = malloc(P * sizeof(float));
    uint16_t *g16 = malloc(P * sizeof(uint16_t));
    FL_REQUIRE(w && g32 && g16);
    FL_REQUIRE_OK(be.to_host(&be, w, fl_model_params_f32(&a), P * sizeof(float))); /* device memory: copied */
    for (size_t i = 0; i < P; i++) w[i] = r16(w[i]);
    FL_REQUIRE_OK(be.to_device(&be, fl_model_params_f32(&a), w, P * sizeof(float)));
    FL_REQUIRE_OK(fl_model_set_precision(&a, fl_precision_get(FL_PREC_BF16_MIXED)));
    FL_REQUIRE_OK(fl_model_alloc_grads(&a));
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&a, B, Ts, Tt));
    const size_t nl = (size_t)B * Tt * a.cfg.vocab_size;
    float *la = malloc(nl * sizeof(float)), *lb = malloc(nl * sizeof(float));
    FL_REQUIRE(la && lb);
    fl_model_zero_grads(&a);
    FL_REQUIRE_OK(fl_model_forward_s2s(&a, src->data, mask->data, dec->data, NULL, B, Ts, Tt, 0, la));
    FL_REQUIRE_OK(fl_model_forward_s2s(&a, src->data, mask->data, dec->data, lab->data, B, Ts, Tt, 1.0f / nv, NULL));
    FL_REQUIRE_OK(fl_model_backward_s2s(&a));

    /* B: bf16 storage holding the same values, bf16-true */
    fl_model b;
    fl_model_storage stor = {.param_dtype = FL_BF16};
    FL_REQUIRE_OK(fl_model_init_ex(&b, &a.cfg, &be, &pool, &stor));
    FL_CHECK(fl_model_params_f32(&b) == NULL && fl_model_params_16(&b) != NULL);
    for (int i = 0; i < b.layout.n; i++) fl_model_write_param(&b, i, w + a.layout.params[i].offset);
    FL_REQUIRE_OK(fl_model_set_precision(&b, fl_precision_get(FL_PREC_BF16_TRUE)));
    FL_REQUIRE_OK(fl_model_alloc_grads(&b));
    FL_REQUIRE_OK(fl_model_alloc_acts_s2s(&b, B, Ts, Tt));
    fl_model_zero_grads(&b);
    FL_REQUIRE_OK(fl_model_forward_s2s(&b, src->data, mask->data, dec->data, NULL, B, Ts, Tt, 0, lb));
    FL_CHECKF(memcmp(la, lb, nl * sizeof(float)) == 0, "%s: bf16-true logits differ from bf16-mixed's", dir);
    FL_REQUIRE_OK(fl_model_forward_s2s(&b, src->data, mask->data, dec->data, lab->data, B, Ts, Tt, 1.0f / nv, NULL));
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
        for (size_t k = 0; k < pi->numel; k++) mx = fmax(mx, fabs(ga[k])), m16 = fmax(m16, fabs(fl_bf16_to_f32(gb[k])));
        nonzero += m16 > 0;
        for (size_t k = 0; k < pi->numel; k++) {
            if (i == 0) { /* layout entry 0: the shared token embedding */
                const double d = fabs((double)fl_bf16_to_f32(gb[k]) - ga[k]);
                if (mx > 0) worst_emb = fmax(worst_emb, d / mx);
            } else if (gb[k] != fl_f32_to_bf16(ga[k]) && mism++ < 5) {
                fl_test_fail(__FILE__, __LINE__, "%s %s[%zu]: bf16 gradient %g, fp32 %g", dir, pi->name, k,
                             fl_bf16_to_f32(gb[k]), ga[k]);
            }
        }
    }
    FL_CHECKF(mism == 0, "%s: %zu gradients are not the once-rounded fp32 gradient", dir, mism);
    FL_CHECKF(nonzero == b.layout.n, "%s: %d of %d gradients are all zero", dir, b.layout.n - nonzero, b.layout.n);
    FL_CHECKF(worst_emb <= adds / 256.0, "%s: shared embedding gradient off by %.3g of its scale (%d additions)", dir,
              worst_emb, adds);
    printf("      %s: logits and loss = bf16-mixed's bits; %d gradients = bf16(fp32), the embedding's within %.2g of "
           "its scale\n", dir, b.layout.n - 1, worst_emb);

    /* an AdamW step on the bf16 store runs (its state bf16) */
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

FL_TEST(t5_relu_bf16_storage_vs_mixed) { vs_mixed("tests/fixtures/t5-tiny-relu"); }
FL_TEST(t5_gated_bf16_storage_vs_mixed) { vs_mixed("tests/fixtures/t5-tiny-gated"); }
