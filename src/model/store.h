/* The parameter store: ONE interface through which every op that reads a weight (a LINEAR, a norm,
 * the embeddings, the head) binds it, and through which the passes ask for a layout group's
 * parameters and hand its gradient back. The model (transformer.c, generate.c, graph.c) sees only
 * the bound views (fl_weight_view, fp32 pointers, gradient pointers), never which storage holds them.
 *
 * Implementations (src/model/store_*.c), chosen when the model is created:
 *   - dense (store.c): the flat layout in one buffer of fp32, bf16 or f16 (`params` / `p16`),
 *     its gradients (`grads` / `g16`), a mixed policy's compute-dtype copy (`wcompute`), and for
 *     16-bit storage the fp32 staging of 1-D parameters (`pstage`) and of one group's gradients
 *     (`gstage`, added into g16 once per group and micro-batch);
 *   - 4-bit (store_q4.c): the dense store with QLoRA's quantized entries (NF4/FP4 with their absmax,
 *     `q4`, bound into `q4_mem`) beside it; the other entries sit at `soff[i]` of the dense buffer;
 *   - FSDP shard (store_fsdp.c): the dense buffers hold this rank's shard; a group's whole parameters
 *     (and its gradient buffer) exist only while gathered, through the fl_param_provider that
 *     src/train/fsdp.c implements (the store, like the model, never talks to other ranks).
 *   - offloaded (store_offload.c; parameter offload, --offload_param_device cpu|nvme): the FSDP store
 *     whose shard and gradient shard live in a host tier (`tpool`, `tbe`: host memory or NVMe files)
 *     instead of the device pool; the provider copies a group's piece to the device in gather and its
 *     reduced gradient back in grads_ready (src/train/fsdp.c). At one rank the shard is the whole model.
 * The tensor-parallel shard (an entry's row or column slice bound as the
 * whole weight of a narrower LINEAR, the graph's collective op summing the partial outputs) is built as
 * the dense store of a slice's layout: fitllm/tp.h, docs/ARCHITECTURE.md "Tensor parallelism".
 *
 * Offsets: "layout offsets" are the flat layout's (the gradient and optimizer coordinates); "store
 * offsets" (fl_store_off) are where an entry sits in the dense buffer (equal without 4-bit entries). */
#ifndef FL_MODEL_STORE_H
#define FL_MODEL_STORE_H

#include "fitllm/model.h"

/* What an op reads for one weight entry: one of the stored data (fp32 `w`), its compute-dtype copy or
 * the 16-bit stored weight (`wc`, dtype `wct`), or the 4-bit parts of a (fused) output in row order. */
typedef struct {
    const float *w;
    const void *wc;
    fl_dtype wct;
    const fl_q4_weight *q4[FL_Q4_MAX_PARTS];
    int n_q4;
} fl_weight_view;

typedef struct fl_param_store_ops {
    const char *name; /* "dense", "fsdp": messages */
    int whole;        /* holds every parameter (else a shard whose groups are gathered) */
    /* the stored parameter at store offset so (store dtype); NULL while its group is not gathered */
    void *(*param_at)(const fl_param_store *s, size_t so);
    /* its compute-dtype copy (mixed precision), or NULL */
    const void *(*compute_at)(const fl_param_store *s, size_t so);
    /* the gradient at layout offset off in the store dtype: where an fp32 op accumulates, or where a
     * 16-bit group's staged fp32 gradient is added; NULL: none (frozen, or its group has no buffer) */
    void *(*grad_at)(const fl_param_store *s, size_t off);
    /* group g's parameters are about to be read (waits for a gather posted ahead), `next`'s may be
     * posted ahead (-1: none); release: done reading them */
    fl_status (*gather)(fl_param_store *s, int g, int next);
    void (*release)(fl_param_store *s, int g);
    /* group g's gradient buffer for this micro-batch (zeroed) / its gradient is complete */
    fl_status (*grads_begin)(fl_param_store *s, int g);
    fl_status (*grads_ready)(fl_param_store *s, int g);
    /* the start of an optimizer step: the next reductions replace the gradient instead of adding */
    void (*zero_grads)(fl_param_store *s);
} fl_param_store_ops;

struct fl_param_store {
    const fl_param_store_ops *ops;
    const fl_param_layout *lay; /* the model's layout */
    const fl_backend *be;
    fl_mem_pool *pool;
    fl_model_storage storage;   /* how it was created */
    fl_dtype dtype;             /* of the dense store: FL_F32, FL_BF16 or FL_F16 */
    fl_dtype compute_dtype;     /* of the compute copy and of the matmuls (the precision policy's) */
    size_t numel;               /* elements of the flat gradient / optimizer coordinates held here (a shard's) */
    float *params;              /* (dense_numel) PARAMS, fp32 storage, else NULL */
    uint16_t *p16;              /* (dense_numel) PARAMS, 16-bit storage, else NULL */
    float *grads;               /* (numel) GRADS, fp32 storage, NULL until fl_store_alloc_grads */
    uint16_t *g16;              /* (numel) GRADS, 16-bit storage */
    float *pstage, *gstage;     /* 16-bit storage: fp32 views of 1-D parameters, one group's gradients */
    size_t pstage_n, gstage_n;
    size_t *soff;               /* (lay->n) store offsets with 4-bit entries ((size_t)-1 for those), else NULL */
    size_t dense_numel;         /* elements of the dense store */
    fl_q4_weight *q4;           /* (lay->n) 4-bit entries (packed != NULL), or NULL */
    void *q4_mem;               /* PARAMS */
    size_t q4_bytes;
    void *wcompute;             /* (dense_numel) compute-dtype copy (mixed policies), PARAMS, or NULL */
    fl_param_provider *pp;      /* the FSDP store's provider */
    fl_mem_pool *tpool;         /* offloaded store: the pool of params / p16 / grads / g16 (host tier or NVMe), else NULL */
    const fl_backend *tbe;      /* the backend whose memory tpool's is (the host's) */
    /* data parallel (src/train/dp.c): called as each group's gradient becomes final (fl_store_grads_ready) */
    fl_status (*grad_ready)(void *ud, size_t off, size_t n);
    void *grad_ready_ud;
};

/* ---- lifetime (store.c, store_q4.c) ---- */
/* A store for lay with storage st (NULL: fp32): allocates the dense buffer (or calls st->shard, which
 * makes it a shard: fl_store_make_shard), the 4-bit entries, the staging. *out NULL on error. */
fl_status fl_store_create(const fl_param_layout *lay, const fl_model_config *cfg, const fl_backend *be,
                          fl_mem_pool *pool, const fl_model_storage *st, void *model, fl_param_store **out);
void fl_store_destroy(fl_param_store *s);
fl_status fl_store_alloc_grads(fl_param_store *s, const fl_model_config *cfg);
void fl_store_zero_grads(fl_param_store *s);
/* The compute-dtype copy of a policy (allocated and filled for mixed policies on a whole store). */
fl_status fl_store_set_compute(fl_param_store *s, const fl_precision *p);
void fl_store_sync_compute(fl_param_store *s);
/* 4-bit (store_q4.c): the storage plan (dense offsets, 4-bit bytes; soff may be NULL: count only), and
 * binding the entries into q4_mem. */
size_t fl_store_q4_plan(const fl_param_layout *lay, const fl_model_config *cfg, const fl_model_storage *st,
                        size_t *soff, size_t *q4_bytes);
fl_status fl_store_q4_bind(fl_param_store *s, const fl_model_config *cfg);
/* The FSDP store (store_fsdp.c): the dense buffer becomes `shard`, groups come through pp. */
void fl_store_make_shard(fl_param_store *s, void *shard, fl_param_provider *pp);
void fl_store_make_whole(fl_param_store *s);
/* The offloaded store (store_offload.c): as make_shard, with the shard (and later the gradients) in tier_pool,
 * host memory of tier_be. */
void fl_store_make_offloaded(fl_param_store *s, void *shard, fl_param_provider *pp, const fl_backend *tier_be,
                             fl_mem_pool *tier_pool);
/* the provider's view-based table entries, shared by the FSDP and offloaded stores (store_fsdp.c) */
void *fl_store_pp_param_at(const fl_param_store *s, size_t so);
const void *fl_store_pp_compute_at(const fl_param_store *s, size_t so);
void *fl_store_pp_grad_at(const fl_param_store *s, size_t off);
fl_status fl_store_pp_gather(fl_param_store *s, int g, int next);
void fl_store_pp_release(fl_param_store *s, int g);
fl_status fl_store_pp_grads_begin(fl_param_store *s, int g);
fl_status fl_store_pp_grads_ready(fl_param_store *s, int g);
void fl_store_pp_zero_grads(fl_param_store *s);
/* where the parameter and gradient buffers live: the tier's pool and backend (offloaded), else the store's */
static inline fl_mem_pool *fl_store_buf_pool(const fl_param_store *s) { return s->tpool ? s->tpool : s->pool; }
static inline const fl_backend *fl_store_buf_be(const fl_param_store *s) { return s->tbe ? s->tbe : s->be; }
extern const fl_param_store_ops fl_store_dense_ops, fl_store_fsdp_ops, fl_store_offload_ops;

/* ---- binding (store.c): what the passes call ---- */
int fl_store_is_q4(const fl_param_store *s, int i);  /* entry i is held 4-bit */
size_t fl_store_off(const fl_param_store *s, int i); /* entry i's store offset */
/* A shard: groups exist only between gather and release (FSDP). */
int fl_store_sharded(const fl_param_store *s);
/* The layout group holding layout (or, sharded, store) offset off. */
int fl_store_group_of(const fl_param_store *s, size_t off);
/* The weight of entry wi for a LINEAR of `out` rows (a fused output's 4-bit parts are consecutive entries). */
void fl_store_bind_weight(const fl_param_store *s, int wi, int out, fl_weight_view *v);
/* fp32 view of 1-D entry i (-1: NULL): in place (fp32) or widened into the next pstage slot (*cur). */
const float *fl_store_bind_1d(const fl_param_store *s, int i, float **cur);
/* The same with the widening deferred into w (NULL: at once): the 1-D entries a block binds are widened by one
 * fl_store_widen_flush (the backend's convert_many: one launch, convert's bits) instead of one convert each (a
 * GPT-2 block of a 16-bit store: 8 launches per pass; issue 30 item 1). */
typedef struct {
    int n;
    void *dst[FL_CONVERT_MANY_MAX];
    const void *src[FL_CONVERT_MANY_MAX];
    size_t len[FL_CONVERT_MANY_MAX];
} fl_store_widen;
const float *fl_store_bind_1d_w(const fl_param_store *s, int i, float **cur, fl_store_widen *w);
/* The same for n elements from entry i's start: a fused bias whose parts are consecutive entries (OPT's and the
 * Q-Former's q, k, v biases read as one (3C) bias) widened whole, not only its first entry. */
const float *fl_store_bind_span_w(const fl_param_store *s, int i, size_t n, float **cur, fl_store_widen *w);
void fl_store_widen_flush(const fl_param_store *s, fl_store_widen *w);
/* fp32 gradient of the entry at layout offset off (-1: NULL): in place (fp32) or its place in gstage (16-bit). */
float *fl_store_grad(const fl_param_store *s, size_t off);
/* 16-bit storage: gstage zeroed over n elements / added into the gradient at layout offset off (no-ops in fp32). */
void fl_store_stage_begin(fl_param_store *s, size_t n);
fl_status fl_store_stage_flush(fl_param_store *s, size_t off, size_t n);
/* The same over ranges r[k] = [r0, r1) of a group (relative to its layout offset goff): the parts still staged when
 * the linears' dW GEMMs write the 16-bit gradient in place (fl_store_direct16) */
void fl_store_stage_begin_ranges(fl_param_store *s, const size_t (*r)[2], int n);
fl_status fl_store_stage_flush_ranges(fl_param_store *s, size_t goff, const size_t (*r)[2], int n);
/* the implementation's ops (fl_param_store_ops): the parameter at store offset so; group g gathered (next: the one
 * to prefetch) / released; group g's gradient about to be written */
void *fl_store_param_at(const fl_param_store *s, size_t so);
fl_status fl_store_gather(fl_param_store *s, int g, int next);
void fl_store_release(fl_param_store *s, int g);
fl_status fl_store_grads_begin(fl_param_store *s, int g);
/* group g's gradient is final: the implementation's (FSDP: reduce-scatter), then the data-parallel hook */
fl_status fl_store_grads_ready(fl_param_store *s, int g);

#endif
