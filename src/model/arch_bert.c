/* The BERT architecture (BertModel: the encoder without pooler or heads), the proof that an architecture
 * unlike the decoders is one file: learned absolute positions plus token-type embeddings, an embedding
 * LayerNorm, POST-norm blocks with biases everywhere, bidirectional attention with a key padding mask,
 * a GELU MLP, and the last hidden states as the output (fl_model_encode). Its descriptor, config keys,
 * HF-named layout, block graph and model graph are all here; the registry line is in arch.c and the
 * enum value in fitllm/model.h. hidden_act: "gelu_new" / "gelu_pytorch_tanh" (the tanh GELU the backends
 * have; BERT's own "gelu" is the exact erf GELU, not an op yet: refused by name). HF names of transformers'
 * BertModel, "bert." optional (BertFor* checkpoints carry it). */
#include "model-impl.h"

static const char *const targets[] = {"query", "key", "value", "dense", NULL};
static const char *const model_types[] = {"bert", NULL};
static const char *const acts[] = {"gelu_new", "gelu_pytorch_tanh", NULL};

static const fl_arch_hf_keys keys = {
    .dim = "hidden_size", .ffn = "intermediate_size", .heads = "num_attention_heads", .layers = "num_hidden_layers",
    .max_seq = "max_position_embeddings", .vocab = "vocab_size", .eps = "layer_norm_eps",
    .type_vocab = "type_vocab_size", .act = "hidden_act", .acts = acts, .eps_default = 1e-12f,
};

static fl_status check(fl_model_config *c) {
    c->n_kv_heads = c->n_heads;
    c->attention_bias = c->mlp_bias = 1;
    c->tie_embeddings = 0; /* no LM head */
    if (c->type_vocab_size <= 0) c->type_vocab_size = 2; /* BertConfig's default */
    if (c->head_dim * c->n_heads != c->dim)
        return fl_errorf(FL_ERR_FORMAT, "model config: BERT needs hidden_size %d divisible by num_attention_heads %d",
                         c->dim, c->n_heads);
    return FL_OK;
}

static int layout(fl_layout_builder *b, const fl_model_config *c) {
    const int C = c->dim, L = c->n_layers, F = c->ffn_dim;
    int err = 0;
#define P(role, d0, d1, ...) (err |= fl_layout_add(b, FL_ROLE_##role, d0, d1, 0, __VA_ARGS__))
    fl_layout_group(b, 0);
    P(EMBED, c->vocab_size, C, "bert.embeddings.word_embeddings.weight");
    P(POS_EMBED, c->max_seq, C, "bert.embeddings.position_embeddings.weight");
    P(TYPE_EMBED, c->type_vocab_size, C, "bert.embeddings.token_type_embeddings.weight");
    P(EMB_NORM_W, C, 0, "bert.embeddings.LayerNorm.weight");
    P(EMB_NORM_B, C, 0, "bert.embeddings.LayerNorm.bias");
    for (int l = 0; l < L; l++) {
        fl_layout_group(b, l + 1);
        /* query, key, value consecutive: the fused (3C, C) matrix and (3C) bias */
        P(QKV_W, C, C, "bert.encoder.layer.%d.attention.self.query.weight", l);
        P(NONE, C, C, "bert.encoder.layer.%d.attention.self.key.weight", l);
        P(NONE, C, C, "bert.encoder.layer.%d.attention.self.value.weight", l);
        P(QKV_B, C, 0, "bert.encoder.layer.%d.attention.self.query.bias", l);
        P(NONE, C, 0, "bert.encoder.layer.%d.attention.self.key.bias", l);
        P(NONE, C, 0, "bert.encoder.layer.%d.attention.self.value.bias", l);
        P(O_W, C, C, "bert.encoder.layer.%d.attention.output.dense.weight", l);
        P(O_B, C, 0, "bert.encoder.layer.%d.attention.output.dense.bias", l);
        P(LN1_W, C, 0, "bert.encoder.layer.%d.attention.output.LayerNorm.weight", l);
        P(LN1_B, C, 0, "bert.encoder.layer.%d.attention.output.LayerNorm.bias", l);
        P(FC_W, F, C, "bert.encoder.layer.%d.intermediate.dense.weight", l);
        P(FC_B, F, 0, "bert.encoder.layer.%d.intermediate.dense.bias", l);
        P(PROJ_W, C, F, "bert.encoder.layer.%d.output.dense.weight", l);
        P(PROJ_B, C, 0, "bert.encoder.layer.%d.output.dense.bias", l);
        P(LN2_W, C, 0, "bert.encoder.layer.%d.output.LayerNorm.weight", l);
        P(LN2_B, C, 0, "bert.encoder.layer.%d.output.LayerNorm.bias", l);
    }
    fl_layout_group(b, L + 1); /* no final norm, no head */
#undef P
    return err;
}

static int lora_modules(const fl_model_config *c, fl_arch_lora_module out[FL_ARCH_MAX_LORA_MODULES]) {
    const int C = c->dim, F = c->ffn_dim;
    const fl_arch_lora_module t[] = {
        {"query", "bert.encoder.layer.%d.attention.self.query", 0, 3 * C, 0, 0},
        {"key", "bert.encoder.layer.%d.attention.self.key", C, 3 * C, 0, 0},
        {"value", "bert.encoder.layer.%d.attention.self.value", 2 * C, 3 * C, 0, 0},
        {"dense", "bert.encoder.layer.%d.attention.output.dense", 0, C, 0, 0},
        {"dense", "bert.encoder.layer.%d.intermediate.dense", 0, F, 0, 0},
        {"dense", "bert.encoder.layer.%d.output.dense", 0, C, 0, 0},
    };
    const int n = (int)(sizeof t / sizeof t[0]);
    for (int i = 0; i < n; i++) out[i] = t[i];
    return n;
}

/* The post-norm encoder block, N = B x T rows:
 *   x (N, C)                                  the block's input, res[l]
 *   qkv = x @ Wqkv^T + bqkv       (N, 3C)     [q | k | v]
 *   att = softmax(q k^T / sqrt(HD), keys masked) v   (N, C), lse (N, NH): bidirectional
 *   h1 = att @ Wo^T + bo + x      (N, C)
 *   a = LayerNorm1(h1)            (N, C)      [mean, rstd (N)]
 *   fc = a @ Wfc^T + bfc          (N, F);  act = gelu_tanh(fc)   (N, F)
 *   h2 = act @ Wproj^T + bproj + a  (N, C)
 *   out = LayerNorm2(h2)          (N, C)      [mean, rstd (N)], res[l+1]
 * The residual paths: {x, h1} (its gradient ends in dres) and {a, h2}; out's gradient is consumed by
 * LayerNorm2's backward before h1's starts. */
static void block_graph(const fl_model_config *c, fl_block_graph *g) {
    const int C = c->dim, F = c->ffn_dim, NH = c->n_heads;
    const int X = fl_graph_slot(g, "x", C, FL_GSLOT_STREAM, 1), OUT = fl_graph_slot(g, "out", C, FL_GSLOT_STREAM, 1);
    const int qkv = fl_graph_slot(g, "qkv", 3 * C, FL_GSLOT_WIDE, 0), att = fl_graph_slot(g, "att", C, FL_GSLOT_WIDE, 0);
    const int lse = fl_graph_slot(g, "lse", NH, FL_GSLOT_STAT, 0), h1 = fl_graph_slot(g, "h1", C, FL_GSLOT_WIDE, 1);
    const int a = fl_graph_slot(g, "a", C, FL_GSLOT_WIDE, 1);
    const int am = fl_graph_slot(g, "a_mean", 1, FL_GSLOT_STAT, 0), ar = fl_graph_slot(g, "a_rstd", 1, FL_GSLOT_STAT, 0);
    const int fc = fl_graph_slot(g, "fc", F, FL_GSLOT_WIDE, 0), act = fl_graph_slot(g, "act", F, FL_GSLOT_WIDE, 0);
    const int h2 = fl_graph_slot(g, "h2", C, FL_GSLOT_WIDE, 1);
    const int om = fl_graph_slot(g, "out_mean", 1, FL_GSLOT_STAT, 0), orr = fl_graph_slot(g, "out_rstd", 1, FL_GSLOT_STAT, 0);
    fl_graph_op(g, FL_GOP_LINEAR, X, qkv, -1, -1, 0, FL_ROLE_QKV_W, FL_ROLE_QKV_B);
    fl_gop *at = fl_graph_op(g, FL_GOP_ATTN, qkv, att, lse, -1, -1, -1, -1);
    at->attn = FL_ATTN_BIDIR;
    at->attn_flags = FL_GATTN_MASK;
    fl_graph_op(g, FL_GOP_LINEAR, att, h1, -1, -1, 1, FL_ROLE_O_W, FL_ROLE_O_B);
    fl_graph_op(g, FL_GOP_ADD, X, h1, -1, -1, -1, -1, -1);
    fl_graph_op(g, FL_GOP_NORM, h1, a, am, ar, 0, FL_ROLE_LN1_W, FL_ROLE_LN1_B);
    fl_graph_op(g, FL_GOP_LINEAR, a, fc, -1, -1, 2, FL_ROLE_FC_W, FL_ROLE_FC_B);
    fl_graph_op(g, FL_GOP_GELU, fc, act, -1, -1, -1, -1, -1);
    fl_graph_op(g, FL_GOP_LINEAR, act, h2, -1, -1, 3, FL_ROLE_PROJ_W, FL_ROLE_PROJ_B);
    fl_graph_op(g, FL_GOP_ADD, a, h2, -1, -1, -1, -1, -1);
    fl_graph_op(g, FL_GOP_NORM, h2, OUT, om, orr, 1, FL_ROLE_LN2_W, FL_ROLE_LN2_B);
    g->n_norms = 2;
    g->n_linears = 4;
}

/* (B, T) ids, types -> word + position + type embeddings (N, C) -> LayerNorm -> L blocks -> hidden (N, C) */
static void model_graph(const fl_model_config *c, fl_model_graph *mg) {
    (void)c;
    fl_model_graph_op(mg, FL_MOP_EMBED, -1, -1);
    fl_model_graph_op(mg, FL_MOP_EMBED_TYPE, -1, -1);
    fl_model_graph_op(mg, FL_MOP_NORM, FL_ROLE_EMB_NORM_W, FL_ROLE_EMB_NORM_B);
    fl_model_graph_op(mg, FL_MOP_BLOCKS, -1, -1);
    fl_model_graph_op(mg, FL_MOP_OUTPUT, -1, -1);
}

const fl_arch_info fl_arch_bert = {
    .name = "bert",
    .display = "BERT",
    .layernorm = 1,
    .ffn_mult = 4,
    .hf_prefix = "bert.",
    .hf_block = "encoder.layer.",
    .hf_embed = "embeddings.word_embeddings.weight",
    .hf_layers_key = "num_hidden_layers",
    .lora_targets = targets,
    .lora_default = "query,value",
    .lora_switch = {"query", "key", "value", "dense", "dense"},
    .check = check,
    .layout = layout,
    .lora_modules = lora_modules,
    .block_graph = block_graph,
    .model_graph = model_graph,
    .hf_model_types = model_types,
    .hf_keys = &keys,
};
