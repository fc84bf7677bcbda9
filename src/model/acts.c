/* The activation arena: its layout (carving, from the block graph's slots: graph.c), its size
 * (shared with the planner through fl_sizing_acts), its allocation, and what of the model's memory a
 * training step's phase leaves live (fl_model_live: the one query the step records from). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model-impl.h"

/* ---- activation arena carving --------------------------------------------
 * One function walks the arena layout: with base == NULL it only counts
 * bytes (the planner and fl_sizing_acts), with a base it also sets the views.
 * So the size the planner predicts is by construction the size we allocate. */

typedef struct {
    char *base;
    size_t off;
    /* Live bytes: regions carved while `keep` is set hold data a training forward leaves for
     * the backward (fl_act_sizes.acts_saved_bytes); counted without the alignment padding. */
    int keep;
    size_t saved;
} carver;

static void *carve_bytes(carver *cv, size_t nbytes) {
    size_t bytes = (nbytes + 63) / 64 * 64; /* keep every view 64-byte aligned */
    void *p = cv->base ? (void *)(cv->base + cv->off) : NULL;
    cv->off += bytes;
    if (cv->keep) cv->saved += nbytes;
    return p;
}

static float *carve(carver *cv, size_t nfloats) { return carve_bytes(cv, nfloats * sizeof(float)); }

int fl_logits_chunk_rows_test;
int fl_logits_chunk_rows(int vocab_size, int N) {
    /* About 32 MiB of logits per chunk: large enough for an efficient lm_head
     * GEMM, small enough that (N, V) never exists at once. */
    long rows = FL_LOGITS_CHUNK_BYTES / ((long)vocab_size * 4);
    if (rows < 32) rows = 32;
    if (fl_logits_chunk_rows_test > 0) rows = fl_logits_chunk_rows_test; /* tests: several chunks at tiny shapes */
    if (rows > N) rows = N;
    return (int)rows;
}

/* the config's rows (the lab's scaled presets: the real model's / 16) unless a test forces its own */
static int logits_chunk_rows(const fl_model_config *c, int N) {
    if (c->logits_chunk_rows > 0 && fl_logits_chunk_rows_test <= 0) return c->logits_chunk_rows < N ? c->logits_chunk_rows : N;
    return fl_logits_chunk_rows(c->vocab_size, N);
}
int fl_logits_ld(int vocab_size) { return (vocab_size + 7) / 8 * 8; }

/* Rows of the residual stream and of slot k for a pass of N rows: sequence parallel (g->sp > 1), the stream and the
 * slots computed from it before a GATHER hold the rank's N / sp rows */
static size_t stream_rows(const fl_block_graph *g, size_t N) { return g->sp > 1 ? N / (size_t)g->sp : N; }
static size_t slot_rows(const fl_block_graph *g, int k, size_t N) { return g->slot[k].srows ? stream_rows(g, N) : N; }

/* Layouts (N = B*T rows), the block's slots in the graph's production order (g->prod):
 *   fp32 (default):  res[0..L] | L x {the block's slots, all fp32} | lnf
 *   act_ckpt:        res[0..L] | ONE shared fp32 block buffer           | lnf
 *   fp16 saved:      res[0..L] | ONE shared fp32 buffer of the WIDE slots |
 *                    L x {fp32 STAT slots (norm mean/rstd, lse), 16-bit copies of the WIDE slots} | lnf
 *   bf16 stored (act_dtype BF16: what the step stores is bf16, fp32 only for the statistics):
 *                    bf16 res[0..L] | L x {fp32 STAT slots, bf16 WIDE slots} (none with act_ckpt) | lnf statistics;
 *                    the fp32 views the CPU's ops compute in are WORKSPACE scratch (carve_work16). */
static size_t carve_acts(const fl_model_config *c, const fl_block_graph *g, const fl_model_graph *mg, int B, int T,
                         int ckpt, fl_dtype adt, char *base, fl_acts *a, size_t *saved) {
    fl_dims d = fl_model_dims(c);
    size_t N = (size_t)B * T, NS = stream_rows(g, N);
    int ln = fl_arch_get(c->arch)->layernorm; /* LayerNorm keeps the mean too */
    const int b16 = adt == FL_BF16, a16 = !ckpt && adt != FL_F32;
    carver cv = {base, 0, 1, 0};
    /* what backward reads: the residual stream (block inputs, res[L] for the final norm) ... */
    for (int l = 0; l <= d.L; l++) {
        if (b16) {
            void *r = carve_bytes(&cv, NS * d.C * sizeof(uint16_t));
            if (a) a->res16[l] = r;
        } else {
            float *r = carve(&cv, NS * d.C);
            if (a) a->res[l] = r;
        }
    }
    fl_layer_acts sh; /* the views every block shares (16-bit: the WIDE slots; checkpointing: all) */
    memset(&sh, 0, sizeof sh);
    if (a16) {
        cv.keep = 0; /* fp16: the shared fp32 buffer, the block being computed; backward widens into it */
        for (int k = 0; !b16 && d.L > 0 && k < g->n_prod; k++)
            if (g->slot[g->prod[k]].kind == FL_GSLOT_WIDE || g->slot[g->prod[k]].kind == FL_GSLOT_TEMP)
                sh.s[g->prod[k]] = carve(&cv, slot_rows(g, g->prod[k], N) * g->slot[g->prod[k]].width);
        const size_t es = sizeof(uint16_t); /* a16: adt is BF16 or F16 (fl_precision's act_dtype: F32, BF16, F16) */
        cv.keep = 1; /* ... every block's statistics and 16-bit copies ... */
        for (int l = 0; l < d.L; l++) {
            fl_layer_acts la = sh;
            for (int k = 0; k < g->n_prod; k++)
                if (g->slot[g->prod[k]].kind == FL_GSLOT_STAT)
                    la.s[g->prod[k]] = carve(&cv, slot_rows(g, g->prod[k], N) * g->slot[g->prod[k]].width);
            for (int k = 0; k < g->n_prod; k++)
                if (g->slot[g->prod[k]].kind == FL_GSLOT_WIDE)
                    la.s16[g->prod[k]] = carve_bytes(&cv, slot_rows(g, g->prod[k], N) * g->slot[g->prod[k]].width * es);
            if (a) a->layer[l] = la;
        }
    } else if (!b16) {
        /* checkpointing: one block buffer shared by all blocks (backward recomputes it: not kept) */
        fl_layer_acts tmp; /* TEMP slots (read by the next op only): one buffer each for every block, not kept */
        memset(&tmp, 0, sizeof tmp);
        cv.keep = 0;
        for (int k = 0; d.L > 0 && k < g->n_prod; k++)
            if (g->slot[g->prod[k]].kind == FL_GSLOT_TEMP)
                tmp.s[g->prod[k]] = carve(&cv, slot_rows(g, g->prod[k], N) * g->slot[g->prod[k]].width);
        cv.keep = !ckpt; /* ... every block's activations ... */
        for (int l = 0; l < (ckpt ? (d.L > 0 ? 1 : 0) : d.L); l++) {
            fl_layer_acts la = tmp;
            for (int k = 0; k < g->n_prod; k++)
                if (g->slot[g->prod[k]].kind != FL_GSLOT_TEMP)
                    la.s[g->prod[k]] = carve(&cv, slot_rows(g, g->prod[k], N) * g->slot[g->prod[k]].width);
            if (a) {
                if (ckpt) for (int k = 0; k < d.L; k++) a->layer[k] = la;
                else a->layer[l] = la;
            }
        }
    }
    /* ... and the final norm's statistics; its output only feeds the head, whose backward
     * runs inside the forward (bf16 stored: an fp32 WORKSPACE view the head's GEMM rounds) */
    float *lnf = NULL, *lnf_mean = NULL, *lnf_rstd = NULL;
    if (fl_model_graph_has(mg, FL_MOP_NORM, 1)) {
        cv.keep = 0;
        lnf = b16 ? NULL : carve(&cv, N * d.C); /* sequence parallel: the group's rows gathered for the head */
        cv.keep = 1;
        lnf_mean = ln ? carve(&cv, NS) : NULL;
        lnf_rstd = carve(&cv, NS);
    }
    /* an embedding norm (BERT): its input and statistics */
    float *emb_x = NULL, *emb_mean = NULL, *emb_rstd = NULL;
    if (fl_model_graph_has(mg, FL_MOP_NORM, -1)) {
        emb_x = carve(&cv, N * d.C);
        emb_mean = ln ? carve(&cv, N) : NULL;
        emb_rstd = carve(&cv, N);
    }
    if (saved) *saved = cv.saved;
    if (a) { a->lnf_mean = lnf_mean; a->lnf_rstd = lnf_rstd; a->act_dtype = b16 || a16 ? adt : FL_F32; }
    if (a && !b16) a->lnf = lnf;
    if (a) { a->emb_x = emb_x; a->emb_mean = emb_mean; a->emb_rstd = emb_rstd; }
    return cv.off;
}

/* The facts fl_get_block would bind for block l's LINEARs (store.c's set_linear and fl_linear_set_dw_scratch: a bias's
 * role, a 4-bit base, the bf16 compute copy, a trained weight's bf16 dW scratch, the adapters attached), at set-up
 * without touching a parameter: every pointer set is `any` (never dereferenced); dy16: the arena has the dy scratch
 * alone for frozen bases (fl_act_opts.dy_bf16 1), which fl_linear_set_dw_scratch hands every bf16 linear. */
void fl_block_bind_facts(const fl_model *m, const fl_block_graph *g, int l, int dy16, void *any, fl_block_params *bp) {
    const int q4 = fl_model_quant4(m) != 0, trains = fl_model_grads_data(m) != NULL;
    const int bf16 = m->prec.compute_dtype == FL_BF16;
    memset(bp, 0, sizeof *bp);
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (o->kind != FL_GOP_LINEAR) continue;
        fl_linear *lin = &bp->lin[o->p];
        lin->n_q4 = q4; /* 4-bit (QLoRA): every linear taken as 4-bit, its x and dy read in fp32 unless q416 */
        lin->q416 = q4 && fl_model_q4x16(m);
        lin->wc = bf16 && !q4 ? any : NULL;
        lin->wct = FL_BF16;
        if (o->role_b >= 0 && fl_layout_role(&m->layout, l + 1, (fl_param_role)o->role_b) >= 0) lin->b = any;
        lin->dw = trains && !q4 ? any : NULL;
        lin->db = trains && lin->b ? any : NULL; /* a trained bias: its gradient sums the fp32 dy */
        lin->xb16 = lin->dw && lin->wc ? any : NULL; /* fl_linear_set_dw_scratch */
        lin->dyb16 = (lin->xb16 || dy16) && (lin->wc || lin->q416) ? any : NULL; /* (dy16: the arena's dy scratch
                                                                                   * alone, dy_bf16) */
        if (m->adapt) m->adapt->bind(m->adapt, l, o->p, lin, 0);
    }
}

/* The WIDE slots whose fp32 views the model's decoder-only training arena does not carve (0: every view): those
 * fl_block_views32 leaves out in every block, with and without the config's dropout (training and evaluation passes),
 * from the facts fl_get_block would bind (fl_block_bind_facts), at set-up without touching a parameter (the planner's
 * null backend standing in for the GPU takes the same path). block_forward checks each pass against it. */
unsigned fl_block_facts_walk(const fl_model *m, const fl_block_graph *g, fl_block_facts_fn f, void *ud) {
    static const char one;
    void *const any = (void *)&one; /* a pointer the facts set (never dereferenced) */
    void *s16[FL_GRAPH_MAX_SLOTS] = {0};
    for (int k = 0; k < g->n_slots; k++)
        if (g->slot[k].kind == FL_GSLOT_WIDE || g->slot[k].kind == FL_GSLOT_STREAM) s16[k] = any;
    fl_block_ctx x = {.s16 = s16, .store16 = 1};
    for (int l = 0; l < m->cfg.n_layers; l++) {
        fl_block_params bp;
        fl_block_bind_facts(m, g, l, 0, any, &bp);
        for (int d = 0; d < 2; d++) {
            x.attn_drop_p = d && m->cfg.dropout_on ? m->cfg.attn_dropout_rate : 0.0f;
            const unsigned r = f(m, g, &bp, &x, ud);
            if (r) return r;
        }
    }
    return 0;
}

static unsigned views_needed(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                             const fl_block_ctx *x, void *need) {
    *(unsigned *)need |= fl_block_views32(m, g, bp, x);
    return 0;
}
unsigned fl_block_views_dropped(const fl_model *m, const fl_block_graph *g) {
    if (!(m->be->caps & FL_CAP_VIEWS16) || !m->prec.name || m->prec.act_dtype != FL_BF16) return 0;
    unsigned wide = 0, need = 0;
    for (int k = 0; k < g->n_slots; k++)
        if (g->slot[k].kind == FL_GSLOT_WIDE) wide |= 1u << k;
    fl_block_facts_walk(m, g, views_needed, &need);
    return wide & ~need;
}

/* bf16 stored: the fp32 views the ops compute in, WORKSPACE scratch (nothing in them outlives a block's
 * pass but res[L], read by the final norm's backward; the backward widens each block's stored bf16
 * into them again): the residual stream's two rows buffers (block l reads res[l] = io[l % 2] and writes
 * io[(l+1) % 2]), the WIDE slots, with checkpointing also the statistics and bf16 copies of the one block
 * being recomputed, and the final norm's output. drop32: the WIDE slots without a view (fl_block_views_dropped: an
 * FL_CAP_VIEWS16 backend writes them in bf16 only and nothing reads them in fp32); their s[] stay NULL. stream16
 * (fl_block_stream16): the residual slots whose views share ONE rows buffer (io[0], also the mid residual's view). */
static void carve_work16(carver *cv, const fl_model_config *c, const fl_block_graph *g, int B, int T, int ckpt,
                         unsigned drop32, unsigned stream16, fl_acts *a) {
    fl_dims d = fl_model_dims(c);
    const size_t N = (size_t)B * T, NS = stream_rows(g, N);
    float *io[2] = {carve(cv, NS * d.C), NULL};
    io[1] = stream16 ? io[0] : carve(cv, NS * d.C);
    fl_layer_acts sh;
    memset(&sh, 0, sizeof sh);
    for (int k = 0; d.L > 0 && k < g->n_prod; k++) {
        const fl_gslot *sl = &g->slot[g->prod[k]];
        const size_t n = slot_rows(g, g->prod[k], N);
        const int dropped = drop32 >> g->prod[k] & 1u; /* no view (a stream slot too: no fp32 write or read) */
        if (stream16 >> g->prod[k] & 1u)
            sh.s[g->prod[k]] = dropped ? NULL : io[0];
        else if ((sl->kind == FL_GSLOT_WIDE && !dropped) || sl->kind == FL_GSLOT_TEMP)
            sh.s[g->prod[k]] = carve(cv, n * sl->width);
        if (ckpt && sl->kind == FL_GSLOT_STAT) sh.s[g->prod[k]] = carve(cv, n * sl->width);
        if (ckpt && sl->kind == FL_GSLOT_WIDE) sh.s16[g->prod[k]] = carve_bytes(cv, n * sl->width * sizeof(uint16_t));
    }
    float *lnf = carve(cv, N * d.C);
    if (!a) return;
    for (int l = 0; l <= d.L; l++) a->res[l] = io[l % 2];
    for (int l = 0; l < d.L; l++)
        for (int k = 0; k < g->n_prod; k++) {
            const int sl = g->prod[k];
            if (g->slot[sl].kind == FL_GSLOT_WIDE || g->slot[sl].kind == FL_GSLOT_TEMP) a->layer[l].s[sl] = sh.s[sl];
            if (ckpt) { a->layer[l].s[sl] = sh.s[sl]; a->layer[l].s16[sl] = sh.s16[sl]; }
        }
    a->lnf = lnf;
}

/* The residual stream in the block views: block l reads res[l], writes res[l+1] (bf16 stored: and their copies). */
static void wire_stream(fl_acts *a) {
    for (int l = 0; l < a->L; l++) {
        a->layer[l].s[FL_GSLOT_IN] = a->res[l];
        a->layer[l].s[FL_GSLOT_OUT] = a->res[l + 1];
        a->layer[l].s16[FL_GSLOT_IN] = a->res16 ? a->res16[l] : NULL;
        a->layer[l].s16[FL_GSLOT_OUT] = a->res16 ? a->res16[l + 1] : NULL;
    }
}

/* 16-bit saved activations: block l's WIDE slots between the shared fp32 buffer and its 16-bit copies.
 * bf16 stored: the block rounds each slot as it writes it (fl_block_ctx.store16), so nothing is left to narrow;
 * widening rebuilds its fp32 views from what is stored, the input always, the WIDE slots unless checkpointing
 * recomputes them (from that input: widened before the recompute). */
/* done: the slots left out (narrowing: already stored; widening: read in bf16 by their backward ops) */
static fl_status convert_saved(fl_model *m, int l, int N, int narrow, unsigned done) {
    fl_acts *a = m->acts;
    if (!a || a->act_dtype == FL_F32) return FL_OK;
    if (a->res16 && narrow) return FL_OK;
    const fl_block_graph *g = a->graph;
    fl_layer_acts *la = &a->layer[l];
    const fl_backend *be = m->be;
    /* the list of conversions (dst, src, len): one convert_many launch where the backend has it */
    void *dst[FL_GRAPH_MAX_SLOTS + 1];
    const void *src[FL_GRAPH_MAX_SLOTS + 1];
    size_t len[FL_GRAPH_MAX_SLOTS + 1];
    int cnt = 0;
    if (a->res16 && !(done >> FL_GSLOT_IN & 1u)) { /* bf16 stored: widen (narrow returned above) */
        dst[cnt] = la->s[FL_GSLOT_IN], src[cnt] = la->s16[FL_GSLOT_IN], len[cnt++] = stream_rows(g, N) * m->cfg.dim;
    }
    for (int k = 0; k < g->n_prod && !(a->res16 && m->act_ckpt); k++) {
        int sl = g->prod[k];
        if (g->slot[sl].kind != FL_GSLOT_WIDE || (done >> sl & 1u)) continue;
        dst[cnt] = narrow ? (void *)la->s16[sl] : (void *)la->s[sl];
        src[cnt] = narrow ? (const void *)la->s[sl] : (const void *)la->s16[sl];
        len[cnt++] = slot_rows(g, sl, N) * g->slot[sl].width;
    }
    return fl_convert_list(be, cnt, dst, narrow ? a->act_dtype : FL_F32, src, narrow ? FL_F32 : a->act_dtype, len);
}

fl_status fl_convert_list(const fl_backend *be, int cnt, void *const *dst, fl_dtype dt, const void *const *src,
                          fl_dtype st, const size_t *len) {
    if (be->convert_many && cnt > 1 && cnt <= FL_CONVERT_MANY_MAX)
        return FL_RUN(be, convert_many, cnt, dst, dt, src, st, len);
    for (int k = 0; k < cnt; k++) FL_TRY(FL_RUN(be, convert, dst[k], dt, src[k], st, len[k]));
    return FL_OK;
}

fl_status fl_acts_narrow(fl_model *m, int l, int N, unsigned done) { return convert_saved(m, l, N, 1, done); }
fl_status fl_acts_widen(fl_model *m, int l, int N, unsigned skip) { return convert_saved(m, l, N, 0, skip); }

fl_status fl_acts_store_stream(fl_model *m, int l, int N) {
    fl_acts *a = m->acts;
    if (!a || !a->res16) return FL_OK;
    const fl_backend *be = m->be;
    const size_t n = stream_rows(a->graph, N) * m->cfg.dim;
    if (be->round16) return FL_RUN(be, round16, a->res16[l], FL_BF16, a->res[l], n); /* one kernel */
    FL_TRY(FL_RUN(be, convert, a->res16[l], FL_BF16, a->res[l], FL_F32, n));
    return FL_RUN(be, convert, a->res[l], FL_F32, a->res16[l], FL_BF16, n);
}

static size_t imax(size_t a, size_t b) { return a > b ? a : b; }

/* The gradient buffers' widths: graph.c's (the widest slot each holds) without the slots in gdrop */
static void gbuf_widths(const fl_block_graph *g, unsigned gdrop, int *w) {
    for (int b = 0; b < FL_GRAPH_MAX_GBUF; b++) w[b] = gdrop ? 0 : g->gbuf_width[b];
    for (int k = 0; gdrop && k < g->n_slots; k++) {
        const int b = g->slot[k].grad;
        if (b > FL_GBUF_NONE && !(gdrop >> k & 1u) && w[b] < g->slot[k].width) w[b] = g->slot[k].width;
    }
}

/* Workspace live bytes: *handoff = what a training forward leaves for the backward (d(lnf),
 * the first N x C floats of buf1, and the token ids), *constant = the RoPE tables (written
 * once, read by every pass). Everything else is scratch within one pass (the widened head and
 * the backend's scratch too). */
static size_t carve_work(const fl_model_config *c, const fl_block_graph *g, const fl_model_graph *mg, int B, int T,
                         int ckpt, fl_dtype adt, unsigned drop32, unsigned gdrop, unsigned stream16, int dw_bf16,
                         int dy_bf16, fl_dtype head_widen, size_t be_scratch, char *base, fl_acts *a, size_t *handoff,
                         size_t *constant) {
    fl_dims d = fl_model_dims(c);
    size_t N = (size_t)B * T;
    carver cv = {base, 0, 0, 0};
    /* the backward's gradient buffers (the graph's assignment) as wide as their slots' gradients the backward holds
     * in fp32 (gdrop: those it does not, fl_block_grads_dropped); buf1 also takes d(lnf) (N, C) */
    int gw[FL_GRAPH_MAX_GBUF];
    gbuf_widths(g, gdrop, gw);
    float *dres = carve(&cv, N * imax(d.C, (size_t)gw[FL_GBUF_RES]));
    float *buf1 = carve(&cv, N * imax(d.C, (size_t)gw[FL_GBUF_1]));
    float *buf2 = carve(&cv, N * (size_t)gw[FL_GBUF_2]);
    float *more[2] = {NULL, NULL}; /* a graph with slots read by several ops: its further buffers */
    for (int k = FL_N_GBUF; k < g->n_gbuf; k++) more[k - FL_N_GBUF] = carve(&cv, N * (size_t)gw[k]);
    const size_t Vp = (size_t)fl_logits_ld((int)d.V); /* the bf16 head's padded rows (fl_logits_ld; d.V: a TP rank's slice) */
    float *logits = carve(&cv, (size_t)logits_chunk_rows(c, (int)N) * Vp);
    float *sp_dnorm = g->sp > 1 ? carve(&cv, 2 * (size_t)d.C) : NULL; /* sequence parallel: a norm's gradient part */
    const size_t tpr = c->tp_size > 1 ? (size_t)logits_chunk_rows(c, (int)N) : 0; /* tensor parallel: the statistics */
    double *tp_stats = tpr ? carve_bytes(&cv, (size_t)(c->tp_size + 1) * 3 * tpr * sizeof(double)) : NULL;
    float *losses = carve(&cv, N);
    float *ids = carve(&cv, N); /* int32 ids stored in float-sized slots */
    size_t half = fl_arch_get(c->arch)->rope ? (size_t)T * (d.HD / 2) : 0;
    float *rc = carve(&cv, half), *rs = carve(&cv, half);
    /* bf16 dW scratch: the widest linear input and output (the head's: (N, C) and a logits chunk) */
    void *xb16 = dw_bf16 ? carve_bytes(&cv, N * imax(d.C, (size_t)g->lin_in_max) * sizeof(uint16_t)) : NULL;
    size_t dyn = imax(N * imax(d.C, (size_t)g->lin_out_max), (size_t)logits_chunk_rows(c, (int)N) * Vp);
    if (!dw_bf16 && dy_bf16 == 2) dyn = (size_t)logits_chunk_rows(c, (int)N) * Vp; /* QLoRA: the head's alone */
    void *dyb16 = dw_bf16 || dy_bf16 ? carve_bytes(&cv, dyn * sizeof(uint16_t)) : NULL;
    if (handoff) *handoff = N * d.C * sizeof(float) + N * sizeof(int32_t);
    if (constant) *constant = 2 * half * sizeof(float);
    /* the widened lm_head (fl_act_opts.head_widen); a BF16 head also rounds its chunk's input
     * (head_x) and the logits' gradient through a 16-bit scratch (dyb16 when carved: >= (chunk, V)) */
    size_t R = (size_t)logits_chunk_rows(c, (int)N);
    int hw = head_widen == FL_BF16 || head_widen == FL_F16, hb = head_widen == FL_BF16;
    float *head_w = hw ? carve(&cv, (size_t)d.V * d.C) : NULL;
    float *head_x = hb ? carve(&cv, R * d.C) : NULL;
    void *head_t16 = !hb ? NULL : dw_bf16 ? dyb16 : carve_bytes(&cv, R * imax(d.V, d.C) * sizeof(uint16_t));
    void *bes = be_scratch ? carve_bytes(&cv, be_scratch) : NULL;
    /* an encoder's inputs beside the ids: token types and the key padding mask */
    const int enc = fl_model_graph_has(mg, FL_MOP_OUTPUT, 1);
    void *types = enc ? carve_bytes(&cv, N * sizeof(int32_t)) : NULL, *kmask = enc ? carve_bytes(&cv, N) : NULL;
    if (adt == FL_BF16) carve_work16(&cv, c, g, B, T, ckpt, drop32, stream16, a);
    if (a) {
        a->type_ids = types;
        a->kmask = kmask;
        a->be_scratch = bes;
        a->be_scratch_bytes = be_scratch;
        a->head_dt = hw ? head_widen : FL_F32;
        a->head_w = head_w; a->head_x = head_x; a->head_t16 = head_t16;
        a->xb16 = xb16;
        a->dyb16 = dyb16;
        a->dyb16_elems = dyb16 ? dyn : 0;
        a->dres = dres; a->buf1 = buf1; a->buf2 = buf2; a->gbuf_more[0] = more[0]; a->gbuf_more[1] = more[1]; a->logits = logits; a->losses = losses; a->ids = (int32_t *)ids;
        a->rope_cos = rc; a->rope_sin = rs; a->rope_T = T;
        a->sp_dnorm = sp_dnorm;
        a->tp_stats = tp_stats, a->tp_stats_rows = (int)tpr;
    }
    return cv.off;
}

size_t fl_model_backend_scratch(fl_dtype compute_dtype, int quant4, size_t scratch_bytes) {
    return compute_dtype != FL_F32 || quant4 ? scratch_bytes : 0;
}

fl_dtype fl_head_widen_dtype(fl_dtype compute_dtype, unsigned widens16) {
    /* opt-in (FITLLM_HEAD_WIDEN=1): measured on Zen 3 (docs/BENCHMARKS.md) the head got ~7% faster
     * and the bf16-true step no faster, for V x C x 4 more bytes of WORKSPACE (+9% RSS on tiny) */
    const char *e = getenv("FITLLM_HEAD_WIDEN");
    if (!e || strcmp(e, "1") != 0) return FL_F32;
    return (compute_dtype == FL_BF16 || compute_dtype == FL_F16) && (widens16 & (1u << compute_dtype)) ? compute_dtype
                                                                                                       : FL_F32;
}

void fl_sizing_acts(const fl_model_config *cfg_in, int B, int T, fl_act_sizes *out) {
    fl_sizing_acts_ex(cfg_in, B, T, NULL, out);
}

void fl_sizing_acts_ex(const fl_model_config *cfg_in, int B, int T, const fl_act_opts *opts, fl_act_sizes *out) {
    int ckpt = opts && opts->act_ckpt;
    fl_dtype adt = opts ? opts->act_dtype : FL_F32;
    /* Fill the config's derived defaults (head_dim, kv heads) the same way the
     * model does, so planner and runtime size the same arena. */
    fl_model_config c = *cfg_in;
    memset(out, 0, sizeof *out);
    fl_block_graph g;
    fl_model_graph mg;
    if (fl_config_validate(&c) != FL_OK || B <= 0 || T <= 0 ||
        fl_block_graph_build_ex(&c, opts && opts->seq_par, &g) != FL_OK ||
        fl_model_graph_build(&c, &mg) != FL_OK)
        return;
    out->acts_bytes = carve_acts(&c, &g, &mg, B, T, ckpt, adt, NULL, NULL, &out->acts_saved_bytes);
    out->workspace_bytes = carve_work(&c, &g, &mg, B, T, ckpt, adt, opts ? opts->drop32 : 0, opts ? opts->gdrop : 0,
                                      opts ? opts->stream16 : 0, opts && opts->dw_bf16, opts ? opts->dy_bf16 : 0, opts ? opts->head_widen : FL_F32,
                                      opts ? opts->backend_scratch : 0, NULL, NULL, &out->work_handoff_bytes,
                                      &out->work_const_bytes);
    /* per layer: the difference between L and L-1 layers */
    fl_model_config c1 = c;
    c1.n_layers = c.n_layers - 1;
    out->per_layer_acts_bytes = out->acts_bytes - carve_acts(&c1, &g, &mg, B, T, ckpt, adt, NULL, NULL, NULL);
    out->logits_chunk_rows = logits_chunk_rows(&c, B * T);
}

/* Live bytes of the arenas for a pass over (B, T) rows (B*T <= the arena's): after a training
 * forward, what the backward reads; otherwise (train = 0: an inference forward, a finished
 * backward) only the constant tables. Same carving as the arena: the planner's figures
 * (fl_sizing_acts_ex at its T) are these for a batch of the arena's shape. */
void fl_acts_live_bytes(const fl_model *m, int B, int T, int train, size_t *acts, size_t *work) {
    size_t saved = 0, handoff = 0, constant = 0;
    if (m->acts->kind) { /* another kind (an encoder-decoder): its passes' (fl_model_kind) */
        m->acts->kind->live_bytes(m, train, acts, work);
        return;
    }
    if (train) {
        carve_acts(&m->cfg, m->acts->graph, m->acts->mgraph, B, T, m->act_ckpt, m->act_dtype, NULL, NULL, &saved);
        carve_work(&m->cfg, m->acts->graph, m->acts->mgraph, B, T, 0, FL_F32, 0, 0, 0, 0, 0, FL_F32, 0, NULL, NULL, &handoff,
                   &constant);
    }
    *acts = saved;
    *work = handoff + m->sizes.work_const_bytes;
}

/* What the model holds live after each phase of a training step (fitllm/model.h): the step records it at the phase
 * boundary (fl_mem_record_live); forward and backward set no live bytes. */
int fl_model_live(const fl_model *m, fl_live_phase phase, fl_live_region *out) {
    int n = 0;
    void *g = fl_model_grads_buffer(m);
    if (phase == FL_LIVE_ZEROED || phase == FL_LIVE_UPDATED) { /* zeros, or consumed: nothing accumulated */
        if (g) out[n++] = (fl_live_region){g, 0, 0};
        return n;
    }
    const int train = phase == FL_LIVE_FORWARD && m->fwd_train;
    if (m->acts) {
        size_t acts, work;
        const void *lbuf = NULL;
        fl_acts_live_bytes(m, m->fwd_B, m->fwd_T, train, &acts, &work);
        out[n++] = (fl_live_region){m->acts_arena, acts, 0};
        out[n++] = (fl_live_region){m->work_arena, work, 0};
        size_t lb = m->adapt && m->adapt->h.live_acts ? m->adapt->h.live_acts(m, train, &lbuf) : 0;
        if (lbuf) out[n++] = (fl_live_region){lbuf, lb, 0};
    }
    if (!g) return n;
    if (phase == FL_LIVE_BACKWARD) {
        out[n++] = (fl_live_region){g, SIZE_MAX, 0}; /* every gradient holds the step's sum */
    } else if (train && !fl_model_provider(m)) { /* the head's gradient (sharded: in its group's gathered buffer) */
        fl_outer_params op;
        fl_get_outer(m, &op);
        fl_dims d = fl_model_dims(&m->cfg);
        size_t hg = m->adapt ? m->adapt->h.head_grad_bytes
                  : op.dhead ? (size_t)d.V * d.C * (fl_model_grads_16(m) ? sizeof(uint16_t) : sizeof(float)) : 0;
        out[n++] = (fl_live_region){g, hg, 1};
    }
    return n;
}

size_t fl_model_adapter_live_rows(const fl_model *m, int layer, int param_index, int train) {
    if (!train || layer < 0) return 0; /* the head's run chunk by chunk inside the forward */
    /* without an arena of its own (a BLIP-2 part, in its owner's): the owner's last forward (fwd_B, fwd_T) */
    if (m->acts && m->acts->kind) return m->acts->kind->adapter_live_rows(m, layer, param_index);
    return m->act_ckpt ? 0 : (size_t)m->fwd_B * (size_t)m->fwd_T; /* checkpointed: recomputed before the backward */
}

/* Issue 30 item 5: the backend's input slots (fl_backend.input_slots, a device's second stream) for a decoder-only
 * LM's training passes, made with the arena (set-up, not the step): ids then targets at fixed offsets, so a CUDA
 * graph's copies repeat. None (a->in_dev NULL: the pass uploads through to_device) on host memory, without the
 * slots, for an encoder's token types or a tensor-parallel slice, or when the backend refuses. */
static void input_slots(fl_model *m, fl_acts *a, int B, int T) {
    const fl_backend *be = m->be;
    const fl_model_graph *mg = a->mgraph;
    if (!a->targets_home || !be->input_slots || !be->input_upload || !be->input_wait || a->type_ids ||
        mg->op[mg->n_ops - 1].kind != FL_MOP_HEAD_LM || m->cfg.tp_size > 1)
        return;
    const size_t cap = (size_t)B * T * sizeof(int32_t);
    a->in_off = (cap + 255) / 256 * 256;
    a->in_dev = (char *)be->input_slots(be, a->in_off + cap, &a->in_stride);
}

fl_status fl_model_alloc_acts(fl_model *m, int B, int T) {
    if (fl_model_is_s2s(&m->cfg)) return fl_model_alloc_acts_s2s(m, B, T, T); /* an encoder-decoder: seq2seq.c */
    if (B <= 0 || T <= 0) return fl_errorf(FL_ERR_INVALID, "micro-batch must be positive (B=%d, T=%d)", B, T);
    if (T > m->cfg.max_seq)
        return fl_errorf(FL_ERR_INVALID, "sequence length %d exceeds the model's max_position_embeddings %d", T,
                         m->cfg.max_seq);
    if (m->sp && T % m->cfg.tp_size) {
        /* sequence parallel: each rank holds 1/N of a pass's rows, so the arena's T is rounded up to a multiple of N and
         * a pass whose rows N does not divide is padded at each sequence's end (sp_pad, transformer.c: token 0, ignored
         * targets; exact for the causal decoders): any --train.max_seq_length runs (the planner sizes the same arena) */
        const int n = m->cfg.tp_size, Tr = (T + n - 1) / n * n;
        if (Tr > m->cfg.max_seq)
            return fl_errorf(FL_ERR_INVALID, "--sequence_parallel with --tensor_parallel %d: the sequence length %d, padded "
                             "to %d (a multiple of %d: each rank holds 1/%d of the stream's rows), exceeds the model's "
                             "max_position_embeddings %d: give a shorter --train.max_seq_length (sequences of at most %d "
                             "tokens)", n, T, Tr, n, n, m->cfg.max_seq, m->cfg.max_seq / n * n);
        T = Tr;
    }
    fl_model_free_acts(m);
    m->act_dtype = m->prec.name ? m->prec.act_dtype : FL_F32; /* zeroed policy = 32-true */
    /* bf16 weight-gradient GEMMs when the matmuls compute in bf16 and the weights train */
    int dw_bf16 = m->prec.name && m->prec.compute_dtype == FL_BF16 && fl_model_grads_data(m) != NULL;
    /* a frozen bf16 base (LoRA, not 4-bit) on a backend with bf16 matmul kernels (FL_CAP_COMPUTE_BF16): its dy's bf16
     * copy, which the op that makes dy writes as it writes dy (act_backward16, rope_backward16, the w16 norms), read
     * by its dx GEMM instead of the backend rounding the fp32 dy into a panel inside every such GEMM (issue 30 items
     * 1 and 7; the same RNE, the same bits) */
    int lora16 = 1;
    FL_TRY(fl_lora16_on(&lora16));
    const int dy_bf16 = !dw_bf16 && lora16 && m->prec.name && m->prec.compute_dtype == FL_BF16 && m->adapt &&
                        (m->be->caps & FL_CAP_COMPUTE_BF16) ? (fl_model_quant4(m) && !fl_model_q4x16(m) ? 2 : 1) : 0;
    /* 2: 4-bit blocks reading their dy in fp32 (1 with fl_model_q4x16: they read its bf16 copy too) */
    fl_dtype head_widen = fl_head_widen_dtype(m->prec.name ? m->prec.compute_dtype : FL_F32, m->be->gemm_widens16);
    size_t bes = fl_model_backend_scratch(m->prec.name ? m->prec.compute_dtype : FL_F32, fl_model_quant4(m),
                                          m->be->scratch_bytes);
    /* bf16 compute: the attention's scratch (cuda: cuDNN's operand copies), lent with the rest, so it is planned */
    if (bes && m->prec.name && m->prec.compute_dtype == FL_BF16 && m->be->attn_scratch_bytes)
        bes += m->be->attn_scratch_bytes(B, T, m->cfg.n_heads, m->cfg.n_kv_heads, m->cfg.head_dim);
    fl_acts *a = calloc(1, sizeof *a);
    if (!a) return fl_errorf(FL_ERR_OOM, "activation views: out of host memory");
    a->L = m->cfg.n_layers;
    a->res = calloc((size_t)a->L + 1, sizeof *a->res);
    a->layer = calloc((size_t)a->L, sizeof *a->layer);
    if (m->act_dtype == FL_BF16) a->res16 = calloc((size_t)a->L + 1, sizeof *a->res16);
    /* one allocation, freed through a->graph (model.c's fl_model_free_acts) */
    struct graphs { fl_block_graph g; fl_model_graph mg; } *both = calloc(1, sizeof *both);
    fl_block_graph *g = both ? &both->g : NULL;
    fl_model_graph *mg = both ? &both->mg : NULL;
    a->graph = g;
    a->mgraph = mg;
    m->acts = a;
    if (!a->res || !a->layer || !both || (m->act_dtype == FL_BF16 && !a->res16)) { fl_model_free_acts(m); return fl_errorf(FL_ERR_OOM, "activation views: out of host memory"); }
    fl_status s = fl_block_graph_build_ex(&m->cfg, m->sp, g);
    if (s == FL_OK) s = fl_model_graph_build(&m->cfg, mg);
    if (s != FL_OK) { fl_model_free_acts(m); return s; }
    /* bf16 stored on an FL_CAP_VIEWS16 backend: the fp32 views no block reads or writes are not carved */
    const unsigned drop32 = fl_block_views_dropped(m, g), gdrop = fl_block_grads_dropped(m, g, dy_bf16 == 1);
    const unsigned stream16 = fl_block_stream16(m, g); /* the residual slots' fp32 views in one buffer */
    fl_act_opts ao = {m->act_ckpt, m->act_dtype, dw_bf16, head_widen, bes, m->sp, drop32, gdrop, stream16, dy_bf16};
    fl_sizing_acts_ex(&m->cfg, B, T, &ao, &m->sizes);
    s = fl_mem_alloc(m->pool, FL_TAG_ACTS, m->sizes.acts_bytes, (void **)&m->acts_arena);
    if (s == FL_OK) s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, m->sizes.workspace_bytes, (void **)&m->work_arena);
    if (s != FL_OK) { fl_model_free_acts(m); return fl_error_prefix(s, "allocating activations for B=%d T=%d", B, T); }
    carve_acts(&m->cfg, g, mg, B, T, m->act_ckpt, m->act_dtype, (char *)m->acts_arena, a, NULL);
    carve_work(&m->cfg, g, mg, B, T, m->act_ckpt, m->act_dtype, drop32, gdrop, stream16, dw_bf16, dy_bf16, head_widen,
               bes, (char *)m->work_arena, a, NULL, NULL);
    a->drop32 = drop32;
    a->stream16 = stream16;
    a->gdrop = gdrop;
    wire_stream(a);
    if (fl_arch_get(m->cfg.arch)->rope)
        s = m->be->rope_tables(m->be, a->rope_cos, a->rope_sin, T, m->cfg.head_dim, m->cfg.rope_theta,
                               &m->cfg.rope_scaling);
    if (s != FL_OK) { fl_model_free_acts(m); return fl_error_prefix(s, "the RoPE tables"); }
    if (!fl_backend_host_memory(m->be)) { /* the targets the cross-entropy op reads must be device memory too */
        s = fl_mem_alloc(m->pool, FL_TAG_WORKSPACE, (size_t)B * T * sizeof(int32_t), (void **)&a->targets);
        if (s != FL_OK) { fl_model_free_acts(m); return fl_error_prefix(s, "allocating the targets"); }
    }
    a->ids_home = a->ids, a->targets_home = a->targets; /* (a prefetched pass points them at an input slot) */
    input_slots(m, a, B, T);
    fl_mem_set_live(m->pool, m->work_arena, m->sizes.work_const_bytes); /* the RoPE tables */
    m->B = B;
    m->T = T;
    s = m->adapt && m->adapt->h.alloc_acts ? m->adapt->h.alloc_acts(m, B, T) : FL_OK;
    if (s != FL_OK) { fl_model_free_acts(m); return fl_error_prefix(s, "allocating the adapters' activations"); }
    return FL_OK;
}

