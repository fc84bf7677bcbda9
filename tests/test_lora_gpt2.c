/* LoRA on GPT-2 as LitGPT's switches mean it: lora_query / _key / _value train their parts of the fused c_attn only
 * (lora_B's other rows stay exactly 0, so the PEFT adapter on the whole c_attn is LitGPT's), lora_projection adapts
 * attn.c_proj, lora_mlp mlp.c_fc and mlp.c_proj; adapter_config.json's target_modules resolve, by PEFT's own rule
 * (peft/tuners/tuners_utils.py check_target_module_exists: the module's name is the target or ends with "." + target),
 * to exactly the trained modules; "attn.c_proj" adapters load, older "c_proj" ones (both projections) load as they
 * were trained, and an older checkpoint is not resumed under the new meaning. PEFT's rank_pattern / alpha_pattern: bad
 * ones refused naming the key (the merge against PEFT's: test_lora.c peft_rank_pattern_merge_vs_peft). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/peft.h"
#include "fitllm/trainer.h"
#include "test.h"

/* PEFT's check_target_module_exists for a list of targets (the anchor the modules are checked against) */
static int peft_matches(const fl_lora_config *lc, const char *module) {
    const size_t ml = strlen(module);
    for (int i = 0; i < lc->n_targets; i++) {
        const size_t tl = strlen(lc->targets[i]);
        if (!strcmp(module, lc->targets[i])) return 1;
        if (ml > tl && module[ml - tl - 1] == '.' && !strcmp(module + ml - tl, lc->targets[i])) return 1;
    }
    return 0;
}

static void gpt2_micro(fl_model_config *mc, fl_param_layout *lay) {
    FL_REQUIRE_OK(fl_preset_find("gpt2-micro", mc));
    FL_REQUIRE_OK(fl_config_validate(mc));
    FL_REQUIRE_OK(fl_layout_build(lay, mc));
}

/* c's run, then its final/adapter read into *a */
static fl_status train_load(const fl_run_config *c, fl_peft_adapter *a) {
    fl_trainer_result res;
    FL_TRY(fl_trainer_run(c, NULL, 0, NULL, NULL, &res));
    char p[PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/adapter", res.final_dir);
    return fl_peft_load(p, a);
}

/* Every switch combination: the modules (and the c_attn parts that train) are LitGPT's, the trainable count is theirs,
 * and the targets PEFT resolves are the modules trained (no more, no fewer). */
FL_TEST(lora_gpt2_switches_make_litgpt_modules) {
    fl_model_config mc;
    fl_param_layout lay;
    gpt2_micro(&mc, &lay);
    const size_t C = (size_t)mc.dim, F = (size_t)mc.ffn_dim, L = (size_t)mc.n_layers, r = 4;
    static fl_run_config c;
    fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, "gpt2-micro", "lg-switches", 32);
    c.lora.r = (int)r;
    for (int combo = 1; combo < 32; combo++) {
        const int q = combo & 1, k = combo >> 1 & 1, v = combo >> 2 & 1, proj = combo >> 3 & 1, mlp = combo >> 4 & 1;
        c.lora.query = q, c.lora.key = k, c.lora.value = v, c.lora.projection = proj, c.lora.mlp = mlp, c.lora.head = 0;
        fl_lora_config lc;
        FL_REQUIRE_OK(fl_trainer_lora_config(&c, &mc, &lc));
        fl_lora_module *mods;
        int nm;
        FL_REQUIRE_OK(fl_lora_modules(&lc, &lay, &mc, &mods, &nm));
        const int nqkv = q + k + v;
        const unsigned frozen = nqkv == 3 ? 0u : ~(unsigned)(q | k << 1 | v << 2) & 7u;
        int want_n = 0, bad = 0;
        size_t want_train = 0;
        if (nqkv) want_n++, want_train += r * C + (size_t)nqkv * C * r;
        if (proj) want_n++, want_train += r * C + C * r;
        if (mlp) want_n += 2, want_train += r * C + F * r + r * F + C * r;
        FL_CHECKF(nm == want_n * (int)L, "combo %d: %d modules, want %d", combo, nm, want_n * (int)L);
        for (int j = 0; j < nm; j++) {
            const char *n = mods[j].name;
            const int attn = strstr(n, ".attn.c_attn") != NULL, ap = strstr(n, ".attn.c_proj") != NULL;
            const int fc = strstr(n, ".mlp.c_fc") != NULL, mp = strstr(n, ".mlp.c_proj") != NULL;
            if (!((attn && nqkv) || (ap && proj) || ((fc || mp) && mlp)) && !bad++)
                fl_test_fail(__FILE__, __LINE__, "combo %d: %s adapted", combo, n);
            if (attn && (mods[j].parts != 3 || mods[j].frozen != frozen) && !bad++)
                fl_test_fail(__FILE__, __LINE__, "combo %d: %s frozen parts %u, want %u", combo, n, mods[j].frozen, frozen);
            if (!attn && mods[j].frozen && !bad++) fl_test_fail(__FILE__, __LINE__, "combo %d: %s has frozen parts", combo, n);
        }
        FL_CHECKF(fl_lora_trainable(mods, nm, (int)r) == L * want_train, "combo %d: %zu trainable, want %zu", combo,
                  fl_lora_trainable(mods, nm, (int)r), L * want_train);
        /* PEFT's resolution of the targets adapter_config.json will list: exactly these modules */
        int peft_n = 0;
        for (int i = 0; i < lay.n; i++) {
            char mod[FL_PARAM_NAME_MAX];
            const char *nmi = lay.params[i].name;
            const size_t len = strlen(nmi);
            if (lay.params[i].ndim != 2 || len < 8 || strcmp(nmi + len - 7, ".weight")) continue;
            snprintf(mod, sizeof mod, "%.*s", (int)(len - 7), nmi);
            if (!peft_matches(&lc, mod)) continue;
            peft_n++;
            int found = 0;
            for (int j = 0; j < nm; j++) found |= !strcmp(mods[j].name, mod);
            if (!found && !bad++) fl_test_fail(__FILE__, __LINE__, "combo %d: PEFT adapts %s, fitllm does not", combo, mod);
        }
        FL_CHECKF(peft_n == nm, "combo %d: PEFT resolves the targets to %d modules, fitllm trains %d", combo, peft_n, nm);
        free(mods);
    }
    /* a PEFT target list means whole modules: c_attn all of it, c_proj both projections (older adapters' meaning) */
    c.lora.query = 1, c.lora.key = 0, c.lora.value = 1;
    snprintf(c.lora.target_modules, sizeof c.lora.target_modules, "c_attn,c_proj");
    fl_lora_config lc;
    FL_REQUIRE_OK(fl_trainer_lora_config(&c, &mc, &lc));
    fl_lora_module *mods;
    int nm;
    FL_REQUIRE_OK(fl_lora_modules(&lc, &lay, &mc, &mods, &nm));
    FL_CHECK(nm == 3 * (int)L && lc.qkv_parts == 0 && mods[0].frozen == 0);
    FL_CHECK(!strcmp(mods[1].name, "transformer.h.0.attn.c_proj") && !strcmp(mods[2].name, "transformer.h.0.mlp.c_proj"));
    free(mods);
    FL_REQUIRE_OK(fl_lora_config_init(&lc, &mc, 4, 8, 0, 0, "all-linear"));
    FL_CHECK(lc.n_targets == 3); /* c_attn, c_proj, c_fc: the dotted names are parts of c_proj's */
    fl_layout_free(&lay);
}

/* A few AdamW steps with weight decay (and 8-bit AdamW's): lora_B's k rows of every c_attn are still exactly 0, q's
 * and v's trained; only c_attn is saved. */
FL_TEST(lora_gpt2_disabled_qkv_rows_stay_zero) {
    for (int o = 0; o < 2; o++) {
        static fl_run_config c;
        fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, "gpt2-micro", o ? "lg-rows-8bit" : "lg-rows", 32);
        c.lora.query = c.lora.value = 1, c.lora.key = c.lora.projection = c.lora.mlp = c.lora.head = 0;
        c.lora.r = 4;
        c.train.max_steps = 2;
        c.optimizer.lr = 1e-2f;
        c.optimizer.weight_decay = 0.1f;
        if (o) c.optimizer.kind = FL_OPT_ADAMW8BIT;
        fl_peft_adapter a;
        FL_REQUIRE_OK(train_load(&c, &a));
        FL_CHECK(a.cfg.lora.n_targets == 1 && !strcmp(a.cfg.lora.targets[0], "c_attn"));
        FL_CHECK(a.n == 2); /* gpt2-micro's 2 blocks' c_attn */
        for (int j = 0; j < a.n; j++) {
            const fl_peft_module *m = &a.mods[j];
            FL_REQUIRE(strstr(m->name, ".attn.c_attn") && m->out % 3 == 0);
            const size_t rows = (size_t)m->out / 3 * 4;
            double norm[3] = {0, 0, 0};
            for (int part = 0; part < 3; part++)
                for (size_t i = 0; i < rows; i++) norm[part] += fabs(m->B[part * rows + i]);
            FL_CHECKF(norm[1] == 0 && norm[0] > 0 && norm[2] > 0, "%s %s: |B| q %g, k %g, v %g (k must stay 0)",
                      o ? "AdamW8bit" : "AdamW", m->name, norm[0], norm[1], norm[2]);
        }
        fl_peft_free(&a);
    }
}

/* --lora_mlp alone: the adapter is on mlp.c_fc and mlp.c_proj, not attn.c_proj; --lora_projection alone on
 * attn.c_proj; the target_modules written resolve (PEFT's rule) to the saved modules. */
FL_TEST(lora_gpt2_projection_and_mlp_targets) {
    for (int w = 0; w < 2; w++) {
        static fl_run_config c;
        fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, "gpt2-micro", w ? "lg-mlp" : "lg-proj", 32);
        c.lora.query = c.lora.key = c.lora.value = c.lora.head = 0;
        c.lora.projection = !w, c.lora.mlp = w;
        c.train.max_steps = 1;
        fl_peft_adapter a;
        FL_REQUIRE_OK(train_load(&c, &a));
        FL_CHECKF(a.n == (w ? 4 : 2), "%s: %d modules saved", w ? "lora_mlp" : "lora_projection", a.n);
        for (int j = 0; j < a.n; j++) {
            const char *n = a.mods[j].name;
            FL_CHECKF(w ? strstr(n, ".mlp.") != NULL : strstr(n, ".attn.c_proj") != NULL, "%s: %s saved",
                      w ? "lora_mlp" : "lora_projection", n);
            FL_CHECKF(peft_matches(&a.cfg.lora, n), "target_modules do not resolve to %s", n);
        }
        /* and nothing else: attn.c_proj (mlp) / mlp.c_proj (projection) is no PEFT match */
        FL_CHECK(!peft_matches(&a.cfg.lora, w ? "transformer.h.0.attn.c_proj" : "transformer.h.0.mlp.c_proj"));
        fl_peft_free(&a);
    }
}

/* PEFT adapters on "attn.c_proj" (fitllm's now, PEFT's suffix form) and on "c_proj" (older fitllm's: both
 * projections) are checked against the model and merged into exactly their modules. */
FL_TEST(lora_gpt2_adapter_target_forms_load) {
    fl_model_config mc;
    fl_param_layout lay;
    gpt2_micro(&mc, &lay);
    const int C = mc.dim, F = mc.ffn_dim, r = 2;
    float *A = malloc(sizeof(float) * r * F), *B = malloc(sizeof(float) * C * r);
    float *params = calloc(lay.numel, sizeof(float));
    FL_REQUIRE(A && B && params);
    for (int i = 0; i < r * F; i++) A[i] = 0.01f * (float)(i % 7 + 1);
    for (int i = 0; i < C * r; i++) B[i] = 0.02f * (float)(i % 5 + 1);
    for (int form = 0; form < 3; form++) { /* ["attn.c_proj"], ["attn.c_proj", "mlp.c_proj"], ["c_proj"] */
        char dir[600];
        snprintf(dir, sizeof dir, "%s/lg-form%d", fl_test_tmpdir(), form);
        fl_peft_config pc;
        memset(&pc, 0, sizeof pc);
        pc.lora.r = r, pc.lora.alpha = 4, pc.fan_in_fan_out = 1;
        pc.lora.n_targets = form == 1 ? 2 : 1;
        snprintf(pc.lora.targets[0], sizeof pc.lora.targets[0], "%s", form == 2 ? "c_proj" : "attn.c_proj");
        snprintf(pc.lora.targets[1], sizeof pc.lora.targets[1], "mlp.c_proj");
        fl_peft_module m[2] = {{"transformer.h.1.attn.c_proj", C, C, A, B, NULL, 0, 0, 0, 0},
                               {"transformer.h.1.mlp.c_proj", F, C, A, B, NULL, 0, 0, 0, 0}};
        FL_REQUIRE_OK(fl_peft_save(dir, &pc, m, form ? 2 : 1));
        const int both = form > 0;
        fl_peft_adapter a;
        FL_REQUIRE_OK(fl_peft_load(dir, &a));
        FL_CHECKF(fl_peft_check_model(&a, &mc, &lay, NULL, NULL) == FL_OK, "target_modules [\"%s\"]: %s",
                  pc.lora.targets[0], fl_error_message());
        memset(params, 0, lay.numel * sizeof(float));
        FL_REQUIRE_OK(fl_peft_merge_into(&a, &lay, params));
        const char *w[2] = {"transformer.h.1.attn.c_proj.weight", "transformer.h.1.mlp.c_proj.weight"};
        for (int k = 0; k < 2; k++) {
            const fl_param_info *pi = &lay.params[fl_layout_find(&lay, w[k])];
            const int in = (int)pi->shape[1];
            double want = 0; /* element (0, 0): scaling (alpha / r = 2) * sum_j B[0, j] A[j, 0] */
            for (int j = 0; j < r; j++) want += 2.0 * B[j] * A[(size_t)j * in];
            const double got = params[pi->offset];
            FL_CHECKF(k > both ? got == 0 : fabs(got - want) <= 1e-6, "[\"%s\"]: %s[0,0] %g, want %g",
                      pc.lora.targets[0], w[k], got, k > both ? 0.0 : want);
        }
        fl_peft_free(&a);
    }
    free(A), free(B), free(params);
    fl_layout_free(&lay);
}

/* rank_pattern / alpha_pattern that PEFT would not take are refused naming the key and the pattern */
FL_TEST(peft_rank_pattern_bad_keys) {
    static const char *const cfgs[] = {
        "{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"target_modules\":[\"v_proj\"],\"rank_pattern\":{\"v_proj(\":2}}",
        "{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"target_modules\":[\"v_proj\"],\"rank_pattern\":{\"v_proj\":0}}",
        "{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"target_modules\":[\"v_proj\"],\"rank_pattern\":{\"v_proj\":1.5}}",
        "{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"target_modules\":[\"v_proj\"],\"alpha_pattern\":{\"q_proj\":-1}}",
        "{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"target_modules\":[\"v_proj\"],\"rank_pattern\":[2]}",
        /* a rank that does not fit the tensors: the expected shape says where it comes from */
        "{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"target_modules\":[\"v_proj\"],\"rank_pattern\":{\"v_proj\":3}}",
    };
    static const fl_status want[] = {FL_ERR_INVALID, FL_ERR_INVALID, FL_ERR_FORMAT, FL_ERR_INVALID, FL_ERR_FORMAT,
                                     FL_ERR_FORMAT};
    static const char *const msg[] = {"'rank_pattern': pattern 'v_proj(' is not a regular expression",
                                      "'rank_pattern': pattern 'v_proj': the rank must be > 0",
                                      "'rank_pattern': pattern 'v_proj': the value is not an integer rank",
                                      "'alpha_pattern': pattern 'q_proj': lora_alpha must be > 0",
                                      "'rank_pattern': not an object",
                                      "expected (r=3 from rank_pattern 'v_proj', in)"};
    char dir[600], p[700];
    snprintf(dir, sizeof dir, "%s/lg-pattern", fl_test_tmpdir());
    FL_REQUIRE(mkdir(dir, 0755) == 0 || errno == EEXIST);
    /* the tensors of the PEFT fixture (v_proj at r 2, q_proj at 4 / 6, down_proj at 4) */
    FILE *in = fopen("tests/fixtures/peft-llama-pattern/adapter_model.safetensors", "rb");
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    FILE *out = fopen(p, "wb");
    FL_REQUIRE(in && out);
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, in)) > 0;) FL_REQUIRE(fwrite(buf, 1, n, out) == n);
    fclose(in);
    FL_REQUIRE(fclose(out) == 0);
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) {
        FILE *f = fopen(p, "w");
        FL_REQUIRE(f && fputs(cfgs[i], f) >= 0 && fclose(f) == 0);
        fl_peft_adapter a;
        fl_status s = fl_peft_load(dir, &a);
        FL_CHECKF(s == want[i] && strstr(fl_error_message(), msg[i]), "case %zu: status %d: %s", i, (int)s,
                  fl_error_message());
        if (s == FL_OK) fl_peft_free(&a);
    }
}

/* A checkpoint of an older fitllm's switch run (its adapter on the whole c_attn and on both c_proj, its
 * hyperparameters.yaml lora_projection true) is not resumed under the new meaning of the switches: refused with the
 * --lora_target_modules that resumes it as it was trained, which then resumes it. */
FL_TEST(lora_gpt2_older_checkpoint_resumed_as_trained) {
    static fl_run_config c, r;
    fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, "gpt2-micro", "lg-old", 32);
    c.lora.query = c.lora.value = 1, c.lora.key = c.lora.mlp = c.lora.head = 0, c.lora.projection = 0;
    snprintf(c.lora.target_modules, sizeof c.lora.target_modules, "c_attn,c_proj"); /* what the older run trained */
    c.train.max_steps = 1;
    c.train.save_interval = 1;
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, NULL));
    /* its hyperparameters.yaml as the older run wrote it: the switches, no target list */
    char p[PATH_MAX + 64], *text = NULL, line[512];
    size_t len = 0;
    snprintf(p, sizeof p, "%s/step-000001/hyperparameters.yaml", c.out_dir);
    FILE *f = fopen(p, "r"), *o = open_memstream(&text, &len);
    FL_REQUIRE(f && o);
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "lora_target_modules:", 20)) fputs("lora_target_modules: null\n", o);
        else if (!strncmp(line, "lora_projection:", 16)) fputs("lora_projection: true\n", o);
        else fputs(line, o);
    }
    fclose(f);
    fclose(o);
    f = fopen(p, "w");
    FL_REQUIRE(f && fputs(text, f) >= 0 && fclose(f) == 0);
    free(text);
    r = c;
    r.lora.target_modules[0] = 0, r.lora.projection = 1;
    r.train.max_steps = 2;
    snprintf(r.resume, sizeof r.resume, "%.4000s/step-000001", c.out_dir);
    fl_status s = fl_trainer_run(&r, NULL, 0, NULL, NULL, NULL);
    FL_CHECKF(s == FL_ERR_INVALID && strstr(fl_error_message(), "an older fitllm") &&
              strstr(fl_error_message(), "--lora_target_modules c_attn,c_proj"), "status %d: %s", (int)s,
              fl_error_message());
    snprintf(r.lora.target_modules, sizeof r.lora.target_modules, "c_attn,c_proj");
    s = fl_trainer_run(&r, NULL, 0, NULL, NULL, NULL);
    FL_CHECKF(s == FL_OK, "status %d: %s", (int)s, fl_error_message());
}
