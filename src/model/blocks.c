/* Parameter lookup shared by the training forward/backward (transformer.c)
 * and generation (generate.c): pointers of one block's parameters and
 * gradients, of the embeddings/final norm/head (the ops that read them run in exec.c). */
#include <stdio.h>
#include <string.h>

#include "model-impl.h"
#include "store.h"

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
}

void fl_linear_set_dw_scratch(const fl_model *m, fl_linear *lin) {
    int on = m->acts && m->acts->xb16 && lin->wc && lin->wct == FL_BF16;
    lin->xb16 = on ? m->acts->xb16 : NULL;
    lin->dyb16 = on ? m->acts->dyb16 : NULL;
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
        lin->b16 = m->store->ops->param_at(m->store, fl_store_off(m->store, bi)); /* NULL: a shard not gathered */
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
