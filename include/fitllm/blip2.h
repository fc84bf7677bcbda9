/* fitllm: BLIP-2 (transformers' Blip2ForConditionalGeneration, the OPT language model), a composite of three models:
 *
 *   pixels (B, 3, H, W) -> vision tower (PATCH, pre-LayerNorm ViT blocks, post_layernorm) -> image features
 *   query tokens -> Q-Former (LayerNorm, post-LayerNorm BERT-style blocks cross-attending to the image features every
 *   cross_attention_frequency blocks) -> language projection -> the language model's input rows: they replace the
 *   image_token_index placeholders of the ids (transformers 5), or come before the ids when the config has none
 *   -> OPT decoder -> logits, the mean next-token cross-entropy.
 *
 * Each part is an fl_model (its own config, layout, parameter store and gradients: fl_blip2_part), the vision tower
 * and the Q-Former being architectures of their own (FL_ARCH_BLIP2_VISION / _QFORMER, src/model/arch_blip2.c; the
 * query tokens and the language projection are the Q-Former's); src/model/blip2*.c runs the three as one forward and
 * backward over an arena of its own. fp32 storage and activations (bf16-mixed: each part's bf16 weight copy in the
 * matmuls), one process (what is not done is refused by
 * name). docs/ARCHITECTURE.md "BLIP-2". */
#ifndef FITLLM_BLIP2_H
#define FITLLM_BLIP2_H

#include "fitllm/generate.h"
#include "fitllm/model.h"
#include "fitllm/peft.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    fl_model_config vision, qformer, text; /* the parts (the Q-Former's carries num_query_tokens, the projection) */
    int image_token;                       /* image_token_index; -1: none (the queries are prepended) */
    int n_queries;                         /* num_query_tokens */
    int bos_id, eos_id;                    /* the language model's text_config bos_token_id, eos_token_id (OPT: 2) */
} fl_blip2_config;

typedef struct fl_blip2 fl_blip2;
enum { FL_BLIP2_VISION = 0, FL_BLIP2_QFORMER = 1, FL_BLIP2_TEXT = 2, FL_BLIP2_PARTS = 3 };

/* config.json of a Blip2ForConditionalGeneration folder (transformers' defaults for absent keys); errors name the
 * key (vision_config.hidden_act, qformer_config.encoder_hidden_size, ...). */
fl_status fl_blip2_config_load(const char *config_json_path, fl_blip2_config *c);
/* Presets with the real shapes: blip2-opt-2.7b, blip2-opt-6.7b (also Salesforce/...), the CPU-sized blip2-micro;
 * FL_ERR_NOT_FOUND for other names (the Flan-T5 variants are named as not built yet). */
fl_status fl_blip2_preset(const char *name, fl_blip2_config *c);
/* Is this a BLIP-2 folder (config.json with model_type "blip-2")? */
int fl_blip2_is_folder(const char *dir);

/* A model of this config (random weights when seed != 0, else zeros), or loaded from an HF folder (config.json,
 * model.safetensors or its sharded index): every tensor is checked by name and shape, a missing or unexpected one
 * refused by name. */
fl_status fl_blip2_create(fl_blip2 **out, const fl_blip2_config *c, const fl_backend *be, fl_mem_pool *pool,
                          uint64_t seed);
fl_status fl_blip2_load(fl_blip2 **out, const char *dir, const fl_backend *be, fl_mem_pool *pool);
/* The same with each part's storage (st[FL_BLIP2_PARTS], NULL: fp32): fl_model_storage_for(precision) gives
 * bf16-true's bf16 store (the loader rounds the file's values to nearest even, as torch's .to(bfloat16)). */
fl_status fl_blip2_create_ex(fl_blip2 **out, const fl_blip2_config *c, const fl_backend *be, fl_mem_pool *pool,
                             uint64_t seed, const fl_model_storage *st);
fl_status fl_blip2_load_ex(fl_blip2 **out, const char *dir, const fl_backend *be, fl_mem_pool *pool,
                           const fl_model_storage *st);
void fl_blip2_free(fl_blip2 *b);
const fl_blip2_config *fl_blip2_get_config(const fl_blip2 *b);
fl_model *fl_blip2_part(fl_blip2 *b, int part);
size_t fl_blip2_param_count(const fl_blip2_config *c);

/* The precision policy of every part (after loading, before the activations): 32-true, or bf16-mixed (fp32 master
 * weights, a bf16 copy the matmuls read with fp32 accumulation, as PyTorch's autocast; the image parts' and the OPT
 * stack's activations stay fp32, the Flan-T5 language model's arena stores them in bf16 as its trainer does), or
 * bf16-true (the parts created with bf16 storage: fl_blip2_create_ex / _load_ex; bf16 parameters, gradients and AdamW
 * state, the entries the passes read as fp32 widened before use, each layout group's gradient staged in fp32 and
 * rounded once per micro-batch). fp16 storage and loss scaling (16-true, 16-mixed) are refused by name. */
fl_status fl_blip2_set_precision(fl_blip2 *b, const fl_precision *p);
fl_status fl_blip2_alloc_grads(fl_blip2 *b);
/* Gradient buffers for the parts in the mask (1 << FL_BLIP2_VISION | ...) only: the others are frozen (their backward
 * is skipped where nothing before them trains; dX still flows through a frozen language model to the Q-Former). A
 * part with LoRA adapters (fl_model_lora_init on fl_blip2_part) trains them with its base frozen. */
fl_status fl_blip2_alloc_grads_parts(fl_blip2 *b, int parts);
/* An HF folder of the model as it is now (LoRA adapters merged: fl_model_lora_merge first): model.safetensors under
 * the names fl_blip2_load reads (each tensor in src_dir's own shape), src_dir's config.json,
 * preprocessor_config.json and tokenizer files copied. */
fl_status fl_blip2_save(const fl_blip2 *b, const char *src_dir, const char *dst_dir);
/* The same with part k's parameters read from whole[k] (host memory, the part's layout order in its storage dtype:
 * an FSDP part's gathered parameters) where whole[k] is not NULL. */
fl_status fl_blip2_save_whole(const fl_blip2 *b, const char *src_dir, const char *dst_dir,
                              const void *const whole[FL_BLIP2_PARTS]);
/* A PEFT LoRA adapter (fl_peft_load) merged into the weights: W = (its saved base layer, else W) + scaling B A for
 * every module. The language model's modules are named language_model.<module> (as PEFT names them on
 * Blip2ForConditionalGeneration, and as fine-tuning saves them), the image parts' by their full names; a module that
 * is no linear layer of the model, or of another shape, is FL_ERR_INVALID naming it. */
fl_status fl_blip2_merge_peft(fl_blip2 *b, const fl_peft_adapter *a);
void fl_blip2_zero_grads(fl_blip2 *b);
/* ACTS bytes of part k in the arena allocated now: its residual stream, saved slots and norms (the Flan-T5 language
 * model: its own encoder-decoder arena); LoRA adapters' activations not included. 0 without an arena. */
size_t fl_blip2_acts_bytes(const fl_blip2 *b, int part);
/* Of those, the bytes kept for the backward. A part that trains nothing, with no part before it that trains (the frozen
 * vision tower of a fine-tuning run, a frozen Q-Former above it, every part of a loss / generate forward), is carved
 * lean when the arena is allocated: two residual buffers in turn and one block's slots, only its output kept for the
 * next part: 0 saved bytes. Allocate the arena after the gradients and adapters (a training forward that would need a
 * lean part's activations is refused). The Flan-T5 language model's own arena: all its ACTS. */
size_t fl_blip2_acts_saved_bytes(const fl_blip2 *b, int part);
/* Activation checkpointing on all three stacks (before the arena): each stack keeps its blocks' inputs (the residual
 * stream) and one block's saved slots per block graph, shared by its blocks and recomputed from the block's input in
 * the backward, as transformers' gradient_checkpointing (the Flan-T5 language model: its own arena's checkpointing).
 * The same gradients bit for bit; ACTS shrinks to the residual streams, the norms and one block per graph. */
fl_status fl_blip2_set_act_ckpt(fl_blip2 *b, int on);
/* Dropout in the training forwards (on 1, before the arena; 0: none, the default), where transformers'
 * Blip2ForConditionalGeneration drops in training mode at each config's rates: the vision tower's attention weights
 * (vision_config.attention_dropout), the Q-Former's embedding LayerNorm output, its three dense outputs before their
 * residual adds (hidden_dropout_prob) and its self- and cross-attention weights (attention_probs_dropout_prob), the
 * OPT language model's attention and FFN outputs (text_config.dropout) and attention weights (attention_dropout), or
 * the Flan-T5 one's (text_config.dropout_rate, fl_model_set_dropout). The masks follow the language model's
 * micro-batch seed (fl_model_adapters_seed on fl_blip2_part(b, FL_BLIP2_TEXT)): nothing is saved, the backward and a
 * checkpointed recompute regenerate them; a rate of 0 drops nothing (the bits without). FL_ERR_UNSUPPORTED: a
 * backend without the dropout op while a rate is positive. */
fl_status fl_blip2_set_dropout(fl_blip2 *b, int on);
/* What the model holds live after each phase of a training step (fitllm/model.h fl_model_live for one model;
 * docs/ARCHITECTURE.md "Reserved and live memory"), the regions into out (FL_BLIP2_LIVE_MAX), their count returned;
 * the fine-tuning records them at its phase boundaries (fl_mem_phase_edge). ZEROED / UPDATED: every part's gradients
 * 0. FORWARD (a training forward): the arena's saved activations the backward reads, the OPT head's d(final norm out)
 * and ids (WORKSPACE), the LoRA adapters' activations, the OPT head's gradient (at least); the Flan-T5 language
 * model's own arena as fl_model_live. BACKWARD: the activations 0, every trained part's gradients in full. */
#define FL_BLIP2_LIVE_MAX (FL_MODEL_LIVE_MAX + 2 + 2 * FL_BLIP2_PARTS)
int fl_blip2_live(const fl_blip2 *b, fl_live_phase phase, fl_live_region *out);
/* The arena for B images and T language-model ids per sequence. */
fl_status fl_blip2_alloc_acts(fl_blip2 *b, int B, int T);

/* pixels (B, 3, image_size, image_size) float32 (the processor's pixel_values), ids (B, T): the language model's
 * input (with image_token: num_query_tokens placeholders per sequence, replaced in order by the projected queries;
 * without: the queries go first, the logits then have T + num_query_tokens rows per sequence), targets (B, T) or
 * NULL: the label of each id's position (the next token; FL_IGNORE_INDEX: none). grad_scale > 0: a training forward
 * (the head's backward runs here). logits_out (B, rows, V) or NULL. *loss: the mean cross-entropy of the valid
 * targets (NULL: not wanted). */
fl_status fl_blip2_forward(fl_blip2 *b, const float *pixels, const int32_t *ids, const int32_t *targets, int B, int T,
                           float grad_scale, float *logits_out, float *loss);
/* The Flan-T5 variant (an encoder-decoder language model): the arena for B images, Ts source ids (the
 * placeholders and the prompt) and Tt decoder rows; dec (B, Tt) the decoder's input (the start token, then the labels
 * but the last), targets (B, Tt) the labels (FL_IGNORE_INDEX: none); logits_out (B, Tt, V); *loss T5's mean. */
fl_status fl_blip2_alloc_acts_s2s(fl_blip2 *b, int B, int Ts, int Tt);
fl_status fl_blip2_forward_s2s(fl_blip2 *b, const float *pixels, const int32_t *ids, const int32_t *dec,
                               const int32_t *targets, int B, int Ts, int Tt, float grad_scale, float *logits_out,
                               float *loss);
/* Every part's gradients (+=) from the last training forward. */
fl_status fl_blip2_backward(fl_blip2 *b);
/* Greedy captioning of one image: the language model's input (the Flan-T5 variant's source) is the placeholders (or
 * nothing), BOS (OPT), then the prompt's ids; up to max_new (>= 0) tokens into out, their count in *n_out. It stops
 * after EOS, at max_new, or (OPT) when the sequence (the queries, BOS, the prompt and the new tokens) reaches the
 * language model's context, as fl_generate does (a prompt beyond it: FL_ERR_INVALID); *why (may be NULL) says which.
 * out holds min(max_new, the context) ids (the Flan-T5 variant: max_new). */
fl_status fl_blip2_generate(fl_blip2 *b, const float *pixels, const int32_t *prompt, int n_prompt, int max_new,
                            int32_t *out, int *n_out, fl_gen_stop *why);

#ifdef __cplusplus
}
#endif

#endif
