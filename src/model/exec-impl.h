/* The block executor's graph predicates (exec.c, exec16.c): which op reads or writes a slot when, and which bf16
 * paths a pair of ops takes. Private to src/model/exec*.c. */
#ifndef FL_MODEL_EXEC_IMPL_H
#define FL_MODEL_EXEC_IMPL_H

#include "model-impl.h"

/* RoPE's q and k heads are consecutive in the q|k|v rows: rope_forward16 / rope_backward16 take them in one pass */
static inline int rope16_fused(const fl_model *m) {
    fl_dims d = fl_model_dims(&m->cfg);
    return d.QD == d.NH * d.HD;
}
/* Slot k holds its final values once op i has run: no later op writes it (an output, or RoPE's / ALLREDUCE's
 * in-place change). */
static inline int final_after(const fl_block_graph *g, int i, int k) {
    for (int j = i + 1; j < g->n_ops; j++)
        if (g->op[j].out == k || (fl_gop_modifies(&g->op[j]) && g->op[j].in == k)) return 0;
    return 1;
}
/* bf16 activations stored end to end (fl_block_ctx.store16): slot k, just written for the last time in the
 * block, is stored in bf16 (its s16 copy) and the fp32 view the later ops read holds the same value (round on
 * store, widen on load: the CPU backend computes in fp32, what it keeps is bf16). A slot written by several ops
 * (a LINEAR's output then RoPE, or the residual add) is stored once, after the last: the ops between act as one
 * fused kernel (bias + residual epilogue, RoPE in the attention's input preparation) that keeps its
 * intermediate in registers. Statistics stay fp32. */
static inline int stored16(const fl_block_graph *g, int k, const fl_block_ctx *x) {
    const uint8_t kind = g->slot[k].kind;
    return (kind == FL_GSLOT_WIDE || kind == FL_GSLOT_STREAM) && x->s16[k];
}
/* causal self-attention without bias or mask: the fused kernels, unless it drops its weights (OPT in training) */
static inline int fused_causal(const fl_gop *o, const fl_block_ctx *x) {
    return o->attn == FL_ATTN_CAUSAL && !o->attn_flags && !(o->p >= 0 && x->attn_drop_p > 0);
}
/* a paired activation ([gate | up] rows of 2F in, F out: act_forward16's F is its output's width) */
static inline int act16_paired(uint8_t k) { return k == FL_GOP_SWIGLU || k == FL_GOP_GEGLU; }
/* act_forward16 / act_backward16's kind of an activation op, -1: none */
static inline int act16_kind(uint8_t k) {
    return k == FL_GOP_SWIGLU  ? FL_ACT16_SWIGLU
           : k == FL_GOP_GELU  ? FL_ACT16_GELU
           : k == FL_GOP_RELU  ? FL_ACT16_RELU
           : k == FL_GOP_GEGLU ? FL_ACT16_GEGLU
                               : -1;
}
/* no op after op j reads slot k */
static inline int unread_after(const fl_block_graph *g, int j, int k) {
    for (int i = j + 1; i < g->n_ops; i++) {
        const fl_gop *o = &g->op[i];
        if (o->in == k || (o->kind == FL_GOP_ATTN && o->attn == FL_ATTN_CROSS && o->in2 == k)) return 0;
    }
    return 1;
}
/* Backward, bf16 compute: op i (an activation or ROPE) is the last to write d(in) and op i - 1, next in the
 * backward's order, is the LINEAR that made in and reads its dy in bf16: op i writes that copy into the linear's
 * dyb16 as it writes d(in) (act_backward16 / rope_backward16), and the linear skips its convert. NULL: no such
 * pair, or the backend lacks the op (cpu, ref, opaque). */
static inline void *dy16_for(const fl_backend *be, const fl_block_graph *g, const fl_block_params *bp, int i) {
    const fl_gop *o = &g->op[i], *pv = i > 0 ? &g->op[i - 1] : NULL;
    if (!pv || pv->kind != FL_GOP_LINEAR || pv->out != o->in || !fl_linear_dx16(&bp->lin[pv->p])) return NULL;
    const int ok = (act16_kind(o->kind) >= 0 && be->act_backward16) || (o->kind == FL_GOP_ROPE && be->rope_backward16);
    return ok ? bp->lin[pv->p].dyb16 : NULL;
}

static inline int lin_biased(const fl_linear *lin) { return lin->b || lin->b16; } /* an fp32 view or the stored bf16 bias */
/* A biased linear whose bias (and a following op) the GEMM's epilogue takes, e.g. straight into the tanh GELU
 * (GPT-2's c_fc) as one GEMM with cuBLASLt's bias + GELU epilogue (issue 30 item 3): pre = x W^T + b (the slot the
 * GELU's backward reads), out = gelu(pre); the backend's gemm_epilogue (cuda-emu: the bits of the GEMM, bias_forward
 * and gelu_forward). Not with adapters (LoRA adds to pre before the GELU) or a 4-bit weight. */
/* whether a LINEAR reads its input's stored bf16 copy where there is one: a bf16 weight's GEMM (it rounds an fp32 x
 * to it), a 4-bit base with q416 (q4_matmul_forward16) */
static inline int lin_x16(const fl_linear *lin) { return lin->n_q4 ? lin->q416 : lin->wc && lin->wct == FL_BF16; }
static inline int epilogue_fuses(const fl_backend *be, const fl_linear *lin) {
    return be->gemm_epilogue && lin_biased(lin) && lin->n_q4 == 0 && lin->n_adapters == 0;
}
/* gemm_epilogue's bias argument of a linear: its bf16 stored bias (FL_GEMM_EPI_BIAS_BF16 or'ed into *epi) or fp32 */
static inline const void *epi_bias(const fl_linear *lin, int *epi) {
    if (lin->b16) *epi |= FL_GEMM_EPI_BIAS_BF16;
    return lin->b16 ? lin->b16 : (const void *)lin->b;
}

#endif
