/* The graph executor's ops around the blocks (exec.c has the blocks' own): the norms, RMSNorm or LayerNorm as the
 * architecture says (fp32 or 16-bit weights, the sequence-parallel gradient sums), and the embeddings forward and
 * backward. */
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "exec-impl.h"
#include "model-impl.h"
#include "store.h"

/* ---- the norms around and inside the blocks ------------------------------------------------------------------
 * RMSNorm or LayerNorm, as the architecture says: the fp32 ops, the backends' w16 kernels over a 16-bit weight or a
 * bf16 copy of the input / output (issue 30), and the sequence-parallel partial sums of a norm's parameter gradients
 * (each rank sees its rows only). */

/* The backend's w16 kernel of the architecture's norm (rmsnorm_*_w16 or layernorm_*_w16; bwd: the backward's): a
 * 16-bit weight (and bias), or (bf16-mixed) an fp32 one with a bf16 copy to write or read */
int fl_norm16_have(const fl_model *m, int bwd) {
    const fl_backend *be = m->be;
    if (fl_arch_get(m->cfg.arch)->layernorm)
        return bwd ? be->layernorm_backward_w16 != NULL : be->layernorm_forward_w16 != NULL;
    return bwd ? be->rmsnorm_backward_w16 != NULL : be->rmsnorm_forward_w16 != NULL;
}

int fl_norm_forward_t(const fl_model *m, float *out, void *out16, float *mean, float *rstd, const float *x,
                      const void *w, fl_dtype wt, const void *b, int N) {
    const fl_backend *be = m->be;
    const int ln = fl_arch_get(m->cfg.arch)->layernorm;
    /* norm_weight's 16-bit binding (w and b); or an fp32 weight with a bf16 copy to store (bf16-mixed): the same
     * kernel */
    if (wt != FL_F32 || (out16 && fl_norm16_have(m, 0))) {
        if (ln)
            FL_RUN(be, layernorm_forward_w16, out, out16, mean, rstd, x, w, b, wt, N, m->cfg.dim, m->cfg.norm_eps);
        else
            FL_RUN(be, rmsnorm_forward_w16, out, out16, rstd, x, w, wt, N, m->cfg.dim, m->cfg.norm_eps);
        return out16 != NULL;
    }
    if (ln)
        FL_RUN(be, layernorm_forward, out, mean, rstd, x, w, b, N, m->cfg.dim, m->cfg.norm_eps);
    else
        FL_RUN(be, rmsnorm_forward, out, rstd, x, w, N, m->cfg.dim, m->cfg.norm_eps);
    return 0;
}

/* x16 (NULL or): the input read from its bf16 copy (the w16 kernel, x may then be NULL) */
void fl_norm_backward_x16(const fl_model *m, float *dx, void *dx16, float *dw, float *db, const float *dout,
                          const float *x, const void *x16, const void *w, fl_dtype wt, const float *mean,
                          const float *rstd, int N) {
    const fl_backend *be = m->be;
    const int ln = fl_arch_get(m->cfg.arch)->layernorm;
    if (wt != FL_F32 || ((dx16 || x16) && fl_norm16_have(m, 1))) {
        if (ln)
            FL_RUN(be, layernorm_backward_w16, dx, dx16, dw, db, dout, x, x16, w, wt, mean, rstd, N, m->cfg.dim);
        else
            FL_RUN(be, rmsnorm_backward_w16, dx, dx16, dw, dout, x, x16, w, wt, rstd, N, m->cfg.dim);
    } else if (ln)
        FL_RUN(be, layernorm_backward, dx, dw, db, dout, x, w, mean, rstd, N, m->cfg.dim);
    else
        FL_RUN(be, rmsnorm_backward, dx, dw, dout, x, w, rstd, N, m->cfg.dim);
}

void fl_norm_backward_t(const fl_model *m, float *dx, void *dx16, float *dw, float *db, const float *dout,
                        const float *x, const void *w, fl_dtype wt, const float *mean, const float *rstd, int N) {
    fl_norm_backward_x16(m, dx, dx16, dw, db, dout, x, NULL, w, wt, mean, rstd, N);
}

void fl_norm_forward(const fl_model *m, float *out, float *mean, float *rstd, const float *x, const float *w,
                     const float *b, int N) {
    fl_norm_forward_t(m, out, NULL, mean, rstd, x, w, FL_F32, b, N);
}

void fl_norm_backward(const fl_model *m, float *dx, float *dw, float *db, const float *dout, const float *x,
                      const float *w, const float *mean, const float *rstd, int N) {
    fl_norm_backward_t(m, dx, NULL, dw, db, dout, x, w, FL_F32, mean, rstd, N);
}

void fl_sp_norm_begin(const fl_model *m, float *dw, float *db, float **sw, float **sb) {
    float *z = m->acts->sp_dnorm;
    const int C = m->cfg.dim;
    FL_RUN(m->be, zero, z, 2 * (size_t)C * sizeof(float));
    *sw = dw ? z : NULL;
    *sb = db ? z + C : NULL;
}

fl_status fl_sp_norm_end(const fl_model *m, struct fl_comm *c, float *dw, float *db) {
    float *z = m->acts->sp_dnorm;
    const size_t C = (size_t)m->cfg.dim;
    if (!dw && !db) return FL_OK;
    FL_TRY(fl_error_prefix(fl_comm_all_reduce(c, z, z, 2 * C, FL_F32, FL_COMM_SUM), "sequence parallel: a norm's "
                           "parameter gradients"));
    if (dw) FL_RUN(m->be, add, dw, dw, z, C);
    if (db) FL_RUN(m->be, add, db, db, z + C, C);
    return FL_OK;
}

/* ---- the ops around the blocks --------------------------------------------------------------- */

/* out (n, C) = wte[ids] (+ wpe[pos0 ..]) for one sequence of n rows at position pos0,
 * or (B, T) rows (pos0 = 0) */
fl_status fl_embed_forward(const fl_model *m, const fl_outer_params *op, float *out, const int32_t *dids,
                           const int32_t *ids, int B, int T, int pos0) {
    return fl_embed_forward16(m, op, out, NULL, NULL, dids, ids, B, T, pos0);
}

fl_status fl_embed_forward16(const fl_model *m, const fl_outer_params *op, float *out, void *out16, int *done16,
                             const int32_t *dids, const int32_t *ids, int B, int T, int pos0) {
    const fl_backend *be = m->be;
    if (done16) *done16 = 0;
    const int C = m->cfg.dim;
    if (m->tp_ops) return m->tp_ops->embed_forward(m, op, out, ids, B, T, pos0); /* a vocabulary slice */
    if (m->store->dtype == FL_F32) {
        FL_RUN(be, embedding_forward, out, dids, op->wte, op->wpe ? op->wpe + (size_t)pos0 * C : NULL, B, T, C);
        return FL_OK;
    }
    if (be->embedding_forward16 && (m->store->dtype == FL_BF16 || m->store->dtype == FL_F16)) { /* one launch, not one convert per token (+ one per position row) */
        const void *wpe = op->wpe_off != (size_t)-1 ? fl_store_param_at(m->store, op->wpe_off + (size_t)pos0 * C) : NULL;
        FL_RUN(be, embedding_forward16, out, out16, dids, fl_store_param_at(m->store, op->wte_off), wpe,
               m->store->dtype, B, T, C);
        if (done16) *done16 = out16 != NULL;
        return FL_OK;
    }
    float *row = m->store->pstage + fl_pstage_block_start(m) - C; /* one fp32 row */
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            FL_RUN(be, convert, o, FL_F32, fl_store_param_at(m->store, op->wte_off + (size_t)ids[b * T + t] * C),
                   m->store->dtype, C);
            if (op->wpe_off != (size_t)-1) {
                FL_RUN(be, convert, row, FL_F32, fl_store_param_at(m->store, op->wpe_off + (size_t)(pos0 + t) * C),
                       m->store->dtype, C);
                FL_RUN(be, add, o, o, row, C);
            }
        }
    return FL_OK;
}

/* Embedding backward into the gradients (fp32: in place; 16-bit: through gstage, group 0). */
fl_status fl_embed_backward(fl_model *m, const fl_outer_params *op, const float *dout, const int32_t *ids, int B,
                            int T) {
    const fl_backend *be = m->be;
    const fl_model_tp_ops *tpv = m->tp_ops; /* a vocabulary slice */
    if (!m->store->g16) {
        if (tpv) return tpv->embed_backward(m, op, dout, ids, B, T);
        FL_RUN(be, embedding_backward, op->dwte, op->dwpe, dout, ids, B, T, m->cfg.dim);
        return FL_OK;
    }
    size_t n0 = fl_group_numel(m, 0);
    fl_store_stage_begin(m->store, n0);
    if (tpv) FL_TRY(tpv->embed_backward(m, op, dout, ids, B, T));
    else
        FL_RUN(be, embedding_backward, op->dwte, op->dwpe, dout, ids, B, T, m->cfg.dim);
    return fl_store_stage_flush(m->store, m->layout.group_offset[0], n0);
}
