/* The T5 architecture (transformers' T5ForConditionalGeneration: T5 v1.0 and v1.1 / Flan-T5), an encoder-decoder:
 * two stacks of pre-norm blocks with T5's RMS norm (no mean, no bias), attention without the 1/sqrt(d) scaling,
 * the bucketed relative position bias of each stack's first block added to every block's self-attention (the
 * model graph's RELBIAS: bidirectional buckets in the encoder, causal in the decoder), the encoder's bidirectional
 * self-attention with the source's key padding mask, the decoder's causal self-attention and its cross-attention
 * to the encoder output (an XSTREAM slot: its gradient flows back into the encoder), the FFN ReLU (v1.0) or
 * gated-GELU (v1.1: wi_0 | wi_1 fused, GEGLU), one shared embedding, and the head: tied with the decoder output
 * scaled by d_model^-0.5 (v1.0) or lm_head (v1.1). Executed by src/model/seq2seq.c; config.json in
 * src/io/hf_config.c (fl_hf_parse_t5). HF names of T5ForConditionalGeneration. */
#include "model-impl.h"

static const char *const targets[] = {"q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo", "lm_head", NULL};
/* copies of shared.weight some files carry (older save_pretrained), and the unused cross-attention table of
 * checkpoints converted from Mesh TensorFlow (transformers ignores it too) */
static const char *const aliases[] = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", NULL};
static const char *const ignored[] = {"decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight", NULL};

static fl_status check(fl_model_config *c) {
    c->n_kv_heads = c->n_heads;
    c->attention_bias = c->mlp_bias = 0;
    if (c->n_dec_layers <= 0 && c->pp_enc <= 0) /* a pipeline stage may hold encoder blocks only */
        return fl_errorf(FL_ERR_FORMAT, "model config: T5 needs num_decoder_layers > 0 (got %d)", c->n_dec_layers);
    if (c->rel_buckets < 2 || c->rel_max_dist <= 0)
        return fl_errorf(FL_ERR_FORMAT, "model config: T5 needs relative_attention_num_buckets >= 2 (got %d) and "
                         "relative_attention_max_distance > 0 (got %d)", c->rel_buckets, c->rel_max_dist);
    return FL_OK;
}

/* One block's attention: the norm, q, k, v consecutive (the fused (3 QD, C) matrix), o. */
static int attn_entries(fl_layout_builder *b, const fl_model_config *c, const char *stack, int l, int sub,
                        const char *mod, int cross) {
    const int C = c->dim, QD = c->n_heads * c->head_dim;
    int err = 0;
    err |= fl_layout_add(b, cross ? FL_ROLE_LN3_W : FL_ROLE_LN1_W, C, 0, 0, "%s.block.%d.layer.%d.layer_norm.weight",
                         stack, l, sub);
    if (cross) { /* q reads the decoder's stream, k | v the encoder output: two linears */
        err |= fl_layout_add(b, FL_ROLE_XQ_W, QD, C, 0, "%s.block.%d.layer.%d.%s.q.weight", stack, l, sub, mod);
        err |= fl_layout_add(b, FL_ROLE_XKV_W, QD, C, 0, "%s.block.%d.layer.%d.%s.k.weight", stack, l, sub, mod);
    } else {
        err |= fl_layout_add(b, FL_ROLE_QKV_W, QD, C, 0, "%s.block.%d.layer.%d.%s.q.weight", stack, l, sub, mod);
        err |= fl_layout_add(b, FL_ROLE_NONE, QD, C, 0, "%s.block.%d.layer.%d.%s.k.weight", stack, l, sub, mod);
    }
    err |= fl_layout_add(b, FL_ROLE_NONE, QD, C, 0, "%s.block.%d.layer.%d.%s.v.weight", stack, l, sub, mod);
    err |= fl_layout_add(b, cross ? FL_ROLE_XO_W : FL_ROLE_O_W, C, QD, 0, "%s.block.%d.layer.%d.%s.o.weight", stack, l,
                         sub, mod);
    return err;
}

static int ffn_entries(fl_layout_builder *b, const fl_model_config *c, const char *stack, int l, int sub) {
    const int C = c->dim, F = c->ffn_dim;
    int err = fl_layout_add(b, FL_ROLE_LN2_W, C, 0, 0, "%s.block.%d.layer.%d.layer_norm.weight", stack, l, sub);
    if (c->ffn_gated) { /* wi_0 then wi_1: the fused (2F, C) matrix GEGLU reads */
        err |= fl_layout_add(b, FL_ROLE_FC_W, F, C, 0, "%s.block.%d.layer.%d.DenseReluDense.wi_0.weight", stack, l, sub);
        err |= fl_layout_add(b, FL_ROLE_NONE, F, C, 0, "%s.block.%d.layer.%d.DenseReluDense.wi_1.weight", stack, l, sub);
    } else {
        err |= fl_layout_add(b, FL_ROLE_FC_W, F, C, 0, "%s.block.%d.layer.%d.DenseReluDense.wi.weight", stack, l, sub);
    }
    err |= fl_layout_add(b, FL_ROLE_PROJ_W, C, F, 0, "%s.block.%d.layer.%d.DenseReluDense.wo.weight", stack, l, sub);
    return err;
}

/* The relative position bias table is stored (NH, buckets): one head's row is what the bucket lookup reads
 * (seq2seq.c); on disk it is nn.Embedding(buckets, NH), so transposed. */
static int layout(fl_layout_builder *b, const fl_model_config *c) {
    const int Le = c->n_layers, Ld = c->n_dec_layers, V = fl_config_vocab_rows(c, NULL); /* TP: the vocabulary slice */
    int err = 0;
    fl_layout_group(b, 0);
    err |= fl_layout_add(b, FL_ROLE_EMBED, V, c->dim, 0, "shared.weight");
    for (int l = 0; l < Le; l++) {
        fl_layout_group(b, 1 + l);
        if (l == 0)
            err |= fl_layout_add(b, FL_ROLE_REL_BIAS, c->n_heads, c->rel_buckets, 1,
                                 "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight");
        err |= attn_entries(b, c, "encoder", l, 0, "SelfAttention", 0);
        err |= ffn_entries(b, c, "encoder", l, 1);
    }
    for (int l = 0; l < Ld; l++) {
        fl_layout_group(b, 1 + Le + l);
        if (l == 0)
            err |= fl_layout_add(b, FL_ROLE_REL_BIAS, c->n_heads, c->rel_buckets, 1,
                                 "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight");
        err |= attn_entries(b, c, "decoder", l, 0, "SelfAttention", 0);
        err |= attn_entries(b, c, "decoder", l, 1, "EncDecAttention", 1);
        err |= ffn_entries(b, c, "decoder", l, 2);
    }
    fl_layout_group(b, 1 + Le + Ld);
    err |= fl_layout_add(b, FL_ROLE_NORM_E_W, c->dim, 0, 0, "encoder.final_layer_norm.weight");
    err |= fl_layout_add(b, FL_ROLE_NORM_F_W, c->dim, 0, 0, "decoder.final_layer_norm.weight");
    if (!c->tie_embeddings) err |= fl_layout_add(b, FL_ROLE_HEAD, V, c->dim, 0, "lm_head.weight");
    return err;
}

/* PEFT's module names: q, k, v, o of every attention (the encoder's and the decoder's self-attention, the decoder's
 * cross-attention: its k, v rows of the fused k|v of the encoder output), wi (v1.0) or wi_0, wi_1 (v1.1), wo */
static int lora_modules(const fl_model_config *c, fl_arch_lora_module out[FL_ARCH_MAX_LORA_MODULES]) {
    const int C = c->dim, F = c->ffn_dim, QD = c->n_heads * c->head_dim;
    int n = 0;
#define M(t, f, r0, rows, st) out[n++] = (fl_arch_lora_module){t, f, r0, rows, st}
    for (int st = 0; st < 2; st++) {
        const char *const *nm = st ? (const char *const[]){"decoder.block.%d.layer.0.SelfAttention.q",
                                                           "decoder.block.%d.layer.0.SelfAttention.k",
                                                           "decoder.block.%d.layer.0.SelfAttention.v",
                                                           "decoder.block.%d.layer.0.SelfAttention.o"}
                                   : (const char *const[]){"encoder.block.%d.layer.0.SelfAttention.q",
                                                           "encoder.block.%d.layer.0.SelfAttention.k",
                                                           "encoder.block.%d.layer.0.SelfAttention.v",
                                                           "encoder.block.%d.layer.0.SelfAttention.o"};
        M("q", nm[0], 0, 3 * QD, st);
        M("k", nm[1], QD, 3 * QD, st);
        M("v", nm[2], 2 * QD, 3 * QD, st);
        M("o", nm[3], 0, C, st);
        if (st) {
            M("q", "decoder.block.%d.layer.1.EncDecAttention.q", 0, QD, 1);
            M("k", "decoder.block.%d.layer.1.EncDecAttention.k", 0, 2 * QD, 1);
            M("v", "decoder.block.%d.layer.1.EncDecAttention.v", QD, 2 * QD, 1);
            M("o", "decoder.block.%d.layer.1.EncDecAttention.o", 0, C, 1);
        }
        const char *wi0 = st ? "decoder.block.%d.layer.2.DenseReluDense.wi_0" : "encoder.block.%d.layer.1.DenseReluDense.wi_0";
        const char *wi1 = st ? "decoder.block.%d.layer.2.DenseReluDense.wi_1" : "encoder.block.%d.layer.1.DenseReluDense.wi_1";
        const char *wi = st ? "decoder.block.%d.layer.2.DenseReluDense.wi" : "encoder.block.%d.layer.1.DenseReluDense.wi";
        const char *wo = st ? "decoder.block.%d.layer.2.DenseReluDense.wo" : "encoder.block.%d.layer.1.DenseReluDense.wo";
        if (c->ffn_gated) {
            M("wi_0", wi0, 0, 2 * F, st);
            M("wi_1", wi1, F, 2 * F, st);
        } else {
            M("wi", wi, 0, F, st);
        }
        M("wo", wo, 0, C, st);
    }
#undef M
    return n;
}

/* Dropout (config.json dropout_rate > 0 with cfg.dropout_on, the trainer's; applied in training passes only,
 * fl_block_ctx.drop_p): transformers'
 * T5 drops each sublayer's output before its residual add and the FFN's activation before wo (and, outside the
 * blocks, the embeddings and each stack's final norm output: seq2seq.c). A residual slot's gradient is its path's,
 * so a sublayer's output projection writes an off-path slot (TEMP: not saved) that DROPOUT copies, masked, into the
 * residual one; the activation is masked in place. Without dropout the graphs are the ones before (the same bits).
 * The sites (fl_gop.p: each mask's seed within the block): graph.h's FL_DROP_* (0 self-attention output, 1 cross, 2
 * the FFN's activation, 3 the FFN's output, 4 / 5 the self- / cross-attention's weights: the ATTN ops' p, exec.c); a
 * sublayer's output through fl_graph_sublayer_out (graph.c, OPT's and BLIP-2's too). */
static int drops(const fl_model_config *c) { return fl_drops_hidden(c); }

static void sublayer_out(fl_block_graph *g, const fl_model_config *c, int in, int res, int lin, int role, int site) {
    fl_graph_sublayer_out(g, c, in, res, lin, role, -1, site);
}

/* The self-attention sublayer: x -> norm -> q|k|v -> attention (+ the stack's relative bias, unscaled) -> o -> + x
 * (returns the sum's slot).
 * The FFN sublayer: h -> norm -> wi (| wi_1) -> relu | geglu -> wo -> + h. The slots in production order. */
static int self_attn(fl_block_graph *g, const fl_model_config *c, int X, int attn, int flags) {
    const int C = c->dim, QD = c->n_heads * c->head_dim;
    const int ln = fl_graph_slot(g, "ln1", C, FL_GSLOT_WIDE, 0), lr = fl_graph_slot(g, "ln1_rstd", 1, FL_GSLOT_STAT, 0);
    const int qkv = fl_graph_slot(g, "qkv", 3 * QD, FL_GSLOT_WIDE, 0), att = fl_graph_slot(g, "att", QD, FL_GSLOT_WIDE, 0);
    const int lse = fl_graph_slot(g, "lse", c->n_heads, FL_GSLOT_STAT, 0);
    const int H = fl_graph_slot(g, "h1", C, FL_GSLOT_WIDE, 1);
    fl_graph_op(g, FL_GOP_NORM, X, ln, -1, lr, 0, FL_ROLE_LN1_W, -1);
    fl_graph_op(g, FL_GOP_LINEAR, ln, qkv, -1, -1, 0, FL_ROLE_QKV_W, -1);
    fl_gop *a = fl_graph_op(g, FL_GOP_ATTN, qkv, att, lse, -1, -1, -1, -1);
    a->attn = (uint8_t)attn;
    a->attn_flags = (uint8_t)(flags | FL_GATTN_BIAS | FL_GATTN_NOSCALE);
    if (drops(c)) a->p = FL_DROP_ATTN_W;
    sublayer_out(g, c, att, H, 1, FL_ROLE_O_W, FL_DROP_ATTN);
    fl_graph_op(g, FL_GOP_ADD, X, H, -1, -1, -1, -1, -1);
    return H;
}

static void ffn(fl_block_graph *g, const fl_model_config *c, int H, int OUT) {
    const int C = c->dim, F = c->ffn_dim;
    const int ln = fl_graph_slot(g, "ln2", C, FL_GSLOT_WIDE, 0), lr = fl_graph_slot(g, "ln2_rstd", 1, FL_GSLOT_STAT, 0);
    const int fc = fl_graph_slot(g, "fc", c->ffn_gated ? 2 * F : F, FL_GSLOT_WIDE, 0);
    const int act = fl_graph_slot(g, "act", F, FL_GSLOT_WIDE, 0);
    fl_graph_op(g, FL_GOP_NORM, H, ln, -1, lr, 1, FL_ROLE_LN2_W, -1);
    fl_graph_op(g, FL_GOP_LINEAR, ln, fc, -1, -1, 2, FL_ROLE_FC_W, -1);
    fl_graph_op(g, c->ffn_gated ? FL_GOP_GEGLU : FL_GOP_RELU, fc, act, -1, -1, -1, -1, -1);
    if (drops(c)) fl_graph_op(g, FL_GOP_DROPOUT, act, act, -1, -1, FL_DROP_ACT, -1, -1);
    sublayer_out(g, c, act, OUT, 3, FL_ROLE_PROJ_W, FL_DROP_FFN);
    fl_graph_op(g, FL_GOP_ADD, H, OUT, -1, -1, -1, -1, -1);
}

/* The encoder block (N = B x Ts rows): bidirectional self-attention with the source's key padding mask, the FFN. */
static void encoder_block(const fl_model_config *c, fl_block_graph *g) {
    const int X = fl_graph_slot(g, "x", c->dim, FL_GSLOT_STREAM, 1), OUT = fl_graph_slot(g, "out", c->dim, FL_GSLOT_STREAM, 1);
    const int H = self_attn(g, c, X, FL_ATTN_BIDIR, FL_GATTN_MASK);
    ffn(g, c, H, OUT);
    g->n_norms = 2;
    g->n_linears = 4;
}

/* The decoder block (N = B x Tt rows; the encoder output `enc` B x Ts rows): causal self-attention, then
 * cross-attention (norm 2, linears 4 q, 5 k|v of enc, 6 o; the source's key padding mask), then the FFN. */
static void decoder_block(const fl_model_config *c, fl_block_graph *g) {
    const int C = c->dim, QD = c->n_heads * c->head_dim;
    const int X = fl_graph_slot(g, "x", C, FL_GSLOT_STREAM, 1), OUT = fl_graph_slot(g, "out", C, FL_GSLOT_STREAM, 1);
    const int ENC = fl_graph_slot(g, "enc", C, FL_GSLOT_XSTREAM, 0);
    const int H1 = self_attn(g, c, X, FL_ATTN_CAUSAL, 0);
    const int ln = fl_graph_slot(g, "ln3", C, FL_GSLOT_WIDE, 0), lr = fl_graph_slot(g, "ln3_rstd", 1, FL_GSLOT_STAT, 0);
    const int xq = fl_graph_slot(g, "xq", QD, FL_GSLOT_WIDE, 0), xkv = fl_graph_slot(g, "xkv", 2 * QD, FL_GSLOT_WIDE, 0);
    const int xatt = fl_graph_slot(g, "xatt", QD, FL_GSLOT_WIDE, 0);
    const int xlse = fl_graph_slot(g, "xlse", c->n_heads, FL_GSLOT_STAT, 0);
    const int H2 = fl_graph_slot(g, "h2", C, FL_GSLOT_WIDE, 1);
    fl_graph_op(g, FL_GOP_NORM, H1, ln, -1, lr, 2, FL_ROLE_LN3_W, -1);
    fl_graph_op(g, FL_GOP_LINEAR, ln, xq, -1, -1, 4, FL_ROLE_XQ_W, -1);
    fl_graph_op(g, FL_GOP_LINEAR, ENC, xkv, -1, -1, 5, FL_ROLE_XKV_W, -1);
    fl_gop *a = fl_graph_op(g, FL_GOP_ATTN, xq, xatt, xlse, -1, -1, -1, -1);
    a->attn = FL_ATTN_CROSS;
    a->attn_flags = FL_GATTN_MASK | FL_GATTN_NOSCALE;
    a->in2 = (int8_t)xkv;
    if (drops(c)) a->p = FL_DROP_XATTN_W;
    sublayer_out(g, c, xatt, H2, 6, FL_ROLE_XO_W, FL_DROP_XATTN);
    fl_graph_op(g, FL_GOP_ADD, H1, H2, -1, -1, -1, -1, -1);
    ffn(g, c, H2, OUT);
    g->n_norms = 3;
    g->n_linears = 7;
}

/* encoder: ids -> shared embedding -> relative bias (bidirectional) -> blocks -> final norm -> the stream the
 * decoder reads; decoder: ids -> shared embedding -> relative bias (causal) -> blocks -> final norm -> head */
static void model_graph(const fl_model_config *c, fl_model_graph *mg) {
    (void)c;
    fl_model_graph_op(mg, FL_MOP_EMBED, -1, -1);
    fl_model_graph_op(mg, FL_MOP_RELBIAS, -1, -1);
    fl_model_graph_op(mg, FL_MOP_BLOCKS, -1, -1);
    fl_model_graph_op(mg, FL_MOP_NORM, FL_ROLE_NORM_E_W, -1);
    fl_model_graph_op(mg, FL_MOP_OUTPUT, -1, -1);
    fl_model_graph_stack(mg);
    fl_model_graph_op(mg, FL_MOP_EMBED, -1, -1);
    fl_model_graph_op(mg, FL_MOP_RELBIAS, -1, -1);
    fl_model_graph_op(mg, FL_MOP_BLOCKS, -1, -1);
    fl_model_graph_op(mg, FL_MOP_NORM, FL_ROLE_NORM_F_W, -1);
    fl_model_graph_op(mg, FL_MOP_HEAD_LM, -1, -1);
}

const fl_arch_info fl_arch_t5 = {
    .name = "t5",
    .display = "T5",
    .hf_block = "encoder.block.",
    .hf_embed = "shared.weight",
    .hf_layers_key = "num_layers",
    .lora_targets = targets,
    .lora_default = "q,v",
    .lora_switch = {"q", "k", "v", "o", "wi,wi_0,wi_1,wo"},
    .check = check,
    .layout = layout,
    .lora_modules = lora_modules,
    .block_graph = encoder_block,
    .block_graph2 = decoder_block,
    .model_graph = model_graph,
    .hf_embed_aliases = aliases,
    .hf_ignored = ignored,
    .tp_split = 1,
};
