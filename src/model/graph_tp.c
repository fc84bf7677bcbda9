/* Tensor parallelism as a rewrite of the block graph (docs/ARCHITECTURE.md "Tensor parallelism").
 * A rank's block holds its slice of the heads and of the MLP (its config's n_heads, n_kv_heads and
 * ffn_dim are the rank's, src/model/tp.c): the linears that read the replicated stream (fused QKV,
 * fused gate|up or fc) are column-parallel, those that write back into it (O, down / proj) row-parallel.
 * Megatron's two conjugate collectives make the slice compute the whole block:
 *   - after a row-parallel LINEAR, ALLREDUCE FL_GAR_FWD sums the ranks' partial outputs (g: the
 *     backward is the identity, every rank holding the same d(out));
 *   - before a column-parallel LINEAR, ALLREDUCE FL_GAR_BWD on its input (f: the forward is the
 *     identity, the backward sums the ranks' parts of d(in) before the replicated norm reads it).
 * Norms stay replicated: their inputs and gradients are the same bits on every rank after these sums.
 * T5 (its encoder and decoder blocks): the cross-attention's q and k|v column-parallel, its o row-parallel; the
 * k|v linear reads the encoder output (an XSTREAM slot), whose d(in) sum the caller runs once for all the decoder's
 * blocks; a DROPOUT on the rank's columns (the FFN's activation) is marked (fl_gop.tp_cols) to draw the whole
 * model's mask at those columns (exec.c), the attention's weights likewise at the rank's heads. */
#include "model-impl.h"

static int column_parallel(const fl_gop *o) {
    return o->kind == FL_GOP_LINEAR && (o->role_w == FL_ROLE_QKV_W || o->role_w == FL_ROLE_FC_W ||
                                        o->role_w == FL_ROLE_XQ_W || o->role_w == FL_ROLE_XKV_W);
}
static int row_parallel(const fl_gop *o) {
    return o->kind == FL_GOP_LINEAR &&
           (o->role_w == FL_ROLE_O_W || o->role_w == FL_ROLE_PROJ_W || o->role_w == FL_ROLE_XO_W);
}

fl_status fl_block_graph_tp(fl_block_graph *g) {
    fl_gop ops[FL_GRAPH_MAX_OPS];
    int n = 0, reduced[FL_GRAPH_MAX_SLOTS] = {0}, split[FL_GRAPH_MAX_SLOTS] = {0};
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        /* a stream from outside the block (T5's encoder output, read by the cross-attention's k|v): its f is the
         * caller's, one sum of d(stream) over the group after every block has added its part (seq2seq.c) */
        const int before = column_parallel(o) && !reduced[o->in] && g->slot[o->in].kind != FL_GSLOT_XSTREAM;
        const int after = row_parallel(o);
        /* the rank's columns of a slot: a column-parallel output and what is computed from it alone */
        if (o->kind != FL_GOP_ALLREDUCE && o->kind != FL_GOP_ADD && o->kind != FL_GOP_NORM)
            split[o->out] = column_parallel(o) || (o->kind != FL_GOP_LINEAR && split[o->in]);
        if (n + 1 + before + after > FL_GRAPH_MAX_OPS)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: the tensor-parallel rewrite needs more than %d ops",
                             FL_GRAPH_MAX_OPS);
        if (before) { /* f: identity forward, d(in) summed over the ranks (once per slot: GPT-J's shared norm) */
            ops[n++] = (fl_gop){.kind = FL_GOP_ALLREDUCE, .in = o->in, .out = o->in, .a1 = -1, .a2 = -1,
                                .p = FL_GAR_BWD, .role_w = -1, .role_b = -1};
            reduced[o->in] = 1;
        }
        ops[n] = *o;
        ops[n++].tp_cols = o->kind == FL_GOP_DROPOUT && split[o->in]; /* its mask: the whole's at those columns */
        if (after) /* g: the partial outputs summed, identity backward */
            ops[n++] = (fl_gop){.kind = FL_GOP_ALLREDUCE, .in = o->out, .out = o->out, .a1 = -1, .a2 = -1,
                                .p = FL_GAR_FWD, .role_w = -1, .role_b = -1};
    }
    for (int i = 0; i < n; i++) g->op[i] = ops[i];
    g->n_ops = n;
    return FL_OK;
}
