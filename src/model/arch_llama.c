/* The LLaMA architecture (TinyLlama, OpenLLaMA, Llama 2/3, stories*): RMSNorm, RoPE, SwiGLU, grouped-query
 * attention, optional biases; HF names of transformers' LlamaForCausalLM. See fl_arch_info (fitllm/model.h). */
#include "fitllm/model.h"

static const char *const targets[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj", "lm_head", NULL};

static int layout(fl_layout_builder *b, const fl_model_config *c) {
    const int C = c->dim, L = c->n_layers, V = fl_config_vocab_rows(c, NULL), F = c->ffn_dim;
    const int QD = c->n_heads * c->head_dim, KVD = c->n_kv_heads * c->head_dim;
    int err = 0;
#define P(role, d0, d1, ...) (err |= fl_layout_add(b, FL_ROLE_##role, d0, d1, 0, __VA_ARGS__))
    fl_layout_group(b, 0);
    P(EMBED, V, C, "model.embed_tokens.weight");
    for (int l = 0; l < L; l++) {
        fl_layout_group(b, l + 1);
        P(LN1_W, C, 0, "model.layers.%d.input_layernorm.weight", l);
        /* q, k, v consecutive: together the fused (QD+2KVD, C) matrix. */
        P(QKV_W, QD, C, "model.layers.%d.self_attn.q_proj.weight", l);
        P(NONE, KVD, C, "model.layers.%d.self_attn.k_proj.weight", l);
        P(NONE, KVD, C, "model.layers.%d.self_attn.v_proj.weight", l);
        if (c->attention_bias) {
            P(QKV_B, QD, 0, "model.layers.%d.self_attn.q_proj.bias", l);
            P(NONE, KVD, 0, "model.layers.%d.self_attn.k_proj.bias", l);
            P(NONE, KVD, 0, "model.layers.%d.self_attn.v_proj.bias", l);
        }
        P(O_W, C, QD, "model.layers.%d.self_attn.o_proj.weight", l);
        if (c->attention_bias) P(O_B, C, 0, "model.layers.%d.self_attn.o_proj.bias", l);
        P(LN2_W, C, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        /* gate then up: the fused (2F, C) matrix. */
        P(FC_W, F, C, "model.layers.%d.mlp.gate_proj.weight", l);
        P(NONE, F, C, "model.layers.%d.mlp.up_proj.weight", l);
        if (c->mlp_bias) {
            P(FC_B, F, 0, "model.layers.%d.mlp.gate_proj.bias", l);
            P(NONE, F, 0, "model.layers.%d.mlp.up_proj.bias", l);
        }
        P(PROJ_W, C, F, "model.layers.%d.mlp.down_proj.weight", l);
        if (c->mlp_bias) P(PROJ_B, C, 0, "model.layers.%d.mlp.down_proj.bias", l);
    }
    fl_layout_group(b, L + 1);
    P(NORM_F_W, C, 0, "model.norm.weight");
    if (!c->tie_embeddings) P(HEAD, V, C, "lm_head.weight");
#undef P
    return err;
}

static int lora_modules(const fl_model_config *c, fl_arch_lora_module out[FL_ARCH_MAX_LORA_MODULES]) {
    const int C = c->dim, F = c->ffn_dim, QD = c->n_heads * c->head_dim, KVD = c->n_kv_heads * c->head_dim;
    const int QKV = QD + 2 * KVD;
    const fl_arch_lora_module t[] = {
        {"q_proj", "model.layers.%d.self_attn.q_proj", 0, QKV, 0, 0},
        {"k_proj", "model.layers.%d.self_attn.k_proj", QD, QKV, 0, 0},
        {"v_proj", "model.layers.%d.self_attn.v_proj", QD + KVD, QKV, 0, 0},
        {"o_proj", "model.layers.%d.self_attn.o_proj", 0, C, 0, 0},
        {"gate_proj", "model.layers.%d.mlp.gate_proj", 0, 2 * F, 0, 0},
        {"up_proj", "model.layers.%d.mlp.up_proj", F, 2 * F, 0, 0},
        {"down_proj", "model.layers.%d.mlp.down_proj", 0, C, 0, 0},
    };
    const int n = (int)(sizeof t / sizeof t[0]);
    for (int i = 0; i < n; i++) out[i] = t[i];
    return n;
}

const fl_arch_info fl_arch_llama = {
    .name = "llama",
    .display = "LLaMA",
    .rope = 1,
    .glu = 1,
    .hf_block = "model.layers.",
    .hf_embed = "model.embed_tokens.weight",
    .hf_layers_key = "num_hidden_layers",
    .lora_targets = targets,
    .lora_default = "q_proj,v_proj",
    .lora_switch = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj,up_proj,down_proj"},
    .layout = layout,
    .lora_modules = lora_modules,
};
