/* The graph executor: every backend op a model pass issues runs here, from the tables the model files
 * describe (graph.c: the block table and the model table; arch_*.c: an architecture's own). What a pass
 * reads top to bottom (transformer.c's stack interpreter, seq2seq.c's, generation, BLIP-2's) calls these:
 *   - the block table's ops in order (fl_block_forward: training, the checkpointed recompute, prefill,
 *     decode) and in reverse, each op's own backward (fl_block_backward);
 *   - the ops around the blocks: the norms (RMSNorm / LayerNorm, fp32 or 16-bit weights, the sequence-parallel
 *     gradient sums) and the embeddings forward and backward (exec_outer.c), the linear layer (dense in any dtype,
 *     4-bit, with its adapters' branches), the head's cross-entropy (dense or vocabulary-parallel) and the chunked
 *     head of the stacks of seq2seq.c / blip2_pass.c (fl_head_loss, in seq2seq.c); the decoder-only stack's own HEAD_LM
 *     (fl_lm_head_loss: the widened 16-bit head, the bf16 loss gradient) is transformer.c's, with the pass that ends
 *     in it.
 * The model files describe (which slot, which weight, which op kind); the executor turns a description
 * into backend calls. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fitllm/comm.h"
#include "exec-impl.h"
#include "model-impl.h"
#include "store.h"

/* ---- running ------------------------------------------------------------------------------ */

/* x16 (NULL or): the q|k|v rows' bf16 copy, written in the same pass where the backend has the variant (forward:
 * stored, x rounded too; backward: the next LINEAR's dy, x not rounded; issue 30 item 1): *done16 = 1. only16: the
 * rotated rows' bf16 copy alone, x read and left as it was (fl_block_only16). */
static fl_status rope(const fl_model *m, float *x, void *x16, int *done16, int bwd, const fl_block_ctx *c,
                      size_t row, int only16) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    if (x16 && (bwd ? be->rope_backward16 : be->rope_forward16) && rope16_fused(m)) {
        *done16 = 1;
        const int nh = d.NH + d.NKV, w = (int)row;
        float *o = only16 ? NULL : x; /* x NULL (the backward): x16 rotated in place (attention_backward_b16's) */
        return bwd ? FL_RUN(be, rope_backward16, o, x16, x, c->B, c->T, nh, d.HD, w, c->rope_cos, c->rope_sin, c->pos0)
                   : FL_RUN(be, rope_forward16, o, x16, x, c->B, c->T, nh, d.HD, w, c->rope_cos, c->rope_sin, c->pos0);
    }
    if (only16)
        return fl_errorf(FL_ERR_INTERNAL, "RoPE: a bf16-only result without rope_%s16", bwd ? "backward" : "forward");
    for (int k = 0; k < 2; k++) { /* the q heads, then the k heads */
        float *xk = k ? x + d.QD : x;
        const int nh = k ? d.NKV : d.NH;
        FL_TRY(bwd ? FL_RUN(be, rope_backward, xk, c->B, c->T, nh, d.HD, row, c->rope_cos, c->rope_sin, c->pos0)
                   : FL_RUN(be, rope_forward, xk, c->B, c->T, nh, d.HD, row, c->rope_cos, c->rope_sin, c->pos0));
    }
    return FL_OK;
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
            FL_TRY(FL_RUN(be, copy, kc + dst, row + d.QD + (size_t)h * d.HD, (size_t)d.HD * sizeof(float)));
            FL_TRY(FL_RUN(be, copy, vc + dst, row + d.QD + d.KVD + (size_t)h * d.HD, (size_t)d.HD * sizeof(float)));
        }
    }
    return FL_OK;
}

/* Rows of slot k in this pass: the block's B x T, or B x Tk for a stream from outside and what is computed from it. */
static int rows(const fl_block_graph *g, int k, const fl_block_ctx *x) {
    const int n = x->B * (g->slot[k].xrows ? x->Tk : x->T);
    return g->sp > 1 && g->slot[k].srows ? n / g->sp : n; /* sequence parallel: the rank's rows of the stream */
}

/* slot k stored in bf16 (stored16, exec-impl.h): its copy written after its last writer */
static fl_status store16(const fl_backend *be, const fl_block_graph *g, int k, float *const *s, const fl_block_ctx *x) {
    if (!stored16(g, k, x)) return FL_OK;
    const size_t n = (size_t)rows(g, k, x) * g->slot[k].width;
    if (be->round16) return FL_RUN(be, round16, x->s16[k], FL_BF16, s[k], n); /* one kernel */
    FL_TRY(FL_RUN(be, convert, x->s16[k], FL_BF16, s[k], FL_F32, n));
    return FL_RUN(be, convert, s[k], FL_F32, x->s16[k], FL_BF16, n);
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
    if (o->p >= 0 && x->attn_drop_p > 0) { /* dropout on the weights: the op's site of the block's seed */
        a->drop_p = x->attn_drop_p;
        a->drop_seed = fl_dropout_seed(x->drop_seed, (uint64_t)o->p);
    }
}

/* ---- dropout on a tensor-parallel rank's heads and columns (T5 under --tensor_parallel) --------------------------
 * The masks are one process's: fitllm/lora.h's keep(seed, i) of an element's index i in the whole model's tensor,
 * and keep(seed, i0 + j) = keep(seed + i0 K, j) (K its odd increment), so a rank's part starting at the whole's index
 * i0 draws the same mask from the shifted seed. */
#define TP_DROP_K 0x9E3779B97F4A7C15ULL
static int tp_drops(const fl_model *m) { return m->cfg.tp_size > 1; }

/* the attention's weights: batch element b's heads h0 .. h0 + NH - 1 of the whole's NH x tp_size, one call each
 * (dropout's index ((b NHw + h0 + h) Tq + t) Tk + j) */
static fl_status attn_tp_drop(const fl_model *m, const fl_attn_desc *a, int bwd, float *out, float *lse, const float *q,
                              const float *k, const float *v, const float *bias, const uint8_t *kmask, float *dq,
                              float *dk, float *dv, float *dbias, const float *dout) {
    const size_t NHw = (size_t)a->NH * (size_t)m->cfg.tp_size, h0 = (size_t)a->NH * (size_t)m->cfg.tp_rank;
    fl_attn_desc ab = *a;
    ab.B = 1;
    for (int b = 0; b < a->B; b++) {
        const size_t qo = (size_t)b * a->Tq, ko = (size_t)b * a->Tk, lo = qo * (size_t)a->NH;
        ab.drop_seed = a->drop_seed + (uint64_t)(((size_t)b * NHw + h0) * (size_t)a->Tq * (size_t)a->Tk) * TP_DROP_K;
        const uint8_t *km = kmask ? kmask + ko : NULL;
        if (!bwd)
            FL_TRY(FL_RUN(m->be, attention_forward, &ab, out + qo * a->ldo, lse + lo, q + qo * a->ldq, k + ko * a->ldk,
                          v + ko * a->ldv, bias, km));
        else
            FL_TRY(FL_RUN(m->be, attention_backward, &ab, dq + qo * a->ldq, dk + ko * a->ldk, dv + ko * a->ldv, dbias,
                          dout + qo * a->ldo, q + qo * a->ldq, k + ko * a->ldk, v + ko * a->ldv, bias, km,
                          out + qo * a->ldo, lse + lo));
    }
    return FL_OK;
}

/* DROPOUT of a slot of the rank's columns (fl_gop.tp_cols; n rows of w): row r's columns start at the whole's index
 * r w N + rank w (one dropout_rows call: row r's mask at r w N past row 0's) */
static fl_status drop_tp_cols(const fl_model *m, float *y, const float *x, int n, size_t w, float p, uint64_t seed,
                              int acc) {
    const size_t W = w * (size_t)m->cfg.tp_size, c0 = w * (size_t)m->cfg.tp_rank;
    return FL_RUN(m->be, dropout_rows, y, x, n, w, W, p, seed + (uint64_t)c0 * TP_DROP_K, acc);
}

/* A DROPOUT's seed: the block's site p; sequence parallel, a slot of the rank's N rows (of w): the whole pass's mask at
 * those rows, which start at the whole's element rank N w (keep(seed, i0 + j) = keep(seed + i0 K, j)) */
static uint64_t drop_seed(const fl_model *m, const fl_block_graph *g, const fl_gop *o, const fl_block_ctx *x, int N,
                          size_t w) {
    const uint64_t s = fl_dropout_seed(x->drop_seed, o->p);
    if (g->sp <= 1 || !g->slot[o->in].srows) return s;
    return s + (uint64_t)((size_t)m->cfg.tp_rank * (size_t)N * w) * TP_DROP_K;
}

/* o16 (NULL or): the output's bf16 copy, written by the op itself where the backend has attention_forward16
 * (*done16 = 1: no round16 after it); in16 (NULL or): the fused causal op's q|k|v rows in bf16 only (gemm_to_attn16:
 * attention_forward_in16 reads them) */
static fl_status attn_forward(const fl_model *m, const fl_block_graph *g, const fl_gop *o, float *const *s,
                              const fl_block_ctx *x, void *o16, int *done16, const uint16_t *in16) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    float *in = s[o->in], *out = s[o->out], *lse = o->a1 >= 0 ? s[o->a1] : NULL;
    if (fused_causal(o, x)) { /* the decoder's fused causal kernels */
        if (x->kv) FL_TRY(kv_append(m, in, x));
        if (x->kv && x->T == 1) {
            fl_kv_cache *kv = x->kv;
            FL_RUN(be, attention_decode, out, in, kv->k + fl_kv_cache_index(kv, x->layer, 0, 0),
                   kv->v + fl_kv_cache_index(kv, x->layer, 0, 0), x->pos0 + 1, d.NH, d.NKV, d.HD,
                   (size_t)kv->max_T * d.HD);
        } else if (in16) { /* gemm_to_attn16 */
            const fl_attn_desc a = fl_attn_desc_qkv(x->B, x->T, d.NH, d.NKV, d.HD);
            FL_TRY(FL_RUN(be, attention_forward_in16, &a, out, o16, lse, in16, in16 + d.QD, in16 + d.QD + d.KVD, NULL));
            *done16 = o16 != NULL;
        } else if (o16 && be->attention_forward16) { /* (N, QD) and its stored copy */
            const fl_attn_desc a = fl_attn_desc_qkv(x->B, x->T, d.NH, d.NKV, d.HD);
            FL_TRY(FL_RUN(be, attention_forward16, &a, out, o16, lse, in, in + d.QD, in + d.QD + d.KVD, NULL, NULL));
            *done16 = 1;
        } else {
            FL_TRY(FL_RUN(be, attention_qkv_forward, out, lse, in, x->B, x->T, d.NH, d.NKV, d.HD)); // (N, QD)
        }
        return FL_OK;
    }
    if (x->kv) return fl_errorf(FL_ERR_UNSUPPORTED, "generation with a KV cache runs causal self-attention only");
    if (x->kv_rows > x->T && x->B != 1)
        return fl_errorf(FL_ERR_INVALID, "incremental decoding (kv_rows) runs one sequence (B %d)", x->B);
    fl_attn_desc a;
    float *q, *k, *v;
    attn_views(m, g, o, x, s, &a, &q, &k, &v);
    const float *bias = o->attn_flags & FL_GATTN_BIAS ? x->attn_bias : NULL;
    const uint8_t *kmask = o->attn_flags & FL_GATTN_MASK ? x->kmask : NULL;
    if (a.drop_p > 0 && tp_drops(m)) /* the whole model's masks at the rank's heads */
        return attn_tp_drop(m, &a, 0, out, lse, q, k, v, bias, kmask, NULL, NULL, NULL, NULL, NULL);
    if (o16 && be->attention_forward16) {
        *done16 = 1;
        return FL_RUN(be, attention_forward16, &a, out, o16, lse, q, k, v, bias, kmask);
    }
    return FL_RUN(be, attention_forward, &a, out, lse, q, k, v, bias, kmask);
}

/* The gradient buffer of slot k: a stream from outside accumulates into the caller's. */
static float *dslot(const fl_block_graph *g, int k, float *const *gb, const fl_block_ctx *x) {
    return g->slot[k].kind == FL_GSLOT_XSTREAM ? (x->dxs ? x->dxs[k] : NULL) : gb[g->slot[k].grad];
}

/* Issue 30 item 1, cuDNN's backward in bf16 around its graphs (attention_backward_b16): the fused causal attention
 * (op ia) whose output only the next op, a plain bf16 LINEAR (the output projection), reads gets its dO in bf16 from
 * that linear's dx GEMM (fl_linear_backward_b16, into the fp32 d(out) buffer, which nothing else reads), no fp32 dO
 * and no conversion; and where RoPE (op ia - 1) writes d(q|k|v) for the q|k|v linear in bf16 alone (fl_block_only16),
 * cuDNN's bf16 gradients go straight into that linear's dy copy (dqkv16) and RoPE rotates them there in place: no
 * zeroed fp32 d(q|k|v), no widening add, no fp32 read. The bits of the fp32 path: RNE of the same fp32 dx sums, cuDNN's
 * bf16 gradients widened exactly, the same rotation. ia < 0: not taken (another backend, cuDNN not running the call,
 * FITLLM_CUDA_CUDNN_B16=0, an adapter or a 4-bit part on the output projection, sequence parallelism). */
static int regather_at(const fl_block_graph *g, int i);
static int bwd_reads16_p(const fl_model *m, const fl_block_graph *g, const fl_gop *o, const fl_block_ctx *x, int plan);
typedef struct {
    int ia;           /* the ATTN op, or -1 */
    uint16_t *dqkv16; /* NULL: the gradients in fp32 (a q|k|v linear reading its dy in fp32: LoRA's, a bias) */
} attn_b16;
static void attn_b16_of(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, const fl_block_ctx *x,
                        unsigned only16, attn_b16 *r) {
    const fl_backend *be = m->be;
    r->ia = -1, r->dqkv16 = NULL;
    if (!be->attention_backward_b16 || !be->attention_b16_ok || !x->s16 || x->kv || g->sp > 1) return;
    const fl_dims d = fl_model_dims(&m->cfg);
    for (int i = 0; i + 1 < g->n_ops; i++) {
        const fl_gop *o = &g->op[i], *pj = &g->op[i + 1];
        if (o->kind != FL_GOP_ATTN || !fused_causal(o, x) || !bwd_reads16_p(m, g, o, x, 0)) continue;
        if (pj->kind != FL_GOP_LINEAR || pj->in != o->out || pj->acc || !unread_after(g, i + 1, o->out) ||
            regather_at(g, i + 1) >= 0 || !fl_linear_dx_b16(&bp->lin[pj->p]))
            return;
        const fl_attn_desc a = fl_attn_desc_qkv(x->B, x->T, d.NH, d.NKV, d.HD);
        const uint16_t *q16 = x->s16[o->in];
        if (!be->attention_b16_ok(be, &a, q16, q16 + d.QD, q16 + d.QD + d.KVD, x->s16[o->out])) return;
        r->ia = i;
        const fl_gop *pv = i > 0 ? &g->op[i - 1] : NULL;
        if (pv && pv->kind == FL_GOP_ROPE && pv->in == o->in && pv->out == o->in && !o->acc && (only16 >> (i - 1) & 1u))
            r->dqkv16 = dy16_for(be, g, bp, i - 1);
        return;
    }
}

/* in16: the fused causal op's q|k|v rows and output read from their bf16 copies (attention_backward16); b16 (NULL
 * or): attention_backward_b16's dO in dout's buffer in bf16, its gradients into b16->dqkv16 (or fp32 din) */
static fl_status attn_backward(const fl_model *m, const fl_block_graph *g, const fl_gop *o, float *const *s,
                               float *const *gb, const fl_block_ctx *x, float *din, float *dout, int in16,
                               const attn_b16 *b16) {
    const fl_backend *be = m->be;
    fl_dims d = fl_model_dims(&m->cfg);
    const float *lse = o->a1 >= 0 ? s[o->a1] : NULL;
    if (fused_causal(o, x) && in16 && b16) { /* dO in bf16 (in dout's buffer), d(q|k|v) in bf16 (dqkv16) or fp32 */
        const fl_attn_desc a = fl_attn_desc_qkv(x->B, x->T, d.NH, d.NKV, d.HD);
        const uint16_t *q16 = x->s16[o->in], *d16 = b16->dqkv16;
        return FL_RUN(be, attention_backward_b16, &a, d16 ? NULL : din, d16 ? NULL : din + d.QD,
                      d16 ? NULL : din + d.QD + d.KVD, (void *)d16, d16 ? (void *)(d16 + d.QD) : NULL,
                      d16 ? (void *)(d16 + d.QD + d.KVD) : NULL, (const void *)dout, q16, q16 + d.QD, q16 + d.QD + d.KVD,
                      x->s16[o->out], lse);
    }
    if (fused_causal(o, x) && in16) {
        const fl_attn_desc a = fl_attn_desc_qkv(x->B, x->T, d.NH, d.NKV, d.HD);
        const uint16_t *q16 = x->s16[o->in];
        return FL_RUN(be, attention_backward16, &a, din, din + d.QD, din + d.QD + d.KVD, dout, q16, q16 + d.QD,
                      q16 + d.QD + d.KVD, NULL, x->s16[o->out], lse);
    }
    if (fused_causal(o, x)) {
        return FL_RUN(be, attention_qkv_backward, din, dout, s[o->in], s[o->out], lse, x->B, x->T, d.NH, d.NKV, d.HD);
    }
    fl_attn_desc a;
    float *q, *k, *v, *dk, *dv;
    attn_views(m, g, o, x, s, &a, &q, &k, &v);
    if (o->attn == FL_ATTN_CROSS) {
        dk = dslot(g, o->in2, gb, x);
        if (!o->acc2) FL_RUN(be, zero, dk, (size_t)rows(g, o->in2, x) * g->slot[o->in2].width * sizeof(float));
    } else {
        dk = din + d.QD;
    }
    dv = dk + d.KVD;
    const float *bias = o->attn_flags & FL_GATTN_BIAS ? x->attn_bias : NULL;
    if (a.drop_p > 0 && tp_drops(m)) /* the whole model's masks at the rank's heads */
        return attn_tp_drop(m, &a, 1, s[o->out], (float *)lse, q, k, v, bias,
                            o->attn_flags & FL_GATTN_MASK ? x->kmask : NULL, din, dk, dv, bias ? x->dattn_bias : NULL,
                            dout);
    return FL_RUN(be, attention_backward, &a, din, dk, dv, bias ? x->dattn_bias : NULL, dout, q, k, v, bias,
                  o->attn_flags & FL_GATTN_MASK ? x->kmask : NULL, s[o->out], lse);
}

/* The blocks' collective ops run by tensor parallelism's interface (m->tp_ops: its ALLREDUCE, sequence
 * parallelism's GATHER and SCATTER and their transposes in the backward); one rank: a sum is nothing to do and a
 * move has no group. */
static fl_status sp_move(const fl_model *m, struct fl_comm *c, int gather, float *whole, float *part, size_t n_whole) {
    if (!m->tp_ops) return fl_errorf(FL_ERR_INVALID, "sequence parallel: the block needs its group");
    return m->tp_ops->move(c, gather, whole, part, n_whole);
}

static fl_status allreduce(const fl_model *m, struct fl_comm *c, float *p, size_t n) {
    if (!c) return FL_OK; /* one rank */
    /* a group given to the block of a model that is not a rank's slice (the block-graph tests): the same sum */
    return (m->tp_ops ? m->tp_ops : &fl_tp_model_ops)->sum(c, p, n);
}

/* bf16 stored, fused (issue 30 item 1): ops that write their stored output's bf16 copy themselves where the
 * backend has the optional variant (act_forward16, add16, rope_forward16: the fp32 op's value, then round16's
 * bits), and a plain linear feeding an activation stored by the GEMM in bf16 only (fl_linear_forward16), its fp32
 * view (where one is carved: fl_block_views32) filled by that activation, its one reader. Backends without them (cpu,
 * ref, opaque): the fp32 op, then store16. An fp32 view that was not carved is NULL: the ops then write the bf16
 * copy alone. */
/* op i is a LINEAR whose output only op i + 1 reads, an activation with a bf16 input variant */
static int gemm_to_act16(const fl_backend *be, const fl_block_graph *g, int i) {
    const fl_gop *o = &g->op[i], *nx = i + 1 < g->n_ops ? &g->op[i + 1] : NULL;
    return be->act_forward16 && nx && act16_kind(nx->kind) >= 0 && nx->in == o->out &&
           g->slot[o->out].kind == FL_GSLOT_WIDE && unread_after(g, i + 1, o->out);
}

/* The next op after op i in the backward's order that is not an ADD (whose backward is the identity on the
 * residual gradient's one buffer); -1: none */
static int next_bwd(const fl_block_graph *g, int i) {
    int j = i - 1;
    while (j >= 0 && g->op[j].kind == FL_GOP_ADD) j--;
    return j;
}
void *fl_block_dout16(const fl_block_graph *g, const fl_block_params *bp) {
    const int j = next_bwd(g, g->n_ops);
    const fl_gop *o = j >= 0 ? &g->op[j] : NULL;
    if (!o || o->kind != FL_GOP_LINEAR || o->out != FL_GSLOT_OUT || !fl_linear_dx16(&bp->lin[o->p])) return NULL;
    return bp->lin[o->p].dyb16;
}
/* A NORM (op i, 16-bit RMSNorm weight: the backend's w16 kernel) finishes the residual gradient d(in), which the
 * next LINEAR in the backward's order reads as its dy (a pre-norm block: the attention's output projection; the
 * block's input gradient: the previous block's last projection, x->din16): the norm writes that LINEAR's bf16 dy
 * as it accumulates (rmsnorm_backward_w16's dinp16). NULL: no such pair. */
static void *norm_dy16_for(const fl_model *m, const fl_backend *be, const fl_block_graph *g,
                           const fl_block_params *bp, int i, const fl_block_ctx *x) {
    const fl_gop *o = &g->op[i];
    (void)be;
    if (!fl_norm16_have(m, 1)) return NULL;
    const int j = next_bwd(g, i);
    if (j < 0) return o->in == FL_GSLOT_IN && !x->no_din ? x->din16 : NULL;
    const fl_gop *pv = &g->op[j];
    if (pv->kind != FL_GOP_LINEAR || pv->out != o->in || !fl_linear_dx16(&bp->lin[pv->p])) return NULL;
    return bp->lin[pv->p].dyb16;
}

/* A biased linear (GPT-2's c_attn, OPT's fused q|k|v) whose stored output only the next op, the fused causal attention,
 * reads (issue 30 item 1): the GEMM writes it in bf16 only, into its stored copy (gemm_epilogue's bias epilogue with
 * a bf16 D: RNE of the fp32 sum + bias, round16's bits of the unfused path's fp32 output), and the attention reads
 * q|k|v in bf16 (attention_forward_in16); the fp32 view is not written (the backward reads the bf16 copy too:
 * attention_backward16, else the views are widened from it). Not with adapters or a 4-bit weight. */
static int gemm_to_attn16(const fl_backend *be, const fl_block_graph *g, int i, const fl_block_ctx *x,
                          const fl_linear *lin) {
    const fl_gop *o = &g->op[i], *nx = i + 1 < g->n_ops ? &g->op[i + 1] : NULL;
    return be->attention_forward_in16 && be->gemm_epilogue && nx && nx->kind == FL_GOP_ATTN && nx->in == o->out &&
           fused_causal(nx, x) && !x->kv && g->slot[o->out].kind == FL_GSLOT_WIDE && unread_after(g, i + 1, o->out) &&
           epilogue_fuses(be, lin) && lin->wc && lin->wct == FL_BF16;
}
/* a LINEAR's fp32 input x: there, or not read (the bf16 copy in16 read instead, no adapter); else set-up left the view
 * out (fl_block_views_dropped) although this pass reads it: refused naming the slot */
static fl_status lin_in32(const fl_block_graph *g, int i, const float *in, const void *in16, const fl_linear *lin) {
    if (in || (in16 && lin->n_adapters == 0)) return FL_OK;
    return fl_errorf(FL_ERR_INTERNAL, "block op %d (a linear) reads the fp32 view of '%s', which the arena does not "
                     "carve (set-up took its readers as bf16 ones)", i, g->slot[g->op[i].in].name);
}
static fl_status linear_bias16(const fl_backend *be, void *y16, float *scratch, const void *x16, const fl_linear *lin,
                               int N) {
    int epi = FL_GEMM_EPI_BIAS | FL_GEMM_EPI_OUT_BF16;
    const void *b = epi_bias(lin, &epi);
    return FL_RUN(be, gemm_epilogue, epi, b, scratch, lin->out, 0, 1, N, lin->out, lin->in, 1.0f, x16, FL_BF16,
                  lin->in, lin->wc, FL_BF16, lin->in, 0.0f, (float *)y16, lin->out);
}
static fl_status linear_bias_gelu(const fl_backend *be, float *out, float *pre, const float *x, const void *x16,
                                  const fl_linear *lin, int N) {
    const void *w = lin->wc ? lin->wc : (const void *)lin->w;
    int epi = FL_GEMM_EPI_BIAS_GELU;
    const void *b = epi_bias(lin, &epi);
    return FL_RUN(be, gemm_epilogue, epi, b, pre, lin->out, 0, 1, N, lin->out, lin->in, 1.0f,
                  x16 ? x16 : (const void *)x, x16 ? FL_BF16 : FL_F32, lin->in, w, lin->wc ? lin->wct : FL_F32, lin->in,
                  0.0f, out, lin->out);
}

/* A residual add's NORM (op j) under a bf16 store, fused with the add (add_norm_forward16) when the backend has the
 * op and the norm would store its output's bf16 copy itself (the w16 kernel, or the fp32 one then store16): that
 * copy, else NULL */
static void *norm_out16(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, int j,
                        const fl_block_ctx *x) {
    const int k = g->op[j].out;
    if (!m->be->add_norm_forward16 || !final_after(g, j, k) || !stored16(g, k, x)) return NULL;
    return bp->norm_wt == FL_F32 || fl_norm16_have(m, 0) ? x->s16[k] : NULL;
}

/* A residual ADD (op i: out += in) of fl_block_forward, rows N; o16 (NULL or): the sum's bf16 copy (*done16 = 1 when
 * the op wrote it). Fused with the next op, a norm of the sum, where one op does both (*fused = 1: the norm done):
 * fp32 activations, add_rmsnorm_forward (RMSNorm, fp32 weight; the CPU's is the two ops, the same bits); bf16 stored
 * (the sum rounded to bf16 before the norm reads it), add_norm_forward16, RMSNorm or LayerNorm (the bits of add16
 * then the w16 norm; issue 30 item 4). A block's last add may be left pending (x->hand_on). stream16 (x->stream16,
 * issue 30 item 1): the residual operand read from its stored bf16 rows, its view sharing out's buffer
 * (add_norm_forward16_b16; the planner's null backend, which writes nothing, takes the fp32 ops). */
static fl_status residual_add(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                              const fl_block_ctx *x, int i, int N, void *o16, int rg, int *done16, int *fused) {
    const fl_backend *be = m->be;
    const fl_gop *o = &g->op[i], *nx = i + 1 < g->n_ops ? &g->op[i + 1] : NULL;
    float *in = s[o->in], *out = s[o->out];
    const size_t wo = (size_t)g->slot[o->out].width;
    const int ln = fl_arch_get(m->cfg.arch)->layernorm, C = m->cfg.dim;
    const float eps = m->cfg.norm_eps;
    const int to_norm = nx && nx->kind == FL_GOP_NORM && nx->in == o->out && wo == (size_t)C && rows(g, nx->in, x) == N;
    float *nout = to_norm ? s[nx->out] : NULL, *mean = to_norm && nx->a1 >= 0 ? s[nx->a1] : NULL;
    float *rstd = to_norm && nx->a2 >= 0 ? s[nx->a2] : NULL;
    const void *w = to_norm ? bp->norm_w[nx->p] : NULL, *b = to_norm ? bp->norm_b[nx->p] : NULL;
    const int pend = x->hand_on && i == g->n_ops - 1 && o->out == FL_GSLOT_OUT; /* a block's last add, left pending */
    if (to_norm && !x->store16 && !ln && bp->norm_wt == FL_F32) {
        *fused = 1;
        return FL_RUN(be, add_rmsnorm_forward, out, nout, rstd, out, in, w, FL_F32, N, C, eps);
    }
    void *n16 = to_norm && o16 ? norm_out16(m, g, bp, i + 1, x) : NULL; /* o16: bf16 stored */
    if (rg) { /* the projection's GEMM wrote the sum's bf16 rows (gemm_res16): its norm, or its fp32 view, alone */
        float *res = fl_block_stream16_dead(g, x->stream16, i + 1, o->out) ? NULL : out;
        *done16 = 1;
        *fused = n16 != NULL;
        if (n16)
            return FL_RUN(be, add_norm_forward16_b16, 0, res, o16, nout, n16, mean, rstd, NULL, o16, w, b,
                          bp->norm_wt, N, C, eps);
        if (pend) {
            *x->hand_on = (fl_add_pending){1, N, (int)wo, out, o16, NULL, NULL, o16};
            return FL_OK;
        }
        if (!res) return FL_OK; /* its fp32 view is overwritten before any read: nothing to widen */
        return FL_RUN(be, add_norm_forward16_b16, 0, res, o16, NULL, NULL, NULL, NULL, NULL, o16, NULL, NULL, FL_F32,
                      N, (int)wo, 0.0f);
    }
    const void *b16 = x->stream16 >> o->in & 1u && be->add_norm_forward16_b16 ? x->s16[o->in] : NULL;
    if (b16 && !o16)
        return fl_errorf(FL_ERR_INTERNAL, "block op %d: '%s' is not stored in bf16 (stream16)", i, g->slot[o->out].name);
    *done16 = o16 && (b16 || be->add16 || n16);
    *fused = n16 != NULL;
    if (b16 && n16) { /* the sum's fp32 rows written only where a later op reads them */
        float *res = fl_block_stream16_dead(g, x->stream16, i + 1, o->out) ? NULL : out;
        return FL_RUN(be, add_norm_forward16_b16, ln, res, o16, nout, n16, mean, rstd, out, b16, w, b, bp->norm_wt, N,
                      C, eps);
    }
    if (n16) /* the norm, and both bf16 copies */
        return FL_RUN(be, add_norm_forward16, ln, out, o16, nout, n16, mean, rstd, out, in, w, b, bp->norm_wt, N, C, eps);
    if (*done16 && pend) {
        *x->hand_on = (fl_add_pending){1, N, (int)wo, out, o16, out, b16 ? NULL : in, b16};
        return FL_OK;
    }
    if (b16) /* the add alone */
        return FL_RUN(be, add_norm_forward16_b16, 0, out, o16, NULL, NULL, NULL, NULL, out, b16, NULL, NULL, FL_F32, N,
                      (int)wo, 0.0f);
    if (*done16) return FL_RUN(be, add16, out, o16, out, in, (size_t)N * wo);
    FL_RUN(be, add, out, out, in, (size_t)N * wo);
    return FL_OK;
}

unsigned fl_block_gemm16_slots(const fl_block_graph *g, const fl_block_params *bp, const fl_block_ctx *x) {
    if (!x->gemm16 || !x->s16 || x->store16) return 0;
    unsigned r = 0;
    for (int k = 0; k < g->n_slots; k++) {
        if (g->slot[k].kind != FL_GSLOT_WIDE || !x->s16[k]) continue;
        int w = -1; /* the last writer */
        for (int i = 0; i < g->n_ops; i++)
            if (g->op[i].out == k || (fl_gop_modifies(&g->op[i]) && g->op[i].in == k)) w = i;
        int readers = 0, ok = w >= 0;
        for (int i = w + 1; ok && i < g->n_ops; i++) {
            const fl_gop *o = &g->op[i];
            if (o->in != k && !(o->kind == FL_GOP_ATTN && o->attn == FL_ATTN_CROSS && o->in2 == k)) continue;
            readers++;
            ok = o->kind == FL_GOP_LINEAR && lin_x16(&bp->lin[o->p]) && bp->lin[o->p].n_adapters == 0;
        }
        if (ok && readers) r |= 1u << k;
    }
    return r;
}

fl_status fl_block_forward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s0,
                           const fl_block_ctx *x) {
    const fl_backend *be = m->be;
    int pend16 = -1; /* a slot stored in bf16 only so far (gemm_to_act16) */
    int pendr = -1;  /* a stored slot not rounded yet: the activation reading it rounds it (FL_ACT16_ROUND_IN) */
    int pendq = -1;  /* q|k|v stored in bf16 only (gemm_to_attn16, a bf16-only RoPE): the attention reads that copy */
    const unsigned only16 = fl_block_only16(m, g, bp, x, 0);
    const unsigned resgemm = fl_block_resgemm(m, g, bp, x); /* ADDs whose sum their projection's GEMM writes */
    const unsigned g16 = fl_block_gemm16_slots(g, bp, x); /* gemm16: the slots only bf16 GEMMs read, stored in bf16 */
    float *s[FL_GRAPH_MAX_SLOTS]; /* the slots' fp32 views; NULL once stale (a bf16-only RoPE's) */
    memcpy(s, s0, (size_t)g->n_slots * sizeof *s);
#define S(k) ((k) >= 0 ? s[k] : NULL)
    if (x->stream16) { /* the residual slots' views share one buffer: this pass reads each while the buffer holds it */
        const char *bad = fl_block_stream16_lacks(m, g, bp, x, x->stream16);
        if (bad)
            return fl_errorf(FL_ERR_INVALID, "block forward: the fp32 view of '%s' shares the residual stream's buffer "
                             "(fl_block_stream16) but this pass would read it after another slot overwrote it (set up "
                             "before the adapters or weights it has now?)", bad);
    }
    int i0 = 0; /* the previous block's last add, pending: done first, fused with op 0 where that norms its sum */
    if (x->take && x->take->on) FL_TRY(fl_xblock_take(m, g, bp, s, x, norm_out16(m, g, bp, 0, x), &i0));
    for (int i = i0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        const int cross = o->kind == FL_GOP_ATTN && o->attn == FL_ATTN_CROSS;
        const int stale = (!s[o->in] && s0[o->in]) || (cross && !s[o->in2] && s0[o->in2]);
        if (stale && !(o->kind == FL_GOP_ATTN && pendq == o->in))
            return fl_errorf(FL_ERR_INTERNAL, "block op %d reads the fp32 view of '%s', which RoPE wrote in bf16 only "
                             "(fl_block_only16)", i, g->slot[o->in].name);
        float *in = s[o->in], *out = s[o->out];
        const int N = rows(g, o->in, x);
        const size_t wi = (size_t)g->slot[o->in].width, wo = (size_t)g->slot[o->out].width;
        /* the output is stored in bf16 after this op */
        const int last = (x->store16 || (g16 >> o->out & 1u)) && final_after(g, i, o->out);
        void *o16 = last && stored16(g, o->out, x) ? x->s16[o->out] : NULL; /* its bf16 copy */
        int done16 = 0; /* the op wrote that bf16 copy itself */
        if (act16_kind(o->kind) >= 0 && be->act_forward16 && (o16 || pend16 == o->in || pendr == o->in)) {
            /* its fp32 view is filled here (and first rounded, pendr) */
            const void *in16 = pend16 == o->in || pendr == o->in ? x->s16[o->in] : NULL;
            const int kind = act16_kind(o->kind) | (pendr == o->in ? FL_ACT16_ROUND_IN : 0);
            FL_TRY(FL_RUN(be, act_forward16, kind, out, o16, in, in16, N, act16_paired(o->kind) ? (int)wo : (int)wi));
            pend16 = pendr = -1;
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
            const void *in16 =
                (x->store16 || (g16 >> o->in & 1u)) && lin_x16(lin) && final_after(g, i, o->in) ? x->s16[o->in] : NULL;
            FL_TRY(lin_in32(g, i, in, in16, lin));
            const fl_gop *nx = i + 1 < g->n_ops ? &g->op[i + 1] : NULL;
            if (resgemm >> (i + 1) & 1u) { /* out + residual in one GEMM: C the residual's bf16 rows, D the sum's */
                FL_TRY(FL_RUN(be, gemm_res16, 0, 1, N, lin->out, lin->in, 1.0f, in16, lin->in, lin->wc, lin->in,
                              x->s16[nx->in], x->s16[o->out], lin->out));
                break;
            }
            if (o16 && be->gelu16_epilogue && nx && nx->kind == FL_GOP_GELU && nx->in == o->out &&
                epilogue_fuses(be, lin)) {
                /* bf16 stored (issue 30 item 3, fl_backend.gelu16_epilogue): the GELU of the fp32 pre-activation in
                 * the GEMM's epilogue, then the GELU's output and (below, `last`) the pre-activation the backward
                 * reads stored in bf16: the pre-activation's bits are the unfused path's, the output is rounded once */
                FL_TRY(linear_bias_gelu(be, s[nx->out], out, in, in16, lin, N));
                if (final_after(g, i + 1, nx->out)) FL_TRY(store16(be, g, nx->out, s, x));
                i++;
                break;
            }
            if (o16 && in16 && gemm_to_attn16(be, g, i, x, lin)) { /* bf16 only, its fp32 view as scratch */
                FL_TRY(linear_bias16(be, o16, out, in16, lin, N));
                pendq = o->out, done16 = 1;
                break;
            }
            if (o16 && in16 && fl_linear_plain16(lin) && gemm_to_act16(be, g, i)) { /* bf16 only: see act16_kind */
                FL_TRY(fl_linear_forward16(be, o16, in16, lin, N));
                pend16 = o->out, done16 = 1;
                break;
            }
            if (o16 && gemm_to_act16(be, g, i)) { /* a biased (or adapted, 4-bit) LINEAR: the activation rounds it */
                FL_TRY(fl_linear_forward_ex(be, out, in, in16, lin, N));
                pendr = o->out, done16 = 1;
                break;
            }
            if (!x->store16 && nx && nx->kind == FL_GOP_GELU && nx->in == o->out && epilogue_fuses(be, lin)) {
                FL_TRY(linear_bias_gelu(be, s[nx->out], out, in, NULL, lin, N)); /* GPT-2's c_fc + GELU: one GEMM */
                i++;
                break;
            }
            FL_TRY(fl_linear_forward_ex(be, out, in, in16, lin, N));
            break;
        }
        case FL_GOP_ROPE:
            FL_TRY(rope(m, in, o16, &done16, 0, x, wi, only16 >> i & 1u));
            if (only16 >> i & 1u) { /* its fp32 view now stale: the attention reads the bf16 rows */
                s[o->in] = NULL;
                if (be->attention_forward_in16) pendq = o->in;
            }
            break;
        case FL_GOP_ATTN:
            FL_TRY(attn_forward(m, g, o, s, x, o16, &done16, pendq == o->in ? (const uint16_t *)x->s16[o->in] : NULL));
            pendq = -1;
            break;
        case FL_GOP_ADD: {
            int fused = 0; /* the next op, a norm of the sum, done with it */
            FL_TRY(residual_add(m, g, bp, s, x, i, N, o16, resgemm >> i & 1u, &done16, &fused));
            const int nk = fused ? g->op[i + 1].out : -1; /* gemm16: the fused norm's output, stored as its op would */
            if (nk >= 0 && (g16 >> nk & 1u) && final_after(g, i + 1, nk)) FL_TRY(store16(be, g, nk, s, x));
            i += fused;
            break;
        }
        case FL_GOP_SWIGLU: FL_RUN(be, swiglu_forward, out, in, N, (int)wo); break;
        case FL_GOP_GELU: FL_RUN(be, gelu_forward, out, in, (size_t)N * wi); break;
        case FL_GOP_RELU: FL_RUN(be, relu_forward, out, in, (size_t)N * wi); break;
        case FL_GOP_GELU_ERF: FL_RUN(be, gelu_erf_forward, out, in, (size_t)N * wi); break;
        case FL_GOP_GEGLU:
            if (!be->geglu_forward)
                return fl_errorf(FL_ERR_UNSUPPORTED, "backend %s has no geglu op (T5 v1.1's gated-GELU FFN)", be->name);
            FL_RUN(be, geglu_forward, out, in, N, (int)wo);
            break;
        case FL_GOP_ALLREDUCE:
            if (o->p == FL_GAR_FWD) FL_TRY(allreduce(m, x->comm, out, (size_t)N * wo));
            break;
        case FL_GOP_GATHER: FL_TRY(sp_move(m, x->comm, 1, out, in, (size_t)rows(g, o->out, x) * wo)); break;
        case FL_GOP_SCATTER: FL_TRY(sp_move(m, x->comm, 0, in, out, (size_t)N * wi)); break;
        case FL_GOP_DROPOUT:
            if (o->tp_cols && x->drop_p > 0)
                FL_TRY(drop_tp_cols(m, out, in, N, wo, x->drop_p, fl_dropout_seed(x->drop_seed, o->p), 0));
            else if (x->drop_p > 0 || in != out)
                FL_TRY(FL_RUN(be, dropout, out, in, (size_t)N * wo, x->drop_p, drop_seed(m, g, o, x, N, wo), 0));
            break;
        }
        if (last && !done16) FL_TRY(store16(be, g, o->out, s, x)); /* ROPE: in place */
    }
    return FL_OK;
#undef S
}

/* Sequence parallel: op i reads a TEMP slot a GATHER made (not saved), and no later op reads it: the op the backward
 * reaches first, which gathers the slot again from the GATHER's saved input. The GATHER's index, else -1. */
static int regather_at(const fl_block_graph *g, int i) {
    const fl_gop *o = &g->op[i];
    if (g->sp <= 1 || g->slot[o->in].kind != FL_GSLOT_TEMP) return -1;
    for (int j = i + 1; j < g->n_ops; j++)
        if (g->op[j].in == o->in) return -1;
    for (int j = i - 1; j >= 0; j--)
        if (g->op[j].out == o->in) return g->op[j].kind == FL_GOP_GATHER ? j : -1;
    return -1;
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

/* Backward, bf16 stored (issue 30 item 1): op o reads its saved input (the attention: q|k|v and its output) from
 * the bf16 copies, through the backend's bf16-input variant (rmsnorm_backward_w16's inp16, act_backward16's in16,
 * attention_backward16), each element widened exactly in the kernel: the bits of the fp32 views the
 * widen-before-backward rebuilt, which are then not needed. 0: the op reads the fp32 views. */
/* plan: the planner's null backend standing in for an FL_CAP_VIEWS16 backend, whose bf16 ops it takes as there */
static int bwd_reads16_p(const fl_model *m, const fl_block_graph *g, const fl_gop *o, const fl_block_ctx *x, int plan) {
    const fl_backend *be = m->be;
    if (!x->s16 || !stored16(g, o->in, x)) return 0;
    switch ((fl_gop_kind)o->kind) {
    case FL_GOP_NORM: return plan || fl_norm16_have(m, 1);
    case FL_GOP_ATTN:
        return fused_causal(o, x) && !x->kv && (plan || be->attention_backward16) && stored16(g, o->out, x);
    case FL_GOP_SWIGLU:
    case FL_GOP_GELU:
    case FL_GOP_RELU:
    case FL_GOP_GEGLU: return plan || be->act_backward16 != NULL;
    default: return 0;
    }
}

static unsigned bwd_reads32(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                            const fl_block_ctx *x, int plan) {
    const fl_backend *be = m->be;
    unsigned r = 0;
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        switch ((fl_gop_kind)o->kind) {
        case FL_GOP_LINEAR: { /* the dW GEMM reads the stored copy when there is one; the adapters fp32 unless
                               * they all take the stored copy (fl_linear_adapters_x16) */
            const fl_linear *l = &bp->lin[o->p];
            const int x16 = x->s16 && x->s16[o->in];
            if ((l->n_adapters > 0 && !(x16 && fl_linear_adapters_x16(be, l))) ||
                (l->dw && !(fl_linear_wants_dy16(l) && x16)))
                r |= 1u << o->in;
            break;
        }
        case FL_GOP_NORM:
        case FL_GOP_ATTN:
        case FL_GOP_SWIGLU:
        case FL_GOP_GELU:
        case FL_GOP_RELU:
        case FL_GOP_GELU_ERF:
        case FL_GOP_GEGLU:
            if (bwd_reads16_p(m, g, o, x, plan)) break;
            r |= 1u << o->in;
            if (o->kind == FL_GOP_ATTN) r |= 1u << o->out;
            if (o->kind == FL_GOP_ATTN && o->attn == FL_ATTN_CROSS) r |= 1u << o->in2;
            break;
        default: break; /* ROPE, ADD, ALLREDUCE: no saved slot read */
        }
        const int j = regather_at(g, i); /* sequence parallel: the GATHER's saved input, gathered again */
        if (j >= 0) r |= 1u << g->op[j].in;
    }
    return r;
}
unsigned fl_block_bwd_reads32(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                              const fl_block_ctx *x) {
    return bwd_reads32(m, g, bp, x, 0);
}
unsigned fl_block_bwd_reads32_p(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp,
                                const fl_block_ctx *x) {
    return bwd_reads32(m, g, bp, x, fl_backend_discards(m->be));
}

/* Issue 30 item 1, bf16 stored on an FL_CAP_VIEWS16 backend: the slots (bit k) whose fp32 view a pass with context x
 * writes or reads, the forward's ops as fl_block_forward takes them and the backward's (bwd_reads32); every other
 * stored slot is written in bf16 only (the ops get out == NULL) and its view is not carved (acts.c). Where an op has
 * no bf16-only form its fp32 output stays: a LINEAR's (the GEMM into RoPE's in-place input, the residual adds' o /
 * down projections, a biased or adapted linear; gemm_to_attn16's refused-epilogue scratch), RoPE, the residual adds,
 * dropout, the sequence-parallel moves; and every fp32 input: LoRA adapters and 4-bit GEMMs without q416 read x in
 * fp32. ~0u:
 * every view (another backend: the CPU ones compute in fp32). */
unsigned fl_views_test_forget;
unsigned fl_block_views32(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, const fl_block_ctx *x) {
    const fl_backend *be = m->be;
    if (!(be->caps & FL_CAP_VIEWS16) || !x->s16 || !x->store16) return ~0u;
    const int plan = fl_backend_discards(be);
    unsigned need = bwd_reads32(m, g, bp, x, plan);
    int pend16 = -1, pendq = -1; /* as fl_block_forward's */
    for (int i = 0; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i], *nx = i + 1 < g->n_ops ? &g->op[i + 1] : NULL;
        const int o16 = final_after(g, i, o->out) && stored16(g, o->out, x);
        unsigned rd = 1u << o->in, wr = 1u << o->out; /* op i's fp32 reads and writes, unless below */
        if (o->kind == FL_GOP_ATTN && o->attn == FL_ATTN_CROSS) rd |= 1u << o->in2;
        switch ((fl_gop_kind)o->kind) {
        case FL_GOP_NORM: wr = o16 ? 0 : wr; break; /* the w16 kernel with out16 */
        case FL_GOP_LINEAR: {
            const fl_linear *lin = &bp->lin[o->p];
            const int in16 = lin_x16(lin) && final_after(g, i, o->in) && stored16(g, o->in, x);
            if (in16 && lin->n_adapters == 0) rd = 0;
            if (o16 && be->gelu16_epilogue && nx && nx->kind == FL_GOP_GELU && nx->in == o->out && lin_biased(lin) &&
                lin->n_q4 == 0 && lin->n_adapters == 0) /* FITLLM_CUDA_GELU16: the GELU's output in fp32 too */
                wr |= 1u << nx->out | 1u << nx->in;
            else if (o16 && in16 && nx && nx->kind == FL_GOP_ATTN && nx->in == o->out && fused_causal(nx, x) &&
                     g->slot[o->out].kind == FL_GSLOT_WIDE && unread_after(g, i + 1, o->out) && lin_biased(lin) &&
                     lin->n_adapters == 0 && lin->n_q4 == 0)
                pendq = o->out; /* gemm_to_attn16: bf16 only, the view its refused epilogue's scratch (wr kept) */
            else if (o16 && in16 && fl_linear_plain16(lin) && nx && act16_kind(nx->kind) >= 0 && nx->in == o->out &&
                     g->slot[o->out].kind == FL_GSLOT_WIDE && unread_after(g, i + 1, o->out))
                pend16 = o->out, wr = 0; /* gemm_to_act16: bf16 only */
            break;
        }
        case FL_GOP_ATTN:
            if (pendq == o->in) rd = 0;
            pendq = -1;
            if (o16 && !(o->p >= 0 && x->attn_drop_p > 0 && tp_drops(m))) wr = 0; /* attention_forward16 / _in16 */
            break;
        case FL_GOP_SWIGLU:
        case FL_GOP_GELU:
        case FL_GOP_RELU:
            if (pend16 == o->in) rd = 0; /* act_forward16 reads in16 (in NULL: not filled) */
            if (o16) wr = 0;
            pend16 = -1;
            break;
        default: break; /* ROPE, ADD, DROPOUT, the others: fp32 in and out */
        }
        need |= rd | wr;
    }
    return need & ~fl_views_test_forget;
}

fl_status fl_block_backward(const fl_model *m, const fl_block_graph *g, const fl_block_params *bp, float *const *s,
                            float *const *gb, const fl_block_ctx *x) {
    const fl_backend *be = m->be;
    const unsigned need = x->no_din ? grads_needed(g, bp) : ~0u;
    /* the next op's (a LINEAR's) dy already in its dyb16 (dy16_for, norm_dy16_for; the caller's for the first) */
    int dy16_ready = x->dout16_ready && x->s16 && fl_block_dout16(g, bp);
    const unsigned only16 = fl_block_only16(m, g, bp, x, 1);
    /* (the planner's stand-in lacks the bf16 ops, writes nothing, and sizes as the backend it plans: not checked) */
    const char *lack = x->gdrop && !fl_backend_discards(be) ? fl_block_grads16_lacking(g, x->gdrop, only16) : NULL;
    if (lack)
        return fl_errorf(FL_ERR_INVALID, "block backward: this pass writes d('%s') in fp32, which the gradient buffers "
                         "were sized without (fl_block_grads_dropped: set up before the adapters or weights it has now?)",
                         lack);
    const unsigned reads32 = bwd_reads32(m, g, bp, x, 0); /* the saved slots read in fp32 (the others not widened) */
    /* their views share one buffer (stream16; the planner's stand-in lacks the bf16 ops and reads nothing) */
    const unsigned shared32 = fl_backend_discards(be) ? 0 : reads32 & x->stream16;
    for (int k = 0; shared32 && k < g->n_slots; k++)
        if (shared32 >> k & 1u)
            return fl_errorf(FL_ERR_INVALID, "block backward: this pass reads the fp32 view of '%s', which shares the "
                             "residual stream's buffer (fl_block_stream16: set up before the adapters it has now?)",
                             g->slot[k].name);
    int stale = -1; /* the slot whose gradient the op before wrote in bf16 only (fl_block_only16) */
    attn_b16 ab; /* cuDNN's backward in bf16 (attention_backward_b16) */
    attn_b16_of(m, g, bp, x, only16, &ab);
#define S(k) ((k) >= 0 ? s[k] : NULL)
    for (int i = g->n_ops - 1; i >= 0; i--) {
        const fl_gop *o = &g->op[i];
        const fl_gslot *si = &g->slot[o->in], *so = &g->slot[o->out];
        if (o->kind == FL_GOP_ADD) continue; /* both sides on one residual path: d(in) += d(out) is the identity */
        const int ready = dy16_ready; /* this op's dout was rounded into its dyb16 by the op before (dy16_for) */
        dy16_ready = 0;
        const int dstale = stale == o->out, b16 = only16 >> i & 1u; /* d(out) in bf16 only; d(in) written so */
        stale = -1;
        if (dstale && (o->kind != FL_GOP_LINEAR || !ready || fl_linear_reads_dy32(&bp->lin[o->p])))
            return fl_errorf(FL_ERR_INTERNAL, "block op %d reads d('%s') in fp32, which op %d wrote in bf16 only "
                             "(fl_block_only16)", i, so->name, i + 1);
        /* nothing reads d(in): only an op that trains runs (a LINEAR without its dx) */
        const int need_in = need >> o->in & 1u;
        if (!need_in && !op_trains(bp, o)) continue;
        float *din = need_in || o->kind != FL_GOP_LINEAR ? dslot(g, o->in, gb, x) : NULL, *dout = dslot(g, o->out, gb, x);
        if (dstale) dout = NULL; /* read in bf16 (its dyb16) */
        const int N = rows(g, o->in, x);
        const int rg = regather_at(g, i); /* sequence parallel: the whole rows of o's input, gathered again */
        if (rg >= 0) FL_TRY(sp_move(m, x->comm, 1, s[o->in], s[g->op[rg].in], (size_t)N * si->width));
        const size_t wi = (size_t)si->width, wo = (size_t)so->width;
        /* ops whose backward accumulates into d(in): a gradient not started yet starts from zero (a
         * LINEAR overwrites it instead; o->acc: the residual path, or another reader's part already there) */
        const int moves = o->kind == FL_GOP_GATHER || o->kind == FL_GOP_SCATTER; /* overwrite d(in) */
        if (moves && o->acc)
            return fl_errorf(FL_ERR_INTERNAL, "block graph: sequence parallel op %d adds to d('%s')", i, si->name);
        /* the LINEAR next in this order made in and reads d(in) in bf16: this op writes that copy (dy16); b16: that
         * copy alone (an activation's: the update of a zero d(in), not cleared first) */
        void *dy16 = dy16_for(be, g, bp, i);
        if (b16 && act16_kind(o->kind) >= 0) din = NULL;
        if (b16) stale = o->in;
        const int ab16 = ab.ia >= 0 && i == ab.ia && ab.dqkv16; /* the gradients in bf16 alone: din not written */
        if (!o->acc && o->kind != FL_GOP_LINEAR && o->kind != FL_GOP_DROPOUT && !moves && !fl_gop_modifies(o) && din &&
            !ab16)
            FL_RUN(be, zero, din, (size_t)N * wi * sizeof(float));
        const int in16 = bwd_reads16_p(m, g, o, x, 0); /* the saved input read in bf16 (its fp32 view not widened) */
        if ((dy16 || in16) && act16_kind(o->kind) >= 0) {
            FL_TRY(FL_RUN(be, act_backward16, act16_kind(o->kind), din, dy16, dout, s[o->in],
                          in16 ? x->s16[o->in] : NULL, N, act16_paired(o->kind) ? (int)wo : (int)wi));
            dy16_ready = dy16 != NULL;
            continue;
        }
        switch ((fl_gop_kind)o->kind) {
        case FL_GOP_NORM: {
            void *d16 = x->s16 ? norm_dy16_for(m, be, g, bp, i, x) : NULL;
            float *dw = bp->d_norm_w[o->p], *db = bp->d_norm_b[o->p];
            const int part = g->sp > 1 && si->srows; /* sequence parallel: the rank's rows' part, summed below */
            if (part) fl_sp_norm_begin(m, bp->d_norm_w[o->p], bp->d_norm_b[o->p], &dw, &db);
            /* in16: over the stored bf16 input (the weight fp32 or 16-bit) */
            fl_norm_backward_x16(m, din, d16, dw, db, dout, s[o->in], in16 ? x->s16[o->in] : NULL,
                                 bp->norm_w[o->p], bp->norm_wt, S(o->a1), S(o->a2), N);
            if (part) FL_TRY(m->tp_ops->norm_sum(m, x->comm, bp->d_norm_w[o->p], bp->d_norm_b[o->p]));
            dy16_ready = d16 != NULL;
            if (d16 && d16 == x->din16 && x->din16_done) *x->din16_done = 1;
            break;
        }
        case FL_GOP_LINEAR: /* x NULL: its fp32 view not widened (bwd_reads32), the adapters read x16 */
            if (ab.ia >= 0 && i == ab.ia + 1 && din) /* the attention's dO in bf16, in its fp32 buffer */
                FL_TRY(fl_linear_backward_b16(be, din, dout, ready, reads32 >> o->in & 1u ? s[o->in] : NULL,
                                              x->s16 ? x->s16[o->in] : NULL, &bp->lin[o->p], N));
            else
                FL_TRY(fl_linear_backward_dy16(be, din, o->acc, dout, ready, reads32 >> o->in & 1u ? s[o->in] : NULL,
                                               x->s16 ? x->s16[o->in] : NULL, &bp->lin[o->p], N));
            break;
        case FL_GOP_ROPE: /* after attention_backward_b16's bf16 gradients: rotated in place in the linear's copy */
            FL_TRY(rope(m, ab.ia >= 0 && i == ab.ia - 1 && ab.dqkv16 ? NULL : din, dy16, &dy16_ready, 1, x, wi, b16));
            break;
        case FL_GOP_ATTN: FL_TRY(attn_backward(m, g, o, s, gb, x, din, dout, in16, i == ab.ia ? &ab : NULL)); break;
        case FL_GOP_SWIGLU: FL_RUN(be, swiglu_backward, din, dout, s[o->in], N, (int)wo); break;
        case FL_GOP_GELU: FL_RUN(be, gelu_backward, din, dout, s[o->in], (size_t)N * wi); break;
        case FL_GOP_RELU: FL_RUN(be, relu_backward, din, dout, s[o->in], (size_t)N * wi); break;
        case FL_GOP_GELU_ERF: FL_RUN(be, gelu_erf_backward, din, dout, s[o->in], (size_t)N * wi); break;
        case FL_GOP_GEGLU: FL_RUN(be, geglu_backward, din, dout, s[o->in], N, (int)wo); break;
        case FL_GOP_ALLREDUCE:
            if (o->p == FL_GAR_BWD) FL_TRY(allreduce(m, x->comm, din, (size_t)N * wi));
            break;
        case FL_GOP_GATHER: FL_TRY(sp_move(m, x->comm, 0, dout, din, (size_t)rows(g, o->out, x) * wo)); break;
        case FL_GOP_SCATTER: FL_TRY(sp_move(m, x->comm, 1, din, dout, (size_t)N * wi)); break;
        case FL_GOP_DROPOUT: /* d(in) (+)= the forward's mask on d(out); in place: masked where it is */
            if (o->tp_cols && x->drop_p > 0)
                FL_TRY(drop_tp_cols(m, din, dout, N, wi, x->drop_p, fl_dropout_seed(x->drop_seed, o->p),
                                    o->acc && din != dout));
            else if (x->drop_p > 0 || din != dout)
                FL_TRY(FL_RUN(be, dropout, din, dout, (size_t)N * wi, x->drop_p, drop_seed(m, g, o, x, N, wi),
                              o->acc && din != dout));
            break;
        case FL_GOP_ADD: break;
        }
    }
    if (g->slot[FL_GSLOT_IN].grad != FL_GBUF_RES && !x->no_din) /* d(input) ended elsewhere (assign_grads) */
        FL_TRY(FL_RUN(be, copy, gb[FL_GBUF_RES], gb[g->slot[FL_GSLOT_IN].grad],
                      (size_t)rows(g, FL_GSLOT_IN, x) * g->slot[FL_GSLOT_IN].width * sizeof(float)));
    return FL_OK;
#undef S
}
