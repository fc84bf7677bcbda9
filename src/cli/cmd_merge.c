/* fitllm merge_lora: merge a PEFT LoRA adapter folder into its base model and
 * write the merged Hugging Face folder (W += scaling * B @ A). The base comes
 * from --base or the adapter's base_model_name_or_path. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "fitllm/peft.h"

static void help(void) {
    printf("usage: fitllm merge_lora <adapter_dir> [--base MODEL_DIR] [--out_dir DIR] [--threads N]\n\n"
           "  <adapter_dir>     PEFT adapter folder (adapter_config.json + adapter_model.safetensors)\n"
           "  --base DIR        base model folder (default: the adapter's base_model_name_or_path)\n"
           "  --out_dir DIR     where the merged HF model goes (default: <adapter_dir>/merged)\n"
           "  --threads N       CPU threads (default: all cores)\n\n"
           "Every adapted weight becomes W + scaling * B @ A (scaling = lora_alpha / r, or / sqrt(r) with\n"
           "use_rslora); the result loads in transformers and in fitllm without the adapter.\n");
}

/* Load base (+ optional PEFT adapter merged in memory) for generate and merge_lora. */
fl_status fl_cli_load_with_adapter(fl_model *m, const char *base, const char *adapter_dir, const fl_backend *be,
                                   fl_mem_pool *pool, int *loaded) {
    fl_peft_adapter a;
    memset(&a, 0, sizeof a);
    if (adapter_dir) FL_TRY(fl_peft_load(adapter_dir, &a));
    char base_buf[1100];
    if (!base) {
        if (!adapter_dir || !a.cfg.base_model[0]) {
            fl_peft_free(&a);
            return fl_errorf(FL_ERR_INVALID, "no base model: give --base (the adapter names none)");
        }
        snprintf(base_buf, sizeof base_buf, "%s", a.cfg.base_model);
        base = base_buf;
    }
    fl_status s = fl_cli_load_model(m, base, 0, 1337, be, pool, loaded);
    if (s == FL_OK && adapter_dir) {
        int *idx = NULL;
        s = fl_peft_check_model(&a, &m->cfg, &m->layout, NULL, &idx);
        free(idx);
        if (s == FL_OK) s = fl_peft_merge_into(&a, &m->layout, m->params);
        if (s != FL_OK) fl_error_prefix(s, "%s", adapter_dir);
        if (s != FL_OK) fl_model_free(m);
    }
    fl_peft_free(&a);
    return s;
}

int fl_cmd_merge_lora(int argc, char **argv) {
    const char *cmd = "merge_lora", *adapter = NULL, *base = NULL, *out = NULL;
    int threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--base") || !strcmp(a, "--checkpoint_dir")) { if (!v) return fl_cli_usage(cmd, "%s needs a folder", a); base = v; i++; }
        else if (!strcmp(a, "--out_dir")) { if (!v) return fl_cli_usage(cmd, "--out_dir needs a folder"); out = v; i++; }
        else if (!strcmp(a, "--threads")) { if (fl_cli_int(cmd, a, v, 0, 1024, &threads)) return 2; i++; }
        else if (a[0] == '-') return fl_cli_usage(cmd, "unknown option '%s'", a);
        else if (!adapter) adapter = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!adapter) return fl_cli_usage(cmd, "missing <adapter_dir>");
    char out_buf[4200];
    if (!out) {
        snprintf(out_buf, sizeof out_buf, "%s/merged", adapter);
        out = out_buf;
    }
    fl_backend be;
    fl_mem_pool pool;
    fl_model m;
    memset(&m, 0, sizeof m);
    int loaded = 0, rc = 0;
    fl_status s = fl_cpu_backend_init(&be, threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_mem_pool_init(&pool, "cpu", 0)) != FL_OK) return fl_cli_fail(cmd, s, NULL);
    s = fl_cli_load_with_adapter(&m, base, adapter, &be, &pool, &loaded);
    if (s == FL_OK && !loaded) s = fl_errorf(FL_ERR_INVALID, "the base model has no weights to merge into");
    if (s == FL_OK) s = fl_hf_save_model(&m, out);
    if (s != FL_OK) rc = fl_cli_fail(cmd, s, &pool);
    else printf("merged %s into %s -> %s\n", adapter, base ? base : "(adapter's base)", out);
    if (m.pool) fl_model_free(&m);
    fl_mem_pool_free(&pool);
    fl_cpu_backend_free(&be);
    return rc == 0 ? 0 : (s == FL_ERR_INVALID || s == FL_ERR_NOT_FOUND ? FL_EXIT_USAGE : rc);
}
