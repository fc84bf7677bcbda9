/* Whether a checkpoint is this run's to resume (fl_ckpt_check_resume, include/fitllm/checkpoint.h): the checkpoint's
 * hyperparameters.yaml (fl_ckpt_write_hparams) against the run's configuration, before anything is loaded.
 *
 * The model first, by name (a fine-tune's checkpoint_dir, pretrain's model_name / model_config), then, where the names
 * differ, by config.json's architecture: another architecture is refused, the same one (a copy of the model in
 * another folder, a hub name for a local folder) is resumed with a note. Then one table, key by key, says what a
 * difference does: REFUSE where the saved state would be taken for another run's (the optimizer's tensors, the
 * adapters' shapes and scale, the data the saved position indexes), NOTE where it only changes the steps to come.
 * fl_ckpt_load's own checks (the trainable-element count, the optimizer named in the state) stay: they guard library
 * callers and checkpoints without hyperparameters.yaml. LitGPT checks none of this (its fabric.load fails on shapes
 * only). */
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fs.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"

typedef enum { RS_REFUSE, RS_NOTE } rs_action;

/* what a difference in `key` does, and why (said after the two values) */
static const struct {
    const char *key;
    rs_action act;
    const char *why;
} k_resume_keys[] = {
    {"optimizer", RS_REFUSE, "the saved state is that optimizer's"},
    {"optimizer.state_dtype", RS_REFUSE, "the saved optimizer state is held in that type"},
    {"lora_r", RS_REFUSE, "the saved adapters have that rank"},
    {"lora_alpha", RS_REFUSE, "the saved adapters are scaled by lora_alpha / r: another scale makes another model of them"},
    {"use_rslora", RS_REFUSE, "the saved adapters are scaled by lora_alpha / sqrt(r) with it, lora_alpha / r without: "
                              "another scale makes another model of them"},
    {"lora_query", RS_REFUSE, "the saved adapters are those modules'"},
    {"lora_key", RS_REFUSE, "the saved adapters are those modules'"},
    {"lora_value", RS_REFUSE, "the saved adapters are those modules'"},
    {"lora_projection", RS_REFUSE, "the saved adapters are those modules'"},
    {"lora_mlp", RS_REFUSE, "the saved adapters are those modules'"},
    {"lora_head", RS_REFUSE, "the saved adapters are those modules'"},
    {"lora_target_modules", RS_REFUSE, "the saved adapters are those modules'"},
    {"data", RS_REFUSE, "the saved data position indexes that data set"},
    {"data.seed", RS_REFUSE, "it draws the train/validation split (JSON, Alpaca) or the samples (Synthetic): the saved "
                             "data position would index other samples"},
    {"data.val_split_fraction", RS_REFUSE, "it decides which samples train: the saved data position would index "
                                           "others"},
    {"data.n_train", RS_REFUSE, "the saved data position indexes that many samples"},
    {"lora_dropout", RS_NOTE, "the resumed steps drop the adapters' input at the new rate"},
    {"quantize", RS_NOTE, "the adapters go on over the base weights stored the new way"},
    {"seed", RS_NOTE, "the resumed steps' dropout masks follow the new seed (the sample order stays the checkpoint's)"},
    {"precision", RS_NOTE, "the resumed steps compute in the new precision"},
    {"tokenizer_dir", RS_NOTE, "the samples are tokenized by the new one: it must be the checkpoint's tokenizer"},
    {"data.json_path", RS_NOTE, "the data is read from there: it must be the checkpoint's for the saved position to "
                                "mean the same samples"},
    {"data.train_data_path", RS_NOTE, "the data is read from there: it must be the checkpoint's for the saved position "
                                      "to mean the same samples"},
    {"data.prompt_style", RS_NOTE, "the resumed steps' samples are prepared the new way"},
    {"data.mask_prompt", RS_NOTE, "the resumed steps' samples are prepared the new way"},
    {"data.ignore_index", RS_NOTE, "the resumed steps' samples are prepared the new way"},
    {"data.max_source_length", RS_NOTE, "the resumed steps' samples are prepared the new way"},
    {"data.max_target_length", RS_NOTE, "the resumed steps' samples are prepared the new way"},
    {"data.lengths", RS_NOTE, "the resumed steps' samples are prepared the new way"},
    {"train.max_seq_length", RS_NOTE, "the resumed steps' samples are prepared the new way"},
    {"train.global_batch_size", RS_NOTE, "the resumed steps take the new batch"},
    {"train.micro_batch_size", RS_NOTE, "the resumed steps take the new batch"},
    {"optimizer.lr", RS_NOTE, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.lr_warmup_steps", RS_NOTE, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.lr_warmup_fraction", RS_NOTE, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.min_lr", RS_NOTE, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.max_steps", RS_NOTE, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.epochs", RS_NOTE, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.max_tokens", RS_NOTE, "the resumed steps' learning-rate schedule is the new one's"},
    {"optimizer.weight_decay", RS_NOTE, "the resumed updates use the new value"},
    {"optimizer.betas", RS_NOTE, "the resumed updates use the new value"},
    {"optimizer.eps", RS_NOTE, "the resumed updates use the new value"},
    {"optimizer.momentum", RS_NOTE, "the resumed updates use the new value"},
    {"optimizer.dampening", RS_NOTE, "the resumed updates use the new value"},
    {"optimizer.nesterov", RS_NOTE, "the resumed updates use the new value"},
    {"train.max_norm", RS_NOTE, "the resumed updates clip at the new norm"},
};
#define N_RESUME_KEYS (sizeof k_resume_keys / sizeof k_resume_keys[0])

/* text appended to buf (its length kept at o), cut at n */
static void say(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(char *buf, size_t n, const char *fmt, ...) {
    size_t o = strlen(buf);
    if (o + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + o, n - o, fmt, ap);
    va_end(ap);
}

static int is_null(const char *v) { return !v || !*v || !strcmp(v, "null") || !strcmp(v, "~"); }

static int cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* The model a configuration names: pretrain's model_name, model_config (a file) or model_config mapping (fields:
 * "key: value" each, sorted), else checkpoint_dir (a fine-tune's model; pretrain's initial weights). */
static void model_name(const char *ckdir, const char *name, const char *mcfg, const char **fields, int nf, char *out,
                       size_t n) {
    out[0] = 0;
    if (!is_null(name)) snprintf(out, n, "%s", name);
    else if (!is_null(mcfg)) snprintf(out, n, "model_config %s", mcfg);
    else if (nf) {
        qsort(fields, (size_t)nf, sizeof *fields, cmp_str);
        say(out, n, "model_config {");
        for (int i = 0; i < nf; i++) say(out, n, "%s%s", i ? ", " : "", fields[i]);
        say(out, n, "}");
    } else if (!is_null(ckdir)) snprintf(out, n, "%s", ckdir);
}

#define FIELD_TEXT 160
/* The run's and the checkpoint's model names (ck: the checkpoint's hyperparameters); *ck_dir: its checkpoint_dir. */
static fl_status model_names(const fl_run_config *cfg, const fl_cfg_entries *ck, char *run, char *was, size_t n,
                             const char **ck_dir) {
    const char *f[FL_CFG_MODEL_FIELDS];
    char (*text)[FIELD_TEXT] = calloc(2 * FL_CFG_MODEL_FIELDS, FIELD_TEXT);
    if (!text) return fl_errorf(FL_ERR_OOM, "out of host memory");
    int nf = 0;
    for (int i = 0; i < cfg->n_model_fields && nf < FL_CFG_MODEL_FIELDS; i++, nf++) {
        snprintf(text[nf], FIELD_TEXT, "%s: %s", cfg->model_fields[i].key, cfg->model_fields[i].value);
        f[nf] = text[nf];
    }
    model_name(cfg->checkpoint_dir, cfg->model_name, cfg->model_config, f, nf, run, n);
    nf = 0;
    for (int i = 0; i < ck->n && nf < FL_CFG_MODEL_FIELDS; i++)
        if (!strncmp(ck->e[i].key, "model_config.", 13)) {
            snprintf(text[FL_CFG_MODEL_FIELDS + nf], FIELD_TEXT, "%s: %s", ck->e[i].key + 13, ck->e[i].value);
            f[nf] = text[FL_CFG_MODEL_FIELDS + nf];
            nf++;
        }
    *ck_dir = fl_cfg_entries_value(ck, "checkpoint_dir");
    model_name(*ck_dir ? *ck_dir : "", fl_cfg_entries_value(ck, "model_name"), fl_cfg_entries_value(ck, "model_config"),
               f, nf, was, n);
    free(text);
    return FL_OK;
}

/* The checkpoint's architecture: its config.json (a full checkpoint), else its model's (a LoRA step: the base's
 * folder, or a preset); 0 when neither can be read here. src: where it came from. */
static int ckpt_model_config(const char *dir, const char *ck_dir, fl_model_config *mc, char *src, size_t n) {
    char p[FL_CFG_PATH + 32];
    snprintf(p, sizeof p, "%s/config.json", dir);
    if (fl_fs_is_file(p) && fl_hf_load_config(p, mc) == FL_OK) return snprintf(src, n, "its config.json"), 1;
    if (is_null(ck_dir)) return 0;
    snprintf(p, sizeof p, "%s/config.json", ck_dir);
    if (fl_fs_is_file(p) && fl_hf_load_config(p, mc) == FL_OK) return snprintf(src, n, "'%s'", p), 1;
    if (!fl_fs_is_path_form(ck_dir) && !fl_fs_is_dir(ck_dir) && fl_preset_find(ck_dir, mc) == FL_OK)
        return snprintf(src, n, "the preset's"), 1;
    return 0;
}

/* The first architecture field (config.json's name) in which a and b differ, their values in diff; 0: none. */
static int arch_differs(const fl_model_config *a, const fl_model_config *b, char *diff, size_t n) {
#define MF(name, field, kind) {name, offsetof(fl_model_config, field), kind}
    static const struct {
        const char *name;
        size_t off;
        char kind; /* a: fl_arch, i: int, f: float */
    } f[] = {
        MF("model_type", arch, 'a'), MF("vocab_size", vocab_size, 'i'), MF("hidden_size", dim, 'i'),
        MF("num_hidden_layers", n_layers, 'i'), MF("num_attention_heads", n_heads, 'i'),
        MF("num_key_value_heads", n_kv_heads, 'i'), MF("head_dim", head_dim, 'i'), MF("intermediate_size", ffn_dim, 'i'),
        MF("max_position_embeddings", max_seq, 'i'), MF("the norm's eps", norm_eps, 'f'),
        MF("rope_theta", rope_theta, 'f'), MF("rope_scaling", rope_scaling.type, 'i'),
        MF("rope_scaling.factor", rope_scaling.factor, 'f'),
        MF("rope_scaling.low_freq_factor", rope_scaling.low_freq_factor, 'f'),
        MF("rope_scaling.high_freq_factor", rope_scaling.high_freq_factor, 'f'),
        MF("rope_scaling.original_max_position_embeddings", rope_scaling.original_max_position, 'i'),
        MF("tie_word_embeddings", tie_embeddings, 'i'), MF("attention_bias", attention_bias, 'i'),
        MF("mlp_bias", mlp_bias, 'i'), MF("type_vocab_size", type_vocab_size, 'i'),
        MF("num_decoder_layers", n_dec_layers, 'i'), MF("relative_attention_num_buckets", rel_buckets, 'i'),
        MF("relative_attention_max_distance", rel_max_dist, 'i'), MF("the gated FFN", ffn_gated, 'i'),
        MF("the head's scale", head_scale, 'i'), MF("the exact GELU", gelu_exact, 'i'),
    };
#undef MF
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        const char *x = (const char *)a + f[i].off, *y = (const char *)b + f[i].off;
        if (f[i].kind == 'f' ? *(const float *)x == *(const float *)y : *(const int *)x == *(const int *)y) continue;
        if (f[i].kind == 'f')
            snprintf(diff, n, "%s %g there, %g here", f[i].name, (double)*(const float *)y, (double)*(const float *)x);
        else if (f[i].kind == 'a')
            snprintf(diff, n, "%s %s there, %s here", f[i].name, fl_arch_get(*(const fl_arch *)y)->name,
                     fl_arch_get(*(const fl_arch *)x)->name);
        else snprintf(diff, n, "%s %d there, %d here", f[i].name, *(const int *)y, *(const int *)x);
        return 1;
    }
    return 0;
}

static int same_model(const char *a, const char *b) {
    if (!strcmp(a, b)) return 1;
    char ra[PATH_MAX], rb[PATH_MAX];
    return realpath(a, ra) && realpath(b, rb) && !strcmp(ra, rb);
}

/* The model: refused (a part of why, its fix in fix) or noted. */
static fl_status check_model(const char *dir, const fl_run_config *cfg, const fl_model_config *mc,
                             const fl_cfg_entries *ck, char *why, char *fix, size_t wn, char *notes, size_t n) {
    char run[FL_CFG_PATH + 64], was[FL_CFG_PATH + 64], src[FL_CFG_PATH + 64], diff[256];
    const char *ck_dir = NULL;
    FL_TRY(model_names(cfg, ck, run, was, sizeof run, &ck_dir));
    if (!was[0] || same_model(run, was)) return FL_OK;
    fl_model_config cm;
    memset(&cm, 0, sizeof cm);
    const int known = ckpt_model_config(dir, ck_dir, &cm, src, sizeof src);
    if (known && arch_differs(mc, &cm, diff, sizeof diff)) {
        say(why, wn, "%sthe checkpoint was trained from model '%s', this run's model is '%s', another architecture "
            "(%s: %s)", why[0] ? "; " : "", was, run, src, diff);
        say(fix, wn, "%sthe model '%s'", fix[0] ? ", " : "", was);
    } else if (known) {
        say(notes, n, "note: --resume: the checkpoint was trained from '%s', this run names '%s': the same architecture "
            "(%s), taken for the same model%s\n", was, run, src,
            cfg->command == FL_CMD_FINETUNE_LORA ? " (the saved adapters go on over this run's base weights)" : "");
    } else {
        say(notes, n, "note: --resume: the checkpoint was trained from '%s', this run names '%s' (the checkpoint's "
            "architecture cannot be read here: no config.json in it or its model's folder), taken for the same model\n",
            was, run);
    }
    return FL_OK;
}

/* Each key of the table: refused or noted when the checkpoint's value is not this run's (both as
 * hyperparameters.yaml writes them, the checkpoint's read back through the run's parser). */
static void check_keys(const fl_run_config *cfg, const fl_cfg_entries *ck, fl_run_config *tmp, char *why, char *fix,
                       size_t wn, char *notes, size_t n) {
    char here[512], there[512];
    for (size_t i = 0; i < N_RESUME_KEYS; i++) {
        const char *key = k_resume_keys[i].key;
        const int lora = !strncmp(key, "lora_", 5) || !strcmp(key, "use_rslora") || !strcmp(key, "quantize");
        const char *v = fl_cfg_entries_value(ck, key);
        if (!v || (lora && cfg->command != FL_CMD_FINETUNE_LORA)) continue; /* not in that run's, or not this run's */
        if (fl_cfg_value_text(cfg, key, here, sizeof here) != FL_OK) continue;
        *tmp = *cfg;
        if (fl_cfg_set(tmp, key, v) != FL_OK || fl_cfg_value_text(tmp, key, there, sizeof there) != FL_OK)
            snprintf(there, sizeof there, "%s", v); /* a value this build does not take: as written */
        if (!strcmp(here, there)) continue;
        if (k_resume_keys[i].act == RS_NOTE) {
            say(notes, n, "note: --resume: the checkpoint's run had %s %s, this run gives %s: %s\n", key, there, here,
                k_resume_keys[i].why);
            continue;
        }
        say(why, wn, "%sthe checkpoint's run had %s %s, this run gives %s (%s)", why[0] ? "; " : "", key, there, here,
            k_resume_keys[i].why);
        say(fix, wn, "%s--%s %s%s%s", fix[0] ? " " : "", key, strchr(there, ' ') ? "'" : "", there,
            strchr(there, ' ') ? "'" : "");
    }
}

fl_status fl_ckpt_check_resume(const char *dir, const fl_run_config *cfg, const fl_model_config *mc, char *notes,
                               size_t n) {
    char p[FL_CFG_PATH + 32];
    if (n) notes[0] = 0;
    snprintf(p, sizeof p, "%s/hyperparameters.yaml", dir);
    if (!fl_fs_is_file(p)) return FL_OK; /* written by a library caller: nothing to compare */
    fl_cfg_entries ck;
    fl_cfg_entries_init(&ck);
    fl_status s = fl_cfg_entries_load_yaml_file(&ck, p);
    const size_t wn = 4 * FL_CFG_PATH;
    char *why = calloc(1, wn), *fix = calloc(1, wn);
    fl_run_config *tmp = malloc(sizeof *tmp);
    if (s == FL_OK && (!why || !fix || !tmp)) s = fl_errorf(FL_ERR_OOM, "out of host memory");
    if (s == FL_OK) s = check_model(dir, cfg, mc, &ck, why, fix, wn, notes, n);
    if (s == FL_OK) check_keys(cfg, &ck, tmp, why, fix, wn, notes, n);
    if (s == FL_OK && why[0])
        s = fl_errorf(FL_ERR_INVALID, "--resume '%s' continues another run: %s. Resume it with the checkpoint's "
                      "settings (%s), or start a new run without --resume (with --overwrite when '%s' holds a run)", dir,
                      why, fix, cfg->out_dir);
    else if (s != FL_OK && s != FL_ERR_OOM)
        s = fl_error_prefix(s, "--resume '%s'", dir);
    free(why);
    free(fix);
    free(tmp);
    fl_cfg_entries_free(&ck);
    return s;
}
