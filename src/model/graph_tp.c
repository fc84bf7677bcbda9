/* Tensor parallelism as a rewrite of the block graph (docs/ARCHITECTURE.md "Tensor parallelism").
 * A rank's block holds its slice of the heads and of the MLP (its config's n_heads, n_kv_heads and
 * ffn_dim are the rank's, src/model/tp.c): the linears that read the replicated stream (fused QKV,
 * fused gate|up or fc) are column-parallel, those that write back into it (O, down / proj) row-parallel.
 * Megatron's two conjugate collectives make the slice compute the whole block:
 *   - after a row-parallel LINEAR, ALLREDUCE FL_GAR_FWD sums the ranks' partial outputs (g: the
 *     backward is the identity, every rank holding the same d(out));
 *   - before a column-parallel LINEAR, ALLREDUCE FL_GAR_BWD on its input (f: the forward is the
 *     identity, the backward sums the ranks' parts of d(in) before the replicated norm reads it).
 * Norms stay replicated: their inputs and gradients are the same bits on every rank after these sums. */
#include "model-impl.h"

static int column_parallel(const fl_gop *o) {
    return o->kind == FL_GOP_LINEAR && (o->role_w == FL_ROLE_QKV_W || o->role_w == FL_ROLE_FC_W);
}
static int row_parallel(const fl_gop *o) {
    return o->kind == FL_GOP_LINEAR && (o->role_w == FL_ROLE_O_W || o->role_w == FL_ROLE_PROJ_W);
}

fl_status fl_block_graph_tp(fl_block_graph *g) {
    fl_gop ops[FL_GRAPH_MAX_OPS];
    int n = 0, reduced[FL_GRAPH_MAX_SLOTS] = {0};
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        const int before = column_parallel(o) && !reduced[o->in], after = row_parallel(o);
        if (n + 1 + before + after > FL_GRAPH_MAX_OPS)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: the tensor-parallel rewrite needs more than %d ops",
                             FL_GRAPH_MAX_OPS);
        if (before) { /* f: identity forward, d(in) summed over the ranks (once per slot: GPT-J's shared norm) */
            ops[n++] = (fl_gop){.kind = FL_GOP_ALLREDUCE, .in = o->in, .out = o->in, .a1 = -1, .a2 = -1,
                                .p = FL_GAR_BWD, .role_w = -1, .role_b = -1};
            reduced[o->in] = 1;
        }
        ops[n++] = *o;
        if (after) /* g: the partial outputs summed, identity backward */
            ops[n++] = (fl_gop){.kind = FL_GOP_ALLREDUCE, .in = o->out, .out = o->out, .a1 = -1, .a2 = -1,
                                .p = FL_GAR_FWD, .role_w = -1, .role_b = -1};
    }
    for (int i = 0; i < n; i++) g->op[i] = ops[i];
    g->n_ops = n;
    return FL_OK;
}
