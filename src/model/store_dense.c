/* The dense parameter store (store.h): the flat layout in one fp32, bf16 or f16 buffer, its
 * gradients, a mixed policy's compute-dtype copy and 16-bit storage's fp32 staging. Its lifetime
 * (what fl_model_init_ex, fl_model_alloc_grads, fl_model_set_precision and fl_model_free did to
 * these buffers, in the same order) serves the 4-bit and FSDP stores too, which change how entries
 * are bound, not how the buffers are made. */
#include <stdlib.h>
#include <string.h>

#include "store.h"

static void *dense_param_at(const fl_param_store *s, size_t so) {
    return s->params ? (void *)(s->params + so) : (void *)(s->p16 + so);
}

static const void *dense_compute_at(const fl_param_store *s, size_t so) {
    return s->wcompute ? (const void *)((const char *)s->wcompute + so * fl_dtype_size(s->compute_dtype)) : NULL;
}

static void *dense_grad_at(const fl_param_store *s, size_t off) {
    if (s->dtype == FL_F32) return s->grads ? (void *)(s->grads + off) : NULL;
    return s->g16 ? (void *)(s->g16 + off) : NULL;
}

static fl_status no_gather(fl_param_store *s, int g, int next) { (void)s, (void)g, (void)next; return FL_OK; }
static void no_release(fl_param_store *s, int g) { (void)s, (void)g; }
static fl_status no_group(fl_param_store *s, int g) { (void)s, (void)g; return FL_OK; }
static void no_zero(fl_param_store *s) { (void)s; }

const fl_param_store_ops fl_store_dense_ops = {
    "dense", 1, dense_param_at, dense_compute_at, dense_grad_at, no_gather, no_release, no_group, no_group, no_zero,
};

static void free_buffers(fl_param_store *s) {
    fl_mem_pool *bp = fl_store_buf_pool(s); /* offloaded: the host tier's */
    fl_mem_free(s->pool, s->wcompute);
    fl_mem_free(bp, s->grads);
    fl_mem_free(bp, s->params);
    fl_mem_free(bp, s->g16);
    fl_mem_free(s->pool, s->gstage);
    fl_mem_free(s->pool, s->pstage);
    fl_mem_free(bp, s->p16);
    fl_mem_free(s->pool, s->q4_mem);
    free(s->soff);
    free(s->q4);
}

void fl_store_destroy(fl_param_store *s) {
    if (!s) return;
    free_buffers(s);
    free(s);
}

fl_status fl_store_create(const fl_param_layout *lay, const fl_model_config *cfg, const fl_backend *be,
                          fl_mem_pool *pool, const fl_model_storage *st, void *model, fl_param_store **out) {
    fl_param_store *s = calloc(1, sizeof *s);
    *out = s;
    if (!s) return fl_errorf(FL_ERR_OOM, "parameter store: out of host memory");
    s->ops = &fl_store_dense_ops;
    s->lay = lay;
    s->be = be;
    s->pool = pool;
    if (st) s->storage = *st;
    else s->storage.param_dtype = FL_F32;
    s->dtype = s->storage.param_dtype;
    s->compute_dtype = s->dtype;
    s->numel = lay->numel;
    fl_status st_ = FL_OK;
    s->dense_numel = lay->numel;
    if (s->storage.quant4) {
        s->soff = malloc((size_t)lay->n * sizeof *s->soff);
        s->q4 = calloc((size_t)lay->n, sizeof *s->q4);
        if (!s->soff || !s->q4) st_ = fl_errorf(FL_ERR_OOM, "4-bit storage bookkeeping: out of host memory");
        else s->dense_numel = fl_store_q4_plan(lay, cfg, &s->storage, s->soff, &s->q4_bytes);
    }
    if (st_ == FL_OK && s->storage.shard) { /* sharded from the start: the owner allocates this rank's shard */
        if (s->dtype != FL_F32) s->pstage_n = fl_sizing_pstage_elems(cfg);
        st_ = s->storage.shard(s->storage.shard_ud, model); /* fl_model_store_shard -> fl_store_make_shard */
    } else if (st_ == FL_OK && s->dtype == FL_F32) {
        st_ = fl_mem_alloc(pool, FL_TAG_PARAMS, s->dense_numel * sizeof(float), (void **)&s->params);
    } else if (st_ == FL_OK) {
        s->pstage_n = fl_sizing_pstage_elems(cfg);
        st_ = fl_mem_alloc(pool, FL_TAG_PARAMS, s->dense_numel * sizeof(uint16_t), (void **)&s->p16);
    }
    if (st_ == FL_OK && s->q4_bytes) st_ = fl_mem_alloc(pool, FL_TAG_PARAMS, s->q4_bytes, &s->q4_mem);
    if (st_ == FL_OK && s->pstage_n)
        st_ = fl_mem_alloc(pool, FL_TAG_WORKSPACE, s->pstage_n * sizeof(float), (void **)&s->pstage);
    if (st_ == FL_OK) st_ = fl_store_q4_bind(s, cfg);
    if (st_ != FL_OK) {
        fl_store_destroy(s);
        *out = NULL;
    }
    return st_;
}

fl_status fl_store_alloc_grads(fl_param_store *s, const fl_model_config *cfg) {
    if (s->grads || s->g16) return FL_OK;
    if (s->q4)
        return fl_errorf(FL_ERR_UNSUPPORTED, "the 4-bit base weights are frozen: QLoRA trains LoRA adapters only "
                         "(fitllm finetune_lora --quantize ...)");
    fl_status st;
    const size_t n = s->numel; /* sharded: this rank's shard */
    const fl_backend *bbe = fl_store_buf_be(s); /* offloaded: the gradient shard in the host tier */
    fl_mem_pool *bp = fl_store_buf_pool(s);
    if (s->dtype == FL_F32) {
        st = fl_backend_calloc(bbe, bp, FL_TAG_GRADS, n * sizeof(float), (void **)&s->grads);
    } else {
        s->gstage_n = fl_sizing_gstage_elems(cfg);
        st = fl_backend_calloc(bbe, bp, FL_TAG_GRADS, n * sizeof(uint16_t), (void **)&s->g16);
        if (st == FL_OK) st = fl_mem_alloc(s->pool, FL_TAG_WORKSPACE, s->gstage_n * sizeof(float), (void **)&s->gstage);
        if (st != FL_OK) {
            fl_mem_free(bp, s->g16);
            s->g16 = NULL;
        }
    }
    return st == FL_OK ? st : fl_error_prefix(st, "allocating gradients (%s)", fl_dtype_name(s->dtype));
}

void fl_store_zero_grads(fl_param_store *s) {
    /* offloaded: not zeroed (every unit's first reduction of the step writes its piece of the host shard,
     * FSDP's `fresh`), so an NVMe tier's gradient pages are not touched for nothing */
    if (s->grads && !s->tpool) FL_RUN(s->be, zero, s->grads, s->numel * sizeof(float));
    if (s->g16 && !s->tpool) FL_RUN(s->be, zero, s->g16, s->numel * sizeof(uint16_t));
    s->ops->zero_grads(s);
}

fl_status fl_store_set_compute(fl_param_store *s, const fl_precision *p) {
    fl_mem_free(s->pool, s->wcompute);
    s->wcompute = NULL;
    s->compute_dtype = p->compute_dtype;
    if (p->compute_copy && s->ops->whole) { /* sharded: each gathered unit converts its own (src/train/fsdp.c) */
        fl_status st = fl_mem_alloc(s->pool, FL_TAG_PARAMS, fl_precision_copy_bytes(p, s->dense_numel), &s->wcompute);
        if (st != FL_OK) return fl_error_prefix(st, "allocating the %s weight copy", p->name);
        fl_store_sync_compute(s);
    }
    return FL_OK;
}

void fl_store_sync_compute(fl_param_store *s) {
    /* sharded: no whole copy (each gathered group converts its own, src/train/fsdp.c) */
    if (s->wcompute && s->params && s->ops->whole)
        FL_RUN(s->be, convert, s->wcompute, s->compute_dtype, s->params, FL_F32, s->dense_numel);
}
