/* Fused softmax cross-entropy over the vocabulary.
 *
 * One pass over each row in CHUNK-sized pieces keeps an online max m and sum
 * s = sum exp(x - m) (rescaled when m grows), so the (N,V) logits are read once
 * for the loss and once more for the gradient, never materializing a softmax.
 * Rows are independent: parallel over rows, deterministic. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

#define CHUNK 512

void fl_cpu_cross_entropy(const fl_backend *be, float *loss /*(N)*/, float *dlogits /*(N,V) or NULL*/,
                          const float *logits /*(N,V)*/, const int32_t *targets /*(N)*/, int N, int V,
                          float grad_scale, int ignore_index) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((size_t)N * V >= FL_CPU_PAR_MIN)
    for (int n = 0; n < N; n++) {
        const float *x = logits + (size_t)n * V;
        float *dx = dlogits ? dlogits + (size_t)n * V : NULL;
        int tgt = targets[n];
        if (tgt == ignore_index) {
            loss[n] = 0.0f;
            if (dx) memset(dx, 0, (size_t)V * sizeof(float));
            continue;
        }
        float m = -INFINITY;
        double s = 0.0; /* across chunks in double: V up to ~256k */
        for (int v0 = 0; v0 < V; v0 += CHUNK) {
            int v1 = v0 + CHUNK < V ? v0 + CHUNK : V;
            float cm = -INFINITY;
            /* FL_VECTORIZE: xent_max */
#pragma omp simd reduction(max : cm)
            for (int v = v0; v < v1; v++) cm = x[v] > cm ? x[v] : cm;
            if (cm > m) {
                s *= (double)fl_cpu_expf(m - cm); /* m = -inf first: s is 0 anyway */
                m = cm;
            }
            float cs = 0.0f;
            /* FL_VECTORIZE: xent_exp_sum */
#pragma omp simd reduction(+ : cs)
            for (int v = v0; v < v1; v++) cs += fl_cpu_expf(x[v] - m);
            s += cs;
        }
        float lse = m + (float)log(s);
        float xt = x[tgt]; /* read before dlogits (which may alias) overwrites it */
        loss[n] = lse - xt;
        if (dx) {
            /* FL_VECTORIZE: xent_softmax_grad */
#pragma omp simd
            for (int v = 0; v < V; v++) dx[v] = grad_scale * fl_cpu_expf(x[v] - lse);
            dx[tgt] -= grad_scale;
        }
    }
}
