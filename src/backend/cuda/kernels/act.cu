/* SwiGLU (LLaMA, fused gate/up rows) and the tanh GELU (GPT-2 "gelu_new"), forward and backward,
 * the CPU backend's formulas (act.c: GELU through sigmoid(2u), no 1 + tanh cancellation).
 * Elementwise, grid-stride; SwiGLU and GELU with 128-bit loads and stores where the widths and pointers allow
 * (issue 30 item 4: the same bits as one element per thread). */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

#define FL_CU_GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define FL_CU_GELU_A 0.044715f

FL_CU_DEV float fl_cu_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The per-element formulas (one place: the scalar and the 128-bit paths give the same bits). */
FL_CU_DEV float swiglu_f(float g, float u) { return g * fl_cu_sigmoidf(g) * u; }
FL_CU_DEV void swiglu_b(float g, float u, float d, float *dg, float *du) {
    float sg = fl_cu_sigmoidf(g);
    *dg += d * u * sg * (1.0f + g * (1.0f - sg));
    *du += d * g * sg;
}
FL_CU_DEV float gelu_f(float x) {
    float u = FL_CU_GELU_K * (x + FL_CU_GELU_A * x * x * x);
    return x * fl_cu_sigmoidf(2.0f * u);
}
FL_CU_DEV float gelu_grad(float x) {
    float u = FL_CU_GELU_K * (x + FL_CU_GELU_A * x * x * x), sg = fl_cu_sigmoidf(2.0f * u);
    return sg + 2.0f * x * sg * (1.0f - sg) * FL_CU_GELU_K * (1.0f + 3.0f * FL_CU_GELU_A * x * x);
}
/* GEGLU (T5 v1.1) of a gate / lin pair: gelu_tanh(gate) * lin, and its backward's updates */
FL_CU_DEV float geglu_f(float x, float u) {
    const float t = FL_CU_GELU_K * (x + FL_CU_GELU_A * x * x * x);
    return x * fl_cu_sigmoidf(2.0f * t) * u;
}
FL_CU_DEV void geglu_b(float x, float u, float d, float *dg, float *du) {
    const float t = FL_CU_GELU_K * (x + FL_CU_GELU_A * x * x * x), sg = fl_cu_sigmoidf(2.0f * t);
    const float dgl = sg + 2.0f * x * sg * (1.0f - sg) * FL_CU_GELU_K * (1.0f + 3.0f * FL_CU_GELU_A * x * x);
    *dg += d * u * dgl;
    *du += d * x * sg;
}
/* the paired kinds ([gate | up] rows of 2F in, F out) of act_forward16 / act_backward16 */
FL_CU_DEV float pair_f(int kind, float g, float u) { return kind == FL_CU_ACT16_GEGLU ? geglu_f(g, u) : swiglu_f(g, u); }
FL_CU_DEV void pair_b(int kind, float g, float u, float d, float *dg, float *du) {
    if (kind == FL_CU_ACT16_GEGLU) geglu_b(g, u, d, dg, du);
    else swiglu_b(g, u, d, dg, du);
}
static inline __host__ __device__ int paired(int kind) { return kind == FL_CU_ACT16_SWIGLU || kind == FL_CU_ACT16_GEGLU; }

/* SwiGLU over (N, 2F) [gate | up] rows. vec (F % 4 == 0, the pointers 16-byte aligned): a thread takes 4
 * consecutive columns with 128-bit loads and stores; else one element. Grid-stride either way. */
__global__ static void fl_cu_swiglu_fwd_k(float *out, const float *gu, int N, int F, int vec) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const size_t F4 = (size_t)F / 4, total = (size_t)N * F4;
        for (size_t q = (size_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += stride) {
            size_t n = q / F4, f = 4 * (q % F4);
            float g[4], u[4], o[4];
            fl_cu_ld4(gu + n * 2 * F + f, g);
            fl_cu_ld4(gu + n * 2 * F + F + f, u);
            for (int k = 0; k < 4; k++) o[k] = swiglu_f(g[k], u[k]);
            fl_cu_st4(out + n * F + f, o);
        }
        return;
    }
    size_t total = (size_t)N * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        size_t n = i / F, f = i % F;
        out[i] = swiglu_f(gu[n * 2 * F + f], gu[n * 2 * F + F + f]);
    }
}

__global__ static void fl_cu_swiglu_bwd_k(float *dgu, const float *dout, const float *gu, int N, int F, int vec) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        const size_t F4 = (size_t)F / 4, total = (size_t)N * F4;
        for (size_t q = (size_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += stride) {
            size_t n = q / F4, f = 4 * (q % F4);
            float g[4], u[4], d[4], dg[4], du[4];
            fl_cu_ld4(gu + n * 2 * F + f, g);
            fl_cu_ld4(gu + n * 2 * F + F + f, u);
            fl_cu_ld4(dout + n * F + f, d);
            fl_cu_ld4(dgu + n * 2 * F + f, dg);
            fl_cu_ld4(dgu + n * 2 * F + F + f, du);
            for (int k = 0; k < 4; k++) swiglu_b(g[k], u[k], d[k], &dg[k], &du[k]);
            fl_cu_st4(dgu + n * 2 * F + f, dg);
            fl_cu_st4(dgu + n * 2 * F + F + f, du);
        }
        return;
    }
    size_t total = (size_t)N * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        size_t n = i / F, f = i % F;
        swiglu_b(gu[n * 2 * F + f], gu[n * 2 * F + F + f], dout[i], &dgu[n * 2 * F + f], &dgu[n * 2 * F + F + f]);
    }
}

/* GELU over n elements: vec (the pointers 16-byte aligned): the first n / 4 quads with 128-bit accesses,
 * then the tail (< 4) one by one. */
__global__ static void fl_cu_gelu_fwd_k(float *out, const float *inp, size_t n, int vec) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, t0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t i0 = 0;
    if (vec) {
        for (size_t q = t0; q < n / 4; q += stride) {
            float x[4];
            fl_cu_ld4(inp + 4 * q, x);
            for (int k = 0; k < 4; k++) x[k] = gelu_f(x[k]);
            fl_cu_st4(out + 4 * q, x);
        }
        i0 = n / 4 * 4;
    }
    for (size_t i = i0 + t0; i < n; i += stride) out[i] = gelu_f(inp[i]);
}

__global__ static void fl_cu_gelu_bwd_k(float *dinp, const float *dout, const float *inp, size_t n, int vec) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, t0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t i0 = 0;
    if (vec) {
        for (size_t q = t0; q < n / 4; q += stride) {
            float x[4], d[4], g[4];
            fl_cu_ld4(inp + 4 * q, x);
            fl_cu_ld4(dout + 4 * q, d);
            fl_cu_ld4(dinp + 4 * q, g);
            for (int k = 0; k < 4; k++) g[k] += gelu_grad(x[k]) * d[k];
            fl_cu_st4(dinp + 4 * q, g);
        }
        i0 = n / 4 * 4;
    }
    for (size_t i = i0 + t0; i < n; i += stride) dinp[i] += gelu_grad(inp[i]) * dout[i];
}

/* ReLU (OPT), the CPU backend's rules: a NaN passes, no gradient at 0 (threshold_backward) */
__global__ static void fl_cu_relu_fwd_k(float *out, const float *inp, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = inp[i] < 0.0f ? 0.0f : inp[i];
}

__global__ static void fl_cu_relu_bwd_k(float *dinp, const float *dout, const float *inp, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dinp[i] += inp[i] <= 0.0f ? 0.0f : dout[i];
}

/* The exact GELU (transformers' "gelu"), the CPU backend's formulas */
__global__ static void fl_cu_gelu_erf_fwd_k(float *out, const float *inp, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = inp[i] * 0.5f * (1.0f + erff(inp[i] * 0.70710678118654752f));
}

__global__ static void fl_cu_gelu_erf_bwd_k(float *dinp, const float *dout, const float *inp, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float x = inp[i], cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
        dinp[i] += dout[i] * (cdf + x * expf(-0.5f * x * x) * 0.39894228040143268f);
    }
}

/* GEGLU (T5 v1.1) on the fused [gate | lin] rows: gelu_tanh(gate) * lin, the CPU backend's formulas */
__global__ static void fl_cu_geglu_fwd_k(float *out, const float *gu, int N, int F) {
    size_t total = (size_t)N * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t n = i / F, f = i % F;
        out[i] = geglu_f(gu[n * 2 * F + f], gu[n * 2 * F + F + f]);
    }
}

__global__ static void fl_cu_geglu_bwd_k(float *dgu, const float *dout, const float *gu, int N, int F) {
    size_t total = (size_t)N * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t n = i / F, f = i % F, ig = n * 2 * F + f, iu = ig + F;
        float dg = dgu[ig], du = dgu[iu];
        geglu_b(gu[ig], gu[iu], dout[i], &dg, &du);
        dgu[ig] = dg;
        dgu[iu] = du;
    }
}

static unsigned act_blocks(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b > 1024 ? 1024 : b ? b : 1);
}

extern "C" int FL_CUK(swiglu_forward)(float *out, const float *gu, int N, int F, void *stream) {
    if (N <= 0 || F <= 0) return 0;
    const int vec = F % 4 == 0 && fl_cu_aligned16(out, gu, NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_swiglu_fwd_k, dim3(act_blocks((size_t)N * F / (vec ? 4 : 1))), dim3(256), 0, (fl_cu_stream)stream,
                 out, gu, N, F, vec);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(swiglu_backward)(float *dgu, const float *dout, const float *gu, int N, int F, void *stream) {
    if (N <= 0 || F <= 0) return 0;
    const int vec = F % 4 == 0 && fl_cu_aligned16(dgu, dout, gu, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_swiglu_bwd_k, dim3(act_blocks((size_t)N * F / (vec ? 4 : 1))), dim3(256), 0, (fl_cu_stream)stream,
                 dgu, dout, gu, N, F, vec);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(gelu_forward)(float *out, const float *inp, size_t n, void *stream) {
    if (n == 0) return 0;
    const int vec = fl_cu_aligned16(out, inp, NULL, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_gelu_fwd_k, dim3(act_blocks(vec ? (n + 3) / 4 : n)), dim3(256), 0, (fl_cu_stream)stream, out, inp,
                 n, vec);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(gelu_backward)(float *dinp, const float *dout, const float *inp, size_t n, void *stream) {
    if (n == 0) return 0;
    const int vec = fl_cu_aligned16(dinp, dout, inp, NULL, NULL);
    FL_CU_LAUNCH(fl_cu_gelu_bwd_k, dim3(act_blocks(vec ? (n + 3) / 4 : n)), dim3(256), 0, (fl_cu_stream)stream, dinp,
                 dout, inp, n, vec);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(relu_forward)(float *out, const float *inp, size_t n, void *stream) {
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_relu_fwd_k, dim3(act_blocks(n)), dim3(256), 0, (fl_cu_stream)stream, out, inp, n);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(relu_backward)(float *dinp, const float *dout, const float *inp, size_t n, void *stream) {
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_relu_bwd_k, dim3(act_blocks(n)), dim3(256), 0, (fl_cu_stream)stream, dinp, dout, inp, n);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(gelu_erf_forward)(float *out, const float *inp, size_t n, void *stream) {
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_gelu_erf_fwd_k, dim3(act_blocks(n)), dim3(256), 0, (fl_cu_stream)stream, out, inp, n);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(gelu_erf_backward)(float *dinp, const float *dout, const float *inp, size_t n, void *stream) {
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_gelu_erf_bwd_k, dim3(act_blocks(n)), dim3(256), 0, (fl_cu_stream)stream, dinp, dout, inp, n);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(geglu_forward)(float *out, const float *gu, int N, int F, void *stream) {
    if (N <= 0 || F <= 0) return 0;
    FL_CU_LAUNCH(fl_cu_geglu_fwd_k, dim3(act_blocks((size_t)N * F)), dim3(256), 0, (fl_cu_stream)stream, out, gu, N, F);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(geglu_backward)(float *dgu, const float *dout, const float *gu, int N, int F, void *stream) {
    if (N <= 0 || F <= 0) return 0;
    FL_CU_LAUNCH(fl_cu_geglu_bwd_k, dim3(act_blocks((size_t)N * F)), dim3(256), 0, (fl_cu_stream)stream, dgu, dout, gu,
                 N, F);
    return fl_cu_launch_error();
}

/* ---- bf16-stored outputs (act_forward16, issue 30 item 1) -------------------------------------------------
 * The forward's value as above, stored in bf16 (o16) with its exact widening in the fp32 out (fl_cu_keep16:
 * round16's bits, no round16 launch). in16 (NULL or): the input's bf16 copy, read instead of in, whose exact
 * widening is written to in (the fp32 view of an input a GEMM wrote in bf16 only; in NULL: not written). out NULL: the
 * bf16 copy only (a stored slot's fp32 view nothing reads, issue 30 item 1). One element (SwiGLU: one
 * output and its gate/up pair) per thread. */
/* rnd (FL_CU_ACT16_ROUND_IN): in16 is written, RNE(in), and in its widening (round16's bits), then read */
FL_CU_DEV float act_in(float *in, const uint16_t *in16, size_t i, int rnd) {
    if (!in16) return in[i];
    if (rnd) ((uint16_t *)in16)[i] = fl_cu_f32_to_bf16(in[i]);
    const float v = fl_cu_bf16_to_f32(in16[i]);
    if (in) in[i] = v; /* NULL: an fp32 view nothing reads (issue 30 item 1) */
    return v;
}
/* 8 inputs from element i (vector path): from in16 (their widening written to in) or in */
FL_CU_DEV void act_in8(float *in, const uint16_t *in16, size_t i, float *v, int rnd) {
    if (!in16) {
        fl_cu_ld8t(in, FL_F32, i, v);
        return;
    }
    if (rnd) {
        fl_cu_ld8t(in, FL_F32, i, v);
        fl_cu_st8t((uint16_t *)in16, FL_BF16, i, v);
    }
    fl_cu_ld8t(in16, FL_BF16, i, v);
    if (in) fl_cu_st8t(in, FL_F32, i, v);
}
/* The vector path (vec: every pointer 16-byte aligned, and F % 8 == 0 for SwiGLU): 8 consecutive outputs per thread
 * with 128-bit accesses (SwiGLU: within a row; the others: the first total / 8 groups, then the tail below). Returns
 * the first element the scalar loop takes. */
FL_CU_DEV size_t act16_fwd8(int kind, float *out, uint16_t *o16, float *in, const uint16_t *in16, int N, int F,
                            int rnd) {
    const size_t S = (size_t)gridDim.x * blockDim.x, t0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t total = (size_t)N * F, F8 = (size_t)F / 8;
    if (paired(kind)) {
        fl_cu_rowcol rc = fl_cu_rc_start(t0, S, F8);
        for (size_t q = t0; q < (size_t)N * F8; q += S, fl_cu_rc_next(rc)) {
            const size_t n = rc.n, f = 8 * rc.c;
            float g[8], u[8];
            act_in8(in, in16, n * 2 * F + f, g, rnd);
            act_in8(in, in16, n * 2 * F + F + f, u, rnd);
            for (int k = 0; k < 8; k++) g[k] = pair_f(kind, g[k], u[k]);
            fl_cu_keep16x8(o16, n * F + f, g);
            if (out) fl_cu_st8t(out, FL_F32, n * F + f, g);
        }
        return total;
    }
    for (size_t q = t0; q < total / 8; q += S) {
        float x[8];
        act_in8(in, in16, 8 * q, x, rnd);
        for (int k = 0; k < 8; k++) x[k] = kind == FL_CU_ACT16_GELU ? gelu_f(x[k]) : x[k] < 0.0f ? 0.0f : x[k];
        fl_cu_keep16x8(o16, 8 * q, x);
        if (out) fl_cu_st8t(out, FL_F32, 8 * q, x);
    }
    return total / 8 * 8;
}
__global__ static void fl_cu_act16_k(int kind, float *out, uint16_t *o16, float *in, const uint16_t *in16, int N,
                                     int F, int vec, int rnd) {
    const size_t total = (size_t)N * F, i0 = vec ? act16_fwd8(kind, out, o16, in, in16, N, F, rnd) : 0;
    for (size_t i = i0 + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        float y;
        if (paired(kind)) {
            const size_t n = i / F, f = i % F;
            y = pair_f(kind, act_in(in, in16, n * 2 * F + f, rnd), act_in(in, in16, n * 2 * F + F + f, rnd));
        } else {
            const float x = act_in(in, in16, i, rnd);
            y = kind == FL_CU_ACT16_GELU ? gelu_f(x) : x < 0.0f ? 0.0f : x;
        }
        fl_cu_put16(out, o16, i, y);
    }
}

/* kind | FL_CU_ACT16_ROUND_IN (in16 required): in16 = RNE(in), in its widening, then as with a given in16 */
extern "C" int FL_CUK(act_forward16)(int kind, float *out, void *out16, float *in, const void *in16, int N, int F,
                                     void *stream) {
    const int rnd = (kind & FL_CU_ACT16_ROUND_IN) != 0;
    kind &= ~FL_CU_ACT16_ROUND_IN;
    if ((!paired(kind) && kind != FL_CU_ACT16_GELU && kind != FL_CU_ACT16_RELU) || (rnd && !in16)) return -1;
    /* out NULL: out16 only; in NULL: read from in16 (not rounded here), its fp32 view not filled (issue 30 item 1) */
    if ((!out && !out16) || (!in && (!in16 || rnd))) return -1;
    if (N <= 0 || F <= 0) return 0;
    const int vec = (!paired(kind) || F % 8 == 0) && fl_cu_aligned16(out, out16, in, in16, NULL);
    FL_CU_LAUNCH(fl_cu_act16_k, dim3(act_blocks((size_t)N * F / (vec ? 8 : 1))), dim3(256), 0, (fl_cu_stream)stream,
                 kind, out, (uint16_t *)out16, in, (const uint16_t *)in16, N, F, vec, rnd);
    return fl_cu_launch_error();
}

/* act_backward16: the fp32 backward's update of din (the same formulas, one element (SwiGLU: one gate/up pair)
 * per thread), then a bf16 copy of the result in d16 (NULL: none; the next LINEAR's dy operand), din not rounded.
 * din NULL (d16 then required): the update of a zero din, its bf16 copy alone (issue 30 item 1: an fp32 gradient
 * nothing reads; the bits of the full path over a zeroed din).
 * in16 (NULL or): the input read in bf16 (a bf16 run's stored activation, widened exactly in the kernel: the bits
 * of the fp32 kernel over its widening, without the widen launch before the backward) */
FL_CU_DEV float act_x(const float *in, const uint16_t *in16, size_t i) {
    return in16 ? fl_cu_bf16_to_f32(in16[i]) : in[i];
}
/* the updated gradient v of element i: into din (NULL: not written) and its bf16 copy into d16 (NULL: none) */
FL_CU_DEV void act_dput(float *din, uint16_t *d16, size_t i, float v) {
    if (din) din[i] = v;
    if (d16) d16[i] = fl_cu_f32_to_bf16(v);
}
/* 8 gradients from element i of din, or 8 zeros (din NULL) */
FL_CU_DEV void act_din8(const float *din, size_t i, float *v) {
    if (din) fl_cu_ld8t(din, FL_F32, i, v);
    else
        for (int k = 0; k < 8; k++) v[k] = 0.0f;
}
/* the vector path of the backward (as act16_fwd8's); d16 gets the 8 updated gradients rounded, din not */
FL_CU_DEV void act_x8(const float *in, const uint16_t *in16, size_t i, float *v) {
    if (in16) fl_cu_ld8t(in16, FL_BF16, i, v);
    else fl_cu_ld8t(in, FL_F32, i, v);
}
FL_CU_DEV size_t act16_bwd8(int kind, float *din, uint16_t *d16, const float *dout, const float *in,
                            const uint16_t *in16, int N, int F) {
    const size_t S = (size_t)gridDim.x * blockDim.x, t0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t total = (size_t)N * F, F8 = (size_t)F / 8;
    if (paired(kind)) {
        fl_cu_rowcol rc = fl_cu_rc_start(t0, S, F8);
        for (size_t q = t0; q < (size_t)N * F8; q += S, fl_cu_rc_next(rc)) {
            const size_t n = rc.n, f = 8 * rc.c, ig = n * 2 * F + f, iu = ig + F;
            float g[8], u[8], d[8], dg[8], du[8];
            act_x8(in, in16, ig, g);
            act_x8(in, in16, iu, u);
            fl_cu_ld8t(dout, FL_F32, n * F + f, d);
            act_din8(din, ig, dg);
            act_din8(din, iu, du);
            for (int k = 0; k < 8; k++) pair_b(kind, g[k], u[k], d[k], &dg[k], &du[k]);
            if (din) fl_cu_st8t(din, FL_F32, ig, dg), fl_cu_st8t(din, FL_F32, iu, du);
            if (d16) fl_cu_st8t(d16, FL_BF16, ig, dg), fl_cu_st8t(d16, FL_BF16, iu, du);
        }
        return total;
    }
    for (size_t q = t0; q < total / 8; q += S) {
        float x[8], d[8], g[8];
        act_x8(in, in16, 8 * q, x);
        fl_cu_ld8t(dout, FL_F32, 8 * q, d);
        act_din8(din, 8 * q, g);
        for (int k = 0; k < 8; k++) {
            if (kind == FL_CU_ACT16_GELU) g[k] += gelu_grad(x[k]) * d[k];
            else g[k] += x[k] <= 0.0f ? 0.0f : d[k];
        }
        if (din) fl_cu_st8t(din, FL_F32, 8 * q, g);
        if (d16) fl_cu_st8t(d16, FL_BF16, 8 * q, g);
    }
    return total / 8 * 8;
}
__global__ static void fl_cu_act16_bwd_k(int kind, float *din, uint16_t *d16, const float *dout, const float *in,
                                         const uint16_t *in16, int N, int F, int vec) {
    const size_t total = (size_t)N * F, i0 = vec ? act16_bwd8(kind, din, d16, dout, in, in16, N, F) : 0;
    for (size_t i = i0 + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        if (paired(kind)) {
            const size_t n = i / F, f = i % F, ig = n * 2 * F + f, iu = ig + F;
            float dg = din ? din[ig] : 0.0f, du = din ? din[iu] : 0.0f;
            pair_b(kind, act_x(in, in16, ig), act_x(in, in16, iu), dout[i], &dg, &du);
            act_dput(din, d16, ig, dg);
            act_dput(din, d16, iu, du);
        } else {
            const float x = act_x(in, in16, i);
            float g = din ? din[i] : 0.0f;
            if (kind == FL_CU_ACT16_GELU) g += gelu_grad(x) * dout[i];
            else g += x <= 0.0f ? 0.0f : dout[i];
            act_dput(din, d16, i, g);
        }
    }
}

extern "C" int FL_CUK(act_backward16)(int kind, float *din, void *din16, const float *dout, const float *in,
                                      const void *in16, int N, int F, void *stream) {
    if ((!paired(kind) && kind != FL_CU_ACT16_GELU && kind != FL_CU_ACT16_RELU) || (!din16 && !in16)) return -1;
    if (N <= 0 || F <= 0) return 0;
    if ((!din && !din16) || !dout || (!in && !in16)) return -1; /* no output, or an input missing */
    const int vec = (!paired(kind) || F % 8 == 0) && fl_cu_aligned16(din, din16, dout, in16 ? NULL : in, in16);
    FL_CU_LAUNCH(fl_cu_act16_bwd_k, dim3(act_blocks((size_t)N * F / (vec ? 8 : 1))), dim3(256), 0,
                 (fl_cu_stream)stream, kind, din, (uint16_t *)din16, dout, in, (const uint16_t *)in16, N, F, vec);
    return fl_cu_launch_error();
}
