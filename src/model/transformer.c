/* The decoder's training passes: embeddings, the blocks (each run from its block graph, graph.c:
 * LLaMA's RMSNorm/RoPE/SwiGLU/GQA or GPT-2's LayerNorm/GELU/biases described once), the final norm
 * and the chunked head + cross-entropy, forward and backward (llm.c style: every op a backend call).
 * Activations live in the arena carved from the same graph (acts.c; fp32, or the wide ones stored
 * in 16 bits between forward and backward: fl_act_opts). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model-impl.h"
#include "store.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* A training pass's context: B sequences of T rows from position 0, the arena's RoPE tables. */
static fl_block_ctx train_ctx(const fl_model *m, int B, int T) {
    fl_block_ctx x = {.B = B, .T = T, .rope_cos = m->acts->rope_cos, .rope_sin = m->acts->rope_sin};
    x.kmask = m->acts->kmask_on ? m->acts->kmask : NULL; /* an encoder's key padding mask */
    x.comm = m->tp_comm; /* tensor parallel: the blocks' ALLREDUCE ops (graph_tp.c) */
    return x;
}

/* One block forward: res[l] (N, C) -> res[l+1] (N, C), saving the block's activations in its
 * slots (the block graph, graph.c). Used by the forward pass and, with activation checkpointing,
 * again in backward (same ops, same order: bit-identical). */
static fl_status block_forward(fl_model *m, int l, int B, int T) {
    const fl_block_graph *g = m->acts->graph;
    fl_block_params bp;
    fl_get_block(m, g, l, &bp);
    fl_block_ctx x = train_ctx(m, B, T);
    if (m->acts->res16) { /* bf16 stored: every slot the block writes, after its last writer */
        x.s16 = m->acts->layer[l].s16;
        x.store16 = 1;
    }
    return fl_block_forward(m, g, &bp, m->acts->layer[l].s, &x);
}

/* The parameter store (store.h) around each layout group: gathered right before use (the next one's
 * gather posted ahead), released after; its gradient buffer begun before its backward and handed back
 * after (FSDP: reduce-scattered into the shard; data parallel: the bucket's hook). No-ops for a store
 * that holds every parameter. */
#define PP_GATHER(g, next) FL_TRY(fl_store_gather(m->store, (g), (next)))
#define PP_RELEASE(g) fl_store_release(m->store, (g))
#define PP_GRADS(g) FL_TRY(fl_store_grads_begin(m->store, (g)))
#define PP_READY(g) FL_TRY(fl_store_grads_ready(m->store, (g)))

static fl_status model_forward(fl_model *m, const int32_t *ids, const int32_t *targets, int B, int T, float grad_scale,
                           float *logits_out) {
    const fl_backend *be = m->be;
    fl_acts *a = m->acts;
    if (!a) return fl_errorf(FL_ERR_INVALID, "fl_model_forward: activations not allocated (call fl_model_alloc_acts)");
    if (fl_model_adapters_are_merged(m)) /* the adapters are in the weights now: running them again would double them */
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward: the LoRA adapters were merged into the weights "
                                         "(fl_model_lora_merge); save the model and reload it to run it");
    if (B * T > m->B * m->T || T > m->T)
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward: batch (%d,%d) exceeds the arena's (%d,%d)", B, T, m->B, m->T);
    if (grad_scale > 0 && (!targets || (!fl_model_grads_data(m) && !m->adapt)))
        return fl_errorf(FL_ERR_INVALID, "fl_model_forward: training forward needs targets and gradient buffers");
    fl_dims d = fl_model_dims(&m->cfg);
    const int N = B * T;
    for (int i = 0; i < N; i++)
        if (ids[i] < 0 || ids[i] >= d.V)
            return fl_errorf(FL_ERR_INVALID, "token id %d at position %d is outside the vocabulary [0, %d)", ids[i], i, d.V);
    FL_TRY(be->to_device(be, a->ids, ids, (size_t)N * sizeof *ids)); /* host ids -> the arena */
    /* The arena may be sized for a larger T; views are laid out for (m->B, m->T)
     * rows but we use them as (B, T) contiguous rows, which fits since B*T <= m->B*m->T. */
    /* sharded: the units in forward order are the embeddings (0), the blocks (1..L) and the head
     * group (L+1: final norm, lm_head); tied embeddings keep group 0 gathered for the head */
    const int HG = d.L + 1, tied = m->cfg.tie_embeddings;
    PP_GATHER(0, d.L > 0 ? 1 : HG);
    fl_outer_params op;
    fl_get_outer(m, &op);
    fl_embed_forward(m, &op, a->res[0], a->ids, ids, B, T, 0);
    FL_TRY(fl_acts_store_stream(m, 0, N));
    if (!tied) PP_RELEASE(0);
    const int32_t *tg = targets; /* what cross_entropy reads: device memory on a device backend */
    if (targets && a->targets) {
        FL_TRY(be->to_device(be, a->targets, targets, (size_t)N * sizeof *targets));
        tg = a->targets;
    }

    /* With activation checkpointing every block writes into the same single
     * layer buffer (layer[l] all alias it) and only res[l] survives. With 16-bit
     * saved activations the blocks also share one fp32 buffer of the wide
     * activations, and a training forward rounds each block's into its 16-bit
     * region (the forward itself computes in fp32 either way: same loss). */
    m->ckpt_last_live = 0;
    for (int l = 0; l < d.L; l++) {
        PP_GATHER(l + 1, l + 2 <= d.L ? l + 2 : HG);
        FL_TRY(block_forward(m, l, B, T));
        if (grad_scale > 0) FL_TRY(fl_acts_narrow(m, l, N, 0));
        PP_RELEASE(l + 1);
    }
    /* checkpointing: the last block's activations are still in the shared buffer (the final norm
     * and the head write elsewhere), so the backward starts on them without a recompute */
    m->ckpt_last_live = m->act_ckpt && grad_scale > 0 && d.L > 0;
    if (fl_store_sharded(m->store)) { /* the head group, and in training its gradient buffer (tied: the embeddings' too) */
        PP_GATHER(HG, -1);
        if (grad_scale > 0 && targets) {
            PP_GRADS(HG);
            if (tied) PP_GRADS(0);
        }
        fl_get_outer(m, &op);
    }
    fl_norm_forward(m, a->lnf, a->lnf_mean, a->lnf_rstd, a->res[d.L], op.lnf_w, op.lnf_b, N);

    /* Head + cross-entropy, chunked over rows: at most (rows, V) logits exist.
     * In training the head's backward runs here too (dlogits overwrite the
     * logits chunk), leaving d(lnf) in buf1 for fl_model_backward; an lm_head
     * adapter gets its gradients here, chunk by chunk (the base head is frozen). */
    /* an asynchronous device (not host memory) runs behind the host: wait at the phase edges so the
     * phase times are the device's */
    if (m->phase_sync && !fl_backend_host_memory(be)) FL_TRY(be->sync(be));
    const double t_head = now_ms(); /* the step's "head" phase (fl_step_result.ms_head) */
    const int R = m->sizes.logits_chunk_rows;
    fl_linear head = {.in = d.C, .out = d.V, .w = op.head, .dw = op.dhead};
    fl_linear_set_weight(m, &head, op.head_idx);
    fl_linear_set_dw_scratch(m, &head);
    float *dlnf = a->buf1; // (N, C)
    m->loss_sum = 0;
    m->n_valid = 0;
    m->have_targets = targets != NULL;
    /* 16-bit storage: the head's gradient accumulates over the chunks in fp32, then is added once */
    const int stage_head = grad_scale > 0 && targets && head.dw && m->store->g16;
    if (stage_head) fl_store_stage_begin(m->store, (size_t)d.V * d.C);
    /* A 16-bit head on a backend whose 16-bit GEMM widens (fl_act_opts.head_widen): widen the
     * weight once here instead of in every chunk's GEMMs, then run fp32 GEMMs on the same
     * values: a BF16 head's GEMM operands are rounded to bf16 first (its chunk's rows into
     * head_x; the logits' gradient in place, which only this head's dx and dW read), as the
     * bf16 GEMM rounds an F32 A. An F16 GEMM does not round its F32 A, so nothing else changes.
     * Not with a LoRA adapter on lm_head (its branch reads the unrounded x and dy). */
    fl_linear hw = head;
    const int wide = a->head_w && head.wc && head.wct == a->head_dt && head.n_q4 == 0 && !fl_model_head_adapted(m);
    const int round_bf16 = wide && a->head_dt == FL_BF16;
    if (wide) {
        FL_TRY(be->convert(be, a->head_w, FL_F32, head.wc, head.wct, (size_t)d.V * d.C)); // (V, C)
        hw.wc = a->head_w;
        hw.wct = FL_F32;
        hw.xb16 = hw.dyb16 = NULL; /* dW += dy^T x in fp32 on the rounded operands */
    }
    for (int r0 = 0; r0 < N; r0 += R) {
        int rows = N - r0 < R ? N - r0 : R;
        const float *xr = a->lnf + (size_t)r0 * d.C;
        if (round_bf16) { /* x (rows, C) -> bf16 -> fp32 */
            FL_TRY(be->convert(be, a->head_t16, FL_BF16, xr, FL_F32, (size_t)rows * d.C));
            FL_TRY(be->convert(be, a->head_x, FL_F32, a->head_t16, FL_BF16, (size_t)rows * d.C));
            xr = a->head_x;
        }
        fl_model_bind_adapters(m, -1, 0, &head, r0); /* head adapters: this chunk, the batch's dropout mask */
        FL_TRY(fl_linear_forward(be, a->logits, xr, wide ? &hw : &head, rows)); // (rows, V)
        if (logits_out) FL_TRY(be->to_host(be, logits_out + (size_t)r0 * d.V, a->logits, (size_t)rows * d.V * sizeof(float)));
        if (!targets) continue;
        int train = grad_scale > 0;
        be->cross_entropy(be, a->losses + r0, train ? a->logits : NULL, a->logits, tg + r0, rows, d.V, grad_scale,
                          FL_IGNORE_INDEX);
        if (!train) continue;
        if (round_bf16) { /* dlogits (rows, V) -> bf16 -> fp32, in place */
            FL_TRY(be->convert(be, a->head_t16, FL_BF16, a->logits, FL_F32, (size_t)rows * d.V));
            FL_TRY(be->convert(be, a->logits, FL_F32, a->head_t16, FL_BF16, (size_t)rows * d.V));
        }
        FL_TRY(fl_linear_backward(be, dlnf + (size_t)r0 * d.C, 0, a->logits, xr, wide ? &hw : &head, rows));
    }
    if (stage_head) FL_TRY(fl_store_stage_flush(m->store, op.head_off, (size_t)d.V * d.C));
    if (m->phase_sync && !fl_backend_host_memory(be)) FL_TRY(be->sync(be));
    m->ms_head = now_ms() - t_head;
    if (targets) { /* the per-token losses come to the host in slices (a device's arena is not host memory); on a
                    * device in one copy (each copy waits for the device: issue 30 item 5) */
        float lstack[1024], *lheap = NULL, *lbuf = lstack;
        int slice = 1024;
        if (N > slice && !fl_backend_host_memory(be) && (lheap = malloc((size_t)N * sizeof *lheap))) {
            lbuf = lheap;
            slice = N;
        }
        for (int i0 = 0; i0 < N; i0 += slice) {
            int n = N - i0 < slice ? N - i0 : slice;
            fl_status ls = be->to_host(be, lbuf, a->losses + i0, (size_t)n * sizeof(float));
            if (ls != FL_OK) {
                free(lheap);
                return ls;
            }
            for (int i = i0; i < i0 + n; i++)
                if (targets[i] != FL_IGNORE_INDEX) {
                    if (targets[i] < 0 || targets[i] >= d.V) {
                        free(lheap);
                        return fl_errorf(FL_ERR_INVALID, "target id %d at position %d is outside the vocabulary [0, %d)",
                                         targets[i], i, d.V);
                    }
                    m->loss_sum += lbuf[i - i0];
                    m->n_valid++;
                }
        }
        free(lheap);
    }
    m->fwd_B = B;
    m->fwd_T = T;
    m->fwd_train = grad_scale > 0;
    /* sharded: the head group stays gathered for the final norm's backward (PyTorch keeps its root
     * unit too); tied, the embeddings' weight is not read again (their gradient buffer stays) */
    if (tied) PP_RELEASE(0);
    if (!m->fwd_train) PP_RELEASE(HG);
    return FL_OK;
}


/* The blocks' backward, L-1 down to 0: d res[L] in dres becomes d res[0]. */
static fl_status blocks_backward(fl_model *m, int B, int T) {
    fl_acts *a = m->acts;
    fl_dims d = fl_model_dims(&m->cfg);
    const int N = B * T;
    float *dres = a->dres, *buf1 = a->buf1, *buf2 = a->buf2;
    for (int l = d.L - 1; l >= 0; l--) {
        PP_GATHER(l + 1, l >= 1 ? l : -1); /* the embeddings' weights are not read in backward */
        PP_GRADS(l + 1);
        const size_t gn = fl_group_numel(m, l + 1);
        fl_store_stage_begin(m->store, gn);
        /* 16-bit saved activations: widen this block's back into the shared fp32 buffer (bf16 stored: its
         * input too, which a recompute starts from) */
        FL_TRY(fl_acts_widen(m, l, N));
        /* checkpointing: rebuild this block's activations from its saved input (it also rewrites
         * res[l+1] with identical values; backward no longer needs it). Block L-1's are still
         * there from the forward (the same ops in the same order: the same bits). */
        if (m->act_ckpt && !(l == d.L - 1 && m->ckpt_last_live)) {
            FL_TRY(block_forward(m, l, B, T));
            m->ckpt_recomputed++;
        }
        m->ckpt_last_live = 0;
        /* the block's ops in reverse (graph.c): d res[l+1] in dres becomes d res[l] */
        fl_block_params bp;
        fl_get_block(m, a->graph, l, &bp);
        fl_block_ctx x = train_ctx(m, B, T);
        if (a->act_dtype == FL_BF16) x.s16 = a->layer[l].s16;
        /* LoRA: the embeddings are frozen, so block 0's input gradient has no reader */
        x.no_din = l == 0 && m->adapt && !m->keep_block0_din;
        float *const gb[FL_GRAPH_MAX_GBUF] = {dres, buf1, buf2, a->gbuf_more[0], a->gbuf_more[1]};
        FL_TRY(fl_block_backward(m, a->graph, &bp, a->layer[l].s, gb, &x));
        FL_TRY(fl_store_stage_flush(m->store, m->layout.group_offset[l + 1], gn));
        PP_RELEASE(l + 1);
        PP_READY(l + 1);
    }
    return FL_OK;
}

static fl_status model_backward(fl_model *m) {
    const fl_backend *be = m->be;
    fl_acts *a = m->acts;
    if (!a || !m->fwd_train)
        return fl_errorf(FL_ERR_INVALID, "fl_model_backward: needs a preceding training forward (grad_scale > 0)");
    fl_dims d = fl_model_dims(&m->cfg);
    const int B = m->fwd_B, T = m->fwd_T, N = B * T;
    const int HG = d.L + 1;
    PP_GATHER(HG, d.L > 0 ? d.L : -1); /* kept from the forward; block L-1's gather posted ahead */
    fl_outer_params op;
    fl_get_outer(m, &op);
    float *dres = a->dres;   // (N, C)
    float *buf1 = a->buf1;   // (N, max(C, graph's gbuf_width[1])): d(lnf), then the blocks' off-path gradients
    be->zero(be, dres, (size_t)N * d.C * sizeof(float));
    m->ckpt_recomputed = 0;
    /* the final norm's parameters open the head group (16-bit storage: staged) */
    const size_t n_lnf = fl_outer_1d(m), head_group = m->layout.group_offset[d.L + 1];
    fl_store_stage_begin(m->store, n_lnf);
    fl_norm_backward(m, dres, op.dlnf_w, op.dlnf_b, buf1, a->res[d.L], op.lnf_w, a->lnf_mean, a->lnf_rstd, N);
    FL_TRY(fl_store_stage_flush(m->store, head_group, n_lnf));
    /* the head's gradient was completed in forward */
    PP_RELEASE(HG);
    PP_READY(HG);

    FL_TRY(blocks_backward(m, B, T));
    if (fl_store_sharded(m->store)) { /* the embeddings' gradient buffer (tied: the head's, since the forward) */
        PP_GRADS(0);
        fl_get_outer(m, &op);
    }
    FL_TRY(fl_embed_backward(m, &op, dres, a->ids, B, T));
    PP_READY(0);
    m->fwd_train = 0;
    return FL_OK;
}

/* ---- encoders: the model graph interpreted (embeddings, norms, blocks, the hidden states out) ---- */

/* fp32 parameter / gradient of group g's entry of role r (encoders run fp32 storage), NULL if absent */
static float *enc_param(const fl_model *m, int g, int r, int grad) {
    const int i = r < 0 ? -1 : fl_layout_role(&m->layout, g, (fl_param_role)r);
    if (i < 0) return NULL;
    float *gr = fl_model_grads_f32(m), *pr = fl_model_params_f32(m);
    if (grad) return gr ? gr + m->layout.params[i].offset : NULL;
    return pr + fl_model_store_off(m, i);
}

static fl_status encode_check(const fl_model *m, int B, int T) {
    const fl_acts *a = m->acts;
    if (fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_encode: %s is an encoder-decoder (fl_model_forward_s2s)",
                         fl_arch_get(m->cfg.arch)->display);
    if (!a) return fl_errorf(FL_ERR_INVALID, "fl_model_encode: activations not allocated (call fl_model_alloc_acts)");
    if (!fl_model_graph_has(a->mgraph, FL_MOP_OUTPUT, 1))
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

/* The model graph's ops before BLOCKS: res[0] (N, C) from the ids. A norm that follows the embeddings
 * normalizes their sum, saved in emb_x for its backward. */
static fl_status encode_embed(fl_model *m, const int32_t *ids, int B, int T) {
    const fl_backend *be = m->be;
    fl_acts *a = m->acts;
    const fl_model_graph *mg = a->mgraph;
    const int N = B * T, C = m->cfg.dim;
    float *e = fl_model_graph_has(mg, FL_MOP_NORM, -1) ? a->emb_x : a->res[0]; // (N, C) before the norm
    fl_outer_params op;
    fl_get_outer(m, &op);
    for (int i = 0; i < mg->n_ops && mg->op[i].kind != FL_MOP_BLOCKS; i++) {
        switch ((fl_mop_kind)mg->op[i].kind) {
        case FL_MOP_EMBED: fl_embed_forward(m, &op, e, a->ids, ids, B, T, 0); break; // wte[ids] + wpe[t]
        case FL_MOP_EMBED_TYPE: /* + wtt[types], through buf1 (N, C) */
            be->embedding_forward(be, a->buf1, a->type_ids, enc_param(m, 0, FL_ROLE_TYPE_EMBED, 0), NULL, B, T, C);
            be->add(be, e, e, a->buf1, (size_t)N * C);
            break;
        case FL_MOP_NORM:
            fl_norm_forward(m, a->res[0], a->emb_mean, a->emb_rstd, e, enc_param(m, 0, mg->op[i].role_w, 0),
                            enc_param(m, 0, mg->op[i].role_b, 0), N);
            break;
        default:
            return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_encode: model graph op %d (patch embedding, learned "
                             "queries) is declared but not executed yet", mg->op[i].kind);
        }
    }
    return FL_OK;
}

static fl_status model_encode(fl_model *m, const int32_t *ids, const int32_t *type_ids, const uint8_t *kmask, int B,
                              int T, int train, float *hidden) {
    const fl_backend *be = m->be;
    FL_TRY(encode_check(m, B, T));
    fl_acts *a = m->acts;
    fl_dims d = fl_model_dims(&m->cfg);
    const int N = B * T;
    for (int i = 0; i < N; i++)
        if (ids[i] < 0 || ids[i] >= d.V || (type_ids && (type_ids[i] < 0 || type_ids[i] >= m->cfg.type_vocab_size)))
            return fl_errorf(FL_ERR_INVALID, "token id %d (type %d) at position %d is outside the vocabulary [0, %d) "
                             "(types [0, %d))", ids[i], type_ids ? type_ids[i] : 0, i, d.V, m->cfg.type_vocab_size);
    FL_TRY(be->to_device(be, a->ids, ids, (size_t)N * sizeof *ids));
    if (type_ids) FL_TRY(be->to_device(be, a->type_ids, type_ids, (size_t)N * sizeof *type_ids));
    else be->zero(be, a->type_ids, (size_t)N * sizeof(int32_t));
    a->kmask_on = kmask != NULL;
    if (kmask) FL_TRY(be->to_device(be, a->kmask, kmask, (size_t)N));
    FL_TRY(encode_embed(m, ids, B, T));
    for (int l = 0; l < d.L; l++) FL_TRY(block_forward(m, l, B, T));
    const float *out = a->res[d.L];
    if (fl_model_graph_has(a->mgraph, FL_MOP_NORM, 1)) { /* a final norm (the decoders' kind of output) */
        fl_outer_params op;
        fl_get_outer(m, &op);
        fl_norm_forward(m, a->lnf, a->lnf_mean, a->lnf_rstd, out, op.lnf_w, op.lnf_b, N);
        out = a->lnf;
    }
    if (hidden) FL_TRY(be->to_host(be, hidden, out, (size_t)N * d.C * sizeof(float)));
    m->fwd_B = B;
    m->fwd_T = T;
    m->fwd_train = train != 0;
    return FL_OK;
}

static fl_status model_encode_backward(fl_model *m, const float *dhidden) {
    const fl_backend *be = m->be;
    fl_acts *a = m->acts;
    if (!a || !m->fwd_train || !fl_model_grads_f32(m))
        return fl_errorf(FL_ERR_INVALID, "fl_model_encode_backward: needs a training encode and gradient buffers");
    fl_dims d = fl_model_dims(&m->cfg);
    const int B = m->fwd_B, T = m->fwd_T, N = B * T;
    const size_t nc = (size_t)N * d.C;
    const fl_model_graph *mg = a->mgraph;
    fl_outer_params op;
    fl_get_outer(m, &op);
    if (fl_model_graph_has(mg, FL_MOP_NORM, 1)) { /* d(lnf) -> d res[L] */
        FL_TRY(be->to_device(be, a->buf1, dhidden, nc * sizeof(float)));
        be->zero(be, a->dres, nc * sizeof(float));
        fl_norm_backward(m, a->dres, op.dlnf_w, op.dlnf_b, a->buf1, a->res[d.L], op.lnf_w, a->lnf_mean, a->lnf_rstd, N);
    } else {
        FL_TRY(be->to_device(be, a->dres, dhidden, nc * sizeof(float)));
    }
    FL_TRY(blocks_backward(m, B, T)); // d res[0] in dres
    const float *de = a->dres;        // d(embeddings' sum)
    int en = -1; /* the embedding norm, if any: d(sum) = its backward */
    for (int i = 0; i < mg->n_ops && mg->op[i].kind != FL_MOP_BLOCKS; i++)
        if (mg->op[i].kind == FL_MOP_NORM) en = i;
    if (en >= 0) {
        be->zero(be, a->buf1, nc * sizeof(float));
        fl_norm_backward(m, a->buf1, enc_param(m, 0, mg->op[en].role_w, 1), enc_param(m, 0, mg->op[en].role_b, 1),
                         a->dres, a->emb_x, enc_param(m, 0, mg->op[en].role_w, 0), a->emb_mean, a->emb_rstd, N);
        de = a->buf1;
    }
    for (int i = 0; i < mg->n_ops && mg->op[i].kind != FL_MOP_BLOCKS; i++) {
        if (mg->op[i].kind == FL_MOP_EMBED) be->embedding_backward(be, op.dwte, op.dwpe, de, a->ids, B, T, d.C);
        if (mg->op[i].kind == FL_MOP_EMBED_TYPE)
            be->embedding_backward(be, enc_param(m, 0, FL_ROLE_TYPE_EMBED, 1), NULL, de, a->type_ids, B, T, d.C);
    }
    m->fwd_train = 0;
    return FL_OK;
}

/* The backend's scratch (fl_backend.set_scratch) is the model's WORKSPACE region, lent for the
 * duration of each call and taken back before returning, so no op allocates and no pointer
 * into a freed arena outlives the call. */
static void lend_scratch(const fl_model *m, int on) {
    if (m->acts && m->acts->be_scratch)
        m->be->set_scratch(m->be, on ? m->acts->be_scratch : NULL, on ? m->be->scratch_bytes : 0);
}

/* The precision's compute dtype told to the backend for the call (fl_backend.set_compute_dtype:
 * bf16 runs may take its tensor-core attention), FL_F32 again after. */
void fl_model_tell_compute_dtype(const fl_model *m, int on) {
    if (m->be->set_compute_dtype)
        m->be->set_compute_dtype(m->be, on && m->prec.name ? m->prec.compute_dtype : FL_F32);
}

fl_status fl_model_forward(fl_model *m, const int32_t *ids, const int32_t *targets, int B, int T, float grad_scale,
                           float *logits_out) {
    if (fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_forward: %s is an encoder-decoder (fl_model_forward_s2s)",
                         fl_arch_get(m->cfg.arch)->display);
    if (m->acts && !fl_model_graph_has(m->acts->mgraph, FL_MOP_HEAD_LM, 1))
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_forward: %s has no LM head (an encoder: fl_model_encode)",
                         fl_arch_get(m->cfg.arch)->display);
    lend_scratch(m, 1);
    fl_model_tell_compute_dtype(m, 1);
    fl_status s = model_forward(m, ids, targets, B, T, grad_scale, logits_out);
    fl_model_tell_compute_dtype(m, 0);
    lend_scratch(m, 0);
    return s;
}

fl_status fl_model_backward(fl_model *m) {
    if (fl_model_is_s2s(&m->cfg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "fl_model_backward: %s is an encoder-decoder (fl_model_backward_s2s)",
                         fl_arch_get(m->cfg.arch)->display);
    lend_scratch(m, 1);
    fl_model_tell_compute_dtype(m, 1);
    fl_status s = model_backward(m);
    fl_model_tell_compute_dtype(m, 0);
    lend_scratch(m, 0);
    return s;
}

fl_status fl_model_encode(fl_model *m, const int32_t *ids, const int32_t *type_ids, const uint8_t *kmask, int B, int T,
                          int train, float *hidden) {
    lend_scratch(m, 1);
    fl_status s = model_encode(m, ids, type_ids, kmask, B, T, train, hidden);
    lend_scratch(m, 0);
    return s;
}

fl_status fl_model_encode_backward(fl_model *m, const float *dhidden) {
    lend_scratch(m, 1);
    fl_status s = model_encode_backward(m, dhidden);
    lend_scratch(m, 0);
    return s;
}
