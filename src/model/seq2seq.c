/* The model graph interpreted over several stacks (graph.h fl_model_graph): an encoder-decoder's training passes.
 * Each stack is its ops in order (EMBED, RELBIAS, BLOCKS, NORM, then OUTPUT: the stream the next stack's blocks
 * read as their XSTREAM slot, or HEAD_LM: the chunked head and cross-entropy); the backward runs the stacks in
 * reverse, the last stack's cross-attention gradients accumulating into d(the earlier stack's output), which then
 * starts that stack's backward. The blocks are the block graph's executors (graph.c), one graph per stack.
 * Written as the interpreter the decoder-only passes (transformer.c) are to be folded into (issue 29): nothing here
 * knows T5 but the relative position buckets (T5's, the only RELBIAS there is).
 *
 * The arena (seq2seq_acts.c): per stack its residual stream (L + 1 views of B x T rows), every block's saved slots (an XSTREAM's
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

#include "seq2seq-impl.h"
#include "store.h"
#include "fitllm/comm.h"
#include "fitllm/generate.h"


/* ---- relative position bias (T5) ------------------------------------------------------------- */

/* transformers' T5Attention._relative_position_bucket of rel = key j - query i, in its float32 arithmetic:
 * bidirectional (the encoder) halves the buckets between keys after and before the query; causal (the decoder)
 * sees only keys before it. Small distances get a bucket each, larger ones logarithmic bins up to max_dist. */
static int32_t rel_bucket(int rel, int bidir, int buckets, int max_dist) {
    int ret = 0, nb = buckets, n;
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

/* The buckets of Tq queries at positions q0 .. q0 + Tq - 1 and keys 0 .. Tk - 1, one per diagonal (the backend's
 * relbias ops: query i, key j take rb[j - i + Tq - 1]), into the stack's device array. */
static fl_status relbias_buckets(fl_model *m, s2s_stack *st, int q0, int Tq, int Tk, int bidir) {
    const int nd = Tq + Tk - 1;
    int32_t *rb = malloc((size_t)nd * sizeof *rb);
    if (!rb) return fl_errorf(FL_ERR_OOM, "relative position buckets: out of host memory");
    for (int k = 0; k < nd; k++) rb[k] = rel_bucket(k - (Tq - 1) - q0, bidir, m->cfg.rel_buckets, m->cfg.rel_max_dist);
    fl_status s = FL_RUN(m->be, to_device, st->buckets, rb, (size_t)nd * sizeof *rb);
    free(rb);
    return s;
}

static fl_status relbias_table(const fl_model *m, const s2s_stack *st, int grad, float **tab);

/* bias (NH, T, T) = table (NH, buckets) at each (query, key)'s bucket (the backend's relbias_forward) */
static fl_status relbias_forward(fl_model *m, s2s_stack *st, int T, int bidir) {
    FL_TRY(relbias_buckets(m, st, 0, T, T, bidir));
    float *tab;
    FL_TRY(relbias_table(m, st, 0, &tab));
    return FL_RUN(m->be, relbias_forward, st->bias, tab, st->buckets, m->cfg.n_heads, T, T, m->cfg.rel_buckets);
}

/* d(table) += dbias summed per bucket (the backend's relbias_backward: no atomics, one order on every backend) */
static fl_status relbias_backward(fl_model *m, s2s_stack *st, int T) {
    float *dtab = NULL;
    if (relbias_table(m, st, 1, &dtab) != FL_OK || !dtab) return FL_OK; /* the base is frozen (LoRA) */
    return FL_RUN(m->be, relbias_backward, dtab, st->dbias, st->buckets, m->cfg.n_heads, T, T, m->cfg.rel_buckets);
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

/* A pipeline stage (cfg.pp_enc > 0, fitllm/pp.h): stack s's embedding runs where the stage holds the stack's first
 * block, its final norm (and the decoder's head) where it holds the last; block l of stack s is block
 * fl_s2s_block_index of the whole model (its dropout sites). A whole model runs every end. */
int fl_s2s_runs_embed(const fl_model *m, int s) {
    const fl_model_config *c = &m->cfg;
    if (c->pp_enc <= 0) return 1;
    return s == 0 ? c->n_layers > 0 && c->pp_first == 0 : c->n_dec_layers > 0 && c->pp_first <= c->pp_enc;
}
int fl_s2s_runs_norm(const fl_model *m, int s) {
    const fl_model_config *c = &m->cfg;
    if (c->pp_enc <= 0) return 1;
    return s == 0 ? c->n_layers > 0 && c->pp_first + c->n_layers == c->pp_enc : c->n_dec_layers > 0 && !m->stage.out;
}
static int block_index(const fl_model *m, const s2s_stack *st, int s, int l) {
    const fl_model_config *c = &m->cfg;
    if (c->pp_enc <= 0) return st->l0 + l;
    return s == 0 ? c->pp_first + l : (c->pp_first > c->pp_enc ? c->pp_first : c->pp_enc) + l;
}

/* the dropout of a stack's embedding (site 2s) or final norm output (2s + 1) over n values: in a training forward
 * and, for the gradient, in its backward (the same mask); nothing without dropout */
static fl_status drop_rows(const fl_model *m, float *x, size_t n, int site) {
    const float p = m->acts->s2s->drop_p;
    return p > 0 ? FL_RUN(m->be, dropout, x, x, n, p, drop_site(m, site), 0) : FL_OK;
}

/* sequence parallel: the same over the rank's n rows, the whole pass's mask at them (its rows from row0 on:
 * keep(seed, i0 + j) = keep(seed + i0 K, j), K the mask's increment, fitllm/lora.h) */
static fl_status drop_part(const fl_model *m, float *x, int n, size_t row0, int site) {
    const float p = m->acts->s2s->drop_p;
    const uint64_t at = (uint64_t)(row0 * (size_t)m->cfg.dim) * 0x9E3779B97F4A7C15ULL;
    return p > 0 ? FL_RUN(m->be, dropout, x, x, (size_t)n * m->cfg.dim, p, drop_site(m, site) + at, 0) : FL_OK;
}

static fl_block_ctx stack_ctx(const fl_model *m, const struct fl_s2s_acts *a, int s, int l, float *const *dxs) {
    fl_block_ctx x = {.B = a->Bp, .T = a->T[s], .drop_p = a->drop_p, .attn_drop_p = a->drop_p, /* T5: one rate */
                      .comm = m->tp_comm}; /* TP: the blocks' sums */
    x.drop_seed = drop_site(m, 16 + block_index(m, &a->st[s], s, l));
    x.kmask = a->kmask_on ? a->kmask : NULL; /* the first stack's keys: its self-attention's and the cross-attention's */
    x.attn_bias = a->st[s].bias;
    x.Tk = s > 0 ? a->T[s - 1] : a->T[s];
    x.dxs = dxs;
    return x;
}

/* 16-bit saved activations: block l of stack st's WIDE slots from the shared fp32 buffer into its 16-bit copies
 * (narrow, after its training forward) or back (before its backward); no-ops otherwise. skip (bit k): slots left
 * alone (narrow: the forward stored them already, gemm16; widen: the backward reads their bf16 copies only). */
static fl_status saved16(const fl_model *m, const s2s_stack *st, int l, int narrow, unsigned skip) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    if (!a->act16) return FL_OK;
    const int s = (int)(st - a->st);
    const fl_layer_acts *la = &st->layer[l];
    void *dst[FL_GRAPH_MAX_SLOTS];
    const void *src[FL_GRAPH_MAX_SLOTS];
    size_t len[FL_GRAPH_MAX_SLOTS];
    int cnt = 0;
    for (int k = 0; k < st->g.n_prod; k++) {
        const int sl = st->g.prod[k];
        if (st->g.slot[sl].kind != FL_GSLOT_WIDE || (skip >> sl & 1u)) continue;
        dst[cnt] = narrow ? (void *)la->s16[sl] : (void *)la->s[sl];
        src[cnt] = narrow ? (const void *)la->s[sl] : (const void *)la->s16[sl];
        len[cnt++] = slot_n(a, s, sl, a->T, (size_t)a->Bp) * (size_t)st->g.slot[sl].width;
    }
    return fl_convert_list(m->be, cnt, dst, narrow ? a->act16 : FL_F32, src, narrow ? FL_F32 : a->act16, len);
}

/* bf16 saved slots (issue 30 item 1): block l's copies as the pass's s16, so the forward stores the slots only bf16
 * GEMMs read as it writes them (fl_block_ctx.gemm16) and the backward reads the copies where the backend's ops take
 * bf16 (the weight gradients' x, the norms' inputs), widening only the slots it reads in fp32; the same bits */
int fl_s2s_test_no16;
static void ctx16(const struct fl_s2s_acts *a, const s2s_stack *st, int l, fl_block_ctx *x, int fwd) {
    if (a->act16 != FL_BF16 || fl_s2s_test_no16) return;
    x->s16 = st->layer[l].s16;
    x->gemm16 = fwd;
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
    if (m->adapt && m->adapt->merged) /* the adapters are in the weights: running them again would double them */
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
    const fl_head_bufs h = {x, a->gb[1], a->logits, a->losses, a->targets, a->chunk, NULL, NULL};
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
        case FL_MOP_EMBED: {
            if (!fl_s2s_runs_embed(m, s)) break; /* a later pipeline stage: res[0] is the previous stage's */
            FL_TRY(FL_RUN(be, to_device, st->ids, ids, (size_t)N * sizeof *ids));
            float *e = a->spp ? a->gb[0] : st->res[0]; /* sequence parallel: the whole rows, the rank's kept */
            FL_TRY(fl_embed_forward(m, &op, e, st->ids, ids, a->Bp, T, 0)); /* TP: summed over the group */
            if (s == 0) FL_TRY(inject_rows(m, e, NULL));
            FL_TRY(drop_rows(m, e, (size_t)N * m->cfg.dim, 2 * s)); /* after any injected rows (as HF) */
            if (a->spp) {
                size_t r0;
                const int n = fl_sp_part(m, N, &r0);
                FL_TRY(FL_RUN(be, copy, st->res[0], e + r0 * m->cfg.dim, (size_t)n * m->cfg.dim * sizeof(float)));
            }
            break;
        }
        case FL_MOP_RELBIAS: /* the table is in the stack's first block's group */
            if (st->L == 0) break; /* a pipeline stage without blocks of the stack */
            FL_TRY(block_gather(m, st->l0 + 1));
            FL_TRY(relbias_forward(m, st, T, s < mg->n_stacks - 1));
            break;
        case FL_MOP_BLOCKS:
            for (int l = 0; l < st->L; l++) {
                FL_TRY(block_gather(m, st->l0 + l + 1));
                fl_block_params bp;
                fl_get_block(m, &st->g, st->l0 + l, &bp);
                fl_block_ctx x = stack_ctx(m, a, s, l, NULL);
                if (grad_scale > 0) ctx16(a, st, l, &x, 1);
                FL_TRY(fl_block_forward(m, &st->g, &bp, st->layer[l].s, &x));
                if (grad_scale > 0) FL_TRY(saved16(m, st, l, 1, fl_block_gemm16_slots(&st->g, &bp, &x)));
                fl_store_release(m->store, st->l0 + l + 1);
            }
            break;
        case FL_MOP_NORM:
            if (!fl_s2s_runs_norm(m, s)) break; /* a pipeline stage before the stack's end */
            if (a->spp) { /* sequence parallel: the rank's rows (their part of the whole mask), then the whole rows */
                size_t r0;
                const int n = fl_sp_part(m, N, &r0);
                float *no = st->nout + r0 * m->cfg.dim;
                fl_norm_forward(m, no, NULL, st->nrstd, st->res[st->L], param_of(m, G, mg->op[i].role_w, 0), NULL, n);
                FL_TRY(drop_part(m, no, n, r0, 2 * s + 1));
                FL_TRY(fl_sp_gather(m, no, st->nout, N));
                break;
            }
            fl_norm_forward(m, st->nout, NULL, st->nrstd, st->res[st->L], param_of(m, G, mg->op[i].role_w, 0), NULL, N);
            FL_TRY(drop_rows(m, st->nout, (size_t)N * m->cfg.dim, 2 * s + 1));
            break;
        case FL_MOP_OUTPUT: break; /* nout is the next stack's XSTREAM (bound when carved) */
        case FL_MOP_HEAD_LM:
            if (a->head.defer) { /* the step's "head" phase: fl_model_forward_head runs it (s2s_head) */
                a->head.targets = targets, a->head.grad_scale = grad_scale, a->head.N = N, a->head.open = 1;
                break;
            }
            if (fl_s2s_runs_norm(m, s)) FL_TRY(head_run(m, targets, N, grad_scale, logits_out));
            break;
        default:
            return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_forward_s2s: model graph op %d is not executed in a stack",
                             mg->op[i].kind);
        }
    }
    return FL_OK;
}

/* Sequence parallelism: a pass whose B Ts or B Tt rows the group does not divide runs B' > B sequences (the fewest it
 * divides both ways, at most the arena's B, a multiple of the group): the added ones are sources of token 0 that the
 * key padding mask hides entirely (no real query sees them, their own queries see nothing: out 0, no gradient) and
 * decoder inputs of token 0 with ignored targets. The real sequences' rows keep their places, so their values, dropout
 * masks (indexed from the pass's first element), losses and gradients are the unpadded pass's. The arrays are
 * replaced by host copies in a->pad; *B the padded count. */
static fl_status sp_pad(fl_model *m, const int32_t **src, const uint8_t **mask, const int32_t **dec,
                        const int32_t **tg, int *B, int Ts, int Tt) {
    struct fl_s2s_acts *a = m->acts->s2s;
    const int n = a->sp, B0 = *B;
    int Bp = B0;
    while (n > 1 && ((Bp * Ts) % n || (Bp * Tt) % n)) Bp++;
    if (Bp == B0) return FL_OK;
    if (Bp > a->B) return fl_errorf(FL_ERR_INTERNAL, "sequence parallel: %d padded sequences exceed the arena's %d", Bp, a->B);
    const size_t ns = (size_t)a->B * a->st[0].Tmax, nt = (size_t)a->B * a->st[1].Tmax;
    if (!a->pad && !(a->pad = malloc((ns * 2 + nt * 2) * sizeof *a->pad)))
        return fl_errorf(FL_ERR_OOM, "sequence parallel: out of host memory for a padded batch");
    int32_t *ps = a->pad, *pd = ps + ns, *pt = pd + nt;
    uint8_t *pm = (uint8_t *)(pt + nt);
    const size_t s0 = (size_t)B0 * Ts, t0 = (size_t)B0 * Tt, s1 = (size_t)Bp * Ts, t1 = (size_t)Bp * Tt;
    memcpy(ps, *src, s0 * sizeof *ps);
    memset(ps + s0, 0, (s1 - s0) * sizeof *ps);
    if (*mask) memcpy(pm, *mask, s0);
    else memset(pm, 1, s0);
    memset(pm + s0, 0, s1 - s0);
    memcpy(pd, *dec, t0 * sizeof *pd);
    memset(pd + t0, 0, (t1 - t0) * sizeof *pd);
    if (*tg) {
        memcpy(pt, *tg, t0 * sizeof *pt);
        for (size_t i = t0; i < t1; i++) pt[i] = FL_IGNORE_INDEX;
        *tg = pt;
    }
    *src = ps, *mask = pm, *dec = pd, *B = Bp;
    return FL_OK;
}

/* defer: stop before the head (fl_model_forward_s2s_body; fl_model_forward_head runs it). */
static fl_status s2s_forward(fl_model *m, const int32_t *src_ids, const uint8_t *src_mask, const int32_t *dec_ids,
                             const int32_t *targets, int B, int Ts, int Tt, float grad_scale, float *logits_out,
                             int defer) {
    FL_TRY(check_model(m, "fl_model_forward_s2s"));
    struct fl_s2s_acts *a = m->acts->s2s;
    if (a->gen)
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward_s2s: the arena is generation's (fl_model_alloc_gen_s2s); a "
                         "forward needs fl_model_alloc_acts_s2s's");
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
    const int B0 = B;
    FL_TRY(sp_pad(m, &src_ids, &src_mask, &dec_ids, &targets, &B, Ts, Tt)); /* sequence parallel: rows it divides */
    ids[0] = src_ids, ids[1] = dec_ids;
    float *lg_pad = NULL; /* a padded pass's logits: the real sequences' rows handed back */
    if (logits_out && B > B0 && !(lg_pad = malloc((size_t)B * Tt * V * sizeof *lg_pad)))
        return fl_errorf(FL_ERR_OOM, "sequence parallel: out of host memory for a padded batch's logits");
    a->spp = a->sp > 1 ? a->sp : 0;
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
        s = stack_forward(m, &mg, k, ids[k], targets, grad_scale, lg_pad ? lg_pad : logits_out);
    if (lg_pad && s == FL_OK) memcpy(logits_out, lg_pad, (size_t)B0 * Tt * V * sizeof *lg_pad);
    free(lg_pad);
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
    size_t r0 = 0; /* sequence parallel: the rank's rows of d(the norm's output) and of the stream */
    const int n = a->spp ? fl_sp_part(m, N, &r0) : N;
    /* a pipeline stage before the stack's end starts from d(its blocks' output) the next stage sent (in dres) */
    const int norm = fl_s2s_runs_norm(m, s), embed = fl_s2s_runs_embed(m, s);
    if (norm) {
        FL_RUN(be, zero, dres, (size_t)n * C * sizeof(float));
        if (a->spp) FL_TRY(drop_part(m, dnout + r0 * C, n, r0, 2 * s + 1));
        else FL_TRY(drop_rows(m, dnout, (size_t)N * C, 2 * s + 1)); /* d(the norm's output) through its dropout mask */
        stage_open(m, G);
        float *dw = param_of(m, G, role_norm, 1), *db = NULL;
        if (a->spp) fl_sp_norm_begin(m, param_of(m, G, role_norm, 1), NULL, &dw, &db); /* the rank's rows' part */
        fl_norm_backward(m, dres, dw, NULL, dnout + r0 * C, st->res[st->L], param_of(m, G, role_norm, 0), NULL,
                         st->nrstd, n);
        if (a->spp) FL_TRY(fl_sp_norm_end(m, m->tp_comm, param_of(m, G, role_norm, 1), NULL));
        FL_TRY(stage_close(m, G));
    }
    if (s == 0) fl_store_release(m->store, G);
    /* data parallel: each layout group's gradient handed on as it becomes final (fl_store_grads_ready; its bucket
     * hook): the final norms and head's group once the first stack's norm is done (the stacks run backward in
     * reverse), each block's after its backward (the first block's after the relative bias table it holds), the
     * shared embedding's after the first stack's embedding */
    if (s == 0) FL_TRY(fl_store_grads_ready(m->store, G));
    FL_RUN(be, zero, st->dbias, (size_t)m->cfg.n_heads * T * T * sizeof(float));
    int dw16; /* bf16-true: the block linears' weight gradients written into the bf16 gradient by their GEMMs */
    FL_TRY(fl_store_dw16_on(m, &dw16));
    float *dxs[FL_GRAPH_MAX_SLOTS] = {0};
    if (st->xslot >= 0) { /* a pipeline stage before the decoder's end adds to the sum the next stage sent */
        dxs[st->xslot] = a->dstream;
        if (norm) FL_RUN(be, zero, a->dstream, (size_t)a->Bp * a->T[s - 1] * C * sizeof(float));
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
        if (!m->act_ckpt) ctx16(a, st, l, &x, 0);
        FL_TRY(saved16(m, st, l, 0, x.s16 ? ~fl_block_bwd_reads32(m, &st->g, &bp, &x) : 0u));
        x.dattn_bias = st->dbias;
        size_t rng[FL_STAGE_RANGES_MAX][2]; /* the staged ranges (the relative bias table among them) */
        const int nr = fl_store_block_stage_begin(m, &st->g, &bp, g, dw16, rng);
        FL_TRY(fl_block_backward(m, &st->g, &bp, st->layer[l].s, a->gb, &x));
        if (l == 0) FL_TRY(relbias_backward(m, st, T)); /* the first block's group holds the table; dbias complete */
        FL_TRY(fl_store_stage_flush_ranges(m->store, m->layout.group_offset[g], (const size_t(*)[2])rng, nr));
        fl_store_release(m->store, g);
        FL_TRY(fl_store_grads_ready(m->store, g));
    }
    fl_outer_params op;
    fl_get_outer(m, &op);
    if (!embed && s == 0) fl_store_release(m->store, 0); /* a later pipeline stage (sharded: regathered after the update) */
    if (!embed) /* a later pipeline stage: d(its blocks' input) stays in dres for the previous stage */
        return s == 0 ? fl_store_grads_ready(m->store, 0) : FL_OK;
    if (a->spp) { /* sequence parallel: the rank's rows through their part of the mask, then the whole rows */
        FL_TRY(drop_part(m, dres, n, r0, 2 * s));
        FL_TRY(fl_sp_gather(m, dres, a->gb[1], N));
        dres = a->gb[1];
    } else {
        FL_TRY(drop_rows(m, dres, (size_t)N * C, 2 * s)); /* d(the embedding's output) through its dropout mask */
    }
    if (s == 0) FL_TRY(inject_rows(m, NULL, dres));
    FL_TRY(fl_embed_backward(m, &op, dres, st->ids, a->Bp, T));
    if (s == 0) fl_store_release(m->store, 0);
    return s == 0 ? fl_store_grads_ready(m->store, 0) : FL_OK;
}

/* sequence parallel: d(the earlier stack's output), each rank's partial sum over its heads' cross k|v (of every
 * decoder block: a pipeline's later stages add theirs to the same rank's), reduce-scattered into the rank's rows of
 * gb[1] (free now), which the earlier stack's norm reads */
static fl_status sp_dstream(fl_model *m, struct fl_s2s_acts *a, int k) {
    const size_t nx = (size_t)a->Bp * a->T[k - 1] * m->cfg.dim;
    return fl_error_prefix(fl_comm_reduce_scatter(m->tp_comm, a->dstream, a->gb[1] + m->cfg.tp_rank * (nx / a->spp), nx,
                                                  FL_F32, FL_COMM_SUM),
                           "sequence parallel: d(the encoder output)");
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
    if (s == FL_OK && m->cfg.head_scale && fl_s2s_runs_norm(m, last)) /* d(norm out) = scale x d(head input) */
        FL_RUN(m->be, scale, a->gb[1], (size_t)N * m->cfg.dim, 1.0f / sqrtf((float)m->cfg.dim));
    /* the last stack from the head's d(its norm's output); each earlier one from d(its output) the later left */
    for (int k = last; s == FL_OK && k >= 0; k--) {
        if (a->st[k].L == 0) { /* a pipeline stage without blocks of the stack: the groups it would hand on (sharded:
                                * the roots released, as stack_backward does, so the next step gathers the update) */
            if (k == 0) fl_store_release(m->store, 0), fl_store_release(m->store, m->layout.n_groups - 1);
            if (k == 0) s = fl_store_grads_ready(m->store, m->layout.n_groups - 1);
            if (k == 0 && s == FL_OK) s = fl_store_grads_ready(m->store, 0);
            if (k > 0 && a->spp && fl_s2s_runs_norm(m, k - 1)) /* SP: the later stages' d(encoder output) to the rows */
                s = sp_dstream(m, a, k);
            continue;
        }
        /* TP x PP: a pipeline stage before the decoder's end received the later stages' d(encoder output), summed over
         * the group already: parked on the host while its blocks' parts are summed, then added back */
        const int tp = m->tp_comm && fl_comm_size(m->tp_comm) > 1, xs = k > 0 && a->st[k].xslot >= 0;
        const size_t nxs = xs ? (size_t)a->Bp * a->T[k - 1] * m->cfg.dim : 0;
        const int park = tp && xs && !fl_s2s_runs_norm(m, k) && !a->spp; /* SP: the partial sum travels (above) */
        float *part = park ? malloc(nxs * sizeof *part) : NULL;
        if (park) {
            s = part ? FL_RUN(m->be, to_host, part, a->dstream, nxs * sizeof *part)
                     : fl_errorf(FL_ERR_OOM, "pipeline stage: out of host memory");
            if (s == FL_OK) FL_RUN(m->be, zero, a->dstream, nxs * sizeof *part);
        }
        if (s == FL_OK) s = stack_backward(m, &mg, k, k == last ? a->gb[1] : a->spp ? a->gb[1] : a->dstream);
        /* tensor parallel: d(the earlier stack's output) is each rank's part from its heads' cross k|v: summed over the
         * group once for every block (Megatron's f of the column-parallel k|v linears, graph_tp.c); sequence
         * parallel: reduce-scattered into the rank's rows (of gb[1], free now), which the earlier stack's norm reads */
        if (s == FL_OK && k > 0 && a->st[k].xslot >= 0 && a->spp) {
            if (fl_s2s_runs_norm(m, k - 1)) s = sp_dstream(m, a, k); /* else a stage before the encoder's end: sent on */
        } else if (s == FL_OK && k > 0 && a->st[k].xslot >= 0 && m->tp_comm && fl_comm_size(m->tp_comm) > 1)
            s = fl_error_prefix(fl_comm_all_reduce(m->tp_comm, a->dstream, a->dstream,
                                                   (size_t)a->Bp * a->T[k - 1] * m->cfg.dim, FL_F32, FL_COMM_SUM),
                                "tensor parallel: d(the encoder output)");
        if (s == FL_OK && part) { /* gb[1] is free after the stack's blocks */
            s = FL_RUN(m->be, to_device, a->gb[1], part, nxs * sizeof *part);
            if (s == FL_OK) FL_RUN(m->be, add, a->dstream, a->dstream, a->gb[1], nxs);
        }
        free(part);
    }
    m->fwd_train = 0;
    return s;
}

/* ---- greedy decoding ------------------------------------------------------------------------ */

/* The relative bias row of decoder query n-1, (NH, 1, n) in the last stack's bias: the same for every sequence of a
 * batch (the positions are). */
static fl_status decode_bias(fl_model *m, s2s_stack *st, int n) {
    FL_TRY(relbias_buckets(m, st, n - 1, 1, n, 0)); /* query n - 1, keys 0 .. n - 1 */
    float *tab;
    FL_TRY(block_gather(m, st->l0 + 1));
    FL_TRY(relbias_table(m, st, 0, &tab));
    return FL_RUN(m->be, relbias_forward, st->bias, tab, st->buckets, m->cfg.n_heads, 1, n, m->cfg.rel_buckets);
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
    const size_t r1 = a->gen ? (size_t)b : r; /* generation's arena: the per-row buffers hold one row per sequence */
    fl_outer_params op;
    fl_get_outer(m, &op);
    FL_TRY(FL_RUN(be, to_device, st->ids + r1, tok, sizeof *tok));
    FL_TRY(fl_embed_forward(m, &op, st->res[0] + r1 * C, st->ids + r1, tok, 1, 1, 0));
    for (int l = 0; l < st->L; l++) {
        float *sv[FL_GRAPH_MAX_SLOTS];
        for (int k = 0; k < st->g.n_slots; k++) /* row r of the per-row slots (the cache's); the sequence's source rows */
            sv[k] = st->layer[l].s[k] + (st->g.slot[k].xrows ? xr : s2s_one_row(a, s, k) ? r1 : r) * st->g.slot[k].width;
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
    float *no = st->nout + r1 * C;
    fl_norm_forward(m, no, NULL, st->nrstd + r1, st->res[st->L] + r1 * C, param_of(m, G, role, 0), NULL, 1);
    if (m->cfg.head_scale) FL_RUN(be, scale, no, (size_t)C, 1.0f / sqrtf((float)C));
    fl_linear head = {.in = C, .out = fl_config_vocab_rows(&m->cfg, NULL), .w = op.head}; /* TP: the rank's rows */
    fl_linear_set_weight(m, &head, op.head_idx);
    if (m->adapt) m->adapt->bind(m->adapt, -1, 0, &head, 0);
    FL_TRY(fl_linear_forward(be, a->logits, no, &head, 1));
    return fl_head_logits_out(m, lg, a->logits, 1); /* TP: the group's columns gathered */
}

static fl_status check_sources(const fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts,
                               int max_new) {
    const struct fl_s2s_acts *a = m->acts->s2s;
    const int V = m->cfg.vocab_size;
    if (B <= 0 || B > a->B || Ts <= 0 || Ts > a->st[0].Tmax || max_new < 0 || max_new > a->st[1].Tmax)
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
static fl_status s2s_generate_run(fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts,
                                  int max_new, int kv_cache, fl_sampler *sp, int32_t *out, int *n_out);

/* Sequence parallelism: generation runs the tensor-parallel graphs (gtp: a row per token, the stream whole on every
 * rank) in the arena carved for the sequence-parallel ones, whose stream slots hold B / sp sequences' rows */
static fl_status s2s_generate(fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts, int max_new,
                              int kv_cache, fl_sampler *sp, int32_t *out, int *n_out) {
    FL_TRY(check_model(m, "fl_model_generate_s2s"));
    struct fl_s2s_acts *a = m->acts->s2s;
    if (a->sp <= 1) return s2s_generate_run(m, src, src_mask, B, Ts, max_new, kv_cache, sp, out, n_out);
    *n_out = 0;
    if (B > a->B / a->sp)
        return fl_errorf(FL_ERR_INVALID, "fl_model_generate_s2s: sequence parallel over %d ranks: at most %d source(s) "
                         "at once (the arena's %d / %d), not %d", a->sp, a->B / a->sp, a->B, a->sp, B);
    fl_block_graph t;
    for (int k = 0; k < a->n_stacks; k++) t = a->st[k].g, a->st[k].g = a->st[k].gtp, a->st[k].gtp = t;
    a->spp = 0;
    fl_status s = s2s_generate_run(m, src, src_mask, B, Ts, max_new, kv_cache, sp, out, n_out);
    for (int k = 0; k < a->n_stacks; k++) t = a->st[k].g, a->st[k].g = a->st[k].gtp, a->st[k].gtp = t;
    return s;
}

static fl_status s2s_generate_run(fl_model *m, const int32_t *src, const uint8_t *src_mask, int B, int Ts,
                                  int max_new, int kv_cache, fl_sampler *sp, int32_t *out, int *n_out) {
    struct fl_s2s_acts *a = m->acts->s2s;
    const int V = m->cfg.vocab_size, W = max_new + 1;
    *n_out = 0;
    FL_TRY(check_sources(m, src, src_mask, B, Ts, max_new));
    if (max_new == 0) { /* no new token asked for (as a decoder-only generate): the start token alone, nothing run */
        for (int b = 0; b < B; b++) out[b] = m->cfg.dec_start_id;
        *n_out = 1;
        return FL_OK;
    }
    /* 16-bit saved activations: the blocks share one fp32 buffer of the WIDE slots (q|k|v among them), so the decoder
     * reruns its prefix for each token (the cache's ids: the same computation on the same keys) */
    if (a->act16) kv_cache = 0;
    if (a->gen && !kv_cache) /* its decoder keeps one row per sequence: no prefix to rerun */
        return fl_errorf(FL_ERR_INVALID, "fl_model_generate_s2s: generation's arena (fl_model_alloc_gen_s2s) decodes with "
                         "the KV cache only (kv_cache 1)");
    if (kv_cache && m->act_ckpt && !a->gen) /* the blocks share one set of slots there: no room for each block's keys */
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
            if (fl_model_is_eos(m, best)) done[b] = 1, left--;
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
    if (!fl_s2s_runs_norm(m, a->n_stacks - 1)) { /* an earlier pipeline stage: no head */
        m->fwd_train = a->head.grad_scale > 0;
        return FL_OK;
    }
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
const fl_model_kind fl_s2s_kind = {.name = "encoder-decoder",
                                       .forward_micro = s2s_forward_micro,
                                       .forward_head = s2s_forward_head,
                                       .backward = fl_model_backward_s2s,
                                       .live_bytes = fl_s2s_live_bytes,
                                       .adapter_live_rows = fl_s2s_adapter_live_rows};

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
    const int gen = m->acts && m->acts->s2s && m->acts->s2s->gen; /* generation's arena: the cache, always */
    fl_status s = s2s_generate(m, src, src_mask, B, Ts, gp->max_new_tokens, gen || !m->act_ckpt, &sp, out, n_out);
    s2s_lend(m, 0);
    fl_sampler_free(&sp);
    return s;
}

fl_status fl_generate_s2s(fl_model *m, const int32_t *src, const uint8_t *src_mask, int Ts, const fl_gen_params *gp,
                          int32_t *out, int *n_out) {
    return fl_generate_s2s_batch(m, src, src_mask, 1, Ts, gp, out, n_out);
}

fl_status fl_model_set_dropout(fl_model *m, int on) {
    if (!fl_model_is_s2s(&m->cfg) && m->cfg.arch != FL_ARCH_OPT)
        return fl_errorf(FL_ERR_UNSUPPORTED, "dropout: %s has no dropout of its own (the encoder-decoders and OPT "
                         "have)", fl_arch_get(m->cfg.arch)->display);
    if (on && (m->cfg.dropout_rate > 0 || m->cfg.attn_dropout_rate > 0) && !m->be->dropout)
        return fl_errorf(FL_ERR_UNSUPPORTED, "config.json dropout_rate %g: backend %s has no dropout op",
                         (double)m->cfg.dropout_rate, m->be->name);
    if (m->acts && !m->cfg.dropout_on != !on)
        return fl_errorf(FL_ERR_INVALID, "fl_model_set_dropout: call it before fl_model_alloc_acts(_s2s) (the blocks' "
                         "graphs change)");
    m->cfg.dropout_on = on != 0;
    return FL_OK;
}

/* ---- the chunked LM head and cross-entropy over a stack's final norm output, shared by the interpreters of
 * several stacks (seq2seq.c, blip2_pass.c): at most `chunk` rows of (rows, V) logits exist at once; in training
 * the head's backward runs chunk by chunk too (the logits' gradient overwrites them), leaving d(the head's
 * input) in dx. */

fl_status fl_head_loss(fl_model *m, const fl_head_bufs *h, const int32_t *targets, int N, float grad_scale,
                       float *logits_out, double *loss_sum, long *n_valid) {
    const fl_backend *be = m->be;
    /* tensor parallel: the rank's vocabulary rows Vr of the head, the cross-entropy over the group's slices */
    const int C = m->cfg.dim, V = m->cfg.vocab_size, Vr = fl_config_vocab_rows(&m->cfg, NULL);
    const int train = grad_scale > 0 && targets;
    fl_outer_params op;
    fl_get_outer(m, &op);
    fl_linear head = {.in = C, .out = Vr, .w = op.head, .dw = op.dhead};
    fl_linear_set_weight(m, &head, op.head_idx);
    fl_linear_set_dw_scratch(m, &head); /* the arena's bf16 dW scratch (an encoder-decoder's: seq2seq_acts.c), or none */
    fl_linear_bind_dw16(&head, h->xb16, h->dyb16); /* a caller's own (BLIP-2's) */
    const int32_t *tg = targets;
    if (targets && h->dtargets) {
        FL_TRY(FL_RUN(be, to_device, h->dtargets, targets, (size_t)N * sizeof *targets));
        tg = h->dtargets;
    }
    for (int r0 = 0; r0 < N; r0 += h->chunk) {
        const int rows = N - r0 < h->chunk ? N - r0 : h->chunk;
        const float *xr = h->x + (size_t)r0 * C;
        if (m->adapt) m->adapt->bind(m->adapt, -1, 0, &head, r0); /* head adapters: this chunk */
        FL_TRY(fl_linear_forward(be, h->logits, xr, &head, rows)); // (rows, Vr)
        if (logits_out) FL_TRY(fl_head_logits_out(m, logits_out + (size_t)r0 * V, h->logits, rows));
        if (!targets) continue;
        FL_TRY(fl_head_cross_entropy(m, h->losses + r0, train ? h->logits : NULL, h->logits, tg + r0, targets + r0,
                                     rows, grad_scale));
        if (train) FL_TRY(fl_linear_backward(be, h->dx + (size_t)r0 * C, 0, h->logits, xr, &head, rows));
    }
    if (train && m->tp_ops) FL_TRY(m->tp_ops->head_dx_sum(m, h->dx, N)); /* a vocabulary slice's part of d(the head's input) */
    if (!targets) return FL_OK;
    float *l = malloc((size_t)N * sizeof *l);
    if (!l) return fl_errorf(FL_ERR_OOM, "losses: out of host memory");
    fl_status s = FL_RUN(be, to_host, l, h->losses, (size_t)N * sizeof *l);
    for (int i = 0; s == FL_OK && i < N; i++)
        if (targets[i] != FL_IGNORE_INDEX) {
            *loss_sum += l[i];
            (*n_valid)++;
        }
    free(l);
    return s;
}
