/* fl_model_load_auto: pick the loader by looking at the path. */
#include "fitllm/io.h"

#include "core/fs.h"
#include "fitllm/torch_ckpt.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

static int fl_auto_ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

fl_status fl_model_load_auto(fl_model *m, const char *path, const fl_backend *be, fl_mem_pool *pool,
                             int *weights_loaded) {
    return fl_model_load_auto_ex(m, path, be, pool, NULL, weights_loaded);
}

fl_status fl_model_load_auto_ex(fl_model *m, const char *path, const fl_backend *be, fl_mem_pool *pool,
                                const fl_model_storage *stg, int *weights_loaded) {
    if (weights_loaded) *weights_loaded = 0;
    if (!path || !path[0]) return fl_errorf(FL_ERR_INVALID, "no model path given");
    struct stat st;
    if (stat(path, &st) != 0)
        return fl_errorf(errno == ENOENT ? FL_ERR_NOT_FOUND : FL_ERR_IO, "%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        char cfg[4096];
        FL_TRY(fl_fs_join(cfg, sizeof cfg, path, "config.json"));
        if (!fl_fs_is_file(cfg)) {
            char lit[4096];
            FL_TRY(fl_fs_join(lit, sizeof lit, path, "model_config.yaml"));
            if (fl_fs_is_file(lit)) { /* a LitGPT checkpoint folder: lit_model.pth + model_config.yaml */
                fl_model_config c;
                FL_TRY(fl_lit_load_config(lit, &c));
                FL_TRY(fl_hf_load_model_cfg(m, path, &c, lit, be, pool, stg));
                if (weights_loaded) *weights_loaded = 1;
                return FL_OK;
            }
            FL_TRY(fl_fs_join(cfg, sizeof cfg, path, "adapter_config.json"));
            if (fl_fs_is_file(cfg)) /* e.g. a finetune_lora step checkpoint */
                return fl_errorf(FL_ERR_NOT_FOUND, "%s: a PEFT LoRA adapter folder (adapter_config.json), not a model: "
                                 "`fitllm merge_lora %s` makes a model of it (`fitllm generate` takes it as it is)",
                                 path, path);
            return fl_errorf(FL_ERR_NOT_FOUND, "%s: folder has no config.json (not a Hugging Face model folder) and no "
                             "model_config.yaml (not a LitGPT checkpoint folder)", path);
        }
        FL_TRY(fl_hf_load_model_ex(m, path, be, pool, stg));
        if (weights_loaded) *weights_loaded = 1;
        return FL_OK;
    }
    if (fl_auto_ends_with(path, ".json")) {
        fl_model_config c;
        FL_TRY(fl_hf_load_config(path, &c));
        return fl_model_init_ex(m, &c, be, pool, stg);
    }
    if (fl_auto_ends_with(path, ".bin")) {
        FL_TRY(fl_llama2c_load_model_ex(m, path, be, pool, stg));
        if (weights_loaded) *weights_loaded = 1;
        return FL_OK;
    }
    return fl_errorf(FL_ERR_UNSUPPORTED,
                     "%s: unknown model format (expected a Hugging Face folder, a config.json or a llama2.c .bin)", path);
}
