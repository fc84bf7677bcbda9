/* BLIP-2 under bf16-true (every part stored in bf16: fl_blip2_load_ex with fl_model_storage_for; blip2_pass.c widens
 * the entries it reads as fp32 into its staging and stages each layout group's gradient in fp32, rounded into the bf16
 * gradient once per micro-batch), both variants (the Flan-T5 language model through seq2seq.c's own 16-bit path).
 *
 * Anchor (as tests/test_t5_bf16true.c): the bf16-mixed run on the same bf16-exact weights, itself checked against
 * PyTorch's autocast (tests/test_blip2_prec.c). Both read the same bf16 values in every matmul and the same widened
 * values elsewhere (class token, positions, query tokens, norms, biases), and BLIP-2's arena keeps fp32 activations
 * under both, so the logits and the loss are the same bits and every bf16 gradient is the fp32 gradient rounded once.
 * The exception is the language model's token embedding where several additions meet it (OPT's tied head, then the
 * lookup; T5's encoder, decoder and head): each rounds to bf16 again, so it is held to one bf16 ulp (2^-8) of its
 * scale per addition. A gradient left in the fp32 staging, flushed into the wrong group or staged twice is zero,
 * misplaced or doubled: far outside. Then AdamW steps on the bf16 store: the loss falls. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/blip2.h"
#include "fitllm/io.h"
#include "fitllm/train.h"
#include "blip2_batch.h"
#include "test.h"

static void set_prec(fl_blip2 *b, const char *name) {
    fl_precision p;
    FL_REQUIRE_OK(fl_precision_find(name, &p));
    FL_REQUIRE_OK(fl_blip2_set_precision(b, &p));
    FL_REQUIRE_OK(fl_blip2_alloc_grads_parts(b, 7));
}

/* part k's gradients vs the fp32 ones; returns the mismatches, the worst relative error of the token embedding */
static void cmp_part(const fl_backend *be, fl_model *a, fl_model *m, const char *what, size_t *mism, double *worst_emb,
                     int *zero) {
    const size_t P = a->layout.numel;
    float *g32 = malloc(P * sizeof *g32);
    uint16_t *g16 = malloc(P * sizeof *g16);
    FL_REQUIRE(g32 && g16);
    FL_REQUIRE_OK(be->to_host(be, g32, fl_model_grads_f32(a), P * sizeof *g32));
    FL_REQUIRE_OK(be->to_host(be, g16, fl_model_grads_16(m), P * sizeof *g16));
    for (int i = 0; i < m->layout.n; i++) {
        const fl_param_info *pi = &m->layout.params[i];
        const float *ga = g32 + pi->offset;
        const uint16_t *gb = g16 + pi->offset;
        const int emb = !strcmp(what, "language model") && pi->group == 0 && !strstr(pi->name, "position");
        double mx = 0, m16 = 0;
        for (size_t k = 0; k < pi->numel; k++) mx = fmax(mx, fabs(ga[k])), m16 = fmax(m16, fabs(fl_bf16_to_f32(gb[k])));
        *zero += m16 == 0 && mx > 0;
        for (size_t k = 0; k < pi->numel; k++) {
            if (emb) {
                if (mx > 0) *worst_emb = fmax(*worst_emb, fabs((double)fl_bf16_to_f32(gb[k]) - ga[k]) / mx);
            } else if (gb[k] != fl_f32_to_bf16(ga[k]) && (*mism)++ < 5) {
                fl_test_fail(__FILE__, __LINE__, "%s %s[%zu]: bf16 gradient %g, fp32 %g", what, pi->name, k,
                             fl_bf16_to_f32(gb[k]), ga[k]);
            }
        }
    }
    free(g32), free(g16);
}

static void vs_mixed(const char *dir, int t5) {
    b2_env env;
    b2_env_open(&env);
    b2_batch c;
    b2_batch_open(&c, dir, t5);
    fl_precision bt;
    FL_REQUIRE_OK(fl_precision_find("bf16-true", &bt));
    fl_model_storage st[FL_BLIP2_PARTS];
    for (int k = 0; k < FL_BLIP2_PARTS; k++) fl_model_storage_for(&bt, &st[k]);
    /* A: fp32 storage holding the bf16-rounded weights, bf16-mixed (its bf16 copy equals the master) */
    fl_blip2 *a = NULL, *b = NULL;
    FL_REQUIRE_OK(fl_blip2_load(&a, dir, &env.be, &env.pool));
    FL_REQUIRE_OK(fl_blip2_load_ex(&b, dir, &env.be, &env.pool, st)); /* B: the loader rounds to nearest even */
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_model *ma = fl_blip2_part(a, k), *mb = fl_blip2_part(b, k);
        FL_CHECK(fl_model_params_f32(mb) == NULL && fl_model_params_16(mb) != NULL);
        for (int i = 0; i < ma->layout.n; i++) {
            const size_t n = ma->layout.params[i].numel;
            float *w = malloc(n * sizeof *w), *v = malloc(n * sizeof *v);
            FL_REQUIRE(w && v);
            fl_model_read_param(ma, i, w);
            for (size_t j = 0; j < n; j++) w[j] = fl_bf16_to_f32(fl_f32_to_bf16(w[j]));
            fl_model_write_param(ma, i, w);
            fl_model_read_param(mb, i, v);
            FL_CHECKF(memcmp(w, v, n * sizeof *w) == 0, "%s: the bf16 load of %s is not the rounded file", dir,
                      ma->layout.params[i].name);
            free(w), free(v);
        }
    }
    set_prec(a, "bf16-mixed");
    set_prec(b, "bf16-true");
    const size_t nl = b2_batch_logits(&c, a);
    float *la = malloc(nl * sizeof *la), *lb = malloc(nl * sizeof *lb);
    FL_REQUIRE(la && lb);
    float lossa, lossb;
    b2_batch_fwd_bwd(a, &c, la, &lossa);
    b2_batch_fwd_bwd(b, &c, lb, &lossb);
    FL_CHECKF(memcmp(la, lb, nl * sizeof *la) == 0, "%s: bf16-true logits differ from bf16-mixed's", dir);
    FL_CHECKF(lossa == lossb, "%s: loss %.9g (bf16-true) vs %.9g (bf16-mixed)", dir, lossb, lossa);
    static const char *const what[FL_BLIP2_PARTS] = {"vision tower", "Q-Former", "language model"};
    size_t mism = 0;
    int zero = 0, n = 0;
    double worst = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        cmp_part(&env.be, fl_blip2_part(a, k), fl_blip2_part(b, k), what[k], &mism, &worst, &zero);
        n += fl_blip2_part(a, k)->layout.n;
    }
    const int adds = t5 ? 3 : 2; /* T5: encoder, decoder, head; OPT: the tied head, then the lookup */
    FL_CHECKF(mism == 0, "%s: %zu bf16 gradients are not the once-rounded fp32 gradient", dir, mism);
    FL_CHECKF(zero == 0, "%s: %d gradients are zero in bf16 but not in fp32", dir, zero);
    FL_CHECKF(worst <= adds / 256.0, "%s: token embedding gradient off by %.3g of its scale (%d additions)", dir, worst,
              adds);
    printf("      %s bf16-true: logits and loss (%.6f) = bf16-mixed's bits; %d gradient tensors = bf16(fp32), the token "
           "embedding's within %.2g of its scale\n", t5 ? "T5" : "OPT", lossb, n - 1, worst);
    /* AdamW on the bf16 store (bf16 state, as the trainer's bf16-true), clipping the bf16 gradients: the loss falls */
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.lr = 3e-3f;
    fl_optimizer o[FL_BLIP2_PARTS];
    for (int k = 0; k < FL_BLIP2_PARTS; k++) FL_REQUIRE_OK(fl_optim_init(&o[k], fl_blip2_part(b, k), &oc));
    FL_CHECK(o[0].cfg.state_dtype == FL_BF16 && o[0].w.pt == FL_BF16);
    float first = 0, last = 0;
    for (int s = 0; s < 6; s++) {
        b2_batch_fwd_bwd(b, &c, NULL, &last);
        if (!s) first = last;
        for (int k = 0; k < FL_BLIP2_PARTS; k++) FL_REQUIRE_OK(fl_optim_step(&o[k], oc.lr, 1.0f, NULL));
    }
    FL_CHECKF(last < first - 0.5f, "%s: bf16-true AdamW: loss %.4f -> %.4f", dir, first, last);
    printf("      %s bf16-true, 6 AdamW steps: %.4f -> %.4f\n", t5 ? "T5" : "OPT", first, last);
    for (int k = 0; k < FL_BLIP2_PARTS; k++) fl_optim_free(&o[k]);
    free(la), free(lb);
    b2_batch_close(&c);
    fl_blip2_free(a);
    fl_blip2_free(b);
    b2_env_close(&env);
}

/* bf16 compute: the weight gradients of every part's blocks and of the language model's head come from bf16 operands,
 * dW += bf16(dy)^T bf16(x) (the decoder-only passes' dw_bf16; on a GPU fp32 x fp32 runs on the CUDA cores): a
 * bf16-mixed training pass issues exactly 2 fp32 x fp32 GEMMs, the two outer linears outside any block and head (the
 * patch embedding's and the language projection's dW, small), against every GEMM in fp32 under 32-true. The values:
 * the autocast comparisons (tests/test_blip2_prec.c) and vs_mixed above. */
static fl_status (*g_gemm_real)(const fl_backend *, int, int, int, int, int, float, const void *, fl_dtype, int,
                                const void *, fl_dtype, int, float, void *, fl_dtype, int);
static int g_f32f32, g_all;
static fl_status gemm_rec(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                          const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C,
                          fl_dtype tc, int ldc) {
    g_all++;
    g_f32f32 += ta == FL_F32 && tb == FL_F32;
    return g_gemm_real(be, trans_a, trans_b, M, N, K, alpha, A, ta, lda, B, tb, ldb, beta, C, tc, ldc);
}
static void dw_operands(const char *dir, int t5) {
    for (int mixed = 0; mixed < 2; mixed++) {
        b2_env env;
        b2_env_open(&env);
        b2_batch c;
        b2_batch_open(&c, dir, t5);
        fl_blip2 *a = NULL;
        FL_REQUIRE_OK(fl_blip2_load(&a, dir, &env.be, &env.pool));
        set_prec(a, mixed ? "bf16-mixed" : "32-true");
        g_gemm_real = env.be.gemm;
        env.be.gemm = gemm_rec;
        g_f32f32 = g_all = 0;
        float loss;
        b2_batch_fwd_bwd(a, &c, NULL, &loss);
        env.be.gemm = g_gemm_real;
        printf("      %s %s: %d GEMMs, %d fp32 x fp32, loss %.6f\n", t5 ? "T5" : "OPT", mixed ? "bf16-mixed" : "32-true",
               g_all, g_f32f32, loss);
        FL_CHECK(g_all > 10 && isfinite(loss));
        FL_CHECKF(mixed ? g_f32f32 == 2 : g_f32f32 == g_all, "%s %s: %d of %d GEMMs fp32 x fp32", dir,
                  mixed ? "bf16-mixed" : "32-true", g_f32f32, g_all);
        b2_batch_close(&c);
        fl_blip2_free(a);
        b2_env_close(&env);
    }
}
FL_TEST(blip2_bf16_weight_gradients_read_bf16) {
    dw_operands("tests/fixtures/blip2-tiny-opt", 0);
    dw_operands("tests/fixtures/blip2-tiny-t5", 1);
}

FL_TEST(blip2_opt_bf16_true_vs_mixed) { vs_mixed("tests/fixtures/blip2-tiny-opt", 0); }
FL_TEST(blip2_t5_bf16_true_vs_mixed) { vs_mixed("tests/fixtures/blip2-tiny-t5", 1); }

/* bf16-true needs the parts stored in bf16: a model loaded in fp32 is refused by name, as are fp16 storage and loss
 * scaling (16-true, 16-mixed) */
FL_TEST(blip2_bf16_true_needs_bf16_storage) {
    fl_backend be;
    fl_mem_pool pool, host;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    FL_REQUIRE_OK(fl_backend_pools_init(&be, &pool, &host, be.name, 0));
    fl_blip2 *b = NULL;
    FL_REQUIRE_OK(fl_blip2_load(&b, "tests/fixtures/blip2-tiny-opt", &be, &pool));
    fl_precision p;
    FL_REQUIRE_OK(fl_precision_find("bf16-true", &p));
    FL_CHECK(fl_blip2_set_precision(b, &p) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "fl_blip2_load_ex") != NULL, "%s", fl_error_message());
    fl_blip2_free(b);
    fl_backend_pools_free(&pool, &host);
    fl_backend_free(&be);
}
