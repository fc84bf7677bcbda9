/* Parameter lookup shared by the training forward/backward (transformer.c)
 * and generation (generate.c): pointers of one block's parameters and
 * gradients, of the embeddings/final norm/head, and the norm dispatch.
 * Moved verbatim out of transformer.c. */
#include <stdio.h>
#include <string.h>

#include "model-impl.h"

/* Layout (gradient) offset of entry i, or -1. */
static size_t loff(const fl_model *m, int i) { return i < 0 ? (size_t)-1 : m->layout.params[i].offset; }

/* The layout group holding layout offset off. */
static int group_of(const fl_model *m, size_t off) {
    const size_t *go = m->layout.group_offset;
    int g = 0;
    while (g + 1 < m->layout.n_groups && off >= go[g + 1]) g++;
    return g;
}

/* Sharded parameters (m->pp): element `off` of group g's view buffer v (element size es), NULL
 * while the group is not gathered. A sharded model has no 4-bit entries: store offsets are layout
 * offsets. */
static void *view_at(const fl_model *m, void *v, size_t off, size_t es) {
    return v ? (char *)v + (off - m->layout.group_offset[group_of(m, off)]) * es : NULL;
}

/* The stored parameter at store offset so (fp32 or 16-bit storage): in the whole buffer, or in
 * its group's gathered view. */
static void *paddr(const fl_model *m, size_t so) {
    if (m->pp) return view_at(m, m->pp->views[group_of(m, so)].p, so, fl_dtype_size(m->store_dtype));
    return m->params ? (void *)(m->params + so) : (void *)(m->p16 + so);
}

/* Its compute-dtype copy (mixed policies), or NULL. */
static const void *wcaddr(const fl_model *m, size_t so) {
    size_t es = fl_dtype_size(m->prec.compute_dtype);
    if (m->pp) return view_at(m, m->pp->views[group_of(m, so)].wc, so, es);
    return m->wcompute ? (const void *)((const char *)m->wcompute + so * es) : NULL;
}

/* fp32 view of 1-D parameter entry i (-1: absent, NULL): in place (fp32 storage) or widened into
 * the next free slot of pstage (16-bit storage; *cur is the slot cursor). */
static const float *P1(const fl_model *m, int i, float **cur) {
    if (i < 0) return NULL;
    const fl_param_info *p = &m->layout.params[i];
    size_t so = fl_model_store_off(m, i);
    const void *src = paddr(m, so);
    if (m->store_dtype == FL_F32) return src;
    float *v = *cur;
    *cur += p->numel;
    if (!src) return NULL; /* sharded: its group is not gathered */
    m->be->convert(m->be, v, FL_F32, src, m->store_dtype, p->numel);
    return v;
}

/* Gradient of the entry at layout offset off: in place (fp32), or at the same
 * position relative to its group in gstage (16-bit: see fl_grad_stage_*). Sharded
 * fp32: in its group's gradient view (NULL while it has none). */
static float *G(const fl_model *m, size_t off) {
    if (off == (size_t)-1) return NULL;
    if (m->pp && m->store_dtype == FL_F32) return view_at(m, m->pp->views[group_of(m, off)].g, off, sizeof(float));
    if (m->grads) return m->grads + off;
    if (!m->g16) return NULL;
    return m->gstage + (off - m->layout.group_offset[group_of(m, off)]);
}

void fl_linear_set_weight(const fl_model *m, fl_linear *lin, int wi) {
    lin->w = NULL;
    lin->wc = NULL;
    lin->wct = m->prec.compute_dtype;
    lin->n_q4 = 0;
    if (wi < 0) return;
    if (fl_model_param_is_q4(m, wi)) {
        /* 4-bit base: a fused output (q|k|v, gate|up) is consecutive 4-bit entries, in row order */
        for (int r = 0, i = wi; r < lin->out && i < m->layout.n && lin->n_q4 < 3 && fl_model_param_is_q4(m, i); i++) {
            lin->q4[lin->n_q4++] = &m->q4[i];
            r += (int)m->layout.params[i].shape[0];
        }
        return;
    }
    size_t so = fl_model_store_off(m, wi);
    if (m->store_dtype != FL_F32) { /* 16-bit storage: the matmul reads the stored weights */
        lin->wc = paddr(m, so);
        lin->wct = m->store_dtype;
        return;
    }
    lin->w = paddr(m, so);
    lin->wc = wcaddr(m, so);
}

void fl_linear_set_dw_scratch(const fl_model *m, fl_linear *lin) {
    int on = m->acts && m->acts->xb16 && lin->wc && lin->wct == FL_BF16;
    lin->xb16 = on ? m->acts->xb16 : NULL;
    lin->dyb16 = on ? m->acts->dyb16 : NULL;
}

/* A linear layer from its weight and bias entries (indices; bias -1: none). */
static void set_linear(const fl_model *m, fl_linear *lin, int in, int out, int wi, int bi, float **cur) {
    lin->in = in;
    lin->out = out;
    fl_linear_set_weight(m, lin, wi);
    fl_linear_set_dw_scratch(m, lin);
    lin->b = P1(m, bi, cur);
    lin->dw = lin->n_q4 ? NULL : G(m, loff(m, wi));
    lin->db = G(m, loff(m, bi));
}

/* ---- 16-bit storage: gradient staging ------------------------------------------ */

size_t fl_group_numel(const fl_model *m, int g) {
    return m->layout.group_offset[g + 1] - m->layout.group_offset[g];
}

void fl_grad_stage_begin(fl_model *m, size_t n) {
    if (m->g16) m->be->zero(m->be, m->gstage, n * sizeof(float));
}

fl_status fl_grad_stage_flush(fl_model *m, size_t off, size_t n) {
    if (!m->g16) return FL_OK;
    /* g16[off : off+n] += gstage[0 : n], widened to fp32, rounded once (sharded: into the
     * gradient view of off's group) */
    void *dst = m->pp ? view_at(m, m->pp->views[group_of(m, off)].g, off, sizeof(uint16_t)) : (void *)(m->g16 + off);
    if (!dst) return fl_errorf(FL_ERR_INTERNAL, "sharded gradients: group %d has no gradient buffer", group_of(m, off));
    return m->be->accumulate16(m->be, dst, m->store_dtype, m->gstage, n);
}

void fl_get_block(const fl_model *m, const fl_block_graph *gr, int l, fl_block_params *bp) {
    memset(bp, 0, sizeof *bp);
    float *cur0 = m->pstage ? m->pstage + fl_pstage_block_start(m) : NULL, **cur = &cur0;
    const int g = l + 1;
#define R(role) ((role) < 0 ? -1 : fl_layout_role(&m->layout, g, (fl_param_role)(role)))
    /* the graph's parameters: the norms' (in op order), then the linears' (weight: a fused (QKV, C) or
     * (2F, C) matrix starts at its role's entry); 1-D ones take pstage slots in this order */
    for (int i = 0; i < gr->n_ops; i++) {
        const fl_gop *o = &gr->op[i];
        if (o->kind != FL_GOP_NORM) continue;
        bp->norm_w[o->p] = P1(m, R(o->role_w), cur); bp->d_norm_w[o->p] = G(m, loff(m, R(o->role_w)));
        bp->norm_b[o->p] = P1(m, R(o->role_b), cur); bp->d_norm_b[o->p] = G(m, loff(m, R(o->role_b)));
    }
    for (int i = 0; i < gr->n_ops; i++) {
        const fl_gop *o = &gr->op[i];
        if (o->kind != FL_GOP_LINEAR) continue;
        set_linear(m, &bp->lin[o->p], gr->slot[o->in].width, gr->slot[o->out].width, R(o->role_w), R(o->role_b), cur);
        fl_lora_attach(m, l, o->p, &bp->lin[o->p]); /* LoRA kind = the linear's index (0 qkv, 1 o, 2 fc, 3 proj) */
    }
#undef R
}

void fl_norm_forward(const fl_model *m, float *out, float *mean, float *rstd, const float *x, const float *w,
                     const float *b, int N) {
    const fl_backend *be = m->be;
    if (fl_arch_get(m->cfg.arch)->layernorm) be->layernorm_forward(be, out, mean, rstd, x, w, b, N, m->cfg.dim, m->cfg.norm_eps);
    else be->rmsnorm_forward(be, out, rstd, x, w, N, m->cfg.dim, m->cfg.norm_eps);
}

void fl_norm_backward(const fl_model *m, float *dx, float *dw, float *db, const float *dout, const float *x,
                      const float *w, const float *mean, const float *rstd, int N) {
    const fl_backend *be = m->be;
    if (fl_arch_get(m->cfg.arch)->layernorm) be->layernorm_backward(be, dx, dw, db, dout, x, w, mean, rstd, N, m->cfg.dim);
    else be->rmsnorm_backward(be, dx, dw, dout, x, w, rstd, N, m->cfg.dim);
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
    float *cur0 = m->pstage, **cur = &cur0;
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
    const int f32 = m->store_dtype == FL_F32;
    o->wte = f32 ? paddr(m, o->wte_off) : NULL;
    o->dwte = G(m, wte);
    o->wpe = (f32 && iwpe >= 0) ? paddr(m, o->wpe_off) : NULL;
    o->dwpe = G(m, wpe);
    o->lnf_w = P1(m, ilw, cur); o->dlnf_w = G(m, loff(m, ilw));
    o->lnf_b = P1(m, ilb, cur); o->dlnf_b = G(m, loff(m, ilb));
    o->head = f32 && ihd >= 0 ? paddr(m, fl_model_store_off(m, ihd)) : NULL; /* an encoder has none */
    o->dhead = f32 ? G(m, hd) : m->g16 ? m->gstage : NULL; /* 16-bit: the head is staged alone */
    o->head_off = hd;
    o->head_idx = ihd;
}

/* out (n, C) = wte[ids] (+ wpe[pos0 ..]) for one sequence of n rows at position pos0,
 * or (B, T) rows (pos0 = 0) */
void fl_embed_forward(const fl_model *m, const fl_outer_params *op, float *out, const int32_t *dids,
                      const int32_t *ids, int B, int T, int pos0) {
    const fl_backend *be = m->be;
    const int C = m->cfg.dim;
    if (m->store_dtype == FL_F32) {
        be->embedding_forward(be, out, dids, op->wte, op->wpe ? op->wpe + (size_t)pos0 * C : NULL, B, T, C);
        return;
    }
    float *row = m->pstage + fl_pstage_block_start(m) - C; /* one fp32 row */
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            be->convert(be, o, FL_F32, paddr(m, op->wte_off + (size_t)ids[b * T + t] * C), m->store_dtype, C);
            if (op->wpe_off != (size_t)-1) {
                be->convert(be, row, FL_F32, paddr(m, op->wpe_off + (size_t)(pos0 + t) * C), m->store_dtype, C);
                be->add(be, o, o, row, C);
            }
        }
}

/* Embedding backward into the gradients (fp32: in place; 16-bit: through gstage, group 0). */
fl_status fl_embed_backward(fl_model *m, const fl_outer_params *op, const float *dout, const int32_t *ids, int B,
                            int T) {
    const fl_backend *be = m->be;
    if (!m->g16) {
        be->embedding_backward(be, op->dwte, op->dwpe, dout, ids, B, T, m->cfg.dim);
        return FL_OK;
    }
    size_t n0 = fl_group_numel(m, 0);
    fl_grad_stage_begin(m, n0);
    be->embedding_backward(be, op->dwte, op->dwpe, dout, ids, B, T, m->cfg.dim);
    return fl_grad_stage_flush(m, m->layout.group_offset[0], n0);
}
