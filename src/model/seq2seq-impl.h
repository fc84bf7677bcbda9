/* The encoder-decoder's activation views (seq2seq.c's passes, seq2seq_acts.c's arena): private to src/model. */
#ifndef FL_SEQ2SEQ_IMPL_H
#define FL_SEQ2SEQ_IMPL_H

#include "model-impl.h"

typedef struct {
    fl_block_graph g;
    int L, l0;            /* blocks; the first one's index among all the model's blocks (layout group l0 + 1) */
    int Tmax;             /* rows per sequence the arena holds */
    int xslot;            /* the XSTREAM slot of its blocks (the earlier stack's output), -1 */
    float **res;          /* L + 1 views (B Tmax, C) */
    fl_layer_acts *layer; /* L */
    float *nout, *nrstd;  /* the final norm's output (B Tmax, C) and rstd (B Tmax) */
    float *bias, *dbias;  /* (NH, T, T) relative position bias and its gradient */
    int32_t *buckets;     /* (2T - 1) bucket of each diagonal key - query (device memory; backend.h's relbias) */
    int32_t *ids;         /* (B T) (device memory) */
    fl_block_graph gtp;   /* sequence parallel: the tensor-parallel graph generation runs (its rows per token) */
} s2s_stack;

struct fl_s2s_acts {
    int B, n_stacks;      /* the arena's sequences (sequence parallel: a multiple of the group); the stacks */
    int sp;               /* sequence parallel: the group's size (the blocks' graphs fl_block_graph_sp), else 0 */
    int spp;              /* the pass in progress runs the sequence-parallel graphs (a->sp; generation: 0) */
    int32_t *pad;         /* sequence parallel: a pass's sequences padded to rows the group divides (host memory) */
    fl_dtype act16;       /* the WIDE slots saved in this 16-bit dtype (a bf16 policy without checkpointing), else 0 */
    int gen;              /* generation's arena (fl_model_alloc_gen_s2s): the last stack's per-row buffers hold one row
                           * per sequence (the token being decoded) but its self-attention's q|k|v slot (the K/V cache:
                           * every row) and the cross k|v (the source's rows, computed once); its bias one query row;
                           * no gradient buffers. The training passes refuse it. */
    int Bp;               /* the last forward's sequences (<= B) */
    s2s_stack st[FL_MODEL_GRAPH_MAX_STACKS];
    int T[FL_MODEL_GRAPH_MAX_STACKS]; /* the last forward's rows per sequence */
    uint8_t *kmask;       /* (B, T[0]) the first stack's key padding mask (device memory) */
    int kmask_on;
    float *dstream;       /* (B T[0], C) d(the first stack's output) */
    float *gb[FL_GRAPH_MAX_GBUF]; /* the backward's gradient buffers, B x max Tmax rows; gb[1] also d(final norm out) */
    float *logits, *losses;
    void *be_scratch;     /* the backend's op scratch (bf16 matmuls, 4-bit weights), lent for each pass, or NULL */
    int32_t *targets;     /* device copy when the backend's memory is not host memory, else NULL */
    int chunk;            /* logits rows per chunk */
    float drop_p;         /* the last forward's dropout rate: cfg.dropout_rate in a training forward with cfg.dropout_on,
                           * else 0 (its backward regenerates the same masks from the model's drop_seed) */
    /* the training forward in progress between fl_model_forward_s2s_body and fl_model_forward_head: the last stack
     * stopped at its HEAD_LM op (defer set by the body), the head's targets, grad_scale and rows */
    struct { const int32_t *targets; float grad_scale; int N, defer, open; } head;
};

/* Rows of slot k of stack s's blocks per sequence: its own T, or the earlier stack's for an XSTREAM and what is
 * computed from it alone. */
static inline int slot_T(const struct fl_s2s_acts *a, int s, int k, const int *T) {
    return a->st[s].g.slot[k].xrows && s > 0 ? T[s - 1] : T[s];
}

/* Elements per width of slot k of stack s for B sequences: sequence parallel, a slot of the stream's rows is the
 * rank's B T / sp of them */
static inline size_t slot_n(const struct fl_s2s_acts *a, int s, int k, const int *T, size_t B) {
    const size_t n = B * (size_t)slot_T(a, s, k, T);
    return a->sp > 1 && a->st[s].g.slot[k].srows ? n / (size_t)a->sp : n;
}
static inline size_t stream_n(const struct fl_s2s_acts *a, size_t N) { return a->sp > 1 ? N / (size_t)a->sp : N; }

/* Whether slot k of a block graph is a self-attention's q|k|v input: decoding reads its earlier rows as the keys and
 * values (fl_block_ctx.kv_rows), so the generation arena keeps every row of it. */
static inline int s2s_kv_slot(const fl_block_graph *g, int k) {
    for (int i = 0; i < g->n_ops; i++)
        if (g->op[i].kind == FL_GOP_ATTN && g->op[i].attn != FL_ATTN_CROSS && g->op[i].in == k) return 1;
    return 0;
}

/* The generation arena's one row per sequence: slot k of stack s holds it (a->gen, the last stack, neither the cache
 * nor the source's rows) */
static inline int s2s_one_row(const struct fl_s2s_acts *a, int s, int k) {
    return a->gen && s == a->n_stacks - 1 && !a->st[s].g.slot[k].xrows && !s2s_kv_slot(&a->st[s].g, k);
}

/* The encoder-decoder's passes behind the model's step entries (fl_model_kind, fitllm/model.h): seq2seq.c's table,
 * installed with the arena (seq2seq_acts.c), whose live-byte and adapter-row queries it names */
extern const fl_model_kind fl_s2s_kind;
void fl_s2s_live_bytes(const fl_model *m, int train, size_t *acts, size_t *work);
size_t fl_s2s_adapter_live_rows(const fl_model *m, int layer, int param_index);

/* A pipeline stage of an encoder-decoder (seq2seq.c): whether it runs stack s's embedding / its final norm (and the
 * decoder's head); 1 for a whole model. The stage's streams and stash: seq2seq_stage.c. */
int fl_s2s_runs_embed(const fl_model *m, int s);
int fl_s2s_runs_norm(const fl_model *m, int s);
fl_status fl_s2s_stage_output(const fl_model *m, float *y);
fl_status fl_s2s_stage_dout(fl_model *m, const float *dy);
fl_status fl_s2s_stage_dinput(const fl_model *m, float *dx);
typedef struct fl_s2s_stash fl_s2s_stash;
size_t fl_s2s_stash_bytes(const fl_model *m);
/* Testing only (0 otherwise): 1 turns off the bf16 saved slots' use by the block passes (seq2seq.c's ctx16: the
 * forward's gemm16 stores, the backward's bf16 reads), so a test compares the passes' bits with and without them. */
extern int fl_s2s_test_no16;
fl_status fl_s2s_stash_new(fl_model *m, fl_s2s_stash **out);
void fl_s2s_stash_free(fl_model *m, fl_s2s_stash *s);
fl_status fl_s2s_stash_save(fl_model *m, fl_s2s_stash *s);
fl_status fl_s2s_stash_restore(fl_model *m, const fl_s2s_stash *s);
fl_status fl_s2s_stash_swap(fl_model *m, fl_s2s_stash *s, void *scratch, size_t scratch_bytes);

#endif
