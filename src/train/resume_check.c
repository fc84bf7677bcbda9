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
#include <sys/stat.h>

#include "core/fs.h"
#include "fitllm/blip2.h"
#include "fitllm/checkpoint.h"
#include "fitllm/io.h"
#include "fitllm/lora.h"
#include "fitllm/peft.h"
#include "fitllm/trainer.h"
#include "resume_check.h"

typedef enum { RS_REFUSE, RS_NOTE } rs_action;
enum { RS_LM = 1, RS_B2 = 2, RS_ALL = 3 }; /* the runs a key applies to: the language-model trainer's, BLIP-2's */

/* what a difference in `key` does in the runs it applies to, and why (said after the two values). The LoRA targets
 * (lora_query ... lora_head, lora_target_modules) are compared as the module sets they make (check_targets). */
static const struct {
    const char *key;
    rs_action act;
    unsigned char runs;
    const char *why;
} k_resume_keys[] = {
    {"optimizer", RS_REFUSE, RS_ALL, "the saved state is that optimizer's"},
    {"optimizer.state_dtype", RS_REFUSE, RS_ALL, "the saved optimizer state is held in that type"},
    {"lora_r", RS_REFUSE, RS_ALL, "the saved adapters have that rank"},
    {"lora_alpha", RS_REFUSE, RS_ALL, "the saved adapters are scaled by lora_alpha / r: another scale makes another model "
                                      "of them"},
    {"use_rslora", RS_REFUSE, RS_ALL, "the saved adapters are scaled by lora_alpha / sqrt(r) with it, lora_alpha / r "
                                      "without: another scale makes another model of them"},
    {"data", RS_REFUSE, RS_ALL, "the saved data position indexes that data set"},
    {"data.seed", RS_REFUSE, RS_LM, "it draws the train/validation split (JSON, Alpaca) or the samples (Synthetic): the "
                                    "saved data position would index other samples"},
    {"data.val_split_fraction", RS_REFUSE, RS_ALL, "it decides which samples train: the saved data position would "
                                                   "index others"},
    {"data.n_train", RS_REFUSE, RS_LM, "the saved data position indexes that many samples"},
    {"lora_dropout", RS_NOTE, RS_ALL, "the resumed steps drop the adapters' input at the new rate"},
    {"quantize", RS_NOTE, RS_ALL, "the adapters go on over the base weights stored the new way"},
    {"seed", RS_NOTE, RS_LM, "the resumed steps' dropout masks follow the new seed (the sample order stays the "
                             "checkpoint's)"},
    {"seed", RS_REFUSE, RS_B2, "it shuffles the captions (which records train, which validate) and orders each epoch: the "
                               "saved data position would index other records"},
    {"precision", RS_NOTE, RS_ALL, "the resumed steps compute in the new precision"},
    {"tokenizer_dir", RS_NOTE, RS_LM, "the samples are tokenized by the new one: it must be the checkpoint's "
                                      "tokenizer"},
    {"data.json_path", RS_NOTE, RS_ALL, "the data is read from there: it must be the checkpoint's for the saved position "
                                        "to mean the same samples"},
    {"data.train_data_path", RS_NOTE, RS_LM, "the data is read from there: it must be the checkpoint's for the saved "
                                             "position to mean the same samples"},
    {"data.prompt_style", RS_NOTE, RS_LM, "the resumed steps' samples are prepared the new way"},
    {"data.mask_prompt", RS_NOTE, RS_LM, "the resumed steps' samples are prepared the new way"},
    {"data.ignore_index", RS_NOTE, RS_LM, "the resumed steps' samples are prepared the new way"},
    {"data.max_source_length", RS_NOTE, RS_LM, "the resumed steps' samples are prepared the new way"},
    {"data.max_target_length", RS_NOTE, RS_LM, "the resumed steps' samples are prepared the new way"},
    {"data.lengths", RS_NOTE, RS_LM, "the resumed steps' samples are prepared the new way"},
    {"train.max_seq_length", RS_NOTE, RS_ALL, "the resumed steps' samples are prepared the new way"},
    {"train.global_batch_size", RS_NOTE, RS_ALL, "the resumed steps take the new batch"},
    {"train.micro_batch_size", RS_NOTE, RS_ALL, "the resumed steps take the new batch"},
    {"optimizer.lr", RS_NOTE, RS_ALL, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.lr_warmup_steps", RS_NOTE, RS_ALL, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.lr_warmup_fraction", RS_NOTE, RS_LM, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.min_lr", RS_NOTE, RS_ALL, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.max_steps", RS_NOTE, RS_ALL, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.epochs", RS_NOTE, RS_ALL, "the resumed steps' learning-rate schedule is the new one's"},
    {"train.max_tokens", RS_NOTE, RS_LM, "the resumed steps' learning-rate schedule is the new one's"},
    {"optimizer.weight_decay", RS_NOTE, RS_ALL, "the resumed updates use the new value"},
    {"optimizer.betas", RS_NOTE, RS_ALL, "the resumed updates use the new value"},
    {"optimizer.eps", RS_NOTE, RS_ALL, "the resumed updates use the new value"},
    {"optimizer.momentum", RS_NOTE, RS_ALL, "the resumed updates use the new value"},
    {"optimizer.dampening", RS_NOTE, RS_ALL, "the resumed updates use the new value"},
    {"optimizer.nesterov", RS_NOTE, RS_ALL, "the resumed updates use the new value"},
    {"train.max_norm", RS_NOTE, RS_ALL, "the resumed updates clip at the new norm"},
    {"blip2.train", RS_REFUSE, RS_B2, "the saved state holds those parts' weights and optimizer state"},
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

/* The run's model as resume compares it: a language model's config, or a BLIP-2 model's (bc set). */
typedef struct {
    const fl_model_config *mc;
    const fl_blip2_config *bc;
} rs_model;

/* The checkpoint's architecture: its config.json (a full checkpoint), else its model's (a LoRA step: the base's
 * folder, or a preset); 0 when neither can be read here. src: where it came from. BLIP-2 (run->bc): into *bc. */
static int ckpt_model_config(const char *dir, const char *ck_dir, const rs_model *run, fl_model_config *mc,
                             fl_blip2_config *bc, char *src, size_t n) {
    char p[FL_CFG_PATH + 32];
    for (int k = 0; k < 2; k++) {
        const char *d = k ? ck_dir : dir;
        if (k && is_null(ck_dir)) return 0;
        snprintf(p, sizeof p, "%s/config.json", d);
        if (fl_fs_is_file(p) && (run->bc ? fl_blip2_config_load(p, bc) : fl_hf_load_config(p, mc)) == FL_OK)
            return k ? snprintf(src, n, "'%s'", p) : snprintf(src, n, "its config.json"), 1;
    }
    if (!fl_fs_is_path_form(ck_dir) && !fl_fs_is_dir(ck_dir) &&
        (run->bc ? fl_blip2_preset(ck_dir, bc) : fl_preset_find(ck_dir, mc)) == FL_OK)
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

/* arch_differs over a BLIP-2 model's parts (their config.json sections) and how they join */
static int b2_arch_differs(const fl_blip2_config *a, const fl_blip2_config *b, char *diff, size_t n) {
    static const char *const part[3] = {"vision_config.", "qformer_config.", "text_config."};
    const fl_model_config *pa[3] = {&a->vision, &a->qformer, &a->text}, *pb[3] = {&b->vision, &b->qformer, &b->text};
    char d[200];
    for (int k = 0; k < 3; k++)
        if (arch_differs(pa[k], pb[k], d, sizeof d)) return snprintf(diff, n, "%s%s", part[k], d), 1;
    if (a->n_queries != b->n_queries)
        return snprintf(diff, n, "num_query_tokens %d there, %d here", b->n_queries, a->n_queries), 1;
    if (a->image_token != b->image_token)
        return snprintf(diff, n, "image_token_index %d there, %d here", b->image_token, a->image_token), 1;
    return 0;
}

static int same_model(const char *a, const char *b) {
    if (!strcmp(a, b)) return 1;
    char ra[PATH_MAX], rb[PATH_MAX];
    return realpath(a, ra) && realpath(b, rb) && !strcmp(ra, rb);
}

/* The model: refused (a part of why, its fix in fix) or noted. */
static fl_status check_model(const char *dir, const fl_run_config *cfg, const rs_model *rm, const fl_cfg_entries *ck,
                             char *why, char *fix, size_t wn, char *notes, size_t n) {
    char run[FL_CFG_PATH + 64], was[FL_CFG_PATH + 64], src[FL_CFG_PATH + 64], diff[256];
    const char *ck_dir = NULL;
    FL_TRY(model_names(cfg, ck, run, was, sizeof run, &ck_dir));
    if (!was[0] || same_model(run, was)) return FL_OK;
    fl_model_config cm;
    fl_blip2_config cb;
    memset(&cm, 0, sizeof cm);
    memset(&cb, 0, sizeof cb);
    const int known = ckpt_model_config(dir, ck_dir, rm, &cm, &cb, src, sizeof src);
    if (known && (rm->bc ? b2_arch_differs(rm->bc, &cb, diff, sizeof diff) : arch_differs(rm->mc, &cm, diff, sizeof diff))) {
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
    fl_error_clear(); /* a config.json that is not this kind of model's: read as unknown */
    return FL_OK;
}

/* --blip2.train as the parts it trains, in a fixed order ("" is the command's default) */
static void b2_parts(const char *v, int lora, char *out, size_t n) {
    if (!v[0]) v = lora ? "lm" : "qformer,lm";
    static const char *const names[3] = {"vision", "qformer", "lm"};
    out[0] = 0;
    for (int k = 0; k < 3; k++) {
        char buf[64];
        snprintf(buf, sizeof buf, "%s", v);
        int on = 0;
        for (char *save = NULL, *w = strtok_r(buf, ", ", &save); w && !on; w = strtok_r(NULL, ", ", &save))
            on = !strcmp(w, names[k]);
        if (on) say(out, n, "%s%s", out[0] ? "," : "", names[k]);
    }
    if (!out[0]) snprintf(out, n, "%s", v); /* none known: as given (the run refuses it) */
}

/* Each key of the table that applies to this run (b2: a BLIP-2 run's): refused or noted when the checkpoint's value
 * is not this run's (both as hyperparameters.yaml writes them, the checkpoint's read back through the run's parser). */
static void check_keys(const fl_run_config *cfg, int b2, const fl_cfg_entries *ck, fl_run_config *tmp, char *why,
                       char *fix, size_t wn, char *notes, size_t n) {
    char here[512], there[512];
    for (size_t i = 0; i < N_RESUME_KEYS; i++) {
        const char *key = k_resume_keys[i].key;
        const int lora = !strncmp(key, "lora_", 5) || !strcmp(key, "use_rslora") || !strcmp(key, "quantize");
        const char *v = fl_cfg_entries_value(ck, key);
        if (!(k_resume_keys[i].runs & (b2 ? RS_B2 : RS_LM))) continue; /* not what this kind of run reads */
        if (!v && !strcmp(key, "blip2.train")) v = ""; /* written only when given: absent is the default */
        if (!v || (lora && cfg->command != FL_CMD_FINETUNE_LORA)) continue; /* not in that run's, or not this run's */
        if (fl_cfg_value_text(cfg, key, here, sizeof here) != FL_OK) continue;
        *tmp = *cfg;
        if (fl_cfg_set(tmp, key, v) != FL_OK || fl_cfg_value_text(tmp, key, there, sizeof there) != FL_OK)
            snprintf(there, sizeof there, "%s", v); /* a value this build does not take: as written */
        if (!strcmp(key, "blip2.train")) { /* the parts, not their spelling ("" is the command's default) */
            const int l = cfg->command == FL_CMD_FINETUNE_LORA;
            b2_parts(cfg->blip2_train, l, here, sizeof here);
            b2_parts(tmp->blip2_train, l, there, sizeof there);
        }
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

/* The modules c's LoRA switches or lora_target_modules make on model mc: as fl_lora_describe says them into mods (the
 * comparison), and as their targets, sorted, comma-separated, a fused q|k|v's trained parts after it ("c_attn[q+v]")
 * into out (the message); "" when they make none (the run refuses that itself). *parts: the fused parts c trains. */
static void lora_targets(const fl_run_config *c, const fl_model_config *mc, char *out, size_t n, char *mods,
                         size_t mn, unsigned *parts) {
    fl_lora_config lc;
    out[0] = mods[0] = 0;
    *parts = 0;
    if (fl_trainer_lora_config(c, mc, &lc) != FL_OK || fl_lora_describe(&lc, mc, mods, mn) != FL_OK) {
        mods[0] = 0;
        fl_error_clear();
        return;
    }
    *parts = lc.qkv_parts;
    const char *t[FL_LORA_MAX_TARGETS];
    for (int i = 0; i < lc.n_targets; i++) t[i] = lc.targets[i];
    qsort(t, (size_t)lc.n_targets, sizeof *t, cmp_str);
    const char *fused = fl_arch_get(mc->arch)->lora_switch[0];
    for (int i = 0; i < lc.n_targets; i++) {
        say(out, n, "%s%s", i ? "," : "", t[i]);
        for (int p = 0, first = 1; lc.qkv_parts && !strcmp(t[i], fused) && p < 3; p++)
            if (lc.qkv_parts >> p & 1u) say(out, n, "%s%s", first ? "[" : "+", (const char *[]){"q", "k", "v"}[p]), first = 0;
        if (lc.qkv_parts && !strcmp(t[i], fused)) say(out, n, "]");
    }
}

/* Part p (of parts) of B (out, r) is all zero */
static int part_zero(const fl_peft_module *m, int r, int p, int parts) {
    const size_t rows = (size_t)(m->out / parts), from = (size_t)p * rows * r;
    for (size_t i = 0; i < rows * r; i++)
        if (m->B[from + i] != 0.0f) return 0;
    return 1;
}

/* Whether the adapter modules' B rows match what this run trains (mods): 1 when a part this run freezes
 * (fl_lora_module.frozen) is not 0 in some module (an older fitllm's adapter trained it), 2 when a part it trains is 0 in
 * all of them while their others are not (the checkpoint's run froze it), else 0. */
static int rows_differ(const fl_peft_adapter *a, const fl_lora_module *mods, int n, const int *at, int r) {
    for (int p = 0; p < 3; p++) {
        int kind = 0, zero = 1, other = 0; /* among the fused modules: p all zero; some other part not */
        for (int j = 0; j < n; j++) {
            if (mods[j].parts != 3) continue;
            const int z = part_zero(&a->mods[at[j]], r, p, 3);
            if ((mods[j].frozen >> p & 1u) && !z) return 1; /* trained there, frozen here */
            if (mods[j].frozen >> p & 1u) continue;
            kind = 1;
            zero &= z;
            for (int q = 0; q < 3; q++) other |= q != p && !part_zero(&a->mods[at[j]], r, q, 3);
        }
        if (kind && zero && other) return 2; /* frozen there, trained here */
    }
    return 0;
}

/* The checkpoint's own PEFT adapter (dir/adapter_config.json: what its run trained) against this run's LoRA modules
 * (mc: the whole model): 1 when it is on the same modules with the fused q|k|v's rows trained where this run trains
 * them, 2 when not (its target_modules into t), 0 when the checkpoint has no adapter to read or its run froze parts
 * this run trains (its hyperparameters.yaml says which). */
static int adapter_fits(const char *dir, const fl_run_config *cfg, const fl_model_config *mc, char *t, size_t tn) {
    char p[FL_CFG_PATH + 32];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    fl_peft_adapter a;
    if (!fl_fs_is_file(p) || fl_peft_load(dir, &a) != FL_OK) return fl_error_clear(), 0;
    fl_lora_config lc;
    fl_param_layout lay;
    fl_lora_module *mods = NULL;
    int n = 0, res = 0, same = 0, rows = 0, *at = NULL;
    if (fl_trainer_lora_config(cfg, mc, &lc) == FL_OK && fl_layout_build(&lay, mc) == FL_OK) {
        if (fl_lora_modules(&lc, &lay, mc, &mods, &n) == FL_OK && (at = calloc((size_t)n + 1, sizeof *at)) != NULL) {
            same = n == a.n;
            for (int j = 0; j < n && same; j++) {
                for (at[j] = 0; at[j] < a.n && strcmp(a.mods[at[j]].name, mods[j].name); at[j]++) {}
                same = at[j] < a.n && a.mods[at[j]].out == mods[j].out && fl_peft_module_r(&a, &a.mods[at[j]]) == lc.r;
            }
            rows = same ? rows_differ(&a, mods, n, at, lc.r) : 0;
            res = rows == 2 ? 0 : same && !rows ? 1 : 2;
        }
        fl_layout_free(&lay);
    }
    fl_error_clear();
    t[0] = 0;
    for (int i = 0; i < a.cfg.lora.n_targets; i++) say(t, tn, "%s%s", i ? "," : "", a.cfg.lora.targets[i]);
    free(at);
    free(mods);
    fl_peft_free(&a);
    return res;
}

/* LoRA: the modules the checkpoint's adapters are on against this run's, as sets (lora_query true and
 * lora_target_modules q_proj are one target on LLaMA; GPT-2's lora_query and lora_value the q and v parts of c_attn);
 * mc: the model the adapters go on (BLIP-2's language model). The checkpoint's own adapter (dir/adapter_config.json, a
 * language model's) first: the same modules and rows as this run's are resumed whatever its switches say (an older
 * fitllm's whole-c_attn / both-c_proj adapter resumed with --lora_target_modules), other ones that its switches
 * make as this run's are an older fitllm's, refused with the target_modules that resume them as trained. */
static void check_targets(const char *dir, const fl_run_config *cfg, const fl_model_config *mc, int b2,
                          const fl_cfg_entries *ck, fl_run_config *tmp, char *why, char *fix, size_t wn) {
    static const char *const keys[] = {"lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp",
                                       "lora_head", "lora_target_modules"};
    if (cfg->command != FL_CMD_FINETUNE_LORA) return;
    char at[FL_LORA_MAX_TARGETS * 34];
    const int fits = b2 ? 0 : adapter_fits(dir, cfg, mc, at, sizeof at);
    if (fits == 1) return;
    *tmp = *cfg;
    int given = 0;
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const char *v = fl_cfg_entries_value(ck, keys[i]);
        if (!v) continue;
        given = 1;
        if (fl_cfg_set(tmp, keys[i], is_null(v) && i + 1 == sizeof keys / sizeof keys[0] ? "" : v) != FL_OK)
            fl_error_clear();
    }
    char here[512], there[512], hm[1024], tm_[1024];
    unsigned hp, tp;
    lora_targets(cfg, mc, here, sizeof here, hm, sizeof hm, &hp);
    lora_targets(tmp, mc, there, sizeof there, tm_, sizeof tm_, &tp);
    if (fits == 2 && (!given || !strcmp(hm, tm_))) { /* its switches are this run's, its adapter is not: older */
        say(why, wn, "%sthe checkpoint's adapter (adapter_config.json target_modules %s) is not on the modules this "
            "run's LoRA trains (%s): an older fitllm trained the whole GPT-2 c_attn for lora_query / lora_value, and "
            "c_proj (both projections) for lora_projection / lora_mlp", why[0] ? "; " : "", at, here);
        say(fix, wn, "%s--lora_target_modules %s", fix[0] ? " " : "", at);
        return;
    }
    if (!given || !hm[0] || !tm_[0] || !strcmp(hm, tm_)) return; /* not written by that run, or the same */
    say(why, wn, "%sthe checkpoint's adapters are on the modules %s, this run's LoRA targets are %s (the saved adapters "
        "are those modules')", why[0] ? "; " : "", there, here);
    const char *tm = fl_cfg_entries_value(ck, "lora_target_modules");
    if (!is_null(tm) || !tp) /* its target list, else (a fused module's parts, which no list says) its switches */
        say(fix, wn, "%s--lora_target_modules %s", fix[0] ? " " : "", is_null(tm) ? there : tm);
    for (size_t i = 0; i + 1 < sizeof keys / sizeof keys[0] && is_null(tm) && tp; i++) {
        const char *v = fl_cfg_entries_value(ck, keys[i]);
        if (v) say(fix, wn, "%s--%s %s", fix[0] ? " " : "", keys[i], v);
    }
}

/* A LoRA run's base weights: the checkpoint's adapters were trained over random ones (hyperparameters.yaml's init:
 * what the run started from) and this run would read pretrained weights, or the reverse: refused (the adapters would
 * go on over another base, and name the wrong one). A run reads weights when --init random is not given and its
 * checkpoint_dir is a model folder or a llama2.c .bin (a preset name or a config.json: random weights either way, as
 * an older build's "init: pretrained" of such a run said). */
int fl_rs_has_weights(const char *p) {
    struct stat st;
    const size_t pl = strlen(p);
    return stat(p, &st) == 0 && (S_ISDIR(st.st_mode) || (pl > 4 && !strcmp(p + pl - 4, ".bin")));
}

static void check_init(const fl_run_config *cfg, const fl_cfg_entries *ck, char *why, char *fix, size_t wn) {
    const char *v = fl_cfg_entries_value(ck, "init");
    if (cfg->command != FL_CMD_FINETUNE_LORA || !v) return;
    const int has_weights = fl_rs_has_weights(cfg->checkpoint_dir);
    const int was_random = !strcmp(v, "random");
    if (was_random == cfg->init_random || !has_weights) return; /* !has_weights: random here too, whatever --init */
    say(why, wn, "%sthe checkpoint's adapters were trained over %s base weights (init %s), this run would train them "
        "over %s ones%s (the adapters go on over their own base only)", why[0] ? "; " : "",
        was_random ? "random" : "pretrained", v, was_random ? "the pretrained" : "random",
        was_random ? " read from checkpoint_dir" : " (--init random)");
    say(fix, wn, "%s--init %s", fix[0] ? " " : "", was_random ? "random" : "pretrained");
}

static fl_status check_resume(const char *dir, const fl_run_config *cfg, const rs_model *rm, char *notes, size_t n) {
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
    if (s == FL_OK) s = check_model(dir, cfg, rm, &ck, why, fix, wn, notes, n);
    if (s == FL_OK) check_keys(cfg, rm->bc != NULL, &ck, tmp, why, fix, wn, notes, n);
    if (s == FL_OK && !rm->bc) check_init(cfg, &ck, why, fix, wn);
    if (s == FL_OK) check_targets(dir, cfg, rm->bc ? &rm->bc->text : rm->mc, rm->bc != NULL, &ck, tmp, why, fix, wn);
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

fl_status fl_ckpt_check_resume(const char *dir, const fl_run_config *cfg, const fl_model_config *mc, char *notes,
                               size_t n) {
    const rs_model rm = {mc, NULL};
    return check_resume(dir, cfg, &rm, notes, n);
}

fl_status fl_ckpt_check_resume_blip2(const char *dir, const fl_run_config *cfg, const fl_blip2_config *bc, char *notes,
                                     size_t n) {
    const rs_model rm = {NULL, bc};
    return check_resume(dir, cfg, &rm, notes, n);
}
