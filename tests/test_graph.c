/* The block graph (src/model/graph.c): what is derived from each architecture's table is checked
 * here by independent simulations of the op sequence (which gradient each backward buffer holds,
 * which slot each inference buffer holds), and malformed tables are refused by name. That the
 * executors compute the right thing is the golden/PyTorch, finite-difference and generation
 * tests' job (test_model.c, test_generate.c): every forward, backward and decode runs the graph. */
#include <string.h>

#include "fitllm/model.h"
#include "model/model-impl.h"
#include "test.h"

static int imax(int a, int b) { return a > b ? a : b; }

/* The backward walks the ops in reverse. Off the residual path each gradient lives from the op that
 * reads the slot (which writes its gradient) back to the op that makes it (which reads it last), so a
 * buffer may only be written while it holds no gradient still to be read. */
static void check_backward_buffers(const fl_block_graph *g, const char *what) {
    int holds[FL_N_GBUF] = {-1, -1, -1}; /* the off-path slot whose gradient each buffer holds */
    int made_at[FL_GRAPH_MAX_SLOTS];
    for (int s = 0; s < g->n_slots; s++) made_at[s] = -1;
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (o->kind != FL_GOP_ROPE && o->kind != FL_GOP_ADD) made_at[o->out] = i;
    }
    for (int i = g->n_ops - 1; i >= 0; i--) {
        const fl_gop *o = &g->op[i];
        const fl_gslot *si = &g->slot[o->in], *so = &g->slot[o->out];
        if (o->kind == FL_GOP_ADD) {
            FL_CHECKF(si->resid && so->resid && si->grad == FL_GBUF_RES && so->grad == FL_GBUF_RES,
                      "%s: residual add op %d off the residual gradient", what, i);
            continue;
        }
        FL_CHECKF(so->grad >= 0 && si->grad >= 0, "%s: op %d has no gradient buffer", what, i);
        if (so->grad < 0 || si->grad < 0) return;
        if (!so->resid) FL_CHECKF(holds[so->grad] == o->out, "%s: op %d reads d(%s) from a buffer holding %d", what, i,
                                  so->name, holds[so->grad]);
        if (o->kind == FL_GOP_ROPE) continue; /* rotates d(qkv) in place */
        if (si->resid) {
            FL_CHECKF(si->grad == FL_GBUF_RES, "%s: d(%s) on the residual path not in dres", what, si->name);
        } else {
            FL_CHECKF(si->grad != so->grad, "%s: op %d writes d(%s) over its own d(%s)", what, i, si->name, so->name);
            FL_CHECKF(holds[si->grad] < 0 || holds[si->grad] == o->out, "%s: op %d overwrites live d(%s) with d(%s)",
                      what, i, holds[si->grad] >= 0 ? g->slot[holds[si->grad]].name : "-", si->name);
            holds[si->grad] = o->in;
        }
        if (!so->resid && made_at[o->out] == i) holds[so->grad] = holds[so->grad] == o->out ? -1 : holds[so->grad];
        FL_CHECKF(g->gbuf_width[si->grad] >= si->width, "%s: buffer %d (%d) narrower than d(%s) (%d)", what, si->grad,
                  g->gbuf_width[si->grad], si->name, si->width);
    }
}

/* Inference: at every op, the slots it reads or writes and those live across it sit in distinct
 * buffers (IN and OUT excepted: the block runs in place), each wide enough. */
static void check_inference_buffers(const fl_block_graph *g, const char *what) {
    int def[FL_GRAPH_MAX_SLOTS], last[FL_GRAPH_MAX_SLOTS];
    for (int s = 0; s < g->n_slots; s++) def[s] = last[s] = -1;
    def[FL_GSLOT_IN] = -1;
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        int ip = o->kind == FL_GOP_ROPE || o->kind == FL_GOP_ADD;
        last[o->in] = i;
        if (ip) last[o->out] = i;
        else def[o->out] = last[o->out] = i;
        if (o->a1 >= 0) def[o->a1] = last[o->a1] = i;
        if (o->a2 >= 0) def[o->a2] = last[o->a2] = i;
    }
    last[FL_GSLOT_OUT] = g->n_ops;
    FL_CHECKF(last[FL_GSLOT_IN] < def[FL_GSLOT_OUT], "%s: input read after the output is made", what);
    for (int i = 0; i < g->n_ops; i++)
        for (int a = 0; a < g->n_slots; a++)
            for (int b = a + 1; b < g->n_slots; b++) {
                int live_a = def[a] <= i && i <= last[a], live_b = def[b] <= i && i <= last[b];
                if (a == FL_GSLOT_IN && b == FL_GSLOT_OUT) continue;
                if (live_a && live_b)
                    FL_CHECKF(g->ibuf_of[a] != g->ibuf_of[b], "%s: '%s' and '%s' share buffer %d at op %d", what,
                              g->slot[a].name, g->slot[b].name, g->ibuf_of[a], i);
            }
    for (int s = 0; s < g->n_slots; s++)
        FL_CHECKF(g->ibuf_width[g->ibuf_of[s]] >= g->slot[s].width, "%s: buffer of '%s' too narrow", what, g->slot[s].name);
}

static void decoder_case(const char *preset, int dim, int heads, int kv_heads, int head_dim, int ffn) {
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find(preset, &c));
    if (dim) { c.dim = dim; c.n_heads = heads; c.n_kv_heads = kv_heads; c.head_dim = head_dim; c.ffn_dim = ffn; }
    FL_REQUIRE_OK(fl_config_validate(&c));
    fl_block_graph g;
    FL_REQUIRE_OK(fl_block_graph_build(&c, &g));
    char what[96];
    snprintf(what, sizeof what, "%s C=%d NH=%d NKV=%d HD=%d F=%d", preset, c.dim, c.n_heads, c.n_kv_heads, c.head_dim,
             c.ffn_dim);
    check_backward_buffers(&g, what);
    check_inference_buffers(&g, what);
    /* anchors: the widths the hand-written passes used before the graph (transformer.c's buf1/buf2,
     * the bf16 dW scratch) and generation's scratch then (one buffer per activation, ln shared) */
    const int C = c.dim, QD = c.n_heads * c.head_dim, KVD = c.n_kv_heads * c.head_dim, QKV = QD + 2 * KVD;
    const int F = c.ffn_dim, FCW = c.arch == FL_ARCH_LLAMA ? 2 * F : F;
    FL_CHECKF(g.gbuf_width[FL_GBUF_RES] == C, "%s: dres width %d", what, g.gbuf_width[FL_GBUF_RES]);
    FL_CHECKF(imax(C, g.gbuf_width[FL_GBUF_1]) == imax(imax(C, QD), F), "%s: buf1 width %d", what, g.gbuf_width[1]);
    FL_CHECKF(g.gbuf_width[FL_GBUF_2] == imax(QKV, FCW), "%s: buf2 width %d", what, g.gbuf_width[2]);
    FL_CHECKF(g.lin_in_max == imax(imax(C, QD), F) && g.lin_out_max == imax(imax(C, QKV), FCW), "%s: linear widths",
              what);
    int rows = 0, before = 3 * C + QD + QKV + FCW + F + c.n_heads + 2;
    for (int b = 0; b < g.n_ibuf; b++) rows += g.ibuf_width[b];
    FL_CHECKF(rows <= before, "%s: inference scratch %d floats per row, %d before the graph", what, rows, before);
    printf("      %s: %d ops, %d slots, inference %d buffers = %d floats/row (was %d)\n", what, g.n_ops, g.n_slots,
           g.n_ibuf, rows, before);
}

FL_TEST(graph_decoder_buffers) {
    decoder_case("micro", 0, 0, 0, 0, 0);
    decoder_case("gpt2-micro", 0, 0, 0, 0, 0);
    decoder_case("micro", 48, 6, 2, 16, 40);    /* QD > C, F < C, GQA */
    decoder_case("micro", 64, 4, 2, 8, 100);    /* QD < C */
    decoder_case("gpt2-micro", 40, 4, 4, 10, 33); /* F < C, odd widths */
}

/* Finish a hand-made table. */
static fl_status finish(fl_block_graph *g) {
    g->n_norms = 1;
    g->n_linears = 2;
    return fl_block_graph_finish(g);
}

static void set_slot(fl_block_graph *g, int s, const char *name, fl_gslot_kind kind, int resid) {
    g->slot[s].name = name;
    g->slot[s].width = 8;
    g->slot[s].kind = (uint8_t)kind;
    g->slot[s].resid = (uint8_t)resid;
    g->slot[s].grad = resid ? FL_GBUF_RES : FL_GBUF_NONE;
    if (s >= g->n_slots) g->n_slots = s + 1;
}

static void set_op(fl_block_graph *g, fl_gop_kind k, int in, int out) {
    fl_gop *o = &g->op[g->n_ops++];
    memset(o, 0, sizeof *o);
    o->kind = (uint8_t)k;
    o->in = (int8_t)in;
    o->out = (int8_t)out;
    o->a1 = o->a2 = -1;
    o->p = (int8_t)(g->n_ops - 1);
    o->role_w = o->role_b = -1;
}

/* An empty table with the slots x (in), out and a (off-path). */
static void table(fl_block_graph *g) {
    memset(g, 0, sizeof *g);
    set_slot(g, 0, "x", FL_GSLOT_STREAM, 1);
    set_slot(g, 1, "out", FL_GSLOT_STREAM, 1);
    set_slot(g, 2, "a", FL_GSLOT_WIDE, 0);
}

static void expect_refused(fl_block_graph *g, const char *needle, const char *what) {
    fl_status s = finish(g);
    FL_CHECKF(s == FL_ERR_INTERNAL && strstr(fl_error_message(), needle), "%s: status %d, message '%s'", what, (int)s,
              fl_error_message());
}

FL_TEST(graph_rejects_malformed_tables) {
    fl_block_graph g;
    /* in -> a -> out, then out += in: the input outlives the output's making (prefill runs blocks in place) */
    table(&g);
    set_op(&g, FL_GOP_LINEAR, 0, 2);
    set_op(&g, FL_GOP_LINEAR, 2, 1);
    set_op(&g, FL_GOP_ADD, 0, 1);
    fl_status s = finish(&g);
    FL_CHECKF(s == FL_ERR_INTERNAL && strstr(fl_error_message(), "input is read after"), "in-place: %s",
              fl_error_message());
    table(&g); /* an off-path activation read twice: its gradients would need summing */
    set_slot(&g, 3, "b", FL_GSLOT_WIDE, 0);
    set_op(&g, FL_GOP_LINEAR, 0, 2);
    set_op(&g, FL_GOP_LINEAR, 2, 3);
    set_op(&g, FL_GOP_LINEAR, 2, 1);
    expect_refused(&g, "'a' is read by 2 ops", "two readers");
    table(&g); /* read before made */
    set_op(&g, FL_GOP_LINEAR, 2, 1);
    set_op(&g, FL_GOP_LINEAR, 0, 2);
    expect_refused(&g, "reads 'a' before it is made", "order");
    table(&g); /* a residual add from an off-path slot */
    set_op(&g, FL_GOP_LINEAR, 0, 2);
    set_op(&g, FL_GOP_LINEAR, 0, 1);
    set_op(&g, FL_GOP_ADD, 2, 1);
    expect_refused(&g, "adds 'a' off the residual path", "add");
    table(&g); /* a slot no op makes */
    set_op(&g, FL_GOP_LINEAR, 0, 1);
    expect_refused(&g, "no op makes slot 'a'", "unmade");
    table(&g); /* made twice */
    set_op(&g, FL_GOP_LINEAR, 0, 2);
    set_op(&g, FL_GOP_LINEAR, 0, 2);
    set_op(&g, FL_GOP_LINEAR, 2, 1);
    expect_refused(&g, "'a' is made twice", "twice");
}
