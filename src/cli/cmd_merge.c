/* fitllm merge_shards: see fl_cmd_merge_shards at the end.
 * fitllm merge_lora: merge a PEFT LoRA adapter into its base model and write a
 * complete Hugging Face folder (W += scaling * B @ A; config.json,
 * model.safetensors and the tokenizer files). The adapter may be given as the
 * adapter folder, a LoRA checkpoint (step-N/, final/ -> final/adapter) or a
 * finetune_lora run folder; the base comes from --base or the adapter's
 * base_model_name_or_path. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "core/fs.h"
#include "fitllm/blip2.h"
#include "fitllm/checkpoint.h"
#include "fitllm/hub.h"
#include "fitllm/lora.h"
#include "fitllm/peft.h"

static void help(void) {
    printf("usage: fitllm merge_lora <adapter> [--base MODEL_DIR] [--out_dir DIR] [--threads N]\n\n"
           "  <adapter>         a PEFT adapter folder (adapter_config.json + adapter_model.safetensors),\n"
           "                    a finetune_lora checkpoint (out/step-000100, or out/final: its adapter/)\n"
           "                    or a finetune_lora run folder (out: final/adapter, else the newest step)\n"
           "  --base DIR        base model folder (default: the adapter's base_model_name_or_path); a Hugging\n"
           "                    Face repo id ORG/NAME means its download (`fitllm download --help`)\n"
           "  --out_dir DIR     where the merged HF model goes (default: <adapter>/merged; inside a\n"
           "                    step checkpoint it goes with it when train.keep_checkpoints rotates it out)\n"
           "  --threads N       CPU threads (default: all cores)\n"
           "  --accelerator A   auto|cpu|cuda (default auto: the GPU when this build has CUDA and one is\n"
           "                    visible, else the CPU). cuda is EXPERIMENTAL (single GPU; README)\n\n"
           "Every adapted weight becomes W + scaling * B @ A (scaling = lora_alpha / r, or / sqrt(r) with\n"
           "use_rslora). The output holds config.json, model.safetensors and the tokenizer files (the\n"
           "checkpoint's, the run's tokenizer, else the base's; the output says which), so `fitllm generate DIR`\n"
           "and transformers load it as it is.\n"
           "A BLIP-2 adapter (finetune_lora on a BLIP-2 folder: modules language_model.<module>, as PEFT names them\n"
           "on Blip2ForConditionalGeneration) merges into its BLIP-2 base: the output is a BLIP-2 folder (its\n"
           "preprocessor_config.json too) for `fitllm generate DIR --image FILE`, `fitllm loss`, fine-tuning and\n"
           "transformers.\n"
           "--out_dir may not be the base model's folder or the adapter's. A new --out_dir is written beside itself and\n"
           "renamed into place: a failure or a stop (Ctrl-C, SIGTERM: exit 130, 143) leaves nothing; an existing one\n"
           "gets its files replaced one by one.\n");
}

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* dst = dir "/" name (name NULL: dir); -1 when it does not fit in n bytes */
static int join(char *dst, size_t n, const char *dir, const char *name) {
    size_t a = strlen(dir), b = name ? strlen(name) + 1 : 0;
    if (a + b + 1 > n) return -1;
    memmove(dst, dir, a);
    if (name) {
        dst[a] = '/';
        memcpy(dst + a + 1, name, b - 1);
    }
    dst[a + b] = 0;
    return 0;
}

static int has_file(const char *dir, const char *name) {
    char p[FL_CLI_PATH + 64];
    struct stat st;
    return join(p, sizeof p, dir, name) == 0 && stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

fl_status fl_cli_find_adapter(const char *path, fl_cli_adapter_info *info) {
    char p[FL_CLI_PATH + 64];
    info->how = "";
    if (strlen(path) >= FL_CLI_PATH - 32) return fl_errorf(FL_ERR_INVALID, "%s: path too long", path);
    if (!is_dir(path)) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no such folder (expected a PEFT adapter folder)", path);
    if (has_file(path, "adapter_config.json")) {
        join(info->adapter, sizeof info->adapter, path, NULL);
        return FL_OK;
    }
    join(p, sizeof p, path, "adapter"); /* a LoRA run's final/ (the merged model + adapter/) */
    if (has_file(p, "adapter_config.json")) {
        join(info->adapter, sizeof info->adapter, p, NULL);
        info->how = "the PEFT adapter of the checkpoint";
        return FL_OK;
    }
    join(p, sizeof p, path, "final/adapter"); /* a finetune_lora run folder */
    if (has_file(p, "adapter_config.json")) {
        join(info->adapter, sizeof info->adapter, p, NULL);
        info->how = "the final adapter of the run";
        return FL_OK;
    }
    if (fl_ckpt_find_latest(path, p, sizeof p) == FL_OK && has_file(p, "adapter_config.json")) {
        join(info->adapter, sizeof info->adapter, p, NULL);
        info->how = "the newest step checkpoint of the run (no final/ yet)";
        return FL_OK;
    }
    if (has_file(path, "training_state.safetensors") && !has_file(path, "model.safetensors"))
        return fl_errorf(FL_ERR_NOT_FOUND,
                         "%s: a LoRA checkpoint without adapter_config.json (written by an older fitllm: it holds "
                         "only the training state); resume from it (--resume %s) and let the run save again", path,
                         path);
    if (has_file(path, "model.safetensors") || has_file(path, "model.safetensors.index.json"))
        return fl_errorf(FL_ERR_NOT_FOUND,
                         "%s: a model folder, not a LoRA adapter (no adapter_config.json, no adapter/): use it as it "
                         "is (fitllm generate %s)", path, path);
    return fl_errorf(FL_ERR_NOT_FOUND,
                     "%s: no adapter_config.json: not a PEFT adapter folder, a finetune_lora checkpoint (step-N/, "
                     "final/) or a finetune_lora run folder", path);
}

/* "KEY: VALUE" of the hyperparameters.yaml beside an adapter (a step checkpoint's own, final/adapter's in final/) into
 * v (n bytes); 0 when there is none. */
static int hparam(const char *adapter, const char *key, char *v, size_t n) {
    char p[FL_CLI_PATH + 64], line[FL_CLI_PATH + 64];
    const size_t k = strlen(key);
    for (int up = 0; up < 2; up++) {
        if (join(p, sizeof p, adapter, up ? "../hyperparameters.yaml" : "hyperparameters.yaml") != 0) return 0;
        FILE *f = fopen(p, "r");
        if (!f) continue;
        int found = 0;
        while (!found && fgets(line, sizeof line, f))
            if (!strncmp(line, key, k) && line[k] == ':' && line[k + 1] == ' ') {
                line[strcspn(line, "\r\n")] = 0;
                snprintf(v, n, "%s", line + k + 2);
                found = 1;
            }
        fclose(f);
        if (found) return 1;
    }
    return 0;
}

/* A base folder of config.json alone (a model shape: no weights to merge into): refused, saying why. A random-init
 * LoRA run of an older fitllm named its --init random folder so (runs now keep the weights in out_dir/base). */
static fl_status check_base_weights(const fl_cli_adapter_info *info, const char *b, const char *hint) {
    static const char *const w[] = {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                                    "pytorch_model.bin.index.json", "lit_model.pth"};
    if (!is_dir(b) || !has_file(b, "config.json")) return FL_OK;
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        if (has_file(b, w[i])) return FL_OK;
    char init[32] = "", seed[32] = "?", why[512] = "";
    if (hparam(info->adapter, "init", init, sizeof init) && !strcmp(init, "random")) {
        hparam(info->adapter, "seed", seed, sizeof seed);
        snprintf(why, sizeof why, ": the run that wrote this adapter trained it on random weights of that shape "
                 "(hyperparameters.yaml: init random, seed %s), which it did not save (fitllm now saves them to the "
                 "run's out_dir/base, which the adapters name); use the run's final/ (the adapter merged into those "
                 "weights) or train again", seed);
    }
    return fl_errorf(FL_ERR_NOT_FOUND, "%s/adapter_config.json: the base model '%s' (base_model_name_or_path) is a model "
                     "shape without weights (config.json, no model.safetensors)%s; give a base model with its weights "
                     "with %s", info->adapter, b, why, hint);
}

/* The base named by the adapter (or given), checked to exist before anything is loaded, so
 * that a missing one is reported with the path tried and how to give another. */
static fl_status resolve_base(const fl_peft_adapter *a, const fl_cli_adapter_info *info, const char *base,
                              const char *hint, char *out, size_t n) {
    if (base) /* a Hugging Face repo id: its downloaded folder */
        return fl_cli_resolve_model(NULL, base, out, n, 0);
    const char *b = a->cfg.base_model;
    if (!b[0])
        return fl_errorf(FL_ERR_INVALID, "%s/adapter_config.json names no base model (base_model_name_or_path is "
                         "null): give it with %s", info->adapter, hint);
    struct stat st;
    fl_model_config mc;
    char named[FL_CLI_PATH];
    /* base_model_name_or_path is most often a Hub repo id: the download folder's or HF cache's copy */
    if (stat(b, &st) != 0 && fl_hub_repo_of(b, named, sizeof named)) {
        fl_status s = fl_cli_resolve_model(NULL, b, out, n, 0);
        if (s == FL_OK) return FL_OK;
        char why[2048]; /* copied: fl_errorf rewrites the message it would read */
        snprintf(why, sizeof why, "%s", fl_error_message());
        return fl_errorf(s, "%s/adapter_config.json: base model '%s' (base_model_name_or_path) not found (%s); give "
                         "the base model folder with %s", info->adapter, b, why, hint);
    }
    if (stat(b, &st) != 0 && fl_preset_find(b, &mc) != FL_OK) {
        int relative = b[0] != '/';
        return fl_errorf(FL_ERR_NOT_FOUND,
                         "%s/adapter_config.json: base model '%s' (base_model_name_or_path) not found%s; give the "
                         "base model folder with %s", info->adapter, b,
                         relative ? " (a relative path is looked up from the current directory)" : "", hint);
    }
    FL_TRY(check_base_weights(info, b, hint));
    snprintf(out, n, "%s", b);
    return FL_OK;
}

/* fl_peft_merge_into for a model whose weights are device memory: each adapted weight comes to
 * the host (fl_model_read_param), is merged there and written back (one weight at a time). */
static fl_status merge_on_device(const fl_peft_adapter *a, fl_model *m) {
    for (int k = 0; k < a->n; k++) {
        const fl_peft_module *md = &a->mods[k];
        char w[FL_PARAM_NAME_MAX + 8];
        snprintf(w, sizeof w, "%s.weight", md->name);
        int i = fl_layout_find(&m->layout, w);
        if (i < 0 || m->layout.params[i].shape[0] != md->out || m->layout.params[i].shape[1] != md->in)
            return fl_errorf(FL_ERR_INVALID, "merge: module '%s' does not match the model", md->name);
        size_t n = (size_t)md->out * md->in;
        float *tmp = malloc(n * sizeof(float));
        if (!tmp) return fl_errorf(FL_ERR_OOM, "merge: out of host memory");
        if (md->W) memcpy(tmp, md->W, n * sizeof(float)); /* PEFT's saved base layer replaces the weight */
        else fl_model_read_param(m, i, tmp);
        fl_lora_merge(tmp, md->in, md->A, md->B, fl_peft_module_r(a, md), md->in, md->out, fl_peft_module_scaling(a, md));
        fl_model_write_param(m, i, tmp);
        free(tmp);
    }
    return FL_OK;
}

/* The adapter folder (fl_cli_find_adapter) read into *a, and its base model (base, else the adapter's
 * base_model_name_or_path) into info->base, checked to exist. */
static fl_status open_adapter(const char *base, const char *adapter_path, const char *hint, fl_peft_adapter *a,
                              fl_cli_adapter_info *info) {
    memset(a, 0, sizeof *a);
    memset(info, 0, sizeof *info);
    info->how = "";
    FL_TRY(fl_cli_find_adapter(adapter_path, info));
    FL_TRY(fl_peft_load(info->adapter, a));
    for (int j = 0; j < a->n; j++) info->blip2 |= !strncmp(a->mods[j].name, "language_model.", 15);
    fl_status s = resolve_base(a, info, base, hint ? hint : "--base <dir>", info->base, sizeof info->base);
    if (s != FL_OK) fl_peft_free(a);
    return s;
}

fl_status fl_cli_resolve_adapter(const char *base, const char *adapter_path, const char *hint,
                                 fl_cli_adapter_info *info) {
    fl_peft_adapter a;
    FL_TRY(open_adapter(base, adapter_path, hint, &a, info));
    fl_peft_free(&a);
    return FL_OK;
}

fl_status fl_cli_load_with_adapter(fl_model *m, const char *base, const char *adapter_path, const char *hint,
                                   const fl_backend *be, fl_mem_pool *pool, int *loaded, fl_cli_adapter_info *info) {
    fl_peft_adapter a;
    memset(&a, 0, sizeof a);
    memset(info, 0, sizeof *info);
    info->how = "";
    if (adapter_path) FL_TRY(open_adapter(base, adapter_path, hint, &a, info));
    else snprintf(info->base, sizeof info->base, "%s", base ? base : "");
    fl_status s = info->base[0] ? FL_OK : fl_errorf(FL_ERR_INVALID, "no base model given");
    if (s == FL_OK) s = fl_cli_load_model(m, info->base, 0, 1337, be, pool, loaded);
    if (s == FL_OK && adapter_path) {
        int *idx = NULL;
        s = fl_peft_check_model(&a, &m->cfg, &m->layout, NULL, &idx);
        free(idx);
        if (s == FL_OK && fl_backend_host_memory(be)) s = fl_peft_merge_into(&a, &m->layout, fl_model_params_f32(m));
        else if (s == FL_OK) s = merge_on_device(&a, m);
        if (s != FL_OK) fl_error_prefix(s, "%s", info->adapter);
        if (s != FL_OK) fl_model_free(m);
    }
    fl_peft_free(&a);
    return s;
}

fl_status fl_cli_blip2_with_adapter(fl_blip2 **b, const char *base, const char *adapter_path, const char *hint,
                                    const fl_backend *be, fl_mem_pool *pool, fl_cli_adapter_info *info) {
    fl_peft_adapter a;
    *b = NULL;
    FL_TRY(open_adapter(base, adapter_path, hint, &a, info));
    fl_status s = fl_blip2_is_folder(info->base)
                      ? fl_blip2_load(b, info->base, be, pool)
                      : fl_errorf(FL_ERR_INVALID, "%s: the adapter's base model '%s' is not a BLIP-2 folder (config.json "
                                  "with model_type \"blip-2\"): give the BLIP-2 folder with %s", info->adapter, info->base,
                                  hint ? hint : "--base <dir>");
    if (s == FL_OK) s = fl_error_prefix(fl_blip2_merge_peft(*b, &a), "%s", info->adapter);
    if (s != FL_OK) fl_blip2_free(*b), *b = NULL;
    fl_peft_free(&a);
    return s;
}

/* The checkpoint's own tokenizer: the adapter folder's (fitllm's step checkpoints carry the run's), else final/'s for
 * final/adapter; NULL if none. */
static const char *own_tokenizer(const fl_cli_adapter_info *info, char *buf, size_t n) {
    if (fl_io_has_tokenizer(info->adapter)) return info->adapter;
    snprintf(buf, n, "%s", info->adapter);
    size_t len = strlen(buf);
    while (len > 1 && buf[len - 1] == '/') buf[--len] = 0;
    char *slash = strrchr(buf, '/');
    if (slash && !strcmp(slash + 1, "adapter")) {
        *slash = 0;
        if (has_file(buf, "COMMITTED") && fl_io_has_tokenizer(buf)) return buf;
    }
    return NULL;
}

const char *fl_cli_adapter_tokenizer(const fl_cli_adapter_info *info, int own_first, char *buf, size_t n) {
    const char *own = own_first ? own_tokenizer(info, buf, n) : NULL;
    if (own) return own;
    /* the base's: with its config.json (bos/eos ids) */
    if (is_dir(info->base) && fl_io_has_tokenizer(info->base)) return info->base;
    return own_first ? NULL : own_tokenizer(info, buf, n);
}

int fl_cmd_merge_lora(int argc, char **argv) {
    const char *cmd = "merge_lora", *adapter = NULL, *base = NULL, *out = NULL;
    int threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help(); return 0; }
        else if (!strcmp(a, "--base") || !strcmp(a, "--checkpoint_dir")) { if (!v) return fl_cli_usage(cmd, "%s needs a folder", a); base = v; i++; }
        else if (!strcmp(a, "--out_dir")) { if (!v) return fl_cli_usage(cmd, "--out_dir needs a folder"); out = v; i++; }
        else if (!strcmp(a, "--threads")) { if (fl_cli_threads(cmd, v, 1024, &threads)) return 2; i++; }
        else if (!strcmp(a, "--accelerator")) { int rc = fl_cli_accelerator(cmd, v); if (rc) return rc; i++; }
        else if (a[0] == '-') return fl_cli_unknown_option(cmd, a, (const char *const[]){"--accelerator", "--base", "--checkpoint_dir", "--help", "--out_dir", "--threads", NULL});
        else if (!adapter) adapter = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!adapter) return fl_cli_usage(cmd, "missing <adapter>");
    char out_buf[FL_CLI_PATH + 16];
    if (!out) {
        snprintf(out_buf, sizeof out_buf, "%s/merged", adapter);
        out = out_buf;
    }
    fl_backend be;
    fl_mem_pool pool, hpool; /* tensors; host staging when the backend's memory is not host memory */
    fl_model m;
    memset(&m, 0, sizeof m);
    fl_blip2 *b2 = NULL; /* the base is a BLIP-2 folder: the adapter goes into its parts (language_model.<module>) */
    fl_cli_adapter_info info;
    int loaded = 0, rc = 0, n_tok = 0;
    char tok_buf[FL_CLI_PATH];
    const char *tok_src = NULL;
    fl_status s = fl_backend_init_by_name(fl_backend_default_name(), &be, threads);
    if (s != FL_OK) return fl_cli_fail(cmd, s, NULL);
    if ((s = fl_backend_pools_init(&be, &pool, &hpool, "cpu", 0)) != FL_OK) return fl_cli_fail(cmd, s, NULL);
    s = fl_cli_resolve_adapter(base, adapter, "--base <dir>", &info);
    const int blip2 = s == FL_OK && (info.blip2 || fl_blip2_is_folder(info.base));
    if (s == FL_OK && blip2) s = fl_cli_blip2_with_adapter(&b2, base, adapter, "--base <dir>", &be, &pool, &info);
    else if (s == FL_OK) s = fl_cli_load_with_adapter(&m, base, adapter, "--base <dir>", &be, &pool, &loaded, &info);
    loaded |= b2 != NULL;
    if (s == FL_OK && !loaded)
        s = fl_errorf(FL_ERR_INVALID, "the base model '%s' has no weights to merge into (a preset is randomly "
                      "initialized): give the base model folder with --base <dir>", info.base);
    /* the merged model written over the base it was merged from (an adapter naming that folder would then merge onto
     * merged weights), or into the adapter's folder (a full model beside the adapter): refused */
    if (s == FL_OK && (fl_cli_same_dir(out, info.base) || fl_cli_same_dir(out, info.adapter)))
        s = fl_errorf(FL_ERR_INVALID, "--out_dir '%s' is the %s folder ('%s'): the merge would overwrite it; give "
                      "another --out_dir", out, fl_cli_same_dir(out, info.base) ? "base model's" : "adapter's",
                      fl_cli_same_dir(out, info.base) ? info.base : info.adapter);
    /* Ctrl-C / SIGTERM while writing: the files under way removed (a new folder appears whole or not at all) */
    const int existed = is_dir(out);
    const fl_cli_signals sigs = {.cmd = cmd, .threads = 1, .first_stops = 1,
                                 .left = existed ? "the existing output folder may mix old and new files"
                                                 : "nothing was written"};
    fl_cli_signals_begin(&sigs);
    /* a new folder: the model and the tokenizer files into out.tmp-PID, renamed into place whole */
    char tmp[FL_CLI_PATH + 32];
    const char *dst = out;
    if (s == FL_OK && !existed) {
        size_t dl = strlen(out);
        while (dl > 1 && out[dl - 1] == '/') dl--;
        if (snprintf(tmp, sizeof tmp, "%.*s.tmp-%ld", (int)dl, out, (long)getpid()) >= (int)sizeof tmp)
            s = fl_errorf(FL_ERR_INVALID, "--out_dir '%s': path too long", out);
        else {
            fl_fs_remove_dir(tmp); /* a crashed merge's leftover with this pid */
            fl_fs_tmp_track(tmp);
            dst = tmp;
            if (mkdir(tmp, 0755) != 0)
                s = fl_errorf(FL_ERR_IO, "%s: cannot create folder %s: %s", out, tmp, strerror(errno));
        }
    }
    /* BLIP-2: every part's tensors under the names its loader reads, with the base's config.json, processor and
     * tokenizer files (fl_blip2_save) */
    if (s == FL_OK) s = blip2 ? fl_blip2_save(b2, info.base, dst) : fl_hf_save_model(&m, dst);
    if (s == FL_OK && (tok_src = fl_cli_adapter_tokenizer(&info, 1, tok_buf, sizeof tok_buf)) != NULL)
        s = fl_io_copy_tokenizer_files(tok_src, dst, &n_tok);
    if (dst != out) {
        if (s == FL_OK) {
            fl_fs_sync_dir(tmp);
            if (rename(tmp, out) != 0) s = fl_errorf(FL_ERR_IO, "%s: cannot rename %s into place: %s", out, tmp, strerror(errno));
        }
        if (s != FL_OK) fl_fs_remove_dir(tmp);
        fl_fs_tmp_untrack(tmp);
    }
    fl_cli_signals_end();
    if (s != FL_OK) {
        rc = fl_cli_fail(cmd, s, &pool);
    } else {
        if (info.how[0]) printf("adapter: %s (%s)\n", info.adapter, info.how);
        else printf("adapter: %s\n", info.adapter);
        printf("base: %s\n", info.base);
        printf("merged -> %s (config.json, model.safetensors%s", out, blip2 ? ", the processor's files: a BLIP-2 "
               "folder" : "");
        if (tok_src) printf(", %d tokenizer file%s from %s: %s)\n", n_tok, n_tok == 1 ? "" : "s", tok_src,
                            tok_src == info.base ? "the base's (the checkpoint carries none)" : "the checkpoint's, the run's");
        else printf("; no tokenizer found next to the adapter or in the base: give generate --tokenizer)\n");
        if (strcmp(info.adapter, adapter) && has_file(adapter, "model.safetensors") && has_file(adapter, "COMMITTED"))
            printf("note: %s itself is already this merged model (a finetune_lora final/)\n", adapter);
    }
    if (m.pool) fl_model_free(&m);
    fl_blip2_free(b2);
    fl_backend_pools_free(&pool, &hpool);
    fl_backend_free(&be);
    return rc == 0 ? 0 : (s == FL_ERR_INVALID || s == FL_ERR_NOT_FOUND ? FL_EXIT_USAGE : rc);
}

/* ---- fitllm merge_shards ---------------------------------------------------------------------- */

static void help_shards(void) {
    printf("usage: fitllm merge_shards <ckpt_dir> [--out DIR]\n\n"
           "  <ckpt_dir>        a committed sharded checkpoint (out/step-000100 or out/final of a run with\n"
           "                    --fsdp.state_dict_type sharded): shard-RRRRR-of-NNNNN.safetensors per rank\n"
           "  --out DIR         where the Hugging Face folder goes (default: <ckpt_dir>/merged; inside a\n"
           "                    step checkpoint it goes with it when train.keep_checkpoints rotates it out)\n\n"
           "Writes config.json, model.safetensors (above 5 GB: model-0000i-of-0000N.safetensors + index, as\n"
           "save_pretrained) and the checkpoint's tokenizer files: the bytes a full (unsharded) checkpoint of\n"
           "the same weights holds. Offline (no mpirun, any machine that sees the files); streamed: it holds\n"
           "one output tensor at a time (as fp32) besides the shard files' read-only mappings. A missing shard\n"
           "file or a range no file holds is an error naming the file and the range (exit 2).\n");
}

int fl_cmd_merge_shards(int argc, char **argv) {
    const char *cmd = "merge_shards", *ckpt = NULL, *out = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { help_shards(); return 0; }
        else if (!strcmp(a, "--out") || !strcmp(a, "--out_dir")) { if (!v) return fl_cli_usage(cmd, "%s needs a folder", a); out = v; i++; }
        else if (a[0] == '-') return fl_cli_unknown_option(cmd, a, (const char *const[]){"--help", "--out", "--out_dir", NULL});
        else if (!ckpt) ckpt = a;
        else return fl_cli_usage(cmd, "unexpected argument '%s'", a);
    }
    if (!ckpt) return fl_cli_usage(cmd, "missing <ckpt_dir>");
    char out_buf[FL_CLI_PATH + 16];
    if (!out) {
        snprintf(out_buf, sizeof out_buf, "%s/merged", ckpt);
        out = out_buf;
    }
    int n_tok = 0;
    const fl_cli_signals sigs = {.cmd = cmd, .threads = 1, .first_stops = 1}; /* as merge_lora's */
    fl_cli_signals_begin(&sigs);
    fl_status s = fl_ckpt_merge_shards(ckpt, out, &n_tok);
    fl_cli_signals_end();
    if (s != FL_OK) {
        int rc = fl_cli_fail(cmd, s, NULL);
        return s == FL_ERR_INVALID || s == FL_ERR_NOT_FOUND || s == FL_ERR_FORMAT ? FL_EXIT_USAGE : rc;
    }
    printf("merged %s -> %s (config.json, model.safetensors, %d tokenizer file%s)\n", ckpt, out, n_tok,
           n_tok == 1 ? "" : "s");
    return 0;
}
