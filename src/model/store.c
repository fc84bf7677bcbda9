/* Binding weights through the parameter store (store.h), in one place: how every op's weight, 1-D parameter and
 * gradient is found, whatever holds it.
 *   1. the binding every implementation shares: the weight of a LINEAR, a 1-D parameter widened to fp32, a gradient
 *      (16-bit storage: staged in fp32 and added back), the store's dispatch to its implementation's ops;
 *   2. the dense implementation (fl_store_dense_ops): the flat layout in one fp32, bf16 or f16 buffer, its
 *      gradients, a mixed policy's compute-dtype copy and 16-bit storage's fp32 staging; its lifetime (what
 *      fl_model_init_ex, fl_model_alloc_grads, fl_model_set_precision and fl_model_free did to these buffers, in the
 *      same order) serves the 4-bit and FSDP stores too, which change how entries are bound, not how the buffers are
 *      made (the other implementations: store_q4.c, store_fsdp.c, store_offload.c);
 *   3. a block's and the outer groups' parameter views (which weights each op of the graph reads), shared by the
 *      training passes (transformer.c) and generation (generate.c); the ops that read them run in exec.c;
 *   4. the model's accessors of its store (fitllm/model.h): the parameter and gradient buffers, one parameter read
 *      or written in fp32 (a 4-bit one dequantized), the gradients allocated and cleared, the compute copy's
 *      refresh. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/tp.h"
#include "model-impl.h"
#include "store.h"

/* ---- 1. the binding every store shares ---- */
int fl_store_is_q4(const fl_param_store *s, int i) { return s->q4 && s->q4[i].packed != NULL; }
size_t fl_store_off(const fl_param_store *s, int i) { return s->soff ? s->soff[i] : s->lay->params[i].offset; }
int fl_store_sharded(const fl_param_store *s) { return !s->ops->whole; }
void *fl_store_param_at(const fl_param_store *s, size_t so) { return s->ops->param_at(s, so); }
fl_status fl_store_gather(fl_param_store *s, int g, int next) { return s->ops->gather(s, g, next); }
void fl_store_release(fl_param_store *s, int g) { s->ops->release(s, g); }
fl_status fl_store_grads_begin(fl_param_store *s, int g) { return s->ops->grads_begin(s, g); }

int fl_store_group_of(const fl_param_store *s, size_t off) {
    const size_t *go = s->lay->group_offset;
    int g = 0;
    while (g + 1 < s->lay->n_groups && off >= go[g + 1]) g++;
    return g;
}

void fl_store_bind_weight(const fl_param_store *s, int wi, int out, fl_weight_view *v) {
    v->w = NULL;
    v->wc = NULL;
    v->wct = s->compute_dtype;
    v->n_q4 = 0;
    if (wi < 0) return;
    if (fl_store_is_q4(s, wi)) {
        /* 4-bit base: a fused output (q|k|v, gate|up) is consecutive 4-bit entries, in row order */
        for (int r = 0, i = wi; r < out && i < s->lay->n && v->n_q4 < FL_Q4_MAX_PARTS && fl_store_is_q4(s, i); i++) {
            v->q4[v->n_q4++] = &s->q4[i];
            r += (int)s->lay->params[i].shape[0];
        }
        return;
    }
    size_t so = fl_store_off(s, wi);
    if (s->dtype != FL_F32) { /* 16-bit storage: the matmul reads the stored weights */
        v->wc = s->ops->param_at(s, so);
        v->wct = s->dtype;
        return;
    }
    v->w = s->ops->param_at(s, so);
    v->wc = s->ops->compute_at(s, so);
}

const float *fl_store_bind_1d(const fl_param_store *s, int i, float **cur) { return fl_store_bind_1d_w(s, i, cur, NULL); }

void fl_store_widen_flush(const fl_param_store *s, fl_store_widen *w) {
    const fl_backend *be = s->be;
    if (w->n > 1 && be->convert_many)
        (void)FL_RUN(be, convert_many, w->n, w->dst, FL_F32, (const void *const *)w->src, s->dtype, w->len);
    else
        for (int k = 0; k < w->n; k++) (void)FL_RUN(be, convert, w->dst[k], FL_F32, w->src[k], s->dtype, w->len[k]);
    w->n = 0;
}

const float *fl_store_bind_1d_w(const fl_param_store *s, int i, float **cur, fl_store_widen *w) {
    return i < 0 ? NULL : fl_store_bind_span_w(s, i, s->lay->params[i].numel, cur, w);
}

const float *fl_store_bind_span_w(const fl_param_store *s, int i, size_t n, float **cur, fl_store_widen *w) {
    if (i < 0) return NULL;
    const void *src = s->ops->param_at(s, fl_store_off(s, i));
    if (s->dtype == FL_F32) return src;
    float *v = *cur;
    *cur += n;
    if (!src) return NULL; /* sharded: its group is not gathered */
    if (!w) {
        FL_RUN(s->be, convert, v, FL_F32, src, s->dtype, n);
        return v;
    }
    if (w->n == FL_CONVERT_MANY_MAX) fl_store_widen_flush(s, w);
    w->dst[w->n] = v, w->src[w->n] = src, w->len[w->n++] = n;
    return v;
}

float *fl_store_grad(const fl_param_store *s, size_t off) {
    if (off == (size_t)-1) return NULL;
    if (s->dtype == FL_F32) return s->ops->grad_at(s, off);
    if (!s->g16) return NULL;
    return s->gstage + (off - s->lay->group_offset[fl_store_group_of(s, off)]);
}

void fl_store_stage_begin(fl_param_store *s, size_t n) {
    if (s->g16) FL_RUN(s->be, zero, s->gstage, n * sizeof(float));
}

fl_status fl_store_stage_flush(fl_param_store *s, size_t off, size_t n) {
    if (!s->g16) return FL_OK;
    /* g16[off : off+n] += gstage[0 : n], widened to fp32, rounded once (sharded: into the
     * gradient view of off's group) */
    void *dst = s->ops->grad_at(s, off);
    if (!dst)
        return fl_errorf(FL_ERR_INTERNAL, "sharded gradients: group %d has no gradient buffer", fl_store_group_of(s, off));
    return FL_RUN(s->be, accumulate16, dst, s->dtype, s->gstage, n);
}

void fl_store_stage_begin_ranges(fl_param_store *s, const size_t (*r)[2], int n) {
    for (int k = 0; k < n; k++)
        if (s->g16 && r[k][1] > r[k][0]) FL_RUN(s->be, zero, s->gstage + r[k][0], (r[k][1] - r[k][0]) * sizeof(float));
}

fl_status fl_store_stage_flush_ranges(fl_param_store *s, size_t goff, const size_t (*r)[2], int n) {
    if (!s->g16) return FL_OK;
    for (int k = 0; k < n; k++) {
        if (r[k][1] <= r[k][0]) continue;
        void *dst = s->ops->grad_at(s, goff + r[k][0]);
        if (!dst)
            return fl_errorf(FL_ERR_INTERNAL, "sharded gradients: group %d has no gradient buffer",
                             fl_store_group_of(s, goff));
        FL_TRY(FL_RUN(s->be, accumulate16, dst, s->dtype, s->gstage + r[k][0], r[k][1] - r[k][0]));
    }
    return FL_OK;
}

fl_status fl_store_grads_ready(fl_param_store *s, int g) {
    FL_TRY(s->ops->grads_ready(s, g));
    if (s->grad_ready) {
        const size_t *go = s->lay->group_offset;
        FL_TRY(s->grad_ready(s->grad_ready_ud, go[g], go[g + 1] - go[g]));
    }
    return FL_OK;
}

/* ---- 2. the dense store ---- */

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

/* ---- 3. a block's and the outer groups' parameter views ---- */

/* Layout (gradient) offset of entry i, or -1. */
static size_t loff(const fl_model *m, int i) { return i < 0 ? (size_t)-1 : m->layout.params[i].offset; }

/* The stored views come from the parameter store (store.h): whichever implementation holds the
 * entry (dense fp32 or 16-bit, 4-bit, an FSDP shard's gathered group) binds it. */
#define P1(m, i, cur) fl_store_bind_1d_w((m)->store, (i), (cur), wb) /* wb: the caller's widen list */
#define G(m, off) fl_store_grad((m)->store, (off))
#define paddr(m, so) fl_store_param_at((m)->store, (so))

void fl_linear_set_weight(const fl_model *m, fl_linear *lin, int wi) {
    fl_weight_view v;
    fl_store_bind_weight(m->store, wi, lin->out, &v);
    lin->w = v.w;
    lin->wc = v.wc;
    lin->wct = v.wct;
    lin->n_q4 = v.n_q4;
    for (int k = 0; k < v.n_q4; k++) lin->q4[k] = v.q4[k];
    lin->q416 = v.n_q4 > 0 && fl_model_q4x16(m) && !fl_q416_test_unbind;
}

void fl_linear_set_dw_scratch(const fl_model *m, fl_linear *lin) {
    /* a 4-bit base reading bf16 dy (q416) takes the dy scratch too, never xb16 (no weight gradient) */
    int on = m->acts && m->acts->dyb16 && ((lin->wc && lin->wct == FL_BF16) || lin->q416);
    lin->xb16 = on && lin->wc ? m->acts->xb16 : NULL;
    lin->dyb16 = on ? m->acts->dyb16 : NULL; /* without xb16 (fl_act_opts.dy_bf16): a frozen base's dy (fl_linear_dx16) */
}

void fl_linear_bind_dw16(fl_linear *lin, void *xb16, void *dyb16) {
    if (xb16 && lin->dw && lin->wc && lin->wct == FL_BF16 && !lin->n_q4) lin->xb16 = xb16, lin->dyb16 = dyb16;
}

/* A linear layer from its weight and bias entries (indices; bias -1: none). */
static void set_linear(const fl_model *m, fl_linear *lin, int in, int out, int wi, int bi, float **cur,
                       fl_store_widen *wb) {
    lin->in = in;
    lin->out = out;
    fl_linear_set_weight(m, lin, wi);
    fl_linear_set_dw_scratch(m, lin);
    if (bi >= 0 && m->store->dtype == FL_BF16 && m->be->gemm_epilogue && lin->n_q4 == 0) {
        /* a bf16 store's bias read as stored by the GEMM's epilogue (issue 30 item 1: no widening launch per block
         * and pass); its staging slot kept (the later entries' places unchanged) */
        lin->b16 = paddr(m, fl_store_off(m->store, bi)); /* NULL: a shard not gathered */
        *cur += out;
    } else
        lin->b = fl_store_bind_span_w(m->store, bi, (size_t)out, cur, wb); /* a fused bias: its `out` values */
    lin->dw = lin->n_q4 ? NULL : G(m, loff(m, wi));
    lin->db = G(m, loff(m, bi));
}

size_t fl_group_numel(const fl_model *m, int g) {
    return m->layout.group_offset[g + 1] - m->layout.group_offset[g];
}

/* A norm weight or LayerNorm bias (layout entry i) as the norm kernels read it: the stored 16-bit values when the
 * storage is 16-bit and the backend's kernels of the architecture's norm read them (fl_norm16_have; *wt = the
 * storage dtype: no widening launch per norm and pass); else its fp32 view (fl_store_bind_1d, *wt = F32). */
static const void *norm_weight(const fl_model *m, int i, float **cur, fl_dtype *wt, fl_store_widen *wb) {
    const fl_param_store *s = m->store;
    if (i >= 0 && s->dtype != FL_F32 && fl_norm16_have(m, 0) && fl_norm16_have(m, 1)) {
        *wt = s->dtype;
        return s->ops->param_at(s, fl_store_off(s, i)); /* NULL: a shard whose group is not gathered */
    }
    *wt = FL_F32;
    return P1(m, i, cur);
}

void fl_get_block(const fl_model *m, const fl_block_graph *gr, int l, fl_block_params *bp) {
    memset(bp, 0, sizeof *bp);
    float *cur0 = m->store->pstage ? m->store->pstage + fl_pstage_block_start(m) : NULL, **cur = &cur0;
    fl_store_widen w = {0}, *wb = &w; /* the block's 1-D parameters widened in one launch (16-bit storage) */
    const int g = l + 1;
#define R(role) ((role) < 0 ? -1 : fl_layout_role(&m->layout, g, (fl_param_role)(role)))
    /* the graph's parameters: the norms' (in op order), then the linears' (weight: a fused (QKV, C) or
     * (2F, C) matrix starts at its role's entry); 1-D ones take pstage slots in this order */
    for (int i = 0; i < gr->n_ops; i++) {
        const fl_gop *o = &gr->op[i];
        if (o->kind != FL_GOP_NORM) continue;
        bp->norm_w[o->p] = norm_weight(m, R(o->role_w), cur, &bp->norm_wt, wb); /* the same wt for every norm */
        bp->d_norm_w[o->p] = G(m, loff(m, R(o->role_w)));
        fl_dtype bt; /* the bias (LayerNorm's) as its weight: the same dtype */
        bp->norm_b[o->p] = norm_weight(m, R(o->role_b), cur, &bt, wb);
        bp->d_norm_b[o->p] = G(m, loff(m, R(o->role_b)));
    }
    for (int i = 0; i < gr->n_ops; i++) {
        const fl_gop *o = &gr->op[i];
        if (o->kind != FL_GOP_LINEAR) continue;
        /* tensor parallel: a row-parallel linear's bias is added once, by rank 0, before the sum (graph_tp.c) */
        const int bias_here = !(m->cfg.tp_size > 1 && m->cfg.tp_rank != 0 &&
                                (o->role_w == FL_ROLE_O_W || o->role_w == FL_ROLE_PROJ_W));
        set_linear(m, &bp->lin[o->p], gr->slot[o->in].width, gr->slot[o->out].width, R(o->role_w),
                   bias_here ? R(o->role_b) : -1, cur, wb);
        if (m->adapt) m->adapt->bind(m->adapt, l, o->p, &bp->lin[o->p], 0); /* the adapters the rewrite attached to it */
    }
    fl_store_widen_flush(m->store, wb);
#undef R
}

size_t fl_outer_1d(const fl_model *m) {
    const fl_param_layout *lay = &m->layout;
    size_t n = 0;
    for (int i = lay->n - 1; i >= 0 && lay->params[i].group == lay->n_groups - 1; i--) /* the last group's entries */
        if (lay->params[i].ndim == 1) n += lay->params[i].numel;
    return n;
}

size_t fl_pstage_block_start(const fl_model *m) {
    return fl_outer_1d(m) + (size_t)m->cfg.dim; /* outer 1-D, then one embedding row */
}

void fl_get_outer(const fl_model *m, fl_outer_params *o) {
    const fl_param_layout *lay = &m->layout;
    const int gh = lay->n_groups - 1; /* the final norm and head's group */
    float *cur0 = m->store->pstage, **cur = &cur0;
    int iwte = fl_layout_role(lay, 0, FL_ROLE_EMBED), iwpe = fl_layout_role(lay, 0, FL_ROLE_POS_EMBED);
    int ihd = m->cfg.tie_embeddings ? iwte : fl_layout_role(lay, gh, FL_ROLE_HEAD);
    int ilw = fl_layout_role(lay, gh, FL_ROLE_NORM_F_W), ilb = fl_layout_role(lay, gh, FL_ROLE_NORM_F_B);
    size_t wte = loff(m, iwte), wpe = loff(m, iwpe), hd = loff(m, ihd);
    /* the position table from the row position 0 reads (OPT's starts 2 rows in: fl_arch_info.pos_offset) */
    const size_t pos_skip = (size_t)fl_arch_get(m->cfg.arch)->pos_offset * m->cfg.dim;
    if (iwpe >= 0) wpe += pos_skip;
    /* embeddings: fp32 pointers only with fp32 storage (else fl_embed_* read the 16-bit rows) */
    o->wte_off = fl_model_store_off(m, iwte);
    o->wpe_off = iwpe >= 0 ? fl_model_store_off(m, iwpe) + pos_skip : (size_t)-1;
    const int f32 = m->store->dtype == FL_F32;
    o->wte = f32 ? paddr(m, o->wte_off) : NULL;
    o->dwte = G(m, wte);
    o->wpe = (f32 && iwpe >= 0) ? paddr(m, o->wpe_off) : NULL;
    o->dwpe = G(m, wpe);
    fl_store_widen w = {0}, *wb = &w; /* the final norm's weight and bias: one launch */
    o->lnf_w = norm_weight(m, ilw, cur, &o->lnf_wt, wb); o->dlnf_w = G(m, loff(m, ilw));
    fl_dtype bt;
    o->lnf_b = norm_weight(m, ilb, cur, &bt, wb); o->dlnf_b = G(m, loff(m, ilb));
    fl_store_widen_flush(m->store, wb);
    o->head = f32 && ihd >= 0 ? paddr(m, fl_model_store_off(m, ihd)) : NULL; /* an encoder has none */
    o->dhead = f32 ? G(m, hd) : m->store->g16 ? m->store->gstage : NULL; /* 16-bit: the head is staged alone */
    o->head_off = hd;
    o->head_idx = ihd;
}

/* ---- 4. the store's accessors (model.h) ---- */

/* (a model that failed to initialize, or was freed, has no store: NULL / defaults) */
void *fl_model_params_data(const fl_model *m) {
    const fl_param_store *s = m->store;
    return !s ? NULL : s->params ? (void *)s->params : (void *)s->p16;
}
void *fl_model_grads_data(const fl_model *m) {
    const fl_param_store *s = m->store;
    return !s ? NULL : s->grads ? (void *)s->grads : (void *)s->g16;
}
float *fl_model_params_f32(const fl_model *m) { return m->store ? m->store->params : NULL; }
float *fl_model_grads_f32(const fl_model *m) { return m->store ? m->store->grads : NULL; }
uint16_t *fl_model_params_16(const fl_model *m) { return m->store ? m->store->p16 : NULL; }
uint16_t *fl_model_grads_16(const fl_model *m) { return m->store ? m->store->g16 : NULL; }
fl_dtype fl_model_store_dtype(const fl_model *m) { return m->store ? m->store->dtype : FL_F32; }
size_t fl_model_store_numel(const fl_model *m) { return m->store ? m->store->numel : 0; }
int fl_model_quant4(const fl_model *m) { return m->store && m->store->q4 != NULL; }
const fl_param_provider *fl_model_provider(const fl_model *m) { return m->store ? m->store->pp : NULL; }
const fl_backend *fl_model_params_be(const fl_model *m) { return m->store ? fl_store_buf_be(m->store) : m->be; }
void fl_model_store_shard(fl_model *m, void *shard, fl_param_provider *pp) { fl_store_make_shard(m->store, shard, pp); }
void fl_model_store_offload(fl_model *m, void *shard, fl_param_provider *pp, const fl_backend *tier_be,
                            fl_mem_pool *tier_pool) {
    fl_store_make_offloaded(m->store, shard, pp, tier_be, tier_pool);
}
void fl_model_store_unshard(fl_model *m) {
    if (m->store) fl_store_make_whole(m->store);
}
float *fl_model_grad_stage(const fl_model *m) { return m->store ? m->store->gstage : NULL; }
void fl_model_set_grad_ready(fl_model *m, fl_status (*fn)(void *ud, size_t off, size_t n), void *ud) {
    m->store->grad_ready = fn;
    m->store->grad_ready_ud = ud;
}

int fl_model_param_is_q4(const fl_model *m, int i) { return fl_store_is_q4(m->store, i); }

size_t fl_model_store_off(const fl_model *m, int i) { return fl_store_off(m->store, i); }

void *fl_model_param_data(const fl_model *m, int i, fl_dtype *dt) {
    if (dt) *dt = m->store->dtype;
    if (fl_model_param_is_q4(m, i)) return NULL;
    if (!m->store->ops->whole) return NULL; /* sharded (FSDP): no whole entry here; src/train/fsdp.c stages a whole copy */
    return fl_store_param_at(m->store, fl_model_store_off(m, i));
}

void *fl_model_param_piece(const fl_model *m, int i, size_t *k0, size_t *k1, fl_dtype *dt) {
    const fl_param_info *p = &m->layout.params[i];
    const fl_param_provider *pp = m->store->pp;
    if (dt) *dt = m->store->dtype;
    if (!pp || !pp->flat_off) {
        *k0 = 0, *k1 = p->numel;
        return fl_model_param_data(m, i, dt);
    }
    const int g = p->group; /* the entry [p->offset, + numel) meets the piece [a, b) of its group */
    const size_t a = pp->flat_off[g], b = a + pp->len[g];
    const size_t lo = p->offset > a ? p->offset : a, hi = p->offset + p->numel < b ? p->offset + p->numel : b;
    if (lo >= hi) {
        *k0 = *k1 = 0;
        return NULL;
    }
    *k0 = lo - p->offset, *k1 = hi - p->offset;
    size_t at = pp->shard_off[g] + (lo - a);
    return m->store->params ? (void *)(m->store->params + at) : (void *)(m->store->p16 + at);
}

/* A 4-bit entry's buffer on a device whose memory is not host memory: a host copy (from the host
 * pool, one entry at a time) bound as *hw. NULL when out of host memory. */
static void *q4_host_copy(const fl_model *m, int i, fl_q4_weight *hw) {
    const fl_q4_weight *w = &m->store->q4[i];
    size_t bytes = fl_q4_weight_bytes(w);
    void *blob = NULL;
    if (fl_mem_alloc(fl_mem_host_pool(m->pool), FL_TAG_WORKSPACE, bytes, &blob) != FL_OK) return NULL;
    if ((w->row_start ? fl_q4_bind_mapped(hw, w->rows, w->cols, w->type, w->n_blocks, blob)
                      : fl_q4_bind(hw, w->rows, w->cols, w->type, w->double_quant, blob)) != FL_OK) {
        fl_mem_free(fl_mem_host_pool(m->pool), blob);
        return NULL;
    }
    return blob;
}

static int on_device(const fl_model *m) { return m->be && !fl_backend_host_memory(m->be); }

void fl_model_read_param(const fl_model *m, int i, float *dst) {
    if (fl_model_param_is_q4(m, i) && on_device(m)) { /* the 4-bit buffer to the host, dequantized there */
        fl_q4_weight hw;
        void *blob = q4_host_copy(m, i, &hw);
        if (!blob || FL_RUN(m->be, to_host, blob, m->store->q4[i].packed, fl_q4_weight_bytes(&hw)) != FL_OK) {
            memset(dst, 0, m->layout.params[i].numel * sizeof(float));
        } else {
            fl_q4_dequantize(&hw, dst, m->be->n_threads);
            if (m->adapt && m->adapt->merged && m->adapt->h.read_merged) m->adapt->h.read_merged(m, i, dst);
        }
        fl_mem_free(fl_mem_host_pool(m->pool), blob);
        return;
    }
    if (fl_model_param_is_q4(m, i)) {
        fl_q4_dequantize(&m->store->q4[i], dst, m->be ? m->be->n_threads : 0);
        /* after the adapters were merged (fl_model_lora_merge): the merged weight */
        if (m->adapt && m->adapt->merged && m->adapt->h.read_merged) m->adapt->h.read_merged(m, i, dst);
        return;
    }
    fl_dtype dt;
    const char *src = fl_model_param_data(m, i, &dt);
    const size_t n = m->layout.params[i].numel, es = fl_dtype_size(dt);
    if (!src) { /* sharded */
        memset(dst, 0, n * sizeof(float));
        return;
    }
    if (dt == FL_F32 || !m->be) { /* storage is device memory: it comes to the host through the backend */
        if (m->be) (void)FL_RUN(m->be, to_host, dst, src, n * sizeof(float));
        else fl_convert(dst, FL_F32, src, dt, n);
        return;
    }
    uint16_t slice[8192]; /* 16-bit storage: copied out in slices, widened on the host */
    for (size_t k0 = 0; k0 < n; k0 += 8192) {
        size_t k = n - k0 < 8192 ? n - k0 : 8192;
        (void)FL_RUN(m->be, to_host, slice, src + k0 * es, k * es);
        fl_convert(dst + k0, FL_F32, slice, dt, k);
    }
}

int fl_model_q4_mapped(const fl_model *m, int i) { return fl_model_param_is_q4(m, i) && m->store->q4[i].row_start; }

fl_status fl_model_q4_take_blocks(const fl_model *whole, int j, fl_model *part, int i) {
    const fl_q4_weight *pw = &part->store->q4[i];
    const size_t nb = pw->n_blocks, bytes = fl_q4_weight_bytes(pw);
    fl_q4_weight hw = whole->store->q4[j], tw;
    void *wblob = on_device(whole) ? q4_host_copy(whole, j, &hw) : NULL;
    char *blob = calloc(1, bytes + 4);
    size_t *src = malloc(nb * sizeof *src);
    fl_status s = blob && src && (wblob || !on_device(whole)) ? FL_OK : fl_errorf(FL_ERR_OOM, "out of host memory");
    if (s == FL_OK && wblob) s = FL_RUN(whole->be, to_host, wblob, whole->store->q4[j].packed, fl_q4_weight_bytes(&hw));
    if (s == FL_OK) s = fl_q4_bind_mapped(&tw, pw->rows, pw->cols, pw->type, nb, blob);
    if (s == FL_OK && fl_tp_q4_map(&part->cfg, &part->layout, i, src, tw.row_start) != nb)
        s = fl_errorf(FL_ERR_INVALID, "the 4-bit blocks of %s: the map changed", part->layout.params[i].name);
    if (s == FL_OK) s = fl_q4_take_blocks(&hw, src, &tw); /* codes and dequantized absmax */
    if (s == FL_OK) s = FL_RUN(part->be, to_device, pw->packed, blob, bytes);
    if (wblob) fl_mem_free(fl_mem_host_pool(whole->pool), wblob);
    free(blob), free(src);
    return fl_error_prefix(s, "tensor parallel: the whole 4-bit blocks of %s", part->layout.params[i].name);
}

void fl_model_write_param(fl_model *m, int i, const float *src) {
    if (fl_model_param_is_q4(m, i) && on_device(m)) { /* quantized on the host, copied in */
        fl_q4_weight hw;
        void *blob = q4_host_copy(m, i, &hw);
        if (blob && fl_q4_quantize(&hw, src, m->be->n_threads) == FL_OK)
            (void)FL_RUN(m->be, to_device, m->store->q4[i].packed, blob, fl_q4_weight_bytes(&hw));
        fl_mem_free(fl_mem_host_pool(m->pool), blob);
        return;
    }
    if (fl_model_param_is_q4(m, i)) {
        fl_q4_quantize(&m->store->q4[i], src, m->be ? m->be->n_threads : 0);
        return;
    }
    fl_dtype dt;
    char *dst = fl_model_param_data(m, i, &dt);
    const size_t n = m->layout.params[i].numel, es = fl_dtype_size(dt);
    if (!dst) return; /* sharded */
    if (dt == FL_F32 || !m->be) {
        if (m->be) (void)FL_RUN(m->be, to_device, dst, src, n * sizeof(float));
        else fl_convert(dst, dt, src, FL_F32, n);
        return;
    }
    uint16_t slice[8192]; /* 16-bit storage: rounded on the host in slices, copied in */
    for (size_t k0 = 0; k0 < n; k0 += 8192) {
        size_t k = n - k0 < 8192 ? n - k0 : 8192;
        fl_convert(slice, dt, src + k0, FL_F32, k);
        (void)FL_RUN(m->be, to_device, dst + k0 * es, slice, k * es);
    }
}

fl_status fl_model_write_param_any(fl_model *m, int i, const float *src) {
    if (!fl_model_provider(m)) {
        fl_model_write_param(m, i, src);
        return FL_OK;
    }
    size_t k0, k1;
    fl_dtype dt;
    char *dst = fl_model_param_piece(m, i, &k0, &k1, &dt);
    if (!dst || k1 <= k0) return FL_OK;
    const size_t n = k1 - k0, es = fl_dtype_size(dt);
    const fl_backend *be = fl_model_params_be(m);
    void *tmp = malloc(n * es + 4);
    if (!tmp) return fl_errorf(FL_ERR_OOM, "out of host memory staging a piece of %s", m->layout.params[i].name);
    fl_convert(tmp, dt, src + k0, FL_F32, n);
    fl_status s = be ? FL_RUN(be, to_device, dst, tmp, n * es) : (memcpy(dst, tmp, n * es), FL_OK);
    free(tmp);
    return s;
}

void fl_model_sync_compute_copy(fl_model *m) { fl_store_sync_compute(m->store); }

fl_status fl_model_alloc_grads(fl_model *m) { return fl_store_alloc_grads(m->store, &m->cfg); }

void fl_model_zero_grads(fl_model *m) {
    fl_store_zero_grads(m->store);
    if (m->adapt) FL_RUN(m->be, zero, m->adapt->h.grads, m->adapt->h.grads_numel * sizeof(float));
}

void *fl_model_grads_buffer(const fl_model *m) {
    return m->adapt ? (void *)m->adapt->h.grads : fl_model_grads_data(m);
}

float *fl_model_param(fl_model *m, const char *name) {
    int i = fl_layout_find(&m->layout, name);
    const fl_param_store *st = m->store;
    return (i < 0 || !st->params || st->pp || fl_model_param_is_q4(m, i)) ? NULL : st->params + fl_model_store_off(m, i);
}

float *fl_model_grad(fl_model *m, const char *name) {
    int i = fl_layout_find(&m->layout, name);
    const fl_param_store *st = m->store;
    return (i < 0 || !st->grads || st->pp) ? NULL : st->grads + m->layout.params[i].offset;
}

/* ---- 4. 16-bit weight gradients written by their GEMMs in place (issue 30 item 1) ---- */

fl_status fl_store_dw16_knob(int *on) {
    const char *ev = getenv("FITLLM_CUDA_DW16");
    *on = 1;
    if (!ev || !*ev || !strcmp(ev, "1")) return FL_OK;
    if (!strcmp(ev, "0")) {
        *on = 0;
        return FL_OK;
    }
    return fl_errorf(FL_ERR_INVALID, "FITLLM_CUDA_DW16=%s: expected 0 (every weight gradient staged in fp32, then added "
                     "into the bf16 gradient) or 1 (the default: a block's plain linears' dW GEMMs add into it in place)",
                     ev);
}

int fl_store_dw16_model(const fl_model *m) {
    const fl_param_store *s = m->store;
    const fl_backend *be = m->be;
    /* a dense bf16 gradient of the whole model on the device (FSDP / offload: the shards' reductions read the stage;
     * tensor / sequence parallel: kept staged, not checked) */
    return s && s->g16 && s->gstage && s->dtype == FL_BF16 && s->ops->whole && !s->tpool && !s->pp &&
           m->cfg.tp_size <= 1 && !m->sp && be && be->supports_op &&
           be->supports_op(be, FL_OP_GEMM_ACC16, FL_BF16, FL_BF16, FL_BF16);
}

fl_status fl_store_dw16_on(const fl_model *m, int *on) {
    *on = 0;
    return fl_store_dw16_model(m) ? fl_store_dw16_knob(on) : FL_OK;
}

int fl_store_block_stage_begin(const fl_model *m, const fl_block_graph *g, fl_block_params *bp, int grp, int dw16,
                               size_t rng[FL_STAGE_RANGES_MAX][2]) {
    rng[0][0] = 0, rng[0][1] = fl_group_numel(m, grp);
    const int nr = dw16 ? fl_store_direct16(m, g, bp, grp, rng) : 1;
    fl_store_stage_begin_ranges(m->store, (const size_t(*)[2])rng, nr);
    return nr;
}

int fl_store_direct16(const fl_model *m, const fl_block_graph *g, fl_block_params *bp, int grp,
                      size_t rng[FL_STAGE_RANGES_MAX][2]) {
    fl_param_store *s = m->store;
    const size_t goff = m->layout.group_offset[grp], gn = fl_group_numel(m, grp);
    size_t iv[FL_GRAPH_MAX_LINEARS][2];
    fl_linear *lv[FL_GRAPH_MAX_LINEARS];
    int n = 0;
    for (int i = 0; i < g->n_ops && n < FL_GRAPH_MAX_LINEARS; i++) {
        const fl_gop *o = &g->op[i];
        if (o->kind != FL_GOP_LINEAR) continue;
        fl_linear *lin = &bp->lin[o->p];
        lin->dw16 = NULL;
        /* a plain trained weight whose dW GEMM reads bf16 operands, its gradient staged in this group */
        if (!lin->dw || !fl_linear_wants_dy16(lin) || lin->b || lin->b16 || lin->db || lin->n_adapters || lin->n_q4 ||
            lin->dw < s->gstage || lin->dw >= s->gstage + gn)
            continue;
        const size_t a = (size_t)(lin->dw - s->gstage);
        iv[n][0] = a, iv[n][1] = a + (size_t)lin->out * lin->in;
        lv[n++] = lin;
    }
    /* a weight two dW GEMMs of one pass write (the same op twice, overlapping fused weights) stays staged: its fp32
     * sum rounded once */
    int keep[FL_GRAPH_MAX_LINEARS], nk = 0;
    for (int i = 0; i < n; i++) {
        int twice = iv[i][1] > gn;
        for (int j = 0; j < n; j++)
            if (j != i && iv[j][0] < iv[i][1] && iv[i][0] < iv[j][1]) twice = 1;
        if (!twice) keep[nk++] = i;
    }
    for (int i = 1; i < nk; i++) /* by offset */
        for (int j = i; j > 0 && iv[keep[j]][0] < iv[keep[j - 1]][0]; j--) {
            int t = keep[j];
            keep[j] = keep[j - 1], keep[j - 1] = t;
        }
    int nr = 0;
    size_t at = 0;
    for (int k = 0; k < nk; k++) {
        const int i = keep[k];
        lv[i]->dw16 = s->ops->grad_at(s, goff + iv[i][0]);
        if (iv[i][0] > at) rng[nr][0] = at, rng[nr++][1] = iv[i][0];
        at = iv[i][1];
    }
    if (at < gn) rng[nr][0] = at, rng[nr++][1] = gn;
    return nr;
}
