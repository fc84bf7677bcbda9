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
 * A new architecture of the same family (pre-norm residual blocks) is a new builder in graph.c;
 * a new kind of op is one case in each executor. See docs/ARCHITECTURE.md "The block graph". */
#ifndef FL_MODEL_GRAPH_H
#define FL_MODEL_GRAPH_H

#include <stdint.h>

#include "fitllm/generate.h"
#include "fitllm/model.h"

#define FL_GRAPH_MAX_SLOTS 16
#define FL_GRAPH_MAX_OPS 16
_Static_assert(FL_GRAPH_MAX_SLOTS == sizeof(((fl_layer_acts *)0)->s) / sizeof(float *),
               "fl_layer_acts (model-impl.h) holds one view per slot");

/* Slot 0 is the block's input (res[l]), slot 1 its output (res[l+1]): the residual stream. */
enum { FL_GSLOT_IN = 0, FL_GSLOT_OUT = 1 };

typedef enum {
    FL_GSLOT_STREAM, /* the block's input or output: lives in the residual stream, not in the block's buffers */
    FL_GSLOT_WIDE,   /* an (N, width) activation the backward reads: saved per block (16-bit when narrowed) */
    FL_GSLOT_STAT,   /* per-row fp32 statistics (norm mean / rstd, attention log-sum-exp): saved, never narrowed */
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
    int8_t grad;       /* fl_gbuf of its gradient in the backward (FL_GBUF_NONE: statistics) */
} fl_gslot;

typedef enum {
    FL_GOP_NORM,   /* out, a1 (mean: LayerNorm only, else -1), a2 (rstd) = norm_p(in): the architecture's norm */
    FL_GOP_LINEAR, /* out = in @ W_p^T (+ b_p) (+ LoRA) */
    FL_GOP_ROPE,   /* in place: rotate the q and k heads of in (fused q|k|v rows) */
    FL_GOP_ATTN,   /* out, a1 (lse) = causal GQA attention over in's fused q|k|v rows */
    FL_GOP_ADD,    /* out += in (the residual connection; both on the residual path) */
    FL_GOP_SWIGLU, /* out (N, F) = silu(in[:, :F]) * in[:, F:] */
    FL_GOP_GELU,   /* out = gelu_tanh(in) */
    FL_GOP_RELU,   /* out = max(in, 0) */
} fl_gop_kind;

typedef struct {
    uint8_t kind;        /* fl_gop_kind */
    int8_t in, out;      /* slots (ROPE: in == out) */
    int8_t a1, a2;       /* auxiliary output slots (statistics), -1 if none */
    int8_t p;            /* NORM: norm index (fl_block_params.norm_*), LINEAR: linear index (lin[], LoRA kind) */
    int8_t role_w, role_b; /* NORM / LINEAR: the parameters' fl_param_role (role_b -1: none) */
    uint8_t acc;         /* derived: the backward adds to d(in) (the residual path, or a slot's later reader in
                          * the backward's order: its gradients are summed) instead of starting it */
} fl_gop;

#define FL_GRAPH_MAX_NORMS 2
#define FL_GRAPH_MAX_LINEARS 4

typedef struct fl_block_graph_s {
    int n_slots, n_ops;
    fl_gslot slot[FL_GRAPH_MAX_SLOTS];
    fl_gop op[FL_GRAPH_MAX_OPS];
    int n_norms, n_linears;
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
/* Derive a table's production order, gradient buffers, widths and inference buffers (n_slots, slot[] with
 * name/width/kind/resid, n_ops, op[], n_norms, n_linears filled; the rest zero), checking that
 * every slot is made once before it is read, every off-path activation is read (by one op or several:
 * their gradients are summed), residual adds stay on the residual path, and the input dies before the
 * output is made. Used by fl_block_graph_build; a
 * new architecture's builder calls it too. */
fl_status fl_block_graph_finish(fl_block_graph *g);

/* Parameter and gradient pointers of one block, bound by the graph's NORM and LINEAR ops. */
typedef struct fl_block_params {
    const float *norm_w[FL_GRAPH_MAX_NORMS], *norm_b[FL_GRAPH_MAX_NORMS];
    float *d_norm_w[FL_GRAPH_MAX_NORMS], *d_norm_b[FL_GRAPH_MAX_NORMS];
    fl_linear lin[FL_GRAPH_MAX_LINEARS];
} fl_block_params;

/* Where a block pass runs. */
typedef struct {
    int B, T, pos0;                     /* B sequences of T rows at positions pos0 .. pos0+T-1 */
    const float *rope_cos, *rope_sin;   /* (>= pos0+T, HD/2) */
    fl_kv_cache *kv;                    /* generation (B == 1): ATTN appends its K/V rows to the cache and, for
                                         * one row, attends to positions 0..pos0 of it; NULL: training */
    int layer;                          /* the cache's layer */
    void *const *s16;                   /* BF16 saved activations: each WIDE slot's bf16 copy (fl_layer_acts.s16).
                                         * Backward: a LINEAR's bf16 weight-gradient GEMM reads it as its rounded
                                         * input (the same bits). Forward (with narrowed): a LINEAR with a BF16
                                         * weight rounds its input there and its GEMM reads that copy. NULL: none */
    unsigned *narrowed;                 /* forward with s16: bit k set when the block rounded slot k into s16 */
    int no_din;                         /* backward: nothing reads d(input) (block 0 under LoRA: the embeddings
                                         * are frozen), so ops whose gradient only flows there are skipped */
} fl_block_ctx;

/* s: the slots' buffers (s[FL_GSLOT_IN] the input rows, s[FL_GSLOT_OUT] where the output goes; may alias
 * the input only when the graph's inference buffers say so). */
fl_status fl_block_forward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                           const fl_block_ctx *x);
/* gb[FL_GBUF_RES] holds d(output) on entry and d(input) on return (accumulated along the residual path);
 * gb[1 .. n_gbuf-1]: (N, gbuf_width) scratch. Parameter gradients accumulate (+=). */
fl_status fl_block_backward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                            float *const *gb, const fl_block_ctx *x);

/* Inference scratch for n rows: the floats of the graph's shared buffers (64-byte aligned views), and with a
 * base, the slot views (s[FL_GSLOT_IN] and s[FL_GSLOT_OUT] point to the same buffer). */
size_t fl_block_rows_scratch(const fl_block_graph *g, int n, float *base, float **s);

#endif
