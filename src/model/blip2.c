/* BLIP-2 (fitllm/blip2.h): its config.json, presets, the three parts' creation and the loader of an HF folder. The
 * passes are src/model/blip2_pass.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blip2-impl.h"
#include "core/fs.h"
#include "fitllm/io.h"
#include "fitllm/json.h"
#include "fitllm/torch_ckpt.h"

/* ---- config.json ------------------------------------------------------------------------------ */

/* A sub-config's integer / number / string key (absent or null: def; path.key named in errors). */
static fl_status cfg_int(const char *path, const fl_json *o, const char *sec, const char *key, int def, int *out) {
    const fl_json *j = o ? fl_json_get(o, key) : NULL;
    if (!j || j->type == FL_JSON_NULL) {
        *out = def;
        return FL_OK;
    }
    if (j->type == FL_JSON_ARRAY && j->child && !strcmp(key, "eos_token_id")) j = j->child; /* a list: its first (the
                                                                  * captioning stops at any: fl_hf_stop_ids) */
    if (j->type != FL_JSON_NUMBER || !j->is_int || j->i < -1 || j->i > (1 << 30))
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s%s' must be a non-negative integer%s", path, sec, key,
                         strcmp(key, "eos_token_id") ? "" : " or a list of them");
    *out = (int)j->i;
    return FL_OK;
}

static fl_status cfg_num(const char *path, const fl_json *o, const char *sec, const char *key, float def, float *out) {
    const fl_json *j = o ? fl_json_get(o, key) : NULL;
    if (!j || j->type == FL_JSON_NULL) {
        *out = def;
        return FL_OK;
    }
    if (j->type != FL_JSON_NUMBER) return fl_errorf(FL_ERR_FORMAT, "%s: key '%s%s' must be a number", path, sec, key);
    *out = (float)j->num;
    return FL_OK;
}

/* a dropout probability in [0, 1) */
static fl_status cfg_rate(const char *path, const fl_json *o, const char *sec, const char *key, float def, float *out) {
    FL_TRY(cfg_num(path, o, sec, key, def, out));
    if (*out < 0 || *out >= 1)
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%s%s' = %g must be in [0, 1)", path, sec, key, (double)*out);
    return FL_OK;
}

static fl_status cfg_bool(const char *path, const fl_json *o, const char *sec, const char *key, int def, int *out) {
    const fl_json *j = o ? fl_json_get(o, key) : NULL;
    *out = def;
    if (!j || j->type == FL_JSON_NULL) return FL_OK;
    if (j->type != FL_JSON_BOOL) return fl_errorf(FL_ERR_FORMAT, "%s: key '%s%s' must be true or false", path, sec, key);
    *out = j->b;
    return FL_OK;
}

/* hidden_act: the exact GELU ("gelu", transformers' default) or the tanh one */
static fl_status cfg_act(const char *path, const fl_json *o, const char *sec, int *exact) {
    const fl_json *j = o ? fl_json_get(o, "hidden_act") : NULL;
    const char *a = j && j->type == FL_JSON_STRING ? j->str : "gelu";
    *exact = strcmp(a, "gelu") == 0;
    if (!*exact && strcmp(a, "gelu_pytorch_tanh") && strcmp(a, "gelu_new"))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key '%shidden_act' = '%s' is not supported (gelu, gelu_pytorch_tanh, "
                         "gelu_new)", path, sec, a);
    return FL_OK;
}

/* The parts' shared fields: transformers' Blip2VisionConfig / Blip2QFormerConfig defaults for absent keys. */
static fl_status part_common(const char *path, const fl_json *o, const char *sec, fl_model_config *c, int dim, int ffn,
                             int layers, int heads, float eps) {
    FL_TRY(cfg_int(path, o, sec, "hidden_size", dim, &c->dim));
    FL_TRY(cfg_int(path, o, sec, "intermediate_size", ffn, &c->ffn_dim));
    FL_TRY(cfg_int(path, o, sec, "num_hidden_layers", layers, &c->n_layers));
    FL_TRY(cfg_int(path, o, sec, "num_attention_heads", heads, &c->n_heads));
    FL_TRY(cfg_num(path, o, sec, "layer_norm_eps", eps, &c->norm_eps));
    if (!(c->norm_eps > 0) || c->norm_eps == INFINITY) /* 0 or below would fall back to a default in validation */
        return fl_errorf(FL_ERR_FORMAT, "%s: key '%slayer_norm_eps' = %g must be a positive finite number", path, sec,
                         (double)c->norm_eps);
    c->vocab_size = 1; /* no token table: the parts read pixels and learned queries */
    return cfg_act(path, o, sec, &c->gelu_exact);
}

/* Fill the parts' derived fields and validate them (errors name the part). */
static fl_status finish_config(const char *src, fl_blip2_config *c) {
    fl_model_config *v = &c->vision, *q = &c->qformer;
    v->arch = FL_ARCH_BLIP2_VISION;
    q->arch = FL_ARCH_BLIP2_QFORMER;
    snprintf(v->name, sizeof v->name, "blip2-vision");
    snprintf(q->name, sizeof q->name, "blip2-qformer");
    const int g = v->patch_size > 0 ? v->image_size / v->patch_size : 0;
    v->max_seq = g * g + 1;
    q->n_queries = q->max_seq = c->n_queries;
    q->proj_dim = c->text.dim;
    if (q->xattn_dim != v->dim)
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'qformer_config.encoder_hidden_size' = %d differs from "
                         "'vision_config.hidden_size' = %d (the Q-Former cross-attends to the image features)", src,
                         q->xattn_dim, v->dim);
    if (c->image_token >= c->text.vocab_size)
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'image_token_index' = %d is outside the language model's vocabulary "
                         "(%d)", src, c->image_token, c->text.vocab_size);
    if (c->text.arch != FL_ARCH_OPT && c->text.arch != FL_ARCH_T5)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: the language model is %s: BLIP-2 has OPT or T5", src,
                         fl_arch_get(c->text.arch)->display);
    fl_status s = fl_config_validate(v);
    if (s != FL_OK) return fl_error_prefix(s, "%s: vision_config", src);
    s = fl_config_validate(q);
    if (s != FL_OK) return fl_error_prefix(s, "%s: qformer_config", src);
    return FL_OK;
}

static fl_status parse_config(const char *path, const fl_json *r, fl_blip2_config *c) {
    memset(c, 0, sizeof *c);
    const fl_json *mt = fl_json_get(r, "model_type");
    if (!mt || mt->type != FL_JSON_STRING || strcmp(mt->str, "blip-2") != 0)
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'model_type' must be 'blip-2' (a Blip2ForConditionalGeneration folder)",
                         path);
    int dec_only = 1, qkv_bias = 1, text_in = 0;
    FL_TRY(cfg_bool(path, r, "", "use_decoder_only_language_model", 1, &dec_only));
    FL_TRY(cfg_int(path, r, "", "num_query_tokens", 32, &c->n_queries));
    FL_TRY(cfg_int(path, r, "", "image_token_index", -1, &c->image_token));
    const fl_json *vj = fl_json_get(r, "vision_config"), *qj = fl_json_get(r, "qformer_config");
    const fl_json *tj = fl_json_get(r, "text_config");
    if (!tj || tj->type != FL_JSON_OBJECT)
        return fl_errorf(FL_ERR_FORMAT, "%s: missing key 'text_config' (the language model's config)", path);
    fl_model_config *v = &c->vision, *q = &c->qformer;
    FL_TRY(part_common(path, vj, "vision_config.", v, 1408, 6144, 39, 16, 1e-6f));
    FL_TRY(cfg_int(path, vj, "vision_config.", "image_size", 224, &v->image_size));
    FL_TRY(cfg_int(path, vj, "vision_config.", "patch_size", 14, &v->patch_size));
    FL_TRY(cfg_bool(path, vj, "vision_config.", "qkv_bias", 1, &qkv_bias));
    if (!qkv_bias)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'vision_config.qkv_bias' = false is not supported", path);
    FL_TRY(part_common(path, qj, "qformer_config.", q, 768, 3072, 12, 12, 1e-12f));
    FL_TRY(cfg_int(path, qj, "qformer_config.", "cross_attention_frequency", 2, &q->xattn_every));
    FL_TRY(cfg_int(path, qj, "qformer_config.", "encoder_hidden_size", 1408, &q->xattn_dim));
    FL_TRY(cfg_bool(path, qj, "qformer_config.", "use_qformer_text_input", 0, &text_in));
    /* dropout (applied in training passes when the fine-tuning turns it on, cfg.dropout_on): transformers' defaults */
    FL_TRY(cfg_rate(path, vj, "vision_config.", "attention_dropout", 0.0f, &v->attn_dropout_rate));
    FL_TRY(cfg_rate(path, qj, "qformer_config.", "hidden_dropout_prob", 0.1f, &q->dropout_rate));
    FL_TRY(cfg_rate(path, qj, "qformer_config.", "attention_probs_dropout_prob", 0.1f, &q->attn_dropout_rate));
    if (text_in)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: key 'qformer_config.use_qformer_text_input' = true (the Q-Former's text "
                         "FFN) is not supported", path);
    fl_status s = fl_hf_config_from_json(path, tj, &c->text);
    if (s != FL_OK) return fl_error_prefix(s, "text_config");
    const int t5 = fl_model_is_s2s(&c->text); /* T5 has no BOS (its source goes as it is), EOS 1 */
    FL_TRY(cfg_int(path, tj, "text_config.", "bos_token_id", t5 ? -1 : 2, &c->bos_id));
    FL_TRY(cfg_int(path, tj, "text_config.", "eos_token_id", t5 ? 1 : 2, &c->eos_id));
    if (dec_only != !fl_model_is_s2s(&c->text))
        return fl_errorf(FL_ERR_FORMAT, "%s: key 'use_decoder_only_language_model' = %s contradicts text_config's %s", path,
                         dec_only ? "true" : "false", fl_arch_get(c->text.arch)->display);
    return finish_config(path, c);
}

fl_status fl_blip2_config_load(const char *path, fl_blip2_config *c) {
    fl_json *root = NULL;
    FL_TRY(fl_json_parse_file(path, &root));
    fl_status s = root->type == FL_JSON_OBJECT ? parse_config(path, root, c)
                                               : fl_errorf(FL_ERR_FORMAT, "%s: top level must be a JSON object", path);
    fl_json_free(root);
    return s;
}

int fl_blip2_is_folder(const char *dir) {
    char path[4096];
    if (fl_fs_join(path, sizeof path, dir, "config.json") != FL_OK || !fl_fs_is_file(path)) return 0;
    fl_json *root = NULL;
    if (fl_json_parse_file(path, &root) != FL_OK) return 0;
    const fl_json *mt = fl_json_get(root, "model_type");
    const int yes = mt && mt->type == FL_JSON_STRING && strcmp(mt->str, "blip-2") == 0;
    fl_json_free(root);
    return yes;
}

/* ---- presets ---------------------------------------------------------------------------------- */

typedef struct {
    const char *name, *alias, *text; /* text: the language model's preset */
    int vdim, vffn, vlayers, vheads, image, patch;
    int qdim, qffn, qlayers, qheads, nq, image_token; /* image_token -1: the vocabulary's last id */
} blip2_preset;

static const blip2_preset presets[] = {
    {"blip2-opt-2.7b", "Salesforce/blip2-opt-2.7b", "opt-2.7b", 1408, 6144, 39, 16, 224, 14, 768, 3072, 12, 12, 32, 50265},
    {"blip2-opt-6.7b", "Salesforce/blip2-opt-6.7b", "opt-6.7b", 1408, 6144, 39, 16, 224, 14, 768, 3072, 12, 12, 32, 50265},
    {"blip2-flan-t5-xl", "Salesforce/blip2-flan-t5-xl", "flan-t5-xl", 1408, 6144, 39, 16, 224, 14, 768, 3072, 12, 12, 32,
     32100},
    {"blip2-flan-t5-xxl", "Salesforce/blip2-flan-t5-xxl", "flan-t5-xxl", 1408, 6144, 39, 16, 224, 14, 768, 3072, 12, 12,
     32, 32100},
    {"blip2-micro", NULL, "opt-micro", 64, 128, 2, 4, 32, 8, 48, 96, 2, 4, 8, -1},
};

fl_status fl_blip2_preset(const char *name, fl_blip2_config *c) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        const blip2_preset *p = &presets[i];
        if (strcmp(name, p->name) && !(p->alias && strcmp(name, p->alias) == 0)) continue;
        memset(c, 0, sizeof *c);
        FL_TRY(fl_preset_find(p->text, &c->text));
        fl_model_config *v = &c->vision, *q = &c->qformer;
        *v = (fl_model_config){.dim = p->vdim, .ffn_dim = p->vffn, .n_layers = p->vlayers, .n_heads = p->vheads,
                               .image_size = p->image, .patch_size = p->patch, .norm_eps = 1e-6f, .vocab_size = 1,
                               .gelu_exact = 1};
        *q = (fl_model_config){.dim = p->qdim, .ffn_dim = p->qffn, .n_layers = p->qlayers, .n_heads = p->qheads,
                               .xattn_every = 2, .xattn_dim = p->vdim, .norm_eps = 1e-12f, .vocab_size = 1,
                               .gelu_exact = 1};
        c->n_queries = p->nq;
        c->bos_id = c->eos_id = 2; /* OPT's; T5: no BOS, EOS 1 */
        if (c->text.arch == FL_ARCH_T5) c->bos_id = -1, c->eos_id = c->text.eos_id;
        c->image_token = p->image_token >= 0 ? p->image_token : c->text.vocab_size - 1;
        return finish_config(name, c);
    }
    return fl_errorf(FL_ERR_NOT_FOUND, "no BLIP-2 preset '%s' (blip2-opt-2.7b, blip2-opt-6.7b, blip2-flan-t5-xl, "
                     "blip2-flan-t5-xxl, blip2-micro)", name);
}

size_t fl_blip2_param_count(const fl_blip2_config *c) {
    return fl_sizing_param_count(&c->vision) + fl_sizing_param_count(&c->qformer) + fl_sizing_param_count(&c->text);
}

/* ---- the parts -------------------------------------------------------------------------------- */

const fl_blip2_config *fl_blip2_get_config(const fl_blip2 *b) { return &b->cfg; }
fl_model *fl_blip2_part(fl_blip2 *b, int part) { return part >= 0 && part < FL_BLIP2_PARTS ? &b->part[part] : NULL; }

void fl_blip2_free(fl_blip2 *b) {
    if (!b) return;
    fl_blip2_free_acts(b);
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (b->part[k].store) fl_model_free(&b->part[k]);
    free(b);
}

fl_status fl_blip2_create(fl_blip2 **out, const fl_blip2_config *c, const fl_backend *be, fl_mem_pool *pool,
                          uint64_t seed) {
    return fl_blip2_create_ex(out, c, be, pool, seed, NULL);
}

fl_status fl_blip2_create_ex(fl_blip2 **out, const fl_blip2_config *c, const fl_backend *be, fl_mem_pool *pool,
                             uint64_t seed, const fl_model_storage *st) {
    *out = NULL;
    fl_blip2 *b = calloc(1, sizeof *b);
    if (!b) return fl_errorf(FL_ERR_OOM, "BLIP-2: out of host memory");
    b->cfg = *c;
    b->be = be;
    b->pool = pool;
    const fl_model_config *pc[FL_BLIP2_PARTS] = {&c->vision, &c->qformer, &c->text};
    static const char *const what[FL_BLIP2_PARTS] = {"vision tower", "Q-Former", "language model"};
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_status s = fl_model_init_ex(&b->part[k], pc[k], be, pool, st ? &st[k] : NULL);
        if (s != FL_OK) {
            fl_blip2_free(b);
            return fl_error_prefix(s, "BLIP-2 %s", what[k]);
        }
        if (seed) fl_model_init_random(&b->part[k], seed + (uint64_t)k);
    }
    *out = b;
    return FL_OK;
}

/* ---- loading ---------------------------------------------------------------------------------- */

typedef struct {
    fl_st_file *files;
    int n;
} st_set;

static const fl_st_tensor *find_tensor(const st_set *f, const char *name) {
    for (int i = 0; i < f->n; i++) {
        const fl_st_tensor *t = fl_st_find(&f->files[i], name);
        if (t) return t;
    }
    return NULL;
}

/* The file's shape against the entry's: leading 1s dropped ((1, 1, C) class token, (1, P, C) positions, (1, NQ, C)
 * queries), a 4-D convolution weight (C, 3, p, p) as its (C, 3 p p) matrix. */
static int shape_ok(const fl_st_tensor *t, const fl_param_info *p) {
    int nd = t->ndim, d0 = 0;
    if (p->ndim == 2 && p->transposed_on_disk) /* stored (d1, d0) on disk (T5's relative bias tables) */
        return nd == 2 && t->shape[0] == p->shape[1] && t->shape[1] == p->shape[0];
    while (nd > p->ndim && t->shape[d0] == 1 && nd > 1) d0++, nd--;
    if (p->ndim == 2 && nd == 4)
        return t->shape[d0] == p->shape[0] && t->shape[d0 + 1] * t->shape[d0 + 2] * t->shape[d0 + 3] == p->shape[1];
    if (nd != p->ndim) return 0;
    for (int d = 0; d < nd; d++)
        if (t->shape[d0 + d] != p->shape[d]) return 0;
    return 1;
}

/* n elements of t from element k0 as float32 into dst (host), refusing a non-finite value by name */
static fl_status read_f32(const fl_st_tensor *t, size_t k0, float *dst, size_t n, const char *file) {
    if (t->dtype != FL_F32 && t->dtype != FL_BF16 && t->dtype != FL_F16 && t->dtype != FL_F64)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: tensor '%s': dtype %s cannot be loaded (F32, BF16, F16)", file, t->name,
                         fl_dtype_name(t->dtype));
    const size_t es = fl_dtype_size(t->dtype);
    void *tmp = malloc(n > 0 ? n * es : 1);
    if (!tmp) return fl_errorf(FL_ERR_OOM, "%s: out of memory loading '%s'", file, t->name);
    memcpy(tmp, (const char *)t->data + k0 * es, n * es); /* the file does not promise alignment */
    long long bad = fl_dtype_first_nonfinite(tmp, t->dtype, n);
    fl_status s = FL_OK;
    if (bad >= 0)
        s = fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' holds a non-finite value (inf/NaN) at element %lld", file, t->name,
                      bad + (long long)k0);
    else if (fl_convert(dst, FL_F32, tmp, t->dtype, n))
        s = fl_errorf(FL_ERR_INTERNAL, "%s: tensor '%s': conversion failed", file, t->name);
    free(tmp);
    return s;
}

/* A tensor in its entry's orientation into the store in fixed slices (16-bit storage: each slice rounded to nearest
 * even on the host, as torch's .to(bfloat16)): no whole-tensor copy */
static fl_status copy_slices(fl_model *m, int i, const fl_st_tensor *t, const char *file) {
    enum { SLICE = 1 << 16 };
    fl_dtype dt;
    size_t k0 = 0, k1 = 0; /* FSDP (a sharded part): this rank's piece of the entry, the only bytes read */
    char *dst = fl_model_param_piece(m, i, &k0, &k1, &dt);
    if (k0 == k1) return FL_OK;
    float *buf = malloc(SLICE * sizeof *buf);
    uint16_t *b16 = malloc(SLICE * sizeof *b16);
    fl_status s = buf && b16 ? FL_OK : fl_errorf(FL_ERR_OOM, "%s: out of memory loading '%s'", file, t->name);
    if (s == FL_OK && !dst) s = fl_errorf(FL_ERR_INTERNAL, "BLIP-2: a dense store expected");
    const size_t es = fl_dtype_size(dt);
    dst -= k0 * es;
    for (size_t k = k0; s == FL_OK && k < k1; k += SLICE) {
        const size_t n = k1 - k < SLICE ? k1 - k : SLICE;
        s = read_f32(t, k, buf, n, file);
        if (s == FL_OK && dt != FL_F32 && fl_convert(b16, dt, buf, FL_F32, n))
            s = fl_errorf(FL_ERR_INTERNAL, "%s: tensor '%s': conversion failed", file, t->name);
        /* parameter offload: the shard is host memory of the tier's backend */
        if (s == FL_OK)
            s = FL_RUN(fl_model_params_be(m), to_device, dst + k * es, dt == FL_F32 ? (void *)buf : (void *)b16, n * es);
    }
    free(buf), free(b16);
    return s;
}

/* A whole entry in host fp32 into the store: fl_model_write_param, or under FSDP this rank's piece of it (16-bit
 * storage rounded to nearest even, as the whole write). */
static fl_status write_piece(fl_model *m, int i, const float *src) {
    if (!fl_model_provider(m)) {
        fl_model_write_param(m, i, src);
        return FL_OK;
    }
    fl_dtype dt;
    size_t k0 = 0, k1 = 0;
    char *dst = fl_model_param_piece(m, i, &k0, &k1, &dt);
    if (k0 == k1) return FL_OK;
    const size_t n = k1 - k0;
    if (dt == FL_F32) return FL_RUN(fl_model_params_be(m), to_device, dst, src + k0, n * sizeof(float));
    uint16_t *b16 = malloc(n * sizeof *b16);
    if (!b16) return fl_errorf(FL_ERR_OOM, "out of host memory");
    fl_status s = fl_convert(b16, dt, src + k0, FL_F32, n) ? fl_errorf(FL_ERR_INTERNAL, "conversion failed")
                                                           : FL_RUN(fl_model_params_be(m), to_device, dst, b16, n * sizeof *b16);
    free(b16);
    return s;
}

/* The vision qkv bias of files written before transformers 5: q_bias and v_bias, the k part zero. */
static fl_status load_split_qkv_bias(const st_set *f, const fl_param_info *p, float *buf, const char *dir) {
    char qn[FL_PARAM_NAME_MAX + 8], vn[FL_PARAM_NAME_MAX + 8];
    const size_t C = (size_t)p->shape[0] / 3, stem = strlen(p->name) - strlen("qkv.bias");
    snprintf(qn, sizeof qn, "%.*sq_bias", (int)stem, p->name);
    snprintf(vn, sizeof vn, "%.*sv_bias", (int)stem, p->name);
    const fl_st_tensor *q = find_tensor(f, qn), *v = find_tensor(f, vn);
    if (!q || !v) return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' (or '%s' and '%s') not found in the model files",
                                   dir, p->name, qn, vn);
    if (q->ndim != 1 || q->shape[0] != (int64_t)C || v->ndim != 1 || v->shape[0] != (int64_t)C)
        return fl_errorf(FL_ERR_FORMAT, "%s: tensors '%s' / '%s' must have shape [%zu]", dir, qn, vn, C);
    memset(buf + C, 0, C * sizeof *buf);
    FL_TRY(read_f32(q, 0, buf, C, dir));
    return read_f32(v, 0, buf + 2 * C, C, dir);
}

/* (r, c) row-major -> (c, r), in place through a copy */
static fl_status transpose(float *a, int64_t r, int64_t c) {
    float *t = malloc((size_t)(r * c) * sizeof *t);
    if (!t) return fl_errorf(FL_ERR_OOM, "out of host memory");
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < c; j++) t[j * r + i] = a[i * c + j];
    memcpy(a, t, (size_t)(r * c) * sizeof *t);
    free(t);
    return FL_OK;
}

/* Every entry of part k from the files (names with prefix), checked by shape. */
static fl_status load_part(fl_model *m, const st_set *f, const char *prefix, const char *dir) {
    const fl_param_layout *lay = &m->layout;
    fl_status s = FL_OK;
    for (int i = 0; i < lay->n && s == FL_OK; i++) {
        const fl_param_info *p = &lay->params[i];
        char name[FL_PARAM_NAME_MAX + 32];
        snprintf(name, sizeof name, "%s%s", prefix, p->name);
        const fl_st_tensor *t = find_tensor(f, name);
        const int split = !t && m->cfg.arch == FL_ARCH_BLIP2_VISION && strstr(name, "qkv.bias") != NULL;
        if (!t && !split) return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' not found in the model files", dir, name);
        if (t && !shape_ok(t, p))
            return fl_errorf(FL_ERR_FORMAT, "%s: tensor '%s' has a shape that does not match config.json (%lld x %lld "
                             "expected)", dir, name, (long long)p->shape[0], (long long)(p->ndim == 2 ? p->shape[1] : 1));
        const int tr = p->ndim == 2 && p->transposed_on_disk;
        if (!split && !tr && !fl_model_param_is_q4(m, i)) { /* the common case, slice by slice */
            s = copy_slices(m, i, t, dir);
            continue;
        }
        float *buf = malloc(p->numel * sizeof *buf); /* a (3C) bias, a relative bias table; QLoRA: a 4-bit weight, whole */
        if (!buf) return fl_errorf(FL_ERR_OOM, "%s: out of memory loading '%s'", dir, name);
        s = split ? load_split_qkv_bias(f, p, buf, dir) : read_f32(t, 0, buf, p->numel, dir);
        if (s == FL_OK && tr) s = transpose(buf, p->shape[1], p->shape[0]);
        if (s == FL_OK) s = write_piece(m, i, buf);
        free(buf);
    }
    return s;
}

static int listed(const char *const *list, const char *name) {
    for (int i = 0; list && list[i]; i++)
        if (strcmp(list[i], name) == 0) return 1;
    return 0;
}

/* A file tensor nobody reads is an error (a config that does not describe the files). */
static fl_status check_unexpected(fl_blip2 *b, const st_set *f, const char *dir) {
    for (int i = 0; i < f->n; i++)
        for (int j = 0; j < f->files[i].n_tensors; j++) {
            const char *n = f->files[i].tensors[j].name;
            if (fl_layout_find(&b->part[0].layout, n) >= 0 || fl_layout_find(&b->part[1].layout, n) >= 0) continue;
            const size_t np = strlen("language_model.");
            const fl_arch_info *ta = fl_arch_get(b->cfg.text.arch);
            if (strncmp(n, "language_model.", np) == 0 &&
                (fl_layout_find(&b->part[2].layout, n + np) >= 0 || listed(ta->hf_embed_aliases, n + np) ||
                 listed(ta->hf_ignored, n + np) || (b->cfg.text.tie_embeddings && strcmp(n + np, "lm_head.weight") == 0)))
                continue;
            const size_t ln = strlen(n);
            if (strncmp(n, "vision_model.", 13) == 0 && ln > 7 &&
                (strcmp(n + ln - 7, ".q_bias") == 0 || strcmp(n + ln - 7, ".v_bias") == 0))
                continue;
            return fl_errorf(FL_ERR_FORMAT, "%s: unexpected tensor '%s' (not a parameter of this BLIP-2 model per "
                             "config.json)", f->files[i].path, n);
        }
    return FL_OK;
}

fl_status fl_blip2_load(fl_blip2 **out, const char *dir, const fl_backend *be, fl_mem_pool *pool) {
    return fl_blip2_load_ex(out, dir, be, pool, NULL);
}

fl_status fl_blip2_load_ex(fl_blip2 **out, const char *dir, const fl_backend *be, fl_mem_pool *pool,
                           const fl_model_storage *st) {
    char path[4096];
    *out = NULL;
    FL_TRY(fl_fs_join(path, sizeof path, dir, "config.json"));
    fl_blip2_config c;
    FL_TRY(fl_blip2_config_load(path, &c));
    st_set f = {0};
    FL_TRY(fl_hf_open_weight_files(dir, &c.text, &f.files, &f.n));
    fl_blip2 *b = NULL;
    fl_status s = fl_blip2_create_ex(&b, &c, be, pool, 0, st);
    if (s == FL_OK) s = check_unexpected(b, &f, dir);
    if (s == FL_OK) s = load_part(&b->part[0], &f, "", dir);
    if (s == FL_OK) s = load_part(&b->part[1], &f, "", dir);
    if (s == FL_OK) s = load_part(&b->part[2], &f, "language_model.", dir);
    fl_hf_close_weight_files(f.files, f.n);
    if (s != FL_OK) {
        fl_blip2_free(b);
        return s;
    }
    *out = b;
    return FL_OK;
}

fl_status fl_blip2_set_precision(fl_blip2 *b, const fl_precision *p) {
    if (p->loss_scaling || p->param_dtype == FL_F16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "--precision %s: BLIP-2 runs 32-true, bf16-true and bf16-mixed so far (no "
                         "fp16 storage or loss scaling)", p->name);
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_model_storage want;
        fl_model_storage_for(p, &want);
        if (fl_model_store_dtype(&b->part[k]) != want.param_dtype)
            return fl_errorf(FL_ERR_INVALID, "--precision %s stores the parameters in %s: create or load the model with "
                             "that storage (fl_blip2_create_ex / fl_blip2_load_ex)", p->name,
                             fl_dtype_name(want.param_dtype));
    }
    if (b->acts) return fl_errorf(FL_ERR_INVALID, "fl_blip2_set_precision: before the activations (fl_blip2_alloc_acts)");
    static const char *const what[FL_BLIP2_PARTS] = {"vision tower", "Q-Former", "language model"};
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        FL_TRY(fl_error_prefix(fl_model_set_precision(&b->part[k], p), "BLIP-2 %s", what[k]));
    return FL_OK;
}

fl_status fl_blip2_alloc_grads(fl_blip2 *b) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++) FL_TRY(fl_model_alloc_grads(&b->part[k]));
    return FL_OK;
}

void fl_blip2_zero_grads(fl_blip2 *b) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++) fl_model_zero_grads(&b->part[k]);
}

fl_status fl_blip2_alloc_grads_parts(fl_blip2 *b, int parts) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (parts & (1 << k)) FL_TRY(fl_model_alloc_grads(&b->part[k]));
    return FL_OK;
}

/* ---- saving ----------------------------------------------------------------------------------- */

typedef struct {
    const fl_model *m;
    int i;
    const void *whole; /* the part's whole parameters in host memory (FSDP: gathered), or NULL: the model's */
} save_src;

static fl_status save_fill(void *ud, float *dst) {
    const save_src *p = ud;
    if (p->whole) {
        const fl_dtype dt = fl_model_store_dtype(p->m);
        const fl_param_info *e = &p->m->layout.params[p->i];
        return fl_convert(dst, FL_F32, (const char *)p->whole + e->offset * fl_dtype_size(dt), dt, e->numel)
                   ? fl_errorf(FL_ERR_INTERNAL, "saving BLIP-2: converting '%s'", e->name)
                   : FL_OK;
    }
    fl_model_read_param(p->m, p->i, dst); /* LoRA-merged after fl_model_lora_merge */
    return FL_OK;
}

/* A small file of src_dir copied to dst_dir (absent: nothing). */
static fl_status copy_small(const char *src_dir, const char *dst_dir, const char *name) {
    char a[4096], d[4096];
    FL_TRY(fl_fs_join(a, sizeof a, src_dir, name));
    FL_TRY(fl_fs_join(d, sizeof d, dst_dir, name));
    if (!fl_fs_is_file(a)) return FL_OK;
    char *buf = NULL;
    size_t n = 0;
    FL_TRY(fl_fs_read_file(a, (size_t)64 << 20, &buf, &n));
    fl_status s = fl_fs_write_file_atomic(d, buf, n);
    free(buf);
    return s;
}

fl_status fl_blip2_save(const fl_blip2 *b, const char *src_dir, const char *dst_dir) {
    return fl_blip2_save_whole(b, src_dir, dst_dir, NULL);
}

fl_status fl_blip2_save_whole(const fl_blip2 *b, const char *src_dir, const char *dst_dir,
                              const void *const whole[FL_BLIP2_PARTS]) {
    FL_TRY(fl_fs_mkdir_p(dst_dir));
    st_set f = {0};
    FL_TRY(fl_hf_open_weight_files(src_dir, &b->cfg.text, &f.files, &f.n));
    const int n = b->part[0].layout.n + b->part[1].layout.n + b->part[2].layout.n;
    fl_st_write_tensor *t = calloc((size_t)n + 1, sizeof *t);
    save_src *src = calloc((size_t)n + 1, sizeof *src);
    char(*names)[FL_PARAM_NAME_MAX + 32] = calloc((size_t)n + 1, sizeof *names);
    fl_status s = t && src && names ? FL_OK : fl_errorf(FL_ERR_OOM, "saving BLIP-2: out of host memory");
    int nt = 0;
    for (int k = 0; s == FL_OK && k < FL_BLIP2_PARTS; k++) {
        const fl_model *m = &b->part[k];
        for (int i = 0; i < m->layout.n; i++, nt++) {
            const fl_param_info *p = &m->layout.params[i];
            snprintf(names[nt], sizeof names[0], "%s%s", k == FL_BLIP2_TEXT ? "language_model." : "", p->name);
            fl_st_write_tensor *e = &t[nt];
            e->name = names[nt];
            e->dtype = e->src_dtype = FL_F32;
            fl_hf_tensor_shape(p, e);
            /* the file's own shape where the source holds it ((1, 1, C) class token, the 4-D convolution weight) */
            const fl_st_tensor *o = find_tensor(&f, names[nt]);
            size_t on = 1;
            for (int d = 0; o && d < o->ndim; d++) on *= (size_t)o->shape[d];
            if (o && on == p->numel && !e->transpose2d && o->ndim <= 8) {
                e->ndim = o->ndim;
                for (int d = 0; d < o->ndim; d++) e->shape[d] = o->shape[d];
            }
            src[nt] = (save_src){m, i, whole ? whole[k] : NULL};
            e->fill = save_fill;
            e->fill_ud = &src[nt];
        }
    }
    fl_hf_close_weight_files(f.files, f.n);
    char path[4096];
    if (s == FL_OK) s = fl_fs_join(path, sizeof path, dst_dir, "model.safetensors");
    const char *mk[] = {"format"}, *mv[] = {"pt"};
    if (s == FL_OK) s = fl_st_write(path, t, nt, mk, mv, 1);
    free(t), free(src), free(names);
    static const char *const small[] = {"config.json", "preprocessor_config.json", "generation_config.json",
                                        "processor_config.json"};
    for (size_t i = 0; s == FL_OK && i < sizeof small / sizeof small[0]; i++) s = copy_small(src_dir, dst_dir, small[i]);
    int nc = 0;
    if (s == FL_OK && fl_io_has_tokenizer(src_dir)) s = fl_io_copy_tokenizer_files(src_dir, dst_dir, &nc);
    return s == FL_OK ? FL_OK : fl_error_prefix(s, "saving BLIP-2 to %s", dst_dir);
}

/* ---- PEFT adapters ---------------------------------------------------------------------------- */

fl_status fl_blip2_merge_peft(fl_blip2 *b, const fl_peft_adapter *a) {
    static const char lm[] = "language_model.";
    for (int j = 0; j < a->n; j++) {
        const fl_peft_module *md = &a->mods[j];
        const int text = !strncmp(md->name, lm, sizeof lm - 1);
        char w[FL_PARAM_NAME_MAX + 8];
        snprintf(w, sizeof w, "%s.weight", text ? md->name + sizeof lm - 1 : md->name);
        fl_model *m = NULL;
        int i = -1;
        for (int k = 0; k < FL_BLIP2_PARTS && i < 0; k++) /* the language model's under its prefix, else the image parts' */
            if ((k == FL_BLIP2_TEXT) == text && (i = fl_layout_find(&b->part[k].layout, w)) >= 0) m = &b->part[k];
        if (i < 0)
            return fl_errorf(FL_ERR_INVALID, "LoRA module '%s' is not a linear layer of this BLIP-2 model (the language "
                             "model's are named language_model.<module>, as PEFT names them on "
                             "Blip2ForConditionalGeneration)", md->name);
        const fl_param_info *p = &m->layout.params[i];
        if (p->ndim != 2 || p->shape[0] != md->out || p->shape[1] != md->in)
            return fl_errorf(FL_ERR_INVALID, "LoRA module '%s' is %d x %d, the model's %s %lld x %lld", md->name,
                             md->out, md->in, w, (long long)p->shape[0], (long long)(p->ndim == 2 ? p->shape[1] : 1));
        const size_t n = (size_t)md->out * md->in;
        float *tmp = malloc(n * sizeof *tmp);
        if (!tmp) return fl_errorf(FL_ERR_OOM, "merging the LoRA adapter: out of host memory");
        if (md->W) memcpy(tmp, md->W, n * sizeof *tmp); /* PEFT's saved base layer replaces the weight */
        else fl_model_read_param(m, i, tmp);
        fl_lora_merge(tmp, md->in, md->A, md->B, fl_peft_module_r(a, md), md->in, md->out, fl_peft_module_scaling(a, md));
        fl_model_write_param(m, i, tmp);
        free(tmp);
    }
    return FL_OK;
}

/* ---- live memory (docs/ARCHITECTURE.md "Reserved and live memory") ------------------------------- */

/* The bytes a view carved at p holds up to the view carved after it (q): fl_carve's share of the arena. */
static size_t carved(const void *p, const void *q) { return p && q ? (size_t)((const char *)q - (const char *)p) : 0; }

/* The arena's ACTS the backward reads after a training forward: each part's saved activations (0 for a lean part;
 * under checkpointing the shared block slots, recomputed, are not), less the OPT language model's final norm output
 * (only its head reads it, and the head's backward ran in the forward), plus a lean vision tower's output (the image
 * features) when the Q-Former trains: its cross-attention's backward reads them. */
static size_t acts_live(const fl_blip2 *b, int here) {
    size_t n = 0;
    for (int k = 0; k < here; k++) n += b->acts_saved[k];
    if (here == 3 && !b->lean[2]) n -= carved(b->st[2].nout, b->st[2].nmean);
    if (b->lean[0] && !b->lean[1]) n += carved(b->st[0].nout, b->st[0].nmean);
    return n;
}

int fl_blip2_live(const fl_blip2 *b, fl_live_phase phase, fl_live_region *out) {
    int n = 0;
    const int s2s = fl_model_is_s2s(&b->cfg.text), here = s2s ? 2 : 3;
    const int train = phase == FL_LIVE_FORWARD && b->fwd_train, passes = phase == FL_LIVE_FORWARD || phase == FL_LIVE_BACKWARD;
    if (s2s) n += fl_model_live(&b->part[2], phase, out); /* the Flan-T5 language model: its own arena, as a T5's */
    if (b->acts && passes) {
        const fl_model *lm = &b->part[2];
        const size_t N = (size_t)b->Bp * (size_t)b->st[2].T;
        /* WORKSPACE: the OPT head's d(final norm out) and, when the embeddings train, the ids their backward reads */
        const size_t hand = train && !s2s ? N * (size_t)lm->cfg.dim * sizeof(float) +
                                                (fl_model_grads_data(lm) ? N * sizeof(int32_t) : 0) : 0;
        out[n++] = (fl_live_region){b->acts, train ? acts_live(b, here) : 0, 0};
        out[n++] = (fl_live_region){b->work, hand, 0};
    }
    for (int k = 0; k < here; k++) {
        const fl_model *m = &b->part[k];
        const void *lbuf = NULL;
        /* LoRA adapters' activations: the rows fl_model_adapter_live_rows gives for the part's last forward */
        const size_t lb = passes && m->adapt && m->adapt->h.live_acts ? m->adapt->h.live_acts(m, train, &lbuf) : 0;
        if (lbuf) out[n++] = (fl_live_region){lbuf, lb, 0};
        void *g = fl_model_grads_buffer(m);
        if (!g) continue;
        if (phase == FL_LIVE_ZEROED || phase == FL_LIVE_UPDATED) { /* zeros, or consumed */
            out[n++] = (fl_live_region){g, 0, 0};
        } else if (phase == FL_LIVE_BACKWARD) {
            out[n++] = (fl_live_region){g, SIZE_MAX, 0}; /* every gradient of a part that trains holds the sum */
        } else if (train && k == FL_BLIP2_TEXT && !fl_model_provider(m)) { /* the head's, written in the forward */
            fl_outer_params op;
            fl_get_outer(m, &op);
            const size_t hg = m->adapt ? m->adapt->h.head_grad_bytes
                              : op.dhead ? (size_t)m->cfg.vocab_size * m->cfg.dim *
                                               (fl_model_grads_16(m) ? sizeof(uint16_t) : sizeof(float)) : 0;
            out[n++] = (fl_live_region){g, hg, 1};
        }
    }
    return n;
}
