/* QLoRA end to end on a real model against transformers + bitsandbytes + PEFT
 * (tests/ref/qlora_ref.py -> tests/fixtures/qlora-ref.safetensors, tests/fixtures/qlora-adapter/):
 * ../shared/data/stories260K-hf stored in NF4 with double quantization, every quantized weight
 * dequantized vs bnb's, the 4-bit model's logits, and the logits with a PEFT LoRA adapter
 * (q_proj, v_proj, down_proj) attached unmerged on the 4-bit base as QLoRA runs it. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu-impl.h"
#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/model.h"
#include "fitllm/peft.h"
#include "fitllm/quant4.h"
#include "model/model-impl.h"
#include "lora/lora-impl.h"
#include "test.h"

#define QREF "tests/fixtures/qlora-ref.safetensors"
#define QADAPTER "tests/fixtures/qlora-adapter"

/* max |a - b| / max |b| (the logits compared at the scale of the tensor). */
static double scaled_err(const float *a, const float *b, size_t n) { return fl_test_scaled_err(a, b, n, NULL); }

/* Attach the PEFT adapter folder to m unmerged: fl_model_lora_init with the adapter's config,
 * then its A/B copied into the model's adapter slots (matched by layout entry). */
static fl_status attach_peft(fl_model *m, const char *dir) {
    fl_peft_adapter a;
    memset(&a, 0, sizeof a);
    FL_TRY(fl_peft_load(dir, &a));
    int *idx = NULL;
    fl_status s = fl_peft_check_model(&a, &m->cfg, &m->layout, NULL, &idx);
    if (s == FL_OK) s = fl_model_lora_init(m, &a.cfg.lora, 1);
    if (s == FL_OK) {
        struct fl_lora_state *st = m->lora;
        int found = 0;
        for (int k = 0; k < a.n; k++)
            for (int j = 0; j < st->n_mods; j++) {
                if (st->mods[j].param_index != idx[k]) continue;
                memcpy(st->params + st->off[2 * j], a.mods[k].A, (size_t)a.cfg.lora.r * a.mods[k].in * sizeof(float));
                memcpy(st->params + st->off[2 * j + 1], a.mods[k].B, (size_t)a.mods[k].out * a.cfg.lora.r * sizeof(float));
                found++;
            }
        if (found != a.n || found != st->n_mods)
            s = fl_errorf(FL_ERR_INVALID, "%s: %d of %d adapter modules matched %d model slots", dir, found, a.n,
                          st->n_mods);
        fl_model_lora_set_train(m, 0);
    }
    free(idx);
    fl_peft_free(&a);
    return s;
}

FL_TEST(qlora_vs_bitsandbytes_peft) {
    FL_SKIP_IF_NO_DATA();
    const char *dir = fl_test_data_path("stories260K-hf");
    char model_dir[1024];
    snprintf(model_dir, sizeof model_dir, "%s", dir);
    fl_st_file g;
    FL_REQUIRE_OK(fl_st_open(&g, QREF));
    const fl_st_tensor *ids = fl_st_find(&g, "ids"), *lb = fl_st_find(&g, "logits_base"),
                       *ll = fl_st_find(&g, "logits_lora");
    FL_REQUIRE(ids && lb && ll && ids->dtype == FL_I32 && ids->ndim == 2);
    const int B = (int)ids->shape[0], T = (int)ids->shape[1];

    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model m;
    fl_model_storage st = {.param_dtype = FL_F32, .quant4 = 1, .q4_type = FL_Q4_NF4, .q4_double_quant = 1};
    FL_REQUIRE_OK(fl_hf_load_model_ex(&m, model_dir, &be, &pool, &st));
    const int V = m.cfg.vocab_size;
    FL_REQUIRE(lb->shape[0] == B && lb->shape[1] == T && lb->shape[2] == V);

    /* ---- (a) every quantized weight, dequantized, vs bnb's dequantize_4bit ----------------------
     * The 4-bit codes must be the same: fitllm follows bnb's CUDA kernel, bnb quantized here on CPU,
     * and qlora_ref.py found all 226560 codes of this model equal under both rules. The dequantized
     * values differ only through the double-quantized absmax: bnb's offset is torch's fp32
     * absmax.mean(), fitllm's the float64 mean rounded once (quant4.h); they differ by one ulp in
     * 17 of the 35 weights (absmax off by ~1e-7 relative), and for 5 absmax values bnb's CPU
     * quantize_blockwise picks the neighbouring 8-bit code. Measured: 71699 of 226560 elements
     * differ, in 1289 of 3540 blocks; 4-bit codes differing 0; 5 blocks with another 8-bit absmax
     * code, worst absmax |diff| / absmax 2.97e-3. (qlora_ref.py counts the same 71699 between bnb
     * and the CUDA-rule reimplementation of quant4_ref.py.) */
    static const float nf4[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                                  -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                                  0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                                  0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                                  0.7229568362236023f, 1.0f};
    int n_q4 = 0, n_blocks = 0, n_blocks_diff = 0, n_blocks_code8 = 0;
    size_t n_el = 0, n_diff = 0, n_code_diff = 0;
    double worst_am = 0;
    float *buf = NULL;
    for (int i = 0; i < m.layout.n; i++) {
        if (!fl_model_param_is_q4(&m, i)) continue;
        const fl_param_info *pi = &m.layout.params[i];
        char name[FL_PARAM_NAME_MAX + 8];
        snprintf(name, sizeof name, "deq.%s", pi->name);
        const fl_st_tensor *t = fl_st_find(&g, name);
        FL_CHECKF(t != NULL, "fixture lacks %s", name);
        if (!t) continue;
        FL_REQUIRE(t->dtype == FL_F32 && t->shape[0] == pi->shape[0] && t->shape[1] == pi->shape[1]);
        FL_REQUIRE(pi->numel % 64 == 0);
        buf = realloc(buf, pi->numel * sizeof(float));
        FL_REQUIRE(buf);
        fl_model_read_param(&m, i, buf);
        const float *ref = t->data;
        n_q4++;
        n_el += pi->numel;
        /* per block of 64: the element of largest |x| has code +-1.0, so max |deq| is the block's
         * dequantized absmax exactly; the 4-bit code of every element is the NF4 level nearest to
         * deq / absmax (recovered on both sides and compared). */
        for (size_t b0 = 0; b0 < pi->numel; b0 += 64) {
            float am_o = 0, am_r = 0;
            int nd = 0;
            for (int e = 0; e < 64; e++) {
                am_o = fmaxf(am_o, fabsf(buf[b0 + e]));
                am_r = fmaxf(am_r, fabsf(ref[b0 + e]));
                nd += buf[b0 + e] != ref[b0 + e];
            }
            n_blocks++;
            n_diff += (size_t)nd;
            n_blocks_diff += nd > 0;
            double rel = fabs((double)am_o - am_r) / am_r;
            worst_am = fmax(worst_am, rel);
            n_blocks_code8 += rel > 1e-5; /* more than the offset's ulp: another 8-bit absmax code */
            for (int e = 0; e < 64; e++) {
                int qo = 0, qr = 0;
                for (int c = 1; c < 16; c++) {
                    if (fabsf(buf[b0 + e] / am_o - nf4[c]) < fabsf(buf[b0 + e] / am_o - nf4[qo])) qo = c;
                    if (fabsf(ref[b0 + e] / am_r - nf4[c]) < fabsf(ref[b0 + e] / am_r - nf4[qr])) qr = c;
                }
                if (qo != qr && !n_code_diff++)
                    fl_test_fail(__FILE__, __LINE__, "%s[%zu]: NF4 code %d vs bnb %d (%.9g vs %.9g)", pi->name,
                                 b0 + (size_t)e, qo, qr, buf[b0 + e], ref[b0 + e]);
            }
        }
    }
    free(buf);
    fprintf(stderr, "  qlora: %d 4-bit weights, %zu elements, %zu differ from bnb-cpu in %d of %d blocks; 4-bit codes "
                    "differing %zu; blocks whose absmax differs by more than the offset's ulp %d, worst absmax "
                    "|diff|/absmax %.3g\n",
            n_q4, n_el, n_diff, n_blocks_diff, n_blocks, n_code_diff, n_blocks_code8, worst_am);
    FL_CHECKF(n_q4 == 35 && n_el == 226560, "%d quantized weights, %zu elements", n_q4, n_el);
    FL_CHECKF(n_code_diff == 0, "%zu 4-bit codes differ from bnb's", n_code_diff);
    FL_CHECKF(n_blocks_diff <= 2000, "%d blocks differ from bnb (measured 1289)", n_blocks_diff);
    FL_CHECKF(n_blocks_code8 <= 10, "%d blocks with another double-quantized absmax than bnb (measured 5)",
              n_blocks_code8);
    FL_CHECKF(worst_am <= 1e-2, "dequantized absmax differs from bnb by %.3g (measured 2.97e-3)", worst_am);

    /* ---- (b) logits of the 4-bit model ----------------------------------------------------------- */
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, B, T));
    size_t nl = (size_t)B * T * V;
    float *logits = malloc(nl * sizeof(float));
    FL_REQUIRE(logits);
    FL_REQUIRE_OK(fl_model_forward(&m, ids->data, NULL, B, T, 0.0f, logits));
    double e_base = scaled_err(logits, lb->data, nl);

    /* ---- (c) the PEFT adapter on the 4-bit base (unmerged, as QLoRA) ----------------------------- */
    FL_REQUIRE_OK(attach_peft(&m, QADAPTER));
    FL_REQUIRE_OK(fl_model_alloc_acts(&m, B, T));
    FL_REQUIRE_OK(fl_model_forward(&m, ids->data, NULL, B, T, 0.0f, logits));
    double e_lora = scaled_err(logits, ll->data, nl);
    double adapter_effect = scaled_err(lb->data, ll->data, nl);
    fl_model_free(&m);

    /* ---- (d) the same in fp32 with bnb's dequantized weights written in and the adapter merged as
     * `generate --adapter` does (fl_peft_merge_into): isolates accumulation order from (a). */
    fl_model f;
    FL_REQUIRE_OK(fl_hf_load_model(&f, model_dir, &be, &pool));
    for (int i = 0; i < f.layout.n; i++) {
        char name[FL_PARAM_NAME_MAX + 8];
        snprintf(name, sizeof name, "deq.%s", f.layout.params[i].name);
        const fl_st_tensor *t = fl_st_find(&g, name);
        if (t) memcpy(fl_model_params_f32(&f) + f.layout.params[i].offset, t->data, f.layout.params[i].numel * sizeof(float));
    }
    FL_REQUIRE_OK(fl_model_alloc_acts(&f, B, T));
    FL_REQUIRE_OK(fl_model_forward(&f, ids->data, NULL, B, T, 0.0f, logits));
    double e_base32 = scaled_err(logits, lb->data, nl);
    fl_peft_adapter a;
    FL_REQUIRE_OK(fl_peft_load(QADAPTER, &a));
    int *idx = NULL;
    FL_REQUIRE_OK(fl_peft_check_model(&a, &f.cfg, &f.layout, NULL, &idx));
    free(idx);
    FL_REQUIRE_OK(fl_peft_merge_into(&a, &f.layout, fl_model_params_f32(&f)));
    fl_peft_free(&a);
    FL_REQUIRE_OK(fl_model_forward(&f, ids->data, NULL, B, T, 0.0f, logits));
    double e_lora32 = scaled_err(logits, ll->data, nl);
    fl_model_free(&f);

    fprintf(stderr, "  qlora logits max|diff|/max|ref|: 4-bit base %.3g, 4-bit + adapter %.3g; fp32 with bnb's "
                    "weights %.3g, + merged adapter %.3g (adapter moves the logits by %.3g)\n",
            e_base, e_lora, e_base32, e_lora32, adapter_effect);
    /* Measured (max |logits| ~21): 4-bit base 1.55e-4 and 4-bit + adapter 1.61e-4, dominated by the
     * 5 absmax blocks of (a), not by arithmetic; fp32 with bnb's weights 8.6e-7 and + merged adapter
     * 8.3e-7 (accumulation order only); the adapter itself moves the logits by 0.19 of max|logit|.
     * Tolerances: ~3x the measured values. */
    FL_CHECKF(e_base <= 5e-4, "4-bit logits vs bnb: %.3g (measured 1.55e-4)", e_base);
    FL_CHECKF(e_lora <= 5e-4, "4-bit + adapter logits vs PEFT: %.3g (measured 1.61e-4)", e_lora);
    FL_CHECKF(e_base32 <= 3e-6, "fp32 logits with bnb's weights vs bnb: %.3g (measured 8.6e-7)", e_base32);
    FL_CHECKF(e_lora32 <= 3e-6, "fp32 + merged adapter vs PEFT: %.3g (measured 8.3e-7)", e_lora32);
    FL_CHECKF(adapter_effect > 0.05, "the adapter barely changes the logits (%.3g): the test would not see it",
              adapter_effect);
    free(logits);
    fl_st_close(&g);
    fl_mem_pool_free(&pool);
}
