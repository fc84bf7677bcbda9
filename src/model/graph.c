/* The block graph (see graph.h): the decoder block of LLaMA, GPT-2 and OPT described once as a table
 * of ops over activation slots (another architecture's block comes from its descriptor), what is derived
 * from the table (production order, gradient buffers, widths, inference buffers by liveness), the two
 * executors every pass runs: forward (training, the checkpointed recompute, prefill, decode) and
 * backward, and the model-level table around the blocks. */
#include <math.h>
#include <string.h>

#include "fitllm/comm.h"
#include "model-impl.h"

/* ---- building -------------------------------------------------------------------------- */

int fl_graph_slot(fl_block_graph *g, const char *name, int width, fl_gslot_kind kind, int resid) {
    fl_gslot *s = &g->slot[g->n_slots];
    s->name = name;
    s->width = width;
    s->kind = (uint8_t)kind;
    s->resid = (uint8_t)resid;
    s->grad = kind == FL_GSLOT_STAT ? FL_GBUF_NONE : resid ? FL_GBUF_RES : FL_GBUF_NONE; /* blocks: derive() */
    return g->n_slots++;
}

fl_gop *fl_graph_op(fl_block_graph *g, fl_gop_kind kind, int in, int out, int a1, int a2, int p, int role_w,
                    int role_b) {
    fl_gop *o = &g->op[g->n_ops++];
    memset(o, 0, sizeof *o);
    o->kind = (uint8_t)kind;
    o->in = (int8_t)in;
    o->out = (int8_t)out;
    o->a1 = (int8_t)a1;
    o->a2 = (int8_t)a2;
    o->p = (int8_t)p;
    o->role_w = (int8_t)role_w;
    o->role_b = (int8_t)role_b;
    return o;
}

#define slot fl_graph_slot
#define op fl_graph_op

/* The pre-norm decoder block, by the architecture's flags (fl_arch_info: LLaMA's RMSNorm, RoPE, SwiGLU,
 * GQA; GPT-2's LayerNorm, GELU, biases; OPT's LayerNorm, ReLU, biases):
 *   x -> norm1 -> qkv -> [rope] -> attention -> o -> (+ x) = res_mid
 *     -> norm2 -> fc -> swiglu | gelu | relu -> proj -> (+ res_mid) = out
 * The slots are declared in the order the ops produce them: that order is the arena's layout. */
static void decoder_block(const fl_model_config *c, fl_block_graph *g) {
    fl_dims d = fl_model_dims(c);
    const fl_arch_info *ai = fl_arch_get(c->arch);
    const int ln = ai->layernorm;
    const int X = slot(g, "x", d.C, FL_GSLOT_STREAM, 1), OUT = slot(g, "out", d.C, FL_GSLOT_STREAM, 1);
    const int ln1 = slot(g, "ln1", d.C, FL_GSLOT_WIDE, 0);
    const int ln1m = ln ? slot(g, "ln1_mean", 1, FL_GSLOT_STAT, 0) : -1, ln1r = slot(g, "ln1_rstd", 1, FL_GSLOT_STAT, 0);
    const int qkv = slot(g, "qkv", d.QKV, FL_GSLOT_WIDE, 0), att = slot(g, "att", d.QD, FL_GSLOT_WIDE, 0);
    const int lse = slot(g, "lse", d.NH, FL_GSLOT_STAT, 0);
    const int mid = slot(g, "res_mid", d.C, FL_GSLOT_WIDE, 1);
    const int ln2 = slot(g, "ln2", d.C, FL_GSLOT_WIDE, 0);
    const int ln2m = ln ? slot(g, "ln2_mean", 1, FL_GSLOT_STAT, 0) : -1, ln2r = slot(g, "ln2_rstd", 1, FL_GSLOT_STAT, 0);
    const int fc = slot(g, "fc", d.FCW, FL_GSLOT_WIDE, 0), act = slot(g, "act", d.F, FL_GSLOT_WIDE, 0);
    op(g, FL_GOP_NORM, X, ln1, ln1m, ln1r, 0, FL_ROLE_LN1_W, FL_ROLE_LN1_B);
    op(g, FL_GOP_LINEAR, ln1, qkv, -1, -1, 0, FL_ROLE_QKV_W, FL_ROLE_QKV_B); /* fused (QKV, C) */
    if (ai->rope) op(g, FL_GOP_ROPE, qkv, qkv, -1, -1, -1, -1, -1);
    op(g, FL_GOP_ATTN, qkv, att, lse, -1, -1, -1, -1);
    op(g, FL_GOP_LINEAR, att, mid, -1, -1, 1, FL_ROLE_O_W, FL_ROLE_O_B);
    op(g, FL_GOP_ADD, X, mid, -1, -1, -1, -1, -1);
    op(g, FL_GOP_NORM, mid, ln2, ln2m, ln2r, 1, FL_ROLE_LN2_W, FL_ROLE_LN2_B);
    op(g, FL_GOP_LINEAR, ln2, fc, -1, -1, 2, FL_ROLE_FC_W, FL_ROLE_FC_B); /* LLaMA: fused (2F, C) [gate | up] */
    op(g, ai->glu ? FL_GOP_SWIGLU : ai->relu ? FL_GOP_RELU : FL_GOP_GELU, fc, act, -1, -1, -1, -1, -1);
    op(g, FL_GOP_LINEAR, act, OUT, -1, -1, 3, FL_ROLE_PROJ_W, FL_ROLE_PROJ_B);
    op(g, FL_GOP_ADD, mid, OUT, -1, -1, -1, -1, -1);
    g->n_norms = 2;
    g->n_linears = 4;
}
#undef slot
#undef op

/* ops that modify their slot in place without reading it as an input of their own (in == out) */
static int modifies(const fl_gop *o) { return o->kind == FL_GOP_ROPE || o->kind == FL_GOP_ALLREDUCE; }
static int in_place(const fl_gop *o) { return modifies(o) || o->kind == FL_GOP_ADD; }
static int cross(const fl_gop *o) { return o->kind == FL_GOP_ATTN && o->attn == FL_ATTN_CROSS; }
/* a slot the block does not make: its input and the streams from outside */
static int given(const fl_block_graph *g, int s) { return s == FL_GSLOT_IN || g->slot[s].kind == FL_GSLOT_XSTREAM; }

/* The forward order: every slot made by exactly one op before it is read (in-place ops modify, they do
 * not make), def / last op of each slot, how many ops read it, the production order, the row kinds. */
static fl_status forward_order(fl_block_graph *g, int *def, int *last, int *used) {
    int made[FL_GRAPH_MAX_SLOTS] = {0};
    int merged[FL_GRAPH_MAX_SLOTS]; /* the residual slot each one was added into (ADD), -1 */
    for (int s = 0; s < g->n_slots; s++) {
        def[s] = last[s] = merged[s] = -1;
        used[s] = 0;
        g->slot[s].xrows = g->slot[s].kind == FL_GSLOT_XSTREAM;
    }
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        const int8_t ins[2] = {o->in, o->in2};
        if (o->out < 0 || o->out >= g->n_slots)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d names a slot that does not exist", i);
        for (int k = 0; k < (cross(o) ? 2 : 1); k++) {
            const int s = ins[k];
            if (s < 0 || s >= g->n_slots)
                return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d names a slot that does not exist", i);
            if (!given(g, s) && !made[s])
                return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d reads '%s' before it is made", i, g->slot[s].name);
            if (!modifies(o) && s != FL_GSLOT_IN) used[s]++; /* ROPE and ALLREDUCE modify, the rest read */
            /* a residual path has one gradient: once a slot is added into the next residual slot, that one's
             * gradient is the slot's in the backward, and a later read of the slot would add its gradient
             * there before the ops that read d(next) have run */
            if (merged[s] >= 0)
                return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d reads '%s' after it was added into '%s'", i,
                                 g->slot[s].name, g->slot[merged[s]].name);
            last[s] = i;
        }
        if (o->kind == FL_GOP_ADD) merged[o->in] = o->out;
        if (in_place(o) && !made[o->out])
            return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d modifies '%s' before it is made", i, g->slot[o->out].name);
        if (in_place(o)) last[o->out] = i;
        const int8_t outs[3] = {in_place(o) ? -1 : o->out, o->a1, o->a2};
        for (int k = 0; k < 3; k++) {
            int s = outs[k];
            if (s < 0) continue;
            if (given(g, s) || made[s])
                return fl_errorf(FL_ERR_INTERNAL, "block graph: slot '%s' is made twice (op %d)", g->slot[s].name, i);
            made[s] = 1;
            def[s] = last[s] = i;
            g->slot[s].xrows = g->slot[o->in].xrows; /* rows follow the (query) input */
            if (s != FL_GSLOT_OUT) g->prod[g->n_prod++] = (int8_t)s;
        }
    }
    for (int s = 0; s < g->n_slots; s++) {
        if (!given(g, s) && !made[s])
            return fl_errorf(FL_ERR_INTERNAL, "block graph: no op makes slot '%s'", g->slot[s].name);
        /* an off-path activation nobody reads has no gradient for its producer's backward */
        if (g->slot[s].kind == FL_GSLOT_WIDE && !g->slot[s].resid && used[s] == 0)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: '%s' is made but no op reads it", g->slot[s].name);
    }
    return FL_OK;
}

static int root(const int8_t *uf, int s) {
    while (uf[s] != s) s = uf[s];
    return s;
}

/* The lowest free off-path gradient buffer (1 ..), taken for `who` (a slot, or a residual path's root). */
static fl_status take_gbuf(fl_block_graph *g, int8_t *holder, int who, int *b) {
    *b = 1;
    while (*b < FL_GRAPH_MAX_GBUF && holder[*b] >= 0) (*b)++;
    if (*b == FL_GRAPH_MAX_GBUF)
        return fl_errorf(FL_ERR_INTERNAL, "block graph: d('%s') needs more than %d gradient buffers", g->slot[who].name,
                         FL_GRAPH_MAX_GBUF - 1);
    holder[*b] = (int8_t)who;
    if (*b + 1 > g->n_gbuf) g->n_gbuf = *b + 1;
    return FL_OK;
}

/* Gradient buffers, ops in reverse. Residual slots joined by ADDs share one gradient (uf: their root);
 * the output's starts in RES (d(out) on entry) and the input's must end there: the same path in a
 * pre-norm block, two in a post-norm one (then the output's leaves RES at the last norm's backward,
 * before the input's first contribution; when it is still there, as in a one-sublayer post-norm block,
 * the input's takes another buffer and the backward copies it into RES at its end). An off-path slot's gradient, and another residual path's,
 * takes the lowest free buffer at its first contribution (its last reader in forward order), stays
 * there while its other readers add to it, and frees the buffer once its (first) producer's backward
 * has read it: a chain alternates 1 and 2, as the hand-written passes did. */
static fl_status assign_grads(fl_block_graph *g, const int *def) {
    int8_t uf[FL_GRAPH_MAX_SLOTS], ugrad[FL_GRAPH_MAX_SLOTS];
    int udef[FL_GRAPH_MAX_SLOTS]; /* the first op making a member of each residual path */
    for (int s = 0; s < g->n_slots; s++) uf[s] = (int8_t)s, ugrad[s] = FL_GBUF_NONE, udef[s] = g->n_ops;
    for (int i = 0; i < g->n_ops; i++)
        if (g->op[i].kind == FL_GOP_ADD) uf[root(uf, g->op[i].in)] = (int8_t)root(uf, g->op[i].out);
    for (int s = 0; s < g->n_slots; s++)
        if (def[s] >= 0 && def[s] < udef[root(uf, s)]) udef[root(uf, s)] = def[s];
    const int rin = root(uf, FL_GSLOT_IN), rout = root(uf, FL_GSLOT_OUT);
    int8_t holder[FL_GRAPH_MAX_GBUF]; /* the slot (or path root) whose gradient each buffer holds, -1 free */
    memset(holder, -1, sizeof holder);
    ugrad[rout] = FL_GBUF_RES;
    holder[FL_GBUF_RES] = (int8_t)rout;
    g->n_gbuf = FL_N_GBUF;
#define GRAD(s) (g->slot[s].resid ? ugrad[root(uf, s)] : g->slot[s].grad)
    for (int i = g->n_ops - 1; i >= 0; i--) {
        fl_gop *o = &g->op[i];
        fl_gslot *si = &g->slot[o->in], *so = &g->slot[o->out];
        o->acc = si->resid;
        if (o->kind == FL_GOP_ADD) {
            if (!si->resid || !so->resid)
                return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d adds '%s' off the residual path", i, si->name);
            continue;
        }
        const int gout = GRAD(o->out);
        if (gout == FL_GBUF_NONE)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: the backward reaches op %d before d('%s')", i, so->name);
        if (modifies(o)) continue; /* in place: in == out */
        const int8_t ins[2] = {o->in, o->in2};
        for (int k = 0; k < (cross(o) ? 2 : 1); k++) {
            const int s = ins[k], r = root(uf, s);
            fl_gslot *sk = &g->slot[s];
            int acc = 1, b;
            if (sk->kind == FL_GSLOT_XSTREAM) {
                acc = 1; /* accumulates across blocks in the caller's buffer */
            } else if (sk->resid && ugrad[r] == FL_GBUF_NONE) { /* a residual path's first contribution */
                acc = 0;
                if (r == rin && holder[FL_GBUF_RES] < 0) {
                    holder[b = FL_GBUF_RES] = (int8_t)r;
                } else { /* the input's path while d(out) still holds RES: copied there at the end */
                    FL_TRY(take_gbuf(g, holder, r, &b));
                }
                ugrad[r] = (int8_t)b;
            } else if (!sk->resid && sk->grad == FL_GBUF_NONE) { /* an off-path slot's first contribution */
                acc = 0;
                FL_TRY(take_gbuf(g, holder, s, &b));
                sk->grad = (int8_t)b;
            }
            if (sk->kind != FL_GSLOT_XSTREAM && GRAD(s) == gout)
                return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d's backward reads d('%s') where it writes d('%s')", i,
                                 so->name, sk->name);
            if (k) o->acc2 = (uint8_t)acc;
            else o->acc = (uint8_t)acc; /* the residual path, or a later reader in forward order started it */
        }
        /* the op that makes its output (the first member of its residual path) has read d(out) for the last time */
        if (!so->resid && def[o->out] == i && holder[so->grad] == o->out) holder[so->grad] = -1;
        if (so->resid && root(uf, o->out) != rin && udef[root(uf, o->out)] == i) holder[gout] = -1;
    }
#undef GRAD
    for (int s = 0; s < g->n_slots; s++)
        if (g->slot[s].resid) g->slot[s].grad = ugrad[root(uf, s)];
    for (int s = 0; s < g->n_slots; s++)
        if (g->slot[s].grad > FL_GBUF_NONE && g->gbuf_width[g->slot[s].grad] < g->slot[s].width)
            g->gbuf_width[g->slot[s].grad] = g->slot[s].width;
    return FL_OK;
}

/* Inference buffers by liveness: IN and OUT share buffer 0 (the input is dead before the output is made;
 * prefill and decode then run the blocks in place); the others take, in production order, the free
 * buffer that fits best (else the widest free one, widened; else a new one). */
static fl_status inference_buffers(fl_block_graph *g, const int *def, int *last) {
    if (last[FL_GSLOT_IN] >= def[FL_GSLOT_OUT])
        return fl_errorf(FL_ERR_INTERNAL, "block graph: the block's input is read after its output is made");
    last[FL_GSLOT_OUT] = g->n_ops;
    int busy[FL_GRAPH_MAX_SLOTS]; /* last op reading each buffer's current slot */
    g->n_ibuf = 1;
    g->ibuf_width[0] = g->slot[FL_GSLOT_IN].width;
    g->ibuf_of[FL_GSLOT_IN] = g->ibuf_of[FL_GSLOT_OUT] = 0;
    busy[0] = g->n_ops;
    for (int k = 0; k < g->n_prod; k++) {
        int s = g->prod[k], w = g->slot[s].width, best = -1, widest = -1;
        for (int b = 1; b < g->n_ibuf; b++) {
            if (busy[b] >= def[s]) continue;
            if (g->ibuf_width[b] >= w && (best < 0 || g->ibuf_width[b] < g->ibuf_width[best])) best = b;
            if (widest < 0 || g->ibuf_width[b] > g->ibuf_width[widest]) widest = b;
        }
        if (best < 0) best = widest >= 0 ? widest : g->n_ibuf++; /* a new buffer starts at width 0 */
        if (g->ibuf_width[best] < w) g->ibuf_width[best] = w;
        g->ibuf_of[s] = (int8_t)best;
        busy[best] = last[s];
    }
    return FL_OK;
}

/* Everything derived from the table, and the checks that make the derivations valid. */
fl_status fl_block_graph_finish(fl_block_graph *g) {
    int def[FL_GRAPH_MAX_SLOTS], last[FL_GRAPH_MAX_SLOTS], used[FL_GRAPH_MAX_SLOTS];
    FL_TRY(forward_order(g, def, last, used));
    FL_TRY(assign_grads(g, def));
    for (int i = 0; i < g->n_ops; i++)
        if (g->op[i].kind == FL_GOP_LINEAR) {
            if (g->slot[g->op[i].in].width > g->lin_in_max) g->lin_in_max = g->slot[g->op[i].in].width;
            if (g->slot[g->op[i].out].width > g->lin_out_max) g->lin_out_max = g->slot[g->op[i].out].width;
        }
    return inference_buffers(g, def, last);
}

fl_status fl_block_graph_build(const fl_model_config *c, fl_block_graph *g) {
    memset(g, 0, sizeof *g);
    const fl_arch_info *ai = fl_arch_get(c->arch);
    if (!ai) return fl_errorf(FL_ERR_UNSUPPORTED, "no block graph for architecture %d", (int)c->arch);
    if (ai->block_graph) ai->block_graph(c, g); /* its own block (BERT's post-norm encoder block) */
    else decoder_block(c, g);                  /* the pre-norm decoder block, by the descriptor's feature flags */
    if (c->tp_size > 1) FL_TRY(fl_block_graph_tp(g)); /* a tensor-parallel rank's slice (graph_tp.c) */
    return fl_block_graph_finish(g);
}

fl_status fl_stack_graph_build(const fl_model_config *c, int stack, fl_block_graph *g) {
    if (stack == 0) return fl_block_graph_build(c, g);
    memset(g, 0, sizeof *g);
    const fl_arch_info *ai = fl_arch_get(c->arch);
    if (!ai || stack != 1 || !ai->block_graph2)
        return fl_errorf(FL_ERR_UNSUPPORTED, "no block graph for stack %d of architecture %d", stack, (int)c->arch);
    ai->block_graph2(c, g);
    return fl_block_graph_finish(g);
}

static size_t al16(size_t n) { return (n + 15) / 16 * 16; } /* 64-byte aligned views */

size_t fl_block_rows_scratch(const fl_block_graph *g, int n, float *base, float **s) {
    size_t off[FL_GRAPH_MAX_SLOTS], tot = 0;
    for (int b = 0; b < g->n_ibuf; b++) {
        off[b] = tot;
        tot += al16((size_t)n * g->ibuf_width[b]);
    }
    if (base && s) /* a stream from outside the block is the caller's to bind */
        for (int k = 0; k < g->n_slots; k++)
            if (g->slot[k].kind != FL_GSLOT_XSTREAM) s[k] = base + off[g->ibuf_of[k]];
    return tot;
}

/* ---- running ------------------------------------------------------------------------------ */

static void rope(const fl_model *m, float *x, int bwd, const fl_block_ctx *c, size_t row) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    void (*f)(const fl_backend *, float *, int, int, int, int, size_t, const float *, const float *, int) =
        bwd ? be->rope_backward : be->rope_forward;
    f(be, x, c->B, c->T, d.NH, d.HD, row, c->rope_cos, c->rope_sin, c->pos0);        /* q heads */
    f(be, x + d.QD, c->B, c->T, d.NKV, d.HD, row, c->rope_cos, c->rope_sin, c->pos0); /* k heads */
}

/* Generation: append the rows' K and V (after RoPE) to the layer's cache, (NKV, max_T, HD) per layer. */
static fl_status kv_append(const fl_model *m, const float *qkv, const fl_block_ctx *c) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    fl_kv_cache *kv = c->kv;
    float *kc = kv->k + fl_kv_cache_index(kv, c->layer, 0, 0), *vc = kv->v + fl_kv_cache_index(kv, c->layer, 0, 0);
    const size_t head_stride = (size_t)kv->max_T * d.HD;
    for (int t = 0; t < c->T; t++) {
        const float *row = qkv + (size_t)t * d.QKV;
        for (int h = 0; h < d.NKV; h++) {
            size_t dst = (size_t)h * head_stride + (size_t)(c->pos0 + t) * d.HD;
            FL_TRY(be->copy(be, kc + dst, row + d.QD + (size_t)h * d.HD, (size_t)d.HD * sizeof(float)));
            FL_TRY(be->copy(be, vc + dst, row + d.QD + d.KVD + (size_t)h * d.HD, (size_t)d.HD * sizeof(float)));
        }
    }
    return FL_OK;
}

/* Slot k holds its final values once op i has run: no later op writes it (an output, or RoPE's / ALLREDUCE's
 * in-place change). */
static int final_after(const fl_block_graph *g, int i, int k) {
    for (int j = i + 1; j < g->n_ops; j++)
        if (g->op[j].out == k || (modifies(&g->op[j]) && g->op[j].in == k)) return 0;
    return 1;
}

/* Rows of slot k in this pass: the block's B x T, or B x Tk for a stream from outside and what is computed from it. */
static int rows(const fl_block_graph *g, int k, const fl_block_ctx *x) { return x->B * (g->slot[k].xrows ? x->Tk : x->T); }

/* bf16 activations stored end to end (fl_block_ctx.store16): slot k, just written for the last time in the
 * block, is stored in bf16 (its s16 copy) and the fp32 view the later ops read holds the same value (round on
 * store, widen on load: the CPU backend computes in fp32, what it keeps is bf16). A slot written by several ops
 * (a LINEAR's output then RoPE, or the residual add) is stored once, after the last: the ops between act as one
 * fused kernel (bias + residual epilogue, RoPE in the attention's input preparation) that keeps its
 * intermediate in registers. Statistics stay fp32. */
static int stored16(const fl_block_graph *g, int k, const fl_block_ctx *x) {
    const uint8_t kind = g->slot[k].kind;
    return (kind == FL_GSLOT_WIDE || kind == FL_GSLOT_STREAM) && x->s16[k];
}
static fl_status store16(const fl_backend *be, const fl_block_graph *g, int k, float *const *s, const fl_block_ctx *x) {
    if (!stored16(g, k, x)) return FL_OK;
    const size_t n = (size_t)rows(g, k, x) * g->slot[k].width;
    if (be->round16) return be->round16(be, x->s16[k], FL_BF16, s[k], n); /* one kernel */
    FL_TRY(be->convert(be, x->s16[k], FL_BF16, s[k], FL_F32, n));
    return be->convert(be, s[k], FL_F32, x->s16[k], FL_BF16, n);
}

/* bf16 stored, fused (issue 30 item 1): ops that write their stored output's bf16 copy themselves where the
 * backend has the optional variant (act_forward16, add16, rope_forward16: the fp32 op's value, then round16's
 * bits), and a plain linear feeding an activation stored by the GEMM in bf16 only (fl_linear_forward16), its fp32
 * view filled by that activation, its one reader. Backends without them (cpu, ref, opaque): the fp32 op, then
 * store16. */
static int act16_kind(uint8_t k) {
    return k == FL_GOP_SWIGLU ? FL_ACT16_SWIGLU : k == FL_GOP_GELU ? FL_ACT16_GELU : k == FL_GOP_RELU ? FL_ACT16_RELU : -1;
}
/* no op after op j reads slot k */
static int unread_after(const fl_block_graph *g, int j, int k) {
    for (int i = j + 1; i < g->n_ops; i++)
        if (g->op[i].in == k || (cross(&g->op[i]) && g->op[i].in2 == k)) return 0;
    return 1;
}
/* op i is a LINEAR whose output only op i + 1 reads, an activation with a bf16 input variant */
static int gemm_to_act16(const fl_backend *be, const fl_block_graph *g, int i) {
    const fl_gop *o = &g->op[i], *nx = i + 1 < g->n_ops ? &g->op[i + 1] : NULL;
    return be->act_forward16 && nx && act16_kind(nx->kind) >= 0 && nx->in == o->out &&
           g->slot[o->out].kind == FL_GSLOT_WIDE && unread_after(g, i + 1, o->out);
}

/* The general attention op's shape and q/k/v views for an ATTN op that is not the fused causal one:
 * self-attention over the fused q|k|v rows, or cross-attention of q rows to fused k|v rows. */
static void attn_views(const fl_model *m, const fl_block_graph *g, const fl_gop *o, const fl_block_ctx *x,
                       float *const *s, fl_attn_desc *a, float **q, float **k, float **v) {
    fl_dims d = fl_model_dims(&m->cfg);
    memset(a, 0, sizeof *a);
    a->B = x->B, a->Tq = x->T, a->NH = d.NH, a->NKV = d.NKV, a->HD = d.HD;
    a->ldo = (size_t)g->slot[o->out].width;
    a->scale = o->attn_flags & FL_GATTN_NOSCALE ? 1.0f : 1.0f / sqrtf((float)d.HD);
    a->causal = o->attn == FL_ATTN_CAUSAL;
    *q = s[o->in];
    a->ldq = (size_t)g->slot[o->in].width;
    if (o->attn == FL_ATTN_CROSS) { /* k | v of the stream's rows */
        a->Tk = x->Tk;
        *k = s[o->in2];
        a->ldk = a->ldv = (size_t)g->slot[o->in2].width;
    } else {
        a->Tk = x->T;
        *k = *q + d.QD;
        a->ldk = a->ldv = a->ldq;
        if (x->kv_rows > x->T) { /* incremental decoding: the keys from the slot's first row (causal: bottom-right) */
            a->Tk = x->kv_rows;
            *k -= (size_t)(x->kv_rows - x->T) * a->ldq;
        }
    }
    *v = *k + d.KVD;
}

static fl_status attn_forward(const fl_model *m, const fl_block_graph *g, const fl_gop *o, float *const *s,
                              const fl_block_ctx *x) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    float *in = s[o->in], *out = s[o->out], *lse = o->a1 >= 0 ? s[o->a1] : NULL;
    if (o->attn == FL_ATTN_CAUSAL && !o->attn_flags) { /* the decoder's fused causal kernels */
        if (x->kv) FL_TRY(kv_append(m, in, x));
        if (x->kv && x->T == 1) {
            fl_kv_cache *kv = x->kv;
            be->attention_decode(be, out, in, kv->k + fl_kv_cache_index(kv, x->layer, 0, 0),
                                 kv->v + fl_kv_cache_index(kv, x->layer, 0, 0), x->pos0 + 1, d.NH, d.NKV, d.HD,
                                 (size_t)kv->max_T * d.HD);
        } else {
            FL_TRY(fl_attention_qkv_forward(be, out, lse, in, x->B, x->T, d.NH, d.NKV, d.HD)); // (N, QD)
        }
        return FL_OK;
    }
    if (x->kv) return fl_errorf(FL_ERR_UNSUPPORTED, "generation with a KV cache runs causal self-attention only");
    if (x->kv_rows > x->T && x->B != 1)
        return fl_errorf(FL_ERR_INVALID, "incremental decoding (kv_rows) runs one sequence (B %d)", x->B);
    fl_attn_desc a;
    float *q, *k, *v;
    attn_views(m, g, o, x, s, &a, &q, &k, &v);
    return be->attention_forward(be, &a, out, lse, q, k, v, o->attn_flags & FL_GATTN_BIAS ? x->attn_bias : NULL,
                                    o->attn_flags & FL_GATTN_MASK ? x->kmask : NULL);
}

/* The gradient buffer of slot k: a stream from outside accumulates into the caller's. */
static float *dslot(const fl_block_graph *g, int k, float *const *gb, const fl_block_ctx *x) {
    return g->slot[k].kind == FL_GSLOT_XSTREAM ? (x->dxs ? x->dxs[k] : NULL) : gb[g->slot[k].grad];
}

static fl_status attn_backward(const fl_model *m, const fl_block_graph *g, const fl_gop *o, float *const *s,
                               float *const *gb, const fl_block_ctx *x, float *din, float *dout) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    const float *lse = o->a1 >= 0 ? s[o->a1] : NULL;
    if (o->attn == FL_ATTN_CAUSAL && !o->attn_flags) {
        return fl_attention_qkv_backward(be, din, dout, s[o->in], s[o->out], lse, x->B, x->T, d.NH, d.NKV, d.HD);
    }
    fl_attn_desc a;
    float *q, *k, *v, *dk, *dv;
    attn_views(m, g, o, x, s, &a, &q, &k, &v);
    if (o->attn == FL_ATTN_CROSS) {
        dk = dslot(g, o->in2, gb, x);
        if (!o->acc2) be->zero(be, dk, (size_t)rows(g, o->in2, x) * g->slot[o->in2].width * sizeof(float));
    } else {
        dk = din + d.QD;
    }
    dv = dk + d.KVD;
    const float *bias = o->attn_flags & FL_GATTN_BIAS ? x->attn_bias : NULL;
    return be->attention_backward(be, &a, din, dk, dv, bias ? x->dattn_bias : NULL, dout, q, k, v, bias,
                                     o->attn_flags & FL_GATTN_MASK ? x->kmask : NULL, s[o->out], lse);
}

/* ALLREDUCE: the slot summed over the communicator's ranks (no communicator or one rank: nothing to do). */
static fl_status allreduce(struct fl_comm *c, float *p, size_t n) {
    if (!c || fl_comm_size(c) <= 1) return FL_OK;
    return fl_comm_all_reduce(c, p, p, n, FL_F32, FL_COMM_SUM);
}

/* Backward, bf16 compute (issue 30 item 1): op i (an activation or ROPE) is the last to write d(in) and op i - 1,
 * next in the backward's order, is the LINEAR that made in and reads its dy in bf16: op i writes that copy into
 * the linear's dyb16 as it writes d(in) (act_backward16 / rope_backward16), and the linear skips its convert.
 * NULL: no such pair, or the backend lacks the op (cpu, ref, opaque). */
static void *dy16_for(const fl_backend *be, const fl_block_graph *g, const fl_block_params *bp, int i) {
    const fl_gop *o = &g->op[i], *pv = i > 0 ? &g->op[i - 1] : NULL;
    if (!pv || pv->kind != FL_GOP_LINEAR || pv->out != o->in || !fl_linear_wants_dy16(&bp->lin[pv->p])) return NULL;
    const int ok = (act16_kind(o->kind) >= 0 && be->act_backward16) || (o->kind == FL_GOP_ROPE && be->rope_backward16);
    return ok ? bp->lin[pv->p].dyb16 : NULL;
}

fl_status fl_block_forward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                           const fl_block_ctx *x) {
    const fl_backend *be = m->be;
    int pend16 = -1; /* a slot stored in bf16 only so far (gemm_to_act16) */
#define S(k) ((k) >= 0 ? s[k] : NULL)
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        float *in = s[o->in], *out = s[o->out];
        const int N = rows(g, o->in, x);
        const size_t wi = (size_t)g->slot[o->in].width, wo = (size_t)g->slot[o->out].width;
        const int last = x->store16 && final_after(g, i, o->out); /* the output is stored in bf16 after this op */
        void *o16 = last && stored16(g, o->out, x) ? x->s16[o->out] : NULL; /* its bf16 copy */
        int done16 = 0; /* the op wrote that bf16 copy itself */
        if (act16_kind(o->kind) >= 0 && be->act_forward16 && (o16 || pend16 == o->in)) {
            const void *in16 = pend16 == o->in ? x->s16[o->in] : NULL; /* its fp32 view is filled here */
            FL_TRY(be->act_forward16(be, act16_kind(o->kind), out, o16, in, in16, N,
                                     o->kind == FL_GOP_SWIGLU ? (int)wo : (int)wi));
            pend16 = -1;
            continue;
        }
        switch ((fl_gop_kind)o->kind) {
        case FL_GOP_NORM: {
            done16 = fl_norm_forward_t(m, out, o16, S(o->a1), S(o->a2), in, bp->norm_w[o->p], bp->norm_wt,
                                       bp->norm_b[o->p], N);
            break;
        }
        case FL_GOP_LINEAR: { // (N, wo)
            const fl_linear *lin = &bp->lin[o->p];
            if (x->xs_ready && g->slot[o->in].kind == FL_GSLOT_XSTREAM) break; /* kept from an earlier pass */
            /* stored in bf16: the input's copy is the GEMM's bf16 operand (a BF16 weight rounds an F32 x to it);
             * a slot still to be changed by a later op is not stored yet (the GEMM rounds the fp32 view itself) */
            const void *in16 = x->store16 && lin->n_q4 == 0 && lin->wc && lin->wct == FL_BF16 &&
                                       final_after(g, i, o->in)
                                   ? x->s16[o->in]
                                   : NULL;
            if (o16 && in16 && fl_linear_plain16(lin) && gemm_to_act16(be, g, i)) { /* bf16 only: see act16_kind */
                FL_TRY(fl_linear_forward16(be, o16, in16, lin, N));
                pend16 = o->out, done16 = 1;
                break;
            }
            FL_TRY(fl_linear_forward_ex(be, out, in, in16, lin, N));
            break;
        }
        case FL_GOP_ROPE: {
            fl_dims d = fl_model_dims(&m->cfg);
            if (o16 && be->rope_forward16 && d.QD == d.NH * d.HD) { /* the q and k heads are consecutive */
                FL_TRY(be->rope_forward16(be, in, o16, x->B, x->T, d.NH + d.NKV, d.HD, (int)wi, x->rope_cos,
                                          x->rope_sin, x->pos0));
                done16 = 1;
            } else
                rope(m, in, 0, x, wi);
            break;
        }
        case FL_GOP_ATTN: FL_TRY(attn_forward(m, g, o, s, x)); break;
        case FL_GOP_ADD: {
            /* a residual add straight into an RMSNorm of its sum: one fused op (issue 30 item 4; the CPU's is the
             * two ops, the same bits). Not when bf16 is stored (store16): the sum must be rounded to bf16 before
             * the norm reads it, and the fused op has no bf16 variant yet. */
            const fl_gop *nx = i + 1 < g->n_ops && !x->store16 ? &g->op[i + 1] : NULL;
            if (nx && nx->kind == FL_GOP_NORM && nx->in == o->out && !fl_arch_get(m->cfg.arch)->layernorm &&
                bp->norm_wt == FL_F32 &&
                wo == (size_t)m->cfg.dim && rows(g, nx->in, x) == N) {
                FL_TRY(be->add_rmsnorm_forward(be, out, s[nx->out], S(nx->a2), out, in, bp->norm_w[nx->p], FL_F32, N,
                                               m->cfg.dim, m->cfg.norm_eps));
                i++; /* the norm is done */
                break;
            }
            if (o16 && be->add16) {
                FL_TRY(be->add16(be, out, o16, out, in, (size_t)N * wo));
                done16 = 1;
            } else
                be->add(be, out, out, in, (size_t)N * wo);
            break;
        }
        case FL_GOP_SWIGLU: be->swiglu_forward(be, out, in, N, (int)wo); break;
        case FL_GOP_GELU: be->gelu_forward(be, out, in, (size_t)N * wi); break;
        case FL_GOP_RELU: be->relu_forward(be, out, in, (size_t)N * wi); break;
        case FL_GOP_GELU_ERF: be->gelu_erf_forward(be, out, in, (size_t)N * wi); break;
        case FL_GOP_GEGLU:
            if (!be->geglu_forward)
                return fl_errorf(FL_ERR_UNSUPPORTED, "backend %s has no geglu op (T5 v1.1's gated-GELU FFN)", be->name);
            be->geglu_forward(be, out, in, N, (int)wo);
            break;
        case FL_GOP_ALLREDUCE:
            if (o->p == FL_GAR_FWD) FL_TRY(allreduce(x->comm, out, (size_t)N * wo));
            break;
        }
        if (last && !done16) FL_TRY(store16(be, g, o->out, s, x)); /* ROPE: in place */
    }
    return FL_OK;
#undef S
}

/* Slots whose gradient something reads (bit k: slot k), when d(input) is not read: in the forward's
 * order, an op's output needs its gradient when the op trains a parameter (or LoRA adapter) or its
 * input needs one. */
static int op_trains(const fl_block_params *bp, const fl_gop *o) {
    if (o->kind == FL_GOP_LINEAR) {
        const fl_linear *l = &bp->lin[o->p];
        return l->dw || l->db || l->n_adapters > 0;
    }
    return o->kind == FL_GOP_NORM && (bp->d_norm_w[o->p] || bp->d_norm_b[o->p]);
}

static unsigned grads_needed(const fl_block_graph *g, const fl_block_params *bp) {
    unsigned need = 0;
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (op_trains(bp, o) || (need >> o->in & 1u)) need |= 1u << o->out;
    }
    return need;
}

fl_status fl_block_backward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                            float *const *gb, const fl_block_ctx *x) {
    const fl_backend *be = m->be;
    const unsigned need = x->no_din ? grads_needed(g, bp) : ~0u;
    int dy16_ready = 0; /* the next op's (a LINEAR's) dy already in its dyb16 (dy16_for) */
#define S(k) ((k) >= 0 ? s[k] : NULL)
    for (int i = g->n_ops - 1; i >= 0; i--) {
        const fl_gop *o = &g->op[i];
        const fl_gslot *si = &g->slot[o->in], *so = &g->slot[o->out];
        const int ready = dy16_ready; /* this op's dout was rounded into its dyb16 by the op before (dy16_for) */
        dy16_ready = 0;
        if (o->kind == FL_GOP_ADD) continue; /* both sides on one residual path: d(in) += d(out) is the identity */
        /* nothing reads d(in): only an op that trains runs (a LINEAR without its dx) */
        const int need_in = need >> o->in & 1u;
        if (!need_in && !op_trains(bp, o)) continue;
        float *din = need_in || o->kind != FL_GOP_LINEAR ? dslot(g, o->in, gb, x) : NULL, *dout = dslot(g, o->out, gb, x);
        const int N = rows(g, o->in, x);
        const size_t wi = (size_t)si->width, wo = (size_t)so->width;
        /* ops whose backward accumulates into d(in): a gradient not started yet starts from zero (a
         * LINEAR overwrites it instead; o->acc: the residual path, or another reader's part already there) */
        if (!o->acc && o->kind != FL_GOP_LINEAR && !modifies(o)) be->zero(be, din, (size_t)N * wi * sizeof(float));
        /* the LINEAR next in this order made in and reads d(in) in bf16: this op writes that copy (dy16) */
        void *dy16 = dy16_for(be, g, bp, i);
        if (dy16 && act16_kind(o->kind) >= 0) {
            FL_TRY(be->act_backward16(be, act16_kind(o->kind), din, dy16, dout, s[o->in], N,
                                      o->kind == FL_GOP_SWIGLU ? (int)wo : (int)wi));
            dy16_ready = 1;
            continue;
        }
        switch ((fl_gop_kind)o->kind) {
        case FL_GOP_NORM:
            fl_norm_backward_t(m, din, bp->d_norm_w[o->p], bp->d_norm_b[o->p], dout, s[o->in], bp->norm_w[o->p],
                               bp->norm_wt, S(o->a1), S(o->a2), N);
            break;
        case FL_GOP_LINEAR:
            FL_TRY(fl_linear_backward_dy16(be, din, o->acc, dout, ready, s[o->in], x->s16 ? x->s16[o->in] : NULL,
                                           &bp->lin[o->p], N));
            break;
        case FL_GOP_ROPE: {
            fl_dims d = fl_model_dims(&m->cfg);
            if (dy16 && d.QD == d.NH * d.HD) {
                FL_TRY(be->rope_backward16(be, din, dy16, x->B, x->T, d.NH + d.NKV, d.HD, (int)wi, x->rope_cos,
                                           x->rope_sin, x->pos0));
                dy16_ready = 1;
            } else
                rope(m, din, 1, x, wi);
            break;
        }
        case FL_GOP_ATTN: FL_TRY(attn_backward(m, g, o, s, gb, x, din, dout)); break;
        case FL_GOP_SWIGLU: be->swiglu_backward(be, din, dout, s[o->in], N, (int)wo); break;
        case FL_GOP_GELU: be->gelu_backward(be, din, dout, s[o->in], (size_t)N * wi); break;
        case FL_GOP_RELU: be->relu_backward(be, din, dout, s[o->in], (size_t)N * wi); break;
        case FL_GOP_GELU_ERF: be->gelu_erf_backward(be, din, dout, s[o->in], (size_t)N * wi); break;
        case FL_GOP_GEGLU: be->geglu_backward(be, din, dout, s[o->in], N, (int)wo); break;
        case FL_GOP_ALLREDUCE:
            if (o->p == FL_GAR_BWD) FL_TRY(allreduce(x->comm, din, (size_t)N * wi));
            break;
        case FL_GOP_ADD: break;
        }
    }
    if (g->slot[FL_GSLOT_IN].grad != FL_GBUF_RES && !x->no_din) /* d(input) ended elsewhere (assign_grads) */
        FL_TRY(be->copy(be, gb[FL_GBUF_RES], gb[g->slot[FL_GSLOT_IN].grad],
                        (size_t)x->B * x->T * g->slot[FL_GSLOT_IN].width * sizeof(float)));
    return FL_OK;
#undef S
}

/* ---- the model around the blocks ------------------------------------------------------------ */

void fl_model_graph_op(fl_model_graph *mg, fl_mop_kind kind, int role_w, int role_b) {
    if (mg->n_ops >= FL_MODEL_GRAPH_MAX_OPS) return; /* fl_model_graph_build refuses the table */
    mg->op[mg->n_ops].kind = (uint8_t)kind;
    mg->op[mg->n_ops].role_w = (int8_t)role_w;
    mg->op[mg->n_ops].role_b = (int8_t)role_b;
    mg->op[mg->n_ops].stack = (int8_t)mg->n_stacks;
    mg->n_ops++;
}

void fl_model_graph_stack(fl_model_graph *mg) { mg->n_stacks++; }

/* (of the last stack: an encoder-decoder's decoder, whose end is the model's) */
int fl_model_graph_has(const fl_model_graph *mg, fl_mop_kind kind, int where) {
    int side = -1;
    const int last = mg->n_ops ? mg->op[mg->n_ops - 1].stack : 0;
    for (int i = 0; i < mg->n_ops; i++) {
        if (mg->op[i].stack != last) continue;
        if (mg->op[i].kind == FL_MOP_BLOCKS) side = 1;
        else if (mg->op[i].kind == kind && (where == 0 || where == side)) return 1;
    }
    return 0;
}

fl_status fl_model_graph_build(const fl_model_config *c, fl_model_graph *mg) {
    memset(mg, 0, sizeof *mg);
    const fl_arch_info *ai = fl_arch_get(c->arch);
    if (!ai) return fl_errorf(FL_ERR_UNSUPPORTED, "no model graph for architecture %d", (int)c->arch);
    if (ai->model_graph) {
        ai->model_graph(c, mg);
    } else { /* the decoders: (B, T) ids -> (N, C) rows -> L blocks -> final norm -> (N, V) logits, loss */
        fl_model_graph_op(mg, FL_MOP_EMBED, -1, -1);
        fl_model_graph_op(mg, FL_MOP_BLOCKS, -1, -1);
        fl_model_graph_op(mg, FL_MOP_NORM, FL_ROLE_NORM_F_W, FL_ROLE_NORM_F_B);
        fl_model_graph_op(mg, FL_MOP_HEAD_LM, -1, -1);
    }
    /* every stack: one BLOCKS after its first op; the last ends in a head or the output, the others in the
     * output (the stream the next stack reads) */
    mg->n_stacks = mg->n_ops ? mg->op[mg->n_ops - 1].stack + 1 : 0;
    int ok = mg->n_ops > 0 && mg->n_ops < FL_MODEL_GRAPH_MAX_OPS && mg->n_stacks <= FL_MODEL_GRAPH_MAX_STACKS;
    for (int st = 0; ok && st < mg->n_stacks; st++) {
        int blocks = 0, first = -1, end = -1;
        for (int i = 0; i < mg->n_ops; i++) {
            if (mg->op[i].stack != st) continue;
            if (first < 0) first = i;
            blocks += mg->op[i].kind == FL_MOP_BLOCKS;
            end = mg->op[i].kind;
        }
        ok = first >= 0 && blocks == 1 && mg->op[first].kind != FL_MOP_BLOCKS &&
             (end == FL_MOP_OUTPUT || (end == FL_MOP_HEAD_LM && st == mg->n_stacks - 1));
    }
    if (!ok)
        return fl_errorf(FL_ERR_INTERNAL, "model graph of %s: per stack one BLOCKS after the embeddings, ending in the "
                         "output (the last stack: or a head), at most %d ops and %d stacks", ai->name,
                         FL_MODEL_GRAPH_MAX_OPS - 1, FL_MODEL_GRAPH_MAX_STACKS);
    return FL_OK;
}
