/* Parameter layout: which HF tensor lives where in the flat buffer, plus the
 * config validation and parameter count that the planner shares. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/model.h"

/* Every bad field is named, in one message (FL_ERR_FORMAT's, "model config: a; b"): the independent checks all run,
 * those that need a field checked before it (the head split needs hidden_size and the heads) when that one passed. */
fl_status fl_config_validate(fl_model_config *c) {
    fl_errlist bad = {0};
#define NEED_POS(field, key) \
    if (c->field <= 0) fl_errlist_add(&bad, FL_ERR_FORMAT, "'%s' must be positive (got %d)", key, c->field)
    if (c->arch < 0 || c->arch >= FL_ARCH_COUNT) return fl_errorf(FL_ERR_UNSUPPORTED, "model config: unknown architecture %d", (int)c->arch);
    NEED_POS(vocab_size, "vocab_size");
    NEED_POS(dim, "hidden_size");
    if (c->pp_enc <= 0 || c->n_layers < 0) NEED_POS(n_layers, "num_hidden_layers"); /* an encoder-decoder's pipeline
                                                                                        * stage may hold decoder blocks only */
    NEED_POS(n_heads, "num_attention_heads");
    const fl_arch_info *ai = fl_arch_get(c->arch);
    if (c->n_heads > 0) {
        if (c->n_kv_heads <= 0) c->n_kv_heads = c->n_heads;
        if (c->head_dim <= 0 && c->dim > 0 && c->dim % c->n_heads)
            fl_errlist_add(&bad, FL_ERR_FORMAT, "hidden_size %d is not divisible by num_attention_heads %d", c->dim,
                           c->n_heads);
        else if (c->head_dim <= 0 && c->dim > 0)
            c->head_dim = c->dim / c->n_heads;
        if (c->n_heads % c->n_kv_heads)
            fl_errlist_add(&bad, FL_ERR_FORMAT, "num_attention_heads %d is not a multiple of num_key_value_heads %d",
                           c->n_heads, c->n_kv_heads);
        if (c->head_dim > 0 && c->head_dim % 2 && ai->rope)
            fl_errlist_add(&bad, FL_ERR_FORMAT, "head_dim %d must be even for RoPE", c->head_dim);
    }
    if (c->ffn_dim <= 0) c->ffn_dim = ai->ffn_mult * c->dim;
    if (c->dim > 0) NEED_POS(ffn_dim, "intermediate_size");
    NEED_POS(max_seq, "max_position_embeddings");
    if (!(c->norm_eps > 0)) c->norm_eps = 1e-5f;
    if (ai->rope && !(c->rope_theta > 0)) c->rope_theta = 10000.0f;
    if (c->rope_scaling.type != FL_ROPE_NONE && !(c->rope_scaling.factor > 0))
        fl_errlist_add(&bad, FL_ERR_FORMAT, "rope_scaling.factor must be positive");
    /* sanity limits, far above any real model (405B: 126 layers, 16384 wide, 53248 MLP, 128256
     * tokens): past them a config is corrupt, and building its layout would run for minutes */
#define LIMIT(field, key, max) \
    if (c->field > (max)) \
        fl_errlist_add(&bad, FL_ERR_FORMAT, "'%s' = %d is beyond any real model (at most %d here)", key, c->field, (max))
    LIMIT(n_layers, "num_hidden_layers", 1 << 14);
    LIMIT(dim, "hidden_size", 1 << 18);
    LIMIT(ffn_dim, "intermediate_size", 1 << 20);
    LIMIT(n_heads, "num_attention_heads", 1 << 14);
    LIMIT(head_dim, "head_dim", 1 << 14);
    LIMIT(vocab_size, "vocab_size", 1 << 24);
    LIMIT(max_seq, "max_position_embeddings", 1 << 26);
#undef LIMIT
#undef NEED_POS
    if (bad.n) return fl_error_prefix(fl_errlist_fail(&bad), "model config");
    if (ai->check) FL_TRY(ai->check(c));
    return FL_OK;
}

struct fl_layout_builder {
    fl_param_layout *lay;
    int cap;
    size_t off;
    int group;
};

int fl_layout_add(fl_layout_builder *b, fl_param_role role, int64_t d0, int64_t d1, int transposed, const char *fmt,
                  ...) {
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
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->name, sizeof e->name, fmt, ap);
    va_end(ap);
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

void fl_layout_group(fl_layout_builder *b, int g) {
    b->lay->group_offset[g] = b->off;
    b->group = g;
}

fl_status fl_layout_build(fl_param_layout *lay, const fl_model_config *c) {
    memset(lay, 0, sizeof *lay);
    const fl_arch_info *ai = fl_arch_get(c->arch);
    if (!ai) return fl_errorf(FL_ERR_UNSUPPORTED, "layout: unknown architecture %d", (int)c->arch);
    fl_layout_builder b = {lay, 0, 0, 0};
    const int L = c->n_layers + c->n_dec_layers; /* every stack's blocks (an encoder-decoder has two) */
    lay->n_groups = L + 2;
    lay->group_offset = calloc((size_t)lay->n_groups + 1, sizeof(size_t));
    if (!lay->group_offset) return fl_errorf(FL_ERR_OOM, "layout: out of host memory");
    int err = ai->layout(&b, c); /* its entries in flat order: the embeddings, each block, the final norm and head */
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
    /* files may omit an architecture's optional prefix (GPT-2's "transformer.") */
    const char *pre = NULL;
    for (int a = 0; a < FL_ARCH_COUNT && !pre; a++) {
        const char *p = fl_arch_get((fl_arch)a)->hf_prefix;
        if (p && lay->n > 0 && !strncmp(lay->params[0].name, p, strlen(p))) pre = p;
    }
    if (pre && strncmp(name, pre, strlen(pre)) != 0) {
        for (int i = 0; i < lay->n; i++)
            if (strncmp(lay->params[i].name, pre, strlen(pre)) == 0 && strcmp(lay->params[i].name + strlen(pre), name) == 0)
                return i;
    }
    return -1;
}

/* Sizes derived from the layout itself (no per-architecture formula): the config's layout is built
 * (names and offsets only, tens of microseconds for the largest models) and measured. */
typedef struct {
    size_t numel, outer_1d, block_1d, max_group;
} layout_sums;

static int layout_sums_of(const fl_model_config *cin, layout_sums *o) {
    memset(o, 0, sizeof *o);
    fl_model_config c = *cin;
    fl_param_layout lay;
    if (fl_config_validate(&c) != FL_OK || fl_layout_build(&lay, &c) != FL_OK) return -1;
    const int L = lay.n_groups - 2;
    size_t *one_d = calloc((size_t)lay.n_groups, sizeof *one_d);
    if (!one_d) { fl_layout_free(&lay); return -1; }
    for (int i = 0; i < lay.n; i++)
        if (lay.params[i].ndim == 1) one_d[lay.params[i].group] += lay.params[i].numel;
    o->numel = lay.numel;
    o->outer_1d = one_d[L + 1];
    for (int g = 1; g <= L; g++)
        if (one_d[g] > o->block_1d) o->block_1d = one_d[g];
    for (int g = 0; g < lay.n_groups; g++) {
        size_t n = lay.group_offset[g + 1] - lay.group_offset[g];
        if (n > o->max_group) o->max_group = n;
    }
    free(one_d);
    fl_layout_free(&lay);
    return 0;
}

size_t fl_sizing_param_count(const fl_model_config *c) {
    layout_sums s;
    return layout_sums_of(c, &s) ? 0 : s.numel;
}

/* 16-bit storage staging (see fl_model in model.h). pstage: the 1-D parameters of the final norm
 * and head's group, one row of C for the embedding, and the 1-D parameters of one block. gstage:
 * the largest group (a block, the embeddings or the head; a tied head's gradient is the embedding's). */
size_t fl_sizing_pstage_elems(const fl_model_config *c) {
    layout_sums s;
    return layout_sums_of(c, &s) ? 0 : s.outer_1d + (size_t)c->dim + s.block_1d;
}

size_t fl_sizing_gstage_elems(const fl_model_config *c) {
    layout_sums s;
    return layout_sums_of(c, &s) ? 0 : s.max_group;
}
