/* bf16-true (16-bit parameter storage): the model stores parameters and gradients in bf16,
 * widens 1-D parameters into fp32 views, computes each group's gradients in fp32 and adds
 * them into bf16 once per micro-batch.
 *
 * Checks: (1) against the bf16-mixed path on the same bf16-exact weights: the matmuls read
 * the same bf16 values, so logits and loss are bit-identical and every bf16 gradient is
 * the fp32 gradient rounded once (tied embeddings: rounded twice, head then embedding,
 * within one bf16 ulp of the tensor scale); (2) exact memory: PARAMS and GRADS are 2 bytes
 * per parameter, WORKSPACE grows by the two staging buffers, AdamW state is bf16;
 * (3) save/load keeps the bf16 bits; (4) against PyTorch's bf16-true (model.to(bfloat16))
 * on the golden LLaMA (tests/ref/make_golden_prec.py). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/io.h"
#include "fitllm/model.h"
#include "fitllm/train.h"
#include "test.h"

static void fill_ids(int32_t *ids, int32_t *tg, int n, int V, uint64_t s) {
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = (int32_t)((s >> 33) % (uint64_t)V);
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        tg[i] = (i % 7 == 3) ? FL_IGNORE_INDEX : (int32_t)((s >> 33) % (uint64_t)V);
    }
}

static float bf(float x) { return fl_bf16_to_f32(fl_f32_to_bf16(x)); }

static void vs_mixed(const char *preset, int untie) {
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find(preset, &c));
    if (untie) c.tie_embeddings = 0;
    fl_backend be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    const int B = 2, T = 24, N = B * T;
    int32_t ids[48], tg[48];
    fill_ids(ids, tg, N, c.vocab_size, 99);
    long nv = 0;
    for (int i = 0; i < N; i++) nv += tg[i] != FL_IGNORE_INDEX;

    /* A: fp32 storage with bf16-exact weights, bf16-mixed (its bf16 copy equals the master) */
    fl_model a;
    FL_REQUIRE_OK(fl_model_init(&a, &c, &be, &pool));
    fl_model_init_random(&a, 5);
    for (size_t i = 0; i < a.layout.numel; i++) a.params[i] = bf(a.params[i]);
    FL_REQUIRE_OK(fl_model_set_precision(&a, fl_precision_get(FL_PREC_BF16_MIXED)));
    FL_REQUIRE_OK(fl_model_alloc_grads(&a));
    FL_REQUIRE_OK(fl_model_alloc_acts(&a, B, T));
    float *la = malloc((size_t)N * c.vocab_size * sizeof(float)), *lb = malloc((size_t)N * c.vocab_size * sizeof(float));
    FL_REQUIRE_OK(fl_model_forward(&a, ids, NULL, B, T, 0.0f, la));
    FL_REQUIRE_OK(fl_model_forward(&a, ids, tg, B, T, 1.0f / nv, NULL));
    FL_REQUIRE_OK(fl_model_backward(&a));

    /* B: bf16 storage with the same values */
    fl_model b;
    fl_model_storage st = {FL_BF16};
    size_t p0 = pool.cur[FL_TAG_PARAMS], w0 = pool.cur[FL_TAG_WORKSPACE], g0 = pool.cur[FL_TAG_GRADS];
    FL_REQUIRE_OK(fl_model_init_ex(&b, &c, &be, &pool, &st));
    FL_CHECK(b.params == NULL && b.p16 != NULL);
    FL_CHECK(pool.cur[FL_TAG_PARAMS] - p0 == b.layout.numel * 2);
    FL_CHECK(pool.cur[FL_TAG_WORKSPACE] - w0 == fl_sizing_pstage_elems(&c) * 4);
    for (int i = 0; i < b.layout.n; i++) fl_model_write_param(&b, i, a.params + a.layout.params[i].offset);
    FL_REQUIRE_OK(fl_model_set_precision(&b, fl_precision_get(FL_PREC_BF16_TRUE)));
    FL_CHECK(fl_model_set_precision(&b, fl_precision_get(FL_PREC_32_TRUE)) == FL_ERR_INVALID); /* storage is fixed */
    FL_REQUIRE_OK(fl_model_set_precision(&b, fl_precision_get(FL_PREC_BF16_TRUE)));
    FL_REQUIRE_OK(fl_model_alloc_grads(&b));
    FL_CHECK(b.grads == NULL && b.g16 != NULL);
    FL_CHECK(pool.cur[FL_TAG_GRADS] - g0 == b.layout.numel * 2);
    FL_CHECK(pool.cur[FL_TAG_WORKSPACE] - w0 == (fl_sizing_pstage_elems(&c) + fl_sizing_gstage_elems(&c)) * 4);
    FL_REQUIRE_OK(fl_model_alloc_acts(&b, B, T));
    FL_REQUIRE_OK(fl_model_forward(&b, ids, NULL, B, T, 0.0f, lb));
    FL_CHECK(memcmp(la, lb, (size_t)N * c.vocab_size * sizeof(float)) == 0);
    FL_REQUIRE_OK(fl_model_forward(&b, ids, tg, B, T, 1.0f / nv, NULL));
    FL_CHECKF(b.loss_sum == a.loss_sum, "%s: loss %.9g vs %.9g", preset, b.loss_sum, a.loss_sum);
    FL_REQUIRE_OK(fl_model_backward(&b));

    int tied_wte = c.tie_embeddings ? 0 : -1; /* layout entry 0 is the token embedding */
    size_t mism = 0;
    double worst_tied = 0;
    for (int i = 0; i < b.layout.n; i++) {
        const fl_param_info *p = &b.layout.params[i];
        const float *g32 = a.grads + p->offset;
        const uint16_t *g16 = b.g16 + p->offset;
        double mx = 0;
        for (size_t k = 0; k < p->numel; k++) mx = fmax(mx, fabs(g32[k]));
        for (size_t k = 0; k < p->numel; k++) {
            if (i == tied_wte) {
                double d = fabs((double)fl_bf16_to_f32(g16[k]) - g32[k]);
                if (mx > 0 && d / mx > worst_tied) worst_tied = d / mx;
            } else if (g16[k] != fl_f32_to_bf16(g32[k])) {
                if (mism++ < 5)
                    fl_test_fail(__FILE__, __LINE__, "%s %s[%zu]: bf16 grad %g, fp32 grad %g", preset, p->name, k,
                                 fl_bf16_to_f32(g16[k]), g32[k]);
            }
        }
    }
    FL_CHECKF(mism == 0, "%s: %zu gradients are not the once-rounded fp32 gradient", preset, mism);
    FL_CHECKF(worst_tied <= 1.0 / 256, "%s: tied embedding gradient off by %.3g of its scale", preset, worst_tied);
    printf("      %s%s: loss and logits identical to bf16-mixed; gradients = bf16(fp32)%s\n", preset,
           untie ? " (untied)" : "", c.tie_embeddings ? ", tied embedding within one bf16 ulp" : "");

    /* optimizer: AdamW state is bf16 under the policy (2 x 2 bytes per parameter) */
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    fl_optimizer o;
    size_t o0 = pool.cur[FL_TAG_OPTIM];
    FL_REQUIRE_OK(fl_optim_init(&o, &b, &oc));
    FL_CHECK(o.cfg.state_dtype == FL_BF16 && pool.cur[FL_TAG_OPTIM] - o0 == b.layout.numel * 4);
    FL_REQUIRE_OK(fl_optim_step(&o, 1e-3f, 1.0f, NULL));
    fl_optim_free(&o);

    /* save keeps the bf16 bits; reload into bf16 (bit-exact) and into fp32 (exact widening) */
    char dir[600];
    snprintf(dir, sizeof dir, "%s/bf16-%s-%d", fl_test_tmpdir(), preset, untie);
    FL_REQUIRE_OK(fl_hf_save_model(&b, dir));
    char f[700];
    snprintf(f, sizeof f, "%s/model.safetensors", dir);
    fl_st_file sf;
    FL_REQUIRE_OK(fl_st_open(&sf, f));
    FL_CHECK(sf.n_tensors > 0 && sf.tensors[0].dtype == FL_BF16);
    fl_st_close(&sf);
    fl_model r16, r32;
    FL_REQUIRE_OK(fl_hf_load_model_ex(&r16, dir, &be, &pool, &st));
    FL_CHECK(memcmp(r16.p16, b.p16, b.layout.numel * 2) == 0);
    FL_REQUIRE_OK(fl_hf_load_model(&r32, dir, &be, &pool));
    size_t bad = 0;
    for (size_t i = 0; i < b.layout.numel; i++) bad += r32.params[i] != fl_bf16_to_f32(b.p16[i]);
    FL_CHECK(bad == 0);
    fl_model_free(&r16);
    fl_model_free(&r32);

    free(la);
    free(lb);
    fl_model_free(&a);
    fl_model_free(&b);
    FL_CHECK(pool.cur_total == 0);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

FL_TEST(bf16_true_vs_mixed_llama_tied) { vs_mixed("micro", 0); }
FL_TEST(bf16_true_vs_mixed_llama_untied) { vs_mixed("micro", 1); }
FL_TEST(bf16_true_vs_mixed_gpt2) { vs_mixed("gpt2-micro", 0); }
