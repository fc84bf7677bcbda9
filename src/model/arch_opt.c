/* The OPT architecture (Meta's OPT-125m ... 66b; BLIP-2's language model): pre-norm LayerNorm blocks with
 * biases (enable_bias), learned positions whose table starts 2 rows in, ReLU MLP (fc1, fc2), multi-head
 * attention with separate q/k/v projections, tied head; HF names of transformers' OPTForCausalLM.
 * Refused at config time (src/io/hf_config.c): post-norm blocks (do_layer_norm_before: false, OPT-350m)
 * and a projected embedding (word_embed_proj_dim != hidden_size). See fl_arch_info. */
#include "fitllm/model.h"

static const char *const targets[] = {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "lm_head", NULL};

static fl_status check(fl_model_config *c) {
    c->n_kv_heads = c->n_heads;
    if (c->attention_bias != c->mlp_bias)
        return fl_errorf(FL_ERR_FORMAT, "model config: OPT has one enable_bias for attention and MLP");
    if (c->head_dim * c->n_heads * (c->tp_size > 1 ? c->tp_size : 1) != c->dim)
        return fl_errorf(FL_ERR_FORMAT, "model config: OPT needs hidden_size %d divisible by num_attention_heads %d",
                         c->dim, c->n_heads);
    return FL_OK;
}

static int layout(fl_layout_builder *b, const fl_model_config *c) {
    const int C = c->dim, L = c->n_layers, V = fl_config_vocab_rows(c, NULL), F = c->ffn_dim, bias = c->attention_bias;
    const int QD = c->n_heads * c->head_dim; /* C, but a tensor-parallel rank's slice holds fewer heads */
    int err = 0;
#define P(role, d0, d1, ...) (err |= fl_layout_add(b, FL_ROLE_##role, d0, d1, 0, __VA_ARGS__))
    fl_layout_group(b, 0);
    P(EMBED, V, C, "model.decoder.embed_tokens.weight");
    P(POS_EMBED, c->max_seq + 2, C, "model.decoder.embed_positions.weight"); /* rows 0, 1 unused (pos_offset) */
    for (int l = 0; l < L; l++) {
        fl_layout_group(b, l + 1);
        P(LN1_W, C, 0, "model.decoder.layers.%d.self_attn_layer_norm.weight", l);
        P(LN1_B, C, 0, "model.decoder.layers.%d.self_attn_layer_norm.bias", l);
        /* q, k, v consecutive: together the fused (3C, C) matrix; their biases the fused (3C) bias */
        P(QKV_W, QD, C, "model.decoder.layers.%d.self_attn.q_proj.weight", l);
        P(NONE, QD, C, "model.decoder.layers.%d.self_attn.k_proj.weight", l);
        P(NONE, QD, C, "model.decoder.layers.%d.self_attn.v_proj.weight", l);
        if (bias) {
            P(QKV_B, QD, 0, "model.decoder.layers.%d.self_attn.q_proj.bias", l);
            P(NONE, QD, 0, "model.decoder.layers.%d.self_attn.k_proj.bias", l);
            P(NONE, QD, 0, "model.decoder.layers.%d.self_attn.v_proj.bias", l);
        }
        P(O_W, C, QD, "model.decoder.layers.%d.self_attn.out_proj.weight", l);
        if (bias) P(O_B, C, 0, "model.decoder.layers.%d.self_attn.out_proj.bias", l);
        P(LN2_W, C, 0, "model.decoder.layers.%d.final_layer_norm.weight", l);
        P(LN2_B, C, 0, "model.decoder.layers.%d.final_layer_norm.bias", l);
        P(FC_W, F, C, "model.decoder.layers.%d.fc1.weight", l);
        if (bias) P(FC_B, F, 0, "model.decoder.layers.%d.fc1.bias", l);
        P(PROJ_W, C, F, "model.decoder.layers.%d.fc2.weight", l);
        if (bias) P(PROJ_B, C, 0, "model.decoder.layers.%d.fc2.bias", l);
    }
    fl_layout_group(b, L + 1);
    P(NORM_F_W, C, 0, "model.decoder.final_layer_norm.weight");
    P(NORM_F_B, C, 0, "model.decoder.final_layer_norm.bias");
    if (!c->tie_embeddings) P(HEAD, V, C, "lm_head.weight");
#undef P
    return err;
}

static int lora_modules(const fl_model_config *c, fl_arch_lora_module out[FL_ARCH_MAX_LORA_MODULES]) {
    /* the fused q|k|v output is 3 x heads x head_dim wide: C for a whole model, C / N for a tensor-parallel slice */
    const int C = c->dim, F = c->ffn_dim, QD = c->n_heads * c->head_dim;
    const fl_arch_lora_module t[] = {
        {"q_proj", "model.decoder.layers.%d.self_attn.q_proj", 0, 3 * QD, 0, 0},
        {"k_proj", "model.decoder.layers.%d.self_attn.k_proj", QD, 3 * QD, 0, 0},
        {"v_proj", "model.decoder.layers.%d.self_attn.v_proj", 2 * QD, 3 * QD, 0, 0},
        {"out_proj", "model.decoder.layers.%d.self_attn.out_proj", 0, C, 0, 0},
        {"fc1", "model.decoder.layers.%d.fc1", 0, F, 0, 0},
        {"fc2", "model.decoder.layers.%d.fc2", 0, C, 0, 0},
    };
    const int n = (int)(sizeof t / sizeof t[0]);
    for (int i = 0; i < n; i++) out[i] = t[i];
    return n;
}

const fl_arch_info fl_arch_opt = {
    .name = "opt",
    .display = "OPT",
    .layernorm = 1,
    .relu = 1,
    .pos_offset = 2,
    .ffn_mult = 4,
    .hf_prefix = "model.", /* OPTModel checkpoints (the original facebook/opt-* .bin) name tensors without it */
    .hf_block = "decoder.layers.",
    .hf_embed = "decoder.embed_tokens.weight",
    .hf_layers_key = "num_hidden_layers",
    .lora_targets = targets,
    .lora_default = "q_proj,v_proj",
    .lora_switch = {"q_proj", "k_proj", "v_proj", "out_proj", "fc1,fc2"},
    .check = check,
    .layout = layout,
    .lora_modules = lora_modules,
};
