/* SwiGLU (LLaMA, fused gate/up rows) and the tanh GELU (GPT-2 "gelu_new"), forward and backward,
 * the CPU backend's formulas (act.c: GELU through sigmoid(2u), no 1 + tanh cancellation).
 * Elementwise, grid-stride. */
#include "backend/cuda/cu_compat.h"
#include "backend/cuda/cu_kernels.h"

#define FL_CU_GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define FL_CU_GELU_A 0.044715f

FL_CU_DEV float fl_cu_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ static void fl_cu_swiglu_fwd_k(float *out, const float *gu, int N, int F) {
    size_t total = (size_t)N * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t n = i / F, f = i % F;
        float g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
        out[i] = g * fl_cu_sigmoidf(g) * u;
    }
}

__global__ static void fl_cu_swiglu_bwd_k(float *dgu, const float *dout, const float *gu, int N, int F) {
    size_t total = (size_t)N * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t n = i / F, f = i % F;
        float g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f], d = dout[i], sg = fl_cu_sigmoidf(g);
        dgu[n * 2 * F + f] += d * u * sg * (1.0f + g * (1.0f - sg));
        dgu[n * 2 * F + F + f] += d * g * sg;
    }
}

__global__ static void fl_cu_gelu_fwd_k(float *out, const float *inp, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = inp[i], u = FL_CU_GELU_K * (x + FL_CU_GELU_A * x * x * x);
        out[i] = x * fl_cu_sigmoidf(2.0f * u);
    }
}

__global__ static void fl_cu_gelu_bwd_k(float *dinp, const float *dout, const float *inp, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = inp[i], u = FL_CU_GELU_K * (x + FL_CU_GELU_A * x * x * x), sg = fl_cu_sigmoidf(2.0f * u);
        float g = sg + 2.0f * x * sg * (1.0f - sg) * FL_CU_GELU_K * (1.0f + 3.0f * FL_CU_GELU_A * x * x);
        dinp[i] += g * dout[i];
    }
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
        float x = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f], t = FL_CU_GELU_K * (x + FL_CU_GELU_A * x * x * x);
        out[i] = x * fl_cu_sigmoidf(2.0f * t) * u;
    }
}

__global__ static void fl_cu_geglu_bwd_k(float *dgu, const float *dout, const float *gu, int N, int F) {
    size_t total = (size_t)N * F;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t n = i / F, f = i % F;
        float x = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f], d = dout[i];
        float t = FL_CU_GELU_K * (x + FL_CU_GELU_A * x * x * x), sg = fl_cu_sigmoidf(2.0f * t);
        float dg = sg + 2.0f * x * sg * (1.0f - sg) * FL_CU_GELU_K * (1.0f + 3.0f * FL_CU_GELU_A * x * x);
        dgu[n * 2 * F + f] += d * u * dg;
        dgu[n * 2 * F + F + f] += d * x * sg;
    }
}

static unsigned act_blocks(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b > 1024 ? 1024 : b ? b : 1);
}

extern "C" int FL_CUK(swiglu_forward)(float *out, const float *gu, int N, int F, void *stream) {
    if (N <= 0 || F <= 0) return 0;
    FL_CU_LAUNCH(fl_cu_swiglu_fwd_k, dim3(act_blocks((size_t)N * F)), dim3(256), 0, (fl_cu_stream)stream, out, gu, N, F);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(swiglu_backward)(float *dgu, const float *dout, const float *gu, int N, int F, void *stream) {
    if (N <= 0 || F <= 0) return 0;
    FL_CU_LAUNCH(fl_cu_swiglu_bwd_k, dim3(act_blocks((size_t)N * F)), dim3(256), 0, (fl_cu_stream)stream, dgu, dout, gu,
                 N, F);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(gelu_forward)(float *out, const float *inp, size_t n, void *stream) {
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_gelu_fwd_k, dim3(act_blocks(n)), dim3(256), 0, (fl_cu_stream)stream, out, inp, n);
    return fl_cu_launch_error();
}
extern "C" int FL_CUK(gelu_backward)(float *dinp, const float *dout, const float *inp, size_t n, void *stream) {
    if (n == 0) return 0;
    FL_CU_LAUNCH(fl_cu_gelu_bwd_k, dim3(act_blocks(n)), dim3(256), 0, (fl_cu_stream)stream, dinp, dout, inp, n);
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
