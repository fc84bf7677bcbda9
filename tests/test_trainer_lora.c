/* LoRA and QLoRA training end to end: the loss goes down with the adapters alone (GRADS and OPTIM hold exactly the
 * adapters), the step checkpoints are PEFT adapter folders, final/ is the merged model and final/adapter the PEFT
 * adapter that merges to it; the head's adapters; QLoRA on a 4-bit base. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitllm/checkpoint.h"
#include "fitllm/config.h"
#include "fitllm/io.h"
#include "fitllm/peft.h"
#include "fitllm/trainer.h"
#include "test.h"
#include "trainer_runs.h"

/* A 25-step LoRA run at lr 1e-2 (no checkpoints): the loss must drop by 0.3. */
static void lora_train(fl_run_config *c, const char *what, rec *r, fl_trainer_result *res) {
    c->optimizer.lr = 1e-2f;
    c->train.max_steps = 25;
    c->train.save_interval = 0;
    FL_REQUIRE_OK(fl_trainer_run(c, NULL, 0, record, r, res));
    double first = (r->loss[0] + r->loss[1]) / 2, last = (r->loss[23] + r->loss[24]) / 2;
    FL_CHECKF(last < first - 0.3, "%s loss %.3f -> %.3f", what, first, last);
    printf("      %s: loss %.3f -> %.3f\n", what, first, last);
}

/* Analytic adapter elements of lora_run's targets (q, v and the MLP of every layer, r (in + out)
 * each), plus the head's r (C + V) when it is adapted; GRADS and OPTIM must hold exactly these. */
static size_t check_adapter_bytes(const fl_model_config *mc, const fl_run_config *c, const fl_trainer_result *res) {
    size_t C = mc->dim, KVD = (size_t)mc->n_kv_heads * mc->head_dim, QD = (size_t)mc->n_heads * mc->head_dim;
    size_t F = mc->ffn_dim, rr = c->lora.r;
    size_t per = rr * (C + QD) + rr * (C + KVD) + 2 * rr * (C + F) + rr * (F + C);
    size_t n = per * mc->n_layers + (c->lora.head ? rr * (C + (size_t)mc->vocab_size) : 0);
    FL_CHECKF(res->peak[FL_TAG_GRADS] == n * 4, "GRADS %zu, adapters %zu x 4", res->peak[FL_TAG_GRADS], n);
    FL_CHECKF(res->peak[FL_TAG_OPTIM] == n * 8, "OPTIM %zu, adapters %zu x 8", res->peak[FL_TAG_OPTIM], n);
    return n;
}

/* LoRA: loss goes down; GRADS and OPTIM hold the adapters only (analytic count);
 * final/ is the merged model and final/adapter the PEFT adapter that merges to it. */
FL_TEST(trainer_lora_trains_adapters_only) {
    FL_SKIP_IF_NO_DATA();
    fl_run_config c;
    char out[512];
    snprintf(out, sizeof out, "%s/lora", fl_test_tmpdir());
    small_run(&c, out);
    lora_run(&c);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", fl_test_data_path("stories260K-hf"));
    rec r = {0};
    fl_trainer_result res;
    lora_train(&c, "LoRA q,v,mlp stories260K-hf", &r, &res);
    fl_model_config mc;
    FL_REQUIRE_OK(fl_hf_load_config(fl_test_data_path("stories260K-hf/config.json"), &mc));
    FL_REQUIRE_OK(fl_config_validate(&mc));
    check_adapter_bytes(&mc, &c, &res);
    /* the PEFT adapter merged into the base equals final/ */
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model base, fin;
    FL_REQUIRE_OK(fl_hf_load_model(&base, fl_test_data_path("stories260K-hf"), &be, &pool));
    FL_REQUIRE_OK(fl_hf_load_model(&fin, res.final_dir, &be, &pool));
    char ad[700];
    snprintf(ad, sizeof ad, "%s/adapter", res.final_dir);
    fl_peft_adapter a;
    FL_REQUIRE_OK(fl_peft_load(ad, &a));
    FL_CHECK(a.n == 5 * mc.n_layers && a.cfg.lora.r == c.lora.r); /* q, v, gate, up, down */
    FL_REQUIRE_OK(fl_peft_merge_into(&a, &base.layout, fl_model_params_f32(&base)));
    double md = 0;
    for (size_t i = 0; i < base.layout.numel; i++) {
        double d = fabs((double)fl_model_params_f32(&base)[i] - fl_model_params_f32(&fin)[i]);
        if (d > md) md = d;
    }
    FL_CHECKF(md <= 1e-6, "merged adapter differs from final/ by %.3g", md);
    fl_peft_free(&a);
    fl_model_free(&base);
    fl_model_free(&fin);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
    free(r.params);
}

/* The hook of trainer_lora_step_checkpoints_are_peft_adapters: after step 2's checkpoint, put a
 * merge_lora output (a subfolder with a file) into it, as `fitllm merge_lora out/step-000002` does. */
static int put_merged_into_step2(void *ud, long step, double loss, const void *params, size_t bytes) {
    const char *out = ud;
    char p[700];
    if (step != 2) return 0;
    snprintf(p, sizeof p, "%s/step-000002/merged", out);
    FL_CHECK(mkdir(p, 0755) == 0);
    snprintf(p, sizeof p, "%s/step-000002/merged/config.json", out);
    FILE *f = fopen(p, "w");
    FL_CHECK(f != NULL);
    if (f) fclose(f);
    return 0;
}

/* Every step checkpoint of a LoRA run is a PEFT adapter folder (as PEFT's checkpoint-N/): the
 * adapter of that step, naming the base by its absolute path (usable from any directory), that
 * merged into the base gives the run's model; rotation removes an old one whole, also with a
 * merge_lora output inside. */
FL_TEST(trainer_lora_step_checkpoints_are_peft_adapters) {
    FL_SKIP_IF_NO_DATA();
    fl_run_config c;
    char out[512], p[4400], base_abs[PATH_MAX];
    snprintf(out, sizeof out, "%s/lora-steps", fl_test_tmpdir());
    small_run(&c, out);
    lora_run(&c);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", fl_test_data_path("stories260K-hf"));
    FL_REQUIRE(realpath(c.checkpoint_dir, base_abs) != NULL);
    c.train.max_steps = 4;
    c.train.save_interval = 2;
    c.train.keep_checkpoints = 1;
    c.optimizer.lr = 1e-2f;
    fl_trainer_result res;
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, put_merged_into_step2, out, &res));
    snprintf(p, sizeof p, "%s/step-000002", out);
    FL_CHECKF(access(p, F_OK) != 0, "rotation left %s (with a merged/ subfolder) behind", p);
    snprintf(p, sizeof p, "%s/step-000004", out);
    FL_REQUIRE(fl_ckpt_is_committed(p));
    fl_peft_adapter a, fa;
    FL_REQUIRE_OK(fl_peft_load(p, &a));
    FL_CHECKF(!strcmp(a.cfg.base_model, base_abs), "base_model_name_or_path '%s', want the absolute '%s'",
              a.cfg.base_model, base_abs);
    fl_model_config mc;
    FL_REQUIRE_OK(fl_hf_load_config(fl_test_data_path("stories260K-hf/config.json"), &mc));
    FL_CHECK(a.n == 5 * mc.n_layers && a.cfg.lora.r == c.lora.r); /* q, v, gate, up, down */
    /* step 4 is the last step: its adapter is final/adapter's, and merged into the base it is final/ */
    snprintf(p, sizeof p, "%s/adapter", res.final_dir);
    FL_REQUIRE_OK(fl_peft_load(p, &fa));
    FL_REQUIRE(fa.n == a.n);
    for (int k = 0; k < a.n; k++) {
        size_t na = (size_t)a.cfg.lora.r * a.mods[k].in, nb = (size_t)a.mods[k].out * a.cfg.lora.r;
        FL_CHECKF(!strcmp(a.mods[k].name, fa.mods[k].name) && !memcmp(a.mods[k].A, fa.mods[k].A, na * 4) &&
                  !memcmp(a.mods[k].B, fa.mods[k].B, nb * 4), "module %s differs from final/adapter", a.mods[k].name);
    }
    fl_backend be;
    FL_REQUIRE_OK(fl_cpu_backend_init(&be, 1));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model base, fin;
    FL_REQUIRE_OK(fl_hf_load_model(&base, base_abs, &be, &pool));
    FL_REQUIRE_OK(fl_hf_load_model(&fin, res.final_dir, &be, &pool));
    double mx = 0, md = 0;
    for (size_t i = 0; i < base.layout.numel; i++) mx = fmax(mx, fabs((double)fl_model_params_f32(&base)[i] - fl_model_params_f32(&fin)[i]));
    FL_CHECKF(mx > 1e-4, "the adapters did not move the weights (max change %.3g)", mx);
    FL_REQUIRE_OK(fl_peft_merge_into(&a, &base.layout, fl_model_params_f32(&base)));
    for (size_t i = 0; i < base.layout.numel; i++) md = fmax(md, fabs((double)fl_model_params_f32(&base)[i] - fl_model_params_f32(&fin)[i]));
    FL_CHECKF(md <= 1e-6, "step-000004's adapter merged into the base differs from final/ by %.3g", md);
    fl_peft_free(&a);
    fl_peft_free(&fa);
    fl_model_free(&base);
    fl_model_free(&fin);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

/* An untied copy of stories260K-hf (whose head is tied): lm_head.weight = the embeddings,
 * tie_word_embeddings false, written to dir. */
static void untied_stories(const char *dir) {
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model tied, un;
    FL_REQUIRE_OK(fl_hf_load_model(&tied, fl_test_data_path("stories260K-hf"), &be, &pool));
    FL_REQUIRE(tied.cfg.tie_embeddings);
    fl_model_config mc = tied.cfg;
    mc.tie_embeddings = 0;
    FL_REQUIRE_OK(fl_model_init(&un, &mc, &be, &pool));
    for (int i = 0; i < un.layout.n; i++) {
        const fl_param_info *p = &un.layout.params[i];
        const char *src = strcmp(p->name, "lm_head.weight") ? p->name : "model.embed_tokens.weight";
        memcpy(fl_model_params_f32(&un) + p->offset, fl_model_param(&tied, src), p->numel * sizeof(float));
    }
    FL_REQUIRE_OK(fl_hf_save_model(&un, dir));
    fl_model_free(&tied);
    fl_model_free(&un);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
}

/* LoRA with lora_head on an untied model: loss goes down; GRADS / OPTIM are the adapters'
 * including the head's r (C + V); the head base stays frozen (only final/ changes it, by the
 * merge); the PEFT adapter holds lm_head and merges into the base to final/. */
FL_TEST(trainer_lora_head_trains_adapters_only) {
    FL_SKIP_IF_NO_DATA();
    char base[512], out[512];
    snprintf(base, sizeof base, "%s/stories-untied", fl_test_tmpdir());
    untied_stories(base);
    fl_run_config c;
    snprintf(out, sizeof out, "%s/lora-head", fl_test_tmpdir());
    small_run(&c, out);
    lora_run(&c);
    c.lora.head = 1;
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", base);
    snprintf(c.tokenizer_dir, sizeof c.tokenizer_dir, "%s", fl_test_data_path("stories260K-hf"));
    rec r = {0};
    fl_trainer_result res;
    lora_train(&c, "LoRA q,v,mlp,head on untied stories260K", &r, &res);
    fl_model_config mc;
    char cp[600];
    snprintf(cp, sizeof cp, "%s/config.json", base);
    FL_REQUIRE_OK(fl_hf_load_config(cp, &mc));
    FL_REQUIRE_OK(fl_config_validate(&mc));
    FL_REQUIRE(!mc.tie_embeddings);
    check_adapter_bytes(&mc, &c, &res); /* includes lm_head's A (r, C) and B (V, r) */
    const size_t C = mc.dim, V = mc.vocab_size, rr = c.lora.r;
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model bm, fin;
    FL_REQUIRE_OK(fl_hf_load_model(&bm, base, &be, &pool));
    FL_REQUIRE_OK(fl_hf_load_model(&fin, res.final_dir, &be, &pool));
    FL_CHECK(!fin.cfg.tie_embeddings);
    char ad[700];
    snprintf(ad, sizeof ad, "%s/adapter", res.final_dir);
    fl_peft_adapter a;
    FL_REQUIRE_OK(fl_peft_load(ad, &a));
    FL_CHECK(a.n == 5 * mc.n_layers + 1 && a.cfg.lora.r == c.lora.r); /* q, v, gate, up, down; lm_head */
    int head = -1;
    for (int k = 0; k < a.n; k++)
        if (!strcmp(a.mods[k].name, "lm_head")) head = k;
    FL_REQUIRE(head >= 0);
    FL_CHECK(a.mods[head].in == (int)C && a.mods[head].out == (int)V);
    double bmax = 0;
    for (size_t i = 0; i < V * rr; i++) bmax = fmax(bmax, fabs(a.mods[head].B[i]));
    FL_CHECKF(bmax > 0, "lm_head lora_B stayed zero");
    int tgt = 0;
    for (int i = 0; i < a.cfg.lora.n_targets; i++) tgt |= !strcmp(a.cfg.lora.targets[i], "lm_head");
    FL_CHECK(tgt);
    /* final/'s head moved (merged adapter), and equals base + the PEFT adapter */
    const float *h0 = fl_model_param(&bm, "lm_head.weight"), *h1 = fl_model_param(&fin, "lm_head.weight");
    double hm = 0;
    for (size_t i = 0; i < V * C; i++) hm = fmax(hm, fabs((double)h0[i] - h1[i]));
    FL_CHECKF(hm > 1e-4, "final/ lm_head equals the base (%.3g)", hm);
    FL_REQUIRE_OK(fl_peft_merge_into(&a, &bm.layout, fl_model_params_f32(&bm)));
    double md = 0;
    for (size_t i = 0; i < bm.layout.numel; i++) md = fmax(md, fabs((double)fl_model_params_f32(&bm)[i] - fl_model_params_f32(&fin)[i]));
    FL_CHECKF(md <= 1e-6, "merged adapter differs from final/ by %.3g", md);
    fl_peft_free(&a);
    fl_model_free(&bm);
    fl_model_free(&fin);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
    free(r.params);
    /* a tied head is refused before anything runs, and says why */
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", fl_test_data_path("stories260K-hf"));
    c.tokenizer_dir[0] = 0;
    snprintf(c.out_dir, sizeof c.out_dir, "%s/lora-head-tied", fl_test_tmpdir());
    FL_CHECK(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL) == FL_ERR_INVALID);
    FL_CHECKF(strstr(fl_error_message(), "tied") != NULL, "message: %s", fl_error_message());
}

/* QLoRA (--quantize bnb.nf4-dq): loss goes down on stories260K with a 4-bit base; PARAMS is
 * exactly the fp32 entries + the 4-bit entries (4.127 bits per quantized weight) + the
 * adapters; GRADS/OPTIM are the adapters'; final/ is the dequantized base with the adapters
 * merged, which equals (dequantized base + PEFT adapter merged) from the saved adapter. */
FL_TEST(trainer_qlora_trains_adapters_on_4bit_base) {
    FL_SKIP_IF_NO_DATA();
    fl_run_config c;
    char out[512];
    snprintf(out, sizeof out, "%s/qlora", fl_test_tmpdir());
    small_run(&c, out);
    lora_run(&c);
    snprintf(c.checkpoint_dir, sizeof c.checkpoint_dir, "%s", fl_test_data_path("stories260K-hf"));
    FL_REQUIRE_OK(fl_cfg_set(&c, "quantize", "bnb.nf4-dq"));
    rec r = {0};
    fl_trainer_result res;
    lora_train(&c, "QLoRA nf4-dq stories260K-hf", &r, &res);
    fl_model_config mc;
    FL_REQUIRE_OK(fl_hf_load_config(fl_test_data_path("stories260K-hf/config.json"), &mc));
    FL_REQUIRE_OK(fl_config_validate(&mc));
    size_t C = mc.dim, KVD = (size_t)mc.n_kv_heads * mc.head_dim, QD = (size_t)mc.n_heads * mc.head_dim;
    size_t F = mc.ffn_dim, L = mc.n_layers;
    size_t n = check_adapter_bytes(&mc, &c, &res);
    /* PARAMS: every block linear in 4 bits (written out from the bitsandbytes layout), the rest fp32 */
    size_t lin[7] = {QD * C, KVD * C, KVD * C, C * QD, F * C, F * C, C * F}, q4 = 0, nq = 0;
    for (int k = 0; k < 7; k++) {
        size_t nb = (lin[k] + 63) / 64, packed = (lin[k] + 1) / 2;
        q4 += (packed + 3) / 4 * 4 + (nb + 3) / 4 * 4 + (nb + 255) / 256 * 4 + 4; /* codes | q_absmax | scales | offset */
        nq += lin[k];
    }
    q4 *= L;
    nq *= L;
    size_t dense = fl_sizing_param_count(&mc) - nq;
    FL_CHECKF(res.peak[FL_TAG_PARAMS] == dense * 4 + q4 + n * 4, "PARAMS %zu, expected %zu fp32 + %zu 4-bit + %zu adapters",
              res.peak[FL_TAG_PARAMS], dense * 4, q4, n * 4);
    double bits = 8.0 * q4 / nq;
    FL_CHECKF(bits > 4.12 && bits < 4.20, "nf4-dq: %.4f bits per quantized weight", bits);
    printf("      nf4-dq: %.4f bits per quantized weight (incl. per-tensor padding and offset)\n", bits);
    /* final/ = dequantized 4-bit base + merged adapters */
    fl_backend be;
    FL_REQUIRE_OK(fl_test_backend(&be, 1));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model q, fin, deq;
    fl_model_storage st = {.param_dtype = FL_F32, .quant4 = 1, .q4_type = FL_Q4_NF4, .q4_double_quant = 1};
    FL_REQUIRE_OK(fl_hf_load_model_ex(&q, fl_test_data_path("stories260K-hf"), &be, &pool, &st));
    FL_REQUIRE_OK(fl_hf_load_model(&fin, res.final_dir, &be, &pool));
    FL_REQUIRE_OK(fl_model_init(&deq, &q.cfg, &be, &pool));
    for (int i = 0; i < q.layout.n; i++) fl_model_read_param(&q, i, fl_model_params_f32(&deq) + deq.layout.params[i].offset);
    char ad[700];
    snprintf(ad, sizeof ad, "%s/adapter", res.final_dir);
    fl_peft_adapter a;
    FL_REQUIRE_OK(fl_peft_load(ad, &a));
    FL_REQUIRE_OK(fl_peft_merge_into(&a, &deq.layout, fl_model_params_f32(&deq)));
    double md = 0;
    for (size_t i = 0; i < deq.layout.numel; i++) md = fmax(md, fabs((double)fl_model_params_f32(&deq)[i] - fl_model_params_f32(&fin)[i]));
    FL_CHECKF(md <= 1e-6, "QLoRA final/ differs from dequantized base + adapter by %.3g", md);
    fl_peft_free(&a);
    fl_model_free(&q);
    fl_model_free(&fin);
    fl_model_free(&deq);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
    free(r.params);
    /* quantization with a mixed policy is refused as LitGPT does; unknown modes list the valid ones */
    FL_REQUIRE_OK(fl_cfg_set(&c, "precision", "bf16-mixed"));
    FL_CHECK(fl_cfg_validate(&c) == FL_ERR_INVALID && strstr(fl_error_message(), "mixed precision"));
    FL_REQUIRE_OK(fl_cfg_set(&c, "precision", "32-true"));
    FL_REQUIRE_OK(fl_cfg_set(&c, "quantize", "bnb.int8"));
    FL_CHECK(fl_cfg_validate(&c) == FL_ERR_INVALID && strstr(fl_error_message(), "nf4"));
}
