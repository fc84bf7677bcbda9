/* Activations: SwiGLU on the fused gate/up projection (LLaMA) and the tanh
 * GELU (GPT-2 "gelu_new"). Elementwise, parallel over rows / elements. The
 * exp/tanh come from the vectorizable helpers in cpu-impl.h. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_A 0.044715f

void fl_cpu_swiglu_forward(const fl_backend *be, float *out /*(N,F)*/, const float *gu /*(N,2F)*/, int N, int F) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F, *u = g + F; // (F) gate, (F) up
        float *o = out + (size_t)n * F;
#pragma omp simd
        for (int i = 0; i < F; i++) o[i] = g[i] * fl_cpu_sigmoidf(g[i]) * u[i];
    }
}

void fl_cpu_swiglu_backward(const fl_backend *be, float *dgu /*(N,2F)*/, const float *dout /*(N,F)*/,
                            const float *gu /*(N,2F)*/, int N, int F) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * F, *u = g + F;
        const float *d = dout + (size_t)n * F;
        float *dg = dgu + (size_t)n * 2 * F, *du = dg + F;
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
#pragma omp parallel for simd num_threads(be->n_threads) schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_A * x * x * x);
        out[i] = 0.5f * x * (1.0f + fl_cpu_tanhf(u));
    }
}

void fl_cpu_gelu_backward(const fl_backend *be, float *dinp /*(n)*/, const float *dout /*(n)*/,
                          const float *inp /*(n)*/, size_t n) {
#pragma omp parallel for simd num_threads(be->n_threads) schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_A * x * x * x);
        float th = fl_cpu_tanhf(u);
        float sech2 = 1.0f - th * th;
        float g = 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * GELU_A * x * x);
        dinp[i] += g * dout[i];
    }
}
