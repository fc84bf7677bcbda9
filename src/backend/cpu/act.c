/* Activations: SwiGLU on the fused gate/up projection (LLaMA) and the tanh
 * GELU (GPT-2 "gelu_new"), evaluated through sigmoid(2u) = (1 + tanh u)/2.
 * Elementwise, parallel over rows / elements; the sigmoid comes from the
 * vectorizable exp in cpu-impl.h. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_A 0.044715f

void fl_cpu_swiglu_forward(const fl_backend *be, float *out /*(N,F)*/, const float *gu /*(N,2F)*/, int N, int F) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * F >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F, *u = g + F; // (F) gate, (F) up
        float *o = out + (size_t)n * F;
        /* FL_VECTORIZE: swiglu_fwd */
#pragma omp simd
        for (int i = 0; i < F; i++) o[i] = g[i] * fl_cpu_sigmoidf(g[i]) * u[i];
    }
}

void fl_cpu_swiglu_backward(const fl_backend *be, float *dgu /*(N,2F)*/, const float *dout /*(N,F)*/,
                            const float *gu /*(N,2F)*/, int N, int F) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * F >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F, *u = g + F;
        const float *d = dout + (size_t)n * F;
        float *dg = dgu + (size_t)n * 2 * F, *du = dg + F;
        /* FL_VECTORIZE: swiglu_bwd */
#pragma omp simd
        for (int i = 0; i < F; i++) {
            float sg = fl_cpu_sigmoidf(g[i]);
            /* d silu/dg = sig + g sig (1 - sig) */
            dg[i] += d[i] * u[i] * sg * (1.0f + g[i] * (1.0f - sg));
            du[i] += d[i] * g[i] * sg;
        }
    }
}

void fl_cpu_gelu_forward(const fl_backend *be, float *out /*(n)*/, const float *inp /*(n)*/, size_t n) {
    /* FL_VECTORIZE: gelu_fwd */
#pragma omp parallel for simd num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_A * x * x * x);
        /* 0.5 (1 + tanh u) == sigmoid(2u): same value, but without the
         * cancellation of 1 + tanh(u) near -1 (large negative x). */
        out[i] = x * fl_cpu_sigmoidf(2.0f * u);
    }
}

/* The exact GELU in float as PyTorch's CPU kernel writes it: x * 0.5 * (1 + erf(x * M_SQRT1_2)); backward with
 * the normal density, exp(-x^2 / 2) / sqrt(2 pi). */
void fl_cpu_gelu_erf_forward(const fl_backend *be, float *out /*(n)*/, const float *inp /*(n)*/, size_t n) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) out[i] = inp[i] * 0.5f * (1.0f + erff(inp[i] * 0.70710678118654752f));
}

void fl_cpu_gelu_erf_backward(const fl_backend *be, float *dinp /*(n)*/, const float *dout /*(n)*/,
                              const float *inp /*(n)*/, size_t n) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        const float x = inp[i], cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
        const float pdf = expf(-0.5f * x * x) * 0.39894228040143268f;
        dinp[i] += dout[i] * (cdf + x * pdf);
    }
}

void fl_cpu_relu_forward(const fl_backend *be, float *out /*(n)*/, const float *inp /*(n)*/, size_t n) {
    /* FL_VECTORIZE: relu_fwd */
#pragma omp parallel for simd num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) out[i] = inp[i] < 0.0f ? 0.0f : inp[i]; /* a NaN stays NaN, as in torch */
}

void fl_cpu_relu_backward(const fl_backend *be, float *dinp /*(n)*/, const float *dout /*(n)*/, const float *inp /*(n)*/,
                          size_t n) {
    /* FL_VECTORIZE: relu_bwd */
#pragma omp parallel for simd num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        const float d = dout[i]; /* loaded unconditionally: a select, not a branch (generic builds vectorize it) */
        dinp[i] += inp[i] <= 0.0f ? 0.0f : d; /* threshold_backward's rule */
    }
}

void fl_cpu_gelu_backward(const fl_backend *be, float *dinp /*(n)*/, const float *dout /*(n)*/,
                          const float *inp /*(n)*/, size_t n) {
    /* FL_VECTORIZE: gelu_bwd */
#pragma omp parallel for simd num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_A * x * x * x);
        /* with sg = sigmoid(2u) = (1 + tanh u)/2:  1 - tanh^2 u = 4 sg (1 - sg), so
         * d/dx = sg + 0.5 x (1 - tanh^2 u) K (1 + 3 A x^2) = sg + 2 x sg (1 - sg) K (1 + 3 A x^2). */
        float sg = fl_cpu_sigmoidf(2.0f * u);
        float g = sg + 2.0f * x * sg * (1.0f - sg) * GELU_K * (1.0f + 3.0f * GELU_A * x * x);
        dinp[i] += g * dout[i];
    }
}

/* GEGLU on the fused [gate (F) | lin (F)] rows (T5 v1.1): out = gelu_tanh(gate) * lin, the GELU as
 * gelu_forward's (x sigmoid(2u)); backward: d gate += dout lin gelu'(gate), d lin += dout gelu(gate). */
void fl_cpu_geglu_forward(const fl_backend *be, float *out /*(N,F)*/, const float *gu /*(N,2F)*/, int N, int F) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * F >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F, *u = g + F;
        float *o = out + (size_t)n * F;
        /* FL_VECTORIZE: geglu_fwd */
#pragma omp simd
        for (int i = 0; i < F; i++) {
            float x = g[i], t = GELU_K * (x + GELU_A * x * x * x);
            o[i] = x * fl_cpu_sigmoidf(2.0f * t) * u[i];
        }
    }
}

void fl_cpu_geglu_backward(const fl_backend *be, float *dgu /*(N,2F)*/, const float *dout /*(N,F)*/,
                           const float *gu /*(N,2F)*/, int N, int F) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * F >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F, *u = g + F;
        const float *d = dout + (size_t)n * F;
        float *dg = dgu + (size_t)n * 2 * F, *du = dg + F;
        /* FL_VECTORIZE: geglu_bwd */
#pragma omp simd
        for (int i = 0; i < F; i++) {
            float x = g[i], t = GELU_K * (x + GELU_A * x * x * x), sg = fl_cpu_sigmoidf(2.0f * t);
            float dgelu = sg + 2.0f * x * sg * (1.0f - sg) * GELU_K * (1.0f + 3.0f * GELU_A * x * x);
            dg[i] += d[i] * u[i] * dgelu;
            du[i] += d[i] * x * sg;
        }
    }
}
