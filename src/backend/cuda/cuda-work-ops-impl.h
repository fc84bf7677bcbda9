/* fitllm CUDA backend object: the ops whose kernels take a device work buffer from the op
 * scratch's work area (included by cuda-backend-impl.h, which holds the table and the other ops):
 * attention (cu_kernels_attn.h) and the embedding / 8-bit Adam / 4-bit / LoRA-dropout kernels
 * (cu_kernels_train.h). */
#include "backend/cuda/cu_kernels_attn.h"
#include "backend/cuda/cu_kernels_train.h"
#include "backend/cuda/cudnn-impl.h"

/* the work area of the scratch (after the GEMM's workspace and panels), or NULL with the sticky
 * error set when `bytes` does not fit */
static void *flb_work(const fl_backend *be, size_t bytes, const char *op) {
    char *s = (char *)flb_scratch(be);
    if (!s) return NULL;
    if (bytes > FLB_WORK_BYTES) {
        char why[160];
        snprintf(why, sizeof why, "needs %zu bytes of work space, the backend's scratch has %zu", bytes,
                 (size_t)FLB_WORK_BYTES);
        flb_set_error(be, FL_ERR_UNSUPPORTED, op, why);
        return NULL;
    }
    return s + FLB_LT_WS_BYTES + FLB_PANEL_BYTES;
}

/* the fused attention ops return nothing: on an unsupported head size their outputs become NaN
 * (all-ones bytes) as the CPU backend's do, besides the sticky error */
static void flb_nan_fill(const fl_backend *be, float *p, size_t n) {
    if (p && n) flb_memset(p, 0xff, n * sizeof(float), STREAM);
}

static void flb_embedding_forward(const fl_backend *be, float *out, const int32_t *ids, const float *wte,
                                  const float *wpe, int B, int T, int C) {
    if (flb_in_check(be, ids, "embedding_forward")) return;
    FLB_RUN(be, FLB_K(embedding_forward)(out, ids, wte, wpe, B, T, C, STREAM), "embedding_forward");
}
static void flb_embedding_forward16(const fl_backend *be, float *out, void *out16, const int32_t *ids,
                                    const void *wte, const void *wpe, fl_dtype dt, int B, int T, int C) {
    if (flb_in_check(be, ids, "embedding_forward16")) return;
    FLB_RUN(be, FLB_K(embedding_forward16)(out, out16, ids, wte, wpe, dt, B, T, C, STREAM), "embedding_forward16");
}
static void flb_embedding_backward(const fl_backend *be, float *dwte, float *dwpe, const float *dout,
                                   const int32_t *ids, int B, int T, int C) {
    int32_t *work = NULL;
    if (flb_in_check(be, ids, "embedding_backward")) return;
    if (dwte) {
        work = (int32_t *)flb_work(be, FL_CU_EMB_WORK_INTS((size_t)B * T) * sizeof(int32_t), "embedding_backward");
        if (!work) return;
    }
    FLB_RUN(be, FLB_K(embedding_backward)(dwte, dwpe, dout, ids, B, T, C, work, STREAM), "embedding_backward");
}
/* T5's relative position bias (backend.h; kernels/embedding.cu): the backward's diagonal sums in the work area */
_Static_assert(FL_CU_RELBIAS_MAX_BUCKETS == FL_RELBIAS_MAX_BUCKETS, "relbias_backward: one bucket limit");
static void flb_relbias_forward(const fl_backend *be, float *bias, const float *tab, const int32_t *rb, int NH, int Tq,
                                int Tk, int nb) {
    if ((size_t)NH * Tq * Tk == 0 || FLB_NULL(be, "relbias_forward", bias, tab, rb)) return;
    FLB_RUN(be, FLB_K(relbias_forward)(bias, tab, rb, NH, Tq, Tk, nb, STREAM), "relbias_forward");
}
static fl_status flb_relbias_backward(const fl_backend *be, float *dtab, const float *dbias, const int32_t *rb, int NH,
                                      int Tq, int Tk, int nb) {
    if (NH < 0 || Tq < 0 || Tk < 0 || nb <= 0 || nb > FL_RELBIAS_MAX_BUCKETS)
        return fl_errorf(FL_ERR_INVALID, "%s relbias_backward: bad shape (NH %d, Tq %d, Tk %d, %d buckets: 1 .. %d)",
                         FLB_NAME, NH, Tq, Tk, nb, FL_RELBIAS_MAX_BUCKETS);
    if (NH == 0 || Tq == 0 || Tk == 0) return FL_OK;
    if (FLB_NULL(be, "relbias_backward", dtab, dbias, rb)) return flb_sticky(be);
    float *work = (float *)flb_work(be, FL_CU_RELBIAS_WORK_FLOATS(NH, Tq, Tk) * sizeof(float), "relbias_backward");
    if (!work) return flb_sticky(be);
    FLB_RUN_S(be, FLB_K(relbias_backward)(dtab, dbias, rb, NH, Tq, Tk, nb, work, STREAM), "relbias_backward");
    return FL_OK;
}
/* FITLLM_CUDA_ATTN (read at init: fl_cudnn_attn_parse, cudnn-impl.h): which kernels a bf16 run's
 * attention of a shape the tensor-core kernels take gets: cuDNN's fused SDPA graphs (HD 64, 80, ..., 128, no bias,
 * mask or dropout; "auto", the default, and "cudnn"; the plugin only, EXPERIMENTAL: cuda-cudnn-impl.h), the
 * FlashAttention-2-structured ones (kernels/attn_fa2.cu, HD 64 or an even HD in (64, 128]; at HD 64 / 128 also a
 * bias and dropout: T5's, the Q-Former's; "own", and "auto" where cuDNN is absent or refuses the shape;
 * experimental: not yet timed on a GPU), the earlier ones (kernels/attention_tc.cu, HD 64 / 128, no bias or
 * dropout; "legacy"), or none ("fp32": the fp32 kernels whatever the dtype). Other shapes and fp32 runs take the
 * fp32 kernels. */
enum { FLB_ATTN_OWN = 0, FLB_ATTN_LEGACY = 1 };
/* 0: the fp32 kernels; else the FLB_ATTN_* + 1 of the tensor-core kernels to run */
static int flb_attn_tc(const fl_backend *be, const fl_attn_desc *a, const float *bias) {
    const flb_impl *im = FLB_IMPL(be);
    if (im->compute != FL_BF16 || im->attn == FL_CUDNN_ATTN_FP32) return 0;
    if (im->attn == FL_CUDNN_ATTN_LEGACY) return fl_cu_attention_tc_supported(a, bias) ? FLB_ATTN_LEGACY + 1 : 0;
    /* own, auto, cudnn: the fa2 kernels (padded sizes too), after cuDNN where it loaded (flb_cudnn_forward /
     * _backward: any size up to 128, padded to a multiple of 8) */
    return fl_cu_attention_fa2_supported(a, bias) ? FLB_ATTN_OWN + 1 : 0;
}
static void flb_attention_decode(const fl_backend *be, float *out, const float *q, const float *kcache,
                                 const float *vcache, int T, int NH, int NKV, int HD, size_t head_stride) {
    int rc = FLB_K(attention_decode)(out, q, kcache, vcache, T, NH, NKV, HD, head_stride, STREAM);
    if (rc == FL_CU_ATTN_UNSUPPORTED) flb_nan_fill(be, out, (size_t)NH * HD);
    FLB_RUN(be, rc, "attention_decode");
}
/* the attention launchers' own codes: -1 unsupported (HD), -2 invalid arguments */
static fl_status flb_attn_status(const fl_backend *be, int rc, const char *op) {
    if (rc == 0) return FL_OK;
    if (rc == FL_CU_ATTN_UNSUPPORTED)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s %s: head dimension beyond %d", FLB_NAME, op, FL_CU_ATTN_MAX_HD);
    if (rc == FL_CU_ATTN_INVALID) return fl_errorf(FL_ERR_INVALID, "%s %s: bad shape, stride or NULL", FLB_NAME, op);
    flb_launch(be, rc, op);
    return flb_sticky(be);
}
#include "backend/cuda/cuda-cudnn-impl.h"

/* The fused-QKV causal shape (fl_attn_is_qkv) needs no kernel of its own here: the general
 * kernels take its descriptor (the fused launchers of cu_kernels_attn.h build the same one). */
/* in16: q, k, v bf16 (attention_forward_in16; no bias then), else fp32 */
static fl_status flb_attn_fwd(const fl_backend *be, const fl_attn_desc *a, float *out, void *out16, float *lse,
                              const void *qv, const void *kv, const void *vv, const float *bias, const uint8_t *kmask,
                              int in16) {
    FL_TRY(flb_sticky(be));
    const float *q = (const float *)qv, *k = (const float *)kv, *v = (const float *)vv; /* checks: the pointers */
    /* out NULL with out16: the bf16 copy only (an fp32 view nothing reads; issue 30 item 1) */
    float *oc = out ? out : (float *)out16;
    fl_status st = fl_attn_check_args("attention_forward", a, FL_CU_ATTN_MAX_HD, "the CUDA kernels' tiles", oc, lse,
                                      q, k, v, bias, NULL);
    if (st == FL_ERR_UNSUPPORTED && out && lse && fl_attn_is_qkv(a, q, k, v, bias, kmask, NULL, NULL, NULL, NULL)) {
        /* as the CPU: the fused shape's outputs NaN (all-ones bytes) on a refused head size */
        flb_nan_fill(be, out, (size_t)a->B * a->Tq * a->ldo);
        flb_nan_fill(be, lse, (size_t)a->B * a->NH * a->Tq);
    }
    FL_TRY(st);
    if (in16 && bias) return fl_errorf(FL_ERR_UNSUPPORTED, "%s attention_forward_in16: no bias", FLB_NAME);
    /* cuDNN first where it loaded (a bf16 compute, no bias, ...: flb_cudnn_forward says), whatever the head size */
    if (flb_cudnn_forward(be, a, out, out16, lse, qv, kv, vv, in16 ? FL_BF16 : FL_F32, bias, kmask, &st)) return st;
    const int tc = flb_attn_tc(be, a, bias);
    int rc;
    if (tc == FLB_ATTN_OWN + 1)
        rc = in16 ? FLB_K(attention_forward_fa2_16)(a, out, out16, lse, qv, kv, vv, kmask, STREAM)
                  : FLB_K(attention_forward_fa2_b)(a, out, out16, lse, q, k, v, bias, kmask, STREAM);
    else if (tc)
        rc = in16 ? FLB_K(attention_forward_tc16)(a, out, out16, lse, qv, kv, vv, kmask, STREAM)
                  : FLB_K(attention_forward_tc)(a, out, out16, lse, q, k, v, kmask, STREAM);
    else
        rc = in16 ? FLB_K(attention_forward_ex16)(a, out, out16, lse, qv, kv, vv, kmask, STREAM)
                  : FLB_K(attention_forward_ex)(a, out, out16, lse, q, k, v, bias, kmask, STREAM);
    return flb_attn_status(be, rc, "attention_forward");
}
static fl_status flb_attention_forward16(const fl_backend *be, const fl_attn_desc *a, float *out, void *out16,
                                         float *lse, const float *q, const float *k, const float *v, const float *bias,
                                         const uint8_t *kmask) {
    return flb_attn_fwd(be, a, out, out16, lse, q, k, v, bias, kmask, 0);
}
static fl_status flb_attention_forward_in16(const fl_backend *be, const fl_attn_desc *a, float *out, void *out16,
                                            float *lse, const void *q16, const void *k16, const void *v16,
                                            const uint8_t *kmask) {
    return flb_attn_fwd(be, a, out, out16, lse, q16, k16, v16, NULL, kmask, 1);
}
static fl_status flb_attention_forward(const fl_backend *be, const fl_attn_desc *a, float *out, float *lse,
                                       const float *q, const float *k, const float *v, const float *bias,
                                       const uint8_t *kmask) {
    return flb_attention_forward16(be, a, out, NULL, lse, q, k, v, bias, kmask);
}
/* in16: q, k, v and out are bf16 (attention_backward16; no bias then), else fp32. The argument checks look at
 * the pointers only (NULL or not), so they take either. */
static fl_status flb_attn_bwd(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                              float *dbias, const float *dout, const void *q, const void *k, const void *v,
                              const float *bias, const uint8_t *kmask, const void *out, const float *lse, int in16) {
    FL_TRY(flb_sticky(be));
    const float *qf = (const float *)q, *kf = (const float *)k, *vf = (const float *)v, *of = (const float *)out;
    fl_status st = fl_attn_check_args("attention_backward", a, FL_CU_ATTN_MAX_HD, "the CUDA kernels' tiles", of, lse,
                                      qf, kf, vf, bias, dbias);
    if (st == FL_ERR_UNSUPPORTED && dq && fl_attn_is_qkv(a, qf, kf, vf, bias, kmask, dq, dk, dv, dbias))
        flb_nan_fill(be, dq, (size_t)a->B * a->Tq * a->ldq); /* NaN, as forward */
    FL_TRY(st);
    if (!dq || !dk || !dv || !dout) return fl_errorf(FL_ERR_INVALID, "attention_backward: NULL gradient tensor");
    if (in16 && (bias || dbias)) return fl_errorf(FL_ERR_UNSUPPORTED, "%s attention_backward16: no bias", FLB_NAME);
    void *work = flb_work(be, FLB_IMPL(be)->det ? fl_cu_attention_work_bytes_det(a->B, a->NH, a->Tq)
                                                : fl_cu_attention_work_bytes(a->B, a->NH, a->Tq), "attention_backward");
    if (!work) return flb_sticky(be);
    const fl_dtype it = in16 ? FL_BF16 : FL_F32;
    if (flb_cudnn_backward(be, a, dq, dk, dv, dout, q, k, v, it, bias, kmask, out, lse, work, &st)) return st;
    const int tc = flb_attn_tc(be, a, bias); /* the fa2 kernels take a bias (and dbias) at HD 64 / 128 */
    const int fa_flags = (FLB_IMPL(be)->det ? FL_CU_FA2_DET : 0) | FLB_IMPL(be)->fa2_bk; /* the fa2 backward's flags */
    int rc;
    if (tc == FLB_ATTN_OWN + 1)
        rc = in16 ? FLB_K(attention_backward_fa2_16)(a, dq, dk, dv, dout, q, k, v, kmask, out, lse, work, fa_flags,
                                                     STREAM)
                  : FLB_K(attention_backward_fa2_b)(a, dq, dk, dv, dbias, dout, qf, kf, vf, bias, kmask, of, lse, work,
                                                    fa_flags, STREAM);
    else if (tc)
        rc = in16 ? FLB_K(attention_backward_tc16)(a, dq, dk, dv, dout, q, k, v, kmask, out, lse, work, STREAM)
                  : FLB_K(attention_backward_tc)(a, dq, dk, dv, dout, qf, kf, vf, kmask, of, lse, work, STREAM);
    else
        rc = in16 ? FLB_K(attention_backward_ex16)(a, dq, dk, dv, dout, q, k, v, kmask, out, lse, work, STREAM)
                  : FLB_K(attention_backward_ex)(a, dq, dk, dv, dbias, dout, qf, kf, vf, bias, kmask, of, lse, work,
                                                 STREAM);
    return flb_attn_status(be, rc, "attention_backward");
}
static fl_status flb_attention_backward(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk,
                                        float *dv, float *dbias, const float *dout, const float *q, const float *k,
                                        const float *v, const float *bias, const uint8_t *kmask, const float *out,
                                        const float *lse) {
    return flb_attn_bwd(be, a, dq, dk, dv, dbias, dout, q, k, v, bias, kmask, out, lse, 0);
}
static fl_status flb_attention_backward16(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk,
                                          float *dv, const float *dout, const void *q16, const void *k16,
                                          const void *v16, const uint8_t *kmask, const void *out16, const float *lse) {
    return flb_attn_bwd(be, a, dq, dk, dv, NULL, dout, q16, k16, v16, NULL, kmask, out16, lse, 1);
}
static fl_status flb_bias_backward16(const fl_backend *be, float *db, void *dy16, const float *dy, int N, int OC) {
    FL_TRY(flb_sticky(be));
    if (!db || !dy16 || !dy || N < 0 || OC < 0)
        return fl_errorf(FL_ERR_INVALID, "%s bias_backward16: %s NULL or a negative shape (N %d, OC %d)", FLB_NAME,
                         !db ? "db" : !dy16 ? "dy16" : !dy ? "dy" : "nothing", N, OC);
    FLB_RUN_S(be, FLB_K(bias_backward16)(db, dy16, dy, N, OC, FLB_NWORK(be, "bias_backward16"), STREAM),
              "bias_backward16");
    return FL_OK;
}
static fl_status flb_add_norm_forward16(const fl_backend *be, int ln, float *res, void *res16, float *out, void *out16,
                                        float *mean, float *rstd, const float *a, const float *b, const void *w,
                                        const void *bias, fl_dtype wt, int N, int C, float eps) {
    FL_TRY(flb_sticky(be));
    if (!res16 || !out16 || !a || !b || !w || N < 0 || C <= 0)
        return fl_errorf(FL_ERR_INVALID, "%s add_norm_forward16: %s NULL or a bad shape (N %d, C %d)", FLB_NAME,
                         !res16 ? "res16" : !out16 ? "out16" : !a ? "a" : !b ? "b" : !w ? "w" : "nothing", N, C);
    if (wt != FL_F32 && wt != FL_BF16 && wt != FL_F16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s add_norm_forward16: %s norm weight", FLB_NAME, fl_dtype_name(wt));
    FLB_RUN_S(be, FLB_K(add_norm_forward16)(ln, res, res16, out, out16, mean, rstd, a, b, w, bias, wt, N, C, eps, STREAM),
              "add_norm_forward16");
    return FL_OK;
}
static fl_status flb_add_norm_forward16_b16(const fl_backend *be, int ln, float *res, void *res16, float *out,
                                            void *out16, float *mean, float *rstd, const float *a, const void *b16,
                                            const void *w, const void *bias, fl_dtype wt, int N, int C, float eps) {
    FL_TRY(flb_sticky(be));
    if (!res16 || !b16 || (out16 && !w) || N < 0 || C <= 0)
        return fl_errorf(FL_ERR_INVALID, "%s add_norm_forward16_b16: %s NULL or a bad shape (N %d, C %d)", FLB_NAME,
                         !res16 ? "res16" : !b16 ? "b16" : out16 && !w ? "w" : "nothing", N, C);
    if (!a && (res16 != b16 || (out16 && ln))) /* a NULL: b16 is the sum already (gemm_res16) */
        return fl_errorf(FL_ERR_INVALID, "%s add_norm_forward16_b16: a NULL takes res16 == b16 (the stored sum) and "
                         "RMSNorm (ln %d, res16 %s b16)", FLB_NAME, ln, res16 == b16 ? "==" : "!=");
    if (out16 && wt != FL_F32 && wt != FL_BF16 && wt != FL_F16)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s add_norm_forward16_b16: %s norm weight", FLB_NAME, fl_dtype_name(wt));
    if (!a && !out16 && !res) return FL_OK; /* nothing to add, norm or widen */
    if (!out16) /* the add alone */
        FLB_RUN_S(be, FLB_K(add16_b16)(res, res16, a, b16, (size_t)N * C, STREAM), "add_norm_forward16_b16");
    else
        FLB_RUN_S(be, FLB_K(add_norm_forward16_b16)(ln, res, res16, out, out16, mean, rstd, a, b16, w, bias, wt, N, C,
                                                    eps, STREAM),
                  "add_norm_forward16_b16");
    return FL_OK;
}
static fl_status flb_adam8bit_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                     const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                     float weight_decay, int step, float grad_scale) {
    FL_TRY(flb_sticky(be));
    if (!fl_adam8bit_dtype_ok(tp) || !fl_adam8bit_dtype_ok(tg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s adam8bit_update: p %s, g %s not supported", FLB_NAME,
                         fl_dtype_name(tp), fl_dtype_name(tg));
    FLB_RUN_S(be, FLB_K(adam8bit_update)(p, tp, g, tg, st, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                                         STREAM), "adam8bit_update");
    return FL_OK;
}
/* FITLLM_CUDA_Q4=scratch (a bf16 run's default): W dequantized a panel of rows at a time into a bf16 scratch, each
 * panel one GEMM (fp32 accumulation); forward: y[:, panel] = x @ panel^T; backward: dx (+)= dy[:, panel] @ panel, the
 * panels accumulated in dx. An F32 `in` (q4_matmul_forward / _backward) is the F32 x bf16 GEMM's A, which flb_gemm
 * rounds to bf16 in its mixed-type panels: the weight's panel then lives in the work area. A BF16 `in`
 * (q4_matmul_forward16 / _backward16: the stored copy, the RNE those panels hold) is the GEMM's A as it is, one GEMM
 * over all its rows, and the weight's panel may take the mixed-type panels' area too (unused by a bf16 x bf16 GEMM):
 * FLB_PANEL_BYTES + FLB_WORK_BYTES, 48 MiB on a GPU, so each of TinyLlama's 4-bit linears (its stacked parts: gate|up
 * 11,264 x 2,048 at most, 44 MiB) is one GEMM after a dequantization a part (nw parts stacked, backend.h). Panels
 * from fl_cu_gemm_panel_rows (balanced, whole 128s or 8s) of the stacked rows: each panel's offsets into y, dy and dx
 * keep the GEMM's operands 16-byte aligned (the H200's profile of 2026-11-30 had
 * these GEMMs at 214 / 263 TFLOP/s against ~690 for the bf16 bases of LoRA: TinyLlama's down projection, 2,048 x
 * 5,632, split at 1,489 rows, put its second panel's y and dy at 4- and 2-byte alignment). Both inputs give the same
 * bits where the weight is one panel either way (on the emulator always: its GEMM's sums do not depend on the
 * shapes' split but for the backward's accumulation over panels). */
static fl_status flb_q4_scratch(const fl_backend *be, int bwd, float *out, int ldo, const void *in, fl_dtype it,
                                int ldi, const fl_q4_weight *w, int nw, int N, float beta, const char *op) {
    int R = 0; /* the stacked rows */
    for (int k = 0; k < nw; k++) R += w[k].rows;
    const size_t row_bytes = (size_t)w->cols * sizeof(uint16_t);
    const size_t area = it == FL_BF16 ? (size_t)FLB_PANEL_BYTES + FLB_WORK_BYTES : FLB_WORK_BYTES;
    const size_t fit = area / row_bytes;
    const int rows = fl_cu_gemm_panel_rows(R, fit < (size_t)R ? (int)fit : R);
    if (rows < 1)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s %s: FITLLM_CUDA_Q4=scratch: a row of %d columns exceeds the work area",
                         FLB_NAME, op, w->cols);
    uint16_t *panel;
    if (it == FL_BF16) { /* the mixed-type panels and the work area: contiguous in the scratch (flb_work) */
        char *s = (char *)flb_scratch(be);
        panel = s ? (uint16_t *)(s + FLB_LT_WS_BYTES) : NULL;
    } else {
        panel = (uint16_t *)flb_work(be, (size_t)rows * row_bytes, op);
    }
    if (!panel) return flb_sticky(be);
    const size_t es = it == FL_F32 ? sizeof(float) : sizeof(uint16_t);
    for (int r0 = 0; r0 < R && N > 0; r0 += rows) {
        const int nr = R - r0 < rows ? R - r0 : rows;
        const int K = bwd ? nr : w->cols, Nc = bwd ? w->cols : nr;
        const char *a = (const char *)in + (bwd ? (size_t)r0 * es : 0);
        float *o = bwd ? out : out + r0;
        const float b = bwd && r0 ? 1.0f : beta;
        /* the panel's stacked rows [r0, r0 + nr): each part's share, side by side */
        for (int k = 0, p0 = 0; k < nw; p0 += w[k].rows, k++) {
            const int lo = r0 > p0 ? r0 : p0, hi = r0 + nr < p0 + w[k].rows ? r0 + nr : p0 + w[k].rows;
            if (lo < hi)
                FLB_RUN_S(be, FLB_K(q4_dequantize)(panel + (size_t)(lo - r0) * w->cols, FL_BF16, w->cols, &w[k],
                                                   lo - p0, hi - lo, STREAM), op);
        }
        FL_TRY(flb_gemm(be, 0, !bwd, N, Nc, K, 1.0f, a, it, ldi, panel, FL_BF16, w->cols, b, o, FL_F32, ldo));
    }
    return FL_OK;
}
/* a bf16 run's 4-bit matmul path (FITLLM_CUDA_Q4, default scratch): FLB_Q4_FP32 for any other compute dtype (32-true,
 * 16-mixed, 16-true) whatever it says */
static int flb_q4_mode(const fl_backend *be) {
    return FLB_IMPL(be)->compute == FL_BF16 ? FLB_IMPL(be)->q4 : FLB_Q4_FP32;
}
static fl_status flb_adam8bit_update_ss(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                        const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                        float weight_decay, int step, const double *ss) {
    FL_TRY(flb_sticky(be));
    if (!fl_adam8bit_dtype_ok(tp) || !fl_adam8bit_dtype_ok(tg))
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s adam8bit_update_ss: p %s, g %s not supported", FLB_NAME,
                         fl_dtype_name(tp), fl_dtype_name(tg));
    FLB_RUN_S(be, FLB_K(adam8bit_update_ss)(p, tp, g, tg, st, lr, beta1, beta2, eps, weight_decay, step, ss, STREAM),
              "adam8bit_update_ss");
    return FL_OK;
}
static fl_status flb_q4_matmul_forward(const fl_backend *be, float *y, int ldy, const float *x, const fl_q4_weight *w,
                                       int N, float beta) {
    FL_TRY(flb_sticky(be));
    const int mode = flb_q4_mode(be);
    if (mode == FLB_Q4_SCRATCH && w && w->rows > 0 && w->cols > 0 && ldy >= w->rows && N >= 0 &&
        (beta == 0.0f || beta == 1.0f))
        return flb_q4_scratch(be, 0, y, ldy, x, FL_F32, w->cols, w, 1, N, beta, "q4_matmul_forward");
    if (mode == FLB_Q4_TC)
        FLB_RUN_S(be, FLB_K(q4_matmul_forward_tc)(y, ldy, x, w, N, beta, STREAM), "q4_matmul_forward");
    else
        FLB_RUN_S(be, FLB_K(q4_matmul_forward)(y, ldy, x, w, N, beta, STREAM), "q4_matmul_forward");
    return FL_OK;
}
static fl_status flb_q4_matmul_backward(const fl_backend *be, float *dx, const float *dy, int ldy,
                                        const fl_q4_weight *w, int N, float beta) {
    FL_TRY(flb_sticky(be));
    const int mode = flb_q4_mode(be);
    if (mode == FLB_Q4_SCRATCH && w && w->rows > 0 && w->cols > 0 && ldy >= w->rows && N >= 0 &&
        (beta == 0.0f || beta == 1.0f))
        return flb_q4_scratch(be, 1, dx, w->cols, dy, FL_F32, ldy, w, 1, N, beta, "q4_matmul_backward");
    if (mode == FLB_Q4_TC)
        FLB_RUN_S(be, FLB_K(q4_matmul_backward_tc)(dx, dy, ldy, w, N, beta, STREAM), "q4_matmul_backward");
    else
        FLB_RUN_S(be, FLB_K(q4_matmul_backward)(dx, dy, ldy, w, N, beta, STREAM), "q4_matmul_backward");
    return FL_OK;
}
/* backend.h q4_matmul_forward16 / _backward16 (FL_CAP_Q4X16): a bf16 run's tc or scratch path over the bf16 x / dy
 * (the same operand those paths round the fp32 one to); refused where the path computes in fp32 (FLB_Q4_FP32). nw
 * stacked parts: scratch dequantizes them side by side into its panels (one GEMM a panel over all of them: TinyLlama's
 * q|k|v 2,560 x 2,048 and gate|up 11,264 x 2,048 each one GEMM, where a GEMM a part took 3 and 2, the backward's
 * accumulating dx in turn); tc runs part after part. */
static fl_status flb_q4_16(const fl_backend *be, int bwd, float *out, int ldo, const void *in, int ldi, int ldy,
                           const fl_q4_weight *w, int nw, int N, float beta) {
    const char *op = bwd ? "q4_matmul_backward16" : "q4_matmul_forward16";
    FL_TRY(flb_sticky(be));
    const int mode = flb_q4_mode(be);
    if (mode != FLB_Q4_TC && mode != FLB_Q4_SCRATCH)
        return fl_errorf(FL_ERR_UNSUPPORTED, "%s %s: a bf16 run's FITLLM_CUDA_Q4=tc or scratch only (this one computes "
                         "its 4-bit matmuls in fp32)", FLB_NAME, op);
    long R = 0;
    int bad = !w || nw < 1 || nw > FL_Q4_MAX_PARTS;
    for (int k = 0; !bad && k < nw; k++) {
        bad = w[k].rows <= 0 || w[k].cols <= 0 || w[k].cols != w[0].cols;
        R += w[k].rows;
    }
    if (bad || ldy < R || N < 0 || (beta != 0.0f && beta != 1.0f) || (N > 0 && (!out || !in)))
        return fl_errorf(FL_ERR_INVALID, "%s %s: NULL argument or a bad shape (%d parts of rows %ld in all, N %d, ldy "
                         "%d, beta %g)", FLB_NAME, op, nw, R, N, ldy, (double)beta);
    if (mode == FLB_Q4_SCRATCH && FLB_IMPL(be)->q4_stack)
        return flb_q4_scratch(be, bwd, out, ldo, in, FL_BF16, ldi, w, nw, N, beta, op);
    for (int k = 0, p0 = 0; k < nw; p0 += w[k].rows, k++) { /* a part at a time (tc; FITLLM_CUDA_Q4_STACK=0) */
        const float b = bwd && k ? 1.0f : beta;
        const void *ik = bwd ? (const void *)((const uint16_t *)in + p0) : in; /* dy's columns of part k */
        if (mode == FLB_Q4_SCRATCH)
            FL_TRY(flb_q4_scratch(be, bwd, bwd ? out : out + p0, ldo, ik, FL_BF16, ldi, &w[k], 1, N, b, op));
        else if (bwd)
            FLB_RUN_S(be, FLB_K(q4_matmul_backward16_tc)(out, (const uint16_t *)in + p0, ldy, &w[k], N, b, STREAM), op);
        else FLB_RUN_S(be, FLB_K(q4_matmul_forward16_tc)(out + p0, ldy, in, &w[k], N, b, STREAM), op);
    }
    return FL_OK;
}
static fl_status flb_q4_matmul_forward16(const fl_backend *be, float *y, int ldy, const void *x16,
                                         const fl_q4_weight *w, int nw, int N, float beta) {
    return flb_q4_16(be, 0, y, ldy, x16, w ? w->cols : 0, ldy, w, nw, N, beta);
}
static fl_status flb_q4_matmul_backward16(const fl_backend *be, float *dx, const void *dy16, int ldy,
                                          const fl_q4_weight *w, int nw, int N, float beta) {
    return flb_q4_16(be, 1, dx, w ? w->cols : 0, dy16, ldy, ldy, w, nw, N, beta);
}
