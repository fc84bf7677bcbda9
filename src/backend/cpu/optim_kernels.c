/* Optimizer updates, elementwise over flat parameter ranges (parallel, and
 * deterministic since every element is independent).
 *
 * Built with -fno-math-errno (sqrtf then vectorizes; it is correctly rounded
 * either way) and -ffp-contract=off (CMakeLists.txt): every operation is
 * rounded as written, so the vector loops give the same bits as the scalar
 * code, on every -march. tests/check_vectorized.sh checks both loops vectorize. */
#include <math.h>
#include <omp.h>

#include "backend/cpu/cpu-impl.h"

void fl_cpu_adamw_f32(const fl_backend *be, float *p /*(n)*/, const float *g /*(n)*/, float *m /*(n)*/,
                      float *v /*(n)*/, size_t n, float lr, float beta1, float beta2, float eps,
                         float weight_decay, int step, float grad_scale) {
    /* torch.optim.AdamW (single-tensor path):
     *   p *= 1 - lr*wd; m.lerp_(g, 1-b1); v = b2 v + (1-b2) g^2;
     *   denom = sqrt(v) / sqrt(1 - b2^t) + eps; p -= lr / (1 - b1^t) * m / denom.
     * Bias corrections in double (torch computes them as Python floats). */
    double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
    float step_size = (float)(lr / bc1), bc2_sqrt = (float)sqrt(bc2);
    float decay = 1.0f - lr * weight_decay, w1 = 1.0f - beta1, w2 = 1.0f - beta2;
    /* FL_VECTORIZE: adamw */
#pragma omp parallel for simd num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * grad_scale;
        float pi = p[i] * decay;
        float mi = m[i] + w1 * (gi - m[i]); /* lerp: same as b1 m + (1-b1) g up to rounding */
        float vi = beta2 * v[i] + w2 * gi * gi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi - step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}

void fl_cpu_sgd_f32(const fl_backend *be, float *p /*(n)*/, const float *g /*(n)*/, float *buf /*(n) or NULL*/,
                    size_t n, float lr, float momentum, float dampening, float weight_decay, int nesterov,
                       int first_step, float grad_scale) {
    /* torch.optim.SGD: d = g + wd p; buf = first ? d : mom buf + (1-damp) d;
     * d = nesterov ? d + mom buf : buf; p -= lr d. */
    int use_mom = momentum != 0.0f && buf != NULL;
    /* No `simd` here: gcc unswitches the loop on the loop-invariant flags, and
     * the copies of an `omp simd` loop stay scalar; plain auto-vectorization
     * vectorizes every copy. */
    /* FL_VECTORIZE: sgd */
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n >= FL_CPU_PAR_MIN)
    for (size_t i = 0; i < n; i++) {
        float d = g[i] * grad_scale + weight_decay * p[i];
        if (use_mom) {
            float b = first_step ? d : momentum * buf[i] + (1.0f - dampening) * d;
            buf[i] = b;
            d = nesterov ? d + momentum * b : b;
        }
        p[i] -= lr * d;
    }
}
