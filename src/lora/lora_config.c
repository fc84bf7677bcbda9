/* LoRA configuration, target modules, adapter layout, PEFT init and merge (fitllm/lora.h). */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/lora.h"

const char *const *fl_lora_valid_targets(fl_arch arch) {
    const fl_arch_info *ai = fl_arch_get(arch);
    return ai ? ai->lora_targets : NULL;
}

float fl_lora_scaling(const fl_lora_config *c) {
    double s = c->use_rslora ? (double)c->alpha / sqrt((double)c->r) : (double)c->alpha / (double)c->r;
    return (float)s;
}

static void list_valid(fl_arch arch, char *buf, size_t n) {
    const char *const *v = fl_lora_valid_targets(arch);
    size_t k = 0;
    buf[0] = 0;
    for (int i = 0; v[i]; i++) k += snprintf(buf + k, k < n ? n - k : 0, "%s%s", i ? ", " : "", v[i]);
    if (k < n) snprintf(buf + k, n - k, ", all-linear");
}

static int is_valid(fl_arch arch, const char *t) {
    const char *const *v = fl_lora_valid_targets(arch);
    for (int i = 0; v[i]; i++)
        if (strcmp(v[i], t) == 0) return 1;
    return 0;
}

fl_status fl_lora_config_validate(const fl_lora_config *c, const fl_model_config *mc) {
    char valid[256];
    if (!c || !mc) return fl_errorf(FL_ERR_INVALID, "lora: NULL config");
    if (c->r <= 0) return fl_errorf(FL_ERR_INVALID, "lora_r must be > 0 (got %d)", c->r);
    if (!(c->alpha > 0.0f)) return fl_errorf(FL_ERR_INVALID, "lora_alpha must be > 0 (got %g)", (double)c->alpha);
    if (!(c->dropout >= 0.0f && c->dropout < 1.0f))
        return fl_errorf(FL_ERR_INVALID, "lora_dropout must be in [0, 1) (got %g)", (double)c->dropout);
    list_valid(mc->arch, valid, sizeof valid);
    if (c->n_targets <= 0) return fl_errorf(FL_ERR_INVALID, "lora target_modules: empty list (valid: %s)", valid);
    for (int i = 0; i < c->n_targets; i++) {
        if (!is_valid(mc->arch, c->targets[i]))
            return fl_errorf(FL_ERR_INVALID, "lora target_modules: unknown module '%s' for %s (valid: %s)",
                             c->targets[i], fl_arch_get(mc->arch)->display, valid);
        if (strcmp(c->targets[i], "lm_head") == 0 && mc->tie_embeddings)
            return fl_errorf(FL_ERR_INVALID,
                             "lora target_modules: lm_head is tied to the input embeddings in this model "
                             "(tie_word_embeddings: true); an adapter on a tied head is not supported (PEFT adapts "
                             "the head alone and merging it rewrites the shared embeddings too, peft issue #2777). "
                             "Untie the model first (a copy with tie_word_embeddings: false and lm_head.weight = "
                             "the embeddings) or drop lm_head / lora_head");
    }
    return FL_OK;
}

static fl_status add_target(fl_lora_config *c, const char *t, size_t len, fl_arch arch) {
    for (int i = 0; i < c->n_targets; i++)
        if (strlen(c->targets[i]) == len && strncmp(c->targets[i], t, len) == 0) return FL_OK; /* duplicate */
    if (c->n_targets >= FL_LORA_MAX_TARGETS || len >= sizeof c->targets[0]) {
        char valid[256];
        list_valid(arch, valid, sizeof valid);
        return fl_errorf(FL_ERR_INVALID, "lora target_modules: unknown module '%.*s' (valid: %s)", (int)len, t, valid);
    }
    memcpy(c->targets[c->n_targets], t, len);
    c->targets[c->n_targets][len] = 0;
    c->n_targets++;
    return FL_OK;
}

fl_status fl_lora_config_init(fl_lora_config *c, const fl_model_config *mc, int r, float alpha, float dropout,
                              int use_rslora, const char *targets) {
    if (!c || !mc) return fl_errorf(FL_ERR_INVALID, "lora: NULL config");
    memset(c, 0, sizeof *c);
    c->r = r;
    c->alpha = alpha;
    c->dropout = dropout;
    c->use_rslora = use_rslora ? 1 : 0;
    const char *s = targets ? targets : "";
    while (*s) {
        while (*s == ',' || isspace((unsigned char)*s)) s++;
        const char *e = s;
        while (*e && *e != ',' && !isspace((unsigned char)*e)) e++;
        if (e > s) {
            if ((size_t)(e - s) == 10 && strncmp(s, "all-linear", 10) == 0) {
                /* the plain names: a dotted one ("attn.c_proj") is a part of a plain one's modules */
                const char *const *v = fl_lora_valid_targets(mc->arch);
                for (int i = 0; v[i]; i++)
                    if (strcmp(v[i], "lm_head") != 0 && !strchr(v[i], '.'))
                        FL_TRY(add_target(c, v[i], strlen(v[i]), mc->arch));
            } else {
                FL_TRY(add_target(c, s, (size_t)(e - s), mc->arch));
            }
        }
        s = e;
    }
    return fl_lora_config_validate(c, mc);
}

/* Whether c adapts the module named name whose table target is t: a config target equal to t, or PEFT's rule
 * (check_target_module_exists): the name is the target or ends with "." + target ("c_proj" is
 * transformer.h.0.attn.c_proj and transformer.h.0.mlp.c_proj, "attn.c_proj" the first alone). */
static int has_target(const fl_lora_config *c, const char *t, const char *name) {
    const size_t nl = strlen(name);
    for (int i = 0; i < c->n_targets; i++) {
        const char *g = c->targets[i];
        const size_t gl = strlen(g);
        if (strcmp(g, t) == 0 || strcmp(g, name) == 0) return 1;
        if (nl > gl && name[nl - gl - 1] == '.' && strcmp(name + nl - gl, g) == 0) return 1;
    }
    return 0;
}

/* The frozen parts of a module of table entry e (fl_lora_module.frozen) */
static unsigned frozen_parts(const fl_lora_config *c, const fl_arch_lora_module *e) {
    return e->parts == 3 && c->qkv_parts ? ~c->qkv_parts & 7u : 0u;
}

fl_status fl_lora_modules(const fl_lora_config *c, const fl_param_layout *lay, const fl_model_config *mc,
                          fl_lora_module **mods, int *n_mods) {
    FL_TRY(fl_lora_config_validate(c, mc));
    *mods = NULL;
    *n_mods = 0;
    fl_arch_lora_module tab[FL_ARCH_MAX_LORA_MODULES];
    const int nt = fl_arch_get(mc->arch)->lora_modules(mc, tab); /* the architecture's block modules */
    const int L = mc->n_layers + mc->n_dec_layers; /* every stack's blocks (an encoder-decoder's decoder's after) */
    int cap = L * nt + 1, n = 0;
    fl_lora_module *m = calloc((size_t)cap, sizeof *m);
    if (!m) return fl_errorf(FL_ERR_OOM, "lora: module list");
    for (int l = 0; l < L; l++)
        for (int t = 0; t < nt; t++) {
            const int stack = l >= mc->n_layers, l_in = stack ? l - mc->n_layers : l;
            if (tab[t].stack != stack) continue;
            fl_lora_module *e = &m[n];
            snprintf(e->name, sizeof e->name, tab[t].fmt, l_in);
            if (!has_target(c, tab[t].target, e->name)) continue;
            e->layer = l;
            e->fused_row0 = tab[t].row0;
            e->fused_rows = tab[t].rows;
            e->parts = tab[t].parts;
            e->frozen = frozen_parts(c, &tab[t]);
            n++;
        }
    if (has_target(c, "lm_head", "lm_head")) {
        fl_lora_module *e = &m[n++];
        snprintf(e->name, sizeof e->name, "lm_head");
        e->layer = -1;
        e->fused_row0 = 0;
        e->fused_rows = mc->vocab_size;
    }
    for (int i = 0; i < n; i++) {
        char w[FL_PARAM_NAME_MAX + 8];
        snprintf(w, sizeof w, "%s.weight", m[i].name);
        int idx = fl_layout_find(lay, w);
        if (idx < 0 || lay->params[idx].ndim != 2) {
            fl_status s = fl_errorf(FL_ERR_INTERNAL, "lora: module '%s' has no 2-D weight in the model layout", m[i].name);
            free(m); /* after the message, which reads the name */
            return s;
        }
        m[i].param_index = idx;
        m[i].out = (int)lay->params[idx].shape[0];
        m[i].in = (int)lay->params[idx].shape[1];
    }
    *mods = m;
    *n_mods = n;
    return FL_OK;
}

size_t fl_lora_trainable(const fl_lora_module *mods, int n_mods, int r) {
    size_t n = 0;
    for (int j = 0; j < n_mods; j++) {
        int rows = mods[j].out;
        for (int p = 0; p < mods[j].parts; p++)
            if (mods[j].frozen >> p & 1u) rows -= mods[j].out / mods[j].parts;
        n += (size_t)r * mods[j].in + (size_t)rows * r;
    }
    return n;
}

fl_status fl_lora_describe(const fl_lora_config *c, const fl_model_config *mc, char *out, size_t n) {
    static const char *const part_names[3] = {"q", "k", "v"};
    if (n) out[0] = 0;
    FL_TRY(fl_lora_config_validate(c, mc));
    fl_arch_lora_module tab[FL_ARCH_MAX_LORA_MODULES];
    const int nt = fl_arch_get(mc->arch)->lora_modules(mc, tab);
    size_t k = 0;
#define SAY(...) (k += (size_t)snprintf(out + k, k < n ? n - k : 0, __VA_ARGS__))
    for (int t = 0; t < nt; t++) {
        char name[FL_PARAM_NAME_MAX], star[FL_PARAM_NAME_MAX];
        const char *d = strstr(tab[t].fmt, "%d");
        snprintf(name, sizeof name, tab[t].fmt, 0);
        if (!d || !has_target(c, tab[t].target, name)) continue;
        snprintf(star, sizeof star, "%.*s*%s", (int)(d - tab[t].fmt), tab[t].fmt, d + 2);
        SAY("%s%s", k ? "," : "", star);
        const unsigned fr = frozen_parts(c, &tab[t]);
        for (int p = 0, first = 1; fr && p < 3; p++)
            if (!(fr >> p & 1u)) SAY("%s%s", first ? "[" : "+", part_names[p]), first = 0;
        if (fr) SAY("]");
    }
    if (has_target(c, "lm_head", "lm_head")) SAY("%slm_head", k ? "," : "");
#undef SAY
    if (k >= n && n) out[n - 1] = 0;
    return FL_OK;
}

void fl_lora_adapter_offsets(const fl_lora_module *mods, int n_mods, int r, size_t *off, size_t *total) {
    size_t o = 0;
    for (int j = 0; j < n_mods; j++) {
        if (off) off[2 * j] = o;
        o += (size_t)r * mods[j].in;
        if (off) off[2 * j + 1] = o;
        o += (size_t)mods[j].out * r;
    }
    if (total) *total = o;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

void fl_lora_init_adapter(float *A, float *B, int r, int in, int out, uint64_t seed) {
    const double bound = 1.0 / sqrt((double)in);
    uint64_t s = seed;
    for (size_t i = 0; i < (size_t)r * in; i++) {
        double u = (double)(splitmix(&s) >> 11) * (1.0 / 9007199254740992.0); /* [0, 1) */
        A[i] = (float)((2.0 * u - 1.0) * bound);
    }
    if (B) memset(B, 0, (size_t)out * r * sizeof(float));
}

void fl_lora_merge(float *W, int ldw, const float *A, const float *B, int r, int in, int out, float scaling) {
#pragma omp parallel for schedule(static)
    for (int o = 0; o < out; o++)
        for (int i = 0; i < in; i++) {
            double s = 0;
            for (int j = 0; j < r; j++) s += (double)B[(size_t)o * r + j] * (double)A[(size_t)j * in + i];
            float d = (float)s * scaling;
            W[(size_t)o * ldw + i] += d;
        }
}

fl_status fl_lora_merge_q4(float *dst, const fl_q4_weight *W, const float *A, const float *B, int r,
                           float scaling) {
    FL_TRY(fl_q4_dequantize(W, dst, 0));
    fl_lora_merge(dst, W->cols, A, B, r, W->cols, W->rows, scaling);
    return FL_OK;
}
