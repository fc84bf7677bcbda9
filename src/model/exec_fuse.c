/* The cross-block residual add + norm (issue 30 item 4, bf16 stored): a block's last residual add (res[l+1] =
 * res_mid + the MLP's output) left pending by fl_block_forward (fl_block_ctx.hand_on) and done here with the norm that
 * reads its sum next: the next block's ln_1 (fl_block_forward's take, after that block's parameters were gathered),
 * or the final norm (transformer.c). One add_norm_forward16 launch instead of add16 + the norm, the same bits
 * (add_norm_forward16 is add16 then the w16 norm, bit for bit). */
#include <stdlib.h>
#include <string.h>

#include "model-impl.h"

fl_status fl_add_pending_norm(const fl_model *m, fl_add_pending *p, float *out, void *out16, float *mean,
                              float *rstd, const void *w, const void *b, fl_dtype wt) {
    const fl_backend *be = m->be;
    if (!p || !p->on) return FL_OK;
    p->on = 0;
    const int ln = fl_arch_get(m->cfg.arch)->layernorm;
    if (p->b16) /* stream16: the residual operand's stored bf16 rows (exec16.c) */
        return FL_RUN(be, add_norm_forward16_b16, ln, p->res, p->res16, out16 ? out : NULL, out16, mean, rstd, p->a,
                      p->b16, w, b, wt, p->N, p->C, m->cfg.norm_eps);
    if (out16)
        return FL_RUN(be, add_norm_forward16, ln, p->res, p->res16, out, out16, mean, rstd, p->a, p->b, w, b, wt, p->N,
                      p->C, m->cfg.norm_eps);
    return FL_RUN(be, add16, p->res, p->res16, p->a, p->b, (size_t)p->N * p->C); /* the block's own add */
}

/* An on / off knob in the environment: unset, empty or 1 on, 0 off (*on); another value an error naming it and what
 * 0 and 1 mean (`expect`) */
static fl_status knob01(const char *name, int *on, const char *expect) {
    const char *ev = getenv(name);
    *on = 1;
    if (!ev || !*ev || !strcmp(ev, "1")) return FL_OK;
    if (!strcmp(ev, "0")) {
        *on = 0;
        return FL_OK;
    }
    return fl_errorf(FL_ERR_INVALID, "%s=%s: expected %s", name, ev, expect);
}

fl_status fl_xblock_fuse_on(int *on) {
    return knob01("FITLLM_CUDA_XBLOCK_NORM", on, "0 (a block's last residual add and the next norm in two launches) or "
                  "1 (the default: one fused launch under a bf16 store)");
}

fl_status fl_lora16_on(int *on) {
    return knob01("FITLLM_CUDA_LORA16", on, "0 (a frozen base's dx GEMM rounds its fp32 dy, the adapters read their "
                  "input in fp32) or 1 (the default: the bf16 dy and input as stored)");
}

/* fl_block_forward's start: x->take (on) done before op 0, fused with it where op 0 is a NORM of the block's input
 * row (that row's pending sum) whose output is stored in bf16 by a w16 norm (n16: its bf16 copy, exec.c norm_out16;
 * NULL: the add alone, then op 0 as usual). *i0 = 1: op 0 done. */
fl_status fl_xblock_take(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                         const fl_block_ctx *x, void *n16, int *i0) {
    const fl_gop *o = &g->op[0];
    fl_add_pending *p = (fl_add_pending *)x->take;
    const int fuse = n16 && m->be->add_norm_forward16 && o->kind == FL_GOP_NORM && o->in == FL_GSLOT_IN &&
                     x->store16 && g->sp <= 1 && p->res == s[FL_GSLOT_IN] && p->res16 == x->s16[FL_GSLOT_IN] &&
                     p->N == x->B * x->T && p->C == m->cfg.dim && g->slot[FL_GSLOT_IN].width == m->cfg.dim;
    *i0 = fuse;
    if (!fuse) return fl_add_pending_norm(m, p, NULL, NULL, NULL, NULL, NULL, NULL, FL_F32);
    return fl_add_pending_norm(m, p, s[o->out], n16, o->a1 >= 0 ? s[o->a1] : NULL, o->a2 >= 0 ? s[o->a2] : NULL,
                               bp->norm_w[o->p], bp->norm_b[o->p], bp->norm_wt);
}
