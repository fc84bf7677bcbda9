/* LitGPT's `model_config:` for pretrain: the fields of litgpt.Config (e.g. the
 * tinystories recipe's n_layer: 6, n_embd: 288, ...). As in LitGPT, a field left
 * out takes litgpt.Config's default (a GPT-NeoX shape), not the named model's:
 * `name` is only a label. fitllm builds the LLaMA family from such a config
 * (RMSNorm, LLaMAMLP, full rotary, sequential residual, no biases); a field that
 * asks for something else is an error naming the field and the value we need. */
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "config-impl.h"
#include "fitllm/io.h"

typedef enum { MF_STR, MF_INT, MF_FLOAT, MF_BOOL, MF_LIST, MF_MAP } mf_type;

typedef struct {
    const char *name;
    mf_type type;
    const char *def;  /* litgpt.Config's default (NULL: None) */
    const char *need; /* the only value fitllm builds (NULL: any, or handled below) */
} mfield;

/* litgpt/config.py, class Config (field order kept). */
static const mfield k_fields[] = {
    {"name", MF_STR, "", NULL},
    {"hf_config.name", MF_STR, NULL, NULL},
    {"hf_config.org", MF_STR, NULL, NULL},
    {"block_size", MF_INT, "4096", NULL},
    {"n_layer", MF_INT, "16", NULL},
    {"n_embd", MF_INT, "4096", NULL},
    {"vocab_size", MF_INT, "50254", NULL},
    {"padding_multiple", MF_INT, "512", NULL},
    {"padded_vocab_size", MF_INT, NULL, NULL},
    {"norm_class_name", MF_STR, "LayerNorm", "RMSNorm"},
    {"norm_eps", MF_FLOAT, "1e-5", NULL},
    {"norm_qk", MF_BOOL, "false", "false"},
    {"norm_qk_type", MF_STR, "default", NULL},
    {"post_attention_norm", MF_BOOL, "false", "false"},
    {"post_mlp_norm", MF_BOOL, "false", "false"},
    {"parallel_residual", MF_BOOL, "true", "false"},
    {"shared_attention_norm", MF_BOOL, "false", "false"},
    {"n_head", MF_INT, "32", NULL},
    {"head_size", MF_INT, NULL, NULL},
    {"n_query_groups", MF_INT, NULL, NULL},
    {"attn_bias", MF_BOOL, "false", "false"},
    {"attention_scores_scalar", MF_INT, NULL, "null"},
    {"sliding_window_size", MF_INT, NULL, "null"},
    {"sliding_window_indices", MF_LIST, NULL, NULL},
    {"attention_logit_softcapping", MF_FLOAT, NULL, "null"},
    {"rope_base", MF_FLOAT, "10000", NULL},
    {"rotary_percentage", MF_FLOAT, "0.25", "1.0"},
    {"rope_condense_ratio", MF_INT, "1", "1"},
    {"rope_adjustments.factor", MF_FLOAT, NULL, NULL},
    {"rope_adjustments.low_freq_factor", MF_FLOAT, NULL, NULL},
    {"rope_adjustments.high_freq_factor", MF_FLOAT, NULL, NULL},
    {"rope_adjustments.original_max_seq_len", MF_INT, NULL, NULL},
    {"rope_interleave", MF_BOOL, "false", "false"},
    {"intermediate_size", MF_INT, NULL, NULL},
    {"moe_intermediate_size", MF_INT, NULL, NULL},
    {"bias", MF_BOOL, "true", "false"},
    {"mlp_class_name", MF_STR, "GptNeoxMLP", "LLaMAMLP"},
    {"gelu_approximate", MF_STR, "none", NULL},
    {"n_expert", MF_INT, "0", "0"},
    {"n_shared_expert", MF_INT, NULL, NULL},
    {"n_expert_groups", MF_INT, NULL, NULL},
    {"n_topk_groups", MF_INT, NULL, NULL},
    {"n_topk_scores_per_group", MF_INT, NULL, NULL},
    {"n_expert_per_token", MF_INT, "0", NULL},
    {"first_k_dense_replace", MF_INT, NULL, NULL},
    {"routed_scaling_factor", MF_FLOAT, "1.0", NULL},
    {"norm_topk_prob", MF_BOOL, "false", NULL},
    {"scale_embeddings", MF_BOOL, "false", "false"},
    {"lm_head_bias", MF_BOOL, "false", "false"},
    {"final_logit_softcapping", MF_FLOAT, NULL, "null"},
    {"norm_1", MF_BOOL, "true", "true"},
    {"norm_2", MF_BOOL, "true", "true"},
    {"latent_attention", MF_MAP, NULL, "null"},
    {"rope_local_base_freq", MF_FLOAT, NULL, "null"},
    {"rope_indices", MF_LIST, NULL, NULL},
};
#define N_FIELDS (sizeof k_fields / sizeof k_fields[0])

static const mfield *find_field(const char *name) {
    for (size_t i = 0; i < N_FIELDS; i++)
        if (!strcmp(k_fields[i].name, name)) return &k_fields[i];
    /* latent_attention.* and hf_config.* beyond name/org are accepted as a group */
    if (!strncmp(name, "latent_attention.", 17)) return find_field("latent_attention");
    return NULL;
}

static int parse_bool(const char *v, int *out) {
    if (!strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcmp(v, "1")) { *out = 1; return 0; }
    if (!strcasecmp(v, "false") || !strcasecmp(v, "no") || !strcmp(v, "0")) { *out = 0; return 0; }
    return -1;
}

static int parse_num(const char *v, int integer, double *out) {
    char buf[64];
    size_t o = 0;
    for (size_t i = 0; v[i] && o < sizeof buf - 1; i++)
        if (v[i] != '_') buf[o++] = v[i];
    buf[o] = 0;
    char *end;
    double x = strtod(buf, &end);
    if (end == buf || *end || !isfinite(x)) return -1;
    if (integer && (x != floor(x) || fabs(x) > 1e9)) return -1;
    *out = x;
    return 0;
}

int fl_cfg_model_field_is_str(const char *field) {
    const mfield *f = find_field(field);
    return !f || f->type == MF_STR;
}

fl_status fl_cfg_model_field_check(const char *field, const char *v) {
    const mfield *f = find_field(field);
    if (!f) {
        const char *best = NULL;
        size_t bd = (size_t)-1;
        for (size_t i = 0; i < N_FIELDS; i++) {
            size_t d = fl_edit_distance(field, k_fields[i].name);
            if (d < bd) bd = d, best = k_fields[i].name;
        }
        return fl_errorf(FL_ERR_INVALID, "unknown option 'model_config.%s': not a litgpt.Config field%s%s%s", field,
                         bd <= 2 + strlen(field) / 4 ? " (did you mean 'model_config." : "",
                         bd <= 2 + strlen(field) / 4 ? best : "", bd <= 2 + strlen(field) / 4 ? "'?)" : "");
    }
    if (fl_cfg_is_null(v) || f->type == MF_STR || f->type == MF_MAP) return FL_OK;
    int b;
    double x;
    if (f->type == MF_BOOL && parse_bool(v, &b))
        return fl_errorf(FL_ERR_INVALID, "option 'model_config.%s': '%s' is not a boolean (true/false)", field, v);
    if ((f->type == MF_INT || f->type == MF_FLOAT) && parse_num(v, f->type == MF_INT, &x))
        return fl_errorf(FL_ERR_INVALID, "option 'model_config.%s': '%s' is not %s", field, v,
                         f->type == MF_INT ? "an integer" : "a number");
    if (f->type == MF_LIST && (v[0] != '[' || v[strlen(v) - 1] != ']'))
        return fl_errorf(FL_ERR_INVALID, "option 'model_config.%s': '%s' is not a list like [1, 0]", field, v);
    return FL_OK;
}

/* The value of a field: the one given, else litgpt.Config's default (NULL = None). */
static const char *get(const fl_run_config *c, const char *name) {
    for (int i = 0; i < c->n_model_fields; i++)
        if (!strcmp(c->model_fields[i].key, name)) return fl_cfg_is_null(c->model_fields[i].value) ? NULL
                                                                                                   : c->model_fields[i].value;
    const mfield *f = find_field(name);
    return f ? f->def : NULL;
}

static long geti(const fl_run_config *c, const char *name, long dflt) {
    const char *v = get(c, name);
    double x;
    return v && !parse_num(v, 1, &x) ? (long)x : dflt;
}

static double getf(const fl_run_config *c, const char *name, double dflt) {
    const char *v = get(c, name);
    double x;
    return v && !parse_num(v, 0, &x) ? x : dflt;
}

/* Does a value equal the one fitllm needs? (numbers compared as numbers) */
static int same(const mfield *f, const char *v, const char *need) {
    if (!strcmp(need, "null")) return v == NULL;
    if (!v) return 0;
    if (f->type == MF_BOOL) {
        int a, b;
        return !parse_bool(v, &a) && !parse_bool(need, &b) && a == b;
    }
    if (f->type == MF_INT || f->type == MF_FLOAT) {
        double a, b;
        return !parse_num(v, 0, &a) && !parse_num(need, 0, &b) && a == b;
    }
    return !strcmp(v, need);
}

/* Every field fitllm cannot build and every bad value, in one message (a field a run made a user fix them one rerun
 * at a time). */
static fl_status from_fields(const fl_run_config *c, fl_model_config *mc) {
    fl_errlist need = {0}, bad = {0};
    for (size_t i = 0; i < N_FIELDS; i++) {
        const mfield *f = &k_fields[i];
        if (!f->need) continue;
        const char *v = get(c, f->name);
        if (!same(f, v, f->need))
            fl_errlist_add(&need, FL_ERR_UNSUPPORTED, "model_config.%s = %s (%sset %s: %s)", f->name, v ? v : "null",
                           c->n_model_fields && v == f->def && f->def ? "litgpt.Config's default; " : "", f->name,
                           f->need);
    }
    if (need.n) /* what fitllm builds, once after the fields that differ from it */
        fl_errlist_add(&bad, FL_ERR_UNSUPPORTED, "%s: fitllm builds LLaMA-style models from a model_config "
                       "(norm_class_name RMSNorm, mlp_class_name LLaMAMLP, rotary_percentage 1.0, parallel_residual "
                       "false, bias false, ...), or use a preset (model_name)", need.text);
    memset(mc, 0, sizeof *mc);
    mc->arch = FL_ARCH_LLAMA;
    const char *name = get(c, "name");
    if ((!name || !*name) && get(c, "hf_config.name")) name = get(c, "hf_config.name");
    snprintf(mc->name, sizeof mc->name, "%s", name && *name ? name : "model_config");
    long n_embd = geti(c, "n_embd", 0), n_head = geti(c, "n_head", 0);
    long head_size = geti(c, "head_size", -1);
    if (n_head <= 0 || n_embd <= 0)
        fl_errlist_add(&bad, FL_ERR_INVALID, "model_config: n_embd and n_head must be positive");
    else if (head_size < 0 && n_embd % n_head)
        fl_errlist_add(&bad, FL_ERR_INVALID, "model_config: n_embd %ld is not divisible by n_head %ld (set head_size)",
                       n_embd, n_head);
    else if (head_size < 0)
        head_size = n_embd / n_head;
    long vocab = geti(c, "vocab_size", 0), mult = geti(c, "padding_multiple", 512);
    long padded = geti(c, "padded_vocab_size", -1);
    if (padded < 0 && mult <= 0) fl_errlist_add(&bad, FL_ERR_INVALID, "model_config.padding_multiple must be positive");
    else if (padded < 0)
        padded = vocab % mult ? vocab + mult - vocab % mult : vocab;
    long ffn = geti(c, "intermediate_size", -1);
    if (ffn < 0) /* litgpt.Config raises the same */
        fl_errlist_add(&bad, FL_ERR_INVALID, "model_config: LLaMAMLP needs intermediate_size");
    if (get(c, "rope_adjustments.factor") &&
        (!get(c, "rope_adjustments.low_freq_factor") || !get(c, "rope_adjustments.high_freq_factor") ||
         !get(c, "rope_adjustments.original_max_seq_len")))
        fl_errlist_add(&bad, FL_ERR_UNSUPPORTED, "model_config.rope_adjustments: fitllm supports Llama 3's form "
                       "(factor, low_freq_factor, high_freq_factor, original_max_seq_len)");
    if (bad.n > (need.n > 0)) return fl_errlist_fail(&bad); /* the shape's own fields: no model to check further */
    long groups = geti(c, "n_query_groups", n_head);
    mc->vocab_size = (int)padded;
    mc->dim = (int)n_embd;
    mc->n_layers = (int)geti(c, "n_layer", 0);
    mc->n_heads = (int)n_head;
    mc->n_kv_heads = (int)groups;
    mc->head_dim = (int)head_size;
    mc->ffn_dim = (int)ffn;
    mc->max_seq = (int)geti(c, "block_size", 0);
    mc->norm_eps = (float)getf(c, "norm_eps", 1e-5);
    mc->rope_theta = (float)getf(c, "rope_base", 10000);
    if (get(c, "rope_adjustments.factor")) { /* Llama 3.1 / 3.2 frequency scaling */
        mc->rope_scaling.type = FL_ROPE_LLAMA3;
        mc->rope_scaling.factor = (float)getf(c, "rope_adjustments.factor", 1);
        mc->rope_scaling.low_freq_factor = (float)getf(c, "rope_adjustments.low_freq_factor", 1);
        mc->rope_scaling.high_freq_factor = (float)getf(c, "rope_adjustments.high_freq_factor", 1);
        mc->rope_scaling.original_max_position = (int)geti(c, "rope_adjustments.original_max_seq_len", 0);
    }
    /* LitGPT's GPT has a separate lm_head; pretrain ties it when train.tie_embeddings */
    mc->tie_embeddings = c->train.tie_embeddings == 1;
    /* the model's own checks (a value in a recipe or a model_config.yaml: a bad value, exit 2) */
    if (fl_config_validate(mc) != FL_OK) fl_errlist_add(&bad, FL_ERR_INVALID, "model_config: %s", fl_error_message());
    return fl_errlist_fail(&bad);
}

fl_status fl_cfg_model_config(const fl_run_config *c, fl_model_config *mc, int *have) {
    *have = 0;
    if (c->n_model_fields) {
        FL_TRY(from_fields(c, mc));
    } else if (c->model_config[0]) {
        FL_TRY(fl_hf_load_config(c->model_config, mc));
    } else if (c->model_name[0]) {
        FL_TRY(fl_preset_find(c->model_name, mc));
        if (c->train.tie_embeddings >= 0) mc->tie_embeddings = c->train.tie_embeddings;
    } else {
        return FL_OK;
    }
    *have = 1;
    return FL_OK;
}
