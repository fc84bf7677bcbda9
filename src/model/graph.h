/* The block graph: each architecture's transformer block described ONCE, as a table of ops over
 * named activation slots (src/model/graph.c). Everything else derives from the table:
 *
 *   - the training forward and the activation-checkpointed recompute (fl_block_forward, ops in order),
 *   - the backward (fl_block_backward, ops in reverse, each op's own backward; which gradient buffer
 *     holds each slot's gradient is assigned from the table),
 *   - prefill and decode (fl_block_forward with a KV cache in the context: the attention op appends
 *     its K/V rows and, for one row, attends to the cache),
 *   - the activation arena's carving and sizing (acts.c: which slots are saved, their widths, the
 *     16-bit copies, the gradient buffers' and bf16 dW scratch widths) and generation's scratch
 *     (buffers shared by liveness).
 *
 * Blocks may be pre-norm or post-norm (a residual add followed by a norm: the slots joined by ADD ops
 * share one gradient, whichever buffer it lives in), attend causally, bidirectionally or across to a
 * stream from outside the block (an encoder output: its gradient accumulates into the caller's buffer),
 * with an optional additive bias and key padding mask, and may hold collectives (ALLREDUCE over the
 * context's communicator: tensor parallelism as a graph rewrite). The decoder block is built here from
 * the descriptor's flags; an architecture with another block gives its own builder (fl_arch_info.
 * block_graph, with fl_graph_slot / fl_graph_op). The model around the blocks (embeddings, norms, head
 * or plain output) is a second, smaller table (fl_model_graph). A new kind of op is one case in each
 * executor. See docs/ARCHITECTURE.md "The block graph". */
#ifndef FL_MODEL_GRAPH_H
#define FL_MODEL_GRAPH_H

#include <stdint.h>

#include "fitllm/generate.h"
#include "fitllm/model.h"

#define FL_GRAPH_MAX_SLOTS 32 /* T5's decoder block with dropout: 23, 29 under sequence parallelism; BLIP-2's Q-Former cross block with dropout: 26 */
#define FL_GRAPH_MAX_OPS 32 /* T5's decoder block with dropout under tensor parallelism: 26 */
_Static_assert(FL_GRAPH_MAX_SLOTS == sizeof(((fl_layer_acts *)0)->s) / sizeof(float *),
               "fl_layer_acts (model-impl.h) holds one view per slot");

/* Slot 0 is the block's input (res[l]), slot 1 its output (res[l+1]): the residual stream. */
enum { FL_GSLOT_IN = 0, FL_GSLOT_OUT = 1 };

typedef enum {
    FL_GSLOT_STREAM, /* the block's input or output: lives in the residual stream, not in the block's buffers */
    FL_GSLOT_WIDE,   /* an (N, width) activation the backward reads: saved per block (16-bit when narrowed) */
    FL_GSLOT_STAT,   /* per-row fp32 statistics (norm mean / rstd, attention log-sum-exp): saved, never narrowed */
    FL_GSLOT_XSTREAM, /* a stream from outside the block (cross-attention's encoder output, B x Tk rows): bound by
                       * the caller in s[] like IN / OUT, its gradient accumulated into fl_block_ctx.dxs */
    FL_GSLOT_TEMP,    /* an (N, width) activation only the forward's next op reads, never the backward (a linear's
                       * output that a DROPOUT copies, masked, into a residual slot): not saved, the caller may give
                       * every block the same buffer (seq2seq.c: one per model). Its gradient is a buffer as any.
                       * Sequence parallel: a GATHER's whole rows, gathered again before its readers' backward */
} fl_gslot_kind;

/* Which workspace buffer holds a slot's gradient during the backward: RES the residual stream's,
 * then the off-path buffers, assigned by liveness (a pre-norm chain alternates 1 and 2; a slot read by
 * several ops keeps its buffer from its first gradient contribution to its producer's backward, so a
 * parallel block needs a third). n_gbuf >= 3 of at most FL_GRAPH_MAX_GBUF. */
typedef enum { FL_GBUF_NONE = -1, FL_GBUF_RES = 0, FL_GBUF_1 = 1, FL_GBUF_2 = 2, FL_N_GBUF = 3 } fl_gbuf;
#define FL_GRAPH_MAX_GBUF 5 /* fl_acts.gbuf_more holds the 2 beyond FL_N_GBUF */

typedef struct {
    const char *name;  /* "ln1", "qkv", ...: messages and docs */
    int width;         /* floats per row */
    uint8_t kind;      /* fl_gslot_kind */
    uint8_t resid;     /* on the residual path: its gradient is the stream's (accumulated, never overwritten) */
    int8_t grad;       /* fl_gbuf of its gradient in the backward (FL_GBUF_NONE: statistics, an XSTREAM) */
    uint8_t xrows;     /* derived: B x Tk rows (an XSTREAM and what is computed from it alone), else B x T */
    uint8_t srows;     /* derived (sequence parallel, fl_block_graph.sp > 1): the rank's B T / sp rows of the stream
                        * (the block's input and what is computed from it up to a GATHER) */
} fl_gslot;

typedef enum {
    FL_GOP_NORM,   /* out, a1 (mean: LayerNorm only, else -1), a2 (rstd) = norm_p(in): the architecture's norm */
    FL_GOP_LINEAR, /* out = in @ W_p^T (+ b_p) (+ LoRA) */
    FL_GOP_ROPE,   /* in place: rotate the q and k heads of in (fused q|k|v rows) */
    FL_GOP_ATTN,   /* out, a1 (lse) = GQA attention (fl_gop.attn): over in's fused q|k|v rows, or (CROSS) of in's
                    * q rows (width QD) to in2's fused k|v rows (width 2 KVD, B x Tk rows of an XSTREAM's linear) */
    FL_GOP_ADD,    /* out += in (a residual connection; both on a residual path) */
    FL_GOP_SWIGLU, /* out (N, F) = silu(in[:, :F]) * in[:, F:] */
    FL_GOP_GELU,   /* out = gelu_tanh(in) */
    FL_GOP_RELU,   /* out = max(in, 0) */
    FL_GOP_GEGLU,  /* out (N, F) = gelu_tanh(in[:, :F]) * in[:, F:] (T5 v1.1's gated-GELU: wi_0 | wi_1 fused) */
    FL_GOP_ALLREDUCE, /* in place (in == out): sum over fl_block_ctx.comm's ranks; p = FL_GAR_FWD: in the forward
                       * (backward: identity; Megatron's g after a row-parallel linear), FL_GAR_BWD: in the backward
                       * (forward: identity; Megatron's f before a column-parallel one). No comm / one rank: no-op */
    FL_GOP_GELU_ERF, /* out = the exact GELU, in (1 + erf(in / sqrt 2)) / 2 (BLIP-2's vision tower and Q-Former) */
    FL_GOP_DROPOUT, /* out = drop(in) in a training pass (fl_block_ctx.drop_p > 0; the mask of (drop_seed, site p,
                     * element): backward.h's dropout op), else out = in. in == out: in place, on an off-path slot
                     * only (a residual slot's gradient is its path's: the mask must not reach it); the backward
                     * masks d(out) into d(in) with the same mask (nothing saved). T5's dropout (issue 31) */
    FL_GOP_GATHER,  /* sequence parallel: out (B T rows) = the group's in (B T / sp rows each) concatenated in rank order
                     * (all-gather over fl_block_ctx.comm); backward: d(in) = the rank's rows of the group's sum of
                     * d(out) (reduce-scatter). Megatron's g-bar before a column-parallel linear */
    FL_GOP_SCATTER, /* sequence parallel: out (the rank's B T / sp rows) = its rows of the group's sum of in (B T rows:
                     * a row-parallel linear's partial output; reduce-scatter); backward: d(in) = the group's d(out)
                     * rows gathered (all-gather). Megatron's g after a row-parallel linear */
} fl_gop_kind;

/* Attention kinds (fl_gop.attn). CAUSAL without bias or mask runs the fused causal kernels (the decoder's
 * path, unchanged); everything else the general op (attention_forward_ex, fl_attn_desc). */
typedef enum { FL_ATTN_CAUSAL = 0, FL_ATTN_BIDIR, FL_ATTN_CROSS } fl_attn_kind;
/* fl_gop.attn_flags: read fl_block_ctx.attn_bias / kmask; NOSCALE: scores q.k unscaled (T5), else q.k / sqrt(HD) */
enum { FL_GATTN_BIAS = 1, FL_GATTN_MASK = 2, FL_GATTN_NOSCALE = 4 };
enum { FL_GAR_FWD = 0, FL_GAR_BWD = 1 };       /* ALLREDUCE's direction (fl_gop.p) */

typedef struct {
    uint8_t kind;        /* fl_gop_kind */
    int8_t in, out;      /* slots (ROPE: in == out) */
    int8_t a1, a2;       /* auxiliary output slots (statistics), -1 if none */
    int8_t p;            /* NORM: norm index (fl_block_params.norm_*), LINEAR: linear index (lin[], LoRA kind);
                          * DROPOUT, ATTN: the dropout site (its mask's seed within the block; ATTN -1: no dropout on
                          * its weights) */
    int8_t role_w, role_b; /* NORM / LINEAR: the parameters' fl_param_role (role_b -1: none) */
    uint8_t acc;         /* derived: the backward adds to d(in) (the residual path, or a slot's later reader in
                          * the backward's order: its gradients are summed) instead of starting it */
    uint8_t attn, attn_flags; /* ATTN: fl_attn_kind, FL_GATTN_* */
    int8_t in2;          /* ATTN CROSS: the fused k|v slot (else unused) */
    uint8_t acc2;        /* derived: the backward adds to d(in2) */
    uint8_t tp_cols;     /* DROPOUT of a tensor-parallel rank's slot of 1/tp_size of the whole's columns (graph_tp.c):
                          * its mask is the whole model's at the rank's columns */
} fl_gop;

/* An op that changes its input in place (in == out): RoPE, ALLREDUCE, an in-place DROPOUT. */
int fl_gop_modifies(const fl_gop *o);

#define FL_GRAPH_MAX_NORMS 3   /* T5's decoder block: self-attention, cross-attention, FFN */
#define FL_GRAPH_MAX_LINEARS 8 /* T5's decoder block: 7 (0 qkv, 1 o, 2 fc, 3 proj as the decoders', 4.. its own) */
_Static_assert(FL_GRAPH_MAX_LINEARS == FL_MODEL_BLOCK_LINEARS, "the adapters' linear index (fitllm/model.h)");

typedef struct fl_block_graph_s {
    int n_slots, n_ops;
    fl_gslot slot[FL_GRAPH_MAX_SLOTS];
    fl_gop op[FL_GRAPH_MAX_OPS];
    int n_norms, n_linears;
    int sp;                       /* sequence parallel over sp ranks (> 1: the srows slots hold B T / sp rows) */
    /* derived (fl_block_graph_build) */
    int8_t prod[FL_GRAPH_MAX_SLOTS]; /* the block's own slots (not IN/OUT) in the order the ops produce them */
    int n_prod;
    int n_gbuf;                   /* backward buffers (>= FL_N_GBUF) */
    int gbuf_width[FL_GRAPH_MAX_GBUF]; /* widest gradient each backward buffer holds (floats per row) */
    int lin_in_max, lin_out_max;  /* widest LINEAR input / output (bf16 dW scratch) */
    /* inference (prefill / decode): slots share buffers by liveness */
    int n_ibuf;
    int ibuf_width[FL_GRAPH_MAX_SLOTS];
    int8_t ibuf_of[FL_GRAPH_MAX_SLOTS]; /* the buffer of each slot; OUT shares IN's */
} fl_block_graph;

/* The block graph of a (validated) config's architecture. FL_ERR_INTERNAL names a malformed table. */
fl_status fl_block_graph_build(const fl_model_config *c, fl_block_graph *g);
/* Builders (an architecture's fl_arch_info.block_graph): declare a slot (returns its index; resid: on a residual
 * path, joined to others by ADD ops) and append an op (in2 / attention kind: set the returned op's fields). */
int fl_graph_slot(fl_block_graph *g, const char *name, int width, fl_gslot_kind kind, int resid);
fl_gop *fl_graph_op(fl_block_graph *g, fl_gop_kind kind, int in, int out, int a1, int a2, int p, int role_w,
                    int role_b);
/* Derive a table's production order, gradient buffers, widths and inference buffers (n_slots, slot[] with
 * name/width/kind/resid, n_ops, op[], n_norms, n_linears filled; the rest zero), checking that
 * every slot is made once before it is read, every off-path activation is read (by one op or several:
 * their gradients are summed), residual adds stay on residual paths, and the input dies before the
 * output is made. Residual slots joined by ADD ops share one gradient: the input's and the output's
 * live in FL_GBUF_RES (the same one in a pre-norm block; in a post-norm block the output's is consumed by
 * the last norm's backward before the input's starts there), another residual path takes a free buffer
 * as an off-path slot does. Used by fl_block_graph_build. */
fl_status fl_block_graph_finish(fl_block_graph *g);
/* Tensor parallelism (graph_tp.c): the ALLREDUCE ops around the column- and row-parallel LINEARs of a rank's
 * slice (before fl_block_graph_finish; fl_block_graph_build applies it when the config's tp_size > 1). */
fl_status fl_block_graph_tp(fl_block_graph *g);
/* Sequence parallelism (graph_tp.c, Megatron-LM's; instead of fl_block_graph_tp): the stream, the norms and the
 * residual adds on the rank's B T / n rows; a GATHER before the first column-parallel LINEAR reading a slot, the
 * row-parallel LINEARs' partial outputs into full-row TEMP slots and a SCATTER into the stream. */
fl_status fl_block_graph_sp(fl_block_graph *g, int n);
/* fl_block_graph_build with sequence parallelism over the config's tp_size ranks when sp (a training arena's graph:
 * fl_act_opts.seq_par; generation keeps the tensor-parallel graph) */
fl_status fl_block_graph_build_ex(const fl_model_config *c, int sp, fl_block_graph *g);

/* Dropout sites within a block (fl_gop.p of a DROPOUT or ATTN op; each mask's seed fl_dropout_seed(block seed,
 * site)): T5's (arch_t5.c), OPT's and BLIP-2's Q-Former's (the same numbers where they drop the same thing; a
 * block's seed is fl_dropout_seed(micro-batch or part seed, 16 + block)). */
enum { FL_DROP_ATTN, FL_DROP_XATTN, FL_DROP_ACT, FL_DROP_FFN, FL_DROP_ATTN_W, FL_DROP_XATTN_W };
/* Does a config drop (dropout_on) its sublayer outputs (dropout_rate > 0) / its attention weights
 * (attn_dropout_rate > 0)? OPT's and BLIP-2's parts' graphs (T5 drops both at dropout_rate: arch_t5.c) */
int fl_drops_hidden(const fl_model_config *c);
int fl_drops_attn(const fl_model_config *c);
/* A sublayer's output projection (LINEAR lin, roles) from slot in into the residual slot res, through a DROPOUT
 * (site) from a TEMP slot when the config drops its sublayer outputs (fl_drops_hidden) */
void fl_graph_sublayer_out(fl_block_graph *g, const fl_model_config *c, int in, int res, int lin, int role_w,
                           int role_b, int site);

/* Parameter and gradient pointers of one block, bound by the graph's NORM and LINEAR ops. */
typedef struct fl_block_params {
    /* norm_w and norm_b of norm_wt: F32, or the stored 16-bit values when the backend's norm kernels read them
     * (fl_norm_*_t, fl_norm16_have) */
    const void *norm_w[FL_GRAPH_MAX_NORMS];
    const void *norm_b[FL_GRAPH_MAX_NORMS];
    fl_dtype norm_wt;
    float *d_norm_w[FL_GRAPH_MAX_NORMS], *d_norm_b[FL_GRAPH_MAX_NORMS];
    fl_linear lin[FL_GRAPH_MAX_LINEARS];
} fl_block_params;

/* Where a block pass runs. */
/* A residual add left pending across two blocks (issue 30 item 4, exec_fuse.c): res (N, C) = a + b, stored in bf16
 * (res16 = RNE(a + b), res its widening: add16's bits), not yet done; on 0: none. */
typedef struct {
    int on, N, C;
    float *res;
    void *res16;
    const float *a, *b;
    const void *b16; /* (NULL or) b read from its stored bf16 rows instead (stream16: add_norm_forward16_b16) */
} fl_add_pending;

typedef struct {
    int B, T, pos0;                     /* B sequences of T rows at positions pos0 .. pos0+T-1 */
    const float *rope_cos, *rope_sin;   /* (>= pos0+T, HD/2) */
    fl_kv_cache *kv;                    /* generation (B == 1): ATTN appends its K/V rows to the cache and, for
                                         * one row, attends to positions 0..pos0 of it; NULL: training */
    int layer;                          /* the cache's layer */
    void *const *s16;                   /* bf16 activations (fl_layer_acts.s16): each stored slot's bf16 copy, or NULL.
                                         * Backward: a LINEAR's bf16 weight-gradient GEMM reads it as its rounded
                                         * input (the same bits as rounding the fp32 view) */
    int store16;                        /* forward with s16: every WIDE and stream slot is stored in bf16 after the
                                         * last op that writes it (its s16 copy) and its fp32 view rounded to the
                                         * same value, so later ops read what is stored; a LINEAR with a BF16
                                         * weight reads its (stored) input's copy as the GEMM's operand */
    int no_din;                         /* backward: nothing reads d(input) (block 0 under LoRA: the embeddings
                                         * are frozen), so ops whose gradient only flows there are skipped */
    const uint8_t *kmask;               /* ATTN with FL_GATTN_MASK: (B, Tk) key padding mask, nonzero = attend */
    const float *attn_bias;             /* ATTN with FL_GATTN_BIAS: (NH, T, Tk) added to the scores (T5) */
    float *dattn_bias;                  /* its gradient (+=), or NULL */
    int Tk;                             /* ATTN CROSS: key rows per sequence (the XSTREAM slots' rows: B x Tk) */
    float *const *dxs;                  /* XSTREAM slot k's gradient (dxs[k], (B Tk, width), +=) */
    struct fl_comm *comm;               /* ALLREDUCE's communicator (NULL: one rank) */
    /* incremental decoding through the general attention op (an encoder-decoder's decoder, B == 1): */
    int kv_rows;                        /* > T: a self-attention's keys are the kv_rows rows of its q|k|v slot that end
                                         * at this pass's (the slot a persistent buffer the earlier passes filled);
                                         * 0: this pass's rows */
    int xs_ready;                       /* LINEARs reading an XSTREAM slot are skipped: their output (the cross
                                         * k|v) is kept from an earlier pass */
    /* backward, bf16 compute (issue 30 item 1): the residual gradient's bf16 copy passed between blocks, so the
     * LINEAR reading it as dy skips its convert. dout16_ready: d(output)'s copy is already in the dyb16 of the
     * block's first LINEAR in the backward's order (fl_block_dout16: the caller compares the pointers); din16
     * (NULL or): the norm that finishes d(input) writes its copy there, and sets *din16_done. */
    int dout16_ready;
    void *din16;
    int *din16_done;
    /* DROPOUT ops (a training pass of a model with dropout; 0: off, out = in): the rate and this block's seed (each
     * site's mask from fl_dropout_seed(drop_seed, site)); the recompute of a checkpointed block gets the same */
    float drop_p;
    uint64_t drop_seed;
    float attn_drop_p; /* the ATTN ops' rate on their weights (their site fl_gop.p >= 0; T5: drop_p, OPT / BLIP-2: the
                        * config's attn_dropout_rate); 0: none. A dropping causal ATTN takes the general kernels */
    /* the cross-block add + norm (issue 30 item 4, bf16 stored; NULL both: none, every caller but the decoder-only
     * stack's training / eval forward): hand_on (NULL or): the block's last ADD (into its output row) may be left
     * pending, recorded there for the caller (the next block's take, or the final norm: fl_add_pending_norm); take
     * (NULL or): the previous block's pending add into this block's input row, done before op 0 (fused with op 0
     * when that is a NORM of the input stored in bf16, else alone) */
    fl_add_pending *hand_on;
    const fl_add_pending *take;
    /* the slots whose fp32 gradient gb's buffers were sized without (fl_block_grads_dropped; 0: every one fits): a
     * backward pass that would write one fails naming it */
    unsigned gdrop;
    /* bf16 stored (fl_block_stream16, issue 30 item 1): the residual slots whose fp32 views share one buffer; their
     * residual adds read the other operand's bf16 rows (add_norm_forward16_b16). A pass that would read one of those
     * views after another slot overwrote it fails naming it. 0: every slot its own view */
    unsigned stream16;
    /* forward with s16 and store16 off (an encoder-decoder's bf16 saved slots; issue 30 item 1): the WIDE slots only
     * bf16-weight LINEARs without adapters read after their last writer (fl_block_gemm16_slots) are stored in bf16
     * there as store16 stores every slot (the writer's bf16-output variant, else round16) and those LINEARs read the
     * copy: the rounding each GEMM did to its fp32 input, moved into the producer, so the same bits; every other slot
     * keeps its fp32 values (the residual adds, the attention's q|k|v, the activations' inputs) */
    int gemm16;
} fl_block_ctx;

/* The seed of dropout site `site` under base seed `base` (a micro-batch's block, or a stack's embedding / final
 * norm): splitmix64 of both, so neighbouring bases and sites give unrelated masks (backend.h dropout's streams). */
uint64_t fl_dropout_seed(uint64_t base, uint64_t site);

/* s: the slots' buffers (s[FL_GSLOT_IN] the input rows, s[FL_GSLOT_OUT] where the output goes; may alias
 * the input only when the graph's inference buffers say so). */
fl_status fl_block_forward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                           const fl_block_ctx *x);
/* gb[FL_GBUF_RES] holds d(output) on entry and d(input) on return (accumulated along the residual path);
 * gb[1 .. n_gbuf-1]: (N, gbuf_width) scratch. Parameter gradients accumulate (+=). */
fl_status fl_block_backward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                            float *const *gb, const fl_block_ctx *x);

/* The dyb16 of the block's first LINEAR in the backward's order when it reads d(output) as a bf16 dy
 * (fl_block_ctx.dout16_ready), else NULL. */
void *fl_block_dout16(const fl_block_graph *g, const fl_block_params *bp);
/* The slots (bit k: slot k) whose fp32 views fl_block_backward reads with context x; a bf16-stored slot read
 * only through the backend's bf16-input ops (issue 30 item 1) is not among them, so its widening is skipped. */
unsigned fl_block_bwd_reads32(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                              const fl_block_ctx *x);
/* The slots (bit k) a forward with context x stores in bf16 under gemm16 (fl_block_ctx.gemm16), else 0: WIDE, with a
 * bf16 copy in x->s16, and read after their last writer only by LINEARs whose GEMM rounds x to bf16 anyway (a BF16
 * weight, or a 4-bit base with q416) and that carry no adapter. */
unsigned fl_block_gemm16_slots(const fl_block_graph *g, const fl_block_params *bp, const fl_block_ctx *x);
/* bf16 stored on an FL_CAP_VIEWS16 backend (issue 30 item 1): the slots whose fp32 views a pass with context x writes
 * or reads, forward and backward (~0u: every one, another backend; exec.c); fl_block_views_dropped (acts.c): the WIDE
 * slots no block of the model's training arena needs, which acts.c does not carve (their views NULL, the ops writing
 * bf16 only; fl_model_attach_adapter refuses an adapter that would read one). */
/* exec_fuse.c: p's pending add done, fused with the norm of its sum when out16 != NULL (add_norm_forward16: out (NULL
 * or), out16, mean (LayerNorm), rstd; the norm's weight w, bias b of wt), else alone (add16); p->on cleared. The
 * bits of add16 then the w16 norm. */
fl_status fl_add_pending_norm(const fl_model *m, fl_add_pending *p, float *out, void *out16, float *mean,
                              float *rstd, const void *w, const void *b, fl_dtype wt);
fl_status fl_xblock_take(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                         const fl_block_ctx *x, void *n16, int *i0);
/* FITLLM_CUDA_XBLOCK_NORM (unset or 1: on, 0: off): the cross-block add + norm; *on. An error for another value. */
fl_status fl_xblock_fuse_on(int *on);
/* FITLLM_CUDA_LORA16 (unset or 1: on, 0: off): a frozen bf16 base's bf16 dy (fl_act_opts.dy_bf16) and the adapters'
 * backward without widening its input where it has dropout (lora_model.c's x16_only); *on. An error for another value. */
fl_status fl_lora16_on(int *on);
unsigned fl_block_views32(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, const fl_block_ctx *x);
unsigned fl_block_views_dropped(const fl_model *m, const fl_block_graph *g);
/* acts.c: f over every block's bound facts (fl_block_bind_facts) in a bf16-stored pass (every WIDE and stream slot
 * stored), with and without the config's attention dropout: the set-up decisions' walk; the first nonzero f, or 0 */
typedef unsigned (*fl_block_facts_fn)(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                                      const fl_block_ctx *x, void *ud);
unsigned fl_block_facts_walk(const fl_model *m, const fl_block_graph *g, fl_block_facts_fn f, void *ud);
/* exec16.c, issue 30 item 1 (bf16 stored, FL_CAP_STREAM16): the residual slots (bit k; the input, the output and the
 * slots residual adds write) whose fp32 views may share one buffer in every block of the model's training arena, the
 * adds reading the residual operand in bf16: every pass (training and evaluation, checkpointing's recompute) reads
 * such a view only while the buffer holds it and the backward reads none (from the facts fl_get_block would bind,
 * at set-up); 0: off (another backend, FITLLM_CUDA_STREAM16=0, tensor / sequence parallel). fl_block_stream16_lacks:
 * NULL, or the slot a pass with context x would read from the shared buffer while it holds another (the check). */
unsigned fl_block_stream16(const fl_model *m, const fl_block_graph *g);
/* exec16.c, issue 30 items 1 and 3 (bf16 stored, stream16, the backend's gemm_res16; FITLLM_CUDA_RESGEMM=0 off): bit i,
 * op i is a residual ADD whose sum the LINEAR op i - 1 writes with its GEMM (C the residual's stored bf16 rows, D the
 * sum's): an unbiased, unadapted bf16 linear (LLaMA's o and down) whose output only the ADD reads, the residual operand
 * read from its bf16 rows (stream16), RMSNorm. The ADD then adds nothing: its norm (or the pending add's) reads the
 * stored sum (add_norm_forward16_b16 with a NULL). Per pass, from the bound facts; no memory depends on it. */
unsigned fl_block_resgemm(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                          const fl_block_ctx *x);
int fl_block_stream16_dead(const fl_block_graph *g, unsigned shared, int i, int k);
const char *fl_block_stream16_lacks(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                                    const fl_block_ctx *x, unsigned shared);
/* fl_block_bwd_reads32 as the planner's null backend takes it (the bf16 ops of the backend it stands in for) */
unsigned fl_block_bwd_reads32_p(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                                const fl_block_ctx *x);
/* Testing only (0 otherwise): slots fl_block_views32 leaves out although a pass needs them, so the test shows that an op
 * handed such a view (NULL) fails instead of reading or writing memory (tests/test_cuda_views.c). */
extern unsigned fl_views_test_forget;
/* FL_CAP_VIEWS16 (issue 30 item 1): the ops (bit i: op i) of a block pass that write their fp32 result's bf16 copy
 * alone, since no op reads the fp32 (forward, bwd 0: RoPE before the fused causal attention's bf16 input; backward:
 * the activation's / RoPE's d(in) that only the LINEAR before reads, in bf16); 0 on other backends (exec16.c).
 * fl_only16_test_force (testing only, 0 otherwise): ops taken so although a later op reads the fp32, to show that
 * reader refused by name (tests/test_cuda_views.c). */
unsigned fl_block_only16(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, const fl_block_ctx *x,
                         int bwd);
extern unsigned fl_only16_test_force;
/* The slots whose fp32 gradient no backward pass of the model's training arena writes (exec16.c; acts.c sizes the
 * gradient buffers without them: fl_act_opts.gdrop), and a pass's check against it (the slot's name, NULL: none
 * lacking). fl_block_bind_facts (acts.c): the facts fl_get_block would bind for block l's LINEARs, every pointer
 * `any`, for these set-up decisions. */
unsigned fl_block_grads_dropped(const fl_model *m, const fl_block_graph *g, int dy16);
const char *fl_block_grads16_lacking(const fl_block_graph *g, unsigned gdrop, unsigned only16);
void fl_block_bind_facts(const fl_model *m, const fl_block_graph *g, int l, int dy16, void *any, fl_block_params *bp);

/* Inference scratch for n rows: the floats of the graph's shared buffers (64-byte aligned views), and with a
 * base, the slot views (s[FL_GSLOT_IN] and s[FL_GSLOT_OUT] point to the same buffer). */
size_t fl_block_rows_scratch(const fl_block_graph *g, int n, float *base, float **s);

/* ---- the model around the blocks -------------------------------------------------------------
 * A short table read top to bottom: what makes the first residual rows, the blocks, what follows them.
 * The decoders': EMBED (tokens, + positions unless RoPE), BLOCKS, NORM (final), HEAD_LM (chunked head +
 * cross-entropy: transformer.c's LM path). An encoder (BERT): EMBED, EMBED_TYPE, NORM (embedding norm),
 * BLOCKS, OUTPUT (the last residual rows are the result: fl_model_encode). */
typedef enum {
    FL_MOP_EMBED,      /* res[0] = wte[ids] (+ wpe[pos]) */
    FL_MOP_EMBED_TYPE, /* res[0] += wtt[type_ids] (role TYPE_EMBED; BERT's token types) */
    FL_MOP_PATCH,      /* res[0] = patches @ W^T + b (+ pos): ViT's patch embedding. Declared, not executed yet */
    FL_MOP_QUERIES,    /* res[0] = learned query rows (NQ, C) per sequence: BLIP-2's Q-Former. Declared only */
    FL_MOP_NORM,       /* the stream normalized in place (before BLOCKS: the embedding norm, saving its input) */
    FL_MOP_BLOCKS,     /* the L blocks (fl_block_graph) */
    FL_MOP_HEAD_LM,    /* the LM head and cross-entropy */
    FL_MOP_OUTPUT,     /* the stream is the model's output (hidden states); in a stack before the last: the stream
                        * the next stack's blocks read (their XSTREAM slot: an encoder-decoder's encoder output) */
    FL_MOP_RELBIAS,    /* the stack's relative position bias (NH, T, Tk) from its first block's table (role REL_BIAS,
                        * T5's buckets: bidirectional in a stack before the last, causal in the last), added to every
                        * block's self-attention scores; its gradient (summed over the blocks) back into the table */
} fl_mop_kind;

#define FL_MODEL_GRAPH_MAX_OPS 12
#define FL_MODEL_GRAPH_MAX_STACKS 2
typedef struct fl_model_graph_s {
    int n_ops;
    /* NORM: its parameters' roles; stack: which stack the op belongs to (0 the first; the ops of a stack are
     * consecutive, each stack has one BLOCKS; stack s's blocks are the layout's groups after stack s-1's) */
    struct { uint8_t kind; int8_t role_w, role_b, stack; } op[FL_MODEL_GRAPH_MAX_OPS];
    int n_stacks;          /* derived (fl_model_graph_build) */
} fl_model_graph;

/* The model graph of a (validated) config's architecture (fl_arch_info.model_graph, else the decoder's). */
fl_status fl_model_graph_build(const fl_model_config *c, fl_model_graph *mg);
/* Builders (fl_arch_info.model_graph): append an op (role_w/role_b: a NORM's parameters, else -1) to the current
 * stack; fl_model_graph_stack starts the next stack (its ops follow). */
void fl_model_graph_op(fl_model_graph *mg, fl_mop_kind kind, int role_w, int role_b);
void fl_model_graph_stack(fl_model_graph *mg);
/* The block graph of stack s (0: fl_arch_info.block_graph or the decoder block; 1: block_graph2). */
fl_status fl_stack_graph_build(const fl_model_config *c, int stack, fl_block_graph *g);
/* the same, sequence parallel (sp: fl_block_graph_sp instead of the tensor-parallel rewrite; needs tp_size > 1) */
fl_status fl_stack_graph_build_ex(const fl_model_config *c, int stack, int sp, fl_block_graph *g);
/* Has the model graph an op of this kind (before BLOCKS: where < 0, after: > 0, anywhere: 0)? */
int fl_model_graph_has(const fl_model_graph *mg, fl_mop_kind kind, int where);

#endif
