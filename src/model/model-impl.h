/* Private model internals: views into the activation arena and workspace. */
#ifndef FL_MODEL_IMPL_H
#define FL_MODEL_IMPL_H

#include "fitllm/model.h"

/* Per-layer views of the block graph's slots (graph.h), into m->acts_arena. N = B*T rows. */
typedef struct {
    float *s[32];      /* FL_GRAPH_MAX_SLOTS: each slot's (N, width) fp32 view; s[IN] = res[l], s[OUT] = res[l+1].
                        * 16-bit saved activations: the WIDE slots alias ONE shared fp32 layer buffer */
    void *s16[32];     /* 16-bit activations (fl_act_opts.act_dtype != F32, no checkpointing): this layer's copy of
                        * each WIDE slot in act_dtype; else NULL. bf16 stored: also s16[IN] = res16[l],
                        * s16[OUT] = res16[l+1], and with checkpointing the one recomputed block's copies */
} fl_layer_acts;

struct fl_acts {
    int L;
    fl_dtype act_dtype;     /* storage of the saved activations (F32: in place, no conversion) */
    float **res;            /* L+1 views (N, C): res[l] = input of block l; res[L] = final residual (bf16 stored:
                             * fp32 WORKSPACE views of what res16 holds, two buffers alternating; stream16: one
                             * buffer, also the mid residual's view) */
    void **res16;           /* bf16 stored (act_dtype BF16): the L+1 residual rows in bf16 (ACTS), else NULL */
    unsigned drop32;        /* bf16 stored: the WIDE slots whose fp32 views are not carved (fl_act_opts.drop32) */
    unsigned gdrop;         /* the slots whose fp32 gradient the buffers were sized without (fl_act_opts.gdrop) */
    unsigned stream16;      /* bf16 stored: the residual slots whose fp32 views share one buffer (fl_act_opts.stream16) */
    fl_layer_acts *layer;   /* L */
    const struct fl_block_graph_s *graph; /* the block graph the views follow (m->acts owns it) */
    const struct fl_model_graph_s *mgraph; /* the model graph around the blocks (m->acts owns it) */
    /* encoders (a model graph with an embedding norm, token types, a plain output), else NULL */
    float *emb_x;           /* (N, C) the embedding norm's input */
    float *emb_mean, *emb_rstd; /* (N) its statistics */
    int32_t *type_ids;      /* (N) the token types (WORKSPACE) */
    uint8_t *kmask;         /* (N) the key padding mask (WORKSPACE) */
    int kmask_on;           /* the current pass has a mask */
    int drop;               /* the last forward drops (a training forward with cfg.dropout_on: OPT), so its backward */
    float *lnf;             /* (N, C) */
    float *lnf_mean;        /* (N) */
    float *lnf_rstd;        /* (N) */
    void *lnf16;            /* NULL or lnf's bf16 copy, written by the final norm for the bf16 head (fl_lm_head_x16) */
    /* workspace */
    float *dres;            /* (N, C) gradient of the residual stream */
    float *buf1;            /* (N, max(C, QD, F)) activation-gradient scratch; also dlnf */
    float *buf2;            /* (N, max(QKV, FCW)) */
    float *gbuf_more[2];    /* the graph's backward buffers 3 and 4 (a slot read by several ops), else NULL */
    float *logits;          /* (chunk, V) */
    float *losses;          /* (N) per-token loss */
    int32_t *ids;           /* (N) copy of the forward's token ids, for the embedding backward */
    int32_t *targets;       /* (N) the forward's targets in device memory (WORKSPACE, outside the sized
                             * arena), only when the backend's memory is not host memory; else NULL and
                             * cross_entropy reads the caller's host targets (as before the split) */
    /* issue 30 item 5: a pass whose inputs fl_model_prefetch uploaded ahead reads ids / targets in the backend's
     * input slot (fl_backend.input_slots): ids / targets point there for that pass, else at their homes */
    int32_t *ids_home, *targets_home;
    struct { const int32_t *ids, *targets; int N; } in_slot[FL_INPUT_SLOTS]; /* what each slot holds, not yet read */
    char *in_dev;           /* the backend's slots, made with the arena (NULL: none: no slots, or refused) */
    size_t in_stride, in_off; /* a slot's bytes; the targets' offset in it */
    float *rope_cos;        /* (T, HD/2) */
    float *rope_sin;        /* (T, HD/2) */
    int rope_T;
    void *xb16;             /* (N, max(C, QD, F)) bf16 layer input for bf16 dW GEMMs, or NULL */
    void *dyb16;            /* (N, max(C, QKV, FCW)) or (chunk, V) bf16 output gradient for them */
    size_t dyb16_elems;     /* its capacity in bf16 elements (the head's chunks grouped in it: FL_CAP_HEAD_GROUP) */
    /* the lm_head widened once per forward (fl_act_opts.head_widen; NULL when off) */
    fl_dtype head_dt;       /* the head weight's 16-bit dtype (FL_F32: off) */
    float *head_w;          /* (V, C) fp32 copy of the 16-bit head weight */
    float *head_x;          /* (chunk, C) BF16: the chunk's input rounded to bf16, held in fp32 */
    void *head_t16;         /* (chunk, max(V, C)) BF16: rounding scratch (aliases dyb16 when that exists) */
    /* the forward in progress between fl_model_forward_body and fl_model_forward_head */
    struct fl_fwd_pass { const int32_t *targets; float grad_scale; int B, T, open, T_given; } fwd;
    int32_t *sp_pad;        /* sequence parallel: a padded pass's ids and targets (host, 2 x B T; transformer.c) */
    float *sp_dnorm;        /* sequence parallel: (2, C) a norm's weight and bias gradient of the rank's rows (WORKSPACE) */
    double *tp_stats;       /* tensor parallel: the cross-entropy's row statistics, the rank's (chunk, 3) then the
                             * group's (tp_size, chunk, 3) doubles (WORKSPACE; tp_vocab.c), or NULL */
    int tp_stats_rows;      /* the chunk rows they hold */
    struct fl_s2s_acts *s2s; /* an encoder-decoder's stacks (seq2seq.c; then the views above are unused), or NULL */
    const fl_model_kind *kind; /* another kind's passes (fitllm/model.h; seq2seq.c's with s2s), NULL: decoder-only */
    void *be_scratch;       /* the backend's scratch (fl_backend.scratch_bytes), lent to its ops in each
                             * forward and backward (fl_act_opts.backend_scratch), or NULL */
    size_t be_scratch_bytes; /* its bytes: scratch_bytes + the attention's (fl_backend.attn_scratch_bytes) */
};

typedef struct fl_fwd_pass fl_fwd_pass;

/* Widths derived from the config. */
typedef struct {
    int C, QD, KVD, QKV, F, FCW, V, NH, NKV, HD, L;
} fl_dims;

fl_dims fl_model_dims(const fl_model_config *c); /* (graph.c) */


/* An encoder-decoder's views (seq2seq.c), released with the arena (safe with NULL). */
void fl_s2s_acts_free(struct fl_s2s_acts *s);
/* Release the activation arena and its views (safe when none). */
void fl_model_free_acts(fl_model *m);
/* fl_backend.set_compute_dtype around a model call (transformer.c): on = the precision's compute
 * dtype, off = FL_F32 (no-op for backends without the slot). */
void fl_model_tell_compute_dtype(const fl_model *m, int on);
/* 16-bit saved activations (no-ops when a->act_dtype is F32; fp16 under checkpointing too):
 * fp16: round block l's saved activations (N rows) from the shared fp32 layer buffer into its
 * 16-bit region after its forward (but for the slots in `done`, bit k: slot k) / widen them back
 * before its backward. bf16 stored: narrowing is the block's own (fl_block_ctx.store16); widening
 * rebuilds block l's fp32 views from its stored input and (without checkpointing) slots. */
fl_status fl_acts_narrow(fl_model *m, int l, int N, unsigned done);
/* Live bytes (fl_mem_set_live) of the ACTS (*acts) and WORKSPACE (*work) arenas after a pass over
 * (B, T): train = a training forward (what the backward reads), else none but the constant tables.
 * fl_model_live (acts.c) puts them together with the gradients' and the LoRA activations'. */
void fl_acts_live_bytes(const fl_model *m, int B, int T, int train, size_t *acts, size_t *work);
/* The gradient buffer (the trained parameters' or the LoRA adapters'), NULL without one. */
void *fl_model_grads_buffer(const fl_model *m);
/* skip (bit k: slot k, FL_GSLOT_IN the input too): views not widened, their readers take the bf16 copies */
fl_status fl_acts_widen(fl_model *m, int l, int N, unsigned skip);
/* cnt conversions dst[k] (len[k], dt) = src[k] (len[k], st): one convert_many launch where the backend has it (and
 * 1 < cnt <= FL_CONVERT_MANY_MAX), else a convert each; convert's bits either way (acts.c; seq2seq.c's saved slots) */
fl_status fl_convert_list(const fl_backend *be, int cnt, void *const *dst, fl_dtype dt, const void *const *src,
                          fl_dtype st, const size_t *len);
/* bf16 stored: residual rows res[l] (N rows, written by the embeddings) stored in res16[l], and the fp32 view
 * rounded to the same values (no-op otherwise). */
fl_status fl_acts_store_stream(fl_model *m, int l, int N);

/* A linear layer: weight (out, in) in HF orientation, optional bias, optional
 * gradients (NULL = frozen). LoRA and quantized bases become fields here so
 * the model code does not change. */
typedef struct {
    int in, out;
    const fl_q4_weight *q4[FL_Q4_MAX_PARTS]; /* 4-bit base (QLoRA): parts of the fused output, in row order,
                                              * consecutive in the store (q4[k] == q4[0] + k: the 16 ops
                                              * take them stacked, backend.h) */
    int n_q4;
    int q416;         /* the 4-bit parts read bf16 x / dy (q4_matmul_forward16 / _backward16: FL_CAP_Q4X16 in a bf16 run,
                       * FITLLM_CUDA_Q4X16; fl_linear_q416) */
    const float *w;   /* (out, in) */
    const void *wc;   /* (out, in) compute-dtype copy of w (mixed precision) or NULL */
    fl_dtype wct;     /* dtype of wc */
    const float *b;   /* (out) or NULL */
    const void *b16;  /* (out) bf16, or NULL: a bf16 store's bias as stored (b NULL then), read by gemm_epilogue */
    float *dw;        /* (out, in) or NULL */
    float *db;        /* (out) or NULL */
    const fl_linear_adapter *const *adapters; /* attached by the rewrite (n_adapters, run in order), or NULL */
    int n_adapters;
    int row_base;     /* the head: the chunk's first row in the batch (what the adapters' dropout masks follow) */
    void *xb16, *dyb16; /* bf16 scratch (N, in), (N, out): dW += bf16(dy)^T bf16(x), or NULL (fp32 dW); dyb16 alone:
                         * a frozen base's dx GEMM reads bf16(dy) (fl_linear_dx16) */
    /* (out, in) bf16, or NULL: the weight's 16-bit gradient itself, which that dW GEMM then adds into in place
     * (FL_OP_GEMM_ACC16: bf16(fp32 sum + g16), rounded once; dw's staging slot unused). Set per block pass by
     * fl_store_direct16 (issue 30 item 1) */
    void *dw16;
} fl_linear;

/* The adapter table, the one interface through which the model's core reaches the adapters attached to its LINEAR
 * ops. fl_model_adapters_begin installs it (m->adapt; adapter.c keeps the rewrite's bookkeeping behind it: per LINEAR
 * the adapters in attach order); a model without adapters has m->adapt NULL and its passes never enter adapter.c.
 * The core reads h (the owner's hooks: the seed of its draws, its activations, live bytes, merged reads), merged and
 * head, and calls bind: the adapters attached to block l's LINEAR p (l -1: the head) onto lin (its adapters and
 * n_adapters; none: 0), row_base the head chunk's first row in the batch (what the adapters' dropout masks follow). */
struct fl_adapter_table {
    fl_adapter_hooks h; /* the owner's hooks (copied by fl_model_adapters_begin) */
    int merged;         /* fl_model_adapters_merged: the adapters are in the weights (a forward refuses) */
    int head;           /* adapters attached to the lm_head */
    void (*bind)(const struct fl_adapter_table *t, int l, int p, fl_linear *lin, int row_base);
};
/* QLoRA where a rank's part cuts the blocks: entry i of the slice part (a row-mapped 4-bit weight, fl_tp_q4_map) takes
 * its whole blocks from entry j of the whole model's 4-bit weight, codes and dequantized absmax (store.c) */
fl_status fl_model_q4_take_blocks(const fl_model *whole, int j, fl_model *part, int i);
int fl_model_q4_mapped(const fl_model *m, int i); /* entry i is such a part */

/* y (N,out) = x (N,in) @ W^T + b */
fl_status fl_linear_forward(const fl_backend *be, float *y, const float *x, const fl_linear *lin, int N);
/* dx (N,in) = dy @ W (OVERWRITES dx when dx_accumulate == 0, else +=);
 * dW += dy^T x; db += colsum(dy). dx may be NULL. */
fl_status fl_linear_backward(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, const float *x,
                             const fl_linear *lin, int N);
/* y = x W^T (+ b, + the LoRA branches on x) with x16: bf16(x) already at hand (NULL: none), what a
 * BF16 weight's GEMM reads instead of rounding x itself. */
fl_status fl_linear_forward_ex(const fl_backend *be, float *y, const float *x, const void *x16, const fl_linear *lin,
                               int N);
/* y16 (N,out) bf16 = round(x16 W^T): a plain linear (a BF16 weight, no bias, adapter or 4-bit base) whose
 * output is stored in bf16 only (the GEMM rounds its fp32 sums once: fl_linear_forward_ex's value, rounded).
 * FL_ERR_UNSUPPORTED for any other linear (fl_linear_plain16 says which take it). */
int fl_linear_plain16(const fl_linear *lin);
fl_status fl_linear_forward16(const fl_backend *be, void *y16, const void *x16, const fl_linear *lin, int N);
/* The same, with x16: bf16(x) already at hand (NULL: none), what a bf16 weight-gradient GEMM reads
 * instead of rounding x itself (lin->xb16 set). */
fl_status fl_linear_backward_ex(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, const float *x,
                                const void *x16, const fl_linear *lin, int N);
/* The same, where the op that made dy may have written its bf16 copy into lin->dyb16 already (dy16_ready: the
 * convert is skipped; fl_linear_wants_dy16 says whether the linear reads that copy). */
int fl_linear_wants_dy16(const fl_linear *lin);
/* Whether its dx GEMM reads dy in bf16 from lin->dyb16: a trained linear's (fl_linear_wants_dy16), or a frozen bf16
 * base given the dy scratch alone (xb16 NULL: fl_act_opts.dy_bf16), which the op that made dy may have written too */
int fl_linear_dx16(const fl_linear *lin);
/* Whether it has adapters and every one reads its input in bf16 alone on be (fl_linear_adapter_ops.x16_only): the
 * backward then need not widen x's fp32 view (fl_linear_backward_dy16 takes x NULL and the stored x16) */
int fl_linear_adapters_x16(const fl_backend *be, const fl_linear *lin);
/* Whether its dx can be written in bf16 by its GEMM alone (fl_linear_backward_b16): a bf16 weight, dy read in bf16
 * (fl_linear_dx16), no adapter or 4-bit part adding to an fp32 dx */
int fl_linear_dx_b16(const fl_linear *lin);
/* fl_linear_backward_dy16 with dx (N, in) written in bf16 (RNE of the dx GEMM's fp32 sums, not accumulated) into dx16:
 * the fused causal attention's bf16 dO (attention_backward_b16, exec.c). Refused unless fl_linear_dx_b16. */
fl_status fl_linear_backward_b16(const fl_backend *be, void *dx16, const float *dy, int dy16_ready, const float *x,
                                 const void *x16, const fl_linear *lin, int N);
/* Whether its backward reads dy in fp32 even with dy16_ready (a bias gradient, an adapter, a 4-bit base without q416,
 * no bf16 dy): else dy may be NULL there (an fp32 gradient written in bf16 only, fl_block_only16). */
int fl_linear_reads_dy32(const fl_linear *lin);
/* Whether m's 4-bit linears read bf16 x / dy (fl_linear.q416): a bf16-compute QLoRA run on a backend with
 * q4_matmul_forward16 / _backward16 (FL_CAP_Q4X16: cuda, cuda-emu under FITLLM_CUDA_Q4=scratch (default)|tc, FITLLM_CUDA_Q4X16) */
int fl_model_q4x16(const fl_model *m);
/* Testing only (0 otherwise): the blocks' 4-bit linears bound without q416 although set-up took them with it, so a test
 * shows that the views set-up left out fail the step by name */
extern int fl_q416_test_unbind;
fl_status fl_linear_backward_dy16(const fl_backend *be, float *dx, int dx_accumulate, const float *dy, int dy16_ready,
                                  const float *x, const void *x16, const fl_linear *lin, int N);

#include "graph.h"

/* ---- parameter lookup (store.c), shared by transformer.c and generate.c ---- */

/* 16-bit weight gradients written by their GEMMs in place (issue 30 item 1; store.c). fl_store_dw16_knob:
 * FITLLM_CUDA_DW16 (unset or 1: on, 0: off; an error naming it otherwise). fl_store_dw16_model: the store and backend
 * allow it (a dense bf16 gradient, FL_OP_GEMM_ACC16, no tensor / sequence parallelism). fl_store_direct16: in block
 * params bp bound for layout group grp, each LINEAR with a plain bf16-operand weight gradient (no bias, adapter or
 * 4-bit base) that no other dW GEMM of the pass writes gets dw16 = its bf16 gradient; rng receives the group-relative
 * ranges [r0, r1) still staged in fp32 (norm weights, biases, the rest), in order; returns their count. */
enum { FL_STAGE_RANGES_MAX = FL_GRAPH_MAX_LINEARS + 1 };
fl_status fl_store_dw16_knob(int *on);
int fl_store_dw16_model(const fl_model *m);
int fl_store_direct16(const fl_model *m, const fl_block_graph *g, fl_block_params *bp, int grp,
                      size_t rng[FL_STAGE_RANGES_MAX][2]);
/* *on: the model takes the direct bf16 weight gradients (fl_store_dw16_model) and FITLLM_CUDA_DW16 allows them (an
 * error naming a bad value). fl_store_block_stage_begin: block group grp's fp32 stage opened before its backward, all
 * of it, or under dw16 what fl_store_direct16 leaves staged; rng receives the ranges, the count is returned (what
 * fl_store_stage_flush_ranges takes after the backward; the decoder-only and the encoder-decoder passes). */
fl_status fl_store_dw16_on(const fl_model *m, int *on);
int fl_store_block_stage_begin(const fl_model *m, const fl_block_graph *g, fl_block_params *bp, int grp, int dw16,
                               size_t rng[FL_STAGE_RANGES_MAX][2]);

/* Embeddings, final norm and head (head == wte when tied). */
typedef struct {
    const float *wte, *wpe, *head;
    const void *lnf_w, *lnf_b; /* of lnf_wt (as fl_block_params.norm_w, norm_b) */
    fl_dtype lnf_wt;
    float *dwte, *dwpe, *dlnf_w, *dlnf_b, *dhead;
    size_t head_off;  /* layout (gradient) offset of the head weight */
    int head_idx;     /* its layout entry (fl_linear_set_weight) */
    size_t wte_off, wpe_off; /* storage offsets of the embeddings (wpe: -1 if none) */
} fl_outer_params;

/* Block l's parameters, bound by the graph's NORM and LINEAR ops (roles of layout group l + 1). */
void fl_get_block(const fl_model *m, const fl_block_graph *g, int l, fl_block_params *bp);
/* Point lin at the stored weight of layout entry wi (fp32 w and its compute copy wc,
 * the 16-bit weight as wc, or the 4-bit parts q4); lin->out must be set. */
void fl_linear_set_weight(const fl_model *m, fl_linear *lin, int wi);
/* bf16 dW scratch for a linear whose weights the matmuls read in bf16 (fl_act_opts.dw_bf16). */
void fl_linear_set_dw_scratch(const fl_model *m, fl_linear *lin);
/* A trained bf16 linear (a BF16 compute weight with a gradient, not 4-bit) takes bf16 dW scratch xb16 / dyb16 (an
 * arena of its own: an encoder-decoder's head, BLIP-2's parts); NULL xb16: nothing changes */
void fl_linear_bind_dw16(fl_linear *lin, void *xb16, void *dyb16);
void fl_get_outer(const fl_model *m, fl_outer_params *o);
/* Embedding lookup / backward for either storage (16-bit: rows widened one at a time;
 * gradients through gstage). out is (B, T, C); positions start at pos0. */
/* dids: the ids in device memory (what the embedding op reads), ids: the same on the host (the
 * 16-bit path indexes rows with them). */
fl_status fl_embed_forward(const fl_model *m, const fl_outer_params *op, float *out, const int32_t *dids,
                           const int32_t *ids, int B, int T, int pos0);
/* The same with out16 (NULL or (B T, C) bf16): where the backend's one-launch 16-bit lookup runs, it stores the
 * rows in bf16 too (out then their exact widening: round16's bits) and sets *done16 (issue 30 item 1: the
 * residual stream's first row without its round16 launch); *done16 0: out16 not written. */
fl_status fl_embed_forward16(const fl_model *m, const fl_outer_params *op, float *out, void *out16, int *done16,
                             const int32_t *dids, const int32_t *ids, int B, int T, int pos0);
/* Where a training pass's bf16 head (cross_entropy_dbf16's chunks) reads the final norm's output in bf16: the
 * (N, C) scratch the norm may store it in (its out16: lnf then the exact widening, which every reader of that
 * head would round to the same bits), else NULL (issue 30 item 1: no convert of each chunk's input). */
void *fl_lm_head_x16(fl_model *m);
fl_status fl_embed_backward(fl_model *m, const fl_outer_params *op, const float *dout, const int32_t *ids, int B,
                            int T);

/* Tensor parallelism's part of the model's passes: the one interface the executor (exec.c) and the stack
 * interpreters (transformer.c, seq2seq.c) call for it. tp_vocab.c implements it (fl_tp_model_ops) and
 * fl_model_init_ex installs it in m->tp_ops when the config is a rank's slice (cfg.tp_size > 1); NULL: one rank,
 * whose passes run the dense embedding and head and have no collectives. The vocabulary split: embed_forward /
 * embed_backward the slice's embedding (host ids; device ids) summed over the group, cross_entropy a (rows, V/N)
 * logits chunk's loss and gradient from the ranks' row statistics (device targets; dlogits may alias logits),
 * logits_out the whole (rows, V) logits gathered on the host, head_dx_sum the group's sum of d(the head's input)
 * (N, C) (sequence parallel: reduce-scattered to the rank's rows). The blocks' collective ops over c (tp_comm):
 * sum (ALLREDUCE: p summed in place; no group or one rank: nothing), move (GATHER: whole = the ranks' parts in rank
 * order; SCATTER: part = the rank's rows of the group's sum of whole), norm_sum (fl_sp_norm_end: the group's sum of
 * a sequence-parallel norm's parameter gradients added to dw, db) and sp_gather (the stream's (N, C) rows made
 * whole). Each returns an error status with its message set. */
typedef struct fl_model_tp_ops {
    fl_status (*embed_forward)(const fl_model *m, const fl_outer_params *op, float *out, const int32_t *ids, int B,
                               int T, int pos0);
    fl_status (*embed_backward)(fl_model *m, const fl_outer_params *op, const float *dout, const int32_t *dids, int B,
                                int T);
    fl_status (*cross_entropy)(fl_model *m, float *loss, float *dlogits, const float *logits, const int32_t *dtargets,
                               int rows, float grad_scale);
    fl_status (*logits_out)(fl_model *m, float *out, const float *part, int rows);
    fl_status (*head_dx_sum)(fl_model *m, float *dx, int N);
    fl_status (*sum)(struct fl_comm *c, float *p, size_t n);
    fl_status (*move)(struct fl_comm *c, int gather, float *whole, float *part, size_t n_whole);
    fl_status (*norm_sum)(const fl_model *m, struct fl_comm *c, float *dw, float *db);
    fl_status (*sp_gather)(fl_model *m, const float *part, float *whole, int N);
} fl_model_tp_ops;
extern const fl_model_tp_ops fl_tp_model_ops;

/* Tensor parallelism's vocabulary split (tp_vocab.c): whether m holds a vocabulary slice; the embedding
 * (forward: host ids; backward: device ids), the cross-entropy of a (rows, V/N) logits chunk (device targets;
 * dlogits may alias logits), the sum of d(the head's input) over the group, the whole logits gathered on the
 * host (out (rows, V); part the rank's (rows, V/N) in device memory, may alias out on a host-memory backend). */
int fl_tp_vocab_split(const fl_model *m);
fl_status fl_tp_embed_forward(const fl_model *m, const fl_outer_params *op, float *out, const int32_t *ids, int B,
                              int T, int pos0);
fl_status fl_tp_embed_backward(fl_model *m, const fl_outer_params *op, const float *dout, const int32_t *dids, int B,
                               int T);
fl_status fl_tp_cross_entropy(fl_model *m, float *loss, float *dlogits, const float *logits, const int32_t *dtargets,
                              int rows, float grad_scale);
fl_status fl_tp_head_dx_sum(fl_model *m, float *dx, int N);
/* Sequence parallelism (m->sp): the rank's rows of a pass of N rows (the count; the first at *row0), and the
 * group's rows (N, C) made whole from each rank's own part (n, C) (all-gather over tp_comm; part may be
 * whole + row0 C: in place). */
int fl_sp_part(const fl_model *m, int N, size_t *row0); /* (transformer.c) */
fl_status fl_sp_gather(fl_model *m, const float *part, float *whole, int N);
/* Sequence parallelism: the sequence length a pass of (B, T) runs at (sp_pad: the shortest T' >= T whose B T' rows the
 * group divides; T itself without SP) */
int fl_sp_pass_T(const fl_model *m, int B, int T); /* (transformer.c) */
/* A norm over the rank's rows computes its part of the weight's (and bias') gradient: begin points *sw, *sb at a
 * zeroed scratch in place of dw, db (NULL stays NULL); end sums the group's parts over c and adds them to dw, db, so
 * every rank adds the whole gradient (Megatron's sum of the sequence-parallel norms' gradients, here per norm). */
void fl_sp_norm_begin(const fl_model *m, float *dw, float *db, float **sw, float **sb);
fl_status fl_sp_norm_end(const fl_model *m, struct fl_comm *c, float *dw, float *db);
fl_status fl_tp_logits_out(fl_model *m, float *out, const float *part, int rows);
/* The head's chunk of `rows` rows either way (the backend's cross-entropy on device targets, or the slices'
 * on the host targets; the logits to the caller's host rows of the whole vocabulary). */
fl_status fl_head_cross_entropy(fl_model *m, float *loss, float *dlogits, const float *logits, const int32_t *dtargets,
                                const int32_t *targets, int rows, float grad_scale);
fl_status fl_head_logits_out(fl_model *m, float *out, const float *logits, int rows);

/* Elements of layout group g (its gradients are staged and handed back per group: store.h). */
size_t fl_group_numel(const fl_model *m, int g);
/* Elements of the 1-D parameters of the final norm and head's group (the final norm's weight and bias). */
size_t fl_outer_1d(const fl_model *m);
/* Start of a block's 1-D parameter views in pstage (after the outer ones and one row). */
size_t fl_pstage_block_start(const fl_model *m);

/* Normalization dispatch by the architecture (fl_arch_info.layernorm): RMSNorm or LayerNorm (mean and the
 * bias unused for RMSNorm), over (N, C) rows; the backward accumulates into dx, dw, db. */
void fl_norm_forward(const fl_model *m, float *out, float *mean, float *rstd, const float *x, const float *w,
                     const float *b, int N);
void fl_norm_backward(const fl_model *m, float *dx, float *dw, float *db, const float *dout, const float *x,
                      const float *w, const float *mean, const float *rstd, int N);
/* The same with the weight w (and LayerNorm's bias b) of wt: F32, or BF16/F16 as store.c's norm_weight binds it
 * (a backend with the norm's *_w16 kernels, fl_norm16_have: the kernel widens it, no convert launch); with a 16-bit
 * w, out16 (NULL or) the output's bf16 copy (out its widening: a stored slot, no round16). Returns whether out16 was
 * written. */
int fl_norm_forward_t(const fl_model *m, float *out, void *out16, float *mean, float *rstd, const float *x,
                      const void *w, fl_dtype wt, const void *b, int N);
/* The backend has the w16 kernel of the architecture's norm (RMSNorm or LayerNorm; bwd: the backward's) */
int fl_norm16_have(const fl_model *m, int bwd);
/* x16 (NULL or): the input read from its bf16 copy (the w16 kernel; x may then be NULL) */
void fl_norm_backward_x16(const fl_model *m, float *dx, void *dx16, float *dw, float *db, const float *dout,
                          const float *x, const void *x16, const void *w, fl_dtype wt, const float *mean,
                          const float *rstd, int N);
/* dx16 (NULL or, 16-bit w only): bf16(dx) after the accumulation, dx not rounded (the next LINEAR's bf16 dy) */
void fl_norm_backward_t(const fl_model *m, float *dx, void *dx16, float *dw, float *db, const float *dout,
                        const float *x, const void *w, fl_dtype wt, const float *mean, const float *rstd, int N);

/* BLIP-2 (arch_blip2.c): does Q-Former block l cross-attend to the image features; a Q-Former block's graph with or
 * without the cross-attention (the stack alternates them, so src/model/blip2.c builds both). */
int fl_blip2_has_xattn(const fl_model_config *c, int l);
struct fl_block_graph_s;
void fl_blip2_qformer_block(const fl_model_config *c, int xattn, struct fl_block_graph_s *g);

/* The chunked LM head + cross-entropy (exec.c) over x (N, C): logits / losses (chunk x V, N) scratch, dtargets a device
 * copy of the targets or NULL (host memory), dx (N, C) d(x) in training (grad_scale > 0 with targets); the valid
 * targets' losses summed into *loss_sum, counted in *n_valid. xb16 / dyb16: bf16 dW scratch of at least (chunk, C) /
 * (chunk, V) for a trained bf16 head (dW += bf16(dy)^T bf16(x)), or NULL: the model's arena's (m->acts), if any. */
typedef struct {
    const float *x;
    float *dx, *logits, *losses;
    int32_t *dtargets;
    int chunk;
    void *xb16, *dyb16;
} fl_head_bufs;
/* One stack's HEAD_LM over the final norm's output (m->acts->lnf, N rows): logits chunk by chunk (logits_out: to
 * the host), with targets the per-token losses, in training (grad_scale > 0) the head's backward too, leaving
 * d(lnf) in buf1; fl_lm_sum_losses then adds the valid targets' losses into m->loss_sum / n_valid (transformer.c). */
fl_status fl_lm_head_loss(fl_model *m, const int32_t *targets, int N, float grad_scale, float *logits_out);
fl_status fl_lm_sum_losses(fl_model *m, const int32_t *targets, int N);
fl_status fl_head_loss(fl_model *m, const fl_head_bufs *h, const int32_t *targets, int N, float grad_scale,
                       float *logits_out, double *loss_sum, long *n_valid);

/* An arena's views carved from one allocation (base NULL: count only), 64-byte aligned. */
typedef struct {
    char *base;
    size_t off;
} fl_carver;
static inline void *fl_carve(fl_carver *cv, size_t bytes) {
    void *p = cv->base ? (void *)(cv->base + cv->off) : NULL;
    cv->off += (bytes + 63) / 64 * 64;
    return p;
}

#endif
