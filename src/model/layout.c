/* Parameter layout: which HF tensor lives where in the flat buffer, plus the
 * config validation and parameter count that the planner shares. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/model.h"

fl_status fl_config_validate(fl_model_config *c) {
#define NEED_POS(field, key)                                                                        \
    if (c->field <= 0) return fl_errorf(FL_ERR_FORMAT, "model config: '%s' must be positive (got %d)", key, c->field)
    if (c->arch < 0 || c->arch >= FL_ARCH_COUNT) return fl_errorf(FL_ERR_UNSUPPORTED, "model config: unknown architecture %d", (int)c->arch);
    NEED_POS(vocab_size, "vocab_size");
    NEED_POS(dim, "hidden_size");
    NEED_POS(n_layers, "num_hidden_layers");
    NEED_POS(n_heads, "num_attention_heads");
    if (c->n_kv_heads <= 0) c->n_kv_heads = c->n_heads;
    if (c->head_dim <= 0) {
        if (c->dim % c->n_heads)
            return fl_errorf(FL_ERR_FORMAT, "model config: hidden_size %d is not divisible by num_attention_heads %d",
                             c->dim, c->n_heads);
        c->head_dim = c->dim / c->n_heads;
    }
    if (c->n_heads % c->n_kv_heads)
        return fl_errorf(FL_ERR_FORMAT,
                         "model config: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                         c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 && c->arch == FL_ARCH_LLAMA)
        return fl_errorf(FL_ERR_FORMAT, "model config: head_dim %d must be even for RoPE", c->head_dim);
    if (c->ffn_dim <= 0) c->ffn_dim = c->arch == FL_ARCH_GPT2 ? 4 * c->dim : 0;
    NEED_POS(ffn_dim, "intermediate_size");
    NEED_POS(max_seq, "max_position_embeddings");
    if (!(c->norm_eps > 0)) c->norm_eps = 1e-5f;
    if (c->arch == FL_ARCH_LLAMA && !(c->rope_theta > 0)) c->rope_theta = 10000.0f;
    if (c->arch == FL_ARCH_GPT2) {
        c->attention_bias = 1;
        c->mlp_bias = 1;
        c->n_kv_heads = c->n_heads;
        if (c->head_dim * c->n_heads != c->dim)
            return fl_errorf(FL_ERR_FORMAT, "model config: GPT-2 needs n_embd %d divisible by n_head %d", c->dim,
                             c->n_heads);
    }
    if (c->rope_scaling.type != FL_ROPE_NONE && !(c->rope_scaling.factor > 0))
        return fl_errorf(FL_ERR_FORMAT, "model config: rope_scaling.factor must be positive");
    /* sanity limits, far above any real model (405B: 126 layers, 16384 wide, 53248 MLP, 128256
     * tokens): past them a config is corrupt, and building its layout would run for minutes */
#define LIMIT(field, key, max)                                                                               \
    if (c->field > (max))                                                                                     \
        return fl_errorf(FL_ERR_FORMAT, "model config: '%s' = %d is beyond any real model (at most %d here)", key, \
                         c->field, (max))
    LIMIT(n_layers, "num_hidden_layers", 1 << 14);
    LIMIT(dim, "hidden_size", 1 << 18);
    LIMIT(ffn_dim, "intermediate_size", 1 << 20);
    LIMIT(n_heads, "num_attention_heads", 1 << 14);
    LIMIT(head_dim, "head_dim", 1 << 14);
    LIMIT(vocab_size, "vocab_size", 1 << 24);
    LIMIT(max_seq, "max_position_embeddings", 1 << 26);
#undef LIMIT
    return FL_OK;
#undef NEED_POS
}

typedef struct {
    fl_param_layout *lay;
    int cap;
    size_t off;
    int group;
} builder;

static int add(builder *b, fl_param_role role, const char *name, int64_t d0, int64_t d1, int transposed) {
    fl_param_layout *lay = b->lay;
    if (lay->n == b->cap) {
        int nc = b->cap ? b->cap * 2 : 64;
        fl_param_info *p = realloc(lay->params, (size_t)nc * sizeof *p);
        if (!p) return -1;
        lay->params = p;
        b->cap = nc;
    }
    fl_param_info *e = &lay->params[lay->n++];
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", name);
    e->ndim = d1 > 0 ? 2 : 1;
    e->shape[0] = d0;
    e->shape[1] = d1 > 0 ? d1 : 0;
    e->numel = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    e->offset = b->off;
    e->group = b->group;
    e->transposed_on_disk = transposed;
    e->role = role;
    b->off += e->numel;
    return 0;
}

fl_status fl_layout_build(fl_param_layout *lay, const fl_model_config *c) {
    memset(lay, 0, sizeof *lay);
    builder b = {lay, 0, 0, 0};
    const int C = c->dim, L = c->n_layers, V = c->vocab_size, F = c->ffn_dim;
    const int QD = c->n_heads * c->head_dim, KVD = c->n_kv_heads * c->head_dim;
    char nm[FL_PARAM_NAME_MAX];
    int err = 0;
    lay->n_groups = L + 2;
    lay->group_offset = calloc((size_t)lay->n_groups + 1, sizeof(size_t));
    if (!lay->group_offset) return fl_errorf(FL_ERR_OOM, "layout: out of host memory");
#define P(role, d0, d1, tr, ...) (snprintf(nm, sizeof nm, __VA_ARGS__), err |= add(&b, FL_ROLE_##role, nm, d0, d1, tr))
    if (c->arch == FL_ARCH_LLAMA) {
        P(EMBED, V, C, 0, "model.embed_tokens.weight");
        for (int l = 0; l < L; l++) {
            lay->group_offset[l + 1] = b.off;
            b.group = l + 1;
            P(LN1_W, C, 0, 0, "model.layers.%d.input_layernorm.weight", l);
            /* q, k, v consecutive: together the fused (QD+2KVD, C) matrix. */
            P(QKV_W, QD, C, 0, "model.layers.%d.self_attn.q_proj.weight", l);
            P(NONE, KVD, C, 0, "model.layers.%d.self_attn.k_proj.weight", l);
            P(NONE, KVD, C, 0, "model.layers.%d.self_attn.v_proj.weight", l);
            if (c->attention_bias) {
                P(QKV_B, QD, 0, 0, "model.layers.%d.self_attn.q_proj.bias", l);
                P(NONE, KVD, 0, 0, "model.layers.%d.self_attn.k_proj.bias", l);
                P(NONE, KVD, 0, 0, "model.layers.%d.self_attn.v_proj.bias", l);
            }
            P(O_W, C, QD, 0, "model.layers.%d.self_attn.o_proj.weight", l);
            if (c->attention_bias) P(O_B, C, 0, 0, "model.layers.%d.self_attn.o_proj.bias", l);
            P(LN2_W, C, 0, 0, "model.layers.%d.post_attention_layernorm.weight", l);
            /* gate then up: the fused (2F, C) matrix. */
            P(FC_W, F, C, 0, "model.layers.%d.mlp.gate_proj.weight", l);
            P(NONE, F, C, 0, "model.layers.%d.mlp.up_proj.weight", l);
            if (c->mlp_bias) {
                P(FC_B, F, 0, 0, "model.layers.%d.mlp.gate_proj.bias", l);
                P(NONE, F, 0, 0, "model.layers.%d.mlp.up_proj.bias", l);
            }
            P(PROJ_W, C, F, 0, "model.layers.%d.mlp.down_proj.weight", l);
            if (c->mlp_bias) P(PROJ_B, C, 0, 0, "model.layers.%d.mlp.down_proj.bias", l);
        }
        lay->group_offset[L + 1] = b.off;
        b.group = L + 1;
        P(NORM_F_W, C, 0, 0, "model.norm.weight");
        if (!c->tie_embeddings) P(HEAD, V, C, 0, "lm_head.weight");
    } else {
        P(EMBED, V, C, 0, "transformer.wte.weight");
        P(POS_EMBED, c->max_seq, C, 0, "transformer.wpe.weight");
        for (int l = 0; l < L; l++) {
            lay->group_offset[l + 1] = b.off;
            b.group = l + 1;
            P(LN1_W, C, 0, 0, "transformer.h.%d.ln_1.weight", l);
            P(LN1_B, C, 0, 0, "transformer.h.%d.ln_1.bias", l);
            P(QKV_W, 3 * C, C, 1, "transformer.h.%d.attn.c_attn.weight", l);
            P(QKV_B, 3 * C, 0, 0, "transformer.h.%d.attn.c_attn.bias", l);
            P(O_W, C, C, 1, "transformer.h.%d.attn.c_proj.weight", l);
            P(O_B, C, 0, 0, "transformer.h.%d.attn.c_proj.bias", l);
            P(LN2_W, C, 0, 0, "transformer.h.%d.ln_2.weight", l);
            P(LN2_B, C, 0, 0, "transformer.h.%d.ln_2.bias", l);
            P(FC_W, F, C, 1, "transformer.h.%d.mlp.c_fc.weight", l);
            P(FC_B, F, 0, 0, "transformer.h.%d.mlp.c_fc.bias", l);
            P(PROJ_W, C, F, 1, "transformer.h.%d.mlp.c_proj.weight", l);
            P(PROJ_B, C, 0, 0, "transformer.h.%d.mlp.c_proj.bias", l);
        }
        lay->group_offset[L + 1] = b.off;
        b.group = L + 1;
        P(NORM_F_W, C, 0, 0, "transformer.ln_f.weight");
        P(NORM_F_B, C, 0, 0, "transformer.ln_f.bias");
        if (!c->tie_embeddings) P(HEAD, V, C, 0, "lm_head.weight");
    }
#undef P
    lay->group_offset[L + 2] = b.off;
    lay->numel = b.off;
    lay->role_index = err ? NULL : malloc((size_t)lay->n_groups * FL_ROLE_COUNT * sizeof(int));
    if (!lay->role_index) err = 1;
    else {
        for (int i = 0; i < lay->n_groups * FL_ROLE_COUNT; i++) lay->role_index[i] = -1;
        for (int i = 0; i < lay->n; i++)
            if (lay->params[i].role != FL_ROLE_NONE)
                lay->role_index[lay->params[i].group * FL_ROLE_COUNT + lay->params[i].role] = i;
    }
    if (err) {
        fl_layout_free(lay);
        return fl_errorf(FL_ERR_OOM, "layout: out of host memory");
    }
    return FL_OK;
}

void fl_layout_free(fl_param_layout *lay) {
    free(lay->params);
    free(lay->role_index);
    free(lay->group_offset);
    memset(lay, 0, sizeof *lay);
}

int fl_layout_find(const fl_param_layout *lay, const char *name) {
    for (int i = 0; i < lay->n; i++)
        if (strcmp(lay->params[i].name, name) == 0) return i;
    /* GPT-2 files may omit the "transformer." prefix. */
    static const char pre[] = "transformer.";
    if (strncmp(name, pre, sizeof pre - 1) != 0) {
        for (int i = 0; i < lay->n; i++)
            if (strncmp(lay->params[i].name, pre, sizeof pre - 1) == 0 &&
                strcmp(lay->params[i].name + sizeof pre - 1, name) == 0)
                return i;
    }
    return -1;
}

size_t fl_sizing_param_count(const fl_model_config *c) {
    size_t C = c->dim, V = c->vocab_size, F = c->ffn_dim, L = c->n_layers;
    size_t QD = (size_t)c->n_heads * c->head_dim, KVD = (size_t)c->n_kv_heads * c->head_dim;
    size_t n = V * C, blk;
    if (c->arch == FL_ARCH_LLAMA) {
        blk = 2 * C + (QD + 2 * KVD) * C + C * QD + 3 * F * C;
        if (c->attention_bias) blk += QD + 2 * KVD + C;
        if (c->mlp_bias) blk += 2 * F + C;
        n += L * blk + C;
    } else {
        n += (size_t)c->max_seq * C;
        blk = 4 * C + 3 * C * C + 3 * C + C * C + C + 2 * F * C + F + C;
        n += L * blk + 2 * C;
    }
    if (!c->tie_embeddings) n += V * C;
    return n;
}

/* 16-bit storage staging (see fl_model in model.h). pstage: the 1-D parameters
 * of the embeddings/head groups, one row of C for the embedding, and the 1-D
 * parameters of one block. gstage: the largest group (a block, the embeddings
 * or the head; a tied head's gradient is the embedding's). */
static size_t block_1d(const fl_model_config *c) {
    size_t C = c->dim, F = c->ffn_dim, QKV = (size_t)(c->n_heads + 2 * c->n_kv_heads) * c->head_dim;
    if (c->arch == FL_ARCH_GPT2) return 4 * C + QKV + C + F + C;
    size_t n = 2 * C;
    if (c->attention_bias) n += QKV + C;
    if (c->mlp_bias) n += 2 * (size_t)F + C;
    return n;
}

size_t fl_sizing_pstage_elems(const fl_model_config *c) {
    size_t C = c->dim;
    return (c->arch == FL_ARCH_GPT2 ? 2 * C : C) + C + block_1d(c);
}

size_t fl_sizing_gstage_elems(const fl_model_config *c) {
    size_t C = c->dim, V = c->vocab_size, L = c->n_layers;
    size_t outer_1d = c->arch == FL_ARCH_GPT2 ? 2 * C : C;
    size_t g0 = V * C + (c->arch == FL_ARCH_GPT2 ? (size_t)c->max_seq * C : 0);
    size_t head = outer_1d + (c->tie_embeddings ? 0 : V * C);
    size_t blk = L ? (fl_sizing_param_count(c) - g0 - head) / L : 0;
    size_t n = blk > g0 ? blk : g0;
    return head > n ? head : n;
}
