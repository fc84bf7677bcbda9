/* The per-op profiler of `bench-step --profile` (fitllm/perf.h; issue 30, item 6).
 *
 * fl_profiler_attach keeps a copy of the backend's table and replaces its op slots with wrappers that
 * call the original between two markers. The wrapped ops receive the same `be` (its impl is untouched),
 * so an op that calls another slot of its own backend (the CPU's LoRA calls gemm) reaches a wrapper
 * again: only the outermost op of such a nest is timed (a depth count), so nothing is counted twice.
 *
 * Markers: the backend's `mark` slot (CUDA events recorded on its stream: the step keeps running
 * without a host round trip per op, and the times are the GPU's), read back by `mark_ms` when the
 * caller collects (after a step) or when FL_PROF_MAX_MARKS markers are pending. A backend without the
 * slot (cpu, ref, opaque) is timed by the host clock with a sync on both sides of each op. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fitllm/perf.h"

#define PROF_OPS(X)                                                                                                    \
    X(gemm, FL_PROF_GEMM) X(gemm_epilogue, FL_PROF_GEMM) X(lora_forward, FL_PROF_GEMM) X(lora_backward, FL_PROF_GEMM)                                 \
    X(q4_matmul_forward, FL_PROF_GEMM) X(q4_matmul_backward, FL_PROF_GEMM)                                             \
    X(attention_forward, FL_PROF_ATTN) X(attention_backward, FL_PROF_ATTN) X(attention_decode, FL_PROF_ATTN)            \
    X(rope_forward, FL_PROF_ATTN) X(rope_backward, FL_PROF_ATTN)                                                       \
    X(rmsnorm_forward, FL_PROF_NORM) X(rmsnorm_backward, FL_PROF_NORM) X(layernorm_forward, FL_PROF_NORM)              \
    X(layernorm_backward, FL_PROF_NORM) X(add_rmsnorm_forward, FL_PROF_NORM)                                           \
    X(swiglu_forward, FL_PROF_ELEM) X(swiglu_backward, FL_PROF_ELEM) X(gelu_forward, FL_PROF_ELEM)                     \
    X(gelu_backward, FL_PROF_ELEM) X(relu_forward, FL_PROF_ELEM) X(relu_backward, FL_PROF_ELEM)                        \
    X(geglu_forward, FL_PROF_ELEM) X(geglu_backward, FL_PROF_ELEM) X(add, FL_PROF_ELEM) X(bias_forward, FL_PROF_ELEM)  \
    X(bias_backward, FL_PROF_ELEM) X(scale, FL_PROF_ELEM) X(convert, FL_PROF_ELEM) X(accumulate16, FL_PROF_ELEM)       \
    X(embedding_forward, FL_PROF_LOSS) X(embedding_backward, FL_PROF_LOSS) X(cross_entropy, FL_PROF_LOSS)              \
    X(cross_entropy_dbf16, FL_PROF_LOSS)                                                                               \
    X(adamw_update, FL_PROF_OPTIM) X(sgd_update, FL_PROF_OPTIM) X(adam8bit_update, FL_PROF_OPTIM)                      \
    X(sumsq, FL_PROF_OPTIM) X(check_finite, FL_PROF_OPTIM)                                                             \
    X(to_device, FL_PROF_COPY) X(to_host, FL_PROF_COPY) X(copy, FL_PROF_COPY) X(zero, FL_PROF_COPY)                   \
    /* the optional 16-bit variants (a bf16 step runs these instead of the ops above) */                             \
    X(attention_forward16, FL_PROF_ATTN) X(attention_backward16, FL_PROF_ATTN) X(rope_forward16, FL_PROF_ATTN)         \
    X(rope_backward16, FL_PROF_ATTN) X(rmsnorm_forward_w16, FL_PROF_NORM) X(rmsnorm_backward_w16, FL_PROF_NORM)        \
    X(layernorm_forward_w16, FL_PROF_NORM) X(layernorm_backward_w16, FL_PROF_NORM) X(act_forward16, FL_PROF_ELEM)      \
    X(act_backward16, FL_PROF_ELEM) X(add16, FL_PROF_ELEM) X(round16, FL_PROF_ELEM) X(convert_many, FL_PROF_ELEM)      \
    X(embedding_forward16, FL_PROF_LOSS)                                                                               \
    /* the step scalars (issue 30 item 5: the norm, the clip scale and the loss sums on the device) */                \
    X(grad_norm_dev, FL_PROF_OPTIM) X(adamw_update_ss, FL_PROF_OPTIM) X(sgd_update_ss, FL_PROF_OPTIM)                  \
    X(loss_sum_dev, FL_PROF_LOSS) X(check_finite_dev, FL_PROF_OPTIM)                                                   \
    /* tensor parallelism's (issue 35): the vocabulary-parallel cross-entropy's halves, the row-strided dropout */     \
    X(vocab_stats, FL_PROF_LOSS) X(vocab_xent, FL_PROF_LOSS) X(dropout_rows, FL_PROF_ELEM)                             \
    X(bias_backward16, FL_PROF_ELEM) X(attention_forward_in16, FL_PROF_ATTN) X(attention_backward_b16, FL_PROF_ATTN)  \
    X(add_norm_forward16, FL_PROF_NORM) X(add_norm_forward16_b16, FL_PROF_NORM) X(q4_matmul_forward16, FL_PROF_GEMM) \
    X(q4_matmul_backward16, FL_PROF_GEMM) X(gemm_res16, FL_PROF_GEMM)                                                 \
    X(relbias_forward, FL_PROF_ATTN) X(relbias_backward, FL_PROF_ATTN)                                                 \
    /* dropout (T5 / OPT / BLIP-2 training with a config's dropout), the exact GELU (BLIP-2's ViT and Q-Former), the
     * step scalars' 8-bit AdamW */                                                                                   \
    X(dropout, FL_PROF_ELEM) X(gelu_erf_forward, FL_PROF_ELEM) X(gelu_erf_backward, FL_PROF_ELEM)                     \
    X(adam8bit_update_ss, FL_PROF_OPTIM)

#define PROF_ENUM(op, g) OP_##op,
enum { PROF_OPS(PROF_ENUM) OP_COUNT };
#define PROF_NAME(op, g) #op,
static const char *const k_op_name[OP_COUNT] = {PROF_OPS(PROF_NAME)};
#define PROF_GROUP(op, g) g,
static const fl_prof_group k_op_group[OP_COUNT] = {PROF_OPS(PROF_GROUP)};

typedef struct {
    int op;
    int m0;    /* its first marker (m0 + 1 the second) */
    int shape; /* a GEMM's row of the shape table, else -1 */
} pending;

/* GEMMs by shape (issue 30 item 3 compares each with cuBLASLt's own rate for it) */
#define PROF_SHAPES 64
typedef struct {
    int ta, tb, M, N, K;
    fl_dtype tA, tB, tC;
    int epi; /* gemm_epilogue's epilogue, 0: a plain gemm */
    double ref_best, ref_chosen; /* fl_profiler_gemm_refs: the library's rate for the shape alone, ms per call (< 0: none) */
    double ms;
    long calls;
} gemm_shape;

struct fl_profiler {
    fl_backend *be;
    fl_backend orig; /* the table before the wrappers */
    int depth;       /* > 0 inside an op */
    double t0;       /* host clock at the outermost op's start (no mark slot) */
    int n_pending;
    pending pend[FL_PROF_MAX_MARKS / 2];
    double ms[OP_COUNT], flops[OP_COUNT];
    long calls[OP_COUNT];
    fl_status err; /* the first marker failure (reported by collect) */
    gemm_shape shapes[PROF_SHAPES];
    int n_shapes;
    int cur_shape; /* the GEMM being closed (prof_out), else -1 */
};

/* The profilers attached now (a handful at most: one per backend object). */
#define PROF_MAX 8
static fl_profiler *g_prof[PROF_MAX];

/* The profiler of a wrapped table: by address, else (a copy of the table, as the trainer's borrowed backend)
 * by the backend's private state. */
static fl_profiler *prof_find(const fl_backend *be) {
    for (int i = 0; i < PROF_MAX; i++)
        if (g_prof[i] && g_prof[i]->be == be) return g_prof[i];
    for (int i = 0; i < PROF_MAX; i++)
        if (g_prof[i] && be->impl && g_prof[i]->be->impl == be->impl) return g_prof[i];
    return NULL;
}
static fl_profiler *prof_of(const fl_backend *be) {
    fl_profiler *p = prof_find(be);
    if (!p) abort(); /* not reached: a wrapper is installed only with its profiler, and a copy keeps its impl */
    return p;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Opens an op: 1 when it is the outermost (timed), 0 inside another op. */
static int prof_in(fl_profiler *p) {
    if (p->depth++ > 0) return 0;
    if (p->orig.mark) {
        if (p->n_pending == FL_PROF_MAX_MARKS / 2) (void)fl_profiler_collect(p);
        fl_status s = p->orig.mark(p->be, 2 * p->n_pending);
        if (s != FL_OK && p->err == FL_OK) p->err = s;
    } else {
        if (p->orig.sync) (void)p->orig.sync(p->be);
        p->t0 = now_ms();
    }
    return 1;
}

static void prof_out(fl_profiler *p, int timed, int op, double flops) {
    p->depth--;
    if (!timed) return;
    p->calls[op]++;
    p->flops[op] += flops;
    if (p->orig.mark) {
        fl_status s = p->orig.mark(p->be, 2 * p->n_pending + 1);
        if (s != FL_OK && p->err == FL_OK) p->err = s;
        p->pend[p->n_pending].op = op;
        p->pend[p->n_pending].m0 = 2 * p->n_pending;
        p->pend[p->n_pending].shape = p->cur_shape;
        p->n_pending++;
    } else {
        if (p->orig.sync) (void)p->orig.sync(p->be);
        const double dt = now_ms() - p->t0;
        p->ms[op] += dt;
        if (p->cur_shape >= 0) p->shapes[p->cur_shape].ms += dt;
    }
    if (p->cur_shape >= 0) p->shapes[p->cur_shape].calls++;
}

/* The shape table's row of a GEMM (a new one while there is room; -1 when full). */
static int shape_of(fl_profiler *p, int ta, int tb, int M, int N, int K, fl_dtype tA, fl_dtype tB, fl_dtype tC,
                    int epi) {
    for (int i = 0; i < p->n_shapes; i++) {
        const gemm_shape *g = &p->shapes[i];
        if (g->ta == ta && g->tb == tb && g->M == M && g->N == N && g->K == K && g->tA == tA && g->tB == tB &&
            g->tC == tC && g->epi == epi)
            return i;
    }
    if (p->n_shapes == PROF_SHAPES) return -1;
    p->shapes[p->n_shapes] = (gemm_shape){ta, tb, M, N, K, tA, tB, tC, epi, -1.0, -1.0, 0.0, 0};
    return p->n_shapes++;
}

/* A wrapper: V for void slots, S for fl_status ones; FL the op's FLOPs (an expression of its arguments). */
#define WRAP_V(op, FL, params, args)                                                                                   \
    static void w_##op params {                                                                                        \
        fl_profiler *p = prof_of(be);                                                                                  \
        int tm_ = prof_in(p);                                                                                          \
        p->orig.op args;                                                                                               \
        prof_out(p, tm_, OP_##op, (FL));                                                                                 \
    }
#define WRAP_S(op, FL, params, args)                                                                                   \
    static fl_status w_##op params {                                                                                   \
        fl_profiler *p = prof_of(be);                                                                                  \
        int tm_ = prof_in(p);                                                                                          \
        fl_status s = p->orig.op args;                                                                                 \
        prof_out(p, tm_, OP_##op, (FL));                                                                                 \
        return s;                                                                                                      \
    }
#define BE const fl_backend *be

/* attention: QK^T and PV, 2 x 2 Tq Tk HD per head, halved under the causal mask (the convention of
 * fl_model_train_flops); the backward is twice the forward (dV, dP, dQ, dK) */
static double attn_flops(const fl_attn_desc *a) {
    double f = 4.0 * a->B * a->NH * a->HD * (double)a->Tq * a->Tk;
    return a->causal ? f / 2 : f;
}

static fl_status w_gemm(BE, int ta, int tb, int M, int N, int K, float alpha, const void *A, fl_dtype tA, int lda,
                        const void *B, fl_dtype tB, int ldb, float beta, void *C, fl_dtype tC, int ldc) {
    fl_profiler *p = prof_of(be);
    int tm = prof_in(p);
    fl_status s = p->orig.gemm(be, ta, tb, M, N, K, alpha, A, tA, lda, B, tB, ldb, beta, C, tC, ldc);
    p->cur_shape = tm ? shape_of(p, ta, tb, M, N, K, tA, tB, tC, 0) : -1;
    prof_out(p, tm, OP_gemm, 2.0 * M * N * K);
    p->cur_shape = -1;
    return s;
}
static fl_status w_gemm_epilogue(BE, int epi, const void *bias, float *aux, int ldaux, int ta, int tb, int M, int N,
                                 int K, float alpha, const void *A, fl_dtype tA, int lda, const void *B, fl_dtype tB,
                                 int ldb, float beta, float *C, int ldc) {
    fl_profiler *p = prof_of(be);
    int tm = prof_in(p);
    fl_status s = p->orig.gemm_epilogue(be, epi, bias, aux, ldaux, ta, tb, M, N, K, alpha, A, tA, lda, B, tB, ldb, beta,
                                        C, ldc);
    /* the shape's epilogue kind (a bf16 bias is timed as gemm_bench's fp32 one) and C's type */
    const fl_dtype tC = epi > 0 && (epi & FL_GEMM_EPI_OUT_BF16) ? FL_BF16 : FL_F32;
    p->cur_shape = tm ? shape_of(p, ta, tb, M, N, K, tA, tB, tC, epi & ~(FL_GEMM_EPI_BIAS_BF16 | FL_GEMM_EPI_OUT_BF16))
                      : -1;
    prof_out(p, tm, OP_gemm_epilogue, 2.0 * M * N * K);
    p->cur_shape = -1;
    return s;
}
static fl_status w_gemm_res16(BE, int ta, int tb, int M, int N, int K, float alpha, const void *A, int lda,
                              const void *B, int ldb, const void *c16, void *d16, int ldc) {
    fl_profiler *p = prof_of(be);
    int tm = prof_in(p);
    fl_status s = p->orig.gemm_res16(be, ta, tb, M, N, K, alpha, A, lda, B, ldb, c16, d16, ldc);
    p->cur_shape = tm ? shape_of(p, ta, tb, M, N, K, FL_BF16, FL_BF16, FL_BF16, 0) : -1; /* the bf16 C read in place */
    prof_out(p, tm, OP_gemm_res16, 2.0 * M * N * K);
    p->cur_shape = -1;
    return s;
}
WRAP_S(lora_forward, 2.0 * N * r * ((double)in + out),
       (BE, float *y, int ldy, float *h, float *xd, const float *x, const float *A, const float *B, int N, int in,
        int out, int r, float scaling, float dropout, uint64_t seed),
       (be, y, ldy, h, xd, x, A, B, N, in, out, r, scaling, dropout, seed))
WRAP_S(lora_backward, 2.0 * N * r * ((double)(dB ? out : 0) + out + (dA ? in : 0) + (dx ? in : 0)),
       (BE, float *dx, float *dA, float *dB, const float *dy, int ldy, const float *xb, const float *h, const float *A,
        const float *B, int N, int in, int out, int r, float scaling, float dropout, uint64_t seed, float *work),
       (be, dx, dA, dB, dy, ldy, xb, h, A, B, N, in, out, r, scaling, dropout, seed, work))
WRAP_S(q4_matmul_forward, 2.0 * N * (double)w->n, (BE, float *y, int ldy, const float *x, const fl_q4_weight *w, int N, float beta),
       (be, y, ldy, x, w, N, beta))
WRAP_S(q4_matmul_backward, 2.0 * N * (double)w->n,
       (BE, float *dx, const float *dy, int ldy, const fl_q4_weight *w, int N, float beta), (be, dx, dy, ldy, w, N, beta))
/* the stacked parts' elements (a NULL w or a bad nw: 0, the op refuses it) */
static double q4_parts_n(const fl_q4_weight *w, int nw) {
    double n = 0;
    for (int k = 0; w && k < nw && k < FL_Q4_MAX_PARTS; k++) n += (double)w[k].n;
    return n;
}
WRAP_S(q4_matmul_forward16, 2.0 * N * q4_parts_n(w, nw),
       (BE, float *y, int ldy, const void *x16, const fl_q4_weight *w, int nw, int N, float beta),
       (be, y, ldy, x16, w, nw, N, beta))
WRAP_S(q4_matmul_backward16, 2.0 * N * q4_parts_n(w, nw),
       (BE, float *dx, const void *dy16, int ldy, const fl_q4_weight *w, int nw, int N, float beta),
       (be, dx, dy16, ldy, w, nw, N, beta))
WRAP_S(attention_forward, attn_flops(a),
       (BE, const fl_attn_desc *a, float *out, float *lse, const float *q, const float *k, const float *v,
        const float *bias, const uint8_t *kmask),
       (be, a, out, lse, q, k, v, bias, kmask))
WRAP_S(attention_backward, 2.0 * attn_flops(a),
       (BE, const fl_attn_desc *a, float *dq, float *dk, float *dv, float *dbias, const float *dout, const float *q,
        const float *k, const float *v, const float *bias, const uint8_t *kmask, const float *out, const float *lse),
       (be, a, dq, dk, dv, dbias, dout, q, k, v, bias, kmask, out, lse))
WRAP_V(attention_decode, 4.0 * NH * HD * (double)T,
       (BE, float *out, const float *q, const float *kc, const float *vc, int T, int NH, int NKV, int HD, size_t hs),
       (be, out, q, kc, vc, T, NH, NKV, HD, hs))
WRAP_V(rope_forward, 0, (BE, float *x, int B, int T, int nh, int HD, size_t rs, const float *c, const float *s, int p0),
       (be, x, B, T, nh, HD, rs, c, s, p0))
WRAP_V(rope_backward, 0, (BE, float *x, int B, int T, int nh, int HD, size_t rs, const float *c, const float *s, int p0),
       (be, x, B, T, nh, HD, rs, c, s, p0))
WRAP_V(rmsnorm_forward, 0, (BE, float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps),
       (be, out, rstd, inp, w, N, C, eps))
WRAP_V(rmsnorm_backward, 0,
       (BE, float *dinp, float *dw, const float *dout, const float *inp, const float *w, const float *rstd, int N, int C),
       (be, dinp, dw, dout, inp, w, rstd, N, C))
WRAP_S(add_rmsnorm_forward, 0,
       (BE, void *res, void *out, float *rstd, const void *a, const void *b, const float *w, fl_dtype t, int N, int C,
        float eps),
       (be, res, out, rstd, a, b, w, t, N, C, eps))
WRAP_V(layernorm_forward, 0,
       (BE, float *out, float *mean, float *rstd, const float *inp, const float *w, const float *b, int N, int C,
        float eps),
       (be, out, mean, rstd, inp, w, b, N, C, eps))
WRAP_V(layernorm_backward, 0,
       (BE, float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w, const float *mean,
        const float *rstd, int N, int C),
       (be, dinp, dw, db, dout, inp, w, mean, rstd, N, C))
WRAP_V(swiglu_forward, 0, (BE, float *out, const float *gu, int N, int F), (be, out, gu, N, F))
WRAP_V(swiglu_backward, 0, (BE, float *dgu, const float *dout, const float *gu, int N, int F), (be, dgu, dout, gu, N, F))
WRAP_V(geglu_forward, 0, (BE, float *out, const float *gu, int N, int F), (be, out, gu, N, F))
WRAP_V(geglu_backward, 0, (BE, float *dgu, const float *dout, const float *gu, int N, int F), (be, dgu, dout, gu, N, F))
WRAP_V(gelu_forward, 0, (BE, float *out, const float *inp, size_t n), (be, out, inp, n))
WRAP_V(gelu_backward, 0, (BE, float *dinp, const float *dout, const float *inp, size_t n), (be, dinp, dout, inp, n))
WRAP_V(relu_forward, 0, (BE, float *out, const float *inp, size_t n), (be, out, inp, n))
WRAP_V(relu_backward, 0, (BE, float *dinp, const float *dout, const float *inp, size_t n), (be, dinp, dout, inp, n))
WRAP_V(add, 0, (BE, float *out, const float *a, const float *b, size_t n), (be, out, a, b, n))
WRAP_V(bias_forward, 0, (BE, float *y, const float *b, int N, int OC), (be, y, b, N, OC))
WRAP_V(bias_backward, 0, (BE, float *db, const float *dy, int N, int OC), (be, db, dy, N, OC))
WRAP_V(scale, 0, (BE, float *x, size_t n, float s), (be, x, n, s))
WRAP_S(convert, 0, (BE, void *dst, fl_dtype dt, const void *src, fl_dtype st, size_t n), (be, dst, dt, src, st, n))
WRAP_S(accumulate16, 0, (BE, uint16_t *dst, fl_dtype t, const float *src, size_t n), (be, dst, t, src, n))
WRAP_V(embedding_forward, 0,
       (BE, float *out, const int32_t *ids, const float *wte, const float *wpe, int B, int T, int C),
       (be, out, ids, wte, wpe, B, T, C))
WRAP_V(embedding_backward, 0,
       (BE, float *dwte, float *dwpe, const float *dout, const int32_t *ids, int B, int T, int C),
       (be, dwte, dwpe, dout, ids, B, T, C))
WRAP_S(dropout, 0, (BE, float *y, const float *x, size_t n, float pr, uint64_t seed, int acc), (be, y, x, n, pr, seed, acc))
WRAP_V(gelu_erf_forward, 0, (BE, float *out, const float *inp, size_t n), (be, out, inp, n))
WRAP_V(gelu_erf_backward, 0, (BE, float *dinp, const float *dout, const float *inp, size_t n), (be, dinp, dout, inp, n))
WRAP_S(adam8bit_update_ss, 0,
       (BE, void *pp, fl_dtype tp, const void *g, fl_dtype tg, const fl_adam8bit_state *st, float lr, float b1,
        float b2, float eps, float wd, int step, const double *ss),
       (be, pp, tp, g, tg, st, lr, b1, b2, eps, wd, step, ss))
WRAP_V(relbias_forward, 0, (BE, float *bias, const float *tab, const int32_t *rb, int NH, int Tq, int Tk, int nb),
       (be, bias, tab, rb, NH, Tq, Tk, nb))
WRAP_S(relbias_backward, 0, (BE, float *dtab, const float *dbias, const int32_t *rb, int NH, int Tq, int Tk, int nb),
       (be, dtab, dbias, rb, NH, Tq, Tk, nb))
WRAP_V(cross_entropy, 0,
       (BE, float *loss, float *dlogits, const float *logits, const int32_t *targets, int N, int V, float gs, int ii),
       (be, loss, dlogits, logits, targets, N, V, gs, ii))
WRAP_S(cross_entropy_dbf16, 0,
       (BE, float *loss, void *dl16, const float *logits, const int32_t *targets, int N, int V, int ld, float gs,
        int ii),
       (be, loss, dl16, logits, targets, N, V, ld, gs, ii))
WRAP_S(adamw_update, 0,
       (BE, void *pp, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v, fl_dtype ts, size_t n, float lr,
        float b1, float b2, float eps, float wd, int step, float gs),
       (be, pp, tp, g, tg, m, v, ts, n, lr, b1, b2, eps, wd, step, gs))
WRAP_S(sgd_update, 0,
       (BE, void *pp, fl_dtype tp, const void *g, fl_dtype tg, void *buf, fl_dtype ts, size_t n, float lr, float mom,
        float damp, float wd, int nest, int first, float gs),
       (be, pp, tp, g, tg, buf, ts, n, lr, mom, damp, wd, nest, first, gs))
WRAP_S(adam8bit_update, 0,
       (BE, void *pp, fl_dtype tp, const void *g, fl_dtype tg, const fl_adam8bit_state *st, float lr, float b1,
        float b2, float eps, float wd, int step, float gs),
       (be, pp, tp, g, tg, st, lr, b1, b2, eps, wd, step, gs))
WRAP_S(grad_norm_dev, 0, (BE, const void *g, fl_dtype tg, size_t n, float mx, float sc, int nl, double *ss),
       (be, g, tg, n, mx, sc, nl, ss))
WRAP_S(loss_sum_dev, 0, (BE, const float *loss, const int32_t *tg, int N, int ii, double *acc),
       (be, loss, tg, N, ii, acc))
WRAP_S(vocab_stats, 0, (BE, double *st, const float *lg, const int32_t *tg, int rows, int n, int lo),
       (be, st, lg, tg, rows, n, lo))
WRAP_S(vocab_xent, 0,
       (BE, float *loss, float *dl, const float *lg, const double *all, const int32_t *tg, int rows, int n, int lo, int np,
        int me, int V, float gs, int ii),
       (be, loss, dl, lg, all, tg, rows, n, lo, np, me, V, gs, ii))
WRAP_S(dropout_rows, 0, (BE, float *y, const float *x, int rows, size_t w, size_t stride, float pr, uint64_t seed, int acc),
       (be, y, x, rows, w, stride, pr, seed, acc))
WRAP_S(adamw_update_ss, 0,
       (BE, void *pp, fl_dtype tp, const void *g, fl_dtype tg, void *m, void *v, fl_dtype ts, size_t n, float lr,
        float b1, float b2, float eps, float wd, int step, const double *ss),
       (be, pp, tp, g, tg, m, v, ts, n, lr, b1, b2, eps, wd, step, ss))
WRAP_S(sgd_update_ss, 0,
       (BE, void *pp, fl_dtype tp, const void *g, fl_dtype tg, void *buf, fl_dtype ts, size_t n, float lr, float mom,
        float damp, float wd, int nest, int first, const double *ss),
       (be, pp, tp, g, tg, buf, ts, n, lr, mom, damp, wd, nest, first, ss))
WRAP_S(check_finite, 0, (BE, const void *x, fl_dtype t, size_t n, float inv, int *found), (be, x, t, n, inv, found))
WRAP_S(check_finite_dev, 0, (BE, const void *x, fl_dtype t, size_t n, float inv, double *ss), (be, x, t, n, inv, ss))
WRAP_V(zero, 0, (BE, void *x, size_t bytes), (be, x, bytes))
WRAP_S(attention_forward16, attn_flops(a),
       (BE, const fl_attn_desc *a, float *out, void *out16, float *lse, const float *q, const float *k, const float *v,
        const float *bias, const uint8_t *kmask),
       (be, a, out, out16, lse, q, k, v, bias, kmask))
WRAP_S(attention_backward16, 2.0 * attn_flops(a),
       (BE, const fl_attn_desc *a, float *dq, float *dk, float *dv, const float *dout, const void *q16, const void *k16,
        const void *v16, const uint8_t *kmask, const void *out16, const float *lse),
       (be, a, dq, dk, dv, dout, q16, k16, v16, kmask, out16, lse))
WRAP_S(rope_forward16, 0,
       (BE, float *o, void *x16, const float *x, int B, int T, int nh, int HD, int w, const float *ct, const float *st,
        int p0),
       (be, o, x16, x, B, T, nh, HD, w, ct, st, p0))
WRAP_S(rope_backward16, 0,
       (BE, float *o, void *x16, const float *x, int B, int T, int nh, int HD, int w, const float *ct, const float *st,
        int p0),
       (be, o, x16, x, B, T, nh, HD, w, ct, st, p0))
WRAP_V(rmsnorm_forward_w16, 0,
       (BE, float *out, void *out16, float *rstd, const float *inp, const void *w, fl_dtype wt, int N, int C, float eps),
       (be, out, out16, rstd, inp, w, wt, N, C, eps))
WRAP_V(rmsnorm_backward_w16, 0,
       (BE, float *dinp, void *dinp16, float *dw, const float *dout, const float *inp, const void *inp16, const void *w,
        fl_dtype wt, const float *rstd, int N, int C),
       (be, dinp, dinp16, dw, dout, inp, inp16, w, wt, rstd, N, C))
WRAP_V(layernorm_forward_w16, 0,
       (BE, float *out, void *out16, float *mean, float *rstd, const float *inp, const void *w, const void *b,
        fl_dtype wt, int N, int C, float eps),
       (be, out, out16, mean, rstd, inp, w, b, wt, N, C, eps))
WRAP_V(layernorm_backward_w16, 0,
       (BE, float *dinp, void *dinp16, float *dw, float *db, const float *dout, const float *inp, const void *inp16,
        const void *w, fl_dtype wt, const float *mean, const float *rstd, int N, int C),
       (be, dinp, dinp16, dw, db, dout, inp, inp16, w, wt, mean, rstd, N, C))
WRAP_S(act_forward16, 0, (BE, int kind, float *out, void *out16, float *in, const void *in16, int N, int F),
       (be, kind, out, out16, in, in16, N, F))
WRAP_S(act_backward16, 0,
       (BE, int kind, float *din, void *din16, const float *dout, const float *in, const void *in16, int N, int F),
       (be, kind, din, din16, dout, in, in16, N, F))
WRAP_S(attention_forward_in16, attn_flops(a),
       (BE, const fl_attn_desc *a, float *out, void *out16, float *lse, const void *q16, const void *k16,
        const void *v16, const uint8_t *kmask),
       (be, a, out, out16, lse, q16, k16, v16, kmask))
WRAP_S(attention_backward_b16, 2.0 * attn_flops(a),
       (BE, const fl_attn_desc *a, float *dq, float *dk, float *dv, void *dq16, void *dk16, void *dv16,
        const void *dout16, const void *q16, const void *k16, const void *v16, const void *out16, const float *lse),
       (be, a, dq, dk, dv, dq16, dk16, dv16, dout16, q16, k16, v16, out16, lse))
WRAP_S(bias_backward16, 0, (BE, float *db, void *dy16, const float *dy, int N, int OC), (be, db, dy16, dy, N, OC))
WRAP_S(add_norm_forward16, 0,
       (BE, int ln, float *res, void *res16, float *out, void *out16, float *mean, float *rstd, const float *a,
        const float *b, const void *w, const void *bias, fl_dtype wt, int N, int C, float eps),
       (be, ln, res, res16, out, out16, mean, rstd, a, b, w, bias, wt, N, C, eps))
WRAP_S(add_norm_forward16_b16, 0,
       (BE, int ln, float *res, void *res16, float *out, void *out16, float *mean, float *rstd, const float *a,
        const void *b16, const void *w, const void *bias, fl_dtype wt, int N, int C, float eps),
       (be, ln, res, res16, out, out16, mean, rstd, a, b16, w, bias, wt, N, C, eps))
WRAP_S(add16, 0, (BE, float *out, void *out16, const float *a, const float *b, size_t n), (be, out, out16, a, b, n))
WRAP_S(round16, 0, (BE, void *dst, fl_dtype dt, float *x, size_t n), (be, dst, dt, x, n))
WRAP_S(convert_many, 0,
       (BE, int count, void *const *dst, fl_dtype dt, const void *const *src, fl_dtype st, const size_t *len),
       (be, count, dst, dt, src, st, len))
WRAP_V(embedding_forward16, 0,
       (BE, float *out, void *out16, const int32_t *ids, const void *wte, const void *wpe, fl_dtype dt, int B, int T,
        int C),
       (be, out, out16, ids, wte, wpe, dt, B, T, C))
WRAP_S(to_device, 0, (BE, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))
WRAP_S(to_host, 0, (BE, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))
WRAP_S(copy, 0, (BE, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))

static double w_sumsq(BE, const void *x, fl_dtype t, size_t n) {
    fl_profiler *p = prof_of(be);
    int tm = prof_in(p);
    double r = p->orig.sumsq(be, x, t, n);
    prof_out(p, tm, OP_sumsq, 0);
    return r;
}

const char *fl_prof_group_name(fl_prof_group g) {
    static const char *const n[FL_PROF_GROUPS] = {"GEMM", "attention", "norm", "elementwise", "embedding+loss",
                                                  "optimizer", "copies"};
    return (unsigned)g < FL_PROF_GROUPS ? n[g] : "?";
}

fl_status fl_profiler_attach(fl_backend *be, fl_profiler **out) {
    *out = NULL;
    if (prof_find(be)) return fl_errorf(FL_ERR_INVALID, "profiler: backend '%s' is already profiled", be->name);
    int slot = -1;
    for (int i = 0; i < PROF_MAX && slot < 0; i++)
        if (!g_prof[i]) slot = i;
    if (slot < 0) return fl_errorf(FL_ERR_INVALID, "profiler: more than %d backends profiled at once", PROF_MAX);
    fl_profiler *p = (fl_profiler *)calloc(1, sizeof *p);
    if (!p) return fl_errorf(FL_ERR_OOM, "profiler: out of host memory");
    p->be = be;
    p->orig = *be;
    p->cur_shape = -1;
    g_prof[slot] = p;
#define PROF_INSTALL(op, g) be->op = p->orig.op ? w_##op : NULL; /* an optional slot stays NULL */
    PROF_OPS(PROF_INSTALL)
    *out = p;
    return FL_OK;
}

void fl_profiler_detach(fl_profiler *p) {
    if (!p) return;
    (void)fl_profiler_collect(p);
#define PROF_RESTORE(op, g) p->be->op = p->orig.op;
    PROF_OPS(PROF_RESTORE)
    for (int i = 0; i < PROF_MAX; i++)
        if (g_prof[i] == p) g_prof[i] = NULL;
    free(p);
}

fl_status fl_profiler_collect(fl_profiler *p) {
    fl_status s = p->err;
    for (int i = 0; i < p->n_pending; i++) {
        float ms = 0;
        fl_status e = p->orig.mark_ms(p->be, p->pend[i].m0, p->pend[i].m0 + 1, &ms);
        if (e != FL_OK && s == FL_OK) s = e;
        if (e == FL_OK) p->ms[p->pend[i].op] += ms;
        if (e == FL_OK && p->pend[i].shape >= 0) p->shapes[p->pend[i].shape].ms += ms;
    }
    p->n_pending = 0;
    p->err = FL_OK;
    return s;
}

void fl_profiler_reset(fl_profiler *p) {
    memset(p->ms, 0, sizeof p->ms);
    memset(p->flops, 0, sizeof p->flops);
    memset(p->calls, 0, sizeof p->calls);
    p->n_shapes = 0;
}

double fl_profiler_group_ms(const fl_profiler *p, fl_prof_group g) {
    double t = 0;
    for (int i = 0; i < OP_COUNT; i++) t += k_op_group[i] == g ? p->ms[i] : 0;
    return t;
}
long fl_profiler_group_calls(const fl_profiler *p, fl_prof_group g) {
    long c = 0;
    for (int i = 0; i < OP_COUNT; i++) c += k_op_group[i] == g ? p->calls[i] : 0;
    return c;
}
double fl_profiler_flops(const fl_profiler *p, fl_prof_group g) {
    double f = 0;
    for (int i = 0; i < OP_COUNT; i++) f += k_op_group[i] == g ? p->flops[i] : 0;
    return f;
}
double fl_profiler_total_ms(const fl_profiler *p) {
    double t = 0;
    for (int g = 0; g < FL_PROF_GROUPS; g++) t += fl_profiler_group_ms(p, (fl_prof_group)g);
    return t;
}

fl_status fl_profiler_gemm_refs(fl_profiler *p, int reps) {
    const fl_backend *be = p->be;
    if (!p->orig.gemm_bench) return FL_OK;
    fl_status first = FL_OK;
    for (int i = 0; i < p->n_shapes; i++) { /* a shape the library cannot time (its operands do not fit): no rate */
        gemm_shape *g = &p->shapes[i];
        fl_status s = p->orig.gemm_bench(be, g->epi, g->ta, g->tb, g->M, g->N, g->K, g->tA, g->tB, g->tC, reps,
                                         &g->ref_best, &g->ref_chosen);
        if (s != FL_OK) g->ref_best = g->ref_chosen = -1;
        if (s != FL_OK && first == FL_OK) first = s;
    }
    return first;
}

static int shape_cmp(const void *a, const void *b) {
    double x = ((const gemm_shape *)a)->ms, y = ((const gemm_shape *)b)->ms;
    return (x < y) - (x > y);
}
/* The GEMM shapes by time (a step's, k = 1 / steps), the slowest first. */
static void gemm_shape_table(const fl_profiler *p, double k, FILE *f) {
    if (!p->n_shapes) return;
    gemm_shape sh[PROF_SHAPES];
    memcpy(sh, p->shapes, (size_t)p->n_shapes * sizeof sh[0]);
    qsort(sh, (size_t)p->n_shapes, sizeof sh[0], shape_cmp);
    fprintf(f, "  GEMM shapes (row-major C(M,N) = op(A) op(B), K inner; the slowest first):\n");
    int refs = 0;
    for (int i = 0; i < p->n_shapes; i++) refs |= sh[i].ref_best > 0;
    fprintf(f, "    %6s %6s %6s %2s %2s %-24s %8s %10s %10s", "M", "N", "K", "tA", "tB", "A,B->C (epilogue)", "calls", "ms/step",
            "TFLOP/s");
    /* the library's own rate for the shape alone (its fastest candidate algorithm; the one our plan runs), and the
     * step's rate as a share of the fastest: issue 30 item 3 asks >= 80% (a converted panel's time counts against it) */
    if (refs) fprintf(f, " %10s %10s %7s", "lib best", "lib ours", "% best");
    fputc('\n', f);
    for (int i = 0; i < p->n_shapes; i++) {
        const gemm_shape *g = &sh[i];
        char ty[40];
        snprintf(ty, sizeof ty, "%s,%s->%s%s", fl_dtype_name(g->tA), fl_dtype_name(g->tB), fl_dtype_name(g->tC),
                 g->epi == FL_GEMM_EPI_BIAS ? "+bias" : g->epi == FL_GEMM_EPI_BIAS_GELU ? "+bias+gelu" : "");
        fprintf(f, "    %6d %6d %6d %2d %2d %-24s %8.0f %10.3f", g->M, g->N, g->K, g->ta, g->tb, ty, g->calls * k, g->ms * k);
        const double fl = 2.0 * g->M * g->N * (double)g->K;
        if (g->ms > 0) fprintf(f, " %10.2f", fl * g->calls / (g->ms * 1e-3) / 1e12);
        else if (refs) fprintf(f, " %10s", "-");
        if (refs && g->ref_best > 0)
            fprintf(f, " %10.2f %10.2f %6.1f%%", fl / (g->ref_best * 1e-3) / 1e12, fl / (g->ref_chosen * 1e-3) / 1e12,
                    g->ms > 0 ? 100.0 * g->ref_best * g->calls / g->ms : 0.0);
        fputc('\n', f);
    }
}

void fl_profiler_print(const fl_profiler *p, int steps, double step_ms, FILE *f) {
    const double k = steps > 0 ? 1.0 / steps : 1.0, tot = fl_profiler_total_ms(p) * k;
    fprintf(f, "profile (%s per op, ms per step over %d steps; the step's median %.2f ms):\n",
            p->orig.mark ? "markers on the device queue" : "host clock, synchronized", steps, step_ms);
    fprintf(f, "  %-22s %10s %7s %8s %10s\n", "group / op", "ms/step", "share", "calls", "TFLOP/s");
    for (int g = 0; g < FL_PROF_GROUPS; g++) {
        double gm = fl_profiler_group_ms(p, (fl_prof_group)g) * k, gf = fl_profiler_flops(p, (fl_prof_group)g) * k;
        long gc = fl_profiler_group_calls(p, (fl_prof_group)g);
        if (!gc) continue;
        fprintf(f, "  %-22s %10.3f %6.1f%% %8.0f", fl_prof_group_name((fl_prof_group)g), gm,
                step_ms > 0 ? 100.0 * gm / step_ms : 0.0, gc * k);
        if (gf > 0 && gm > 0) fprintf(f, " %10.2f", gf / (gm * 1e-3) / 1e12);
        fputc('\n', f);
        for (int i = 0; i < OP_COUNT; i++) {
            if (k_op_group[i] != (fl_prof_group)g || !p->calls[i]) continue;
            double om = p->ms[i] * k, of = p->flops[i] * k;
            fprintf(f, "    %-20s %10.3f %6.1f%% %8.0f", k_op_name[i], om, step_ms > 0 ? 100.0 * om / step_ms : 0.0,
                    p->calls[i] * k);
            if (of > 0 && om > 0) fprintf(f, " %10.2f", of / (om * 1e-3) / 1e12);
            fputc('\n', f);
        }
    }
    fprintf(f, "  %-22s %10.3f %6.1f%%   (the rest of the step: host work and gaps between ops)\n", "sum of ops", tot,
            step_ms > 0 ? 100.0 * tot / step_ms : 0.0);
    gemm_shape_table(p, k, f);
    fprintf(f, "PROFILE");
    static const char *const key[FL_PROF_GROUPS] = {"gemm", "attn", "norm", "elem", "loss", "optim", "copy"};
    for (int g = 0; g < FL_PROF_GROUPS; g++) fprintf(f, " %s_ms=%.3f", key[g], fl_profiler_group_ms(p, (fl_prof_group)g) * k);
    fprintf(f, " sum_ms=%.3f step_ms=%.3f\n", tot, step_ms);
}
