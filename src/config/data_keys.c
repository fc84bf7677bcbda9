/* Which data class takes which data.* option. LitGPT's data modules are classes whose init_args jsonargparse
 * checks: an option the class does not have is refused, never ignored. fitllm took every data.* option whatever the
 * class and read only the class's own, so `--data Alpaca --data.lengths T` trained on Alpaca without a word about the
 * table. One row per option, the classes that read it as a bit set: the merged options are checked against the class
 * they chose (fl_cfg_data_check, from fl_cfg_apply_entries), and hyperparameters.yaml writes a class's own options
 * only (fl_cfg_data_key_applies), so that it reads back. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config-impl.h"

#define SYN (1u << FL_DATA_SYNTHETIC)
#define ALP (1u << FL_DATA_ALPACA)
#define JSN (1u << FL_DATA_JSON)
#define TXT (1u << FL_DATA_TEXTFILES)
#define ALL (SYN | ALP | JSN | TXT)

static const struct {
    const char *key;
    unsigned classes;
} k_data_keys[] = {
    {"json_path", ALP | JSN}, /* fitllm's Alpaca reads its file from here too (download_dir / file_name) */
    {"download_dir", ALP},
    {"file_name", ALP},
    {"train_data_path", TXT},
    {"val_data_path", TXT},
    {"prompt_style", SYN | ALP | JSN}, /* the instruction records' template (Synthetic's records are ones too) */
    {"mask_prompt", SYN | ALP | JSN},
    {"ignore_index", SYN | ALP | JSN},
    {"val_split_fraction", ALP | JSN | TXT}, /* TextFiles: with one train file (fitllm's) */
    {"n_train", SYN},
    {"n_val", SYN},
    {"lengths", SYN},
    {"seed", ALL},
    {"num_workers", ALL},
    {"cache_dir", ALL},
    /* an encoder-decoder's limits: the planner sizes with them whatever the class (`fitllm plan t5-small` has none),
     * and training an encoder-decoder refuses every class but JSON */
    {"max_source_length", ALL},
    {"max_target_length", ALL},
};
#define N_DATA_KEYS (sizeof k_data_keys / sizeof k_data_keys[0])

unsigned fl_cfg_data_key_classes(const char *field) {
    for (size_t i = 0; i < N_DATA_KEYS; i++)
        if (!strcmp(k_data_keys[i].key, field)) return k_data_keys[i].classes;
    return 0;
}

int fl_cfg_data_key_applies(fl_data_kind kind, const char *key) {
    if (strncmp(key, "data.", 5)) return 1;
    if (!strcmp(key, "data.class_path")) return 1;
    const unsigned c = fl_cfg_data_key_classes(key + 5);
    return !c || (c >> kind & 1u); /* an option without a row is not a class's to refuse */
}

/* "Alpaca, JSON" */
static void class_list(unsigned classes, char *buf, size_t n) {
    size_t o = 0;
    buf[0] = '\0';
    for (int k = 0; k < FL_DATA_KIND_COUNT && o < n; k++)
        if (classes >> k & 1u) o += (size_t)snprintf(buf + o, n - o, "%s%s", o ? ", " : "", fl_data_kind_name((fl_data_kind)k));
}

/* "json_path, download_dir, ..." */
static void key_list(fl_data_kind kind, char *buf, size_t n) {
    size_t o = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < N_DATA_KEYS && o < n; i++)
        if (k_data_keys[i].classes >> kind & 1u) o += (size_t)snprintf(buf + o, n - o, "%s%s", o ? ", " : "", k_data_keys[i].key);
}

/* 1 when a recipe's option of another class holds the value the chosen class's defaults give it (`json_path: null`,
 * `prompt_style: alpaca` under TextFiles): it changes nothing. hyperparameters.yaml of fitllm before this check wrote
 * every data.* option whatever the class, with these values; `--config` of such a file must keep working (README:
 * "--config it to run the same configuration again"), while a value that would be ignored is still refused. */
static int recipe_default(const fl_run_config *c, const fl_cfg_entry *e) {
    if (e->from_cli) return 0; /* typed: refused whatever its value */
    fl_run_config *d = malloc(sizeof *d);
    if (!d) return 0;
    fl_cfg_defaults(d, c->command);
    /* the value as written against the default as hyperparameters.yaml writes it (a pseudo-option such as download_dir,
     * which sets json_path, has no value of its own there: "null", never equal to a path given) */
    char want[512];
    const int is_null = !*e->value || !strcmp(e->value, "null") || !strcmp(e->value, "~");
    const int same = fl_cfg_set(d, "data", fl_data_kind_name(c->data.kind)) == FL_OK &&
                     fl_cfg_value_text(d, e->key, want, sizeof want) == FL_OK &&
                     (!strcmp(e->value, want) || (is_null && !strcmp(want, "null")));
    free(d);
    fl_error_clear();
    return same;
}

fl_status fl_cfg_data_check(const fl_run_config *c, const fl_cfg_entries *l, int *failed) {
    const char *given = NULL; /* the class as written (Alpaca2k), when one was */
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->e[i].key, "data")) given = l->e[i].value;
    if (given && strrchr(given, '.')) given = strrchr(given, '.') + 1;
    for (int i = 0; i < l->n; i++) {
        const fl_cfg_entry *e = &l->e[i];
        if (fl_cfg_data_key_applies(c->data.kind, e->key) || recipe_default(c, e)) continue;
        char own[160], takes[320], cls[96];
        class_list(fl_cfg_data_key_classes(e->key + 5), own, sizeof own);
        key_list(c->data.kind, takes, sizeof takes);
        if (given) snprintf(cls, sizeof cls, "%s", given);
        else snprintf(cls, sizeof cls, "%s (%s's default)", fl_data_kind_name(c->data.kind), fl_cfg_command_name(c->command));
        if (failed) *failed = i;
        fl_status s = fl_errorf(FL_ERR_INVALID, "option '%s' is not an option of data class %s, which takes %s; %s is "
                                "an option of %s: choose the class with --data (data: class_path: in a recipe)",
                                e->key, cls, takes, e->key, own);
        return e->from_cli ? s : fl_error_prefix(s, "%s", e->source);
    }
    return FL_OK;
}
