/* Merging a recipe with the command line: options are collected as (key, value,
 * source) entries, later ones replacing earlier ones, and only the merged list is
 * applied and validated. This is what lets `--data TextFiles` rescue a LitGPT
 * recipe whose `data: TinyStories` fitllm does not have: the unsupported value is
 * replaced before anything looks at it (jsonargparse merges the same way). */
#include <stdlib.h>
#include <string.h>

#include "config-impl.h"

#define FL_CFG_MAX_ENTRIES 4096

void fl_cfg_entries_init(fl_cfg_entries *l) { memset(l, 0, sizeof *l); }

static void entry_free(fl_cfg_entry *e) {
    free(e->key);
    free(e->name);
    free(e->value);
    free(e->source);
}

void fl_cfg_entries_free(fl_cfg_entries *l) {
    for (int i = 0; i < l->n; i++) entry_free(&l->e[i]);
    free(l->e);
    memset(l, 0, sizeof *l);
}

static char *dup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

static void drop(fl_cfg_entries *l, int i) {
    entry_free(&l->e[i]);
    memmove(&l->e[i], &l->e[i + 1], (size_t)(l->n - i - 1) * sizeof *l->e);
    l->n--;
}

/* "litgpt.data.Alpaca2k" and "Alpaca2k" name the same class. */
static const char *class_name(const char *v) {
    const char *dot = strrchr(v, '.');
    return dot ? dot + 1 : v;
}

/* "r.yaml:4" and "r.yaml:9": one file; "command line" */
static int same_origin(const char *a, const char *b) {
    const char *ca = strrchr(a, ':'), *cb = strrchr(b, ':');
    size_t na = ca ? (size_t)(ca - a) : strlen(a), nb = cb ? (size_t)(cb - b) : strlen(b);
    return na == nb && !strncmp(a, b, na);
}

/* "0.001" and "1e-3": one number */
static int same_value(const char *a, const char *b) {
    char *ea, *eb;
    const double x = strtod(a, &ea), y = strtod(b, &eb);
    if (ea != a && !*ea && eb != b && !*eb) return x == y;
    return !strcmp(a, b);
}

fl_status fl_cfg_entries_add(fl_cfg_entries *l, const char *name, const char *value, const char *source, int from_cli) {
    char key[256];
    fl_cfg_canonical_key(name, key, sizeof key);
    /* A command-line value for a group replaces the recipe's group: another data
     * class does not take the old class's init_args, and `--model_config X` (a
     * config.json or null) replaces a recipe's model_config mapping. */
    int is_group = !strcmp(key, "data") || !strcmp(key, "model_config");
    if (from_cli && is_group) {
        const char *old = NULL;
        for (int i = 0; i < l->n; i++)
            if (!strcmp(l->e[i].key, key)) old = l->e[i].value;
        int replace = !strcmp(key, "model_config") || !old || strcmp(class_name(old), class_name(value));
        size_t kn = strlen(key);
        for (int i = l->n - 1; replace && i >= 0; i--)
            if (!l->e[i].from_cli && !strncmp(l->e[i].key, key, kn) && l->e[i].key[kn] == '.') drop(l, i);
    }
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->e[i].key, key)) {
            /* two names of one setting (an older LitGPT recipe's train.learning_rate beside optimizer.lr) given with
             * other values by the same origin: one silently won; a command line over a recipe overrides, as always
             * (the model's names, checkpoint_dir / initial_checkpoint_dir, have their own command check) */
            const fl_cfg_entry *o = &l->e[i];
            if (o->from_cli == from_cli && same_origin(o->source, source) && strcmp(o->name, name) &&
                !same_value(o->value, value) && (!strncmp(key, "optimizer.", 10) || !strncmp(key, "train.", 6)))
                return fl_errorf(FL_ERR_INVALID, "%s: %s %s and %s %s name the same setting: give one", source,
                                 o->name, o->value, name, value);
            drop(l, i--);
        }
    /* LitGPT's recipes have ~50 leaves; a document with thousands is not a recipe (and
     * the replace-by-key scan above is quadratic) */
    if (l->n >= FL_CFG_MAX_ENTRIES)
        return fl_errorf(FL_ERR_INVALID, "%s: more than %d options; not a recipe", source, FL_CFG_MAX_ENTRIES);
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 32;
        fl_cfg_entry *e = realloc(l->e, (size_t)cap * sizeof *e);
        if (!e) return fl_errorf(FL_ERR_OOM, "out of host memory");
        l->e = e, l->cap = cap;
    }
    fl_cfg_entry *e = &l->e[l->n];
    e->key = dup(key), e->name = dup(name), e->value = dup(value), e->source = dup(source);
    e->from_cli = from_cli;
    if (!e->key || !e->name || !e->value || !e->source) {
        entry_free(e);
        return fl_errorf(FL_ERR_OOM, "out of host memory");
    }
    l->n++;
    return FL_OK;
}

/* Class keys first: a data or optimizer class resets its group to the class's
 * defaults, so its fields must come after it whatever the order they were written
 * in; `model_config: null` likewise before any model_config field. */
static int is_head(const char *key) {
    return !strcmp(key, "data") || !strcmp(key, "optimizer") || !strcmp(key, "model_config");
}

fl_status fl_cfg_apply_entries(fl_run_config *c, const fl_cfg_entries *l, int *failed) {
    if (failed) *failed = -1;
    fl_errlist fields = {0}; /* pretrain's model_config.* fields: every bad one named at once */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < l->n; i++) {
            const fl_cfg_entry *e = &l->e[i];
            if (is_head(e->key) != (pass == 0)) continue;
            fl_status s = fl_cfg_set(c, e->name, e->value);
            if (s == FL_OK) continue;
            if (failed && *failed < 0) *failed = i;
            if (c->command == FL_CMD_PRETRAIN && !strncmp(e->key, "model_config.", 13)) {
                fl_errlist_add(&fields, s, "%s%s%s", e->from_cli ? "" : e->source, e->from_cli ? "" : ": ",
                               fl_error_message());
                continue;
            }
            if (fields.n) return fl_errlist_fail(&fields);
            return e->from_cli ? s : fl_error_prefix(s, "%s", e->source);
        }
    FL_TRY(fl_errlist_fail(&fields));
    return fl_cfg_data_check(c, l, failed); /* each data.* option one of the chosen class's */
}

const char *fl_cfg_entries_value(const fl_cfg_entries *l, const char *name) {
    char key[256];
    fl_cfg_canonical_key(name, key, sizeof key);
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->e[i].key, key)) return l->e[i].value;
    return NULL;
}
