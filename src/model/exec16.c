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
 * no bias gradient, adapter or 4-bit base reading dy in fp32 (fl_linear_reads_dy32); an activation that starts d(in) (not acc: the update
 * of a zero d(in), not cleared). Made once per block pass from the graph and the bound facts; block_forward /
 * fl_block_backward hand a later fp32 reader NULL, and refuse it naming the slot. */
static unsigned only16_bwd(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, int have_act,
                           int have_rope, unsigned *forced);
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
    if (bwd) r = only16_bwd(m, g, bp, be->act_backward16 != NULL, be->rope_backward16 != NULL, &f);
    return r | f;
}

/* The backward's half of fl_block_only16, with the backend's act_backward16 / rope_backward16 there or not (have_act,
 * have_rope: dy16_for's test, which it repeats); *forced gets fl_only16_test_force's bits where they apply. */
static unsigned only16_bwd(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, int have_act,
                           int have_rope, unsigned *forced) {
    unsigned r = 0;
    for (int i = 1; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i], *pv = &g->op[i - 1];
        const int act = act16_kind(o->kind) >= 0;
        if (pv->kind != FL_GOP_LINEAR || pv->out != o->in || !fl_linear_dx16(&bp->lin[pv->p]) ||
            !bp->lin[pv->p].dyb16 || !(act ? have_act : o->kind == FL_GOP_ROPE && have_rope) ||
            g->slot[o->in].kind == FL_GSLOT_XSTREAM)
            continue; /* dy16_for: NULL */
        if (!act && !rope16_fused(m)) continue;
        *forced |= fl_only16_test_force & 1u << i;
        if (!fl_linear_reads_dy32(&bp->lin[pv->p]) && (!act || !o->acc)) r |= 1u << i;
    }
    return r;
}

/* The slots whose gradient a pass of this op set holds in bf16 only: an activation's input (its d(in) not written in
 * fp32: act_backward16 with din NULL); RoPE's d(q|k|v) is written in fp32 by the attention's backward before it. */
static unsigned grads16_of(const fl_block_graph *g, unsigned only16) {
    unsigned r = 0;
    for (int i = 0; i < g->n_ops; i++)
        if ((only16 >> i & 1u) && act16_kind(g->op[i].kind) >= 0) r |= 1u << g->op[i].in;
    return r;
}

/* The slots whose fp32 gradient no backward pass of the model writes (bit k: slot k; 0: every one): those every block's
 * backward holds in bf16 only (fl_block_only16's, from the facts fl_get_block would bind: fl_block_bind_facts), so
 * acts.c sizes the gradient buffers without them (a TinyLlama block: d(gate|up), 11,264 floats a row, leaves buffer 2
 * at d(q|k|v)'s 2,560). FL_CAP_VIEWS16 says the backend has act_backward16 and rope_backward16 taking a NULL fp32
 * gradient, so the planner's null backend standing in for it decides the same. fl_block_backward refuses a pass
 * that would write one (fl_block_ctx.gdrop). dy16: the arena has the dy scratch alone (LoRA's frozen bases: their dy in
 * bf16 too, fl_act_opts.dy_bf16 1). */
unsigned fl_block_grads_dropped(const fl_model *m, const fl_block_graph *g, int dy16) {
    if (!(m->be->caps & FL_CAP_VIEWS16) || !m->prec.name || m->prec.act_dtype != FL_BF16 || m->cfg.n_layers < 1)
        return 0;
    static const char one;
    unsigned r = ~0u, forced = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        fl_block_params bp;
        fl_block_bind_facts(m, g, l, dy16, (void *)&one, &bp);
        r &= grads16_of(g, only16_bwd(m, g, &bp, 1, 1, &forced));
    }
    return r;
}

/* fl_block_backward's check of a pass against the buffers' sizing: NULL, or the first slot in gdrop whose fp32
 * gradient this pass (only16: its fl_block_only16) would write. */
const char *fl_block_grads16_lacking(const fl_block_graph *g, unsigned gdrop, unsigned only16) {
    const unsigned lack = gdrop & ~grads16_of(g, only16);
    for (int k = 0; lack && k < g->n_slots; k++)
        if (lack >> k & 1u) return g->slot[k].name;
    return NULL;
}


/* ---- the residual stream held in bf16 (issue 30 item 1, FL_CAP_STREAM16) ------------------------------------------
 * Under a bf16 store the residual slots' fp32 views hold the exact widening of their stored rows (add16 / the fused
 * add + norm / round16 write both), so a residual add that reads its residual operand from the bf16 copy
 * (add_norm_forward16_b16) gives the same bits, and each view is read in fp32 only by the ops right after its writer:
 * the views of the input, the mid residual and the output may then share one buffer, which holds the slot last
 * written (the projection's fp32 output, then the sum written in place over it). */
static unsigned stream_slots(const fl_block_graph *g, int C) {
    unsigned r = 1u << FL_GSLOT_IN | 1u << FL_GSLOT_OUT;
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (o->kind == FL_GOP_ADD && g->slot[o->out].kind == FL_GSLOT_WIDE && g->slot[o->out].width == C)
            r |= 1u << o->out;
    }
    return r;
}

/* Whether slot k's fp32 view (in the shared buffer) is overwritten before any read after op i: a later op writes another
 * shared slot first (the residual add's sum that only its fused norm reads: its fp32 rows need not be written) */
int fl_block_stream16_dead(const fl_block_graph *g, unsigned shared, int i, int k) {
    for (int j = i + 1; j < g->n_ops; j++) {
        const fl_gop *o = &g->op[j];
        const int reads = o->in == k || (o->kind == FL_GOP_ATTN && o->attn == FL_ATTN_CROSS && o->in2 == k) ||
                          ((o->kind == FL_GOP_ADD || fl_gop_modifies(o)) && o->out == k);
        if (reads) return 0;
        if (shared >> o->out & 1u) return 1;
    }
    return 0; /* still there at the block's end (its output: the next block, the final norm read it) */
}

const char *fl_block_stream16_lacks(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                                    const fl_block_ctx *x, unsigned shared) {
    if (!x->s16 || !x->store16) return g->slot[FL_GSLOT_IN].name;
    const unsigned rd = fl_block_bwd_reads32_p(m, g, bp, x) & shared; /* the backward reads none of them */
    for (int k = 0; rd && k < g->n_slots; k++)
        if (rd >> k & 1u) return g->slot[k].name;
    int own = FL_GSLOT_IN; /* the slot the buffer holds: a block starts on its input (or the pending sum's operand) */
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (o->kind == FL_GOP_ADD && (shared >> o->in & 1u)) { /* out += in: out's fp32 (just written), in's bf16 */
            if (!stored16(g, o->in, x) || !final_after(g, i, o->in)) return g->slot[o->in].name;
            if (own != o->out) return g->slot[o->out].name;
            continue;
        }
        const int8_t rds[3] = {o->in, o->kind == FL_GOP_ATTN && o->attn == FL_ATTN_CROSS ? o->in2 : -1,
                               o->kind == FL_GOP_ADD || fl_gop_modifies(o) ? o->out : -1};
        for (int k = 0; k < 3; k++)
            if (rds[k] >= 0 && (shared >> rds[k] & 1u) && own != rds[k]) return g->slot[rds[k]].name;
        if (shared >> o->out & 1u) own = o->out;
    }
    return own == FL_GSLOT_OUT ? NULL : g->slot[FL_GSLOT_OUT].name; /* the next block / the final norm read it */
}

static unsigned stream16_refused(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                                 const fl_block_ctx *x, void *shared) {
    return fl_block_stream16_lacks(m, g, bp, x, *(const unsigned *)shared) != NULL;
}
unsigned fl_block_stream16(const fl_model *m, const fl_block_graph *g) {
    const fl_backend *be = m->be;
    const unsigned caps = FL_CAP_VIEWS16 | FL_CAP_STREAM16;
    if ((be->caps & caps) != caps || !m->prec.name || m->prec.act_dtype != FL_BF16 || m->sp || g->sp > 1 ||
        m->cfg.tp_size > 1 || m->cfg.n_layers < 1 || (!be->add_norm_forward16_b16 && !fl_backend_discards(be)))
        return 0;
    unsigned shared = stream_slots(g, m->cfg.dim);
    return fl_block_facts_walk(m, g, stream16_refused, &shared) ? 0 : shared;
}

/* ---- the residual add inside its projection's GEMM (issue 30 items 1 and 3, gemm_res16) -------------------------- */
unsigned fl_block_resgemm(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                          const fl_block_ctx *x) {
    const fl_backend *be = m->be;
    if (!be->gemm_res16 || !be->add_norm_forward16_b16 || !x->stream16 || !x->store16 || !x->s16 || x->kv ||
        fl_arch_get(m->cfg.arch)->layernorm)
        return 0;
    unsigned r = 0;
    for (int i = 1; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i], *pv = &g->op[i - 1];
        if (o->kind != FL_GOP_ADD || pv->kind != FL_GOP_LINEAR || pv->out != o->out || !(x->stream16 >> o->in & 1u))
            continue;
        const fl_linear *lin = &bp->lin[pv->p];
        if (!fl_linear_plain16(lin) || lin->out != m->cfg.dim || g->slot[o->out].width != m->cfg.dim ||
            (x->xs_ready && g->slot[pv->in].kind == FL_GSLOT_XSTREAM))
            continue;
        /* the GEMM's operands: its input's and the residual's stored bf16 rows; its output: the sum's */
        if (!final_after(g, i - 1, pv->in) || !stored16(g, pv->in, x) || !x->s16[pv->in] ||
            !final_after(g, i, o->in) || !stored16(g, o->in, x) || !x->s16[o->in] || !final_after(g, i, o->out) ||
            !stored16(g, o->out, x) || !x->s16[o->out] || g->sp > 1) /* (stream16: no sequence parallel) */
            continue;
        r |= 1u << i;
    }
    return r;
}
