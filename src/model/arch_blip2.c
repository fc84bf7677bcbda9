/* BLIP-2's two new parts as architectures (transformers' Blip2VisionModel and Blip2QFormerModel; the composite that
 * joins them to the language model is src/model/blip2.c):
 *
 *   vision tower  PATCH (the patch-embedding convolution as a (C, 3 p p) matrix over each patch's pixels, the class
 *                 token in front, the learned positions added), pre-LayerNorm blocks (bidirectional attention over the
 *                 fused qkv with one (3C) bias, as transformers 5 stores it; projection; fc1, GELU, fc2), the final
 *                 post_layernorm
 *   Q-Former      QUERIES (the learned query tokens) and their LayerNorm, BERT-style post-LayerNorm blocks: self-
 *                 attention over the queries, in blocks 0, f, 2f, ... (f = cross_attention_frequency) a cross-attention
 *                 to the image features (an XSTREAM of B x (patches + 1) rows, encoder_hidden_size wide), the query FFN
 *                 (intermediate_query, output_query); the language projection lives in its last group
 *
 * Names are the checkpoint's (vision_model., query_tokens, qformer., language_projection.). hidden_act: the exact
 * GELU ("gelu", transformers' default and the checkpoints': FL_GOP_GELU_ERF, cfg.gelu_exact) or the tanh one
 * ("gelu_pytorch_tanh", "gelu_new"). */
#include "model-impl.h"

static const char *const vis_targets[] = {"qkv", "projection", "fc1", "fc2", NULL};
static const char *const qf_targets[] = {"query", "key", "value", "dense", NULL};

static fl_status vis_check(fl_model_config *c) {
    c->n_kv_heads = c->n_heads;
    c->attention_bias = c->mlp_bias = 1;
    c->tie_embeddings = 0;
    if (c->head_dim * c->n_heads != c->dim)
        return fl_errorf(FL_ERR_FORMAT, "vision_config: hidden_size %d is not divisible by num_attention_heads %d", c->dim,
                         c->n_heads);
    if (c->patch_size <= 0 || c->image_size < c->patch_size)
        return fl_errorf(FL_ERR_FORMAT, "vision_config: 'patch_size' %d must be positive and at most 'image_size' %d",
                         c->patch_size, c->image_size);
    const int g = c->image_size / c->patch_size;
    if (c->max_seq != g * g + 1)
        return fl_errorf(FL_ERR_FORMAT, "vision_config: %d positions, but image_size %d / patch_size %d gives %d patches "
                         "and the class token", c->max_seq, c->image_size, c->patch_size, g * g);
    return FL_OK;
}

static fl_status qf_check(fl_model_config *c) {
    c->n_kv_heads = c->n_heads;
    c->attention_bias = c->mlp_bias = 1;
    c->tie_embeddings = 0;
    if (c->head_dim * c->n_heads != c->dim)
        return fl_errorf(FL_ERR_FORMAT, "qformer_config: hidden_size %d is not divisible by num_attention_heads %d", c->dim,
                         c->n_heads);
    if (c->xattn_every <= 0)
        return fl_errorf(FL_ERR_FORMAT, "qformer_config: 'cross_attention_frequency' must be positive (got %d)",
                         c->xattn_every);
    if (c->xattn_dim <= 0)
        return fl_errorf(FL_ERR_FORMAT, "qformer_config: 'encoder_hidden_size' must be positive (got %d)", c->xattn_dim);
    if (c->n_queries <= 0 || c->max_seq != c->n_queries)
        return fl_errorf(FL_ERR_FORMAT, "'num_query_tokens' must be positive (got %d)", c->n_queries);
    return FL_OK;
}

int fl_blip2_has_xattn(const fl_model_config *c, int l) { return c->xattn_every > 0 && l % c->xattn_every == 0; }

static int vis_layout(fl_layout_builder *b, const fl_model_config *c) {
    const int C = c->dim, L = c->n_layers, F = c->ffn_dim, p = c->patch_size;
    int err = 0;
#define P(role, d0, d1, ...) (err |= fl_layout_add(b, FL_ROLE_##role, d0, d1, 0, __VA_ARGS__))
    fl_layout_group(b, 0);
    P(PATCH_W, C, 3 * p * p, "vision_model.embeddings.patch_embedding.weight"); /* file (C, 3, p, p) */
    P(PATCH_B, C, 0, "vision_model.embeddings.patch_embedding.bias");
    P(CLS_EMBED, C, 0, "vision_model.embeddings.class_embedding"); /* file (1, 1, C) */
    P(POS_EMBED, c->max_seq, C, "vision_model.embeddings.position_embedding"); /* file (1, P + 1, C) */
    for (int l = 0; l < L; l++) {
        fl_layout_group(b, l + 1);
        P(LN1_W, C, 0, "vision_model.encoder.layers.%d.layer_norm1.weight", l);
        P(LN1_B, C, 0, "vision_model.encoder.layers.%d.layer_norm1.bias", l);
        P(QKV_W, 3 * C, C, "vision_model.encoder.layers.%d.self_attn.qkv.weight", l);
        P(QKV_B, 3 * C, 0, "vision_model.encoder.layers.%d.self_attn.qkv.bias", l); /* older files: q_bias, v_bias */
        P(O_W, C, C, "vision_model.encoder.layers.%d.self_attn.projection.weight", l);
        P(O_B, C, 0, "vision_model.encoder.layers.%d.self_attn.projection.bias", l);
        P(LN2_W, C, 0, "vision_model.encoder.layers.%d.layer_norm2.weight", l);
        P(LN2_B, C, 0, "vision_model.encoder.layers.%d.layer_norm2.bias", l);
        P(FC_W, F, C, "vision_model.encoder.layers.%d.mlp.fc1.weight", l);
        P(FC_B, F, 0, "vision_model.encoder.layers.%d.mlp.fc1.bias", l);
        P(PROJ_W, C, F, "vision_model.encoder.layers.%d.mlp.fc2.weight", l);
        P(PROJ_B, C, 0, "vision_model.encoder.layers.%d.mlp.fc2.bias", l);
    }
    fl_layout_group(b, L + 1);
    P(NORM_F_W, C, 0, "vision_model.post_layernorm.weight");
    P(NORM_F_B, C, 0, "vision_model.post_layernorm.bias");
    return err;
}

static int qf_layout(fl_layout_builder *b, const fl_model_config *c) {
    const int C = c->dim, L = c->n_layers, F = c->ffn_dim, E = c->xattn_dim;
    int err = 0;
    fl_layout_group(b, 0);
    P(QUERY_EMBED, c->n_queries, C, "query_tokens"); /* file (1, NQ, C) */
    P(EMB_NORM_W, C, 0, "qformer.layernorm.weight");
    P(EMB_NORM_B, C, 0, "qformer.layernorm.bias");
#define Q "qformer.encoder.layer.%d."
    for (int l = 0; l < L; l++) {
        fl_layout_group(b, l + 1);
        /* query, key, value consecutive: the fused (3C, C) matrix and (3C) bias */
        P(QKV_W, C, C, Q "attention.attention.query.weight", l);
        P(NONE, C, C, Q "attention.attention.key.weight", l);
        P(NONE, C, C, Q "attention.attention.value.weight", l);
        P(QKV_B, C, 0, Q "attention.attention.query.bias", l);
        P(NONE, C, 0, Q "attention.attention.key.bias", l);
        P(NONE, C, 0, Q "attention.attention.value.bias", l);
        P(O_W, C, C, Q "attention.output.dense.weight", l);
        P(O_B, C, 0, Q "attention.output.dense.bias", l);
        P(LN1_W, C, 0, Q "attention.output.LayerNorm.weight", l);
        P(LN1_B, C, 0, Q "attention.output.LayerNorm.bias", l);
        if (fl_blip2_has_xattn(c, l)) { /* key, value of the image features consecutive: the fused (2C, E) k|v */
            P(XQ_W, C, C, Q "crossattention.attention.query.weight", l);
            P(XQ_B, C, 0, Q "crossattention.attention.query.bias", l);
            P(XKV_W, C, E, Q "crossattention.attention.key.weight", l);
            P(NONE, C, E, Q "crossattention.attention.value.weight", l);
            P(XKV_B, C, 0, Q "crossattention.attention.key.bias", l);
            P(NONE, C, 0, Q "crossattention.attention.value.bias", l);
            P(XO_W, C, C, Q "crossattention.output.dense.weight", l);
            P(XO_B, C, 0, Q "crossattention.output.dense.bias", l);
            P(LN3_W, C, 0, Q "crossattention.output.LayerNorm.weight", l);
            P(LN3_B, C, 0, Q "crossattention.output.LayerNorm.bias", l);
        }
        P(FC_W, F, C, Q "intermediate_query.dense.weight", l);
        P(FC_B, F, 0, Q "intermediate_query.dense.bias", l);
        P(PROJ_W, C, F, Q "output_query.dense.weight", l);
        P(PROJ_B, C, 0, Q "output_query.dense.bias", l);
        P(LN2_W, C, 0, Q "output_query.LayerNorm.weight", l);
        P(LN2_B, C, 0, Q "output_query.LayerNorm.bias", l);
    }
#undef Q
    fl_layout_group(b, L + 1);
    P(LMPROJ_W, c->proj_dim, C, "language_projection.weight");
    P(LMPROJ_B, c->proj_dim, 0, "language_projection.bias");
#undef P
    return err;
}

static int vis_lora_modules(const fl_model_config *c, fl_arch_lora_module out[FL_ARCH_MAX_LORA_MODULES]) {
    const int C = c->dim, F = c->ffn_dim;
    const fl_arch_lora_module t[] = {
        {"qkv", "vision_model.encoder.layers.%d.self_attn.qkv", 0, 3 * C, 0, 3}, /* q|k|v in one module */
        {"projection", "vision_model.encoder.layers.%d.self_attn.projection", 0, C, 0, 0},
        {"fc1", "vision_model.encoder.layers.%d.mlp.fc1", 0, F, 0, 0},
        {"fc2", "vision_model.encoder.layers.%d.mlp.fc2", 0, C, 0, 0},
    };
    const int n = (int)(sizeof t / sizeof t[0]);
    for (int i = 0; i < n; i++) out[i] = t[i];
    return n;
}

static int qf_lora_modules(const fl_model_config *c, fl_arch_lora_module out[FL_ARCH_MAX_LORA_MODULES]) {
    const int C = c->dim, F = c->ffn_dim;
    const fl_arch_lora_module t[] = {
        {"query", "qformer.encoder.layer.%d.attention.attention.query", 0, 3 * C, 0, 0},
        {"key", "qformer.encoder.layer.%d.attention.attention.key", C, 3 * C, 0, 0},
        {"value", "qformer.encoder.layer.%d.attention.attention.value", 2 * C, 3 * C, 0, 0},
        {"dense", "qformer.encoder.layer.%d.attention.output.dense", 0, C, 0, 0},
        {"dense", "qformer.encoder.layer.%d.intermediate_query.dense", 0, F, 0, 0},
        {"dense", "qformer.encoder.layer.%d.output_query.dense", 0, C, 0, 0},
    };
    const int n = (int)(sizeof t / sizeof t[0]);
    for (int i = 0; i < n; i++) out[i] = t[i];
    return n;
}

/* The vision block, pre-norm (Blip2EncoderLayer), N = B x (patches + 1) rows:
 *   ln1 = LN1(x); qkv = ln1 @ Wqkv^T + b (3C); att = softmax(q k^T / sqrt(HD)) v (bidirectional, no mask)
 *   mid = att @ Wo^T + bo + x; ln2 = LN2(mid); fc = ln2 @ W1^T + b1; act = gelu(fc); out = act @ W2^T + b2 + mid */
static void vis_block(const fl_model_config *c, fl_block_graph *g) {
    const int C = c->dim, F = c->ffn_dim, NH = c->n_heads;
    const int X = fl_graph_slot(g, "x", C, FL_GSLOT_STREAM, 1), OUT = fl_graph_slot(g, "out", C, FL_GSLOT_STREAM, 1);
    const int ln1 = fl_graph_slot(g, "ln1", C, FL_GSLOT_WIDE, 0);
    const int m1 = fl_graph_slot(g, "ln1_mean", 1, FL_GSLOT_STAT, 0), r1 = fl_graph_slot(g, "ln1_rstd", 1, FL_GSLOT_STAT, 0);
    const int qkv = fl_graph_slot(g, "qkv", 3 * C, FL_GSLOT_WIDE, 0), att = fl_graph_slot(g, "att", C, FL_GSLOT_WIDE, 0);
    const int lse = fl_graph_slot(g, "lse", NH, FL_GSLOT_STAT, 0), mid = fl_graph_slot(g, "res_mid", C, FL_GSLOT_WIDE, 1);
    const int ln2 = fl_graph_slot(g, "ln2", C, FL_GSLOT_WIDE, 0);
    const int m2 = fl_graph_slot(g, "ln2_mean", 1, FL_GSLOT_STAT, 0), r2 = fl_graph_slot(g, "ln2_rstd", 1, FL_GSLOT_STAT, 0);
    const int fc = fl_graph_slot(g, "fc", F, FL_GSLOT_WIDE, 0), act = fl_graph_slot(g, "act", F, FL_GSLOT_WIDE, 0);
    fl_graph_op(g, FL_GOP_NORM, X, ln1, m1, r1, 0, FL_ROLE_LN1_W, FL_ROLE_LN1_B);
    fl_graph_op(g, FL_GOP_LINEAR, ln1, qkv, -1, -1, 0, FL_ROLE_QKV_W, FL_ROLE_QKV_B);
    fl_gop *a = fl_graph_op(g, FL_GOP_ATTN, qkv, att, lse, -1, -1, -1, -1);
    a->attn = FL_ATTN_BIDIR;
    if (fl_drops_attn(c)) a->p = FL_DROP_ATTN_W; /* attention_dropout on the weights (Blip2Attention) */
    fl_graph_op(g, FL_GOP_LINEAR, att, mid, -1, -1, 1, FL_ROLE_O_W, FL_ROLE_O_B);
    fl_graph_op(g, FL_GOP_ADD, X, mid, -1, -1, -1, -1, -1);
    fl_graph_op(g, FL_GOP_NORM, mid, ln2, m2, r2, 1, FL_ROLE_LN2_W, FL_ROLE_LN2_B);
    fl_graph_op(g, FL_GOP_LINEAR, ln2, fc, -1, -1, 2, FL_ROLE_FC_W, FL_ROLE_FC_B);
    fl_graph_op(g, c->gelu_exact ? FL_GOP_GELU_ERF : FL_GOP_GELU, fc, act, -1, -1, -1, -1, -1);
    fl_graph_op(g, FL_GOP_LINEAR, act, OUT, -1, -1, 3, FL_ROLE_PROJ_W, FL_ROLE_PROJ_B);
    fl_graph_op(g, FL_GOP_ADD, mid, OUT, -1, -1, -1, -1, -1);
    g->n_norms = 2;
    g->n_linears = 4;
}

/* A Q-Former block (Blip2QFormerLayer on the queries alone), post-norm, N = B x NQ rows (with dropout on: the
 * self- and cross-attention weights at attention_probs_dropout_prob, the three dense outputs before their residual
 * adds at hidden_dropout_prob, as Blip2QFormerSelfOutput / Blip2QFormerOutput drop):
 *   qkv = x @ Wqkv^T + b; att = softmax(q k^T / sqrt(HD)) v (bidirectional); h1 = att @ Wo^T + bo + x; a1 = LN1(h1)
 *   with a cross-attention (xattn): xq = a1 @ Wxq^T + b; xkv = img @ Wxkv^T + b (B x Tk rows, from the XSTREAM of the
 *   image features, E wide); xatt = softmax(xq xk^T / sqrt(HD)) xv; h3 = xatt @ Wxo^T + b + a1; a = LN3(h3)
 *   (else a = a1); fc = a @ Wfc^T + b; act = gelu(fc); h2 = act @ Wproj^T + b + a; out = LN2(h2).
 * Linears: 0 qkv, 1 o, 2 fc, 3 proj, 4 cross q, 5 cross k|v, 6 cross o (T5's numbering); norms: 0 LN1, 1 LN2, 2 LN3. */
void fl_blip2_qformer_block(const fl_model_config *c, int xattn, fl_block_graph *g) {
    const int C = c->dim, F = c->ffn_dim, NH = c->n_heads;
    const int X = fl_graph_slot(g, "x", C, FL_GSLOT_STREAM, 1), OUT = fl_graph_slot(g, "out", C, FL_GSLOT_STREAM, 1);
    const int qkv = fl_graph_slot(g, "qkv", 3 * C, FL_GSLOT_WIDE, 0), att = fl_graph_slot(g, "att", C, FL_GSLOT_WIDE, 0);
    const int lse = fl_graph_slot(g, "lse", NH, FL_GSLOT_STAT, 0), h1 = fl_graph_slot(g, "h1", C, FL_GSLOT_WIDE, 1);
    const int a1 = fl_graph_slot(g, "a1", C, FL_GSLOT_WIDE, 1);
    const int a1m = fl_graph_slot(g, "a1_mean", 1, FL_GSLOT_STAT, 0), a1r = fl_graph_slot(g, "a1_rstd", 1, FL_GSLOT_STAT, 0);
    fl_graph_op(g, FL_GOP_LINEAR, X, qkv, -1, -1, 0, FL_ROLE_QKV_W, FL_ROLE_QKV_B);
    fl_gop *sa = fl_graph_op(g, FL_GOP_ATTN, qkv, att, lse, -1, -1, -1, -1);
    sa->attn = FL_ATTN_BIDIR;
    if (fl_drops_attn(c)) sa->p = FL_DROP_ATTN_W;
    fl_graph_sublayer_out(g, c, att, h1, 1, FL_ROLE_O_W, FL_ROLE_O_B, FL_DROP_ATTN);
    fl_graph_op(g, FL_GOP_ADD, X, h1, -1, -1, -1, -1, -1);
    fl_graph_op(g, FL_GOP_NORM, h1, a1, a1m, a1r, 0, FL_ROLE_LN1_W, FL_ROLE_LN1_B);
    int a = a1;
    if (xattn) {
        const int img = fl_graph_slot(g, "img", c->xattn_dim, FL_GSLOT_XSTREAM, 0);
        const int xq = fl_graph_slot(g, "xq", C, FL_GSLOT_WIDE, 0), xkv = fl_graph_slot(g, "xkv", 2 * C, FL_GSLOT_WIDE, 0);
        const int xatt = fl_graph_slot(g, "xatt", C, FL_GSLOT_WIDE, 0), xlse = fl_graph_slot(g, "xlse", NH, FL_GSLOT_STAT, 0);
        const int h3 = fl_graph_slot(g, "h3", C, FL_GSLOT_WIDE, 1), a3 = fl_graph_slot(g, "a3", C, FL_GSLOT_WIDE, 1);
        const int a3m = fl_graph_slot(g, "a3_mean", 1, FL_GSLOT_STAT, 0);
        const int a3r = fl_graph_slot(g, "a3_rstd", 1, FL_GSLOT_STAT, 0);
        fl_graph_op(g, FL_GOP_LINEAR, a1, xq, -1, -1, 4, FL_ROLE_XQ_W, FL_ROLE_XQ_B);
        fl_graph_op(g, FL_GOP_LINEAR, img, xkv, -1, -1, 5, FL_ROLE_XKV_W, FL_ROLE_XKV_B);
        fl_gop *x = fl_graph_op(g, FL_GOP_ATTN, xq, xatt, xlse, -1, -1, -1, -1);
        x->attn = FL_ATTN_CROSS;
        x->in2 = (int8_t)xkv;
        if (fl_drops_attn(c)) x->p = FL_DROP_XATTN_W;
        fl_graph_sublayer_out(g, c, xatt, h3, 6, FL_ROLE_XO_W, FL_ROLE_XO_B, FL_DROP_XATTN);
        fl_graph_op(g, FL_GOP_ADD, a1, h3, -1, -1, -1, -1, -1);
        fl_graph_op(g, FL_GOP_NORM, h3, a3, a3m, a3r, 2, FL_ROLE_LN3_W, FL_ROLE_LN3_B);
        a = a3;
    }
    const int fc = fl_graph_slot(g, "fc", F, FL_GSLOT_WIDE, 0), act = fl_graph_slot(g, "act", F, FL_GSLOT_WIDE, 0);
    const int h2 = fl_graph_slot(g, "h2", C, FL_GSLOT_WIDE, 1);
    const int om = fl_graph_slot(g, "out_mean", 1, FL_GSLOT_STAT, 0), orr = fl_graph_slot(g, "out_rstd", 1, FL_GSLOT_STAT, 0);
    fl_graph_op(g, FL_GOP_LINEAR, a, fc, -1, -1, 2, FL_ROLE_FC_W, FL_ROLE_FC_B);
    fl_graph_op(g, c->gelu_exact ? FL_GOP_GELU_ERF : FL_GOP_GELU, fc, act, -1, -1, -1, -1, -1);
    fl_graph_sublayer_out(g, c, act, h2, 3, FL_ROLE_PROJ_W, FL_ROLE_PROJ_B, FL_DROP_FFN);
    fl_graph_op(g, FL_GOP_ADD, a, h2, -1, -1, -1, -1, -1);
    fl_graph_op(g, FL_GOP_NORM, h2, OUT, om, orr, 1, FL_ROLE_LN2_W, FL_ROLE_LN2_B);
    g->n_norms = xattn ? 3 : 2;
    g->n_linears = xattn ? 7 : 4;
}

static void qf_block(const fl_model_config *c, fl_block_graph *g) { fl_blip2_qformer_block(c, 0, g); }

/* pixels -> patches (+ class token, + positions) -> L blocks -> post_layernorm -> the image features */
static void vis_model_graph(const fl_model_config *c, fl_model_graph *mg) {
    (void)c;
    fl_model_graph_op(mg, FL_MOP_PATCH, -1, -1);
    fl_model_graph_op(mg, FL_MOP_BLOCKS, -1, -1);
    fl_model_graph_op(mg, FL_MOP_NORM, FL_ROLE_NORM_F_W, FL_ROLE_NORM_F_B);
    fl_model_graph_op(mg, FL_MOP_OUTPUT, -1, -1);
}

/* query tokens -> LayerNorm -> L blocks (cross-attending to the image features) -> the query output */
static void qf_model_graph(const fl_model_config *c, fl_model_graph *mg) {
    (void)c;
    fl_model_graph_op(mg, FL_MOP_QUERIES, -1, -1);
    fl_model_graph_op(mg, FL_MOP_NORM, FL_ROLE_EMB_NORM_W, FL_ROLE_EMB_NORM_B);
    fl_model_graph_op(mg, FL_MOP_BLOCKS, -1, -1);
    fl_model_graph_op(mg, FL_MOP_OUTPUT, -1, -1);
}

const fl_arch_info fl_arch_blip2_vision = {
    .name = "blip2-vision",
    .display = "BLIP-2 vision tower",
    .layernorm = 1,
    .ffn_mult = 4,
    .hf_block = "vision_model.encoder.layers.",
    .hf_embed = "vision_model.embeddings.patch_embedding.weight",
    .hf_layers_key = "vision_config.num_hidden_layers",
    .lora_targets = vis_targets,
    .lora_default = "qkv",
    .lora_switch = {"qkv", "qkv", "qkv", "projection", "fc1,fc2"},
    .check = vis_check,
    .layout = vis_layout,
    .lora_modules = vis_lora_modules,
    .block_graph = vis_block,
    .model_graph = vis_model_graph,
};

const fl_arch_info fl_arch_blip2_qformer = {
    .name = "blip2-qformer",
    .display = "BLIP-2 Q-Former",
    .layernorm = 1,
    .ffn_mult = 4,
    .hf_block = "qformer.encoder.layer.",
    .hf_embed = "query_tokens",
    .hf_layers_key = "qformer_config.num_hidden_layers",
    .lora_targets = qf_targets,
    .lora_default = "query,value",
    .lora_switch = {"query", "key", "value", "dense", "dense"},
    .check = qf_check,
    .layout = qf_layout,
    .lora_modules = qf_lora_modules,
    .block_graph = qf_block,
    .model_graph = qf_model_graph,
};
