/* fitllm: transformer models (LLaMA and GPT-2 families) with explicit
 * forward/backward, flat per-block parameter storage and a sized activation
 * arena.
 *
 * One decoder implementation covers both families; the config says which
 * norm (RMSNorm / LayerNorm), position scheme (RoPE / learned), MLP (SwiGLU /
 * GELU) and biases are used, as LitGPT's single GPT class does.
 *
 * Parameter storage: ONE flat buffer (tag PARAMS) laid out group by group:
 *   group 0        embeddings: wte (V,C) [, wpe (maxT,C)]
 *   group 1..L     block l-1: ln1 w[,b] | q,k,v weights (consecutive rows, so
 *                  together they ARE the fused (QKV,C) matrix) [| q,k,v biases]
 *                  | o (C,NH*HD) [,b] | ln2 w[,b] | fc (gate rows then up rows
 *                  for SwiGLU: fused (2F,C); GPT-2 c_fc (F,C)) [,b] | proj (C,F) [,b]
 *   group L+1      head: final norm w[,b] [| lm_head (V,C) if untied]
 * Grads and optimizer state use the same layout, so a ZeRO shard, an FSDP
 * gather, an offload range or an all-reduce bucket is a contiguous slice.
 * Every entry of the layout is one Hugging Face tensor (HF name, HF shape in
 * our (out,in) orientation); GPT-2 Conv1D tensors are stored transposed on
 * disk ([in,out]) and flagged so the loader/saver transposes.
 */
#ifndef FITLLM_MODEL_H
#define FITLLM_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/backend.h"
#include "fitllm/mem.h"
#include "fitllm/precision.h"
#include "fitllm/quant4.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* FL_ARCH_BLIP2_VISION / _QFORMER: BLIP-2's vision tower and Q-Former, parts of the composite fl_blip2 (fitllm/blip2.h) */
typedef enum {
    FL_ARCH_LLAMA = 0, FL_ARCH_GPT2, FL_ARCH_OPT, FL_ARCH_BERT, FL_ARCH_T5, FL_ARCH_BLIP2_VISION, FL_ARCH_BLIP2_QFORMER,
    FL_ARCH_COUNT
} fl_arch;

typedef struct {
    fl_arch arch;
    char name[64];       /* preset or model_type, informational */
    int vocab_size;      /* V */
    int dim;             /* C: hidden_size / n_embd */
    int n_layers;        /* L */
    int n_heads;         /* NH */
    int n_kv_heads;      /* NKV (GPT-2: = NH) */
    int head_dim;        /* HD (LLaMA: head_dim or C/NH) */
    int ffn_dim;         /* F: intermediate_size (GPT-2: n_inner or 4C) */
    int max_seq;         /* max_position_embeddings / n_positions */
    float norm_eps;      /* rms_norm_eps / layer_norm_epsilon */
    float rope_theta;    /* LLaMA only */
    fl_rope_scaling rope_scaling;
    int tie_embeddings;  /* lm_head shares wte */
    int attention_bias;  /* biases on q,k,v,o (GPT-2: always) */
    int mlp_bias;        /* biases on fc/proj (GPT-2: always) */
    int type_vocab_size; /* token types (BERT's segment embeddings, role TYPE_EMBED); 0: none */
    /* encoder-decoder (T5): n_layers is the encoder's block count, n_dec_layers the decoder's (0: one stack) */
    int n_dec_layers;
    int rel_buckets, rel_max_dist; /* T5's bucketed relative position bias (buckets, max distance) */
    int ffn_gated;       /* T5 v1.1 / Flan: gated-GELU FFN (wi_0 | wi_1 fused, GEGLU); 0: ReLU (v1.0) */
    int head_scale;      /* T5 v1.0: the decoder output is scaled by dim^-0.5 before the (tied) head */
    int dec_start_id, pad_id, eos_id; /* T5: decoder_start_token_id, pad_token_id, eos_token_id */
    float dropout_rate;  /* T5: config.json's dropout_rate (transformers' default 0.1), read and written back;
                          * applied in training passes when dropout_on (below) */
    float attn_dropout_rate; /* dropout on the attention weights where it is its own key (OPT's attention_dropout,
                              * BLIP-2's Q-Former attention_probs_dropout_prob and vision attention_dropout; T5 drops
                              * its weights at dropout_rate); applied when dropout_on. OPT and BLIP-2's parts also read
                              * dropout_rate (OPT's dropout, the Q-Former's hidden_dropout_prob) */
    int dropout_on;      /* T5: apply dropout_rate in training forwards (the trainer sets it, fl_model_set_dropout,
                          * before allocating the activations: the block graphs get their DROPOUT ops); 0: none (the
                          * library's passes, loss, generate, BLIP-2). Never read from or written to config.json */
    /* Tensor parallelism (src/model/tp.c, fitllm/tp.h): this config is rank tp_rank's slice of a model split
     * over tp_size ranks (n_heads, n_kv_heads and ffn_dim are the rank's; head_dim and everything else the
     * model's); 0 or 1: the whole model. Never read from or written to config.json. The token embeddings and
     * lm_head are vocabulary-parallel too: the rank holds rows [tp_rank V / tp_size, (tp_rank + 1) V / tp_size)
     * (fl_config_vocab_rows); vocab_size stays the model's. */
    int tp_size, tp_rank;
    /* BLIP-2's parts (fitllm/blip2.h; 0 elsewhere): the vision tower's image_size and patch_size (max_seq = the patches
     * + the class token); the Q-Former's num_query_tokens (= max_seq), its cross-attention's key width
     * (encoder_hidden_size) and frequency (a cross-attention in blocks 0, every, 2 every, ...), and the language
     * projection's output width (the language model's hidden size) */
    int image_size, patch_size;
    int n_queries, xattn_dim, xattn_every, proj_dim;
    int gelu_exact; /* BLIP-2's parts: the MLP's GELU is the exact erf one (hidden_act "gelu"), else the tanh one */
    /* A pipeline stage of an encoder-decoder (fitllm/pp.h, fl_pp_stage_config; 0 elsewhere): pp_enc the whole model's
     * encoder blocks, pp_first the stage's first block among the whole's [encoder; decoder] blocks. n_layers and
     * n_dec_layers are the stage's (either may be 0). Never read from or written to config.json. */
    int pp_enc, pp_first;
    /* The decoder's LM head: rows of its (rows, V) logits chunk (0: FL_LOGITS_CHUNK_BYTES of logits,
     * fl_logits_chunk_rows). The lab's scaled presets (lab-*) set the real model's rows / 16: the tokens scale by 1/16
     * with the widths, so the chunk keeps the real one's share of the memory (a fixed 32 MiB chunk would be ~256x it).
     * Never read from or written to config.json. */
    int logits_chunk_rows;
} fl_model_config;

/* The token-embedding / lm_head rows a config holds: a tensor-parallel slice (tp_size > 1) holds rows
 * [tp_rank V / tp_size, (tp_rank + 1) V / tp_size) of the whole table (the first at *lo; sizes differ by at most
 * one row when tp_size does not divide V); else the whole vocabulary, lo 0. */
static inline int fl_config_vocab_rows(const fl_model_config *c, int *lo) {
    if (c->tp_size <= 1) {
        if (lo) *lo = 0;
        return c->vocab_size;
    }
    const int a = (int)((long long)c->tp_rank * c->vocab_size / c->tp_size);
    const int b = (int)((long long)(c->tp_rank + 1) * c->vocab_size / c->tp_size);
    if (lo) *lo = a;
    return b - a;
}

/* Fill derived defaults and validate (positive sizes, NH % NKV == 0, ...).
 * Errors name the offending key. */
fl_status fl_config_validate(fl_model_config *cfg);

/* ---- architectures --------------------------------------------------------
 * Everything the engine knows about one architecture, in one descriptor per fl_arch, defined
 * with its config rules, its HF-named layout and its LoRA modules in src/model/arch_<name>.c.
 * The block graph (src/model/graph.c) reads the feature flags; the rest of the engine reads the
 * descriptor instead of comparing fl_arch values. */
typedef struct fl_layout_builder fl_layout_builder;
struct fl_block_graph_s; /* src/model/graph.h: the block graph and the model graph around it */
struct fl_model_graph_s;
typedef struct {
    const char *target;   /* PEFT target module name ("q_proj", "c_attn") */
    const char *fmt;      /* the module's HF name for block %d (of its stack) */
    int row0, rows;       /* its rows of the fused output (q|k|v, gate|up), and the fused output's rows */
    int stack;            /* the stack whose blocks have it (an encoder-decoder: 0 encoder, 1 decoder; else 0) */
    int parts;            /* the module is a fused q|k|v itself (GPT-2's c_attn): 3 (fl_lora_config.qkv_parts), else 0 */
} fl_arch_lora_module;
#define FL_ARCH_MAX_LORA_MODULES 24
/* LINEAR ops a block may have (the block graph's linear index: 0 qkv, 1 o, 2 fc, 3 proj; T5's decoder block adds
 * 4 cross q, 5 cross k|v, 6 cross o): fl_model_attach_adapter's `linear` */
#define FL_MODEL_BLOCK_LINEARS 8
/* An architecture whose config.json is read from a table of keys (src/io/hf_config.c's generic parser)
 * instead of a parser of its own: the config keys of each field (NULL: not read; the field keeps 0 and
 * fl_config_validate's defaults apply). */
typedef struct {
    const char *dim, *ffn, *heads, *kv_heads, *layers, *max_seq, *vocab, *eps, *type_vocab;
    const char *act;           /* the activation's key ("hidden_act") ... */
    const char *const *acts;   /* ... and the values this build runs, NULL-terminated (the first is the default) */
    float eps_default;         /* when the eps key is absent */
} fl_arch_hf_keys;
typedef struct {
    const char *name;          /* "llama", "gpt2": JSON and bench output */
    const char *display;       /* "LLaMA", "GPT-2": messages */
    int layernorm;             /* LayerNorm (mean, rstd, bias) instead of RMSNorm */
    int rope;                  /* rotary positions (else a learned position table, role POS_EMBED) */
    int glu;                   /* gated MLP: the fused (2F, C) gate|up matrix and SwiGLU (else relu or GELU) */
    int relu;                  /* a plain MLP's activation is ReLU (OPT), else the tanh GELU (GPT-2) */
    int pos_offset;            /* the learned position table has this many leading rows no position reads
                                * (OPT: 2); position p reads row p + pos_offset */
    int conv1d;                /* HF stores the linears as Conv1D (in, out): transposed on load and save,
                                * PEFT's fan_in_fan_out */
    int scaled_proj_init;      /* random init: the residual projections (O_W, PROJ_W) at std / sqrt(2 L) */
    int ffn_mult;              /* ffn_dim = ffn_mult x dim when the config gives none (0: required) */
    const char *hf_prefix;     /* an optional leading prefix of the HF tensor names ("transformer."), or NULL */
    const char *hf_block;      /* the HF names' block prefix, after hf_prefix ("model.layers.", "h.") */
    const char *hf_embed;      /* the token embedding's HF name, after hf_prefix */
    const char *hf_layers_key; /* config.json's layer count key ("num_hidden_layers", "n_layer"): messages */
    const char *const *lora_targets; /* the valid PEFT target names, NULL-terminated (lm_head included) */
    const char *lora_default;  /* the default target list of `fitllm bench --lora` ("q_proj,v_proj") */
    /* the PEFT targets of LitGPT's --lora_query, _key, _value, _projection, _mlp switches (comma lists); the same
     * target for query, key and value is a fused q|k|v module (its table entry's parts: 3), whose disabled parts are
     * frozen (fl_lora_config.qkv_parts) */
    const char *lora_switch[5];
    /* the architecture's own config rules, after the generic ones (forced fields, extra checks) */
    fl_status (*check)(fl_model_config *c);
    /* the HF-named flat layout: fl_layout_add / fl_layout_group (src/model/layout.c); nonzero on OOM */
    int (*layout)(fl_layout_builder *b, const fl_model_config *c);
    /* the block LoRA modules (lm_head excluded), in the order adapters are laid out; returns the count */
    int (*lora_modules)(const fl_model_config *c, fl_arch_lora_module out[FL_ARCH_MAX_LORA_MODULES]);
    /* its block, when it is not the pre-norm decoder block the flags above describe (src/model/graph.h:
     * fl_graph_slot, fl_graph_op; fl_block_graph_build checks and derives the rest), or NULL */
    void (*block_graph)(const fl_model_config *c, struct fl_block_graph_s *g);
    /* a second stack's block (an encoder-decoder's decoder block, cross-attending to the first stack's output:
     * cfg.n_dec_layers blocks after the first stack's), or NULL */
    void (*block_graph2)(const fl_model_config *c, struct fl_block_graph_s *g);
    /* the model around the blocks, when it is not the decoder's (embeddings, blocks, final norm, LM head), or NULL */
    void (*model_graph)(const fl_model_config *c, struct fl_model_graph_s *mg);
    /* config.json by table (see fl_arch_hf_keys): the model_type values it answers to (NULL-terminated) and
     * its keys; NULL for the architectures hf_config.c parses with code of their own */
    const char *const *hf_model_types;
    const fl_arch_hf_keys *hf_keys;
    /* HF tensor names that are copies of the token embedding (skipped on load after a shape check, as a tied
     * lm_head.weight), and names transformers ignores on load; NULL-terminated, or NULL */
    const char *const *hf_embed_aliases, *const *hf_ignored;
    /* its own graphs (block_graph, block_graph2, model_graph) are split by tensor parallelism (src/model/graph_tp.c's
     * roles, fl_tp_entry_split: T5); 0 refuses --tensor_parallel for an architecture with graphs of its own */
    int tp_split;
} fl_arch_info;
/* The descriptor of a (valid) architecture; NULL for a value outside fl_arch. */
const fl_arch_info *fl_arch_get(fl_arch a);

/* ---- parameter layout ---------------------------------------------------- */

#define FL_PARAM_NAME_MAX 96

/* What a layout entry is to the graph, resolved once when the layout is built (the forward and
 * backward look parameters up by role and group, never by name). A fused matrix is named by its
 * first entry: QKV_W is q_proj (LLaMA; k and v follow it) or c_attn (GPT-2), FC_W is gate_proj
 * (up follows it) or c_fc. Entries inside a fused run (k, v, up and their biases) have no role. */
typedef enum {
    FL_ROLE_NONE = -1,
    /* outer: group 0 (embeddings) and L+1 (final norm, head) */
    FL_ROLE_EMBED = 0, FL_ROLE_POS_EMBED, FL_ROLE_NORM_F_W, FL_ROLE_NORM_F_B, FL_ROLE_HEAD,
    /* per block: groups 1..L */
    FL_ROLE_LN1_W, FL_ROLE_LN1_B, FL_ROLE_LN2_W, FL_ROLE_LN2_B, FL_ROLE_QKV_W, FL_ROLE_QKV_B, FL_ROLE_O_W,
    FL_ROLE_O_B, FL_ROLE_FC_W, FL_ROLE_FC_B, FL_ROLE_PROJ_W, FL_ROLE_PROJ_B,
    /* outer, group 0: token-type embeddings and the embedding norm (BERT) */
    FL_ROLE_TYPE_EMBED, FL_ROLE_EMB_NORM_W, FL_ROLE_EMB_NORM_B,
    /* encoder-decoder (T5): a stack's relative position bias table (its first block's group), the cross-attention's
     * norm and linears (decoder blocks: q, the fused k|v of the encoder output, o), the encoder's final norm (last group) */
    FL_ROLE_REL_BIAS, FL_ROLE_LN3_W, FL_ROLE_XQ_W, FL_ROLE_XKV_W, FL_ROLE_XO_W, FL_ROLE_NORM_E_W,
    /* BLIP-2: the patch embedding (a (C, 3 p p) matrix: the convolution's weight flattened) and its bias, the class
     * token, the Q-Former's learned queries (group 0); the cross-attention's biases and norm bias (Q-Former blocks);
     * the language projection (the Q-Former's last group) */
    FL_ROLE_PATCH_W, FL_ROLE_PATCH_B, FL_ROLE_CLS_EMBED, FL_ROLE_QUERY_EMBED, FL_ROLE_LN3_B, FL_ROLE_XQ_B,
    FL_ROLE_XKV_B, FL_ROLE_XO_B, FL_ROLE_LMPROJ_W, FL_ROLE_LMPROJ_B,
    FL_ROLE_COUNT
} fl_param_role;

typedef struct {
    char name[FL_PARAM_NAME_MAX]; /* HF name, e.g. "model.layers.0.self_attn.q_proj.weight" */
    int ndim;                     /* 1 or 2 */
    int64_t shape[2];             /* our orientation: (out, in) for weights */
    size_t offset;                /* element offset into the flat buffer */
    size_t numel;
    int group;                    /* 0 embed, 1..L blocks, L+1 head */
    int transposed_on_disk;       /* GPT-2 Conv1D: file holds shape[1] x shape[0] */
    fl_param_role role;
} fl_param_info;

typedef struct {
    fl_param_info *params;  /* n entries, in storage order */
    int n;
    int n_groups;           /* L + 2 */
    size_t *group_offset;   /* n_groups + 1 element offsets; group g = [off[g], off[g+1]) */
    size_t numel;           /* total elements */
    int *role_index;        /* (n_groups x FL_ROLE_COUNT) entry of each role in each group, or -1 */
} fl_param_layout;

/* Build the layout for a config (malloc'd bookkeeping, not model memory). */
fl_status fl_layout_build(fl_param_layout *lay, const fl_model_config *cfg);
/* For an architecture's layout function: start layout group g (0 embeddings, 1..L blocks, L+1 final
 * norm and head) at the current offset; add the next entry (HF name from fmt; d1 0: 1-D; transposed:
 * stored (d1, d0) on disk). fl_layout_add returns nonzero when out of memory. */
void fl_layout_group(fl_layout_builder *b, int g);
int fl_layout_add(fl_layout_builder *b, fl_param_role role, int64_t d0, int64_t d1, int transposed, const char *fmt,
                  ...) __attribute__((format(printf, 6, 7)));
void fl_layout_free(fl_param_layout *lay);
/* Index of an entry by HF name, or -1. Accepts GPT-2 names without the
 * "transformer." prefix too. */
int fl_layout_find(const fl_param_layout *lay, const char *name);
/* Index of group g's entry of role r (outer roles: group 0 or L+1; block roles: 1..L), or -1
 * (absent: a bias the config does not have, a tied head). */
static inline int fl_layout_role(const fl_param_layout *lay, int g, fl_param_role r) {
    return (g < 0 || g >= lay->n_groups || r < 0 || r >= FL_ROLE_COUNT) ? -1 : lay->role_index[g * FL_ROLE_COUNT + r];
}

/* ---- sizing (shared by the runtime and the planner) ---------------------- */

/* Number of parameters (elements) for a config. */
size_t fl_sizing_param_count(const fl_model_config *cfg);

/* Activation arena and workspace for micro-batch (B,T), in bytes, float32.
 * ACTS = what backward needs (per layer plus final norm); WORKSPACE = scratch
 * (activation gradients, one logits chunk, rope tables). */
typedef struct {
    size_t acts_bytes;
    size_t workspace_bytes;
    size_t per_layer_acts_bytes;
    int logits_chunk_rows;  /* rows of (rows, V) logits processed at once */
    /* live bytes (fl_mem_set_live): of acts_bytes, what a training forward leaves for the
     * backward (residual stream, saved block activations or their 16-bit copies, norm and
     * attention statistics; not a checkpointed or shared compute buffer, not lnf's output);
     * of workspace_bytes, what a training forward hands to the backward (d(lnf), token ids)
     * and what is live from allocation on (the RoPE tables). Data bytes, no padding. */
    size_t acts_saved_bytes;
    size_t work_handoff_bytes, work_const_bytes;
} fl_act_sizes;
void fl_sizing_acts(const fl_model_config *cfg, int B, int T, fl_act_sizes *out);

/* Options that change the activation arena. */
typedef struct {
    int act_ckpt; /* activation checkpointing: keep only each block's input (L+1 residuals)
                   * plus ONE block's activations, recomputed in backward */
    fl_dtype act_dtype; /* storage of the activations (fl_precision.act_dtype; FL_F32 = 0 default).
                   * BF16 (bf16-true, bf16-mixed): stored end to end in bf16: the residual stream
                   * res[0..L] and every block slot, rounded as each op writes it (the forward reads
                   * what is stored); ACTS keeps the bf16 rows and the fp32 per-row statistics (norm
                   * mean/rstd, attention lse), the fp32 views the ops compute in are WORKSPACE;
                   * with act_ckpt only the bf16 residual rows are saved.
                   * F16 without act_ckpt: every block computes in ONE shared fp32 layer
                   * buffer; after its forward, its (N, width) activations (ln1, qkv, att,
                   * res_mid, ln2, fc, act) are rounded (RNE) into a per-layer 16-bit region and
                   * widened back into the shared buffer before its backward. The residual
                   * stream res[0..L], the final norm's output and the small per-row
                   * statistics stay fp32. Ignored with act_ckpt (only the fp32 residuals are
                   * saved there). */
    int dw_bf16;  /* bf16 weight-gradient GEMMs (bf16 compute policies with trainable weights): a
                   * WORKSPACE scratch of N x max(C, QD, F) bf16 holds the layer input rounded to
                   * bf16, and dW = dy^T x runs bf16 x bf16 with fp32 accumulation into the fp32
                   * gradient (as autocast / bf16-true do in PyTorch) */
    fl_dtype head_widen; /* FL_BF16 / FL_F16: the lm_head's 16-bit weight is widened ONCE per forward
                   * into a WORKSPACE fp32 copy (V x C floats) and the chunked head runs fp32
                   * GEMMs on it, with a BF16 head's inputs (the chunk's rows, the logits'
                   * gradient) rounded to bf16 first: the same products as the 16-bit GEMM, whose
                   * widening path would otherwise widen the whole weight again in every chunk's
                   * forward and backward. Set when the backend's 16-bit GEMM widens
                   * (fl_backend.gemm_widens16 / fl_cpu_gemm_widens16) and the user opted in with
                   * FITLLM_HEAD_WIDEN=1 (off by default: no measurable step gain on Zen 3, see
                   * docs/BENCHMARKS.md): fl_head_widen_dtype. FL_F32 (0): off. */
    size_t backend_scratch; /* bytes of the backend's op scratch (fl_backend.scratch_bytes) carved
                   * from WORKSPACE and lent to its ops (fl_backend.set_scratch), for models whose
                   * ops need one: 16-bit matmuls or 4-bit weights (fl_model_backend_scratch) */
    int seq_par;  /* sequence parallelism over the config's tp_size ranks (fl_model_set_sp): the residual stream,
                   * the norms' statistics and the mid residual hold the rank's B T / tp_size rows */
    unsigned drop32; /* bf16 stored (act_dtype BF16): the block graph's WIDE slots (bit k: slot k) whose fp32 WORKSPACE
                   * views are not carved, on a backend whose bf16 ops write those slots in bf16 only
                   * (FL_CAP_VIEWS16: fl_model_alloc_acts asks the executor); 0: every view */
    unsigned gdrop;  /* the same backends: the block graph's slots (bit k: slot k) whose gradient every backward pass
                   * holds in bf16 only (an activation's input, e.g. d(gate|up)): the gradient buffers are sized
                   * without their widths; 0: every slot's */
    unsigned stream16; /* bf16 stored on an FL_CAP_STREAM16 backend (issue 30 item 1): the block graph's residual slots
                   * (bit k: slot k; the input, the output, the mid residual) whose fp32 WORKSPACE views share ONE
                   * (N, C) buffer, the residual adds reading the other operand's stored bf16 rows
                   * (fl_block_stream16); 0: two rows buffers and the mid residual's own view */
    int dy_bf16;  /* without dw_bf16 (LoRA: a frozen bf16 base) on an FL_CAP_COMPUTE_BF16 backend: the bf16 dy scratch
                   * alone, N x max(C, QKV, FCW) or a logits chunk (chunk, V) bf16 in WORKSPACE, which the ops that make
                   * a frozen base linear's dy write beside it and its dx GEMM reads (the head's: cross_entropy_dbf16);
                   * 2 (QLoRA: 4-bit blocks, which read the fp32 dy): the chunk's alone, for the head; QLoRA whose
                   * 4-bit blocks read bf16 dy (FL_CAP_Q4X16: FITLLM_CUDA_Q4=tc|scratch) takes 1
                   * (fl_model_alloc_acts; FITLLM_CUDA_LORA16=0: off) */
} fl_act_opts;
/* The backend_scratch of a model whose matmuls read `compute_dtype` weights, `quant4` if it has
 * 4-bit weights, on a backend with `scratch_bytes` (the CPU's: fl_cpu_scratch_bytes). */
size_t fl_model_backend_scratch(fl_dtype compute_dtype, int quant4, size_t scratch_bytes);
/* The head_widen of a model whose matmuls read `compute_dtype` weights, on a backend whose
 * 16-bit GEMMs widen the dtypes in `widens16` (bit 1 << dtype): FL_F32 when off. */
fl_dtype fl_head_widen_dtype(fl_dtype compute_dtype, unsigned widens16);
void fl_sizing_acts_ex(const fl_model_config *cfg, int B, int T, const fl_act_opts *opts, fl_act_sizes *out);

/* ---- the model ----------------------------------------------------------- */

typedef struct fl_acts fl_acts; /* private: pointers into the ACTS arena */
typedef struct fl_param_store fl_param_store; /* private: src/model/store.h */

/* How the parameters are stored, fixed when the model is created (so a bf16
 * model never exists in fp32, not even while loading). */
typedef struct {
    fl_dtype param_dtype; /* FL_F32 (default), FL_BF16 (bf16-true) or FL_F16 (16-true) */
    int quant4;           /* QLoRA: every linear weight of the blocks stored in 4 bits (bitsandbytes
                           * NF4/FP4 blocks of 64, fitllm/quant4.h); embeddings, norms, biases and
                           * lm_head stay in param_dtype (as transformers' BitsAndBytesConfig) */
    int q4_type;          /* fl_q4_type: FL_Q4_NF4 or FL_Q4_FP4 */
    int q4_double_quant;  /* "-dq": double-quantized absmax */
    /* Sharded from the start (FSDP FULL_SHARD; set by src/train/fsdp.c's fl_fsdp_prepare, NULL
     * otherwise): fl_model_init_ex calls shard(shard_ud, m) IN PLACE of allocating the whole dense
     * parameter buffer; it allocates this rank's shard and hands it with its provider (pieces) to
     * fl_model_store_shard, which makes the parameter store an FSDP shard, so the loaders and the random init fill only the shard (fl_model_param_piece) and no
     * rank ever holds the whole model. (m is an fl_model *.) */
    fl_status (*shard)(void *shard_ud, void *m);
    void *shard_ud;
} fl_model_storage;

/* Sharded parameters (FSDP FULL_SHARD / ZeRO-3; implemented by src/train/fsdp.c, wrapped by the
 * parameter store's FSDP implementation, src/model/store_fsdp.c). The model's units are its layout
 * groups (0 the embeddings, 1..L the blocks, L+1 the final norm and lm_head); under sharding the
 * store's parameter and gradient buffers hold only this rank's shard of every group (numel
 * elements), and a group's whole parameters exist only while it is gathered: fl_model_forward /
 * backward ask the store for each group right before using it and give it back after, so
 * transformer.c stays one graph and the model never talks to other ranks. views[g] is what the
 * store binds while group g is gathered: p its parameters (store dtype), wc
 * their compute-dtype copy (mixed policies) or NULL, g its gradient of this micro-batch (store
 * dtype) between grads_begin and grads_ready; NULL when absent. */
typedef struct {
    void *p, *wc, *g;
} fl_group_view;

typedef struct fl_param_provider {
    void *ud;
    size_t numel;         /* elements of this rank's shard (params, grads and optimizer state) */
    fl_group_view *views; /* (layout.n_groups) */
    /* group g's parameters into views[g] (waiting for a gather posted ahead), then post the gather
     * of group `next` ahead (-1: none; the provider may decline: its prefetch limit) */
    fl_status (*gather)(void *ud, int g, int next);
    /* done with group g's parameters (its buffers go back) */
    void (*release)(void *ud, int g);
    /* a zeroed gradient buffer for group g in views[g].g (no-op when it has one) */
    fl_status (*grads_begin)(void *ud, int g);
    /* group g's gradient of this micro-batch is complete: reduce-scatter it into the shard */
    fl_status (*grads_ready)(void *ud, int g);
    /* the start of an optimizer step (fl_model_zero_grads): the next reduction of each group
     * replaces the shard's gradient instead of adding to it */
    void (*zero_grads)(void *ud);
    /* (layout.n_groups) this rank's piece of group g: the whole-model (layout) elements
     * [flat_off[g], flat_off[g] + len[g]), stored at shard_off[g] of the shard */
    const size_t *flat_off, *shard_off, *len;
} fl_param_provider;

#define FL_MODEL_MAX_EOS 32 /* the ids that may end generation (fl_model.eos) */

typedef struct {
    fl_model_config cfg;
    fl_param_layout layout;
    const fl_backend *be;
    fl_mem_pool *pool;
    /* the parameters, their gradients and every storage detail (dtype, 16-bit staging, 4-bit entries,
     * the compute copy, a shard's provider): the parameter store, src/model/store.h. Outside the model
     * reach it through the accessors below. */
    fl_param_store *store;
    /* activation arena for (B,T), allocated by fl_model_alloc_acts */
    int B, T;
    fl_act_sizes sizes;
    float *acts_arena;      /* ACTS */
    float *work_arena;      /* WORKSPACE */
    fl_acts *acts;          /* views into the arenas */
    /* last forward */
    int have_targets;
    double loss_sum;        /* sum of per-token losses over non-ignored targets */
    long n_valid;           /* number of non-ignored targets */
    int fwd_B, fwd_T;       /* shape of the last forward */
    int fwd_train;          /* last forward prepared a backward */
    int ckpt_last_live;     /* act_ckpt: the shared block buffer still holds block L-1's activations from
                             * the last training forward, so its backward skips the recompute */
    int ckpt_recomputed;    /* act_ckpt: blocks the last backward recomputed (L - 1) */
    int keep_block0_din;    /* tests: run block 0's input-gradient ops under LoRA too (nothing reads their
                             * result: the embeddings are frozen; by default they are skipped) */
    int host_memory;        /* the backend's memory is host memory (fl_backend_host_memory, recorded at set-up) */
    int phase_sync;         /* an asynchronous device: synchronize at the step's phase edges (around the head, after
                             * the backward and the update) so the phase times are its own (fl_step_ctx.phase_times
                             * sets it; 0: no sync inside a step) */
    double *loss_dev;       /* issue 30 item 5: a device double the next forward's head adds its valid targets' losses
                             * to (fl_backend.loss_sum_dev) instead of reading them to m->loss_sum; NULL: the host sum
                             * (fl_step_run lends it, one step scalar per micro-batch) */
    int loss_on_dev;        /* the last forward's losses went to *loss_dev (m->loss_sum stays 0; n_valid is counted) */
    int act_ckpt;           /* activation checkpointing (set before fl_model_alloc_acts) */
    fl_dtype act_dtype;     /* storage of the saved activations of the current arena: prec.act_dtype when
                             * fl_model_alloc_acts ran (fl_model_set_precision re-sizes the arena) */
    fl_precision prec;      /* precision policy (fl_model_set_precision); zeroed = 32-true */
    struct fl_lora_state *lora; /* LoRA's own state (src/lora: fl_model_lora_init), opaque to the model, or NULL */
    struct fl_adapter_table *adapt; /* adapters attached to LINEAR ops (fl_model_adapters_begin) or NULL: when
                                 * set, the base is frozen and the adapters are what trains */
    struct fl_comm *tp_comm;    /* tensor parallel (cfg.tp_size > 1): the group the blocks' ALLREDUCE ops sum over
                                 * (fl_model_set_tp; on the backend's memory); NULL: one rank */
    struct fl_comm *tp_host;    /* the same group on host memory (gathered logits; set: the cross-entropy's
                                 * statistics have their group): tp_comm on a host-memory backend, else
                                 * fl_model_set_tp_host's */
    int sp;                     /* sequence parallelism over tp_comm (fl_model_set_sp, before fl_model_alloc_acts) */
    const struct fl_model_tp_ops *tp_ops; /* tensor parallelism's part of the passes (src/model/model-impl.h), installed
                                 * by fl_model_init_ex for a sliced config (cfg.tp_size > 1); NULL: one rank */
    /* An encoder-decoder's source rows supplied by the caller (BLIP-2's projected queries in place of the
     * image placeholders, fitllm/blip2.h): after the first stack's embedding, row rows[i] of the (B Ts) rows is
     * src[i] (n rows of C, device memory); the backward moves their gradient into dsrc and none reaches the
     * token table. A decoder-only model's fl_model_prefill (one sequence) takes them the same way, plus the row's
     * learned position (BLIP-2's OPT captioning with the KV cache). n 0: none. */
    struct { const int *rows; int n; const float *src; float *dsrc; } emb_inject;
    /* Pipeline parallelism (fitllm/pp.h, src/model/stage.c): this model is a stage of a deeper one. in: its
     * blocks' input res[0] is the previous stage's output (fl_model_stage_input), not the embeddings (which it
     * neither runs nor trains); out: its forward ends after the blocks (no final norm, head or loss) and its
     * backward starts from the next stage's d(output) (fl_model_stage_dout). Both 0: a whole model. first: the whole
     * model's index of its block 0 (the blocks' dropout seeds: one process's masks; 0 for a whole model). */
    struct { int in, out, first; } stage;
    uint64_t drop_seed;         /* the micro-batch's dropout seed (fl_model_adapters_seed: its masks, cfg.dropout_on) */
    /* The ids that end a generated sequence of an encoder-decoder (fl_model_generate_s2s) and of BLIP-2's language
     * model, as fl_model_set_eos_ids sets them (generation_config.json's eos_token_id list and the tokenizer's:
     * fl_hf_stop_ids); n 0: cfg.eos_id alone. fl_generate takes its ids as arguments. */
    struct { int32_t ids[FL_MODEL_MAX_EOS]; int n; } eos;
} fl_model;

/* Set m->eos (at most FL_MODEL_MAX_EOS ids; n 0: back to cfg.eos_id alone). */
void fl_model_set_eos_ids(fl_model *m, const int32_t *ids, int n);
/* Does id end a generated sequence of m (m->eos, else cfg.eos_id)? */
int fl_model_is_eos(const fl_model *m, int32_t id);

/* ---- adapters on LINEAR ops: a graph rewrite --------------------------------------------------
 * An adapter is a trainable branch attached to a LINEAR op of the block graph (or to the lm_head):
 * the op runs its base product (any parameter store: dense, 16-bit, 4-bit), its bias, then each
 * attached adapter adds its branch to the output; its backward runs the base's, then each adapter
 * adds its input gradient and accumulates its own parameters' gradients. The model knows nothing
 * else about them: src/lora implements LoRA through this interface (fl_model_lora_init does the
 * rewrite), and QLoRA is the 4-bit store plus the same rewrite. */
typedef struct fl_linear_adapter fl_linear_adapter;
typedef struct {
    /* y (N rows of ldy floats: the LINEAR's whole output) += the branch on x (N, the LINEAR's input);
     * row_base: the first of these rows in the pass's batch (the head runs chunk by chunk; blocks 0) */
    fl_status (*forward)(const fl_linear_adapter *a, const fl_backend *be, float *y, int ldy, const float *x, int N,
                         int row_base);
    /* after the base backward: dx (N, in) += the branch's input gradient (dx NULL: not needed); the
     * adapter's own parameter gradients accumulate. dy: the LINEAR's whole output gradient (N, ldy) */
    fl_status (*backward)(const fl_linear_adapter *a, const fl_backend *be, float *dx, const float *dy, int ldy,
                          const float *x, int N, int row_base);
    /* Optional (NULL: none): x16_only says whether backward16 on be needs no fp32 x (it may read x16 (N, in), the
     * stored copy, or nothing: LoRA with dropout reads its own dropped copy), so the model need not widen the input
     * into x's fp32 view for the backward (issue 30 items 1 and 7) */
    int (*x16_only)(const fl_linear_adapter *a, const fl_backend *be);
    fl_status (*backward16)(const fl_linear_adapter *a, const fl_backend *be, float *dx, const float *dy, int ldy,
                            const void *x16, int N, int row_base);
} fl_linear_adapter_ops;
struct fl_linear_adapter {
    const fl_linear_adapter_ops *ops; /* an implementation embeds this first in its own adapter */
};

/* What the owner of a model's adapters does at the model level. */
typedef struct {
    float *grads;           /* the adapters' gradient buffer: zeroed by fl_model_zero_grads, its live bytes tracked */
    size_t grads_numel;     /* fp32 elements */
    size_t head_grad_bytes; /* of which the head adapters' (written inside a training forward) */
    /* their activations for micro-batches of (B, T) (fl_model_alloc_acts), released with the arena */
    fl_status (*alloc_acts)(fl_model *m, int B, int T);
    void (*free_acts)(fl_model *m);
    /* their activations' live bytes after the model's last pass (train: a training forward; each adapted
     * module's rows from fl_model_adapter_live_rows); *buf gets their buffer (NULL: none) */
    size_t (*live_acts)(const fl_model *m, int train, const void **buf);
    /* the seed of the step's random draws (LoRA dropout) for the next micro-batch (fl_model_adapters_seed) */
    void (*seed)(fl_model *m, uint64_t seed);
    /* after fl_model_adapters_merged: a frozen 4-bit entry i as read (dst, dequantized) gets the merged branch */
    void (*read_merged)(const fl_model *m, int i, float *dst);
    /* the owner's state goes (fl_model_free, fl_model_detach_adapters) */
    void (*release)(fl_model *m);
    /* their whole activation buffer for the arena's (B, T) and its bytes (NULL / 0: none): a pipeline stage parks it
     * with the arena for a micro-batch in flight (fitllm/pp.h's stash) */
    size_t (*acts_region)(const fl_model *m, void **buf);
} fl_adapter_hooks;
/* The rewrite: fl_model_adapters_begin freezes the base and takes the owner's hooks (copied); then each
 * fl_model_attach_adapter puts adapter a (owned by the caller, alive until release) on block `block`'s LINEAR
 * `linear` (the block graph's linear index: 0 qkv, 1 o, 2 fc, 3 proj in the decoder block), or on the lm_head
 * (block -1), after those attached before (their order is the order they run in). */
fl_status fl_model_adapters_begin(fl_model *m, const fl_adapter_hooks *h);
fl_status fl_model_attach_adapter(fl_model *m, int block, int linear, const fl_linear_adapter *a);
/* The seed of the model's own dropout masks (T5, cfg.dropout_on) for the next micro-batch, and of its adapters'
 * random draws (the adapter table's owner's seed hook; none without adapters or a seed hook). The training step
 * sets it through fl_model_forward_micro. */
void fl_model_adapters_seed(fl_model *m, uint64_t seed);
/* T5's dropout (cfg.dropout_rate) in this model's training passes (on 1) or none (0: the default), before
 * fl_model_alloc_acts_s2s (the block graphs change). The masks follow fl_model_adapters_seed's seed (each
 * micro-batch's, so a resumed run draws the same); evaluation, loss and generation never drop. FL_ERR_UNSUPPORTED:
 * a model other than an encoder-decoder, or a backend without the dropout op. */
fl_status fl_model_set_dropout(fl_model *m, int on);
/* Rows of the input of the adapted LINEAR at `param_index` (the weight's index in m->layout) of block `layer` that
 * an adapter's saved activations hold after the model's last pass (train: a training forward whose backward reads
 * them; otherwise 0): B*T of that pass (an encoder-decoder: of the stack whose rows the LINEAR reads), 0 for the
 * head (it runs chunk by chunk inside the forward) and, under checkpointing, for the recomputed blocks. A model run in
 * another's arena (a BLIP-2 part) answers from the fwd_B, fwd_T and fwd_train its owner's forward sets. */
size_t fl_model_adapter_live_rows(const fl_model *m, int layer, int param_index, int train);
/* The adapters were merged into the base weights: the model is then for saving only (fl_model_forward refuses;
 * 4-bit entries read back merged through read_merged). */
void fl_model_adapters_merged(fl_model *m);
/* Remove every adapter (their owner's release runs). */
void fl_model_detach_adapters(fl_model *m);
/* Rows of the (rows, V) logits chunk the head processes at once for N = B*T rows (fl_act_sizes.logits_chunk_rows;
 * a head adapter's activations hold one chunk); a decoder config's logits_chunk_rows > 0 replaces it (capped at N). */
int fl_logits_chunk_rows(int vocab_size, int N);
/* The chunk's bytes of fp32 logits that fl_logits_chunk_rows aims at. */
#define FL_LOGITS_CHUNK_BYTES (32L << 20)
/* The row stride of the head's logits chunk and of its bf16 gradient (issue 30 item 3): the vocabulary rounded up to
 * a multiple of 8, so that the head's GEMMs read and write 16-byte aligned rows (GPT-2's 50,257 in rows of 50,264:
 * every row of an odd vocabulary otherwise starts 2- or 4-byte aligned, where cuBLASLt has only its slow kernels;
 * llm.c pads the vocabulary itself to 50,304 for the same reason). The bf16 training head (cross_entropy_dbf16's
 * chunks) uses it; the other paths keep rows of vocab_size in the same buffer. */
int fl_logits_ld(int vocab_size);
/* tests only: > 0 forces the chunk's rows (several chunks at a tiny model's shapes); 0 (default): the rule above */
extern int fl_logits_chunk_rows_test;

/* The storage of the flat layout, whichever dtype holds it (fl_model_store_dtype: fp32 or 16-bit; device memory
 * on a device backend; under FSDP this rank's shard): code outside the model reaches the store through these
 * rather than its fields. NULL: none (grads: nothing trains, or LoRA's own). The _f32 / _16 forms: the buffer
 * when it has that width, else NULL. */
void *fl_model_params_data(const fl_model *m);
void *fl_model_grads_data(const fl_model *m);
float *fl_model_params_f32(const fl_model *m);
float *fl_model_grads_f32(const fl_model *m);
uint16_t *fl_model_params_16(const fl_model *m);
uint16_t *fl_model_grads_16(const fl_model *m);
fl_dtype fl_model_store_dtype(const fl_model *m);
/* Elements of the flat gradient / optimizer coordinates this model holds (sharded: this rank's shard). */
size_t fl_model_store_numel(const fl_model *m);
/* The model has 4-bit entries (QLoRA). */
int fl_model_quant4(const fl_model *m);
/* Sharded parameters: the provider (FSDP FULL_SHARD, set through fl_model_store_shard), else NULL. */
const fl_param_provider *fl_model_provider(const fl_model *m);
/* The backend whose memory holds the stored parameters and gradients (fl_model_params_data, the pieces of
 * fl_model_param_piece): the model's, or under parameter offload the host tier's. Loaders, the random init
 * and checkpoints copy through it. */
const fl_backend *fl_model_params_be(const fl_model *m);
/* For fl_model_storage.shard: the dense store becomes this rank's `shard` (PARAMS, store dtype, pp->numel
 * elements), its groups gathered through pp. _unshard: the provider goes (teardown). */
void fl_model_store_shard(fl_model *m, void *shard, fl_param_provider *pp);
void fl_model_store_unshard(fl_model *m);
/* Parameter offload: as fl_model_store_shard, the shard (and the gradients' shard, fl_model_alloc_grads) in
 * tier_pool, host memory of tier_be (the offloaded store, src/model/store_offload.c). */
void fl_model_store_offload(fl_model *m, void *shard, fl_param_provider *pp, const fl_backend *tier_be,
                            fl_mem_pool *tier_pool);
/* 16-bit storage's fp32 gradient staging (gstage: the largest group's elements; free between a group's
 * backward and the next), or NULL. */
float *fl_model_grad_stage(const fl_model *m);
/* Data parallel (src/train/dp.c, bucketed reduction): fl_model_backward calls fn(ud, off, n) as each layout
 * group's gradients [off, off + n) become final for this backward: the head group (final norm, lm_head), block
 * L-1 ... 0, then the embeddings (group 0). fn NULL: not called. */
void fl_model_set_grad_ready(fl_model *m, fl_status (*fn)(void *ud, size_t off, size_t n), void *ud);

/* Create an empty model for cfg (validates cfg, builds the layout, allocates
 * PARAMS, uninitialized). */
fl_status fl_model_init(fl_model *m, const fl_model_config *cfg, const fl_backend *be, fl_mem_pool *pool);
/* The same with an explicit parameter storage (NULL = fp32). */
fl_status fl_model_init_ex(fl_model *m, const fl_model_config *cfg, const fl_backend *be, fl_mem_pool *pool,
                           const fl_model_storage *st);
void fl_model_free(fl_model *m);
/* Storage needed by a precision policy (bf16-true -> BF16, 16-true -> F16, else F32). */
void fl_model_storage_for(const fl_precision *p, fl_model_storage *st);
/* Bytes of the fp32 staging buffers of 16-bit storage (0 for fp32): pstage for
 * 1-D parameter views, gstage for one group's gradients (when trainable). */
size_t fl_sizing_pstage_elems(const fl_model_config *cfg);
size_t fl_sizing_gstage_elems(const fl_model_config *cfg);
/* Read / write parameter entry i (layout order) as fp32, converting from or to
 * the storage dtype (round to nearest even). */
void fl_model_read_param(const fl_model *m, int i, float *dst);
void fl_model_write_param(fl_model *m, int i, const float *src);
/* The same for a model that may be sharded (FSDP FULL_SHARD: fl_model_provider): src is the whole entry, and a
 * sharded model keeps only its piece of it (fl_model_param_piece; 16-bit storage rounded to nearest even). */
fl_status fl_model_write_param_any(fl_model *m, int i, const float *src);
/* Pointer to entry i in the dense storage and its dtype; NULL for a 4-bit entry
 * (read it with fl_model_read_param: dequantized, LoRA-merged after fl_model_lora_merge). */
void *fl_model_param_data(const fl_model *m, int i, fl_dtype *dt);
/* The part of entry i this model holds: its elements [*k0, *k1) (of the entry), at the returned
 * pointer (element *k0; dtype *dt). Whole model: 0, numel and fl_model_param_data. Sharded (m->pp):
 * the entry's intersection with this rank's piece of its group, one range (an entry lies in one
 * group), NULL when empty (*k0 == *k1). What the loaders and the random init fill. */
void *fl_model_param_piece(const fl_model *m, int i, size_t *k0, size_t *k1, fl_dtype *dt);
/* Entry i is stored in 4 bits. */
int fl_model_param_is_q4(const fl_model *m, int i);
/* Element offset of entry i in the dense store. */
size_t fl_model_store_off(const fl_model *m, int i);
/* Layout entries that are quantized under fl_model_storage.quant4 (the blocks' 2-D weights). */
int fl_layout_entry_quantizable(const fl_param_layout *lay, int i);
/* Storage of a model stored as st: elements of the dense store (in st->param_dtype) and
 * bytes of the 4-bit entries (exact; what fl_model_init_ex allocates as PARAMS). */
void fl_sizing_param_split(const fl_model_config *cfg, const fl_model_storage *st, size_t *dense_numel,
                           size_t *q4_bytes);
/* Random init like HF's _init_weights (normal(0, 0.02) for linears and
 * embeddings, zeros for biases, ones for norm weights), deterministic in seed. */
void fl_model_init_random(fl_model *m, uint64_t seed);
/* The same, returning the status (a 4-bit model's staging may not fit the budget). */
fl_status fl_model_init_random_ex(fl_model *m, uint64_t seed);
/* The fp32 staging through which a 4-bit entry is written whole (random init, the loader):
 * the largest quantized entry's elements, from the pool (WORKSPACE); *out = NULL when the
 * model has no 4-bit entry. fl_mem_free it. fl_sizing_q4_staging_elems: its size, planned. */
fl_status fl_model_q4_staging(fl_model *m, float **out);
size_t fl_sizing_q4_staging_elems(const fl_model_config *cfg, const fl_model_storage *st);
fl_status fl_model_alloc_grads(fl_model *m);
void fl_model_zero_grads(fl_model *m);
/* Size and allocate the activation arena and workspace for micro-batches of
 * at most (B,T). Re-callable; frees the previous arena. */
fl_status fl_model_alloc_acts(fl_model *m, int B, int T);

/* Select the precision policy (after loading weights). Mixed policies allocate
 * the compute copy (tag PARAMS) and fill it from the master weights. */
fl_status fl_model_set_precision(fl_model *m, const fl_precision *p);
/* Refresh the compute copy from the master weights (after every update). */
void fl_model_sync_compute_copy(fl_model *m);

/* Pointer to a parameter / gradient by HF name (NULL if absent or not stored in fp32). */
float *fl_model_param(fl_model *m, const char *name);
float *fl_model_grad(fl_model *m, const char *name);

/* Forward over ids (B,T). If targets != NULL (B,T; FL_IGNORE_INDEX masks),
 * computes the summed loss into m->loss_sum and m->n_valid. If logits_out !=
 * NULL, writes the full logits (B,T,V) there (inference/debug; the fused path
 * never holds more than one chunk). If `grad_scale` > 0 and targets are given,
 * the head's backward runs fused inside the chunked loss (dlogits never fully
 * materialized) with d(loss)/d(logit) scaled by grad_scale (for a mean loss:
 * 1 / number of valid targets in the whole optimizer step), preparing
 * fl_model_backward. B,T must not exceed the arena's. */
fl_status fl_model_forward(fl_model *m, const int32_t *ids, const int32_t *targets, int B, int T,
                           float grad_scale, float *logits_out);
/* fl_model_forward in its two phases, as the training step times them (src/train/step.c): the model up to the
 * head's input (the embeddings, the blocks, the final norm), then the head and the loss (the chunked lm_head,
 * cross-entropy and, in training, the head's backward) with the targets and grad_scale of the first call. */
fl_status fl_model_forward_body(fl_model *m, const int32_t *ids, const int32_t *targets, int B, int T,
                                float grad_scale);
/* One micro-batch of a step; micro-batches of a step may differ in shape. */
typedef struct {
    const int32_t *ids;      /* (B, T) */
    const int32_t *targets;  /* (B, T) */
    int B, T;
    /* an encoder-decoder's micro-batch (src non-NULL: fl_model_forward_s2s_body): ids are the decoder's
     * input (B, T), targets its labels; src (B, Ts) the source, src_mask (B, Ts) its key mask */
    const int32_t *src;
    const uint8_t *src_mask;
    int Ts;
} fl_micro_batch;
/* The training step's forward phase of one micro-batch, either kind (src NULL: fl_model_forward_body; otherwise
 * fl_model_forward_s2s_body), its random draws (LoRA dropout) seeded first by *seed when seed is non-NULL
 * (fl_model_adapters_seed): the one model entry the step (src/train/step.c) calls per micro-batch before the head. */
fl_status fl_model_forward_micro(fl_model *m, const fl_micro_batch *mb, float grad_scale, const uint64_t *seed);
/* Issue 30 item 5: upload mb's ids and targets ahead into the backend's input slot `slot` (fl_backend.input_upload:
 * its second stream), for the next fl_model_forward_micro of exactly these host buffers, which then reads them there
 * after an input_wait; *done 0 where it does not apply (no slots, host memory, another kind of model, sequence
 * parallel): that pass uploads as before. mb NULL: forget what the slots hold (fl_step_run, at the step's end). */
fl_status fl_model_prefetch(fl_model *m, const fl_micro_batch *mb, int slot, int *done);
/* The head of the forward fl_model_forward_body or, of an encoder-decoder, fl_model_forward_s2s_body began. */
fl_status fl_model_forward_head(fl_model *m, float *logits_out);
/* Backward through all blocks and embeddings after a forward with grad_scale
 * > 0; ACCUMULATES into m->grads (so micro-batches accumulate). An encoder-decoder: fl_model_backward_s2s. */
fl_status fl_model_backward(fl_model *m);

/* A model kind other than the core's decoder-only stack (transformer.c, which the step's entries run themselves):
 * the passes its arena's set-up installs (an encoder-decoder: fl_model_alloc_acts_s2s installs seq2seq.c's), kept
 * with the activations. The model's step entries dispatch to it: fl_model_forward_micro -> forward_micro (mb->src
 * set: the stacks up to the head's input, the head's targets and grad_scale kept), fl_model_forward_head ->
 * forward_head (that head and loss, in training its backward; logits_out as fl_model_forward_head's),
 * fl_model_backward -> backward (every stack backward, gradients accumulating, each layout group handed to the
 * grad-ready hook as it becomes final); fl_model_live -> live_bytes (the ACTS / WORKSPACE bytes still live after the
 * last pass, train: after a training forward) and fl_model_adapter_live_rows -> adapter_live_rows. Each returns an
 * error status with its message set, as the entry would. */
typedef struct fl_model_kind {
    const char *name;
    fl_status (*forward_micro)(fl_model *m, const fl_micro_batch *mb, float grad_scale);
    fl_status (*forward_head)(fl_model *m, float *logits_out);
    fl_status (*backward)(fl_model *m);
    void (*live_bytes)(const fl_model *m, int train, size_t *acts, size_t *work);
    size_t (*adapter_live_rows)(const fl_model *m, int layer, int param_index);
} fl_model_kind;

/* Encoders (an architecture whose model graph ends in its hidden states, as BERT's: src/model/graph.h
 * fl_model_graph): the forward over (B, T) ids (B*T <= the arena's) with optional token types (NULL: 0)
 * and key padding mask ((B, T), nonzero = attend; NULL: all), copying the last hidden states (B*T, C) to
 * hidden (host memory, may be NULL). train: keep what fl_model_encode_backward reads. fp32 storage, no
 * LoRA, sharding, checkpointing or 16-bit saved activations yet (FL_ERR_UNSUPPORTED). A decoder's
 * fl_model_forward refuses an encoder and this refuses a decoder. */
fl_status fl_model_encode(fl_model *m, const int32_t *ids, const int32_t *type_ids, const uint8_t *kmask, int B, int T,
                          int train, float *hidden);
/* Its backward from d(hidden) (B*T, C, host memory): every parameter gradient ACCUMULATES (+=). */
fl_status fl_model_encode_backward(fl_model *m, const float *dhidden);

/* Encoder-decoders (T5: src/model/seq2seq.c, the model graph's two stacks interpreted). The arena for B sequences
 * of at most Ts source and Tt target tokens (fl_model_alloc_acts(m, B, T) of such a model: Ts = Tt = T). */
fl_status fl_model_alloc_acts_s2s(fl_model *m, int B, int Ts, int Tt);
/* The arena for generating up to max_new tokens from B sources of at most Ts tokens (fl_generate_s2s*,
 * fl_model_generate_s2s* with the cache): the encoder's pass over B x Ts rows; the decoder's K/V cache (each block's
 * self-attention q|k|v rows, B x max_new) and cross k|v (B x Ts rows, computed once), every other decoder buffer one
 * row per sequence, its relative bias one query row (NH x max_new); no gradient buffers. Bytes linear in max_new (the
 * training arena's decoder bias is NH x max_new x max_new, twice). The training passes refuse it. */
fl_status fl_model_alloc_gen_s2s(fl_model *m, int B, int Ts, int max_new);
/* The forward over src_ids (B, Ts) with its key padding mask src_mask ((B, Ts), nonzero = a token; NULL: all) and
 * dec_ids (B, Tt) (the decoder input: the start token, then the target shifted right): the logits (B, Tt, V) into
 * logits_out (host memory, may be NULL); with targets (B, Tt; FL_IGNORE_INDEX masks) the summed loss into
 * m->loss_sum / m->n_valid as fl_model_forward, and with grad_scale > 0 the head's backward (d(loss)/d(logit)
 * scaled by grad_scale) for fl_model_backward_s2s. fp32 storage and saved activations (LoRA, activation
 * checkpointing, a mixed policy's bf16 weight copy and 4-bit block linears run; 16-bit storage and a sharded store:
 * FL_ERR_UNSUPPORTED naming it). */
fl_status fl_model_forward_s2s(fl_model *m, const int32_t *src_ids, const uint8_t *src_mask, const int32_t *dec_ids,
                               const int32_t *targets, int B, int Ts, int Tt, float grad_scale, float *logits_out);
/* fl_model_forward_s2s in the two phases of the training step (as fl_model_forward_body / fl_model_forward_head):
 * the stacks up to the head's input, then fl_model_forward_head runs the head and the loss (and in training the
 * head's backward) with the targets and grad_scale given here. */
fl_status fl_model_forward_s2s_body(fl_model *m, const int32_t *src_ids, const uint8_t *src_mask,
                                    const int32_t *dec_ids, const int32_t *targets, int B, int Ts, int Tt,
                                    float grad_scale);
/* Its backward: the decoder, the cross-attention's gradient into the encoder output, the encoder; every parameter
 * gradient ACCUMULATES (+=); each layout group's is handed on as it becomes final (the data-parallel bucket hook). */
fl_status fl_model_backward_s2s(fl_model *m);
/* Greedy decoding of one source sequence src (Ts tokens; src_mask (Ts) or NULL): the encoder once, then the decoder
 * token by token from the start token until eos or max_new tokens (as generate(do_sample=False)); out (max_new + 1)
 * gets the start token and the generated ids, *n_out their count. kv_cache: each token runs its row alone (the
 * self-attention's keys and values of the earlier tokens kept, the cross-attention's computed once); 0: the
 * decoder reruns its whole prefix (the reference). The arena must hold source >= Ts and target >= max_new. max_new 0:
 * the start token alone (*n_out 1), nothing run. */
fl_status fl_model_generate_s2s(fl_model *m, const int32_t *src, const uint8_t *src_mask, int Ts, int max_new,
                                int kv_cache, int32_t *out, int *n_out);
/* The same for B sources at once (src (B, Ts) right-padded, src_mask (B, Ts) 0 at the padding, or NULL): the encoder
 * once over the batch, the decoder token by token for the sequences not yet ended (with the cache: each in its own
 * rows of the arena, so the ids are each source's alone); row b of out (B rows of max_new + 1) gets the start token,
 * its ids and pad_id after its eos (transformers' generate on a padded batch); *n_out the rows' common length (1 + the
 * steps until every row has ended, at most max_new). The arena must hold batch >= B. A mask row of zeros is refused
 * naming the row. */
fl_status fl_model_generate_s2s_batch(fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts,
                                      int max_new, int kv_cache, int32_t *out, int *n_out);
/* The model has two stacks (an encoder-decoder: fl_model_forward_s2s; src/model/graph.c). */
int fl_model_is_s2s(const fl_model_config *c);

/* Live bytes (fl_mem_set_live: docs/ARCHITECTURE.md "Reserved and live memory") are a fact of a
 * training step's phases, which the step (src/train/step.c) records at each phase boundary from this
 * query; forward and backward themselves set none. */
typedef enum {
    FL_LIVE_ZEROED,   /* gradients cleared (fl_model_zero_grads): nothing accumulated yet */
    FL_LIVE_FORWARD,  /* after a training forward: what the backward reads; the head's gradient is written
                       * already (its backward ran chunk by chunk inside the forward) */
    FL_LIVE_BACKWARD, /* after the backward: the saved activations are consumed, every gradient holds the step's sum */
    FL_LIVE_UPDATED   /* after the optimizer update: the gradients are consumed (or, skipped, discarded) */
} fl_live_phase;
/* One region of the model's memory and the bytes of it live after the phase (fitllm/mem.h: the pool records it). */
typedef fl_mem_live_region fl_live_region;
#define FL_MODEL_LIVE_MAX 4
/* The regions whose live bytes `phase` sets, into out (FL_MODEL_LIVE_MAX); returns their count. The
 * pass's (B, T) are the last forward's. */
int fl_model_live(const fl_model *m, fl_live_phase phase, fl_live_region *out);

/* FLOPs of one training step (forward + backward) for B*T tokens: 6 * N_matmul
 * * tokens + attention, the figure MFU is based on. */
double fl_model_train_flops(const fl_model_config *cfg, int B, int T);
/* The same for an encoder-decoder's step of B pairs of Ts source and Tt target tokens: 6 x (the encoder's
 * linears x source tokens + the decoder's, the head's x target tokens + the cross-attention's k|v x source
 * tokens) + the attention (bidirectional in the encoder, causal in the decoder, the cross-attention Tt x Ts). */
double fl_model_train_flops_s2s(const fl_model_config *cfg, int B, int Ts, int Tt);

#ifdef __cplusplus
}
#endif
#endif

#ifndef FITLLM_MODEL_PRESETS
#define FITLLM_MODEL_PRESETS
#ifdef __cplusplus
extern "C" {
#endif
/* Named model shapes with the real configurations (tinyllama-1.1b, open-llama-*,
 * llama-2-*, llama-3*, gpt2*) and small CPU shapes ("tiny", "small", "micro").
 * Returns FL_ERR_NOT_FOUND listing the known names if absent. */
fl_status fl_preset_find(const char *name, fl_model_config *cfg);
/* NULL-terminated list of preset names. */
const char *const *fl_preset_names(void);
/* The i-th Hugging Face repo id ("ORG/NAME") of a preset, with the preset it has the shape of in
 * *preset (may be NULL); NULL past the last. */
const char *fl_preset_repo_at(size_t i, const char **preset);
/* The first Hugging Face repo id of the preset `name` (a preset name or an alias), NULL if none. */
const char *fl_preset_repo_id(const char *name);
#ifdef __cplusplus
}
#endif
#endif
