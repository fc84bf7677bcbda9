/* The helpers of the backend contract (fitllm/backend.h) that every backend shares: the op
 * names of supports_op, the argument checks of the attention ops (a bad descriptor gets the same
 * error, naming the field, wherever it runs) and the decoder's fused-QKV attention shape. */
#include <math.h>
#include <string.h>

#include "fitllm/backend.h"

fl_status fl_backend_add_rmsnorm_composed(const fl_backend *be, void *res, void *out, float *rstd, const void *a,
                                          const void *b, const float *w, fl_dtype t, int N, int C, float eps) {
    if (t != FL_F32)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s add_rmsnorm_forward: %s activations not supported", be->name,
                         fl_dtype_name(t));
    if (N < 0 || C <= 0) return fl_errorf(FL_ERR_INVALID, "%s add_rmsnorm_forward: bad shape %d x %d", be->name, N, C);
    if (N == 0) return FL_OK;
    be->add(be, (float *)res, (const float *)a, (const float *)b, (size_t)N * C);
    be->rmsnorm_forward(be, (float *)out, rstd, (const float *)res, w, N, C, eps);
    return FL_OK;
}

/* a bf16-stored slot without the backend's one-kernel rounding: round16, else two converts (exec.c's store16) */
static fl_status keep16_composed(const fl_backend *be, void *x16, float *x, size_t n) {
    if (be->round16) return be->round16(be, x16, FL_BF16, x, n);
    FL_TRY(be->convert(be, x16, FL_BF16, x, FL_F32, n));
    return be->convert(be, x, FL_F32, x16, FL_BF16, n);
}

fl_status fl_backend_add_norm16_composed(const fl_backend *be, int ln, float *res, void *res16, float *out, void *out16,
                                         float *mean, float *rstd, const float *a, const float *b, const void *w,
                                         const void *bias, fl_dtype wt, int N, int C, float eps) {
    const int w16 = ln ? be->layernorm_forward_w16 != NULL : be->rmsnorm_forward_w16 != NULL;
    if (!res || !res16 || !out || !out16 || !a || !b || !w)
        return fl_errorf(FL_ERR_INVALID, "%s add_norm_forward16: res, res16, out, out16, a, b and w are required (the "
                         "composed op keeps the fp32 views)", be->name);
    if (wt != FL_F32 && !w16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s add_norm_forward16: a %s norm weight needs the backend's w16 norm",
                         be->name, fl_dtype_name(wt));
    if (N < 0 || C <= 0) return fl_errorf(FL_ERR_INVALID, "%s add_norm_forward16: bad shape %d x %d", be->name, N, C);
    if (N == 0) return FL_OK;
    const size_t n = (size_t)N * C;
    if (be->add16)
        FL_TRY(be->add16(be, res, res16, a, b, n));
    else {
        be->add(be, res, a, b, n);
        FL_TRY(keep16_composed(be, res16, res, n));
    }
    if (w16) { /* the bf16 copy written by the norm */
        if (ln)
            be->layernorm_forward_w16(be, out, out16, mean, rstd, res, w, bias, wt, N, C, eps);
        else
            be->rmsnorm_forward_w16(be, out, out16, rstd, res, w, wt, N, C, eps);
        return FL_OK;
    }
    if (ln)
        be->layernorm_forward(be, out, mean, rstd, res, (const float *)w, (const float *)bias, N, C, eps);
    else
        be->rmsnorm_forward(be, out, rstd, res, (const float *)w, N, C, eps);
    return keep16_composed(be, out16, out, n);
}

const char *fl_op_name(fl_op op) {
    static const char *const names[FL_OP_COUNT] = {"gemm",       "convert",   "adamw_update", "sgd_update",
                                                    "adam8bit_update", "accumulate16", "sumsq", "q4_matmul",
                                                    "vocab_xent", "gemm_acc16"};
    return (unsigned)op < FL_OP_COUNT ? names[op] : "?";
}

fl_status fl_lora_check_args(const char *who, int N, int in, int out, int r, int ldy, float dropout) {
    if (N < 0 || in <= 0 || out <= 0 || r <= 0 || ldy < out)
        return fl_errorf(FL_ERR_INVALID, "%s: bad sizes N=%d in=%d out=%d r=%d ldy=%d", who, N, in, out, r, ldy);
    if (!(dropout >= 0.0f && dropout < 1.0f))
        return fl_errorf(FL_ERR_INVALID, "%s: dropout %g outside [0, 1)", who, (double)dropout);
    return FL_OK;
}

fl_status fl_attn_check_args(const char *op, const fl_attn_desc *a, int max_hd, const char *why_max, const void *out,
                             const void *lse, const float *q, const float *k, const float *v, const float *bias,
                             const float *dbias) {
    if (!a) return fl_errorf(FL_ERR_INVALID, "%s: NULL descriptor", op);
    if (a->B < 0 || a->Tq < 0 || a->Tk < 0 || a->NH <= 0 || a->NKV <= 0 || a->HD <= 0 || a->NH % a->NKV)
        return fl_errorf(FL_ERR_INVALID, "%s: bad shape B %d Tq %d Tk %d NH %d NKV %d HD %d (NH must be a multiple of NKV)",
                         op, a->B, a->Tq, a->Tk, a->NH, a->NKV, a->HD);
    if (a->HD > max_hd)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s: head dimension %d > %d (%s)", op, a->HD, max_hd, why_max);
    size_t wq = (size_t)a->NH * a->HD, wk = (size_t)a->NKV * a->HD;
    if (a->ldq < wq || a->ldo < wq || a->ldk < wk || a->ldv < wk)
        return fl_errorf(FL_ERR_INVALID, "%s: row strides ldq %zu ldo %zu (need >= %zu), ldk %zu ldv %zu (need >= %zu)",
                         op, a->ldq, a->ldo, wq, a->ldk, a->ldv, wk);
    if (!out || !lse || !q || !k || !v) return fl_errorf(FL_ERR_INVALID, "%s: NULL tensor", op);
    if (dbias && !bias) return fl_errorf(FL_ERR_INVALID, "%s: dbias given without bias", op);
    if (!isfinite(a->scale)) return fl_errorf(FL_ERR_INVALID, "%s: scale %g is not finite", op, (double)a->scale);
    if (!(a->drop_p >= 0.0f && a->drop_p < 1.0f))
        return fl_errorf(FL_ERR_INVALID, "%s: attention dropout %g outside [0, 1)", op, (double)a->drop_p);
    return FL_OK;
}

int fl_attn_is_qkv(const fl_attn_desc *a, const float *q, const float *k, const float *v, const float *bias,
                   const uint8_t *kmask, const float *dq, const float *dk, const float *dv, const float *dbias) {
    if (!a || bias || kmask || dbias || !q || a->HD <= 0 || a->NKV <= 0 || a->NH <= 0 || a->drop_p > 0) return 0;
    const fl_attn_desc f = fl_attn_desc_qkv(a->B, a->Tq, a->NH, a->NKV, a->HD);
    const size_t ko = (size_t)a->NH * a->HD, vo = (size_t)(a->NH + a->NKV) * a->HD;
    if (a->Tk != f.Tk || !a->causal || a->ldq != f.ldq || a->ldk != f.ldk || a->ldv != f.ldv || a->ldo != f.ldo ||
        a->scale != f.scale || k != q + ko || v != q + vo)
        return 0;
    return !dq || (dk == dq + ko && dv == dq + vo);
}

fl_status fl_attention_qkv_forward(const fl_backend *be, float *out, float *lse, const float *qkv, int B, int T, int NH,
                                   int NKV, int HD) {
    const fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    const size_t ko = (size_t)NH * (HD > 0 ? HD : 0), vo = (size_t)(NH + (NKV > 0 ? NKV : 0)) * (HD > 0 ? HD : 0);
    return be->attention_forward(be, &a, out, lse, qkv, qkv ? qkv + ko : NULL, qkv ? qkv + vo : NULL, NULL, NULL);
}

fl_status fl_attention_qkv_backward(const fl_backend *be, float *dqkv, const float *dout, const float *qkv,
                                    const float *out, const float *lse, int B, int T, int NH, int NKV, int HD) {
    const fl_attn_desc a = fl_attn_desc_qkv(B, T, NH, NKV, HD);
    const size_t ko = (size_t)NH * (HD > 0 ? HD : 0), vo = (size_t)(NH + (NKV > 0 ? NKV : 0)) * (HD > 0 ? HD : 0);
    return be->attention_backward(be, &a, dqkv, dqkv ? dqkv + ko : NULL, dqkv ? dqkv + vo : NULL, NULL, dout, qkv,
                                  qkv ? qkv + ko : NULL, qkv ? qkv + vo : NULL, NULL, NULL, out, lse);
}
