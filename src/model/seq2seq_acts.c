/* The encoder-decoder's arena (seq2seq.c's passes read it): per stack its residual stream, every block's saved
 * slots and its final norm (ACTS), the relative biases, buckets, ids, key padding mask, d(stream), gradient buffers,
 * logits chunk and losses (WORKSPACE); the live bytes the planner compares (seq2seq.c's header has the layout). */
#include <stdlib.h>
#include <string.h>

#include "seq2seq-impl.h"

void fl_s2s_acts_free(struct fl_s2s_acts *s) {
    if (!s) return;
    for (int k = 0; k < FL_MODEL_GRAPH_MAX_STACKS; k++) free(s->st[k].res), free(s->st[k].layer);
    free(s->pad);
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

/* ACTS: every stack's residual stream, saved slots and final norm (base NULL: count only). Sequence parallel: the
 * stream and what is computed from it before a GATHER are the rank's rows; the final norm's output stays whole (the
 * decoder's cross k|v and the head read it), its statistics the rank's. */
static size_t carve_acts(const fl_model *m, struct fl_s2s_acts *a, char *base) {
    carver cv = {base, 0};
    const size_t C = (size_t)m->cfg.dim, B = (size_t)a->B;
    int T[FL_MODEL_GRAPH_MAX_STACKS];
    for (int s = 0; s < a->n_stacks; s++) T[s] = a->st[s].Tmax;
    for (int s = 0; s < a->n_stacks; s++) {
        s2s_stack *st = &a->st[s];
        const int one = a->gen && s == a->n_stacks - 1; /* generation's decoder: one row per sequence (s2s_one_row) */
        const size_t N = B * (one ? 1 : (size_t)st->Tmax), NS = stream_n(a, N);
        for (int l = 0; l <= st->L; l++) {
            float *r = TAKEF(&cv, NS * C);
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
                sh.s[sl] = TAKEF(&cv, slot_n(a, s, sl, T, B) * (size_t)st->g.slot[sl].width);
        }
        for (int l = 0; l < st->L; l++) {
            if (l == 0 || !m->act_ckpt || a->gen) { /* generation: each block its own cache */
                la = sh;
                for (int k = 0; k < st->g.n_prod; k++) {
                    const int sl = st->g.prod[k];
                    const size_t n = (s2s_one_row(a, s, sl) ? B : slot_n(a, s, sl, T, B)) * (size_t)st->g.slot[sl].width;
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
        float *no = TAKEF(&cv, N * C), *nr = TAKEF(&cv, NS);
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
        /* generation: no gradient; its decoder's bias is one query's (decode_bias: NH x 1 x n keys, n <= T buckets) */
        const int one = a->gen && s == a->n_stacks - 1;
        float *bi = TAKEF(&cv, NH * (one ? 1 : T) * T), *db = a->gen ? NULL : TAKEF(&cv, NH * T * T);
        int32_t *bk = take(&cv, (one ? T : 2 * T - 1) * sizeof(int32_t)), *ids = take(&cv, B * (one ? 1 : T) * sizeof(int32_t));
        if (base) st->bias = bi, st->dbias = db, st->buckets = bk, st->ids = ids;
        if (st->Tmax > Tx) Tx = st->Tmax;
        if (st->g.n_gbuf > ngb) ngb = st->g.n_gbuf;
        for (int k = 0; k < st->g.n_gbuf; k++)
            if (st->g.gbuf_width[k] > width[k]) width[k] = st->g.gbuf_width[k];
    }
    /* the blocks' TEMP slots (a dropped projection's output, read by the next op only): one buffer for all;
     * sequence parallel: one per slot (a SCATTER reads one TEMP slot into another), whole rows */
    size_t tmp_n[FL_GRAPH_MAX_SLOTS] = {0};
    for (int s = 0; s < a->n_stacks; s++)
        for (int k = 0; k < a->st[s].g.n_slots; k++) {
            const size_t rows = s2s_one_row(a, s, k) ? 1 : (size_t)a->st[s].Tmax;
            const size_t n = B * rows * a->st[s].g.slot[k].width, j = a->sp > 1 ? (size_t)k : 0;
            if (a->st[s].g.slot[k].kind == FL_GSLOT_TEMP && n > tmp_n[j]) tmp_n[j] = n;
        }
    float *tmp[FL_GRAPH_MAX_SLOTS] = {0};
    for (int k = 0; k < FL_GRAPH_MAX_SLOTS; k++) tmp[k] = tmp_n[k] ? TAKEF(&cv, tmp_n[k]) : NULL;
    for (int s = 0; base && s < a->n_stacks; s++)
        for (int k = 0; k < a->st[s].g.n_slots; k++)
            for (int l = 0; a->st[s].g.slot[k].kind == FL_GSLOT_TEMP && l < a->st[s].L; l++)
                a->st[s].layer[l].s[k] = tmp[a->sp > 1 ? k : 0];
    float *spd = a->sp > 1 ? TAKEF(&cv, 2 * C) : NULL; /* sequence parallel: a norm's gradient part (exec.c) */
    if (base) m->acts->sp_dnorm = spd;
    /* generation: no backward (d(stream), the gradient buffers, losses, targets); the logits of a token per sequence */
    const size_t T0 = (size_t)a->st[0].Tmax, Tl = a->gen ? 1 : (size_t)a->st[a->n_stacks - 1].Tmax;
    uint8_t *km = take(&cv, B * T0);
    float *ds = a->gen ? NULL : TAKEF(&cv, B * T0 * C);
    for (int k = 0; k < ngb && !a->gen; k++) { /* dres and buf1 (d(final norm out)) at least C wide */
        float *g = TAKEF(&cv, B * (size_t)Tx * (size_t)(k < 2 && width[k] < (int)C ? (int)C : width[k]));
        if (base) a->gb[k] = g;
    }
    a->chunk = fl_logits_chunk_rows(m->cfg.vocab_size, (int)(B * Tl)); /* one process's chunks; the rank's columns */
    float *lg = TAKEF(&cv, (size_t)a->chunk * fl_config_vocab_rows(&m->cfg, NULL)), *ls = a->gen ? NULL : TAKEF(&cv, B * Tl);
    int32_t *tg = fl_backend_host_memory(m->be) || a->gen ? NULL : take(&cv, B * Tl * sizeof(int32_t));
    const int tpr = m->cfg.tp_size > 1 ? a->chunk : 0; /* tensor parallel: the cross-entropy's statistics (tp_vocab.c) */
    double *tps = tpr ? take(&cv, (size_t)(m->cfg.tp_size + 1) * 3 * (size_t)tpr * sizeof(double)) : NULL;
    if (base) m->acts->tp_stats = tps, m->acts->tp_stats_rows = tpr;
    /* bf16 weight-gradient GEMMs when the matmuls compute in bf16 and the weights train (the decoder-only passes'
     * dw_bf16, acts.c): dW += bf16(dy)^T bf16(x), PyTorch autocast's and bf16-true's operands (fp32 dW GEMMs before).
     * Scratch for the widest LINEAR input and output over the stacks at their longest rows (a cross-attention's k|v
     * read the earlier stack's rows) and the head's chunk (x: C, dy: the rank's vocabulary rows); store.c's
     * fl_linear_set_dw_scratch hands them to every bf16 linear, fl_head_loss to the head. */
    void *xb16 = NULL, *dyb16 = NULL;
    size_t dyn = 0;
    if (m->prec.name && m->prec.compute_dtype == FL_BF16 && fl_model_grads_data(m) != NULL && !a->gen) {
        size_t in_max = C, out_max = C;
        for (int s = 0; s < a->n_stacks; s++) {
            if ((size_t)a->st[s].g.lin_in_max > in_max) in_max = (size_t)a->st[s].g.lin_in_max;
            if ((size_t)a->st[s].g.lin_out_max > out_max) out_max = (size_t)a->st[s].g.lin_out_max;
        }
        const size_t rows = B * (size_t)Tx, hrows = (size_t)a->chunk, Vr = (size_t)fl_config_vocab_rows(&m->cfg, NULL);
        const size_t xn = rows * in_max > hrows * C ? rows * in_max : hrows * C;
        dyn = rows * out_max > hrows * Vr ? rows * out_max : hrows * Vr;
        xb16 = take(&cv, xn * sizeof(uint16_t));
        dyb16 = take(&cv, dyn * sizeof(uint16_t));
    }
    if (base) m->acts->xb16 = xb16, m->acts->dyb16 = dyb16, m->acts->dyb16_elems = dyb16 ? dyn : 0;
    const size_t bes = fl_model_backend_scratch(m->prec.name ? m->prec.compute_dtype : FL_F32, fl_model_quant4(m),
                                                m->be->scratch_bytes);
    void *sc = bes ? take(&cv, bes) : NULL;
    if (base) a->kmask = km, a->dstream = ds, a->logits = lg, a->losses = ls, a->targets = tg, a->be_scratch = sc;
    return cv.off;
}

/* gen: generation's arena (fl_s2s_acts.gen), else training's */
static fl_status alloc_s2s(fl_model *m, int B, int Ts, int Tt, int gen) {
    const char *fn = gen ? "fl_model_alloc_gen_s2s" : "fl_model_alloc_acts_s2s";
    if (!fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_INVALID, "%s: %s has one stack (fl_model_alloc_acts)", fn,
                         fl_arch_get(m->cfg.arch)->display);
    if (B <= 0 || Ts <= 0 || Tt <= 0)
        return fl_errorf(FL_ERR_INVALID, "%s: %s must be positive (B=%d, source %d, target %d)", fn,
                         gen ? "sources, their length and max_new" : "micro-batch", B, Ts, Tt);
    fl_model_free_acts(m);
    fl_acts *acts = calloc(1, sizeof *acts);
    struct fl_s2s_acts *a = calloc(1, sizeof *a);
    if (!acts || !a) {
        free(acts), free(a);
        return fl_errorf(FL_ERR_OOM, "activation views: out of host memory");
    }
    acts->s2s = a;
    acts->kind = &fl_s2s_kind;
    /* the bf16 policies save the blocks' WIDE slots in bf16 (not with checkpointing, which saves the stream only) */
    const fl_dtype adt = m->prec.name ? m->prec.act_dtype : FL_F32;
    a->gen = gen; /* generation saves nothing for a backward: fp32 slots, each block its own (the cache) */
    a->act16 = adt != FL_F32 && !m->act_ckpt && !gen ? adt : (fl_dtype)0;
    acts->act_dtype = a->act16 ? adt : FL_F32;
    m->acts = acts;
    m->act_dtype = acts->act_dtype;
    a->sp = m->sp && !gen ? m->cfg.tp_size : 0; /* generation runs the tensor-parallel graphs (gtp) */
    if (a->sp > 1) B = (B + a->sp - 1) / a->sp * a->sp; /* room for a pass's padding sequences (s2s_forward) */
    a->B = B;
    fl_model_graph mg;
    fl_status s = fl_model_graph_build(&m->cfg, &mg);
    a->n_stacks = mg.n_stacks;
    const int Ls[2] = {m->cfg.n_layers, m->cfg.n_dec_layers}, Tm[2] = {Ts, Tt};
    for (int k = 0; s == FL_OK && k < a->n_stacks; k++) {
        s2s_stack *st = &a->st[k];
        s = fl_stack_graph_build_ex(&m->cfg, k, a->sp > 1, &st->g);
        if (s == FL_OK && a->sp > 1) s = fl_stack_graph_build_ex(&m->cfg, k, 0, &st->gtp); /* generation's */
        st->L = Ls[k];
        st->l0 = k ? Ls[0] : 0;
        st->Tmax = Tm[k];
        st->xslot = -1;
        for (int j = 0; j < st->g.n_slots; j++) {
            if (st->g.slot[j].kind == FL_GSLOT_XSTREAM) st->xslot = j;
            if (gen && k == a->n_stacks - 1 && st->g.slot[j].kind == FL_GSLOT_TEMP && (s2s_kv_slot(&st->g, j) || st->g.slot[j].xrows))
                s = fl_errorf(FL_ERR_INTERNAL, "%s: slot %d, kept across the tokens, is a shared TEMP slot", fn, j);
        }
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
        return fl_error_prefix(s, "allocating %s for B=%d, source %d, target %d", gen ? "generation's arena" : "activations",
                               B, Ts, Tt);
    }
    carve_acts(m, a, (char *)m->acts_arena);
    carve_work(m, a, (char *)m->work_arena);
    m->B = B;
    m->T = Tt > Ts ? Tt : Ts;
    /* the adapters' activations: rows of the longer stack (a cross k|v adapter sees the source's); generation's
     * longest pass is the encoder's (a decoding step runs one row) */
    s = m->adapt && m->adapt->h.alloc_acts ? m->adapt->h.alloc_acts(m, B, gen ? Ts : m->T) : FL_OK;
    if (s != FL_OK) {
        fl_model_free_acts(m);
        return fl_error_prefix(s, "allocating the adapters' activations");
    }
    return FL_OK;
}

fl_status fl_model_alloc_acts_s2s(fl_model *m, int B, int Ts, int Tt) { return alloc_s2s(m, B, Ts, Tt, 0); }

fl_status fl_model_alloc_gen_s2s(fl_model *m, int B, int Ts, int max_new) {
    return alloc_s2s(m, B, Ts, max_new > 0 ? max_new : 1, 1); /* max_new 0: no decoding step, the smallest arena */
}

/* Live bytes after the last pass (fl_model_kind.live_bytes of an encoder-decoder), counted at that pass's (B, T) of each
 * stack without the arena's alignment. After a training forward (train): what the backward reads. ACTS: every
 * stack's residual stream (L + 1 views: the blocks' inputs, the final norm's), its blocks' saved slots (under
 * checkpointing the last block's, which the backward reuses without recomputing them), its final norm's rstd and,
 * where a later stack reads it (the encoder's output: the cross-attention's k|v), that norm's output. WORKSPACE:
 * every stack's relative bias (the attention backward re-forms its probabilities with it), bucket indices (the
 * table's gradient) and ids (the embedding's), the key padding mask, and d(the last norm's output) the head left
 * in gb[1]. Otherwise nothing: there are no constant tables (the bias is rebuilt by every forward). */
void fl_s2s_live_bytes(const fl_model *m, int train, size_t *acts, size_t *work) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    const size_t C = (size_t)m->cfg.dim, B = (size_t)a->Bp, NH = (size_t)m->cfg.n_heads, f = sizeof(float);
    size_t ac = 0, wk = 0;
    for (int s = 0; train && s < a->n_stacks; s++) {
        const s2s_stack *st = &a->st[s];
        const size_t T = (size_t)a->T[s], N = B * T, NS = stream_n(a, N);
        size_t blk = 0, blk16 = 0; /* a block's saved fp32 elements, 16-bit ones */
        for (int k = 0; k < st->g.n_prod; k++) {
            const int sl = st->g.prod[k];
            const size_t n = slot_n(a, s, sl, a->T, B) * (size_t)st->g.slot[sl].width;
            if (st->g.slot[sl].kind == FL_GSLOT_TEMP) continue; /* the backward does not read it */
            if (a->act16 && st->g.slot[sl].kind == FL_GSLOT_WIDE) blk16 += n;
            else blk += n;
        }
        const size_t nb = st->L > 0 ? (m->act_ckpt ? 1 : (size_t)st->L) : 0;
        ac += (((size_t)st->L + 1) * NS * C + nb * blk + NS) * f + nb * blk16 * sizeof(uint16_t);
        if (s + 1 < a->n_stacks && a->st[s + 1].xslot >= 0) ac += N * C * f;
        wk += NH * T * T * f + (2 * T - 1) * sizeof(int32_t) + N * sizeof(int32_t);
    }
    if (train) wk += (a->kmask_on ? B * (size_t)a->T[0] : 0) + B * (size_t)a->T[a->n_stacks - 1] * C * f;
    *acts = ac;
    *work = wk;
}

/* The rows an adapter on the LINEAR at param_index of block `layer` saves in a training forward (its h and, with
 * dropout, its dropped input; fl_model_kind.adapter_live_rows): the source's in the encoder and for the cross-attention's
 * k|v (it reads the encoder output), the target's elsewhere; under checkpointing only the last block of each
 * stack's (the others are recomputed before their backward reads them). */
size_t fl_s2s_adapter_live_rows(const fl_model *m, int layer, int param_index) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    const int Le = a->st[0].L, Lall = Le + (a->n_stacks > 1 ? a->st[1].L : 0);
    if (m->act_ckpt && layer != Le - 1 && layer != Lall - 1) return 0;
    int p = param_index; /* k, v of a fused run carry no role: the run's first entry has it */
    while (p > 0 && m->layout.params[p].role == FL_ROLE_NONE) p--;
    const int src_rows = layer < Le || m->layout.params[p].role == FL_ROLE_XKV_W;
    return (size_t)a->Bp * (size_t)a->T[src_rows ? 0 : a->n_stacks - 1];
}
