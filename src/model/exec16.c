/* The fp32 results no op reads (issue 30 item 1, FL_CAP_VIEWS16): which ops of a block pass write their fp32 result's
 * bf16 copy alone (fl_block_only16), beside exec.c's fl_block_views32 (the views not carved). */
#include "exec-impl.h"
#include "graph.h"
#include "model-impl.h"

/* Issue 30 item 1, the fp32 results no op reads (FL_CAP_VIEWS16: the kernels take a NULL fp32 output): bit i, op i
 * writes its result's bf16 copy alone. Forward (bwd 0, bf16 stored): a ROPE whose rotated q|k|v only the next op, the
 * fused causal attention, reads (attention_forward_in16: the bf16 rows), and whose fp32 view the backward does not
 * read either (fl_block_bwd_reads32: attention_backward16 reads the bf16 copy; checkpointing's recompute is this same pass).
 * The view stays carved (the q|k|v GEMM's fp32 output is RoPE's input): traffic, not memory. Backward (bwd 1): an
 * activation or ROPE whose d(in) only the LINEAR that made in reads, from the bf16 copy the op writes (dy16_for), with
 * no bias gradient, adapter or 4-bit base (fl_linear_reads_dy32); an activation that starts d(in) (not acc: the update
 * of a zero d(in), not cleared). Made once per block pass from the graph and the bound facts; block_forward /
 * fl_block_backward hand a later fp32 reader NULL, and refuse it naming the slot. */
unsigned fl_only16_test_force; /* testing: ops (bit i) taken as bf16-only although a later op reads their fp32 */
unsigned fl_block_only16(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, const fl_block_ctx *x,
                         int bwd) {
    const fl_backend *be = m->be;
    if (!(be->caps & FL_CAP_VIEWS16)) return 0;
    unsigned r = 0, f = 0;
    if (!bwd && x->s16 && x->store16 && !x->kv && be->rope_forward16 && rope16_fused(m)) {
        const unsigned rd = fl_block_bwd_reads32(m, g, bp, x);
        for (int i = 0; i + 1 < g->n_ops; i++) {
            const fl_gop *o = &g->op[i], *nx = &g->op[i + 1];
            if (o->kind != FL_GOP_ROPE || !stored16(g, o->in, x) || !final_after(g, i, o->in)) continue;
            f |= fl_only16_test_force & 1u << i;
            if (nx->kind == FL_GOP_ATTN && nx->in == o->in && fused_causal(nx, x) && be->attention_forward_in16 &&
                unread_after(g, i + 1, o->in) && !(rd >> o->in & 1u))
                r |= 1u << i;
        }
    }
    for (int i = 1; bwd && i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (!dy16_for(be, g, bp, i) || g->slot[o->in].kind == FL_GSLOT_XSTREAM) continue;
        const int act = act16_kind(o->kind) >= 0;
        if (!act && !rope16_fused(m)) continue;
        f |= fl_only16_test_force & 1u << i;
        if (!fl_linear_reads_dy32(&bp->lin[g->op[i - 1].p]) && (!act || !o->acc)) r |= 1u << i;
    }
    return r | f;
}

