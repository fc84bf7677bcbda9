/* The GPT-2 architecture: LayerNorm, learned positions, tanh-GELU MLP, biases everywhere, multi-head
 * attention; HF names and Conv1D (in, out) weights of transformers' GPT2LMHeadModel. See fl_arch_info. */
#include "fitllm/model.h"

/* "c_proj" is both attn.c_proj and mlp.c_proj (PEFT's suffix match), "attn.c_proj" / "mlp.c_proj" one of them */
static const char *const targets[] = {"c_attn", "c_proj", "attn.c_proj", "mlp.c_proj", "c_fc", "lm_head", NULL};

static fl_status check(fl_model_config *c) {
    c->attention_bias = 1;
    c->mlp_bias = 1;
    c->n_kv_heads = c->n_heads;
    if (c->head_dim * c->n_heads * (c->tp_size > 1 ? c->tp_size : 1) != c->dim)
        return fl_errorf(FL_ERR_FORMAT, "model config: GPT-2 needs n_embd %d divisible by n_head %d", c->dim, c->n_heads);
    return FL_OK;
}

static int layout(fl_layout_builder *b, const fl_model_config *c) {
    const int C = c->dim, L = c->n_layers, V = fl_config_vocab_rows(c, NULL), F = c->ffn_dim;
    const int QD = c->n_heads * c->head_dim; /* C, but a tensor-parallel rank's slice holds fewer heads */
    int err = 0;
#define P(role, d0, d1, tr, ...) (err |= fl_layout_add(b, FL_ROLE_##role, d0, d1, tr, __VA_ARGS__))
    fl_layout_group(b, 0);
    P(EMBED, V, C, 0, "transformer.wte.weight");
    P(POS_EMBED, c->max_seq, C, 0, "transformer.wpe.weight");
    for (int l = 0; l < L; l++) {
        fl_layout_group(b, l + 1);
        P(LN1_W, C, 0, 0, "transformer.h.%d.ln_1.weight", l);
        P(LN1_B, C, 0, 0, "transformer.h.%d.ln_1.bias", l);
        P(QKV_W, 3 * QD, C, 1, "transformer.h.%d.attn.c_attn.weight", l);
        P(QKV_B, 3 * QD, 0, 0, "transformer.h.%d.attn.c_attn.bias", l);
        P(O_W, C, QD, 1, "transformer.h.%d.attn.c_proj.weight", l);
        P(O_B, C, 0, 0, "transformer.h.%d.attn.c_proj.bias", l);
        P(LN2_W, C, 0, 0, "transformer.h.%d.ln_2.weight", l);
        P(LN2_B, C, 0, 0, "transformer.h.%d.ln_2.bias", l);
        P(FC_W, F, C, 1, "transformer.h.%d.mlp.c_fc.weight", l);
        P(FC_B, F, 0, 0, "transformer.h.%d.mlp.c_fc.bias", l);
        P(PROJ_W, C, F, 1, "transformer.h.%d.mlp.c_proj.weight", l);
        P(PROJ_B, C, 0, 0, "transformer.h.%d.mlp.c_proj.bias", l);
    }
    fl_layout_group(b, L + 1);
    P(NORM_F_W, C, 0, 0, "transformer.ln_f.weight");
    P(NORM_F_B, C, 0, 0, "transformer.ln_f.bias");
    if (!c->tie_embeddings) P(HEAD, V, C, 0, "lm_head.weight");
#undef P
    return err;
}

/* PEFT matches target names as suffixes of the module names: "c_proj" adapts both attn.c_proj and mlp.c_proj,
 * "attn.c_proj" the attention's alone (fl_lora_modules). c_attn is q|k|v in one module: 3 parts. */
static int lora_modules(const fl_model_config *c, fl_arch_lora_module out[FL_ARCH_MAX_LORA_MODULES]) {
    const int C = c->dim, F = c->ffn_dim;
    const fl_arch_lora_module t[] = {
        {"c_attn", "transformer.h.%d.attn.c_attn", 0, 3 * C, 0, 3},
        {"attn.c_proj", "transformer.h.%d.attn.c_proj", 0, C, 0, 0},
        {"c_fc", "transformer.h.%d.mlp.c_fc", 0, F, 0, 0},
        {"mlp.c_proj", "transformer.h.%d.mlp.c_proj", 0, C, 0, 0},
    };
    const int n = (int)(sizeof t / sizeof t[0]);
    for (int i = 0; i < n; i++) out[i] = t[i];
    return n;
}

const fl_arch_info fl_arch_gpt2 = {
    .name = "gpt2",
    .display = "GPT-2",
    .layernorm = 1,
    .conv1d = 1,
    .scaled_proj_init = 1,
    .ffn_mult = 4,
    .hf_prefix = "transformer.",
    .hf_block = "h.",
    .hf_embed = "wte.weight",
    .hf_layers_key = "n_layer",
    .lora_targets = targets,
    .lora_default = "c_attn",
    /* LitGPT: query / key / value are the parts of the fused c_attn (only the enabled ones train: qkv_parts),
     * projection the attention's c_proj, mlp c_fc and the MLP's c_proj */
    .lora_switch = {"c_attn", "c_attn", "c_attn", "attn.c_proj", "c_fc,mlp.c_proj"},
    .check = check,
    .layout = layout,
    .lora_modules = lora_modules,
};
