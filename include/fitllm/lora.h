/* fitllm: LoRA adapters as PEFT defines them (building blocks; the ops are
 * backend->lora_forward / lora_backward, the files fitllm/peft.h).
 *
 * One adapter on a linear layer W (out, in):  y = x W^T + scaling * (drop(x) A^T) B^T,
 * A (r, in), B (out, r); scaling = alpha / r (use_rslora: alpha / sqrt(r)); dropout only on
 * the LoRA branch input (inverted dropout: kept values times 1/(1-p), as torch).
 * PEFT init: A ~ kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); B = 0.
 */
#ifndef FITLLM_LORA_H
#define FITLLM_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/model.h"
#include "fitllm/quant4.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- dropout mask ---------------------------------------------------------------------------
 * Element i (= row * in + col of the branch input) is kept iff u(seed, i) >= p, where u is a
 * 24-bit uniform in [0, 1) from splitmix64(seed + i * 0x9E3779B97F4A7C15). A function of (seed, i)
 * only: the same mask whatever the thread count, and backward regenerates it. Kept values are
 * multiplied by fl_lora_dropout_scale(p) = 1.0f / (1.0f - p). Use a fresh seed per layer and step
 * (e.g. hash(run seed, step, micro-batch, layer, module)). */
static inline int fl_lora_dropout_keep(uint64_t seed, size_t i, float p) {
    uint64_t z = seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f) >= p;
}
static inline float fl_lora_dropout_scale(float p) { return 1.0f / (1.0f - p); }

/* ---- configuration ------------------------------------------------------------------------- */

#define FL_LORA_MAX_TARGETS 16

typedef struct {
    int r;                 /* rank > 0 */
    float alpha;           /* lora_alpha > 0 */
    float dropout;         /* in [0, 1) */
    int use_rslora;        /* scaling alpha / sqrt(r) instead of alpha / r */
    int n_targets;
    char targets[FL_LORA_MAX_TARGETS][32]; /* module suffixes: "q_proj", "c_attn", "attn.c_proj", ... */
    unsigned qkv_parts;    /* a fused q|k|v module (GPT-2's c_attn): the parts that train, bit 0 q, 1 k, 2 v (LitGPT's
                            * lora_query / _key / _value, fl_trainer_lora_config); 0: the whole module (PEFT's meaning of
                            * a target). The others' lora_B rows stay exactly 0: their gradient is zeroed each backward,
                            * so the optimizer never moves them, and the PEFT adapter on the whole module changes the
                            * enabled parts alone, as LitGPT's does (whose parts have an A each; here they share one) */
} fl_lora_config;

/* scaling = alpha / r, or alpha / sqrt(r) with use_rslora (fp32, as PEFT stores a Python float:
 * the value is computed in double and rounded once). */
float fl_lora_scaling(const fl_lora_config *c);

/* Module suffixes an architecture accepts (NULL-terminated). LLaMA: q_proj k_proj v_proj o_proj
 * gate_proj up_proj down_proj lm_head; GPT-2: c_attn c_proj attn.c_proj mlp.c_proj c_fc lm_head. A target
 * matches a module as PEFT's check_target_module_exists does: the module's name is the target or ends with
 * "." + target, so "c_proj" is both attn.c_proj and mlp.c_proj, "attn.c_proj" the attention's alone. */
const char *const *fl_lora_valid_targets(fl_arch arch);

/* Fill c from options: targets is a comma-separated list (spaces ignored) or "all-linear" (every
 * linear of the blocks, not lm_head, as PEFT). Errors (FL_ERR_INVALID): r <= 0, alpha <= 0,
 * dropout outside [0, 1), an unknown target (the message lists the valid names), an empty list,
 * lm_head on a model with tied embeddings (PEFT would adapt the head alone and a merge would
 * rewrite the shared embedding matrix; untie the model to adapt its head). */
fl_status fl_lora_config_init(fl_lora_config *c, const fl_model_config *mc, int r, float alpha, float dropout,
                              int use_rslora, const char *targets);
/* Validate an existing config against a model (same rules). */
fl_status fl_lora_config_validate(const fl_lora_config *c, const fl_model_config *mc);

/* ---- the adapted modules of a model -------------------------------------------------------- */

typedef struct {
    char name[FL_PARAM_NAME_MAX];  /* HF module path: "model.layers.0.self_attn.q_proj" */
    int layer;                     /* block index, or -1 for lm_head */
    int param_index;               /* index of "<name>.weight" in the model's fl_param_layout */
    int in, out;                   /* A (r, in), B (out, r) */
    int fused_row0;                /* first row of this module in the fused matrix the model's
                                      fl_linear multiplies: q 0, k QD, v QD+KVD (fused QKV);
                                      gate 0, up F (fused gate/up); 0 otherwise */
    int fused_rows;                /* rows of that fused matrix (QKV, 2F, ...): the y/dy row stride */
    int parts;                     /* a module that is itself a fused q|k|v (GPT-2's c_attn): 3, else 0 */
    unsigned frozen;               /* of those parts, the ones that never train (bit i: B rows [i out/parts,
                                      (i+1) out/parts) stay 0; fl_lora_config.qkv_parts' complement) */
} fl_lora_module;

/* List the modules the config adapts, in layout order (layer by layer; q, k, v, o, gate, up,
 * down; GPT-2 c_attn, attn.c_proj, c_fc, mlp.c_proj; then lm_head). *mods is malloc'd (free()).
 * A/B of module j live at adapter offsets from fl_lora_adapter_offsets. */
fl_status fl_lora_modules(const fl_lora_config *c, const fl_param_layout *lay, const fl_model_config *mc,
                          fl_lora_module **mods, int *n_mods);

/* The adapter elements that train: each module's A and the rows of its B that are not frozen (fl_lora_module.frozen):
 * what a LitGPT run counts as trainable. */
size_t fl_lora_trainable(const fl_lora_module *mods, int n_mods, int r);

/* The modules c adapts on mc, one per kind, in the architecture's table order: their names with the block number as
 * '*' ("transformer.h.*.attn.c_attn[q+v]": the parts that train of a module with frozen parts; "lm_head"),
 * comma-separated, into out (n bytes; "" on error, with the error set). Two configurations adapt the same modules the
 * same way iff their descriptions are equal. */
fl_status fl_lora_describe(const fl_lora_config *c, const fl_model_config *mc, char *out, size_t n);

/* Adapter parameter layout: A_j at off[2j], B_j at off[2j+1] (elements), total returned in *total.
 * One flat buffer: adapters PARAMS, their GRADS and OPTIM use the same layout. */
void fl_lora_adapter_offsets(const fl_lora_module *mods, int n_mods, int r, size_t *off, size_t *total);

/* PEFT init of one adapter: A ~ U(-1/sqrt(in), 1/sqrt(in)) from a splitmix64 stream seeded with
 * seed, B = 0. */
void fl_lora_init_adapter(float *A, float *B, int r, int in, int out, uint64_t seed);

/* ---- merge ----------------------------------------------------------------------------------
 * W (out, in), row stride ldw: W += scaling * (B @ A)  (PEFT get_delta_weight: (B @ A) * scaling,
 * the product accumulated in double and rounded once, then scaled and added in fp32). */
void fl_lora_merge(float *W, int ldw, const float *A, const float *B, int r, int in, int out, float scaling);
/* 4-bit base: dst (out, in) = deq(W) + scaling * (B @ A), f32 (the base stays quantized). */
fl_status fl_lora_merge_q4(float *dst, const fl_q4_weight *W, const float *A, const float *B, int r,
                           float scaling);

/* ---- LoRA on a model ---------------------------------------------------------
 * fl_model_lora_init attaches adapters for cfg's targets: adapter parameters
 * (PARAMS) and gradients (GRADS) in one flat buffer each, PEFT init (A
 * kaiming-uniform from seed, B = 0). The base model is frozen from then on: it
 * needs no gradient buffer (fl_model_alloc_grads is not called), and dX still
 * flows through every base linear. Activations for the adapters come with
 * fl_model_alloc_acts. An lm_head adapter (untied head) runs with the head,
 * chunk by chunk inside fl_model_forward (its activations hold one logits
 * chunk of rows), and in generation. */
fl_status fl_model_lora_init(fl_model *m, const fl_lora_config *cfg, uint64_t seed);
/* The same for a pipeline stage (fitllm/pp.h): its module j is the whole model's module j + base (the modules of the
 * blocks before the stage's first) for the initial values and the dropout stream, so a stage's adapters start and
 * drop as the whole model's do. */
fl_status fl_model_lora_init_at(fl_model *m, const fl_lora_config *cfg, uint64_t seed, int base);
/* Dropout seed of the next forward/backward (the trainer derives it from the
 * iteration, so a resumed run draws the same masks). */
void fl_model_lora_set_seed(fl_model *m, uint64_t seed);
/* Training (dropout on) or evaluation (dropout off, as PEFT's eval mode). */
void fl_model_lora_set_train(fl_model *m, int train);
/* Merge every adapter into the base weights (W += scaling B A); 4-bit entries stay quantized
 * and are read back merged (fl_model_read_param, saving). The model is then for saving only:
 * fl_model_forward refuses (the attached adapters would be applied twice). */
fl_status fl_model_lora_merge(fl_model *m);
/* The adapters of a LoRA model as the optimizer and the checkpoints see them: one flat fp32 PARAMS
 * buffer and its GRADS (numel elements each; the backend's memory), the modules, and each module j's
 * A and B at element offsets off[2j] and off[2j+1]. Returns 0 (and *v zeroed) without LoRA. */
typedef struct {
    const fl_lora_config *cfg;
    const fl_lora_module *mods;
    int n_mods;
    const size_t *off;
    size_t numel;
    float *params, *grads;
} fl_lora_adapters;
int fl_model_lora_adapters(const fl_model *m, fl_lora_adapters *v);
/* Bytes of adapter activations for (B, T) (ACTS) and scratch (WORKSPACE). Block modules keep
 * h (B*T, r) [and xd (B*T, in) with dropout]; lm_head keeps them for one logits chunk of rows. */
void fl_lora_sizing_acts(const fl_lora_config *cfg, const fl_lora_module *mods, int n_mods, int B, int T,
                         size_t *acts_bytes, size_t *work_bytes);
/* Of those ACTS bytes, what a training forward over (B, T) leaves for the backward: the block
 * modules' h [and xd] (lm_head's are consumed inside the forward; with activation checkpointing
 * the backward recomputes them all, so the caller counts 0 then). */
size_t fl_lora_sizing_live_acts(const fl_lora_config *cfg, const fl_lora_module *mods, int n_mods, int B, int T);
/* Gradient bytes a training forward writes: the lm_head adapter's A and B (0 without one). */
size_t fl_lora_sizing_head_grads(const fl_lora_config *cfg, const fl_lora_module *mods, int n_mods);

#ifdef __cplusplus
}
#endif
#endif
