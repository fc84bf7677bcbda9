/* One stack of the model graph interpreted (graph.h fl_model_graph): a decoder-only model (EMBED, BLOCKS, NORM,
 * HEAD_LM) and an encoder (EMBED, EMBED_TYPE, NORM, BLOCKS, OUTPUT) run the same two functions, run_forward (the
 * table's ops in order) and run_backward (in reverse). The blocks are their block graph's executors (graph.c:
 * LLaMA's RMSNorm/RoPE/SwiGLU/GQA, GPT-2's LayerNorm/GELU/biases, BERT's post-norm blocks described once); every op
 * is a backend call (llm.c style). Activations live in the arena carved from the same graphs (acts.c; fp32, or the
 * wide ones stored in 16 bits between forward and backward: fl_act_opts). The parameter store (store.h) is opened
 * and closed around each layout group: group 0 the embeddings, 1..L the blocks, L+1 the final norm and the head.
 * An encoder-decoder's two stacks run in seq2seq.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model-impl.h"
#include "store.h"

/* What one pass is given (B sequences of T rows from position 0). */
typedef struct {
    const int32_t *ids, *type_ids, *targets; /* (B, T) host memory; types and targets may be NULL */
    const uint8_t *kmask;                     /* (B, T) key padding mask (an encoder's), or NULL */
    int B, T, train;                          /* train: keep what the backward reads */
    float grad_scale;                         /* > 0 with targets: the head's backward runs in the forward */
} pass;

/* Block l's context in a training pass: the arena's RoPE tables, the key mask, tensor parallelism's communicator, and
 * in a dropping pass (OPT's dropout, fl_acts.drop) the rates and the block's seed: fl_dropout_seed(the micro-batch's
 * seed, 16 + l), as T5's and BLIP-2's language model's (l the whole model's block: a pipeline stage's first + l). */
static fl_block_ctx train_ctx(const fl_model *m, int B, int T, int l) {
    fl_block_ctx x = {.B = B, .T = T, .rope_cos = m->acts->rope_cos, .rope_sin = m->acts->rope_sin};
    x.kmask = m->acts->kmask_on ? m->acts->kmask : NULL; /* an encoder's key padding mask */
    x.comm = m->tp_comm; /* tensor parallel: the blocks' ALLREDUCE ops (graph_tp.c) */
    if (m->acts->drop) {
        x.drop_p = m->cfg.dropout_rate;
        x.attn_drop_p = m->cfg.attn_dropout_rate;
        x.drop_seed = fl_dropout_seed(m->drop_seed, 16 + (uint64_t)(m->stage.first + l)); /* the whole's block */
    }
    return x;
}

/* One block forward: res[l] (N, C) -> res[l+1] (N, C), saving the block's activations in its
 * slots (the block graph, graph.c). Used by the forward pass and, with activation checkpointing,
 * again in backward (same ops, same order: bit-identical). */
static fl_status block_forward(fl_model *m, int l, int B, int T, fl_add_pending *hand_on, const fl_add_pending *take) {
    const fl_block_graph *g = m->acts->graph;
    fl_block_params bp;
    fl_get_block(m, g, l, &bp);
    fl_block_ctx x = train_ctx(m, B, T, l);
    if (m->acts->res16) { /* bf16 stored: every slot the block writes, after its last writer */
        x.s16 = m->acts->layer[l].s16;
        x.store16 = 1;
        x.stream16 = m->acts->stream16; /* the residual slots' views in one buffer (fl_block_stream16) */
    }
    x.hand_on = hand_on, x.take = take; /* the cross-block add + norm (blocks_forward) */
    return fl_block_forward(m, g, &bp, m->acts->layer[l].s, &x);
}

/* Issue 30 item 4, bf16 stored: whether block l's last residual add may be left pending (fl_block_ctx.hand_on) for
 * the norm that reads its sum next on this rank: block l+1's ln_1 (its first op, after its parameters are gathered)
 * or, after the last block, the final norm (forward_body; only where it follows BLOCKS: not a pipeline stage that
 * sends the row, not sequence parallel). Not with dropout (OPT's: the block does its add), nor tensor parallel (ln_1's
 * output is stored after the backward's ALLREDUCE op on it, so its norm is not fused: as ln_2's), nor where the block
 * does not end in an add and start with a norm (BERT's post-norm blocks), nor without the fused slot;
 * FITLLM_CUDA_XBLOCK_NORM=0 off (the same bits either way: add_norm_forward16 is add16 then the norm). */
static int xblock_defers(const fl_model *m, int l, int on) {
    const fl_acts *a = m->acts;
    const fl_block_graph *g = a->graph;
    if (!on || !a->res16 || a->drop || m->sp || g->sp > 1 || m->cfg.tp_size > 1 || !m->be->add_norm_forward16 ||
        !m->be->add16 || g->n_ops < 2 || g->op[g->n_ops - 1].kind != FL_GOP_ADD || g->op[g->n_ops - 1].out != FL_GSLOT_OUT)
        return 0;
    if (l + 1 < m->cfg.n_layers) return g->op[0].kind == FL_GOP_NORM && g->op[0].in == FL_GSLOT_IN;
    const fl_model_graph *mg = a->mgraph;
    for (int i = 0; i + 1 < mg->n_ops; i++) /* the final norm right after BLOCKS, on this stage */
        if (mg->op[i].kind == FL_MOP_BLOCKS) return mg->op[i + 1].kind == FL_MOP_NORM && !m->stage.out;
    return 0;
}

/* The parameter store (store.h) around each layout group: gathered right before use (the next one's
 * gather posted ahead), released after; its gradient buffer begun before its backward and handed back
 * after (FSDP: reduce-scattered into the shard; data parallel: the bucket's hook). No-ops for a store
 * that holds every parameter. */
#define PP_GATHER(g, next) FL_TRY(fl_store_gather(m->store, (g), (next)))
#define PP_RELEASE(g) fl_store_release(m->store, (g))
#define PP_GRADS(g) FL_TRY(fl_store_grads_begin(m->store, (g)))
#define PP_READY(g) FL_TRY(fl_store_grads_ready(m->store, (g)))

/* fp32 parameter / gradient of group g's entry of role r (the encoders' extra embeddings and embedding norm:
 * fp32 storage), NULL if absent */
static float *role_param(const fl_model *m, int g, int r, int grad) {
    const int i = r < 0 ? -1 : fl_layout_role(&m->layout, g, (fl_param_role)r);
    if (i < 0) return NULL;
    float *gr = fl_model_grads_f32(m), *pr = fl_model_params_f32(m);
    if (grad) return gr ? gr + m->layout.params[i].offset : NULL;
    return pr + fl_model_store_off(m, i);
}

/* Sequence parallelism (model-impl.h): the rank's rows of a pass of N rows, and a pass's sequence length. */
int fl_sp_part(const fl_model *m, int N, size_t *row0) {
    const int n = m->sp ? N / m->cfg.tp_size : N;
    *row0 = m->sp ? (size_t)m->cfg.tp_rank * n : 0;
    return n;
}
int fl_sp_pass_T(const fl_model *m, int B, int T) {
    if (!m->sp) return T;
    while ((B * T) % m->cfg.tp_size) T++;
    return T;
}

/* The op that ends the table (HEAD_LM or OUTPUT) and its final norm, if any. */
static int end_op(const fl_model_graph *mg) { return mg->op[mg->n_ops - 1].kind; }
static int has_final_norm(const fl_model_graph *mg) { return fl_model_graph_has(mg, FL_MOP_NORM, 1); }

/* The input slot fl_model_prefetch filled with exactly this pass's ids and targets, or -1. */
static int prefetched(const fl_acts *a, const pass *p, int N) {
    for (int s = 0; a->in_dev && p->targets && !p->type_ids && !p->kmask && s < FL_INPUT_SLOTS; s++)
        if (a->in_slot[s].N == N && a->in_slot[s].ids == p->ids && a->in_slot[s].targets == p->targets) return s;
    return -1;
}

/* Issue 30 item 5: mb's ids and targets into the backend's input slot `slot` ahead of its pass, on the backend's
 * second stream (fl_backend.input_upload), for a decoder-only LM's training pass on a backend with the slots (not
 * host memory); *done 0 where it does not apply (the pass then uploads as before). mb NULL: forget what the slots
 * hold (the step's end: a later pass of the same host buffers may hold other bytes). */
fl_status fl_model_prefetch(fl_model *m, const fl_micro_batch *mb, int slot, int *done) {
    fl_acts *a = m->acts;
    const fl_backend *be = m->be;
    if (done) *done = 0;
    if (!mb) {
        if (a) memset(a->in_slot, 0, sizeof a->in_slot);
        return FL_OK;
    }
    const int N = mb->B * mb->T;
    if (!a || !a->in_dev || a->kind || mb->src || !mb->ids || !mb->targets || !a->ids_home || !a->targets_home ||
        a->type_ids || end_op(a->mgraph) != FL_MOP_HEAD_LM || m->cfg.tp_size > 1 || N <= 0 || N > m->B * m->T ||
        mb->T > m->T || slot < 0 || slot >= FL_INPUT_SLOTS)
        return FL_OK; /* (the slots are made with the arena: acts.c's input_slots) */
    const size_t bytes = (size_t)N * sizeof(int32_t);
    FL_TRY(FL_RUN(be, input_upload, slot, mb->ids, bytes, mb->targets, bytes, a->in_off));
    a->in_slot[slot].ids = mb->ids, a->in_slot[slot].targets = mb->targets, a->in_slot[slot].N = N;
    if (done) *done = 1;
    return FL_OK;
}

/* The pass's inputs into the arena: ids (and an encoder's token types and key mask), the targets on a device. */
static fl_status upload(fl_model *m, const pass *p) {
    const fl_backend *be = m->be;
    fl_acts *a = m->acts;
    const int N = p->B * p->T, V = m->cfg.vocab_size;
    for (int i = 0; i < N; i++) {
        const int ty = p->type_ids ? p->type_ids[i] : 0;
        if (p->ids[i] >= 0 && p->ids[i] < V && (!p->type_ids || (ty >= 0 && ty < m->cfg.type_vocab_size))) continue;
        if (a->type_ids) /* an encoder's: with the types */
            return fl_errorf(FL_ERR_INVALID, "token id %d (type %d) at position %d is outside the vocabulary [0, %d) "
                             "(types [0, %d))", p->ids[i], ty, i, V, m->cfg.type_vocab_size);
        return fl_errorf(FL_ERR_INVALID, "token id %d at position %d is outside the vocabulary [0, %d)", p->ids[i], i, V);
    }
    if (a->ids_home) a->ids = a->ids_home, a->targets = a->targets_home;
    a->kmask_on = p->kmask != NULL;
    const int slot = prefetched(a, p, N);
    if (slot >= 0) { /* uploaded ahead (fl_model_prefetch): read there once its copy passed */
        memset(&a->in_slot[slot], 0, sizeof a->in_slot[slot]);
        FL_TRY(FL_RUN(be, input_wait, slot));
        a->ids = (int32_t *)(void *)(a->in_dev + (size_t)slot * a->in_stride);
        a->targets = (int32_t *)(void *)(a->in_dev + (size_t)slot * a->in_stride + a->in_off);
        return FL_OK;
    }
    FL_TRY(FL_RUN(be, to_device, a->ids, p->ids, (size_t)N * sizeof *p->ids)); /* host ids -> the arena */
    if (a->type_ids) {
        if (p->type_ids)
            FL_TRY(FL_RUN(be, to_device, a->type_ids, p->type_ids, (size_t)N * sizeof *p->type_ids));
        else
            FL_RUN(be, zero, a->type_ids, (size_t)N * sizeof(int32_t));
    }
    if (p->kmask) FL_TRY(FL_RUN(be, to_device, a->kmask, p->kmask, (size_t)N));
    if (p->targets && a->targets) FL_TRY(FL_RUN(be, to_device, a->targets, p->targets, (size_t)N * sizeof *p->targets));
    return FL_OK;
}

/* BLOCKS: res[l] (N, C) -> res[l+1] (N, C), l = 0..L-1, each layout group gathered around its block.
 * With activation checkpointing every block writes into the same single layer buffer (layer[l] all alias it)
 * and only res[l] survives. With 16-bit saved activations the blocks share one fp32 buffer of the wide
 * activations, and a training forward rounds each block's into its 16-bit region (the forward itself computes
 * in fp32 either way: the same loss). */
static fl_status blocks_forward(fl_model *m, const pass *p, fl_outer_params *op, int res0_stored, fl_add_pending *pend) {
    const int L = m->cfg.n_layers, HG = L + 1, N = p->B * p->T;
    if (!m->cfg.tie_embeddings) PP_RELEASE(0); /* tied: the head reads the embeddings again */
    m->ckpt_last_live = 0;
    /* bf16 stored: the stream the blocks read, as stored (res0_stored: the embedding lookup stored it) */
    if (!res0_stored) FL_TRY(fl_acts_store_stream(m, 0, N));
    int xfuse;
    FL_TRY(fl_xblock_fuse_on(&xfuse));
    for (int l = 0; l < L; l++) {
        PP_GATHER(l + 1, l + 2 <= L ? l + 2 : HG);
        /* block l-1's last add, pending, is done by this block's first op (fused with its ln_1) */
        fl_add_pending take = *pend;
        memset(pend, 0, sizeof *pend);
        FL_TRY(block_forward(m, l, p->B, p->T, xblock_defers(m, l, xfuse) ? pend : NULL, &take));
        if (p->train) FL_TRY(fl_acts_narrow(m, l, N, 0));
        PP_RELEASE(l + 1);
    }
    /* checkpointing: the last block's activations are still in the shared buffer (the final norm and the head
     * write elsewhere), so the backward starts on them without a recompute */
    m->ckpt_last_live = m->act_ckpt && p->train && L > 0;
    if (fl_store_sharded(m->store)) { /* the head group, and in training its gradient buffer (tied: the embeddings' too) */
        PP_GATHER(HG, -1);
        if (p->train) {
            PP_GRADS(HG);
            if (m->cfg.tie_embeddings) PP_GRADS(0);
        }
        fl_get_outer(m, op);
    }
    return FL_OK;
}

/* The final norm's output bf16 copy: the bf16 head's training chunks read it, and the norm stores it; else NULL */
static void *lnf_x16(fl_model *m, const pass *p, const fl_outer_params *op) {
    return m->acts->act_dtype == FL_BF16 && p->grad_scale > 0 && p->targets && op->lnf_wt != FL_F32 &&
                   end_op(m->acts->mgraph) == FL_MOP_HEAD_LM
               ? fl_lm_head_x16(m)
               : NULL;
}

/* The forward up to the table's end:
 *   EMBED       e (N, C) = wte[ids] (+ wpe[t])     e: res[0], or emb_x when an embedding norm follows
 *   EMBED_TYPE  e += wtt[types]
 *   NORM        res[0] = norm(emb_x)              before BLOCKS: the embedding norm (its input saved)
 *   BLOCKS      res[L] = blocks(res[0])
 *   NORM        lnf (N, C) = norm(res[L])         after BLOCKS: the final norm */
static fl_status forward_body(fl_model *m, const pass *p) {
    const fl_backend *be = m->be;
    fl_acts *a = m->acts;
    const fl_model_graph *mg = a->mgraph;
    const int B = p->B, T = p->T, N = B * T, C = m->cfg.dim, L = m->cfg.n_layers;
    FL_TRY(upload(m, p));
    /* sharded: the units in forward order are the embeddings (0), the blocks (1..L) and the head group (L+1:
     * final norm, lm_head); tied embeddings keep group 0 gathered for the head */
    PP_GATHER(0, L > 0 ? 1 : L + 1);
    fl_outer_params op;
    fl_get_outer(m, &op);
    float *e = fl_model_graph_has(mg, FL_MOP_NORM, -1) ? a->emb_x : a->res[0];
    int after = 0; /* past BLOCKS */
    /* bf16 stored: the lookup stores res[0] itself when it is the whole of it (no token types added) */
    void *e16 = a->res16 && e == a->res[0] && !fl_model_graph_has(mg, FL_MOP_EMBED_TYPE, -1) ? a->res16[0] : NULL;
    int res0_stored = 0;
    fl_add_pending pend = {0}; /* the last block's add, left for the final norm (blocks_forward) */
    for (int i = 0; i < mg->n_ops; i++) {
        const int rw = mg->op[i].role_w, rb = mg->op[i].role_b;
        switch ((fl_mop_kind)mg->op[i].kind) {
        case FL_MOP_EMBED: /* a later pipeline stage: res[0] holds the previous stage's output (stage.c; sequence
                            * parallel: the rank's rows) */
            if (m->stage.in) {
            } else if (m->sp) { /* sequence parallel: the whole rows (the vocabulary slices' sum), the rank's kept */
                size_t r0;
                const int n = fl_sp_part(m, N, &r0);
                FL_TRY(fl_embed_forward16(m, &op, a->buf1, NULL, NULL, a->ids, p->ids, B, T, 0));
                FL_TRY(FL_RUN(be, copy, e, a->buf1 + r0 * C, (size_t)n * C * sizeof(float)));
            } else
                FL_TRY(fl_embed_forward16(m, &op, e, e16, &res0_stored, a->ids, p->ids, B, T, 0));
            break;
        case FL_MOP_EMBED_TYPE: /* through buf1 (N, C) */
            FL_RUN(be, embedding_forward, a->buf1, a->type_ids, role_param(m, 0, FL_ROLE_TYPE_EMBED, 0), NULL, B, T, C);
            FL_RUN(be, add, e, e, a->buf1, (size_t)N * C);
            break;
        case FL_MOP_NORM:
            if (!after)
                fl_norm_forward(m, a->res[0], a->emb_mean, a->emb_rstd, e, role_param(m, 0, rw, 0),
                                role_param(m, 0, rb, 0), N);
            else if (pend.on) { /* the last block's add, pending (blocks_forward): fused with the final norm */
                void *x16 = lnf_x16(m, p, &op); /* (non-NULL: a 16-bit weight, the w16 norm's bits) */
                FL_TRY(fl_add_pending_norm(m, &pend, a->lnf, x16, a->lnf_mean, a->lnf_rstd, op.lnf_w, op.lnf_b,
                                           op.lnf_wt));
                a->lnf16 = x16 || fl_norm_forward_t(m, a->lnf, x16, a->lnf_mean, a->lnf_rstd, a->res[L], op.lnf_w,
                                                    op.lnf_wt, op.lnf_b, N) ? x16 : NULL; /* else: the norm alone */
            } else if (m->stage.out) { /* an earlier pipeline stage ends at res[L] (sequence parallel: the rank's rows) */
            } else if (m->sp) { /* sequence parallel: the rank's rows, then the whole rows for the head */
                size_t r0;
                const int n = fl_sp_part(m, N, &r0);
                fl_norm_forward_t(m, a->lnf + r0 * C, NULL, a->lnf_mean, a->lnf_rstd, a->res[L], op.lnf_w, op.lnf_wt,
                                  op.lnf_b, n);
                a->lnf16 = NULL;
                FL_TRY(m->tp_ops->sp_gather(m, a->lnf + r0 * C, a->lnf, N));
            } else {
                void *x16 = lnf_x16(m, p, &op);
                a->lnf16 = fl_norm_forward_t(m, a->lnf, x16, a->lnf_mean, a->lnf_rstd, a->res[L], op.lnf_w, op.lnf_wt,
                                             op.lnf_b, N) ? x16 : NULL;
            }
            break;
        case FL_MOP_BLOCKS:
            FL_TRY(blocks_forward(m, p, &op, res0_stored, &pend));
            after = 1;
            break;
        case FL_MOP_HEAD_LM:
        case FL_MOP_OUTPUT: break; /* the end (forward_end) */
        default:
            return fl_errorf(FL_ERR_UNSUPPORTED, "model graph op %d (patch embedding, learned queries) is declared but "
                             "not executed yet", mg->op[i].kind);
        }
    }
    return fl_add_pending_norm(m, &pend, NULL, NULL, NULL, NULL, NULL, NULL, FL_F32); /* (none left: done above) */
}

/* The table's end: HEAD_LM (the loss) or OUTPUT (the last hidden states (N, C), the final norm's when there is
 * one, into hidden). */
static fl_status forward_end(fl_model *m, const pass *p, float *logits_out, float *hidden) {
    fl_acts *a = m->acts;
    const int N = p->B * p->T, HG = m->cfg.n_layers + 1;
    if (end_op(a->mgraph) == FL_MOP_HEAD_LM) {
        m->loss_sum = 0;
        m->n_valid = 0;
        m->have_targets = p->targets != NULL && !m->stage.out;
        if (!m->stage.out) /* the executor (exec.c); an earlier pipeline stage has no head */
            FL_TRY(fl_lm_head_loss(m, p->targets, N, p->grad_scale, logits_out));
        if (p->targets && !m->stage.out) FL_TRY(fl_lm_sum_losses(m, p->targets, N));
    } else if (hidden) {
        const float *out = has_final_norm(a->mgraph) ? a->lnf : a->res[m->cfg.n_layers];
        FL_TRY(FL_RUN(m->be, to_host, hidden, out, (size_t)N * m->cfg.dim * sizeof(float)));
    }
    m->fwd_B = p->B;
    m->fwd_T = p->T;
    m->fwd_train = p->train;
    /* sharded: the head group stays gathered for the final norm's backward (PyTorch keeps its root unit too);
     * tied, the embeddings' weight is not read again (their gradient buffer stays) */
    if (m->cfg.tie_embeddings) PP_RELEASE(0);
    if (!m->fwd_train) PP_RELEASE(HG);
    return FL_OK;
}

/* BLOCKS backward, L-1 down to 0: d res[L] in dres becomes d res[0]. dres16: d res[L]'s bf16 copy is in the
 * acts' dyb16 (the final norm's backward wrote it), passed on block to block (fl_block_ctx.din16). */
static fl_status blocks_backward(fl_model *m, int B, int T, int dres16) {
    fl_acts *a = m->acts;
    const int L = m->cfg.n_layers, N = B * T;
    float *const gb[FL_GRAPH_MAX_GBUF] = {a->dres, a->buf1, a->buf2, a->gbuf_more[0], a->gbuf_more[1]};
    int dw16; /* the linears' weight gradients written in the bf16 gradient by their GEMMs (FL_OP_GEMM_ACC16) */
    FL_TRY(fl_store_dw16_on(m, &dw16));
    for (int l = L - 1; l >= 0; l--) {
        PP_GATHER(l + 1, l >= 1 ? l : -1); /* the embeddings' weights are not read in backward */
        PP_GRADS(l + 1);
        /* 16-bit saved activations: widen this block's back into the shared fp32 buffer (bf16 stored: its input too,
         * which a recompute starts from, so before it); bf16 stored without checkpointing: below, only what the
         * block's backward reads in fp32 */
        const int widen_some = a->act_dtype == FL_BF16 && !m->act_ckpt;
        if (!widen_some) FL_TRY(fl_acts_widen(m, l, N, 0));
        /* checkpointing: rebuild this block's activations from its saved input (it also rewrites res[l+1] with
         * identical values; backward no longer needs it). Block L-1's are still there from the forward (the same
         * ops in the same order: the same bits). */
        if (m->act_ckpt && !(l == L - 1 && m->ckpt_last_live)) {
            FL_TRY(block_forward(m, l, B, T, NULL, NULL)); /* its input row stored: its ln_1 alone */
            m->ckpt_recomputed++;
        }
        m->ckpt_last_live = 0;
        /* the block's ops in reverse (graph.c): d res[l+1] in dres becomes d res[l] */
        fl_block_params bp;
        fl_get_block(m, a->graph, l, &bp);
        size_t rng[FL_STAGE_RANGES_MAX][2];
        const int nr = fl_store_block_stage_begin(m, a->graph, &bp, l + 1, dw16, rng);
        fl_block_ctx x = train_ctx(m, B, T, l);
        if (a->act_dtype == FL_BF16) x.s16 = a->layer[l].s16;
        x.gdrop = a->gdrop; /* the gradient buffers sized without these slots' fp32 (acts.c) */
        x.stream16 = a->stream16;
        /* LoRA: the embeddings are frozen, so block 0's input gradient has no reader */
        x.no_din = l == 0 && m->adapt && !m->keep_block0_din;
        /* the residual gradient's bf16 copy, where the norms write it (the copy lives in the shared dyb16,
         * which nothing between two blocks' backwards writes) */
        void *dy16 = x.s16 ? fl_block_dout16(a->graph, &bp) : NULL;
        x.dout16_ready = dres16 && dy16 == a->dyb16;
        x.din16 = l > 0 ? dy16 : NULL;
        dres16 = 0;
        x.din16_done = &dres16;
        if (widen_some) FL_TRY(fl_acts_widen(m, l, N, ~fl_block_bwd_reads32(m, a->graph, &bp, &x)));
        FL_TRY(fl_block_backward(m, a->graph, &bp, a->layer[l].s, gb, &x));
        FL_TRY(fl_store_stage_flush_ranges(m->store, m->layout.group_offset[l + 1], (const size_t(*)[2])rng, nr));
        PP_RELEASE(l + 1);
        PP_READY(l + 1);
    }
    return FL_OK;
}

/* The backward, the table in reverse: d(the end) -> d res[L] (dres, through the final norm) -> blocks -> d res[0]
 * -> (the embedding norm ->) the embeddings. The end's gradient: HEAD_LM's d(lnf) left in buf1 by the forward,
 * or OUTPUT's dhidden (N, C, host memory). Parameter gradients ACCUMULATE. */
static fl_status run_backward(fl_model *m, const float *dhidden) {
    const fl_backend *be = m->be;
    fl_acts *a = m->acts;
    const fl_model_graph *mg = a->mgraph;
    const int B = m->fwd_B, T = m->fwd_T, N = B * T, L = m->cfg.n_layers, HG = L + 1;
    const size_t nc = (size_t)N * m->cfg.dim;
    PP_GATHER(HG, L > 0 ? L : -1); /* kept from the forward; block L-1's gather posted ahead */
    fl_outer_params op;
    fl_get_outer(m, &op);
    m->ckpt_recomputed = 0;
    int dres16 = 0; /* d res[L]'s bf16 copy in dyb16 (blocks_backward) */
    if (m->stage.out) { /* an earlier pipeline stage: d res[L] is already in dres (fl_model_stage_dout) */
    } else if (has_final_norm(mg)) { /* d(lnf) (N, C) in buf1 -> d res[L] in dres */
        if (dhidden) FL_TRY(FL_RUN(be, to_device, a->buf1, dhidden, nc * sizeof(float)));
        size_t r0; /* sequence parallel: the rank's rows of d(lnf) (fl_tp_head_dx_sum) and of the stream */
        const int n = fl_sp_part(m, N, &r0);
        FL_RUN(be, zero, a->dres, (size_t)n * m->cfg.dim * sizeof(float));
        /* the final norm's parameters open the head group (16-bit storage: staged) */
        const size_t n_lnf = fl_outer_1d(m);
        fl_store_stage_begin(m->store, n_lnf);
        /* the last block's bf16 dy too (an fp32 RMSNorm weight, bf16-mixed: through the w16 kernel) */
        dres16 = a->act_dtype == FL_BF16 && a->dyb16 && !m->sp && (op.lnf_wt != FL_F32 || fl_norm16_have(m, 1));
        float *dw = op.dlnf_w, *db = op.dlnf_b;
        if (m->sp) fl_sp_norm_begin(m, op.dlnf_w, op.dlnf_b, &dw, &db); /* the rank's rows' part, summed below */
        fl_norm_backward_t(m, a->dres, dres16 ? a->dyb16 : NULL, dw, db, a->buf1 + r0 * m->cfg.dim, a->res[L],
                           op.lnf_w, op.lnf_wt, a->lnf_mean, a->lnf_rstd, n);
        if (m->sp) FL_TRY(m->tp_ops->norm_sum(m, m->tp_comm, op.dlnf_w, op.dlnf_b));
        FL_TRY(fl_store_stage_flush(m->store, m->layout.group_offset[HG], n_lnf));
    } else {
        FL_TRY(FL_RUN(be, to_device, a->dres, dhidden, nc * sizeof(float)));
    }
    /* the head's gradient was completed in the forward */
    PP_RELEASE(HG);
    PP_READY(HG);
    FL_TRY(blocks_backward(m, B, T, dres16)); // d res[0] in dres
    if (m->stage.in) { /* a later pipeline stage: d res[0] goes to the previous one (fl_model_stage_dinput; sequence
                        * parallel: the rank's rows); the embeddings' gradients (none here) are ready as they are */
        PP_READY(0);
        m->fwd_train = 0;
        return FL_OK;
    }
    const float *de = a->dres; // d(the embeddings' sum)
    if (m->sp) { /* sequence parallel: d res[0] of the group's rows (the rank's in dres), for the embeddings */
        FL_TRY(m->tp_ops->sp_gather(m, a->dres, a->buf1, N));
        de = a->buf1;
    }
    for (int i = 0; i < mg->n_ops && mg->op[i].kind != FL_MOP_BLOCKS; i++)
        if (mg->op[i].kind == FL_MOP_NORM) { /* the embedding norm: d(its input) into buf1 */
            const int rw = mg->op[i].role_w, rb = mg->op[i].role_b;
            FL_RUN(be, zero, a->buf1, nc * sizeof(float));
            fl_norm_backward(m, a->buf1, role_param(m, 0, rw, 1), role_param(m, 0, rb, 1), a->dres, a->emb_x,
                             role_param(m, 0, rw, 0), a->emb_mean, a->emb_rstd, N);
            de = a->buf1;
        }
    if (fl_store_sharded(m->store)) { /* the embeddings' gradient buffer (tied: the head's, since the forward) */
        PP_GRADS(0);
        fl_get_outer(m, &op);
    }
    for (int i = 0; i < mg->n_ops && mg->op[i].kind != FL_MOP_BLOCKS; i++) {
        if (mg->op[i].kind == FL_MOP_EMBED) FL_TRY(fl_embed_backward(m, &op, de, a->ids, B, T));
        if (mg->op[i].kind == FL_MOP_EMBED_TYPE)
            FL_RUN(be, embedding_backward, role_param(m, 0, FL_ROLE_TYPE_EMBED, 1), NULL, de, a->type_ids, B, T,
                   m->cfg.dim);
    }
    PP_READY(0);
    m->fwd_train = 0;
    return FL_OK;
}

/* ---- the entry points: checks, the backend's scratch and compute dtype around each call ---- */

/* The backend's scratch (fl_backend.set_scratch) is the model's WORKSPACE region, lent for the
 * duration of each call and taken back before returning, so no op allocates and no pointer
 * into a freed arena outlives the call. */
static void lend_scratch(const fl_model *m, int on) {
    if (m->acts && m->acts->be_scratch)
        FL_RUN(m->be, set_scratch, on ? m->acts->be_scratch : NULL, on ? m->acts->be_scratch_bytes : 0);
}

/* The precision's compute dtype told to the backend for the call (fl_backend.set_compute_dtype:
 * bf16 runs may take its tensor-core attention), FL_F32 again after. */
void fl_model_tell_compute_dtype(const fl_model *m, int on) {
    if (m->be->set_compute_dtype) FL_RUN(m->be, set_compute_dtype, on && m->prec.name ? m->prec.compute_dtype : FL_F32);
}

static void around(const fl_model *m, int on, int compute) {
    lend_scratch(m, on);
    if (compute) fl_model_tell_compute_dtype(m, on);
}

/* A decoder-only forward (the table ends in HEAD_LM). */
static fl_status lm_check(const fl_model *m, const char *fn, int B, int T, const int32_t *targets, float grad_scale) {
    if (fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: %s is an encoder-decoder (fl_model_forward_s2s)", fn,
                         fl_arch_get(m->cfg.arch)->display);
    if (!m->acts) return fl_errorf(FL_ERR_INVALID, "fl_model_forward: activations not allocated (call fl_model_alloc_acts)");
    if (end_op(m->acts->mgraph) != FL_MOP_HEAD_LM)
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_forward: %s has no LM head (an encoder: fl_model_encode)",
                         fl_arch_get(m->cfg.arch)->display);
    if (m->adapt && m->adapt->merged) /* the adapters are in the weights now: running them again would double them */
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward: the LoRA adapters were merged into the weights "
                                         "(fl_model_lora_merge); save the model and reload it to run it");
    if (B * T > m->B * m->T || T > m->T)
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward: batch (%d,%d) exceeds the arena's (%d,%d)", B, T, m->B, m->T);
    if (grad_scale > 0 && (!targets || (!fl_model_grads_data(m) && !m->adapt)))
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward: training forward needs targets and gradient buffers");
    return FL_OK;
}

/* Sequence parallelism: a pass whose B T rows the group does not divide runs at the shortest T' > T it divides (at
 * most the arena's T, a multiple of the group: fl_model_alloc_acts), each sequence padded at its end with token 0 and
 * ignored targets. The decoders attend causally: the padded rows read the real ones, never the reverse, and their
 * losses are ignored, so the real rows' values, losses and gradients are the unpadded pass's. */
static fl_status sp_pad(fl_model *m, const int32_t **ids, const int32_t **targets, int B, int *T) {
    const int n = m->cfg.tp_size, T0 = *T, Tp = fl_sp_pass_T(m, B, T0);
    if (Tp == T0) return FL_OK;
    if (Tp > m->T)
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward: sequence parallel over %d ranks: the batch's %d x %d rows "
                         "padded to %d x %d exceed the arena's T %d", n, B, T0, B, Tp, m->T);
    fl_acts *a = m->acts;
    const size_t cap = (size_t)m->B * m->T;
    if (!a->sp_pad && !(a->sp_pad = malloc(2 * cap * sizeof *a->sp_pad)))
        return fl_errorf(FL_ERR_OOM, "sequence parallel: out of host memory for a padded batch");
    int32_t *pi = a->sp_pad, *pt = *targets ? a->sp_pad + cap : NULL;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < Tp; t++) {
            pi[b * Tp + t] = t < T0 ? (*ids)[b * T0 + t] : 0;
            if (pt) pt[b * Tp + t] = t < T0 ? (*targets)[b * T0 + t] : FL_IGNORE_INDEX;
        }
    *ids = pi;
    *targets = pt;
    *T = Tp;
    return FL_OK;
}

/* The two phases of fl_model_forward (the caller lends the scratch and tells the compute dtype). */
static fl_status lm_body(fl_model *m, const int32_t *ids, const int32_t *targets, int B, int T, float grad_scale) {
    FL_TRY(lm_check(m, "fl_model_forward", B, T, targets, grad_scale));
    const int T_given = T;
    FL_TRY(sp_pad(m, &ids, &targets, B, &T)); /* sequence parallel: rows the group divides */
    const pass p = {.ids = ids, .targets = targets, .B = B, .T = T, .train = grad_scale > 0, .grad_scale = grad_scale};
    m->acts->fwd.open = 0;
    m->acts->drop = p.train && m->cfg.dropout_on; /* OPT's dropout: training forwards (and their backward) only */
    FL_TRY(forward_body(m, &p));
    m->acts->fwd = (fl_fwd_pass){.targets = targets, .grad_scale = grad_scale, .B = B, .T = T, .open = 1,
                                 .T_given = T_given};
    return FL_OK;
}

static fl_status lm_head(fl_model *m, float *logits_out) {
    if (!m->acts || !m->acts->fwd.open)
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward_head: needs a preceding fl_model_forward_body");
    const fl_fwd_pass f = m->acts->fwd;
    if (logits_out && f.T != f.T_given)
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_forward: the logits of a sequence-parallel pass padded from T %d "
                         "to %d are not returned (give a T the group divides)", f.T_given, f.T);
    const pass p = {.targets = f.targets, .B = f.B, .T = f.T, .train = f.grad_scale > 0, .grad_scale = f.grad_scale};
    m->acts->fwd.open = 0;
    return forward_end(m, &p, logits_out, NULL);
}

fl_status fl_model_forward_body(fl_model *m, const int32_t *ids, const int32_t *targets, int B, int T,
                                float grad_scale) {
    around(m, 1, 1);
    fl_status s = lm_body(m, ids, targets, B, T, grad_scale);
    around(m, 0, 1);
    return s;
}

/* The micro-batch's seed: the model's own dropout (T5, OPT), the adapters' draws through their table's owner */
void fl_model_adapters_seed(fl_model *m, uint64_t seed) {
    m->drop_seed = seed;
    if (m->adapt && m->adapt->h.seed) m->adapt->h.seed(m, seed);
}

/* Another kind's passes (fl_model_kind, installed with its arena), or NULL: the decoder-only stack's below. */
static const fl_model_kind *kind_of(const fl_model *m) { return m->acts ? m->acts->kind : NULL; }

fl_status fl_model_forward_micro(fl_model *m, const fl_micro_batch *mb, float grad_scale, const uint64_t *seed) {
    if (seed) fl_model_adapters_seed(m, *seed);
    const fl_model_kind *k = kind_of(m);
    if (mb->src && !k) /* a source is an encoder-decoder's, whose arena installs its kind */
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward_micro: a source sequence for %s (%s)",
                         fl_arch_get(m->cfg.arch)->display,
                         fl_model_is_s2s(&m->cfg) ? "activations not allocated: call fl_model_alloc_acts"
                                                  : "one stack: no encoder");
    if (k) return k->forward_micro(m, mb, grad_scale); /* an encoder-decoder: its stacks, up to the head's input */
    return fl_model_forward_body(m, mb->ids, mb->targets, mb->B, mb->T, grad_scale);
}

fl_status fl_model_forward_head(fl_model *m, float *logits_out) {
    const fl_model_kind *k = kind_of(m);
    if (k) return k->forward_head(m, logits_out); /* after its forward_micro */
    around(m, 1, 1);
    fl_status s = lm_head(m, logits_out);
    around(m, 0, 1);
    return s;
}

fl_status fl_model_forward(fl_model *m, const int32_t *ids, const int32_t *targets, int B, int T, float grad_scale,
                           float *logits_out) {
    around(m, 1, 1);
    fl_status s = lm_body(m, ids, targets, B, T, grad_scale);
    if (s == FL_OK) s = lm_head(m, logits_out);
    around(m, 0, 1);
    return s;
}

fl_status fl_model_backward(fl_model *m) {
    const fl_model_kind *k = kind_of(m);
    if (k) return k->backward(m); /* the step's one backward: an encoder-decoder's runs its stacks */
    if (fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_INVALID, "fl_model_backward: needs a preceding training forward (grad_scale > 0)");
    if (!m->acts || !m->fwd_train || end_op(m->acts->mgraph) != FL_MOP_HEAD_LM)
        return fl_errorf(FL_ERR_INVALID, "fl_model_backward: needs a preceding training forward (grad_scale > 0)");
    around(m, 1, 1);
    fl_status s = run_backward(m, NULL);
    around(m, 0, 1);
    return s;
}

/* An encoder's pass (the table ends in OUTPUT). */
static fl_status encode_check(const fl_model *m, int B, int T) {
    const fl_acts *a = m->acts;
    if (fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_encode: %s is an encoder-decoder (fl_model_forward_s2s)",
                         fl_arch_get(m->cfg.arch)->display);
    if (!a) return fl_errorf(FL_ERR_INVALID, "fl_model_encode: activations not allocated (call fl_model_alloc_acts)");
    if (end_op(a->mgraph) != FL_MOP_OUTPUT)
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_encode: %s ends in an LM head (fl_model_forward)",
                         fl_arch_get(m->cfg.arch)->display);
    if (!fl_model_params_f32(m) || fl_model_provider(m) || m->adapt || fl_model_quant4(m) || m->act_ckpt ||
        a->act_dtype != FL_F32)
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_encode: fp32 storage and activations only (no LoRA, sharding, "
                                             "4-bit weights or activation checkpointing yet)");
    if (B * T > m->B * m->T || T > m->T)
        return fl_errorf(FL_ERR_INVALID, "fl_model_encode: batch (%d,%d) exceeds the arena's (%d,%d)", B, T, m->B, m->T);
    return FL_OK;
}

fl_status fl_model_encode(fl_model *m, const int32_t *ids, const int32_t *type_ids, const uint8_t *kmask, int B, int T,
                          int train, float *hidden) {
    FL_TRY(encode_check(m, B, T));
    pass p = {.ids = ids, .type_ids = type_ids, .kmask = kmask, .B = B, .T = T, .train = train != 0};
    m->acts->drop = 0;
    around(m, 1, 0);
    fl_status s = forward_body(m, &p);
    if (s == FL_OK) s = forward_end(m, &p, NULL, hidden);
    around(m, 0, 0);
    return s;
}

fl_status fl_model_encode_backward(fl_model *m, const float *dhidden) {
    if (!m->acts || !m->fwd_train || !fl_model_grads_f32(m) || end_op(m->acts->mgraph) != FL_MOP_OUTPUT)
        return fl_errorf(FL_ERR_INVALID, "fl_model_encode_backward: needs a training encode and gradient buffers");
    around(m, 1, 0);
    fl_status s = run_backward(m, dhidden);
    around(m, 0, 0);
    return s;
}

/* ---- HEAD_LM: the decoder-only stack's chunked head, its loss and backward (the head's ops: exec.c) ---------- */

/* The bf16 head's logits chunk (rows, V) = x @ W^T in rows fl_logits_ld(V) apart (V rounded up to 8: GPT-2's 50,257 in
 * rows of 50,264), so that the head's GEMMs read and write 16-byte aligned rows; columns past V are never read. A
 * plain bf16 weight (head_plain16: no bias, adapter or 4-bit part), its GEMM on x16 where there is one, else rounding
 * the fp32 x itself (fl_linear_forward_ex's GEMM); logits_out (NULL or) gets the rows compact (rows of V). */
static fl_status head_logits_ld(fl_model *m, const fl_linear *head, const float *x, const void *x16, int rows,
                                float *logits_out) {
    float *logits = m->acts->logits;
    const int ld = fl_logits_ld(head->out);
    FL_TRY(FL_RUN(m->be, gemm, 0, 1, rows, head->out, head->in, 1.0f, x16 ? x16 : (const void *)x,
                  x16 ? FL_BF16 : FL_F32, head->in, head->wc, FL_BF16, head->in, 0.0f, logits, FL_F32, ld));
    if (logits_out && ld == head->out) return fl_head_logits_out(m, logits_out, logits, rows);
    for (int r = 0; logits_out && r < rows; r++)
        FL_TRY(fl_head_logits_out(m, logits_out + (size_t)r * head->out, logits + (size_t)r * ld, 1));
    return FL_OK;
}

/* One training chunk of a bf16 head on a backend with cross_entropy_dbf16 (issue 30 item 4): the chunk's input
 * rounded to bf16 once (xb16) for the forward and dW GEMMs, the loss's gradient written as bf16 straight into
 * dyb16 for the dx and dW GEMMs. Those are the operands the generic path's GEMMs round from fp32 (the same bits),
 * without its fp32 gradient's (rows, V) write and the converts that read it back. The logits and dyb16 rows are
 * fl_logits_ld(V) apart (head_logits_ld). */
/* x16: NULL (the chunk rounded here into xb16), or the chunk's rows of the final norm's bf16 copy. slot (grouped,
 * FL_CAP_HEAD_GROUP, > 0 chunks): the chunk's place in its group: its dlogits at slot chunks into dyb16 and its rounded
 * x at slot chunks into xb16 (R rows each), dx here and dW left to head_group_dw; -1: one chunk, dx and dW here. */
static fl_status head_chunk_dbf16(fl_model *m, const fl_linear *head, float *dx, const float *x, const void *x16,
                                  const int32_t *tg, float *losses, int rows, float grad_scale, float *logits_out,
                                  int slot) {
    const fl_backend *be = m->be;
    const int ld = fl_logits_ld(head->out);
    const size_t R = (size_t)m->sizes.logits_chunk_rows, at = slot > 0 ? (size_t)slot * R : 0;
    fl_linear hx = *head; /* frozen (no xb16): the forward GEMM rounds x itself, the same operand */
    if (hx.xb16) hx.xb16 = (uint16_t *)hx.xb16 + at * hx.in;
    if (hx.dyb16) hx.dyb16 = (uint16_t *)hx.dyb16 + at * ld;
    if (!x16 && hx.xb16) FL_TRY(FL_RUN(be, convert, hx.xb16, FL_BF16, x, FL_F32, (size_t)rows * hx.in));
    if (x16) hx.xb16 = (void *)x16;
    head = &hx;
    FL_TRY(head_logits_ld(m, head, x, head->xb16, rows, logits_out));
    FL_TRY(FL_RUN(be, cross_entropy_dbf16, losses, head->dyb16, m->acts->logits, tg, rows, head->out, ld, grad_scale,
                  FL_IGNORE_INDEX));
    /* dx (rows, C) = dy (rows, V) @ W (V, C), fl_linear_backward_dy16's dx GEMM on the bf16 dy */
    FL_TRY(FL_RUN(be, gemm, 0, 0, rows, head->in, head->out, 1.0f, head->dyb16, FL_BF16, ld, head->wc, FL_BF16,
                  head->in, 0.0f, dx, FL_F32, head->in));
    if (slot >= 0 || !fl_linear_wants_dy16(head)) return FL_OK; /* grouped: head_group_dw; frozen: no dW */
    /* dW (V, C) += dy^T @ x over the chunk's rows, as fl_linear_backward_dy16's dW GEMM */
    return FL_RUN(be, gemm, 1, 0, head->out, head->in, rows, 1.0f, head->dyb16, FL_BF16, ld, head->xb16, FL_BF16,
                  head->in, 1.0f, head->dw16 ? head->dw16 : (void *)head->dw, head->dw16 ? FL_BF16 : FL_F32, head->in);
}
/* A group's dW (V, C) += dy^T (V, K) @ x (K, C) over its K rows: dyb16's first K rows (fl_logits_ld apart) and x16's
 * (the final norm's bf16 copy from the group's first row, or xb16 where the chunks were rounded), as
 * fl_linear_backward_dy16's dW GEMM */
static fl_status head_group_dw(fl_model *m, const fl_linear *head, const void *x16, int K) {
    return FL_RUN(m->be, gemm, 1, 0, head->out, head->in, K, 1.0f, head->dyb16, FL_BF16, fl_logits_ld(head->out),
                  x16 ? x16 : head->xb16, FL_BF16, head->in, 1.0f, head->dw16 ? head->dw16 : (void *)head->dw,
                  head->dw16 ? FL_BF16 : FL_F32, head->in);
}

/* A plain bf16 head (a BF16 weight, no 4-bit part or head adapter, one vocabulary) on a backend with
 * cross_entropy_dbf16; wide: the head widened to fp32 (fl_act_opts.head_widen) */
static int head_plain16(const fl_model *m, const fl_linear *head, int wide) {
    return m->be->cross_entropy_dbf16 && !wide && head->wc && head->wct == FL_BF16 && head->n_q4 == 0 &&
           !(m->adapt && m->adapt->head) && !m->tp_ops;
}
/* Its training chunks through cross_entropy_dbf16 (trained, or frozen with the dy scratch: fl_linear_dx16, LoRA's,
 * fl_act_opts.dy_bf16) */
static int head_dbf16(const fl_model *m, const fl_linear *head, int train_targets, int wide) {
    return train_targets && head_plain16(m, head, wide) && fl_linear_dx16(head);
}
/* A forward-only pass (the validation, `fitllm loss`) whose vocabulary is not a multiple of 8: its logits in the padded
 * rows too (head_chunk_eval16), the loss alone (no gradient), the same bits as cross_entropy's */
static int head_eval16(const fl_model *m, const fl_linear *head, int eval_targets, int wide) {
    return eval_targets && head_plain16(m, head, wide) && fl_logits_ld(head->out) != head->out;
}
static fl_status head_chunk_eval16(fl_model *m, const fl_linear *head, const float *x, const int32_t *tg,
                                   float *losses, int rows, float *logits_out) {
    FL_TRY(head_logits_ld(m, head, x, NULL, rows, logits_out));
    return FL_RUN(m->be, cross_entropy_dbf16, losses, NULL, m->acts->logits, tg, rows, head->out,
                  fl_logits_ld(head->out), 0.0f, FL_IGNORE_INDEX);
}
static void head_linear(fl_model *m, const fl_outer_params *op, fl_linear *head) {
    fl_dims d = fl_model_dims(&m->cfg);
    *head = (fl_linear){.in = d.C, .out = d.V, .w = op->head, .dw = op->dhead};
    fl_linear_set_weight(m, head, op->head_idx);
    fl_linear_set_dw_scratch(m, head);
}
static int head_wide(const fl_model *m, const fl_linear *head) {
    const fl_acts *a = m->acts;
    return a->head_w && head->wc && head->wct == a->head_dt && head->n_q4 == 0 && !(m->adapt && m->adapt->head);
}
void *fl_lm_head_x16(fl_model *m) {
    fl_outer_params op;
    fl_get_outer(m, &op);
    fl_linear head;
    head_linear(m, &op, &head);
    return head_dbf16(m, &head, 1, head_wide(m, &head)) ? head.xb16 : NULL;
}

/* HEAD_LM: logits (rows, V) = lnf @ head^T, chunked over rows, so at most (rows, V) logits exist; with targets the
 * per-token losses, and in training the head's backward too (dlogits overwrite the logits chunk), leaving d(lnf)
 * (N, C) in buf1 for the backward; an lm_head adapter gets its gradients here, chunk by chunk (the base head is
 * frozen). */
fl_status fl_lm_head_loss(fl_model *m, const int32_t *targets, int N, float grad_scale, float *logits_out) {
    const fl_backend *be = m->be;
    fl_acts *a = m->acts;
    fl_dims d = fl_model_dims(&m->cfg);
    const int R = m->sizes.logits_chunk_rows, train = grad_scale > 0;
    const int32_t *tg = a->targets && targets ? a->targets : targets; /* device memory on a device backend */
    fl_outer_params op;
    fl_get_outer(m, &op);
    fl_linear head;
    head_linear(m, &op, &head);
    float *dlnf = a->buf1; // (N, C)
    const void *lnf16 = a->lnf16; /* the final norm's bf16 copy (fl_lm_head_x16), for this pass only */
    a->lnf16 = NULL;
    /* 16-bit storage: the head's gradient accumulates over the chunks in fp32, then is added once */
    const int stage_head = train && targets && head.dw && m->store->g16;
    if (stage_head) fl_store_stage_begin(m->store, (size_t)d.V * d.C);
    /* A 16-bit head on a backend whose 16-bit GEMM widens (fl_act_opts.head_widen): widen the weight once here
     * instead of in every chunk's GEMMs, then run fp32 GEMMs on the same values: a BF16 head's GEMM operands are
     * rounded to bf16 first (its chunk's rows into head_x; the logits' gradient in place, which only this head's
     * dx and dW read), as the bf16 GEMM rounds an F32 A. An F16 GEMM does not round its F32 A, so nothing else
     * changes. Not with a LoRA adapter on lm_head (its branch reads the unrounded x and dy). */
    fl_linear hw = head;
    const int wide = head_wide(m, &head);
    const int round_bf16 = wide && a->head_dt == FL_BF16;
    if (wide) {
        FL_TRY(FL_RUN(be, convert, a->head_w, FL_F32, head.wc, head.wct, (size_t)d.V * d.C)); // (V, C)
        hw.wc = a->head_w;
        hw.wct = FL_F32;
        hw.xb16 = hw.dyb16 = NULL; /* dW += dy^T x in fp32 on the rounded operands */
    }
    const int dbf16 = head_dbf16(m, &head, train && targets, wide);
    const int eval16 = !dbf16 && head_eval16(m, &head, !train && targets, wide);
    /* FL_CAP_HEAD_GROUP: a trained head's chunks grouped G at a time in the dy scratch, their dW one GEMM */
    size_t G = 1;
    if (dbf16 && (be->caps & FL_CAP_HEAD_GROUP) && fl_linear_wants_dy16(&head) && a->dyb16_elems)
        G = a->dyb16_elems / ((size_t)R * fl_logits_ld(d.V));
    const int grouped = G > 1;
    for (int r0 = 0; r0 < N; r0 += R) {
        int rows = N - r0 < R ? N - r0 : R;
        const float *xr = a->lnf + (size_t)r0 * d.C;
        if (dbf16) {
            const void *x16 = lnf16 ? (const uint16_t *)lnf16 + (size_t)r0 * d.C : NULL;
            const int slot = grouped ? (int)((size_t)(r0 / R) % G) : -1, g0 = grouped ? r0 - slot * R : r0;
            FL_TRY(head_chunk_dbf16(m, &head, dlnf + (size_t)r0 * d.C, xr, x16, tg + r0, a->losses + r0, rows, grad_scale,
                                    logits_out ? logits_out + (size_t)r0 * m->cfg.vocab_size : NULL, slot));
            if (grouped && ((size_t)slot == G - 1 || r0 + rows >= N)) /* the group's last chunk: its dW */
                FL_TRY(head_group_dw(m, &head, lnf16 ? (const uint16_t *)lnf16 + (size_t)g0 * d.C : NULL, r0 + rows - g0));
            continue;
        }
        if (eval16) {
            FL_TRY(head_chunk_eval16(m, &head, xr, tg + r0, a->losses + r0, rows,
                                     logits_out ? logits_out + (size_t)r0 * m->cfg.vocab_size : NULL));
            continue;
        }
        if (round_bf16) { /* x (rows, C) -> bf16 -> fp32 */
            FL_TRY(FL_RUN(be, convert, a->head_t16, FL_BF16, xr, FL_F32, (size_t)rows * d.C));
            FL_TRY(FL_RUN(be, convert, a->head_x, FL_F32, a->head_t16, FL_BF16, (size_t)rows * d.C));
            xr = a->head_x;
        }
        if (m->adapt) m->adapt->bind(m->adapt, -1, 0, &head, r0); /* head adapters: this chunk, the batch's dropout mask */
        FL_TRY(fl_linear_forward(be, a->logits, xr, wide ? &hw : &head, rows)); // (rows, V)
        if (logits_out) FL_TRY(fl_head_logits_out(m, logits_out + (size_t)r0 * m->cfg.vocab_size, a->logits, rows));
        if (!targets) continue;
        FL_TRY(fl_head_cross_entropy(m, a->losses + r0, train ? a->logits : NULL, a->logits, tg + r0, targets + r0,
                                     rows, grad_scale)); /* tensor parallel: over the group's vocabulary slices */
        if (!train) continue;
        if (round_bf16) { /* dlogits (rows, V) -> bf16 -> fp32, in place */
            FL_TRY(FL_RUN(be, convert, a->head_t16, FL_BF16, a->logits, FL_F32, (size_t)rows * d.V));
            FL_TRY(FL_RUN(be, convert, a->logits, FL_F32, a->head_t16, FL_BF16, (size_t)rows * d.V));
        }
        FL_TRY(fl_linear_backward(be, dlnf + (size_t)r0 * d.C, 0, a->logits, xr, wide ? &hw : &head, rows));
    }
    if (train && targets && m->tp_ops) FL_TRY(m->tp_ops->head_dx_sum(m, dlnf, N)); /* a vocabulary slice's part of d(lnf) */
    if (stage_head) FL_TRY(fl_store_stage_flush(m->store, op.head_off, (size_t)d.V * d.C));
    return FL_OK;
}

/* The per-token losses come to the host in slices (a device's arena is not host memory), on a device in one copy
 * per micro-batch (each copy waits for the device: issue 30 item 5): m->loss_sum, n_valid; with m->loss_dev lent
 * (fl_step_run) on a backend with loss_sum_dev, summed into it on the device instead (m->loss_on_dev). */
fl_status fl_lm_sum_losses(fl_model *m, const int32_t *targets, int N) {
    const fl_backend *be = m->be;
    const int V = m->cfg.vocab_size;
    m->loss_on_dev = 0;
    if (m->loss_dev && be->loss_sum_dev) { /* summed on the device (the host's order and bits), read at the step's end */
        for (int i = 0; i < N; i++)
            if (targets[i] != FL_IGNORE_INDEX) {
                if (targets[i] < 0 || targets[i] >= V)
                    return fl_errorf(FL_ERR_INVALID, "target id %d at position %d is outside the vocabulary [0, %d)",
                                     targets[i], i, V);
                m->n_valid++;
            }
        const int32_t *tg = m->acts->targets ? m->acts->targets : targets; /* device memory on a device backend */
        FL_TRY(FL_RUN(be, loss_sum_dev, m->acts->losses, tg, N, FL_IGNORE_INDEX, m->loss_dev));
        m->loss_on_dev = 1;
        return FL_OK;
    }
    float lstack[1024], *lheap = NULL, *lbuf = lstack;
    int slice = 1024;
    if (N > slice && !m->host_memory && (lheap = malloc((size_t)N * sizeof *lheap))) {
        lbuf = lheap;
        slice = N;
    }
    fl_status s = FL_OK;
    for (int i0 = 0; s == FL_OK && i0 < N; i0 += slice) {
        int n = N - i0 < slice ? N - i0 : slice;
        s = FL_RUN(be, to_host, lbuf, m->acts->losses + i0, (size_t)n * sizeof(float));
        for (int i = i0; s == FL_OK && i < i0 + n; i++)
            if (targets[i] != FL_IGNORE_INDEX) {
                if (targets[i] < 0 || targets[i] >= V)
                    s = fl_errorf(FL_ERR_INVALID, "target id %d at position %d is outside the vocabulary [0, %d)",
                                  targets[i], i, V);
                else {
                    m->loss_sum += lbuf[i - i0];
                    m->n_valid++;
                }
            }
    }
    free(lheap);
    return s;
}

/* ---- the head's cross-entropy and logits, for every stack's head (this file's HEAD_LM, seq2seq.c's fl_head_loss) ---- */

fl_status fl_head_cross_entropy(fl_model *m, float *loss, float *dlogits, const float *logits, const int32_t *dtargets,
                                const int32_t *targets, int rows, float grad_scale) {
    (void)targets; /* the host's copy (the device's read by both paths) */
    if (m->tp_ops) return m->tp_ops->cross_entropy(m, loss, dlogits, logits, dtargets, rows, grad_scale);
    FL_RUN(m->be, cross_entropy, loss, dlogits, logits, dtargets, rows, m->cfg.vocab_size, grad_scale, FL_IGNORE_INDEX);
    return FL_OK;
}

fl_status fl_head_logits_out(fl_model *m, float *out, const float *logits, int rows) {
    if (m->tp_ops) return m->tp_ops->logits_out(m, out, logits, rows);
    return FL_RUN(m->be, to_host, out, logits, (size_t)rows * m->cfg.vocab_size * sizeof(float));
}
