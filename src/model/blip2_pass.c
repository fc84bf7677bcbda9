/* BLIP-2's passes (fitllm/blip2.h): the three parts' model graphs interpreted in order, vision tower -> Q-Former ->
 * language model, and back. The ops around the blocks:
 *
 *   PATCH    res[0] (B, P + 1, Cv): row 0 the class token, row 1 + p the patch p's pixels (3 p p, arranged on the
 *            host: the convolution with stride = kernel is a matrix product) @ W^T + b; the learned positions added.
 *            Backward: dW, db from the patch rows' gradient, d(class token) and d(positions) summed over the batch.
 *   QUERIES  nin (B, NQ, Cq): the learned query tokens for every image (backward: summed over the batch), then the
 *            embedding LayerNorm into res[0].
 *   EMBED    the language model's token and position embeddings; the rows of the image placeholders (or the rows in
 *            front) are the projected queries + their position instead (backward: their gradient goes to the
 *            projection, never to the placeholder's token row; the positions get all rows').
 *
 * The blocks are the block graph's executors (graph.c); the Q-Former's cross-attention blocks read the vision
 * tower's output as their XSTREAM slot and accumulate its gradient. Every op is a backend call (copies, adds, the
 * linears), so each backend runs BLIP-2 with the kernels it has. */
#include <stdlib.h>
#include <string.h>

#include "blip2-impl.h"
#include "fitllm/generate.h"
#include "store.h"

#define TAKEF(cv, n) ((float *)fl_carve((cv), (size_t)(n) * sizeof(float)))

static int npatch(const fl_blip2 *b) { return b->cfg.vision.max_seq - 1; }
/* The parts this arena runs: an encoder-decoder language model runs in its own (seq2seq.c) */
static int parts_here(const fl_blip2 *b) { return fl_model_is_s2s(&b->cfg.text) ? 2 : 3; }

/* Part m has something to train: its gradient buffers, or LoRA adapters (the base frozen). */
static int part_trains(const fl_model *m) { return fl_model_grads_data(m) != NULL || m->adapt != NULL; }

/* ACTS: per part its residual stream, every block's saved slots, its norm's buffers. A lean part (it and every part
 * before it train nothing: a frozen vision tower, also a frozen Q-Former above it, everything in a loss / generate
 * forward) saves nothing for a backward that never reaches it: two residual buffers in turn (res[l] = buf[l % 2]) and
 * one block's slots per block graph (as checkpointing shares them), only its output kept for the next part. */
static size_t carve_acts(fl_blip2 *b, char *base) {
    fl_carver cv = {base, 0};
    const size_t B = (size_t)b->B, T0 = (size_t)b->st[0].T;
    for (int k = 0; k < parts_here(b); k++) {
        fl_b2_stack *st = &b->st[k];
        const size_t C = (size_t)b->part[k].cfg.dim, N = B * (size_t)st->T, off0 = cv.off;
        const int lean = b->lean[k], share = lean || b->part[k].act_ckpt;
        size_t shared_bytes = 0;
        for (int l = 0; l <= st->L; l++) {
            float *r = lean && l >= 2 ? st->res[l & 1] : TAKEF(&cv, N * C);
            if (base) st->res[l] = r;
        }
        /* checkpointing (and a lean part): one block's slots per block graph (the Q-Former has two), shared by the
         * stack's blocks of that graph (checkpointing: recomputed from their saved input in the backward) */
        fl_layer_acts shared[2];
        int have[2] = {0, 0};
        for (int l = 0; l < st->L; l++) {
            const int v = k == FL_BLIP2_QFORMER && fl_blip2_has_xattn(&b->part[k].cfg, l);
            const fl_block_graph *g = &st->g[v];
            fl_layer_acts la;
            memset(&la, 0, sizeof la);
            if (share && have[v]) la = shared[v];
            const size_t at = cv.off;
            for (int j = 0; !(share && have[v]) && j < g->n_prod; j++) {
                const int sl = g->prod[j];
                if (g->slot[sl].kind == FL_GSLOT_XSTREAM || g->slot[sl].kind == FL_GSLOT_TEMP) continue;
                la.s[sl] = TAKEF(&cv, (g->slot[sl].xrows ? B * T0 : N) * (size_t)g->slot[sl].width);
            }
            if (share) shared_bytes += cv.off - at;
            shared[v] = la, have[v] = 1;
            if (!base) continue;
            la.s[FL_GSLOT_IN] = st->res[l];
            la.s[FL_GSLOT_OUT] = st->res[l + 1];
            if (g == &st->g[1] && st->xslot >= 0) la.s[st->xslot] = b->st[0].nout; /* the image features */
            st->layer[l] = la;
        }
        float *ni = k == FL_BLIP2_QFORMER ? TAKEF(&cv, N * C) : NULL;
        float *no = TAKEF(&cv, N * C), *nm = TAKEF(&cv, N), *nr = TAKEF(&cv, N);
        if (base) st->nin = ni, st->nout = no, st->nmean = nm, st->nrstd = nr;
        b->acts_part[k] = cv.off - off0;
        b->acts_saved[k] = lean ? 0 : b->acts_part[k] - shared_bytes;
    }
    return cv.off;
}

/* 16-bit storage: the most the passes widen at once (par): the vision tower's class token, positions and patch bias,
 * the Q-Former's query tokens and embedding norm, a language-model position row or final norm (2 Ct also covers the
 * projection's bias); none with fp32 storage. */
static size_t wstage_elems(const fl_blip2 *b) {
    int st16 = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) st16 |= fl_model_store_dtype(&b->part[k]) != FL_F32;
    if (!st16) return 0;
    const size_t Cv = (size_t)b->cfg.vision.dim, Cq = (size_t)b->cfg.qformer.dim, Ct = (size_t)b->cfg.text.dim;
    size_t n = Cv * ((size_t)b->cfg.vision.max_seq + 2), nq = Cq * ((size_t)b->cfg.n_queries + 2);
    if (nq > n) n = nq;
    return 2 * Ct > n ? 2 * Ct : n;
}

/* WORKSPACE: the patches, the projected queries, d(image features), the gradient buffers, a logits chunk, ids. */
static size_t carve_work(fl_blip2 *b, char *base) {
    fl_carver cv = {base, 0};
    const size_t B = (size_t)b->B, P = (size_t)npatch(b), p = (size_t)b->cfg.vision.patch_size;
    const size_t Cv = (size_t)b->cfg.vision.dim, Ct = (size_t)b->cfg.text.dim, NQ = (size_t)b->cfg.n_queries;
    float *pa = TAKEF(&cv, B * P * 3 * p * p), *pe = TAKEF(&cv, B * P * Cv);
    float *qp = TAKEF(&cv, B * NQ * Ct), *dqp = TAKEF(&cv, B * NQ * Ct), *di = TAKEF(&cv, B * (P + 1) * Cv);
    int rows = 0, width[FL_GRAPH_MAX_GBUF] = {0}, ngb = FL_N_GBUF;
    for (int k = 0; k < parts_here(b); k++) {
        const fl_b2_stack *st = &b->st[k];
        if (st->T > rows) rows = st->T;
        for (int j = 0; j < 2; j++) {
            const fl_block_graph *g = &st->g[j];
            if (g->n_gbuf > ngb) ngb = g->n_gbuf;
            for (int i = 0; i < g->n_gbuf; i++)
                if (g->gbuf_width[i] > width[i]) width[i] = g->gbuf_width[i];
        }
        const int C = b->part[k].cfg.dim;
        for (int i = 0; i < 2; i++) /* dres and d(norm out) at least C wide; buf1 also the patch rows' gradient */
            if (width[i] < C) width[i] = C;
    }
    for (int i = 0; i < ngb; i++) {
        float *g = TAKEF(&cv, B * (size_t)rows * (size_t)width[i]);
        if (base) b->gb[i] = g;
    }
    const size_t NL = parts_here(b) == 3 ? B * (size_t)b->TL : 0, V = (size_t)b->cfg.text.vocab_size;
    b->chunk = NL ? fl_logits_chunk_rows((int)V, (int)NL) : 0;
    float *lg = TAKEF(&cv, (size_t)b->chunk * V), *ls = TAKEF(&cv, NL);
    int32_t *ids = fl_carve(&cv, NL * sizeof(int32_t));
    int32_t *tg = fl_backend_host_memory(b->be) ? NULL : fl_carve(&cv, NL * sizeof(int32_t));
    float *ws = TAKEF(&cv, wstage_elems(b));
    size_t tmp_n = 0; /* the blocks' TEMP slots (dropout): one buffer for every part's, not kept */
    for (int k = 0; k < parts_here(b); k++)
        for (int j = 0; j < 2; j++)
            for (int i = 0; i < b->st[k].g[j].n_slots; i++)
                if (b->st[k].g[j].slot[i].kind == FL_GSLOT_TEMP && B * b->st[k].T * b->st[k].g[j].slot[i].width > tmp_n)
                    tmp_n = B * b->st[k].T * (size_t)b->st[k].g[j].slot[i].width;
    float *tmp = TAKEF(&cv, tmp_n);
    /* bf16 weight-gradient GEMMs (dW += bf16(dy)^T bf16(x), as the decoder-only passes' dw_bf16 and an encoder-
     * decoder's): when a part here computes in bf16 and trains its weights, scratch for the widest LINEAR input and
     * output of every part's graphs at the longest rows (the Q-Former's cross-attention k|v read the image rows) */
    size_t xn = 0, dn = 0, r = P + 1; /* rows: any part's (a cross-attention reads another part's: the image rows) */
    for (int k = 0; k < parts_here(b); k++) r = (size_t)b->st[k].T > r ? (size_t)b->st[k].T : r;
    r *= B;
    for (int k = 0; k < parts_here(b); k++) {
        const fl_model *m = &b->part[k];
        if (!(m->prec.name && m->prec.compute_dtype == FL_BF16 && fl_model_grads_data(m) != NULL)) continue;
        for (int i = 0; i < 2; i++) {
            const fl_block_graph *g = &b->st[k].g[i];
            const size_t in = (size_t)(g->lin_in_max > m->cfg.dim ? g->lin_in_max : m->cfg.dim);
            const size_t out = (size_t)(g->lin_out_max > m->cfg.dim ? g->lin_out_max : m->cfg.dim);
            xn = r * in > xn ? r * in : xn;
            dn = r * out > dn ? r * out : dn;
        }
    }
    if (NL && xn) { /* the language model's head (fl_head_loss): a chunk of its rows, in and out */
        if ((size_t)b->chunk * Ct > xn) xn = (size_t)b->chunk * Ct;
        if ((size_t)b->chunk * V > dn) dn = (size_t)b->chunk * V;
    }
    void *xb = xn ? fl_carve(&cv, xn * sizeof(uint16_t)) : NULL, *db = dn ? fl_carve(&cv, dn * sizeof(uint16_t)) : NULL;
    if (base) b->xb16 = xb, b->dyb16 = db;
    if (base) {
        b->temp = tmp;
        for (int k = 0; k < parts_here(b); k++)
            for (int l = 0; l < b->st[k].L; l++) {
                const fl_block_graph *g = &b->st[k].g[k == FL_BLIP2_QFORMER && fl_blip2_has_xattn(&b->part[k].cfg, l)];
                for (int i = 0; i < g->n_slots; i++)
                    if (g->slot[i].kind == FL_GSLOT_TEMP) b->st[k].layer[l].s[i] = tmp;
            }
    }
    if (base) {
        b->wstage = ws;
        b->patches = pa, b->pe = pe, b->qproj = qp, b->dqproj = dqp, b->dimg = di, b->n_gb = ngb;
        b->logits = lg, b->losses = ls, b->ids = ids, b->dtargets = tg;
    }
    return cv.off;
}

size_t fl_blip2_acts_saved_bytes(const fl_blip2 *b, int part) {
    if (!b->acts || part < 0 || part >= FL_BLIP2_PARTS) return 0;
    const fl_model *m = &b->part[part];
    /* the Flan-T5 language model's own arena keeps all it carves */
    return (part < parts_here(b) ? b->acts_saved[part] : 0) + (m->acts_arena ? m->sizes.acts_bytes : 0);
}

size_t fl_blip2_acts_bytes(const fl_blip2 *b, int part) {
    if (!b->acts || part < 0 || part >= FL_BLIP2_PARTS) return 0;
    const fl_model *m = &b->part[part];
    return (part < parts_here(b) ? b->acts_part[part] : 0) + (m->acts_arena ? m->sizes.acts_bytes : 0);
}

void fl_blip2_free_acts(fl_blip2 *b) {
    for (int k = 0; k < FL_BLIP2_PARTS; k++)
        if (b->part[k].adapt && b->part[k].adapt->h.free_acts && !fl_model_is_s2s(&b->part[k].cfg))
            b->part[k].adapt->h.free_acts(&b->part[k]);
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        free(b->st[k].res), free(b->st[k].layer);
        b->st[k].res = NULL, b->st[k].layer = NULL;
    }
    if (b->acts) fl_mem_free(b->pool, b->acts);
    if (b->work) fl_mem_free(b->pool, b->work);
    if (b->hpatches) fl_mem_free(fl_mem_host_pool(b->pool), b->hpatches);
    free(b->hids), free(b->qrow);
    b->acts = b->work = NULL, b->hids = NULL, b->qrow = NULL, b->hpatches = NULL;
    b->B = 0;
}

/* The arena for B images, T language-model ids (an encoder-decoder's source) and Tt target rows (0: one stack). */
static fl_status alloc_parts(fl_blip2 *b, int B, int T, int Tt) {
    if (B <= 0 || T <= 0 || Tt < 0)
        return fl_errorf(FL_ERR_INVALID, "BLIP-2: micro-batch must be positive (B=%d, T=%d)", B, T);
    const int NQ = b->cfg.n_queries, TL = b->cfg.image_token >= 0 ? T : T + NQ;
    if (Tt == 0 && TL > b->cfg.text.max_seq)
        return fl_errorf(FL_ERR_INVALID, "BLIP-2: %d language-model rows exceed its max_position_embeddings %d", TL,
                         b->cfg.text.max_seq);
    fl_blip2_free_acts(b);
    b->B = B, b->T = T, b->TL = TL;
    const int Ts[FL_BLIP2_PARTS] = {b->cfg.vision.max_seq, NQ, TL};
    fl_status s = FL_OK;
    b->st[2].T = TL;
    for (int k = 0; s == FL_OK && k < parts_here(b); k++) {
        fl_b2_stack *st = &b->st[k];
        memset(st->g, 0, sizeof st->g);
        st->L = b->part[k].cfg.n_layers;
        st->T = Ts[k];
        st->xslot = -1;
        s = fl_block_graph_build(&b->part[k].cfg, &st->g[0]);
        if (s == FL_OK && k == FL_BLIP2_QFORMER) { /* the block with the cross-attention */
            fl_blip2_qformer_block(&b->part[k].cfg, 1, &st->g[1]);
            s = fl_block_graph_finish(&st->g[1]);
            for (int j = 0; j < st->g[1].n_slots; j++)
                if (st->g[1].slot[j].kind == FL_GSLOT_XSTREAM) st->xslot = j;
        }
        st->res = calloc((size_t)st->L + 1, sizeof *st->res);
        st->layer = calloc((size_t)st->L, sizeof *st->layer);
        if (s == FL_OK && (!st->res || !st->layer)) s = fl_errorf(FL_ERR_OOM, "BLIP-2 activation views: out of memory");
    }
    for (int k = 0, below = 0; k < parts_here(b); k++) { /* what trains now decides what the arena saves */
        below |= part_trains(&b->part[k]);
        b->lean[k] = !below;
    }
    b->hids = malloc((size_t)B * TL * sizeof *b->hids);
    b->qrow = malloc((size_t)B * NQ * sizeof *b->qrow);
    if (s == FL_OK && (!b->hids || !b->qrow)) s = fl_errorf(FL_ERR_OOM, "BLIP-2: out of host memory");
    if (s == FL_OK) s = fl_mem_alloc(b->pool, FL_TAG_ACTS, carve_acts(b, NULL), &b->acts);
    if (s == FL_OK) s = fl_mem_alloc(b->pool, FL_TAG_WORKSPACE, carve_work(b, NULL), &b->work);
    /* the pixels patch by patch on the host (B P, 3 p p), as the arena lives: OTHER (megabytes at real sizes) */
    const size_t pk = (size_t)3 * b->cfg.vision.patch_size * b->cfg.vision.patch_size;
    if (s == FL_OK)
        s = fl_mem_alloc(fl_mem_host_pool(b->pool), FL_TAG_OTHER, (size_t)B * npatch(b) * pk * sizeof(float),
                         (void **)&b->hpatches);
    if (s != FL_OK) {
        fl_blip2_free_acts(b);
        return fl_error_prefix(s, "BLIP-2 activations for B=%d, T=%d", B, T);
    }
    carve_acts(b, b->acts);
    carve_work(b, b->work);
    for (int k = 0; s == FL_OK && k < parts_here(b); k++) { /* LoRA adapters' activations, per part's rows */
        fl_model *m = &b->part[k];
        if (m->adapt && m->adapt->h.alloc_acts) s = m->adapt->h.alloc_acts(m, B, b->st[k].T);
    }
    if (s != FL_OK) {
        fl_blip2_free_acts(b);
        return fl_error_prefix(s, "BLIP-2 LoRA activations for B=%d, T=%d", B, T);
    }
    if (Tt > 0) { /* the encoder-decoder's own arena */
        s = fl_model_alloc_acts_s2s(&b->part[2], B, TL, Tt);
        if (s != FL_OK) fl_blip2_free_acts(b);
    }
    return s;
}

fl_status fl_blip2_alloc_acts(fl_blip2 *b, int B, int T) {
    if (fl_model_is_s2s(&b->cfg.text))
        return fl_errorf(FL_ERR_INVALID, "BLIP-2 with %s: an encoder-decoder (fl_blip2_alloc_acts_s2s)",
                         fl_arch_get(b->cfg.text.arch)->display);
    return alloc_parts(b, B, T, 0);
}

fl_status fl_blip2_alloc_acts_s2s(fl_blip2 *b, int B, int Ts, int Tt) {
    if (!fl_model_is_s2s(&b->cfg.text))
        return fl_errorf(FL_ERR_INVALID, "BLIP-2 with %s: one stack (fl_blip2_alloc_acts)",
                         fl_arch_get(b->cfg.text.arch)->display);
    if (Tt <= 0) return fl_errorf(FL_ERR_INVALID, "BLIP-2: target rows must be positive (got %d)", Tt);
    return alloc_parts(b, B, Ts, Tt);
}

/* ---- helpers ------------------------------------------------------------------------------------ */

/* The parameter store (store.h) binds every weight these ops read, as the decoder's and T5's interpreters do:
 * fp32 storage gives the stored entries in place (the pointers the passes always read); 16-bit storage (bf16-true)
 * widens the entries read as fp32 (class token, positions, query tokens, norms, biases) into BLIP-2's own staging
 * (`wstage`, WORKSPACE) and stages each layout group's gradient in fp32 (the store's gstage, added into its 16-bit
 * gradient once per group and micro-batch); the linears read the 16-bit weights directly (fl_linear_set_weight). */

/* Entry (g, r) of part m as fp32, NULL if absent: in place, or widened at *cur (advanced; bind right before use: the
 * next binding from the same start overwrites it). */
static const float *par(const fl_model *m, int g, int r, float **cur) {
    const int i = fl_layout_role(&m->layout, g, (fl_param_role)r);
    return i < 0 ? NULL : fl_store_bind_1d(m->store, i, cur);
}

/* Its gradient: in place (fp32), its place in the open stage of group g (16-bit), NULL without gradients. */
static float *grd(const fl_model *m, int g, int r) {
    const int i = fl_layout_role(&m->layout, g, (fl_param_role)r);
    return i < 0 ? NULL : fl_store_grad(m->store, m->layout.params[i].offset);
}

/* 16-bit storage: group g's gradients (its first n elements: n 0, the whole group) staged in fp32 around their
 * writers, added into the stored gradient once (no-ops in fp32 and without gradients) */
static void stage_open(fl_model *m, int g, size_t n) { fl_store_stage_begin(m->store, n ? n : fl_group_numel(m, g)); }
static fl_status stage_close(fl_model *m, int g, size_t n) {
    return fl_store_stage_flush(m->store, m->layout.group_offset[g], n ? n : fl_group_numel(m, g));
}

/* FSDP FULL_SHARD / ZeRO-3 (a part created sharded: src/train/fsdp.c's provider behind its store): unit g of part m
 * (its layout group) gathered around its use, `next` posted ahead (-1: none); its gradient buffer opened when the part
 * trains and reduce-scattered when its backward is done. No-ops on a whole store (the bits of the passes before). */
static fl_status ugather(fl_model *m, int g, int next) { return fl_store_gather(m->store, g, next); }
static void urelease(fl_model *m, int g) { fl_store_release(m->store, g); }
static fl_status ugrads(fl_model *m, int g) {
    return fl_model_grads_data(m) ? fl_store_grads_begin(m->store, g) : FL_OK;
}
static fl_status uready(fl_model *m, int g) {
    return fl_model_grads_data(m) ? fl_store_grads_ready(m->store, g) : FL_OK;
}

/* A linear of the parts' outer groups (the patch embedding, the language projection); its bias widened at *cur. */
static fl_linear outer_linear(const fl_model *m, int g, int rw, int rb, float **cur) {
    const int wi = fl_layout_role(&m->layout, g, (fl_param_role)rw);
    fl_linear lin = {.in = (int)m->layout.params[wi].shape[1], .out = (int)m->layout.params[wi].shape[0]};
    fl_linear_set_weight(m, &lin, wi);
    lin.b = par(m, g, rb, cur);
    lin.dw = grd(m, g, rw);
    lin.db = grd(m, g, rb);
    return lin;
}

static const fl_block_graph *graph_of(const fl_blip2 *b, int k, int l) {
    return &b->st[k].g[k == FL_BLIP2_QFORMER && fl_blip2_has_xattn(&b->part[k].cfg, l)];
}

/* Dropout's seeds: the language model's micro-batch seed S (fl_model_adapters_seed); its blocks (OPT) 16 + l of S as
 * the decoder's (T5's own: seq2seq.c), the vision tower's and the Q-Former's of their part seeds fl_dropout_seed(S, 8)
 * and (S, 9): the Q-Former's embedding site 0, block l 16 + l. */
static uint64_t part_seed(const fl_blip2 *b, int k) {
    const uint64_t S = b->part[FL_BLIP2_TEXT].drop_seed;
    return k == FL_BLIP2_TEXT ? S : fl_dropout_seed(S, 8 + (uint64_t)k);
}

/* Block l of part k's context: dropout's rates (a dropping pass) and the block's seed. */
static fl_block_ctx ctx_of(const fl_blip2 *b, int k, int l, float *const *dxs) {
    fl_block_ctx x = {.B = b->Bp, .T = b->st[k].T};
    x.Tk = b->st[0].T;
    x.dxs = dxs;
    const fl_model_config *c = &b->part[k].cfg;
    if (b->drop && c->dropout_on) {
        x.drop_p = c->dropout_rate;
        x.attn_drop_p = c->attn_dropout_rate;
        x.drop_seed = fl_dropout_seed(part_seed(b, k), 16 + (uint64_t)l);
    }
    return x;
}

/* The Q-Former's embedding dropout (hidden_dropout_prob on its LayerNorm's output, in place; the backward masks the
 * gradient the same way) */
static fl_status drop_queries(fl_blip2 *b, float *x) {
    const fl_model_config *c = &b->part[FL_BLIP2_QFORMER].cfg;
    if (!b->drop || !fl_drops_hidden(c)) return FL_OK;
    return FL_RUN(b->be, dropout, x, x, (size_t)b->Bp * b->st[FL_BLIP2_QFORMER].T * c->dim, c->dropout_rate,
                  fl_dropout_seed(part_seed(b, FL_BLIP2_QFORMER), 0), 0);
}

/* ---- the ops around the blocks --------------------------------------------------------------------- */

/* The pixels (B, 3, S, S) patch by patch: row (b, p) holds channel, kernel row, kernel column of patch p in the
 * convolution weight's order; then res[0]. */
static fl_status patch_forward(fl_blip2 *b, const float *pixels) {
    const fl_backend *be = b->be;
    const fl_model *m = &b->part[0];
    const int S = m->cfg.image_size, ps = m->cfg.patch_size, G = S / ps, P = G * G, K = 3 * ps * ps, C = m->cfg.dim;
    const int T0 = P + 1, B = b->Bp;
    float *h = b->hpatches; /* arranged on the host (the arena's staging), then copied to the device */
    for (int n = 0; n < B; n++)
        for (int gy = 0; gy < G; gy++)
            for (int gx = 0; gx < G; gx++) {
                float *row = h + ((size_t)n * P + (size_t)gy * G + gx) * K;
                for (int ch = 0; ch < 3; ch++)
                    for (int y = 0; y < ps; y++)
                        memcpy(row + (ch * ps + y) * ps,
                               pixels + (((size_t)n * 3 + ch) * S + (size_t)gy * ps + y) * S + (size_t)gx * ps,
                               (size_t)ps * sizeof *row);
            }
    FL_TRY(FL_RUN(be, to_device, b->patches, h, (size_t)B * P * K * sizeof *h));
    float *cur = b->wstage;
    fl_linear lin = outer_linear(m, 0, FL_ROLE_PATCH_W, FL_ROLE_PATCH_B, &cur);
    FL_TRY(fl_linear_forward(be, b->pe, b->patches, &lin, B * P)); // (B P, C)
    const float *cls = par(m, 0, FL_ROLE_CLS_EMBED, &cur), *pos = par(m, 0, FL_ROLE_POS_EMBED, &cur);
    float *r0 = b->st[0].res[0];
    for (int n = 0; n < B; n++) {
        float *r = r0 + (size_t)n * T0 * C;
        FL_TRY(FL_RUN(be, copy, r, cls, (size_t)C * sizeof(float)));
        FL_TRY(FL_RUN(be, copy, r + C, b->pe + (size_t)n * P * C, (size_t)P * C * sizeof(float)));
        FL_RUN(be, add, r, r, pos, (size_t)T0 * C);
    }
    return FL_OK;
}

/* d res[0] in dres: the patch linear's dW, db (its rows' gradient gathered into gb[1]), the class token's and the
 * positions' gradients summed over the batch. */
static fl_status patch_backward(fl_blip2 *b, const float *dres) {
    const fl_backend *be = b->be;
    fl_model *m = &b->part[0];
    const int C = m->cfg.dim, P = npatch(b), T0 = P + 1, B = b->Bp;
    FL_TRY(ugather(m, 0, -1));
    FL_TRY(ugrads(m, 0));
    stage_open(m, 0, 0);
    float *dcls = grd(m, 0, FL_ROLE_CLS_EMBED), *dpos = grd(m, 0, FL_ROLE_POS_EMBED), *dpe = b->gb[1];
    for (int n = 0; n < B; n++) {
        const float *d = dres + (size_t)n * T0 * C;
        FL_RUN(be, add, dcls, dcls, d, (size_t)C);
        FL_RUN(be, add, dpos, dpos, d, (size_t)T0 * C);
        FL_TRY(FL_RUN(be, copy, dpe + (size_t)n * P * C, d + C, (size_t)P * C * sizeof(float)));
    }
    float *cur = b->wstage;
    fl_linear lin = outer_linear(m, 0, FL_ROLE_PATCH_W, FL_ROLE_PATCH_B, &cur);
    FL_TRY(fl_linear_backward(be, NULL, 0, dpe, b->patches, &lin, B * P));
    FL_TRY(stage_close(m, 0, 0));
    urelease(m, 0);
    return uready(m, 0);
}

/* The learned queries for every image, then the Q-Former's embedding LayerNorm into res[0]. */
static fl_status queries_forward(fl_blip2 *b) {
    const fl_backend *be = b->be;
    const fl_model *m = &b->part[1];
    fl_b2_stack *st = &b->st[1];
    const size_t n = (size_t)st->T * m->cfg.dim;
    float *cur = b->wstage;
    const float *q = par(m, 0, FL_ROLE_QUERY_EMBED, &cur);
    for (int i = 0; i < b->Bp; i++) FL_TRY(FL_RUN(be, copy, st->nin + i * n, q, n * sizeof(float)));
    const float *w = par(m, 0, FL_ROLE_EMB_NORM_W, &cur), *bias = par(m, 0, FL_ROLE_EMB_NORM_B, &cur);
    fl_norm_forward(m, st->res[0], st->nmean, st->nrstd, st->nin, w, bias, b->Bp * st->T);
    return drop_queries(b, st->res[0]);
}

static fl_status queries_backward(fl_blip2 *b, float *dres) {
    const fl_backend *be = b->be;
    fl_model *m = &b->part[1];
    fl_b2_stack *st = &b->st[1];
    const size_t n = (size_t)st->T * m->cfg.dim;
    float *din = b->gb[1], *cur = b->wstage;
    FL_TRY(drop_queries(b, dres)); /* d(the norm's output) through the embedding dropout's mask */
    FL_RUN(be, zero, din, (size_t)b->Bp * n * sizeof(float));
    FL_TRY(ugather(m, 0, -1));
    FL_TRY(ugrads(m, 0));
    stage_open(m, 0, 0);
    fl_norm_backward(m, din, grd(m, 0, FL_ROLE_EMB_NORM_W), grd(m, 0, FL_ROLE_EMB_NORM_B), dres, st->nin,
                     par(m, 0, FL_ROLE_EMB_NORM_W, &cur), st->nmean, st->nrstd, b->Bp * st->T);
    float *dq = grd(m, 0, FL_ROLE_QUERY_EMBED);
    for (int i = 0; dq && i < b->Bp; i++) FL_RUN(be, add, dq, dq, din + i * n, n);
    FL_TRY(stage_close(m, 0, 0));
    urelease(m, 0);
    return uready(m, 0);
}

/* The language model's learned position of row t as fp32 (16-bit storage: widened into the staging). */
static const float *pos_row(const fl_blip2 *b, const fl_model *m, const fl_outer_params *op, int t) {
    const size_t C = (size_t)m->cfg.dim;
    if (op->wpe) return op->wpe + (size_t)t * C;
    FL_RUN(b->be, convert, b->wstage, FL_F32, fl_store_param_at(m->store, op->wpe_off + (size_t)t * C),
           m->store->dtype, C);
    return b->wstage;
}

/* The language model's embeddings, the projected queries in their rows (+ the rows' positions). */
static fl_status embed_forward(fl_blip2 *b) {
    const fl_backend *be = b->be;
    const fl_model *m = &b->part[2];
    const int C = m->cfg.dim, TL = b->st[2].T, NQ = b->cfg.n_queries;
    fl_outer_params op;
    fl_get_outer(m, &op);
    FL_TRY(FL_RUN(be, to_device, b->ids, b->hids, (size_t)b->Bp * TL * sizeof(int32_t)));
    float *r0 = b->st[2].res[0];
    FL_TRY(fl_embed_forward(m, &op, r0, b->ids, b->hids, b->Bp, TL, 0));
    for (int i = 0; i < b->Bp * NQ; i++) {
        const int row = b->qrow[i], t = row % TL;
        float *r = r0 + (size_t)row * C;
        FL_TRY(FL_RUN(be, copy, r, b->qproj + (size_t)i * C, (size_t)C * sizeof(float)));
        FL_RUN(be, add, r, r, pos_row(b, m, &op, t), (size_t)C);
    }
    return FL_OK;
}

/* d res[0] (overwritten): the query rows' gradient to dqproj and their positions', the rest to the embeddings. */
static fl_status embed_backward(fl_blip2 *b, float *dres) {
    const fl_backend *be = b->be;
    fl_model *m = &b->part[2];
    const int C = m->cfg.dim, TL = b->st[2].T, NQ = b->cfg.n_queries;
    FL_TRY(ugrads(m, 0)); /* FSDP: the tables' weights are not read here (tied: opened at the head) */
    fl_outer_params op;
    fl_get_outer(m, &op);
    stage_open(m, 0, 0); /* the rows' positions and the tables' gradients: one stage of group 0 */
    for (int i = 0; i < b->Bp * NQ; i++) {
        const int row = b->qrow[i], t = row % TL;
        float *d = dres + (size_t)row * C;
        FL_TRY(FL_RUN(be, copy, b->dqproj + (size_t)i * C, d, (size_t)C * sizeof(float)));
        if (op.dwpe) FL_RUN(be, add, op.dwpe + (size_t)t * C, op.dwpe + (size_t)t * C, d, (size_t)C);
        FL_RUN(be, zero, d, (size_t)C * sizeof(float));
    }
    /* a frozen language model (the Q-Former trains through it): no table to update */
    if (op.dwte) FL_RUN(be, embedding_backward, op.dwte, op.dwpe, dres, b->ids, b->Bp, TL, C);
    FL_TRY(stage_close(m, 0, 0));
    return uready(m, 0);
}

/* ---- the passes ------------------------------------------------------------------------------------ */

static fl_status blocks_forward(fl_blip2 *b, int k) {
    fl_b2_stack *st = &b->st[k];
    fl_model *m = &b->part[k];
    const int HG = m->layout.n_groups - 1;
    for (int l = 0; l < st->L; l++) {
        FL_TRY(ugather(m, l + 1, l + 2 <= st->L ? l + 2 : HG));
        const fl_block_graph *g = graph_of(b, k, l);
        fl_block_params bp;
        fl_get_block(m, g, l, &bp);
        fl_block_ctx x = ctx_of(b, k, l, NULL);
        FL_TRY(fl_block_forward(m, g, &bp, st->layer[l].s, &x));
        urelease(m, l + 1);
    }
    return ugather(m, HG, -1); /* the group after the blocks (final norm, head; the Q-Former's projection) */
}

/* gb[0] holds d(the stack's last residual rows) on entry and d(res[0]) on return. */
static fl_status blocks_backward(fl_blip2 *b, int k) {
    fl_b2_stack *st = &b->st[k];
    float *dxs[FL_GRAPH_MAX_SLOTS] = {0};
    if (st->xslot >= 0) {
        dxs[st->xslot] = b->dimg;
        FL_RUN(b->be, zero, b->dimg, (size_t)b->Bp * b->st[0].T * b->cfg.vision.dim * sizeof(float));
    }
    const fl_block_graph *live[2] = {NULL, NULL}; /* checkpointing: the graphs whose shared slots hold a block now */
    for (int l = st->L - 1; l >= 0; l--) {
        FL_TRY(ugather(&b->part[k], l + 1, l >= 1 ? l : k == FL_BLIP2_TEXT ? -1 : 0));
        FL_TRY(ugrads(&b->part[k], l + 1));
        const fl_block_graph *g = graph_of(b, k, l);
        fl_block_params bp;
        fl_get_block(&b->part[k], g, l, &bp);
        /* checkpointing: the block's slots again from its saved input, but for the last block of its graph, whose
         * slots the forward left there (the same ops in the same order: the same bits) */
        const int v = g == &st->g[1];
        if (b->part[k].act_ckpt && live[v]) {
            fl_block_ctx fx = ctx_of(b, k, l, NULL);
            FL_TRY(fl_block_forward(&b->part[k], g, &bp, st->layer[l].s, &fx));
            b->part[k].ckpt_recomputed++;
        }
        live[v] = g;
        fl_block_ctx x = ctx_of(b, k, l, dxs);
        for (int i = 0; b->xb16 && i < g->n_ops; i++) /* bf16 dW GEMMs: every trained bf16 linear takes the scratch */
            if (g->op[i].kind == FL_GOP_LINEAR) fl_linear_bind_dw16(&bp.lin[g->op[i].p], b->xb16, b->dyb16);
        stage_open(&b->part[k], l + 1, 0);
        FL_TRY(fl_block_backward(&b->part[k], g, &bp, st->layer[l].s, b->gb, &x));
        FL_TRY(stage_close(&b->part[k], l + 1, 0));
        urelease(&b->part[k], l + 1);
        FL_TRY(uready(&b->part[k], l + 1));
    }
    return FL_OK;
}

fl_status fl_blip2_set_dropout(fl_blip2 *b, int on) {
    if (b->acts) return fl_errorf(FL_ERR_INVALID, "fl_blip2_set_dropout: before the arena (fl_blip2_alloc_acts)");
    for (int k = 0; k < FL_BLIP2_PARTS; k++) {
        fl_model *m = &b->part[k];
        if (fl_model_is_s2s(&m->cfg)) {
            FL_TRY(fl_model_set_dropout(m, on));
            continue;
        }
        if (on && (m->cfg.dropout_rate > 0 || m->cfg.attn_dropout_rate > 0) && !b->be->dropout)
            return fl_errorf(FL_ERR_UNSUPPORTED, "BLIP-2 %s dropout %g / attention %g: backend %s has no dropout op",
                             fl_arch_get(m->cfg.arch)->display, (double)m->cfg.dropout_rate,
                             (double)m->cfg.attn_dropout_rate, b->be->name);
        m->cfg.dropout_on = on != 0;
    }
    return FL_OK;
}

fl_status fl_blip2_set_act_ckpt(fl_blip2 *b, int on) {
    if (b->acts) return fl_errorf(FL_ERR_INVALID, "fl_blip2_set_act_ckpt: before the arena (fl_blip2_alloc_acts)");
    for (int k = 0; k < FL_BLIP2_PARTS; k++) b->part[k].act_ckpt = on != 0;
    return FL_OK;
}

/* The head and the loss over the language model's final norm output (d(its input) in gb[1] in training). */
static fl_status head_loss(fl_blip2 *b, const int32_t *targets, float grad_scale, float *logits_out) {
    fl_model *m = &b->part[2];
    const fl_head_bufs h = {b->st[2].nout, b->gb[1], b->logits, b->losses, b->dtargets, b->chunk, b->xb16, b->dyb16};
    /* 16-bit storage: the head's gradient staged alone, added into its 16-bit gradient after */
    fl_outer_params op;
    fl_get_outer(m, &op);
    const size_t head_n = (size_t)m->cfg.vocab_size * m->cfg.dim;
    const int stage_head = grad_scale > 0 && targets && op.dhead && m->store->g16;
    if (stage_head) fl_store_stage_begin(m->store, head_n);
    FL_TRY(fl_head_loss(m, &h, targets, b->Bp * b->st[2].T, grad_scale, logits_out, &b->loss_sum, &b->n_valid));
    return stage_head ? fl_store_stage_flush(m->store, op.head_off, head_n) : FL_OK;
}

/* Part k's model graph, forward. */
static fl_status part_forward(fl_blip2 *b, int k, const float *pixels, const int32_t *targets, float grad_scale,
                              float *logits_out) {
    fl_model *m = &b->part[k];
    fl_b2_stack *st = &b->st[k];
    fl_model_graph mg;
    FL_TRY(fl_model_graph_build(&m->cfg, &mg));
    const int G = m->layout.n_groups - 1, N = b->Bp * st->T;
    /* FSDP: the units in forward order, group 0 (patch embedding / query tokens / embeddings) first; the language
     * model's stays for its tied head, whose gradient (and the final norm's) opens with the head */
    const int keep0 = k == FL_BLIP2_TEXT && m->cfg.tie_embeddings;
    FL_TRY(ugather(m, 0, st->L > 0 ? 1 : G));
    int after = 0;
    for (int i = 0; i < mg.n_ops; i++) {
        switch ((fl_mop_kind)mg.op[i].kind) {
        case FL_MOP_PATCH: FL_TRY(patch_forward(b, pixels)); break;
        case FL_MOP_QUERIES: FL_TRY(queries_forward(b)); break;
        case FL_MOP_EMBED: FL_TRY(embed_forward(b)); break;
        case FL_MOP_NORM:
            if (after) { /* the final norm; QUERIES ran the embedding norm already */
                float *cur = b->wstage;
                const float *w = par(m, G, mg.op[i].role_w, &cur), *bias = par(m, G, mg.op[i].role_b, &cur);
                fl_norm_forward(m, st->nout, st->nmean, st->nrstd, st->res[st->L], w, bias, N);
            }
            break;
        case FL_MOP_BLOCKS:
            if (!keep0) urelease(m, 0);
            FL_TRY(blocks_forward(b, k));
            after = 1;
            break;
        case FL_MOP_OUTPUT: break; /* nout (or res[L] without a final norm) is what the next part reads */
        case FL_MOP_HEAD_LM:
            if (grad_scale > 0 && targets) { /* the head's gradient (tied: the embeddings') is written here */
                FL_TRY(ugrads(m, G));
                if (keep0) FL_TRY(ugrads(m, 0));
            }
            FL_TRY(head_loss(b, targets, grad_scale, logits_out));
            break;
        default:
            return fl_errorf(FL_ERR_UNSUPPORTED, "BLIP-2 %s: model graph op %d is not executed here",
                             fl_arch_get(m->cfg.arch)->display, mg.op[i].kind);
        }
    }
    urelease(m, 0);
    /* the last group stays gathered where the backward reads it next: the Q-Former's projection (project_forward),
     * a training forward's final norm of the language model */
    if (k == FL_BLIP2_VISION || (k == FL_BLIP2_TEXT && !(grad_scale > 0 && targets))) urelease(m, G);
    return FL_OK;
}

/* The Q-Former's output (its last residual rows) through the language projection into qproj. */
static fl_status project_forward(fl_blip2 *b) {
    fl_model *m = &b->part[1];
    FL_TRY(ugather(m, m->layout.n_groups - 1, -1)); /* gathered after the blocks already */
    float *cur = b->wstage;
    fl_linear lin = outer_linear(m, m->layout.n_groups - 1, FL_ROLE_LMPROJ_W, FL_ROLE_LMPROJ_B, &cur);
    fl_status s = fl_linear_forward(b->be, b->qproj, b->st[1].res[b->st[1].L], &lin, b->Bp * b->st[1].T);
    urelease(&b->part[1], m->layout.n_groups - 1);
    return s;
}

/* The language model's ids with the queries' rows: the placeholders in order, or NQ rows in front (id 0, replaced). */
static fl_status place_queries(fl_blip2 *b, const int32_t *ids, int B, int T) {
    const int NQ = b->cfg.n_queries, TL = b->st[2].T, V = b->cfg.text.vocab_size, it = b->cfg.image_token;
    for (int n = 0; n < B; n++) {
        int q = 0;
        for (int t = 0; t < TL; t++) {
            const int pre = it < 0 && t < NQ, id = pre ? 0 : ids[(size_t)n * T + t - (it < 0 ? NQ : 0)];
            if (id < 0 || id >= V)
                return fl_errorf(FL_ERR_INVALID, "token id %d at position %d of sequence %d is outside the vocabulary "
                                 "[0, %d)", id, t, n, V);
            if (pre || id == it) {
                if (q == NQ)
                    return fl_errorf(FL_ERR_INVALID, "sequence %d has more than num_query_tokens = %d image tokens (id "
                                     "%d)", n, NQ, it);
                b->qrow[n * NQ + q++] = n * TL + t;
            }
            b->hids[(size_t)n * TL + t] = id;
        }
        if (q != NQ)
            return fl_errorf(FL_ERR_INVALID, "sequence %d has %d image tokens (id %d), not num_query_tokens = %d", n, q,
                             it, NQ);
    }
    return FL_OK;
}

/* Each part in this arena: the shape of its last forward and whether it was a training one (what the LoRA adapters'
 * live rows follow: fl_model_adapter_live_rows; fl_blip2_live). */
static void mark_parts(fl_blip2 *b, int train) {
    for (int k = 0; k < parts_here(b); k++) {
        b->part[k].fwd_B = b->Bp, b->part[k].fwd_T = b->st[k].T;
        b->part[k].fwd_train = train;
    }
}

/* The image parts: checks, the queries' rows among the language model's, the vision tower, the Q-Former and the
 * projection (qproj). */
static fl_status front(fl_blip2 *b, const char *fn, const float *pixels, const int32_t *ids, const int32_t *targets,
                       int B, int T, float grad_scale) {
    if (!b->acts) return fl_errorf(FL_ERR_INVALID, "%s: activations not allocated (fl_blip2_alloc_acts)", fn);
    if (B <= 0 || T <= 0 || B > b->B || T != b->T)
        return fl_errorf(FL_ERR_INVALID, "%s: batch %d x %d does not fit the arena's %d x %d", fn, B, T, b->B, b->T);
    int any = 0;
    for (int k = 0; k < FL_BLIP2_PARTS; k++) any |= part_trains(&b->part[k]);
    if (grad_scale > 0 && (!targets || !any))
        return fl_errorf(FL_ERR_INVALID, "%s: a training forward needs targets and a part that trains (gradient "
                         "buffers or LoRA adapters: fl_blip2_alloc_grads / fl_blip2_alloc_grads_parts)", fn);
    for (int k = 0, below = 0; grad_scale > 0 && k < parts_here(b); k++) {
        below |= part_trains(&b->part[k]);
        if (below && b->lean[k])
            return fl_errorf(FL_ERR_INVALID, "%s: the arena saves no activations of the %s (it trained nothing, nor did "
                             "a part before it, when fl_blip2_alloc_acts ran): allocate the arena after the gradients "
                             "and adapters", fn, k == FL_BLIP2_VISION ? "vision tower" : k == FL_BLIP2_QFORMER ?
                             "Q-Former" : "language model");
    }
    b->Bp = B;
    b->Tp = T;
    b->fwd_train = 0;
    b->drop = grad_scale > 0; /* dropout (the parts' dropout_on) in training forwards only */
    b->loss_sum = 0;
    b->n_valid = 0;
    FL_TRY(place_queries(b, ids, B, T));
    FL_TRY(part_forward(b, FL_BLIP2_VISION, pixels, NULL, 0, NULL));
    FL_TRY(part_forward(b, FL_BLIP2_QFORMER, NULL, NULL, 0, NULL));
    return project_forward(b);
}

fl_status fl_blip2_forward(fl_blip2 *b, const float *pixels, const int32_t *ids, const int32_t *targets, int B, int T,
                           float grad_scale, float *logits_out, float *loss) {
    if (fl_model_is_s2s(&b->cfg.text))
        return fl_errorf(FL_ERR_INVALID, "fl_blip2_forward: the language model is an encoder-decoder "
                         "(fl_blip2_forward_s2s)");
    FL_TRY(front(b, "fl_blip2_forward", pixels, ids, targets, B, T, grad_scale));
    int32_t *tg = NULL;
    if (targets && b->cfg.image_token < 0) { /* the prepended rows have no label */
        const int NQ = b->cfg.n_queries, TL = b->st[2].T;
        tg = malloc((size_t)B * TL * sizeof *tg);
        if (!tg) return fl_errorf(FL_ERR_OOM, "BLIP-2 targets: out of host memory");
        for (int n = 0; n < B; n++)
            for (int t = 0; t < TL; t++) tg[n * TL + t] = t < NQ ? FL_IGNORE_INDEX : targets[n * T + t - NQ];
        targets = tg;
    }
    fl_status s = part_forward(b, FL_BLIP2_TEXT, NULL, targets, grad_scale, logits_out);
    free(tg);
    if (s != FL_OK) return s;
    if (loss) *loss = b->n_valid ? (float)(b->loss_sum / b->n_valid) : 0.0f;
    b->fwd_train = grad_scale > 0;
    mark_parts(b, b->fwd_train);
    return FL_OK;
}

/* The encoder-decoder's source rows of the queries come from qproj (its backward leaves their gradient in dqproj). */
static void set_inject(fl_blip2 *b) {
    fl_model *lm = &b->part[2];
    lm->emb_inject.rows = b->qrow;
    lm->emb_inject.n = b->Bp * b->cfg.n_queries;
    lm->emb_inject.src = b->qproj;
    lm->emb_inject.dsrc = b->dqproj;
}

fl_status fl_blip2_forward_s2s(fl_blip2 *b, const float *pixels, const int32_t *ids, const int32_t *dec,
                               const int32_t *targets, int B, int Ts, int Tt, float grad_scale, float *logits_out,
                               float *loss) {
    if (!fl_model_is_s2s(&b->cfg.text))
        return fl_errorf(FL_ERR_INVALID, "fl_blip2_forward_s2s: the language model has one stack (fl_blip2_forward)");
    FL_TRY(front(b, "fl_blip2_forward_s2s", pixels, ids, targets, B, Ts, grad_scale));
    fl_model *lm = &b->part[2];
    set_inject(b);
    FL_TRY(fl_model_forward_s2s(lm, b->hids, NULL, dec, targets, B, b->st[2].T, Tt, grad_scale, logits_out));
    if (loss) *loss = lm->n_valid ? (float)(lm->loss_sum / (double)lm->n_valid) : 0.0f;
    b->fwd_train = grad_scale > 0;
    mark_parts(b, b->fwd_train);
    return FL_OK;
}

/* Part k's final norm backward: d(its output) in dout, d(its input) into gb[0] (zeroed by the caller). Its group's
 * 1-D entries open it (the head after them was staged alone in the forward). */
static fl_status final_norm_backward(fl_blip2 *b, int k, const float *dout) {
    fl_model *m = &b->part[k];
    const fl_b2_stack *st = &b->st[k];
    const int G = m->layout.n_groups - 1;
    const size_t n1 = fl_outer_1d(m);
    float *cur = b->wstage;
    FL_TRY(ugather(m, G, st->L > 0 ? st->L : -1)); /* the language model's: kept from the forward */
    FL_TRY(ugrads(m, G));
    stage_open(m, G, n1);
    fl_norm_backward(m, b->gb[0], grd(m, G, FL_ROLE_NORM_F_W), grd(m, G, FL_ROLE_NORM_F_B), dout, st->res[st->L],
                     par(m, G, FL_ROLE_NORM_F_W, &cur), st->nmean, st->nrstd, b->Bp * st->T);
    FL_TRY(stage_close(m, G, n1));
    urelease(m, G);
    return uready(m, G);
}

fl_status fl_blip2_backward(fl_blip2 *b) {
    if (!b->fwd_train) return fl_errorf(FL_ERR_INVALID, "fl_blip2_backward: needs a preceding training forward");
    const fl_backend *be = b->be;
    b->fwd_train = 0;
    mark_parts(b, 0);
    for (int k = 0; k < parts_here(b); k++) b->part[k].ckpt_recomputed = 0;
    /* the language model: d(final norm out) in gb[1] from the head */
    fl_model *lm = &b->part[2], *qf = &b->part[1], *vm = &b->part[0];
    fl_b2_stack *st = &b->st[2];
    int G = lm->layout.n_groups - 1, N = b->Bp * st->T;
    if (fl_model_is_s2s(&lm->cfg)) { /* its own passes; the queries' rows' gradient in dqproj */
        FL_TRY(fl_model_backward_s2s(lm));
    } else {
        FL_RUN(be, zero, b->gb[0], (size_t)N * lm->cfg.dim * sizeof(float));
        FL_TRY(final_norm_backward(b, FL_BLIP2_TEXT, b->gb[1]));
        FL_TRY(blocks_backward(b, FL_BLIP2_TEXT));
        FL_TRY(embed_backward(b, b->gb[0]));
    }
    /* the image parts only as far back as something trains: a frozen vision tower (the default of a fine-tuning run)
     * ends the pass after the Q-Former, a frozen Q-Former too after the language model */
    if (!part_trains(qf) && !part_trains(vm)) return FL_OK;
    /* the projection: d(Q-Former output) into gb[0] */
    G = qf->layout.n_groups - 1;
    float *cur = b->wstage;
    FL_TRY(ugather(qf, G, b->st[1].L > 0 ? b->st[1].L : 0));
    FL_TRY(ugrads(qf, G));
    fl_linear proj = outer_linear(qf, G, FL_ROLE_LMPROJ_W, FL_ROLE_LMPROJ_B, &cur);
    stage_open(qf, G, 0);
    FL_TRY(fl_linear_backward(be, b->gb[0], 0, b->dqproj, b->st[1].res[b->st[1].L], &proj, b->Bp * b->st[1].T));
    FL_TRY(stage_close(qf, G, 0));
    urelease(qf, G);
    FL_TRY(uready(qf, G));
    FL_TRY(blocks_backward(b, FL_BLIP2_QFORMER)); /* d(image features) into dimg */
    FL_TRY(queries_backward(b, b->gb[0]));
    if (!part_trains(vm)) return FL_OK;
    /* the vision tower from d(its output) */
    N = b->Bp * b->st[0].T;
    FL_RUN(be, zero, b->gb[0], (size_t)N * vm->cfg.dim * sizeof(float));
    FL_TRY(final_norm_backward(b, FL_BLIP2_VISION, b->dimg));
    FL_TRY(blocks_backward(b, FL_BLIP2_VISION));
    return patch_backward(b, b->gb[0]);
}

/* ---- greedy captioning ------------------------------------------------------------------------------ */

/* The Flan-T5 variant: the source (placeholders, prompt) through the encoder once, greedy decoding with the cache;
 * the new ids after the decoder's start token. */
static fl_status gen_s2s(fl_blip2 *b, const float *pixels, const int32_t *src, int ns, int max_new, int32_t *out,
                         int *n_out) {
    int32_t *o = malloc(((size_t)max_new + 1) * sizeof *o);
    if (!o) return fl_errorf(FL_ERR_OOM, "BLIP-2 captioning: out of host memory");
    int n = 0;
    fl_status s = fl_blip2_alloc_acts_s2s(b, 1, ns, max_new);
    if (s == FL_OK) s = front(b, "BLIP-2 captioning", pixels, src, NULL, 1, ns, 0);
    if (s == FL_OK) {
        set_inject(b);
        s = fl_model_generate_s2s(&b->part[2], b->hids, NULL, ns, max_new, 1, o, &n);
    }
    for (int i = 1; s == FL_OK && i < n; i++) out[(*n_out)++] = o[i];
    free(o);
    return s;
}

fl_status fl_blip2_generate(fl_blip2 *b, const float *pixels, const int32_t *prompt, int n_prompt, int max_new,
                            int32_t *out, int *n_out, fl_gen_stop *why) {
    *n_out = 0;
    if (why) *why = FL_GEN_STOP_MAX_TOKENS;
    if (max_new < 0 || n_prompt < 0)
        return fl_errorf(FL_ERR_INVALID, "BLIP-2 captioning: max_new_tokens must be >= 0 (got %d)", max_new);
    const int NQ = b->cfg.n_queries, it = b->cfg.image_token, V = b->cfg.text.vocab_size;
    /* the ids: the placeholders (when the config has image_token_index), BOS, the prompt; the language model's rows
     * also hold the queries in front without it */
    const int head = (it >= 0 ? NQ : 0) + (b->cfg.bos_id >= 0 ? 1 : 0) + n_prompt, rows = head + (it >= 0 ? 0 : NQ);
    const int s2s = fl_model_is_s2s(&b->cfg.text), ctx = b->cfg.text.max_seq;
    if (!s2s && rows > ctx) /* as fl_generate refuses a prompt longer than the context */
        return fl_errorf(FL_ERR_INVALID, "BLIP-2 captioning: the %d query tokens, BOS and a prompt of %d tokens (%d "
                         "positions) exceed the language model's context of %d", NQ, n_prompt, rows, ctx);
    if (max_new == 0) return FL_OK;
    int32_t *ids = malloc((size_t)head * sizeof *ids);
    float *lg = malloc((size_t)V * sizeof *lg); /* the last row's logits */
    if (!ids || !lg) {
        free(ids), free(lg);
        return fl_errorf(FL_ERR_OOM, "BLIP-2 captioning: out of host memory");
    }
    int n = 0;
    for (int i = 0; it >= 0 && i < NQ; i++) ids[n++] = it;
    if (b->cfg.bos_id >= 0) ids[n++] = b->cfg.bos_id;
    for (int i = 0; i < n_prompt; i++) ids[n++] = prompt[i];
    fl_status s = FL_OK;
    if (s2s) { /* the source once, then the decoder's cache */
        free(lg);
        s = gen_s2s(b, pixels, ids, n, max_new, out, n_out);
        free(ids);
        return s;
    }
    /* the image parts once, then the language model with its KV cache (the sequence up to the context, as
     * fl_generate's): the prefill takes the projected queries in their rows (fl_model.emb_inject), each new token one
     * decode step */
    fl_model *lm = &b->part[2];
    fl_kv_cache kv;
    memset(&kv, 0, sizeof kv);
    s = fl_blip2_alloc_acts(b, 1, n);
    if (s == FL_OK) s = front(b, "BLIP-2 captioning", pixels, ids, NULL, 1, n, 0);
    if (s == FL_OK) s = fl_kv_cache_init(&kv, lm, (long)b->TL + max_new < ctx ? b->TL + max_new : ctx);
    if (s == FL_OK) {
        lm->emb_inject.rows = b->qrow, lm->emb_inject.n = NQ, lm->emb_inject.src = b->qproj, lm->emb_inject.dsrc = NULL;
        s = fl_model_prefill(lm, &kv, b->hids, b->TL, lg);
        lm->emb_inject.n = 0;
    }
    while (s == FL_OK && *n_out < max_new) {
        if (kv.pos >= kv.max_T) { /* the prompt filled the context: no room for a token */
            if (why) *why = FL_GEN_STOP_CONTEXT;
            break;
        }
        int best = 0;
        for (int v = 1; v < V; v++)
            if (lg[v] > lg[best]) best = v; /* the first of equal maxima, as torch.argmax */
        out[(*n_out)++] = best;
        if (best == b->cfg.eos_id || (lm->eos.n && fl_model_is_eos(lm, best))) {
            if (why) *why = FL_GEN_STOP_EOS;
            break;
        }
        if (*n_out == max_new) break;
        if (kv.pos + 1 >= kv.max_T) { /* the sequence reached the context: stop without a wasted decode */
            if (why) *why = FL_GEN_STOP_CONTEXT;
            break;
        }
        s = fl_model_decode(lm, &kv, best, lg);
    }
    fl_kv_cache_free(&kv);
    free(ids), free(lg);
    return s;
}
