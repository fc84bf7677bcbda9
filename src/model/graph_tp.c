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
 * model's mask at those columns (exec.c), the attention's weights likewise at the rank's heads.
 *
 * Sequence parallelism (fl_block_graph_sp, Megatron-LM's): the stream between the linears is the rank's
 * rows [r B T / n, (r + 1) B T / n) instead of a replicated copy, so the norms and residual adds run on 1/n of the
 * rows and what they save (the block's input, the mid residual, the norms' statistics) is 1/n; before the first
 * column-parallel LINEAR reading a slot a GATHER makes the whole rows into a TEMP slot (not saved: what is saved is
 * the norm's output, the rank's rows; the backward gathers them again before the linears' weight gradients read
 * them, as Megatron-LM does), and a row-parallel LINEAR writes its partial output into a full-row TEMP slot that a
 * SCATTER sums over the group into the rank's rows of the stream (backward: the transposes). T5: the decoder's
 * cross k|v reads the encoder output whole (the caller gathers it once per pass); a DROPOUT of the rank's rows (a
 * sublayer's output into the stream) draws the whole pass's mask at those rows (exec.c). */
#include <string.h>

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

fl_status fl_block_graph_sp(fl_block_graph *g, int n) {
    fl_gop ops[FL_GRAPH_MAX_OPS];
    int8_t gathered[FL_GRAPH_MAX_SLOTS];
    int cnt = 0, split[FL_GRAPH_MAX_SLOTS] = {0};
    memset(gathered, -1, sizeof gathered);
    for (int i = 0; i < g->n_ops; i++) {
        fl_gop c = g->op[i];
        const int col = column_parallel(&c), row = row_parallel(&c);
        /* the rank's columns of a slot (as fl_block_graph_tp): a DROPOUT there draws the whole's mask at them */
        if (c.kind != FL_GOP_ADD && c.kind != FL_GOP_NORM)
            split[c.out] = col || (c.kind != FL_GOP_LINEAR && split[c.in]);
        c.tp_cols = c.kind == FL_GOP_DROPOUT && split[c.in];
        if (cnt + 1 + col + row > FL_GRAPH_MAX_OPS || g->n_slots + col + row > FL_GRAPH_MAX_SLOTS)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: the sequence-parallel rewrite needs more than %d ops or "
                             "%d slots", FL_GRAPH_MAX_OPS, FL_GRAPH_MAX_SLOTS);
        /* a stream from outside the block (T5's encoder output for the cross-attention's k|v) is whole already */
        const int outside = g->slot[c.in].kind == FL_GSLOT_XSTREAM;
        if (col && !outside && gathered[c.in] < 0) { /* the whole rows, once per slot (a parallel block's shared norm) */
            const int s = fl_graph_slot(g, "gathered", g->slot[c.in].width, FL_GSLOT_TEMP, 0);
            ops[cnt++] = (fl_gop){.kind = FL_GOP_GATHER, .in = c.in, .out = (int8_t)s, .a1 = -1, .a2 = -1, .p = -1,
                                  .role_w = -1, .role_b = -1};
            gathered[c.in] = (int8_t)s;
        }
        if (col && !outside) c.in = gathered[c.in];
        if (row) { /* the partial output (full rows), summed into the rank's rows of the stream */
            const int s = fl_graph_slot(g, "partial", g->slot[c.out].width, FL_GSLOT_TEMP, 0);
            ops[cnt++] = (fl_gop){.kind = FL_GOP_SCATTER, .in = (int8_t)s, .out = c.out, .a1 = -1, .a2 = -1, .p = -1,
                                  .role_w = -1, .role_b = -1};
            c.out = (int8_t)s;
            ops[cnt] = ops[cnt - 1]; /* the linear first, then its scatter */
            ops[cnt - 1] = c;
            cnt++;
            continue;
        }
        ops[cnt++] = c;
    }
    for (int i = 0; i < cnt; i++) g->op[i] = ops[i];
    g->n_ops = cnt;
    g->sp = n;
    return FL_OK;
}
