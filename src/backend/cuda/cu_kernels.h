/* fitllm CUDA kernels: the host launchers of src/backend/cuda/kernels/ (*.cu).
 *
 * Each launcher exists twice: fl_cuk_NAME (nvcc build, device pointers, asynchronous on
 * `stream`) and fl_cuemu_NAME (the same source under the CPU emulator, host pointers,
 * synchronous). Semantics are those of the backend op of the same name in fitllm/backend.h
 * unless a comment says otherwise. Returns 0, or the CUDA error of the launch (emulator: 1 with
 * fl_cu_emu_error() set). `stream` is a cudaStream_t (NULL: the default stream). */
#ifndef FL_CU_KERNELS_H
#define FL_CU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Partial sums of sumsq, at most (their count is a function of n, so the result does not depend
 * on the device). 64 parts (the first version) streamed a 1.1B-parameter gradient at 80 GB/s on an
 * H100 (28 ms per step). */
#define FL_CU_SUMSQ_PARTS 1024
/* The step scalars' layout (backend.h's FL_SS_FOUND, FL_SS_LOSS) */
#define FL_CU_SS_FOUND 2
#define FL_CU_SS_LOSS 3
/* Segments one convert_many launch takes (backend.h's FL_CONVERT_MANY_MAX) */
#define FL_CU_CONVERT_MANY_MAX 16
/* Work bytes the column sums (the norm backwards' dw / db, bias_backward) and the split cross-entropy use at most
 * (their partial sums; the backend lends its op work area, FLB_WORK_BYTES >= this on both builds). The tile counts
 * are bounded by it, so the order of every sum is a function of the shape alone. */
#define FL_CU_NORM_WORK_BYTES ((size_t)1 << 20)
/* act_forward16's kinds (backend.h's FL_ACT16_*) */
#define FL_CU_ACT16_SWIGLU 0
#define FL_CU_ACT16_GELU 1
#define FL_CU_ACT16_RELU 2
#define FL_CU_ACT16_GEGLU 3 /* [gate | lin] rows as SwiGLU's: gelu_tanh(gate) * lin (T5 v1.1, Flan-T5) */
#define FL_CU_ACT16_ROUND_IN 0x100 /* backend.h's FL_ACT16_ROUND_IN: in16 = RNE(in), in its widening, first */

#define FL_CU_DECLARE_KERNELS(P)                                                                              \
    int P##rmsnorm_forward(float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps,  \
                           void *stream);                                                                      \
    /* add_rmsnorm_forward (F32): res = a + b, out = rmsnorm(res) * w; 128-bit accesses when C % 4 == 0 and   \
     * every pointer is 16-byte aligned */                                                                   \
    int P##add_rmsnorm_forward(float *res, float *out, float *rstd, const float *a, const float *b,             \
                               const float *w, int N, int C, float eps, void *stream);                         \
    /* work (the norm backwards, bias_backward, the cross-entropies): FL_CU_NORM_WORK_BYTES of device memory for \
     * the partial sums (the backend's op work area; NULL: -1 where the shape needs it) */                     \
    int P##rmsnorm_backward(float *dinp, float *dw, const float *dout, const float *inp, const float *w,        \
                            const float *rstd, int N, int C, void *work, void *stream);                        \
    /* the same two over a 16-bit weight (wt BF16/F16; -1 otherwise), widened exactly in the kernel; out16    \
     * (NULL or) the output's bf16 copy, out then its exact widening (round16's bits); dinp16 (NULL or) bf16  \
     * of dinp after the accumulation, dinp not rounded (the next LINEAR's dy operand); inp16 (NULL or) the   \
     * input's bf16 copy read instead of inp; wt F32 too with out16 / inp16 / dinp16 (bf16-mixed) */           \
    int P##rmsnorm_forward_w16(float *out, void *out16, float *rstd, const float *inp, const void *w,           \
                               fl_dtype wt, int N, int C, float eps, void *stream);                            \
    int P##rmsnorm_backward_w16(float *dinp, void *dinp16, float *dw, const float *dout, const float *inp,      \
                                const void *inp16, const void *w, fl_dtype wt, const float *rstd, int N, int C, \
                                void *work, void *stream);                                                     \
    int P##cross_entropy(float *loss, float *dlogits, const float *logits, const int32_t *targets, int N, int V, \
                         float grad_scale, int ignore_index, void *work, void *stream);                        \
    /* the same with the gradient written as bf16 only (dlogits16 (N, V), not overlapping logits); logits and \
     * dlogits16 rows ld >= V apart (columns V .. ld-1 neither read nor written) */                             \
    int P##cross_entropy_dbf16(float *loss, void *dlogits16, const float *logits, const int32_t *targets, int N, \
                               int V, int ld, float grad_scale, int ignore_index, void *work, void *stream);   \
    /* either of the two (dlogits or dlogits16, or neither) with grad_scale read from device memory when it runs  \
     * (a CUDA graph's per-step scalar) */                                                                      \
    int P##cross_entropy_dev(float *loss, float *dlogits, void *dlogits16, const float *logits,                 \
                             const int32_t *targets, int N, int V, int ld, const float *grad_scale,             \
                             int ignore_index, void *work, void *stream);                                       \
    int P##adamw_update(float *p, const float *g, float *m, float *v, size_t n, float lr, float beta1,          \
                        float beta2, float eps, float weight_decay, int step, float grad_scale, void *stream);  \
    /* dtypes as the backend's adamw_update; unsupported ones return -1 (checked on the host) */             \
    int P##adamw_update_ex(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v, fl_dtype ts,     \
                           size_t n, float lr, float beta1, float beta2, float eps, float weight_decay, int step, \
                           float grad_scale, void *stream);                                                    \
    /* the same in two halves (a CUDA graph's update, its per-step constants in device memory): adamw_consts     \
     * writes the constants adamw_update_ex would pass (out NULL: only their size), adamw_update_dev reads them    \
     * from consts (device memory) when it runs */                                                              \
    size_t P##adamw_consts(void *out, float lr, float beta1, float beta2, float eps, float weight_decay, int step, \
                           float grad_scale);                                                                   \
    int P##adamw_update_dev(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v, fl_dtype ts,    \
                            size_t n, const void *consts, void *stream);                                        \
    /* F32/BF16/F16, any pair; -1 for other dtypes */                                                          \
    int P##convert(void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n, void *stream);               \
    /* count <= FL_CU_CONVERT_MANY_MAX segments dst[k] (n[k], dt) = src[k] (n[k], st) in one launch */          \
    int P##convert_many(int count, void *const *dst, fl_dtype dt, const void *const *src, fl_dtype st,          \
                        const size_t *n, void *stream);                                                        \
    /* dst (dt BF16/F16) = round(x), then x = widen(dst): a stored slot and its equal fp32 view */             \
    int P##round16(void *dst, fl_dtype dt, float *x, size_t n, void *stream);                                  \
    /* bf16-stored outputs (backend.h's act_forward16 / add16 / rope_forward16; out16 bf16, -1: kind/shape refused) */ \
    int P##act_forward16(int kind, float *out, void *out16, float *in, const void *in16, int N, int F, void *stream); \
    int P##add16(float *out, void *out16, const float *a, const float *b, size_t n, void *stream);              \
    /* backend.h's add_norm_forward16 (ln: LayerNorm with mean / bias, else RMSNorm); -1: refused */           \
    int P##add_norm_forward16(int ln, float *res, void *res16, float *out, void *out16, float *mean,           \
                              float *rstd, const float *a, const float *b, const void *w, const void *bias,    \
                              fl_dtype wt, int N, int C, float eps, void *stream);                             \
    /* backend.h's add_norm_forward16_b16: the norm's (out16 != NULL), and the add alone (add16_b16) */          \
    int P##add_norm_forward16_b16(int ln, float *res, void *res16, float *out, void *out16, float *mean,       \
                                  float *rstd, const float *a, const void *b16, const void *w,                 \
                                  const void *bias, fl_dtype wt, int N, int C, float eps, void *stream);       \
    int P##add16_b16(float *out, void *out16, const float *a, const void *b16, size_t n, void *stream);       \
    /* rope_forward16 / rope_backward16: rows read from x, written to out (== x in place; NULL: x16 only) */ \
    int P##rope_forward16(float *out, void *x16, const float *x, int B, int T, int nh, int HD, int width,       \
                          const float *cos_t, const float *sin_t, int pos0, void *stream);                     \
    int P##act_backward16(int kind, float *din, void *din16, const float *dout, const float *in,               \
                          const void *in16, int N, int F, void *stream);                                       \
    int P##rope_backward16(float *dout, void *dx16, const float *dx, int B, int T, int nh, int HD, int width,   \
                           const float *cos_t, const float *sin_t, int pos0, void *stream);                    \
    int P##layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w,            \
                             const float *b, int N, int C, float eps, void *stream);                           \
    int P##layernorm_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp,            \
                              const float *w, const float *mean, const float *rstd, int N, int C, void *work,   \
                              void *stream);                                                                    \
    /* the same over 16-bit w and b and a 16-bit saved input, as rmsnorm_forward_w16 / rmsnorm_backward_w16 */  \
    int P##layernorm_forward_w16(float *out, void *out16, float *mean, float *rstd, const float *inp,          \
                                 const void *w, const void *b, fl_dtype wt, int N, int C, float eps,           \
                                 void *stream);                                                                \
    int P##layernorm_backward_w16(float *dinp, void *dinp16, float *dw, float *db, const float *dout,          \
                                  const float *inp, const void *inp16, const void *w, fl_dtype wt,             \
                                  const float *mean, const float *rstd, int N, int C, void *work, void *stream); \
    int P##swiglu_forward(float *out, const float *gu, int N, int F, void *stream);                             \
    int P##swiglu_backward(float *dgu, const float *dout, const float *gu, int N, int F, void *stream);          \
    int P##gelu_forward(float *out, const float *inp, size_t n, void *stream);                                  \
    int P##gelu_backward(float *dinp, const float *dout, const float *inp, size_t n, void *stream);             \
    int P##relu_forward(float *out, const float *inp, size_t n, void *stream);                                  \
    int P##relu_backward(float *dinp, const float *dout, const float *inp, size_t n, void *stream);             \
    int P##gelu_erf_forward(float *out, const float *inp, size_t n, void *stream);                              \
    int P##gelu_erf_backward(float *dinp, const float *dout, const float *inp, size_t n, void *stream);         \
    int P##geglu_forward(float *out, const float *gu, int N, int F, void *stream);                              \
    int P##geglu_backward(float *dgu, const float *dout, const float *gu, int N, int F, void *stream);           \
    /* rope_forward (backward = 0) or rope_backward (1), in place */                                       \
    int P##rope(float *x, int B, int T, int nh, int HD, size_t row_stride, const float *cos_t,                  \
                const float *sin_t, int pos0, int backward, void *stream);                                     \
    int P##sgd_update_ex(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf, fl_dtype ts, size_t n,   \
                         float lr, float momentum, float dampening, float weight_decay, int nesterov,          \
                         int first_step, float grad_scale, void *stream);                                      \
    /* found_inf: a device int, set to 1 (never cleared) */                                                   \
    int P##check_finite(const void *x, fl_dtype t, size_t n, float inv_scale, int *found_inf, void *stream);    \
    /* the same test, ss[FL_SS_FOUND] = 1 (device double; the step scalars' fp16 overflow flag); dinv (device, or  \
     * NULL: inv_scale) the scale read when the kernel runs (a CUDA graph's per-step slot) */                  \
    int P##check_finite_ss(const void *x, fl_dtype t, size_t n, float inv_scale, const float *dinv, double *ss, \
                           void *stream);                                                                       \
    int P##accumulate16(uint16_t *dst, fl_dtype t, const float *src, size_t n, void *stream);                   \
    /* *out (device double) = sum of squares; work: FL_CU_SUMSQ_PARTS doubles of device scratch */             \
    int P##sumsq_ex(double *out, double *work, const void *x, fl_dtype t, size_t n, void *stream);              \
    /* the step scalars (backend.h's grad_norm_dev, loss_sum_dev, adamw_update_ss / sgd_update_ss; ss device     \
     * doubles): clip_scale from *sq (sumsq_ex's result); loss_sum in index order (one adding thread); the updates read  \
     * their grad_scale from ss[1] (NaN: nothing changes); clip_scale's dscale as check_finite_ss's dinv */     \
    int P##clip_scale(double *ss, const double *sq, float max_norm, float scale, const float *dscale, int n_loss, \
                      void *stream);                                                                            \
    int P##loss_sum(double *acc, const float *loss, const int32_t *targets, int N, int ignore_index,            \
                    void *stream);                                                                             \
    int P##adamw_update_ss(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v, fl_dtype ts,     \
                           size_t n, float lr, float beta1, float beta2, float eps, float weight_decay, int step, \
                           const double *ss, void *stream);                                                    \
    /* adamw_update_ss with the other constants from adamw_consts' device copy (a CUDA graph's per-step slot) */ \
    int P##adamw_update_dss(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v, fl_dtype ts,    \
                            size_t n, const void *consts, const double *ss, void *stream);                     \
    int P##sgd_update_ss(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf, fl_dtype ts, size_t n,   \
                         float lr, float momentum, float dampening, float weight_decay, int nesterov,          \
                         int first_step, const double *ss, void *stream);                                      \
    /* sgd_update_ss with the other constants from sgd_consts' device copy (a CUDA graph's per-step slot; has_mom:  \
     * momentum != 0 and a buffer, as sgd_consts was told) */                                                   \
    size_t P##sgd_consts(void *out, float lr, float momentum, float dampening, float weight_decay, int nesterov,  \
                         int first_step, int has_buf);                                                          \
    int P##sgd_update_dss(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf, fl_dtype ts, size_t n,  \
                          const void *consts, int has_mom, const double *ss, void *stream);                    \
    int P##add(float *out, const float *a, const float *b, size_t n, void *stream);                             \
    int P##scale(float *x, size_t n, float s, void *stream);                                                    \
    /* elements [k0, k0 + n) of fl_model_init_random's stream (kind 0 zeros, 1 ones, 2 normal(0, sd)) from state s */ \
    int P##init_random(void *dst, fl_dtype dt, size_t k0, size_t n, int kind, double sd, uint64_t s, void *stream);  \
    int P##bias_forward(float *y, const float *b, int N, int OC, void *stream);                                 \
    /* bias_forward with a bias of type bt: F32 (bias_forward) or BF16 (widened exactly; another type: -1) */     \
    int P##bias_forward_t(float *y, const void *b, fl_dtype bt, int N, int OC, void *stream);                   \
    int P##bias_backward(float *db, const float *dy, int N, int OC, void *work, void *stream);                  \
    int P##bias_backward16(float *db, void *dy16, const float *dy, int N, int OC, void *work, void *stream);    \
    /* emulator self-test kernels (tests/test_cuda_emu.c): out[i] = in[i-1] of a block-wide shift through     \
     * shared memory (in[n-1] for i = 0), with or without the __syncthreads between the write and the read;    \
     * and every shuffle of cu_compat.h on lane ids (see kernels/selftest.cu) */                                \
    int P##selftest_shift(float *out, const float *in, int n, int with_barrier, void *stream);                  \
    int P##selftest_shuffles(int *out /*(block, 4)*/, int block, void *stream);                                \
    /* the shift through smem bytes of dynamic shared memory in a (1, gy) grid, its opt-in first or not (the      \
     * emulator's launch checks: cu_emu.h fl_cu_emu_launch_ok) */                                               \
    int P##selftest_smem(float *out, const float *in, int n, size_t smem, int optin, unsigned gy, void *stream); \
    /* cp.async's copies as the emulator holds them, out (128) from in (128); modes 1-3 emulator only */        \
    int P##selftest_cp(float *out, const float *in, int mode, void *stream);                                    \
    /* a barrier in divergent code (emulator only: reported as a deadlock; never run it on a GPU) */           \
    int P##selftest_divergent(int *out /*(32)*/, void *stream);

FL_CU_DECLARE_KERNELS(fl_cuk_)
FL_CU_DECLARE_KERNELS(fl_cuemu_)

#ifdef __cplusplus
}
#endif
#endif
