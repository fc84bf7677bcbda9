/* PEFT LoRA adapter folders: adapter_config.json + adapter_model.safetensors (fitllm/peft.h). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/text.h"
#include "fitllm/io.h"
#include "fitllm/json.h"
#include "fitllm/peft.h"
#include "core/fs.h"

#define PEFT_PREFIX "base_model.model."

/* Append a JSON string literal (escaped) to buf at *k. */
static void json_str(char *buf, size_t n, size_t *k, const char *s) {
    *k += snprintf(buf + *k, *k < n ? n - *k : 0, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') *k += snprintf(buf + *k, *k < n ? n - *k : 0, "\\%c", c);
        else if (c < 0x20) *k += snprintf(buf + *k, *k < n ? n - *k : 0, "\\u%04x", c);
        else *k += snprintf(buf + *k, *k < n ? n - *k : 0, "%c", c);
    }
    *k += snprintf(buf + *k, *k < n ? n - *k : 0, "\"");
}

fl_status fl_peft_save(const char *dir, const fl_peft_config *cfg, const fl_peft_module *mods, int n) {
    if (!dir || !cfg || (n > 0 && !mods)) return fl_errorf(FL_ERR_INVALID, "fl_peft_save: NULL argument");
    const int r = cfg->lora.r;
    if (r <= 0) return fl_errorf(FL_ERR_INVALID, "%s: lora r must be > 0 (got %d)", dir, r);
    if (!(cfg->lora.alpha > 0.0f))
        return fl_errorf(FL_ERR_INVALID, "%s: lora_alpha must be > 0 (got %g)", dir, (double)cfg->lora.alpha);
    if (n <= 0) return fl_errorf(FL_ERR_INVALID, "%s: no adapted modules to save", dir);
    if (!fl_fs_is_dir(dir) && mkdir(dir, 0755) != 0)
        return fl_errorf(FL_ERR_IO, "%s: cannot create folder: %s", dir, strerror(errno));
    /* ---- adapter_model.safetensors ---- */
    fl_st_write_tensor *t = calloc((size_t)3 * n, sizeof *t);
    char (*names)[FL_PARAM_NAME_MAX + 64] = calloc((size_t)3 * n, sizeof *names);
    int nt = 0;
    if (!t || !names) {
        free(t);
        free(names);
        return fl_errorf(FL_ERR_OOM, "%s: adapter tensor list", dir);
    }
    fl_status st = FL_OK;
    for (int j = 0; j < n && st == FL_OK; j++) {
        if (mods[j].in <= 0 || mods[j].out <= 0 || !mods[j].A || !mods[j].B) {
            st = fl_errorf(FL_ERR_INVALID, "%s: module '%s' has bad sizes or no data", dir, mods[j].name);
            break;
        }
        for (int ab = 0; ab < 3; ab++) { /* lora_A, lora_B, base_layer (if given) */
            if (ab == 2 && !mods[j].W) continue;
            fl_st_write_tensor *e = &t[nt];
            if (ab == 2) snprintf(names[nt], sizeof names[0], PEFT_PREFIX "%s.base_layer.weight", mods[j].name);
            else snprintf(names[nt], sizeof names[0], PEFT_PREFIX "%s.lora_%c.weight", mods[j].name, ab ? 'B' : 'A');
            e->name = names[nt];
            e->dtype = FL_F32;
            e->src_dtype = FL_F32;
            e->ndim = 2;
            e->shape[0] = ab ? mods[j].out : r;
            e->shape[1] = ab == 1 ? r : mods[j].in;
            e->data = ab == 2 ? mods[j].W : ab ? mods[j].B : mods[j].A;
            nt++;
        }
    }
    char path[4096];
    if (st == FL_OK) st = fl_fs_join(path, sizeof path, dir, "adapter_model.safetensors");
    const char *mk[] = {"format"}, *mv[] = {"pt"};
    if (st == FL_OK) st = fl_st_write(path, t, nt, mk, mv, 1);
    free(t);
    free(names);
    FL_TRY(st);
    /* ---- adapter_config.json ---- */
    size_t cap = 8192 + strlen(cfg->base_model) * 6, k = 0;
    char *js = malloc(cap);
    if (!js) return fl_errorf(FL_ERR_OOM, "%s: adapter_config.json", dir);
    char alpha_s[32], dropout_s[32]; /* 0.05 as 0.05 (PEFT's own file), not 0.0500000007 */
    fl_text_float(cfg->lora.alpha, alpha_s, sizeof alpha_s);
    fl_text_float(cfg->lora.dropout, dropout_s, sizeof dropout_s);
    k += snprintf(js + k, cap - k, "{\n  \"base_model_name_or_path\": ");
    if (cfg->base_model[0]) json_str(js, cap, &k, cfg->base_model);
    else k += snprintf(js + k, cap - k, "null");
    k += snprintf(js + k, cap - k,
                  ",\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": %s,\n  \"inference_mode\": %s,\n"
                  "  \"init_lora_weights\": true,\n  \"lora_alpha\": %s,\n  \"lora_dropout\": %s,\n"
                  "  \"modules_to_save\": null,\n  \"peft_type\": \"LORA\",\n  \"r\": %d,\n  \"target_modules\": [",
                  cfg->fan_in_fan_out ? "true" : "false", cfg->inference_mode ? "true" : "false",
                  alpha_s, dropout_s, r);
    for (int i = 0; i < cfg->lora.n_targets; i++) {
        k += snprintf(js + k, cap - k, "%s", i ? ", " : "");
        json_str(js, cap, &k, cfg->lora.targets[i]);
    }
    k += snprintf(js + k, cap - k, "],\n  \"task_type\": \"%s\",\n  \"use_rslora\": %s\n}\n",
                  cfg->seq2seq ? "SEQ_2_SEQ_LM" : "CAUSAL_LM", cfg->lora.use_rslora ? "true" : "false");
    st = k < cap ? fl_fs_join(path, sizeof path, dir, "adapter_config.json")
                 : fl_errorf(FL_ERR_INTERNAL, "%s: adapter_config.json too long", dir);
    if (st == FL_OK) st = fl_fs_write_file_atomic(path, js, k);
    free(js);
    return st;
}

void fl_peft_free(fl_peft_adapter *a) {
    if (!a) return;
    for (int i = 0; i < a->n; i++) {
        free(a->mods[i].A);
        free(a->mods[i].B);
        free(a->mods[i].W);
    }
    free(a->mods);
    memset(a, 0, sizeof *a);
}

/* A boolean key of adapter_config.json: absent or null keeps *out; anything but true / false is refused (a "yes"
 * read as false would merge with another scaling unsaid). */
static fl_status peft_bool(const char *path, const fl_json *j, const char *key, int *out) {
    static const char *const types[] = {"null", "a boolean", "a number", "a string", "a list", "an object"};
    const fl_json *v = fl_json_get(j, key);
    if (!v || v->type == FL_JSON_NULL) return FL_OK;
    if (v->type != FL_JSON_BOOL)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s': must be true or false (got %s)", path, key, types[v->type]);
    *out = v->b;
    return FL_OK;
}

/* adapter_config.json (parsed: j) into c */
static fl_status read_config(const char *path, const fl_json *j, fl_peft_config *c) {
    fl_status st = FL_OK;
    const fl_json *v;
    memset(c, 0, sizeof *c);
#define BAD(...) do { st = fl_errorf(FL_ERR_FORMAT, __VA_ARGS__); goto done; } while (0)
    if (j->type != FL_JSON_OBJECT) BAD("%s: not a JSON object", path);
    v = fl_json_get(j, "peft_type");
    if (!v || v->type != FL_JSON_STRING || strcmp(v->str, "LORA") != 0)
        BAD("%s: key 'peft_type': expected \"LORA\"", path);
    v = fl_json_get(j, "r");
    if (!v || v->type != FL_JSON_NUMBER || !v->is_int) BAD("%s: key 'r': missing or not an integer", path);
    if (v->i <= 0 || v->i > 1 << 20) {
        st = fl_errorf(FL_ERR_INVALID, "%s: key 'r': must be > 0 (got %lld)", path, (long long)v->i);
        goto done;
    }
    c->lora.r = (int)v->i;
    v = fl_json_get(j, "lora_alpha");
    if (!v || v->type != FL_JSON_NUMBER) BAD("%s: key 'lora_alpha': missing or not a number", path);
    if (!(v->num > 0)) {
        st = fl_errorf(FL_ERR_INVALID, "%s: key 'lora_alpha': must be > 0 (got %g)", path, v->num);
        goto done;
    }
    c->lora.alpha = (float)v->num;
    v = fl_json_get(j, "lora_dropout");
    if (v && v->type == FL_JSON_NUMBER) c->lora.dropout = (float)v->num;
    else if (v && v->type != FL_JSON_NULL) BAD("%s: key 'lora_dropout': not a number", path);
    if (!(c->lora.dropout >= 0 && c->lora.dropout < 1)) {
        st = fl_errorf(FL_ERR_INVALID, "%s: key 'lora_dropout': must be in [0, 1)", path);
        goto done;
    }
    int dora = 0, lbias = 0;
    if ((st = peft_bool(path, j, "use_rslora", &c->lora.use_rslora)) != FL_OK ||
        (st = peft_bool(path, j, "fan_in_fan_out", &c->fan_in_fan_out)) != FL_OK ||
        (st = peft_bool(path, j, "inference_mode", &c->inference_mode)) != FL_OK ||
        (st = peft_bool(path, j, "use_dora", &dora)) != FL_OK || (st = peft_bool(path, j, "lora_bias", &lbias)) != FL_OK)
        goto done;
    /* a magnitude vector per module (DoRA) or a bias on B besides A and B: merging A and B alone would be wrong */
    if (dora || lbias) {
        st = fl_errorf(FL_ERR_UNSUPPORTED, "%s: key '%s': true is not supported (plain LoRA adapters only)", path,
                       dora ? "use_dora" : "lora_bias");
        goto done;
    }
    v = fl_json_get(j, "bias");
    if (v && v->type == FL_JSON_STRING && strcmp(v->str, "none") != 0) {
        st = fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'bias': \"%s\" not supported (only \"none\")", path, v->str);
        goto done;
    }
    v = fl_json_get(j, "base_model_name_or_path");
    if (v && v->type == FL_JSON_STRING) snprintf(c->base_model, sizeof c->base_model, "%s", v->str);
    v = fl_json_get(j, "target_modules");
    if (v && v->type == FL_JSON_STRING) { /* PEFT allows a single string (a regex or "all-linear") */
        snprintf(c->lora.targets[0], sizeof c->lora.targets[0], "%s", v->str);
        c->lora.n_targets = 1;
    } else if (v && v->type == FL_JSON_ARRAY) {
        for (const fl_json *e = v->child; e; e = e->next) {
            if (e->type != FL_JSON_STRING) BAD("%s: key 'target_modules': not a list of strings", path);
            if (c->lora.n_targets >= FL_LORA_MAX_TARGETS || strlen(e->str) >= sizeof c->lora.targets[0])
                BAD("%s: key 'target_modules': too many or too long names", path);
            snprintf(c->lora.targets[c->lora.n_targets++], sizeof c->lora.targets[0], "%s", e->str);
        }
    } else {
        BAD("%s: key 'target_modules': missing or not a list", path);
    }
#undef BAD
done:
    return st;
}

/* rank_pattern / alpha_pattern: {pattern: value}, each pattern compiled as PEFT's get_pattern_key matches it */
typedef struct {
    const char *key;
    pcre2_code *re;
    double v;
} peft_pat;
typedef struct {
    peft_pat *p;
    int n;
} peft_pats;

static void pats_free(peft_pats *ps) {
    for (int i = 0; i < ps->n; i++) pcre2_code_free(ps->p[i].re);
    free(ps->p);
    memset(ps, 0, sizeof *ps);
}

/* key (rank_pattern: ints, else alpha_pattern) of adapter_config.json j into *ps (empty when absent, null or {}) */
static fl_status read_pats(const char *path, const fl_json *j, const char *key, int ints, peft_pats *ps) {
    const fl_json *o = fl_json_get(j, key);
    memset(ps, 0, sizeof *ps);
    if (!o || o->type == FL_JSON_NULL) return FL_OK;
    if (o->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s': not an object of module patterns and their %s", path, key,
                         ints ? "ranks" : "alphas");
    ps->p = calloc(o->len + 1, sizeof *ps->p);
    if (!ps->p) return fl_errorf(FL_ERR_OOM, "%s: key '%s'", path, key);
    fl_status st = FL_OK;
    for (const fl_json *e = o->child; e && st == FL_OK; e = e->next) {
        const double v = e->type == FL_JSON_NUMBER ? (e->is_int ? (double)e->i : e->num) : 0;
        if (e->type != FL_JSON_NUMBER || (ints && !e->is_int)) {
            st = fl_errorf(FL_ERR_FORMAT, "%s: key '%s': pattern '%s': the value is not %s", path, key, e->key,
                           ints ? "an integer rank" : "a number");
            break;
        }
        if (!(v > 0) || (ints && v > (double)(1 << 20))) {
            st = fl_errorf(FL_ERR_INVALID, "%s: key '%s': pattern '%s': %s must be > 0 (got %g)", path, key, e->key,
                           ints ? "the rank" : "lora_alpha", v);
            break;
        }
        const size_t kl = strlen(e->key);
        char *rx = malloc(kl + 32);
        if (!rx) { st = fl_errorf(FL_ERR_OOM, "%s: key '%s'", path, key); break; }
        snprintf(rx, kl + 32, "^(?:.*\\.)?(?:%s)$", e->key); /* re.match(rf"(.*\.)?({key})$", name) */
        int err = 0;
        PCRE2_SIZE off = 0;
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)rx, PCRE2_ZERO_TERMINATED, 0, &err, &off, NULL);
        free(rx);
        if (!re) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(err, msg, sizeof msg);
            st = fl_errorf(FL_ERR_INVALID, "%s: key '%s': pattern '%s' is not a regular expression (%s)", path, key,
                           e->key, (const char *)msg);
            break;
        }
        ps->p[ps->n++] = (peft_pat){e->key, re, v};
    }
    if (st != FL_OK) pats_free(ps);
    return st;
}

/* The first pattern of ps matching the module name (PEFT's get_pattern_key), or NULL */
static const peft_pat *pats_find(const peft_pats *ps, const char *name) {
    for (int i = 0; i < ps->n; i++) {
        pcre2_match_data *md = pcre2_match_data_create_from_pattern(ps->p[i].re, NULL);
        const int rc = md ? pcre2_match(ps->p[i].re, (PCRE2_SPTR)name, PCRE2_ZERO_TERMINATED, 0, 0, md, NULL) : -1;
        pcre2_match_data_free(md);
        if (rc >= 0) return &ps->p[i];
    }
    return NULL;
}

int fl_peft_module_r(const fl_peft_adapter *a, const fl_peft_module *m) { return m->r > 0 ? m->r : a->cfg.lora.r; }

float fl_peft_module_scaling(const fl_peft_adapter *a, const fl_peft_module *m) {
    return m->r > 0 ? m->scaling : fl_lora_scaling(&a->cfg.lora);
}

/* A copy of tensor t as n fp32 values (malloc'd into *out). */
static fl_status read_f32(const char *path, const char *nm, const fl_st_tensor *t, size_t n, float **out) {
    float *buf = malloc(n * sizeof(float));
    if (!buf) return fl_errorf(FL_ERR_OOM, "%s: tensor '%s'", path, nm);
    if (fl_convert(buf, FL_F32, t->data, t->dtype, n) != 0) {
        free(buf);
        return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': cannot convert", path, nm);
    }
    *out = buf;
    return FL_OK;
}

static fl_status load_tensors(const char *dir, fl_peft_adapter *a, const peft_pats *rp, const peft_pats *ap);

fl_status fl_peft_load(const char *dir, fl_peft_adapter *a) {
    if (!dir || !a) return fl_errorf(FL_ERR_INVALID, "fl_peft_load: NULL argument");
    memset(a, 0, sizeof *a);
    char path[4096];
    FL_TRY(fl_fs_join(path, sizeof path, dir, "adapter_config.json"));
    if (!fl_fs_is_file(path)) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no adapter_config.json (not a PEFT adapter folder)", dir);
    fl_json *j = NULL;
    peft_pats rp = {0}, ap = {0};
    FL_TRY(fl_json_parse_file(path, &j));
    fl_status st = read_config(path, j, &a->cfg);
    if (st == FL_OK) st = read_pats(path, j, "rank_pattern", 1, &rp);
    if (st == FL_OK) st = read_pats(path, j, "alpha_pattern", 0, &ap);
    if (st == FL_OK) st = load_tensors(dir, a, &rp, &ap);
    pats_free(&rp);
    pats_free(&ap);
    fl_json_free(j); /* after the patterns: their keys are its strings */
    return st;
}

/* fl_peft_load's tensors, each module's r and scaling from the patterns (rank_pattern rp, alpha_pattern ap) */
static fl_status load_tensors(const char *dir, fl_peft_adapter *a, const peft_pats *rp, const peft_pats *ap) {
    char path[4096];
    FL_TRY(fl_fs_join(path, sizeof path, dir, "adapter_model.safetensors"));
    if (!fl_fs_is_file(path)) return fl_errorf(FL_ERR_NOT_FOUND, "%s: no adapter_model.safetensors", dir);
    fl_st_file f;
    FL_TRY(fl_st_open(&f, path));
    fl_status st = FL_OK;
    a->mods = calloc((size_t)f.n_tensors + 1, sizeof *a->mods);
    if (!a->mods) {
        fl_st_close(&f);
        return fl_errorf(FL_ERR_OOM, "%s: adapter modules", path);
    }
    const size_t plen = strlen(PEFT_PREFIX);
    for (int i = 0; i < f.n_tensors && st == FL_OK; i++) {
        const fl_st_tensor *t = &f.tensors[i];
        const char *nm = t->name;
        size_t len = strlen(nm);
        /* kind 0: lora_A, 1: lora_B, 2: base_layer (PEFT's saved embedding layers: lm_head) */
        static const char *const suf[3] = {".lora_A.weight", ".lora_B.weight", ".base_layer.weight"};
        int isB = -1;
        size_t sl = 0;
        for (int k = 0; k < 3 && isB < 0; k++) {
            size_t kl = strlen(suf[k]);
            if (len > plen + kl && strncmp(nm, PEFT_PREFIX, plen) == 0 && strcmp(nm + len - kl, suf[k]) == 0) {
                isB = k;
                sl = kl;
            }
        }
        if (isB < 0) {
            st = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': not a LoRA weight (expected "
                           PEFT_PREFIX "<module>.lora_A.weight / .lora_B.weight / .base_layer.weight)", path, nm);
            break;
        }
        size_t ml = len - plen - sl;
        if (ml >= FL_PARAM_NAME_MAX) {
            st = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': module name too long", path, nm);
            break;
        }
        if (t->ndim != 2 || (t->dtype != FL_F32 && t->dtype != FL_BF16 && t->dtype != FL_F16)) {
            st = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': expected a 2-D F32/BF16/F16 tensor", path, nm);
            break;
        }
        char mod[FL_PARAM_NAME_MAX];
        memcpy(mod, nm + plen, ml);
        mod[ml] = 0;
        int k;
        for (k = 0; k < a->n; k++)
            if (strcmp(a->mods[k].name, mod) == 0) break;
        const peft_pat *pr = pats_find(rp, mod);
        if (k == a->n) { /* a new module: its rank and scaling (rank_pattern, alpha_pattern) */
            const peft_pat *pa = pats_find(ap, mod);
            fl_lora_config lc = a->cfg.lora;
            if (pr) lc.r = (int)pr->v;
            if (pa) lc.alpha = (float)pa->v;
            snprintf(a->mods[a->n].name, FL_PARAM_NAME_MAX, "%s", mod);
            a->mods[a->n].r = lc.r;
            a->mods[a->n++].scaling = fl_lora_scaling(&lc);
        }
        fl_peft_module *m = &a->mods[k];
        const int r = m->r;
        char from[FL_PARAM_NAME_MAX + 40] = ""; /* where the expected r comes from */
        if (pr) snprintf(from, sizeof from, " from rank_pattern '%.*s'", FL_PARAM_NAME_MAX, pr->key);
        int64_t d0 = t->shape[0], d1 = t->shape[1];
        if (isB == 2) {
            if (m->W) {
                st = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': duplicate", path, nm);
                break;
            }
            if (d0 <= 0 || d1 <= 0 || d0 > INT32_MAX || d1 > INT32_MAX) {
                st = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': bad shape (%lld, %lld)", path, nm, (long long)d0,
                               (long long)d1);
                break;
            }
            float *buf = NULL;
            if ((st = read_f32(path, nm, t, (size_t)(d0 * d1), &buf)) != FL_OK) break;
            m->W = buf;
            m->w_out = (int)d0;
            m->w_in = (int)d1;
            continue;
        }
        if (!isB && d0 != r) {
            st = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': shape (%lld, %lld), expected (r=%d%s, in)", path, nm,
                           (long long)d0, (long long)d1, r, from);
            break;
        }
        if (isB && d1 != r) {
            st = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': shape (%lld, %lld), expected (out, r=%d%s)", path, nm,
                           (long long)d0, (long long)d1, r, from);
            break;
        }
        if ((isB ? m->B : m->A) != NULL) {
            st = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s': duplicate", path, nm);
            break;
        }
        float *buf = NULL;
        if ((st = read_f32(path, nm, t, (size_t)(d0 * d1), &buf)) != FL_OK) break;
        if (isB) { m->B = buf; m->out = (int)d0; }
        else { m->A = buf; m->in = (int)d1; }
    }
    for (int k = 0; k < a->n && st == FL_OK; k++) {
        const fl_peft_module *m = &a->mods[k];
        if (!m->A && !m->B)
            st = fl_errorf(FL_ERR_FORMAT, "%s: module '%s' has a base_layer weight but no lora_A / lora_B", path,
                           m->name);
        else if (!m->A || !m->B)
            st = fl_errorf(FL_ERR_FORMAT, "%s: module '%s' has lora_%c but no lora_%c", path, m->name,
                           m->A ? 'A' : 'B', m->A ? 'B' : 'A');
        else if (m->W && (m->w_out != m->out || m->w_in != m->in))
            st = fl_errorf(FL_ERR_FORMAT, "%s: module '%s': base_layer.weight is (%d, %d) but lora_B/lora_A make "
                           "(out %d, in %d)", path, m->name, m->w_out, m->w_in, m->out, m->in);
    }
    if (st == FL_OK && a->n == 0) st = fl_errorf(FL_ERR_FORMAT, "%s: no LoRA tensors", path);
    fl_st_close(&f);
    if (st != FL_OK) fl_peft_free(a);
    return st;
}

fl_status fl_peft_check_model(const fl_peft_adapter *a, const fl_model_config *mc, const fl_param_layout *lay,
                              const char *expect_base, int **param_index) {
    if (param_index) *param_index = NULL;
    if (expect_base && a->cfg.base_model[0] && strcmp(expect_base, a->cfg.base_model) != 0)
        return fl_errorf(FL_ERR_INVALID, "adapter_config.json: base_model_name_or_path '%s' does not match the base model '%s'",
                         a->cfg.base_model, expect_base);
    /* target_modules must be names of this architecture (a single-string regex is not checked) */
    const fl_lora_config *lc = &a->cfg.lora;
    if (!(lc->n_targets == 1 && strpbrk(lc->targets[0], ".*[]()|\\^$") != NULL) &&
        !(lc->n_targets == 1 && strcmp(lc->targets[0], "all-linear") == 0)) {
        fl_status s = fl_lora_config_validate(lc, mc);
        if (s != FL_OK) return fl_error_prefix(s, "adapter_config.json");
    }
    int *idx = malloc((size_t)(a->n > 0 ? a->n : 1) * sizeof(int));
    if (!idx) return fl_errorf(FL_ERR_OOM, "adapter check");
    for (int k = 0; k < a->n; k++) {
        const fl_peft_module *m = &a->mods[k];
        char w[FL_PARAM_NAME_MAX + 8];
        snprintf(w, sizeof w, "%s.weight", m->name);
        int i = fl_layout_find(lay, w);
        if (i < 0 || lay->params[i].ndim != 2) {
            free(idx);
            return fl_errorf(FL_ERR_INVALID,
                             "adapter_model.safetensors: key '" PEFT_PREFIX "%s.lora_A.weight': module '%s' "
                             "is not a linear layer of the base model",
                             m->name, m->name);
        }
        if (lay->params[i].shape[0] != m->out || lay->params[i].shape[1] != m->in) {
            free(idx);
            return fl_errorf(FL_ERR_INVALID,
                             "adapter_model.safetensors: module '%s': adapter is (out %d, in %d) but the base "
                             "weight '%s' is (%lld, %lld)",
                             m->name, m->out, m->in, w, (long long)lay->params[i].shape[0],
                             (long long)lay->params[i].shape[1]);
        }
        idx[k] = i;
    }
    if (param_index) *param_index = idx;
    else free(idx);
    return FL_OK;
}

fl_status fl_peft_merge_into(const fl_peft_adapter *a, const fl_param_layout *lay, float *params) {
    for (int k = 0; k < a->n; k++) {
        const fl_peft_module *m = &a->mods[k];
        char w[FL_PARAM_NAME_MAX + 8];
        snprintf(w, sizeof w, "%s.weight", m->name);
        int i = fl_layout_find(lay, w);
        if (i < 0 || lay->params[i].shape[0] != m->out || lay->params[i].shape[1] != m->in)
            return fl_errorf(FL_ERR_INVALID, "merge: module '%s' does not match the model (run fl_peft_check_model)",
                             m->name);
        if (m->W) /* PEFT loads the saved base layer into the model, then merges */
            memcpy(params + lay->params[i].offset, m->W, (size_t)m->out * m->in * sizeof(float));
        fl_lora_merge(params + lay->params[i].offset, m->in, m->A, m->B, fl_peft_module_r(a, m), m->in, m->out,
                      fl_peft_module_scaling(a, m));
    }
    return FL_OK;
}
