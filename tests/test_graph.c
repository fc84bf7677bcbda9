/* The block graph (src/model/graph.c): what is derived from each architecture's table is checked
 * here by independent simulations of the op sequence (which gradient each backward buffer holds,
 * which slot each inference buffer holds), and malformed tables are refused by name. That the
 * executors compute the right thing is the golden/PyTorch, finite-difference and generation
 * tests' job (test_model.c, test_generate.c): every forward, backward and decode runs the graph. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/backend.h"
#include "fitllm/model.h"
#include "model/model-impl.h"
#include "test.h"

static int imax(int a, int b) { return a > b ? a : b; }

/* The backward walks the ops in reverse. Off the residual path each gradient lives from the op that
 * reads the slot (which writes its gradient) back to the op that makes it (which reads it last), so a
 * buffer may only be written while it holds no gradient still to be read. */
static void check_backward_buffers(const fl_block_graph *g, const char *what) {
    int holds[FL_GRAPH_MAX_GBUF]; /* the off-path slot whose gradient each buffer holds */
    int started[FL_GRAPH_MAX_SLOTS] = {0}, made_at[FL_GRAPH_MAX_SLOTS];
    for (int b = 0; b < FL_GRAPH_MAX_GBUF; b++) holds[b] = -1;
    for (int s = 0; s < g->n_slots; s++) made_at[s] = -1;
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (o->kind != FL_GOP_ROPE && o->kind != FL_GOP_ADD) made_at[o->out] = i;
    }
    FL_CHECKF(g->n_gbuf >= FL_N_GBUF && g->n_gbuf <= FL_GRAPH_MAX_GBUF, "%s: %d gradient buffers", what, g->n_gbuf);
    for (int i = g->n_ops - 1; i >= 0; i--) {
        const fl_gop *o = &g->op[i];
        const fl_gslot *si = &g->slot[o->in], *so = &g->slot[o->out];
        if (o->kind == FL_GOP_ADD) {
            FL_CHECKF(si->resid && so->resid && si->grad == FL_GBUF_RES && so->grad == FL_GBUF_RES,
                      "%s: residual add op %d off the residual gradient", what, i);
            continue;
        }
        FL_CHECKF(so->grad >= 0 && si->grad >= 0 && so->grad < g->n_gbuf && si->grad < g->n_gbuf,
                  "%s: op %d has no gradient buffer", what, i);
        if (so->grad < 0 || si->grad < 0) return;
        if (!so->resid) FL_CHECKF(holds[so->grad] == o->out, "%s: op %d reads d(%s) from a buffer holding %d", what, i,
                                  so->name, holds[so->grad]);
        if (o->kind == FL_GOP_ROPE) continue; /* rotates d(qkv) in place */
        if (si->resid) {
            FL_CHECKF(si->grad == FL_GBUF_RES && o->acc, "%s: d(%s) on the residual path not summed in dres", what,
                      si->name);
        } else if (started[o->in]) { /* a second reader: adds to the gradient the first one started */
            FL_CHECKF(o->acc && holds[si->grad] == o->in, "%s: op %d does not add to d(%s)", what, i, si->name);
        } else {
            FL_CHECKF(!o->acc, "%s: op %d adds to d(%s) before anything started it", what, i, si->name);
            FL_CHECKF(si->grad != so->grad, "%s: op %d writes d(%s) over its own d(%s)", what, i, si->name, so->name);
            FL_CHECKF(holds[si->grad] < 0, "%s: op %d overwrites live d(%s) with d(%s)", what, i,
                      holds[si->grad] >= 0 ? g->slot[holds[si->grad]].name : "-", si->name);
            holds[si->grad] = o->in;
            started[o->in] = 1;
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
    table(&g); /* an off-path activation nobody reads: its producer's backward would have no gradient */
    set_slot(&g, 3, "b", FL_GSLOT_WIDE, 0);
    set_op(&g, FL_GOP_LINEAR, 0, 2);
    set_op(&g, FL_GOP_LINEAR, 0, 3);
    set_op(&g, FL_GOP_LINEAR, 2, 1);
    expect_refused(&g, "'b' is made but no op reads it", "unread");
    table(&g); /* the input read after it was added into the output: dres would then hold d(out) and d(x) at once */
    set_slot(&g, 3, "m", FL_GSLOT_WIDE, 1);
    set_op(&g, FL_GOP_LINEAR, 0, 3);
    set_op(&g, FL_GOP_ADD, 0, 3);
    set_op(&g, FL_GOP_LINEAR, 0, 2);
    set_op(&g, FL_GOP_LINEAR, 2, 1);
    set_op(&g, FL_GOP_ADD, 3, 1);
    expect_refused(&g, "op 2 reads 'x' after it was added into 'm'", "read after the add");
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

/* ---- a slot read by two ops: the parallel block ------------------------------------------------
 * GPT-J / Falcon's parallel residual block, one norm read by both branches:
 *   out = x + attn(ln1(x)) + mlp(ln1(x)),
 * built from LLaMA's ops over micro's block-0 parameters (ln_1 for the norm, the attention's and the
 * MLP's linears). kind 0: ln1 read by both branches' first linears (its gradient summed by the
 * graph); kind 1, the anchor: the same function with the norm computed twice from the same weight,
 * ln1 for the attention and ln2 for the MLP, so every off-path slot has one reader and the sum happens
 * where it always did (x's gradient on the residual path, the weight's gradient accumulating). */
static void par_graph(const fl_model_config *c, int kind, fl_block_graph *g) {
    fl_dims d = fl_model_dims(c);
    memset(g, 0, sizeof *g);
    set_slot(g, 0, "x", FL_GSLOT_STREAM, 1);
    set_slot(g, 1, "out", FL_GSLOT_STREAM, 1);
    g->slot[0].width = g->slot[1].width = d.C;
    int n = 2;
#define SL(name, w, k, r) (set_slot(g, n, name, k, r), g->slot[n].width = (w), n++)
    const int ln1 = SL("ln1", d.C, FL_GSLOT_WIDE, 0), rstd = SL("ln1_rstd", 1, FL_GSLOT_STAT, 0);
    const int qkv = SL("qkv", d.QKV, FL_GSLOT_WIDE, 0), att = SL("att", d.QD, FL_GSLOT_WIDE, 0);
    const int lse = SL("lse", d.NH, FL_GSLOT_STAT, 0), mid = SL("res_mid", d.C, FL_GSLOT_WIDE, 1);
    const int ln2 = kind ? SL("ln2", d.C, FL_GSLOT_WIDE, 0) : ln1, rstd2 = kind ? SL("ln2_rstd", 1, FL_GSLOT_STAT, 0) : -1;
    const int fc = SL("fc", d.FCW, FL_GSLOT_WIDE, 0), act = SL("act", d.F, FL_GSLOT_WIDE, 0);
#undef SL
#define OP(k, i, o, x1, x2, pi, rw)                                                                    \
    do {                                                                                              \
        set_op(g, k, i, o);                                                                           \
        fl_gop *op_ = &g->op[g->n_ops - 1];                                                           \
        op_->a1 = (int8_t)(x1), op_->a2 = (int8_t)(x2), op_->p = (int8_t)(pi), op_->role_w = (int8_t)(rw); \
    } while (0)
    g->n_ops = 0;
    OP(FL_GOP_NORM, 0, ln1, -1, rstd, 0, FL_ROLE_LN1_W);
    if (kind) OP(FL_GOP_NORM, 0, ln2, -1, rstd2, 1, FL_ROLE_LN1_W); /* the same weight again (x is read before
                                                                    * it is added into res_mid) */
    OP(FL_GOP_LINEAR, ln1, qkv, -1, -1, 0, FL_ROLE_QKV_W);
    OP(FL_GOP_ROPE, qkv, qkv, -1, -1, -1, -1);
    OP(FL_GOP_ATTN, qkv, att, lse, -1, -1, -1);
    OP(FL_GOP_LINEAR, att, mid, -1, -1, 1, FL_ROLE_O_W);
    OP(FL_GOP_ADD, 0, mid, -1, -1, -1, -1);
    OP(FL_GOP_LINEAR, ln2, fc, -1, -1, 2, FL_ROLE_FC_W);
    OP(FL_GOP_SWIGLU, fc, act, -1, -1, -1, -1);
    OP(FL_GOP_LINEAR, act, 1, -1, -1, 3, FL_ROLE_PROJ_W);
    OP(FL_GOP_ADD, mid, 1, -1, -1, -1, -1);
#undef OP
    g->n_norms = kind ? 2 : 1;
    g->n_linears = 4;
}

typedef struct {
    float *out, *dx, *grads; /* (N, C), (N, C), block 0's parameter gradients */
} par_result;

/* One forward and backward of graph g over block 0 of m: d(out) = r. */
static void par_run(fl_model *m, const fl_block_graph *g, const float *x, const float *r, int B, int T,
                    const float *rc, const float *rs, par_result *res) {
    fl_dims d = fl_model_dims(&m->cfg);
    const size_t N = (size_t)B * T, g0 = m->layout.group_offset[1], gn = m->layout.group_offset[2] - g0;
    float *s[FL_GRAPH_MAX_SLOTS] = {0}, *gb[FL_GRAPH_MAX_GBUF] = {0};
    for (int k = 0; k < g->n_slots; k++) s[k] = calloc(N * (size_t)g->slot[k].width + 16, sizeof(float));
    memcpy(s[FL_GSLOT_IN], x, N * d.C * sizeof(float));
    for (int k = 0; k < g->n_gbuf; k++) gb[k] = calloc(N * (size_t)(k ? g->gbuf_width[k] : d.C) + 16, sizeof(float));
    memcpy(gb[FL_GBUF_RES], r, N * d.C * sizeof(float));
    fl_model_zero_grads(m);
    fl_block_params bp;
    fl_get_block(m, g, 0, &bp);
    fl_block_ctx cx = {.B = B, .T = T, .rope_cos = rc, .rope_sin = rs};
    FL_CHECK(fl_block_forward(m, g, &bp, s, &cx) == FL_OK);
    res->out = malloc(N * d.C * sizeof(float));
    memcpy(res->out, s[FL_GSLOT_OUT], N * d.C * sizeof(float));
    FL_CHECK(fl_block_backward(m, g, &bp, s, gb, &cx) == FL_OK);
    res->dx = malloc(N * d.C * sizeof(float));
    memcpy(res->dx, gb[FL_GBUF_RES], N * d.C * sizeof(float));
    res->grads = malloc(gn * sizeof(float));
    memcpy(res->grads, (const float *)fl_model_grads_data(m) + g0, gn * sizeof(float));
    for (int k = 0; k < g->n_slots; k++) free(s[k]);
    for (int k = 0; k < g->n_gbuf; k++) free(gb[k]);
}

/* max |p - q| against (N + C) fp32 roundings of the largest |p| + |q|: the two differ only in how sums
 * are associated (J^T (a + b) against J^T a + J^T b in the norm's backward, over C columns; the weight's
 * gradient over N rows in one sum or two), exact arithmetic gives equality (a backward is linear in its
 * output's gradient), and fp32 reassociation of n terms moves a sum by at most n roundings of their
 * scale. exact: bit for bit (the same operations in the same order). */
static void par_compare(const float *p, const float *q, size_t n, int terms, int exact, const char *what) {
    double worst = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs((double)p[i] - q[i]) > worst) worst = fabs((double)p[i] - q[i]);
        if (fabs(p[i]) + fabs(q[i]) > scale) scale = fabs(p[i]) + fabs(q[i]);
    }
    const double bound = exact ? 0.0 : terms * FLT_EPSILON * scale;
    FL_CHECKF(scale > 0 && worst <= bound, "%s: max |shared - twice| %.3g, bound %.3g (scale %.3g)", what, worst,
              bound, scale);
    if (getenv("FL_TEST_VERBOSE")) printf("      %s: %.3g (bound %.3g)\n", what, worst, bound);
}

FL_TEST(graph_parallel_block_sums_the_shared_gradient) {
    fl_model_config c;
    FL_REQUIRE_OK(fl_preset_find("micro", &c));
    fl_block_graph par, two;
    par_graph(&c, 0, &par);
    par_graph(&c, 1, &two);
    FL_REQUIRE_OK(fl_block_graph_finish(&par));
    FL_REQUIRE_OK(fl_block_graph_finish(&two));
    check_backward_buffers(&par, "parallel block");
    check_inference_buffers(&par, "parallel block");
    check_backward_buffers(&two, "parallel block, norm twice");
    /* d(ln1) (d(ln2)) stays in its buffer across the attention branch's backward, which then needs a third */
    FL_CHECKF(par.n_gbuf == 4 && two.n_gbuf == 4, "gradient buffers: shared %d, twice %d", par.n_gbuf, two.n_gbuf);
    int readers = 0, adds = 0;
    for (int i = 0; i < par.n_ops; i++)
        if (par.op[i].in == 2 && par.op[i].kind == FL_GOP_LINEAR) readers++, adds += par.op[i].acc;
    FL_CHECKF(readers == 2 && adds == 1, "ln1: %d linear readers, %d of them adding", readers, adds);
    /* the executors: host memory (the cpu backend), micro's block 0 */
    fl_backend be;
    FL_REQUIRE_OK(fl_backend_init_by_name("cpu", &be, 2));
    fl_mem_pool pool;
    FL_REQUIRE_OK(fl_mem_pool_init(&pool, "cpu", 0));
    fl_model m;
    FL_REQUIRE_OK(fl_model_init(&m, &c, &be, &pool));
    fl_model_init_random(&m, 11);
    FL_REQUIRE_OK(fl_model_alloc_grads(&m));
    fl_dims d = fl_model_dims(&c);
    const int B = 2, T = 7, N = B * T;
    float *x = malloc((size_t)N * d.C * sizeof(float)), *r = malloc((size_t)N * d.C * sizeof(float));
    float *rc = malloc((size_t)T * d.HD / 2 * sizeof(float)), *rs = malloc((size_t)T * d.HD / 2 * sizeof(float));
    fl_test_rng g = {5};
    for (int i = 0; i < N * d.C; i++) {
        x[i] = fl_test_rng_uniform(&g, -2.0f, 2.0f);
        r[i] = fl_test_rng_uniform(&g, -1.0f, 1.0f);
    }
    FL_REQUIRE_OK(be.rope_tables(&be, rc, rs, T, d.HD, c.rope_theta, &c.rope_scaling));
    par_result P, Q;
    par_run(&m, &par, x, r, B, T, rc, rs, &P);
    par_run(&m, &two, x, r, B, T, rc, rs, &Q);
    const size_t g0 = m.layout.group_offset[1], gn = m.layout.group_offset[2] - g0;
    const int iw = fl_layout_role(&m.layout, 1, FL_ROLE_LN1_W);
    FL_REQUIRE(iw >= 0);
    const size_t wo = m.layout.params[iw].offset - g0, wn = m.layout.params[iw].numel;
    par_compare(P.out, Q.out, (size_t)N * d.C, 0, 1, "output");
    par_compare(P.dx, Q.dx, (size_t)N * d.C, N + d.C, 0, "d(x)");
    par_compare(P.grads + wo, Q.grads + wo, wn, N + d.C, 0, "d(ln_1 weight)");
    /* every other parameter's gradient: the same operations on the same values */
    float *pz = malloc(gn * sizeof(float)), *qz = malloc(gn * sizeof(float));
    memcpy(pz, P.grads, gn * sizeof(float));
    memcpy(qz, Q.grads, gn * sizeof(float));
    memset(pz + wo, 0, wn * sizeof(float));
    memset(qz + wo, 0, wn * sizeof(float));
    if (getenv("FL_TEST_VERBOSE"))
        for (int i = 0; i < m.layout.n; i++) {
            const fl_param_info *pi = &m.layout.params[i];
            if (pi->offset < g0 || pi->offset >= g0 + gn) continue;
            double w = 0;
            for (size_t k = 0; k < pi->numel; k++) {
                double e = fabs((double)pz[pi->offset - g0 + k] - qz[pi->offset - g0 + k]);
                if (e > w) w = e;
            }
            printf("      %s: %.3g\n", pi->name, w);
        }
    par_compare(pz, qz, gn, 0, 1, "the linears' gradients");
    free(pz), free(qz);
    free(P.out), free(P.dx), free(P.grads), free(Q.out), free(Q.dx), free(Q.grads);
    free(x), free(r), free(rc), free(rs);
    fl_model_free(&m);
    fl_mem_pool_free(&pool);
    fl_backend_free(&be);
}
