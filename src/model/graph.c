/* The block graph (see graph.h): the decoder block of LLaMA, GPT-2 and OPT described once as a table
 * of ops over activation slots (another architecture's block comes from its descriptor), what is derived
 * from the table (production order, gradient buffers, widths, inference buffers by liveness) and the
 * model-level table around the blocks. The tables are run by the executor (exec.c). The registry of the
 * architectures whose descriptors feed it (fl_arch_get) opens the file. */
#include <math.h>
#include <string.h>

#include "fitllm/comm.h"
#include "model-impl.h"

/* ---- the architectures this build knows (fl_arch_get): one descriptor each, in src/model/arch_<name>.c ---- */

extern const fl_arch_info fl_arch_llama, fl_arch_gpt2, fl_arch_opt, fl_arch_bert, fl_arch_t5, fl_arch_blip2_vision,
    fl_arch_blip2_qformer;

const fl_arch_info *fl_arch_get(fl_arch a) {
    static const fl_arch_info *const all[FL_ARCH_COUNT] = {[FL_ARCH_LLAMA] = &fl_arch_llama, [FL_ARCH_GPT2] = &fl_arch_gpt2,
                                                            [FL_ARCH_OPT] = &fl_arch_opt, [FL_ARCH_BERT] = &fl_arch_bert,
                                                            [FL_ARCH_T5] = &fl_arch_t5,
                                                            [FL_ARCH_BLIP2_VISION] = &fl_arch_blip2_vision,
                                                            [FL_ARCH_BLIP2_QFORMER] = &fl_arch_blip2_qformer};
    return a >= 0 && a < FL_ARCH_COUNT ? all[a] : NULL;
}

int fl_model_is_s2s(const fl_model_config *c) { return c->n_dec_layers > 0 || c->pp_enc > 0; }

/* ---- the graphs' small facts ---- */

/* The model's dimensions (model-impl.h fl_dims) from its config. */
fl_dims fl_model_dims(const fl_model_config *c) {
    fl_dims d;
    d.C = c->dim;
    d.NH = c->n_heads;
    d.NKV = c->n_kv_heads;
    d.HD = c->head_dim;
    d.QD = d.NH * d.HD;
    d.KVD = d.NKV * d.HD;
    d.QKV = d.QD + 2 * d.KVD;
    d.F = c->ffn_dim;
    d.FCW = fl_arch_get(c->arch)->glu ? 2 * d.F : d.F;
    d.V = fl_config_vocab_rows(c, NULL); /* tensor parallel: the vocabulary slice */
    d.L = c->n_layers;
    return d;
}

/* An op that changes its input in place, and a dropout site's seed (graph.h). */
int fl_gop_modifies(const fl_gop *o) {
    return o->kind == FL_GOP_ROPE || o->kind == FL_GOP_ALLREDUCE || (o->kind == FL_GOP_DROPOUT && o->in == o->out);
}
uint64_t fl_dropout_seed(uint64_t base, uint64_t site) {
    uint64_t z = base ^ (site + 1) * 0xD6E8FEB86659FD93ULL;
    z = (z ^ (z >> 32)) * 0xD6E8FEB86659FD93ULL;
    z = (z ^ (z >> 32)) * 0xD6E8FEB86659FD93ULL;
    return z ^ (z >> 32);
}

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

int fl_drops_hidden(const fl_model_config *c) { return c->dropout_on && c->dropout_rate > 0; }
int fl_drops_attn(const fl_model_config *c) { return c->dropout_on && c->attn_dropout_rate > 0; }

void fl_graph_sublayer_out(fl_block_graph *g, const fl_model_config *c, int in, int res, int lin, int role_w,
                           int role_b, int site) {
    static const char *const names[] = {"o", "xo", "", "ffo"};
    int y = res;
    if (fl_drops_hidden(c)) /* the projection's output: TEMP (the backward reads only its gradient) */
        y = fl_graph_slot(g, names[site], g->slot[res].width, FL_GSLOT_TEMP, 0);
    fl_graph_op(g, FL_GOP_LINEAR, in, y, -1, -1, lin, role_w, role_b);
    if (y != res) fl_graph_op(g, FL_GOP_DROPOUT, y, res, -1, -1, site, -1, -1);
}

#define slot fl_graph_slot
#define op fl_graph_op

/* The pre-norm decoder block, by the architecture's flags (fl_arch_info: LLaMA's RMSNorm, RoPE, SwiGLU,
 * GQA; GPT-2's LayerNorm, GELU, biases; OPT's LayerNorm, ReLU, biases):
 *   x -> norm1 -> qkv -> [rope] -> attention -> o -> (+ x) = res_mid
 *     -> norm2 -> fc -> swiglu | gelu | relu -> proj -> (+ res_mid) = out
 * OPT's dropout (a config with dropout_on: its training passes) where OPTDecoderLayer drops: the attention's weights
 * (attention_dropout) and the o and proj outputs before their residual adds (dropout); none otherwise.
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
    op(g, FL_GOP_ATTN, qkv, att, lse, -1, -1, -1, -1)->p = (int8_t)(fl_drops_attn(c) ? FL_DROP_ATTN_W : -1);
    fl_graph_sublayer_out(g, c, att, mid, 1, FL_ROLE_O_W, FL_ROLE_O_B, FL_DROP_ATTN);
    op(g, FL_GOP_ADD, X, mid, -1, -1, -1, -1, -1);
    op(g, FL_GOP_NORM, mid, ln2, ln2m, ln2r, 1, FL_ROLE_LN2_W, FL_ROLE_LN2_B);
    op(g, FL_GOP_LINEAR, ln2, fc, -1, -1, 2, FL_ROLE_FC_W, FL_ROLE_FC_B); /* LLaMA: fused (2F, C) [gate | up] */
    op(g, ai->glu ? FL_GOP_SWIGLU : ai->relu ? FL_GOP_RELU : FL_GOP_GELU, fc, act, -1, -1, -1, -1, -1);
    fl_graph_sublayer_out(g, c, act, OUT, 3, FL_ROLE_PROJ_W, FL_ROLE_PROJ_B, FL_DROP_FFN);
    op(g, FL_GOP_ADD, mid, OUT, -1, -1, -1, -1, -1);
    g->n_norms = 2;
    g->n_linears = 4;
}
#undef slot
#undef op

/* ops that modify their slot in place without reading it as an input of their own (in == out) */
static int modifies(const fl_gop *o) { return fl_gop_modifies(o); }
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
        g->slot[s].srows = s == FL_GSLOT_IN && g->sp > 1; /* sequence parallel: the rank's rows of the stream */
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
        /* sequence parallel: an add joins rows of one kind; attention and RoPE read whole sequences */
        if ((o->kind == FL_GOP_ADD && g->slot[o->in].srows != g->slot[o->out].srows) ||
            ((o->kind == FL_GOP_ATTN || o->kind == FL_GOP_ROPE) && g->slot[o->in].srows))
            return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d mixes the rank's rows of the sequence with whole "
                             "ones ('%s')", i, g->slot[o->in].name);
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
            g->slot[s].srows = o->kind == FL_GOP_SCATTER ? 1 : o->kind == FL_GOP_GATHER ? 0 : g->slot[o->in].srows;
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

fl_status fl_block_graph_build(const fl_model_config *c, fl_block_graph *g) { return fl_block_graph_build_ex(c, 0, g); }

fl_status fl_block_graph_build_ex(const fl_model_config *c, int sp, fl_block_graph *g) {
    memset(g, 0, sizeof *g);
    const fl_arch_info *ai = fl_arch_get(c->arch);
    if (!ai) return fl_errorf(FL_ERR_UNSUPPORTED, "no block graph for architecture %d", (int)c->arch);
    if (ai->block_graph) ai->block_graph(c, g); /* its own block (BERT's post-norm encoder block) */
    else decoder_block(c, g);                  /* the pre-norm decoder block, by the descriptor's feature flags */
    if (c->tp_size > 1 && sp) FL_TRY(fl_block_graph_sp(g, c->tp_size)); /* sequence parallel over the group */
    else if (c->tp_size > 1) FL_TRY(fl_block_graph_tp(g)); /* a tensor-parallel rank's slice (graph_tp.c) */
    return fl_block_graph_finish(g);
}

fl_status fl_stack_graph_build(const fl_model_config *c, int stack, fl_block_graph *g) {
    return fl_stack_graph_build_ex(c, stack, 0, g);
}

fl_status fl_stack_graph_build_ex(const fl_model_config *c, int stack, int sp, fl_block_graph *g) {
    if (stack == 0) return fl_block_graph_build_ex(c, sp, g);
    memset(g, 0, sizeof *g);
    const fl_arch_info *ai = fl_arch_get(c->arch);
    if (!ai || stack != 1 || !ai->block_graph2)
        return fl_errorf(FL_ERR_UNSUPPORTED, "no block graph for stack %d of architecture %d", stack, (int)c->arch);
    ai->block_graph2(c, g);
    if (c->tp_size > 1 && sp) FL_TRY(fl_block_graph_sp(g, c->tp_size)); /* T5's decoder block: sequence parallel */
    else if (c->tp_size > 1) FL_TRY(fl_block_graph_tp(g)); /* T5's decoder block: its slice too (graph_tp.c) */
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
