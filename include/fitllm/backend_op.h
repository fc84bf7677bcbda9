/* fitllm: the backend's one door (issue 29): op records.
 *
 * The model and the trainer issue every per-step backend operation as a record {kind, arguments}
 * through one slot, fl_backend.run, instead of calling the op slots one by one: the layers above the
 * backend depend on one entry (the trainer step's call path enters the backend once: see
 * docs/ARCHITECTURE.md "The step's call path, counted"), and a backend sees the stream of ops at one
 * place (to record, trace or capture it). The record of kind FL_OPK_<slot> holds the arguments of
 * the slot <slot> of fitllm/backend.h after `be`, in the same order and with the same meaning (that
 * header documents each op); FL_RUN(be, slot, args...) issues one with the slot's argument list, so
 * a call site reads as the call it replaces:
 *
 *     FL_TRY(FL_RUN(be, gemm, 0, 1, N, OC, C, 1.0f, x, FL_F32, C, w, FL_F32, C, 0.0f, y, FL_F32, OC));
 *
 * Every kind returns an fl_status: the slot's own for the ops that return one, FL_OK for the ops
 * whose slot returns nothing; an optional slot the backend lacks (NULL) is FL_ERR_UNSUPPORTED naming
 * the op and the backend. sumsq, the one op with a value, writes it to its record's `result`. Two
 * kinds have no slot of their own: attention_qkv_forward / _backward, the decoder's causal
 * self-attention over a fused QKV buffer (fl_attention_qkv_forward / _backward of backend.h).
 *
 * fl_backend_run_slots is the run every backend of this tree installs: a switch over the kinds that
 * calls the backend's own kernels (its slots), so the bits are those of the slot called directly.
 * The slots stay the kernels' table: the op tests, selftest and set-up code call them. A new op is
 * a slot, an X() entry, a record and a case of the switch (src/backend/run.c).
 * (Included at the end of fitllm/backend.h.) */
#ifndef FITLLM_BACKEND_OP_H
#define FITLLM_BACKEND_OP_H

#include "fitllm/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kinds, one per slot (X(slot)), in the order of their records below. */
#define FL_OPK_LIST(X) \
    X(gemm) X(embedding_forward) X(embedding_forward16) X(embedding_backward) X(rmsnorm_forward)                     \
    X(rmsnorm_forward_w16) X(rmsnorm_backward) X(rmsnorm_backward_w16) X(add_rmsnorm_forward) X(layernorm_forward)   \
    X(layernorm_backward) X(rope_forward) X(rope_forward16) X(rope_backward) X(rope_backward16) X(swiglu_forward)    \
    X(swiglu_backward) X(gelu_forward) X(gelu_backward) X(relu_forward) X(relu_backward) X(gelu_erf_forward)         \
    X(gelu_erf_backward) X(geglu_forward) X(geglu_backward) X(act_forward16) X(act_backward16) X(add) X(add16)       \
    X(bias_forward) X(bias_backward) X(attention_forward) X(attention_backward) X(attention_decode)                  \
    X(attention_forward16) X(attention_backward16)                                                                   \
    X(q4_matmul_forward) X(q4_matmul_backward) X(lora_forward) X(lora_backward) X(dropout) X(cross_entropy)          \
    X(cross_entropy_dbf16) X(convert) X(convert_many) X(round16) X(accumulate16) X(adamw_update) X(sgd_update)       \
    X(adam8bit_update) X(sumsq)                                                                                      \
    X(check_finite) X(scale) X(zero) X(copy) X(to_device) X(to_host) X(sync) X(set_scratch) X(set_compute_dtype)     \
    X(attention_qkv_forward) X(attention_qkv_backward) X(gemm_epilogue)                                            \
    X(layernorm_forward_w16) X(layernorm_backward_w16) X(grad_norm_dev) X(loss_sum_dev) X(adamw_update_ss)          \
    X(sgd_update_ss) X(check_finite_dev) X(input_upload) X(input_wait) X(adam8bit_update_ss)                 \
    X(dropout_rows) X(vocab_stats) X(vocab_xent) X(bias_backward16)     \
    X(attention_forward_in16) X(add_norm_forward16) X(add_norm_forward16_b16) X(q4_matmul_forward16) \
    X(q4_matmul_backward16) X(gemm_res16) X(relbias_forward) X(relbias_backward) X(attention_backward_b16)

typedef enum {
#define FL_OPK_ENUM_(slot) FL_OPK_##slot,
    FL_OPK_LIST(FL_OPK_ENUM_)
#undef FL_OPK_ENUM_
    FL_OPK_COUNT
} fl_opk;
/* "gemm" for FL_OPK_gemm; "?" outside the kinds. */
const char *fl_opk_name(fl_opk k);

/* One record per kind: the slot's arguments after `be`, in its order (fitllm/backend.h). sumsq's
 * result: where the sum goes. */
struct fl_op_gemm { int trans_a, trans_b, M, N, K; float alpha; const void *A; fl_dtype ta; int lda; const void *B;
    fl_dtype tb; int ldb; float beta; void *C; fl_dtype tc; int ldc; };
struct fl_op_embedding_forward { float *out; const int32_t *ids; const float *wte, *wpe; int B, T, C; };
struct fl_op_embedding_forward16 { float *out; void *out16; const int32_t *ids; const void *wte, *wpe; fl_dtype dt;
    int B, T, C; };
struct fl_op_embedding_backward { float *dwte, *dwpe; const float *dout; const int32_t *ids; int B, T, C; };
struct fl_op_rmsnorm_forward { float *out, *rstd; const float *inp, *w; int N, C; float eps; };
struct fl_op_rmsnorm_forward_w16 { float *out; void *out16; float *rstd; const float *inp; const void *w; fl_dtype wt;
    int N, C; float eps; };
struct fl_op_rmsnorm_backward { float *dinp, *dw; const float *dout, *inp, *w, *rstd; int N, C; };
struct fl_op_rmsnorm_backward_w16 { float *dinp; void *dinp16; float *dw; const float *dout, *inp; const void *inp16;
    const void *w; fl_dtype wt; const float *rstd; int N, C; };
struct fl_op_add_rmsnorm_forward { void *res, *out; float *rstd; const void *a, *b; const float *w; fl_dtype t;
    int N, C; float eps; };
struct fl_op_layernorm_forward { float *out, *mean, *rstd; const float *inp, *w, *b; int N, C; float eps; };
struct fl_op_layernorm_backward { float *dinp, *dw, *db; const float *dout, *inp, *w, *mean, *rstd; int N, C; };
struct fl_op_layernorm_forward_w16 { float *out; void *out16; float *mean, *rstd; const float *inp; const void *w, *b;
    fl_dtype wt; int N, C; float eps; };
struct fl_op_layernorm_backward_w16 { float *dinp; void *dinp16; float *dw, *db; const float *dout, *inp;
    const void *inp16, *w; fl_dtype wt; const float *mean, *rstd; int N, C; };
struct fl_op_rope_forward { float *x; int B, T, nh, HD; size_t row_stride; const float *cos_t, *sin_t; int pos0; };
struct fl_op_rope_forward16 { float *out; void *x16; const float *x; int B, T, nh, HD, width; const float *cos_t, *sin_t; int pos0; };
struct fl_op_rope_backward { float *dx; int B, T, nh, HD; size_t row_stride; const float *cos_t, *sin_t; int pos0; };
struct fl_op_rope_backward16 { float *dout; void *dx16; const float *dx; int B, T, nh, HD, width; const float *cos_t, *sin_t; int pos0; };
struct fl_op_swiglu_forward { float *out; const float *gu; int N, F; };
struct fl_op_swiglu_backward { float *dgu; const float *dout, *gu; int N, F; };
struct fl_op_gelu_forward { float *out; const float *inp; size_t n; };
struct fl_op_gelu_backward { float *dinp; const float *dout, *inp; size_t n; };
struct fl_op_relu_forward { float *out; const float *inp; size_t n; };
struct fl_op_relu_backward { float *dinp; const float *dout, *inp; size_t n; };
struct fl_op_gelu_erf_forward { float *out; const float *inp; size_t n; };
struct fl_op_gelu_erf_backward { float *dinp; const float *dout, *inp; size_t n; };
struct fl_op_geglu_forward { float *out; const float *gu; int N, F; };
struct fl_op_geglu_backward { float *dgu; const float *dout, *gu; int N, F; };
struct fl_op_act_forward16 { int kind; float *out; void *out16; float *in; const void *in16; int N, F; };
struct fl_op_act_backward16 { int kind; float *din; void *din16; const float *dout, *in; const void *in16; int N, F; };
struct fl_op_add { float *out; const float *a, *b; size_t n; };
struct fl_op_add16 { float *out; void *out16; const float *a, *b; size_t n; };
struct fl_op_bias_forward { float *y; const float *b; int N, OC; };
struct fl_op_bias_backward { float *db; const float *dy; int N, OC; };
struct fl_op_attention_forward { const fl_attn_desc *a; float *out, *lse; const float *q, *k, *v, *bias;
    const uint8_t *kmask; };
struct fl_op_attention_backward { const fl_attn_desc *a; float *dq, *dk, *dv, *dbias;
    const float *dout, *q, *k, *v, *bias; const uint8_t *kmask; const float *out, *lse; };
struct fl_op_attention_decode { float *out; const float *q, *kcache, *vcache; int T, NH, NKV, HD; size_t head_stride; };
struct fl_op_attention_forward16 { const fl_attn_desc *a; float *out; void *out16; float *lse;
    const float *q, *k, *v, *bias; const uint8_t *kmask; };
struct fl_op_attention_backward16 { const fl_attn_desc *a; float *dq, *dk, *dv; const float *dout;
    const void *q16, *k16, *v16; const uint8_t *kmask; const void *out16; const float *lse; };
struct fl_op_q4_matmul_forward { float *y; int ldy; const float *x; const fl_q4_weight *w; int N; float beta; };
struct fl_op_q4_matmul_forward16 { float *y; int ldy; const void *x16; const fl_q4_weight *w; int nw; int N; float beta; };
struct fl_op_q4_matmul_backward { float *dx; const float *dy; int ldy; const fl_q4_weight *w; int N; float beta; };
struct fl_op_q4_matmul_backward16 { float *dx; const void *dy16; int ldy; const fl_q4_weight *w; int nw; int N;
    float beta; };
struct fl_op_lora_forward { float *y; int ldy; float *h, *xd; const float *x, *A, *B; int N, in, out, r;
    float scaling, dropout; uint64_t seed; };
struct fl_op_lora_backward { float *dx, *dA, *dB; const float *dy; int ldy; const float *xb, *h, *A, *B;
    int N, in, out, r; float scaling, dropout; uint64_t seed; float *work; };
struct fl_op_dropout { float *y; const float *x; size_t n; float p; uint64_t seed; int accumulate; };
struct fl_op_cross_entropy { float *loss, *dlogits; const float *logits; const int32_t *targets; int N, V;
    float grad_scale; int ignore_index; };
struct fl_op_cross_entropy_dbf16 { float *loss; void *dlogits16; const float *logits; const int32_t *targets;
    int N, V, ld; float grad_scale; int ignore_index; };
struct fl_op_convert { void *dst; fl_dtype dt; const void *src; fl_dtype st; size_t n; };
struct fl_op_convert_many { int count; void *const *dst; fl_dtype dt; const void *const *src; fl_dtype st;
    const size_t *len; };
struct fl_op_round16 { void *dst; fl_dtype dt; float *x; size_t n; };
struct fl_op_accumulate16 { uint16_t *dst; fl_dtype t; const float *src; size_t n; };
struct fl_op_adamw_update { void *p; fl_dtype tp; const void *g; fl_dtype tg; void *m, *v; fl_dtype ts; size_t n;
    float lr, beta1, beta2, eps, weight_decay; int step; float grad_scale; };
struct fl_op_sgd_update { void *p; fl_dtype tp; const void *g; fl_dtype tg; void *buf; fl_dtype ts; size_t n;
    float lr, momentum, dampening, weight_decay; int nesterov, first_step; float grad_scale; };
struct fl_op_adam8bit_update { void *p; fl_dtype tp; const void *g; fl_dtype tg; const fl_adam8bit_state *st;
    float lr, beta1, beta2, eps, weight_decay; int step; float grad_scale; };
struct fl_op_sumsq { const void *x; fl_dtype t; size_t n; double *result; };
struct fl_op_grad_norm_dev { const void *g; fl_dtype tg; size_t n; float max_norm, scale; int n_loss; double *ss; };
struct fl_op_loss_sum_dev { const float *loss; const int32_t *targets; int N, ignore_index; double *acc; };
struct fl_op_adamw_update_ss { void *p; fl_dtype tp; const void *g; fl_dtype tg; void *m, *v; fl_dtype ts; size_t n;
    float lr, beta1, beta2, eps, weight_decay; int step; const double *ss; };
struct fl_op_sgd_update_ss { void *p; fl_dtype tp; const void *g; fl_dtype tg; void *buf; fl_dtype ts; size_t n;
    float lr, momentum, dampening, weight_decay; int nesterov, first_step; const double *ss; };
struct fl_op_check_finite { const void *x; fl_dtype t; size_t n; float inv_scale; int *found_inf; };
struct fl_op_check_finite_dev { const void *x; fl_dtype t; size_t n; float inv_scale; double *ss; };
struct fl_op_input_upload { int slot; const void *src0; size_t n0; const void *src1; size_t n1, off1; };
struct fl_op_input_wait { int slot; };
struct fl_op_adam8bit_update_ss { void *p; fl_dtype tp; const void *g; fl_dtype tg; const fl_adam8bit_state *st;
    float lr, beta1, beta2, eps, weight_decay; int step; const double *ss; };
struct fl_op_dropout_rows { float *y; const float *x; int rows; size_t w, stride; float p; uint64_t seed;
    int accumulate; };
struct fl_op_vocab_stats { double *stats; const float *logits; const int32_t *targets; int rows, n, lo; };
struct fl_op_attention_forward_in16 { const fl_attn_desc *a; float *out; void *out16; float *lse; const void *q16,
    *k16, *v16; const uint8_t *kmask; };
struct fl_op_bias_backward16 { float *db; void *dy16; const float *dy; int N, OC; };
struct fl_op_attention_backward_b16 { const fl_attn_desc *a; float *dq, *dk, *dv; void *dq16, *dk16, *dv16;
    const void *dout16, *q16, *k16, *v16, *out16; const float *lse; };
struct fl_op_add_norm_forward16 { int ln; float *res; void *res16; float *out; void *out16; float *mean, *rstd;
    const float *a, *b; const void *w, *bias; fl_dtype wt; int N, C; float eps; };
struct fl_op_add_norm_forward16_b16 { int ln; float *res; void *res16; float *out; void *out16; float *mean, *rstd;
    const float *a; const void *b16, *w, *bias; fl_dtype wt; int N, C; float eps; };
struct fl_op_vocab_xent { float *loss, *dlogits; const float *logits; const double *all; const int32_t *targets;
    int rows, n, lo, P, me, V; float grad_scale; int ignore_index; };
struct fl_op_scale { float *x; size_t n; float s; };
struct fl_op_zero { void *x; size_t bytes; };
struct fl_op_copy { void *dst; const void *src; size_t bytes; };
struct fl_op_to_device { void *dst; const void *src; size_t bytes; };
struct fl_op_to_host { void *dst; const void *src; size_t bytes; };
struct fl_op_sync {  };
struct fl_op_set_scratch { void *p; size_t bytes; };
struct fl_op_set_compute_dtype { fl_dtype t; };
struct fl_op_attention_qkv_forward { float *out, *lse; const float *qkv; int B, T, NH, NKV, HD; };
struct fl_op_attention_qkv_backward { float *dqkv; const float *dout, *qkv, *out, *lse; int B, T, NH, NKV, HD; };
struct fl_op_gemm_epilogue { int epi; const void *bias; float *aux; int ldaux; int trans_a, trans_b, M, N, K;
    float alpha; const void *A; fl_dtype ta; int lda; const void *B; fl_dtype tb; int ldb; float beta; float *C;
    int ldc; };

struct fl_op_gemm_res16 { int trans_a, trans_b, M, N, K; float alpha; const void *A; int lda; const void *B; int ldb;
    const void *c16; void *d16; int ldc; };
struct fl_op_relbias_forward { float *bias; const float *tab; const int32_t *rb; int NH, Tq, Tk, nb; };
struct fl_op_relbias_backward { float *dtab; const float *dbias; const int32_t *rb; int NH, Tq, Tk, nb; };

struct fl_oprec {
    fl_opk kind;
    union {
        struct fl_op_gemm gemm;
        struct fl_op_embedding_forward embedding_forward;
        struct fl_op_embedding_forward16 embedding_forward16;
        struct fl_op_embedding_backward embedding_backward;
        struct fl_op_rmsnorm_forward rmsnorm_forward;
        struct fl_op_rmsnorm_forward_w16 rmsnorm_forward_w16;
        struct fl_op_rmsnorm_backward rmsnorm_backward;
        struct fl_op_rmsnorm_backward_w16 rmsnorm_backward_w16;
        struct fl_op_add_rmsnorm_forward add_rmsnorm_forward;
        struct fl_op_layernorm_forward layernorm_forward;
        struct fl_op_layernorm_backward layernorm_backward;
        struct fl_op_layernorm_forward_w16 layernorm_forward_w16;
        struct fl_op_layernorm_backward_w16 layernorm_backward_w16;
        struct fl_op_rope_forward rope_forward;
        struct fl_op_rope_forward16 rope_forward16;
        struct fl_op_rope_backward rope_backward;
        struct fl_op_rope_backward16 rope_backward16;
        struct fl_op_swiglu_forward swiglu_forward;
        struct fl_op_swiglu_backward swiglu_backward;
        struct fl_op_gelu_forward gelu_forward;
        struct fl_op_gelu_backward gelu_backward;
        struct fl_op_relu_forward relu_forward;
        struct fl_op_relu_backward relu_backward;
        struct fl_op_gelu_erf_forward gelu_erf_forward;
        struct fl_op_gelu_erf_backward gelu_erf_backward;
        struct fl_op_geglu_forward geglu_forward;
        struct fl_op_geglu_backward geglu_backward;
        struct fl_op_act_forward16 act_forward16;
        struct fl_op_act_backward16 act_backward16;
        struct fl_op_add add;
        struct fl_op_add16 add16;
        struct fl_op_bias_forward bias_forward;
        struct fl_op_bias_backward bias_backward;
        struct fl_op_attention_forward attention_forward;
        struct fl_op_attention_backward attention_backward;
        struct fl_op_attention_decode attention_decode;
        struct fl_op_attention_forward16 attention_forward16;
        struct fl_op_attention_backward16 attention_backward16;
        struct fl_op_q4_matmul_forward q4_matmul_forward;
        struct fl_op_q4_matmul_backward q4_matmul_backward;
        struct fl_op_lora_forward lora_forward;
        struct fl_op_lora_backward lora_backward;
        struct fl_op_dropout dropout;
        struct fl_op_cross_entropy cross_entropy;
        struct fl_op_cross_entropy_dbf16 cross_entropy_dbf16;
        struct fl_op_convert convert;
        struct fl_op_convert_many convert_many;
        struct fl_op_round16 round16;
        struct fl_op_accumulate16 accumulate16;
        struct fl_op_adamw_update adamw_update;
        struct fl_op_sgd_update sgd_update;
        struct fl_op_adam8bit_update adam8bit_update;
        struct fl_op_sumsq sumsq;
        struct fl_op_check_finite check_finite;
        struct fl_op_scale scale;
        struct fl_op_zero zero;
        struct fl_op_copy copy;
        struct fl_op_to_device to_device;
        struct fl_op_to_host to_host;
        struct fl_op_sync sync;
        struct fl_op_set_scratch set_scratch;
        struct fl_op_set_compute_dtype set_compute_dtype;
        struct fl_op_attention_qkv_forward attention_qkv_forward;
        struct fl_op_attention_qkv_backward attention_qkv_backward;
        struct fl_op_gemm_epilogue gemm_epilogue;
        struct fl_op_gemm_res16 gemm_res16;
        struct fl_op_relbias_forward relbias_forward;
        struct fl_op_relbias_backward relbias_backward;
        struct fl_op_attention_backward_b16 attention_backward_b16;
        struct fl_op_grad_norm_dev grad_norm_dev;
        struct fl_op_loss_sum_dev loss_sum_dev;
        struct fl_op_adamw_update_ss adamw_update_ss;
        struct fl_op_sgd_update_ss sgd_update_ss;
        struct fl_op_check_finite_dev check_finite_dev;
        struct fl_op_input_upload input_upload;
        struct fl_op_input_wait input_wait;
        struct fl_op_adam8bit_update_ss adam8bit_update_ss;
        struct fl_op_dropout_rows dropout_rows;
        struct fl_op_vocab_stats vocab_stats;
        struct fl_op_vocab_xent vocab_xent;
        struct fl_op_bias_backward16 bias_backward16;
        struct fl_op_attention_forward_in16 attention_forward_in16;
        struct fl_op_add_norm_forward16 add_norm_forward16;
        struct fl_op_q4_matmul_forward16 q4_matmul_forward16;
        struct fl_op_q4_matmul_backward16 q4_matmul_backward16;
        struct fl_op_add_norm_forward16_b16 add_norm_forward16_b16;
    };
};

/* Issue one op through be's door: FL_RUN(be, slot, the slot's arguments after be...) -> fl_status. */
#define FL_RUN(be, slot, ...) ((be)->run((be), &(fl_oprec){.kind = FL_OPK_##slot, .slot = {__VA_ARGS__}}))

/* The run of every backend in this tree: op->kind's slot of be called with the record's arguments
 * (FL_ERR_INVALID for an unknown kind, FL_ERR_UNSUPPORTED for a NULL slot). */
fl_status fl_backend_run_slots(const fl_backend *be, const fl_oprec *op);

#ifdef __cplusplus
}
#endif
#endif
