/* fitllm: the backend vtable (ggml's ggml_backend_i, llm.c's kernels).
 *
 * A backend is one device's set of kernels. Model code calls only these ops,
 * so a CUDA backend later implements the same table and the model does not
 * change. The CPU backend (src/backend/cpu/) is the tested reference; every op
 * has a reference test (float64) and a finite-difference gradient check.
 *
 * Conventions for every op:
 *  - row-major, contiguous, float32, except gemm (F32, BF16 and F16 combinations) and the
 *    reduced-precision ops appended at the end of the table;
 *  - shapes in comments use B, T, C, NH, NKV, HD, V, F (ffn width), N (= B*T rows);
 *  - forward ops OVERWRITE their outputs;
 *  - backward ops ACCUMULATE (+=) into every gradient they produce, input
 *    gradients and parameter gradients alike (callers zero what they need), so a
 *    residual branch and gradient accumulation need no extra adds;
 *  - parameter-gradient outputs may be NULL (frozen parameter): not computed;
 *  - results are deterministic for a fixed thread count (no atomics, fixed
 *    reduction order);
 *  - ops never allocate; they may use small fixed-size stack tiles.
 */
#ifndef FITLLM_BACKEND_H
#define FITLLM_BACKEND_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fitllm/adam8bit.h"
#include "fitllm/cpu.h"
#include "fitllm/dtype.h"
#include "fitllm/mem.h"
#include "fitllm/quant4.h"
#include "fitllm/rope.h"
#include "fitllm/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_IGNORE_INDEX (-100)
/* Segments one fl_backend.convert_many call takes at most. */
#define FL_CONVERT_MANY_MAX 16
/* relbias_backward's largest bucket count (T5: 32) */
#define FL_RELBIAS_MAX_BUCKETS 1024

/* fl_backend.act_forward16's kinds */
enum { FL_ACT16_SWIGLU = 0, FL_ACT16_GELU = 1, FL_ACT16_RELU = 2, FL_ACT16_GEGLU = 3 };
/* act_forward16's kind | FL_ACT16_ROUND_IN: the fp32 input in is a stored slot not rounded yet: in16 = RNE(in) and in =
 * its widening first (round16's bits), then the activation of that (a biased LINEAR's output, issue 30 item 1) */
#define FL_ACT16_ROUND_IN 0x100
/* gemm_epilogue's epilogues */
enum { FL_GEMM_EPI_BIAS = 1, FL_GEMM_EPI_BIAS_GELU = 2 };
/* or'ed into either: the bias is bf16 (a bf16 model's stored bias, read as it is stored: no widening launch).
 * FL_GEMM_EPI_OUT_BF16, with FL_GEMM_EPI_BIAS, beta 0 and bf16 A and B only: C is bf16 (passed as float *), C =
 * RNE(the fp32 result), one rounding (a bf16 run's stored linear output); aux NULL or an fp32 (M, ldaux) buffer the
 * backend may use as scratch where it cannot fuse (then its contents are undefined). */
enum { FL_GEMM_EPI_BIAS_BF16 = 0x100, FL_GEMM_EPI_OUT_BF16 = 0x200 };

typedef struct fl_backend fl_backend;
struct fl_comm; /* fitllm/comm.h */
typedef struct fl_oprec fl_oprec; /* an op record: fitllm/backend_op.h */

/* Ops whose support depends on dtypes (fl_backend.supports_op: a, b, c as listed; every other
 * op is F32 and always implemented). */
typedef enum {
    FL_OP_GEMM = 0,     /* a = A's, b = B's, c = C's dtype */
    FL_OP_CONVERT,      /* a = destination, b = source */
    FL_OP_ADAMW,        /* a = parameters, b = gradients, c = the two state buffers */
    FL_OP_SGD,          /* a = parameters, b = gradients, c = the momentum buffer */
    FL_OP_ADAM8BIT,     /* a = parameters, b = gradients */
    FL_OP_ACCUMULATE16, /* a = the 16-bit destination */
    FL_OP_SUMSQ,        /* a = the input */
    FL_OP_Q4_MATMUL,    /* 4-bit weights (no dtype) */
    FL_OP_VOCAB_XENT,   /* vocab_stats and vocab_xent (the vocabulary-parallel cross-entropy on the device; F32) */
    /* gemm with a 16-bit C read (beta != 0; a, b, c as FL_OP_GEMM): D = C = round(fp32(alpha op(A) op(B)) + beta C)
     * with fp32 accumulation, the sum's fp32 value plus beta C in fp32, rounded to C's type once (accumulate16's bits
     * after a gemm into a zeroed fp32 buffer). cuda, cuda-emu (BF16); issue 30 item 1: a bf16 weight gradient written
     * by its GEMM in place */
    FL_OP_GEMM_ACC16,
    FL_OP_COUNT
} fl_op;
const char *fl_op_name(fl_op op);

/* Capability flags (fl_backend.caps, fl_backend_facts.caps): what code above the backend may
 * assume about a backend, asked instead of comparing its name. */
enum {
    FL_CAP_HOST_MEMORY = 1u << 0,   /* its buffers are host memory (cpu, ref, cuda-emu): one pool may serve tensors and
                                     * host staging (fl_backend_host_memory) */
    /* ops and copies do nothing: the null backend (the planner's, src/backend/null/): its pool hands out addresses
     * nobody may touch, so host code may skip producing tensor bytes that nothing will read (the random init's
     * values, a LoRA init's, a 4-bit quantization); it must still make every allocation it would make otherwise
     * (that is what the planner measures). fl_backend_discards */
    FL_CAP_DISCARDS = 1u << 1,
    FL_CAP_ASYNC = 1u << 2,         /* ops are queued on a stream in issue order; to_host and sync wait for them
                                     * (cuda, cuda-emu) */
    FL_CAP_DEVICE_MEMORY = 1u << 3, /* memory of its own, sized apart from the machine's RAM (cuda):
                                     * fl_backend_memory_capacity asks the device */
    FL_CAP_COMPUTE_BF16 = 1u << 4,  /* set_compute_dtype takes FL_BF16: bf16 matmul and attention kernels, so a bf16
                                     * run converts its fp32 activations (cuda, cuda-emu); else fp32 compute */
    FL_CAP_VIEWS16 = 1u << 5,       /* bf16 storage without the unread fp32 views (issue 30 item 1; cuda, cuda-emu): the
                                     * optional bf16 ops exec.c's stored paths take (rmsnorm / layernorm_forward_w16,
                                     * act_forward16 / act_backward16, attention_forward16 / _in16 / attention_backward16,
                                     * add16, rope_forward16, gemm_epilogue) are all there and the forward ones accept
                                     * out == NULL (the bf16 copy only; act_forward16 also in == NULL with in16), so a
                                     * stored slot's fp32 view nothing reads is neither written nor carved
                                     * (fl_block_views32) */
    FL_CAP_Q4X16 = 1u << 6,         /* a bf16 run's 4-bit matmuls read bf16 inputs (issue 30 items 1 and 7; cuda, cuda-emu
                                     * with FITLLM_CUDA_Q4=tc|scratch, FITLLM_CUDA_Q4X16 unset or 1): the optional
                                     * q4_matmul_forward16 / q4_matmul_backward16 are there, so a QLoRA base linear reads
                                     * its input's stored bf16 copy and its dy's bf16 copy (no fp32 view, no fp32 dy) */
    FL_CAP_STREAM16 = 1u << 7,      /* with FL_CAP_VIEWS16, a bf16 run's residual stream held in bf16 (issue 30 item 1;
                                     * cuda, cuda-emu; FITLLM_CUDA_STREAM16=0 off): the residual adds read the stored
                                     * bf16 rows (add_norm_forward16_b16), so the stream's fp32 rows buffers and the
                                     * mid residual's view share one WORKSPACE buffer (fl_block_stream16, acts.c) */
    FL_CAP_HEAD_GROUP = 1u << 8,    /* a trained bf16 LM head's dW over several loss chunks in one GEMM (cuda, cuda-emu;
                                     * FITLLM_CUDA_HEAD_GROUP=0 off): the chunks' bf16 dlogits fill the dy scratch side
                                     * by side and one dW GEMM reads them all (K = rows of the group instead of a chunk's
                                     * ~262: 41% of cuBLASLt's peak on the H200), no extra memory; transformer.c */
};

/* Shape of one attention call (the attention_forward / attention_backward ops).
 * Layout: q (B, Tq, NH, HD), k and v (B, Tk, NKV, HD), out (B, Tq, NH, HD) are row-major views
 * with explicit row strides: row (b, t) of q starts at q + (b*Tq + t)*ldq, and head h of it at
 * + h*HD (k, v, out likewise with ldk, ldv, ldo); the gradients dq, dk, dv, dout have the same
 * layout and strides as q, k, v, out. So the fused QKV buffer (B, T, (NH+2*NKV)*HD) is passed
 * without copies as q = qkv, k = qkv + NH*HD, v = qkv + (NH+NKV)*HD, ldq = ldk = ldv =
 * (NH+2*NKV)*HD, and a cross-attention's fused KV projection likewise. */
typedef struct {
    int B, Tq, Tk;             /* batch; query rows and key/value rows per batch element (>= 0) */
    int NH, NKV, HD;           /* query heads, key/value heads (NH % NKV == 0), head dimension */
    size_t ldq, ldk, ldv, ldo; /* row strides in floats: ldq, ldo >= NH*HD; ldk, ldv >= NKV*HD */
    float scale;               /* scores = scale * q.k + bias (1/sqrt(HD) usually; T5: 1) */
    int causal;                /* 1: query t sees keys j <= t + Tk - Tq (bottom-right aligned, as
                                * flash-attention 2.1+; the usual j <= t when Tq == Tk); 0: all keys */
    /* dropout on the attention weights (training; T5, issue 31): softmax(s)_j of query row t of head h, batch b is
     * multiplied by keep(drop_seed, ((b*NH + h)*Tq + t)*Tk + j) / (1 - drop_p) (fitllm/lora.h's mask) before it
     * weighs v_j; lse stays the undropped softmax's, the backward regenerates the mask. drop_p 0 (a zeroed
     * descriptor): none; in [0, 1), else FL_ERR_INVALID. cpu, ref, opaque, cuda (its fp32 kernels) */
    float drop_p;
    uint64_t drop_seed;
} fl_attn_desc;

struct fl_backend {
    const char *name;       /* "cpu" */
    fl_device device;
    int n_threads;
    const char *gemm_name;  /* which GEMM library: "openblas", "onednn", "naive" */
    unsigned gemm_widens16; /* bit (1u << FL_BF16) / (1u << FL_F16): gemm with a B of that 16-bit type
                             * widens B to fp32 in every call and runs an fp32 GEMM (no native 16-bit
                             * matmul), so a caller that reuses one such operand across calls may
                             * widen it once itself (the chunked lm_head: fl_act_opts.head_widen) */
    size_t scratch_bytes;   /* bytes of the op scratch the caller lends (set_scratch below; 0: none) */
    unsigned caps;   /* FL_CAP_* flags (above), the one place they live; fl_backend_facts_of answers them without
                      * making the backend */
    /* 1: with bf16 activations stored, a biased linear straight into the tanh GELU (GPT-2's c_fc) runs as
     * gemm_epilogue's bias + GELU, the GELU of the fp32 pre-activation, both then stored in bf16 (the backward's GELU
     * gradient reads the stored pre-activation as before); 0: the pre-activation is rounded to bf16 first and the
     * GELU reads that. cuda, cuda-emu: FITLLM_CUDA_GELU16 (issue 30 item 3); 0 elsewhere */
    int gelu16_epilogue;
    /* Several ranks (data-parallel training): a communicator whose collectives take this backend's
     * device memory, made over the host communicator `host` (same ranks; collective over it: every
     * rank calls it at the same point). NULL slot, or *out = NULL: the host communicator's own
     * collectives work on this backend's buffers (cpu, ref). cuda: NCCL (include/fitllm/comm_nccl.h);
     * cuda-emu: the NCCL code over its CPU stand-in. Destroy *out with fl_comm_destroy before host. */
    fl_status (*comm_create)(const fl_backend *be, struct fl_comm *host, struct fl_comm **out);
    /* The compute dtype of the run (its precision policy's), which some ops may follow instead of
     * their fp32 contract; NULL slot: none do (cpu, ref, opaque). cuda: with FL_BF16 the attention
     * ops (forward, backward, fused and general without bias) multiply bf16-rounded Q, K, V, P, dO
     * and dS on tensor cores with fp32 accumulation and softmax, as a bf16 PyTorch run's flash
     * attention (the environment's FITLLM_CUDA_ATTN=fp32 keeps the fp32 kernels). The model sets
     * it around each forward / backward / generation call and puts back FL_F32 after, so ops
     * called outside a model (tests, selftest) keep the fp32 contract. */
    void (*set_compute_dtype)(const fl_backend *be, fl_dtype t);
    /* The accelerator's name as its driver reports it ("NVIDIA H100 80GB HBM3"; cuda-emu: "CUDA emulator"),
     * which MFU's peak table is looked up by (fitllm/perf.h); NULL for the CPU backends (no MFU printed). */
    const char *device_name;
    /* Profiling markers (bench-step --profile, fitllm/perf.h): mark records marker i (0 <= i <
     * FL_PROF_MAX_MARKS) on the backend's queue after the ops queued so far (a CUDA event; the emulator, whose
     * launches are synchronous, reads the host clock); mark_ms gives the milliseconds from marker i to marker j
     * once both completed (it waits for j). NULL slots: the profiler syncs around each op and reads the host
     * clock (cpu, ref, opaque). */
    fl_status (*mark)(const fl_backend *be, int i);
    fl_status (*mark_ms)(const fl_backend *be, int i, int j, float *ms);
    /* Optional 16-bit storage ops (NULL slots: cpu, ref, opaque, null; the caller converts instead; cuda and
     * cuda-emu fill them so a bf16 step launches no per-row / narrow-then-widen conversions, issue 30 item 1).
     * embedding_forward16: embedding_forward (below) over a 16-bit table, wte and wpe (NULL or) of dt in
     * {BF16, F16}, each element widened exactly and the position row added in fp32 (the fallback's bits); out16
     * (NULL or (B T, C) bf16): the rows stored in bf16 too, out then their exact widening (round16's bits: a bf16
     * run's first residual row without the round16 launch).
     * round16: dst (dt BF16/F16) = round(x) and x = widen(dst) in one pass, a stored 16-bit activation whose
     * fp32 view must hold the stored value (graph.c's store16, acts.c's residual rows). */
    void (*embedding_forward16)(const fl_backend *be, float *out, void *out16, const int32_t *ids, const void *wte,
                                const void *wpe, fl_dtype dt, int B, int T, int C);
    fl_status (*round16)(const fl_backend *be, void *dst, fl_dtype dt, float *x, size_t n);
    /* Optional (NULL: one convert per segment): count <= FL_CONVERT_MANY_MAX conversions dst[k] (len[k], dt)
     * = src[k] (len[k], st), convert's bits, in one launch (a block's saved 16-bit activations widened before
     * its backward: acts.c). */
    fl_status (*convert_many)(const fl_backend *be, int count, void *const *dst, fl_dtype dt,
                              const void *const *src, fl_dtype st, const size_t *len);
    /* Optional (NULL: the caller widens w to fp32 first, one convert launch per norm and pass): rmsnorm_forward /
     * rmsnorm_backward (below) over a 16-bit weight, w of wt in {BF16, F16} (bf16/fp16 storage), each
     * element widened exactly in the kernel: the bits of widening first. out16 (NULL or (N,C) bf16): the output stored in bf16 too, out
     * then holding its exact widening (round16's bits: a bf16-stored slot without the round16 launch). dinp16
     * (NULL or (N,C) bf16): bf16(dinp) (RNE) after the accumulation, dinp NOT rounded: the residual gradient the
     * norm finishes is the next LINEAR's dy, whose bf16 operand it writes (its dyb16; exec.c). The backward's
     * inp16 (NULL or (N,C) bf16): the input read from its bf16 copy instead of inp (inp may be NULL), each element
     * widened exactly (the bits over inp = its widening; a bf16 run's stored input without the widen-before-backward),
     * and then wt may be F32 too (bf16-mixed's fp32 norm weight), as with out16 (forward) or dinp16 (backward). */
    void (*rmsnorm_forward_w16)(const fl_backend *be, float *out, void *out16, float *rstd, const float *inp,
                                const void *w, fl_dtype wt, int N, int C, float eps);
    void (*rmsnorm_backward_w16)(const fl_backend *be, float *dinp, void *dinp16, float *dw, const float *dout,
                                 const float *inp, const void *inp16, const void *w, fl_dtype wt, const float *rstd,
                                 int N, int C);
    /* Optional (NULL: the caller widens w and b first and converts around the fp32 ops): layernorm_forward /
     * layernorm_backward (below) as the two above, w and b (NULL or) of wt, out16 / dinp16 / inp16 as theirs
     * (GPT-2 and OPT under a 16-bit store or bf16 activations: no convert launch in the step, issue 30 item 1). */
    void (*layernorm_forward_w16)(const fl_backend *be, float *out, void *out16, float *mean, float *rstd,
                                  const float *inp, const void *w, const void *b, fl_dtype wt, int N, int C, float eps);
    void (*layernorm_backward_w16)(const fl_backend *be, float *dinp, void *dinp16, float *dw, float *db,
                                   const float *dout, const float *inp, const void *inp16, const void *w, fl_dtype wt,
                                   const float *mean, const float *rstd, int N, int C);
    /* Optional bf16-stored outputs (NULL: the fp32 op, then round16; issue 30 item 1). Each writes out16, the
     * output's bf16 copy (RNE), and leaves in the fp32 output its exact widening: the fp32 op's value rounded as
     * round16 rounds it, without the round16 launch. UNSUPPORTED for a kind or dtype they do not take.
     * act_forward16: kind FL_ACT16_SWIGLU (out (N,F) from [gate | up] rows (N,2F)), FL_ACT16_GEGLU (the same rows:
     * geglu_forward's gelu_tanh(gate) * lin, T5 v1.1 / Flan-T5), FL_ACT16_GELU (tanh),
     * FL_ACT16_RELU (out and in (N,F)); in16 (NULL or the input's bf16 copy, of in's shape): the input is read
     * from it and its exact widening written to in (an input a GEMM stored in bf16 only, graph.c).
     * add16: out = a + b (out may alias a or b), n elements.
     * rope_forward16: rope_forward over nh heads at the start of contiguous rows of `width` floats (the fused
     * q|k|v rows: q and k heads are consecutive), then every element of the rows stored as above (x16 (B T,
     * width)); the rows read from x and written to out (in place: out == x; NULL: x16 alone, the same bits: a
     * rotated q|k|v no op reads in fp32, FL_CAP_VIEWS16). */
    fl_status (*act_forward16)(const fl_backend *be, int kind, float *out, void *out16, float *in, const void *in16,
                               int N, int F);
    fl_status (*add16)(const fl_backend *be, float *out, void *out16, const float *a, const float *b, size_t n);
    fl_status (*rope_forward16)(const fl_backend *be, float *out, void *x16, const float *x, int B, int T, int nh,
                                int HD, int width, const float *cos_t, const float *sin_t, int pos0);
    /* Optional backward halves (NULL: the fp32 op, then the LINEAR below rounds its dy with a convert): the fp32
     * op's gradient, and a bf16 copy of it (RNE) in d16, the gradient itself NOT rounded: the dy16 operand of
     * the LINEAR that made the op's input (graph.c hands it that LINEAR's dyb16 scratch).
     * act_backward16: swiglu_backward / gelu_backward / relu_backward by kind (din += ..., shapes as
     * act_forward16), then din16 = bf16(din). rope_backward16: rope_backward over rows as rope_forward16's
     * (read from dx, written to dout: in place dout == dx), then dx16 (B T, width) = bf16(the result), every
     * element of the rows. act_backward16's in16 (NULL or the input's bf16 copy, in's shape): the input read from
     * it instead of in (widened exactly: a bf16 run's stored activation without the widen-before-backward); din16
     * may then be NULL (no copy). FL_CAP_VIEWS16: din (act_backward16: the update of a zero din) and dout
     * (rope_backward16) may be NULL, the bf16 copy alone with the same bits (an fp32 gradient no op reads).
     * rope_backward16 with dx NULL too (a backend with attention_backward_b16, whose bf16 gradients are in dx16
     * already): the rows read from dx16, each element widened exactly, and the nh heads' rotated values rounded back
     * into dx16 in place, the columns past them untouched: the bits of the call over dx = dx16 widened. */
    fl_status (*act_backward16)(const fl_backend *be, int kind, float *din, void *din16, const float *dout,
                                const float *in, const void *in16, int N, int F);
    fl_status (*rope_backward16)(const fl_backend *be, float *dout, void *dx16, const float *dx, int B, int T, int nh,
                                 int HD, int width, const float *cos_t, const float *sin_t, int pos0);
    /* Optional (NULL: attention_forward (below), then the caller rounds; issue 30 item 1): attention_forward that also
     * writes out16, the output's bf16 copy (RNE) in out's layout (ldo), leaving in out its exact widening: a
     * bf16-stored attention output without the round16 launch (exec.c). */
    fl_status (*attention_forward16)(const fl_backend *be, const fl_attn_desc *a, float *out, void *out16, float *lse,
                                     const float *q, const float *k, const float *v, const float *bias,
                                     const uint8_t *kmask);
    /* Optional (NULL: the caller widens the stored activations and calls attention_backward; issue 30 item 1):
     * attention_backward without bias (and dbias) reading q16, k16, v16 and out16, bf16 with the layouts and
     * strides of q, k, v, out in a (elements): each element widened exactly, so the bits of attention_backward over
     * the widened copies (a bf16 run's stored q|k|v and attention output, no widen-before-backward). */
    fl_status (*attention_backward16)(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                      const float *dout, const void *q16, const void *k16, const void *v16,
                                      const uint8_t *kmask, const void *out16, const float *lse);
    /* Optional (NULL: the caller stores q|k|v in fp32 too and calls attention_forward16; issue 30 item 1):
     * attention_forward16 without bias reading q16, k16, v16, bf16 with the layouts and strides of q, k, v in a
     * (elements), each element widened exactly: the bits of attention_forward16 over the widened copies (a bf16
     * run's q|k|v slot written by its GEMM in bf16 only, no fp32 view and no round16). */
    fl_status (*attention_forward_in16)(const fl_backend *be, const fl_attn_desc *a, float *out, void *out16,
                                        float *lse, const void *q16, const void *k16, const void *v16,
                                        const uint8_t *kmask);
    /* Optional, with attention_b16_ok (NULL: attention_backward16 over an fp32 dO; issue 30 item 1, cuda with cuDNN):
     * attention_backward16 (no bias, no key mask) whose dO is bf16, dout16 in out16's layout (ldo), and whose
     * gradients, when dq16 is not NULL, are bf16 too: dq16, dk16, dv16 in q16, k16, v16's layouts and strides,
     * written (not added; cuDNN's 16-bit results as its graphs write them), dq, dk, dv neither read nor written (may
     * be NULL); dq16 NULL: the gradients added into the fp32 dq, dk, dv as attention_backward16 does. A decoder's
     * attention without an fp32 dO (its output projection's dx GEMM writes it in bf16), without the zeroed fp32
     * d(q|k|v) and the conversions around cuDNN's 16-bit graphs (exec.c). Only for a call attention_b16_ok takes:
     * FL_ERR_UNSUPPORTED, nothing written, otherwise. */
    fl_status (*attention_backward_b16)(const fl_backend *be, const fl_attn_desc *a, float *dq, float *dk, float *dv,
                                        void *dq16, void *dk16, void *dv16, const void *dout16, const void *q16,
                                        const void *k16, const void *v16, const void *out16, const float *lse);
    /* Whether attention_backward_b16 runs this call (cuDNN's bf16 graphs take the shape and the operands' layout:
     * FITLLM_CUDA_ATTN, FITLLM_CUDA_CUDNN_B16, FITLLM_CUDA_DETERMINISTIC and the compute dtype say): a host-side
     * question, no op issued; the same answer for the same descriptor and pointers for the backend's life. */
    int (*attention_b16_ok)(const fl_backend *be, const fl_attn_desc *a, const void *q16, const void *k16,
                            const void *v16, const void *out16);
    /* Optional (NULL: bias_backward, and the caller converts dy; issue 30 item 1): bias_backward (db += the column
     * sums of dy, its bits) that also writes dy16 (N, OC) = bf16(dy) (RNE) as it reads dy: a biased linear's bf16
     * dy for its dx and dW GEMMs without a convert launch (GPT-2's c_attn, whose dy the attention writes in fp32).
     * (cuda, cuda-emu) */
    fl_status (*bias_backward16)(const fl_backend *be, float *db /*(OC)*/, void *dy16 /*(N,OC) bf16*/,
                                 const float *dy /*(N,OC)*/, int N, int OC);
    /* Optional (NULL: add16 (or add + round16), then the norm; issue 30 item 4): the residual add fused with the next
     * norm under a bf16 store, one pass. res16 = RNE(a + b) and res (NULL or) its exact widening (add16's bits; res
     * may alias a or b); then the norm (ln: layernorm_forward_w16, mean and bias; else rmsnorm_forward_w16) of the
     * STORED sum widen(res16), w (and bias, NULL or) of wt (F32, BF16, F16), out16 = RNE of the norm and out (NULL
     * or) its exact widening, rstd (and mean) as the norm's: the bits of the two ops. (cuda, cuda-emu: one kernel;
     * cpu, ref, opaque: fl_backend_add_norm16_composed, which needs res and out, and wt F32 where the backend has
     * no w16 norm) */
    fl_status (*add_norm_forward16)(const fl_backend *be, int ln, float *res /*(N,C)*/, void *res16 /*(N,C) bf16*/,
                                    float *out /*(N,C)*/, void *out16 /*(N,C) bf16*/, float *mean /*(N)*/,
                                    float *rstd /*(N)*/, const float *a, const float *b, const void *w /*(C)*/,
                                    const void *bias /*(C)*/, fl_dtype wt, int N, int C, float eps);
    /* Optional (NULL: add16 / add_norm_forward16 over the residual's fp32 view; issue 30 item 1, FL_CAP_STREAM16):
     * add_norm_forward16 (out16 != NULL) or add16 alone (out16 NULL: out, mean, rstd, w, bias unused) with the
     * operand b read from b16, its bf16 copy (N, C), each element widened exactly: the bits of the fp32 op over the
     * view holding widen(b16) (a bf16 run's residual stream, whose fp32 rows then need not exist); res (NULL or) the
     * sum's exact widening, may alias a. a NULL (res16 == b16, RMSNorm): no add, b16 is the sum already (a GEMM wrote
     * it: gemm_res16), the norm of its stored rows (the bits of the fused op's norm over the same stored sum) and res
     * (NULL or) their widening. (cuda, cuda-emu; NULL on cpu, ref, opaque, null) */
    fl_status (*add_norm_forward16_b16)(const fl_backend *be, int ln, float *res, void *res16, float *out, void *out16,
                                        float *mean, float *rstd, const float *a, const void *b16, const void *w,
                                        const void *bias, fl_dtype wt, int N, int C, float eps);

    /* Optional (NULL: the cross_entropy op below, then a convert of its gradient): cross_entropy with the logits'
     * gradient
     * written ONLY as bf16, dlogits16 (N, V) = RNE of the fp32 value cross_entropy would write (not
     * overlapping logits); the loss as cross_entropy's. The LM head's bf16 GEMMs read it (fl_lm_head_loss:
     * issue 30 item 4), so no fp32 (N, V) gradient is written and read back. Rows of logits and dlogits16 are ld
     * >= V elements apart (the head's padded rows, fl_logits_ld: a vocabulary of 50,257 in rows of 50,264 keeps the
     * head's GEMM operands 16-byte aligned); columns V .. ld-1 are neither read nor written. dlogits16 NULL: the loss
     * alone (a forward-only pass's padded rows). (cuda, cuda-emu) */
    fl_status (*cross_entropy_dbf16)(const fl_backend *be, float *loss /*(N)*/, void *dlogits16 /*(N,ld) bf16*/,
                                     const float *logits /*(N,ld)*/, const int32_t *targets /*(N)*/, int N, int V,
                                     int ld, float grad_scale, int ignore_index);
    /* Optional, above gemm as the others (issue 33): elements [k0, k1) of a tensor's random-init stream
     * (fl_model_init_random: splitmix64 as a counter from state s, one Box-Muller pair per two elements; kind 0 zeros,
     * 1 ones, 2 normal(0, sd)) written to dst[0 .. k1-k0) in dtype dt on the device, the same values as the host's
     * stream. NULL: generated on the host and copied. (cuda, cuda-emu) */
    fl_status (*init_random)(const fl_backend *be, void *dst, fl_dtype dt, size_t k0, size_t k1, size_t numel,
                             int kind, double sd, uint64_t s);
    /* Optional (issue 31: T5's dropout in training): y[i] = keep(seed, i) ? x[i] * fl_lora_dropout_scale(p) : 0
     * (accumulate 0; y may be x: in place) or y[i] += that (accumulate 1), the mask of fitllm/lora.h's
     * fl_lora_dropout_keep, a function of (seed, i) only: the backward is the same call on the gradient (the mask
     * regenerated, nothing saved). p in [0, 1); p 0 copies (or adds) x. NULL: a model that drops refuses by name.
     * (cpu, ref, opaque, null, cuda, cuda-emu) */
    fl_status (*dropout)(const fl_backend *be, float *y, const float *x, size_t n, float p, uint64_t seed,
                         int accumulate);
    /* Optional (issue 35; cpu, ref, opaque, null, cuda, cuda-emu): dropout over `rows` rows of w contiguous values
     * whose masks are rows of a wider tensor: y[r w + j] = keep(seed, r stride + j) ? x[r w + j] * scale : 0 (or +=,
     * accumulate 1), stride >= w: one call for a rank's columns of every row (the row-parallel LoRA adapters' input,
     * T5's dropout on a tensor-parallel slot), the bits of one dropout call per row at seed + r stride K. */
    fl_status (*dropout_rows)(const fl_backend *be, float *y, const float *x, int rows, size_t w, size_t stride,
                              float p, uint64_t seed, int accumulate);
    /* Optional (issue 35; supports_op FL_OP_VOCAB_XENT; cpu, ref, opaque, null, cuda, cuda-emu): the
     * vocabulary-parallel cross-entropy on the device, in two halves around the group's all-gather of the row
     * statistics (src/model/tp_vocab.c). vocab_stats: for each of `rows` rows of a rank's logits slice (rows, n),
     * whose columns are the vocabulary ids [lo, lo + n): stats[3i] = its max m (a float), stats[3i + 1] = the sum
     * of exp(l - m) in double, stats[3i + 2] = the logit of targets[i] when lo <= targets[i] < lo + n, else 0
     * (targets device memory). vocab_xent: with all (P, rows, 3) the P ranks' statistics in rank order (rank k's
     * slice is [k V / P, (k + 1) V / P)), per row M = max_k m_k, S = sum_k s_k exp(m_k - M) in rank order,
     * lse = (float)M + (float)log(S), loss[i] = lse - (the target's owner's logit) (0 when no rank owns it);
     * dlogits (NULL, or (rows, n), may alias logits) = grad_scale exp(l - lse) (in double, rounded) minus
     * grad_scale at the target's column on its owner `me`; targets[i] == ignore_index: loss 0 and a zero row. */
    fl_status (*vocab_stats)(const fl_backend *be, double *stats /*(rows,3)*/, const float *logits /*(rows,n)*/,
                             const int32_t *targets /*(rows)*/, int rows, int n, int lo);
    fl_status (*vocab_xent)(const fl_backend *be, float *loss /*(rows)*/, float *dlogits /*(rows,n) or NULL*/,
                            const float *logits /*(rows,n)*/, const double *all /*(P,rows,3)*/,
                            const int32_t *targets /*(rows)*/, int rows, int n, int lo, int P, int me, int V,
                            float grad_scale, int ignore_index);

    /* Optional (issue 30 item 3): gemm (row-major, the gemm slot's types and semantics) with an F32 C and an epilogue
     * fused into the matmul where the backend can (cuBLASLt's), for a linear's bias and GPT-2's GELU:
     * FL_GEMM_EPI_BIAS: C = alpha op(A) op(B) + beta C, then C[i, j] += bias[j] (gemm then bias_forward);
     * FL_GEMM_EPI_BIAS_GELU (beta 0): aux[i, j] = alpha op(A) op(B) + bias[j] (row stride ldaux, the pre-activation
     * the backward reads) and C = gelu_tanh(aux) (gelu_forward's). bias (N) fp32, or bf16 with FL_GEMM_EPI_BIAS_BF16
     * or'ed into epi (each element widened exactly: the bits of its fp32 widening). cuda-emu: the bits of the three ops
     * (checked); cuda: cuBLASLt's epilogue (its GELU within fp32 rounding of gelu_forward's), the three ops where
     * cuBLASLt refuses it or FITLLM_CUDA_EPILOGUE=0. NULL: callers run the separate ops. (cuda, cuda-emu) */
    fl_status (*gemm_epilogue)(const fl_backend *be, int epi, const void *bias /*(N)*/, float *aux /*(M,ldaux)*/,
                               int ldaux, int trans_a, int trans_b, int M, int N, int K, float alpha, const void *A,
                               fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta, float *C, int ldc);

    /* Optional (issue 30 items 1 and 3): gemm (row-major; BF16 A and B, fp32 accumulation, no bias) whose bf16 output
     * d16 is apart from its bf16 C c16, both (M, N) with row stride ldc: d16 = RNE(fp32(alpha op(A) op(B)) + widen(c16))
     * (the fp32 sum plus C in fp32, rounded once: FL_OP_GEMM_ACC16's bits with beta 1 on a copy of C; add16's
     * RNE(y + widen(c16)) of the fp32 GEMM output y, alpha 1), c16 only read; d16 == c16 is the in-place form, other
     * overlaps are refused. A bf16 run's residual add inside its output projection (LLaMA's o and down): C the stored
     * residual, D the sum's stored rows (fl_block_resgemm). K >= 1. (cuda: cuBLASLt's separate C and D pointers;
     * cuda-emu: the stand-in; FITLLM_CUDA_RESGEMM=0 or another backend: NULL) */
    fl_status (*gemm_res16)(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                            const void *A, int lda, const void *B, int ldb, const void *c16, void *d16, int ldc);

    /* Optional (issue 30 item 3; bench-step --profile): the library's own rate for one shape of gemm (row-major, the
     * gemm slot's types; epi as gemm_epilogue's, 0 none), on operands of the backend's own: *best_ms the fastest of
     * the library's candidate algorithms, *chosen_ms the one gemm runs, ms per call over reps calls. Not a step op
     * (set-up / reporting code calls it directly). (cuda: cuBLASLt's heuristic candidates; cuda-emu: the stand-in) */
    fl_status (*gemm_bench)(const fl_backend *be, int epi, int trans_a, int trans_b, int M, int N, int K, fl_dtype ta,
                            fl_dtype tb, fl_dtype tc, int reps, double *best_ms, double *chosen_ms);

    /* Optional: the op scratch a model's self-attention needs BEYOND scratch_bytes under bf16 compute, for B
     * sequences of T, NH query and NKV key/value heads of size HD (causal, compact output rows); the model lends
     * scratch_bytes + this (set_scratch with the sum, from its WORKSPACE), so the planner counts it. cuda with
     * cuDNN's fused attention loaded: the bf16 copies of its operands and an allowance for cuDNN's workspace
     * (fl_cudnn_sdpa_scratch_bytes), which otherwise live in a buffer of the backend's own, outside the pools.
     * 0 for a shape it does not take; NULL: none (every other backend). A pure function: fl_backend_facts has it. */
    size_t (*attn_scratch_bytes)(int B, int T, int NH, int NKV, int HD);

    /* The one door (issue 29, fitllm/backend_op.h): run the op record `op` (its kind names the slot below whose
     * arguments the record holds). The model and the trainer issue their per-step ops through it (FL_RUN), so
     * they reach the backend by one entry; every backend of this tree installs fl_backend_run_slots, a switch
     * over the kinds calling its own slots (the same bits as calling them). */
    fl_status (*run)(const fl_backend *be, const fl_oprec *op);

    /* ==== device-resident step scalars (issue 30 item 5; optional: CUDA / cuda-emu, NULL elsewhere) ====
     * A step keeps its gradient norm, the update's gradient scale and the micro-batches' loss sums in device memory,
     * so nothing inside the step waits for the device; the step reads them once, at its end (fl_step_run). `ss`
     * is an array of doubles from step_scalars: ss[FL_SS_NORM], ss[FL_SS_SCALE], ss[FL_SS_FOUND], ss[FL_SS_LOSS + k]. */
    /* set-up: device memory for n doubles owned by the backend (the same for every call), NULL when n > FL_SS_MAX */
    double *(*step_scalars)(const fl_backend *be, int n);
    /* ss[FL_SS_NORM] = sqrt(sum of g^2) * scale (the sum as sumsq's, in double), ss[FL_SS_SCALE] = the update's
     * gradient scale: scale, times c = max_norm / (norm + 1e-6) when max_norm > 0 and c < 1 (in double, rounded to
     * float: fl_optim_step's host arithmetic); NaN when the norm is not finite, one of the n_loss loss sums
     * ss[FL_SS_LOSS + k] is not, or ss[FL_SS_FOUND] != 0 (fp16's overflow: check_finite_dev) (the update is then
     * skipped). */
    fl_status (*grad_norm_dev)(const fl_backend *be, const void *g, fl_dtype tg, size_t n, float max_norm, float scale,
                               int n_loss, double *ss);
    /* *acc += the sum of loss[i] over targets[i] != ignore_index (targets device memory), in index order, in double
     * (the host's sum, the same bits) */
    fl_status (*loss_sum_dev)(const fl_backend *be, const float *loss, const int32_t *targets, int N, int ignore_index,
                              double *acc);
    /* adamw_update / sgd_update with grad_scale read from ss[FL_SS_SCALE] when the kernel runs; a NaN there: no
     * element changes (p and the state stay) */
    fl_status (*adamw_update_ss)(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m,
                                 void *v, fl_dtype ts, size_t n, float lr, float beta1, float beta2, float eps,
                                 float weight_decay, int step, const double *ss);
    fl_status (*sgd_update_ss)(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf,
                               fl_dtype ts, size_t n, float lr, float momentum, float dampening, float weight_decay,
                               int nesterov, int first_step, const double *ss);
    /* fp16 loss scaling's overflow check on the device (issue 30 item 5): ss[FL_SS_FOUND] = 1 when some
     * x[i] * inv_scale is inf/NaN (check_finite's test), else unchanged; nothing reaches the host (the step reads
     * the flag with its other scalars at its end, and grad_norm_dev skips the update on it) */
    fl_status (*check_finite_dev)(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                                  double *ss);

    /* ==== the next micro-batch's inputs uploaded ahead on a second stream (issue 30 item 5; optional: CUDA /
     * cuda-emu with device memory, NULL elsewhere and with FITLLM_CUDA_PREFETCH=0) ====
     * set-up: FL_INPUT_SLOTS device slots of at least `bytes` each, owned by the backend at fixed addresses (a CUDA
     * graph captures the reads); returns slot 0, slot s at + s * *stride; NULL: refused (too large, no memory). A
     * later call with bytes <= the first's returns the same slots. */
    void *(*input_slots)(const fl_backend *be, size_t bytes, size_t *stride);
    /* copy n0 bytes of src0 to the slot's offset 0 and n1 bytes of src1 to its offset off1 on the backend's second
     * stream, after every op already queued on its stream (the slot's last readers), from page-locked memory: the
     * host does not wait (the caller's buffers are free on return) and the copy overlaps the ops queued next. */
    fl_status (*input_upload)(const fl_backend *be, int slot, const void *src0, size_t n0, const void *src1, size_t n1,
                              size_t off1);
    /* the ops queued after this one wait for the slot's last input_upload (an event on the second stream); an op
     * that reads the slot before it is a race (cuda-emu refuses it by name) */
    fl_status (*input_wait)(const fl_backend *be, int slot);
    /* the step scalars' 8-bit AdamW (issue 30 item 5): adam8bit_update with grad_scale read from ss[FL_SS_SCALE] when
     * the kernel runs (NaN: p and the state stay) */
    fl_status (*adam8bit_update_ss)(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                    const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                    float weight_decay, int step, const double *ss);
    /* ==== the 4-bit matmuls over bf16 inputs (issue 30 items 1 and 7; optional: cuda, cuda-emu under FL_CAP_Q4X16,
     * NULL elsewhere) ====
     * q4_matmul_forward / q4_matmul_backward (below) with x16 (N, in) / dy16 (N, out; row stride ldy) bf16: the bits of
     * the fp32 op in a bf16 run on the widened input, the bf16 paths (FITLLM_CUDA_Q4=tc: the tensor-core kernels;
     * scratch: the dequantized bf16 panel's GEMM) rounding x / dy to bf16 (RNE) before any product, so a stored copy
     * (the RNE of the fp32 value) is the same operand, read without an fp32 copy. Refused (UNSUPPORTED) where the op
     * would not round (an fp32 run, FITLLM_CUDA_Q4=fp32).
     * w: nw (1 .. FL_Q4_MAX_PARTS) consecutive weights of equal cols whose rows stack, W = [w[0]; w[1]; ...] (a fused
     * output's parts: q|k|v, gate|up), y's / dy's columns in that order: one product over the stacked rows (the
     * scratch path: the parts dequantized side by side into one panel, one GEMM, instead of a GEMM per part and, in
     * the backward, dx accumulated part after part). */
    fl_status (*q4_matmul_forward16)(const fl_backend *be, float *y, int ldy, const void *x16, const fl_q4_weight *w,
                                     int nw, int N, float beta);
    fl_status (*q4_matmul_backward16)(const fl_backend *be, float *dx, const void *dy16, int ldy,
                                      const fl_q4_weight *w, int nw, int N, float beta);

    /* ---- matmul ---------------------------------------------------------
     * C(M,N) = alpha * op(A)(M,K) @ op(B)(K,N) + beta * C, row-major, with
     * op(X) = X or X^T. lda/ldb/ldc are row strides of the stored matrices.
     * Types (ta, tb, tc): (F32, F32, F32), (BF16, BF16, F32), (F32, BF16, F32), (BF16, BF16, BF16),
     * (F32, F16, F32), (F16, F16, F32); anything else returns UNSUPPORTED. With a BF16 operand,
     * an F32 A is first rounded to bf16 (RNE), products of bf16 values are accumulated in fp32,
     * alpha and beta are applied in fp32 (beta * C with C widened from bf16 when tc is BF16) and
     * a BF16 C is rounded (RNE) once. The oneDNN build uses cached bf16 matmul primitives
     * (avx512_bf16 when the CPU has it); other builds/CPUs a portable tiled kernel with the same
     * semantics. With an F16 B, F16 operands are widened exactly to fp32 (an F32 A is NOT
     * rounded to f16) and the rest is an fp32 GEMM (the library sgemm over widened blocks). */
    fl_status (*gemm)(const fl_backend *be, int trans_a, int trans_b, int M, int N, int K, float alpha,
                      const void *A, fl_dtype ta, int lda, const void *B, fl_dtype tb, int ldb, float beta,
                      void *C, fl_dtype tc, int ldc);

    /* ---- embeddings -----------------------------------------------------
     * out[b,t,:] = wte[ids[b,t],:] (+ wpe[t,:] if wpe). ids outside [0,V) are
     * the caller's bug (validated at the data boundary). */
    void (*embedding_forward)(const fl_backend *be, float *out /*(B,T,C)*/, const int32_t *ids /*(B,T)*/,
                              const float *wte /*(V,C)*/, const float *wpe /*(maxT,C) or NULL*/, int B, int T,
                              int C);
    void (*embedding_backward)(const fl_backend *be, float *dwte /*(V,C) or NULL*/, float *dwpe /*(maxT,C) or NULL*/,
                               const float *dout /*(B,T,C)*/, const int32_t *ids /*(B,T)*/, int B, int T, int C);
    /* T5's relative position bias (an encoder-decoder's RELBIAS op: seq2seq.c). Query i and key j take bucket
     * rb[j - i + Tq - 1] (rb: Tq + Tk - 1 int32 in [0, nb), one per diagonal: T5's buckets depend on j - i only).
     * relbias_forward: bias[h][i][j] (NH, Tq, Tk) = tab[h nb + bucket(i, j)], copies.
     * relbias_backward: dtab[h nb + b] += A(h, b), A the fp32 sum from 0, in increasing r, of S(h, r) over the
     * diagonals r = j - i with rb[r + Tq - 1] == b, added to dtab once. S(h, r), the diagonal's sum: its elements
     * dbias[h][i][i + r] dealt to 32 partials by row, P_s the fp32 sum from 0 of those with i mod 32 == s in
     * increasing i, then combined as a warp's butterfly (for off = 16, 8, 4, 2, 1: P_s = P_s + P_(s + off), s < off;
     * S = P_0). One order on every backend (the same bits on cpu and cuda); O(NH Tq Tk) work with no atomics, where
     * a per-head embedding_backward over the Tq Tk elements ranked them in O((Tq Tk)^2) on the GPU. */
    void (*relbias_forward)(const fl_backend *be, float *bias /*(NH,Tq,Tk)*/, const float *tab /*(NH,nb)*/,
                            const int32_t *rb /*(Tq+Tk-1)*/, int NH, int Tq, int Tk, int nb);
    fl_status (*relbias_backward)(const fl_backend *be, float *dtab /*(NH,nb)*/, const float *dbias /*(NH,Tq,Tk)*/,
                                  const int32_t *rb /*(Tq+Tk-1)*/, int NH, int Tq, int Tk, int nb);

    /* ---- normalization --------------------------------------------------
     * RMSNorm: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps)  (LLaMA).
     * LayerNorm: out = (x - mean) * rstd * w + b                     (GPT-2). */
    void (*rmsnorm_forward)(const fl_backend *be, float *out /*(N,C)*/, float *rstd /*(N)*/, const float *inp /*(N,C)*/,
                            const float *w /*(C)*/, int N, int C, float eps);
    void (*rmsnorm_backward)(const fl_backend *be, float *dinp /*(N,C)*/, float *dw /*(C) or NULL*/,
                             const float *dout /*(N,C)*/, const float *inp /*(N,C)*/, const float *w /*(C)*/,
                             const float *rstd /*(N)*/, int N, int C);
    /* The residual add fused with the next RMSNorm (issue 30 item 4): res = a + b (res may be a or b), then
     * out = rmsnorm(res) * w with rstd as rmsnorm_forward's. t is the dtype of res, out, a and b (F32; other
     * dtypes UNSUPPORTED, for bf16 activations later); C is the row width (res and out contiguous). The CPU's
     * is add + rmsnorm_forward (the same bits as the two ops); CUDA's one pass with 128-bit loads. The
     * backward needs no fused op: the residual's gradient passes through the add and rmsnorm_backward
     * accumulates into it. */
    fl_status (*add_rmsnorm_forward)(const fl_backend *be, void *res /*(N,C)*/, void *out /*(N,C)*/, float *rstd /*(N)*/,
                                     const void *a /*(N,C)*/, const void *b /*(N,C)*/, const float *w /*(C)*/,
                                     fl_dtype t, int N, int C, float eps);
    void (*layernorm_forward)(const fl_backend *be, float *out /*(N,C)*/, float *mean /*(N)*/, float *rstd /*(N)*/,
                              const float *inp /*(N,C)*/, const float *w /*(C)*/, const float *b /*(C) or NULL*/,
                              int N, int C, float eps);
    void (*layernorm_backward)(const fl_backend *be, float *dinp /*(N,C)*/, float *dw /*(C) or NULL*/,
                               float *db /*(C) or NULL*/, const float *dout /*(N,C)*/, const float *inp /*(N,C)*/,
                               const float *w /*(C)*/, const float *mean /*(N)*/, const float *rstd /*(N)*/, int N,
                               int C);

    /* ---- rotary position embedding (HF rotate-half pairing j <-> j+HD/2) --
     * Applied IN PLACE to `nh` heads of each row of x, where row (b,t) starts at
     * x + (b*T + t)*row_stride and head h at + h*HD. cos/sin are (maxT, HD/2)
     * tables from fl_rope_table_init; position of token t is pos0 + t.
     * backward rotates the gradient by the opposite angle, in place (it is the
     * transpose of the forward rotation, so it overwrites rather than adds). */
    void (*rope_forward)(const fl_backend *be, float *x, int B, int T, int nh, int HD, size_t row_stride,
                         const float *cos_t, const float *sin_t, int pos0);
    void (*rope_backward)(const fl_backend *be, float *dx, int B, int T, int nh, int HD, size_t row_stride,
                          const float *cos_t, const float *sin_t, int pos0);

    /* ---- activations ----------------------------------------------------
     * SwiGLU on the fused gate/up projection: gu rows are [gate (F) | up (F)],
     * out = silu(gate) * up. GELU is the tanh approximation (GPT-2 "gelu_new"). */
    void (*swiglu_forward)(const fl_backend *be, float *out /*(N,F)*/, const float *gu /*(N,2F)*/, int N, int F);
    void (*swiglu_backward)(const fl_backend *be, float *dgu /*(N,2F)*/, const float *dout /*(N,F)*/,
                            const float *gu /*(N,2F)*/, int N, int F);
    void (*gelu_forward)(const fl_backend *be, float *out /*(n)*/, const float *inp /*(n)*/, size_t n);
    void (*gelu_backward)(const fl_backend *be, float *dinp /*(n)*/, const float *dout, const float *inp, size_t n);
    /* ReLU (OPT): out = inp < 0 ? 0 : inp (a NaN stays NaN); backward dinp += inp <= 0 ? 0 : dout (PyTorch's
     * threshold_backward: no gradient at inp == 0). */
    void (*relu_forward)(const fl_backend *be, float *out /*(n)*/, const float *inp /*(n)*/, size_t n);
    void (*relu_backward)(const fl_backend *be, float *dinp /*(n)*/, const float *dout, const float *inp, size_t n);
    /* The exact GELU, x (1 + erf(x / sqrt 2)) / 2 (transformers' "gelu": BLIP-2's vision tower and Q-Former);
     * backward: dinp += dout (Phi(x) + x phi(x)) */
    void (*gelu_erf_forward)(const fl_backend *be, float *out /*(n)*/, const float *inp /*(n)*/, size_t n);
    void (*gelu_erf_backward)(const fl_backend *be, float *dinp /*(n)*/, const float *dout, const float *inp, size_t n);
    /* GEGLU (T5 v1.1's gated-GELU FFN) on the fused [wi_0 (F) | wi_1 (F)] rows: out = gelu_tanh(gate) * lin;
     * backward accumulates (+=) as swiglu_backward. (A backend without it, NULL: the graph refuses the op by name.) */
    void (*geglu_forward)(const fl_backend *be, float *out /*(N,F)*/, const float *gu /*(N,2F)*/, int N, int F);
    void (*geglu_backward)(const fl_backend *be, float *dgu /*(N,2F)*/, const float *dout /*(N,F)*/,
                           const float *gu /*(N,2F)*/, int N, int F);

    /* ---- elementwise / bias -------------------------------------------- */
    /* out = a + b (out may alias a or b). */
    void (*add)(const fl_backend *be, float *out, const float *a, const float *b, size_t n);
    /* y[n,:] += b for every row. */
    void (*bias_forward)(const fl_backend *be, float *y /*(N,OC)*/, const float *b /*(OC)*/, int N, int OC);
    /* db += column sums of dy. */
    void (*bias_backward)(const fl_backend *be, float *db /*(OC)*/, const float *dy /*(N,OC)*/, int N, int OC);

    /* ---- fused cross-entropy --------------------------------------------
     * For each row n: if targets[n] == ignore_index, loss[n] = 0 and (when
     * dlogits) the row's gradient is 0; else loss[n] = logsumexp(logits[n]) -
     * logits[n, targets[n]], computed in one pass over the vocabulary in chunks
     * with an online max/sum. If dlogits != NULL it receives (OVERWRITES, may
     * alias logits) grad_scale * (softmax(logits[n]) - onehot(targets[n])).
     * Returns nothing; sum loss[] yourself (in double) for the mean. */
    void (*cross_entropy)(const fl_backend *be, float *loss /*(N)*/, float *dlogits /*(N,V) or NULL*/,
                          const float *logits /*(N,V)*/, const int32_t *targets /*(N)*/, int N, int V,
                          float grad_scale, int ignore_index);

    /* ---- optimizers (flat buffers; one call per contiguous range) --------
     * AdamW exactly as torch.optim.AdamW: p *= 1 - lr*wd; m = b1 m + (1-b1) g;
     * v = b2 v + (1-b2) g^2; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
     * g is multiplied by grad_scale first (clipping, loss-scale removal). step >= 1.
     * Storage dtypes: p in {F32, BF16, F16}, g in {F32, BF16, F16}, m and v share ts in {F32, BF16}
     * (supports_op FL_OP_ADAMW says which a backend has; others return FL_ERR_UNSUPPORTED). Every
     * value is widened to fp32 when loaded, the formula is evaluated in fp32 and the new p, m, v
     * are rounded (RNE) once when stored. fp32 training = (F32, F32, F32); bf16-true = (BF16, BF16,
     * BF16); bf16-mixed master weights = (F32, F32 or BF16, F32). (One slot since issue 29: the
     * fp32-only adamw_update and the typed adamw_update_ex were twins; the CPU backend still runs
     * its fp32 loop for (F32, F32, F32), the same bits as before.) */
    fl_status (*adamw_update)(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *m,
                              void *v, fl_dtype ts, size_t n, float lr, float beta1, float beta2, float eps,
                              float weight_decay, int step, float grad_scale);
    /* SGD exactly as torch.optim.SGD (weight decay added to the gradient; momentum buffer
     * initialized to the gradient on the first step), with the storage dtypes of adamw_update;
     * buf (dtype ts in {F32, BF16}) NULL when momentum == 0. */
    fl_status (*sgd_update)(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf,
                            fl_dtype ts, size_t n, float lr, float momentum, float dampening, float weight_decay,
                            int nesterov, int first_step, float grad_scale);

    /* ---- reductions / misc ---------------------------------------------- */
    /* sum of x[i]^2 of x (F32, BF16 or F16; another dtype: 0), accumulated in double; the same
     * bits for any thread count. */
    double (*sumsq)(const fl_backend *be, const void *x, fl_dtype t, size_t n);
    /* x *= s */
    void (*scale)(const fl_backend *be, float *x, size_t n, float s);
    /* x = 0 (device memset) */
    void (*zero)(const fl_backend *be, void *x, size_t bytes);

    /* ---- attention of one new query against a KV cache (generation) ------
     * For each query head h (kv head g = h / (NH/NKV)): out[h] = softmax(q[h] .
     * K_g[0..T-1] / sqrt(HD)) V_g[0..T-1]. Head g's keys are the T rows
     * kcache + g*head_stride + t*HD (t < T), values likewise in vcache; the
     * cache of one layer is (NKV, Tmax, HD), so head_stride = Tmax*HD. No mask:
     * the caller passes T = position + 1. Online softmax over key tiles: no (T)
     * score buffer, O(T*HD) work per head, deterministic. */
    void (*attention_decode)(const fl_backend *be, float *out /*(NH*HD)*/, const float *q /*(NH*HD)*/,
                             const float *kcache, const float *vcache, int T, int NH, int NKV, int HD,
                             size_t head_stride);

    /* ==== reduced precision (appended; see docs/ARCHITECTURE.md "Precision kernels") ====
     * All of these return FL_ERR_UNSUPPORTED (with a message) for dtype combinations they do
     * not implement; F32/BF16/F16 mean IEEE binary32, bfloat16, binary16; conversions to
     * 16-bit types round to nearest even (fl_f32_to_bf16 / fl_f32_to_f16). */

    /* dst(n, dt) = src(n, st) for dt, st in {F32, BF16, F16} (any pair; same type = copy).
     * BF16 <-> F16 goes through f32 (exact widening, one RNE rounding). Parallel. */
    fl_status (*convert)(const fl_backend *be, void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n);

    /* Loss scaling: sets *found_inf = 1 if any x[i] * inv_scale (computed in fp32, x widened from
     * t in {F32, BF16, F16}) is inf or NaN; otherwise leaves *found_inf unchanged, so calls over
     * several ranges OR together (torch._amp_foreach_non_finite_check_and_unscale_ without the
     * unscale: pass the loss scale's reciprocal as grad_scale to the optimizer instead). The
     * result is a flag, so it is deterministic whatever the thread count. */
    fl_status (*check_finite)(const fl_backend *be, const void *x, fl_dtype t, size_t n, float inv_scale,
                              int *found_inf);

    /* 8-bit AdamW with bitsandbytes semantics (bnb.optim.AdamW8bit / Adam8bit on a GPU: kernel
     * kOptimizerStatic8bit2StateBlockwise, blocksize 256) over one flat tensor described by st
     * (fitllm/adam8bit.h; st->n < FL_ADAM8BIT_MIN_SIZE uses bnb's fp32-state kernel instead).
     * p in {F32, BF16}, g in {F32, BF16}. NOTE bnb's order: decoupled weight decay is applied
     * AFTER the Adam step (p = (p + step) * (1 - lr*wd)), eps is added as eps*sqrt(1-b2^t) to
     * sqrt(v), and an element whose raw gradient is inf/NaN keeps its parameter but has its m
     * and v reset to 0 (8-bit path only). Parallel over blocks, deterministic. */
    fl_status (*adam8bit_update)(const fl_backend *be, void *p, fl_dtype tp, const void *g, fl_dtype tg,
                                 const fl_adam8bit_state *st, float lr, float beta1, float beta2, float eps,
                                 float weight_decay, int step, float grad_scale);

    /* ==== LoRA and QLoRA (appended; see docs/ARCHITECTURE.md "LoRA and QLoRA building blocks") ==== */

    /* Fused 4-bit matmul over a bitsandbytes NF4/FP4 weight w (rows = out, cols = in; fitllm/quant4.h):
     *   forward:  y (N, out; row stride ldy) = x (N, in) @ deq(W)^T + beta * y,  beta in {0, 1};
     *   backward: dx (N, in) = dy (N, out; row stride ldy) @ deq(W) + beta * dx, beta in {0, 1}
     *             (the frozen base has no weight gradient; beta 1 = accumulate).
     * W is dequantized tile by tile (32 x 256 values in a stack tile) inside the kernel: no full
     * dequantized copy exists. fp32 accumulation, deterministic, independent of the thread count. */
    fl_status (*q4_matmul_forward)(const fl_backend *be, float *y, int ldy, const float *x, const fl_q4_weight *w,
                                   int N, float beta);
    fl_status (*q4_matmul_backward)(const fl_backend *be, float *dx, const float *dy, int ldy,
                                    const fl_q4_weight *w, int N, float beta);

    /* LoRA branch on a linear (in -> out), A (r, in), B (out, r), fitllm/lora.h:
     *   forward: xb = drop(x) (dropout > 0: written to xd (N, in), which must be non-NULL; else xb = x
     *            and xd is unused), h (N, r) = xb @ A^T (saved for backward; OVERWRITTEN),
     *            y (N, out; row stride ldy) += scaling * h @ B^T.
     *   Pass y = base output + row offset of the module inside a fused output (q/k/v slices of the
     *   fused QKV, gate/up of the fused (2F) projection) and ldy = the fused width.
     *   backward (xb = what forward multiplied: xd when dropout > 0, else x):
     *            g = dy @ B (N, r) into work;  dB += scaling * dy^T @ h;  dA += scaling * g^T @ xb;
     *            dx += scaling * (g @ A) * mask / (1 - p)  (mask regenerated from seed; p = 0: no mask).
     *   dA, dB, dx may be NULL (skipped). work: N*r floats, plus N*in when dropout > 0 and dx != NULL. */
    fl_status (*lora_forward)(const fl_backend *be, float *y, int ldy, float *h, float *xd, const float *x,
                              const float *A, const float *B, int N, int in, int out, int r, float scaling,
                              float dropout, uint64_t seed);
    fl_status (*lora_backward)(const fl_backend *be, float *dx, float *dA, float *dB, const float *dy, int ldy,
                               const float *xb, const float *h, const float *A, const float *B, int N, int in,
                               int out, int r, float scaling, float dropout, uint64_t seed, float *work);

    /* ==== 16-bit parameter storage (bf16-true, 16-true; appended) ==== */

    /* dst (n, BF16 or F16) = round(widen(dst) + src) (round to nearest even): how a
     * group's fp32 staged gradients are added into 16-bit gradient storage. */
    fl_status (*accumulate16)(const fl_backend *be, uint16_t *dst, fl_dtype t, const float *src, size_t n);

    /* ==== attention (see docs/ARCHITECTURE.md "General attention") ====
     * Encoder (bidirectional), decoder (causal) and cross-attention (q from one tensor, k/v
     * from another, Tq != Tk) with grouped-query heads (query head h uses kv head h/(NH/NKV)).
     * For query row t of head h in batch b, key j is VISIBLE when kmask is NULL or
     * kmask[b*Tk + j] != 0, and (causal) j <= t + Tk - Tq. Then
     *   s_j = scale * q.k_j + bias[(h*Tq + t)*Tk + j]   (bias term only when bias != NULL),
     *   out = sum over visible j of softmax(s)_j v_j,   lse = log sum over visible j of exp(s_j).
     * bias (NH, Tq, Tk) is added to every batch element (T5's relative position bias; entries
     * must be finite: padding goes in kmask); kmask (B, Tk) is a key padding mask, nonzero =
     * attend. A query row with no visible key gets out = 0 and lse = -inf, and contributes
     * nothing to any gradient. The (Tq, Tk) scores of all heads never exist (flash-attention
     * style): key tiles with an online softmax, per-row lse saved for the backward.
     * backward takes out and lse of attention_forward on the same inputs, ACCUMULATES dq, dk,
     * dv (all required) and, when dbias != NULL (requires bias),
     * dbias (NH, Tq, Tk) += the gradient summed over the batch (T5's bias is learned). dq, dk, dv
     * may be disjoint column ranges of one buffer (the fused dQKV). Results are the same bits for
     * any thread count. Errors: FL_ERR_INVALID (bad shape, stride or NULL), FL_ERR_UNSUPPORTED
     * (HD beyond what the backend's tiles hold: FL_CPU_ATTN_MAX_HD = 256 on the CPU); on error
     * nothing is written.
     * The decoder's causal self-attention over a fused QKV buffer (fl_attn_desc_qkv: q, k, v
     * column ranges of one (B, T, (NH+2*NKV)*HD) buffer, scale 1/sqrt(HD), no bias, no mask) is
     * this op too (fl_attention_qkv_forward / _backward below); a backend may run its own kernel
     * for that shape (fl_attn_is_qkv; the CPU does). Until issue 29 it was a separate pair of
     * slots, attention_forward / attention_backward, beside attention_forward_ex / _backward_ex. */
    fl_status (*attention_forward)(const fl_backend *be, const fl_attn_desc *a, float *out /*(B,Tq,NH,HD) ldo*/,
                                   float *lse /*(B,NH,Tq)*/, const float *q /*(B,Tq,NH,HD) ldq*/,
                                   const float *k /*(B,Tk,NKV,HD) ldk*/, const float *v /*(B,Tk,NKV,HD) ldv*/,
                                   const float *bias /*(NH,Tq,Tk) or NULL*/, const uint8_t *kmask /*(B,Tk) or NULL*/);
    fl_status (*attention_backward)(const fl_backend *be, const fl_attn_desc *a, float *dq /*like q*/,
                                    float *dk /*like k*/, float *dv /*like v*/, float *dbias /*(NH,Tq,Tk) or NULL*/,
                                    const float *dout /*like out*/, const float *q, const float *k, const float *v,
                                    const float *bias, const uint8_t *kmask, const float *out,
                                    const float *lse /*(B,NH,Tq)*/);

    /* ---- scratch -------------------------------------------------------------------------
     * Ops never allocate: the few that need a large scratch (the CPU's 16-bit GEMM widening
     * and 4-bit dequantization panels) use one lent by the caller from its accounting pool:
     * scratch_bytes (above) bytes, lent with set_scratch(be, p, scratch_bytes) by the calling
     * thread before its ops run (the model lends its WORKSPACE region in each forward and
     * backward), taken back with set_scratch(be, NULL, 0). Without a lent scratch the CPU
     * backend falls back to a process-wide buffer allocated on first use (op tests, tools). */
    void (*set_scratch)(const fl_backend *be, void *p, size_t bytes);

    /* ---- memory: host <-> device -----------------------------------------------------------
     * Device buffers come from the device's accounting pool (fl_mem_alloc on the pool created
     * for the backend's device). Code above the backend (model/, train/, io/, generation)
     * reaches their bytes only through these copies, never by dereferencing them: a device
     * whose memory the host cannot touch implements them as transfers; the CPU's are memcpy.
     * Copies are ordered with the ops; to_host returns when the bytes are in host memory. */
    fl_status (*to_device)(const fl_backend *be, void *dst /*device*/, const void *src /*host*/, size_t bytes);
    fl_status (*to_host)(const fl_backend *be, void *dst /*host*/, const void *src /*device*/, size_t bytes);
    fl_status (*copy)(const fl_backend *be, void *dst /*device*/, const void *src /*device*/, size_t bytes);
    /* wait until every op and copy issued so far has completed */
    fl_status (*sync)(const fl_backend *be);
    /* 1 when the backend implements `op` with these dtypes (see fl_op: which slot means what;
     * FL_F32 in unused slots), else 0. Checked when a model is set up (fl_model_set_precision,
     * fl_optim_init), so a missing kernel is an error naming the op before any step runs. */
    int (*supports_op)(const fl_backend *be, fl_op op, fl_dtype a, fl_dtype b, fl_dtype c);
    /* RoPE tables written on the device: cos_t/sin_t (maxT, HD/2), as fl_rope_table_init. */
    fl_status (*rope_tables)(const fl_backend *be, float *cos_t, float *sin_t, int maxT, int HD, float theta,
                             const fl_rope_scaling *scaling);

    /* Initialize p as this backend's pool for tensor memory (parameters, gradients, optimizer state, activations, KV cache): CPU and ref: fl_mem_pool_init(p, name, budget). */
    fl_status (*pool_init)(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget);
    /* Initialize p as the pool of the host tier of an offloaded run (CPU offload: the optimizer state and
     * the update's staging live there, outside the device's budget): host memory that this backend's
     * to_host / to_device reach fastest. cuda: page-locked (cudaMallocHost), so the copies run at the
     * link's speed without a bounce buffer; cpu, ref, opaque, cuda-emu: ordinary host memory; null: its
     * fake addresses (counted, never touched). */
    fl_status (*host_pool_init)(const fl_backend *be, fl_mem_pool *p, const char *name, size_t budget);

    void *impl; /* backend-private state (last: the op slots from gemm to here are the whole table) */
};

/* The step scalars' layout (fl_backend.step_scalars): the norm, the update's gradient scale, fp16's overflow flag
 * (check_finite_dev), a loss sum per micro-batch; FL_SS_MAX doubles at most (a step of more micro-batches reads its
 * losses on the host). */
enum { FL_SS_NORM = 0, FL_SS_SCALE = 1, FL_SS_FOUND = 2, FL_SS_LOSS = 3, FL_SS_MAX = 64 };
/* The input slots (fl_backend.input_slots): double-buffered, micro-batch k of a step in slot k % FL_INPUT_SLOTS. */
enum { FL_INPUT_SLOTS = 2 };

/* The two capabilities model/ and train/ ask most. Host memory: the backend's buffers are host memory
 * (cpu, ref, cuda-emu), so code may share one pool for tensors and host staging and read tensors
 * directly. Discards: the planner's null backend (FL_CAP_DISCARDS above). */
static inline int fl_backend_host_memory(const fl_backend *be) { return (be->caps & FL_CAP_HOST_MEMORY) != 0; }
static inline int fl_backend_discards(const fl_backend *be) { return (be->caps & FL_CAP_DISCARDS) != 0; }

/* First thing in main() of a program that runs the CPU backend (the CLI and the test runner
 * call it): make idle OpenMP workers sleep instead of spin. libgomp's default (neither
 * OMP_WAIT_POLICY nor GOMP_SPINCOUNT set) busy-waits 300,000 pause loops after every parallel
 * region, 17 ms on a Zen 3 VM: with one other busy process on 2 cores the spinning workers take
 * the cores from the thread with work, and a 1-step fine-tune ran 30-100x slower (measurements:
 * docs/ARCHITECTURE.md "Threads on a shared machine"). libgomp reads its environment once, in a
 * library constructor that runs before main(), so setting it here would be too late: unless the
 * user set OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME (their choice is kept), this sets
 * OMP_WAIT_POLICY=passive (OpenBLAS builds: also OPENBLAS_THREAD_TIMEOUT=4 unless set) and
 * re-executes the program once (/proc/self/exe, the same argv and environment otherwise). Returns when nothing had to be done, or when the exec failed (the run
 * goes on with the runtime's default). Single-threaded callers only (it changes the environment). */
void fl_cpu_process_init(char **argv);

/* Create the CPU backend. n_threads <= 0: use the OpenMP default / all cores.
 * The GEMM library is chosen at build time (see docs/BENCHMARKS.md). */
fl_status fl_cpu_backend_init(fl_backend *be, int n_threads);
/* The CPU backend's gemm_widens16 in this build on this CPU (the planner's answer too). */
unsigned fl_cpu_gemm_widens16(void);
/* The CPU backend's GEMM library: "openblas", "onednn" or "naive". */
const char *fl_cpu_gemm_library(void);
/* The CPU kernels run-time dispatch chose (fitllm --version, benchmarks; src/backend/cpu/dispatch.c). */
typedef struct {
    const char *cpu_level;     /* fl_cpu_level_name(fl_cpu_level()) */
    const char *gemm_library;  /* fl_cpu_gemm_library() */
    const char *bf16_gemm;     /* fl_cpu_gemm_bf16_path() */
    const char *f16_gemm;      /* fl_cpu_gemm_f16_path() */
    const char *adam8bit;      /* fl_cpu_adam8bit_quantizer_path() */
    const char *convert;       /* 16-bit conversions: core/cvt.c's fl_cvt_path() */
    const char *attention;     /* the attention kernels' tile products: fl_cpu_attn_mm_path() */
    int threads;               /* default thread count (fl_cpu_backend_init with 0) */
} fl_cpu_kernel_info;
void fl_cpu_kernels(fl_cpu_kernel_info *k);
/* The CPU backend's scratch_bytes (the planner's answer too). */
size_t fl_cpu_scratch_bytes(void);
void fl_cpu_backend_free(fl_backend *be);

/* The portable scalar reference backend: same ops, simple loops, no BLAS. The
 * fast CPU ops are tested against it and against float64. */
fl_status fl_ref_backend_init(fl_backend *be);

/* The opaque test backend (src/backend/opaque/): the CPU kernels, but its pool hands out addresses
 * that stay PROT_NONE (its ops work on an aliased copy of the range), so a host dereference of tensor
 * memory anywhere above the backend faults (docs/ARCHITECTURE.md "The opaque test backend").
 * A testing aid: FITLLM_TEST_BACKEND=opaque (tests), FITLLM_BACKEND=opaque (CLI). */
fl_status fl_opaque_backend_init(fl_backend *be, int n_threads);
void fl_opaque_backend_free(fl_backend *be);
/* Whether backends made from now on have a device communicator (comm_create), and which: 1 (default)
 * the NCCL stand-in with each collective's buffers taken at their storage; 2 the staged
 * communicator (fl_backend_comm_staged: through host buffers by the backend's own copies, as the CUDA
 * backend's thread ranks on one GPU); 0 none: tests see the refusal of several ranks on memory no
 * communicator can reach. */
void fl_opaque_use_comm(int on);

/* The null backend (src/backend/null/): the planner's. Every op and copy is a no-op that touches
 * no memory (to_host writes zeros into the host buffer, sumsq returns 0, check_finite finds
 * nothing; supports_op is the planned backend's, so a plan refuses what that run would refuse at
 * set-up; the registry's null says yes), its pool (pool_init) hands out fake addresses that are never
 * dereferenced, so running the real set-up and training step on it costs no memory and little
 * time, while every allocation goes through the accounting pool as on the backend it stands in
 * for. `planned` names that backend, "cpu" or "cuda": its scratch_bytes, gemm_widens16 and
 * host memory are copied (docs/ARCHITECTURE.md "Planner and lab"); "cpu" (host memory) is for
 * fl_trainer_rehearse only, whose code never writes tensors through host pointers. NULL (the
 * registry's "null", FITLLM_BACKEND=null): a device whose memory the host cannot read (any code
 * path runs on it, as on the opaque backend) with the CPU's scratch sizes. */
fl_status fl_null_backend_init_for(fl_backend *be, const char *planned);
fl_status fl_null_backend_init(fl_backend *be, int n_threads); /* planned NULL (the registry's init) */
/* Several ranks: the null backend's device communicator (comm_create: fl_comm_null_create over the
 * host communicator) moves nothing; with on, its reductions take the MPI implementation's receive
 * scratch from the pool, as a CPU run over mpirun does (plan: not for thread ranks or NCCL). */
void fl_null_backend_set_mpi_scratch(fl_backend *be, int on);
void fl_null_backend_free(fl_backend *be);

/* ---- the registry: the backends this build has (src/backend/registry.c) ----------------------
 * In a fixed order: "cpu" (the fast CPU ops), "ref" (the portable scalar reference); a build
 * with more backends lists them after these ("opaque", the host-cannot-read test backend;
 * "cuda"). The op tests run every registered backend against the same float64 references, the
 * test suite's FITLLM_TEST_BACKEND picks one by name, and `fitllm --version` lists them. */
int fl_backend_count(void);
/* Name and one-line description of backend i (0 <= i < fl_backend_count()); NULL outside. */
const char *fl_backend_name(int i);
const char *fl_backend_description(int i);
/* Create the backend called `name` with n_threads (<= 0: the default; backends with a fixed
 * thread count ignore it). An unknown name is FL_ERR_INVALID with a message listing the names
 * this build has. Release it with fl_backend_free. */
fl_status fl_backend_init_by_name(const char *name, fl_backend *be, int n_threads);
/* Add a backend defined outside the library (the test programs register "cuda-emu", the CUDA
 * backend over the CPU emulator) after the built-in ones; a name already there: no-op. Call it
 * before any other thread uses the registry. */
fl_status fl_backend_register(const char *name, const char *what, fl_status (*init)(fl_backend *be, int n_threads),
                              void (*free_fn)(fl_backend *be));
/* Release a backend made by any registered init (by its name); NULL or a zeroed one: no-op. */
void fl_backend_free(fl_backend *be);
/* The pools of a run on `be`: tensors (parameters, gradients, optimizer state, activations, KV
 * cache) come from *dev, made by be->pool_init with the budget. A backend whose memory is host
 * memory (fl_backend_host_memory: cpu, ref) gets ONE pool, as before (*host unused, dev->host NULL);
 * another gets a separate host pool *host (no budget) for host staging, linked as dev->host
 * (fl_mem_host_pool). Free with fl_backend_pools_free (dev first: the host pool outlives it). */
fl_status fl_backend_pools_init(const fl_backend *be, fl_mem_pool *dev, fl_mem_pool *host, const char *name,
                                size_t budget);
void fl_backend_pools_free(fl_mem_pool *dev, fl_mem_pool *host);
/* fl_mem_calloc for device memory: allocate from p (be's pool) and zero with be->zero. */
fl_status fl_backend_calloc(const fl_backend *be, fl_mem_pool *p, fl_mem_tag tag, size_t bytes, void **out);
/* A device communicator for be's memory staged through host memory over `host` (fl_comm_staged_create
 * with be->to_host / be->to_device as its copies): the CUDA backend's when its ranks are threads of one
 * process sharing one GPU (NCCL refuses that), the opaque backend's in its "staged" mode (tests). */
struct fl_comm;
fl_status fl_backend_comm_staged(const fl_backend *be, struct fl_comm *host, struct fl_comm **out);
/* The backend the CLI and the trainer create: $FITLLM_BACKEND when set (a testing aid, e.g.
 * "opaque"; checked by fl_backend_init_by_name), else the one chosen with
 * fl_backend_set_default_name (the CLI's --accelerator cpu|cuda), else "cpu". */
const char *fl_backend_default_name(void);
/* Choose the default backend by name (NULL: back to "cpu"); the name must stay valid. */
void fl_backend_set_default_name(const char *name);

/* What the registry knows of a backend by name, without making it (no device needed): the
 * planner's null backend stands in for the backend with these facts, the lab and selftest ask
 * them instead of comparing names. */
typedef struct {
    unsigned caps;          /* FL_CAP_* */
    fl_device device;       /* its pools' device */
    size_t scratch_bytes;   /* as fl_backend.scratch_bytes */
    unsigned gemm_widens16; /* as fl_backend.gemm_widens16 */
    /* as fl_backend.attn_scratch_bytes (cuda: when FITLLM_CUDA_ATTN takes cuDNN and a cuDNN library loads here) */
    size_t (*attn_scratch_bytes)(int B, int T, int NH, int NKV, int HD);
    /* as fl_backend.supports_op, without a backend; NULL: not known here (a backend registered with
     * fl_backend_register): every op */
    int (*supports_op)(fl_op op, fl_dtype a, fl_dtype b, fl_dtype c);
    size_t (*memory_capacity)(void);       /* FL_CAP_DEVICE_MEMORY: the device's bytes (0: unknown) */
    void (*describe)(char *buf, size_t n); /* one line on the device (cuda); NULL: none */
    const char *reference;                 /* the backend `fitllm selftest` compares this one against */
} fl_backend_facts;
/* The facts of a registered backend, or of "cuda" in any build (plan --accelerator cuda plans for a
 * GPU without one). Unknown name: FL_ERR_INVALID listing the names. A backend registered with
 * fl_backend_register is made once (and freed) to read them. */
fl_status fl_backend_facts_of(const char *name, fl_backend_facts *f);
/* The memory a run on backend `name` is budgeted against: the device's (FL_CAP_DEVICE_MEMORY),
 * else the machine's RAM. 0 when unknown. */
size_t fl_backend_memory_capacity(const char *name);

/* --accelerator auto|cpu|cuda: which backend a command runs on (the CLI's choice; the registry
 * maps it to a backend name, so no caller names the GPU backend itself). */
typedef enum { FL_ACCEL_AUTO = 0, FL_ACCEL_CPU, FL_ACCEL_CUDA } fl_accel;
/* Parse "auto", "cpu" or "cuda"; -1 for anything else. */
int fl_accel_parse(const char *s, fl_accel *out);
/* The backend a command runs on: FL_ACCEL_CUDA when asked (cuda) or, for auto, when this build has
 * CUDA and a device is visible; FL_ACCEL_CPU for cpu and for auto otherwise. cuda without a CUDA
 * build or without a visible device is an error (FL_ERR_UNSUPPORTED) saying which. */
fl_status fl_accel_resolve(fl_accel want, fl_accel *use);
/* The registry's backend for a resolved accelerator: "cpu" or "cuda" (auto: "cpu"). */
const char *fl_accel_backend(fl_accel a);

/* add_norm_forward16 composed of be's add16 (or add and round16 / two converts), then its w16 norm (or the fp32 norm
 * and the same rounding): the bits of exec.c's unfused ops (the CPU backends' implementation) */
fl_status fl_backend_add_norm16_composed(const fl_backend *be, int ln, float *res, void *res16, float *out, void *out16,
                                         float *mean, float *rstd, const float *a, const float *b, const void *w,
                                         const void *bias, fl_dtype wt, int N, int C, float eps);
/* add_rmsnorm_forward composed of be's add and rmsnorm_forward (the CPU backends' implementation: the same
 * bits as the two ops called in turn). */
fl_status fl_backend_add_rmsnorm_composed(const fl_backend *be, void *res, void *out, float *rstd, const void *a,
                                          const void *b, const float *w, fl_dtype t, int N, int C, float eps);
/* The checks of attention_forward / attention_backward's arguments (shape, NH % NKV, row
 * strides, NULL tensors, dbias without bias, scale): FL_ERR_INVALID naming the field, or
 * FL_ERR_UNSUPPORTED for HD > max_hd (why_max says whose limit). Every backend calls it first. */
fl_status fl_attn_check_args(const char *op, const fl_attn_desc *a, int max_hd, const char *why_max, const void *out,
                             const void *lse, const float *q, const float *k, const float *v, const float *bias,
                             const float *dbias);
/* The checks of lora_forward / lora_backward's sizes (N >= 0, in, out, r > 0, ldy >= out) and dropout in [0, 1):
 * FL_ERR_INVALID naming the op (who). Every backend calls it first. */
fl_status fl_lora_check_args(const char *who, int N, int in, int out, int r, int ldy, float dropout);
/* The descriptor of the decoder's causal self-attention over a fused QKV buffer (B, T,
 * (NH+2*NKV)*HD) with out (B, T, NH*HD): Tq = Tk = T, ldq = ldk = ldv = (NH+2*NKV)*HD, ldo =
 * NH*HD, scale 1/sqrt(HD), causal. */
static inline fl_attn_desc fl_attn_desc_qkv(int B, int T, int NH, int NKV, int HD) {
    fl_attn_desc a;
    memset(&a, 0, sizeof a);
    a.B = B;
    a.Tq = a.Tk = T;
    a.NH = NH;
    a.NKV = NKV;
    a.HD = HD;
    a.ldq = a.ldk = a.ldv = (size_t)(NH + 2 * (NKV > 0 ? NKV : 0)) * (HD > 0 ? HD : 0);
    a.ldo = (size_t)NH * (HD > 0 ? HD : 0);
    /* the expression of the CPU's fused kernel and the CUDA kernels' fused descriptor: the same
     * float, so fl_attn_is_qkv recognizes the shape and the bits stay those of the fused kernel
     * (inline: the CUDA launchers build the same descriptor) */
    a.scale = HD > 0 ? 1.0f / sqrtf((float)HD) : 1.0f;
    a.causal = 1;
    return a;
}
/* 1 when an attention call is exactly that fused shape: the descriptor of fl_attn_desc_qkv, k and
 * v the column ranges NH*HD and (NH+NKV)*HD of q's rows, no bias, no mask (backward: dk, dv the
 * same ranges of dq, no dbias; pass dq = NULL for forward). A backend with a kernel of its own for
 * the fused layout uses it then. */
int fl_attn_is_qkv(const fl_attn_desc *a, const float *q, const float *k, const float *v, const float *bias,
                   const uint8_t *kmask, const float *dq, const float *dk, const float *dv, const float *dbias);
/* attention_forward / attention_backward over a fused QKV buffer (fl_attn_desc_qkv): the decoder's
 * causal self-attention. dqkv ACCUMULATES like dq, dk, dv. */
fl_status fl_attention_qkv_forward(const fl_backend *be, float *out /*(B,T,NH*HD)*/, float *lse /*(B,NH,T)*/,
                                   const float *qkv /*(B,T,(NH+2*NKV)*HD)*/, int B, int T, int NH, int NKV, int HD);
fl_status fl_attention_qkv_backward(const fl_backend *be, float *dqkv /*(B,T,(NH+2*NKV)*HD)*/,
                                    const float *dout /*(B,T,NH*HD)*/, const float *qkv, const float *out,
                                    const float *lse /*(B,NH,T)*/, int B, int T, int NH, int NKV, int HD);


#ifdef __cplusplus
}
#endif
/* the op records of fl_backend.run and FL_RUN */
#include "fitllm/backend_op.h"
#endif
