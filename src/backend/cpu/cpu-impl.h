/* fitllm CPU backend: private declarations shared by the op files.
 *
 * Each op family lives in its own file (embedding.c, norm.c, rope.c,
 * attention.c, act.c, elementwise.c, xent.c, optim_kernels.c); backend_cpu.c wires
 * them into the vtable. The GEMM lives in gemm.c (OpenBLAS / oneDNN / naive).
 * Semantics of every op: see include/fitllm/backend.h.
 */
#ifndef FITLLM_CPU_IMPL_H
#define FITLLM_CPU_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fitllm/backend.h"

/* Small work runs on the calling thread. Idle workers sleep (fl_cpu_process_init), so a
 * parallel region pays a futex wake-up: 5 us per region with spinning workers vs 35-65 us with
 * sleeping ones on our 2 loaded vCPUs (an empty region in a loop), and on a busy machine the
 * region's end waits for a worker the scheduler has not run yet. Below ~50-100 us of serial
 * work a second thread does not pay for that. Elementwise ops: elements (64K floats: 15-80 us
 * for add .. swiglu). */
#define FL_CPU_PAR_MIN 65536
/* Attention forward/backward: B*NH*T*T*HD (about the multiply-adds of the forward). */
#define FL_CPU_ATTN_PAR_MIN ((int64_t)1 << 21)
/* GEMM: M*N*K multiply-adds (4M: ~100 us on one core; a 118x192x64 sgemm took 31 us on 1
 * thread and 45 us on 2). Smaller GEMMs run on one thread (backend_cpu.c). */
#define FL_CPU_GEMM_PAR_MIN ((int64_t)1 << 22)

/* Largest head dimension attention supports: its tiles are fixed-size stack
 * buffers sized for this (ops never allocate). Covers LLaMA (64/128) and
 * Gemma-style 256. Larger HD fills the outputs with NaN so misuse is loud;
 * model setup should reject such configs up front. */
#define FL_CPU_ATTN_MAX_HD 256
#define FL_CPU_ATTN_BK 32 /* keys per tile of the attention kernels (attention.c, attention_ex.c) */

/* C(M,N) = [C +] A(M,K) B(K,N) on the calling thread, A(i,k) = A[i*ai + k*ak], B rows and C rows
 * contiguous (strides ldb, ldc); acc = 0 starts from 0 (C not read). The attention kernels' tile
 * products (attn_mm.c: per-element order, variants). */
void fl_cpu_attn_mm(float *C, int ldc, const float *A, int ai, int ak, const float *B, int ldb, int M, int N, int K,
                    int acc);
/* The variant fl_cpu_attn_mm runs for N % 8 == 0 at the current level ("avx2-fma" or "portable"). */
const char *fl_cpu_attn_mm_path(void);

/* Upper bound on threads for ops that keep per-thread partial sums on the stack. */
#define FL_CPU_MAX_THREADS 256

/* Deterministic sums over a long vector (the gradient norm): the n elements are cut into
 * fl_cpu_sum_parts(n) contiguous ranges fixed by n alone (range c = [n*c/P, n*(c+1)/P)), each summed
 * in order by one thread, and the partial sums added in range order: the same bits for any thread
 * count, and up to 256 ranges keep many threads busy. */
#define FL_CPU_SUM_PARTS 256
static inline int fl_cpu_sum_parts(size_t n) {
    size_t p = (n + 4095) / 4096; /* ranges of at least 4096 elements */
    return p < 1 ? 1 : p > FL_CPU_SUM_PARTS ? FL_CPU_SUM_PARTS : (int)p;
}

/* ---- gemm (gemm.c) ------------------------------------------------------ */
fl_status fl_cpu_gemm(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                      const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, void *C,
                      fl_dtype tc, int ldc);
/* The backend's gemm: fl_cpu_gemm, on one thread below FL_CPU_GEMM_PAR_MIN multiply-adds. */
fl_status fl_cpu_gemm_sized(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                            void *C, fl_dtype tc, int ldc);
/* Plain triple loop, single-threaded: the reference the fast GEMM is tested against. */
fl_status fl_cpu_gemm_naive(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                            void *C, fl_dtype tc, int ldc);
/* fl_cpu_gemm_library: fitllm/backend.h */
/* The portable bf16 GEMM (B must be BF16; same semantics as fl_cpu_gemm's bf16 path). */
fl_status fl_cpu_gemm_bf16_tiled(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                                 const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb,
                                 float beta, void *C, fl_dtype tc, int ldc);
/* The bf16 GEMM that widens bf16 blocks to fp32 and calls the build's sgemm (B must be BF16;
 * same semantics as fl_cpu_gemm's bf16 path), whatever the CPU. */
fl_status fl_cpu_gemm_bf16_widen(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                                 const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb,
                                 float beta, void *C, fl_dtype tc, int ldc);
/* Which bf16 path fl_cpu_gemm takes: "onednn-matmul-bf16" (oneDNN build, avx512_bf16 usable),
 * "avx512-widen+sgemm" / "avx2-widen+sgemm" / "widen+sgemm" (library builds otherwise; the
 * prefix is the widening's SIMD level) or "tiled" (naive builds). FITLLM_BF16_GEMM=tiled|widen
 * forces the tiled kernel / the widening path. */
const char *fl_cpu_gemm_bf16_path(void);

/* The lent scratch (fl_backend.set_scratch): part 0, FL_CPU_WIDEN_SCRATCH floats for the 16-bit
 * GEMM widening; part 1, FL_CPU_Q4_SCRATCH floats for the 4-bit dequantization panels. NULL when
 * the calling thread lent none (the callers then use their process-wide fallback). */
#define FL_CPU_WIDEN_SCRATCH ((size_t)2 << 20) /* fp32 elements: 8 MiB */
#define FL_CPU_Q4_SCRATCH ((size_t)2 << 20)    /* fp32 elements: 8 MiB */
#define FL_CPU_SCRATCH_BYTES ((FL_CPU_WIDEN_SCRATCH + FL_CPU_Q4_SCRATCH) * sizeof(float))
void fl_cpu_set_scratch(const fl_backend *be, void *p, size_t bytes);

/* ---- memory.c: copies, sync, supports_op, RoPE tables ------------------------------------ */
fl_status fl_cpu_to_device(const fl_backend *be, void *dst, const void *src, size_t bytes);
fl_status fl_cpu_to_host(const fl_backend *be, void *dst, const void *src, size_t bytes);
fl_status fl_cpu_copy(const fl_backend *be, void *dst, const void *src, size_t bytes);
fl_status fl_cpu_sync(const fl_backend *be);
fl_status fl_cpu_pool_init(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget);
int fl_cpu_supports_op(const fl_backend *be, fl_op op, fl_dtype a, fl_dtype b, fl_dtype c);
fl_status fl_cpu_rope_tables(const fl_backend *be, float *cos_t, float *sin_t, int maxT, int HD, float theta,
                             const fl_rope_scaling *scaling);
float *fl_cpu_scratch_part(int part);
/* How fl_cpu_gemm does F32xF16 / F16xF16: "f16c-widen+sgemm" (F16C widening) or "widen+sgemm". */
const char *fl_cpu_gemm_f16_path(void);
/* Tests: use only the first n floats (at least 512) of the bf16/fp16 widening GEMM's scratch (0
 * or >= its size: all of it), so that small shapes exercise the K / N / M / C-tile blocking.
 * Process-wide. */
void fl_cpu_gemm_widen_set_scratch_cap(size_t n);
/* 1 if AVX512_BF16 (vdpbf16ps) is usable: the CPU has it and FITLLM_CPU allows avx512. */
int fl_cpu_has_avx512bf16(void);

/* ---- dispatch.c: fl_cpu_kernels (fitllm/backend.h) ---- */

/* ---- lowp.c / adam8bit.c (reduced precision; semantics in backend.h) ------------ */
fl_status fl_cpu_accumulate16(const fl_backend *be, uint16_t *dst, fl_dtype t, const float *src, size_t n);
double fl_cpu_sumsq(const fl_backend *be, const void *x, fl_dtype t, size_t n);
fl_status fl_cpu_convert(const fl_backend *be, void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n);
fl_status fl_cpu_adamw_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m,
                              void *v, fl_dtype ts, size_t n, float lr, float beta1, float beta2, float eps,
                              float weight_decay, int step, float grad_scale);
fl_status fl_cpu_sgd_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf,
                            fl_dtype ts, size_t n, float lr, float momentum, float dampening, float weight_decay,
                            int nesterov, int first_step, float grad_scale);
fl_status fl_cpu_check_finite(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                              int *found_inf);
fl_status fl_cpu_adam8bit_update(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                 const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                 float weight_decay, int step, float grad_scale);
/* The 8-bit quantizer variant fl_adam8bit_quantize_n runs for the two code tables: "avx2-table" (AVX2 and AVX-512
 * CPUs) or "scalar-table" (run-time dispatch, fitllm/cpu.h), "scalar" (the search) if the table was not built. */
const char *fl_cpu_adam8bit_quantizer_path(void);

/* ---- quant4.c / q4matmul.c / lora.c (LoRA and QLoRA; semantics in backend.h) ---------- */
fl_status fl_cpu_q4_matmul_forward(const fl_backend *be, float *y, int ldy, const float *x, const fl_q4_weight *w,
                                   int N, float beta);
fl_status fl_cpu_q4_matmul_backward(const fl_backend *be, float *dx, const float *dy, int ldy, const fl_q4_weight *w,
                                    int N, float beta);
fl_status fl_cpu_dropout_rows(const fl_backend *be, float *y, const float *x, int rows, size_t w, size_t stride, float p,
                              uint64_t seed, int accumulate);
fl_status fl_cpu_vocab_stats(const fl_backend *be, double *stats, const float *logits, const int32_t *targets, int rows,
                             int n, int lo);
fl_status fl_cpu_vocab_xent(const fl_backend *be, float *loss, float *dlogits, const float *logits, const double *all,
                            const int32_t *targets, int rows, int n, int lo, int P, int me, int V, float grad_scale,
                            int ignore_index);
fl_status fl_cpu_dropout(const fl_backend *be, float *y, const float *x, size_t n, float p, uint64_t seed,
                         int accumulate);
fl_status fl_cpu_lora_forward(const fl_backend *be, float *y, int ldy, float *h, float *xd, const float *x,
                              const float *A, const float *B, int N, int in, int out, int r, float scaling,
                              float dropout, uint64_t seed);
fl_status fl_cpu_lora_backward(const fl_backend *be, float *dx, float *dA, float *dB, const float *dy, int ldy,
                               const float *xb, const float *h, const float *A, const float *B, int N, int in,
                               int out, int r, float scaling, float dropout, uint64_t seed, float *work);

/* ---- embedding.c ---------------------------------------------------------- */
void fl_cpu_embedding_forward(const fl_backend *be, float *out, const int32_t *ids, const float *wte,
                              const float *wpe, int B, int T, int C);
void fl_cpu_embedding_backward(const fl_backend *be, float *dwte, float *dwpe, const float *dout,
                               const int32_t *ids, int B, int T, int C);
void fl_cpu_relbias_forward(const fl_backend *be, float *bias, const float *tab, const int32_t *rb, int NH, int Tq,
                            int Tk, int nb);
fl_status fl_cpu_relbias_backward(const fl_backend *be, float *dtab, const float *dbias, const int32_t *rb, int NH,
                                  int Tq, int Tk, int nb);

/* ---- norm.c --------------------------------------------------------------- */
void fl_cpu_rmsnorm_forward(const fl_backend *be, float *out, float *rstd, const float *inp, const float *w, int N,
                            int C, float eps);
void fl_cpu_rmsnorm_backward(const fl_backend *be, float *dinp, float *dw, const float *dout, const float *inp,
                             const float *w, const float *rstd, int N, int C);
void fl_cpu_layernorm_forward(const fl_backend *be, float *out, float *mean, float *rstd, const float *inp,
                              const float *w, const float *b, int N, int C, float eps);
void fl_cpu_layernorm_backward(const fl_backend *be, float *dinp, float *dw, float *db, const float *dout,
                               const float *inp, const float *w, const float *mean, const float *rstd, int N, int C);

/* ---- rope.c ----------------------------------------------------------------- */
void fl_cpu_rope_forward(const fl_backend *be, float *x, int B, int T, int nh, int HD, size_t row_stride,
                         const float *cos_t, const float *sin_t, int pos0);
void fl_cpu_rope_backward(const fl_backend *be, float *dx, int B, int T, int nh, int HD, size_t row_stride,
                          const float *cos_t, const float *sin_t, int pos0);

/* ---- attention.c (the kernels of the fused-QKV causal shape, fl_attn_is_qkv) ---------- */
/* HD beyond FL_CPU_ATTN_MAX_HD or NH % NKV != 0: the outputs become NaN (the slots refuse it first). */
void fl_cpu_attn_qkv_forward(const fl_backend *be, float *out, float *lse, const float *qkv, int B, int T, int NH,
                             int NKV, int HD);
/* dqkv += the gradient, with the schedule chosen: split 0 = fused (item (b, kv head)), 1 = split
 * (items (b, kv head, key tile) and (b, head, query tile)), -1 = by thread count. Same bits for
 * every choice (tests). */
void fl_cpu_attn_qkv_backward_sched(const fl_backend *be, float *dqkv, const float *dout, const float *qkv,
                                     const float *out, const float *lse, int B, int T, int NH, int NKV, int HD,
                                     int split);

/* 1 if the split backward schedule (more, smaller items; 1.55-1.8x the work) should beat the
 * fused one (n_fused items) on nt threads by at least 1.5x (attention.c, attention_general.c). */
int fl_cpu_attn_use_split(int n_fused, int nt);

/* ---- attention_general.c (the attention slots: mask, bias, cross, bidirectional; backend.h) ---- */
fl_status fl_cpu_attention_forward(const fl_backend *be, const fl_attn_desc *a, float *out, float *lse,
                                   const float *q, const float *k, const float *v, const float *bias,
                                   const uint8_t *kmask);
fl_status fl_cpu_attention_backward(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                    float *dbias, const float *dout, const float *q, const float *k, const float *v,
                                    const float *bias, const uint8_t *kmask, const float *out, const float *lse);
/* The general kernels, whatever the shape (the slots above send the fused-QKV shape to
 * attention.c instead; tests and bench/attention_bench.c compare the two). Backward with the
 * schedule chosen: split 0 = fused (items (b, kv head), or (kv head) with dbias), 1 = split
 * (kv-tile and query-tile items), -1 = by thread count. Same bits for every choice (tests). */
fl_status fl_cpu_attn_general_forward(const fl_backend *be, const fl_attn_desc *a, float *out, float *lse,
                                      const float *q, const float *k, const float *v, const float *bias,
                                      const uint8_t *kmask);
fl_status fl_cpu_attn_general_backward_sched(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk,
                                             float *dv, float *dbias, const float *dout, const float *q,
                                             const float *k, const float *v, const float *bias,
                                             const uint8_t *kmask, const float *out, const float *lse, int split);

/* ---- attention_kv.c (generation: one query against a KV cache) ---------------- */
void fl_cpu_attention_decode(const fl_backend *be, float *out, const float *q, const float *kcache,
                             const float *vcache, int T, int NH, int NKV, int HD, size_t head_stride);

/* ---- act.c -------------------------------------------------------------------- */
void fl_cpu_swiglu_forward(const fl_backend *be, float *out, const float *gu, int N, int F);
void fl_cpu_swiglu_backward(const fl_backend *be, float *dgu, const float *dout, const float *gu, int N, int F);
void fl_cpu_geglu_forward(const fl_backend *be, float *out, const float *gu, int N, int F);
void fl_cpu_geglu_backward(const fl_backend *be, float *dgu, const float *dout, const float *gu, int N, int F);
void fl_cpu_gelu_forward(const fl_backend *be, float *out, const float *inp, size_t n);
void fl_cpu_gelu_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n);
void fl_cpu_relu_forward(const fl_backend *be, float *out, const float *inp, size_t n);
void fl_cpu_relu_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n);
void fl_cpu_gelu_erf_forward(const fl_backend *be, float *out, const float *inp, size_t n);
void fl_cpu_gelu_erf_backward(const fl_backend *be, float *dinp, const float *dout, const float *inp, size_t n);

/* ---- elementwise.c -------------------------------------------------------------- */
void fl_cpu_add(const fl_backend *be, float *out, const float *a, const float *b, size_t n);
void fl_cpu_bias_forward(const fl_backend *be, float *y, const float *b, int N, int OC);
void fl_cpu_bias_backward(const fl_backend *be, float *db, const float *dy, int N, int OC);
double fl_cpu_sumsq_f32(const fl_backend *be, const float *x, size_t n);
void fl_cpu_scale(const fl_backend *be, float *x, size_t n, float s);
void fl_cpu_zero(const fl_backend *be, void *x, size_t bytes);

/* ---- xent.c ----------------------------------------------------------------------- */
void fl_cpu_cross_entropy(const fl_backend *be, float *loss, float *dlogits, const float *logits,
                          const int32_t *targets, int N, int V, float grad_scale, int ignore_index);

/* ---- optim_kernels.c ---------------------------------------------------------------------- */
/* The fp32 loops of adamw_update / sgd_update (all-F32 storage; lowp.c's slots call them). */
void fl_cpu_adamw_f32(const fl_backend *be, float *p, const float *g, float *m, float *v, size_t n, float lr,
                      float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale);
void fl_cpu_sgd_f32(const fl_backend *be, float *p, const float *g, float *buf, size_t n, float lr, float momentum,
                    float dampening, float weight_decay, int nesterov, int first_step, float grad_scale);

/* ---- shared math helpers ------------------------------------------------------------ */

/* Vectorizable expf. glibc's expf is a scalar call that gcc only vectorizes
 * (via libmvec) under -ffast-math, which we do not use; softmax, sigmoid and
 * tanh sit in hot loops, so we use a branch-free Cody-Waite reduction
 * x = n*ln2 + r, |r| <= ln2/2, and a degree-7 Taylor polynomial for e^r
 * (truncation error < 1e-8 relative). Measured max error against double exp
 * over a dense sweep of [-87, 88]: 1.2 ulp (1.02e-7 relative) with SSE2, 0.94
 * ulp with FMA contraction; test ops_expf_accuracy bounds it by 2 ulp.
 *
 * Semantics: the input is clamped to [-87, 88] so the exponent bits stay in the
 * normal range: exp(-87) ~ 1.6e-38 stands in for 0 (callers that need an exact
 * 0, masked scores, set it themselves) and exp(88) ~ 1.65e38 for overflow.
 * -inf gives ~1.6e-38 (no NaN), +inf gives ~1.65e38, NaN gives NaN.
 *
 * Written so that gcc 12 vectorizes loops calling it at -O3 under the default
 * -ftrapping-math, with SSE2 only as well as with AVX2 (tests/check_vectorized.sh
 * fails when a marked loop stops vectorizing):
 * - the clamp is a bit-mask select, not `x < lo ? lo : x`: PRE turns that
 *   ternary back into a branch (it folds the constant through the arithmetic
 *   that follows), and under -ftrapping-math the if-converter then refuses to
 *   speculate the float ops in it ("control flow in loop");
 * - the scale 2^n is built from the bits of t = x*log2e + 1.5*2^23, which hold
 *   n in their low mantissa bits, with integer ops only: no float->int
 *   conversion (which also was UB for NaN input: left shift of a negative int). */
static inline uint32_t fl_cpu_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline float fl_cpu_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float fl_cpu_expf(float x) {
    const float lo = -87.0f, hi = 88.0f;
    uint32_t below = -(uint32_t)(x < lo), above = -(uint32_t)(x > hi); /* all-ones masks; false for NaN */
    x = fl_cpu_f32_from_bits((fl_cpu_f32_bits(x) & ~(below | above)) | (fl_cpu_f32_bits(lo) & below) |
                             (fl_cpu_f32_bits(hi) & above));
    /* t = 1.5*2^23 + round(x / ln2): |x / ln2| < 2^22, so t lies in [2^23, 2^24)
     * where the float spacing is 1 and the add rounds x/ln2 to the nearest
     * integer n (no reassociation without fast-math). */
    const float shifter = 12582912.0f;
    float t = x * 1.44269504088896341f + shifter;
    float n = t - shifter;              /* exact */
    float r = x - n * 0.693359375f;    /* ln2 high part (exact in float) */
    r = r - n * -2.12194440e-4f;       /* ln2 low part */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* bits(t) = bits(1.5*2^23) + n, and bits(1.5*2^23) has zero low 9 bits, so
     * bits(t) << 23 == (n mod 2^9) << 23; adding 127 << 23 wraps (unsigned) to
     * the biased exponent n + 127, which is in [1, 254] after the clamp: 2^n
     * exactly. For NaN input, p is NaN and so is the product. */
    float s = fl_cpu_f32_from_bits((fl_cpu_f32_bits(t) << 23) + (127u << 23));
    return p * s;
}

/* keep ? v : +0.0f, as an integer mask on the bits. In a loop, write masking
 * this way (e.g. fl_cpu_keepf(fl_cpu_expf(s - m), j < jmax)), not with `?:`:
 * gcc's PRE turns a float `?:` into a branch and copies the float arithmetic
 * that follows into it, and under -ftrapping-math the if-converter will not
 * speculate that arithmetic back, so the loop stays scalar. */
static inline float fl_cpu_keepf(float v, int keep) {
    return fl_cpu_f32_from_bits(fl_cpu_f32_bits(v) & -(uint32_t)(keep != 0));
}

/* keep ? a : b on the bits (the same reason as fl_cpu_keepf: a float ?: in a loop stays scalar). */
static inline float fl_cpu_selectf(float a, float b, int keep) {
    uint32_t m = -(uint32_t)(keep != 0);
    return fl_cpu_f32_from_bits((fl_cpu_f32_bits(a) & m) | (fl_cpu_f32_bits(b) & ~m));
}

/* 1 / (1 + e^-x) */
static inline float fl_cpu_sigmoidf(float x) { return 1.0f / (1.0f + fl_cpu_expf(-x)); }

#endif
