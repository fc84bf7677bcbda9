/* QLoRA on BLIP-2 (finetune_lora --quantize: every part's block linears stored in 4 bits, bitsandbytes NF4 / FP4
 * blocks of 64 with or without double quantization; LoRA adapters on the language model; fl_blip2_load_ex with
 * fl_trainer_storage's 4-bit storage), both variants.
 *
 * Anchor (as the decoder's and T5's QLoRA tests): the fp32 BLIP-2 whose quantized entries hold the dequantized values
 * (fl_model_read_param of the 4-bit model), with the same adapters. The 4-bit linears dequantize tile by tile into the
 * same fp32 values and multiply as the fp32 GEMM does, so the logits and the loss are the same bits on the cpu backend
 * (within 1e-5 of their scale on the others, whose 4-bit kernels are their own); the adapters' gradients flow back
 * through the 4-bit linears' dX, which sums the tiles in another order than one GEMM: within fp32 noise, K u of their
 * scale for the widest inner dimension K (112 here: 6.7e-6; held to 1e-5).
 * That the quantization happened: the 4-bit model's logits are away from the original fp32 model's by far more than
 * fp32 noise (NF4 keeps about 3 bits). Then AdamW on the adapters lowers the loss. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/blip2.h"
#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/quant4.h"
#include "fitllm/train.h"
#include "blip2_batch.h"
#include "test.h"

/* LoRA r 4 on the language model's attention (OPT q_proj, v_proj; T5 q, v), B set away from 0 (PEFT's init has B = 0,
 * where A gets no gradient) */
static void add_lora(fl_blip2 *b, int t5) {
    fl_model *lm = fl_blip2_part(b, FL_BLIP2_TEXT);
    fl_lora_config lc;
    FL_REQUIRE_OK(fl_lora_config_init(&lc, &lm->cfg, 4, 8.0f, 0.0f, 0, t5 ? "q,v" : "q_proj,v_proj"));
    FL_REQUIRE_OK(fl_model_lora_init(lm, &lc, 11));
    fl_lora_adapters ad;
    FL_REQUIRE(fl_model_lora_adapters(lm, &ad));
    float *h = malloc(ad.numel * sizeof *h);
    FL_REQUIRE(h);
    FL_REQUIRE_OK(lm->be->to_host(lm->be, h, ad.params, ad.numel * sizeof *h));
    for (int j = 0; j < ad.n_mods; j++)
        for (size_t i = ad.off[2 * j + 1]; i < (j + 1 < ad.n_mods ? ad.off[2 * j + 2] : ad.numel); i++)
            h[i] = 0.05f * (float)((int)(i * 7 % 11) - 5);
    FL_REQUIRE_OK(lm->be->to_device(lm->be, ad.params, h, ad.numel * sizeof *h));
    free(h);
}

static double rel_err(const float *a, const float *b, size_t n) {
    double e = 0, sc = 0;
    for (size_t i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - b[i])), sc = fmax(sc, fabs((double)b[i]));
    return sc > 0 ? e / sc : e;
}

static void vs_dequantized(const char *dir, int t5, const char *mode) {
    b2_env env;
    b2_env_open(&env);
    b2_batch c;
    b2_batch_open(&c, dir, t5);
    fl_model_storage st[FL_BLIP2_PARTS];
    memset(st, 0, sizeof st);
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_q4_type qt;
        FL_REQUIRE_OK(fl_q4_parse_mode(mode, &qt, &st[k].q4_double_quant));
        st[k].param_dtype = FL_F32, st[k].quant4 = 1, st[k].q4_type = qt;
    }
    fl_blip2 *q = NULL, *d = NULL, *o = NULL;
    FL_REQUIRE_OK(fl_blip2_load_ex(&q, dir, &env.be, &env.pool, st));
    FL_REQUIRE_OK(fl_blip2_load(&d, dir, &env.be, &env.pool));
    FL_REQUIRE_OK(fl_blip2_load(&o, dir, &env.be, &env.pool));
    int nq = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) { /* d: the dequantized values in fp32 */
        fl_model *mq = fl_blip2_part(q, k), *md = fl_blip2_part(d, k);
        FL_CHECKF(fl_model_quant4(mq), "%s: part %d has no 4-bit entry", dir, k);
        for (int i = 0; i < mq->layout.n; i++) {
            if (!fl_model_param_is_q4(mq, i)) continue;
            float *w = malloc(mq->layout.params[i].numel * sizeof *w);
            FL_REQUIRE(w);
            fl_model_read_param(mq, i, w);
            fl_model_write_param(md, i, w);
            free(w);
            nq++;
        }
    }
    add_lora(q, t5), add_lora(d, t5), add_lora(o, t5);
    const size_t nl = b2_batch_logits(&c, q);
    float *lq = malloc(nl * sizeof *lq), *ld = malloc(nl * sizeof *ld), *lo = malloc(nl * sizeof *lo);
    FL_REQUIRE(lq && ld && lo);
    float lossq, lossd, losso;
    b2_batch_fwd_bwd(q, &c, lq, &lossq);
    b2_batch_fwd_bwd(d, &c, ld, &lossd);
    b2_batch_fwd_bwd(o, &c, lo, &losso);
    fl_lora_adapters aq, ad;
    FL_REQUIRE(fl_model_lora_adapters(fl_blip2_part(q, 2), &aq) && fl_model_lora_adapters(fl_blip2_part(d, 2), &ad));
    FL_REQUIRE(aq.numel == ad.numel);
    float *gq = malloc(aq.numel * sizeof *gq), *gd = malloc(aq.numel * sizeof *gd);
    FL_REQUIRE(gq && gd);
    FL_REQUIRE_OK(env.be.to_host(&env.be, gq, aq.grads, aq.numel * sizeof *gq));
    FL_REQUIRE_OK(env.be.to_host(&env.be, gd, ad.grads, ad.numel * sizeof *gd));
    /* Not bit for bit, on any backend: the 4-bit linears multiply dequantized panels with the fp32
     * GEMM (q4matmul.c), whose kernel may sum in another order than the dense linear's call (Zen 4's
     * AVX-512 build gave equal bits, Zen 3's AVX2 build 4.2e-7 of scale). The bound is fp32 GEMM
     * reordering over this model's few layers of K <= 128 sums: K * 2^-24 per layer ~ 1e-5. */
    const int bits = memcmp(lq, ld, nl * sizeof *lq) == 0 && lossq == lossd;
    const double el = rel_err(lq, ld, nl), eg = rel_err(gq, gd, aq.numel), eo = rel_err(lq, lo, nl);
    FL_CHECKF(el <= 1e-5 && fabs(lossq - lossd) <= 1e-5 * fabs(lossd), "%s %s: logits %.3g, loss %.9g vs %.9g", dir, mode,
              el, lossq, lossd);
    FL_CHECKF(eg <= 1e-5, "%s %s: adapter gradients %.3g of their scale from the dequantized model's", dir, mode, eg);
    FL_CHECKF(eo > 1e-3, "%s %s: the 4-bit logits are the fp32 model's (%.3g): nothing quantized?", dir, mode, eo);
    double gs = 0;
    for (size_t i = 0; i < aq.numel; i++) gs += fabs(gq[i]);
    FL_CHECKF(gs > 0, "%s %s: the adapters got no gradient", dir, mode);
    printf("      %s %s: %d 4-bit entries; logits and loss (%.6f) = the dequantized fp32 model's (%s), %zu adapter "
           "gradients within %.2g; %.3g from the unquantized model's logits (loss %.6f)\n", t5 ? "T5" : "OPT", mode, nq,
           lossq, bits ? "bits" : "within 1e-5", aq.numel, eg, eo, losso);
    /* AdamW on the adapters over the 4-bit base */
    fl_optim_config oc;
    fl_optim_config_default(&oc, FL_OPT_ADAMW);
    oc.lr = 1e-2f;
    fl_optimizer opt;
    FL_REQUIRE_OK(fl_optim_init(&opt, fl_blip2_part(q, FL_BLIP2_TEXT), &oc));
    float first = 0, last = 0;
    for (int s = 0; s < 6; s++) {
        b2_batch_fwd_bwd(q, &c, NULL, &last);
        if (!s) first = last;
        FL_REQUIRE_OK(fl_optim_step(&opt, oc.lr, 0.0f, NULL));
    }
    FL_CHECKF(last < first - 0.2f, "%s %s: QLoRA AdamW: loss %.4f -> %.4f", dir, mode, first, last);
    fl_optim_free(&opt);
    free(lq), free(ld), free(lo), free(gq), free(gd);
    b2_batch_close(&c);
    fl_blip2_free(q), fl_blip2_free(d), fl_blip2_free(o);
    b2_env_close(&env);
}

FL_TEST(blip2_opt_qlora_nf4_dq_vs_dequantized) { vs_dequantized("tests/fixtures/blip2-tiny-opt", 0, "bnb.nf4-dq"); }
FL_TEST(blip2_opt_qlora_fp4_vs_dequantized) { vs_dequantized("tests/fixtures/blip2-tiny-opt", 0, "bnb.fp4"); }
FL_TEST(blip2_t5_qlora_nf4_vs_dequantized) { vs_dequantized("tests/fixtures/blip2-tiny-t5", 1, "bnb.nf4"); }
