/* The block graph (see graph.h): the decoder block of LLaMA and GPT-2 described once as a table of
 * ops over activation slots, what is derived from the table (production order, gradient buffers,
 * widths, inference buffers by liveness), and the two executors every pass runs: forward (training,
 * the checkpointed recompute, prefill, decode) and backward. */
#include <string.h>

#include "model-impl.h"

/* ---- building -------------------------------------------------------------------------- */

static int slot(fl_block_graph *g, const char *name, int width, fl_gslot_kind kind, int resid) {
    fl_gslot *s = &g->slot[g->n_slots];
    s->name = name;
    s->width = width;
    s->kind = (uint8_t)kind;
    s->resid = (uint8_t)resid;
    s->grad = kind == FL_GSLOT_STAT ? FL_GBUF_NONE : resid ? FL_GBUF_RES : FL_GBUF_NONE; /* blocks: derive() */
    return g->n_slots++;
}

static void op(fl_block_graph *g, fl_gop_kind kind, int in, int out, int a1, int a2, int p, int role_w, int role_b) {
    fl_gop *o = &g->op[g->n_ops++];
    o->kind = (uint8_t)kind;
    o->in = (int8_t)in;
    o->out = (int8_t)out;
    o->a1 = (int8_t)a1;
    o->a2 = (int8_t)a2;
    o->p = (int8_t)p;
    o->role_w = (int8_t)role_w;
    o->role_b = (int8_t)role_b;
}

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

static int in_place(const fl_gop *o) { return o->kind == FL_GOP_ROPE || o->kind == FL_GOP_ADD; }

/* Everything derived from the table, and the checks that make the derivations valid. */
fl_status fl_block_graph_finish(fl_block_graph *g) {
    int made[FL_GRAPH_MAX_SLOTS] = {0}, used[FL_GRAPH_MAX_SLOTS] = {0};
    int merged[FL_GRAPH_MAX_SLOTS]; /* the residual slot each one was added into (ADD), -1 */
    int def[FL_GRAPH_MAX_SLOTS], last[FL_GRAPH_MAX_SLOTS];
    for (int s = 0; s < g->n_slots; s++) def[s] = last[s] = merged[s] = -1;
    /* production order; each slot made by exactly one op (in-place ops modify, they do not make) */
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (o->in < 0 || o->in >= g->n_slots || o->out < 0 || o->out >= g->n_slots)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d names a slot that does not exist", i);
        if (o->in != FL_GSLOT_IN && !made[o->in])
            return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d reads '%s' before it is made", i, g->slot[o->in].name);
        if (o->kind != FL_GOP_ROPE && o->in != FL_GSLOT_IN) used[o->in]++; /* ROPE modifies, the rest read */
        /* the residual path has one gradient buffer: once a slot is added into the next residual slot, dres
         * holds that one's gradient in the backward, and a later read of the slot would add its gradient
         * there before the ops that read d(next) have run */
        if (merged[o->in] >= 0)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d reads '%s' after it was added into '%s'", i,
                             g->slot[o->in].name, g->slot[merged[o->in]].name);
        if (o->kind == FL_GOP_ADD) merged[o->in] = o->out;
        if (in_place(o) && !made[o->out])
            return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d modifies '%s' before it is made", i, g->slot[o->out].name);
        last[o->in] = i;
        if (in_place(o)) last[o->out] = i;
        const int8_t outs[3] = {in_place(o) ? -1 : o->out, o->a1, o->a2};
        for (int k = 0; k < 3; k++) {
            int s = outs[k];
            if (s < 0) continue;
            if (s == FL_GSLOT_IN || made[s])
                return fl_errorf(FL_ERR_INTERNAL, "block graph: slot '%s' is made twice (op %d)", g->slot[s].name, i);
            made[s] = 1;
            def[s] = last[s] = i;
            if (s != FL_GSLOT_OUT) g->prod[g->n_prod++] = (int8_t)s;
        }
    }
    for (int s = 0; s < g->n_slots; s++) {
        if (s != FL_GSLOT_IN && !made[s])
            return fl_errorf(FL_ERR_INTERNAL, "block graph: no op makes slot '%s'", g->slot[s].name);
        /* an off-path activation nobody reads has no gradient for its producer's backward */
        if (g->slot[s].kind == FL_GSLOT_WIDE && !g->slot[s].resid && used[s] == 0)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: '%s' is made but no op reads it", g->slot[s].name);
    }
    /* gradient buffers, ops in reverse: the residual path accumulates in RES. An off-path slot's gradient
     * takes the lowest free buffer at its first contribution (its last reader in forward order), stays
     * there while its other readers add to it, and frees the buffer once its producer's backward has
     * read it: a chain alternates 1 and 2, as the hand-written passes did */
    int8_t holder[FL_GRAPH_MAX_GBUF]; /* the slot whose gradient each buffer holds, -1 free */
    memset(holder, -1, sizeof holder);
    g->n_gbuf = FL_N_GBUF;
    for (int i = g->n_ops - 1; i >= 0; i--) {
        fl_gop *o = &g->op[i];
        fl_gslot *si = &g->slot[o->in], *so = &g->slot[o->out];
        o->acc = si->resid;
        if (o->kind == FL_GOP_ADD) {
            if (!si->resid || !so->resid)
                return fl_errorf(FL_ERR_INTERNAL, "block graph: op %d adds '%s' off the residual path", i, si->name);
            continue;
        }
        if (so->grad == FL_GBUF_NONE)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: the backward reaches op %d before d('%s')", i, so->name);
        if (o->kind == FL_GOP_ROPE) continue; /* in place: in == out */
        if (!si->resid) {
            if (si->grad != FL_GBUF_NONE) {
                o->acc = 1; /* a later reader already started d(in): add to it */
            } else {
                int b = 1;
                while (b < FL_GRAPH_MAX_GBUF && holder[b] >= 0) b++;
                if (b == FL_GRAPH_MAX_GBUF)
                    return fl_errorf(FL_ERR_INTERNAL, "block graph: d('%s') needs more than %d gradient buffers",
                                     si->name, FL_GRAPH_MAX_GBUF - 1);
                si->grad = (int8_t)b;
                holder[b] = o->in;
                if (b + 1 > g->n_gbuf) g->n_gbuf = b + 1;
            }
        }
        /* the op that makes its output has read d(out) for the last time */
        if (!so->resid && def[o->out] == i && holder[so->grad] == o->out) holder[so->grad] = -1;
    }
    for (int s = 0; s < g->n_slots; s++)
        if (g->slot[s].grad > FL_GBUF_NONE && g->gbuf_width[g->slot[s].grad] < g->slot[s].width)
            g->gbuf_width[g->slot[s].grad] = g->slot[s].width;
    for (int i = 0; i < g->n_ops; i++)
        if (g->op[i].kind == FL_GOP_LINEAR) {
            if (g->slot[g->op[i].in].width > g->lin_in_max) g->lin_in_max = g->slot[g->op[i].in].width;
            if (g->slot[g->op[i].out].width > g->lin_out_max) g->lin_out_max = g->slot[g->op[i].out].width;
        }
    /* inference buffers by liveness: IN and OUT share buffer 0 (the input is dead before the output is
     * made in a pre-norm block; prefill and decode then run the blocks in place); the others take, in
     * production order, the free buffer that fits best (else the widest free one, widened; else a new one) */
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

fl_status fl_block_graph_build(const fl_model_config *c, fl_block_graph *g) {
    memset(g, 0, sizeof *g);
    if (!fl_arch_get(c->arch)) return fl_errorf(FL_ERR_UNSUPPORTED, "no block graph for architecture %d", (int)c->arch);
    decoder_block(c, g); /* every architecture so far: the pre-norm decoder block, by its feature flags */
    return fl_block_graph_finish(g);
}

static size_t al16(size_t n) { return (n + 15) / 16 * 16; } /* 64-byte aligned views */

size_t fl_block_rows_scratch(const fl_block_graph *g, int n, float *base, float **s) {
    size_t off[FL_GRAPH_MAX_SLOTS], tot = 0;
    for (int b = 0; b < g->n_ibuf; b++) {
        off[b] = tot;
        tot += al16((size_t)n * g->ibuf_width[b]);
    }
    if (base && s)
        for (int k = 0; k < g->n_slots; k++) s[k] = base + off[g->ibuf_of[k]];
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

/* Slot k holds its final values once op i has read it: no later op writes it (an output, or
 * RoPE's in-place rotation). */
static int final_after(const fl_block_graph *g, int i, int k) {
    for (int j = i + 1; j < g->n_ops; j++)
        if (g->op[j].out == k || (g->op[j].kind == FL_GOP_ROPE && g->op[j].in == k)) return 0;
    return 1;
}

fl_status fl_block_forward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                           const fl_block_ctx *x) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    const int N = x->B * x->T;
#define S(k) ((k) >= 0 ? s[k] : NULL)
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        float *in = s[o->in], *out = s[o->out];
        const size_t wi = (size_t)g->slot[o->in].width, wo = (size_t)g->slot[o->out].width;
        switch ((fl_gop_kind)o->kind) {
        case FL_GOP_NORM: fl_norm_forward(m, out, S(o->a1), S(o->a2), in, bp->norm_w[o->p], bp->norm_b[o->p], N); break;
        case FL_GOP_LINEAR: { // (N, wo)
            const fl_linear *lin = &bp->lin[o->p];
            void *in16 = x->s16 && x->narrowed && lin->n_q4 == 0 && lin->wc && lin->wct == FL_BF16 &&
                                 final_after(g, i, o->in)
                             ? x->s16[o->in]
                             : NULL;
            if (in16) { /* the saved copy, rounded now, is the GEMM's bf16 operand */
                FL_TRY(be->convert(be, in16, FL_BF16, in, FL_F32, (size_t)N * wi));
                *x->narrowed |= 1u << o->in;
            }
            FL_TRY(fl_linear_forward_ex(be, out, in, in16, lin, N));
            break;
        }
        case FL_GOP_ROPE: rope(m, in, 0, x, wi); break;
        case FL_GOP_ATTN:
            if (x->kv) FL_TRY(kv_append(m, in, x));
            if (x->kv && x->T == 1) {
                fl_kv_cache *kv = x->kv;
                be->attention_decode(be, out, in, kv->k + fl_kv_cache_index(kv, x->layer, 0, 0),
                                     kv->v + fl_kv_cache_index(kv, x->layer, 0, 0), x->pos0 + 1, d.NH, d.NKV, d.HD,
                                     (size_t)kv->max_T * d.HD);
            } else {
                FL_TRY(fl_attention_qkv_forward(be, out, S(o->a1), in, x->B, x->T, d.NH, d.NKV, d.HD)); // (N, QD)
            }
            break;
        case FL_GOP_ADD: be->add(be, out, out, in, (size_t)N * wo); break;
        case FL_GOP_SWIGLU: be->swiglu_forward(be, out, in, N, (int)wo); break;
        case FL_GOP_GELU: be->gelu_forward(be, out, in, (size_t)N * wi); break;
        case FL_GOP_RELU: be->relu_forward(be, out, in, (size_t)N * wi); break;
        }
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
    fl_dims d = fl_model_dims(&m->cfg);
    const int N = x->B * x->T;
    const unsigned need = x->no_din ? grads_needed(g, bp) : ~0u;
#define S(k) ((k) >= 0 ? s[k] : NULL)
    for (int i = g->n_ops - 1; i >= 0; i--) {
        const fl_gop *o = &g->op[i];
        const fl_gslot *si = &g->slot[o->in], *so = &g->slot[o->out];
        if (o->kind == FL_GOP_ADD) continue; /* both sides on the residual path: d(in) += d(out) is the identity */
        /* nothing reads d(in): only an op that trains runs (a LINEAR without its dx) */
        const int need_in = need >> o->in & 1u;
        if (!need_in && !op_trains(bp, o)) continue;
        float *din = need_in || o->kind != FL_GOP_LINEAR ? gb[si->grad] : NULL, *dout = gb[so->grad];
        const size_t wi = (size_t)si->width, wo = (size_t)so->width;
        /* ops whose backward accumulates into d(in): a gradient not started yet starts from zero (a
         * LINEAR overwrites it instead; o->acc: the residual path, or another reader's part already there) */
        if (!o->acc && o->kind != FL_GOP_LINEAR && o->kind != FL_GOP_ROPE)
            be->zero(be, din, (size_t)N * wi * sizeof(float));
        switch ((fl_gop_kind)o->kind) {
        case FL_GOP_NORM:
            fl_norm_backward(m, din, bp->d_norm_w[o->p], bp->d_norm_b[o->p], dout, s[o->in], bp->norm_w[o->p], S(o->a1),
                             S(o->a2), N);
            break;
        case FL_GOP_LINEAR:
            FL_TRY(fl_linear_backward_ex(be, din, o->acc, dout, s[o->in], x->s16 ? x->s16[o->in] : NULL,
                                         &bp->lin[o->p], N));
            break;
        case FL_GOP_ROPE: rope(m, din, 1, x, wi); break;
        case FL_GOP_ATTN:
            FL_TRY(fl_attention_qkv_backward(be, din, dout, s[o->in], s[o->out], S(o->a1), x->B, x->T, d.NH, d.NKV, d.HD));
            break;
        case FL_GOP_SWIGLU: be->swiglu_backward(be, din, dout, s[o->in], N, (int)wo); break;
        case FL_GOP_GELU: be->gelu_backward(be, din, dout, s[o->in], (size_t)N * wi); break;
        case FL_GOP_RELU: be->relu_backward(be, din, dout, s[o->in], (size_t)N * wi); break;
        case FL_GOP_ADD: break;
        }
    }
    return FL_OK;
#undef S
}
