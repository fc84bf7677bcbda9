/* fitllm CUDA kernels of the training extras: embeddings, 8-bit AdamW, the 4-bit (NF4/FP4) matmuls and
 * dequantization, and the LoRA dropout pieces (src/backend/cuda/kernels/{embedding,adam8bit,q4,
 * lora}.cu). Same conventions as cu_kernels.h: each launcher exists as fl_cuk_NAME (nvcc,
 * device pointers, asynchronous on `stream`) and fl_cuemu_NAME (the emulator, host pointers,
 * synchronous); semantics are the backend op's of fitllm/backend.h unless a comment says
 * otherwise. Returns 0, the CUDA error of the launch (emulator: 1 with fl_cu_emu_error() set), or
 * -1 for arguments the kernel does not take (checked on the host before any launch).
 *
 * Structs passed by pointer (fl_adam8bit_state, fl_q4_weight) are HOST structs whose pointer
 * fields point to device memory; the launcher reads them on the host. */
#ifndef FL_CU_KERNELS_TRAIN_H
#define FL_CU_KERNELS_TRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "fitllm/adam8bit.h"
#include "fitllm/dtype.h"
#include "fitllm/quant4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* int32 scratch of embedding_backward for N = B*T tokens (device memory, no initialization). */
#define FL_CU_EMB_WORK_INTS(N) (3 * (size_t)(N))
/* relbias_backward's work: the diagonals' sums, NH (Tq + Tk - 1) floats; its bucket count's limit (one thread each) */
#define FL_CU_RELBIAS_WORK_FLOATS(NH, Tq, Tk) ((size_t)(NH) * ((size_t)(Tq) + (size_t)(Tk) - 1))
#define FL_CU_RELBIAS_MAX_BUCKETS 1024

#define FL_CU_DECLARE_KERNELS_MORE(P)                                                                          \
    int P##embedding_forward(float *out, const int32_t *ids, const float *wte, const float *wpe, int B, int T,  \
                             int C, void *stream);                                                              \
    /* the same over a 16-bit table (dt BF16 or F16; wpe NULL or of dt): exact widening + one fp32 add; out16    \
     * (NULL or) the rows' bf16 copy, out then its exact widening */                                          \
    int P##embedding_forward16(float *out, void *out16, const int32_t *ids, const void *wte, const void *wpe,    \
                               fl_dtype dt, int B, int T, int C, void *stream);                                 \
    /* dwte and/or dwpe may be NULL; work: FL_CU_EMB_WORK_INTS(B*T) ints (needed when dwte != NULL). Each    \
     * element is the CPU's fp32 sum in token order: the same bits as the CPU backend. */                    \
    int P##embedding_backward(float *dwte, float *dwpe, const float *dout, const int32_t *ids, int B, int T,     \
                              int C, int32_t *work, void *stream);                                              \
    /* backend.h's relbias_forward / relbias_backward (rb: Tq + Tk - 1 buckets, device memory); the backward's  \
     * work: FL_CU_RELBIAS_WORK_FLOATS(NH, Tq, Tk) floats. The contract's order: the CPU backend's bits. */     \
    int P##relbias_forward(float *bias, const float *tab, const int32_t *rb, int NH, int Tq, int Tk, int nb,     \
                           void *stream);                                                                       \
    int P##relbias_backward(float *dtab, const float *dbias, const int32_t *rb, int NH, int Tq, int Tk, int nb,  \
                            float *work, void *stream);                                                         \
    /* p, g in {F32, BF16}; the state's arrays are device memory (a fresh state is zeroed memory). The same   \
     * fp32 operation sequence as the CPU backend (no contraction): the same bits. */                         \
    int P##adam8bit_update(void *p, fl_dtype tp, const void *g, fl_dtype tg, const fl_adam8bit_state *st,       \
                           float lr, float beta1, float beta2, float eps, float weight_decay, int step,          \
                           float grad_scale, void *stream);                                                     \
    /* the same, grad_scale read from the step scalars' ss[1] when it runs (NaN: nothing changes) */           \
    int P##adam8bit_update_ss(void *p, fl_dtype tp, const void *g, fl_dtype tg, const fl_adam8bit_state *st,    \
                              float lr, float beta1, float beta2, float eps, float weight_decay, int step,       \
                              const double *ss, void *stream);                                                  \
    /* the same in two halves (a CUDA graph's update, issue 30 item 5): adam8bit_consts writes the step's        \
     * constants (the expressions above, grad_scale 1) to out (NULL: only the size), adam8bit_update_dss reads    \
     * them from consts (device memory) and grad_scale from ss[1] when it runs: the bits of adam8bit_update_ss */ \
    size_t P##adam8bit_consts(void *out, float lr, float beta1, float beta2, float eps, float weight_decay,      \
                              int step);                                                                         \
    int P##adam8bit_update_dss(void *p, fl_dtype tp, const void *g, fl_dtype tg, const fl_adam8bit_state *st,   \
                               const void *consts, const double *ss, void *stream);                             \
    /* y (N, w->rows; row stride ldy) = x (N, w->cols) @ deq(W)^T + beta * y, beta in {0, 1} */              \
    int P##q4_matmul_forward(float *y, int ldy, const float *x, const fl_q4_weight *w, int N, float beta,       \
                             void *stream);                                                                     \
    /* dx (N, w->cols) = dy (N, w->rows; row stride ldy) @ deq(W) + beta * dx, beta in {0, 1} */              \
    int P##q4_matmul_backward(float *dx, const float *dy, int ldy, const fl_q4_weight *w, int N, float beta,    \
                              void *stream);                                                                    \
    /* dst (nr, w->cols; row stride ldd, F32 or BF16) = deq(W)[r0 : r0+nr, :]: fl_q4_dequantize_tile's       \
     * values (F32: the same bits; BF16: those rounded to nearest even). A panel for dequantize + GEMM. */    \
    int P##q4_dequantize(void *dst, fl_dtype dt, int ldd, const fl_q4_weight *w, int r0, int nr, void *stream);  \
    /* The same matmuls on bf16 tensor cores (issue 30 item 7, EXPERIMENTAL: not yet timed on a GPU): x / dy and    \
     * the dequantized W rounded to bf16 (RNE) as they are loaded into shared memory, fp32 accumulation (mma    \
     * m16n8k16, cu_mma.h): not the fp32 kernels' values; the bound is bf16 operands' */                     \
    int P##q4_matmul_forward_tc(float *y, int ldy, const float *x, const fl_q4_weight *w, int N, float beta,    \
                                void *stream);                                                                  \
    int P##q4_matmul_backward_tc(float *dx, const float *dy, int ldy, const fl_q4_weight *w, int N, float beta, \
                                 void *stream);                                                                 \
    /* the tc kernels over a bf16 x / dy (backend.h q4_matmul_forward16 / _backward16, issue 30 items 1 and 7): \
     * x16 / dy16 loaded 8 bf16 (128 bits) at a time into the same shared tiles the fp32 kernels round theirs   \
     * into: the bits of the _tc kernels on widen(x16) / widen(dy16) */                                         \
    int P##q4_matmul_forward16_tc(float *y, int ldy, const void *x16, const fl_q4_weight *w, int N, float beta, \
                                  void *stream);                                                                \
    int P##q4_matmul_backward16_tc(float *dx, const void *dy16, int ldy, const fl_q4_weight *w, int N,          \
                                   float beta, void *stream);                                                   \
    /* LoRA dropout (fitllm/lora.h's mask of (seed, i), bit-identical): xd[i] = keep(i) ? x[i] / (1-p) : 0     \
     * for i < n (0 < p < 1); seed_dev (NULL or) device memory holding the seed, read when it runs instead    \
     * (a CUDA graph's per-step scalar) */                                                                     \
    int P##lora_dropout(float *xd, const float *x, size_t n, float p, uint64_t seed, const uint64_t *seed_dev,  \
                        void *stream);                                                                          \
    /* LoRA backward's masked input gradient: dx[i] += t[i] / (1-p) where keep(i), t = scaling * (g @ A)      \
     * (the GEMM's alpha applies the scaling, as the CPU backend's lora_backward). */                        \
    int P##lora_dropout_dx(float *dx, const float *t, size_t n, float p, uint64_t seed,                        \
                           const uint64_t *seed_dev, void *stream);                                             \
    /* the same update with t's product inside (no temporary): dx (N, in) += keep ? (scaling * g @ A) / (1-p),  \
     * g (N, r), A (r, in), the k sum in order, each operation rounded (lora.cu); 0 < p < 1, r >= 1 */          \
    int P##lora_dx_fused(float *dx, const float *g, const float *A, int N, int in, int r, float scaling,       \
                         float p, uint64_t seed, const uint64_t *seed_dev, void *stream);                        \
    /* backend.h's dropout_rows (0 <= p < 1; p 0 copies or adds): row r's mask indices r stride + j */          \
    int P##dropout_rows(float *y, const float *x, int rows, size_t w, size_t stride, float p, uint64_t seed,     \
                        int accumulate, void *stream);                                                          \
    /* backend.h's vocab_stats / vocab_xent (issue 35: the vocabulary-parallel cross-entropy; xent_vocab.cu) */  \
    int P##vocab_stats(double *stats, const float *logits, const int32_t *targets, int rows, int n, int lo,     \
                       void *stream);                                                                           \
    int P##vocab_xent(float *loss, float *dlogits, const float *logits, const double *all,                      \
                      const int32_t *targets, int rows, int n, int lo, int np, int me, int V, float grad_scale, \
                      int ignore_index, void *stream);                                                          \
    /* test hook: the 256-entry dynamic code tables the kernels use (signed then unsigned, 512 floats), to     \
     * compare with fl_adam8bit_code_signed / _unsigned */                                                    \
    int P##adam8bit_codes(float *out /*(512)*/, void *stream);

FL_CU_DECLARE_KERNELS_MORE(fl_cuk_)
FL_CU_DECLARE_KERNELS_MORE(fl_cuemu_)

#ifdef __cplusplus
}
#endif
#endif
