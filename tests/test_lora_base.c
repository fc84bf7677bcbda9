/* A LoRA run on random base weights (a preset, --init random) keeps them once in out_dir/base (fl_ckpt_save_base) and
 * its adapters (step-N/, final/adapter) name that folder as base_model_name_or_path: the adapter merged into it is the
 * run's final/ (LoRA and QLoRA, whose base/ holds the 4-bit weights dequantized); a resumed run keeps the committed
 * base/, --overwrite replaces it; a run that saves no adapter writes none, nor one whose base was read from files (its
 * adapters name checkpoint_dir). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitllm/checkpoint.h"
#include "fitllm/cpu.h"
#include "fitllm/io.h"
#include "fitllm/peft.h"
#include "fitllm/trainer.h"
#include "test.h"

/* adapter_config.json of dir names want (an absolute path) */
static int names_base(const char *dir, const char *want) {
    fl_peft_adapter a;
    memset(&a, 0, sizeof a);
    if (fl_peft_load(dir, &a) != FL_OK) return 0;
    int ok = !strcmp(a.cfg.base_model, want);
    if (!ok) fprintf(stderr, "     %s names '%s', want '%s'\n", dir, a.cfg.base_model, want);
    fl_peft_free(&a);
    return ok;
}

/* max |merge(base, adapter) - final| over the model's parameters; -1 when something does not load */
static double merged_vs_final(const char *base, const char *adapter, const char *final_dir) {
    fl_backend be;
    fl_mem_pool pool;
    fl_model b, f;
    fl_peft_adapter a;
    memset(&a, 0, sizeof a);
    double md = -1;
    if (fl_cpu_backend_init(&be, 1) != FL_OK) return -1;
    if (fl_mem_pool_init(&pool, "cpu", 0) == FL_OK) {
        if (fl_hf_load_model(&b, base, &be, &pool) == FL_OK) {
            if (fl_hf_load_model(&f, final_dir, &be, &pool) == FL_OK) {
                if (fl_peft_load(adapter, &a) == FL_OK &&
                    fl_peft_merge_into(&a, &b.layout, fl_model_params_f32(&b)) == FL_OK && b.layout.numel == f.layout.numel) {
                    md = 0;
                    for (size_t i = 0; i < b.layout.numel; i++)
                        md = fmax(md, fabs((double)fl_model_params_f32(&b)[i] - fl_model_params_f32(&f)[i]));
                }
                fl_peft_free(&a);
                fl_model_free(&f);
            }
            fl_model_free(&b);
        }
        fl_mem_pool_free(&pool);
    }
    fl_cpu_backend_free(&be);
    return md;
}

FL_TEST(trainer_lora_random_base_saved) {
    for (int q = 0; q < 2; q++) { /* LoRA, then QLoRA (nf4) */
        fl_run_config c;
        fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, "micro", q ? "lrb-qlora" : "lrb-lora", 32);
        if (q) snprintf(c.lora.quantize, sizeof c.lora.quantize, "bnb.nf4");
        c.train.max_steps = 2;
        c.train.save_interval = 1;
        c.optimizer.lr = 1e-2f;
        fl_trainer_result res;
        FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, &res));
        char base[PATH_MAX], p[PATH_MAX + 64];
        snprintf(p, sizeof p, "%s/base", c.out_dir);
        FL_REQUIRE(fl_ckpt_is_committed(p) && realpath(p, base) != NULL);
        snprintf(p, sizeof p, "%s/step-000001", c.out_dir);
        FL_CHECK(names_base(p, base));
        snprintf(p, sizeof p, "%s/final/adapter", c.out_dir);
        FL_CHECK(names_base(p, base));
        double md = merged_vs_final(base, p, res.final_dir);
        FL_CHECKF(md >= 0 && md <= 1e-6, "%s: final/adapter merged into base/ differs from final/ by %.3g",
                  q ? "QLoRA" : "LoRA", md);
        /* resumed: the committed base/ is the one the run continues on, not written again (a file put in it stays) */
        char mark[PATH_MAX + 64];
        snprintf(mark, sizeof mark, "%s/mark", base);
        FILE *f = fopen(mark, "w");
        FL_REQUIRE(f && fclose(f) == 0);
        c.train.max_steps = 3;
        snprintf(c.resume, sizeof c.resume, "auto");
        FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, &res));
        FL_CHECK(access(mark, F_OK) == 0);
        snprintf(p, sizeof p, "%s/step-000003", c.out_dir);
        FL_CHECK(names_base(p, base));
        /* a new run over it (--overwrite) removes the old one's base/ with its checkpoints and writes its own */
        snprintf(c.resume, sizeof c.resume, "false");
        c.overwrite = 1;
        FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, &res));
        FL_CHECK(access(mark, F_OK) != 0 && fl_ckpt_is_committed(base));
    }
}

static int stop_at_once(void *ud, long step, double loss, const void *params, size_t bytes) {
    (void)ud, (void)step, (void)loss, (void)params, (void)bytes;
    return 1;
}

/* a run that saves no adapter (stopped by its hook before final/, as the lab's rows) writes no base/ either */
FL_TEST(trainer_lora_random_base_only_with_adapters) {
    fl_run_config c;
    fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, "micro", "lrb-none", 32);
    c.train.max_steps = 2;
    fl_trainer_result res;
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, stop_at_once, NULL, &res));
    char p[PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/final", c.out_dir);
    FL_REQUIRE(access(p, F_OK) != 0);
    snprintf(p, sizeof p, "%s/base", c.out_dir);
    FL_CHECKF(access(p, F_OK) != 0, "%s written by a run that saved no adapter", p);
}

FL_TEST(trainer_lora_loaded_base_not_saved) {
    FL_SKIP_IF_NO_DATA();
    fl_run_config c;
    fl_test_tiny_run_config(&c, FL_CMD_FINETUNE_LORA, fl_test_data_path("stories260K-hf"), "lrb-loaded", 32);
    c.train.save_interval = 1;
    fl_trainer_result res;
    FL_REQUIRE_OK(fl_trainer_run(&c, NULL, 0, NULL, NULL, &res));
    char base[PATH_MAX], p[PATH_MAX + 64];
    snprintf(p, sizeof p, "%s/base", c.out_dir);
    FL_CHECKF(access(p, F_OK) != 0, "%s written for a base read from files", p);
    FL_REQUIRE(realpath(c.checkpoint_dir, base) != NULL);
    snprintf(p, sizeof p, "%s/step-000001", c.out_dir);
    FL_CHECK(names_base(p, base));
}
