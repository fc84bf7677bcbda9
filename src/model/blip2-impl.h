/* BLIP-2's private state (src/model/blip2.c: config, presets, loading; blip2_pass.c: the arena and the passes). */
#ifndef FL_MODEL_BLIP2_IMPL_H
#define FL_MODEL_BLIP2_IMPL_H

#include "fitllm/blip2.h"
#include "model-impl.h"

/* One part's stack in the arena: its block graphs (g[1]: the Q-Former's block with the cross-attention), residual
 * stream, saved slots, and the norm around the blocks (the vision tower's and the language model's final norm, the
 * Q-Former's embedding norm: nin its input). */
typedef struct {
    fl_block_graph g[2];
    int L, T;              /* blocks; rows per sequence */
    int xslot;             /* g[1]'s XSTREAM slot (the image features), -1 */
    float **res;           /* L + 1 views (B T, C) */
    fl_layer_acts *layer;  /* L */
    float *nin, *nout, *nmean, *nrstd;
} fl_b2_stack;

struct fl_blip2 {
    fl_blip2_config cfg;
    const fl_backend *be;
    fl_mem_pool *pool;
    fl_model part[FL_BLIP2_PARTS];
    /* the arena (fl_blip2_alloc_acts): B images, T language-model ids, TL its rows (T, or T + NQ prepended) */
    int B, T, TL;
    fl_b2_stack st[FL_BLIP2_PARTS];
    void *acts, *work;
    size_t acts_part[FL_BLIP2_PARTS]; /* each part's share of acts (carve_acts) */
    size_t acts_saved[FL_BLIP2_PARTS]; /* of which kept for the backward (0 for a lean part) */
    int lean[FL_BLIP2_PARTS]; /* carved without saved activations: the part and every part before it train nothing */
    float *patches, *pe;    /* (B P, 3 p p) the pixels patch by patch, (B P, Cv) their projection */
    float *hpatches;        /* host pool, OTHER (B P, 3 p p): patches arranged on the host, copied to patches */
    float *qproj, *dqproj;  /* (B NQ, Ct) the projected queries, their gradient */
    float *dimg;            /* (B (P + 1), Cv) d(image features) */
    float *wstage;          /* 16-bit storage: the entries the passes read as fp32, widened (par), else unused */
    float *gb[FL_GRAPH_MAX_GBUF];
    int n_gb;
    float *logits, *losses;
    int chunk;
    int32_t *ids, *dtargets; /* device: the language model's ids, targets (NULL on host-memory backends) */
    int32_t *hids;           /* host (B TL): the last forward's ids */
    int *qrow;               /* host (B NQ): the language-model row of each query */
    /* the last forward */
    int Bp, Tp, fwd_train;
    int drop;               /* the last forward dropped (a training forward with dropout on): so does its backward */
    float *temp;            /* WORKSPACE: the blocks' TEMP slots (a dropped projection's output), one buffer for all */
    void *xb16, *dyb16;     /* WORKSPACE, bf16 compute with trained weights: the bf16 dW GEMMs' x and dy scratch (the
                             * decoder-only passes' dw_bf16), bound to every trained bf16 linear in the backward; NULL */
    long n_valid;
    double loss_sum;
};

void fl_blip2_free_acts(fl_blip2 *b);

#endif
