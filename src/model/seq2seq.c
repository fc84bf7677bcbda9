/* The model graph interpreted over several stacks (graph.h fl_model_graph): an encoder-decoder's training passes.
 * Each stack is its ops in order (EMBED, RELBIAS, BLOCKS, NORM, then OUTPUT: the stream the next stack's blocks
 * read as their XSTREAM slot, or HEAD_LM: the chunked head and cross-entropy); the backward runs the stacks in
 * reverse, the last stack's cross-attention gradients accumulating into d(the earlier stack's output), which then
 * starts that stack's backward. The blocks are the block graph's executors (graph.c), one graph per stack.
 * Written as the interpreter the decoder-only passes (transformer.c) are to be folded into (issue 29): nothing here
 * knows T5 but the relative position buckets (T5's, the only RELBIAS there is).
 *
 * The arena: per stack its residual stream (L + 1 views of B x T rows), every block's saved slots (an XSTREAM's
 * and what is computed from it alone, B x Tk rows: the earlier stack's), its final norm's output and statistics
 * (ACTS); the relative bias (NH, T, T), its gradient and bucket indices, the ids, the key padding mask, d(stream)
 * of the earlier stack, the backward's gradient buffers (rows B x max(T) of the stacks), one logits chunk and the
 * per-token losses (WORKSPACE). Activation checkpointing: one block's slots per stack, shared by its blocks and
 * recomputed in the backward; the bf16 policies without checkpointing: the WIDE slots saved in bf16 (one fp32 buffer
 * of them per stack, the block being computed). Sharded stores (FSDP / ZeRO-3): each layout group gathered around
 * its use. What is not done is refused by name. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model-impl.h"
#include "store.h"
#include "fitllm/comm.h"
#include "fitllm/generate.h"

typedef struct {
    fl_block_graph g;
    int L, l0;            /* blocks; the first one's index among all the model's blocks (layout group l0 + 1) */
    int Tmax;             /* rows per sequence the arena holds */
    int xslot;            /* the XSTREAM slot of its blocks (the earlier stack's output), -1 */
    float **res;          /* L + 1 views (B Tmax, C) */
    fl_layer_acts *layer; /* L */
    float *nout, *nrstd;  /* the final norm's output (B Tmax, C) and rstd (B Tmax) */
    float *bias, *dbias;  /* (NH, T, T) relative position bias and its gradient */
    int32_t *buckets;     /* (T, T) bucket of each (query, key) (device memory) */
    int32_t *ids;         /* (B T) (device memory) */
} s2s_stack;

struct fl_s2s_acts {
    int B, n_stacks;      /* the arena's sequences; the stacks */
    fl_dtype act16;       /* the WIDE slots saved in this 16-bit dtype (a bf16 policy without checkpointing), else 0 */
    int Bp;               /* the last forward's sequences (<= B) */
    s2s_stack st[FL_MODEL_GRAPH_MAX_STACKS];
    int T[FL_MODEL_GRAPH_MAX_STACKS]; /* the last forward's rows per sequence */
    uint8_t *kmask;       /* (B, T[0]) the first stack's key padding mask (device memory) */
    int kmask_on;
    float *dstream;       /* (B T[0], C) d(the first stack's output) */
    float *gb[FL_GRAPH_MAX_GBUF]; /* the backward's gradient buffers, B x max Tmax rows; gb[1] also d(final norm out) */
    float *logits, *losses;
    void *be_scratch;     /* the backend's op scratch (bf16 matmuls, 4-bit weights), lent for each pass, or NULL */
    int32_t *targets;     /* device copy when the backend's memory is not host memory, else NULL */
    int chunk;            /* logits rows per chunk */
    float drop_p;         /* the last forward's dropout rate: cfg.dropout_rate in a training forward with cfg.dropout_on,
                           * else 0 (its backward regenerates the same masks from the model's drop_seed) */
    /* the training forward in progress between fl_model_forward_s2s_body and fl_model_forward_head: the last stack
     * stopped at its HEAD_LM op (defer set by the body), the head's targets, grad_scale and rows */
    struct { const int32_t *targets; float grad_scale; int N, defer, open; } head;
};

void fl_s2s_acts_free(struct fl_s2s_acts *s) {
    if (!s) return;
    for (int k = 0; k < FL_MODEL_GRAPH_MAX_STACKS; k++) free(s->st[k].res), free(s->st[k].layer);
    free(s);
}

/* ---- the arena ---------------------------------------------------------------------------- */

typedef struct {
    char *base;
    size_t off;
} carver;

static void *take(carver *cv, size_t bytes) {
    void *p = cv->base ? (void *)(cv->base + cv->off) : NULL;
    cv->off += (bytes + 63) / 64 * 64;
    return p;
}
#define TAKEF(cv, n) ((float *)take((cv), (size_t)(n) * sizeof(float)))

/* Rows of slot k of stack s's blocks per sequence: its own T, or the earlier stack's for an XSTREAM and what is
 * computed from it alone. */
static int slot_T(const struct fl_s2s_acts *a, int s, int k, const int *T) {
    return a->st[s].g.slot[k].xrows && s > 0 ? T[s - 1] : T[s];
}

/* ACTS: every stack's residual stream, saved slots and final norm (base NULL: count only). */
static size_t carve_acts(const fl_model *m, struct fl_s2s_acts *a, char *base) {
    carver cv = {base, 0};
    const size_t C = (size_t)m->cfg.dim, B = (size_t)a->B;
    int T[FL_MODEL_GRAPH_MAX_STACKS];
    for (int s = 0; s < a->n_stacks; s++) T[s] = a->st[s].Tmax;
    for (int s = 0; s < a->n_stacks; s++) {
        s2s_stack *st = &a->st[s];
        const size_t N = B * (size_t)st->Tmax;
        for (int l = 0; l <= st->L; l++) {
            float *r = TAKEF(&cv, N * C);
            if (base) st->res[l] = r;
        }
        /* activation checkpointing: one block's slots shared by the stack's blocks (recomputed in the backward).
         * 16-bit saved (a->act16): one fp32 buffer of the WIDE slots shared by the stack's blocks (the block being
         * computed; the backward widens into it), every block's STAT slots in fp32 and WIDE slots in 16 bits */
        fl_layer_acts la, sh;
        memset(&sh, 0, sizeof sh);
        for (int k = 0; a->act16 && st->L > 0 && k < st->g.n_prod; k++) {
            const int sl = st->g.prod[k];
            if (st->g.slot[sl].kind == FL_GSLOT_WIDE)
                sh.s[sl] = TAKEF(&cv, B * (size_t)slot_T(a, s, sl, T) * (size_t)st->g.slot[sl].width);
        }
        for (int l = 0; l < st->L; l++) {
            if (l == 0 || !m->act_ckpt) {
                la = sh;
                for (int k = 0; k < st->g.n_prod; k++) {
                    const int sl = st->g.prod[k];
                    const size_t n = B * (size_t)slot_T(a, s, sl, T) * (size_t)st->g.slot[sl].width;
                    if (st->g.slot[sl].kind == FL_GSLOT_TEMP) continue; /* not saved: WORKSPACE's (carve_work) */
                    if (a->act16 && st->g.slot[sl].kind == FL_GSLOT_WIDE) la.s16[sl] = take(&cv, n * sizeof(uint16_t));
                    else la.s[sl] = TAKEF(&cv, n);
                }
            }
            if (!base) continue;
            la.s[FL_GSLOT_IN] = st->res[l];
            la.s[FL_GSLOT_OUT] = st->res[l + 1];
            st->layer[l] = la;
        }
        float *no = TAKEF(&cv, N * C), *nr = TAKEF(&cv, N);
        if (base) st->nout = no, st->nrstd = nr;
    }
    /* the later stacks' blocks read the earlier stack's output */
    for (int s = 1; base && s < a->n_stacks; s++)
        for (int l = 0; a->st[s].xslot >= 0 && l < a->st[s].L; l++) a->st[s].layer[l].s[a->st[s].xslot] = a->st[s - 1].nout;
    return cv.off;
}

/* WORKSPACE: relative biases, buckets, ids, mask, d(stream), gradient buffers, logits chunk, losses, targets. */
static size_t carve_work(const fl_model *m, struct fl_s2s_acts *a, char *base) {
    carver cv = {base, 0};
    const size_t C = (size_t)m->cfg.dim, B = (size_t)a->B, NH = (size_t)m->cfg.n_heads;
    int Tx = 0, width[FL_GRAPH_MAX_GBUF] = {0}, ngb = FL_N_GBUF;
    for (int s = 0; s < a->n_stacks; s++) {
        s2s_stack *st = &a->st[s];
        const size_t T = (size_t)st->Tmax;
        float *bi = TAKEF(&cv, NH * T * T), *db = TAKEF(&cv, NH * T * T);
        int32_t *bk = take(&cv, T * T * sizeof(int32_t)), *ids = take(&cv, B * T * sizeof(int32_t));
        if (base) st->bias = bi, st->dbias = db, st->buckets = bk, st->ids = ids;
        if (st->Tmax > Tx) Tx = st->Tmax;
        if (st->g.n_gbuf > ngb) ngb = st->g.n_gbuf;
        for (int k = 0; k < st->g.n_gbuf; k++)
            if (st->g.gbuf_width[k] > width[k]) width[k] = st->g.gbuf_width[k];
    }
    /* the blocks' TEMP slots (a dropped projection's output, read by the next op only): one buffer for all */
    size_t tmp_n = 0;
    for (int s = 0; s < a->n_stacks; s++)
        for (int k = 0; k < a->st[s].g.n_slots; k++)
            if (a->st[s].g.slot[k].kind == FL_GSLOT_TEMP && B * a->st[s].Tmax * a->st[s].g.slot[k].width > tmp_n)
                tmp_n = B * a->st[s].Tmax * a->st[s].g.slot[k].width;
    float *tmp = tmp_n ? TAKEF(&cv, tmp_n) : NULL;
    for (int s = 0; base && s < a->n_stacks; s++)
        for (int k = 0; k < a->st[s].g.n_slots; k++)
            for (int l = 0; a->st[s].g.slot[k].kind == FL_GSLOT_TEMP && l < a->st[s].L; l++)
                a->st[s].layer[l].s[k] = tmp;
    const size_t T0 = (size_t)a->st[0].Tmax, Tl = (size_t)a->st[a->n_stacks - 1].Tmax;
    uint8_t *km = take(&cv, B * T0);
    float *ds = TAKEF(&cv, B * T0 * C);
    for (int k = 0; k < ngb; k++) { /* dres and buf1 (d(final norm out)) at least C wide */
        float *g = TAKEF(&cv, B * (size_t)Tx * (size_t)(k < 2 && width[k] < (int)C ? (int)C : width[k]));
        if (base) a->gb[k] = g;
    }
    a->chunk = fl_logits_chunk_rows(m->cfg.vocab_size, (int)(B * Tl)); /* one process's chunks; the rank's columns */
    float *lg = TAKEF(&cv, (size_t)a->chunk * fl_config_vocab_rows(&m->cfg, NULL)), *ls = TAKEF(&cv, B * Tl);
    int32_t *tg = fl_backend_host_memory(m->be) ? NULL : take(&cv, B * Tl * sizeof(int32_t));
    const size_t bes = fl_model_backend_scratch(m->prec.name ? m->prec.compute_dtype : FL_F32, fl_model_quant4(m),
                                                m->be->scratch_bytes);
    void *sc = bes ? take(&cv, bes) : NULL;
    if (base) a->kmask = km, a->dstream = ds, a->logits = lg, a->losses = ls, a->targets = tg, a->be_scratch = sc;
    return cv.off;
}

static const fl_model_kind s2s_kind; /* the passes it installs (below) */

fl_status fl_model_alloc_acts_s2s(fl_model *m, int B, int Ts, int Tt) {
    if (!fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_INVALID, "fl_model_alloc_acts_s2s: %s has one stack (fl_model_alloc_acts)",
                         fl_arch_get(m->cfg.arch)->display);
    if (B <= 0 || Ts <= 0 || Tt <= 0)
        return fl_errorf(FL_ERR_INVALID, "micro-batch must be positive (B=%d, source %d, target %d)", B, Ts, Tt);
    fl_model_free_acts(m);
    fl_acts *acts = calloc(1, sizeof *acts);
    struct fl_s2s_acts *a = calloc(1, sizeof *a);
    if (!acts || !a) {
        free(acts), free(a);
        return fl_errorf(FL_ERR_OOM, "activation views: out of host memory");
    }
    acts->s2s = a;
    acts->kind = &s2s_kind;
    /* the bf16 policies save the blocks' WIDE slots in bf16 (not with checkpointing, which saves the stream only) */
    const fl_dtype adt = m->prec.name ? m->prec.act_dtype : FL_F32;
    a->act16 = adt != FL_F32 && !m->act_ckpt ? adt : (fl_dtype)0;
    acts->act_dtype = a->act16 ? adt : FL_F32;
    m->acts = acts;
    m->act_dtype = acts->act_dtype;
    a->B = B;
    fl_model_graph mg;
    fl_status s = fl_model_graph_build(&m->cfg, &mg);
    a->n_stacks = mg.n_stacks;
    const int Ls[2] = {m->cfg.n_layers, m->cfg.n_dec_layers}, Tm[2] = {Ts, Tt};
    for (int k = 0; s == FL_OK && k < a->n_stacks; k++) {
        s2s_stack *st = &a->st[k];
        s = fl_stack_graph_build(&m->cfg, k, &st->g);
        st->L = Ls[k];
        st->l0 = k ? Ls[0] : 0;
        st->Tmax = Tm[k];
        st->xslot = -1;
        for (int j = 0; j < st->g.n_slots; j++)
            if (st->g.slot[j].kind == FL_GSLOT_XSTREAM) st->xslot = j;
        st->res = calloc((size_t)st->L + 1, sizeof *st->res);
        st->layer = calloc((size_t)st->L, sizeof *st->layer);
        if (s == FL_OK && (!st->res || !st->layer)) s = fl_errorf(FL_ERR_OOM, "activation views: out of host memory");
    }
    if (s != FL_OK) {
        fl_model_free_acts(m);
        return s;
    }
    memset(&m->sizes, 0, sizeof m->sizes);
    m->sizes.acts_bytes = carve_acts(m, a, NULL);
    m->sizes.workspace_bytes = carve_work(m, a, NULL);
    m->sizes.logits_chunk_rows = a->chunk;
    s = fl_mem_alloc(m->pool, FL_TAG_ACTS, m->sizes.acts_bytes, (void **)&m->acts_arena);
    if (s == FL_OK) s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, m->sizes.workspace_bytes, (void **)&m->work_arena);
    if (s != FL_OK) {
        fl_model_free_acts(m);
        return fl_error_prefix(s, "allocating activations for B=%d, source %d, target %d", B, Ts, Tt);
    }
    carve_acts(m, a, (char *)m->acts_arena);
    carve_work(m, a, (char *)m->work_arena);
    m->B = B;
    m->T = Tt > Ts ? Tt : Ts;
    /* the adapters' activations: rows of the longer stack (a cross k|v adapter sees the source's) */
    s = m->adapt && m->adapt->h.alloc_acts ? m->adapt->h.alloc_acts(m, B, m->T) : FL_OK;
    if (s != FL_OK) {
        fl_model_free_acts(m);
        return fl_error_prefix(s, "allocating the adapters' activations");
    }
    return FL_OK;
}

/* Live bytes after the last pass (fl_model_kind.live_bytes of an encoder-decoder), counted at that pass's (B, T) of each
 * stack without the arena's alignment. After a training forward (train): what the backward reads. ACTS: every
 * stack's residual stream (L + 1 views: the blocks' inputs, the final norm's), its blocks' saved slots (under
 * checkpointing the last block's, which the backward reuses without recomputing them), its final norm's rstd and,
 * where a later stack reads it (the encoder's output: the cross-attention's k|v), that norm's output. WORKSPACE:
 * every stack's relative bias (the attention backward re-forms its probabilities with it), bucket indices (the
 * table's gradient) and ids (the embedding's), the key padding mask, and d(the last norm's output) the head left
 * in gb[1]. Otherwise nothing: there are no constant tables (the bias is rebuilt by every forward). */
static void s2s_live_bytes(const fl_model *m, int train, size_t *acts, size_t *work) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    const size_t C = (size_t)m->cfg.dim, B = (size_t)a->Bp, NH = (size_t)m->cfg.n_heads, f = sizeof(float);
    size_t ac = 0, wk = 0;
    for (int s = 0; train && s < a->n_stacks; s++) {
        const s2s_stack *st = &a->st[s];
        const size_t T = (size_t)a->T[s], N = B * T;
        size_t blk = 0, blk16 = 0; /* a block's saved fp32 elements, 16-bit ones */
        for (int k = 0; k < st->g.n_prod; k++) {
            const int sl = st->g.prod[k];
            const size_t n = B * (size_t)slot_T(a, s, sl, a->T) * (size_t)st->g.slot[sl].width;
            if (st->g.slot[sl].kind == FL_GSLOT_TEMP) continue; /* the backward does not read it */
            if (a->act16 && st->g.slot[sl].kind == FL_GSLOT_WIDE) blk16 += n;
            else blk += n;
        }
        const size_t nb = st->L > 0 ? (m->act_ckpt ? 1 : (size_t)st->L) : 0;
        ac += (((size_t)st->L + 1) * N * C + nb * blk + N) * f + nb * blk16 * sizeof(uint16_t);
        if (s + 1 < a->n_stacks && a->st[s + 1].xslot >= 0) ac += N * C * f;
        wk += NH * T * T * f + T * T * sizeof(int32_t) + N * sizeof(int32_t);
    }
    if (train) wk += (a->kmask_on ? B * (size_t)a->T[0] : 0) + B * (size_t)a->T[a->n_stacks - 1] * C * f;
    *acts = ac;
    *work = wk;
}

/* The rows an adapter on the LINEAR at param_index of block `layer` saves in a training forward (its h and, with
 * dropout, its dropped input; fl_model_kind.adapter_live_rows): the source's in the encoder and for the cross-attention's
 * k|v (it reads the encoder output), the target's elsewhere; under checkpointing only the last block of each
 * stack's (the others are recomputed before their backward reads them). */
static size_t s2s_adapter_live_rows(const fl_model *m, int layer, int param_index) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    const int Le = a->st[0].L, Lall = Le + (a->n_stacks > 1 ? a->st[1].L : 0);
    if (m->act_ckpt && layer != Le - 1 && layer != Lall - 1) return 0;
    int p = param_index; /* k, v of a fused run carry no role: the run's first entry has it */
    while (p > 0 && m->layout.params[p].role == FL_ROLE_NONE) p--;
    const int src_rows = layer < Le || m->layout.params[p].role == FL_ROLE_XKV_W;
    return (size_t)a->Bp * (size_t)a->T[src_rows ? 0 : a->n_stacks - 1];
}

/* ---- relative position bias (T5) ------------------------------------------------------------- */

/* transformers' T5Attention._relative_position_bucket for key j and query i, in its float32 arithmetic:
 * bidirectional (the encoder) halves the buckets between keys after and before the query; causal (the decoder)
 * sees only keys before it. Small distances get a bucket each, larger ones logarithmic bins up to max_dist. */
static int32_t rel_bucket(int i, int j, int bidir, int buckets, int max_dist) {
    int rel = j - i, ret = 0, nb = buckets, n;
    if (bidir) {
        nb /= 2;
        ret = rel > 0 ? nb : 0;
        n = rel < 0 ? -rel : rel;
    } else {
        n = rel < 0 ? -rel : 0;
    }
    const int me = nb / 2;
    if (n < me) return ret + n;
    const float lg = logf((float)n / (float)me) / (float)log((double)max_dist / me) * (float)(nb - me);
    int v = me + (int)lg;
    return ret + (v < nb - 1 ? v : nb - 1);
}

static fl_status relbias_table(const fl_model *m, const s2s_stack *st, int grad, float **tab);

/* bias (NH, T, T) = table (NH, buckets) at each (query, key)'s bucket: one embedding lookup of width 1 per head */
static fl_status relbias_forward(fl_model *m, s2s_stack *st, int T, int bidir) {
    const fl_backend *be = m->be;
    const int nb = m->cfg.rel_buckets, NH = m->cfg.n_heads;
    int32_t *bk = malloc((size_t)T * T * sizeof *bk);
    if (!bk) return fl_errorf(FL_ERR_OOM, "relative position buckets: out of host memory");
    for (int i = 0; i < T; i++)
        for (int j = 0; j < T; j++) bk[(size_t)i * T + j] = rel_bucket(i, j, bidir, nb, m->cfg.rel_max_dist);
    fl_status s = FL_RUN(be, to_device, st->buckets, bk, (size_t)T * T * sizeof *bk);
    free(bk);
    FL_TRY(s);
    float *tab;
    FL_TRY(relbias_table(m, st, 0, &tab));
    for (int h = 0; h < NH; h++)
        FL_RUN(be, embedding_forward, st->bias + (size_t)h * T * T, st->buckets, tab + (size_t)h * nb, NULL, 1, T * T,
               1);
    return FL_OK;
}

static void relbias_backward(fl_model *m, s2s_stack *st, int T) {
    float *dtab = NULL;
    if (relbias_table(m, st, 1, &dtab) != FL_OK || !dtab) return; /* the base is frozen (LoRA) */
    const int nb = m->cfg.rel_buckets;
    for (int h = 0; h < m->cfg.n_heads; h++)
        FL_RUN(m->be, embedding_backward, dtab + (size_t)h * nb, NULL, st->dbias + (size_t)h * T * T, st->buckets, 1,
               T * T, 1);
}

/* ---- rows from the caller (fl_model.emb_inject: BLIP-2's queries) ----------------------------------- */

static fl_status inject_rows(fl_model *m, float *res0, float *dres0) {
    const fl_backend *be = m->be;
    const size_t C = (size_t)m->cfg.dim;
    for (int i = 0; i < m->emb_inject.n; i++) {
        float *r = (dres0 ? dres0 : res0) + (size_t)m->emb_inject.rows[i] * C;
        if (!dres0) {
            FL_TRY(FL_RUN(be, copy, r, m->emb_inject.src + i * C, C * sizeof(float)));
            continue;
        }
        FL_TRY(FL_RUN(be, copy, m->emb_inject.dsrc + i * C, r, C * sizeof(float)));
        FL_RUN(be, zero, r, C * sizeof(float));
    }
    return FL_OK;
}

/* ---- the passes --------------------------------------------------------------------------- */

/* entry (g, role)'s fp32 parameter or gradient. 16-bit storage: the parameter widened into the store's pstage at
 * `at` (overwritten by the next binding there: bind right before use), the gradient in the open stage of its group
 * (fl_store_stage_begin / _flush around its writer); NULL without gradients (LoRA's frozen base) */
static float *param_at(const fl_model *m, int g, int role, int grad, size_t at) {
    const int i = role < 0 ? -1 : fl_layout_role(&m->layout, g, (fl_param_role)role);
    if (i < 0) return NULL;
    const fl_param_store *st = m->store;
    if (grad) { /* fp32: in place (sharded: the gathered group's gradient view); 16-bit: the group's stage */
        if (st->dtype != FL_F32) return st->g16 ? fl_store_grad(st, m->layout.params[i].offset) : NULL;
        return fl_model_grads_f32(m) ? fl_store_grad(st, m->layout.params[i].offset) : NULL;
    }
    if (st->dtype == FL_F32) return fl_store_param_at(st, fl_model_store_off(m, i));
    float *cur = st->pstage + at;
    return (float *)fl_store_bind_1d(st, i, &cur);
}

static float *param_of(const fl_model *m, int g, int role, int grad) { return param_at(m, g, role, grad, 0); }

/* The parameter store around each layout group (store.h; no-ops for a whole store), as transformer.c's: FSDP /
 * ZeRO-3 units are the layout groups, a block of either stack each; the root units, the shared embedding (group 0)
 * and the final norms with the head (group G), stay gathered for the whole pass (PyTorch keeps its root unit, which
 * both stacks and the tied head read); a block is gathered around its forward and again around its backward (the
 * next one's gather posted ahead, across the stacks too), its gradient reduced when its backward ends. */
static fl_status roots_gather(fl_model *m) {
    const int G = m->layout.n_groups - 1;
    FL_TRY(fl_store_gather(m->store, 0, G));
    return fl_store_gather(m->store, G, G > 1 ? 1 : -1);
}
static void roots_release(fl_model *m) {
    fl_store_release(m->store, 0);
    fl_store_release(m->store, m->layout.n_groups - 1);
}
/* block group g (1 .. G-1) in a forward: the next block's gather posted ahead (the decoder's first after the
 * encoder's last) */
static fl_status block_gather(fl_model *m, int g) {
    return fl_store_gather(m->store, g, g + 1 < m->layout.n_groups - 1 ? g + 1 : -1);
}

/* 16-bit storage: stage s's gradients of layout group g in the store's fp32 stage (no-ops with fp32 storage) */
static void stage_open(const fl_model *m, int g) { fl_store_stage_begin(m->store, fl_group_numel(m, g)); }
static fl_status stage_close(const fl_model *m, int g) {
    return fl_store_stage_flush(m->store, m->layout.group_offset[g], fl_group_numel(m, g));
}

/* the stack's relative bias table (NH, buckets) as fp32: 16-bit storage widens it into the pstage's block region
 * (free before the blocks bind theirs) */
static fl_status relbias_table(const fl_model *m, const s2s_stack *st, int grad, float **tab) {
    const int ti = fl_layout_role(&m->layout, st->l0 + 1, FL_ROLE_REL_BIAS);
    if (ti < 0) return fl_errorf(FL_ERR_INTERNAL, "stack of block %d has no relative_attention_bias", st->l0);
    const size_t at = fl_pstage_block_start(m);
    if (!grad && m->store->dtype != FL_F32 && at + m->layout.params[ti].numel > m->store->pstage_n)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s (%zu values) does not fit the 16-bit storage's staging of a block's "
                         "1-D parameters (%zu)", m->layout.params[ti].name, m->layout.params[ti].numel,
                         m->store->pstage_n - at);
    *tab = param_at(m, st->l0 + 1, FL_ROLE_REL_BIAS, grad, at);
    return FL_OK;
}

/* Dropout seeds (fl_dropout_seed of the micro-batch's drop_seed): stack s's embedding 2s, its final norm's output
 * 2s + 1, block b of either stack (its index among all the model's blocks) 16 + b (its sites within it) */
static uint64_t drop_site(const fl_model *m, int site) { return fl_dropout_seed(m->drop_seed, (uint64_t)site); }

/* the dropout of a stack's embedding (site 2s) or final norm output (2s + 1) over n values: in a training forward
 * and, for the gradient, in its backward (the same mask); nothing without dropout */
static fl_status drop_rows(const fl_model *m, float *x, size_t n, int site) {
    const float p = m->acts->s2s->drop_p;
    return p > 0 ? FL_RUN(m->be, dropout, x, x, n, p, drop_site(m, site), 0) : FL_OK;
}

static fl_block_ctx stack_ctx(const fl_model *m, const struct fl_s2s_acts *a, int s, int l, float *const *dxs) {
    fl_block_ctx x = {.B = a->Bp, .T = a->T[s], .drop_p = a->drop_p, .comm = m->tp_comm}; /* TP: the blocks' sums */
    x.drop_seed = drop_site(m, 16 + a->st[s].l0 + l);
    x.kmask = a->kmask_on ? a->kmask : NULL; /* the first stack's keys: its self-attention's and the cross-attention's */
    x.attn_bias = a->st[s].bias;
    x.Tk = s > 0 ? a->T[s - 1] : a->T[s];
    x.dxs = dxs;
    return x;
}

/* 16-bit saved activations: block l of stack st's WIDE slots from the shared fp32 buffer into its 16-bit copies
 * (narrow, after its training forward) or back (before its backward); no-ops otherwise */
static fl_status saved16(const fl_model *m, const s2s_stack *st, int l, int narrow) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    if (!a->act16) return FL_OK;
    const int s = (int)(st - a->st);
    const fl_layer_acts *la = &st->layer[l];
    for (int k = 0; k < st->g.n_prod; k++) {
        const int sl = st->g.prod[k];
        if (st->g.slot[sl].kind != FL_GSLOT_WIDE) continue;
        const size_t n = (size_t)a->Bp * (size_t)slot_T(a, s, sl, a->T) * (size_t)st->g.slot[sl].width;
        if (narrow)
            FL_TRY(FL_RUN(m->be, convert, la->s16[sl], a->act16, la->s[sl], FL_F32, n));
        else
            FL_TRY(FL_RUN(m->be, convert, la->s[sl], FL_F32, la->s16[sl], a->act16, n));
    }
    return FL_OK;
}

static fl_status check_model(const fl_model *m, const char *fn) {
    if (!m->acts || !m->acts->s2s)
        return fl_errorf(FL_ERR_INVALID, "%s: activations not allocated (call fl_model_alloc_acts_s2s)", fn);
    /* fp32 stores (mixed precision's bf16 copy and 4-bit block linears through fl_linear_set_weight) or 16-bit
     * ones (their 1-D parameters and relative bias tables widened into the pstage, each group's gradients staged);
     * sharded ones (FSDP / ZeRO-3, parameter offload) the same around each gathered group */
    const int st16 = m->store && m->store->dtype != FL_F32 && m->store->pstage;
    if (!fl_model_params_f32(m) && !st16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: encoder-decoders run fp32 or 16-bit storage only", fn);
    if (fl_model_adapters_are_merged(m)) /* the adapters are in the weights: running them again would double them */
        return fl_errorf(FL_ERR_INVALID, "%s: the LoRA adapters were merged into the weights; save the model and reload "
                         "it to run it", fn);
    return FL_OK;
}

/* The head and the loss over the last stack's final norm output (scaled by 1/sqrt(C) first where the config says:
 * T5's tied head), chunked over rows; in training its backward too, leaving d(the norm's output) in gb[1]. */
static fl_status head_run(fl_model *m, const int32_t *targets, int N, float grad_scale, float *logits_out) {
    struct fl_s2s_acts *a = m->acts->s2s;
    float *x = a->st[a->n_stacks - 1].nout;
    if (m->cfg.head_scale) FL_RUN(m->be, scale, x, (size_t)N * m->cfg.dim, 1.0f / sqrtf((float)m->cfg.dim));
    const fl_head_bufs h = {x, a->gb[1], a->logits, a->losses, a->targets, a->chunk};
    if (grad_scale > 0 && targets) { /* sharded: the root units' gradient buffers, open until the backward ends */
        FL_TRY(fl_store_grads_begin(m->store, m->layout.n_groups - 1));
        FL_TRY(fl_store_grads_begin(m->store, 0));
    }
    /* 16-bit storage: the head's gradient staged alone, added into its 16-bit gradient after */
    fl_outer_params op;
    fl_get_outer(m, &op);
    const size_t head_n = (size_t)fl_config_vocab_rows(&m->cfg, NULL) * m->cfg.dim; /* TP: the rank's rows */
    const int stage_head = grad_scale > 0 && targets && op.dhead && m->store->g16;
    if (stage_head) fl_store_stage_begin(m->store, head_n);
    FL_TRY(fl_head_loss(m, &h, targets, N, grad_scale, logits_out, &m->loss_sum, &m->n_valid));
    if (stage_head) FL_TRY(fl_store_stage_flush(m->store, op.head_off, head_n));
    return FL_OK;
}

/* Stack s's model-graph ops, forward. */
static fl_status stack_forward(fl_model *m, const fl_model_graph *mg, int s, const int32_t *ids, const int32_t *targets,
                               float grad_scale, float *logits_out) {
    const fl_backend *be = m->be;
    struct fl_s2s_acts *a = m->acts->s2s;
    s2s_stack *st = &a->st[s];
    const int T = a->T[s], N = a->Bp * T, G = m->layout.n_groups - 1;
    fl_outer_params op;
    fl_get_outer(m, &op);
    for (int i = 0; i < mg->n_ops; i++) {
        if (mg->op[i].stack != s) continue;
        switch ((fl_mop_kind)mg->op[i].kind) {
        case FL_MOP_EMBED:
            FL_TRY(FL_RUN(be, to_device, st->ids, ids, (size_t)N * sizeof *ids));
            FL_TRY(fl_embed_forward(m, &op, st->res[0], st->ids, ids, a->Bp, T, 0)); /* TP: summed over the group */
            if (s == 0) FL_TRY(inject_rows(m, st->res[0], NULL));
            FL_TRY(drop_rows(m, st->res[0], (size_t)N * m->cfg.dim, 2 * s)); /* after any injected rows (as HF) */
            break;
        case FL_MOP_RELBIAS: /* the table is in the stack's first block's group */
            FL_TRY(block_gather(m, st->l0 + 1));
            FL_TRY(relbias_forward(m, st, T, s < mg->n_stacks - 1));
            break;
        case FL_MOP_BLOCKS:
            for (int l = 0; l < st->L; l++) {
                FL_TRY(block_gather(m, st->l0 + l + 1));
                fl_block_params bp;
                fl_get_block(m, &st->g, st->l0 + l, &bp);
                fl_block_ctx x = stack_ctx(m, a, s, l, NULL);
                FL_TRY(fl_block_forward(m, &st->g, &bp, st->layer[l].s, &x));
                if (grad_scale > 0) FL_TRY(saved16(m, st, l, 1));
                fl_store_release(m->store, st->l0 + l + 1);
            }
            break;
        case FL_MOP_NORM:
            fl_norm_forward(m, st->nout, NULL, st->nrstd, st->res[st->L], param_of(m, G, mg->op[i].role_w, 0), NULL, N);
            FL_TRY(drop_rows(m, st->nout, (size_t)N * m->cfg.dim, 2 * s + 1));
            break;
        case FL_MOP_OUTPUT: break; /* nout is the next stack's XSTREAM (bound when carved) */
        case FL_MOP_HEAD_LM:
            if (a->head.defer) { /* the step's "head" phase: fl_model_forward_head runs it (s2s_head) */
                a->head.targets = targets, a->head.grad_scale = grad_scale, a->head.N = N, a->head.open = 1;
                break;
            }
            FL_TRY(head_run(m, targets, N, grad_scale, logits_out));
            break;
        default:
            return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_forward_s2s: model graph op %d is not executed in a stack",
                             mg->op[i].kind);
        }
    }
    return FL_OK;
}

/* defer: stop before the head (fl_model_forward_s2s_body; fl_model_forward_head runs it). */
static fl_status s2s_forward(fl_model *m, const int32_t *src_ids, const uint8_t *src_mask, const int32_t *dec_ids,
                             const int32_t *targets, int B, int Ts, int Tt, float grad_scale, float *logits_out,
                             int defer) {
    FL_TRY(check_model(m, "fl_model_forward_s2s"));
    struct fl_s2s_acts *a = m->acts->s2s;
    a->head.open = 0;
    if (B > a->B || Ts > a->st[0].Tmax || Tt > a->st[1].Tmax || B <= 0 || Ts <= 0 || Tt <= 0)
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward_s2s: batch %d x source %d x target %d exceeds the arena's "
                         "(%d x %d x %d)", B, Ts, Tt, a->B, a->st[0].Tmax, a->st[1].Tmax);
    if (grad_scale > 0 && (!targets || (!fl_model_grads_f32(m) && !fl_model_grads_16(m) && !m->adapt)))
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward_s2s: training forward needs targets and gradient buffers");
    const int V = m->cfg.vocab_size;
    const int32_t *ids[2] = {src_ids, dec_ids};
    const int T[2] = {Ts, Tt};
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < B * T[s]; i++)
            if (ids[s][i] < 0 || ids[s][i] >= V)
                return fl_errorf(FL_ERR_INVALID, "%s token id %d at position %d is outside the vocabulary [0, %d)",
                                 s ? "decoder input" : "source", ids[s][i], i, V);
    for (int i = 0; targets && i < B * Tt; i++)
        if (targets[i] != FL_IGNORE_INDEX && (targets[i] < 0 || targets[i] >= V))
            return fl_errorf(FL_ERR_INVALID, "target id %d at position %d is outside the vocabulary [0, %d)", targets[i],
                             i, V);
    fl_model_graph mg;
    FL_TRY(fl_model_graph_build(&m->cfg, &mg));
    /* the arena's views are laid out for its maxima; a smaller pass uses them as contiguous (B, T) rows */
    a->Bp = B;
    a->T[0] = Ts, a->T[1] = Tt;
    a->kmask_on = src_mask != NULL;
    fl_status s = src_mask ? FL_RUN(m->be, to_device, a->kmask, src_mask, (size_t)B * Ts) : FL_OK;
    m->loss_sum = 0;
    m->n_valid = 0;
    m->have_targets = targets != NULL;
    a->head.defer = defer;
    a->drop_p = grad_scale > 0 && m->cfg.dropout_on ? m->cfg.dropout_rate : 0.0f; /* training forwards only */
    if (s == FL_OK) s = roots_gather(m);
    for (int k = 0; s == FL_OK && k < mg.n_stacks; k++)
        s = stack_forward(m, &mg, k, ids[k], targets, grad_scale, logits_out);
    a->head.defer = 0;
    if (s != FL_OK || (grad_scale <= 0 && !defer)) roots_release(m); /* training: kept for the backward */
    if (s != FL_OK) a->head.open = 0;
    m->fwd_B = B;
    m->fwd_T = Tt;
    m->fwd_train = s == FL_OK && grad_scale > 0 && !defer; /* deferred: once its head has run */
    return s;
}

/* Stack s's backward: d(its final norm's output) in dnout, into its parameters' gradients; the cross-attention's
 * into d(the earlier stack's output) (a->dstream, zeroed here). */
static fl_status stack_backward(fl_model *m, const fl_model_graph *mg, int s, float *dnout) {
    const fl_backend *be = m->be;
    struct fl_s2s_acts *a = m->acts->s2s;
    s2s_stack *st = &a->st[s];
    const int T = a->T[s], N = a->Bp * T, C = m->cfg.dim, G = m->layout.n_groups - 1;
    float *dres = a->gb[0];
    int role_norm = -1;
    for (int i = 0; i < mg->n_ops; i++)
        if (mg->op[i].stack == s && mg->op[i].kind == FL_MOP_NORM) role_norm = mg->op[i].role_w;
    FL_RUN(be, zero, dres, (size_t)N * C * sizeof(float));
    FL_TRY(drop_rows(m, dnout, (size_t)N * C, 2 * s + 1)); /* d(the norm's output) through its dropout mask */
    stage_open(m, G);
    fl_norm_backward(m, dres, param_of(m, G, role_norm, 1), NULL, dnout, st->res[st->L], param_of(m, G, role_norm, 0),
                     NULL, st->nrstd, N);
    FL_TRY(stage_close(m, G));
    if (s == 0) fl_store_release(m->store, G);
    /* data parallel: each layout group's gradient handed on as it becomes final (fl_store_grads_ready; its bucket
     * hook): the final norms and head's group once the first stack's norm is done (the stacks run backward in
     * reverse), each block's after its backward (the first block's after the relative bias table it holds), the
     * shared embedding's after the first stack's embedding */
    if (s == 0) FL_TRY(fl_store_grads_ready(m->store, G));
    FL_RUN(be, zero, st->dbias, (size_t)m->cfg.n_heads * T * T * sizeof(float));
    float *dxs[FL_GRAPH_MAX_SLOTS] = {0};
    if (st->xslot >= 0) {
        dxs[st->xslot] = a->dstream;
        FL_RUN(be, zero, a->dstream, (size_t)a->Bp * a->T[s - 1] * C * sizeof(float));
    }
    for (int l = st->L - 1; l >= 0; l--) {
        const int g = st->l0 + l + 1;
        FL_TRY(fl_store_gather(m->store, g, g > 1 ? g - 1 : -1)); /* the block before's gather posted ahead */
        FL_TRY(fl_store_grads_begin(m->store, g));
        fl_block_params bp;
        fl_get_block(m, &st->g, st->l0 + l, &bp);
        fl_block_ctx x = stack_ctx(m, a, s, l, dxs);
        /* checkpointing: the block's slots again from its saved input (the last block's are still there: each stack
         * has its own shared buffer, and the same ops in the same order give the same bits) */
        if (m->act_ckpt && l < st->L - 1) {
            FL_TRY(fl_block_forward(m, &st->g, &bp, st->layer[l].s, &x));
            m->ckpt_recomputed++;
        }
        FL_TRY(saved16(m, st, l, 0));
        x.dattn_bias = st->dbias;
        stage_open(m, st->l0 + l + 1);
        FL_TRY(fl_block_backward(m, &st->g, &bp, st->layer[l].s, a->gb, &x));
        if (l == 0) relbias_backward(m, st, T); /* the first block's group holds the table; dbias is complete */
        FL_TRY(stage_close(m, g));
        fl_store_release(m->store, g);
        FL_TRY(fl_store_grads_ready(m->store, g));
    }
    fl_outer_params op;
    fl_get_outer(m, &op);
    FL_TRY(drop_rows(m, dres, (size_t)N * C, 2 * s)); /* d(the embedding's output) through its dropout mask */
    if (s == 0) FL_TRY(inject_rows(m, NULL, dres));
    FL_TRY(fl_embed_backward(m, &op, dres, st->ids, a->Bp, T));
    if (s == 0) fl_store_release(m->store, 0);
    return s == 0 ? fl_store_grads_ready(m->store, 0) : FL_OK;
}

static fl_status s2s_backward(fl_model *m) {
    FL_TRY(check_model(m, "fl_model_backward_s2s"));
    struct fl_s2s_acts *a = m->acts->s2s;
    if (!m->fwd_train)
        return fl_errorf(FL_ERR_INVALID, "fl_model_backward_s2s: needs a preceding training forward (grad_scale > 0)");
    fl_model_graph mg;
    fl_status s = fl_model_graph_build(&m->cfg, &mg);
    const int last = mg.n_stacks - 1, N = a->Bp * a->T[last];
    m->ckpt_recomputed = 0;
    if (s == FL_OK && m->cfg.head_scale) /* d(norm out) = scale x d(head input) */
        FL_RUN(m->be, scale, a->gb[1], (size_t)N * m->cfg.dim, 1.0f / sqrtf((float)m->cfg.dim));
    /* the last stack from the head's d(its norm's output); each earlier one from d(its output) the later left */
    for (int k = last; s == FL_OK && k >= 0; k--) {
        s = stack_backward(m, &mg, k, k == last ? a->gb[1] : a->dstream);
        /* tensor parallel: d(the earlier stack's output) is each rank's part from its heads' cross k|v: summed over the
         * group once for every block (Megatron's f of the column-parallel k|v linears, graph_tp.c) */
        if (s == FL_OK && k > 0 && a->st[k].xslot >= 0 && m->tp_comm && fl_comm_size(m->tp_comm) > 1)
            s = fl_error_prefix(fl_comm_all_reduce(m->tp_comm, a->dstream, a->dstream,
                                                   (size_t)a->Bp * a->T[k - 1] * m->cfg.dim, FL_F32, FL_COMM_SUM),
                                "tensor parallel: d(the encoder output)");
    }
    m->fwd_train = 0;
    return s;
}

/* ---- greedy decoding ------------------------------------------------------------------------ */

/* The relative bias row of decoder query n-1, (NH, 1, n) in the last stack's bias: the same for every sequence of a
 * batch (the positions are). */
static fl_status decode_bias(fl_model *m, s2s_stack *st, int n) {
    const fl_backend *be = m->be;
    const int NH = m->cfg.n_heads, nb = m->cfg.rel_buckets;
    int32_t *bk = malloc((size_t)n * sizeof *bk);
    if (!bk) return fl_errorf(FL_ERR_OOM, "relative position buckets: out of host memory");
    for (int j = 0; j < n; j++) bk[j] = rel_bucket(n - 1, j, 0, nb, m->cfg.rel_max_dist);
    fl_status rc = FL_RUN(be, to_device, st->buckets, bk, (size_t)n * sizeof *bk);
    free(bk);
    FL_TRY(rc);
    float *tab;
    FL_TRY(block_gather(m, st->l0 + 1));
    FL_TRY(relbias_table(m, st, 0, &tab));
    for (int h = 0; h < NH; h++)
        FL_RUN(be, embedding_forward, st->bias + (size_t)h * n, st->buckets, tab + (size_t)h * nb, NULL, 1, n, 1);
    return FL_OK;
}

/* One decoder token of sequence b of the batch with the cache: row n-1 of that sequence's region of the last stack
 * (b x the arena's target rows on), its blocks' per-row slots viewed at that row (the q|k|v slot's earlier rows are
 * the cache the earlier steps wrote), the encoder's output, its cross k|v (computed at the first step, kept after) and
 * the source mask at the sequence's rows of the (B, Ts) encoder pass; the bias row from decode_bias; the logits of
 * the row into lg (V). With B 1 the regions are the arena's first rows. */
static fl_status decode_step(fl_model *m, const fl_model_graph *mg, int b, const int32_t *tok, int n, float *lg) {
    const fl_backend *be = m->be;
    struct fl_s2s_acts *a = m->acts->s2s;
    const int s = mg->n_stacks - 1, C = m->cfg.dim, Ts = a->T[s - 1];
    s2s_stack *st = &a->st[s];
    const size_t r = (size_t)b * st->Tmax + (size_t)n - 1, xr = (size_t)b * Ts; /* this row; the sequence's source */
    fl_outer_params op;
    fl_get_outer(m, &op);
    FL_TRY(FL_RUN(be, to_device, st->ids + r, tok, sizeof *tok));
    FL_TRY(fl_embed_forward(m, &op, st->res[0] + r * C, st->ids + r, tok, 1, 1, 0));
    for (int l = 0; l < st->L; l++) {
        float *sv[FL_GRAPH_MAX_SLOTS];
        for (int k = 0; k < st->g.n_slots; k++) /* row r of the per-row slots; the sequence's source rows of the rest */
            sv[k] = st->layer[l].s[k] + (st->g.slot[k].xrows ? xr : r) * st->g.slot[k].width;
        FL_TRY(block_gather(m, st->l0 + l + 1));
        fl_block_params bp;
        fl_get_block(m, &st->g, st->l0 + l, &bp);
        fl_block_ctx x = {.B = 1, .T = 1, .attn_bias = st->bias, .Tk = Ts, .kv_rows = n, .xs_ready = n > 1,
                          .comm = m->tp_comm};
        x.kmask = a->kmask_on ? a->kmask + xr : NULL;
        FL_TRY(fl_block_forward(m, &st->g, &bp, sv, &x));
        fl_store_release(m->store, st->l0 + l + 1);
    }
    const int G = m->layout.n_groups - 1;
    int role = -1;
    for (int i = 0; i < mg->n_ops; i++)
        if (mg->op[i].stack == s && mg->op[i].kind == FL_MOP_NORM) role = mg->op[i].role_w;
    float *no = st->nout + r * C;
    fl_norm_forward(m, no, NULL, st->nrstd + r, st->res[st->L] + r * C, param_of(m, G, role, 0), NULL, 1);
    if (m->cfg.head_scale) FL_RUN(be, scale, no, (size_t)C, 1.0f / sqrtf((float)C));
    fl_linear head = {.in = C, .out = fl_config_vocab_rows(&m->cfg, NULL), .w = op.head}; /* TP: the rank's rows */
    fl_linear_set_weight(m, &head, op.head_idx);
    fl_model_bind_adapters(m, -1, 0, &head, 0);
    FL_TRY(fl_linear_forward(be, a->logits, no, &head, 1));
    return fl_head_logits_out(m, lg, a->logits, 1); /* TP: the group's columns gathered */
}

static fl_status check_sources(const fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts,
                               int max_new) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    const int V = m->cfg.vocab_size;
    if (B <= 0 || B > a->B || Ts <= 0 || Ts > a->st[0].Tmax || max_new <= 0 || max_new > a->st[1].Tmax)
        return fl_errorf(FL_ERR_INVALID, "fl_model_generate_s2s: %d source(s) of %d tokens and %d new tokens need an "
                         "arena of batch >= %d, source >= %d and target >= %d (it has %d, %d, %d)", B, Ts, max_new, B,
                         Ts, max_new, a->B, a->st[0].Tmax, a->st[1].Tmax);
    for (int i = 0; i < B * Ts; i++)
        if (src[i] < 0 || src[i] >= V)
            return fl_errorf(FL_ERR_INVALID, "source token id %d at position %d (of source %d) is outside the "
                             "vocabulary [0, %d)", src[i], i % Ts, i / Ts, V);
    for (int b = 0; src_mask && b < B; b++) {
        int any = 0;
        for (int i = 0; i < Ts; i++) any |= src_mask[(size_t)b * Ts + i] != 0;
        if (!any) return fl_errorf(FL_ERR_INVALID, "source %d: its mask hides every token (nothing to attend to)", b);
    }
    return FL_OK;
}

/* Decoding B sources (B, Ts) at once: the encoder once over the batch (src_mask (B, Ts) masks each row's padding),
 * then the decoder token by token for every sequence not yet ended, from the start token; row b of out (stride
 * max_new + 1) gets the start token and its ids, then pad_id after its eos (generate's padded batch); *n_out the
 * common length (1 + the steps taken: until every row has ended or max_new). With the cache each sequence runs its
 * new row alone in its own region of the arena (decode_step); without it (kv_cache 0, 16-bit saved activations,
 * checkpointing) the decoder reruns the batch's whole prefix for each token. Tokens are chosen row by row (the
 * sampler's draws in row order; greedy: the first of equal maxima). */
static fl_status s2s_generate(fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts, int max_new,
                              int kv_cache, fl_sampler *sp, int32_t *out, int *n_out) {
    FL_TRY(check_model(m, "fl_model_generate_s2s"));
    struct fl_s2s_acts *a = m->acts->s2s;
    const int V = m->cfg.vocab_size, W = max_new + 1;
    *n_out = 0;
    FL_TRY(check_sources(m, src, src_mask, B, Ts, max_new));
    /* 16-bit saved activations: the blocks share one fp32 buffer of the WIDE slots (q|k|v among them), so the decoder
     * reruns its prefix for each token (the cache's ids: the same computation on the same keys) */
    if (a->act16) kv_cache = 0;
    if (kv_cache && m->act_ckpt) /* the blocks share one set of slots there: no room for each block's keys */
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_generate_s2s: the KV cache needs an arena without activation "
                         "checkpointing (or kv_cache 0)");
    fl_model_graph mg;
    FL_TRY(fl_model_graph_build(&m->cfg, &mg));
    /* the logits: one row per sequence with the cache, else every row of the batch's prefix */
    const size_t nlg = kv_cache ? (size_t)B * V : (size_t)B * max_new * V;
    float *lg = malloc(nlg * sizeof(float));
    int32_t *dec = kv_cache ? NULL : malloc((size_t)B * max_new * sizeof *dec);
    uint8_t *done = calloc((size_t)B, 1);
    if (!lg || (!kv_cache && !dec) || !done) {
        free(lg), free(dec), free(done);
        return fl_errorf(FL_ERR_OOM, "fl_model_generate_s2s: logits: out of host memory");
    }
    a->Bp = B;
    a->T[0] = Ts;
    a->kmask_on = src_mask != NULL;
    a->drop_p = 0; /* generation never drops */
    m->fwd_train = 0;
    fl_status s = src_mask ? FL_RUN(m->be, to_device, a->kmask, src_mask, (size_t)B * Ts) : FL_OK;
    if (s == FL_OK) s = roots_gather(m); /* sharded: every rank decodes in step, each block gathered per token */
    if (s == FL_OK) s = stack_forward(m, &mg, 0, src, NULL, 0, NULL); /* the encoder, once */
    int n = 0, left = B;
    for (int b = 0; b < B; b++) out[(size_t)b * W] = m->cfg.dec_start_id;
    n = 1;
    /* each token: with the cache each live sequence's new row alone (its keys: the earlier rows' k, v kept in the
     * blocks' q|k|v slots; the cross k|v from the first step), else the decoder over the batch's whole prefix (an
     * ended row fed pad, as generate); each row's last logits chosen from */
    while (s == FL_OK && n <= max_new && left > 0) {
        a->T[1] = n;
        if (kv_cache) {
            s = decode_bias(m, &a->st[mg.n_stacks - 1], n);
            for (int b = 0; s == FL_OK && b < B; b++)
                if (!done[b]) s = decode_step(m, &mg, b, out + (size_t)b * W + n - 1, n, lg + (size_t)b * V);
        } else {
            for (int b = 0; b < B; b++) memcpy(dec + (size_t)b * n, out + (size_t)b * W, (size_t)n * sizeof *dec);
            s = stack_forward(m, &mg, mg.n_stacks - 1, dec, NULL, 0, lg);
        }
        if (s != FL_OK) break;
        for (int b = 0; b < B; b++) {
            int32_t *o = out + (size_t)b * W;
            if (done[b]) {
                o[n] = m->cfg.pad_id;
                continue;
            }
            float *row = kv_cache ? lg + (size_t)b * V : lg + ((size_t)b * n + (size_t)(n - 1)) * V;
            int best = 0;
            if (sp) best = fl_sampler_sample(sp, row);
            else
                for (int v = 1; v < V; v++)
                    if (row[v] > row[best]) best = v; /* the first of equal maxima, as torch.argmax */
            o[n] = best;
            if (best == m->cfg.eos_id) done[b] = 1, left--;
        }
        n++;
    }
    free(lg), free(dec), free(done);
    roots_release(m);
    *n_out = n;
    return s;
}

/* ---- the passes with the backend's scratch lent and the compute dtype told (as transformer.c's) ---------- */

static void s2s_lend(const fl_model *m, int on) {
    const void *sc = m->acts && m->acts->s2s ? m->acts->s2s->be_scratch : NULL;
    if (sc) FL_RUN(m->be, set_scratch, on ? (void *)sc : NULL, on ? m->be->scratch_bytes : 0);
    fl_model_tell_compute_dtype(m, on);
}

fl_status fl_model_forward_s2s(fl_model *m, const int32_t *src_ids, const uint8_t *src_mask, const int32_t *dec_ids,
                               const int32_t *targets, int B, int Ts, int Tt, float grad_scale, float *logits_out) {
    s2s_lend(m, 1);
    fl_status s = s2s_forward(m, src_ids, src_mask, dec_ids, targets, B, Ts, Tt, grad_scale, logits_out, 0);
    s2s_lend(m, 0);
    return s;
}

fl_status fl_model_forward_s2s_body(fl_model *m, const int32_t *src_ids, const uint8_t *src_mask,
                                    const int32_t *dec_ids, const int32_t *targets, int B, int Ts, int Tt,
                                    float grad_scale) {
    s2s_lend(m, 1);
    fl_status s = s2s_forward(m, src_ids, src_mask, dec_ids, targets, B, Ts, Tt, grad_scale, NULL, 1);
    s2s_lend(m, 0);
    return s;
}

static fl_status s2s_forward_head(fl_model *m, float *logits_out) {
    struct fl_s2s_acts *a = m->acts->s2s;
    if (!a->head.open)
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward_head: needs a preceding fl_model_forward_s2s_body");
    a->head.open = 0;
    s2s_lend(m, 1);
    fl_status s = head_run(m, a->head.targets, a->head.N, a->head.grad_scale, logits_out);
    if (s != FL_OK || a->head.grad_scale <= 0) roots_release(m);
    s2s_lend(m, 0);
    m->fwd_train = s == FL_OK && a->head.grad_scale > 0;
    return s;
}

fl_status fl_model_backward_s2s(fl_model *m) {
    s2s_lend(m, 1);
    fl_status s = s2s_backward(m);
    s2s_lend(m, 0);
    return s;
}

static fl_status s2s_forward_micro(fl_model *m, const fl_micro_batch *mb, float grad_scale) {
    return fl_model_forward_s2s_body(m, mb->src, mb->src_mask, mb->ids, mb->targets, mb->B, mb->Ts, mb->T, grad_scale);
}

/* The encoder-decoder's passes behind the model's step entries (fitllm/model.h), installed with its arena. */
static const fl_model_kind s2s_kind = {.name = "encoder-decoder",
                                       .forward_micro = s2s_forward_micro,
                                       .forward_head = s2s_forward_head,
                                       .backward = fl_model_backward_s2s,
                                       .live_bytes = s2s_live_bytes,
                                       .adapter_live_rows = s2s_adapter_live_rows};

fl_status fl_model_generate_s2s_batch(fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts,
                                      int max_new, int kv_cache, int32_t *out, int *n_out) {
    s2s_lend(m, 1);
    fl_status s = s2s_generate(m, src, src_mask, B, Ts, max_new, kv_cache, NULL, out, n_out);
    s2s_lend(m, 0);
    return s;
}

fl_status fl_model_generate_s2s(fl_model *m, const int32_t *src, const uint8_t *src_mask, int Ts, int max_new,
                                int kv_cache, int32_t *out, int *n_out) {
    return fl_model_generate_s2s_batch(m, src, src_mask, 1, Ts, max_new, kv_cache, out, n_out);
}

fl_status fl_generate_s2s_batch(fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts,
                                const fl_gen_params *gp, int32_t *out, int *n_out) {
    *n_out = 0;
    FL_TRY(fl_gen_params_validate(gp));
    fl_sampler sp;
    FL_TRY(fl_sampler_init(&sp, fl_mem_host_pool(m->pool), m->cfg.vocab_size, gp));
    s2s_lend(m, 1);
    fl_status s = s2s_generate(m, src, src_mask, B, Ts, gp->max_new_tokens, !m->act_ckpt, &sp, out, n_out);
    s2s_lend(m, 0);
    fl_sampler_free(&sp);
    return s;
}

fl_status fl_generate_s2s(fl_model *m, const int32_t *src, const uint8_t *src_mask, int Ts, const fl_gen_params *gp,
                          int32_t *out, int *n_out) {
    return fl_generate_s2s_batch(m, src, src_mask, 1, Ts, gp, out, n_out);
}

fl_status fl_model_set_dropout(fl_model *m, int on) {
    if (!fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_set_dropout: %s has no dropout of its own (encoder-decoders "
                         "only)", fl_arch_get(m->cfg.arch)->display);
    if (on && m->cfg.dropout_rate > 0 && !m->be->dropout)
        return fl_errorf(FL_ERR_UNSUPPORTED, "config.json dropout_rate %g: backend %s has no dropout op",
                         (double)m->cfg.dropout_rate, m->be->name);
    if (m->acts && !m->cfg.dropout_on != !on)
        return fl_errorf(FL_ERR_INVALID, "fl_model_set_dropout: call it before fl_model_alloc_acts_s2s (the blocks' "
                         "graphs change)");
    m->cfg.dropout_on = on != 0;
    return FL_OK;
}
