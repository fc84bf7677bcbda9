/* fitllm CUDA kernels: the host launchers of the attention kernels (kernels/attention.cu,
 * kernels/attention_bwd.cu), in the two-prefix pattern of cu_kernels.h: fl_cuk_NAME (nvcc build,
 * device pointers, asynchronous on `stream`) and fl_cuemu_NAME (the same source under the CPU
 * emulator, host pointers, synchronous). Semantics are those of the backend op of the same name
 * in fitllm/backend.h (fused causal self-attention over qkv rows, the KV-cache decode step, and
 * the general fl_attn_desc attention); backward launchers ACCUMULATE into their gradients.
 *
 * Returns 0, the CUDA error of a launch (emulator: 1 with fl_cu_emu_error() set), or
 * FL_CU_ATTN_UNSUPPORTED (HD > FL_CU_ATTN_MAX_HD) / FL_CU_ATTN_INVALID (bad shape, stride or
 * NULL; a grid dimension over 65535) checked on the host before anything runs: on an error
 * nothing is written. fp32 in and out; deterministic (the same bits every run) except the _fa2
 * backward's dq (atomic adds across key blocks). */
#ifndef FL_CU_KERNELS_ATTN_H
#define FL_CU_KERNELS_ATTN_H

#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fitllm/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_CU_ATTN_MAX_HD 256 /* as the CPU's FL_CPU_ATTN_MAX_HD */
#define FL_CU_ATTN_UNSUPPORTED (-1)
#define FL_CU_ATTN_INVALID (-2)

/* Bytes of device scratch the backward launchers take as `work` (the per-row D = dout . out of
 * B*NH*Tq query rows). Tq = T for the fused op. */
static inline size_t fl_cu_attention_work_bytes(int B, int NH, int Tq) {
    return (B > 0 && NH > 0 && Tq > 0) ? (size_t)B * (size_t)NH * (size_t)Tq * sizeof(float) : 0;
}
/* attention_backward_fa2_ex / _fa2_16's flags */
#define FL_CU_FA2_DET 1   /* dq's adds in key-block order (FITLLM_CUDA_DETERMINISTIC=1) */
#define FL_CU_FA2_BK128 2 /* 128-key blocks of 8 warps (FITLLM_CUDA_FA2_BK=128) */
#define FL_CU_FA2_BK64 4  /* 64-key blocks even for a padded head (FITLLM_CUDA_FA2_BK=64 set) */
/* The same for attention_backward_fa2_ex with FL_CU_FA2_DET: then the dq counters (one int per query
 * tile of at least 16 rows) after D's rows. */
static inline size_t fl_cu_attention_work_bytes_det(int B, int NH, int Tq) {
    return (B > 0 && NH > 0 && Tq > 0) ? (size_t)B * (size_t)NH * ((size_t)Tq + ((size_t)Tq + 15) / 16) * sizeof(float)
                                       : 0;
}

/* The tensor-core kernels (kernels/attention_tc.cu: bf16 operands, fp32 accumulation and softmax;
 * for runs whose compute dtype is bf16) take these shapes: HD 64 or 128, no bias. Anything else
 * is FL_CU_ATTN_UNSUPPORTED from their launchers: run the fp32 kernels. */
static inline int fl_cu_attention_tc_supported(const fl_attn_desc *a, const float *bias) {
    return a && (a->HD == 64 || a->HD == 128) && !bias && !(a->drop_p > 0); /* dropout: the fp32 kernels */
}

/* The FlashAttention-2-structured kernels (kernels/attn_fa2.cu) take more head sizes: 64, and any even size in
 * (64, 128], zero-padded to 128 in their tiles (BLIP-2 OPT-2.7b's 80, its ViT-g's 88, OpenLLaMA 3B's 100): the
 * tensor cores at up to 128 / HD the products instead of the fp32 kernels. At HD 64 and 128 also a bias (with its
 * gradient) and dropout on the weights (T5 / Flan-T5's attention, BLIP-2's Q-Former): their EX kernels. */
static inline int fl_cu_attention_fa2_supported(const fl_attn_desc *a, const float *bias) {
    if (!a || !(a->HD == 64 || (a->HD > 64 && a->HD <= 128 && a->HD % 2 == 0))) return 0;
    return (!bias && !(a->drop_p > 0)) || a->HD == 64 || a->HD == 128;
}

#define FL_CU_DECLARE_ATTN_KERNELS(P)                                                                          \
    /* causal self-attention, qkv rows [q (NH*HD) | k (NKV*HD) | v (NKV*HD)], scale 1/sqrt(HD) */              \
    int P##attention_forward(float *out /*(B,T,NH*HD)*/, float *lse /*(B,NH,T)*/, const float *qkv, int B,     \
                             int T, int NH, int NKV, int HD, void *stream);                                   \
    int P##attention_backward(float *dqkv, const float *dout, const float *qkv, const float *out,               \
                              const float *lse, int B, int T, int NH, int NKV, int HD, void *work,             \
                              void *stream);                                                                   \
    /* one query row against the KV cache (head g's rows at kcache + g*head_stride + t*HD); T >= 1 */          \
    int P##attention_decode(float *out /*(NH*HD)*/, const float *q /*(NH*HD)*/, const float *kcache,           \
                            const float *vcache, int T, int NH, int NKV, int HD, size_t head_stride,            \
                            void *stream);                                                                     \
    /* out16 (NULL or, the forwards): the output's bf16 copy (out's layout), out then its exact widening */  \
    int P##attention_forward_ex(const fl_attn_desc *a, float *out, void *out16, float *lse, const float *q,     \
                                const float *k, const float *v, const float *bias, const uint8_t *kmask,       \
                                void *stream);                                                                 \
    int P##attention_backward_ex(const fl_attn_desc *a, float *dq, float *dk, float *dv, float *dbias,          \
                                 const float *dout, const float *q, const float *k, const float *v,            \
                                 const float *bias, const uint8_t *kmask, const float *out, const float *lse,  \
                                 void *work, void *stream);                                                    \
    /* tensor cores (bf16): the attention ops without bias and dbias */            \
    int P##attention_forward_tc(const fl_attn_desc *a, float *out, void *out16, float *lse, const float *q,     \
                                const float *k, const float *v, const uint8_t *kmask, void *stream);           \
    int P##attention_backward_tc(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout,     \
                                 const float *q, const float *k, const float *v, const uint8_t *kmask,         \
                                 const float *out, const float *lse, void *work, void *stream);                \
    /* FlashAttention-2-structured tensor-core kernels (kernels/attn_fa2.cu; EXPERIMENTAL): the _tc     \
     * semantics and shapes; the backward's dq adds run in a varying order on a GPU (atomics) */          \
    int P##attention_forward_fa2(const fl_attn_desc *a, float *out, void *out16, float *lse, const float *q,    \
                                 const float *k, const float *v, const uint8_t *kmask, void *stream);          \
    int P##attention_backward_fa2(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout,    \
                                  const float *q, const float *k, const float *v, const uint8_t *kmask,        \
                                  const float *out, const float *lse, void *work, void *stream);               \
    /* _fa2 backward, flags: FL_CU_FA2_DET: dq's adds across key blocks in key-block order (a counter per      \
     * query tile; the same bits every run, at some speed), else atomics, as attention_backward_fa2;          \
     * FL_CU_FA2_BK128: blocks of 128 keys (8 warps: half the dq adds); FL_CU_FA2_BK64: 64 (4 warps); neither:  \
     * 64 at HD 64 / 128, 128 for a padded head (the 64-key one reads dO by element pairs: registers) where the   \
     * device has the shared memory (sm_80 / sm_90; else 64) */                                                 \
    int P##attention_backward_fa2_ex(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, \
                                     const float *q, const float *k, const float *v, const uint8_t *kmask,     \
                                     const float *out, const float *lse, void *work, int flags,                \
                                     void *stream);                                                          \
    /* _fa2 with a bias (NULL or, (NH, Tq, Tk) as attention_forward_ex's) and dbias (NULL or; added by atomics \
     * as dq, or with FL_CU_FA2_DET by a block walking the batch: one owner, the same bits every run); dropout   \
     * (a->drop_p) in every _fa2 launcher, the fp32 kernels' mask bits. A bias or dropout: HD 64 or 128       \
     * (fl_cu_attention_fa2_supported) */                                                                        \
    int P##attention_forward_fa2_b(const fl_attn_desc *a, float *out, void *out16, float *lse, const float *q,  \
                                   const float *k, const float *v, const float *bias, const uint8_t *kmask,    \
                                   void *stream);                                                              \
    int P##attention_backward_fa2_b(const fl_attn_desc *a, float *dq, float *dk, float *dv, float *dbias,       \
                                    const float *dout, const float *q, const float *k, const float *v,         \
                                    const float *bias, const uint8_t *kmask, const float *out, const float *lse, \
                                    void *work, int flags, void *stream);                                     \
    /* The three backwards above (the fp32 kernels without bias, _tc, _fa2_ex) reading q, k, v and out in bf16    \
     * (the same layouts and strides, in elements): a bf16 run's stored activations without their widening;    \
     * each element widened exactly, so the bits of the fp32 launcher over the widened copies (issue 30 item 1) */ \
    int P##attention_backward_ex16(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout,   \
                                   const void *q16, const void *k16, const void *v16, const uint8_t *kmask,     \
                                   const void *out16, const float *lse, void *work, void *stream);              \
    int P##attention_backward_tc16(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout,   \
                                   const void *q16, const void *k16, const void *v16, const uint8_t *kmask,     \
                                   const void *out16, const float *lse, void *work, void *stream);              \
    int P##attention_backward_fa2_16(const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, \
                                     const void *q16, const void *k16, const void *v16, const uint8_t *kmask,   \
                                     const void *out16, const float *lse, void *work, int flags,                \
                                     void *stream);                                                             \
    /* the forwards (no bias) reading q16, k16, v16 in bf16 (the layouts and strides of q, k, v, in elements): \
     * a bf16 run's stored q|k|v written by its GEMM in bf16 only; each element widened exactly, so the bits of \
     * the fp32 launcher over the widened copies (issue 30 item 1) */                                          \
    int P##attention_forward_ex16(const fl_attn_desc *a, float *out, void *out16, float *lse, const void *q16,  \
                                  const void *k16, const void *v16, const uint8_t *kmask, void *stream);       \
    int P##attention_forward_tc16(const fl_attn_desc *a, float *out, void *out16, float *lse, const void *q16,  \
                                  const void *k16, const void *v16, const uint8_t *kmask, void *stream);       \
    int P##attention_forward_fa2_16(const fl_attn_desc *a, float *out, void *out16, float *lse, const void *q16, \
                                    const void *k16, const void *v16, const uint8_t *kmask, void *stream);     \
    /* per head h < heads of rows r < rows: dst[r ldd + h dhs + c] (+= with acc: fp32 dst) the value of          \
     * src[r lds + h shs + c] for c < w and 0 for w <= c < wdst (dst F32 or BF16 (RNE), src F32, BF16 or F16):   \
     * a call's head size to cuDNN's padded one (wdst > w: zeros) and back (kernels/attn_cudnn.cu) */           \
    int P##attention_heads2d(void *dst, fl_dtype dt, size_t ldd, int dhs, const void *src, fl_dtype st,         \
                             size_t lds, int shs, int rows, int heads, int w, int wdst, int acc, void *stream);  \
    /* one warp: d (16x8) = a (16x16) b (16x8) + c through fl_cu_mma_bf16_16816 (row-major, bf16 a, b) */     \
    int P##mma_bf16_check(float *d, const uint16_t *a, const uint16_t *b, const float *c, void *stream);

FL_CU_DECLARE_ATTN_KERNELS(fl_cuk_)
FL_CU_DECLARE_ATTN_KERNELS(fl_cuemu_)

#ifdef __cplusplus
}
#endif
#endif
