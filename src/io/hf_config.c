/* Hugging Face config.json <-> fl_model_config (LLaMA and GPT-2 families). */
#include "fitllm/io.h"
#include "fitllm/json.h"

#include "core/fs.h"
#include "core/text.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *fl_hf_type_name(const fl_json *j) {
    static const char *names[] = {"null", "boolean", "number", "string", "array", "object"};
    return j ? names[j->type] : "absent";
}

/* Key present and not null. */
static const fl_json *fl_hf_key(const fl_json *o, const char *key) {
    const fl_json *j = fl_json_get(o, key);
    return (j && j->type != FL_JSON_NULL) ? j : NULL;
}

/* Integer key: required (no default) when def == NULL. */
static fl_status fl_hf_int(const char *path, const fl_json *o, const char *key, const int *def, int *out) {
    const fl_json *j = fl_hf_key(o, key);
    if (!j) {
        if (def) { *out = *def; return FL_OK; }
        return fl_errorf(FL_ERR_FORMAT, "%s: %s key '%s' (an integer is needed)", path,
                         fl_json_get(o, key) ? "null" : "missing", key);
    }
    if (j->type != FL_JSON_NUMBER || !j->is_int)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s' must be an integer (got %s)", path, key,
                         j->type == FL_JSON_NUMBER ? "a non-integer number" : fl_hf_type_name(j));
    if (j->i < INT_MIN || j->i > INT_MAX)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s' value %lld is out of range", path, key, (long long)j->i);
    *out = (int)j->i;
    return FL_OK;
}

static fl_status fl_hf_float(const char *path, const fl_json *o, const char *key, const float *def, float *out) {
    const fl_json *j = fl_hf_key(o, key);
    if (!j) {
        if (def) { *out = *def; return FL_OK; }
        return fl_errorf(FL_ERR_FORMAT, "%s: %s key '%s' (a number is needed)", path,
                         fl_json_get(o, key) ? "null" : "missing", key);
    }
    if (j->type != FL_JSON_NUMBER)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s' must be a number (got %s)", path, key, fl_hf_type_name(j));
    *out = (float)j->num;
    /* 1e105 parses as a double but is inf as a float, and inf would be written back as a non-JSON token */
    if (!isfinite(*out))
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s' = %g is outside the range of a float", path, key, j->num);
    return FL_OK;
}

/* A float key that must be positive (an epsilon, RoPE's base, a scaling factor): 0 or below would be replaced by a
 * default downstream, or divide by zero, so it is refused here, naming the key. */
static fl_status fl_hf_pos_float(const char *path, const fl_json *o, const char *key, const float *def, float *out) {
    FL_TRY(fl_hf_float(path, o, key, def, out));
    if (!(*out > 0))
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s' = %g must be a positive number", path, key, (double)*out);
    return FL_OK;
}

static fl_status fl_hf_bool(const char *path, const fl_json *o, const char *key, int def, int *out) {
    const fl_json *j = fl_hf_key(o, key);
    if (!j) { *out = def; return FL_OK; }
    if (j->type != FL_JSON_BOOL)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s' must be true or false (got %s)", path, key, fl_hf_type_name(j));
    *out = j->b;
    return FL_OK;
}

/* Optional string key; *out = NULL if absent/null. */
static fl_status fl_hf_str(const char *path, const fl_json *o, const char *key, const char **out) {
    const fl_json *j = fl_hf_key(o, key);
    *out = NULL;
    if (!j) return FL_OK;
    if (j->type != FL_JSON_STRING)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s' must be a string (got %s)", path, key, fl_hf_type_name(j));
    *out = j->str;
    return FL_OK;
}

/* rope_scaling (transformers <= 4) or rope_parameters (transformers 5, which
 * also moves rope_theta inside it): `key` names the object. */
static fl_status fl_hf_rope_scaling(const char *path, const fl_json *root, const char *key, fl_rope_scaling *rs) {
    memset(rs, 0, sizeof *rs);
    const fl_json *j = fl_hf_key(root, key);
    if (!j) return FL_OK;
    if (j->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s' must be an object or null (got %s)", path, key, fl_hf_type_name(j));
    const char *type = NULL;
    FL_TRY(fl_hf_str(path, j, "rope_type", &type));
    if (!type) FL_TRY(fl_hf_str(path, j, "type", &type));
    if (!type) return fl_errorf(FL_ERR_FORMAT, "%s: missing key '%s.rope_type'", path, key);
    if (strcmp(type, "default") == 0) return FL_OK;
    if (strcmp(type, "linear") == 0) {
        rs->type = FL_ROPE_LINEAR;
        FL_TRY(fl_hf_pos_float(path, j, "factor", NULL, &rs->factor));
        return FL_OK;
    }
    if (strcmp(type, "llama3") == 0) {
        rs->type = FL_ROPE_LLAMA3;
        FL_TRY(fl_hf_pos_float(path, j, "factor", NULL, &rs->factor));
        FL_TRY(fl_hf_pos_float(path, j, "low_freq_factor", NULL, &rs->low_freq_factor));
        FL_TRY(fl_hf_pos_float(path, j, "high_freq_factor", NULL, &rs->high_freq_factor));
        FL_TRY(fl_hf_int(path, j, "original_max_position_embeddings", NULL, &rs->original_max_position));
        if (!(rs->high_freq_factor > rs->low_freq_factor))
            return fl_errorf(FL_ERR_FORMAT, "%s: key 'rope_scaling.high_freq_factor' must exceed low_freq_factor", path);
        return FL_OK;
    }
    return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'rope_scaling.rope_type' = '%s' is not supported (linear, llama3, default)",
                     path, type);
}

static int fl_hf_arch_has(const fl_json *root, const char *name) {
    const fl_json *a = fl_json_get(root, "architectures");
    if (!a || a->type != FL_JSON_ARRAY) return 0;
    for (const fl_json *c = a->child; c; c = c->next)
        if (c->type == FL_JSON_STRING && strcmp(c->str, name) == 0) return 1;
    return 0;
}

static fl_status fl_hf_parse_llama(const char *path, const fl_json *r, fl_model_config *c) {
    c->arch = FL_ARCH_LLAMA;
    snprintf(c->name, sizeof c->name, "llama");
    const char *act = NULL;
    FL_TRY(fl_hf_str(path, r, "hidden_act", &act));
    if (act && strcmp(act, "silu") != 0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'hidden_act' = '%s' is not supported (silu)", path, act);
    FL_TRY(fl_hf_int(path, r, "hidden_size", NULL, &c->dim));
    FL_TRY(fl_hf_int(path, r, "intermediate_size", NULL, &c->ffn_dim));
    FL_TRY(fl_hf_int(path, r, "num_attention_heads", NULL, &c->n_heads));
    FL_TRY(fl_hf_int(path, r, "num_key_value_heads", &c->n_heads, &c->n_kv_heads));
    int hd_def = c->n_heads > 0 ? c->dim / c->n_heads : 0;
    FL_TRY(fl_hf_int(path, r, "head_dim", &hd_def, &c->head_dim));
    FL_TRY(fl_hf_int(path, r, "num_hidden_layers", NULL, &c->n_layers));
    FL_TRY(fl_hf_pos_float(path, r, "rms_norm_eps", NULL, &c->norm_eps));
    const float theta = 10000.0f;
    const fl_json *rp = fl_hf_key(r, "rope_parameters");
    if (rp && rp->type == FL_JSON_OBJECT && !fl_hf_key(r, "rope_theta") && !fl_hf_key(r, "rope_scaling")) {
        FL_TRY(fl_hf_pos_float(path, rp, "rope_theta", &theta, &c->rope_theta));
        FL_TRY(fl_hf_rope_scaling(path, r, "rope_parameters", &c->rope_scaling));
    } else {
        FL_TRY(fl_hf_pos_float(path, r, "rope_theta", &theta, &c->rope_theta));
        FL_TRY(fl_hf_rope_scaling(path, r, "rope_scaling", &c->rope_scaling));
    }
    FL_TRY(fl_hf_int(path, r, "vocab_size", NULL, &c->vocab_size));
    FL_TRY(fl_hf_bool(path, r, "tie_word_embeddings", 0, &c->tie_embeddings));
    FL_TRY(fl_hf_int(path, r, "max_position_embeddings", NULL, &c->max_seq));
    FL_TRY(fl_hf_bool(path, r, "attention_bias", 0, &c->attention_bias));
    FL_TRY(fl_hf_bool(path, r, "mlp_bias", 0, &c->mlp_bias));
    return FL_OK;
}

static fl_status fl_hf_parse_gpt2(const char *path, const fl_json *r, fl_model_config *c) {
    c->arch = FL_ARCH_GPT2;
    snprintf(c->name, sizeof c->name, "gpt2");
    const char *act = NULL;
    FL_TRY(fl_hf_str(path, r, "activation_function", &act));
    if (act && strcmp(act, "gelu_new") != 0 && strcmp(act, "gelu_pytorch_tanh") != 0 && strcmp(act, "gelu_fast") != 0)
        return fl_errorf(FL_ERR_UNSUPPORTED,
                         "%s: key 'activation_function' = '%s' is not supported (gelu_new, gelu_pytorch_tanh)", path, act);
    FL_TRY(fl_hf_int(path, r, "n_embd", NULL, &c->dim));
    FL_TRY(fl_hf_int(path, r, "n_layer", NULL, &c->n_layers));
    FL_TRY(fl_hf_int(path, r, "n_head", NULL, &c->n_heads));
    c->n_kv_heads = c->n_heads;
    c->head_dim = c->n_heads > 0 ? c->dim / c->n_heads : 0;
    if (fl_hf_key(r, "n_positions")) FL_TRY(fl_hf_int(path, r, "n_positions", NULL, &c->max_seq));
    else if (fl_hf_key(r, "n_ctx")) FL_TRY(fl_hf_int(path, r, "n_ctx", NULL, &c->max_seq));
    else return fl_errorf(FL_ERR_FORMAT, "%s: missing key 'n_positions'", path);
    FL_TRY(fl_hf_int(path, r, "vocab_size", NULL, &c->vocab_size));
    const float eps = 1e-5f;
    FL_TRY(fl_hf_pos_float(path, r, "layer_norm_epsilon", &eps, &c->norm_eps));
    int inner = 4 * c->dim;
    FL_TRY(fl_hf_int(path, r, "n_inner", &inner, &c->ffn_dim));
    FL_TRY(fl_hf_bool(path, r, "tie_word_embeddings", 1, &c->tie_embeddings));
    c->rope_theta = 0.0f;
    c->attention_bias = 1;
    c->mlp_bias = 1;
    return FL_OK;
}

/* OPT (OPTForCausalLM): pre-norm blocks only, no embedding projection (fl_arch_opt, src/model/arch_opt.c) */
static fl_status fl_hf_parse_opt(const char *path, const fl_json *r, fl_model_config *c) {
    c->arch = FL_ARCH_OPT;
    snprintf(c->name, sizeof c->name, "opt");
    const char *act = NULL;
    FL_TRY(fl_hf_str(path, r, "activation_function", &act));
    if (act && strcmp(act, "relu") != 0)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'activation_function' = '%s' is not supported (relu)", path, act);
    int pre = 1, affine = 1, bias = 1, remove_final = 0;
    FL_TRY(fl_hf_bool(path, r, "do_layer_norm_before", 1, &pre));
    if (!pre)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'do_layer_norm_before' = false (post-norm blocks, as OPT-350m) is "
                         "not supported", path);
    FL_TRY(fl_hf_bool(path, r, "_remove_final_layer_norm", 0, &remove_final));
    if (remove_final) return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key '_remove_final_layer_norm' = true is not supported", path);
    FL_TRY(fl_hf_bool(path, r, "layer_norm_elementwise_affine", 1, &affine));
    if (!affine)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'layer_norm_elementwise_affine' = false is not supported", path);
    FL_TRY(fl_hf_int(path, r, "hidden_size", NULL, &c->dim));
    int proj = c->dim;
    FL_TRY(fl_hf_int(path, r, "word_embed_proj_dim", &proj, &proj));
    if (proj != c->dim)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'word_embed_proj_dim' = %d differs from hidden_size %d (project_in/out "
                         "layers, as OPT-350m) is not supported", path, proj, c->dim);
    FL_TRY(fl_hf_int(path, r, "ffn_dim", NULL, &c->ffn_dim));
    FL_TRY(fl_hf_int(path, r, "num_attention_heads", NULL, &c->n_heads));
    c->n_kv_heads = c->n_heads;
    c->head_dim = c->n_heads > 0 ? c->dim / c->n_heads : 0;
    FL_TRY(fl_hf_int(path, r, "num_hidden_layers", NULL, &c->n_layers));
    FL_TRY(fl_hf_int(path, r, "max_position_embeddings", NULL, &c->max_seq));
    FL_TRY(fl_hf_int(path, r, "vocab_size", NULL, &c->vocab_size));
    FL_TRY(fl_hf_bool(path, r, "tie_word_embeddings", 1, &c->tie_embeddings));
    FL_TRY(fl_hf_bool(path, r, "enable_bias", 1, &bias));
    c->attention_bias = c->mlp_bias = bias;
    c->norm_eps = 1e-5f; /* nn.LayerNorm's default: OPT has no epsilon key */
    c->rope_theta = 0.0f;
    /* OPTDecoderLayer's dropout (the attention and FFN outputs) and attention_dropout (the weights): applied in
     * training passes when the trainer turns them on (cfg.dropout_on); OPTConfig's defaults. activation_dropout is
     * not read by transformers' OPT (nor here); layerdrop's random layer skipping is not applied */
    const float drop = 0.1f, adrop = 0.0f;
    FL_TRY(fl_hf_float(path, r, "dropout", &drop, &c->dropout_rate));
    FL_TRY(fl_hf_float(path, r, "attention_dropout", &adrop, &c->attn_dropout_rate));
    if (c->dropout_rate < 0 || c->dropout_rate >= 1)
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'dropout' = %g must be in [0, 1)", path, (double)c->dropout_rate);
    if (c->attn_dropout_rate < 0 || c->attn_dropout_rate >= 1)
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'attention_dropout' = %g must be in [0, 1)", path,
                         (double)c->attn_dropout_rate);
    return FL_OK;
}

/* T5 (T5ForConditionalGeneration; fl_arch_t5, src/model/arch_t5.c). feed_forward_proj selects the variant: "relu"
 * (v1.0) or "gated-gelu" (v1.1 / Flan: the tanh GELU, "gelu_new"); dense_act_fn and is_gated_act, which
 * transformers derives from it, must agree with it when present. tie_word_embeddings (default true) ties the head
 * and scales the decoder output by d_model^-0.5 (v1.0), unless scale_decoder_outputs (transformers 5) says
 * otherwise; false: lm_head.weight, no scaling (v1.1). */
static fl_status fl_hf_parse_t5(const char *path, const fl_json *r, fl_model_config *c) {
    c->arch = FL_ARCH_T5;
    snprintf(c->name, sizeof c->name, "t5");
    const char *ff = NULL, *act = NULL;
    FL_TRY(fl_hf_str(path, r, "feed_forward_proj", &ff));
    if (!ff) ff = "relu";
    if (strcmp(ff, "relu") == 0) c->ffn_gated = 0;
    else if (strcmp(ff, "gated-gelu") == 0 || strcmp(ff, "gated-gelu_new") == 0) c->ffn_gated = 1;
    else
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'feed_forward_proj' = '%s' is not supported (relu, gated-gelu)",
                         path, ff);
    const char *want = c->ffn_gated ? "gelu_new" : "relu";
    FL_TRY(fl_hf_str(path, r, "dense_act_fn", &act));
    if (act && strcmp(act, want) != 0 && !(c->ffn_gated && strcmp(act, "gelu_pytorch_tanh") == 0))
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'dense_act_fn' = '%s' contradicts 'feed_forward_proj' = '%s' (which "
                         "means %s)", path, act, ff, want);
    int gated = c->ffn_gated;
    FL_TRY(fl_hf_bool(path, r, "is_gated_act", c->ffn_gated, &gated));
    if (gated != c->ffn_gated)
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'is_gated_act' = %s contradicts 'feed_forward_proj' = '%s'", path,
                         gated ? "true" : "false", ff);
    const int kv = 64, buckets = 32, maxd = 128, npos = 512, zero = 0, one = 1;
    const float eps = 1e-6f;
    FL_TRY(fl_hf_int(path, r, "d_model", NULL, &c->dim));
    FL_TRY(fl_hf_int(path, r, "d_kv", &kv, &c->head_dim));
    FL_TRY(fl_hf_int(path, r, "d_ff", NULL, &c->ffn_dim));
    FL_TRY(fl_hf_int(path, r, "num_layers", NULL, &c->n_layers));
    FL_TRY(fl_hf_int(path, r, "num_decoder_layers", &c->n_layers, &c->n_dec_layers));
    FL_TRY(fl_hf_int(path, r, "num_heads", NULL, &c->n_heads));
    c->n_kv_heads = c->n_heads;
    FL_TRY(fl_hf_int(path, r, "relative_attention_num_buckets", &buckets, &c->rel_buckets));
    FL_TRY(fl_hf_int(path, r, "relative_attention_max_distance", &maxd, &c->rel_max_dist));
    FL_TRY(fl_hf_pos_float(path, r, "layer_norm_epsilon", &eps, &c->norm_eps));
    const float drop = 0.1f;
    FL_TRY(fl_hf_float(path, r, "dropout_rate", &drop, &c->dropout_rate));
    if (c->dropout_rate < 0 || c->dropout_rate >= 1)
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'dropout_rate' = %g must be in [0, 1)", path, (double)c->dropout_rate);
    FL_TRY(fl_hf_int(path, r, "vocab_size", NULL, &c->vocab_size));
    FL_TRY(fl_hf_int(path, r, "n_positions", &npos, &c->max_seq)); /* informational: relative positions have no table */
    FL_TRY(fl_hf_bool(path, r, "tie_word_embeddings", 1, &c->tie_embeddings));
    FL_TRY(fl_hf_bool(path, r, "scale_decoder_outputs", c->tie_embeddings, &c->head_scale));
    FL_TRY(fl_hf_int(path, r, "pad_token_id", &zero, &c->pad_id));
    FL_TRY(fl_hf_int(path, r, "decoder_start_token_id", &c->pad_id, &c->dec_start_id));
    const fl_json *eos = fl_hf_key(r, "eos_token_id"); /* an id or a list of ids (the first) */
    if (eos && eos->type == FL_JSON_ARRAY) {
        const fl_json *e0 = eos->child;
        if (!e0 || e0->type != FL_JSON_NUMBER || !e0->is_int || e0->i < 0 || e0->i > INT_MAX)
            return fl_errorf(FL_ERR_FORMAT, "%s: key 'eos_token_id' must be an id or a non-empty list of ids", path);
        c->eos_id = (int)e0->i;
    } else {
        FL_TRY(fl_hf_int(path, r, "eos_token_id", &one, &c->eos_id));
    }
    c->attention_bias = c->mlp_bias = 0;
    c->rope_theta = 0.0f;
    return FL_OK;
}

/* An architecture read from its descriptor's key table (fl_arch_hf_keys): nothing here changes per architecture. */
static int fl_hf_in_list(const char *v, const char *const *list) {
    for (int i = 0; v && list && list[i]; i++)
        if (strcmp(v, list[i]) == 0) return 1;
    return 0;
}

/* ", bert": the keyed architectures' model types, for messages */
static const char *fl_hf_keyed_names(void) {
    static char buf[128];
    buf[0] = 0;
    for (int a = 0; a < FL_ARCH_COUNT; a++) {
        const fl_arch_info *ai = fl_arch_get((fl_arch)a);
        for (int i = 0; ai->hf_keys && ai->hf_model_types && ai->hf_model_types[i]; i++)
            snprintf(buf + strlen(buf), sizeof buf - strlen(buf), ", %s", ai->hf_model_types[i]);
    }
    return buf;
}

static fl_status fl_hf_parse_keys(const char *path, const fl_json *r, fl_arch a, fl_model_config *c) {
    const fl_arch_info *ai = fl_arch_get(a);
    const fl_arch_hf_keys *k = ai->hf_keys;
    c->arch = a;
    snprintf(c->name, sizeof c->name, "%s", ai->name);
    const char *act = NULL;
    if (k->act) FL_TRY(fl_hf_str(path, r, k->act, &act));
    if (act && !fl_hf_in_list(act, k->acts)) {
        char list[256] = "";
        for (int i = 0; k->acts && k->acts[i]; i++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", k->acts[i]);
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key '%s' = '%s' is not supported (%s)", path, k->act, act, list);
    }
    const int zero = 0;
    struct { const char *key; int *field; const int *def; } ints[] = {
        {k->dim, &c->dim, NULL},          {k->ffn, &c->ffn_dim, &zero},      {k->heads, &c->n_heads, NULL},
        {k->kv_heads, &c->n_kv_heads, &zero}, {k->layers, &c->n_layers, NULL}, {k->max_seq, &c->max_seq, NULL},
        {k->vocab, &c->vocab_size, NULL}, {k->type_vocab, &c->type_vocab_size, &zero},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (ints[i].key) FL_TRY(fl_hf_int(path, r, ints[i].key, ints[i].def, ints[i].field));
    if (k->eps) FL_TRY(fl_hf_pos_float(path, r, k->eps, &k->eps_default, &c->norm_eps));
    return FL_OK;
}

/* One config object (the whole config.json, or a composite's text_config) by its model_type, validated. */
fl_status fl_hf_config_from_json(const char *path, const fl_json *root, fl_model_config *cfg) {
    fl_status s = FL_OK;
    fl_model_config c;
    memset(&c, 0, sizeof c);
    if (root->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: top level must be a JSON object (got %s)", path, fl_hf_type_name(root));
    const char *mt = NULL;
    FL_TRY(fl_hf_str(path, root, "model_type", &mt));
    int is_llama = mt ? strcmp(mt, "llama") == 0 : 0, is_gpt2 = mt ? strcmp(mt, "gpt2") == 0 : 0;
    const int is_opt = mt ? strcmp(mt, "opt") == 0 : 0, is_t5 = mt ? strcmp(mt, "t5") == 0 : 0;
    if (!is_llama && !is_gpt2) { /* llama-compatible variants name the architecture */
        is_llama = fl_hf_arch_has(root, "LlamaForCausalLM");
        is_gpt2 = !is_llama && !mt && fl_hf_arch_has(root, "GPT2LMHeadModel");
    }
    fl_arch keyed = FL_ARCH_COUNT; /* an architecture whose descriptor carries its config keys */
    for (int a = 0; a < FL_ARCH_COUNT && keyed == FL_ARCH_COUNT; a++)
        if (fl_arch_get((fl_arch)a)->hf_keys && fl_hf_in_list(mt, fl_arch_get((fl_arch)a)->hf_model_types)) keyed = (fl_arch)a;
    if (keyed != FL_ARCH_COUNT)
        s = fl_hf_parse_keys(path, root, keyed, &c);
    else if (is_llama)
        s = fl_hf_parse_llama(path, root, &c);
    else if (is_gpt2)
        s = fl_hf_parse_gpt2(path, root, &c);
    else if (is_opt)
        s = fl_hf_parse_opt(path, root, &c);
    else if (is_t5)
        s = fl_hf_parse_t5(path, root, &c);
    else if (mt && strcmp(mt, "blip-2") == 0)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: model_type 'blip-2' is a composite (vision tower, Q-Former, language "
                      "model): its commands take it as BLIP-2 (fitllm loss / generate with --image, finetune_full, "
                      "finetune_lora, merge_lora, plan, bench-step)", path);
    else if (mt)
        s = fl_errorf(FL_ERR_UNSUPPORTED, "%s: model_type '%s' is not supported (llama, gpt2, opt, t5%s)", path, mt,
                      fl_hf_keyed_names());
    else
        s = fl_errorf(FL_ERR_FORMAT, "%s: missing key 'model_type' (and no known 'architectures')", path);
    if (s != FL_OK) return s;
    s = fl_config_validate(&c);
    if (s != FL_OK) return fl_error_prefix(s, "%s", path);
    *cfg = c;
    return FL_OK;
}

fl_status fl_hf_load_config(const char *path, fl_model_config *cfg) {
    fl_json *root = NULL;
    FL_TRY(fl_json_parse_file(path, &root));
    fl_status s = fl_hf_config_from_json(path, root, cfg);
    fl_json_free(root);
    return s;
}

/* ---- writing ------------------------------------------------------------ */

/* the shortest decimal that reads back as the same float (1e-05, not %.9g's 9.99999975e-06: what transformers writes) */
static void fl_hf_fmt_float(char *buf, size_t n, float v) {
    if (v == floorf(v) && fabsf(v) < 1e15f) snprintf(buf, n, "%.1f", (double)v); /* 500000.0, not 5e+05 */
    else fl_text_float(v, buf, n);
    if (!strpbrk(buf, ".eEn")) strncat(buf, ".0", n - strlen(buf) - 1);
}

/* config.json's rope_scaling value of a LLaMA config */
static void fl_hf_rope_scaling_text(const fl_model_config *c, char *rs, size_t n) {
    char f[48], lo[48], hi[48];
    fl_hf_fmt_float(f, sizeof f, c->rope_scaling.factor);
    if (c->rope_scaling.type == FL_ROPE_LINEAR) {
        snprintf(rs, n, "{\"rope_type\": \"linear\", \"factor\": %s}", f);
    } else if (c->rope_scaling.type == FL_ROPE_LLAMA3) {
        fl_hf_fmt_float(lo, sizeof lo, c->rope_scaling.low_freq_factor);
        fl_hf_fmt_float(hi, sizeof hi, c->rope_scaling.high_freq_factor);
        snprintf(rs, n,
                 "{\"rope_type\": \"llama3\", \"factor\": %s, \"low_freq_factor\": %s, \"high_freq_factor\": %s, "
                 "\"original_max_position_embeddings\": %d}",
                 f, lo, hi, c->rope_scaling.original_max_position);
    } else {
        snprintf(rs, n, "null");
    }
}

fl_status fl_hf_save_config(const char *path, const fl_model_config *c) { return fl_hf_save_config_dtype(path, c, FL_F32); }

/* transformers' name of a parameter dtype (config.json's torch_dtype / dtype) */
static const char *fl_hf_torch_dtype(fl_dtype dt) {
    return dt == FL_BF16 ? "bfloat16" : dt == FL_F16 ? "float16" : dt == FL_F64 ? "float64" : "float32";
}

fl_status fl_hf_save_config_dtype(const char *path, const fl_model_config *c, fl_dtype dt) {
    const char *dn = fl_hf_torch_dtype(dt); /* written as torch_dtype (transformers 4) and dtype (transformers 5) */
    char buf[4096], eps[48], theta[48];
    int w;
    fl_hf_fmt_float(eps, sizeof eps, c->norm_eps);
    if (c->arch == FL_ARCH_LLAMA) {
        char rs[512];
        fl_hf_fmt_float(theta, sizeof theta, c->rope_theta > 0 ? c->rope_theta : 10000.0f);
        fl_hf_rope_scaling_text(c, rs, sizeof rs);
        w = snprintf(buf, sizeof buf,
                     "{\n"
                     "  \"architectures\": [\"LlamaForCausalLM\"],\n"
                     "  \"model_type\": \"llama\",\n"
                     "  \"hidden_act\": \"silu\",\n"
                     "  \"hidden_size\": %d,\n"
                     "  \"intermediate_size\": %d,\n"
                     "  \"num_hidden_layers\": %d,\n"
                     "  \"num_attention_heads\": %d,\n"
                     "  \"num_key_value_heads\": %d,\n"
                     "  \"head_dim\": %d,\n"
                     "  \"vocab_size\": %d,\n"
                     "  \"max_position_embeddings\": %d,\n"
                     "  \"rms_norm_eps\": %s,\n"
                     "  \"rope_theta\": %s,\n"
                     "  \"rope_scaling\": %s,\n"
                     "  \"attention_bias\": %s,\n"
                     "  \"mlp_bias\": %s,\n"
                     "  \"tie_word_embeddings\": %s,\n"
                     "  \"initializer_range\": 0.02,\n"
                     "  \"use_cache\": true,\n"
                     "  \"torch_dtype\": \"%s\",\n"
                     "  \"dtype\": \"%s\"\n"
                     "}\n",
                     c->dim, c->ffn_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->head_dim, c->vocab_size, c->max_seq,
                     eps, theta, rs, c->attention_bias ? "true" : "false", c->mlp_bias ? "true" : "false",
                     c->tie_embeddings ? "true" : "false", dn, dn);
    } else if (c->arch == FL_ARCH_GPT2) {
        w = snprintf(buf, sizeof buf,
                     "{\n"
                     "  \"architectures\": [\"GPT2LMHeadModel\"],\n"
                     "  \"model_type\": \"gpt2\",\n"
                     "  \"activation_function\": \"gelu_new\",\n"
                     "  \"n_embd\": %d,\n"
                     "  \"n_layer\": %d,\n"
                     "  \"n_head\": %d,\n"
                     "  \"n_inner\": %d,\n"
                     "  \"n_positions\": %d,\n"
                     "  \"n_ctx\": %d,\n"
                     "  \"vocab_size\": %d,\n"
                     "  \"layer_norm_epsilon\": %s,\n"
                     "  \"tie_word_embeddings\": %s,\n"
                     "  \"attn_pdrop\": 0.0,\n"
                     "  \"embd_pdrop\": 0.0,\n"
                     "  \"resid_pdrop\": 0.0,\n"
                     "  \"initializer_range\": 0.02,\n"
                     "  \"scale_attn_weights\": true,\n"
                     "  \"use_cache\": true,\n"
                     "  \"torch_dtype\": \"%s\",\n"
                     "  \"dtype\": \"%s\"\n"
                     "}\n",
                     c->dim, c->n_layers, c->n_heads, c->ffn_dim, c->max_seq, c->max_seq, c->vocab_size, eps,
                     c->tie_embeddings ? "true" : "false", dn, dn);
    } else if (c->arch == FL_ARCH_OPT) {
        char drop[48], adrop[48]; /* written back as read (the trainer applies them) */
        fl_hf_fmt_float(drop, sizeof drop, c->dropout_rate);
        fl_hf_fmt_float(adrop, sizeof adrop, c->attn_dropout_rate);
        w = snprintf(buf, sizeof buf,
                     "{\n"
                     "  \"architectures\": [\"OPTForCausalLM\"],\n"
                     "  \"model_type\": \"opt\",\n"
                     "  \"activation_function\": \"relu\",\n"
                     "  \"hidden_size\": %d,\n"
                     "  \"word_embed_proj_dim\": %d,\n"
                     "  \"ffn_dim\": %d,\n"
                     "  \"num_hidden_layers\": %d,\n"
                     "  \"num_attention_heads\": %d,\n"
                     "  \"max_position_embeddings\": %d,\n"
                     "  \"vocab_size\": %d,\n"
                     "  \"do_layer_norm_before\": true,\n"
                     "  \"enable_bias\": %s,\n"
                     "  \"layer_norm_elementwise_affine\": true,\n"
                     "  \"tie_word_embeddings\": %s,\n"
                     "  \"dropout\": %s,\n"
                     "  \"attention_dropout\": %s,\n"
                     "  \"layerdrop\": 0.0,\n"
                     "  \"init_std\": 0.02,\n"
                     "  \"use_cache\": true,\n"
                     "  \"torch_dtype\": \"%s\",\n"
                     "  \"dtype\": \"%s\"\n"
                     "}\n",
                     c->dim, c->dim, c->ffn_dim, c->n_layers, c->n_heads, c->max_seq, c->vocab_size,
                     c->attention_bias ? "true" : "false", c->tie_embeddings ? "true" : "false", drop, adrop, dn, dn);
    } else if (c->arch == FL_ARCH_T5) {
        char sc[64] = "";
        if (c->head_scale != c->tie_embeddings) /* only transformers 5 writes it; the checkpoints' meaning otherwise */
            snprintf(sc, sizeof sc, "  \"scale_decoder_outputs\": %s,\n", c->head_scale ? "true" : "false");
        w = snprintf(buf, sizeof buf,
                     "{\n"
                     "  \"architectures\": [\"T5ForConditionalGeneration\"],\n"
                     "  \"model_type\": \"t5\",\n"
                     "  \"d_model\": %d,\n"
                     "  \"d_kv\": %d,\n"
                     "  \"d_ff\": %d,\n"
                     "  \"num_layers\": %d,\n"
                     "  \"num_decoder_layers\": %d,\n"
                     "  \"num_heads\": %d,\n"
                     "  \"relative_attention_num_buckets\": %d,\n"
                     "  \"relative_attention_max_distance\": %d,\n"
                     "  \"feed_forward_proj\": \"%s\",\n"
                     "  \"dense_act_fn\": \"%s\",\n"
                     "  \"is_gated_act\": %s,\n"
                     "  \"layer_norm_epsilon\": %s,\n"
                     "  \"vocab_size\": %d,\n"
                     "  \"n_positions\": %d,\n"
                     "  \"tie_word_embeddings\": %s,\n%s"
                     "  \"decoder_start_token_id\": %d,\n"
                     "  \"pad_token_id\": %d,\n"
                     "  \"eos_token_id\": %d,\n"
                     "  \"is_encoder_decoder\": true,\n"
                     "  \"dropout_rate\": %g,\n"
                     "  \"initializer_factor\": 1.0,\n"
                     "  \"use_cache\": true,\n"
                     "  \"torch_dtype\": \"%s\",\n"
                     "  \"dtype\": \"%s\"\n"
                     "}\n",
                     c->dim, c->head_dim, c->ffn_dim, c->n_layers, c->n_dec_layers, c->n_heads, c->rel_buckets,
                     c->rel_max_dist, c->ffn_gated ? "gated-gelu" : "relu", c->ffn_gated ? "gelu_new" : "relu",
                     c->ffn_gated ? "true" : "false", eps, c->vocab_size, c->max_seq,
                     c->tie_embeddings ? "true" : "false", sc, c->dec_start_id, c->pad_id, c->eos_id,
                     (double)c->dropout_rate, dn, dn);
    } else {
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: cannot write a config for architecture %d", path, (int)c->arch);
    }
    if (w < 0 || (size_t)w >= sizeof buf) return fl_errorf(FL_ERR_INTERNAL, "%s: config text too long", path);
    return fl_fs_write_file_atomic(path, buf, (size_t)w);
}

/* the string token starting at text[i] == '"': index just past its closing quote (n if unterminated) */
static size_t fl_hf_str_end(const char *text, size_t n, size_t i) {
    for (i++; i < n && text[i] != '"'; i++)
        if (text[i] == '\\') i++;
    return i < n ? i + 1 : n;
}

static size_t fl_hf_skip_ws(const char *text, size_t n, size_t i) {
    while (i < n && (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r')) i++;
    return i;
}

fl_status fl_hf_config_text_set_dtype(const char *text, size_t n, fl_dtype dt, char **out, size_t *out_n) {
    const char *dn = fl_hf_torch_dtype(dt);
    const size_t dl = strlen(dn);
    /* each value replaced follows a key of 7 bytes at least: at most n / 7 of them, each grown by dl + 2 at most */
    size_t cap = n + (n / 7 + 1) * (dl + 2) + 1, w = 0, i = 0;
    char *o = malloc(cap);
    if (!o) return fl_errorf(FL_ERR_OOM, "config.json: out of host memory");
    while (i < n) {
        if (text[i] != '"') { o[w++] = text[i++]; continue; }
        size_t e = fl_hf_str_end(text, n, i), c = fl_hf_skip_ws(text, n, e), v = c < n ? fl_hf_skip_ws(text, n, c + 1) : n;
        int key = ((e - i == 13 && !memcmp(text + i, "\"torch_dtype\"", 13)) || (e - i == 7 && !memcmp(text + i, "\"dtype\"", 7)))
                  && c < n && text[c] == ':' && v < n && text[v] == '"';
        size_t upto = key ? v : e; /* the key and what follows it up to the value's opening quote, copied */
        memcpy(o + w, text + i, upto - i);
        w += upto - i;
        i = upto;
        if (key) { /* the value: the written dtype's name */
            o[w++] = '"';
            memcpy(o + w, dn, dl);
            w += dl;
            o[w++] = '"';
            i = fl_hf_str_end(text, n, v);
        }
    }
    *out = o;
    *out_n = w;
    return FL_OK;
}
