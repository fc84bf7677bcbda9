/* The run configuration as text: hyperparameters.yaml (fl_cfg_write_yaml), --help (fl_cfg_print_help) and one
 * key's value as the dump writes it (fl_cfg_value_text), all from run_config.c's key table. */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "config-impl.h"

/* A string as a YAML scalar that every reader (libyaml here, PyYAML's YAML 1.1
 * resolver) takes back as the same string: plain when it cannot be mistaken for a
 * number, boolean or null and holds no indicator, double-quoted otherwise. */
static void yaml_str(const char *s, char *buf, size_t n) {
    static const char *special[] = {"null", "~", "true", "false", "yes", "no", "on", "off", "y", "n", "none"};
    int plain = isalpha((unsigned char)s[0]) || s[0] == '_' || s[0] == '/' || !strncmp(s, "./", 2) ||
                !strncmp(s, "../", 3);
    for (const char *p = s; plain && *p; p++) plain = isalnum((unsigned char)*p) || strchr("_./+-", *p) != NULL;
    for (size_t i = 0; plain && i < sizeof special / sizeof special[0]; i++)
        if (!strcasecmp(s, special[i])) plain = 0;
    if (plain) { snprintf(buf, n, "%s", s); return; }
    size_t o = 0;
    if (n < 8) { if (n) buf[0] = 0; return; }
    buf[o++] = '"';
    for (const unsigned char *p = (const unsigned char *)s; *p && o + 6 < n; p++) {
        if (*p == '"' || *p == '\\') { buf[o++] = '\\'; buf[o++] = (char)*p; }
        else if (*p < 0x20 || *p == 0x7f) o += (size_t)snprintf(buf + o, n - o, "\\x%02x", *p);
        else buf[o++] = (char)*p;
    }
    buf[o++] = '"';
    buf[o] = 0;
}

/* The shortest decimal that reads back as the same float (%g's 6 digits would
 * change some values), written so that a YAML 1.1 reader sees a float: with a '.'
 * and, before an exponent, a '.' too (PyYAML reads "1e-05" as a string). */
static void float_str(float v, char *buf, size_t n) {
    char t[48];
    for (int prec = 6; prec <= 9; prec++) {
        snprintf(t, sizeof t, "%.*g", prec, (double)v);
        if (strtof(t, NULL) == v) break;
    }
    char *e = strchr(t, 'e');
    if (!strchr(t, '.') && e) snprintf(buf, n, "%.*s.0%s", (int)(e - t), t, e);
    else if (!strchr(t, '.')) snprintf(buf, n, "%s.0", t);
    else snprintf(buf, n, "%s", t);
}

static void value_str(const fl_run_config *c, const fl_cfg_key *k, char *buf, size_t n) {
    const char *base = (const char *)c;
    switch (k->type) {
    case FL_CK_PATH: case FL_CK_STR32: case FL_CK_STR64: case FL_CK_PRECISION: case FL_CK_RESUME: case FL_CK_LOGGER:
    case FL_CK_MODEL_CONFIG: {
        const char *s = base + k->off;
        if (k->type == FL_CK_RESUME && (!strcmp(s, "true") || !strcmp(s, "false"))) snprintf(buf, n, "%s", s); /* bool */
        else if (*s) yaml_str(s, buf, n);
        else snprintf(buf, n, "null");
        break;
    }
    case FL_CK_PATH256: { /* a module list: "q_proj,v_proj" -> [q_proj, v_proj] */
        const char *s = base + k->off;
        if (!*s) { snprintf(buf, n, "null"); break; }
        if (!strchr(s, ',')) { yaml_str(s, buf, n); break; }
        size_t o = (size_t)snprintf(buf, n, "[");
        char item[256];
        for (const char *p = s; *p && o < n;) {
            size_t l = strcspn(p, ",");
            char one[256];
            snprintf(one, sizeof one, "%.*s", (int)l, p);
            yaml_str(one, item, sizeof item);
            o += (size_t)snprintf(buf + o, n - o, "%s%s", p == s ? "" : ", ", item);
            p += l + (p[l] == ',');
        }
        if (o < n) snprintf(buf + o, n - o, "]");
        break;
    }
    case FL_CK_INT: case FL_CK_POS: case FL_CK_SINT: case FL_CK_DEVICES:
        snprintf(buf, n, "%d", *(const int *)(base + k->off));
        break;
    case FL_CK_INT_OPT: case FL_CK_BOOL_OPT: {
        int v = *(const int *)(base + k->off);
        if (v < 0) snprintf(buf, n, "null");
        else if (k->type == FL_CK_BOOL_OPT) snprintf(buf, n, "%s", v ? "true" : "false");
        else snprintf(buf, n, "%d", v);
        break;
    }
    case FL_CK_INT_OPT0: {
        int v = *(const int *)(base + k->off);
        if (v <= 0) snprintf(buf, n, "null"); else snprintf(buf, n, "%d", v);
        break;
    }
    case FL_CK_LL_OPT: {
        long long v = *(const long long *)(base + k->off);
        if (v < 0) snprintf(buf, n, "null"); else snprintf(buf, n, "%lld", v);
        break;
    }
    case FL_CK_U64: snprintf(buf, n, "%llu", (unsigned long long)*(const uint64_t *)(base + k->off)); break;
    case FL_CK_FLOAT: float_str(*(const float *)(base + k->off), buf, n); break;
    case FL_CK_FLOAT_OPT: case FL_CK_FLOAT_OPT0: {
        float v = *(const float *)(base + k->off);
        if (v < 0 || (k->type == FL_CK_FLOAT_OPT0 && v == 0)) snprintf(buf, n, "null"); else float_str(v, buf, n);
        break;
    }
    case FL_CK_BOOL: snprintf(buf, n, "%s", *(const int *)(base + k->off) ? "true" : "false"); break;
    case FL_CK_BYTES: { /* bytes, exactly, with their unit (fl_parse_bytes refuses a bare number) */
        size_t v = *(const size_t *)(base + k->off);
        if (v) snprintf(buf, n, "%zuB", v); else snprintf(buf, n, "null");
        break;
    }
    case FL_CK_DATA: snprintf(buf, n, "%s", fl_data_kind_name(c->data.kind)); break;
    case FL_CK_OPTIMIZER: snprintf(buf, n, "%s", fl_optim_name(c->optimizer.kind)); break;
    case FL_CK_STATE_DTYPE: snprintf(buf, n, "%s", c->optimizer.state_dtype == FL_BF16 ? "bfloat16" : "float32"); break;
    case FL_CK_INIT: snprintf(buf, n, "%s", c->init_random ? "random" : "pretrained"); break;
    case FL_CK_BETAS: {
        char b1[48], b2[48];
        float_str(c->optimizer.beta1, b1, sizeof b1);
        float_str(c->optimizer.beta2, b2, sizeof b2);
        snprintf(buf, n, "[%s, %s]", b1, b2);
        break;
    }
    default: snprintf(buf, n, "null"); break;
    }
}

static int dumped(const fl_cfg_key *k) {
    /* skip aliases and LitGPT-compat keys that hold no state of their own */
    return k->type != FL_CK_IGNORED && k->type != FL_CK_DOWNLOAD_DIR && k->type != FL_CK_FILE_NAME &&
           strcmp(k->name, "data.class_path") && strcmp(k->name, "optimizer.class_path") &&
           strncmp(k->name, "train.learning_rate", 19) && strcmp(k->name, "train.weight_decay") &&
           strcmp(k->name, "train.beta1") && strcmp(k->name, "train.beta2") &&
           strcmp(k->name, "initial_checkpoint_dir") && strcmp(k->name, "model") &&
           /* permission for this invocation, not a setting of the run: rerunning the file
            * must not silently replace the run it came from */
           strcmp(k->name, "overwrite");
}

/* model_config as LitGPT writes it: one mapping, nested fields (hf_config.name)
 * as flow mappings so that each key appears once. */
static void write_model_fields(const fl_run_config *c, FILE *f) {
    char v[160];
    fprintf(f, "model_config:\n");
    for (int i = 0; i < c->n_model_fields; i++) {
        const char *key = c->model_fields[i].key, *dot = strchr(key, '.');
        if (!dot) {
            const char *val = c->model_fields[i].value;
            if (fl_cfg_model_field_is_str(key) && !fl_cfg_is_null(val)) yaml_str(val, v, sizeof v);
            else snprintf(v, sizeof v, "%s", fl_cfg_is_null(val) ? "null" : val);
            fprintf(f, "  %s: %s\n", key, v);
            continue;
        }
        size_t pl = (size_t)(dot - key);
        int first = 1;
        for (int j = 0; j < i; j++) /* this group was written with its first field */
            if (!strncmp(c->model_fields[j].key, key, pl + 1)) first = 0;
        if (!first) continue;
        fprintf(f, "  %.*s: {", (int)pl, key);
        int n = 0;
        for (int j = i; j < c->n_model_fields; j++)
            if (!strncmp(c->model_fields[j].key, key, pl + 1)) {
                const char *val = c->model_fields[j].value;
                if (fl_cfg_model_field_is_str(c->model_fields[j].key) && !fl_cfg_is_null(val)) yaml_str(val, v, sizeof v);
                else snprintf(v, sizeof v, "%s", fl_cfg_is_null(val) ? "null" : val);
                fprintf(f, "%s%s: %s", n++ ? ", " : "", c->model_fields[j].key + pl + 1, v);
            }
        fprintf(f, "}\n");
    }
}

/* Each top-level group (train, eval, data, optimizer) is ONE mapping holding all
 * its keys, as LitGPT writes hyperparameters.yaml; data and optimizer in
 * jsonargparse's class_path / init_args form. */
void fl_cfg_write_yaml(const fl_run_config *c, FILE *f) {
    size_t n_keys;
    const fl_cfg_key *keys = fl_cfg_keys(&n_keys);
    char v[FL_CFG_PATH * 2 + 16];
    fprintf(f, "# fitllm %s: effective configuration (fitllm %s --config this-file reproduces the run)\n",
            fl_cfg_command_name(c->command), fl_cfg_command_name(c->command));
    for (size_t i = 0; i < n_keys; i++) {
        const fl_cfg_key *k = &keys[i];
        if (!dumped(k) || !fl_cfg_key_applies(k, c->command)) continue;
        if (strchr(k->name, '.')) continue; /* written with its group */
        if (!strcmp(k->name, "tensor_parallel") && c->tensor_parallel == 1) continue; /* only when given */
        if (!strncmp(k->name, "pipeline_", 9) && c->pipeline_parallel == 1) continue;
        if (!strcmp(k->name, "pipeline_chunks") && strcmp(c->pipeline_schedule, "interleaved")) continue;
        if (!strcmp(k->name, "sequence_parallel") && !c->sequence_parallel) continue; /* only when given */
        if (k->type == FL_CK_MODEL_CONFIG && c->n_model_fields) {
            write_model_fields(c, f);
            continue;
        }
        value_str(c, k, v, sizeof v);
        int args = !strcmp(k->name, "data") || !strcmp(k->name, "optimizer");
        if (args) fprintf(f, "%s:\n  class_path: %s\n  init_args:\n", k->name, v);
        else fprintf(f, "%s: %s\n", k->name, v);
        if (args) {
            size_t pl = strlen(k->name);
            for (size_t j = 0; j < n_keys; j++)
                if (dumped(&keys[j]) && !strncmp(keys[j].name, k->name, pl) && keys[j].name[pl] == '.' &&
                    fl_cfg_data_key_applies(c->data.kind, keys[j].name)) { /* a class's own options only */
                    value_str(c, &keys[j], v, sizeof v);
                    fprintf(f, "    %s: %s\n", keys[j].name + pl + 1, v);
                }
        }
    }
    /* groups without a head key */
    static const char *groups[] = {"train", "eval", "fsdp", "blip2"};
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
        size_t pl = strlen(groups[g]);
        if (!strcmp(groups[g], "fsdp") && !c->sharding_strategy[0] && !strcmp(c->state_dict_type, "full"))
            continue; /* only when given */
        if (!strcmp(groups[g], "blip2") && !c->blip2_train[0]) continue; /* only when given (BLIP-2 runs) */
        fprintf(f, "%s:\n", groups[g]);
        for (size_t j = 0; j < n_keys; j++)
            if (dumped(&keys[j]) && !strncmp(keys[j].name, groups[g], pl) && keys[j].name[pl] == '.') {
                value_str(c, &keys[j], v, sizeof v);
                fprintf(f, "  %s: %s\n", keys[j].name + pl + 1, v);
            }
    }
}

void fl_cfg_print_help(fl_cmd_kind cmd, FILE *f) {
    size_t n_keys;
    const fl_cfg_key *keys = fl_cfg_keys(&n_keys);
    fl_run_config c;
    fl_cfg_defaults(&c, cmd);
    char v[64];
    for (size_t i = 0; i < n_keys; i++) {
        const fl_cfg_key *k = &keys[i];
        if (!fl_cfg_key_applies(k, cmd) || !strncmp(k->name, "log.", 4)) continue; /* log: one line is enough */
        value_str(&c, k, v, sizeof v);
        if (k->type == FL_CK_IGNORED) snprintf(v, sizeof v, "(ignored)");
        fprintf(f, "  --%-30s %-14s %s\n", k->name, v, k->help);
    }
}

fl_status fl_cfg_value_text(const fl_run_config *c, const char *key_in, char *buf, size_t n) {
    char key[256];
    fl_cfg_canonical_key(key_in, key, sizeof key);
    const fl_cfg_key *k = fl_cfg_find_key(key);
    if (!k || k->type == FL_CK_IGNORED) return fl_errorf(FL_ERR_INVALID, "unknown option '%s'", key_in);
    value_str(c, k, buf, n);
    return FL_OK;
}
