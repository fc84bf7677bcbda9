/* RoPE, SGD, the loss-scaling inf/NaN check, 16-bit gradient accumulation, the deterministic sum
 * of squares (gradient norm), add / scale / bias: semantics of the backend ops of the same names
 * (fitllm/backend.h), the CPU backend's formulas and operation order. */
#include <math.h>
#include <string.h>

#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

FL_CU_DEV float fl_cu_ld(const void *p, int t, size_t i) {
    if (t == FL_F32) return ((const float *)p)[i];
    if (t == FL_BF16) return fl_cu_bf16_to_f32(((const uint16_t *)p)[i]);
    return fl_cu_f16_to_f32(((const uint16_t *)p)[i]);
}
FL_CU_DEV void fl_cu_st(void *p, int t, size_t i, float v) {
    if (t == FL_F32) ((float *)p)[i] = v;
    else if (t == FL_BF16) ((uint16_t *)p)[i] = fl_cu_f32_to_bf16(v);
    else ((uint16_t *)p)[i] = fl_cu_f32_to_f16(v);
}
static unsigned ew_grid(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b > 1024 ? 1024 : b ? b : 1);
}
static int is_float(fl_dtype t) { return t == FL_F32 || t == FL_BF16 || t == FL_F16; }
#define FL_CU_GRID_STRIDE(i, n)                                                                   \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

/* ---- RoPE: one thread per (row, head, pair j); sign +1 forward, -1 backward (the transpose) --------
 * x16 (rope_forward16 / rope_backward16): the rows are contiguous, `width` floats each, and every element of
 * them is stored in bf16, with its exact widening left in x (keep, the forward: fl_cu_keep16) or x unrounded
 * (the backward's dy16 copy): a thread per rotated pair, then one per element past the nh heads. The rows are read
 * from in and written to x (in place: x == in); x NULL: the bf16 copy only (issue 30 item 1: an fp32 result nothing
 * reads), the same bits in x16. in NULL too (the backward over cuDNN's bf16 gradients, attention_backward_b16): the
 * rotated pairs read from x16 (widened exactly) and written back there, the columns past them left as they are. */
FL_CU_DEV float rope16(uint16_t *r16, size_t c, float v, int keep) {
    if (keep || !r16) return fl_cu_keep16(r16, c, v);
    r16[c] = fl_cu_f32_to_bf16(v);
    return v;
}
FL_CU_DEV void rope_put(float *row, uint16_t *r16, size_t c, float v, int keep) {
    v = rope16(r16, c, v, keep);
    if (row) row[c] = v;
}
FL_CU_DEV float rope_in(const float *rin, const uint16_t *r16, size_t c) {
    return rin ? rin[c] : fl_cu_bf16_to_f32(r16[c]);
}
/* A block per row (n = b * T + t), its threads over the row's rotated pairs (h, j) and then its stored-only columns:
 * consecutive threads take consecutive j (coalesced reads of x[h*HD + j] and x[h*HD + j + H]), the indices are 32-bit
 * within the row (a grid-stride loop over B*T*items paid 64-bit divisions per element); each element's arithmetic is
 * the same as before, so the same bits. */
__global__ static void fl_cu_rope_k(float *x, const float *in, uint16_t *x16, int T, int nh, int HD, size_t row_stride,
                                    int width, const float *cos_t, const float *sin_t, int pos0, float sign, int keep) {
    const int H = HD / 2, pairs = nh * H, items = pairs + (x16 && in ? width - nh * HD : 0);
    const size_t n = blockIdx.x;
    const int t = (int)(n % (size_t)T);
    const float *rin = in ? in + n * row_stride : NULL;
    float *row = x ? x + n * row_stride : NULL;
    uint16_t *r16 = x16 ? x16 + n * (size_t)width : NULL;
    const float *ct = cos_t + (size_t)(pos0 + t) * H, *st = sin_t + (size_t)(pos0 + t) * H;
    for (int r = threadIdx.x; r < items; r += blockDim.x) {
        if (r >= pairs) { /* past the rotated heads: stored only */
            const size_t c = (size_t)nh * HD + (size_t)(r - pairs);
            rope_put(row, r16, c, rin[c], keep);
            continue;
        }
        const int h = r / H, j = r - h * H;
        float c = ct[j], sn = sign * st[j];
        const size_t o = (size_t)h * HD;
        float x0 = rope_in(rin, r16, o + j), x1 = rope_in(rin, r16, o + j + H);
        rope_put(row, r16, o + j, x0 * c - x1 * sn, keep);
        rope_put(row, r16, o + j + H, x1 * c + x0 * sn, keep);
    }
}
/* threads per row block: the row's items rounded up to a warp, at most 256 */
static unsigned rope_threads(size_t items) {
    size_t t = (items + 31) / 32 * 32;
    return (unsigned)(t > 256 ? 256 : t ? t : 32);
}

extern "C" int FL_CUK(rope)(float *x, int B, int T, int nh, int HD, size_t row_stride, const float *cos_t,
                            const float *sin_t, int pos0, int backward, void *stream) {
    size_t total = (size_t)B * T * nh * (HD / 2);
    if (total == 0) return 0;
    FL_CU_LAUNCH(fl_cu_rope_k, dim3((unsigned)((size_t)B * T)), dim3(rope_threads((size_t)nh * (HD / 2))), 0,
                 (fl_cu_stream)stream, x, (const float *)x, (uint16_t *)NULL, T, nh, HD, row_stride, 0, cos_t, sin_t,
                 pos0, backward ? -1.0f : 1.0f, 1);
    return fl_cu_launch_error();
}

/* out (NULL: x16 only, then required) and x16 (NULL or) from the rows of x; in place: out == x; the backward with x
 * and out NULL: x16 in place */
static int rope16_launch(float *out, void *x16, const float *x, int B, int T, int nh, int HD, int width,
                         const float *cos_t, const float *sin_t, int pos0, int backward, void *stream) {
    if (B < 0 || T < 0 || nh < 0 || HD < 0 || HD % 2 || width < nh * HD) return -1;
    const size_t items = (size_t)nh * (HD / 2) + (x ? (size_t)(width - nh * HD) : 0), total = (size_t)B * T * items;
    if (total == 0) return 0;
    if (x ? !out && !x16 : !backward || out || !x16) return -1;
    FL_CU_LAUNCH(fl_cu_rope_k, dim3((unsigned)((size_t)B * T)), dim3(rope_threads(items)), 0, (fl_cu_stream)stream,
                 out, x, (uint16_t *)x16, T, nh, HD, (size_t)width, width, cos_t, sin_t, pos0,
                 backward ? -1.0f : 1.0f, !backward);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(rope_forward16)(float *out, void *x16, const float *x, int B, int T, int nh, int HD, int width,
                                      const float *cos_t, const float *sin_t, int pos0, void *stream) {
    return rope16_launch(out, x16, x, B, T, nh, HD, width, cos_t, sin_t, pos0, 0, stream);
}
extern "C" int FL_CUK(rope_backward16)(float *dout, void *dx16, const float *dx, int B, int T, int nh, int HD,
                                       int width, const float *cos_t, const float *sin_t, int pos0, void *stream) {
    return rope16_launch(dout, dx16, dx, B, T, nh, HD, width, cos_t, sin_t, pos0, 1, stream);
}

/* ---- SGD (torch.optim.SGD), any storage dtype as sgd_update_ex ----------------------------------- */
typedef struct {
    float lr, momentum, dampening, weight_decay, grad_scale;
    int nesterov, first_step, use_mom;
} fl_cu_sgd_c;
/* one element: the new parameter; *b the momentum buffer's value in (not read on the first step) and out */
FL_CU_DEV float sgd_one(float pi, float gi, float *b, const fl_cu_sgd_c &c) {
    float d = gi * c.grad_scale + c.weight_decay * pi;
    if (c.use_mom) {
        *b = c.first_step ? d : c.momentum * *b + (1.0f - c.dampening) * d;
        d = c.nesterov ? d + c.momentum * *b : *b;
    }
    return pi - c.lr * d;
}
/* vec (every pointer 16-byte aligned): groups of 8 with 128-bit accesses, then the tail; the same bits */
FL_CU_DEV void fl_cu_sgd_body(void *p, int tp, const void *g, int tg, void *buf, int ts, size_t n, const fl_cu_sgd_c &c,
                               int vec) {
    const size_t S = (size_t)gridDim.x * blockDim.x, t0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int rb = c.use_mom && !c.first_step; /* the buffer is read */
    size_t i0 = 0;
    if (vec) {
        for (size_t q = t0; q < n / 8; q += S) {
            float pv[8], gv[8], bv[8] = {0};
            fl_cu_ld8t(p, tp, 8 * q, pv);
            fl_cu_ld8t(g, tg, 8 * q, gv);
            if (rb) fl_cu_ld8t(buf, ts, 8 * q, bv);
            for (int k = 0; k < 8; k++) pv[k] = sgd_one(pv[k], gv[k], &bv[k], c);
            if (c.use_mom) fl_cu_st8t(buf, ts, 8 * q, bv);
            fl_cu_st8t(p, tp, 8 * q, pv);
        }
        i0 = n / 8 * 8;
    }
    for (size_t i = i0 + t0; i < n; i += S) {
        float b = rb ? fl_cu_ld(buf, ts, i) : 0.0f;
        const float pn = sgd_one(fl_cu_ld(p, tp, i), fl_cu_ld(g, tg, i), &b, c);
        if (c.use_mom) fl_cu_st(buf, ts, i, b);
        fl_cu_st(p, tp, i, pn);
    }
}

__global__ static void fl_cu_sgd_k(void *p, int tp, const void *g, int tg, void *buf, int ts, size_t n, fl_cu_sgd_c c,
                                   int vec) {
    fl_cu_sgd_body(p, tp, g, tg, buf, ts, n, c, vec);
}
static fl_cu_sgd_c sgd_consts(float lr, float momentum, float dampening, float weight_decay, int nesterov,
                              int first_step, float grad_scale, const void *buf) {
    fl_cu_sgd_c c;
    c.lr = lr, c.momentum = momentum, c.dampening = dampening, c.weight_decay = weight_decay, c.grad_scale = grad_scale;
    c.nesterov = nesterov, c.first_step = first_step, c.use_mom = momentum != 0.0f && buf != NULL;
    return c;
}

extern "C" int FL_CUK(sgd_update_ex)(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf, fl_dtype ts, size_t n,
                                     float lr, float momentum, float dampening, float weight_decay, int nesterov,
                                     int first_step, float grad_scale, void *stream) {
    if (!is_float(tp) || !is_float(tg) || (ts != FL_F32 && ts != FL_BF16)) return -1;
    if (n == 0) return 0;
    fl_cu_sgd_c c = sgd_consts(lr, momentum, dampening, weight_decay, nesterov, first_step, grad_scale, buf);
    const int vec = fl_cu_aligned16(p, g, c.use_mom ? buf : NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_sgd_k, dim3(ew_grid(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, p, (int)tp, g,
                 (int)tg, buf, (int)ts, n, c, vec);
    return fl_cu_launch_error();
}

__global__ static void fl_cu_sgd_ks(void *p, int tp, const void *g, int tg, void *buf, int ts, size_t n, fl_cu_sgd_c c,
                                    const double *ss, int vec) {
    const double s = ss[1];
    if (s != s) return; /* the step's norm was not finite: nothing changes */
    c.grad_scale = (float)s;
    fl_cu_sgd_body(p, tp, g, tg, buf, ts, n, c, vec);
}

extern "C" int FL_CUK(sgd_update_ss)(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf, fl_dtype ts, size_t n,
                                     float lr, float momentum, float dampening, float weight_decay, int nesterov,
                                     int first_step, const double *ss, void *stream) {
    if (!is_float(tp) || !is_float(tg) || (ts != FL_F32 && ts != FL_BF16)) return -1;
    if (n == 0) return 0;
    fl_cu_sgd_c c = sgd_consts(lr, momentum, dampening, weight_decay, nesterov, first_step, 1.0f, buf);
    const int vec = fl_cu_aligned16(p, g, c.use_mom ? buf : NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_sgd_ks, dim3(ew_grid(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, p, (int)tp, g,
                 (int)tg, buf, (int)ts, n, c, ss, vec);
    return fl_cu_launch_error();
}

/* A CUDA graph's per-step slot (issue 30 item 5): sgd_update_ss's constants (learning rate, first step, ...) written
 * to host memory `out` (NULL: only the size), the update then reading them from the slot's device copy */
extern "C" size_t FL_CUK(sgd_consts)(void *out, float lr, float momentum, float dampening, float weight_decay,
                                     int nesterov, int first_step, int has_buf) {
    static const char some_buf = 1; /* sgd_consts asks only whether there is a momentum buffer */
    fl_cu_sgd_c c = sgd_consts(lr, momentum, dampening, weight_decay, nesterov, first_step, 1.0f,
                               has_buf ? (const void *)&some_buf : NULL);
    if (out) memcpy(out, &c, sizeof c);
    return sizeof c;
}

__global__ static void fl_cu_sgd_kds(void *p, int tp, const void *g, int tg, void *buf, int ts, size_t n,
                                     const fl_cu_sgd_c *cd, const double *ss, int vec) {
    const double s = ss[1];
    if (s != s) return;
    fl_cu_sgd_c c = *cd;
    c.grad_scale = (float)s;
    fl_cu_sgd_body(p, tp, g, tg, buf, ts, n, c, vec);
}

extern "C" int FL_CUK(sgd_update_dss)(void *p, fl_dtype tp, const void *g, fl_dtype tg, void *buf, fl_dtype ts,
                                      size_t n, const void *consts, int has_mom, const double *ss, void *stream) {
    if (!is_float(tp) || !is_float(tg) || (ts != FL_F32 && ts != FL_BF16)) return -1;
    if (n == 0) return 0;
    const int vec = fl_cu_aligned16(p, g, has_mom ? buf : NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_sgd_kds, dim3(ew_grid(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, p, (int)tp,
                 g, (int)tg, buf, (int)ts, n, (const fl_cu_sgd_c *)consts, ss, vec);
    return fl_cu_launch_error();
}

/* ---- check_finite: *found_inf = 1 when some x*inv_scale is inf/NaN (every writer writes 1) ---------- */
__global__ static void fl_cu_check_finite_k(const void *x, int t, size_t n, float inv_scale, int *found_inf) {
    FL_CU_GRID_STRIDE(i, n) {
        float y = fl_cu_ld(x, t, i) * inv_scale;
        if (y - y != 0.0f) *found_inf = 1;
    }
}

extern "C" int FL_CUK(check_finite)(const void *x, fl_dtype t, size_t n, float inv_scale, int *found_inf,
                                    void *stream) {
    if (!is_float(t)) return -1;
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_check_finite_k, dim3(ew_grid(n)), dim3(256), 0, (fl_cu_stream)stream, x, (int)t, n, inv_scale,
                 found_inf);
    return fl_cu_launch_error();
}

/* the step scalars' variant (backend.h check_finite_dev): the flag is ss[FL_CU_SS_FOUND], a double the step zeroed */
__global__ static void fl_cu_check_finite_ss_k(const void *x, int t, size_t n, float inv_scale, const float *dinv,
                                               double *ss) {
    if (dinv) inv_scale = *dinv; /* a CUDA graph's per-step slot */
    FL_CU_GRID_STRIDE(i, n) {
        float y = fl_cu_ld(x, t, i) * inv_scale;
        if (y - y != 0.0f) ss[FL_CU_SS_FOUND] = 1.0;
    }
}

extern "C" int FL_CUK(check_finite_ss)(const void *x, fl_dtype t, size_t n, float inv_scale, const float *dinv,
                                       double *ss, void *stream) {
    if (!is_float(t)) return -1;
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_check_finite_ss_k, dim3(ew_grid(n)), dim3(256), 0, (fl_cu_stream)stream, x, (int)t, n, inv_scale,
                 dinv, ss);
    return fl_cu_launch_error();
}

/* ---- accumulate16: dst = round(widen(dst) + src) ------------------------------------------------- */
__global__ static void fl_cu_accumulate16_k(uint16_t *dst, int t, const float *src, size_t n) {
    FL_CU_GRID_STRIDE(i, n) fl_cu_st(dst, t, i, fl_cu_ld(dst, t, i) + src[i]);
}

extern "C" int FL_CUK(accumulate16)(uint16_t *dst, fl_dtype t, const float *src, size_t n, void *stream) {
    if (t != FL_BF16 && t != FL_F16) return -1;
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_accumulate16_k, dim3(ew_grid(n)), dim3(256), 0, (fl_cu_stream)stream, dst, (int)t, src, n);
    return fl_cu_launch_error();
}

/* ---- sum of squares in double, deterministic: P contiguous ranges fixed by n (P = n / 2^16 within
 * [1, FL_CU_SUMSQ_PARTS]; range p = [n*p/P, n*(p+1)/P)), one block each (strided in the block, a fixed-order block sum), then one
 * block adds the partials in a fixed order. The same bits for any device; not the CPU's bits. ------ */
__global__ static void fl_cu_sumsq_part_k(double *part, const void *x, int t, size_t n) {
    __shared__ double buf[32];
    size_t P = gridDim.x, b = n * blockIdx.x / P, e = n * (blockIdx.x + 1) / P;
    double s = 0.0;
    size_t i = b + threadIdx.x, S = blockDim.x;
    for (; i + 3 * S < e; i += 4 * S) { /* four loads in flight; added in index order */
        double v0 = fl_cu_ld(x, t, i), v1 = fl_cu_ld(x, t, i + S), v2 = fl_cu_ld(x, t, i + 2 * S),
               v3 = fl_cu_ld(x, t, i + 3 * S);
        s += v0 * v0;
        s += v1 * v1;
        s += v2 * v2;
        s += v3 * v3;
    }
    for (; i < e; i += S) {
        double v = fl_cu_ld(x, t, i);
        s += v * v;
    }
    s = fl_cu_block_sum(s, buf);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

__global__ static void fl_cu_sumsq_total_k(double *out, const double *part, int P) {
    __shared__ double buf[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < P; i += blockDim.x) s += part[i];
    s = fl_cu_block_sum(s, buf);
    if (threadIdx.x == 0) *out = s;
}

extern "C" int FL_CUK(sumsq_ex)(double *out, double *work, const void *x, fl_dtype t, size_t n, void *stream) {
    if (!is_float(t)) return -1;
    /* P = n / 2^16 parts within [1, FL_CU_SUMSQ_PARTS]: a function of n alone (the same bits on any device) */
    size_t P = n >> 16;
    P = P < 1 ? 1 : P > FL_CU_SUMSQ_PARTS ? FL_CU_SUMSQ_PARTS : P;
    FL_CU_LAUNCH(fl_cu_sumsq_part_k, dim3((unsigned)P), dim3(256), 0, (fl_cu_stream)stream, work, x, (int)t, n);
    FL_CU_LAUNCH(fl_cu_sumsq_total_k, dim3(1), dim3(256), 0, (fl_cu_stream)stream, out, work, (int)P);
    return fl_cu_launch_error();
}

/* ---- the step scalars (backend.h grad_norm_dev / loss_sum_dev): one adding thread each, double arithmetic as
 * fl_optim_step's and fl_lm_sum_losses' on the host (no contraction: each product is rounded before the next
 * operation), so the norm, the clip scale and the loss sums have the host's bits ------------------------------ */
__global__ static void fl_cu_clip_scale_k(double *ss, const double *sq, float max_norm, float scale,
                                          const float *dscale, int n_loss) {
    if (threadIdx.x || blockIdx.x) return;
    if (dscale) scale = *dscale; /* a CUDA graph's per-step slot */
    const double norm = sqrt(*sq) * (double)scale;
    float s = scale;
    int bad = norm - norm != 0.0 || ss[FL_CU_SS_FOUND] != 0.0; /* fp16's overflow flag (check_finite_ss) */
    for (int k = 0; k < n_loss; k++) bad |= ss[FL_CU_SS_LOSS + k] - ss[FL_CU_SS_LOSS + k] != 0.0;
    if (bad) {
        ss[1] = NAN; /* inf/NaN gradients or losses, an overflow: the update is skipped, the host says so when it reads */
    } else {
        if (max_norm > 0.0f) {
            const double c = (double)max_norm / (norm + 1e-6);
            if (c < 1.0) s = (float)(c * (double)s);
        }
        ss[1] = (double)s;
    }
    ss[0] = norm;
}
extern "C" int FL_CUK(clip_scale)(double *ss, const double *sq, float max_norm, float scale, const float *dscale,
                                  int n_loss, void *stream) {
    FL_CU_LAUNCH(fl_cu_clip_scale_k, dim3(1), dim3(32), 0, (fl_cu_stream)stream, ss, sq, max_norm, scale, dscale,
                 n_loss);
    return fl_cu_launch_error();
}
/* in index order, added by one thread: the host's order. The block loads each chunk of 1024 losses into shared
 * memory first (coalesced, every load in flight at once), so thread 0's chain of double adds reads shared memory
 * only (a TinyLlama micro-batch's 8192 losses: tens of microseconds, not one global-memory latency per loss). */
#define FL_CU_LOSS_CHUNK 1024
__global__ static void fl_cu_loss_sum_k(double *acc, const float *loss, const int32_t *targets, int N, int ignore) {
    __shared__ float buf[FL_CU_LOSS_CHUNK];
    __shared__ unsigned char valid[FL_CU_LOSS_CHUNK];
    double s = threadIdx.x == 0 ? *acc : 0.0;
    for (int c0 = 0; c0 < N; c0 += FL_CU_LOSS_CHUNK) {
        const int n = N - c0 < FL_CU_LOSS_CHUNK ? N - c0 : FL_CU_LOSS_CHUNK;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            valid[i] = targets[c0 + i] != ignore;
            buf[i] = loss[c0 + i];
        }
        __syncthreads();
        if (threadIdx.x == 0)
            for (int i = 0; i < n; i++)
                if (valid[i]) s += buf[i];
        __syncthreads();
    }
    if (threadIdx.x == 0) *acc = s;
}
extern "C" int FL_CUK(loss_sum)(double *acc, const float *loss, const int32_t *targets, int N, int ignore_index,
                                void *stream) {
    if (N <= 0) return 0;
    FL_CU_LAUNCH(fl_cu_loss_sum_k, dim3(1), dim3(256), 0, (fl_cu_stream)stream, acc, loss, targets, N, ignore_index);
    return fl_cu_launch_error();
}

/* ---- add, scale, bias ---------------------------------------------------------------------------- */
/* o16 (add16): the sum stored in bf16 too, out its exact widening (NULL: o16 alone). b of type bt: F32, or BF16
 * (add16_b16: the residual operand read as stored, its exact widening). vec (every pointer 16-byte aligned): the first
 * n / 8 groups of 8 with 128-bit accesses, then the tail (< 8) one by one; the same bits either way. */
FL_CU_DEV float elem_t(const void *p, int t, size_t i) {
    return t == (int)FL_F32 ? ((const float *)p)[i] : fl_cu_bf16_to_f32(((const uint16_t *)p)[i]);
}
__global__ static void fl_cu_add_k(float *out, uint16_t *o16, const float *a, const void *b, int bt, size_t n,
                                   int vec) {
    const size_t S = (size_t)gridDim.x * blockDim.x, t0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t i0 = 0;
    if (vec) {
        for (size_t q = t0; q < n / 8; q += S) {
            float x[8], y[8];
            fl_cu_ld8t(b, bt, 8 * q, y);
            if (a) {
                fl_cu_ld8t(a, FL_F32, 8 * q, x);
                for (int k = 0; k < 8; k++) x[k] = x[k] + y[k];
            } else {
                for (int k = 0; k < 8; k++) x[k] = y[k];
            }
            fl_cu_keep16x8(o16, 8 * q, x);
            if (out) fl_cu_st8t(out, FL_F32, 8 * q, x);
        }
        i0 = n / 8 * 8;
    }
    for (size_t i = i0 + t0; i < n; i += S) fl_cu_put16(out, o16, i, a ? a[i] + elem_t(b, bt, i) : elem_t(b, bt, i));
}
static int add_launch(float *out, uint16_t *o16, const float *a, const void *b, fl_dtype bt, size_t n, void *stream) {
    if (!n) return fl_cu_launch_error();
#if FL_CU_EMULATED
    fl_cu_emu_norm_add_launches++;
#endif
    const int vec = fl_cu_aligned16(out, o16, a, b, NULL);
    FL_CU_LAUNCH(fl_cu_add_k, dim3(ew_grid(vec ? (n + 7) / 8 : n)), dim3(256), 0, (fl_cu_stream)stream, out, o16, a, b,
                 (int)bt, n, vec);
    return fl_cu_launch_error();
}
__global__ static void fl_cu_scale_k(float *x, size_t n, float s) {
    FL_CU_GRID_STRIDE(i, n) x[i] *= s;
}
__global__ static void fl_cu_bias_fwd_k(float *y, const float *b, int N, int OC) {
    FL_CU_GRID_STRIDE(i, (size_t)N * OC) y[i] += b[i % OC];
}
/* a bf16 bias (a bf16 model's stored one): each element widened exactly, then bias_forward's fp32 add */
__global__ static void fl_cu_bias_fwd16_k(float *y, const uint16_t *b, int N, int OC) {
    FL_CU_GRID_STRIDE(i, (size_t)N * OC) y[i] += fl_cu_bf16_to_f32(b[i % OC]);
}

extern "C" int FL_CUK(add)(float *out, const float *a, const float *b, size_t n, void *stream) {
    return add_launch(out, NULL, a, b, FL_F32, n, stream);
}
extern "C" int FL_CUK(add16)(float *out, void *out16, const float *a, const float *b, size_t n, void *stream) {
    return add_launch(out, (uint16_t *)out16, a, b, FL_F32, n, stream);
}
/* backend.h's add_norm_forward16_b16 without a norm: out (NULL or) and out16 = a + widen(b16); a NULL (out16 == b16,
 * the stored sum a GEMM wrote: gemm_res16): out = widen(b16) alone, the stored rows not written again */
extern "C" int FL_CUK(add16_b16)(float *out, void *out16, const float *a, const void *b16, size_t n, void *stream) {
    if (!out16 || !b16 || (!a && (!out || out16 != b16))) return -1;
    return add_launch(out, a ? (uint16_t *)out16 : NULL, a, b16, FL_BF16, n, stream);
}
extern "C" int FL_CUK(scale)(float *x, size_t n, float s, void *stream) {
    if (n) FL_CU_LAUNCH(fl_cu_scale_k, dim3(ew_grid(n)), dim3(256), 0, (fl_cu_stream)stream, x, n, s);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(bias_forward)(float *y, const float *b, int N, int OC, void *stream) {
    if (N > 0 && OC > 0)
        FL_CU_LAUNCH(fl_cu_bias_fwd_k, dim3(ew_grid((size_t)N * OC)), dim3(256), 0, (fl_cu_stream)stream, y, b, N, OC);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(bias_forward_t)(float *y, const void *b, fl_dtype bt, int N, int OC, void *stream) {
    if (bt == FL_F32) return FL_CUK(bias_forward)(y, (const float *)b, N, OC, stream);
    if (bt != FL_BF16) return -1;
    if (N > 0 && OC > 0)
        FL_CU_LAUNCH(fl_cu_bias_fwd16_k, dim3(ew_grid((size_t)N * OC)), dim3(256), 0, (fl_cu_stream)stream, y,
                     (const uint16_t *)b, N, OC);
    return fl_cu_launch_error();
}
/* bias_backward: a column sum, kernels/norm.cu (fl_cu_colsum_k) */
