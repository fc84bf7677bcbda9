/* The norms around and inside the blocks (RMSNorm or LayerNorm, as the architecture says): the fp32 ops, the
 * backends' w16 kernels over a 16-bit weight or a bf16 copy of the input / output (issue 30), and the sequence-parallel
 * partial sums of a norm's parameter gradients (each rank sees its rows only). Split from exec.c, which calls them. */
#include "fitllm/comm.h"
#include "model-impl.h"

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
